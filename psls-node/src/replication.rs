//! The door to the metadata log ([`Replication`], held by the node): deliver a peer's log
//! message, submit an operation, read at the committed index, look at the log's state
//! ([`Status`], published by the task after every batch). The task that owns the log is
//! `log_task.rs`'s.
//!
//! Bounds: at most [`MAX_INPUTS`] inputs wait; a log message arriving on a full queue is
//! dropped (raft retries).

use crate::failstop::Locked;
use psls_cluster::log::{ReadError, SubmitError, Wire};
use psls_pfs::logstore::{LogStore, Opened};
use psls_pfs::meta::MetaOp;
use psls_pfs::MetaError;
use std::sync::Mutex;
use tokio::sync::{mpsc, oneshot};

/// How often the machine's clock ticks.
pub const TICK_MS: u64 = 50;
/// Inputs waiting for the replication task.
pub const MAX_INPUTS: usize = 16384;
/// Inputs handed to the machine before its actions are carried out.
pub const MAX_BATCH: usize = 4096;
/// A snapshot's bytes travel in chunks of this size.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Largest snapshot fetched.
pub const MAX_SNAPSHOT_BYTES: u64 = 4 << 30;
/// The leader looks at the voters every this many ticks.
pub const PLAN_EVERY_TICKS: u64 = 20;
/// What a snapshot's data says when its bytes travel apart: this, then the length (u64 LE).
pub(crate) const SNAPSHOT_REF: &[u8] = b"psls-snapshot-ref:";

/// The answer to a submission: the index the operation was applied at.
pub type Outcome = Result<u64, SubmitError<MetaError>>;

pub(crate) enum Token {
    Submit(oneshot::Sender<Outcome>),
    Read(oneshot::Sender<Result<u64, ReadError>>),
}

pub(crate) enum Input {
    Msg {
        from: u32,
        wire: Wire,
    },
    Submit {
        op: MetaOp,
        reply: oneshot::Sender<Outcome>,
    },
    Read {
        reply: oneshot::Sender<Result<u64, ReadError>>,
    },
    /// A snapshot fetch ended (successfully or not).
    Fetched,
    /// Enough of the first voters never held a log entry.
    FreshCluster,
}

/// The log as this node sees it (published after every batch).
#[derive(Clone, Debug, Default)]
pub struct Status {
    pub term: u64,
    /// The leader of the current term, as this node knows it.
    pub leader: Option<String>,
    pub is_leader: bool,
    /// Leader with its lease (`Log::lease_held`): no other voter leads now.
    pub lease: bool,
    /// Until when the lease holds if no voter answers again (a tick short of what the log
    /// says: the clock may be up to a tick ahead of the ticks delivered).
    pub lease_until: Option<std::time::Instant>,
    /// Candidate or leader.
    pub claims: bool,
    pub commit: u64,
    pub applied: u64,
    pub first_index: u64,
    pub last_index: u64,
    /// Catching up after a lost disk.
    pub amnesiac: bool,
    /// At the leader: the index each voter is known to hold.
    pub matched: Vec<(String, u64)>,
    /// The log's voters (both halves of a joint configuration), in config order.
    pub voters: Vec<String>,
    /// This node is one of them (else it follows the log).
    pub is_voter: bool,
    /// A blank store waiting to learn whether the cluster is new.
    pub awaiting_fresh: bool,
    /// The store was created in this life and has not caught up since.
    pub lost_disk: bool,
    /// Bytes of the store on disk.
    pub store_bytes: u64,
}

/// The door other parts of the daemon use: deliver, submit, read, look. Its fields are the
/// task's (`log_task.rs`) too.
pub struct Replication {
    /// Every physical node, in config order (its position is its number in the log).
    pub(crate) nodes: Vec<String>,
    pub(crate) tx: mpsc::Sender<Input>,
    pub(crate) rx: Mutex<Option<mpsc::Receiver<Input>>>,
    /// The store and what it held at start, until the task takes them.
    pub(crate) start: Mutex<Option<(LogStore, Opened)>>,
    pub(crate) status: Mutex<Status>,
    /// The bytes of the last snapshot sent: (index, term, data), served in chunks.
    pub(crate) serving: Mutex<Option<(u64, u64, bytes::Bytes)>>,
}

impl Replication {
    /// Nodes: the physical nodes, in config order; the store, opened.
    pub fn new(nodes: Vec<String>, store: LogStore, opened: Opened) -> Replication {
        let (tx, rx) = mpsc::channel(MAX_INPUTS);
        Replication {
            nodes,
            tx,
            rx: Mutex::new(Some(rx)),
            start: Mutex::new(Some((store, opened))),
            status: Mutex::new(Status::default()),
            serving: Mutex::new(None),
        }
    }

    /// The metadata's leader as this node knows it.
    pub fn leader(&self) -> Option<String> {
        self.status.locked().leader.clone()
    }

    /// Whether this node campaigns or leads.
    pub fn claims(&self) -> bool {
        self.status.locked().claims
    }

    /// Whether this node leads the metadata with its lease (`Log::lease_held`), by the clock
    /// now (not as of the log's last batch).
    pub fn lease_held(&self) -> bool {
        let s = self.status.locked();
        s.lease && s.lease_until.is_some_and(|u| std::time::Instant::now() < u)
    }

    /// [`Replication::leader`] with its term.
    pub fn leader_epoch(&self) -> Option<(String, u64)> {
        let s = self.status.locked();
        s.leader.clone().map(|l| (l, s.term))
    }

    /// Whether this node leads the current term.
    pub fn is_leader(&self) -> bool {
        self.status.locked().is_leader
    }

    /// The log as this node sees it.
    pub fn status(&self) -> Status {
        self.status.locked().clone()
    }

    pub(crate) fn number_of(&self, physical: &str) -> Option<u32> {
        self.nodes.iter().position(|v| v == physical).map(|i| i as u32)
    }

    /// A log message from peer `from` (its certificate's name).
    pub fn deliver(&self, from: &str, bytes: &[u8]) {
        let Some(from_v) = self.number_of(from) else {
            tracing::warn!(
                peer = from,
                "metadata log message from a node not in the config: dropped"
            );
            return;
        };
        let wire = match psls_cluster::log::decode_wire(bytes) {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(peer = from, error = %e, "metadata log message does not decode: dropped");
                return;
            }
        };
        if self.tx.try_send(Input::Msg { from: from_v, wire }).is_err() {
            tracing::warn!(peer = from, "metadata log queue full: message dropped");
        }
    }

    /// Submits `op` to this node's machine (answered `NotLeader` unless it leads).
    pub async fn submit(&self, op: MetaOp) -> Outcome {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Input::Submit { op, reply }).await.is_err() {
            return Err(SubmitError::Halted);
        }
        rx.await.unwrap_or(Err(SubmitError::Halted))
    }

    /// Asks the leader for its commit index (raft's read index): once this node applied up to
    /// the answer, a read here sees every operation answered before the call.
    pub async fn read_index(&self) -> Result<u64, ReadError> {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Input::Read { reply }).await.is_err() {
            return Err(ReadError::Halted);
        }
        rx.await.unwrap_or(Err(ReadError::Halted))
    }

    /// Heartbeats show a new cluster ([`Node::check_fresh_cluster`]).
    pub fn fresh_cluster(&self) {
        let _ = self.tx.try_send(Input::FreshCluster);
    }

    /// A chunk of the snapshot this node sent last: its total length and the bytes at `offset`.
    pub fn snapshot_chunk(&self, index: u64, term: u64, offset: u64) -> Option<(u64, bytes::Bytes)> {
        let s = self.serving.locked();
        let (i, t, data) = s.as_ref()?;
        if (*i, *t) != (index, term) || offset > data.len() as u64 {
            return None;
        }
        let start = offset as usize;
        let end = (start + CHUNK_BYTES).min(data.len());
        Some((data.len() as u64, data.slice(start..end)))
    }
}
