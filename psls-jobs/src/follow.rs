//! [`Follower`]: what a node tells one client that follows a job (`psls run`, `psls attach`):
//! the job's notes (a rollback, a restart), its ranks' output after what the client already
//! has, each rank's lines once and in order, and its end.
//!
//! The shell (`psls-node`'s `ipc::ranks::follow`) calls [`Follower::handle_tick`] now and then
//! with the committed metadata, fetches the output the machine asks for from every live node,
//! and writes to the client what [`Follower::poll_action`] gives.
//! The same machine delivers output in the job-control simulator (`tests/sim.rs`).
//!
//! Rules:
//! - while the job runs, only lines kept on two nodes are given (`output::Store::since`): a
//!   line a client printed outlives one failure, so a restarted rank printing it again is
//!   matched to it and it is not printed twice;
//! - the end is read before the last fetch: every line its ranks wrote is kept by then, and
//!   at the end fetches go on until one brings nothing new (a fetch returns a bounded amount);
//! - an end of a start before `since` is ignored (what this node's records still say before
//!   they catch up with a resume);
//! - a line after a missing one of the same rank waits [`GAP_WAIT_MS`] for it (a node that did
//!   not answer may keep it), then is sent with the gap skipped; at the end nothing waits;
//! - a client that followed a start before the one the job ended in is told that the job
//!   restarted, though the run's record (and the notes it gives) is gone by then;
//! - a job this node's records do not know is gone only once a fresh read of the metadata
//!   does not know it either (this node may be behind the leader that recorded it).
//!
//! Invariants (asserted): a rank's numbers sent only grow; the end is given once, last.

use crate::output::{line_of, Record};
use psls_pfs::meta::MetaState;
use psls_pfs::runs::{RunPhase, RunRecord};
use std::collections::{BTreeMap, VecDeque};

/// How long a line waits for a missing earlier line of its rank before it goes on past it.
pub const GAP_WAIT_MS: u64 = 2000;

/// What the shell must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FollowAction {
    /// Tell the client about the job (a rollback, a restart).
    Note(String),
    /// Fetch the job's output after `after` (rank → last number the client has) from every
    /// live node, then [`Follower::handle_output`]: only lines kept on two nodes, unless `all`
    /// (the job ended: no rank will print them again).
    Fetch { after: BTreeMap<u32, u64>, all: bool },
    /// Read the metadata fresh from the leader, then [`Follower::handle_fresh`].
    CheckGone,
    /// Send the client this line.
    Line(Record),
    /// Rank `rank`'s numbers after `after` and before `next` are skipped: no node that
    /// answered keeps them (for the log).
    Skipped { rank: u32, after: u64, next: u64 },
    /// The job ended (or is gone): tell the client, and stop following.
    End { code: i32, message: String },
    /// Tell the client the start it follows now, so that a client that follows again from
    /// another node is told what it missed ([`Follower::knowing`]).
    Start(u32),
}

/// What the follower waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    Tick,
    Output,
    Fresh,
    Over,
}

/// One client following one job (see the module doc).
#[derive(Debug)]
pub struct Follower {
    job: String,
    since: u32,
    after: BTreeMap<u32, u64>,
    /// Since when a rank's next line waits for a missing one.
    stalled: BTreeMap<u32, u64>,
    /// What the client was told of the job's record: (start, phase).
    told: Option<(u32, String)>,
    /// The start the client knew when it (re)connected ([`Follower::knowing`]).
    known: Option<u32>,
    /// The end read before the fetch under way.
    end: Option<(i32, String)>,
    wait: Wait,
    actions: VecDeque<FollowAction>,
}

impl Follower {
    /// A follower of `job` for a client that has each rank's lines up to `after`, following
    /// start `since` or a later one.
    pub fn new(job: &str, after: BTreeMap<u32, u64>, since: u32) -> Follower {
        Follower {
            job: job.to_string(),
            since,
            after,
            stalled: BTreeMap::new(),
            told: None,
            known: None,
            end: None,
            wait: Wait::Tick,
            actions: VecDeque::new(),
        }
    }

    /// The client knew start `attempt` when it connected (it followed the job through another
    /// node before, or it started that start here): restarts since are noted, as if this
    /// follower had seen them. The client is told the start at once, before this node's
    /// records show it: a client that loses this node first must still know the start it
    /// followed, to be told of the restarts it then missed.
    pub fn knowing(mut self, attempt: Option<u32>) -> Follower {
        self.known = attempt;
        if let Some(a) = attempt {
            self.actions.push_back(FollowAction::Start(a));
        }
        self
    }

    /// The last number of each rank's lines sent.
    pub fn delivered(&self) -> &BTreeMap<u32, u64> {
        &self.after
    }

    /// Whether the end was given.
    pub fn is_over(&self) -> bool {
        self.wait == Wait::Over
    }

    /// The next action.
    pub fn poll_action(&mut self) -> Option<FollowAction> {
        self.actions.pop_front()
    }

    /// Time passed; `st`: this node's committed metadata now. Ignored while a fetch or a fresh
    /// read is under way.
    pub fn handle_tick(&mut self, st: &MetaState) {
        if self.wait != Wait::Tick {
            return;
        }
        let job = self.job.as_str();
        self.end = st
            .ended
            .get(job)
            .map(|(_, e)| e)
            .filter(|e| e.attempt >= self.since)
            .map(|e| (e.code, e.message.clone()));
        if let Some(run) = st.runs.get(job).filter(|r| r.attempt >= self.since) {
            // This node's records are behind the start the client knew (it followed through a
            // node that was ahead, or this node restarted and replays its log): nothing to tell
            // until they catch up.
            let floor = self.known.max(self.told.as_ref().map(|(a, _)| *a));
            if floor.is_some_and(|k| run.attempt < k) {
                self.fetch();
                return;
            }
            let phase = match &run.phase {
                RunPhase::RollingBack { why } => why.clone(),
                p => format!("{p:?}"),
            };
            let now = (run.attempt, phase);
            if self.told.as_ref() != Some(&now) {
                // A client that followed start `k` elsewhere missed what came since.
                let told = self.told.clone().or_else(|| {
                    self.known
                        .filter(|&k| k < run.attempt)
                        .map(|k| (k, format!("{:?}", RunPhase::Running)))
                });
                for n in notes(st, job, told.as_ref(), run) {
                    self.actions.push_back(FollowAction::Note(n));
                }
                if told.as_ref().is_none_or(|(a, _)| *a != run.attempt) {
                    self.actions.push_back(FollowAction::Start(run.attempt));
                }
                self.told = Some(now);
            }
        } else if let Some(ended) = st.ended.get(job).map(|(_, e)| e).filter(|e| e.attempt >= self.since) {
            // The job ended in a start after the one the client followed (it lost its node,
            // and the job was rolled back and restarted before it followed again): the run's
            // record with its notes is gone, but the client still hears that it restarted.
            let floor = self.known.max(self.told.as_ref().map(|(a, _)| *a));
            if let Some(k) = floor.filter(|&k| k < ended.attempt) {
                self.actions.push_back(FollowAction::Note(format!(
                    "job {job} was rolled back and restarted while this client was away (it followed start {k}; start {} ended)",
                    ended.attempt
                )));
                self.actions.push_back(FollowAction::Start(ended.attempt));
                self.told = Some((ended.attempt, "Ended".to_string()));
            }
        } else {
            self.wait = Wait::Fresh;
            self.actions.push_back(FollowAction::CheckGone);
            return;
        }
        self.fetch();
    }

    fn fetch(&mut self) {
        self.wait = Wait::Output;
        self.actions.push_back(FollowAction::Fetch {
            after: self.after.clone(),
            all: self.end.is_some(),
        });
    }

    /// A fresh read of the metadata, or `None` if it failed (the follower tries again later).
    pub fn handle_fresh(&mut self, st: Option<&MetaState>) {
        if self.wait != Wait::Fresh {
            return;
        }
        self.wait = Wait::Tick;
        let Some(st) = st else { return };
        let job = self.job.as_str();
        let known = st.runs.get(job).is_some_and(|r| r.attempt >= self.since)
            || st.ended.get(job).is_some_and(|(_, e)| e.attempt >= self.since);
        if !known {
            self.over(1, format!("job {job} is gone (removed)"));
        }
    }

    /// What the fetch brought (from every node that answered, in any order), at `now_ms`.
    pub fn handle_output(&mut self, mut records: Vec<Record>, now_ms: u64) {
        if self.wait != Wait::Output {
            return;
        }
        records.sort_by_key(|r| (r.rank, r.seq));
        let last = self.end.is_some();
        let mut blocked: Option<u32> = None;
        let mut sent = 0;
        for rec in records {
            if blocked == Some(rec.rank) {
                continue;
            }
            let have = self.after.get(&rec.rank).copied().unwrap_or(0);
            if rec.seq <= have {
                continue;
            }
            if line_of(rec.seq) > line_of(have) + 1 {
                let since = *self.stalled.entry(rec.rank).or_insert(now_ms);
                if !(last || now_ms.saturating_sub(since) >= GAP_WAIT_MS) {
                    blocked = Some(rec.rank);
                    continue;
                }
                self.actions.push_back(FollowAction::Skipped {
                    rank: rec.rank,
                    after: have,
                    next: rec.seq,
                });
            }
            self.stalled.remove(&rec.rank);
            assert!(rec.seq > have, "a rank's numbers sent only grow");
            self.after.insert(rec.rank, rec.seq);
            sent += 1;
            self.actions.push_back(FollowAction::Line(rec));
        }
        match self.end.clone() {
            // At the end, until every kept line went.
            Some(_) if sent > 0 => self.fetch(),
            Some((code, message)) => self.over(code, message),
            None => self.wait = Wait::Tick,
        }
    }

    fn over(&mut self, code: i32, message: String) {
        assert!(self.wait != Wait::Over, "a follower ends once");
        self.wait = Wait::Over;
        self.actions.push_back(FollowAction::End { code, message });
    }
}

/// What the client is told of `run` after what it was told (`told`: start and phase): the
/// restart that began a later start (also one it missed: a client that followed another node,
/// and knows only an earlier start), then the rollback under way.
fn notes(st: &MetaState, job: &str, told: Option<&(u32, String)>, run: &RunRecord) -> Vec<String> {
    let max = st
        .jobs
        .get(job)
        .and_then(|r| r.spec.as_ref())
        .map_or(0, |s| s.max_restarts);
    let mut out = Vec::new();
    if let Some((_, was)) = told.filter(|(a, _)| *a < run.attempt) {
        let from = if run.restart_epoch == 0 {
            "its start".to_string()
        } else {
            format!("checkpoint {}", run.restart_epoch)
        };
        if was == crate::control::RESUMED {
            out.push(format!("job {job} resumed from {from}"));
        } else {
            out.push(format!(
                "job {job} restarted from {from} (restart {} of at most {max})",
                run.restarts
            ));
        }
    }
    if let RunPhase::RollingBack { why } = &run.phase {
        if why != crate::control::RESUMED {
            out.push(format!("{why}: rolling job {job} back to its last checkpoint"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::LINE_STEP;

    fn rec(rank: u32, line: u64) -> Record {
        Record {
            rank,
            seq: line * LINE_STEP,
            err: false,
            data: format!("r{rank} l{line}\n").into_bytes(),
        }
    }

    /// Records where job "j" finished in start `attempt`.
    fn finished_in(attempt: u32) -> MetaState {
        let mut st = MetaState::default();
        let end = psls_pfs::runs::JobEnd {
            how: psls_pfs::runs::EndHow::Finished,
            code: 0,
            message: String::new(),
            attempt,
            at_unix_ms: 0,
        };
        st.ended.insert("j".into(), (7, end));
        st
    }

    fn lines(f: &mut Follower) -> Vec<(u32, u64)> {
        std::iter::from_fn(|| f.poll_action())
            .filter_map(|a| match a {
                FollowAction::Line(r) => Some((r.rank, line_of(r.seq))),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_client_back_after_the_job_ended_in_a_later_start_hears_of_the_restart() {
        let st = finished_in(3);
        // The client followed start 1 through a node it lost.
        let mut f = Follower::new("j", BTreeMap::new(), 1).knowing(Some(1));
        // The client is told back at once the start it knows.
        assert_eq!(f.poll_action(), Some(FollowAction::Start(1)));
        f.handle_tick(&st);
        let note = f.poll_action();
        assert!(
            matches!(&note, Some(FollowAction::Note(n)) if n.contains("restarted") && n.contains("start 3")),
            "{note:?}"
        );
        assert_eq!(f.poll_action(), Some(FollowAction::Start(3)));
        assert!(matches!(f.poll_action(), Some(FollowAction::Fetch { all: true, .. })));
        f.handle_output(Vec::new(), 0);
        assert!(matches!(f.poll_action(), Some(FollowAction::End { code: 0, .. })));
        assert!(f.is_over());
        // A client that followed the start that ended, or a new one, hears no restart.
        for known in [Some(3), None] {
            let mut f = Follower::new("j", BTreeMap::new(), 1).knowing(known);
            f.handle_tick(&st);
            let told: Vec<FollowAction> = std::iter::from_fn(|| f.poll_action()).collect();
            assert!(
                matches!(told.last(), Some(FollowAction::Fetch { all: true, .. }))
                    && !told.iter().any(|a| matches!(a, FollowAction::Note(_))),
                "{told:?}"
            );
        }
    }

    /// A client that started a job through a node, and lost that node before its records
    /// showed the start (the CI met it: the node was paused right after the start), still
    /// hears of the restart from the next node: it was told its start at once.
    #[test]
    fn a_client_that_lost_its_node_before_its_records_showed_the_start_hears_of_the_restart() {
        let mut f = Follower::new("j", BTreeMap::new(), 0).knowing(Some(0));
        // The first node's records do not show the start yet: all the client heard is its start.
        f.handle_tick(&MetaState::default());
        assert_eq!(f.poll_action(), Some(FollowAction::Start(0)));
        assert_eq!(f.poll_action(), Some(FollowAction::CheckGone));
        assert_eq!(f.poll_action(), None);
        // The next node knows the job ended in start 1.
        let st = finished_in(1);
        let mut f = Follower::new("j", BTreeMap::new(), 0).knowing(Some(0));
        f.handle_tick(&st);
        let told: Vec<FollowAction> = std::iter::from_fn(|| f.poll_action()).collect();
        assert!(
            told.iter()
                .any(|a| matches!(a, FollowAction::Note(n) if n.contains("restarted"))),
            "{told:?}"
        );
    }

    #[test]
    fn a_gap_waits_then_is_skipped_and_each_line_goes_once_in_order() {
        let mut f = Follower::new("j", BTreeMap::new(), 1);
        // The job is not in these records: a fresh read decides.
        f.handle_tick(&MetaState::default());
        assert_eq!(f.poll_action(), Some(FollowAction::CheckGone));
        f.handle_fresh(None);
        assert!(!f.is_over());
        f.handle_tick(&MetaState::default());
        assert_eq!(f.poll_action(), Some(FollowAction::CheckGone));
        f.handle_fresh(Some(&MetaState::default()));
        assert_eq!(
            f.poll_action(),
            Some(FollowAction::End {
                code: 1,
                message: "job j is gone (removed)".into()
            })
        );
        // Rank 0's line 2 is missing: line 3 waits, rank 1 goes on.
        let mut f = Follower::new("j", BTreeMap::new(), 0);
        f.wait = Wait::Output;
        f.handle_output(vec![rec(0, 1), rec(0, 3), rec(1, 1), rec(1, 2), rec(0, 1)], 0);
        assert_eq!(lines(&mut f), vec![(0, 1), (1, 1), (1, 2)]);
        f.wait = Wait::Output;
        f.handle_output(vec![rec(0, 3)], GAP_WAIT_MS - 1);
        assert_eq!(lines(&mut f), vec![]);
        f.wait = Wait::Output;
        f.handle_output(vec![rec(0, 3), rec(0, 2), rec(1, 2)], GAP_WAIT_MS - 1);
        assert_eq!(lines(&mut f), vec![(0, 2), (0, 3)]);
        f.wait = Wait::Output;
        f.handle_output(vec![rec(0, 5)], 10_000);
        assert_eq!(lines(&mut f), vec![]);
        f.wait = Wait::Output;
        f.handle_output(vec![rec(0, 5)], 10_000 + GAP_WAIT_MS);
        assert_eq!(lines(&mut f), vec![(0, 5)]);
        assert_eq!(f.delivered().get(&0), Some(&(5 * LINE_STEP)));
    }
}
