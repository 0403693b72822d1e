//! A restart is local (issue 39): a node that restarts between jobs — kill -9 of the CLI's
//! node, of a manager, of the node that owns the pages the last job wrote, or a pause past the
//! failure timeout that makes it re-execute itself — costs nothing but its own memory. The
//! next job on the same file starts at once and ends with the unfailed run's checksum, and
//! the file exports bit-identical before and after. Before, every later job on the file failed
//! (`the page's manager node restarted and lost its directory`, or `the page's only
//! up-to-date copy was lost`) until every daemon was restarted.

#[allow(dead_code)]
mod common;

use psls_tests::*;
use std::time::{Duration, Instant};

const FILE: &str = "mgs-1024x1024";

/// Runs the next MGS job on the same file through `launcher`, within 120 s; checks its
/// checksum and that it never rolled back.
fn next_job(c: &Cluster, launcher: &str, want: &str, after: &str) {
    let what = format!("the job after {after}");
    let t = Instant::now();
    let (got, err) = finish(common::start_mgs(c, launcher, &[]), &what);
    assert_eq!(got, want, "{what}: checksum differs from the unfailed run's\n{err}");
    assert!(!err.contains("restarted from"), "{what}: rolled back\n{err}");
    assert!(t.elapsed() < Duration::from_secs(120), "{what} took {:?}", t.elapsed());
}

fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).expect("signal");
}

#[test]
fn a_file_is_used_again_at_once_after_any_node_restarts_between_jobs() {
    let c = Cluster::start(4, 0);
    let (want, _) = common::finish_unfailed(&c, "n1");
    let exported = c.export(FILE, &[]);
    // The CLI's node, a node that is none of it, and n0 (the coordinator, which owns pages
    // the last job wrote): each kill -9, then back, then the next job on the same file.
    for (victim, launcher) in [("n1", "n1"), ("n3", "n2"), ("n0", "n1"), ("n2", "n2")] {
        let before = common::incarnation(&c, launcher, victim);
        c.kill(victim);
        c.ok(&["cluster", "up"]);
        assert!(
            common::incarnation(&c, launcher, victim) > before,
            "{victim} is back as a new incarnation"
        );
        assert_same(
            &c.export(FILE, &[]),
            &exported,
            &format!("export after {victim} restarted"),
        );
        next_job(&c, launcher, &want, &format!("kill -9 of {victim}"));
        assert_same(
            &c.export(FILE, &[]),
            &exported,
            &format!("export after the job after {victim}"),
        );
    }
    // A pause past the failure timeout: the node learns its verdict when it wakes and
    // re-executes itself as a new incarnation (same pid).
    let timeout = Duration::from_millis(c.config().cluster.heartbeat_timeout_ms);
    let before = common::incarnation(&c, "n1", "n3");
    let pid = c.pid("n3");
    signal(pid, nix::sys::signal::Signal::SIGSTOP);
    std::thread::sleep(3 * timeout);
    signal(pid, nix::sys::signal::Signal::SIGCONT);
    wait_for(Duration::from_secs(30), "n3 back as a new incarnation", || {
        common::incarnation(&c, "n1", "n3") > before
    });
    c.ok(&["cluster", "up"]);
    next_job(&c, "n1", &want, "a pause of n3");
    assert!(
        !c.logs_contain("refused until no node holds shared pages"),
        "no node refused pages as restarted"
    );
}
