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
}
