//! Seeded simulation of the cluster's control protocols: heartbeats and the failure detector
//! ([`Membership`]), coordinator election and metadata replication ([`Replica`]).
//!
//! Each seed builds 3 to 5 voters and runs a schedule in simulated milliseconds: heartbeats
//! every 100 ms, a 1000 ms failure timeout, messages delayed by 1–80 ms and so reordered, now
//! and then delayed past the timeout (so live nodes are declared down and two nodes may both
//! believe they coordinate), submissions at whichever node leads, and crashes at any step —
//! of the coordinator too, of two nodes at once, in the middle of an election or a proposal.
//! A crashed node loses every action it had not carried out and its in-flight messages may or
//! may not arrive (a dead link drops its queue); it restarts from what it made durable, with a
//! new incarnation. Nodes also *pause* (a VM stall, swapping, a debugger: no tick, no
//! heartbeat, nothing received, for up to three failure timeouts) and wake with all their old
//! state, the messages sent to them meanwhile arriving then; and links are *cut*, one way or
//! both, for up to four timeouts (everything sent on them is lost). The coordinator declares
//! silent peers down with committed operations ([`Verdicts`]); every receiver drops messages
//! from a declared incarnation; a node that learns its verdict (from its metadata or a
//! heartbeat) rejoins at once as a new incarnation from its disk. The shell here does what
//! `psls-node` does: persist before anything later, send, answer; claim by
//! [`verdicts::should_claim`] (lease included), declare by [`Verdicts::poll_declarations`].
//!
//! After every step it checks: two nodes never hold different committed states for the same
//! sequence number (and histories are prefixes of each other); a node's committed sequence
//! number never goes back, not even across a restart; an operation answered `Ok(seq)` is the
//! `seq`-th operation of every committed history; at most one node coordinates an epoch;
//! what a live node must have on disk is on disk; every submission is answered at most once;
//! no node takes a message from an incarnation its committed metadata declared down; no
//! operation is acknowledged by an incarnation that a committed state up to it declared down
//! (a fenced coordinator commits nothing).
//! At the end it stops the chaos, restarts every node and checks liveness: one coordinator,
//! every node at the same committed state, a new operation committed, every submission to a
//! node that did not crash answered, no node fenced.
//!
//! `PSLS_SIM_SEED=N` runs one seed (with `PSLS_SIM_TRACE=1`, every event); `PSLS_SIM_SEEDS=N`
//! runs N seeds from 0. A failing seed prints itself.

mod common;

use psls_cluster::membership::Membership;
use psls_cluster::meta::{Action, Durable, Epoch, Msg, ReplError, Replica, Replicated};
use psls_cluster::verdicts::{self, Verdicts};
use psls_svm::rng::SplitMix64;
use std::collections::{BTreeMap, BTreeSet};

/// An operation: a number (odd numbers above 1000 are refused, so rejections happen), or a
/// down verdict on a node's incarnation (as `MetaOp::DeclareDown`).
#[derive(Clone, Debug, PartialEq)]
enum Op {
    Num(u64),
    Down(String, u64),
}

/// A log of operations, and the verdicts they committed.
#[derive(Clone, Debug, Default, PartialEq)]
struct Log(Vec<Op>, BTreeMap<String, u64>);

impl Replicated for Log {
    type Op = Op;
    type Error = String;
    fn seq(&self) -> u64 {
        self.0.len() as u64
    }
    fn apply(&mut self, op: &Op) -> Result<(), String> {
        match op {
            Op::Num(n) if *n > 1000 && n % 2 == 1 => return Err(format!("{n} refused")),
            Op::Num(_) => {}
            Op::Down(p, inc) => {
                let e = self.1.entry(p.clone()).or_insert(0);
                *e = (*e).max(*inc);
            }
        }
        self.0.push(op.clone());
        Ok(())
    }
}

const HEARTBEAT_MS: u64 = 100;
const TIMEOUT_MS: u64 = 1000;
const STEPS: usize = 1500;

enum Wire {
    Heartbeat {
        incarnation: u64,
        seq: u64,
        down: Vec<(String, u64)>,
        heard: Vec<(String, u64)>,
        /// The sender claims or leads an epoch.
        claims: bool,
    },
    Meta(Msg<Log>),
}

struct InFlight {
    at_ms: u64,
    from: u32,
    from_inc: u64,
    to: u32,
    wire: Wire,
}

struct Node {
    up: bool,
    incarnation: u64,
    replica: Replica<Log, u64>,
    disk: Durable<Log>,
    /// The failure detector; a heartbeat carries whether its sender claims or leads.
    members: Membership<bool>,
    verdicts: Verdicts,
    /// Paused (stopped, state kept) until then.
    paused_until_ms: u64,
    next_heartbeat_ms: u64,
    restart_at_ms: u64,
    /// Highest committed sequence number this node ever held (memory or disk).
    high_seq: u64,
    /// The live voters this node's machine was last told of.
    live_view: Vec<u32>,
}

struct World {
    seed: u64,
    rng: SplitMix64,
    now_ms: u64,
    nodes: Vec<Node>,
    net: Vec<InFlight>,
    /// Sequence number → the one committed state for it.
    chosen: BTreeMap<u64, Log>,
    /// Epoch → the node that led it.
    leaders: BTreeMap<Epoch, u32>,
    /// Token → (node it was submitted to, that node's incarnation, op, answered).
    tokens: BTreeMap<u64, (u32, u64, Op, bool)>,
    /// Tokens of down verdicts: token → the peer declared.
    declaring: BTreeMap<u64, String>,
    /// Directed links cut until then: everything sent on them is lost.
    cut_until_ms: BTreeMap<(u32, u32), u64>,
    verdicts_committed: u64,
    /// Metadata messages dropped because their sender's incarnation was declared down.
    fenced_drops: u64,
    fences: u64,
    pauses: u64,
    cuts: u64,
    next_token: u64,
    /// Directed links that delay every message past the failure timeout until then: the
    /// receiver declares a live sender down.
    slow_until_ms: BTreeMap<(u32, u32), u64>,
    /// Steps at which two live nodes both led (each in its own epoch).
    dual_leader_steps: u64,
    committed_ops: u64,
    rejected: u64,
    interrupted: u64,
    trace: bool,
}

fn name(i: u32) -> String {
    format!("v{i}")
}

fn empty() -> Durable<Log> {
    Durable {
        promised: Epoch::default(),
        committed: Log::default(),
        accepted: None,
    }
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = SplitMix64::new(seed);
        let n = 3 + rng.below(3) as u32;
        let nodes = (0..n)
            .map(|i| Node {
                up: true,
                incarnation: 1,
                replica: Replica::new(i, n, empty()),
                disk: empty(),
                members: Membership::new((0..n).filter(|&j| j != i).map(name), TIMEOUT_MS, 0),
                verdicts: Verdicts::new(name(i), 1),
                paused_until_ms: 0,
                next_heartbeat_ms: 0,
                restart_at_ms: 0,
                high_seq: 0,
                live_view: (0..n).collect(),
            })
            .collect();
        World {
            seed,
            rng,
            now_ms: 0,
            nodes,
            net: Vec::new(),
            chosen: BTreeMap::new(),
            leaders: BTreeMap::new(),
            tokens: BTreeMap::new(),
            declaring: BTreeMap::new(),
            cut_until_ms: BTreeMap::new(),
            verdicts_committed: 0,
            fenced_drops: 0,
            fences: 0,
            pauses: 0,
            cuts: 0,
            next_token: 0,
            slow_until_ms: BTreeMap::new(),
            dual_leader_steps: 0,
            committed_ops: 0,
            rejected: 0,
            interrupted: 0,
            trace: std::env::var_os("PSLS_SIM_TRACE").is_some(),
        }
    }

    fn fail(&self, what: String) -> ! {
        panic!("cluster simulation seed {} at {} ms: {what}", self.seed, self.now_ms);
    }

    fn n(&self) -> u32 {
        self.nodes.len() as u32
    }

    fn delay_ms(&mut self, chaos: bool, from: u32, to: u32) -> u64 {
        let slow = self.slow_until_ms.get(&(from, to)).is_some_and(|&t| t > self.now_ms);
        if chaos && (slow || self.rng.chance(15)) {
            1200 + self.rng.below(1300)
        } else {
            1 + self.rng.below(80)
        }
    }

    /// Sends on the link `from` → `to`, unless it is cut.
    fn send(&mut self, chaos: bool, from: u32, from_inc: u64, to: u32, wire: Wire) {
        if chaos && self.cut_until_ms.get(&(from, to)).is_some_and(|&t| t > self.now_ms) {
            return;
        }
        let at_ms = self.now_ms + self.delay_ms(chaos, from, to);
        self.net.push(InFlight {
            at_ms,
            from,
            from_inc,
            to,
            wire,
        });
    }

    /// What the daemon does at every install: reads the committed verdicts, and fences itself
    /// (rejoins from its disk as a new incarnation) when one names this incarnation.
    fn install_verdicts(&mut self, i: u32) {
        let node = &mut self.nodes[i as usize];
        let down = node.replica.committed().1.clone();
        node.verdicts.handle_committed(&down);
        self.maybe_fence(i);
    }

    fn maybe_fence(&mut self, i: u32) {
        if let Some(f) = self.nodes[i as usize].verdicts.poll_fence() {
            if self.trace {
                eprintln!("{} FENCE v{i}: {f:?}", self.now_ms);
            }
            self.fences += 1;
            self.crash(i);
            self.restart(i);
        }
    }

    /// Carries out node `i`'s actions in order, as the daemon does.
    fn run_actions(&mut self, i: u32, chaos: bool) {
        for _ in 0..100_000 {
            let Some(a) = self.nodes[i as usize].replica.poll_action() else {
                let node = &self.nodes[i as usize];
                if node.replica.durable() != node.disk.clone().normalized() {
                    self.fail(format!("v{i} changed durable state without asking to persist it"));
                }
                self.install_verdicts(i);
                return;
            };
            match a {
                Action::PersistVote { promised, accepted } => {
                    let d = &mut self.nodes[i as usize].disk;
                    d.promised = promised;
                    d.accepted = accepted;
                }
                Action::PersistCommitted(s) => {
                    let node = &mut self.nodes[i as usize];
                    if s.seq() < node.disk.committed.seq() {
                        self.fail(format!("v{i} persisted an older committed state"));
                    }
                    node.disk.committed = s;
                }
                Action::Send { to, msg } => {
                    if self.trace {
                        eprintln!("{} v{i} -> v{to}: {msg:?}", self.now_ms);
                    }
                    let from_inc = self.nodes[i as usize].incarnation;
                    self.send(chaos, i, from_inc, to, Wire::Meta(msg));
                }
                Action::Done { token, result } => {
                    if self.trace {
                        eprintln!("{} v{i} answers {token}: {result:?}", self.now_ms);
                    }
                    let Some(t) = self.tokens.get_mut(&token) else {
                        self.fail(format!("answer to unknown submission {token}"));
                    };
                    if t.3 {
                        self.fail(format!("submission {token} answered twice"));
                    }
                    t.3 = true;
                    let op = t.2.clone();
                    if let Some(peer) = self.declaring.remove(&token) {
                        self.nodes[i as usize].verdicts.handle_declared(&peer);
                        if result.is_ok() {
                            self.verdicts_committed += 1;
                        }
                    }
                    match result {
                        Ok(seq) => {
                            self.committed_ops += 1;
                            let state = self.nodes[i as usize].replica.committed().clone();
                            self.record(i, &state);
                            let Some(s) = self.chosen.get(&seq) else {
                                self.fail(format!("v{i} acknowledged seq {seq} that no node committed"));
                            };
                            if s.0.get(seq as usize - 1) != Some(&op) {
                                self.fail(format!(
                                    "submission {token} ({op:?}) acknowledged at seq {seq} holding {s:?}"
                                ));
                            }
                            let inc = self.nodes[i as usize].incarnation;
                            if s.1.get(&name(i)).is_some_and(|&d| d >= inc) {
                                self.fail(format!(
                                    "v{i} (incarnation {inc}) acknowledged seq {seq} after its verdict: {s:?}"
                                ));
                            }
                            // Answered only once every node it takes as live has it.
                            for v in self.nodes[i as usize].live_view.clone() {
                                let n = &self.nodes[v as usize];
                                let has = if n.up {
                                    n.replica.committed().seq()
                                } else {
                                    n.disk.committed.seq()
                                };
                                if has < seq {
                                    self.fail(format!(
                                        "submission {token} answered at seq {seq} while live v{v} is at {has}"
                                    ));
                                }
                            }
                        }
                        Err(ReplError::Rejected(_)) => {
                            self.rejected += 1;
                            if !matches!(op, Op::Num(n) if n > 1000 && n % 2 == 1) {
                                self.fail(format!("valid op {op:?} rejected"));
                            }
                        }
                        Err(ReplError::Interrupted) => self.interrupted += 1,
                        Err(_) => {}
                    }
                }
            }
        }
        self.fail(format!("v{i} produced actions without end"));
    }

    /// Records a committed state: the first one for its seq is the one every other must equal,
    /// and histories must be prefixes of each other.
    fn record(&mut self, i: u32, s: &Log) {
        let seq = s.seq();
        if seq == 0 {
            return;
        }
        match self.chosen.get(&seq) {
            Some(c) if c != s => self.fail(format!("v{i} committed {s:?} at seq {seq}, another node {c:?}")),
            Some(_) => {}
            None => {
                for (&other, c) in self.chosen.range(..seq).next_back().into_iter() {
                    if s.0[..other as usize] != c.0[..] {
                        self.fail(format!("v{i}'s history {s:?} does not extend seq {other}'s {c:?}"));
                    }
                }
                if let Some((&other, c)) = self.chosen.range(seq + 1..).next() {
                    if c.0[..seq as usize] != s.0[..] {
                        self.fail(format!("v{i}'s history {s:?} is not a prefix of seq {other}'s {c:?}"));
                    }
                }
                self.chosen.insert(seq, s.clone());
            }
        }
    }

    fn check(&mut self) {
        let leading = (0..self.n())
            .filter(|&i| self.nodes[i as usize].up && self.nodes[i as usize].replica.leading().is_some())
            .count();
        if leading > 1 {
            self.dual_leader_steps += 1;
        }
        for i in 0..self.n() {
            let node = &self.nodes[i as usize];
            let (mem, disk) = (node.replica.committed().clone(), node.disk.committed.clone());
            let seq = if node.up { mem.seq() } else { disk.seq() };
            if seq < node.high_seq {
                self.fail(format!(
                    "v{i}'s committed seq went back from {} to {seq}",
                    node.high_seq
                ));
            }
            self.nodes[i as usize].high_seq = seq;
            self.record(i, &disk);
            if self.nodes[i as usize].up {
                self.record(i, &mem);
                if let Some(e) = self.nodes[i as usize].replica.leading() {
                    match self.leaders.insert(e, i) {
                        Some(other) if other != i => self.fail(format!("v{other} and v{i} both led epoch {e:?}")),
                        _ => {}
                    }
                }
            }
        }
    }

    /// The voters node `i`'s failure detector takes as live (itself included).
    fn live_in_view(&self, i: u32) -> Vec<u32> {
        let node = &self.nodes[i as usize];
        (0..self.n())
            .filter(|&j| j == i || node.members.is_live(self.now_ms, &name(j)))
            .collect()
    }

    /// The daemon's claim rule ([`verdicts::should_claim`]).
    fn coordinator_in_view(&self, i: u32, lease: bool) -> bool {
        let node = &self.nodes[i as usize];
        let live = |j: u32| node.members.is_live(self.now_ms, &name(j));
        let names: Vec<String> = (0..self.n()).filter(|&j| j == i || live(j)).map(name).collect();
        let view = verdicts::ClaimView {
            fencing: node.verdicts.is_fenced(),
            lease_held: lease,
            claiming: node.replica.claimed().is_some(),
            other_claims: (0..self.n())
                .any(|j| j != i && live(j) && node.members.heartbeat(&name(j)).copied().unwrap_or(false)),
        };
        verdicts::should_claim(&name(i), view, names.iter().map(String::as_str))
    }

    fn crash(&mut self, i: u32) {
        if self.trace {
            eprintln!("{} CRASH v{i}", self.now_ms);
        }
        let down_ms = 200 + self.rng.below(3000);
        let node = &mut self.nodes[i as usize];
        node.up = false;
        node.restart_at_ms = self.now_ms + down_ms;
        // The dead link drops what it had not sent yet; what was on the wire may arrive.
        let inc = node.incarnation;
        let mut keep = Vec::new();
        for m in std::mem::take(&mut self.net) {
            if m.from == i && m.from_inc == inc && self.rng.chance(500) {
                continue;
            }
            keep.push(m);
        }
        self.net = keep;
    }

    fn restart(&mut self, i: u32) {
        if self.trace {
            eprintln!("{} RESTART v{i}", self.now_ms);
        }
        let n = self.n();
        let now_ms = self.now_ms;
        let node = &mut self.nodes[i as usize];
        node.up = true;
        node.incarnation += 1;
        node.replica = Replica::new(i, n, node.disk.clone());
        node.members = Membership::new((0..n).filter(|&j| j != i).map(name), TIMEOUT_MS, now_ms);
        node.verdicts = Verdicts::new(name(i), node.incarnation);
        node.paused_until_ms = 0;
        node.next_heartbeat_ms = now_ms;
        self.install_verdicts(i);
    }

    fn deliver(&mut self, mut m: InFlight, chaos: bool) {
        let to = m.to as usize;
        if !self.nodes[to].up {
            return;
        }
        // A restarted sender's old connection is gone: its late messages are dropped.
        if self.nodes[m.from as usize].incarnation != m.from_inc {
            return;
        }
        // A paused receiver takes its messages when it wakes (they wait in its socket), while
        // it already runs its own ticks.
        if self.nodes[to].paused_until_ms > self.now_ms {
            m.at_ms = self.nodes[to].paused_until_ms + self.rng.below(150);
            self.net.push(m);
            return;
        }
        let from = name(m.from);
        match m.wire {
            Wire::Heartbeat {
                incarnation,
                seq,
                down,
                heard,
                claims,
            } => {
                let now_ms = self.now_ms;
                let node = &mut self.nodes[to];
                let down = down.iter().map(|(p, d)| (p.as_str(), *d));
                let heard = heard.iter().map(|(p, i)| (p.as_str(), *i));
                if node.verdicts.handle_heartbeat(&from, incarnation, down, heard) {
                    node.members.heard(now_ms, &from, incarnation, claims);
                    node.replica.peer_seq(m.from, seq);
                }
                self.maybe_fence(m.to);
                if !self.nodes[to].up {
                    return;
                }
            }
            Wire::Meta(msg) => {
                let node = &self.nodes[to];
                if !node.verdicts.accepts(&from, m.from_inc) {
                    if self.trace {
                        eprintln!("{} v{} drops from fenced v{}: {msg:?}", self.now_ms, m.to, m.from);
                    }
                    self.fenced_drops += 1;
                    return;
                }
                // Checked apart from the machine: the committed metadata's own verdicts.
                if node.replica.committed().1.get(&from).is_some_and(|&d| d >= m.from_inc) {
                    self.fail(format!(
                        "v{} took a message from v{} incarnation {}, declared down",
                        m.to, m.from, m.from_inc
                    ));
                }
                if self.trace {
                    eprintln!("{} v{} <- v{}: {msg:?}", self.now_ms, m.to, m.from);
                }
                self.nodes[to].replica.receive(m.from, msg);
            }
        }
        self.run_actions(m.to, chaos);
    }

    /// One step: time passes, due messages arrive, nodes tick, maybe a crash or a submission.
    fn step(&mut self, chaos: bool) {
        self.now_ms += 1 + self.rng.below(40);
        let now_ms = self.now_ms;
        // Deliver what is due, in a random order among them (reordering).
        let mut due: Vec<InFlight> = Vec::new();
        let mut later = Vec::new();
        for m in std::mem::take(&mut self.net) {
            if m.at_ms <= now_ms {
                due.push(m);
            } else {
                later.push(m);
            }
        }
        self.net = later;
        while !due.is_empty() {
            let k = self.rng.below(due.len() as u64) as usize;
            let m = due.swap_remove(k);
            self.deliver(m, chaos);
        }
        for i in 0..self.n() {
            if !self.nodes[i as usize].up {
                if chaos && now_ms >= self.nodes[i as usize].restart_at_ms {
                    self.restart(i);
                    if !self.nodes[i as usize].up {
                        continue;
                    }
                } else {
                    continue;
                }
            }
            if self.nodes[i as usize].paused_until_ms > now_ms {
                continue;
            }
            if now_ms >= self.nodes[i as usize].next_heartbeat_ms {
                self.nodes[i as usize].next_heartbeat_ms = now_ms + HEARTBEAT_MS;
                let node = &self.nodes[i as usize];
                let (inc, seq) = (node.incarnation, node.replica.committed().seq());
                let claims = node.replica.claimed().is_some();
                let down: Vec<(String, u64)> = node.verdicts.committed().iter().map(|(p, d)| (p.clone(), *d)).collect();
                let heard: Vec<(String, u64)> = (0..self.n())
                    .filter_map(|j| {
                        node.members
                            .view(&name(j))
                            .and_then(|v| v.incarnation)
                            .map(|x| (name(j), x))
                    })
                    .collect();
                for j in 0..self.n() {
                    if j != i {
                        let wire = Wire::Heartbeat {
                            incarnation: inc,
                            seq,
                            down: down.clone(),
                            heard: heard.clone(),
                            claims,
                        };
                        self.send(chaos, i, inc, j, wire);
                    }
                }
            }
            // The daemon's tick: the detector (its stall hysteresis), the lease, the claim.
            let silent = self.nodes[i as usize].members.tick(now_ms);
            let lease = self.nodes[i as usize].members.lease_held(now_ms);
            let coord = self.coordinator_in_view(i, lease);
            let live = self.live_in_view(i);
            self.nodes[i as usize].replica.set_live(live.iter().copied());
            self.nodes[i as usize].live_view = live;
            self.nodes[i as usize].replica.tick(now_ms, coord);
            self.run_actions(i, chaos);
            if !self.nodes[i as usize].up {
                continue;
            }
            // The coordinator turns silences past the timeout into verdicts.
            let node = &mut self.nodes[i as usize];
            let coordinating = node.replica.leading().is_some() && lease;
            let suspects: Vec<(String, u64)> = silent
                .into_iter()
                .map(|(p, _)| {
                    let inc = node.members.view(&p).and_then(|v| v.incarnation).unwrap_or(0);
                    (p, inc)
                })
                .collect();
            for (peer, inc) in node.verdicts.poll_declarations(coordinating, suspects) {
                if self.trace {
                    eprintln!("{now_ms} v{i} declares {peer} incarnation {inc} down");
                }
                let token = self.next_token;
                self.next_token += 1;
                let op = Op::Down(peer.clone(), inc);
                self.tokens
                    .insert(token, (i, self.nodes[i as usize].incarnation, op.clone(), false));
                self.declaring.insert(token, peer);
                self.nodes[i as usize].replica.submit(token, op);
                self.run_actions(i, chaos);
                if !self.nodes[i as usize].up {
                    break;
                }
            }
        }
        if chaos {
            // A slow link: one node, or a pair both ways, stops hearing another in time.
            if self.rng.chance(6) {
                let (a, b) = (
                    self.rng.below(self.n() as u64) as u32,
                    self.rng.below(self.n() as u64) as u32,
                );
                let until_ms = now_ms + 500 + self.rng.below(3000);
                if a != b {
                    self.slow_until_ms.insert((a, b), until_ms);
                    if self.rng.chance(500) {
                        self.slow_until_ms.insert((b, a), until_ms);
                    }
                }
            }
            // A pause: the process stops, state kept, for up to three failure timeouts.
            if self.rng.chance(10) {
                let i = self.rng.below(self.n() as u64) as u32;
                if self.nodes[i as usize].up && self.nodes[i as usize].paused_until_ms <= now_ms {
                    let until_ms = now_ms + 200 + self.rng.below(3 * TIMEOUT_MS);
                    if self.trace {
                        eprintln!("{now_ms} PAUSE v{i} until {until_ms}");
                    }
                    self.nodes[i as usize].paused_until_ms = until_ms;
                    self.pauses += 1;
                }
            }
            // A cut link, one way or both: what is sent on it is lost.
            if self.rng.chance(10) {
                let (a, b) = (
                    self.rng.below(self.n() as u64) as u32,
                    self.rng.below(self.n() as u64) as u32,
                );
                if a != b {
                    let until_ms = now_ms + 300 + self.rng.below(4 * TIMEOUT_MS);
                    self.cut_until_ms.insert((a, b), until_ms);
                    if self.rng.chance(500) {
                        self.cut_until_ms.insert((b, a), until_ms);
                    }
                    self.cuts += 1;
                }
            }
            // A node cut off from every other, both ways (the coordinator half the time).
            if self.rng.chance(3) {
                let leader = (0..self.n())
                    .find(|&i| self.nodes[i as usize].up && self.nodes[i as usize].replica.leading().is_some());
                let a = match leader {
                    Some(l) if self.rng.chance(500) => l,
                    _ => self.rng.below(self.n() as u64) as u32,
                };
                let until_ms = now_ms + 500 + self.rng.below(3 * TIMEOUT_MS);
                for b in (0..self.n()).filter(|&b| b != a) {
                    self.cut_until_ms.insert((a, b), until_ms);
                    self.cut_until_ms.insert((b, a), until_ms);
                }
                self.cuts += 1;
            }
            if self.rng.chance(8) {
                let i = self.rng.below(self.n() as u64) as u32;
                if self.nodes[i as usize].up {
                    self.crash(i);
                }
                // Now and then a second node at the same instant.
                if self.rng.chance(200) {
                    let j = (i + 1) % self.n();
                    if self.nodes[j as usize].up {
                        self.crash(j);
                    }
                }
            }
            // The coordinator, often in the middle of a proposal.
            if self.rng.chance(4) {
                if let Some(i) = (0..self.n())
                    .find(|&i| self.nodes[i as usize].up && self.nodes[i as usize].replica.leading().is_some())
                {
                    self.crash(i);
                }
            }
        }
        if chaos && self.rng.chance(150) {
            self.submit_somewhere();
        }
        self.check();
    }

    fn submit_somewhere(&mut self) {
        let leaders: Vec<u32> = (0..self.n())
            .filter(|&i| self.nodes[i as usize].up && self.nodes[i as usize].replica.leading().is_some())
            .collect();
        // Mostly to a leader; sometimes to anyone (who must refuse it).
        let i = if !leaders.is_empty() && !self.rng.chance(100) {
            leaders[self.rng.below(leaders.len() as u64) as usize]
        } else {
            self.rng.below(self.n() as u64) as u32
        };
        if !self.nodes[i as usize].up || self.nodes[i as usize].paused_until_ms > self.now_ms {
            return;
        }
        let op = Op::Num(if self.rng.chance(100) {
            1001 + 2 * self.rng.below(100)
        } else {
            self.rng.below(1000)
        });
        let token = self.next_token;
        self.next_token += 1;
        self.tokens
            .insert(token, (i, self.nodes[i as usize].incarnation, op.clone(), false));
        self.nodes[i as usize].replica.submit(token, op);
        self.run_actions(i, true);
    }
}

/// What a seed did.
#[derive(Default)]
struct Counts {
    committed: u64,
    rejected: u64,
    interrupted: u64,
    dual: u64,
    verdicts: u64,
    fenced_drops: u64,
    fences: u64,
    pauses: u64,
    cuts: u64,
}

fn run_seed(seed: u64) -> Counts {
    let mut w = World::new(seed);
    for _ in 0..STEPS {
        w.step(true);
    }
    // Calm: every node back and awake, no more crashes, cuts or long delays.
    for i in 0..w.n() {
        w.nodes[i as usize].paused_until_ms = 0;
        if !w.nodes[i as usize].up {
            w.restart(i);
        }
    }
    w.cut_until_ms.clear();
    let calm_from_ms = w.now_ms;
    let mut settled = false;
    for _ in 0..2000 {
        w.step(false);
        let leaders: Vec<u32> = (0..w.n())
            .filter(|&i| w.nodes[i as usize].replica.leading().is_some())
            .collect();
        let seqs: BTreeSet<u64> = w.nodes.iter().map(|n| n.replica.committed().seq()).collect();
        if leaders.len() == 1
            && seqs.len() == 1
            && !w.nodes[leaders[0] as usize].replica.busy()
            && w.now_ms > calm_from_ms + 3 * TIMEOUT_MS
        {
            settled = true;
            break;
        }
    }
    if !settled {
        w.fail("the cluster did not settle on one coordinator and one committed state".into());
    }
    // A last operation commits everywhere, submitted as the daemon's callers do: to the
    // leader, again if the leader changed under it (a claim still pending from the chaos may
    // preempt a leader that looked settled).
    let from_seq = w.nodes.iter().map(|n| n.replica.committed().seq()).max().unwrap_or(0);
    let reached = |w: &World| {
        w.nodes.iter().all(|n| {
            let log = &n.replica.committed().0;
            log.len() as u64 > from_seq && log[from_seq as usize..].contains(&Op::Num(7))
        })
    };
    for _attempt in 0..10 {
        let Some(leader) = (0..w.n()).find(|&i| w.nodes[i as usize].replica.leading().is_some()) else {
            for _ in 0..50 {
                w.step(false);
            }
            continue;
        };
        let token = w.next_token;
        w.next_token += 1;
        w.tokens
            .insert(token, (leader, w.nodes[leader as usize].incarnation, Op::Num(7), false));
        w.nodes[leader as usize].replica.submit(token, Op::Num(7));
        w.run_actions(leader, false);
        for _ in 0..300 {
            w.step(false);
            if w.tokens.get(&token).is_some_and(|t| t.3) && reached(&w) {
                break;
            }
        }
        if reached(&w) {
            break;
        }
    }
    if !reached(&w) {
        w.fail(format!(
            "the last operation did not reach every node (after seq {from_seq})"
        ));
    }
    // Every submission to a node that did not crash since was answered.
    for (token, (i, inc, _, answered)) in &w.tokens {
        if !answered && w.nodes[*i as usize].incarnation == *inc {
            w.fail(format!("submission {token} to v{i} was never answered"));
        }
    }
    Counts {
        committed: w.committed_ops,
        rejected: w.rejected,
        interrupted: w.interrupted,
        dual: w.dual_leader_steps,
        verdicts: w.verdicts_committed,
        fenced_drops: w.fenced_drops,
        fences: w.fences,
        pauses: w.pauses,
        cuts: w.cuts,
    }
}

#[test]
fn random_schedules_keep_the_metadata_agreed_and_durable() {
    let seeds = common::seeds(3000);
    let count = seeds.end - seeds.start;
    let mut t = Counts::default();
    for seed in seeds {
        let c = run_seed(seed);
        t.committed += c.committed;
        t.rejected += c.rejected;
        t.interrupted += c.interrupted;
        t.dual += c.dual;
        t.verdicts += c.verdicts;
        t.fenced_drops += c.fenced_drops;
        t.fences += c.fences;
        t.pauses += c.pauses;
        t.cuts += c.cuts;
    }
    let (ok, rejected, interrupted, dual) = (t.committed, t.rejected, t.interrupted, t.dual);
    eprintln!(
        "{count} seeds: {ok} operations committed, {rejected} rejected, {interrupted} interrupted, \
         {dual} steps with two coordinators; {} pauses, {} cut links, {} down verdicts committed, \
         {} nodes fenced themselves, {} messages of fenced incarnations dropped",
        t.pauses, t.cuts, t.verdicts, t.fences, t.fenced_drops
    );
    if count >= 100 {
        // The schedules must do real work and really exercise the failure paths.
        assert!(ok > count * 5, "only {ok} operations committed over {count} seeds");
        assert!(rejected > 0, "no invalid operation was ever rejected");
        assert!(
            interrupted > 0,
            "no operation was ever interrupted by a coordinator change"
        );
        assert!(dual > 0, "two nodes never believed they coordinated at once");
        assert!(
            t.verdicts > count,
            "only {} down verdicts over {count} seeds",
            t.verdicts
        );
        assert!(t.fences > count, "only {} fenced nodes over {count} seeds", t.fences);
        assert!(
            t.fenced_drops > 0,
            "no message of a fenced incarnation was ever dropped"
        );
    }
}
