//! Deterministic simulator of the coherence protocol (DESIGN §9, level 2).
//!
//! Many nodes and clients in one process; a seed chooses everything: cluster size, pages,
//! which client acts, which in-flight message is delivered next (any order: messages are
//! reordered freely), when loads from disk finish or fail, when nodes crash, pause or are cut
//! off, when links break, when jobs end and when the others learn of any of it.
//!
//! # The shell, as the daemon's (`psls-node/src/svm.rs`)
//! Each node runs its state machine's actions in order, as the daemon's shell does, and keeps
//! what they left: the node's memory (its memfd), the access its `SetAccess` actions applied,
//! and, per client, that client's page table. `SetAccess(None)` punches the page out of the
//! memory and unmaps it in every client of the node; `SetAccess(Read)` write-protects it in
//! every client; `SetAccess(Write)` changes no client. `Resolve` maps the page in the faulting
//! client, writable only if the node's access (by the state machine's books, as the daemon
//! asks them) is `Write`; if the memory does not hold the page, the client is only woken and
//! faults again. Clients read and write only through their page tables: a client whose
//! mapping does not allow its operation faults. Client threads do not take the shell's lock:
//! a client may act between two actions of its node's shell.
//!
//! # Verdicts, as the daemon has them (`psls_cluster::verdicts`)
//! The failure detector gives impressions only: a node is *declared down* by a committed
//! metadata operation `(node, incarnation)`, which the coordinator makes after a silence longer
//! than the failure timeout (here [`World::timeout`] steps); a verdict is final for that
//! incarnation. Each node keeps a verdict book ([`Node::verdicts`]) and learns each verdict at
//! its own time; its transport drops every message of an incarnation at or below a verdict it
//! knows on the sender (`Verdicts::accepts`; psls-cluster depends on psls-svm, so the rule is
//! modelled here: [`World::transport_accepts`]), and its state machine hears of the death
//! (`peer_down`, the daemon's `sync_peers`) then or later. A declared node does not know of its
//! verdict at first: it runs on, its clients too, and the others may still take what it sends
//! until each learns of the verdict. It learns of it at its own time (from its committed
//! metadata or from any peer's heartbeat): it then kills its ranks (its clients stop at once)
//! and, soon after (its daemon may still answer messages meanwhile), rejoins as a new
//! incarnation with an empty memory.
//!
//! # Failures, as the daemon meets them
//! - **Crash** (of one node, or two at once, at any step, several per seed on most seeds): the
//!   node restarts at once as a new incarnation with an empty memory (its waiting clients are
//!   gone with it), as [`Svm::restarted`] when another node holds segments (the daemon's
//!   `ensure_svm`), else as [`Svm::new`], not having heard yet of some live peers (it learns of
//!   them later, as the daemon from their first heartbeats), with the verdicts committed so
//!   far in its book. Its messages still queued die with it (each with even odds; the rest
//!   were on the wire). Each other node learns, at its own time, of the death (a verdict) and
//!   then of the new incarnation, or only of the new incarnation (a restart faster than the
//!   failure detector: the daemon then calls only `peer_up`).
//! - **Link break between live nodes**: the transport is reliable between live nodes, but a
//!   lost connection drops its queue (`link.rs`), in both directions; the protocols rely on
//!   membership to learn of it. So a break is followed by a verdict on one of the two ends.
//! - **Pause** (SIGSTOP, a VM stall) of any node, several per seed on many seeds: it does
//!   nothing (no deliveries, no loads finishing, no news, no shell actions) and its clients do
//!   not act. Messages sent to it wait in its sockets. A pause shorter than the timeout ends
//!   with no verdict: the node simply goes on. A longer one leads to a verdict while it sleeps
//!   (half of the time its connections break then, dropping their queues both ways, and what
//!   is sent to it while it still sleeps is lost); it wakes with all its old state, takes its
//!   queued messages and may act (send, answer, resolve faults, its clients read and write)
//!   before it learns of its verdict.
//! - **Partition**: a link cut one way (only `a`→`b`) or both ways, for a while. Messages on a
//!   cut direction are held (the transport retransmits) until it heals. A cut longer than the
//!   timeout leads to a verdict on the cut-off node (`a` if one way, either end if both) and,
//!   half of the time, to a link break that drops the link's queue both ways; from then on,
//!   while the declared incarnation runs, what is sent on a cut direction is lost. (Messages
//!   between live incarnations are never lost without a verdict: the coherence protocol has
//!   no retransmission of its own and relies on that.)
//! - **Failed loads** (injected, 2%).
//! - **A client process dies** while its fault waits: the shell cancels the fault
//!   ([`Svm::cancel`], the daemon's `drop_map`).
//! - **A job ends**: its processes exit (their waiting faults are cancelled), then each node,
//!   at its own time, drops the job's segments and their coherence state
//!   ([`Svm::forget_file`], the daemon's `end_job`/`forget`), and a later job uses new files.
//!   A restarted node refusing its pages serves them again ([`Svm::end_recovery`]) once no
//!   other node holds any segment (the daemon's `sync_peers`).
//!
//! # Checks after every step
//! - The access each node's shell applied equals the state machine's record; no client maps a
//!   page beyond its node's applied access, nor a page its node's memory does not hold; no
//!   page is snapshotted for `Data` while a client of the sender may write it.
//! - At most one node can write a page, and then no other node holds it; every copy a node may
//!   access holds the latest value written, so every read returns the latest write. (A
//!   declared node is left out: its copies may be stale, and its ranks die when it learns.)
//! - Fencing: no message of an incarnation a node knows declared down reaches its state
//!   machine (checked where messages enter it, apart from the transport's rule); no client of
//!   a node that learnt its verdict reads, writes or faults; a paused node processes nothing
//!   and its clients do nothing.
//! - The manager's directory covers every node that holds the page: a holder is in the
//!   copyset (a writer is the writable owner and the only member), unless its own transaction
//!   is still in progress at the manager (its `Done` is on the way), or the page is lost and
//!   an `Inval` or write `Fwd` on the way will drop the copy, or it is the owner and a read
//!   `Fwd` on the way will downgrade it (the manager counts a forwarded read as done). Between transactions, a live
//!   owner the manager knows holds the page. A manager that restarted and refuses its pages
//!   has no directory to check.
//! - A page is marked lost (or a `Deny` says so) only if a node that died may have taken its
//!   latest version: owned it by the manager's books, held its last copy, could write it, was
//!   writing it (by its own books or the manager's), or had sent its data, still on the way;
//!   or its manager, late to learn of the death (declared itself, or asleep), granted it a
//!   write afterwards (its request was still on the way). A reader's death alone loses
//!   nothing. (A declared node is dead from its verdict on.) A manager refuses as restarted
//!   only while it is.
//! - Every failed fault is explained, per page and per cause: `PageLost` only on a page a
//!   dead node may have taken (as above: the source of a transfer is the owner);
//!   `ManagerDown` only when the manager incarnation the node knew really died (crashed or
//!   declared) and the node has learnt it; `ManagerRestarted` only from a recovering
//!   manager's refusal; `LoadFailed` only from an injected failure of that page's load on
//!   that node; none at all otherwise (faults of a declared node excepted).
//! - No protocol violation is reported (but by a declared node: the others stopped waiting
//!   for it, so its state may contradict what it is sent, and the daemon logs and drops such
//!   a message); no action is produced for a cancelled fault.
//!
//! At the end it stops new work and drains (failures still happen early in the drain; pauses
//! and cuts run their course): every fault must then be resolved or failed as above, and no
//! node may have anything left in progress on the current job's pages. A failure prints the
//! seed that reproduces it. Counters of the run are printed at the end; over 100 seeds or more,
//! every path (each kind of pause, cut and verdict, the transport's drops) must have run.
//!
//! `PSLS_SIM_SEEDS=N` runs N seeds (default 10000); `PSLS_SIM_SEED=S` runs only seed S;
//! `PSLS_SIM_TRACE=1` prints every event.
//!
//! Why one file of this size: one simulated world (nodes, shell, clients, network) whose
//! checks after every step read all of it.

use psls_svm::coherence::{
    Access, Action, Envelope, FaultError, FenceAnswer, InProgress, Msg, ProtocolError, Receipt, Svm, TxnId, WaiterId,
};
use psls_svm::rng::SplitMix64;
use psls_svm::{FileId, Incarnation, NodeId, PageId};
use std::collections::{BTreeMap, HashMap, HashSet};

struct Rng(SplitMix64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        assert!(n > 0);
        (self.0.next_u64() % n as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.0.next_u64() % 100 < percent
    }
    fn permille(&mut self, p: u64) -> bool {
        self.0.next_u64() % 1000 < p
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
    /// Faulted (this waiter); waiting for the daemon.
    Waiting(Op, WaiterId),
}

struct Client {
    node: usize,
    state: ClientState,
    /// The client's page table: how each page is mapped in it (absent: not mapped).
    mapped: HashMap<PageId, Access>,
}

struct Node {
    svm: Svm,
    /// The node's memory (its memfd): page → value. Present is not the same as accessible.
    mem: HashMap<PageId, u64>,
    loads: Vec<(PageId, TxnId)>,
    /// Access per page as the `SetAccess` actions run so far left it.
    applied: HashMap<PageId, Access>,
    /// Holds segments of the current job (a client of it used one): its heartbeats say so.
    segs: bool,
    /// Every node's incarnation as this node knew it when it took up the job's segments (the
    /// daemon's `Segment::known_at_open`).
    seg_known: Vec<Incarnation>,
    /// This incarnation was declared down (a committed verdict) while live: dead to the
    /// others from then on, though it runs on, its clients too, until it learns of it.
    declared: bool,
    /// It learnt of its verdict: its ranks are killed (its clients never act again) and it
    /// rejoins as a new incarnation soon.
    fenced: bool,
    /// Paused (SIGSTOP, a VM stall) until that step: it does nothing meanwhile.
    paused_until: Option<u64>,
    /// The pause outlasts the failure timeout: the coordinator declares it down at that step.
    pause_verdict_at: Option<u64>,
    /// Woke from a pause during which it was declared down (it has not learnt it yet).
    woke_declared: bool,
    /// Declared down, its connections broke: what is sent to it while it sleeps is lost.
    cut_off: bool,
    /// The verdict book: per node, the highest incarnation this node knows was declared down
    /// (0: none). Its transport drops what such an incarnation sends.
    verdicts: Vec<Incarnation>,
    /// While a job ends: this node dropped the job's segments.
    dropped: bool,
}

impl Node {
    fn new(svm: Svm, verdicts: Vec<Incarnation>, dropped: bool) -> Node {
        Node {
            svm,
            mem: HashMap::new(),
            loads: Vec::new(),
            applied: HashMap::new(),
            segs: false,
            seg_known: Vec::new(),
            declared: false,
            fenced: false,
            paused_until: None,
            pause_verdict_at: None,
            woke_declared: false,
            cut_off: false,
            verdicts,
            dropped,
        }
    }

    fn paused(&self) -> bool {
        self.paused_until.is_some()
    }
}

/// What a node learns of another (or of itself) from membership and the metadata.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Learn {
    /// That incarnation runs (`peer_up`).
    Up,
    /// That incarnation died: a verdict, in the book and then in the state machine
    /// (`peer_down`).
    Down,
    /// A verdict on that incarnation, in the book only (the state machine hears of it by a
    /// later `Down`); about the node itself, its own verdict: it fences itself.
    Verdict,
}

/// A cut link: messages from `a` to `b` (and from `b` to `a` if `both`) are held until it
/// heals.
#[derive(Clone, Copy, Debug)]
struct Cut {
    a: usize,
    b: usize,
    both: bool,
    until: u64,
    /// A cut longer than the failure timeout: at that step, the coordinator declares that
    /// node, at that incarnation, down.
    verdict: Option<(u64, usize, Incarnation)>,
    /// The connections broke after the verdict on that node (at that incarnation): while it
    /// runs, what is sent on the cut link is lost.
    broken: Option<(usize, Incarnation)>,
}

impl Cut {
    fn holds(&self, from: usize, to: usize) -> bool {
        (from == self.a && to == self.b) || (self.both && from == self.b && to == self.a)
    }
}

/// The input a node is processing, for what it explains.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cause {
    Other,
    /// That node's load of that page failed (injected).
    LoadFailed(usize, PageId),
    /// A `Deny` delivered to that node.
    Denied(usize, PageId, FaultError),
}

/// Counters over a run.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    done: u64,
    failed: u64,
    /// Failures by error: lost, manager down, load failed, too many waiters, manager
    /// restarted.
    failed_by: [u64; 5],
    crashes: u64,
    double_crashes: u64,
    verdicts: u64,
    dropped_msgs: u64,
    cancels: u64,
    job_ends: u64,
    end_recoveries: u64,
    /// Files a restarted manager served again after asking ([`Svm::fence_checked`]).
    fences_cleared: u64,
    /// Resolved faults whose page was not in memory any more (the client faulted again).
    woken_unmapped: u64,
    /// Client operations done between two actions of their node's shell.
    interleaved: u64,
    joined: u64,
    late: u64,
    redundant: u64,
    /// Reads abandoned because an invalidation overtook their data, and forwarded reads
    /// served again because the owner by the manager's books had no copy.
    abandoned: u64,
    reforwarded: u64,
    /// Pauses shorter and longer than the failure timeout, and what the paused node was:
    /// the manager of a page with a directory entry, a page's owner by its manager's books,
    /// the requester of a transaction in flight, a node loading a page.
    pauses_short: u64,
    pauses_long: u64,
    paused_managers: u64,
    paused_owners: u64,
    paused_in_txn: u64,
    paused_loading: u64,
    /// Cut links, one way and both ways, and those longer than the failure timeout.
    cuts_one_way: u64,
    cuts_two_way: u64,
    cuts_long: u64,
    /// Verdicts on a paused node, on the cut-off end of a one-way and of a two-way cut.
    verdicts_paused: u64,
    verdicts_cut_one_way: u64,
    verdicts_cut_two_way: u64,
    /// Messages a transport dropped because it knew their incarnation declared down.
    dropped_fenced: u64,
    /// Messages a declared node sent before it learnt of its verdict, and of those, after
    /// waking from the pause that got it declared; client operations of declared nodes
    /// before they learnt of it.
    declared_sends: u64,
    woken_declared_sends: u64,
    declared_ops: u64,
    /// Nodes that learnt of their own verdict and fenced themselves.
    self_fences: u64,
    /// Messages a declared node rejected as protocol violations (logged and dropped).
    declared_violations: u64,
    /// Messages lost as they were sent on a broken link.
    lost_on_broken: u64,
}

impl Counts {
    fn add(&mut self, c: &Counts) {
        macro_rules! sum {
            ($($f:ident),*) => { $(self.$f += c.$f;)* };
        }
        sum!(
            done,
            failed,
            crashes,
            double_crashes,
            verdicts,
            dropped_msgs,
            cancels,
            job_ends,
            end_recoveries,
            fences_cleared,
            woken_unmapped,
            interleaved,
            joined,
            late,
            redundant,
            abandoned,
            reforwarded,
            pauses_short,
            pauses_long,
            paused_managers,
            paused_owners,
            paused_in_txn,
            paused_loading,
            cuts_one_way,
            cuts_two_way,
            cuts_long,
            verdicts_paused,
            verdicts_cut_one_way,
            verdicts_cut_two_way,
            dropped_fenced,
            declared_sends,
            woken_declared_sends,
            declared_ops,
            self_fences,
            declared_violations,
            lost_on_broken
        );
        for (a, b) in self.failed_by.iter_mut().zip(c.failed_by) {
            *a += b;
        }
    }
}

struct World {
    seed: u64,
    rng: Rng,
    nodes: Vec<Node>,
    clients: Vec<Client>,
    /// Pages per job, and files they spread over.
    npages: usize,
    files: usize,
    job: u64,
    /// The current job's pages.
    pages: Vec<PageId>,
    /// The job ended: nodes drop its segments; no client works until the next job.
    ending: bool,
    /// In flight: (to, envelope, payload).
    net: Vec<(usize, Envelope, Option<u64>)>,
    /// Membership and verdict news not yet delivered: (to node, about node, incarnation,
    /// what).
    news: Vec<(usize, usize, Incarnation, Learn)>,
    /// The committed verdicts (the metadata's `down`): per node, the highest incarnation
    /// declared down (0: none).
    committed: Vec<Incarnation>,
    /// Links cut now.
    cuts: Vec<Cut>,
    /// The failure timeout, in steps: a silence longer than this leads to a verdict.
    timeout: u64,
    /// The latest value written to each page (the disk holds 0 and is never written here).
    truth: HashMap<PageId, u64>,
    next_value: u64,
    next_waiter: WaiterId,
    /// Faults waiting: waiter → client.
    waiters: HashMap<WaiterId, usize>,
    /// Pages whose latest version a node that died may have taken (see [`World::taint`]):
    /// only their faults may fail as lost.
    tainted: HashSet<PageId>,
    /// The input being processed, and what the node processing it knew of every node's
    /// incarnation before it.
    cause: Cause,
    known_before: Vec<Incarnation>,
    /// A restarted manager's questions about files it does not serve yet
    /// ([`Action::CheckFence`]), not answered yet: (node, its incarnation, file).
    fence_checks: Vec<(usize, Incarnation, FileId)>,
    /// Per mille per step: crashes, link breaks, pauses, cuts.
    crash_rate: u64,
    break_rate: u64,
    pause_rate: u64,
    cut_rate: u64,
    c: Counts,
    steps: u64,
    trace: Vec<String>,
}

/// Most deaths (crashes and verdicts) in one seed.
const MAX_DEATHS: u64 = 10;

impl World {
    fn new(seed: u64) -> World {
        let mut rng = Rng(SplitMix64::new(seed));
        let n = 2 + rng.below(4);
        let files = 1 + rng.below(2);
        let npages = 1 + rng.below(4);
        let peers: Vec<Option<Incarnation>> = (0..n).map(|_| Some(Incarnation(1))).collect();
        let nodes = (0..n)
            .map(|i| {
                let svm = Svm::new(NodeId(i as u32), Incarnation(1), peers.clone());
                Node::new(svm, vec![Incarnation(0); n], false)
            })
            .collect();
        let per_node = 1 + rng.below(2);
        let clients = (0..n * per_node)
            .map(|k| Client {
                node: k % n,
                state: ClientState::Idle,
                mapped: HashMap::new(),
            })
            .collect();
        // Most seeds see failures: crashes on most, link breaks on one in two.
        let crash_rate = if rng.chance(85) { 20 + rng.below(60) as u64 } else { 0 };
        let break_rate = if rng.chance(50) { 20 + rng.below(40) as u64 } else { 0 };
        // Pauses on one seed in two, cuts on one in two, short and long ones alike.
        let pause_rate = if rng.chance(50) { 10 + rng.below(30) as u64 } else { 0 };
        let cut_rate = if rng.chance(50) { 10 + rng.below(30) as u64 } else { 0 };
        let timeout = 10 + rng.below(30) as u64;
        let mut w = World {
            seed,
            rng,
            nodes,
            clients,
            npages,
            files,
            job: 0,
            pages: Vec::new(),
            ending: false,
            net: Vec::new(),
            news: Vec::new(),
            committed: vec![Incarnation(0); n],
            cuts: Vec::new(),
            timeout,
            truth: HashMap::new(),
            next_value: 1,
            next_waiter: 0,
            waiters: HashMap::new(),
            tainted: HashSet::new(),
            cause: Cause::Other,
            known_before: Vec::new(),
            fence_checks: Vec::new(),
            crash_rate,
            break_rate,
            pause_rate,
            cut_rate,
            c: Counts::default(),
            steps: 0,
            trace: Vec::new(),
        };
        w.pages = w.job_pages();
        w
    }

    /// The current job's pages (each job its own files). Indices 5 apart: some pages share a
    /// run of pages (a manager), others do not.
    fn job_pages(&self) -> Vec<PageId> {
        (0..self.npages)
            .map(|k| PageId {
                file: FileId(100 + 16 * self.job + (k % self.files) as u64),
                index: 5 * k as u64,
            })
            .collect()
    }

    /// Node `i` takes up the current job's segments (a client of it uses them), if not yet:
    /// they remember what it knew then.
    fn hold_segments(&mut self, i: usize) {
        if !self.nodes[i].segs {
            let n = self.nodes.len();
            self.nodes[i].segs = true;
            self.nodes[i].seg_known = (0..n)
                .map(|m| self.nodes[i].svm.known_incarnation(NodeId(m as u32)))
                .collect();
        }
    }

    /// The current job's files.
    fn job_files(&self) -> Vec<FileId> {
        let mut f: Vec<FileId> = self.pages.iter().map(|p| p.file).collect();
        f.sort();
        f.dedup();
        f
    }

    /// The shell of node `i` (incarnation `inc`) has every other node's answer about `file`
    /// ([`Svm::fence_answer`]; every other node, [`Svm::fence_askees`], a declared one too: it
    /// runs until it restarts): the file is served if all say clean, refused if one held it;
    /// asked again later if one has not learnt of the restart yet.
    fn answer_fence(&mut self, k: usize) {
        let (i, inc, file) = self.fence_checks.swap_remove(k);
        if self.nodes[i].svm.incarnation() != inc {
            self.log(format!("n{i} incarnation {} died before its check of {file}", inc.0));
            return;
        }
        let files = self.job_files();
        let mut answers = Vec::new();
        for j in self.nodes[i].svm.fence_askees().into_iter().map(|n| n.0 as usize) {
            let seg = (self.nodes[j].segs && files.contains(&file)).then(|| self.nodes[j].seg_known[i]);
            answers.push(self.nodes[j].svm.fence_answer(NodeId(i as u32), inc, file, seg));
        }
        self.log(format!("n{i} asked about {file}: {answers:?}"));
        let held = answers.contains(&FenceAnswer::Held);
        if !held && answers.contains(&FenceAnswer::Unknown) {
            self.fence_checks.push((i, inc, file));
            return;
        }
        if !held && self.nodes[i].svm.recovering() && !self.nodes[i].svm.serves(file) {
            // As `end_recovery`, for this file: nobody alive holds any of it or saw it since
            // the restart, so its pages managed here start again from disk.
            self.c.fences_cleared += 1;
            for p in self.pages.clone() {
                if p.file == file && self.manager(p) == i {
                    self.truth.remove(&p);
                }
            }
        }
        self.begin(i, Cause::Other);
        self.nodes[i].svm.fence_checked(file, !held);
        self.run_actions(i);
    }

    fn manager(&self, page: PageId) -> usize {
        self.nodes[0].svm.manager(page).0 as usize
    }

    fn fail(&self, why: String) -> ! {
        let tail: Vec<&String> = self.trace.iter().rev().take(60).collect();
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

    /// Node `i` is about to process an input: remembers what it explains.
    fn begin(&mut self, i: usize, cause: Cause) {
        if self.nodes[i].paused() {
            self.fail(format!("n{i} is paused, yet its shell processes an input"));
        }
        self.cause = cause;
        self.known_before = (0..self.nodes.len())
            .map(|m| self.nodes[i].svm.known_incarnation(NodeId(m as u32)))
            .collect();
    }

    /// Why a fault of node `i` on `page` may fail with `error` now, or why not.
    fn excuse(&self, i: usize, page: PageId, error: FaultError) -> Result<(), String> {
        if self.nodes[i].declared {
            // Declared dead: its ranks die when it learns of it, their faults with them.
            return Ok(());
        }
        match error {
            FaultError::LoadFailed if self.cause == Cause::LoadFailed(i, page) => Ok(()),
            FaultError::LoadFailed => Err("no load of that page failed on that node".into()),
            FaultError::ManagerRestarted if self.cause == Cause::Denied(i, page, error) => Ok(()),
            FaultError::ManagerRestarted => Err("not on a restarted manager's refusal".into()),
            FaultError::ManagerDown => {
                let m = self.manager(page);
                let k = self.known_before[m];
                let dead = self.nodes[m].svm.incarnation() > k
                    || (self.nodes[m].declared && self.nodes[m].svm.incarnation() == k);
                let svm = &self.nodes[i].svm;
                let learnt = !svm.is_up(NodeId(m as u32)) || svm.known_incarnation(NodeId(m as u32)) > k;
                if dead && learnt {
                    Ok(())
                } else {
                    Err(format!(
                        "manager n{m} incarnation {} did not die (dead {dead}, learnt {learnt})",
                        k.0
                    ))
                }
            }
            FaultError::PageLost if self.tainted.contains(&page) => Ok(()),
            FaultError::PageLost => Err("no node that died may have taken its latest version".into()),
            FaultError::TooManyWaiters => Err("the simulator never has that many".into()),
        }
    }

    /// Runs node `i`'s queued actions, as the daemon would, in order.
    fn run_actions(&mut self, i: usize) {
        for _ in 0..100_000 {
            // A client thread does not wait for the shell's lock.
            if self.rng.chance(10) {
                self.client_inline(i);
            }
            let Some(a) = self.nodes[i].svm.poll_action() else {
                self.cause = Cause::Other;
                return;
            };
            self.log(format!("n{i} {a:?}"));
            match a {
                Action::Send { to, env } => {
                    let page = env.msg.page();
                    match env.msg {
                        Msg::Deny {
                            error: FaultError::ManagerRestarted,
                            ..
                        } if !self.nodes[i].svm.recovering() => {
                            self.fail(format!("n{i} refuses {page} as restarted, but it is not recovering"))
                        }
                        Msg::Deny {
                            error: FaultError::PageLost,
                            ..
                        } if self.live_page(page) && !self.tainted.contains(&page) => self.fail(format!(
                            "n{i} says {page} is lost, but no node that died may have taken its latest version"
                        )),
                        _ => {}
                    }
                    let payload = if env.msg.has_payload() {
                        // A snapshot while clients could still write would miss their stores.
                        if self.nodes[i].applied.get(&page) == Some(&Access::Write)
                            || self
                                .clients
                                .iter()
                                .any(|c| c.node == i && c.mapped.get(&page) == Some(&Access::Write))
                        {
                            self.fail(format!("n{i} snapshots page {page} while it may still be written"));
                        }
                        match self.nodes[i].mem.get(&page) {
                            Some(v) => Some(*v),
                            None => self.fail(format!("n{i} sends page {page} it does not have")),
                        }
                    } else {
                        None
                    };
                    if self.nodes[i].declared && !self.nodes[i].fenced {
                        self.c.declared_sends += 1;
                        self.c.woken_declared_sends += self.nodes[i].woke_declared as u64;
                    }
                    let to = to.0 as usize;
                    self.net.push((to, env, payload));
                    if let Some(v) = self.lost_on_send(i, to) {
                        // The connection broke and cannot be made again yet: the message is
                        // lost (what the declared node took with it first).
                        self.taint(&[v]);
                        if let Some((_, env, _)) = self.net.pop() {
                            self.c.dropped_msgs += 1;
                            self.c.lost_on_broken += 1;
                            self.log(format!("lost (the link to n{to} is broken): {env:?}"));
                        }
                    }
                }
                Action::Load { page, txn } => self.nodes[i].loads.push((page, txn)),
                Action::CheckFence { file } => {
                    let inc = self.nodes[i].svm.incarnation();
                    if !self.nodes[i].svm.recovering() || self.nodes[i].svm.serves(file) {
                        self.fail(format!("n{i} checks {file} but serves it"));
                    }
                    self.fence_checks.push((i, inc, file));
                }
                Action::SetAccess { page, access } => {
                    match access {
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
                    }
                    for c in self.clients.iter_mut().filter(|c| c.node == i) {
                        match access {
                            // Punched out of the memfd: gone from every mapping.
                            None => {
                                c.mapped.remove(&page);
                            }
                            // Write-protected in every mapping.
                            Some(Access::Read) => {
                                if let Some(m) = c.mapped.get_mut(&page) {
                                    *m = Access::Read;
                                }
                            }
                            Some(Access::Write) => {}
                        }
                    }
                }
                Action::Resolve { waiter, page, access } => {
                    let Some(k) = self.waiters.remove(&waiter) else {
                        self.fail(format!("resolve of waiter {waiter}, which does not wait (cancelled?)"))
                    };
                    let op = match self.clients[k].state {
                        ClientState::Waiting(op, w) if w == waiter && op.page() == page && op.access() <= access => op,
                        other => self.fail(format!(
                            "resolve of {page} {access:?} for client {k} in state {other:?}"
                        )),
                    };
                    // As the daemon: mapped (UFFDIO_CONTINUE) as the node's access allows, if
                    // the memory holds the page; else the client is woken and faults again.
                    if self.nodes[i].mem.contains_key(&page) {
                        let m = match self.nodes[i].svm.access(page) {
                            Some(Access::Write) => Access::Write,
                            _ => Access::Read,
                        };
                        self.clients[k].mapped.insert(page, m);
                    } else {
                        self.c.woken_unmapped += 1;
                    }
                    self.clients[k].state = ClientState::Ready(op);
                }
                Action::Fail { waiter, page, error } => {
                    let Some(k) = self.waiters.remove(&waiter) else {
                        self.fail(format!("fail of waiter {waiter}, which does not wait (cancelled?)"))
                    };
                    let state = self.clients[k].state;
                    if !matches!(state, ClientState::Waiting(op, w) if w == waiter && op.page() == page) {
                        self.fail(format!("fail for client {k} in state {state:?}"));
                    }
                    if let Err(why) = self.excuse(i, page, error) {
                        self.fail(format!(
                            "fault of client {k} on n{i} on {page} failed: {error}; unexplained: {why}"
                        ));
                    }
                    self.clients[k].state = ClientState::Idle;
                    self.c.failed += 1;
                    self.c.failed_by[error as usize] += 1;
                }
            }
        }
        self.fail(format!("n{i} produced an unbounded number of actions"));
    }

    /// Whether `page` belongs to the running job (an ended job's pages are being forgotten:
    /// their directories go before their copies, and their messages may find no state).
    fn live_page(&self, page: PageId) -> bool {
        !self.ending && self.pages.contains(&page)
    }

    /// Whether client `k` may work: its job is running, its node is neither paused nor fenced
    /// (a declared node's clients work on until it learns of its verdict).
    fn may_work(&self, k: usize) -> bool {
        let n = &self.nodes[self.clients[k].node];
        !self.ending && !n.fenced && !n.paused()
    }

    /// A client of node `i` is about to read, write or fault: never on a paused node, nor on
    /// one that learnt of its verdict (its ranks are killed).
    fn check_client_may_act(&self, k: usize, op: Op, fault: bool) {
        let i = self.clients[k].node;
        let what = if fault { "faults" } else { "does" };
        if self.nodes[i].fenced {
            self.fail(format!(
                "client {k} on n{i} {what} {op:?} after its node learnt of its verdict (incarnation {})",
                self.nodes[i].svm.incarnation().0
            ));
        }
        if self.nodes[i].paused() {
            self.fail(format!("client {k} on n{i} {what} {op:?} while its node is paused"));
        }
    }

    /// Client `k` does `op` in memory, as its page table allows (checked by the caller).
    fn perform(&mut self, k: usize, op: Op) {
        self.check_client_may_act(k, op, false);
        let i = self.clients[k].node;
        let page = op.page();
        let have = self.nodes[i].mem.get(&page).copied();
        let want = self.truth.get(&page).copied().unwrap_or(0);
        // A declared node's reads are not checked: the others may have moved on without it
        // (its ranks die when it learns of its verdict).
        let declared = self.nodes[i].declared;
        self.c.declared_ops += declared as u64;
        match op {
            Op::Read(_) => {
                if have != Some(want) && !declared {
                    self.fail(format!(
                        "client {k} on n{i} read {have:?} from {page}, latest write is {want}"
                    ));
                }
            }
            Op::Write(_, v) => {
                if have.is_none() {
                    self.fail(format!("client {k} on n{i} writes {page}, mapped but not in memory"));
                }
                self.nodes[i].mem.insert(page, v);
                self.truth.insert(page, v);
            }
        }
        self.log(format!("client {k} on n{i} did {op:?}"));
        self.clients[k].state = ClientState::Idle;
        self.c.done += 1;
    }

    /// A ready client of node `i` whose mapping allows its operation does it now (between two
    /// actions of the shell).
    fn client_inline(&mut self, i: usize) {
        let able: Vec<(usize, Op)> = (0..self.clients.len())
            .filter(|&k| self.clients[k].node == i && self.may_work(k))
            .filter_map(|k| match self.clients[k].state {
                ClientState::Ready(op) if self.clients[k].mapped.get(&op.page()).copied() >= Some(op.access()) => {
                    Some((k, op))
                }
                _ => None,
            })
            .collect();
        if able.is_empty() {
            return;
        }
        let (k, op) = able[self.rng.below(able.len())];
        self.c.interleaved += 1;
        self.perform(k, op);
    }

    /// Client `k` tries its op: done if its page table allows it, else a fault.
    fn client_try(&mut self, k: usize) {
        let ClientState::Ready(op) = self.clients[k].state else {
            return;
        };
        let i = self.clients[k].node;
        self.hold_segments(i);
        if self.clients[k].mapped.get(&op.page()).copied() >= Some(op.access()) {
            self.perform(k, op);
            return;
        }
        self.check_client_may_act(k, op, true);
        let waiter = self.next_waiter;
        self.next_waiter += 1;
        self.waiters.insert(waiter, k);
        self.clients[k].state = ClientState::Waiting(op, waiter);
        self.log(format!("client {k} on n{i} faults {op:?} as waiter {waiter}"));
        self.begin(i, Cause::Other);
        self.nodes[i].svm.fault(op.page(), op.access(), waiter);
        self.run_actions(i);
    }

    /// The daemon's transport rule (`Verdicts::accepts`): node `to` takes a message of
    /// incarnation `i` of its sender unless it knows a verdict on the sender at `i` or above.
    fn transport_accepts(&self, to: usize, env: &Envelope) -> bool {
        self.nodes[to].verdicts[env.from.0 as usize] < env.from_incarnation
    }

    /// Hands a message to node `to`'s state machine, the only way in: checks, apart from
    /// the transport's rule, that its sender's incarnation is not one `to` knows declared
    /// down (nothing it sends — data, grants, acks — may be applied there).
    fn receive(&mut self, to: usize, env: Envelope) -> Result<Receipt, ProtocolError> {
        let from = env.from.0 as usize;
        let known = self.nodes[to].verdicts[from];
        if env.from_incarnation <= known {
            self.fail(format!(
                "n{to} takes {:?} from n{from} incarnation {}, which it knows was declared down (verdict at {})",
                env.msg, env.from_incarnation.0, known.0
            ));
        }
        self.nodes[to].svm.receive(env)
    }

    fn deliver(&mut self, m: usize) {
        let (to, env, payload) = self.net.swap_remove(m);
        if self.nodes[to].paused() {
            self.fail(format!("a message is delivered to n{to}, which is paused"));
        }
        if let Some(c) = self.cuts.iter().find(|c| c.holds(env.from.0 as usize, to)) {
            self.fail(format!("a message crosses the cut link {c:?}"));
        }
        if !self.transport_accepts(to, &env) {
            self.c.dropped_fenced += 1;
            self.log(format!(
                "n{to} drops (sender's incarnation declared down): {env:?} payload {payload:?}"
            ));
            return;
        }
        self.log(format!("deliver to n{to}: {env:?} payload {payload:?}"));
        let cause = match env.msg {
            Msg::Deny { page, error, .. } => Cause::Denied(to, page, error),
            _ => Cause::Other,
        };
        self.begin(to, cause);
        match self.receive(to, env) {
            Ok(Receipt::Install(page)) => match payload {
                Some(v) => {
                    self.nodes[to].mem.insert(page, v);
                }
                None => self.fail("install without a payload".into()),
            },
            Ok(_) => {}
            // An ended job's pages are forgotten node by node: a manager that forgot one may
            // grant it afresh to a node still holding it. The daemon logs such a message and
            // drops it; no process maps the page any more.
            Err(e) if !self.live_page(e.page) => self.log(format!("n{to} rejects: {e}")),
            // A declared node runs on while the others, having learnt of its verdict, no longer
            // wait for it: the acks it owes are waived (a write may complete while its `Inval`
            // is still on the way to it), and messages to it may be lost. It may then be sent
            // what contradicts its state; the daemon logs and drops such a message. It is dead
            // to the others, and its ranks die when it learns of it.
            Err(e) if self.nodes[to].declared => {
                self.c.declared_violations += 1;
                self.log(format!("n{to} (declared) rejects: {e}"));
            }
            Err(e) => self.fail(format!("n{to}: {e}")),
        }
        self.run_actions(to);
    }

    fn finish_load(&mut self, i: usize, l: usize) {
        let (page, txn) = self.nodes[i].loads.swap_remove(l);
        let ok = !self.rng.chance(2);
        if ok {
            self.nodes[i].mem.insert(page, 0);
        }
        self.log(format!("n{i} load of {page} done ok={ok}"));
        let cause = if ok { Cause::Other } else { Cause::LoadFailed(i, page) };
        self.begin(i, cause);
        self.nodes[i].svm.loaded(page, txn, ok);
        self.run_actions(i);
    }

    /// Nodes `vs` die together (crash or verdict): the pages whose latest version they may
    /// take with them may be lost from now on. Those are the pages one of them owns by its
    /// manager's books, holds as the last copy outside them (a fenced node's copy counts as
    /// gone), could write, is writing (a write transaction of its in progress, by its own books
    /// or the manager's), or sent the data of (still on the way). A reader's death alone, or a
    /// requester's reading, loses nothing.
    fn taint(&mut self, vs: &[usize]) {
        for &page in &self.pages {
            let dir = self.nodes[self.manager(page)].svm.directory(page);
            let holds_elsewhere = (0..self.nodes.len())
                .any(|j| !vs.contains(&j) && !self.nodes[j].declared && self.nodes[j].applied.contains_key(&page));
            let takes = |v: usize| {
                let me = NodeId(v as u32);
                let n = &self.nodes[v];
                let owner = dir.as_ref().is_some_and(|d| d.0 == Some(me));
                let last = n.applied.contains_key(&page) && !holds_elsewhere;
                let writes = n.applied.get(&page) == Some(&Access::Write)
                    || n.svm.access(page) == Some(Access::Write)
                    || n.svm.in_progress(page).pending.is_some_and(|(_, a)| a == Access::Write)
                    || self.nodes.iter().any(|m| {
                        m.svm
                            .in_progress(page)
                            .busy
                            .iter()
                            .any(|&(t, a)| t.node == me && a == Access::Write)
                    });
                let sourcing = self
                    .net
                    .iter()
                    .any(|(_, e, _)| e.from == me && e.msg.page() == page && e.msg.has_payload());
                owner || last || writes || sourcing
            };
            if vs.iter().any(|&v| takes(v)) {
                self.tainted.insert(page);
            }
        }
    }

    /// Drops in-flight messages that `keep` refuses; counts them.
    fn drop_messages(&mut self, mut drop: impl FnMut(&mut Rng, usize, &Envelope) -> bool) {
        let mut kept = Vec::with_capacity(self.net.len());
        for m in std::mem::take(&mut self.net) {
            if drop(&mut self.rng, m.0, &m.1) {
                self.c.dropped_msgs += 1;
                self.trace.push(format!("dropped: to n{} {:?}", m.0, m.1));
            } else {
                kept.push(m);
            }
        }
        self.net = kept;
    }

    /// Nodes `vs` crash at once and restart.
    fn crash(&mut self, vs: &[usize]) {
        self.c.crashes += 1;
        if vs.len() > 1 {
            self.c.double_crashes += 1;
        }
        self.taint(vs);
        // Their queued messages die with them (those on the wire arrive).
        self.drop_messages(|rng, _, e| vs.contains(&(e.from.0 as usize)) && rng.chance(50));
        for &v in vs {
            self.restart(v);
        }
    }

    /// Node `v` (crashed, or fenced after its verdict) starts again as a new incarnation.
    fn restart(&mut self, v: usize) {
        let old = self.nodes[v].svm.incarnation();
        let inc = Incarnation(old.0 + 1);
        let was_declared = self.nodes[v].declared;
        // As the daemon's `ensure_svm`: if another node holds segments, it may hold pages the
        // lost directory counted, and the pages managed here are refused.
        let others_hold = (0..self.nodes.len()).any(|j| j != v && self.nodes[j].segs);
        self.log(format!(
            "RESTART n{v} as incarnation {} ({})",
            inc.0,
            if others_hold { "recovering" } else { "fresh" }
        ));
        // It knows everybody's current incarnation, but not one declared dead.
        let peers: Vec<Option<Incarnation>> = self
            .nodes
            .iter()
            .map(|n| (!n.declared).then(|| n.svm.incarnation()))
            .collect();
        let mut peers = peers;
        // Some peers it has not heard from yet: it learns of them later.
        let mut deaf = Vec::new();
        for (j, p) in peers.iter_mut().enumerate() {
            if j != v && p.is_some() && self.rng.chance(30) {
                deaf.push((j, p.take().unwrap_or(Incarnation(0))));
            }
        }
        peers[v] = Some(inc);
        let me = NodeId(v as u32);
        let svm = if others_hold {
            Svm::restarted(me, inc, peers)
        } else {
            self.restart_from_disk(v, false);
            Svm::new(me, inc, peers)
        };
        // It reads the committed verdicts as it starts (the daemon's metadata catch-up).
        self.nodes[v] = Node::new(svm, self.committed.clone(), self.ending);
        for k in 0..self.clients.len() {
            if self.clients[k].node != v {
                continue;
            }
            if let ClientState::Waiting(_, w) = self.clients[k].state {
                self.waiters.remove(&w);
            }
            self.clients[k].state = ClientState::Idle;
            self.clients[k].mapped.clear();
        }
        for (j, jinc) in deaf {
            self.news.push((v, j, jinc, Learn::Up));
        }
        for j in 0..self.nodes.len() {
            if j != v {
                // Each other node hears, at its own time, of the death (a verdict, unless one
                // was committed already, or the restart beat the failure detector), then of
                // the restart.
                if !was_declared && self.rng.chance(70) {
                    self.committed[v] = self.committed[v].max(old);
                    self.tell_verdict(j, v, old);
                }
                self.news.push((j, v, inc, Learn::Up));
            }
        }
    }

    /// Node `j` learns, at its own time, of the verdict on incarnation `inc` of `v`: its book
    /// first (at once, or by an earlier piece of news), then its state machine.
    fn tell_verdict(&mut self, j: usize, v: usize, inc: Incarnation) {
        if self.rng.chance(50) {
            self.news.push((j, v, inc, Learn::Verdict));
        }
        self.news.push((j, v, inc, Learn::Down));
    }

    /// Node `v`, live, is declared dead (a committed verdict): dead to the others, though it
    /// runs on until it learns of it.
    fn verdict(&mut self, v: usize) {
        self.c.verdicts += 1;
        self.taint(&[v]);
        let inc = self.nodes[v].svm.incarnation();
        self.log(format!("VERDICT: n{v} incarnation {} declared dead", inc.0));
        self.nodes[v].declared = true;
        self.committed[v] = self.committed[v].max(inc);
        for j in 0..self.nodes.len() {
            if j != v {
                self.tell_verdict(j, v, inc);
            }
        }
        // It learns of it too, at its own time (once awake).
        self.news.push((v, v, inc, Learn::Verdict));
    }

    /// The link between live nodes `a` and `b` breaks: its queued messages (both ways) are
    /// dropped, and one of the two is declared dead.
    fn link_break(&mut self, a: usize, b: usize) {
        let v = if self.rng.chance(50) { a } else { b };
        self.log(format!("LINK n{a}-n{b} breaks"));
        self.break_link(a, b, v);
        self.verdict(v);
    }

    /// The connections between `a` and `b` break, `v` (one of them) being declared dead:
    /// their queues are dropped, both ways (what `v` took with it first).
    fn break_link(&mut self, a: usize, b: usize, v: usize) {
        self.taint(&[v]);
        self.nodes[v].cut_off = true;
        self.drop_messages(|_, to, e| {
            let from = e.from.0 as usize;
            (to == a && from == b) || (to == b && from == a)
        });
    }

    /// Deaths so far (crashes and verdicts), bounded per seed.
    fn deaths(&self) -> u64 {
        self.c.crashes + self.c.double_crashes + self.c.verdicts
    }

    /// Node `v` pauses (SIGSTOP, a VM stall): for less than the failure timeout (no verdict),
    /// or for longer (a verdict while it sleeps).
    fn pause(&mut self, v: usize) {
        let t = self.timeout;
        let long = self.rng.chance(50);
        let d = if long {
            t + 1 + self.rng.below(2 * t as usize) as u64
        } else {
            1 + self.rng.below(t as usize - 1) as u64
        };
        // What it is in the middle of.
        let me = NodeId(v as u32);
        let node = &self.nodes[v];
        let manages = self
            .pages
            .iter()
            .any(|&p| self.manager(p) == v && node.svm.directory(p).is_some());
        let owns = self.pages.iter().any(|&p| {
            self.nodes[self.manager(p)]
                .svm
                .directory(p)
                .is_some_and(|d| d.0 == Some(me))
        });
        let in_txn = self.pages.iter().any(|&p| node.svm.in_progress(p).pending.is_some());
        let loading = !node.loads.is_empty();
        self.c.paused_managers += manages as u64;
        self.c.paused_owners += owns as u64;
        self.c.paused_in_txn += in_txn as u64;
        self.c.paused_loading += loading as u64;
        if long {
            self.c.pauses_long += 1;
        } else {
            self.c.pauses_short += 1;
        }
        self.log(format!(
            "PAUSE n{v} for {d} steps (timeout {t}; manages {manages}, owns {owns}, in a transaction {in_txn}, loading {loading})"
        ));
        self.nodes[v].paused_until = Some(self.steps + d);
        self.nodes[v].pause_verdict_at = long.then_some(self.steps + t);
    }

    /// The link from `a` to `b` is cut, one way or both ways, for less than the failure
    /// timeout (its messages are late) or for longer (a verdict on the cut-off node).
    fn cut(&mut self, a: usize, b: usize) {
        let t = self.timeout;
        let both = self.rng.chance(50);
        let long = self.rng.chance(50);
        let d = if long {
            t + 1 + self.rng.below(2 * t as usize) as u64
        } else {
            1 + self.rng.below(t as usize - 1) as u64
        };
        // One way, the coordinator stops hearing `a`; both ways, either end (whichever the
        // coordinator is cut off from).
        let v = if both && self.rng.chance(50) { b } else { a };
        let verdict = long.then(|| (self.steps + t, v, self.nodes[v].svm.incarnation()));
        if both {
            self.c.cuts_two_way += 1;
        } else {
            self.c.cuts_one_way += 1;
        }
        self.c.cuts_long += long as u64;
        self.log(format!(
            "CUT n{a}{}n{b} for {d} steps (timeout {t})",
            if both { "<->" } else { "->" }
        ));
        self.cuts.push(Cut {
            a,
            b,
            both,
            until: self.steps + d,
            verdict,
            broken: None,
        });
    }

    /// Time passes: a pause or a cut that outlasts the failure timeout leads to a verdict (the
    /// connections may break then), paused nodes wake and cut links heal when their time
    /// comes.
    fn timers(&mut self) {
        let now = self.steps;
        for v in 0..self.nodes.len() {
            if self.nodes[v].pause_verdict_at.is_some_and(|t| t <= now) {
                self.nodes[v].pause_verdict_at = None;
                if self.nodes[v].paused() && !self.nodes[v].declared && self.deaths() < MAX_DEATHS {
                    self.c.verdicts_paused += 1;
                    self.log(format!("n{v} is silent past the timeout (paused)"));
                    if self.rng.chance(50) {
                        // Its connections break: their queues are dropped, both ways (what it
                        // sends itself does not leave it).
                        self.log(format!("n{v}'s connections break"));
                        self.taint(&[v]);
                        self.nodes[v].cut_off = true;
                        self.drop_messages(|_, to, e| (to == v) != (e.from.0 as usize == v));
                    }
                    self.verdict(v);
                }
            }
            if self.nodes[v].paused_until.is_some_and(|t| t <= now) {
                let n = &mut self.nodes[v];
                n.paused_until = None;
                n.woke_declared = n.declared;
                let declared = n.declared;
                self.log(format!(
                    "n{v} WAKES{}",
                    if declared { " (declared down meanwhile)" } else { "" }
                ));
            }
        }
        for k in 0..self.cuts.len() {
            let c = self.cuts[k];
            let Some((at, v, inc)) = c.verdict.filter(|x| x.0 <= now) else {
                continue;
            };
            self.cuts[k].verdict = None;
            let n = &self.nodes[v];
            if n.svm.incarnation() == inc && !n.declared && self.deaths() < MAX_DEATHS {
                if c.both {
                    self.c.verdicts_cut_two_way += 1;
                } else {
                    self.c.verdicts_cut_one_way += 1;
                }
                self.log(format!(
                    "n{v} is silent past the timeout (cut off since step {})",
                    at - self.timeout
                ));
                if self.rng.chance(50) {
                    self.log(format!("LINK n{}-n{} breaks", c.a, c.b));
                    self.break_link(c.a, c.b, v);
                    self.cuts[k].broken = Some((v, inc));
                }
                self.verdict(v);
            }
        }
        if self.cuts.iter().any(|c| c.until <= now) {
            for c in self.cuts.clone() {
                if c.until <= now {
                    self.log(format!("CUT n{}-n{} heals", c.a, c.b));
                }
            }
            self.cuts.retain(|c| c.until > now);
        }
    }

    /// Whether a message from `from` to `to` is lost as it is sent, and with which declared
    /// node: the link is cut and its connections broke when that node was declared down (it
    /// still runs that incarnation), or `to` sleeps and its connections broke.
    fn lost_on_send(&self, from: usize, to: usize) -> Option<usize> {
        if self.nodes[to].paused() && self.nodes[to].cut_off {
            return Some(to);
        }
        self.cuts
            .iter()
            .filter(|c| c.holds(from, to))
            .find_map(|c| c.broken.filter(|&(v, inc)| self.nodes[v].svm.incarnation() == inc))
            .map(|(v, _)| v)
    }

    /// Whether node `to` may take message `m` now (awake, and not held on a cut link).
    fn deliverable(&self, m: &(usize, Envelope, Option<u64>)) -> bool {
        let (to, from) = (m.0, m.1.from.0 as usize);
        !self.nodes[to].paused() && !self.cuts.iter().any(|c| c.holds(from, to))
    }

    fn deliver_news(&mut self, k: usize) {
        // Per (to, about), news arrive in order: take the first one of that pair.
        let (to, about, _, _) = self.news[k];
        let first = self.news.iter().position(|n| n.0 == to && n.1 == about).unwrap_or(k);
        let (to, about, inc, what) = self.news.remove(first);
        self.log(format!("n{to} learns n{about} incarnation {} is {what:?}", inc.0));
        if self.nodes[to].paused() {
            self.fail(format!("n{to} is paused, yet it learns news"));
        }
        if what != Learn::Up && to != about {
            let known = &mut self.nodes[to].verdicts[about];
            *known = (*known).max(inc);
        }
        match what {
            Learn::Up => {
                self.begin(to, Cause::Other);
                self.nodes[to].svm.peer_up(NodeId(about as u32), inc);
                self.run_actions(to);
            }
            Learn::Down => {
                self.begin(to, Cause::Other);
                self.nodes[to].svm.peer_down(NodeId(about as u32), inc);
                self.run_actions(to);
            }
            Learn::Verdict if to == about => {
                let n = &mut self.nodes[to];
                if n.declared && !n.fenced && n.svm.incarnation() == inc {
                    // It kills its ranks at once; its daemon rejoins soon.
                    self.c.self_fences += 1;
                    n.fenced = true;
                    self.log(format!("n{to} FENCES itself: its clients stop, it will rejoin"));
                }
            }
            Learn::Verdict => {}
        }
    }

    /// The client process of a waiting fault dies: the shell cancels the fault.
    fn cancel(&mut self, k: usize) {
        let ClientState::Waiting(_, w) = self.clients[k].state else {
            return;
        };
        let i = self.clients[k].node;
        self.log(format!("client {k} on n{i} dies; waiter {w} cancelled"));
        self.c.cancels += 1;
        self.waiters.remove(&w);
        self.clients[k].state = ClientState::Idle;
        self.clients[k].mapped.clear();
        self.begin(i, Cause::Other);
        self.nodes[i].svm.cancel(w);
        self.run_actions(i);
    }

    /// The job ends: its processes exit (their faults are cancelled); the nodes drop its
    /// segments later, each at its own time.
    fn end_job(&mut self) {
        self.log(format!("JOB {} ENDS", self.job));
        self.c.job_ends += 1;
        for k in 0..self.clients.len() {
            self.cancel(k);
            self.clients[k].state = ClientState::Idle;
            self.clients[k].mapped.clear();
        }
        self.ending = true;
        for n in &mut self.nodes {
            n.dropped = false;
        }
    }

    /// Node `i` drops the ended job's segments: memory and coherence state.
    fn drop_job(&mut self, i: usize) {
        self.log(format!("n{i} drops job {}'s segments", self.job));
        let pages = self.pages.clone();
        let n = &mut self.nodes[i];
        for &p in &pages {
            n.mem.remove(&p);
            n.applied.remove(&p);
        }
        for p in pages.iter().take(self.files) {
            n.svm.forget_file(p.file);
        }
        n.segs = false;
        n.dropped = true;
    }

    fn start_job(&mut self) {
        self.job += 1;
        self.pages = self.job_pages();
        self.ending = false;
        self.log(format!("JOB {} STARTS: {:?}", self.job, self.pages));
    }

    /// The pages node `v` manages start again from disk, with an empty directory: no other
    /// node holds a segment (and `v` itself holds none of them: it restarted, and refused
    /// them since), so no memory holds them and no live process saw what was written to them
    /// since they were loaded. (Pages managed elsewhere keep their directories: lost stays
    /// lost.)
    /// With `keep_served`, files it serves already after asking keep their directories (they
    /// are true); a node that restarts keeps none.
    fn restart_from_disk(&mut self, v: usize, keep_served: bool) {
        for p in self.pages.clone() {
            let served = self.nodes[v].svm.recovering() && self.nodes[v].svm.serves(p.file);
            if self.manager(p) == v && !(keep_served && served) {
                // (A page stays tainted: a dead node's messages about it may still arrive.)
                self.truth.remove(&p);
            }
        }
    }

    /// A restarted node serves its pages again: no other node holds a segment.
    fn end_recovery(&mut self, r: usize) {
        self.log(format!("n{r} ends recovery"));
        self.c.end_recoveries += 1;
        self.restart_from_disk(r, true);
        self.begin(r, Cause::Other);
        self.nodes[r].svm.end_recovery();
        self.run_actions(r);
    }

    fn recovery_ends(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&r| {
                !self.nodes[r].declared
                    && !self.nodes[r].paused()
                    && self.nodes[r].svm.recovering()
                    && (0..self.nodes.len()).all(|j| j == r || !self.nodes[j].segs)
            })
            .collect()
    }

    fn check(&self) {
        let n = self.nodes.len();
        // The shell's access is the state machine's; clients map within it.
        for (i, node) in self.nodes.iter().enumerate() {
            let mut pages: Vec<PageId> = node.applied.keys().copied().collect();
            pages.extend(node.svm.held().map(|(p, _)| p));
            for p in pages {
                let (applied, books) = (node.applied.get(&p).copied(), node.svm.access(p));
                if applied != books {
                    self.fail(format!(
                        "n{i} page {p}: the shell applied {applied:?}, the protocol says {books:?}"
                    ));
                }
            }
            for (k, c) in self.clients.iter().enumerate().filter(|(_, c)| c.node == i) {
                for (p, &m) in &c.mapped {
                    if Some(m) > node.applied.get(p).copied() || !node.mem.contains_key(p) {
                        self.fail(format!(
                            "client {k} on n{i} maps {p} {m:?}; the node applied {:?}, memory has it: {}",
                            node.applied.get(p),
                            node.mem.contains_key(p)
                        ));
                    }
                }
            }
        }
        if self.ending {
            // No process maps the ended job's pages; their directories go before their
            // copies. The next job uses other files.
            return;
        }
        for &page in &self.pages {
            let want = self.truth.get(&page).copied().unwrap_or(0);
            let mut writers = 0;
            let mut holders = 0;
            for (i, node) in self.nodes.iter().enumerate().filter(|(_, x)| !x.declared) {
                let Some(&a) = node.applied.get(&page) else { continue };
                holders += 1;
                writers += (a == Access::Write) as usize;
                let have = node.mem.get(&page).copied();
                if have != Some(want) {
                    self.fail(format!(
                        "n{i} holds {page} ({a:?}) with {have:?}, latest write is {want}"
                    ));
                }
            }
            if writers > 1 || (writers == 1 && holders > 1) {
                let who: BTreeMap<usize, Option<Access>> =
                    (0..n).map(|i| (i, self.nodes[i].applied.get(&page).copied())).collect();
                self.fail(format!(
                    "page {page}: {writers} writers among {holders} holders: {who:?}"
                ));
            }
            let m = self.manager(page);
            let mgr = &self.nodes[m];
            let (owner, copyset, writable, lost) = mgr.svm.directory(page).unwrap_or_default();
            if lost && !self.tainted.contains(&page) {
                self.fail(format!(
                    "n{m} marks {page} lost, but no node that died may have taken its latest version"
                ));
            }
            if mgr.declared || !mgr.svm.serves(page.file) {
                continue;
            }
            // The directory covers every holder.
            let prog = mgr.svm.in_progress(page);
            for (h, node) in self.nodes.iter().enumerate().filter(|(_, x)| !x.declared) {
                let Some(&a) = node.applied.get(&page) else { continue };
                let inc = node.svm.incarnation();
                let in_txn = prog
                    .busy
                    .iter()
                    .any(|(t, _)| t.node.0 as usize == h && t.incarnation == inc);
                let leaving = lost
                    && self.net.iter().any(|(to, e, _)| {
                        *to == h
                            && e.to_incarnation == inc
                            && e.msg.page() == page
                            && matches!(
                                e.msg,
                                Msg::Inval { .. }
                                    | Msg::Fwd {
                                        access: Access::Write,
                                        ..
                                    }
                            )
                    });
                let me = NodeId(h as u32);
                let recorded = match a {
                    Access::Read => copyset.contains(&me),
                    Access::Write => owner == Some(me) && writable && copyset == [me],
                };
                // A read forwarded to the owner is over at the manager (the reader is in the
                // copyset, the owner no longer writable) while the forward, which downgrades
                // the owner before the data goes out, is on the way to it.
                let downgrading = a == Access::Write
                    && owner == Some(me)
                    && copyset.contains(&me)
                    && self.net.iter().any(|(to, e, _)| {
                        *to == h
                            && e.to_incarnation == inc
                            && e.msg.page() == page
                            && matches!(
                                e.msg,
                                Msg::Fwd {
                                    access: Access::Read,
                                    ..
                                }
                            )
                    });
                if !(recorded || in_txn || leaving || downgrading) {
                    self.fail(format!(
                        "n{h} holds {page} ({a:?}) but the directory at n{m} says owner {owner:?} copyset \
                         {copyset:?} writable {writable} lost {lost}, in progress {prog:?}"
                    ));
                }
            }
            // Between transactions, a live owner holds the page. (A writer is recorded writable,
            // above; the converse need not hold: a forward for a reader that died meanwhile
            // may still downgrade the owner.)
            if let (Some(o), true, false) = (owner, prog == InProgress::default(), lost) {
                let on = &self.nodes[o.0 as usize];
                let current = mgr.svm.is_up(o) && mgr.svm.known_incarnation(o) == on.svm.incarnation();
                if current && !on.declared {
                    let held = on.applied.get(&page).copied();
                    if held.is_none() || !copyset.contains(&o) {
                        self.fail(format!(
                            "n{m} records {o} as {page}'s owner (writable {writable}, copyset {copyset:?}), which holds {held:?}"
                        ));
                    }
                }
            }
        }
    }

    fn step(&mut self, new_work: bool, failures: bool) -> bool {
        self.steps += 1;
        self.timers();
        let n = self.nodes.len();
        let deaths = self.deaths();
        let any_paused = self.nodes.iter().any(Node::paused);
        // Messages and news a paused node or a cut link holds wait.
        let holding = any_paused || !self.cuts.is_empty();
        let msgs: Option<Vec<usize>> = holding.then(|| {
            (0..self.net.len())
                .filter(|&m| self.deliverable(&self.net[m]))
                .collect()
        });
        let news: Option<Vec<usize>> = any_paused.then(|| {
            (0..self.news.len())
                .filter(|&k| !self.nodes[self.news[k].0].paused())
                .collect()
        });
        // Candidate moves, picked uniformly at random.
        let mut moves: Vec<u8> = Vec::new();
        if msgs.as_ref().map_or(!self.net.is_empty(), |m| !m.is_empty()) {
            moves.extend([0, 0, 0]);
        }
        let loading: Vec<usize> = (0..n)
            .filter(|&i| !self.nodes[i].loads.is_empty() && !self.nodes[i].paused())
            .collect();
        if !loading.is_empty() {
            moves.push(1);
        }
        if news.as_ref().map_or(!self.news.is_empty(), |k| !k.is_empty()) {
            moves.push(2);
        }
        let ready: Vec<usize> = (0..self.clients.len())
            .filter(|&k| matches!(self.clients[k].state, ClientState::Ready(_)) && self.may_work(k))
            .collect();
        if !ready.is_empty() {
            moves.extend([3, 3]);
        }
        let idle: Vec<usize> = (0..self.clients.len())
            .filter(|&k| self.clients[k].state == ClientState::Idle && self.may_work(k))
            .collect();
        if new_work && !idle.is_empty() {
            moves.extend([4, 4]);
        }
        if failures && deaths < MAX_DEATHS && self.rng.permille(self.crash_rate) {
            moves.push(5);
        }
        // Prefetches come from the shells of nodes awake and not fencing.
        let active: Vec<usize> = (0..n)
            .filter(|&i| !self.nodes[i].paused() && !self.nodes[i].fenced)
            .collect();
        if new_work && !self.ending && !active.is_empty() {
            moves.push(6);
        }
        let live: Vec<usize> = (0..n).filter(|&i| !self.nodes[i].declared).collect();
        if failures && deaths < MAX_DEATHS && live.len() >= 2 && self.rng.permille(self.break_rate) {
            moves.push(7);
        }
        let rejoining: Vec<usize> = (0..n)
            .filter(|&i| self.nodes[i].fenced && !self.nodes[i].paused())
            .collect();
        if !rejoining.is_empty() {
            moves.push(8);
        }
        let waiting: Vec<usize> = (0..self.clients.len())
            .filter(|&k| matches!(self.clients[k].state, ClientState::Waiting(..)) && self.may_work(k))
            .collect();
        if failures && !waiting.is_empty() && self.rng.permille(10) {
            moves.push(9);
        }
        // A job ends now and then, soon after its pages started failing (a failed fault ends
        // its process); not while a node is paused (its shell would cancel the faults).
        let failing = self.nodes.iter().any(|n| n.svm.recovering()) || !self.tainted.is_empty();
        if new_work && !self.ending && !any_paused && self.rng.permille(if failing { 30 } else { 3 }) {
            moves.push(10);
        }
        let left: Vec<usize> = (0..n)
            .filter(|&i| !self.nodes[i].dropped && !self.nodes[i].paused())
            .collect();
        if self.ending {
            if self.nodes.iter().all(|n| n.dropped) {
                moves.push(12);
            } else if !left.is_empty() {
                moves.push(11);
            }
        }
        let ends = self.recovery_ends();
        if !ends.is_empty() {
            moves.push(13);
        }
        // A restarted manager's question needs every other node's answer.
        if !self.fence_checks.is_empty() && !any_paused {
            moves.push(14);
        }
        let awake: Vec<usize> = (0..n).filter(|&i| !self.nodes[i].paused()).collect();
        if failures && awake.len() >= 2 && self.rng.permille(self.pause_rate) {
            moves.push(15);
        }
        if failures && self.cuts.len() < 2 && self.rng.permille(self.cut_rate) {
            moves.push(16);
        }
        // Time passes (pauses end, cuts heal) even when nothing else can happen.
        if holding {
            moves.push(17);
        }
        if moves.is_empty() {
            return false;
        }
        match moves[self.rng.below(moves.len())] {
            0 => {
                let m = match &msgs {
                    Some(d) => d[self.rng.below(d.len())],
                    None => self.rng.below(self.net.len()),
                };
                self.deliver(m);
            }
            1 => {
                let i = loading[self.rng.below(loading.len())];
                let l = self.rng.below(self.nodes[i].loads.len());
                self.finish_load(i, l);
            }
            2 => {
                let k = match &news {
                    Some(d) => d[self.rng.below(d.len())],
                    None => self.rng.below(self.news.len()),
                };
                self.deliver_news(k);
            }
            3 => {
                let k = ready[self.rng.below(ready.len())];
                self.client_try(k);
            }
            4 => {
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
                let a = self.rng.below(n);
                let b = self.rng.below(n);
                if a != b && self.rng.chance(25) {
                    self.crash(&[a, b]);
                } else {
                    self.crash(&[a]);
                }
            }
            6 => {
                // A prefetch (the daemon's, on a fault): access to a page nobody waits for.
                let i = active[self.rng.below(active.len())];
                let page = self.pages[self.rng.below(self.pages.len())];
                let access = if self.rng.chance(30) {
                    Access::Write
                } else {
                    Access::Read
                };
                self.log(format!("n{i} prefetches {page} {access:?}"));
                self.hold_segments(i);
                self.begin(i, Cause::Other);
                self.nodes[i].svm.prefetch(page, access);
                self.run_actions(i);
            }
            7 => {
                let a = live[self.rng.below(live.len())];
                let b = live[self.rng.below(live.len())];
                if a != b {
                    self.link_break(a, b);
                }
            }
            8 => {
                // A fenced node's daemon re-executes itself: a new incarnation, empty memory.
                let v = rejoining[self.rng.below(rejoining.len())];
                self.taint(&[v]);
                self.drop_messages(|rng, _, e| e.from.0 as usize == v && rng.chance(50));
                self.restart(v);
            }
            9 => {
                let k = waiting[self.rng.below(waiting.len())];
                self.cancel(k);
            }
            10 => self.end_job(),
            11 => {
                let i = left[self.rng.below(left.len())];
                self.drop_job(i);
            }
            12 => self.start_job(),
            13 => {
                let r = ends[self.rng.below(ends.len())];
                self.end_recovery(r);
            }
            14 => {
                let k = self.rng.below(self.fence_checks.len());
                self.answer_fence(k);
            }
            15 => {
                let v = awake[self.rng.below(awake.len())];
                self.pause(v);
            }
            16 => {
                let a = self.rng.below(n);
                let b = (a + 1 + self.rng.below(n - 1)) % n;
                self.cut(a, b);
            }
            _ => {}
        }
        // A declared node is dead to the protocol from its verdict on: whatever it takes up
        // meanwhile goes with it too.
        for z in 0..n {
            if self.nodes[z].declared {
                self.taint(&[z]);
            }
        }
        // So does a write its manager grants to an incarnation that died before the request
        // arrived (a manager declared down, or paused, learns of deaths late).
        for k in 0..self.pages.len() {
            let page = self.pages[k];
            let busy = self.nodes[self.manager(page)].svm.in_progress(page).busy;
            if busy
                .iter()
                .any(|&(t, a)| a == Access::Write && t.incarnation < self.nodes[t.node.0 as usize].svm.incarnation())
            {
                self.tainted.insert(page);
            }
        }
        self.check();
        true
    }
}

fn run_seed(seed: u64) -> Counts {
    let mut w = World::new(seed);
    let steps = 200 + w.rng.below(400);
    for _ in 0..steps {
        w.step(true, true);
    }
    // Drain: no new work; failures only at first; everything in flight must settle.
    let mut drained = false;
    for s in 0..200_000 {
        if !w.step(false, s < 50) {
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
    for (i, n) in w.nodes.iter().enumerate() {
        for &p in &w.pages {
            let prog = n.svm.in_progress(p);
            if prog != InProgress::default() {
                w.fail(format!("n{i} still has work in flight on {p} after draining: {prog:?}"));
            }
        }
    }
    if w.nodes.iter().any(|n| n.paused() || n.declared) || !w.cuts.is_empty() {
        w.fail("a node still paused or declared, or a link still cut, after draining".into());
    }
    let mut c = w.c;
    c.joined = w.nodes.iter().map(|n| n.svm.stats().joined_reads).sum();
    c.late = w.nodes.iter().map(|n| n.svm.stats().late_grants).sum();
    c.redundant = w.nodes.iter().map(|n| n.svm.stats().redundant_grants).sum();
    c.abandoned = w.nodes.iter().map(|n| n.svm.stats().abandoned_reads).sum();
    c.reforwarded = w.nodes.iter().map(|n| n.svm.stats().reforwarded_reads).sum();
    c
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
                .unwrap_or(10000),
        ),
    };
    let mut t = Counts::default();
    let mut crashed_seeds = 0;
    for seed in first..first + count {
        let c = run_seed(seed);
        crashed_seeds += (c.crashes > 0) as u64;
        t.add(&c);
    }
    eprintln!("{count} seeds, {crashed_seeds} with crashes: {t:?}");
    // The runs must do real work, and every path they are meant to test must run.
    if count >= 100 {
        // (Most seeds crash, and a manager that restarted while others held pages refuses its
        // pages until the job ends: many faults fail, every one of them explained.)
        assert!(
            t.done > count * 30,
            "only {} operations completed over {count} seeds",
            t.done
        );
        assert!(
            t.failed < t.done,
            "{} failed operations against {} done",
            t.failed,
            t.done
        );
        for (kind, n) in ["lost", "manager down", "load failed"]
            .iter()
            .zip(t.failed_by)
            .chain([(&"manager restarted", t.failed_by[4])])
        {
            assert!(n > 0, "no fault failed as {kind} over {count} seeds");
        }
        assert!(
            crashed_seeds > count * 7 / 10,
            "crashes on only {crashed_seeds} of {count} seeds"
        );
        assert!(t.crashes > 2 * count, "only {} crashes over {count} seeds", t.crashes);
        assert!(t.double_crashes > 0, "no two nodes crashed at once over {count} seeds");
        assert!(t.verdicts > count / 10, "only {} live nodes declared dead", t.verdicts);
        assert!(t.dropped_msgs > 0, "no message dropped over {count} seeds");
        assert!(t.cancels > 0, "no fault cancelled over {count} seeds");
        assert!(
            t.end_recoveries > 0,
            "no restarted node ended its recovery over {count} seeds"
        );
        assert!(
            t.fences_cleared > 0,
            "no restarted node served a file again after asking over {count} seeds"
        );
        assert!(t.interleaved > 0, "no client acted between two actions of its shell");
        // Concurrent reads of one page really happen (so their checks above ran).
        assert!(t.joined > count, "only {} joined reads over {count} seeds", t.joined);
        // Invalidations overtake forwarded reads' data (so the requesters' re-requests ran).
        assert!(t.abandoned > 0, "no read abandoned over {count} seeds");
        // Owners die between a forward and their data (so the manager's late grants ran).
        assert!(t.late > 0, "no late grant over {count} seeds");
        // ... also after their `Data` granted a write that still collected acks (so the
        // requester's handling of the redundant grant ran).
        assert!(t.redundant > 0, "no redundant late grant over {count} seeds");
        // Pauses and partitions, short and long, of every kind of node, and what follows.
        for (what, n) in [
            ("short pause", t.pauses_short),
            ("long pause", t.pauses_long),
            ("pause of a manager", t.paused_managers),
            ("pause of an owner", t.paused_owners),
            ("pause in a transaction", t.paused_in_txn),
            ("pause while loading", t.paused_loading),
            ("one-way cut", t.cuts_one_way),
            ("two-way cut", t.cuts_two_way),
            ("long cut", t.cuts_long),
            ("verdict on a paused node", t.verdicts_paused),
            ("verdict after a one-way cut", t.verdicts_cut_one_way),
            ("verdict after a two-way cut", t.verdicts_cut_two_way),
            ("message dropped from a fenced incarnation", t.dropped_fenced),
            ("message sent by a declared node before it knew", t.declared_sends),
            (
                "message sent by a declared node woken from its pause",
                t.woken_declared_sends,
            ),
            ("client operation on a declared node before it knew", t.declared_ops),
            ("node fencing itself", t.self_fences),
            ("message lost on a broken link", t.lost_on_broken),
        ] {
            assert!(n > 0, "no {what} over {count} seeds");
        }
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
    drive_fifo_holding(nodes, mem, &|_, _| false, &mut Vec::new())
}

/// [`drive_fifo`], holding back the messages `hold(sender, message)` picks: they go to `held`
/// as (sender, destination, message), undelivered.
fn drive_fifo_holding(
    nodes: &mut [Svm],
    mem: &mut [Option<u64>],
    hold: &dyn Fn(usize, &Envelope) -> bool,
    held: &mut Vec<(usize, usize, Envelope)>,
) -> Driven {
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
            Action::Send { to, env } if hold(i, &env) => held.push((i, to.0 as usize, env)),
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
            Action::CheckFence { file } => panic!("no node restarted, yet one checks {file}"),
        }
    }
    panic!("actions did not settle");
}

/// `n` fresh nodes (every one at incarnation 1, knowing the others), a page of file 7, and
/// that page's manager.
fn fresh_nodes(n: usize) -> (Vec<Svm>, PageId, usize) {
    let peers = vec![Some(Incarnation(1)); n];
    let nodes: Vec<Svm> = (0..n)
        .map(|i| Svm::new(NodeId(i as u32), Incarnation(1), peers.clone()))
        .collect();
    let page = PageId {
        file: FileId(7),
        index: 0,
    };
    let m = nodes[0].manager(page).0 as usize;
    (nodes, page, m)
}

/// Three fresh nodes ([`fresh_nodes`]) where the node after the manager (the owner) wrote the
/// page and holds it writable; the next one (the reader) holds nothing. Returns the nodes, the
/// page, the manager, the owner, the reader, and the nodes' copies of the page.
#[allow(clippy::type_complexity)]
fn owner_wrote() -> (Vec<Svm>, PageId, usize, usize, usize, Vec<Option<u64>>) {
    let n = 3;
    let (mut nodes, page, m) = fresh_nodes(n);
    let (owner, reader) = ((m + 1) % n, (m + 2) % n);
    let mut mem = vec![None; n];
    nodes[owner].fault(page, Access::Write, 0);
    drive_fifo(&mut nodes, &mut mem);
    (nodes, page, m, owner, reader, mem)
}

/// The messages node `i`'s pending actions send, as (destination, message); its other actions
/// are dropped.
fn sends(nodes: &mut [Svm], i: usize) -> Vec<(usize, Envelope)> {
    std::iter::from_fn(|| nodes[i].poll_action())
        .filter_map(|a| match a {
            Action::Send { to, env } => Some((to.0 as usize, env)),
            _ => None,
        })
        .collect()
}

/// A write that must invalidate copies is granted by the owner's `Data`, which carries the
/// acknowledgements to collect: the writer waits for the data and one ack per other copy, and
/// no `Grant`. Exact messages.
#[test]
fn an_invalidating_write_is_granted_by_the_owners_data() {
    let n = 4;
    let (mut nodes, page, m) = fresh_nodes(n);
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

/// A read the owner serves is over at the manager once forwarded: request, forward, data —
/// no `Done`. The manager counts the reader in the copyset at once, so the next write
/// invalidates it. Exact messages.
#[test]
fn a_read_served_by_the_owner_takes_three_messages() {
    let (mut nodes, page, m, owner, reader, mut mem) = owner_wrote();
    mem[owner] = Some(1);
    nodes[reader].fault(page, Access::Read, 0);
    let (sent, resolved) = drive_fifo(&mut nodes, &mut mem);
    assert_eq!(
        sent,
        vec![(reader, m, "Req"), (m, owner, "Fwd"), (owner, reader, "Data")]
    );
    assert_eq!(resolved, vec![(reader, 0)]);
    assert_eq!(mem[reader], Some(1));
    assert!(nodes[m].is_quiet(), "the manager waits for nothing");
    let (o, copyset, writable, _) = nodes[m].directory(page).expect("a directory entry");
    assert_eq!(o, Some(NodeId(owner as u32)));
    assert_eq!(copyset.len(), 2);
    assert!(!writable);
    assert_eq!(nodes[owner].access(page), Some(Access::Read));
    // The owner writes again: the reader's copy goes.
    nodes[owner].fault(page, Access::Write, 1);
    drive_fifo(&mut nodes, &mut mem);
    assert_eq!(nodes[reader].access(page), None);
    assert_eq!(nodes[owner].access(page), Some(Access::Write));
}

/// An invalidation that overtakes the data of a forwarded read: the reader acks, drops the
/// read, and asks again; the data that arrives later is ignored, and the read returns the
/// value written after it.
#[test]
fn a_read_overtaken_by_an_invalidation_asks_again() {
    let (mut nodes, page, m, owner, reader, mut mem) = owner_wrote();
    mem[owner] = Some(1);
    // The reader's request reaches the manager, which forwards it to the owner.
    nodes[reader].fault(page, Access::Read, 7);
    let reqs = sends(&mut nodes, reader);
    assert_eq!(reqs.len(), 1);
    let _ = nodes[m].receive(reqs[0].1.clone()).expect("request");
    let fwds = sends(&mut nodes, m);
    assert!(matches!(fwds[..], [(o, Envelope { msg: Msg::Fwd { .. }, .. })] if o == owner));
    // The owner serves it: the data is on the way (held back).
    let _ = nodes[owner].receive(fwds[0].1.clone()).expect("forward");
    let late_data = sends(&mut nodes, owner);
    assert!(matches!(late_data[..], [(r, Envelope { msg: Msg::Data { .. }, .. })] if r == reader));
    // The owner writes 2: the manager invalidates the reader, whose ack lets the write go on.
    // The reader asks again at once (its request held back here until the write is done).
    let again = |from: usize, e: &Envelope| from == reader && matches!(e.msg, Msg::Req { .. });
    let mut held = Vec::new();
    nodes[owner].fault(page, Access::Write, 1);
    drive_fifo_holding(&mut nodes, &mut mem, &again, &mut held);
    mem[owner] = Some(2);
    assert_eq!(nodes[owner].access(page), Some(Access::Write));
    assert_eq!(nodes[reader].stats().abandoned_reads, 1);
    assert_eq!(held.len(), 1, "the reader's new request");
    // The old data arrives: ignored. The reader's new request is served with the new value.
    let r = nodes[reader].receive(late_data[0].1.clone()).expect("late data");
    assert_eq!(r, Receipt::Dropped);
    let _ = nodes[m].receive(held.remove(0).2).expect("request");
    let (_, resolved) = drive_fifo(&mut nodes, &mut mem);
    assert_eq!(resolved, vec![(reader, 7)]);
    assert_eq!(mem[reader], Some(2), "the read returns the latest write");
    assert_eq!(nodes[reader].access(page), Some(Access::Read));
}

/// A `Data` for a page its receiver already holds is a protocol violation, refused without
/// changing anything: the transaction stays as it was (no grant recorded from the refused
/// message), and the real grant still completes it.
#[test]
fn a_refused_data_changes_nothing() {
    let (mut nodes, page, m, owner, reader, mut mem) = owner_wrote();
    nodes[reader].fault(page, Access::Read, 0);
    drive_fifo(&mut nodes, &mut mem);
    assert_eq!(nodes[reader].access(page), Some(Access::Read));
    // The reader upgrades: its request is on the way to the manager.
    nodes[reader].fault(page, Access::Write, 1);
    let req = std::iter::from_fn(|| nodes[reader].poll_action())
        .find_map(|a| match a {
            Action::Send { to, env } if to.0 as usize == m => Some(env),
            _ => None,
        })
        .expect("the upgrade's request");
    let Msg::Req { txn, .. } = req.msg else {
        panic!("not a request: {:?}", req.msg)
    };
    let before = nodes[reader].in_progress(page);
    // A confused owner sends data (granting) for a page the reader holds.
    let bad = Envelope {
        from: NodeId(owner as u32),
        from_incarnation: Incarnation(1),
        to_incarnation: Incarnation(1),
        msg: Msg::Data {
            page,
            txn,
            grant: Some(Vec::new()),
        },
    };
    assert!(nodes[reader].receive(bad).is_err(), "data for a held page is refused");
    assert_eq!(
        nodes[reader].in_progress(page),
        before,
        "the refused data changed the transaction"
    );
    assert!(
        nodes[reader].poll_action().is_none(),
        "the refused data produced an action"
    );
    // The real request goes on and completes the upgrade.
    let _ = nodes[m].receive(req);
    drive_fifo(&mut nodes, &mut mem);
    assert_eq!(nodes[reader].access(page), Some(Access::Write));
    assert_eq!(nodes[owner].access(page), None);
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

/// A manager that restarted while another node held pages asks before it serves a file: the
/// file that node held when it learnt of the restart stays refused (its pages' directory died),
/// while a file first used after the restart is served at once, with exact answers.
#[test]
fn a_restarted_manager_serves_a_file_nobody_held_and_refuses_one_held_before() {
    let peers = vec![Some(Incarnation(1)); 2];
    let mut n1 = Svm::new(NodeId(1), Incarnation(1), peers);
    let pages = |file| {
        (0..64).map(move |index| PageId {
            file: FileId(file),
            index,
        })
    };
    let old = pages(1)
        .find(|&p| n1.manager(p) == NodeId(0))
        .expect("a page managed by n0");
    let new = pages(2)
        .find(|&p| n1.manager(p) == NodeId(0))
        .expect("a page managed by n0");
    // n1 reads a page of file 1 that n0 manages (n0's grant comes from its first incarnation).
    n1.fault(old, Access::Read, 1);
    let mut txn = None;
    while let Some(a) = n1.poll_action() {
        if let Action::Send { env, .. } = a {
            if let Msg::Req { txn: t, .. } = env.msg {
                txn = Some(t);
            }
        }
    }
    let txn = txn.expect("a request");
    let grant = Envelope {
        from: NodeId(0),
        from_incarnation: Incarnation(1),
        to_incarnation: Incarnation(1),
        msg: Msg::Grant {
            page: old,
            txn,
            access: Access::Read,
            source: psls_svm::coherence::Source::Disk,
            acks: vec![],
        },
    };
    n1.receive(grant).expect("grant");
    while let Some(a) = n1.poll_action() {
        if let Action::Load { page, txn } = a {
            n1.loaded(page, txn, true);
        }
    }
    assert_eq!(n1.access(old), Some(Access::Read));
    // Not learnt of the restart yet: unsure about file 1, which it holds; clean about file 2.
    let (m, inc) = (NodeId(0), Incarnation(2));
    let (before, since) = (Some(Incarnation(1)), Some(inc));
    assert_eq!(n1.fence_answer(m, inc, old.file, None), FenceAnswer::Unknown);
    assert_eq!(n1.fence_answer(m, inc, new.file, None), FenceAnswer::Clean);
    assert_eq!(
        n1.fence_answer(m, inc, new.file, before),
        FenceAnswer::Unknown,
        "a segment counts"
    );
    n1.peer_up(m, inc);
    assert_eq!(n1.fence_answer(m, inc, old.file, None), FenceAnswer::Held);
    assert_eq!(
        n1.fence_answer(m, inc, new.file, since),
        FenceAnswer::Clean,
        "opened since"
    );
    assert_eq!(
        n1.fence_answer(m, inc, new.file, before),
        FenceAnswer::Held,
        "a segment opened before: its processes may have seen what died"
    );
    assert_eq!(
        n1.fence_answer(m, Incarnation(1), new.file, None),
        FenceAnswer::Held,
        "a dead asker"
    );
    // The restarted n0 parks requests for both files, asks once per file, then grants file 2's
    // page and refuses file 1's.
    let mut n0 = Svm::restarted(NodeId(0), inc, vec![Some(inc), Some(Incarnation(1))]);
    assert_eq!(n0.fence_askees(), vec![NodeId(1)]);
    // Asked too: a node the restarted one has not heard of yet.
    let deaf = Svm::restarted(NodeId(0), inc, vec![Some(inc), None]);
    assert_eq!(deaf.fence_askees(), vec![NodeId(1)]);
    let req = |page, seq| Envelope {
        from: NodeId(1),
        from_incarnation: Incarnation(1),
        to_incarnation: inc,
        msg: Msg::Req {
            page,
            txn: TxnId {
                node: NodeId(1),
                incarnation: Incarnation(1),
                seq,
            },
            access: Access::Write,
            have: false,
        },
    };
    n0.receive(req(old, 10)).expect("req");
    n0.receive(req(new, 11)).expect("req");
    let mut checks = Vec::new();
    while let Some(a) = n0.poll_action() {
        match a {
            Action::CheckFence { file } => checks.push(file),
            other => panic!("nothing but checks while parked: {other:?}"),
        }
    }
    assert_eq!(checks, vec![old.file, new.file]);
    for file in checks {
        let answer = n1.fence_answer(NodeId(0), inc, file, (file == new.file).then_some(inc));
        n0.fence_checked(file, answer == FenceAnswer::Clean);
    }
    let mut replies = Vec::new();
    while let Some(a) = n0.poll_action() {
        if let Action::Send { env, .. } = a {
            replies.push(env.msg);
        }
    }
    assert!(matches!(
        replies[0],
        Msg::Deny { page, error: FaultError::ManagerRestarted, .. } if page == old
    ));
    assert!(matches!(replies[1], Msg::Grant { page, access: Access::Write, .. } if page == new));
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert!(n0.serves(new.file) && !n0.serves(old.file));
}

/// Runs every action of `nodes` to completion in FIFO order, answering a restarted manager's
/// fence checks from the other nodes' books; returns the loads and the failed faults.
fn drive_all(nodes: &mut [Svm]) -> (usize, Vec<FaultError>) {
    let (mut loads, mut fails) = (0, Vec::new());
    for _ in 0..1000 {
        let mut any = false;
        for i in 0..nodes.len() {
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
                    Action::Fail { error, .. } => fails.push(error),
                    Action::CheckFence { file } => {
                        let (me, inc) = (nodes[i].me(), nodes[i].incarnation());
                        let clean = nodes[i]
                            .fence_askees()
                            .into_iter()
                            .all(|n| nodes[n.0 as usize].fence_answer(me, inc, file, None) == FenceAnswer::Clean);
                        nodes[i].fence_checked(file, clean);
                    }
                    _ => {}
                }
            }
        }
        if !any {
            return (loads, fails);
        }
    }
    panic!("did not settle");
}

/// A settled file (no job writes it: its memory copies equal the disks') loses nothing when a
/// node restarts. A written page whose owner restarted is reloaded, not lost, and so is one
/// lost while a job still wrote it once the file settles. The holders of pages a restarted
/// manager managed drop them when they learn of the restart, so that manager serves the file
/// at once; a file a job writes stays refused until it settles (its copies go then).
#[test]
fn a_settled_file_is_served_after_any_restart() {
    let one = Incarnation(1);
    let mut nodes: Vec<Svm> = (0..3).map(|i| Svm::new(NodeId(i), one, vec![Some(one); 3])).collect();
    let managed_by_n0 = |file: u64| {
        (0..64)
            .map(move |index| PageId {
                file: FileId(file),
                index,
            })
            .find(|p| psls_svm::coherence::manager_node(p.file, p.index, 3) == NodeId(0))
            .expect("a page managed by n0")
    };
    // The owner restarts. n1 writes page p of file 1 (managed by n0); while a job writes the
    // file, its only current copy dies with n1 and the page is lost; once the file settles, the
    // disks hold its latest version and it is loaded again.
    let p = managed_by_n0(1);
    nodes[1].fault(p, Access::Write, 1);
    assert_eq!(drive_all(&mut nodes), (1, vec![]));
    nodes[0].peer_up(NodeId(1), Incarnation(2));
    nodes[2].peer_up(NodeId(1), Incarnation(2));
    nodes[1] = Svm::new(
        NodeId(1),
        Incarnation(2),
        vec![Some(one), Some(Incarnation(2)), Some(one)],
    );
    nodes[2].fault(p, Access::Read, 2);
    assert_eq!(drive_all(&mut nodes), (0, vec![FaultError::PageLost]));
    nodes[0].set_settled(p.file, true);
    nodes[2].fault(p, Access::Read, 3);
    assert_eq!(drive_all(&mut nodes), (1, vec![]), "loaded from the disks");
    // Written again, then settled before its owner restarts: never lost.
    for n in nodes.iter_mut() {
        n.set_settled(p.file, false);
    }
    nodes[1].fault(p, Access::Write, 4);
    assert_eq!(drive_all(&mut nodes), (0, vec![]), "n2's copy is current");
    for n in nodes.iter_mut() {
        n.set_settled(p.file, true);
    }
    nodes[0].peer_up(NodeId(1), Incarnation(3));
    nodes[2].peer_up(NodeId(1), Incarnation(3));
    nodes[1] = Svm::new(
        NodeId(1),
        Incarnation(3),
        vec![Some(one), Some(Incarnation(3)), Some(one)],
    );
    nodes[2].fault(p, Access::Read, 5);
    assert_eq!(drive_all(&mut nodes), (1, vec![]));
    assert_eq!(nodes[2].access(p), Some(Access::Read));

    // The manager restarts. n1 and n2 read page q of settled file 2, n2 also page r of file 3,
    // which a job writes; both managed by n0.
    let (q, r) = (managed_by_n0(2), managed_by_n0(3));
    for n in nodes.iter_mut() {
        n.set_settled(q.file, true);
    }
    nodes[1].fault(q, Access::Read, 6);
    nodes[2].fault(q, Access::Read, 7);
    nodes[2].fault(r, Access::Read, 8);
    assert_eq!(drive_all(&mut nodes).1, vec![]);
    let two = Incarnation(2);
    nodes[0] = Svm::restarted(NodeId(0), two, vec![Some(two), Some(Incarnation(3)), Some(one)]);
    for n in nodes[1..].iter_mut() {
        n.peer_up(NodeId(0), two);
    }
    // The settled files' copies went (zapped in the clients), the written file's stayed.
    let zapped: Vec<Action> = std::iter::from_fn(|| nodes[2].poll_action()).collect();
    assert_eq!(
        zapped,
        vec![
            Action::SetAccess { page: p, access: None },
            Action::SetAccess { page: q, access: None }
        ]
    );
    assert_eq!((nodes[1].access(q), nodes[2].access(q)), (None, None));
    assert_eq!(nodes[2].access(r), Some(Access::Read));
    while nodes[1].poll_action().is_some() {}
    assert_eq!(nodes[2].fence_answer(NodeId(0), two, q.file, None), FenceAnswer::Clean);
    assert_eq!(nodes[2].fence_answer(NodeId(0), two, r.file, None), FenceAnswer::Held);
    // The restarted manager serves the settled file at once (from the disks), and refuses the
    // written one until it settles.
    nodes[1].fault(q, Access::Write, 9);
    nodes[1].fault(r, Access::Read, 10);
    assert_eq!(drive_all(&mut nodes), (1, vec![FaultError::ManagerRestarted]));
    assert_eq!(nodes[1].access(q), Some(Access::Write));
    nodes[2].set_settled(r.file, true);
    assert_eq!(
        std::iter::from_fn(|| nodes[2].poll_action()).collect::<Vec<_>>(),
        vec![Action::SetAccess { page: r, access: None }]
    );
    assert_eq!(nodes[2].fence_answer(NodeId(0), two, r.file, None), FenceAnswer::Clean);
    nodes[1].fault(r, Access::Read, 11);
    assert_eq!(drive_all(&mut nodes), (1, vec![]));
    assert_eq!(nodes[1].access(r), Some(Access::Read));
}
