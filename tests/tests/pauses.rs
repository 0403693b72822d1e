//! A paused node is fenced, not fatal (DESIGN §2): SIGSTOP of a daemon for twice the failure
//! timeout, then SIGCONT, during an MGS job — a plain node, then the coordinator. The others
//! declare it down by a committed verdict and drop what its old incarnation still sends; it
//! learns its verdict when it wakes, stops its ranks and rejoins as a new incarnation; the job
//! rolls back, completes with the checksum of an unfailed run, and the next job runs at once.
//!
//! The job's `psls run` talks to a node that is not paused (surviving the pause of that node
//! belongs to job control).

use psls_tests::*;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const ARGS: [&str; 7] = [
    "--vectors",
    "1024",
    "--dim",
    "1024",
    "--no-baseline",
    "--checkpoint-every",
    "50",
];

fn start_mgs(c: &Cluster, launcher: &str) -> Child {
    start_mgs_with(c, launcher, &[])
}

fn start_mgs_with(c: &Cluster, launcher: &str, options: &[&str]) -> Child {
    let mgs = mgs_bin();
    let mut args = vec!["--node", launcher, "run", "-n", "4"];
    args.extend(options);
    args.extend(["--", mgs.as_str()]);
    args.extend(ARGS);
    c.cmd(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run")
}

fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).expect("signal");
}

/// The incarnation of `node` as `asked` sees it (0: not up there).
fn incarnation(c: &Cluster, asked: &str, node: &str) -> u64 {
    let out = c.run(&["--node", asked, "cluster", "status", "--json"]);
    let Ok(st) = serde_json::from_slice::<psls_ipc::proto::ClusterStatus>(&out.stdout) else {
        return 0;
    };
    st.nodes
        .iter()
        .find(|n| n.name == node && n.state.to_string() == "up")
        .map_or(0, |n| n.incarnation)
}

/// The coordinator as `asked` sees it.
fn coordinator(c: &Cluster, asked: &str) -> String {
    let out = c.ok(&["--node", asked, "cluster", "status", "--json"]);
    let st: psls_ipc::proto::ClusterStatus = serde_json::from_str(&out).expect("status json");
    st.coordinator.unwrap_or_default()
}

/// Seconds since midnight UTC of a log line's timestamp (`2026-11-25T22:14:24.752882Z ...`).
fn log_secs(line: &str) -> Option<f64> {
    let t = line.split('T').nth(1)?.split('Z').next()?;
    let mut parts = t.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// Seconds since midnight UTC now.
fn now_secs() -> f64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock");
    (d.as_secs_f64()) % 86400.0
}

/// How long after `since` (seconds of the day) the coordinator committed `victim`'s verdict,
/// from its log.
fn verdict_after(c: &Cluster, victim: &str, since: f64) -> Option<f64> {
    let tag = format!("peer={victim} ");
    ["n0", "n1", "n2", "n3"]
        .iter()
        .flat_map(|n| c.log(n).lines().map(str::to_string).collect::<Vec<_>>())
        .filter(|l| l.contains("node declared down (committed)") && l.contains(&tag))
        .filter_map(|l| log_secs(&l))
        .filter(|t| *t >= since)
        .map(|t| t - since)
        .reduce(f64::min)
}

/// Pauses `victim` for `pause` during an MGS job launched through `launcher`; checks the job's
/// checksum, the victim's new incarnation, and that a job runs right after. Returns the time
/// from SIGCONT to the new incarnation being seen up.
fn pause_during_job(c: &Cluster, victim: &str, launcher: &str, pause: Duration, want: &str) -> Duration {
    pause_during(c, victim, launcher, pause, want, &[], false)
}

/// [`pause_during_job`] with `psls run` `options`; with `in_checkpoint`, the pause starts
/// while the coordinator shows a checkpoint writing its pages.
fn pause_during(
    c: &Cluster,
    victim: &str,
    launcher: &str,
    pause: Duration,
    want: &str,
    options: &[&str],
    in_checkpoint: bool,
) -> Duration {
    let what = format!("{victim} paused for {pause:?} (launcher {launcher}, {options:?})");
    let before = incarnation(c, launcher, victim);
    assert!(before > 0, "{what}: {victim} is not up before the pause");
    let mut job = start_mgs_with(c, launcher, options);
    let (id, rest) = job_id(&mut job);
    wait_first_checkpoint(c, &id);
    if in_checkpoint {
        wait_for(Duration::from_secs(60), "a checkpoint writing its pages", || {
            c.job_entry(&id)["activity"]
                .as_str()
                .is_some_and(|a| a.contains("writing pages"))
        });
    }
    let pid = c.pid(victim);
    let stopped = now_secs();
    signal(pid, nix::sys::signal::Signal::SIGSTOP);
    std::thread::sleep(pause);
    signal(pid, nix::sys::signal::Signal::SIGCONT);
    let woke = Instant::now();
    let back = loop {
        let inc = incarnation(c, launcher, victim);
        if inc > before {
            break woke.elapsed();
        }
        assert!(
            woke.elapsed() < Duration::from_secs(30),
            "{what}: {victim} never came back as a new incarnation\n{}",
            c.log(victim)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(c.pid(victim), pid, "{what}: the daemon re-executes itself in place");
    let (got, err) = finish_rest(job, rest, &what);
    c.assert_no_rank_left(&what);
    assert_eq!(got, want, "{what}: checksum differs from the unfailed run's\n{err}");
    // The cluster serves the next job at once, with no restart by hand.
    let t = Instant::now();
    let (again, _) = finish(start_mgs(c, launcher), &format!("{what}: the next job"));
    assert_eq!(again, want, "{what}: the next job");
    let verdict = verdict_after(c, victim, stopped);
    assert!(verdict.is_some(), "{what}: no committed verdict in the logs");
    eprintln!(
        "{what}: verdict {:.3} s after SIGSTOP; back as a new incarnation {back:?} after SIGCONT; next job took {:?}",
        verdict.unwrap_or_default(),
        t.elapsed()
    );
    back
}

#[test]
fn a_paused_node_and_a_paused_coordinator_are_fenced_and_the_job_completes() {
    let c = Cluster::start(4, 0);
    let timeout = Duration::from_millis(c.config().cluster.heartbeat_timeout_ms);
    let (want, _) = finish(start_mgs(&c, "n1"), "the unfailed run");
    // A plain node.
    let back = pause_during_job(&c, "n2", "n1", 2 * timeout, &want);
    assert!(back <= 2 * timeout, "n2 came back {back:?} after SIGCONT");
    // The coordinator.
    let coord = coordinator(&c, "n1");
    assert!(!coord.is_empty(), "no coordinator");
    let launcher = if coord == "n1" { "n2" } else { "n1" };
    let back = pause_during_job(&c, &coord, launcher, 2 * timeout, &want);
    assert!(back <= 2 * timeout, "{coord} came back {back:?} after SIGCONT");
    assert_ne!(coordinator(&c, launcher), "", "a coordinator again");
    // A node in the middle of a persistent checkpoint's writes.
    let back = pause_during(&c, "n3", "n1", 2 * timeout, &want, &["--level", "persistent"], true);
    assert!(back <= 2 * timeout, "n3 came back {back:?} after SIGCONT");
}
