//! Seeded simulator of the metadata log ([`psls_cluster::log`]): eight nodes, five of them
//! voters at first and the others followers pulling the committed entries, running the real
//! machine over a simulated network and simulated disks, with crashes (restarts from what was
//! persisted), pauses, partitions, message loss and reordering, disks lost for good, and
//! snapshot installs (the log is compacted after a few entries), disks failing for a while
//! (a leader that may not lead hands its leadership over), and nodes lost for good one at a
//! time (the leader replaces a lost voter with a follower, [`psls_cluster::voters::plan`],
//! through a joint configuration).
//!
//! The state is a small key-value map whose operations do not commute and are not idempotent
//! (`Add`), so an entry applied twice, skipped or reordered shows.
//! Checked after every step:
//! - no two nodes apply different entries at the same index;
//! - at most one leader per term;
//! - an operation answered `Ok(i)` is the one every node applies at `i`, across any crash;
//! - a node's per-key table on disk equals the result of applying the log from the start up to
//!   its durable applied index;
//! - a node's applied index never goes back, not even across a crash;
//! - a read answered `Ok(i)` covers every operation answered `Ok` before it began;
//! - the voters of the most advanced configuration have a live majority (in both halves of a
//!   joint one): the log never loses its majority to permanent losses one at a time.
//!
//! At the end, with every fault healed, every node still there (followers too) converges on the
//! same state holding every operation answered `Ok`, and no voter lost for good is a voter.
//!
//! `PSLS_SIM_SEED=N` runs one seed (`PSLS_SIM_TRACE=1` prints every event);
//! `PSLS_SIM_SEEDS=N` runs seeds 0..N.

mod common;

use psls_cluster::log::{Action, Durable, Limits, Log, Machine, Persist, ReadError, SubmitError, Wire};
use psls_cluster::voters::{self, Candidate};
use raft::eraftpb::{ConfState, Entry, EntryType, HardState, Message, MessageType};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

const VOTERS: u32 = 5;
/// Nodes of the simulated cluster (the first [`VOTERS`] vote at first).
const NODES: u32 = 8;
/// Nodes lost for good in a run, at most (one at a time).
const MAX_GONE: usize = 2;

fn first_conf() -> ConfState {
    psls_cluster::log::conf_of(&(0..VOTERS).collect::<Vec<u32>>())
}

fn domain_of(n: u32) -> &'static str {
    ["rack-a", "rack-b", "rack-c"][n as usize % 3]
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
enum Op {
    /// Adds `delta` to key `key` (id: a unique number, to find the op again).
    Add { id: u64, key: u8, delta: u64 },
    /// Always refused.
    Refuse { id: u64 },
}

impl Op {
    fn id(&self) -> u64 {
        match self {
            Op::Add { id, .. } | Op::Refuse { id } => *id,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
struct Kv {
    index: u64,
    map: BTreeMap<u8, u64>,
    #[serde(skip)]
    touched: BTreeSet<u8>,
}

/// Changes: key → new value (`None`: gone).
type Changes = BTreeMap<u8, Option<u64>>;

impl Machine for Kv {
    type Op = Op;
    type Error = String;
    type Changes = Changes;
    fn index(&self) -> u64 {
        self.index
    }
    fn apply(&mut self, index: u64, op: &Op) -> Result<(), String> {
        assert_eq!(index, self.index + 1);
        self.index = index;
        match op {
            Op::Add { key, delta, .. } => {
                let v = self.map.entry(*key).or_insert(0);
                *v = v.wrapping_mul(31).wrapping_add(*delta);
                self.touched.insert(*key);
                Ok(())
            }
            Op::Refuse { id } => Err(format!("refused {id}")),
        }
    }
    fn skip(&mut self, index: u64) {
        assert_eq!(index, self.index + 1);
        self.index = index;
    }
    fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.touched)
            .into_iter()
            .map(|k| (k, self.map.get(&k).copied()))
            .collect()
    }
    fn all_changes(&self) -> Changes {
        self.map.iter().map(|(k, v)| (*k, Some(*v))).collect()
    }
    fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("serializes")
    }
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        postcard::from_bytes(bytes).map_err(|e| e.to_string())
    }
    fn merge_changes(earlier: &mut Changes, later: Changes) {
        earlier.extend(later);
    }
}

/// One node's disk: what survives a crash (`durable`) and what a crash loses (`volatile`, the
/// writes not followed by a synced one).
#[derive(Clone, Debug, Default)]
struct Disk {
    hard_state: HardState,
    compacted: (u64, u64),
    entries: BTreeMap<u64, Entry>,
    table: BTreeMap<u8, u64>,
    applied: (u64, u64),
    amnesiac: bool,
    conf: Option<ConfState>,
}

impl Disk {
    fn write(&mut self, p: &Persist<Kv>) {
        self.hard_state = p.hard_state.clone();
        if let Some((i, t)) = p.snapshot {
            self.entries.clear();
            self.compacted = (i, t);
            self.table.clear();
        }
        if let Some(first) = p.entries.first() {
            self.entries.split_off(&first.index);
            for e in &p.entries {
                self.entries.insert(e.index, e.clone());
            }
        }
        for (k, v) in &p.changes {
            match v {
                Some(v) => self.table.insert(*k, *v),
                None => self.table.remove(k),
            };
        }
        self.applied = p.applied;
        self.amnesiac = p.amnesiac;
        if let Some(c) = &p.conf {
            self.conf = Some(c.clone());
        }
    }

    fn compact(&mut self, p: &Persist<Kv>) {
        if let Some((i, t)) = p.compact_to {
            self.entries = self.entries.split_off(&(i + 1));
            self.compacted = (i, t);
        }
    }

    fn durable(&self) -> Durable<Kv> {
        Durable {
            hard_state: self.hard_state.clone(),
            compacted: self.compacted,
            entries: self.entries.values().cloned().collect(),
            state: Kv {
                index: self.applied.0,
                map: self.table.clone(),
                touched: BTreeSet::new(),
            },
            applied_term: self.applied.1,
            amnesiac: self.amnesiac,
            legacy: None,
            conf: self.conf.clone(),
        }
    }
}

struct Node {
    log: Option<Log<Kv, u64>>,
    durable: Disk,
    volatile: Disk,
    paused: bool,
    /// Its disk failed for a while: it may not lead (a leader hands its leadership over).
    ineligible: bool,
    incarnation: u64,
    /// Reads in flight: token → the highest index answered `Ok` when it began.
    reads: BTreeMap<u64, u64>,
}

#[derive(Default)]
struct Counts {
    ok: u64,
    dropped: u64,
    rejected: u64,
    not_leader: u64,
    reads_ok: u64,
    crashes: u64,
    disk_losses: u64,
    pauses: u64,
    partitions: u64,
    snapshots_installed: u64,
    compactions: u64,
    lost_msgs: u64,
    /// Leaders that became ineligible (and handed their leadership over).
    hand_overs: u64,
    /// Nodes lost for good, voters among them.
    gone: u64,
    gone_voters: u64,
    /// Changes of voters proposed, and configurations applied somewhere.
    conf_proposals: u64,
    /// Reads answered on followers.
    follower_reads: u64,
}

struct Sim {
    /// Nodes of the cluster (the first [`VOTERS`] vote at first).
    n: u32,
    rng: psls_svm::rng::SplitMix64,
    nodes: Vec<Node>,
    limits: Limits,
    /// Messages in flight: (from, to, message).
    net: Vec<(u32, u32, Wire)>,
    /// Links cut: (from, to).
    cut: BTreeSet<(u32, u32)>,
    /// The entry every node applied at each index: (term, op id or none).
    applied: BTreeMap<u64, Option<u64>>,
    /// The state after applying the log up to each index (index 0: empty).
    states: Vec<BTreeMap<u8, u64>>,
    /// Operations answered Ok: op id → index.
    acked: BTreeMap<u64, u64>,
    /// Leader of each term.
    leaders: BTreeMap<u64, u32>,
    next_id: u64,
    next_token: u64,
    /// Submissions in flight: token → op.
    submitted: BTreeMap<u64, Op>,
    counts: Counts,
    /// Nodes lost for good.
    gone: BTreeSet<u32>,
    /// Messages each node sent or took (the idle count).
    handled: Vec<u64>,
    trace: bool,
    seed: u64,
}

/// The simulator's limits: small, so that compaction and snapshots happen.
fn sim_limits() -> Limits {
    Limits {
        election_ticks: 10,
        heartbeat_ticks: 2,
        max_pending: 64,
        max_reads: 64,
        max_msg_bytes: 512,
        max_inflight: 8,
        compact_after: 12,
        keep_behind: 4,
        read_retry_ticks: 10,
        follow_wait_ticks: 20,
        follow_fanout: 2,
    }
}

impl Sim {
    fn new(seed: u64) -> Sim {
        Sim::sized(seed, NODES)
    }

    fn sized(seed: u64, nodes_n: u32) -> Sim {
        let limits = sim_limits();
        let nodes = (0..nodes_n)
            .map(|v| Node {
                log: Some(
                    Log::new(
                        v,
                        nodes_n,
                        limits,
                        Durable {
                            conf: Some(first_conf()),
                            ..Durable::fresh(false)
                        },
                        seed * 100 + v as u64,
                    )
                    .expect("starts"),
                ),
                durable: Disk {
                    conf: Some(first_conf()),
                    ..Disk::default()
                },
                volatile: Disk {
                    conf: Some(first_conf()),
                    ..Disk::default()
                },
                paused: false,
                ineligible: false,
                incarnation: 0,
                reads: BTreeMap::new(),
            })
            .collect();
        Sim {
            n: nodes_n,
            rng: psls_svm::rng::SplitMix64::new(seed),
            nodes,
            limits,
            net: Vec::new(),
            cut: BTreeSet::new(),
            applied: BTreeMap::new(),
            states: vec![BTreeMap::new()],
            acked: BTreeMap::new(),
            leaders: BTreeMap::new(),
            next_id: 1,
            next_token: 1,
            submitted: BTreeMap::new(),
            counts: Counts::default(),
            gone: BTreeSet::new(),
            handled: vec![0; nodes_n as usize],
            trace: std::env::var_os("PSLS_SIM_TRACE").is_some(),
            seed,
        }
    }

    fn log(&mut self, v: u32) -> &mut Log<Kv, u64> {
        self.nodes[v as usize].log.as_mut().expect("running")
    }

    fn max_acked(&self) -> u64 {
        self.acked.values().copied().max().unwrap_or(0)
    }

    /// Carries out node `v`'s actions.
    fn drain(&mut self, v: u32) {
        // Answers are checked once the actions before and after them are carried out: a node
        // answers for entries committed by a quorum before it wrote them itself.
        let mut answered = Vec::new();
        loop {
            let Some(a) = self.nodes[v as usize].log.as_mut().and_then(|l| l.poll_action()) else {
                break;
            };
            match a {
                Action::Persist(p) => {
                    if p.snapshot.is_some() {
                        self.counts.snapshots_installed += 1;
                    }
                    if p.compact_to.is_some() {
                        self.counts.compactions += 1;
                    }
                    let n = &mut self.nodes[v as usize];
                    assert!(
                        p.applied.0 >= n.volatile.applied.0,
                        "seed {}: node {v}'s applied index went back",
                        self.seed
                    );
                    n.volatile.write(&p);
                    // What it applied, learnt before compaction takes the entries away.
                    self.learn(v);
                    let n = &mut self.nodes[v as usize];
                    n.volatile.compact(&p);
                    if p.sync {
                        n.durable = n.volatile.clone();
                    }
                    self.check_table(v);
                }
                Action::Send { to, msg } => {
                    self.handled[v as usize] += 1;
                    let snapshot = psls_cluster::log::is_snapshot(&msg);
                    if self.cut.contains(&(v, to)) || self.gone.contains(&to) {
                        // The shell sees the link down (or the node's address refuses).
                        self.counts.lost_msgs += 1;
                        self.log(v).handle_unreachable(to);
                    } else if self.rng.chance(20) {
                        // Lost on the way: the sender does not know.
                        self.counts.lost_msgs += 1;
                    } else {
                        self.net.push((v, to, msg));
                    }
                    if snapshot {
                        self.log(v).handle_snapshot_sent(to);
                    }
                }
                Action::Done { token, result } => {
                    let op = self.submitted.remove(&token).expect("answered once");
                    if self.trace {
                        eprintln!("node {v}: {op:?} answered {result:?}");
                    }
                    answered.push((op, result));
                }
                Action::Read { token, result } => {
                    self.read_answered(v, token, result);
                }
                Action::Halt { reason } => panic!("seed {}: node {v} halted: {reason}", self.seed),
            }
        }
        self.learn(v);
        for (op, result) in answered {
            match result {
                Ok(i) => {
                    assert_eq!(
                        self.applied.get(&i).copied().flatten(),
                        Some(op.id()),
                        "seed {}: op {op:?} answered Ok({i}) is not the entry applied there",
                        self.seed
                    );
                    self.acked.insert(op.id(), i);
                    self.counts.ok += 1;
                }
                Err(SubmitError::Dropped) => {
                    assert!(
                        !self.applied.values().any(|x| *x == Some(op.id())),
                        "seed {}: op {op:?} answered Dropped was applied",
                        self.seed
                    );
                    self.counts.dropped += 1;
                }
                Err(SubmitError::Rejected(_)) => {
                    assert!(matches!(op, Op::Refuse { .. }), "seed {}: {op:?} refused", self.seed);
                    self.counts.rejected += 1;
                }
                Err(SubmitError::NotLeader { .. } | SubmitError::Busy | SubmitError::Unknown) => {
                    self.counts.not_leader += 1
                }
                Err(SubmitError::Halted) => panic!("seed {}: node {v} halted", self.seed),
            }
        }
        self.record_applied(v);
    }

    fn read_answered(&mut self, v: u32, token: u64, result: Result<u64, ReadError>) {
        let floor = self.nodes[v as usize].reads.remove(&token).expect("read answered once");
        match result {
            Ok(i) => {
                assert!(
                    i >= floor,
                    "seed {}: read on node {v} answered at {i}, before op acked at {floor}",
                    self.seed
                );
                assert!(
                    self.log(v).applied() >= i,
                    "seed {}: read answered before applying",
                    self.seed
                );
                self.counts.reads_ok += 1;
                if !self.log(v).is_voter() {
                    self.counts.follower_reads += 1;
                }
            }
            Err(ReadError::NoLeader | ReadError::Busy) => {}
            Err(ReadError::Halted) => panic!("seed {}: node {v} halted", self.seed),
        }
    }

    /// Records what node `v` applied (checks it against every other node).
    fn record_applied(&mut self, v: u32) {
        let Some(l) = self.nodes[v as usize].log.as_ref() else {
            return;
        };
        if l.is_leader() {
            let term = l.term();
            if let Some(other) = self.leaders.insert(term, v) {
                assert_eq!(other, v, "seed {}: two leaders in term {term}", self.seed);
            }
        }
    }

    /// Node `v`'s per-key table equals the log applied from the start to its applied index.
    fn check_table(&mut self, v: u32) {
        let d = &self.nodes[v as usize].volatile;
        let i = d.applied.0 as usize;
        if let Some(want) = self.states.get(i) {
            assert_eq!(
                &d.table, want,
                "seed {}: node {v}'s table at index {i} is not the log's result",
                self.seed
            );
        }
        // The state in memory too.
        let st = self.nodes[v as usize].log.as_ref().map(|l| l.state().clone());
        if let Some(st) = st {
            if let Some(want) = self.states.get(st.index as usize) {
                assert_eq!(&st.map, want, "seed {}: node {v}'s state is not the log's", self.seed);
            }
        }
    }

    /// Learns the entries node `v` holds as committed: the reference log.
    fn learn(&mut self, v: u32) {
        let Some(l) = self.nodes[v as usize].log.as_ref() else {
            return;
        };
        let applied = l.applied();
        // The node's log entries up to its applied index, as written to its disk.
        let ents: Vec<Entry> = self.nodes[v as usize]
            .volatile
            .entries
            .range(..=applied)
            .map(|(_, e)| e.clone())
            .collect();
        for e in ents {
            let conf_change = e.get_entry_type() != EntryType::EntryNormal;
            let id = if e.data.is_empty() || conf_change {
                None
            } else {
                Some(psls_cluster::log::decode_op::<Op>(&e.data).expect("decodes").id())
            };
            match self.applied.get(&e.index) {
                Some(x) => assert_eq!(
                    *x, id,
                    "seed {}: node {v} applied another entry at index {}",
                    self.seed, e.index
                ),
                None => {
                    assert_eq!(
                        e.index as usize,
                        self.states.len(),
                        "seed {}: the reference log has a gap at {}",
                        self.seed,
                        e.index
                    );
                    self.applied.insert(e.index, id);
                    let mut next = self.states.last().cloned().unwrap_or_default();
                    let op = (!conf_change).then(|| psls_cluster::log::decode_op::<Op>(&e.data));
                    if let Some(Ok(Op::Add { key, delta, .. })) = op {
                        let x = next.entry(key).or_insert(0);
                        *x = x.wrapping_mul(31).wrapping_add(delta);
                    }
                    self.states.push(next);
                }
            }
        }
    }

    /// The leader with its lease changes the voters as [`voters::plan`] says (the simulator's
    /// view of who is usable stands for the failure detector's).
    fn plan_voters(&mut self) {
        let Some(l) = (0..self.n).find(|u| {
            let n = &self.nodes[*u as usize];
            !n.paused && n.log.as_ref().is_some_and(|l| l.lease_held())
        }) else {
            return;
        };
        if self.log(l).conf_changing() {
            return;
        }
        let cands: Vec<Candidate<'static>> = (0..self.n)
            .map(|c| {
                let n = &self.nodes[c as usize];
                Candidate {
                    id: c,
                    domain: domain_of(c),
                    usable: n.log.as_ref().is_some_and(|l| !l.lost_disk())
                        && !n.paused
                        && !n.ineligible
                        && !self.cut.contains(&(l, c))
                        && !self.cut.contains(&(c, l)),
                    gone: self.gone.contains(&c),
                }
            })
            .collect();
        let current = self.log(l).voters();
        if let Some(want) = voters::plan(&current, l, VOTERS as usize, &cands) {
            if self.trace || std::env::var_os("PSLS_SIM_CONF").is_some() {
                eprintln!(
                    "leader {l} (term {}): voters {current:?} -> {want:?}",
                    self.log(l).term()
                );
            }
            if self.log(l).propose_voters(&want).is_ok() {
                self.counts.conf_proposals += 1;
            }
            self.after(l);
        }
    }

    /// The most advanced configuration (of the running node that applied most) has a live
    /// majority in each half.
    fn check_voters(&self) {
        let Some(conf) = self
            .nodes
            .iter()
            .filter_map(|n| n.log.as_ref())
            .max_by_key(|l| l.applied())
            .map(|l| l.conf().clone())
        else {
            return;
        };
        for half in [&conf.voters, &conf.voters_outgoing] {
            if half.is_empty() {
                continue;
            }
            let live = half
                .iter()
                .filter(|id| !self.gone.contains(&((**id - 1) as u32)))
                .count();
            assert!(
                live > half.len() / 2,
                "seed {}: voters {half:?} with {:?} lost for good: no live majority",
                self.seed,
                self.gone
            );
        }
    }

    /// Loses node `v` for good (a voter only when the voters have none lost already and no
    /// change is under way: one at a time).
    fn lose_for_good(&mut self, v: u32) {
        if self.gone.len() >= MAX_GONE || self.gone.contains(&v) || self.amnesiacs() > 0 {
            return;
        }
        let Some(conf) = self
            .nodes
            .iter()
            .filter_map(|n| n.log.as_ref())
            .max_by_key(|l| l.applied())
            .map(|l| l.conf().clone())
        else {
            return;
        };
        let voters = psls_cluster::log::voters_of(&conf);
        // One at a time: the voters are whole again (as many as wanted, none lost) first.
        if !conf.voters_outgoing.is_empty()
            || voters.len() != VOTERS as usize
            || voters.iter().any(|x| self.gone.contains(x))
        {
            return;
        }
        // Every voter the most advanced configuration names must know it too, or a lagging
        // one could still count on the node.
        let settled = voters
            .iter()
            .all(|x| self.nodes[*x as usize].log.as_ref().is_some_and(|l| l.conf() == &conf));
        if !settled {
            return;
        }
        if self.trace {
            eprintln!("node {v} lost for good (voters {voters:?})");
        }
        self.nodes[v as usize].log = None;
        self.nodes[v as usize].reads.clear();
        self.gone.insert(v);
        self.counts.gone += 1;
        if voters.contains(&v) {
            self.counts.gone_voters += 1;
        }
    }

    fn step(&mut self) {
        let r = self.rng.below(1000);
        let v = self.rng.below(self.n as u64) as u32;
        if self.gone.contains(&v) && r >= 150 {
            return;
        }
        let running = self.nodes[v as usize].log.is_some() && !self.nodes[v as usize].paused;
        match r {
            0..=149 => {
                // Everyone's clock ticks (paused nodes' does not matter: they do nothing).
                for u in 0..self.n {
                    let n = &self.nodes[u as usize];
                    if n.log.is_some() && !n.paused {
                        self.log(u).handle_tick();
                        self.after(u);
                    }
                }
                self.plan_voters();
            }
            150..=699 => {
                // Deliver a few messages (any in flight: reordering).
                for _ in 0..6 {
                    self.deliver_one();
                }
            }
            700..=799 if running => {
                // Submitted where the node forwards it: to the leader it knows.
                let v = match self.log(v).leader() {
                    Some(l) if self.nodes[l as usize].log.is_some() && !self.nodes[l as usize].paused => l,
                    _ => v,
                };
                let id = self.next_id;
                self.next_id += 1;
                let op = if self.rng.chance(100) {
                    Op::Refuse { id }
                } else {
                    Op::Add {
                        id,
                        key: self.rng.below(6) as u8,
                        delta: self.rng.below(1000),
                    }
                };
                let token = self.next_token;
                self.next_token += 1;
                self.submitted.insert(token, op.clone());
                self.log(v).submit(token, &op);
                self.after(v);
            }
            800..=849 if running => {
                let token = self.next_token;
                self.next_token += 1;
                let floor = self.max_acked();
                self.nodes[v as usize].reads.insert(token, floor);
                self.log(v).read(token);
                self.after(v);
            }
            850..=859 => {
                // Crash (and restart at once from the disk), or a disk lost for good.
                if self.nodes[v as usize].log.is_none() {
                    return;
                }
                let lose = self.rng.chance(150) && self.amnesiacs() == 0;
                self.crash(v, lose);
            }
            860..=874 => {
                // Wake a paused node more often than pausing one.
                let v = match (0..self.n).find(|u| self.nodes[*u as usize].paused) {
                    Some(u) if self.rng.chance(600) => u,
                    _ => v,
                };
                let n = &mut self.nodes[v as usize];
                n.paused = !n.paused;
                if n.paused {
                    self.counts.pauses += 1;
                }
                if self.trace {
                    eprintln!("node {v} paused: {}", n.paused);
                }
            }
            875..=889 => {
                // Cut or heal links: one way, both ways, or all of one node's.
                match self.rng.below(6) {
                    0..=2 => self.cut.clear(),
                    3 => {
                        let u = self.rng.below(self.n as u64) as u32;
                        self.cut.insert((v, u));
                    }
                    4 => {
                        let u = self.rng.below(self.n as u64) as u32;
                        self.cut.insert((v, u));
                        self.cut.insert((u, v));
                    }
                    _ => {
                        for u in 0..self.n {
                            self.cut.insert((v, u));
                            self.cut.insert((u, v));
                        }
                    }
                }
                self.counts.partitions += 1;
            }
            890..=899 if running => {
                // A node's disk fails for a while (one at a time), or works again: a leader
                // that may not lead hands its leadership to the voter with the longest log.
                let n = &self.nodes[v as usize];
                let others = (0..self.n).any(|u| u != v && self.nodes[u as usize].ineligible);
                if !n.ineligible && others {
                    return;
                }
                let ineligible = !n.ineligible;
                if ineligible && self.log(v).is_leader() {
                    self.counts.hand_overs += 1;
                }
                if self.trace {
                    eprintln!("node {v} may lead: {}", !ineligible);
                }
                self.nodes[v as usize].ineligible = ineligible;
                self.log(v).set_eligible(!ineligible);
                self.after(v);
            }
            900..=902 => self.lose_for_good(v),
            _ => {}
        }
        self.check_voters();
    }

    fn status(&self, i: usize) {
        let roles: Vec<String> = (0..self.n)
            .filter(|u| !self.gone.contains(u))
            .map(|u| {
                let n = &self.nodes[u as usize];
                let l = n.log.as_ref().expect("running");
                format!(
                    "{}{}{}t{}c{}a{}f{}l{}",
                    if n.paused { "P" } else { "" },
                    if l.amnesiac() { "A" } else { "" },
                    if l.is_leader() {
                        "L"
                    } else if l.claims() {
                        "C"
                    } else if l.is_voter() {
                        "V"
                    } else {
                        "F"
                    },
                    l.term(),
                    l.commit(),
                    l.applied(),
                    l.first_index(),
                    l.last_index()
                )
            })
            .collect();
        let conf = self
            .nodes
            .iter()
            .filter_map(|n| n.log.as_ref())
            .max_by_key(|l| l.applied())
            .map(|l| (l.conf().voters.clone(), l.conf().voters_outgoing.clone()));
        eprintln!(
            "step {i}: in flight {} cut {:?} gone {:?} {roles:?} conf {conf:?}",
            self.net.len(),
            self.cut,
            self.gone
        );
    }

    fn deliver_one(&mut self) {
        if self.net.is_empty() {
            return;
        }
        let k = self.rng.below(self.net.len() as u64) as usize;
        let (from, to, msg) = self.net.swap_remove(k);
        let n = &self.nodes[to as usize];
        if n.log.is_none() || n.paused {
            if n.paused {
                // A paused node gets it when it wakes.
                self.net.push((from, to, msg));
            }
            return;
        }
        if self.trace {
            match &msg {
                Wire::Raft(m) => eprintln!("deliver {from}->{to} {:?} term {}", m.get_msg_type(), m.term),
                w => eprintln!("deliver {from}->{to} {w:?}"),
            }
        }
        self.log(to).handle_message(from, msg);
        self.after(to);
    }

    /// Nodes catching up after a lost disk (one disk is lost at a time: a majority of lost
    /// disks loses data by definition).
    fn amnesiacs(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.log.as_ref().is_some_and(|l| l.amnesiac() || l.lost_disk()))
            .count()
    }

    fn crash(&mut self, v: u32, lose_disk: bool) {
        let n = &mut self.nodes[v as usize];
        // The node's answers die with it: its submissions and reads are never answered.
        n.log = None;
        n.reads.clear();
        n.incarnation += 1;
        if lose_disk {
            // A store created now records the first voters, as the daemon's does.
            n.durable = Disk {
                amnesiac: true,
                conf: Some(first_conf()),
                ..Disk::default()
            };
            self.counts.disk_losses += 1;
        } else {
            self.counts.crashes += 1;
        }
        n.volatile = n.durable.clone();
        let durable = n.durable.durable();
        let seed = self.seed * 100 + v as u64 + 1000 * n.incarnation;
        let log = Log::new(v, self.n, self.limits, durable, seed).expect("restarts from its disk");
        if self.trace {
            eprintln!(
                "node {v} crashed (disk lost: {lose_disk}), restarts at applied {}",
                log.applied()
            );
        }
        self.nodes[v as usize].log = Some(log);
        self.nodes[v as usize].paused = false;
        self.nodes[v as usize].ineligible = false;
        // Its waiting submissions are never answered (their tokens stay in `submitted`).
        self.check_table(v);
    }

    fn after(&mut self, v: u32) {
        self.drain(v);
        self.learn(v);
        self.check_table(v);
    }

    /// Messages the busiest node sends or takes per tick over `rounds` ticks of an idle,
    /// settled cluster (every message delivered within its tick), and which node that is.
    fn idle_busiest(&mut self, rounds: u64) -> (f64, u32) {
        self.handled.iter_mut().for_each(|h| *h = 0);
        let live: Vec<u32> = (0..self.n).filter(|u| !self.gone.contains(u)).collect();
        for _ in 0..rounds {
            for &u in &live {
                self.log(u).handle_tick();
                self.after(u);
            }
            while let Some((from, to, msg)) = self.net.pop() {
                if self.gone.contains(&to) {
                    continue;
                }
                self.handled[to as usize] += 1;
                if self.trace && to == 0 {
                    let kind = match &msg {
                        Wire::Raft(m) => format!("{:?}", m.get_msg_type()),
                        Wire::Follow { .. } => "Follow".into(),
                        Wire::Feed(_) => "Feed".into(),
                        w => format!("{w:?}"),
                    };
                    eprintln!("idle: {from} -> 0 {kind}");
                }
                self.log(to).handle_message(from, msg);
                self.after(to);
            }
        }
        let (node, most) = self
            .handled
            .iter()
            .enumerate()
            .max_by_key(|(_, h)| **h)
            .map(|(i, h)| (i as u32, *h))
            .unwrap_or((0, 0));
        (most as f64 / rounds as f64, node)
    }

    /// Heals everything, lets the cluster settle, and checks every node converged.
    fn settle(&mut self) {
        self.cut.clear();
        for n in &mut self.nodes {
            n.paused = false;
            n.ineligible = false;
            if let Some(l) = n.log.as_mut() {
                l.set_eligible(true);
            }
        }
        let live: Vec<u32> = (0..self.n).filter(|u| !self.gone.contains(u)).collect();
        // A last operation, resubmitted until it commits.
        let mut done = false;
        for round in 0..4000 {
            if self.trace && round % 250 == 0 {
                self.status(100_000 + round);
            }
            for &u in &live {
                self.log(u).handle_tick();
                self.after(u);
            }
            self.plan_voters();
            while let Some((from, to, msg)) = self.net.pop() {
                if self.gone.contains(&to) {
                    continue;
                }
                self.handled[to as usize] += 1;
                self.log(to).handle_message(from, msg);
                self.after(to);
            }
            self.check_voters();
            done = done || self.acked.contains_key(&(self.next_id - 1));
            if !done && round % 20 == 19 {
                if let Some(l) = live
                    .iter()
                    .copied()
                    .find(|u| self.nodes[*u as usize].log.as_ref().is_some_and(|l| l.is_leader()))
                {
                    let id = self.next_id;
                    self.next_id += 1;
                    let token = self.next_token;
                    self.next_token += 1;
                    let op = Op::Add { id, key: 0, delta: 1 };
                    self.submitted.insert(token, op.clone());
                    self.log(l).submit(token, &op);
                    self.after(l);
                }
            }
            let applied: BTreeSet<u64> = live.iter().map(|u| self.log(*u).applied()).collect();
            let confs: BTreeSet<Vec<u32>> = live.iter().map(|u| self.log(*u).voters()).collect();
            let settled = confs.len() == 1
                && confs
                    .iter()
                    .next()
                    .is_some_and(|c| c.len() == VOTERS as usize && !c.iter().any(|v| self.gone.contains(v)));
            if done && applied.len() == 1 && settled {
                break;
            }
        }
        // Every op answered Ok is applied everywhere, and every node holds the same state.
        let applied: BTreeSet<u64> = live.iter().map(|u| self.log(*u).applied()).collect();
        if applied.len() != 1 {
            self.status(999_999);
        }
        assert_eq!(
            applied.len(),
            1,
            "seed {}: the nodes did not converge: {applied:?}",
            self.seed
        );
        // The voters lost for good were replaced.
        let confs: BTreeSet<Vec<u32>> = live.iter().map(|u| self.log(*u).voters()).collect();
        if confs.len() != 1 || confs.iter().any(|c| c.len() != VOTERS as usize) {
            self.status(999_998);
        }
        for &u in &live {
            let v = self.log(u).voters();
            let l = self.nodes[u as usize].log.as_ref().expect("running");
            assert!(
                v.len() == VOTERS as usize && !v.iter().any(|x| self.gone.contains(x)),
                "seed {}: node {u}'s voters {v:?} ({:?}) with {:?} lost for good; leader {:?} applied {}",
                self.seed,
                l.conf(),
                self.gone,
                l.leader(),
                l.applied()
            );
            assert_eq!(
                self.log(u).is_voter(),
                v.contains(&u),
                "seed {}: node {u}'s role",
                self.seed
            );
        }
        let top = *applied.iter().next().expect("nodes");
        for (id, i) in &self.acked {
            assert!(
                *i <= top,
                "seed {}: op {id} acked at {i} is past the end {top}",
                self.seed
            );
            assert_eq!(
                self.applied.get(i).copied().flatten(),
                Some(*id),
                "seed {}: op {id} lost",
                self.seed
            );
        }
        // Every read asked of a node still running is answered (a follower's too: one that
        // waited behind another's request was once never asked).
        for _ in 0..400 {
            if live.iter().all(|u| self.nodes[*u as usize].reads.is_empty()) {
                break;
            }
            for &u in &live {
                self.log(u).handle_tick();
                self.after(u);
            }
            while let Some((from, to, msg)) = self.net.pop() {
                if self.gone.contains(&to) {
                    continue;
                }
                self.log(to).handle_message(from, msg);
                self.after(to);
            }
        }
        for &u in &live {
            assert!(
                self.nodes[u as usize].reads.is_empty(),
                "seed {}: node {u}'s reads {:?} were never answered",
                self.seed,
                self.nodes[u as usize].reads
            );
        }
        let want = self.states[top as usize].clone();
        for u in live {
            let seed = self.seed;
            assert_eq!(self.log(u).state().map, want, "seed {seed}: node {u}'s state differs");
        }
    }
}

fn run(seed: u64) -> Counts {
    let mut sim = Sim::new(seed);
    for i in 0..3000 {
        sim.step();
        if sim.trace && i % 100 == 0 {
            sim.status(i);
        }
    }
    sim.settle();
    sim.counts
}

#[test]
fn the_metadata_log_keeps_every_acknowledged_operation() {
    let mut total = Counts::default();
    for seed in common::seeds(1500) {
        let c = run(seed);
        total.ok += c.ok;
        total.dropped += c.dropped;
        total.rejected += c.rejected;
        total.not_leader += c.not_leader;
        total.reads_ok += c.reads_ok;
        total.crashes += c.crashes;
        total.disk_losses += c.disk_losses;
        total.pauses += c.pauses;
        total.partitions += c.partitions;
        total.snapshots_installed += c.snapshots_installed;
        total.compactions += c.compactions;
        total.lost_msgs += c.lost_msgs;
        total.hand_overs += c.hand_overs;
        total.gone += c.gone;
        total.gone_voters += c.gone_voters;
        total.conf_proposals += c.conf_proposals;
        total.follower_reads += c.follower_reads;
    }
    eprintln!(
        "ok {} dropped {} rejected {} not-leader {} reads {} crashes {} disk losses {} pauses {} partitions {} snapshots {} compactions {} lost msgs {} hand-overs {}",
        total.ok,
        total.dropped,
        total.rejected,
        total.not_leader,
        total.reads_ok,
        total.crashes,
        total.disk_losses,
        total.pauses,
        total.partitions,
        total.snapshots_installed,
        total.compactions,
        total.lost_msgs,
        total.hand_overs
    );
    eprintln!(
        "lost for good {} (voters {}) voter changes proposed {} reads on followers {}",
        total.gone, total.gone_voters, total.conf_proposals, total.follower_reads
    );
    // Every path ran.
    assert!(total.ok > 0 && total.dropped > 0 && total.rejected > 0 && total.reads_ok > 0);
    assert!(total.crashes > 0 && total.pauses > 0 && total.partitions > 0 && total.disk_losses > 0);
    assert!(total.snapshots_installed > 0 && total.compactions > 0 && total.hand_overs > 0);
    assert!(total.gone_voters > 0 && total.conf_proposals > 0 && total.follower_reads > 0);
}

/// The log at 16, 128 and 1,024 nodes (five voters, the others followers in a tree), with
/// every fault of the main test, fewer seeds at the larger sizes: every node converges, the
/// voters lost for good are replaced; and when idle the busiest node handles about as many
/// messages at 1,024 nodes as at 16 (no node feeds more than the fan-out).
#[test]
fn the_log_at_16_128_and_1024_nodes_converges_and_its_busiest_node_costs_the_same() {
    let mut busiest = Vec::new();
    for (nodes, seeds) in [(16u32, 40u64), (128, 4), (1024, 1)] {
        let mut worst = 0f64;
        for seed in common::seeds(seeds) {
            let mut sim = Sim::sized(seed, nodes);
            for _ in 0..3000 {
                sim.step();
            }
            sim.settle();
            let (idle, node) = sim.idle_busiest(200);
            if sim.trace {
                eprintln!("{nodes} nodes, seed {seed}: busiest idle node {node}: {idle:.2} messages a tick");
            }
            worst = worst.max(idle);
        }
        eprintln!("{nodes} nodes: the busiest idle node handles {worst:.2} messages a tick");
        busiest.push(worst);
    }
    assert!(
        busiest[2] <= 2.0 * busiest[0],
        "the busiest idle node: {:.2} messages a tick at 1,024 nodes, {:.2} at 16",
        busiest[2],
        busiest[0]
    );
}

/// A voter back on a blank disk votes again only once it holds the leader's log as it was
/// after the loss — not as far as an append sent before the loss said (a link may deliver one
/// late): the log simulator, with operators moving the leadership, met a voter that left its
/// catching up at such an append's end, without entries it had acknowledged before the loss,
/// was counted for their commit and was then elected without them.
#[test]
fn a_voter_back_on_a_blank_disk_catches_up_to_the_leaders_log_not_to_a_stale_append() {
    let limits = Limits {
        compact_after: 1000,
        keep_behind: 100,
        ..sim_limits()
    };
    let mut log: Log<Kv, u64> = Log::new(1, VOTERS, limits, Durable::fresh(true), 7).expect("starts");
    assert!(log.amnesiac());
    // A blank store is a follower first: it asks a voter for the committed entries.
    let mut asked = false;
    log.handle_tick();
    while let Some(a) = log.poll_action() {
        asked |= matches!(
            a,
            Action::Send {
                msg: Wire::Follow { after: 0, .. },
                ..
            }
        );
    }
    assert!(asked && !log.is_voter(), "a blank store follows first");
    let nonce_of = |log: &mut Log<Kv, u64>| {
        let mut nonce = None;
        while let Some(a) = log.poll_action() {
            if let Action::Send {
                to: 0,
                msg: Wire::LostDisk { nonce: n, .. },
            } = a
            {
                nonce = Some(n);
            }
        }
        nonce
    };
    // An append leader 0 (term 2) sent before the disk was lost: entries 1 to 3, commit 3.
    let entries: Vec<Entry> = (1..=3u64)
        .map(|i| {
            let mut data = vec![psls_cluster::log::ENTRY_FORMAT];
            data.extend(
                postcard::to_stdvec(&Op::Add {
                    id: i,
                    key: 0,
                    delta: i,
                })
                .expect("encodes"),
            );
            Entry {
                term: 2,
                index: i,
                data: data.into(),
                ..Default::default()
            }
        })
        .collect();
    // A voter's feed: entry 1, committed. The configuration makes this node a voter, which
    // catches up before it votes (it may have acknowledged entries it no longer holds).
    log.handle_message(
        0,
        Wire::Feed(Box::new(psls_cluster::log::Feed {
            entries: entries[..1].to_vec(),
            applied: 1,
            term: 2,
            leader: Some(0),
            ..Default::default()
        })),
    );
    while log.poll_action().is_some() {}
    assert!(
        log.is_voter() && log.amnesiac() && log.applied() == 1,
        "a voter again, catching up"
    );
    let mut m = Message::default();
    m.set_msg_type(MessageType::MsgAppend);
    m.from = 1;
    m.to = 2;
    m.term = 2;
    m.index = 0;
    m.log_term = 0;
    m.commit = 3;
    m.entries = entries.into();
    log.handle_message(0, Wire::Raft(Box::new(m)));
    let nonce = nonce_of(&mut log).expect("the voter asks the leader where its log ends");
    assert!(log.amnesiac(), "a stale append does not end the catching up");
    // Another life's answer is ignored; this life's says the log ends at 10: not caught up.
    log.handle_message(
        0,
        Wire::CatchUpTo {
            nonce: nonce.wrapping_add(1),
            last_index: 3,
            term: 2,
        },
    );
    assert!(log.amnesiac(), "an answer to another life's question");
    log.handle_message(
        0,
        Wire::CatchUpTo {
            nonce,
            last_index: 10,
            term: 2,
        },
    );
    assert!(log.amnesiac(), "entries 4 to 10 are still missing");
    // A leadership handed to it meanwhile is refused.
    let mut t = Message::default();
    t.set_msg_type(MessageType::MsgTimeoutNow);
    t.from = 1;
    t.to = 2;
    t.term = 2;
    log.handle_message(0, Wire::Raft(Box::new(t)));
    while log.poll_action().is_some() {}
    assert!(!log.is_leader() && log.term() == 2, "no campaign while catching up");
    // The wire forms round-trip.
    for w in [
        Wire::LostDisk {
            last_index: 3,
            nonce: 99,
        },
        Wire::CatchUpTo {
            nonce: 99,
            last_index: 10,
            term: 4,
        },
        Wire::Follow { after: 12, term: 3 },
        Wire::NotVoter { applied: 40 },
        Wire::Feed(Box::new(psls_cluster::log::Feed {
            entries: vec![Entry {
                term: 3,
                index: 13,
                data: vec![1, 2, 3].into(),
                ..Default::default()
            }],
            snapshot: None,
            applied: 13,
            term: 3,
            leader: Some(2),
        })),
        Wire::Feed(Box::default()),
    ] {
        let b = psls_cluster::log::encode_wire(&w);
        assert_eq!(psls_cluster::log::decode_wire(&b), Ok(w));
    }
    // An earlier build's LostDisk (no nonce) still reads.
    let mut old = vec![1u8];
    old.extend(7u64.to_le_bytes());
    assert_eq!(
        psls_cluster::log::decode_wire(&old),
        Ok(Wire::LostDisk {
            last_index: 7,
            nonce: 0
        })
    );
}

/// A leader's lease ends by the clock: ticks its shell missed (its process stood still) age
/// the answers it counted, so it holds no lease until a majority answers again — while the
/// others may have elected another leader.
#[test]
fn a_leader_that_stood_still_holds_no_lease_until_a_majority_answers_again() {
    let mut s = Sim::new(3);
    s.settle();
    let l = (0..VOTERS)
        .find(|u| s.nodes[*u as usize].log.as_ref().is_some_and(|l| l.is_leader()))
        .expect("a leader");
    let lease = s.limits.election_ticks as u64 - s.limits.lease_margin_ticks();
    assert!(s.log(l).lease_held());
    let left = s.log(l).lease_ticks_left();
    assert!(left > 0 && left <= lease, "{left} of {lease}");
    // Ticks delivered without answers: the lease runs down one tick at a time.
    s.log(l).handle_tick();
    assert_eq!(s.log(l).lease_ticks_left(), left - 1);
    // It stood still for a lease's length: none left.
    s.log(l).handle_missed_ticks(lease);
    assert!(!s.log(l).lease_held());
    assert_eq!(s.log(l).lease_ticks_left(), 0);
    s.after(l);
    // Its heartbeats answered again: the lease is back (or another leads, and it holds none).
    for _ in 0..4 * s.limits.heartbeat_ticks {
        for u in 0..VOTERS {
            s.log(u).handle_tick();
            s.after(u);
        }
        while let Some((from, to, msg)) = s.net.pop() {
            s.log(to).handle_message(from, msg);
            s.after(to);
        }
    }
    let leaders: Vec<u32> = (0..VOTERS)
        .filter(|u| s.nodes[*u as usize].log.as_ref().is_some_and(|l| l.lease_held()))
        .collect();
    assert_eq!(leaders.len(), 1, "one lease: {leaders:?}");
}
