//! Coordinator election and replication of the namespace metadata: a one-slot Multi-Paxos over
//! snapshots of a deterministic state.
//!
//! The replicated value is any [`Replicated`] state (the daemon's is `psls_pfs::meta::MetaState`):
//! a sequence number and a pure, validated `apply`. Every physical node of the cluster (logical
//! nodes and spares) is a *voter*; a majority of voters is a quorum.
//!
//! - **Election.** The shell tells the machine, at every tick, whether its failure detector
//!   makes this node the coordinator (lowest live logical id). Such a node *claims* a new
//!   [`Epoch`] `(n, me)`, higher than any it has seen; a voter *promises* it if it promised no
//!   higher one, reporting its committed sequence number, its committed state when newer than
//!   the claimer's, and the operation it accepted but has not seen committed. With a quorum of
//!   promises the claimer adopts the newest committed state, re-proposes the newest accepted
//!   operation for the next slot (it may have been chosen), and then serves submissions.
//!   Epochs are unique to their coordinator by construction (`by` is part of the epoch), so at
//!   most one coordinator acts per epoch.
//! - **Replication.** The coordinator proposes one operation at a time for slot `seq + 1`; a
//!   voter accepts it (durably) unless it promised a higher epoch; with a quorum of
//!   acceptances the operation is committed and the coordinator tells everyone to commit; it
//!   answers the submitter once every voter the shell says is live (`set_live`) has confirmed
//!   the commit, so an operation answered `Ok` is visible on every live node (and one refused
//!   as invalid is answered once the state it was refused on is). A voter whose committed
//!   state is behind is sent the coordinator's
//!   (`Install`); a voter that hears (from heartbeats) of a newer committed state fetches it.
//! - **Durability.** The shell must make `PersistVote` (promised epoch, accepted operation)
//!   and `PersistCommitted` durable before it carries out any later action (a send or an
//!   answer): that is what lets a restarted voter keep its promises.
//!
//! Invariants (checked by the simulator after every step): two nodes never hold different
//! committed states for the same sequence number; a node's committed sequence number never goes
//! back, not even across a restart; an operation answered `Ok(seq)` is in every committed state
//! from `seq` on; at most one node is coordinator of an epoch. Liveness needs a quorum of
//! voters up and a failure detector that settles on one coordinator.
//!
//! Bounds: at most [`MAX_QUEUED`] submissions wait at a coordinator; every message names one
//! slot or carries one state.
//!
//! Why one file of this size (about 800 lines without its tests): one state machine whose
//! handlers share the Paxos invariants stated above; split, a reader would lose them.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::{Debug, Display};

/// Submissions waiting at a coordinator beyond the one in flight.
pub const MAX_QUEUED: usize = 256;
/// A claim or proposal with no quorum after this long is sent again (messages to a node
/// that restarted are lost with its connection).
pub const RETRY_MS: u64 = 500;

/// A replicated state: a sequence number and a deterministic, validated transition.
pub trait Replicated: Clone + Debug + PartialEq {
    type Op: Clone + Debug + PartialEq;
    type Error: Clone + Debug + Display;
    /// Sequence number of the last applied operation.
    fn seq(&self) -> u64;
    /// Applies `op` as operation `seq() + 1`; on error the state is unchanged.
    fn apply(&mut self, op: &Self::Op) -> Result<(), Self::Error>;
}

/// A coordinator's term: ordered by `n`, then by the claiming voter, so no two voters ever
/// claim the same epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Epoch {
    pub n: u64,
    pub by: u32,
}

/// An operation accepted for slot `seq` in `epoch`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Accepted<Op> {
    pub epoch: Epoch,
    pub seq: u64,
    pub op: Op,
}

/// What a voter keeps on disk: restart a [`Replica`] from it.
#[derive(Clone, Debug, PartialEq)]
pub struct Durable<S: Replicated> {
    pub promised: Epoch,
    pub committed: S,
    pub accepted: Option<Accepted<S::Op>>,
}

impl<S: Replicated> Durable<S> {
    /// The same record with an accepted operation that the committed state already covers
    /// dropped (it is kept on disk until the next vote is written, and means nothing).
    pub fn normalized(mut self) -> Self {
        if self.accepted.as_ref().is_some_and(|a| a.seq <= self.committed.seq()) {
            self.accepted = None;
        }
        self
    }
}

/// Messages between voters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(bound(
    serialize = "S: Serialize, S::Op: Serialize",
    deserialize = "S: Deserialize<'de>, S::Op: Deserialize<'de>"
))]
pub enum Msg<S: Replicated> {
    /// A voter claims `epoch`; its committed state is at `seq`.
    Claim { epoch: Epoch, seq: u64 },
    /// Promise of `epoch`: the promiser's committed `seq` (and the state itself when newer
    /// than the claimer's) and the operation it accepted for the next slot.
    Promise {
        epoch: Epoch,
        seq: u64,
        accepted: Option<Accepted<S::Op>>,
        state: Option<S>,
    },
    /// `epoch` is refused: the sender promised `promised`.
    Refuse { epoch: Epoch, promised: Epoch },
    /// Accept this operation for its slot.
    Propose { accepted: Accepted<S::Op> },
    /// The operation of slot `seq` proposed in `epoch` is accepted.
    Accepted { epoch: Epoch, seq: u64 },
    /// The sender's committed state is at `seq`, too old for the proposal of `epoch`.
    Behind { epoch: Epoch, seq: u64 },
    /// The operation proposed for `seq` in `epoch` is committed.
    Commit { epoch: Epoch, seq: u64 },
    /// A committed state newer than the receiver's.
    Install { state: S },
    /// Send me your committed state if it is newer than `seq`.
    Fetch { seq: u64 },
    /// The sender's committed state is at `seq` now (after a `Commit` or an `Install`).
    Committed { seq: u64 },
}

/// Why a submission failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplError<E: Display> {
    #[error("this node is not the coordinator")]
    NotCoordinator,
    #[error("too many metadata operations are waiting")]
    Busy,
    /// The coordinator changed while the operation was under way: it may or may not have been
    /// applied (the caller looks).
    #[error("the coordinator changed while the operation was under way")]
    Interrupted,
    /// The operation is invalid on the current state.
    #[error("{0}")]
    Rejected(E),
}

/// The answer to a submission: the seq it was committed at, or why not.
pub type Outcome<S> = Result<u64, ReplError<<S as Replicated>::Error>>;

/// What the shell must do, in order.
#[derive(Debug)]
pub enum Action<S: Replicated, T> {
    /// Make the promised epoch and the accepted operation durable before any later action.
    PersistVote {
        promised: Epoch,
        accepted: Option<Accepted<S::Op>>,
    },
    /// Make this committed state durable before any later action.
    PersistCommitted(S),
    Send {
        to: u32,
        msg: Msg<S>,
    },
    /// Answer to `submit(token, ..)`: the sequence number of the committed operation.
    Done {
        token: T,
        result: Result<u64, ReplError<S::Error>>,
    },
}

struct Inflight<T, Op> {
    token: Option<T>,
    accepted: Accepted<Op>,
    acks: BTreeSet<u32>,
    sent_ms: u64,
}

enum Role<S: Replicated, T> {
    Follower,
    Candidate {
        epoch: Epoch,
        /// Voter → the operation it accepted (promised voters only).
        promises: BTreeMap<u32, Option<Accepted<S::Op>>>,
        newest: Option<S>,
        sent_ms: u64,
    },
    Leader {
        epoch: Epoch,
        inflight: Option<Inflight<T, S::Op>>,
    },
}

/// One voter's side of election and replication. `T` is the shell's handle for a submission.
pub struct Replica<S: Replicated, T> {
    me: u32,
    voters: u32,
    promised: Epoch,
    committed: S,
    accepted: Option<Accepted<S::Op>>,
    /// Highest epoch number seen anywhere.
    max_seen: u64,
    role: Role<S, T>,
    queue: VecDeque<(T, S::Op)>,
    actions: VecDeque<Action<S, T>>,
    now_ms: u64,
    /// Voters the shell's failure detector says are live.
    live: BTreeSet<u32>,
    /// Voter → the highest committed seq it confirmed (at the coordinator).
    confirmed: BTreeMap<u32, u64>,
    /// Answers waiting for every live voter to confirm the state they were decided on (an
    /// operation committed at seq, or refused on the state at seq), in order.
    confirming: VecDeque<(T, u64, Outcome<S>)>,
    /// When confirmations were last asked for again.
    confirm_sent_ms: u64,
}

impl<S: Replicated, T> Replica<S, T> {
    /// A voter `me` of `voters`, restarted from what it kept on disk.
    pub fn new(me: u32, voters: u32, durable: Durable<S>) -> Self {
        assert!(me < voters, "voter {me} of {voters}");
        let durable = durable.normalized();
        Replica {
            me,
            voters,
            max_seen: durable.promised.n,
            promised: durable.promised,
            committed: durable.committed,
            accepted: durable.accepted,
            role: Role::Follower,
            queue: VecDeque::new(),
            actions: VecDeque::new(),
            now_ms: 0,
            live: (0..voters).collect(),
            confirmed: BTreeMap::new(),
            confirming: VecDeque::new(),
            confirm_sent_ms: 0,
        }
    }

    /// The voters the failure detector says are live (this one is always taken as live).
    pub fn set_live(&mut self, live: impl IntoIterator<Item = u32>) {
        self.live = live.into_iter().filter(|&v| v < self.voters).collect();
        self.answer_confirmed();
    }

    /// Asks the live voters that have not confirmed the oldest awaited commit again (a
    /// `Commit` or `Install` may have been lost with a connection).
    fn retry_confirmations(&mut self) {
        let Role::Leader { epoch, .. } = &self.role else {
            return;
        };
        let epoch = *epoch;
        let Some(&(_, seq, _)) = self.confirming.front() else {
            return;
        };
        if self.now_ms.saturating_sub(self.confirm_sent_ms) < RETRY_MS {
            return;
        }
        self.confirm_sent_ms = self.now_ms;
        let late: Vec<u32> = self
            .live
            .iter()
            .copied()
            .filter(|&v| v != self.me && self.confirmed.get(&v).is_none_or(|&c| c < seq))
            .collect();
        let seq = self.committed.seq();
        for v in late {
            self.send(v, Msg::Commit { epoch, seq });
        }
    }

    /// Queues an answer until every live voter has confirmed the state at `seq`.
    fn confirm(&mut self, token: T, seq: u64, result: Outcome<S>) {
        if self.confirming.is_empty() {
            self.confirm_sent_ms = self.now_ms;
        }
        self.confirming.push_back((token, seq, result));
        self.answer_confirmed();
    }

    /// Answers the submitters whose operations every live voter has confirmed.
    fn answer_confirmed(&mut self) {
        while let Some(&(_, seq, _)) = self.confirming.front() {
            let me = self.me;
            let all = self
                .live
                .iter()
                .filter(|&&v| v != me)
                .all(|v| self.confirmed.get(v).is_some_and(|&c| c >= seq));
            if !all {
                return;
            }
            if let Some((token, _, result)) = self.confirming.pop_front() {
                self.actions.push_back(Action::Done { token, result });
            }
        }
    }

    /// The committed state (what readers see).
    pub fn committed(&self) -> &S {
        &self.committed
    }

    /// What must be on disk now.
    pub fn durable(&self) -> Durable<S> {
        Durable {
            promised: self.promised,
            committed: self.committed.clone(),
            accepted: self.accepted.clone(),
        }
    }

    pub fn promised(&self) -> Epoch {
        self.promised
    }

    /// The epoch this node coordinates, once a quorum promised it.
    pub fn leading(&self) -> Option<Epoch> {
        match &self.role {
            Role::Leader { epoch, .. } => Some(*epoch),
            _ => None,
        }
    }

    /// The epoch this replica claimed in this life, while it claims or leads it (not a claim
    /// of an earlier life found on its disk).
    pub fn claimed(&self) -> Option<Epoch> {
        match &self.role {
            Role::Candidate { epoch, .. } | Role::Leader { epoch, .. } => Some(*epoch),
            Role::Follower => None,
        }
    }

    /// Whether an operation is being replicated or waits (for tests and status).
    pub fn busy(&self) -> bool {
        !self.queue.is_empty()
            || !self.confirming.is_empty()
            || matches!(&self.role, Role::Leader { inflight: Some(_), .. })
    }

    fn quorum(&self) -> usize {
        self.voters as usize / 2 + 1
    }

    /// The next action for the shell.
    pub fn poll_action(&mut self) -> Option<Action<S, T>> {
        self.actions.pop_front()
    }

    fn send(&mut self, to: u32, msg: Msg<S>) {
        self.actions.push_back(Action::Send { to, msg });
    }

    fn broadcast(&mut self, msg: &Msg<S>) {
        for v in 0..self.voters {
            if v != self.me {
                self.send(v, msg.clone());
            }
        }
    }

    fn persist_vote(&mut self) {
        self.actions.push_back(Action::PersistVote {
            promised: self.promised,
            accepted: self.accepted.clone(),
        });
    }

    fn set_committed(&mut self, s: S) {
        debug_assert!(s.seq() > self.committed.seq());
        self.committed = s;
        if self.accepted.as_ref().is_some_and(|a| a.seq <= self.committed.seq()) {
            self.accepted = None;
        }
        self.actions.push_back(Action::PersistCommitted(self.committed.clone()));
    }

    /// Time passes; `coordinator` says whether the failure detector makes this node the
    /// coordinator now.
    pub fn tick(&mut self, now_ms: u64, coordinator: bool) {
        self.now_ms = now_ms;
        if !coordinator {
            if !matches!(self.role, Role::Follower) {
                self.step_down();
            }
            return;
        }
        self.retry_confirmations();
        match &self.role {
            Role::Follower => self.campaign(),
            Role::Candidate { sent_ms, .. } if now_ms.saturating_sub(*sent_ms) >= RETRY_MS => self.campaign(),
            Role::Leader { inflight: Some(f), .. } if now_ms.saturating_sub(f.sent_ms) >= RETRY_MS => {
                let (acks, msg) = (
                    f.acks.clone(),
                    Msg::Propose {
                        accepted: f.accepted.clone(),
                    },
                );
                for v in 0..self.voters {
                    if !acks.contains(&v) {
                        self.send(v, msg.clone());
                    }
                }
                if let Role::Leader { inflight: Some(f), .. } = &mut self.role {
                    f.sent_ms = now_ms;
                }
            }
            _ => {}
        }
    }

    /// Submits an operation (answered by a `Done` with `token`).
    pub fn submit(&mut self, token: T, op: S::Op) {
        match &self.role {
            Role::Follower => self.actions.push_back(Action::Done {
                token,
                result: Err(ReplError::NotCoordinator),
            }),
            _ if self.queue.len() >= MAX_QUEUED => self.actions.push_back(Action::Done {
                token,
                result: Err(ReplError::Busy),
            }),
            _ => {
                self.queue.push_back((token, op));
                self.propose_next();
            }
        }
    }

    /// A peer's heartbeat says its committed state is at `seq`.
    pub fn peer_seq(&mut self, from: u32, seq: u64) {
        if seq > self.committed.seq() && from < self.voters && from != self.me {
            self.send(
                from,
                Msg::Fetch {
                    seq: self.committed.seq(),
                },
            );
        }
    }

    fn campaign(&mut self) {
        self.max_seen = self.max_seen.max(self.promised.n) + 1;
        let epoch = Epoch {
            n: self.max_seen,
            by: self.me,
        };
        self.fail_all(ReplError::Interrupted);
        self.promised = epoch;
        self.persist_vote();
        let mut promises = BTreeMap::new();
        promises.insert(self.me, self.accepted.clone());
        self.role = Role::Candidate {
            epoch,
            promises,
            newest: None,
            sent_ms: self.now_ms,
        };
        let seq = self.committed.seq();
        self.broadcast(&Msg::Claim { epoch, seq });
        self.check_promises();
    }

    fn fail_all(&mut self, why: ReplError<S::Error>) {
        if let Role::Leader { inflight, .. } = &mut self.role {
            if let Some(token) = inflight.take().and_then(|f| f.token) {
                self.actions.push_back(Action::Done {
                    token,
                    result: Err(why.clone()),
                });
            }
        }
        while let Some((token, _)) = self.queue.pop_front() {
            self.actions.push_back(Action::Done {
                token,
                result: Err(why.clone()),
            });
        }
        // Committed, but not yet seen everywhere: the submitter looks for itself.
        while let Some((token, _, _)) = self.confirming.pop_front() {
            self.actions.push_back(Action::Done {
                token,
                result: Err(why.clone()),
            });
        }
        self.confirmed.clear();
    }

    fn step_down(&mut self) {
        self.fail_all(ReplError::Interrupted);
        self.role = Role::Follower;
    }

    /// Handles a message from voter `from`. Messages naming a voter outside the cluster are
    /// dropped.
    pub fn receive(&mut self, from: u32, msg: Msg<S>) {
        if from >= self.voters || from == self.me {
            return;
        }
        match msg {
            Msg::Claim { epoch, seq } => {
                if epoch.by != from {
                    return;
                }
                self.max_seen = self.max_seen.max(epoch.n);
                if epoch > self.promised {
                    if !matches!(self.role, Role::Follower) {
                        self.step_down();
                    }
                    self.promised = epoch;
                    self.persist_vote();
                } else if epoch < self.promised {
                    let promised = self.promised;
                    self.send(from, Msg::Refuse { epoch, promised });
                    return;
                }
                let state = (self.committed.seq() > seq).then(|| self.committed.clone());
                let reply = Msg::Promise {
                    epoch,
                    seq: self.committed.seq(),
                    accepted: self.accepted.clone(),
                    state,
                };
                self.send(from, reply);
            }
            Msg::Promise {
                epoch,
                seq,
                accepted,
                state,
            } => {
                let Role::Candidate {
                    epoch: mine,
                    promises,
                    newest,
                    ..
                } = &mut self.role
                else {
                    return;
                };
                if *mine != epoch {
                    return;
                }
                promises.insert(from, accepted);
                let c = self.confirmed.entry(from).or_insert(0);
                *c = (*c).max(seq);
                if let Some(s) = state {
                    if s.seq() > newest.as_ref().map_or(0, |n| n.seq()) {
                        *newest = Some(s);
                    }
                }
                self.check_promises();
            }
            Msg::Refuse { epoch, promised } => {
                self.max_seen = self.max_seen.max(promised.n);
                let ours = match &self.role {
                    Role::Candidate { epoch: e, .. } | Role::Leader { epoch: e, .. } => *e == epoch,
                    Role::Follower => false,
                };
                if ours {
                    self.step_down();
                }
            }
            Msg::Propose { accepted } => {
                let epoch = accepted.epoch;
                if epoch.by != from {
                    return;
                }
                self.max_seen = self.max_seen.max(epoch.n);
                if epoch < self.promised {
                    let promised = self.promised;
                    self.send(from, Msg::Refuse { epoch, promised });
                    return;
                }
                if epoch > self.promised {
                    if !matches!(self.role, Role::Follower) {
                        self.step_down();
                    }
                    // The promise is durable before anything is said in this epoch.
                    self.promised = epoch;
                    self.persist_vote();
                }
                let seq = accepted.seq;
                let base = self.committed.seq();
                if seq <= base {
                    // Already committed here: the chosen operation of a slot is unique.
                    self.send(from, Msg::Accepted { epoch, seq });
                    return;
                }
                if seq > base + 1 {
                    self.send(from, Msg::Behind { epoch, seq: base });
                    return;
                }
                if self.committed.clone().apply(&accepted.op).is_err() {
                    // An operation a correct coordinator validated on the same state cannot
                    // fail here; refuse to take part rather than accept it.
                    return;
                }
                self.accepted = Some(accepted);
                self.persist_vote();
                self.send(from, Msg::Accepted { epoch, seq });
            }
            Msg::Accepted { epoch, seq } => {
                let quorum = self.quorum();
                let Role::Leader {
                    epoch: mine,
                    inflight: Some(f),
                } = &mut self.role
                else {
                    return;
                };
                if *mine != epoch || f.accepted.seq != seq {
                    return;
                }
                f.acks.insert(from);
                // Accepting slot seq means holding the state at seq - 1.
                let c = self.confirmed.entry(from).or_insert(0);
                *c = (*c).max(seq - 1);
                if f.acks.len() >= quorum {
                    self.commit_inflight();
                }
            }
            Msg::Behind { epoch, seq } => {
                let Role::Leader { epoch: mine, inflight } = &self.role else {
                    return;
                };
                if *mine != epoch {
                    return;
                }
                let again = inflight.as_ref().map(|f| Msg::Propose {
                    accepted: f.accepted.clone(),
                });
                if self.committed.seq() > seq {
                    let state = self.committed.clone();
                    self.send(from, Msg::Install { state });
                }
                if let Some(m) = again {
                    self.send(from, m);
                }
            }
            Msg::Commit { epoch, seq } => {
                if seq <= self.committed.seq() {
                    let seq = self.committed.seq();
                    self.send(from, Msg::Committed { seq });
                    return;
                }
                let matches = self
                    .accepted
                    .as_ref()
                    .is_some_and(|a| a.epoch == epoch && a.seq == seq && seq == self.committed.seq() + 1);
                if !matches {
                    let base = self.committed.seq();
                    self.send(from, Msg::Behind { epoch, seq: base });
                    return;
                }
                let Some(a) = self.accepted.clone() else { return };
                let mut next = self.committed.clone();
                if next.apply(&a.op).is_ok() {
                    self.set_committed(next);
                    let seq = self.committed.seq();
                    self.send(from, Msg::Committed { seq });
                }
            }
            Msg::Install { state } => {
                if state.seq() <= self.committed.seq() {
                    let seq = self.committed.seq();
                    self.send(from, Msg::Committed { seq });
                    return;
                }
                {
                    self.set_committed(state);
                    let seq = self.committed.seq();
                    self.send(from, Msg::Committed { seq });
                    // A coordinator that learns of a newer committed state mid-proposal has a
                    // stale base: its proposal cannot be chosen on it.
                    if let Role::Leader { inflight, .. } = &mut self.role {
                        if inflight
                            .as_ref()
                            .is_some_and(|f| f.accepted.seq <= self.committed.seq())
                        {
                            if let Some(token) = inflight.take().and_then(|f| f.token) {
                                self.actions.push_back(Action::Done {
                                    token,
                                    result: Err(ReplError::Interrupted),
                                });
                            }
                        }
                    }
                    self.propose_next();
                }
            }
            Msg::Committed { seq } => {
                if matches!(self.role, Role::Leader { .. }) {
                    let c = self.confirmed.entry(from).or_insert(0);
                    *c = (*c).max(seq);
                    self.answer_confirmed();
                }
            }
            Msg::Fetch { seq } => {
                if self.committed.seq() > seq {
                    let state = self.committed.clone();
                    self.send(from, Msg::Install { state });
                }
            }
        }
    }

    fn check_promises(&mut self) {
        let quorum = self.quorum();
        let Role::Candidate {
            epoch,
            promises,
            newest,
            ..
        } = &mut self.role
        else {
            return;
        };
        if promises.len() < quorum {
            return;
        }
        let epoch = *epoch;
        let promises = std::mem::take(promises);
        let newest = newest.take();
        if let Some(s) = newest {
            if s.seq() > self.committed.seq() {
                self.set_committed(s);
            }
        }
        // The operation that may have been chosen for the next slot: the one accepted in the
        // highest epoch among the quorum.
        let next = self.committed.seq() + 1;
        let recovered = promises
            .into_values()
            .flatten()
            .filter(|a| a.seq == next)
            .max_by_key(|a| a.epoch);
        self.role = Role::Leader { epoch, inflight: None };
        if let Some(a) = recovered {
            if self.committed.clone().apply(&a.op).is_ok() {
                self.start(None, a.op);
                return;
            }
        }
        self.propose_next();
    }

    /// Proposes the next queued operation if none is in flight.
    fn propose_next(&mut self) {
        loop {
            let Role::Leader { inflight: None, .. } = &self.role else {
                return;
            };
            let Some((token, op)) = self.queue.pop_front() else {
                return;
            };
            let mut probe = self.committed.clone();
            match probe.apply(&op) {
                Ok(()) => {
                    self.start(Some(token), op);
                    return;
                }
                // Refused on the state at this seq: answered once every live voter has that state
                // (a node told "exists" must find the file).
                Err(e) => {
                    let seq = self.committed.seq();
                    self.confirm(token, seq, Err(ReplError::Rejected(e)));
                }
            }
        }
    }

    fn start(&mut self, token: Option<T>, op: S::Op) {
        let Role::Leader { epoch, .. } = &self.role else {
            return;
        };
        let accepted = Accepted {
            epoch: *epoch,
            seq: self.committed.seq() + 1,
            op,
        };
        self.accepted = Some(accepted.clone());
        self.persist_vote();
        let mut acks = BTreeSet::new();
        acks.insert(self.me);
        let msg = Msg::Propose {
            accepted: accepted.clone(),
        };
        if let Role::Leader { inflight, .. } = &mut self.role {
            *inflight = Some(Inflight {
                token,
                accepted,
                acks,
                sent_ms: self.now_ms,
            });
        }
        self.broadcast(&msg);
        if self.quorum() <= 1 {
            self.commit_inflight();
        }
    }

    fn commit_inflight(&mut self) {
        let Role::Leader { epoch, inflight } = &mut self.role else {
            return;
        };
        let epoch = *epoch;
        let Some(f) = inflight.take() else { return };
        let mut next = self.committed.clone();
        let applied = next.apply(&f.accepted.op);
        assert!(
            applied.is_ok(),
            "an operation validated on the committed state failed to apply on it"
        );
        self.set_committed(next);
        let seq = f.accepted.seq;
        self.broadcast(&Msg::Commit { epoch, seq });
        if let Some(token) = f.token {
            self.confirm(token, seq, Ok(seq));
        }
        self.propose_next();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log of numbers; odd numbers above 1000 are refused.
    #[derive(Clone, Debug, Default, PartialEq)]
    struct Log(Vec<u32>);

    impl Replicated for Log {
        type Op = u32;
        type Error = String;
        fn seq(&self) -> u64 {
            self.0.len() as u64
        }
        fn apply(&mut self, op: &u32) -> Result<(), String> {
            if *op > 1000 && op % 2 == 1 {
                return Err(format!("{op} refused"));
            }
            self.0.push(*op);
            Ok(())
        }
    }

    type R = Replica<Log, u32>;

    fn fresh(me: u32, n: u32) -> R {
        Replica::new(
            me,
            n,
            Durable {
                promised: Epoch::default(),
                committed: Log::default(),
                accepted: None,
            },
        )
    }

    /// Delivers every message until none is left; returns the answers.
    fn settle(rs: &mut [R]) -> Vec<(u32, Result<u64, ReplError<String>>)> {
        let mut done = Vec::new();
        for _ in 0..10_000 {
            let mut moved = false;
            for i in 0..rs.len() {
                while let Some(a) = rs[i].poll_action() {
                    moved = true;
                    match a {
                        Action::Send { to, msg } => rs[to as usize].receive(i as u32, msg),
                        Action::Done { token, result } => done.push((token, result)),
                        Action::PersistVote { .. } | Action::PersistCommitted(_) => {}
                    }
                }
            }
            if !moved {
                return done;
            }
        }
        panic!("messages never settled");
    }

    #[test]
    fn elect_replicate_reject_and_take_over() {
        let mut rs: Vec<R> = (0..3).map(|i| fresh(i, 3)).collect();
        rs[0].tick(0, true);
        settle(&mut rs);
        assert_eq!(rs[0].leading(), Some(Epoch { n: 1, by: 0 }));
        rs[0].submit(1, 5);
        rs[0].submit(2, 1001);
        rs[0].submit(3, 6);
        let mut done = settle(&mut rs);
        done.sort_by_key(|d| d.0);
        assert_eq!(done[0], (1, Ok(1)));
        assert!(matches!(&done[1], (2, Err(ReplError::Rejected(m))) if m.contains("1001")));
        assert_eq!(done[2], (3, Ok(2)));
        for r in &rs {
            assert_eq!(r.committed().0, vec![5, 6]);
        }
        // A follower is not the coordinator.
        rs[1].submit(4, 7);
        assert!(matches!(settle(&mut rs)[..], [(4, Err(ReplError::NotCoordinator))]));
        // Voter 1 takes over with a higher epoch; voter 0 steps down when it hears of it.
        rs[1].tick(10, true);
        settle(&mut rs);
        assert_eq!(rs[1].leading(), Some(Epoch { n: 2, by: 1 }));
        assert_eq!(rs[0].leading(), None);
        rs[1].submit(5, 8);
        assert_eq!(settle(&mut rs), vec![(5, Ok(3))]);
        assert!(rs.iter().all(|r| r.committed().0 == vec![5, 6, 8]));
    }

    #[test]
    fn an_accepted_operation_is_recovered_by_the_next_coordinator() {
        let mut rs: Vec<R> = (0..3).map(|i| fresh(i, 3)).collect();
        rs[0].tick(0, true);
        settle(&mut rs);
        rs[0].submit(1, 42);
        // Deliver only the proposal to voter 1, then lose voter 0 and everything it sends.
        let mut to1 = None;
        while let Some(a) = rs[0].poll_action() {
            if let Action::Send { to: 1, msg } = a {
                to1 = Some(msg);
            }
        }
        rs[1].receive(0, to1.expect("a proposal to voter 1"));
        while rs[1].poll_action().is_some() {}
        rs[0] = Replica::new(0, 3, rs[0].durable());
        rs[1].tick(20, true);
        settle(&mut rs);
        assert_eq!(
            rs[1].committed().0,
            vec![42],
            "the accepted operation may have been chosen"
        );
        assert!(rs.iter().all(|r| r.committed().0 == vec![42]));
    }
}
