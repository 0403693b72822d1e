//! A job outlives any one machine (issue 23): the daemon `psls run` talks to killed mid-job,
//! the `psls run` process itself killed, a job started detached, followed from another terminal
//! and cancelled, then resumed — every time the job ends with the checksum of a run that never
//! failed, and `psls jobs` tells how it ended.

use psls_tests::*;
use std::process::Stdio;
use std::time::Duration;

fn mgs(c: &Cluster, node: &str, extra: &[&str]) -> std::process::Child {
    start_mgs_job(c, node, extra)
}

#[test]
fn the_daemon_psls_run_talks_to_killed_mid_job_and_psls_run_killed_leave_the_job_running() {
    let c = Cluster::start(4, 0);
    let (want, _) = finish(mgs(&c, "n0", &[]), "the unfailed run");

    // kill -9 of the daemon `psls run` talks to: the job rolls back (its ranks there are
    // lost) and goes on; `psls run` follows it again from another node.
    let mut run = mgs(&c, "n1", &[]);
    let (job, mut err) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    c.kill("n1");
    c.ok(&["cluster", "up"]);
    let (got, text) = finish_rest(run, &mut err, "psls run after its daemon was killed");
    assert_eq!(got, want);
    assert!(text.contains("following job"), "{text}");
    assert_eq!(c.job_entry(&job)["state"], "finished");

    // kill -9 of `psls run` itself: the job goes on; `psls attach` follows it to its end.
    let mut run = mgs(&c, "n2", &[]);
    let (job, _err) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    run.kill().expect("kill psls run");
    let _ = run.wait();
    assert_eq!(c.job_entry(&job)["state"], "running");
    let attach = c
        .cmd(&["--node", "n3", "attach", &job])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls attach");
    let (got, _) = finish(attach, "psls attach after psls run was killed");
    assert_eq!(got, want);
    assert_eq!(c.job_entry(&job)["state"], "finished");
    c.assert_no_rank_left("after the attached job");

    // kill -9 of `psls run` during a rollback (n1 killed): the rollback goes on, the job
    // completes, `psls attach` follows it to its end and nothing is left running.
    let mut run = mgs(&c, "n2", &[]);
    let (job, _err) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    c.kill("n1");
    wait_for(Duration::from_secs(30), "the rollback", || {
        c.job_entry(&job)["activity"]
            .as_str()
            .is_some_and(|a| a.starts_with("rolling back"))
    });
    run.kill().expect("kill psls run");
    let _ = run.wait();
    c.ok(&["cluster", "up"]);
    let attach = c
        .cmd(&["--node", "n0", "attach", &job])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls attach");
    let (got, _) = finish(attach, "psls attach after psls run was killed in a rollback");
    assert_eq!(got, want);
    assert_eq!(c.job_entry(&job)["state"], "finished");
    c.assert_no_rank_left("after the job rolled back without its psls run");
}

#[test]
fn a_detached_job_is_cancelled_then_resumed_from_its_checkpoint() {
    let c = Cluster::start(4, 0);
    let (want, _) = finish(mgs(&c, "n0", &[]), "the unfailed run");
    let mgs_path = mgs_bin();
    let mut args = vec!["--node", "n1", "run", "--detach", "-n", "4", "--", mgs_path.as_str()];
    args.extend(MGS_ARGS);
    let job = c.ok(&args).trim().to_string();
    assert!(!job.is_empty());
    wait_first_checkpoint(&c, &job);
    c.ok(&["cancel", &job]);
    wait_for(Duration::from_secs(60), "the job's end", || {
        c.job_entry(&job)["state"] != "running"
    });
    c.assert_no_rank_left("after the cancel");
    // It keeps its file: another job on it is told which job keeps it, and how to free it.
    let other = mgs(&c, "n3", &[]).wait_with_output().expect("another job");
    let said = String::from_utf8_lossy(&other.stdout).into_owned() + &String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success(), "{said}");
    assert!(
        said.contains(&format!("is kept by job {job}, which ended and can be resumed"))
            && said.contains(&format!("psls jobs rm {job}")),
        "{said}"
    );
    let resumed = c
        .cmd(&["--node", "n2", "run", "--resume", &job])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run --resume");
    let (got, _) = finish(resumed, "the resumed job");
    assert_eq!(got, want);
    // Cancelling what is not running is refused with one clear line.
    let e = c.fails(&["cancel", &job]);
    assert!(e.contains("is not running"), "{e}");

    // Ctrl-C of `psls run` cancels its job (like `psls cancel`); the job is resumable.
    let mut run = mgs(&c, "n3", &[]);
    let (job, err) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(run.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .expect("SIGINT");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut { err }, &mut rest).expect("stderr");
    let status = run.wait().expect("wait");
    assert_eq!(status.code(), Some(130), "{rest}");
    assert!(rest.contains("cancelling job"), "{rest}");
    let entry = c.job_entry(&job);
    assert_eq!(entry["state"], "resumable", "{rest}");
    assert!(
        entry["activity"].as_str().is_some_and(|a| a.starts_with("cancelled: ")),
        "{entry}"
    );
    c.assert_no_rank_left("after Ctrl-C");
    let resumed = c
        .cmd(&["run", "--resume", &job])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run --resume");
    let (got, _) = finish(resumed, "the job resumed after Ctrl-C");
    assert_eq!(got, want);
}

const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");
/// Steps of the line-printing job.
const LINE_STEPS: u64 = 150;

/// The probe's job of 4 ranks printing `line S` after the safe-point call of each step (a
/// checkpoint at every call, at `level`), through `launcher`.
fn start_lines(c: &Cluster, launcher: &str, level: &str, file: &str) -> std::process::Child {
    let steps = LINE_STEPS.to_string();
    c.cmd(&[
        "--node", launcher, "run", "-n", "4", "--level", level, "--", PROBE, "steps", file, "4", &steps, "99", "8",
        "60",
    ])
    .env("PROBE_LINES", "1")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("psls run")
}

/// Every rank printed `line 0` .. `line STEPS-1` once each, in order, then `done SUM` (the
/// file held the sums of `jobs - 1` jobs before), and nothing else but, at most once each, the
/// error of a checkpoint call: a node paused for longer than a checkpoint's calls wait, and
/// shorter than the failure timeout, fails the round, and the probe prints why and exits 3
/// (job control then blames the paused node once it is declared down, and rolls back).
fn assert_every_line_once(out: &str, err: &str, jobs: u64) {
    let sum = jobs * LINE_STEPS * (LINE_STEPS + 1) / 2;
    for r in 0..4 {
        let prefix = format!("[{r}] ");
        let all: Vec<&str> = out.lines().filter_map(|l| l.strip_prefix(&prefix)).collect();
        let errors: Vec<&str> = all
            .iter()
            .copied()
            .filter(|l| l.starts_with("checkpoint error: "))
            .collect();
        let distinct: std::collections::BTreeSet<&str> = errors.iter().copied().collect();
        assert_eq!(
            distinct.len(),
            errors.len(),
            "rank {r} printed a line twice:\n{out}\n{err}"
        );
        let got: Vec<&str> = all
            .into_iter()
            .filter(|l| !l.starts_with("checkpoint error: "))
            .collect();
        let mut want: Vec<String> = (0..LINE_STEPS).map(|s| format!("line {s}")).collect();
        want.push(format!("done {sum}"));
        assert_eq!(got, want, "rank {r}'s lines:\n{out}\n{err}");
    }
}

/// Waits for the line job's `psls run`: its stdout and stderr.
fn wait_lines(ch: std::process::Child, mut rest: impl std::io::Read) -> (String, String) {
    let mut err = String::new();
    rest.read_to_string(&mut err).expect("read");
    let o = ch.wait_with_output().expect("wait");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "the job failed ({}):\n{out}\n{err}", o.status);
    (out, err)
}

#[test]
fn every_line_is_printed_once_after_psls_runs_daemon_is_killed_or_paused() {
    let c = Cluster::start(4, 0);
    let timeout = Duration::from_millis(c.config().cluster.heartbeat_timeout_ms);
    for (k, (level, how)) in [("memory", "kill"), ("persistent", "kill"), ("memory", "stop")]
        .into_iter()
        .enumerate()
    {
        // The same file for every job: the probe adds to what it holds, so each job's result
        // must have outlived the next job's failure.
        let mut run = start_lines(&c, "n1", level, "ln");
        let (job, err) = job_id(&mut run);
        wait_first_checkpoint_any(&c, &job);
        std::thread::sleep(Duration::from_millis(1500));
        let failed_at = unix_now();
        if how == "kill" {
            c.kill("n1");
            c.ok(&["cluster", "up"]);
        } else {
            let pid = nix::unistd::Pid::from_raw(c.pid("n1"));
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
            std::thread::sleep(2 * timeout);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
        }
        let t = std::time::Instant::now();
        let (out, err) = wait_lines(run, err);
        eprintln!("{level}/{how}: the job ended {:?} after the failure", t.elapsed());
        assert_every_line_once(&out, &err, k as u64 + 1);
        // The failure did reach the job: its ranks were started again, within twice the
        // failure timeout and a second (and the restart of the killed daemon, which a spare
        // would spare; the reload of pages comes after: these ranks fault them in).
        let restarted = c
            .ranks_started_at(&job, 1)
            .unwrap_or_else(|| panic!("{level}/{how}: job {job} was not restarted:\n{err}"));
        let took = restarted - failed_at;
        eprintln!(
            "{level}/{how}: every rank running again {took:.2} s after the failure (failure timeout {:.1} s)",
            timeout.as_secs_f64()
        );
        let bound = 2.0 * timeout.as_secs_f64() + 1.0 + 1.0;
        assert!(
            took <= bound,
            "{level}/{how}: ranks running again {took:.2} s after the failure (at most {bound} s)"
        );
        assert!(err.contains("following job") || how == "stop", "{level}/{how}: {err}");
        assert_eq!(c.job_entry(&job)["state"], "finished", "{level}/{how}");
        c.assert_no_rank_left("after the line job");
        c.ok(&["cluster", "up"]);
    }
}

/// Waits until `job` committed a checkpoint of either level.
fn wait_first_checkpoint_any(c: &Cluster, job: &str) {
    wait_for(Duration::from_secs(60), "the job's first checkpoint", || {
        let list: serde_json::Value =
            serde_json::from_str::<serde_json::Value>(&c.ok(&["jobs", "--json"])).unwrap_or_default()["jobs"].clone();
        list.as_array().is_some_and(|a| {
            a.iter()
                .any(|j| j["job"] == job && j["epoch"].as_u64().unwrap_or(0) > 0)
        })
    });
}

/// The SHA-256 of `data` as `sha256sum` prints it.
fn sha256sum(data: &[u8]) -> String {
    let mut ch = std::process::Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum");
    std::io::Write::write_all(&mut ch.stdin.take().expect("stdin"), data).expect("feed sha256sum");
    let o = ch.wait_with_output().expect("sha256sum ends");
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .expect("a hash")
        .to_string()
}

#[test]
fn psls_run_forwards_its_input_to_rank_0_and_rank_0_reads_an_end_when_psls_run_dies() {
    let c = Cluster::start(3, 0);
    // 4 MiB, more than rank 0's node queues (1 MiB), to a rank 0 that waits before it reads
    // and runs on another node than the daemon psls run talks to; rank 1 reads nothing.
    let data = random_bytes(4 << 20, 17);
    let mut run = c
        .cmd(&[
            "--node",
            "n0",
            "run",
            "--nodes",
            "n1,n2",
            "-n",
            "2",
            "--",
            "sh",
            "-c",
            "if [ $PSLS_RANK = 0 ]; then sleep 2; sha256sum; else wc -c; fi",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run");
    let mut input = run.stdin.take().expect("stdin");
    let feed = {
        let data = data.clone();
        std::thread::spawn(move || std::io::Write::write_all(&mut input, &data).expect("feed psls run"))
    };
    let o = run.wait_with_output().expect("psls run ends");
    feed.join().expect("fed");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains(&format!("[0] {}  -", sha256sum(&data))), "{out}");
    assert!(out.contains("[1] 0"), "{out}");

    // A detached job's rank 0 reads an empty input at once: nothing waits for psls run.
    let t = std::time::Instant::now();
    let job = c.ok(&["run", "--detach", "-n", "1", "--", "sh", "-c", "cat; echo read-all"]);
    let out = c.ok(&["attach", job.trim()]);
    assert!(out.contains("[0] read-all"), "{out}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

    // psls run killed -9 while rank 0 reads its input (still open): rank 0's input ends once
    // psls run was not heard for the lease (10 s), and the job finishes.
    let mut run = c
        .cmd(&["run", "-n", "1", "--", "sh", "-c", "cat; echo got-eof"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run");
    let mut input = run.stdin.take().expect("stdin");
    std::io::Write::write_all(&mut input, b"first line\n").expect("feed");
    let (job, _err) = job_id(&mut run);
    std::thread::sleep(Duration::from_millis(500));
    run.kill().expect("kill -9 psls run");
    let _ = run.wait();
    let t = std::time::Instant::now();
    let out = c.ok(&["attach", &job]);
    assert!(out.contains("[0] first line") && out.contains("[0] got-eof"), "{out}");
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "the input ended {:?} after psls run died",
        t.elapsed()
    );
    drop(input);
}

/// The cluster, not the program, failed a rank's call: rank 0 waits at a barrier on n2 when
/// n0 and n1 are killed (the coordinator with them, and no majority is left to elect another),
/// so its wait fails and it exits non-zero. None of the job's nodes (n2, n3) went down, yet the
/// job rolls back and completes once the cluster is whole again, instead of failing (the
/// nemesis met jobs failed by "n0 is not the coordinator (any more)" after a pause).
#[test]
fn a_rank_that_exits_because_the_cluster_failed_its_barrier_rolls_the_job_back() {
    let c = Cluster::start(4, 0);
    let probe = bin_dir().join("svm-probe");
    let go = c.path("go");
    // Rank 0 goes to the barrier at once; rank 1 only once `go` exists.
    let script = format!(
        "if [ \"$PSLS_RANK\" = 1 ]; then while [ ! -e {go} ]; do sleep 0.05; done; fi
         exec {probe} count barrier-job 1 0 2",
        go = go.display(),
        probe = probe.display()
    );
    let run = c
        .cmd(&[
            "--node",
            "n2",
            "run",
            "-n",
            "2",
            "--nodes",
            "n2,n3",
            "--max-restarts",
            "2",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run");
    let cfg = c.config();
    let waits = || {
        let s = psls_client::Session::connect_to(&cfg.socket_path(cfg.entry("n2").expect("n2"))).expect("session");
        let (_, counters) = s.node_stats().expect("stats");
        counters
            .into_iter()
            .find(|(k, _)| k == "sync_waits")
            .map_or(0, |(_, v)| v)
    };
    wait_for(Duration::from_secs(30), "rank 0 waiting at its barrier", || {
        waits() >= 1
    });
    c.kill("n0");
    c.kill("n1");
    // Rank 0's wait fails (its coordinator is gone), and it exits.
    wait_for(Duration::from_secs(30), "rank 0's wait failed", || {
        c.log("n2").contains("a rank's call failed by the cluster")
    });
    std::fs::write(&go, b"").expect("go");
    c.ok(&["cluster", "up"]);
    let o = run.wait_with_output().expect("psls run");
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "the job failed ({}):\n{out}\n{err}", o.status);
    assert!(
        c.logs_contain("rank 0 exited with status 101 after the cluster failed its call"),
        "the rollback's reason is not recorded:\n{err}"
    );
    assert!(err.contains("restarted from its start (restart 1 of"), "{err}");
    // Both ranks passed the barrier once, in the restarted start.
    assert_eq!(out.lines().filter(|l| l.ends_with(" 0")).count(), 2, "{out}");
}

/// A `psls run` whose daemon sleeps (SIGSTOP past the failure timeout) while the job rolls
/// back, restarts and ends is told of the restart when it follows again, though the job's
/// record of the start it followed is gone by then (it used to print only the end: the
/// issue's "a CLI whose daemon is cut off printed no rollback notes").
#[test]
fn a_client_whose_daemon_slept_through_the_jobs_restart_and_end_is_told_of_the_restart() {
    // A spare replaces n1 (a rollback waits for every logical node, or its replacement).
    let c = Cluster::start(4, 1);
    let marks = c.path("marks");
    std::fs::create_dir_all(&marks).expect("marks folder");
    // Each rank's first start waits; its restart prints its result and ends.
    let script = format!(
        "if [ -e {m}/started-$PSLS_RANK ]; then echo \"result $PSLS_RANK\"; exit 0; fi
         touch {m}/started-$PSLS_RANK
         sleep 600",
        m = marks.display()
    );
    let run = c
        .cmd(&[
            "--node",
            "n1",
            "run",
            "-n",
            "2",
            "--nodes",
            "n2,n3",
            "--respawn-timeout",
            "1s",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run");
    wait_for(Duration::from_secs(60), "every rank started", || {
        (0..2).all(|r| marks.join(format!("started-{r}")).exists())
    });
    // n1 sleeps; n3, which runs rank 1, is killed and started again (the cluster is healthy
    // only once n1 wakes).
    let pid = nix::unistd::Pid::from_raw(c.pid("n1"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).expect("SIGSTOP");
    c.kill("n3");
    let up = c.cmd(&["cluster", "up"]).spawn().expect("cluster up");
    let ended = || {
        let o = c.run(&["--node", "n2", "jobs", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        v["jobs"]
            .as_array()
            .is_some_and(|a| a.iter().any(|j| j["state"] == "finished"))
    };
    let t = std::time::Instant::now();
    while !ended() && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(200));
    }
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).expect("SIGCONT");
    assert!(ended(), "the job did not end while n1 slept");
    let up = wait_within(up, Duration::from_secs(120));
    assert!(
        up.status.success(),
        "cluster up: {}",
        String::from_utf8_lossy(&up.stderr)
    );
    let o = wait_within(run, Duration::from_secs(120));
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "the job failed ({}):\n{out}\n{err}", o.status);
    for r in 0..2 {
        assert_eq!(out.matches(&format!("[{r}] result {r}")).count(), 1, "{out}\n{err}");
    }
    assert!(
        err.contains("restarted"),
        "the client was not told of the restart:\n{err}"
    );
}
