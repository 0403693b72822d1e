//! Local clients' requests as ranks of a job: a sync channel for barrier and lock calls (the
//! short path, served by the `psls-sync` thread), the same calls on this connection, and
//! `psls run` (the launcher's side: start the job, relay its output, end with its status).

use super::conn::{err, misrouted, ok_or_err, send, Conn, Flow};
use crate::dispatch::Daemon;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::proto::{Request, Response};
use psls_ipc::ErrorKind;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use tokio::io::AsyncReadExt;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// Sync channel, barrier, lock, unlock, run.
pub(super) async fn handle(c: &mut Conn, req: Request, mut fds: Vec<OwnedFd>) -> std::io::Result<Flow> {
    let (d, caller, pid) = (c.d.clone(), c.caller, c.pid);
    let node = d.node.clone();
    let resp = match req {
        Request::SyncChannel => match (pid, fds.len()) {
            (None, _) => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
            (Some(_), n) if n != 1 => err(OpError::new(
                ErrorKind::Invalid,
                format!("a sync channel needs exactly one descriptor (the socket), got {n}"),
            )),
            (Some(pid), _) => match d.channels.add(fds.remove(0), pid, caller.uid, start_of(&d, pid)) {
                Ok(()) => Response::Ok,
                Err(e) => err(e),
            },
        },
        Request::Barrier { job, name, count } => {
            let job = crate::sync::scope(&job, &start_of(&d, pid.unwrap_or(0)));
            let req = crate::peer::PeerReq::BarrierArrive {
                key: crate::sync::key(caller.uid, &job, &name),
                count,
                who: crate::sync::who(&node, pid.unwrap_or(0)),
                call: 0,
            };
            ok_or_err(crate::sync::call(&d.sync, req).await)
        }
        Request::Lock { job, id } => {
            let job = crate::sync::scope(&job, &start_of(&d, pid.unwrap_or(0)));
            let req = crate::peer::PeerReq::LockAcquire {
                key: crate::sync::key(caller.uid, &job, &id.to_string()),
                who: crate::sync::who(&node, pid.unwrap_or(0)),
                call: 0,
            };
            ok_or_err(crate::sync::call(&d.sync, req).await)
        }
        Request::Unlock { job, id } => {
            let job = crate::sync::scope(&job, &start_of(&d, pid.unwrap_or(0)));
            let req = crate::peer::PeerReq::LockRelease {
                key: crate::sync::key(caller.uid, &job, &id.to_string()),
                who: crate::sync::who(&node, pid.unwrap_or(0)),
                call: 0,
            };
            ok_or_err(crate::sync::call(&d.sync, req).await)
        }
        Request::Run {
            program,
            args,
            ranks,
            per_node,
            env,
            cwd,
        } => {
            // An older client's `psls run`: no checkpoint options, no job id announced.
            let req = Request::RunJob {
                program,
                args,
                ranks,
                per_node,
                env,
                cwd,
                checkpoint: Default::default(),
            };
            return start_job(c, req, false).await;
        }
        Request::RunJob { env, checkpoint, .. } if !checkpoint.resume.is_empty() => {
            let job = checkpoint.resume;
            match crate::recovery::resume(&node, &d.jobs, &d.ckpt, &job, env, (caller.uid, caller.gid)).await {
                Ok(crate::recovery::Resumed::Written { from, written }) => {
                    send(&mut c.w, &Response::JobStarted { job: job.clone() }).await?;
                    let message = format!("job {job} had finished: its result, restored from checkpoint {from}, is written by checkpoint {written}");
                    send(&mut c.w, &Response::JobNote { message }).await?;
                    Response::JobDone {
                        code: 0,
                        message: format!("job {job} written"),
                    }
                }
                Ok(crate::recovery::Resumed::Running(spec, owners, per_node, rx)) => {
                    send(&mut c.w, &Response::JobStarted { job: spec.job.clone() }).await?;
                    let message = format!("job {job} resumed from checkpoint {}", spec.restart_epoch);
                    send(&mut c.w, &Response::JobNote { message }).await?;
                    return Ok(Flow::Job {
                        spec: *spec,
                        per_node,
                        owners,
                        rx,
                    });
                }
                Err(e) => err(e),
            }
        }
        Request::Jobs => match jobs(&d).await {
            Ok(list) => Response::Jobs(list),
            Err(e) => err(e),
        },
        Request::JobRm { job } => ok_or_err(job_rm(&d, caller, &job).await),
        req @ Request::RunJob { .. } => return start_job(c, req, true).await,
        Request::Checkpoint { state } => match pid {
            None => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
            Some(pid) => {
                let call = safe_call(&d, caller, pid);
                match d.ckpt.safe_point(call, state).await {
                    Ok(o) => Response::Checkpointed {
                        epoch: o.epoch,
                        halt: o.halt,
                        pages: o.pages,
                        stopped_us: o.stopped_us,
                    },
                    Err(e) => err(e),
                }
            }
        },
        Request::RestartState { epoch } => match pid {
            None => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
            Some(pid) => {
                let call = safe_call(&d, caller, pid);
                match d.ckpt.restart_state(&call.job, call.rank, epoch).await {
                    Ok(state) => Response::RestartState { epoch, state },
                    Err(e) => err(e),
                }
            }
        },
        Request::ForceCheckpoint { job, halt } => ok_or_err(d.ckpt.force(&job, halt, caller.uid).await),
        other => misrouted(&other),
    };
    Ok(Flow::Reply(resp))
}

/// Launches the job of a `RunJob` request (`announce`: its id goes to the CLI first); the
/// connection then follows it.
async fn start_job(c: &mut Conn, req: Request, announce: bool) -> std::io::Result<Flow> {
    let Request::RunJob {
        program,
        args,
        ranks,
        per_node,
        env,
        cwd,
        checkpoint,
    } = req
    else {
        return Ok(Flow::Reply(misrouted(&req)));
    };
    let (d, caller) = (c.d.clone(), c.caller);
    let launched = crate::launcher::launch(
        &d.node, &d.jobs, ranks, per_node, program, args, env, cwd, caller.uid, caller.gid, checkpoint,
    )
    .await;
    match launched {
        Ok((spec, owners, rx)) => {
            if announce {
                send(&mut c.w, &Response::JobStarted { job: spec.job.clone() }).await?;
            }
            Ok(Flow::Job {
                spec,
                per_node,
                owners,
                rx,
            })
        }
        Err(e) => Ok(Flow::Reply(err(e))),
    }
}

/// The `psls run` job process `pid` is a rank of, and which start of it.
fn start_of(d: &Daemon, pid: i32) -> Option<(String, u32)> {
    d.jobs.rank_of(pid as u32).map(|(spec, _)| (spec.job, spec.attempt))
}

/// `psls jobs`: every job with a record (a `psls run` job), running or resumable.
async fn jobs(d: &Arc<Daemon>) -> Result<Vec<psls_ipc::proto::JobInfo>, OpError> {
    let st = d.node.meta_state();
    let mut out = Vec::new();
    for (job, rec) in &st.jobs {
        let Some(sum) = &rec.spec else { continue };
        let launcher = crate::launcher::running_activity(&d.node, job).await;
        let running = launcher.is_some();
        if !running && rec.epoch == 0 {
            continue; // ended without a checkpoint: its record is on its way out
        }
        let mut command = sum.program.clone();
        for a in &sum.args {
            command.push(' ');
            command.push_str(a);
        }
        let (activity, last) = match launcher {
            // A rollback's step, else a checkpoint in progress.
            Some(a) if a.is_empty() => d.ckpt.progress(job).await,
            Some(a) => (a, None),
            None => (String::new(), None),
        };
        let mut info = psls_ipc::proto::JobInfo {
            job: job.clone(),
            state: if running { "running" } else { "resumable" }.into(),
            ranks: sum.ranks,
            command,
            uid: sum.uid,
            epoch: rec.epoch,
            at_unix_ms: rec.at_unix_ms,
            bytes: rec.bytes,
            level: if rec.epoch > 0 {
                "persistent".into()
            } else {
                String::new()
            },
            pause_us: 0,
            commit_us: 0,
            recovery_frames: 0,
            unsaved_frames: 0,
            pre_recovery_frames: 0,
            persistent_epoch: rec.epoch,
            activity,
            finished: st.finished.get(job).map(|f| f.why.clone()).unwrap_or_default(),
        };
        // A running job's later checkpoints, memory ones too, as its coordinator saw them.
        if let Some(l) = last.filter(|l| l.epoch >= rec.epoch) {
            info.epoch = l.epoch;
            info.at_unix_ms = l.at_unix_ms;
            info.bytes = l.bytes;
            info.level = l.level;
            info.pause_us = l.pause_us;
            info.commit_us = l.commit_us;
        }
        if running {
            let c = job_frames(&d.node, job).await;
            info.recovery_frames = c.recovery;
            info.unsaved_frames = c.unsaved;
            info.pre_recovery_frames = c.pre_recovery;
        }
        out.push(info);
    }
    Ok(out)
}

/// `job`'s recovery frames over every live node, by category (a node that does not answer in
/// time counts none).
async fn job_frames(node: &Arc<crate::node::Node>, job: &str) -> crate::frames::FrameCounts {
    let st = node.meta_state();
    let mut asks = tokio::task::JoinSet::new();
    for (_, p) in node.logical_map(&st).into_iter().filter(|(_, p)| node.is_live(p)) {
        let (node, job) = (node.clone(), job.to_string());
        asks.spawn(async move {
            let req = PeerReq::Frames(crate::peer::FramesReq::State { job });
            node.call_data(&p, req, bytes::Bytes::new(), node.read_timeout()).await
        });
    }
    let mut sum = crate::frames::FrameCounts::default();
    while let Some(r) = asks.join_next().await {
        if let Ok(Ok((PeerResp::MemState { counts, .. }, _))) = r {
            sum.recovery += counts.recovery;
            sum.unsaved += counts.unsaved;
            sum.pre_recovery += counts.pre_recovery;
        }
    }
    sum
}

/// `psls jobs rm JOB`: drops a job that is not running (its owner or root).
async fn job_rm(d: &Arc<Daemon>, caller: crate::pfs::Caller, job: &str) -> Result<(), OpError> {
    let st = d.node.meta_state();
    let Some(rec) = st.jobs.get(job) else {
        return Err(OpError::new(ErrorKind::NotFound, format!("no job {job}")));
    };
    // A `psls run` job's user is in its record; a job a process joined (`ext:UID:NAME`)
    // names it; any other (a process's own) only root removes.
    let owner = rec.spec.as_ref().map(|s| s.uid).or_else(|| {
        job.strip_prefix("ext:")
            .and_then(|rest| rest.split_once(':'))
            .and_then(|(uid, _)| uid.parse::<u32>().ok())
    });
    if caller.uid != 0 && Some(caller.uid) != owner {
        let whose = owner.map_or("another process".to_string(), |o| format!("uid {o}"));
        return Err(OpError::new(
            ErrorKind::Permission,
            format!("job {job} belongs to {whose}: only it or root may remove it"),
        ));
    }
    if crate::launcher::is_running(&d.node, job).await {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("job {job} is running (psls halt {job} stops it)"),
        ));
    }
    d.ckpt.end_job(job).await;
    Ok(())
}

/// Who makes a safe-point call: a rank of a job running here (its job, rank and options from
/// the launcher, whatever the process says), or a process outside `psls run` (a job of one).
fn safe_call(d: &Daemon, caller: crate::pfs::Caller, pid: i32) -> crate::ckpt::SafeCall {
    let files = d.svm.writable_files(pid);
    match d.jobs.rank_of(pid as u32) {
        Some((spec, rank)) => crate::ckpt::SafeCall {
            job: spec.job,
            rank,
            attempt: spec.attempt,
            size: spec.size,
            interval_ms: spec.checkpoint_interval_ms,
            timeout_ms: spec.checkpoint_timeout_ms,
            level: spec.level,
            persistent_interval_ms: spec.persistent_interval_ms,
            persistent_every: spec.persistent_every,
            cleaning: spec.cleaning,
            files,
            uid: spec.uid,
            gid: spec.gid,
            launcher: spec.launcher,
            node_inc: d.node.incarnation,
        },
        None => crate::ckpt::SafeCall {
            job: super::memory::job_of(d, pid),
            rank: 0,
            attempt: 0,
            size: 1,
            interval_ms: 0,
            timeout_ms: crate::launcher::DEFAULT_CALL_TIMEOUT_MS,
            // A process of its own: every checkpoint it asks for is persistent.
            level: psls_ckpt::msg::Choice::Persistent,
            persistent_interval_ms: 0,
            persistent_every: 0,
            cleaning: d.node.default_cleaning(),
            files,
            uid: caller.uid,
            gid: caller.gid,
            launcher: d.node.name().to_string(),
            node_inc: d.node.incarnation,
        },
    }
}

/// The incarnation of each node running ranks.
fn incarnations(node: &crate::node::Node, owners: &crate::launcher::Owners) -> std::collections::BTreeMap<String, u64> {
    let st = node.meta_state();
    owners
        .keys()
        .map(|l| node.physical_of(&st, psls_svm::NodeId(*l)))
        .map(|p| {
            let inc = node.heartbeat_of(&p).map_or(0, |h| h.incarnation);
            (p, inc)
        })
        .collect()
}

/// The nodes running ranks that went down or restarted since `incs` was taken.
fn failed_nodes(
    node: &crate::node::Node,
    owners: &crate::launcher::Owners,
    incs: &std::collections::BTreeMap<String, u64>,
) -> Vec<String> {
    let st = node.meta_state();
    owners
        .keys()
        .map(|l| node.physical_of(&st, psls_svm::NodeId(*l)))
        .filter(|p| {
            node.is_declared_down(p)
                || node.heartbeat_of(p).map_or(0, |h| h.incarnation) != incs.get(p).copied().unwrap_or(0)
        })
        .collect()
}

/// Every rank of `job` exited 0: a memory checkpoint keeps its result in the nodes' memories,
/// then a last persistent checkpoint makes it durable and the job goes. If the persistent one
/// fails, nothing finished is thrown away: the job stays resumable with the reason
/// (`MetaOp::JobFinished`), and `psls run --resume` only has to write it. Returns the job's
/// status and its last line.
async fn end_finished(d: &Arc<Daemon>, job: &str, ranks: u32, pinned_persistent: bool) -> (i32, String) {
    let node = &d.node;
    let files = crate::launcher::job_files(node, job, true).await;
    let done = format!("all {ranks} ranks exited with status 0");
    let last = if files.is_empty() {
        Ok(())
    } else {
        // Not when it does not fit (or fails): the persistent one is tried all the same. Not
        // for a job pinned to persistent checkpoints (`--level persistent`).
        let kept = if pinned_persistent {
            Err(OpError::new(
                ErrorKind::Invalid,
                "the job takes persistent checkpoints only",
            ))
        } else {
            d.ckpt
                .checkpoint_at(job, files.clone(), psls_ckpt::msg::Level::Memory)
                .await
        };
        if let Err(e) = &kept {
            tracing::info!(node = %node.name(), job, error = %e, "no memory checkpoint of the finished job");
        }
        match d.ckpt.checkpoint(job, files.clone()).await {
            Ok(_) => Ok(()),
            Err(e) => Err((e, kept.ok().map(|k| k.epoch))),
        }
    };
    match last {
        Ok(()) => {
            crate::launcher::drop_job_segments(node, job).await;
            d.ckpt.end_job(job).await;
            crate::launcher::finished(node, &d.jobs, job);
            (0, done)
        }
        Err((e, Some(epoch))) => {
            let why = format!("its last persistent checkpoint failed: {e}");
            let op = psls_pfs::meta::MetaOp::JobFinished {
                job: job.to_string(),
                why: why.chars().take(psls_pfs::meta::MAX_WHY_LEN / 4).collect(),
                files: files.clone(),
                epoch,
            };
            // Not `finished`: the job's segments and recovery copies hold its result.
            crate::launcher::unlaunched(&d.jobs, job);
            match node.submit(op).await {
                Ok(()) => {
                    tracing::warn!(node = %node.name(), job, epoch, error = %e, "a finished job's last persistent checkpoint failed: kept, resumable");
                    (
                        crate::launcher::HALTED_STATUS,
                        format!(
                            "{done}, but {why}; the result is kept in memory checkpoint {epoch}: `psls run --resume {job}` writes it"
                        ),
                    )
                }
                Err(e2) => (1, format!("{done}, but {why}; keeping the result failed too: {e2}")),
            }
        }
        Err((e, None)) => {
            let resumable = node.meta_state().jobs.get(job).is_some_and(|r| r.epoch > 0);
            crate::launcher::finished(node, &d.jobs, job);
            if resumable {
                // Its last checkpoint is from before the end: a resume runs the rest again.
                (
                    crate::launcher::HALTED_STATUS,
                    format!("{done}, but the job's last checkpoint failed: {e}; `psls run --resume {job}` runs it again from its last checkpoint"),
                )
            } else {
                crate::launcher::drop_job_segments(node, job).await;
                d.ckpt.end_job(job).await;
                (1, format!("{done}, but the job's last checkpoint failed: {e}"))
            }
        }
    }
}

/// Relays a job's output to the CLI and ends with its status; kills the job if the CLI goes.
/// A node with ranks that goes down rolls the job back and starts its ranks again (at most
/// `max_restarts` times).
pub(super) async fn run_job(
    d: &Arc<Daemon>,
    mut spec: crate::launcher::JobSpec,
    per_node: Option<u32>,
    mut owners: crate::launcher::Owners,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<crate::launcher::JobEvent>,
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
) -> anyhow::Result<()> {
    let node = &d.node;
    let job = spec.job.clone();
    let job = job.as_str();
    let ranks = spec.size;
    use crate::launcher::JobEvent;
    let mut exited: std::collections::BTreeMap<u32, i32> = std::collections::BTreeMap::new();
    let mut failed: Option<(u32, i32)> = None;
    let mut halted: Option<u64> = None;
    let mut lost: Option<String> = None;
    let mut byte = [0u8; 1];
    let interval_ms = node.cfg.cluster.heartbeat_interval_ms;
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The incarnation of every node running ranks: a node that went down, or came back as
    // another incarnation (its memory lost), fails the job's start.
    let mut incs = incarnations(node, &owners);
    // A rank that failed may have failed because a node did (a fault on a page whose manager
    // restarted, say): its failure is judged once the failure detector had time to tell.
    let grace = std::time::Duration::from_millis(node.cfg.cluster.heartbeat_timeout_ms + 2 * interval_ms);
    let mut pending: Option<((u32, i32), std::time::Instant)> = None;
    while lost.is_none() && ((exited.len() as u32) < ranks || pending.is_some()) {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = tick.tick() => {
                let gone = failed_nodes(node, &owners, &incs);
                if gone.is_empty() || failed.is_some() || halted.is_some() {
                    if let Some((rc, since)) = pending {
                        if since.elapsed() >= grace {
                            pending = None;
                            failed = Some(rc);
                            crate::launcher::kill_everywhere(node, job).await;
                        }
                    }
                    continue;
                }
                pending = None;
                let why = format!("{} went down", gone.join(", "));
                if spec.attempt >= spec.max_restarts {
                    lost = Some(format!(
                        "{why}; the job was restarted {} times already (--max-restarts {})",
                        spec.attempt, spec.max_restarts
                    ));
                    crate::launcher::kill_everywhere(node, job).await;
                    continue;
                }
                let note = format!("{why}: rolling job {job} back to its last checkpoint");
                send(&mut w, &Response::JobNote { message: note }).await?;
                match crate::recovery::roll_back(node, &d.ckpt, &d.jobs, &spec).await {
                    Ok(epoch) => {
                        spec.attempt += 1;
                        spec.restart_epoch = epoch;
                        match crate::launcher::spawn_all(node, &spec, per_node).await {
                            Ok(o) => {
                                owners = o;
                                incs = incarnations(node, &owners);
                                exited.clear();
                                let from = if epoch == 0 { "its start".to_string() } else { format!("checkpoint {epoch}") };
                                let message = format!("job {job} restarted from {from} (restart {} of at most {})", spec.attempt, spec.max_restarts);
                                send(&mut w, &Response::JobNote { message }).await?;
                            }
                            Err(e) => lost = Some(format!("{why}; restarting the ranks failed: {e}")),
                        }
                    }
                    Err(e) => lost = Some(format!("{why}; the rollback failed: {e}")),
                }
                continue;
            }
            _ = r.read(&mut byte) => {
                tracing::info!(node = %node.name(), job, "the CLI went away: stopping the job");
                crate::launcher::kill_everywhere(node, job).await;
                crate::launcher::finished(node, &d.jobs, job);
                return Ok(());
            }
        };
        let Some(ev) = ev else { break };
        match ev {
            JobEvent::Output { rank, err, data } => {
                send(&mut w, &Response::RankOutput { rank, err, data }).await?;
            }
            JobEvent::Halted { epoch } => {
                halted = Some(epoch);
                tracing::info!(node = %node.name(), job, epoch, "job halted: stopping its ranks");
                let (node, job) = (node.clone(), job.to_string());
                tokio::spawn(async move { crate::launcher::kill_everywhere(&node, &job).await });
            }
            JobEvent::Exit { rank, code, attempt } => {
                // Exits of the ranks stopped for a rollback are not the job's.
                if attempt != spec.attempt || rank >= ranks || exited.contains_key(&rank) {
                    continue;
                }
                exited.insert(rank, code);
                if code != 0 && failed.is_none() && pending.is_none() && halted.is_none() {
                    pending = Some(((rank, code), std::time::Instant::now()));
                }
            }
        }
    }
    // A job that ended without a committed checkpoint cannot be resumed: its record, area
    // and writer claims go; one with a checkpoint keeps them (until `psls jobs rm`).
    let resumable = node.meta_state().jobs.get(job).is_some_and(|r| r.epoch > 0);
    if !resumable && (lost.is_some() || failed.is_some()) {
        // The volatile segments go as the job's (then their files in its area).
        crate::launcher::drop_job_segments(node, job).await;
        d.ckpt.end_job(job).await;
    }
    if let Some(why) = lost {
        crate::launcher::finished(node, &d.jobs, job);
        let message = format!("job {job} failed: {why}");
        send(
            &mut w,
            &Response::JobDone {
                code: crate::launcher::LOST_STATUS,
                message,
            },
        )
        .await?;
        return Ok(());
    }
    if failed.is_none() && halted.is_none() {
        let pinned = spec.level == psls_ckpt::msg::Choice::Persistent;
        let (code, message) = end_finished(d, job, ranks, pinned).await;
        send(&mut w, &Response::JobDone { code, message }).await?;
        return Ok(());
    }
    crate::launcher::finished(node, &d.jobs, job);
    if let Some(epoch) = halted {
        let message = format!("job {job} halted after checkpoint {epoch}; it can be resumed from it");
        let code = crate::launcher::HALTED_STATUS;
        send(&mut w, &Response::JobDone { code, message }).await?;
        return Ok(());
    }
    let (code, message) = match failed {
        None => (0, format!("all {ranks} ranks exited with status 0")),
        Some((rank, code)) => (
            code,
            format!("rank {rank} exited with status {code}; the other ranks were stopped"),
        ),
    };
    send(&mut w, &Response::JobDone { code, message }).await?;
    Ok(())
}
