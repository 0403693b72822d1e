//! Memory checkpoints with real daemons (DESIGN §7–§8): MGS keeps its checkpoints in the nodes'
//! memories and writes nothing to the disks while it runs; a failure rolls it back to the
//! newest memory checkpoint, or to the persistent one when both recovery copies of some pages
//! are gone (two neighbouring nodes at once); a lost node's place is taken by the spare, which
//! receives fresh recovery copies so that a second failure right after is survived; a memory
//! too small for a memory checkpoint hands every checkpoint to the cleaner. Each job ends with
//! the checksum of a run that never failed.

use psls_tests::*;
use std::process::{Child, Stdio};
use std::time::Duration;

/// MGS 1024×1024 on 4 ranks from `launcher`, a safe point every 50 vectors, with `extra`
/// `psls run` options.
fn start(c: &Cluster, launcher: &str, extra: &[&str]) -> Child {
    let mgs = mgs_bin();
    let mut args = vec!["--node", launcher, "run", "-n", "4", "--respawn-timeout", "2"];
    args.extend(extra);
    args.extend(["--", mgs.as_str()]);
    args.extend(MGS_ARGS);
    c.cmd(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run")
}

/// `job`'s entry in `psls jobs --json`, if listed.
fn entry(c: &Cluster, job: &str) -> Option<serde_json::Value> {
    let list: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&c.ok(&["jobs", "--json"])).unwrap_or_default()["jobs"].clone();
    list.as_array()?.iter().find(|j| j["job"] == job).cloned()
}

/// Waits until `job` committed a memory checkpoint after a persistent one; returns the
/// memory epoch and the persistent one.
fn wait_memory_checkpoint(c: &Cluster, job: &str) -> (u64, u64) {
    let mut got = (0, 0);
    wait_for(
        Duration::from_secs(60),
        "a memory checkpoint after a persistent one",
        || {
            let Some(e) = entry(c, job) else { return false };
            let (epoch, persistent) = (
                e["epoch"].as_u64().unwrap_or(0),
                e["persistent_epoch"].as_u64().unwrap_or(0),
            );
            got = (epoch, persistent);
            e["level"] == "memory" && persistent > 0 && epoch > persistent
        },
    );
    got
}

/// The epoch a job's stderr says it restarted from (the last one said).
fn restarted_from(err: &str) -> u64 {
    err.lines()
        .rev()
        .filter_map(|l| l.split("restarted from checkpoint ").nth(1))
        .find_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("never restarted:\n{err}"))
}

#[test]
fn memory_checkpoints_write_nothing_to_the_disks_and_persistent_ones_do() {
    let c = Cluster::start(4, 0);
    let (persistent, _) = finish_json(start(&c, "n0", &["--level", "persistent"]), "persistent checkpoints");
    let (memory, _) = finish_json(start(&c, "n1", &["--level", "memory"]), "memory checkpoints");
    assert_eq!(memory["checksum"], persistent["checksum"]);
    // One checkpoint per 50 vectors, and the ranks' states, kept at each level.
    for j in [&memory, &persistent] {
        assert_eq!(j["checkpoints"], 20, "{j}");
        assert!(j["checkpoint_bytes"].as_u64().unwrap_or(0) > 0, "{j}");
        // The ranks' stop, as the coordinator saw it (from the last rank's call to their
        // answer), is within rank 0's own calls (which began no later and ended no earlier).
        let (stop, call) = (
            j["checkpoint_stop_s"].as_f64().unwrap_or(0.0),
            j["checkpoint_pause_s"].as_f64().unwrap_or(0.0),
        );
        assert!(stop > 0.0 && stop <= call, "{j}");
    }
    // Counted by the daemons from the first safe point to the last: not one page written to
    // a disk at the memory level; at the persistent level both copies of every page taken.
    assert_eq!(memory["disk_pages_written"], 0, "{memory}");
    let written = persistent["disk_pages_written"].as_u64().unwrap_or(0);
    assert!(written > 2 * 2048, "{persistent}");
    // The recovery copies took frames on every node (two per page checkpointed in memory).
    for n in ["n0", "n1", "n2", "n3"] {
        assert!(
            memory["faults_per_node"][n]["frames_peak"].as_u64().unwrap_or(0) > 0,
            "{memory}"
        );
    }
    // Each page checkpointed in memory has two recovery copies, one of them on the node that
    // took it (as one of its holders, or as its writer): exactly one crosses the network.
    let taken = memory["ckpt_pages_taken"].as_u64().unwrap_or(0);
    let sent = memory["ckpt_pages_sent"].as_u64().unwrap_or(0);
    assert!(taken > 2048 && sent == taken, "{memory}");
    assert_eq!(persistent["ckpt_pages_taken"], 0, "{persistent}");
    // A checkpoint leaves the pages a node holds writable writable (it compares them at the
    // next one): the ranks' writes after it take no write-protect fault. Each node's ranks
    // write 512 pages between checkpoints, 20 times; protecting them cost about 5,000 faults
    // per node. What is left comes from the protocol (a page read elsewhere, then written).
    for j in [&memory, &persistent] {
        for n in ["n0", "n1", "n2", "n3"] {
            let wp = j["faults_per_node"][n]["wp_faults"].as_u64();
            println!("{n}: {wp:?} write-protect faults");
            assert!(wp.is_some_and(|f| f <= 500), "{n}: {wp:?} write-protect faults\n{j}");
        }
    }
}

#[test]
fn a_kill_rolls_back_to_the_memory_checkpoint_and_two_kills_to_the_persistent_one() {
    let c = Cluster::start(4, 0);
    let (want, _) = finish(start(&c, "n0", &[]), "the unfailed run");
    // One node killed: every page keeps one recovery copy, re-created on it when it is back;
    // the job restarts from its memory checkpoint. Two, even not neighbours: a page homed on
    // n1 and written by n3 had its copies on both.
    for (victims, two) in [(&["n1"][..], false), (&["n1", "n3"][..], true)] {
        let mut run = start(&c, "n0", &[]);
        let (job, rest) = job_id(&mut run);
        let (memory, persistent) = wait_memory_checkpoint(&c, &job);
        // The recovery copies show in the nodes' counters (heartbeats, `psls cluster status`).
        let frames: u64 = c
            .status()
            .nodes
            .iter()
            .map(|n| n.recovery_frames + n.pre_recovery_frames)
            .sum();
        assert!(frames > 0, "{:?}", c.status());
        for v in victims {
            c.kill(v);
        }
        std::thread::sleep(Duration::from_millis(300));
        c.ok(&["cluster", "up"]);
        let what = format!("{victims:?} killed after memory checkpoint {memory}");
        let (got, err) = finish_rest(run, rest, &what);
        c.assert_no_rank_left(&what);
        assert_eq!(got, want, "{what}\n{err}");
        let from = restarted_from(&err);
        if two {
            // Only the disks are left.
            assert!(
                from >= persistent && from < memory,
                "{what}: restarted from {from}\n{err}"
            );
            assert!(c.logs_contain("recovery copies lost on more than one node"));
        } else {
            assert!(from >= memory, "{what}: restarted from {from}\n{err}");
            assert!(c.logs_contain("recovery copies re-created"));
        }
    }
}

#[test]
fn a_lost_node_is_replaced_by_the_spare_with_fresh_recovery_copies_and_a_second_failure_is_survived() {
    use std::io::BufRead;
    let c = Cluster::start(4, 1);
    let (want, _) = finish(start(&c, "n0", &[]), "the unfailed run");
    let mut run = start(&c, "n0", &[]);
    let (job, mut rest) = job_id(&mut run);
    let (memory, _) = wait_memory_checkpoint(&c, &job);
    // n2 and its disk are gone for good: after 2 s the spare takes logical id 2 and receives
    // the recovery copies n2 held.
    c.destroy("n2");
    let mut err = String::new();
    let mut line = String::new();
    while !line.contains("restarted from checkpoint") {
        line.clear();
        assert!(rest.read_line(&mut line).expect("stderr") > 0, "the job ended:\n{err}");
        err.push_str(&line);
    }
    assert!(c.status().nodes.iter().any(|n| n.name == "s0" && n.logical == Some(2)));
    assert!(restarted_from(&err) >= memory, "{err}");
    // At once n3 dies — the spare's neighbour: the pages homed on 2 have their other copy on
    // 3, so the spare must hold the copies n2 had for this to roll back in memory.
    c.kill("n3");
    std::thread::sleep(Duration::from_millis(300));
    c.ok(&["cluster", "up"]);
    let (got, more) = finish_rest(run, rest, "n2 lost, then n3 killed");
    err.push_str(&more);
    assert_eq!(got, want, "{err}");
    let rollbacks = err
        .lines()
        .filter(|l| l.starts_with("psls: job ") && l.contains(" restarted from checkpoint "))
        .count();
    assert_eq!(rollbacks, 2, "{err}");
    assert!(
        restarted_from(&err) >= memory,
        "the second rollback used memory copies:\n{err}"
    );
    assert!(!c.logs_contain("recovery copies lost on more than one node"));
}

#[test]
fn with_too_little_memory_for_a_memory_checkpoint_the_cleaner_takes_every_one() {
    // 1 MiB of frames per node: one memory checkpoint of MGS needs about 4 MiB.
    let c = Cluster::init(4, 0, |cfg| {
        for n in cfg.nodes.iter_mut() {
            n.memory_mb = 1;
        }
    });
    c.ok(&["cluster", "up"]);
    let (j, _) = finish_json(start(&c, "n0", &[]), "with 1 MiB per node");
    assert_eq!(j["checkpoints"], 20, "{j}");
    assert!(j["disk_pages_written"].as_u64().unwrap_or(0) > 0, "{j}");
    assert!(c.logs_contain("a memory checkpoint might not fit: taking the cleaner"));
    // Pinned to memory, a checkpoint that does not fit goes to the cleaner too.
    let (j, _) = finish_json(start(&c, "n1", &["--level", "memory"]), "memory pinned, 1 MiB per node");
    assert_eq!(j["checkpoints"], 20, "{j}");
}

/// What each node's prefetch after `job`'s rollback asked for and loaded (its log lines).
fn prefetched(c: &Cluster, job: &str) -> Vec<(u64, u64)> {
    let field = |l: &str, k: &str| -> u64 {
        l.split(&format!(" {k}="))
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {l}"))
    };
    let tag = format!("job=\"{job}\"");
    ["n0", "n1", "n2", "n3"]
        .iter()
        .flat_map(|n| {
            c.log(n)
                .lines()
                .filter(|l| l.contains("active pages prefetched after a rollback") && l.contains(&tag))
                .map(|l| (field(l, "asked"), field(l, "here")))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn mgs_completes_under_every_cleaning_policy_with_a_failure_after_a_cleaner_and_prefetches_by_its_rules() {
    let c = Cluster::start(4, 0);
    let (want, _) = finish(start(&c, "n0", &["--level", "persistent"]), "the unfailed run");
    for policy in ["none", "total", "p1", "p2", "p3", "lru:300"] {
        // A cleaner every fourth checkpoint (whatever the machine's speed), memory checkpoints
        // between; after the rollback the pages that were active are loaded again before the
        // ranks restart.
        let args = ["--cleaning", policy, "--persistent-every", "4", "--prefetch"];
        let mut run = start(&c, "n1", &args);
        let (job, rest) = job_id(&mut run);
        let what = format!("cleaning {policy}");
        // After a cleaner that followed memory checkpoints (the policy then acted), n3 dies.
        let mut seen = None;
        wait_for(
            Duration::from_secs(60),
            &format!("{what}: a cleaner after memory checkpoints"),
            || {
                let now = entry(&c, &job);
                // Listed once, it must stay listed and running until n3 dies.
                if seen.is_some() && now.as_ref().is_none_or(|e| e["state"] != "running") {
                    panic!("{what}: the job stopped running: {now:?}, before: {seen:?}");
                }
                seen = now;
                seen.as_ref()
                    .is_some_and(|e| e["level"] == "memory" && e["persistent_epoch"].as_u64().unwrap_or(0) > 1)
            },
        );
        // Epochs 1, 5, 9, ... are cleaners, the others memory checkpoints.
        let e = seen.unwrap_or_default();
        let (epoch, persistent) = (
            e["epoch"].as_u64().unwrap_or(0),
            e["persistent_epoch"].as_u64().unwrap_or(0),
        );
        assert_eq!(persistent % 4, 1, "{what}: {e}");
        assert!(epoch > persistent && epoch < persistent + 4, "{what}: {e}");
        c.kill("n3");
        std::thread::sleep(Duration::from_millis(300));
        c.ok(&["cluster", "up"]);
        let (got, err) = finish_rest(run, rest, &what);
        c.assert_no_rank_left(&what);
        assert_eq!(got, want, "{what}\n{err}");
        assert!(err.contains("restarted from checkpoint"), "{what}\n{err}");
        // Every node answered the prefetch; the survivors held MGS's vectors, and loaded all
        // they asked for. Total cleaning keeps nothing in memory: nothing is asked for; LRU
        // at most its frames per node.
        let p = prefetched(&c, &job);
        assert_eq!(p.len(), 4, "{what}: {p:?}");
        let asked: u64 = p.iter().map(|x| x.0).sum();
        assert!(p.iter().all(|(a, h)| a == h), "{what}: {p:?}");
        match policy {
            "total" => assert_eq!(asked, 0, "{what}: {p:?}"),
            "lru:300" => assert!(asked > 0 && p.iter().all(|x| x.0 <= 300), "{what}: {p:?}"),
            _ => assert!(asked > 0, "{what}: {p:?}"),
        }
    }
    // A policy that is not one is a clear error, and no job starts.
    let o = c.run(&["run", "-n", "1", "--cleaning", "p4", "--", "true"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown cleaning policy 'p4'"));
}

/// `psls jobs rm` of a job that ended keeping memory checkpoints drops its recovery copies on
/// every node, and the next job on the same file takes memory checkpoints again. (They were
/// kept: every memory checkpoint of the next job on the file was refused, and a load after its
/// rollback was served the removed job's pages — a job computing on another job's data, found
/// by the nemesis.)
#[test]
fn a_removed_jobs_recovery_copies_go_and_the_next_job_on_its_file_checkpoints_in_memory() {
    let c = Cluster::start(4, 0);
    let probe = bin_dir().join("svm-probe");
    let frames = || -> u64 {
        c.status()
            .nodes
            .iter()
            .map(|n| n.recovery_frames + n.pre_recovery_frames)
            .sum()
    };
    // A job taking a memory checkpoint at every step, cancelled: it stays resumable from its
    // memory checkpoint, which its nodes keep.
    // The probe's steps on file `kept` through `node`, a memory checkpoint at every step.
    let steps = |node: &'static str, count: &'static str| -> Vec<String> {
        let probe = probe.to_str().expect("path").to_string();
        [
            "--node", node, "run", "-n", "4", "--level", "memory", "--", &probe, "steps", "kept", "4", count, "99",
            "8", "20",
        ]
        .map(String::from)
        .to_vec()
    };
    let args = steps("n0", "1000");
    let mut run = c
        .cmd(&args.iter().map(String::as_str).collect::<Vec<_>>())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run");
    let (job, rest) = job_id(&mut run);
    wait_for(Duration::from_secs(60), "memory checkpoints kept", || frames() > 0);
    c.ok(&["cancel", &job]);
    let _ = wait_within(run, Duration::from_secs(60));
    drop(rest);
    wait_for(Duration::from_secs(30), "the job cancelled", || {
        entry(&c, &job).is_some_and(|e| e["state"] != "running")
    });
    assert!(frames() > 0, "the cancelled job keeps its memory checkpoint");
    c.ok(&["jobs", "rm", &job]);
    wait_for(
        Duration::from_secs(10),
        "every node dropped the removed job's copies",
        || frames() == 0,
    );
    // The next job on the file checkpoints in memory (before, every memory checkpoint was
    // refused where the removed job's copies stayed).
    let args = steps("n1", "10");
    let out = c.ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.matches("done ").count(), 4, "{out}");
    assert_eq!(out.matches(" epoch ").count(), 40, "a checkpoint at every step:\n{out}");
}
