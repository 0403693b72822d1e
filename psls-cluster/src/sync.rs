//! Named barriers and locks for client ranks (DESIGN §5: synchronization comes from the
//! daemons, not from spinning on shared pages).
//!
//! [`SyncState`] lives at the coordinator: each call returns *notices* — which waiting rank to
//! release, with what result. [`Waits`] lives on every node: the ranks of that node waiting for
//! a notice, each with the coordinator its call went to and a reply handle `R` of the shell's
//! choosing. Both are pure; the shell posts arrivals to the coordinator and notices back.
//!
//! Invariants: a lock has at most one holder, and only the holder may release it; a barrier
//! opens exactly once, when `count` distinct ranks have arrived, releasing every one of them;
//! a rank that dies releases its locks and fails the barrier it waited at, so no other rank
//! waits forever on it; a wait whose coordinator changes fails at the next sweep (the new
//! coordinator never saw it); every registered wait is answered exactly once. Ranks are named
//! `node/pid`.

use std::collections::{HashMap, VecDeque};

/// Most ranks at one barrier, and waiters on one lock.
pub const MAX_PARTIES: u32 = 1 << 16;
/// Most waits registered on one node at a time.
pub const MAX_LOCAL_WAITS: usize = 1 << 16;

/// Why a barrier or lock call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    /// The call itself is wrong (count mismatch, relocking, unlocking a lock not held, ...).
    #[error("{0}")]
    Invalid(String),
    /// The call cannot complete now (a rank died, the coordinator changed, limits reached).
    #[error("{0}")]
    Unavailable(String),
}

/// A rank to release: the key it waits on, the rank (`node/pid`), and the result.
pub type Notice = (String, String, Result<(), SyncError>);

#[derive(Debug)]
struct Barrier {
    count: u32,
    waiting: Vec<String>,
}

#[derive(Debug, Default)]
struct Lock {
    holder: Option<String>,
    queue: VecDeque<String>,
}

/// The coordinator's barriers and locks.
#[derive(Debug, Default)]
pub struct SyncState {
    barriers: HashMap<String, Barrier>,
    locks: HashMap<String, Lock>,
}

fn invalid(m: String) -> SyncError {
    SyncError::Invalid(m)
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
            Some(_) if l.queue.iter().any(|w| w == who) => {
                let m = format!("this rank already waits for lock {}", short(key));
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
        let mut held: Vec<String> = self
            .locks
            .iter()
            .filter(|(_, l)| l.holder.as_deref() == Some(who))
            .map(|(k, _)| k.clone())
            .collect();
        held.sort();
        for k in held {
            out.extend(self.pass_on(&k));
        }
        let mut failed: Vec<String> = self
            .barriers
            .iter()
            .filter(|(_, b)| b.waiting.iter().any(|w| w == who))
            .map(|(k, _)| k.clone())
            .collect();
        failed.sort();
        for k in failed {
            if let Some(b) = self.barriers.remove(&k) {
                for w in b.waiting.into_iter().filter(|w| w != who) {
                    let e = SyncError::Unavailable(format!(
                        "a rank ({who}) exited while waiting at barrier '{}'",
                        short(&k)
                    ));
                    out.push((k.clone(), w, Err(e)));
                }
            }
        }
        out
    }

    /// The holder of lock `key` (for invariant checks and status).
    pub fn holder(&self, key: &str) -> Option<&str> {
        self.locks.get(key).and_then(|l| l.holder.as_deref())
    }

    /// Ranks waiting at barrier `key`.
    pub fn waiting(&self, key: &str) -> &[String] {
        self.barriers.get(key).map_or(&[], |b| b.waiting.as_slice())
    }
}

/// The user-visible part of a key (`uid:job:name`).
pub fn short(key: &str) -> &str {
    key.splitn(3, ':').nth(2).unwrap_or(key)
}

/// The scope of a client's names.
pub fn key(uid: u32, job: &str, name: &str) -> String {
    format!("{uid}:{job}:{name}")
}

/// The node of a rank named `node/pid`.
pub fn node_of(who: &str) -> &str {
    who.split_once('/').map_or(who, |(n, _)| n)
}

/// One registered wait: the coordinator the call went to, and how to answer it.
#[derive(Debug)]
pub struct Wait<R> {
    pub coord: String,
    pub reply: R,
}

/// Why a wait could not be registered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("too many waiting ranks on this node")]
    Full,
    #[error("this rank already waits here")]
    Duplicate,
}

/// This node's ranks waiting for a barrier, a lock or an unlock, by (key, who). `R` is how
/// the shell answers a rank. Every wait taken out is answered by the caller exactly once.
#[derive(Debug)]
pub struct Waits<R> {
    waits: HashMap<(String, String), Wait<R>>,
}

impl<R> Default for Waits<R> {
    fn default() -> Self {
        Waits { waits: HashMap::new() }
    }
}

impl<R> Waits<R> {
    /// Registers rank `who`'s call on `key`, sent to `coord`. On error the reply handle comes
    /// back, to be answered with the error.
    pub fn register(&mut self, key: &str, who: &str, coord: &str, reply: R) -> Result<(), (RegisterError, R)> {
        if self.waits.len() >= MAX_LOCAL_WAITS {
            return Err((RegisterError::Full, reply));
        }
        let k = (key.to_string(), who.to_string());
        if self.waits.contains_key(&k) {
            return Err((RegisterError::Duplicate, reply));
        }
        self.waits.insert(
            k,
            Wait {
                coord: coord.to_string(),
                reply,
            },
        );
        Ok(())
    }

    /// Takes the wait of `who` on `key` (a notice came, or its call could not be sent).
    pub fn take(&mut self, key: &str, who: &str) -> Option<Wait<R>> {
        self.waits.remove(&(key.to_string(), who.to_string()))
    }

    /// Takes every wait of rank `who` (gone): the caller answers each with an error.
    pub fn take_rank(&mut self, who: &str) -> Vec<(String, Wait<R>)> {
        let mut keys: Vec<(String, String)> = self.waits.keys().filter(|(_, w)| w == who).cloned().collect();
        keys.sort();
        keys.into_iter()
            .filter_map(|k| self.waits.remove_entry(&k).map(|((key, _), w)| (key, w)))
            .collect()
    }

    /// Takes every wait whose coordinator is not `coord` (it changed: the new one never saw
    /// the call); the caller answers each with an error.
    pub fn sweep(&mut self, coord: Option<&str>) -> Vec<((String, String), Wait<R>)> {
        let mut keys: Vec<(String, String)> = self
            .waits
            .iter()
            .filter(|(_, w)| coord != Some(w.coord.as_str()))
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort();
        keys.into_iter().filter_map(|k| self.waits.remove_entry(&k)).collect()
    }

    pub fn len(&self) -> usize {
        self.waits.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waits.is_empty()
    }
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
        assert!(n[0].2.as_ref().unwrap_err().to_string().contains("awaited by 2 ranks"));
        let n = s.arrive("0:j:x", 2, "n0/1");
        assert!(n[0].2.as_ref().unwrap_err().to_string().contains("already waits"));
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
        assert!(s.acquire("0:j:7", "n1/2")[0].2.is_err(), "queueing twice");
        let n = s.release("0:j:7", "n1/2");
        assert_eq!(released(&n), vec![("n1/2", false)], "a waiter cannot release");
        assert_eq!(released(&s.gone("n0/1")), vec![("n1/2", true)]);
        assert_eq!(s.holder("0:j:7"), Some("n1/2"));
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
            .to_string()
            .contains("is not held by this rank"));
    }

    #[test]
    fn a_rank_dying_at_a_barrier_fails_the_others() {
        let mut s = SyncState::default();
        s.arrive("0:j:x", 3, "n0/1");
        s.arrive("0:j:x", 3, "n1/2");
        let n = s.gone("n1/2");
        assert_eq!(released(&n), vec![("n0/1", false)]);
        assert!(n[0]
            .2
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("exited while waiting"));
        assert!(s.barriers.is_empty());
    }

    #[test]
    fn waits_are_taken_once_and_swept_when_the_coordinator_changes() {
        let mut w: Waits<u32> = Waits::default();
        w.register("k", "n0/1", "n0", 1).unwrap();
        assert_eq!(
            w.register("k", "n0/1", "n0", 2).unwrap_err(),
            (RegisterError::Duplicate, 2)
        );
        w.register("k", "n0/2", "n1", 3).unwrap();
        w.register("l", "n0/2", "n0", 4).unwrap();
        let swept = w.sweep(Some("n0"));
        assert_eq!(swept.len(), 1);
        assert_eq!(swept[0].1.reply, 3);
        assert_eq!(w.take_rank("n0/2").len(), 1);
        assert_eq!(w.take("k", "n0/1").map(|w| w.reply), Some(1));
        assert!(w.take("k", "n0/1").is_none(), "a wait is taken once");
        assert!(w.is_empty());
    }

    #[test]
    fn ranks_are_found_by_node() {
        assert_eq!(node_of("n3/123"), "n3");
        assert_eq!(short("0:j:x:y"), "x:y");
    }
}
