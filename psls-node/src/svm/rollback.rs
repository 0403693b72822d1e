//! A job's rollback in this node's shared memory: every copy here of the job's files and
//! volatile segments goes (the pages are punched out of the memfds, their dirty bits and
//! coherence state dropped), so that every page of them is next loaded from its last
//! persistent checkpoint; once every node did so, their directories are empty and true, and
//! a node that restarted (whose manager state died) serves them again.
//!
//! Invariant: `serve_rebuilt` is called only after `drop_for_rollback` has run on every live
//! node (the recovery orchestrator waits for every answer in between).

use super::state::*;
use crate::failstop::Locked;
use crate::node::Node;
use psls_svm::coherence::WaiterId;
use psls_svm::{FileId, PAGE_SIZE};

impl SvmShell {
    /// Drops every copy here of `files` and of `job`'s volatile segments; returns the volatile
    /// segments' ids. Processes waiting in a fault on them are told to end (their view was
    /// rolled back).
    pub fn drop_for_rollback(&self, node: &Node, job: &str, files: &[FileId]) -> Vec<FileId> {
        let mut g = self.inner.locked();
        let volatile: Vec<FileId> = g
            .segs
            .iter()
            .filter(|(_, s)| matches!(&s.backing, Backing::Volatile { job: Some(j) } if j == job))
            .map(|(id, _)| *id)
            .collect();
        let mut ended: Vec<(i32, String)> = Vec::new();
        for id in files.iter().chain(volatile.iter()) {
            if let Some(seg) = g.segs.get_mut(id) {
                let len = (seg.pages * PAGE_SIZE as u64) as i64;
                let punch =
                    nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
                if let Err(e) = nix::fcntl::fallocate(&seg.memfd, punch, 0, len) {
                    // Fail closed: a page that cannot be dropped must not stay readable.
                    tracing::error!(node = %node.name(), file = %id, error = %e, "emptying a segment for a rollback failed; stopping");
                    std::process::abort();
                }
                seg.dirty = Dirty::new(seg.pages);
                let message = format!("'{}' was rolled back to the last checkpoint of job {job}", seg.name);
                let waiting: Vec<WaiterId> = g
                    .waiters
                    .iter()
                    .filter(|(_, w)| w.map.file == *id)
                    .map(|(k, _)| *k)
                    .collect();
                for w in waiting {
                    if let Some(w) = g.waiters.remove(&w) {
                        ended.push((w.map.pid, message.clone()));
                    }
                }
            }
            if let Some(svm) = g.svm.as_mut() {
                svm.forget_file(*id);
            }
        }
        drop(g);
        for (pid, message) in ended {
            if let Some(lines) = self.lifelines.locked().get(&pid) {
                for (_, tx) in lines {
                    let _ = tx.send(message.clone());
                }
            }
        }
        tracing::info!(node = %node.name(), job, files = files.len(), volatile = volatile.len(), "job's pages dropped for a rollback");
        volatile
    }

    /// Every node dropped `files`: their directories are rebuilt (managers that hold no
    /// segment of them forget them too). A node that restarted and has no coherence state yet
    /// starts it now, so that it knows these files are served.
    pub fn serve_rebuilt(&self, node: &Node, files: &[FileId]) {
        let mut g = self.inner.locked();
        if let Err(e) = super::fault::ensure_svm(&mut g, node) {
            tracing::warn!(node = %node.name(), error = %e, "no coherence state to rebuild directories in");
        }
        let held: Vec<bool> = files.iter().map(|f| g.segs.contains_key(f)).collect();
        if let Some(svm) = g.svm.as_mut() {
            for (f, held) in files.iter().zip(held) {
                if !held {
                    svm.forget_file(*f);
                }
                svm.directory_rebuilt(*f);
            }
        }
    }
}
