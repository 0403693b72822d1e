//! Seeded simulator of memory and persistent checkpoints and rollback: 3–5 nodes, one job
//! writing two files through the nodes' memories, the real coordinator and participant state
//! machines, the real recovery-copy tables (`FrameTable`, with a capacity that a round may
//! exceed) and the real memory level of a rollback (`rollback_target`), the real metadata
//! operations (`MetaState::apply`: begin, commit record, fence), and disks with two slots per
//! page copy that lose or tear unsynced writes in a crash. Rounds are memory or persistent at
//! random; a persistent one flushes the recovery copies newer than the disks. Messages are
//! delayed and reordered; nodes crash at any step (the coordinator mid-round, a participant
//! mid-write or mid-sync, two at once, every node in a power cut) and come back, or are
//! declared down while they run on (a coordinator that goes on with its round until it is
//! fenced); metadata operations of a dead coordinator may still be applied later, in order,
//! or never.
//!
//! A crash rolls the job back (the shape the daemon follows): once every node is up and no
//! round is deciding, the coordinator fences every epoch begun or seen so far, and when the
//! fence is applied, the job returns to the newest memory checkpoint a node committed if it
//! is newer than the committed persistent one and no page lost both recovery copies, else to
//! the persistent one (memories dropped, recovery copies settled and re-created on the nodes
//! that lost theirs, the pages reloaded from recovery copies or the disks).
//!
//! Checked after every step:
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
//!   restored checkpoint, bit for bit, and no checkpoint begun before it ever commits.
//!
//! Each seed ends with a calm phase: every node up, a write, a round that must commit.
//! `PSLS_SIM_SEED=N` runs one seed, `PSLS_SIM_SEEDS=N` seeds 0..N, `PSLS_SIM_TRACE=1` prints
//! every step.

mod common;

use psls_ckpt::cleaning::Policy;
use psls_ckpt::frames::{rollback_target, FrameTable};
use psls_ckpt::msg::Level;
use psls_ckpt::{CoordAction, Coordinator, Msg, Outcome, PartAction, Participant};
use psls_pfs::jobs::FileRuns;
use psls_pfs::meta::{FileMeta, MetaOp, MetaState};
use psls_pfs::{Placement, Role};
use psls_svm::rng::SplitMix64;
use psls_svm::{FileId, NodeId};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

const JOB: &str = "j";
const STEPS: usize = 600;
const TIMEOUT_MS: u64 = 5_000;

type Page = (FileId, u64);
/// The bytes of every page, as a value per page (0: zeros).
type Image = BTreeMap<Page, u64>;

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

struct Node {
    up: bool,
    /// Declared down by the others while it still runs (a false suspicion): it goes on acting
    /// on what it knew — a coordinator may still submit its round's operations — until it is
    /// fenced (restarted with a new incarnation and an empty memory).
    zombie: bool,
    inc: u64,
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
    /// As coordinator: the last memory epoch it committed.
    mem_committed: u64,
}

impl Node {
    fn new(frame_capacity: u64) -> Node {
        Node {
            up: true,
            zombie: false,
            inc: 1,
            disk: Disk::default(),
            part: Participant::new(1),
            coord: Coordinator::new(TIMEOUT_MS, 1),
            mem: BTreeMap::new(),
            taken: BTreeMap::new(),
            took: BTreeMap::new(),
            writes: Vec::new(),
            started: 0,
            frames: FrameTable::new(frame_capacity),
            gens: BTreeMap::new(),
            mem_committed: 0,
        }
    }
}

#[derive(Debug)]
enum Task {
    Begin(u64),
    Commit(u64),
    Fence(u64),
    /// The fence of a rollback (its number: only the last one submitted completes it).
    Rollback(u64),
}

struct MetaTask {
    op: MetaOp,
    by: NodeId,
    inc: u64,
    task: Task,
}

struct Envelope {
    from: NodeId,
    to: NodeId,
    to_inc: u64,
    msg: Msg,
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
    /// The image when each round began (its checkpoint's contents).
    round_images: BTreeMap<u64, Image>,
    /// The job's pages as it sees them (its writes since the restored checkpoint).
    app: Image,
    next_val: u64,
    /// A crash happened: the job is stopped until a rollback completes (`Some(true)`: its
    /// fence is submitted).
    rollback: Option<bool>,
    /// Rollback fences submitted.
    fences: u64,
    /// Rollbacks completed: the job's run since the last one, and the run each round began in
    /// (a checkpoint of a run rolled back must never commit).
    lineage: u64,
    round_lineage: BTreeMap<u64, u64>,
    rollbacks: u64,
    commits: u64,
    memory_commits: u64,
    /// Rollbacks that returned to a memory checkpoint.
    memory_rollbacks: u64,
    /// Rounds that let the ranks go on before their decision, and the job's writes made while
    /// such a round was still deciding.
    releases: u64,
    early_writes: u64,
    /// Pages the persistent checkpoints that finished committed said they kept.
    persistent_pages: u64,
    trace: bool,
    /// Frames a node may hold.
    frame_capacity: u64,
    /// The job's cleaning policy: which recovery copies stay after a cleaner checkpoint.
    cleaning: Policy,
    /// Generations the metadata began: the only ones a disk write may carry.
    begun_gens: BTreeSet<u64>,
    /// The epoch the last rollback fenced.
    fenced: u64,
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
        World {
            rng,
            now_ms: 0,
            nodes: (0..n).map(|_| Node::new(frame_capacity)).collect(),
            placement,
            files,
            meta,
            queue: VecDeque::new(),
            net: Vec::new(),
            history: BTreeMap::from([(0, app.clone())]),
            round_images: BTreeMap::new(),
            app,
            next_val: 1,
            rollback: None,
            fences: 0,
            lineage: 0,
            round_lineage: BTreeMap::new(),
            rollbacks: 0,
            commits: 0,
            memory_commits: 0,
            memory_rollbacks: 0,
            releases: 0,
            early_writes: 0,
            persistent_pages: 0,
            trace: std::env::var("PSLS_SIM_TRACE").is_ok(),
            frame_capacity,
            cleaning,
            begun_gens: BTreeSet::new(),
            fenced: 0,
        }
    }

    fn log(&self, what: impl FnOnce() -> String) {
        if self.trace {
            println!("[{}] {}", self.now_ms, what());
        }
    }

    fn coordinator(&self) -> Option<NodeId> {
        (0..self.nodes.len())
            .find(|&i| self.nodes[i].up && !self.nodes[i].zombie)
            .map(|i| NodeId(i as u32))
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

    /// Whether the job's ranks run: not at a safe point in a round, not stopped for a rollback,
    /// and every node up (the ranks of a failed node restart when it is back).
    fn app_runs(&self) -> bool {
        self.rollback.is_none()
            && self
                .nodes
                .iter()
                .all(|n| n.up && !n.zombie && (!n.coord.busy(JOB) || n.coord.released(JOB)))
    }

    // ---- the job ----

    fn app_write(&mut self) {
        let n = self.rng.below(self.nodes.len() as u64) as usize;
        if !self.nodes[n].up {
            return;
        }
        let pages = self.pages();
        let p = pages[self.rng.below(pages.len() as u64) as usize];
        let val = self.next_val;
        self.next_val += 1;
        // Write access: every other copy goes (with its dirty bit); this one is dirty.
        for m in &mut self.nodes {
            m.mem.remove(&p);
        }
        self.nodes[n].mem.insert(p, (val, true));
        self.app.insert(p, val);
        if self.nodes.iter().any(|m| m.coord.busy(JOB)) {
            self.early_writes += 1;
        }
        self.log(|| format!("write {p:?} = {val} at {n}"));
    }

    fn app_read(&mut self) {
        let n = self.rng.below(self.nodes.len() as u64) as usize;
        if !self.nodes[n].up {
            return;
        }
        let pages = self.pages();
        let p = pages[self.rng.below(pages.len() as u64) as usize];
        if self.nodes[n].mem.contains_key(&p) {
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
        let Some(c) = self.coordinator() else { return };
        if !self.app_runs() {
            return;
        }
        let ci = c.0 as usize;
        let level = level.unwrap_or(if self.rng.chance(600) {
            Level::Memory
        } else {
            Level::Persistent
        });
        let epoch = self
            .meta
            .job_floor(JOB)
            .max(self.nodes[ci].started)
            .max(self.nodes[ci].coord.seen(JOB))
            + 1;
        let all: BTreeSet<NodeId> = (0..self.nodes.len()).map(|i| NodeId(i as u32)).collect();
        let files = self.file_ids();
        let now = self.now_ms;
        let committed = self.committed_epoch().max(self.nodes[ci].mem_committed);
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
            self.round_images.insert(epoch, img);
            self.round_lineage.insert(epoch, self.lineage);
            self.log(|| format!("{level} round {epoch} starts at {ci}"));
        }
    }

    fn run_actions(&mut self) {
        for _ in 0..10_000 {
            let mut any = false;
            for i in 0..self.nodes.len() {
                if !self.nodes[i].up {
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
        let to_inc = self.nodes[to.0 as usize].inc;
        self.net.push(Envelope {
            from: NodeId(from as u32),
            to,
            to_inc,
            msg,
        });
    }

    fn submit(&mut self, by: usize, op: MetaOp, task: Task) {
        let inc = self.nodes[by].inc;
        self.queue.push_back(MetaTask {
            op,
            by: NodeId(by as u32),
            inc,
            task,
        });
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
                // stopped for a rollback dropped what it took; its ranks do not run.)
                for (k, n) in self.nodes.iter().enumerate().filter(|_| self.rollback.is_none()) {
                    assert!(
                        n.took.contains_key(&epoch),
                        "round {epoch} released its ranks before node {k} took its pages"
                    );
                }
                if self.rollback.is_none() {
                    let took: u64 = self.nodes.iter().map(|n| n.took[&epoch]).sum();
                    assert_eq!(pages, took, "round {epoch} released with a wrong page count");
                }
                self.releases += 1;
                self.log(|| format!("round {epoch} released its ranks at {i}"));
            }
            CoordAction::Finished { epoch, outcome, .. } => {
                self.log(|| format!("round {epoch} over at {i}: {outcome:?}"));
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
                        self.nodes[i].mem_committed = epoch;
                        if self.round_lineage.get(&epoch) == Some(&self.lineage) {
                            self.memory_commits += 1;
                        }
                    }
                    Outcome::Aborted(_) => {}
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

    /// One step of a participant's write: all pages to both copies, or the fsync.
    fn write_step(&mut self, i: usize) {
        if self.nodes[i].writes.is_empty() {
            return;
        }
        let k = self.rng.below(self.nodes[i].writes.len() as u64) as usize;
        let mut w = self.nodes[i].writes.swap_remove(k);
        let result = match w.stage {
            // A memory round: each page to the pre-recovery copies of its two holders; no disk.
            Stage::Taken if w.level == Level::Memory => {
                let mut r = Ok(());
                for &(p, val) in &w.pages {
                    for role in [Role::Primary, Role::Mirror] {
                        let h = self.placement.holder(p.0, p.1, role).0 as usize;
                        if !self.nodes[h].up {
                            r = Err(format!("{h} is down"));
                            continue;
                        }
                        let stored =
                            self.nodes[h]
                                .frames
                                .store_pre(JOB, w.epoch, w.committed, p.0, role, &[p.1], vec![val]);
                        if let Err(e) = stored {
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
                        if !self.nodes[h].up {
                            failed = Some(format!("{h} is down"));
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
                        self.nodes[h].frames.supersede(p.0, &[p.1], w.gen);
                        if let Err(e) = self.nodes[h].disk.write((p, role), w.gen, keep, val) {
                            failed = Some(e);
                            continue;
                        }
                        // Kept aside for a policy that keeps what a cleaner wrote.
                        self.nodes[h].frames.keep_written(p.0, role, &[p.1], w.gen, vec![val]);
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
                    let n = &mut self.nodes[h.0 as usize];
                    if n.up && n.inc == inc {
                        n.disk.sync();
                    } else {
                        r = Err(format!("{h} restarted before its fsync"));
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
        self.nodes[i].part.written(JOB, epoch, r);
    }

    /// A cleaner round's flush on node `i`: its recovery copies newer than the disks that the
    /// round did not overwrite go to its disk at `gen`, durably.
    fn flush(&mut self, i: usize, epoch: u64, gen: u64) {
        assert!(self.begun_gens.contains(&gen), "a flush at {gen} outside a cleaner");
        let todo = self.nodes[i].frames.to_flush(JOB, gen);
        let mut runs: BTreeMap<FileId, Vec<(u64, u64)>> = BTreeMap::new();
        let mut r = Ok(());
        for (file, role, indices, vals) in todo {
            for (idx, val) in indices.into_iter().zip(vals) {
                let p = (file, idx);
                let keep = self.page_gen(p);
                if let Err(e) = self.nodes[i].disk.write((p, role), gen, keep, val) {
                    r = Err(e);
                }
                runs.entry(file).or_default().push((idx, idx + 1));
            }
        }
        self.nodes[i].disk.sync();
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
        let k = self.rng.below(self.net.len() as u64) as usize;
        let e = self.net.swap_remove(k);
        let to = e.to.0 as usize;
        if !self.nodes[to].up || self.nodes[to].inc != e.to_inc {
            return;
        }
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
            if Some(e.from) == self.coordinator() {
                let frames = &mut self.nodes[to].frames;
                frames.settle_pre(JOB, *committed, *epoch);
                frames.set_policy(JOB, *cleaning);
                if *level == Level::Memory {
                    frames.mark_memory(JOB, files);
                }
            }
        }
        match e.msg {
            Msg::Prepare { .. } | Msg::Decide { .. } | Msg::Flush { .. } => self.nodes[to].part.receive(e.from, e.msg),
            _ => self.nodes[to].coord.receive(e.from, e.msg),
        }
    }

    /// Applies the next metadata operation (in order; one of a dead submitter may be lost).
    fn meta_step(&mut self) {
        let Some(t) = self.queue.pop_front() else { return };
        let alive = self.nodes[t.by.0 as usize].up && self.nodes[t.by.0 as usize].inc == t.inc;
        if !alive && self.rng.chance(300) {
            self.log(|| format!("lost: {:?}", t.task));
            return;
        }
        let r = self.meta.apply(&t.op);
        self.log(|| format!("meta {:?}: {:?}", t.task, r));
        if r.is_ok() {
            if let MetaOp::Checkpoint { epoch, .. } = &t.op {
                assert_eq!(
                    self.round_lineage.get(epoch),
                    Some(&self.lineage),
                    "checkpoint {epoch}, begun before a rollback, committed after it"
                );
                let img = self
                    .round_images
                    .get(epoch)
                    .cloned()
                    .expect("a committed round began here");
                self.history.insert(*epoch, img);
                self.commits += 1;
            }
        }
        let by = t.by.0 as usize;
        let now = self.now_ms;
        match t.task {
            Task::Rollback(k) if k == self.fences && self.rollback == Some(true) => self.finish_rollback(),
            Task::Rollback(_) => {}
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
                self.nodes[by].coord.begun(now, JOB, epoch, res);
            }
            Task::Commit(epoch) => self.nodes[by].coord.committed(JOB, epoch, r.map_err(|e| e.to_string())),
            Task::Fence(epoch) => {
                let d = self.meta.job_decided(JOB, epoch).ok_or_else(|| "undecided".to_string());
                self.nodes[by].coord.fenced(JOB, epoch, d);
            }
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
            inc,
            disk,
            ..Node::new(self.frame_capacity)
        };
        // Messages from the dead node may still arrive, or not.
        if self.rng.chance(500) {
            self.net.retain(|e| e.from.0 as usize != i);
        }
        for m in self.nodes.iter_mut().filter(|m| m.up) {
            m.coord.node_down(NodeId(i as u32));
        }
        // The job stops: its memories are dropped; a rollback follows.
        self.stop_job();
        self.rollback = Some(false);
    }

    /// The others declare node `i` down while it runs on.
    fn suspect(&mut self, i: usize) {
        if !self.nodes[i].up || self.nodes[i].zombie {
            return;
        }
        self.log(|| format!("{i} declared down while it runs"));
        self.nodes[i].zombie = true;
        for (k, m) in self.nodes.iter_mut().enumerate() {
            if m.up && k != i {
                m.coord.node_down(NodeId(i as u32));
            }
        }
        self.stop_job();
        self.rollback = Some(false);
    }

    fn restart(&mut self, i: usize) {
        if self.nodes[i].zombie {
            // Fenced: it must come back as a new incarnation with an empty memory.
            self.crash(i);
        }
        if self.nodes[i].up {
            return;
        }
        self.nodes[i].up = true;
        self.nodes[i].inc += 1;
        // Its coordinator and participant are a new incarnation too.
        self.nodes[i].coord = Coordinator::new(TIMEOUT_MS, self.nodes[i].inc);
        self.nodes[i].part = Participant::new(self.nodes[i].inc);
        self.log(|| format!("restart {i}"));
    }

    fn stop_job(&mut self) {
        for m in self.nodes.iter_mut() {
            m.mem.clear();
            m.taken.clear();
            m.took.clear();
            m.part.forget(JOB);
        }
    }

    /// The coordinator fences every epoch begun, once no round of its own is deciding.
    fn rollback_step(&mut self) {
        if self.rollback != Some(false) {
            return;
        }
        // The launcher waits for every node (the failed one back with an empty memory).
        if !self.nodes.iter().all(|n| n.up && !n.zombie) {
            return;
        }
        let Some(c) = self.coordinator() else { return };
        let ci = c.0 as usize;
        if self.nodes[ci].coord.busy(JOB) {
            return;
        }
        // Above every epoch a node saw: memory epochs leave no record.
        let seen = self.nodes.iter().map(|n| n.part.seen(JOB)).max().unwrap_or(0);
        let epoch = self.meta.job_floor(JOB).max(self.nodes[ci].started).max(seen);
        self.nodes[ci].mem_committed = 0;
        self.fenced = epoch;
        self.rollback = Some(true);
        self.fences += 1;
        self.submit(
            ci,
            MetaOp::FenceCheckpoint { job: JOB.into(), epoch },
            Task::Rollback(self.fences),
        );
    }

    fn finish_rollback(&mut self) {
        // A node went down meanwhile: the launcher starts its pass again.
        if !self.nodes.iter().all(|n| n.up && !n.zombie) {
            self.rollback = Some(false);
            return;
        }
        let persistent = self.committed_epoch();
        self.lineage += 1;
        self.stop_job();
        // The memory level (the daemon's `recovery::settle_memory`).
        let states: Vec<(u32, u64, Option<u64>)> = (0..self.nodes.len())
            .map(|l| {
                let m = self.nodes[l].frames.job(JOB);
                (l as u32, m.committed, m.pre)
            })
            .collect();
        let (memory, lost) = rollback_target(&states, persistent, self.nodes.len() as u32);
        for n in self.nodes.iter_mut() {
            n.frames.settle(JOB, memory, self.fenced);
        }
        if memory > 0 {
            for h in 0..self.nodes.len() {
                for (file, index, frame) in self.nodes[h].frames.committed_frames(JOB) {
                    let other_role = match frame.role {
                        Role::Primary => Role::Mirror,
                        Role::Mirror => Role::Primary,
                    };
                    let o = self.placement.holder(file, index, other_role);
                    if lost.contains(&o.0) {
                        let f = psls_ckpt::frames::Frame {
                            role: other_role,
                            ..frame
                        };
                        self.nodes[o.0 as usize]
                            .frames
                            .install(JOB, memory, file, vec![(index, f)])
                            .expect("a lost node's copies fit where they were");
                    }
                }
            }
            self.memory_rollbacks += 1;
        }
        let target = memory.max(persistent);
        self.app = self
            .history
            .get(&target)
            .or_else(|| self.round_images.get(&target))
            .cloned()
            .unwrap_or_else(|| panic!("no image of checkpoint {target}"));
        self.rollback = None;
        self.rollbacks += 1;
        self.log(|| format!("rolled back to {target} (memory {memory}, persistent {persistent}, lost {lost:?})"));
        // Every page as the job now sees it: the restored checkpoint, bit for bit.
        if self.nodes.iter().all(|n| n.up) {
            assert_eq!(self.image(), self.app, "after the rollback to {target}");
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
        if self.rollback.is_none() && memory > epoch {
            let img = &self.round_images[&memory];
            for p in self.pages() {
                if img[&p] == want[&p] {
                    continue;
                }
                for role in [Role::Primary, Role::Mirror] {
                    let h = self.placement.holder(p.0, p.1, role).0 as usize;
                    let n = &self.nodes[h];
                    let cur = n.frames.read(p.0, p.1).copied();
                    let pre = n
                        .frames
                        .read_pre(p.0, p.1)
                        .filter(|f| f.epoch == memory)
                        .map(|f| f.data);
                    assert!(
                        n.up && (cur == Some(img[&p]) || pre == Some(img[&p])),
                        "{role:?} recovery copy of {p:?} at node {h} after memory checkpoint {memory}: {cur:?} / {pre:?}, not {}",
                        img[&p]
                    );
                }
            }
        }
        // While the job runs, what it sees is what it wrote since the restored checkpoint.
        if self.rollback.is_none() {
            for (p, val) in self.nodes.iter().filter(|n| n.up).flat_map(|n| n.mem.iter()) {
                assert_eq!(val.0, self.app[p], "memory copy of {p:?}");
            }
        }
    }

    fn step(&mut self) {
        let coordinator = self.coordinator();
        for n in self.nodes.iter_mut().filter(|n| n.up && !n.zombie) {
            n.part.coordinator_changed(coordinator);
        }
        match self.rng.below(100) {
            0..=14 if self.app_runs() => self.app_write(),
            15..=19 if self.app_runs() => self.app_read(),
            20..=24 => self.start_round(None),
            25..=49 => self.deliver(),
            50..=61 => self.meta_step(),
            62..=75 => {
                let i = self.rng.below(self.nodes.len() as u64) as usize;
                if self.nodes[i].up {
                    self.write_step(i);
                }
            }
            76..=85 => {
                self.now_ms += self.rng.below(2 * TIMEOUT_MS / 3);
                let now = self.now_ms;
                for n in self.nodes.iter_mut().filter(|n| n.up) {
                    n.coord.tick(now);
                    n.coord.retry();
                }
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
                let i = match self.coordinator() {
                    Some(c) if self.rng.chance(700) => c.0 as usize,
                    _ => self.rng.below(self.nodes.len() as u64) as usize,
                };
                self.suspect(i);
            }
            _ => {}
        }
        self.run_actions();
        self.check();
    }

    /// One step of the calm phase: everything that can progress does.
    fn calm_step(&mut self) {
        self.rollback_step();
        self.deliver();
        self.meta_step();
        for i in 0..self.nodes.len() {
            self.write_step(i);
        }
        self.now_ms += 100;
        let now = self.now_ms;
        for n in self.nodes.iter_mut() {
            n.coord.tick(now);
            n.coord.retry();
        }
        let c = self.coordinator();
        for n in self.nodes.iter_mut().filter(|n| !n.zombie) {
            n.part.coordinator_changed(c);
        }
        self.run_actions();
        self.check();
    }

    /// Everything up, messages and operations drained: the job must be able to checkpoint.
    fn calm(&mut self) {
        for i in 0..self.nodes.len() {
            self.restart(i);
        }
        for _ in 0..20_000 {
            if self.rollback.is_none() && self.app_runs() && self.queue.is_empty() && self.net.is_empty() {
                break;
            }
            self.calm_step();
        }
        assert!(self.rollback.is_none() && self.app_runs(), "the job never resumed");
        self.app_write();
        let before = self.committed_epoch();
        self.start_round(Some(Level::Persistent));
        self.run_actions();
        for _ in 0..20_000 {
            if self.committed_epoch() > before && self.app_runs() {
                break;
            }
            // A round refused for an epoch a participant saw already: again, above it.
            if self
                .coordinator()
                .is_some_and(|c| !self.nodes[c.0 as usize].coord.busy(JOB))
            {
                self.start_round(Some(Level::Persistent));
            }
            self.calm_step();
        }
        assert!(self.committed_epoch() > before, "no checkpoint committed in the calm");
        assert_eq!(self.image(), self.app);
    }
}

fn run(seed: u64) -> [u64; 6] {
    let mut w = World::new(seed);
    for _ in 0..STEPS {
        w.step();
    }
    w.calm();
    let writes: u64 = w.nodes.iter().map(|n| n.disk.writes).sum();
    // A persistent checkpoint of pages wrote them.
    assert!(writes > 0 || w.persistent_pages == 0);
    [
        w.commits,
        w.rollbacks,
        w.memory_commits,
        w.memory_rollbacks,
        w.releases,
        w.early_writes,
    ]
}

#[test]
fn checkpoints_and_rollbacks_keep_exactly_one_checkpoint_on_the_disks() {
    let mut total = [0u64; 6];
    let seeds = common::seeds(10_000);
    let many = seeds.end - seeds.start >= 1000;
    for seed in seeds {
        let r = std::panic::catch_unwind(|| run(seed));
        match r {
            Ok(counts) => {
                for (t, c) in total.iter_mut().zip(counts) {
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
    let [commits, rollbacks, memory_commits, memory_rollbacks, releases, early_writes] = total;
    println!(
        "{commits} persistent and {memory_commits} memory checkpoints committed, {rollbacks} rollbacks ({memory_rollbacks} to a memory checkpoint); {releases} rounds let the ranks go on before their decision, {early_writes} writes made meanwhile"
    );
    // Every kind of step happened (a single seed need not have them all).
    if many {
        assert!(total.iter().all(|&c| c > 0), "{total:?}");
    }
}
