//! One node's side of a persistent checkpoint.
//!
//! On `Prepare` the shell takes the job's dirty pages it holds (they stop counting as dirty,
//! and the taken set is kept per epoch), writes them to both copies at the checkpoint's
//! generation and makes them durable ([`PartAction::Write`]), then reports with `written`.
//! On the decision the taken pages are clean ([`PartAction::Clean`]) or dirty again
//! ([`PartAction::Restore`]).
//!
//! Invariants:
//! - at most one write per job at a time: a `Prepare` that arrives while an earlier epoch is
//!   still being written waits until that write is over (two writes into the same shadow
//!   slots could leave one epoch's bytes under the other's header);
//! - pages are marked clean only on the coordinator's `commit: true` for their own epoch, or
//!   when a later `Prepare` says their epoch is the job's last committed one; every other way
//!   out (a refusal, an abort, a doubt settled by a later round) marks them dirty again;
//! - messages from a node other than the coordinator, or of an epoch not in progress here,
//!   are dropped; so is a `Prepare` not above every epoch of the job seen here (a late one
//!   would take pages that belong to the round in progress, which would then commit without
//!   them).

use crate::msg::Msg;
use psls_pfs::jobs::FileRuns;
use psls_svm::{FileId, NodeId};
use std::collections::{BTreeMap, VecDeque};

/// What the shell must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartAction {
    /// Take the dirty pages of `files` held here (remember them as epoch `epoch`'s), write
    /// them to both copies at generation `gen` once metadata reached `seq`, make them durable,
    /// and call [`Participant::written`].
    Write {
        job: String,
        epoch: u64,
        gen: u64,
        seq: u64,
        files: Vec<FileId>,
    },
    Send {
        to: NodeId,
        msg: Msg,
    },
    /// Epoch `epoch` committed: its taken pages are clean.
    Clean {
        job: String,
        epoch: u64,
    },
    /// Epoch `epoch` did not commit: its taken pages are dirty again.
    Restore {
        job: String,
        epoch: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// The shell writes the epoch's pages; a newer `Prepare` may wait behind it.
    Writing { epoch: u64, next: Option<Box<Msg>> },
    /// Durable here; waiting for the decision.
    Prepared { epoch: u64 },
}

/// See the module documentation.
#[derive(Debug)]
pub struct Participant {
    coordinator: Option<NodeId>,
    jobs: BTreeMap<String, State>,
    /// The highest epoch prepared here, per job (kept across a rollback, dropped at its end).
    seen: BTreeMap<String, u64>,
    actions: VecDeque<PartAction>,
}

impl Default for Participant {
    fn default() -> Self {
        Participant::new()
    }
}

impl Participant {
    pub fn new() -> Participant {
        Participant {
            coordinator: None,
            jobs: BTreeMap::new(),
            seen: BTreeMap::new(),
            actions: VecDeque::new(),
        }
    }

    pub fn poll_action(&mut self) -> Option<PartAction> {
        self.actions.pop_front()
    }

    /// The epoch of `job` written or prepared here, if any.
    pub fn in_progress(&self, job: &str) -> Option<u64> {
        self.jobs.get(job).map(|s| match s {
            State::Writing { epoch, .. } | State::Prepared { epoch } => *epoch,
        })
    }

    /// The coordinator is now `c`: the epochs prepared here and not decided are reported to it.
    pub fn coordinator_changed(&mut self, c: Option<NodeId>) {
        if self.coordinator == c {
            return;
        }
        self.coordinator = c;
        let Some(to) = c else { return };
        for (job, s) in &self.jobs {
            if let State::Prepared { epoch } = s {
                self.actions.push_back(PartAction::Send {
                    to,
                    msg: Msg::InDoubt {
                        job: job.clone(),
                        epoch: *epoch,
                    },
                });
            }
        }
    }

    /// A message from `from`.
    pub fn receive(&mut self, from: NodeId, msg: Msg) {
        if Some(from) != self.coordinator {
            return;
        }
        match msg {
            Msg::Prepare { .. } => self.prepare(msg),
            Msg::Decide { job, epoch, commit } if self.jobs.get(&job) == Some(&State::Prepared { epoch }) => {
                self.jobs.remove(&job);
                self.actions.push_back(if commit {
                    PartAction::Clean { job, epoch }
                } else {
                    PartAction::Restore { job, epoch }
                });
            }
            _ => {}
        }
    }

    fn prepare(&mut self, msg: Msg) {
        let (job, epoch) = (msg.job(), msg.epoch());
        if self.seen.get(job).is_some_and(|&s| epoch <= s) {
            return;
        }
        if !self.seen.contains_key(job) && self.seen.len() >= crate::MAX_ROUNDS {
            return; // too many jobs at once: this one's round times out at the coordinator
        }
        self.seen.insert(job.to_string(), epoch);
        self.begin(msg);
    }

    /// Starts the write of a `Prepare` that passed the checks (now, or once the write before
    /// it is over).
    fn begin(&mut self, msg: Msg) {
        if let Some(State::Writing { epoch: e, next }) = self.jobs.get_mut(msg.job()) {
            if msg.epoch() > *e {
                // The coordinator moved on; this write's round is dead. Start the new one when
                // it is over.
                *next = Some(Box::new(msg));
            }
            return;
        }
        let Msg::Prepare {
            job,
            epoch,
            gen,
            seq,
            files,
            committed,
        } = msg
        else {
            return;
        };
        if let Some(&State::Prepared { epoch: e }) = self.jobs.get(&job) {
            if epoch <= e {
                return;
            }
            // A new round means the coordinator settled ours: committed if it is the job's
            // last committed epoch; otherwise (aborted, or unknown) dirty again.
            self.jobs.remove(&job);
            let job = job.clone();
            self.actions.push_back(if committed == e {
                PartAction::Clean { job, epoch: e }
            } else {
                PartAction::Restore { job, epoch: e }
            });
        }
        self.jobs.insert(job.clone(), State::Writing { epoch, next: None });
        self.actions.push_back(PartAction::Write {
            job,
            epoch,
            gen,
            seq,
            files,
        });
    }

    /// The shell's write of `epoch` is over: durable (`Ok`: the runs written and their bytes)
    /// or failed.
    pub fn written(&mut self, job: &str, epoch: u64, result: Result<(Vec<FileRuns>, u64), String>) {
        let next = match self.jobs.get_mut(job) {
            Some(State::Writing { epoch: e, next }) if *e == epoch => next.take(),
            _ => return,
        };
        if let Some(next) = next {
            // Superseded while writing: this epoch will not be decided; start the next.
            self.jobs.remove(job);
            self.actions.push_back(PartAction::Restore {
                job: job.to_string(),
                epoch,
            });
            self.begin(*next);
            return;
        }
        let Some(to) = self.coordinator else {
            // No coordinator to tell: the epoch cannot commit without this answer.
            self.jobs.remove(job);
            self.actions.push_back(PartAction::Restore {
                job: job.to_string(),
                epoch,
            });
            return;
        };
        match result {
            Ok((written, bytes)) => {
                self.jobs.insert(job.to_string(), State::Prepared { epoch });
                self.actions.push_back(PartAction::Send {
                    to,
                    msg: Msg::Prepared {
                        job: job.to_string(),
                        epoch,
                        written,
                        bytes,
                    },
                });
            }
            Err(why) => {
                self.jobs.remove(job);
                self.actions.push_back(PartAction::Restore {
                    job: job.to_string(),
                    epoch,
                });
                self.actions.push_back(PartAction::Send {
                    to,
                    msg: Msg::Refused {
                        job: job.to_string(),
                        epoch,
                        why,
                    },
                });
            }
        }
    }

    /// The job rolled back here: whatever was taken is dropped with its pages by the shell;
    /// nothing more is reported (a later `Prepare` still has to be above every epoch seen).
    pub fn forget(&mut self, job: &str) {
        self.jobs.remove(job);
    }

    /// The job ended: nothing of it is kept.
    pub fn end(&mut self, job: &str) {
        self.jobs.remove(job);
        self.seen.remove(job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepare(epoch: u64, committed: u64) -> Msg {
        Msg::Prepare {
            job: "j".into(),
            epoch,
            gen: epoch + 10,
            seq: 1,
            files: vec![FileId(1)],
            committed,
        }
    }

    fn drain(p: &mut Participant) -> Vec<PartAction> {
        std::iter::from_fn(|| p.poll_action()).collect()
    }

    #[test]
    fn writes_one_epoch_at_a_time_and_settles_on_the_decision() {
        let mut p = Participant::new();
        p.receive(NodeId(0), prepare(1, 0));
        assert!(drain(&mut p).is_empty(), "no coordinator known yet: dropped");
        p.coordinator_changed(Some(NodeId(0)));
        p.receive(NodeId(1), prepare(1, 0));
        assert!(drain(&mut p).is_empty(), "not from the coordinator: dropped");
        p.receive(NodeId(0), prepare(1, 0));
        assert!(matches!(
            drain(&mut p)[..],
            [PartAction::Write { epoch: 1, gen: 11, .. }]
        ));
        p.receive(NodeId(0), prepare(2, 0));
        assert!(drain(&mut p).is_empty(), "waits for the write of epoch 1");
        p.written("j", 1, Ok((vec![], 0)));
        let a = drain(&mut p);
        assert!(
            matches!(
                &a[..],
                [PartAction::Restore { epoch: 1, .. }, PartAction::Write { epoch: 2, .. }]
            ),
            "{a:?}"
        );
        p.written("j", 2, Ok((vec![], 0)));
        assert!(matches!(
            drain(&mut p)[..],
            [PartAction::Send {
                msg: Msg::Prepared { epoch: 2, .. },
                ..
            }]
        ));
        p.receive(
            NodeId(0),
            Msg::Decide {
                job: "j".into(),
                epoch: 1,
                commit: true,
            },
        );
        assert!(drain(&mut p).is_empty(), "a decision of another epoch is stale");
        p.receive(
            NodeId(0),
            Msg::Decide {
                job: "j".into(),
                epoch: 2,
                commit: true,
            },
        );
        assert!(matches!(drain(&mut p)[..], [PartAction::Clean { epoch: 2, .. }]));
        assert_eq!(p.in_progress("j"), None);
    }

    #[test]
    fn doubts_go_to_a_new_coordinator_and_a_later_round_settles_them() {
        let mut p = Participant::new();
        p.coordinator_changed(Some(NodeId(0)));
        p.receive(NodeId(0), prepare(3, 2));
        drain(&mut p);
        p.written("j", 3, Ok((vec![], 0)));
        drain(&mut p);
        p.coordinator_changed(Some(NodeId(1)));
        assert!(matches!(
            drain(&mut p)[..],
            [PartAction::Send {
                to: NodeId(1),
                msg: Msg::InDoubt { epoch: 3, .. }
            }]
        ));
        // The new coordinator's next round says epoch 3 committed.
        p.receive(NodeId(1), prepare(4, 3));
        assert!(matches!(
            drain(&mut p)[..],
            [PartAction::Clean { epoch: 3, .. }, PartAction::Write { epoch: 4, .. }]
        ));
        // A failed write is restored and refused.
        p.written("j", 4, Err("disk".into()));
        assert!(matches!(
            drain(&mut p)[..],
            [
                PartAction::Restore { epoch: 4, .. },
                PartAction::Send {
                    msg: Msg::Refused { .. },
                    ..
                }
            ]
        ));
        // Unknown outcome settles toward dirty.
        p.receive(NodeId(1), prepare(5, 3));
        drain(&mut p);
        p.written("j", 5, Ok((vec![], 0)));
        drain(&mut p);
        p.receive(NodeId(1), prepare(7, 3));
        assert!(matches!(
            drain(&mut p)[..],
            [PartAction::Restore { epoch: 5, .. }, PartAction::Write { epoch: 7, .. }]
        ));
    }
}
