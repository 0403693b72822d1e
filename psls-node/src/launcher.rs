//! `psls run`: jobs of ranks spread over the cluster's nodes.
//!
//! The daemon the CLI talks to is the job's *launcher*: it places the ranks on the live nodes
//! (round robin, or `per_node` consecutive ranks per node), asks each node's daemon to start
//! its ranks (so this works when nodes are separate machines), relays every rank's output to
//! the CLI, and ends the job with the first failing rank's status after stopping the others.
//! After a node failure the job is rolled back and its ranks started again (`crate::recovery`
//! does the rollback; `spawn_all` the new start, whose number `attempt` every exit carries, so
//! the exits of the ranks stopped for the rollback are told from the new ones').
//!
//! Invariants: a rank's output reaches the launcher before its exit (both are sent in order,
//! each acknowledged); once a rank fails or its node goes down, every other rank of the job is
//! killed; the CLI's answer comes only when every rank is accounted for.

use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
pub use crate::peer::JobSpec;
use crate::peer::{PeerReq, PeerResp};
use psls_ipc::ErrorKind;
use psls_pfs::meta::{MetaOp, MetaState};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::AsyncReadExt;

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

/// What the launcher tells the CLI.
#[derive(Debug)]
pub enum JobEvent {
    Output {
        rank: u32,
        err: bool,
        data: Vec<u8>,
    },
    /// A rank of start `attempt` ended.
    Exit {
        rank: u32,
        code: i32,
        attempt: u32,
    },
    /// The job halted after checkpoint `epoch` (`psls halt`): its ranks are being stopped.
    Halted {
        epoch: u64,
    },
}

/// Per node: the launcher's event channels and the local rank processes.
#[derive(Default)]
pub struct Jobs {
    /// Jobs this node launched: where their events go.
    launched: Mutex<HashMap<String, tokio::sync::mpsc::UnboundedSender<JobEvent>>>,
    /// Rank processes running here, per job.
    local: Mutex<HashMap<String, Vec<u32>>>,
    /// Rank processes running here: pid → the job and the rank.
    procs: Mutex<HashMap<u32, (JobSpec, u32)>>,
    /// Parallel files the ranks running here mapped writable, per job (its last checkpoint
    /// covers them).
    written: Mutex<HashMap<String, std::collections::BTreeSet<psls_svm::FileId>>>,
    /// What the launcher does for a job it launched, when it is not just running it (a
    /// rollback's step), and since when.
    activity: Mutex<HashMap<String, (String, std::time::Instant)>>,
}

impl Jobs {
    /// `job`'s launcher is now doing `what` (`None`: nothing special any more); whether that
    /// is new (the time counts from the change).
    pub fn set_activity(&self, job: &str, what: Option<String>) -> bool {
        let mut a = lock(&self.activity);
        match what {
            Some(w) if a.get(job).is_some_and(|(old, _)| *old == w) => false,
            Some(w) => {
                a.insert(job.to_string(), (w, std::time::Instant::now()));
                true
            }
            None => a.remove(job).is_some(),
        }
    }

    /// What `job`'s launcher does (empty: nothing special), and for how long.
    pub fn activity(&self, job: &str) -> String {
        lock(&self.activity)
            .get(job)
            .map(|(w, t)| format!("{w} (for {:.1} s)", t.elapsed().as_secs_f64()))
            .unwrap_or_default()
    }

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
}

static NEXT_JOB: AtomicU64 = AtomicU64::new(1);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.locked()
}

/// Rank → logical node: `per_node` consecutive ranks per node, else round robin.
pub fn place(ranks: u32, nodes: &[u32], per_node: Option<u32>) -> Result<Vec<u32>, String> {
    if nodes.is_empty() {
        return Err("no node is up".into());
    }
    if ranks == 0 || ranks > MAX_RANKS {
        return Err(format!("-n {ranks}: a job has 1 to {MAX_RANKS} ranks"));
    }
    match per_node {
        Some(0) => Err("--per-node must be at least 1".into()),
        Some(k) => {
            if ranks.div_ceil(k) as usize > nodes.len() {
                return Err(format!(
                    "{ranks} ranks at {k} per node need {} nodes; {} are up",
                    ranks.div_ceil(k),
                    nodes.len()
                ));
            }
            Ok((0..ranks).map(|r| nodes[(r / k) as usize]).collect())
        }
        None => Ok((0..ranks).map(|r| nodes[r as usize % nodes.len()]).collect()),
    }
}

/// Ranks per logical node.
pub type Owners = BTreeMap<u32, Vec<u32>>;

/// Starts a job from this node; its events come out of the returned channel (every rank's
/// `Exit` of each start). Returns the job's spec and where its ranks run.
#[allow(clippy::too_many_arguments)]
pub async fn launch(
    node: &Arc<Node>,
    jobs: &Arc<Jobs>,
    ranks: u32,
    per_node: Option<u32>,
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: String,
    uid: u32,
    gid: u32,
    checkpoint: psls_ipc::proto::CkptOptions,
) -> Result<(JobSpec, Owners, tokio::sync::mpsc::UnboundedReceiver<JobEvent>), OpError> {
    let job = format!(
        "{}-{}-{}",
        node.name(),
        node.incarnation,
        NEXT_JOB.fetch_add(1, Ordering::Relaxed)
    );
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
    let spec = JobSpec {
        job: job.clone(),
        launcher: node.name().to_string(),
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
    let rx = register(jobs, &job);
    // The job's record keeps what it runs (for `psls jobs` and `psls run --resume`).
    if let Err(e) = node
        .submit(MetaOp::StartJobWith {
            job: job.clone(),
            spec: Box::new(summary(&spec, per_node, 1)),
            options: Box::new(options(&spec)),
        })
        .await
    {
        lock(&jobs.launched).remove(&job);
        return Err(e);
    }
    match spawn_all(node, &spec, per_node).await {
        Ok(owners) => {
            tracing::info!(node = %node.name(), %job, ranks, nodes = owners.len(), "job started");
            Ok((spec, owners, rx))
        }
        Err(e) => {
            lock(&jobs.launched).remove(&job);
            Err(e)
        }
    }
}

/// This node follows `job`: its events come out of the returned channel.
pub fn register(jobs: &Jobs, job: &str) -> tokio::sync::mpsc::UnboundedReceiver<JobEvent> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    lock(&jobs.launched).insert(job.to_string(), tx);
    rx
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
        launcher: spec.launcher.clone(),
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

/// Whether some live node launched `job` and follows it.
pub async fn is_running(node: &Arc<Node>, job: &str) -> bool {
    running_activity(node, job).await.is_some()
}

/// Whether a live node launched `job` and runs it (`None`: no), and what that launcher is
/// doing for it (empty: nothing special).
pub async fn running_activity(node: &Arc<Node>, job: &str) -> Option<String> {
    let st = node.meta_state();
    for (_, phys) in node.logical_map(&st) {
        if !node.is_live(&phys) {
            continue;
        }
        let req = PeerReq::JobLaunched { job: job.to_string() };
        if let Ok(PeerResp::Running {
            running: true,
            activity,
        }) = node.call_ok(&phys, req).await
        {
            return Some(activity);
        }
    }
    None
}

/// Places `spec`'s ranks on the live nodes and starts them (a restart: the same way, with
/// `spec.attempt` and `spec.restart_epoch`); on a failure, stops what started.
pub async fn spawn_all(node: &Arc<Node>, spec: &JobSpec, per_node: Option<u32>) -> Result<Owners, OpError> {
    let st = node.meta_state();
    let live: Vec<u32> = node
        .logical_map(&st)
        .into_iter()
        .filter(|(_, p)| node.is_live(p))
        .map(|(l, _)| l)
        .collect();
    let placement = place(spec.size, &live, per_node).map_err(|m| OpError::new(ErrorKind::Invalid, m))?;
    let mut by_node: Owners = BTreeMap::new();
    for (r, l) in placement.iter().enumerate() {
        by_node.entry(*l).or_default().push(r as u32);
    }
    let mut started: Vec<String> = Vec::new();
    for (l, rs) in &by_node {
        let phys = node.physical_of(&st, psls_svm::NodeId(*l));
        let req = PeerReq::Spawn {
            spec: spec.clone(),
            ranks: rs.clone(),
        };
        if let Err(e) = node.call_ok(&phys, req).await {
            for p in started {
                let _ = node.call(&p, PeerReq::KillJob { job: spec.job.clone() }).await;
            }
            return Err(OpError::new(e.kind, format!("starting ranks on {phys}: {}", e.message)));
        }
        started.push(phys);
    }
    Ok(by_node)
}

/// A `Spawn` runs what the job's record in the metadata says, under the uid and gid it names
/// (set by the launcher from its caller's credentials): a peer's word alone starts nothing,
/// and no certificate makes a node root on the others.
fn check_spawn(st: &MetaState, spec: &JobSpec) -> Result<(), OpError> {
    let Some(sum) = st.jobs.get(&spec.job).and_then(|r| r.spec.as_ref()) else {
        return Err(OpError::new(
            ErrorKind::Permission,
            format!("job {} has no record: its ranks are not started", spec.job),
        ));
    };
    let same = sum.uid == spec.uid
        && sum.gid == spec.gid
        && sum.program == spec.program
        && sum.args == spec.args
        && sum.cwd == spec.cwd
        && sum.ranks == spec.size;
    if !same {
        return Err(OpError::new(
            ErrorKind::Permission,
            format!("job {}: what to start differs from the job's record", spec.job),
        ));
    }
    Ok(())
}

/// Stops every rank of `job` on every node.
pub async fn kill_everywhere(node: &Arc<Node>, job: &str) {
    let st = node.meta_state();
    for (_, phys) in node.logical_map(&st) {
        if node.is_live(&phys) {
            let _ = node.call(&phys, PeerReq::KillJob { job: job.to_string() }).await;
        }
    }
}

/// Most volatile segments forgotten in one message.
pub const MAX_JOB_SEGMENTS: usize = 4096;

/// The launcher forgets a finished job, and every node drops the job's volatile segments:
/// first where they are held, then the coherence state of their managers.
pub fn finished(node: &Arc<Node>, jobs: &Arc<Jobs>, job: &str) {
    unlaunched(jobs, job);
    let (node, job) = (node.clone(), job.to_string());
    tokio::spawn(async move { drop_job_segments(&node, &job).await });
}

/// This node no longer launches `job` (its events and activity go); what the job holds on the
/// nodes stays (a finished job's result in its memory checkpoint).
pub fn unlaunched(jobs: &Jobs, job: &str) {
    lock(&jobs.launched).remove(job);
    jobs.set_activity(job, None);
}

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

/// A rank's output or exit arrived at the launcher.
pub fn event(jobs: &Jobs, job: &str, ev: JobEvent) -> Result<(), OpError> {
    match lock(&jobs.launched).get(job) {
        Some(tx) => {
            let _ = tx.send(ev);
            Ok(())
        }
        None => Err(OpError::new(ErrorKind::NotFound, format!("no job {job} launched here"))),
    }
}

/// Every rank process running here (of every job).
pub fn local_ranks(jobs: &Jobs) -> Vec<u32> {
    lock(&jobs.local).values().flatten().copied().collect()
}

/// Kills this node's ranks of `job` (and their children).
pub fn kill_local(jobs: &Jobs, job: &str) {
    let pids = lock(&jobs.local).remove(job).unwrap_or_default();
    for pid in pids {
        // The whole process group of the rank.
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Starts this node's `ranks` of a job.
pub fn spawn_local(node: &Arc<Node>, jobs: &Arc<Jobs>, spec: JobSpec, ranks: Vec<u32>) -> Result<(), OpError> {
    if spec.size == 0 || spec.size > MAX_RANKS || ranks.iter().any(|&r| r >= spec.size) {
        return Err(OpError::new(ErrorKind::Invalid, "bad rank numbers"));
    }
    let socket = node.cfg.socket_path(&node.me);
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
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(false)
            // Its own process group, so that stopping the rank stops its children too.
            .process_group(0);
        // A daemon running as root starts ranks as the user who asked.
        if node.euid == 0 && spec.uid != 0 {
            cmd.uid(spec.uid).gid(spec.gid);
        }
        // The table of ranks stays locked from before the fork until the rank is in it: a rank
        // that maps a file at once is known as its job's (looked up by pid), not taken for a
        // process of its own and refused as a writer by its own job's claim.
        let mut procs = lock(&jobs.procs);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                drop(procs);
                kill_local(jobs, &spec.job);
                return Err(OpError::new(
                    ErrorKind::Invalid,
                    format!("cannot start '{}': {e}", spec.program),
                ));
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
        if let Some(pid) = child.id() {
            lock(&jobs.local).entry(spec.job.clone()).or_default().push(pid);
            procs.insert(pid, (spec.clone(), rank));
        }
        drop(procs);
        let (out, err) = (child.stdout.take(), child.stderr.take());
        let (node, jobs, spec) = (node.clone(), jobs.clone(), spec.clone());
        // Known before the wait: a reaped child has no id any more.
        let child_pid = child.id();
        tokio::spawn(async move {
            let relay = |stream: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>>, is_err: bool| {
                let (node, spec) = (node.clone(), spec.clone());
                async move {
                    let Some(mut s) = stream else { return };
                    let mut buf = vec![0u8; OUTPUT_CHUNK];
                    loop {
                        let n = match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let req = PeerReq::RankOutput {
                            job: spec.job.clone(),
                            rank,
                            err: is_err,
                            data: buf[..n].to_vec(),
                        };
                        let _ = node.call(&spec.launcher, req).await;
                    }
                }
            };
            let out: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>> = out.map(|o| Box::new(o) as _);
            let err: Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>> = err.map(|e| Box::new(e) as _);
            tokio::join!(relay(out, false), relay(err, true));
            let code = match child.wait().await {
                Ok(s) => {
                    use std::os::unix::process::ExitStatusExt;
                    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
                }
                Err(_) => LOST_STATUS,
            };
            if let Some(pid) = child_pid {
                if let Some(pids) = lock(&jobs.local).get_mut(&spec.job) {
                    pids.retain(|p| *p != pid);
                }
                lock(&jobs.procs).remove(&pid);
            }
            let req = PeerReq::RankExit {
                job: spec.job.clone(),
                rank,
                code,
                attempt: spec.attempt,
            };
            if let Err(e) = node.call(&spec.launcher, req).await {
                tracing::warn!(node = %node.name(), job = %spec.job, rank, error = %e, "could not report a rank's exit");
            }
        });
    }
    Ok(())
}

/// Answers the launcher-related peer messages.
pub async fn serve(node: &Arc<Node>, jobs: &Arc<Jobs>, req: PeerReq) -> Result<PeerResp, OpError> {
    match req {
        PeerReq::Spawn { spec, ranks } => {
            // The launcher recorded the job just before: a node that has not applied the record
            // yet catches up to the leader's read index and looks again.
            if check_spawn(&node.meta_state(), &spec).is_err() {
                check_spawn(&node.meta_fresh().await?, &spec)?;
            }
            spawn_local(node, jobs, spec, ranks).map(|()| PeerResp::Ok)
        }
        PeerReq::RankOutput { job, rank, err, data } => {
            event(jobs, &job, JobEvent::Output { rank, err, data }).map(|()| PeerResp::Ok)
        }
        PeerReq::RankExit {
            job,
            rank,
            code,
            attempt,
        } => event(jobs, &job, JobEvent::Exit { rank, code, attempt }).map(|()| PeerResp::Ok),
        PeerReq::KillJob { job } => {
            kill_local(jobs, &job);
            Ok(PeerResp::Ok)
        }
        PeerReq::JobHalted { job, epoch } => event(jobs, &job, JobEvent::Halted { epoch }).map(|()| PeerResp::Ok),
        PeerReq::JobLaunched { job } => Ok(PeerResp::Running {
            running: lock(&jobs.launched).contains_key(&job),
            activity: jobs.activity(&job),
        }),
        PeerReq::JobFiles { job, forget } => Ok(PeerResp::JobFiles {
            files: jobs.written(&job, forget),
        }),
        _ => Err(OpError::new(ErrorKind::Internal, "not a launcher request")),
    }
}

#[cfg(test)]
mod tests {
    use super::place;

    #[test]
    fn placement_round_robin_and_per_node() {
        assert_eq!(place(6, &[0, 1, 2, 3], None).unwrap(), vec![0, 1, 2, 3, 0, 1]);
        assert_eq!(place(5, &[0, 2, 3], Some(2)).unwrap(), vec![0, 0, 2, 2, 3]);
        assert!(place(7, &[0, 1, 2], Some(2)).unwrap_err().contains("need 4 nodes"));
        assert!(place(0, &[0], None).is_err());
        assert!(place(1, &[], None).is_err());
    }
}
