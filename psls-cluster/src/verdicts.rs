//! Verdicts and fencing, as a pure state machine: which peers the coordinator declares down,
//! which senders every node drops, and when a node must fence itself.
//!
//! The failure detector ([`crate::membership`]) gives impressions; this machine turns them
//! into decisions the metadata commits, and reads the committed decisions back:
//! - **Declaring** ([`Verdicts::poll_declarations`]): the coordinator, while it holds its
//!   lease, proposes `(peer, incarnation)` for every peer its detector has found silent past
//!   the failure timeout or whose disk failed, at the newest incarnation any node heard of it;
//!   one proposal per peer at a time, none for an incarnation already declared.
//! - **Fencing by the receivers** ([`Verdicts::accepts`]): a message from an incarnation at or
//!   below a committed verdict on its sender is dropped, whatever it is.
//! - **Fencing of oneself** ([`Verdicts::poll_fence`]): a node that learns of a verdict on its
//!   own incarnation — from its committed metadata or from any peer's heartbeat — must stop
//!   its ranks and rejoin as a new incarnation with an empty memory.
//! - **Who coordinates** ([`coordinator`]): the metadata log's leader, and only while it holds
//!   its lease.
//!
//! Invariant: a verdict is never withdrawn; the table of committed verdicts only grows, so a
//! sender dropped once is dropped for good.

use std::collections::{BTreeMap, BTreeSet};

/// The highest incarnation a daemon may have (shared memory keeps it in 32 bits): a claim of
/// a higher one is not taken.
pub const MAX_INCARNATION: u64 = u32::MAX as u64;

/// Why this incarnation must fence itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The incarnation the verdict declared down (at or above this one).
    pub declared: u64,
    /// The peer whose heartbeat told of it; `None` when this node's committed metadata holds it.
    pub told_by: Option<String>,
    /// Not a verdict: that peer (or the committed metadata's record of this node's starts,
    /// when `told_by` is `None`) knows an incarnation of this node later than this one (this
    /// one started from a folder that lost its counter).
    pub heard_later: bool,
}

/// A node's verdict book (names are physical node names).
#[derive(Debug)]
pub struct Verdicts {
    me: String,
    incarnation: u64,
    /// Committed verdicts: physical → highest incarnation declared down.
    committed: BTreeMap<String, u64>,
    /// The newest incarnation known of each node: heard from it (its heartbeats), reported
    /// heard by a peer, or committed as its start (`MetaOp::Boot`).
    reported: BTreeMap<String, u64>,
    /// Peers known as a newer incarnation than one known before, not yet polled.
    restarts: Vec<(String, u64)>,
    /// Peers whose declaration is being committed.
    declaring: BTreeSet<String>,
    fence: Option<Fence>,
    fence_polled: bool,
}

impl Verdicts {
    pub fn new(me: impl Into<String>, incarnation: u64) -> Self {
        Verdicts {
            me: me.into(),
            incarnation,
            committed: BTreeMap::new(),
            reported: BTreeMap::new(),
            restarts: Vec::new(),
            declaring: BTreeSet::new(),
            fence: None,
            fence_polled: false,
        }
    }

    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// The committed verdicts this node knows.
    pub fn committed(&self) -> &BTreeMap<String, u64> {
        &self.committed
    }

    /// The newest incarnation known of `peer` (0: none; this node's own for itself).
    pub fn known(&self, peer: &str) -> u64 {
        if peer == self.me {
            return self.incarnation;
        }
        self.reported.get(peer).copied().unwrap_or(0)
    }

    /// Whether `peer`'s newest known incarnation was declared down: it failed, and is not
    /// known to have started again. A peer of no known incarnation is down if any verdict
    /// names it (every start commits its incarnation: one not committed yet is unknown).
    pub fn is_down(&self, peer: &str) -> bool {
        peer != self.me && !self.accepts(peer, self.known(peer))
    }

    /// Notes that `peer` is incarnation `incarnation` (heard from it, or reported): a newer
    /// one than known before is a restart ([`Verdicts::poll_restarts`]).
    fn note(&mut self, peer: &str, incarnation: u64) {
        if peer == self.me || incarnation > MAX_INCARNATION {
            return;
        }
        let e = self.reported.entry(peer.to_string()).or_insert(0);
        if incarnation > *e {
            if *e > 0 {
                self.restarts.push((peer.to_string(), incarnation));
            }
            *e = incarnation;
        }
    }

    /// The committed incarnations of every node's current start (`MetaState::up_from`). One
    /// later than this node's own means this one started from a folder that lost its counter:
    /// it fences itself and starts above it.
    pub fn handle_booted(&mut self, up_from: &BTreeMap<String, u64>) {
        for (p, &i) in up_from {
            if *p == self.me {
                if i > self.incarnation && i <= MAX_INCARNATION && self.fence.is_none() {
                    self.fence = Some(Fence {
                        declared: i,
                        told_by: None,
                        heard_later: true,
                    });
                }
                continue;
            }
            self.note(p, i);
        }
    }

    /// The peers known as a newer incarnation since the last poll (each with it): what they
    /// held of the previous one is gone.
    pub fn poll_restarts(&mut self) -> Vec<(String, u64)> {
        std::mem::take(&mut self.restarts)
    }

    /// Whether this incarnation learnt its verdict (it serves and coordinates nothing more).
    pub fn is_fenced(&self) -> bool {
        self.fence.is_some()
    }

    /// Whether a message of `incarnation` of `from` is taken: not from an incarnation declared
    /// down.
    pub fn accepts(&self, from: &str, incarnation: u64) -> bool {
        self.committed.get(from).is_none_or(|&d| d < incarnation)
    }

    /// The committed verdicts of this node's metadata (all of them: they only grow).
    pub fn handle_committed(&mut self, down: &BTreeMap<String, u64>) {
        for (p, &d) in down {
            self.record(p, d, None);
        }
    }

    /// A peer's heartbeat: its incarnation, the verdicts it knows, the incarnations it heard.
    /// Returns whether the heartbeat is taken (its sender not declared down). A verdict on this
    /// node is believed even from a fenced sender: it can only stop this node, never harm it.
    pub fn handle_heartbeat<'a>(
        &mut self,
        from: &str,
        incarnation: u64,
        down: impl IntoIterator<Item = (&'a str, u64)>,
        heard: impl IntoIterator<Item = (&'a str, u64)>,
    ) -> bool {
        for (p, d) in down {
            if p == self.me {
                self.record(p, d, Some(from));
            }
        }
        if !self.accepts(from, incarnation) {
            return false;
        }
        self.note(from, incarnation);
        let mut above = None;
        for (p, i) in heard {
            if p == self.me && i > self.incarnation && i <= MAX_INCARNATION {
                above = Some(i);
            }
            self.note(p, i);
        }
        // A peer heard a later incarnation of this node than this one: this one started
        // from a data folder that lost its counter (a replaced disk) and drew one that an
        // earlier incarnation had passed. It must not pass for that one: it fences itself
        // and comes back above it.
        if let Some(i) = above {
            if self.fence.is_none() {
                self.fence = Some(Fence {
                    declared: i,
                    told_by: Some(from.to_string()),
                    heard_later: true,
                });
            }
        }
        true
    }

    fn record(&mut self, peer: &str, declared: u64, told_by: Option<&str>) {
        if peer == self.me {
            if declared >= self.incarnation && self.fence.is_none() {
                self.fence = Some(Fence {
                    declared,
                    told_by: told_by.map(str::to_string),
                    heard_later: false,
                });
            }
            // A verdict on this node only fences it; it is not a sender to drop.
            if told_by.is_some() {
                return;
            }
        }
        let e = self.committed.entry(peer.to_string()).or_insert(0);
        *e = (*e).max(declared);
    }

    /// The fence this incarnation must carry out, once.
    pub fn poll_fence(&mut self) -> Option<Fence> {
        if self.fence_polled {
            return None;
        }
        let f = self.fence.clone()?;
        self.fence_polled = true;
        Some(f)
    }

    /// The declarations the coordinator proposes now. `coordinating`: this node leads the
    /// metadata and holds its lease. `suspects`: `(peer, incarnation heard)` of every peer
    /// silent past the failure timeout or whose disk failed. Each returned `(peer, incarnation)`
    /// is being committed until [`Verdicts::handle_declared`].
    pub fn poll_declarations(
        &mut self,
        coordinating: bool,
        suspects: impl IntoIterator<Item = (String, u64)>,
    ) -> Vec<(String, u64)> {
        if !coordinating || self.is_fenced() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (peer, heard) in suspects {
            let inc = heard.max(self.reported.get(&peer).copied().unwrap_or(0));
            if peer == self.me || inc == 0 || !self.accepts(&peer, inc) || self.declaring.contains(&peer) {
                continue;
            }
            self.declaring.insert(peer.clone());
            out.push((peer, inc));
        }
        out
    }

    /// A declaration's submission ended (committed or not: the next tick proposes it again).
    pub fn handle_declared(&mut self, peer: &str) {
        self.declaring.remove(peer);
    }
}

/// The coordinator as node `me` sees it: the metadata log's leader as this node knows it
/// (`leader`), but not itself while it does not hold its lease.
pub fn coordinator<'a>(me: &str, leader: Option<&'a str>, lease_held: bool) -> Option<&'a str> {
    leader.filter(|l| *l != me || lease_held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receivers_drop_declared_incarnations_for_good() {
        let mut v = Verdicts::new("a", 1);
        assert!(v.accepts("b", 1));
        v.handle_committed(&BTreeMap::from([("b".to_string(), 2)]));
        assert!(!v.accepts("b", 1) && !v.accepts("b", 2));
        assert!(v.accepts("b", 3), "a new incarnation is taken");
        // An older committed table never withdraws a verdict.
        v.handle_committed(&BTreeMap::from([("b".to_string(), 1)]));
        assert!(!v.accepts("b", 2));
        assert!(!v.handle_heartbeat("b", 2, [], [("c", 5)]));
        assert!(v.handle_heartbeat("b", 3, [], [("c", 5)]));
        assert_eq!(v.poll_fence(), None);
    }

    /// A node whose data folder lost its counter drew an incarnation a peer had already heard
    /// passed: it fences itself to come back above it; a peer hearing this one or an older one
    /// changes nothing.
    #[test]
    fn a_peer_is_known_by_its_newest_incarnation_heard_or_committed_and_its_restarts_are_told_once() {
        let mut v = Verdicts::new("a", 4);
        assert_eq!(v.known("b"), 0);
        assert!(!v.is_down("b"), "unknown and never declared");
        v.handle_booted(&BTreeMap::from([("b".to_string(), 2), ("a".to_string(), 4)]));
        assert_eq!((v.known("b"), v.known("a")), (2, 4));
        assert!(v.poll_restarts().is_empty(), "a first incarnation is no restart");
        v.handle_committed(&BTreeMap::from([("b".to_string(), 2), ("c".to_string(), 1)]));
        assert!(
            v.is_down("b") && v.is_down("c"),
            "c: declared, and no start of it known"
        );
        assert!(
            !v.handle_heartbeat("b", 2, [], []),
            "a declared incarnation is not heard"
        );
        assert!(v.handle_heartbeat("b", 3, [], []));
        assert!(!v.is_down("b"));
        assert_eq!(v.poll_restarts(), vec![("b".to_string(), 3)]);
        assert!(
            v.handle_heartbeat("b", 3, [], []) && v.poll_restarts().is_empty(),
            "once"
        );
        // Its start committed later changes nothing more; an older record is history.
        v.handle_booted(&BTreeMap::from([("b".to_string(), 3)]));
        v.handle_booted(&BTreeMap::from([("b".to_string(), 1)]));
        assert_eq!((v.known("b"), v.poll_restarts()), (3, vec![]));
        assert_eq!(v.poll_fence(), None);
        // The metadata records a later start of this node than this one.
        v.handle_booted(&BTreeMap::from([("a".to_string(), 9)]));
        assert_eq!(
            v.poll_fence(),
            Some(Fence {
                declared: 9,
                told_by: None,
                heard_later: true,
            })
        );
    }

    #[test]
    fn a_node_a_peer_heard_later_than_itself_fences_itself_above_it() {
        let mut v = Verdicts::new("a", 5);
        assert!(v.handle_heartbeat("b", 1, [], [("a", 5), ("c", 9)]));
        assert!(v.handle_heartbeat("b", 1, [], [("a", 4)]));
        assert_eq!(v.poll_fence(), None);
        assert!(v.handle_heartbeat("b", 1, [], [("a", 7)]));
        assert_eq!(
            v.poll_fence(),
            Some(Fence {
                declared: 7,
                told_by: Some("b".into()),
                heard_later: true,
            })
        );
        assert_eq!(v.poll_fence(), None, "once");
    }

    #[test]
    fn a_node_fences_itself_once_on_its_own_verdict() {
        let mut v = Verdicts::new("a", 3);
        v.handle_committed(&BTreeMap::from([("a".to_string(), 2)]));
        assert_eq!(v.poll_fence(), None, "a verdict on an older incarnation is history");
        // Told by a peer that is itself declared down: still believed.
        v.handle_committed(&BTreeMap::from([("c".to_string(), 1)]));
        assert!(!v.handle_heartbeat("c", 1, [("a", 3)], []));
        assert_eq!(
            v.poll_fence(),
            Some(Fence {
                heard_later: false,
                declared: 3,
                told_by: Some("c".into())
            })
        );
        assert_eq!(v.poll_fence(), None, "once");
        assert!(v.is_fenced());
        assert!(v.poll_declarations(true, [("b".to_string(), 1)]).is_empty());
    }

    #[test]
    fn the_coordinator_declares_each_silent_peer_once_at_the_newest_incarnation_heard() {
        let mut v = Verdicts::new("a", 1);
        assert!(v.poll_declarations(false, [("b".to_string(), 1)]).is_empty());
        v.handle_heartbeat("c", 1, [], [("b", 4)]);
        assert_eq!(
            v.poll_declarations(true, [("b".to_string(), 2), ("d".to_string(), 0)]),
            vec![("b".to_string(), 4)],
            "never heard: nothing to declare"
        );
        assert!(
            v.poll_declarations(true, [("b".to_string(), 2)]).is_empty(),
            "in flight"
        );
        v.handle_declared("b");
        v.handle_committed(&BTreeMap::from([("b".to_string(), 4)]));
        assert!(v.poll_declarations(true, [("b".to_string(), 4)]).is_empty(), "declared");
    }

    #[test]
    fn coordination_needs_the_lease() {
        assert_eq!(coordinator("a", Some("a"), true), Some("a"));
        assert_eq!(coordinator("a", Some("a"), false), None);
        assert_eq!(coordinator("a", Some("b"), false), Some("b"));
        assert_eq!(coordinator("a", None, true), None);
    }
}
