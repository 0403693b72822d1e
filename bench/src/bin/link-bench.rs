//! The message link's cost per message against a raw socket (issue 24), in one run.
//!
//! Two links of a two-node cluster (real certificates, real sockets on loopback) play
//! ping-pong: the main thread posts a message to `b`, whose link thread echoes it back from its
//! handler, and `a`'s link thread hands the echo to the main thread. The baseline does the same
//! with plain TCP sockets and the same threads: an echo thread on `b`'s side, a reader thread
//! on `a`'s side handing each message to the main thread. Both count the process's CPU time
//! (user + system, `getrusage`) over the whole run, so the figure includes every thread's
//! wake-ups, and divide it by the messages sent (two per round trip).
//!
//! A second baseline gives each direction a plain TCP connection of its own, as the link does:
//! what a connection carrying both directions would save.
//!
//! Prints one CSV line per payload size: `size_bytes,link_rtt_p50_us,raw_rtt_p50_us,
//! link_cpu_us_per_msg,raw_cpu_us_per_msg,cpu_ratio,raw_one_way_rtt_p50_us,
//! raw_one_way_cpu_us_per_msg`.

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use psls_node::link::{Link, LinkHandler};
use psls_node::peer::PeerReq;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// CPU time (user + system) of the whole process so far, in µs.
fn cpu_us() -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a live, writable rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn p50(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Echoes every message back to its sender.
struct Echo(std::sync::OnceLock<Arc<Link>>);
impl LinkHandler for Echo {
    fn deliver(&self, from: &str, req: PeerReq, payload: Bytes) {
        if let Some(l) = self.0.get() {
            let _ = l.post(from, &req, payload);
        }
    }
}

/// Hands every message to the main thread.
struct Hand(mpsc::Sender<Bytes>);
impl LinkHandler for Hand {
    fn deliver(&self, _: &str, _: PeerReq, payload: Bytes) {
        let _ = self.0.send(payload);
    }
}

/// 100 warm-up round trips (handshakes, first allocations), then `rounds` timed ones: `send`
/// sends message `id`, and its echo of `size` bytes comes back on `rx`. (p50 RTT µs, CPU µs
/// per message of the whole process.)
fn ping_pong(
    size: usize,
    rounds: usize,
    rx: &mpsc::Receiver<Bytes>,
    mut send: impl FnMut(u64) -> Result<()>,
) -> Result<(f64, f64)> {
    let mut echo = |id: u64| -> Result<()> {
        send(id)?;
        let back = rx.recv_timeout(Duration::from_secs(10)).context("no echo in 10 s")?;
        if back.len() != size {
            bail!("echo of {} bytes, not {size}", back.len());
        }
        Ok(())
    };
    for id in 0..100 {
        echo(id)?;
    }
    let mut rtt = Vec::with_capacity(rounds);
    let cpu0 = cpu_us();
    for id in 0..rounds as u64 {
        let t = Instant::now();
        echo(id)?;
        rtt.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let cpu = (cpu_us() - cpu0) / (2 * rounds) as f64;
    Ok((p50(&mut rtt), cpu))
}

/// A loopback address with a port free for both TCP and UDP (at the time of asking).
fn free_addr() -> Result<SocketAddr> {
    for _ in 0..100 {
        let t = TcpListener::bind("127.0.0.1:0")?;
        let addr = t.local_addr()?;
        if std::net::UdpSocket::bind(addr).is_ok() {
            return Ok(addr);
        }
    }
    bail!("no free port")
}

/// Round trips over the link: (p50 RTT µs, CPU µs per message).
fn link_run(sizes: &[usize], rounds: usize) -> Result<Vec<(f64, f64)>> {
    let dir = tempfile::tempdir()?;
    let names = ["a".to_string(), "b".to_string()];
    psls_ipc::certs::generate(dir.path(), "bench", &names)?;
    let (aaddr, baddr) = (free_addr()?, free_addr()?);
    let b = Arc::new(Link::for_node(
        dir.path(),
        "b",
        baddr,
        [("a".to_string(), aaddr)].into(),
        names.to_vec(),
    )?);
    let a = Arc::new(Link::for_node(
        dir.path(),
        "a",
        aaddr,
        [("b".to_string(), baddr)].into(),
        names.to_vec(),
    )?);
    let echo = Arc::new(Echo(std::sync::OnceLock::new()));
    let _ = echo.0.set(b.clone());
    let (tx, rx) = mpsc::channel();
    let (a2, b2) = (a.clone(), b.clone());
    let ta = std::thread::spawn(move || a2.run(Arc::new(Hand(tx))));
    let tb = std::thread::spawn(move || b2.run(echo));
    let mut out = Vec::new();
    for &size in sizes {
        let payload = Bytes::from(vec![7u8; size]);
        out.push(ping_pong(size, rounds, &rx, |id| {
            a.post("b", &PeerReq::LinkPing { id }, payload.clone())?;
            Ok(())
        })?);
    }
    a.close();
    b.close();
    let _ = ta.join();
    let _ = tb.join();
    Ok(out)
}

/// Round trips over plain TCP with the same threads: (p50 RTT µs, CPU µs per message). With
/// `one_way`, each direction has a connection of its own, as the link has: no acknowledgement
/// can ride on data going back.
fn raw_run(sizes: &[usize], rounds: usize, one_way: bool) -> Result<Vec<(f64, f64)>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut out = if one_way {
            let (o, _) = listener.accept()?;
            o.set_nodelay(true)?;
            o
        } else {
            s.try_clone()?
        };
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let mut len = [0u8; 4];
            if s.read_exact(&mut len).is_err() {
                return Ok(());
            }
            let n = u32::from_le_bytes(len) as usize;
            s.read_exact(&mut buf[..n])?;
            let mut msg = len.to_vec();
            msg.extend_from_slice(&buf[..n]);
            out.write_all(&msg)?;
        }
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut r = if one_way {
        let r = TcpStream::connect(addr)?;
        r.set_nodelay(true)?;
        r
    } else {
        s.try_clone()?
    };
    let r_close = r.try_clone()?;
    let (tx, rx) = mpsc::channel::<Bytes>();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let mut len = [0u8; 4];
            if r.read_exact(&mut len).is_err() {
                return;
            }
            let n = u32::from_le_bytes(len) as usize;
            if r.read_exact(&mut buf[..n]).is_err() {
                return;
            }
            let _ = tx.send(Bytes::copy_from_slice(&buf[..n]));
        }
    });
    let mut out = Vec::new();
    for &size in sizes {
        let mut msg = (size as u32).to_le_bytes().to_vec();
        msg.extend(std::iter::repeat_n(7u8, size));
        out.push(ping_pong(size, rounds, &rx, |_| Ok(s.write_all(&msg)?))?);
    }
    s.shutdown(std::net::Shutdown::Both)?;
    if one_way {
        r_close.shutdown(std::net::Shutdown::Both)?;
    }
    let _ = echo.join();
    let _ = reader.join();
    Ok(out)
}

/// CPU and round trip of a message on the link against plain TCP, in one process.
#[derive(clap::Parser)]
#[command(name = "link-bench", version, about)]
struct Args {
    /// Round trips per size (at least 100).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..))]
    rounds: u64,
    /// Message sizes in bytes, comma-separated (each at most 1 MiB).
    #[arg(long, value_delimiter = ',', default_values_t = [64, 4096], value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    sizes: Vec<u64>,
}

fn main() -> Result<()> {
    let a = <Args as clap::Parser>::parse();
    let rounds = a.rounds as usize;
    let sizes: Vec<usize> = a.sizes.iter().map(|&s| s as usize).collect();
    let link = link_run(&sizes, rounds)?;
    let raw = raw_run(&sizes, rounds, false)?;
    let one_way = raw_run(&sizes, rounds, true)?;
    println!("size_bytes,link_rtt_p50_us,raw_rtt_p50_us,link_cpu_us_per_msg,raw_cpu_us_per_msg,cpu_ratio,raw_one_way_rtt_p50_us,raw_one_way_cpu_us_per_msg");
    for (k, &size) in sizes.iter().enumerate() {
        let ((lr, lc), (rr, rc), (or, oc)) = (link[k], raw[k], one_way[k]);
        println!("{size},{lr:.1},{rr:.1},{lc:.2},{rc:.2},{:.2},{or:.1},{oc:.2}", lc / rc);
    }
    Ok(())
}
