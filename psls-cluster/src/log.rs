//! The metadata log: one voter's side of the replicated log of metadata operations, and the
//! state those operations build.
//!
//! A deterministic machine around raft-rs's `RawNode` (the consensus module of TiKV, sans-IO
//! like this crate: `tick`, `step`, `ready`/`advance`), shaped like quinn-proto's
//! `Connection`: `handle_*` inputs, [`Log::poll_action`] outputs, getters.
//! It owns the applied state (any [`Machine`]; the daemon's is `psls_pfs::meta::MetaState`) and
//! the in-memory copy of the log ([`Cache`], raft-rs's `Storage`).
//! The shell makes durable what [`Action::Persist`] says, before any later action; it sends what
//! [`Action::Send`] says; it answers submitters and readers.
//!
//! - **Nodes and voters.** Every physical node is numbered `0..nodes` (raft ids `1..=nodes`).
//!   A few of them are the log's voters (raft's `ConfState`, kept with the applied state and
//!   changed only by [`Log::propose_voters`]: raft-rs's `ConfChangeV2`, joint consensus when
//!   more than one voter changes, left automatically, or by the next leader).
//!   Every other node is a *follower*: it runs no raft, and pulls the committed entries from its
//!   parent in a tree rooted at the voters ([`Wire::Follow`], answered by [`Wire::Feed`] at once
//!   when the parent applied more, else held until it does or [`Limits::follow_wait_ticks`]
//!   pass; [`Log::feed_source`]), so a leader sends nothing per follower and no node feeds more
//!   than [`Limits::follow_fanout`] of them, whatever the cluster's size.
//!   A follower applies what it pulls (configuration changes included, so it knows when it
//!   becomes a voter) and writes it like a voter; its reads ask the leader's read index.
//!   A node that finds itself out of the configuration (or is told so by a voter,
//!   [`Wire::NotVoter`]) becomes a follower; one that finds itself in it becomes a voter.
//!   A store created in this life starts as a follower: it learns whether it is a voter (then
//!   catching up as after a lost disk) or whether the cluster is new.
//! - **Leader.** Elections follow the election timeout the shell gives in ticks, randomized per
//!   election from the project's seeded generator (`psls_svm::rng`, so a seed replays a run); among voters whose logs are as
//!   long, the lowest-numbered live one wins (raft-rs's priorities) — until no leader was known
//!   for [`LEADERLESS_TICKS_PER_ELECTION`] election timeouts: then this voter sets no priority
//!   until one is (raft-rs's priority refuses a candidate whose log is as long even when its
//!   last term is newer, and a voter whose own log is stale cannot win either: with a voter
//!   lost for good and one catching up, the log simulator met elections that never ended);
//!   pre-vote and check-quorum are on, so a node cut off cannot disrupt a working majority when it comes back, and a leader
//!   that hears no majority for an election timeout steps down.
//!   A node that must not lead ([`Log::set_eligible`]) never campaigns and hands its leadership
//!   over.
//! - **Submissions** ([`Log::submit`]) are proposed by the leader only; many are in flight at once
//!   and a whole batch is written with one [`Action::Persist`] (group commit).
//!   A submission is answered once its entry is applied here: `Ok(index)` or the state's
//!   refusal, the same on every node; or `Dropped` once a newer term's entry took its place (it
//!   was never applied and never will be).
//! - **Reads** ([`Log::read`]) ask the leader for its commit index (raft's read index, no lease)
//!   and are answered once this node applied up to it: a read served after the answer sees every
//!   operation answered `Ok` before the read began. Concurrent reads share one request.
//! - **The applied state is written lazily.** Only log entries, votes and terms must reach the
//!   disk before the next action; what applying committed entries changed (which the log
//!   rebuilds after a crash) waits, merged, for the next tick, so the writes on an operation's
//!   path touch the log alone, whatever the size of the state, and a tick's write carries many
//!   operations' changes. A compaction goes with the changes it depends on (the entries it
//!   drops are applied in the same write), and so do changes once [`MAX_UNSAVED_ENTRIES`]
//!   entries wait.
//! - **Log compaction.** Once the log holds more than `compact_after` applied entries, the entries
//!   up to `keep_behind` before the applied index go; a voter that needs older ones is sent the
//!   applied state as a snapshot.
//!
//! Invariants (asserted here, and by the simulator after every step): the applied index only
//! grows; an entry is applied only once committed; every submission is answered exactly once,
//! unless this node stops first; a follower runs no raft.
//! Bounds: at most [`Limits::max_pending`] submissions and [`Limits::max_reads`] reads wait;
//! at most one held [`Wire::Follow`] per node; a [`Wire::Feed`] carries at most
//! [`Limits::max_msg_bytes`] of entries.

use psls_svm::rng::SplitMix64;
use raft::eraftpb::{
    ConfChange, ConfChangeSingle, ConfChangeTransition, ConfChangeType, ConfChangeV2, ConfState, Entry, EntryType,
    HardState, Message, MessageType, Snapshot, SnapshotMetadata,
};
use raft::{GetEntriesContext, RaftState, RawNode, ReadOnlyOption, StateRole, Storage, StorageError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::fmt::{Debug, Display};

/// A state built by applying the log's operations in order.
pub trait Machine: Clone + Default {
    type Op: Clone + Debug + Serialize + DeserializeOwned;
    type Error: Clone + Debug + Display;
    /// What the shell writes to make the applied state durable (the keys changed since the last
    /// [`Machine::take_changes`], with their new values).
    type Changes: Debug + Default;
    /// Index of the last applied entry.
    fn index(&self) -> u64;
    /// Applies `op` as entry `index` (`index() + 1`). On error nothing changes but the index.
    fn apply(&mut self, index: u64, op: &Self::Op) -> Result<(), Self::Error>;
    /// Entry `index` carries no operation (a new leader's empty entry): only the index moves.
    fn skip(&mut self, index: u64);
    /// The changes since the last call.
    fn take_changes(&mut self) -> Self::Changes;
    /// The whole state as the changes to write (after a snapshot replaced it).
    fn all_changes(&self) -> Self::Changes;
    /// The state as snapshot bytes.
    fn encode(&self) -> Vec<u8>;
    /// A state from snapshot bytes.
    fn decode(bytes: &[u8]) -> Result<Self, String>;
    /// Folds `later` changes into `earlier` ones: writing the result is writing both in order.
    fn merge_changes(earlier: &mut Self::Changes, later: Self::Changes);
}

/// Entries applied but not written to the store before a write of the log takes their changes
/// along.
pub const MAX_UNSAVED_ENTRIES: u64 = 4096;

/// Applied changes waiting to be written: merged, with the applied index they bring the store
/// to and the compaction that must go with them.
struct Unsaved<S: Machine> {
    changes: S::Changes,
    applied: (u64, u64),
    compact_to: Option<(u64, u64)>,
    /// The voters as of `applied`.
    conf: ConfState,
}

/// Election timeouts without a known leader after which a voter drops its election priority.
pub const LEADERLESS_TICKS_PER_ELECTION: u64 = 3;

/// Format of an entry's data: `[ENTRY_FORMAT u8][postcard operation]`.
pub const ENTRY_FORMAT: u8 = 1;

/// Tunables, in ticks and counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Ticks without a leader before a follower campaigns (randomized up to twice this).
    pub election_ticks: usize,
    /// Ticks between a leader's heartbeats.
    pub heartbeat_ticks: usize,
    /// Submissions waiting for their entry to be applied.
    pub max_pending: usize,
    /// Reads waiting.
    pub max_reads: usize,
    /// Entries a leader sends in one message, in bytes (at least one entry).
    pub max_msg_bytes: u64,
    /// Append messages in flight per follower.
    pub max_inflight: usize,
    /// The log is compacted once it holds more than this many applied entries...
    pub compact_after: u64,
    /// ... down to this many behind the applied index.
    pub keep_behind: u64,
    /// A read request unanswered after this many ticks is asked again.
    pub read_retry_ticks: u64,
    /// A follower's [`Wire::Follow`] is held this many ticks at most when there is nothing new
    /// (then answered empty); one unanswered for this plus an election timeout is asked of
    /// another node.
    pub follow_wait_ticks: u64,
    /// Followers one node feeds at most (see [`Log::feed_source`]).
    pub follow_fanout: u32,
}

impl Limits {
    /// How many ticks short of the election timeout a leader's lease ends: the longest a
    /// message may take (a fifth of the timeout, at least 2 ticks).
    pub fn lease_margin_ticks(&self) -> u64 {
        (self.election_ticks as u64 / 5).max(2)
    }

    /// Limits for a failure-detector timeout of `timeout_ms` and a tick of `tick_ms`.
    pub fn for_timeout(timeout_ms: u64, tick_ms: u64) -> Limits {
        let election = (timeout_ms / tick_ms.max(1)).max(4) as usize;
        Limits {
            election_ticks: election,
            heartbeat_ticks: (election / 6).max(1),
            max_pending: 8192,
            max_reads: 8192,
            max_msg_bytes: 1 << 20,
            max_inflight: 64,
            compact_after: 20_000,
            keep_behind: 5_000,
            read_retry_ticks: election as u64,
            follow_wait_ticks: 2 * election as u64,
            follow_fanout: 16,
        }
    }
}

/// What a voter keeps on disk: restart a [`Log`] from it.
#[derive(Clone, Debug)]
pub struct Durable<S> {
    pub hard_state: HardState,
    /// The last compaction: entries up to its index are gone.
    pub compacted: (u64, u64),
    /// The entries after it, in order.
    pub entries: Vec<Entry>,
    /// The applied state (its index at least the compaction's), and its entry's term.
    pub state: S,
    pub applied_term: u64,
    /// This voter lost what it acknowledged (its disk was replaced) and has not caught up yet.
    pub amnesiac: bool,
    /// The state was converted from a store written before the log, at this index, and no
    /// leader has confirmed it since (see [`Log::handle_message`]).
    pub legacy: Option<u64>,
    /// The voters as of the applied state (`None`: a store written before voters changed, when
    /// every node was one).
    pub conf: Option<ConfState>,
}

impl<S: Machine> Durable<S> {
    /// A voter that never ran (`amnesiac`: it ran before, and its disk was lost).
    pub fn fresh(amnesiac: bool) -> Durable<S> {
        Durable {
            hard_state: HardState::default(),
            compacted: (0, 0),
            entries: Vec::new(),
            state: S::default(),
            applied_term: 0,
            amnesiac,
            legacy: None,
            conf: None,
        }
    }
}

/// The configuration whose voters are `voters`.
pub fn conf_of(voters: &[u32]) -> ConfState {
    ConfState {
        voters: voters.iter().map(|v| raft_id(*v)).collect(),
        ..Default::default()
    }
}

/// A configuration as bytes (raft's protobuf), as a store keeps it.
pub fn encode_conf(c: &ConfState) -> Vec<u8> {
    use protobuf::Message as _;
    // Writing a message built here into a vector does not fail.
    c.write_to_bytes().unwrap_or_default()
}

/// A configuration from its bytes.
pub fn decode_conf(b: &[u8]) -> Result<ConfState, String> {
    use protobuf::Message as _;
    ConfState::parse_from_bytes(b).map_err(|e| e.to_string())
}

/// The voters of a configuration (both halves of a joint one), in order.
pub fn voters_of(conf: &ConfState) -> Vec<u32> {
    let mut v: Vec<u32> = conf
        .voters
        .iter()
        .chain(conf.voters_outgoing.iter())
        .filter_map(|id| voter_of(*id))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// One durable write: carried out whole (one transaction, one fsync when `sync`) before any
/// later action.
#[derive(Debug)]
pub struct Persist<S: Machine> {
    /// Whether it must reach the disk before the next action (votes, terms, log entries, a
    /// snapshot); otherwise only the applied state moved, which the log can rebuild.
    pub sync: bool,
    /// The hard state now (term, vote, commit; commit is at least `applied`).
    pub hard_state: HardState,
    /// Entries to write, replacing any at their indices and after.
    pub entries: Vec<Entry>,
    /// The state was replaced by a snapshot at this index and term: every key is in `changes`,
    /// and keys not there go; the log up to it goes.
    pub snapshot: Option<(u64, u64)>,
    /// Entries up to this index and term can go (compaction).
    pub compact_to: Option<(u64, u64)>,
    /// The applied index (and its entry's term) the tables are at after this write: the
    /// changes bring them there (a write of the log alone repeats the last one).
    pub applied: (u64, u64),
    pub changes: S::Changes,
    /// Whether the voter is still catching up after losing its disk.
    pub amnesiac: bool,
    /// The index of a converted state no leader has confirmed yet.
    pub legacy: Option<u64>,
    /// The voters as of `applied`, when the tables are written (`None`: a write of the log
    /// alone).
    pub conf: Option<ConfState>,
}

/// Why a submission was not applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError<E: Display> {
    /// This node does not lead; the leader, as far as it knows.
    #[error("this node does not lead the metadata")]
    NotLeader { leader: Option<u32> },
    #[error("too many metadata operations are waiting")]
    Busy,
    /// It was not applied and never will be (a newer term replaced it): submit it again.
    #[error("the metadata's leader changed before the operation was committed")]
    Dropped,
    /// This node skipped its index (a snapshot): it may or may not have been applied.
    #[error("the operation's outcome is unknown here (the log was replaced by a snapshot)")]
    Unknown,
    /// The state refused it (the same on every node).
    #[error("{0}")]
    Rejected(E),
    #[error("this node's metadata log stopped")]
    Halted,
}

/// Why a read cannot be served yet.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("no metadata leader is known")]
    NoLeader,
    #[error("too many metadata reads are waiting")]
    Busy,
    #[error("this node's metadata log stopped")]
    Halted,
}

/// A message between voters.
#[derive(Clone, Debug, PartialEq)]
pub enum Wire {
    Raft(Box<Message>),
    /// The sender lost its disk: its log ends at `last_index`, whatever the leader believed
    /// (raft assumes a voter never loses what it acknowledged; the leader starts over with it).
    /// `nonce`: drawn by the sender in this life, echoed by the leader's [`Wire::CatchUpTo`].
    LostDisk {
        last_index: u64,
        nonce: u64,
    },
    /// A leader's answer (in `term`) to a [`Wire::LostDisk`] of `nonce`: its log ended at
    /// `last_index` once the sender had lost its disk, so the sender acknowledged nothing past it.
    CatchUpTo {
        nonce: u64,
        last_index: u64,
        term: u64,
    },
    /// A follower asks for the committed entries after `after` (held until there are some, the
    /// leadership changes, or [`Limits::follow_wait_ticks`] pass); `term`: the latest it knows
    /// (asked by one that knows an older, it is answered at once).
    Follow {
        after: u64,
        term: u64,
    },
    /// The answer to a [`Wire::Follow`].
    Feed(Box<Feed>),
    /// A voter's answer to a raft message from a node that is not a voter in its configuration,
    /// applied up to `applied`: the sender is a follower at least until it applied that far.
    NotVoter {
        applied: u64,
    },
}

/// Committed entries for a follower: the entries after what it asked for (or the applied state
/// as a snapshot, once they were compacted away), and the sender's view of the leadership.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Feed {
    pub entries: Vec<Entry>,
    pub snapshot: Option<Snapshot>,
    /// The sender's applied index.
    pub applied: u64,
    pub term: u64,
    pub leader: Option<u32>,
}

impl Wire {
    /// The snapshot this message carries, if any.
    pub fn snapshot(&self) -> Option<&Snapshot> {
        match self {
            Wire::Raft(m) if m.get_msg_type() == MessageType::MsgSnapshot => Some(m.get_snapshot()),
            Wire::Feed(f) => f.snapshot.as_ref(),
            _ => None,
        }
    }

    /// The snapshot this message carries, to change.
    pub fn snapshot_mut(&mut self) -> Option<&mut Snapshot> {
        match self {
            Wire::Raft(m) if m.get_msg_type() == MessageType::MsgSnapshot => Some(m.mut_snapshot()),
            Wire::Feed(f) => f.snapshot.as_mut(),
            _ => None,
        }
    }
}

/// Why a change of voters was not proposed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfError {
    #[error("this node does not lead the metadata")]
    NotLeader,
    #[error("a change of the metadata's voters is under way")]
    Pending,
    #[error("the metadata's leader must stay a voter")]
    DropsLeader,
    #[error("a configuration needs at least one voter, and voters among the cluster's nodes")]
    Invalid,
}

/// What the shell must do, in order.
#[derive(Debug)]
pub enum Action<S: Machine, T> {
    Persist(Box<Persist<S>>),
    /// Send to voter `to`.
    Send {
        to: u32,
        msg: Wire,
    },
    /// The answer to `submit(token, ..)`: the index it was applied at.
    Done {
        token: T,
        result: Result<u64, SubmitError<S::Error>>,
    },
    /// The answer to `read(token)`: the state here is at least at the leader's commit index
    /// (returned) as of some time after the read began.
    Read {
        token: T,
        result: Result<u64, ReadError>,
    },
    /// The log cannot go on here (an entry this node cannot decode): the node must stop.
    Halt {
        reason: String,
    },
}

/// The in-memory log, raft-rs's [`Storage`]: what was persisted (or is being persisted in the
/// current [`Action::Persist`]), and the applied state it hands out as a snapshot.
pub struct Cache<S> {
    hard_state: HardState,
    conf_state: ConfState,
    /// Index and term of the last entry compacted away.
    compacted: (u64, u64),
    entries: VecDeque<Entry>,
    /// The applied state and its entry's term (a snapshot sent to a lagging voter).
    applied: Option<(S, u64)>,
}

impl<S> Cache<S> {
    fn first_index(&self) -> u64 {
        self.entries.front().map_or(self.compacted.0 + 1, |e| e.index)
    }
    fn last_index(&self) -> u64 {
        self.entries.back().map_or(self.compacted.0, |e| e.index)
    }
    fn append(&mut self, ents: &[Entry]) {
        let Some(first) = ents.first() else { return };
        assert!(
            first.index > self.compacted.0,
            "append at compacted index {}",
            first.index
        );
        assert!(
            first.index <= self.last_index() + 1,
            "gap before appended index {}",
            first.index
        );
        let keep = (first.index - self.first_index()) as usize;
        self.entries.truncate(keep);
        self.entries.extend(ents.iter().cloned());
    }
    fn compact(&mut self, index: u64, term: u64) {
        while self.entries.front().is_some_and(|e| e.index <= index) {
            self.entries.pop_front();
        }
        self.compacted = (index, term);
    }
    fn entry_term(&self, idx: u64) -> Option<u64> {
        if idx == self.compacted.0 {
            return Some(self.compacted.1);
        }
        let first = self.first_index();
        if idx < first || idx > self.last_index() {
            return None;
        }
        self.entries.get((idx - first) as usize).map(|e| e.term)
    }
}

impl<S: Machine> Storage for Cache<S> {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(self.hard_state.clone(), self.conf_state.clone()))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low < self.first_index() {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last_index() + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let first = self.first_index();
        let max = max_size.into().unwrap_or(u64::MAX);
        let mut out = Vec::new();
        let mut size = 0u64;
        for e in self.entries.range((low - first) as usize..(high - first) as usize) {
            size += (e.data.len() + e.context.len() + 16) as u64;
            if !out.is_empty() && size > max {
                break;
            }
            out.push(e.clone());
        }
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx < self.compacted.0 {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        self.entry_term(idx)
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(Cache::first_index(self))
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(Cache::last_index(self))
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let Some((state, term)) = &self.applied else {
            return Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable));
        };
        if state.index() < request_index || state.index() < self.compacted.0 {
            return Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable));
        }
        let mut snap = Snapshot {
            data: state.encode().into(),
            ..Default::default()
        };
        let meta = snap.mut_metadata();
        meta.index = state.index();
        meta.term = *term;
        meta.set_conf_state(self.conf_state.clone());
        Ok(snap)
    }
}

/// A proposal waiting for its entry.
struct Pending<T> {
    term: u64,
    token: T,
}

/// Reads sharing one read-index request, and those waiting for the next.
struct Reads<T> {
    next_ctx: u64,
    /// The request in flight: its context, its readers, the tick it was sent at.
    inflight: Option<(u64, Vec<T>, u64)>,
    waiting: Vec<T>,
    /// Readers whose index is known, waiting for this node to apply up to it.
    ready: BTreeMap<u64, Vec<T>>,
    count: usize,
}

/// A term and its leader as a node knows them.
type Leadership = (u64, Option<u32>);

/// A follower's side: whom it pulls from, and what it knows of the leadership.
#[derive(Debug, Default)]
struct Following {
    /// The node asked, and the tick it was asked at.
    asked: Option<(u32, u64)>,
    /// Turns of the sources to ask (the next after one that failed: [`Log::feed_source`]),
    /// and the tick the turn left 0 (after a while the parent is asked again: it may be back).
    turn: u32,
    turned_at: u64,
    leader: Option<u32>,
    term: u64,
    /// A voter said this node is no voter as of this index: it stays a follower until it
    /// applied that far.
    not_voter_until: u64,
    /// The leader's commit index a read answer told, and the tick this node first knew it was
    /// behind it: a source that does not bring it that far within an election timeout (it is
    /// cut off from the leader, or lags) is left for another.
    behind: Option<(u64, u64)>,
    /// A follower on a store created in this life asks the leader's commit index itself (this
    /// context, the tick asked), and clears its lost disk once it applied that far as a
    /// non-voter: whatever it acknowledged as a voter before is committed and here by then, so
    /// if it is made a voter again it need not catch up before it votes.
    probe: Option<(u64, u64)>,
    /// The commit index the probe answered.
    clear_at: Option<u64>,
}

impl Following {
    fn next_turn(&mut self, now: u64) {
        if self.turn == 0 {
            self.turned_at = now;
        }
        self.turn = self.turn.wrapping_add(1);
    }
}

/// One node's side of the metadata log. `T` is the shell's handle for a submission or a read.
pub struct Log<S: Machine, T> {
    me: u32,
    /// Physical nodes: ids `0..nodes`.
    nodes: u32,
    limits: Limits,
    /// `Some` while this node is a follower (its raft node, kept only as the store and the
    /// configuration's tracker, takes no message and no tick).
    following: Option<Following>,
    /// The store was created in this life (the disk was lost, or the cluster is new) and this
    /// node has not caught up as a voter since: it may have acknowledged entries it no longer
    /// holds, so as a voter it catches up before it votes (see `amnesia`).
    lost_disk: bool,
    /// Followers' [`Wire::Follow`] held here: node → (after, tick asked, the term and leader
    /// known here then).
    held: BTreeMap<u32, (u64, u64, Leadership)>,
    node: RawNode<Cache<S>>,
    state: S,
    applied_term: u64,
    pending: BTreeMap<u64, Pending<T>>,
    reads: Reads<T>,
    actions: VecDeque<Action<S, T>>,
    /// The project's one seeded generator: election timeouts replay with the seed.
    rng: SplitMix64,
    ticks: u64,
    /// On a leader: the tick at which each voter last answered it in its term (the lease).
    acked: BTreeMap<u32, u64>,
    acked_term: u64,
    eligible: bool,
    halted: Option<String>,
    /// Applied changes not written yet, merged.
    unsaved: Option<Unsaved<S>>,
    /// The applied index (and its term) of the state the store holds.
    written_applied: (u64, u64),
    /// The last election timeout drawn, so a new one is drawn only after raft reset its count.
    timeout_drawn: bool,
    /// The election timeout set last (raft's own, drawn unseeded, differs from it).
    timeout_set: usize,
    /// After a lost disk: `Some(None)` until a leader's append says how long its log is, then
    /// `Some(Some(index))` until this voter committed up to it. Meanwhile it neither votes nor
    /// campaigns: it may have acknowledged entries it no longer holds, and a vote of it could
    /// elect a leader without them.
    amnesia: Option<Option<u64>>,
    /// The index of a state converted from a store before the log that no leader confirmed.
    legacy: Option<u64>,
    /// This life's [`Wire::LostDisk`] nonce (a [`Wire::CatchUpTo`] for another is stale).
    lost_nonce: u64,
    /// The term of the last [`Wire::CatchUpTo`] taken: a leader of a later term is asked again.
    catch_up_term: u64,
    /// Ticks since this voter last knew a leader (its priority is dropped past a few election
    /// timeouts).
    leaderless_ticks: u64,
}

/// raft-rs logs through `slog`; this drain hands its records to `tracing`.
struct ToTracing;

impl slog::Drain for ToTracing {
    type Ok = ();
    type Err = slog::Never;
    fn log(&self, record: &slog::Record<'_>, _: &slog::OwnedKVList) -> Result<(), slog::Never> {
        match record.level() {
            slog::Level::Critical | slog::Level::Error => {
                tracing::error!(target: "psls_cluster::raft", "{}", record.msg())
            }
            slog::Level::Warning => tracing::warn!(target: "psls_cluster::raft", "{}", record.msg()),
            slog::Level::Info => tracing::debug!(target: "psls_cluster::raft", "{}", record.msg()),
            _ => tracing::trace!(target: "psls_cluster::raft", "{}", record.msg()),
        }
        Ok(())
    }
}

fn raft_id(voter: u32) -> u64 {
    voter as u64 + 1
}

fn voter_of(id: u64) -> Option<u32> {
    id.checked_sub(1).and_then(|v| u32::try_from(v).ok())
}

/// Why a [`Log`] cannot start from what was on disk.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StartError {
    #[error("the metadata log on disk is inconsistent: {0}")]
    Inconsistent(String),
}

impl<S: Machine, T> Log<S, T> {
    /// Node `me` of `nodes`, from what it kept on disk; `seed` randomizes its election
    /// timeouts. It is a voter if the configuration on disk says so (every node, for a store
    /// written before voters changed), except a store created in this life, which starts as a
    /// follower.
    pub fn new(me: u32, nodes: u32, limits: Limits, durable: Durable<S>, seed: u64) -> Result<Self, StartError> {
        assert!(me < nodes, "node {me} of {nodes}");
        let Durable {
            mut hard_state,
            compacted,
            entries,
            state,
            applied_term,
            amnesiac,
            legacy,
            conf,
        } = durable;
        let applied = state.index();
        let bad = |what: String| Err(StartError::Inconsistent(what));
        if applied < compacted.0 {
            return bad(format!(
                "applied index {applied} is before the compacted index {}",
                compacted.0
            ));
        }
        if entries.windows(2).any(|w| w[1].index != w[0].index + 1)
            || entries.first().is_some_and(|e| e.index != compacted.0 + 1)
        {
            return bad("the entries are not contiguous after the compacted index".into());
        }
        let last = entries.last().map_or(compacted.0, |e| e.index);
        if applied > last {
            return bad(format!("applied index {applied} is past the last entry {last}"));
        }
        let conf = conf.unwrap_or_else(|| conf_of(&(0..nodes).collect::<Vec<u32>>()));
        if voters_of(&conf).is_empty() || voters_of(&conf).iter().any(|v| *v >= nodes) {
            return bad(format!(
                "the voters on disk ({:?}) are not among the {nodes} nodes",
                voters_of(&conf)
            ));
        }
        // The commit index is at least what was applied (and at most the last entry).
        hard_state.commit = hard_state.commit.max(applied).min(last);
        // Term 0 is "never ran" to raft-rs, which then refuses a vote with term 0 and stops
        // (it requires a term on every vote answer): a new voter starts in term 1, as if a
        // term with no leader had passed.
        hard_state.term = hard_state.term.max(1);
        let member = voters_of(&conf).contains(&me);
        // A blank store learns first whether it is a voter (or the cluster is new).
        let blank = amnesiac && last == 0;
        let cache = Cache {
            hard_state,
            conf_state: conf,
            compacted,
            entries: entries.into(),
            applied: Some((state.clone(), applied_term)),
        };
        let node = Self::raw(me, nodes, limits, cache, applied)?;
        let mut log = Log {
            me,
            nodes,
            limits,
            following: (!member || blank).then(Following::default),
            lost_disk: amnesiac,
            held: BTreeMap::new(),
            node,
            state,
            applied_term,
            pending: BTreeMap::new(),
            reads: Reads {
                next_ctx: 1,
                inflight: None,
                waiting: Vec::new(),
                ready: BTreeMap::new(),
                count: 0,
            },
            actions: VecDeque::new(),
            rng: SplitMix64::new(seed ^ (me as u64).wrapping_mul(0x2545_F491_4F6C_DD1D)),
            ticks: 0,
            acked: BTreeMap::new(),
            acked_term: 0,
            eligible: true,
            halted: None,
            unsaved: None,
            written_applied: (applied, applied_term),
            timeout_drawn: false,
            timeout_set: 0,
            amnesia: (amnesiac && member && !blank).then_some(None),
            legacy: legacy.filter(|l| *l > 0),
            lost_nonce: 0,
            catch_up_term: 0,
            leaderless_ticks: 0,
        };
        log.lost_nonce = log.rng.next_u64();
        // Read requests are told apart from those of this voter's earlier lives (an answer to one
        // of those can still arrive).
        log.reads.next_ctx = log.rng.next_u64();
        log.draw_timeout();
        Ok(log)
    }

    /// Lower node numbers first: between logs as long, a voter votes only for a candidate of a
    /// priority at least its own, so the lowest live voter leads (the logical nodes before the
    /// spares), as operators expect of the coordinator.
    fn priority_of(me: u32, nodes: u32) -> i64 {
        i64::from(nodes - me)
    }

    fn raw(
        me: u32,
        nodes: u32,
        limits: Limits,
        cache: Cache<S>,
        applied: u64,
    ) -> Result<RawNode<Cache<S>>, StartError> {
        let cfg = raft::Config {
            id: raft_id(me),
            election_tick: limits.election_ticks,
            heartbeat_tick: limits.heartbeat_ticks,
            applied,
            max_size_per_msg: limits.max_msg_bytes,
            max_inflight_msgs: limits.max_inflight,
            check_quorum: true,
            pre_vote: true,
            read_only_option: ReadOnlyOption::Safe,
            priority: Self::priority_of(me, nodes),
            ..Default::default()
        };
        cfg.validate()
            .map_err(|e| StartError::Inconsistent(format!("raft configuration: {e}")))?;
        let logger = slog::Logger::root(ToTracing, slog::o!());
        RawNode::new(&cfg, cache, &logger).map_err(|e| StartError::Inconsistent(format!("raft: {e}")))
    }

    // ---- getters ----

    /// This voter's number.
    pub fn me(&self) -> u32 {
        self.me
    }
    /// The applied state.
    pub fn state(&self) -> &S {
        &self.state
    }
    /// The current term (a follower's: the latest a feed told).
    pub fn term(&self) -> u64 {
        match &self.following {
            Some(f) => f.term,
            None => self.node.raft.term,
        }
    }
    /// The leader of the current term, as far as this node knows.
    pub fn leader(&self) -> Option<u32> {
        match &self.following {
            Some(f) => f.leader,
            None => voter_of(self.node.raft.leader_id),
        }
    }
    /// Whether this node leads.
    pub fn is_leader(&self) -> bool {
        self.following.is_none() && self.node.raft.state == StateRole::Leader
    }
    /// Whether this node is a voter now (else a follower).
    pub fn is_voter(&self) -> bool {
        self.following.is_none()
    }
    /// The voters of the configuration applied here (both halves of a joint one), in order.
    pub fn voters(&self) -> Vec<u32> {
        voters_of(&self.node.store().conf_state)
    }
    /// The configuration applied here.
    pub fn conf(&self) -> &ConfState {
        &self.node.store().conf_state
    }
    /// Whether a change of voters is under way (a joint configuration, or one proposed and not
    /// applied yet).
    pub fn conf_changing(&self) -> bool {
        !self.conf().voters_outgoing.is_empty()
            || (self.is_leader() && self.node.raft.pending_conf_index > self.state.index())
    }
    /// A blank store that waits to learn whether the cluster is new (it may be one of its first
    /// voters: see [`Log::handle_fresh_cluster`]).
    pub fn awaiting_fresh(&self) -> bool {
        self.following.is_some()
            && self.lost_disk
            && self.node.store().last_index() == 0
            && self.voters().contains(&self.me)
    }
    /// Whether this voter leads and holds its lease: a majority (itself included) answered it
    /// in its term within the election timeout less a margin ([`Limits::lease_margin_ticks`]).
    /// A voter that heard its leader within the election timeout votes for no other (raft's
    /// check-quorum), so while this holds no other voter leads — if a message takes less than
    /// the margin. Job control drives only then.
    pub fn lease_held(&self) -> bool {
        self.lease_ticks_left() > 0
    }

    /// How many more ticks this voter's lease lasts if no voter answers again (0: it holds
    /// none; `u64::MAX` for a leader that is the only voter): the shortest of the majorities'
    /// (of both halves of a joint configuration), each its oldest answer's.
    pub fn lease_ticks_left(&self) -> u64 {
        if !self.is_leader() {
            return 0;
        }
        let conf = self.conf().clone();
        let mut left = u64::MAX;
        for half in [&conf.voters, &conf.voters_outgoing] {
            if half.is_empty() {
                continue;
            }
            left = left.min(self.lease_of(half));
        }
        left
    }

    /// The lease a majority of `voters` (raft ids) gives this leader.
    fn lease_of(&self, voters: &[u64]) -> u64 {
        let me = raft_id(self.me);
        let mine = voters.contains(&me);
        if voters.len() == 1 && mine {
            return u64::MAX;
        }
        if self.acked_term != self.term() {
            return 0;
        }
        let lease = (self.limits.election_ticks as u64).saturating_sub(self.limits.lease_margin_ticks());
        let mut left: Vec<u64> = voters
            .iter()
            .filter(|id| **id != me)
            .filter_map(|id| voter_of(*id).and_then(|v| self.acked.get(&v)))
            .map(|&t| lease.saturating_sub(self.ticks.saturating_sub(t)))
            .filter(|&l| l > 0)
            .collect();
        left.sort_unstable_by(|a, b| b.cmp(a));
        // This voter (if one) and the (majority − 1) that answered last.
        let others = (voters.len() / 2 + 1) - usize::from(mine);
        match others.checked_sub(1) {
            None => u64::MAX,
            Some(k) => left.get(k).copied().unwrap_or(0),
        }
    }

    /// The shell's clock ran `missed` ticks it did not deliver (its process stood still: a
    /// pause, a stall): the answers counted toward the lease are that much older, so a lease
    /// ends by the clock, not by the ticks delivered. Nothing else happens on them (a leader
    /// that stood still learns of a new term from the next message).
    pub fn handle_missed_ticks(&mut self, missed: u64) {
        self.ticks = self.ticks.saturating_add(missed);
    }

    /// Whether this voter campaigns (a candidate or pre-candidate) or leads.
    pub fn claims(&self) -> bool {
        self.following.is_none() && self.node.raft.state != StateRole::Follower
    }
    /// The commit index as this node knows it (a follower's: what it applied).
    pub fn commit(&self) -> u64 {
        match &self.following {
            Some(_) => self.state.index(),
            None => self.node.raft.raft_log.committed,
        }
    }
    /// The applied index.
    pub fn applied(&self) -> u64 {
        self.state.index()
    }
    /// The last index of the log here.
    pub fn last_index(&self) -> u64 {
        match &self.following {
            Some(_) => self.node.store().last_index(),
            None => self.node.raft.raft_log.last_index(),
        }
    }
    /// The first index still in the log here.
    pub fn first_index(&self) -> u64 {
        self.node.store().first_index()
    }
    /// The leader's view of voter `v`'s log: the index it is known to hold (leaders only).
    pub fn matched(&self, v: u32) -> Option<u64> {
        if !self.is_leader() {
            return None;
        }
        self.node.raft.prs().get(raft_id(v)).map(|p| p.matched)
    }
    /// Submissions waiting for their entry.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
    /// The index of a converted state no leader has confirmed yet.
    pub fn legacy(&self) -> Option<u64> {
        self.legacy
    }
    /// Whether this voter is catching up after losing its disk (it neither votes nor campaigns),
    /// or is a voter on a blank store that has not learnt yet how far to catch up.
    pub fn amnesiac(&self) -> bool {
        self.amnesia.is_some() || (self.following.is_some() && self.lost_disk && self.voters().contains(&self.me))
    }
    /// Whether this node's store was created in this life and it has not caught up since (as
    /// a voter, or as a follower through the leader's commit index): made a voter, it would
    /// catch up before it votes, so the leader does not choose it.
    pub fn lost_disk(&self) -> bool {
        self.lost_disk
    }
    /// Why the log stopped here, if it did.
    pub fn halted(&self) -> Option<&str> {
        self.halted.as_deref()
    }

    // ---- inputs ----

    /// Whether this voter may lead (a node whose disk failed may not). An ineligible voter never
    /// campaigns, and a leader that becomes ineligible hands its leadership to the voter with the
    /// longest log among those that answered recently.
    pub fn set_eligible(&mut self, eligible: bool) {
        self.eligible = eligible;
        if !eligible && self.is_leader() {
            self.hand_over();
        }
    }

    fn hand_over(&mut self) {
        let me = raft_id(self.me);
        let best = self
            .node
            .raft
            .prs()
            .iter()
            .filter(|(id, p)| **id != me && p.recent_active)
            .max_by_key(|(id, p)| (p.matched, std::cmp::Reverse(**id)))
            .map(|(id, _)| *id);
        if let Some(to) = best {
            self.node.transfer_leader(to);
        }
    }

    /// One tick of the shell's clock.
    pub fn handle_tick(&mut self) {
        if self.halted.is_some() {
            return;
        }
        self.ticks += 1;
        self.write_unsaved();
        self.release_held();
        if self.following.is_some() {
            self.follow_tick();
            return;
        }
        // A timeout raft drew itself since the last input (its generator is not seeded) is
        // replaced before it counts.
        self.draw_timeout();
        if (self.eligible && self.amnesia.is_none()) || self.is_leader() {
            self.node.tick();
        }
        if !self.eligible && self.is_leader() {
            self.hand_over();
        }
        // No leader for a few election timeouts: no priority either, until there is one.
        let priority = Self::priority_of(self.me, self.nodes);
        if self.node.raft.leader_id == 0 {
            self.leaderless_ticks += 1;
            let limit = LEADERLESS_TICKS_PER_ELECTION * self.limits.election_ticks as u64;
            if self.leaderless_ticks >= limit && self.node.raft.priority != 0 {
                tracing::info!(
                    voter = self.me,
                    "no metadata leader for a while: this voter drops its election priority"
                );
                self.node.raft.set_priority(0);
            }
        } else {
            self.leaderless_ticks = 0;
            if self.node.raft.priority != priority {
                self.node.raft.set_priority(priority);
            }
        }
        // A leader elected while the configuration was joint leaves it (raft-rs leaves only
        // when the leader that entered it applies the entry).
        if self.is_leader()
            && !self.conf().voters_outgoing.is_empty()
            && self.node.raft.pending_conf_index <= self.state.index()
        {
            let leave = ConfChangeV2::default();
            if let Err(e) = self.node.propose_conf_change(Vec::new(), leave) {
                tracing::debug!(voter = self.me, error = %e, "leaving the joint configuration refused");
            }
        }
        self.draw_timeout();
        // A read request lost with a message (or dropped by a leader that has not committed in
        // its term yet) is asked again.
        if let Some((ctx, _, sent)) = &self.reads.inflight {
            if self.ticks.saturating_sub(*sent) >= self.limits.read_retry_ticks {
                let ctx = *ctx;
                if let Some(r) = self.reads.inflight.as_mut() {
                    r.2 = self.ticks;
                }
                self.node.read_index(ctx.to_le_bytes().to_vec());
            }
        }
    }

    /// A follower's tick: asks for entries when no request is out (or one went unanswered too
    /// long: then another voter), and asks a lost read again.
    fn follow_tick(&mut self) {
        let limit = self.limits.follow_wait_ticks + self.limits.election_ticks as u64;
        let back_after = 8 * self.limits.follow_wait_ticks;
        let Some(f) = self.following.as_mut() else { return };
        if let Some((_, at)) = f.asked {
            if self.ticks.saturating_sub(at) >= limit {
                f.asked = None;
                f.next_turn(self.ticks);
            }
        }
        if f.turn != 0 && self.ticks.saturating_sub(f.turned_at) >= back_after {
            // The next request goes to the parent again.
            f.turn = 0;
        }
        let applied = self.state.index();
        match f.behind {
            Some((index, _)) if applied >= index => f.behind = None,
            Some((index, since)) if self.ticks.saturating_sub(since) >= self.limits.election_ticks as u64 => {
                tracing::debug!(
                    node = self.me,
                    applied,
                    index,
                    "the source of entries lags the leader: asking another"
                );
                f.asked = None;
                f.next_turn(self.ticks);
                f.behind = Some((index, self.ticks));
            }
            _ => {}
        }
        if f.asked.is_none() {
            self.ask_feed();
        }
        if let Some((ctx, _, sent)) = &self.reads.inflight {
            if self.ticks.saturating_sub(*sent) >= self.limits.read_retry_ticks {
                let ctx = *ctx;
                self.send_read_ctx(ctx);
            }
        }
        self.probe_lost_disk();
    }

    /// See [`Following::probe`].
    fn probe_lost_disk(&mut self) {
        let member = self.voters().contains(&self.me);
        let applied = self.state.index();
        let retry = self.limits.read_retry_ticks;
        let (ticks, leader) = (self.ticks, self.leader());
        let Some(f) = self.following.as_mut() else { return };
        if !self.lost_disk || member || applied == 0 {
            return;
        }
        if let Some(at) = f.clear_at {
            if applied >= at {
                tracing::info!(node = self.me, applied, "a follower caught up after a lost disk");
                self.lost_disk = false;
                f.clear_at = None;
                f.probe = None;
                // Written with the next write.
                self.persist(true, Vec::new(), None);
            }
            return;
        }
        let due = f.probe.is_none_or(|(_, at)| ticks.saturating_sub(at) >= retry);
        let Some(leader) = leader.filter(|_| due) else { return };
        let ctx = self.rng.next_u64();
        if let Some(f) = self.following.as_mut() {
            f.probe = Some((ctx, ticks));
        }
        self.ask_read_index(leader, ctx);
    }

    /// The node a follower asks for entries at turn `turn`: its parent in a tree of fan-out
    /// [`Limits::follow_fanout`] rooted at the voters (the nodes in order, voters first and the
    /// leader last among them: the
    /// node at position `p` past the voters pulls from the one at `(p - voters) / fanout`),
    /// then, turn after turn (one did not answer, or lagged), that parent's parent and so on up
    /// to a voter, then each voter in turn. So no node answers more than the fan-out
    /// followers, whatever the cluster's size.
    fn feed_source(&self, turn: u32) -> Option<u32> {
        // The leader (as this node knows it) last: it feeds followers only when the other
        // voters cannot take them all.
        let mut voters = self.voters();
        if let Some(i) = self.leader().and_then(|l| voters.iter().position(|v| *v == l)) {
            let l = voters.remove(i);
            voters.push(l);
        }
        let fanout = self.limits.follow_fanout.max(1) as usize;
        let order: Vec<u32> = voters
            .iter()
            .copied()
            .chain((0..self.nodes).filter(|n| !voters.contains(n)))
            .collect();
        let mut chain = Vec::new();
        if let Some(mut p) = order.iter().position(|n| *n == self.me) {
            while p >= voters.len() {
                p = (p - voters.len()) / fanout;
                chain.push(order[p]);
            }
        }
        if let Some(n) = chain.get(turn as usize) {
            return Some(*n);
        }
        let others: Vec<u32> = voters.iter().copied().filter(|v| *v != self.me).collect();
        if others.is_empty() {
            return None;
        }
        let t = turn as usize - chain.len()
            + chain
                .last()
                .and_then(|v| others.iter().position(|o| o == v))
                .unwrap_or(self.me as usize);
        Some(others[t % others.len()])
    }

    /// Asks the node [`Log::feed_source`] names for the entries after the applied index.
    fn ask_feed(&mut self) {
        let Some(f) = self.following.as_ref() else { return };
        let Some(to) = self.feed_source(f.turn) else {
            return;
        };
        let ticks = self.ticks;
        if let Some(f) = self.following.as_mut() {
            f.asked = Some((to, ticks));
        }
        let after = self.state.index();
        let term = self.term();
        self.actions.push_back(Action::Send {
            to,
            msg: Wire::Follow { after, term },
        });
    }

    /// Answers the held requests that can be (this node applied past them, or learnt of a
    /// new leadership), and those held long enough (empty: the follower asks again, and learns
    /// the leadership meanwhile).
    fn release_held(&mut self) {
        let applied = self.state.index();
        let wait = self.limits.follow_wait_ticks;
        let now = (self.term(), self.leader());
        let due: Vec<(u32, u64)> = self
            .held
            .iter()
            .filter(|(_, (after, at, known))| {
                *after < applied || self.ticks.saturating_sub(*at) >= wait || (now.1.is_some() && *known != now)
            })
            .map(|(n, (after, _, _))| (*n, *after))
            .collect();
        for (n, after) in due {
            self.held.remove(&n);
            let feed = self.feed_after(after);
            self.actions.push_back(Action::Send {
                to: n,
                msg: Wire::Feed(Box::new(feed)),
            });
        }
    }

    /// The committed entries after `after` this node can give (applied here), at most
    /// [`Limits::max_msg_bytes`] of them, or the applied state once they were compacted away.
    fn feed_after(&self, after: u64) -> Feed {
        let applied = self.state.index();
        let mut feed = Feed {
            applied,
            term: self.term(),
            leader: self.leader(),
            ..Feed::default()
        };
        if after >= applied {
            return feed;
        }
        let store = self.node.store();
        if after < store.compacted.0 {
            match store.snapshot(0, 0) {
                Ok(snap) => feed.snapshot = Some(snap),
                Err(e) => tracing::debug!(node = self.me, error = %e, "no snapshot for a follower yet"),
            }
            return feed;
        }
        match store.entries(
            after + 1,
            applied + 1,
            self.limits.max_msg_bytes,
            GetEntriesContext::empty(false),
        ) {
            Ok(entries) => feed.entries = entries,
            Err(e) => tracing::debug!(node = self.me, after, error = %e, "no entries for a follower"),
        }
        feed
    }

    /// A follower's request: answered now if this node applied past `after` or knows a newer
    /// leadership than the follower, else held.
    fn handle_follow(&mut self, from: u32, after: u64, term: u64) {
        let newer = term < self.term() && self.leader().is_some();
        if after < self.state.index() || newer {
            let feed = self.feed_after(after);
            self.actions.push_back(Action::Send {
                to: from,
                msg: Wire::Feed(Box::new(feed)),
            });
        } else {
            // One per node: a newer request replaces an older one.
            let known = (self.term(), self.leader());
            self.held.insert(from, (after, self.ticks, known));
        }
    }

    /// Entries (or a snapshot) pulled as a follower: applied and written like a voter's.
    fn handle_feed(&mut self, from: u32, feed: Feed) {
        let Some(f) = self.following.as_mut() else {
            return;
        };
        if f.asked.is_some_and(|(n, _)| n == from) {
            f.asked = None;
        }
        if feed.term >= f.term {
            f.term = feed.term;
            f.leader = feed.leader.filter(|l| *l < self.nodes);
        }
        let applied = self.state.index();
        let mut answers = Vec::new();
        if let Some(snap) = feed.snapshot {
            let meta = snap.get_metadata().clone();
            if meta.index > applied {
                let state = match S::decode(&snap.data) {
                    Ok(s) if s.index() == meta.index => s,
                    Ok(_) | Err(_) => {
                        tracing::warn!(
                            node = self.me,
                            from,
                            index = meta.index,
                            "a follower's snapshot does not decode: dropped"
                        );
                        return;
                    }
                };
                if voters_of(meta.get_conf_state()).iter().any(|v| *v >= self.nodes) {
                    tracing::warn!(
                        node = self.me,
                        from,
                        "a snapshot's voters are not among the nodes: dropped"
                    );
                    return;
                }
                self.install(state, meta.index, meta.term, &mut answers);
                let cache = self.node.mut_store();
                cache.conf_state = meta.get_conf_state().clone();
                cache.hard_state.commit = meta.index;
                self.rebuild_node();
                self.persist(true, Vec::new(), Some((meta.index, meta.term)));
            }
        } else {
            // The entries continuing this node's applied ones.
            let entries: Vec<Entry> = feed.entries.into_iter().filter(|e| e.index > applied).collect();
            let contiguous = entries
                .iter()
                .enumerate()
                .all(|(i, e)| e.index == applied + 1 + i as u64);
            if !entries.is_empty() && contiguous && entries.last().is_some_and(|e| e.index <= feed.applied) {
                let last = entries.last().map_or(applied, |e| e.index);
                let cache = self.node.mut_store();
                cache.append(&entries);
                cache.hard_state.commit = cache.hard_state.commit.max(last);
                self.apply(entries.clone(), last, &mut answers);
                if self.halted.is_some() {
                    return;
                }
                self.persist(false, entries, None);
            }
        }
        self.actions.extend(answers);
        self.answer_ready_reads();
        self.release_held();
        self.check_role();
        if let Some(f) = self.following.as_mut() {
            if f.asked.is_none() {
                self.ask_feed();
            }
        }
    }

    /// Becomes a follower when the configuration applied here leaves this node out, and a voter
    /// when it takes it in (a blank store: only once it learnt something, catching up first).
    fn check_role(&mut self) {
        let member = self.voters().contains(&self.me);
        match &self.following {
            None if !member => self.become_follower(0),
            Some(f) if member && self.state.index() >= f.not_voter_until && self.state.index() > 0 => {
                let lost = self.lost_disk;
                self.become_voter(lost);
            }
            _ => {}
        }
    }

    fn become_follower(&mut self, not_voter_until: u64) {
        tracing::info!(
            node = self.me,
            applied = self.state.index(),
            "not a voter of the metadata log: follows it"
        );
        let (leader, term) = (self.leader(), self.term());
        for (_, p) in std::mem::take(&mut self.pending) {
            self.actions.push_back(Action::Done {
                token: p.token,
                result: Err(SubmitError::Unknown),
            });
        }
        self.amnesia = None;
        self.following = Some(Following {
            leader,
            term,
            not_voter_until,
            ..Following::default()
        });
        // Reads ask the leader again, as a follower.
        if let Some((ctx, _, _)) = &self.reads.inflight {
            let ctx = *ctx;
            self.send_read_ctx(ctx);
        }
        self.ask_feed();
    }

    /// Starts raft here from the store as it is (a follower's entries are committed ones).
    fn become_voter(&mut self, lost_disk: bool) {
        tracing::info!(
            node = self.me,
            applied = self.state.index(),
            catching_up = lost_disk,
            "a voter of the metadata log"
        );
        self.following = None;
        self.rebuild_node();
        self.amnesia = lost_disk.then_some(None);
        self.lost_nonce = self.rng.next_u64();
        self.catch_up_term = 0;
        self.acked.clear();
        self.timeout_drawn = false;
        self.draw_timeout();
        // Reads go through raft now.
        if let Some((ctx, _, _)) = &self.reads.inflight {
            let ctx = *ctx;
            self.node.read_index(ctx.to_le_bytes().to_vec());
        }
        self.persist(true, Vec::new(), None);
    }

    /// A new raft node over a copy of the store as it is (its configuration, its entries, the
    /// applied state).
    fn rebuild_node(&mut self) {
        let old = self.node.store();
        let applied = self.state.index();
        let mut hard_state = old.hard_state.clone();
        hard_state.commit = hard_state.commit.max(applied).min(old.last_index().max(applied));
        let cache = Cache {
            hard_state,
            conf_state: old.conf_state.clone(),
            compacted: old.compacted,
            entries: old.entries.clone(),
            applied: Some((self.state.clone(), self.applied_term)),
        };
        match Self::raw(self.me, self.nodes, self.limits, cache, applied) {
            Ok(node) => self.node = node,
            Err(e) => self.halt(format!("cannot restart raft over the store: {e}")),
        }
    }

    /// A message from voter `from` (its authenticated identity). Messages that name another
    /// sender or receiver, or that raft refuses, are dropped.
    pub fn handle_message(&mut self, from: u32, msg: Wire) {
        if self.halted.is_some() || from >= self.nodes || from == self.me {
            return;
        }
        let mut msg = match msg {
            Wire::Raft(m) => *m,
            Wire::LostDisk { last_index, nonce } => return self.handle_lost_disk(from, last_index, nonce),
            Wire::CatchUpTo {
                nonce,
                last_index,
                term,
            } => return self.handle_catch_up_to(nonce, last_index, term),
            Wire::Follow { after, term } => return self.handle_follow(from, after, term),
            Wire::Feed(feed) => return self.handle_feed(from, *feed),
            Wire::NotVoter { applied } => {
                if self.following.is_none() && applied > self.state.index() {
                    tracing::info!(node = self.me, from, applied, "a voter says this node is not a voter");
                    self.become_follower(applied);
                }
                return;
            }
        };
        if msg.from != raft_id(from) || msg.to != raft_id(self.me) {
            tracing::warn!(from, "metadata log message naming another sender or receiver: dropped");
            return;
        }
        if let Some(f) = self.following.as_mut() {
            // A follower takes only the leader's answers to its reads.
            if msg.get_msg_type() == MessageType::MsgReadIndexResp {
                if msg.term >= f.term {
                    f.term = msg.term;
                    f.leader = Some(from);
                }
                if msg.index > self.state.index() && f.behind.is_none_or(|(i, _)| i < msg.index) {
                    let since = f.behind.map_or(self.ticks, |(_, t)| t);
                    f.behind = Some((msg.index, since));
                }
                let probe = f.probe.map(|(c, _)| c.to_le_bytes().to_vec());
                if probe.is_some() && msg.entries.first().map(|e| e.data.to_vec()) == probe {
                    f.clear_at = Some(msg.index);
                    f.probe = None;
                    self.probe_lost_disk();
                    return;
                }
                if let Some(ctx) = msg.entries.first().map(|e| e.data.to_vec()) {
                    let rs = raft::ReadState {
                        index: msg.index,
                        request_ctx: ctx,
                    };
                    self.answer_reads(vec![rs]);
                    self.answer_ready_reads();
                }
            }
            return;
        }
        // A node this voter's configuration leaves out gets no vote (one removed while it was
        // away could otherwise disrupt the voters), and is told; the rest goes to raft, which
        // counts only its configuration's voters (a leader this voter does not know as a voter
        // yet, because it lags, is followed).
        let vote = matches!(
            msg.get_msg_type(),
            MessageType::MsgRequestVote | MessageType::MsgRequestPreVote
        );
        if vote && !self.voters().contains(&from) {
            self.actions.push_back(Action::Send {
                to: from,
                msg: Wire::NotVoter {
                    applied: self.state.index(),
                },
            });
            return;
        }
        // An answer to this leader in its term renews its lease with that voter.
        let answer = matches!(
            msg.get_msg_type(),
            MessageType::MsgAppendResponse | MessageType::MsgHeartbeatResponse
        );
        if answer && self.is_leader() && msg.term == self.term() {
            if self.acked_term != self.term() {
                self.acked.clear();
                self.acked_term = self.term();
            }
            self.acked.insert(from, self.ticks);
        }
        // A leader that believes this voter holds more than it does (it lost its disk) would have
        // it commit entries it does not have: the commit is not taken, and the leader is told.
        let last = self.node.raft.raft_log.last_index();
        // A voter catching up after a lost disk learns how far it must catch up only from a
        // leader's answer to this life's LostDisk: an append or a snapshot may have been sent
        // before the disk was lost (the log simulator met a voter that left its catching up
        // without entries it had acknowledged, and was then elected).
        let from_leader = matches!(
            msg.get_msg_type(),
            MessageType::MsgHeartbeat | MessageType::MsgAppend | MessageType::MsgSnapshot
        );
        let told_below = msg.get_msg_type() == MessageType::MsgHeartbeat && msg.commit > last;
        let ask = match self.amnesia {
            Some(None) => true,
            // A leader of a later term may have a longer log than the one that answered.
            Some(Some(_)) => msg.term > self.catch_up_term,
            None => false,
        };
        if from_leader && ask && !told_below {
            self.actions.push_back(Action::Send {
                to: from,
                msg: Wire::LostDisk {
                    last_index: last,
                    nonce: self.lost_nonce,
                },
            });
        }
        // A leadership handed to a voter that may not lead is not taken: a transfer's campaign
        // ignores the other voters' leases.
        if msg.get_msg_type() == MessageType::MsgTimeoutNow && (self.amnesia.is_some() || !self.eligible) {
            tracing::info!(
                voter = self.me,
                from,
                "a leadership transfer to a voter that may not lead: refused"
            );
            return;
        }
        if told_below {
            if self.amnesia.is_none() {
                tracing::warn!(
                    voter = self.me,
                    from,
                    commit = msg.commit,
                    last,
                    "a leader believes this voter's log is longer than it is"
                );
            }
            msg.commit = self.node.raft.raft_log.committed;
            self.actions.push_back(Action::Send {
                to: from,
                msg: Wire::LostDisk {
                    last_index: last,
                    nonce: self.lost_nonce,
                },
            });
        }
        if let Some(l) = self.legacy {
            // A leader whose log below the converted state's index is not known to be that
            // state (that protocol committed on a majority, but a voter could hold a newer
            // state no majority had): the converted state may hold operations the leader's log
            // does not. It goes, and the voter starts over from the leader.
            let ours = msg.index == l && Some(msg.log_term) == self.node.store().entry_term(l);
            if msg.get_msg_type() == MessageType::MsgAppend && msg.index <= l && !ours {
                self.forget_legacy(from, l);
            }
        }
        if let Err(e) = self.node.step(msg) {
            tracing::debug!(from, error = %e, "metadata log message refused");
        }
        self.draw_timeout();
    }

    /// Drops the converted state (see [`Log::handle_message`]): an empty log and state, the same
    /// term and vote, and the leader told to start over with this voter.
    fn forget_legacy(&mut self, leader: u32, index: u64) {
        tracing::warn!(
            voter = self.me,
            leader,
            index,
            "the metadata converted from the store before the log may hold operations the leader's log does not: dropped, caught up from the leader"
        );
        self.legacy = None;
        let mut hard_state = self.node.store().hard_state.clone();
        hard_state.commit = 0;
        let cache = Cache {
            hard_state: hard_state.clone(),
            conf_state: self.node.store().conf_state.clone(),
            compacted: (0, 0),
            entries: VecDeque::new(),
            applied: Some((S::default(), 0)),
        };
        match Self::raw(self.me, self.nodes, self.limits, cache, 0) {
            Ok(node) => self.node = node,
            Err(e) => return self.halt(format!("cannot start over after dropping the converted metadata: {e}")),
        }
        self.state = S::default();
        self.applied_term = 0;
        for (_, p) in std::mem::take(&mut self.pending) {
            self.actions.push_back(Action::Done {
                token: p.token,
                result: Err(SubmitError::Unknown),
            });
        }
        let mut readers: Vec<T> = std::mem::take(&mut self.reads.waiting);
        if let Some((_, r, _)) = self.reads.inflight.take() {
            readers.extend(r);
        }
        for (_, r) in std::mem::take(&mut self.reads.ready) {
            readers.extend(r);
        }
        self.reads.count = 0;
        for t in readers {
            self.read_done(t, Err(ReadError::NoLeader));
        }
        self.unsaved = None;
        self.written_applied = (0, 0);
        self.actions.push_back(Action::Persist(Box::new(Persist {
            sync: true,
            hard_state,
            entries: Vec::new(),
            snapshot: Some((0, 0)),
            compact_to: None,
            applied: (0, 0),
            changes: self.state.all_changes(),
            amnesiac: self.lost_disk,
            legacy: None,
            conf: Some(self.conf().clone()),
        })));
        self.actions.push_back(Action::Send {
            to: leader,
            msg: Wire::LostDisk {
                last_index: 0,
                nonce: self.lost_nonce,
            },
        });
        self.timeout_drawn = false;
        self.draw_timeout();
    }

    /// Voter `from` lost its disk: as its leader, start over with it from where its log ends,
    /// and tell it where this log ends now (it must catch up that far before it votes).
    fn handle_lost_disk(&mut self, from: u32, last_index: u64, nonce: u64) {
        if !self.is_leader() {
            return;
        }
        self.actions.push_back(Action::Send {
            to: from,
            msg: Wire::CatchUpTo {
                nonce,
                last_index: self.node.raft.raft_log.last_index(),
                term: self.term(),
            },
        });
        if let Some(pr) = self.node.raft.mut_prs().get_mut(raft_id(from)) {
            if pr.matched > last_index {
                tracing::info!(
                    voter = self.me,
                    from,
                    matched = pr.matched,
                    last_index,
                    "a voter lost its disk: replicating to it from its end"
                );
                pr.matched = last_index;
                pr.become_probe();
            }
        }
    }

    /// A leader's answer to this life's LostDisk: catch up at least to `last_index` before
    /// voting again.
    fn handle_catch_up_to(&mut self, nonce: u64, last_index: u64, term: u64) {
        if nonce != self.lost_nonce || self.amnesia.is_none() || term < self.catch_up_term {
            return;
        }
        let target = self.amnesia.flatten().unwrap_or(0).max(last_index);
        self.amnesia = Some(Some(target));
        self.catch_up_term = term;
        // Caught up already: the next write says so.
        self.persist(false, Vec::new(), None);
    }

    /// Campaigns now (with a pre-vote first) instead of waiting out the election timeout: the
    /// shell's hint that no leader is known and this voter is the one that should lead. Harmless
    /// when wrong: the pre-vote fails while a leader holds a majority.
    pub fn campaign(&mut self) {
        if self.halted.is_some()
            || self.following.is_some()
            || !self.eligible
            || self.amnesia.is_some()
            || self.is_leader()
        {
            return;
        }
        if let Err(e) = self.node.campaign() {
            tracing::debug!(voter = self.me, error = %e, "campaign refused");
        }
        self.draw_timeout();
    }

    /// The shell learnt that enough other voters never held a log entry that nothing can have been
    /// committed, so a voter whose store was created in this life (amnesiac until proven
    /// otherwise) lost nothing and may vote.
    pub fn handle_fresh_cluster(&mut self) {
        if self.amnesia == Some(None) && self.node.raft.raft_log.last_index() == 0 {
            tracing::info!(
                voter = self.me,
                "the cluster is new: this voter takes part in elections"
            );
            self.amnesia = None;
            self.lost_disk = false;
        }
        if self.awaiting_fresh() && self.state.index() == 0 {
            tracing::info!(
                node = self.me,
                "the cluster is new: this node is one of its first voters"
            );
            self.lost_disk = false;
            self.become_voter(false);
        }
    }

    /// A message to node `to` could not be delivered (its link is down): the leader probes it
    /// again instead of streaming to it; a follower asks another voter.
    pub fn handle_unreachable(&mut self, to: u32) {
        if to >= self.nodes || to == self.me {
            return;
        }
        if let Some(f) = self.following.as_mut() {
            if f.asked.is_some_and(|(n, _)| n == to) {
                f.asked = None;
                f.next_turn(self.ticks);
            }
            return;
        }
        self.node.report_unreachable(raft_id(to));
    }

    /// A snapshot was sent to node `to` (whether it arrives or not: a voter that did not install
    /// it rejects the next append, and is sent one again).
    pub fn handle_snapshot_sent(&mut self, to: u32) {
        if to < self.nodes && to != self.me && self.following.is_none() {
            self.node.report_snapshot(raft_id(to), raft::SnapshotStatus::Finish);
        }
    }

    /// Leader only: proposes `voters` as the log's voters (one `ConfChangeV2`: joint consensus
    /// when more than one voter changes, left by itself once applied). The leader stays one.
    pub fn propose_voters(&mut self, voters: &[u32]) -> Result<(), ConfError> {
        if !self.is_leader() || self.halted.is_some() {
            return Err(ConfError::NotLeader);
        }
        if self.conf_changing() {
            return Err(ConfError::Pending);
        }
        if voters.is_empty() || voters.iter().any(|v| *v >= self.nodes) {
            return Err(ConfError::Invalid);
        }
        if !voters.contains(&self.me) {
            return Err(ConfError::DropsLeader);
        }
        let now = self.voters();
        let mut changes = Vec::new();
        for v in voters.iter().filter(|v| !now.contains(v)) {
            let mut c = ConfChangeSingle::default();
            c.set_change_type(ConfChangeType::AddNode);
            c.node_id = raft_id(*v);
            changes.push(c);
        }
        for v in now.iter().filter(|v| !voters.contains(v)) {
            let mut c = ConfChangeSingle::default();
            c.set_change_type(ConfChangeType::RemoveNode);
            c.node_id = raft_id(*v);
            changes.push(c);
        }
        if changes.is_empty() {
            return Ok(());
        }
        tracing::info!(voter = self.me, from = ?now, to = ?voters, "changing the metadata log's voters");
        let mut cc = ConfChangeV2::default();
        cc.set_transition(ConfChangeTransition::Auto);
        cc.set_changes(changes.into());
        self.node
            .propose_conf_change(Vec::new(), cc)
            .map_err(|_| ConfError::Pending)
    }

    /// Proposes `op`; answered with [`Action::Done`].
    pub fn submit(&mut self, token: T, op: &S::Op) {
        if self.halted.is_some() {
            return self.done(token, Err(SubmitError::Halted));
        }
        if !self.is_leader() || self.node.raft.lead_transferee.is_some() {
            return self.done(token, Err(SubmitError::NotLeader { leader: self.leader() }));
        }
        if self.pending.len() >= self.limits.max_pending {
            return self.done(token, Err(SubmitError::Busy));
        }
        let mut data = vec![ENTRY_FORMAT];
        match postcard::to_extend(op, data) {
            Ok(d) => data = d,
            Err(e) => {
                tracing::error!(error = %e, ?op, "a metadata operation does not serialize");
                return self.done(token, Err(SubmitError::Busy));
            }
        }
        let before = self.node.raft.raft_log.last_index();
        match self.node.propose(Vec::new(), data) {
            Ok(()) => {
                let index = self.node.raft.raft_log.last_index();
                assert_eq!(index, before + 1, "a proposal is one entry");
                let term = self.node.raft.term;
                self.pending.insert(index, Pending { term, token });
            }
            Err(_) => self.done(token, Err(SubmitError::NotLeader { leader: self.leader() })),
        }
    }

    /// Asks to serve a read; answered with [`Action::Read`] once this node applied up to the
    /// leader's commit index.
    pub fn read(&mut self, token: T) {
        if self.halted.is_some() {
            return self.read_done(token, Err(ReadError::Halted));
        }
        if self.leader().is_none() {
            return self.read_done(token, Err(ReadError::NoLeader));
        }
        if self.reads.count >= self.limits.max_reads {
            return self.read_done(token, Err(ReadError::Busy));
        }
        self.reads.count += 1;
        if self.reads.inflight.is_some() {
            self.reads.waiting.push(token);
        } else {
            self.send_read(vec![token]);
        }
    }

    fn send_read(&mut self, tokens: Vec<T>) {
        let ctx = self.reads.next_ctx;
        self.reads.next_ctx = self.reads.next_ctx.wrapping_add(1);
        self.reads.inflight = Some((ctx, tokens, self.ticks));
        if self.following.is_some() {
            self.send_read_ctx(ctx);
        } else {
            self.node.read_index(ctx.to_le_bytes().to_vec());
        }
    }

    /// Asks `leader` for its read index under context `ctx` (raft's `MsgReadIndex`, which a
    /// leader answers to any node).
    fn ask_read_index(&mut self, leader: u32, ctx: u64) {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgReadIndex);
        m.from = raft_id(self.me);
        m.to = raft_id(leader);
        m.entries = vec![Entry {
            data: ctx.to_le_bytes().to_vec().into(),
            ..Default::default()
        }]
        .into();
        self.actions.push_back(Action::Send {
            to: leader,
            msg: Wire::Raft(Box::new(m)),
        });
    }

    /// A follower asks the leader it knows for its read index.
    fn send_read_ctx(&mut self, ctx: u64) {
        if let Some(r) = self.reads.inflight.as_mut() {
            r.2 = self.ticks;
        }
        let Some(leader) = self.leader() else { return };
        self.ask_read_index(leader, ctx);
    }

    // ---- outputs ----

    /// The next action, if any.
    pub fn poll_action(&mut self) -> Option<Action<S, T>> {
        if self.actions.is_empty() && self.halted.is_none() {
            if self.following.is_none() {
                self.process();
                self.release_held();
                self.check_role();
            } else if self.reads.inflight.is_none() && !self.reads.waiting.is_empty() {
                // The readers that waited for a follower's request just answered share the
                // next one (a voter asks it in `process`).
                let waiting = std::mem::take(&mut self.reads.waiting);
                self.send_read(waiting);
            }
        }
        self.actions.pop_front()
    }

    fn done(&mut self, token: T, result: Result<u64, SubmitError<S::Error>>) {
        self.actions.push_back(Action::Done { token, result });
    }

    fn read_done(&mut self, token: T, result: Result<u64, ReadError>) {
        self.actions.push_back(Action::Read { token, result });
    }

    /// Draws a fresh election timeout after raft reset its count (its own is not seeded): when
    /// the count went back to 0, or when raft's timeout is no longer the one drawn here (a
    /// second reset before any tick, which raft redrew from its unseeded generator).
    fn draw_timeout(&mut self) {
        let redrawn = self.node.raft.randomized_election_timeout() != self.timeout_set;
        if self.node.raft.election_elapsed == 0 {
            if !self.timeout_drawn || redrawn {
                let e = self.limits.election_ticks;
                let t = e + (self.rng.next_u64() % e as u64) as usize;
                self.node.raft.set_randomized_election_timeout(t);
                self.timeout_set = t;
                self.timeout_drawn = true;
            }
        } else {
            self.timeout_drawn = false;
        }
    }

    fn halt(&mut self, reason: String) {
        tracing::error!(voter = self.me, %reason, "the metadata log stops");
        self.halted = Some(reason.clone());
        self.actions.push_back(Action::Halt { reason });
        for (_, p) in std::mem::take(&mut self.pending) {
            self.actions.push_back(Action::Done {
                token: p.token,
                result: Err(SubmitError::Halted),
            });
        }
        let mut readers: Vec<T> = std::mem::take(&mut self.reads.waiting);
        if let Some((_, r, _)) = self.reads.inflight.take() {
            readers.extend(r);
        }
        for (_, r) in std::mem::take(&mut self.reads.ready) {
            readers.extend(r);
        }
        for t in readers {
            self.actions.push_back(Action::Read {
                token: t,
                result: Err(ReadError::Halted),
            });
        }
        self.reads.count = 0;
    }

    /// Turns raft's readiness into actions: sends, one durable write, answers.
    fn process(&mut self) {
        while self.halted.is_none() && self.node.has_ready() {
            let mut answers = Vec::new();
            let mut rd = self.node.ready();
            for m in rd.take_messages() {
                self.send(m);
            }
            let mut snapshot = None;
            if !rd.snapshot().is_empty() {
                let meta: SnapshotMetadata = rd.snapshot().get_metadata().clone();
                match S::decode(&rd.snapshot().data) {
                    Ok(state) => {
                        assert_eq!(state.index(), meta.index, "a snapshot's state is at its index");
                        self.install(state, meta.index, meta.term, &mut answers);
                        // raft restored its tracker from the snapshot's configuration.
                        self.node.mut_store().conf_state = meta.get_conf_state().clone();
                        snapshot = Some((meta.index, meta.term));
                    }
                    Err(e) => {
                        self.halt(format!("a snapshot at index {} does not decode: {e}", meta.index));
                        return;
                    }
                }
            }
            let committed = rd.take_committed_entries();
            let bound = self.node.raft.raft_log.committed;
            self.apply(committed, bound, &mut answers);
            if self.halted.is_some() {
                return;
            }
            // Entries committed before this ready are on a quorum's disks: their submitters
            // hear now, not after this ready's own write (unless a snapshot replaced the log,
            // which is written first).
            if snapshot.is_none() {
                self.actions.extend(answers.drain(..));
            }
            let sync = rd.must_sync() || !rd.entries().is_empty() || snapshot.is_some();
            {
                let cache = self.node.mut_store();
                cache.append(rd.entries());
                if let Some(hs) = rd.hs() {
                    cache.hard_state = hs.clone();
                }
            }
            let entries = rd.take_entries();
            let persisted = rd.take_persisted_messages();
            self.persist(sync, entries, snapshot);
            for m in persisted {
                self.send(m);
            }
            self.answer_reads(rd.take_read_states());
            let mut light = self.node.advance_append(rd);
            if let Some(c) = light.commit_index() {
                self.node.mut_store().hard_state.commit = c;
            }
            for m in light.take_messages() {
                self.send(m);
            }
            let committed = light.take_committed_entries();
            if !committed.is_empty() {
                let bound = self.node.raft.raft_log.committed;
                self.apply(committed, bound, &mut answers);
                if self.halted.is_some() {
                    return;
                }
                self.persist(false, Vec::new(), None);
            }
            self.node.advance_apply_to(self.state.index());
            self.actions.extend(answers);
            self.answer_ready_reads();
            // The readers that waited for the request just answered share the next one (asked
            // only now: raft takes no input between a ready and its advance).
            if self.reads.inflight.is_none() && !self.reads.waiting.is_empty() {
                let waiting = std::mem::take(&mut self.reads.waiting);
                self.send_read(waiting);
            }
        }
    }

    fn send(&mut self, msg: Message) {
        let Some(to) = voter_of(msg.to).filter(|v| *v < self.nodes) else {
            return;
        };
        let vote = matches!(
            msg.get_msg_type(),
            MessageType::MsgRequestVoteResponse | MessageType::MsgRequestPreVoteResponse
        );
        if vote && !msg.reject && self.amnesia.is_some() {
            tracing::debug!(voter = self.me, to, "catching up after a lost disk: vote withheld");
            return;
        }
        self.actions.push_back(Action::Send {
            to,
            msg: Wire::Raft(Box::new(msg)),
        });
    }

    /// The state was replaced by a snapshot at `index`.
    fn install(&mut self, state: S, index: u64, term: u64, answers: &mut Vec<Action<S, T>>) {
        assert!(index >= self.state.index(), "a snapshot never takes the state back");
        self.state = state;
        self.applied_term = term;
        let cache = self.node.mut_store();
        cache.entries.clear();
        cache.compacted = (index, term);
        cache.hard_state.commit = cache.hard_state.commit.max(index);
        // Proposals at or below it: their fate is unknown here.
        let later = self.pending.split_off(&(index + 1));
        for (_, p) in std::mem::replace(&mut self.pending, later) {
            answers.push(Action::Done {
                token: p.token,
                result: Err(SubmitError::Unknown),
            });
        }
    }

    /// Applies committed entries in order (`committed`: the commit index they are under).
    fn apply(&mut self, entries: Vec<Entry>, committed: u64, answers: &mut Vec<Action<S, T>>) {
        for e in entries {
            if e.index <= self.state.index() {
                continue;
            }
            assert_eq!(e.index, self.state.index() + 1, "entries are applied in order");
            assert!(e.index <= committed, "only committed entries are applied");
            let result = match e.get_entry_type() {
                EntryType::EntryConfChange | EntryType::EntryConfChangeV2 => {
                    if let Err(why) = self.apply_conf(&e) {
                        self.halt(format!("entry {} (term {}): {why}", e.index, e.term));
                        return;
                    }
                    self.state.skip(e.index);
                    None
                }
                EntryType::EntryNormal if e.data.is_empty() => {
                    self.state.skip(e.index);
                    None
                }
                EntryType::EntryNormal => match decode_op::<S::Op>(&e.data) {
                    Ok(op) => Some(self.state.apply(e.index, &op)),
                    Err(why) => {
                        self.halt(format!("entry {} (term {}) does not decode: {why}", e.index, e.term));
                        return;
                    }
                },
            };
            assert_eq!(
                self.state.index(),
                e.index,
                "applying entry {} moved the index to it",
                e.index
            );
            self.applied_term = e.term;
            // This node's proposal at this index, if its term is this entry's.
            if let Some(p) = self.pending.remove(&e.index) {
                let result = match result {
                    _ if p.term != e.term => Err(SubmitError::Dropped),
                    Some(Ok(())) => Ok(e.index),
                    Some(Err(err)) => Err(SubmitError::Rejected(err)),
                    None => Err(SubmitError::Dropped),
                };
                answers.push(Action::Done { token: p.token, result });
            }
            // Proposals after it from an older term can no longer commit (terms only grow along
            // the log).
            let stale: Vec<u64> = self
                .pending
                .range(e.index..)
                .filter(|(_, p)| p.term < e.term)
                .map(|(i, _)| *i)
                .collect();
            for i in stale {
                if let Some(p) = self.pending.remove(&i) {
                    answers.push(Action::Done {
                        token: p.token,
                        result: Err(SubmitError::Dropped),
                    });
                }
            }
        }
    }

    /// Applies a configuration change entry (raft's own tracker, on a follower too).
    fn apply_conf(&mut self, e: &Entry) -> Result<(), String> {
        use protobuf::Message as _;
        let cs = if e.get_entry_type() == EntryType::EntryConfChange {
            let cc = ConfChange::parse_from_bytes(&e.data)
                .map_err(|x| format!("a configuration change does not decode: {x}"))?;
            self.node.apply_conf_change(&cc)
        } else {
            let cc = ConfChangeV2::parse_from_bytes(&e.data)
                .map_err(|x| format!("a configuration change does not decode: {x}"))?;
            self.node.apply_conf_change(&cc)
        }
        .map_err(|x| format!("the configuration change does not apply: {x}"))?;
        if voters_of(&cs).iter().any(|v| *v >= self.nodes) || voters_of(&cs).is_empty() {
            return Err(format!(
                "the configuration {cs:?} names nodes beyond the {}",
                self.nodes
            ));
        }
        tracing::info!(node = self.me, index = e.index, voters = ?voters_of(&cs), joint = !cs.voters_outgoing.is_empty(), "metadata log voters");
        self.node.mut_store().conf_state = cs;
        Ok(())
    }

    fn persist(&mut self, mut sync: bool, entries: Vec<Entry>, snapshot: Option<(u64, u64)>) {
        let applied = (self.state.index(), self.applied_term);
        // A leader's log matched this voter's past the converted state (or replaced it).
        if let Some(l) = self.legacy {
            if snapshot.is_some() || self.node.raft.raft_log.committed > l {
                tracing::info!(
                    voter = self.me,
                    index = l,
                    "the converted metadata is confirmed by a leader"
                );
                self.legacy = None;
                sync = true;
            }
        }
        if let Some(Some(target)) = self.amnesia {
            if self.node.raft.raft_log.committed >= target {
                tracing::info!(
                    voter = self.me,
                    index = target,
                    "caught up after a lost disk: votes again"
                );
                self.amnesia = None;
                self.lost_disk = false;
                sync = true;
            }
        }
        let conf = self.conf().clone();
        let changes = if snapshot.is_some() {
            let _ = self.state.take_changes();
            self.state.all_changes()
        } else {
            self.state.take_changes()
        };
        let mut compact_to = None;
        let first = self.node.store().first_index();
        if applied.0 >= first && applied.0 - first + 1 > self.limits.compact_after {
            let to = applied.0.saturating_sub(self.limits.keep_behind);
            if to >= first {
                if let Some(term) = self.node.store().entry_term(to) {
                    self.node.mut_store().compact(to, term);
                    compact_to = Some((to, term));
                }
            }
        }
        let cache = self.node.mut_store();
        cache.hard_state.commit = cache.hard_state.commit.max(applied.0);
        cache.applied = Some((self.state.clone(), applied.1));
        let hard_state = cache.hard_state.clone();
        let mut p = Box::new(Persist {
            sync,
            hard_state,
            entries,
            snapshot,
            compact_to,
            applied,
            changes: S::Changes::default(),
            amnesiac: self.lost_disk,
            legacy: self.legacy,
            conf: None,
        });
        if p.snapshot.is_some() {
            // A snapshot replaces every key: what waited is in it.
            self.unsaved = None;
            p.changes = changes;
            p.conf = Some(conf);
            self.written_applied = p.applied;
            self.actions.push_back(Action::Persist(p));
            return;
        }
        // What this ready applied joins what waits to be written.
        let u = match self.unsaved.take() {
            Some(mut u) => {
                S::merge_changes(&mut u.changes, changes);
                u.applied = applied;
                u.compact_to = compact_to.or(u.compact_to);
                u.conf = conf;
                u
            }
            None => Unsaved {
                changes,
                applied,
                compact_to,
                conf,
            },
        };
        if !p.sync && p.entries.is_empty() {
            // Only the applied state moved: written at the next tick.
            self.unsaved = Some(u);
            return;
        }
        // A write that must reach the disk now (entries, votes): the applied changes go with it
        // only when a compaction is due (the entries it drops must be applied in the same
        // transaction) or too many wait; otherwise it writes the log alone.
        if u.compact_to.is_some() || u.applied.0 - self.written_applied.0 > MAX_UNSAVED_ENTRIES {
            p.changes = u.changes;
            p.applied = u.applied;
            p.compact_to = u.compact_to;
            p.conf = Some(u.conf);
            self.written_applied = u.applied;
        } else {
            p.applied = self.written_applied;
            p.compact_to = None;
            self.unsaved = Some(u);
        }
        self.actions.push_back(Action::Persist(p));
    }

    /// Writes the applied changes that wait (at a tick).
    fn write_unsaved(&mut self) {
        let Some(u) = self.unsaved.take() else {
            return;
        };
        self.written_applied = u.applied;
        let hard_state = self.node.store().hard_state.clone();
        self.actions.push_back(Action::Persist(Box::new(Persist {
            sync: false,
            hard_state,
            entries: Vec::new(),
            snapshot: None,
            compact_to: u.compact_to,
            applied: u.applied,
            changes: u.changes,
            amnesiac: self.lost_disk,
            legacy: self.legacy,
            conf: Some(u.conf),
        })));
    }

    fn answer_reads(&mut self, states: Vec<raft::ReadState>) {
        for rs in states {
            let Ok(ctx) = <[u8; 8]>::try_from(rs.request_ctx.as_slice()) else {
                continue;
            };
            let ctx = u64::from_le_bytes(ctx);
            if self.reads.inflight.as_ref().is_some_and(|r| r.0 == ctx) {
                if let Some((_, tokens, _)) = self.reads.inflight.take() {
                    self.reads.ready.entry(rs.index).or_default().extend(tokens);
                }
            }
        }
    }

    fn answer_ready_reads(&mut self) {
        let applied = self.state.index();
        let later = self.reads.ready.split_off(&(applied + 1));
        for (index, tokens) in std::mem::replace(&mut self.reads.ready, later) {
            for t in tokens {
                self.reads.count -= 1;
                self.read_done(t, Ok(index));
            }
        }
    }
}

/// An entry's operation.
pub fn decode_op<Op: DeserializeOwned>(data: &[u8]) -> Result<Op, String> {
    match data.split_first() {
        Some((&ENTRY_FORMAT, rest)) => postcard::from_bytes(rest).map_err(|e| e.to_string()),
        Some((v, _)) => Err(format!(
            "log entry of format {v}, and this build reads format {ENTRY_FORMAT} (written by a newer psls-node: run that build, or a newer one)"
        )),
        None => Err("empty entry".into()),
    }
}

/// The little-endian u64 at `at` in `b` (its length checked by the caller).
fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        x.copy_from_slice(s);
    }
    u64::from_le_bytes(x)
}

/// Whether `msg` carries a snapshot (its data can be large: the shell sends it apart).
pub fn is_snapshot(msg: &Wire) -> bool {
    msg.snapshot().is_some()
}

/// Largest encoded message accepted from a peer (snapshots travel apart, in chunks).
pub const MAX_WIRE_BYTES: usize = 4 << 20;

/// A message as bytes: `[0][protobuf raft message]`, `[1][last index][nonce]` (u64 LE each; an
/// earlier build sent `[1][last index]`), `[2][nonce][last index][term]`, `[3][after]`,
/// `[4][applied][term][leader + 1, 0: none][snapshot length u32 LE, 0: none][protobuf
/// snapshot][entries u32 LE]([length u32 LE][protobuf entry])*` or `[5][applied]`.
pub fn encode_wire(w: &Wire) -> Vec<u8> {
    use protobuf::Message as _;
    match w {
        Wire::Raft(m) => {
            let mut out = vec![0u8];
            // Writing a message built here into a vector does not fail.
            if let Err(e) = m.write_to_vec(&mut out) {
                tracing::error!(error = %e, "a raft message does not encode");
            }
            out
        }
        Wire::LostDisk { last_index, nonce } => {
            let mut out = vec![1u8];
            out.extend(last_index.to_le_bytes());
            out.extend(nonce.to_le_bytes());
            out
        }
        Wire::CatchUpTo {
            nonce,
            last_index,
            term,
        } => {
            let mut out = vec![2u8];
            out.extend(nonce.to_le_bytes());
            out.extend(last_index.to_le_bytes());
            out.extend(term.to_le_bytes());
            out
        }
        Wire::Follow { after, term } => {
            let mut out = vec![3u8];
            out.extend(after.to_le_bytes());
            out.extend(term.to_le_bytes());
            out
        }
        Wire::Feed(f) => {
            let mut out = vec![4u8];
            out.extend(f.applied.to_le_bytes());
            out.extend(f.term.to_le_bytes());
            out.extend(f.leader.map_or(0, |l| l as u64 + 1).to_le_bytes());
            let put = |out: &mut Vec<u8>, m: &dyn protobuf::Message| {
                let at = out.len();
                out.extend([0u8; 4]);
                // Writing a message built here into a vector does not fail.
                if let Err(e) = m.write_to_vec(out) {
                    tracing::error!(error = %e, "a metadata feed does not encode");
                }
                let len = (out.len() - at - 4) as u32;
                out[at..at + 4].copy_from_slice(&len.to_le_bytes());
            };
            match &f.snapshot {
                Some(snap) => put(&mut out, snap),
                None => out.extend(0u32.to_le_bytes()),
            }
            out.extend((f.entries.len() as u32).to_le_bytes());
            for e in &f.entries {
                put(&mut out, e);
            }
            out
        }
        Wire::NotVoter { applied } => {
            let mut out = vec![5u8];
            out.extend(applied.to_le_bytes());
            out
        }
    }
}

/// Reads a feed's body (after its tag).
fn decode_feed(b: &[u8]) -> Result<Feed, String> {
    use protobuf::Message as _;
    let short = || "a metadata feed is cut short".to_string();
    let mut at = 0usize;
    let u64_at = |at: &mut usize| -> Result<u64, String> {
        let v = b.get(*at..*at + 8).ok_or_else(short)?;
        *at += 8;
        Ok(le_u64(v, 0))
    };
    let applied = u64_at(&mut at)?;
    let term = u64_at(&mut at)?;
    let leader = match u64_at(&mut at)? {
        0 => None,
        l => Some(u32::try_from(l - 1).map_err(|_| "a metadata feed names no node".to_string())?),
    };
    let chunk = |at: &mut usize| -> Result<&[u8], String> {
        let len = b.get(*at..*at + 4).ok_or_else(short)?;
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let body = b.get(*at + 4..*at + 4 + len).ok_or_else(short)?;
        *at += 4 + len;
        Ok(body)
    };
    let snap = chunk(&mut at)?;
    let snapshot = if snap.is_empty() {
        None
    } else {
        Some(Snapshot::parse_from_bytes(snap).map_err(|e| e.to_string())?)
    };
    let n = b.get(at..at + 4).ok_or_else(short)?;
    let n = u32::from_le_bytes([n[0], n[1], n[2], n[3]]) as usize;
    at += 4;
    // Each entry takes at least its 4-byte length: a count beyond the bytes is refused before
    // anything is allocated for it.
    if n > b.len().saturating_sub(at) / 4 {
        return Err(short());
    }
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        entries.push(Entry::parse_from_bytes(chunk(&mut at)?).map_err(|e| e.to_string())?);
    }
    if at != b.len() {
        return Err("a metadata feed has bytes after its entries".into());
    }
    Ok(Feed {
        entries,
        snapshot,
        applied,
        term,
        leader,
    })
}

/// A message from its bytes (from an authenticated peer; bounded in size, since protobuf 2
/// parses nested messages recursively).
pub fn decode_wire(b: &[u8]) -> Result<Wire, String> {
    use protobuf::Message as _;
    if b.len() > MAX_WIRE_BYTES {
        return Err(format!(
            "a metadata log message of {} bytes exceeds {MAX_WIRE_BYTES}",
            b.len()
        ));
    }
    match b.split_first() {
        Some((0, rest)) => Message::parse_from_bytes(rest)
            .map(|m| Wire::Raft(Box::new(m)))
            .map_err(|e| e.to_string()),
        // An earlier build's (8 bytes, no nonce: never matched by a CatchUpTo).
        Some((1, rest)) if rest.len() == 8 => Ok(Wire::LostDisk {
            last_index: le_u64(rest, 0),
            nonce: 0,
        }),
        Some((1, rest)) if rest.len() == 16 => Ok(Wire::LostDisk {
            last_index: le_u64(rest, 0),
            nonce: le_u64(rest, 8),
        }),
        Some((1, _)) => Err("a lost-disk message is 8 or 16 bytes".to_string()),
        Some((2, rest)) if rest.len() == 24 => Ok(Wire::CatchUpTo {
            nonce: le_u64(rest, 0),
            last_index: le_u64(rest, 8),
            term: le_u64(rest, 16),
        }),
        Some((2, _)) => Err("a catch-up message is 24 bytes".to_string()),
        Some((3, rest)) if rest.len() == 16 => Ok(Wire::Follow {
            after: le_u64(rest, 0),
            term: le_u64(rest, 8),
        }),
        Some((3, _)) => Err("a follow message is 16 bytes".to_string()),
        Some((4, rest)) => decode_feed(rest).map(|f| Wire::Feed(Box::new(f))),
        Some((5, rest)) if rest.len() == 8 => Ok(Wire::NotVoter {
            applied: le_u64(rest, 0),
        }),
        Some((5, _)) => Err("a not-a-voter message is 8 bytes".to_string()),
        Some((t, _)) => Err(format!("unknown metadata log message type {t}")),
        None => Err("empty metadata log message".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry a newer build wrote is refused with one line naming both formats.
    #[test]
    fn an_entry_of_a_newer_format_is_refused_naming_both() {
        let e = decode_op::<u32>(&[ENTRY_FORMAT + 1, 0]).unwrap_err();
        assert!(
            e.contains(&format!("of format {}", ENTRY_FORMAT + 1))
                && e.contains(&format!("reads format {ENTRY_FORMAT}")),
            "{e}"
        );
        assert_eq!(decode_op::<u32>(&[ENTRY_FORMAT, 5]), Ok(5));
    }
}
