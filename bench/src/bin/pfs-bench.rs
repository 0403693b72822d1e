//! PFS throughput: import and export of one file on a local 4-node cluster, next to the same
//! bytes written twice with write+fsync to plain files on the same disk (and read back), in
//! the same run. Prints a table and one JSON line.
//!
//! The client passes memory-backed files (memfd) to the daemon, which reads and writes them
//! itself, as `psls import`/`export` do with real files; the baseline writes from and reads
//! into memory too.
//!
//! Reads are measured twice: *cold* (after dropping the page cache, when this process may —
//! root only; both the baseline and the export then read from the disk) and *warm* (from the
//! page cache: the baseline is then a memory copy).
//!
//! Usage: pfs-bench [--size-mb 256] [--rounds 3] [--dir DIR]
//! Needs `psls-node` next to this binary (`cargo build --release --workspace --bins`).

use anyhow::{bail, Result};
use psls_bench::{median, random_bytes};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// PFS import and export throughput against plain files on the same disk.
#[derive(clap::Parser)]
#[command(name = "pfs-bench", version, about)]
struct Args {
    /// Size of the file imported and exported, in MiB.
    #[arg(long, default_value_t = 256, value_parser = psls_bench::positive)]
    size_mb: usize,
    /// Rounds, each alternating PSLS and the baseline.
    #[arg(long, default_value_t = 3, value_parser = psls_bench::positive)]
    rounds: usize,
    /// Folder for the cluster and the baseline's files (default: a temporary one).
    #[arg(long)]
    dir: Option<PathBuf>,
}

fn args() -> Result<Args> {
    Ok(<Args as clap::Parser>::parse())
}

/// Baseline write: the bytes to two plain files, 1 MiB writes, fsync each. Seconds.
fn baseline_write(dir: &Path, data: &[u8]) -> Result<f64> {
    let t = Instant::now();
    for name in ["copy-a", "copy-b"] {
        let mut f = std::fs::File::create(dir.join(name))?;
        for c in data.chunks(1 << 20) {
            f.write_all(c)?;
        }
        f.sync_all()?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Baseline read: one copy back into memory. Seconds.
fn baseline_read(dir: &Path, data: &[u8]) -> Result<f64> {
    let t = Instant::now();
    let mut out = Vec::with_capacity(data.len());
    std::fs::File::open(dir.join("copy-a"))?.read_to_end(&mut out)?;
    let secs = t.elapsed().as_secs_f64();
    if out != data {
        bail!("baseline read back different bytes");
    }
    Ok(secs)
}

/// Writes back and drops the page cache; false when not permitted.
fn drop_caches() -> bool {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// An in-memory file holding `data` (what a client would pass to the daemon).
fn memfd_with(data: &[u8]) -> Result<std::fs::File> {
    let fd = nix::sys::memfd::memfd_create("pfs-bench", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
    let mut f = std::fs::File::from(fd);
    f.write_all(data)?;
    use std::io::Seek;
    f.rewind()?;
    Ok(f)
}

fn import(cdir: &Path, data: &[u8], replace: bool) -> Result<f64> {
    use std::os::fd::AsFd;
    let src = memfd_with(data)?;
    let t = Instant::now();
    psls_client::cluster::connect(cdir, Some("n0"))?.import_fd(
        src.as_fd(),
        data.len() as u64,
        "bench",
        0o644,
        replace,
    )?;
    Ok(t.elapsed().as_secs_f64())
}

fn export(cdir: &Path, data: &[u8]) -> Result<f64> {
    use std::os::fd::AsFd;
    let mut dst = memfd_with(&[])?;
    let t = Instant::now();
    psls_client::cluster::connect(cdir, Some("n0"))?.export_fd("bench", dst.as_fd())?;
    let secs = t.elapsed().as_secs_f64();
    use std::io::Seek;
    dst.rewind()?;
    let mut out = Vec::with_capacity(data.len());
    dst.read_to_end(&mut out)?;
    if out != data {
        bail!("export returned different bytes");
    }
    Ok(secs)
}

fn main() -> Result<()> {
    let a = args()?;
    let node_bin = std::env::current_exe()?.with_file_name("psls-node");
    if !node_bin.exists() {
        bail!(
            "{} not found: run `cargo build --release --workspace --bins` first",
            node_bin.display()
        );
    }
    let tmp = tempfile::Builder::new()
        .prefix("pfs-bench")
        .tempdir_in(a.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let base = tmp.path().join("baseline");
    std::fs::create_dir_all(&base)?;
    let cdir = tmp.path().join("cluster");
    let port = 30000 + (std::process::id() % 2000) as u16 * 8;
    psls_client::cluster::init(&cdir, 4, 0, 1024, port, false)?;
    psls_client::cluster::up(&cdir, Duration::from_secs(60), true)?;
    let result = run(&a, &base, &cdir);
    let _ = psls_client::cluster::down(&cdir);
    result
}

fn run(a: &Args, base: &Path, cdir: &Path) -> Result<()> {
    let size = a.size_mb << 20;
    let data = random_bytes(size, 42);
    let mib = size as f64 / (1024.0 * 1024.0);
    let cold = drop_caches();
    if !cold {
        eprintln!("note: cannot drop the page cache (not root): cold reads are not measured");
    }
    let mut m: [Vec<f64>; 6] = Default::default(); // write, import, read cold/warm, export cold/warm
    for round in 0..a.rounds {
        // Interleave baseline and PFS so that drift in machine load hits both alike.
        m[0].push(mib / baseline_write(base, &data)?);
        m[1].push(mib / import(cdir, &data, round > 0)?);
        if cold {
            drop_caches();
            m[2].push(mib / baseline_read(base, &data)?);
            drop_caches();
            m[4].push(mib / export(cdir, &data)?);
        }
        m[3].push(mib / baseline_read(base, &data)?);
        m[5].push(mib / export(cdir, &data)?);
        let last = |v: &Vec<f64>| v.last().copied().unwrap_or(f64::NAN);
        eprintln!(
            "round {}: write x2 {:.0}, import {:.0}; read cold {:.0}, export cold {:.0}; read warm {:.0}, export warm {:.0} MiB/s",
            round + 1,
            last(&m[0]),
            last(&m[1]),
            last(&m[2]),
            last(&m[4]),
            last(&m[3]),
            last(&m[5])
        );
    }
    let med = |v: &mut Vec<f64>| if v.is_empty() { f64::NAN } else { median(v) };
    // Ratios per round (each PSLS figure against the baseline measured next to it, under the
    // same machine load), then their median: the baselines swing by 2x between rounds on a
    // shared machine, and a ratio of medians would pair figures from different rounds.
    let ratio = |a: usize, b: usize| {
        let mut r: Vec<f64> = m[a].iter().zip(&m[b]).map(|(x, y)| x / y).collect();
        med(&mut r)
    };
    let (ri, rec, rew) = (ratio(1, 0), ratio(4, 2), ratio(5, 3));
    let [w, i, rc, rw, ec, ew] = m.each_mut().map(med);
    println!(
        "PFS throughput, {} MiB file, 4-node local cluster, median of {} rounds",
        a.size_mb, a.rounds
    );
    println!("  baseline write x2 + fsync : {w:8.0} MiB/s (of file bytes)");
    println!("  psls import               : {i:8.0} MiB/s   ratio {ri:.2} (target >= 0.5)");
    println!("  baseline read, cold cache : {rc:8.0} MiB/s");
    println!("  psls export, cold cache   : {ec:8.0} MiB/s   ratio {rec:.2} (target >= 0.5)");
    println!("  baseline read, warm cache : {rw:8.0} MiB/s (a memory copy)");
    println!("  psls export, warm cache   : {ew:8.0} MiB/s   ratio {rew:.2}");
    println!("  (ratios: median over rounds of each round's PSLS figure / that round's baseline)");
    let j = psls_bench::json_f64;
    println!(
        "{}",
        serde_json::json!({
            "bench": "pfs", "size_mb": a.size_mb, "rounds": a.rounds,
            "baseline_write_mib_s": j(w), "import_mib_s": j(i), "import_ratio": j(ri),
            "baseline_read_cold_mib_s": j(rc), "export_cold_mib_s": j(ec), "export_cold_ratio": j(rec),
            "baseline_read_warm_mib_s": j(rw), "export_warm_mib_s": j(ew), "export_warm_ratio": j(rew),
        })
    );
    Ok(())
}
