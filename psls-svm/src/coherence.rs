//! The coherence protocol of one node, as a pure state machine (no I/O, no clock): a
//! sequentially consistent write-invalidate protocol with a fixed distributed manager per page
//! (Li & Hudak), DESIGN §5.
//!
//! Inputs are method calls ([`Svm::fault`], [`Svm::receive`], [`Svm::loaded`],
//! [`Svm::peer_down`], [`Svm::peer_up`], [`Svm::cancel`]); outputs are [`Action`]s taken with [`Svm::poll_action`]
//! and executed by the shell **in order**.
//!
//! # Roles
//! - The **manager** of a page is the home node of its run of pages ([`manager_node`]).
//!   It records the page's *owner* (the node whose copy is the latest and which supplies it), the *copyset* (every node with a copy, the owner included), whether the owner may write, and whether the page was written since it was loaded from disk.
//!   It orders requests per page: a write transaction runs alone and the next starts only after its requester reported `Done`.
//!   A read the owner serves is over at the manager as soon as it is forwarded: the requester joins the copyset then, and sends no `Done`.
//! - A **requester** asks its manager for read or write access on a local fault, collects the grant, the page data (from the owner, or from disk) and the invalidation acks, then sets its access and wakes the faulting clients.
//!
//! # Messages of one transaction
//! Read: `Req` → manager; `Fwd` → owner, which downgrades and sends `Data` to the requester: three messages, one and a half round trips.
//! Write: as read, but the owner sends its data and drops its copy, and every other holder gets `Inval` and acks the requester directly (`InvalAck`).
//! When the owner is the source, its `Data` is the grant (it carries the acks to collect, which the manager put in the `Fwd`).
//! Otherwise the manager sends a `Grant`: a requester that already holds a copy gets no data (`Source::Have`), and a page in no memory is loaded from disk by the requester (`Source::Disk`).
//! The requester reports `Done` to the manager, except for a read the owner's data granted.
//!
//! # Reads without `Done`
//! The manager may start a write while a read it forwarded is still on the way, so three races need an answer:
//! - The write's `Inval` reaches the reader before the data: a read with neither grant nor data is abandoned and asked for again (the data, arriving later, belongs to no pending transaction and is dropped).
//!   A request says whether the requester holds a copy (`have`); one without drops the requester from the copyset first, so the directory heals.
//! - The owner dies before its data gets out: the manager keeps the reads it forwarded since the last write started (`forwarded`), and turns those of the dead owner into transactions in progress with a late `Grant`, as for any transaction whose source died; each reader reports `Done` (a reader whose read is over reports whether it holds the page).
//! - An owner that took over after a death turns out to have no copy (`Nack`): the read is served again.
//!
//! # Invariants (asserted by the simulator after every step)
//! - At most one node has write access to a page; while one has, no other node has any access.
//! - A read returns the value of the latest write in the order the manager serialized them.
//! - The manager's directory covers every node that holds the page (owner, copyset), save a
//!   requester whose transaction is still in progress there, and, on a lost page, a holder an
//!   invalidation on the way will empty.
//!
//! The shell keeps these by executing actions in order: it sets access before it acks an
//! invalidation, snapshots a page for `Data` before it drops it, and installs received data
//! before it runs the actions that follow the [`Receipt::Install`].
//!
//! # Failures
//! Messages from a node this one holds down, or from or to another incarnation, are dropped.
//! When a peer goes down, transactions that waited on its data fail; acks it owed are no longer
//! needed (its memory is gone). A page whose only up-to-date copy was on a lost node is *lost*:
//! faults on it fail until a checkpoint rollback restores it. A page that was not
//! written since it was loaded is simply reloaded from disk.
//!
//! Why one file of this size: it is one state machine whose handlers share one set of
//! invariants (owner, copyset, the manager's queue); split, a reader would lose them.

use crate::ids::{FileId, Incarnation, NodeId, PageId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;

/// At most this many local faults wait on one page (clients are bounded by the shell too).
pub const MAX_WAITERS_PER_PAGE: usize = 4096;
/// At most this many actions queued before the shell drains them (a bound, asserted).
const MAX_ACTIONS: usize = 1 << 20;
/// Requests a recovering manager holds while it asks whether a file's directory died with its
/// previous incarnation ([`Action::CheckFence`]); beyond this, it refuses them at once.
pub const MAX_PARKED_REQUESTS: usize = 1 << 16;

/// The home (PFS primary) node of page `index` of `file` in a cluster of `nodes`:
/// `(hash(file) + index) mod N` (DESIGN §3). `nodes` must be ≥ 1.
pub fn home_node(file: FileId, index: u64, nodes: u32) -> NodeId {
    let n = nodes.max(1) as u64;
    NodeId(((crate::rng::mix64(file.0) % n + index % n) % n) as u32)
}

/// Consecutive pages share a manager in aligned runs of this many (64 KiB): the requests,
/// forwards, data and reports of a fault and its prefetch then go to the same nodes, and
/// the shell sends them in one link message.
pub const MANAGER_RUN_PAGES: u64 = 16;

/// The coherence manager of page `index` of `file` in a cluster of `nodes`: the home node of
/// its run of [`MANAGER_RUN_PAGES`] (runs spread over the nodes as pages spread over homes).
pub fn manager_node(file: FileId, index: u64, nodes: u32) -> NodeId {
    home_node(file, index / MANAGER_RUN_PAGES, nodes)
}

/// Access a node (or a fault) needs: reading, or reading and writing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Access {
    Read,
    Write,
}

/// Identifies one transaction: the requester, its incarnation and a sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TxnId {
    pub node: NodeId,
    pub incarnation: Incarnation,
    pub seq: u64,
}

/// Where a requester gets the page's contents from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Source {
    /// The owner (that incarnation of it) sends a `Data` message.
    Owner(NodeId, Incarnation),
    /// No memory holds the page: load it from the PFS.
    Disk,
    /// The requester's own copy is current (an upgrade from read to write).
    Have,
}

/// Why a fault could not be served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum FaultError {
    #[error("the page's only up-to-date copy was lost with a failed node")]
    PageLost,
    #[error("the page's manager node is down")]
    ManagerDown,
    #[error("the page could not be read from either disk copy")]
    LoadFailed,
    #[error("too many faults waiting on one page")]
    TooManyWaiters,
    #[error("the page's manager node restarted while a job was writing the file: its pages are refused until that job rolls back or ends")]
    ManagerRestarted,
}

/// A protocol message between nodes (the payload of `Data` travels beside it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Requester → manager. `have`: the requester holds a read copy (an upgrade); without
    /// one, the manager drops it from the copyset if it is there (its copy went, or a read
    /// forwarded to it was abandoned).
    Req {
        page: PageId,
        txn: TxnId,
        access: Access,
        have: bool,
    },
    /// Manager → requester: the transaction may go ahead.
    Grant {
        page: PageId,
        txn: TxnId,
        access: Access,
        source: Source,
        /// Nodes (incarnations) whose `InvalAck` the requester must collect.
        acks: Vec<(NodeId, Incarnation)>,
    },
    /// Manager → requester: the request is refused.
    Deny {
        page: PageId,
        txn: TxnId,
        error: FaultError,
    },
    /// Manager → owner: send the page to `to`; drop the copy after if `access` is `Write`,
    /// keep it read-only if `Read`. `grant`: the manager sent the requester no `Grant` (the
    /// owner is the source), so the `Data` stands for it, with these acknowledgements to
    /// collect.
    Fwd {
        page: PageId,
        txn: TxnId,
        to: NodeId,
        access: Access,
        grant: Option<Vec<(NodeId, Incarnation)>>,
    },
    /// Owner → requester, with the page's 4096 bytes as payload. `grant`: this also grants the
    /// transaction (source: the sender), with the acknowledgements to collect.
    Data {
        page: PageId,
        txn: TxnId,
        grant: Option<Vec<(NodeId, Incarnation)>>,
    },
    /// Manager → holder: drop your copy and ack `txn.node`.
    Inval { page: PageId, txn: TxnId },
    /// Holder → requester.
    InvalAck { page: PageId, txn: TxnId },
    /// Requester → manager: the transaction is over (`ok`: the requester now holds the page).
    Done { page: PageId, txn: TxnId, ok: bool },
    /// Owner → manager: the owner has no copy to forward (it lost it).
    Nack { page: PageId, txn: TxnId },
}

impl Msg {
    pub fn page(&self) -> PageId {
        match self {
            Msg::Req { page, .. }
            | Msg::Grant { page, .. }
            | Msg::Deny { page, .. }
            | Msg::Fwd { page, .. }
            | Msg::Data { page, .. }
            | Msg::Inval { page, .. }
            | Msg::InvalAck { page, .. }
            | Msg::Done { page, .. }
            | Msg::Nack { page, .. } => *page,
        }
    }
    /// The transaction the message belongs to.
    pub fn txn(&self) -> TxnId {
        match self {
            Msg::Req { txn, .. }
            | Msg::Grant { txn, .. }
            | Msg::Deny { txn, .. }
            | Msg::Fwd { txn, .. }
            | Msg::Data { txn, .. }
            | Msg::Inval { txn, .. }
            | Msg::InvalAck { txn, .. }
            | Msg::Done { txn, .. }
            | Msg::Nack { txn, .. } => *txn,
        }
    }
    /// Whether the message carries a page of data.
    pub fn has_payload(&self) -> bool {
        matches!(self, Msg::Data { .. })
    }
}

/// A message with the incarnations it is valid between.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    pub from: NodeId,
    pub from_incarnation: Incarnation,
    pub to_incarnation: Incarnation,
    pub msg: Msg,
}

/// Identifies one waiting fault (chosen by the shell).
pub type WaiterId = u64;

/// What the shell must do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `env` to `to` (possibly this node). If the message has a payload, attach this node's
    /// copy of the page as it is now (the state machine only asks for that while no client of
    /// this node can write the page).
    Send { to: NodeId, env: Envelope },
    /// Read the page from the PFS into local memory, then call [`Svm::loaded`].
    Load { page: PageId, txn: TxnId },
    /// Set this node's access to the page: `None` drops the copy (zap it in every client),
    /// `Read` write-protects it in every client, `Write` lets clients write it.
    SetAccess { page: PageId, access: Option<Access> },
    /// The fault may proceed: map the page in the waiter (read-only unless access is `Write`).
    Resolve {
        waiter: WaiterId,
        page: PageId,
        access: Access,
    },
    /// The fault fails.
    Fail {
        waiter: WaiterId,
        page: PageId,
        error: FaultError,
    },
    /// This node restarted while others held shared pages, and a request came for a page of
    /// `file`, which it does not serve yet: ask every other node ([`Svm::fence_askees`]) whether it
    /// held any of `file` when it learnt of this incarnation ([`Svm::fence_answer`]), then call
    /// [`Svm::fence_checked`]. The file's requests wait until then.
    CheckFence { file: FileId },
}

/// A node's answer to a restarted manager asking about one file ([`Svm::fence_answer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FenceAnswer {
    /// It held nothing of the file (no segment, no page, no directory entry) when it learnt of
    /// the manager's incarnation: what it holds of it now came later.
    Clean,
    /// It did: it may hold pages, or have seen versions, that the directory which died with
    /// the previous incarnation knew of.
    Held,
    /// It has not learnt of that incarnation yet and holds some of the file: ask again later.
    Unknown,
}

/// What [`Svm::receive`] did with a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Receipt {
    /// Accepted; nothing to install.
    Accepted,
    /// Accepted: install the message's payload as this node's copy of the page **before**
    /// running the actions that follow.
    Install(PageId),
    /// Stale (another incarnation, or from a node held down): ignored.
    Dropped,
}

/// A message that breaks the protocol (a bug or a misbehaving peer). The state is unchanged.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("protocol violation from {from} on page {page}: {what}")]
pub struct ProtocolError {
    pub from: NodeId,
    pub page: PageId,
    pub what: String,
}

/// Counters a node reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Faults resolved at once (the node had the access).
    pub local_faults: u64,
    /// Read and write requests this node issued to managers.
    pub read_requests: u64,
    pub write_requests: u64,
    /// Pages received from other nodes, and sent to them.
    pub pages_in: u64,
    pub pages_out: u64,
    /// Pages loaded from the PFS.
    pub pages_loaded: u64,
    /// Copies this node dropped because another node wrote.
    pub invalidations: u64,
    /// Faults that failed.
    pub failed_faults: u64,
    /// Read transactions this node, as manager, started while other reads of the page were
    /// still in progress, or forwarded since the last write.
    pub joined_reads: u64,
    /// Transactions this node, as manager, started without a `Grant` (the owner's `Data`
    /// granted), and those of them it had to grant after all because the owner died.
    pub implied_grants: u64,
    pub late_grants: u64,
    /// Late grants this node, as requester, received after the owner's `Data` had granted
    /// while it still collected acknowledgements.
    pub redundant_grants: u64,
    /// Reads this node, as manager, forwarded to the owner with no `Done` to wait for; reads
    /// this node, as requester, abandoned because an invalidation overtook their data; and
    /// forwarded reads it asked for again because the owner by its books had no copy.
    pub reads_without_done: u64,
    pub abandoned_reads: u64,
    pub reforwarded_reads: u64,
    /// Protocol messages this node sent to other nodes (the shell may carry several in one
    /// link message).
    pub messages_out: u64,
}

/// This node's side of one page: its access and its own pending request.
#[derive(Debug, Default)]
struct Local {
    access: Option<Access>,
    pending: Option<Pending>,
    waiters: Vec<(WaiterId, Access)>,
}

#[derive(Debug)]
struct Pending {
    txn: TxnId,
    access: Access,
    grant: Option<(Source, Vec<(NodeId, Incarnation)>)>,
    data: bool,
    loaded: bool,
    /// Acks received, from these incarnations.
    acked: BTreeSet<(NodeId, Incarnation)>,
    /// Failed (its waiters were told); it still collects the invalidation acks before
    /// telling the manager, so that no copy outlives the manager's view.
    aborted: bool,
    /// The owner's `Data` granted (a late `Grant` from a manager that thinks the owner died
    /// is then redundant).
    granted_by_data: bool,
}

/// The manager's record of a page it manages.
#[derive(Debug, Default)]
struct Directory {
    owner: Option<NodeId>,
    copyset: BTreeSet<NodeId>,
    writable: bool,
    /// Written since it was loaded from disk: memory holds the only current version.
    dirty: bool,
    lost: bool,
    /// Transactions in progress: one, or several reads served by an owner at once (reads of
    /// a page do not conflict, so they are not serialized behind each other; a write waits
    /// for all of them, and they for it).
    busy: Vec<Busy>,
    queue: VecDeque<Queued>,
    /// Reads forwarded to the owner since the last write started, with no `Done` to wait
    /// for: the transaction, and the owner (incarnation) asked to send the data. At most one
    /// per requester. Should that owner die, they become transactions in progress again
    /// (granted late, so that each requester says whether its data got out).
    forwarded: Vec<(TxnId, NodeId, Incarnation)>,
}

/// A request waiting at the manager.
#[derive(Debug, Clone, Copy)]
struct Queued {
    txn: TxnId,
    access: Access,
    /// The requester holds a read copy.
    have: bool,
}

impl Directory {
    /// Every copy is gone: the page is lost if memory held its only current version.
    fn forget_copies(&mut self) {
        self.owner = None;
        self.copyset.clear();
        self.writable = false;
        self.lost |= self.dirty;
    }
    /// Between transactions, a page without an owner has no copies either, and is lost if it
    /// was written (an owner that died mid-transaction leaves this decision to the end).
    fn settle(&mut self) {
        if self.owner.is_none() {
            // A leftover reader takes over; with no copy left, a written page is lost.
            self.reassign_or_lose();
        }
        debug_assert!(self.owner.is_some() || self.copyset.is_empty());
    }
    /// The owner is gone: another holder of a read copy takes over, or every copy is gone.
    /// A holder whose data is confirmed comes first: not one a read was forwarded to, whose
    /// data may not have come (it may even have abandoned the read).
    fn reassign_or_lose(&mut self) {
        let unconfirmed = |c: &NodeId| {
            self.forwarded.iter().any(|(t, _, _)| t.node == *c) || self.busy.iter().any(|b| b.txn.node == *c)
        };
        let pick = self
            .copyset
            .iter()
            .find(|c| !unconfirmed(c))
            .or_else(|| self.copyset.iter().next())
            .copied();
        match pick {
            Some(c) if !self.writable => self.owner = Some(c),
            _ => self.forget_copies(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Peer {
    incarnation: Incarnation,
    up: bool,
}

#[derive(Debug, Clone)]
struct Busy {
    txn: TxnId,
    access: Access,
    source: Source,
    /// The requester got no `Grant`: the owner's `Data` grants. Should the owner die first,
    /// the manager sends the `Grant` after all, so that the requester learns its source is
    /// gone.
    implied: bool,
    /// The invalidation acks the requester collects.
    acks: Vec<(NodeId, Incarnation)>,
}

/// What is in progress on one page at one node ([`Svm::in_progress`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InProgress {
    /// This node's own request: its transaction and the access asked for.
    pub pending: Option<(TxnId, Access)>,
    /// Local faults waiting.
    pub waiters: usize,
    /// As the page's manager: the transactions running, and how many wait in the queue.
    pub busy: Vec<(TxnId, Access)>,
    pub queued: usize,
}

/// The protocol state of one node.
#[derive(Debug)]
pub struct Svm {
    me: NodeId,
    incarnation: Incarnation,
    nodes: u32,
    /// The latest incarnation known of every node, and whether it is up.
    peers: Vec<Peer>,
    /// Per node, the incarnation it came back as while this node held coherence state (0:
    /// none): that incarnation's directory is gone and it must know it (see [`Svm::fenced`]).
    fenced: Vec<Incarnation>,
    local: HashMap<PageId, Local>,
    dir: HashMap<PageId, Directory>,
    actions: VecDeque<Action>,
    next_seq: u64,
    stats: Stats,
    /// Restarted: the directory of the pages this node manages died with the previous
    /// incarnation, so it cannot tell where their latest versions are. It serves a file again
    /// once every other node says it holds nothing the old incarnation granted (settled files:
    /// their holders drop their copies), or once a rollback rebuilt the file's directory.
    recovering: bool,
    /// While recovering: files whose directory is known empty and true — a rollback rebuilt
    /// it (every node forgot them), or no node held any of their pages managed here when it
    /// learnt of this incarnation ([`Svm::fence_checked`]): their pages are served.
    rebuilt: HashSet<FileId>,
    /// While recovering: requests for pages of files being checked ([`Action::CheckFence`]),
    /// in arrival order.
    parked: HashMap<FileId, Vec<(PageId, Queued)>>,
    /// Per node, the files this node held pages or directory entries of when it learnt of
    /// that node's latest incarnation (what [`Svm::fence_answer`] says; the shell tells of
    /// its segments).
    fenced_files: Vec<HashSet<FileId>>,
    /// Parallel files with no writer job (the shell reads it from the metadata:
    /// [`Svm::set_settled`]): every memory copy equals the disks' persistent checkpoint, so a
    /// copy that dies loses nothing and a restarted manager's directory is rebuilt by the
    /// holders dropping their copies. Any other file (a job writes it, a volatile segment)
    /// may hold its only current version in memory.
    settled: HashSet<FileId>,
}

/// Returns a protocol error unless `cond` holds.
macro_rules! ensure {
    ($cond:expr, $from:expr, $page:expr, $($what:tt)+) => {
        if !$cond {
            return Err(ProtocolError { from: $from, page: $page, what: format!($($what)+) });
        }
    };
}

impl Svm {
    /// Node `me` (incarnation `incarnation`) of a cluster of `nodes`, all of them up at
    /// incarnation `peers[i]` (`None`: down, incarnation unknown).
    pub fn new(me: NodeId, incarnation: Incarnation, peers: Vec<Option<Incarnation>>) -> Svm {
        let nodes = peers.len() as u32;
        assert!(me.0 < nodes, "node {me} outside a cluster of {nodes}");
        let mut peers: Vec<Peer> = peers
            .into_iter()
            .map(|p| Peer {
                incarnation: p.unwrap_or(Incarnation(0)),
                up: p.is_some(),
            })
            .collect();
        peers[me.0 as usize] = Peer { incarnation, up: true };
        Svm {
            me,
            incarnation,
            nodes,
            fenced: vec![Incarnation(0); peers.len()],
            fenced_files: vec![HashSet::new(); peers.len()],
            parked: HashMap::new(),
            peers,
            local: HashMap::new(),
            dir: HashMap::new(),
            actions: VecDeque::new(),
            next_seq: 0,
            stats: Stats::default(),
            recovering: false,
            rebuilt: HashSet::new(),
            settled: HashSet::new(),
        }
    }

    /// Like [`Svm::new`], for a node whose previous incarnation died: it refuses requests for
    /// the pages it manages (their directory is gone) with [`FaultError::ManagerRestarted`].
    pub fn restarted(me: NodeId, incarnation: Incarnation, peers: Vec<Option<Incarnation>>) -> Svm {
        Svm {
            recovering: true,
            ..Svm::new(me, incarnation, peers)
        }
    }

    /// Whether this node still refuses the pages it manages ([`Svm::restarted`]).
    pub fn recovering(&self) -> bool {
        self.recovering
    }

    /// No other node holds any page any more (the shell knows it from their reports): the
    /// empty directory is true again, and the pages managed here are served as usual.
    pub fn end_recovery(&mut self) {
        self.recovering = false;
        self.rebuilt.clear();
        let mut files: Vec<FileId> = self.parked.keys().copied().collect();
        files.sort();
        for f in files {
            self.fence_checked(f, true);
        }
    }

    /// Whether `file` has no writer job ([`Svm::set_settled`]).
    pub fn is_settled(&self, file: FileId) -> bool {
        self.settled.contains(&file)
    }

    /// The files this node holds pages or directory entries of.
    pub fn files(&self) -> Vec<FileId> {
        let mut v: Vec<FileId> = self.local.keys().chain(self.dir.keys()).map(|p| p.file).collect();
        v.sort();
        v.dedup();
        v
    }

    /// Whether parallel file `file` has no writer job (`settled`), as the metadata says: its
    /// memory copies then equal the disks' persistent checkpoint. When a file becomes settled,
    /// what its writer left behind is let go: as manager, a page is no longer *written since
    /// loaded* nor lost (the disks hold its latest version); as holder, copies of pages whose
    /// manager restarted meanwhile are dropped, so that manager serves them again from the
    /// disks (its directory is true once no node holds what its old incarnation granted).
    ///
    /// Only the change to settled lets go: a write granted while settled comes from a writer
    /// whose claim the shell has not seen yet, and stays written until the next settling.
    /// (Should the shell see a writer's release after a next writer's first writes, those are
    /// let go too; that writer's node failing then rolls the job back all the same, and only
    /// its ranks on other nodes read the disks' version meanwhile instead of failing.)
    pub fn set_settled(&mut self, file: FileId, settled: bool) {
        if !settled {
            self.settled.remove(&file);
            return;
        }
        if !self.settled.insert(file) {
            return;
        }
        for (page, d) in self.dir.iter_mut() {
            if page.file == file && d.busy.is_empty() {
                d.dirty = false;
                d.lost = false;
            }
        }
        let restarted: Vec<NodeId> = (0..self.nodes)
            .map(NodeId)
            .filter(|n| self.fenced_files[n.0 as usize].contains(&file))
            .collect();
        for n in restarted {
            self.fenced_files[n.0 as usize].remove(&file);
            self.drop_managed_by(n, |f| f == file);
        }
    }

    /// Drops this node's copies of the pages of files `which` selects that `manager`
    /// manages, with no transaction of this node in progress on them (the manager restarted:
    /// it no longer knows of them, and these copies equal the disks').
    fn drop_managed_by(&mut self, manager: NodeId, which: impl Fn(FileId) -> bool) {
        let nodes = self.nodes;
        let mut pages: Vec<PageId> = self
            .local
            .iter()
            .filter(|(p, l)| {
                which(p.file)
                    && l.access.is_some()
                    && l.pending.is_none()
                    && manager_node(p.file, p.index, nodes) == manager
            })
            .map(|(p, _)| *p)
            .collect();
        pages.sort();
        for page in pages {
            if let Some(l) = self.local.get_mut(&page) {
                l.access = None;
            }
            self.push(Action::SetAccess { page, access: None });
        }
    }

    /// Whether this node serves requests for pages of `file` it manages (not recovering, or
    /// the file's directory is known true).
    pub fn serves(&self, file: FileId) -> bool {
        !self.recovering || self.rebuilt.contains(&file)
    }

    /// What this node says to `manager`, restarted as `incarnation`, asking whether it may
    /// serve `file` from the disks with an empty directory, as if no node held any of it (the
    /// rule of [`Svm::end_recovery`], for one file). `segment`: the shell holds a segment of
    /// `file`, opened when this node knew `manager` as that incarnation (a process mapping it
    /// may have seen versions that died with an older one). `Held` if this node held
    /// anything of `file` when it learnt of `incarnation` (pages, directory entries, or a
    /// segment opened before), or knows it dead or a later one (the asker is dead itself);
    /// `Unknown` if it has not learnt of it yet and holds some of `file` now; `Clean`
    /// otherwise. What this node holds of `file` afterwards came after the old incarnation
    /// died, so `Clean` stays true.
    pub fn fence_answer(
        &self,
        manager: NodeId,
        incarnation: Incarnation,
        file: FileId,
        segment: Option<Incarnation>,
    ) -> FenceAnswer {
        let known = self.known_incarnation(manager);
        if manager == self.me || known > incarnation || (known == incarnation && !self.is_up(manager)) {
            return FenceAnswer::Held;
        }
        if known < incarnation {
            let holds = segment.is_some()
                || self.local.keys().any(|p| p.file == file)
                || self.dir.keys().any(|p| p.file == file);
            return if holds {
                FenceAnswer::Unknown
            } else {
                FenceAnswer::Clean
            };
        }
        // A settled file's copies equal the disks' (what this node held of it when it learnt
        // of the restart went then, or when it settled): a segment of it saw nothing newer.
        let held = self
            .fenced_files
            .get(manager.0 as usize)
            .is_some_and(|f| f.contains(&file))
            || (segment.is_some_and(|k| k < incarnation) && !self.settled.contains(&file));
        if held {
            FenceAnswer::Held
        } else {
            FenceAnswer::Clean
        }
    }

    /// The nodes to ask for [`Action::CheckFence`]: every other node of the cluster, whatever
    /// this one knows of it — one not heard of yet may hold pages the old incarnation
    /// granted, and one held down may still run with its copies until it restarts.
    pub fn fence_askees(&self) -> Vec<NodeId> {
        (0..self.nodes).map(NodeId).filter(|&n| n != self.me).collect()
    }

    /// The answer to [`Action::CheckFence`] for `file`: `clean` when every node of
    /// [`Svm::fence_askees`] said [`FenceAnswer::Clean`]. Its waiting requests go on if so, else they are refused.
    pub fn fence_checked(&mut self, file: FileId, clean: bool) {
        let Some(reqs) = self.parked.remove(&file) else { return };
        if clean && self.recovering {
            self.rebuilt.insert(file);
        }
        for (page, q) in reqs {
            let txn = q.txn;
            if self.serves(file) {
                // Checked when parked; the state has not changed for it since.
                if let Err(e) = self.on_request(page, q, txn.node) {
                    debug_assert!(false, "{e}");
                }
            } else {
                self.send(
                    txn.node,
                    Msg::Deny {
                        page,
                        txn,
                        error: FaultError::ManagerRestarted,
                    },
                );
            }
        }
    }

    pub fn me(&self) -> NodeId {
        self.me
    }
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }
    pub fn stats(&self) -> Stats {
        self.stats
    }
    /// The incarnation node `n` came back as (restarted, or a spare took its id over) while
    /// this node held pages or directory entries (0: never). Such an incarnation must start
    /// with [`Svm::restarted`]: this node may hold pages it managed, and knows what it knew.
    pub fn fenced(&self, n: NodeId) -> Incarnation {
        self.fenced.get(n.0 as usize).copied().unwrap_or(Incarnation(0))
    }
    /// The incarnation of node `n` this node knows (0: never heard of), up or not.
    pub fn known_incarnation(&self, n: NodeId) -> Incarnation {
        self.peers
            .get(n.0 as usize)
            .map(|p| p.incarnation)
            .unwrap_or(Incarnation(0))
    }
    /// The manager of `page`.
    pub fn manager(&self, page: PageId) -> NodeId {
        manager_node(page.file, page.index, self.nodes)
    }
    /// This node's access to `page`.
    pub fn access(&self, page: PageId) -> Option<Access> {
        self.local.get(&page).and_then(|l| l.access)
    }
    /// Pages this node holds, with their access.
    pub fn held(&self) -> impl Iterator<Item = (PageId, Access)> + '_ {
        self.local.iter().filter_map(|(p, l)| l.access.map(|a| (*p, a)))
    }
    /// Whether nothing is in flight at this node (no pending request, no busy directory entry).
    pub fn is_quiet(&self) -> bool {
        self.local.values().all(|l| l.pending.is_none() && l.waiters.is_empty())
            && self.dir.values().all(|d| d.busy.is_empty() && d.queue.is_empty())
    }
    /// The manager's view of `page` (for checks): owner, copyset, writable, lost.
    pub fn directory(&self, page: PageId) -> Option<(Option<NodeId>, Vec<NodeId>, bool, bool)> {
        self.dir
            .get(&page)
            .map(|d| (d.owner, d.copyset.iter().copied().collect(), d.writable, d.lost))
    }

    /// What is in progress on `page` here (for checks): this node's own request, the faults
    /// waiting, and, as its manager, the transactions running and queued.
    pub fn in_progress(&self, page: PageId) -> InProgress {
        let l = self.local.get(&page);
        let d = self.dir.get(&page);
        InProgress {
            pending: l.and_then(|l| l.pending.as_ref()).map(|p| (p.txn, p.access)),
            waiters: l.map_or(0, |l| l.waiters.len()),
            busy: d.map_or(Vec::new(), |d| d.busy.iter().map(|b| (b.txn, b.access)).collect()),
            queued: d.map_or(0, |d| d.queue.len()),
        }
    }

    /// The next action for the shell.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    fn push(&mut self, a: Action) {
        assert!(self.actions.len() < MAX_ACTIONS, "action queue not drained");
        self.actions.push_back(a);
    }

    fn send(&mut self, to: NodeId, msg: Msg) {
        let Some(inc) = self.peers.get(to.0 as usize).filter(|p| p.up).map(|p| p.incarnation) else {
            // A down node gets nothing; failure handling covers what it would have done.
            return;
        };
        if matches!(msg, Msg::Data { .. }) {
            self.stats.pages_out += 1;
        }
        self.stats.messages_out += (to != self.me) as u64;
        self.push(Action::Send {
            to,
            env: Envelope {
                from: self.me,
                from_incarnation: self.incarnation,
                to_incarnation: inc,
                msg,
            },
        });
    }

    /// Whether this node holds node `n` up (at the incarnation it knows of it).
    pub fn is_up(&self, n: NodeId) -> bool {
        self.peers.get(n.0 as usize).is_some_and(|p| p.up)
    }

    // ----- local faults (requester side) -----

    /// A local client `waiter` faulted on `page` needing `access`.
    pub fn fault(&mut self, page: PageId, access: Access, waiter: WaiterId) {
        let l = self.local.entry(page).or_default();
        if l.access >= Some(access) {
            self.stats.local_faults += 1;
            self.push(Action::Resolve { waiter, page, access });
            return;
        }
        if l.waiters.len() >= MAX_WAITERS_PER_PAGE {
            self.stats.failed_faults += 1;
            self.push(Action::Fail {
                waiter,
                page,
                error: FaultError::TooManyWaiters,
            });
            return;
        }
        l.waiters.push((waiter, access));
        self.request_if_needed(page);
    }

    /// Asks for `access` to `page` ahead of any fault (nobody waits on it), so that a coming
    /// access finds the page here. Does nothing if the node already has that access, a request
    /// is pending, or the manager is down.
    pub fn prefetch(&mut self, page: PageId, access: Access) {
        let manager_up = self.is_up(self.manager(page));
        let l = self.local.entry(page).or_default();
        if l.access >= Some(access) || l.pending.is_some() || !manager_up {
            return;
        }
        self.request(page, Some(access));
    }

    /// Forgets every page of `file`, as holder and as manager: for a segment no client uses
    /// any more anywhere (a volatile segment after its job ended). Its pages' next fault
    /// starts afresh (loads). Returns how many page entries were dropped.
    pub fn forget_file(&mut self, file: FileId) -> usize {
        let before = self.local.len() + self.dir.len();
        self.local.retain(|p, _| p.file != file);
        self.dir.retain(|p, _| p.file != file);
        // Requests waiting for a check go, as queued ones do: every node forgets the file.
        self.parked.remove(&file);
        for f in &mut self.fenced_files {
            f.remove(&file);
        }
        self.settled.remove(&file);
        before - self.local.len() - self.dir.len()
    }

    /// A rollback made every node forget `file` (after [`Svm::forget_file`] everywhere): its
    /// directory is empty and true, so a recovering node serves its pages again.
    pub fn directory_rebuilt(&mut self, file: FileId) {
        if self.recovering {
            self.rebuilt.insert(file);
            // Requests waiting for a check go on now.
            self.fence_checked(file, true);
        }
    }

    /// The client behind `waiter` is gone: forget its waiting faults.
    pub fn cancel(&mut self, waiter: WaiterId) {
        for l in self.local.values_mut() {
            l.waiters.retain(|(w, _)| *w != waiter);
        }
    }

    /// Issues a request for the strongest access a waiter needs, unless one is pending.
    fn request_if_needed(&mut self, page: PageId) {
        self.request(page, None)
    }

    /// Issues a request for the strongest access a waiter (or `want`) needs, unless one is
    /// pending.
    fn request(&mut self, page: PageId, want: Option<Access>) {
        let manager = self.manager(page);
        let manager_up = self.is_up(manager);
        let Some(l) = self.local.get_mut(&page) else { return };
        if l.pending.is_some() {
            return;
        }
        // Wake those the current access already serves.
        let have = l.access;
        let mut wake = Vec::new();
        l.waiters.retain(|&(w, a)| {
            if have >= Some(a) {
                wake.push((w, a));
                false
            } else {
                true
            }
        });
        let need = l
            .waiters
            .iter()
            .map(|w| w.1)
            .max()
            .max(want.filter(|&w| have < Some(w)));
        for (waiter, access) in wake {
            self.push(Action::Resolve { waiter, page, access });
        }
        let Some(need) = need else { return };
        if !manager_up {
            self.fail_waiters(page, FaultError::ManagerDown);
            return;
        }
        let txn = TxnId {
            node: self.me,
            incarnation: self.incarnation,
            seq: self.next_seq,
        };
        self.next_seq += 1;
        match need {
            Access::Read => self.stats.read_requests += 1,
            Access::Write => self.stats.write_requests += 1,
        }
        if let Some(l) = self.local.get_mut(&page) {
            l.pending = Some(Pending {
                txn,
                access: need,
                grant: None,
                granted_by_data: false,
                data: false,
                loaded: false,
                acked: BTreeSet::new(),
                aborted: false,
            });
        }
        self.send(
            manager,
            Msg::Req {
                page,
                txn,
                access: need,
                have: have.is_some(),
            },
        );
    }

    fn fail_waiters(&mut self, page: PageId, error: FaultError) {
        let waiters = self
            .local
            .get_mut(&page)
            .map(|l| std::mem::take(&mut l.waiters))
            .unwrap_or_default();
        for (waiter, _) in waiters {
            self.stats.failed_faults += 1;
            self.push(Action::Fail { waiter, page, error });
        }
    }

    /// The PFS load of `page` for `txn` finished (`ok`: its bytes are in local memory).
    pub fn loaded(&mut self, page: PageId, txn: TxnId, ok: bool) {
        let Some(p) = self.local.get_mut(&page).and_then(|l| l.pending.as_mut()) else {
            return;
        };
        if p.txn != txn || !matches!(p.grant, Some((Source::Disk, _))) || p.loaded {
            return;
        }
        if ok {
            p.loaded = true;
            self.stats.pages_loaded += 1;
            self.try_complete(page);
        } else {
            self.abort_pending(page, FaultError::LoadFailed);
        }
    }

    /// Ends the pending transaction of `page` without the page: fails the waiters and tells the
    /// manager.
    fn abort_pending(&mut self, page: PageId, error: FaultError) {
        let Some(l) = self.local.get_mut(&page) else { return };
        let Some(p) = l.pending.as_mut().filter(|p| !p.aborted) else {
            return;
        };
        p.aborted = true;
        // Our read copy stays valid only while the manager counts it: it does not after a
        // failed upgrade (the others were invalidated for us), so drop it.
        let drop_copy = p.access == Access::Write && p.grant.as_ref().map(|g| g.0) == Some(Source::Have);
        if drop_copy && l.access.is_some() {
            l.access = None;
            self.push(Action::SetAccess { page, access: None });
        }
        self.fail_waiters(page, error);
        self.try_complete(page);
    }

    /// Completes the pending transaction when grant, data and acks are all in.
    fn try_complete(&mut self, page: PageId) {
        let peers = &self.peers;
        let Some(l) = self.local.get_mut(&page) else { return };
        let Some(p) = &l.pending else { return };
        let Some((source, acks)) = &p.grant else { return };
        let have_data = match source {
            Source::Owner(..) => p.data,
            Source::Disk => p.loaded,
            Source::Have => true,
        };
        // An ack is in, or not needed: that incarnation is dead, and its copy with it.
        let acked = |&(n, inc): &(NodeId, Incarnation)| {
            p.acked.contains(&(n, inc)) || peers.get(n.0 as usize).is_none_or(|q| q.incarnation > inc || !q.up)
        };
        if !acks.iter().all(acked) {
            return;
        }
        if p.aborted {
            // Every invalidated copy is gone: the manager may go on.
            let txn = p.txn;
            l.pending = None;
            let manager = self.manager(page);
            self.send(manager, Msg::Done { page, txn, ok: false });
            self.request_if_needed(page);
            return;
        }
        if !have_data {
            return;
        }
        let (txn, access) = (p.txn, p.access);
        // A read the owner's data granted is over at the manager already.
        let report = !(access == Access::Read && p.granted_by_data);
        l.pending = None;
        l.access = Some(access);
        self.push(Action::SetAccess {
            page,
            access: Some(access),
        });
        if report {
            let manager = self.manager(page);
            self.send(manager, Msg::Done { page, txn, ok: true });
        }
        self.request_if_needed(page);
    }

    // ----- membership -----

    /// Incarnation `incarnation` of node `n` is dead (news of an older one are ignored).
    pub fn peer_down(&mut self, n: NodeId, incarnation: Incarnation) {
        let Some(p) = self.peers.get(n.0 as usize).copied() else {
            return;
        };
        if n == self.me || incarnation < p.incarnation {
            return;
        }
        self.peers[n.0 as usize] = Peer { incarnation, up: false };
        if p.up {
            let retry = self.node_failed(n, false);
            debug_assert!(retry.is_empty(), "a request retried with a node down");
        }
    }

    /// Node `n` runs as `incarnation`. A newer incarnation than the one known proves the old
    /// one failed, with its memory; a dead incarnation never comes back up (fencing).
    pub fn peer_up(&mut self, n: NodeId, incarnation: Incarnation) {
        let Some(p) = self.peers.get(n.0 as usize).copied() else {
            return;
        };
        if n == self.me || incarnation <= p.incarnation {
            return;
        }
        if p.incarnation.0 != 0 && (!self.local.is_empty() || !self.dir.is_empty()) {
            self.fenced[n.0 as usize] = incarnation;
        }
        // The files the new incarnation may not serve from the disks as if nobody held them:
        // those this node holds pages or directory entries of (the shell tells of segments),
        // but settled ones, whose copies here go below.
        let files: HashSet<FileId> = self
            .local
            .keys()
            .chain(self.dir.keys())
            .map(|pg| pg.file)
            .filter(|f| !self.settled.contains(f))
            .collect();
        self.fenced_files[n.0 as usize] = files;
        self.peers[n.0 as usize] = Peer { incarnation, up: false };
        let retry = if p.up { self.node_failed(n, true) } else { Vec::new() };
        self.peers[n.0 as usize].up = true;
        let settled = std::mem::take(&mut self.settled);
        self.drop_managed_by(n, |f| settled.contains(&f));
        self.settled = settled;
        // Requests the old incarnation never granted go to the new one.
        for page in retry {
            self.request_if_needed(page);
        }
    }

    /// Node `n`'s incarnation failed (`restarted`: it runs again as a new one). Returns the
    /// pages whose faults wait for a request to be sent again to the new incarnation.
    fn node_failed(&mut self, n: NodeId, restarted: bool) -> Vec<PageId> {
        let mut retry = Vec::new();
        // As requester.
        let mut pages: Vec<PageId> = self.local.keys().copied().collect();
        pages.sort();
        for page in pages {
            let manager = self.manager(page);
            let settled = self.settled.contains(&page.file);
            let Some(p) = self.local.get_mut(&page).and_then(|l| l.pending.as_mut()) else {
                continue;
            };
            let waits_data = matches!(p.grant, Some((Source::Owner(o, _), _)) if o == n) && !p.data;
            if manager == n && restarted && settled && p.grant.is_none() && !p.data {
                // A settled file's request the old manager never granted (no copy moved for
                // it): asked again of the new incarnation, which rebuilds its directory.
                if let Some(l) = self.local.get_mut(&page) {
                    l.pending = None;
                }
                retry.push(page);
            } else if manager == n {
                // The manager's state is gone with it: nothing more will come, and no one is
                // left to tell (its invalidations may have been dropped as stale, too).
                if let Some(l) = self.local.get_mut(&page) {
                    l.pending = None;
                }
                self.fail_waiters(page, FaultError::ManagerDown);
            } else if waits_data {
                self.abort_pending(page, FaultError::PageLost);
            } else {
                self.try_complete(page);
            }
        }
        // As manager.
        for reqs in self.parked.values_mut() {
            reqs.retain(|(_, q)| q.txn.node != n);
        }
        self.parked.retain(|_, reqs| !reqs.is_empty());
        let mut pages: Vec<PageId> = self.dir.keys().copied().collect();
        pages.sort();
        for page in pages {
            let Some(d) = self.dir.get_mut(&page) else { continue };
            d.queue.retain(|q| q.txn.node != n);
            d.copyset.remove(&n);
            // Reads the dead node was forwarded to serve: in progress again, granted late
            // below, so that each requester says whether its data got out.
            d.forwarded.retain(|(t, _, _)| t.node != n);
            let mut k = 0;
            while k < d.forwarded.len() {
                let (txn, o, inc) = d.forwarded[k];
                if o == n {
                    d.forwarded.swap_remove(k);
                    d.busy.push(Busy {
                        txn,
                        access: Access::Read,
                        source: Source::Owner(o, inc),
                        implied: true,
                        acks: Vec::new(),
                    });
                } else {
                    k += 1;
                }
            }
            let owner_gone = d.owner == Some(n);
            // Requesters that died mid-transaction. After a write transaction every other copy
            // may be gone already, and the requester may have written (its `Done` died with
            // it): the latest version is lost.
            let before = d.busy.len();
            let mut wrote = false;
            d.busy.retain(|b| {
                let dead = b.txn.node == n;
                wrote |= dead && b.access == Access::Write;
                !dead
            });
            let ended = d.busy.len() < before;
            if wrote {
                d.forget_copies();
                d.lost = true;
            }
            // Requesters waiting on the dead owner's `Data` as their grant: the grant now, so
            // that they see their source is gone (its `Data`, if any got out, still counts).
            let mut late = Vec::new();
            for b in d.busy.iter_mut() {
                if b.implied && matches!(b.source, Source::Owner(o, _) if o == n) {
                    b.implied = false;
                    late.push(b.clone());
                }
            }
            if owner_gone {
                if !d.busy.is_empty() {
                    // The requesters' `Done`s say whether the data got out before it died (a
                    // requester in a transaction may not have its data yet): another holder
                    // takes over once none is in progress (`settle`).
                    d.owner = None;
                    d.writable = false;
                } else {
                    d.reassign_or_lose();
                }
            }
            if ended && d.busy.is_empty() {
                d.settle();
            }
            self.stats.late_grants += late.len() as u64;
            for b in late {
                let grant = Msg::Grant {
                    page,
                    txn: b.txn,
                    access: b.access,
                    source: b.source,
                    acks: b.acks,
                };
                self.send(b.txn.node, grant);
            }
            if ended {
                self.next_in_queue(page);
            }
        }
        retry
    }

    // ----- messages -----

    /// A message from a peer (or this node). See [`Receipt`] for what the shell does with
    /// its payload.
    pub fn receive(&mut self, env: Envelope) -> Result<Receipt, ProtocolError> {
        let from = env.from;
        let Some(known) = self.peers.get(from.0 as usize).copied() else {
            return Ok(Receipt::Dropped);
        };
        if env.from_incarnation > known.incarnation {
            // A newer incarnation: proof that the one we knew is gone.
            self.peer_up(from, env.from_incarnation);
        }
        let known = self.peers[from.0 as usize];
        if env.to_incarnation != self.incarnation || !known.up || env.from_incarnation != known.incarnation {
            return Ok(Receipt::Dropped);
        }
        // The requester's incarnation travels in the transaction id: a newer one than known
        // means it restarted (and replies must go to the new incarnation).
        let txn = env.msg.txn();
        if self
            .peers
            .get(txn.node.0 as usize)
            .is_some_and(|p| txn.incarnation > p.incarnation)
        {
            self.peer_up(txn.node, txn.incarnation);
        }
        let page = env.msg.page();
        let manager = self.manager(page);
        match env.msg {
            Msg::Req { txn, access, have, .. } => {
                ensure!(
                    manager == self.me,
                    from,
                    page,
                    "request sent to a node that does not manage the page"
                );
                ensure!(
                    txn.node == from && txn.incarnation == env.from_incarnation,
                    from,
                    page,
                    "request for another node's transaction"
                );
                self.on_request(page, Queued { txn, access, have }, from)?;
                Ok(Receipt::Accepted)
            }
            Msg::Done { txn, ok, .. } => {
                ensure!(
                    manager == self.me,
                    from,
                    page,
                    "done sent to a node that does not manage the page"
                );
                self.on_done(page, txn, ok, from)?;
                Ok(Receipt::Accepted)
            }
            Msg::Nack { txn, .. } => {
                ensure!(
                    manager == self.me,
                    from,
                    page,
                    "nack sent to a node that does not manage the page"
                );
                self.on_nack(page, txn, from);
                Ok(Receipt::Accepted)
            }
            Msg::Grant {
                txn,
                access,
                source,
                acks,
                ..
            } => {
                ensure!(
                    from == manager,
                    from,
                    page,
                    "grant from a node that does not manage the page"
                );
                self.on_grant(page, txn, access, source, acks, from)?;
                Ok(Receipt::Accepted)
            }
            Msg::Deny { txn, error, .. } => {
                ensure!(
                    from == manager,
                    from,
                    page,
                    "deny from a node that does not manage the page"
                );
                let pending = self.local.get(&page).and_then(|l| l.pending.as_ref()).map(|p| p.txn);
                if pending == Some(txn) {
                    if let Some(l) = self.local.get_mut(&page) {
                        l.pending = None;
                    }
                    self.fail_waiters(page, error);
                }
                Ok(Receipt::Accepted)
            }
            Msg::Fwd {
                txn, to, access, grant, ..
            } => {
                ensure!(
                    from == manager,
                    from,
                    page,
                    "forward from a node that does not manage the page"
                );
                self.on_forward(page, txn, to, access, grant);
                Ok(Receipt::Accepted)
            }
            Msg::Inval { txn, .. } => {
                ensure!(
                    from == manager,
                    from,
                    page,
                    "invalidation from a node that does not manage the page"
                );
                let l = self.local.entry(page).or_default();
                let dropped = l.access.take().is_some();
                // A read with neither grant nor data may have been forwarded already (the
                // manager then counts this node in the copyset, and the write this ack lets
                // go on may be served before the owner sends to us): its data can no longer
                // be trusted. Ask again.
                let abandon = l
                    .pending
                    .as_ref()
                    .is_some_and(|p| p.access == Access::Read && p.grant.is_none() && !p.data && !p.aborted);
                if abandon {
                    l.pending = None;
                    self.stats.abandoned_reads += 1;
                }
                if dropped {
                    self.stats.invalidations += 1;
                    self.push(Action::SetAccess { page, access: None });
                }
                self.send(txn.node, Msg::InvalAck { page, txn });
                if abandon {
                    self.request_if_needed(page);
                }
                Ok(Receipt::Accepted)
            }
            Msg::InvalAck { txn, .. } => {
                if let Some(p) = self.local.get_mut(&page).and_then(|l| l.pending.as_mut()) {
                    if p.txn == txn {
                        p.acked.insert((from, env.from_incarnation));
                        self.try_complete(page);
                    }
                }
                Ok(Receipt::Accepted)
            }
            Msg::Data { txn, grant, .. } => {
                if let Some(acks) = &grant {
                    self.learn_incarnations(acks);
                }
                let l = self.local.entry(page).or_default();
                let holds = l.access.is_some();
                let Some(p) = l.pending.as_mut().filter(|p| p.txn == txn) else {
                    return Ok(Receipt::Dropped);
                };
                ensure!(!p.data, from, page, "data sent twice");
                ensure!(from != self.me, from, page, "data from this node itself");
                // Checked before the data's grant is recorded: a refused message changes
                // nothing.
                ensure!(!holds, from, page, "data for a page this node already holds");
                let source = Source::Owner(from, env.from_incarnation);
                match &p.grant {
                    Some((granted, _)) => ensure!(
                        *granted == source,
                        from,
                        page,
                        "data from a node that is not the granted source"
                    ),
                    // The data grants: from the owner, with the acks to collect. (A `Grant` may
                    // still follow if the manager thinks this owner died: it is then ignored.)
                    None => {
                        if let Some(acks) = grant {
                            p.grant = Some((source, acks));
                            p.granted_by_data = true;
                        }
                    }
                }
                p.data = true;
                self.stats.pages_in += 1;
                self.try_complete(page);
                Ok(Receipt::Install(page))
            }
        }
    }

    fn on_grant(
        &mut self,
        page: PageId,
        txn: TxnId,
        access: Access,
        source: Source,
        acks: Vec<(NodeId, Incarnation)>,
        from: NodeId,
    ) -> Result<(), ProtocolError> {
        self.learn_incarnations(&acks);
        if let Source::Owner(o, inc) = source {
            self.learn_incarnations(&[(o, inc)]);
        }
        // An owner that is down, or runs a later incarnation than the one that held the page,
        // has lost it.
        let alive = |s: &Svm, n: NodeId, inc: Incarnation| {
            s.peers.get(n.0 as usize)
                == Some(&Peer {
                    incarnation: inc,
                    up: true,
                })
        };
        let source_up = match source {
            Source::Owner(o, inc) => alive(self, o, inc),
            _ => true,
        };
        let mine = txn.node == self.me && txn.incarnation == self.incarnation && txn.seq < self.next_seq;
        let held = self.local.get(&page).and_then(|l| l.access);
        let pending = self
            .local
            .get(&page)
            .and_then(|l| l.pending.as_ref())
            .is_some_and(|p| p.txn == txn);
        if !pending {
            // A transaction of this node that is over here (completed by the owner's data, or
            // abandoned), granted late by a manager that waits for its report: whether this
            // node holds the page says whether the data got here (nothing else can have
            // changed it while the manager waits).
            if mine {
                self.send(
                    from,
                    Msg::Done {
                        page,
                        txn,
                        ok: held.is_some(),
                    },
                );
            }
            return Ok(());
        }
        let Some(p) = self.local.get_mut(&page).and_then(|l| l.pending.as_mut()) else {
            return Ok(());
        };
        if p.granted_by_data {
            // The owner's `Data` granted already; the manager sent this one because it
            // thought the owner died first. The same grant: nothing to do.
            ensure!(
                p.grant.as_ref().map(|g| (&g.0, &g.1)) == Some((&source, &acks)),
                from,
                page,
                "a late grant that differs from the one the data carried"
            );
            self.stats.redundant_grants += 1;
            return Ok(());
        }
        ensure!(p.grant.is_none(), from, page, "grant sent twice");
        ensure!(
            p.access == access,
            from,
            page,
            "grant of {access:?} for a {:?} request",
            p.access
        );
        ensure!(
            source != Source::Have || held.is_some(),
            from,
            page,
            "upgrade granted to a node without a copy"
        );
        if let Source::Owner(o, _) = source {
            ensure!(o != self.me, from, page, "told to fetch the page from itself");
        }
        if p.data {
            ensure!(
                matches!(source, Source::Owner(..)),
                from,
                page,
                "data arrived for a grant without an owner"
            );
        }
        p.grant = Some((source, acks));
        if !source_up && !p.data {
            self.abort_pending(page, FaultError::PageLost);
            return Ok(());
        }
        if source == Source::Disk {
            self.push(Action::Load { page, txn });
        }
        self.try_complete(page);
        Ok(())
    }

    /// Incarnations newer than known are news: those nodes are up.
    fn learn_incarnations(&mut self, mentioned: &[(NodeId, Incarnation)]) {
        for &(n, inc) in mentioned {
            if self.peers.get(n.0 as usize).is_some_and(|p| inc > p.incarnation) {
                self.peer_up(n, inc);
            }
        }
    }

    fn on_forward(
        &mut self,
        page: PageId,
        txn: TxnId,
        to: NodeId,
        access: Access,
        grant: Option<Vec<(NodeId, Incarnation)>>,
    ) {
        let manager = self.manager(page);
        let held = self.local.get(&page).and_then(|l| l.access);
        if held.is_none() {
            self.send(manager, Msg::Nack { page, txn });
            return;
        }
        // A page is snapshotted for `Data` only when nobody can write it any more: the
        // write-protection comes first (on real hardware it also drains the writers' stores),
        // else a store landing between the snapshot and the drop would be lost.
        if held == Some(Access::Write) {
            if let Some(l) = self.local.get_mut(&page) {
                l.access = Some(Access::Read);
            }
            self.push(Action::SetAccess {
                page,
                access: Some(Access::Read),
            });
        }
        match access {
            Access::Read => {
                self.send(to, Msg::Data { page, txn, grant });
            }
            Access::Write => {
                self.send(to, Msg::Data { page, txn, grant });
                if let Some(l) = self.local.get_mut(&page) {
                    l.access = None;
                }
                self.stats.invalidations += 1;
                self.push(Action::SetAccess { page, access: None });
            }
        }
    }

    // ----- manager side -----

    fn on_request(&mut self, page: PageId, q: Queued, from: NodeId) -> Result<(), ProtocolError> {
        let txn = q.txn;
        // An older request of the same requester still waiting here was abandoned (an
        // invalidation overtook the read it asked for): the new one takes its place.
        let older = |t: &TxnId| t.node == from && t.incarnation == txn.incarnation && t.seq < txn.seq;
        let d = self.dir.entry(page).or_default();
        d.queue.retain(|w| !older(&w.txn));
        if let Some(reqs) = self.parked.get_mut(&page.file) {
            reqs.retain(|(p, w)| !(*p == page && older(&w.txn)));
        }
        // One request per node at a time. (Its previous transaction may still be busy here: the
        // `Done` and this request can cross; the request then waits in the queue.)
        let d = self.dir.entry(page).or_default();
        let dup = d.busy.iter().any(|b| b.txn == txn)
            || d.queue.iter().any(|w| w.txn.node == from)
            || self
                .parked
                .get(&page.file)
                .is_some_and(|r| r.iter().any(|(p, w)| *p == page && w.txn.node == from));
        ensure!(!dup, from, page, "a second request while one is in progress");
        if d.lost {
            let error = FaultError::PageLost;
            self.send(from, Msg::Deny { page, txn, error });
            return Ok(());
        }
        if !self.serves(page.file) {
            let waiting: usize = self.parked.values().map(Vec::len).sum();
            if waiting >= MAX_PARKED_REQUESTS {
                let error = FaultError::ManagerRestarted;
                self.send(from, Msg::Deny { page, txn, error });
                return Ok(());
            }
            if self.parked.get(&page.file).is_none_or(Vec::is_empty) {
                self.push(Action::CheckFence { file: page.file });
            }
            self.parked.entry(page.file).or_default().push((page, q));
            return Ok(());
        }
        let bound = self.nodes as usize;
        let d = self.dir.entry(page).or_default();
        assert!(d.queue.len() < bound, "more queued requests than nodes");
        d.queue.push_back(q);
        self.next_in_queue(page);
        Ok(())
    }

    /// Starts the next queued transactions of `page`: the first one if it is idle, and while
    /// only reads served by a live owner are in progress, further reads (from nodes with no
    /// transaction in progress here). A read the owner serves is over here once forwarded:
    /// the requester joins the copyset at once and sends no `Done` (see [`Directory::forwarded`]).
    fn next_in_queue(&mut self, page: PageId) {
        loop {
            let Some(d) = self.dir.get_mut(&page) else { return };
            let Some(&front) = d.queue.front() else {
                return;
            };
            if !d.busy.is_empty() {
                let joins = front.access == Access::Read
                    && d.owner.is_some()
                    && !d.lost
                    && d.busy
                        .iter()
                        .all(|b| b.access == Access::Read && b.txn.node != front.txn.node);
                if !joins {
                    return;
                }
            }
            let Some(Queued { txn, access, have }) = d.queue.pop_front() else {
                return;
            };
            let r = txn.node;
            // Its new request supersedes what the requester asked before.
            d.forwarded.retain(|(t, _, _)| t.node != r);
            let joined = access == Access::Read && (!d.busy.is_empty() || !d.forwarded.is_empty());
            self.stats.joined_reads += joined as u64;
            if !have && d.copyset.remove(&r) && d.owner == Some(r) {
                // The owner by these books has no copy: as if it had lost it.
                d.owner = None;
                d.writable = false;
                if d.busy.is_empty() {
                    d.reassign_or_lose();
                }
            }
            if d.lost {
                self.send(
                    txn.node,
                    Msg::Deny {
                        page,
                        txn,
                        error: FaultError::PageLost,
                    },
                );
                continue;
            }
            let source = match d.owner {
                None => Source::Disk,
                Some(_) if d.copyset.contains(&r) => Source::Have,
                Some(o) => Source::Owner(o, self.peers[o.0 as usize].incarnation),
            };
            // A write invalidates every other copy; a forwarding owner drops its own.
            let mut invals = Vec::new();
            if access == Access::Write {
                let forwarder = match source {
                    Source::Owner(o, _) => Some(o),
                    _ => None,
                };
                invals = d
                    .copyset
                    .iter()
                    .copied()
                    .filter(|&c| c != r && Some(c) != forwarder)
                    .collect();
                // Every forwarded reader is in the copyset: it is invalidated, and abandons
                // its read if the data has not come yet.
                d.forwarded.clear();
            }
            let acks: Vec<(NodeId, Incarnation)> = invals
                .iter()
                .map(|&c| (c, self.peers[c.0 as usize].incarnation))
                .collect();
            // With the owner as source, the owner's `Data` grants (carrying the acks to
            // collect): one message fewer on every such fault, and one fewer for the requester
            // to wait for.
            let implied = matches!(source, Source::Owner(..));
            self.stats.implied_grants += implied as u64;
            match source {
                Source::Owner(o, inc) if access == Access::Read => {
                    // Over here: the owner keeps its copy (read-only) and the requester will
                    // hold one. Should the data not reach it, an invalidation or a late grant
                    // sorts it out (the requester re-requests, or reports it failed).
                    d.copyset.insert(r);
                    d.writable = false;
                    d.forwarded.push((txn, o, inc));
                    assert!(
                        d.forwarded.len() <= self.nodes as usize,
                        "a forwarded read per node at most"
                    );
                    self.stats.reads_without_done += 1;
                }
                _ => d.busy.push(Busy {
                    txn,
                    access,
                    source,
                    implied,
                    acks: acks.clone(),
                }),
            }
            // The forward first: its path (owner, then the page's bytes to the requester) is
            // the longest, and the shell sends in this order.
            if let Source::Owner(o, _) = source {
                self.send(
                    o,
                    Msg::Fwd {
                        page,
                        txn,
                        to: r,
                        access,
                        grant: implied.then(|| acks.clone()),
                    },
                );
            }
            for c in invals {
                self.send(c, Msg::Inval { page, txn });
            }
            if !implied {
                self.send(
                    r,
                    Msg::Grant {
                        page,
                        txn,
                        access,
                        source,
                        acks,
                    },
                );
            }
        }
    }

    fn on_done(&mut self, page: PageId, txn: TxnId, ok: bool, from: NodeId) -> Result<(), ProtocolError> {
        let Some(d) = self.dir.get_mut(&page) else {
            return Ok(());
        };
        let Some(i) = d.busy.iter().position(|b| b.txn == txn) else {
            return Ok(());
        };
        let b = d.busy[i].clone();
        ensure!(
            from == txn.node,
            from,
            page,
            "done from a node that is not the requester"
        );
        let r = txn.node;
        match (ok, b.access) {
            (true, Access::Read) => {
                match b.source {
                    Source::Disk => {
                        d.owner = Some(r);
                        d.dirty = false;
                    }
                    // The owner died after sending: the requester's copy is the latest.
                    Source::Owner(..) if d.owner.is_none() => d.owner = Some(r),
                    Source::Owner(..) | Source::Have => {}
                }
                d.copyset.insert(r);
                d.writable = false;
            }
            (true, Access::Write) => {
                d.owner = Some(r);
                d.copyset = BTreeSet::from([r]);
                d.writable = true;
                d.dirty = true;
            }
            (false, Access::Read) => {
                // Nothing changed hands, except that a forwarding owner downgraded. (A read
                // forwarded without a `Done` put the requester in the copyset.)
                // Without an owner (it died), another holder takes over once no transaction
                // is in progress (`settle`): a requester still in one may not have the data.
                d.copyset.remove(&r);
                if d.owner == Some(r) {
                    d.owner = None;
                }
                if matches!(b.source, Source::Owner(..)) {
                    d.writable = false;
                }
            }
            (false, Access::Write) => {
                // Every other copy may have been invalidated or handed over.
                if b.source != Source::Disk {
                    d.forget_copies();
                }
            }
        }
        d.busy.swap_remove(i);
        if d.busy.is_empty() {
            d.settle();
        }
        self.next_in_queue(page);
        Ok(())
    }

    fn on_nack(&mut self, page: PageId, txn: TxnId, from: NodeId) {
        let Some(d) = self.dir.get_mut(&page) else { return };
        if let Some(k) = d.forwarded.iter().position(|&(t, o, _)| t == txn && o == from) {
            // A read forwarded to an owner (by these books) that has no copy: one that took over
            // after a death and had itself abandoned its read. No write started since (it would
            // have cleared the record), so the requester still waits: it is served again.
            d.forwarded.swap_remove(k);
            d.copyset.remove(&from);
            d.copyset.remove(&txn.node);
            if d.owner == Some(from) {
                d.owner = None;
                d.writable = false;
                if d.busy.is_empty() {
                    d.reassign_or_lose();
                }
            }
            let bound = self.nodes as usize;
            if d.queue.len() < bound && !d.queue.iter().any(|w| w.txn.node == txn.node) {
                d.queue.push_front(Queued {
                    txn,
                    access: Access::Read,
                    have: false,
                });
            }
            self.stats.reforwarded_reads += 1;
            self.next_in_queue(page);
            return;
        }
        let Some(i) = d.busy.iter().position(|b| b.txn == txn) else {
            return;
        };
        let b = d.busy[i].clone();
        if !matches!(b.source, Source::Owner(o, _) if o == from) {
            return;
        }
        // The owner has no copy (it cannot happen without a failure; fail closed). A write's
        // invalidations may still be in flight: the page is lost rather than handed out.
        d.copyset.remove(&from);
        if b.access == Access::Write {
            d.forget_copies();
            d.lost = true;
        } else {
            // Another holder takes over once no transaction is in progress (`settle`).
            d.owner = None;
            d.writable = false;
        }
        d.busy.swap_remove(i);
        if d.busy.is_empty() {
            d.settle();
        }
        self.send(
            txn.node,
            Msg::Deny {
                page,
                txn,
                error: FaultError::PageLost,
            },
        );
        self.next_in_queue(page);
    }
}

impl fmt::Display for TxnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}.{}", self.node, self.incarnation.0, self.seq)
    }
}

/// Where a node stands on one page, by the node's own books (for invariant checks).
pub fn holders(nodes: &[&Svm], page: PageId) -> BTreeMap<NodeId, Access> {
    nodes
        .iter()
        .filter_map(|n| n.access(page).map(|a| (n.me(), a)))
        .collect()
}
