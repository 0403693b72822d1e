//! What the pause and partition tests share: an MGS job during which one node is cut off from
//! the others for a while (a pause, a partition), and what must hold after it — the job ends
//! with an unfailed run's checksum, the node is back as a new incarnation, the coordinator
//! committed its verdict, no rank outlived the job, no two nodes coordinated at once (by the
//! logs' take-overs), and the next job runs at once.

use psls_tests::*;
use std::collections::BTreeMap;
use std::process::Child;
use std::time::{Duration, Instant};

pub fn start_mgs(c: &Cluster, launcher: &str, options: &[&str]) -> Child {
    start_mgs_job(c, launcher, options)
}

/// An unfailed run's checksum (and stderr), launched through `launcher`.
pub fn finish_unfailed(c: &Cluster, launcher: &str) -> (String, String) {
    finish(start_mgs(c, launcher, &[]), "the unfailed run")
}

/// The incarnation of `node` as `asked` sees it (0: not up there).
pub fn incarnation(c: &Cluster, asked: &str, node: &str) -> u64 {
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
pub fn coordinator(c: &Cluster, asked: &str) -> String {
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
    d.as_secs_f64() % 86400.0
}

/// How long after `since` (seconds of the day) the coordinator committed `victim`'s verdict,
/// from the daemons' logs.
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

/// Checks the daemons' logs for overlapping coordination: every take-over of barriers and
/// locks names its coordinator `name#incarnation@epoch`; no epoch has two coordinators, and
/// in time order a take-over by another node is always in a newer epoch (coordination only
/// ever passes forward; a node that took over in an older epoch after a newer one was
/// coordinating while another did).
/// Returns the take-overs seen: (coordinator, epoch) in time order.
pub fn assert_no_overlapping_coordination(c: &Cluster, what: &str) -> Vec<(String, u64)> {
    let mut takeovers: Vec<(f64, String, u64, String)> = Vec::new();
    for n in ["n0", "n1", "n2", "n3"] {
        for l in c.log(n).lines() {
            if !l.contains("coordinating barriers and locks") {
                continue;
            }
            let Some(id) = l.split("coordinator=").nth(1).and_then(|r| r.split_whitespace().next()) else {
                panic!("{what}: a take-over without its coordinator's identity: {l}");
            };
            let (name, epoch) = id
                .split_once('#')
                .and_then(|(name, r)| Some((name, r.split_once('@')?.1)))
                .unwrap_or_else(|| panic!("{what}: bad coordinator identity {id}"));
            let epoch: u64 = epoch.parse().unwrap_or_else(|_| panic!("{what}: bad epoch in {id}"));
            let t = log_secs(l).unwrap_or_else(|| panic!("{what}: no time in {l}"));
            takeovers.push((t, name.to_string(), epoch, l.to_string()));
        }
    }
    takeovers.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert!(
        !takeovers.is_empty(),
        "{what}: no take-over of barriers and locks in the logs"
    );
    let mut by_epoch: BTreeMap<u64, String> = BTreeMap::new();
    for (_, name, epoch, line) in &takeovers {
        if let Some(other) = by_epoch.insert(*epoch, name.clone()) {
            assert_eq!(
                &other, name,
                "{what}: two coordinators in epoch {epoch}: {other} and {line}"
            );
        }
    }
    for w in takeovers.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if a.1 != b.1 {
            assert!(
                b.2 > a.2,
                "{what}: {} took over in epoch {} after {} had in epoch {}:\n{}\n{}",
                b.1,
                b.2,
                a.1,
                a.2,
                a.3,
                b.3
            );
        }
    }
    takeovers.into_iter().map(|(_, n, e, _)| (n, e)).collect()
}

/// One disruption of `victim` during an MGS job launched through `launcher` with `options`:
/// `cut` starts it (once the job committed a checkpoint; with `in_checkpoint`, while the
/// coordinator shows one writing its pages), `heal` ends it `hold` later. Checks the job's
/// checksum against `want`, the victim's new incarnation, the committed verdict, that no rank
/// outlived the job, and that a job runs right after. Returns the verdict's delay after the
/// cut and the new incarnation's after the heal.
#[allow(clippy::too_many_arguments)]
pub fn disrupt_during_job(
    c: &Cluster,
    what: &str,
    victim: &str,
    launcher: &str,
    want: &str,
    options: &[&str],
    in_checkpoint: bool,
    hold: Duration,
    cut: &mut dyn FnMut(),
    heal: &mut dyn FnMut(),
) -> (f64, Duration) {
    let what = format!("{what} of {victim} for {hold:?} (launcher {launcher}, {options:?})");
    let before = incarnation(c, launcher, victim);
    assert!(before > 0, "{what}: {victim} is not up before");
    let mut job = start_mgs(c, launcher, options);
    let (id, rest) = job_id(&mut job);
    // The job's notes as they come, with when they came.
    let notes = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut seen = Vec::new();
        for line in rest.lines().map_while(Result::ok) {
            seen.push((Instant::now(), line));
        }
        seen
    });
    wait_first_checkpoint(c, &id);
    if in_checkpoint {
        wait_for(Duration::from_secs(60), "a checkpoint writing its pages", || {
            c.job_entry(&id)["activity"]
                .as_str()
                .is_some_and(|a| a.contains("writing pages"))
        });
    }
    let started = now_secs();
    cut();
    std::thread::sleep(hold);
    heal();
    let healed = Instant::now();
    let back = loop {
        if incarnation(c, launcher, victim) > before {
            break healed.elapsed();
        }
        assert!(
            healed.elapsed() < Duration::from_secs(30),
            "{what}: {victim} never came back as a new incarnation\n{}",
            c.log(victim)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let notes = notes.join().expect("notes");
    let text: String = notes.iter().map(|(_, l)| format!("{l}\n")).collect();
    let (got, err) = finish_rest(job, std::io::Cursor::new(text), &what);
    // The ranks ran again once the launcher said the job restarted, after the heal.
    let running = notes
        .iter()
        .find(|(t, l)| *t >= healed && l.contains("restarted from"))
        .map(|(t, _)| t.duration_since(healed))
        .unwrap_or_else(|| panic!("{what}: the job never restarted after the heal:\n{err}"));
    assert_eq!(got, want, "{what}: checksum differs from the unfailed run's\n{err}");
    c.assert_no_rank_left(&what);
    let takeovers = assert_no_overlapping_coordination(c, &what);
    let verdict =
        verdict_after(c, victim, started).unwrap_or_else(|| panic!("{what}: no committed verdict in the logs"));
    // The cluster serves the next job at once, with no restart by hand.
    let t = Instant::now();
    let (again, _) = finish(start_mgs(c, launcher, &[]), &format!("{what}: the next job"));
    assert_eq!(again, want, "{what}: the next job");
    eprintln!(
        "{what}: verdict {verdict:.3} s after the start; back as a new incarnation {back:?} and ranks running again {running:?} after the end; next job took {:?}; take-overs so far {takeovers:?}",
        t.elapsed()
    );
    (verdict, back)
}
