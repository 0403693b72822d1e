//! Failure detector over heartbeats, as a pure state machine: time comes in as `now_ms`.
//!
//! A node silent for more than half the timeout is *suspect*, for more than the timeout
//! *down*. A node never heard since this daemon started counts its silence from the start.
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
    peers: BTreeMap<String, PeerView<H>>,
}

impl<H> Membership<H> {
    pub fn new(peers: impl IntoIterator<Item = String>, timeout_ms: u64, now_ms: u64) -> Self {
        Membership {
            timeout_ms,
            started_ms: now_ms,
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

    /// Records a heartbeat of `incarnation` from `peer`. Returns true when the peer restarted
    /// (an incarnation other than the last one heard). Unknown peers are ignored.
    pub fn heard(&mut self, now_ms: u64, peer: &str, incarnation: u64, hb: H) -> bool {
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
        let silence_ms = now_ms.saturating_sub(v.last_heard_ms.unwrap_or(self.started_ms));
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

    /// Updates `down_since` marks; returns how long (ms) each down peer has been down.
    pub fn tick(&mut self, now_ms: u64) -> Vec<(String, u64)> {
        let (timeout_ms, started_ms) = (self.timeout_ms, self.started_ms);
        let mut out = Vec::new();
        for (name, v) in self.peers.iter_mut() {
            let silence_ms = now_ms.saturating_sub(v.last_heard_ms.unwrap_or(started_ms));
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
        assert_eq!(m.tick(3000), vec![("a".to_string(), 0)]);
        assert_eq!(m.tick(3500), vec![("a".to_string(), 500)]);
        assert!(m.heard(3600, "a", 2, ()), "a new incarnation is a restart");
        assert!(!m.heard(3700, "a", 2, ()));
        assert!(m.tick(3700).is_empty());
        assert_eq!(m.state(0, "zz"), Liveness::Down);
        assert!(!m.heard(0, "zz", 1, ()), "unknown peers are ignored");
    }
}
