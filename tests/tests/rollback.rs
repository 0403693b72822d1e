//! Jobs that survive node failures (DESIGN §8): a node's daemon killed with SIGKILL at a random
//! moment of an MGS run with persistent checkpoints — any node, the coordinator too — comes
//! back; the job is rolled back to its last checkpoint, its ranks restart from it, and it ends
//! with the checksum of a run that never failed.
//!
//! `PSLS_KILLS=N` runs N kills (10 by default); `PSLS_SIM_SEED=S` picks the schedule (printed
//! on failure).

use psls_tests::*;
use std::io::Read;
use std::process::{Child, Stdio};
use std::time::Duration;

const ARGS: [&str; 7] = [
    "--vectors",
    "1024",
    "--dim",
    "1024",
    "--no-baseline",
    "--checkpoint-every",
    "50",
];

fn mgs() -> String {
    psls_tests::bin_dir().join("mgs").display().to_string()
}

fn start_mgs(c: &Cluster, launcher: &str) -> Child {
    let mgs = mgs();
    let mut args = vec![
        "--node",
        launcher,
        "run",
        "-n",
        "4",
        "--respawn-timeout",
        "30",
        "--",
        mgs.as_str(),
    ];
    args.extend(ARGS);
    c.cmd(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run")
}

/// Waits for the job; returns its checksum and what it said on stderr.
fn finish(mut ch: Child, what: &str) -> (String, String) {
    let mut err = String::new();
    ch.stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("read");
    let o = ch.wait_with_output().expect("wait");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{what}: job failed ({}):\n{out}\n{err}", o.status);
    let line = out
        .lines()
        .find(|l| l.contains("\"bench\":\"mgs\""))
        .unwrap_or_else(|| panic!("{what}: no result line:\n{out}\n{err}"));
    let j: serde_json::Value = serde_json::from_str(line.trim_start_matches("[0] ")).expect("json");
    assert_eq!(j["ok"], true, "{what}: {line}");
    (j["checksum"].as_str().expect("checksum").to_string(), err)
}

#[test]
fn mgs_survives_kill_9_of_any_node_at_random_moments_with_the_checksum_of_an_unfailed_run() {
    let c = Cluster::start(4, 0);
    let (want, _) = finish(start_mgs(&c, "n0"), "the unfailed run");
    let kills: u64 = std::env::var("PSLS_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let seed: u64 = std::env::var("PSLS_SIM_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut rng = psls_svm::rng::SplitMix64::new(seed);
    let mut rolled_back = 0;
    for k in 0..kills {
        let victim = rng.below(4);
        let launcher = format!("n{}", (victim + 1 + rng.below(3)) % 4);
        let victim = format!("n{victim}");
        let delay_ms = 200 + rng.below(2200);
        let what = format!("kill {k} (PSLS_SIM_SEED={seed}): {victim} after {delay_ms} ms, launcher {launcher}");
        let job = start_mgs(&c, &launcher);
        std::thread::sleep(Duration::from_millis(delay_ms));
        c.kill(&victim);
        std::thread::sleep(Duration::from_millis(500 + rng.below(1500)));
        c.ok(&["cluster", "up"]);
        let (got, err) = finish(job, &what);
        assert_eq!(got, want, "{what}: checksum differs from the unfailed run's\n{err}");
        if err.contains("restarted from") {
            rolled_back += 1;
        }
    }
    // Most kills land while the job runs (it takes longer than the longest delay).
    assert!(
        rolled_back * 2 >= kills,
        "only {rolled_back} of {kills} kills rolled a job back"
    );
}
