//! One writer job per file (DESIGN §7): a parallel file is mapped writable by the processes of
//! at most one job at a time, so a job's checkpoint and rollback concern its own writes only.
//! The claim lives in the replicated metadata (`FileMeta::writer`, counted per process), so it
//! holds across coordinator changes and power cuts: a job that can be resumed keeps its files.
//!
//! Which job a process belongs to: a rank of `psls run` is its job's; a process outside `psls
//! run` with `PSLS_JOB` set is the job `ext:UID:NAME` (processes of one user sharing the name
//! form one job, as they share barriers, locks and volatile segments); any other process is a
//! job of its own (`proc:NODE:PID`).
//!
//! Claims are made once per (process, file) at its first writable mapping; a process outside
//! `psls run` releases at its last writable unmap of the file, or when it ends, after its
//! writes were made durable; a job's ranks' claims go when the job ends for good.
//!
//! So a file without a writer has every memory copy equal to the disks' (unless the last
//! durable write of a process that ended failed): the coherence layer lets go of its copies
//! freely when a node restarts (`psls_svm::coherence::Svm::set_settled`).

use super::round::CkptShell;
use crate::failstop::Locked;
use crate::op::OpError;
use psls_ipc::ErrorKind;
use psls_pfs::meta::MetaOp;
use psls_svm::FileId;
use std::collections::BTreeSet;

/// Whether `job` is the job of processes outside `psls run` (`ext:` or `proc:`), whose claims
/// go with the processes, not with an `EndJob`.
pub fn is_process_job(job: &str) -> bool {
    job.starts_with("ext:") || job.starts_with("proc:")
}

/// The job of a process outside `psls run` that set `PSLS_JOB` to `name`.
pub fn ext_job(uid: u32, name: &str) -> Result<String, OpError> {
    let job = format!("ext:{uid}:{name}");
    psls_pfs::jobs::validate_job(&job).map_err(OpError::from)?;
    Ok(job)
}

impl CkptShell {
    /// The job a process outside `psls run` joined with its first mapping (if it named one).
    pub fn ext_job_of(&self, pid: i32) -> Option<String> {
        self.claims
            .locked()
            .get(&pid)
            .map(|(j, _)| j.clone())
            .filter(|j| j.starts_with("ext:"))
    }

    /// Process `pid` of `job` maps `file` writable: claims the file for the job (refused with a
    /// clear error if another job writes it).
    pub async fn claim(&self, pid: i32, job: &str, file: FileId) -> Result<(), OpError> {
        {
            let claims = self.claims.locked();
            if claims.get(&pid).is_some_and(|(j, fs)| j == job && fs.contains(&file)) {
                return Ok(());
            }
        }
        let f = self
            .node
            .file_by_id(file)
            .ok_or_else(|| OpError::new(ErrorKind::NotFound, format!("no file with id {file}")))?;
        if let Some((w, _)) = f.writer.as_ref().filter(|(w, _)| w != job) {
            let st = self.node.meta_state();
            let busy = || {
                // A `psls run` job that is not running keeps its files until it is resumed
                // or dropped: say how.
                let msg = if !is_process_job(w) && !st.runs.contains_key(w) {
                    format!(
                        "'{}' is kept by job {w}, which ended and can be resumed: `psls run --resume {w}` finishes it, `psls jobs rm {w}` drops it and frees the file",
                        f.name
                    )
                } else {
                    format!(
                        "'{}' is mapped writable by job {w}: one job writes a file at a time (map it read-only, or wait for that job to end)",
                        f.name
                    )
                };
                OpError::new(ErrorKind::Exists, msg)
            };
            // A writer outside `psls run` whose processes all ran on node incarnations that
            // are over (down, or older than their node's incarnation heard now: incarnations
            // never repeat) holds nothing: those incarnations are recorded down, and the
            // claims go with them.
            let claims = st.process_claims.get(&file).cloned().unwrap_or_default();
            let over = |n: &str, i: u64| st.is_down(n, i) || self.node.heard_incarnation(n) > i;
            if !is_process_job(w) || claims.is_empty() || !claims.keys().all(|(n, i)| over(n, *i)) {
                return Err(busy());
            }
            let nodes: BTreeSet<&String> = claims
                .keys()
                .filter(|(n, i)| !st.is_down(n, *i))
                .map(|(n, _)| n)
                .collect();
            for n in nodes {
                let op = MetaOp::DeclareDown {
                    physical: n.clone(),
                    incarnation: self.node.heard_incarnation(n).saturating_sub(1),
                };
                tracing::info!(node = %self.node.name(), %file, peer = %n, "a writer claim of an earlier incarnation of {n} goes with it");
                self.node.submit(op).await?;
            }
        }
        self.node.submit(self.claim_op(job, file)).await?;
        self.claims
            .locked()
            .entry(pid)
            .or_insert_with(|| (job.to_string(), BTreeSet::new()))
            .1
            .insert(file);
        Ok(())
    }

    /// Remembers that process `pid` belongs to `job` (before any claim).
    pub fn join(&self, pid: i32, job: &str) {
        self.claims
            .locked()
            .entry(pid)
            .or_insert_with(|| (job.to_string(), BTreeSet::new()));
    }

    /// Process `pid` no longer maps `file` writable: its claim goes.
    pub async fn release(&self, pid: i32, file: FileId) -> Result<(), OpError> {
        let job = {
            let mut claims = self.claims.locked();
            match claims.get_mut(&pid) {
                Some((job, fs)) => {
                    if !fs.remove(&file) {
                        return Ok(());
                    }
                    job.clone()
                }
                None => return Ok(()),
            }
        };
        self.node.submit(self.release_op(&job, file)).await
    }

    /// The claim of `job` on `file` (or its release): a process's is made on this node's
    /// incarnation (it goes with it); a `psls run` job's holds until the job ends.
    fn claim_op(&self, job: &str, file: FileId) -> MetaOp {
        self.writer_op(job, file, true)
    }

    fn release_op(&self, job: &str, file: FileId) -> MetaOp {
        self.writer_op(job, file, false)
    }

    fn writer_op(&self, job: &str, file: FileId, claim: bool) -> MetaOp {
        let job = job.to_string();
        if !is_process_job(&job) {
            return if claim {
                MetaOp::ClaimWriter { file, job }
            } else {
                MetaOp::ReleaseWriter { file, job }
            };
        }
        let (node, incarnation) = (self.node.name().to_string(), self.node.incarnation);
        if claim {
            MetaOp::ClaimWriterOn {
                file,
                job,
                node,
                incarnation,
            }
        } else {
            MetaOp::ReleaseWriterOn {
                file,
                job,
                node,
                incarnation,
            }
        }
    }

    /// What process `pid` claims: its job and files.
    pub fn claimed(&self, pid: i32) -> Option<(String, Vec<FileId>)> {
        self.claims
            .locked()
            .get(&pid)
            .map(|(j, fs)| (j.clone(), fs.iter().copied().collect()))
    }

    /// Process `pid` ended: every claim it still holds goes — but a `psls run` job's, which
    /// its files keep until the job ends for good (`EndJob`): a rollback, a resumable job
    /// and a job finishing its last checkpoint still write them, with no rank running.
    pub async fn release_all(&self, pid: i32) {
        let Some((job, files)) = self.claims.locked().remove(&pid) else {
            return;
        };
        if !is_process_job(&job) {
            return;
        }
        for file in files {
            let op = self.release_op(&job, file);
            if let Err(e) = self.node.submit(op).await {
                tracing::warn!(node = %self.node.name(), pid, %file, error = %e, "could not release a file's writer claim");
            }
        }
    }
}

/// At a start: the claims that processes on this node's earlier incarnations still hold in
/// the metadata (they ended with that daemon, or were killed with it, and could not release
/// them) go, by recording those incarnations down — which they are. Retried until the metadata
/// answers, for at most `START_CLAIMS_LIMIT`.
pub async fn drop_earlier_claims(node: std::sync::Arc<crate::node::Node>) {
    const START_CLAIMS_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);
    let t = tokio::time::Instant::now();
    while t.elapsed() < START_CLAIMS_LIMIT {
        let st = match node.meta_fresh().await {
            Ok(st) => st,
            Err(_) => {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                continue;
            }
        };
        let me = node.name();
        let earlier = st
            .process_claims
            .values()
            .flat_map(|c| c.keys())
            .filter(|(n, i)| n == me && *i < node.incarnation && !st.is_down(n, *i))
            .map(|(_, i)| *i)
            .max();
        let Some(earlier) = earlier else { return };
        let op = MetaOp::DeclareDown {
            physical: me.to_string(),
            incarnation: node.incarnation - 1,
        };
        match node.submit(op).await {
            Ok(()) => {
                tracing::info!(node = %me, incarnation = node.incarnation, earlier, "the claims of this node's earlier processes went with their incarnation");
                return;
            }
            Err(e) => {
                tracing::debug!(node = %me, error = %e, "could not record this node's earlier incarnations down yet");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
        }
    }
}
