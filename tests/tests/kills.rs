//! Kills at the exact instants of a job's checkpoints and rollbacks that matter, made with the
//! daemons' failpoints (`psls-node/src/failpoint.rs`): a participant halfway through its
//! checkpoint writes, the coordinator with the commit record durable but no node told, the
//! coordinator with the checkpoint committed but the ranks not yet answered, the coordinator
//! asked to fence during a rollback, a node asked to drop the job's pages during a rollback,
//! and a power cut while a checkpoint's writes are under way. Every time, the job ends with
//! the sums of a run that never failed — in its parallel file and in its volatile segment, so
//! neither ever mixes two checkpoints nor loses one.

use psls_tests::*;
use std::io::Read;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");
const STEPS: u64 = 30;
const RANKS: u32 = 4;

/// A cluster whose daemons arm `points`; returns it and the failpoint directory.
fn cluster(points: &str, fault_disk: bool) -> (Cluster, std::path::PathBuf) {
    let mut c = Cluster::init(4, 0, |_| {});
    let dir = c.tmp.path().join("failpoints");
    std::fs::create_dir_all(&dir).expect("failpoint dir");
    c.env.push(("PSLS_FAILPOINTS".into(), points.into()));
    c.env.push(("PSLS_FAILPOINT_DIR".into(), dir.display().to_string()));
    if fault_disk {
        c.env.push(("PSLS_FAULT_DISK".into(), "1".into()));
    }
    c.ok(&["cluster", "up"]);
    (c, dir)
}

/// The probe's job: every rank adds its step to a word of the file and of the job's volatile
/// segment, with a safe-point call (its step as state) at the top of every step; persistent
/// checkpoints (the failpoints are in their writes and commit record).
fn start(c: &Cluster, launcher: &str) -> Child {
    start_at(c, launcher, "persistent")
}

/// [`start`] with checkpoints at `level`.
fn start_at(c: &Cluster, launcher: &str, level: &str) -> Child {
    let steps = STEPS.to_string();
    c.cmd(&[
        "--node", launcher, "run", "-n", "4", "--level", level, "--", PROBE, "steps", "kp", "4", &steps, "99", "64",
        "40", "vol",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("psls run")
}

/// The failpoints fired so far: (point, node).
fn fired(dir: &std::path::Path) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::fs::read_dir(dir)
        .expect("failpoint dir")
        .filter_map(|e| e.ok())
        .map(|e| {
            let node = std::fs::read_to_string(e.path()).unwrap_or_default();
            (e.file_name().to_string_lossy().into_owned(), node)
        })
        // A marker is created, then names its node, then the node dies (or pauses, until
        // the test releases it).
        .filter(|(point, node)| !node.is_empty() && !point.ends_with(".release"))
        .collect();
    v.sort();
    v
}

/// Waits for the job, bringing back up every daemon a failpoint killed (once it is gone) and
/// calling `on_pause` with every point that paused — those that had not fired when it was
/// called; returns its stdout and stderr.
fn run_through(c: &Cluster, mut ch: Child, dir: &std::path::Path, on_pause: &mut dyn FnMut(&str)) -> (String, String) {
    let mut err_pipe = ch.stderr.take().expect("stderr");
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let mut handled: std::collections::BTreeSet<(String, String)> = fired(dir).into_iter().collect();
    let t = Instant::now();
    while ch.try_wait().expect("wait").is_none() {
        assert!(t.elapsed() < Duration::from_secs(240), "the job did not end");
        let new: Vec<(String, String)> = fired(dir).into_iter().filter(|p| !handled.contains(p)).collect();
        if !new.is_empty() {
            let mut killed = false;
            for (point, node) in &new {
                if node.ends_with(" paused") {
                    on_pause(point);
                    std::fs::write(dir.join(format!("{point}.release")), b"").expect("release");
                    continue;
                }
                killed = true;
                if let Some(pid) = psls_client::cluster::running_pid(&c.dir, node) {
                    assert!(
                        psls_client::cluster::wait_gone(pid, Duration::from_secs(10)),
                        "{node} did not die at failpoint {point}"
                    );
                }
            }
            handled.extend(new);
            if !killed {
                continue;
            }
            let o = c.run(&["cluster", "up"]);
            // A point that fired while `cluster up` waited for the cluster: handled next.
            if !o.status.success() && fired(dir).len() == handled.len() {
                for n in ["n0", "n1", "n2", "n3"] {
                    let log = c.log(n);
                    let tail: Vec<&str> = log.lines().rev().take(40).collect();
                    eprintln!("--- {n}:\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
                }
                panic!("cluster up failed: {}", String::from_utf8_lossy(&o.stderr));
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = ch.wait_with_output().expect("wait");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let err = err.join().expect("stderr reader");
    assert!(o.status.success(), "job failed ({}):\n{out}\n{err}", o.status);
    c.assert_no_rank_left("after the job");
    (out, err)
}

/// Every rank ended with the sums of a run that never failed, in the file and in the
/// volatile segment.
fn assert_sums(out: &str, err: &str) {
    let sum = STEPS * (STEPS + 1) / 2;
    for r in 0..RANKS {
        assert!(
            out.contains(&format!("[{r}] done {sum} {sum}")),
            "rank {r} did not end with {sum} {sum}:\n{out}\n{err}"
        );
    }
}

#[test]
fn a_participant_killed_in_its_checkpoint_writes_and_a_node_killed_during_the_rollback() {
    let (c, dir) = cluster("ckpt.write/n2@3,rollback.drop/n3", false);
    let (out, err) = run_through(&c, start(&c, "n0"), &dir, &mut |_| {});
    assert_eq!(
        fired(&dir),
        vec![
            ("ckpt.write.n2".into(), "n2".into()),
            ("rollback.drop.n3".into(), "n3".into())
        ],
        "{err}"
    );
    assert_sums(&out, &err);
    // (Checkpoint E saves step E - 1.) One rollback, from a checkpoint before the one n2 died in (it never committed), done
    // in two passes (n3 died in the first).
    assert_eq!(err.matches("restarted from").count(), 1, "{err}");
    assert!(err.contains("restarted from checkpoint 2"), "{err}");
    assert!(out.contains("restarted from epoch 2 at step 1"), "{out}");
    assert!(c.logs_contain("rollback interrupted: trying again"));
    // The job's checkpoint area, volatile segment included, went with it.
    let ls = c.ok(&["ls"]);
    assert!(!ls.contains(".psls-ckpt"), "{ls}");
}

/// A rank that maps its file writable before its daemon has it in its table of ranks (the
/// daemon held up right after the fork) is its job's, not a process of its own refused as a
/// writer by its own job's claim.
#[test]
fn a_rank_that_maps_its_file_before_its_daemon_knows_it_is_its_jobs() {
    let (c, dir) = cluster("launch.spawned/n2:pause=3000", false);
    let (out, err) = run_through(&c, start(&c, "n0"), &dir, &mut |_| {
        // The rank has long mapped its file when the daemon goes on.
        std::thread::sleep(Duration::from_millis(700));
    });
    assert_eq!(
        fired(&dir),
        vec![("launch.spawned.n2".into(), "n2 paused".into())],
        "{err}"
    );
    assert_sums(&out, &err);
    assert_eq!(err.matches("restarted from").count(), 0, "{err}");
    assert!(!c.logs_contain("is mapped writable by job"), "{err}");
}

/// A start slow to prepare its ranks (n1 held up after reading their output numbers) while
/// the job rolls back once more starts none of them once the newer start began: no rank of an
/// older start runs beside a newer one (the nemesis met a C job whose rank 1 ran twice, and
/// lost the newer one's output).
#[test]
fn a_start_overtaken_by_a_newer_one_starts_no_rank() {
    let (c, dir) = cluster("launch.prepared/n1@2:pause=60000", false);
    let mut run = start(&c, "n0");
    let (job, rest) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    // Restart 1: n1 prepares it, and is held up.
    c.kill("n3");
    c.ok(&["cluster", "up"]);
    wait_for(Duration::from_secs(60), "n1 held up preparing start 1", || {
        !fired(&dir).is_empty()
    });
    // Restart 2 begins (and starts rank 1 on n1) meanwhile.
    c.kill("n2");
    c.ok(&["cluster", "up"]);
    let newer = format!("starting ranks node=n1 job=\"{job}\" attempt=2");
    wait_for(Duration::from_secs(60), "start 2 on n1", || {
        c.log("n1").contains(&newer)
    });
    std::fs::write(dir.join("launch.prepared.n1.release"), b"").expect("release");
    let mut err = String::new();
    let mut rest = rest;
    rest.read_to_string(&mut err).expect("stderr");
    let o = run.wait_with_output().expect("wait");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "job failed ({}):\n{out}\n{err}", o.status);
    assert_sums(&out, &err);
    assert_eq!(err.matches("restarted from").count(), 2, "{err}");
    let older = format!("rank exited node=n1 job={job} attempt=1");
    assert!(
        !c.log("n1").contains(&older),
        "a rank of start 1 ran on n1 beside start 2's:\n{}",
        c.log("n1")
    );
    c.assert_no_rank_left("after the job");
}

#[test]
fn the_coordinator_killed_after_a_commit_record_before_answering_the_ranks_and_during_a_rollback() {
    let (c, dir) = cluster("ckpt.committed@3,rollback.fence,ckpt.answer@6", false);
    // The launcher is not the coordinator (n0, the lowest live logical id).
    let (out, err) = run_through(&c, start(&c, "n3"), &dir, &mut |_| {});
    let points: Vec<String> = fired(&dir).into_iter().map(|(p, _)| p).collect();
    assert_eq!(points, vec!["ckpt.answer", "ckpt.committed", "rollback.fence"], "{err}");
    assert_sums(&out, &err);
    // Checkpoint 3's record was durable when the coordinator died: the job restarts from it,
    // not from 2. Then once more, from the checkpoint whose ranks were never answered.
    assert!(err.contains("restarted from checkpoint 3"), "{err}");
    assert!(out.contains("restarted from epoch 3 at step 2"), "{out}");
    assert_eq!(err.matches("restarted from").count(), 2, "{err}");
}

#[test]
fn a_power_cut_during_a_checkpoints_writes_resumes_from_the_one_before() {
    let (c, dir) = cluster("ckpt.write/n1@4:pause", true);
    let mut run = start(&c, "n0");
    let (job, _rest) = job_id(&mut run);
    wait_for(Duration::from_secs(60), "n1 in checkpoint 4's writes", || {
        !fired(&dir).is_empty()
    });
    // Some of checkpoint 4's pages are durable on some nodes, n1's half written: the power
    // goes.
    c.power_cut_during(run);
    // Back up, the job rolls back by itself (to checkpoint 3: the output below says so) and
    // may take later checkpoints before the resume, which follows it.
    let entry = c.job_entry(&job);
    assert!(entry["epoch"].as_u64().unwrap_or(0) >= 3, "{entry}");
    let resumed = c
        .cmd(&["--node", "n2", "run", "--resume", &job])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run --resume");
    let (out, err) = run_through(&c, resumed, &dir, &mut |_| {});
    assert!(out.contains("restarted from epoch 3 at step 2"), "{out}");
    assert_sums(&out, &err);
}

#[test]
fn a_slow_checkpoint_and_a_slow_rollback_show_their_progress_in_psls_jobs() {
    // n1 is slow to write checkpoint 2; n3 dies writing checkpoint 5, and n2 is slow to drop
    // the job's pages in the rollback that follows.
    let (c, dir) = cluster(
        "ckpt.write/n1@2:pause=30000,ckpt.write/n3@5,rollback.drop/n2:pause=30000",
        false,
    );
    let mut seen = Vec::new();
    let (out, err) = run_through(&c, start(&c, "n0"), &dir, &mut |point| {
        let jobs = c.ok(&["jobs"]);
        let now = jobs
            .lines()
            .find_map(|l| l.trim().strip_prefix("now: "))
            .unwrap_or_else(|| panic!("{point}: nothing in progress shown:\n{jobs}"))
            .to_string();
        match point {
            "ckpt.write.n1" => {
                assert!(now.starts_with("persistent checkpoint 2: writing pages (for "), "{now}");
                let waiting = now.split("waiting for ").nth(1).unwrap_or("");
                assert!(waiting.split(", ").any(|n| n == "n1"), "{now}");
            }
            "rollback.drop.n2" => {
                assert!(
                    now.starts_with("rolling back: restoring the newest intact checkpoint (for "),
                    "{now}"
                );
            }
            other => panic!("unexpected pause {other}"),
        }
        seen.push(point.to_string());
    });
    assert_eq!(seen, vec!["ckpt.write.n1", "rollback.drop.n2"], "{err}");
    assert_sums(&out, &err);
}

#[test]
fn memory_checkpoints_killed_in_phase_1_and_in_phase_2_and_their_coordinator_before_answering_the_ranks() {
    // n2 dies halfway through sending checkpoint 3's pages to their holders (phase 1: 3 never
    // commits); then n1 dies told that a later checkpoint committed, before its phase 2 (the
    // others committed it: it is restored from their copies); then the coordinator dies with a
    // checkpoint's pages taken everywhere, before the ranks were answered (they go on before
    // the decision, which then never comes: back to the one before).
    let (c, dir) = cluster("ckpt.mem.write/n2@3,ckpt.mem.commit/n1@5,ckpt.answer@9", false);
    let (out, err) = run_through(&c, start_at(&c, "n3", "memory"), &dir, &mut |_| {});
    let points: Vec<String> = fired(&dir).into_iter().map(|(p, _)| p).collect();
    assert_eq!(
        points,
        vec!["ckpt.answer", "ckpt.mem.commit.n1", "ckpt.mem.write.n2"],
        "{err}"
    );
    assert_sums(&out, &err);
    let from: Vec<u64> = err
        .lines()
        .filter(|l| l.starts_with("psls: job "))
        .filter_map(|l| {
            l.split("restarted from checkpoint ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(from.len(), 3, "{err}");
    // Phase 1 of 3 failed: back to 2.
    assert_eq!(from[0], 2, "{err}");
    // Every later rollback went to a checkpoint after the one before.
    assert!(from[1] > from[0] && from[2] > from[1], "{from:?}\n{err}");
    // No persistent checkpoint: every rollback was in memory (recovery copies re-created).
    assert!(c.logs_contain("recovery copies re-created"));
    assert!(!c.logs_contain("recovery copies lost on more than one node"));
}

/// The daemon `psls run` talks to killed halfway through a persistent checkpoint's writes, then
/// again, back up, while the rollback that follows drops the job's pages: `psls run` follows
/// the job from another node each time, and prints every line of every rank once, in order.
#[test]
fn psls_runs_own_daemon_killed_in_a_checkpoints_writes_and_again_in_the_rollback() {
    let (c, dir) = cluster("ckpt.write/n2@3,rollback.drop/n2", false);
    let steps = STEPS.to_string();
    let run = c
        .cmd(&[
            "--node",
            "n2",
            "run",
            "-n",
            "4",
            "--level",
            "persistent",
            "--",
            PROBE,
            "steps",
            "kp",
            "4",
            &steps,
            "99",
            "64",
            "40",
            "vol",
        ])
        .env("PROBE_LINES", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run");
    let (out, err) = run_through(&c, run, &dir, &mut |_| {});
    assert_eq!(
        fired(&dir),
        vec![
            ("ckpt.write.n2".into(), "n2".into()),
            ("rollback.drop.n2".into(), "n2".into())
        ],
        "{err}"
    );
    assert_sums(&out, &err);
    assert!(err.contains("following job"), "{err}");
    let sum = STEPS * (STEPS + 1) / 2;
    for r in 0..RANKS {
        let prefix = format!("[{r}] ");
        let got: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix(&prefix)).collect();
        let mut want: Vec<String> = (0..STEPS).map(|s| format!("line {s}")).collect();
        want.push(format!("done {sum} {sum}"));
        assert_eq!(got, want, "rank {r}'s lines:\n{out}\n{err}");
    }
}

/// A node killed while the job finishes (every rank exited 0, its last checkpoints not yet
/// taken) lost the ranks' writes there since their last checkpoint: the job rolls back and
/// runs that part again, and its file on the disks holds the unfailed run's sums. Before, the
/// last cleaner went on without that node's part: the job said finished, and the disks held a
/// rank's word of a checkpoint before (found by the nemesis).
/// The job's driver killed once its finished result's memory checkpoint committed, before the
/// persistent one: the rollback restores that result and only writes it (no rank runs again),
/// and the disks hold the unfailed run's sums. Before, the rollback restarted the ranks from
/// the result's checkpoint, which holds no rank states: every rank was refused with "state
/// belongs to checkpoint 20, not 21" and the job was lost (found by the nemesis).
#[test]
fn the_driver_killed_between_the_finished_results_checkpoints_has_the_result_written() {
    let (c, dir) = cluster("job.finish.kept", false);
    let run = c
        .cmd(&[
            "--node", "n1", "run", "-n", "4", "--level", "memory", "--", PROBE, "steps", "kept", "4", "30", "99", "64",
            "20", "vol",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run");
    let (out, err) = run_through(&c, run, &dir, &mut |_| {});
    assert_eq!(fired(&dir).len(), 1, "the driver died at the point\n{err}");
    assert_eq!(
        out.matches("done ").count(),
        RANKS as usize,
        "every rank's result once\n{out}\n{err}"
    );
    assert!(!out.contains("restarted from epoch"), "no rank ran again\n{out}\n{err}");
    let data = c.export("kept", &[]);
    let sum = 30 * 31 / 2;
    for r in 0..RANKS as usize {
        let w = u64::from_le_bytes(data[r * 4096..r * 4096 + 8].try_into().expect("8 bytes"));
        assert_eq!(w, sum, "rank {r}'s word on the disks\n{err}");
    }
}

#[test]
fn a_node_killed_while_the_job_finishes_rolls_the_job_back_and_the_disks_hold_its_result() {
    killed_while_the_job_finishes(false);
}

/// The same with the node back on a blank disk: its copies and the ranks' writes there are
/// lost, and a cleaner committed without its part would hold older words (the nemesis met a
/// job that ended finished with a file differing from the unfailed run's: the wiped node,
/// whose records lagged, took part with nothing).
#[test]
fn a_node_back_on_a_blank_disk_while_the_job_finishes_rolls_the_job_back() {
    killed_while_the_job_finishes(true);
}

fn killed_while_the_job_finishes(wipe: bool) {
    let (c, dir) = cluster("job.finish:pause", false);
    let mut run = c
        .cmd(&[
            "--node", "n1", "run", "-n", "4", "--level", "memory", "--", PROBE, "steps", "fin", "4", "30", "99", "64",
            "20", "vol",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run");
    let _ = &mut run;
    let (out, err) = run_through(&c, run, &dir, &mut |_| {
        c.kill("n2");
        if wipe {
            let cfg = c.config();
            let data = cfg.data_dir(cfg.entry("n2").expect("n2"));
            for e in std::fs::read_dir(&data).expect("data dir").flatten() {
                let p = e.path();
                let _ = if p.is_dir() {
                    std::fs::remove_dir_all(&p)
                } else {
                    std::fs::remove_file(&p)
                };
            }
        }
        c.ok(&["cluster", "up"]);
    });
    assert_eq!(fired(&dir).len(), 1, "{err}");
    assert_sums(&out, &err);
    assert!(err.contains("restarted from checkpoint"), "the job rolled back\n{err}");
    let data = c.export("fin", &[]);
    let sum = STEPS * (STEPS + 1) / 2;
    for r in 0..RANKS as usize {
        let w = u64::from_le_bytes(data[r * 4096..r * 4096 + 8].try_into().expect("8 bytes"));
        assert_eq!(w, sum, "rank {r}'s word on the disks\n{err}");
    }
}
