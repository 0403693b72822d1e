//! The shell of metadata replication: one task owns this node's
//! [`psls_cluster::meta::Replica`] over [`MetaState`] and feeds it, one input at a time, the
//! coordinator verdict of the failure detector (every [`TICK_MS`]), the replication messages
//! peers post on the message link, submissions, and the sequence numbers heartbeats gossip.
//! It carries out the machine's actions in order: votes and committed states are written to
//! the metadata store (redb, fsync) before anything later is sent or answered; sends go out on
//! the message link; answers go back to the submitter.
//!
//! Voters are the physical nodes of the config (logical nodes first, then spares), numbered in
//! config order; a majority of them is a quorum. A submission is answered once every voter
//! the failure detector takes as live has the operation (as before: a file created through one
//! node can be mapped through any other at once). The lowest logical id the failure detector
//! hears claims the coordination; it acts only in an epoch a quorum promised it, so two nodes
//! that both believe they coordinate cannot commit different operations. The leader of the
//! current epoch ([`Replication::leader`]) is the cluster's one coordinator: of barriers,
//! locks and checkpoints too (`Node::coordinator_now`).
//!
//! Fail-stop: a node that cannot write its vote or a committed state stops (it must not answer
//! as if it had). Bounds: at most [`MAX_INPUTS`] inputs wait; a replication message arriving on
//! a full queue is dropped (the protocol retries).

use crate::failstop::Locked;
use crate::op::blocking;
use crate::peer::{NetError, PeerReq};
use psls_cluster::meta::{Action, Msg, ReplError, Replica};
use psls_pfs::meta::MetaStore;
use psls_pfs::meta::{MetaOp, MetaState};
use psls_pfs::MetaError;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// How often the machine hears the failure detector's verdict (and retries claims and
/// proposals).
pub const TICK_MS: u64 = 50;
/// Inputs waiting for the replication task.
pub const MAX_INPUTS: usize = 4096;

/// The answer to a submission: the sequence number the operation was committed at.
pub type Outcome = Result<u64, ReplError<MetaError>>;

enum Input {
    Msg {
        from: u32,
        /// Boxed: a message may carry a whole state.
        msg: Box<Msg<MetaState>>,
    },
    Submit {
        op: MetaOp,
        reply: oneshot::Sender<Outcome>,
    },
    PeerSeq {
        from: u32,
        seq: u64,
    },
}

/// What replication needs of the node it runs on (its door; `Node` is the one host).
pub trait Host: Send + Sync + 'static {
    /// This node's physical name.
    fn name(&self) -> &str;
    /// Milliseconds on the failure detector's clock.
    fn now_ms(&self) -> u64;
    /// Whether the failure detector makes this node the coordinator (lowest live logical id).
    fn is_coordinator(&self) -> bool;
    /// Whether the failure detector takes physical node `peer` as live.
    fn is_live(&self, peer: &str) -> bool;
    /// The metadata store (committed state and vote).
    fn meta(&self) -> &Arc<Mutex<MetaStore>>;
    /// Committed metadata was installed in [`Host::meta`].
    fn installed(&self);
    /// The replication messages' own door in (this node's [`Replication`]).
    fn replication(&self) -> &Replication;
    /// Posts a one-way message to `peer` on the message link.
    fn post(&self, peer: &str, req: &PeerReq) -> Result<(), NetError>;
}

/// The door other parts of the daemon use: deliver, submit, gossip.
pub struct Replication {
    voters: Vec<String>,
    tx: mpsc::Sender<Input>,
    rx: Mutex<Option<mpsc::Receiver<Input>>>,
    /// The leader as this node knows it, with its epoch's number (published after every
    /// input).
    leader: Mutex<Option<(String, u64)>>,
    /// Whether this node claims or leads an epoch in this life (published after every input).
    claims: std::sync::atomic::AtomicBool,
}

impl Replication {
    /// Voters: the physical nodes, in config order.
    pub fn new(voters: Vec<String>) -> Replication {
        let (tx, rx) = mpsc::channel(MAX_INPUTS);
        Replication {
            voters,
            tx,
            rx: Mutex::new(Some(rx)),
            leader: Mutex::new(None),
            claims: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The metadata's leader as this node knows it: the claimer of the newest epoch it
    /// promised (itself from its own claim on), none before any.
    pub fn leader(&self) -> Option<String> {
        self.leader.locked().as_ref().map(|(l, _)| l.clone())
    }

    /// Whether this node claims or leads an epoch in this life.
    pub fn claims(&self) -> bool {
        self.claims.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`Replication::leader`] with the number of the epoch it leads.
    pub fn leader_epoch(&self) -> Option<(String, u64)> {
        self.leader.locked().clone()
    }

    fn voter_of(&self, physical: &str) -> Option<u32> {
        self.voters.iter().position(|v| v == physical).map(|i| i as u32)
    }

    /// A replication message from peer `from` (its certificate's name).
    pub fn deliver(&self, from: &str, msg: Msg<MetaState>) {
        let Some(from) = self.voter_of(from) else {
            tracing::warn!(
                peer = from,
                "replication message from a node that is not a voter: dropped"
            );
            return;
        };
        let input = Input::Msg {
            from,
            msg: Box::new(msg),
        };
        if self.tx.try_send(input).is_err() {
            tracing::warn!(peer = from, "replication queue full: message dropped");
        }
    }

    /// A heartbeat of `from` says its committed metadata is at `seq`.
    pub fn peer_seq(&self, from: &str, seq: u64) {
        if let Some(from) = self.voter_of(from) {
            let _ = self.tx.try_send(Input::PeerSeq { from, seq });
        }
    }

    /// Submits `op` to this node's machine (answered `NotCoordinator` unless it coordinates).
    pub async fn submit(&self, op: MetaOp) -> Outcome {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Input::Submit { op, reply }).await.is_err() {
            return Err(ReplError::Interrupted);
        }
        rx.await.unwrap_or(Err(ReplError::Interrupted))
    }

    /// Runs the replication task until the daemon stops. Called once.
    pub async fn run<H: Host>(node: Arc<H>) {
        let Some(mut rx) = node.replication().rx.locked().take() else {
            tracing::error!("the replication task was started twice");
            return;
        };
        let voters = node.replication().voters.clone();
        let Some(me) = node.replication().voter_of(node.name()) else {
            tracing::error!(node = %node.name(), "this node is not in its own config");
            return;
        };
        let durable = node.meta().locked().durable();
        let mut replica: Replica<MetaState, oneshot::Sender<Outcome>> = Replica::new(me, voters.len() as u32, durable);
        let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let coordinator = node.is_coordinator();
                    let live = voters.iter().enumerate().filter(|(_, v)| node.is_live(v)).map(|(i, _)| i as u32);
                    replica.set_live(live);
                    replica.tick(node.now_ms(), coordinator);
                }
                input = rx.recv() => match input {
                    None => return,
                    Some(Input::Msg { from, msg }) => replica.receive(from, *msg),
                    Some(Input::Submit { op, reply }) => replica.submit(reply, op),
                    Some(Input::PeerSeq { from, seq }) => replica.peer_seq(from, seq),
                },
            }
            while let Some(a) = replica.poll_action() {
                carry_out(&node, &voters, a).await;
            }
            // The claimer of the newest epoch promised here: this node itself from its claim on
            // (its followers may route to it as soon as they promise, before it has counted
            // their promises), or the claimer this node promised.
            // Not itself from a promise alone: a node that restarted (or re-executed itself
            // when fenced) finds its own old claim as the newest promise on its disk, and must
            // not take itself for the leader of that epoch (it did, and coordinated barriers
            // and locks in an old epoch beside the real leader, by the pause tests' logs).
            node.replication()
                .claims
                .store(replica.claimed().is_some(), std::sync::atomic::Ordering::Relaxed);
            let leader = match replica.claimed() {
                Some(e) => Some((me, e.n)),
                None => {
                    let p = replica.promised();
                    (p.n > 0 && p.by != me).then_some((p.by, p.n))
                }
            };
            let leader = leader.and_then(|(v, n)| voters.get(v as usize).map(|l| (l.clone(), n)));
            let mut known = node.replication().leader.locked();
            if *known != leader {
                tracing::info!(node = %node.name(), leader = ?leader, epoch = ?replica.promised(), "metadata leader");
                *known = leader;
            }
        }
    }
}

/// Carries out one action; persisting comes before anything after it.
async fn carry_out<H: Host>(node: &Arc<H>, voters: &[String], a: Action<MetaState, oneshot::Sender<Outcome>>) {
    match a {
        Action::PersistVote { promised, accepted } => {
            let meta = node.meta().clone();
            let r = blocking(move || meta.locked().persist_vote(promised, accepted)).await;
            if let Err(e) = r.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string())) {
                panic!("cannot record the metadata replication vote: {e}");
            }
        }
        Action::PersistCommitted(state) => {
            let seq = state.seq;
            let meta = node.meta().clone();
            let r = blocking(move || {
                let mut m = meta.locked();
                if state.seq > m.state().seq {
                    m.install(state)
                } else {
                    Ok(())
                }
            })
            .await;
            if let Err(e) = r.map_err(|e| e.to_string()).and_then(|r| r.map_err(|e| e.to_string())) {
                panic!("cannot record committed metadata (seq {seq}): {e}");
            }
            node.installed();
            tracing::debug!(node = %node.name(), seq, "metadata committed");
        }
        Action::Send { to, msg } => {
            let Some(peer) = voters.get(to as usize) else { return };
            if let Err(e) = node.post(peer, &PeerReq::Meta(msg)) {
                tracing::debug!(node = %node.name(), %peer, error = %e, "replication message not sent");
            }
        }
        Action::Done { token, result } => {
            let _ = token.send(result);
        }
    }
}
