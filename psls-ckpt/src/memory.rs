//! The memory level's page transitions (DESIGN §6–§8, seed 001 §3.1–§3.3) on a
//! [`PageTable`]: reads and writes (copy-on-write of readable recovery copies), the two phases
//! of a memory checkpoint and its abort, a cleaner checkpoint under a cleaning policy, and the
//! rollback after a node failure. Pure functions: the daemon will carry out the same steps on
//! its frames; here they are the model the simulator holds it to.
//!
//! Readable copies — active, readable recovery and pre-recovery — hold the page's latest
//! version and agree ([`PageTable::check`]); pure recovery copies hold the last checkpoint's
//! version of a page written since. A page's last checkpoint is in memory when it has recovery
//! copies (readable recovery, or pure recovery if written since), else on the disks.
//!
//! Invariants these functions keep (the simulator checks them after every step): after a
//! memory checkpoint commits, every page written since the previous one has readable recovery
//! copies on two distinct nodes; phase 1 never drops or changes the previous checkpoint's
//! recovery copies, so a failure before the commit decision rolls back to it; after a rollback,
//! every page reads as the restored checkpoint; phase 1 never makes a node hold more frames
//! than its capacity (it refuses before changing anything).

use crate::cleaning::Policy;
use crate::pages::{Category, Frame, PageTable};
use psls_svm::{NodeId, PageId};

/// Why a memory-level step cannot be done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemError {
    /// Phase 1 would need `need` frames on `node`, which has room for `capacity`.
    NoRoom { node: NodeId, need: u64, capacity: u64 },
    /// Fewer than two live nodes: no two copies on distinct nodes.
    TooFewNodes,
    /// Every recovery copy of these pages is gone (two nodes at once): only the persistent
    /// checkpoint is left to roll back to.
    Lost(Vec<PageId>),
    /// A page written since the last checkpoint has no copy left holding its writes (its
    /// node failed): the job must roll back first.
    Unwritten(PageId),
}

const READ_ONLY: Category = Category::Active { writable: false };

fn readable(c: Category) -> bool {
    matches!(
        c,
        Category::Active { .. } | Category::ReadableRecovery | Category::PreRecovery
    )
}

/// The next live node after `from` (in `live`'s order, wrapping) that `avoid` does not name.
fn next_live(live: &[NodeId], from: NodeId, avoid: &[NodeId]) -> Option<NodeId> {
    let start = live.iter().position(|n| *n > from).unwrap_or(0);
    (0..live.len())
        .map(|k| live[(start + k) % live.len()])
        .find(|n| !avoid.contains(n))
}

impl PageTable {
    /// The version a read of `page` sees from memory (none: it is read from the disks).
    pub fn readable_version(&self, page: PageId) -> Option<u64> {
        self.pages
            .get(&page)?
            .frames
            .iter()
            .find(|f| readable(f.category))
            .map(|f| f.version)
    }

    /// A read of `page` on `node` at time `now`: an active copy there is used; else one is
    /// made from a readable copy elsewhere (a writable one is downgraded: one writer or many
    /// readers), or loaded from the disks' `disk_version`.
    pub fn read(&mut self, page: PageId, node: NodeId, disk_version: u64, now: u64) {
        let p = self.pages.entry(page).or_default();
        if let Some(f) = p
            .frames
            .iter_mut()
            .find(|f| f.node == node && matches!(f.category, Category::Active { .. }))
        {
            f.last_use = now;
            return;
        }
        let version = p
            .frames
            .iter()
            .find(|f| readable(f.category))
            .map_or(disk_version, |f| f.version);
        for f in p.frames.iter_mut() {
            if f.category == (Category::Active { writable: true }) {
                f.category = READ_ONLY;
            }
        }
        p.frames.push(Frame {
            node,
            category: READ_ONLY,
            last_use: now,
            version,
        });
    }

    /// A write of `version` of `page` on `node` at time `now` (a read-modify-write: the
    /// writer's copy is made current first): every other active copy goes, the readable
    /// recovery copies turn into pure recovery on their holders (copy-on-write: the last
    /// checkpoint's contents stay for a rollback; a clean page's go, its checkpoint being on
    /// the disks), and `node` holds the only active copy, writable.
    pub fn write(&mut self, page: PageId, node: NodeId, version: u64, now: u64) {
        let p = self.pages.entry(page).or_default();
        p.frames
            .retain(|f| !matches!(f.category, Category::Active { .. }) || f.node == node);
        if p.dirty {
            for f in p.frames.iter_mut() {
                if f.category == Category::ReadableRecovery {
                    f.category = Category::PureRecovery;
                }
            }
        } else {
            // A clean page's checkpoint is on the disks: copies of it in memory (kept by a
            // cleaning policy) are not needed for a rollback.
            p.frames.retain(|f| f.category != Category::ReadableRecovery);
        }
        p.frames.retain(|f| f.node != node || f.category != READ_ONLY);
        match p
            .frames
            .iter_mut()
            .find(|f| f.node == node && matches!(f.category, Category::Active { .. }))
        {
            Some(f) => {
                f.version = version;
                f.last_use = now;
            }
            None => p.frames.push(Frame {
                node,
                category: Category::Active { writable: true },
                last_use: now,
                version,
            }),
        }
        p.dirty = true;
        p.modified = true;
    }

    /// Phase 1 of a memory checkpoint on the `live` nodes, each with room for `capacity`
    /// frames: every page written since the last checkpoint gets two pre-recovery copies on
    /// two distinct nodes — two of its active copies turn into pre-recovery (no transfer), or
    /// its only one does and a replica goes to the next live node. Nothing of the previous
    /// checkpoint changes. Returns the replicas sent: (page, from, to). Refuses, changing
    /// nothing, when a node would go over its capacity.
    pub fn memory_phase1(&mut self, live: &[NodeId], capacity: u64) -> Result<Vec<(PageId, NodeId, NodeId)>, MemError> {
        if live.len() < 2 {
            return Err(MemError::TooFewNodes);
        }
        // The plan first: which copies turn, where replicas go.
        let mut turn: Vec<(PageId, Vec<NodeId>)> = Vec::new();
        let mut replicas: Vec<(PageId, NodeId, NodeId)> = Vec::new();
        for (id, p) in self.pages.iter().filter(|(_, p)| p.modified) {
            let mut active: Vec<&Frame> = p.of(READ_ONLY).filter(|f| live.contains(&f.node)).collect();
            active.sort_by(|a, b| b.last_use.cmp(&a.last_use).then(a.node.cmp(&b.node)));
            match active.as_slice() {
                [] => return Err(MemError::Unwritten(*id)),
                [only] => {
                    let to = next_live(live, only.node, &[only.node]).ok_or(MemError::TooFewNodes)?;
                    turn.push((*id, vec![only.node]));
                    replicas.push((*id, only.node, to));
                }
                [a, b, ..] => turn.push((*id, vec![a.node, b.node])),
            }
        }
        let counters = self.counters();
        for n in live {
            let need =
                counters.get(n).map_or(0, |c| c.total()) + replicas.iter().filter(|(_, _, to)| to == n).count() as u64;
            if need > capacity {
                return Err(MemError::NoRoom {
                    node: *n,
                    need,
                    capacity,
                });
            }
        }
        for (id, nodes) in turn {
            if let Some(p) = self.pages.get_mut(&id) {
                for f in p.frames.iter_mut() {
                    if nodes.contains(&f.node) && matches!(f.category, Category::Active { .. }) {
                        f.category = Category::PreRecovery;
                    }
                }
            }
        }
        for (id, _, to) in &replicas {
            if let Some(p) = self.pages.get_mut(id) {
                let version = p.frames.iter().find(|f| readable(f.category)).map_or(0, |f| f.version);
                p.frames.push(Frame {
                    node: *to,
                    category: Category::PreRecovery,
                    last_use: 0,
                    version,
                });
            }
        }
        Ok(replicas)
    }

    /// Phase 2, after the commit decision: the previous checkpoint's pure recovery copies go,
    /// pre-recovery copies become readable recovery, and the pages they hold are no longer
    /// modified since the last checkpoint (their disk copies are stale: dirty).
    pub fn memory_commit(&mut self) {
        for p in self.pages.values_mut() {
            if !p.frames.iter().any(|f| f.category == Category::PreRecovery) {
                continue;
            }
            p.frames.retain(|f| f.category != Category::PureRecovery);
            for f in p.frames.iter_mut() {
                if f.category == Category::PreRecovery {
                    f.category = Category::ReadableRecovery;
                }
            }
            p.modified = false;
            p.dirty = true;
        }
    }

    /// Phase 1 abandoned before the commit decision: the pre-recovery copies hold the latest
    /// version and go back to being active read-only copies; the previous checkpoint is as
    /// it was.
    pub fn memory_abort(&mut self) {
        for f in self.pages.values_mut().flat_map(|p| p.frames.iter_mut()) {
            if f.category == Category::PreRecovery {
                f.category = READ_ONLY;
            }
        }
    }

    /// A cleaner (persistent) checkpoint: every dirty page's latest version is written to the
    /// disks (returned: page and version), then `policy` chooses what stays in memory.
    pub fn cleaner(&mut self, policy: Policy) -> Vec<(PageId, u64)> {
        let written: Vec<(PageId, u64)> = self
            .pages
            .iter()
            .filter(|(_, p)| p.dirty)
            .filter_map(|(id, p)| p.frames.iter().find(|f| readable(f.category)).map(|f| (*id, f.version)))
            .collect();
        *self = policy.clean(self);
        written
    }

    /// The rollback after the nodes `failed` lost their memories (transient or permanent: a
    /// spare in the place of a lost node starts empty too): their copies go; every page
    /// written since the last checkpoint loses its active and pre-recovery copies and its
    /// pure recovery copies become readable recovery again (or, with its checkpoint on the
    /// disks, it is read from them); then every page with one recovery copy left gets a second
    /// on the next live node. Returns those replicas: (page, from, to). When every recovery
    /// copy of some page is gone, nothing changes and the pages are named: only the persistent
    /// checkpoint is left (see [`PageTable::power_cut`]).
    pub fn roll_back(&mut self, failed: &[NodeId], live: &[NodeId]) -> Result<Vec<(PageId, NodeId, NodeId)>, MemError> {
        let lost: Vec<PageId> = self
            .pages
            .iter()
            .filter(|(_, p)| {
                let recovery = |f: &&Frame| {
                    if p.modified {
                        f.category == Category::PureRecovery
                    } else {
                        // Not written since: any readable copy holds the checkpoint.
                        readable(f.category)
                    }
                };
                let in_memory =
                    p.dirty && (!p.modified || p.frames.iter().any(|f| f.category == Category::PureRecovery));
                in_memory && !p.frames.iter().filter(recovery).any(|f| !failed.contains(&f.node))
            })
            .map(|(id, _)| *id)
            .collect();
        if !lost.is_empty() {
            return Err(MemError::Lost(lost));
        }
        for p in self.pages.values_mut() {
            p.frames.retain(|f| !failed.contains(&f.node));
            if p.modified {
                let in_memory = p.frames.iter().any(|f| f.category == Category::PureRecovery);
                p.frames.retain(|f| f.category == Category::PureRecovery);
                for f in p.frames.iter_mut() {
                    f.category = Category::ReadableRecovery;
                }
                p.modified = false;
                p.dirty = in_memory;
            } else if p.dirty && !p.frames.iter().any(|f| f.category == Category::ReadableRecovery) {
                // Its recovery copies were lost but an active copy holds the same version.
                if let Some(f) = p.frames.iter_mut().find(|f| readable(f.category)) {
                    f.category = Category::ReadableRecovery;
                }
            }
            // Phase 1 copies of an abandoned checkpoint of a page not written since.
            for f in p.frames.iter_mut() {
                if f.category == Category::PreRecovery {
                    f.category = READ_ONLY;
                }
            }
        }
        self.pages.retain(|_, p| !p.frames.is_empty());
        let mut replicas = Vec::new();
        for (id, p) in self.pages.iter_mut() {
            let holders: Vec<NodeId> = p.of(Category::ReadableRecovery).map(|f| f.node).collect();
            if let [only] = holders.as_slice() {
                let others: Vec<NodeId> = p
                    .frames
                    .iter()
                    .filter(|f| f.category == Category::ReadableRecovery || f.node == *only)
                    .map(|f| f.node)
                    .collect();
                if let Some(to) = next_live(live, *only, &others) {
                    let version = p.frames.iter().find(|f| f.node == *only).map_or(0, |f| f.version);
                    // An active copy there becomes the recovery copy; else one is sent.
                    p.frames.retain(|f| f.node != to);
                    p.frames.push(Frame {
                        node: to,
                        category: Category::ReadableRecovery,
                        last_use: 0,
                        version,
                    });
                    replicas.push((*id, *only, to));
                }
            }
        }
        Ok(replicas)
    }

    /// Every memory is gone (a power cut, or a rollback to the persistent checkpoint after
    /// both recovery copies of a page were lost): every page is read from the disks again.
    pub fn power_cut(&mut self) {
        self.pages.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pages::test_support::page;

    /// Four live nodes (the model run over many seeds is `tests/memory_sim.rs`).
    fn live() -> Vec<NodeId> {
        (0..4).map(NodeId).collect()
    }

    #[test]
    fn a_unique_page_is_replicated_and_a_replicated_one_is_not() {
        let mut t = PageTable::default();
        t.write(page(0), NodeId(1), 1, 1);
        t.read(page(1), NodeId(0), 0, 2);
        t.write(page(1), NodeId(0), 1, 3);
        t.read(page(1), NodeId(2), 0, 4);
        let replicas = t.memory_phase1(&live(), 100).unwrap();
        assert_eq!(
            replicas,
            vec![(page(0), NodeId(1), NodeId(2))],
            "page 1 is on two nodes already"
        );
        t.memory_commit();
        // Copy-on-write: a write turns both readable recovery copies into pure recovery.
        t.write(page(1), NodeId(3), 2, 5);
        let cats: Vec<(u32, Category)> = t.pages[&page(1)]
            .frames
            .iter()
            .map(|f| (f.node.0, f.category))
            .collect();
        assert_eq!(
            cats,
            vec![
                (0, Category::PureRecovery),
                (2, Category::PureRecovery),
                (3, Category::Active { writable: true })
            ]
        );
        // Page 1's replica would go to node 0, which holds a frame already: no room for two.
        let before = t.clone();
        assert_eq!(
            t.memory_phase1(&live(), 1),
            Err(MemError::NoRoom {
                node: NodeId(0),
                need: 2,
                capacity: 1
            })
        );
        assert_eq!(t, before, "a refused phase 1 changes nothing");
    }
}
