//! Deterministic simulator of the coherence protocol (DESIGN §9, level 2).
//!
//! Many nodes and clients in one process; a seed chooses everything: cluster size, pages,
//! which client acts, which in-flight message is delivered next (any order: messages are
//! reordered freely), when loads from disk finish or fail, when nodes crash and when the others
//! learn of it. After every step it checks:
//! - at most one node can write a page, and no other node holds it meanwhile;
//! - every copy a node may access holds the latest value written to that page, so every read
//!   returns the value of the latest write;
//! - no protocol violation is reported.
//!
//! At the end it stops new work and drains: every fault must then be resolved or, only where
//! a crash or a failed load excuses it, failed. A failure prints the seed that reproduces it.
//!
//! `PSLS_SIM_SEEDS=N` runs N seeds (default 2000); `PSLS_SIM_SEED=S` runs only seed S.

use psls_svm::coherence::{Access, Action, Envelope, FaultError, Msg, Receipt, Svm, TxnId, WaiterId};
use psls_svm::rng::SplitMix64;
use psls_svm::{FileId, Incarnation, NodeId, PageId};
use std::collections::{BTreeMap, HashMap};

struct Rng(SplitMix64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        assert!(n > 0);
        (self.0.next_u64() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.0.next_u64() % 100 < percent
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Read(PageId),
    Write(PageId, u64),
}

impl Op {
    fn page(self) -> PageId {
        match self {
            Op::Read(p) | Op::Write(p, _) => p,
        }
    }
    fn access(self) -> Access {
        match self {
            Op::Read(_) => Access::Read,
            Op::Write(..) => Access::Write,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum ClientState {
    Idle,
    /// Wants to do `op`; will try at one of its next steps.
    Ready(Op),
    /// Faulted; waiting for the daemon.
    Waiting(Op),
}

struct Client {
    node: usize,
    id: WaiterId,
    state: ClientState,
}

struct Node {
    svm: Svm,
    /// The node's memory (its memfd): page → value. Present is not the same as accessible.
    mem: HashMap<PageId, u64>,
    loads: Vec<(PageId, TxnId)>,
    /// Access per page as the `SetAccess` actions run so far left it (what clients can do).
    applied: HashMap<PageId, Access>,
}

struct World {
    seed: u64,
    rng: Rng,
    nodes: Vec<Node>,
    clients: Vec<Client>,
    pages: Vec<PageId>,
    /// In flight: (to, envelope, payload).
    net: Vec<(usize, Envelope, Option<u64>)>,
    /// Membership news not yet delivered: (to node, about node, incarnation, up).
    news: Vec<(usize, usize, Incarnation, bool)>,
    /// The latest value written to each page (the disk holds 0 and is never written here).
    truth: HashMap<PageId, u64>,
    next_value: u64,
    crashes: usize,
    load_failures: usize,
    done_ops: u64,
    failed_ops: u64,
    steps: u64,
    trace: Vec<String>,
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = Rng(SplitMix64::new(seed));
        let n = 2 + rng.below(4);
        let files = 1 + rng.below(2);
        let pages: Vec<PageId> = (0..1 + rng.below(4))
            .map(|k| PageId {
                file: FileId(100 + (k % files) as u64),
                index: k as u64,
            })
            .collect();
        let peers: Vec<Option<Incarnation>> = (0..n).map(|_| Some(Incarnation(1))).collect();
        let nodes = (0..n)
            .map(|i| Node {
                svm: Svm::new(NodeId(i as u32), Incarnation(1), peers.clone()),
                mem: HashMap::new(),
                loads: Vec::new(),
                applied: HashMap::new(),
            })
            .collect();
        let per_node = 1 + rng.below(2);
        let clients = (0..n * per_node)
            .map(|k| Client {
                node: k % n,
                id: k as WaiterId,
                state: ClientState::Idle,
            })
            .collect();
        World {
            seed,
            rng,
            nodes,
            clients,
            pages,
            net: Vec::new(),
            news: Vec::new(),
            truth: HashMap::new(),
            next_value: 1,
            crashes: 0,
            load_failures: 0,
            done_ops: 0,
            failed_ops: 0,
            steps: 0,
            trace: Vec::new(),
        }
    }

    fn fail(&self, why: String) -> ! {
        let tail: Vec<&String> = self.trace.iter().rev().take(40).collect();
        let mut t = String::new();
        for l in tail.into_iter().rev() {
            t.push_str(l);
            t.push('\n');
        }
        panic!(
            "seed {} step {}: {why}\nlast events:\n{t}reproduce: PSLS_SIM_SEED={} cargo test -p psls-svm --test sim",
            self.seed, self.steps, self.seed
        );
    }

    fn log(&mut self, s: String) {
        if std::env::var_os("PSLS_SIM_TRACE").is_some() {
            eprintln!("{s}");
        }
        if self.trace.len() >= 4000 {
            self.trace.drain(..2000);
        }
        self.trace.push(s);
    }

    /// Runs node `i`'s queued actions, as the daemon would, in order.
    fn run_actions(&mut self, i: usize) {
        for _ in 0..100_000 {
            let Some(a) = self.nodes[i].svm.poll_action() else {
                return;
            };
            self.log(format!("n{i} {a:?}"));
            match a {
                Action::Send { to, env } => {
                    let payload = if env.msg.has_payload() {
                        let page = env.msg.page();
                        // A snapshot while clients could still write would miss their stores:
                        // check the access as the actions executed so far left it.
                        if self.nodes[i].applied.get(&page) == Some(&Access::Write) {
                            self.fail(format!("n{i} snapshots page {page} while it may still be written"));
                        }
                        match self.nodes[i].mem.get(&page) {
                            Some(v) => Some(*v),
                            None => self.fail(format!("n{i} sends page {page} it does not have")),
                        }
                    } else {
                        None
                    };
                    self.net.push((to.0 as usize, env, payload));
                }
                Action::Load { page, txn } => self.nodes[i].loads.push((page, txn)),
                Action::SetAccess { page, access } => match access {
                    None => {
                        self.nodes[i].applied.remove(&page);
                        self.nodes[i].mem.remove(&page);
                    }
                    Some(a) => {
                        self.nodes[i].applied.insert(page, a);
                        if !self.nodes[i].mem.contains_key(&page) {
                            self.fail(format!("n{i} gets access to page {page} not in its memory"));
                        }
                    }
                },
                Action::Resolve { waiter, page, access } => match self.clients[waiter as usize].state {
                    ClientState::Waiting(op) if op.page() == page && op.access() <= access => {
                        self.clients[waiter as usize].state = ClientState::Ready(op);
                    }
                    ClientState::Waiting(op) if op.page() == page => {
                        self.fail(format!("client {waiter} resolved with {access:?} for {op:?}"))
                    }
                    other => self.fail(format!("resolve for client {waiter} in state {other:?}")),
                },
                Action::Fail { waiter, page, error } => {
                    let excused = match error {
                        FaultError::LoadFailed => self.load_failures > 0,
                        _ => self.crashes > 0,
                    };
                    if !excused {
                        self.fail(format!("fault of client {waiter} on {page} failed: {error}"));
                    }
                    let state = self.clients[waiter as usize].state;
                    if !matches!(state, ClientState::Waiting(op) if op.page() == page) {
                        self.fail(format!("fail for client {waiter} in state {state:?}"));
                    }
                    self.clients[waiter as usize].state = ClientState::Idle;
                    self.failed_ops += 1;
                }
            }
        }
        self.fail(format!("n{i} produced an unbounded number of actions"));
    }

    /// Client `k` tries its op: done if its node has the access, else a fault.
    fn client_try(&mut self, k: usize) {
        let c = &self.clients[k];
        let ClientState::Ready(op) = c.state else { return };
        let i = c.node;
        let page = op.page();
        if self.nodes[i].svm.access(page) >= Some(op.access()) {
            let have = self.nodes[i].mem.get(&page).copied();
            let want = self.truth.get(&page).copied().unwrap_or(0);
            match op {
                Op::Read(_) => {
                    if have != Some(want) {
                        self.fail(format!(
                            "client {k} on n{i} read {have:?} from {page}, latest write is {want}"
                        ));
                    }
                }
                Op::Write(_, v) => {
                    self.nodes[i].mem.insert(page, v);
                    self.truth.insert(page, v);
                }
            }
            self.log(format!("client {k} on n{i} did {op:?}"));
            self.clients[k].state = ClientState::Idle;
            self.done_ops += 1;
        } else {
            self.clients[k].state = ClientState::Waiting(op);
            let id = self.clients[k].id;
            self.log(format!("client {k} on n{i} faults {op:?}"));
            self.nodes[i].svm.fault(page, op.access(), id);
            self.run_actions(i);
        }
    }

    fn deliver(&mut self, m: usize) {
        let (to, env, payload) = self.net.swap_remove(m);
        self.log(format!("deliver to n{to}: {env:?} payload {payload:?}"));
        match self.nodes[to].svm.receive(env) {
            Ok(Receipt::Install(page)) => match payload {
                Some(v) => {
                    self.nodes[to].mem.insert(page, v);
                }
                None => self.fail("install without a payload".into()),
            },
            Ok(_) => {}
            Err(e) => self.fail(format!("n{to}: {e}")),
        }
        self.run_actions(to);
    }

    fn finish_load(&mut self, i: usize, l: usize) {
        let (page, txn) = self.nodes[i].loads.swap_remove(l);
        let ok = !self.rng.chance(2);
        if ok {
            self.nodes[i].mem.insert(page, 0);
        } else {
            self.load_failures += 1;
        }
        self.log(format!("n{i} load of {page} done ok={ok}"));
        self.nodes[i].svm.loaded(page, txn, ok);
        self.run_actions(i);
    }

    fn crash(&mut self, i: usize) {
        self.crashes += 1;
        let inc = Incarnation(self.nodes[i].svm.incarnation().0 + 1);
        self.log(format!("CRASH n{i}, restarts as incarnation {}", inc.0));
        // It restarts knowing everybody's current incarnation, with an empty memory.
        let peers: Vec<Option<Incarnation>> = self.nodes.iter().map(|n| Some(n.svm.incarnation())).collect();
        self.nodes[i] = Node {
            svm: Svm::restarted(NodeId(i as u32), inc, peers),
            mem: HashMap::new(),
            loads: Vec::new(),
            applied: HashMap::new(),
        };
        for c in self.clients.iter_mut().filter(|c| c.node == i) {
            c.state = ClientState::Idle;
        }
        for j in 0..self.nodes.len() {
            if j != i {
                // Each survivor hears, at its own time, first of the death, then of the restart.
                self.news.push((j, i, Incarnation(inc.0 - 1), false));
                self.news.push((j, i, inc, true));
            }
        }
    }

    fn deliver_news(&mut self, k: usize) {
        // Per (to, about), news arrive in order: take the first one of that pair.
        let (to, about, _, _) = self.news[k];
        let first = self.news.iter().position(|n| n.0 == to && n.1 == about).unwrap_or(k);
        let (to, about, inc, up) = self.news.remove(first);
        self.log(format!(
            "n{to} learns n{about} incarnation {} is {}",
            inc.0,
            if up { "up" } else { "down" }
        ));
        if up {
            self.nodes[to].svm.peer_up(NodeId(about as u32), inc);
        } else {
            self.nodes[to].svm.peer_down(NodeId(about as u32), inc);
        }
        self.run_actions(to);
    }

    fn check(&self) {
        for &page in &self.pages {
            let mut writers = 0;
            let mut holders = 0;
            for (i, n) in self.nodes.iter().enumerate() {
                let Some(a) = n.svm.access(page) else { continue };
                holders += 1;
                if a == Access::Write {
                    writers += 1;
                }
                let have = n.mem.get(&page).copied();
                let want = self.truth.get(&page).copied().unwrap_or(0);
                if have != Some(want) {
                    self.fail(format!(
                        "n{i} holds {page} ({a:?}) with {have:?}, latest write is {want}"
                    ));
                }
            }
            if writers > 1 || (writers == 1 && holders > 1) {
                let who: BTreeMap<usize, Option<Access>> = self
                    .nodes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| (i, n.svm.access(page)))
                    .collect();
                self.fail(format!(
                    "page {page}: {writers} writers among {holders} holders: {who:?}"
                ));
            }
        }
    }

    fn step(&mut self, new_work: bool, crashes_allowed: bool) -> bool {
        self.steps += 1;
        // Candidate moves, picked uniformly at random.
        let mut moves: Vec<u8> = Vec::new();
        if !self.net.is_empty() {
            moves.extend([0, 0, 0]);
        }
        if self.nodes.iter().any(|n| !n.loads.is_empty()) {
            moves.push(1);
        }
        if !self.news.is_empty() {
            moves.push(2);
        }
        let ready = self.clients.iter().any(|c| matches!(c.state, ClientState::Ready(_)));
        if ready {
            moves.extend([3, 3]);
        }
        if new_work && self.clients.iter().any(|c| c.state == ClientState::Idle) {
            moves.extend([4, 4]);
        }
        if crashes_allowed && self.crashes < 2 && self.rng.chance(1) {
            moves.push(5);
        }
        if new_work {
            moves.push(6);
        }
        if moves.is_empty() {
            return false;
        }
        match moves[self.rng.below(moves.len())] {
            0 => {
                let m = self.rng.below(self.net.len());
                self.deliver(m);
            }
            1 => {
                let with: Vec<usize> = (0..self.nodes.len())
                    .filter(|&i| !self.nodes[i].loads.is_empty())
                    .collect();
                let i = with[self.rng.below(with.len())];
                let l = self.rng.below(self.nodes[i].loads.len());
                self.finish_load(i, l);
            }
            2 => {
                let k = self.rng.below(self.news.len());
                self.deliver_news(k);
            }
            3 => {
                let ready: Vec<usize> = (0..self.clients.len())
                    .filter(|&k| matches!(self.clients[k].state, ClientState::Ready(_)))
                    .collect();
                let k = ready[self.rng.below(ready.len())];
                self.client_try(k);
            }
            4 => {
                let idle: Vec<usize> = (0..self.clients.len())
                    .filter(|&k| self.clients[k].state == ClientState::Idle)
                    .collect();
                let k = idle[self.rng.below(idle.len())];
                let page = self.pages[self.rng.below(self.pages.len())];
                let op = if self.rng.chance(40) {
                    let v = self.next_value;
                    self.next_value += 1;
                    Op::Write(page, v)
                } else {
                    Op::Read(page)
                };
                self.clients[k].state = ClientState::Ready(op);
                self.client_try(k);
            }
            5 => {
                let i = self.rng.below(self.nodes.len());
                self.crash(i);
            }
            _ => {
                // A prefetch: read or write access to a page nobody waits for.
                let i = self.rng.below(self.nodes.len());
                let page = self.pages[self.rng.below(self.pages.len())];
                let access = if self.rng.chance(30) {
                    Access::Write
                } else {
                    Access::Read
                };
                self.log(format!("n{i} prefetches {page} {access:?}"));
                self.nodes[i].svm.prefetch(page, access);
                self.run_actions(i);
            }
        }
        self.check();
        true
    }
}

fn run_seed(seed: u64) -> (u64, u64, u64, u64, u64) {
    let mut w = World::new(seed);
    let crashes_allowed = seed.is_multiple_of(3);
    let steps = 200 + w.rng.below(400);
    for _ in 0..steps {
        w.step(true, crashes_allowed);
    }
    // Drain: no new work, no crashes; everything in flight must settle.
    let mut drained = false;
    for _ in 0..200_000 {
        if !w.step(false, false) {
            drained = true;
            break;
        }
    }
    if !drained {
        w.fail("did not settle (livelock?)".into());
    }
    for (k, c) in w.clients.iter().enumerate() {
        if c.state != ClientState::Idle {
            w.fail(format!("client {k} never finished: {:?}", c.state));
        }
    }
    if w.crashes == 0 {
        for (i, n) in w.nodes.iter().enumerate() {
            if !n.svm.is_quiet() {
                w.fail(format!("n{i} still has work in flight after draining"));
            }
        }
    }
    let joined = w.nodes.iter().map(|n| n.svm.stats().joined_reads).sum();
    let late = w.nodes.iter().map(|n| n.svm.stats().late_grants).sum();
    let redundant = w.nodes.iter().map(|n| n.svm.stats().redundant_grants).sum();
    (w.done_ops, w.failed_ops, joined, late, redundant)
}

#[test]
fn random_schedules_keep_memory_sequentially_consistent() {
    let (first, count) = match std::env::var("PSLS_SIM_SEED").ok().and_then(|s| s.parse::<u64>().ok()) {
        Some(s) => (s, 1),
        None => (
            0,
            std::env::var("PSLS_SIM_SEEDS")
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or(2000),
        ),
    };
    let mut done = 0;
    let mut failed = 0;
    let mut joined = 0;
    let mut late = 0;
    let mut redundant = 0;
    for seed in first..first + count {
        let (d, f, j, l, r) = run_seed(seed);
        done += d;
        failed += f;
        joined += j;
        late += l;
        redundant += r;
    }
    // The runs must do real work, and failures only come from crashes and failed loads.
    if count >= 100 {
        assert!(done > count * 50, "only {done} operations completed over {count} seeds");
        assert!(failed < done / 10, "{failed} failed operations against {done} done");
        // Concurrent reads of one page really happen (so their checks above ran).
        assert!(joined > count, "only {joined} joined reads over {count} seeds");
        // Owners die between a forward and their data (so the manager's late grants ran).
        assert!(late > 0, "no late grant over {count} seeds");
        // ... also after their `Data` granted a write that still collected acks (so the
        // requester's handling of the redundant grant ran).
        assert!(redundant > 0, "no redundant late grant over {count} seeds");
    }
}

/// A hand-made schedule: the classic ping-pong of one page between two writers, delivering
/// messages in the order sent. Exact message and transfer counts.
#[test]
fn page_bounces_between_two_writers_with_exact_counts() {
    let peers = vec![Some(Incarnation(1)); 2];
    let mut nodes = [
        Svm::new(NodeId(0), Incarnation(1), peers.clone()),
        Svm::new(NodeId(1), Incarnation(1), peers),
    ];
    let page = PageId {
        file: FileId(7),
        index: 0,
    };
    let mut mem: [Option<u64>; 2] = [None, None];
    let mut value = 0u64;
    let mut messages = 0;
    for round in 0..1000u64 {
        let w = (round % 2) as usize;
        nodes[w].fault(page, Access::Write, round);
        let (sent, resolved) = drive_fifo(&mut nodes, &mut mem);
        messages += sent.len();
        assert_eq!(resolved, vec![(w, round)], "round {round}");
        assert_eq!(mem[w], Some(value), "round {round}: the writer sees the latest value");
        value += 1;
        mem[w] = Some(value);
        assert_eq!(nodes[1 - w].access(page), None);
        assert_eq!(nodes[w].access(page), Some(Access::Write));
    }
    // Node 0 (round 0) loads from disk; then every round moves the page once.
    let s: Vec<_> = nodes.iter().map(|n| n.stats()).collect();
    assert_eq!(s[0].pages_loaded + s[1].pages_loaded, 1);
    assert_eq!(s[0].pages_in + s[1].pages_in, 999);
    assert_eq!(s[0].write_requests + s[1].write_requests, 1000);
    // Round 0: Req, Grant (load from disk), Done. Every later round: Req, Fwd, Data, Done —
    // the owner's Data grants (the owner is the only other copy), so no Grant.
    assert_eq!(messages, 3 + 999 * 4);
}

/// Messages sent, as (from, to, kind), and faults resolved, as (node, waiter).
type Driven = (Vec<(usize, usize, &'static str)>, Vec<(usize, WaiterId)>);

/// Runs every action of `nodes` to completion in FIFO order, moving page contents in `mem`;
/// returns every message sent (to another node or to the sender itself) and every fault
/// resolved. A failed fault panics.
fn drive_fifo(nodes: &mut [Svm], mem: &mut [Option<u64>]) -> Driven {
    let mut queue: std::collections::VecDeque<(usize, Action)> = std::collections::VecDeque::new();
    let mut sent = Vec::new();
    let mut resolved = Vec::new();
    for _ in 0..10_000 {
        for (i, n) in nodes.iter_mut().enumerate() {
            while let Some(a) = n.poll_action() {
                queue.push_back((i, a));
            }
        }
        let Some((i, a)) = queue.pop_front() else {
            return (sent, resolved);
        };
        match a {
            Action::Send { to, env } => {
                let to = to.0 as usize;
                let kind = match env.msg {
                    Msg::Req { .. } => "Req",
                    Msg::Grant { .. } => "Grant",
                    Msg::Deny { .. } => "Deny",
                    Msg::Fwd { .. } => "Fwd",
                    Msg::Data { .. } => "Data",
                    Msg::Inval { .. } => "Inval",
                    Msg::InvalAck { .. } => "InvalAck",
                    Msg::Done { .. } => "Done",
                    Msg::Nack { .. } => "Nack",
                };
                sent.push((i, to, kind));
                let payload = env.msg.has_payload().then(|| mem[i].expect("sender has the page"));
                if let Receipt::Install(_) = nodes[to].receive(env).expect("no violation") {
                    mem[to] = payload;
                }
            }
            Action::Load { page, txn } => {
                mem[i] = Some(0);
                nodes[i].loaded(page, txn, true);
            }
            Action::SetAccess { access: None, .. } => mem[i] = None,
            Action::SetAccess { .. } => {}
            Action::Resolve { waiter, .. } => resolved.push((i, waiter)),
            Action::Fail { error, .. } => panic!("fault failed: {error}"),
        }
    }
    panic!("actions did not settle");
}

/// A write that must invalidate copies is granted by the owner's `Data`, which carries the
/// acknowledgements to collect: the writer waits for the data and one ack per other copy, and
/// no `Grant`. Exact messages.
#[test]
fn an_invalidating_write_is_granted_by_the_owners_data() {
    let n = 4;
    let peers = vec![Some(Incarnation(1)); n];
    let mut nodes: Vec<Svm> = (0..n)
        .map(|i| Svm::new(NodeId(i as u32), Incarnation(1), peers.clone()))
        .collect();
    let page = PageId {
        file: FileId(7),
        index: 0,
    };
    let m = nodes[0].manager(page).0 as usize;
    let (owner, writer) = ((m + 1) % n, (m + 2) % n);
    let mut mem = vec![None; n];
    // The owner writes 1; every other node but the writer reads it (the writer has no copy:
    // with one, it would be granted an upgrade, with no data).
    nodes[owner].fault(page, Access::Write, 0);
    drive_fifo(&mut nodes, &mut mem);
    mem[owner] = Some(1);
    for i in (0..n).filter(|&i| i != owner && i != writer) {
        nodes[i].fault(page, Access::Read, 0);
        drive_fifo(&mut nodes, &mut mem);
        assert_eq!(mem[i], Some(1), "reader n{i}");
    }
    nodes[writer].fault(page, Access::Write, 0);
    let (sent, _) = drive_fifo(&mut nodes, &mut mem);
    let mut sent: Vec<_> = sent.into_iter().filter(|(from, to, _)| from != to).collect();
    sent.sort();
    let other = (m + 3) % n;
    let mut want = vec![
        (writer, m, "Req"),
        (m, owner, "Fwd"),
        (m, other, "Inval"),
        (owner, writer, "Data"),
        (m, writer, "InvalAck"),
        (other, writer, "InvalAck"),
        (writer, m, "Done"),
    ];
    want.sort();
    assert_eq!(sent, want);
    assert_eq!(mem[writer], Some(1), "the writer has the latest value");
    for i in (0..n).filter(|&i| i != writer) {
        assert_eq!(nodes[i].access(page), None, "n{i} still has a copy");
    }
    assert_eq!(nodes[writer].access(page), Some(Access::Write));
}

/// Forgetting a file drops its pages' holder and manager state and nothing else: the next
/// fault on it loads afresh, while another file's page stays where it was.
#[test]
fn forgetting_a_file_drops_only_its_pages() {
    let peers = vec![Some(Incarnation(1)); 2];
    let mut nodes = [
        Svm::new(NodeId(0), Incarnation(1), peers.clone()),
        Svm::new(NodeId(1), Incarnation(1), peers),
    ];
    let a = PageId {
        file: FileId(1),
        index: 0,
    };
    let b = PageId {
        file: FileId(2),
        index: 0,
    };
    // Runs every action to completion in FIFO order; returns the loads seen.
    let drive = |nodes: &mut [Svm; 2]| -> usize {
        let mut loads = 0;
        for _ in 0..1000 {
            let mut any = false;
            for i in 0..2 {
                while let Some(act) = nodes[i].poll_action() {
                    any = true;
                    match act {
                        Action::Send { to, env } => {
                            nodes[to.0 as usize].receive(env).expect("no violation");
                        }
                        Action::Load { page, txn } => {
                            loads += 1;
                            nodes[i].loaded(page, txn, true);
                        }
                        Action::Fail { error, .. } => panic!("fault failed: {error}"),
                        _ => {}
                    }
                }
            }
            if !any {
                return loads;
            }
        }
        panic!("did not settle");
    };
    nodes[1].fault(a, Access::Write, 1);
    nodes[1].fault(b, Access::Write, 2);
    assert_eq!(drive(&mut nodes), 2);
    assert_eq!(nodes[1].access(a), Some(Access::Write));
    let dropped: usize = nodes.iter_mut().map(|n| n.forget_file(FileId(1))).sum();
    assert_eq!(dropped, 2, "one holder entry and one manager entry");
    assert_eq!(nodes[1].access(a), None);
    assert_eq!(nodes[1].access(b), Some(Access::Write), "another file is untouched");
    nodes[0].fault(a, Access::Read, 3);
    assert_eq!(drive(&mut nodes), 1, "a forgotten page is loaded afresh");
    assert_eq!(nodes[0].access(a), Some(Access::Read));
}

/// A node that comes back as a newer incarnation is fenced by the nodes that held coherence
/// state when they learnt of it (they may hold pages its lost directory counted), and only by
/// those; a node that never knew the old incarnation does not fence the new one.
#[test]
fn a_node_coming_back_is_fenced_only_by_nodes_holding_state() {
    let peers = vec![Some(Incarnation(1)); 3];
    let mut busy = Svm::new(NodeId(0), Incarnation(1), peers.clone());
    let mut idle = Svm::new(NodeId(1), Incarnation(1), peers);
    let mut late = Svm::new(
        NodeId(2),
        Incarnation(1),
        vec![Some(Incarnation(1)), Some(Incarnation(1)), None],
    );
    let page = (0..64)
        .map(|index| PageId { file: FileId(3), index })
        .find(|&p| busy.manager(p) != NodeId(0))
        .expect("a page managed elsewhere");
    busy.fault(page, Access::Read, 1);
    while busy.poll_action().is_some() {}
    for n in [&mut busy, &mut idle, &mut late] {
        n.peer_down(NodeId(2), Incarnation(1));
        n.peer_up(NodeId(2), Incarnation(7));
    }
    assert_eq!(busy.fenced(NodeId(2)), Incarnation(7));
    assert_eq!(idle.fenced(NodeId(2)), Incarnation(0));
    assert_eq!(late.fenced(NodeId(2)), Incarnation(0));
    // Nor does an incarnation already known fence again.
    busy.peer_up(NodeId(2), Incarnation(7));
    busy.peer_up(NodeId(1), Incarnation(1));
    assert_eq!(busy.fenced(NodeId(1)), Incarnation(0));
}
