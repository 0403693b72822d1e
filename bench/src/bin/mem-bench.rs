//! The cost of memory checkpoints against persistent ones on MGS (issue 14's benchmark, the
//! paper's Figure 5), in one run on a local 4-node cluster: MGS `--vectors`×`--vectors` with
//! 4 ranks without checkpoints, then with a checkpoint every K vectors for each K of `--ks`
//! (default 50 and 250), pinned to the memory level and to the persistent level; rounds
//! interleaved, so machine load drifts hit every configuration alike, and every time a ratio
//! against the run without checkpoints of the same round. Per configuration: the run time, its
//! ratio, the checkpoints and the pages they kept, the pause per checkpoint (from the last rank's
//! call to the ranks' answer, as the coordinator measured it: the ranks go on once every node
//! took its pages) against the target 1 ms + 2 µs per page, and rank 0's time in its
//! safe-point calls (which also waits for the slowest rank), the pages the daemons wrote
//! to their disks during the run, and the recovery frames at the peak; per K, how many times
//! cheaper a memory checkpoint is than a persistent one (their overheads' ratio). Writes the
//! figures as CSV (`--csv FILE`, default `mem-bench.csv`) and a JSON line.
//!
//! With `--policies P,P,..` it measures the paper's Figure 6 instead: each cleaning policy with
//! `auto` checkpoints (a cleaner every `--persistent-interval` seconds, 1 by default, and
//! whenever memory runs short) on a cluster whose nodes have `--memory-mb` MiB (10 by
//! default: one MGS memory checkpoint fits, two do not), the policy deciding how much memory
//! the recovery copies keep after a cleaner, so whether the next checkpoint fits in memory.
//!
//! Usage: mem-bench [--rounds 3] [--vectors 1024] [--ks 50,250] [--csv FILE] [--dir DIR] [--keep]
//!                  [--policies none,total,p1,p2,p3,lru:1000 [--memory-mb 10] [--persistent-interval 1]]
//! Needs `psls`, `psls-node` and `mgs` next to this binary (`cargo build --release --workspace --bins`).

use anyhow::{bail, Context, Result};
use psls_bench::{median, run_mgs};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Memory against persistent checkpoints on MGS per K, or each cleaning policy in a small
/// memory (Figures 5 and 6), as CSV.
#[derive(clap::Parser)]
#[command(name = "mem-bench", version, about)]
struct Args {
    /// Keep the cluster folder (its daemons' logs time every checkpoint's steps).
    #[arg(long)]
    keep: bool,
    /// Figure 6: these cleaning policies (comma-separated), on nodes of `--memory-mb`.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Each node's memory for recovery copies, in MiB (with `--policies`).
    #[arg(long, default_value_t = 10)]
    memory_mb: u64,
    /// Seconds between persistent checkpoints (with `--policies`).
    #[arg(long = "persistent-interval", value_name = "SECONDS", default_value_t = 1)]
    persistent_interval_s: u64,
    /// Rounds of runs.
    #[arg(long, default_value_t = 3, value_parser = psls_bench::positive)]
    rounds: usize,
    /// MGS vectors (at least 50).
    #[arg(long, default_value_t = 1024, value_parser = psls_bench::vectors)]
    vectors: usize,
    /// The checkpoint intervals K, in vectors (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [50, 250], value_parser = psls_bench::positive)]
    ks: Vec<usize>,
    /// Where the CSV goes.
    #[arg(long, default_value = "mem-bench.csv")]
    csv: PathBuf,
    /// Folder for the cluster (default: a temporary one).
    #[arg(long)]
    dir: Option<PathBuf>,
}

fn args() -> Result<Args> {
    Ok(<Args as clap::Parser>::parse())
}

/// One configuration: a series (a level or a policy; "none" with K = 0: no checkpoints), a K,
/// and the `psls run` options it takes.
#[derive(Clone)]
struct Config {
    level: String,
    k: usize,
    extra: Vec<String>,
}

/// What the runs of one configuration measured.
#[derive(Default, Clone)]
struct Figures {
    time_s: Vec<f64>,
    ratio: Vec<f64>,
    checkpoints: Vec<f64>,
    pages_per_ckpt: Vec<f64>,
    pause_ms: Vec<f64>,
    /// Rank 0's time in its safe-point calls, per checkpoint (it also waits for the slowest
    /// rank to arrive).
    call_ms: Vec<f64>,
    disk_pages: Vec<f64>,
    frames_peak: Vec<f64>,
    /// At that peak (the node with the most frames): recovery and pre-recovery copies.
    peak_recovery: Vec<f64>,
    peak_pre_recovery: Vec<f64>,
}

fn main() -> Result<()> {
    let a = args()?;
    let bin = std::env::current_exe()?.parent().context("no folder")?.to_path_buf();
    for b in ["psls", "psls-node", "mgs"] {
        if !bin.join(b).exists() {
            bail!("{b} not found next to mem-bench: run `cargo build --release --workspace --bins` first");
        }
    }
    let tmp = tempfile::Builder::new()
        .prefix("mem-bench")
        .tempdir_in(a.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let cdir = tmp.path().join("cluster");
    let port = 34000 + (std::process::id() % 2000) as u16 * 8;
    let memory_mb = if a.policies.is_empty() { 1024 } else { a.memory_mb };
    psls_client::cluster::init(&cdir, 4, 0, memory_mb, port, false)?;
    psls_client::cluster::up(&cdir, Duration::from_secs(60), true)?;
    let result = run(&a, &bin, &cdir);
    let _ = psls_client::cluster::down(&cdir);
    if a.keep {
        eprintln!("kept {}", tmp.keep().display());
    }
    result
}

fn run(a: &Args, bin: &Path, cdir: &Path) -> Result<()> {
    // The run without checkpoints (K = 0; "off", not to be taken for the policy "none").
    let mut configs = vec![Config {
        level: "off".into(),
        k: 0,
        extra: Vec::new(),
    }];
    for &k in &a.ks {
        if a.policies.is_empty() {
            for level in ["memory", "persistent"] {
                configs.push(Config {
                    level: level.into(),
                    k,
                    extra: vec!["--level".into(), level.into()],
                });
            }
        }
        for p in &a.policies {
            configs.push(Config {
                level: p.clone(),
                k,
                extra: vec![
                    "--cleaning".into(),
                    p.clone(),
                    "--persistent-interval".into(),
                    a.persistent_interval_s.to_string(),
                ],
            });
        }
    }
    let mut figs: Vec<Figures> = vec![Figures::default(); configs.len()];
    let mut checksum = String::new();
    for round in 0..a.rounds {
        let mut base = f64::NAN;
        for (c, cfg) in configs.iter().enumerate() {
            let extra: Vec<&str> = cfg.extra.iter().map(String::as_str).collect();
            let j = run_mgs(bin, cdir, "n0", a.vectors, cfg.k, &extra)?;
            let sum = j["checksum"].as_str().unwrap_or_default().to_string();
            if checksum.is_empty() {
                checksum = sum;
            } else if checksum != sum {
                bail!("checksums differ between runs: {checksum} / {sum}");
            }
            let t = j["time_s"].as_f64().unwrap_or(f64::NAN);
            if cfg.k == 0 {
                base = t;
            }
            let n = j["checkpoints"].as_f64().unwrap_or(0.0);
            let f = &mut figs[c];
            f.time_s.push(t);
            f.ratio.push(t / base);
            f.checkpoints.push(n);
            if n > 0.0 {
                f.pages_per_ckpt
                    .push(j["checkpoint_bytes"].as_f64().unwrap_or(0.0) / 4096.0 / n);
                f.pause_ms
                    .push(1e3 * j["checkpoint_stop_s"].as_f64().unwrap_or(0.0) / n);
                f.call_ms
                    .push(1e3 * j["checkpoint_pause_s"].as_f64().unwrap_or(0.0) / n);
            }
            f.disk_pages.push(j["disk_pages_written"].as_f64().unwrap_or(0.0));
            // The node with the most frames at its peak, and what they were then.
            let top = j["faults_per_node"].as_object().and_then(|m| {
                m.values()
                    .max_by_key(|n| n["frames_peak"].as_u64().unwrap_or(0))
                    .cloned()
            });
            let get = |k: &str| top.as_ref().and_then(|n| n[k].as_f64()).unwrap_or(0.0);
            let peak = get("frames_peak");
            f.frames_peak.push(peak);
            f.peak_recovery.push(get("frames_peak_recovery"));
            f.peak_pre_recovery.push(get("frames_peak_pre_recovery"));
            eprintln!(
                "round {} {} K={}: {t:.3} s (x{:.3}), {n} checkpoints, pause {:.2} ms each, {} disk pages, frames peak {peak}",
                round + 1,
                cfg.level,
                cfg.k,
                t / base,
                f.pause_ms.last().copied().unwrap_or(0.0),
                j["disk_pages_written"]
            );
        }
    }
    let med = |v: &[f64]| {
        if v.is_empty() {
            f64::NAN
        } else {
            median(&mut v.to_vec())
        }
    };
    let series = if a.policies.is_empty() { "level" } else { "policy" };
    let mut csv = format!(
        "{series},k,time_s,ratio,checkpoints,pages_per_checkpoint,pause_ms,pause_target_ms,call_ms,disk_pages_written,frames_peak_per_node,frames_peak_recovery,frames_peak_pre_recovery\n"
    );
    println!(
        "MGS {v}x{v}, 4 ranks on a local 4-node cluster, median of {} rounds (ratios against the run without checkpoints of the same round)",
        a.rounds,
        v = a.vectors
    );
    let mut rows = Vec::new();
    for (c, cfg) in configs.iter().enumerate() {
        let f = &figs[c];
        let (t, r, pages, pause) = (med(&f.time_s), med(&f.ratio), med(&f.pages_per_ckpt), med(&f.pause_ms));
        let call = med(&f.call_ms);
        let target = 1.0 + 0.002 * pages;
        let (disk, peak) = (med(&f.disk_pages), med(&f.frames_peak));
        let (rec, pre) = (med(&f.peak_recovery), med(&f.peak_pre_recovery));
        csv.push_str(&format!(
            "{},{},{t:.4},{r:.4},{},{pages:.0},{pause:.3},{target:.3},{call:.3},{disk:.0},{peak:.0},{rec:.0},{pre:.0}\n",
            cfg.level,
            cfg.k,
            med(&f.checkpoints)
        ));
        if cfg.k == 0 {
            println!("  no checkpoints: {t:.3} s");
        } else {
            println!(
                "  {:<10} K = {:3}: {t:.3} s (x{r:.3}); {pages:.0} pages per checkpoint, pause {pause:.2} ms (target {target:.2} ms; rank 0's call {call:.2} ms); {disk:.0} pages written to disks; frames at the peak {peak:.0} per node ({rec:.0} recovery, {pre:.0} pre-recovery)",
                cfg.level, cfg.k
            );
        }
        rows.push(serde_json::json!({
            "level": cfg.level, "k": cfg.k, "time_s": t, "ratio": r, "pages_per_checkpoint": pages,
            "pause_ms": pause, "pause_target_ms": target, "call_ms": call, "disk_pages_written": disk, "frames_peak": peak, "frames_peak_recovery": rec, "frames_peak_pre_recovery": pre,
        }));
    }
    // How many times cheaper a memory checkpoint is than a persistent one: per round, the
    // overheads (time above the run without checkpoints) divided, per checkpoint pauses too.
    for &k in a.ks.iter().filter(|_| a.policies.is_empty()) {
        let at = |level: &str| {
            configs
                .iter()
                .position(|c| c.level == level && c.k == k)
                .expect("configured")
        };
        let (m, p) = (&figs[at("memory")], &figs[at("persistent")]);
        let overhead: Vec<f64> = p
            .ratio
            .iter()
            .zip(&m.ratio)
            .map(|(p, m)| (p - 1.0) / (m - 1.0))
            .collect();
        let pause: Vec<f64> = p.pause_ms.iter().zip(&m.pause_ms).map(|(p, m)| p / m).collect();
        let o = med(&overhead);
        let cost = if o > 0.0 {
            format!("1/{o:.1} of a persistent one's overhead")
        } else {
            "an overhead below the noise".to_string()
        };
        println!(
            "  K = {k:3}: a memory checkpoint costs {cost}, its pause 1/{:.1} of a persistent one's (target: at least 10x cheaper)",
            med(&pause)
        );
    }
    std::fs::write(&a.csv, csv).with_context(|| format!("writing {}", a.csv.display()))?;
    println!(
        "{}",
        serde_json::json!({"bench": "mem", "vectors": a.vectors, "rounds": a.rounds, "rows": rows, "checksum": checksum, "csv": a.csv})
    );
    let _ = std::io::stdout().flush();
    Ok(())
}
