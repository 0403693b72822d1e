//! One node's side of a checkpoint round, memory or persistent.
//!
//! On `Prepare` the shell takes the job's dirty pages it holds (they stop counting as dirty,
//! and the taken set is kept per epoch), says so with `taken` (the coordinator lets the ranks
//! go on once every participant took), and keeps them at the round's level
//! ([`PartAction::Write`]): as pre-recovery copies in the memories of each page's two holders,
//! or written to both disk copies at the checkpoint's generation, durably; then it reports
//! with `written`. In a persistent round the coordinator then asks every participant to
//! write its recovery copies newer than the disks ([`PartAction::Flush`], reported with
//! `flushed`). On the decision the taken pages are clean ([`PartAction::Clean`]) or dirty
//! again ([`PartAction::Restore`]).
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
//!   them): it is refused, naming the highest epoch seen, so that a new coordinator that
//!   does not know the memory epochs of its predecessor starts the next round above them;
//! - only a persistent epoch is reported in doubt to a new coordinator (its commit record
//!   decides); a memory epoch in doubt is settled by the job's rollback.

use crate::msg::{Level, Msg, Refusal};
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
        level: Level,
        gen: u64,
        seq: u64,
        files: Vec<FileId>,
        /// The job's last committed epoch, as the `Prepare` said (a holder that missed the
        /// decision of an earlier memory epoch settles it by this).
        committed: u64,
    },
    /// Write the job's recovery copies held here that are newer than the disks and that this
    /// persistent round did not overwrite, to this node's disk at `gen` (metadata at `seq`),
    /// durably, and call [`Participant::flushed`].
    Flush {
        job: String,
        epoch: u64,
        gen: u64,
        seq: u64,
    },
    Send {
        to: NodeId,
        msg: Msg,
    },
    /// Every participant of `epoch` took its pages: the shell's write may keep its own now (a
    /// hint: it goes on after a while without it).
    Go {
        job: String,
        epoch: u64,
    },
    /// Epoch `epoch` committed: its taken pages are clean (and, at the memory level, the
    /// pre-recovery copies are the checkpoint's recovery copies).
    Clean {
        job: String,
        epoch: u64,
        level: Level,
    },
    /// Epoch `epoch` did not commit: its taken pages are dirty again (and its pre-recovery
    /// copies go).
    Restore {
        job: String,
        epoch: u64,
        level: Level,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// The shell writes the epoch's pages; a newer `Prepare` may wait behind it.
    Writing {
        epoch: u64,
        level: Level,
        coord_inc: u64,
        next: Option<Box<Msg>>,
    },
    /// Kept at its level here; waiting for the decision (a persistent round flushes first).
    Prepared {
        epoch: u64,
        level: Level,
        coord_inc: u64,
        flushing: bool,
    },
}

/// See the module documentation.
#[derive(Debug)]
pub struct Participant {
    /// This node's incarnation: its `Taken` and `Prepared` carry it.
    inc: u64,
    coordinator: Option<NodeId>,
    jobs: BTreeMap<String, State>,
    /// The highest epoch prepared here, per job (kept across a rollback, dropped at its end).
    seen: BTreeMap<String, u64>,
    /// Per job, an epoch whose write ended while no coordinator was known, and its round's
    /// coordinator incarnation: refused to the next coordinator (a round still waiting for it
    /// would otherwise wait out its whole timeout: the nemesis met a job stalled 600 s).
    untold: BTreeMap<String, (u64, u64, String)>,
    actions: VecDeque<PartAction>,
}

impl Default for Participant {
    fn default() -> Self {
        Participant::new(0)
    }
}

impl Participant {
    /// The participant of a node of incarnation `inc`.
    pub fn new(inc: u64) -> Participant {
        Participant {
            inc,
            coordinator: None,
            jobs: BTreeMap::new(),
            seen: BTreeMap::new(),
            untold: BTreeMap::new(),
            actions: VecDeque::new(),
        }
    }

    pub fn poll_action(&mut self) -> Option<PartAction> {
        self.actions.pop_front()
    }

    /// The level of `job`'s round written or prepared here, if any.
    fn level_of(&self, job: &str) -> Option<Level> {
        self.jobs.get(job).map(|s| match s {
            State::Writing { level, .. } | State::Prepared { level, .. } => *level,
        })
    }

    /// The coordinator incarnation of `job`'s round written or prepared here, if any.
    fn inc_of(&self, job: &str) -> Option<u64> {
        self.jobs.get(job).map(|s| match s {
            State::Writing { coord_inc, .. } | State::Prepared { coord_inc, .. } => *coord_inc,
        })
    }

    /// The highest epoch of `job` prepared here (0: none).
    pub fn seen(&self, job: &str) -> u64 {
        self.seen.get(job).copied().unwrap_or(0)
    }

    /// The epoch of `job` written or prepared here, if any.
    pub fn in_progress(&self, job: &str) -> Option<u64> {
        self.jobs.get(job).map(|s| match s {
            State::Writing { epoch, .. } | State::Prepared { epoch, .. } => *epoch,
        })
    }

    /// The coordinator is now `c`: the epochs prepared here and not decided are reported to it.
    pub fn coordinator_changed(&mut self, c: Option<NodeId>) {
        if self.coordinator == c {
            return;
        }
        self.coordinator = c;
        let Some(to) = c else { return };
        for (job, (epoch, coord_inc, why)) in std::mem::take(&mut self.untold) {
            self.refuse(to, &job, (epoch, coord_inc), why, 0);
        }
        for (job, s) in &self.jobs {
            if let State::Prepared {
                epoch,
                level: Level::Persistent,
                ..
            } = s
            {
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
            Msg::Prepare { .. } => self.prepare(from, msg),
            Msg::Decide {
                job,
                epoch,
                commit,
                coord_inc,
            } => {
                let Some(&State::Prepared {
                    epoch: e,
                    level,
                    coord_inc: mine,
                    ..
                }) = self.jobs.get(&job)
                else {
                    return;
                };
                // Another round of this epoch (a memory one a restarted coordinator started
                // again) is not decided by this decision; a persistent epoch is decided by its
                // record, whoever tells.
                if e != epoch || (coord_inc != mine && level == Level::Memory) {
                    return;
                }
                self.jobs.remove(&job);
                self.actions.push_back(if commit {
                    PartAction::Clean { job, epoch, level }
                } else {
                    PartAction::Restore { job, epoch, level }
                });
            }
            Msg::Go { job, epoch, coord_inc } => {
                if let Some(State::Writing {
                    epoch: e,
                    coord_inc: mine,
                    next: None,
                    ..
                }) = self.jobs.get(&job)
                {
                    if *e == epoch && *mine == coord_inc {
                        self.actions.push_back(PartAction::Go { job, epoch });
                    }
                }
            }
            Msg::Flush {
                job,
                epoch,
                gen,
                seq,
                coord_inc,
            } => {
                let Some(State::Prepared {
                    epoch: e,
                    level: Level::Persistent,
                    flushing,
                    coord_inc: mine,
                }) = self.jobs.get_mut(&job)
                else {
                    return;
                };
                if *e != epoch || *flushing || *mine != coord_inc {
                    return;
                }
                *flushing = true;
                self.actions.push_back(PartAction::Flush { job, epoch, gen, seq });
            }
            _ => {}
        }
    }

    fn prepare(&mut self, from: NodeId, msg: Msg) {
        let (job, epoch) = (msg.job(), msg.epoch());
        let (level, coord_inc) = match &msg {
            Msg::Prepare { level, coord_inc, .. } => (*level, *coord_inc),
            _ => return,
        };
        if let Some(&s) = self.seen.get(job) {
            // The same epoch again is a duplicate only from the same round (a coordinator that
            // restarted may reuse the epoch of a memory round nobody else saw begin).
            let same_round = self.in_progress(job) == Some(epoch)
                && self.level_of(job) == Some(level)
                && self.inc_of(job) == Some(coord_inc);
            if epoch < s || (epoch == s && !same_round) {
                self.refuse(
                    from,
                    job,
                    (epoch, coord_inc),
                    format!("epoch {epoch} is not above epoch {s}, seen here"),
                    s,
                );
                return;
            }
            if epoch == s {
                // A duplicate of the round in progress: still being written, it is answered
                // when written; prepared already, its answer was lost on the way (the
                // coordinator asks again only after `coordinator::REASK_MS`) and the runs it
                // carried are not kept, so the round is refused (it aborts, and the decision
                // restores the pages).
                if matches!(self.jobs.get(job), Some(State::Prepared { epoch: e, .. }) if *e == epoch) {
                    let why = format!("asked again for epoch {epoch} after its answer: the answer was lost");
                    self.refuse(from, job, (epoch, coord_inc), why, s);
                }
                return;
            }
        }
        if !self.seen.contains_key(job) && self.seen.len() >= crate::MAX_ROUNDS {
            return; // too many jobs at once: this one's round times out at the coordinator
        }
        self.seen.insert(job.to_string(), epoch);
        self.begin(msg);
    }

    /// Refuses `to` the round of `epoch` of coordinator incarnation `coord_inc` (`round`),
    /// saying the highest epoch `seen` here (0: none to say).
    fn refuse(&mut self, to: NodeId, job: &str, round: (u64, u64), why: String, seen: u64) {
        let (epoch, coord_inc) = round;
        self.actions.push_back(PartAction::Send {
            to,
            msg: Msg::Refused {
                job: job.to_string(),
                epoch,
                coord_inc,
                why,
                seen,
                no_room: false,
            },
        });
    }

    /// Starts the write of a `Prepare` that passed the checks (now, or once the write before
    /// it is over).
    fn begin(&mut self, msg: Msg) {
        if let Some(State::Writing { epoch: e, next, .. }) = self.jobs.get_mut(msg.job()) {
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
            level,
            gen,
            seq,
            files,
            committed,
            coord_inc,
            ..
        } = msg
        else {
            return;
        };
        if let Some(&State::Prepared { epoch: e, level: l, .. }) = self.jobs.get(&job) {
            if epoch <= e {
                return;
            }
            // A new round means the coordinator settled ours: committed if it is the job's
            // last committed epoch; otherwise (aborted, or unknown) dirty again.
            self.jobs.remove(&job);
            let job = job.clone();
            self.actions.push_back(if committed == e {
                PartAction::Clean {
                    job,
                    epoch: e,
                    level: l,
                }
            } else {
                PartAction::Restore {
                    job,
                    epoch: e,
                    level: l,
                }
            });
        }
        self.jobs.insert(
            job.clone(),
            State::Writing {
                epoch,
                level,
                coord_inc,
                next: None,
            },
        );
        self.actions.push_back(PartAction::Write {
            job,
            epoch,
            level,
            gen,
            seq,
            files,
            committed,
        });
    }

    /// The shell took `pages` pages of `epoch` (the dirty pages and the ranks' states, now
    /// copies of their own): the coordinator hears it, so the ranks may go on before the
    /// pages are kept. Said once per write, and only while this write is still the round's.
    pub fn taken(&mut self, job: &str, epoch: u64, pages: u64) {
        let coord_inc = match self.jobs.get(job) {
            Some(State::Writing {
                epoch: e,
                next: None,
                coord_inc,
                ..
            }) if *e == epoch => *coord_inc,
            _ => return,
        };
        let Some(to) = self.coordinator else { return };
        self.actions.push_back(PartAction::Send {
            to,
            msg: Msg::Taken {
                job: job.to_string(),
                epoch,
                coord_inc,
                part_inc: self.inc,
                pages,
            },
        });
    }

    /// The shell's write of `epoch` is over: durable (`Ok`: the runs written and their bytes)
    /// or failed.
    pub fn written(&mut self, job: &str, epoch: u64, result: Result<(Vec<FileRuns>, u64), Refusal>) {
        let (next, level, coord_inc) = match self.jobs.get_mut(job) {
            Some(State::Writing {
                epoch: e,
                level,
                next,
                coord_inc,
            }) if *e == epoch => (next.take(), *level, *coord_inc),
            _ => return,
        };
        if let Some(next) = next {
            // Superseded while writing: this epoch will not be decided; start the next.
            self.jobs.remove(job);
            self.actions.push_back(PartAction::Restore {
                job: job.to_string(),
                epoch,
                level,
            });
            self.begin(*next);
            return;
        }
        let Some(to) = self.coordinator else {
            // No coordinator to tell: the epoch cannot commit without this answer. The next
            // coordinator hears it refused (the same one, back, may still wait for it).
            let why = match &result {
                Ok(_) => "its pages were written while it knew no coordinator".to_string(),
                Err(r) => r.why.clone(),
            };
            if self.untold.contains_key(job) || self.untold.len() < crate::MAX_ROUNDS {
                self.untold.insert(job.to_string(), (epoch, coord_inc, why));
            }
            self.jobs.remove(job);
            self.actions.push_back(PartAction::Restore {
                job: job.to_string(),
                epoch,
                level,
            });
            return;
        };
        match result {
            Ok((written, bytes)) => {
                self.jobs.insert(
                    job.to_string(),
                    State::Prepared {
                        epoch,
                        level,
                        coord_inc,
                        flushing: false,
                    },
                );
                self.actions.push_back(PartAction::Send {
                    to,
                    msg: Msg::Prepared {
                        job: job.to_string(),
                        epoch,
                        level,
                        coord_inc,
                        part_inc: self.inc,
                        written,
                        bytes,
                    },
                });
            }
            Err(Refusal { why, no_room }) => {
                self.jobs.remove(job);
                self.actions.push_back(PartAction::Restore {
                    job: job.to_string(),
                    epoch,
                    level,
                });
                self.actions.push_back(PartAction::Send {
                    to,
                    msg: Msg::Refused {
                        job: job.to_string(),
                        epoch,
                        coord_inc,
                        why,
                        seen: 0,
                        no_room,
                    },
                });
            }
        }
    }

    /// The shell's flush of `epoch` is over: durable (`Ok`: the runs written and their bytes)
    /// or failed (the round aborts; the decision restores the pages).
    pub fn flushed(&mut self, job: &str, epoch: u64, result: Result<(Vec<FileRuns>, u64), String>) {
        let coord_inc = match self.jobs.get(job) {
            Some(State::Prepared {
                epoch: e,
                flushing: true,
                coord_inc,
                ..
            }) if *e == epoch => *coord_inc,
            _ => return,
        };
        let Some(to) = self.coordinator else { return };
        let msg = match result {
            Ok((written, bytes)) => Msg::Flushed {
                job: job.to_string(),
                epoch,
                coord_inc,
                written,
                bytes,
            },
            Err(why) => Msg::Refused {
                job: job.to_string(),
                epoch,
                coord_inc,
                why,
                seen: 0,
                no_room: false,
            },
        };
        self.actions.push_back(PartAction::Send { to, msg });
    }

    /// The job rolled back here: whatever was taken is dropped with its pages by the shell;
    /// nothing more is reported (a later `Prepare` still has to be above every epoch seen).
    pub fn forget(&mut self, job: &str) {
        self.jobs.remove(job);
        self.untold.remove(job);
    }

    /// The job ended: nothing of it is kept.
    pub fn end(&mut self, job: &str) {
        self.jobs.remove(job);
        self.seen.remove(job);
        self.untold.remove(job);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepare(epoch: u64, committed: u64) -> Msg {
        Msg::Prepare {
            job: "j".into(),
            coord_inc: 0,
            epoch,
            level: Level::Persistent,
            gen: epoch + 10,
            seq: 1,
            files: vec![FileId(1)],
            committed,
            cleaning: crate::cleaning::Policy::P1,
        }
    }

    fn drain(p: &mut Participant) -> Vec<PartAction> {
        std::iter::from_fn(|| p.poll_action()).collect()
    }

    #[test]
    fn writes_one_epoch_at_a_time_and_settles_on_the_decision() {
        let mut p = Participant::new(1);
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
                coord_inc: 0,
                epoch: 1,
                commit: true,
            },
        );
        assert!(drain(&mut p).is_empty(), "a decision of another epoch is stale");
        p.receive(
            NodeId(0),
            Msg::Decide {
                job: "j".into(),
                coord_inc: 0,
                epoch: 2,
                commit: true,
            },
        );
        assert!(matches!(drain(&mut p)[..], [PartAction::Clean { epoch: 2, .. }]));
        assert_eq!(p.in_progress("j"), None);
    }

    #[test]
    fn doubts_go_to_a_new_coordinator_and_a_later_round_settles_them() {
        let mut p = Participant::new(1);
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
                    msg: Msg::Refused { no_room: false, .. },
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

    /// A write that ends while no coordinator is known (the coordinator lost its lease a
    /// moment) is refused to the next coordinator: the same one, back, would otherwise wait
    /// for it until the round's timeout (the nemesis met a job stalled 600 s).
    #[test]
    fn a_write_ended_without_a_coordinator_is_refused_to_the_next_one() {
        let mut p = Participant::new(1);
        p.coordinator_changed(Some(NodeId(0)));
        p.receive(NodeId(0), prepare(3, 2));
        drain(&mut p);
        p.coordinator_changed(None);
        p.written("j", 3, Err("cannot reach n2".into()));
        assert!(matches!(drain(&mut p)[..], [PartAction::Restore { epoch: 3, .. }]));
        assert_eq!(p.in_progress("j"), None);
        p.coordinator_changed(Some(NodeId(0)));
        let a = drain(&mut p);
        assert!(
            matches!(
                &a[..],
                [PartAction::Send {
                    to: NodeId(0),
                    msg: Msg::Refused { epoch: 3, why, .. }
                }] if why.contains("cannot reach n2")
            ),
            "{a:?}"
        );
        // Told once.
        p.coordinator_changed(Some(NodeId(1)));
        assert!(drain(&mut p).is_empty());
        // A success without a coordinator is refused too (it cannot be prepared without one).
        p.receive(NodeId(1), prepare(4, 2));
        drain(&mut p);
        p.coordinator_changed(None);
        p.written("j", 4, Ok((vec![], 0)));
        drain(&mut p);
        // A job that rolled back forgets it.
        p.forget("j");
        p.coordinator_changed(Some(NodeId(1)));
        assert!(drain(&mut p).is_empty());
    }

    /// The coordinator asks again a participant it did not hear from: one still writing
    /// ignores it, one prepared already refuses (its answer was lost), one that dropped the
    /// round refuses it too.
    #[test]
    fn a_prepare_asked_again_is_ignored_while_writing_and_refused_once_prepared() {
        let mut p = Participant::new(1);
        p.coordinator_changed(Some(NodeId(0)));
        p.receive(NodeId(0), prepare(3, 2));
        drain(&mut p);
        p.receive(NodeId(0), prepare(3, 2));
        assert!(drain(&mut p).is_empty(), "still writing: answered when written");
        p.written("j", 3, Ok((vec![], 0)));
        assert!(matches!(
            drain(&mut p)[..],
            [PartAction::Send {
                msg: Msg::Prepared { epoch: 3, .. },
                ..
            }]
        ));
        p.receive(NodeId(0), prepare(3, 2));
        assert!(matches!(
            drain(&mut p)[..],
            [PartAction::Send {
                msg: Msg::Refused { epoch: 3, seen: 3, .. },
                ..
            }]
        ));
        // Dropped (the job rolled back here): refused as not above the epoch seen.
        p.forget("j");
        p.receive(NodeId(0), prepare(3, 2));
        assert!(matches!(
            drain(&mut p)[..],
            [PartAction::Send {
                msg: Msg::Refused { epoch: 3, .. },
                ..
            }]
        ));
    }
}
