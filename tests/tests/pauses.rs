//! A paused node is fenced, not fatal (DESIGN §2): SIGSTOP of a daemon for twice the failure
//! timeout, then SIGCONT, during an MGS job — a plain node, the coordinator, and a node in the
//! middle of a persistent checkpoint's writes. The others declare it down by a committed
//! verdict and drop what its old incarnation still sends; it learns its verdict when it wakes,
//! stops its ranks and rejoins as a new incarnation (re-executed in place: the same pid); the
//! job rolls back, completes with the checksum of an unfailed run, and the next job runs at
//! once.
//!
//! The job's `psls run` talks to a node that is not paused (surviving the pause of that node
//! belongs to job control).

mod common;

use psls_tests::*;
use std::time::Duration;

fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).expect("signal");
}

/// Pauses `victim` for twice the failure timeout during a job; checks that it came back in
/// place within that long after SIGCONT and that the verdict came about one timeout after
/// SIGSTOP.
fn pause(c: &Cluster, victim: &str, launcher: &str, want: &str, options: &[&str], in_checkpoint: bool) {
    let timeout = Duration::from_millis(c.config().cluster.heartbeat_timeout_ms);
    let pid = c.pid(victim);
    let (verdict, back) = common::disrupt_during_job(
        c,
        "SIGSTOP",
        victim,
        launcher,
        want,
        options,
        in_checkpoint,
        2 * timeout,
        &mut || signal(pid, nix::sys::signal::Signal::SIGSTOP),
        &mut || signal(pid, nix::sys::signal::Signal::SIGCONT),
    );
    assert_eq!(c.pid(victim), pid, "{victim}: the daemon re-executes itself in place");
    assert!(back <= 2 * timeout, "{victim} came back {back:?} after SIGCONT");
    assert!(
        verdict < 2.0 * timeout.as_secs_f64(),
        "{victim}: verdict {verdict} s after SIGSTOP"
    );
}

#[test]
fn a_paused_node_a_paused_coordinator_and_a_node_paused_in_a_checkpoint_are_fenced_and_the_job_completes() {
    let c = Cluster::start(4, 0);
    let (want, _) = common::finish_unfailed(&c, "n1");
    pause(&c, "n2", "n1", &want, &[], false);
    let coord = common::coordinator(&c, "n1");
    assert!(!coord.is_empty(), "no coordinator");
    let launcher = if coord == "n1" { "n2" } else { "n1" };
    pause(&c, &coord, launcher, &want, &[], false);
    assert_ne!(common::coordinator(&c, launcher), "", "a coordinator again");
    pause(&c, "n3", "n1", &want, &["--level", "persistent"], true);
}
