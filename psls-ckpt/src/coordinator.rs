//! The coordinator's side of a checkpoint round (two-phase, DESIGN §7), memory or persistent.
//!
//! A memory round (one per job at a time): `start` sends `Prepare` (level memory) to every
//! participant → each answers `Prepared` once its pages have pre-recovery copies on their two
//! holders → with every answer in, `Decide{commit: true}` to everyone and
//! [`CoordAction::Finished`]. No metadata and no disk: the decision lives in the
//! participants' memories. A coordinator that dies before every participant heard it leaves
//! the epoch in doubt on some; the job rolls back then (the coordinator was a node of it),
//! and the rollback settles the epoch by the highest one any survivor committed.
//!
//! A persistent round: `start` asks the shell to begin the epoch in the metadata
//! ([`CoordAction::Begin`]: it gets its generation there, never given to another checkpoint)
//! → `begun` sends `Prepare` to every participant (every live logical node: any of them may
//! hold dirty pages of the job's files and every page has copies on two of them) → each answers `Prepared` (its pages are durable on both copies) or
//! `Refused` → with every answer in, `Flush` to every participant (each writes the job's
//! recovery copies it holds that are newer than the disks and that this round did not
//! overwrite) → each answers `Flushed` → [`CoordAction::Commit`]: the shell writes the commit
//! record (one metadata operation for every file of the job) and reports with `committed` →
//! `Decide` to every participant, and [`CoordAction::Finished`].
//!
//! Aborts: a refusal, a participant going down, or no answer within the timeout before the
//! commit record is asked for: `Decide{commit: false}` and `Finished(Aborted)`; nothing was
//! submitted, so nothing can commit. Once the record is asked for, only its outcome decides:
//! if writing it fails (the coordinator's metadata quorum broke, say), the epoch is fenced
//! ([`CoordAction::Fence`]) and the record — committed or fenced — is what the participants
//! are told.
//!
//! After a coordinator change, the new coordinator knows no round; participants report the
//! epochs they prepared and never saw decided (`InDoubt`, or a `Prepared` for no round here):
//! it fences each once and tells them the outcome (the commit record decides).
//!
//! Early release: each participant says `Taken` as soon as it took its pages (copies of their
//! own, write-protected in the clients); with every participant's in, the shell is told
//! [`CoordAction::Released`] and lets the job's ranks go on while the pages are kept and the
//! round decides (a failure before the decision restores the checkpoint before, exactly as
//! if the ranks had waited; an abort without a failure makes the pages dirty again, so the
//! next checkpoint takes them).
//!
//! Invariants: `Released` only after every participant of the round said `Taken` (or
//! `Prepared`) for that epoch, at most once per round and before its `Finished`; `Commit` only
//! after every participant of the round answered `Prepared` for that epoch; a participant is told `commit: true` only after the record committed; each round
//! finishes exactly once; the tables are bounded ([`crate::MAX_ROUNDS`],
//! [`crate::MAX_IN_DOUBT`]).

use crate::msg::{Level, Msg};
use psls_pfs::jobs::FileRuns;
use psls_svm::{FileId, NodeId};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// How a round ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The checkpoint committed at `level`: `pages` pages (one copy; `bytes` bytes) were
    /// kept.
    Committed { level: Level, pages: u64, bytes: u64 },
    /// It did not; the previous checkpoint stands.
    Aborted(String),
    /// A memory round did not: a participant had no room for its recovery copies (the
    /// cleaner may take over at once); the previous checkpoint stands.
    NoRoom(String),
}

/// What the shell must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CoordAction {
    Send {
        to: NodeId,
        msg: Msg,
    },
    /// Begin `epoch` in the metadata (`MetaOp::BeginCheckpoint`), then call
    /// [`Coordinator::begun`] with its generation.
    Begin {
        job: String,
        epoch: u64,
    },
    /// Write the commit record of `epoch` (`MetaOp::Checkpoint`), then call
    /// [`Coordinator::committed`].
    Commit {
        job: String,
        epoch: u64,
        gen: u64,
        files: Vec<FileRuns>,
        bytes: u64,
    },
    /// Every participant of `epoch` took its pages (`pages` in all, the ranks' states
    /// included): the job's ranks may go on while the round keeps the pages and decides.
    /// Once per round, before its `Finished`, and only in a round still collecting.
    Released {
        job: String,
        epoch: u64,
        pages: u64,
    },
    /// Make sure `epoch` never commits (`MetaOp::FenceCheckpoint`), then call
    /// [`Coordinator::fenced`] with what the record says.
    Fence {
        job: String,
        epoch: u64,
    },
    /// The round of `epoch` is over.
    Finished {
        job: String,
        epoch: u64,
        outcome: Outcome,
    },
}

/// Why `start` refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartError {
    /// A round of this job is in progress.
    Busy,
    /// Too many rounds in progress.
    Full,
    /// No participant, or an epoch not above the job's floor.
    Invalid(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Beginning,
    Collecting,
    /// A persistent round's participants write their recovery copies to the disks.
    Flushing,
    Committing,
    /// The commit record's outcome is unknown: fencing to learn it.
    Fencing,
}

/// What a round in progress does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Its epoch's generation is being taken in the metadata.
    Beginning,
    /// The participants write their pages to both copies (or, in a memory round, to their
    /// holders' memories).
    WritingPages,
    /// The participants write their recovery copies newer than the disks to the disks.
    FlushingRecoveryCopies,
    /// Every participant's pages are durable: the commit record is being written.
    CommitRecord,
    /// The commit record's outcome is unknown: fencing to learn it.
    LearningOutcome,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Step::Beginning => "beginning",
            Step::WritingPages => "writing pages",
            Step::FlushingRecoveryCopies => "writing recovery copies to the disks",
            Step::CommitRecord => "writing its commit record",
            Step::LearningOutcome => "learning its commit record's outcome",
        })
    }
}

/// A round in progress, as [`Coordinator::progress`] tells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Progress {
    pub epoch: u64,
    pub level: Level,
    pub step: Step,
    pub started_ms: u64,
    /// Participants that have not reported their pages durable yet.
    pub waiting: Vec<NodeId>,
    pub participants: usize,
    /// Every participant took its pages: the ranks run on.
    pub released: bool,
}

#[derive(Debug)]
struct Round {
    epoch: u64,
    level: Level,
    cleaning: crate::cleaning::Policy,
    gen: u64,
    seq: u64,
    files: Vec<FileId>,
    participants: BTreeSet<NodeId>,
    waiting: BTreeSet<NodeId>,
    /// Participants that have not said they took their pages yet.
    untaken: BTreeSet<NodeId>,
    /// The incarnation each participant with ranks at the safe point had then (`expect`):
    /// an answer of another one aborts the round.
    expect: BTreeMap<NodeId, u64>,
    taken_pages: u64,
    released: bool,
    coord_inc: u64,
    written: BTreeMap<FileId, Vec<(u64, u64)>>,
    bytes: u64,
    started_ms: u64,
    /// The job's last committed epoch its `Prepare` carried, and when it was last sent to
    /// the participants that have not answered ([`REASK_MS`]).
    committed: u64,
    asked_ms: u64,
    phase: Phase,
}

impl Round {
    /// The round's `Prepare` for `job`, from coordinator incarnation `inc`.
    fn prepare_msg(&self, job: &str, inc: u64) -> Msg {
        Msg::Prepare {
            job: job.to_string(),
            epoch: self.epoch,
            level: self.level,
            gen: self.gen,
            seq: self.seq,
            files: self.files.clone(),
            committed: self.committed,
            cleaning: self.cleaning,
            coord_inc: inc,
        }
    }
}

/// How long a round waits for a participant's answer before it sends that participant its
/// `Prepare` again. Answers travel on the message link, which drops what was queued on a
/// connection it loses: without this, a participant that is up but whose answer was lost (or
/// that dropped its round unanswered) held the round for its whole timeout. A participant
/// still working on the round ignores the duplicate; one that no longer has it refuses it,
/// and the round aborts.
pub const REASK_MS: u64 = 2_000;

/// An epoch reported in doubt, being fenced, and who to tell.
#[derive(Debug, Default)]
struct Doubt {
    reporters: BTreeSet<NodeId>,
    asked: bool,
}

/// See the module documentation.
#[derive(Debug)]
pub struct Coordinator {
    timeout_ms: u64,
    /// This coordinator's incarnation: its rounds' messages carry it.
    inc: u64,
    rounds: BTreeMap<String, Round>,
    doubts: BTreeMap<(String, u64), Doubt>,
    /// Per job, the highest epoch a participant reported seeing in a refusal (bounded by
    /// [`crate::MAX_ROUNDS`]).
    seen: BTreeMap<String, u64>,
    /// The incarnation each node was last heard at ([`Coordinator::heard`]).
    heard: BTreeMap<NodeId, u64>,
    actions: VecDeque<CoordAction>,
}

impl Coordinator {
    /// A coordinator whose rounds abort when not all prepared within `timeout_ms`, on a node
    /// of incarnation `inc` (each start of the node a new one: the answers to a round of a
    /// predecessor with the same epoch are not this one's).
    pub fn new(timeout_ms: u64, inc: u64) -> Coordinator {
        Coordinator {
            timeout_ms,
            inc,
            rounds: BTreeMap::new(),
            doubts: BTreeMap::new(),
            seen: BTreeMap::new(),
            heard: BTreeMap::new(),
            actions: VecDeque::new(),
        }
    }

    /// Node `n` is heard at incarnation `inc` now (0: not heard). Heard at another one than
    /// before, it restarted — within the failure timeout, so it is never declared down — and
    /// its earlier incarnation will not answer the rounds it was in: as [`Self::node_down`].
    /// (Found by the nemesis: a job's last checkpoint waited ten minutes for a participant
    /// killed and back within a second.)
    pub fn heard(&mut self, n: NodeId, inc: u64) {
        if inc == 0 {
            return;
        }
        if self.heard.insert(n, inc).is_some_and(|was| was != inc) {
            self.node_down(n);
        }
    }

    pub fn poll_action(&mut self) -> Option<CoordAction> {
        self.actions.pop_front()
    }

    /// Whether a round of `job` is in progress.
    pub fn busy(&self, job: &str) -> bool {
        self.rounds.contains_key(job)
    }

    /// Whether `job`'s round in progress let its ranks go on (every participant took).
    pub fn released(&self, job: &str) -> bool {
        self.rounds.get(job).is_some_and(|r| r.released)
    }

    /// `job`'s round in progress: its epoch, what it does, since when, and the participants
    /// it still waits for (of how many).
    pub fn progress(&self, job: &str) -> Option<Progress> {
        self.rounds.get(job).map(|r| Progress {
            epoch: r.epoch,
            level: r.level,
            step: match r.phase {
                Phase::Beginning => Step::Beginning,
                Phase::Collecting => Step::WritingPages,
                Phase::Flushing => Step::FlushingRecoveryCopies,
                Phase::Committing => Step::CommitRecord,
                Phase::Fencing => Step::LearningOutcome,
            },
            started_ms: r.started_ms,
            waiting: r.waiting.iter().copied().collect(),
            participants: r.participants.len(),
            released: r.released,
        })
    }

    /// Starts checkpoint `epoch` of `job` at `level` (the shell takes it above the job's floor
    /// in the metadata, [`psls_pfs::jobs::floor`], and every epoch it started) over `files`,
    /// with every node of `participants`. `committed` is the job's last committed epoch the
    /// shell knows (a memory round's `Prepare` carries it; a persistent one's the metadata's);
    /// `cleaning`, the job's cleaning policy, goes with the `Prepare`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        now_ms: u64,
        job: &str,
        epoch: u64,
        (level, cleaning): (Level, crate::cleaning::Policy),
        files: Vec<FileId>,
        participants: BTreeSet<NodeId>,
        committed: u64,
    ) -> Result<(), StartError> {
        if self.rounds.contains_key(job) {
            return Err(StartError::Busy);
        }
        if self.rounds.len() >= crate::MAX_ROUNDS {
            return Err(StartError::Full);
        }
        if participants.is_empty() || epoch == 0 {
            return Err(StartError::Invalid(format!(
                "epoch {epoch} with {} participants",
                participants.len()
            )));
        }
        // A round at or below the committed memory epoch would abort, and its abort would take
        // that epoch's pre-recovery copies from a node that missed the commit (found by the
        // simulator, once writers kept a copy of their own).
        if epoch <= committed {
            return Err(StartError::Invalid(format!(
                "epoch {epoch} is not above the committed epoch {committed}"
            )));
        }
        self.rounds.insert(
            job.to_string(),
            Round {
                epoch,
                level,
                cleaning,
                gen: 0,
                seq: 0,
                files,
                committed: 0,
                asked_ms: 0,
                waiting: participants.clone(),
                untaken: participants.clone(),
                expect: BTreeMap::new(),
                taken_pages: 0,
                released: false,
                coord_inc: self.inc,
                participants,
                written: BTreeMap::new(),
                bytes: 0,
                started_ms: now_ms,
                phase: Phase::Beginning,
            },
        );
        match level {
            Level::Persistent => self.actions.push_back(CoordAction::Begin {
                job: job.to_string(),
                epoch,
            }),
            // Nothing to begin in the metadata: prepare at once.
            Level::Memory => self.prepare(now_ms, job, 0, 0, committed),
        }
        Ok(())
    }

    /// `job`'s round of `epoch` must hear from each node of `incarnations` (a node whose ranks
    /// reached the safe point) in that incarnation: one that restarted since lost their pages
    /// and their states, and a round that committed without them would be the checkpoint a
    /// rollback returns to. Called right after `start`.
    pub fn expect(&mut self, job: &str, epoch: u64, incarnations: BTreeMap<NodeId, u64>) {
        if let Some(r) = self.rounds.get_mut(job).filter(|r| r.epoch == epoch) {
            r.expect = incarnations;
        }
    }

    /// Whether an answer of `from` in incarnation `inc` may count for `job`'s round.
    fn same_incarnation(&self, job: &str, from: NodeId, inc: u64) -> bool {
        self.rounds
            .get(job)
            .and_then(|r| r.expect.get(&from))
            .is_none_or(|want| *want == inc)
    }

    /// Sends the round's `Prepare` to every participant.
    fn prepare(&mut self, now_ms: u64, job: &str, gen: u64, seq: u64, committed: u64) {
        let Some(r) = self.rounds.get_mut(job) else { return };
        r.gen = gen;
        r.seq = seq;
        r.phase = Phase::Collecting;
        r.started_ms = now_ms;
        r.committed = committed;
        r.asked_ms = now_ms;
        for &to in &r.participants {
            let msg = r.prepare_msg(job, self.inc);
            self.actions.push_back(CoordAction::Send { to, msg });
        }
    }

    /// The metadata began `epoch` (`Ok`: its generation, the metadata sequence number that
    /// shows it, and the job's last committed epoch) or could not (`Err`: the round aborts).
    pub fn begun(&mut self, now_ms: u64, job: &str, epoch: u64, result: Result<(u64, u64, u64), String>) {
        let Some(r) = self.rounds.get_mut(job) else { return };
        if r.epoch != epoch || r.phase != Phase::Beginning {
            return;
        }
        let (gen, seq, committed) = match result {
            Ok(v) => v,
            Err(why) => {
                // Nothing was sent: nobody to tell.
                r.participants.clear();
                self.abort(job, format!("the checkpoint could not begin: {why}"));
                return;
            }
        };
        self.prepare(now_ms, job, gen, seq, committed);
    }

    /// A message from participant `from`.
    pub fn receive(&mut self, from: NodeId, msg: Msg) {
        let (job, epoch) = (msg.job().to_string(), msg.epoch());
        let current = self.rounds.get(&job).map(|r| r.epoch);
        // An answer to a round of this epoch that another coordinator incarnation started is
        // not an answer to this one's.
        let mine = |inc: u64| inc == self.inc;
        // A participant that restarted since its ranks reached the safe point: the round
        // cannot have its pages.
        if let Msg::Taken {
            part_inc, coord_inc, ..
        }
        | Msg::Prepared {
            part_inc, coord_inc, ..
        } = &msg
        {
            let collecting = self.rounds.get(&job).is_some_and(|r| r.phase == Phase::Collecting);
            if current == Some(epoch) && collecting && mine(*coord_inc) && !self.same_incarnation(&job, from, *part_inc)
            {
                self.abort(
                    &job,
                    format!("{from} restarted since its part of the job began (it answers as incarnation {part_inc})"),
                );
                return;
            }
        }
        match msg {
            Msg::Taken { pages, coord_inc, .. } if current == Some(epoch) && mine(coord_inc) => {
                let Some(r) = self.rounds.get_mut(&job) else { return };
                if r.phase != Phase::Collecting || !r.untaken.remove(&from) {
                    return;
                }
                r.taken_pages += pages;
                release_if_all_took(&job, r, &mut self.actions);
            }
            Msg::Prepared {
                written,
                bytes,
                level,
                coord_inc,
                ..
            } if current == Some(epoch) && mine(coord_inc) => {
                let Some(r) = self.rounds.get_mut(&job) else { return };
                // A level other than the round's: a late answer to a round of the same epoch
                // that a coordinator before this one began.
                if r.phase != Phase::Collecting || r.level != level || !r.waiting.remove(&from) {
                    return;
                }
                // Kept means taken (its `Taken` may still be on its way, or lost).
                if r.untaken.remove(&from) {
                    r.taken_pages += written.iter().flat_map(|fr| &fr.runs).map(|(a, b)| b - a).sum::<u64>();
                    release_if_all_took(&job, r, &mut self.actions);
                }
                for fr in written {
                    r.written.entry(fr.file).or_default().extend(fr.runs);
                }
                r.bytes += bytes;
                if !r.waiting.is_empty() {
                    return;
                }
                match r.level {
                    // Two recovery copies of every page in memory: that is the commit.
                    Level::Memory => {
                        let r = self.rounds.remove(&job).expect("present");
                        self.finish_committed(&job, r);
                    }
                    Level::Persistent => {
                        r.phase = Phase::Flushing;
                        r.waiting = r.participants.clone();
                        for &to in &r.participants {
                            self.actions.push_back(CoordAction::Send {
                                to,
                                msg: Msg::Flush {
                                    job: job.clone(),
                                    epoch,
                                    coord_inc: self.inc,
                                    gen: r.gen,
                                    seq: r.seq,
                                },
                            });
                        }
                    }
                }
            }
            Msg::Flushed {
                written,
                bytes,
                coord_inc,
                ..
            } if current == Some(epoch) && mine(coord_inc) => {
                let Some(r) = self.rounds.get_mut(&job) else { return };
                if r.phase != Phase::Flushing || !r.waiting.remove(&from) {
                    return;
                }
                for fr in written {
                    r.written.entry(fr.file).or_default().extend(fr.runs);
                }
                r.bytes += bytes;
                if r.waiting.is_empty() {
                    r.phase = Phase::Committing;
                    let files = r
                        .written
                        .iter()
                        .map(|(f, runs)| FileRuns {
                            file: *f,
                            runs: merge(runs),
                        })
                        .collect();
                    self.actions.push_back(CoordAction::Commit {
                        job,
                        epoch,
                        gen: r.gen,
                        files,
                        bytes: r.bytes,
                    });
                }
            }
            Msg::Refused {
                why,
                seen,
                coord_inc,
                no_room,
                ..
            } if current == Some(epoch)
                && mine(coord_inc)
                && self
                    .rounds
                    .get(&job)
                    .is_some_and(|r| matches!(r.phase, Phase::Collecting | Phase::Flushing)) =>
            {
                if seen >= epoch && (self.seen.contains_key(&job) || self.seen.len() < crate::MAX_ROUNDS) {
                    let s = self.seen.entry(job.clone()).or_default();
                    *s = (*s).max(seen);
                }
                let why = format!("{from} could not keep its pages: {why}");
                self.abort_as(
                    &job,
                    if no_room {
                        Outcome::NoRoom(why)
                    } else {
                        Outcome::Aborted(why)
                    },
                );
            }
            // A participant holds a persistent epoch no round here is deciding: settle it by
            // the record. (A memory epoch has no record: the job's rollback settles it.)
            Msg::Prepared {
                level: Level::Persistent,
                ..
            }
            | Msg::InDoubt { .. }
                if current != Some(epoch) =>
            {
                self.doubt(&job, epoch, from);
            }
            // Stale (another epoch), or not for a coordinator.
            _ => {}
        }
    }

    fn doubt(&mut self, job: &str, epoch: u64, from: NodeId) {
        let key = (job.to_string(), epoch);
        if !self.doubts.contains_key(&key) && self.doubts.len() >= crate::MAX_IN_DOUBT {
            return; // reported again later (the participant repeats at every coordinator change)
        }
        let d = self.doubts.entry(key).or_default();
        d.reporters.insert(from);
        if !d.asked {
            d.asked = true;
            self.actions.push_back(CoordAction::Fence {
                job: job.to_string(),
                epoch,
            });
        }
    }

    /// Participant `n` went down: a round still collecting that waits on it aborts (one
    /// committing finishes by its record, and those that come back roll back anyway).
    pub fn node_down(&mut self, n: NodeId) {
        let hit: Vec<String> = self
            .rounds
            .iter()
            .filter(|(_, r)| {
                matches!(r.phase, Phase::Beginning | Phase::Collecting | Phase::Flushing) && r.participants.contains(&n)
            })
            .map(|(j, _)| j.clone())
            .collect();
        for job in hit {
            if let Some(r) = self.rounds.get_mut(&job) {
                r.participants.remove(&n);
            }
            self.abort(&job, format!("{n} went down during the checkpoint"));
        }
        for d in self.doubts.values_mut() {
            d.reporters.remove(&n);
        }
    }

    /// `job` rolls back: a round of it that has not asked for its commit record aborts (one
    /// that has finishes by its record). Returns whether a round is still deciding.
    pub fn abort_job(&mut self, job: &str) -> bool {
        match self.rounds.get(job).map(|r| r.phase) {
            Some(Phase::Beginning | Phase::Collecting | Phase::Flushing) => {
                self.abort(job, "the job rolls back".into());
                false
            }
            Some(_) => true,
            None => false,
        }
    }

    /// Rounds not all prepared after the timeout abort.
    pub fn tick(&mut self, now_ms: u64) {
        let late: Vec<String> = self
            .rounds
            .iter()
            .filter(|(_, r)| {
                matches!(r.phase, Phase::Collecting | Phase::Flushing)
                    && now_ms.saturating_sub(r.started_ms) > self.timeout_ms
            })
            .map(|(j, _)| j.clone())
            .collect();
        for job in late {
            let waiting: Vec<String> = self.rounds[&job].waiting.iter().map(|n| n.to_string()).collect();
            self.abort(
                &job,
                format!("no answer from {} within {} ms", waiting.join(", "), self.timeout_ms),
            );
        }
        // The participants a collecting round has not heard from for a while are asked again.
        for (job, r) in self.rounds.iter_mut() {
            if r.phase != Phase::Collecting || now_ms.saturating_sub(r.asked_ms) < REASK_MS {
                continue;
            }
            r.asked_ms = now_ms;
            for &to in &r.waiting {
                let msg = r.prepare_msg(job, self.inc);
                self.actions.push_back(CoordAction::Send { to, msg });
            }
        }
    }

    fn abort(&mut self, job: &str, why: String) {
        self.abort_as(job, Outcome::Aborted(why));
    }

    /// Ends `job`'s round with `outcome` (not a commit).
    fn abort_as(&mut self, job: &str, outcome: Outcome) {
        debug_assert!(!matches!(outcome, Outcome::Committed { .. }));
        let Some(r) = self.rounds.remove(job) else { return };
        self.decide(job, r.epoch, false, &r.participants);
        self.actions.push_back(CoordAction::Finished {
            job: job.to_string(),
            epoch: r.epoch,
            outcome,
        });
    }

    /// `r` committed: everyone is told, and the round is over.
    fn finish_committed(&mut self, job: &str, r: Round) {
        let pages = pages_of(&r.written);
        self.decide(job, r.epoch, true, &r.participants);
        self.actions.push_back(CoordAction::Finished {
            job: job.to_string(),
            epoch: r.epoch,
            outcome: Outcome::Committed {
                level: r.level,
                pages,
                bytes: r.bytes,
            },
        });
    }

    /// The highest epoch of `job` a participant said it had seen when it refused a `Prepare`
    /// (the shell starts the next round above it).
    pub fn seen(&self, job: &str) -> u64 {
        self.seen.get(job).copied().unwrap_or(0)
    }

    /// `job` ended: what is remembered of it goes.
    pub fn forget(&mut self, job: &str) {
        self.seen.remove(job);
    }

    fn decide(&mut self, job: &str, epoch: u64, commit: bool, to: &BTreeSet<NodeId>) {
        for &n in to {
            self.actions.push_back(CoordAction::Send {
                to: n,
                msg: Msg::Decide {
                    job: job.to_string(),
                    epoch,
                    coord_inc: self.inc,
                    commit,
                },
            });
        }
    }

    /// The commit record of `epoch` was written (`Ok`) or could not be (`Err`: its fate is
    /// unknown, so it is fenced and the record decides).
    pub fn committed(&mut self, job: &str, epoch: u64, result: Result<(), String>) {
        let Some(r) = self.rounds.get_mut(job) else { return };
        if r.epoch != epoch || r.phase != Phase::Committing {
            return;
        }
        match result {
            Ok(()) => {
                let r = self.rounds.remove(job).expect("present");
                self.finish_committed(job, r);
            }
            Err(_) => {
                r.phase = Phase::Fencing;
                self.actions.push_back(CoordAction::Fence {
                    job: job.to_string(),
                    epoch,
                });
            }
        }
    }

    /// What the record says of `epoch` after a fence: `Ok(true)` it committed, `Ok(false)` it
    /// never will; `Err` the fence could not be written (asked again at once by the shell's
    /// retry, or at the next report).
    pub fn fenced(&mut self, job: &str, epoch: u64, result: Result<bool, String>) {
        let key = (job.to_string(), epoch);
        match result {
            Ok(commit) => {
                if let Some(d) = self.doubts.remove(&key) {
                    self.decide(job, epoch, commit, &d.reporters);
                }
                if self
                    .rounds
                    .get(job)
                    .is_some_and(|r| r.epoch == epoch && r.phase == Phase::Fencing)
                {
                    let r = self.rounds.remove(job).expect("present");
                    let pages = pages_of(&r.written);
                    self.decide(job, epoch, commit, &r.participants);
                    let outcome = if commit {
                        Outcome::Committed {
                            level: r.level,
                            pages,
                            bytes: r.bytes,
                        }
                    } else {
                        Outcome::Aborted("the commit record could not be written".into())
                    };
                    self.actions.push_back(CoordAction::Finished {
                        job: job.to_string(),
                        epoch,
                        outcome,
                    });
                }
            }
            Err(_) => {
                // Nobody is told anything; the doubt is asked again when reported again, the
                // round's fence when the shell retries.
                if let Some(d) = self.doubts.get_mut(&key) {
                    d.asked = false;
                }
            }
        }
    }

    /// Fences still to be asked again (after a failed one): the shell calls this on its timer.
    pub fn retry(&mut self) {
        let again: Vec<(String, u64)> = self
            .doubts
            .iter()
            .filter(|(_, d)| !d.asked && !d.reporters.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        for (job, epoch) in again {
            if let Some(d) = self.doubts.get_mut(&(job.clone(), epoch)) {
                d.asked = true;
            }
            self.actions.push_back(CoordAction::Fence { job, epoch });
        }
        self.doubts.retain(|_, d| !d.reporters.is_empty());
        let fencing: Vec<(String, u64)> = self
            .rounds
            .iter()
            .filter(|(_, r)| r.phase == Phase::Fencing)
            .map(|(j, r)| (j.clone(), r.epoch))
            .collect();
        for (job, epoch) in fencing {
            self.actions.push_back(CoordAction::Fence { job, epoch });
        }
    }
}

/// `r`'s ranks go on once every participant took its pages (once per round).
fn release_if_all_took(job: &str, r: &mut Round, actions: &mut VecDeque<CoordAction>) {
    if r.untaken.is_empty() && !r.released {
        r.released = true;
        actions.push_back(CoordAction::Released {
            job: job.to_string(),
            epoch: r.epoch,
            pages: r.taken_pages,
        });
        for &to in &r.participants {
            actions.push_back(CoordAction::Send {
                to,
                msg: Msg::Go {
                    job: job.to_string(),
                    epoch: r.epoch,
                    coord_inc: r.coord_inc,
                },
            });
        }
    }
}

/// Pages in `written`, each counted once.
fn pages_of(written: &BTreeMap<FileId, Vec<(u64, u64)>>) -> u64 {
    written
        .values()
        .map(|runs| merge(runs).iter().map(|(s, e)| e - s).sum::<u64>())
        .sum()
}

/// Sorts and merges page runs.
fn merge(runs: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = runs.iter().copied().filter(|(s, e)| s < e).collect();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cleaning::Policy;

    fn nodes(n: u32) -> BTreeSet<NodeId> {
        (0..n).map(NodeId).collect()
    }

    fn drain(c: &mut Coordinator) -> Vec<CoordAction> {
        std::iter::from_fn(|| c.poll_action()).collect()
    }

    fn prepared(epoch: u64, runs: Vec<(u64, u64)>) -> Msg {
        Msg::Prepared {
            job: "j".into(),
            coord_inc: 0,
            part_inc: 0,
            epoch,
            level: Level::Persistent,
            written: vec![FileRuns { file: FileId(1), runs }],
            bytes: 4096,
        }
    }

    fn flushed(epoch: u64, runs: Vec<(u64, u64)>) -> Msg {
        Msg::Flushed {
            job: "j".into(),
            coord_inc: 0,
            epoch,
            written: vec![FileRuns { file: FileId(1), runs }],
            bytes: 0,
        }
    }

    /// A participant not heard from for [`REASK_MS`] is sent its `Prepare` again (its answer
    /// may have been lost with a connection); those that answered are not.
    #[test]
    fn a_silent_participant_is_asked_again_and_its_refusal_aborts_the_round() {
        let mut c = Coordinator::new(600_000, 0);
        c.start(0, "j", 1, (Level::Persistent, Policy::P1), vec![FileId(1)], nodes(3), 0)
            .unwrap();
        drain(&mut c);
        c.begun(10, "j", 1, Ok((5, 10, 0)));
        drain(&mut c);
        c.receive(NodeId(0), prepared(1, vec![(4, 6)]));
        c.tick(10 + REASK_MS - 1);
        assert!(drain(&mut c).is_empty(), "not yet");
        c.tick(10 + REASK_MS);
        let a = drain(&mut c);
        let asked: Vec<NodeId> = a
            .iter()
            .filter_map(|x| match x {
                CoordAction::Send {
                    to,
                    msg:
                        Msg::Prepare {
                            epoch: 1,
                            gen: 5,
                            seq: 10,
                            ..
                        },
                } => Some(*to),
                _ => None,
            })
            .collect();
        assert_eq!(asked, vec![NodeId(1), NodeId(2)], "{a:?}");
        // Asked once a period.
        c.tick(10 + REASK_MS + 1);
        assert!(drain(&mut c).is_empty());
        // A participant that no longer has the round refuses it: the round aborts at once,
        // not after its timeout.
        c.receive(
            NodeId(1),
            Msg::Refused {
                job: "j".into(),
                epoch: 1,
                coord_inc: 0,
                why: "epoch 1 is not above epoch 1, seen here".into(),
                seen: 1,
                no_room: false,
            },
        );
        let a = drain(&mut c);
        assert!(
            a.iter().any(|x| matches!(
                x,
                CoordAction::Finished {
                    outcome: Outcome::Aborted(_),
                    ..
                }
            )),
            "{a:?}"
        );
        assert_eq!(c.progress("j"), None);
    }

    #[test]
    fn commits_after_every_participant_prepared_and_then_decides() {
        let mut c = Coordinator::new(1000, 0);
        c.start(0, "j", 1, (Level::Persistent, Policy::P1), vec![FileId(1)], nodes(3), 0)
            .unwrap();
        assert_eq!(
            c.start(0, "j", 2, (Level::Persistent, Policy::P1), vec![], nodes(3), 0),
            Err(StartError::Busy)
        );
        assert!(matches!(drain(&mut c)[..], [CoordAction::Begin { epoch: 1, .. }]));
        c.receive(NodeId(0), prepared(1, vec![(4, 6)]));
        assert!(drain(&mut c).is_empty(), "nothing is collected before the epoch begun");
        assert_eq!(c.progress("j").map(|p| p.step), Some(Step::Beginning));
        c.begun(7, "j", 1, Ok((5, 10, 0)));
        let a = drain(&mut c);
        assert_eq!(a.len(), 3, "{a:?}");
        c.receive(NodeId(0), prepared(1, vec![(4, 6)]));
        c.receive(NodeId(0), prepared(1, vec![(9, 10)])); // a duplicate counts once
        c.receive(NodeId(1), prepared(0, vec![(0, 1)])); // stale epoch: a doubt, not this round
        c.receive(NodeId(1), prepared(1, vec![(2, 4)]));
        let p = c.progress("j").expect("in progress");
        assert_eq!(
            (p.epoch, p.step, p.started_ms, p.waiting, p.participants),
            (1, Step::WritingPages, 7, vec![NodeId(2)], 3)
        );
        assert_eq!(c.progress("other"), None);
        let a = drain(&mut c);
        assert!(matches!(&a[..], [CoordAction::Fence { epoch: 0, .. }]), "{a:?}");
        c.receive(NodeId(2), prepared(1, vec![(6, 7)]));
        let a = drain(&mut c);
        assert_eq!(
            a.iter()
                .filter(|x| matches!(
                    x,
                    CoordAction::Send {
                        msg: Msg::Flush {
                            epoch: 1,
                            gen: 5,
                            seq: 10,
                            ..
                        },
                        ..
                    }
                ))
                .count(),
            3,
            "every participant flushes its recovery copies: {a:?}"
        );
        assert_eq!(c.progress("j").map(|p| p.step), Some(Step::FlushingRecoveryCopies));
        c.receive(NodeId(0), flushed(1, vec![(20, 21)]));
        c.receive(NodeId(0), flushed(1, vec![(30, 31)])); // a duplicate counts once
        c.receive(NodeId(1), flushed(1, vec![]));
        assert!(drain(&mut c).is_empty());
        c.receive(NodeId(2), flushed(1, vec![(20, 21)])); // the other holder of page 20
        let a = drain(&mut c);
        match &a[..] {
            [CoordAction::Commit {
                epoch: 1,
                gen: 5,
                files,
                bytes,
                ..
            }] => {
                assert_eq!(files[0].runs, vec![(2, 7), (20, 21)]);
                assert_eq!(*bytes, 3 * 4096);
            }
            other => panic!("{other:?}"),
        }
        // A participant lost now does not abort: the record decides.
        c.node_down(NodeId(2));
        c.committed("j", 1, Ok(()));
        let a = drain(&mut c);
        assert_eq!(
            a.iter()
                .filter(|x| matches!(
                    x,
                    CoordAction::Send {
                        msg: Msg::Decide { commit: true, .. },
                        ..
                    }
                ))
                .count(),
            3
        );
        assert!(matches!(
            a.last(),
            Some(CoordAction::Finished {
                outcome: Outcome::Committed { pages: 6, .. },
                ..
            })
        ));
        assert!(!c.busy("j"));
    }

    #[test]
    fn refusals_downs_and_timeouts_abort_before_the_record_and_a_failed_record_is_fenced() {
        let mut c = Coordinator::new(1000, 0);
        let go = |c: &mut Coordinator, epoch: u64, n: u32| {
            c.start(0, "j", epoch, (Level::Persistent, Policy::P1), vec![], nodes(n), 0)
                .unwrap();
            c.begun(0, "j", epoch, Ok((5, 10, 0)));
            drain(c);
        };
        go(&mut c, 1, 2);
        c.receive(
            NodeId(0),
            Msg::Refused {
                job: "j".into(),
                coord_inc: 0,
                epoch: 1,
                why: "disk".into(),
                seen: 0,
                no_room: false,
            },
        );
        let a = drain(&mut c);
        assert!(a
            .iter()
            .any(|x| matches!(x, CoordAction::Finished { outcome: Outcome::Aborted(w), .. } if w.contains("disk"))));
        assert!(!a.iter().any(|x| matches!(x, CoordAction::Commit { .. })));

        go(&mut c, 2, 2);
        c.node_down(NodeId(1));
        let a = drain(&mut c);
        assert!(matches!(
            a.last(),
            Some(CoordAction::Finished {
                outcome: Outcome::Aborted(_),
                ..
            })
        ));
        // Only the survivor is told.
        assert_eq!(
            a.iter()
                .filter(|x| matches!(
                    x,
                    CoordAction::Send {
                        msg: Msg::Decide { .. },
                        ..
                    }
                ))
                .count(),
            1
        );

        go(&mut c, 3, 2);
        c.tick(1000);
        assert!(c.busy("j"));
        c.tick(1001);
        assert!(!c.busy("j"));
        drain(&mut c);

        go(&mut c, 4, 1);
        c.receive(NodeId(0), prepared(4, vec![]));
        drain(&mut c);
        c.receive(NodeId(0), flushed(4, vec![]));
        drain(&mut c);
        c.committed("j", 4, Err("quorum lost".into()));
        assert!(matches!(drain(&mut c)[..], [CoordAction::Fence { epoch: 4, .. }]));
        c.fenced("j", 4, Err("still no quorum".into()));
        c.retry();
        assert!(matches!(drain(&mut c)[..], [CoordAction::Fence { epoch: 4, .. }]));
        c.fenced("j", 4, Ok(true));
        let a = drain(&mut c);
        assert!(a.iter().any(|x| matches!(
            x,
            CoordAction::Send {
                msg: Msg::Decide {
                    commit: true,
                    epoch: 4,
                    ..
                },
                ..
            }
        )));
        assert!(matches!(
            a.last(),
            Some(CoordAction::Finished {
                outcome: Outcome::Committed { .. },
                ..
            })
        ));
    }

    #[test]
    fn a_memory_round_touches_no_metadata_and_commits_on_the_last_prepared() {
        let mut c = Coordinator::new(1000, 0);
        c.start(3, "j", 5, (Level::Memory, Policy::P1), vec![FileId(1)], nodes(2), 4)
            .unwrap();
        let a = drain(&mut c);
        assert_eq!(a.len(), 2, "{a:?}");
        assert!(a.iter().all(|x| matches!(
            x,
            CoordAction::Send {
                msg: Msg::Prepare {
                    epoch: 5,
                    level: Level::Memory,
                    gen: 0,
                    seq: 0,
                    committed: 4,
                    ..
                },
                ..
            }
        )));
        let p = c.progress("j").expect("in progress");
        assert_eq!((p.level, p.step, p.started_ms), (Level::Memory, Step::WritingPages, 3));
        let mem = |epoch, runs| Msg::Prepared {
            job: "j".into(),
            coord_inc: 0,
            part_inc: 0,
            epoch,
            level: Level::Memory,
            written: vec![FileRuns { file: FileId(1), runs }],
            bytes: 4096,
        };
        c.receive(NodeId(0), mem(5, vec![(0, 1)]));
        assert!(drain(&mut c).is_empty());
        c.receive(NodeId(1), mem(5, vec![(1, 2)]));
        let a = drain(&mut c);
        assert!(
            !a.iter().any(|x| matches!(
                x,
                CoordAction::Begin { .. } | CoordAction::Commit { .. } | CoordAction::Fence { .. }
            )),
            "{a:?}"
        );
        assert_eq!(
            a.iter()
                .filter(|x| matches!(
                    x,
                    CoordAction::Send {
                        msg: Msg::Decide {
                            epoch: 5,
                            commit: true,
                            ..
                        },
                        ..
                    }
                ))
                .count(),
            2
        );
        assert!(matches!(
            a.last(),
            Some(CoordAction::Finished {
                outcome: Outcome::Committed {
                    level: Level::Memory,
                    pages: 2,
                    bytes: 8192
                },
                ..
            })
        ));
        // A memory epoch reported with no round here is not fenced: the rollback settles it.
        c.receive(NodeId(1), mem(6, vec![]));
        assert!(drain(&mut c).is_empty());
        // A participant that saw a later epoch refuses; the next round starts above it.
        c.start(3, "j", 6, (Level::Memory, Policy::P1), vec![], nodes(2), 5)
            .unwrap();
        drain(&mut c);
        c.receive(
            NodeId(0),
            Msg::Refused {
                job: "j".into(),
                coord_inc: 0,
                epoch: 6,
                why: "stale".into(),
                seen: 9,
                no_room: false,
            },
        );
        assert!(!c.busy("j"));
        assert_eq!(c.seen("j"), 9);
        c.forget("j");
        assert_eq!(c.seen("j"), 0);
        // A participant with no room for its recovery copies: the outcome says so by its kind
        // (the shell's cleaner takes over), not by its text.
        c.start(3, "j", 10, (Level::Memory, Policy::P1), vec![], nodes(2), 9)
            .unwrap();
        drain(&mut c);
        c.receive(
            NodeId(1),
            Msg::Refused {
                job: "j".into(),
                coord_inc: 0,
                epoch: 10,
                why: "full".into(),
                seen: 0,
                no_room: true,
            },
        );
        let a = drain(&mut c);
        assert!(
            matches!(a.last(), Some(CoordAction::Finished { epoch: 10, outcome: Outcome::NoRoom(w), .. }) if w.contains("full")),
            "{a:?}"
        );
    }

    #[test]
    fn ranks_go_on_once_every_participant_took_and_other_rounds_or_incarnations_do_not_count() {
        let mut c = Coordinator::new(1000, 7);
        c.start(0, "j", 3, (Level::Memory, Policy::P1), vec![FileId(1)], nodes(3), 2)
            .unwrap();
        c.expect("j", 3, (0..3).map(|n| (NodeId(n), 1)).collect());
        let a = drain(&mut c);
        assert!(a.iter().all(|x| matches!(
            x,
            CoordAction::Send {
                msg: Msg::Prepare { coord_inc: 7, .. },
                ..
            }
        )));
        let taken = |coord_inc, part_inc, pages| Msg::Taken {
            job: "j".into(),
            epoch: 3,
            coord_inc,
            part_inc,
            pages,
        };
        c.receive(NodeId(0), taken(7, 1, 10));
        // A predecessor's round of the same epoch: not this one's answer.
        c.receive(NodeId(1), taken(6, 1, 5));
        c.receive(NodeId(1), taken(7, 1, 20));
        c.receive(NodeId(1), taken(7, 1, 20)); // a duplicate counts once
        assert!(drain(&mut c).is_empty(), "node 2 has not taken");
        assert!(!c.released("j"));
        // Kept means taken: a `Prepared` before (or instead of) node 2's `Taken`.
        c.receive(
            NodeId(2),
            Msg::Prepared {
                job: "j".into(),
                epoch: 3,
                level: Level::Memory,
                coord_inc: 7,
                part_inc: 1,
                written: vec![FileRuns {
                    file: FileId(1),
                    runs: vec![(0, 4)],
                }],
                bytes: 4 * 4096,
            },
        );
        let a = drain(&mut c);
        assert_eq!(
            a.first(),
            Some(&CoordAction::Released {
                job: "j".into(),
                epoch: 3,
                pages: 34
            }),
            "{a:?}"
        );
        let goes = a
            .iter()
            .filter(|x| {
                matches!(
                    x,
                    CoordAction::Send {
                        msg: Msg::Go {
                            epoch: 3,
                            coord_inc: 7,
                            ..
                        },
                        ..
                    }
                )
            })
            .count();
        assert_eq!((goes, a.len()), (3, 4), "{a:?}");
        assert!(c.released("j"));
        c.receive(NodeId(2), taken(7, 1, 4));
        assert!(drain(&mut c).is_empty(), "released once");
        // Node 1 restarted since the safe point: its answer aborts the round.
        c.receive(
            NodeId(1),
            Msg::Prepared {
                job: "j".into(),
                epoch: 3,
                level: Level::Memory,
                coord_inc: 7,
                part_inc: 2,
                written: vec![],
                bytes: 0,
            },
        );
        let a = drain(&mut c);
        assert!(
            matches!(a.last(), Some(CoordAction::Finished { outcome: Outcome::Aborted(why), .. }) if why.contains("restarted")),
            "{a:?}"
        );
        assert!(!c.busy("j"));
    }

    #[test]
    fn a_participant_heard_at_a_new_incarnation_aborts_the_rounds_it_was_in() {
        let mut c = Coordinator::new(600_000, 0);
        c.heard(NodeId(1), 5);
        c.start(0, "j", 1, (Level::Persistent, Policy::P1), vec![], nodes(2), 0)
            .unwrap();
        c.begun(0, "j", 1, Ok((5, 10, 0)));
        drain(&mut c);
        c.heard(NodeId(1), 5);
        c.heard(NodeId(0), 0);
        assert!(drain(&mut c).is_empty(), "the same incarnation: the round waits");
        c.heard(NodeId(1), 6);
        let a = drain(&mut c);
        assert!(
            matches!(a.last(), Some(CoordAction::Finished { outcome: Outcome::Aborted(why), .. }) if why.contains("went down")),
            "{a:?}"
        );
        assert!(!c.busy("j"));
    }

    #[test]
    fn doubts_are_fenced_once_and_every_reporter_told() {
        let mut c = Coordinator::new(1000, 0);
        c.receive(
            NodeId(1),
            Msg::InDoubt {
                job: "j".into(),
                epoch: 3,
            },
        );
        c.receive(
            NodeId(2),
            Msg::InDoubt {
                job: "j".into(),
                epoch: 3,
            },
        );
        assert_eq!(drain(&mut c).len(), 1);
        c.fenced("j", 3, Ok(false));
        let a = drain(&mut c);
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|x| matches!(
            x,
            CoordAction::Send {
                msg: Msg::Decide { commit: false, .. },
                ..
            }
        )));
        assert_eq!(merge(&[(5, 6), (0, 2), (1, 3), (3, 3)]), vec![(0, 3), (5, 6)]);
    }
}
