//! A job's rollback after a node failure (DESIGN §8), run by the job's launcher: the job's
//! ranks are stopped everywhere; once every logical node is live again (the failed one back
//! with an empty memory), the coordinator fences every epoch the job began, and what is
//! committed then is the checkpoint the job restarts from; every node drops every copy of the
//! job's files and volatile segments (so each page is next loaded from that checkpoint), and
//! once all did, their directories are rebuilt (a restarted node serves their pages again).
//! The launcher then starts the ranks again, telling them the checkpoint.
//!
//! Invariant: no rank of the new start runs before every node dropped the job's pages and the
//! epoch to restart from is fenced above every epoch begun (so no checkpoint of the stopped
//! run can commit later).

use crate::ckpt::{state_file_name, CkptShell};
use crate::launcher::{kill_everywhere, JobSpec};
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::ErrorKind;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rolls `spec`'s job back; returns the checkpoint it restarts from (0: its start).
pub async fn roll_back(node: &Arc<Node>, ckpt: &Arc<CkptShell>, spec: &JobSpec) -> Result<u64, OpError> {
    let job = spec.job.as_str();
    kill_everywhere(node, job).await;
    // Every logical node live again.
    let deadline = Instant::now() + Duration::from_millis(spec.respawn_timeout_ms);
    loop {
        let st = node.meta_state();
        let down: Vec<String> = node
            .logical_map(&st)
            .into_values()
            .filter(|p| !node.is_live(p))
            .collect();
        if down.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(OpError::new(
                ErrorKind::Unavailable,
                format!(
                    "{} did not come back within {} s",
                    down.join(", "),
                    spec.respawn_timeout_ms / 1000
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let epoch = ckpt.rollback_fence(job).await?;
    let mut files = crate::launcher::job_files(node, job, false).await;
    if let Ok(area) = crate::pfs::lookup_file(node, &state_file_name(job)) {
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
    tracing::warn!(node = %node.name(), job, epoch, files = files.len(), "job rolled back");
    Ok(epoch)
}
