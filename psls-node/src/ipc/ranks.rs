//! Local clients' requests as ranks of a job: a sync channel for barrier and lock calls (the
//! short path, served by the `psls-sync` thread), the same calls on this connection, and
//! `psls run` (the launcher's side: start the job, relay its output, end with its status).

use super::conn::{err, misrouted, ok_or_err, send, Conn, Flow};
use crate::dispatch::Daemon;
use crate::op::OpError;
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
            (Some(pid), _) => match d.channels.add(fds.remove(0), pid, caller.uid) {
                Ok(()) => Response::Ok,
                Err(e) => err(e),
            },
        },
        Request::Barrier { job, name, count } => {
            let req = crate::peer::PeerReq::BarrierArrive {
                key: crate::sync::key(caller.uid, &job, &name),
                count,
                who: crate::sync::who(&node, pid.unwrap_or(0)),
                call: 0,
            };
            ok_or_err(crate::sync::call(&d.sync, req).await)
        }
        Request::Lock { job, id } => {
            let req = crate::peer::PeerReq::LockAcquire {
                key: crate::sync::key(caller.uid, &job, &id.to_string()),
                who: crate::sync::who(&node, pid.unwrap_or(0)),
                call: 0,
            };
            ok_or_err(crate::sync::call(&d.sync, req).await)
        }
        Request::Unlock { job, id } => {
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
            let launched = crate::launcher::launch(
                &node,
                &d.jobs,
                ranks,
                per_node,
                program,
                args,
                env,
                cwd,
                caller.uid,
                caller.gid,
                Default::default(),
            )
            .await;
            match launched {
                Ok((job, rx)) => return Ok(Flow::Job { job, ranks, rx }),
                Err(e) => err(e),
            }
        }
        Request::RunJob {
            program,
            args,
            ranks,
            per_node,
            env,
            cwd,
            checkpoint,
        } => {
            let launched = crate::launcher::launch(
                &node, &d.jobs, ranks, per_node, program, args, env, cwd, caller.uid, caller.gid, checkpoint,
            )
            .await;
            match launched {
                Ok((job, rx)) => {
                    send(&mut c.w, &Response::JobStarted { job: job.clone() }).await?;
                    return Ok(Flow::Job { job, ranks, rx });
                }
                Err(e) => err(e),
            }
        }
        Request::Checkpoint { state } => match pid {
            None => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
            Some(pid) => {
                let call = safe_call(&d, caller, pid);
                match d.ckpt.safe_point(call, state).await {
                    Ok((epoch, halt)) => Response::Checkpointed { epoch, halt },
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

/// Who makes a safe-point call: a rank of a job running here (its job, rank and options from
/// the launcher, whatever the process says), or a process outside `psls run` (a job of one).
fn safe_call(d: &Daemon, caller: crate::pfs::Caller, pid: i32) -> crate::ckpt::SafeCall {
    let files = d.svm.writable_files(pid);
    match d.jobs.rank_of(pid as u32) {
        Some((spec, rank)) => crate::ckpt::SafeCall {
            job: spec.job,
            rank,
            size: spec.size,
            interval_ms: spec.checkpoint_interval_ms,
            timeout_ms: spec.checkpoint_timeout_ms,
            files,
            uid: spec.uid,
            gid: spec.gid,
            launcher: spec.launcher,
        },
        None => crate::ckpt::SafeCall {
            job: super::memory::process_job(d, pid),
            rank: 0,
            size: 1,
            interval_ms: 0,
            timeout_ms: crate::launcher::DEFAULT_CALL_TIMEOUT_MS,
            files,
            uid: caller.uid,
            gid: caller.gid,
            launcher: d.node.name().to_string(),
        },
    }
}

/// Relays a job's output to the CLI and ends with its status; kills the job if the CLI goes.
pub(super) async fn run_job(
    d: &Arc<Daemon>,
    job: &str,
    ranks: u32,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<crate::launcher::JobEvent>,
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
) -> anyhow::Result<()> {
    let node = &d.node;
    use crate::launcher::JobEvent;
    let mut exited: std::collections::BTreeMap<u32, i32> = std::collections::BTreeMap::new();
    let mut failed: Option<(u32, i32)> = None;
    let mut halted: Option<u64> = None;
    let mut byte = [0u8; 1];
    while (exited.len() as u32) < ranks {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
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
            JobEvent::Exit { rank, code } => {
                if rank >= ranks || exited.contains_key(&rank) {
                    continue;
                }
                exited.insert(rank, code);
                if code != 0 && failed.is_none() {
                    failed = Some((rank, code));
                    let (node, job) = (node.clone(), job.to_string());
                    tokio::spawn(async move { crate::launcher::kill_everywhere(&node, &job).await });
                }
            }
        }
    }
    if failed.is_none() && halted.is_none() {
        // Every rank exited 0: a last checkpoint makes the job's writes durable before the
        // answer, and its checkpoint area goes.
        let files = crate::launcher::job_files(node, job, true).await;
        let last = if files.is_empty() {
            Ok(())
        } else {
            d.ckpt.checkpoint(job, files).await.map(|_| ())
        };
        d.ckpt.end_job(job).await;
        crate::launcher::finished(node, &d.jobs, job);
        let (code, message) = match last {
            Ok(()) => (0, format!("all {ranks} ranks exited with status 0")),
            Err(e) => (
                1,
                format!("all {ranks} ranks exited with status 0, but the job's last checkpoint failed: {e}"),
            ),
        };
        send(&mut w, &Response::JobDone { code, message }).await?;
        return Ok(());
    }
    crate::launcher::finished(node, &d.jobs, job);
    if let Some(epoch) = halted {
        let message = format!("job {job} halted after checkpoint {epoch}; it can be resumed from it");
        send(&mut w, &Response::JobDone { code: 0, message }).await?;
        return Ok(());
    }
    let (code, message) = match failed {
        None => (0, format!("all {ranks} ranks exited with status 0")),
        Some((rank, crate::launcher::LOST_STATUS)) => (
            crate::launcher::LOST_STATUS,
            format!("rank {rank} was lost (its node went down or it could not report); the other ranks were stopped"),
        ),
        Some((rank, code)) => (
            code,
            format!("rank {rank} exited with status {code}; the other ranks were stopped"),
        ),
    };
    send(&mut w, &Response::JobDone { code, message }).await?;
    Ok(())
}
