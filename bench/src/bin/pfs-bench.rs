//! PFS throughput: import and export of one file on a local 4-node cluster, next to the same
//! bytes written twice with write+fsync to plain files on the same disk (and read back), in
//! the same run. Prints a table and one JSON line.
//!
//! Usage: pfs-bench [--size-mb 256] [--rounds 3] [--dir DIR]
//! Needs `psls-node` next to this binary (`cargo build --release --workspace --bins`).

use anyhow::{bail, Context, Result};
use psls_bench::{median, random_bytes};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

struct Args {
    size_mb: usize,
    rounds: usize,
    dir: Option<PathBuf>,
}

fn args() -> Result<Args> {
    let mut a = Args {
        size_mb: 256,
        rounds: 3,
        dir: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--size-mb" => a.size_mb = v()?.parse().context("--size-mb")?,
            "--rounds" => a.rounds = v()?.parse().context("--rounds")?,
            "--dir" => a.dir = Some(PathBuf::from(v()?)),
            _ => bail!("unknown argument {k} (use --size-mb N, --rounds N, --dir DIR)"),
        }
    }
    if a.size_mb == 0 || a.rounds == 0 {
        bail!("--size-mb and --rounds must be > 0");
    }
    Ok(a)
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
    let (mut bw, mut br, mut pi, mut pe) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..a.rounds {
        // Interleave baseline and PFS so that drift in machine load hits both alike.
        bw.push(mib / baseline_write(base, &data)?);
        br.push(mib / baseline_read(base, &data)?);
        let mut c = psls_client::cluster::connect(cdir, Some("n0"))?;
        let t = Instant::now();
        c.import(&mut data.as_slice(), size as u64, "bench", 0o644, round > 0)?;
        pi.push(mib / t.elapsed().as_secs_f64());
        let mut out = Vec::with_capacity(size);
        let t = Instant::now();
        psls_client::cluster::connect(cdir, Some("n0"))?.export("bench", &mut out)?;
        pe.push(mib / t.elapsed().as_secs_f64());
        if out != data {
            bail!("export returned different bytes");
        }
        eprintln!(
            "round {}: baseline write {:.0} MiB/s, read {:.0} MiB/s; import {:.0} MiB/s, export {:.0} MiB/s",
            round + 1,
            bw[round],
            br[round],
            pi[round],
            pe[round]
        );
    }
    let (bw, br, pi, pe) = (median(&mut bw), median(&mut br), median(&mut pi), median(&mut pe));
    println!(
        "PFS throughput, {} MiB file, 4-node local cluster, median of {} rounds",
        a.size_mb, a.rounds
    );
    println!("  baseline write x2 + fsync : {bw:8.0} MiB/s (of file bytes)");
    println!(
        "  psls import               : {pi:8.0} MiB/s   ratio {:.2} (target >= 0.5)",
        pi / bw
    );
    println!("  baseline read back        : {br:8.0} MiB/s");
    println!(
        "  psls export               : {pe:8.0} MiB/s   ratio {:.2} (target >= 0.5)",
        pe / br
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "pfs", "size_mb": a.size_mb, "rounds": a.rounds,
            "baseline_write_mib_s": bw, "import_mib_s": pi, "import_ratio": pi / bw,
            "baseline_read_mib_s": br, "export_mib_s": pe, "export_ratio": pe / br,
        })
    );
    Ok(())
}
