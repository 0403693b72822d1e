//! The memory level's model run (`psls_ckpt::memory` on a `PageTable`): seeded random runs of
//! reads, writes, memory checkpoints (with a failure in phase 1 or phase 2 now and then, and
//! phase 1 refused for lack of room, then a cleaner checkpoint instead), cleaner checkpoints
//! under every policy, failures of one node or two at once, and power cuts. After every step:
//! the page table's invariants; after a commit, two recovery copies on distinct nodes of every
//! page written since the previous checkpoint; after every rollback, every page reads as the
//! restored checkpoint (one failure never loses one); phase 1 never over a node's capacity,
//! and a refused one changes nothing. `PSLS_SIM_SEED=S` runs seed S alone, `PSLS_SIM_SEEDS=N`
//! the first N (2,000 by default); a failure names its seed and step.

mod common;

use psls_ckpt::cleaning::Policy;
use psls_ckpt::memory::MemError;
use psls_ckpt::pages::{Category, PageTable};
use psls_svm::rng::SplitMix64;
use psls_svm::{FileId, NodeId, PageId};
use std::collections::BTreeMap;

fn page(i: u64) -> PageId {
    PageId {
        file: FileId(1),
        index: i,
    }
}

const NODES: u32 = 4;
const PAGES: u64 = 8;

/// The model: what each page's last checkpoint and the disks hold.
struct Model {
    table: PageTable,
    latest: BTreeMap<PageId, u64>,
    committed: BTreeMap<PageId, u64>,
    disk: BTreeMap<PageId, u64>,
    written_since: Vec<PageId>,
    now: u64,
}

impl Model {
    fn new() -> Model {
        Model {
            table: PageTable::default(),
            latest: BTreeMap::new(),
            committed: BTreeMap::new(),
            disk: BTreeMap::new(),
            written_since: Vec::new(),
            now: 0,
        }
    }
    fn disk(&self, p: PageId) -> u64 {
        self.disk.get(&p).copied().unwrap_or(0)
    }
    /// After a rollback: every page reads as its last checkpoint.
    fn restored(&mut self, why: &str) {
        for i in 0..PAGES {
            let p = page(i);
            let sees = self.table.readable_version(p).unwrap_or(self.disk(p));
            let want = self.committed.get(&p).copied().unwrap_or(0);
            assert_eq!(sees, want, "{why}: page {i} reads {sees}, its checkpoint holds {want}");
            self.latest.insert(p, want);
        }
        self.written_since.clear();
    }
    /// A persistent rollback (power cut, or both recovery copies lost).
    fn back_to_disk(&mut self) {
        self.table.power_cut();
        self.committed = self.disk.clone();
        self.restored("persistent rollback");
    }
    /// A checkpoint committed: what every page holds now is its checkpoint.
    fn committed_now(&mut self) {
        self.committed = self.latest.clone();
        self.written_since.clear();
    }
}

fn live() -> Vec<NodeId> {
    (0..NODES).map(NodeId).collect()
}

/// Seeded random runs of reads, writes, memory and cleaner checkpoints, failures in
/// either phase, of one or two nodes, and power cuts; the invariants after every step.
fn run(seed: u64, steps: usize) {
    let mut rng = SplitMix64::new(seed);
    let mut m = Model::new();
    let policies = [
        Policy::NoCleaning,
        Policy::Total,
        Policy::P1,
        Policy::P2,
        Policy::P3,
        Policy::Lru { frames: 4 },
    ];
    for step in 0..steps {
        m.now += 1;
        let what = format!("seed {seed} step {step}");
        let node = NodeId(rng.below(NODES as u64) as u32);
        let p = page(rng.below(PAGES));
        match rng.below(100) {
            0..=34 => {
                let d = m.disk(p);
                m.table.read(p, node, d, m.now);
                let want = m.latest.get(&p).copied().unwrap_or(0);
                assert_eq!(
                    m.table.readable_version(p),
                    Some(want),
                    "{what}: a read sees a stale version"
                );
            }
            35..=64 => {
                let v = m.latest.get(&p).copied().unwrap_or(0) + 1;
                m.latest.insert(p, v);
                m.table.write(p, node, v, m.now);
                m.written_since.push(p);
            }
            65..=84 => {
                // A memory checkpoint, perhaps with a failure in phase 1 or phase 2.
                let capacity = if rng.below(10) == 0 { rng.below(12) } else { 1000 };
                let before = m.table.counters();
                match m.table.memory_phase1(&live(), capacity) {
                    Err(MemError::NoRoom { .. }) => {
                        assert_eq!(m.table.counters(), before, "{what}: a refused phase 1 changed frames");
                        // The coordinator takes a cleaner checkpoint instead.
                        for (pg, v) in m.table.cleaner(Policy::Total) {
                            m.disk.insert(pg, v);
                        }
                        m.committed_now();
                        for (pg, v) in &m.latest {
                            assert_eq!(m.disk(*pg), *v, "{what}: page {pg} not on the disks");
                        }
                    }
                    Err(e) => panic!("{what}: phase 1: {e:?}"),
                    Ok(_) => {
                        for (n, c) in m.table.counters() {
                            assert!(c.total() <= capacity, "{what}: {n:?} holds {} > {capacity}", c.total());
                        }
                        let fail = rng.below(6);
                        if fail == 0 {
                            // A node fails in phase 1: the previous checkpoint comes back.
                            m.table.memory_abort();
                            let failed = [node];
                            match m.table.roll_back(&failed, &live()) {
                                Ok(_) => m.restored(&format!("{what}: failure in phase 1")),
                                Err(MemError::Lost(_)) => m.back_to_disk(),
                                Err(e) => panic!("{what}: {e:?}"),
                            }
                        } else {
                            let written = std::mem::take(&mut m.written_since);
                            m.table.memory_commit();
                            m.committed_now();
                            for pg in written {
                                let holders: Vec<NodeId> = m.table.pages[&pg]
                                    .of(Category::ReadableRecovery)
                                    .map(|f| f.node)
                                    .collect();
                                assert_eq!(holders.len(), 2, "{what}: page {pg} has recovery copies on {holders:?}");
                                assert_ne!(holders[0], holders[1], "{what}");
                            }
                            if fail == 1 {
                                // A node fails in phase 2: the new checkpoint stays.
                                match m.table.roll_back(&[node], &live()) {
                                    Ok(_) => m.restored(&format!("{what}: failure in phase 2")),
                                    Err(e) => panic!("{what}: one failure after a commit lost pages: {e:?}"),
                                }
                            }
                        }
                    }
                }
            }
            85..=89 => {
                let policy = policies[rng.below(policies.len() as u64) as usize];
                for (pg, v) in m.table.cleaner(policy) {
                    m.disk.insert(pg, v);
                }
                m.committed_now();
                for (pg, v) in &m.latest {
                    assert_eq!(m.disk(*pg), *v, "{what}: {policy}: page {pg} not on the disks");
                }
            }
            90..=97 => {
                // One node fails, or two at once.
                let mut failed = vec![node];
                if rng.below(3) == 0 {
                    failed.push(NodeId((node.0 + 1 + rng.below(NODES as u64 - 1) as u32) % NODES));
                }
                match m.table.roll_back(&failed, &live()) {
                    Ok(_) => m.restored(&format!("{what}: failure of {failed:?}")),
                    Err(MemError::Lost(pages)) => {
                        assert!(failed.len() == 2, "{what}: one failure lost {pages:?}");
                        m.back_to_disk();
                    }
                    Err(e) => panic!("{what}: {e:?}"),
                }
                // After a rollback, every checkpointed page in memory has two copies.
                for (id, pg) in &m.table.pages {
                    let n = pg.of(Category::ReadableRecovery).count();
                    assert!(
                        n == 0 || n == 2,
                        "{what}: page {id} has {n} recovery copies after a rollback"
                    );
                }
            }
            _ => m.back_to_disk(),
        }
        m.table.check().unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

#[test]
fn memory_checkpoints_and_rollbacks_over_random_runs() {
    for seed in common::seeds(2000) {
        run(seed, 300);
    }
}
