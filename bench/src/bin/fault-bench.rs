//! Fault latency benchmark (issue #3), in one run on a local 4-node cluster:
//! - a read and a write fault on a page already on the node (another local process brought
//!   it there);
//! - a read fault on a page owned by another node;
//! - a write fault that must invalidate copies on 3 other nodes;
//!
//! next to, measured in the same run: a bare userfaultfd round trip (a minimal in-process
//! handler resolving a memfd mapping's faults like the daemon does: pwrite, then
//! `UFFDIO_CONTINUE`) and a 4 KiB request/response over the daemons' own QUIC transport.
//! Prints p50/p99 of each, the targets, and one JSON line.
//!
//! Usage: `fault-bench [--pages N]` (needs `psls-node` next to it; run as root on a machine
//! with /dev/userfaultfd).

use anyhow::{bail, Context, Result};
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
            // SAFETY (all arms): one volatile byte access inside the mapping.
            "read" => {
                unsafe { std::ptr::read_volatile(p) };
            }
            "write" => unsafe { std::ptr::write_volatile(p, i as u8) },
            "mread" | "mwrite" if i % 2 == 0 => {
                let t = Instant::now();
                if mode == "mread" {
                    unsafe { std::ptr::read_volatile(p) };
                } else {
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

/// A minimal in-process userfaultfd handler: `n` faults on a memfd mapping, each resolved by
/// pwrite + UFFDIO_CONTINUE from a handler thread. Latency per fault (ns).
fn bare_uffd(n: usize) -> Result<Vec<u64>> {
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
    let handler = std::thread::spawn(move || -> Result<()> {
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
    });
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        // SAFETY: one byte inside the mapping.
        unsafe { std::ptr::read_volatile((b + i * PAGE) as *const u8) };
        lat.push(t.elapsed().as_nanos() as u64);
    }
    handler.join().map_err(|_| anyhow::anyhow!("handler panicked"))??;
    // SAFETY: unmaps the mapping made above; nothing uses it any more.
    unsafe { libc::munmap(base, n * PAGE) };
    Ok(lat)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        let pages = args.get(4).context("pages")?.parse()?;
        return child(&args[2], &args[3], pages);
    }
    let mut pages = 2000usize;
    let mut it = args.iter().skip(1);
    while let Some(k) = it.next() {
        match k.as_str() {
            "--pages" => pages = it.next().context("--pages N")?.parse()?,
            _ => bail!("unknown argument {k} (use --pages N)"),
        }
    }
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
    let r = measure(&exe, &cdir, pages);
    let _ = psls_client::cluster::down(&cdir);
    r
}

fn measure(exe: &Path, cdir: &Path, pages: usize) -> Result<()> {
    let mut bare = bare_uffd(pages)?;
    let mut quic = psls_client::cluster::connect(cdir, Some("n0"))?.peer_ping("n1", 4096, pages as u32)?;
    // Local read: another process on n0 brought every page to n0 first.
    run_child(exe, cdir, "n0", "read", "fb-lr", pages)?;
    let mut local_read = run_child(exe, cdir, "n0", "mread", "fb-lr", pages)?;
    // Local write: n0 holds every page writable.
    run_child(exe, cdir, "n0", "write", "fb-lw", pages)?;
    let mut local_write = run_child(exe, cdir, "n0", "mwrite", "fb-lw", pages)?;
    // Remote read: n1 owns every page (wrote it); n0 reads.
    run_child(exe, cdir, "n1", "write", "fb-rr", pages)?;
    let mut remote_read = run_child(exe, cdir, "n0", "mread", "fb-rr", pages)?;
    // Write invalidating 3 nodes: n1 owns, n2 and n3 read copies; n0 writes.
    run_child(exe, cdir, "n1", "write", "fb-wi", pages)?;
    run_child(exe, cdir, "n2", "read", "fb-wi", pages)?;
    run_child(exe, cdir, "n3", "read", "fb-wi", pages)?;
    let mut inval_write = run_child(exe, cdir, "n0", "mwrite", "fb-wi", pages)?;

    let (b50, b99) = (pct(&mut bare, 0.5), pct(&mut bare, 0.99));
    let (q50, q99) = (pct(&mut quic, 0.5), pct(&mut quic, 0.99));
    let mut rows = Vec::new();
    let mut json = serde_json::Map::new();
    for (name, v) in [
        ("bare_uffd", &mut bare),
        ("quic_4k_rtt", &mut quic),
        ("local_read_fault", &mut local_read),
        ("local_write_fault", &mut local_write),
        ("remote_read_fault", &mut remote_read),
        ("write_fault_invalidating_3", &mut inval_write),
    ] {
        let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
        rows.push((name, p50, p99, v.len()));
        json.insert(
            name.to_string(),
            serde_json::json!({"p50_us": p50, "p99_us": p99, "samples": v.len()}),
        );
    }
    println!("Fault latency, local 4-node cluster (µs; p50 / p99)");
    for (name, p50, p99, n) in &rows {
        println!("  {name:<28} {p50:9.1} {p99:9.1}   ({n} samples)");
    }
    let lr = pct(&mut local_read, 0.5);
    let lw = pct(&mut local_write, 0.5);
    let rr = pct(&mut remote_read, 0.5);
    let wi = pct(&mut inval_write, 0.5);
    println!(
        "Targets (p50): local fault <= 1.3 x bare uffd = {:.1}: read {lr:.1} ({:.2}x), write {lw:.1} ({:.2}x)",
        1.3 * b50,
        lr / b50,
        lw / b50
    );
    println!(
        "               remote fault <= bare + 1.5 x QUIC RTT = {:.1}: read {rr:.1}, invalidating write {wi:.1}",
        b50 + 1.5 * q50
    );
    json.insert("bench".into(), serde_json::json!("faults"));
    json.insert("local_read_ratio".into(), serde_json::json!(lr / b50));
    json.insert("local_write_ratio".into(), serde_json::json!(lw / b50));
    json.insert("remote_target_us".into(), serde_json::json!(b50 + 1.5 * q50));
    json.insert("bare_p99_us".into(), serde_json::json!(b99));
    json.insert("quic_p99_us".into(), serde_json::json!(q99));
    println!("{}", serde_json::Value::Object(json));
    Ok(())
}
