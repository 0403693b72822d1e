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
