//! The node's core ([`Node`]): configuration and identity, the page store and the applied
//! namespace (published by the metadata log), the failure detector and heartbeats, the transport and requests to peers (a
//! request to itself goes to the daemon's handler, wired at start-up), metadata submission
//! through the coordinator, and the page-store requests peers make. Every subsystem is built
//! on it and gets it as its door; it imports none of them (the subsystems and the dispatch sit
//! above it: see `dispatch`).
//!
//! Failures are suspected, not known: the failure detector gives *impressions*
//! ([`Node::is_reachable`]: route around a silent node, elect a coordinator); the metadata's
//! coordinator turns an impression that outlasts the failure timeout into a committed
//! *verdict* (`MetaOp::DeclareDown`), and every decision that a node failed (coherence, the
//! launcher, barriers and locks) follows verdicts only ([`Node::is_declared_down`]). Messages
//! from an incarnation declared down are dropped by the receivers ([`Node::fenced_sender`]);
//! the node itself, on learning its verdict, fences itself ([`Node::fence_self`]).
//!
//! Invariants:
//! - a page is written to this node's store only if placement makes this node's logical id its
//!   holder in that role (checked on every `WritePages`);
//! - metadata operations are entries of the metadata log (`replication`), ordered by its leader
//!   (the coordinator); a submission is answered once applied at the leader and here, and a
//!   lookup that must see every answered operation first applies up to the leader's read index
//!   ([`Node::meta_fresh`]);
//! - blocking disk work runs on the blocking pool, never on the async workers.

use crate::failstop::Locked;
pub use crate::op::{blocking, peer_error, OpError};
use crate::peer::{BadCopy, Heartbeat, PageState, PeerReq, PeerResp};
use crate::transport::{Handler, NetError, Transport};
use psls_ckpt::frames::DiskWrite;
use psls_cluster::log::SubmitError;
use psls_cluster::membership::{Liveness, Membership};
use psls_cluster::verdicts::{self, Verdicts};
use psls_cluster::watch::{Duties, Duty, Topology};
use psls_ipc::proto::NodeState;
use psls_ipc::{ClusterConfig, ErrorKind, NodeEntry};
use psls_pfs::logstore::{LogStore, Opened};
use psls_pfs::meta::{MetaOp, MetaState};
use psls_pfs::{PageRef, PageStore, Placement, ReadStatus, Role};
use psls_svm::{FileId, NodeId, PAGE_SIZE};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// What shared memory adds to a heartbeat, given the number of logical nodes: segments held,
/// the incarnation known of every logical node, and those seen back while holding state.
pub type SvmBeat = Arc<dyn Fn(usize) -> SvmFigures + Send + Sync>;

/// What shared memory adds to a heartbeat (see [`Heartbeat`]).
#[derive(Default)]
pub struct SvmFigures {
    pub segments: u64,
    pub view: Vec<u64>,
    pub fenced: Vec<u64>,
    pub dirty_pages: u64,
}

/// The node's core: configuration, identity, the page store and the metadata replica,
/// membership, the transport, and requests to peers. Every subsystem (shared memory, the
/// PFS operations, barriers and locks, the launcher) is built on it and gets it as its door;
/// it knows none of them.
pub struct Node {
    /// What the node counts for Prometheus (`crate::metrics`).
    pub metrics: Arc<crate::metrics::Metrics>,
    pub cfg: Arc<ClusterConfig>,
    pub me: NodeEntry,
    pub incarnation: u64,
    pub store: Arc<PageStore>,
    /// Memory checkpoints' recovery copies held here.
    pub frames: crate::frames::RecoveryArea,
    /// The applied namespace, published by the metadata log after every write (a clone is
    /// O(1): readers take it whole).
    meta: Mutex<MetaState>,
    /// The failure detector over the peers this node watches (time: milliseconds since
    /// `started`): its topology peers, the leader's probes, and every voter while a new node
    /// learns whether the cluster is new.
    members: Mutex<Membership<Heartbeat>>,
    /// Who heartbeats whom (`psls_cluster::watch`).
    topology: Topology,
    /// This node's part in failure detection beyond its detector: its reports to the
    /// metadata leader, and the leader's tally of everyone's.
    watching: Mutex<Watching>,
    /// The latest figures each node sent (its heartbeats, its reports to the leader, or the
    /// leader's table of them), with when they came (ms).
    figures: Mutex<HashMap<String, (Heartbeat, u64)>>,
    /// The heartbeat built last, and when ([`Node::heartbeat_recent`]).
    recent_beat: Mutex<Option<(Heartbeat, Instant)>>,
    started: Instant,
    pub net: Arc<Transport>,
    pub placement: Placement,
    pub request_timeout: Duration,
    pub euid: u32,
    /// The metadata log and its leader, the coordinator (the shell of `psls_cluster::log`).
    pub replication: crate::replication::Replication,
    pub(crate) rebuild_running: AtomicBool,
    /// Started on a blank data folder, and not yet decided whether its copies are rebuilt
    /// (`pfs::rejoin_blank`): until then it says it is rebuilding (it holds no copy yet).
    pub(crate) rejoin_pending: AtomicBool,
    pub rebuild_done: AtomicU64,
    pub rebuild_total: AtomicU64,
    /// Pages written to this node's page store, and its fsyncs (for the "no disk I/O during a
    /// memory checkpoint" figures).
    pub store_page_writes: AtomicU64,
    /// Pages this node's memory-checkpoint writes took, and the recovery copies of them it
    /// sent to other nodes (a copy kept here is no transfer).
    pub ckpt_pages_taken: AtomicU64,
    pub ckpt_pages_sent: AtomicU64,
    disk_used: AtomicU64,
    disk_free: AtomicU64,
    pub shutdown: tokio::sync::Notify,
    /// Told each time a peer is known as a new incarnation (its restarts wait in `restarts`):
    /// the transport forgets its connections to the old one, and the subsystems that keep
    /// their own view of the peers (shared memory) catch up at once, not at their next tick.
    pub peer_restarted: tokio::sync::Notify,
    /// Peers known as a new incarnation, not yet acted on ([`Node::take_restarts`]).
    restarts: Mutex<Vec<(String, u64)>>,
    /// Told each time committed metadata is installed here (for [`Node::meta_reached`]).
    meta_installed: tokio::sync::Notify,
    /// The daemon's request handler, for the requests a node sends itself (set at start-up).
    local: OnceLock<Arc<dyn Handler>>,
    /// What shared memory adds to every heartbeat (set at start-up).
    beat: OnceLock<SvmBeat>,
    /// Message link round trips under way (`LinkPing` id → its waiter).
    pub link_pings: Mutex<HashMap<u64, tokio::sync::oneshot::Sender<usize>>>,
    pub next_link_ping: AtomicU64,
    /// The verdict book (a pure machine): committed verdicts, copied from the metadata at
    /// every install (every message asks), what peers heard, declarations under way, and this
    /// incarnation's own fence.
    verdicts: Mutex<Verdicts>,
    /// What fencing this incarnation does (set at start-up): stop its ranks, rejoin anew.
    fencer: OnceLock<Fencer>,
    fencing: AtomicBool,
}

/// A node's part in failure detection beyond its own detector (see `psls_cluster::watch`).
struct Watching {
    /// Its failure-detection duties (a pure machine): its reports, and the leader's tally.
    duties: Duties,
    /// The figures last sent to the leader: (leader, figures, when in ms).
    sent_figures: Option<(String, Heartbeat, u64)>,
    /// When this node last pulled the leader's table of figures (ms).
    pulled_ms: Option<u64>,
    /// When each node was first seen declared down here (the voters lost for good).
    voter_down_seen: HashMap<String, u64>,
}

/// Figures sent to the leader again after this long even when unchanged (ms).
const FIGURES_REFRESH_MS: u64 = 30_000;

/// How long a pulled table of the leader's figures serves before it is pulled again (ms).
const FIGURES_PULL_MS: u64 = 1_000;

/// Most restarts of peers queued for the daemon's restart task before they are folded to
/// each peer's latest.
const MAX_QUEUED_RESTARTS: usize = 1024;

/// What the daemon does when its incarnation is fenced (given the reason and the incarnation
/// declared down): it never returns.
pub type Fencer = Arc<dyn Fn(&str, u64) + Send + Sync>;

impl Node {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: Arc<ClusterConfig>,
        me: NodeEntry,
        incarnation: u64,
        store: Arc<PageStore>,
        meta: (LogStore, Opened),
        net: Transport,
        now: Instant,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Node {
        let topology = Topology::new(
            cfg.all().map(|n| (n.name.clone(), n.failure_domain().to_string())),
            cfg.cluster.heartbeat_min_peers,
        );
        let peers = topology.peers_of(&me.name).into_iter().map(String::from);
        let members = Membership::new(peers, cfg.cluster.heartbeat_timeout_ms, 0);
        let duties = Duties::new(
            me.name.clone(),
            cfg.cluster.heartbeat_interval_ms,
            cfg.cluster.heartbeat_timeout_ms,
        );
        let nodes = cfg.all().map(|n| n.name.clone()).collect();
        let placement = Placement::new(cfg.nodes.len() as u32).expect("validated config has >= 2 nodes");
        let capacity_frames = me.memory_mb * (1024 * 1024 / PAGE_SIZE as u64);
        let verdicts = Verdicts::new(me.name.clone(), incarnation);
        Node {
            request_timeout: Duration::from_millis(cfg.cluster.request_timeout_ms),
            cfg,
            me,
            incarnation,
            store,
            // The node's memory capacity, in frames, is what recovery copies may use.
            frames: crate::frames::RecoveryArea::new(capacity_frames),
            meta: Mutex::new(meta.1.durable.state.clone()),
            members: Mutex::new(members),
            topology,
            watching: Mutex::new(Watching {
                duties,
                sent_figures: None,
                pulled_ms: None,
                voter_down_seen: HashMap::new(),
            }),
            figures: Mutex::new(HashMap::new()),
            recent_beat: Mutex::new(None),
            started: now,
            net: Arc::new(net),
            placement,
            euid: nix::unistd::geteuid().as_raw(),
            replication: crate::replication::Replication::new(nodes, meta.0, meta.1),
            rebuild_running: AtomicBool::new(false),
            rejoin_pending: AtomicBool::new(false),
            rebuild_done: AtomicU64::new(0),
            rebuild_total: AtomicU64::new(0),
            store_page_writes: AtomicU64::new(0),
            ckpt_pages_taken: AtomicU64::new(0),
            ckpt_pages_sent: AtomicU64::new(0),
            disk_used: AtomicU64::new(0),
            disk_free: AtomicU64::new(0),
            shutdown: tokio::sync::Notify::new(),
            peer_restarted: tokio::sync::Notify::new(),
            restarts: Mutex::new(Vec::new()),
            meta_installed: tokio::sync::Notify::new(),
            local: OnceLock::new(),
            beat: OnceLock::new(),
            link_pings: Mutex::new(HashMap::new()),
            next_link_ping: AtomicU64::new(0),
            verdicts: Mutex::new(verdicts),
            fencer: OnceLock::new(),
            fencing: AtomicBool::new(false),
            metrics,
        }
    }

    pub fn name(&self) -> &str {
        &self.me.name
    }

    /// The cluster's cleaning policy (checked when the daemon started).
    pub fn default_cleaning(&self) -> psls_ckpt::cleaning::Policy {
        self.cfg
            .cluster
            .cleaning
            .parse()
            .unwrap_or(psls_ckpt::cleaning::Policy::P1)
    }

    /// Wires the daemon's request handler (for requests to this node itself) and what shared
    /// memory adds to heartbeats. Called once, at start-up.
    pub fn wire(&self, local: Arc<dyn Handler>, beat: SvmBeat, fencer: Fencer) {
        let _ = self.local.set(local);
        let _ = self.beat.set(beat);
        let _ = self.fencer.set(fencer);
        self.refresh_verdicts();
    }

    /// Milliseconds since this daemon started: the failure detector's clock.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Whether the peer named `physical` by its certificate holds logical id `logical` now:
    /// a coherence message names its sender, and only that node may send it.
    pub fn speaks_for(&self, physical: &str, logical: NodeId) -> bool {
        self.physical_now(logical) == physical
    }

    /// The latest figures of `physical` known here (this node's own for itself): from its
    /// heartbeats if watched, its reports if this node leads, or the leader's table.
    pub fn heartbeat_of(&self, physical: &str) -> Option<Heartbeat> {
        if physical == self.me.name {
            return Some(self.heartbeat());
        }
        self.figures.locked().get(physical).map(|(h, _)| h.clone())
    }

    /// Makes the figures of every node at most [`FIGURES_PULL_MS`] old here: a node that does
    /// not lead pulls the leader's table (one request, at most once a period).
    pub async fn figures_fresh(self: &Arc<Self>) {
        if self.replication.is_leader() {
            return;
        }
        let now = self.now_ms();
        {
            let mut w = self.watching.locked();
            if w.pulled_ms.is_some_and(|t| now.saturating_sub(t) < FIGURES_PULL_MS) {
                return;
            }
            w.pulled_ms = Some(now);
        }
        let Some(leader) = self.replication.leader() else {
            return;
        };
        let timeout = self.read_timeout();
        if let Ok((PeerResp::FiguresTable { nodes }, _)) = self
            .call_data(&leader, PeerReq::FiguresAsk, bytes::Bytes::new(), timeout)
            .await
        {
            let now = self.now_ms();
            let mut f = self.figures.locked();
            for (name, hb) in nodes {
                if name == self.me.name || self.cfg.entry(&name).is_none() {
                    continue;
                }
                // What this node heard itself within the period is as fresh.
                if f.get(&name)
                    .is_some_and(|(_, at)| now.saturating_sub(*at) < FIGURES_PULL_MS)
                {
                    continue;
                }
                f.insert(name, (hb, now));
            }
        }
    }

    /// The leader's table of every node's latest figures (a peer's `FiguresAsk`).
    pub fn figures_table(&self) -> Vec<(String, Heartbeat)> {
        let mut out: Vec<(String, Heartbeat)> = self
            .figures
            .locked()
            .iter()
            .map(|(n, (h, _))| (n.clone(), h.clone()))
            .collect();
        out.push((self.me.name.clone(), self.heartbeat()));
        out
    }

    /// A node's figures sent to this node as the leader (`Figures`).
    pub fn handle_figures(&self, from: &str, hb: Heartbeat) {
        if hb.incarnation < self.heard_incarnation(from) {
            return;
        }
        let now = self.now_ms();
        self.figures.locked().insert(from.to_string(), (hb, now));
    }

    /// Runs `f` with a read-only look at the failure detector (its `heartbeat(peer)` is the
    /// last heartbeat heard from a peer).
    pub fn with_heartbeats<R>(&self, f: impl FnOnce(&Membership<Heartbeat>) -> R) -> R {
        f(&self.members.locked())
    }

    /// The applied namespace (an O(1) snapshot of it).
    pub fn meta_state(&self) -> MetaState {
        self.meta.locked().clone()
    }

    /// The applied namespace once it holds every operation answered before this call, cluster
    /// wide (the leader's read index): what a map, an open or a stat serves, so a file created
    /// through any node is found through this one.
    pub async fn meta_fresh(self: &Arc<Self>) -> Result<MetaState, OpError> {
        let deadline = Instant::now() + self.request_timeout * 3;
        let mut last = String::from("no metadata leader is known");
        while Instant::now() < deadline {
            match self.replication.read_index().await {
                Ok(index) => return self.meta_reached(index).await,
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(OpError::new(
            ErrorKind::Unavailable,
            format!("no majority of the metadata's voters is reachable ({last})"),
        ))
    }

    /// Publishes the applied namespace (the metadata log, after each write).
    /// The index of the metadata state published last.
    pub(crate) fn meta_index(&self) -> u64 {
        self.meta.locked().seq
    }

    pub(crate) fn publish_meta(&self, st: MetaState) {
        *self.meta.locked() = st;
        self.refresh_verdicts();
        self.meta_installed.notify_waiters();
    }

    /// Whether this node is the first of `voters` (config order: logical nodes, then spares)
    /// the failure detector hears, not counting those whose disk failed.
    pub fn first_live_voter(&self, voters: &[String]) -> bool {
        self.cfg
            .all()
            .filter(|n| voters.contains(&n.name))
            .find(|n| self.is_reachable(&n.name) && !self.disk_failed(&n.name))
            .is_some_and(|n| n.name == self.me.name)
    }

    /// What the leader knows of every node when it looks at the metadata log's voters: its
    /// name, failure domain, whether it is usable (up, not fencing, its disk working) and
    /// whether it is lost for good (declared down for `voter_replace_after_ms`, or declared
    /// down and replaced by a spare).
    pub fn voter_facts(&self) -> Vec<(String, String, bool, bool)> {
        let now = self.now_ms();
        let after = self.cfg.cluster.voter_replace_after_ms;
        let map: BTreeSet<String> = {
            let m = self.meta.locked();
            self.logical_map(&m).into_values().collect()
        };
        let spares: BTreeSet<&str> = self.cfg.spares.iter().map(|s| s.name.as_str()).collect();
        let downs: Vec<(String, bool)> = self
            .cfg
            .all()
            .map(|n| (n.name.clone(), n.name != self.me.name && self.is_declared_down(&n.name)))
            .collect();
        let mut w = self.watching.locked();
        let mut out = Vec::new();
        for (n, (name, down)) in self.cfg.all().zip(downs) {
            let since = if down {
                Some(*w.voter_down_seen.entry(name.clone()).or_insert(now))
            } else {
                w.voter_down_seen.remove(&name);
                None
            };
            let replaced = !map.contains(&name) && !spares.contains(name.as_str());
            let gone = since.is_some_and(|t| now.saturating_sub(t) >= after || replaced || self.disk_failed(&name));
            let usable = if name == self.me.name {
                self.may_lead()
            } else {
                !down
                    && self.state_of(&name) == psls_ipc::proto::NodeState::Up
                    && !self.disk_failed(&name)
                    && self.heartbeat_of(&name).is_some_and(|h| !h.meta_lost_disk)
            };
            out.push((name, n.failure_domain().to_string(), usable, gone));
        }
        out
    }

    /// Whether this node may lead the metadata (and so coordinate): not while it fences itself
    /// or its disk failed.
    pub fn may_lead(&self) -> bool {
        !self.fencing.load(Ordering::Relaxed) && !self.store.is_poisoned()
    }

    /// The committed metadata of file `id` now (by key).
    pub fn file_by_id(&self, id: FileId) -> Option<psls_pfs::meta::FileMeta> {
        self.meta.locked().file_by_id(id).cloned()
    }

    /// Logical → physical map (the configured one until the first replacement).
    pub fn logical_map(&self, st: &MetaState) -> BTreeMap<u32, String> {
        if st.logical.is_empty() {
            self.cfg
                .nodes
                .iter()
                .enumerate()
                .map(|(i, n)| (i as u32, n.name.clone()))
                .collect()
        } else {
            st.logical.clone()
        }
    }

    pub fn physical_of(&self, st: &MetaState, logical: NodeId) -> String {
        if st.logical.is_empty() {
            return self
                .cfg
                .nodes
                .get(logical.0 as usize)
                .map(|n| n.name.clone())
                .unwrap_or_default();
        }
        st.logical.get(&logical.0).cloned().unwrap_or_default()
    }

    /// The physical node holding `logical` now: [`Node::physical_of`] on the current
    /// metadata, without copying it (every coherence message asks).
    pub fn physical_now(&self, logical: NodeId) -> String {
        let m = self.meta.locked();
        self.physical_of(&m, logical)
    }

    /// The coordinator: the metadata log's leader as this node knows it — this node only while
    /// its failure detector's lease holds (it hears a majority). Barriers, locks, checkpoint
    /// rounds and metadata submissions all go there; no choice of coordinator is made from a
    /// local view of who is alive. (Job control also needs the log's own lease: `jobctl`.)
    pub fn coordinator_now(&self) -> Option<(u32, String)> {
        let leader = self.replication.leader()?;
        let leader = verdicts::coordinator(&self.me.name, Some(&leader), self.holds_lease())?.to_string();
        let m = self.meta.locked();
        let l = self
            .logical_map(&m)
            .into_iter()
            .find(|(_, p)| *p == leader)
            .map(|(l, _)| l)?;
        Some((l, leader))
    }

    /// Whether `physical`'s page store failed (this node's own, or as its latest figures say).
    pub fn disk_failed(&self, physical: &str) -> bool {
        if physical == self.me.name {
            return self.store.is_poisoned();
        }
        self.figures
            .locked()
            .get(physical)
            .is_some_and(|(h, _)| h.disk_failed.is_some())
    }

    /// Whether this node leads the metadata and a majority of its voters answered it within
    /// the lease, by the clock (the metadata log's lease: it does not grow with the cluster,
    /// as hearing a majority of every node did). Without it, it coordinates nothing.
    pub fn holds_lease(&self) -> bool {
        self.replication.lease_held()
    }

    pub fn my_logical(&self, st: &MetaState) -> Option<NodeId> {
        self.logical_map(st)
            .iter()
            .find(|(_, p)| **p == self.me.name)
            .map(|(l, _)| NodeId(*l))
    }

    /// The failure detector's impression: a watched peer was heard within the failure
    /// timeout; another one is reachable unless the last dial to it failed (this node always
    /// is). For routing and elections, never for deciding that it failed.
    pub fn is_reachable(&self, physical: &str) -> bool {
        if physical == self.me.name {
            return true;
        }
        {
            let m = self.members.locked();
            if m.watches(physical) {
                return m.is_live(self.now_ms(), physical);
            }
        }
        !self.net.dial_failing(physical)
    }

    /// Whether this node's failure detector watches `physical` now.
    pub fn watches(&self, physical: &str) -> bool {
        self.members.locked().watches(physical)
    }

    /// The newest incarnation of `physical` known here (0: none): heard from it (its
    /// heartbeats), reported by a peer, or committed as its start (`MetaOp::Boot`).
    pub fn heard_incarnation(&self, physical: &str) -> u64 {
        self.verdicts.locked().known(physical)
    }

    /// The verdict: the newest incarnation of `physical` known here was declared down
    /// (committed), and no later start of it is known.
    pub fn is_declared_down(&self, physical: &str) -> bool {
        self.verdicts.locked().is_down(physical)
    }

    /// Whether a message of incarnation `incarnation` of `physical` must be dropped: that
    /// incarnation was declared down.
    pub fn fenced_sender(&self, physical: &str, incarnation: u64) -> bool {
        !self.verdicts.locked().accepts(physical, incarnation)
    }

    /// The receivers' test of every message's stamp: whether a message of incarnation
    /// `incarnation` from `physical` is taken (not declared down, and an incarnation a daemon
    /// may have). A stamp is not taken as news of a restart: a peer's new incarnation is known
    /// from its heartbeats or its committed start.
    pub fn take_stamp(&self, physical: &str, incarnation: u64) -> bool {
        incarnation <= verdicts::MAX_INCARNATION && !self.fenced_sender(physical, incarnation)
    }

    fn queue_restarts(&self, restarts: Vec<(String, u64)>) {
        if restarts.is_empty() {
            return;
        }
        for (peer, incarnation) in &restarts {
            tracing::info!(node = %self.me.name, peer = peer.as_str(), incarnation, "peer restarted with a new incarnation");
        }
        let mut q = self.restarts.locked();
        q.extend(restarts);
        // Bounded: a peer's latest restart is all that matters.
        if q.len() > MAX_QUEUED_RESTARTS {
            let mut latest: BTreeMap<String, u64> = BTreeMap::new();
            for (p, i) in q.drain(..) {
                let e = latest.entry(p).or_insert(0);
                *e = (*e).max(i);
            }
            q.extend(latest);
        }
        drop(q);
        self.peer_restarted.notify_one();
    }

    /// The peers known as a new incarnation since the last call (each with it).
    pub fn take_restarts(&self) -> Vec<(String, u64)> {
        std::mem::take(&mut *self.restarts.locked())
    }

    /// Live: reachable and not declared down — what requests are routed by. A node that is
    /// silent but not yet declared down is not live here, but it has not failed either.
    pub fn is_live(&self, physical: &str) -> bool {
        physical == self.me.name || (self.is_reachable(physical) && !self.is_declared_down(physical))
    }

    pub fn state_of(&self, physical: &str) -> NodeState {
        if physical == self.me.name {
            NodeState::Up
        } else if self.is_declared_down(physical) {
            NodeState::Down
        } else {
            {
                let m = self.members.locked();
                if m.watches(physical) {
                    return match m.state(self.now_ms(), physical) {
                        Liveness::Up => NodeState::Up,
                        Liveness::Suspect => NodeState::Suspect,
                        Liveness::Down => NodeState::Down,
                    };
                }
            }
            // Not watched here: up once its start is known and while it can be dialled.
            if self.heard_incarnation(physical) == 0 || self.net.dial_failing(physical) {
                NodeState::Suspect
            } else {
                NodeState::Up
            }
        }
    }

    /// Whether logical node `l` can serve its copies (live and not rebuilding).
    pub fn can_serve(&self, st: &MetaState, l: NodeId) -> bool {
        !st.rebuilding.contains_key(&l.0) && self.is_live(&self.physical_of(st, l))
    }

    /// The coordinator ([`Node::coordinator_now`]; `st` is no longer needed to find it).
    pub fn coordinator(&self, _st: &MetaState) -> Option<(u32, String)> {
        self.coordinator_now()
    }

    // ---- verdicts and fencing ----

    /// Copies the committed verdicts and starts from the metadata; fences this node if one
    /// names it (or a later start of it).
    pub fn refresh_verdicts(&self) {
        let (down, up_from) = {
            let m = self.meta.locked();
            (m.down.clone(), m.up_from.clone())
        };
        let (fence, restarts) = {
            let mut v = self.verdicts.locked();
            v.handle_committed(&down);
            v.handle_booted(&up_from);
            (v.poll_fence(), v.poll_restarts())
        };
        self.queue_restarts(restarts);
        {
            let now = self.now_ms();
            self.watching.locked().duties.handle_boots(now, &up_from);
        }
        self.carry_out_fence(fence);
    }

    fn carry_out_fence(&self, fence: Option<verdicts::Fence>) {
        let Some(f) = fence else { return };
        let why = match &f.told_by {
            None if f.heard_later => format!(
                "the cluster's metadata records incarnation {} of this node, later than this one (its data folder lost its counter)",
                f.declared
            ),
            None => "the cluster declared this incarnation down (committed verdict)".to_string(),
            Some(peer) if f.heard_later => format!(
                "{peer} heard incarnation {} of this node, later than this one (its data folder lost its counter)",
                f.declared
            ),
            Some(peer) => format!("{peer} says the cluster declared this incarnation down"),
        };
        self.fence_self(&why, f.declared);
    }

    /// This incarnation must not go on: stop its ranks and rejoin as a new incarnation with
    /// an empty memory (the daemon's fencer; it does not return once set up).
    pub fn fence_self(&self, why: &str, declared: u64) {
        if self.fencing.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::warn!(node = %self.me.name, incarnation = self.incarnation, why, "fenced: stopping this node's ranks and rejoining as a new incarnation");
        if let Some(f) = self.fencer.get() {
            f(why, declared);
        }
    }

    /// The peers of the logical map whose latest figures say their page store failed.
    pub fn disk_failed_peers(&self) -> Vec<String> {
        let map: Vec<String> = {
            let m = self.meta.locked();
            self.logical_map(&m).into_values().collect()
        };
        let f = self.figures.locked();
        map.into_iter()
            .filter(|p| *p != self.me.name && f.get(p).is_some_and(|(h, _)| h.disk_failed.is_some()))
            .collect()
    }

    /// Whether `physical`'s heartbeats say its disk failed.
    pub fn peer_disk_failed(&self, physical: &str) -> bool {
        physical != self.me.name
            && self
                .figures
                .locked()
                .get(physical)
                .is_some_and(|(h, _)| h.disk_failed.is_some())
    }

    /// Whether this incarnation is fencing itself (it serves nothing more).
    pub fn is_fencing(&self) -> bool {
        self.fencing.load(Ordering::Relaxed)
    }

    /// Failure detection's duties, every heartbeat interval (`psls_cluster::watch`):
    /// - as a watcher: the watched peers silent past the failure timeout (whose incarnation
    ///   known here is not declared already) are reported to the metadata leader, again every
    ///   interval while the silence lasts, and taken back once heard again;
    /// - as the leader holding its lease: the tally of everyone's reports (this node's own
    ///   among them), probes of reported peers it does not watch, and a committed verdict on
    ///   every peer the tally confirms or whose disk failed, at the incarnation reported. Its
    ///   probes and tally end with its leadership.
    pub fn watch_duties(self: &Arc<Self>) {
        let now = self.now_ms();
        let ticked = self.members.locked().tick(now);
        let silent: Vec<(String, u64)> = ticked
            .into_iter()
            .map(|(p, _)| p)
            .filter(|p| !self.is_declared_down(p))
            .map(|p| {
                let inc = self.heard_incarnation(&p);
                (p, inc)
            })
            .collect();
        let leading = self.replication.is_leader() && self.holds_lease() && !self.is_fencing();
        let leader = self.replication.leader();
        let disk_failed: Vec<(String, u64)> = self
            .disk_failed_peers()
            .into_iter()
            .map(|p| {
                let inc = self.heard_incarnation(&p);
                (p, inc)
            })
            .collect();
        let duties = {
            // Lock order: watching, then verdicts.
            let mut w = self.watching.locked();
            let mut v = self.verdicts.locked();
            w.duties.handle_tick(
                now,
                silent,
                leading,
                leader.as_deref(),
                disk_failed,
                &self.topology,
                &mut v,
            )
        };
        self.prune_watches(now);
        for duty in duties {
            self.carry_out_duty(duty);
        }
    }

    /// Carries out one of failure detection's duties (`psls_cluster::watch::Duty`).
    fn carry_out_duty(self: &Arc<Self>, duty: Duty) {
        let me = self.clone();
        match duty {
            Duty::Report { leader, silent, back } => {
                tokio::spawn(async move {
                    let req = PeerReq::Watch { silent, back };
                    let _ = me
                        .net
                        .request(&leader, &req, bytes::Bytes::new(), me.read_timeout())
                        .await;
                });
            }
            Duty::Declare {
                peer,
                incarnation,
                reporters,
            } => {
                tokio::spawn(async move {
                    let op = MetaOp::DeclareDown {
                        physical: peer.clone(),
                        incarnation,
                    };
                    match me.submit(op).await {
                        Ok(()) => {
                            me.metrics.verdicts.with_label_values(&[peer.as_str()]).inc();
                            tracing::warn!(node = %me.me.name, peer = %peer, incarnation, ?reporters, "node declared down (committed)")
                        }
                        Err(e) => {
                            tracing::warn!(node = %me.me.name, peer = %peer, incarnation, error = %e, "down verdict not committed")
                        }
                    }
                    me.verdicts.locked().handle_declared(&peer);
                });
            }
        }
    }

    /// The watched peers beyond the topology's: the leader's probes of reported peers (while
    /// reported), the other voters (on a voter), and every voter while this node's new store
    /// learns whether the cluster is new.
    fn prune_watches(&self, now: u64) {
        let st = self.replication.status();
        let fresh_pending = st.awaiting_fresh;
        let probes: BTreeSet<String> = {
            let own: BTreeSet<String> = self
                .topology
                .peers_of(&self.me.name)
                .into_iter()
                .map(String::from)
                .collect();
            self.watching.locked().duties.probes(&own)
        };
        // A voter watches the other voters (a few): it learns at the failure timeout that the
        // leader is gone, and which live voter should campaign (`Node::first_live_voter`).
        let voters: BTreeSet<String> = if st.is_voter {
            st.voters.iter().filter(|v| **v != self.me.name).cloned().collect()
        } else {
            BTreeSet::new()
        };
        let mut m = self.members.locked();
        for p in probes.iter().chain(voters.iter()) {
            m.watch(p, now);
        }
        if fresh_pending {
            for n in st.voters.iter().filter(|n| **n != self.me.name) {
                m.watch(n, now);
            }
            return;
        }
        let extra: Vec<String> = m
            .watched()
            .filter(|p| !self.topology.watches(&self.me.name, p) && !probes.contains(*p) && !voters.contains(*p))
            .map(String::from)
            .collect();
        for p in extra {
            m.unwatch(&p);
        }
    }

    /// A watcher's reports (`Watch`), at the leader.
    pub fn handle_watch(self: &Arc<Self>, from: &str, silent: Vec<(String, u64)>, back: Vec<String>) {
        let now = self.now_ms();
        let leading = self.replication.is_leader() && self.holds_lease() && !self.is_fencing();
        let known = |p: &str| self.cfg.entry(p).is_some();
        let duties = {
            // Lock order: watching, then verdicts.
            let mut w = self.watching.locked();
            let mut v = self.verdicts.locked();
            w.duties
                .handle_reports(now, from, silent, back, leading, known, &self.topology, &mut v)
        };
        for duty in duties {
            self.carry_out_duty(duty);
        }
    }

    /// Sends this node's figures to the metadata leader when they changed in a way that
    /// matters (disk, frames, dirty pages, a rebuild), when the leader changed, or every
    /// [`FIGURES_REFRESH_MS`]: the leader decides the checkpoint level and declares failed
    /// disks from them, and serves them to the other nodes.
    pub fn send_figures(self: &Arc<Self>, hb: &Heartbeat) {
        let Some(leader) = self.replication.leader() else {
            return;
        };
        if leader == self.me.name {
            return;
        }
        let now = self.now_ms();
        {
            let mut w = self.watching.locked();
            let due = match &w.sent_figures {
                None => true,
                Some((l, old, at)) => {
                    *l != leader || now.saturating_sub(*at) >= FIGURES_REFRESH_MS || figures_changed(old, hb)
                }
            };
            if !due {
                return;
            }
            w.sent_figures = Some((leader.clone(), hb.clone(), now));
        }
        let me = self.clone();
        let req = PeerReq::Figures(hb.clone());
        tokio::spawn(async move {
            if me
                .net
                .request(&leader, &req, bytes::Bytes::new(), me.read_timeout())
                .await
                .is_err()
            {
                // Sent again at the next tick.
                me.watching.locked().sent_figures = None;
            }
        });
    }

    /// Sends a request with a payload to a physical node (handled in-process when it is this
    /// node) and returns the response with its payload.
    pub async fn call_data(
        self: &Arc<Self>,
        physical: &str,
        req: PeerReq,
        payload: bytes::Bytes,
        timeout: Duration,
    ) -> Result<(PeerResp, bytes::Bytes), NetError> {
        if physical == self.me.name {
            let Some(local) = self.local.get().cloned() else {
                return Err(NetError::Unreachable {
                    peer: physical.to_string(),
                    message: "the daemon is still starting".into(),
                });
            };
            return Ok(local.handle(physical.to_string(), req, payload).await);
        }
        self.net.request(physical, &req, payload, timeout).await
    }

    /// Sends a request without payload (response payload dropped).
    pub async fn call(self: &Arc<Self>, physical: &str, req: PeerReq) -> Result<PeerResp, NetError> {
        Ok(self
            .call_data(physical, req, bytes::Bytes::new(), self.request_timeout)
            .await?
            .0)
    }

    /// How long a read waits for a copy before trying the other one: a dead node is declared
    /// down after the heartbeat timeout, so waiting longer than that only adds latency.
    pub fn read_timeout(&self) -> Duration {
        self.request_timeout
            .min(Duration::from_millis(self.cfg.cluster.heartbeat_timeout_ms))
    }

    /// Sends a request and turns a peer's error reply into an error.
    pub async fn call_ok(self: &Arc<Self>, physical: &str, req: PeerReq) -> Result<PeerResp, OpError> {
        Ok(self.call_data_ok(physical, req, bytes::Bytes::new()).await?.0)
    }

    /// [`Node::call_data`] with the request timeout, turning an error reply into an error.
    pub async fn call_data_ok(
        self: &Arc<Self>,
        physical: &str,
        req: PeerReq,
        payload: bytes::Bytes,
    ) -> Result<(PeerResp, bytes::Bytes), OpError> {
        match self.call_data(physical, req, payload, self.request_timeout).await? {
            (PeerResp::Error { kind, message }, _) => Err(OpError::new(kind, format!("{physical}: {message}"))),
            r => Ok(r),
        }
    }

    /// This node's heartbeat as built at most half a heartbeat interval ago: what answers to
    /// the peers' heartbeats carry (building one reads the process's memory from /proc).
    pub(crate) fn heartbeat_recent(&self) -> Heartbeat {
        let fresh = Duration::from_millis(self.cfg.cluster.heartbeat_interval_ms / 2);
        if let Some((hb, at)) = self.recent_beat.locked().as_ref() {
            if at.elapsed() < fresh {
                return hb.clone();
            }
        }
        let hb = self.heartbeat();
        *self.recent_beat.locked() = Some((hb.clone(), Instant::now()));
        hb
    }

    pub(crate) fn heartbeat(&self) -> Heartbeat {
        let st = self.meta_state();
        let log = self.replication.status();
        let rebuilding = self.my_logical(&st).is_some_and(|l| st.rebuilding.contains_key(&l.0))
            || self.rejoin_pending.load(Ordering::Relaxed);
        // Nothing of every node: a heartbeat's size does not grow with the cluster.
        let svm = self.beat.get().map_or_else(SvmFigures::default, |b| b(0));
        Heartbeat {
            incarnation: self.incarnation,
            pid: std::process::id(),
            // The last index of the metadata log here (0: it never held an entry).
            meta_seq: log.last_index,
            meta_log: (log.term, log.commit, log.applied),
            memory_used_bytes: rss_bytes(),
            memory_capacity_bytes: self.me.memory_mb * 1024 * 1024,
            disk_used_bytes: self.disk_used.load(Ordering::Relaxed),
            disk_free_bytes: self.disk_free.load(Ordering::Relaxed),
            rebuild: rebuilding.then(|| {
                (
                    self.rebuild_done.load(Ordering::Relaxed),
                    self.rebuild_total.load(Ordering::Relaxed),
                )
            }),
            svm_segments: svm.segments,
            svm_view: svm.view,
            svm_fenced: svm.fenced,
            frames: self.frames.counts(),
            frame_capacity: self.frames.capacity_frames(),
            dirty_pages: svm.dirty_pages,
            down: Vec::new(),
            claims: self.replication.claims(),
            meta_lost_disk: self.replication.status().lost_disk,
            disk_failed: self
                .store
                .is_poisoned()
                .then(|| "an fsync of its page store failed: its disk may have lost writes".to_string()),
            heard: Vec::new(),
        }
    }

    /// This node's heartbeat to `peer`: its figures, and what it knows of `peer` itself (the
    /// verdict on it, and the newest incarnation of it known here), from which `peer` learns
    /// that it must fence itself.
    pub(crate) fn heartbeat_to(&self, base: &Heartbeat, peer: &str) -> Heartbeat {
        let mut hb = base.clone();
        let v = self.verdicts.locked();
        if let Some(&d) = v.committed().get(peer) {
            hb.down.push((peer.to_string(), d));
        }
        let known = v.known(peer);
        if known > 0 {
            hb.heard.push((peer.to_string(), known));
        }
        hb
    }

    /// This node's own heartbeat (for status).
    pub fn own_heartbeat(&self) -> Heartbeat {
        self.heartbeat()
    }

    // ---- metadata replication ----

    /// Submits `op` to the metadata's leader (this node or a peer) and waits until it is applied
    /// there and here. If the leader changes while the operation is under way, the outcome may
    /// be unknown: the applied state then says whether it was applied.
    pub async fn submit(self: &Arc<Self>, op: MetaOp) -> Result<(), OpError> {
        self.submit_at(op).await.map(|_| ())
    }

    /// [`Node::submit`], returning the index the operation was applied at (0 when it was found
    /// applied after an unknown outcome).
    pub async fn submit_at(self: &Arc<Self>, op: MetaOp) -> Result<u64, OpError> {
        let index = self.submit_to_leader(op).await?;
        // Visible here too before the caller goes on.
        self.meta_reached(index).await?;
        Ok(index)
    }

    /// [`Node::submit_at`] without waiting for this node to apply it: answered once the leader
    /// applied it. For a client's operation whose answer needs nothing of this node's state:
    /// what the client asks next here catches up first (`Node::meta_fresh`).
    pub async fn submit_to_leader(self: &Arc<Self>, op: MetaOp) -> Result<u64, OpError> {
        let kind = op.kind();
        let r = self.submit_to_leader_uncounted(op).await;
        let outcome = match &r {
            Ok(_) => "applied",
            Err(e) if e.kind == ErrorKind::Unavailable => "unavailable",
            Err(_) => "refused",
        };
        self.metrics.meta_ops.with_label_values(&[kind, outcome]).inc();
        r
    }

    async fn submit_to_leader_uncounted(self: &Arc<Self>, op: MetaOp) -> Result<u64, OpError> {
        let deadline = Instant::now() + self.request_timeout * 3;
        let mut last = OpError::new(
            ErrorKind::Unavailable,
            "no majority of the metadata's voters is reachable (no leader)",
        );
        let mut unknown = false;
        while Instant::now() < deadline {
            if unknown && op.reflected_in(&self.meta_state()) {
                return Ok(0);
            }
            let leader = self.replication.leader();
            let outcome: Result<u64, SubmitError<psls_pfs::MetaError>> = match leader {
                Some(l) if l == self.me.name => self.replication.submit(op.clone()).await,
                Some(l) => match self.call(&l, PeerReq::MetaSubmit { op: op.clone() }).await {
                    Ok(PeerResp::MetaDone { index }) => Ok(index),
                    Ok(PeerResp::MetaDropped) => Err(SubmitError::Dropped),
                    Ok(PeerResp::NotCoordinator) => Err(SubmitError::NotLeader { leader: None }),
                    Ok(PeerResp::Interrupted) => Err(SubmitError::Unknown),
                    Ok(PeerResp::Error { kind, message }) => {
                        // Refused by the leader's state: this node catches up to it first.
                        let st = self.meta_fresh().await?;
                        if unknown && op.reflected_in(&st) {
                            return Ok(0);
                        }
                        return Err(OpError::new(kind, message));
                    }
                    Ok(other) => {
                        last = OpError::new(
                            ErrorKind::Unavailable,
                            format!("metadata leader {l} answered {other:?}"),
                        );
                        Err(SubmitError::NotLeader { leader: None })
                    }
                    Err(e) => {
                        // It may have been applied before the connection broke.
                        unknown = true;
                        last = e.into();
                        Err(SubmitError::NotLeader { leader: None })
                    }
                },
                None => Err(SubmitError::NotLeader { leader: None }),
            };
            match outcome {
                Ok(index) => return Ok(index),
                Err(SubmitError::Rejected(e)) => {
                    // Refused on a state the caller may look at next (a create refused as
                    // existing, then a lookup): this node catches up to it first.
                    let st = self.meta_fresh().await?;
                    if unknown && op.reflected_in(&st) {
                        return Ok(0);
                    }
                    return Err(e.into());
                }
                Err(SubmitError::Unknown) => {
                    unknown = true;
                    last = OpError::new(
                        ErrorKind::Unavailable,
                        "the metadata's leader changed while an operation was under way",
                    );
                }
                Err(SubmitError::Halted) => {
                    return Err(OpError::new(ErrorKind::Internal, "this node's metadata log stopped"))
                }
                Err(SubmitError::Dropped | SubmitError::NotLeader { .. } | SubmitError::Busy) => {}
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(last)
    }

    /// Commits this start's incarnation (`MetaOp::Boot`), retrying until a leader takes it.
    /// Refused because the metadata holds a verdict on it or a later start of this node, the
    /// node fences itself (it starts again above it).
    pub async fn boot(self: Arc<Self>) {
        let op = MetaOp::Boot {
            physical: self.me.name.clone(),
            incarnation: self.incarnation,
        };
        let mut wait = Duration::from_millis(100);
        loop {
            if self.is_fencing() {
                return;
            }
            match self.submit(op.clone()).await {
                Ok(()) => {
                    tracing::info!(node = %self.me.name, incarnation = self.incarnation, "this start is committed");
                    return;
                }
                Err(e) if e.kind == ErrorKind::Invalid => {
                    // Refused by the committed state, which this node caught up to.
                    let st = self.meta_state();
                    let declared = st.down.get(&self.me.name).copied().filter(|&d| d >= self.incarnation);
                    let later = st.up_from.get(&self.me.name).copied().filter(|&u| u > self.incarnation);
                    match (declared, later) {
                        (Some(d), _) => self.fence_self("this incarnation was declared down before its start was committed", d),
                        (None, Some(u)) => self.fence_self(&format!("the cluster's metadata records incarnation {u} of this node, later than this one (its data folder lost its counter)"), u),
                        (None, None) => tracing::error!(node = %self.me.name, error = %e, "this start cannot be committed"),
                    }
                    return;
                }
                Err(e) => {
                    tracing::debug!(node = %self.me.name, error = %e, "this start is not committed yet: trying again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// The leader's side of a peer's `MetaSubmit`: a node commits only its own start.
    pub(crate) async fn serve_submit(self: &Arc<Self>, from: &str, op: MetaOp) -> PeerResp {
        if let MetaOp::Boot { physical, .. } = &op {
            if physical != from {
                return peer_error(OpError::new(
                    ErrorKind::Permission,
                    format!("{from} may not commit the start of {physical}"),
                ));
            }
        }
        match self.replication.submit(op).await {
            Ok(index) => PeerResp::MetaDone { index },
            Err(SubmitError::NotLeader { .. } | SubmitError::Busy) => PeerResp::NotCoordinator,
            Err(SubmitError::Dropped) => PeerResp::MetaDropped,
            Err(SubmitError::Unknown | SubmitError::Halted) => PeerResp::Interrupted,
            Err(SubmitError::Rejected(e)) => peer_error(e.into()),
        }
    }

    /// Start-up and every heartbeat round: a node whose metadata store is new and empty, and
    /// that is one of the cluster's first voters, learns from heartbeats whether the cluster is
    /// new: enough of the first voters hold no log entry that none can ever have been
    /// committed, and no node it hears holds any metadata. It then takes part in elections.
    pub fn check_fresh_cluster(&self) {
        let st = self.replication.status();
        if !st.awaiting_fresh {
            return;
        }
        // An entry ever committed is on a quorum, so on at least quorum - 1 other voters: once
        // more than (voters - 1) - (quorum - 1) others report an empty log, none was committed
        // by them. A node heard with metadata (a follower, or voters chosen later) says the
        // cluster ran.
        let voters = st.voters.len();
        let quorum = voters / 2 + 1;
        // A lone voter has no other to ask: the nodes it hears say.
        let need = (voters - quorum + 1).min(voters - 1);
        let now_ms = self.now_ms();
        let (empty, ran, heard) = self.with_heartbeats(|m| {
            let empty = st
                .voters
                .iter()
                .filter(|n| **n != self.me.name && m.is_live(now_ms, n))
                .filter(|n| m.heartbeat(n).is_some_and(|h| h.meta_seq == 0))
                .count();
            let ran = self
                .cfg
                .all()
                .filter(|n| n.name != self.me.name && m.is_live(now_ms, &n.name))
                .any(|n| m.heartbeat(&n.name).is_some_and(|h| h.meta_seq > 0));
            let heard = self
                .cfg
                .all()
                .any(|n| n.name != self.me.name && m.is_live(now_ms, &n.name) && m.heartbeat(&n.name).is_some());
            (empty, ran, heard)
        });
        if empty >= need && !ran && heard {
            self.replication.fresh_cluster();
        }
    }

    // ---- background work ----

    /// One heartbeat request to every watched peer, waiting until each answered or timed out
    /// (start-up: the node knows its peers before it serves). A heartbeat may wait as long as
    /// the failure timeout: cancelling it sooner would also cancel a slow first TLS handshake.
    pub async fn heartbeat_round(self: &Arc<Self>) {
        let timeout = Duration::from_millis(self.cfg.cluster.heartbeat_timeout_ms);
        let base = self.heartbeat();
        let targets: Vec<String> = self.members.locked().watched().map(String::from).collect();
        let mut tasks = tokio::task::JoinSet::new();
        for name in targets {
            let me = self.clone();
            let hb = self.heartbeat_to(&base, &name);
            tasks.spawn(async move {
                if let Ok((PeerResp::HeartbeatAck(theirs), _)) = me
                    .net
                    .request(&name, &PeerReq::Heartbeat(hb), bytes::Bytes::new(), timeout)
                    .await
                {
                    me.heard(&name, theirs);
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    }

    /// Every heartbeat interval: one beat to each watched peer, one-way on the message link
    /// (cheaper than a request and its answer: the peers' own beats are what this node hears),
    /// and this node's figures to the leader when due.
    pub fn beat_round(self: &Arc<Self>) {
        let base = self.heartbeat();
        self.send_figures(&base);
        let targets: Vec<String> = self.members.locked().watched().map(String::from).collect();
        for peer in targets {
            let hb = self.heartbeat_to(&base, &peer);
            // A peer that cannot be reached now is found silent: nothing to say here.
            let _ = self.net.post(&peer, &PeerReq::Beat(hb), bytes::Bytes::new());
        }
    }

    /// A peer's beat (on the message link): heard; a `Beat` (not a `BeatBack`) is answered
    /// with this node's own when this node does not watch the sender (the leader's probe, a
    /// new node asking every voter). An answer is never answered: two nodes that stopped
    /// watching each other would answer each other's answers forever.
    pub(crate) fn handle_beat(&self, from: &str, hb: Heartbeat, answer: bool) {
        self.heard(from, hb);
        if answer && !self.watches(from) {
            let base = self.heartbeat_recent();
            let back = PeerReq::BeatBack(self.heartbeat_to(&base, from));
            let _ = self.net.post(from, &back, bytes::Bytes::new());
        }
    }

    /// Measures disk use and free space on the blocking pool.
    pub async fn refresh_disk_stats_async(self: &Arc<Self>) {
        let me = self.clone();
        let _ = blocking(move || me.refresh_disk_stats()).await;
    }

    /// The page store's free bytes, measured now (the heartbeats carry the figure of the last
    /// periodic measure, which a disk freed since may have outgrown).
    pub async fn disk_free_now(self: &Arc<Self>) -> u64 {
        self.refresh_disk_stats_async().await;
        self.disk_free.load(Ordering::Relaxed)
    }

    /// Node `physical`'s free disk space: from its last heartbeat, or, if that is below
    /// `need`, measured afresh there (a full disk freed since its last periodic measure).
    pub async fn disk_free_of(self: &Arc<Self>, physical: &str, need: u64) -> u64 {
        let heard = if physical == self.me.name {
            self.disk_free.load(Ordering::Relaxed)
        } else {
            self.heartbeat_of(physical).map_or(0, |h| h.disk_free_bytes)
        };
        if heard >= need {
            return heard;
        }
        if physical == self.me.name {
            return self.disk_free_now().await;
        }
        match self.call(physical, PeerReq::DiskFree).await {
            Ok(PeerResp::DiskFree { bytes }) => bytes,
            _ => heard,
        }
    }

    /// Measures disk use and free space (blocking: walks the store folder).
    pub fn refresh_disk_stats(&self) {
        let d = self.store.disk();
        self.disk_used.store(d.used_bytes().unwrap_or(0), Ordering::Relaxed);
        self.disk_free.store(d.free_bytes().unwrap_or(0), Ordering::Relaxed);
    }

    /// One heartbeat round-trip with every watched peer (start-up; every voter too while
    /// this node's new store learns whether the cluster is new).
    pub async fn initial_sync(self: &Arc<Self>) {
        self.prune_watches(self.now_ms());
        self.heartbeat_round().await;
        self.check_fresh_cluster();
    }

    pub(crate) fn heard(&self, peer: &str, hb: Heartbeat) {
        let now_ms = self.now_ms();
        let (taken, fence, restarts) = {
            let mut v = self.verdicts.locked();
            let down = hb.down.iter().map(|(p, d)| (p.as_str(), *d));
            let heard = hb.heard.iter().map(|(p, i)| (p.as_str(), *i));
            let taken = v.handle_heartbeat(peer, hb.incarnation, down, heard);
            let restarts = v.poll_restarts();
            (taken, v.poll_fence(), restarts)
        };
        self.queue_restarts(restarts);
        // The sender's committed metadata declared this incarnation down.
        self.carry_out_fence(fence);
        if !taken {
            // An incarnation declared down is not heard: it may not look live again (it is
            // answered, and learns its verdict from the answer).
            return;
        }
        let incarnation = hb.incarnation;
        self.net.heard_from(peer);
        self.watching.locked().duties.handle_heard(now_ms, peer, incarnation);
        self.figures.locked().insert(peer.to_string(), (hb.clone(), now_ms));
        // A restart is told by the verdict book (it knows every source of incarnations).
        let _ = self.members.locked().heard(now_ms, peer, incarnation, hb);
    }

    // ---- local page store requests ----

    pub(crate) fn check_holder(
        &self,
        file: FileId,
        role: Role,
        indices: impl Iterator<Item = u64>,
    ) -> Result<(), OpError> {
        let st = self.meta_state();
        let Some(me) = self.my_logical(&st) else {
            return Err(OpError::new(
                ErrorKind::Invalid,
                format!("{} holds no logical id", self.me.name),
            ));
        };
        for i in indices {
            if self.placement.holder(file, i, role) != me {
                return Err(OpError::new(
                    ErrorKind::Invalid,
                    format!("page {file}:{i} ({role:?}) does not belong to {me}"),
                ));
            }
        }
        Ok(())
    }

    fn refs(&self, indices: &[u64], gens: impl Fn(usize, u64) -> u64) -> Vec<PageRef> {
        indices
            .iter()
            .enumerate()
            .map(|(k, &index)| PageRef {
                index,
                local: self.placement.local_index(index),
                gen: gens(k, index),
            })
            .collect()
    }

    /// Waits (a bounded time) until this node's committed metadata has reached `seq`: woken
    /// by each install (a checkpoint's page writes wait here for its epoch's metadata, so
    /// polling cost them milliseconds each), and looking again now and then regardless.
    pub async fn meta_reached(&self, seq: u64) -> Result<MetaState, OpError> {
        let deadline = Instant::now() + self.request_timeout;
        loop {
            // Registered before looking, so an install in between is not missed.
            let installed = self.meta_installed.notified();
            let st = self.meta_state();
            if st.seq >= seq {
                return Ok(st);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(OpError::new(
                    ErrorKind::Unavailable,
                    format!("{}: metadata at {} has not reached {seq}", self.me.name, st.seq),
                ));
            }
            let _ = tokio::time::timeout((deadline - now).min(Duration::from_millis(20)), installed).await;
        }
    }

    pub(crate) async fn write_pages(
        &self,
        file: FileId,
        role: Role,
        gen: crate::peer::WriteGen,
        indices: Vec<u64>,
        data: bytes::Bytes,
    ) -> Result<(), OpError> {
        use crate::peer::WriteGen;
        if data.len() != indices.len() * PAGE_SIZE {
            let msg = format!(
                "{} pages need {} bytes, got {}",
                indices.len(),
                indices.len() * PAGE_SIZE,
                data.len()
            );
            return Err(OpError::new(ErrorKind::Invalid, msg));
        }
        self.check_holder(file, role, indices.iter().copied())?;
        let store = self.store.clone();
        let by = match gen {
            WriteGen::Flush { .. } => DiskWrite::Flush,
            _ => DiskWrite::Round,
        };
        match gen {
            WriteGen::New { gen, seq } | WriteGen::Flush { gen, seq } => {
                // The slot to spare is the committed version's, as this node's metadata says
                // (never the writer's word for it).
                let t = Instant::now();
                let st = self.meta_reached(seq).await?;
                let wait_us = t.elapsed().as_micros() as u64;
                let f = st.file_by_id(file);
                let refs = self.refs(&indices, |_, i| f.map_or(0, |f| f.page_gen(i)));
                if let Some(r) = refs.iter().find(|r| r.gen >= gen) {
                    return Err(OpError::new(
                        ErrorKind::Invalid,
                        format!(
                            "page {file}:{} is at generation {}: a write at {gen} is stale",
                            r.index, r.gen
                        ),
                    ));
                }
                let pages = refs.len();
                let t = Instant::now();
                self.frames.storing(by, file, &indices, gen);
                let kept = data.clone();
                blocking(move || store.write_batch(file, role, gen, &refs, &data)).await??;
                self.store_page_writes.fetch_add(pages as u64, Ordering::Relaxed);
                self.frames.stored(by, file, role, &indices, gen, &kept);
                tracing::debug!(node = %self.me.name, %file, pages, wait_us, write_us = t.elapsed().as_micros() as u64, "checkpoint pages stored");
            }
            WriteGen::Same { gens } => {
                if gens.len() != indices.len() {
                    return Err(OpError::new(ErrorKind::Invalid, "one generation per page is needed"));
                }
                let refs = self.refs(&indices, |k, _| gens[k]);
                blocking(move || -> Result<(), psls_pfs::StoreError> {
                    // One batch per run of pages of the same generation.
                    let mut k = 0;
                    while k < refs.len() {
                        let g = refs[k].gen;
                        let mut e = k + 1;
                        while e < refs.len() && refs[e].gen == g {
                            e += 1;
                        }
                        store.write_batch(file, role, g, &refs[k..e], &data[k * PAGE_SIZE..e * PAGE_SIZE])?;
                        k = e;
                    }
                    Ok(())
                })
                .await??;
            }
        }
        Ok(())
    }

    pub(crate) async fn read_pages(
        &self,
        file: FileId,
        role: Role,
        indices: Vec<u64>,
        gens: Vec<u64>,
    ) -> Result<(Vec<PageState>, bytes::Bytes), OpError> {
        if indices.len() > crate::peer::BATCH_PAGES * 4 {
            return Err(OpError::new(ErrorKind::Invalid, "too many pages in one read"));
        }
        if gens.len() != indices.len() {
            return Err(OpError::new(ErrorKind::Invalid, "one generation per page is needed"));
        }
        self.check_holder(file, role, indices.iter().copied())?;
        let store = self.store.clone();
        let refs = self.refs(&indices, |k, _| gens[k]);
        blocking(move || {
            // Page-aligned, so runs of pages are read with direct I/O. A reused buffer is not
            // zeroed first (the reads overwrite it); the pages not read well are zeroed after,
            // so an answer never carries bytes of an earlier one.
            let len = refs.len() * PAGE_SIZE;
            let mut data = crate::peer::batch_pool().get_at_least(len);
            data.resize_reusing(len);
            let states: Vec<PageState> = match store.read_batch(file, role, &refs, &mut data) {
                Ok(st) => st.into_iter().map(page_state).collect(),
                Err(e) => vec![PageState::Error(e.to_string()); refs.len()],
            };
            for (k, st) in states.iter().enumerate() {
                if *st != PageState::Ok {
                    data[k * PAGE_SIZE..(k + 1) * PAGE_SIZE].fill(0);
                }
            }
            (states, bytes::Bytes::from_owner(data))
        })
        .await
    }

    pub(crate) async fn scrub_local(&self, files: Vec<FileId>, seq: u64) -> Result<(u64, Vec<BadCopy>), OpError> {
        let st = self.meta_reached(seq).await?;
        let files: Vec<psls_pfs::meta::FileMeta> = st
            .files
            .values()
            .filter(|f| files.contains(&f.id) && !f.never_written())
            .cloned()
            .collect();
        let Some(me) = self.my_logical(&st) else {
            return Ok((0, Vec::new()));
        };
        let store = self.store.clone();
        let placement = self.placement;
        blocking(move || {
            let mut checked = 0;
            let mut bad = Vec::new();
            let mut buf = Vec::new();
            for f in files {
                let file = f.id;
                for role in [Role::Primary, Role::Mirror] {
                    // Pages never written (generation 0) have no copy to check.
                    let held: Vec<u64> = placement
                        .held(me, file, f.pages(), role)
                        .filter(|&i| f.page_gen(i) > 0)
                        .collect();
                    for chunk in held.chunks(crate::peer::BATCH_PAGES) {
                        let refs: Vec<PageRef> = chunk
                            .iter()
                            .map(|&index| PageRef {
                                index,
                                local: placement.local_index(index),
                                gen: f.page_gen(index),
                            })
                            .collect();
                        buf.resize(refs.len() * PAGE_SIZE, 0);
                        let states = store.read_batch(file, role, &refs, &mut buf);
                        checked += refs.len() as u64;
                        for (k, &index) in chunk.iter().enumerate() {
                            if !matches!(states.as_ref().map(|s| s[k]), Ok(ReadStatus::Ok)) {
                                bad.push(BadCopy { file, role, index });
                            }
                        }
                    }
                }
            }
            (checked, bad)
        })
        .await
    }
}

fn page_state(s: ReadStatus) -> PageState {
    match s {
        ReadStatus::Ok => PageState::Ok,
        ReadStatus::Missing => PageState::Missing,
        ReadStatus::Stale { found } => PageState::Stale(found),
        ReadStatus::Corrupt => PageState::Corrupt,
    }
}

/// Whether figures changed in a way the leader must hear of before their next refresh: the
/// disk's state, free space by more than 1/64, frames, dirty pages, a rebuild's progress.
fn figures_changed(old: &Heartbeat, new: &Heartbeat) -> bool {
    let free_moved = old.disk_free_bytes.abs_diff(new.disk_free_bytes) > old.disk_free_bytes / 64;
    old.incarnation != new.incarnation
        || old.disk_failed != new.disk_failed
        || free_moved
        || old.frames != new.frames
        || old.frame_capacity != new.frame_capacity
        || old.dirty_pages != new.dirty_pages
        || old.rebuild != new.rebuild
        || old.svm_segments != new.svm_segments
        || old.meta_lost_disk != new.meta_lost_disk
}

/// Resident set size of this process.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map(|pages| pages * 4096)
        .unwrap_or(0)
}
