//! Persistent checkpoints with real daemons: what a process writes through a mapping reaches
//! both disk copies at its last unmap, its `sync` or its end, and only then; exports and new mappings
//! after a restart of every daemon read it back. The ranks' safe-point call: one decision for
//! all ranks, intervals, `psls checkpoint`, `psls halt`, and bad calls.

use psls_tests::*;
const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");

fn probe(c: &Cluster, node: &str, args: &[&str]) -> String {
    c.client_ok(node, PROBE, args)
}

/// The bytes svm-probe's `fill` writes: word k of page p is `mix64(seed ^ p << 20 ^ k)`.
fn pattern(seed: u64, pages: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(pages * 4096);
    for p in 0..pages {
        for k in 0..512usize {
            out.extend_from_slice(&psls_svm::rng::mix64(seed ^ ((p as u64) << 20) ^ k as u64).to_le_bytes());
        }
    }
    out
}

#[test]
fn writes_reach_the_disks_at_the_last_unmap_and_survive_a_restart_of_every_daemon() {
    let c = Cluster::start(4, 0);
    // A new file, filled through a mapping and unmapped: the export shows the writes.
    probe(&c, "n1", &["fill", "d", "64", "9"]);
    assert_same(&c.export("d", &[]), &pattern(9, 64), "export after the unmap");
    // Rewritten from another node: the new bytes replace the old on disk.
    probe(&c, "n2", &["fill", "d", "64", "10"]);
    assert_same(&c.export("d", &[]), &pattern(10, 64), "export after a rewrite");
    // Every daemon stops and starts: memory is gone, the disks hold the writes.
    c.ok(&["cluster", "down"]);
    c.ok(&["cluster", "up"]);
    probe(&c, "n3", &["check", "d", "64", "10"]);
    assert_same(&c.export("d", &[]), &pattern(10, 64), "export after a restart");
}

#[test]
fn sync_makes_writes_durable_later_writes_stay_off_the_disks_and_the_process_end_makes_them_durable() {
    let c = Cluster::start(4, 0);
    // Fill with 3, sync, overwrite the second half with 4, wait, exit without unmapping.
    let marker = c.tmp.path().join("fillsync-go");
    let marker_arg = marker.display().to_string();
    let mut writer = c
        .client("n0", PROBE)
        .args(["fillsync", "s", "32", "3", "4", "16", &marker_arg])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("fillsync");
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(writer.stdout.take().expect("stdout")));
    let mut out = String::new();
    for l in lines.by_ref() {
        let l = l.expect("read");
        out.push_str(&l);
        out.push('\n');
        if l == "written" {
            break;
        }
    }
    assert!(out.contains("synced 32") && out.contains("written"), "{out}");
    // While it lives, the disks hold exactly the synced version: the writes after it reached
    // no disk, and are the file's contents in memory (a reader on n2 sees them).
    assert_same(&c.export("s", &[]), &pattern(3, 32), "export after sync");
    probe(&c, "n2", &["rocheck", "s", "32", "4", "20"]);
    // Its end unmaps: with a shared mapping, its writes outlive it, and are made durable (a
    // file no process writes holds on the disks what it holds in memory).
    std::fs::write(&marker, b"").expect("marker");
    assert!(writer.wait().expect("wait").success());
    let mut want = pattern(3, 32);
    want[16 * 4096..].copy_from_slice(&pattern(4, 32)[16 * 4096..]);
    // (The daemon sees the process end, then makes its writes durable.)
    wait_for(
        std::time::Duration::from_secs(10),
        "the ended writer's writes on the disks",
        || c.export("s", &[]) == want,
    );
    // A process on n2 writes one page and unmaps: that checkpoint takes only that page.
    probe(&c, "n2", &["fill", "s", "32", "7", "20"]);
    want[20 * 4096..21 * 4096].copy_from_slice(&pattern(7, 32)[20 * 4096..21 * 4096]);
    assert_same(&c.export("s", &[]), &want, "export after the second checkpoint");
    c.ok(&["cluster", "down"]);
    c.ok(&["cluster", "up"]);
    assert_same(&c.export("s", &[]), &want, "export after a restart");
    probe(&c, "n1", &["check", "s", "32", "7", "20"]);
    probe(&c, "n3", &["check", "s", "32", "3", "5"]);
}

fn words0(data: &[u8], pages: usize) -> Vec<u64> {
    (0..pages)
        .map(|p| u64::from_le_bytes(data[p * 4096..p * 4096 + 8].try_into().expect("8 bytes")))
        .collect()
}

#[test]
fn every_safe_point_call_takes_one_checkpoint_for_all_ranks_and_the_area_goes_with_the_job() {
    let c = Cluster::start(4, 0);
    // 5 steps, interval 0: every call is a checkpoint, the same epoch on every rank.
    let out = c.ok(&["run", "-n", "4", "--", PROBE, "steps", "st", "4", "5", "99", "100", "0"]);
    for r in 0..4 {
        for step in 0..5 {
            assert!(
                out.contains(&format!("[{r}] step {step} epoch {}\n", step + 1)),
                "{out}\n{}",
                ["n0", "n1", "n2", "n3"]
                    .iter()
                    .flat_map(|n| c
                        .log(n)
                        .lines()
                        .filter(|l| l.contains("WARN") || l.contains("memory"))
                        .map(|l| l.to_string())
                        .collect::<Vec<_>>())
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
        assert!(out.contains(&format!("[{r}] done 15")), "{out}");
    }
    // The last step's writes came after the last call: the job's last checkpoint at its end
    // made them durable; its checkpoint area went with it.
    assert_eq!(words0(&c.export("st", &[]), 4), vec![15; 4]);
    assert!(!c.ok(&["ls"]).contains(".psls-ckpt"));
    // The C example's safe-point calls (through the C ABI) are tested with it (svm.rs).
}

#[test]
fn an_interval_skips_calls_psls_checkpoint_forces_one_and_psls_halt_stops_the_job() {
    let c = Cluster::start(4, 0);
    let mut run = c
        .cmd(&[
            "run",
            "-n",
            "2",
            "--checkpoint-interval",
            "3600",
            "--",
            PROBE,
            "steps",
            "iv",
            "4",
            "400",
            "99",
            "100",
            "50",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("psls run");
    let (job, mut err) = job_id(&mut run);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let said = c.ok(&["checkpoint", &job]);
    assert!(said.contains("next safe-point call"), "{said}");
    let committed = |epoch: u64| {
        wait_for(std::time::Duration::from_secs(30), "the forced checkpoint", || {
            c.job_entry(&job)["epoch"].as_u64() == Some(epoch)
        });
        c.job_entry(&job)
    };
    committed(1);
    // A second one is persistent too, as `psls checkpoint` promises (the job's later
    // checkpoints are memory ones by default).
    c.ok(&["checkpoint", &job]);
    let entry = committed(2);
    assert_eq!(entry["persistent_epoch"].as_u64(), Some(2), "{entry}");
    c.ok(&["halt", &job]);
    let o = run.wait_with_output().expect("psls run ends");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).expect("read");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(
        o.status.code(),
        Some(75),
        "a halted job exits with EX_TEMPFAIL\n{out}{rest}"
    );
    // Calls skipped until the forced ones (epochs 1 and 2, on both ranks at the same step),
    // then the halt's (epoch 3); the job stopped before its 400 steps.
    let at = |r: u32, e: u32| {
        out.lines().find_map(|l| {
            l.strip_prefix(&format!("[{r}] step "))
                .and_then(|l| l.strip_suffix(&format!(" epoch {e}")))
                .map(str::to_string)
        })
    };
    assert!(at(0, 1).is_some() && at(0, 1) == at(1, 1), "{out}");
    assert!(!out.contains("done"), "{out}");
    assert!(rest.contains(&format!("job {job} halted after checkpoint 3")), "{rest}");
    // The halted job keeps its checkpoint area (it can be resumed), which is the daemon's:
    // no user removes it, nor creates a file in an area (or plants one for a future job).
    assert!(c.ok(&["ls"]).contains(&format!(".psls-ckpt.{job}")));
    let e = c.fails(&["rm", &format!(".psls-ckpt.{job}")]);
    assert!(e.contains("reserved for jobs' checkpoint areas"), "{e}");
    let e = c.fails(&["create", ".psls-ckpt.n9-1-1.v.seg", "--size", "4096"]);
    assert!(e.contains("reserved for jobs' checkpoint areas"), "{e}");
    assert!(c.ok(&["ls"]).contains(&format!(".psls-ckpt.{job}")));
    // An unknown job is a clear error.
    let e = c.fails(&["checkpoint", "no-such-job"]);
    assert!(e.contains("no-such-job has made no checkpoint call"), "{e}");
}

#[test]
fn bad_safe_point_calls_get_clear_errors_and_take_no_checkpoint() {
    let c = Cluster::start(4, 0);
    // Rank 1 never calls: the others' calls fail after the timeout, naming it.
    let o = c.run(&[
        "run",
        "-n",
        "3",
        "--checkpoint-timeout",
        "2",
        "--",
        PROBE,
        "steps",
        "sk",
        "4",
        "3",
        "1",
        "100",
        "0",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success());
    assert!(
        out.contains("only 2 of 3 ranks called checkpoint within 2000 ms (missing: rank 1); no checkpoint was taken"),
        "{out}"
    );
    assert!(!out.contains(" epoch "), "{out}");
    // A state over 1 MiB is refused before it leaves the process.
    let o = c.run(&[
        "run", "-n", "2", "--", PROBE, "steps", "big", "4", "2", "99", "2000000", "0",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("checkpoint state is at most 1048576 bytes; this one is 2000000"),
        "{out}"
    );
    // Nothing was committed for either job.
    assert!(!c.ok(&["ls"]).contains(".psls-ckpt"), "no checkpoint area was written");
}

#[test]
fn a_file_is_written_by_one_job_at_a_time() {
    let c = Cluster::start(4, 0);
    let marker = c.path("release");
    let mut holder = c.hold_writable("n1", "first", "w1", &marker);
    // Another job may not map it writable, on any node (reading is free: svm.rs maps
    // read-only next to writers).
    for node in ["n1", "n3"] {
        let o = c
            .client(node, PROBE)
            .env("PSLS_JOB", "second")
            .args(["map", "w1", "4096", "0"])
            .output()
            .expect("probe");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(!o.status.success(), "{out}");
        assert!(
            out.contains("'w1' is mapped writable by job ext:0:first: one job writes a file at a time"),
            "{out}"
        );
    }
    // A process of the same job may.
    let o = c
        .client("n2", PROBE)
        .env("PSLS_JOB", "first")
        .args(["map", "w1", "4096", "0"])
        .output()
        .expect("probe");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    // Once the holder is gone, the other job may.
    std::fs::write(&marker, b"").expect("marker");
    assert!(holder.wait().expect("holder").success());
    let o = c
        .client("n3", PROBE)
        .env("PSLS_JOB", "second")
        .args(["map", "w1", "4096", "0"])
        .output()
        .expect("probe");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
}

/// A store file of `node`: file `id`'s `role` copies, `part` (`hdr`, `d0`, `d1`).
fn store_file(c: &Cluster, node: &str, id: u64, role: char, part: &str) -> std::path::PathBuf {
    let cfg = c.config();
    cfg.data_dir(cfg.entry(node).expect("node"))
        .join("pages")
        .join(format!("f{id:016x}.{role}.{part}"))
}

fn overwrite(path: &std::path::Path, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    f.write_all_at(bytes, offset).expect("write");
    f.sync_all().expect("sync");
}

#[test]
fn a_checkpointed_page_bad_on_one_copy_is_served_from_the_other_and_repaired_and_on_both_is_a_clear_error() {
    let c = Cluster::start(4, 0);
    // Checkpoint 1 writes all 8 pages (slot 0); checkpoint 2 rewrites page 5 (slot 1).
    probe(&c, "n0", &["fillsync", "cs", "8", "3", "3", "8"]);
    probe(&c, "n1", &["fill", "cs", "8", "7", "5"]);
    let mut want = pattern(3, 8);
    want[5 * 4096..6 * 4096].copy_from_slice(&pattern(7, 8)[5 * 4096..6 * 4096]);
    assert_same(&c.export("cs", &[]), &want, "before any damage");
    let stat: serde_json::Value = serde_json::from_str(&c.ok(&["stat", "cs", "--json"])).expect("json");
    let id = stat["file"]["id"]
        .as_str()
        .and_then(|s| s.parse::<u64>().ok())
        .expect("id");
    // Page 5 is the second page of its stripe on its home and mirror (4 nodes: local index 1).
    let stripe = stat["stripes"]
        .as_array()
        .expect("stripes")
        .iter()
        .find(|s| s["first_page"].as_u64() == Some(1))
        .expect("the stripe of pages 1, 5");
    let (home, mirror) = (
        format!("n{}", stripe["home"].as_u64().expect("home")),
        format!("n{}", stripe["mirror"].as_u64().expect("mirror")),
    );
    let local = 1u64;
    // Exports go through a node holding neither copy, so they read the primary first.
    let other = (0..4)
        .map(|n| format!("n{n}"))
        .find(|n| *n != home && *n != mirror)
        .expect("a third node");
    let via: [&str; 2] = ["--node", &other];
    // A flipped byte in the committed slot of the primary: found by its checksum, served from
    // the mirror, and repaired.
    overwrite(&store_file(&c, &home, id, 'p', "d1"), local * 4096 + 100, &[0x5a]);
    assert_same(&c.export("cs", &via), &want, "export with page 5's primary corrupt");
    wait_for(
        std::time::Duration::from_secs(10),
        "the read path repairs the primary",
        || c.logs_contain("primary copies repaired from the other copy"),
    );
    assert!(c.ok(&["scrub"]).contains(" 0 bad,"), "repaired");
    // The committed slot's header erased on the primary: the generation the metadata names is
    // not there (the older version in the other slot is never taken for it).
    overwrite(&store_file(&c, &home, id, 'p', "hdr"), local * 128 + 64, &[0u8; 64]);
    assert_same(&c.export("cs", &via), &want, "export with page 5's primary slot erased");
    let scrub = c.ok(&["scrub"]);
    assert!(scrub.contains(" 0 unrepairable"), "{scrub}");
    assert_same(&c.export("cs", &[]), &want, "after the scrub");
    // Both copies bad: a clear error naming the file and the page, never other bytes.
    overwrite(&store_file(&c, &home, id, 'p', "d1"), local * 4096 + 7, &[0xff, 0x00]);
    overwrite(&store_file(&c, &mirror, id, 'm', "d1"), local * 4096 + 7, &[0xff, 0x00]);
    let err = c.fails(&["--node", &other, "export", "cs", &c.path("x").display().to_string()]);
    assert!(err.contains("page 5 of 'cs' is unreadable"), "{err}");
    // The page's current version is still in the nodes' memories (disks hold checkpoints for
    // recovery): a new mapping reads the right bytes from there.
    probe(&c, "n2", &["check", "cs", "8", "7", "5"]);
}

/// A rank's node that lost its connection mid-call retries the call: the coordinator, still
/// holding the first (the rank arrived), lets the retry take over the wait instead of failing
/// the rank with "already in a checkpoint call" (the nemesis met it after a pause). A call
/// answered already gets its answer again; a call out of step with the other ranks' fails
/// theirs (the nemesis met a checkpoint of ranks at different steps, and wrong results).
#[test]
fn a_retried_checkpoint_call_takes_over_the_wait_or_gets_its_answer_again() {
    let c = Cluster::start(3, 0);
    // n2 stops; a stand-in speaks for it (a new incarnation, as after a restart).
    c.kill("n2");
    let peer = Peer::new(&c, "n2");
    let status: psls_ipc::proto::ClusterStatus =
        serde_json::from_str(&c.ok(&["cluster", "status", "--json"])).expect("status");
    let coordinator = status.coordinator.expect("a coordinator");
    let call = psls_node::peer::SafeCall {
        job: "retried-1".into(),
        rank: 0,
        attempt: 0,
        size: 2,
        interval_ms: 3_600_000,
        timeout_ms: 60_000,
        level: psls_ckpt::msg::Choice::Auto,
        persistent_interval_ms: 0,
        persistent_every: 0,
        cleaning: psls_ckpt::cleaning::Policy::NoCleaning,
        files: Vec::new(),
        uid: 0,
        gid: 0,
        launcher: "n2".into(),
        node_inc: NEW_INCARNATION,
        session: 7,
        seq: 1,
        resent: false,
    };
    let rank1 = psls_node::peer::SafeCall {
        rank: 1,
        session: 8,
        ..call.clone()
    };
    let req = psls_node::peer::PeerReq::CkptArrive(call.clone());
    let error = |r: Result<(psls_node::peer::PeerResp, bytes::Bytes), psls_node::transport::NetError>| match r {
        Ok((psls_node::peer::PeerResp::Error { message, .. }, _)) => message,
        other => panic!("an error answer, not {other:?}"),
    };
    let done = |r: Result<(psls_node::peer::PeerResp, bytes::Bytes), psls_node::transport::NetError>| match r {
        Ok((psls_node::peer::PeerResp::SafeDone { epoch, halt, .. }, _)) => (epoch, halt),
        other => panic!("the call's answer, not {other:?}"),
    };
    // Quickly (the stand-in sends no heartbeats: it is down again after the failure timeout):
    // the call, its retry, then rank 1's call. The interval is not over: no checkpoint.
    let (first, second, other) = std::thread::scope(|s| {
        let first = s.spawn(|| peer.request(&coordinator, &req, bytes::Bytes::new()));
        std::thread::sleep(std::time::Duration::from_millis(200));
        let second = s.spawn(|| peer.request(&coordinator, &req, bytes::Bytes::new()));
        std::thread::sleep(std::time::Duration::from_millis(200));
        let other = peer.request(
            &coordinator,
            &psls_node::peer::PeerReq::CkptArrive(rank1),
            bytes::Bytes::new(),
        );
        (
            first.join().expect("first call"),
            second.join().expect("the retry"),
            other,
        )
    });
    let first = error(first);
    assert!(first.contains("retried"), "the first wait is over: {first}");
    assert_eq!(done(second), (0, false), "the retry is answered with the decision");
    assert_eq!(done(other), (0, false), "rank 1 too");
    // Rank 0's call once more (its answer lost on the way): the same answer at once, not a
    // wait for rank 1's next call (the request gives up after 10 s).
    let t = std::time::Instant::now();
    assert_eq!(
        done(peer.request(&coordinator, &req, bytes::Bytes::new())),
        (0, false),
        "a call answered already"
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(2), "{:?}", t.elapsed());
    // Rank 1 makes its next call; rank 0 (as seen by a coordinator that never answered it)
    // makes call 1 again: out of step, both fail, no checkpoint of ranks at different steps.
    let next1 = psls_node::peer::PeerReq::CkptArrive(psls_node::peer::SafeCall {
        rank: 1,
        session: 8,
        seq: 2,
        ..call.clone()
    });
    let again0 = psls_node::peer::PeerReq::CkptArrive(psls_node::peer::SafeCall {
        session: 9,
        resent: true,
        ..call.clone()
    });
    let (next1, again0) = std::thread::scope(|s| {
        let next1 = s.spawn(|| peer.request(&coordinator, &next1, bytes::Bytes::new()));
        std::thread::sleep(std::time::Duration::from_millis(200));
        let again0 = peer.request(&coordinator, &again0, bytes::Bytes::new());
        (next1.join().expect("rank 1's next call"), again0)
    });
    for (what, r) in [("rank 1's next call", next1), ("rank 0's call again", again0)] {
        let e = error(r);
        assert!(e.contains("out of step"), "{what}: {e}");
    }
    c.ok(&["cluster", "up"]);
}
