//! A job's rollback after a node failure (DESIGN §8), run by the job's launcher: the job's
//! ranks are stopped everywhere; once every logical node is live again — the failed one back
//! with an empty memory, or, when it is not back within the job's respawn timeout, a free
//! spare in its place (it takes the logical id and re-creates every page copy the lost node
//! held, from the other copies) — the coordinator fences every epoch the job began, and what is
//! committed then is the checkpoint the job restarts from; every node drops every copy of the
//! job's files and volatile segments (so each page is next loaded from that checkpoint), and
//! once all did, their directories are rebuilt (a restarted node serves their pages again).
//! The launcher then starts the ranks again, telling them the checkpoint.
//!
//! Invariant: no rank of the new start runs before every node dropped the job's pages and the
//! epoch to restart from is fenced above every epoch begun (so no checkpoint of the stopped
//! run can commit later).

use crate::ckpt::{state_file_name, CkptShell};
use crate::launcher::{kill_everywhere, JobSpec, Jobs};
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::ErrorKind;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a rollback waits, past the respawn timeout, for a spare to re-create its copies.
const REBUILD_TIMEOUT_MS: u64 = 10 * 60 * 1000;

/// Rollback passes tried before giving up: a node (or the coordinator) that fails during a
/// rollback starts the pass again, once it is back.
const MAX_ROLLBACK_PASSES: u32 = 8;

/// Rolls `spec`'s job back; returns the checkpoint it restarts from (0: its start). Every
/// step is idempotent, so a failure during a pass (a node down, the coordinator gone) is met
/// by another pass, after the nodes are back.
/// Its steps show in `psls jobs` (through `jobs`, the launcher's).
pub async fn roll_back(node: &Arc<Node>, ckpt: &Arc<CkptShell>, jobs: &Jobs, spec: &JobSpec) -> Result<u64, OpError> {
    let r = roll_back_passes(node, ckpt, jobs, spec).await;
    jobs.set_activity(&spec.job, None);
    r
}

async fn roll_back_passes(
    node: &Arc<Node>,
    ckpt: &Arc<CkptShell>,
    jobs: &Jobs,
    spec: &JobSpec,
) -> Result<u64, OpError> {
    let mut pass = 1;
    // When each node was first seen down (across passes): it gets the respawn timeout from
    // then, whichever pass finds it down.
    let mut down_since: HashMap<String, Instant> = HashMap::new();
    loop {
        let step = |what: String| {
            let what = if pass > 1 {
                format!("{what} (pass {pass})")
            } else {
                what
            };
            if jobs.set_activity(&spec.job, Some(format!("rolling back: {what}"))) {
                tracing::info!(node = %node.name(), job = %spec.job, step = %what, "rollback step");
            }
        };
        match roll_back_pass(node, ckpt, spec, &mut down_since, &step).await {
            Ok(epoch) => return Ok(epoch),
            Err(e) if e.kind == ErrorKind::Unavailable && pass < MAX_ROLLBACK_PASSES => {
                tracing::warn!(node = %node.name(), job = %spec.job, pass, error = %e, "rollback interrupted: trying again");
                pass += 1;
                // The failure detector has decided by then: the next pass waits for the node.
                tokio::time::sleep(Duration::from_millis(node.cfg.cluster.heartbeat_timeout_ms)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// One pass of a rollback; waits for each node down the respawn timeout from when it was
/// first seen down (`down_since`), then takes a spare in its place.
async fn roll_back_pass(
    node: &Arc<Node>,
    ckpt: &Arc<CkptShell>,
    spec: &JobSpec,
    down_since: &mut HashMap<String, Instant>,
    step: &(dyn Fn(String) + Sync),
) -> Result<u64, OpError> {
    let job = spec.job.as_str();
    step("stopping the ranks".into());
    kill_everywhere(node, job).await;
    // Every logical node live again (a spare in the place of one that does not come back),
    // and none still re-creating its copies.
    let respawn = Duration::from_millis(spec.respawn_timeout_ms);
    let rebuild_deadline = Instant::now() + respawn + Duration::from_millis(REBUILD_TIMEOUT_MS);
    loop {
        let st = node.meta_state();
        let down: Vec<(u32, String)> = node
            .logical_map(&st)
            .into_iter()
            .filter(|(_, p)| !node.is_live(p))
            .collect();
        let now = Instant::now();
        down_since.retain(|p, _| down.iter().any(|d| d.1 == *p));
        for (_, p) in &down {
            down_since.entry(p.clone()).or_insert(now);
        }
        if down.is_empty() && st.rebuilding.is_empty() {
            break;
        }
        // The longest down: its respawn timeout is over when `deadline` is past.
        let deadline = down
            .iter()
            .filter_map(|(_, p)| down_since.get(p))
            .min()
            .map_or(now, |since| *since + respawn);
        if down.is_empty() {
            step("a spare re-creates the copies of the node it replaces".into());
        } else {
            let names: Vec<&str> = down.iter().map(|d| d.1.as_str()).collect();
            step(format!(
                "waiting for {} to come back (a spare takes over after {} s)",
                names.join(", "),
                spec.respawn_timeout_ms / 1000
            ));
        }
        if !down.is_empty() && now >= deadline {
            // The one down longest.
            let Some((logical, lost)) = down
                .iter()
                .min_by_key(|(_, p)| down_since.get(p).copied().unwrap_or(now))
            else {
                continue;
            };
            let map = node.logical_map(&st);
            let spare = node
                .cfg
                .spares
                .iter()
                .map(|s| s.name.clone())
                .find(|s| !map.values().any(|p| p == s) && node.is_live(s));
            let Some(spare) = spare else {
                return Err(OpError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "{} did not come back within {} s and no spare is free",
                        down.iter().map(|d| d.1.as_str()).collect::<Vec<_>>().join(", "),
                        spec.respawn_timeout_ms / 1000
                    ),
                ));
            };
            tracing::warn!(node = %node.name(), job = %spec.job, logical, lost = %lost, %spare, "node not back: a spare takes its place");
            // A refusal may be a race (the node back at that moment, the spare taken): the
            // next pass looks again.
            crate::pfs::replace(node, *logical, &spare).await.map_err(|e| {
                OpError::new(
                    ErrorKind::Unavailable,
                    format!("replacing {lost} by {spare}: {}", e.message),
                )
            })?;
            continue;
        }
        if now >= rebuild_deadline {
            return Err(OpError::new(
                ErrorKind::Unavailable,
                "a spare's copies were not re-created in time",
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    step("fencing the checkpoints begun".into());
    // Above every epoch a node saw: memory epochs leave no record.
    let seen = memory_states(node, job)
        .await?
        .iter()
        .map(|s| s.seen)
        .max()
        .unwrap_or(0);
    let (persistent, fenced) = ckpt.rollback_fence(job, seen).await?;
    step("settling the memory checkpoint".into());
    let epoch = settle_memory(node, job, persistent, fenced).await?;
    step(format!("every node drops the pages written since checkpoint {epoch}"));
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
    step("directories rebuilt".into());
    for p in &nodes {
        node.call_ok(p, PeerReq::RollbackServe { files: all.clone() }).await?;
    }
    if spec.prefetch {
        step("loading again the pages that were active".into());
        let pages = prefetch(node, job, &nodes, spec.cleaning.prefetch_limit()).await;
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

/// What `psls run --resume` did.
pub enum Resumed {
    /// The job runs again: the new start's spec, where its ranks run, the per-node placement
    /// option and its events.
    Running(
        Box<JobSpec>,
        crate::launcher::Owners,
        Option<u32>,
        tokio::sync::mpsc::UnboundedReceiver<crate::launcher::JobEvent>,
    ),
    /// The job had finished computing; its result, restored from checkpoint `from`, is now
    /// written by persistent checkpoint `written`, and the job is over.
    Written { from: u64, written: u64 },
}

/// `psls run --resume JOB` by `caller` (uid, gid) with the environment `env`: starts `job`
/// again from its last committed checkpoint, on this node as its launcher — or, for a job
/// that finished computing but whose last persistent checkpoint failed, restores that result
/// and writes it.
pub async fn resume(
    node: &Arc<Node>,
    jobs: &Arc<crate::launcher::Jobs>,
    ckpt: &Arc<CkptShell>,
    job: &str,
    env: Vec<(String, String)>,
    caller: (u32, u32),
) -> Result<Resumed, OpError> {
    let st = node.meta_state();
    let Some(rec) = st.jobs.get(job) else {
        return Err(OpError::new(
            ErrorKind::NotFound,
            format!("no job {job} to resume (psls jobs lists the resumable ones)"),
        ));
    };
    let Some(sum) = rec.spec.clone() else {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("job {job} was not started by psls run"),
        ));
    };
    if rec.epoch == 0 && !st.finished.contains_key(job) {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("job {job} has no checkpoint to resume from"),
        ));
    }
    if caller.0 != 0 && caller.0 != sum.uid {
        return Err(OpError::new(
            ErrorKind::Permission,
            format!("job {job} belongs to uid {}: only it or root may resume it", sum.uid),
        ));
    }
    if crate::launcher::is_running(node, job).await {
        return Err(OpError::new(ErrorKind::Exists, format!("job {job} is running")));
    }
    let mut spec = JobSpec {
        job: job.to_string(),
        launcher: node.name().to_string(),
        size: sum.ranks,
        program: sum.program.clone(),
        args: sum.args.clone(),
        env,
        cwd: sum.cwd.clone(),
        uid: sum.uid,
        gid: sum.gid,
        checkpoint_interval_ms: sum.checkpoint_interval_ms,
        checkpoint_timeout_ms: sum.checkpoint_timeout_ms,
        max_restarts: sum.max_restarts,
        respawn_timeout_ms: sum.respawn_timeout_ms,
        // As the record keeps them (below); a record of an older format: the defaults.
        level: psls_ckpt::msg::Choice::Auto,
        persistent_interval_ms: node.cfg.cluster.persistent_interval_s.saturating_mul(1000),
        persistent_every: 0,
        cleaning: node.default_cleaning(),
        prefetch: false,
        // Exits of an earlier start are not this one's.
        attempt: sum.starts.max(1),
        restart_epoch: 0,
    };
    if let Some(o) = st.job_options.get(job) {
        crate::launcher::restore_options(node, &mut spec, o);
    }
    let rx = crate::launcher::register(jobs, job);
    let finished = st.finished.get(job).cloned();
    let restored = roll_back(node, ckpt, jobs, &spec).await;
    // A finished job whose result came back (its memory checkpoint, or a newer one): written,
    // and the job is over. If both copies of some of its pages were lost, it went back further:
    // its ranks run again from there, as for any resume.
    if let (Some(fin), Ok(from)) = (&finished, &restored) {
        if *from >= fin.epoch {
            let from = *from;
            let written = async {
                let done = ckpt.checkpoint(job, fin.files.clone()).await?;
                crate::launcher::drop_job_segments(node, job).await;
                ckpt.end_job(job).await;
                Ok::<_, OpError>(done.epoch)
            }
            .await;
            crate::launcher::finished(node, jobs, job);
            let written = written?;
            tracing::warn!(node = %node.name(), job, from, written, "a finished job's result written");
            return Ok(Resumed::Written { from, written });
        }
        tracing::warn!(node = %node.name(), job, from, result = fin.epoch, "a finished job's result was lost with two neighbouring nodes: its ranks run again");
    }
    let started = async {
        spec.restart_epoch = restored?;
        let op = psls_pfs::meta::MetaOp::StartJobWith {
            job: job.to_string(),
            spec: Box::new(crate::launcher::summary(&spec, sum.per_node, sum.starts + 1)),
            options: Box::new(crate::launcher::options(&spec)),
        };
        node.submit(op).await?;
        crate::launcher::spawn_all(node, &spec, sum.per_node).await
    }
    .await;
    match started {
        Ok(owners) => {
            tracing::warn!(node = %node.name(), job, epoch = spec.restart_epoch, "job resumed");
            Ok(Resumed::Running(Box::new(spec), owners, sum.per_node, rx))
        }
        Err(e) => {
            crate::launcher::finished(node, jobs, job);
            Err(e)
        }
    }
}
