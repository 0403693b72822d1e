//! Named barriers and locks for client ranks (DESIGN §5: synchronization comes from the
//! daemons, not from spinning on shared pages).
//!
//! [`SyncState`] lives at the coordinator: each call returns *notices* — which waiting rank to
//! release, with what result. [`Waits`] lives on every node: the ranks of that node waiting for
//! a notice, each with the coordinator its call went to and a reply handle `R` of the shell's
//! choosing, and the locks its ranks hold. Both are pure; the shell posts calls to the
//! coordinator and notices back, in order per pair of nodes (the message link is FIFO).
//!
//! The coordinator's state is soft: a node that becomes coordinator starts from
//! [`SyncState::take_over`], which knows no barrier and no lock and grants nothing until every
//! live node has *reported* the locks its ranks hold (or has been declared down). A node sends
//! its report to a coordinator before its first call there ([`Waits::switch_to`], also run by
//! [`Waits::sweep`]), after giving up every call still waiting on the old coordinator (its late
//! grant must not make a second holder), and a recovering coordinator asks the nodes it awaits again
//! (a report may be lost with a connection) — safe, since nothing is granted or released while
//! it recovers, and reports it does not await are ignored. So a new coordinator never grants a
//! lock that a rank of a live node still holds.
//!
//! Invariants: a lock has at most one holder, and only the holder may release it; a barrier
//! opens exactly once, when `count` distinct ranks have arrived, releasing every one of them;
//! a rank that dies (or whose node is declared down) releases its locks and fails the barrier
//! it waited at, so no other rank waits forever on it; a wait whose coordinator changes fails
//! at the next sweep (the new coordinator never saw it); every registered wait is answered
//! exactly once. Ranks are named `node/pid`.

use std::collections::{BTreeSet, HashMap, VecDeque};

/// Most ranks at one barrier, and waiters on one lock.
pub const MAX_PARTIES: u32 = 1 << 16;
/// Most waits registered on one node at a time.
pub const MAX_LOCAL_WAITS: usize = 1 << 16;
/// Most calls a recovering coordinator keeps until the reports are in.
pub const MAX_DEFERRED: usize = 1 << 16;

/// A rank's call at the coordinator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    Arrive {
        key: String,
        count: u32,
        who: String,
        call: u64,
    },
    Acquire {
        key: String,
        who: String,
        call: u64,
    },
    Release {
        key: String,
        who: String,
        call: u64,
    },
    /// Rank `who` exited.
    Gone {
        who: String,
    },
}

/// What a waiting call was (to keep a node's ledger of held locks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    Barrier,
    Acquire,
    Release,
}

/// The locks a node's ranks hold: (key, rank).
pub type Report = Vec<(String, String)>;

/// Why a barrier or lock call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    /// The call itself is wrong (count mismatch, relocking, unlocking a lock not held, ...).
    #[error("{0}")]
    Invalid(String),
    /// The call cannot complete now (a rank died, limits reached).
    #[error("{0}")]
    Unavailable(String),
    /// The node the call went to no longer coordinates (or takes the caller's node as down):
    /// the cluster failed the call, not the program.
    #[error("{0}")]
    Moved(String),
}

/// A rank to release: the key it waits on, the rank (`node/pid`), the id of the call it waits
/// in (a notice for an earlier call on the same key, whose wait was given up, must not answer
/// a later one), and the result.
pub type Notice = (String, String, u64, Result<(), SyncError>);

#[derive(Debug)]
struct Barrier {
    count: u32,
    /// (rank, call id).
    waiting: Vec<(String, u64)>,
}

#[derive(Debug, Default)]
struct Lock {
    holder: Option<String>,
    /// (rank, call id) waiting for the lock.
    queue: VecDeque<(String, u64)>,
}

/// The coordinator's barriers and locks.
#[derive(Debug, Default)]
pub struct SyncState {
    barriers: HashMap<String, Barrier>,
    locks: HashMap<String, Lock>,
    /// Nodes whose report this coordinator still waits for; calls wait meanwhile.
    awaiting: BTreeSet<String>,
    deferred: VecDeque<Call>,
}

fn invalid(m: String) -> SyncError {
    SyncError::Invalid(m)
}

impl SyncState {
    /// The state of a node that has just become coordinator: nothing is known, and calls wait
    /// until each of `nodes` (the live nodes, this one included) has reported its ranks' locks
    /// or been declared down.
    pub fn take_over(nodes: impl IntoIterator<Item = String>) -> SyncState {
        SyncState {
            awaiting: nodes.into_iter().collect(),
            ..SyncState::default()
        }
    }

    /// Whether calls still wait for reports.
    pub fn recovering(&self) -> bool {
        !self.awaiting.is_empty()
    }

    /// A call of a rank (deferred while reports are missing).
    pub fn call(&mut self, c: Call) -> Vec<Notice> {
        if self.recovering() {
            if self.deferred.len() >= MAX_DEFERRED {
                let (key, who, call) = match &c {
                    Call::Arrive { key, who, call, .. }
                    | Call::Acquire { key, who, call }
                    | Call::Release { key, who, call } => (key.clone(), who.clone(), *call),
                    Call::Gone { .. } => return Vec::new(),
                };
                let e = SyncError::Unavailable("the new coordinator has too many calls waiting".into());
                return vec![(key, who, call, Err(e))];
            }
            self.deferred.push_back(c);
            return Vec::new();
        }
        self.dispatch(c)
    }

    fn dispatch(&mut self, c: Call) -> Vec<Notice> {
        match c {
            Call::Arrive { key, count, who, call } => self.arrive(&key, count, &who, call),
            Call::Acquire { key, who, call } => self.acquire(&key, &who, call),
            Call::Release { key, who, call } => self.release(&key, &who, call),
            Call::Gone { who } => self.gone(&who),
        }
    }

    /// Node `node` reports the locks its ranks hold (ignored unless awaited). Once every
    /// awaited node has reported, the deferred calls run.
    pub fn report(&mut self, node: &str, held: &[(String, String)]) -> Vec<Notice> {
        // Only awaited reports count: one asked for again, or sent twice, after recovery
        // could name a lock released since.
        if !self.awaiting.contains(node) {
            return Vec::new();
        }
        for (key, who) in held {
            if node_of(who) != node {
                continue;
            }
            let l = self.locks.entry(key.clone()).or_default();
            match &l.holder {
                None => l.holder = Some(who.clone()),
                Some(h) if h == who => {}
                // Two holders cannot both be right; the first report stands (the second
                // would be a protocol violation).
                Some(_) => {}
            }
        }
        self.awaiting.remove(node);
        self.drain_deferred()
    }

    /// Node `node` is down: it reports nothing, and its ranks are gone.
    pub fn node_down(&mut self, node: &str) -> Vec<Notice> {
        self.awaiting.remove(node);
        let mut ranks: BTreeSet<String> = BTreeSet::new();
        for l in self.locks.values() {
            ranks.extend(l.holder.iter().filter(|w| node_of(w) == node).cloned());
            ranks.extend(l.queue.iter().map(|(w, _)| w).filter(|w| node_of(w) == node).cloned());
        }
        for b in self.barriers.values() {
            ranks.extend(b.waiting.iter().map(|(w, _)| w).filter(|w| node_of(w) == node).cloned());
        }
        self.deferred.retain(|c| match c {
            Call::Arrive { who, .. } | Call::Acquire { who, .. } | Call::Release { who, .. } | Call::Gone { who } => {
                node_of(who) != node
            }
        });
        let mut out = Vec::new();
        for who in ranks {
            out.extend(self.gone(&who));
        }
        out.extend(self.drain_deferred());
        out
    }

    /// The nodes whose reports are still awaited.
    pub fn awaiting(&self) -> impl Iterator<Item = &str> {
        self.awaiting.iter().map(|s| s.as_str())
    }

    fn drain_deferred(&mut self) -> Vec<Notice> {
        let mut out = Vec::new();
        if self.recovering() {
            return out;
        }
        while let Some(c) = self.deferred.pop_front() {
            out.extend(self.dispatch(c));
        }
        out
    }

    /// `who` arrives at barrier `key` of `count` ranks (in its call `call`).
    pub fn arrive(&mut self, key: &str, count: u32, who: &str, call: u64) -> Vec<Notice> {
        if count == 0 || count > MAX_PARTIES {
            let m = format!("barrier count {count} (1 to {MAX_PARTIES})");
            return vec![(key.into(), who.into(), call, Err(invalid(m)))];
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
            return vec![(key.into(), who.into(), call, Err(invalid(m)))];
        }
        if b.waiting.iter().any(|(w, _)| w == who) {
            let m = format!("this rank already waits at barrier '{}'", short(key));
            return vec![(key.into(), who.into(), call, Err(invalid(m)))];
        }
        b.waiting.push((who.to_string(), call));
        if b.waiting.len() as u32 == b.count {
            if let Some(b) = self.barriers.remove(key) {
                return b
                    .waiting
                    .into_iter()
                    .map(|(w, c)| (key.to_string(), w, c, Ok(())))
                    .collect();
            }
        }
        Vec::new()
    }

    /// `who` asks for lock `key` (in its call `call`).
    pub fn acquire(&mut self, key: &str, who: &str, call: u64) -> Vec<Notice> {
        let l = self.locks.entry(key.to_string()).or_default();
        match &l.holder {
            None => {
                l.holder = Some(who.to_string());
                vec![(key.into(), who.into(), call, Ok(()))]
            }
            Some(h) if h == who => {
                let m = format!("lock {} is already held by this rank", short(key));
                vec![(key.into(), who.into(), call, Err(invalid(m)))]
            }
            Some(_) if l.queue.iter().any(|(w, _)| w == who) => {
                let m = format!("this rank already waits for lock {}", short(key));
                vec![(key.into(), who.into(), call, Err(invalid(m)))]
            }
            Some(_) if l.queue.len() as u32 >= MAX_PARTIES => {
                let m = format!("too many ranks wait for lock {}", short(key));
                vec![(key.into(), who.into(), call, Err(invalid(m)))]
            }
            Some(_) => {
                l.queue.push_back((who.to_string(), call));
                Vec::new()
            }
        }
    }

    /// `who` releases lock `key` (in its call `call`): the notices answer it (an error if it
    /// does not hold the lock) and grant the lock to the next waiter.
    pub fn release(&mut self, key: &str, who: &str, call: u64) -> Vec<Notice> {
        let held = self.locks.get(key).and_then(|l| l.holder.as_deref()) == Some(who);
        if !held {
            let m = format!("lock {} is not held by this rank", short(key));
            return vec![(key.into(), who.into(), call, Err(invalid(m)))];
        }
        let mut out = vec![(key.to_string(), who.to_string(), call, Ok(()))];
        out.extend(self.pass_on(key));
        out
    }

    /// Gives lock `key` to the next waiter, or frees it.
    fn pass_on(&mut self, key: &str) -> Vec<Notice> {
        let Some(l) = self.locks.get_mut(key) else {
            return Vec::new();
        };
        match l.queue.pop_front() {
            Some((next, call)) => {
                l.holder = Some(next.clone());
                vec![(key.to_string(), next, call, Ok(()))]
            }
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
            l.queue.retain(|(w, _)| w != who);
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
            .filter(|(_, b)| b.waiting.iter().any(|(w, _)| w == who))
            .map(|(k, _)| k.clone())
            .collect();
        failed.sort();
        for k in failed {
            if let Some(b) = self.barriers.remove(&k) {
                for (w, c) in b.waiting.into_iter().filter(|(w, _)| w != who) {
                    let e = SyncError::Unavailable(format!(
                        "a rank ({who}) exited while waiting at barrier '{}'",
                        short(&k)
                    ));
                    out.push((k.clone(), w, c, Err(e)));
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
    pub fn waiting(&self, key: &str) -> Vec<&str> {
        self.barriers
            .get(key)
            .map_or(Vec::new(), |b| b.waiting.iter().map(|(w, _)| w.as_str()).collect())
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

/// One registered wait: the coordinator the call went to, what it was, and how to answer it.
#[derive(Debug)]
pub struct Wait<R> {
    pub coord: String,
    pub kind: CallKind,
    /// The call's id: notices name it.
    pub call: u64,
    pub reply: R,
}

/// Why a wait could not be registered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("too many waiting ranks on this node")]
    Full,
    #[error("this rank already waits here")]
    Duplicate,
    #[error("no coordinator is up")]
    NoCoordinator,
}

/// This node's ranks waiting for a barrier, a lock or an unlock, by (key, who), and the locks
/// they hold (the node's report to a new coordinator). `R` is how the shell answers a rank.
/// Every wait taken out is answered by the caller exactly once.
#[derive(Debug)]
pub struct Waits<R> {
    waits: HashMap<(String, String), Wait<R>>,
    /// (key, rank) of every lock a rank of this node holds.
    held: BTreeSet<(String, String)>,
    /// The coordinator that has this node's report.
    reported_to: Option<String>,
    /// The id of the last call registered.
    last_call: u64,
}

impl<R> Default for Waits<R> {
    fn default() -> Self {
        Waits {
            waits: HashMap::new(),
            held: BTreeSet::new(),
            reported_to: None,
            last_call: 0,
        }
    }
}

impl<R> Waits<R> {
    /// Makes `coord` the coordinator this node talks to. If it was another, every wait sent
    /// to another coordinator is taken out (the caller answers each with an error: a late
    /// notice from the old coordinator then answers nothing) and the report `coord` must get
    /// before anything else from this node is returned with them.
    #[allow(clippy::type_complexity)]
    pub fn switch_to(&mut self, coord: &str) -> Option<(Vec<((String, String), Wait<R>)>, Report)> {
        if self.reported_to.as_deref() == Some(coord) {
            return None;
        }
        let stale = self.take_where(|w| w.coord != coord);
        self.reported_to = Some(coord.to_string());
        Some((stale, self.held.iter().cloned().collect()))
    }

    fn take_where(&mut self, f: impl Fn(&Wait<R>) -> bool) -> Vec<((String, String), Wait<R>)> {
        let mut keys: Vec<(String, String)> = self
            .waits
            .iter()
            .filter(|(_, w)| f(w))
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort();
        keys.into_iter().filter_map(|k| self.waits.remove_entry(&k)).collect()
    }

    /// Registers rank `who`'s call on `key` to the coordinator this node switched to last
    /// ([`Waits::switch_to`] first). Returns the call's id (the call carries it, its notice
    /// names it). On error the reply handle comes back, to be answered with the error.
    pub fn register(&mut self, key: &str, who: &str, kind: CallKind, reply: R) -> Result<u64, (RegisterError, R)> {
        let Some(coord) = self.reported_to.clone() else {
            return Err((RegisterError::NoCoordinator, reply));
        };
        if self.waits.len() >= MAX_LOCAL_WAITS {
            return Err((RegisterError::Full, reply));
        }
        let k = (key.to_string(), who.to_string());
        if self.waits.contains_key(&k) {
            return Err((RegisterError::Duplicate, reply));
        }
        self.last_call += 1;
        let call = self.last_call;
        self.waits.insert(
            k,
            Wait {
                coord,
                kind,
                call,
                reply,
            },
        );
        Ok(call)
    }

    /// Takes the wait of `who` on `key` in call `call` because its answer came (`ok`: it
    /// succeeded), keeping the ledger of held locks; `None` if no such wait (a notice for a
    /// call whose wait was given up answers nothing).
    pub fn answered(&mut self, key: &str, who: &str, call: u64, ok: bool) -> Option<Wait<R>> {
        let k = (key.to_string(), who.to_string());
        if self.waits.get(&k).is_none_or(|w| w.call != call) {
            return None;
        }
        let w = self.waits.remove(&k)?;
        if ok {
            match w.kind {
                CallKind::Acquire => {
                    self.held.insert((key.to_string(), who.to_string()));
                }
                CallKind::Release => {
                    self.held.remove(&(key.to_string(), who.to_string()));
                }
                CallKind::Barrier => {}
            }
        }
        Some(w)
    }

    /// Takes the wait of `who` on `key` whose call could not be sent.
    pub fn take(&mut self, key: &str, who: &str) -> Option<Wait<R>> {
        self.waits.remove(&(key.to_string(), who.to_string()))
    }

    /// Rank `who` is gone: takes every wait of it (the caller answers each with an error) and
    /// forgets its locks (the coordinator passes them on).
    pub fn take_rank(&mut self, who: &str) -> Vec<(String, Wait<R>)> {
        self.held.retain(|(_, w)| w != who);
        let mut keys: Vec<(String, String)> = self.waits.keys().filter(|(_, w)| w == who).cloned().collect();
        keys.sort();
        keys.into_iter()
            .filter_map(|k| self.waits.remove_entry(&k).map(|((key, _), w)| (key, w)))
            .collect()
    }

    /// Every heartbeat interval: the coordinator is `coord` now (`None`: none is up). Takes
    /// every wait whose coordinator was another (the new one never saw the call; the caller
    /// answers each with an error), and returns the report `coord` must get if it has not had
    /// it.
    #[allow(clippy::type_complexity)]
    pub fn sweep(&mut self, coord: Option<&str>) -> (Vec<((String, String), Wait<R>)>, Option<Report>) {
        match coord {
            None => (self.take_where(|_| true), None),
            Some(c) => match self.switch_to(c) {
                Some((stale, report)) => (stale, Some(report)),
                None => (Vec::new(), None),
            },
        }
    }

    /// The last report could not be sent: the next call or sweep sends it again.
    pub fn report_lost(&mut self) {
        self.reported_to = None;
    }

    /// Coordinator `coord` (this node's) asks for this node's report again (it is recovering:
    /// nothing is granted or released meanwhile, so the ledger is current). Waits sent to
    /// another coordinator are taken out first, as by [`Waits::switch_to`].
    #[allow(clippy::type_complexity)]
    pub fn report_to(&mut self, coord: &str) -> (Vec<((String, String), Wait<R>)>, Report) {
        match self.switch_to(coord) {
            Some(x) => x,
            None => (Vec::new(), self.held.iter().cloned().collect()),
        }
    }

    /// Locks this node's ranks hold.
    pub fn held(&self) -> impl Iterator<Item = &(String, String)> {
        self.held.iter()
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
        n.iter().map(|(_, w, _, r)| (w.as_str(), r.is_ok())).collect()
    }

    #[test]
    fn barrier_opens_at_count_and_rejects_mismatches() {
        let mut s = SyncState::default();
        assert!(s.arrive("0:j:x", 2, "n0/1", 0).is_empty(), "opened too early");
        let n = s.arrive("0:j:x", 3, "n1/2", 0);
        assert!(n[0].3.as_ref().unwrap_err().to_string().contains("awaited by 2 ranks"));
        let n = s.arrive("0:j:x", 2, "n0/1", 0);
        assert!(n[0].3.as_ref().unwrap_err().to_string().contains("already waits"));
        let n = s.arrive("0:j:x", 2, "n1/2", 0);
        assert_eq!(released(&n), vec![("n0/1", true), ("n1/2", true)]);
        assert!(n.iter().all(|(k, _, _, _)| k == "0:j:x"));
        assert!(s.barriers.is_empty());
        assert!(s.arrive("0:j:y", 0, "n0/1", 0)[0].3.is_err());
    }

    #[test]
    fn locks_are_exclusive_fifo_and_released_by_a_dying_holder() {
        let mut s = SyncState::default();
        assert_eq!(released(&s.acquire("0:j:7", "n0/1", 0)), vec![("n0/1", true)]);
        assert!(s.acquire("0:j:7", "n1/2", 0).is_empty());
        assert!(s.acquire("0:j:7", "n2/3", 0).is_empty());
        assert!(s.acquire("0:j:7", "n0/1", 0)[0].3.is_err(), "relocking");
        assert!(s.acquire("0:j:7", "n1/2", 0)[0].3.is_err(), "queueing twice");
        let n = s.release("0:j:7", "n1/2", 0);
        assert_eq!(released(&n), vec![("n1/2", false)], "a waiter cannot release");
        assert_eq!(released(&s.gone("n0/1")), vec![("n1/2", true)]);
        assert_eq!(s.holder("0:j:7"), Some("n1/2"));
        let n = s.release("0:j:7", "n1/2", 0);
        assert_eq!(released(&n), vec![("n1/2", true), ("n2/3", true)]);
        assert_eq!(released(&s.release("0:j:7", "n2/3", 0)), vec![("n2/3", true)]);
        assert!(s.locks.is_empty());
        let n = s.release("0:j:7", "n2/3", 0);
        assert_eq!(released(&n), vec![("n2/3", false)], "unlocking a lock not held");
        assert!(n[0]
            .3
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("is not held by this rank"));
    }

    #[test]
    fn a_rank_dying_at_a_barrier_fails_the_others() {
        let mut s = SyncState::default();
        s.arrive("0:j:x", 3, "n0/1", 0);
        s.arrive("0:j:x", 3, "n1/2", 0);
        let n = s.gone("n1/2");
        assert_eq!(released(&n), vec![("n0/1", false)]);
        assert!(n[0]
            .3
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("exited while waiting"));
        assert!(s.barriers.is_empty());
    }

    #[test]
    fn waits_are_taken_once_and_given_up_when_the_coordinator_changes() {
        let mut w: Waits<u32> = Waits::default();
        assert_eq!(
            w.register("k", "n0/1", CallKind::Acquire, 0).unwrap_err().0,
            RegisterError::NoCoordinator
        );
        let (stale, report) = w.switch_to("n0").unwrap();
        assert!(
            stale.is_empty() && report.is_empty(),
            "the first switch carries an empty report"
        );
        assert!(w.switch_to("n0").is_none(), "reported once per coordinator");
        let c1 = w.register("k", "n0/1", CallKind::Acquire, 1).unwrap();
        assert_eq!(
            w.register("k", "n0/1", CallKind::Acquire, 2).unwrap_err(),
            (RegisterError::Duplicate, 2)
        );
        let c3 = w.register("l", "n0/2", CallKind::Barrier, 3).unwrap();
        assert!(
            w.answered("k", "n0/1", c1 + 100, true).is_none(),
            "another call's notice"
        );
        assert_eq!(w.answered("k", "n0/1", c1, true).map(|w| w.reply), Some(1));
        assert!(w.answered("k", "n0/1", c1, true).is_none(), "a wait is taken once");
        assert_eq!(w.held().count(), 1, "the granted lock is in the ledger");
        // A new coordinator: the barrier call to n0 is given up, the report names the lock.
        let (stale, report) = w.sweep(Some("n1"));
        assert_eq!(stale.len(), 1);
        assert_eq!(stale[0].1.reply, 3);
        assert_eq!(report, Some(vec![("k".to_string(), "n0/1".to_string())]));
        assert!(
            w.answered("l", "n0/2", c3, true).is_none(),
            "the old coordinator's late notice"
        );
        let c5 = w.register("k", "n0/1", CallKind::Release, 5).unwrap();
        w.answered("k", "n0/1", c5, true);
        assert_eq!(w.held().count(), 0, "the released lock left the ledger");
        let c6 = w.register("m", "n0/3", CallKind::Acquire, 6).unwrap();
        assert_eq!(w.take_rank("n0/3").len(), 1);
        assert!(w.answered("m", "n0/3", c6, true).is_none());
        let (stale, report) = w.sweep(None);
        assert!(stale.is_empty() && report.is_none());
        assert!(w.is_empty());
    }

    #[test]
    fn a_new_coordinator_grants_nothing_before_the_reports_and_keeps_reported_holders() {
        let mut s = SyncState::take_over(["n0".to_string(), "n1".to_string(), "n2".to_string()]);
        assert!(
            s.call(Call::Acquire {
                key: "L".into(),
                who: "n0/5".into(),
                call: 9,
            })
            .is_empty(),
            "granted before reports"
        );
        assert!(s.report("n0", &[]).is_empty());
        assert!(s.report("n5", &[("L".to_string(), "n5/1".to_string())]).is_empty());
        assert_eq!(s.holder("L"), None, "a report that is not awaited is ignored");
        let n = s.report(
            "n1",
            &[
                ("L".to_string(), "n1/7".to_string()),
                ("M".to_string(), "n2/1".to_string()),
            ],
        );
        assert!(n.is_empty());
        assert!(s.recovering());
        // n2 is declared down: its report will not come; n0/5 keeps waiting since n1/7 holds L.
        assert!(s.node_down("n2").is_empty(), "{:?}", s);
        assert!(!s.recovering());
        assert_eq!(s.holder("L"), Some("n1/7"));
        assert_eq!(s.holder("M"), None, "a report names only its own node's ranks");
        let n = s.call(Call::Release {
            key: "L".into(),
            who: "n1/7".into(),
            call: 3,
        });
        assert_eq!(released(&n), vec![("n1/7", true), ("n0/5", true)]);
        assert_eq!((n[0].2, n[1].2), (3, 9), "each notice names the call it answers");
        // A node going down releases its ranks' locks.
        let n = s.node_down("n0");
        assert!(n.is_empty());
        assert_eq!(s.holder("L"), None);
    }

    #[test]
    fn ranks_are_found_by_node() {
        assert_eq!(node_of("n3/123"), "n3");
        assert_eq!(short("0:j:x:y"), "x:y");
    }
}
