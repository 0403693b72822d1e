//! Seeded simulator of memory and persistent checkpoints and rollback: 3–5 nodes, one job
//! writing two files through the nodes' memories, the real coordinator and participant state
//! machines, the real recovery-copy tables (`FrameTable`, with a capacity that a round may
//! exceed) and the real memory level of a rollback (`rollback_target`), the real metadata
//! operations (`MetaState::apply`: begin, commit record, fence, down verdict), every node's
//! real verdict book (`psls_cluster::verdicts::Verdicts`: what it drops, when it fences
//! itself, whom the coordinator declares down), and disks with two slots per page copy that
//! lose or tear unsynced writes in a crash. Rounds are memory or persistent at random; a
//! persistent one flushes the recovery copies newer than the disks.
//!
//! Failures: messages are delayed and reordered; nodes crash at any step (the coordinator
//! mid-round, a participant mid-write or mid-sync, two at once, every node in a power cut) and
//! come back; nodes *pause* (SIGSTOP, a VM stall — the coordinator, a node with a write in
//! progress, or any) for less or more than the failure timeout, and wake with all their
//! state: what was sent to them meanwhile arrives then, and they act on what they knew (send
//! their round's messages, write pages, apply old decisions) until they learn their verdict;
//! links are *cut* one way or both (one link, or a node cut off from every other, the
//! coordinator half the time) for less or more than the timeout, a cut dropping what was
//! queued on the link and everything sent on it; and the detector now and then suspects a
//! node that runs.
//!
//! The cluster as the daemon runs it, in the small: the coordinator is the metadata's leader,
//! one per term. When a majority has not heard it for the failure timeout, they elect the
//! lowest of them, which declares the old one down at once; a deposed coordinator's later
//! metadata operations are refused, those it submitted before are applied in order, or lost.
//! The metadata applies operations only while its leader is awake and joined both ways to a
//! majority. The coordinator declares down (a committed `DeclareDown`) every node it has not
//! heard for the timeout. A node learns who coordinates and every committed verdict when it
//! hears the coordinator, its own verdict from any peer's heartbeat too; it then fences itself
//! (a new incarnation with an empty memory; its disk stays). Every checkpoint message and page
//! write carries its sender's incarnation and is dropped by a receiver that knows a verdict on
//! it. Events for a paused node (a failure its coordinator hears of, the job's stop, answers to
//! its metadata operations) wait until it wakes. The coordinator starts a round only when every
//! rank is at the safe point (no node paused) and every node is live for it (heard within the
//! timeout, no verdict on it known: the daemon's `check_all_serving`).
//!
//! The job's life is the real job-control machine's (`psls_jobs::control::Control`, one on
//! every node, as `psls-node`'s `jobctl` runs it): the coordinator drives, with the time and the
//! nodes as its heartbeats show them and the committed metadata; its records go through the
//! metadata like every other operation. Its client launches the job (again until answered). A
//! node starts its ranks when job control asks and its records place them there
//! (`psls_jobs::local::ranks_here`). A crash, or a verdict on a node running the job, loses that
//! node's memory; job control sees the node declared down or back as a new incarnation and
//! rolls the job back: it records the rollback, stops the ranks (a node that does not answer
//! is asked again; the order waits in a paused node's socket), waits for every node, asks for
//! the restore, then records the next start and starts its ranks. The restore is the real
//! restore machine (`psls_ckpt::restore::Restore`, the one `recovery::restore` carries out),
//! one step a call to one node: every node's memory state, the fence of every epoch begun or
//! seen (waiting while a round of its own decides), the states again, the settle, the
//! re-creation of lost copies and their adoption, the drop of the job's pages, and their
//! serving again. A call to a node that is not up, awake, undeclared, stopped, joined both ways
//! to the coordinator and knowing it coordinates fails, and so does the restore; a restore
//! stops at its next call once its driver's term is over or the job's records moved on (the
//! daemon's `JobCtl::drives_in`); job control does the pass again. Once it is over, the job
//! returns to the newest memory checkpoint a node committed if it is newer than the committed
//! persistent one and no page lost both recovery copies, else to the persistent one. The ranks
//! go on only from a restore no failure overtook (a node it asked that crashed, restarted or
//! was declared down before it ended): job control must see that too, or the job never
//! resumes, which the calm phase fails.
//!
//! Checked after every step (the checks (a) to (c) at every message, page write, metadata
//! operation and decision they concern):
//! - the disks hold the last committed checkpoint: every page's committed generation is on
//!   each up node holding a copy, whole, with the bytes the job had in memory when that
//!   checkpoint's round began (the simulator keeps every checkpoint's image);
//! - pages are written to the disks only by a persistent round (its participants' writes and
//!   flushes, at a generation the metadata began);
//! - after a memory checkpoint commits, every page it holds that differs from the disks has a
//!   recovery copy with its checkpointed bytes on both of its holders (committed, or
//!   pre-recovery of that epoch where the decision has not arrived): no node dropped the
//!   previous checkpoint's copies before the new one committed;
//! - after every rollback, each page as the job now sees it equals its contents at the
//!   restored checkpoint, bit for bit, and no checkpoint begun before it ever commits;
//! - (a) no node takes a checkpoint message, a page write or a sync from an incarnation it
//!   learnt was declared down: checked where it is taken, against a table of the verdicts
//!   each incarnation learnt that the dropping code does not read;
//! - (b) once a rollback's fence at epoch F is applied, no round of an epoch up to F commits:
//!   no commit record of one is applied, no coordinator that still believes it coordinates
//!   finishes one as committed, no participant takes the commit of a memory one;
//! - (c) one coordinator per term and per round: every metadata operation applied was
//!   submitted by the leader of its term, as that incarnation; the metadata begins one round
//!   of an epoch at most; at most one round of an epoch finishes committed in a run of the job
//!   (between two rollbacks); a participant acts only on round messages from the node it
//!   believes coordinates.
//!
//! Each seed ends with a calm phase: every node up and awake, every link whole, every verdict
//! known, a write, a round that must commit. `PSLS_SIM_SEED=N` runs one seed,
//! `PSLS_SIM_SEEDS=N` seeds 0..N, `PSLS_SIM_TRACE=1` prints every step.

mod common;

use psls_ckpt::cleaning::Policy;
use psls_ckpt::frames::{site_of, DiskWrite, FrameError, FrameTable, Site};
use psls_ckpt::level::{JobChoice, Levels};
use psls_ckpt::msg::{Choice, Level};
use psls_ckpt::restore::{NodeState, Restore, RestoreAction};
use psls_ckpt::{CoordAction, Coordinator, Msg, Outcome, PartAction, Participant};
use psls_cluster::verdicts::Verdicts;
use psls_jobs::control::{self, Action, Command, Control, Done, NodeView, Report, StepError};
use psls_pfs::jobs::{FileRuns, JobSummary};
use psls_pfs::meta::{FileMeta, MetaOp, MetaState};
use psls_pfs::runs::RunPhase;
use psls_pfs::{Placement, Role};
use psls_svm::rng::SplitMix64;
use psls_svm::{FileId, NodeId};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

const JOB: &str = "j";
const STEPS: usize = 600;
const TIMEOUT_MS: u64 = 5_000;
/// The nodes' physical names: verdicts name nodes by them.
const NAMES: [&str; 5] = ["n0", "n1", "n2", "n3", "n4"];

type Page = (FileId, u64);
/// The bytes of every page, as a value per page (0: zeros).
type Image = BTreeMap<Page, u64>;
/// A round: its epoch, its coordinator's node and incarnation.
type Round = (u64, usize, u64);

fn node_index(name: &str) -> usize {
    NAMES.iter().position(|n| *n == name).expect("a simulated node")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Content {
    Ok { gen: u64, val: u64 },
    Torn,
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    /// What a read finds now.
    now: Option<Content>,
    /// What survives a crash.
    durable: Option<Content>,
}

#[derive(Default, Debug)]
struct Disk {
    slots: BTreeMap<(Page, Role), [Slot; 2]>,
    writes: u64,
}

impl Disk {
    fn gen(c: Option<Content>) -> Option<u64> {
        match c {
            Some(Content::Ok { gen, .. }) => Some(gen),
            _ => None,
        }
    }
    /// The page store's rule: the slot holding `gen`, else the one not holding `keep`, else an
    /// empty one, else the lower; never over a newer generation.
    fn write(&mut self, key: (Page, Role), gen: u64, keep: u64, val: u64) -> Result<(), String> {
        let s = self.slots.entry(key).or_default();
        let g = [Disk::gen(s[0].now), Disk::gen(s[1].now)];
        let t = if let Some(t) = (0..2).find(|&t| g[t] == Some(gen)) {
            t
        } else if let Some(t) = (0..2).find(|&t| g[t] == Some(keep)) {
            1 - t
        } else if let Some(t) = (0..2).find(|&t| s[t].now.is_none()) {
            t
        } else if g[0] <= g[1] {
            0
        } else {
            1
        };
        if g[t].is_some_and(|x| x > gen) {
            return Err(format!("newer generation {:?} in the slot", g[t]));
        }
        s[t].now = Some(Content::Ok { gen, val });
        self.writes += 1;
        Ok(())
    }
    fn sync(&mut self) {
        for s in self.slots.values_mut().flat_map(|p| p.iter_mut()) {
            s.durable = s.now;
        }
    }
    /// Unsynced slots keep their old contents, the new, or tear.
    fn crash(&mut self, rng: &mut SplitMix64) {
        for s in self.slots.values_mut().flat_map(|p| p.iter_mut()) {
            if s.now != s.durable {
                s.now = match rng.below(3) {
                    0 => s.durable,
                    1 => s.now,
                    _ => Some(Content::Torn),
                };
                s.durable = s.now;
            }
        }
    }
    fn read(&self, key: (Page, Role), gen: u64) -> Option<u64> {
        let s = self.slots.get(&key)?;
        s.iter().find_map(|x| match x.now {
            Some(Content::Ok { gen: g, val }) if g == gen => Some(val),
            _ => None,
        })
    }
}

#[derive(Debug)]
enum Stage {
    /// Taken; not written yet.
    Taken,
    /// Written to these nodes (incarnations); not synced.
    Written(BTreeMap<NodeId, u64>),
}

#[derive(Debug)]
struct WriteJob {
    epoch: u64,
    level: Level,
    /// The job's last committed epoch, as the round's `Prepare` said.
    committed: u64,
    gen: u64,
    pages: Vec<(Page, u64)>,
    stage: Stage,
}

/// What reaches a node apart from checkpoint messages: carried out at once if it is awake
/// (and nothing is waiting before it), else once it wakes, in order.
#[derive(Debug)]
enum Local {
    /// Its coordinator hears that a node failed.
    NodeDown(NodeId),
    /// Job control stops the job's ranks of this start or before here (a rollback): it
    /// needs a link from the coordinator.
    Stop(u32),
    /// Answers to its metadata operations.
    Begun(u64, Result<(u64, u64, u64), String>),
    Committed(u64, Result<(), String>),
    Fenced(u64, Result<bool, String>),
}

struct Node {
    up: bool,
    inc: u64,
    /// Stopped with all its state (SIGSTOP, a VM stall) until then: it takes no message, does
    /// not tick, writes and submits nothing.
    paused_until_ms: u64,
    /// The epoch of the round its coordinator was running when it last paused.
    paused_in_round: Option<u64>,
    /// Its verdict book, as the daemon keeps it: what it drops, and when it fences itself.
    verdicts: Verdicts,
    /// The verdicts this incarnation learnt, kept apart from `verdicts` for check (a), and
    /// how many verdicts were committed when it last read them.
    learnt: BTreeMap<usize, u64>,
    learnt_at: u64,
    /// The node it believes coordinates (its participant's coordinator).
    view: Option<usize>,
    /// The term it believes it leads (0: none); its metadata operations carry it.
    led_term: u64,
    /// Events that reached it while it was paused (or before the ones still waiting).
    inbox: VecDeque<Local>,
    disk: Disk,
    part: Participant,
    coord: Coordinator,
    /// Pages held: value and dirty bit.
    mem: BTreeMap<Page, (u64, bool)>,
    taken: BTreeMap<u64, Vec<Page>>,
    /// Every epoch this node took pages for since the job last stopped, and how many (the
    /// taken set above goes at the decision).
    took: BTreeMap<u64, u64>,
    /// Writes in progress: one per job from the participant, and late ones of rounds a
    /// rollback abandoned (they go on writing, as the daemon's tasks would).
    writes: Vec<WriteJob>,
    /// The highest epoch this node, as coordinator, started.
    started: u64,
    /// Memory checkpoints' recovery copies held here (a value per page).
    frames: FrameTable<u64>,
    /// The participant's persistent rounds in progress: their generation, by epoch.
    gens: BTreeMap<u64, u64>,
    /// As coordinator: the last memory epoch it committed (or learnt committed).
    mem_committed: u64,
    /// As coordinator: the term in which it last learnt the newest committed memory epoch
    /// from the nodes (the daemon's `learn_mem_committed`, before its first round of a term).
    mem_learned_term: u64,
    /// As coordinator: the real choice of each checkpoint's level (the daemon's).
    levels: Levels,
    /// The real job-control machine: it drives the job while this node coordinates.
    control: Control,
    /// The metadata sequence number its job control last read.
    control_seq: Option<u64>,
    /// The start whose ranks run here (`None`: none, or stopped).
    ranks: Option<u32>,
}

impl Node {
    /// Incarnation `inc` of node `i`, up, with an empty memory and disk.
    fn new(frame_capacity: u64, n: usize, i: usize, inc: u64) -> Node {
        Node {
            up: true,
            inc,
            paused_until_ms: 0,
            paused_in_round: None,
            verdicts: Verdicts::new(NAMES[i], inc),
            learnt: BTreeMap::new(),
            learnt_at: 0,
            view: None,
            led_term: 0,
            inbox: VecDeque::new(),
            disk: Disk::default(),
            part: Participant::new(inc),
            coord: Coordinator::new(TIMEOUT_MS, inc),
            mem: BTreeMap::new(),
            taken: BTreeMap::new(),
            took: BTreeMap::new(),
            writes: Vec::new(),
            started: 0,
            frames: FrameTable::new(frame_capacity),
            gens: BTreeMap::new(),
            mem_committed: 0,
            mem_learned_term: 0,
            levels: Levels::new(),
            control: Control::new(control_config(n)),
            control_seq: None,
            ranks: None,
        }
    }
}

/// What a job's ranks ask of its checkpoints' level: mostly memory only, else `auto` with an
/// interval and sometimes an every-N-th cleaner; now and then persistent only.
fn draw_choice(rng: &mut SplitMix64, cleaning: Policy) -> JobChoice {
    let level = match rng.below(10) {
        0 => Choice::Persistent,
        1..=6 => Choice::Memory,
        _ => Choice::Auto,
    };
    JobChoice {
        level,
        persistent_interval_ms: 200 + rng.below(5_000),
        persistent_every: if rng.chance(500) { 0 } else { 2 + rng.below(4) as u32 },
        cleaning,
    }
}

/// Job control's settings: the daemon's, but a rollback may take any number of passes (this
/// simulator's job never ends: its ends are the job-control simulator's) and there is no
/// spare.
fn control_config(n: usize) -> control::Config {
    control::Config {
        max_passes: u32::MAX,
        nodes: NAMES[..n].iter().map(|s| s.to_string()).collect(),
        ..control::Config::default()
    }
}

#[derive(Debug)]
enum Task {
    Begin(u64),
    Commit(u64),
    Fence(u64),
    /// The fence of restore `id`.
    Rollback(u64),
    /// An operation job control recorded.
    Job(MetaOp),
    /// A down verdict on incarnation `inc` of `node`, which was paused, or cut off (a link to
    /// or from it cut), when the coordinator declared it.
    Declare {
        node: usize,
        inc: u64,
        paused: bool,
        cut: bool,
    },
}

/// A restore job control asked for, carried out by node `by` (incarnation `inc`) with the real
/// [`Restore`] machine.
struct Restoring {
    id: u64,
    by: usize,
    inc: u64,
    /// The term its driver drove in: it stops at its next call once that term is over (the
    /// daemon's `JobCtl::drives_in`).
    term: u64,
    attempt: u32,
    machine: Restore,
    /// An action that waits (a fence while a round decides).
    next: Option<RestoreAction>,
    /// The epoch its fence fenced.
    fenced: u64,
    /// The incarnation of each node it asked for its state.
    asked: BTreeMap<usize, u64>,
}

struct MetaTask {
    op: MetaOp,
    by: NodeId,
    inc: u64,
    /// The term its submitter led.
    term: u64,
    task: Task,
}

struct Envelope {
    from: NodeId,
    from_inc: u64,
    to: NodeId,
    to_inc: u64,
    msg: Msg,
}

/// What a run counts; over many seeds, each must have happened.
const COUNTED: [&str; 23] = [
    "persistent checkpoints committed",
    "memory checkpoints committed",
    "rollbacks",
    "rollbacks to a memory checkpoint",
    "rounds that let the ranks go on before their decision",
    "writes made meanwhile",
    "pauses",
    "pauses of a coordinator in a round",
    "pauses of a node with a write or sync in progress",
    "rounds that ended after their coordinator woke from a pause",
    "cut links or nodes",
    "coordinator elections",
    "down verdicts",
    "verdicts on paused nodes",
    "verdicts on cut-off nodes",
    "checkpoint messages and page writes dropped from fenced incarnations",
    "messages sent and writes made by incarnations already declared down",
    "nodes that fenced themselves",
    "rollbacks after a verdict on a paused node",
    "rounds a coordinator already declared down went on with to their end",
    "pages whose mirror recovery copy stayed on their writer",
    "recovery copies re-created from or on a writer",
    "re-created copies refused by a lost node restarted since its settle",
];

#[derive(Default)]
struct Counts([u64; COUNTED.len()]);

impl Counts {
    const COMMITS: usize = 0;
    const MEMORY_COMMITS: usize = 1;
    const ROLLBACKS: usize = 2;
    const MEMORY_ROLLBACKS: usize = 3;
    const RELEASES: usize = 4;
    const EARLY_WRITES: usize = 5;
    const PAUSES: usize = 6;
    const COORDINATOR_PAUSES: usize = 7;
    const WRITER_PAUSES: usize = 8;
    const ROUNDS_AFTER_PAUSE: usize = 9;
    const CUTS: usize = 10;
    const ELECTIONS: usize = 11;
    const VERDICTS: usize = 12;
    const VERDICTS_PAUSED: usize = 13;
    const VERDICTS_CUT: usize = 14;
    const FENCED_DROPS: usize = 15;
    const LATE_ACTS: usize = 16;
    const SELF_FENCES: usize = 17;
    const PAUSE_ROLLBACKS: usize = 18;
    const DECLARED_ROUNDS: usize = 19;
    const WRITER_COPIES: usize = 20;
    const WRITER_RECREATIONS: usize = 21;
    const REFUSED_RECREATIONS: usize = 22;
}

struct World {
    rng: SplitMix64,
    now_ms: u64,
    nodes: Vec<Node>,
    placement: Placement,
    files: Vec<(FileId, u64)>,
    meta: MetaState,
    queue: VecDeque<MetaTask>,
    net: Vec<Envelope>,
    /// Every committed checkpoint's image (0: the files as the job started).
    history: BTreeMap<u64, Image>,
    /// The image when each round began (its checkpoint's contents), by round: epoch,
    /// coordinator node and incarnation (two coordinators may start rounds of one memory
    /// epoch).
    round_images: BTreeMap<Round, Image>,
    /// The image of each memory checkpoint committed, from its round.
    memory_images: BTreeMap<u64, Image>,
    /// The job's pages as it sees them (its writes since the restored checkpoint).
    app: Image,
    next_val: u64,
    /// A crash, or a verdict on a node running the job's ranks, lost some of the job's
    /// memory: what the nodes hold is not the job's until a restore that no failure overtook
    /// completes. (What the world knows, for the checks and for whether the ranks can go on;
    /// job control learns of failures only as the daemon does, from the heartbeats and the
    /// committed verdicts.)
    broken: bool,
    /// The restores under way, each carried out for job control by the node that drives it.
    restores: Vec<Restoring>,
    /// Restores begun (their ids).
    restores_begun: u64,
    /// When the client last sent the job's launch (it sends it again until it is answered).
    launch_sent_ms: Option<u64>,
    launched: bool,
    /// Outcomes of steps job control asked for, for its next turn (the daemon's tasks post
    /// them back): the node, its incarnation, the start, the outcome.
    outcomes: Vec<(usize, u64, u64, u32, Done)>,
    /// Rollbacks completed: the job's run since the last one, and the run each round began in
    /// (a checkpoint of a run rolled back must never commit).
    lineage: u64,
    round_lineage: BTreeMap<Round, u64>,
    /// Pages the persistent checkpoints that finished committed said they kept.
    persistent_pages: u64,
    trace: bool,
    /// Frames a node may hold.
    frame_capacity: u64,
    /// The job's cleaning policy: which recovery copies stay after a cleaner checkpoint.
    cleaning: Policy,
    /// What the job's ranks ask of its checkpoints' level (`psls run --level`, …).
    choice: JobChoice,
    /// Generations the metadata began: the only ones a disk write may carry.
    begun_gens: BTreeSet<u64>,
    /// The metadata's leader (the cluster's coordinator), its term, and who led each term
    /// (node, incarnation).
    leader: Option<usize>,
    term: u64,
    term_leaders: BTreeMap<u64, (usize, u64)>,
    /// Directed links cut until then.
    cut_until_ms: BTreeMap<(usize, usize), u64>,
    /// When the leader last heard each node, and each node the leader.
    heard_by_leader: Vec<u64>,
    hears_leader: Vec<u64>,
    /// (b): the highest epoch a rollback's fence that was applied fenced.
    fence_applied: u64,
    /// (c): the coordinator (node, incarnation) each epoch was begun for in the metadata, and
    /// the run and coordinator of each round finished committed.
    begun_by: BTreeMap<u64, (usize, u64)>,
    finished_committed: BTreeMap<u64, (u64, usize, u64)>,
    /// A verdict on a paused node is among the failures the rollback under way answers.
    rollback_after_pause: bool,
    counts: Counts,
}

/// Whether node `j` has not heard the coordinator for the timeout.
fn deaf(w: &World, j: usize) -> bool {
    w.now_ms.saturating_sub(w.hears_leader[j]) > TIMEOUT_MS && w.awake(j) && !w.declared(j)
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = SplitMix64::new(seed);
        let n = 3 + rng.below(3) as u32;
        let placement = Placement::new(n).expect("n >= 2");
        let files = vec![(FileId(11), 4 + rng.below(12)), (FileId(12), 1 + rng.below(6))];
        // Sometimes too small for a round that rewrites many pages.
        let frame_capacity = if rng.chance(300) { 2 + rng.below(8) } else { 64 };
        let cleaning = [
            Policy::NoCleaning,
            Policy::Total,
            Policy::P1,
            Policy::P2,
            Policy::P3,
            Policy::Lru { frames: 4 },
        ][rng.below(6) as usize];
        // Drawn from a generator of its own, so that every other draw of a seed stays as it was.
        let choice = draw_choice(&mut SplitMix64::new(seed ^ 0x1e7e_15c0_ffee_0001), cleaning);
        let mut meta = MetaState::default();
        for (id, pages) in &files {
            meta.apply(&MetaOp::CommitFile {
                meta: FileMeta {
                    id: *id,
                    name: format!("f{id}"),
                    size: pages * 4096,
                    uid: 0,
                    gid: 0,
                    mode: 0o644,
                    gen: 0,
                    created_unix_ms: 0,
                    written: Default::default(),
                    writer: None,
                },
                replaces: None,
                placed_at: None,
            })
            .expect("file");
        }
        let app: Image = files
            .iter()
            .flat_map(|(f, p)| (0..*p).map(move |i| ((*f, i), 0)))
            .collect();
        // Node 0 leads the first term; everyone knows it.
        let mut nodes: Vec<Node> = (0..n as usize)
            .map(|i| Node::new(frame_capacity, n as usize, i, 1))
            .collect();
        for node in nodes.iter_mut() {
            node.view = Some(0);
            node.part.coordinator_changed(Some(NodeId(0)));
        }
        nodes[0].led_term = 1;
        World {
            rng,
            now_ms: 0,
            nodes,
            placement,
            files,
            meta,
            queue: VecDeque::new(),
            net: Vec::new(),
            history: BTreeMap::from([(0, app.clone())]),
            round_images: BTreeMap::new(),
            memory_images: BTreeMap::new(),
            app,
            next_val: 1,
            broken: false,
            restores: Vec::new(),
            restores_begun: 0,
            launch_sent_ms: None,
            launched: false,
            outcomes: Vec::new(),
            lineage: 0,
            round_lineage: BTreeMap::new(),
            persistent_pages: 0,
            trace: std::env::var("PSLS_SIM_TRACE").is_ok(),
            frame_capacity,
            cleaning,
            choice,
            begun_gens: BTreeSet::new(),
            leader: Some(0),
            term: 1,
            term_leaders: BTreeMap::from([(1, (0, 1))]),
            cut_until_ms: BTreeMap::new(),
            heard_by_leader: vec![0; n as usize],
            hears_leader: vec![0; n as usize],
            fence_applied: 0,
            begun_by: BTreeMap::new(),
            finished_committed: BTreeMap::new(),
            rollback_after_pause: false,
            counts: Counts::default(),
        }
    }

    fn log(&self, what: impl FnOnce() -> String) {
        if self.trace {
            println!("[{}] {}", self.now_ms, what());
        }
    }

    fn count(&mut self, what: usize) {
        self.counts.0[what] += 1;
    }

    // ---- the cluster: pauses, links, terms, verdicts ----

    fn awake(&self, i: usize) -> bool {
        self.nodes[i].up && self.nodes[i].paused_until_ms <= self.now_ms
    }

    fn paused(&self, i: usize) -> bool {
        self.nodes[i].up && self.nodes[i].paused_until_ms > self.now_ms
    }

    /// Whether what `a` sends `b` gets there (a node always reaches itself).
    fn link(&self, a: usize, b: usize) -> bool {
        a == b || self.cut_until_ms.get(&(a, b)).is_none_or(|&t| t <= self.now_ms)
    }

    fn both_ways(&self, a: usize, b: usize) -> bool {
        self.link(a, b) && self.link(b, a)
    }

    /// A link to or from node `i` is cut.
    fn cut_off(&self, i: usize) -> bool {
        (0..self.nodes.len()).any(|j| !self.both_ways(i, j))
    }

    /// The metadata holds a verdict on node `i`'s incarnation.
    fn declared(&self, i: usize) -> bool {
        self.meta.is_down(NAMES[i], self.nodes[i].inc)
    }

    /// The coordinator that may start rounds and rollbacks: the leader of the current term,
    /// awake, knowing it leads.
    fn acting(&self) -> Option<usize> {
        self.leader
            .filter(|&l| self.awake(l) && self.nodes[l].view == Some(l) && self.nodes[l].led_term == self.term)
    }

    /// The receivers' rule (`Verdicts::accepts`): nothing from an incarnation declared down,
    /// once the receiver knows the verdict.
    fn takes(&self, to: usize, from: usize, inc: u64) -> bool {
        self.nodes[to].verdicts.accepts(NAMES[from], inc)
    }

    /// Check (a), apart from the dropping code: node `to` takes nothing from an incarnation
    /// it learnt was declared down.
    fn check_not_fenced(&self, to: usize, from: usize, inc: u64, what: &str) {
        if let Some(&d) = self.nodes[to].learnt.get(&from) {
            assert!(
                d < inc,
                "(a) node {to} took {what} from incarnation {inc} of node {from}, which it knows was declared down (verdict up to incarnation {d})"
            );
        }
    }

    /// The failure detector, at the current time: who hears whom, elections, and the
    /// coordinator's declarations.
    fn observe(&mut self) {
        let n = self.nodes.len();
        let now = self.now_ms;
        let l = match self.leader {
            Some(l) if self.nodes[l].up => l,
            _ => {
                self.leader = None;
                let candidates: Vec<usize> = (0..n).filter(|&j| self.awake(j) && !self.declared(j)).collect();
                self.elect_among(&candidates, None);
                return;
            }
        };
        if self.awake(l) {
            for j in 0..n {
                if self.awake(j) {
                    if self.link(j, l) {
                        self.heard_by_leader[j] = now;
                    }
                    if self.link(l, j) {
                        self.hears_leader[j] = now;
                    }
                }
            }
        }
        // A majority that has not heard the coordinator for the timeout elects another.
        if (0..n).any(|j| j != l && deaf(self, j)) {
            let deaf: Vec<usize> = (0..n).filter(|&j| j != l && deaf(self, j)).collect();
            if self.elect_among(&deaf, Some(l)) {
                return;
            }
        }
        if self.acting() != Some(l) {
            return;
        }
        let silent = |j: usize| j != l && now.saturating_sub(self.heard_by_leader[j]) > TIMEOUT_MS;
        if (0..n).any(silent) {
            let suspects = (0..n)
                .filter(|&j| silent(j))
                .map(|j| (NAMES[j].to_string(), self.nodes[j].inc))
                .collect();
            self.declare(l, suspects);
        }
    }

    /// The lowest of `candidates` becomes the coordinator if a majority of the nodes (it
    /// included) joined to it both ways votes for it.
    fn elect_among(&mut self, candidates: &[usize], old: Option<usize>) -> bool {
        let Some(&c) = candidates.first() else { return false };
        let voters: Vec<usize> = candidates.iter().copied().filter(|&j| self.both_ways(c, j)).collect();
        if voters.len() <= self.nodes.len() / 2 {
            return false;
        }
        self.term += 1;
        self.count(Counts::ELECTIONS);
        self.leader = Some(c);
        self.term_leaders.insert(self.term, (c, self.nodes[c].inc));
        self.nodes[c].led_term = self.term;
        self.log(|| format!("{c} coordinates term {} (voters {voters:?}, before {old:?})", self.term));
        // The new coordinator's detector: it hears the others now, not the old coordinator
        // (silent to it for the timeout).
        let now = self.now_ms;
        let old_heard = self.hears_leader[c];
        self.heard_by_leader.iter_mut().for_each(|t| *t = now);
        self.hears_leader.iter_mut().for_each(|t| *t = now);
        if let Some(o) = old {
            self.heard_by_leader[o] = old_heard;
        }
        // The voters promised the new term: they know who coordinates, and what it committed.
        for v in voters {
            self.install(v);
        }
        // The old coordinator, which a majority has not heard for the timeout, is declared.
        if let Some(o) = old.filter(|&o| self.nodes[o].up && self.acting() == Some(c)) {
            let suspect = vec![(NAMES[o].to_string(), self.nodes[o].inc)];
            self.declare(c, suspect);
        }
        true
    }

    /// Coordinator `l` declares down the incarnations of `suspects` it is not declaring yet
    /// (`Verdicts::poll_declarations`, as the daemon does).
    fn declare(&mut self, l: usize, suspects: Vec<(String, u64)>) {
        for (p, inc) in self.nodes[l].verdicts.poll_declarations(true, suspects) {
            let node = node_index(&p);
            let (paused, cut) = (self.paused(node), self.cut_off(node));
            self.log(|| format!("{l} declares incarnation {inc} of {node} down (paused {paused}, cut {cut})"));
            self.submit(
                l,
                MetaOp::DeclareDown {
                    physical: p,
                    incarnation: inc,
                },
                Task::Declare { node, inc, paused, cut },
            );
        }
    }

    /// Node `j` hears the coordinator: it knows it coordinates, and every committed verdict.
    fn install(&mut self, j: usize) {
        let Some(l) = self.leader else { return };
        if self.nodes[j].view != Some(l) {
            self.nodes[j].view = Some(l);
            self.nodes[j].part.coordinator_changed(Some(NodeId(l as u32)));
        }
        if j != l {
            self.nodes[j].led_term = 0;
        }
        self.learn_committed(j);
    }

    /// Node `j` reads the committed verdicts; its coordinator hears of the nodes they name
    /// (in the incarnation they run), and it fences itself if one names it.
    fn learn_committed(&mut self, j: usize) {
        // Nothing new since it last read them.
        let committed = self.counts.0[Counts::VERDICTS];
        if self.nodes[j].learnt_at == committed && committed > 0 {
            return;
        }
        self.nodes[j].learnt_at = committed;
        let World { meta, nodes, .. } = self;
        nodes[j].verdicts.handle_committed(&meta.down);
        let mut failed = Vec::new();
        for (p, &d) in &meta.down {
            let k = node_index(p);
            if nodes[j].learnt.get(&k).is_some_and(|&o| o >= d) {
                continue;
            }
            nodes[j].learnt.insert(k, d);
            if k != j && d >= nodes[k].inc {
                failed.push(k);
            }
        }
        for k in failed {
            self.local(j, Local::NodeDown(NodeId(k as u32)));
        }
        if let Some(f) = self.nodes[j].verdicts.poll_fence() {
            self.log(|| format!("{j} learns its verdict ({f:?})"));
            self.fence_self(j);
        }
    }

    /// Every awake node that hears the coordinator reads it now and then.
    fn hear_leader(&mut self) {
        let Some(l) = self.leader else { return };
        if !self.awake(l) {
            return;
        }
        for j in 0..self.nodes.len() {
            if self.leader == Some(l) && self.awake(j) && self.link(l, j) && self.rng.chance(400) {
                self.install(j);
            }
        }
    }

    /// A heartbeat between two peers: it tells the receiver of a verdict on it.
    fn heartbeat(&mut self) {
        let n = self.nodes.len() as u64;
        let (j, i) = (self.rng.below(n) as usize, self.rng.below(n) as usize);
        if i == j || !self.awake(i) || !self.awake(j) || !self.link(j, i) {
            return;
        }
        let down: Vec<(String, u64)> = self.nodes[j]
            .verdicts
            .committed()
            .iter()
            .map(|(p, d)| (p.clone(), *d))
            .collect();
        let inc = self.nodes[j].inc;
        self.nodes[i].verdicts.handle_heartbeat(
            NAMES[j],
            inc,
            down.iter().map(|(p, d)| (p.as_str(), *d)),
            std::iter::empty(),
        );
        if let Some(f) = self.nodes[i].verdicts.poll_fence() {
            self.log(|| format!("{i} learns its verdict from {j} ({f:?})"));
            self.fence_self(i);
        }
    }

    /// Node `i` learnt its verdict: it stops its ranks and rejoins as a new incarnation with
    /// an empty memory (its disk stays, with what it wrote: the process exits, the machine
    /// does not lose its page cache).
    fn fence_self(&mut self, i: usize) {
        self.count(Counts::SELF_FENCES);
        let inc = self.nodes[i].inc + 1;
        let disk = std::mem::take(&mut self.nodes[i].disk);
        self.nodes[i] = Node {
            disk,
            ..Node::new(self.frame_capacity, self.nodes.len(), i, inc)
        };
        // Its connections close: what they still held may be lost.
        if self.rng.chance(500) {
            self.net.retain(|e| e.from.0 as usize != i);
        }
        if self.leader == Some(i) {
            self.leader = None;
        }
        self.install(i);
    }

    /// A node pauses: the coordinator, a node with a write in progress, or any; shorter than
    /// the failure timeout or up to three times longer.
    fn pause(&mut self) {
        let n = self.nodes.len() as u64;
        let writing: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| !self.nodes[i].writes.is_empty())
            .collect();
        let i = match self.rng.below(3) {
            0 => self.leader.unwrap_or(0),
            1 if !writing.is_empty() => writing[self.rng.below(writing.len() as u64) as usize],
            _ => self.rng.below(n) as usize,
        };
        if !self.awake(i) {
            return;
        }
        let ms = if self.rng.chance(500) {
            1 + self.rng.below(TIMEOUT_MS)
        } else {
            TIMEOUT_MS + self.rng.below(2 * TIMEOUT_MS)
        };
        self.nodes[i].paused_until_ms = self.now_ms + ms;
        self.count(Counts::PAUSES);
        let round = self.nodes[i].coord.progress(JOB).map(|p| p.epoch);
        if round.is_some() {
            self.nodes[i].paused_in_round = round;
            self.count(Counts::COORDINATOR_PAUSES);
        }
        if !self.nodes[i].writes.is_empty() {
            self.count(Counts::WRITER_PAUSES);
        }
        self.log(|| {
            format!(
                "{i} pauses for {ms} ms (coordinating {}, writes {}, round {:?})",
                self.leader == Some(i),
                self.nodes[i].writes.len(),
                self.nodes[i].coord.progress(JOB).map(|p| (p.epoch, p.step))
            )
        });
    }

    /// A link is cut one way or both, or a node (the coordinator half the time) from every
    /// other; shorter than the failure timeout or up to four times longer.
    fn cut(&mut self) {
        let n = self.nodes.len();
        let ms = if self.rng.chance(500) {
            1 + self.rng.below(TIMEOUT_MS)
        } else {
            TIMEOUT_MS + self.rng.below(3 * TIMEOUT_MS)
        };
        let until = self.now_ms + ms;
        let a = match self.leader {
            Some(l) if self.rng.chance(500) => l,
            _ => self.rng.below(n as u64) as usize,
        };
        let mut links = Vec::new();
        match self.rng.below(3) {
            kind @ (0 | 1) => {
                let b = (a + 1 + self.rng.below(n as u64 - 1) as usize) % n;
                links.push((a, b));
                if kind == 1 {
                    links.push((b, a));
                }
            }
            _ => {
                for b in (0..n).filter(|&b| b != a) {
                    links.push((a, b));
                    links.push((b, a));
                }
            }
        }
        for &l in &links {
            let t = self.cut_until_ms.entry(l).or_insert(0);
            *t = (*t).max(until);
        }
        // A link break drops what its connection still held.
        self.net
            .retain(|e| !links.contains(&(e.from.0 as usize, e.to.0 as usize)));
        self.count(Counts::CUTS);
        self.log(|| format!("links {links:?} cut for {ms} ms"));
    }

    /// Time passes (in steps, so that the detector sees pauses and cuts end); awake nodes
    /// tick.
    fn advance(&mut self, ms: u64) {
        let end = self.now_ms + ms;
        while self.now_ms < end {
            self.now_ms = (self.now_ms + 500).min(end);
            self.observe();
        }
        self.cut_until_ms.retain(|_, t| *t > end);
        let now = self.now_ms;
        for i in 0..self.nodes.len() {
            if self.awake(i) {
                self.nodes[i].coord.tick(now);
                self.nodes[i].coord.retry();
            }
        }
    }

    /// An event for node `i`: now if it is awake and nothing waits before it, else queued.
    fn local(&mut self, i: usize, ev: Local) {
        if !self.nodes[i].up {
            return;
        }
        if self.awake(i) && self.nodes[i].inbox.is_empty() {
            self.apply_local(i, ev);
        } else {
            self.nodes[i].inbox.push_back(ev);
        }
    }

    fn apply_local(&mut self, i: usize, ev: Local) {
        let now = self.now_ms;
        let c = &mut self.nodes[i].coord;
        match ev {
            Local::NodeDown(n) => c.node_down(n),
            Local::Begun(epoch, r) => c.begun(now, JOB, epoch, r),
            Local::Committed(epoch, r) => c.committed(JOB, epoch, r),
            Local::Fenced(epoch, r) => c.fenced(JOB, epoch, r),
            Local::Stop(attempt) => self.stop_node(i, attempt),
        }
    }

    /// An event that waited for a node, or else a message.
    fn local_or_deliver(&mut self) {
        if !self.local_step() {
            self.deliver();
        }
    }

    /// An awake node carries out the next event that waited for it; false if none could.
    fn local_step(&mut self) -> bool {
        let n = self.nodes.len();
        let start = self.rng.below(n as u64) as usize;
        for i in (0..n).map(|k| (start + k) % n) {
            if !self.awake(i) {
                continue;
            }
            let stop = matches!(self.nodes[i].inbox.front(), Some(Local::Stop(_)));
            if stop && !self.leader.is_none_or(|l| self.link(l, i)) {
                continue;
            }
            if let Some(ev) = self.nodes[i].inbox.pop_front() {
                self.log(|| format!("{i} wakes to {ev:?}"));
                self.apply_local(i, ev);
                return true;
            }
        }
        false
    }

    // ---- the job ----

    fn coordinator_holds_ranks(&self, i: usize) -> bool {
        let n = &self.nodes[i];
        n.view == Some(i) && n.coord.busy(JOB) && !n.coord.released(JOB)
    }

    /// Whether the ranks of the job's recorded start run on every node: the start is running,
    /// and each node of it, up in the incarnation it names, started them.
    fn ranks_run(&self) -> bool {
        let Some(run) = self.meta.runs.get(JOB) else {
            return false;
        };
        run.phase == RunPhase::Running
            && run.nodes.values().all(|(p, inc)| {
                let n = &self.nodes[node_index(p)];
                n.up && n.inc == *inc && n.ranks == Some(run.attempt)
            })
    }

    /// Whether the job goes on: its ranks run everywhere, on a memory no failure broke, every
    /// node up and not declared down, and not at a safe point in a round of a node that
    /// believes it coordinates.
    fn app_runs(&self) -> bool {
        !self.broken
            && self.ranks_run()
            && (0..self.nodes.len()).all(|i| self.nodes[i].up && !self.declared(i) && !self.coordinator_holds_ranks(i))
    }

    /// A page a paused node holds: a write waits for its invalidation, a read may need it.
    fn held_by_paused(&self, p: Page) -> bool {
        (0..self.nodes.len()).any(|i| self.paused(i) && self.nodes[i].mem.contains_key(&p))
    }

    fn pages(&self) -> Vec<Page> {
        self.files
            .iter()
            .flat_map(|(f, p)| (0..*p).map(move |i| (*f, i)))
            .collect()
    }

    fn file_ids(&self) -> Vec<FileId> {
        self.files.iter().map(|f| f.0).collect()
    }

    fn committed_epoch(&self) -> u64 {
        self.meta.jobs.get(JOB).map_or(0, |r| r.epoch)
    }

    fn page_gen(&self, p: Page) -> u64 {
        self.meta
            .files
            .values()
            .find(|f| f.id == p.0)
            .map_or(0, |f| f.page_gen(p.1))
    }

    fn app_write(&mut self) {
        let n = self.rng.below(self.nodes.len() as u64) as usize;
        if !self.awake(n) {
            return;
        }
        let pages = self.pages();
        let p = pages[self.rng.below(pages.len() as u64) as usize];
        if self.held_by_paused(p) {
            return;
        }
        let val = self.next_val;
        self.next_val += 1;
        // Write access: every other copy goes (with its dirty bit); this one is dirty.
        for m in &mut self.nodes {
            m.mem.remove(&p);
        }
        self.nodes[n].mem.insert(p, (val, true));
        self.app.insert(p, val);
        if self.nodes.iter().any(|m| m.coord.busy(JOB)) {
            self.count(Counts::EARLY_WRITES);
        }
        self.log(|| format!("write {p:?} = {val} at {n}"));
    }

    fn app_read(&mut self) {
        let n = self.rng.below(self.nodes.len() as u64) as usize;
        if !self.awake(n) {
            return;
        }
        let pages = self.pages();
        let p = pages[self.rng.below(pages.len() as u64) as usize];
        if self.nodes[n].mem.contains_key(&p) || self.held_by_paused(p) {
            return;
        }
        // From a node holding it (the owner keeps its dirty bit), else from its last
        // checkpoint: a recovery copy on a holder, or the disks.
        let val = self.nodes.iter().find_map(|m| m.mem.get(&p).map(|x| x.0));
        let val = match val {
            Some(v) => v,
            None => self
                .read_checkpointed(p)
                .unwrap_or_else(|| panic!("page {p:?} is unreadable from both copies")),
        };
        assert_eq!(
            val, self.app[&p],
            "a read of {p:?} at node {n} sees another version than the job wrote"
        );
        self.nodes[n].mem.insert(p, (val, false));
    }

    /// Page `p` as of the job's last checkpoint: a committed recovery copy on one of its
    /// holders (the daemon's `pfs::read_page`), else its committed version on the disks.
    fn read_checkpointed(&self, p: Page) -> Option<u64> {
        for role in [Role::Primary, Role::Mirror] {
            let h = self.placement.holder(p.0, p.1, role).0 as usize;
            if let Some(v) = self.nodes[h].frames.read(p.0, p.1).filter(|_| self.nodes[h].up) {
                return Some(*v);
            }
        }
        self.read_disk(p)
    }

    /// The committed version of page `p` from a copy on an up node.
    fn read_disk(&self, p: Page) -> Option<u64> {
        let gen = self.page_gen(p);
        if gen == 0 {
            return Some(0);
        }
        [Role::Primary, Role::Mirror].iter().find_map(|&role| {
            let h = self.placement.holder(p.0, p.1, role).0 as usize;
            if !self.nodes[h].up {
                return None;
            }
            self.nodes[h].disk.read((p, role), gen)
        })
    }

    fn image(&self) -> Image {
        self.pages()
            .into_iter()
            .map(|p| {
                let v = self
                    .nodes
                    .iter()
                    .find_map(|m| m.mem.get(&p).map(|x| x.0))
                    .or_else(|| self.read_checkpointed(p))
                    .unwrap_or(u64::MAX);
                (p, v)
            })
            .collect()
    }

    // ---- the coordinator ----

    fn start_round(&mut self, level: Option<Level>) {
        let Some(ci) = self.acting() else { return };
        // Every rank reaches the safe point: none is on a paused node. And the daemon's
        // `check_all_serving`: every node is live at the coordinator (heard within the
        // timeout, no verdict on it known there).
        let serving = (0..self.nodes.len()).all(|j| {
            self.awake(j)
                && self.now_ms.saturating_sub(self.heard_by_leader[j]) <= TIMEOUT_MS
                && self.nodes[ci].verdicts.accepts(NAMES[j], self.nodes[j].inc)
        });
        if !self.app_runs() || !serving {
            return;
        }
        // The daemon's choice (`choose_level`): whether memory has room is one draw (the figures
        // the coordinator has), the rest is the job's choice and its history here.
        let level = level.unwrap_or_else(|| {
            let fits = self.rng.chance(900);
            let (now, choice) = (self.now_ms, self.choice);
            let levels = &mut self.nodes[ci].levels;
            levels.called(JOB, choice);
            let level = levels.choose(JOB, now, false, fits);
            assert!(
                level == Level::Persistent || (fits && choice.level != Choice::Persistent),
                "a memory checkpoint chosen for a job pinned to persistent ones, or without room"
            );
            level
        });
        let all: BTreeSet<NodeId> = (0..self.nodes.len()).map(|i| NodeId(i as u32)).collect();
        let files = self.file_ids();
        let now = self.now_ms;
        // A coordinator new to this term first learns the newest memory epoch a node has
        // committed: a memory round its predecessor committed may not have reached it.
        if self.nodes[ci].mem_learned_term != self.term {
            let newest = self
                .nodes
                .iter()
                .map(|n| n.frames.job(JOB).committed)
                .max()
                .unwrap_or(0);
            let c = &mut self.nodes[ci];
            c.mem_committed = c.mem_committed.max(newest);
            c.mem_learned_term = self.term;
        }
        let committed = self.committed_epoch().max(self.nodes[ci].mem_committed);
        // Above every epoch begun, seen or committed (the daemon's `run_round_once`).
        let epoch = self
            .meta
            .job_floor(JOB)
            .max(self.nodes[ci].started)
            .max(self.nodes[ci].coord.seen(JOB))
            .max(committed)
            + 1;
        if self.nodes[ci]
            .coord
            .start(now, JOB, epoch, (level, self.cleaning), files, all, committed)
            .is_ok()
        {
            // The job's ranks run on every node: each must answer in the incarnation it has
            // at the safe point.
            let incs = (0..self.nodes.len())
                .map(|k| (NodeId(k as u32), self.nodes[k].inc))
                .collect();
            self.nodes[ci].coord.expect(JOB, epoch, incs);
            self.nodes[ci].started = epoch;
            let img = self.image();
            assert_eq!(img, self.app, "the memory image differs from the job's writes");
            let round = (epoch, ci, self.nodes[ci].inc);
            self.round_images.insert(round, img);
            self.round_lineage.insert(round, self.lineage);
            self.log(|| format!("{level} round {epoch} starts at {ci}"));
        }
    }

    fn run_actions(&mut self) {
        for _ in 0..10_000 {
            let mut any = false;
            for i in 0..self.nodes.len() {
                if !self.awake(i) {
                    continue;
                }
                while let Some(a) = self.nodes[i].coord.poll_action() {
                    any = true;
                    self.coord_action(i, a);
                }
                while let Some(a) = self.nodes[i].part.poll_action() {
                    any = true;
                    self.part_action(i, a);
                }
            }
            if !any {
                return;
            }
        }
        panic!("actions did not settle");
    }

    fn send(&mut self, from: usize, to: NodeId, msg: Msg) {
        let t = to.0 as usize;
        if self.declared(from) {
            self.count(Counts::LATE_ACTS);
        }
        if !self.link(from, t) {
            self.log(|| format!("{from} -> {to}: lost on a cut link: {msg:?}"));
            return;
        }
        let (from_inc, to_inc) = (self.nodes[from].inc, self.nodes[t].inc);
        self.net.push(Envelope {
            from: NodeId(from as u32),
            from_inc,
            to,
            to_inc,
            msg,
        });
    }

    fn submit(&mut self, by: usize, op: MetaOp, task: Task) {
        let (inc, term) = (self.nodes[by].inc, self.nodes[by].led_term);
        if self.leader != Some(by) || term != self.term {
            // A deposed coordinator: the voters promised a newer term and refuse it.
            self.log(|| format!("{by} (term {term}) is refused {task:?}: term {} now", self.term));
            self.answer_err(by, &task, "not the coordinator any more".into());
            return;
        }
        self.queue.push_back(MetaTask {
            op,
            by: NodeId(by as u32),
            inc,
            term,
            task,
        });
    }

    /// An operation of node `by` failed, or its fate is unknown.
    fn answer_err(&mut self, by: usize, task: &Task, why: String) {
        let ev = match task {
            Task::Begin(epoch) => Local::Begun(*epoch, Err(why)),
            Task::Commit(epoch) => Local::Committed(*epoch, Err(why)),
            Task::Fence(epoch) => Local::Fenced(*epoch, Err(why)),
            Task::Rollback(id) => {
                if let Some(k) = self.restores.iter().position(|r| r.id == *id) {
                    self.fail_restore(k, format!("its fence: {why}"));
                }
                return;
            }
            Task::Job(op) => {
                self.nodes[by].control.handle_refused(JOB, op, &why);
                return;
            }
            Task::Declare { node, .. } => {
                self.nodes[by].verdicts.handle_declared(NAMES[*node]);
                return;
            }
        };
        self.local(by, ev);
    }

    fn coord_action(&mut self, i: usize, a: CoordAction) {
        match a {
            CoordAction::Send { to, msg } => self.send(i, to, msg),
            CoordAction::Begin { job, epoch } => {
                self.submit(i, MetaOp::BeginCheckpoint { job, epoch }, Task::Begin(epoch))
            }
            CoordAction::Commit {
                job,
                epoch,
                gen,
                files,
                bytes,
            } => {
                let op = MetaOp::Checkpoint {
                    job,
                    epoch,
                    gen,
                    placed_at: self.meta.map_version,
                    files,
                    at_unix_ms: self.now_ms,
                    bytes,
                };
                self.submit(i, op, Task::Commit(epoch));
            }
            CoordAction::Fence { job, epoch } => {
                self.submit(i, MetaOp::FenceCheckpoint { job, epoch }, Task::Fence(epoch))
            }
            CoordAction::Released { epoch, pages, .. } => {
                // The ranks go on (`app_runs`): every node must have taken its pages by now,
                // so that nothing they write from here on lands in this checkpoint. (A job
                // stopped for a rollback dropped what it took; its ranks do not run; a round
                // of a run rolled back since has no ranks any more.)
                let round = (epoch, i, self.nodes[i].inc);
                let current = !self.broken && self.round_lineage.get(&round) == Some(&self.lineage);
                for (k, n) in self.nodes.iter().enumerate().filter(|_| current) {
                    assert!(
                        n.took.contains_key(&epoch),
                        "round {epoch} released its ranks before node {k} took its pages"
                    );
                }
                if current {
                    let took: u64 = self.nodes.iter().map(|n| n.took[&epoch]).sum();
                    assert_eq!(pages, took, "round {epoch} released with a wrong page count");
                }
                self.count(Counts::RELEASES);
                self.log(|| format!("round {epoch} released its ranks at {i}"));
            }
            CoordAction::Finished { epoch, outcome, .. } => {
                self.log(|| format!("round {epoch} over at {i}: {outcome:?}"));
                if self.nodes[i].paused_in_round.take() == Some(epoch) {
                    self.count(Counts::ROUNDS_AFTER_PAUSE);
                }
                if self.declared(i) {
                    self.count(Counts::DECLARED_ROUNDS);
                }
                if let Outcome::Committed { level, .. } = outcome {
                    let now = self.now_ms;
                    self.nodes[i].levels.committed(JOB, level, now);
                    // (c) One round of an epoch commits in a run of the job.
                    let me = (self.lineage, i, self.nodes[i].inc);
                    if let Some(before) = self.finished_committed.insert(epoch, me) {
                        assert!(
                            before.0 != self.lineage,
                            "(c) round {epoch} finished committed at node {i} (incarnation {}) and before at node {} (incarnation {})",
                            me.2,
                            before.1,
                            before.2
                        );
                    }
                }
                match outcome {
                    Outcome::Committed {
                        level: Level::Persistent,
                        pages,
                        ..
                    } => {
                        assert_eq!(
                            self.meta.job_decided(JOB, epoch),
                            Some(true),
                            "round {epoch} finished as committed without its record"
                        );
                        self.persistent_pages += pages;
                    }
                    Outcome::Committed {
                        level: Level::Memory, ..
                    } => {
                        // (b) Its decision is the commit: never after a rollback fenced it
                        // (unless this coordinator knows it was deposed: nobody takes its
                        // decisions then, which check (c) on the participants backs).
                        if self.nodes[i].view == Some(i) {
                            assert!(
                                epoch > self.fence_applied,
                                "(b) memory round {epoch} committed at node {i} after a rollback fenced every epoch up to {}",
                                self.fence_applied
                            );
                        }
                        self.nodes[i].mem_committed = epoch;
                        let round = (epoch, i, self.nodes[i].inc);
                        let img = self.round_images[&round].clone();
                        self.memory_images.insert(epoch, img);
                        if self.round_lineage.get(&round) == Some(&self.lineage) {
                            self.count(Counts::MEMORY_COMMITS);
                        }
                    }
                    Outcome::Aborted(_) | Outcome::NoRoom(_) => {}
                }
            }
        }
    }

    fn part_action(&mut self, i: usize, a: PartAction) {
        match a {
            PartAction::Send { to, msg } => self.send(i, to, msg),
            PartAction::Write {
                epoch,
                level,
                gen,
                files,
                committed,
                ..
            } => {
                if level == Level::Persistent {
                    self.nodes[i].gens.insert(epoch, gen);
                }
                assert!(
                    self.nodes[i].writes.iter().all(|w| w.epoch < epoch),
                    "a write of epoch {epoch} at node {i} while one of a later epoch runs"
                );
                let mut pages = Vec::new();
                for (p, (val, dirty)) in self.nodes[i].mem.iter_mut() {
                    if *dirty && files.contains(&p.0) {
                        *dirty = false;
                        pages.push((*p, *val));
                    }
                }
                self.nodes[i].taken.insert(epoch, pages.iter().map(|x| x.0).collect());
                self.nodes[i].took.insert(epoch, pages.len() as u64);
                self.nodes[i].part.taken(JOB, epoch, pages.len() as u64);
                self.nodes[i].writes.push(WriteJob {
                    epoch,
                    level,
                    committed,
                    gen,
                    pages,
                    stage: Stage::Taken,
                });
            }
            // A hint to start keeping the pages: the simulated writes go at any pace anyway.
            PartAction::Go { .. } => {}
            PartAction::Flush { epoch, gen, .. } => self.flush(i, epoch, gen),
            PartAction::Clean { epoch, level, .. } => {
                if level == Level::Memory {
                    // (b) No memory round a rollback fenced commits after the fence.
                    assert!(
                        epoch > self.fence_applied,
                        "(b) node {i} takes the commit of memory round {epoch} after a rollback fenced every epoch up to {}",
                        self.fence_applied
                    );
                }
                let node = &mut self.nodes[i];
                match level {
                    Level::Memory => node.frames.commit(JOB, epoch),
                    Level::Persistent => {
                        if let Some(gen) = node.gens.remove(&epoch) {
                            node.frames.persistent_committed(JOB, gen);
                        }
                    }
                }
                node.taken.remove(&epoch);
            }
            PartAction::Restore { epoch, level, .. } => {
                let node = &mut self.nodes[i];
                match level {
                    Level::Memory => node.frames.abort(JOB, epoch),
                    Level::Persistent => {
                        if let Some(gen) = node.gens.remove(&epoch) {
                            node.frames.persistent_aborted(JOB, gen);
                        }
                    }
                }
                for p in node.taken.remove(&epoch).unwrap_or_default() {
                    if let Some(x) = node.mem.get_mut(&p) {
                        x.1 = true;
                    }
                }
            }
        }
    }

    /// Whether a page write or sync of node `i` reaches holder `h` and is taken there (paused
    /// holders are waited for before).
    fn write_reaches(&mut self, i: usize, h: usize) -> Result<(), String> {
        if h == i {
            return Ok(());
        }
        if !self.nodes[h].up {
            return Err(format!("{h} is down"));
        }
        if !self.both_ways(i, h) {
            return Err(format!("the link between {i} and {h} is cut"));
        }
        let inc = self.nodes[i].inc;
        if !self.takes(h, i, inc) {
            self.count(Counts::FENCED_DROPS);
            return Err(format!(
                "{h} drops the writes of incarnation {inc} of {i}: declared down"
            ));
        }
        self.check_not_fenced(h, i, inc, "a page write");
        Ok(())
    }

    /// One step of a participant's write: all pages to both copies, or the fsync.
    fn write_step(&mut self, i: usize) {
        if self.nodes[i].writes.is_empty() {
            return;
        }
        let k = self.rng.below(self.nodes[i].writes.len() as u64) as usize;
        let mut w = self.nodes[i].writes.swap_remove(k);
        // A paused holder takes nothing until it wakes: the write waits for it.
        let waits = match &w.stage {
            Stage::Taken => w.pages.iter().any(|&(p, _)| {
                [Role::Primary, Role::Mirror]
                    .into_iter()
                    .any(|role| self.paused(self.placement.holder(p.0, p.1, role).0 as usize))
            }),
            Stage::Written(targets) => targets.keys().any(|h| self.paused(h.0 as usize)),
        };
        if waits {
            self.nodes[i].writes.push(w);
            return;
        }
        if self.declared(i) {
            self.count(Counts::LATE_ACTS);
        }
        let result = match w.stage {
            // A memory round: each page to the pre-recovery copies of its two holders, or of
            // its primary holder and of its writer when that holds neither disk copy (its
            // mirror holder is told its copy goes); no disk.
            Stage::Taken if w.level == Level::Memory => {
                let mut r = Ok(());
                for &(p, val) in &w.pages {
                    let h1 = self.placement.holder(p.0, p.1, Role::Primary).0 as usize;
                    let h2 = self.placement.holder(p.0, p.1, Role::Mirror).0 as usize;
                    let targets = if i == h1 || i == h2 {
                        [(h1, Role::Primary, true), (h2, Role::Mirror, true)]
                    } else {
                        [(h1, Role::Primary, true), (i, Role::Mirror, true)]
                    };
                    let moved = (i != h1 && i != h2).then_some(h2);
                    if moved.is_some() {
                        self.count(Counts::WRITER_COPIES);
                    }
                    for (h, role, _) in targets {
                        if let Err(e) = self.write_reaches(i, h) {
                            r = Err(e);
                            continue;
                        }
                        let site = site_of(&self.placement, p.0, p.1, role, h as u32, i as u32)
                            .expect("the writer stores where the copies go");
                        let stored = self.nodes[h].frames.store_pre(
                            JOB,
                            w.epoch,
                            w.committed,
                            p.0,
                            role,
                            site,
                            &[p.1],
                            vec![val],
                        );
                        if let Err(e) = stored {
                            r = Err(e.to_string());
                        }
                    }
                    if let Some(h) = moved {
                        if let Err(e) = self.write_reaches(i, h) {
                            r = Err(e);
                            continue;
                        }
                        if let Err(e) = self.nodes[h].frames.store_moved(JOB, w.epoch, w.committed, p.0, &[p.1]) {
                            r = Err(e.to_string());
                        }
                    }
                }
                r
            }
            Stage::Taken => {
                let mut targets = BTreeMap::new();
                let mut failed = None;
                for &(p, val) in &w.pages {
                    for role in [Role::Primary, Role::Mirror] {
                        let h = self.placement.holder(p.0, p.1, role).0 as usize;
                        if let Err(e) = self.write_reaches(i, h) {
                            failed = Some(e);
                            continue;
                        }
                        let keep = self.page_gen(p);
                        if keep >= w.gen {
                            failed = Some(format!("{p:?} is at {keep}, the write at {}", w.gen));
                            continue;
                        }
                        assert!(
                            self.begun_gens.contains(&w.gen),
                            "a disk write at {} outside a cleaner",
                            w.gen
                        );
                        // A recovery copy held there is older: the round's flush spares it.
                        self.nodes[h].frames.storing(DiskWrite::Round, p.0, &[p.1], w.gen);
                        if let Err(e) = self.nodes[h].disk.write((p, role), w.gen, keep, val) {
                            failed = Some(e);
                            continue;
                        }
                        // Kept aside for a policy that keeps what a cleaner wrote.
                        self.nodes[h]
                            .frames
                            .stored(DiskWrite::Round, p.0, role, &[p.1], w.gen, vec![val]);
                        targets.insert(NodeId(h as u32), self.nodes[h].inc);
                    }
                }
                if failed.is_none() {
                    w.stage = Stage::Written(targets);
                    self.nodes[i].writes.push(w);
                    return;
                }
                Err(failed.unwrap_or_default())
            }
            Stage::Written(ref targets) => {
                let mut r = Ok(());
                for (&h, &inc) in targets {
                    let h = h.0 as usize;
                    if !(self.nodes[h].up && self.nodes[h].inc == inc) {
                        r = Err(format!("{h} restarted before its fsync"));
                    } else if let Err(e) = self.write_reaches(i, h) {
                        r = Err(e);
                    } else {
                        self.nodes[h].disk.sync();
                    }
                }
                r
            }
        };
        let epoch = w.epoch;
        let r = result.map(|()| {
            let mut runs: BTreeMap<FileId, Vec<(u64, u64)>> = BTreeMap::new();
            for (p, _) in &w.pages {
                runs.entry(p.0).or_default().push((p.1, p.1 + 1));
            }
            let runs = runs.into_iter().map(|(file, runs)| FileRuns { file, runs }).collect();
            (runs, w.pages.len() as u64 * 4096)
        });
        self.log(|| format!("write of {epoch} at {i}: {:?}", r.as_ref().map(|_| ())));
        self.nodes[i]
            .part
            .written(JOB, epoch, r.map_err(psls_ckpt::msg::Refusal::from));
    }

    /// A cleaner round's flush on node `i`: its recovery copies newer than the disks that the
    /// round did not overwrite go to its disk at `gen`, durably.
    fn flush(&mut self, i: usize, epoch: u64, gen: u64) {
        assert!(self.begun_gens.contains(&gen), "a flush at {gen} outside a cleaner");
        let todo = self.nodes[i].frames.to_flush(JOB, gen);
        let mut runs: BTreeMap<FileId, Vec<(u64, u64)>> = BTreeMap::new();
        let mut r = Ok(());
        let mut synced = BTreeSet::from([i]);
        for (file, role, indices, vals) in todo {
            for (idx, val) in indices.into_iter().zip(vals) {
                let p = (file, idx);
                let keep = self.page_gen(p);
                // The mirror copy of a page whose other copy is on its writer goes to the
                // mirror holder's disk.
                let h = self.placement.holder(file, idx, role).0 as usize;
                if h != i {
                    if let Err(e) = self.write_reaches(i, h) {
                        r = Err(e);
                        continue;
                    }
                    synced.insert(h);
                }
                self.nodes[h].frames.storing(DiskWrite::Flush, file, &[idx], gen);
                if let Err(e) = self.nodes[h].disk.write((p, role), gen, keep, val) {
                    r = Err(e);
                    continue;
                }
                self.nodes[h]
                    .frames
                    .stored(DiskWrite::Flush, file, role, &[idx], gen, vec![val]);
                runs.entry(file).or_default().push((idx, idx + 1));
            }
        }
        for h in synced {
            self.nodes[h].disk.sync();
        }
        let r = r.map(|()| {
            (
                runs.into_iter().map(|(file, runs)| FileRuns { file, runs }).collect(),
                0,
            )
        });
        self.log(|| format!("flush of {epoch} at {i}: {:?}", r.as_ref().map(|_| ())));
        self.nodes[i].part.flushed(JOB, epoch, r);
    }

    fn deliver(&mut self) {
        if self.net.is_empty() {
            return;
        }
        // What is sent to a paused node waits in its socket.
        let len = self.net.len();
        let start = self.rng.below(len as u64) as usize;
        let Some(k) = (0..len)
            .map(|d| (start + d) % len)
            .find(|&k| !self.paused(self.net[k].to.0 as usize))
        else {
            return;
        };
        let e = self.net.swap_remove(k);
        let (from, to) = (e.from.0 as usize, e.to.0 as usize);
        if !self.nodes[to].up || self.nodes[to].inc != e.to_inc {
            return;
        }
        if !self.takes(to, from, e.from_inc) {
            self.count(Counts::FENCED_DROPS);
            self.log(|| {
                format!(
                    "{from} -> {to}: dropped (incarnation {} declared down): {:?}",
                    e.from_inc, e.msg
                )
            });
            return;
        }
        self.check_not_fenced(to, from, e.from_inc, "a checkpoint message");
        self.log(|| format!("{} -> {}: {:?}", e.from, e.to, e.msg));
        if let Msg::Prepare {
            epoch,
            committed,
            cleaning,
            files,
            level,
            ..
        } = &e.msg
        {
            // A round from the coordinator settles a memory epoch whose decision this node
            // missed, and says the job's policy (the daemon's `CkptShell::receive`).
            if self.nodes[to].view == Some(from) {
                let frames = &mut self.nodes[to].frames;
                frames.settle_pre(JOB, *committed, *epoch);
                frames.set_policy(JOB, *cleaning);
                if *level == Level::Memory {
                    frames.mark_memory(JOB, files);
                }
            }
        }
        match e.msg {
            Msg::Prepare { .. } | Msg::Go { .. } | Msg::Decide { .. } | Msg::Flush { .. } => {
                let kind = match &e.msg {
                    Msg::Prepare { .. } => "prepare",
                    Msg::Go { .. } => "go",
                    Msg::Decide { .. } => "decision",
                    _ => "flush",
                };
                // What it had to do already (say, report its doubts to a new coordinator)
                // comes first.
                while let Some(a) = self.nodes[to].part.poll_action() {
                    self.part_action(to, a);
                }
                self.nodes[to].part.receive(e.from, e.msg);
                let acts: Vec<PartAction> = std::iter::from_fn(|| self.nodes[to].part.poll_action()).collect();
                if !acts.is_empty() {
                    // (c) A participant acts only on round messages of the node it believes
                    // coordinates.
                    assert_eq!(
                        self.nodes[to].view,
                        Some(from),
                        "(c) node {to} acted on a {kind} from node {from}, which it does not believe coordinates"
                    );
                }
                for a in acts {
                    self.part_action(to, a);
                }
            }
            _ => self.nodes[to].coord.receive(e.from, e.msg),
        }
    }

    /// Applies the next metadata operation (in order; one of a dead or deposed submitter may
    /// be lost), while the leader is awake and joined both ways to a majority.
    fn meta_step(&mut self) {
        let n = self.nodes.len();
        let Some(l) = self.leader.filter(|&l| self.awake(l)) else {
            return;
        };
        if (0..n).filter(|&j| self.awake(j) && self.both_ways(l, j)).count() <= n / 2 {
            return;
        }
        let Some(t) = self.queue.pop_front() else { return };
        let by = t.by.0 as usize;
        let alive = self.nodes[by].up && self.nodes[by].inc == t.inc;
        if (!alive || t.term < self.term) && self.rng.chance(300) {
            self.log(|| format!("lost: {:?}", t.task));
            if alive {
                self.answer_err(by, &t.task, "the operation was lost".into());
            }
            return;
        }
        // (c) One coordinator per term: only its leader's operations.
        assert_eq!(
            self.term_leaders.get(&t.term),
            Some(&(by, t.inc)),
            "(c) an operation of node {by} (incarnation {}) in term {}, which it did not lead",
            t.inc,
            t.term
        );
        let r = self.meta.apply(&t.op);
        self.log(|| format!("meta {:?}: {:?}", t.task, r));
        if r.is_ok() {
            match &t.op {
                MetaOp::Checkpoint { epoch, .. } => {
                    assert!(
                        *epoch > self.fence_applied,
                        "(b) checkpoint {epoch} committed after a rollback fenced every epoch up to {}",
                        self.fence_applied
                    );
                    assert_eq!(
                        self.round_lineage.get(&(*epoch, by, t.inc)),
                        Some(&self.lineage),
                        "checkpoint {epoch}, begun before a rollback, committed after it"
                    );
                    let img = self
                        .round_images
                        .get(&(*epoch, by, t.inc))
                        .cloned()
                        .expect("a committed round began here");
                    self.history.insert(*epoch, img);
                    self.count(Counts::COMMITS);
                }
                MetaOp::BeginCheckpoint { epoch, .. } => {
                    // (c) One round of an epoch begun.
                    let before = self.begun_by.insert(*epoch, (by, t.inc));
                    assert!(
                        before.is_none(),
                        "(c) epoch {epoch} begun for node {by} (incarnation {}) and before for {before:?}",
                        t.inc
                    );
                }
                MetaOp::FenceCheckpoint { epoch, .. } if matches!(t.task, Task::Rollback(_)) => {
                    self.fence_applied = self.fence_applied.max(*epoch);
                }
                _ => {}
            }
        }
        match t.task {
            Task::Rollback(id) => {
                let persistent = self.committed_epoch();
                if let Some(k) = self.restores.iter().position(|r| r.id == id) {
                    match r {
                        Ok(()) => {
                            let fenced = self.restores[k].fenced;
                            self.restores[k]
                                .machine
                                .handle_fenced(persistent, fenced)
                                .expect("the restore waits for its fence");
                        }
                        Err(e) => self.fail_restore(k, format!("the fence was refused: {e}")),
                    }
                }
            }
            Task::Job(op) => {
                if let Err(e) = r {
                    if alive {
                        let why = e.to_string();
                        self.nodes[by].control.handle_refused(JOB, &op, &why);
                    }
                }
            }
            Task::Declare { node, inc, paused, cut } => {
                if alive {
                    self.nodes[by].verdicts.handle_declared(NAMES[node]);
                }
                if r.is_ok() {
                    self.verdict(node, inc, paused, cut);
                }
            }
            _ if !alive => {}
            Task::Begin(epoch) => {
                let rec = self.meta.jobs.get(JOB).cloned().unwrap_or_default();
                let committed = rec.epoch.max(self.nodes[by].mem_committed);
                let res = match r {
                    Ok(()) if rec.started == epoch => {
                        self.begun_gens.insert(rec.started_gen);
                        Ok((rec.started_gen, self.meta.seq, committed))
                    }
                    _ => Err("not begun".into()),
                };
                self.local(by, Local::Begun(epoch, res));
            }
            Task::Commit(epoch) => self.local(by, Local::Committed(epoch, r.map_err(|e| e.to_string()))),
            Task::Fence(epoch) => {
                let d = self.meta.job_decided(JOB, epoch).ok_or_else(|| "undecided".to_string());
                self.local(by, Local::Fenced(epoch, d));
            }
        }
    }

    /// A verdict on incarnation `inc` of `node` is committed.
    fn verdict(&mut self, node: usize, inc: u64, paused: bool, cut: bool) {
        self.count(Counts::VERDICTS);
        if paused {
            self.count(Counts::VERDICTS_PAUSED);
        }
        if cut {
            self.count(Counts::VERDICTS_CUT);
        }
        self.log(|| format!("verdict: incarnation {inc} of {node} is down"));
        // A verdict on a node running the job's ranks: its memory is lost (it fences itself
        // when it learns it). Job control rolls the job back once it sees the verdict.
        if self.nodes[node].up && self.nodes[node].inc == inc {
            self.break_memory();
            if paused {
                self.rollback_after_pause = true;
            }
        }
        // The coordinator knows at once (if the verdict is on itself, it fences itself); the
        // others when they hear it, or a peer.
        if let Some(l) = self.leader {
            self.learn_committed(l);
        }
    }

    // ---- failures ----

    fn crash(&mut self, i: usize) {
        if !self.nodes[i].up {
            return;
        }
        self.log(|| format!("crash {i}"));
        let Node { disk, .. } = &mut self.nodes[i];
        let mut rng = SplitMix64::new(self.rng.next_u64());
        disk.crash(&mut rng);
        let disk = std::mem::take(&mut self.nodes[i].disk);
        let inc = self.nodes[i].inc;
        self.nodes[i] = Node {
            up: false,
            disk,
            ..Node::new(self.frame_capacity, self.nodes.len(), i, inc)
        };
        // Messages from the dead node may still arrive, or not.
        if self.rng.chance(500) {
            self.net.retain(|e| e.from.0 as usize != i);
        }
        for k in (0..self.nodes.len()).filter(|&k| k != i) {
            self.local(k, Local::NodeDown(NodeId(i as u32)));
        }
        if self.leader == Some(i) {
            self.leader = None;
        }
        // The job's memory there is lost. Job control rolls the job back once it sees the
        // node gone (declared down, or back as a new incarnation).
        self.break_memory();
    }

    /// The detector suspects node `i` while it runs (its heartbeats were late): the
    /// coordinator declares it down, or, if it is the coordinator, the others elect another,
    /// which does.
    fn suspect(&mut self, i: usize) {
        if !self.awake(i) || self.declared(i) {
            return;
        }
        self.log(|| format!("{i} suspected while it runs"));
        if self.leader == Some(i) {
            let candidates: Vec<usize> = (0..self.nodes.len())
                .filter(|&j| j != i && self.awake(j) && !self.declared(j))
                .collect();
            self.elect_among(&candidates, Some(i));
        } else if let Some(l) = self.acting() {
            // Its silence is over the timeout as the coordinator sees it.
            self.heard_by_leader[i] = self.now_ms.saturating_sub(TIMEOUT_MS + 1);
            let suspect = vec![(NAMES[i].to_string(), self.nodes[i].inc)];
            self.declare(l, suspect);
        }
    }

    fn restart(&mut self, i: usize) {
        if self.nodes[i].up {
            return;
        }
        let inc = self.nodes[i].inc + 1;
        let disk = std::mem::take(&mut self.nodes[i].disk);
        // Its coordinator and participant are a new incarnation too.
        self.nodes[i] = Node {
            disk,
            ..Node::new(self.frame_capacity, self.nodes.len(), i, inc)
        };
        self.log(|| format!("restart {i}"));
        // It joins through the coordinator.
        self.install(i);
    }

    /// Node `i` stops the job's ranks of start `attempt` or before (a later start's stay: the
    /// order came late), and drops what they held.
    fn stop_node(&mut self, i: usize, attempt: u32) {
        if self.nodes[i].ranks.is_some_and(|a| a > attempt) {
            return;
        }
        self.nodes[i].ranks = None;
        self.drop_pages(i);
    }

    /// Node `i` drops the job's pages and abandons its round.
    fn drop_pages(&mut self, i: usize) {
        let m = &mut self.nodes[i];
        m.mem.clear();
        m.taken.clear();
        m.took.clear();
        m.part.forget(JOB);
    }

    /// A crash or a verdict lost some of the job's memory: what the nodes hold is not the
    /// job's any more, and no restore under way restores it whole.
    fn break_memory(&mut self) {
        if !self.meta.runs.contains_key(JOB) {
            return; // nothing ran yet: nothing is lost
        }
        self.broken = true;
    }

    /// Whether coordinator `ci` reaches node `i` for a step of a restore: awake, not declared
    /// down, its ranks stopped, joined both ways and knowing who coordinates.
    fn restore_reaches(&self, ci: usize, i: usize) -> bool {
        self.awake(i)
            && !self.declared(i)
            && !self.nodes[i].inbox.iter().any(|e| matches!(e, Local::Stop(_)))
            && self.both_ways(ci, i)
            && self.nodes[i].view == Some(ci)
    }

    // ---- job control ----

    /// The nodes as the heartbeats show them to coordinator `l`.
    fn views(&self, l: usize) -> BTreeMap<String, NodeView> {
        (0..self.nodes.len())
            .map(|j| {
                let heard = j == l || self.now_ms.saturating_sub(self.heard_by_leader[j]) <= TIMEOUT_MS;
                let live = self.nodes[j].up
                    && heard
                    && !self.declared(j)
                    && self.nodes[l].verdicts.accepts(NAMES[j], self.nodes[j].inc);
                let view = NodeView {
                    live,
                    incarnation: self.nodes[j].inc,
                    declared_down: self.declared(j),
                    disk_failed: false,
                };
                (NAMES[j].to_string(), view)
            })
            .collect()
    }

    /// Job control on every awake node, as the daemon runs it: each reads the committed
    /// metadata; the coordinator drives (the daemon's driver is its metadata log's leader
    /// holding its lease: here, the acting coordinator), with the time and the nodes as its
    /// heartbeats show them. The job's client sends its launch until it is answered.
    fn control_step(&mut self) {
        let acting = self.acting();
        let now = self.now_ms;
        for (i, inc, term, attempt, done) in std::mem::take(&mut self.outcomes) {
            if self.nodes[i].up && self.nodes[i].inc == inc {
                self.nodes[i].control.handle_done(term, JOB, attempt, done);
            }
        }
        for i in 0..self.nodes.len() {
            if !self.awake(i) {
                continue;
            }
            if self.nodes[i].control_seq != Some(self.meta.seq) {
                self.nodes[i].control_seq = Some(self.meta.seq);
                let st = self.meta.clone();
                self.nodes[i].control.handle_meta(&st);
            }
            let lead = (acting == Some(i)).then_some(self.term);
            self.nodes[i].control.handle_lead(lead);
            if lead.is_some() {
                let views = self.views(i);
                self.nodes[i].control.handle_tick(now, now, &views);
                if !self.launched
                    && self
                        .launch_sent_ms
                        .is_none_or(|t| now >= t + control::Config::default().retry_ms)
                {
                    self.launch_sent_ms = Some(now);
                    let spec = JobSummary {
                        program: "sim".into(),
                        ranks: self.nodes.len() as u32,
                        per_node: Some(1),
                        max_restarts: u32::MAX,
                        respawn_timeout_ms: 3_600_000,
                        ..JobSummary::default()
                    };
                    let launch = Command::Launch {
                        job: JOB.into(),
                        spec: Box::new(spec),
                        options: Box::default(),
                        env: Vec::new(),
                        hosts: Vec::new(),
                        stdin: false,
                    };
                    self.nodes[i].control.handle_command(1, launch);
                }
            }
            while let Some(a) = self.nodes[i].control.poll_action() {
                self.control_action(i, a);
            }
        }
    }

    /// Node `i` carries out what its job control asks, as `psls-node`'s `jobctl` does.
    fn control_action(&mut self, i: usize, a: Action) {
        self.log(|| format!("job control at {i}: {a:?}"));
        match a {
            Action::Submit { op, .. } => self.submit(i, op.clone(), Task::Job(op)),
            Action::Spawn { physical, attempt, .. } => {
                // A call to the node: it starts the ranks its records place on it.
                let t = node_index(&physical);
                if !self.awake(t) || !self.both_ways(i, t) || !self.nodes[t].inbox.is_empty() {
                    return;
                }
                let inc = self.nodes[t].inc;
                let Ok(ranks) = psls_jobs::local::ranks_here(&self.meta, JOB, attempt, Some(t as u32), &physical, inc)
                else {
                    return;
                };
                if ranks.is_empty() {
                    return;
                }
                if self.nodes[t].ranks.is_none_or(|a| a < attempt) {
                    self.log(|| format!("{t} starts its ranks of start {attempt}"));
                    self.nodes[t].ranks = Some(attempt);
                }
                let report = Report {
                    job: JOB.into(),
                    attempt,
                    running: ranks,
                    exited: Vec::new(),
                    blamed: Vec::new(),
                };
                self.nodes[i].control.handle_report(&physical, inc, &report);
            }
            Action::StopRanks { attempt, nodes, .. } => {
                // A call to each node: one that is paused, or whose link is cut, does not
                // answer; the order waits in its socket if it got there.
                let mut answered = Vec::new();
                for p in nodes {
                    let t = node_index(&p);
                    if !self.nodes[t].up {
                        continue;
                    }
                    if self.awake(t) && self.both_ways(i, t) && self.nodes[t].inbox.is_empty() {
                        self.stop_node(t, attempt);
                        answered.push(p);
                    } else if self.link(i, t) {
                        self.nodes[t].inbox.push_back(Local::Stop(attempt));
                    }
                }
                let inc = self.nodes[i].inc;
                let term = self.term;
                self.outcomes
                    .push((i, inc, term, attempt, Done::Stopped { nodes: answered }));
            }
            Action::Restore { attempt, .. } => {
                let nodes: Vec<(u32, String)> = (0..self.nodes.len())
                    .map(|k| (k as u32, NAMES[k].to_string()))
                    .collect();
                self.restores_begun += 1;
                let r = Restoring {
                    id: self.restores_begun,
                    by: i,
                    inc: self.nodes[i].inc,
                    term: self.term,
                    attempt,
                    machine: Restore::new(JOB, &nodes, &self.file_ids(), false),
                    next: None,
                    fenced: 0,
                    asked: BTreeMap::new(),
                };
                self.restores.push(r);
            }
            Action::Answer { answer, .. } => {
                if matches!(answer, control::Answer::Started { .. }) {
                    self.launched = true;
                }
            }
            other => panic!("job control asked {other:?}: this simulator's job never ends and has no spare"),
        }
    }

    /// Restore `k` failed: its driver's job control hears so, and does the pass again.
    fn fail_restore(&mut self, k: usize, why: String) {
        let r = self.restores.remove(k);
        self.log(|| format!("restore {} by {} fails: {why}", r.id, r.by));
        if self.nodes[r.by].up && self.nodes[r.by].inc == r.inc {
            let done = Done::Restored(Err(StepError::Unavailable(why)));
            self.nodes[r.by].control.handle_done(r.term, JOB, r.attempt, done);
        }
    }

    /// A restore under way takes a few steps, as the daemon carries it out
    /// (`recovery::restore`): the real [`Restore`] machine orders them, each a call to one node
    /// that fails if the node is not there (and the restore with it: job control asks again).
    /// A restore whose driver is paused waits; one whose driver crashed or does not
    /// coordinate any more fails.
    fn rollback_step(&mut self) {
        if self.restores.is_empty() {
            return;
        }
        let id = self.restores[self.rng.below(self.restores.len() as u64) as usize].id;
        let calls = 1 + self.rng.below(6);
        for _ in 0..calls {
            let Some(k) = self.restores.iter().position(|r| r.id == id) else {
                return;
            };
            if !self.restore_call(k) {
                return;
            }
        }
    }

    /// The next step of restore `k`; false if it is over, failed or waits.
    fn restore_call(&mut self, k: usize) -> bool {
        let (ci, id) = (self.restores[k].by, self.restores[k].id);
        if self.paused(ci) {
            return false;
        }
        if !psls_jobs::local::rolling_back(&self.meta, JOB, self.restores[k].attempt) {
            self.fail_restore(k, "the job moved on".into());
            return false;
        }
        if self.acting() != Some(ci) || self.nodes[ci].inc != self.restores[k].inc || self.restores[k].term != self.term
        {
            self.fail_restore(k, "its driver does not coordinate any more".into());
            return false;
        }
        let a = {
            let r = &mut self.restores[k];
            r.next.take().or_else(|| r.machine.poll_action())
        };
        let Some(a) = a else { return false };
        self.log(|| format!("restore {id} by {ci}: {a:?}"));
        let node = |name: &str| node_index(name);
        let unreachable = |p: &str| format!("{p} does not answer");
        let answered = match a {
            RestoreAction::AskState { logical, node: p } => {
                let i = node(&p);
                if !self.restore_reaches(ci, i) {
                    self.fail_restore(k, unreachable(&p));
                    return false;
                }
                let inc = self.nodes[i].inc;
                self.restores[k].asked.insert(i, inc);
                let m = self.nodes[i].frames.job(JOB);
                let state = NodeState {
                    committed: m.committed,
                    pre: m.pre,
                    seen: self.nodes[i].part.seen(JOB),
                    files: Vec::new(),
                };
                self.restores[k].machine.handle_state(logical, &p, state)
            }
            RestoreAction::Fence { seen } => {
                if self.nodes[ci].coord.busy(JOB) {
                    // A round of its own is deciding: the fence waits for its end.
                    self.restores[k].next = Some(RestoreAction::Fence { seen });
                    return false;
                }
                let epoch = psls_ckpt::frames::fence_epoch(self.meta.job_floor(JOB), self.nodes[ci].started, seen);
                self.nodes[ci].mem_committed = 0;
                self.nodes[ci].mem_learned_term = 0;
                self.restores[k].fenced = epoch;
                self.submit(
                    ci,
                    MetaOp::FenceCheckpoint { job: JOB.into(), epoch },
                    Task::Rollback(id),
                );
                // It waits for the fence.
                return false;
            }
            RestoreAction::Settle {
                node: p,
                target,
                fenced,
                persistent,
                ..
            } => {
                let i = node(&p);
                if !self.restore_reaches(ci, i) {
                    self.fail_restore(k, unreachable(&p));
                    return false;
                }
                self.nodes[i].frames.settle(JOB, target, fenced, persistent);
                self.restores[k].machine.handle_settled(&p)
            }
            RestoreAction::Recreate { node: p, target, lost } => {
                let h = node(&p);
                if !self.restore_reaches(ci, h) {
                    self.fail_restore(k, unreachable(&p));
                    return false;
                }
                // The survivor sends what the nodes that lost theirs held (the daemon's
                // `FramesReq::Recreate`).
                let copies = match self.nodes[h]
                    .frames
                    .copies_for_lost(JOB, target, &lost, &self.placement, h as u32)
                {
                    Ok(c) => c,
                    Err(e) => {
                        self.fail_restore(k, e.to_string());
                        return false;
                    }
                };
                for ((o, file, _), pages) in copies {
                    let writers = pages.iter().filter(|(_, f)| f.site != Site::Holder).count();
                    self.counts.0[Counts::WRITER_RECREATIONS] += writers as u64;
                    // Refused only by a lost node that restarted since it was settled (its
                    // copies fit where they were).
                    if let Err(e) = self.nodes[o.0 as usize].frames.install(JOB, file, pages) {
                        assert!(matches!(e, FrameError::Restarted(_)), "{e}");
                        self.count(Counts::REFUSED_RECREATIONS);
                        self.fail_restore(k, e.to_string());
                        return false;
                    }
                }
                self.restores[k].machine.handle_recreated(&p)
            }
            RestoreAction::Adopt { node: p, target } => {
                let i = node(&p);
                if !self.restore_reaches(ci, i) {
                    self.fail_restore(k, unreachable(&p));
                    return false;
                }
                if let Err(e) = self.nodes[i].frames.adopt(JOB, target) {
                    self.fail_restore(k, e.to_string());
                    return false;
                }
                self.restores[k].machine.handle_adopted(&p)
            }
            RestoreAction::Drop { node: p, .. } => {
                let i = node(&p);
                if !self.restore_reaches(ci, i) {
                    self.fail_restore(k, unreachable(&p));
                    return false;
                }
                self.drop_pages(i);
                self.restores[k].machine.handle_dropped(&p, &[])
            }
            RestoreAction::Serve { node: p, .. } => {
                let i = node(&p);
                if !self.restore_reaches(ci, i) {
                    self.fail_restore(k, unreachable(&p));
                    return false;
                }
                // It takes part again: it knows who coordinates and every committed verdict.
                self.install(i);
                self.restores[k].machine.handle_served(&p)
            }
            RestoreAction::Prefetch { .. } => self.restores[k].machine.handle_prefetched(),
            RestoreAction::Done {
                epoch: target,
                memory,
                persistent,
                lost,
                ..
            } => {
                self.finish_rollback(k, target, memory, persistent, lost);
                return false;
            }
        };
        answered.expect("the simulator answers what the restore asked");
        true
    }

    /// Restore `k` is over: the job's memory is back at checkpoint `target` (unless a failure
    /// overtook it), and its driver's job control hears so.
    fn finish_rollback(&mut self, k: usize, target: u64, memory: u64, persistent: u64, lost: Vec<u32>) {
        let r = self.restores.remove(k);
        // A node it asked that crashed, restarted or was declared down since lost (or will
        // lose) the memory it restored.
        let overtaken = r
            .asked
            .iter()
            .any(|(&i, &inc)| !self.nodes[i].up || self.nodes[i].inc != inc || self.declared(i));
        self.lineage += 1;
        if memory > 0 {
            self.count(Counts::MEMORY_ROLLBACKS);
        }
        self.app = self
            .history
            .get(&target)
            .or_else(|| self.memory_images.get(&target))
            .cloned()
            .unwrap_or_else(|| panic!("no image of checkpoint {target}"));
        self.broken = overtaken;
        self.count(Counts::ROLLBACKS);
        if std::mem::take(&mut self.rollback_after_pause) {
            self.count(Counts::PAUSE_ROLLBACKS);
        }
        self.log(|| {
            format!(
                "restore {} rolled back to {target} (memory {memory}, persistent {persistent}, lost {lost:?}, overtaken {})",
                r.id, overtaken
            )
        });
        // Every page as the job now sees it: the restored checkpoint, bit for bit.
        if !overtaken && self.nodes.iter().all(|n| n.up) {
            assert_eq!(self.image(), self.app, "after the rollback to {target}");
        }
        if self.nodes[r.by].up && self.nodes[r.by].inc == r.inc {
            self.nodes[r.by]
                .control
                .handle_done(r.term, JOB, r.attempt, Done::Restored(Ok(target)));
        }
    }

    // ---- invariants ----

    fn check(&self) {
        let epoch = self.committed_epoch();
        let want = &self.history[&epoch];
        for p in self.pages() {
            let gen = self.page_gen(p);
            if gen == 0 {
                assert_eq!(want[&p], 0, "page {p:?} never written but checkpoint {epoch} has it");
                continue;
            }
            for role in [Role::Primary, Role::Mirror] {
                let h = self.placement.holder(p.0, p.1, role).0 as usize;
                if !self.nodes[h].up {
                    continue;
                }
                let got = self.nodes[h].disk.read((p, role), gen);
                assert_eq!(
                    got,
                    Some(want[&p]),
                    "{role:?} copy of {p:?} at node {h}: committed generation {gen} of checkpoint {epoch}"
                );
            }
        }
        // The last memory checkpoint committed, if newer than the disks': both recovery copies
        // of every page it holds that differs from them.
        let memory = self
            .nodes
            .iter()
            .filter(|n| n.up)
            .map(|n| n.frames.job(JOB).committed)
            .max()
            .unwrap_or(0);
        if !self.broken && memory > epoch {
            let img = &self.memory_images[&memory];
            for p in self.pages() {
                if img[&p] == want[&p] {
                    continue;
                }
                // Its primary holder and one other node (the mirror holder or its writer).
                let holds = |h: usize| {
                    let n = &self.nodes[h];
                    let cur = n.frames.read(p.0, p.1).copied();
                    let pre = n
                        .frames
                        .read_pre(p.0, p.1)
                        .filter(|f| f.epoch == memory)
                        .map(|f| f.data);
                    n.up && (cur == Some(img[&p]) || pre == Some(img[&p]))
                };
                let h1 = self.placement.holder(p.0, p.1, Role::Primary).0 as usize;
                assert!(
                    holds(h1),
                    "primary recovery copy of {p:?} at node {h1} after memory checkpoint {memory}: not {}",
                    img[&p]
                );
                let others: Vec<usize> = (0..self.nodes.len()).filter(|&h| h != h1 && holds(h)).collect();
                assert!(
                    !others.is_empty(),
                    "{p:?} has one recovery copy (at {h1}) after memory checkpoint {memory}"
                );
                // The mirror holder, once it heard the checkpoint commit, holds no older copy.
                let h2 = self.placement.holder(p.0, p.1, Role::Mirror).0 as usize;
                let stale = self.nodes[h2].frames.read(p.0, p.1).filter(|v| **v != img[&p]);
                assert!(
                    stale.is_none() || self.nodes[h2].frames.job(JOB).committed < memory,
                    "the mirror holder {h2} of {p:?} keeps {stale:?} after memory checkpoint {memory} ({})",
                    img[&p]
                );
            }
        }
        // While the job runs, what it sees is what it wrote since the restored checkpoint.
        if !self.broken {
            for (p, val) in self.nodes.iter().filter(|n| n.up).flat_map(|n| n.mem.iter()) {
                assert_eq!(val.0, self.app[p], "memory copy of {p:?}");
            }
        }
    }

    fn step(&mut self) {
        self.observe();
        self.hear_leader();
        self.control_step();
        match self.rng.below(100) {
            0..=14 if self.app_runs() => self.app_write(),
            15..=19 if self.app_runs() => self.app_read(),
            20..=24 => self.start_round(None),
            25..=46 => self.deliver(),
            47..=49 => self.local_or_deliver(),
            50..=61 => self.meta_step(),
            62..=75 => {
                let i = self.rng.below(self.nodes.len() as u64) as usize;
                if self.awake(i) {
                    self.write_step(i);
                }
            }
            76..=85 => {
                let ms = self.rng.below(2 * TIMEOUT_MS / 3);
                self.advance(ms);
            }
            86..=88 => self.rollback_step(),
            89 if self.rng.chance(150) => {
                let i = self.rng.below(self.nodes.len() as u64) as usize;
                self.crash(i);
                if self.rng.chance(150) {
                    let j = self.rng.below(self.nodes.len() as u64) as usize;
                    self.crash(j);
                }
            }
            90 if self.rng.chance(40) => {
                self.log(|| "power cut".into());
                for i in 0..self.nodes.len() {
                    self.crash(i);
                }
            }
            91..=93 => {
                let i = self.rng.below(self.nodes.len() as u64) as usize;
                self.restart(i);
            }
            94 if self.rng.chance(300) => {
                // Most often the coordinator: the one whose round may go on.
                let i = match self.leader {
                    Some(c) if self.rng.chance(700) => c,
                    _ => self.rng.below(self.nodes.len() as u64) as usize,
                };
                self.suspect(i);
            }
            95 if self.rng.chance(500) => self.pause(),
            96 if self.rng.chance(500) => self.cut(),
            97 | 98 => self.heartbeat(),
            _ => {}
        }
        self.run_actions();
        self.check();
    }

    /// One step of the calm phase: everything that can progress does.
    fn calm_step(&mut self) {
        self.observe();
        // Heartbeats tell a declared node its verdict (it rejoins as a new incarnation), also
        // while no coordinator is there to install it.
        for _ in 0..self.nodes.len() {
            self.heartbeat();
        }
        for i in 0..self.nodes.len() {
            if self.awake(i) {
                self.install(i);
            }
        }
        self.control_step();
        self.rollback_step();
        self.deliver();
        while self.local_step() {}
        self.meta_step();
        for i in 0..self.nodes.len() {
            if self.awake(i) {
                self.write_step(i);
            }
        }
        self.advance(100);
        self.run_actions();
        self.check();
    }

    /// Everything up and awake, links whole, messages and operations drained: the job must be
    /// able to checkpoint.
    fn calm(&mut self) {
        self.cut_until_ms.clear();
        for i in 0..self.nodes.len() {
            self.nodes[i].paused_until_ms = self.nodes[i].paused_until_ms.min(self.now_ms);
            self.restart(i);
        }
        for _ in 0..20_000 {
            let drained = self.queue.is_empty() && self.net.is_empty() && self.nodes.iter().all(|n| n.inbox.is_empty());
            if self.app_runs() && drained {
                break;
            }
            self.calm_step();
        }
        assert!(
            self.app_runs(),
            "the job never resumed (memory broken {}, its start {:?}, ranks {:?})",
            self.broken,
            self.meta.runs.get(JOB),
            self.nodes.iter().map(|n| n.ranks).collect::<Vec<_>>()
        );
        self.app_write();
        let before = self.committed_epoch();
        self.start_round(Some(Level::Persistent));
        self.run_actions();
        for _ in 0..20_000 {
            if self.committed_epoch() > before && self.app_runs() {
                break;
            }
            // A round refused for an epoch a participant saw already: again, above it.
            if self.acting().is_some_and(|c| !self.nodes[c].coord.busy(JOB)) {
                self.start_round(Some(Level::Persistent));
            }
            self.calm_step();
        }
        assert!(self.committed_epoch() > before, "no checkpoint committed in the calm");
        assert_eq!(self.image(), self.app);
    }
}

fn run(seed: u64) -> Counts {
    let mut w = World::new(seed);
    for _ in 0..STEPS {
        w.step();
    }
    w.calm();
    let writes: u64 = w.nodes.iter().map(|n| n.disk.writes).sum();
    // A persistent checkpoint of pages wrote them.
    assert!(writes > 0 || w.persistent_pages == 0);
    w.counts
}

#[test]
fn checkpoints_and_rollbacks_keep_exactly_one_checkpoint_on_the_disks() {
    let mut total = Counts::default();
    let seeds = common::seeds(10_000);
    let seeds_run = seeds.end - seeds.start;
    for seed in seeds {
        let r = std::panic::catch_unwind(|| run(seed));
        match r {
            Ok(counts) => {
                for (t, c) in total.0.iter_mut().zip(counts.0) {
                    *t += c;
                }
            }
            Err(e) => {
                eprintln!(
                    "checkpoint simulator failed at seed {seed} (PSLS_SIM_SEED={seed} PSLS_SIM_TRACE=1 to replay)"
                );
                std::panic::resume_unwind(e);
            }
        }
    }
    let said: Vec<String> = COUNTED
        .iter()
        .zip(total.0)
        .map(|(what, c)| format!("{c} {what}"))
        .collect();
    println!("{}", said.join("; "));
    // Every kind of step happened (a single seed need not have them all); the rare ones only
    // over runs long enough to have them: a writer's copy re-created (about 1 seed in 100), a
    // lost node restarting between its settle and its copies' re-creation (about 1 in 10,000).
    let needs = |k: usize| match k {
        Counts::WRITER_RECREATIONS => 2_000,
        Counts::REFUSED_RECREATIONS => 50_000,
        _ => 100,
    };
    for (k, (what, c)) in COUNTED.iter().zip(total.0).enumerate() {
        assert!(c > 0 || seeds_run < needs(k), "no {what} over the seeds run");
    }
}
