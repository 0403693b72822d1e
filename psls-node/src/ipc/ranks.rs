//! Local clients' requests as ranks of a job: a sync channel for barrier and lock calls (the
//! short path, served by the `psls-sync` thread), the same calls on this connection; and the
//! users' job commands (`psls run`, `attach`, `cancel`, `halt`, `jobs`), which go to job
//! control at the metadata's leader (`crate::jobctl`), after which the connection follows the
//! job from here: its notes, its ranks' output fetched from their nodes, its end. A follower is
//! only a client: its death, or this node's, leaves the job running.

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
            // An older client's `psls run`: no checkpoint options.
            let req = Request::RunJob {
                program,
                args,
                ranks,
                per_node,
                env,
                cwd,
                checkpoint: Default::default(),
            };
            return start_job(c, req).await;
        }
        Request::RunJob { env, checkpoint, .. } if !checkpoint.resume.is_empty() => {
            let job = checkpoint.resume;
            // The output kept of the starts before the resume was printed then: the follower
            // goes on after it (a restarted rank's lines up to there are printed again).
            let kept = crate::launcher::output_last(&d.node, &d.jobs, &job).await;
            let cmd = psls_jobs::Command::Resume {
                job: job.clone(),
                env,
                uid: caller.uid,
                hosts: checkpoint.nodes,
            };
            match crate::jobctl::command(&d.jobctl_shell(), cmd).await {
                Ok(psls_jobs::Answer::Started { job, attempt }) => {
                    send(&mut c.w, &Response::JobStarted { job: job.clone() }).await?;
                    return Ok(Flow::Follow {
                        job,
                        after: kept,
                        since: attempt,
                        known: Some(attempt),
                    });
                }
                // Running already (job control went on with it after a failure, even of every
                // node): the resume follows it.
                Ok(psls_jobs::Answer::Refused(psls_jobs::CommandError::Running(job))) => {
                    send(&mut c.w, &Response::JobStarted { job: job.clone() }).await?;
                    let message = format!("job {job} is running: following it");
                    send(&mut c.w, &Response::JobNote { message }).await?;
                    return Ok(Flow::Follow {
                        job,
                        after: Default::default(),
                        since: 0,
                        known: None,
                    });
                }
                Ok(a) => refused(a),
                Err(e) => err(e),
            }
        }
        Request::Stdin { job, offset, data, eof } => match stdin(&d, caller, &job, offset, data, eof).await {
            Ok((received, full)) => Response::StdinAck { received, full },
            Err(e) => err(e),
        },
        Request::Jobs => match jobs(&d).await {
            Ok(list) => Response::Jobs(list),
            Err(e) => err(e),
        },
        Request::JobRm { job } => ok_or_err(job_rm(&d, caller, &job).await),
        req @ Request::RunJob { .. } => return start_job(c, req).await,
        Request::Attach { job, after, attempt } => {
            let st = node.meta_fresh().await;
            let known = st
                .as_ref()
                .is_ok_and(|st| st.runs.contains_key(&job) || st.ended.contains_key(&job));
            if let Err(e) = st {
                err(e)
            } else if !known {
                err(OpError::new(
                    ErrorKind::NotFound,
                    format!("no job {job} running or ended"),
                ))
            } else if after.len() > crate::launcher::MAX_RANKS as usize {
                err(OpError::new(ErrorKind::Invalid, "too many ranks"))
            } else {
                send(&mut c.w, &Response::JobStarted { job: job.clone() }).await?;
                return Ok(Flow::Follow {
                    job,
                    after: after.into_iter().collect(),
                    since: 0,
                    known: attempt,
                });
            }
        }
        Request::Cancel { job } => {
            let cmd = psls_jobs::Command::Cancel { job, uid: caller.uid };
            match crate::jobctl::command(&d.jobctl_shell(), cmd).await {
                Ok(psls_jobs::Answer::Accepted { .. }) => Response::Ok,
                Ok(a) => refused(a),
                Err(e) => err(e),
            }
        }
        Request::Checkpoint { state } => match pid {
            None => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
            Some(pid) => {
                // A rank's calls are counted per rank (any session of it); another process's
                // per session.
                c.safe_calls += 1;
                let seq = d.jobs.next_safe_call(pid as u32).unwrap_or(c.safe_calls);
                let call = safe_call(&d, caller, pid, (c.id, seq));
                // What the rank printed before its call is numbered and kept on two nodes
                // before the checkpoint can hold its number.
                let output_seq = d.jobs.output_mark(pid as u32).await;
                crate::launcher::copy_output(&d.node, &d.jobs).await;
                match d.ckpt.safe_point(call, state, output_seq).await {
                    Ok(o) => Response::Checkpointed {
                        epoch: o.epoch,
                        halt: o.halt,
                        pages: o.pages,
                        stopped_us: o.stopped_us,
                    },
                    Err(e) => {
                        // Not the program's failure (no coordinator, a change of it, ranks
                        // out of step after one): if the rank exits for it, the job rolls
                        // back.
                        if e.kind == ErrorKind::Unavailable {
                            d.jobs.blame(pid as u32, &e.message);
                        }
                        err(e)
                    }
                }
            }
        },
        Request::RestartState { epoch } => match pid {
            None => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
            Some(pid) => {
                let call = safe_call(&d, caller, pid, (c.id, 0));
                match d.ckpt.restart_state(&call.job, call.rank, epoch).await {
                    Ok(state) => Response::RestartState { epoch, state },
                    Err(e) => err(e),
                }
            }
        },
        Request::ForceCheckpoint { job, halt: true } if node.meta_state().runs.contains_key(&job) => {
            // A `psls run` job's halt is job control's (it holds across a rollback and a new
            // driver).
            let cmd = psls_jobs::Command::Halt { job, uid: caller.uid };
            match crate::jobctl::command(&d.jobctl_shell(), cmd).await {
                Ok(psls_jobs::Answer::Accepted { .. }) => Response::Ok,
                Ok(a) => refused(a),
                Err(e) => err(e),
            }
        }
        Request::ForceCheckpoint { job, halt } => ok_or_err(d.ckpt.force(&job, halt, caller.uid).await),
        other => misrouted(&other),
    };
    Ok(Flow::Reply(resp))
}

/// A refusal of job control, as an error.
fn refused(a: psls_jobs::Answer) -> Response {
    use psls_jobs::CommandError as E;
    let e = match a {
        psls_jobs::Answer::Refused(e) => e,
        other => E::Invalid(format!("unexpected answer {other:?}")),
    };
    let kind = match &e {
        E::NotFound(_) | E::NothingToResume(_) => ErrorKind::NotFound,
        E::NotOwner(_) => ErrorKind::Permission,
        E::Running(_) => ErrorKind::Exists,
        E::NotLeader | E::Busy => ErrorKind::Unavailable,
        E::NotRunning(_) | E::NotResumable { .. } | E::Invalid(_) | E::Refused(_) => ErrorKind::Invalid,
    };
    err(OpError::new(kind, e.to_string()))
}

/// Launches the job of a `RunJob` request through job control; the connection then follows it.
async fn start_job(c: &mut Conn, req: Request) -> std::io::Result<Flow> {
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
    let cmd = match crate::launcher::launch_command(
        &d.node,
        ranks,
        per_node,
        program,
        args,
        env,
        cwd,
        caller.uid,
        caller.gid,
        &checkpoint,
    ) {
        Ok(cmd) => cmd,
        Err(e) => return Ok(Flow::Reply(err(e))),
    };
    match crate::jobctl::command(&d.jobctl_shell(), cmd).await {
        Ok(psls_jobs::Answer::Started { job, attempt }) => {
            send(&mut c.w, &Response::JobStarted { job: job.clone() }).await?;
            Ok(Flow::Follow {
                job,
                after: Default::default(),
                since: attempt,
                known: Some(attempt),
            })
        }
        Ok(a) => Ok(Flow::Reply(refused(a))),
        Err(e) => Ok(Flow::Reply(err(e))),
    }
}

/// The `psls run` job process `pid` is a rank of, and which start of it.
fn start_of(d: &Daemon, pid: i32) -> Option<(String, u32)> {
    d.jobs.rank_of(pid as u32).map(|(spec, _)| (spec.job, spec.attempt))
}

/// `psls run`'s input for rank 0 of `job` (see `Request::Stdin`): checked against the job's
/// record (its owner, whether its start reads forwarded input), then queued at rank 0's node.
async fn stdin(
    d: &Arc<Daemon>,
    caller: crate::pfs::Caller,
    job: &str,
    offset: u64,
    data: Vec<u8>,
    eof: bool,
) -> Result<(u64, bool), OpError> {
    if data.len() > psls_ipc::proto::MAX_STDIN_CHUNK {
        return Err(OpError::new(ErrorKind::Invalid, "an input chunk over the limit"));
    }
    let mut st = d.node.meta_state();
    if !st.runs.contains_key(job) {
        st = d.node.meta_fresh().await?;
    }
    let none = || {
        OpError::new(
            ErrorKind::NotFound,
            format!("job {job}'s rank 0 reads no forwarded input"),
        )
    };
    let run = st.runs.get(job).ok_or_else(none)?;
    let owner = st.jobs.get(job).and_then(|r| r.spec.as_ref()).map(|s| s.uid);
    if caller.uid != 0 && owner != Some(caller.uid) {
        return Err(OpError::new(
            ErrorKind::Permission,
            format!("job {job} belongs to another user"),
        ));
    }
    if !run.stdin || run.attempt != 0 {
        return Err(none());
    }
    let at = run
        .placement
        .first()
        .and_then(|l| run.nodes.get(l))
        .map(|(p, _)| p.clone())
        .ok_or_else(none)?;
    if at == d.node.me.name {
        return crate::launcher::feed_stdin(&d.jobs, job, run.attempt, offset, data, eof);
    }
    let req = PeerReq::Stdin {
        job: job.to_string(),
        attempt: run.attempt,
        offset,
        data,
        eof,
    };
    match d.node.call_ok(&at, req).await? {
        PeerResp::StdinAck { received, full } => Ok((received, full)),
        r => Err(OpError::new(ErrorKind::Internal, format!("unexpected answer {r:?}"))),
    }
}

/// `psls jobs`: every job with a record (a `psls run` job), running or resumable.
async fn jobs(d: &Arc<Daemon>) -> Result<Vec<psls_ipc::proto::JobInfo>, OpError> {
    let st = d.node.meta_state();
    let mut out = Vec::new();
    for (job, rec) in &st.jobs {
        let Some(sum) = &rec.spec else { continue };
        let running = st.runs.contains_key(job);
        if !running && rec.epoch == 0 && !st.finished.contains_key(job) && !st.ended.contains_key(job) {
            continue; // ended without a checkpoint: its record is on its way out
        }
        let mut command = sum.program.clone();
        for a in &sum.args {
            command.push(' ');
            command.push_str(a);
        }
        // Job control's step (known at the driver), else a checkpoint in progress.
        let driver = if running {
            driver_activity(d, job).await
        } else {
            String::new()
        };
        let (activity, last) = match (running, driver) {
            (true, a) if a.is_empty() => d.ckpt.progress(job).await,
            (true, a) => (a, None),
            // A resumable job: how its last start ended (like `sacct`).
            (false, _) => match st.ended.get(job) {
                Some((_, e)) => (format!("{}: {}", e.how.word(), e.message), None),
                None => (String::new(), None),
            },
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
            end: match (running, st.ended.get(job)) {
                (false, Some((_, e))) => e.how.word().into(),
                _ => String::new(),
            },
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
    // Ended jobs whose record went (like `sacct`: how they ended).
    for (job, (_, end)) in &st.ended {
        if st.jobs.get(job).is_some_and(|r| r.spec.is_some()) {
            continue;
        }
        out.push(psls_ipc::proto::JobInfo {
            job: job.clone(),
            state: end.how.word().into(),
            at_unix_ms: end.at_unix_ms,
            activity: end.message.clone(),
            end: end.how.word().into(),
            ..Default::default()
        });
    }
    Ok(out)
}

/// What job control's driver (the metadata's leader) does for `job` (empty: nothing but
/// running it, or the leader did not answer).
async fn driver_activity(d: &Arc<Daemon>, job: &str) -> String {
    match d.node.replication.leader() {
        Some(l) if l == d.node.me.name => d.jobctl.activity(job),
        Some(l) => match d.node.call_ok(&l, PeerReq::JobActivity { job: job.to_string() }).await {
            Ok(PeerResp::JobActivity { text }) => text,
            _ => String::new(),
        },
        None => String::new(),
    }
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
    if st.runs.contains_key(job) {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("job {job} is running (psls halt {job} stops it)"),
        ));
    }
    // Every node drops what it keeps of the job, its recovery copies first (kept, they were
    // served to the next job writing the file: found by the nemesis); a node down now drops
    // them once its records no longer know the job (`Daemon::run_ticks`).
    crate::launcher::drop_job_segments(&d.node, job).await;
    d.ckpt.end_job(job).await;
    Ok(())
}

/// Who makes a safe-point call: a rank of a job running here (its job, rank and options from
/// the launcher, whatever the process says), or a process outside `psls run` (a job of one);
/// its call number `seq` on connection `session`.
fn safe_call(d: &Daemon, caller: crate::pfs::Caller, pid: i32, (session, seq): (u64, u64)) -> crate::ckpt::SafeCall {
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
            launcher: d.node.name().to_string(),
            node_inc: d.node.incarnation,
            session,
            seq,
            resent: false,
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
            session,
            seq,
            resent: false,
        },
    }
}

/// How often a follower looks for new output and notes.
const FOLLOW_MS: u64 = 50;

/// Follows `job` for the client on this connection: carries out `psls_jobs::follow::Follower`'s
/// actions (its notes, its ranks' output after the client's numbers `after`, fetched from every
/// live node, and its end, of start `since` or a later one). The client going away leaves the
/// job running.
pub(super) async fn follow(
    d: &Arc<Daemon>,
    job: String,
    after: std::collections::BTreeMap<u32, u64>,
    since: u32,
    known: Option<u32>,
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
) -> anyhow::Result<()> {
    use psls_jobs::follow::{FollowAction, Follower};
    let node = &d.node;
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(FOLLOW_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut byte = [0u8; 1];
    let started = std::time::Instant::now();
    let now_ms = || started.elapsed().as_millis() as u64;
    let mut f = Follower::new(&job, after, since).knowing(known);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = r.read(&mut byte) => {
                tracing::info!(node = %node.name(), %job, "the follower went away; the job goes on");
                return Ok(());
            }
        }
        f.handle_tick(&node.meta_state());
        while let Some(a) = f.poll_action() {
            match a {
                FollowAction::Note(message) => send(&mut w, &Response::JobNote { message }).await?,
                FollowAction::Start(attempt) => send(&mut w, &Response::JobAttempt { attempt }).await?,
                FollowAction::CheckGone => {
                    let fresh = node.meta_fresh().await.ok();
                    f.handle_fresh(fresh.as_ref());
                }
                FollowAction::Fetch { after, all } => {
                    let records = fetch_output(d, &job, &after, all).await;
                    f.handle_output(records, now_ms());
                }
                FollowAction::Line(rec) => {
                    let msg = Response::RankOutput {
                        rank: rec.rank,
                        seq: rec.seq,
                        err: rec.err,
                        data: rec.data,
                    };
                    send(&mut w, &msg).await?;
                }
                FollowAction::Skipped { rank, after, next } => {
                    tracing::info!(node = %node.name(), %job, rank, after, next, "a follower skips lines no node keeps");
                }
                FollowAction::End { code, message } => {
                    send(&mut w, &Response::JobDone { code, message }).await?;
                    return Ok(());
                }
            }
        }
    }
}

/// `job`'s output after `after` from every live node (a node that does not answer gives
/// nothing: the follower waits for the lines it keeps, then goes on past them).
async fn fetch_output(
    d: &Arc<Daemon>,
    job: &str,
    after: &std::collections::BTreeMap<u32, u64>,
    all: bool,
) -> Vec<psls_jobs::output::Record> {
    let node = &d.node;
    let peers: Vec<String> = node
        .cfg
        .nodes
        .iter()
        .chain(node.cfg.spares.iter())
        .map(|n| n.name.clone())
        .filter(|p| *p == node.me.name || node.is_live(p))
        .collect();
    let mut asks = tokio::task::JoinSet::new();
    for p in peers {
        let (d, job) = (d.clone(), job.to_string());
        let after = after.clone();
        asks.spawn(async move {
            if p == d.node.me.name {
                return d.jobs.output_since(&job, &after, all).0;
            }
            let after: Vec<(u32, u64)> = after.into_iter().collect();
            match d.node.call_ok(&p, PeerReq::OutputSince { job, after, all }).await {
                Ok(PeerResp::Output { records, .. }) => records.into_iter().map(crate::launcher::record_of).collect(),
                _ => Vec::new(),
            }
        });
    }
    let mut all = Vec::new();
    while let Some(r) = asks.join_next().await {
        if let Ok(records) = r {
            all.extend(records);
        }
    }
    all
}
