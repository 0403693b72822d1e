//! A job's restore, the step of its rollback after a node failure (DESIGN §8) that job control
//! (`psls_jobs::Control`, through `crate::jobctl`) asks for once the job's ranks are stopped on
//! every node and every logical node is live again (the failed one back with an empty memory,
//! or a spare in its place): the coordinator fences every epoch the job began, and what is
//! committed then — the newest memory checkpoint whose copies are intact, or the persistent
//! one — is the checkpoint the job restarts from; every node drops every copy of the job's
//! files and volatile segments (so each page is next loaded from that checkpoint), and once all
//! did, their directories are rebuilt (a restarted node serves their pages again).
//!
//! Invariant: the epoch to restart from is fenced above every epoch begun (so no checkpoint
//! of the stopped run can commit later), and every node dropped the job's pages, before the
//! step answers (and so before job control records the next start).
//! Every step is idempotent: a restore cut short by a failure is done again whole.

use crate::ckpt::{state_file_name, CkptShell};
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::ErrorKind;
use std::sync::Arc;

/// Restores `job` to its newest intact checkpoint on every node; returns its epoch (0: the
/// job's start).
pub async fn restore(node: &Arc<Node>, ckpt: &Arc<CkptShell>, job: &str) -> Result<u64, OpError> {
    let st = node.meta_state();
    if let Some((_, p)) = node.logical_map(&st).into_iter().find(|(_, p)| !node.is_live(p)) {
        return Err(OpError::new(ErrorKind::Unavailable, format!("{p} is not live")));
    }
    let options = st.job_options.get(job).cloned().unwrap_or_default();
    let prefetching = options.prefetch;
    let cleaning: psls_ckpt::cleaning::Policy = options.cleaning.parse().unwrap_or_else(|_| node.default_cleaning());
    // Above every epoch a node saw: memory epochs leave no record.
    let seen = memory_states(node, job)
        .await?
        .iter()
        .map(|s| s.seen)
        .max()
        .unwrap_or(0);
    let (persistent, fenced) = ckpt.rollback_fence(job, seen).await?;
    let epoch = settle_memory(node, job, persistent, fenced).await?;
    let mut files = crate::launcher::job_files(node, job, false).await;
    if let Ok(area) = crate::pfs::lookup_file(node, &state_file_name(job)).await {
        files.push(area.id);
    }
    files.sort_unstable();
    files.dedup();
    let st = node.meta_state();
    let nodes: Vec<String> = node.logical_map(&st).into_values().collect();
    let mut all = files.clone();
    for p in &nodes {
        let req = PeerReq::RollbackDrop {
            job: job.to_string(),
            files: files.clone(),
        };
        match node.call_ok(p, req).await? {
            PeerResp::Dropped { files: volatile } => all.extend(volatile),
            other => {
                return Err(OpError::new(
                    ErrorKind::Internal,
                    format!("{p}: unexpected answer {other:?}"),
                ))
            }
        }
    }
    all.sort_unstable();
    all.dedup();
    for p in &nodes {
        node.call_ok(p, PeerReq::RollbackServe { files: all.clone() }).await?;
    }
    if prefetching {
        let pages = prefetch(node, job, &nodes, cleaning.prefetch_limit()).await;
        tracing::info!(node = %node.name(), job, epoch, pages, "pages prefetched after the rollback");
    }
    tracing::warn!(node = %node.name(), job, epoch, files = files.len(), "job rolled back");
    Ok(epoch)
}

/// `psls run --prefetch`: every node loads again the pages of `job` it held when the rollback
/// dropped them (at most `limit` each), all at once; returns how many are loaded. A node that
/// fails to answer only loses its prefetch: its ranks fault the pages in as usual.
async fn prefetch(node: &Arc<Node>, job: &str, nodes: &[String], limit: Option<u64>) -> u64 {
    let mut asks = tokio::task::JoinSet::new();
    for p in nodes {
        let (node, p, job) = (node.clone(), p.clone(), job.to_string());
        asks.spawn(async move {
            let r = node.call_ok(&p, PeerReq::RollbackPrefetch { job, limit }).await;
            (p, r)
        });
    }
    let mut pages = 0;
    while let Some(r) = asks.join_next().await {
        match r {
            Ok((_, Ok(PeerResp::Prefetched { pages: n }))) => pages += n,
            Ok((p, Ok(other))) => {
                tracing::warn!(node = %node.name(), job, peer = %p, answer = ?other, "unexpected answer to a prefetch")
            }
            Ok((p, Err(e))) => tracing::warn!(node = %node.name(), job, peer = %p, error = %e, "no prefetch there"),
            Err(e) => tracing::warn!(node = %node.name(), job, error = %e, "a prefetch task failed"),
        }
    }
    pages
}

/// A node's memory-checkpoint state of a job (`FramesReq::State`).
struct MemState {
    logical: u32,
    committed: u64,
    pre: Option<u64>,
    seen: u64,
    files: Vec<psls_svm::FileId>,
}

/// Every logical node's memory-checkpoint state of `job`.
async fn memory_states(node: &Arc<Node>, job: &str) -> Result<Vec<MemState>, OpError> {
    let st = node.meta_state();
    let mut out = Vec::new();
    for (l, p) in node.logical_map(&st) {
        let req = PeerReq::Frames(crate::peer::FramesReq::State { job: job.to_string() });
        match node.call_ok(&p, req).await? {
            PeerResp::MemState {
                committed,
                pre,
                seen,
                files,
                ..
            } => out.push(MemState {
                logical: l,
                committed,
                pre,
                seen,
                files,
            }),
            other => {
                return Err(OpError::new(
                    ErrorKind::Internal,
                    format!("{p}: unexpected answer {other:?}"),
                ))
            }
        }
    }
    Ok(out)
}

/// The memory level of a rollback (DESIGN §8, `psls_ckpt::frames::rollback_target`): the
/// job restarts from the last memory checkpoint a node committed, if it is newer than the
/// persistent one (`persistent`) and no page lost both recovery copies; every node settles its
/// recovery copies to it, and the copies a restarted or replaced node held are re-created from
/// the other holder, so the next failure is tolerated at once. Returns the epoch the job
/// restarts from.
async fn settle_memory(node: &Arc<Node>, job: &str, persistent: u64, fenced: u64) -> Result<u64, OpError> {
    use crate::peer::FramesReq;
    let states = memory_states(node, job).await?;
    let mut files: Vec<psls_svm::FileId> = states.iter().flat_map(|s| s.files.iter().copied()).collect();
    files.sort_unstable();
    files.dedup();
    let table: Vec<(u32, u64, Option<u64>)> = states.iter().map(|s| (s.logical, s.committed, s.pre)).collect();
    let nodes = states.len() as u32;
    let (target, lost) = psls_ckpt::frames::rollback_target(&table, persistent, nodes);
    let newest = table.iter().map(|s| s.1).max().unwrap_or(0);
    if target == 0 && newest > persistent {
        tracing::warn!(node = %node.name(), job, memory = newest, persistent, ?lost, "both recovery copies of some pages are lost: back to the persistent checkpoint");
    }
    let st = node.meta_state();
    let map = node.logical_map(&st);
    for p in map.values() {
        let req = PeerReq::Frames(FramesReq::Settle {
            job: job.to_string(),
            target,
            fenced,
            files: files.clone(),
        });
        node.call_ok(p, req).await?;
    }
    if target > 0 && !lost.is_empty() {
        let mut recreated = 0;
        for p in map.values() {
            let req = PeerReq::Frames(FramesReq::Recreate {
                job: job.to_string(),
                lost: lost.clone(),
            });
            if let PeerResp::Recreated { pages } = node.call_ok(p, req).await? {
                recreated += pages;
            }
        }
        tracing::info!(node = %node.name(), job, memory = target, ?lost, recreated, "recovery copies re-created");
    }
    Ok(target.max(persistent))
}

/// The newest memory checkpoint of `job` any node committed (0: none, or a node did not answer).
pub async fn memory_committed(node: &Arc<Node>, job: &str) -> u64 {
    memory_states(node, job)
        .await
        .map(|s| s.iter().map(|m| m.committed).max().unwrap_or(0))
        .unwrap_or(0)
}
