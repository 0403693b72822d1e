//! The first job after `psls cluster up` runs: twenty fresh clusters, each running a job with
//! checkpoints at once, each within 30 s. (It used to hang now and then with no log line: a
//! node's checkpoint participant knew no coordinator until its first periodic tick and
//! dropped the first round's `Prepare`.) Each rank adds to a word of a page of its own (four
//! pages for four ranks: ranks sharing a page would race on it, with no lock).

use psls_tests::*;
use std::process::Stdio;
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");

#[test]
fn twenty_fresh_clusters_each_run_a_first_job_at_once() {
    for k in 0..20 {
        let c = Cluster::start(4, 0);
        let t = Instant::now();
        let mut run = c
            .cmd(&[
                "run", "-n", "4", "--", PROBE, "steps", "first", "4", "5", "99", "64", "0",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("psls run");
        while run.try_wait().expect("wait").is_none() {
            if t.elapsed() > Duration::from_secs(30) {
                let _ = run.kill();
                let logs: String = ["n0", "n1", "n2", "n3"].iter().map(|n| c.log(n)).collect();
                panic!("cluster {k}: the first job did not end within 30 s\n{logs}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = run.wait_with_output().expect("output");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "cluster {k}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        for r in 0..4 {
            assert!(out.contains(&format!("[{r}] done 15")), "cluster {k}, rank {r}:\n{out}");
        }
        eprintln!("cluster {k}: first job in {:?}", t.elapsed());
    }
}

/// Two `psls cluster up` at once, with one daemon down: both succeed (the second waits for the
/// first's starts, and says so), exactly one daemon runs for the node, and the pid file names
/// it. Before, at least one exited 1 with `data dir … is in use by another psls-node (pid )`.
#[test]
fn two_cluster_ups_at_once_both_succeed_and_start_the_node_once() {
    let c = Cluster::start(4, 0);
    for round in 0..3 {
        c.kill("n2");
        let ups: Vec<std::process::Child> = (0..2)
            .map(|_| {
                c.cmd(&["cluster", "up"])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("cluster up")
            })
            .collect();
        for up in ups {
            let o = up.wait_with_output().expect("cluster up");
            assert!(
                o.status.success(),
                "round {round}: a cluster up failed: {}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        let pid = c.pid("n2");
        let daemons = std::fs::read_dir("/proc")
            .expect("proc")
            .filter_map(|e| e.ok())
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .filter(|cmd| {
                let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
                args.windows(2)
                    .any(|w| w[0] == b"--config" && w[1] == c.dir.join("cluster.toml").as_os_str().as_encoded_bytes())
                    && args.windows(2).any(|w| w[0] == b"--node" && w[1] == b"n2")
            })
            .count();
        assert_eq!(daemons, 1, "round {round}: one daemon for n2");
        assert!(c.log("n2").contains("psls-node ready"), "round {round}");
        let cfg = c.config();
        let lock = std::fs::read_to_string(cfg.data_dir(cfg.entry("n2").expect("n2")).join("lock")).expect("lock");
        assert_eq!(
            lock.trim(),
            pid.to_string(),
            "round {round}: the pid file names the daemon"
        );
    }
}
