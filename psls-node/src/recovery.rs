//! A job's restore, the step of its rollback after a node failure (DESIGN §8) that job control
//! (`psls_jobs::Control`, through job control's task) asks for once the job's ranks are stopped on
//! every node and every logical node is live again (the failed one back with an empty memory,
//! or a spare in its place).
//! The steps and their order are `psls_ckpt::restore::Restore`'s (the checkpoint simulator
//! drives the same machine); this module carries them out with one peer call each and holds no
//! decision of its own.
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
/// job's start). The order of the steps is `psls_ckpt::restore::Restore`'s; this carries them
/// out, one node call each, and fails at the first that fails.
pub async fn restore(
    node: &Arc<Node>,
    ckpt: &Arc<CkptShell>,
    job: &str,
    driving: &(dyn Fn() -> bool + Sync),
) -> Result<u64, OpError> {
    use crate::peer::FramesReq;
    use psls_ckpt::restore::{NodeState, Restore, RestoreAction};
    let st = node.meta_state();
    let map = node.logical_map(&st);
    if let Some(p) = map.values().find(|p| !node.is_live(p)) {
        return Err(OpError::new(ErrorKind::Unavailable, format!("{p} is not live")));
    }
    let options = st.job_options.get(job).cloned().unwrap_or_default();
    let cleaning: psls_ckpt::cleaning::Policy = options.cleaning.parse().unwrap_or_else(|_| node.default_cleaning());
    let mut files = crate::launcher::job_files(node, job, false).await;
    if let Ok(area) = crate::pfs::lookup_file(node, &state_file_name(job)).await {
        files.push(area.id);
    }
    let nodes: Vec<(u32, String)> = map.into_iter().collect();
    let mut r = Restore::new(job, &nodes, &files, options.prefetch);
    let internal = |e: psls_ckpt::restore::RestoreError| OpError::new(ErrorKind::Internal, e.to_string());
    let unexpected =
        |p: &str, other: PeerResp| OpError::new(ErrorKind::Internal, format!("{p}: unexpected answer {other:?}"));
    while let Some(a) = r.poll_action() {
        // A driver deposed or paused mid-restore stops before its next call: the next driver
        // restores again whole, and a late drop of this one must not undo its restart.
        if !driving() {
            return Err(OpError::new(
                ErrorKind::Unavailable,
                "this node no longer drives the job: the restore stops",
            ));
        }
        match a {
            RestoreAction::AskState { logical, node: p } => {
                let req = PeerReq::Frames(FramesReq::State { job: job.to_string() });
                match node.call_ok(&p, req).await? {
                    PeerResp::MemState {
                        committed,
                        pre,
                        seen,
                        files,
                        ..
                    } => {
                        let state = NodeState {
                            committed,
                            pre,
                            seen,
                            files,
                        };
                        r.handle_state(logical, &p, state).map_err(internal)?;
                    }
                    other => return Err(unexpected(&p, other)),
                }
            }
            RestoreAction::Fence { seen } => {
                let (persistent, fenced) = ckpt.rollback_fence(job, seen).await?;
                r.handle_fenced(persistent, fenced).map_err(internal)?;
            }
            RestoreAction::Settle {
                node: p,
                target,
                fenced,
                persistent,
                files,
            } => {
                let req = PeerReq::Frames(FramesReq::Settle {
                    job: job.to_string(),
                    target,
                    fenced,
                    persistent,
                    files,
                });
                node.call_ok(&p, req).await?;
                r.handle_settled(&p).map_err(internal)?;
            }
            RestoreAction::Recreate { node: p, target, lost } => {
                let req = PeerReq::Frames(FramesReq::Recreate {
                    job: job.to_string(),
                    target,
                    lost,
                });
                match node.call_ok(&p, req).await? {
                    PeerResp::Recreated { pages } => {
                        tracing::info!(node = %node.name(), job, peer = %p, pages, "recovery copies re-created")
                    }
                    other => return Err(unexpected(&p, other)),
                }
                r.handle_recreated(&p).map_err(internal)?;
            }
            RestoreAction::Adopt { node: p, target } => {
                let req = PeerReq::Frames(FramesReq::Adopt {
                    job: job.to_string(),
                    committed: target,
                });
                node.call_ok(&p, req).await?;
                r.handle_adopted(&p).map_err(internal)?;
            }
            RestoreAction::Drop { node: p, files } => {
                let req = PeerReq::RollbackDrop {
                    job: job.to_string(),
                    files,
                };
                match node.call_ok(&p, req).await? {
                    PeerResp::Dropped { files: volatile } => r.handle_dropped(&p, &volatile).map_err(internal)?,
                    other => return Err(unexpected(&p, other)),
                }
            }
            RestoreAction::Serve { node: p, files } => {
                node.call_ok(&p, PeerReq::RollbackServe { files }).await?;
                r.handle_served(&p).map_err(internal)?;
            }
            RestoreAction::Prefetch { nodes } => {
                let pages = prefetch(node, job, &nodes, cleaning.prefetch_limit()).await;
                tracing::info!(node = %node.name(), job, pages, "pages prefetched after the rollback");
                r.handle_prefetched().map_err(internal)?;
            }
            RestoreAction::Done {
                epoch,
                memory,
                persistent,
                lost,
                given_up,
            } => {
                if given_up > 0 {
                    tracing::warn!(node = %node.name(), job, memory = given_up, persistent, ?lost, "recovery copies lost on more than one node (both copies of some pages may be gone): back to the persistent checkpoint");
                }
                tracing::warn!(node = %node.name(), job, epoch, memory, persistent, ?lost, files = files.len(), "job rolled back");
                return Ok(epoch);
            }
        }
    }
    Err(OpError::new(
        ErrorKind::Internal,
        format!("the restore of job {job} stopped short"),
    ))
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

/// The newest memory checkpoint of `job` any node committed (0: none, or a node did not answer).
pub async fn memory_committed(node: &Arc<Node>, job: &str) -> u64 {
    let st = node.meta_state();
    let mut newest = 0;
    for p in node.logical_map(&st).into_values() {
        let req = PeerReq::Frames(crate::peer::FramesReq::State { job: job.to_string() });
        match node.call_ok(&p, req).await {
            Ok(PeerResp::MemState { committed, .. }) => newest = newest.max(committed),
            _ => return 0,
        }
    }
    newest
}
