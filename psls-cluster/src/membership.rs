//! Failure detector over heartbeats, as a pure state machine: time comes in as `now_ms`.
//!
//! What it gives are *impressions*, not verdicts: a node silent for more than half the timeout
//! is *suspect*, for more than the timeout *down*. Only the metadata's coordinator turns an
//! impression into a verdict (a committed `DeclareDown`); the others use impressions only to
//! route around a silent node and to elect a coordinator.
//!
//! Hysteresis: a node never heard since this daemon started counts its silence from the start;
//! and a detector that was itself not ticked for more than half the timeout (its process was
//! paused: a VM stall, swapping, a debugger) suspects nobody until a whole timeout has passed
//! since it woke up — the silence it saw was its own.
//!
//! The lease ([`Membership::lease_held`]): whether this node heard from a majority of the
//! cluster (itself included) within the timeout, on raw heard times (no hysteresis). Without
//! it a node claims and coordinates nothing — not even right after it started: a node that
//! restarted behind a cut link hears nobody, and claimed epoch after epoch alone.
//!
//! A heartbeat carrying a new incarnation is proof of a restart (the caller drops what it held
//! for the old one). What a heartbeat carries is the caller's type `H`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What the detector says of a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Liveness {
    Up,
    Suspect,
    Down,
}

/// One peer as the detector sees it.
#[derive(Debug)]
pub struct PeerView<H> {
    pub last_heard_ms: Option<u64>,
    pub incarnation: Option<u64>,
    pub heartbeat: Option<H>,
    /// When it was first seen down in the current silence.
    pub down_since_ms: Option<u64>,
}

/// The failure detector of one node over its peers (names are the peers' physical names).
#[derive(Debug)]
pub struct Membership<H> {
    timeout_ms: u64,
    started_ms: u64,
    /// The last time [`Membership::tick`] ran (a gap of more than half the timeout is a stall).
    ticked_ms: u64,
    /// When this node last woke from a stall (silence before it is not counted).
    awake_ms: u64,
    /// When this node last heard any watched peer.
    heard_any_ms: Option<u64>,
    /// The last tick at which this node had heard none of its peers for half the timeout: it
    /// heard nothing itself (its incoming messages lost, a cut). The silences [`Membership::tick`]
    /// finds count from after it (its peers come back one by one as their beats arrive, and
    /// the last ones would look silent for a while); its impressions ([`Membership::state`])
    /// do not.
    deaf_ms: u64,
    peers: BTreeMap<String, PeerView<H>>,
}

impl<H> Membership<H> {
    pub fn new(peers: impl IntoIterator<Item = String>, timeout_ms: u64, now_ms: u64) -> Self {
        Membership {
            timeout_ms,
            started_ms: now_ms,
            ticked_ms: now_ms,
            awake_ms: now_ms,
            heard_any_ms: None,
            deaf_ms: now_ms,
            peers: peers
                .into_iter()
                .map(|p| {
                    let v = PeerView {
                        last_heard_ms: None,
                        incarnation: None,
                        heartbeat: None,
                        down_since_ms: None,
                    };
                    (p, v)
                })
                .collect(),
        }
    }

    /// Starts watching `peer` at `now_ms` (its silence counts from then): a peer the leader
    /// probes on a report. A peer watched already is left as it is.
    pub fn watch(&mut self, peer: &str, now_ms: u64) {
        self.peers.entry(peer.to_string()).or_insert(PeerView {
            last_heard_ms: Some(now_ms),
            incarnation: None,
            heartbeat: None,
            down_since_ms: None,
        });
    }

    /// Stops watching `peer`.
    pub fn unwatch(&mut self, peer: &str) {
        self.peers.remove(peer);
    }

    /// Whether `peer` is watched.
    pub fn watches(&self, peer: &str) -> bool {
        self.peers.contains_key(peer)
    }

    /// The peers watched now (sorted).
    pub fn watched(&self) -> impl Iterator<Item = &str> {
        self.peers.keys().map(String::as_str)
    }

    /// Records a heartbeat of `incarnation` from `peer`. Returns true when the peer restarted
    /// (an incarnation other than the last one heard). Unknown peers are ignored.
    pub fn heard(&mut self, now_ms: u64, peer: &str, incarnation: u64, hb: H) -> bool {
        if !self.peers.contains_key(peer) {
            return false;
        }
        self.heard_any_ms = Some(self.heard_any_ms.map_or(now_ms, |t| t.max(now_ms)));
        let Some(v) = self.peers.get_mut(peer) else {
            return false;
        };
        let restarted = v.incarnation.is_some_and(|old| old != incarnation);
        v.last_heard_ms = Some(now_ms);
        v.down_since_ms = None;
        v.incarnation = Some(incarnation);
        v.heartbeat = Some(hb);
        restarted
    }

    pub fn state(&self, now_ms: u64, peer: &str) -> Liveness {
        let Some(v) = self.peers.get(peer) else {
            return Liveness::Down;
        };
        let silence_ms = now_ms.saturating_sub(self.silence_from(v));
        if silence_ms > self.timeout_ms {
            Liveness::Down
        } else if silence_ms > self.timeout_ms / 2 {
            Liveness::Suspect
        } else {
            Liveness::Up
        }
    }

    /// Live means up or suspect: still used for requests.
    pub fn is_live(&self, now_ms: u64, peer: &str) -> bool {
        self.state(now_ms, peer) != Liveness::Down
    }

    /// Where `v`'s silence counts from: its last heartbeat, but not before this detector
    /// started or last woke from a stall.
    fn silence_from(&self, v: &PeerView<H>) -> u64 {
        v.last_heard_ms.unwrap_or(self.started_ms).max(self.awake_ms)
    }

    /// Whether this node was stalled (not ticked for more than half the timeout) and woke
    /// less than a timeout ago: it suspects nobody yet.
    pub fn waking(&self, now_ms: u64) -> bool {
        self.awake_ms > self.started_ms && now_ms.saturating_sub(self.awake_ms) <= self.timeout_ms
    }

    /// Whether a majority of the cluster (the peers and this node) was heard within the
    /// timeout, on raw heard times.
    pub fn lease_held(&self, now_ms: u64) -> bool {
        let total = self.peers.len() + 1;
        let heard = 1 + self
            .peers
            .values()
            .filter(|v| {
                v.last_heard_ms
                    .is_some_and(|t| now_ms.saturating_sub(t) <= self.timeout_ms)
            })
            .count();
        heard * 2 > total
    }

    /// Updates `down_since` marks; returns how long (ms) each down peer has been down: the
    /// silences to report. A gap since the last tick of more than half the timeout is a stall
    /// of this node: silence before it is forgotten; so is silence while it heard none of its
    /// peers (`deaf_ms`).
    pub fn tick(&mut self, now_ms: u64) -> Vec<(String, u64)> {
        if now_ms.saturating_sub(self.ticked_ms) > self.timeout_ms / 2 {
            self.awake_ms = now_ms;
        }
        // Hearing none of several peers for half the timeout is this node's own silence (one
        // peer alone may be silent itself: it is found so).
        if self.peers.len() > 1
            && self
                .heard_any_ms
                .is_some_and(|t| now_ms.saturating_sub(t) > self.timeout_ms / 2)
        {
            self.deaf_ms = now_ms;
        }
        self.ticked_ms = self.ticked_ms.max(now_ms);
        let timeout_ms = self.timeout_ms;
        let mut out = Vec::new();
        let deaf_ms = self.deaf_ms;
        let from: Vec<u64> = self.peers.values().map(|v| self.silence_from(v).max(deaf_ms)).collect();
        for ((name, v), from) in self.peers.iter_mut().zip(from) {
            let silence_ms = now_ms.saturating_sub(from);
            if silence_ms > timeout_ms {
                let since = *v.down_since_ms.get_or_insert(now_ms);
                out.push((name.clone(), now_ms.saturating_sub(since)));
            } else {
                v.down_since_ms = None;
            }
        }
        out
    }

    pub fn view(&self, peer: &str) -> Option<&PeerView<H>> {
        self.peers.get(peer)
    }

    /// The last heartbeat heard from `peer`.
    pub fn heartbeat(&self, peer: &str) -> Option<&H> {
        self.peers.get(peer).and_then(|v| v.heartbeat.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suspect_then_down_then_back() {
        let mut m: Membership<()> = Membership::new(["a".to_string()], 1000, 0);
        assert_eq!(m.state(0, "a"), Liveness::Up);
        assert_eq!(m.state(600, "a"), Liveness::Suspect);
        assert_eq!(m.state(1001, "a"), Liveness::Down);
        assert!(!m.heard(1100, "a", 1, ()));
        assert_eq!(m.state(1200, "a"), Liveness::Up);
        // Ticked regularly (a gap of more than half the timeout would be a stall of ours).
        for t in (0..=2100).step_by(100) {
            assert!(m.tick(t).is_empty(), "at {t}");
        }
        assert_eq!(m.tick(2200), vec![("a".to_string(), 0)]);
        for t in (2300..2700).step_by(100) {
            m.tick(t);
        }
        assert_eq!(m.tick(2700), vec![("a".to_string(), 500)]);
        assert!(m.heard(2800, "a", 2, ()), "a new incarnation is a restart");
        assert!(!m.heard(2900, "a", 2, ()));
        assert!(m.tick(2900).is_empty());
        assert_eq!(m.state(0, "zz"), Liveness::Down);
        assert!(!m.heard(0, "zz", 1, ()), "unknown peers are ignored");
    }

    #[test]
    fn a_stalled_detector_suspects_nobody_until_a_timeout_after_it_woke() {
        let mut m: Membership<()> = Membership::new(["a".to_string(), "b".to_string()], 1000, 0);
        m.heard(100, "a", 1, ());
        m.heard(100, "b", 1, ());
        assert!(m.tick(200).is_empty());
        // Paused from 200 to 2500: everyone looks silent for 2.4 s, but the silence was ours.
        assert!(m.tick(2500).is_empty(), "a stall is not the peers' silence");
        assert_eq!(m.state(2500, "a"), Liveness::Up);
        assert!(m.waking(2500));
        m.heard(2550, "a", 1, ());
        for t in (2600..=3500).step_by(100) {
            m.heard(t, "a", 1, ());
            assert!(m.tick(t).is_empty(), "at {t}");
        }
        // b stays silent: suspected half a timeout after the wake-up, down after a whole one.
        assert_eq!(m.state(3200, "b"), Liveness::Suspect);
        assert_eq!(m.tick(3600), vec![("b".to_string(), 0)]);
        assert!(!m.waking(3600));
        // Regular ticks are no stall.
        let mut n: Membership<()> = Membership::new(["a".to_string()], 1000, 0);
        for t in (0..=1500).step_by(100) {
            n.tick(t);
        }
        assert_eq!(n.state(1500, "a"), Liveness::Down);
    }

    #[test]
    fn the_lease_needs_a_majority_heard_within_the_timeout() {
        let peers = ["a", "b", "c", "d"].map(String::from);
        let mut m: Membership<()> = Membership::new(peers, 1000, 0);
        assert!(!m.lease_held(0), "a node that heard nobody yet has no lease");
        m.heard(5000, "a", 1, ());
        assert!(!m.lease_held(5000), "2 of 5 is no majority");
        m.heard(5000, "b", 1, ());
        assert!(m.lease_held(5100), "3 of 5");
        assert!(m.lease_held(6000));
        assert!(!m.lease_held(6001), "nobody heard for more than the timeout");
        m.heard(6100, "c", 1, ());
        m.heard(6100, "d", 1, ());
        assert!(m.lease_held(6100));
    }

    #[test]
    fn a_node_that_heard_nobody_for_half_the_timeout_counts_silences_from_when_it_hears_again() {
        let peers = ["a", "b", "c"].map(String::from);
        let mut m: Membership<()> = Membership::new(peers, 1000, 0);
        for p in ["a", "b", "c"] {
            m.heard(100, p, 1, ());
        }
        // Cut off from 200 to 1300 (its ticks still run): it hears nobody, and finds nobody
        // silent (though its impression is that they are down)...
        for now in (200..=1300).step_by(100) {
            assert!(m.tick(now).is_empty(), "at {now}");
        }
        assert_eq!(m.state(1300, "c"), Liveness::Down);
        // ... and once it hears one again, the others' silence counts from its last tick that
        // heard nobody: "c", whose beat comes last, is not silent to it yet.
        m.heard(1310, "a", 1, ());
        m.heard(1390, "b", 1, ());
        assert!(m.tick(1400).is_empty(), "silences count from 1300");
        for now in (1500..=2300).step_by(100) {
            m.heard(now, "a", 1, ());
            m.heard(now, "b", 1, ());
            assert!(m.tick(now).is_empty(), "at {now}");
        }
        assert_eq!(m.tick(2400).len(), 1, "c silent past the timeout after 1300");
        // A peer that is silent while others are heard is silent from its last beat.
        for now in (2500..=3600).step_by(100) {
            m.heard(now, "a", 1, ());
            m.heard(now, "c", 1, ());
            m.tick(now);
        }
        assert_eq!(
            m.tick(3600).into_iter().map(|(p, _)| p).collect::<Vec<_>>(),
            vec!["b".to_string()]
        );
    }
}
