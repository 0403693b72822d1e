//! A job's rollback in this node's shared memory: every copy here of the job's files and
//! volatile segments goes (the pages are punched out of the memfds, their dirty bits and
//! coherence state dropped), so that every page of them is next loaded from its last
//! persistent checkpoint; once every node did so, their directories are empty and true, and
//! a node that restarted (whose manager state died) serves them again.
//!
//! With `psls run --prefetch`, the pages of the job's files each node held when they were
//! dropped are loaded again (read access, through the coherence protocol: from the restored
//! checkpoint's recovery copies or disks) once the directories are rebuilt, before the ranks
//! restart ([`SvmShell::prefetch_active`]), so the restarted ranks do not fault them in one by
//! one (paper §3.3: "load in advance the pages which were active").
//!
//! Invariant: `serve_rebuilt` is called only after `drop_for_rollback` has run on every live
//! node (the recovery orchestrator waits for every answer in between); a prefetch only after
//! `serve_rebuilt` everywhere.

use super::state::*;
use crate::failstop::Locked;
use crate::node::Node;
use psls_svm::coherence::Access;
use psls_svm::{FileId, PageId};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pages of a job remembered as active on one node, at most (4 GiB of them).
const MAX_ACTIVE_PAGES: usize = 1 << 20;
/// Jobs whose active pages a node remembers at once, at most.
const MAX_ACTIVE_JOBS: usize = 1024;
/// Prefetches in flight at once (each is a coherence transaction with the page's manager).
const PREFETCH_WINDOW: usize = 64;

impl SvmShell {
    /// Drops every copy here of `files` and of `job`'s volatile segments; returns the volatile
    /// segments' ids. Processes waiting in a fault on them are told to end (their view was
    /// rolled back).
    pub fn drop_for_rollback(&self, node: &Node, job: &str, files: &[FileId]) -> Vec<FileId> {
        let mut g = self.inner.locked();
        let volatile = g.job_segments(job);
        // What was active here, for a prefetch (a second pass of the rollback finds nothing
        // held any more and keeps what the first one saw).
        let active: Vec<PageId> = g
            .svm
            .as_ref()
            .map(|s| {
                s.held()
                    .map(|(p, _)| p)
                    .filter(|p| files.contains(&p.file))
                    .take(MAX_ACTIVE_PAGES)
                    .collect()
            })
            .unwrap_or_default();
        if !active.is_empty() {
            let mut sets = self.active.locked();
            if sets.contains_key(job) || sets.len() < MAX_ACTIVE_JOBS {
                sets.insert(job.to_string(), active);
            }
        }
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
    pub fn serve_rebuilt(self: &Arc<Self>, node: &Arc<Node>, files: &[FileId]) {
        let mut out = Vec::new();
        {
            let mut g = self.inner.locked();
            if let Err(e) = super::fault::ensure_svm(&mut g, node, &self.held.locked()) {
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
            // Requests that waited for a check of these files go on.
            super::fault::run(&mut g, node, &mut out);
        }
        self.dispatch(node, out);
    }

    /// Loads again, with read access, the pages of `job`'s files this node held when a
    /// rollback dropped them — at most `limit` (the cleaning policy's rule; `None`: all) —
    /// a window at a time, each waited for until `deadline`; returns how many are here now.
    /// The remembered set goes either way.
    pub async fn prefetch_active(
        self: &Arc<Self>,
        node: &Arc<Node>,
        job: &str,
        limit: Option<u64>,
        deadline: Instant,
    ) -> u64 {
        let mut pages = self.active.locked().remove(job).unwrap_or_default();
        if let Some(limit) = limit {
            pages.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        }
        let mut here = 0u64;
        for window in pages.chunks(PREFETCH_WINDOW) {
            {
                let mut g = self.inner.locked();
                let Inner { svm, segs, .. } = &mut *g;
                let Some(svm) = svm.as_mut() else { return here };
                // A page of a segment this node no longer has has nowhere to go.
                for p in window.iter().filter(|p| segs.contains_key(&p.file)) {
                    svm.prefetch(*p, Access::Read);
                }
                let mut out = Vec::new();
                super::fault::run(&mut g, node, &mut out);
                drop(g);
                self.dispatch(node, out);
            }
            loop {
                let held = {
                    let g = self.inner.locked();
                    let Some(svm) = g.svm.as_ref() else { return here };
                    window.iter().filter(|p| svm.access(**p).is_some()).count() as u64
                };
                if held == window.len() as u64 || Instant::now() >= deadline {
                    here += held;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        tracing::info!(node = %node.name(), job, asked = pages.len(), here, "active pages prefetched after a rollback");
        here
    }

    /// `job` ended: its remembered active pages go.
    pub fn forget_active(&self, job: &str) {
        self.active.locked().remove(job);
    }
}
