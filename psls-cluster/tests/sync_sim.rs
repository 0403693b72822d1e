//! Seeded simulation of barriers and locks ([`SyncState`] at the coordinator, [`Waits`] on
//! every node) through coordinator changes, shaped like `psls-node`'s shell (`sync.rs`).
//!
//! Each seed runs 3 or 4 nodes with ranks of one job; ranks take and release two locks and
//! meet at barriers. Messages are delayed and reordered between pairs but kept in order within
//! a pair (the message link is FIFO), and dropped with a dead or restarted end.
//!
//! Failures, as the daemon meets them: nodes crash at any step (the coordinator too, and two
//! at once) and restart with a new incarnation; nodes *pause* (no step, no delivery, for up to
//! three failure timeouts) and wake with their old state, their queued messages and news
//! arriving while they already act; links are *cut*, one way (what the node sends is lost, or
//! what it is sent) or both, for up to three timeouts. The metadata is modelled by its
//! outcomes: a node silent to the others for a failure timeout is replaced as the metadata's
//! leader by the lowest node that can talk both ways (a new epoch; the news reaches each node
//! at its own time), and the leader, holding its lease, commits a down verdict on every node
//! silent past the timeout (news again; a restarted node catches up at once). Each node picks
//! its coordinator with the daemon's rule ([`verdicts::coordinator`]: the leader it knows, and
//! itself only while it holds its lease — lost by a node that heard nobody for a timeout, and
//! back shortly after it hears again), drops messages from incarnations it knows declared down
//! ([`Verdicts::accepts`]), awaits and forgets nodes by its verdicts, and fences itself (rejoins
//! as a new incarnation) on learning its own verdict. When a node with ranks dies or is
//! declared down, the launcher ends the job (every rank leaves; the ranks of a declared node
//! that has not learnt it yet run on, doomed) and starts a new one on the nodes not declared.
//! The shell here does what the daemon's does: a coordinator is known by name and incarnation;
//! a node sends its report before its first call to a coordinator and when its sweep sees a
//! new one; a recovering coordinator asks the nodes it awaits again.
//!
//! After every step it checks: no lock has two holders among the ranks of nodes not declared
//! down (a declared node's ranks are doomed: the job rolls back and every node drops their
//! messages), even when a coordinator declared down but not yet told grants a lock to a rank
//! of a node that has not learnt the verdict either (it happens; counted); no node takes a
//! message from an incarnation it knows declared down; at most one node grants in an epoch; a rank passes a barrier only when every rank of its job has
//! arrived at it, and passes it once; every call is answered at most once. At the end (no more
//! failures) every call of a live rank is answered and the ranks go on.
//! `PSLS_SIM_SEED=N` runs one seed, `PSLS_SIM_SEEDS=N` runs N; a failing seed prints itself.

mod common;

use psls_cluster::sync::{node_of, Call, CallKind, SyncError, SyncState, Waits};
use psls_cluster::verdicts::{self, Verdicts};
use psls_svm::rng::SplitMix64;
use std::collections::{BTreeMap, BTreeSet};

const STEPS: usize = 3000;
const SWEEP_MS: u64 = 100;
const TIMEOUT_MS: u64 = 1000;

/// What a node learns from heartbeats and the metadata, at its own time.
#[derive(Clone, Debug)]
enum News {
    /// A new metadata epoch and its leader.
    Leader(String, u64),
    /// A committed down verdict on an incarnation.
    Verdict(String, u64),
}

#[derive(Clone, Debug)]
enum Wire {
    Call(Call),
    Report(Vec<(String, String)>),
    Ask,
    Notice(String, String, u64, Result<(), SyncError>),
}

#[derive(Clone, Debug, PartialEq)]
enum RankState {
    Idle,
    Waiting { kind: CallKind, key: String },
    Holding { key: String, until_step: usize },
}

struct Rank {
    who: String,
    job: u64,
    state: RankState,
    /// Barrier generation this rank arrives at next.
    next_barrier: u64,
    calls: u64,
}

struct Node {
    name: String,
    up: bool,
    incarnation: u64,
    /// The incarnation this node last heard of every node.
    incs: BTreeMap<String, u64>,
    /// The metadata's leader as this node knows it, with its epoch.
    leader: Option<(String, u64)>,
    verdicts: Verdicts,
    paused_until_ms: u64,
    /// Cut until then: what it sends is lost (out), what it is sent is lost (in).
    cut_out_until_ms: u64,
    cut_in_until_ms: u64,
    /// Since when the others have not heard it (crashed, paused, or sending on a cut link).
    silent_since_ms: Option<u64>,
    /// Since when it has heard nobody (paused, or receiving on a cut link).
    deaf_since_ms: Option<u64>,
    /// Its lease is back then (it hears a majority again after a deafness past the timeout).
    lease_back_ms: u64,
    waits: Waits<()>,
    coord_seen: Option<String>,
    state: SyncState,
    ranks: Vec<Rank>,
    next_sweep_ms: u64,
}

struct Msg {
    at_ms: u64,
    from: String,
    from_inc: u64,
    to: String,
    to_inc: u64,
    wire: Wire,
}

struct World {
    seed: u64,
    rng: SplitMix64,
    now_ms: u64,
    step: usize,
    nodes: Vec<Node>,
    net: Vec<Msg>,
    /// Last delivery time per (from, to): the link is FIFO.
    last_at: BTreeMap<(String, String), u64>,
    /// News on the way: (at, to, what).
    news: Vec<(u64, String, News)>,
    /// The metadata's leader (node index) and epoch.
    meta: Option<(usize, u64)>,
    /// Committed verdicts: node → highest incarnation declared down.
    committed_down: BTreeMap<String, u64>,
    /// Epoch → the node that granted in it.
    granters: BTreeMap<u64, String>,
    job: u64,
    /// Ranks of each job.
    job_ranks: BTreeMap<u64, BTreeSet<String>>,
    /// (job, barrier generation) → ranks that arrived.
    arrivals: BTreeMap<(u64, u64), BTreeSet<String>>,
    passed: BTreeSet<(String, u64)>,
    next_pid: u64,
    end_job_at_ms: Option<u64>,
    grants: u64,
    barriers_passed: u64,
    takeovers: u64,
    pauses: u64,
    cuts: u64,
    verdicts: u64,
    fences: u64,
    fenced_drops: u64,
    /// Grants made by a coordinator whose incarnation was declared down (it had not learnt it).
    doomed_grants: u64,
    /// Such grants taken by a rank of a node not declared down.
    late_grants: u64,
    trace: bool,
}

fn lock_key(job: u64, k: u64) -> String {
    format!("0:j{job}:lock{k}")
}

fn barrier_key(job: u64, g: u64) -> String {
    format!("0:j{job}:b{g}")
}

impl World {
    fn fail(&self, what: String) -> ! {
        panic!(
            "sync simulation seed {} at {} ms (step {}): {what}",
            self.seed, self.now_ms, self.step
        );
    }

    fn idx(&self, name: &str) -> usize {
        self.nodes.iter().position(|n| n.name == name).expect("known node")
    }

    fn n(&self) -> usize {
        self.nodes.len()
    }

    fn paused(&self, i: usize) -> bool {
        self.nodes[i].paused_until_ms > self.now_ms
    }

    /// Whether node `i` runs and can both send and receive.
    fn reachable(&self, i: usize) -> bool {
        let n = &self.nodes[i];
        n.up && !self.paused(i) && n.cut_out_until_ms <= self.now_ms && n.cut_in_until_ms <= self.now_ms
    }

    /// The daemon's lease: it heard a majority within the timeout.
    fn lease_held(&self, i: usize) -> bool {
        let n = &self.nodes[i];
        let deaf_long = n.deaf_since_ms.is_some_and(|t| self.now_ms - t > TIMEOUT_MS);
        !deaf_long && self.now_ms >= n.lease_back_ms
    }

    /// Whether node `i` takes `peer` (at the incarnation it heard) as declared down.
    fn declared_in_view(&self, i: usize, peer: &str) -> bool {
        let n = &self.nodes[i];
        peer != n.name && !n.verdicts.accepts(peer, n.incs.get(peer).copied().unwrap_or(0))
    }

    /// Whether node `i`'s current incarnation was declared down (committed).
    fn declared(&self, i: usize) -> bool {
        let n = &self.nodes[i];
        self.committed_down.get(&n.name).is_some_and(|&d| d >= n.incarnation)
    }

    /// The coordinator in node `i`'s view (the daemon's rule): (name,
    /// name#incarnation@epoch). The identity changes with the epoch: a node that leads again
    /// in a later epoch starts again from a take-over, and the waits sent to it before fail.
    fn coordinator(&self, i: usize) -> Option<(String, String)> {
        let n = &self.nodes[i];
        let leader = n.leader.as_ref().map(|(l, _)| l.as_str());
        let epoch = n.leader.as_ref().map_or(0, |(_, e)| *e);
        let c = verdicts::coordinator(&n.name, leader, self.lease_held(i))?;
        let inc = if c == n.name {
            n.incarnation
        } else {
            n.incs.get(c).copied().unwrap_or(0)
        };
        Some((c.to_string(), format!("{c}#{inc}@{epoch}")))
    }

    /// Whether node `i` coordinates now: the coordinator in its own view, with the state it
    /// took over for that identity.
    fn coordinating(&self, i: usize) -> bool {
        match self.coordinator(i) {
            Some((c, id)) => c == self.nodes[i].name && self.nodes[i].coord_seen.as_deref() == Some(id.as_str()),
            None => false,
        }
    }

    fn send(&mut self, from: usize, to: &str, wire: Wire) {
        if self.nodes[from].name == to {
            let name = self.nodes[from].name.clone();
            if self.trace {
                eprintln!("{} {name} (local): {wire:?}", self.now_ms);
            }
            let inc = self.nodes[from].incarnation;
            self.handle(from, &name, inc, wire);
            return;
        }
        let t = self.idx(to);
        // A cut link loses what is sent on it.
        if self.nodes[from].cut_out_until_ms > self.now_ms || self.nodes[t].cut_in_until_ms > self.now_ms {
            return;
        }
        let delay = 1 + self.rng.below(60);
        let key = (self.nodes[from].name.clone(), to.to_string());
        let at_ms = (self.now_ms + delay).max(self.last_at.get(&key).copied().unwrap_or(0));
        self.last_at.insert(key, at_ms);
        let to_inc = self.nodes[t].incarnation;
        self.net.push(Msg {
            at_ms,
            from: self.nodes[from].name.clone(),
            from_inc: self.nodes[from].incarnation,
            to: to.to_string(),
            to_inc,
            wire,
        });
    }

    /// The coordinator side's refresh (as `sync::refresh`): take over when this node has just
    /// become coordinator (a new identity), awaiting every node it does not take as declared
    /// down; forget the awaited nodes it takes as declared down. Without its lease it keeps
    /// its state and serves nothing (the identity the nodes know has not changed).
    fn refresh(&mut self, i: usize) {
        let me = self.nodes[i].name.clone();
        let Some((coord, id)) = self.coordinator(i) else { return };
        if coord == me && self.nodes[i].coord_seen.as_deref() != Some(id.as_str()) {
            let names: Vec<String> = self.nodes.iter().map(|n| n.name.clone()).collect();
            let live: Vec<String> = names.into_iter().filter(|p| !self.declared_in_view(i, p)).collect();
            if self.trace {
                eprintln!("{} {me} takes over, awaiting {live:?}", self.now_ms);
            }
            self.nodes[i].state = SyncState::take_over(live);
            self.takeovers += 1;
        }
        self.nodes[i].coord_seen = Some(id);
        let awaited: Vec<String> = self.nodes[i].state.awaiting().map(str::to_string).collect();
        for d in awaited {
            if self.declared_in_view(i, &d) {
                let notices = self.nodes[i].state.node_down(&d);
                self.deliver_notices(i, notices);
            }
        }
    }

    fn deliver_notices(&mut self, i: usize, notices: Vec<(String, String, u64, Result<(), SyncError>)>) {
        for (key, who, call, result) in notices {
            let target = node_of(&who).to_string();
            self.send(i, &target, Wire::Notice(key, who, call, result));
        }
    }

    /// Node `i` handles `wire` from incarnation `from_inc` of node `from`.
    fn handle(&mut self, i: usize, from: &str, from_inc: u64, wire: Wire) {
        // The transport drops what an incarnation declared down sends.
        if !self.nodes[i].verdicts.accepts(from, from_inc) {
            self.fenced_drops += 1;
            return;
        }
        match wire {
            Wire::Call(c) => {
                self.refresh(i);
                // A coordinator refuses calls from a node it takes as down: it would release
                // what it granted there at its next refresh.
                // ... and a node that is not the coordinator in its own view serves nothing.
                let from_down = self.declared_in_view(i, from);
                let not_coord = !self.coordinating(i);
                if from_down || not_coord {
                    if let Call::Arrive { key, who, call, .. }
                    | Call::Acquire { key, who, call }
                    | Call::Release { key, who, call } = c
                    {
                        let e = SyncError::Unavailable("not served here now".into());
                        self.send(i, from, Wire::Notice(key, who, call, Err(e)));
                    }
                    return;
                }
                let notices = self.nodes[i].state.call(c);
                if notices.iter().any(|n| n.3.is_ok()) {
                    self.granted(i);
                }
                self.deliver_notices(i, notices);
            }
            Wire::Report(held) => {
                self.refresh(i);
                // Only the coordinator in its own view takes reports (as the daemon).
                if !self.coordinating(i) {
                    return;
                }
                let notices = self.nodes[i].state.report(from, &held);
                if notices.iter().any(|n| n.3.is_ok()) {
                    self.granted(i);
                }
                self.deliver_notices(i, notices);
            }
            Wire::Ask => {
                let Some((coord, id)) = self.coordinator(i) else { return };
                if coord == from {
                    let (stale, held) = self.nodes[i].waits.report_to(&id);
                    for ((key, who), _) in stale {
                        self.answer(i, &key, &who, false);
                    }
                    self.send(i, &coord, Wire::Report(held));
                }
            }
            Wire::Notice(key, who, call, result) => {
                let ok = result.is_ok();
                if self.nodes[i].waits.answered(&key, &who, call, ok).is_none() {
                    return;
                }
                // A grant of a coordinator already declared down, taken by a node that has not
                // learnt the verdict: it holds for the new coordinator too (the node reports it
                // before any call there, and the new coordinator grants nothing before its
                // report), which the holder check proves.
                let sender_declared = self.committed_down.get(from).is_some_and(|&d| d >= from_inc);
                if ok && sender_declared && !self.declared(i) && key.contains(":lock") {
                    self.late_grants += 1;
                }
                self.answer(i, &key, &who, ok);
            }
        }
    }

    /// Node `i` granted or released something as coordinator: one granter per epoch.
    fn granted(&mut self, i: usize) {
        let Some((leader, epoch)) = self.nodes[i].leader.clone() else {
            self.fail(format!("{} granted knowing no leader", self.nodes[i].name));
        };
        if leader != self.nodes[i].name {
            self.fail(format!("{} granted while {leader} leads", self.nodes[i].name));
        }
        if self.declared(i) {
            self.doomed_grants += 1;
        }
        let name = self.nodes[i].name.clone();
        match self.granters.insert(epoch, name.clone()) {
            Some(other) if other != name => self.fail(format!("{other} and {name} both granted in epoch {epoch}")),
            _ => {}
        }
    }

    /// Rank `who` of node `i` gets the answer to its call on `key`.
    fn answer(&mut self, i: usize, key: &str, who: &str, ok: bool) {
        let step = self.step;
        let hold_steps = 1 + self.rng.below(30) as usize;
        let Some(r) = self.nodes[i].ranks.iter_mut().find(|r| r.who == who) else {
            return;
        };
        let job = r.job;
        let RankState::Waiting { kind, key: waited } = r.state.clone() else {
            let s = format!("{who} answered on {key} while {:?}", r.state);
            self.fail(s);
        };
        if waited != key {
            let s = format!("{who} waits on {waited} but got an answer on {key}");
            self.fail(s);
        }
        r.state = match (kind, ok) {
            (CallKind::Acquire, true) => {
                self.grants += 1;
                RankState::Holding {
                    key: key.to_string(),
                    until_step: step + hold_steps,
                }
            }
            (CallKind::Acquire, false) => RankState::Idle,
            // A rank that called unlock has left its critical section, whatever the answer (a
            // failed unlock may or may not have released the lock at the coordinator).
            (CallKind::Release, _) => RankState::Idle,
            (CallKind::Barrier, ok) => {
                if ok {
                    let g = r.next_barrier - 1;
                    let arrived = self.arrivals.get(&(job, g)).cloned().unwrap_or_default();
                    let ranks = self.job_ranks.get(&job).cloned().unwrap_or_default();
                    if !ranks.iter().all(|w| arrived.contains(w)) {
                        let s = format!("{who} passed barrier {g} of job {job} with only {arrived:?} of {ranks:?}");
                        self.fail(s);
                    }
                    if !self.passed.insert((who.to_string(), g)) {
                        let s = format!("{who} passed barrier {g} twice");
                        self.fail(s);
                    }
                    self.barriers_passed += 1;
                }
                RankState::Idle
            }
        };
    }

    /// Rank `k` of node `i` starts a call (as `sync::start`).
    fn start(&mut self, i: usize, k: usize, kind: CallKind, key: String) {
        let who = self.nodes[i].ranks[k].who.clone();
        let job = self.nodes[i].ranks[k].job;
        let Some((coord, id)) = self.coordinator(i) else { return };
        let count = self.job_ranks.get(&job).map_or(0, |r| r.len()) as u32;
        if let Some((stale, held)) = self.nodes[i].waits.switch_to(&id) {
            for ((key, who), _) in stale {
                self.answer(i, &key, &who, false);
            }
            self.send(i, &coord, Wire::Report(held));
        }
        let call = match self.nodes[i].waits.register(&key, &who, kind, ()) {
            Ok(c) => c,
            Err((e, ())) => self.fail(format!("{who} could not register: {e}")),
        };
        let c = match kind {
            CallKind::Acquire => Call::Acquire {
                key: key.clone(),
                who: who.clone(),
                call,
            },
            CallKind::Release => Call::Release {
                key: key.clone(),
                who: who.clone(),
                call,
            },
            CallKind::Barrier => Call::Arrive {
                key: key.clone(),
                count,
                who: who.clone(),
                call,
            },
        };
        self.nodes[i].ranks[k].state = RankState::Waiting { kind, key };
        self.nodes[i].ranks[k].calls += 1;
        self.send(i, &coord, Wire::Call(c));
    }

    fn sweep(&mut self, i: usize) {
        let coord = self.coordinator(i);
        let (stale, report) = self.nodes[i].waits.sweep(coord.as_ref().map(|c| c.1.as_str()));
        for ((key, who), _) in stale {
            self.answer(i, &key, &who, false);
        }
        if let (Some((name, _)), Some(held)) = (coord, report) {
            self.send(i, &name, Wire::Report(held));
        }
        self.refresh(i);
        let ask: Vec<String> = self.nodes[i].state.awaiting().map(str::to_string).collect();
        for peer in ask {
            self.send(i, &peer, Wire::Ask);
        }
    }

    fn crash(&mut self, i: usize) {
        if !self.nodes[i].up {
            return;
        }
        if self.trace {
            eprintln!("{} CRASH {}", self.now_ms, self.nodes[i].name);
        }
        let had_ranks = self.nodes[i].ranks.iter().any(|r| r.job == self.job);
        let now_ms = self.now_ms;
        let n = &mut self.nodes[i];
        n.up = false;
        n.ranks.clear();
        n.waits = Waits::default();
        n.state = SyncState::default();
        n.coord_seen = None;
        n.paused_until_ms = 0;
        n.silent_since_ms.get_or_insert(now_ms);
        if had_ranks && self.end_job_at_ms.is_none() {
            self.end_job_at_ms = Some(self.now_ms + 100 + self.rng.below(1000));
        }
    }

    fn restart(&mut self, i: usize) {
        if self.trace {
            eprintln!("{} RESTART {}", self.now_ms, self.nodes[i].name);
        }
        let name = self.nodes[i].name.clone();
        let inc = self.nodes[i].incarnation + 1;
        let n = &mut self.nodes[i];
        n.up = true;
        n.incarnation = inc;
        n.paused_until_ms = 0;
        n.silent_since_ms = None;
        n.deaf_since_ms = None;
        n.lease_back_ms = 0;
        n.verdicts = Verdicts::new(name.clone(), inc);
        // A daemon starts with one heartbeat round and a metadata catch-up: it knows every
        // node's incarnation, the leader and the committed verdicts.
        let incs = self.nodes.iter().map(|n| (n.name.clone(), n.incarnation)).collect();
        let leader = self.meta.map(|(l, e)| (self.nodes[l].name.clone(), e));
        let down = self.committed_down.clone();
        let n = &mut self.nodes[i];
        n.incs = incs;
        n.leader = leader;
        n.verdicts.handle_committed(&down);
        // ... and before it serves any client, every live node has heard its heartbeat (the
        // daemon's `initial_sync`), so no rank of it acts while a peer still takes it as down.
        for j in 0..self.n() {
            if j != i {
                self.nodes[j].incs.insert(name.clone(), inc);
            }
        }
        // A leader that restarted claims a new epoch (its old one is gone with its memory).
        if self.meta.is_some_and(|(l, _)| l == i) {
            self.elect();
        }
    }

    /// The metadata's election: the lowest node that can talk both ways claims a new epoch,
    /// if a majority can.
    fn elect(&mut self) {
        let reachable: Vec<usize> = (0..self.n()).filter(|&j| self.reachable(j)).collect();
        if reachable.len() * 2 <= self.n() {
            return;
        }
        let l = reachable[0];
        let epoch = self.meta.map_or(1, |(_, e)| e + 1);
        self.meta = Some((l, epoch));
        let name = self.nodes[l].name.clone();
        if self.trace {
            eprintln!("{} ELECTED {name} epoch {epoch}", self.now_ms);
        }
        self.nodes[l].leader = Some((name.clone(), epoch));
        for j in 0..self.n() {
            if j != l {
                let at = self.now_ms + 1 + self.rng.below(100);
                let to = self.nodes[j].name.clone();
                self.news.push((at, to, News::Leader(name.clone(), epoch)));
            }
        }
    }

    /// What the metadata does this step: a new leader when the old one has been silent for
    /// the timeout, and the leader's verdicts on the nodes silent past it.
    fn control(&mut self) {
        let now_ms = self.now_ms;
        let silent_long = |n: &Node| n.silent_since_ms.is_some_and(|t| now_ms - t > TIMEOUT_MS);
        let leader_ok = self
            .meta
            .is_some_and(|(l, _)| !silent_long(&self.nodes[l]) && self.nodes[l].up && !self.declared(l));
        if !leader_ok {
            self.elect();
        }
        let Some((l, _)) = self.meta else { return };
        if !self.reachable(l) || !self.lease_held(l) {
            return;
        }
        for j in 0..self.n() {
            let inc = self.nodes[j].incarnation;
            if j == l || !silent_long(&self.nodes[j]) || self.declared(j) {
                continue;
            }
            let name = self.nodes[j].name.clone();
            if self.trace {
                eprintln!("{now_ms} VERDICT {name}#{inc}");
            }
            self.committed_down.insert(name.clone(), inc);
            self.verdicts += 1;
            // The launcher: the job loses that node.
            if self.nodes[j].ranks.iter().any(|r| r.job == self.job) && self.end_job_at_ms.is_none() {
                self.end_job_at_ms = Some(now_ms + 100 + self.rng.below(500));
            }
            self.learn(l, News::Verdict(name.clone(), inc));
            for k in 0..self.n() {
                if k != l {
                    let at = now_ms + 1 + self.rng.below(300);
                    let to = self.nodes[k].name.clone();
                    self.news.push((at, to, News::Verdict(name.clone(), inc)));
                }
            }
        }
    }

    /// Node `i` learns `news`.
    fn learn(&mut self, i: usize, news: News) {
        match news {
            News::Leader(name, epoch) => {
                if self.nodes[i].leader.as_ref().is_none_or(|(_, e)| *e < epoch) {
                    self.nodes[i].leader = Some((name, epoch));
                }
            }
            News::Verdict(name, inc) => {
                let v = &mut self.nodes[i].verdicts;
                v.handle_committed(&BTreeMap::from([(name, inc)]));
                if let Some(f) = v.poll_fence() {
                    if self.trace {
                        eprintln!("{} FENCE {}: {f:?}", self.now_ms, self.nodes[i].name);
                    }
                    self.fences += 1;
                    self.crash(i);
                    self.restart(i);
                }
            }
        }
    }

    /// The launcher ends the job: every rank of the nodes not declared down leaves (`gone`),
    /// then a new job starts on them. A declared node that has not learnt it yet keeps its
    /// ranks (the launcher cannot reach them): they run on until it fences itself.
    fn new_job(&mut self) {
        for i in 0..self.n() {
            if !self.nodes[i].up || self.declared(i) {
                continue;
            }
            let ranks: Vec<String> = self.nodes[i].ranks.drain(..).map(|r| r.who).collect();
            for who in ranks {
                let _ = self.nodes[i].waits.take_rank(&who);
                if let Some((coord, _)) = self.coordinator(i) {
                    self.send(i, &coord, Wire::Call(Call::Gone { who }));
                }
            }
        }
        self.job += 1;
        let job = self.job;
        let mut ranks = BTreeSet::new();
        for i in 0..self.n() {
            if !self.nodes[i].up || self.declared(i) {
                continue;
            }
            for _ in 0..2 {
                self.next_pid += 1;
                let who = format!("{}/{}", self.nodes[i].name, self.next_pid);
                ranks.insert(who.clone());
                self.nodes[i].ranks.push(Rank {
                    who,
                    job,
                    state: RankState::Idle,
                    next_barrier: 0,
                    calls: 0,
                });
            }
        }
        self.job_ranks.insert(job, ranks);
    }

    fn check(&self) {
        let mut holders: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.up || self.declared(i) {
                continue;
            }
            for r in &n.ranks {
                if let RankState::Holding { key, .. } = &r.state {
                    holders.entry(key.as_str()).or_default().push(r.who.as_str());
                }
            }
        }
        for (key, h) in holders {
            if h.len() > 1 {
                self.fail(format!("lock {key} has {} holders: {h:?}", h.len()));
            }
        }
    }

    /// Pauses and cuts begin and end: who is silent, who is deaf.
    fn update_links(&mut self) {
        let now_ms = self.now_ms;
        for i in 0..self.n() {
            let paused = self.paused(i);
            let n = &mut self.nodes[i];
            if !n.up {
                continue;
            }
            let silent = paused || n.cut_out_until_ms > now_ms;
            let deaf = paused || n.cut_in_until_ms > now_ms;
            if silent {
                n.silent_since_ms.get_or_insert(now_ms);
            } else {
                n.silent_since_ms = None;
            }
            match (deaf, n.deaf_since_ms) {
                (true, None) => n.deaf_since_ms = Some(now_ms),
                (false, Some(t)) => {
                    n.deaf_since_ms = None;
                    if now_ms - t > TIMEOUT_MS {
                        // Heard nobody for a timeout: the lease comes back with a majority heard.
                        n.lease_back_ms = now_ms + 20 + self.rng.below(200);
                    }
                }
                _ => {}
            }
        }
    }

    fn step(&mut self, chaos: bool) {
        self.step += 1;
        self.now_ms += 1 + self.rng.below(20);
        let now_ms = self.now_ms;
        self.update_links();
        self.control();
        // News, at each node's own time; a paused or deaf node gets it after.
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.news).into_iter().partition(|n| n.0 <= now_ms);
        self.news = later;
        for (_, to, news) in due {
            let i = self.idx(&to);
            if !self.nodes[i].up {
                continue;
            }
            let n = &self.nodes[i];
            let blocked_until = n.paused_until_ms.max(n.cut_in_until_ms);
            if blocked_until > now_ms {
                let at = blocked_until + self.rng.below(150);
                self.news.push((at, to, news));
                continue;
            }
            self.learn(i, news);
        }
        // Messages that are due, in any order across pairs, in order within a pair.
        self.net.sort_by_key(|m| m.at_ms);
        let mut k = 0;
        while k < self.net.len() {
            if self.net[k].at_ms > now_ms {
                break;
            }
            k += 1;
        }
        let due: Vec<Msg> = self.net.drain(..k).collect();
        for mut m in due {
            let (to, from) = (self.idx(&m.to), self.idx(&m.from));
            if !self.nodes[to].up || self.nodes[to].incarnation != m.to_inc {
                continue;
            }
            if !self.nodes[from].up && self.nodes[from].incarnation == m.from_inc && self.rng.chance(500) {
                continue;
            }
            if self.nodes[from].incarnation != m.from_inc {
                continue;
            }
            // A paused receiver takes its messages when it wakes (queued in its socket).
            if self.paused(to) {
                m.at_ms = self.nodes[to].paused_until_ms + self.rng.below(100);
                self.net.push(m);
                continue;
            }
            if self.trace {
                eprintln!("{} {} -> {}: {:?}", now_ms, m.from, m.to, m.wire);
            }
            self.handle(to, &m.from, m.from_inc, m.wire);
        }
        // Ranks act (not those of a paused node).
        for i in 0..self.n() {
            if !self.nodes[i].up || self.paused(i) {
                continue;
            }
            for k in 0..self.nodes[i].ranks.len() {
                let job = self.nodes[i].ranks[k].job;
                match self.nodes[i].ranks[k].state.clone() {
                    RankState::Idle if self.rng.chance(200) => {
                        if self.rng.chance(300) && self.end_job_at_ms.is_none() {
                            let g = self.nodes[i].ranks[k].next_barrier;
                            self.nodes[i].ranks[k].next_barrier += 1;
                            let who = self.nodes[i].ranks[k].who.clone();
                            self.arrivals.entry((job, g)).or_default().insert(who);
                            self.start(i, k, CallKind::Barrier, barrier_key(job, g));
                        } else {
                            let l = self.rng.below(2);
                            self.start(i, k, CallKind::Acquire, lock_key(job, l));
                        }
                    }
                    RankState::Holding { key, until_step } if self.step >= until_step => {
                        self.start(i, k, CallKind::Release, key);
                    }
                    _ => {}
                }
                if !self.nodes[i].up {
                    break;
                }
            }
            if self.nodes[i].up && now_ms >= self.nodes[i].next_sweep_ms {
                self.nodes[i].next_sweep_ms = now_ms + SWEEP_MS;
                self.sweep(i);
            }
        }
        if self.end_job_at_ms.is_some_and(|t| t <= now_ms) {
            self.end_job_at_ms = None;
            self.new_job();
        }
        if chaos {
            self.chaos();
        }
        self.check();
    }

    fn chaos(&mut self) {
        let now_ms = self.now_ms;
        let n = self.n() as u64;
        if self.rng.chance(3) {
            let i = self.rng.below(n) as usize;
            self.crash(i);
            if self.rng.chance(150) {
                let j = (i + 1) % self.n();
                self.crash(j);
            }
        }
        // The coordinator now and then.
        if self.rng.chance(1) {
            if let Some((l, _)) = self.meta {
                self.crash(l);
            }
        }
        for i in 0..self.n() {
            if !self.nodes[i].up && self.rng.chance(20) {
                self.restart(i);
            }
        }
        // A pause of up to three timeouts (the leader half the time).
        if self.rng.chance(3) {
            let i = match self.meta {
                Some((l, _)) if self.rng.chance(500) => l,
                _ => self.rng.below(n) as usize,
            };
            if self.nodes[i].up && !self.paused(i) {
                let until = now_ms + 100 + self.rng.below(3 * TIMEOUT_MS);
                if self.trace {
                    eprintln!("{now_ms} PAUSE {} until {until}", self.nodes[i].name);
                }
                self.nodes[i].paused_until_ms = until;
                self.pauses += 1;
            }
        }
        // A cut: what a node sends is lost, or what it is sent, or both.
        if self.rng.chance(3) {
            let i = match self.meta {
                Some((l, _)) if self.rng.chance(500) => l,
                _ => self.rng.below(n) as usize,
            };
            let until = now_ms + 100 + self.rng.below(3 * TIMEOUT_MS);
            let node = &mut self.nodes[i];
            match self.rng.below(3) {
                0 => node.cut_out_until_ms = until,
                1 => node.cut_in_until_ms = until,
                _ => {
                    node.cut_out_until_ms = until;
                    node.cut_in_until_ms = until;
                }
            }
            if self.trace {
                eprintln!("{now_ms} CUT {} until {until}", self.nodes[i].name);
            }
            self.cuts += 1;
        }
    }
}

/// What a seed did.
#[derive(Default)]
struct Counts {
    grants: u64,
    barriers: u64,
    takeovers: u64,
    pauses: u64,
    cuts: u64,
    verdicts: u64,
    fences: u64,
    fenced_drops: u64,
    doomed_grants: u64,
    late_grants: u64,
}

fn run_seed(seed: u64) -> Counts {
    let mut rng = SplitMix64::new(seed);
    let count = 3 + rng.below(2) as usize;
    let names: Vec<String> = (0..count).map(|i| format!("n{i}")).collect();
    let nodes = names
        .iter()
        .map(|name| Node {
            name: name.clone(),
            up: true,
            incarnation: 1,
            incs: names.iter().map(|n| (n.clone(), 1)).collect(),
            leader: None,
            verdicts: Verdicts::new(name.clone(), 1),
            paused_until_ms: 0,
            cut_out_until_ms: 0,
            cut_in_until_ms: 0,
            silent_since_ms: None,
            deaf_since_ms: None,
            lease_back_ms: 0,
            waits: Waits::default(),
            coord_seen: None,
            state: SyncState::default(),
            ranks: Vec::new(),
            next_sweep_ms: 0,
        })
        .collect();
    let mut w = World {
        seed,
        rng,
        now_ms: 0,
        step: 0,
        nodes,
        net: Vec::new(),
        last_at: BTreeMap::new(),
        news: Vec::new(),
        meta: None,
        committed_down: BTreeMap::new(),
        granters: BTreeMap::new(),
        job: 0,
        job_ranks: BTreeMap::new(),
        arrivals: BTreeMap::new(),
        passed: BTreeSet::new(),
        next_pid: 100,
        end_job_at_ms: None,
        grants: 0,
        barriers_passed: 0,
        takeovers: 0,
        pauses: 0,
        cuts: 0,
        verdicts: 0,
        fences: 0,
        fenced_drops: 0,
        doomed_grants: 0,
        late_grants: 0,
        trace: std::env::var_os("PSLS_SIM_TRACE").is_some(),
    };
    w.elect();
    w.new_job();
    for _ in 0..STEPS {
        w.step(true);
    }
    // Calm: everyone back and awake, links whole, news delivered, a fresh job; every call of
    // a live rank ends.
    for i in 0..w.n() {
        let n = &mut w.nodes[i];
        n.paused_until_ms = n.paused_until_ms.min(w.now_ms);
        n.cut_in_until_ms = n.cut_in_until_ms.min(w.now_ms);
        n.cut_out_until_ms = n.cut_out_until_ms.min(w.now_ms);
        if !w.nodes[i].up {
            w.restart(i);
        }
    }
    for _ in 0..400 {
        w.step(false);
    }
    w.new_job();
    let calls_before: u64 = w.nodes.iter().flat_map(|n| n.ranks.iter()).map(|r| r.calls).sum();
    for _ in 0..1500 {
        w.step(false);
    }
    let calls_after: u64 = w.nodes.iter().flat_map(|n| n.ranks.iter()).map(|r| r.calls).sum();
    if calls_after < calls_before + 10 {
        w.fail(format!(
            "the ranks made no progress after the calm ({calls_before} → {calls_after} calls)"
        ));
    }
    // Let the last calls finish: ranks stop starting new ones.
    for _ in 0..400 {
        for n in w.nodes.iter_mut() {
            for r in n.ranks.iter_mut() {
                if let RankState::Holding { until_step, .. } = &mut r.state {
                    *until_step = 0;
                }
            }
        }
        w.step += 1;
        w.now_ms += 10;
        let due: Vec<Msg> = {
            w.net.sort_by_key(|m| m.at_ms);
            let k = w.net.iter().take_while(|m| m.at_ms <= w.now_ms).count();
            w.net.drain(..k).collect()
        };
        for m in due {
            let to = w.idx(&m.to);
            w.handle(to, &m.from, m.from_inc, m.wire);
        }
        for i in 0..w.n() {
            for k in 0..w.nodes[i].ranks.len() {
                if let RankState::Holding { key, .. } = w.nodes[i].ranks[k].state.clone() {
                    w.start(i, k, CallKind::Release, key);
                }
            }
            if w.now_ms >= w.nodes[i].next_sweep_ms {
                w.nodes[i].next_sweep_ms = w.now_ms + SWEEP_MS;
                w.sweep(i);
            }
        }
        w.check();
    }
    for n in &w.nodes {
        for r in &n.ranks {
            if let RankState::Waiting { key, .. } = &r.state {
                // A barrier of the last job may still wait for ranks that stopped calling.
                if !key.contains(":b") {
                    w.fail(format!("{} still waits on {key}", r.who));
                }
            }
        }
    }
    Counts {
        grants: w.grants,
        barriers: w.barriers_passed,
        takeovers: w.takeovers,
        pauses: w.pauses,
        cuts: w.cuts,
        verdicts: w.verdicts,
        fences: w.fences,
        fenced_drops: w.fenced_drops,
        doomed_grants: w.doomed_grants,
        late_grants: w.late_grants,
    }
}

#[test]
fn random_schedules_keep_one_lock_holder_and_whole_barriers() {
    let seeds = common::seeds(2000);
    let count = seeds.end - seeds.start;
    let mut t = Counts::default();
    for seed in seeds {
        let c = run_seed(seed);
        t.grants += c.grants;
        t.barriers += c.barriers;
        t.takeovers += c.takeovers;
        t.pauses += c.pauses;
        t.cuts += c.cuts;
        t.verdicts += c.verdicts;
        t.fences += c.fences;
        t.fenced_drops += c.fenced_drops;
        t.doomed_grants += c.doomed_grants;
        t.late_grants += c.late_grants;
    }
    eprintln!(
        "{count} seeds: {} locks granted, {} barrier passes, {} coordinator take-overs; {} pauses, \
         {} cuts, {} down verdicts, {} nodes fenced themselves, {} messages of fenced incarnations \
         dropped, {} grants by a declared coordinator that had not learnt it ({} of them taken by a \
         rank of a node that had not learnt it either)",
        t.grants,
        t.barriers,
        t.takeovers,
        t.pauses,
        t.cuts,
        t.verdicts,
        t.fences,
        t.fenced_drops,
        t.doomed_grants,
        t.late_grants
    );
    if count >= 100 {
        assert!(t.grants > count * 20, "only {} locks granted", t.grants);
        assert!(t.barriers > 0, "no barrier ever opened");
        assert!(t.takeovers > count * 2, "coordinators rarely changed ({})", t.takeovers);
        assert!(t.verdicts > count, "only {} verdicts", t.verdicts);
        assert!(t.fences > 0, "no node ever fenced itself");
        assert!(
            t.fenced_drops > 0,
            "no message of a fenced incarnation was ever dropped"
        );
    }
}
