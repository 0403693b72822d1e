//! Named barriers and locks for client ranks (DESIGN §5: synchronization comes from the
//! daemons, not from spinning on shared pages).
//!
//! Both live at the coordinator (the lowest live logical node), in [`SyncState`]: a pure state
//! machine whose calls return *notices* — which waiting rank to release, with what result. A
//! rank's daemon registers the wait locally, posts the arrival, acquire or release to the
//! coordinator (one-way, on the message link), and the coordinator posts each notice back to
//! the waiter's node (`SyncDone`): a call costs one message each way per remote rank. The
//! waiting rank is answered through its [`Replier`]: straight into its sync channel
//! ([`crate::sync_channel`]), or through a runtime task for calls on the request connection.
//! Names are scoped by user and job, so jobs and users cannot meet at each other's barriers.
//!
//! Invariants: a lock has at most one holder, and only the holder may release it; a barrier
//! opens exactly when `count` distinct ranks have arrived; a rank that dies releases its locks
//! and fails the barrier it waited at, so no other rank waits forever on it; a wait whose
//! coordinator changes fails within a heartbeat interval ([`Waits::sweep`]: the new
//! coordinator knows nothing of it); every registered wait is answered exactly once.

use crate::node::{Node, OpError};
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::ErrorKind;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// Most ranks at one barrier, and waiters on one lock.
pub const MAX_PARTIES: u32 = 1 << 16;
/// Most waits registered on one node at a time.
pub const MAX_LOCAL_WAITS: usize = 1 << 16;

/// A rank to release: the key it waits on, the rank (`node/pid`), and the result.
pub type Notice = (String, String, Result<(), OpError>);

struct Barrier {
    count: u32,
    waiting: Vec<String>,
}

#[derive(Default)]
struct Lock {
    holder: Option<String>,
    queue: VecDeque<String>,
}

/// The coordinator's barriers and locks.
#[derive(Default)]
pub struct SyncState {
    barriers: HashMap<String, Barrier>,
    locks: HashMap<String, Lock>,
}

fn invalid(m: String) -> OpError {
    OpError::new(ErrorKind::Invalid, m)
}

impl SyncState {
    /// `who` arrives at barrier `key` of `count` ranks.
    pub fn arrive(&mut self, key: &str, count: u32, who: &str) -> Vec<Notice> {
        if count == 0 || count > MAX_PARTIES {
            let m = format!("barrier count {count} (1 to {MAX_PARTIES})");
            return vec![(key.into(), who.into(), Err(invalid(m)))];
        }
        let b = self.barriers.entry(key.to_string()).or_insert(Barrier {
            count,
            waiting: Vec::new(),
        });
        if b.count != count {
            let m = format!(
                "barrier '{}' is awaited by {} ranks, this rank says {count}",
                short(key),
                b.count
            );
            return vec![(key.into(), who.into(), Err(invalid(m)))];
        }
        if b.waiting.iter().any(|w| w == who) {
            let m = format!("this rank already waits at barrier '{}'", short(key));
            return vec![(key.into(), who.into(), Err(invalid(m)))];
        }
        b.waiting.push(who.to_string());
        if b.waiting.len() as u32 == b.count {
            if let Some(b) = self.barriers.remove(key) {
                return b.waiting.into_iter().map(|w| (key.to_string(), w, Ok(()))).collect();
            }
        }
        Vec::new()
    }

    /// `who` asks for lock `key`.
    pub fn acquire(&mut self, key: &str, who: &str) -> Vec<Notice> {
        let l = self.locks.entry(key.to_string()).or_default();
        match &l.holder {
            None => {
                l.holder = Some(who.to_string());
                vec![(key.into(), who.into(), Ok(()))]
            }
            Some(h) if h == who => {
                let m = format!("lock {} is already held by this rank", short(key));
                vec![(key.into(), who.into(), Err(invalid(m)))]
            }
            Some(_) if l.queue.len() as u32 >= MAX_PARTIES => {
                let m = format!("too many ranks wait for lock {}", short(key));
                vec![(key.into(), who.into(), Err(invalid(m)))]
            }
            Some(_) => {
                l.queue.push_back(who.to_string());
                Vec::new()
            }
        }
    }

    /// `who` releases lock `key`: the notices answer it (an error if it does not hold the
    /// lock) and grant the lock to the next waiter.
    pub fn release(&mut self, key: &str, who: &str) -> Vec<Notice> {
        let held = self.locks.get(key).and_then(|l| l.holder.as_deref()) == Some(who);
        if !held {
            let m = format!("lock {} is not held by this rank", short(key));
            return vec![(key.into(), who.into(), Err(invalid(m)))];
        }
        let mut out = vec![(key.to_string(), who.to_string(), Ok(()))];
        out.extend(self.pass_on(key));
        out
    }

    /// Gives lock `key` to the next waiter, or frees it.
    fn pass_on(&mut self, key: &str) -> Vec<Notice> {
        let Some(l) = self.locks.get_mut(key) else {
            return Vec::new();
        };
        l.holder = l.queue.pop_front();
        match &l.holder {
            Some(next) => vec![(key.to_string(), next.clone(), Ok(()))],
            None => {
                self.locks.remove(key);
                Vec::new()
            }
        }
    }

    /// Rank `who` died: its locks pass on, its queued requests go, and the barrier it waited
    /// at fails for the others.
    pub fn gone(&mut self, who: &str) -> Vec<Notice> {
        let mut out = Vec::new();
        for l in self.locks.values_mut() {
            l.queue.retain(|w| w != who);
        }
        let held: Vec<String> = self
            .locks
            .iter()
            .filter(|(_, l)| l.holder.as_deref() == Some(who))
            .map(|(k, _)| k.clone())
            .collect();
        for k in held {
            out.extend(self.pass_on(&k));
        }
        let failed: Vec<String> = self
            .barriers
            .iter()
            .filter(|(_, b)| b.waiting.iter().any(|w| w == who))
            .map(|(k, _)| k.clone())
            .collect();
        for k in failed {
            if let Some(b) = self.barriers.remove(&k) {
                for w in b.waiting.into_iter().filter(|w| w != who) {
                    let e = OpError::new(
                        ErrorKind::Unavailable,
                        format!("a rank ({who}) exited while waiting at barrier '{}'", short(&k)),
                    );
                    out.push((k.clone(), w, Err(e)));
                }
            }
        }
        out
    }
}

/// The user-visible part of a key (`uid:job:name`).
fn short(key: &str) -> &str {
    key.splitn(3, ':').nth(2).unwrap_or(key)
}

/// The scope of a client's names.
pub fn key(uid: u32, job: &str, name: &str) -> String {
    format!("{uid}:{job}:{name}")
}

/// Who a client process is, cluster-wide.
pub fn who(node: &Node, pid: i32) -> String {
    format!("{}/{pid}", node.name())
}

/// The node of a rank named by [`who`].
fn node_of(who: &str) -> &str {
    who.split_once('/').map_or(who, |(n, _)| n)
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

struct Wait {
    /// The coordinator the call went to: if it changes, the wait fails (the new one never
    /// saw it).
    coord: String,
    reply: Replier,
}

/// This node's ranks waiting for a barrier, a lock or an unlock, by (key, who).
#[derive(Default)]
pub struct Waits(Mutex<HashMap<(String, String), Wait>>);

impl Waits {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Wait>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the waits of rank `who`, which is gone (or has no session left): each is answered
    /// with an error, in case anyone still reads it, since the coordinator, told of the
    /// departure, sends no notice for them.
    fn forget(&self, who: &str) -> usize {
        let gone: Vec<Wait> = {
            let mut w = self.lock();
            let keys: Vec<(String, String)> = w.keys().filter(|(_, rank)| rank == who).cloned().collect();
            keys.iter().filter_map(|k| w.remove(k)).collect()
        };
        let n = gone.len();
        for wait in gone {
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
        let stale: Vec<((String, String), Wait)> = {
            let mut w = self.lock();
            let keys: Vec<(String, String)> = w
                .iter()
                .filter(|(_, v)| now.as_deref() != Some(v.coord.as_str()))
                .map(|(k, _)| k.clone())
                .collect();
            keys.into_iter().filter_map(|k| w.remove_entry(&k)).collect()
        };
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
    {
        let mut w = node.waits.lock();
        if w.len() >= MAX_LOCAL_WAITS {
            drop(w);
            reply.send(Err(OpError::new(
                ErrorKind::Unavailable,
                "too many waiting ranks on this node",
            )));
            return;
        }
        if w.contains_key(&wait_key) {
            drop(w);
            reply.send(Err(invalid("this rank already waits here".into())));
            return;
        }
        w.insert(
            wait_key.clone(),
            Wait {
                coord: coord.clone(),
                reply,
            },
        );
    }
    let sent = if coord == node.name() {
        serve(node, req).map(|_| ())
    } else {
        node.net.post(&coord, &req, bytes::Bytes::new()).map_err(Into::into)
    };
    if let Err(e) = sent {
        if let Some(wait) = node.waits.lock().remove(&wait_key) {
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
    let wait = node.waits.lock().remove(&(key.to_string(), who.to_string()));
    match wait {
        Some(wait) => wait.reply.send(result),
        None => tracing::debug!(node = %node.name(), %who, "sync notice for a wait that is gone"),
    }
}

/// The coordinator's side of the sync messages (arrivals and acquires answer through
/// notices; the returned response is for releases and departures).
pub fn serve(node: &Arc<Node>, req: PeerReq) -> Result<PeerResp, OpError> {
    let notices = {
        let mut st = node.sync.lock().unwrap_or_else(|e| e.into_inner());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn released(n: &[Notice]) -> Vec<(&str, bool)> {
        n.iter().map(|(_, w, r)| (w.as_str(), r.is_ok())).collect()
    }

    #[test]
    fn barrier_opens_at_count_and_rejects_mismatches() {
        let mut s = SyncState::default();
        assert!(s.arrive("0:j:x", 2, "n0/1").is_empty(), "opened too early");
        let n = s.arrive("0:j:x", 3, "n1/2");
        assert!(n[0].2.as_ref().unwrap_err().message.contains("awaited by 2 ranks"));
        let n = s.arrive("0:j:x", 2, "n0/1");
        assert!(n[0].2.as_ref().unwrap_err().message.contains("already waits"));
        let n = s.arrive("0:j:x", 2, "n1/2");
        assert_eq!(released(&n), vec![("n0/1", true), ("n1/2", true)]);
        assert!(n.iter().all(|(k, _, _)| k == "0:j:x"));
        assert!(s.barriers.is_empty());
        assert!(s.arrive("0:j:y", 0, "n0/1")[0].2.is_err());
    }

    #[test]
    fn locks_are_exclusive_fifo_and_released_by_a_dying_holder() {
        let mut s = SyncState::default();
        assert_eq!(released(&s.acquire("0:j:7", "n0/1")), vec![("n0/1", true)]);
        assert!(s.acquire("0:j:7", "n1/2").is_empty());
        assert!(s.acquire("0:j:7", "n2/3").is_empty());
        assert!(s.acquire("0:j:7", "n0/1")[0].2.is_err(), "relocking");
        let n = s.release("0:j:7", "n1/2");
        assert_eq!(released(&n), vec![("n1/2", false)], "a waiter cannot release");
        assert_eq!(released(&s.gone("n0/1")), vec![("n1/2", true)]);
        let n = s.release("0:j:7", "n1/2");
        assert_eq!(released(&n), vec![("n1/2", true), ("n2/3", true)]);
        assert_eq!(released(&s.release("0:j:7", "n2/3")), vec![("n2/3", true)]);
        assert!(s.locks.is_empty());
        let n = s.release("0:j:7", "n2/3");
        assert_eq!(released(&n), vec![("n2/3", false)], "unlocking a lock not held");
        assert!(n[0]
            .2
            .as_ref()
            .unwrap_err()
            .message
            .contains("is not held by this rank"));
    }

    #[test]
    fn a_rank_dying_at_a_barrier_fails_the_others() {
        let mut s = SyncState::default();
        s.arrive("0:j:x", 3, "n0/1");
        s.arrive("0:j:x", 3, "n1/2");
        let n = s.gone("n1/2");
        assert_eq!(released(&n), vec![("n0/1", false)]);
        assert!(n[0].2.as_ref().unwrap_err().message.contains("exited while waiting"));
        assert!(s.barriers.is_empty());
    }

    #[test]
    fn ranks_are_found_by_node() {
        assert_eq!(node_of("n3/123"), "n3");
    }
}
