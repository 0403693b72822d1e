//! The node daemon's state and its peer-facing side: the page store, the metadata replica,
//! membership, metadata replication through the coordinator, heartbeats and background work
//! (rebuild after a replacement, automatic replacement, metadata catch-up).
//!
//! Invariants:
//! - a page is written to this node's store only if placement makes this node's logical id its
//!   holder in that role (checked on every `WritePages`);
//! - metadata operations are ordered by the coordinator (lowest live logical id) and reach
//!   every live node; a node that misses one catches up from a peer with a newer replica;
//! - blocking disk work runs on the blocking pool, never on the async workers.

use crate::failstop::Locked;
use crate::peer::{BadCopy, Heartbeat, PageState, PeerReq, PeerResp};
use crate::transport::{BoxFuture, Handler, NetError, Transport};
use psls_cluster::membership::{Liveness, Membership};
use psls_cluster::meta::ReplError;
use psls_ipc::proto::NodeState;
use psls_ipc::{ClusterConfig, ErrorKind, NodeEntry};
use psls_pfs::meta::{MetaOp, MetaState, MetaStore};
use psls_pfs::MetaError;
use psls_pfs::{PageRef, PageStore, Placement, ReadStatus, Role};
use psls_svm::{FileId, NodeId, PAGE_SIZE};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An error to report to a client or peer: a class and one line of text.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct OpError {
    pub kind: ErrorKind,
    pub message: String,
}

impl OpError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        OpError {
            kind,
            message: message.into(),
        }
    }
}

impl From<MetaError> for OpError {
    fn from(e: MetaError) -> Self {
        let kind = match &e {
            MetaError::Exists(_) => ErrorKind::Exists,
            MetaError::NotFound(_) => ErrorKind::NotFound,
            MetaError::Conflict { .. } | MetaError::Invalid(_) => ErrorKind::Invalid,
            MetaError::Db(_) | MetaError::Corrupt(_) => ErrorKind::Io,
        };
        OpError::new(kind, e.to_string())
    }
}

impl From<NetError> for OpError {
    fn from(e: NetError) -> Self {
        OpError::new(ErrorKind::Unavailable, e.to_string())
    }
}

impl From<psls_pfs::StoreError> for OpError {
    fn from(e: psls_pfs::StoreError) -> Self {
        OpError::new(ErrorKind::Io, e.to_string())
    }
}

pub fn peer_error(e: OpError) -> PeerResp {
    PeerResp::Error {
        kind: e.kind,
        message: e.message,
    }
}

/// Runs blocking work on the blocking pool.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, OpError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| OpError::new(ErrorKind::Internal, format!("worker failed: {e}")))
}

pub struct Node {
    pub cfg: Arc<ClusterConfig>,
    pub me: NodeEntry,
    pub incarnation: u64,
    pub store: Arc<PageStore>,
    pub meta: Arc<Mutex<MetaStore>>,
    /// The failure detector (time: milliseconds since `started`).
    members: Mutex<Membership<Heartbeat>>,
    started: Instant,
    pub net: Arc<Transport>,
    pub placement: Placement,
    pub request_timeout: Duration,
    pub euid: u32,
    /// Coordinator election and metadata replication (the shell of `psls_cluster::meta`).
    pub replication: crate::replication::Replication,
    rebuild_running: AtomicBool,
    pub rebuild_done: AtomicU64,
    pub rebuild_total: AtomicU64,
    disk_used: AtomicU64,
    disk_free: AtomicU64,
    pub shutdown: tokio::sync::Notify,
    /// Shared virtual memory: segments, client mappings, the coherence state machine.
    pub svm: Arc<crate::svm::SvmShell>,
    /// Barriers and locks (served while this node coordinates).
    pub sync: Mutex<crate::sync::SyncSide>,
    /// This node's ranks waiting for a barrier or lock notice.
    pub waits: crate::sync::Waits,
    /// Local clients' sync channels (served by the `psls-sync` thread).
    pub channels: crate::sync_channel::Channels,
    /// Jobs launched here and rank processes running here.
    pub jobs: crate::launcher::Jobs,
    /// Message link round trips under way (`LinkPing` id → its waiter).
    pub link_pings: Mutex<HashMap<u64, tokio::sync::oneshot::Sender<usize>>>,
    pub next_link_ping: AtomicU64,
}

impl Node {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: Arc<ClusterConfig>,
        me: NodeEntry,
        incarnation: u64,
        store: Arc<PageStore>,
        meta: MetaStore,
        net: Transport,
        channels: crate::sync_channel::Channels,
        now: Instant,
    ) -> Node {
        let peers = cfg.all().filter(|n| n.name != me.name).map(|n| n.name.clone());
        let members = Membership::new(peers, cfg.cluster.heartbeat_timeout_ms, 0);
        let voters = cfg.all().map(|n| n.name.clone()).collect();
        let placement = Placement::new(cfg.nodes.len() as u32).expect("validated config has >= 2 nodes");
        Node {
            request_timeout: Duration::from_millis(cfg.cluster.request_timeout_ms),
            cfg,
            me,
            incarnation,
            store,
            meta: Arc::new(Mutex::new(meta)),
            members: Mutex::new(members),
            started: now,
            net: Arc::new(net),
            placement,
            euid: nix::unistd::geteuid().as_raw(),
            replication: crate::replication::Replication::new(voters),
            rebuild_running: AtomicBool::new(false),
            rebuild_done: AtomicU64::new(0),
            rebuild_total: AtomicU64::new(0),
            disk_used: AtomicU64::new(0),
            disk_free: AtomicU64::new(0),
            shutdown: tokio::sync::Notify::new(),
            svm: Arc::new(crate::svm::SvmShell::new(tokio::runtime::Handle::current())),
            sync: Mutex::new(crate::sync::SyncSide::default()),
            waits: crate::sync::Waits::default(),
            channels,
            jobs: crate::launcher::Jobs::default(),
            link_pings: Mutex::new(HashMap::new()),
            next_link_ping: AtomicU64::new(0),
        }
    }

    pub fn name(&self) -> &str {
        &self.me.name
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

    /// The last heartbeat heard from `physical` (this node's own for itself).
    pub fn heartbeat_of(&self, physical: &str) -> Option<Heartbeat> {
        if physical == self.me.name {
            return Some(self.heartbeat());
        }
        self.members.locked().heartbeat(physical).cloned()
    }

    /// Runs `f` with a read-only look at the failure detector (its `heartbeat(peer)` is the
    /// last heartbeat heard from a peer).
    pub fn with_heartbeats<R>(&self, f: impl FnOnce(&Membership<Heartbeat>) -> R) -> R {
        f(&self.members.locked())
    }

    /// A copy of the metadata replica.
    pub fn meta_state(&self) -> MetaState {
        self.meta.locked().state().clone()
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
        self.physical_of(m.state(), logical)
    }

    /// [`Node::coordinator`] on the current metadata, without copying it (every barrier and
    /// lock call asks).
    pub fn coordinator_now(&self) -> Option<(u32, String)> {
        let map = {
            let m = self.meta.locked();
            self.logical_map(m.state())
        };
        map.into_iter().find(|(_, p)| self.is_live(p))
    }

    pub fn my_logical(&self, st: &MetaState) -> Option<NodeId> {
        self.logical_map(st)
            .iter()
            .find(|(_, p)| **p == self.me.name)
            .map(|(l, _)| NodeId(*l))
    }

    pub fn is_live(&self, physical: &str) -> bool {
        physical == self.me.name || self.members.locked().is_live(self.now_ms(), physical)
    }

    pub fn state_of(&self, physical: &str) -> NodeState {
        if physical == self.me.name {
            NodeState::Up
        } else {
            match self.members.locked().state(self.now_ms(), physical) {
                Liveness::Up => NodeState::Up,
                Liveness::Suspect => NodeState::Suspect,
                Liveness::Down => NodeState::Down,
            }
        }
    }

    /// Whether logical node `l` can serve its copies (live and not rebuilding).
    pub fn can_serve(&self, st: &MetaState, l: NodeId) -> bool {
        !st.rebuilding.contains_key(&l.0) && self.is_live(&self.physical_of(st, l))
    }

    /// The coordinator: the lowest logical id whose node is live.
    pub fn coordinator(&self, st: &MetaState) -> Option<(u32, String)> {
        self.logical_map(st).into_iter().find(|(_, p)| self.is_live(p))
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
            return Ok(self.clone().handle(physical.to_string(), req, payload).await);
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

    fn heartbeat(&self) -> Heartbeat {
        let st = self.meta_state();
        let rebuilding = self.my_logical(&st).is_some_and(|l| st.rebuilding.contains_key(&l.0));
        let (svm_view, svm_fenced) = self.svm.view(self.cfg.nodes.len());
        Heartbeat {
            incarnation: self.incarnation,
            pid: std::process::id(),
            meta_seq: st.seq,
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
            svm_segments: self.svm.segments(),
            svm_view,
            svm_fenced,
        }
    }

    /// This node's own heartbeat (for status).
    pub fn own_heartbeat(&self) -> Heartbeat {
        self.heartbeat()
    }

    // ---- metadata replication ----

    /// Submits `op` to the coordinator (this node or a peer) and waits until a quorum of the
    /// nodes committed it. If the coordinator changes while the operation is under way, the
    /// next one may still commit it: the committed state says whether it did.
    pub async fn submit(self: &Arc<Self>, op: MetaOp) -> Result<(), OpError> {
        let deadline = Instant::now() + self.request_timeout * 3;
        let mut last = OpError::new(ErrorKind::Unavailable, "no coordinator is reachable");
        let mut interrupted = false;
        while Instant::now() < deadline {
            if interrupted && op.reflected_in(&self.meta_state()) {
                return Ok(());
            }
            let st = self.meta_state();
            let outcome = match self.coordinator(&st) {
                Some((_, c)) if c == self.me.name => self.replication.submit(op.clone()).await,
                Some((_, c)) => match self.call(&c, PeerReq::MetaSubmit { op: op.clone() }).await {
                    Ok(PeerResp::Ok) => return Ok(()),
                    Ok(PeerResp::NotCoordinator) => Err(ReplError::NotCoordinator),
                    Ok(PeerResp::Interrupted) => Err(ReplError::Interrupted),
                    Ok(PeerResp::Error { kind, message }) => {
                        if interrupted && op.reflected_in(&self.meta_state()) {
                            return Ok(());
                        }
                        return Err(OpError::new(kind, message));
                    }
                    Ok(other) => {
                        last = OpError::new(ErrorKind::Unavailable, format!("coordinator {c} answered {other:?}"));
                        Err(ReplError::NotCoordinator)
                    }
                    Err(e) => {
                        last = e.into();
                        Err(ReplError::NotCoordinator)
                    }
                },
                None => Err(ReplError::NotCoordinator),
            };
            match outcome {
                Ok(_) => return Ok(()),
                Err(ReplError::Rejected(e)) => {
                    if interrupted && op.reflected_in(&self.meta_state()) {
                        return Ok(());
                    }
                    return Err(e.into());
                }
                Err(ReplError::Interrupted) => {
                    interrupted = true;
                    last = OpError::new(
                        ErrorKind::Unavailable,
                        "the coordinator changed while a metadata operation was under way",
                    );
                }
                Err(ReplError::NotCoordinator | ReplError::Busy) => {}
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(last)
    }

    /// The coordinator's side of a peer's `MetaSubmit`.
    async fn serve_submit(self: &Arc<Self>, op: MetaOp) -> PeerResp {
        let st = self.meta_state();
        if self.coordinator(&st).map(|c| c.1) != Some(self.me.name.clone()) {
            return PeerResp::NotCoordinator;
        }
        match self.replication.submit(op).await {
            Ok(_) => PeerResp::Ok,
            Err(ReplError::NotCoordinator | ReplError::Busy) => PeerResp::NotCoordinator,
            Err(ReplError::Interrupted) => PeerResp::Interrupted,
            Err(ReplError::Rejected(e)) => peer_error(e.into()),
        }
    }

    /// Waits (up to a request timeout) until this node's metadata is as new as the newest a
    /// live peer reported in its heartbeat: replication fetches it.
    pub async fn catch_up(self: &Arc<Self>) {
        let best = {
            let m = self.members.locked();
            let now_ms = self.now_ms();
            self.cfg
                .all()
                .filter(|n| n.name != self.me.name && m.is_live(now_ms, &n.name))
                .filter_map(|n| m.heartbeat(&n.name).map(|h| (h.meta_seq, n.name.clone())))
                .max()
        };
        let Some((seq, peer)) = best.filter(|(s, _)| *s > self.meta_state().seq) else {
            return;
        };
        self.replication.peer_seq(&peer, seq);
        let deadline = Instant::now() + self.request_timeout;
        while self.meta_state().seq < seq && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let now = self.meta_state().seq;
        if now >= seq {
            tracing::info!(node = %self.me.name, from = %peer, seq = now, "metadata caught up");
        } else {
            tracing::warn!(node = %self.me.name, from = %peer, seq = now, wanted = seq, "metadata catch-up timed out");
        }
    }

    // ---- background work ----

    /// Heartbeats and periodic duties, until shutdown.
    pub async fn run_ticks(self: Arc<Self>) {
        let interval = Duration::from_millis(self.cfg.cluster.heartbeat_interval_ms);
        // A heartbeat may wait as long as the failure timeout: cancelling it sooner would also
        // cancel a slow first TLS handshake.
        let hb_timeout = Duration::from_millis(self.cfg.cluster.heartbeat_timeout_ms);
        let mut t = tokio::time::interval(interval);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n: u64 = 0;
        loop {
            t.tick().await;
            if n.is_multiple_of(10) {
                let store = self.store.clone();
                if let Ok((u, f)) = blocking(move || {
                    (
                        store.disk().used_bytes().unwrap_or(0),
                        store.disk().free_bytes().unwrap_or(0),
                    )
                })
                .await
                {
                    self.disk_used.store(u, Ordering::Relaxed);
                    self.disk_free.store(f, Ordering::Relaxed);
                }
            }
            n += 1;
            let hb = self.heartbeat();
            for peer in self.cfg.all().filter(|p| p.name != self.me.name) {
                let me = self.clone();
                let name = peer.name.clone();
                let hb = hb.clone();
                tokio::spawn(async move {
                    if let Ok((PeerResp::HeartbeatAck(theirs), _)) = me
                        .net
                        .request(&name, &PeerReq::Heartbeat(hb), bytes::Bytes::new(), hb_timeout)
                        .await
                    {
                        me.heard(&name, theirs);
                    }
                });
            }
            self.catch_up().await;
            self.svm.sync_peers(&self);
            self.maybe_rebuild();
            self.maybe_auto_replace().await;
        }
    }

    /// Measures disk use and free space (blocking: walks the store folder).
    pub fn refresh_disk_stats(&self) {
        let d = self.store.disk();
        self.disk_used.store(d.used_bytes().unwrap_or(0), Ordering::Relaxed);
        self.disk_free.store(d.free_bytes().unwrap_or(0), Ordering::Relaxed);
    }

    /// One heartbeat round-trip with every peer, then metadata catch-up (start-up).
    pub async fn initial_sync(self: &Arc<Self>) {
        let timeout = Duration::from_millis(self.cfg.cluster.heartbeat_timeout_ms);
        let hb = self.heartbeat();
        let mut tasks = tokio::task::JoinSet::new();
        for peer in self.cfg.all().filter(|p| p.name != self.me.name) {
            let me = self.clone();
            let name = peer.name.clone();
            let hb = hb.clone();
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
        self.catch_up().await;
    }

    fn heard(&self, peer: &str, hb: Heartbeat) {
        let now_ms = self.now_ms();
        let seq = hb.meta_seq;
        let restarted = self.members.locked().heard(now_ms, peer, hb.incarnation, hb);
        self.replication.peer_seq(peer, seq);
        if restarted {
            tracing::info!(node = %self.me.name, peer, "peer restarted with a new incarnation");
            self.net.peer_restarted(peer);
        }
    }

    fn maybe_rebuild(self: &Arc<Self>) {
        let st = self.meta_state();
        let Some(l) = self.my_logical(&st) else {
            return;
        };
        if st.rebuilding.get(&l.0).is_none_or(|r| r.physical != self.me.name) {
            return;
        }
        if self.rebuild_running.swap(true, Ordering::SeqCst) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            let r = crate::pfs::rebuild(&me, l).await;
            if let Err(e) = &r {
                tracing::warn!(node = %me.me.name, error = %e, "rebuild interrupted; will retry");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            me.rebuild_running.store(false, Ordering::SeqCst);
        });
    }

    async fn maybe_auto_replace(self: &Arc<Self>) {
        let after = self.cfg.cluster.replace_after_ms;
        let now_ms = self.now_ms();
        let downs = self.members.locked().tick(now_ms);
        if after == 0 {
            return;
        }
        let st = self.meta_state();
        if self.coordinator(&st).map(|c| c.1) != Some(self.me.name.clone()) {
            return;
        }
        let map = self.logical_map(&st);
        for (peer, down_for) in downs {
            if down_for < after {
                continue;
            }
            let Some((&logical, _)) = map.iter().find(|(_, p)| **p == peer) else {
                continue;
            };
            let spare = self
                .cfg
                .spares
                .iter()
                .find(|s| !map.values().any(|p| *p == s.name) && self.state_of(&s.name) == NodeState::Up)
                .map(|s| s.name.clone());
            if let Some(spare) = spare {
                tracing::warn!(logical, down = %peer, %spare, "node down too long: replacing it with a spare");
                if let Err(e) = crate::pfs::replace(self, logical, &spare).await {
                    tracing::warn!(error = %e, "automatic replacement failed");
                }
                return;
            }
        }
    }

    // ---- local page store requests ----

    fn check_holder(&self, file: FileId, role: Role, indices: impl Iterator<Item = u64>) -> Result<(), OpError> {
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

    fn refs(&self, indices: &[u64]) -> Vec<PageRef> {
        indices
            .iter()
            .map(|&index| PageRef {
                index,
                local: self.placement.local_index(index),
            })
            .collect()
    }

    async fn write_pages(
        &self,
        file: FileId,
        role: Role,
        gen: u64,
        keep_gen: u64,
        indices: Vec<u64>,
        data: bytes::Bytes,
    ) -> Result<(), OpError> {
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
        let refs = self.refs(&indices);
        blocking(move || store.write_batch(file, role, gen, keep_gen, &refs, &data)).await??;
        Ok(())
    }

    async fn read_pages(
        &self,
        file: FileId,
        role: Role,
        gen: u64,
        indices: Vec<u64>,
    ) -> Result<(Vec<PageState>, bytes::Bytes), OpError> {
        if indices.len() > crate::peer::BATCH_PAGES * 4 {
            return Err(OpError::new(ErrorKind::Invalid, "too many pages in one read"));
        }
        self.check_holder(file, role, indices.iter().copied())?;
        let store = self.store.clone();
        let refs = self.refs(&indices);
        blocking(move || {
            // Page-aligned, so runs of pages are read with direct I/O. A reused buffer is not
            // zeroed first (the reads overwrite it); the pages not read well are zeroed after,
            // so an answer never carries bytes of an earlier one.
            let len = refs.len() * PAGE_SIZE;
            let mut data = crate::peer::batch_pool().get_at_least(len);
            data.resize_reusing(len);
            let states: Vec<PageState> = match store.read_batch(file, role, gen, &refs, &mut data) {
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

    async fn scrub_local(&self, files: Vec<(FileId, u64, u64)>) -> Result<(u64, Vec<BadCopy>), OpError> {
        let st = self.meta_state();
        let Some(me) = self.my_logical(&st) else {
            return Ok((0, Vec::new()));
        };
        let store = self.store.clone();
        let placement = self.placement;
        blocking(move || {
            let mut checked = 0;
            let mut bad = Vec::new();
            let mut buf = Vec::new();
            for (file, pages, gen) in files {
                if gen == 0 {
                    continue;
                }
                for role in [Role::Primary, Role::Mirror] {
                    let held: Vec<u64> = placement.held(me, file, pages, role).collect();
                    for chunk in held.chunks(crate::peer::BATCH_PAGES) {
                        let refs: Vec<PageRef> = chunk
                            .iter()
                            .map(|&index| PageRef {
                                index,
                                local: placement.local_index(index),
                            })
                            .collect();
                        buf.resize(refs.len() * PAGE_SIZE, 0);
                        let states = store.read_batch(file, role, gen, &refs, &mut buf);
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

impl Handler for Node {
    fn handle(
        self: Arc<Self>,
        from: String,
        req: PeerReq,
        payload: bytes::Bytes,
    ) -> BoxFuture<(PeerResp, bytes::Bytes)> {
        Box::pin(self.handle_inner(from, req, payload))
    }
}

impl Node {
    async fn handle_inner(
        self: Arc<Self>,
        from: String,
        req: PeerReq,
        payload: bytes::Bytes,
    ) -> (PeerResp, bytes::Bytes) {
        let mut out_payload = bytes::Bytes::new();
        let r: Result<PeerResp, OpError> = match req {
            PeerReq::Heartbeat(hb) => {
                self.heard(&from, hb);
                Ok(PeerResp::HeartbeatAck(self.heartbeat()))
            }
            PeerReq::WritePages {
                file,
                role,
                gen,
                keep_gen,
                indices,
            } => self
                .write_pages(file, role, gen, keep_gen, indices, payload)
                .await
                .map(|()| PeerResp::Stored {
                    incarnation: self.incarnation,
                }),
            PeerReq::Sync => {
                let store = self.store.clone();
                match blocking(move || store.sync()).await {
                    Ok(Ok(())) => Ok(PeerResp::Stored {
                        incarnation: self.incarnation,
                    }),
                    Ok(Err(e)) => {
                        tracing::error!(node = %self.me.name, error = %e, "fsync failed; page store poisoned");
                        Err(e.into())
                    }
                    Err(e) => Err(e),
                }
            }
            PeerReq::ReadPages {
                file,
                role,
                gen,
                indices,
            } => self.read_pages(file, role, gen, indices).await.map(|(states, data)| {
                out_payload = data;
                PeerResp::Pages(states)
            }),
            PeerReq::RemoveFile { file } => {
                let store = self.store.clone();
                blocking(move || store.remove_file(file))
                    .await
                    .and_then(|r| r.map_err(OpError::from))
                    .map(|()| PeerResp::Ok)
            }
            PeerReq::ScrubLocal { files } => self
                .scrub_local(files)
                .await
                .map(|(checked, bad)| PeerResp::Scrub { checked, bad }),
            PeerReq::MetaSubmit { op } => Ok(self.serve_submit(op).await),
            PeerReq::Meta(msg) => {
                self.replication.deliver(&from, msg);
                Ok(PeerResp::Ok)
            }
            req @ (PeerReq::BarrierArrive { .. }
            | PeerReq::LockAcquire { .. }
            | PeerReq::LockRelease { .. }
            | PeerReq::SyncGone { .. }
            | PeerReq::SyncReport { .. }
            | PeerReq::SyncReportAsk) => crate::sync::serve(&self, &from, req),
            PeerReq::SyncDone { key, who, call, error } => {
                let result = match error {
                    None => Ok(()),
                    Some((kind, message)) => Err(OpError::new(kind, message)),
                };
                crate::sync::resolve(&self, &key, &who, call, result);
                Ok(PeerResp::Ok)
            }
            req @ (PeerReq::Spawn { .. }
            | PeerReq::RankOutput { .. }
            | PeerReq::RankExit { .. }
            | PeerReq::KillJob { .. }) => crate::launcher::serve(&self, req),
            PeerReq::Echo => {
                out_payload = payload;
                Ok(PeerResp::Ok)
            }
            PeerReq::JobEnded { job } => Ok(PeerResp::Dropped {
                files: self.svm.end_job(&self, &job),
            }),
            PeerReq::ForgetFiles { files } => {
                if files.len() > crate::launcher::MAX_JOB_SEGMENTS {
                    Err(OpError::new(ErrorKind::Invalid, "too many segments to forget at once"))
                } else {
                    let pages = self.svm.forget(&files);
                    tracing::debug!(node = %self.name(), segments = files.len(), pages, "ended job's segments forgotten");
                    Ok(PeerResp::Ok)
                }
            }
            PeerReq::CountMappings { file } => Ok(PeerResp::Mappings {
                count: self.svm.mappings(file),
            }),
            PeerReq::DropRemoved { file } => {
                self.svm.drop_removed(&self, file);
                Ok(PeerResp::Ok)
            }
            PeerReq::Svm(env) => {
                if self.speaks_for(&from, env.from) {
                    self.svm.on_message(&self, env, payload);
                    Ok(PeerResp::Ok)
                } else {
                    Err(OpError::new(
                        ErrorKind::Permission,
                        format!("{from} may not send coherence messages as node {}", env.from),
                    ))
                }
            }
            PeerReq::LinkPing { .. } | PeerReq::LinkPong { .. } => {
                Err(OpError::new(ErrorKind::Invalid, "link pings go over the message link"))
            }
        };
        match r {
            Ok(resp) => (resp, out_payload),
            Err(e) => (peer_error(e), bytes::Bytes::new()),
        }
    }
}

/// Delivers the message link's messages to the node (on the link thread).
pub struct LinkDelivery(pub Arc<Node>);

impl crate::link::LinkHandler for LinkDelivery {
    fn deliver(&self, from: &str, req: PeerReq, payload: bytes::Bytes) {
        let node = &self.0;
        match req {
            PeerReq::Svm(env) => {
                if node.speaks_for(from, env.from) {
                    node.svm.on_message(node, env, payload)
                } else {
                    tracing::warn!(node = %node.name(), peer = from, claimed = %env.from, "coherence message sent in another node's name: dropped");
                }
            }
            req @ (PeerReq::BarrierArrive { .. }
            | PeerReq::LockAcquire { .. }
            | PeerReq::LockRelease { .. }
            | PeerReq::SyncGone { .. }
            | PeerReq::SyncReport { .. }
            | PeerReq::SyncReportAsk) => {
                if let Err(e) = crate::sync::serve(node, from, req) {
                    tracing::warn!(node = %node.name(), peer = from, error = %e, "barrier or lock message refused");
                }
            }
            PeerReq::SyncDone { key, who, call, error } => {
                let result = match error {
                    None => Ok(()),
                    Some((kind, message)) => Err(OpError::new(kind, message)),
                };
                crate::sync::resolve(node, &key, &who, call, result);
            }
            PeerReq::Meta(msg) => node.replication.deliver(from, msg),
            PeerReq::LinkPing { id } => {
                if let Err(e) = node.net.post(from, &PeerReq::LinkPong { id }, payload) {
                    tracing::warn!(node = %node.name(), peer = from, error = %e, "link pong not sent");
                }
            }
            PeerReq::LinkPong { id } => {
                let waiter = node.link_pings.locked().remove(&id);
                if let Some(tx) = waiter {
                    let _ = tx.send(payload.len());
                }
            }
            other => {
                tracing::warn!(node = %node.name(), peer = from, message = ?std::mem::discriminant(&other), "not a one-way message: dropped");
            }
        }
    }
}

/// Resident set size of this process.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map(|pages| pages * 4096)
        .unwrap_or(0)
}
