//! The checkpoint shell: drives `psls_ckpt`'s coordinator (on the cluster coordinator) and
//! participant (on every node) with the message link, the page store writes, the metadata and
//! the shared-memory shell's dirty pages.
//!
//! - A caller (a client's `sync`, the last unmap of a writable mapping) asks the coordinator
//!   for a checkpoint of a job over some files ([`CkptShell::checkpoint`] → `CkptRun`).
//! - The coordinator starts a round: epoch above the job's commit record and above any epoch
//!   it started before, generation above every page generation of the files, participants
//!   every logical node (each may hold dirty pages; every page has copies on two of them).
//!   Rounds touching the same file run one after the other.
//! - A participant takes its dirty pages of the files (`SvmShell::take_dirty`), writes them to
//!   the primary and mirror shadow slots through the two-phase write
//!   (`psls_cluster::write::Write`: every batch acknowledged and fsync'd by the same
//!   incarnation), and reports the page runs it wrote.
//! - The coordinator writes the commit record (`MetaOp::Checkpoint`), tells everyone, answers
//!   the caller. Pages taken are then clean; on an abort they are dirty again.
//!
//! Invariants: nothing here writes the page store except through a round's participant write
//! (or imports and repairs, elsewhere); the coordinator's and participant's state machines are
//! fed under their own locks and their actions run outside them; a round's caller is answered
//! exactly once.

use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{CallId, PeerReq, PeerResp, WriteGen};
use crate::svm::SvmShell;
use psls_ckpt::msg::Level;
use psls_ckpt::{CoordAction, Coordinator, Msg, Outcome, PartAction, Participant};
use psls_cluster::write::{Write, WriteAction};
use psls_ipc::ErrorKind;
use psls_pfs::jobs::FileRuns;
use psls_pfs::meta::MetaOp;
use psls_svm::{FileId, NodeId, PAGE_SIZE};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a round may wait for every participant's pages.
pub(super) const ROUND_TIMEOUT_MS: u64 = 10 * 60 * 1000;

/// How long a participant that took its pages waits for the coordinator's word that every
/// participant did (`Go`) before it keeps them anyway (a hint: only the pause depends on it).
const GO_WAIT_MS: u64 = 1000;

/// Most page-write batches in flight from one participant.
const WRITES_IN_FLIGHT: usize = 8;

/// Most files one checkpoint request may name.
pub const MAX_CKPT_FILES: usize = psls_pfs::jobs::MAX_CKPT_FILES;

/// What a committed checkpoint did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    pub epoch: u64,
    pub pages: u64,
    pub bytes: u64,
}

type Waiter = tokio::sync::oneshot::Sender<Result<Done, OpError>>;

/// Pages taken from files, per file.
type TakenPages = Vec<(FileId, Vec<u64>)>;

/// What a safe-point call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SafeOutcome {
    /// The epoch taken (0: none).
    pub epoch: u64,
    /// The job halts (`psls halt`).
    pub halt: bool,
    /// The pages the checkpoint took (one copy).
    pub pages: u64,
    /// How long the checkpoint stopped the job's ranks, as the coordinator saw it: from the
    /// last rank's call to the ranks' answer (their own calls also wait for the slowest rank).
    pub stopped_us: u64,
}

impl SafeOutcome {
    pub(super) fn into_resp(self) -> PeerResp {
        PeerResp::SafeDone {
            epoch: self.epoch,
            halt: self.halt,
            pages: self.pages,
            stopped_us: self.stopped_us,
        }
    }
}

/// The answer to a rank's safe-point call.
pub(super) type SafeAnswer = Result<SafeOutcome, OpError>;

/// A job's last answered call of each rank, by rank.
pub(super) type Answered = HashMap<u32, (CallId, SafeAnswer)>;

/// A rank waiting at the coordinator for its call's outcome.
/// `None`: this node no longer coordinates; the call is to be made again at the new one.
pub(super) type SafeWaiter = tokio::sync::oneshot::Sender<Option<SafeAnswer>>;

/// A rank's private state, with the start of the job it belongs to and the rank's last output
/// line number at its safe point.
pub(super) type RankState = (u32, Vec<u8>, Option<u64>);

/// A round in progress at the coordinator: its files, the callers waiting for its outcome,
/// when it started, the safe point's hook to answer the ranks early, and when it did.
struct RoundCallers {
    files: Vec<FileId>,
    waiters: Vec<Waiter>,
    started: std::time::Instant,
    release: Option<Arc<Release>>,
    /// A safe point's round: when its last rank called.
    decided: Option<std::time::Instant>,
    /// From that call (or the round's start) until every participant took its pages.
    released_us: Option<u64>,
}

/// What a participant took for a round ([`CkptShell::take_and_tell`]): the pages, their runs
/// and count, and how long taking them and waiting for `Go` took.
pub(super) struct Took {
    pub taken: Vec<crate::svm::Taken>,
    pub runs: Vec<FileRuns>,
    pub pages: u64,
    pub take_us: u64,
    pub go_us: u64,
}

/// A safe point's part in its round (the default for a round a `sync` or an unmap asked for).
#[derive(Clone, Default)]
pub(super) struct SafeRound {
    /// Fired when every participant took its pages: the ranks go on (none for a halt).
    pub release: Option<Arc<Release>>,
    /// The incarnation of each node whose ranks reached the safe point: an answer of another
    /// one aborts the round (`Coordinator::expect`).
    pub expect: std::collections::BTreeMap<NodeId, u64>,
    /// When the last rank called: the pause is counted from there.
    pub decided: Option<std::time::Instant>,
}

impl SafeRound {
    /// Whether the ranks went on.
    pub(super) fn released(&self) -> bool {
        self.release.as_ref().is_some_and(|r| r.fired())
    }
}

/// A safe point's hook on its round: fired (once) with the epoch and the pages taken when
/// every participant took its pages, so the ranks go on while the round keeps the pages and
/// decides. Not fired if the round failed first.
pub(super) struct Release {
    tx: Mutex<Option<tokio::sync::oneshot::Sender<(u64, u64)>>>,
    fired: std::sync::atomic::AtomicBool,
}

impl Release {
    pub(super) fn new() -> (Arc<Release>, tokio::sync::oneshot::Receiver<(u64, u64)>) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let r = Release {
            tx: Mutex::new(Some(tx)),
            fired: std::sync::atomic::AtomicBool::new(false),
        };
        (Arc::new(r), rx)
    }

    /// Whether the ranks were let go.
    pub(super) fn fired(&self) -> bool {
        self.fired.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn fire(&self, epoch: u64, pages: u64) {
        if let Some(tx) = self.tx.locked().take() {
            self.fired.store(true, std::sync::atomic::Ordering::SeqCst);
            let _ = tx.send((epoch, pages));
        }
    }
}

/// See the module documentation.
pub struct CkptShell {
    pub(super) node: Arc<Node>,
    pub(super) svm: Arc<SvmShell>,
    coord: Mutex<Coordinator>,
    part: Mutex<Participant>,
    /// Pages taken by this node for (job, epoch), until the decision.
    pub(super) taken: Mutex<HashMap<(String, u64), TakenPages>>,
    /// At the coordinator: callers of each job's round in progress, and its files.
    rounds: Mutex<HashMap<String, RoundCallers>>,
    /// At the coordinator: the highest epoch it started per job (never started twice).
    started: Mutex<HashMap<String, u64>>,
    /// Messages to this node itself, delivered by the drive loop.
    own: Mutex<VecDeque<Msg>>,
    /// Messages arrive on the link thread: tasks are spawned here.
    pub(super) runtime: tokio::runtime::Handle,
    /// At the coordinator: the ranks' safe-point calls.
    pub(super) safe: Mutex<psls_ckpt::SafePoints>,
    /// At the coordinator: the ranks waiting for their call's outcome, by (job, rank).
    pub(super) safe_waiters: Mutex<HashMap<(String, u32), (CallId, SafeWaiter)>>,
    /// At the coordinator: the last call of each rank answered here and its answer, by job
    /// and rank (a call made again, its answer lost on the way, gets the same). Only jobs the
    /// safe-point machine holds (at most `MAX_ROUNDS`).
    pub(super) safe_answered: Mutex<HashMap<String, Answered>>,
    /// On a rank's node: the private state of each local rank's call in progress, by (job,
    /// rank); written with the job's checkpoint.
    pub(super) states: Mutex<HashMap<(String, u32), RankState>>,
    /// At the coordinator: each job in safe-point calls, its owner (uid, gid) and launcher.
    pub(super) owners: Mutex<HashMap<String, (u32, u32, String)>>,
    /// Local processes: their job and the files they claimed as its writer.
    pub(super) claims: Mutex<HashMap<i32, (String, std::collections::BTreeSet<FileId>)>>,
    /// A participant's persistent rounds in progress: their generation, by (job, epoch).
    gens: Mutex<HashMap<(String, u64), u64>>,
    /// At the coordinator: per job, its last committed memory epoch, and when its last
    /// persistent checkpoint committed (or it first called).
    pub(super) mem_committed: Mutex<HashMap<String, u64>>,
    /// At the coordinator: per job, the metadata epoch in which it last learnt the newest
    /// committed memory epoch from the nodes (see [`CkptShell::learn_mem_committed`]).
    pub(super) mem_learned: Mutex<HashMap<String, u64>>,
    /// At the coordinator: what each job's ranks asked for its checkpoints, and what decides
    /// their level (when the last persistent one committed, memory ones since, a cleaner owed).
    pub(super) levels: Mutex<psls_ckpt::level::Levels>,
    /// At the coordinator: each job's last checkpoint committed here (for `psls jobs`).
    pub(super) last_ckpt: Mutex<HashMap<String, crate::peer::LastCkpt>>,
    /// At the coordinator: a round is over (a round waiting for its files or job goes on).
    round_over: tokio::sync::Notify,
    /// At the coordinator: per job, the incarnation of each node whose ranks called, since
    /// the last decision.
    pub(super) arrived_incs: Mutex<HashMap<String, std::collections::BTreeMap<NodeId, u64>>>,
    /// A participant's writes waiting for `Go`, by (job, epoch) (a `Go` before the wait leaves
    /// its permit).
    goes: Mutex<HashMap<(String, u64), Arc<tokio::sync::Notify>>>,
}

pub(super) fn unavailable(why: impl Into<String>) -> OpError {
    OpError::new(ErrorKind::Unavailable, why)
}

impl CkptShell {
    pub fn new(node: Arc<Node>, svm: Arc<SvmShell>, runtime: tokio::runtime::Handle) -> CkptShell {
        CkptShell {
            runtime,
            coord: Mutex::new(Coordinator::new(ROUND_TIMEOUT_MS, node.incarnation)),
            part: Mutex::new(Participant::new(node.incarnation)),
            node,
            svm,
            taken: Mutex::new(HashMap::new()),
            rounds: Mutex::new(HashMap::new()),
            started: Mutex::new(HashMap::new()),
            own: Mutex::new(VecDeque::new()),
            safe: Mutex::new(psls_ckpt::SafePoints::new()),
            safe_waiters: Mutex::new(HashMap::new()),
            safe_answered: Mutex::new(HashMap::new()),
            states: Mutex::new(HashMap::new()),
            owners: Mutex::new(HashMap::new()),
            claims: Mutex::new(HashMap::new()),
            gens: Mutex::new(HashMap::new()),
            mem_committed: Mutex::new(HashMap::new()),
            mem_learned: Mutex::new(HashMap::new()),
            levels: Mutex::new(psls_ckpt::level::Levels::new()),
            last_ckpt: Mutex::new(HashMap::new()),
            round_over: tokio::sync::Notify::new(),
            goes: Mutex::new(HashMap::new()),
            arrived_incs: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a persistent checkpoint of `job` over `files` (through the coordinator); returns
    /// once it committed.
    pub async fn checkpoint(self: &Arc<Self>, job: &str, files: Vec<FileId>) -> Result<Done, OpError> {
        self.checkpoint_at(job, files, Level::Persistent).await
    }

    /// A checkpoint of `job` over `files` at `level`, run by the coordinator.
    pub async fn checkpoint_at(self: &Arc<Self>, job: &str, files: Vec<FileId>, level: Level) -> Result<Done, OpError> {
        psls_pfs::jobs::validate_job(job).map_err(OpError::from)?;
        if files.len() > MAX_CKPT_FILES {
            return Err(OpError::new(ErrorKind::Invalid, "too many files in one checkpoint"));
        }
        let req = PeerReq::CkptRun {
            job: job.to_string(),
            files,
            level,
        };
        match self
            .call_coordinator(req, Duration::from_millis(ROUND_TIMEOUT_MS + 5000))
            .await?
        {
            PeerResp::CkptDone { epoch, pages, bytes } => Ok(Done { epoch, pages, bytes }),
            other => Err(OpError::new(
                ErrorKind::Internal,
                format!("unexpected answer {other:?}"),
            )),
        }
    }

    /// Sends `req` to the coordinator and returns its answer; a coordinator change mid-way is
    /// retried a few times.
    pub(super) async fn call_coordinator(&self, req: PeerReq, timeout: Duration) -> Result<PeerResp, OpError> {
        let mut last = unavailable("no coordinator is reachable");
        // A change of coordinator (its node killed, or back at once as a new incarnation that
        // does not coordinate yet) is ridden over: tried again for a few failure timeouts
        // before the caller is told. The nemesis met ranks failed by "n0 is no longer the
        // coordinator" 600 ms into such a change. A rank's call made again is safe: it keeps
        // its number, so a coordinator never takes it for the rank's next call.
        // The patience counts from the last exchange that a coordinator held for a while (a
        // safe-point call waits there for the slowest rank): a change after a long wait gets
        // the same patience as one at once.
        let patience = Duration::from_millis(4 * self.node.cfg.cluster.heartbeat_timeout_ms);
        let mut t = tokio::time::Instant::now();
        let mut tries = 0u32;
        let mut req = req;
        loop {
            if tries >= 3 && t.elapsed() >= patience {
                break;
            }
            tries += 1;
            let Some((_, coordinator)) = self.node.coordinator_now() else {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            };
            let sent = tokio::time::Instant::now();
            let r = self
                .node
                .call_data(&coordinator, req.clone(), bytes::Bytes::new(), timeout)
                .await;
            if sent.elapsed() >= patience {
                t = tokio::time::Instant::now();
                tries = 1;
            }
            // What follows is the same call again (a coordinator may have taken it already).
            if let PeerReq::CkptArrive(call) = &mut req {
                call.resent = true;
            }
            match r {
                Ok((PeerResp::NotCoordinator, _)) => {
                    last = unavailable(format!("{coordinator} is no longer the coordinator"))
                }
                // An answer is final (a retry could repeat what the coordinator did).
                Ok((PeerResp::Error { kind, message }, _)) => return Err(OpError::new(kind, message)),
                Ok((resp, _)) => return Ok(resp),
                Err(e) => last = unavailable(format!("{coordinator}: {e}")),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(last)
    }

    /// Whether this node is the coordinator now.
    pub(super) fn coordinating(&self) -> bool {
        self.node.coordinator_now().is_some_and(|(_, c)| c == self.node.name())
    }

    /// At the coordinator: runs a round of `job` over `files` and answers when it is over.
    pub async fn serve_run(
        self: &Arc<Self>,
        job: String,
        files: Vec<FileId>,
        level: Level,
    ) -> Result<PeerResp, OpError> {
        if !self.coordinating() {
            return Ok(PeerResp::NotCoordinator);
        }
        let done = self.run_round(job, files, level, SafeRound::default()).await?;
        Ok(PeerResp::CkptDone {
            epoch: done.epoch,
            pages: done.pages,
            bytes: done.bytes,
        })
    }

    /// Whether a round of `job`, or over one of `files`, is in progress here.
    fn clashes(&self, job: &str, files: &[FileId]) -> bool {
        let rounds = self.rounds.locked();
        rounds.contains_key(job) || rounds.values().any(|r| r.files.iter().any(|f| files.contains(f)))
    }

    /// At the coordinator: waits until no round of `job` or over one of `files` is in
    /// progress (a safe point's round released its ranks before it decided; the next one
    /// waits for that decision). Err after the round timeout.
    pub(super) async fn wait_rounds_over(&self, job: &str, files: &[FileId]) -> Result<(), OpError> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(ROUND_TIMEOUT_MS);
        loop {
            // Registered before the check: a round ending in between still wakes us.
            let over = self.round_over.notified();
            if !self.clashes(job, files) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(unavailable("another checkpoint of these files is still running"));
            }
            // The notification, or a look again now and then (a round's end elsewhere).
            let _ = tokio::time::timeout(Duration::from_millis(50), over).await;
        }
    }

    /// At the coordinator: runs a round of `job` over `files` (after any round of the job or
    /// over one of the files in progress); returns once it committed. `sp.release`, a safe
    /// point's hook, is fired when every participant took its pages; every node of
    /// `sp.expect` must answer in that incarnation.
    async fn run_round_once(
        self: &Arc<Self>,
        job: String,
        files: Vec<FileId>,
        level: Level,
        sp: SafeRound,
    ) -> Result<Done, OpError> {
        let node = &self.node;
        psls_pfs::jobs::validate_job(&job).map_err(OpError::from)?;
        if files.len() > MAX_CKPT_FILES {
            return Err(OpError::new(ErrorKind::Invalid, "too many files in one checkpoint"));
        }
        self.learn_mem_committed(&job).await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Rounds of one job, or over one file, run one after the other.
        loop {
            self.wait_rounds_over(&job, &files).await?;
            {
                let mut rounds = self.rounds.locked();
                let clash =
                    rounds.get(&job).is_some() || rounds.values().any(|r| r.files.iter().any(|f| files.contains(f)));
                if !clash {
                    let st = node.meta_state();
                    crate::pfs::check_all_serving(node, &st)?;
                    if let Some(id) = files.iter().find(|id| st.file_by_id(**id).is_none()) {
                        return Err(OpError::new(ErrorKind::NotFound, format!("no file with id {id}")));
                    }
                    let mut started = self.started.locked();
                    let mut coord = self.coord.locked();
                    let committed = self.known_committed(&job, &st);
                    // Above every epoch begun, seen or committed.
                    let epoch = st
                        .job_floor(&job)
                        .max(started.get(&job).copied().unwrap_or(0))
                        .max(coord.seen(&job))
                        .max(committed)
                        + 1;
                    let participants: BTreeSet<NodeId> = node.logical_map(&st).keys().map(|l| NodeId(*l)).collect();
                    let cleaning = self.cleaning_of(&job);
                    coord
                        .start(
                            node.now_ms(),
                            &job,
                            epoch,
                            (level, cleaning),
                            files.clone(),
                            participants,
                            committed,
                        )
                        .map_err(|e| unavailable(format!("checkpoint of {job} not started: {e:?}")))?;
                    // Every node of the job's current start answers in the incarnation the
                    // start names (a node restarted since lost its part: its pages and
                    // recovery copies), whatever its own records say yet (a blank disk's
                    // may lag: the nemesis met a cleaner committed without a wiped node's
                    // part).
                    let mut expect = sp.expect.clone();
                    if let Some(run) = st.runs.get(&job) {
                        for (l, (_, inc)) in &run.nodes {
                            expect.entry(NodeId(*l)).or_insert(*inc);
                        }
                    }
                    coord.expect(&job, epoch, expect);
                    drop(coord);
                    started.insert(job.clone(), epoch);
                    rounds.insert(
                        job.clone(),
                        RoundCallers {
                            files: files.clone(),
                            waiters: vec![tx],
                            started: std::time::Instant::now(),
                            release: sp.release.clone(),
                            decided: sp.decided,
                            released_us: None,
                        },
                    );
                    tracing::info!(node = %node.name(), job, epoch, %level, files = files.len(), "checkpoint started");
                    break;
                }
            }
        }
        self.drive();
        rx.await
            .map_err(|_| unavailable("the checkpoint's coordinator stopped"))?
    }

    /// [`CkptShell::run_round_once`], once more if a participant had seen a later epoch of
    /// the job (a memory epoch of an earlier coordinator): the next round starts above it.
    pub(super) async fn run_round(
        self: &Arc<Self>,
        job: String,
        files: Vec<FileId>,
        level: Level,
        sp: SafeRound,
    ) -> Result<Done, OpError> {
        let before = self.coord.locked().seen(&job);
        match self.run_round_once(job.clone(), files.clone(), level, sp.clone()).await {
            // Not once the ranks went on: the pages taken then are the checkpoint's.
            Err(e) if self.coord.locked().seen(&job) > before && !sp.released() => {
                tracing::info!(node = %self.node.name(), job, error = %e, "checkpoint epoch was stale; again above it");
                self.run_round_once(job, files, level, sp).await
            }
            r => r,
        }
    }

    /// The highest epoch of `job` this node's participant saw.
    pub(super) fn part_seen(&self, job: &str) -> u64 {
        self.part.locked().seen(job)
    }

    /// At the coordinator: `job`'s cleaning policy (its ranks' calls said it; else the
    /// cluster's).
    fn cleaning_of(&self, job: &str) -> psls_ckpt::cleaning::Policy {
        self.levels
            .locked()
            .choice(job)
            .map(|c| c.cleaning)
            .unwrap_or_else(|| self.node.default_cleaning())
    }

    /// At the coordinator, once per metadata epoch it coordinates (and after a rollback): the
    /// newest memory epoch of `job` any node committed. Memory checkpoints leave no record in
    /// the metadata; a coordinator that took over while its predecessor's commit was still on
    /// the way started its first round with an older `committed`, and that round's prepare
    /// dropped the copies of the committed checkpoint where its decision had not arrived yet
    /// (found by the checkpoint simulator with pauses, seed 28089).
    async fn learn_mem_committed(self: &Arc<Self>, job: &str) -> Result<(), OpError> {
        let node = &self.node;
        let lead = node.replication.leader_epoch().map_or(0, |(_, e)| e);
        if self.mem_learned.locked().get(job) == Some(&lead) {
            return Ok(());
        }
        let st = node.meta_state();
        // A round needs every node anyway: fail fast rather than wait on a dead one.
        crate::pfs::check_all_serving(node, &st)?;
        let mut newest = 0;
        for p in node.logical_map(&st).into_values() {
            let req = PeerReq::Frames(crate::peer::FramesReq::State { job: job.to_string() });
            match node.call_ok(&p, req).await {
                Ok(PeerResp::MemState { committed, .. }) => newest = newest.max(committed),
                Ok(other) => return Err(unavailable(format!("{p}: unexpected answer {other:?}"))),
                Err(e) => {
                    return Err(unavailable(format!(
                        "{p} did not say its memory checkpoints: {}",
                        e.message
                    )))
                }
            }
        }
        {
            let mut m = self.mem_committed.locked();
            let e = m.entry(job.to_string()).or_insert(0);
            *e = (*e).max(newest);
        }
        self.mem_learned.locked().insert(job.to_string(), lead);
        Ok(())
    }

    /// At the coordinator: the job's last committed epoch it knows (its commit record, or a
    /// later memory checkpoint committed here).
    fn known_committed(&self, job: &str, st: &psls_pfs::meta::MetaState) -> u64 {
        let record = st.jobs.get(job).map_or(0, |r| r.epoch);
        record.max(self.mem_committed.locked().get(job).copied().unwrap_or(0))
    }

    /// At the coordinator: `job`'s round aborts unless it is deciding (then: true).
    pub(super) fn coord_abort_job(&self, job: &str) -> bool {
        self.coord.locked().abort_job(job)
    }

    /// At the coordinator: `job`'s round in progress.
    pub(super) fn coord_progress(&self, job: &str) -> Option<psls_ckpt::Progress> {
        self.coord.locked().progress(job)
    }

    /// At the coordinator: the highest epoch of `job` it started.
    pub(super) fn started_epoch(&self, job: &str) -> u64 {
        self.started.locked().get(job).copied().unwrap_or(0)
    }

    /// `job` rolls back here: what this node's participant took or holds for it goes (its
    /// pages are dropped); a `Prepare` must still be above every epoch seen.
    pub fn rollback_local(&self, job: &str) {
        self.part.locked().forget(job);
        self.taken.locked().retain(|(j, _), _| j != job);
        self.states.locked().retain(|(j, _), _| j != job);
    }

    /// `job` ended: this node forgets it (its participant's epochs, pages taken for it, and,
    /// at the coordinator, its epochs started).
    pub fn forget_job(&self, job: &str) {
        self.part.locked().end(job);
        self.taken.locked().retain(|(j, _), _| j != job);
        self.started.locked().remove(job);
        self.states.locked().retain(|(j, _), _| j != job);
        self.gens.locked().retain(|(j, _), _| j != job);
        self.coord.locked().forget(job);
        self.mem_committed.locked().remove(job);
        self.mem_learned.locked().remove(job);
        self.levels.locked().forget(job);
        self.last_ckpt.locked().remove(job);
        self.goes.locked().retain(|(j, _), _| j != job);
        self.arrived_incs.locked().remove(job);
        self.safe_answered.locked().remove(job);
        self.svm.forget_active(job);
        self.node.frames.end_job(job);
    }

    /// A checkpoint message from peer `from` (on the link thread).
    pub fn deliver(self: &Arc<Self>, from: &str, msg: Msg) {
        let st = self.node.meta_state();
        let Some(l) = self
            .node
            .logical_map(&st)
            .into_iter()
            .find(|(_, p)| p == from)
            .map(|(l, _)| NodeId(l))
        else {
            tracing::warn!(node = %self.node.name(), peer = from, "checkpoint message from a node with no logical id: dropped");
            return;
        };
        self.receive(l, msg);
        self.drive();
    }

    fn receive(&self, from: NodeId, msg: Msg) {
        // A round of a job whose current start ran ranks here as an earlier incarnation: the
        // job's pages and recovery copies here died with it, so this node cannot take its
        // part; refused, the round aborts and the job rolls back (a cleaner taken without them
        // would commit a mix of the last writes and older copies).
        if let Msg::Prepare {
            job, epoch, coord_inc, ..
        } = &msg
        {
            if let Some(why) = self.lost_since_start(job) {
                tracing::warn!(node = %self.node.name(), job, epoch, why, "checkpoint round refused");
                self.send(
                    from,
                    Msg::Refused {
                        job: job.clone(),
                        epoch: *epoch,
                        coord_inc: *coord_inc,
                        why,
                        seen: 0,
                        no_room: false,
                    },
                );
                return;
            }
        }
        match msg {
            Msg::Prepare { .. } | Msg::Go { .. } | Msg::Decide { .. } | Msg::Flush { .. } => {
                // The participant knows the coordinator as this node does now, not as of its
                // last tick: a round may start right after an election.
                let coordinator = self.node.coordinator_now().map(|(l, _)| NodeId(l));
                self.part.locked().coordinator_changed(coordinator);
                if let Msg::Prepare {
                    job,
                    epoch,
                    level,
                    files,
                    committed,
                    cleaning,
                    ..
                } = &msg
                {
                    if Some(from) == coordinator {
                        self.node.frames.set_policy(job, *cleaning);
                        // A new round of the job: a memory epoch whose decision this node
                        // missed is settled by the last committed one the coordinator names;
                        // from now on loads of these files look for recovery copies first.
                        self.node.frames.settle_pre(job, *committed, *epoch);
                        if *level == Level::Memory {
                            self.node.frames.mark_memory(job, files);
                        }
                    }
                }
                self.part.locked().receive(from, msg)
            }
            Msg::Taken { .. }
            | Msg::Prepared { .. }
            | Msg::Flushed { .. }
            | Msg::Refused { .. }
            | Msg::InDoubt { .. } => self.coord.locked().receive(from, msg),
        }
    }

    /// Periodic duties: round timeouts, participants gone down, the coordinator's identity for
    /// the participant, fences to ask again.
    pub fn tick(self: &Arc<Self>) {
        let node = &self.node;
        let st = node.meta_state();
        let map = node.logical_map(&st);
        {
            let mut c = self.coord.locked();
            c.tick(node.now_ms());
            for (l, p) in &map {
                if node.is_declared_down(p) {
                    c.node_down(NodeId(*l));
                }
                c.heard(NodeId(*l), node.heard_incarnation(p));
            }
            c.retry();
        }
        {
            let mut safe = self.safe.locked();
            safe.tick(node.now_ms());
            for (l, p) in &map {
                if node.is_declared_down(p) {
                    safe.node_down(NodeId(*l));
                }
            }
        }
        // Another node coordinates now: the calls waiting here are made again there. (Not while
        // no coordinator is known: a brief loss of the lease leaves them waiting here.)
        if node.coordinator_now().is_some_and(|(_, c)| c != node.name()) {
            let handed = self.safe.locked().hand_off();
            for (job, ranks) in handed {
                tracing::info!(node = %node.name(), job, ranks = ranks.len(), "checkpoint calls handed to the new coordinator");
                self.hand_off(&job, &ranks);
            }
        }
        let coordinator = node.coordinator_now().map(|(l, _)| NodeId(l));
        self.part.locked().coordinator_changed(coordinator);
        self.drive();
    }

    /// Runs both state machines' actions (and this node's messages to itself) until none is
    /// left.
    pub(super) fn drive(self: &Arc<Self>) {
        for _ in 0..1_000_000 {
            let own = self.own.locked().pop_front();
            if let Some(msg) = own {
                let me = self.node.my_logical(&self.node.meta_state());
                if let Some(me) = me {
                    self.receive(me, msg);
                }
                continue;
            }
            let c = self.coord.locked().poll_action();
            if let Some(a) = c {
                self.coord_action(a);
                continue;
            }
            let p = self.part.locked().poll_action();
            if let Some(a) = p {
                self.part_action(a);
                continue;
            }
            let s = self.safe.locked().poll_action();
            if let Some(a) = s {
                self.safe_action(a);
                continue;
            }
            return;
        }
        tracing::error!(node = %self.node.name(), "checkpoint actions did not settle");
    }

    /// Why this node cannot take part in a round of `job`: its current start ran ranks here
    /// (or, writing a restored result, had its copies restored here) as an earlier
    /// incarnation of this node.
    fn lost_since_start(&self, job: &str) -> Option<String> {
        let st = self.node.meta_state();
        let run = st.runs.get(job)?;
        let inc = run
            .nodes
            .values()
            .find(|(p, _)| *p == self.node.me.name)
            .map(|(_, inc)| *inc)?;
        (inc != self.node.incarnation).then(|| {
            format!(
                "{} restarted since job {job}'s start {} (incarnation {inc}, now {}): its part of the job is lost until the job rolls back",
                self.node.name(),
                run.attempt,
                self.node.incarnation
            )
        })
    }

    fn send(&self, to: NodeId, msg: Msg) {
        let node = &self.node;
        let phys = node.physical_now(to);
        if phys == node.name() {
            self.own.locked().push_back(msg);
            return;
        }
        if let Err(e) = node.net.post(&phys, &PeerReq::Ckpt(msg), bytes::Bytes::new()) {
            tracing::warn!(node = %node.name(), peer = %phys, error = %e, "checkpoint message not sent");
        }
    }

    fn coord_action(self: &Arc<Self>, a: CoordAction) {
        match a {
            CoordAction::Send { to, msg } => self.send(to, msg),
            CoordAction::Begin { job, epoch } => {
                let me = self.clone();
                self.runtime.spawn(async move {
                    let t = std::time::Instant::now();
                    let r = me
                        .node
                        .submit(MetaOp::BeginCheckpoint {
                            job: job.clone(),
                            epoch,
                        })
                        .await;
                    let st = me.node.meta_state();
                    let r = match (r, st.jobs.get(&job)) {
                        (Ok(()), Some(rec)) if rec.started == epoch => {
                            Ok((rec.started_gen, st.seq, me.known_committed(&job, &st)))
                        }
                        (Ok(()), _) => Err("the metadata does not show the epoch begun".to_string()),
                        (Err(e), _) => Err(e.message),
                    };
                    tracing::debug!(node = %me.node.name(), job, epoch, begin_ms = t.elapsed().as_millis() as u64, "checkpoint begun");
                    me.coord.locked().begun(me.node.now_ms(), &job, epoch, r);
                    me.drive();
                });
            }
            CoordAction::Commit {
                job,
                epoch,
                gen,
                files,
                bytes,
            } => {
                let me = self.clone();
                self.runtime.spawn(async move {
                    let st = me.node.meta_state();
                    let op = MetaOp::Checkpoint {
                        job: job.clone(),
                        epoch,
                        gen,
                        placed_at: st.map_version,
                        files,
                        at_unix_ms: crate::pfs::unix_ms(),
                        bytes,
                    };
                    let t = std::time::Instant::now();
                    let r = me.node.submit(op).await.map_err(|e| e.message);
                    tracing::debug!(node = %me.node.name(), job, epoch, record_ms = t.elapsed().as_millis() as u64, "checkpoint commit record written");
                    if r.is_ok() {
                        crate::failpoint::pass_async(me.node.name(), "ckpt.committed").await;
                    }
                    me.coord.locked().committed(&job, epoch, r);
                    me.drive();
                });
            }
            CoordAction::Fence { job, epoch } => {
                let me = self.clone();
                self.runtime.spawn(async move {
                    let op = MetaOp::FenceCheckpoint {
                        job: job.clone(),
                        epoch,
                    };
                    let r = me.node.submit(op).await;
                    let st = me.node.meta_state();
                    let r = match st.job_decided(&job, epoch) {
                        Some(commit) => Ok(commit),
                        None => Err(r.err().map(|e| e.message).unwrap_or_else(|| "undecided".into())),
                    };
                    me.coord.locked().fenced(&job, epoch, r);
                    me.drive();
                });
            }
            CoordAction::Released { job, epoch, pages } => {
                let mut rounds = self.rounds.locked();
                if let Some(r) = rounds.get_mut(&job) {
                    let from = r.decided.unwrap_or(r.started);
                    r.released_us = Some(from.elapsed().as_micros() as u64);
                    tracing::debug!(node = %self.node.name(), job, epoch, pages, release_us = r.released_us, "every participant took its pages");
                    if let Some(hook) = &r.release {
                        hook.fire(epoch, pages);
                    }
                }
            }
            CoordAction::Finished { job, epoch, outcome } => {
                // The round's outcome is recorded (the last committed memory epoch above all)
                // before the round goes and its waiters wake: a safe point waiting for it
                // starts the next round naming that epoch as committed. (Woken first, it named
                // the one before, and the next round's Prepare made this node drop the
                // recovery copies of the epoch just committed: pages written since left out of
                // the last cleaner, found by the nemesis.)
                let (started, released_us) = match self.rounds.locked().get(&job) {
                    Some(r) => (Some(r.started), r.released_us),
                    None => (None, None),
                };
                let r = match outcome {
                    Outcome::Committed { level, pages, bytes } => {
                        let commit_us = started.map_or(0, |t| t.elapsed().as_micros() as u64);
                        self.last_ckpt.locked().insert(
                            job.clone(),
                            crate::peer::LastCkpt {
                                epoch,
                                level: level.to_string(),
                                pages,
                                bytes,
                                pause_us: released_us.unwrap_or(commit_us),
                                commit_us,
                                at_unix_ms: crate::pfs::unix_ms(),
                            },
                        );
                        if level == Level::Memory {
                            self.mem_committed.locked().insert(job.clone(), epoch);
                        }
                        self.levels.locked().committed(&job, level, self.node.now_ms());
                        self.node
                            .metrics
                            .checkpoint(&level.to_string(), released_us.unwrap_or(commit_us), commit_us);
                        tracing::info!(node = %self.node.name(), job, epoch, %level, pages, bytes, "checkpoint committed");
                        Ok(Done { epoch, pages, bytes })
                    }
                    Outcome::Aborted(why) => {
                        self.node.metrics.ckpt_aborted.inc();
                        tracing::warn!(node = %self.node.name(), job, epoch, why, "checkpoint aborted");
                        Err(unavailable(format!("checkpoint {epoch} of {job} aborted: {why}")))
                    }
                    // (The safe point's caller tells it by its kind: the cleaner takes over.)
                    Outcome::NoRoom(why) => {
                        self.node.metrics.ckpt_aborted.inc();
                        tracing::warn!(node = %self.node.name(), job, epoch, why, "memory checkpoint aborted: no room");
                        Err(OpError::new(
                            ErrorKind::NoSpace,
                            format!("checkpoint {epoch} of {job} aborted: {why}"),
                        ))
                    }
                };
                let waiters = self.rounds.locked().remove(&job).map(|r| r.waiters).unwrap_or_default();
                self.round_over.notify_waiters();
                for w in waiters {
                    let _ = w.send(r.clone());
                }
            }
        }
    }

    fn part_action(self: &Arc<Self>, a: PartAction) {
        match a {
            PartAction::Send { to, msg } => self.send(to, msg),
            PartAction::Write {
                job,
                epoch,
                level,
                gen,
                seq,
                files,
                committed,
            } => {
                let me = self.clone();
                if level == Level::Persistent {
                    self.gens.locked().insert((job.clone(), epoch), gen);
                }
                self.runtime.spawn(async move {
                    let r = match level {
                        Level::Memory => me.write_memory(&job, epoch, committed, &files).await,
                        Level::Persistent => me.write(&job, epoch, gen, seq, &files).await,
                    };
                    if let Err(e) = &r {
                        tracing::warn!(node = %me.node.name(), job, epoch, error = %e, "checkpoint pages not written");
                    }
                    let r = r.map_err(|e| psls_ckpt::msg::Refusal::of(e.kind, level, e.message));
                    me.part.locked().written(&job, epoch, r);
                    me.drive();
                });
            }
            PartAction::Go { job, epoch } => {
                // Only for a write still waiting (one that waited long enough went on).
                if let Some(go) = self.goes.locked().get(&(job, epoch)) {
                    go.notify_one();
                }
            }
            PartAction::Flush { job, epoch, gen, seq } => {
                let me = self.clone();
                self.runtime.spawn(async move {
                    let t = std::time::Instant::now();
                    let r = me.flush(&job, gen, seq).await;
                    match &r {
                        Ok((runs, bytes)) => {
                            tracing::info!(node = %me.node.name(), job, epoch, files = runs.len(), bytes, flush_ms = t.elapsed().as_millis() as u64, "recovery copies flushed")
                        }
                        Err(e) => {
                            tracing::warn!(node = %me.node.name(), job, epoch, error = %e, "recovery copies not flushed")
                        }
                    }
                    me.part.locked().flushed(&job, epoch, r.map_err(|e| e.message));
                    me.drive();
                });
            }
            PartAction::Clean { job, epoch, level } => {
                match level {
                    Level::Memory => {
                        // Told the checkpoint committed, before phase 2 (a test's failpoint:
                        // a kill here must restore this epoch, from the other nodes' copies).
                        crate::failpoint::pass(self.node.name(), "ckpt.mem.commit");
                        self.node.frames.commit(&job, epoch)
                    }
                    Level::Persistent => {
                        if let Some(gen) = self.gens.locked().remove(&(job.clone(), epoch)) {
                            self.node.frames.persistent_committed(&job, gen);
                        }
                    }
                }
                self.taken.locked().remove(&(job, epoch));
            }
            PartAction::Restore { job, epoch, level } => {
                match level {
                    Level::Memory => self.node.frames.abort(&job, epoch),
                    Level::Persistent => {
                        if let Some(gen) = self.gens.locked().remove(&(job.clone(), epoch)) {
                            self.node.frames.persistent_aborted(&job, gen);
                        }
                    }
                }
                if let Some(pages) = self.taken.locked().remove(&(job, epoch)) {
                    self.svm.restore_dirty(&pages);
                }
            }
        }
    }

    /// A participant's first step at both levels: takes its dirty pages of `files` and the
    /// ranks' states for (`job`, `epoch`) ([`CkptShell::take_for`]), tells the coordinator (the
    /// ranks go on once every participant took), and returns once every participant did
    /// (`Go`), or after [`GO_WAIT_MS`]: the transfers that keep the pages then do not compete
    /// for the CPU with the nodes still taking theirs.
    pub(super) async fn take_and_tell(
        self: &Arc<Self>,
        job: &str,
        epoch: u64,
        files: &[FileId],
        st: &psls_pfs::meta::MetaState,
    ) -> Result<Took, OpError> {
        let t0 = std::time::Instant::now();
        let taken = self.take_for(job, epoch, files, st)?;
        let take_us = t0.elapsed().as_micros() as u64;
        let runs = taken
            .iter()
            .map(|t| FileRuns {
                file: t.file,
                runs: runs_of(&t.indices),
            })
            .collect();
        let pages = taken.iter().map(|t| t.indices.len() as u64).sum();
        let key = (job.to_string(), epoch);
        let go = self.goes.locked().entry(key.clone()).or_default().clone();
        self.part.locked().taken(job, epoch, pages);
        self.drive();
        let _ = tokio::time::timeout(Duration::from_millis(GO_WAIT_MS), go.notified()).await;
        self.goes.locked().remove(&key);
        Ok(Took {
            taken,
            runs,
            pages,
            take_us,
            go_us: t0.elapsed().as_micros() as u64 - take_us,
        })
    }

    /// The participant's write: takes the dirty pages of `files` and writes them to both
    /// copies at `gen`, durably; returns the runs written and their bytes.
    async fn write(
        self: &Arc<Self>,
        job: &str,
        epoch: u64,
        gen: u64,
        seq: u64,
        files: &[FileId],
    ) -> Result<(Vec<FileRuns>, u64), OpError> {
        let node = &self.node;
        let t0 = std::time::Instant::now();
        let st = node.meta_reached(seq).await?;
        let Took { taken, runs, pages, .. } = self.take_and_tell(job, epoch, files, &st).await?;
        let take_ms = t0.elapsed().as_millis() as u64;
        let mut write = Write::new();
        let mut inflight = tokio::task::JoinSet::new();
        let mut halfway = super::batches::Halfway::new(&taken);
        for b in super::batches::batches(node.placement, &taken) {
            while inflight.len() >= WRITES_IN_FLIGHT {
                reap(&mut inflight, &mut write).await;
            }
            halfway.next(node.name(), b.indices.len(), "ckpt.write").await;
            let phys = node.physical_of(&st, b.holder);
            write.sent(&phys);
            let node = node.clone();
            inflight.spawn(async move {
                let data = bytes::Bytes::from_owner(b.data);
                let gen = WriteGen::New { gen, seq };
                let r = crate::pfs::write_to_phys(&node, &phys, b.file, b.role, gen, b.indices, data).await;
                (phys, r)
            });
        }
        while !inflight.is_empty() {
            reap(&mut inflight, &mut write).await;
        }
        let store_ms = t0.elapsed().as_millis() as u64 - take_ms;
        write.finish();
        loop {
            let Some(a) = write.poll_action() else {
                return Err(OpError::new(ErrorKind::Internal, "checkpoint write stalled"));
            };
            match a {
                // Every node written to syncs at once (the syncs come together, after the
                // last store).
                WriteAction::Sync { node: first } => {
                    let mut syncs = tokio::task::JoinSet::new();
                    let mut next = Some(first);
                    while let Some(phys) = next.take() {
                        let node = node.clone();
                        syncs.spawn(async move {
                            let r = crate::pfs::sync_on(&node, &phys).await;
                            (phys, r)
                        });
                        if let Some(WriteAction::Sync { .. }) = write.peek_action() {
                            if let Some(WriteAction::Sync { node: phys }) = write.poll_action() {
                                next = Some(phys);
                            }
                        }
                    }
                    while let Some(done) = syncs.join_next().await {
                        match done {
                            Ok((phys, Ok(incarnation))) => write.synced(&phys, incarnation),
                            Ok((phys, Err(e))) => write.sync_failed(&phys, &e.message),
                            Err(e) => write.abort(format!("a sync task failed: {e}")),
                        }
                    }
                }
                // Durable on both copies: the coordinator's commit record is what commits.
                WriteAction::Commit => write.committed(Ok(())),
                WriteAction::Abort { .. } => {}
                WriteAction::Done(Ok(())) => break,
                WriteAction::Done(Err(why)) => return Err(unavailable(why)),
            }
        }
        // Where the time went: taking the pages, storing both copies, syncing the disks.
        let sync_ms = t0.elapsed().as_millis() as u64 - take_ms - store_ms;
        tracing::info!(node = %node.name(), job, epoch, gen, pages, take_ms, store_ms, sync_ms, "checkpoint pages durable");
        Ok((runs, pages * PAGE_SIZE as u64))
    }
}

async fn reap(inflight: &mut tokio::task::JoinSet<(String, Result<u64, OpError>)>, write: &mut Write) {
    match inflight.join_next().await {
        Some(Ok((phys, Ok(incarnation)))) => write.stored(&phys, incarnation),
        Some(Ok((phys, Err(e)))) => write.store_failed(&phys, &e.message),
        Some(Err(e)) => write.abort(format!("a write task failed: {e}")),
        None => {}
    }
}

/// Sorted page indices as runs `(start, end)`.
pub(super) fn runs_of(indices: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &i in indices {
        match out.last_mut() {
            Some(r) if r.1 == i => r.1 = i + 1,
            _ => out.push((i, i + 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_of_sorted_indices() {
        assert_eq!(super::runs_of(&[1, 2, 3, 7, 9, 10]), vec![(1, 4), (7, 8), (9, 11)]);
        assert!(super::runs_of(&[]).is_empty());
    }
}
