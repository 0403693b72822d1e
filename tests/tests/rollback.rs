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

fn start_mgs(c: &Cluster, launcher: &str) -> Child {
    start_mgs_waiting(c, launcher, "30")
}

/// The levels of `job`'s committed checkpoints, in epoch order, from its coordinators' logs.
fn committed_levels(c: &Cluster, job: &str) -> Vec<(u64, String)> {
    let tag = format!("job=\"{job}\"");
    let mut v: Vec<(u64, String)> = ["n0", "n1", "n2", "n3"]
        .iter()
        .flat_map(|n| {
            c.log(n)
                .lines()
                .filter(|l| l.contains("checkpoint committed") && l.contains(&tag))
                .map(|l| {
                    let field = |k: &str| {
                        l.split(&format!(" {k}="))
                            .nth(1)
                            .and_then(|r| r.split_whitespace().next())
                            .unwrap_or_default()
                            .to_string()
                    };
                    (field("epoch").parse().unwrap_or(0), field("level"))
                })
                .collect::<Vec<_>>()
        })
        .collect();
    v.sort();
    v
}

/// MGS whose rollbacks wait `respawn_s` seconds for a failed node before taking a spare.
fn start_mgs_waiting(c: &Cluster, launcher: &str, respawn_s: &str) -> Child {
    start_mgs_with(c, launcher, &["--respawn-timeout", respawn_s])
}

/// MGS with `extra` `psls run` options.
fn start_mgs_with(c: &Cluster, launcher: &str, extra: &[&str]) -> Child {
    let mgs = mgs_bin();
    let mut args = vec!["--node", launcher, "run", "-n", "4"];
    args.extend(extra);
    args.extend(["--", mgs.as_str()]);
    args.extend(MGS_ARGS);
    c.cmd(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run")
}

/// `psls run --resume JOB` of a job that runs: it follows it; the job's checksum.
fn follow_resume(c: &Cluster, node: &str, job: &str, what: &str) -> String {
    let mut resumed = c
        .cmd(&["--node", node, "run", "--resume", job])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run --resume");
    let (again, mut rest) = job_id(&mut resumed);
    assert_eq!(again, job);
    let (got, _) = finish(resumed, what);
    let mut err = String::new();
    rest.read_to_string(&mut err).expect("read");
    assert!(err.contains(&format!("job {job} is running: following it")), "{err}");
    got
}

/// `psls run --resume JOB` from `node`: the job's checksum, after checking it said it resumed.
fn resume(c: &Cluster, node: &str, job: &str, what: &str) -> String {
    let mut resumed = c
        .cmd(&["--node", node, "run", "--resume", job])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run --resume");
    let (again, mut rest) = job_id(&mut resumed);
    assert_eq!(again, job);
    let (got, _) = finish(resumed, what);
    let mut err = String::new();
    rest.read_to_string(&mut err).expect("read");
    assert!(err.contains(&format!("job {job} resumed from checkpoint")), "{err}");
    got
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
        let delay_ms = rng.below(800);
        let what = format!(
            "kill {k} (PSLS_SIM_SEED={seed}): {victim} {delay_ms} ms after the first checkpoint, launcher {launcher}"
        );
        let mut job = start_mgs(&c, &launcher);
        // While the job runs: a node that restarts between jobs is another story (noted in
        // ARCHITECTURE: its pages of files others held then, such as MGS's matrix in their
        // idle segments, stay fenced until those go).
        let (id, rest) = job_id(&mut job);
        wait_first_checkpoint(&c, &id);
        std::thread::sleep(Duration::from_millis(delay_ms));
        c.kill(&victim);
        std::thread::sleep(Duration::from_millis(500 + rng.below(1500)));
        c.ok(&["cluster", "up"]);
        let (got, err) = finish_rest(job, rest, &what);
        c.assert_no_rank_left(&what);
        assert_eq!(got, want, "{what}: checksum differs from the unfailed run's\n{err}");
        if err.contains("restarted from") {
            rolled_back += 1;
        }
    }
    // Most kills land while the job runs (the rest of it takes longer than most delays).
    assert!(
        rolled_back * 2 >= kills,
        "only {rolled_back} of {kills} kills rolled a job back"
    );
}

#[test]
fn after_a_power_cut_during_a_job_it_goes_on_by_itself_and_its_psls_run_follows_it_to_the_unfailed_checksum() {
    let mut c = Cluster::init(4, 0, |_| {});
    // Every daemon on the fault disk: killing them all loses every write not fsync'd.
    c.env.push(("PSLS_FAULT_DISK".into(), "1".into()));
    c.ok(&["cluster", "up"]);
    let (want, _) = finish(start_mgs(&c, "n0"), "the unfailed run");
    for delay_ms in [0, 300, 700] {
        let mut run = start_mgs(&c, "n1");
        let (job, mut err) = job_id(&mut run);
        // Once the job has a checkpoint (a cut before it leaves nothing to resume), some time
        // later — in a step, or in a checkpoint's writes.
        wait_first_checkpoint(&c, &job);
        std::thread::sleep(Duration::from_millis(delay_ms));
        // Every daemon dies at once; the `psls run` that started the job waits for the cluster.
        c.kill_all();
        c.ok(&["cluster", "up"]);
        // Job control rolls the job back to its newest intact checkpoint by itself. A resume
        // from another node follows it, as does the `psls run` that started it: both end with
        // the checksum of the run that never failed.
        if delay_ms == 0 {
            let got = follow_resume(&c, "n2", &job, "a resume of a running job");
            assert_eq!(got, want);
        }
        let what = format!("the job's own psls run after a power cut at {delay_ms} ms");
        let (got, text) = finish_rest(run, &mut err, &what);
        assert_eq!(got, want);
        assert!(text.contains("following job"), "{text}");
        let entry = c.job_entry(&job);
        assert_eq!(entry["state"], "finished", "{entry}");
    }
    // `psls halt` mid-job: a last checkpoint, and the job stops cleanly; resumed, it ends with
    // the same checksum, and checkpoints as it was told to at its start (the record keeps its
    // options: here persistent checkpoints only, where the default would take memory ones).
    let mut run = start_mgs_with(&c, "n3", &["--level", "persistent", "--cleaning", "total"]);
    let (job, mut rest) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    c.ok(&["halt", &job]);
    let o = run.wait_with_output().expect("psls run");
    let mut err = String::new();
    rest.read_to_string(&mut err).expect("read");
    assert_eq!(
        o.status.code(),
        Some(75),
        "a halted job ends with EX_TEMPFAIL, which batch scripts test for: {err}"
    );
    assert!(err.contains(&format!("job {job} halted after checkpoint")), "{err}");
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("\"bench\":\"mgs\""),
        "halted before its end"
    );
    assert!(c.ok(&["jobs"]).contains("resumable"));
    let before = committed_levels(&c, &job).len();
    assert_eq!(resume(&c, "n0", &job, "resume after a halt"), want);
    let levels = committed_levels(&c, &job);
    assert!(levels.len() >= before + 2, "{levels:?}");
    assert!(levels.iter().all(|(_, l)| l == "persistent"), "{levels:?}");
    // Bad input: resuming an unknown or finished job, removing one that does not exist.
    let e = c.fails(&["run", "--resume", "no-such-job"]);
    assert!(e.contains("no job no-such-job to resume"), "{e}");
    let e = c.fails(&["run", "--resume", &job]);
    assert!(e.contains(&format!("no job {job} to resume")), "a finished job: {e}");
    let e = c.fails(&["jobs", "rm", "no-such-job"]);
    assert!(e.contains("no job no-such-job"), "{e}");
}

#[test]
fn a_node_lost_with_its_disk_is_replaced_by_the_spare_and_the_job_finishes_with_the_unfailed_checksum() {
    let c = Cluster::start(4, 1);
    let (want, _) = finish(start_mgs(&c, "n0"), "the unfailed run");
    let mut run = start_mgs_waiting(&c, "n0", "2");
    let (job, mut err) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    // n2 and its disk are gone for good: after 2 s the spare takes logical id 2, re-creates
    // its copies, and the job goes on from its last checkpoint.
    c.destroy("n2");
    let (got, _) = finish(run, "after the loss of n2");
    let mut said = String::new();
    err.read_to_string(&mut said).expect("read");
    assert!(said.contains("restarted from checkpoint"), "{said}");
    assert_eq!(got, want, "{said}");
    let st = c.status();
    let s0 = st.nodes.iter().find(|n| n.name == "s0").expect("s0");
    assert_eq!(s0.logical, Some(2), "{st:?}");
}
