//! Failing disks. Nothing finished is lost (DESIGN §2a): a job whose ranks all exited 0 but
//! whose last persistent checkpoint fails — here on a full disk, a small filesystem mounted
//! under one node's page store — keeps its result in a memory checkpoint and stays resumable
//! with the reason; once space is freed, `psls run --resume` only writes it, and the file on
//! disk is the one an unfailed run leaves. And a node whose disk fails an fsync is failed for
//! good: it says so, the spare takes its place, and the job completes.

use psls_tests::faults::Mount;
use psls_tests::*;
use std::time::Duration;

const FILE: &str = "mgs-1024x1024";

fn mgs(c: &Cluster) -> std::process::Child {
    mgs_with(c, &[])
}

fn mgs_with(c: &Cluster, options: &[&str]) -> std::process::Child {
    start_mgs_job(c, "n0", options)
}

#[test]
fn a_full_disk_at_a_jobs_last_checkpoint_keeps_its_result_and_resume_writes_it() {
    let c = Cluster::init(4, 0, |_| {});
    let cfg = c.config();
    let pages = cfg.data_dir(cfg.entry("n2").expect("n2")).join("pages");
    let Some(disk) = Mount::tmpfs(&pages, "64m") else {
        cannot_run("cannot mount a small filesystem here (mount -t tmpfs needs root)");
        return;
    };
    c.ok(&["cluster", "up"]);
    // The unfailed run's result on disk, then the file goes: the next run makes it anew.
    let (want_sum, _) = finish(mgs(&c), "the unfailed run");
    let want = c.export(FILE, &[]);
    c.ok(&["rm", FILE]);

    let mut run = mgs(&c);
    let (job, rest) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    // n2's disk fills up: the job's memory checkpoints go on, its last persistent one fails.
    disk.fill(16 * 1024);
    let o = run.wait_with_output().expect("psls run");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut { rest }, &mut err).expect("read");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(75), "resumable, not failed:\n{out}\n{err}");
    assert!(
        out.contains(&want_sum),
        "the ranks computed the unfailed result:\n{out}"
    );
    assert!(
        err.contains("last persistent checkpoint failed") && err.contains("psls run --resume"),
        "{err}"
    );
    let entry = c.job_entry(&job);
    assert_eq!(entry["state"], "resumable", "{entry}");
    let why = entry["finished"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("space") || why.contains("No space"), "the reason: {entry}");
    assert!(c.ok(&["jobs"]).contains("finished computing, but"));

    // Space freed: the resume only writes the result (no rank runs again).
    disk.free();
    let resumed = c
        .cmd(&["--node", "n1", "run", "--resume", &job])
        .output()
        .expect("psls run --resume");
    let said = String::from_utf8_lossy(&resumed.stderr).to_string();
    assert!(resumed.status.success(), "{said}");
    assert!(said.contains("had finished") && said.contains("written"), "{said}");
    assert!(
        !String::from_utf8_lossy(&resumed.stdout).contains("\"bench\":\"mgs\""),
        "no rank ran again"
    );
    assert_same(&c.export(FILE, &[]), &want, "the result written by the resume");
    // The job is over, and listed as finished (like `sacct`).
    let entry = c.job_entry(&job);
    assert_eq!(entry["state"], "finished", "{entry}");
    // And the cluster goes on at once: where a heartbeat's figure of free space is short (n2's
    // says its disk is full until its next periodic measure), it is measured afresh.
    let (again, _) = finish(mgs(&c), "a job after the resume");
    assert_eq!(again, want_sum);
    c.ok(&["cluster", "down"]);
}

#[test]
fn a_node_whose_fsync_fails_is_replaced_by_the_spare_and_the_job_completes() {
    let mut c = Cluster::init(4, 2, |_| {});
    c.env.push(("PSLS_FAULT_DISK".into(), "1".into()));
    c.ok(&["cluster", "up"]);
    let (want, _) = finish(mgs(&c), "the unfailed run");
    let cfg = c.config();
    let n2_dir = cfg.data_dir(cfg.entry("n2").expect("n2"));
    let pid = c.pid("n2");
    // Persistent checkpoints: each one fsyncs every node's page store.
    let mut run = mgs_with(&c, &["--level", "persistent"]);
    let (job, rest) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    // From now on every fsync of n2's page store fails (the fault disk's trigger).
    std::fs::write(n2_dir.join("fail-sync"), b"").expect("trigger");
    let mut said = None;
    wait_for(Duration::from_secs(60), "n2 reporting its failed disk", || {
        said = c
            .status()
            .nodes
            .iter()
            .find(|n| n.name == "n2")
            .and_then(|n| n.disk_failed.clone());
        said.is_some()
    });
    let (got, err) = finish_rest(run, rest, "a failed fsync on n2");
    c.assert_no_rank_left("a failed fsync on n2");
    assert_eq!(got, want, "the job's result with n2's disk failed\n{err}");
    assert!(err.contains("rolling job"), "the job rolled back: {err}");
    // The spare holds n2's logical id; n2 stopped instead of rejoining.
    let st = c.status();
    let s0 = st.nodes.iter().find(|n| n.name == "s0").expect("s0");
    assert_eq!(s0.logical, Some(2), "{st:?}");
    assert!(
        psls_client::cluster::wait_gone(pid, Duration::from_secs(10)),
        "n2 stopped"
    );
    assert!(c.log("n2").contains("fenced with a failed disk"), "{}", c.log("n2"));
    let text = c.ok(&["cluster", "status"]);
    assert!(text.contains("disk failed"), "{text}");
    eprintln!("n2 said: {}", said.unwrap_or_default());
    // The cluster goes on without it.
    let (again, _) = finish(mgs(&c), "a job after the replacement");
    assert_eq!(again, want);

    // Then the coordinator's disk fails: another node claims the coordination and declares it
    // down, the second spare takes its logical id, and the job (launched elsewhere) completes.
    let coord = st.coordinator.clone().expect("a coordinator");
    let logical = st.nodes.iter().find(|n| n.name == coord).and_then(|n| n.logical);
    let launcher = if coord == "n1" { "n3" } else { "n1" };
    let cpid = c.pid(&coord);
    let cdir = cfg.data_dir(cfg.entry(&coord).expect("coordinator entry"));
    let mut run = start_mgs_job(&c, launcher, &["--level", "persistent"]);
    let (job, rest) = job_id(&mut run);
    wait_first_checkpoint(&c, &job);
    std::fs::write(cdir.join("fail-sync"), b"").expect("trigger");
    let what = format!("a failed fsync on the coordinator {coord}");
    let (got, err) = finish_rest(run, rest, &what);
    c.assert_no_rank_left(&what);
    assert_eq!(got, want, "{what}\n{err}");
    assert!(
        psls_client::cluster::wait_gone(cpid, Duration::from_secs(10)),
        "{coord} stopped"
    );
    let st = c.status();
    let s1 = st.nodes.iter().find(|n| n.name == "s1").expect("s1");
    assert_eq!(s1.logical, logical, "{st:?}");
    assert_ne!(st.coordinator.as_deref(), Some(coord.as_str()), "{st:?}");
    let (again, _) = finish(
        start_mgs_job(&c, launcher, &[]),
        "a job after the coordinator's replacement",
    );
    assert_eq!(again, want);
}
