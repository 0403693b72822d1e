//! Named barriers and locks for client ranks (DESIGN §5: synchronization comes from the
//! daemons, not from spinning on shared pages).
//!
//! Both live at the coordinator (the lowest live logical node), in [`SyncState`]: a pure state
//! machine whose calls return *notices* — which waiting rank to release, with what result. A
//! rank's daemon registers the wait locally, posts the arrival or acquire to the coordinator
//! (one-way, on the per-peer message stream), and the coordinator posts each notice back to
//! the waiter's node (`SyncDone`): a barrier costs one message each way per remote rank, no
//! stream per call. Names are scoped by user and job, so jobs and users cannot meet at each
//! other's barriers.
//!
//! Invariants: a lock has at most one holder, and only the holder may release it; a barrier
//! opens exactly when `count` distinct ranks have arrived; a rank that dies releases its locks
//! and fails the barrier it waited at, so no other rank waits forever on it; a wait whose
//! coordinator changes fails at once (the new coordinator knows nothing of it).

use crate::node::{Node, OpError};
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::ErrorKind;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
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

    /// `who` releases lock `key`; the notices grant it to the next waiter.
    pub fn release(&mut self, key: &str, who: &str) -> Result<Vec<Notice>, OpError> {
        let held = self.locks.get(key).and_then(|l| l.holder.as_deref()) == Some(who);
        if !held {
            return Err(invalid(format!("lock {} is not held by this rank", short(key))));
        }
        Ok(self.pass_on(key))
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

type Reply = oneshot::Sender<Result<(), OpError>>;

/// This node's ranks waiting for a barrier or a lock, by (key, who).
#[derive(Default)]
pub struct Waits(Mutex<HashMap<(String, String), Reply>>);

impl Waits {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Reply>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A rank's barrier or lock call: waits for its notice. Releases (and `SyncGone`) are
/// request/response; arrivals and acquires are posted and answered by a `SyncDone`.
pub async fn call(node: &Arc<Node>, req: PeerReq) -> Result<(), OpError> {
    let Some((_, coord)) = node.coordinator_now() else {
        return Err(OpError::new(ErrorKind::Unavailable, "no coordinator is up"));
    };
    let wait_key = match &req {
        PeerReq::BarrierArrive { key, who, .. } | PeerReq::LockAcquire { key, who } => (key.clone(), who.clone()),
        // Posted like arrivals, so it cannot overtake the rank's last arrival on the way.
        PeerReq::SyncGone { .. } => {
            if coord == node.name() {
                return serve(node, req).map(|_| ());
            }
            return node.net.post(&coord, &req, bytes::Bytes::new()).map_err(Into::into);
        }
        _ => {
            return match node
                .call_data(&coord, req, bytes::Bytes::new(), node.request_timeout)
                .await?
            {
                (PeerResp::Ok, _) => Ok(()),
                (PeerResp::Error { kind, message }, _) => Err(OpError::new(kind, message)),
                (other, _) => Err(OpError::new(
                    ErrorKind::Internal,
                    format!("unexpected answer {other:?}"),
                )),
            };
        }
    };
    let (tx, mut rx) = oneshot::channel();
    {
        let mut w = node.waits.lock();
        if w.len() >= MAX_LOCAL_WAITS {
            return Err(OpError::new(
                ErrorKind::Unavailable,
                "too many waiting ranks on this node",
            ));
        }
        if w.insert(wait_key.clone(), tx).is_some() {
            return Err(invalid("this rank already waits here".into()));
        }
    }
    if coord == node.name() {
        if let Err(e) = serve(node, req) {
            node.waits.lock().remove(&wait_key);
            return Err(e);
        }
    } else if let Err(e) = node.net.post(&coord, &req, bytes::Bytes::new()) {
        node.waits.lock().remove(&wait_key);
        return Err(e.into());
    }
    // Wait for the notice; a change of coordinator ends the wait (the new one never saw it).
    let check = Duration::from_millis(node.cfg.cluster.heartbeat_interval_ms.max(10));
    loop {
        tokio::select! {
            r = &mut rx => {
                return r.unwrap_or_else(|_| Err(OpError::new(ErrorKind::Unavailable, "the wait was cancelled")));
            }
            _ = tokio::time::sleep(check) => {
                let now = node.coordinator_now().map(|(_, c)| c);
                if now.as_deref() != Some(coord.as_str()) {
                    node.waits.lock().remove(&wait_key);
                    return Err(OpError::new(
                        ErrorKind::Unavailable,
                        format!("the coordinator ({coord}) went down while this rank waited"),
                    ));
                }
            }
        }
    }
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

/// Releases this node's rank `who` waiting on `key`.
pub fn resolve(node: &Node, key: &str, who: &str, result: Result<(), OpError>) {
    match node.waits.lock().remove(&(key.to_string(), who.to_string())) {
        Some(tx) => {
            let _ = tx.send(result);
        }
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
            PeerReq::LockRelease { key, who } => st.release(&key, &who)?,
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
        assert!(s.release("0:j:7", "n1/2").is_err(), "a waiter cannot release");
        assert_eq!(released(&s.gone("n0/1")), vec![("n1/2", true)]);
        assert_eq!(released(&s.release("0:j:7", "n1/2").unwrap()), vec![("n2/3", true)]);
        assert!(s.release("0:j:7", "n2/3").unwrap().is_empty());
        assert!(s.locks.is_empty());
        assert!(s.release("0:j:7", "n2/3").is_err(), "unlocking a lock not held");
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
