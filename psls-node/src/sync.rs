//! The shell of barriers and locks for client ranks (DESIGN §5: synchronization comes from the
//! daemons, not from spinning on shared pages). The protocol — the coordinator's barriers and
//! locks ([`SyncState`]) and each node's table of waiting ranks ([`psls_cluster::sync::Waits`])
//! — is pure and lives in `psls-cluster`; this module wires it to the message link and to the
//! ranks' replies.
//!
//! A rank's daemon registers the wait locally, posts the arrival, acquire or release to the
//! coordinator (one-way, on the message link), and the coordinator posts each notice back to
//! the waiter's node (`SyncDone`): a call costs one message each way per remote rank. The
//! waiting rank is answered through its [`Replier`]: straight into its sync channel
//! ([`crate::sync_channel`]), or through a runtime task for calls on the request connection.
//! Names are scoped by user and job, so jobs and users cannot meet at each other's barriers.
//!
//! Invariants (besides the protocol's): a wait whose coordinator changes fails within a
//! heartbeat interval ([`Waits::sweep`]: the new coordinator knows nothing of it); every
//! registered wait is answered exactly once.

use crate::failstop::Locked;
use crate::node::{Node, OpError};
use crate::peer::{PeerReq, PeerResp};
pub use psls_cluster::sync::{key, SyncState, MAX_LOCAL_WAITS, MAX_PARTIES};
use psls_cluster::sync::{node_of, Notice, RegisterError, SyncError};
use psls_ipc::ErrorKind;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

impl From<SyncError> for OpError {
    fn from(e: SyncError) -> Self {
        match e {
            SyncError::Invalid(m) => OpError::new(ErrorKind::Invalid, m),
            SyncError::Unavailable(m) => OpError::new(ErrorKind::Unavailable, m),
        }
    }
}

/// Who a client process is, cluster-wide.
pub fn who(node: &Node, pid: i32) -> String {
    format!("{}/{pid}", node.name())
}

/// How a waiting rank gets its answer.
pub enum Replier {
    /// A task of the runtime awaits it (calls made on the client's request connection).
    Task(oneshot::Sender<Result<(), OpError>>),
    /// The rank waits on its sync channel: the answer is written there directly, by whichever
    /// thread has it.
    Channel(Arc<crate::sync_channel::Channel>),
}

impl Replier {
    fn send(self, r: Result<(), OpError>) {
        match self {
            Replier::Task(tx) => {
                let _ = tx.send(r);
            }
            Replier::Channel(ch) => ch.answer(r),
        }
    }
}

/// This node's ranks waiting for a barrier, a lock or an unlock (the pure table, behind a lock).
#[derive(Default)]
pub struct Waits(Mutex<psls_cluster::sync::Waits<Replier>>);

impl Waits {
    fn lock(&self) -> std::sync::MutexGuard<'_, psls_cluster::sync::Waits<Replier>> {
        self.0.locked()
    }

    /// Ends the waits of rank `who`, which is gone (or has no session left): each is answered
    /// with an error, in case anyone still reads it, since the coordinator, told of the
    /// departure, sends no notice for them.
    fn forget(&self, who: &str) -> usize {
        let gone = self.lock().take_rank(who);
        let n = gone.len();
        for (_, wait) in gone {
            let e = OpError::new(
                ErrorKind::Unavailable,
                format!("rank {who} ended its sessions while this call waited"),
            );
            wait.reply.send(Err(e));
        }
        n
    }

    /// Waits registered now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fails every wait whose coordinator is no longer the coordinator.
    pub fn sweep(&self, node: &Node) {
        let now = node.coordinator_now().map(|(_, c)| c);
        let stale = self.lock().sweep(now.as_deref());
        for (_, wait) in stale {
            let e = OpError::new(
                ErrorKind::Unavailable,
                format!("the coordinator ({}) went down while this rank waited", wait.coord),
            );
            wait.reply.send(Err(e));
        }
    }
}

/// Starts a rank's barrier, lock or unlock call: registers its wait, then posts it to the
/// coordinator (or serves it here). The answer always comes through `reply`: the
/// coordinator's notice, an error now, or the sweep's if the coordinator goes down.
pub fn start(node: &Arc<Node>, req: PeerReq, reply: Replier) {
    let wait_key = match &req {
        PeerReq::BarrierArrive { key, who, .. }
        | PeerReq::LockAcquire { key, who }
        | PeerReq::LockRelease { key, who } => (key.clone(), who.clone()),
        _ => {
            reply.send(Err(OpError::new(ErrorKind::Internal, "not a barrier or lock call")));
            return;
        }
    };
    let Some((_, coord)) = node.coordinator_now() else {
        reply.send(Err(OpError::new(ErrorKind::Unavailable, "no coordinator is up")));
        return;
    };
    if let Err((e, reply)) = node.waits.lock().register(&wait_key.0, &wait_key.1, &coord, reply) {
        let e = match e {
            RegisterError::Full => OpError::new(ErrorKind::Unavailable, e.to_string()),
            RegisterError::Duplicate => OpError::new(ErrorKind::Invalid, e.to_string()),
        };
        reply.send(Err(e));
        return;
    }
    let sent = if coord == node.name() {
        serve(node, req).map(|_| ())
    } else {
        node.net.post(&coord, &req, bytes::Bytes::new()).map_err(Into::into)
    };
    if let Err(e) = sent {
        if let Some(wait) = node.waits.lock().take(&wait_key.0, &wait_key.1) {
            wait.reply.send(Err(e));
        }
    }
}

/// A rank's barrier, lock or unlock call made through the runtime: waits for its answer.
pub async fn call(node: &Arc<Node>, req: PeerReq) -> Result<(), OpError> {
    let (tx, rx) = oneshot::channel();
    start(node, req, Replier::Task(tx));
    rx.await
        .unwrap_or_else(|_| Err(OpError::new(ErrorKind::Unavailable, "the wait was cancelled")))
}

/// Rank `who` of this node is gone: its waits here end, and the coordinator releases its
/// locks and fails the barrier it waited at. Posted like arrivals, so it cannot overtake the
/// rank's last call on the way.
pub fn gone(node: &Arc<Node>, who: String) -> Result<(), OpError> {
    let ended = node.waits.forget(&who);
    if ended > 0 {
        tracing::debug!(node = %node.name(), %who, ended, "a gone rank's waits ended");
    }
    let Some((_, coord)) = node.coordinator_now() else {
        return Err(OpError::new(ErrorKind::Unavailable, "no coordinator is up"));
    };
    let req = PeerReq::SyncGone { who };
    if coord == node.name() {
        return serve(node, req).map(|_| ());
    }
    node.net.post(&coord, &req, bytes::Bytes::new()).map_err(Into::into)
}

/// Delivers notices: to this node's waits, or posted to the waiter's node.
fn deliver(node: &Arc<Node>, notices: Vec<Notice>) {
    for (key, who, result) in notices {
        let result = result.map_err(OpError::from);
        let target = node_of(&who).to_string();
        if target == node.name() {
            resolve(node, &key, &who, result);
            continue;
        }
        let error = result.err().map(|e| (e.kind, e.message));
        let req = PeerReq::SyncDone {
            key,
            who: who.clone(),
            error,
        };
        if let Err(e) = node.net.post(&target, &req, bytes::Bytes::new()) {
            tracing::warn!(node = %node.name(), peer = %target, %who, error = %e, "sync notice not sent");
        }
    }
}

/// Answers this node's rank `who` waiting on `key`.
pub fn resolve(node: &Node, key: &str, who: &str, result: Result<(), OpError>) {
    let wait = node.waits.lock().take(key, who);
    match wait {
        Some(wait) => wait.reply.send(result),
        None => tracing::debug!(node = %node.name(), %who, "sync notice for a wait that is gone"),
    }
}

/// The coordinator's side of the sync messages (arrivals and acquires answer through
/// notices; the returned response is for releases and departures).
pub fn serve(node: &Arc<Node>, req: PeerReq) -> Result<PeerResp, OpError> {
    let notices = {
        let mut st = node.sync.locked();
        match req {
            PeerReq::BarrierArrive { key, count, who } => st.arrive(&key, count, &who),
            PeerReq::LockAcquire { key, who } => st.acquire(&key, &who),
            PeerReq::LockRelease { key, who } => st.release(&key, &who),
            PeerReq::SyncGone { who } => st.gone(&who),
            _ => return Err(OpError::new(ErrorKind::Internal, "not a sync request")),
        }
    };
    deliver(node, notices);
    Ok(PeerResp::Ok)
}
