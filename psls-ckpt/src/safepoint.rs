//! The safe-point call (`Session::checkpoint`, `psls_checkpoint`), at the coordinator: every
//! rank of a job calls it at the same point of its main loop; once all have, the coordinator
//! decides once, for all of them, whether this call takes a checkpoint — when the job's
//! interval has elapsed since its last checkpoint (or its start), when an operator asked for
//! one (`psls checkpoint`) or for a halt (`psls halt`: a checkpoint, then the job stops) — or
//! does nothing.
//!
//! Every call carries its number within the job's start (`seq`: 1, 2, …, counted by the rank's
//! node), so that a call repeated after its answer was lost (with a killed coordinator) is
//! never taken for the rank's next one: the ranks of one decision made the same call.
//!
//! Invariants: a decision covers exactly the ranks `0..size` of one call, each once, all with
//! the same number; a call that not every rank makes within the timeout fails for the ranks
//! that made it (the job's checkpoints are untouched), and so does a call whose ranks are out
//! of step; a forced checkpoint is taken at the next call, and cleared only when one commits;
//! the tables are bounded ([`crate::MAX_ROUNDS`] jobs, `size` ranks each).

use psls_svm::{ErrorKind, FileId, NodeId};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Whether a call's checkpoint that failed with an error of class `kind` lets its ranks go on
/// as if the interval had not elapsed: when the cluster cannot take one now (a node down or
/// rebuilding its copies), the next call tries again. Never for a halt (its caller is told)
/// and never after another failure (the ranks are told; the job rolls back).
pub fn goes_on_after(kind: ErrorKind, halt: bool) -> bool {
    kind == ErrorKind::Unavailable && !halt
}

/// What a call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Take a checkpoint; with `halt`, the job stops once it committed. `forced`: an operator
    /// asked for it (`psls checkpoint`), which promises a persistent one.
    Take { halt: bool, forced: bool },
    /// Nothing: the interval has not elapsed.
    Skip,
}

/// What the shell must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SafeAction {
    /// Every rank of `job` called: do `decision` over `files` (every file the ranks map
    /// writable), then answer the ranks (`ranks`: each rank's node) with [`SafePoints::done`].
    Decided {
        job: String,
        decision: Decision,
        files: Vec<FileId>,
        ranks: Vec<(u32, NodeId)>,
    },
    /// Not every rank called within the timeout: fail these ranks' calls. `cluster`: the
    /// cluster's failure, not the program's (a node went down, or a call was one made again
    /// after a change of coordinator, while the others went on): the job rolls back.
    TimedOut {
        job: String,
        ranks: Vec<(u32, NodeId)>,
        why: String,
        cluster: bool,
    },
    /// The ranks' calls have different numbers: fail these ranks' calls. `cluster`: one of
    /// them was made again after a change of coordinator (its answer was lost with the old
    /// one), so the job rolls back; otherwise the program calls at different points.
    OutOfStep {
        job: String,
        ranks: Vec<(u32, NodeId)>,
        why: String,
        cluster: bool,
    },
}

/// Why an arrival is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArriveError {
    /// The rank number or the job's size does not fit the calls in progress.
    Invalid(String),
    /// This rank's previous call is still being decided.
    Again,
    /// Too many jobs at once.
    Full,
    /// The rank's call is not the one the other ranks made: the calls of the others fail too.
    /// `cluster`: as in [`SafeAction::OutOfStep`].
    OutOfStep { why: String, cluster: bool },
}

#[derive(Debug)]
struct Job {
    size: u32,
    /// Which start of the job the calls belong to (a restart after a rollback is a new one).
    attempt: u32,
    interval_ms: u64,
    timeout_ms: u64,
    /// The last commit (or the job's first call here).
    last_ms: u64,
    force: bool,
    halt: bool,
    arrived: BTreeMap<u32, NodeId>,
    /// The number of the call the ranks in `arrived` made.
    seq: u64,
    /// One of the calls in `arrived` was made again after a change of coordinator.
    resent: bool,
    files: BTreeSet<FileId>,
    first_ms: u64,
    /// A decision is being carried out: arrivals wait for `done`.
    deciding: bool,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct SafePoints {
    jobs: BTreeMap<String, Job>,
    actions: VecDeque<SafeAction>,
}

impl SafePoints {
    pub fn new() -> SafePoints {
        SafePoints::default()
    }

    pub fn poll_action(&mut self) -> Option<SafeAction> {
        self.actions.pop_front()
    }

    /// Rank `rank` of start `attempt` of `job` (of `size` ranks; checkpoint interval
    /// `interval_ms`; a call not made by every rank within `timeout_ms` fails), on `node`,
    /// makes its call number `seq` of that start, mapping `files` writable. A call of a later
    /// start replaces the calls of earlier ones (their ranks were stopped); a call of an
    /// earlier start is refused; a call whose number is not the other ranks' fails with theirs.
    #[allow(clippy::too_many_arguments)]
    pub fn arrive(
        &mut self,
        now_ms: u64,
        job: &str,
        (rank, attempt, seq, resent): (u32, u32, u64, bool),
        size: u32,
        (interval_ms, timeout_ms): (u64, u64),
        node: NodeId,
        files: &[FileId],
    ) -> Result<(), ArriveError> {
        if size == 0 || rank >= size {
            return Err(ArriveError::Invalid(format!("rank {rank} of a job of {size}")));
        }
        if !self.jobs.contains_key(job) && self.jobs.len() >= crate::MAX_ROUNDS {
            return Err(ArriveError::Full);
        }
        let j = self.jobs.entry(job.to_string()).or_insert_with(|| Job {
            size,
            attempt,
            interval_ms,
            timeout_ms,
            last_ms: now_ms,
            force: false,
            halt: false,
            arrived: BTreeMap::new(),
            seq,
            resent: false,
            files: BTreeSet::new(),
            first_ms: now_ms,
            deciding: false,
        });
        if attempt < j.attempt {
            return Err(ArriveError::Invalid(format!(
                "rank {rank}'s call belongs to start {attempt} of the job; it is at start {}",
                j.attempt
            )));
        }
        if attempt > j.attempt {
            j.attempt = attempt;
            j.arrived.clear();
            j.files.clear();
            j.deciding = false;
            j.resent = false;
        }
        if j.size != size {
            return Err(ArriveError::Invalid(format!(
                "rank {rank} says the job has {size} ranks; it has {}",
                j.size
            )));
        }
        if j.deciding || j.arrived.contains_key(&rank) {
            return Err(ArriveError::Again);
        }
        if !j.arrived.is_empty() && seq != j.seq {
            let ranks: Vec<(u32, NodeId)> = j.arrived.iter().map(|(r, n)| (*r, *n)).collect();
            let cluster = resent || j.resent;
            let others = if ranks.len() == 1 {
                format!("rank {}", ranks[0].0)
            } else {
                format!("{} ranks", ranks.len())
            };
            let why = if cluster {
                format!(
                    "the job's ranks are out of step: rank {rank} made its checkpoint call {seq} of this start while {others} made call {} (a call answered before its coordinator failed was made again); no checkpoint was taken",
                    j.seq
                )
            } else {
                format!(
                    "rank {rank} made its checkpoint call {seq} of this start while {others} made call {}: every rank must call checkpoint at the same points; no checkpoint was taken",
                    j.seq
                )
            };
            j.arrived.clear();
            j.files.clear();
            j.resent = false;
            self.actions.push_back(SafeAction::OutOfStep {
                job: job.to_string(),
                ranks,
                why: why.clone(),
                cluster,
            });
            return Err(ArriveError::OutOfStep { why, cluster });
        }
        if j.arrived.is_empty() {
            j.first_ms = now_ms;
            j.seq = seq;
            j.resent = false;
        }
        j.resent |= resent;
        j.interval_ms = interval_ms;
        j.timeout_ms = timeout_ms;
        j.arrived.insert(rank, node);
        j.files.extend(files.iter().copied());
        if j.arrived.len() as u32 == j.size {
            let decision = if j.halt {
                Decision::Take {
                    halt: true,
                    forced: true,
                }
            } else if j.force || now_ms.saturating_sub(j.last_ms) >= j.interval_ms {
                Decision::Take {
                    halt: false,
                    forced: j.force,
                }
            } else {
                Decision::Skip
            };
            j.deciding = true;
            self.actions.push_back(SafeAction::Decided {
                job: job.to_string(),
                decision,
                files: j.files.iter().copied().collect(),
                ranks: j.arrived.iter().map(|(r, n)| (*r, *n)).collect(),
            });
        }
        Ok(())
    }

    /// The decision of `job`'s call was carried out (`committed`: a checkpoint committed).
    /// The next call starts.
    pub fn done(&mut self, now_ms: u64, job: &str, committed: bool) {
        let Some(j) = self.jobs.get_mut(job) else { return };
        if committed {
            j.last_ms = now_ms;
            j.force = false;
        }
        j.deciding = false;
        j.arrived.clear();
        j.files.clear();
        j.resent = false;
    }

    /// An operator asks for a checkpoint at `job`'s next call (`halt`: then stop the job).
    pub fn force(&mut self, job: &str, halt: bool) -> Result<(), ArriveError> {
        let Some(j) = self.jobs.get_mut(job) else {
            return Err(ArriveError::Invalid(format!(
                "job {job} has made no checkpoint call yet (or is not running)"
            )));
        };
        j.force = true;
        j.halt |= halt;
        Ok(())
    }

    /// Calls waiting longer than the timeout fail.
    pub fn tick(&mut self, now_ms: u64) {
        let late: Vec<String> = self
            .jobs
            .iter()
            .filter(|(_, j)| !j.deciding && !j.arrived.is_empty() && now_ms.saturating_sub(j.first_ms) > j.timeout_ms)
            .map(|(k, _)| k.clone())
            .collect();
        for job in late {
            let Some(j) = self.jobs.get_mut(&job) else { continue };
            let ranks: Vec<(u32, NodeId)> = j.arrived.iter().map(|(r, n)| (*r, *n)).collect();
            let missing: Vec<String> = (0..j.size)
                .filter(|r| !j.arrived.contains_key(r))
                .take(8)
                .map(|r| r.to_string())
                .collect();
            let why = format!(
                "only {} of {} ranks called checkpoint within {} ms (missing: rank {}{}); no checkpoint was taken",
                ranks.len(),
                j.size,
                j.timeout_ms,
                missing.join(", "),
                if (j.size as usize - ranks.len()) > missing.len() {
                    ", ..."
                } else {
                    ""
                }
            );
            let cluster = j.resent;
            j.arrived.clear();
            j.files.clear();
            j.resent = false;
            self.actions.push_back(SafeAction::TimedOut {
                job,
                ranks,
                why,
                cluster,
            });
        }
    }

    /// Rank `rank`'s node went: the calls in progress cannot complete.
    pub fn node_down(&mut self, n: NodeId) {
        let hit: Vec<String> = self
            .jobs
            .iter()
            .filter(|(_, j)| !j.deciding && j.arrived.values().any(|x| *x == n))
            .map(|(k, _)| k.clone())
            .collect();
        for job in hit {
            let Some(j) = self.jobs.get_mut(&job) else { continue };
            let ranks: Vec<(u32, NodeId)> = j
                .arrived
                .iter()
                .filter(|(_, x)| **x != n)
                .map(|(r, x)| (*r, *x))
                .collect();
            j.arrived.clear();
            j.files.clear();
            j.resent = false;
            self.actions.push_back(SafeAction::TimedOut {
                job,
                ranks,
                why: format!("{n} went down during the checkpoint call"),
                cluster: true,
            });
        }
    }

    /// The job is over: forget it.
    pub fn end(&mut self, job: &str) {
        self.jobs.remove(job);
    }

    /// This node no longer coordinates: the calls waiting for their job's other ranks (not
    /// those being decided) are given up here, to be made again at the new coordinator (each
    /// keeps its number). Returns them, by job.
    pub fn hand_off(&mut self) -> Vec<(String, Vec<(u32, NodeId)>)> {
        let mut out = Vec::new();
        for (job, j) in self.jobs.iter_mut() {
            if j.deciding || j.arrived.is_empty() {
                continue;
            }
            out.push((job.clone(), j.arrived.iter().map(|(r, n)| (*r, *n)).collect()));
            j.arrived.clear();
            j.files.clear();
            j.resent = false;
        }
        out
    }

    /// Whether `job` made calls since its last `end`.
    pub fn has(&self, job: &str) -> bool {
        self.jobs.contains_key(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unavailable_cluster_lets_ranks_go_on_without_their_checkpoint() {
        assert!(goes_on_after(ErrorKind::Unavailable, false));
        assert!(!goes_on_after(ErrorKind::Unavailable, true), "a halt is told");
        for k in [
            ErrorKind::Io,
            ErrorKind::NoSpace,
            ErrorKind::Internal,
            ErrorKind::Invalid,
        ] {
            assert!(!goes_on_after(k, false), "{k:?}");
        }
    }

    fn drain(s: &mut SafePoints) -> Vec<SafeAction> {
        std::iter::from_fn(|| s.poll_action()).collect()
    }

    #[test]
    fn decides_once_every_rank_called_by_interval_force_and_halt() {
        let mut s = SafePoints::new();
        let f = [FileId(1)];
        // Interval 0: every call takes one.
        let t = (0, 1000);
        s.arrive(0, "j", (1, 0, 1, false), 2, t, NodeId(1), &f).unwrap();
        assert!(drain(&mut s).is_empty());
        assert_eq!(
            s.arrive(0, "j", (1, 0, 1, false), 2, t, NodeId(1), &f),
            Err(ArriveError::Again)
        );
        assert!(matches!(
            s.arrive(0, "j", (2, 0, 1, false), 2, t, NodeId(1), &f),
            Err(ArriveError::Invalid(_))
        ));
        assert!(matches!(
            s.arrive(0, "j", (0, 0, 1, false), 3, t, NodeId(1), &f),
            Err(ArriveError::Invalid(_))
        ));
        s.arrive(5, "j", (0, 0, 1, false), 2, t, NodeId(0), &[FileId(2)])
            .unwrap();
        match &drain(&mut s)[..] {
            [SafeAction::Decided {
                decision:
                    Decision::Take {
                        halt: false,
                        forced: false,
                    },
                files,
                ranks,
                ..
            }] => {
                assert_eq!(files, &vec![FileId(1), FileId(2)]);
                assert_eq!(ranks, &vec![(0, NodeId(0)), (1, NodeId(1))]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            s.arrive(6, "j", (0, 0, 1, false), 2, t, NodeId(0), &f),
            Err(ArriveError::Again),
            "still deciding"
        );
        s.done(10, "j", true);
        // Interval 100 ms: skipped until it elapsed since the last commit, unless forced.
        let call = |s: &mut SafePoints, now: u64| {
            s.arrive(now, "j", (0, 0, 1, false), 2, (100, 1000), NodeId(0), &f)
                .unwrap();
            s.arrive(now, "j", (1, 0, 1, false), 2, (100, 1000), NodeId(1), &f)
                .unwrap();
            match &drain(s)[..] {
                [SafeAction::Decided { decision, .. }] => *decision,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(call(&mut s, 50), Decision::Skip);
        s.done(50, "j", false);
        assert_eq!(
            call(&mut s, 110),
            Decision::Take {
                halt: false,
                forced: false
            }
        );
        s.done(110, "j", true);
        s.force("j", false).unwrap();
        assert_eq!(
            call(&mut s, 120),
            Decision::Take {
                halt: false,
                forced: true
            }
        );
        s.done(120, "j", false);
        assert_eq!(
            call(&mut s, 130),
            Decision::Take {
                halt: false,
                forced: true
            },
            "a forced one stays asked until it commits"
        );
        s.done(130, "j", true);
        assert_eq!(call(&mut s, 140), Decision::Skip);
        s.done(140, "j", false);
        s.force("j", true).unwrap();
        assert_eq!(
            call(&mut s, 150),
            Decision::Take {
                halt: true,
                forced: true
            }
        );
        assert!(s.force("nope", false).is_err());
    }

    #[test]
    fn a_call_not_every_rank_makes_times_out_and_a_lost_node_fails_it() {
        let mut s = SafePoints::new();
        s.arrive(0, "j", (0, 0, 1, false), 3, (0, 1000), NodeId(0), &[])
            .unwrap();
        s.arrive(10, "j", (2, 0, 1, false), 3, (0, 1000), NodeId(2), &[])
            .unwrap();
        s.tick(1000);
        assert!(drain(&mut s).is_empty());
        s.tick(1001);
        match &drain(&mut s)[..] {
            [SafeAction::TimedOut { ranks, why, .. }] => {
                assert_eq!(ranks.len(), 2);
                assert!(why.contains("only 2 of 3") && why.contains("missing: rank 1"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        // A restarted job's calls replace the calls of the stopped start; those are refused.
        s.arrive(1500, "j", (0, 0, 1, false), 3, (0, 1000), NodeId(0), &[])
            .unwrap();
        s.arrive(1500, "j", (0, 1, 1, false), 3, (0, 1000), NodeId(0), &[])
            .unwrap();
        assert!(matches!(
            s.arrive(1500, "j", (1, 0, 1, false), 3, (0, 1000), NodeId(1), &[]),
            Err(ArriveError::Invalid(_))
        ));
        s.arrive(1500, "j", (1, 1, 1, false), 3, (0, 1000), NodeId(1), &[])
            .unwrap();
        s.arrive(1500, "j", (2, 1, 1, false), 3, (0, 1000), NodeId(2), &[])
            .unwrap();
        assert!(matches!(&drain(&mut s)[..], [SafeAction::Decided { ranks, .. }] if ranks.len() == 3));
        s.done(1500, "j", true);
        // The next call starts afresh.
        s.arrive(2000, "j", (1, 1, 1, false), 3, (0, 1000), NodeId(1), &[])
            .unwrap();
        s.node_down(NodeId(1));
        assert!(matches!(&drain(&mut s)[..], [SafeAction::TimedOut { ranks, .. }] if ranks.is_empty()));
    }

    #[test]
    fn a_call_made_again_after_its_answer_was_lost_fails_the_call_of_the_ranks_gone_on() {
        // Call 4 was decided and answered by a coordinator that then died before rank 2 got
        // its answer: ranks 0 and 1 make call 5 at the next coordinator, rank 2 makes call 4
        // again. Taken together, a checkpoint would hold ranks at different steps.
        let mut s = SafePoints::new();
        let t = (0, 1000);
        s.arrive(0, "j", (0, 0, 5, false), 3, t, NodeId(0), &[]).unwrap();
        s.arrive(1, "j", (1, 0, 5, false), 3, t, NodeId(1), &[]).unwrap();
        // Rank 2's call is made again by its node (`resent`): the cluster's failure.
        let e = s.arrive(2, "j", (2, 0, 4, true), 3, t, NodeId(2), &[]);
        match e {
            Err(ArriveError::OutOfStep { why, cluster: true }) => {
                assert!(
                    why.contains("rank 2 made its checkpoint call 4") && why.contains("2 ranks made call 5"),
                    "{why}"
                )
            }
            other => panic!("{other:?}"),
        }
        match &drain(&mut s)[..] {
            [SafeAction::OutOfStep {
                ranks,
                why,
                cluster: true,
                ..
            }] => {
                assert_eq!(ranks, &vec![(0, NodeId(0)), (1, NodeId(1))]);
                assert!(why.contains("out of step"), "{why}");
            }
            other => panic!("{other:?}"),
        }
        // In the other order too: the repeated call came first.
        s.arrive(3, "j", (2, 0, 4, true), 3, t, NodeId(2), &[]).unwrap();
        assert!(matches!(
            s.arrive(4, "j", (0, 0, 5, false), 3, t, NodeId(0), &[]),
            Err(ArriveError::OutOfStep { cluster: true, .. })
        ));
        assert!(
            matches!(&drain(&mut s)[..], [SafeAction::OutOfStep { ranks, cluster: true, .. }] if ranks == &vec![(2, NodeId(2))])
        );
        // No call made again: the program calls at different points (its own failure).
        s.arrive(5, "j", (0, 0, 6, false), 3, t, NodeId(0), &[]).unwrap();
        match s.arrive(5, "j", (1, 0, 7, false), 3, t, NodeId(1), &[]) {
            Err(ArriveError::OutOfStep { why, cluster: false }) => {
                assert!(
                    why.contains("every rank must call checkpoint at the same points"),
                    "{why}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            &drain(&mut s)[..],
            [SafeAction::OutOfStep { cluster: false, .. }]
        ));
        // A call made again that waits in vain for ranks still computing times out as the
        // cluster's failure.
        s.arrive(6, "j", (2, 0, 8, true), 3, t, NodeId(2), &[]).unwrap();
        s.tick(2000);
        assert!(matches!(
            &drain(&mut s)[..],
            [SafeAction::TimedOut { cluster: true, .. }]
        ));
        // Nothing is left waiting: the restarted job's calls (a new start) are decided.
        for r in 0..3 {
            s.arrive(10, "j", (r, 1, 1, false), 3, t, NodeId(r), &[]).unwrap();
        }
        assert!(matches!(&drain(&mut s)[..], [SafeAction::Decided { ranks, .. }] if ranks.len() == 3));
        assert!(s.has("j"));
        s.end("j");
        assert!(!s.has("j"));
    }

    #[test]
    fn calls_waiting_at_a_coordinator_that_no_longer_is_one_are_handed_off_and_made_again() {
        let mut s = SafePoints::new();
        let t = (0, 1000);
        s.arrive(0, "a", (0, 0, 3, false), 2, t, NodeId(0), &[]).unwrap();
        s.arrive(0, "b", (0, 0, 1, false), 1, t, NodeId(1), &[]).unwrap();
        assert!(matches!(&drain(&mut s)[..], [SafeAction::Decided { job, .. }] if job == "b"));
        // "b" is being decided: its round ends as it would; "a"'s waiting call is handed off.
        assert_eq!(s.hand_off(), vec![("a".to_string(), vec![(0, NodeId(0))])]);
        assert!(s.hand_off().is_empty());
        // Made again here (this node coordinates again), with the other rank: decided.
        s.arrive(5, "a", (0, 0, 3, false), 2, t, NodeId(0), &[]).unwrap();
        s.arrive(5, "a", (1, 0, 3, false), 2, t, NodeId(1), &[]).unwrap();
        assert!(matches!(&drain(&mut s)[..], [SafeAction::Decided { ranks, .. }] if ranks.len() == 2));
        s.tick(10_000);
        assert!(drain(&mut s).is_empty(), "nothing handed off times out");
    }
}
