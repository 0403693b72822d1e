//! Every node serves Prometheus metrics on its `metrics_addr`: the output passes `promtool
//! check metrics` (the distribution's `prometheus` package), holds the families
//! `deploy/README.md` promises with the counts a job leaves, and a node killed -9 shows as
//! down in the survivors' metrics within twice the failure timeout plus one scrape. The
//! Grafana dashboard and the Prometheus config and alerts in `deploy/` name only metrics the
//! nodes export, and pass promtool's checks.

use psls_tests::*;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// One HTTP/1.1 request to `addr`: (status line, body).
fn http(addr: std::net::SocketAddr, request: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect to metrics");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(request.as_bytes()).expect("send request");
    let mut text = String::new();
    // A request the node refuses may be cut off unanswered (the connection reset).
    let _ = s.read_to_string(&mut text);
    match text.split_once("\r\n\r\n") {
        Some((head, body)) => (head.lines().next().unwrap_or_default().to_string(), body.to_string()),
        None => (String::new(), text),
    }
}

fn scrape(addr: std::net::SocketAddr) -> String {
    let (status, body) = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    body
}

/// The value of the sample `name{labels}` (labels exactly as printed), if any.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .map(|v| v.trim().parse().expect("a number"))
}

fn promtool() -> Option<PathBuf> {
    let found = std::process::Command::new("sh")
        .args(["-c", "command -v promtool"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    Some(PathBuf::from(String::from_utf8_lossy(&found.stdout).trim()))
}

fn promtool_ok(tool: &Path, args: &[&str], stdin: Option<&str>) {
    let mut cmd = std::process::Command::new(tool);
    cmd.args(args)
        .current_dir(repo().join("deploy"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("run promtool");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("feed promtool");
    }
    drop(child.stdin.take());
    let o = child.wait_with_output().expect("promtool ends");
    assert!(
        o.status.success(),
        "promtool {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn nodes_serve_valid_metrics_and_a_killed_node_shows_down_within_two_timeouts_and_a_scrape() {
    let Some(tool) = promtool() else {
        println!("skipped: promtool is not installed (Debian's `prometheus` package; scripts/setup.sh installs it)");
        return;
    };
    let c = Cluster::start(4, 0);
    let cfg = c.config();
    let addr = |n: &str| {
        cfg.entry(n)
            .and_then(|e| e.metrics_addr)
            .unwrap_or_else(|| panic!("cluster init gives {n} a metrics_addr"))
    };
    // A job: faults, checkpoints of both levels, link messages, metadata operations, disk.
    c.ok(&["create", "st", "--size", "16K"]);
    let out = c.ok(&[
        "run",
        "-n",
        "4",
        "--persistent-every",
        "3",
        "--",
        PROBE,
        "steps",
        "st",
        "4",
        "9",
        "99",
        "64",
        "0",
    ]);
    assert!(out.contains("[0] done 45"), "{out}");
    let mut texts = Vec::new();
    for n in ["n0", "n1", "n2", "n3"] {
        let text = scrape(addr(n));
        promtool_ok(&tool, &["check", "metrics"], Some(&text));
        for family in [
            "psls_node_state",
            "psls_node_incarnation",
            "psls_verdicts_total",
            "psls_fault_seconds",
            "psls_link_messages_total",
            "psls_link_bytes_total",
            "psls_connections",
            "psls_link_closes_total",
            "psls_recovery_frames",
            "psls_dirty_pages",
            "psls_checkpoint_pause_seconds",
            "psls_checkpoint_commit_seconds",
            "psls_rollbacks_total",
            "psls_rebuild_pages",
            "psls_meta_ops_total",
            "psls_disk_bytes_total",
            "psls_fsync_seconds",
        ] {
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{n} has no {family}:\n{text}"
            );
        }
        for m in ["n0", "n1", "n2", "n3"] {
            assert_eq!(
                sample(&text, &format!("psls_node_state{{node=\"{m}\",state=\"up\"}}")),
                Some(1.0),
                "{n} sees {m} up:\n{text}"
            );
        }
        // Every node ran a rank: it faulted, wrote to its disks and fsynced them.
        let count = |series: &str| sample(&text, series).unwrap_or(0.0);
        assert!(
            count("psls_fault_seconds_count{kind=\"read\"}") + count("psls_fault_seconds_count{kind=\"write\"}") > 0.0,
            "{n}: faults\n{text}"
        );
        assert!(
            count("psls_disk_bytes_total{direction=\"written\",disk=\"meta\"}") > 0.0,
            "{n}\n{text}"
        );
        assert!(count("psls_fsync_seconds_count{disk=\"meta\"}") > 0.0, "{n}\n{text}");
        texts.push(text);
    }
    // The coordinator counted each of the job's checkpoints once: its 9 safe-point calls took
    // 6 memory and 3 persistent ones (every third), and its end a memory and a persistent one.
    let committed = |level: &str| -> f64 {
        texts
            .iter()
            .map(|t| sample(t, &format!("psls_checkpoint_commit_seconds_count{{level=\"{level}\"}}")).unwrap_or(0.0))
            .sum()
    };
    assert_eq!((committed("memory"), committed("persistent")), (7.0, 4.0));
    // Not metrics: answered, and the node goes on.
    let (status, _) = http(addr("n1"), "POST /metrics HTTP/1.1\r\n\r\n");
    assert!(status.contains("405"), "{status}");
    let (status, _) = http(addr("n1"), "GET /nothing HTTP/1.1\r\n\r\n");
    assert!(status.contains("404"), "{status}");
    let (status, _) = http(addr("n1"), &format!("GET /{} HTTP/1.1\r\n\r\n", "x".repeat(20_000)));
    assert!(status.is_empty() || status.contains("404"), "{status}");
    scrape(addr("n1"));

    // kill -9 of n3: every survivor's metrics show it down within 2 × the failure timeout
    // plus one scrape interval (a scrape a second here).
    let timeout = Duration::from_millis(cfg.cluster.heartbeat_timeout_ms);
    let scrape_interval = Duration::from_secs(1);
    c.kill("n3");
    let killed = Instant::now();
    let mut seen: Vec<(&str, Duration)> = Vec::new();
    while seen.len() < 3 && killed.elapsed() < Duration::from_secs(30) {
        for n in ["n0", "n1", "n2"] {
            if seen.iter().any(|(m, _)| *m == n) {
                continue;
            }
            if sample(&scrape(addr(n)), "psls_node_state{node=\"n3\",state=\"down\"}") == Some(1.0) {
                seen.push((n, killed.elapsed()));
            }
        }
        std::thread::sleep(scrape_interval);
    }
    assert_eq!(seen.len(), 3, "not every survivor saw n3 down: {seen:?}");
    println!("n3 shown down after the kill: {seen:?} (failure timeout {timeout:?})");
    for (n, at) in &seen {
        assert!(
            *at <= 2 * timeout + scrape_interval,
            "{n} showed n3 down {at:?} after the kill (limit {:?})",
            2 * timeout + scrape_interval
        );
    }
    // The coordinator committed one verdict on n3.
    wait_for(Duration::from_secs(10), "the verdict on n3 counted", || {
        ["n0", "n1", "n2"]
            .iter()
            .map(|n| sample(&scrape(addr(n)), "psls_verdicts_total{peer=\"n3\"}").unwrap_or(0.0))
            .sum::<f64>()
            == 1.0
    });

    // deploy/: the Prometheus config and alerts pass promtool; the dashboard's queries name
    // only metrics the nodes export.
    promtool_ok(&tool, &["check", "config", "prometheus.yml"], None);
    promtool_ok(&tool, &["check", "rules", "psls-alerts.yml"], None);
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("deploy/grafana/psls-dashboard.json")).expect("read the dashboard"),
    )
    .expect("the dashboard is JSON");
    let exprs: Vec<String> = dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().expect("an expr").to_string())
        .collect();
    assert!(exprs.len() >= 10, "{exprs:?}");
    let exported = &texts[0];
    for e in &exprs {
        for name in e
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("psls_"))
        {
            let family = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            assert!(
                exported.contains(&format!("# TYPE {family} ")),
                "the dashboard's {e:?} names {name}, which no node exports"
            );
        }
    }
}
