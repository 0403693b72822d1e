//! Cleaning policies (DESIGN §7, seed 001 "Cleaner strategies"): which copies of a job's pages
//! stay in memory after a cleaner (persistent) checkpoint. Every policy starts from the same
//! facts: the checkpoint wrote every dirty page and every readable recovery page whose disk
//! copy was stale, so afterwards every page is clean and its pure recovery copies are gone;
//! the policy only chooses how much of the working set memory keeps.
//!
//! - [`Policy::NoCleaning`]: no active or readable recovery copy is discarded.
//! - [`Policy::Total`]: every copy is discarded; the working set is loaded again from the disks.
//! - [`Policy::P1`]: one copy of each clean page, the two copies of each page written since the
//!   last checkpoint (kept as its two readable recovery copies), and the two readable recovery
//!   copies of each page checkpointed in memory before.
//! - [`Policy::P2`]: like P1, but the readable recovery copies of pages checkpointed in memory
//!   before are discarded.
//! - [`Policy::P3`]: one active copy of each page in memory (written since the last checkpoint
//!   or not), and the readable recovery copies of pages checkpointed in memory before.
//! - [`Policy::Lru`]: nothing discarded, then on each node the least recently used copies go
//!   until it holds at most the threshold.
//!
//! When a policy keeps one copy of several, it keeps the most recently used one (the lowest
//! node on a tie): the one the computation is most likely to touch again. Kept active copies
//! are read-only (the checkpoint took write access away, so the next write is seen).
//!
//! Invariants (checked by the tests on every policy): a policy only ever removes copies or
//! turns an active copy into a readable recovery one — it never adds a copy or moves one to
//! another node; the result passes [`PageTable::check`] and holds no pure or pre-recovery copy.

use crate::pages::{Category, Frame, Kind, Page, PageTable};
use psls_svm::NodeId;
use std::collections::BTreeMap;

/// A cleaning policy (chosen in the cluster config, overridable per job).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Policy {
    NoCleaning,
    Total,
    P1,
    P2,
    P3,
    /// Least recently used copies go until each node holds at most `frames`.
    Lru {
        frames: u64,
    },
}

impl Policy {
    /// How many of the pages a node held active before a rollback it loads again ahead of the
    /// restarted ranks (`psls run --prefetch`, paper §3.3: "the same strategies as the ones
    /// driving the cleaner algorithm variants"): what the policy keeps in memory after a
    /// cleaner. Total cleaning keeps nothing there, so nothing; LRU keeps at most `frames` per
    /// node; the others keep a copy of every page that was loaded, so all (`None`).
    pub fn prefetch_limit(&self) -> Option<u64> {
        match self {
            Policy::Total => Some(0),
            Policy::Lru { frames } => Some(*frames),
            Policy::NoCleaning | Policy::P1 | Policy::P2 | Policy::P3 => None,
        }
    }
}

/// Every policy with its name, for benchmarks and the help text (`Lru` with a placeholder).
pub const NAMES: &[&str] = &["none", "total", "p1", "p2", "p3", "lru:FRAMES"];

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Policy::NoCleaning => f.write_str("none"),
            Policy::Total => f.write_str("total"),
            Policy::P1 => f.write_str("p1"),
            Policy::P2 => f.write_str("p2"),
            Policy::P3 => f.write_str("p3"),
            Policy::Lru { frames } => write!(f, "lru:{frames}"),
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Policy, String> {
        Ok(match s {
            "none" => Policy::NoCleaning,
            "total" => Policy::Total,
            "p1" => Policy::P1,
            "p2" => Policy::P2,
            "p3" => Policy::P3,
            _ => match s.strip_prefix("lru:").map(str::parse::<u64>) {
                Some(Ok(frames)) => Policy::Lru { frames },
                _ => return Err(format!("unknown cleaning policy '{s}' (one of: {})", NAMES.join(", "))),
            },
        })
    }
}

/// Copies of `page` in `category`, most recently used first (lowest node on a tie).
fn preferred(page: &Page, category: Category) -> Vec<Frame> {
    let mut v: Vec<Frame> = page.of(category).copied().collect();
    v.sort_by(|a, b| b.last_use.cmp(&a.last_use).then(a.node.cmp(&b.node)));
    v
}

fn as_category(frames: impl IntoIterator<Item = Frame>, category: Category) -> Vec<Frame> {
    frames.into_iter().map(|f| Frame { category, ..f }).collect()
}

const READ_ONLY: Category = Category::Active { writable: false };

impl Policy {
    /// The copies of `page` kept after a cleaner checkpoint (per page; `Lru` applies its
    /// bound in [`Policy::clean`]).
    pub fn keep(&self, page: &Page) -> Vec<Frame> {
        let active = preferred(page, READ_ONLY);
        let readable = preferred(page, Category::ReadableRecovery);
        let one_active = || as_category(active.iter().copied().take(1), READ_ONLY);
        match (self, page.kind()) {
            (Policy::Total, _) => Vec::new(),
            (Policy::NoCleaning | Policy::Lru { .. }, _) => {
                let mut v = as_category(active.iter().copied(), READ_ONLY);
                v.extend(readable);
                v
            }
            (Policy::P1 | Policy::P2 | Policy::P3, Kind::Clean) => one_active(),
            (Policy::P1 | Policy::P2, Kind::DirtyActive) => {
                as_category(active.iter().copied().take(2), Category::ReadableRecovery)
            }
            (Policy::P3, Kind::DirtyActive) => one_active(),
            (Policy::P1 | Policy::P3, Kind::Checkpointed) => readable,
            (Policy::P2, Kind::Checkpointed) => Vec::new(),
        }
    }

    /// The table after a cleaner checkpoint under this policy.
    pub fn clean(&self, before: &PageTable) -> PageTable {
        let mut after = PageTable::default();
        for (id, page) in &before.pages {
            let frames = self.keep(page);
            if !frames.is_empty() {
                after.pages.insert(
                    *id,
                    Page {
                        dirty: false,
                        modified: false,
                        frames,
                    },
                );
            }
        }
        if let Policy::Lru { frames: bound } = *self {
            // Per node, its copies from the least recently used; drop until within the bound.
            let mut per_node: BTreeMap<NodeId, Vec<(u64, psls_svm::PageId)>> = BTreeMap::new();
            for (id, p) in &after.pages {
                for f in &p.frames {
                    per_node.entry(f.node).or_default().push((f.last_use, *id));
                }
            }
            for (node, mut copies) in per_node {
                copies.sort();
                let excess = (copies.len() as u64).saturating_sub(bound) as usize;
                for (_, id) in copies.into_iter().take(excess) {
                    if let Some(p) = after.pages.get_mut(&id) {
                        p.frames.retain(|f| f.node != node);
                    }
                }
            }
            after.pages.retain(|_, p| !p.frames.is_empty());
        }
        after
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pages::test_support::{frame as f, page};

    #[test]
    fn prefetch_follows_what_each_policy_keeps_in_memory() {
        assert_eq!(Policy::Total.prefetch_limit(), Some(0));
        assert_eq!(Policy::Lru { frames: 300 }.prefetch_limit(), Some(300));
        for p in [Policy::NoCleaning, Policy::P1, Policy::P2, Policy::P3] {
            assert_eq!(p.prefetch_limit(), None, "{p}");
        }
    }

    const RO: Category = Category::Active { writable: false };
    const RW: Category = Category::Active { writable: true };
    const RR: Category = Category::ReadableRecovery;
    const PURE: Category = Category::PureRecovery;

    /// The paper's Figure 2 (nodes 0 and 1), plus a page written on one node only since it
    /// was checkpointed, and a page read on three nodes:
    /// - 0: checkpointed in memory, then written: active on nodes 0 and 1 (read-only after
    ///   the write was shared), two pure recovery copies;
    /// - 1: checkpointed in memory, not written since: two readable recovery copies;
    /// - 2: written since it was loaded, never checkpointed in memory: active on 0 and 1;
    /// - 3: loaded on node 1, never written;
    /// - 4: like 0 but not shared: one writable copy on node 0, two pure recovery copies;
    /// - 5: loaded on nodes 0, 1 and 2, never written (node 2 used it last).
    fn figure2() -> PageTable {
        let mut t = PageTable::default();
        let mut put = |i, dirty, modified, frames: Vec<Frame>| {
            t.pages.insert(
                page(i),
                Page {
                    dirty,
                    modified,
                    frames,
                },
            );
        };
        put(
            0,
            true,
            true,
            vec![f(0, RO, 5), f(1, RO, 7), f(0, PURE, 0), f(1, PURE, 0)],
        );
        put(1, true, false, vec![f(0, RR, 3), f(1, RR, 2)]);
        put(2, true, true, vec![f(0, RO, 4), f(1, RO, 4)]);
        put(3, false, false, vec![f(1, RO, 1)]);
        put(4, true, true, vec![f(0, RW, 9), f(0, PURE, 0), f(1, PURE, 0)]);
        put(5, false, false, vec![f(0, RO, 1), f(1, RO, 2), f(2, RO, 6)]);
        t.check().expect("figure 2 is a valid state");
        t
    }

    /// What each page keeps: per page index, (node, category) in order.
    type Kept = BTreeMap<u64, Vec<(u32, Category)>>;

    fn kept(t: &PageTable) -> Kept {
        t.pages
            .iter()
            .map(|(id, p)| (id.index, p.frames.iter().map(|f| (f.node.0, f.category)).collect()))
            .collect()
    }

    fn expect(v: &[(u64, &[(u32, Category)])]) -> Kept {
        v.iter().map(|(i, fs)| (*i, fs.to_vec())).collect()
    }

    /// Every policy: only removes copies or turns active into readable recovery, on the same
    /// node; the result is valid, clean, and holds no pure or pre-recovery copy.
    fn invariants(policy: Policy, before: &PageTable, after: &PageTable) {
        after.check().unwrap_or_else(|e| panic!("{policy}: {e}"));
        for (id, p) in &after.pages {
            assert!(!p.dirty && !p.modified, "{policy}: page {id} not clean");
            let was = &before.pages[id];
            for fr in &p.frames {
                assert!(
                    matches!(
                        fr.category,
                        Category::Active { writable: false } | Category::ReadableRecovery
                    ),
                    "{policy}: page {id} keeps a {:?} copy",
                    fr.category
                );
                assert!(
                    was.frames.iter().any(|w| w.node == fr.node
                        && (w.category == fr.category
                            || matches!(w.category, Category::Active { .. })
                                && matches!(fr.category, Category::Active { .. } | Category::ReadableRecovery))),
                    "{policy}: page {id} gained a copy on {:?}",
                    fr.node
                );
            }
        }
    }

    #[test]
    fn each_policy_keeps_exactly_the_copies_it_defines() {
        let t = figure2();
        let cases: Vec<(Policy, Kept)> = vec![
            (
                Policy::NoCleaning,
                expect(&[
                    (0, &[(1, RO), (0, RO)]),
                    (1, &[(0, RR), (1, RR)]),
                    (2, &[(0, RO), (1, RO)]),
                    (3, &[(1, RO)]),
                    (4, &[(0, RO)]),
                    (5, &[(2, RO), (1, RO), (0, RO)]),
                ]),
            ),
            (Policy::Total, expect(&[])),
            (
                Policy::P1,
                expect(&[
                    (0, &[(1, RR), (0, RR)]),
                    (1, &[(0, RR), (1, RR)]),
                    (2, &[(0, RR), (1, RR)]),
                    (3, &[(1, RO)]),
                    (4, &[(0, RR)]),
                    (5, &[(2, RO)]),
                ]),
            ),
            (
                Policy::P2,
                expect(&[
                    (0, &[(1, RR), (0, RR)]),
                    (2, &[(0, RR), (1, RR)]),
                    (3, &[(1, RO)]),
                    (4, &[(0, RR)]),
                    (5, &[(2, RO)]),
                ]),
            ),
            (
                Policy::P3,
                expect(&[
                    (0, &[(1, RO)]),
                    (1, &[(0, RR), (1, RR)]),
                    (2, &[(0, RO)]),
                    (3, &[(1, RO)]),
                    (4, &[(0, RO)]),
                    (5, &[(2, RO)]),
                ]),
            ),
            // Nodes 0 and 1 hold 5 copies each: the least recently used go, down to 3 each
            // (node 0: pages 5 (use 1) and 1 (3); node 1: pages 3 (1) and 1 (2, before page
            // 5's 2)); node 2's one copy stays.
            (
                Policy::Lru { frames: 3 },
                expect(&[
                    (0, &[(1, RO), (0, RO)]),
                    (2, &[(0, RO), (1, RO)]),
                    (4, &[(0, RO)]),
                    (5, &[(2, RO), (1, RO)]),
                ]),
            ),
        ];
        for (policy, want) in cases {
            let after = policy.clean(&t);
            invariants(policy, &t, &after);
            assert_eq!(kept(&after), want, "{policy}");
        }
    }

    #[test]
    fn policies_parse_and_print() {
        for p in [
            Policy::NoCleaning,
            Policy::Total,
            Policy::P1,
            Policy::P2,
            Policy::P3,
            Policy::Lru { frames: 1000 },
        ] {
            assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
        }
        assert!("p4"
            .parse::<Policy>()
            .unwrap_err()
            .contains("unknown cleaning policy 'p4'"));
        assert!("lru:x".parse::<Policy>().is_err());
    }
}
