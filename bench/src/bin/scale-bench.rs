//! The control plane's cost against the cluster's size (issue 40): for each size N
//! (`--sizes`), a local cluster of N daemons, no spares, nothing running, one after the other
//! in the same run:
//! - `healthy_s`: from `cluster up` to a healthy cluster (or `null`: not within `--up-s`);
//! - `idle_cpu_pct`: each daemon's CPU over `--idle-s` seconds, as a percentage of one core,
//!   mean and busiest, after a settling pause;
//! - `rss_mib`: each idle daemon's resident memory, mean and largest;
//! - `create_ms`: `psls create` (CLI included) through n0, p50 and p99 of `--creates`;
//! - `create_conn_ms`: as many creates over one client connection to n0 (no CLI process: the
//!   daemons' share of a create);
//! - `verdict_s`: from a kill -9 of the last node to n0's status showing it down;
//! - `run_true_s`: `psls run -n N -- /bin/true` through n0 (after the killed node is back);
//! - `connections`: each daemon's open connections (its `psls_connections` metric) on the
//!   message link and the request transport, mean and most, `--settle-s` seconds after that
//!   run (the connections it opened have had time to close when idle).
//!
//! One JSON object per size on stdout, then a table of each figure as a ratio to the first
//! size's (this machine is shared: compare within one run). A size whose cluster does not
//! become healthy is reported with what it reached and the next sizes are still tried.
//! Needs `psls` and `psls-node` next to this binary (`cargo build --release --workspace --bins`);
//! `bench/scale.sh` builds and runs it.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The control plane's figures at several cluster sizes.
#[derive(clap::Parser)]
#[command(name = "scale-bench", version, about)]
struct Cli {
    /// Cluster sizes (daemons), increasing, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [4, 8, 16, 32, 64], value_parser = psls_bench::positive)]
    sizes: Vec<usize>,
    /// How long a cluster may take to become healthy, in seconds.
    #[arg(long, default_value_t = 240)]
    up_s: u64,
    /// How long idle CPU is measured, in seconds.
    #[arg(long, default_value_t = 20)]
    idle_s: u64,
    /// `psls create` calls timed per size.
    #[arg(long, default_value_t = 50)]
    creates: usize,
    /// Each node's memory, in MiB (small: 64 daemons share this machine).
    #[arg(long, default_value_t = 64)]
    memory_mb: u64,
    /// How long after the last run the daemons' connections are counted, in seconds (a
    /// connection closes after 30 s without a message).
    #[arg(long, default_value_t = 40)]
    settle_s: u64,
    /// Where the clusters' folders go (default: the system's temporary folder).
    #[arg(long)]
    dir: Option<PathBuf>,
}

fn main() -> Result<()> {
    let cli = <Cli as clap::Parser>::parse();
    if cli.sizes.windows(2).any(|w| w[0] >= w[1]) || cli.sizes.first().is_some_and(|n| *n < 2) {
        bail!("--sizes must be increasing, from 2");
    }
    let bin = std::env::current_exe()?.parent().context("no folder")?.to_path_buf();
    for b in ["psls", "psls-node"] {
        if !bin.join(b).exists() {
            bail!("{b} not found next to scale-bench: run `cargo build --release --workspace --bins` first");
        }
    }
    let tmp = tempfile::Builder::new()
        .prefix("scale-bench")
        .tempdir_in(cli.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let mut rows = Vec::new();
    for (k, &n) in cli.sizes.iter().enumerate() {
        let dir = tmp.path().join(format!("c{n}"));
        // Three ports per node, below the ephemeral range; a block of 1000 per size.
        let port = (20000 + (std::process::id() as usize * 7) % 6000 + (k % 6) * 1000) as u16;
        psls_client::cluster::init(&dir, n as u32, 0, cli.memory_mb, port, false)?;
        let r = measure(&cli, &bin, &dir, n);
        let _ = psls_client::cluster::down(&dir);
        let row = match r {
            Ok(row) => row,
            Err(e) => serde_json::json!({"nodes": n, "error": format!("{e:#}")}),
        };
        println!("{row}");
        rows.push(row);
    }
    table(&rows);
    Ok(())
}

fn measure(cli: &Cli, bin: &Path, dir: &Path, n: usize) -> Result<serde_json::Value> {
    let psls = |args: &[&str]| {
        Command::new(bin.join("psls"))
            .arg("--dir")
            .arg(dir)
            .args(args)
            .output()
            .context("running psls")
    };
    let t = Instant::now();
    let up = psls_client::cluster::up(dir, Duration::from_secs(cli.up_s), true);
    let healthy_s = t.elapsed().as_secs_f64();
    if let Err(e) = up {
        let logs = log_bytes(dir);
        return Ok(serde_json::json!({
            "nodes": n,
            "healthy_s": null,
            "not_healthy": format!("{e:#}"),
            "log_bytes": logs,
        }));
    }
    let cfg = psls_client::cluster::load(dir)?;
    let names: Vec<String> = cfg.all().map(|e| e.name.clone()).collect();
    let pids: Vec<i32> = names
        .iter()
        .map(|name| psls_client::cluster::running_pid(dir, name).context("a daemon's pid"))
        .collect::<Result<_>>()?;
    // Settle (first heartbeats, leases, the log's first entries), then measure.
    std::thread::sleep(Duration::from_secs(5));
    let before: Vec<u64> = pids.iter().map(|p| cpu_ticks(*p)).collect();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(cli.idle_s));
    let secs = t.elapsed().as_secs_f64();
    // SAFETY: sysconf reads a constant of the system; no pointer is involved.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let cpu: Vec<f64> = pids
        .iter()
        .zip(&before)
        .map(|(p, b)| (cpu_ticks(*p).saturating_sub(*b)) as f64 / hz / secs * 100.0)
        .collect();
    let rss: Vec<f64> = pids.iter().map(|p| rss_kib(*p) as f64 / 1024.0).collect();
    let mut create_ms = Vec::with_capacity(cli.creates);
    for i in 0..cli.creates {
        let name = format!("scale-{i}");
        let t = Instant::now();
        let o = psls(&["--node", "n0", "create", &name, "--size", "4K"])?;
        if !o.status.success() {
            bail!("psls create: {}", String::from_utf8_lossy(&o.stderr));
        }
        create_ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    create_ms.sort_by(f64::total_cmp);
    // The same creates over one client connection (no CLI process): the daemons' share.
    let mut client = psls_client::cluster::connect(dir, Some("n0"))?;
    let mut create_conn_ms = Vec::with_capacity(cli.creates);
    for i in 0..cli.creates {
        let t = Instant::now();
        client.create(&format!("scale-conn-{i}"), 4096, 0o644)?;
        create_conn_ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    drop(client);
    create_conn_ms.sort_by(f64::total_cmp);
    // kill -9 of the last node; n0's status shows it down.
    let victim = names.last().context("no node")?.clone();
    let vpid = *pids.last().context("no node")?;
    let t = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(vpid), nix::sys::signal::Signal::SIGKILL)?;
    let mut verdict_s = None;
    while t.elapsed() < Duration::from_secs(60) {
        let o = psls(&["--node", "n0", "cluster", "status", "--json"])?;
        let st: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        let down = st["nodes"]
            .as_array()
            .is_some_and(|ns| ns.iter().any(|x| x["name"] == victim.as_str() && x["state"] == "down"));
        if down {
            verdict_s = Some(t.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    psls_client::cluster::up(dir, Duration::from_secs(cli.up_s), true)?;
    let t = Instant::now();
    let ranks = n.to_string();
    let o = psls(&["--node", "n0", "run", "-n", &ranks, "--", "/bin/true"])?;
    let run_true_s = o.status.success().then(|| t.elapsed().as_secs_f64());
    std::thread::sleep(Duration::from_secs(cli.settle_s));
    let mut link = Vec::new();
    let mut request = Vec::new();
    for e in cfg.all() {
        let Some(addr) = e.metrics_addr else { continue };
        let text = scrape(addr).with_context(|| format!("scraping {}'s metrics", e.name))?;
        link.push(sample(&text, "psls_connections{transport=\"link\"}").unwrap_or(f64::NAN));
        request.push(sample(&text, "psls_connections{transport=\"request\"}").unwrap_or(f64::NAN));
    }
    Ok(serde_json::json!({
        "nodes": n,
        "healthy_s": healthy_s,
        "idle_cpu_pct": {"mean": mean(&cpu), "max": max(&cpu)},
        "rss_mib": {"mean": mean(&rss), "max": max(&rss)},
        "create_ms": {"p50": pct(&create_ms, 50), "p99": pct(&create_ms, 99)},
        "create_conn_ms": {"p50": pct(&create_conn_ms, 50), "p99": pct(&create_conn_ms, 99)},
        "verdict_s": verdict_s,
        "run_true_s": run_true_s,
        "connections": {
            "link": {"mean": mean(&link), "max": max(&link)},
            "request": {"mean": mean(&request), "max": max(&request)},
        },
        "log_bytes": log_bytes(dir),
    }))
}

/// A process's user and system CPU so far, in clock ticks (0 if it is gone).
fn cpu_ticks(pid: i32) -> u64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // After the command's closing parenthesis: state is field 3; utime and stime 14 and 15.
    let Some((_, rest)) = s.rsplit_once(')') else { return 0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let at = |i: usize| f.get(i - 3).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    at(14) + at(15)
}

/// A process's resident memory, in KiB (0 if it is gone).
fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// The text of `GET /metrics` at `addr`.
fn scrape(addr: std::net::SocketAddr) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    match text.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_string()),
        _ => bail!("no metrics from {addr}: {}", text.lines().next().unwrap_or_default()),
    }
}

/// The value of the sample `series` (labels exactly as printed) in a metrics text.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// Bytes of the daemons' logs so far.
fn log_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir.join("logs"))
        .map(|d| d.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// The `p`-th percentile of sorted `v`.
fn pct(v: &[f64], p: usize) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() - 1) * p).div_ceil(100).min(v.len() - 1)]
}

/// A figure of a row.
type Figure<'a> = (&'a str, &'a dyn Fn(&serde_json::Value) -> Option<f64>);

/// Each figure as a ratio to the first size's.
fn table(rows: &[serde_json::Value]) {
    let figures: [Figure; 10] = [
        ("healthy_s", &|r| r["healthy_s"].as_f64()),
        ("idle_cpu_pct mean", &|r| r["idle_cpu_pct"]["mean"].as_f64()),
        ("idle_cpu_pct max", &|r| r["idle_cpu_pct"]["max"].as_f64()),
        ("rss_mib mean", &|r| r["rss_mib"]["mean"].as_f64()),
        ("create_ms p50", &|r| r["create_ms"]["p50"].as_f64()),
        ("create_conn_ms p50", &|r| r["create_conn_ms"]["p50"].as_f64()),
        ("verdict_s", &|r| r["verdict_s"].as_f64()),
        ("run_true_s", &|r| r["run_true_s"].as_f64()),
        ("link conns mean", &|r| r["connections"]["link"]["mean"].as_f64()),
        ("link conns max", &|r| r["connections"]["link"]["max"].as_f64()),
    ];
    let Some(first) = rows.first() else { return };
    print!("{:<20}", "figure");
    for r in rows {
        print!("{:>16}", format!("N={}", r["nodes"]));
    }
    println!();
    for (name, get) in figures {
        print!("{name:<20}");
        let base = get(first);
        for r in rows {
            let cell = match (get(r), base) {
                (Some(v), Some(b)) if b > 0.0 => format!("{v:.3} ({:.2}x)", v / b),
                (Some(v), _) => format!("{v:.3}"),
                (None, _) => "-".to_string(),
            };
            print!("{cell:>16}");
        }
        println!();
    }
}
