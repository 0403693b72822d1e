//! Seeded simulation of failure detection at a bounded cost per node (DESIGN §2b, issue 40):
//! the real [`Topology`] (who heartbeats whom), [`Membership`] (each node's detector over its
//! watched peers, and the leader's probes), [`Duties`] (each node's reports, and the leader's
//! tally of them, as the daemon runs them) and [`Verdicts`] (the leader's declarations), at 16,
//! 128 and 1,024 nodes in racks (failure domains), in simulated milliseconds.
//!
//! Each node sends a one-way beat to its watched peers every [`INTERVAL_MS`] (their own beats
//! answer it; a peer that does not watch the sender answers with a beat that is not answered); a watched
//! peer silent past [`TIMEOUT_MS`] is reported to the metadata leader (again every interval
//! while it lasts), and taken back when heard again. The leader counts reports, probes a peer
//! reported once (it watches it itself), and declares a peer the tally confirms. The metadata
//! is modelled by its outcome: a declaration commits at once, and a leader that stops being
//! able to lead is replaced a failure timeout later by the first node that can (its log has
//! its own simulator, `log_sim.rs`), and declares only while it holds its lease. A declared
//! node that runs learns its verdict once it hears, and rejoins as a new incarnation, which
//! it announces to the leader (the metadata records each node's current incarnation, and a
//! verdict names it).
//!
//! Faults: kill -9 (restarted 2–4 s later as a new incarnation), pauses (0.3–3 s: no tick, no
//! message, those sent to it arrive when it wakes), a node cut off both ways, its outgoing
//! messages only or its incoming ones only, and a whole rack cut off from the others — at most
//! two at a time. Messages take 1–20 ms.
//!
//! Checked: no verdict on a node with no fault (false verdicts: 0; a node that only hears
//! nothing may be declared, as it cannot serve, but need not be); every node silent to all (killed, paused past the timeout,
//! cut off, its rack cut off) is declared within 2× the failure timeout plus one probe period;
//! and, with no fault, messages per node per second: the busiest node's at 1,024 nodes is at
//! most 2× its figure at 16.
//!
//! `PSLS_SIM_SEEDS=N` runs N seeds at 16 nodes, a third as many at 128 and a hundredth at
//! 1,024 (at least one each).

mod common;

use psls_cluster::membership::Membership;
use psls_cluster::verdicts::Verdicts;
use psls_cluster::watch::{Duties, Duty, Topology, DEFAULT_MIN_PEERS};
use psls_svm::rng::SplitMix64;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

const INTERVAL_MS: u64 = 200;
const TIMEOUT_MS: u64 = 1000;
const TICK_MS: u64 = 10;
/// The bound on declaring a node silent to all: twice the timeout plus one probe period (and
/// the heartbeat phase and message delays, a few ticks).
const DECLARE_WITHIN_MS: u64 = 2 * TIMEOUT_MS + INTERVAL_MS + 100;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Msg {
    /// A one-way heartbeat on the link (as the daemon's `Beat`): to a watched peer every
    /// interval; a peer that does not watch the sender answers with one that is not answered
    /// (`answer: false`, the daemon's `BeatBack`).
    Beat { incarnation: u64, answer: bool },
    /// A watcher's reports to the leader (the daemon's `Watch`): silences `(peer, incarnation
    /// heard)` and peers heard again.
    Watch {
        silent: Vec<(usize, u64)>,
        back: Vec<usize>,
        /// The reporter's own incarnation (a declared one's reports are dropped).
        from_incarnation: u64,
    },
    /// A new incarnation announces itself (the metadata records each node's current one; a
    /// node serves only once it is recorded).
    Boot { incarnation: u64 },
}

struct Node {
    incarnation: u64,
    members: Membership<()>,
    /// Its failure-detection duties (the daemon's).
    duties: Duties,
    alive: bool,
    paused_until: Option<u64>,
    /// When to restart (killed).
    restart_at: Option<u64>,
    /// Its heartbeats go at this offset in each interval.
    phase_ms: u64,
    /// A verdict on this incarnation it has not learnt yet (it learns it once it hears).
    verdict: Option<u64>,
    messages: u64,
}

/// A message on the way: (delivery time, sequence, from, to, message).
type InFlight = (u64, u64, usize, usize, Msg);

/// A fault under way: what it is, on which nodes, since and until when.
#[derive(Clone, Debug)]
struct Fault {
    kind: &'static str,
    nodes: Vec<usize>,
    since_ms: u64,
    until_ms: u64,
    /// The nodes are silent to everyone (they must be declared).
    silent: bool,
}

struct World {
    n: usize,
    topo: Topology,
    names: Vec<String>,
    nodes: Vec<Node>,
    net: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    now: u64,
    rng: SplitMix64,
    leader: usize,
    leader_lost_at: Option<u64>,
    /// The leader's lease (the metadata log's: a majority of voters answered it within the
    /// election timeout less a margin) ends then: modelled as a fifth of the timeout short of
    /// a timeout after it last could hear.
    lease_until: u64,
    /// The leader's verdict book.
    verdicts: Verdicts,
    committed: BTreeMap<String, u64>,
    /// Each node's current incarnation as the metadata records it.
    up_from: BTreeMap<usize, u64>,
    /// When the leader recorded it.
    booted_at: BTreeMap<usize, u64>,
    faults: Vec<Fault>,
    /// Per node, when its last fault ended (a verdict soon after is not false).
    fault_ended: BTreeMap<usize, u64>,
    /// Per node, when it was last declared.
    declared_at: BTreeMap<usize, u64>,
    verdict_count: u64,
    seed: u64,
    /// Every fault and verdict so far (for a failure's message).
    history: Vec<String>,
}

fn rack_of(i: usize, n: usize) -> String {
    format!("rack{}", i / (n / 8).max(2))
}

impl World {
    fn new(n: usize, seed: u64) -> World {
        let names: Vec<String> = (0..n).map(|i| format!("n{i}")).collect();
        let topo = Topology::new(
            names.iter().enumerate().map(|(i, s)| (s.clone(), rack_of(i, n))),
            DEFAULT_MIN_PEERS,
        );
        let mut rng = SplitMix64::new(seed);
        let nodes = (0..n)
            .map(|i| Node {
                incarnation: 1,
                members: Membership::new(topo.peers_of(&names[i]).into_iter().map(String::from), TIMEOUT_MS, 0),
                duties: {
                    let mut d = Duties::new(names[i].clone(), INTERVAL_MS, TIMEOUT_MS);
                    let up: BTreeMap<String, u64> = names.iter().map(|n| (n.clone(), 1)).collect();
                    d.handle_boots(0, &up);
                    d
                },
                alive: true,
                paused_until: None,
                restart_at: None,
                phase_ms: rng.below(INTERVAL_MS / TICK_MS) * TICK_MS,
                verdict: None,
                messages: 0,
            })
            .collect();
        World {
            n,
            topo,
            verdicts: Verdicts::new(names[0].clone(), 1),
            names,
            nodes,
            net: BinaryHeap::new(),
            seq: 0,
            now: 0,
            rng,
            leader: 0,
            leader_lost_at: None,
            lease_until: TIMEOUT_MS * 4 / 5,
            committed: BTreeMap::new(),
            up_from: (0..n).map(|i| (i, 1)).collect(),
            booted_at: BTreeMap::new(),
            faults: Vec::new(),
            fault_ended: BTreeMap::new(),
            declared_at: BTreeMap::new(),
            verdict_count: 0,
            seed,
            history: Vec::new(),
        }
    }

    fn running(&self, i: usize) -> bool {
        self.nodes[i].alive && self.nodes[i].paused_until.is_none()
    }

    /// Whether a message from `a` to `b` is lost on the way (a cut).
    fn cut(&self, a: usize, b: usize) -> bool {
        self.faults.iter().any(|f| match f.kind {
            "cut" => f.nodes.contains(&a) || f.nodes.contains(&b),
            "cut-out" => f.nodes.contains(&a),
            "cut-in" => f.nodes.contains(&b),
            "rack" => f.nodes.contains(&a) != f.nodes.contains(&b),
            _ => false,
        })
    }

    fn send(&mut self, from: usize, to: usize, msg: Msg) {
        self.nodes[from].messages += 1;
        if self.cut(from, to) {
            return;
        }
        let at = self.now + 1 + self.rng.below(20);
        self.seq += 1;
        self.net.push(Reverse((at, self.seq, from, to, msg)));
    }

    /// Whether node `i` can lead: running and talking both ways with most nodes.
    fn can_lead(&self, i: usize) -> bool {
        self.running(i)
            && !self
                .faults
                .iter()
                .any(|f| f.kind != "kill" && f.kind != "pause" && f.nodes.contains(&i))
    }

    fn step(&mut self) {
        self.now += TICK_MS;
        let now = self.now;
        // Restarts and wake-ups.
        for i in 0..self.n {
            if self.nodes[i].restart_at.is_some_and(|t| t <= now) {
                let n = &mut self.nodes[i];
                n.restart_at = None;
                n.alive = true;
                let declared = n.verdict.take().unwrap_or(0);
                self.rejoin(i, declared, now);
            }
            if self.nodes[i].paused_until.is_some_and(|t| t <= now) {
                self.nodes[i].paused_until = None;
            }
            // A declared node that runs and hears learns its verdict and rejoins as a new
            // incarnation with an empty memory.
            let hears = !self
                .faults
                .iter()
                .any(|f| f.nodes.contains(&i) && matches!(f.kind, "cut" | "cut-in" | "rack"));
            if self.running(i) && hears {
                if let Some(d) = self.nodes[i].verdict.take() {
                    self.rejoin(i, d, now);
                }
            }
        }
        // The leader: replaced a timeout after it stopped being able to lead.
        if self.can_lead(self.leader) {
            self.leader_lost_at = None;
        } else {
            let since = *self.leader_lost_at.get_or_insert(now);
            if now >= since + TIMEOUT_MS {
                if let Some(l) = (0..self.n).find(|&i| self.can_lead(i)) {
                    // The old leader's probes end with its leadership (a stale probe would
                    // be its own "observation" of silence when it leads again).
                    let old = self.leader;
                    let own: BTreeSet<String> = self
                        .topo
                        .peers_of(&self.names[old])
                        .into_iter()
                        .map(String::from)
                        .collect();
                    for p in 0..self.n {
                        let name = self.names[p].clone();
                        if p != old && !own.contains(&name) {
                            self.nodes[old].members.unwatch(&name);
                        }
                    }
                    self.leader = l;
                    self.leader_lost_at = None;
                    self.lease_until = now + TIMEOUT_MS * 4 / 5;
                    self.verdicts = Verdicts::new(self.names[l].clone(), self.nodes[l].incarnation);
                    self.verdicts.handle_committed(&self.committed);
                }
            }
        }
        // Deliveries due.
        while self.net.peek().is_some_and(|Reverse((at, ..))| *at <= now) {
            let Some(Reverse((_, _, from, to, msg))) = self.net.pop() else {
                break;
            };
            if !self.nodes[to].alive {
                continue;
            }
            if let Some(t) = self.nodes[to].paused_until {
                // Arrives when it wakes.
                self.seq += 1;
                self.net.push(Reverse((t, self.seq, from, to, msg)));
                continue;
            }
            self.receive(from, to, msg);
        }
        // Each running node's tick.
        let leader = self.leader;
        for i in 0..self.n {
            if !self.running(i) {
                continue;
            }
            if now % INTERVAL_MS == self.nodes[i].phase_ms {
                let inc = self.nodes[i].incarnation;
                let peers: Vec<usize> = self.watched(i);
                for p in peers {
                    self.send(
                        i,
                        p,
                        Msg::Beat {
                            incarnation: inc,
                            answer: true,
                        },
                    );
                }
                // Reports of silent peers (renewed every interval), and take-backs; at the
                // leader, its tally and verdicts.
                let silent: Vec<(String, u64)> = self.nodes[i]
                    .members
                    .tick(now)
                    .into_iter()
                    .filter_map(|(p, _)| {
                        let t = self.index(&p)?;
                        let inc = self.heard_incarnation(i, t);
                        // As the daemon's verdict book: its newest known incarnation (heard, or
                        // recorded as started) declared down.
                        let newest = inc.max(self.up_from.get(&t).copied().unwrap_or(0));
                        let declared = self.committed.get(&p).is_some_and(|&d| d >= newest);
                        (!declared).then_some((p, inc))
                    })
                    .collect();
                let leading = i == leader && now < self.lease_until;
                let leader_name = self.names[leader].clone();
                let duties = self.nodes[i].duties.handle_tick(
                    now,
                    silent,
                    leading,
                    Some(&leader_name),
                    Vec::new(),
                    &self.topo,
                    &mut self.verdicts,
                );
                self.carry_out(i, duties);
            }
        }
        let hears = !self
            .faults
            .iter()
            .any(|f| f.nodes.contains(&leader) && matches!(f.kind, "cut" | "cut-in" | "rack"));
        if self.running(leader) && hears {
            self.lease_until = now + TIMEOUT_MS * 4 / 5;
        }
        if self.running(leader) && now < self.lease_until {
            self.lead(now);
        }
        self.check_deadlines();
        self.faults.retain(|f| f.until_ms > now);
    }

    /// Node `i` starts a new incarnation above `declared` with an empty memory (a restart,
    /// or a rejoin on learning its verdict), and announces it.
    fn rejoin(&mut self, i: usize, declared: u64, now: u64) {
        let n = &mut self.nodes[i];
        n.incarnation = n.incarnation.max(declared) + 1;
        n.members = Membership::new(
            self.topo.peers_of(&self.names[i]).into_iter().map(String::from),
            TIMEOUT_MS,
            now,
        );
        // A new daemon: its first install of the records takes every start as seen long ago.
        n.duties = Duties::new(self.names[i].clone(), INTERVAL_MS, TIMEOUT_MS);
        let _ = n;
        let up: BTreeMap<String, u64> = self.up_from.iter().map(|(&j, &u)| (self.names[j].clone(), u)).collect();
        self.nodes[i].duties.handle_boots(now, &up);
        let incarnation = self.nodes[i].incarnation;
        self.boot(i, incarnation);
    }

    /// Node `i` announces its new incarnation to the leader.
    fn boot(&mut self, i: usize, incarnation: u64) {
        let leader = self.leader;
        if i == leader {
            self.record_boot(i, incarnation);
        } else {
            self.send(i, leader, Msg::Boot { incarnation });
        }
    }

    fn index(&self, name: &str) -> Option<usize> {
        name.strip_prefix('n').and_then(|s| s.parse().ok())
    }

    fn heard_incarnation(&self, i: usize, p: usize) -> u64 {
        self.nodes[i]
            .members
            .view(&self.names[p])
            .and_then(|v| v.incarnation)
            .unwrap_or(1)
    }

    /// The peers node `i` heartbeats now: its topology's, and the leader's probes.
    fn watched(&self, i: usize) -> Vec<usize> {
        let mut out: Vec<usize> = self
            .topo
            .peers_of(&self.names[i])
            .into_iter()
            .filter_map(|p| self.index(p))
            .collect();
        if i == self.leader {
            for p in 0..self.n {
                if p != i && self.nodes[i].members.watches(&self.names[p]) && !out.contains(&p) {
                    out.push(p);
                }
            }
        }
        out
    }

    fn receive(&mut self, from: usize, to: usize, msg: Msg) {
        self.nodes[to].messages += 1;
        let now = self.now;
        match msg {
            Msg::Beat { incarnation, answer } => {
                // Only a declared incarnation is not heard (it learns its verdict instead).
                if self.committed.get(&self.names[from]).is_none_or(|&d| d < incarnation) {
                    self.nodes[to].members.heard(now, &self.names[from], incarnation, ());
                    let name = self.names[from].clone();
                    self.nodes[to].duties.handle_heard(now, &name, incarnation);
                }
                if answer && !self.nodes[to].members.watches(&self.names[from]) {
                    let inc = self.nodes[to].incarnation;
                    self.send(
                        to,
                        from,
                        Msg::Beat {
                            incarnation: inc,
                            answer: false,
                        },
                    );
                }
            }
            Msg::Watch {
                silent,
                back,
                from_incarnation,
            } => {
                // A declared incarnation's reports are dropped (as all it sends).
                if self
                    .committed
                    .get(&self.names[from])
                    .is_some_and(|&d| d >= from_incarnation)
                {
                    return;
                }
                let silent = silent
                    .into_iter()
                    .map(|(t, inc)| (self.names[t].clone(), inc))
                    .collect();
                let back = back.into_iter().map(|t| self.names[t].clone()).collect();
                let r = self.names[from].clone();
                let leading = to == self.leader && now < self.lease_until;
                let duties = self.nodes[to].duties.handle_reports(
                    now,
                    &r,
                    silent,
                    back,
                    leading,
                    |_| true,
                    &self.topo,
                    &mut self.verdicts,
                );
                self.carry_out(to, duties);
            }
            Msg::Boot { incarnation } if to == self.leader => {
                if self.up_from.get(&from).is_none_or(|&u| u < incarnation) {
                    self.record_boot(from, incarnation);
                }
            }
            Msg::Boot { .. } => {}
        }
    }

    /// Node `i`'s failure-detection duties: reports to the leader, and verdicts (committed at
    /// once).
    fn carry_out(&mut self, i: usize, duties: Vec<Duty>) {
        let leader = self.leader;
        for duty in duties {
            match duty {
                Duty::Report { silent, back, .. } => {
                    let silent = silent
                        .into_iter()
                        .filter_map(|(p, inc)| Some((self.index(&p)?, inc)))
                        .collect();
                    let back = back.iter().filter_map(|p| self.index(p)).collect();
                    let from_incarnation = self.nodes[i].incarnation;
                    self.send(
                        i,
                        leader,
                        Msg::Watch {
                            silent,
                            back,
                            from_incarnation,
                        },
                    );
                }
                Duty::Declare { peer, incarnation, .. } => {
                    self.verdicts.handle_declared(&peer);
                    let t = self.index(&peer).expect("a node");
                    self.commit(t, incarnation);
                }
            }
        }
    }

    /// The records take node `i`'s new incarnation; every running node's next install of
    /// them shows it.
    fn record_boot(&mut self, i: usize, incarnation: u64) {
        self.up_from.insert(i, incarnation);
        self.booted_at.insert(i, self.now);
        let up = BTreeMap::from([(self.names[i].clone(), incarnation)]);
        for n in &mut self.nodes {
            n.duties.handle_boots(self.now, &up);
        }
    }

    /// The leader's probes (its tally and declarations are its duties' tick).
    fn lead(&mut self, now: u64) {
        let l = self.leader;
        let own: BTreeSet<String> = self
            .topo
            .peers_of(&self.names[l])
            .into_iter()
            .map(String::from)
            .collect();
        let probes = self.nodes[l].duties.probes(&own);
        for p in &probes {
            self.nodes[l].members.watch(p, now);
        }
        // Probes no longer reported go.
        let extra: Vec<String> = (0..self.n)
            .map(|p| self.names[p].clone())
            .filter(|p| !own.contains(p) && *p != self.names[l] && self.nodes[l].members.watches(p))
            .filter(|p| !probes.contains(p))
            .collect();
        for p in extra {
            self.nodes[l].members.unwatch(&p);
        }
    }

    fn commit(&mut self, t: usize, incarnation: u64) {
        let now = self.now;
        // A node that hears nothing (its incoming messages lost) may be declared too: it
        // cannot serve. It need not be (it is not silent).
        let faulted = self.faults.iter().any(|f| f.nodes.contains(&t))
            || self.fault_ended.get(&t).is_some_and(|&e| now <= e + DECLARE_WITHIN_MS);
        let view = self.nodes[self.leader]
            .members
            .view(&self.names[t])
            .map(|v| (v.last_heard_ms, v.incarnation));
        assert!(
            faulted,
            "seed {} n={}: false verdict on n{t} (incarnation {incarnation}) at {now} ms by leader n{} (its view {view:?}, a topology peer: {}), reporters {:?}; faults {:?}",
            self.seed,
            self.n,
            self.leader,
            self.topo.watches(&self.names[self.leader], &self.names[t]),
            self.nodes[self.leader].duties.tally().reporters_of(&self.names[t]),
            self.history
        );
        self.verdict_count += 1;
        self.history
            .push(format!("{now} ms: n{t} declared at incarnation {incarnation}"));
        let e = self.committed.entry(self.names[t].clone()).or_insert(0);
        *e = (*e).max(incarnation);
        self.verdicts.handle_committed(&self.committed);
        self.declared_at.insert(t, now);
        // It learns its verdict when it runs and hears.
        let n = &mut self.nodes[t];
        if n.incarnation <= incarnation {
            n.verdict = Some(incarnation);
        }
    }

    /// Every node silent to all since `since` is declared by `since + DECLARE_WITHIN_MS`.
    fn check_deadlines(&self) {
        for f in self.faults.iter().filter(|f| f.silent) {
            if f.until_ms < f.since_ms + DECLARE_WITHIN_MS || self.now != f.since_ms + DECLARE_WITHIN_MS {
                continue;
            }
            for &t in &f.nodes {
                // An incarnation the metadata never recorded never served, and one declared
                // already is fenced: nothing to declare.
                let inc = self.nodes[t].incarnation;
                if self.up_from.get(&t) != Some(&inc) || self.committed.get(&self.names[t]).is_some_and(|&d| d >= inc) {
                    continue;
                }
                assert!(
                    self.declared_at.get(&t).is_some_and(|&d| d >= f.since_ms),
                    "seed {} n={}: n{t} silent since {} ms ({}) not declared by {} ms (leader n{}, reporters {:?}, confirmed {:?}, committed {:?}, incarnation {}); {:?}",
                    self.seed,
                    self.n,
                    f.since_ms,
                    f.kind,
                    self.now,
                    self.leader,
                    self.nodes[self.leader].duties.tally().reporters_of(&self.names[t]),
                    self.nodes[self.leader].duties.tally().confirmed(&self.topo, self.now),
                    self.committed.get(&self.names[t]),
                    self.nodes[t].incarnation,
                    self.history
                );
            }
        }
    }

    /// Starts a random fault (at most two at a time; never on the leader's rack when a rack is
    /// cut, so that the leader stays on the majority side).
    fn strike(&mut self) {
        if self.faults.len() >= 2 {
            return;
        }
        let now = self.now;
        let busy: BTreeSet<usize> = self.faults.iter().flat_map(|f| f.nodes.clone()).collect();
        let pick = |w: &mut World| loop {
            let v = w.rng.below(w.n as u64) as usize;
            if !busy.contains(&v) && w.nodes[v].alive && w.nodes[v].paused_until.is_none() {
                return v;
            }
        };
        let (kind, nodes, ms, silent) = match self.rng.below(6) {
            0 => {
                let v = pick(self);
                let ms = 2000 + self.rng.below(2000);
                self.nodes[v].alive = false;
                self.nodes[v].restart_at = Some(now + ms);
                ("kill", vec![v], ms, true)
            }
            1 => {
                let v = pick(self);
                let ms = 300 + self.rng.below(2700);
                self.nodes[v].paused_until = Some(now + ms);
                ("pause", vec![v], ms, true)
            }
            2 => ("cut", vec![pick(self)], 1000 + self.rng.below(3000), true),
            3 => ("cut-out", vec![pick(self)], 1000 + self.rng.below(3000), true),
            4 => ("cut-in", vec![pick(self)], 1000 + self.rng.below(3000), false),
            _ => {
                let rack = rack_of(self.rng.below(self.n as u64) as usize, self.n);
                let nodes: Vec<usize> = (0..self.n).filter(|&i| rack_of(i, self.n) == rack).collect();
                if nodes.contains(&self.leader) || nodes.iter().any(|v| busy.contains(v)) || nodes.len() * 2 >= self.n {
                    return;
                }
                ("rack", nodes, 2000 + self.rng.below(2000), true)
            }
        };
        self.history.push(format!("{now} ms: {kind} {nodes:?} for {ms} ms"));
        self.faults.push(Fault {
            kind,
            nodes,
            since_ms: now,
            until_ms: now + ms,
            silent,
        });
    }

    fn end_faults(&mut self) {
        let now = self.now;
        for f in self.faults.iter().filter(|f| f.until_ms <= now + TICK_MS) {
            for &v in &f.nodes {
                self.fault_ended.insert(v, f.until_ms);
            }
        }
    }
}

/// One seed at `n` nodes: `secs` of faults, then quiet; returns how many verdicts.
fn run(n: usize, seed: u64, secs: u64) -> u64 {
    let mut w = World::new(n, seed);
    // Settle: every node heard its peers.
    while w.now < 2 * TIMEOUT_MS {
        w.step();
    }
    assert_eq!(w.verdict_count, 0, "seed {seed} n={n}: a verdict with no fault");
    let end = w.now + secs * 1000;
    let mut next = w.now + 500;
    while w.now < end {
        if w.now >= next {
            w.strike();
            next = w.now + 500 + w.rng.below(2500);
        }
        w.end_faults();
        w.step();
    }
    w.verdict_count
}

/// Messages (sent and received) per second of the busiest node at `n` nodes with no fault.
fn idle_busiest(n: usize) -> f64 {
    let mut w = World::new(n, 1);
    while w.now < 3 * TIMEOUT_MS {
        w.step();
    }
    let before: Vec<u64> = w.nodes.iter().map(|x| x.messages).collect();
    let t0 = w.now;
    while w.now < t0 + 5000 {
        w.step();
    }
    assert_eq!(w.verdict_count, 0, "n={n}: a verdict with no fault");
    let secs = (w.now - t0) as f64 / 1000.0;
    w.nodes
        .iter()
        .zip(before)
        .map(|(x, b)| (x.messages - b) as f64 / secs)
        .fold(0.0, f64::max)
}

#[test]
fn silent_nodes_are_declared_in_time_with_no_false_verdict_at_every_size() {
    let seeds = common::seeds(12);
    let all = seeds.end - seeds.start;
    let mut total = 0;
    for (n, count, secs) in [(16, all, 40), (128, all.div_ceil(3), 30), (1024, all.div_ceil(100), 20)] {
        for seed in seeds.start..seeds.start + count {
            total += run(n, seed, secs);
        }
    }
    assert!(total > 0, "no fault was declared");
}

#[test]
fn the_busiest_nodes_idle_messages_grow_at_most_2x_from_16_to_1024_nodes() {
    let at: Vec<(usize, f64)> = [16, 128, 1024].into_iter().map(|n| (n, idle_busiest(n))).collect();
    eprintln!("busiest node's idle messages per second: {at:?}");
    let (small, large) = (at[0].1, at[2].1);
    assert!(large <= 2.0 * small, "{at:?}");
}
