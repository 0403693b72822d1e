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
            return Err(OpError::new(
                ErrorKind::Exists,
                format!(
                    "'{}' is mapped writable by job {w}: one job writes a file at a time (map it read-only, or wait for that job to end)",
                    f.name
                ),
            ));
        }
        self.node
            .submit(MetaOp::ClaimWriter {
                file,
                job: job.to_string(),
            })
            .await?;
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
        self.node.submit(MetaOp::ReleaseWriter { file, job }).await
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
            let op = MetaOp::ReleaseWriter { file, job: job.clone() };
            if let Err(e) = self.node.submit(op).await {
                tracing::warn!(node = %self.node.name(), pid, %file, error = %e, "could not release a file's writer claim");
            }
        }
    }
}
