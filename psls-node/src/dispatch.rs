//! The daemon assembled: the node's core ([`Node`]) and the subsystems built on it — shared
//! memory ([`SvmShell`]), barriers and locks ([`SyncShell`]), the sync channels, the jobs,
//! checkpoints ([`CkptShell`]) — in
//! one [`Daemon`], and the dispatch of what peers send: requests on the transport
//! ([`Handler`]) and one-way messages on the message link ([`LinkDelivery`]), each to the
//! subsystem it concerns. Also the periodic duties (heartbeats, metadata catch-up, shared
//! memory bookkeeping, rebuild and automatic replacement). The top of the daemon: `daemon`,
//! `ipc` and job control (`jobctl`, which drives every subsystem) import it.

use crate::ckpt::CkptShell;
use crate::failstop::Locked;
use crate::launcher::Jobs;
use crate::node::Node;
use crate::op::{blocking, peer_error, OpError};
use crate::peer::PeerReq;
use crate::peer::PeerResp;
use crate::svm::SvmShell;
use crate::sync::SyncShell;
use crate::sync_channel::Channels;
use crate::transport::{BoxFuture, Handler};
use psls_ipc::ErrorKind;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A running daemon: the core and its subsystems.
pub struct Daemon {
    pub node: Arc<Node>,
    /// Shared virtual memory: segments, client mappings, the coherence state machine.
    pub svm: Arc<SvmShell>,
    /// Barriers and locks: waiting ranks, and the coordinator's state.
    pub sync: Arc<SyncShell>,
    /// Local clients' sync channels (served by the `psls-sync` thread).
    pub channels: Arc<Channels>,
    /// Jobs launched here and rank processes running here.
    pub jobs: Arc<Jobs>,
    /// Checkpoints: this node's participant and, while it coordinates, the rounds.
    pub ckpt: Arc<CkptShell>,
    /// Job control: its machine's task drives every job while this node leads the metadata.
    pub jobctl: Arc<crate::jobctl::JobCtl>,
}

/// Exit status of a daemon that stopped because its disk failed (EX_IOERR).
pub const DISK_FAILED_EXIT: i32 = 74;

impl Daemon {
    /// Job control's view of the daemon.
    pub fn jobctl_shell(&self) -> crate::jobctl::Shell {
        crate::jobctl::Shell {
            node: self.node.clone(),
            ckpt: self.ckpt.clone(),
            jobctl: self.jobctl.clone(),
        }
    }

    /// Assembles the daemon around `node` and wires the core to it (requests to itself,
    /// shared-memory figures in heartbeats).
    pub fn new(node: Arc<Node>, channels: Channels) -> Arc<Daemon> {
        let svm = Arc::new(SvmShell::new(tokio::runtime::Handle::current()));
        let jobs = Arc::new(Jobs::default());
        let blamed = jobs.clone();
        let blame: crate::sync::Blame = Box::new(move |pid, why| blamed.blame(pid, why));
        let d = Arc::new(Daemon {
            sync: Arc::new(SyncShell::new(node.clone(), blame)),
            channels: Arc::new(channels),
            jobs,
            jobctl: Arc::new(crate::jobctl::JobCtl::default()),
            ckpt: Arc::new(CkptShell::new(
                node.clone(),
                svm.clone(),
                tokio::runtime::Handle::current(),
            )),
            svm: svm.clone(),
            node,
        });
        let beat: crate::node::SvmBeat = Arc::new(move |nodes| {
            let (view, fenced) = svm.view(nodes);
            crate::node::SvmFigures {
                segments: svm.segments(),
                view,
                fenced,
                dirty_pages: svm.dirty_pages(),
            }
        });
        let fenced = Arc::downgrade(&d);
        let fencer: crate::node::Fencer = Arc::new(move |why: &str, declared: u64| {
            let Some(d) = fenced.upgrade() else { return };
            let ranks = crate::launcher::local_ranks(&d.jobs);
            if d.node.store.is_poisoned() {
                // A node whose disk failed does not rejoin: it is failed for good, and a spare
                // takes its place. It stops, its ranks with it.
                tracing::error!(node = %d.node.name(), why, "fenced with a failed disk: stopping (repair the disk, then start the node again)");
                crate::incarnation::stop_ranks(&ranks);
                std::process::exit(DISK_FAILED_EXIT);
            }
            let dir = d.node.cfg.data_dir(&d.node.me);
            tracing::warn!(node = %d.node.name(), why, ranks = ranks.len(), "rejoining as a new incarnation");
            let e = crate::incarnation::rejoin(&dir, &ranks, declared);
            tracing::error!(node = %d.node.name(), error = %e, "cannot re-execute the daemon: stopping");
            std::process::exit(crate::failstop::PANIC_EXIT);
        });
        d.node.wire(d.clone(), beat, fencer);
        d
    }

    /// Heartbeats and periodic duties, until shutdown.
    pub async fn run_ticks(self: Arc<Self>) {
        let node = self.node.clone();
        let interval = Duration::from_millis(node.cfg.cluster.heartbeat_interval_ms);
        let mut t = tokio::time::interval(interval);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n: u64 = 0;
        // Jobs whose recovery copies are here but whom the records no longer know, and since
        // which tick (a job just started may not be in this node's records yet).
        let mut orphans: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
        loop {
            t.tick().await;
            if n.is_multiple_of(10) {
                node.refresh_disk_stats_async().await;
                node.net.close_idle();
                self.drop_orphan_frames(&mut orphans, n);
            }
            n += 1;
            node.beat_round();
            // The coordinator turns silences that outlast the failure timeout into verdicts.
            node.watch_duties();
            node.check_fresh_cluster();
            if self.svm.recovering() {
                // Ends once every node answers that it holds nothing.
                let d = self.clone();
                tokio::spawn(async move {
                    d.svm.ask_peers(&d.node).await;
                    d.svm.sync_peers(&d.node);
                });
            }
            self.svm.sync_peers(&node);
            self.ckpt.tick();
            {
                let d = self.clone();
                tokio::spawn(async move {
                    let reports = crate::launcher::tick(&d.node, &d.jobs).await;
                    if !reports.is_empty() {
                        d.jobctl.post(crate::jobctl::Input::Report {
                            from: d.node.name().to_string(),
                            incarnation: d.node.incarnation,
                            reports,
                        });
                    }
                });
            }
            crate::pfs::maybe_rebuild(&node);
        }
    }
}

impl Daemon {
    /// Drops the recovery copies of jobs the records have not known for [`ORPHAN_TICKS`]
    /// ticks (removed while this node was down, or ended while it missed the news): kept,
    /// they would refuse the next job's copies of the file.
    fn drop_orphan_frames(&self, orphans: &mut std::collections::HashMap<String, u64>, tick: u64) {
        let st = self.node.meta_state();
        let held = self.node.frames.jobs();
        orphans.retain(|j, _| held.contains(j));
        for job in held {
            if st.jobs.contains_key(&job) || st.runs.contains_key(&job) {
                orphans.remove(&job);
                continue;
            }
            let since = *orphans.entry(job.clone()).or_insert(tick);
            if tick.saturating_sub(since) >= ORPHAN_TICKS {
                tracing::info!(node = %self.node.name(), job, "recovery copies of a job the records no longer know dropped");
                self.ckpt.forget_job(&job);
                orphans.remove(&job);
            }
        }
    }
}

/// How many heartbeat ticks a job's recovery copies stay once the records do not know it.
const ORPHAN_TICKS: u64 = 50;

impl Handler for Daemon {
    fn handle(
        self: Arc<Self>,
        from: String,
        req: PeerReq,
        payload: bytes::Bytes,
    ) -> BoxFuture<(PeerResp, bytes::Bytes)> {
        Box::pin(self.handle_inner(from, req, payload))
    }
}

impl Daemon {
    async fn handle_inner(
        self: Arc<Self>,
        from: String,
        req: PeerReq,
        payload: bytes::Bytes,
    ) -> (PeerResp, bytes::Bytes) {
        let node = self.node.clone();
        let mut out_payload = bytes::Bytes::new();
        let r: Result<PeerResp, OpError> = match req {
            PeerReq::Heartbeat(hb) => {
                node.heard(&from, hb);
                let base = node.heartbeat_recent();
                Ok(PeerResp::HeartbeatAck(node.heartbeat_to(&base, &from)))
            }
            PeerReq::Watch { silent, back } => {
                let most = node.cfg.all().count();
                if silent.len() > most || back.len() > most {
                    Err(OpError::new(
                        ErrorKind::Invalid,
                        "a watch report names more peers than the cluster has",
                    ))
                } else {
                    node.handle_watch(&from, silent, back);
                    Ok(PeerResp::Ok)
                }
            }
            PeerReq::Figures(hb) => {
                node.handle_figures(&from, hb);
                Ok(PeerResp::Ok)
            }
            PeerReq::FiguresAsk => Ok(PeerResp::FiguresTable {
                nodes: node.figures_table(),
            }),
            PeerReq::Beat(hb) => {
                node.handle_beat(&from, hb, true);
                Ok(PeerResp::Ok)
            }
            PeerReq::BeatBack(hb) => {
                node.handle_beat(&from, hb, false);
                Ok(PeerResp::Ok)
            }
            PeerReq::WritePages {
                file,
                role,
                gen,
                indices,
            } => node
                .write_pages(file, role, gen, indices, payload)
                .await
                .map(|()| PeerResp::Stored {
                    incarnation: node.incarnation,
                }),
            PeerReq::Sync => {
                let store = node.store.clone();
                match blocking(move || store.sync()).await {
                    Ok(Ok(())) => Ok(PeerResp::Stored {
                        incarnation: node.incarnation,
                    }),
                    Ok(Err(e)) => {
                        tracing::error!(node = %node.me.name, error = %e, "fsync failed; page store poisoned");
                        Err(e.into())
                    }
                    Err(e) => Err(e),
                }
            }
            PeerReq::ReadPages {
                file,
                role,
                indices,
                gens,
            } => node.read_pages(file, role, indices, gens).await.map(|(states, data)| {
                out_payload = data;
                PeerResp::Pages(states)
            }),
            PeerReq::Frames(req) => match self.ckpt.serve_frames(&from, req, payload).await {
                Ok((resp, data)) => {
                    out_payload = data;
                    Ok(resp)
                }
                Err(e) => Err(e),
            },
            PeerReq::RemoveFile { file } => {
                let store = node.store.clone();
                blocking(move || store.remove_file(file))
                    .await
                    .and_then(|r| r.map_err(OpError::from))
                    .map(|()| PeerResp::Ok)
            }
            PeerReq::ScrubLocal { files, seq } => node
                .scrub_local(files, seq)
                .await
                .map(|(checked, bad)| PeerResp::Scrub { checked, bad }),
            PeerReq::MetaSubmit { op } => Ok(node.serve_submit(&from, op).await),
            PeerReq::SvmHeld { logical } if (logical as usize) < node.cfg.nodes.len() => {
                let (segments, knew, fenced) = self.svm.held_for(logical);
                Ok(PeerResp::SvmHeld { segments, knew, fenced })
            }
            PeerReq::SvmHeld { logical } => Err(OpError::new(
                ErrorKind::Invalid,
                format!("no logical node {logical} in a cluster of {}", node.cfg.nodes.len()),
            )),
            PeerReq::DiskFree => Ok(PeerResp::DiskFree {
                bytes: node.disk_free_now().await,
            }),
            PeerReq::MetaLog(msg) => {
                node.replication.deliver(&from, &msg);
                Ok(PeerResp::Ok)
            }
            PeerReq::MetaSnapshotChunk { index, term, offset } => {
                match node.replication.snapshot_chunk(index, term, offset) {
                    Some((total, chunk)) => {
                        out_payload = chunk;
                        Ok(PeerResp::MetaSnapshotChunk { total })
                    }
                    None => Err(OpError::new(
                        ErrorKind::NotFound,
                        format!("no metadata snapshot at index {index} (term {term}) is offered here"),
                    )),
                }
            }
            req @ (PeerReq::BarrierArrive { .. }
            | PeerReq::LockAcquire { .. }
            | PeerReq::LockRelease { .. }
            | PeerReq::SyncGone { .. }
            | PeerReq::SyncReport { .. }
            | PeerReq::SyncReportAsk) => crate::sync::serve(&self.sync, &from, req),
            PeerReq::SyncDone {
                key,
                who,
                call,
                error,
                moved,
            } => {
                let result = match error {
                    None => Ok(()),
                    Some((kind, message)) => Err(OpError::new(kind, message)),
                };
                crate::sync::resolve(&self.sync, &key, &who, call, result, moved);
                Ok(PeerResp::Ok)
            }
            req @ (PeerReq::StartRanks { .. }
            | PeerReq::StopRanks { .. }
            | PeerReq::OutputSince { .. }
            | PeerReq::OutputCopy { .. }
            | PeerReq::OutputLast { .. }
            | PeerReq::Stdin { .. }
            | PeerReq::OutputOf { .. }
            | PeerReq::JobFiles { .. }) => crate::launcher::serve(&node, &self.jobs, req).await,
            PeerReq::JobReport { incarnation, reports } => {
                if reports.len() > psls_jobs::control::MAX_REPORTS {
                    Err(OpError::new(ErrorKind::Invalid, "too many job reports"))
                } else {
                    self.jobctl.post(crate::jobctl::Input::Report {
                        from: from.clone(),
                        incarnation,
                        reports,
                    });
                    Ok(PeerResp::Ok)
                }
            }
            PeerReq::JobActivity { job } => Ok(PeerResp::JobActivity {
                text: self.jobctl.activity(&job),
            }),
            PeerReq::JobCommand { cmd } => Ok(PeerResp::JobAnswer {
                answer: self.jobctl.command(cmd).await,
            }),
            PeerReq::JobHalted { job, epoch } => {
                self.jobctl.post(crate::jobctl::Input::Halted { job, epoch });
                Ok(PeerResp::Ok)
            }
            PeerReq::Echo => {
                out_payload = payload;
                Ok(PeerResp::Ok)
            }
            PeerReq::JobEnded { job } => {
                self.ckpt.forget_job(&job);
                Ok(PeerResp::Dropped {
                    files: self.svm.end_job(&node, &job),
                })
            }
            PeerReq::ForgetFiles { files } => {
                if files.len() > crate::launcher::MAX_JOB_SEGMENTS {
                    Err(OpError::new(ErrorKind::Invalid, "too many segments to forget at once"))
                } else {
                    let pages = self.svm.forget(&files);
                    tracing::debug!(node = %node.name(), segments = files.len(), pages, "ended job's segments forgotten");
                    Ok(PeerResp::Ok)
                }
            }
            PeerReq::CountMappings { file } => Ok(PeerResp::Mappings {
                count: self.svm.mappings(file),
            }),
            PeerReq::DropRemoved { file } => {
                self.svm.drop_removed(&node, file);
                Ok(PeerResp::Ok)
            }
            PeerReq::FenceAsk {
                manager,
                incarnation,
                file,
            } => {
                let manager = psls_svm::NodeId(manager);
                if node.speaks_for(&from, manager) {
                    let inc = psls_svm::Incarnation(incarnation);
                    Ok(PeerResp::Fence(self.svm.fence_answer(manager, inc, file)))
                } else {
                    Err(OpError::new(
                        ErrorKind::Permission,
                        format!("{from} may not ask as node {manager}"),
                    ))
                }
            }
            PeerReq::Svm(env) => {
                if node.speaks_for(&from, env.from) {
                    self.svm.on_message(&node, env, payload);
                    Ok(PeerResp::Ok)
                } else {
                    Err(OpError::new(
                        ErrorKind::Permission,
                        format!("{from} may not send coherence messages as node {}", env.from),
                    ))
                }
            }
            PeerReq::SvmBatch(envs) => match envs.iter().find(|e| !node.speaks_for(&from, e.from)) {
                None => {
                    self.svm.on_messages(&node, envs, payload);
                    Ok(PeerResp::Ok)
                }
                Some(e) => Err(OpError::new(
                    ErrorKind::Permission,
                    format!("{from} may not send coherence messages as node {}", e.from),
                )),
            },
            PeerReq::LinkPing { .. } | PeerReq::LinkPong { .. } | PeerReq::Ckpt(_) => Err(OpError::new(
                ErrorKind::Invalid,
                "link pings and checkpoint messages go over the message link",
            )),
            PeerReq::CkptRun { job, files, level } => self.ckpt.serve_run(job, files, level).await,
            PeerReq::CkptArrive(call) => self.ckpt.serve_arrive(&from, call).await,
            PeerReq::CkptForce { job, halt, uid } => self.ckpt.serve_force(&job, halt, uid),
            PeerReq::CkptEnd { job } => Ok(self.ckpt.serve_end(&job)),
            PeerReq::CkptProgress { job } => Ok(self.ckpt.serve_progress(&job)),
            PeerReq::CkptRollback { job, at_least } => self.ckpt.serve_rollback(&job, at_least).await,
            PeerReq::RollbackDrop { job, files } => {
                if files.len() > crate::launcher::MAX_JOB_SEGMENTS {
                    Err(OpError::new(ErrorKind::Invalid, "too many files in one rollback"))
                } else {
                    crate::failpoint::pass_async(node.name(), "rollback.drop").await;
                    crate::launcher::kill_local(&self.jobs, &job);
                    self.ckpt.rollback_local(&job);
                    Ok(PeerResp::Dropped {
                        files: self.svm.drop_for_rollback(&node, &job, &files),
                    })
                }
            }
            PeerReq::RollbackPrefetch { job, limit } => match psls_pfs::jobs::validate_job(&job) {
                Err(e) => Err(OpError::from(e)),
                Ok(()) => {
                    let deadline = std::time::Instant::now() + node.request_timeout / 2;
                    let pages = self.svm.prefetch_active(&node, &job, limit, deadline).await;
                    Ok(PeerResp::Prefetched { pages })
                }
            },
            PeerReq::RollbackServe { files } => {
                if files.len() > 2 * crate::launcher::MAX_JOB_SEGMENTS {
                    Err(OpError::new(ErrorKind::Invalid, "too many files in one rollback"))
                } else {
                    // The restarted ranks will need every node: this one must see them all up
                    // (with their current incarnations) before it says it is ready.
                    let deadline = std::time::Instant::now() + node.request_timeout;
                    let all_up = || {
                        let st = node.meta_state();
                        node.logical_map(&st).values().all(|p| node.is_live(p))
                    };
                    while !all_up() && std::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    self.svm.sync_peers(&node);
                    self.svm.serve_rebuilt(&node, &files);
                    if all_up() {
                        Ok(PeerResp::Ok)
                    } else {
                        Err(OpError::new(
                            ErrorKind::Unavailable,
                            format!("{} does not see every node up", node.name()),
                        ))
                    }
                }
            }
        };
        match r {
            Ok(resp) => (resp, out_payload),
            Err(e) => (peer_error(e), bytes::Bytes::new()),
        }
    }
}

/// Delivers the message link's messages to the node (on the link thread). What the coherence
/// messages of one wake-up set off is sent when the link has delivered them all
/// ([`crate::link::LinkHandler::delivered`]), so that messages for one node go together.
pub struct LinkDelivery {
    daemon: Arc<Daemon>,
    /// Taken only by the link thread.
    later: Mutex<crate::svm::Deferred>,
}

impl LinkDelivery {
    pub fn new(daemon: Arc<Daemon>) -> LinkDelivery {
        LinkDelivery {
            daemon,
            later: Mutex::new(crate::svm::Deferred::default()),
        }
    }
}

impl crate::link::LinkHandler for LinkDelivery {
    fn delivered(&self) {
        let later = std::mem::take(&mut *self.later.locked());
        self.daemon.svm.dispatch_deferred(&self.daemon.node, later);
    }

    fn deliver(&self, from: &str, req: PeerReq, payload: bytes::Bytes) {
        let d = &self.daemon;
        let node = &d.node;
        match req {
            PeerReq::Svm(env) => {
                if node.speaks_for(from, env.from) {
                    d.svm
                        .on_messages_deferred(node, vec![env], payload, &mut self.later.locked())
                } else {
                    tracing::warn!(node = %node.name(), peer = from, claimed = %env.from, "coherence message sent in another node's name: dropped");
                }
            }
            PeerReq::SvmBatch(envs) => match envs.iter().find(|e| !node.speaks_for(from, e.from)) {
                None => d
                    .svm
                    .on_messages_deferred(node, envs, payload, &mut self.later.locked()),
                Some(e) => {
                    tracing::warn!(node = %node.name(), peer = from, claimed = %e.from, "coherence messages sent in another node's name: dropped")
                }
            },
            req @ (PeerReq::BarrierArrive { .. }
            | PeerReq::LockAcquire { .. }
            | PeerReq::LockRelease { .. }
            | PeerReq::SyncGone { .. }
            | PeerReq::SyncReport { .. }
            | PeerReq::SyncReportAsk) => {
                if let Err(e) = crate::sync::serve(&d.sync, from, req) {
                    tracing::warn!(node = %node.name(), peer = from, error = %e, "barrier or lock message refused");
                }
            }
            PeerReq::SyncDone {
                key,
                who,
                call,
                error,
                moved,
            } => {
                let result = match error {
                    None => Ok(()),
                    Some((kind, message)) => Err(OpError::new(kind, message)),
                };
                crate::sync::resolve(&d.sync, &key, &who, call, result, moved);
            }
            PeerReq::MetaLog(msg) => node.replication.deliver(from, &msg),
            PeerReq::Beat(hb) => node.handle_beat(from, hb, true),
            PeerReq::BeatBack(hb) => node.handle_beat(from, hb, false),
            PeerReq::Ckpt(msg) => d.ckpt.deliver(from, msg),
            PeerReq::LinkPing { id } => {
                if let Err(e) = node.net.post(from, &PeerReq::LinkPong { id }, payload) {
                    tracing::warn!(node = %node.name(), peer = from, error = %e, "link pong not sent");
                }
            }
            PeerReq::LinkPong { id } => {
                let waiter = node.link_pings.locked().remove(&id);
                if let Some(tx) = waiter {
                    let _ = tx.send(payload.len());
                }
            }
            other => {
                tracing::warn!(node = %node.name(), peer = from, message = ?std::mem::discriminant(&other), "not a one-way message: dropped");
            }
        }
    }
}
