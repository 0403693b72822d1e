//! No false verdicts under load: a fault-free job of 2 minutes (`PSLS_LOAD_SECS` to change it)
//! — four ranks stepping every 100 ms with a safe-point call, a checkpoint every second —
//! beside two CPU-bound processes on this 2-core machine. The failure detector's hysteresis
//! and the coordinator's verdicts must never take a slow node for a dead one: no node is
//! declared down, none rejoins, and the job ends with the right sums.

use psls_tests::*;
use std::process::{Command, Stdio};
use std::time::Instant;

const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");

/// Two busy loops, killed on drop.
struct Hogs(Vec<std::process::Child>);

impl Drop for Hogs {
    fn drop(&mut self) {
        for h in &mut self.0 {
            let _ = h.kill();
            let _ = h.wait();
        }
    }
}

#[test]
fn a_long_job_beside_cpu_hogs_gets_no_down_verdict() {
    let secs: u64 = std::env::var("PSLS_LOAD_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let c = Cluster::start(4, 0);
    let incs: Vec<u64> = c.status().nodes.iter().map(|n| n.incarnation).collect();
    let _hogs = Hogs(
        (0..2)
            .map(|_| {
                Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .spawn()
                    .expect("busy loop")
            })
            .collect(),
    );
    let steps = (secs * 10).to_string();
    let t = Instant::now();
    let o = c
        .cmd(&[
            "--node",
            "n1",
            "run",
            "-n",
            "4",
            "--checkpoint-interval",
            "1",
            "--",
            PROBE,
            "steps",
            "load",
            "4",
            &steps,
            "99",
            "64",
            "100",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("psls run");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{out}\n{err}");
    // Every rank added step + 1 for every step to its word: n (n + 1) / 2.
    let n: u64 = steps.parse().expect("steps");
    let sum = n * (n + 1) / 2;
    for r in 0..4 {
        assert!(out.contains(&format!("[{r}] done {sum}")), "rank {r}'s sum:\n{out}");
    }
    assert!(!err.contains("rolling job"), "no rollback: {err}");
    for node in ["n0", "n1", "n2", "n3"] {
        let log = c.log(node);
        assert!(
            !log.contains("node declared down") && !log.contains("fenced:"),
            "{node} saw a down verdict under load:\n{log}"
        );
    }
    let after: Vec<u64> = c.status().nodes.iter().map(|n| n.incarnation).collect();
    assert_eq!(after, incs, "no node rejoined");
    eprintln!("{secs} s of load: no down verdict; the job took {:?}", t.elapsed());
}
