//! The ranks' safe-point call (`Session::checkpoint`) in the daemon.
//!
//! On a rank's node ([`CkptShell::safe_point`]): the rank's private state is kept here, and
//! the call goes to the coordinator. At the coordinator ([`CkptShell::serve_arrive`]): the
//! calls are collected (`psls_ckpt::SafePoints`); once every rank of the job made its call,
//! the decision is carried out — a checkpoint round over the files the ranks map writable and
//! the job's checkpoint area (its ranks' states), or nothing — and every rank is answered. A
//! halt (`psls halt`) ends with the job's launcher stopping the ranks.
//!
//! Invariants: a rank's state is written only in a round of its own job, at that round's
//! epoch; each waiting rank is answered exactly once (a decision, a timeout, or the
//! coordinator's end).

use super::round::{unavailable, CkptShell, Release, SafeAnswer, SafeOutcome, SafeRound};
use super::states::{self, MAX_STATE_BYTES};
use crate::failstop::Locked;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp, SafeCall};
use crate::svm::Taken;
use psls_ckpt::msg::Level;
use psls_ckpt::safepoint::ArriveError;
use psls_ckpt::{Decision, SafeAction};
use psls_ipc::ErrorKind;
use psls_svm::{FileId, NodeId, PAGE_SIZE};
use std::sync::Arc;
use std::time::Duration;

impl CkptShell {
    /// On a rank's node: makes the rank's call with its `state` and its last output line
    /// number `output_seq` (kept with the state); returns the epoch taken (0: none) and
    /// whether the job halts.
    pub async fn safe_point(
        self: &Arc<Self>,
        call: SafeCall,
        state: Vec<u8>,
        output_seq: Option<u64>,
    ) -> Result<SafeOutcome, OpError> {
        if state.len() > MAX_STATE_BYTES {
            return Err(OpError::new(
                ErrorKind::Invalid,
                format!(
                    "a rank's checkpoint state is at most {MAX_STATE_BYTES} bytes; this one is {}",
                    state.len()
                ),
            ));
        }
        psls_pfs::jobs::validate_job(&call.job).map_err(OpError::from)?;
        let key = (call.job.clone(), call.rank);
        self.states
            .locked()
            .insert(key.clone(), (call.attempt, state, output_seq));
        let attempt = call.attempt;
        let timeout = Duration::from_millis(call.timeout_ms + super::round::ROUND_TIMEOUT_MS + 5000);
        let req = PeerReq::CkptArrive(call);
        let r = self.call_coordinator(req, timeout).await;
        // The state went into the checkpoint, or the call is over without one (a restarted
        // rank's newer call keeps its own).
        {
            let mut states = self.states.locked();
            if states.get(&key).is_some_and(|(a, _, _)| *a == attempt) {
                states.remove(&key);
            }
        }
        match r? {
            PeerResp::SafeDone {
                epoch,
                halt,
                pages,
                stopped_us,
            } => Ok(SafeOutcome {
                epoch,
                halt,
                pages,
                stopped_us,
            }),
            other => Err(OpError::new(
                ErrorKind::Internal,
                format!("unexpected answer {other:?}"),
            )),
        }
    }

    /// The pages of `job`'s ranks' states kept here, for checkpoint `epoch` (in area `file`).
    pub(super) fn state_pages(&self, job: &str, epoch: u64, file: FileId) -> Vec<Taken> {
        self.states
            .locked()
            .iter()
            .filter(|((j, _), _)| j == job)
            .map(|((_, rank), (_, state, output_seq))| {
                let (first, data) = states::encode(*rank, epoch, state, *output_seq);
                let n = (data.len() / PAGE_SIZE) as u64;
                Taken {
                    file,
                    indices: (first..first + n).collect(),
                    data,
                }
            })
            .collect()
    }

    /// At the coordinator: rank `call.rank` of `call.job`, on `from`, made its call; answered
    /// once the job's decision was carried out.
    pub async fn serve_arrive(self: &Arc<Self>, from: &str, call: SafeCall) -> Result<PeerResp, OpError> {
        if !self.coordinating() {
            return Ok(PeerResp::NotCoordinator);
        }
        let node = &self.node;
        let st = node.meta_state();
        let Some(l) = node
            .logical_map(&st)
            .into_iter()
            .find(|(_, p)| p == from)
            .map(|(l, _)| NodeId(l))
        else {
            return Err(OpError::new(ErrorKind::Invalid, format!("{from} holds no logical id")));
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let key = (call.job.clone(), call.rank);
        let id = call.id();
        let retried = {
            let mut waiters = self.safe_waiters.locked();
            match waiters.get(&key).map(|(w, _)| *w) {
                Some(w) if w.attempt > call.attempt => {
                    return Err(OpError::new(
                        ErrorKind::Invalid,
                        format!(
                            "rank {} of job {} calls from start {}; the job is at start {}",
                            call.rank, call.job, call.attempt, w.attempt
                        ),
                    ))
                }
                // The same call again: its node lost the connection it was waiting on and
                // retried. The rank arrived already; the retry takes over the wait.
                Some(w) if w == id => {
                    tracing::info!(job = %call.job, rank = call.rank, seq = call.seq, "a checkpoint call retried by {from}");
                    if let Some((_, old)) = waiters.insert(key, (id, tx)) {
                        let _ = old.send(Some(Err(unavailable("the call was retried"))));
                    }
                    true
                }
                _ => {
                    // The same call again, answered here already (the answer was lost on
                    // the way): the same answer, never taken for the rank's next call.
                    let answered = self
                        .safe_answered
                        .locked()
                        .get(&call.job)
                        .and_then(|a| a.get(&call.rank))
                        .filter(|(a, _)| *a == id)
                        .map(|(_, r)| r.clone());
                    if let Some(r) = answered {
                        tracing::info!(job = %call.job, rank = call.rank, seq = call.seq, "a checkpoint call answered already, made again by {from}");
                        return r.map(SafeOutcome::into_resp);
                    }
                    let r = self.safe.locked().arrive(
                        node.now_ms(),
                        &call.job,
                        (call.rank, call.attempt, call.seq, call.resent),
                        call.size,
                        (call.interval_ms, call.timeout_ms),
                        l,
                        &call.files,
                    );
                    match r {
                        Ok(()) => {}
                        Err(ArriveError::Invalid(m)) => return Err(OpError::new(ErrorKind::Invalid, m)),
                        Err(ArriveError::Again) => {
                            return Err(OpError::new(
                                ErrorKind::Invalid,
                                format!("rank {} of job {} called checkpoint twice", call.rank, call.job),
                            ))
                        }
                        Err(ArriveError::Full) => return Err(unavailable("too many jobs in checkpoint calls")),
                        Err(ArriveError::OutOfStep { why, cluster }) => {
                            // The others' calls fail with it (the machine's action).
                            drop(waiters);
                            self.drive();
                            return Err(safe_failure(why, cluster));
                        }
                    }
                    // Which incarnation of its node each rank's call came from.
                    self.arrived_incs
                        .locked()
                        .entry(call.job.clone())
                        .or_default()
                        .insert(l, call.node_inc);
                    // A call of the job's stopped start, still waiting, is over.
                    if let Some((_, old)) = waiters.insert(key, (id, tx)) {
                        let _ = old.send(Some(Err(unavailable(format!("job {} restarted", call.job)))));
                    }
                    false
                }
            }
        };
        if retried {
            return self.await_safe(rx).await;
        }
        self.owners
            .locked()
            .insert(call.job.clone(), (call.uid, call.gid, call.launcher.clone()));
        self.levels.locked().called(
            &call.job,
            psls_ckpt::level::JobChoice {
                level: call.level,
                persistent_interval_ms: call.persistent_interval_ms,
                persistent_every: call.persistent_every,
                cleaning: call.cleaning,
            },
        );
        self.drive();
        self.await_safe(rx).await
    }

    /// The answer to a rank's call, once its job's decision was carried out.
    async fn await_safe(&self, rx: tokio::sync::oneshot::Receiver<Option<SafeAnswer>>) -> Result<PeerResp, OpError> {
        match rx
            .await
            .map_err(|_| unavailable("the coordinator stopped during the call"))?
        {
            Some(r) => r.map(SafeOutcome::into_resp),
            // Made again at the new coordinator by the rank's node.
            None => Ok(PeerResp::NotCoordinator),
        }
    }

    /// This node no longer coordinates: `job`'s calls of `ranks` waiting here are told so
    /// (their nodes make them again at the new coordinator).
    pub(super) fn hand_off(&self, job: &str, ranks: &[(u32, NodeId)]) {
        let mut waiters = self.safe_waiters.locked();
        for (rank, _) in ranks {
            if let Some((_, w)) = waiters.remove(&(job.to_string(), *rank)) {
                let _ = w.send(None);
            }
        }
    }

    /// Answers the calls of `job`'s `ranks` waiting here with `r`, and keeps it for a call
    /// made again (while the safe-point machine holds the job).
    fn answer(&self, job: &str, ranks: &[(u32, NodeId)], r: Result<SafeOutcome, OpError>) {
        let mut waiters = self.safe_waiters.locked();
        let keep = self.safe.locked().has(job);
        let mut answered = self.safe_answered.locked();
        for (rank, _) in ranks {
            if let Some((id, w)) = waiters.remove(&(job.to_string(), *rank)) {
                if keep {
                    answered
                        .entry(job.to_string())
                        .or_default()
                        .insert(*rank, (id, r.clone()));
                }
                let _ = w.send(Some(r.clone()));
            }
        }
        if !keep {
            answered.remove(job);
        }
        debug_assert!(answered.len() <= psls_ckpt::MAX_ROUNDS);
    }

    pub(super) fn safe_action(self: &Arc<Self>, a: SafeAction) {
        match a {
            SafeAction::Decided {
                job,
                decision: Decision::Skip,
                ranks,
                ..
            } => {
                self.safe.locked().done(self.node.now_ms(), &job, false);
                self.arrived_incs.locked().remove(&job);
                self.answer(&job, &ranks, Ok(SafeOutcome::default()));
            }
            SafeAction::Decided {
                job,
                decision: Decision::Take { halt, forced },
                files,
                ranks,
            } => {
                // The ranks go on once every node took its pages (the round then keeps them
                // and decides in the background); a halt waits for the commit.
                let (release, released) = if halt {
                    (None, None)
                } else {
                    let (hook, rx) = Release::new();
                    (Some(hook), Some(rx))
                };
                // The nodes of the ranks, as they were when the ranks called.
                let expect = self.arrived_incs.locked().remove(&job).unwrap_or_default();
                let decided = std::time::Instant::now();
                let sp = SafeRound {
                    release,
                    expect,
                    decided: Some(decided),
                };
                // Exactly one answer: by the release, if it fired, else at the round's end.
                if let Some(rx) = released {
                    let (me, job, ranks) = (self.clone(), job.clone(), ranks.clone());
                    self.runtime.spawn(async move {
                        let Ok((epoch, pages)) = rx.await else { return };
                        crate::failpoint::pass_async(me.node.name(), "ckpt.answer").await;
                        me.safe.locked().done(me.node.now_ms(), &job, true);
                        let stopped_us = decided.elapsed().as_micros() as u64;
                        let o = SafeOutcome {
                            epoch,
                            halt: false,
                            pages,
                            stopped_us,
                        };
                        me.answer(&job, &ranks, Ok(o));
                        me.drive();
                    });
                }
                let me = self.clone();
                self.runtime.spawn(async move {
                    let r = me.take(&job, files, ranks.len() as u32, halt || forced, sp.clone()).await;
                    if sp.released() {
                        // The ranks went on already: a round that failed after that made its
                        // pages dirty again (the next checkpoint takes them), or a failure
                        // rolls the job back.
                        if let Err(e) = &r {
                            tracing::warn!(node = %me.node.name(), job, error = %e, "a checkpoint whose ranks went on did not commit");
                        }
                        me.drive();
                        return;
                    }
                    if r.is_ok() {
                        crate::failpoint::pass_async(me.node.name(), "ckpt.answer").await;
                    }
                    me.safe.locked().done(me.node.now_ms(), &job, r.is_ok());
                    if let (Ok(done), true) = (&r, halt) {
                        me.halt(&job, done.epoch).await;
                    }
                    let stopped_us = decided.elapsed().as_micros() as u64;
                    let r = match r {
                        Ok(done) => Ok(SafeOutcome {
                            epoch: done.epoch,
                            halt,
                            pages: done.pages,
                            stopped_us,
                        }),
                        // The cluster cannot take it now (a node down or rebuilding its
                        // copies): no checkpoint this time, as an interval not elapsed; the
                        // ranks go on and the next safe point tries again. (A halt is told.)
                        Err(e) if psls_ckpt::safepoint::goes_on_after(e.kind, halt) => {
                            tracing::warn!(node = %me.node.name(), job, error = %e, "no checkpoint at this safe point: the cluster cannot take one now");
                            Ok(SafeOutcome::default())
                        }
                        Err(e) => Err(e),
                    };
                    me.answer(&job, &ranks, r);
                    me.drive();
                });
            }
            SafeAction::TimedOut {
                job,
                ranks,
                why,
                cluster,
            }
            | SafeAction::OutOfStep {
                job,
                ranks,
                why,
                cluster,
            } => {
                tracing::warn!(node = %self.node.name(), job, why, cluster, "checkpoint call failed");
                self.arrived_incs.locked().remove(&job);
                self.answer(&job, &ranks, Err(safe_failure(why, cluster)));
            }
        }
    }

    /// Takes `job`'s checkpoint over `files` and its checkpoint area (created at its first);
    /// `sp.release` is fired when every node took its pages (the ranks go on then).
    async fn take(
        self: &Arc<Self>,
        job: &str,
        mut files: Vec<FileId>,
        size: u32,
        persistent: bool,
        sp: SafeRound,
    ) -> Result<super::round::Done, OpError> {
        let node = &self.node;
        let area = states::state_file_name(job);
        let (uid, gid, _) = self.owners.locked().get(job).cloned().unwrap_or_default();
        let want = states::state_file_size(size);
        let existing = node.meta_state().files.get(&area).cloned();
        let id = match existing {
            Some(f) if f.size == want => f.id,
            Some(f) => {
                return Err(OpError::new(
                    ErrorKind::Invalid,
                    format!(
                        "job {job}'s checkpoint area is for {} ranks, not {size}",
                        f.size / (want / size as u64)
                    ),
                ))
            }
            None => {
                let caller = crate::pfs::Caller { uid, gid };
                crate::pfs::lookup_or_create(node, caller, &area, want, 0o600).await?.id
            }
        };
        files.push(id);
        files.sort();
        files.dedup();
        // The job's round before this one may still be deciding (its ranks went on): the level
        // is chosen once it is over, from what it left.
        self.wait_rounds_over(job, &files).await?;
        let level = self.choose_level(job, persistent);
        let r = self.run_round(job.to_string(), files.clone(), level, sp.clone()).await;
        let went_on = sp.released();
        // What follows a failure is the level machine's (`Levels::failed`).
        let Err(e) = r else { return r };
        let next = self.levels.locked().failed(job, level, e.kind, went_on);
        let Some(next) = next else { return Err(e) };
        tracing::info!(node = %node.name(), job, error = %e, ?next, "checkpoint failed; taking another at once");
        self.run_round(job.to_string(), files, next, sp).await
    }

    /// The level of `job`'s checkpoint at this safe point (`psls_ckpt::level`): `persistent`
    /// on a halt or an operator's `psls checkpoint`.
    fn choose_level(&self, job: &str, persistent: bool) -> Level {
        let fits = self.memory_fits();
        if !fits {
            tracing::info!(node = %self.node.name(), job, "a memory checkpoint might not fit: taking the cleaner");
        }
        self.levels.locked().choose(job, self.node.now_ms(), persistent, fits)
    }

    /// Whether a memory checkpoint surely fits, by the figures the nodes sent this node (the
    /// coordinator, the metadata's leader): every dirty page of the cluster gets a frame on two
    /// nodes, at most one on any node, so each node needs room for all of them beside the
    /// frames it holds (the old copies stay until the commit). A node whose figures this node
    /// has not got may not have room: it does not fit.
    fn memory_fits(&self) -> bool {
        let node = &self.node;
        let st = node.meta_state();
        let beats: Option<Vec<crate::peer::Heartbeat>> =
            node.logical_map(&st).values().map(|p| node.heartbeat_of(p)).collect();
        let Some(beats) = beats else {
            return false;
        };
        let dirty: u64 = beats.iter().map(|h| h.dirty_pages).sum();
        // The ranks' states: at most a slot of pages per rank.
        let states = self.states.locked().len() as u64 * 257;
        beats
            .iter()
            .all(|h| h.frames.frames() + dirty + states <= h.frame_capacity)
    }

    /// A halted job: job control (at the metadata's leader, this coordinator) stops it.
    async fn halt(&self, job: &str, epoch: u64) {
        let req = PeerReq::JobHalted {
            job: job.to_string(),
            epoch,
        };
        let me = self.node.me.name.clone();
        if let Err(e) = self.node.call_ok(&me, req).await {
            tracing::warn!(node = %self.node.name(), job, error = %e, "could not tell job control the job halted");
        }
        tracing::info!(node = %self.node.name(), job, epoch, "job halted after its checkpoint");
    }

    /// `psls checkpoint JOB` / `psls halt JOB`, from any node, by user `uid`.
    pub async fn force(self: &Arc<Self>, job: &str, halt: bool, uid: u32) -> Result<(), OpError> {
        psls_pfs::jobs::validate_job(job).map_err(OpError::from)?;
        let req = PeerReq::CkptForce {
            job: job.to_string(),
            halt,
            uid,
        };
        self.call_coordinator(req, self.node.request_timeout).await.map(|_| ())
    }

    /// At the coordinator.
    pub fn serve_force(&self, job: &str, halt: bool, uid: u32) -> Result<PeerResp, OpError> {
        if !self.coordinating() {
            return Ok(PeerResp::NotCoordinator);
        }
        if let Some((owner, _, _)) = self.owners.locked().get(job) {
            if uid != 0 && uid != *owner {
                return Err(OpError::new(
                    ErrorKind::Permission,
                    format!("job {job} belongs to uid {owner}: only it or root may checkpoint or halt it"),
                ));
            }
        }
        match self.safe.locked().force(job, halt) {
            Ok(()) => Ok(PeerResp::Ok),
            Err(ArriveError::Invalid(m)) => Err(OpError::new(ErrorKind::NotFound, m)),
            Err(_) => Err(unavailable("try again")),
        }
    }

    /// `job` is over for good: its checkpoint area and record go.
    pub async fn end_job(self: &Arc<Self>, job: &str) {
        let node = &self.node;
        // The ranks' states, and the files keeping the job's volatile segments.
        let prefix = states::volatile_prefix(job);
        let area: Vec<String> = node
            .meta_state()
            .files
            .keys()
            .filter(|n| **n == states::state_file_name(job) || n.starts_with(&prefix))
            .cloned()
            .collect();
        let root = crate::pfs::Caller { uid: 0, gid: 0 };
        for name in area {
            if let Err(e) = crate::pfs::remove(node, root, &name).await {
                tracing::warn!(node = %node.name(), job, file = name, error = %e, "could not remove a file of the job's checkpoint area");
            }
        }
        let st = node.meta_state();
        if st.jobs.contains_key(job) || st.files_written_by(job).next().is_some() {
            if let Err(e) = node
                .submit(psls_pfs::meta::MetaOp::EndJob { job: job.to_string() })
                .await
            {
                tracing::warn!(node = %node.name(), job, error = %e, "could not drop the job's checkpoint record");
            }
        }
        // The coordinator forgets its calls (a new coordinator never knew them).
        let _ = self
            .call_coordinator(PeerReq::CkptEnd { job: job.to_string() }, node.request_timeout)
            .await;
    }

    /// What `job`'s checkpoint in progress is doing, from the coordinator (empty: none, or
    /// no coordinator answered).
    pub async fn progress(self: &Arc<Self>, job: &str) -> (String, Option<crate::peer::LastCkpt>) {
        let req = PeerReq::CkptProgress { job: job.to_string() };
        match self.call_coordinator(req, self.node.request_timeout).await {
            Ok(PeerResp::Activity { text, last }) => (text, last),
            _ => (String::new(), None),
        }
    }

    /// At the coordinator: [`CkptShell::progress`].
    pub fn serve_progress(&self, job: &str) -> PeerResp {
        if !self.coordinating() {
            return PeerResp::NotCoordinator;
        }
        let last = self.last_ckpt.locked().get(job).cloned();
        let Some(p) = self.coord_progress(job) else {
            return PeerResp::Activity {
                text: String::new(),
                last,
            };
        };
        let waiting: Vec<String> = p.waiting.iter().map(|l| self.node.physical_now(*l)).collect();
        let secs = self.node.now_ms().saturating_sub(p.started_ms) as f64 / 1000.0;
        let mut text = format!("{} checkpoint {}: {} (for {secs:.1} s)", p.level, p.epoch, p.step);
        if p.step == psls_ckpt::Step::WritingPages {
            text.push_str(&format!(
                "; {} of {} nodes durable, waiting for {}",
                p.participants - p.waiting.len(),
                p.participants,
                waiting.join(", ")
            ));
        }
        PeerResp::Activity { text, last }
    }

    /// At the coordinator: `job` is over.
    pub fn serve_end(&self, job: &str) -> PeerResp {
        self.safe.locked().end(job);
        self.safe_answered.locked().remove(job);
        self.owners.locked().remove(job);
        PeerResp::Ok
    }

    /// `job` rolls back (from its launcher): fences every epoch begun and returns the one the
    /// job restarts from (0: its start).
    pub async fn rollback_fence(self: &Arc<Self>, job: &str, at_least: u64) -> Result<(u64, u64), OpError> {
        let req = PeerReq::CkptRollback {
            job: job.to_string(),
            at_least,
        };
        match self.call_coordinator(req, self.node.request_timeout * 4).await? {
            PeerResp::Restart { epoch, fenced } => Ok((epoch, fenced)),
            other => Err(OpError::new(
                ErrorKind::Internal,
                format!("unexpected answer {other:?}"),
            )),
        }
    }

    /// At the coordinator: a round of `job` in progress aborts (or, if it is deciding, ends
    /// by its record), its safe-point calls fail, and every epoch begun is fenced: what is
    /// committed then is what the job restarts from.
    pub async fn serve_rollback(self: &Arc<Self>, job: &str, at_least: u64) -> Result<PeerResp, OpError> {
        if !self.coordinating() {
            return Ok(PeerResp::NotCoordinator);
        }
        let node = &self.node;
        crate::failpoint::pass_async(node.name(), "rollback.fence").await;
        let deadline = std::time::Instant::now() + node.request_timeout * 3;
        loop {
            let deciding = self.coord_abort_job(job);
            self.drive();
            if !deciding {
                break;
            }
            if std::time::Instant::now() >= deadline {
                return Err(unavailable(format!("job {job}'s checkpoint is still deciding")));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Calls of the ranks stopped for the rollback are over; the rollback settles the
        // memory epochs.
        self.safe.locked().end(job);
        self.safe_answered.locked().remove(job);
        self.arrived_incs.locked().remove(job);
        self.mem_committed.locked().remove(job);
        self.mem_learned.locked().remove(job);
        let waiting: Vec<(u32, NodeId)> = self
            .safe_waiters
            .locked()
            .keys()
            .filter(|(j, _)| j == job)
            .map(|(_, r)| (*r, NodeId(0)))
            .collect();
        self.answer(job, &waiting, Err(unavailable(format!("job {job} rolls back"))));
        let st = node.meta_state();
        let epoch = psls_ckpt::frames::fence_epoch(st.job_floor(job), self.started_epoch(job), at_least);
        if epoch > 0 {
            node.submit(psls_pfs::meta::MetaOp::FenceCheckpoint {
                job: job.to_string(),
                epoch,
            })
            .await?;
        }
        let committed = node.meta_state().jobs.get(job).map_or(0, |r| r.epoch);
        tracing::warn!(node = %node.name(), job, fenced = epoch, committed, "job rolls back");
        Ok(PeerResp::Restart {
            epoch: committed,
            fenced: epoch,
        })
    }

    /// The state rank `rank` of `job` saved at checkpoint `epoch`.
    pub async fn restart_state(self: &Arc<Self>, job: &str, rank: u32, epoch: u64) -> Result<Vec<u8>, OpError> {
        let (f, first, head, page) = state_header(&self.node, job, rank, epoch).await?;
        let node = &self.node;
        let mut state = Vec::with_capacity(head.len);
        for k in 0..head.len.div_ceil(PAGE_SIZE) as u64 {
            let page = crate::pfs::read_page(node, &f, first + 1 + k).await?;
            let want = (head.len - state.len()).min(PAGE_SIZE);
            state.extend_from_slice(&page[..want]);
        }
        states::check(rank, &page, &state).map_err(|m| OpError::new(ErrorKind::Io, m))?;
        Ok(state)
    }
}

/// A failed safe-point call: the cluster's failure (`Unavailable`: the rank's node blames it,
/// and the job rolls back if the rank exits for it) or the program's (`Invalid`).
fn safe_failure(why: String, cluster: bool) -> OpError {
    if cluster {
        unavailable(why)
    } else {
        OpError::new(ErrorKind::Invalid, why)
    }
}

/// The last output line number rank `rank` of `job` had at checkpoint `epoch` (`None`: the
/// checkpoint's format kept none, or the rank's node could not tell it).
pub async fn restart_output_seq(
    node: &Arc<crate::node::Node>,
    job: &str,
    rank: u32,
    epoch: u64,
) -> Result<Option<u64>, OpError> {
    Ok(state_header(node, job, rank, epoch).await?.2.output_seq)
}

/// The area file of `job`, the first page of rank `rank`'s slot, its header (which must
/// belong to checkpoint `epoch`, the job's committed one) and the header's page.
async fn state_header(
    node: &Arc<crate::node::Node>,
    job: &str,
    rank: u32,
    epoch: u64,
) -> Result<(psls_pfs::meta::FileMeta, u64, states::Header, Vec<u8>), OpError> {
    // Every checkpoint record answered before the call.
    let st = node.meta_fresh().await?;
    let committed = st.jobs.get(job).map_or(0, |r| r.epoch);
    // Or a memory checkpoint, as this node's rollback settled it.
    let memory = node.frames.job(job).committed;
    if epoch == 0 || (committed != epoch && memory != epoch) {
        return Err(OpError::new(
            ErrorKind::NotFound,
            format!("job {job} has no checkpoint {epoch} (its last is {committed})"),
        ));
    }
    let f = crate::pfs::lookup_file(node, &states::state_file_name(job)).await?;
    let first = rank as u64 * states::SLOT_PAGES;
    if first + states::SLOT_PAGES > f.pages() {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("job {job} has no rank {rank}"),
        ));
    }
    let page = crate::pfs::read_page(node, &f, first).await?;
    let head = states::header(rank, &page).map_err(|m| OpError::new(ErrorKind::Io, m))?;
    if head.epoch != epoch {
        return Err(OpError::new(
            ErrorKind::Io,
            format!("rank {rank}'s state belongs to checkpoint {}, not {epoch}", head.epoch),
        ));
    }
    Ok((f, first, head, page.to_vec()))
}
