//! Failure detector over heartbeats, as a pure state machine: time comes in as an argument.
//!
//! A node silent for more than half the timeout is *suspect*, for more than the timeout
//! *down*. A node never heard since this daemon started counts its silence from the start.

use crate::peer::Heartbeat;
use psls_ipc::proto::NodeState;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct PeerView {
    pub last_heard: Option<Instant>,
    pub heartbeat: Option<Heartbeat>,
    /// When it was first seen down in the current silence.
    pub down_since: Option<Instant>,
}

#[derive(Debug)]
pub struct Membership {
    timeout: Duration,
    started: Instant,
    peers: BTreeMap<String, PeerView>,
}

impl Membership {
    pub fn new(peers: impl IntoIterator<Item = String>, timeout: Duration, now: Instant) -> Self {
        Membership {
            timeout,
            started: now,
            peers: peers
                .into_iter()
                .map(|p| {
                    (
                        p,
                        PeerView {
                            last_heard: None,
                            heartbeat: None,
                            down_since: None,
                        },
                    )
                })
                .collect(),
        }
    }

    /// Records a heartbeat from `peer`. Returns true when it restarted (new incarnation).
    pub fn heard(&mut self, now: Instant, peer: &str, hb: Heartbeat) -> bool {
        let Some(v) = self.peers.get_mut(peer) else {
            return false;
        };
        let restarted = v
            .heartbeat
            .as_ref()
            .is_some_and(|old| old.incarnation != hb.incarnation);
        v.last_heard = Some(now);
        v.down_since = None;
        v.heartbeat = Some(hb);
        restarted
    }

    pub fn state(&self, now: Instant, peer: &str) -> NodeState {
        let Some(v) = self.peers.get(peer) else {
            return NodeState::Down;
        };
        let silence = now.saturating_duration_since(v.last_heard.unwrap_or(self.started));
        if silence > self.timeout {
            NodeState::Down
        } else if silence > self.timeout / 2 {
            NodeState::Suspect
        } else {
            NodeState::Up
        }
    }

    /// Live means up or suspect: still used for requests.
    pub fn is_live(&self, now: Instant, peer: &str) -> bool {
        self.state(now, peer) != NodeState::Down
    }

    /// Updates `down_since` marks; returns how long each down peer has been down.
    pub fn tick(&mut self, now: Instant) -> Vec<(String, Duration)> {
        let names: Vec<String> = self.peers.keys().cloned().collect();
        let mut out = Vec::new();
        for n in names {
            let down = self.state(now, &n) == NodeState::Down;
            let v = self.peers.get_mut(&n).expect("known peer");
            if down {
                let since = *v.down_since.get_or_insert(now);
                out.push((n, now.saturating_duration_since(since)));
            } else {
                v.down_since = None;
            }
        }
        out
    }

    pub fn view(&self, peer: &str) -> Option<&PeerView> {
        self.peers.get(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hb(inc: u64) -> Heartbeat {
        Heartbeat {
            incarnation: inc,
            pid: 1,
            meta_seq: 0,
            memory_used_bytes: 0,
            memory_capacity_bytes: 0,
            disk_used_bytes: 0,
            disk_free_bytes: 0,
            rebuild: None,
            svm_segments: 0,
            svm_view: Vec::new(),
            svm_fenced: Vec::new(),
        }
    }

    #[test]
    fn suspect_then_down_then_back() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut m = Membership::new(["a".to_string()], ms(1000), t0);
        assert_eq!(m.state(t0, "a"), NodeState::Up);
        assert_eq!(m.state(t0 + ms(600), "a"), NodeState::Suspect);
        assert_eq!(m.state(t0 + ms(1001), "a"), NodeState::Down);
        assert!(!m.heard(t0 + ms(1100), "a", hb(1)));
        assert_eq!(m.state(t0 + ms(1200), "a"), NodeState::Up);
        assert_eq!(m.tick(t0 + ms(3000)), vec![("a".to_string(), ms(0))]);
        assert_eq!(m.tick(t0 + ms(3500)), vec![("a".to_string(), ms(500))]);
        assert!(m.heard(t0 + ms(3600), "a", hb(2)));
        assert!(m.tick(t0 + ms(3700)).is_empty());
        assert_eq!(m.state(t0, "zz"), NodeState::Down);
    }
}
