//! Named barriers and locks for client ranks (DESIGN §5: synchronization comes from the
//! daemons, not from spinning on shared pages).
//!
//! Both live at the coordinator (the lowest live logical node). A rank's daemon forwards its
//! call and the answer comes when the barrier opens or the lock is granted. Names are scoped
//! by user and job, so jobs and users cannot meet at each other's barriers.
//!
//! Invariants: a lock has at most one holder, and only the holder may release it; a barrier
//! opens exactly when `count` distinct ranks have arrived; a rank that dies releases its locks
//! and fails the barrier it waited at, so no other rank waits forever on it.

use crate::node::{Node, OpError};
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::ErrorKind;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// Most ranks at one barrier, and waiters on one lock.
pub const MAX_PARTIES: u32 = 1 << 16;
/// How long a rank may wait at a barrier or for a lock.
pub const MAX_WAIT: Duration = Duration::from_secs(7 * 24 * 3600);

type Reply = oneshot::Sender<Result<(), OpError>>;

struct Barrier {
    count: u32,
    waiting: Vec<(String, Reply)>,
}

#[derive(Default)]
struct Lock {
    holder: Option<String>,
    queue: VecDeque<(String, Reply)>,
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
    pub fn arrive(&mut self, key: &str, count: u32, who: &str, reply: Reply) {
        if count == 0 || count > MAX_PARTIES {
            let _ = reply.send(Err(invalid(format!("barrier count {count} (1 to {MAX_PARTIES})"))));
            return;
        }
        let b = self.barriers.entry(key.to_string()).or_insert(Barrier {
            count,
            waiting: Vec::new(),
        });
        if b.count != count {
            let _ = reply.send(Err(invalid(format!(
                "barrier '{}' is awaited by {} ranks, this rank says {count}",
                short(key),
                b.count
            ))));
            return;
        }
        if b.waiting.iter().any(|(w, _)| w == who) {
            let _ = reply.send(Err(invalid(format!(
                "this rank already waits at barrier '{}'",
                short(key)
            ))));
            return;
        }
        b.waiting.push((who.to_string(), reply));
        if b.waiting.len() as u32 == b.count {
            if let Some(b) = self.barriers.remove(key) {
                for (_, r) in b.waiting {
                    let _ = r.send(Ok(()));
                }
            }
        }
    }

    pub fn acquire(&mut self, key: &str, who: &str, reply: Reply) {
        let l = self.locks.entry(key.to_string()).or_default();
        match &l.holder {
            None => {
                l.holder = Some(who.to_string());
                let _ = reply.send(Ok(()));
            }
            Some(h) if h == who => {
                let _ = reply.send(Err(invalid(format!(
                    "lock {} is already held by this rank",
                    short(key)
                ))));
            }
            Some(_) if l.queue.len() as u32 >= MAX_PARTIES => {
                let _ = reply.send(Err(invalid(format!("too many ranks wait for lock {}", short(key)))));
            }
            Some(_) => l.queue.push_back((who.to_string(), reply)),
        }
    }

    pub fn release(&mut self, key: &str, who: &str) -> Result<(), OpError> {
        let held = self.locks.get(key).and_then(|l| l.holder.as_deref()) == Some(who);
        if !held {
            return Err(invalid(format!("lock {} is not held by this rank", short(key))));
        }
        self.pass_on(key);
        Ok(())
    }

    /// Gives lock `key` to the next live waiter, or frees it.
    fn pass_on(&mut self, key: &str) {
        let Some(l) = self.locks.get_mut(key) else { return };
        l.holder = None;
        while let Some((w, r)) = l.queue.pop_front() {
            if r.send(Ok(())).is_ok() {
                l.holder = Some(w);
                break;
            }
        }
        if l.holder.is_none() {
            self.locks.remove(key);
        }
    }

    /// Rank `who` died: its locks pass on, its queued requests go, and the barrier it waited
    /// at fails for the others.
    pub fn gone(&mut self, who: &str) {
        let held: Vec<String> = self
            .locks
            .iter()
            .filter(|(_, l)| l.holder.as_deref() == Some(who))
            .map(|(k, _)| k.clone())
            .collect();
        for k in held {
            self.pass_on(&k);
        }
        for l in self.locks.values_mut() {
            l.queue.retain(|(w, _)| w != who);
        }
        let failed: Vec<String> = self
            .barriers
            .iter()
            .filter(|(_, b)| b.waiting.iter().any(|(w, _)| w == who))
            .map(|(k, _)| k.clone())
            .collect();
        for k in failed {
            if let Some(b) = self.barriers.remove(&k) {
                for (w, r) in b.waiting {
                    if w != who {
                        let _ = r.send(Err(OpError::new(
                            ErrorKind::Unavailable,
                            format!("a rank ({who}) exited while waiting at barrier '{}'", short(&k)),
                        )));
                    }
                }
            }
        }
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

/// Sends a barrier or lock call to the coordinator and waits for its answer.
pub async fn call(node: &Arc<Node>, req: PeerReq) -> Result<(), OpError> {
    let st = node.meta_state();
    let Some((_, coord)) = node.coordinator(&st) else {
        return Err(OpError::new(ErrorKind::Unavailable, "no coordinator is up"));
    };
    match node.call_data(&coord, req, bytes::Bytes::new(), MAX_WAIT).await? {
        (PeerResp::Ok, _) => Ok(()),
        (PeerResp::Error { kind, message }, _) => Err(OpError::new(kind, message)),
        (other, _) => Err(OpError::new(
            ErrorKind::Internal,
            format!("unexpected answer {other:?}"),
        )),
    }
}

/// The coordinator's side of the peer messages.
pub async fn serve(sync: &Mutex<SyncState>, req: PeerReq) -> Result<PeerResp, OpError> {
    let lock = || sync.lock().unwrap_or_else(|e| e.into_inner());
    let (tx, rx) = oneshot::channel();
    match req {
        PeerReq::BarrierArrive { key, count, who } => lock().arrive(&key, count, &who, tx),
        PeerReq::LockAcquire { key, who } => lock().acquire(&key, &who, tx),
        PeerReq::LockRelease { key, who } => return lock().release(&key, &who).map(|()| PeerResp::Ok),
        PeerReq::SyncGone { who } => {
            lock().gone(&who);
            return Ok(PeerResp::Ok);
        }
        _ => return Err(OpError::new(ErrorKind::Internal, "not a sync request")),
    }
    match rx.await {
        Ok(r) => r.map(|()| PeerResp::Ok),
        Err(_) => Err(OpError::new(ErrorKind::Unavailable, "the wait was cancelled")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply() -> (Reply, oneshot::Receiver<Result<(), OpError>>) {
        oneshot::channel()
    }

    #[test]
    fn barrier_opens_at_count_and_rejects_mismatches() {
        let mut s = SyncState::default();
        let (a, mut ra) = reply();
        let (b, mut rb) = reply();
        let (c, mut rc) = reply();
        s.arrive("0:j:x", 2, "n0/1", a);
        assert!(ra.try_recv().is_err(), "opened too early");
        s.arrive("0:j:x", 3, "n1/2", c);
        assert!(rc
            .try_recv()
            .unwrap()
            .unwrap_err()
            .message
            .contains("awaited by 2 ranks"));
        s.arrive("0:j:x", 2, "n1/2", b);
        assert!(ra.try_recv().unwrap().is_ok() && rb.try_recv().unwrap().is_ok());
        assert!(s.barriers.is_empty());
    }

    #[test]
    fn locks_are_exclusive_fifo_and_released_by_a_dying_holder() {
        let mut s = SyncState::default();
        let (a, mut ra) = reply();
        let (b, mut rb) = reply();
        let (c, mut rc) = reply();
        s.acquire("0:j:7", "n0/1", a);
        s.acquire("0:j:7", "n1/2", b);
        s.acquire("0:j:7", "n2/3", c);
        assert!(ra.try_recv().unwrap().is_ok());
        assert!(rb.try_recv().is_err() && rc.try_recv().is_err());
        assert!(s.release("0:j:7", "n1/2").is_err(), "a waiter cannot release");
        s.gone("n0/1");
        assert!(rb.try_recv().unwrap().is_ok());
        s.release("0:j:7", "n1/2").unwrap();
        assert!(rc.try_recv().unwrap().is_ok());
        s.release("0:j:7", "n2/3").unwrap();
        assert!(s.locks.is_empty());
        assert!(s.release("0:j:7", "n2/3").is_err(), "unlocking a lock not held");
    }

    #[test]
    fn a_rank_dying_at_a_barrier_fails_the_others() {
        let mut s = SyncState::default();
        let (a, mut ra) = reply();
        let (b, _rb) = reply();
        s.arrive("0:j:x", 3, "n0/1", a);
        s.arrive("0:j:x", 3, "n1/2", b);
        s.gone("n1/2");
        assert!(ra
            .try_recv()
            .unwrap()
            .unwrap_err()
            .message
            .contains("exited while waiting"));
    }
}
