//! Seeded simulation of the failure detector ([`Membership`]: heartbeats, suspicion with its
//! stall hysteresis, the lease) and of the verdicts it leads to ([`Verdicts`]: the
//! coordinator's declarations, fencing by the receivers and of oneself), shaped like
//! `psls-node`'s shell (`node.rs`).
//!
//! Each seed builds 3 to 5 nodes and runs a schedule in simulated milliseconds: heartbeats
//! every 100 ms, a 1000 ms failure timeout, messages delayed by 1–80 ms and so reordered, now
//! and then delayed past the timeout (so live nodes are declared down), and crashes at any
//! step — of the leader too, and of two nodes at once. A crashed node's in-flight messages
//! may or may not arrive (a dead link drops its queue); it restarts with a new incarnation
//! and the verdicts its disk holds. Nodes also *pause* (a VM stall, swapping, a debugger: no
//! tick, no heartbeat, nothing received, for up to three failure timeouts) and wake with all
//! their old state, the messages sent to them meanwhile arriving then; and links are *cut*,
//! one way or both, for up to four timeouts (everything sent on them is lost).
//!
//! The metadata is modelled by its outcomes (its log has its own simulator, `log_sim.rs`): one
//! list of committed verdicts; a leader per term, replaced a failure timeout after it stopped
//! being able to lead (down, paused, without its lease, or unable to talk both ways with a
//! majority) by a node that can; the leader's appends carry the committed verdicts to each
//! node at its own time, and tell a stale leader it was replaced; a leader that loses its
//! lease steps down (check-quorum); a declaration commits only if its proposer still leads
//! when it arrives. The shell does what the daemon does: it ticks the detector, declares with
//! [`Verdicts::poll_declarations`] while it leads and holds its lease, drops messages of
//! declared incarnations ([`Verdicts::accepts`]), reads the verdicts of heartbeats and of the
//! metadata, and fences itself (rejoins as a new incarnation) on learning its own.
//!
//! After every step it checks: a node's verdict book is exactly the committed verdicts it
//! applied (never one withdrawn); no node takes a message from an incarnation its applied
//! verdicts declare down; no node runs on an incarnation it knows declared down; a node fences
//! itself only on a committed verdict; a declaration is made only by a node that leads and
//! holds its lease (it heard a majority within the timeout), and names another node at an
//! incarnation that exists, one the declarer has not heard within the timeout, never within a
//! timeout of the declarer's start or of its waking from a stall. At the end it stops the
//! chaos and checks liveness: one leader every node knows and takes as coordinator
//! ([`verdicts::coordinator`]), every node holding its lease, up in every detector and at the
//! last verdict — and then, for three failure timeouts, no verdict and no fence.
//!
//! `PSLS_SIM_SEED=N` runs one seed (with `PSLS_SIM_TRACE=1`, every event); `PSLS_SIM_SEEDS=N`
//! runs N seeds from 0. A failing seed prints itself.

mod common;

use psls_cluster::membership::{Liveness, Membership};
use psls_cluster::verdicts::{self, Verdicts};
use psls_cluster::watch::{Duties, Duty, Topology};
use psls_svm::rng::SplitMix64;
use std::collections::BTreeMap;

const HEARTBEAT_MS: u64 = 100;
const TIMEOUT_MS: u64 = 1000;
const STEPS: usize = 1500;

enum Wire {
    Heartbeat {
        incarnation: u64,
        /// The committed verdicts the sender knows.
        down: Vec<(String, u64)>,
        /// The incarnations the sender heard.
        heard: Vec<(String, u64)>,
    },
    /// The sender leads `term` (or believes it does): the committed verdicts up to `upto`.
    Append { term: u64, upto: usize },
}

struct InFlight {
    at_ms: u64,
    from: u32,
    from_inc: u64,
    to: u32,
    wire: Wire,
}

/// A declaration on its way through the metadata log.
struct Proposal {
    at_ms: u64,
    by: u32,
    by_inc: u64,
    term: u64,
    peer: String,
    inc: u64,
}

struct Node {
    up: bool,
    incarnation: u64,
    members: Membership<()>,
    verdicts: Verdicts,
    /// Its failure-detection duties (the daemon's): at 3 to 5 nodes every node watches every
    /// other, so the leader's own observation declares (the reports of the others, which a
    /// larger cluster needs, are `watch_sim.rs`'s).
    duties: Duties,
    /// How many of the committed verdicts this node applied (on its disk: kept across restarts).
    applied: usize,
    /// The leader this node knows, and its term.
    leader: Option<(u32, u64)>,
    /// The term this incarnation leads, as it believes.
    leads: Option<u64>,
    /// Paused (stopped, state kept) until then.
    paused_until_ms: u64,
    /// Its detector started or woke from a stall: it finds nobody silent until then.
    quiet_until_ms: u64,
    next_heartbeat_ms: u64,
    restart_at_ms: u64,
}

/// What a seed did.
#[derive(Default)]
struct Counts {
    verdicts: u64,
    refused: u64,
    fences: u64,
    fenced_drops: u64,
    stale_leader_steps: u64,
    pauses: u64,
    cuts: u64,
}

struct World {
    seed: u64,
    rng: SplitMix64,
    now_ms: u64,
    nodes: Vec<Node>,
    net: Vec<InFlight>,
    /// The committed verdicts, in log order.
    committed: Vec<(String, u64)>,
    /// The metadata's leader: (node, its incarnation, term).
    leader: Option<(u32, u64, u64)>,
    term: u64,
    /// Since when the leader could not lead.
    leaderless_since_ms: Option<u64>,
    proposals: Vec<Proposal>,
    /// Directed links cut until then: everything sent on them is lost.
    cut_until_ms: BTreeMap<(u32, u32), u64>,
    /// Directed links that delay every message past the failure timeout until then.
    slow_until_ms: BTreeMap<(u32, u32), u64>,
    counts: Counts,
    trace: bool,
    /// Who watches whom (everyone everyone, at this size).
    topology: Topology,
}

fn name(i: u32) -> String {
    format!("v{i}")
}

/// The verdicts of a prefix of the log: peer → highest incarnation declared down.
fn table(verdicts: &[(String, u64)]) -> BTreeMap<String, u64> {
    let mut t = BTreeMap::new();
    for (p, d) in verdicts {
        let e = t.entry(p.clone()).or_insert(0);
        *e = (*e).max(*d);
    }
    t
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = SplitMix64::new(seed);
        let n = 3 + rng.below(3) as u32;
        let nodes = (0..n)
            .map(|i| Node {
                up: true,
                incarnation: 1,
                members: Membership::new((0..n).filter(|&j| j != i).map(name), TIMEOUT_MS, 0),
                verdicts: Verdicts::new(name(i), 1),
                duties: Duties::new(name(i), HEARTBEAT_MS, TIMEOUT_MS),
                applied: 0,
                leader: None,
                leads: None,
                paused_until_ms: 0,
                quiet_until_ms: TIMEOUT_MS,
                next_heartbeat_ms: 0,
                restart_at_ms: 0,
            })
            .collect();
        World {
            seed,
            rng,
            now_ms: 0,
            nodes,
            net: Vec::new(),
            committed: Vec::new(),
            leader: None,
            term: 0,
            leaderless_since_ms: Some(0),
            proposals: Vec::new(),
            cut_until_ms: BTreeMap::new(),
            slow_until_ms: BTreeMap::new(),
            counts: Counts::default(),
            trace: std::env::var_os("PSLS_SIM_TRACE").is_some(),
            topology: Topology::new((0..n).map(|i| (name(i), name(i))), n as usize),
        }
    }

    fn fail(&self, what: String) -> ! {
        panic!("verdict simulation seed {} at {} ms: {what}", self.seed, self.now_ms);
    }

    fn n(&self) -> u32 {
        self.nodes.len() as u32
    }

    fn paused(&self, i: u32) -> bool {
        self.nodes[i as usize].paused_until_ms > self.now_ms
    }

    fn slow(&self, from: u32, to: u32) -> bool {
        self.slow_until_ms.get(&(from, to)).is_some_and(|&t| t > self.now_ms)
    }

    fn cut(&self, from: u32, to: u32) -> bool {
        self.cut_until_ms.get(&(from, to)).is_some_and(|&t| t > self.now_ms)
    }

    fn delay_ms(&mut self, chaos: bool, from: u32, to: u32) -> u64 {
        if chaos && (self.slow(from, to) || self.rng.chance(15)) {
            1200 + self.rng.below(1300)
        } else {
            1 + self.rng.below(80)
        }
    }

    /// Sends on the link `from` → `to`, unless it is cut.
    fn send(&mut self, chaos: bool, from: u32, to: u32, wire: Wire) {
        if chaos && self.cut(from, to) {
            return;
        }
        let at_ms = self.now_ms + self.delay_ms(chaos, from, to);
        let from_inc = self.nodes[from as usize].incarnation;
        self.net.push(InFlight {
            at_ms,
            from,
            from_inc,
            to,
            wire,
        });
    }

    /// The committed verdicts node `i` applied.
    fn applied(&self, i: u32) -> BTreeMap<String, u64> {
        table(&self.committed[..self.nodes[i as usize].applied])
    }

    /// Whether the committed verdicts declare incarnation `inc` of node `i` down.
    fn declared(&self, i: u32, inc: u64) -> bool {
        self.committed.iter().any(|(p, d)| *p == name(i) && *d >= inc)
    }

    /// What the daemon does after applying metadata: reads the committed verdicts, and fences
    /// itself when one names this incarnation.
    fn install_verdicts(&mut self, i: u32) {
        let down = self.applied(i);
        self.nodes[i as usize].verdicts.handle_committed(&down);
        self.maybe_fence(i);
    }

    fn maybe_fence(&mut self, i: u32) {
        let Some(f) = self.nodes[i as usize].verdicts.poll_fence() else {
            return;
        };
        if self.trace {
            eprintln!("{} FENCE v{i}: {f:?}", self.now_ms);
        }
        let inc = self.nodes[i as usize].incarnation;
        if f.declared < inc || !self.declared(i, f.declared) {
            self.fail(format!(
                "v{i} (incarnation {inc}) fenced itself on no committed verdict: {f:?}"
            ));
        }
        self.counts.fences += 1;
        self.crash(i);
        self.restart(i);
    }

    /// Whether node `i` can lead the metadata: it runs, holds its lease, is not declared down,
    /// and talks both ways with a majority.
    fn can_lead(&self, i: u32) -> bool {
        let node = &self.nodes[i as usize];
        if !node.up || self.paused(i) || self.declared(i, node.incarnation) || !node.members.lease_held(self.now_ms) {
            return false;
        }
        let talks = |j: u32| {
            j == i
                || (self.nodes[j as usize].up
                    && !self.paused(j)
                    && !self.cut(i, j)
                    && !self.cut(j, i)
                    && !self.slow(i, j)
                    && !self.slow(j, i))
        };
        (0..self.n()).filter(|&j| talks(j)).count() * 2 > self.nodes.len()
    }

    /// Whether the metadata's leader can lead now.
    fn leader_ok(&self) -> bool {
        self.leader.is_some_and(|(l, inc, term)| {
            let node = &self.nodes[l as usize];
            node.incarnation == inc && node.leads == Some(term) && self.can_lead(l)
        })
    }

    /// The metadata's election: a failure timeout after the leader stopped being able to lead,
    /// a node that can is elected in a new term (it applies every committed verdict first).
    fn elect(&mut self) {
        if self.leader_ok() {
            self.leaderless_since_ms = None;
            return;
        }
        let since = *self.leaderless_since_ms.get_or_insert(self.now_ms);
        if self.now_ms.saturating_sub(since) <= TIMEOUT_MS {
            return;
        }
        let candidates: Vec<u32> = (0..self.n()).filter(|&i| self.can_lead(i)).collect();
        if candidates.is_empty() {
            return;
        }
        let l = candidates[self.rng.below(candidates.len() as u64) as usize];
        self.term += 1;
        let term = self.term;
        if self.trace {
            eprintln!("{} ELECTED v{l} term {term}", self.now_ms);
        }
        let node = &mut self.nodes[l as usize];
        self.leader = Some((l, node.incarnation, term));
        node.leads = Some(term);
        node.leader = Some((l, term));
        node.applied = self.committed.len();
        self.leaderless_since_ms = None;
        self.install_verdicts(l);
    }

    /// Node `i` no longer leads (its lease lapsed, or it heard of a newer term).
    fn step_down(&mut self, i: u32) {
        if self.trace {
            eprintln!("{} v{i} steps down", self.now_ms);
        }
        let node = &mut self.nodes[i as usize];
        node.leads = None;
        if self.leader.is_some_and(|(l, inc, _)| l == i && inc == node.incarnation) {
            self.leader = None;
            self.leaderless_since_ms.get_or_insert(self.now_ms);
        }
    }

    /// Declarations whose proposal reached the log: committed if the proposer still leads.
    fn commit_due(&mut self) {
        let now_ms = self.now_ms;
        let mut due = Vec::new();
        for mut p in std::mem::take(&mut self.proposals) {
            if p.at_ms > now_ms {
                self.proposals.push(p);
            } else if self.paused(p.by) {
                // The proposer's process is stopped: its proposal waits with it.
                p.at_ms = self.nodes[p.by as usize].paused_until_ms;
                self.proposals.push(p);
            } else {
                due.push(p);
            }
        }
        for p in due {
            let node = &self.nodes[p.by as usize];
            if !node.up || node.incarnation != p.by_inc {
                // Lost with its proposer, and nobody waits for its answer.
                continue;
            }
            if self.leader == Some((p.by, p.by_inc, p.term)) && self.can_lead(p.by) {
                if self.trace {
                    eprintln!(
                        "{now_ms} COMMITTED {} incarnation {} down (by v{})",
                        p.peer, p.inc, p.by
                    );
                }
                self.committed.push((p.peer.clone(), p.inc));
                self.counts.verdicts += 1;
                self.nodes[p.by as usize].applied = self.committed.len();
                self.install_verdicts(p.by);
            } else {
                if self.trace {
                    eprintln!("{now_ms} v{} no longer leads: {} not declared", p.by, p.peer);
                }
                self.counts.refused += 1;
            }
            // Committed or not, the submission is answered (the next tick proposes it again).
            let node = &mut self.nodes[p.by as usize];
            if node.up && node.incarnation == p.by_inc {
                node.verdicts.handle_declared(&p.peer);
            }
        }
    }

    /// The daemon's rules for what node `i`'s verdict book proposes now.
    fn check_declarations(&self, i: u32, coordinating: bool, out: &[(String, u64)]) {
        let node = &self.nodes[i as usize];
        if !coordinating && !out.is_empty() {
            self.fail(format!("v{i} declared {out:?} without leading and holding its lease"));
        }
        if !out.is_empty() {
            // The lease, counted apart from the detector: a majority heard within the timeout.
            let heard = (0..self.n())
                .filter(|&j| {
                    j == i
                        || node
                            .members
                            .view(&name(j))
                            .and_then(|v| v.last_heard_ms)
                            .is_some_and(|t| self.now_ms - t <= TIMEOUT_MS)
                })
                .count();
            if heard * 2 <= self.nodes.len() {
                self.fail(format!(
                    "v{i} declared {out:?} having heard only {heard} nodes within the timeout"
                ));
            }
        }
        for (peer, inc) in out {
            let Some(j) = (0..self.n()).find(|&j| name(j) == *peer) else {
                self.fail(format!("v{i} declared an unknown node {peer}"));
            };
            if j == i {
                self.fail(format!("v{i} declared itself"));
            }
            let real = self.nodes[j as usize].incarnation;
            if *inc == 0 || *inc > real {
                self.fail(format!("v{i} declared {peer} at incarnation {inc}, which runs {real}"));
            }
            if !node.verdicts.accepts(peer, *inc) {
                self.fail(format!("v{i} declared {peer} at incarnation {inc} again"));
            }
            if self.now_ms <= node.quiet_until_ms {
                self.fail(format!(
                    "v{i} declared {peer} within a timeout of its start or its wake-up ({})",
                    node.quiet_until_ms
                ));
            }
            let heard = node.members.view(peer).and_then(|v| v.last_heard_ms);
            if heard.is_some_and(|t| self.now_ms - t <= TIMEOUT_MS) {
                self.fail(format!("v{i} declared {peer}, heard at {heard:?}"));
            }
        }
    }

    fn check(&mut self) {
        let believers = (0..self.n())
            .filter(|&i| self.nodes[i as usize].up && self.nodes[i as usize].leads.is_some())
            .count();
        if believers > 1 {
            self.counts.stale_leader_steps += 1;
        }
        for i in 0..self.n() {
            let node = &self.nodes[i as usize];
            if !node.up {
                continue;
            }
            let applied = self.applied(i);
            if *node.verdicts.committed() != applied {
                self.fail(format!(
                    "v{i}'s verdict book {:?} is not the verdicts it applied {applied:?}",
                    node.verdicts.committed()
                ));
            }
            if applied.get(&name(i)).is_some_and(|&d| d >= node.incarnation) {
                self.fail(format!(
                    "v{i} runs on incarnation {} that it knows declared down",
                    node.incarnation
                ));
            }
        }
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
        node.members = Membership::new((0..n).filter(|&j| j != i).map(name), TIMEOUT_MS, now_ms);
        node.verdicts = Verdicts::new(name(i), node.incarnation);
        node.duties = Duties::new(name(i), HEARTBEAT_MS, TIMEOUT_MS);
        node.leader = None;
        node.leads = None;
        node.paused_until_ms = 0;
        node.quiet_until_ms = now_ms + TIMEOUT_MS;
        node.next_heartbeat_ms = now_ms;
        self.install_verdicts(i);
    }

    fn deliver(&mut self, mut m: InFlight) {
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
        if self.paused(m.to) {
            m.at_ms = self.nodes[to].paused_until_ms + self.rng.below(150);
            self.net.push(m);
            return;
        }
        let from = name(m.from);
        // Checked apart from the verdict book: the committed verdicts the receiver applied.
        let declared = self.applied(m.to).get(&from).is_some_and(|&d| d >= m.from_inc);
        let taken = match m.wire {
            Wire::Heartbeat {
                incarnation,
                down,
                heard,
            } => {
                let now_ms = self.now_ms;
                let node = &mut self.nodes[to];
                let down = down.iter().map(|(p, d)| (p.as_str(), *d));
                let heard = heard.iter().map(|(p, i)| (p.as_str(), *i));
                let taken = node.verdicts.handle_heartbeat(&from, incarnation, down, heard);
                if taken {
                    node.members.heard(now_ms, &from, incarnation, ());
                    node.duties.handle_heard(now_ms, &from, incarnation);
                }
                self.maybe_fence(m.to);
                taken
            }
            Wire::Append { term, upto } => {
                let taken = self.nodes[to].verdicts.accepts(&from, m.from_inc);
                if taken && self.nodes[to].leader.is_none_or(|(_, t)| t <= term) {
                    self.nodes[to].leader = Some((m.from, term));
                    if self.nodes[to].leads.is_some_and(|t| t < term) {
                        self.step_down(m.to);
                    }
                    if upto > self.nodes[to].applied {
                        self.nodes[to].applied = upto;
                        self.install_verdicts(m.to);
                    }
                }
                taken
            }
        };
        if !taken {
            if self.trace {
                eprintln!("{} v{} drops from fenced v{}", self.now_ms, m.to, m.from);
            }
            self.counts.fenced_drops += 1;
        } else if declared {
            self.fail(format!(
                "v{} took a message from v{} incarnation {}, declared down",
                m.to, m.from, m.from_inc
            ));
        }
    }

    /// Node `i`'s periodic work, as the daemon's: heartbeats (and appends, while it leads), the
    /// detector's tick, check-quorum, and the coordinator's declarations.
    fn tick(&mut self, i: u32, chaos: bool) {
        let now_ms = self.now_ms;
        if now_ms >= self.nodes[i as usize].next_heartbeat_ms {
            self.nodes[i as usize].next_heartbeat_ms = now_ms + HEARTBEAT_MS;
            let node = &self.nodes[i as usize];
            let inc = node.incarnation;
            let down: Vec<(String, u64)> = node.verdicts.committed().iter().map(|(p, d)| (p.clone(), *d)).collect();
            let heard: Vec<(String, u64)> = (0..self.n())
                .filter_map(|j| {
                    node.members
                        .view(&name(j))
                        .and_then(|v| v.incarnation)
                        .map(|x| (name(j), x))
                })
                .collect();
            let append = node.leads.map(|term| Wire::Append {
                term,
                upto: node.applied,
            });
            for j in (0..self.n()).filter(|&j| j != i) {
                let wire = Wire::Heartbeat {
                    incarnation: inc,
                    down: down.clone(),
                    heard: heard.clone(),
                };
                self.send(chaos, i, j, wire);
                if let Some(Wire::Append { term, upto }) = append {
                    self.send(chaos, i, j, Wire::Append { term, upto });
                }
            }
        }
        let silent = self.nodes[i as usize].members.tick(now_ms);
        let lease = self.nodes[i as usize].members.lease_held(now_ms);
        if self.nodes[i as usize].leads.is_some() && !lease {
            self.step_down(i);
        }
        // The daemon's `watch_duties`: the leader, holding its lease, declares every peer
        // silent past the timeout at the newest incarnation it heard.
        let coordinating = self.nodes[i as usize].leads.is_some() && lease;
        let leader = self.nodes[i as usize].leader.map(|(l, _)| name(l));
        let node = &mut self.nodes[i as usize];
        let silent: Vec<(String, u64)> = silent
            .into_iter()
            .map(|(p, _)| {
                let inc = node.members.view(&p).and_then(|v| v.incarnation).unwrap_or(0);
                (p, inc)
            })
            .filter(|(p, inc)| node.verdicts.accepts(p, *inc))
            .collect();
        let duties = node.duties.handle_tick(
            now_ms,
            silent,
            coordinating,
            leader.as_deref(),
            Vec::new(),
            &self.topology,
            &mut node.verdicts,
        );
        let out: Vec<(String, u64)> = duties
            .into_iter()
            .filter_map(|d| match d {
                Duty::Declare { peer, incarnation, .. } => Some((peer, incarnation)),
                // Every node watches every other: the leader observes for itself.
                Duty::Report { .. } => None,
            })
            .collect();
        self.check_declarations(i, coordinating, &out);
        let (inc, term) = (self.nodes[i as usize].incarnation, self.nodes[i as usize].leads);
        for (peer, d) in out {
            if self.trace {
                eprintln!("{now_ms} v{i} declares {peer} incarnation {d} down");
            }
            let at_ms = now_ms + 1 + self.rng.below(80);
            self.proposals.push(Proposal {
                at_ms,
                by: i,
                by_inc: inc,
                term: term.unwrap_or(0),
                peer,
                inc: d,
            });
        }
    }

    /// One step: time passes, due messages arrive, declarations commit, nodes tick, the
    /// metadata elects, maybe some chaos.
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
            self.deliver(m);
        }
        self.commit_due();
        for i in 0..self.n() {
            if !self.nodes[i as usize].up {
                if chaos && now_ms >= self.nodes[i as usize].restart_at_ms {
                    self.restart(i);
                } else {
                    continue;
                }
            }
            if !self.paused(i) {
                self.tick(i, chaos);
            }
        }
        self.elect();
        if chaos {
            self.chaos();
        }
        self.check();
    }

    fn chaos(&mut self) {
        let now_ms = self.now_ms;
        let n = self.n() as u64;
        // A slow link: one node, or a pair both ways, stops hearing another in time.
        if self.rng.chance(6) {
            let (a, b) = (self.rng.below(n) as u32, self.rng.below(n) as u32);
            let until_ms = now_ms + 500 + self.rng.below(3000);
            if a != b {
                self.slow_until_ms.insert((a, b), until_ms);
                if self.rng.chance(500) {
                    self.slow_until_ms.insert((b, a), until_ms);
                }
            }
        }
        // A pause: the process stops, state kept, for up to three failure timeouts. One of
        // more than half a timeout is a stall to its detector: it suspects nobody for a
        // timeout after it wakes.
        if self.rng.chance(10) {
            let i = self.rng.below(n) as u32;
            if self.nodes[i as usize].up && !self.paused(i) {
                let pause_ms = 200 + self.rng.below(3 * TIMEOUT_MS);
                let until_ms = now_ms + pause_ms;
                if self.trace {
                    eprintln!("{now_ms} PAUSE v{i} until {until_ms}");
                }
                let node = &mut self.nodes[i as usize];
                node.paused_until_ms = until_ms;
                if pause_ms > TIMEOUT_MS / 2 {
                    node.quiet_until_ms = node.quiet_until_ms.max(until_ms + TIMEOUT_MS);
                }
                self.counts.pauses += 1;
            }
        }
        // A cut link, one way or both: what is sent on it is lost.
        if self.rng.chance(10) {
            let (a, b) = (self.rng.below(n) as u32, self.rng.below(n) as u32);
            if a != b {
                let until_ms = now_ms + 300 + self.rng.below(4 * TIMEOUT_MS);
                self.cut_until_ms.insert((a, b), until_ms);
                if self.rng.chance(500) {
                    self.cut_until_ms.insert((b, a), until_ms);
                }
                self.counts.cuts += 1;
            }
        }
        // A node cut off from every other, both ways (the leader half the time).
        if self.rng.chance(3) {
            let a = match self.leader {
                Some((l, _, _)) if self.rng.chance(500) => l,
                _ => self.rng.below(n) as u32,
            };
            let until_ms = now_ms + 500 + self.rng.below(3 * TIMEOUT_MS);
            for b in (0..self.n()).filter(|&b| b != a) {
                self.cut_until_ms.insert((a, b), until_ms);
                self.cut_until_ms.insert((b, a), until_ms);
            }
            self.counts.cuts += 1;
        }
        if self.rng.chance(8) {
            let i = self.rng.below(n) as u32;
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
        // The leader.
        if self.rng.chance(4) {
            if let Some((l, inc, _)) = self.leader {
                if self.nodes[l as usize].up && self.nodes[l as usize].incarnation == inc {
                    self.crash(l);
                }
            }
        }
    }

    /// Whether the cluster settled: one leader that every node knows and takes as its
    /// coordinator, every node holding its lease, at the last verdict, and up in every
    /// detector.
    fn settled(&self) -> bool {
        let Some((l, _, term)) = self.leader.filter(|_| self.leader_ok()) else {
            return false;
        };
        let leader = name(l);
        self.proposals.is_empty()
            && (0..self.n()).all(|i| {
                let node = &self.nodes[i as usize];
                let lease = node.members.lease_held(self.now_ms);
                node.up
                    && node.leader == Some((l, term))
                    && verdicts::coordinator(&name(i), Some(&leader), lease) == Some(leader.as_str())
                    && lease
                    && node.applied == self.committed.len()
                    && (0..self.n())
                        .filter(|&j| j != i)
                        .all(|j| node.members.state(self.now_ms, &name(j)) == Liveness::Up)
            })
    }
}

fn run_seed(seed: u64) -> Counts {
    let mut w = World::new(seed);
    for _ in 0..STEPS {
        w.step(true);
    }
    // Calm: every node back, no more crashes, pauses, cuts or long delays (a pause under way
    // ends in its time: its detector then finds it a stall).
    for i in 0..w.n() {
        if !w.nodes[i as usize].up {
            w.restart(i);
        }
    }
    w.cut_until_ms.clear();
    w.slow_until_ms.clear();
    let calm_from_ms = w.now_ms;
    let mut settled = false;
    for _ in 0..2000 {
        w.step(false);
        if w.now_ms > calm_from_ms + 3 * TIMEOUT_MS && w.settled() {
            settled = true;
            break;
        }
    }
    if !settled {
        w.fail("the cluster did not settle on one leader with every node up in every view".into());
    }
    // A calm cluster declares nobody and fences nobody.
    let (verdicts, fences) = (w.committed.len(), w.counts.fences);
    let quiet_from_ms = w.now_ms;
    while w.now_ms < quiet_from_ms + 3 * TIMEOUT_MS {
        w.step(false);
    }
    if w.committed.len() != verdicts || w.counts.fences != fences {
        w.fail(format!(
            "a calm cluster declared a node down: {:?}",
            &w.committed[verdicts..]
        ));
    }
    if !w.settled() {
        w.fail("the calm cluster did not stay settled".into());
    }
    w.counts
}

#[test]
fn random_schedules_declare_only_silent_nodes_and_fence_them() {
    let seeds = common::seeds(1000);
    let count = seeds.end - seeds.start;
    let mut t = Counts::default();
    for seed in seeds {
        let c = run_seed(seed);
        t.verdicts += c.verdicts;
        t.refused += c.refused;
        t.fences += c.fences;
        t.fenced_drops += c.fenced_drops;
        t.stale_leader_steps += c.stale_leader_steps;
        t.pauses += c.pauses;
        t.cuts += c.cuts;
    }
    eprintln!(
        "{count} seeds: {} down verdicts committed, {} declarations refused (no longer leading), \
         {} nodes fenced themselves, {} messages of fenced incarnations dropped, {} steps with a \
         stale leader; {} pauses, {} cut links",
        t.verdicts, t.refused, t.fences, t.fenced_drops, t.stale_leader_steps, t.pauses, t.cuts
    );
    if count >= 100 {
        // The schedules must really exercise the failure paths.
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
        assert!(t.refused > 0, "no declaration was ever refused to a stale leader");
        assert!(t.stale_leader_steps > 0, "no leader was ever stale");
    }
}
