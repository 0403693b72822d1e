//! Fault latency benchmark (issue #3), in one run on a local 4-node cluster:
//! - a read and a write fault on a page already on the node (another local process brought
//!   it there);
//! - a read fault on a page owned by another node;
//! - a write fault that must invalidate copies on 3 other nodes (and, for reference, one whose
//!   only other copy is the owner's);
//!
//! next to, measured in the same run: a bare userfaultfd round trip (a minimal in-process
//! handler resolving a memfd mapping's faults like the daemon does: pwrite, then
//! `UFFDIO_CONTINUE`) and 4 KiB round trips over the daemons' own transports: over the message
//! link (TCP with TLS), which the faults' messages travel on (the remote-fault target is set
//! against this one), and, for reference, a request and its response over the request
//! transport (QUIC).
//! Prints p50/p99 of each, the targets, and one JSON line. The measurements run in rounds
//! (default 5 of 1000 pages); each round's faults are set against that round's baselines and
//! the ratios reported are the medians over rounds. On this VM a fault round trip is bimodal,
//! about 12 µs or about 19 µs for a whole run of one process (whether the handler wakes on the
//! faulting thread's CPU or the other one), for the bare handlers and the daemon alike, so
//! single runs compare modes rather than handlers; rounds average that out, and a last part
//! measures the local faults and the bare handler with the placement fixed (both on one CPU,
//! then on two). For reference it also measures the bare handler in another process (as the
//! daemon serves its clients).
//!
//! Usage: `fault-bench [--pages N] [--rounds N]` (needs `psls-node` next to it; run as root on a machine
//! with /dev/userfaultfd).

use anyhow::{bail, Context, Result};
use psls_bench::median;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const PAGE: usize = 4096;

fn pct(v: &mut [u64], p: f64) -> f64 {
    v.sort_unstable();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)] as f64 / 1000.0
}

/// Child: map `file` on this process's node and touch (`read`/`write`) every page, or measure
/// (`mread`/`mwrite`) the first access to every other page; prints the latencies (ns) as JSON.
fn child(mode: &str, file: &str, pages: usize) -> Result<()> {
    let s = psls_client::Session::connect()?;
    let mut m = s.map(file, (pages * PAGE) as u64, true)?;
    let base = m.as_mut_slice::<u8>().as_mut_ptr();
    let mut lat = Vec::new();
    for i in 0..pages {
        // SAFETY: i < pages: the byte is inside the mapping.
        let p = unsafe { base.add(i * PAGE) };
        match mode {
            "read" => {
                // SAFETY: one volatile byte access inside the mapping.
                unsafe { std::ptr::read_volatile(p) };
            }
            // SAFETY: one volatile byte access inside the mapping.
            "write" => unsafe { std::ptr::write_volatile(p, i as u8) },
            "mread" | "mwrite" if i % 2 == 0 => {
                let t = Instant::now();
                if mode == "mread" {
                    // SAFETY: one volatile byte access inside the mapping.
                    unsafe { std::ptr::read_volatile(p) };
                } else {
                    // SAFETY: one volatile byte access inside the mapping.
                    unsafe { std::ptr::write_volatile(p, i as u8) };
                }
                lat.push(t.elapsed().as_nanos() as u64);
            }
            _ => {}
        }
    }
    println!("{}", serde_json::json!(lat));
    m.unmap()?;
    Ok(())
}

fn run_child(exe: &Path, cdir: &Path, node: &str, mode: &str, file: &str, pages: usize) -> Result<Vec<u64>> {
    let o = Command::new(exe)
        .args(["--child", mode, file, &pages.to_string()])
        .env("PSLS_HOME", cdir)
        .env("PSLS_NODE", node)
        .env_remove("PSLS_SOCKET")
        .output()?;
    if !o.status.success() {
        bail!("child {mode} on {node} failed: {}", String::from_utf8_lossy(&o.stderr));
    }
    let out = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(out.trim()).context("child output")
}

/// A minimal userfaultfd handler: `n` faults on a memfd mapping, each resolved by pwrite +
/// UFFDIO_CONTINUE from a handler thread (`other_process`: from a forked child process, as
/// the daemon serves its clients). Latency per fault (ns).
fn bare_uffd(n: usize, other_process: bool) -> Result<Vec<u64>> {
    bare_uffd_on(n, other_process, None)
}

/// [`bare_uffd`], with `pin` = (handler CPU, faulting CPU) if given.
fn bare_uffd_on(n: usize, other_process: bool, pin: Option<(usize, usize)>) -> Result<Vec<u64>> {
    let fd = nix::sys::memfd::memfd_create("bare", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
    let file = std::fs::File::from(fd);
    file.set_len((n * PAGE) as u64)?;
    // SAFETY: a fresh shared mapping of our own memfd.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if base == libc::MAP_FAILED {
        bail!("mmap failed");
    }
    let uffd = userfaultfd::UffdBuilder::new()
        .close_on_exec(true)
        .user_mode_only(false)
        .create()
        .context("userfaultfd")?;
    uffd.register_with_mode(
        base,
        n * PAGE,
        userfaultfd::RegisterMode::MISSING
            | userfaultfd::RegisterMode::MINOR
            | userfaultfd::RegisterMode::WRITE_PROTECT,
    )?;
    let b = base as usize;
    let (mut handler, mut child) = (None, None);
    if other_process {
        // SAFETY: this process runs no other thread here (the previous handler thread was
        // joined), so the child may use the allocator; it only serves faults and _exits.
        match unsafe { libc::fork() } {
            -1 => bail!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                if let Some((h, _)) = pin {
                    let _ = pin_thread(&[h]);
                }
                let code = i32::from(serve_bare(&uffd, &file, b, n).is_err());
                // SAFETY: ends the child at once, running nothing of the parent's.
                unsafe { libc::_exit(code) }
            }
            pid => child = Some(pid),
        }
    } else {
        handler = Some(std::thread::spawn(move || {
            if let Some((h, _)) = pin {
                pin_thread(&[h])?;
            }
            serve_bare(&uffd, &file, b, n)
        }));
    }
    let everywhere = all_cpus();
    if let Some((_, f)) = pin {
        pin_thread(&[f])?;
    }
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        // SAFETY: one byte inside the mapping.
        unsafe { std::ptr::read_volatile((b + i * PAGE) as *const u8) };
        lat.push(t.elapsed().as_nanos() as u64);
    }
    if pin.is_some() {
        pin_thread(&everywhere)?;
    }
    if let Some(h) = handler {
        h.join().map_err(|_| anyhow::anyhow!("handler panicked"))??;
    }
    if let Some(pid) = child {
        let mut status = 0;
        // SAFETY: waits for our own child, writing its status into a live int.
        if unsafe { libc::waitpid(pid, &mut status, 0) } != pid || status != 0 {
            bail!("the handler process failed (status {status:#x})");
        }
    }
    // SAFETY: unmaps the mapping made above; nothing uses it any more.
    unsafe { libc::munmap(base, n * PAGE) };
    Ok(lat)
}

/// The CPUs this process may run on.
fn all_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data (all zeros is the empty set); the call fills a live set
    // of the size given, for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Pins thread `tid` (0: the calling thread) to `cpus`.
fn pin_tid(tid: i32, cpus: &[usize]) -> Result<()> {
    // SAFETY: as in `all_cpus`; the set is built from CPU numbers below CPU_SETSIZE.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r != 0 {
        bail!("sched_setaffinity({tid}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

fn pin_thread(cpus: &[usize]) -> Result<()> {
    pin_tid(0, cpus)
}

/// Pins every thread of process `pid` to `cpus` (threads it starts later inherit the pin of
/// the thread that starts them).
fn pin_process(pid: u32, cpus: &[usize]) -> Result<()> {
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        if let Some(tid) = t?.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
            // A thread may end meanwhile.
            let _ = pin_tid(tid, cpus);
        }
    }
    Ok(())
}

/// Serves `n` faults of the mapping at `b`: pwrite the page into the memfd, then
/// UFFDIO_CONTINUE.
fn serve_bare(uffd: &userfaultfd::Uffd, file: &std::fs::File, b: usize, n: usize) -> Result<()> {
    let page = [7u8; PAGE];
    for _ in 0..n {
        let Some(userfaultfd::Event::Pagefault { addr, .. }) = uffd.read_event()? else {
            bail!("unexpected uffd event");
        };
        let a = addr as usize & !(PAGE - 1);
        file.write_all_at(&page, (a - b) as u64)?;
        #[repr(C)]
        struct Cont {
            start: u64,
            len: u64,
            mode: u64,
            mapped: i64,
        }
        let mut c = Cont {
            start: a as u64,
            len: PAGE as u64,
            mode: 0,
            mapped: 0,
        };
        // SAFETY: UFFDIO_CONTINUE on a struct with the kernel's layout, live for the call.
        let r = unsafe { libc::ioctl(uffd.as_raw_fd(), userfaultfd_sys::UFFDIO_CONTINUE as _, &mut c) };
        if r < 0 {
            bail!("UFFDIO_CONTINUE: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Page-fault latencies of PSLS against local and userfaultfd baselines, on a local cluster.
#[derive(clap::Parser)]
#[command(name = "fault-bench", version, about)]
struct Args {
    /// Pages faulted per kind and round (at least 2).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(2..))]
    pages: u64,
    /// Rounds.
    #[arg(long, default_value_t = 5, value_parser = psls_bench::positive)]
    rounds: usize,
}

fn main() -> Result<()> {
    // The benchmark runs a copy of itself as the faulting client (`--child`, not for users).
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("--child") {
        let pages = argv.get(4).context("pages")?.parse()?;
        return child(&argv[2], &argv[3], pages);
    }
    let a = <Args as clap::Parser>::parse();
    let (pages, rounds) = (a.pages as usize, a.rounds);
    let exe = std::env::current_exe()?;
    if !exe.with_file_name("psls-node").exists() {
        bail!(
            "psls-node not found next to {}: build the workspace first",
            exe.display()
        );
    }
    let tmp = tempfile::Builder::new().prefix("fault-bench").tempdir()?;
    let cdir = tmp.path().join("cluster");
    let port = 32000 + (std::process::id() % 2000) as u16 * 8;
    psls_client::cluster::init(&cdir, 4, 0, 1024, port, false)?;
    psls_client::cluster::up(&cdir, Duration::from_secs(60), true)?;
    let r = measure(&exe, &cdir, pages, rounds);
    let _ = psls_client::cluster::down(&cdir);
    r
}

/// One round: every kind of fault on fresh files (suffix `round`), with both baselines.
/// Per-kind latencies (ns) in the order of [`KINDS`].
fn round(exe: &Path, cdir: &Path, pages: usize, round: usize) -> Result<[Vec<u64>; 9]> {
    let f = |name: &str| format!("{name}-{round}");
    let bare = bare_uffd(pages, false)?;
    let bare_other = bare_uffd(pages, true)?;
    let quic = psls_client::cluster::connect(cdir, Some("n0"))?.peer_ping("n1", 4096, pages as u32, false)?;
    let link = psls_client::cluster::connect(cdir, Some("n0"))?.peer_ping("n1", 4096, pages as u32, true)?;
    // Local read: another process on n0 brought every page to n0 first.
    run_child(exe, cdir, "n0", "read", &f("fb-lr"), pages)?;
    let local_read = run_child(exe, cdir, "n0", "mread", &f("fb-lr"), pages)?;
    // Local write: n0 holds every page writable.
    run_child(exe, cdir, "n0", "write", &f("fb-lw"), pages)?;
    let local_write = run_child(exe, cdir, "n0", "mwrite", &f("fb-lw"), pages)?;
    // Remote read: n1 owns every page (wrote it); n0 reads.
    run_child(exe, cdir, "n1", "write", &f("fb-rr"), pages)?;
    let remote_read = run_child(exe, cdir, "n0", "mread", &f("fb-rr"), pages)?;
    // Write invalidating 3 nodes: n1 owns, n2 and n3 read copies; n0 writes.
    run_child(exe, cdir, "n1", "write", &f("fb-wi"), pages)?;
    run_child(exe, cdir, "n2", "read", &f("fb-wi"), pages)?;
    run_child(exe, cdir, "n3", "read", &f("fb-wi"), pages)?;
    let inval_write = run_child(exe, cdir, "n0", "mwrite", &f("fb-wi"), pages)?;
    // Reference: a write whose only other copy is the owner's (n1 wrote; n0 writes).
    run_child(exe, cdir, "n1", "write", &f("fb-rw"), pages)?;
    let remote_write = run_child(exe, cdir, "n0", "mwrite", &f("fb-rw"), pages)?;
    Ok([
        bare,
        quic,
        local_read,
        local_write,
        remote_read,
        inval_write,
        bare_other,
        link,
        remote_write,
    ])
}

const KINDS: [&str; 9] = [
    "bare_uffd",
    // The request transport: a request and its response (reference).
    "quic_4k_rtt",
    "local_read_fault",
    "local_write_fault",
    "remote_read_fault",
    "write_fault_invalidating_3",
    // Not a target's baseline: what the same handler costs from another process, as the
    // daemon serves its clients (the local-fault target compares with the in-process one).
    "bare_uffd_other_process",
    // The message link: a one-way message and its one-way answer, as faults' messages travel.
    "link_4k_rtt",
    // Not a target: a write whose only other copy is the owner's, the same three hops as the
    // invalidating write without the fan-out to two more holders (on 2 cores the holders
    // cannot all run at once; the difference is what the fan-out costs here).
    "remote_write_fault",
];

/// Local faults with the placement fixed. On this VM a fault round trip takes about 9 µs when
/// the handler wakes on the faulting thread's CPU and 15–20 µs when it wakes on another
/// (an inter-processor wake-up of an idle virtual CPU), for the bare handler and the daemon
/// alike, and where the scheduler puts a new pair is a coin flip that then sticks. So the
/// local faults and the bare handler are also measured with both pinned: handler (node
/// n0's daemon, every thread) on the first CPU, the faulting process on the same CPU or on
/// another. Per placement: p50s of each repetition, and the median of their ratios.
fn pinned(exe: &Path, cdir: &Path, pages: usize, reps: usize) -> Result<Option<serde_json::Value>> {
    let cpus = all_cpus();
    if cpus.len() < 2 {
        println!("Pinned placements: skipped (one CPU)");
        return Ok(None);
    }
    let st = psls_client::cluster::connect(cdir, Some("n0"))?.status()?;
    let Some(pid) = st.nodes.iter().find(|n| n.name == "n0").and_then(|n| n.pid) else {
        bail!("no pid for n0");
    };
    let mut out = serde_json::Map::new();
    println!(
        "Local faults with fixed placement (daemon n0 on CPU {}; p50 µs, ratio to bare):",
        cpus[0]
    );
    for (label, client) in [("same_cpu", cpus[0]), ("other_cpu", cpus[1])] {
        let (mut lr, mut lw, mut rb) = (Vec::new(), Vec::new(), Vec::new());
        let mut ratios: [Vec<f64>; 2] = Default::default();
        for k in 0..reps {
            pin_process(pid, &cpus[..1])?;
            let f = |name: &str| format!("{name}-pin-{label}-{k}");
            let r = (|| -> Result<(f64, f64, f64)> {
                let mut bare = bare_uffd_on(pages, false, Some((cpus[0], client)))?;
                // Children inherit this thread's pin.
                pin_thread(&[client])?;
                run_child(exe, cdir, "n0", "read", &f("fb-lr"), pages)?;
                let mut a = run_child(exe, cdir, "n0", "mread", &f("fb-lr"), pages)?;
                run_child(exe, cdir, "n0", "write", &f("fb-lw"), pages)?;
                let mut b = run_child(exe, cdir, "n0", "mwrite", &f("fb-lw"), pages)?;
                Ok((pct(&mut bare, 0.5), pct(&mut a, 0.5), pct(&mut b, 0.5)))
            })();
            pin_thread(&cpus)?;
            pin_process(pid, &cpus)?;
            let (b, a, w) = r?;
            ratios[0].push(a / b);
            ratios[1].push(w / b);
            rb.push(b);
            lr.push(a);
            lw.push(w);
        }
        let [r, w] = ratios.map(|mut v| median(&mut v));
        println!(
            "  {label:<9} bare {:.1}, local read {:.1} ({r:.2}x), local write {:.1} ({w:.2}x)",
            median(&mut rb.clone()),
            median(&mut lr.clone()),
            median(&mut lw.clone())
        );
        out.insert(
            label.into(),
            serde_json::json!({"bare_p50_us": rb, "local_read_p50_us": lr, "local_write_p50_us": lw,
                "local_read_ratio": r, "local_write_ratio": w}),
        );
    }
    Ok(Some(serde_json::Value::Object(out)))
}

fn measure(exe: &Path, cdir: &Path, pages: usize, rounds: usize) -> Result<()> {
    // Rounds interleave the baselines with the faults, so that drift in machine load hits
    // both alike; each round's faults are compared with that round's baselines, and the
    // ratios reported are the medians over rounds.
    let mut all: [Vec<u64>; 9] = Default::default();
    // Per round: local read / bare, local write / bare, remote read / target, write / target,
    // local read / bare from another process, remote write (one copy) / target.
    let mut ratios: [Vec<f64>; 6] = Default::default();
    for r in 0..rounds {
        let mut v = round(exe, cdir, pages, r)?;
        let p = |v: &mut Vec<u64>| pct(v, 0.5);
        let (b, q, l) = (p(&mut v[0]), p(&mut v[1]), p(&mut v[7]));
        let target = b + 1.5 * l;
        let (lr, lw, rr, wi) = (p(&mut v[2]), p(&mut v[3]), p(&mut v[4]), p(&mut v[5]));
        let (bo, rw) = (p(&mut v[6]), p(&mut v[8]));
        eprintln!(
            "round {}: bare {b:.1} (other process {bo:.1}), link rtt {l:.1} (request rtt {q:.1}); local read {lr:.1}, write {lw:.1}; remote read {rr:.1}, invalidating write {wi:.1}, remote write {rw:.1} (µs, p50)",
            r + 1
        );
        for (k, x) in [lr / b, lw / b, rr / target, wi / target, lr / bo, rw / target]
            .into_iter()
            .enumerate()
        {
            ratios[k].push(x);
        }
        for (k, x) in v.into_iter().enumerate() {
            all[k].extend(x);
        }
    }
    let mut json = serde_json::Map::new();
    println!("Fault latency, local 4-node cluster, {rounds} rounds (µs; p50 / p99 of all samples)");
    let mut p50 = [0f64; 9];
    for (k, name) in KINDS.iter().enumerate() {
        let v = &mut all[k];
        let (a, z) = (pct(v, 0.5), pct(v, 0.99));
        p50[k] = a;
        println!("  {name:<28} {a:9.1} {z:9.1}   ({} samples)", v.len());
        json.insert(
            name.to_string(),
            serde_json::json!({"p50_us": a, "p99_us": z, "samples": v.len()}),
        );
    }
    let [lr, lw, rr, wi, lro, rw] = ratios.map(|mut v| median(&mut v));
    println!("Targets (median over rounds of each round's p50 against that round's baselines):");
    println!("  local fault  <= 1.3 x bare uffd:              read {lr:.2}x, write {lw:.2}x");
    println!("  (local read against the bare handler in another process: {lro:.2}x)");
    println!("  remote fault <= bare + 1.5 x link RTT (= 1.0): read {rr:.2}, invalidating write {wi:.2}");
    println!("  (a write whose only other copy is the owner's: {rw:.2})");
    json.insert("bench".into(), serde_json::json!("faults"));
    json.insert("rounds".into(), serde_json::json!(rounds));
    json.insert("local_read_ratio".into(), serde_json::json!(lr));
    json.insert("local_write_ratio".into(), serde_json::json!(lw));
    json.insert("local_read_vs_other_process".into(), serde_json::json!(lro));
    json.insert("remote_read_of_target".into(), serde_json::json!(rr));
    json.insert("invalidating_write_of_target".into(), serde_json::json!(wi));
    json.insert("remote_write_of_target".into(), serde_json::json!(rw));
    json.insert("remote_target_us".into(), serde_json::json!(p50[0] + 1.5 * p50[7]));
    if let Some(p) = pinned(exe, cdir, pages, rounds.min(3))? {
        json.insert("pinned".into(), p);
    }
    println!("{}", serde_json::Value::Object(json));
    Ok(())
}
