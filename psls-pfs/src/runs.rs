//! The durable state of job control: each `psls run` job's current start (its [`RunRecord`]:
//! which start, where its ranks run, in which phase it is) and the jobs that ended, kept like
//! `sacct` keeps them ([`JobEnd`]).
//!
//! Only the job-control machine (`psls_jobs`) writes them, through the metadata log's
//! operations [`crate::meta::MetaOp::JobStart`], `JobRestart`, `JobPhase`, `JobHalt` and
//! `JobEnd`; every check that makes them safe is here, so that a leader acting on an old view
//! is refused rather than obeyed:
//! - a start needs no current run, a restart the current start's number plus one;
//! - a phase change and an end name the start they are for, and an end happens once;
//! - the ended jobs kept are bounded ([`MAX_ENDED`]): the oldest go first.

use crate::error::MetaError;
use crate::jobs::validate_job;
use crate::meta::MetaState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most ended jobs kept (the oldest go first).
pub const MAX_ENDED: usize = 1024;
/// Most bytes a job's environment takes (names and values).
pub const MAX_ENV_BYTES: usize = 256 * 1024;
/// Most ranks a job has.
pub const MAX_RANKS: u32 = 4096;
/// Most nodes a start may be confined to ([`RunRecord::hosts`]), and the longest name.
pub const MAX_HOSTS: usize = 2048;
pub const MAX_HOST_LEN: usize = 255;
/// Longest message kept with a phase or an end, in bytes.
pub const MAX_MESSAGE_LEN: usize = 2048;

/// A job's current start.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    /// Which start this is (0: the first; each restart after a failure, and each resume, adds
    /// one). Rank nodes run ranks of this start only.
    pub attempt: u32,
    /// How many times the job was restarted after a failure since it was (re)started by a
    /// user: at most its `max_restarts`.
    pub restarts: u32,
    /// The checkpoint the ranks start from (0: the job's beginning).
    pub restart_epoch: u64,
    /// The logical node each rank runs on (index: rank).
    pub placement: Vec<u32>,
    /// The physical node and its incarnation, for each logical node running ranks, as the
    /// start was decided: another incarnation there (or a verdict on this one) loses the
    /// start's ranks.
    pub nodes: BTreeMap<u32, (String, u64)>,
    /// The environment the ranks get.
    pub env: Vec<(String, String)>,
    pub phase: RunPhase,
    /// A halt was asked: the next safe point takes a persistent checkpoint and the job ends
    /// halted after it.
    pub halt: bool,
    /// When this start was decided (ms since the Unix epoch, the leader's clock).
    pub since_unix_ms: u64,
    /// The physical nodes this start's ranks, and its restarts' ranks, may run on (`psls run
    /// --nodes`, or the Slurm allocation's); empty: any node.
    pub hosts: Vec<String>,
    /// Rank 0 of this start reads what `psls run` forwards of its standard input (a first
    /// start followed by `psls run`); else every rank reads an empty input.
    pub stdin: bool,
}

/// Where a start is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunPhase {
    /// Its ranks are started (or run).
    #[default]
    Running,
    /// A node running ranks failed (why): the job rolls back to its newest intact checkpoint
    /// and starts again.
    RollingBack { why: String },
    /// Every rank exited 0: the job's last checkpoints are being taken.
    Finishing,
    /// Its ranks are being stopped; then the job ends as `end` says.
    Stopping { end: JobEnd },
}

/// How a job ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EndHow {
    /// Every rank exited 0 and the result is written.
    Finished,
    /// Every rank exited 0 but the last persistent checkpoint failed: the result is kept in a
    /// memory checkpoint, and `psls run --resume` writes it.
    Unwritten,
    /// A rank failed (or the job's last checkpoints did).
    Failed,
    /// Nodes running its ranks failed more often than the job may restart, or its rollback
    /// failed (Slurm's `NODE_FAIL`).
    NodeFail,
    /// Halted after a persistent checkpoint (`psls halt`, or before the allocation's end).
    Halted,
    /// Cancelled by its owner (Ctrl-C of `psls run`, `psls cancel`).
    Cancelled,
}

impl EndHow {
    /// The word `psls jobs` shows.
    pub fn word(self) -> &'static str {
        match self {
            EndHow::Finished => "finished",
            EndHow::Unwritten => "unwritten",
            EndHow::Failed => "failed",
            EndHow::NodeFail => "node_fail",
            EndHow::Halted => "halted",
            EndHow::Cancelled => "cancelled",
        }
    }
}

/// The end of a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobEnd {
    pub how: EndHow,
    /// The status `psls run` exits with.
    pub code: i32,
    /// What happened, for the user.
    pub message: String,
    /// The start that ended.
    pub attempt: u32,
    /// When it ended (ms since the Unix epoch, the leader's clock).
    pub at_unix_ms: u64,
}

/// A job's row in the store: its current start and its end (at most one of them is set).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRow {
    pub run: Option<RunRecord>,
    pub end: Option<(u64, JobEnd)>,
}

fn message_ok(what: &str, m: &str) -> Result<(), MetaError> {
    if m.len() > MAX_MESSAGE_LEN {
        return Err(MetaError::Invalid(format!(
            "{what} takes at most {MAX_MESSAGE_LEN} bytes"
        )));
    }
    Ok(())
}

fn validate_run(st: &MetaState, run: &RunRecord) -> Result<(), MetaError> {
    let ranks = run.placement.len();
    if ranks == 0 || ranks > MAX_RANKS as usize {
        return Err(MetaError::Invalid(format!("a job has 1 to {MAX_RANKS} ranks")));
    }
    for l in &run.placement {
        // An empty map is the configured one (no replacement was recorded yet).
        if !st.logical.is_empty() && !st.logical.contains_key(l) {
            return Err(MetaError::Invalid(format!("no logical node {l} to run a rank")));
        }
        if !run.nodes.contains_key(l) {
            return Err(MetaError::Invalid(format!(
                "logical node {l} runs ranks but has no incarnation"
            )));
        }
    }
    if run.hosts.len() > MAX_HOSTS || run.hosts.iter().any(|h| h.len() > MAX_HOST_LEN) {
        return Err(MetaError::Invalid(format!(
            "a start names at most {MAX_HOSTS} nodes of at most {MAX_HOST_LEN} bytes each"
        )));
    }
    let env: usize = run.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if env > MAX_ENV_BYTES {
        return Err(MetaError::Invalid(format!(
            "the job's environment takes {env} bytes; at most {MAX_ENV_BYTES}"
        )));
    }
    phase_ok(&run.phase)
}

fn phase_ok(p: &RunPhase) -> Result<(), MetaError> {
    match p {
        RunPhase::Running | RunPhase::Finishing => Ok(()),
        RunPhase::RollingBack { why } => message_ok("a rollback's reason", why),
        RunPhase::Stopping { end } => message_ok("a job's end message", &end.message),
    }
}

/// The current run of `job`, if its start is `attempt`.
fn current<'a>(st: &'a MetaState, job: &str, attempt: u32) -> Result<&'a RunRecord, MetaError> {
    match st.runs.get(job) {
        None => Err(MetaError::Invalid(format!("job {job} is not running"))),
        Some(r) if r.attempt != attempt => Err(MetaError::Invalid(format!(
            "job {job} is at start {}, not {attempt}",
            r.attempt
        ))),
        Some(r) => Ok(r),
    }
}

/// `JobStart`: a first start or a resume (no run may be current; a resume's start number is
/// above the last one's).
pub(crate) fn apply_start(st: &mut MetaState, job: &str, run: &RunRecord) -> Result<(), MetaError> {
    validate_job(job)?;
    validate_run(st, run)?;
    if st.runs.contains_key(job) {
        return Err(MetaError::Invalid(format!("job {job} is running")));
    }
    if let Some((_, end)) = st.ended.get(job) {
        if run.attempt <= end.attempt {
            return Err(MetaError::Invalid(format!(
                "job {job} ended at start {}: a resume is a later start",
                end.attempt
            )));
        }
    }
    st.ended.remove(job);
    st.touch_job(job);
    st.runs.insert(job.to_string(), run.clone());
    Ok(())
}

/// `JobRestart`: the next start of a running job, after a rollback.
pub(crate) fn apply_restart(st: &mut MetaState, job: &str, attempt: u32, run: &RunRecord) -> Result<(), MetaError> {
    validate_run(st, run)?;
    let cur = current(st, job, attempt)?;
    if run.attempt != attempt + 1 {
        return Err(MetaError::Invalid(format!(
            "job {job}: the start after {attempt} is {}, not {}",
            attempt + 1,
            run.attempt
        )));
    }
    let mut run = run.clone();
    // A halt asked during the rollback still holds.
    run.halt |= cur.halt;
    // A new start that computes again: a finished result kept before is not its any more. (A
    // start that only writes the restored result keeps it.)
    if run.phase != RunPhase::Finishing {
        st.finished.remove(job);
    }
    st.touch_job(job);
    st.runs.insert(job.to_string(), run);
    Ok(())
}

/// `JobPhase`: the current start moves to `phase`.
pub(crate) fn apply_phase(st: &mut MetaState, job: &str, attempt: u32, phase: &RunPhase) -> Result<(), MetaError> {
    phase_ok(phase)?;
    let mut run = current(st, job, attempt)?.clone();
    if let RunPhase::Stopping { .. } = run.phase {
        // A stop is not taken back (an end is decided once).
        if !matches!(phase, RunPhase::Stopping { .. }) {
            return Err(MetaError::Invalid(format!("job {job} is being stopped")));
        }
    }
    run.phase = phase.clone();
    st.touch_job(job);
    st.runs.insert(job.to_string(), run);
    Ok(())
}

/// `JobHalt`: the running job halts at its next safe point.
pub(crate) fn apply_halt(st: &mut MetaState, job: &str) -> Result<(), MetaError> {
    let Some(run) = st.runs.get(job) else {
        return Err(MetaError::Invalid(format!("job {job} is not running")));
    };
    let mut run = run.clone();
    run.halt = true;
    st.touch_job(job);
    st.runs.insert(job.to_string(), run);
    Ok(())
}

/// `JobEnd`: the current start ends (once); the end is kept, the oldest ends beyond
/// [`MAX_ENDED`] go.
pub(crate) fn apply_end(st: &mut MetaState, index: u64, job: &str, end: &JobEnd) -> Result<(), MetaError> {
    message_ok("a job's end message", &end.message)?;
    current(st, job, end.attempt)?;
    st.runs.remove(job);
    st.ended.insert(job.to_string(), (index, end.clone()));
    st.touch_job(job);
    while st.ended.len() > MAX_ENDED {
        let Some(oldest) = st.ended.iter().min_by_key(|(_, (i, _))| *i).map(|(j, _)| j.clone()) else {
            break;
        };
        st.ended.remove(&oldest);
        st.touch_job(&oldest);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jobs::{JobOptions, JobSummary};
    use crate::meta::MetaOp;

    fn state() -> MetaState {
        let mut st = MetaState::default();
        let logical = (0..3).map(|i| (i, format!("n{i}"))).collect();
        st.apply_at(1, &MetaOp::InitMap { logical }).expect("map");
        st
    }

    fn run(attempt: u32) -> RunRecord {
        RunRecord {
            attempt,
            placement: vec![0, 1, 2, 0],
            nodes: (0..3).map(|l| (l, (format!("n{l}"), 1))).collect(),
            env: vec![("HOME".into(), "/root".into())],
            ..RunRecord::default()
        }
    }

    fn apply(st: &mut MetaState, op: MetaOp) -> Result<(), MetaError> {
        let i = st.seq + 1;
        st.apply_at(i, &op)
    }

    fn start(job: &str, attempt: u32) -> MetaOp {
        MetaOp::JobStart {
            job: job.into(),
            spec: Box::new(JobSummary {
                program: "/bin/true".into(),
                ranks: 4,
                ..JobSummary::default()
            }),
            options: Box::new(JobOptions::default()),
            run: Box::new(run(attempt)),
        }
    }

    fn end(attempt: u32, how: EndHow) -> JobEnd {
        JobEnd {
            how,
            code: 0,
            message: "done".into(),
            attempt,
            at_unix_ms: 5,
        }
    }

    #[test]
    fn a_start_restarts_in_order_and_ends_once() {
        let mut st = state();
        apply(&mut st, start("j", 0)).expect("starts");
        assert!(
            apply(&mut st, start("j", 1)).is_err(),
            "a running job is not started again"
        );
        let restart = |attempt, to| MetaOp::JobRestart {
            job: "j".into(),
            attempt,
            run: Box::new(run(to)),
        };
        assert!(apply(&mut st, restart(0, 2)).is_err(), "a restart is the next start");
        assert!(
            apply(&mut st, restart(1, 2)).is_err(),
            "a restart names the current start"
        );
        apply(&mut st, MetaOp::JobHalt { job: "j".into() }).expect("halts");
        apply(&mut st, restart(0, 1)).expect("restarts");
        assert_eq!(st.runs["j"].attempt, 1);
        assert!(st.runs["j"].halt, "a halt asked before a restart still holds");
        let phase = |attempt, phase| MetaOp::JobPhase {
            job: "j".into(),
            attempt,
            phase,
        };
        assert!(
            apply(&mut st, phase(0, RunPhase::Finishing)).is_err(),
            "an old start's phase is refused"
        );
        apply(&mut st, phase(1, RunPhase::Finishing)).expect("phase");
        let stop = RunPhase::Stopping {
            end: end(1, EndHow::Cancelled),
        };
        apply(&mut st, phase(1, stop)).expect("stops");
        assert!(
            apply(&mut st, phase(1, RunPhase::Running)).is_err(),
            "a stop is not taken back"
        );
        let e = MetaOp::JobEnd {
            job: "j".into(),
            end: end(0, EndHow::Finished),
        };
        assert!(apply(&mut st, e).is_err(), "an old start does not end the job");
        let e = MetaOp::JobEnd {
            job: "j".into(),
            end: end(1, EndHow::Cancelled),
        };
        apply(&mut st, e.clone()).expect("ends");
        assert!(e.reflected_in(&st));
        assert!(apply(&mut st, e).is_err(), "a job ends once");
        assert!(!st.runs.contains_key("j"));
        assert_eq!(st.ended["j"].1.how, EndHow::Cancelled);
        assert!(apply(&mut st, start("j", 1)).is_err(), "a resume is a later start");
        apply(&mut st, start("j", 2)).expect("resumes");
        assert!(!st.ended.contains_key("j"), "a resumed job is running, not ended");
    }

    #[test]
    fn bad_runs_are_refused() {
        let mut st = state();
        let mut r = run(0);
        r.placement.push(7);
        let op = |r: RunRecord| MetaOp::JobStart {
            job: "j".into(),
            spec: Box::default(),
            options: Box::default(),
            run: Box::new(r),
        };
        assert!(apply(&mut st, op(r)).is_err(), "no logical node 7");
        let mut r = run(0);
        r.placement.clear();
        assert!(apply(&mut st, op(r)).is_err(), "no ranks");
        let mut r = run(0);
        r.env.push(("BIG".into(), "x".repeat(MAX_ENV_BYTES)));
        assert!(apply(&mut st, op(r)).is_err(), "environment too big");
        let mut r = run(0);
        r.nodes.remove(&2);
        assert!(apply(&mut st, op(r)).is_err(), "a node without incarnation");
        assert!(st.runs.is_empty());
    }

    #[test]
    fn ended_jobs_are_bounded_oldest_first() {
        let mut st = state();
        for i in 0..MAX_ENDED + 5 {
            let job = format!("j{i}");
            apply(&mut st, start(&job, 0)).expect("starts");
            let e = MetaOp::JobEnd {
                job,
                end: end(0, EndHow::Finished),
            };
            apply(&mut st, e).expect("ends");
        }
        assert_eq!(st.ended.len(), MAX_ENDED);
        assert!(
            (0..5).all(|i| !st.ended.contains_key(&format!("j{i}"))),
            "the oldest go"
        );
        assert!(st.ended.contains_key(&format!("j{}", MAX_ENDED + 4)));
    }

    #[test]
    fn runs_and_ends_survive_encoding_and_the_store_rows() {
        let mut st = state();
        apply(&mut st, start("a", 0)).expect("starts");
        apply(&mut st, start("b", 0)).expect("starts");
        let e = MetaOp::JobEnd {
            job: "b".into(),
            end: end(0, EndHow::Failed),
        };
        apply(&mut st, e).expect("ends");
        let back = MetaState::decode(&st.encode()).expect("decodes");
        assert_eq!(back, st);
        assert_eq!(back.runs.len(), 1);
        assert_eq!(back.ended.len(), 1);
        let mut rows = MetaState::default();
        rows.load(st.all_changes());
        rows.seq = st.seq;
        assert_eq!(rows.runs, st.runs);
        assert_eq!(rows.ended, st.ended);
        // The changes of an end: the job's run row goes, its end row comes.
        let _ = st.take_changes();
        let e = MetaOp::JobEnd {
            job: "a".into(),
            end: end(0, EndHow::Halted),
        };
        apply(&mut st, e).expect("ends");
        let c = st.take_changes();
        assert_eq!(c.runs.len(), 1);
        let row = c.runs[0].1.as_ref().expect("a row");
        assert!(row.run.is_none() && row.end.is_some());
    }

    #[test]
    fn a_snapshot_of_format_6_still_decodes() {
        let st = state();
        let mut bytes = 6u16.to_le_bytes().to_vec();
        bytes.extend(postcard::to_stdvec(&st).expect("encodes"));
        let back = MetaState::decode(&bytes).expect("decodes");
        assert_eq!(back, st);
    }
}
