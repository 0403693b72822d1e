//! Seeded simulator of persistent checkpoints and rollback: 3–5 nodes, one job writing two
//! files through the nodes' memories, the real coordinator and participant state machines,
//! the real metadata operations (`MetaState::apply`: begin, commit record, fence), and disks
//! with two slots per page copy that lose or tear unsynced writes in a crash. Messages are
//! delayed and reordered; nodes crash at any step (the coordinator mid-round, a participant
//! mid-write or mid-sync, two at once, every node in a power cut) and come back, or are
//! declared down while they run on (a coordinator that goes on with its round until it is
//! fenced); metadata operations of a dead coordinator may still be applied later, in order,
//! or never.
//!
//! A crash rolls the job back (the shape the daemon follows): once no round is deciding,
//! the coordinator fences every epoch begun so far, and when the fence is applied, the
//! committed epoch it finds is the one every node returns to (memories dropped, the pages
//! reloaded from the disks).
//!
//! Checked after every step:
//! - the disks hold the last committed checkpoint: every page's committed generation is on
//!   each up node holding a copy, whole, with the bytes the job had in memory when that
//!   checkpoint's round began (the simulator keeps every checkpoint's image);
//! - pages are written to the disks only by a participant's checkpoint write;
//! - after every rollback, each page as the job now sees it equals its contents at the
//!   restored checkpoint, bit for bit, and no checkpoint begun before it ever commits.
//!
//! Each seed ends with a calm phase: every node up, a write, a round that must commit.
//! `PSLS_SIM_SEED=N` runs one seed, `PSLS_SIM_SEEDS=N` seeds 0..N, `PSLS_SIM_TRACE=1` prints
//! every step.

mod common;

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
    /// Writes in progress: one per job from the participant, and late ones of rounds a
    /// rollback abandoned (they go on writing, as the daemon's tasks would).
    writes: Vec<WriteJob>,
    /// The highest epoch this node, as coordinator, started.
    started: u64,
}

impl Node {
    fn new() -> Node {
        Node {
            up: true,
            zombie: false,
            inc: 1,
            disk: Disk::default(),
            part: Participant::new(),
            coord: Coordinator::new(TIMEOUT_MS),
            mem: BTreeMap::new(),
            taken: BTreeMap::new(),
            writes: Vec::new(),
            started: 0,
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
    trace: bool,
}

impl World {
    fn new(seed: u64) -> World {
        let mut rng = SplitMix64::new(seed);
        let n = 3 + rng.below(3) as u32;
        let placement = Placement::new(n).expect("n >= 2");
        let files = vec![(FileId(11), 4 + rng.below(12)), (FileId(12), 1 + rng.below(6))];
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
            nodes: (0..n).map(|_| Node::new()).collect(),
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
            trace: std::env::var("PSLS_SIM_TRACE").is_ok(),
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
        self.rollback.is_none() && self.nodes.iter().all(|n| n.up && !n.zombie && !n.coord.busy(JOB))
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
        // From a node holding it (the owner keeps its dirty bit), else from the disks.
        let val = self.nodes.iter().find_map(|m| m.mem.get(&p).map(|x| x.0));
        let val = match val {
            Some(v) => v,
            None => self
                .read_disk(p)
                .unwrap_or_else(|| panic!("page {p:?} is unreadable from both copies")),
        };
        assert_eq!(
            val, self.app[&p],
            "a read of {p:?} at node {n} sees another version than the job wrote"
        );
        self.nodes[n].mem.insert(p, (val, false));
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
                    .or_else(|| self.read_disk(p))
                    .unwrap_or(u64::MAX);
                (p, v)
            })
            .collect()
    }

    // ---- the coordinator ----

    fn start_round(&mut self) {
        let Some(c) = self.coordinator() else { return };
        if !self.app_runs() {
            return;
        }
        let ci = c.0 as usize;
        let epoch = self.meta.job_floor(JOB).max(self.nodes[ci].started) + 1;
        let all: BTreeSet<NodeId> = (0..self.nodes.len()).map(|i| NodeId(i as u32)).collect();
        let files = self.file_ids();
        let now = self.now_ms;
        if self.nodes[ci].coord.start(now, JOB, epoch, files, all).is_ok() {
            self.nodes[ci].started = epoch;
            let img = self.image();
            assert_eq!(img, self.app, "the memory image differs from the job's writes");
            self.round_images.insert(epoch, img);
            self.round_lineage.insert(epoch, self.lineage);
            self.log(|| format!("round {epoch} starts at {ci}"));
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
            CoordAction::Finished { epoch, outcome, .. } => {
                self.log(|| format!("round {epoch} over at {i}: {outcome:?}"));
                if let Outcome::Committed { .. } = outcome {
                    assert_eq!(
                        self.meta.job_decided(JOB, epoch),
                        Some(true),
                        "round {epoch} finished as committed without its record"
                    );
                }
            }
        }
    }

    fn part_action(&mut self, i: usize, a: PartAction) {
        match a {
            PartAction::Send { to, msg } => self.send(i, to, msg),
            PartAction::Write { epoch, gen, files, .. } => {
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
                self.nodes[i].writes.push(WriteJob {
                    epoch,
                    gen,
                    pages,
                    stage: Stage::Taken,
                });
            }
            PartAction::Clean { epoch, .. } => {
                self.nodes[i].taken.remove(&epoch);
            }
            PartAction::Restore { epoch, .. } => {
                let node = &mut self.nodes[i];
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
                        if let Err(e) = self.nodes[h].disk.write((p, role), w.gen, keep, val) {
                            failed = Some(e);
                            continue;
                        }
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
        match e.msg {
            Msg::Prepare { .. } | Msg::Decide { .. } => self.nodes[to].part.receive(e.from, e.msg),
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
                let res = match r {
                    Ok(()) if rec.started == epoch => Ok((rec.started_gen, self.meta.seq, rec.epoch)),
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
            ..Node::new()
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
        self.log(|| format!("restart {i}"));
    }

    fn stop_job(&mut self) {
        for m in self.nodes.iter_mut() {
            m.mem.clear();
            m.taken.clear();
            m.part.forget(JOB);
        }
    }

    /// The coordinator fences every epoch begun, once no round of its own is deciding.
    fn rollback_step(&mut self) {
        if self.rollback != Some(false) {
            return;
        }
        let Some(c) = self.coordinator() else { return };
        let ci = c.0 as usize;
        if self.nodes[ci].coord.busy(JOB) {
            return;
        }
        let epoch = self.meta.job_floor(JOB).max(self.nodes[ci].started);
        self.rollback = Some(true);
        self.fences += 1;
        self.submit(
            ci,
            MetaOp::FenceCheckpoint { job: JOB.into(), epoch },
            Task::Rollback(self.fences),
        );
    }

    fn finish_rollback(&mut self) {
        let target = self.committed_epoch();
        self.lineage += 1;
        self.stop_job();
        self.app = self.history[&target].clone();
        self.rollback = None;
        self.rollbacks += 1;
        self.log(|| format!("rolled back to {target}"));
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
            20..=24 => self.start_round(),
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
        self.start_round();
        self.run_actions();
        for _ in 0..20_000 {
            if self.committed_epoch() > before && self.app_runs() {
                break;
            }
            self.calm_step();
        }
        assert!(self.committed_epoch() > before, "no checkpoint committed in the calm");
        assert_eq!(self.image(), self.app);
    }
}

fn run(seed: u64) -> (u64, u64) {
    let mut w = World::new(seed);
    for _ in 0..STEPS {
        w.step();
    }
    w.calm();
    let writes: u64 = w.nodes.iter().map(|n| n.disk.writes).sum();
    assert!(writes > 0 || w.commits == 0);
    (w.commits, w.rollbacks)
}

#[test]
fn checkpoints_and_rollbacks_keep_exactly_one_checkpoint_on_the_disks() {
    let (mut commits, mut rollbacks) = (0, 0);
    for seed in common::seeds(10_000) {
        let r = std::panic::catch_unwind(|| run(seed));
        match r {
            Ok((c, r)) => {
                commits += c;
                rollbacks += r;
            }
            Err(e) => {
                eprintln!(
                    "checkpoint simulator failed at seed {seed} (PSLS_SIM_SEED={seed} PSLS_SIM_TRACE=1 to replay)"
                );
                std::panic::resume_unwind(e);
            }
        }
    }
    println!("{commits} checkpoints committed, {rollbacks} rollbacks");
    assert!(commits > 0 && rollbacks > 0);
}
