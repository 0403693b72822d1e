//! The rank nodes' side of job control: this node starts its ranks of a job's start when job
//! control asks ([`start_ranks`]), as its own caught-up records say (`psls_jobs::local`), stops
//! them when asked or when its records call them stale ([`tick`]), keeps their exits and
//! reports them to job control (the metadata's leader) until the job goes, and keeps their
//! output, numbered line by line (`psls_jobs::output`), for followers on any node.
//!
//! Invariants: a node runs ranks of one start of a job at a time, the one its records name;
//! a rank's output is kept before its exit is reported (the relay reads both pipes to their
//! end first); no peer's word starts a rank (the records name the program, the user, the
//! environment and the ranks placed here).

use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
pub use crate::peer::JobSpec;
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::ErrorKind;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most ranks in one job.
pub const MAX_RANKS: u32 = 4096;
/// Output relayed per message, at most.
const OUTPUT_CHUNK: usize = 64 * 1024;
/// Status of a rank lost with its node.
pub const LOST_STATUS: i32 = 255;
/// Status of a job stopped by `psls halt` after its checkpoint committed (EX_TEMPFAIL, which
/// batch scripts test for: resume it with `psls run --resume`).
pub const HALTED_STATUS: i32 = 75;
/// How long a safe-point call waits for every rank by default.
pub const DEFAULT_CALL_TIMEOUT_MS: u64 = 60_000;
/// How long a rollback waits for a failed node by default.
pub const DEFAULT_RESPAWN_TIMEOUT_MS: u64 = 60_000;

/// This node's ranks of one job.
#[derive(Debug, Default)]
struct LocalJob {
    /// The start they belong to.
    attempt: u32,
    /// Running ranks: rank → pid.
    running: BTreeMap<u32, u32>,
    /// Ranks that exited, with their status.
    exited: BTreeMap<u32, i32>,
    /// Ranks one of whose calls the cluster failed, and why (see [`Jobs::blame`]).
    blamed: BTreeMap<u32, String>,
    /// Safe-point calls each rank made so far (see [`Jobs::next_safe_call`]).
    safe_calls: BTreeMap<u32, u64>,
    /// Ranks a start request is starting now (it awaits other nodes before it spawns them):
    /// a second request for the same start (job control asks again when the first one's
    /// answer is late) leaves them to it.
    starting: std::collections::BTreeSet<u32>,
}

/// Gives up a start request's claim on its ranks ([`LocalJob::starting`]) however the request
/// ends.
struct Claim<'a> {
    jobs: &'a Jobs,
    job: String,
    attempt: u32,
    ranks: Vec<u32>,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if let Some(l) = lock(&self.jobs.local).get_mut(&self.job) {
            if l.attempt == self.attempt {
                for r in &self.ranks {
                    l.starting.remove(r);
                }
            }
        }
    }
}

/// Per node: the rank processes running here, their exits and their output.
#[derive(Default)]
pub struct Jobs {
    /// Ranks started here, per job (until the job's records let it go).
    local: Mutex<HashMap<String, LocalJob>>,
    /// Rank processes running here: pid → the job and the rank.
    procs: Mutex<HashMap<u32, (JobSpec, u32)>>,
    /// Parallel files the ranks running here mapped writable, per job (its last checkpoint
    /// covers them).
    written: Mutex<HashMap<String, std::collections::BTreeSet<psls_svm::FileId>>>,
    /// The ranks' output kept here (of the ranks running here, and the copies of another
    /// node's).
    output: Mutex<psls_jobs::output::Store>,
    /// Output of the ranks running here not yet copied to the buddy node.
    outbox: Mutex<Outbox>,
    /// One copy to the buddy at a time (a safe point's waits for the tick's).
    copying: tokio::sync::Mutex<()>,
    /// Output waits in the outbox: the copier sends it to the buddy.
    copy_wanted: tokio::sync::Notify,
    /// Per rank process running here (pid): its relay, asked to take in what its pipes hold.
    drains: Mutex<HashMap<u32, tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<u64>>>>,
    /// Something to report changed (a rank started or exited).
    changed: tokio::sync::Notify,
    /// The forwarded input of each job whose rank 0 runs here and reads it.
    stdin: Mutex<HashMap<String, Feed>>,
}

/// How many chunks of a rank 0's forwarded input wait for it to read them (each at most
/// `MAX_STDIN_CHUNK`): more is answered `full`.
pub const STDIN_QUEUE_CHUNKS: usize = 16;
/// A rank 0's input ends when the `psls run` forwarding it was not heard for this long
/// (killed, or its node daemon): it sends a sign of life every [`STDIN_ALIVE`].
pub const STDIN_LEASE: Duration = Duration::from_secs(10);
pub const STDIN_ALIVE: Duration = Duration::from_secs(2);

/// A rank 0's forwarded input (see `Request::Stdin`).
struct Feed {
    attempt: u32,
    /// Bytes taken so far.
    received: u64,
    /// To the task writing into rank 0's pipe; none once the input ended.
    tx: Option<tokio::sync::mpsc::Sender<bytes::Bytes>>,
    /// When the forwarder was last heard.
    heard: Arc<Mutex<Instant>>,
}

impl Jobs {
    /// The spec of `job`, if a rank of it runs here.
    pub fn local_spec(&self, job: &str) -> Option<JobSpec> {
        lock(&self.procs)
            .values()
            .find(|(s, _)| s.job == job)
            .map(|(s, _)| s.clone())
    }

    /// The job and rank of process `pid`, if it is a rank running here.
    pub fn rank_of(&self, pid: u32) -> Option<(JobSpec, u32)> {
        lock(&self.procs).get(&pid).cloned()
    }

    /// A rank of `job` here mapped parallel file `file` writable.
    pub fn note_written(&self, job: &str, file: psls_svm::FileId) {
        lock(&self.written).entry(job.to_string()).or_default().insert(file);
    }

    /// The files `job`'s ranks here mapped writable (forgotten with `forget`).
    pub fn written(&self, job: &str, forget: bool) -> Vec<psls_svm::FileId> {
        let mut w = lock(&self.written);
        let files = w.get(job).map(|s| s.iter().copied().collect()).unwrap_or_default();
        if forget {
            w.remove(job);
        }
        files
    }

    /// This node's reports of its ranks, per job.
    pub fn reports(&self) -> Vec<psls_jobs::Report> {
        lock(&self.local)
            .iter()
            .map(|(job, l)| psls_jobs::Report {
                job: job.clone(),
                attempt: l.attempt,
                running: l.running.keys().copied().collect(),
                exited: l.exited.iter().map(|(r, c)| (*r, *c)).collect(),
                blamed: l.blamed.iter().map(|(r, w)| (*r, w.clone())).collect(),
            })
            .collect()
    }

    /// The number of rank process `pid`'s next safe-point call in its start (1, 2, …; every
    /// session of the process counts), or `None` if it is not a rank here.
    pub fn next_safe_call(&self, pid: u32) -> Option<u64> {
        let (spec, rank) = self.rank_of(pid)?;
        let mut local = lock(&self.local);
        let l = local.get_mut(&spec.job).filter(|l| l.attempt == spec.attempt)?;
        let n = l.safe_calls.entry(rank).or_insert(0);
        *n += 1;
        Some(*n)
    }

    /// The cluster failed a call of rank process `pid` (a barrier, a lock or a safe point
    /// across a change of coordinator) for `why`, and the rank is told so now: if it exits
    /// for it, job control rolls the job back instead of failing it. Called before the rank
    /// gets the error. Nothing for a process that is not a rank here.
    pub fn blame(&self, pid: u32, why: &str) {
        let Some((spec, rank)) = self.rank_of(pid) else { return };
        let mut local = lock(&self.local);
        if let Some(l) = local.get_mut(&spec.job).filter(|l| l.attempt == spec.attempt) {
            if let std::collections::btree_map::Entry::Vacant(e) = l.blamed.entry(rank) {
                // Clipped: reports carry it.
                let why: String = why.chars().take(200).collect();
                tracing::info!(job = %spec.job, attempt = spec.attempt, rank, why, "a rank's call failed by the cluster");
                e.insert(why);
            }
        }
    }

    /// Output of `job` here after the follower's numbers (only what a second node keeps too,
    /// unless `all`).
    pub fn output_since(
        &self,
        job: &str,
        after: &BTreeMap<u32, u64>,
        all: bool,
    ) -> (Vec<psls_jobs::output::Record>, BTreeMap<u32, u64>) {
        lock(&self.output).since(job, after, all)
    }
}

/// Most bytes of output waiting for the copy to the buddy node (the oldest go first: they
/// stay kept here).
const MAX_OUTBOX_BYTES: usize = 16 << 20;
/// Most bytes of output in one copy message.
const MAX_COPY_BYTES: usize = 1 << 20;
/// Most records in one copy message.
const MAX_COPY_RECORDS: usize = 65_536;
/// How long a safe point waits for a rank's relay to take in its pipes.
const DRAIN_TIMEOUT_MS: u64 = 2000;

/// Output waiting for the copy to the buddy node, oldest first.
#[derive(Default)]
struct Outbox {
    records: std::collections::VecDeque<(String, psls_jobs::output::Record)>,
    bytes: usize,
}

impl Jobs {
    /// Keeps record `r` of `job`, produced by a rank running here, and queues it for the
    /// buddy's copy.
    fn keep(&self, job: &str, r: psls_jobs::output::Record) {
        if !lock(&self.output).push(job, r.clone()) {
            return;
        }
        let mut o = lock(&self.outbox);
        o.bytes += r.data.len();
        o.records.push_back((job.to_string(), r));
        while o.bytes > MAX_OUTBOX_BYTES {
            let Some((j, old)) = o.records.pop_front() else { break };
            o.bytes -= old.data.len();
            // Never copied: followers get it as it is, rather than never.
            lock(&self.output).mark_durable(&j, old.rank, old.seq);
        }
        self.copy_wanted.notify_one();
    }

    /// Per rank, the last output number of `job` kept here.
    pub fn output_last(&self, job: &str) -> BTreeMap<u32, u64> {
        lock(&self.output).last_all(job)
    }

    /// Keeps another node's copy of `job`'s output.
    pub fn keep_copy(&self, job: &str, records: Vec<psls_jobs::output::Record>) {
        let mut out = lock(&self.output);
        for r in records {
            out.push_copy(job, r);
        }
    }

    /// The last output line number of rank process `pid`, once its relay took in everything
    /// its pipes hold (what it wrote before its safe-point call); `None`: not known (not a
    /// rank of this node, or its relay did not answer in time).
    pub async fn output_mark(&self, pid: u32) -> Option<u64> {
        let ask = lock(&self.drains).get(&pid).cloned()?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        ask.try_send(tx).ok()?;
        tokio::time::timeout(std::time::Duration::from_millis(DRAIN_TIMEOUT_MS), rx)
            .await
            .ok()?
            .ok()
    }
}

/// Copies the output of the ranks running here to the buddy node (the next live node after
/// this one in the configuration's order), so that it outlives this node; what cannot be
/// sent waits for the next call.
pub async fn copy_output(node: &Arc<Node>, jobs: &Arc<Jobs>) {
    let _one = jobs.copying.lock().await;
    let Some(buddy) = buddy(node) else {
        // Other nodes, none reachable now: the output waits for one. This node may be cut off,
        // about to be declared down and to lose its store; a line a client printed must
        // outlive one failure (a restarted rank's lines are numbered after the kept ones: the
        // nemesis met a rank's last lines dropped as already printed, after a partition).
        if node.cfg.nodes.len() + node.cfg.spares.len() > 1 {
            return;
        }
        // No other node at all: followers get it as it is.
        let waiting: Vec<(String, psls_jobs::output::Record)> = {
            let mut o = lock(&jobs.outbox);
            o.bytes = 0;
            o.records.drain(..).collect()
        };
        let mut out = lock(&jobs.output);
        for (job, r) in waiting {
            out.mark_durable(&job, r.rank, r.seq);
        }
        return;
    };
    loop {
        let (job, batch) = {
            let mut o = lock(&jobs.outbox);
            let Some((job, _)) = o.records.front() else { return };
            let job = job.clone();
            let mut batch = Vec::new();
            let mut bytes = 0;
            while let Some((j, r)) = o.records.front() {
                if *j != job
                    || batch.len() >= MAX_COPY_RECORDS
                    || (bytes + r.data.len() > MAX_COPY_BYTES && !batch.is_empty())
                {
                    break;
                }
                bytes += r.data.len();
                let Some((_, r)) = o.records.pop_front() else { break };
                o.bytes -= r.data.len();
                batch.push(r);
            }
            (job, batch)
        };
        let req = PeerReq::OutputCopy {
            job: job.clone(),
            records: batch.iter().map(wire_record).collect(),
        };
        if let Err(e) = node.call_ok(&buddy, req).await {
            tracing::debug!(node = %node.name(), %buddy, %job, error = %e, "could not copy output to the buddy node");
            let mut o = lock(&jobs.outbox);
            for r in batch.into_iter().rev() {
                o.bytes += r.data.len();
                o.records.push_front((job.clone(), r));
            }
            return;
        }
        let mut out = lock(&jobs.output);
        for r in &batch {
            out.mark_durable(&job, r.rank, r.seq);
        }
    }
}

/// How long the copier lets output gather before it sends it to the buddy.
const COPY_GATHER_MS: u64 = 5;

/// The task that copies the output of the ranks running here to the buddy node as it comes
/// (followers print a line once a second node keeps it).
pub async fn copier(node: Arc<Node>, jobs: Arc<Jobs>) {
    loop {
        jobs.copy_wanted.notified().await;
        tokio::time::sleep(std::time::Duration::from_millis(COPY_GATHER_MS)).await;
        copy_output(&node, &jobs).await;
        // What could not be sent waits for the next line or the next tick.
    }
}

/// The node this node's ranks' output is copied to: the next live node after this one in the
/// configuration's order (nodes, then spares).
fn buddy(node: &Node) -> Option<String> {
    let names: Vec<&str> = node
        .cfg
        .nodes
        .iter()
        .chain(node.cfg.spares.iter())
        .map(|n| n.name.as_str())
        .collect();
    let me = names.iter().position(|n| *n == node.me.name)?;
    (1..names.len())
        .map(|k| names[(me + k) % names.len()])
        .find(|p| node.is_live(p))
        .map(str::to_string)
}

/// A record from the wire.
pub fn record_of(r: crate::peer::OutputRecord) -> psls_jobs::output::Record {
    psls_jobs::output::Record {
        rank: r.rank,
        seq: r.seq,
        err: r.err,
        data: r.data,
    }
}

/// A record on the wire.
pub fn wire_record(r: &psls_jobs::output::Record) -> crate::peer::OutputRecord {
    crate::peer::OutputRecord {
        rank: r.rank,
        seq: r.seq,
        err: r.err,
        data: r.data.clone(),
    }
}

static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.locked()
}

/// A new job's name: this node, its incarnation and a number (unique in the cluster).
pub fn new_job_name(node: &Node) -> String {
    format!(
        "{}-{}-{}",
        node.name(),
        node.incarnation,
        NEXT_JOB.fetch_add(1, Ordering::Relaxed)
    )
}

/// Most bytes of a job name a user chooses (`psls run --job NAME`).
pub const MAX_USER_JOB_NAME: usize = 64;

/// A job name a user chooses: 1 to [`MAX_USER_JOB_NAME`] letters, digits, `.`, `_` or `-`,
/// beginning with a letter or a digit (it names files, and comes from a command line).
pub fn check_job_name(name: &str) -> Result<(), OpError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_USER_JOB_NAME
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(OpError::new(
            ErrorKind::Invalid,
            format!(
                "job name {name:?}: 1 to {MAX_USER_JOB_NAME} letters, digits, '.', '_' or '-', beginning with a letter or a digit"
            ),
        ))
    }
}

/// Job control's command to launch a new job as `psls run` asked (its options checked here).
#[allow(clippy::too_many_arguments)]
pub fn launch_command(
    node: &Node,
    ranks: u32,
    per_node: Option<u32>,
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: String,
    uid: u32,
    gid: u32,
    checkpoint: &psls_ipc::proto::CkptOptions,
) -> Result<psls_jobs::Command, OpError> {
    if ranks == 0 || ranks > MAX_RANKS {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("-n {ranks}: a job has 1 to {MAX_RANKS} ranks"),
        ));
    }
    if per_node == Some(0) {
        return Err(OpError::new(ErrorKind::Invalid, "--per-node must be at least 1"));
    }
    let secs = |s: u64, default_ms: u64| if s == 0 { default_ms } else { s.saturating_mul(1000) };
    let level: psls_ckpt::msg::Choice = checkpoint
        .level
        .parse()
        .map_err(|e: String| OpError::new(ErrorKind::Invalid, e))?;
    let cleaning = match checkpoint.cleaning.as_str() {
        "" => node.default_cleaning(),
        p => p
            .parse::<psls_ckpt::cleaning::Policy>()
            .map_err(|e| OpError::new(ErrorKind::Invalid, e))?,
    };
    let job = if checkpoint.job.is_empty() {
        new_job_name(node)
    } else {
        check_job_name(&checkpoint.job)?;
        checkpoint.job.clone()
    };
    let spec = JobSpec {
        stdin: checkpoint.stdin,
        job,
        size: ranks,
        program,
        args,
        env,
        cwd,
        uid,
        gid,
        checkpoint_interval_ms: checkpoint.interval_s.saturating_mul(1000),
        checkpoint_timeout_ms: secs(checkpoint.timeout_s, DEFAULT_CALL_TIMEOUT_MS),
        max_restarts: checkpoint.max_restarts,
        respawn_timeout_ms: secs(checkpoint.respawn_timeout_s, DEFAULT_RESPAWN_TIMEOUT_MS),
        level,
        persistent_interval_ms: secs(
            checkpoint.persistent_interval_s,
            node.cfg.cluster.persistent_interval_s.saturating_mul(1000),
        ),
        persistent_every: checkpoint.persistent_every,
        cleaning,
        prefetch: checkpoint.prefetch,
        attempt: 0,
        restart_epoch: 0,
    };
    Ok(psls_jobs::Command::Launch {
        job: spec.job.clone(),
        spec: Box::new(summary(&spec, per_node, 1)),
        options: Box::new(options(&spec)),
        env: spec.env.clone(),
        hosts: checkpoint.nodes.clone(),
        stdin: checkpoint.stdin,
    })
}

/// What a job's record keeps of `spec`.
pub fn summary(spec: &JobSpec, per_node: Option<u32>, starts: u32) -> psls_pfs::jobs::JobSummary {
    psls_pfs::jobs::JobSummary {
        program: spec.program.clone(),
        args: spec.args.clone(),
        ranks: spec.size,
        per_node,
        cwd: spec.cwd.clone(),
        uid: spec.uid,
        gid: spec.gid,
        checkpoint_interval_ms: spec.checkpoint_interval_ms,
        checkpoint_timeout_ms: spec.checkpoint_timeout_ms,
        max_restarts: spec.max_restarts,
        respawn_timeout_ms: spec.respawn_timeout_ms,
        launcher: String::new(),
        started_unix_ms: crate::pfs::unix_ms(),
        starts,
    }
}

/// How `spec` checkpoints, as the job's record keeps it.
pub fn options(spec: &JobSpec) -> psls_pfs::jobs::JobOptions {
    psls_pfs::jobs::JobOptions {
        level: spec.level.to_string(),
        persistent_interval_ms: spec.persistent_interval_ms,
        persistent_every: spec.persistent_every,
        cleaning: spec.cleaning.to_string(),
        prefetch: spec.prefetch,
    }
}

/// Sets `spec`'s checkpoint options to those a job's record kept; a word that does not parse
/// (a record from a later version) keeps the default, with a warning.
pub fn restore_options(node: &Node, spec: &mut JobSpec, o: &psls_pfs::jobs::JobOptions) {
    match o.level.parse() {
        Ok(level) => spec.level = level,
        Err(e) => {
            tracing::warn!(node = %node.name(), job = %spec.job, error = %e, "the job's record names an unknown level: auto")
        }
    }
    match o.cleaning.parse() {
        Ok(policy) => spec.cleaning = policy,
        Err(e) => {
            tracing::warn!(node = %node.name(), job = %spec.job, error = %e, "the job's record names an unknown cleaning policy: the cluster's")
        }
    }
    spec.persistent_interval_ms = o.persistent_interval_ms;
    spec.persistent_every = o.persistent_every;
    spec.prefetch = o.prefetch;
}

/// Most volatile segments forgotten in one message.
pub const MAX_JOB_SEGMENTS: usize = 4096;

/// Every node drops `job`'s volatile segments: first where they are held, then the coherence
/// state of their managers.
pub async fn drop_job_segments(node: &Arc<Node>, job: &str) {
    let job = job.to_string();
    {
        let st = node.meta_state();
        let live: Vec<String> = node
            .logical_map(&st)
            .into_values()
            .filter(|p| node.is_live(p))
            .collect();
        let mut files = Vec::new();
        for p in &live {
            match node.call_ok(p, PeerReq::JobEnded { job: job.clone() }).await {
                Ok(PeerResp::Dropped { files: f }) => files.extend(f),
                Ok(_) => {}
                Err(e) => tracing::warn!(node = %p, %job, error = %e, "could not drop the job's volatile segments"),
            }
        }
        files.sort_unstable();
        files.dedup();
        if files.is_empty() {
            return;
        }
        for chunk in files.chunks(MAX_JOB_SEGMENTS) {
            for p in &live {
                let req = PeerReq::ForgetFiles { files: chunk.to_vec() };
                if let Err(e) = node.call_ok(p, req).await {
                    tracing::warn!(node = %p, %job, error = %e, "could not forget the job's volatile segments");
                }
            }
        }
    }
}

/// The parallel files `job`'s ranks mapped writable, over every live node.
pub async fn job_files(node: &Arc<Node>, job: &str, forget: bool) -> Vec<psls_svm::FileId> {
    let st = node.meta_state();
    let mut files = Vec::new();
    for (_, phys) in node.logical_map(&st) {
        if !node.is_live(&phys) {
            continue;
        }
        let req = PeerReq::JobFiles {
            job: job.to_string(),
            forget,
        };
        match node.call_ok(&phys, req).await {
            Ok(PeerResp::JobFiles { files: f }) => files.extend(f),
            Ok(_) => {}
            Err(e) => tracing::warn!(node = %phys, job, error = %e, "could not learn the job's files"),
        }
    }
    files.sort_unstable();
    files.dedup();
    files
}

/// Every rank process running here (of every job).
pub fn local_ranks(jobs: &Jobs) -> Vec<u32> {
    lock(&jobs.local)
        .values()
        .flat_map(|l| l.running.values().copied())
        .collect()
}

/// Kills this node's ranks of `job` of start `attempt` or before (and their children).
pub fn stop_ranks(jobs: &Jobs, job: &str, attempt: u32) {
    // Every started rank is in the table of processes from its fork on (a start's table of
    // running ranks is replaced when a newer start begins, and a rank forked meanwhile is only
    // in the table of processes).
    let mut pids: BTreeSet<u32> = lock(&jobs.procs)
        .iter()
        .filter(|(_, (spec, _))| spec.job == job && spec.attempt <= attempt)
        .map(|(pid, _)| *pid)
        .collect();
    if let Some(l) = lock(&jobs.local).get(job).filter(|l| l.attempt <= attempt) {
        pids.extend(l.running.values().copied());
    }
    for pid in pids {
        // The whole process group of the rank; its relay reports the exit.
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Kills this node's ranks of `job`, of any start.
pub fn kill_local(jobs: &Jobs, job: &str) {
    stop_ranks(jobs, job, u32::MAX);
}

/// Starts this node's ranks of start `attempt` of `job`, as this node's records say once it
/// caught up with the leader: the program, user, folder and environment of the job's record,
/// the ranks its start placed on this node's logical id — if the start names this node's
/// incarnation. Idempotent: ranks of that start started here already are not started again;
/// ranks of an older start here are stopped first.
pub async fn start_ranks(node: &Arc<Node>, jobs: &Arc<Jobs>, job: &str, attempt: u32) -> Result<(), OpError> {
    let st = node.meta_fresh().await?;
    let refuse = |m: String| OpError::new(ErrorKind::Permission, m);
    let logical = node.my_logical(&st).map(|l| l.0);
    let mine =
        psls_jobs::local::ranks_here(&st, job, attempt, logical, &node.me.name, node.incarnation).map_err(refuse)?;
    let (Some(run), Some(sum)) = (st.runs.get(job), st.jobs.get(job).and_then(|r| r.spec.clone())) else {
        return Err(refuse(format!("job {job} is not running")));
    };
    let older = lock(&jobs.local).get(job).is_some_and(|l| l.attempt < attempt);
    let todo: Vec<u32> = {
        let mut local = lock(&jobs.local);
        let l = local.entry(job.to_string()).or_default();
        if l.attempt < attempt {
            *l = LocalJob {
                attempt,
                ..LocalJob::default()
            };
        }
        let todo: Vec<u32> = mine
            .iter()
            .copied()
            .filter(|r| !l.running.contains_key(r) && !l.exited.contains_key(r) && !l.starting.contains(r))
            .collect();
        l.starting.extend(todo.iter().copied());
        todo
    };
    // The newer start is recorded here first: an older start still preparing its ranks no
    // longer forks them, and those it forked already are in the table of processes.
    if older {
        stop_ranks(jobs, job, attempt - 1);
    }
    if todo.is_empty() {
        return Ok(());
    }
    let _claim = Claim {
        jobs,
        job: job.to_string(),
        attempt,
        ranks: todo.clone(),
    };
    let options = st.job_options.get(job).cloned().unwrap_or_default();
    let mut spec = JobSpec {
        job: job.to_string(),
        size: sum.ranks,
        program: sum.program.clone(),
        args: sum.args.clone(),
        env: run.env.clone(),
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
        attempt,
        restart_epoch: run.restart_epoch,
        // Only the first start's rank 0: a restarted rank 0 cannot read its input again.
        stdin: run.stdin && attempt == 0,
    };
    restore_options(node, &mut spec, &options);
    // A restarted rank numbers the lines it prints again as they were numbered (its
    // checkpoint keeps the number of its last line), so that a follower drops them; when that
    // number is not known, above every kept line.
    let mut numbering = BTreeMap::new();
    let mut marks = BTreeMap::new();
    if attempt > 0 {
        let last = output_last(node, jobs, job).await;
        for &rank in &todo {
            let mark = match run.restart_epoch {
                0 => Some(0),
                epoch => crate::ckpt::restart_output_seq(node, job, rank, epoch)
                    .await
                    .unwrap_or_else(|e| {
                        tracing::warn!(node = %node.name(), job, rank, epoch, error = %e, "cannot read the rank's output number at its checkpoint");
                        None
                    }),
            };
            marks.insert(rank, mark);
            let n = match mark {
                Some(m) => psls_jobs::output::Numbering::replay(m, kept_lines(node, jobs, job, rank, m).await),
                None => psls_jobs::output::Numbering::after(last.get(&rank).copied().unwrap_or(0)),
            };
            numbering.insert(rank, n);
        }
    }
    crate::failpoint::pass_async(node.name(), "launch.prepared").await;
    tracing::info!(node = %node.name(), job, attempt, ranks = ?todo, ?marks, "starting ranks");
    spawn_local(node, jobs, spec, todo, numbering)?;
    jobs.changed.notify_one();
    Ok(())
}

/// Every tick: stops the ranks this node's records call stale, lets go of what the records no
/// longer name, and reports this node's ranks to job control (at the metadata's leader).
/// Returns the reports for this node's own job control, when it is the metadata leader (they
/// go to the leader otherwise).
pub async fn tick(node: &Arc<Node>, jobs: &Arc<Jobs>) -> Vec<psls_jobs::Report> {
    let st = node.meta_state();
    let local: Vec<(String, u32)> = lock(&jobs.local).iter().map(|(j, l)| (j.clone(), l.attempt)).collect();
    for (job, attempt) in &local {
        if psls_jobs::local::stale(&st, job, *attempt) {
            stop_ranks(jobs, job, *attempt);
        }
    }
    {
        // A job whose records ended it, with no rank running here, goes (its output stays a
        // while longer: followers fetch the end).
        use psls_jobs::local::{keeps_output, keeps_record};
        let mut l = lock(&jobs.local);
        l.retain(|job, lj| keeps_record(&st, job, !lj.running.is_empty()));
        lock(&jobs.stdin).retain(|job, _| l.contains_key(job));
        let mut out = lock(&jobs.output);
        for job in out.jobs() {
            if !keeps_output(&st, &job, l.contains_key(&job)) {
                out.forget(&job);
            }
        }
    }
    copy_output(node, jobs).await;
    let reports = jobs.reports();
    if reports.is_empty() {
        return Vec::new();
    }
    let Some(leader) = node.replication.leader() else {
        return Vec::new();
    };
    if leader == node.me.name {
        return reports;
    }
    let incarnation = node.incarnation;
    let _ = node.call(&leader, PeerReq::JobReport { incarnation, reports }).await;
    Vec::new()
}

/// Rank 0 of `spec` reads the forwarded input from `input`: a task writes what
/// [`feed_stdin`] queues, and closes the pipe at the input's end, when the forwarder was not
/// heard for [`STDIN_LEASE`], or when rank 0 stops reading (its pipe broke).
fn start_feed(node: &Arc<Node>, jobs: &Arc<Jobs>, spec: &JobSpec, mut input: tokio::process::ChildStdin) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(STDIN_QUEUE_CHUNKS);
    let heard = Arc::new(Mutex::new(Instant::now()));
    lock(&jobs.stdin).insert(
        spec.job.clone(),
        Feed {
            attempt: spec.attempt,
            received: 0,
            tx: Some(tx),
            heard: heard.clone(),
        },
    );
    let (node, jobs, job, attempt) = (node.clone(), jobs.clone(), spec.job.clone(), spec.attempt);
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        let why = loop {
            match tokio::time::timeout(STDIN_ALIVE, rx.recv()).await {
                Ok(Some(chunk)) => {
                    if let Err(e) = input.write_all(&chunk).await {
                        break format!("rank 0 stopped reading: {e}");
                    }
                }
                Ok(None) => break "the input ended".to_string(),
                Err(_) if lock(&heard).elapsed() > STDIN_LEASE => {
                    break format!("psls run was not heard for {} s", STDIN_LEASE.as_secs())
                }
                Err(_) => {}
            }
        };
        drop(input);
        // Later chunks are refused: the input is over for this start.
        if let Some(f) = lock(&jobs.stdin).get_mut(&job).filter(|f| f.attempt == attempt) {
            f.tx = None;
        }
        tracing::debug!(node = %node.name(), job, attempt, why, "rank 0's forwarded input closed");
    });
}

/// Queues `data`, bytes `offset..` of the input forwarded to rank 0 of start `attempt` of
/// `job` (running here); `eof`: the input ends after them. Returns the bytes taken in all and
/// whether the queue was full (the caller sends the rest again later). Bytes sent again are
/// taken once.
pub fn feed_stdin(
    jobs: &Jobs,
    job: &str,
    attempt: u32,
    offset: u64,
    data: Vec<u8>,
    eof: bool,
) -> Result<(u64, bool), OpError> {
    if data.len() > psls_ipc::proto::MAX_STDIN_CHUNK {
        return Err(OpError::new(ErrorKind::Invalid, "an input chunk over the limit"));
    }
    let mut feeds = lock(&jobs.stdin);
    let Some(f) = feeds.get_mut(job).filter(|f| f.attempt == attempt) else {
        return Err(OpError::new(
            ErrorKind::Unavailable,
            format!("rank 0 of job {job} does not run here yet"),
        ));
    };
    *lock(&f.heard) = Instant::now();
    let Some(tx) = f.tx.clone() else {
        return Err(OpError::new(
            ErrorKind::NotFound,
            format!("rank 0 of job {job} reads no more input"),
        ));
    };
    if offset > f.received {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("input from byte {offset}, but only {} came", f.received),
        ));
    }
    let skip = ((f.received - offset) as usize).min(data.len());
    if skip < data.len() {
        let len = data.len() - skip;
        let mut data = data;
        data.drain(..skip);
        match tx.try_send(bytes::Bytes::from(data)) {
            Ok(()) => f.received += len as u64,
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => return Ok((f.received, true)),
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => {
                f.tx = None;
                return Err(OpError::new(
                    ErrorKind::NotFound,
                    format!("rank 0 of job {job} reads no more input"),
                ));
            }
        }
    }
    if eof {
        // The writer drains what is queued, then closes the pipe.
        f.tx = None;
    }
    Ok((f.received, false))
}

/// Starts this node's `ranks` of a job (of start `spec.attempt`), each numbering its output
/// lines by its `numbering` (absent: from the first).
fn spawn_local(
    node: &Arc<Node>,
    jobs: &Arc<Jobs>,
    spec: JobSpec,
    ranks: Vec<u32>,
    mut numbering: BTreeMap<u32, psls_jobs::output::Numbering>,
) -> Result<(), OpError> {
    if spec.size == 0 || spec.size > MAX_RANKS || ranks.iter().any(|&r| r >= spec.size) {
        return Err(OpError::new(ErrorKind::Invalid, "bad rank numbers"));
    }
    let socket = node.cfg.socket_path(&node.me);
    let superseded = psls_jobs::local::stale(&node.meta_state(), &spec.job, spec.attempt);
    for &rank in &ranks {
        let mut cmd = tokio::process::Command::new(&spec.program);
        cmd.args(&spec.args)
            .env_clear()
            .envs(spec.env.iter().cloned())
            .env("PSLS_RANK", rank.to_string())
            .env("PSLS_SIZE", spec.size.to_string())
            .env("PSLS_JOB", &spec.job)
            .env("PSLS_SOCKET", &socket)
            .env("PSLS_NODE", node.name())
            .env("PSLS_RESTART_EPOCH", spec.restart_epoch.to_string())
            .current_dir(&spec.cwd)
            .stdin(if spec.stdin && rank == 0 {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(false)
            // Its own process group, so that stopping the rank stops its children too.
            .process_group(0);
        // A daemon running as root starts ranks as the user the job's record names.
        if node.euid == 0 && spec.uid != 0 {
            cmd.uid(spec.uid).gid(spec.gid);
        }
        // The table of ranks stays locked from before the fork until the rank is in it: a rank
        // that maps a file at once is known as its job's (looked up by pid), not taken for a
        // process of its own and refused as a writer by its own job's claim.
        let mut procs = lock(&jobs.procs);
        // A newer start (or a rollback) came while this one prepared its ranks (reading
        // their output numbers takes a while): its ranks are not started.
        let current = lock(&jobs.local)
            .get(&spec.job)
            .is_some_and(|l| l.attempt == spec.attempt)
            && !superseded;
        if !current {
            drop(procs);
            tracing::info!(node = %node.name(), job = %spec.job, attempt = spec.attempt, rank, "a newer start or a rollback came first: the rank is not started");
            continue;
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                drop(procs);
                // The rank fails at once, as a program that cannot start does (127).
                tracing::warn!(node = %node.name(), job = %spec.job, rank, error = %e, "cannot start the rank's program");
                let mut local = lock(&jobs.local);
                if let Some(l) = local.get_mut(&spec.job).filter(|l| l.attempt == spec.attempt) {
                    l.exited.insert(rank, 127);
                }
                // The folder is the usual cause on a cluster of separate hosts: it must exist,
                // at the same path, on every node that runs ranks (as under Slurm).
                let msg = if std::fs::metadata(&spec.cwd).map(|m| m.is_dir()).unwrap_or(false) {
                    format!("psls: cannot start '{}' on node {}: {e}\n", spec.program, node.name())
                } else {
                    format!(
                        "psls: cannot start '{}' on node {}: the job's folder {} is not there (the folder psls run ran in must exist on every node)\n",
                        spec.program,
                        node.name(),
                        spec.cwd
                    )
                };
                let last = lock(&jobs.output).last(&spec.job, rank);
                let seq = (psls_jobs::output::line_of(last) + 1) * psls_jobs::output::LINE_STEP;
                jobs.keep(
                    &spec.job,
                    psls_jobs::output::Record {
                        rank,
                        seq,
                        err: true,
                        data: msg.into_bytes(),
                    },
                );
                continue;
            }
        };
        if let crate::failpoint::Fire::Pause { max, release } = crate::failpoint::pass(node.name(), "launch.spawned") {
            // The rank runs and may map its files meanwhile (a test's point only: it blocks,
            // handing this worker's other tasks to the runtime).
            tokio::task::block_in_place(|| {
                let until = std::time::Instant::now() + max;
                while std::time::Instant::now() < until && !release.exists() {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            });
        }
        // Known before the wait: a reaped child has no id any more.
        let child_pid = child.id();
        if let Some(pid) = child_pid {
            if let Some(l) = lock(&jobs.local)
                .get_mut(&spec.job)
                .filter(|l| l.attempt == spec.attempt)
            {
                l.running.insert(rank, pid);
            }
            procs.insert(pid, (spec.clone(), rank));
        }
        drop(procs);
        if let Some(input) = child.stdin.take() {
            start_feed(node, jobs, &spec, input);
        }
        let (out, err) = (child.stdout.take(), child.stderr.take());
        let (ask, mut asked) = tokio::sync::mpsc::channel(4);
        if let Some(pid) = child_pid {
            lock(&jobs.drains).insert(pid, ask);
        }
        let numbering = numbering.remove(&rank).unwrap_or_default();
        let (node, jobs, spec) = (node.clone(), jobs.clone(), spec.clone());
        tokio::spawn(async move {
            // Both streams of a rank share its numbers.
            let mut relay = Relay {
                numbering,
                streams: [
                    pipe(out.map(|o| o.into_owned_fd())),
                    pipe(err.map(|e| e.into_owned_fd())),
                ],
                lines: Default::default(),
            };
            let keep = |records: Vec<psls_jobs::output::Record>| {
                for r in records {
                    jobs.keep(&spec.job, r);
                }
            };
            // The pipes to their end (the rank's output is kept before its exit is reported);
            // a safe point's ask takes in what they hold at once.
            while relay.streams.iter().any(Option::is_some) {
                tokio::select! {
                    r = readable(&relay.streams[0]) => keep(relay.take_in(0, r, rank)),
                    r = readable(&relay.streams[1]) => keep(relay.take_in(1, r, rank)),
                    Some(reply) = asked.recv() => {
                        keep(relay.drain(rank));
                        let _ = reply.send(relay.numbering.mark());
                    }
                }
            }
            keep(relay.drain(rank));
            let code = match child.wait().await {
                Ok(s) => {
                    use std::os::unix::process::ExitStatusExt;
                    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
                }
                Err(_) => LOST_STATUS,
            };
            if let Some(pid) = child_pid {
                lock(&jobs.procs).remove(&pid);
                lock(&jobs.drains).remove(&pid);
            }
            if let Some(l) = lock(&jobs.local)
                .get_mut(&spec.job)
                .filter(|l| l.attempt == spec.attempt)
            {
                l.running.remove(&rank);
                l.exited.insert(rank, code);
            }
            tracing::info!(node = %node.name(), job = %spec.job, attempt = spec.attempt, rank, code, "rank exited");
            jobs.changed.notify_one();
        });
    }
    Ok(())
}

/// A rank's pipe, read without blocking.
type Pipe = tokio::net::unix::pipe::Receiver;

fn pipe(fd: Option<std::io::Result<std::os::fd::OwnedFd>>) -> Option<Pipe> {
    Pipe::from_owned_fd(fd?.ok()?).ok()
}

/// Ready to read (never, for a closed stream).
async fn readable(p: &Option<Pipe>) -> std::io::Result<()> {
    match p {
        Some(p) => p.readable().await,
        None => std::future::pending().await,
    }
}

/// A rank's two pipes (standard output, standard error) and their numbering.
struct Relay {
    numbering: psls_jobs::output::Numbering,
    streams: [Option<Pipe>; 2],
    lines: [psls_jobs::output::Lines; 2],
}

impl Relay {
    /// Reads what stream `k` holds (it was ready, or `ready` failed); a stream at its end or
    /// broken is closed.
    fn take_in(&mut self, k: usize, ready: std::io::Result<()>, rank: u32) -> Vec<psls_jobs::output::Record> {
        let mut records = Vec::new();
        if ready.is_err() {
            self.streams[k] = None;
            return records;
        }
        let mut buf = vec![0u8; OUTPUT_CHUNK];
        while let Some(p) = &self.streams[k] {
            match p.try_read(&mut buf) {
                Ok(0) => self.streams[k] = None,
                Ok(n) => records.extend(self.lines[k].feed(rank, k == 1, &buf[..n], &mut self.numbering)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => self.streams[k] = None,
            }
        }
        records
    }

    /// Everything both pipes hold now, and what waits after their last newlines.
    fn drain(&mut self, rank: u32) -> Vec<psls_jobs::output::Record> {
        let mut records = self.take_in(0, Ok(()), rank);
        records.extend(self.take_in(1, Ok(()), rank));
        for k in 0..2 {
            records.extend(self.lines[k].flush(rank, k == 1, &mut self.numbering));
        }
        records
    }
}

/// Per rank, the last output number of `job` any live node keeps.
pub async fn output_last(node: &Arc<Node>, jobs: &Arc<Jobs>, job: &str) -> BTreeMap<u32, u64> {
    let mut last = jobs.output_last(job);
    // Asked of every live node at once: a node that does not answer (down, not yet suspected)
    // costs one request timeout, not one per such node.
    let mut asks = tokio::task::JoinSet::new();
    for p in live_peers(node) {
        let (node, req) = (node.clone(), PeerReq::OutputLast { job: job.to_string() });
        asks.spawn(async move { node.call_ok(&p, req).await });
    }
    while let Some(r) = asks.join_next().await {
        if let Ok(Ok(PeerResp::OutputLast { last: theirs })) = r {
            for (rank, seq) in theirs {
                let l = last.entry(rank).or_insert(0);
                *l = (*l).max(seq);
            }
        }
    }
    last
}

/// The lines of `job`'s rank `rank` after number `after` that any live node keeps, in order.
async fn kept_lines(
    node: &Arc<Node>,
    jobs: &Arc<Jobs>,
    job: &str,
    rank: u32,
    after: u64,
) -> Vec<psls_jobs::output::Record> {
    let mut all: BTreeMap<u64, psls_jobs::output::Record> = BTreeMap::new();
    let mut from = after;
    loop {
        let got = lock(&jobs.output).of_rank(job, rank, from);
        let Some(l) = got.last() else { break };
        from = l.seq;
        all.extend(got.into_iter().map(|r| (r.seq, r)));
    }
    for p in live_peers(node) {
        let mut from = after;
        loop {
            let req = PeerReq::OutputOf {
                job: job.to_string(),
                rank,
                after: from,
            };
            let Ok(PeerResp::Output { records, .. }) = node.call_ok(&p, req).await else {
                break;
            };
            let Some(l) = records.last() else { break };
            if l.seq <= from {
                break;
            }
            from = l.seq;
            for r in records {
                all.entry(r.seq).or_insert(psls_jobs::output::Record {
                    rank,
                    seq: r.seq,
                    err: r.err,
                    data: r.data,
                });
            }
        }
    }
    all.into_values().collect()
}

/// The other live nodes (configured nodes and spares).
fn live_peers(node: &Node) -> Vec<String> {
    node.cfg
        .all()
        .map(|n| n.name.clone())
        .filter(|p| *p != node.me.name && node.is_live(p))
        .collect()
}

/// Answers the rank nodes' peer messages.
pub async fn serve(node: &Arc<Node>, jobs: &Arc<Jobs>, req: PeerReq) -> Result<PeerResp, OpError> {
    match req {
        PeerReq::StartRanks { job, attempt } => start_ranks(node, jobs, &job, attempt).await.map(|()| PeerResp::Ok),
        PeerReq::StopRanks { job, attempt } => {
            stop_ranks(jobs, &job, attempt);
            Ok(PeerResp::Ok)
        }
        PeerReq::OutputSince { job, after, all } => {
            if after.len() > MAX_RANKS as usize {
                return Err(OpError::new(ErrorKind::Invalid, "too many ranks"));
            }
            let (records, gaps) = jobs.output_since(&job, &after.into_iter().collect(), all);
            Ok(PeerResp::Output {
                records: records.iter().map(wire_record).collect(),
                gaps: gaps.into_iter().collect(),
            })
        }
        PeerReq::OutputOf { job, rank, after } => Ok(PeerResp::Output {
            records: lock(&jobs.output)
                .of_rank(&job, rank, after)
                .iter()
                .map(wire_record)
                .collect(),
            gaps: Vec::new(),
        }),
        PeerReq::Stdin {
            job,
            attempt,
            offset,
            data,
            eof,
        } => {
            let (received, full) = feed_stdin(jobs, &job, attempt, offset, data, eof)?;
            Ok(PeerResp::StdinAck { received, full })
        }
        PeerReq::OutputLast { job } => Ok(PeerResp::OutputLast {
            last: jobs.output_last(&job).into_iter().collect(),
        }),
        PeerReq::OutputCopy { job, records } => {
            psls_pfs::jobs::validate_job(&job).map_err(OpError::from)?;
            let bytes: usize = records.iter().map(|r| r.data.len()).sum();
            if records.len() > MAX_COPY_RECORDS || bytes > MAX_COPY_BYTES || records.iter().any(|r| r.rank >= MAX_RANKS)
            {
                return Err(OpError::new(ErrorKind::Invalid, "an output copy out of bounds"));
            }
            // A copy of a job this node's records do not know (yet) waits for them.
            let known = |st: &psls_pfs::meta::MetaState| st.runs.contains_key(&job) || st.ended.contains_key(&job);
            if !known(&node.meta_state()) && !known(&node.meta_fresh().await?) {
                return Err(OpError::new(ErrorKind::NotFound, format!("no job {job}")));
            }
            jobs.keep_copy(&job, records.into_iter().map(record_of).collect());
            Ok(PeerResp::Ok)
        }
        PeerReq::JobFiles { job, forget } => Ok(PeerResp::JobFiles {
            files: jobs.written(&job, forget),
        }),
        _ => Err(OpError::new(ErrorKind::Internal, "not a rank node's request")),
    }
}
