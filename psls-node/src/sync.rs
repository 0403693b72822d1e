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
//! (`sync_channel.rs`), or through a runtime task for calls on the request connection.
//! Names are scoped by user and job, so jobs and users cannot meet at each other's barriers.
//!
//! A coordinator is known by name and incarnation: a new one (another node, or the same one
//! restarted) starts from nothing and grants no lock until every live node has sent the report
//! of its ranks' held locks, which a node sends before its first call there and at the next
//! [`sweep`] (soft state rebuilt from the survivors, DESIGN §3).
//!
//! Invariants (besides the protocol's): a wait whose coordinator changes fails within a
//! heartbeat interval ([`sweep`]: the new coordinator knows nothing of it), as the cluster's
//! failure ([`Blame`]: a rank that exits for it rolls its job back, never fails it); every
//! registered wait is answered exactly once; a node calls only for its own ranks.

use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp};
pub use psls_cluster::sync::{key, SyncState, MAX_LOCAL_WAITS, MAX_PARTIES};
use psls_cluster::sync::{node_of, Call, CallKind, Notice, RegisterError, SyncError};
use psls_ipc::ErrorKind;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

impl From<SyncError> for OpError {
    fn from(e: SyncError) -> Self {
        match e {
            SyncError::Invalid(m) => OpError::new(ErrorKind::Invalid, m),
            SyncError::Unavailable(m) | SyncError::Moved(m) => OpError::new(ErrorKind::Unavailable, m),
        }
    }
}

/// The job part of a barrier's or lock's name: a rank of a `psls run` job (`start`: its job
/// and which start of it) naming its own job meets only the ranks of the same start. After a
/// rollback the ranks start again under the same job name; an arrival of a rank of the
/// stopped start still on its way to the coordinator must not count in a barrier of the new
/// one (it did, and a barrier opened one rank short, each rank then a step apart: the next
/// safe point never gathered them all).
pub fn scope(job: &str, start: &Option<(String, u32)>) -> String {
    match start {
        Some((j, attempt)) if j == job => format!("{job}#{attempt}"),
        _ => job.to_string(),
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
    Sink(Arc<dyn ReplySink>),
}

/// Where an answer can be written straight away (a rank's sync channel).
pub trait ReplySink: Send + Sync {
    fn answer(&self, r: Result<(), OpError>);
}

/// Barriers and locks on this node: the waiting ranks and, while this node coordinates, the
/// barrier and lock state. The handle the sync channels, the IPC server and the peer
/// dispatch use.
pub struct SyncShell {
    pub node: Arc<Node>,
    waits: Waits,
    side: Mutex<SyncSide>,
    blame: Blame,
}

/// Told that the cluster failed a call of local process `pid` (its coordinator changed or
/// was unreachable), and why, before the process gets the error.
pub type Blame = Box<dyn Fn(u32, &str) + Send + Sync>;

impl SyncShell {
    pub fn new(node: Arc<Node>, blame: Blame) -> SyncShell {
        SyncShell {
            node,
            waits: Waits::default(),
            side: Mutex::new(SyncSide::default()),
            blame,
        }
    }

    /// Answers rank `who`'s call with `r`: an error of the cluster's (`moved`) is blamed on
    /// the cluster first (see [`Blame`]).
    fn reply(&self, who: &str, reply: Replier, r: Result<(), OpError>, moved: bool) {
        if let (Err(e), true) = (&r, moved) {
            let pid = who
                .split_once('/')
                .filter(|(n, _)| *n == self.node.name())
                .and_then(|(_, p)| p.parse::<u32>().ok());
            if let Some(pid) = pid {
                (self.blame)(pid, &e.message);
            }
        }
        reply.send(r);
    }

    /// Waits registered now.
    pub fn waits(&self) -> usize {
        self.waits.len()
    }
}

impl Replier {
    fn send(self, r: Result<(), OpError>) {
        match self {
            Replier::Task(tx) => {
                let _ = tx.send(r);
            }
            Replier::Sink(ch) => ch.answer(r),
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
}

/// The coordinator's side: the barrier and lock state, and the identity of the coordinator
/// this node last saw (when it becomes coordinator under a new identity, it starts afresh and
/// waits for the nodes' reports).
#[derive(Default)]
pub struct SyncSide {
    coord_seen: Option<String>,
    state: SyncState,
}

/// The coordinator as a rank's call addresses it: its name, and an identity that changes when
/// it restarts or leads a new epoch (`name#incarnation@epoch`), so a restarted or re-elected
/// coordinator is a new one: waits it lost fail, and it gets the nodes' reports again (a node
/// that led, lost the lead and leads again starts afresh; with the same identity, a grant of
/// its old state still on the way was taken beside one of the new: two holders, found by the
/// sync simulator).
fn coordinator_id(node: &Node) -> Option<(String, String)> {
    let (_, name) = node.coordinator_now()?;
    let inc = node.heard_incarnation(&name);
    let epoch = node
        .replication
        .leader_epoch()
        .filter(|(l, _)| *l == name)
        .map_or(0, |(_, e)| e);
    let id = format!("{name}#{inc}@{epoch}");
    Some((name, id))
}

/// Whether this node coordinates now: the coordinator in its own view (leader, with its
/// lease), with the state it took over under that identity.
fn coordinating(node: &Node, side: &SyncSide) -> bool {
    coordinator_id(node)
        .is_some_and(|(name, id)| name == node.name() && side.coord_seen.as_deref() == Some(id.as_str()))
}

/// Brings the coordinator's side up to date: a node that has just become coordinator (under a
/// new identity) starts from [`SyncState::take_over`] over the live nodes of the map; nodes
/// it awaits that are down now report nothing (their ranks are gone). A leader without its
/// lease keeps its state and serves nothing (the identity the nodes know has not changed).
/// Returns the notices that releases.
fn refresh(node: &Node, side: &mut SyncSide) -> Vec<Notice> {
    let now = coordinator_id(node);
    let me = node.name();
    if let Some((name, id)) = &now {
        if name == me && side.coord_seen.as_deref() != Some(id.as_str()) {
            let st = node.meta_state();
            let live: Vec<String> = node
                .logical_map(&st)
                .into_values()
                .filter(|p| !node.is_declared_down(p))
                .collect();
            tracing::info!(node = %me, coordinator = %id, awaiting = ?live, "coordinating barriers and locks: waiting for the nodes' reports");
            side.state = SyncState::take_over(live);
        }
        side.coord_seen = Some(id.clone());
    }
    let down: Vec<String> = side
        .state
        .awaiting()
        .filter(|n| node.is_declared_down(n))
        .map(str::to_string)
        .collect();
    let mut out = Vec::new();
    for n in down {
        out.extend(side.state.node_down(&n));
    }
    out
}

/// Every heartbeat interval (on the `psls-sync` thread): fails the waits whose coordinator
/// changed, sends a new coordinator this node's report, and at the coordinator, stops waiting
/// for reports of nodes that went down.
pub fn sweep(sh: &SyncShell) {
    let node = &sh.node;
    let coord = coordinator_id(node);
    let (stale, report) = sh.waits.lock().sweep(coord.as_ref().map(|(_, id)| id.as_str()));
    give_up(sh, stale);
    if let (Some((name, _)), Some(held)) = (coord, report) {
        if let Err(e) = send(sh, &name, PeerReq::SyncReport { held }) {
            tracing::debug!(node = %node.name(), coordinator = %name, error = %e, "lock report not sent; will retry");
            sh.waits.lock().report_lost();
        }
    }
    let (notices, ask) = {
        let mut side = sh.side.locked();
        let n = refresh(node, &mut side);
        let ask: Vec<String> = side.state.awaiting().map(str::to_string).collect();
        (n, ask)
    };
    deliver(sh, notices);
    // Recovering: ask the awaited nodes again (a report may have been lost with a connection).
    for peer in ask {
        if let Err(e) = send(sh, &peer, PeerReq::SyncReportAsk) {
            tracing::debug!(node = %node.name(), %peer, error = %e, "lock report request not sent");
        }
    }
}

/// Sends a sync message to the coordinator `coord` (served here if it is this node).
fn send(sh: &SyncShell, coord: &str, req: PeerReq) -> Result<(), OpError> {
    let node = &sh.node;
    if coord == node.name() {
        return serve(sh, coord, req).map(|_| ());
    }
    node.net.post(coord, &req, bytes::Bytes::new()).map_err(Into::into)
}

/// Starts a rank's barrier, lock or unlock call: registers its wait, then posts it to the
/// coordinator (or serves it here), after this node's report if that coordinator has not had
/// it. The answer always comes through `reply`: the coordinator's notice, an error now, or the
/// sweep's if the coordinator goes down.
pub fn start(sh: &SyncShell, mut req: PeerReq, reply: Replier) {
    let node = &sh.node;
    let (key, who, kind) = match &req {
        PeerReq::BarrierArrive { key, who, .. } => (key.clone(), who.clone(), CallKind::Barrier),
        PeerReq::LockAcquire { key, who, .. } => (key.clone(), who.clone(), CallKind::Acquire),
        PeerReq::LockRelease { key, who, .. } => (key.clone(), who.clone(), CallKind::Release),
        _ => {
            reply.send(Err(OpError::new(ErrorKind::Internal, "not a barrier or lock call")));
            return;
        }
    };
    let Some((coord, coord_id)) = coordinator_id(node) else {
        let e = OpError::new(ErrorKind::Unavailable, "no coordinator is up");
        sh.reply(&who, reply, Err(e), true);
        return;
    };
    let (switched, registered) = {
        let mut w = sh.waits.lock();
        let switched = w.switch_to(&coord_id);
        (switched, w.register(&key, &who, kind, reply))
    };
    // A new coordinator: the calls still waiting on the old one are given up, and the new one
    // gets this node's report before anything else.
    let mut sent = Ok(());
    if let Some((stale, held)) = switched {
        give_up(sh, stale);
        sent = send(sh, &coord, PeerReq::SyncReport { held });
        if sent.is_err() {
            sh.waits.lock().report_lost();
        }
    }
    let call_id = match registered {
        Ok(id) => id,
        Err((e, reply)) => {
            let e = match e {
                RegisterError::Full | RegisterError::NoCoordinator => {
                    OpError::new(ErrorKind::Unavailable, e.to_string())
                }
                RegisterError::Duplicate => OpError::new(ErrorKind::Invalid, e.to_string()),
            };
            sh.reply(&who, reply, Err(e), false);
            return;
        }
    };
    if let PeerReq::BarrierArrive { call, .. } | PeerReq::LockAcquire { call, .. } | PeerReq::LockRelease { call, .. } =
        &mut req
    {
        *call = call_id;
    }
    if sent.is_ok() {
        sent = send(sh, &coord, req);
    }
    // Not sent: the coordinator is unreachable (the cluster's failure).
    if let Err(e) = sent {
        let wait = sh.waits.lock().take(&key, &who);
        if let Some(wait) = wait {
            sh.reply(&who, wait.reply, Err(e), true);
        }
    }
}

/// Answers calls given up because the coordinator changed (the cluster's failure).
fn give_up(sh: &SyncShell, stale: Vec<((String, String), psls_cluster::sync::Wait<Replier>)>) {
    for ((_, who), wait) in stale {
        let e = OpError::new(
            ErrorKind::Unavailable,
            format!(
                "the coordinator ({}) went down while this rank waited",
                wait.coord.split('#').next().unwrap_or(&wait.coord)
            ),
        );
        sh.reply(&who, wait.reply, Err(e), true);
    }
}

/// A rank's barrier, lock or unlock call made through the runtime: waits for its answer.
pub async fn call(sh: &SyncShell, req: PeerReq) -> Result<(), OpError> {
    let (tx, rx) = oneshot::channel();
    start(sh, req, Replier::Task(tx));
    rx.await
        .unwrap_or_else(|_| Err(OpError::new(ErrorKind::Unavailable, "the wait was cancelled")))
}

/// Rank `who` of this node is gone: its waits here end, and the coordinator releases its
/// locks and fails the barrier it waited at. Posted like arrivals, so it cannot overtake the
/// rank's last call on the way.
pub fn gone(sh: &SyncShell, who: String) -> Result<(), OpError> {
    let node = &sh.node;
    let ended = sh.waits.forget(&who);
    if ended > 0 {
        tracing::debug!(node = %node.name(), %who, ended, "a gone rank's waits ended");
    }
    let Some((_, coord)) = node.coordinator_now() else {
        return Err(OpError::new(ErrorKind::Unavailable, "no coordinator is up"));
    };
    send(sh, &coord, PeerReq::SyncGone { who })
}

/// Delivers notices: posted to the waiter's node, then to this node's waits. The remote ones
/// go first: a local rank woken first could take this 2-core machine's other core while the
/// remote release, a whole hop longer, still waits to be sent. (A rank has one call at a time,
/// so no rank's notices change order.)
fn deliver(sh: &SyncShell, notices: Vec<Notice>) {
    let node = &sh.node;
    let (local, remote): (Vec<Notice>, Vec<Notice>) = notices.into_iter().partition(|n| node_of(&n.1) == node.name());
    for (key, who, call, result) in remote.into_iter().chain(local) {
        let moved = matches!(result, Err(SyncError::Moved(_)));
        let result = result.map_err(OpError::from);
        let target = node_of(&who).to_string();
        if target == node.name() {
            resolve(sh, &key, &who, call, result, moved);
            continue;
        }
        let error = result.err().map(|e| (e.kind, e.message));
        let req = PeerReq::SyncDone {
            key,
            who: who.clone(),
            call,
            error,
            moved,
        };
        if let Err(e) = node.net.post(&target, &req, bytes::Bytes::new()) {
            tracing::warn!(node = %node.name(), peer = %target, %who, error = %e, "sync notice not sent");
        }
    }
}

/// Answers this node's rank `who` waiting on `key` in call `call` (`moved`: the error is the
/// cluster's).
pub fn resolve(sh: &SyncShell, key: &str, who: &str, call: u64, result: Result<(), OpError>, moved: bool) {
    let node = &sh.node;
    let wait = sh.waits.lock().answered(key, who, call, result.is_ok());
    match wait {
        Some(wait) => sh.reply(who, wait.reply, result, moved),
        None => tracing::debug!(node = %node.name(), %who, "sync notice for a wait that is gone"),
    }
}

/// The coordinator's side of the sync messages from node `from` (arrivals and acquires answer
/// through notices; the returned response is for releases and departures).
pub fn serve(sh: &SyncShell, from: &str, req: PeerReq) -> Result<PeerResp, OpError> {
    let node = &sh.node;
    let call = match req {
        PeerReq::BarrierArrive { key, count, who, call } => Call::Arrive { key, count, who, call },
        PeerReq::LockAcquire { key, who, call } => Call::Acquire { key, who, call },
        PeerReq::LockRelease { key, who, call } => Call::Release { key, who, call },
        PeerReq::SyncGone { who } => Call::Gone { who },
        PeerReq::SyncReportAsk => {
            // From a recovering coordinator (`from`): it gets this node's report now.
            let Some((coord, id)) = coordinator_id(node) else {
                return Ok(PeerResp::Ok);
            };
            if coord != from {
                return Ok(PeerResp::Ok);
            }
            let (stale, held) = sh.waits.lock().report_to(&id);
            give_up(sh, stale);
            send(sh, &coord, PeerReq::SyncReport { held })?;
            return Ok(PeerResp::Ok);
        }
        PeerReq::SyncReport { held } => {
            let notices = {
                let mut side = sh.side.locked();
                let mut n = refresh(node, &mut side);
                // A node that is not the coordinator in its own view takes no report: its
                // state is not the cluster's, and a report completing its take-over would
                // grant the calls it deferred (the reporter reports to the new one too).
                if coordinating(node, &side) {
                    n.extend(side.state.report(from, &held));
                }
                n
            };
            deliver(sh, notices);
            return Ok(PeerResp::Ok);
        }
        _ => return Err(OpError::new(ErrorKind::Internal, "not a sync request")),
    };
    // A node speaks only for its own ranks.
    let who = match &call {
        Call::Arrive { who, .. } | Call::Acquire { who, .. } | Call::Release { who, .. } | Call::Gone { who } => who,
    };
    if node_of(who) != from {
        return Err(OpError::new(
            ErrorKind::Permission,
            format!("{from} may not call for rank {who} of another node"),
        ));
    }
    // A node this coordinator takes as down gets nothing: what it granted there would be
    // released at the next refresh (its ranks count as gone). And a node that is not the
    // coordinator in its own view serves nothing (its state is not the cluster's).
    let notices = {
        let mut side = sh.side.locked();
        let mut n = refresh(node, &mut side);
        let refusal = if node.is_declared_down(from) {
            Some(format!("the coordinator takes {from} as down"))
        } else if !coordinating(node, &side) {
            Some(format!("{} is not the coordinator (any more)", node.name()))
        } else {
            None
        };
        match refusal {
            Some(why) => {
                if let Call::Arrive { key, who, call, .. }
                | Call::Acquire { key, who, call }
                | Call::Release { key, who, call } = call
                {
                    n.push((key, who, call, Err(SyncError::Moved(why))));
                }
            }
            None => n.extend(side.state.call(call)),
        }
        n
    };
    deliver(sh, notices);
    Ok(PeerResp::Ok)
}
