//! The shell of job control: one task owns this node's [`psls_jobs::Control`] and feeds it the
//! committed metadata, ticks with the heartbeats' view of the nodes, the nodes' reports of
//! their ranks, commands, and the outcomes of the steps it asked for; it carries out the
//! machine's actions, each step in a task of its own whose outcome comes back as an input.
//! Only the metadata's leader holding its lease drives ([`crate::node::Node::coordinator_now`]
//! names it); every node runs the task, so the next leader takes over at once.
//!
//! This module makes no decision on a job: which step comes next, and whether a job goes on,
//! rolls back or ends, is the machine's.
//! Bounds: at most [`MAX_INPUTS`] inputs wait (a report or an outcome dropped on a full queue
//! is sent or asked again: the machine retries what it does not hear of).

use crate::ckpt::CkptShell;
use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::ErrorKind;
use psls_jobs::control::FinishError;
use psls_jobs::{Action, Answer, Command, CommandError, Config, Control, Done, NodeView, Report, StepError};
use psls_pfs::meta::MetaOp;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// Most inputs waiting for the task.
pub const MAX_INPUTS: usize = 4096;

/// What the task is told.
pub enum Input {
    Report {
        from: String,
        incarnation: u64,
        reports: Vec<Report>,
    },
    Command {
        cmd: Command,
        reply: oneshot::Sender<Answer>,
    },
    Done {
        /// The term the step was asked in.
        term: u64,
        job: String,
        attempt: u32,
        done: Done,
    },
    /// A replacement by a spare asked in `term` is done.
    Replaced {
        term: u64,
        logical: u32,
        result: Result<(), StepError>,
    },
    Refused {
        job: String,
        op: MetaOp,
        why: String,
    },
    Halted {
        job: String,
        epoch: u64,
    },
    /// Something changed (an operation applied): look again.
    Poke,
}

/// What job control's task and its steps act through: the node, its checkpoints, and the
/// task's own handle (a narrow view of the daemon).
#[derive(Clone)]
pub struct Shell {
    pub node: Arc<Node>,
    pub ckpt: Arc<CkptShell>,
    pub jobctl: Arc<JobCtl>,
}

/// The handle other parts of the daemon hold.
pub struct JobCtl {
    tx: mpsc::Sender<Input>,
    rx: Mutex<Option<mpsc::Receiver<Input>>>,
    /// What the driver does for each job, and since when, for `psls jobs`.
    activity: Mutex<BTreeMap<String, (String, Instant)>>,
    /// The term this node drives in (0: it does not): a step checks it before each call, so
    /// that a driver deposed (or paused) mid-step stops there.
    lead_term: std::sync::atomic::AtomicU64,
}

impl Default for JobCtl {
    fn default() -> JobCtl {
        let (tx, rx) = mpsc::channel(MAX_INPUTS);
        JobCtl {
            tx,
            rx: Mutex::new(Some(rx)),
            activity: Mutex::new(BTreeMap::new()),
            lead_term: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl JobCtl {
    /// Whether this node still drives in `term`.
    pub fn drives_in(&self, term: u64) -> bool {
        term != 0 && self.lead_term.load(std::sync::atomic::Ordering::SeqCst) == term
    }

    /// Hands `input` to the task (dropped if its queue is full: see the module doc).
    pub fn post(&self, input: Input) {
        if self.tx.try_send(input).is_err() {
            tracing::warn!("job control's queue is full: an input is dropped (it comes again)");
        }
    }

    /// A command to this node's machine; its answer.
    pub async fn command(&self, cmd: Command) -> Answer {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Input::Command { cmd, reply }).await.is_err() {
            return Answer::Refused(CommandError::NotLeader);
        }
        rx.await.unwrap_or(Answer::Refused(CommandError::NotLeader))
    }

    /// What job control's driver does for `job` (empty: this node does not drive it).
    pub fn activity(&self, job: &str) -> String {
        self.activity
            .locked()
            .get(job)
            .map(|(w, t)| format!("{w} (for {:.1} s)", t.elapsed().as_secs_f64()))
            .unwrap_or_default()
    }
}

/// Sends `cmd` to the metadata's leader and waits for its answer (tries again while the
/// leader changes, for up to three request timeouts).
pub async fn command(d: &Shell, cmd: Command) -> Result<Answer, OpError> {
    let node = &d.node;
    let deadline = Instant::now() + node.request_timeout * 3;
    loop {
        let answer = match node.replication.leader() {
            Some(l) if l == node.me.name => Some(d.jobctl.command(cmd.clone()).await),
            Some(l) => match node.call_ok(&l, PeerReq::JobCommand { cmd: cmd.clone() }).await {
                Ok(PeerResp::JobAnswer { answer }) => Some(answer),
                _ => None,
            },
            None => None,
        };
        match answer {
            Some(Answer::Refused(CommandError::NotLeader)) | None => {}
            Some(a) => return Ok(a),
        }
        if Instant::now() >= deadline {
            return Err(OpError::new(
                ErrorKind::Unavailable,
                "job control is unavailable: no metadata leader answered",
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn config(d: &Shell) -> Config {
    let c = &d.node.cfg.cluster;
    Config {
        grace_ms: c.heartbeat_timeout_ms + 2 * c.heartbeat_interval_ms,
        pass_pause_ms: c.heartbeat_timeout_ms,
        max_passes: 8,
        retry_ms: (d.node.request_timeout.as_millis() as u64).max(1_000),
        rebuild_timeout_ms: 600_000,
        nodes: d.node.cfg.nodes.iter().map(|n| n.name.clone()).collect(),
        spares: d.node.cfg.spares.iter().map(|s| s.name.clone()).collect(),
        replace_after_ms: c.replace_after_ms,
        ..Config::default()
    }
}

/// The task: until the daemon stops.
pub async fn run(d: Arc<Shell>) {
    let Some(mut rx) = d.jobctl.rx.locked().take() else {
        return;
    };
    let node = d.node.clone();
    let mut control = Control::new(config(&d));
    let mut replies: HashMap<u64, oneshot::Sender<Answer>> = HashMap::new();
    let mut next_id = 0u64;
    let mut last_seq = u64::MAX;
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(node.cfg.cluster.heartbeat_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut ticked = false;
        tokio::select! {
            i = rx.recv() => {
                let Some(i) = i else { return };
                match i {
                    Input::Report { from, incarnation, reports } => {
                        for r in &reports {
                            control.handle_report(&from, incarnation, r);
                        }
                    }
                    Input::Command { cmd, reply } => {
                        next_id += 1;
                        replies.insert(next_id, reply);
                        // A start records its nodes' incarnations: as the heartbeats say now,
                        // not as at the last tick (a node restarted since would look lost at
                        // once, and the new job roll back).
                        control.handle_tick(start.elapsed().as_millis() as u64, crate::pfs::unix_ms(), &views(&d));
                        control.handle_command(next_id, cmd);
                    }
                    Input::Done {
                        term,
                        job,
                        attempt,
                        done,
                    } => control.handle_done(term, &job, attempt, done),
                    Input::Replaced { term, logical, result } => control.handle_replaced(term, logical, result),
                    Input::Refused { job, op, why } => control.handle_refused(&job, &op, &why),
                    Input::Halted { job, epoch } => control.handle_halted(&job, epoch),
                    Input::Poke => {}
                }
            }
            _ = tick.tick() => ticked = true,
        }
        // It drives while it coordinates and its metadata log leads with its lease: no other
        // node leads then, so no two drive at once (the job-control simulator's check).
        let lead = match node.coordinator_now() {
            Some((_, p)) if p == node.me.name && node.replication.lease_held() => {
                node.replication.leader_epoch().map(|(_, term)| term)
            }
            _ => None,
        };
        d.jobctl
            .lead_term
            .store(lead.unwrap_or(0), std::sync::atomic::Ordering::SeqCst);
        control.handle_lead(lead);
        let st = node.meta_state();
        if st.seq != last_seq {
            last_seq = st.seq;
            control.handle_meta(&st);
        }
        if ticked {
            let views = views(&d);
            control.handle_tick(start.elapsed().as_millis() as u64, crate::pfs::unix_ms(), &views);
        }
        {
            // Each job's step, and since when it is at it.
            let mut a = d.jobctl.activity.locked();
            let driven: Vec<String> = control.jobs_driven().map(|j| j.to_string()).collect();
            a.retain(|j, _| driven.contains(j));
            for j in driven {
                match control.activity(&j) {
                    Some(what) => {
                        if a.get(&j).is_none_or(|(w, _)| *w != what) {
                            a.insert(j, (what, Instant::now()));
                        }
                    }
                    None => {
                        a.remove(&j);
                    }
                }
            }
        }
        while let Some(action) = control.poll_action() {
            if let Action::Answer { id, answer } = action {
                if let Some(r) = replies.remove(&id) {
                    let _ = r.send(answer);
                }
                continue;
            }
            execute(&d, action);
        }
    }
}

/// Each physical node's liveness and newest known incarnation.
fn views(d: &Shell) -> BTreeMap<String, NodeView> {
    let node = &d.node;
    node.cfg
        .nodes
        .iter()
        .chain(node.cfg.spares.iter())
        .map(|n| {
            let incarnation = node.heard_incarnation(&n.name);
            (
                n.name.clone(),
                NodeView {
                    live: node.is_live(&n.name),
                    incarnation,
                    declared_down: node.is_declared_down(&n.name),
                    disk_failed: node.peer_disk_failed(&n.name),
                },
            )
        })
        .collect()
}

/// Retry or fail is job control's decision ([`StepError::of`]).
fn step_error(e: OpError) -> StepError {
    StepError::of(e.kind, e.message)
}

/// Carries out one action in a task of its own.
fn execute(d: &Arc<Shell>, action: Action) {
    let d = d.clone();
    // The term the step was asked in: a restore stops at its next call once it is over.
    let term = d.jobctl.lead_term.load(std::sync::atomic::Ordering::SeqCst);
    tokio::spawn(async move {
        let node = d.node.clone();
        match action {
            Action::Submit { job, op } => {
                tracing::info!(node = %node.name(), %job, ?op, "job control records");
                match node.submit(op.clone()).await {
                    Ok(()) => d.jobctl.post(Input::Poke),
                    Err(e) => {
                        tracing::info!(node = %node.name(), %job, error = %e, "job control's record refused");
                        d.jobctl.post(Input::Refused {
                            job,
                            op,
                            why: e.message,
                        })
                    }
                }
            }
            Action::Spawn { physical, job, attempt } => {
                if let Err(e) = node
                    .call_ok(
                        &physical,
                        PeerReq::StartRanks {
                            job: job.clone(),
                            attempt,
                        },
                    )
                    .await
                {
                    tracing::warn!(node = %node.name(), %job, attempt, peer = %physical, error = %e, "could not start ranks there");
                }
            }
            Action::StopRanks { job, attempt, nodes } => {
                let mut asks = tokio::task::JoinSet::new();
                for p in nodes {
                    let (node, job) = (node.clone(), job.clone());
                    asks.spawn(async move {
                        let ok = node.call_ok(&p, PeerReq::StopRanks { job, attempt }).await.is_ok();
                        (p, ok)
                    });
                }
                let mut stopped = Vec::new();
                while let Some(r) = asks.join_next().await {
                    if let Ok((p, true)) = r {
                        stopped.push(p);
                    }
                }
                d.jobctl.post(Input::Done {
                    term,
                    job,
                    attempt,
                    done: Done::Stopped { nodes: stopped },
                });
            }
            Action::Replace { logical, spare } => {
                tracing::warn!(node = %node.name(), logical, %spare, "node down too long, or its disk failed: a spare takes its place");
                let r = crate::pfs::replace(&node, logical, &spare).await.map_err(|e| {
                    StepError::Unavailable(format!("replacing logical node {logical} by {spare}: {}", e.message))
                });
                if let Err(e) = &r {
                    tracing::warn!(node = %node.name(), logical, %spare, error = %e, "replacement failed");
                }
                d.jobctl.post(Input::Replaced {
                    term,
                    logical,
                    result: r,
                });
            }
            Action::Restore { job, attempt } => {
                // Only while this node drives in the term it was asked in, and the records are
                // still at this start's rollback (a late record of an earlier driver may have
                // moved the job on).
                let driving =
                    || d.jobctl.drives_in(term) && psls_jobs::local::rolling_back(&node.meta_state(), &job, attempt);
                let r = crate::recovery::restore(&node, &d.ckpt, &job, &driving)
                    .await
                    .map_err(step_error);
                let outcome = match &r {
                    Ok(_) => "restored",
                    Err(StepError::Unavailable(e)) => {
                        tracing::warn!(node = %node.name(), %job, error = %e, "rollback interrupted: trying again");
                        "interrupted"
                    }
                    Err(e) => {
                        tracing::warn!(node = %node.name(), %job, error = %e, "rollback failed");
                        "failed"
                    }
                };
                node.metrics.rollbacks.with_label_values(&[outcome]).inc();
                d.jobctl.post(Input::Done {
                    term,
                    job,
                    attempt,
                    done: Done::Restored(r),
                });
            }
            Action::Finish {
                job,
                attempt,
                persistent_only,
            } => {
                crate::failpoint::pass_async(d.node.name(), "job.finish").await;
                let r = finish(&d, &job, persistent_only).await;
                d.jobctl.post(Input::Done {
                    term,
                    job,
                    attempt,
                    done: Done::Finished(r),
                });
            }
            Action::Release { job, attempt, keep } => {
                let resumable = release(&d, &job, keep).await;
                d.jobctl.post(Input::Done {
                    term,
                    job,
                    attempt,
                    done: Done::Released { resumable },
                });
            }
            Action::ForceHalt { job, attempt } => {
                // The halt waits for the job's next safe point: asked until the coordinator
                // knows the job's calls (or the job moved on).
                loop {
                    match d.ckpt.force(&job, true, 0).await {
                        Ok(_) => break,
                        Err(e) => {
                            let st = node.meta_state();
                            if st.runs.get(&job).is_none_or(|r| r.attempt != attempt) {
                                break;
                            }
                            tracing::debug!(node = %node.name(), %job, error = %e, "halt not taken yet");
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            Action::Answer { .. } => {}
        }
    });
}

/// The last checkpoints of a job whose ranks all exited 0: a memory one keeps the result in the
/// nodes' memories (unless the job takes persistent ones only), then a persistent one makes it
/// durable.
async fn finish(d: &Arc<Shell>, job: &str, persistent_only: bool) -> Result<(), FinishError> {
    let node = &d.node;
    let st = node.meta_state();
    let mut files: Vec<psls_svm::FileId> = crate::launcher::job_files(node, job, false).await;
    files.extend(st.files_written_by(job).map(|f| f.id));
    if let Some(f) = st.finished.get(job) {
        files.extend(f.files.iter().copied());
    }
    files.sort_unstable();
    files.dedup();
    if files.is_empty() {
        return Ok(());
    }
    let kept = if persistent_only {
        None
    } else {
        match d
            .ckpt
            .checkpoint_at(job, files.clone(), psls_ckpt::msg::Level::Memory)
            .await
        {
            Ok(k) => {
                // The finished result's checkpoint is recorded before the persistent one: a
                // rollback that restores it (a node lost meanwhile) writes it, never restarts
                // the ranks from it (it holds no rank states: the nemesis met every restarted
                // rank refused with "state belongs to checkpoint 30, not 31"). A resumed
                // finished job keeps its record.
                if !st.finished.contains_key(job) {
                    let op = MetaOp::JobFinished {
                        job: job.to_string(),
                        why: String::new(),
                        files: files.clone(),
                        epoch: k.epoch,
                    };
                    if let Err(e) = node.submit(op).await {
                        tracing::warn!(node = %node.name(), job, epoch = k.epoch, error = %e, "the finished result's checkpoint is not recorded");
                    }
                }
                crate::failpoint::pass_async(node.name(), "job.finish.kept").await;
                Some(k.epoch)
            }
            Err(e) => {
                tracing::info!(node = %node.name(), job, error = %e, "no memory checkpoint of the finished job");
                None
            }
        }
    };
    match d.ckpt.checkpoint(job, files.clone()).await {
        Ok(_) => Ok(()),
        Err(e) => match kept {
            Some(epoch) => Err(FinishError::Kept {
                epoch,
                files,
                why: e.message,
            }),
            None => Err(FinishError::Failed {
                why: e.message,
                resumable: node.meta_state().jobs.get(job).is_some_and(|r| r.epoch > 0),
            }),
        },
    }
}

/// Lets a job go: with `keep`, what it holds stays if it has a checkpoint to resume from
/// (returns true); otherwise its segments, recovery copies, area and record go.
async fn release(d: &Arc<Shell>, job: &str, keep: bool) -> bool {
    let node = &d.node;
    let st = node.meta_state();
    let resumable = keep
        && (st.jobs.get(job).is_some_and(|r| r.epoch > 0)
            || st.finished.contains_key(job)
            || crate::recovery::memory_committed(node, job).await > 0);
    if !resumable {
        crate::launcher::drop_job_segments(node, job).await;
        d.ckpt.end_job(job).await;
    }
    resumable
}
