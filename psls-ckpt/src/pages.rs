//! Page categories (DESIGN §6, seed 001 §3.1): the copies of a job's pages in the nodes'
//! memories, each one *active* (used by the computation, read-only or writable), *readable
//! recovery* (belongs to the last checkpoint and is still readable), *pure recovery* (belongs
//! to the last checkpoint, no longer usable, kept only for a rollback) or *pre-recovery*
//! (belongs to the checkpoint being made, not yet committed); and whether each page is
//! *dirty* (its disk copies are not its latest checkpointed or active version) and
//! *modified* since the last checkpoint.
//!
//! [`PageTable`] is the cluster-wide view of those copies — what every node's page table holds,
//! gathered — on which the cleaning policies ([`crate::cleaning`]) decide and the coordinator
//! counts frames ([`Counters`]) to know whether a memory checkpoint fits.
//!
//! Invariants ([`PageTable::check`]): a writable active copy is the page's only active copy
//! (single writer); pure recovery copies exist only for a page modified since the last
//! checkpoint (they are its old contents); a page has at most two copies of each recovery
//! category, on distinct nodes; its readable copies (every one but pure recovery) hold one
//! version, and its pure recovery copies one version. (A clean page may keep readable recovery copies: after a
//! cleaner checkpoint they equal its disk copies, and a policy may keep them in memory.)

use psls_svm::{NodeId, PageId};
use std::collections::BTreeMap;

/// What a copy of a page in a node's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Category {
    /// Used by the computation; `writable` when its node may write it.
    Active { writable: bool },
    /// The last checkpoint's version, still readable.
    ReadableRecovery,
    /// The last checkpoint's version of a page written since: kept only for a rollback.
    PureRecovery,
    /// The version of the checkpoint being made (phase 1), not committed yet.
    PreRecovery,
}

/// One copy of a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    pub node: NodeId,
    pub category: Category,
    /// When the computation last used this copy (a counter: larger is more recent).
    pub last_use: u64,
    /// Which version of the page it holds (for checks; the daemon's frames hold bytes).
    pub version: u64,
}

/// A page's copies and state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Page {
    /// Its disk copies are older than its latest version (checkpointed in memory, or written).
    pub dirty: bool,
    /// Written since the last checkpoint (memory or persistent).
    pub modified: bool,
    pub frames: Vec<Frame>,
}

/// What a page is at a cleaner checkpoint, for the policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Loaded and never written since the last persistent checkpoint.
    Clean,
    /// Written since the last checkpoint: its active copies are its only latest version.
    DirtyActive,
    /// Checkpointed in memory and not written since: its readable recovery copies hold it.
    Checkpointed,
}

impl Page {
    pub fn kind(&self) -> Kind {
        match (self.dirty, self.modified) {
            (false, _) => Kind::Clean,
            (true, true) => Kind::DirtyActive,
            (true, false) => Kind::Checkpointed,
        }
    }

    /// Its copies of one category (any active copy for `Active`).
    pub fn of(&self, category: Category) -> impl Iterator<Item = &Frame> {
        self.frames.iter().filter(move |f| match (f.category, category) {
            (Category::Active { .. }, Category::Active { .. }) => true,
            (a, b) => a == b,
        })
    }
}

/// Frames per category on one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub active: u64,
    pub readable_recovery: u64,
    pub pure_recovery: u64,
    pub pre_recovery: u64,
}

impl Counters {
    pub fn total(&self) -> u64 {
        self.active + self.readable_recovery + self.pure_recovery + self.pre_recovery
    }
}

/// The copies of pages across the nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageTable {
    pub pages: BTreeMap<PageId, Page>,
}

impl PageTable {
    /// Frames per category on every node holding any.
    pub fn counters(&self) -> BTreeMap<NodeId, Counters> {
        let mut out: BTreeMap<NodeId, Counters> = BTreeMap::new();
        for f in self.pages.values().flat_map(|p| &p.frames) {
            let c = out.entry(f.node).or_default();
            match f.category {
                Category::Active { .. } => c.active += 1,
                Category::ReadableRecovery => c.readable_recovery += 1,
                Category::PureRecovery => c.pure_recovery += 1,
                Category::PreRecovery => c.pre_recovery += 1,
            }
        }
        out
    }

    /// Whether a memory checkpoint surely fits in nodes of `capacity` frames each: in phase 1
    /// a modified page may need a pre-recovery frame on two nodes besides what it holds now
    /// (with its two pure recovery copies, four frames for one page), and the decision is
    /// made before phase 1 starts, so that memory never deadlocks. A modified page's two new
    /// frames are on two distinct nodes, so a node takes at most one per modified page;
    /// conservatively, the fullest node is charged one for every modified page.
    pub fn memory_checkpoint_fits(&self, nodes: &[NodeId], capacity: u64) -> bool {
        if nodes.len() < 2 {
            return false;
        }
        let counters = self.counters();
        let used: u64 = nodes
            .iter()
            .map(|n| counters.get(n).map_or(0, Counters::total))
            .max()
            .unwrap_or(0);
        let modified = self.pages.values().filter(|p| p.modified).count() as u64;
        used.saturating_add(modified) <= capacity
    }

    /// Checks the invariants (module documentation); the first one broken, in words.
    pub fn check(&self) -> Result<(), String> {
        for (id, p) in &self.pages {
            let active: Vec<&Frame> = p.of(Category::Active { writable: false }).collect();
            if active.iter().any(|f| f.category == Category::Active { writable: true }) && active.len() > 1 {
                return Err(format!("page {id}: a writable copy and {} active copies", active.len()));
            }
            let readable: Vec<u64> = p
                .frames
                .iter()
                .filter(|f| f.category != Category::PureRecovery)
                .map(|f| f.version)
                .collect();
            if readable.windows(2).any(|w| w[0] != w[1]) {
                return Err(format!("page {id}: readable copies of different versions {readable:?}"));
            }
            let pure: Vec<u64> = p.of(Category::PureRecovery).map(|f| f.version).collect();
            if pure.windows(2).any(|w| w[0] != w[1]) {
                return Err(format!(
                    "page {id}: pure recovery copies of different versions {pure:?}"
                ));
            }
            if !p.modified && p.of(Category::PureRecovery).next().is_some() {
                return Err(format!(
                    "page {id}: pure recovery copies of a page not written since the checkpoint"
                ));
            }
            for cat in [
                Category::ReadableRecovery,
                Category::PureRecovery,
                Category::PreRecovery,
            ] {
                let mut nodes: Vec<NodeId> = p.of(cat).map(|f| f.node).collect();
                let n = nodes.len();
                nodes.sort();
                nodes.dedup();
                if n > 2 || nodes.len() != n {
                    return Err(format!("page {id}: {n} {cat:?} copies on {} nodes", nodes.len()));
                }
            }
        }
        Ok(())
    }
}

/// Pages and frames for the tests of this crate's modules.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// Page `i` of file 1.
    pub fn page(i: u64) -> PageId {
        PageId {
            file: psls_svm::FileId(1),
            index: i,
        }
    }

    /// A copy on `node`, holding version 0.
    pub fn frame(node: u32, category: Category, last_use: u64) -> Frame {
        Frame {
            node: NodeId(node),
            category,
            last_use,
            version: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{frame, page};
    use super::*;

    const RO: Category = Category::Active { writable: false };
    const RW: Category = Category::Active { writable: true };

    #[test]
    fn counters_kinds_and_invariants() {
        let mut t = PageTable::default();
        t.pages.insert(
            page(0),
            Page {
                dirty: true,
                modified: true,
                frames: vec![
                    frame(0, RW, 0),
                    frame(0, Category::PureRecovery, 0),
                    frame(1, Category::PureRecovery, 0),
                ],
            },
        );
        t.pages.insert(
            page(1),
            Page {
                dirty: true,
                modified: false,
                frames: vec![
                    frame(0, Category::ReadableRecovery, 0),
                    frame(1, Category::ReadableRecovery, 0),
                ],
            },
        );
        t.pages.insert(
            page(3),
            Page {
                dirty: false,
                modified: false,
                frames: vec![frame(1, RO, 0)],
            },
        );
        t.check().unwrap();
        let c = t.counters();
        assert_eq!(
            c[&NodeId(0)],
            Counters {
                active: 1,
                readable_recovery: 1,
                pure_recovery: 1,
                pre_recovery: 0
            }
        );
        assert_eq!(c[&NodeId(1)].total(), 3);
        assert_eq!(t.pages[&page(0)].kind(), Kind::DirtyActive);
        assert_eq!(t.pages[&page(1)].kind(), Kind::Checkpointed);
        assert_eq!(t.pages[&page(3)].kind(), Kind::Clean);
        // One modified page: two more frames at worst on the fullest node (3 used).
        assert!(t.memory_checkpoint_fits(&[NodeId(0), NodeId(1)], 4));
        assert!(!t.memory_checkpoint_fits(&[NodeId(0), NodeId(1)], 3));
        assert!(
            !t.memory_checkpoint_fits(&[NodeId(0)], 100),
            "one node cannot hold two copies"
        );

        let mut bad = t.clone();
        bad.pages.get_mut(&page(0)).unwrap().frames.push(frame(1, RO, 0));
        assert!(bad.check().unwrap_err().contains("writable"));
        let mut bad = t.clone();
        bad.pages
            .get_mut(&page(1))
            .unwrap()
            .frames
            .push(frame(2, Category::PureRecovery, 0));
        assert!(bad.check().unwrap_err().contains("pure recovery"));
        let mut bad = t;
        bad.pages.get_mut(&page(1)).unwrap().frames[1].node = NodeId(0);
        assert!(bad.check().unwrap_err().contains("on 1 nodes"));
    }
}
