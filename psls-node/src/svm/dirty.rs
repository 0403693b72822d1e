//! What a checkpoint takes from this node's memory: the pages of given files that clients here
//! may have written since the last checkpoint took them ([`SvmShell::take_dirty`]), and giving
//! them back when that checkpoint does not commit ([`SvmShell::restore_dirty`]).
//!
//! A page is taken under the shell's lock: it is write-protected in every client mapping first
//! (this node keeps its write access in the protocol), then copied, then its bit is cleared. A
//! client that writes it again faults, is let through at once, and the bit is set again, so a
//! write made while a checkpoint runs is never lost: it is in the copy taken, or in the next
//! checkpoint.

use super::state::*;
use crate::failstop::Locked;
use psls_svm::coherence::Access;
use psls_svm::{FileId, PageId, PAGE_SIZE};
use std::os::unix::fs::FileExt;

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
        let mut out = Vec::new();
        for &file in files {
            let Some(seg) = segs.get_mut(&file) else { continue };
            let indices: Vec<u64> = seg.dirty.iter().filter(|&i| i < seg.pages).collect();
            if indices.is_empty() {
                continue;
            }
            let mut data = vec![0u8; indices.len() * PAGE_SIZE];
            // Run by run of consecutive pages: one write-protection per stretch this node may
            // write and per client mapping, one read of the memfd (a checkpoint's pages are
            // mostly long runs: a syscall per page was most of the pause).
            let writable =
                |i: u64| svm.as_ref().and_then(|s| s.access(PageId { file, index: i })) == Some(Access::Write);
            let mut k = 0;
            while k < indices.len() {
                let mut e = k + 1;
                while e < indices.len() && indices[e] == indices[e - 1] + 1 {
                    e += 1;
                }
                let mut a = k;
                while a < e {
                    if !writable(indices[a]) {
                        a += 1;
                        continue;
                    }
                    let mut b = a + 1;
                    while b < e && writable(indices[b]) {
                        b += 1;
                    }
                    let first = indices[a];
                    for m in seg.maps.iter().filter(|m| m.writable) {
                        // The pages of the run this mapping covers.
                        let end = (indices[b - 1] + 1).min(m.len.div_ceil(PAGE_SIZE) as u64);
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
                let first = indices[k];
                seg.memfd
                    .read_exact_at(&mut data[k * PAGE_SIZE..e * PAGE_SIZE], first * PAGE_SIZE as u64)
                    .map_err(|err| {
                        format!(
                            "reading pages {first}..{} of {file} for a checkpoint: {err}",
                            indices[e - 1] + 1
                        )
                    })?;
                for &i in &indices[k..e] {
                    seg.dirty.clear(i);
                }
                k = e;
            }
            out.push(Taken { file, indices, data });
        }
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

    /// Dirty pages held here, over every segment (for status and tests).
    pub fn dirty_pages(&self) -> u64 {
        self.inner.locked().segs.values().map(|s| s.dirty.count()).sum()
    }
}
