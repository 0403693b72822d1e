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
use psls_svm::FileId;

impl SvmShell {
    /// Drops every copy here of `files` and of `job`'s volatile segments; returns the volatile
    /// segments' ids. Processes waiting in a fault on them are told to end (their view was
    /// rolled back).
    pub fn drop_for_rollback(&self, node: &Node, job: &str, files: &[FileId]) -> Vec<FileId> {
        let mut g = self.inner.locked();
        let volatile = g.job_segments(job);
        let mut ended: Vec<(i32, String)> = Vec::new();
        for id in files.iter().chain(volatile.iter()) {
            if let Some(seg) = g.segs.get_mut(id) {
                seg.empty(node.name(), *id, "a rollback");
                let message = format!("'{}' was rolled back to the last checkpoint of job {job}", seg.name);
                ended.extend(g.fail_waiters(*id, &message));
            }
            if let Some(svm) = g.svm.as_mut() {
                svm.forget_file(*id);
            }
        }
        drop(g);
        for (pid, message) in ended {
            self.end_client(node, pid, message);
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
