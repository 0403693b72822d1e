//! What a checkpoint takes from this node's memory: the pages of given files that clients here
//! may have written since the last checkpoint took them ([`SvmShell::take_dirty`]), and giving
//! them back when that checkpoint does not commit ([`SvmShell::restore_dirty`]).
//!
//! A page is taken under the shell's lock, with the job's ranks stopped at the checkpoint. A page
//! this node holds writable is left writable, and the bytes taken are kept beside it (a
//! *shadow*): the next checkpoint compares the page with them, so the ranks' next writes take
//! no write-protect fault. A page is dirty, and taken, when its bit is set or it differs from
//! its shadow. Beyond [`MAX_SHADOW_PAGES`], pages are write-protected in every client mapping
//! before they are copied, as a page without a shadow must be: a client that writes one again
//! faults, is let through at once, and its bit is set again. So a write made while a checkpoint
//! runs is never lost: it is in the copy taken, or in the next checkpoint (a write racing the
//! copy of a shadowed page makes the page differ from its shadow).

use super::state::*;
use crate::failstop::Locked;
use psls_svm::coherence::Access;
use psls_svm::{FileId, PageId, PAGE_SIZE};
use std::os::unix::fs::FileExt;

/// At most this many shadows over every segment of the node (64 MiB): beyond them, taken pages
/// are write-protected.
pub const MAX_SHADOW_PAGES: usize = 16 * 1024;

/// The pages taken from one file: their indices and their bytes (page `indices[i]` at
/// `data[i * 4096..]`).
pub struct Taken {
    pub file: FileId,
    pub indices: Vec<u64>,
    pub data: Vec<u8>,
}

impl SvmShell {
    /// Takes the dirty pages of `files` held here (see the module documentation).
    pub fn take_dirty(&self, files: &[FileId]) -> Result<Vec<Taken>, String> {
        let mut g = self.inner.locked();
        let Inner { svm, segs, .. } = &mut *g;
        let mut shadows: usize = segs.values().map(|s| s.shadows.len()).sum();
        let mut out = Vec::new();
        for &file in files {
            let Some(seg) = segs.get_mut(&file) else { continue };
            // Candidates: pages with their bit set, and pages left writable by the last take.
            let mut cands: Vec<u64> = seg.dirty.iter().filter(|&i| i < seg.pages).collect();
            cands.extend(seg.shadows.keys().copied().filter(|&i| i < seg.pages));
            cands.sort_unstable();
            cands.dedup();
            if cands.is_empty() {
                continue;
            }
            let writable =
                |i: u64| svm.as_ref().and_then(|s| s.access(PageId { file, index: i })) == Some(Access::Write);
            // Per candidate: whether it is write-protected (a writable page without room for a
            // shadow). Pages this node may only read are write-protected already.
            let mut protect = Vec::with_capacity(cands.len());
            for &i in &cands {
                let shadowed = seg.shadows.contains_key(&i);
                let w = writable(i);
                let keep = w && (shadowed || shadows < MAX_SHADOW_PAGES);
                if keep && !shadowed {
                    shadows += 1;
                }
                if !w && shadowed {
                    // Not writable here any more (an access change drops shadows; kept safe).
                    seg.shadows.remove(&i);
                    seg.dirty.set(i);
                    shadows -= 1;
                }
                protect.push(w && !keep);
            }
            let mut data = vec![0u8; cands.len() * PAGE_SIZE];
            // Run by run of consecutive pages: one write-protection per stretch to protect and
            // per client mapping, one read of the memfd (a checkpoint's pages are mostly long
            // runs: a syscall per page was most of the pause).
            let mut k = 0;
            while k < cands.len() {
                let mut e = k + 1;
                while e < cands.len() && cands[e] == cands[e - 1] + 1 {
                    e += 1;
                }
                let mut a = k;
                while a < e {
                    if !protect[a] {
                        a += 1;
                        continue;
                    }
                    let mut b = a + 1;
                    while b < e && protect[b] {
                        b += 1;
                    }
                    let first = cands[a];
                    for m in seg.maps.iter().filter(|m| m.writable) {
                        // The pages of the run this mapping covers.
                        let end = (cands[b - 1] + 1).min(m.len.div_ceil(PAGE_SIZE) as u64);
                        if end <= first {
                            continue;
                        }
                        let len = (end - first) as usize * PAGE_SIZE;
                        if let Err(e) = m.uffd.write_protect(m.addr_of(first) as *mut libc::c_void, len) {
                            tracing::debug!(pid = m.pid, file = %file, first, pages = end - first, error = %e, "write-protect for a checkpoint (client gone?)");
                        }
                    }
                    a = b;
                }
                let first = cands[k];
                seg.memfd
                    .read_exact_at(&mut data[k * PAGE_SIZE..e * PAGE_SIZE], first * PAGE_SIZE as u64)
                    .map_err(|err| {
                        format!(
                            "reading pages {first}..{} of {file} for a checkpoint: {err}",
                            cands[e - 1] + 1
                        )
                    })?;
                k = e;
            }
            // Keep the pages set or changed since their shadow; shadow the writable ones kept
            // writable. Pages are dropped from `data` in place, in order.
            let mut indices = Vec::with_capacity(cands.len());
            let mut kept = 0;
            for (p, &i) in cands.iter().enumerate() {
                let bytes = &data[p * PAGE_SIZE..(p + 1) * PAGE_SIZE];
                let changed = seg.dirty.is_set(i) || seg.shadows.get(&i).is_none_or(|s| s[..] != *bytes);
                seg.dirty.clear(i);
                if !changed {
                    continue;
                }
                if !protect[p] && writable(i) {
                    seg.shadows.insert(i, bytes.into());
                }
                data.copy_within(p * PAGE_SIZE..(p + 1) * PAGE_SIZE, kept * PAGE_SIZE);
                indices.push(i);
                kept += 1;
            }
            data.truncate(kept * PAGE_SIZE);
            debug_assert!(seg.shadows.keys().all(|&i| writable(i)));
            if !indices.is_empty() {
                out.push(Taken { file, indices, data });
            }
        }
        debug_assert!(shadows >= segs.values().map(|s| s.shadows.len()).sum::<usize>());
        Ok(out)
    }

    /// Pages taken by a checkpoint that did not commit are dirty again — those this node still
    /// holds (a copy dropped since went with the latest version to the node that wrote it).
    pub fn restore_dirty(&self, pages: &[(FileId, Vec<u64>)]) {
        let mut g = self.inner.locked();
        let Inner { svm, segs, .. } = &mut *g;
        for (file, indices) in pages {
            let Some(seg) = segs.get_mut(file) else { continue };
            for &i in indices {
                let page = PageId { file: *file, index: i };
                if svm.as_ref().and_then(|s| s.access(page)).is_some() {
                    seg.dirty.set(i);
                }
            }
        }
    }

    /// Pages held here that may be dirty, over every segment (status, heartbeats: whether a
    /// memory checkpoint surely fits).
    pub fn dirty_pages(&self) -> u64 {
        // A shadowed page counts as dirty: an upper bound, without comparing under the lock.
        self.inner
            .locked()
            .segs
            .values()
            .map(|s| s.dirty.count() + s.shadows.keys().filter(|&&i| !s.dirty.is_set(i)).count() as u64)
            .sum()
    }
}
