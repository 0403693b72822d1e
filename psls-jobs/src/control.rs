//! [`Control`]: the job-control machine.
//!
//! A job moves through the phases of its [`RunRecord`] (durable, in the metadata log):
//! `Running` (ranks started and followed) → `Finishing` (every rank exited 0: its last
//! checkpoints) or `RollingBack` (a node running ranks failed: stop, wait for the nodes or a
//! spare, restore the newest intact checkpoint, then the next start, `Running` again) →
//! `Stopping` (the end is decided: stop the ranks, release or keep what the job holds) → its
//! end ([`psls_pfs::runs::JobEnd`]).
//! Every decision is first recorded ([`Action::Submit`]) and acted on once the committed
//! metadata shows it ([`Control::handle_meta`]); what the driver knows beyond the records
//! (which ranks exited, how far a rollback got) is rebuilt by a new driver from the nodes'
//! [`Report`]s and by doing the idempotent steps again.
//!
//! It is also the cluster's one decider of spare replacements ([`Action::Replace`]): for a
//! node whose disk failed, one declared down for [`Config::replace_after_ms`], and a node a
//! job's rollback waits for past the job's respawn timeout; one at a time.
//!
//! Invariants (checked by `tests/sim.rs` after every step):
//! - only a driver ([`Control::handle_lead`]) acts, and it acts on its committed view;
//! - a start's ranks are started only once the start is recorded, on the nodes it names;
//! - a job ends once, with the start it ended; a job whose ranks all exited 0 is finished,
//!   or kept resumable;
//! - every table is bounded ([`Config::max_jobs`], [`Config::max_commands`]).

use psls_pfs::jobs::{JobOptions, JobSummary};
use psls_pfs::meta::{MetaOp, MetaState};
use psls_pfs::runs::{EndHow, JobEnd, RunPhase, RunRecord, MAX_MESSAGE_LEN};
use psls_svm::{ErrorKind, FileId};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Most reports one node sends at once (one per job with ranks there).
pub const MAX_REPORTS: usize = 4096;
/// The status `psls run` exits with when its job halted (resumable): `EX_TEMPFAIL`.
pub const HALTED_STATUS: i32 = 75;
/// The reason a resumed job's first rollback records.
pub const RESUMED: &str = "resumed";
/// The status when nodes failed more often than the job may restart, or its rollback failed.
pub const LOST_STATUS: i32 = 255;
/// How long a node that did not answer a stop waits before it is asked again.
pub const STOP_AGAIN_MS: u64 = 500;

/// The machine's settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long a rank's non-zero exit waits for the failure detector to blame a node (a rank
    /// may fail because its node did) before it fails the job.
    pub grace_ms: u64,
    /// The pause between two passes of a rollback.
    pub pass_pause_ms: u64,
    /// Most passes of one rollback.
    pub max_passes: u32,
    /// A spawn or a record unanswered this long is done again (a lost message, a restarted
    /// node). A step ([`Action::StopRanks`], [`Action::Restore`], ...) is never asked again
    /// while it runs: the shell answers each exactly once.
    pub retry_ms: u64,
    /// How long a spare's copies may take to be re-created.
    pub rebuild_timeout_ms: u64,
    /// The configured nodes (physical names, in logical order: the map until a replacement
    /// is recorded).
    pub nodes: Vec<String>,
    /// The spares (physical names) that may take a failed logical node's place.
    pub spares: Vec<String>,
    /// A logical node whose physical node is declared down this long is given a free spare,
    /// whether or not a job runs there (0: only when a job's rollback waits for it past its
    /// respawn timeout, or at once when its disk failed).
    pub replace_after_ms: u64,
    /// Most jobs driven at once.
    pub max_jobs: usize,
    /// Most commands waiting for their answer.
    pub max_commands: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            grace_ms: 3_000,
            pass_pause_ms: 2_000,
            max_passes: 8,
            retry_ms: 5_000,
            rebuild_timeout_ms: 600_000,
            nodes: Vec::new(),
            spares: Vec::new(),
            replace_after_ms: 0,
            max_jobs: 1024,
            max_commands: 1024,
        }
    }
}

/// A physical node as the heartbeats show it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeView {
    /// Reachable and not declared down.
    pub live: bool,
    /// Its incarnation (0: never heard).
    pub incarnation: u64,
    /// Its newest incarnation is declared down in the records.
    pub declared_down: bool,
    /// Its heartbeats say its disk failed.
    pub disk_failed: bool,
}

/// A node's report of its ranks of one job.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Report {
    pub job: String,
    pub attempt: u32,
    /// Ranks running.
    pub running: Vec<u32>,
    /// Ranks that exited, with their status.
    pub exited: Vec<(u32, i32)>,
    /// Ranks one of whose calls the cluster failed (a barrier or a safe point across a change
    /// of coordinator), and why: their non-zero exit is the cluster's failure, not the
    /// program's, and rolls the job back.
    pub blamed: Vec<(u32, String)>,
}

/// An operator's or a user's command.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Command {
    /// Start job `job` (a new name).
    Launch {
        job: String,
        spec: Box<JobSummary>,
        options: Box<JobOptions>,
        env: Vec<(String, String)>,
        /// The physical nodes its ranks may run on (empty: any).
        hosts: Vec<String>,
        /// Its rank 0 reads the input `psls run` forwards.
        stdin: bool,
    },
    /// Start an ended job again from its newest intact checkpoint (as user `uid`), its ranks
    /// on `hosts` (physical nodes; empty: any).
    Resume {
        job: String,
        env: Vec<(String, String)>,
        uid: u32,
        hosts: Vec<String>,
    },
    /// Halt a running job after a persistent checkpoint at its next safe point.
    Halt { job: String, uid: u32 },
    /// Stop a running job, keeping it resumable from its newest intact checkpoint.
    Cancel { job: String, uid: u32 },
}

/// Why a command is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum CommandError {
    #[error("this node does not drive jobs now")]
    NotLeader,
    #[error("no job {0}")]
    NotFound(String),
    #[error("no job {0} to resume")]
    NothingToResume(String),
    #[error("job {0} belongs to another user")]
    NotOwner(String),
    #[error("job {0} is running")]
    Running(String),
    #[error("job {0} is not running")]
    NotRunning(String),
    #[error("job {job} cannot be resumed: {why}")]
    NotResumable { job: String, why: String },
    #[error("{0}")]
    Invalid(String),
    #[error("too many jobs or commands at once")]
    Busy,
    #[error("the metadata refused it: {0}")]
    Refused(String),
}

/// The answer to a command.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Answer {
    /// The job's start is recorded (its ranks are being started).
    Started {
        job: String,
        attempt: u32,
    },
    /// The halt or the stop is recorded.
    Accepted {
        job: String,
    },
    Refused(CommandError),
}

/// Why a step failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// Something it needs is not there now (a node down, the coordinator changing): the step
    /// (a rollback: its pass) is done again later.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// It cannot succeed: the job ends failed.
    #[error("{0}")]
    Failed(String),
}

impl StepError {
    /// Retry or fail, by the class of what went wrong: a node down or changing, a disk's I/O
    /// error (the copy elsewhere may serve) or an internal error (a restarted task) is tried
    /// again in the rollback's next pass; anything else (a file or checkpoint missing, refused,
    /// no room) cannot succeed by trying again.
    pub fn of(kind: ErrorKind, message: String) -> StepError {
        match kind {
            ErrorKind::Unavailable | ErrorKind::Io | ErrorKind::Internal => StepError::Unavailable(message),
            ErrorKind::NotFound
            | ErrorKind::Exists
            | ErrorKind::Permission
            | ErrorKind::Invalid
            | ErrorKind::NoSpace => StepError::Failed(message),
        }
    }
}

/// The outcome of a step the machine asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Done {
    /// [`Action::StopRanks`]: these nodes answered (none of the job's ranks runs there).
    Stopped { nodes: Vec<String> },
    /// [`Action::Restore`]: every node is back at checkpoint `epoch` (0: the job's start).
    Restored(Result<u64, StepError>),
    /// [`Action::Finish`]: the last persistent checkpoint is written.
    Finished(Result<(), FinishError>),
    /// [`Action::Release`]: whether the job keeps a checkpoint to resume from.
    Released { resumable: bool },
}

/// Why a finished job's last checkpoints failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishError {
    /// The persistent one failed, but memory checkpoint `epoch` holds the result: kept, to be
    /// written by a resume.
    Kept {
        epoch: u64,
        files: Vec<FileId>,
        why: String,
    },
    /// Both failed; `resumable`: an older checkpoint is there to run the rest again from.
    Failed { why: String, resumable: bool },
}

/// What the shell must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Submit `op` to the metadata log; report a refusal with [`Control::handle_refused`].
    Submit { job: String, op: MetaOp },
    /// Start node `physical`'s ranks of start `attempt` of `job` (idempotent: a node that runs
    /// or ran them does nothing). The node reads the rest from its committed records.
    Spawn {
        physical: String,
        job: String,
        attempt: u32,
    },
    /// Stop every rank of `job` of start `attempt` or before on these nodes (a later start's
    /// ranks stay: the order may have come late); then [`Done::Stopped`].
    StopRanks {
        job: String,
        attempt: u32,
        nodes: Vec<String>,
    },
    /// Spare `spare` takes logical node `logical`'s place (its physical node is declared
    /// down); then [`Control::handle_replaced`]. At most one is asked at a time: the machine
    /// is the cluster's one decider of replacements.
    Replace { logical: u32, spare: String },
    /// Fence the job's checkpoints begun, settle its memory checkpoint, and bring every node
    /// back to its newest intact checkpoint; then [`Done::Restored`].
    Restore { job: String, attempt: u32 },
    /// Take the finished job's last checkpoints (a memory one first unless `persistent_only`);
    /// then [`Done::Finished`].
    Finish {
        job: String,
        attempt: u32,
        persistent_only: bool,
    },
    /// Let the job go: keep its segments and checkpoints if `keep` (and it has any), else drop
    /// them; then [`Done::Released`].
    Release { job: String, attempt: u32, keep: bool },
    /// The job halts at its next safe point (the checkpoint coordinator's force); its commit
    /// comes back through [`Control::handle_halted`].
    ForceHalt { job: String, attempt: u32 },
    /// Answer command `id`.
    Answer { id: u64, answer: Answer },
}

/// A step waiting for its [`Done`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Stop,
    Restore,
    Finish,
    Release,
}

/// What the driver knows of a job beyond its record (rebuilt by a new driver).
#[derive(Debug, Default)]
struct Driven {
    attempt: u32,
    /// When each node was last asked to start its ranks.
    spawned: BTreeMap<String, u64>,
    /// Exits reported, by rank.
    exits: BTreeMap<u32, i32>,
    /// Ranks reported running.
    running: BTreeSet<u32>,
    /// A rank's non-zero exit, judged once the grace is over: (rank, status, since).
    failure: Option<(u32, i32, u64)>,
    /// A rank that exited non-zero after the cluster failed one of its calls, and why: the
    /// failure is the cluster's (the job rolls back).
    failure_blame: Option<String>,
    /// The step asked for and when.
    step: Option<(Step, u64)>,
    /// A submitted operation, until the records show it or it is refused, and when.
    submitted: Option<(MetaOp, u64)>,
    /// Not before this time (a pause between passes, after a refusal).
    not_before_ms: u64,
    halt_forced: bool,
    /// Rollback: its pass, the nodes stopped in this pass, when each node was first seen down,
    /// the epoch restored.
    pass: u32,
    stopped: BTreeSet<String>,
    /// When the last stop was answered: a node that did not answer is asked again after
    /// [`STOP_AGAIN_MS`].
    stop_answered_ms: Option<u64>,
    down_since: BTreeMap<String, u64>,
    /// The logical node this pass waits to see replaced by a spare.
    wants_spare: Option<u32>,
    ready_since: Option<u64>,
    restored: Option<u64>,
    /// The incarnation of every node when the restore was asked for.
    restore_incarnations: BTreeMap<String, u64>,
    /// Stop: the job kept a checkpoint (after the release).
    released: Option<bool>,
    /// Finish: a memory checkpoint holds the result and its keeping is being recorded.
    kept: Option<String>,
    /// Finish: how many times the last checkpoints failed, and why last.
    finish_failures: u32,
    last_failure: Option<String>,
}

/// A command waiting for the records to show its effect.
#[derive(Debug)]
struct Waiting {
    id: u64,
    job: String,
    what: Wait,
    op: MetaOp,
}

#[derive(Debug, PartialEq, Eq)]
enum Wait {
    /// The start (attempt) is recorded.
    Start(u32),
    /// The halt flag is set.
    Halt,
    /// The stop is recorded.
    Stop,
}

/// The job-control machine (see the module doc).
#[derive(Debug)]
pub struct Control {
    cfg: Config,
    /// The term this node drives in (`None`: it does not).
    lead: Option<u64>,
    meta: MetaState,
    nodes: BTreeMap<String, NodeView>,
    now_ms: u64,
    unix_ms: u64,
    jobs: BTreeMap<String, Driven>,
    waiting: Vec<Waiting>,
    actions: VecDeque<Action>,
    spares: Spares,
}

/// Spare replacement, for the cluster and for every job's rollback: the one decider.
#[derive(Debug, Default)]
struct Spares {
    /// When each physical node of the map was first seen declared down (by this driver).
    down_since: BTreeMap<String, u64>,
    /// The replacement asked for, not answered yet: (logical node, spare).
    asked: Option<(u32, String)>,
    /// A replacement done, until the records this machine holds show it (within
    /// [`Config::retry_ms`]): (logical node, spare, when answered).
    done: Option<(u32, String, u64)>,
    /// No replacement is asked before this time (after one failed).
    not_before_ms: u64,
}

fn clip(s: String) -> String {
    if s.len() <= MAX_MESSAGE_LEN {
        return s;
    }
    let mut end = MAX_MESSAGE_LEN;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl Control {
    pub fn new(cfg: Config) -> Control {
        Control {
            cfg,
            lead: None,
            meta: MetaState::default(),
            nodes: BTreeMap::new(),
            now_ms: 0,
            unix_ms: 0,
            jobs: BTreeMap::new(),
            waiting: Vec::new(),
            actions: VecDeque::new(),
            spares: Spares::default(),
        }
    }

    // ---- getters ----

    /// Whether this node drives jobs now.
    pub fn is_driving(&self) -> bool {
        self.lead.is_some()
    }

    /// The jobs this node drives.
    pub fn jobs_driven(&self) -> impl Iterator<Item = &str> {
        self.jobs.keys().map(|j| j.as_str())
    }

    /// What a job's driver is doing, for `psls jobs`.
    pub fn activity(&self, job: &str) -> Option<String> {
        let d = self.jobs.get(job)?;
        let run = self.meta.runs.get(job)?;
        let pass = if d.pass > 1 {
            format!(" (pass {})", d.pass)
        } else {
            String::new()
        };
        Some(match (&run.phase, d.step) {
            // Running: nothing but running it (a checkpoint's progress is the coordinator's).
            (RunPhase::Running, _) => return None,
            (RunPhase::RollingBack { .. }, Some((Step::Stop, _))) => format!("rolling back: stopping the ranks{pass}"),
            (RunPhase::RollingBack { .. }, _) if d.wants_spare.is_some() => {
                format!("rolling back: a spare takes a failed node's place{pass}")
            }
            (RunPhase::RollingBack { .. }, Some((Step::Restore, _))) => {
                format!("rolling back: restoring the newest intact checkpoint{pass}")
            }
            (RunPhase::RollingBack { .. }, _) => match d.restored {
                Some(e) => format!("rolling back: restarting from checkpoint {e}{pass}"),
                None => format!("rolling back: waiting for the nodes{pass}"),
            },
            (RunPhase::Finishing, _) => match &d.last_failure {
                Some(why) => format!("taking the last checkpoints (again: {why})"),
                None => "taking the last checkpoints".to_string(),
            },
            (RunPhase::Stopping { end }, _) => format!("stopping ({})", end.how.word()),
        })
    }

    /// The next action.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    // ---- inputs ----

    /// This node drives from now on, in `term` (`Some`), or not any more (`None`). A new driver
    /// forgets what an earlier one knew and starts every job's work again from the records.
    pub fn handle_lead(&mut self, lead: Option<u64>) {
        if lead == self.lead {
            return;
        }
        self.lead = lead;
        self.jobs.clear();
        self.spares = Spares::default();
        for w in std::mem::take(&mut self.waiting) {
            self.actions.push_back(Action::Answer {
                id: w.id,
                answer: Answer::Refused(CommandError::NotLeader),
            });
        }
        self.drive_all();
    }

    /// The committed metadata after it changed.
    pub fn handle_meta(&mut self, st: &MetaState) {
        self.meta = st.clone();
        self.answer_waiting();
        self.drive_all();
    }

    /// Time and the nodes as the heartbeats show them (every tick).
    pub fn handle_tick(&mut self, now_ms: u64, unix_ms: u64, nodes: &BTreeMap<String, NodeView>) {
        self.now_ms = self.now_ms.max(now_ms);
        self.unix_ms = unix_ms;
        self.nodes = nodes.clone();
        self.drive_all();
    }

    /// Node `physical` (incarnation `incarnation`) reports its ranks of a job.
    pub fn handle_report(&mut self, physical: &str, incarnation: u64, r: &Report) {
        let Some(run) = self.meta.runs.get(&r.job) else { return };
        let Some(d) = self.jobs.get_mut(&r.job) else { return };
        if r.attempt != run.attempt || d.attempt != run.attempt {
            return;
        }
        // Only the node the start placed them on speaks for ranks, in the incarnation recorded.
        let ranks_here: BTreeSet<u32> = run
            .placement
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                run.nodes
                    .get(l)
                    .is_some_and(|(p, i)| p == physical && *i == incarnation)
            })
            .map(|(r, _)| r as u32)
            .collect();
        if ranks_here.is_empty() {
            return;
        }
        d.spawned.entry(physical.to_string()).or_insert(self.now_ms);
        for rank in &r.running {
            if ranks_here.contains(rank) && !d.exits.contains_key(rank) {
                d.running.insert(*rank);
            }
        }
        for (rank, code) in &r.exited {
            if !ranks_here.contains(rank) || d.exits.contains_key(rank) {
                continue;
            }
            d.running.remove(rank);
            d.exits.insert(*rank, *code);
            if *code != 0 && d.failure.is_none() {
                d.failure = Some((*rank, *code, self.now_ms));
            }
        }
        // Any rank of this start that exited non-zero after the cluster failed one of its
        // calls makes the failure the cluster's (the first exit reported may be a rank that
        // failed only because that one did).
        if d.failure_blame.is_none() {
            d.failure_blame = r
                .blamed
                .iter()
                .find(|(b, _)| ranks_here.contains(b) && d.exits.get(b).is_some_and(|c| *c != 0))
                .map(|(b, why)| {
                    let code = d.exits.get(b).copied().unwrap_or(0);
                    clip(format!(
                        "rank {b} exited with status {code} after the cluster failed its call: {why}"
                    ))
                });
        }
        let job = r.job.clone();
        self.drive(&job);
    }

    /// A command from a user or an operator (already authenticated: `uid` is the caller's).
    pub fn handle_command(&mut self, id: u64, cmd: Command) {
        if self.lead.is_none() {
            return self.answer(id, Answer::Refused(CommandError::NotLeader));
        }
        if self.waiting.len() >= self.cfg.max_commands {
            return self.answer(id, Answer::Refused(CommandError::Busy));
        }
        // A launch sent again (its answer lost with a driver) is answered as the first was.
        if let Command::Launch { job, spec, .. } = &cmd {
            // A launch made after the job of that name ended is a new start (`psls run --job`
            // of a job that kept nothing to resume from), not the ended one sent again.
            let attempt = match (self.meta.runs.get(job), self.meta.ended.get(job)) {
                (Some(r), _) => Some(r.attempt),
                (None, Some((_, e))) if spec.started_unix_ms <= e.at_unix_ms => Some(e.attempt),
                _ => None,
            };
            let same = self
                .meta
                .jobs
                .get(job)
                .and_then(|r| r.spec.as_ref())
                .is_none_or(|s| s.program == spec.program && s.args == spec.args && s.uid == spec.uid);
            if let (Some(attempt), true) = (attempt, same) {
                let job = job.clone();
                return self.answer(id, Answer::Started { job, attempt });
            }
        }
        match self.command(cmd) {
            Ok((job, what, op)) => {
                self.waiting.push(Waiting {
                    id,
                    job: job.clone(),
                    what,
                    op: op.clone(),
                });
                self.actions.push_back(Action::Submit { job, op });
            }
            Err(e) => self.answer(id, Answer::Refused(e)),
        }
    }

    /// The metadata log refused `op` (submitted for `job`).
    pub fn handle_refused(&mut self, job: &str, op: &MetaOp, why: &str) {
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].job == job && self.waiting[i].op == *op {
                let w = self.waiting.remove(i);
                self.answer(w.id, Answer::Refused(CommandError::Refused(why.to_string())));
            } else {
                i += 1;
            }
        }
        if let Some(d) = self.jobs.get_mut(job) {
            if d.submitted.as_ref().is_some_and(|(o, _)| o == op) {
                d.submitted = None;
                // Decided again from the records once they caught up.
                d.not_before_ms = self.now_ms + self.cfg.pass_pause_ms.min(self.cfg.retry_ms);
            }
        }
        self.drive(job);
    }

    /// A step asked in `term` for start `attempt` of `job` is done. (One asked in another
    /// term is not this driver's: a restore of a term this node drove before, finishing late,
    /// must not end the pass of its new one. Found by the checkpoint simulator.)
    pub fn handle_done(&mut self, term: u64, job: &str, attempt: u32, done: Done) {
        if self.lead != Some(term) {
            return;
        }
        let Some(run) = self.meta.runs.get(job).cloned() else {
            return;
        };
        let now = self.now_ms;
        let expected = match &done {
            Done::Stopped { .. } => Step::Stop,
            Done::Restored(_) => Step::Restore,
            Done::Finished(_) => Step::Finish,
            Done::Released { .. } => Step::Release,
        };
        {
            let Some(d) = self.jobs.get_mut(job) else { return };
            if attempt != run.attempt || d.attempt != attempt || d.step.map(|s| s.0) != Some(expected) {
                return;
            }
            d.step = None;
        }
        let ranks = run.placement.len();
        match done {
            Done::Stopped { nodes } => {
                let d = self.driven(job);
                d.stopped.extend(nodes);
                d.stop_answered_ms = Some(now);
            }
            Done::Restored(Err(e)) => {
                let pause = self.cfg.pass_pause_ms;
                self.pass_failed(job, attempt, e, pause)
            }
            Done::Restored(Ok(epoch)) => self.driven(job).restored = Some(epoch),
            Done::Released { resumable } => self.driven(job).released = Some(resumable),
            Done::Finished(Ok(())) => {
                let message = match self.meta.finished.get(job) {
                    // A resumed job that had finished: only its kept result was written. (The
                    // record of a result being written, with no reason, is this start's own.)
                    Some(f) if !f.why.is_empty() => format!(
                        "job {job} had finished: its result, restored from checkpoint {}, is written",
                        f.epoch
                    ),
                    _ => format!("all {ranks} ranks exited with status 0"),
                };
                let end = self.end(EndHow::Finished, 0, message, attempt);
                self.submit_phase(job, attempt, RunPhase::Stopping { end });
            }
            Done::Finished(Err(FinishError::Kept { epoch, files, why })) => {
                let why = clip(format!("its last persistent checkpoint failed: {why}"));
                self.driven(job).kept = Some(why.clone());
                let op = MetaOp::JobFinished {
                    job: job.to_string(),
                    why: why.chars().take(psls_pfs::meta::MAX_WHY_LEN / 4).collect(),
                    files,
                    epoch,
                };
                self.submit(job, op);
            }
            Done::Finished(Err(FinishError::Failed { why, .. }))
                if self.driven(job).finish_failures + 1 < self.cfg.max_passes =>
            {
                // The result is still in the nodes' memories: the last checkpoints are tried
                // again (a disk may have been freed), a little later each time.
                let pause = self.cfg.pass_pause_ms;
                let d = self.driven(job);
                d.finish_failures += 1;
                d.not_before_ms = now + pause * u64::from(d.finish_failures);
                d.last_failure = Some(clip(why));
            }
            Done::Finished(Err(FinishError::Failed { why, resumable })) => {
                let done = format!("all {ranks} ranks exited with status 0");
                let end = if resumable {
                    self.end(
                        EndHow::Halted,
                        HALTED_STATUS,
                        format!("{done}, but the job's last checkpoint failed: {why}; `psls run --resume {job}` runs it again from its last checkpoint"),
                        attempt,
                    )
                } else {
                    self.end(
                        EndHow::Failed,
                        1,
                        format!("{done}, but the job's last checkpoint failed: {why}"),
                        attempt,
                    )
                };
                self.submit_phase(job, attempt, RunPhase::Stopping { end });
            }
        }
        self.drive(job);
    }

    /// The replacement asked in `term` ([`Action::Replace`]) is done. When it failed, every
    /// rollback waiting for it fails its pass, and no replacement is asked for a pause.
    pub fn handle_replaced(&mut self, term: u64, logical: u32, result: Result<(), StepError>) {
        if self.lead != Some(term) || self.spares.asked.as_ref().map(|a| a.0) != Some(logical) {
            return;
        }
        let Some((_, spare)) = self.spares.asked.take() else {
            return;
        };
        if result.is_ok() {
            self.spares.done = Some((logical, spare, self.now_ms));
        }
        if let Err(e) = result {
            let pause = self.cfg.pass_pause_ms;
            self.spares.not_before_ms = self.now_ms + pause;
            let waiting: Vec<(String, u32)> = self
                .jobs
                .iter()
                .filter(|(_, d)| d.wants_spare == Some(logical))
                .map(|(j, d)| (j.clone(), d.attempt))
                .collect();
            for (job, attempt) in waiting {
                self.driven(&job).wants_spare = None;
                self.pass_failed(&job, attempt, e.clone(), pause);
            }
        }
        self.drive_all();
    }

    /// The driver's state of a job it drives.
    fn driven(&mut self, job: &str) -> &mut Driven {
        self.jobs.entry(job.to_string()).or_default()
    }

    /// The job's halt checkpoint `epoch` committed (from the checkpoint coordinator).
    pub fn handle_halted(&mut self, job: &str, epoch: u64) {
        let Some(run) = self.meta.runs.get(job).cloned() else {
            return;
        };
        if run.phase != RunPhase::Running || !self.jobs.contains_key(job) {
            return;
        }
        let end = self.end(
            EndHow::Halted,
            HALTED_STATUS,
            format!("job {job} halted after checkpoint {epoch}; it can be resumed from it"),
            run.attempt,
        );
        self.submit_phase(job, run.attempt, RunPhase::Stopping { end });
    }

    // ---- commands ----

    fn command(&mut self, cmd: Command) -> Result<(String, Wait, MetaOp), CommandError> {
        match cmd {
            Command::Launch {
                job,
                spec,
                options,
                env,
                hosts,
                stdin,
            } => {
                psls_pfs::jobs::validate_job(&job).map_err(|e| CommandError::Invalid(e.to_string()))?;
                if self.meta.runs.contains_key(&job) || self.waiting.iter().any(|w| w.job == job) {
                    return Err(CommandError::Running(job));
                }
                if self.meta.jobs.contains_key(&job) {
                    return Err(CommandError::Invalid(format!(
                        "a job named {job} exists: resume it or remove it"
                    )));
                }
                if self.meta.runs.len() >= self.cfg.max_jobs {
                    return Err(CommandError::Busy);
                }
                let mut run = self.new_run(0, 0, spec.ranks, spec.per_node, env, hosts, RunPhase::Running)?;
                run.stdin = stdin;
                let op = MetaOp::JobStart {
                    job: job.clone(),
                    spec,
                    options,
                    run: Box::new(run),
                };
                Ok((job, Wait::Start(0), op))
            }
            Command::Resume { job, env, uid, hosts } => {
                if self.meta.runs.contains_key(&job) || self.waiting.iter().any(|w| w.job == job) {
                    return Err(CommandError::Running(job));
                }
                let rec = self
                    .meta
                    .jobs
                    .get(&job)
                    .ok_or_else(|| CommandError::NothingToResume(job.clone()))?;
                let spec = rec.spec.clone().ok_or_else(|| CommandError::NotResumable {
                    job: job.clone(),
                    why: "it is not a `psls run` job".into(),
                })?;
                if uid != 0 && uid != spec.uid {
                    return Err(CommandError::NotOwner(job));
                }
                let ended = self.meta.ended.get(&job).map(|(_, e)| e.clone());
                let finished = self.meta.finished.contains_key(&job);
                if rec.epoch == 0 && !finished && !ended.as_ref().is_some_and(|e| e.how != EndHow::Finished) {
                    return Err(CommandError::NotResumable {
                        job,
                        why: "it has no checkpoint".into(),
                    });
                }
                let attempt = ended.map_or(spec.starts, |e| e.attempt + 1).max(spec.starts);
                let options = self.meta.job_options.get(&job).cloned().unwrap_or_default();
                let mut summary = spec.clone();
                summary.started_unix_ms = self.unix_ms;
                summary.starts = attempt + 1;
                let run = self.new_run(
                    attempt,
                    0,
                    spec.ranks,
                    spec.per_node,
                    env,
                    hosts,
                    RunPhase::RollingBack { why: RESUMED.into() },
                )?;
                let op = MetaOp::JobStart {
                    job: job.clone(),
                    spec: Box::new(summary),
                    options: Box::new(options),
                    run: Box::new(run),
                };
                Ok((job, Wait::Start(attempt), op))
            }
            Command::Halt { job, uid } => {
                self.owned_running(&job, uid)?;
                Ok((job.clone(), Wait::Halt, MetaOp::JobHalt { job }))
            }
            Command::Cancel { job, uid } => {
                let run = self.owned_running(&job, uid)?;
                let end = self.end(EndHow::Cancelled, 130, format!("job {job} was cancelled"), run.attempt);
                let op = MetaOp::JobPhase {
                    job: job.clone(),
                    attempt: run.attempt,
                    phase: RunPhase::Stopping { end },
                };
                Ok((job, Wait::Stop, op))
            }
        }
    }

    fn owned_running(&self, job: &str, uid: u32) -> Result<RunRecord, CommandError> {
        let run = self
            .meta
            .runs
            .get(job)
            .ok_or_else(|| CommandError::NotRunning(job.to_string()))?;
        let owner = self.meta.jobs.get(job).and_then(|r| r.spec.as_ref()).map(|s| s.uid);
        if uid != 0 && owner != Some(uid) {
            return Err(CommandError::NotOwner(job.to_string()));
        }
        Ok(run.clone())
    }

    /// A new start's record: ranks placed on the live logical nodes.
    #[allow(clippy::too_many_arguments)]
    fn new_run(
        &self,
        attempt: u32,
        restart_epoch: u64,
        ranks: u32,
        per_node: Option<u32>,
        env: Vec<(String, String)>,
        hosts: Vec<String>,
        phase: RunPhase,
    ) -> Result<RunRecord, CommandError> {
        let logical = self.logical();
        if let Some(h) = hosts
            .iter()
            .find(|h| !self.cfg.nodes.contains(h) && !self.cfg.spares.contains(h))
        {
            return Err(CommandError::Invalid(format!("no node named {h} in the cluster")));
        }
        let live: Vec<u32> = logical
            .iter()
            .filter(|(_, p)| self.nodes.get(*p).is_some_and(|v| v.live))
            .filter(|(_, p)| hosts.is_empty() || hosts.contains(p))
            .map(|(l, _)| *l)
            .collect();
        if live.is_empty() && !hosts.is_empty() {
            return Err(CommandError::Invalid(format!(
                "none of the job's nodes ({}) is up",
                hosts.join(", ")
            )));
        }
        let placement = crate::place::place(ranks, &live, per_node).map_err(CommandError::Invalid)?;
        let nodes = placement
            .iter()
            .map(|l| {
                let p = logical.get(l).cloned().unwrap_or_default();
                let inc = self.nodes.get(&p).map_or(0, |v| v.incarnation);
                (*l, (p, inc))
            })
            .collect();
        Ok(RunRecord {
            attempt,
            restarts: 0,
            restart_epoch,
            placement,
            nodes,
            env,
            phase,
            halt: false,
            since_unix_ms: self.unix_ms,
            hosts,
            stdin: false,
        })
    }

    fn answer(&mut self, id: u64, answer: Answer) {
        self.actions.push_back(Action::Answer { id, answer });
    }

    /// Answers the commands whose effect the records show.
    fn answer_waiting(&mut self) {
        let mut i = 0;
        while i < self.waiting.len() {
            let w = &self.waiting[i];
            let run = self.meta.runs.get(&w.job);
            let done = match w.what {
                Wait::Start(a) => {
                    run.is_some_and(|r| r.attempt >= a)
                        || self.meta.ended.get(&w.job).is_some_and(|(_, e)| e.attempt >= a)
                }
                Wait::Halt => run.is_none_or(|r| r.halt),
                Wait::Stop => run.is_none_or(|r| matches!(r.phase, RunPhase::Stopping { .. })),
            };
            if done {
                let w = self.waiting.remove(i);
                let answer = match w.what {
                    Wait::Start(attempt) => Answer::Started { job: w.job, attempt },
                    _ => Answer::Accepted { job: w.job },
                };
                self.answer(w.id, answer);
            } else {
                i += 1;
            }
        }
    }

    // ---- driving ----

    fn end(&self, how: EndHow, code: i32, message: String, attempt: u32) -> JobEnd {
        JobEnd {
            how,
            code,
            message: clip(message),
            attempt,
            at_unix_ms: self.unix_ms,
        }
    }

    fn submit(&mut self, job: &str, op: MetaOp) {
        if let Some(d) = self.jobs.get_mut(job) {
            d.submitted = Some((op.clone(), self.now_ms));
        }
        self.actions.push_back(Action::Submit {
            job: job.to_string(),
            op,
        });
    }

    fn submit_phase(&mut self, job: &str, attempt: u32, phase: RunPhase) {
        let op = MetaOp::JobPhase {
            job: job.to_string(),
            attempt,
            phase,
        };
        self.submit(job, op);
    }

    fn ask(&mut self, job: &str, step: Step, action: Action) {
        if let Some(d) = self.jobs.get_mut(job) {
            d.step = Some((step, self.now_ms));
        }
        self.actions.push_back(action);
    }

    fn drive_all(&mut self) {
        if self.lead.is_none() {
            return;
        }
        let running: Vec<String> = self.meta.runs.keys().cloned().collect();
        self.jobs.retain(|j, _| running.contains(j));
        for job in running {
            self.drive_job(&job);
        }
        self.drive_spares();
    }

    /// The one decider of spare replacements. A logical node gets the first free live spare
    /// when its physical node is declared down and its disk failed, or has been declared down
    /// for [`Config::replace_after_ms`], or a job's rollback waits for it (past the job's
    /// respawn timeout, the node declared down). One replacement at a time.
    fn drive_spares(&mut self) {
        if self.lead.is_none() {
            return;
        }
        let now = self.now_ms;
        let map = self.logical();
        let declared = |p: &String| self.nodes.get(p).is_some_and(|v| v.declared_down);
        let down: Vec<(u32, String)> = map
            .iter()
            .filter(|(_, p)| declared(p))
            .map(|(l, p)| (*l, p.clone()))
            .collect();
        self.spares.down_since.retain(|p, _| down.iter().any(|x| x.1 == *p));
        for (_, p) in &down {
            self.spares.down_since.entry(p.clone()).or_insert(now);
        }
        if let Some((l, spare, at)) = &self.spares.done {
            if map.get(l) == Some(spare) || now >= at + self.cfg.retry_ms {
                self.spares.done = None;
            }
        }
        if self.spares.asked.is_some() || self.spares.done.is_some() || now < self.spares.not_before_ms {
            return;
        }
        let after = self.cfg.replace_after_ms;
        // A rollback asks only once the node is declared down at the incarnation its start
        // named (or never heard of it).
        let wanted_by_job = |l: u32| self.jobs.values().any(|d| d.wants_spare == Some(l));
        let chosen = map.iter().find(|(l, p)| {
            if self.live(p) {
                return false;
            }
            if wanted_by_job(**l) {
                return true;
            }
            let Some(since) = self.spares.down_since.get(*p) else {
                return false;
            };
            self.nodes.get(*p).is_some_and(|v| v.disk_failed) || (after > 0 && now >= since + after)
        });
        let Some((&logical, _)) = chosen else { return };
        let Some(spare) = self.free_spare() else { return };
        self.spares.asked = Some((logical, spare.clone()));
        self.actions.push_back(Action::Replace { logical, spare });
    }

    /// The first configured spare that holds no logical node and is live.
    fn free_spare(&self) -> Option<String> {
        let map = self.logical();
        self.cfg
            .spares
            .iter()
            .find(|s| !map.values().any(|x| x == *s) && self.live(s))
            .cloned()
    }

    /// The logical → physical map: the records', or the configured one until the records hold
    /// one (no replacement yet).
    fn logical(&self) -> BTreeMap<u32, String> {
        if self.meta.logical.is_empty() {
            self.cfg
                .nodes
                .iter()
                .enumerate()
                .map(|(i, n)| (i as u32, n.clone()))
                .collect()
        } else {
            self.meta.logical.clone()
        }
    }

    /// A logical node's physical node, if it is live.
    fn live(&self, physical: &str) -> bool {
        self.nodes.get(physical).is_some_and(|v| v.live)
    }

    /// The nodes of `run` that lost its ranks: replaced, restarted, or declared down.
    fn lost_nodes(&self, run: &RunRecord) -> Vec<String> {
        run.nodes
            .iter()
            .filter(|(l, (p, inc))| {
                self.logical().get(l) != Some(p)
                    || self.meta.is_down(p, *inc)
                    || self
                        .nodes
                        .get(p)
                        .is_some_and(|v| v.incarnation != 0 && v.incarnation != *inc)
            })
            .map(|(_, (p, _))| p.clone())
            .collect()
    }

    /// Decides the next step of `job` from its record and what the driver knows.
    /// Drives one job, then the replacement it may wait for (the others are looked at every
    /// tick: an input about one job does not walk the whole map).
    fn drive(&mut self, job: &str) {
        self.drive_job(job);
        if self.jobs.get(job).is_some_and(|d| d.wants_spare.is_some()) {
            self.drive_spares();
        }
    }

    fn drive_job(&mut self, job: &str) {
        if self.lead.is_none() {
            return;
        }
        let Some(run) = self.meta.runs.get(job).cloned() else {
            self.jobs.remove(job);
            return;
        };
        let now = self.now_ms;
        let d = self.jobs.entry(job.to_string()).or_default();
        if d.attempt != run.attempt {
            *d = Driven {
                attempt: run.attempt,
                ..Driven::default()
            };
        }
        if !matches!(run.phase, RunPhase::RollingBack { .. }) {
            d.wants_spare = None;
        }
        // A submission waits for the records (or its refusal), within the retry time.
        if let Some((op, at)) = &d.submitted {
            if op.reflected_in(&self.meta) {
                d.submitted = None;
            } else if now < at + self.cfg.retry_ms {
                return;
            } else {
                d.submitted = None;
            }
        }
        if now < d.not_before_ms {
            return;
        }
        // A step waits for its outcome, however long it takes: asked again while it runs, a
        // restore would run twice at once, and one's drop could undo what the other's
        // restart's ranks wrote. (The simulator found it: a restore outlasting the retry
        // time.) The shell answers every step; a driver that stops driving forgets them.
        if d.step.is_some() {
            return;
        }
        match &run.phase {
            RunPhase::Running => self.drive_running(job, &run),
            RunPhase::RollingBack { .. } => self.drive_rollback(job, &run),
            RunPhase::Finishing => {
                // A node lost while the last checkpoints are taken lost the ranks' last writes
                // there (after their last checkpoint), or its copies of the finished result:
                // the job rolls back, and runs that part again, or (its result's checkpoint
                // recorded, `meta.finished`) writes the restored result. (A result kept once
                // the last persistent checkpoint failed is written by a resume.)
                let kept = self.jobs.get(job).is_some_and(|d| d.kept.is_some());
                if !kept && self.roll_back_if_lost(job, &run) {
                    return;
                }
                let persistent_only = self.meta.job_options.get(job).is_some_and(|o| o.level == "persistent");
                let d = self.jobs.get_mut(job).expect("driven");
                if let Some(why) = d.kept.clone() {
                    // The result is kept (once the records show it): the job ends unwritten.
                    if self.meta.finished.contains_key(job) {
                        let end = self.end(
                            EndHow::Unwritten,
                            HALTED_STATUS,
                            format!(
                                "all {} ranks exited with status 0, but {why}; the result is kept in a memory checkpoint: `psls run --resume {job}` writes it",
                                run.placement.len()
                            ),
                            run.attempt,
                        );
                        self.submit_phase(job, run.attempt, RunPhase::Stopping { end });
                    } else {
                        d.kept = None;
                    }
                    return;
                }
                self.ask(
                    job,
                    Step::Finish,
                    Action::Finish {
                        job: job.to_string(),
                        attempt: run.attempt,
                        persistent_only,
                    },
                );
            }
            RunPhase::Stopping { end } => self.drive_stopping(job, &run, end.clone()),
        }
    }

    /// A node of `run` lost its ranks (and with them the job's memory there): the job rolls
    /// back, or fails past its restarts. Returns whether it did.
    fn roll_back_if_lost(&mut self, job: &str, run: &RunRecord) -> bool {
        let lost = self.lost_nodes(run);
        if lost.is_empty() {
            return false;
        }
        self.roll_back(job, run, format!("{} went down", lost.join(", ")));
        true
    }

    /// Rolls `job` back for `why`, unless it was restarted as often as it may be (then it
    /// ends as lost to a failure).
    fn roll_back(&mut self, job: &str, run: &RunRecord, why: String) {
        let max_restarts = self
            .meta
            .jobs
            .get(job)
            .and_then(|r| r.spec.as_ref())
            .map_or(0, |s| s.max_restarts);
        if run.restarts >= max_restarts {
            let end = self.end(
                EndHow::NodeFail,
                LOST_STATUS,
                format!(
                    "job {job} failed: {why}; the job was restarted {} times already (--max-restarts {max_restarts})",
                    run.restarts
                ),
                run.attempt,
            );
            self.submit_phase(job, run.attempt, RunPhase::Stopping { end });
        } else {
            self.submit_phase(job, run.attempt, RunPhase::RollingBack { why: clip(why) });
        }
    }

    fn drive_running(&mut self, job: &str, run: &RunRecord) {
        let now = self.now_ms;
        if self.roll_back_if_lost(job, run) {
            return;
        }
        let ranks = run.placement.len() as u32;
        let d = self.jobs.get_mut(job).expect("driven");
        if d.exits.len() as u32 == ranks && d.failure.is_none() {
            self.submit_phase(job, run.attempt, RunPhase::Finishing);
            return;
        }
        if let (Some(_), Some(why)) = (d.failure, d.failure_blame.clone()) {
            self.roll_back(job, run, why);
            return;
        }
        if let Some((rank, code, since)) = d.failure {
            if now >= since + self.cfg.grace_ms {
                let end = self.end(
                    EndHow::Failed,
                    code,
                    format!("rank {rank} exited with status {code}; the other ranks were stopped"),
                    run.attempt,
                );
                self.submit_phase(job, run.attempt, RunPhase::Stopping { end });
            }
            return;
        }
        // Start the ranks where they are not known to run (again after the retry time: a
        // lost message, a new driver).
        let retry = self.cfg.retry_ms;
        let mut spawn = Vec::new();
        let d = self.jobs.get_mut(job).expect("driven");
        for (l, (p, _)) in &run.nodes {
            let placed: Vec<u32> = run
                .placement
                .iter()
                .enumerate()
                .filter(|(_, x)| *x == l)
                .map(|(r, _)| r as u32)
                .collect();
            let known = placed.iter().all(|r| d.running.contains(r) || d.exits.contains_key(r));
            if known {
                continue;
            }
            if d.spawned.get(p).is_none_or(|at| now >= at + retry) {
                d.spawned.insert(p.clone(), now);
                spawn.push(p.clone());
            }
        }
        let halt = run.halt && !d.halt_forced;
        if halt {
            d.halt_forced = true;
        }
        for p in spawn {
            self.actions.push_back(Action::Spawn {
                physical: p,
                job: job.to_string(),
                attempt: run.attempt,
            });
        }
        if halt {
            self.actions.push_back(Action::ForceHalt {
                job: job.to_string(),
                attempt: run.attempt,
            });
        }
    }

    /// A pass of the rollback failed: another pass after a pause, or, past the last pass or
    /// when it cannot succeed, the job fails.
    fn pass_failed(&mut self, job: &str, attempt: u32, e: StepError, pause_ms: u64) {
        let max = self.cfg.max_passes;
        let now = self.now_ms;
        let pass = self.driven(job).pass.max(1);
        if matches!(e, StepError::Failed(_)) || pass >= max {
            let end = self.end(
                EndHow::NodeFail,
                LOST_STATUS,
                format!("job {job} failed: the rollback failed: {e}"),
                attempt,
            );
            self.submit_phase(job, attempt, RunPhase::Stopping { end });
            return;
        }
        let d = self.driven(job);
        d.pass = pass + 1;
        d.stopped.clear();
        d.restored = None;
        d.ready_since = None;
        d.wants_spare = None;
        d.not_before_ms = now + pause_ms;
    }

    fn drive_rollback(&mut self, job: &str, run: &RunRecord) {
        let now = self.now_ms;
        let pause = self.cfg.pass_pause_ms;
        let logical = self.logical();
        let down: Vec<(u32, String)> = logical
            .iter()
            .filter(|(_, p)| !self.live(p))
            .map(|(l, p)| (*l, p.clone()))
            .collect();
        let rebuilding = !self.meta.rebuilding.is_empty();
        let respawn_ms = self
            .meta
            .jobs
            .get(job)
            .and_then(|r| r.spec.as_ref())
            .map_or(0, |s| s.respawn_timeout_ms);
        let live_nodes: Vec<String> = logical.values().filter(|p| self.live(p)).cloned().collect();
        let spare = self.free_spare();
        let asked = self.spares.asked.as_ref().map(|a| a.0);
        let rebuild_timeout_ms = self.cfg.rebuild_timeout_ms;
        let incarnations: BTreeMap<String, u64> = logical
            .values()
            .map(|p| (p.clone(), self.nodes.get(p).map_or(0, |v| v.incarnation)))
            .collect();
        let d = self.driven(job);
        d.pass = d.pass.max(1);
        d.wants_spare = None;
        // 1. Stop the ranks on every live node (again on a node that came back).
        let unstopped: Vec<String> = live_nodes.iter().filter(|p| !d.stopped.contains(*p)).cloned().collect();
        if !unstopped.is_empty() {
            if d.stop_answered_ms.is_some_and(|t| now < t + STOP_AGAIN_MS) {
                return;
            }
            let action = Action::StopRanks {
                job: job.to_string(),
                attempt: run.attempt,
                nodes: unstopped,
            };
            return self.ask(job, Step::Stop, action);
        }
        // 2. Every logical node live, none re-creating copies; a spare for a node down longer
        //    than the respawn timeout.
        d.down_since.retain(|p, _| down.iter().any(|x| x.1 == *p));
        for (_, p) in &down {
            d.down_since.entry(p.clone()).or_insert(now);
        }
        let longest = down
            .iter()
            .min_by_key(|(_, p)| d.down_since.get(p).copied().unwrap_or(now))
            .map(|(l, p)| (*l, p.clone(), d.down_since.get(p).copied().unwrap_or(now)));
        if let Some((l, p, since)) = longest {
            d.restored = None;
            d.ready_since = None;
            if now < since + respawn_ms {
                return;
            }
            match spare {
                _ if asked == Some(l) => d.wants_spare = Some(l),
                Some(_) => {
                    // The node it replaces may only be paused, and wake with the job's ranks:
                    // the records first hold a verdict on it (as this start named it, or as
                    // last heard), which it obeys when it wakes. (A driver that restarted
                    // since never heard it, and its detector cannot declare it: found by the
                    // simulator, ranks of two starts running at once.)
                    let named = run.nodes.values().filter(|(x, _)| *x == p).map(|(_, i)| *i).max();
                    let heard = self.nodes.get(&p).map_or(0, |v| v.incarnation);
                    let incarnation = named.unwrap_or(0).max(heard);
                    if incarnation > 0 && !self.meta.is_down(&p, incarnation) {
                        let op = MetaOp::DeclareDown {
                            physical: p,
                            incarnation,
                        };
                        return self.submit(job, op);
                    }
                    // The decider asks for it ([`Control::drive_spares`]).
                    self.driven(job).wants_spare = Some(l);
                }
                None => {
                    let e = StepError::Unavailable(format!(
                        "{p} did not come back within {} s and no spare is free",
                        respawn_ms / 1000
                    ));
                    self.pass_failed(job, run.attempt, e, pause.max(respawn_ms));
                }
            }
            return;
        }
        let ready_since = *d.ready_since.get_or_insert(now);
        if rebuilding {
            d.restored = None;
            if now >= ready_since + rebuild_timeout_ms {
                let e = StepError::Unavailable("a spare's copies were not re-created in time".into());
                self.pass_failed(job, run.attempt, e, pause);
            }
            return;
        }
        // 3. Restore the newest intact checkpoint.
        let Some(epoch) = d.restored else {
            d.restore_incarnations = incarnations;
            let action = Action::Restore {
                job: job.to_string(),
                attempt: run.attempt,
            };
            return self.ask(job, Step::Restore, action);
        };
        // A node that restarted, or was declared down, since the restore began lost the memory
        // it restored: the pass is done again. (Found by the checkpoint simulator driving this
        // machine: ranks restarted on a memory a node had lost meanwhile.)
        let asked = d.restore_incarnations.clone();
        let changed = asked
            .iter()
            .find(|(p, inc)| incarnations.get(*p) != Some(*inc) || self.meta.is_down(p, **inc));
        if let Some((p, _)) = changed {
            let e = StepError::Unavailable(format!("{p} failed during the restore"));
            return self.pass_failed(job, run.attempt, e, 0);
        }
        // 4. A finished job restored to its result only has it written (a new start that runs
        // no rank: its nodes' incarnations are those that hold the restored copies, so a node
        // restarted since is refused from the rounds only until a restore); any other starts
        // again.
        let result = self
            .meta
            .finished
            .get(job)
            .is_some_and(|f| f.epoch <= epoch && f.epoch > 0);
        let phase = if result { RunPhase::Finishing } else { RunPhase::Running };
        let (ranks, per_node) = self
            .meta
            .jobs
            .get(job)
            .and_then(|r| r.spec.as_ref())
            .map_or((run.placement.len() as u32, None), |s| (s.ranks, s.per_node));
        let resumed = matches!(&run.phase, RunPhase::RollingBack { why } if why == RESUMED);
        match self.new_run(
            run.attempt + 1,
            epoch,
            ranks,
            per_node,
            run.env.clone(),
            run.hosts.clone(),
            phase,
        ) {
            Ok(mut next) => {
                next.restarts = if resumed { 0 } else { run.restarts + 1 };
                next.halt = run.halt;
                let op = MetaOp::JobRestart {
                    job: job.to_string(),
                    attempt: run.attempt,
                    run: Box::new(next),
                };
                self.submit(job, op);
            }
            Err(e) => self.pass_failed(job, run.attempt, StepError::Unavailable(e.to_string()), pause),
        }
    }

    fn drive_stopping(&mut self, job: &str, run: &RunRecord, end: JobEnd) {
        let live_nodes: Vec<String> = self.logical().values().filter(|p| self.live(p)).cloned().collect();
        let now = self.now_ms;
        let d = self.jobs.get_mut(job).expect("driven");
        let unstopped: Vec<String> = live_nodes.iter().filter(|p| !d.stopped.contains(*p)).cloned().collect();
        if !unstopped.is_empty() {
            if d.stop_answered_ms.is_some_and(|t| now < t + STOP_AGAIN_MS) {
                return;
            }
            self.ask(
                job,
                Step::Stop,
                Action::StopRanks {
                    job: job.to_string(),
                    attempt: run.attempt,
                    nodes: unstopped,
                },
            );
            return;
        }
        let Some(resumable) = d.released else {
            let keep = !matches!(end.how, EndHow::Finished);
            self.ask(
                job,
                Step::Release,
                Action::Release {
                    job: job.to_string(),
                    attempt: run.attempt,
                    keep,
                },
            );
            return;
        };
        let mut end = end;
        if !resumable && matches!(end.how, EndHow::Cancelled | EndHow::Halted) {
            end.message = clip(format!("{}; it kept no checkpoint to resume from", end.message));
        }
        let op = MetaOp::JobEnd {
            job: job.to_string(),
            end,
        };
        self.submit(job, op);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> (MetaState, BTreeMap<String, NodeView>) {
        let mut st = MetaState::default();
        let logical = (0..2).map(|i| (i, format!("n{i}"))).collect();
        st.apply_at(1, &MetaOp::InitMap { logical }).expect("map");
        let nodes = (0..2)
            .map(|i| {
                (
                    format!("n{i}"),
                    NodeView {
                        live: true,
                        incarnation: 1,
                        declared_down: false,
                        disk_failed: false,
                    },
                )
            })
            .collect();
        (st, nodes)
    }

    /// Two logical nodes and spare s0, all live, with this driver leading in term 1.
    fn with_spare(replace_after_ms: u64) -> (Control, MetaState, BTreeMap<String, NodeView>) {
        let (st, mut nodes) = cluster();
        let up = NodeView {
            live: true,
            incarnation: 1,
            declared_down: false,
            disk_failed: false,
        };
        nodes.insert("s0".into(), up);
        let cfg = Config {
            nodes: vec!["n0".into(), "n1".into()],
            spares: vec!["s0".into()],
            replace_after_ms,
            ..Config::default()
        };
        let mut c = Control::new(cfg);
        c.handle_tick(0, 0, &nodes);
        c.handle_meta(&st);
        c.handle_lead(Some(1));
        (c, st, nodes)
    }

    fn down(nodes: &mut BTreeMap<String, NodeView>, p: &str, disk_failed: bool) {
        let v = nodes.get_mut(p).expect("a node");
        v.live = false;
        v.declared_down = true;
        v.disk_failed = disk_failed;
    }

    #[test]
    fn a_step_is_tried_again_only_after_what_may_pass() {
        let again = [ErrorKind::Unavailable, ErrorKind::Io, ErrorKind::Internal];
        for k in again {
            assert_eq!(
                StepError::of(k, "m".into()),
                StepError::Unavailable("m".into()),
                "{k:?}"
            );
        }
        let fail = [
            ErrorKind::NotFound,
            ErrorKind::Exists,
            ErrorKind::Permission,
            ErrorKind::Invalid,
            ErrorKind::NoSpace,
        ];
        for k in fail {
            assert_eq!(StepError::of(k, "m".into()), StepError::Failed("m".into()), "{k:?}");
        }
    }

    #[test]
    fn a_node_declared_down_past_replace_after_gets_a_spare_once() {
        let (mut c, mut st, mut nodes) = with_spare(10_000);
        down(&mut nodes, "n1", false);
        c.handle_tick(1_000, 0, &nodes);
        assert!(c.poll_action().is_none(), "not before replace_after_ms");
        c.handle_tick(10_999, 0, &nodes);
        assert!(c.poll_action().is_none(), "not before replace_after_ms");
        c.handle_tick(11_000, 0, &nodes);
        assert_eq!(
            c.poll_action(),
            Some(Action::Replace {
                logical: 1,
                spare: "s0".into()
            })
        );
        // Asked once, however long it runs.
        c.handle_tick(60_000, 0, &nodes);
        assert!(c.poll_action().is_none(), "one replacement at a time, asked once");
        // An answer of another term is not this one's.
        c.handle_replaced(2, 1, Ok(()));
        c.handle_tick(61_000, 0, &nodes);
        assert!(c.poll_action().is_none());
        st.apply_at(
            2,
            &MetaOp::Replace {
                logical: 1,
                physical: "s0".into(),
            },
        )
        .expect("applies");
        c.handle_meta(&st);
        c.handle_replaced(1, 1, Ok(()));
        c.handle_tick(120_000, 0, &nodes);
        assert!(c.poll_action().is_none(), "the map holds the spare: nothing more");
    }

    #[test]
    fn a_node_whose_disk_failed_is_replaced_at_once_and_never_without_a_verdict() {
        let (mut c, _, mut nodes) = with_spare(0);
        // Its disk failed but it is not declared down yet: nothing.
        nodes.get_mut("n0").expect("n0").disk_failed = true;
        c.handle_tick(1_000, 0, &nodes);
        assert!(c.poll_action().is_none());
        down(&mut nodes, "n0", true);
        c.handle_tick(1_001, 0, &nodes);
        assert_eq!(
            c.poll_action(),
            Some(Action::Replace {
                logical: 0,
                spare: "s0".into()
            })
        );
        // A failed replacement is asked again after a pause.
        c.handle_replaced(1, 0, Err(StepError::Unavailable("spare not up".into())));
        c.handle_tick(1_002, 0, &nodes);
        assert!(c.poll_action().is_none(), "a pause after a failure");
        c.handle_tick(1_001 + Config::default().pass_pause_ms, 0, &nodes);
        assert!(matches!(c.poll_action(), Some(Action::Replace { logical: 0, .. })));
        // replace_after_ms 0 and a plain verdict: never automatically.
        let (mut c, _, mut nodes) = with_spare(0);
        down(&mut nodes, "n1", false);
        c.handle_tick(1_000_000, 0, &nodes);
        assert!(c.poll_action().is_none());
        // No free live spare: nothing is asked.
        let (mut c, _, mut nodes) = with_spare(5);
        down(&mut nodes, "n1", false);
        nodes.get_mut("s0").expect("s0").live = false;
        c.handle_tick(1_000, 0, &nodes);
        assert!(c.poll_action().is_none());
        // Not leading: nothing is asked.
        let (mut c, _, mut nodes) = with_spare(5);
        c.handle_lead(None);
        down(&mut nodes, "n1", true);
        c.handle_tick(1_000, 0, &nodes);
        assert!(c.poll_action().is_none());
    }

    #[test]
    fn a_launch_is_recorded_then_answered_and_started() {
        let (mut st, nodes) = cluster();
        let mut c = Control::new(Config::default());
        c.handle_tick(0, 0, &nodes);
        c.handle_meta(&st);
        c.handle_lead(Some(1));
        let cmd = Command::Launch {
            job: "j".into(),
            spec: Box::new(JobSummary {
                ranks: 3,
                ..JobSummary::default()
            }),
            options: Box::default(),
            env: Vec::new(),
            hosts: Vec::new(),
            stdin: false,
        };
        c.handle_command(7, cmd);
        let Some(Action::Submit { op, .. }) = c.poll_action() else {
            panic!("the launch is recorded first")
        };
        assert!(c.poll_action().is_none(), "nothing before the record");
        st.apply_at(2, &op).expect("applies");
        c.handle_meta(&st);
        let mut spawned = Vec::new();
        let mut answered = false;
        while let Some(a) = c.poll_action() {
            match a {
                Action::Answer { id: 7, answer } => {
                    assert_eq!(
                        answer,
                        Answer::Started {
                            job: "j".into(),
                            attempt: 0
                        }
                    );
                    answered = true;
                }
                Action::Spawn {
                    physical, attempt: 0, ..
                } => spawned.push(physical),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(answered);
        assert_eq!(spawned, vec!["n0".to_string(), "n1".to_string()]);
        // A report from a node of another incarnation does not speak for the ranks.
        let r = Report {
            job: "j".into(),
            attempt: 0,
            running: Vec::new(),
            exited: vec![(0, 0), (2, 0)],
            blamed: Vec::new(),
        };
        c.handle_report("n0", 2, &r);
        c.handle_report(
            "n1",
            1,
            &Report {
                exited: vec![(1, 0)],
                ..r.clone()
            },
        );
        assert!(c.poll_action().is_none(), "two of three exits count: not finishing yet");
        c.handle_report("n0", 1, &r);
        let Some(Action::Submit {
            op: MetaOp::JobPhase { phase, .. },
            ..
        }) = c.poll_action()
        else {
            panic!("every rank exited 0: the job finishes")
        };
        assert_eq!(phase, RunPhase::Finishing);
    }

    /// A launched job of 3 ranks (0 and 2 on n0, 1 on n1), `max_restarts` 2, all running.
    fn running_job() -> (Control, MetaState, BTreeMap<String, NodeView>) {
        let (mut st, nodes) = cluster();
        let mut c = Control::new(Config::default());
        c.handle_tick(0, 0, &nodes);
        c.handle_meta(&st);
        c.handle_lead(Some(1));
        let cmd = Command::Launch {
            job: "j".into(),
            spec: Box::new(JobSummary {
                ranks: 3,
                max_restarts: 2,
                ..JobSummary::default()
            }),
            options: Box::default(),
            env: Vec::new(),
            hosts: Vec::new(),
            stdin: false,
        };
        c.handle_command(7, cmd);
        let Some(Action::Submit { op, .. }) = c.poll_action() else {
            panic!("the launch is recorded first")
        };
        st.apply_at(2, &op).expect("applies");
        c.handle_meta(&st);
        while c.poll_action().is_some() {}
        let running = |ranks: Vec<u32>| Report {
            job: "j".into(),
            attempt: 0,
            running: ranks,
            exited: Vec::new(),
            blamed: Vec::new(),
        };
        c.handle_report("n0", 1, &running(vec![0, 2]));
        c.handle_report("n1", 1, &running(vec![1]));
        while c.poll_action().is_some() {}
        (c, st, nodes)
    }

    #[test]
    fn a_rank_that_exits_after_the_cluster_failed_its_call_rolls_the_job_back_and_one_that_just_fails_ends_it() {
        // Blamed: the job rolls back at once, no node being down.
        let (mut c, _, _) = running_job();
        let blamed = Report {
            job: "j".into(),
            attempt: 0,
            running: Vec::new(),
            exited: vec![(1, 1)],
            blamed: vec![(1, "n0 is not the coordinator (any more)".into())],
        };
        c.handle_report("n1", 1, &blamed);
        match c.poll_action() {
            Some(Action::Submit {
                op:
                    MetaOp::JobPhase {
                        phase: RunPhase::RollingBack { why },
                        ..
                    },
                ..
            }) => assert!(
                why.contains(
                    "rank 1 exited with status 1 after the cluster failed its call: n0 is not the coordinator"
                ),
                "{why}"
            ),
            other => panic!("a rollback, not {other:?}"),
        }
        // Not blamed (the program's own failure): the job ends once the grace is over (a node
        // may still be found down meanwhile), and does not roll back.
        let (mut c, _, nodes) = running_job();
        c.handle_report(
            "n1",
            1,
            &Report {
                blamed: Vec::new(),
                ..blamed.clone()
            },
        );
        assert!(c.poll_action().is_none(), "waits for the grace");
        // A blame of another rank changes nothing.
        c.handle_report(
            "n0",
            1,
            &Report {
                running: vec![0, 2],
                exited: Vec::new(),
                blamed: vec![(0, "the coordinator (n0) went down while this rank waited".into())],
                ..blamed.clone()
            },
        );
        assert!(c.poll_action().is_none(), "waits for the grace");
        c.handle_tick(Config::default().grace_ms, 0, &nodes);
        match c.poll_action() {
            Some(Action::Submit {
                op:
                    MetaOp::JobPhase {
                        phase: RunPhase::Stopping { end },
                        ..
                    },
                ..
            }) => assert_eq!(end.how, EndHow::Failed),
            other => panic!("the job ends failed, not {other:?}"),
        }
        // The first exit reported is not blamed, a later one is (rank 1 failed only because
        // rank 0's barrier was failed by the cluster): the job rolls back, within the grace.
        let (mut c, _, _) = running_job();
        c.handle_report(
            "n1",
            1,
            &Report {
                blamed: Vec::new(),
                ..blamed.clone()
            },
        );
        assert!(c.poll_action().is_none(), "waits for the grace");
        c.handle_report(
            "n0",
            1,
            &Report {
                running: vec![2],
                exited: vec![(0, 1)],
                blamed: vec![(0, "the coordinator (n0) went down while this rank waited".into())],
                ..blamed.clone()
            },
        );
        match c.poll_action() {
            Some(Action::Submit {
                op:
                    MetaOp::JobPhase {
                        phase: RunPhase::RollingBack { why },
                        ..
                    },
                ..
            }) => assert!(
                why.contains("rank 0 exited with status 1 after the cluster failed its call"),
                "{why}"
            ),
            other => panic!("a rollback, not {other:?}"),
        }
    }
}
