//! The metadata log's task: it owns this node's [`psls_cluster::log::Log`] over
//! [`MetaState`] and its [`LogStore`], and feeds it, a batch at a time, ticks (every
//! [`TICK_MS`]), the log messages peers post on the message link, submissions and reads.
//! It carries out the machine's actions in order: a [`Persist`] is one write of the
//! [`LogStore`] (an append to its log file, with an fsync when the machine says so, then the
//! tables' changes) before anything later is sent or answered, and the applied
//! state is published to the node (`Node::meta_state`) right after it, and after every batch
//! (the machine writes applied changes lazily); sends go out on the
//! message link; answers go back to the waiting callers.
//!
//! Group commit: every input waiting when the task wakes (up to [`MAX_BATCH`]) is handed to the
//! machine before its actions are taken, so many submissions share one write and one round of
//! appends.
//!
//! Nodes are the physical nodes of the config (logical nodes first, then spares), numbered in
//! config order; a few of them vote (`metadata_voters`, chosen when the cluster is created by
//! [`psls_cluster::voters::initial`]), the others follow the log.
//! The leader changes the voters as [`psls_cluster::voters::plan`] says, at most once a
//! [`PLAN_EVERY_TICKS`]: a voter lost for good is replaced by a follower, and a cluster whose
//! every node votes (its stores predate voters) is cut down to the configured few.
//! The log's leader is the cluster's coordinator (of barriers, locks and
//! checkpoints too: `Node::coordinator_now`). Its election timeout is the failure detector's
//! (`heartbeat_timeout_ms`); a node whose disk failed, or that fences itself, does not lead.
//!
//! Snapshots travel apart from the log's messages: the sender keeps the snapshot's bytes and
//! posts the message without them; the receiver fetches them in chunks of [`CHUNK_BYTES`]
//! (at most [`MAX_SNAPSHOT_BYTES`], one fetch at a time) before the machine sees the message.
//!
//! Fail-stop: a node that cannot write its store stops (it must not answer as if it had), and
//! so does one whose log cannot go on (an entry it cannot decode). The door to it is `crate::replication::Replication`.

use crate::failstop::Locked;
use crate::node::Node;
use crate::peer::{PeerReq, PeerResp};
use crate::replication::{
    Input, Status, Token, MAX_BATCH, MAX_SNAPSHOT_BYTES, PLAN_EVERY_TICKS, SNAPSHOT_REF, TICK_MS,
};
use psls_cluster::log::{Action, Limits, Log, Persist, Wire};
use psls_pfs::logstore::LogStore;
use psls_pfs::meta::MetaState;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Runs the log until the daemon stops. Called once.
pub async fn run(node: Arc<Node>) {
    let repl = &node.replication;
    let (Some(mut rx), Some((store, opened))) = (repl.rx.locked().take(), repl.start.locked().take()) else {
        tracing::error!("the metadata log task was started twice");
        return;
    };
    let Some(me) = repl.number_of(node.name()) else {
        tracing::error!(node = %node.name(), "this node is not in its own config");
        return;
    };
    let nodes = repl.nodes.len() as u32;
    let limits = Limits::for_timeout(node.cfg.cluster.heartbeat_timeout_ms, TICK_MS);
    let seed = rand::random::<u64>();
    let mut log: Log<MetaState, Token> = match Log::new(me, nodes, limits, opened.durable, seed) {
        Ok(l) => l,
        Err(e) => panic!("the metadata log cannot start from this node's store: {e}"),
    };
    if opened.legacy.is_some() {
        tracing::info!(node = %node.name(), "metadata converted from the store before the log");
    }
    let store = Arc::new(Mutex::new(store));
    let mut tick = tokio::time::interval(Duration::from_millis(TICK_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut fetching = false;
    let mut known: Option<(Option<u32>, u64)> = None;
    let mut leaderless_ticks = 0u64;
    let mut ticks = 0u64;
    let mut last_tick = std::time::Instant::now();
    loop {
        let first = tokio::select! {
            _ = tick.tick() => None,
            input = rx.recv() => match input {
                None => return,
                Some(i) => Some(i),
            },
        };
        let mut inputs: Vec<Input> = first.into_iter().collect();
        if inputs.is_empty() {
            // Ticks this loop did not run (the process stood still, or was starved) still
            // age the lease's answers.
            let now = std::time::Instant::now();
            let missed = (now.duration_since(last_tick).as_millis() as u64 / TICK_MS).saturating_sub(1);
            last_tick = now;
            if missed > 0 {
                log.handle_missed_ticks(missed);
            }
            log.set_eligible(node.may_lead());
            log.handle_tick();
            // No leader heard for a while, and this node is the one that should lead (the
            // lowest live voter): it campaigns without waiting out a randomized election
            // timeout (a cluster's first start, or its leader lost). A leader the failure
            // detector no longer hears counts as none: its followers are out of its lease as
            // soon (the failure timeout is the election timeout).
            let heard = log
                .leader()
                .and_then(|l| repl.nodes.get(l as usize))
                .is_some_and(|l| node.is_reachable(l));
            leaderless_ticks = if heard { 0 } else { leaderless_ticks + 1 };
            let voters: Vec<String> = log
                .voters()
                .iter()
                .filter_map(|v| repl.nodes.get(*v as usize).cloned())
                .collect();
            if leaderless_ticks >= 2 * limits.heartbeat_ticks as u64 && log.is_voter() && node.first_live_voter(&voters)
            {
                leaderless_ticks = 0;
                log.campaign();
            }
            ticks += 1;
            if ticks.is_multiple_of(PLAN_EVERY_TICKS) && log.lease_held() && !log.conf_changing() {
                plan_voters(&node, &mut log);
            }
        }
        while inputs.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(i) => inputs.push(i),
                Err(_) => break,
            }
        }
        for input in inputs {
            match input {
                Input::Msg { from, wire } => match snapshot_ref(&wire) {
                    Some((index, term, len)) => {
                        if !fetching {
                            fetching = true;
                            tokio::spawn(fetch_snapshot(node.clone(), from, wire, index, term, len));
                        }
                    }
                    None => log.handle_message(from, wire),
                },
                Input::Submit { op, reply } => log.submit(Token::Submit(reply), &op),
                Input::Read { reply } => log.read(Token::Read(reply)),
                Input::Fetched => fetching = false,
                Input::FreshCluster => log.handle_fresh_cluster(),
            }
        }
        while let Some(a) = log.poll_action() {
            match a {
                Action::Persist(p) => persist(&node, &store, p, &log).await,
                Action::Send { to, msg } => send(&node, &mut log, to, msg),
                Action::Done { token, result } => {
                    if let Token::Submit(reply) = token {
                        let _ = reply.send(result);
                    }
                }
                Action::Read { token, result } => {
                    if let Token::Read(reply) = token {
                        let _ = reply.send(result);
                    }
                }
                Action::Halt { reason } => panic!("the metadata log cannot go on here: {reason}"),
            }
        }
        // Applied changes the machine writes lazily are readable at once.
        if node.meta_index() != log.state().seq {
            node.publish_meta(log.state().clone());
        }
        let leader = log.leader();
        if known != Some((leader, log.term())) {
            known = Some((leader, log.term()));
            tracing::info!(
                node = %node.name(),
                term = log.term(),
                leader = ?leader.and_then(|l| repl.nodes.get(l as usize)),
                voter = log.is_voter(),
                commit = log.commit(),
                applied = log.applied(),
                "metadata leader"
            );
        }
        let st = Status {
            term: log.term(),
            leader: leader.and_then(|l| repl.nodes.get(l as usize).cloned()),
            is_leader: log.is_leader(),
            lease: log.lease_held(),
            lease_until: match log.lease_ticks_left() {
                0 => None,
                u64::MAX => Some(std::time::Instant::now() + Duration::from_secs(3600)),
                t => Some(std::time::Instant::now() + Duration::from_millis(t.saturating_sub(1) * TICK_MS)),
            },
            claims: log.claims(),
            commit: log.commit(),
            applied: log.applied(),
            first_index: log.first_index(),
            last_index: log.last_index(),
            amnesiac: log.amnesiac(),
            matched: log
                .voters()
                .into_iter()
                .filter_map(|v| Some((repl.nodes.get(v as usize)?.clone(), log.matched(v)?)))
                .collect(),
            voters: log
                .voters()
                .into_iter()
                .filter_map(|v| repl.nodes.get(v as usize).cloned())
                .collect(),
            is_voter: log.is_voter(),
            awaiting_fresh: log.awaiting_fresh(),
            lost_disk: log.lost_disk(),
            store_bytes: store.locked().bytes_on_disk(),
        };
        *repl.status.locked() = st;
    }
}

/// At the leader with its lease: changes the voters as [`psls_cluster::voters::plan`] says.
fn plan_voters(node: &Arc<Node>, log: &mut Log<MetaState, Token>) {
    let repl = &node.replication;
    let Some(me) = repl.number_of(node.name()) else { return };
    let facts = node.voter_facts();
    let cands: Vec<psls_cluster::voters::Candidate<'_>> = facts
        .iter()
        .filter_map(|(name, domain, usable, gone)| {
            Some(psls_cluster::voters::Candidate {
                id: repl.number_of(name)?,
                domain,
                usable: *usable,
                gone: *gone,
            })
        })
        .collect();
    let current = log.voters();
    let Some(want) = psls_cluster::voters::plan(&current, me, node.cfg.cluster.metadata_voters, &cands) else {
        return;
    };
    let names = |v: &[u32]| -> Vec<String> { v.iter().filter_map(|i| repl.nodes.get(*i as usize).cloned()).collect() };
    tracing::warn!(node = %node.name(), from = ?names(&current), to = ?names(&want), "changing the metadata log's voters");
    if let Err(e) = log.propose_voters(&want) {
        tracing::info!(node = %node.name(), error = %e, "the change of voters was not proposed");
    }
}

/// Writes one [`Persist`], then publishes the applied state.
async fn persist(
    node: &Arc<Node>,
    store: &Arc<Mutex<LogStore>>,
    p: Box<Persist<MetaState>>,
    log: &Log<MetaState, Token>,
) {
    let applied = p.applied.0;
    let s = store.clone();
    match tokio::task::spawn_blocking(move || s.locked().persist(&p)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("cannot write the metadata log (applied {applied}): {e}"),
        // The runtime is shutting down (the daemon stops): the write may not have happened,
        // so nothing after it may go out; the task waits to be dropped with the runtime.
        Err(e) if e.is_cancelled() => std::future::pending::<()>().await,
        Err(e) => panic!("cannot write the metadata log (applied {applied}): worker failed: {e}"),
    }
    node.publish_meta(log.state().clone());
}

/// Posts one message; a snapshot's bytes are kept to be fetched.
fn send(node: &Arc<Node>, log: &mut Log<MetaState, Token>, to: u32, mut msg: Wire) {
    let Some(peer) = node.replication.nodes.get(to as usize).cloned() else {
        return;
    };
    let snapshot = psls_cluster::log::is_snapshot(&msg);
    if let Some(snap) = msg.snapshot_mut() {
        let meta = snap.get_metadata();
        let (index, term) = (meta.index, meta.term);
        let data = std::mem::take(&mut snap.data);
        let mut r = SNAPSHOT_REF.to_vec();
        r.extend((data.len() as u64).to_le_bytes());
        snap.data = r.into();
        tracing::info!(node = %node.name(), %peer, index, bytes = data.len(), "metadata snapshot offered");
        *node.replication.serving.locked() = Some((index, term, data));
    }
    let bytes = psls_cluster::log::encode_wire(&msg);
    if let Err(e) = node.net.post(&peer, &PeerReq::MetaLog(bytes), bytes::Bytes::new()) {
        tracing::debug!(node = %node.name(), %peer, error = %e, "metadata log message not sent");
        log.handle_unreachable(to);
    }
    if snapshot {
        log.handle_snapshot_sent(to);
    }
}

/// The index, term and length of a snapshot whose bytes travel apart.
fn snapshot_ref(w: &Wire) -> Option<(u64, u64, u64)> {
    let snap = w.snapshot()?;
    let len = snap.data.strip_prefix(SNAPSHOT_REF)?;
    let len = u64::from_le_bytes(<[u8; 8]>::try_from(len).ok()?);
    let meta = snap.get_metadata();
    Some((meta.index, meta.term, len))
}

/// Fetches a snapshot's bytes from its sender, then hands the whole message to the machine.
async fn fetch_snapshot(node: Arc<Node>, from: u32, mut wire: Wire, index: u64, term: u64, len: u64) {
    let repl = &node.replication;
    let result = async {
        let peer = repl.nodes.get(from as usize).cloned().ok_or("no such node")?;
        if len > MAX_SNAPSHOT_BYTES {
            return Err(format!("a snapshot of {len} bytes exceeds {MAX_SNAPSHOT_BYTES}"));
        }
        let started = std::time::Instant::now();
        let mut data = Vec::with_capacity(len as usize);
        while (data.len() as u64) < len {
            let req = PeerReq::MetaSnapshotChunk {
                index,
                term,
                offset: data.len() as u64,
            };
            let (resp, chunk) = node
                .call_data_ok(&peer, req, bytes::Bytes::new())
                .await
                .map_err(|e| e.to_string())?;
            match resp {
                PeerResp::MetaSnapshotChunk { total } if total == len && !chunk.is_empty() => {
                    data.extend_from_slice(&chunk);
                }
                other => return Err(format!("{peer} answered {other:?}")),
            }
        }
        if data.len() as u64 != len {
            return Err("the snapshot's chunks overran its length".into());
        }
        tracing::info!(node = %node.name(), %peer, index, bytes = len, ms = started.elapsed().as_millis() as u64, "metadata snapshot fetched");
        if let Some(snap) = wire.snapshot_mut() {
            snap.data = data.into();
        }
        Ok(())
    }
    .await;
    match result {
        Ok(()) => {
            let _ = repl.tx.send(Input::Msg { from, wire }).await;
        }
        Err(e) => tracing::warn!(node = %node.name(), index, error = %e, "metadata snapshot not fetched"),
    }
    let _ = repl.tx.send(Input::Fetched).await;
}
