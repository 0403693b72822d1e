//! The cost of persistent checkpoints on MGS (DESIGN §11), in one run on a local 4-node
//! cluster: MGS `--vectors`×`--vectors` with 4 ranks without checkpoints, and with a persistent
//! checkpoint every K = 250, 100 and 50 vectors (rounds interleaved, so machine load drifts
//! hit every configuration alike). Per run: the time, the checkpoints taken, the bytes they
//! wrote (one copy), the pause they cost rank 0 and what they cost the run (its time over the
//! run without checkpoints of the same round: the ranks go on once every node took its pages,
//! and the writes go on while they compute, so the pause alone is not what a checkpoint
//! costs); right after each run, the same bytes written raw — per checkpoint, `pwrite` +
//! `fsync` to two files (the primary and the mirror copy) on the same disk — so the checkpoint
//! bandwidth (bytes over the run's extra time) is a ratio against the disk measured then.
//! Last, the recovery time: a node's daemon is killed with SIGKILL during a run with K = 50
//! and restarted; the time from the kill to the launcher restarting every rank, against the
//! failure-detection timeout + 1 s + the job's file bytes / the raw write bandwidth.
//!
//! Usage: ckpt-bench [--rounds 3] [--vectors 1024] [--dir DIR] [--keep]
//! (`--keep` keeps the cluster folder: with `PSLS_LOG=info,psls_node::ckpt=debug` its logs
//! time every checkpoint's steps.)
//! Needs `psls`, `psls-node` and `mgs` next to this binary (`cargo build --release --workspace --bins`).

use anyhow::{bail, Context, Result};
use psls_bench::median;
use std::io::{BufRead, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// MGS with persistent checkpoints against none, on a local cluster.
#[derive(clap::Parser)]
#[command(name = "ckpt-bench", version, about)]
struct Args {
    /// Rounds of runs.
    #[arg(long, default_value_t = 3, value_parser = psls_bench::positive)]
    rounds: usize,
    /// MGS vectors (at least 50).
    #[arg(long, default_value_t = 1024, value_parser = psls_bench::vectors)]
    vectors: usize,
    /// Folder for the cluster (default: a temporary one).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the cluster folder (its daemons' logs time every checkpoint's steps).
    #[arg(long)]
    keep: bool,
}

fn args() -> Result<Args> {
    Ok(<Args as clap::Parser>::parse())
}

/// One MGS run's figures.
struct Run {
    time_s: f64,
    checkpoints: u64,
    bytes: u64,
    pause_s: f64,
    checksum: String,
}

fn mgs_cmd(bin: &Path, cdir: &Path, node: &str, vectors: usize, every: usize) -> Command {
    let mut c = Command::new(bin.join("psls"));
    // Persistent checkpoints only (a job's default takes memory ones between them).
    c.arg("--dir")
        .arg(cdir)
        .args(["--node", node, "run", "-n", "4", "--level", "persistent", "--"]);
    c.arg(bin.join("mgs"));
    let v = vectors.to_string();
    c.args(["--vectors", &v, "--dim", &v, "--no-baseline"]);
    if every > 0 {
        c.args(["--checkpoint-every", &every.to_string()]);
    }
    c
}

fn parse(out: &str) -> Result<Run> {
    let line = out
        .lines()
        .find(|l| l.contains("\"bench\":\"mgs\""))
        .with_context(|| format!("no MGS result in:\n{out}"))?;
    let j: serde_json::Value = serde_json::from_str(line.trim_start_matches("[0] "))?;
    if j["ok"] != true {
        bail!("MGS result check failed: {line}");
    }
    Ok(Run {
        time_s: j["time_s"].as_f64().unwrap_or(f64::NAN),
        checkpoints: j["checkpoints"].as_u64().unwrap_or(0),
        bytes: j["checkpoint_bytes"].as_u64().unwrap_or(0),
        pause_s: j["checkpoint_pause_s"].as_f64().unwrap_or(0.0),
        checksum: j["checksum"].as_str().unwrap_or_default().to_string(),
    })
}

fn mgs(bin: &Path, cdir: &Path, vectors: usize, every: usize) -> Result<Run> {
    let o = mgs_cmd(bin, cdir, "n0", vectors, every).output()?;
    let out = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() {
        bail!("mgs failed: {out}{}", String::from_utf8_lossy(&o.stderr));
    }
    parse(&out)
}

/// `checkpoints` times: `bytes` written with `pwrite` in 1 MiB pieces to each of two files,
/// each fsync'd. Seconds.
fn raw_writes(dir: &Path, bytes: u64, checkpoints: u64) -> Result<f64> {
    let buf = psls_bench::random_bytes(1 << 20, 7);
    let files = [
        std::fs::File::create(dir.join("primary"))?,
        std::fs::File::create(dir.join("mirror"))?,
    ];
    let t = Instant::now();
    for _ in 0..checkpoints {
        for f in &files {
            let mut off = 0u64;
            while off < bytes {
                let n = (bytes - off).min(buf.len() as u64) as usize;
                f.write_all_at(&buf[..n], off)?;
                off += n as u64;
            }
            f.sync_all()?;
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Kills node n2's daemon `delay` into a run with K = 50, restarts it; seconds from the kill to
/// the launcher's "restarted from" (every rank started again), and the run's checksum.
fn recovery(bin: &Path, cdir: &Path, vectors: usize, delay: Duration) -> Result<(f64, String)> {
    let mut ch = mgs_cmd(bin, cdir, "n0", vectors, 50)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stderr = ch.stderr.take().context("stderr")?;
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, String)>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            let _ = tx.send((Instant::now(), line));
        }
    });
    std::thread::sleep(delay);
    let pid = psls_client::cluster::running_pid(cdir, "n2").context("n2 is not running")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    let killed = Instant::now();
    psls_client::cluster::wait_gone(pid, Duration::from_secs(10));
    psls_client::cluster::up(cdir, Duration::from_secs(60), true)?;
    let mut restarted = None;
    let mut said = String::new();
    while let Ok((at, line)) = rx.recv_timeout(Duration::from_secs(120)) {
        said.push_str(&line);
        said.push('\n');
        if std::env::var_os("CKPT_BENCH_TRACE").is_some() {
            eprintln!("{:+.3} s: {line}", at.duration_since(killed).as_secs_f64());
        }
        if line.contains("restarted from") {
            restarted = Some(at.duration_since(killed).as_secs_f64());
            break;
        }
    }
    let o = ch.wait_with_output()?;
    let run = parse(&String::from_utf8_lossy(&o.stdout))?;
    let secs = restarted.with_context(|| format!("the job was never restarted:\n{said}"))?;
    Ok((secs, run.checksum))
}

fn main() -> Result<()> {
    let a = args()?;
    let bin = std::env::current_exe()?.parent().context("no folder")?.to_path_buf();
    for b in ["psls", "psls-node", "mgs"] {
        if !bin.join(b).exists() {
            bail!("{b} not found next to ckpt-bench: run `cargo build --release --workspace --bins` first");
        }
    }
    let tmp = tempfile::Builder::new()
        .prefix("ckpt-bench")
        .tempdir_in(a.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let raw = tmp.path().join("raw");
    std::fs::create_dir_all(&raw)?;
    let cdir = tmp.path().join("cluster");
    let port = 32000 + (std::process::id() % 2000) as u16 * 8;
    psls_client::cluster::init(&cdir, 4, 0, 1024, port, false)?;
    psls_client::cluster::up(&cdir, Duration::from_secs(60), true)?;
    let result = run(&a, &bin, &raw, &cdir);
    let _ = psls_client::cluster::down(&cdir);
    if a.keep {
        let kept = tmp.keep();
        eprintln!("kept {}", kept.display());
    }
    result
}

fn run(a: &Args, bin: &Path, raw: &Path, cdir: &Path) -> Result<()> {
    let ks = [0usize, 250, 100, 50];
    // Per K: times, per-run bandwidth ratios, bytes per checkpoint, pause and cost per
    // checkpoint.
    let mut time: Vec<Vec<f64>> = vec![Vec::new(); ks.len()];
    let mut ratio: Vec<Vec<f64>> = vec![Vec::new(); ks.len()];
    let mut per_ckpt: Vec<Vec<(f64, f64, f64, f64)>> = vec![Vec::new(); ks.len()]; // bytes, pause s, raw s, cost s
    let mut checksum = String::new();
    for round in 0..a.rounds {
        let mut base_s = f64::NAN;
        for (k, &every) in ks.iter().enumerate() {
            let r = mgs(bin, cdir, a.vectors, every)?;
            if checksum.is_empty() {
                checksum = r.checksum.clone();
            } else if checksum != r.checksum {
                bail!("checksums differ between runs: {checksum} / {}", r.checksum);
            }
            time[k].push(r.time_s);
            if every == 0 {
                base_s = r.time_s;
            }
            if let Some(bytes) = r.bytes.checked_div(r.checkpoints) {
                let raw_s = raw_writes(raw, bytes, r.checkpoints)?;
                // What the checkpoints cost the run (noise can make it tiny or negative).
                let cost_s = (r.time_s - base_s).max(1e-6);
                ratio[k].push(raw_s / cost_s);
                let n = r.checkpoints as f64;
                per_ckpt[k].push((bytes as f64, r.pause_s / n, raw_s / n, cost_s / n));
            }
            eprintln!(
                "round {} K={every}: {:.3} s, {} checkpoints, {:.2} MiB each, pause {:.1} ms each",
                round + 1,
                r.time_s,
                r.checkpoints,
                r.bytes as f64 / r.checkpoints.max(1) as f64 / (1 << 20) as f64,
                1e3 * r.pause_s / r.checkpoints.max(1) as f64
            );
        }
    }
    let med = |v: &mut Vec<f64>| if v.is_empty() { f64::NAN } else { median(v) };
    let base = med(&mut time[0].clone());
    println!(
        "MGS {v}x{v}, 4 ranks on a local 4-node cluster, persistent checkpoints, median of {} rounds",
        a.rounds,
        v = a.vectors
    );
    println!("  no checkpoints: {base:.3} s");
    let mut rows = Vec::new();
    for (k, &every) in ks.iter().enumerate().skip(1) {
        let t = med(&mut time[k].clone());
        // Time ratio per round against that round's run without checkpoints.
        let mut tr: Vec<f64> = time[k].iter().zip(&time[0]).map(|(x, y)| x / y).collect();
        let tr = med(&mut tr);
        let bw = med(&mut ratio[k].clone());
        let n = per_ckpt[k].len().max(1) as f64;
        let (b, p, r, c) = per_ckpt[k].iter().fold((0.0, 0.0, 0.0, 0.0), |acc, x| {
            (acc.0 + x.0 / n, acc.1 + x.1 / n, acc.2 + x.2 / n, acc.3 + x.3 / n)
        });
        println!(
            "  K = {every:3}: {t:.3} s (x{tr:.2}); per checkpoint {:.2} MiB, pause {:.1} ms, cost to the run {:.1} ms, raw write x2 + fsync {:.1} ms; bandwidth {:.0} MiB/s = {bw:.2} x raw (target >= 0.8)",
            b / (1 << 20) as f64,
            p * 1e3,
            c * 1e3,
            r * 1e3,
            2.0 * b / c / (1 << 20) as f64
        );
        rows.push(serde_json::json!({
            "k": every, "time_s": t, "time_ratio": tr, "bytes_per_checkpoint": b,
            "pause_s": p, "cost_s": c, "raw_s": r, "bandwidth_ratio": bw,
        }));
    }
    // Recovery: detection + 1 s + the job's file (its checkpoint) / the raw bandwidth.
    let file_bytes = (a.vectors * a.vectors.div_ceil(512) * 4096) as f64;
    let raw_s = raw_writes(raw, file_bytes as u64, 1)?;
    let raw_bw = 2.0 * file_bytes / raw_s;
    let hb = psls_ipc::ClusterConfig::load(&cdir.join("cluster.toml"))?
        .cluster
        .heartbeat_timeout_ms as f64
        / 1e3;
    let target = hb + 1.0 + file_bytes / raw_bw;
    let mut rec = Vec::new();
    for round in 0..a.rounds {
        let (secs, sum) = recovery(bin, cdir, a.vectors, Duration::from_millis(700 + 300 * round as u64))?;
        if sum != checksum {
            bail!("the recovered run's checksum {sum} differs from {checksum}");
        }
        eprintln!("recovery {}: {secs:.2} s", round + 1);
        rec.push(secs);
    }
    let r = med(&mut rec);
    println!(
        "  recovery from a kill -9 to every rank running again: {r:.2} s (target <= {target:.2} s: detection {hb:.1} s + 1 s + {:.1} MiB / {:.0} MiB/s); checksum unchanged",
        file_bytes / (1 << 20) as f64,
        raw_bw / (1 << 20) as f64
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "ckpt", "vectors": a.vectors, "rounds": a.rounds, "time_no_ckpt_s": base,
            "k": rows, "recovery_s": r, "recovery_target_s": target, "checksum": checksum,
        })
    );
    let _ = std::io::stdout().flush();
    Ok(())
}
