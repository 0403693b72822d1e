//! Page placement: page `(file, i)` has home node `h = (hash(file) + i) mod N` and mirror
//! node `(h + 1) mod N` (DESIGN §3). On each node, the pages it holds in one role form a
//! dense local array indexed by `i / N`.
//!
//! Invariants (property-tested): home ≠ mirror when N ≥ 2; for a fixed node, file and role the
//! local index is unique; every node holds ⌈pages/N⌉ or ⌊pages/N⌋ pages per role.

use psls_svm::{FileId, NodeId};
use serde::{Deserialize, Serialize};

/// Which copy of a page a node holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Role {
    Primary,
    Mirror,
}

impl Role {
    pub fn other(self) -> Role {
        match self {
            Role::Primary => Role::Mirror,
            Role::Mirror => Role::Primary,
        }
    }
    pub fn tag(self) -> char {
        match self {
            Role::Primary => 'p',
            Role::Mirror => 'm',
        }
    }
}

/// Placement over `n` logical nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    n: u32,
}

pub use psls_svm::rng::mix64;

impl Placement {
    /// `None` when `n < 2`: a mirrored store needs two nodes.
    pub fn new(n: u32) -> Option<Placement> {
        (n >= 2).then_some(Placement { n })
    }
    pub fn nodes(&self) -> u32 {
        self.n
    }
    /// The home node: the page's PFS primary (one definition, in
    /// `psls_svm::coherence::home_node`; its coherence manager is that of its run of pages).
    pub fn home(&self, file: FileId, index: u64) -> NodeId {
        psls_svm::coherence::home_node(file, index, self.n)
    }
    pub fn mirror(&self, file: FileId, index: u64) -> NodeId {
        NodeId((self.home(file, index).0 + 1) % self.n)
    }
    pub fn holder(&self, file: FileId, index: u64, role: Role) -> NodeId {
        match role {
            Role::Primary => self.home(file, index),
            Role::Mirror => self.mirror(file, index),
        }
    }
    /// Position of page `index` in the dense per-(node, role) array.
    pub fn local_index(&self, index: u64) -> u64 {
        index / self.n as u64
    }
    /// How many pages of a `pages`-page file `node` holds in `role` (closed form).
    pub fn held_count(&self, node: NodeId, file: FileId, pages: u64, role: Role) -> u64 {
        let first = self.first_held(node, file, role);
        if first >= pages {
            0
        } else {
            (pages - 1 - first) / self.n as u64 + 1
        }
    }

    fn first_held(&self, node: NodeId, file: FileId, role: Role) -> u64 {
        let n = self.n as u64;
        let shift = match role {
            Role::Primary => 0,
            Role::Mirror => 1,
        };
        // home(i) = (off + i) mod n == node - shift  ⇒  i ≡ node - shift - off (mod n)
        (node.0 as u64 % n + 2 * n - shift - self.home(file, 0).0 as u64) % n
    }

    /// Indices of the pages of a `pages`-page file that `node` holds in `role`, ascending.
    pub fn held(&self, node: NodeId, file: FileId, pages: u64, role: Role) -> impl Iterator<Item = u64> {
        (self.first_held(node, file, role)..pages).step_by(self.n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn placement_invariants(n in 2u32..9, file in any::<u64>(), pages in 0u64..300) {
            let p = Placement::new(n).unwrap();
            let f = FileId(file);
            let mut count = vec![[0u64; 2]; n as usize];
            for i in 0..pages {
                let h = p.home(f, i);
                let m = p.mirror(f, i);
                prop_assert_ne!(h, m);
                prop_assert!(h.0 < n && m.0 < n);
                count[h.0 as usize][0] += 1;
                count[m.0 as usize][1] += 1;
            }
            for node in 0..n {
                for (ri, role) in [Role::Primary, Role::Mirror].into_iter().enumerate() {
                    let held: Vec<u64> = p.held(NodeId(node), f, pages, role).collect();
                    prop_assert_eq!(held.len() as u64, count[node as usize][ri]);
                    prop_assert_eq!(p.held_count(NodeId(node), f, pages, role), held.len() as u64);
                    let mut locals: Vec<u64> = held.iter().map(|&i| p.local_index(i)).collect();
                    for &i in &held { prop_assert_eq!(p.holder(f, i, role), NodeId(node)); }
                    locals.dedup();
                    prop_assert_eq!(locals.len(), held.len());
                    let c = count[node as usize][ri];
                    prop_assert!(c == pages / n as u64 || c == pages.div_ceil(n as u64));
                }
            }
        }
    }

    #[test]
    fn single_node_is_refused() {
        assert!(Placement::new(1).is_none());
        assert!(Placement::new(0).is_none());
    }
}
