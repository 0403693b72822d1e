//! Seeded simulation of the mirrored file system's writes ([`Write`]): imports to home and
//! mirror copies with their commit record, transient crashes that lose unsynced writes, the
//! permanent loss of a node's disk, and the re-mirroring of its copies onto a spare — shaped
//! like `psls-node`'s `pfs.rs`.
//!
//! Four logical nodes and a spare. Page `i` of file `f` lives on logical `(f + i) mod 4`
//! (primary) and the next one (mirror). An importer on a live node writes a new file's pages in
//! batches to both copies (messages delayed and reordered; a dead or restarted end drops them),
//! then runs the two-phase write: fsync on every node written to, and the commit record only if
//! every node synced with the incarnation that took its pages. Imports start only when every
//! logical node is up and none is rebuilding (as the daemon's). Nodes crash at any step
//! (storage nodes, the importer, mid-write, mid-sync, mid-rebuild) and restart with a new
//! incarnation, losing what they had not synced; now and then a node loses its disk for good and
//! the spare takes its logical id and copies every page it must hold from the other copy,
//! through the same two-phase write, before `RebuildDone`.
//!
//! After every step: every page of every committed file is whole (durable, the right bytes) on
//! both copies, except on a logical id being rebuilt, where it is whole on the other one; and
//! after a re-mirror every page has two whole copies again. At the end (no more failures) the
//! rebuild and a last import complete. `PSLS_SIM_SEED` / `PSLS_SIM_SEEDS` as in the others.

mod common;

use psls_cluster::write::{Write, WriteAction};
use psls_svm::rng::SplitMix64;
use std::collections::{BTreeMap, BTreeSet};

const LOGICAL: u32 = 4;
const STEPS: usize = 2000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    Primary,
    Mirror,
}

/// A page copy on a disk: its bytes (a number here) and whether an fsync made it durable.
#[derive(Clone, Copy, Debug)]
struct Copy {
    data: u64,
    durable: bool,
}

struct Node {
    up: bool,
    incarnation: u64,
    disk: BTreeMap<(u64, Role, u64), Copy>,
    restart_at: usize,
}

#[derive(Clone, Debug)]
enum Msg {
    /// Store these pages (index, data) of `file` in `role` copies.
    /// `w`: the writer that sent it (replies go back to it).
    Write {
        w: u64,
        file: u64,
        role: Role,
        pages: Vec<(u64, u64)>,
    },
    Stored {
        w: u64,
        incarnation: u64,
    },
    Sync {
        w: u64,
    },
    Synced {
        w: u64,
        incarnation: u64,
    },
    Remove {
        file: u64,
    },
}

struct InFlight {
    at: usize,
    from: String,
    from_inc: u64,
    to: String,
    to_inc: u64,
    msg: Msg,
}

/// A batch to send: (to node, file, role, pages as (index, data)).
type Batch = (String, u64, Role, Vec<(u64, u64)>);

/// A writer's job: an import of a new file, or the rebuild of a logical id's copies.
enum Job {
    /// `map_version`: the logical map the pages were placed with; the commit record is refused
    /// if it changed (a copy may have gone to a node that lost its disk and was replaced after
    /// the spare planned its rebuild).
    Import {
        file: u64,
        pages: u64,
        map_version: u64,
    },
    Rebuild {
        logical: u32,
    },
}

struct Writer {
    id: u64,
    node: String,
    incarnation: u64,
    job: Job,
    write: Write,
    /// Batches still to send: (to node, file, role, pages).
    queue: Vec<Batch>,
}

struct World {
    seed: u64,
    rng: SplitMix64,
    step: usize,
    nodes: BTreeMap<String, Node>,
    /// Logical id → physical node.
    map: BTreeMap<u32, String>,
    /// Bumped at every change of `map` (as `MetaState::map_version`).
    map_version: u64,
    /// Committed files: id → pages.
    files: BTreeMap<u64, u64>,
    /// Logical ids whose copies are being rebuilt (their node lost its disk).
    rebuilding: BTreeSet<u32>,
    writers: Vec<Writer>,
    net: Vec<InFlight>,
    next_file: u64,
    next_writer: u64,
    imports_committed: u64,
    imports_aborted: u64,
    rebuilds_done: u64,
    trace: bool,
}

fn data(file: u64, index: u64) -> u64 {
    file.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index.wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

fn holder(file: u64, index: u64, role: Role) -> u32 {
    let home = ((file + index) % LOGICAL as u64) as u32;
    match role {
        Role::Primary => home,
        Role::Mirror => (home + 1) % LOGICAL,
    }
}

fn other(role: Role) -> Role {
    match role {
        Role::Primary => Role::Mirror,
        Role::Mirror => Role::Primary,
    }
}

impl World {
    fn fail(&self, what: String) -> ! {
        panic!("pfs simulation seed {} at step {}: {what}", self.seed, self.step);
    }

    fn send(&mut self, from: &str, to: &str, msg: Msg) {
        let at = self.step + 1 + self.rng.below(8) as usize;
        let from_inc = self.nodes[from].incarnation;
        let to_inc = self.nodes[to].incarnation;
        self.net.push(InFlight {
            at,
            from: from.to_string(),
            from_inc,
            to: to.to_string(),
            to_inc,
            msg,
        });
    }

    /// A node handles a message (as `node.rs`'s page-store requests).
    fn handle(&mut self, m: InFlight) {
        let reply = match m.msg {
            Msg::Write { w, file, role, pages } => {
                let n = self.nodes.get_mut(&m.to).expect("known node");
                for (index, d) in pages {
                    n.disk.insert(
                        (file, role, index),
                        Copy {
                            data: d,
                            durable: false,
                        },
                    );
                }
                Some(Msg::Stored {
                    w,
                    incarnation: n.incarnation,
                })
            }
            Msg::Sync { w } => {
                let n = self.nodes.get_mut(&m.to).expect("known node");
                for c in n.disk.values_mut() {
                    c.durable = true;
                }
                Some(Msg::Synced {
                    w,
                    incarnation: n.incarnation,
                })
            }
            Msg::Remove { file } => {
                let n = self.nodes.get_mut(&m.to).expect("known node");
                n.disk.retain(|k, _| k.0 != file);
                None
            }
            Msg::Stored { w, incarnation } => {
                if let Some(x) = self.writers.iter_mut().find(|x| x.id == w) {
                    x.write.stored(&m.from, incarnation);
                }
                None
            }
            Msg::Synced { w, incarnation } => {
                if let Some(x) = self.writers.iter_mut().find(|x| x.id == w) {
                    x.write.synced(&m.from, incarnation);
                }
                None
            }
        };
        if let Some(r) = reply {
            let (to, from) = (m.from.clone(), m.to.clone());
            self.send(&from, &to, r);
        }
    }

    fn all_serving(&self) -> bool {
        self.rebuilding.is_empty() && self.map.values().all(|p| self.nodes[p].up)
    }

    fn start_import(&mut self) {
        let live: Vec<String> = self.map.values().filter(|p| self.nodes[*p].up).cloned().collect();
        if live.is_empty() || !self.all_serving() {
            return;
        }
        let node = live[self.rng.below(live.len() as u64) as usize].clone();
        self.next_file += 1;
        let file = self.next_file;
        let pages = 1 + self.rng.below(12);
        let mut batches: BTreeMap<(String, Role), Vec<(u64, u64)>> = BTreeMap::new();
        for i in 0..pages {
            for role in [Role::Primary, Role::Mirror] {
                let phys = self.map[&holder(file, i, role)].clone();
                batches.entry((phys, role)).or_default().push((i, data(file, i)));
            }
        }
        let queue = batches
            .into_iter()
            .map(|((to, role), pages)| (to, file, role, pages))
            .collect();
        let incarnation = self.nodes[&node].incarnation;
        self.next_writer += 1;
        self.writers.push(Writer {
            id: self.next_writer,
            node,
            incarnation,
            job: Job::Import {
                file,
                pages,
                map_version: self.map_version,
            },
            write: Write::new(),
            queue,
        });
    }

    /// The spare rebuilds logical `l`: every page it must hold, copied from the other copy.
    fn start_rebuild(&mut self, l: u32) {
        let node = self.map[&l].clone();
        if !self.nodes[&node].up || self.writers.iter().any(|w| matches!(w.job, Job::Rebuild { .. })) {
            return;
        }
        let mut queue = Vec::new();
        for (&file, &pages) in &self.files {
            for role in [Role::Primary, Role::Mirror] {
                let mut chunk = Vec::new();
                for i in (0..pages).filter(|&i| holder(file, i, role) == l) {
                    let src = &self.map[&holder(file, i, other(role))];
                    // The read of the other copy (served only from what it has made durable).
                    match self.nodes[src].disk.get(&(file, other(role), i)) {
                        Some(c) if self.nodes[src].up && c.durable => chunk.push((i, c.data)),
                        _ => return, // the source cannot serve now: try again later
                    }
                }
                if !chunk.is_empty() {
                    queue.push((node.clone(), file, role, chunk));
                }
            }
        }
        let incarnation = self.nodes[&node].incarnation;
        self.next_writer += 1;
        self.writers.push(Writer {
            id: self.next_writer,
            node,
            incarnation,
            job: Job::Rebuild { logical: l },
            write: Write::new(),
            queue,
        });
    }

    /// Runs every writer: sends a batch, carries out its actions.
    fn run_writers(&mut self) {
        let mut k = 0;
        while k < self.writers.len() {
            let (id, node, inc) = (
                self.writers[k].id,
                self.writers[k].node.clone(),
                self.writers[k].incarnation,
            );
            if !self.nodes[&node].up || self.nodes[&node].incarnation != inc {
                // The writer died with its node: nothing is committed; what it wrote stays
                // (uncommitted shadow data, removed by a collector in the daemon).
                if matches!(self.writers[k].job, Job::Import { .. }) {
                    self.imports_aborted += 1;
                }
                self.writers.remove(k);
                continue;
            }
            if let Some((to, file, role, pages)) = self.writers[k].queue.pop() {
                if self.writers[k].write.sent(&to) {
                    self.send(
                        &node,
                        &to,
                        Msg::Write {
                            w: id,
                            file,
                            role,
                            pages,
                        },
                    );
                }
            } else {
                self.writers[k].write.finish();
            }
            let mut over = false;
            while let Some(a) = self.writers[k].write.poll_action() {
                match a {
                    WriteAction::Sync { node: to } => self.send(&node, &to, Msg::Sync { w: id }),
                    WriteAction::Commit => {
                        let result = self.commit(k);
                        self.writers[k].write.committed(result);
                    }
                    WriteAction::Abort { nodes, .. } => {
                        if let Job::Import { file, .. } = self.writers[k].job {
                            for to in nodes {
                                self.send(&node, &to, Msg::Remove { file });
                            }
                            self.imports_aborted += 1;
                        }
                    }
                    WriteAction::Done(_) => over = true,
                }
            }
            if over {
                self.writers.remove(k);
            } else {
                k += 1;
            }
        }
    }

    /// The commit record: `CommitFile` or `RebuildDone` (metadata is atomic here; its own
    /// simulator covers its replication).
    fn commit(&mut self, k: usize) -> Result<(), String> {
        match self.writers[k].job {
            Job::Import {
                file,
                pages,
                map_version,
            } => {
                if map_version != self.map_version {
                    return Err("the logical map changed during the write".into());
                }
                if self.trace {
                    eprintln!("{} commit file {file} ({pages} pages)", self.step);
                }
                self.files.insert(file, pages);
                self.imports_committed += 1;
                Ok(())
            }
            Job::Rebuild { logical } => {
                if self.trace {
                    eprintln!("{} rebuild of {logical} done", self.step);
                }
                self.rebuilding.remove(&logical);
                self.rebuilds_done += 1;
                // After a re-mirror every page has two whole copies again.
                self.check_copies(true);
                Ok(())
            }
        }
    }

    /// Every page of every committed file is whole on both copies (on one, for a logical id
    /// being rebuilt; on both for every id when `all`).
    fn check_copies(&self, all: bool) {
        for (&file, &pages) in &self.files {
            for i in 0..pages {
                let mut whole = 0;
                for role in [Role::Primary, Role::Mirror] {
                    let l = holder(file, i, role);
                    let phys = &self.map[&l];
                    let ok = self.nodes[phys]
                        .disk
                        .get(&(file, role, i))
                        .is_some_and(|c| c.durable && c.data == data(file, i));
                    if ok {
                        whole += 1;
                    } else if all || !self.rebuilding.contains(&l) {
                        self.fail(format!(
                            "page {file}:{i} ({role:?}) is not whole on logical {l} ({phys})"
                        ));
                    }
                }
                if whole == 0 {
                    self.fail(format!("page {file}:{i} has no whole copy"));
                }
            }
        }
    }

    fn crash(&mut self, name: &str, lose_disk: bool) {
        if self.trace {
            eprintln!(
                "{} CRASH {name}{}",
                self.step,
                if lose_disk { " (disk lost)" } else { "" }
            );
        }
        let restart_at = self.step + 1 + self.rng.below(60) as usize;
        let n = self.nodes.get_mut(name).expect("known node");
        n.up = false;
        n.restart_at = restart_at;
        if lose_disk {
            n.disk.clear();
        } else {
            n.disk.retain(|_, c| c.durable);
        }
    }

    fn step(&mut self, chaos: bool) {
        self.step += 1;
        let due: Vec<InFlight> = {
            let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.net)
                .into_iter()
                .partition(|m| m.at <= self.step);
            self.net = later;
            due
        };
        let mut due = due;
        while !due.is_empty() {
            let k = self.rng.below(due.len() as u64) as usize;
            let m = due.swap_remove(k);
            let (to, from) = (&self.nodes[&m.to], &self.nodes[&m.from]);
            // A dead or restarted end drops the message with its connection.
            if !to.up || to.incarnation != m.to_inc || from.incarnation != m.from_inc {
                continue;
            }
            if self.trace {
                eprintln!("{} {} -> {}: {:?}", self.step, m.from, m.to, m.msg);
            }
            self.handle(m);
        }
        self.run_writers();
        // Restarts.
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for name in &names {
            let n = self.nodes.get_mut(name).expect("known node");
            if !n.up && (self.step >= n.restart_at || !chaos) {
                n.up = true;
                n.incarnation += 1;
            }
        }
        if chaos {
            if self.rng.chance(20) {
                let name = names[self.rng.below(names.len() as u64) as usize].clone();
                if self.nodes[&name].up {
                    self.crash(&name, false);
                }
            }
            // A disk lost for good: only when every page has two copies (one failure at a time).
            if self.rng.chance(3) && self.rebuilding.is_empty() {
                let l = self.rng.below(LOGICAL as u64) as u32;
                let old = self.map[&l].clone();
                if self.nodes[&old].up {
                    self.crash(&old, true);
                    // The spare takes the logical id (`psls node replace`); the old node, if it
                    // comes back with an empty disk, is the spare now.
                    let spare = self
                        .nodes
                        .keys()
                        .find(|p| !self.map.values().any(|m| m == *p) && **p != old)
                        .cloned()
                        .expect("a spare");
                    if self.trace {
                        eprintln!("{} logical {l} moves from {old} to {spare}", self.step);
                    }
                    self.map.insert(l, spare);
                    self.map_version += 1;
                    self.rebuilding.insert(l);
                }
            }
        }
        for l in self.rebuilding.clone() {
            self.start_rebuild(l);
        }
        if self.rng.chance(60) {
            self.start_import();
        }
        self.check_copies(false);
    }
}

fn run_seed(seed: u64) -> (u64, u64, u64) {
    let rng = SplitMix64::new(seed);
    let names: Vec<String> = (0..=LOGICAL)
        .map(|i| if i < LOGICAL { format!("n{i}") } else { "s0".into() })
        .collect();
    let nodes = names
        .iter()
        .map(|n| {
            (
                n.clone(),
                Node {
                    up: true,
                    incarnation: 1,
                    disk: BTreeMap::new(),
                    restart_at: 0,
                },
            )
        })
        .collect();
    let mut w = World {
        seed,
        rng,
        step: 0,
        nodes,
        map: (0..LOGICAL).map(|l| (l, format!("n{l}"))).collect(),
        map_version: 0,
        files: BTreeMap::new(),
        rebuilding: BTreeSet::new(),
        writers: Vec::new(),
        net: Vec::new(),
        next_file: 0,
        next_writer: 0,
        imports_committed: 0,
        imports_aborted: 0,
        rebuilds_done: 0,
        trace: std::env::var_os("PSLS_SIM_TRACE").is_some(),
    };
    for _ in 0..STEPS {
        w.step(true);
    }
    // Calm: every node back; the rebuild and the imports under way end, and one more commits.
    let before = w.imports_committed;
    for _ in 0..600 {
        w.step(false);
        if w.rebuilding.is_empty() && w.writers.is_empty() && w.imports_committed > before {
            break;
        }
    }
    if !w.rebuilding.is_empty() {
        w.fail(format!("the rebuild of {:?} never finished", w.rebuilding));
    }
    if w.imports_committed == before {
        w.fail("no import committed once failures stopped".into());
    }
    w.check_copies(true);
    (w.imports_committed, w.imports_aborted, w.rebuilds_done)
}

#[test]
fn random_schedules_keep_committed_files_whole_on_both_copies() {
    let seeds = common::seeds(1000);
    let count = seeds.end - seeds.start;
    let (mut committed, mut aborted, mut rebuilds) = (0, 0, 0);
    for seed in seeds {
        let (c, a, r) = run_seed(seed);
        committed += c;
        aborted += a;
        rebuilds += r;
    }
    eprintln!("{count} seeds: {committed} imports committed, {aborted} aborted, {rebuilds} re-mirrors");
    if count >= 100 {
        assert!(committed > count * 5, "only {committed} imports committed");
        assert!(
            aborted > count / 2,
            "imports rarely failed ({aborted}): the crashes miss them"
        );
        assert!(rebuilds > count / 4, "disks were rarely lost and rebuilt ({rebuilds})");
    }
}
