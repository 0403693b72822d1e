//! How a participant sends the pages it took: per page, to its two holders (primary and
//! mirror, by placement), in batches of at most [`BATCH_PAGES`] pages per holder, each
//! batch's bytes gathered into a pooled buffer only when it is reached (so a checkpoint never
//! holds a second copy of all its pages). The persistent level sends this way, to the holders'
//! disks (`round`); the memory level keeps a copy on the writer (`memory::plan`).

use crate::peer::BATCH_PAGES;
use crate::svm::Taken;
use psls_pfs::{Placement, PooledBuf, Role};
use psls_svm::{FileId, NodeId, PAGE_SIZE};
use std::collections::BTreeMap;

/// One batch: pages of one file for one holder of one copy.
pub(super) struct Batch {
    pub file: FileId,
    pub role: Role,
    pub holder: NodeId,
    pub indices: Vec<u64>,
    pub data: PooledBuf,
}

/// The batches of `taken`: per file, the primary copies, then the mirror copies, per holder.
pub(super) fn batches(p: Placement, taken: &[Taken]) -> impl Iterator<Item = Batch> + '_ {
    taken.iter().flat_map(move |t| {
        [Role::Primary, Role::Mirror].into_iter().flat_map(move |role| {
            let mut by_node: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
            for (k, &i) in t.indices.iter().enumerate() {
                by_node.entry(p.holder(t.file, i, role)).or_default().push(k);
            }
            by_node.into_iter().flat_map(move |(holder, ks)| {
                let chunks: Vec<Vec<usize>> = ks.chunks(BATCH_PAGES).map(<[usize]>::to_vec).collect();
                chunks.into_iter().map(move |chunk| {
                    let mut data = crate::peer::batch_pool().get();
                    for &k in &chunk {
                        data.extend_from_slice(&t.data[k * PAGE_SIZE..][..PAGE_SIZE]);
                    }
                    Batch {
                        file: t.file,
                        role,
                        holder,
                        indices: chunk.iter().map(|&k| t.indices[k]).collect(),
                        data,
                    }
                })
            })
        })
    })
}

/// Where a participant is in its batches, for a test's failpoint halfway through them.
pub(super) struct Halfway {
    half: usize,
    sent: usize,
}

impl Halfway {
    pub fn new(taken: &[Taken]) -> Halfway {
        Halfway {
            half: taken.iter().map(|t| t.indices.len()).sum(),
            sent: 0,
        }
    }

    /// A batch of `pages` is about to go: failpoint `name` is passed once, halfway.
    pub async fn next(&mut self, node: &str, pages: usize, name: &str) {
        if self.sent < self.half && self.sent + pages >= self.half {
            crate::failpoint::pass_async(node, name).await;
        }
        self.sent += pages;
    }
}
