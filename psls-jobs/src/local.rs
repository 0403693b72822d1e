//! The rank nodes' side of job control: whether a node may start a job's ranks, and which of
//! the ranks it runs must stop, decided from the committed metadata alone (the node's own
//! records, not the word of whoever asks).
//!
//! Invariant: a node never runs ranks of a start other than the job's current one, nor during
//! its rollback or stop; so once a new start is recorded, no rank of an older one runs beside
//! it on any node that applied the record (a node that did not is either behind, and catches
//! up before it starts anything, or declared down and fenced).

use psls_pfs::meta::MetaState;
use psls_pfs::runs::RunPhase;

/// Whether this node may start ranks of start `attempt` of `job` now.
pub fn may_spawn(st: &MetaState, job: &str, attempt: u32) -> Result<(), String> {
    match st.runs.get(job) {
        None => Err(format!("job {job} is not running")),
        Some(r) if r.attempt != attempt => Err(format!("job {job} is at start {}, not {attempt}", r.attempt)),
        Some(r) if r.phase != RunPhase::Running => Err(format!("job {job} is not starting ranks now")),
        Some(_) => Ok(()),
    }
}

/// The ranks of start `attempt` of `job` that node `physical` (incarnation `incarnation`, logical
/// id `logical` in its records) runs, as its records say: only while the start may spawn, only
/// if the start names this node's incarnation, only the ranks placed on its logical id.
pub fn ranks_here(
    st: &MetaState,
    job: &str,
    attempt: u32,
    logical: Option<u32>,
    physical: &str,
    incarnation: u64,
) -> Result<Vec<u32>, String> {
    may_spawn(st, job, attempt)?;
    let run = st.runs.get(job).ok_or_else(|| format!("job {job} is not running"))?;
    if st.jobs.get(job).and_then(|r| r.spec.as_ref()).is_none() {
        return Err(format!("job {job} has no record: its ranks are not started"));
    }
    let me = logical.ok_or_else(|| format!("{physical} holds no logical id"))?;
    match run.nodes.get(&me) {
        Some((p, inc)) if p == physical && *inc == incarnation => {}
        _ => {
            return Err(format!(
                "start {attempt} of job {job} does not name this node's incarnation"
            ))
        }
    }
    Ok(run
        .placement
        .iter()
        .enumerate()
        .filter(|(_, l)| **l == me)
        .map(|(r, _)| r as u32)
        .collect())
}

/// Whether the records still stand at the rollback of start `attempt` of `job`: a restore for
/// it goes on only then (a late record of an earlier driver may have moved the job on).
pub fn rolling_back(st: &MetaState, job: &str, attempt: u32) -> bool {
    st.runs
        .get(job)
        .is_some_and(|r| r.attempt == attempt && matches!(r.phase, RunPhase::RollingBack { .. }))
}

/// Whether ranks of start `attempt` of `job` must stop: a later start is recorded, the start
/// is being rolled back or stopped, or the job ended.
pub fn stale(st: &MetaState, job: &str, attempt: u32) -> bool {
    if let Some(r) = st.runs.get(job) {
        return r.attempt > attempt
            || (r.attempt == attempt && matches!(r.phase, RunPhase::RollingBack { .. } | RunPhase::Stopping { .. }));
    }
    st.ended.get(job).is_some_and(|(_, e)| e.attempt >= attempt)
}

/// Whether this node keeps its record of `job` (its ranks here, their exits, the forwarded
/// input): while a rank of it runs here, while the records run the job, and while they do
/// not hold its end yet (this node may be behind the start it ran).
pub fn keeps_record(st: &MetaState, job: &str, running_here: bool) -> bool {
    running_here || st.runs.contains_key(job) || !st.ended.contains_key(job)
}

/// Whether this node keeps `job`'s output: while it keeps the job's record, while the records
/// run the job, and while they keep its end (followers fetch the last lines with the end; the
/// records keep the newest [`psls_pfs::runs::MAX_ENDED`] ends).
pub fn keeps_output(st: &MetaState, job: &str, record_here: bool) -> bool {
    record_here || st.runs.contains_key(job) || st.ended.contains_key(job)
}

#[cfg(test)]
mod tests {
    use super::*;
    use psls_pfs::meta::MetaOp;
    use psls_pfs::runs::{EndHow, JobEnd, RunRecord};

    fn apply(st: &mut MetaState, op: MetaOp) {
        let i = st.seq + 1;
        st.apply_at(i, &op).expect("applies");
    }

    #[test]
    fn only_the_current_running_start_may_run() {
        let mut st = MetaState::default();
        apply(
            &mut st,
            MetaOp::InitMap {
                logical: [(0, "n0".to_string())].into(),
            },
        );
        assert!(may_spawn(&st, "j", 0).is_err(), "no record yet");
        assert!(!stale(&st, "j", 0), "an unknown job's ranks are not stopped");
        let run = |attempt| RunRecord {
            attempt,
            placement: vec![0],
            nodes: [(0, ("n0".to_string(), 1))].into(),
            ..RunRecord::default()
        };
        apply(
            &mut st,
            MetaOp::JobStart {
                job: "j".into(),
                spec: Box::default(),
                options: Box::default(),
                run: Box::new(run(0)),
            },
        );
        assert!(may_spawn(&st, "j", 0).is_ok());
        assert!(may_spawn(&st, "j", 1).is_err(), "not a start to come");
        assert!(!stale(&st, "j", 0));
        let phase = |phase| MetaOp::JobPhase {
            job: "j".into(),
            attempt: 0,
            phase,
        };
        apply(
            &mut st,
            phase(RunPhase::RollingBack {
                why: "n1 went down".into(),
            }),
        );
        assert!(may_spawn(&st, "j", 0).is_err(), "not during its rollback");
        assert!(stale(&st, "j", 0), "its ranks stop during its rollback");
        apply(
            &mut st,
            MetaOp::JobRestart {
                job: "j".into(),
                attempt: 0,
                run: Box::new(run(1)),
            },
        );
        assert!(stale(&st, "j", 0), "an older start's ranks stop");
        assert!(!stale(&st, "j", 1));
        assert!(may_spawn(&st, "j", 0).is_err());
        assert!(may_spawn(&st, "j", 1).is_ok());
        assert_eq!(ranks_here(&st, "j", 1, Some(0), "n0", 1), Ok(vec![0]));
        assert!(
            ranks_here(&st, "j", 1, Some(0), "n0", 2).is_err(),
            "another incarnation"
        );
        assert!(
            ranks_here(&st, "j", 1, Some(1), "n1", 1).is_err(),
            "a node the start does not name"
        );
        assert!(ranks_here(&st, "j", 1, None, "n0", 1).is_err(), "no logical id");
        assert!(ranks_here(&st, "j", 0, Some(0), "n0", 1).is_err(), "an older start");
        apply(
            &mut st,
            MetaOp::JobPhase {
                job: "j".into(),
                attempt: 1,
                phase: RunPhase::Finishing,
            },
        );
        assert!(may_spawn(&st, "j", 1).is_err(), "not once finishing");
        let end = JobEnd {
            how: EndHow::Finished,
            code: 0,
            message: String::new(),
            attempt: 1,
            at_unix_ms: 0,
        };
        apply(&mut st, MetaOp::JobEnd { job: "j".into(), end });
        assert!(stale(&st, "j", 1), "an ended job's ranks stop");
        assert!(may_spawn(&st, "j", 1).is_err());
        // Its record goes once no rank of it runs here; its output stays with its end.
        assert!(keeps_record(&st, "j", true), "a rank still runs here");
        assert!(!keeps_record(&st, "j", false));
        assert!(keeps_output(&st, "j", false), "followers fetch the end");
        assert!(keeps_record(&st, "k", false), "a job the records do not know yet");
        assert!(
            !keeps_output(&MetaState::default(), "j", false),
            "an end no longer kept"
        );
        assert!(keeps_output(&MetaState::default(), "j", true));
    }
}
