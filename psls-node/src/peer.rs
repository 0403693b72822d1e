//! Messages between node daemons: the wire types at the bottom of the daemon (this module
//! imports nothing of `psls-node`). One request and one response per QUIC bidirectional stream;
//! each body is postcard, bounded by [`MAX_PEER_MSG`].

use psls_pfs::meta::MetaOp;
use psls_pfs::Role;
use psls_svm::FileId;
use serde::{Deserialize, Serialize};

/// Why a message to a peer (request or one-way) failed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("unknown peer {0}")]
    UnknownPeer(String),
    #[error("cannot reach {peer}: {message}")]
    Unreachable { peer: String, message: String },
    #[error("request to {peer} timed out after {ms} ms")]
    Timeout { peer: String, ms: u64 },
    #[error("bad response from {peer}: {message}")]
    BadResponse { peer: String, message: String },
}

/// Largest accepted peer message body.
pub const MAX_PEER_MSG: usize = 8 * 1024 * 1024;
/// At most this many coherence messages travel in one [`PeerReq::SvmBatch`].
pub const MAX_SVM_BATCH: usize = 64;
/// Pages per write/read batch (1 MiB of data).
pub const BATCH_PAGES: usize = 256;

/// Buffers for page batches (sent or received), reused: one batch and its message header fit.
/// At most 32 (about 33 MiB) are kept free.
pub fn batch_pool() -> &'static std::sync::Arc<psls_pfs::BufPool> {
    static POOL: std::sync::OnceLock<std::sync::Arc<psls_pfs::BufPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| psls_pfs::BufPool::new((BATCH_PAGES + 2) * psls_svm::PAGE_SIZE, 32))
}

/// One record of a rank's output on the wire.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct OutputRecord {
    pub rank: u32,
    pub seq: u64,
    pub err: bool,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

/// What a job description holds (sent to every node that runs ranks of the job).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct JobSpec {
    pub job: String,
    pub size: u32,
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// Safe-point calls take a checkpoint this often (0: every call).
    pub checkpoint_interval_ms: u64,
    /// A safe-point call not made by every rank within this fails.
    pub checkpoint_timeout_ms: u64,
    /// How many times the job may be rolled back and restarted after a failure.
    pub max_restarts: u32,
    /// How long a rollback waits for a failed node to come back.
    pub respawn_timeout_ms: u64,
    /// Which level safe points take, how often the cleaner comes with `Auto`, and what stays
    /// in memory after it.
    pub level: psls_ckpt::msg::Choice,
    pub persistent_interval_ms: u64,
    /// With `Auto`, every this many-th checkpoint is a cleaner (0: by the interval only).
    pub persistent_every: u32,
    pub cleaning: psls_ckpt::cleaning::Policy,
    /// After a rollback, the pages each node held active are loaded again before the ranks
    /// restart (as many as the cleaning policy keeps in memory).
    pub prefetch: bool,
    /// Which start of the job this is (0: the first; each restart after a failure adds one).
    pub attempt: u32,
    /// The checkpoint the ranks restart from (0: a fresh start).
    pub restart_epoch: u64,
    /// Rank 0 reads the input `psls run` forwards (`crate::launcher::feed_stdin`).
    pub stdin: bool,
}

/// A job's last checkpoint, as its coordinator saw it commit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastCkpt {
    pub epoch: u64,
    /// `memory` or `persistent`.
    pub level: String,
    pub pages: u64,
    pub bytes: u64,
    /// From the last rank's call (a round not from a safe point: the round's start) until
    /// the ranks went on (every participant took its pages; else: until its commit).
    pub pause_us: u64,
    /// From the round's start to its commit.
    pub commit_us: u64,
    pub at_unix_ms: u64,
}

/// One rank's safe-point call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SafeCall {
    pub job: String,
    pub rank: u32,
    /// Which start of the job (0, then one more per restart after a rollback).
    pub attempt: u32,
    /// Ranks in the job.
    pub size: u32,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub level: psls_ckpt::msg::Choice,
    pub persistent_interval_ms: u64,
    /// With `Auto`, every this many-th checkpoint is a cleaner (0: by the interval only).
    pub persistent_every: u32,
    pub cleaning: psls_ckpt::cleaning::Policy,
    /// The files the rank maps writable.
    pub files: Vec<FileId>,
    /// The job's owner (its checkpoint area is theirs).
    pub uid: u32,
    pub gid: u32,
    /// The job's launcher (told when a halt stops the job).
    pub launcher: String,
    /// The incarnation of the rank's node (set by that node): a checkpoint round must hear
    /// from the same one.
    pub node_inc: u64,
    /// The rank's session on its node (unique there for the node's incarnation).
    pub session: u64,
    /// The call's number in the rank's start (1, 2, …; counted by the rank's node): every
    /// rank of one decision makes the same one, and a call made again (its answer lost) keeps
    /// its number.
    pub seq: u64,
    /// The rank's node made this call before (to this or an earlier coordinator): a call out
    /// of step with the others' is then the cluster's failure, not the program's.
    pub resent: bool,
}

/// Which call a [`SafeCall`] is: its start, its rank's node incarnation and session, and its
/// number there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallId {
    pub attempt: u32,
    pub node_inc: u64,
    pub session: u64,
    pub seq: u64,
}

impl SafeCall {
    pub fn id(&self) -> CallId {
        CallId {
            attempt: self.attempt,
            node_inc: self.node_inc,
            session: self.session,
            seq: self.seq,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Heartbeat {
    pub incarnation: u64,
    pub pid: u32,
    /// The last index of the sender's metadata log (0: it never held an entry).
    pub meta_seq: u64,
    /// The sender's metadata log: its term, commit and applied indexes.
    pub meta_log: (u64, u64, u64),
    pub memory_used_bytes: u64,
    pub memory_capacity_bytes: u64,
    pub disk_used_bytes: u64,
    pub disk_free_bytes: u64,
    pub rebuild: Option<(u64, u64)>,
    /// Segments this node holds in shared virtual memory (a restarting node must not trust
    /// an empty directory while others hold pages).
    pub svm_segments: u64,
    /// Per logical node, the incarnation this node's coherence state knows it by (0: none).
    pub svm_view: Vec<u64>,
    /// Per logical node, the incarnation this node saw it come back as while it held
    /// coherence state (0: none): that incarnation must start fenced.
    pub svm_fenced: Vec<u64>,
    /// The recovery area's frames, by category (memory checkpoints).
    pub frames: psls_ckpt::frames::FrameCounts,
    /// The recovery area's capacity, in frames.
    pub frame_capacity: u64,
    /// Pages held here modified since the last checkpoint took them (a memory checkpoint
    /// needs a frame for each on two nodes).
    pub dirty_pages: u64,
    /// The committed down verdicts the sender knows (physical → highest incarnation declared
    /// down): a node that finds itself there fences itself.
    pub down: Vec<(String, u64)>,
    /// The incarnation the sender last heard of every peer (the coordinator declares down the
    /// newest incarnation anyone heard).
    pub heard: Vec<(String, u64)>,
    /// Why this node's page store failed (a failed fsync poisons it), if it did.
    pub disk_failed: Option<String>,
    /// Whether the sender claims or leads a metadata epoch in this life (no other node claims
    /// against a claimer it hears).
    pub claims: bool,
    /// The sender's metadata store was created in this life and has not caught up since: the
    /// leader does not make it a voter.
    pub meta_lost_disk: bool,
}

/// State of one page of a `ReadPages` answer; its bytes are in the payload at `i * 4096`
/// (zeros unless `Ok`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum PageState {
    Ok,
    Missing,
    Stale(u64),
    Corrupt,
    Error(String),
}

impl PageState {
    /// The copy was read and found bad (as opposed to: could not be read at all).
    pub fn is_bad_copy(&self) -> bool {
        matches!(self, PageState::Missing | PageState::Stale(_) | PageState::Corrupt)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct BadCopy {
    pub file: FileId,
    pub role: Role,
    pub index: u64,
}

/// Which generation a `WritePages` writes, and which slot it spares.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum WriteGen {
    /// A new version `gen` of every page (an import, a checkpoint), into the slot that does
    /// not hold the page's committed version — as the storing node's metadata says, once it
    /// has reached sequence `seq` (a file it does not know has none).
    New { gen: u64, seq: u64 },
    /// A cleaner round's flush of recovery copies: as `New`, but these are the copies this
    /// node's recovery area holds, not newer versions of them (they supersede nothing there).
    Flush { gen: u64, seq: u64 },
    /// A rewrite of each page's committed version in place (a repair, a rebuild): page `i` at
    /// generation `gens[i]`.
    Same { gens: Vec<u64> },
}

/// Requests on a node's recovery area (`crate::frames`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum FramesReq {
    /// Keep pre-recovery copies of `indices` of `file` for memory epoch `epoch` of `job`
    /// (payload: the pages, page i at `i * 4096`).
    Store {
        job: String,
        epoch: u64,
        /// The job's last committed epoch when the round began: a pre-recovery copy of an
        /// earlier epoch whose decision has not arrived here yet is settled by it.
        committed: u64,
        file: FileId,
        role: Role,
        indices: Vec<u64>,
    },
    /// Memory epoch `epoch` of `job` keeps the mirror copies of `indices` of `file` on their
    /// writer (the sender): the copies this node holds as their mirror holder go when it
    /// commits.
    Moved {
        job: String,
        epoch: u64,
        committed: u64,
        file: FileId,
        indices: Vec<u64>,
    },
    /// The committed recovery copy of a page for a load of `job`, if held (answered with
    /// `Frame`): another job's copies are not served.
    Read { job: String, file: FileId, index: u64 },
    /// The job's memory-checkpoint state here (answered with `MemState`).
    State { job: String },
    /// A rollback of `job` to memory epoch `target` (0: its persistent checkpoint), every
    /// epoch up to `fenced` fenced, `persistent` its persistent checkpoint; with a memory
    /// epoch, loads of `files` look for recovery copies first.
    Settle {
        job: String,
        target: u64,
        fenced: u64,
        persistent: u64,
        files: Vec<FileId>,
    },
    /// Send every recovery copy of `job`'s memory checkpoint `target` held here whose other
    /// copy was on one of the logical ids `lost` (restarted or replaced) there (answered with
    /// `Recreated`; refused by a node that does not hold `target`).
    Recreate { job: String, target: u64, lost: Vec<u32> },
    /// Every holder re-created this node's copies of `job`'s memory checkpoint `committed`: it
    /// is committed here (until then a restore cut short finds this node lost again).
    Adopt { job: String, committed: u64 },
    /// Recovery copies re-created from their other copy, on the sender (payload: their pages,
    /// in order); where each stands here follows from who sends it.
    Install {
        job: String,
        file: FileId,
        role: Role,
        /// Per page: index, epoch, saved.
        pages: Vec<(u64, u64, bool)>,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PeerReq {
    Heartbeat(Heartbeat),
    /// Payload: the pages' bytes, page i at `i * 4096`.
    WritePages {
        file: FileId,
        role: Role,
        gen: WriteGen,
        indices: Vec<u64>,
    },
    Sync,
    /// Page `indices[i]` at its committed generation `gens[i]`.
    ReadPages {
        file: FileId,
        role: Role,
        indices: Vec<u64>,
        gens: Vec<u64>,
    },
    RemoveFile {
        file: FileId,
    },
    /// Check every local copy of these files (at the generations this node's metadata says,
    /// once it has reached sequence `seq`).
    ScrubLocal {
        files: Vec<FileId>,
        seq: u64,
    },
    MetaSubmit {
        op: MetaOp,
    },
    /// A message of the metadata log (one-way, on the message link): `psls_cluster::log`'s wire
    /// encoding.
    MetaLog(Vec<u8>),
    /// A chunk of the metadata snapshot the receiver offered last (answered with
    /// `MetaSnapshotChunk` and the bytes as payload).
    MetaSnapshotChunk {
        index: u64,
        term: u64,
        offset: u64,
    },
    /// Job `job` ended: drop its volatile segments (answered with `Dropped`).
    JobEnded {
        job: String,
    },
    /// Forget the coherence state of these volatile segments (of ended jobs).
    ForgetFiles {
        files: Vec<FileId>,
    },
    /// How many client mappings of (removed) file `file` this node serves (`Mappings`).
    CountMappings {
        file: FileId,
    },
    /// Nobody maps removed file `file` any more: drop its segment and coherence state.
    DropRemoved {
        file: FileId,
    },
    /// From logical node `manager`, restarted as `incarnation`: may it serve `file` from the
    /// disks as if nobody held any of it (`Fence`; see `Svm::fence_answer`)?
    FenceAsk {
        manager: u32,
        incarnation: u64,
        file: FileId,
    },
    /// A coherence protocol message (one-way); payload: the page's 4096 bytes for `Data`.
    Svm(psls_svm::coherence::Envelope),
    /// Coherence messages to one node that became ready together, handled in this order (at
    /// most [`MAX_SVM_BATCH`]); payload: the pages of their `Data` messages, in order.
    SvmBatch(Vec<psls_svm::coherence::Envelope>),
    /// A checkpoint protocol message (one-way, on the message link).
    Ckpt(psls_ckpt::Msg),
    /// Memory checkpoints' recovery copies (this node is the pages' `role` holder).
    Frames(FramesReq),
    /// To the coordinator: take a checkpoint of `job` over `files` now at `level` (answered
    /// with `CkptDone` once it committed, or an error).
    CkptRun {
        job: String,
        files: Vec<FileId>,
        level: psls_ckpt::msg::Level,
    },
    /// To the coordinator: a rank made its safe-point call (answered with `SafeDone` once
    /// every rank of its job did and the decision was carried out).
    CkptArrive(SafeCall),
    /// To the coordinator: a checkpoint at `job`'s next safe-point call (`halt`: then stop).
    CkptForce {
        job: String,
        halt: bool,
        /// Who asks (the job's owner or root).
        uid: u32,
    },
    /// To the coordinator: `job` is over; forget its safe-point calls.
    CkptEnd {
        job: String,
    },
    /// To the coordinator: what `job`'s checkpoint in progress is doing (answered with
    /// `Activity`).
    CkptProgress {
        job: String,
    },
    /// To the coordinator's job control: the job's halt checkpoint `epoch` committed.
    JobHalted {
        job: String,
        epoch: u64,
    },
    /// To the metadata's leader: a job-control command (answered with `JobAnswer`).
    JobCommand {
        cmd: psls_jobs::Command,
    },
    /// To the metadata's leader: what job control does for `job` (answered with
    /// `JobActivity`; empty: nothing but running it).
    JobActivity {
        job: String,
    },
    /// The parallel files `job`'s ranks on this node mapped writable (`forget`: then forget
    /// them); answered with `JobFiles`.
    JobFiles {
        job: String,
        forget: bool,
    },
    /// To the coordinator: rank `who` waits at barrier `key` of `count` ranks (answered when it
    /// opens).
    BarrierArrive {
        key: String,
        count: u32,
        who: String,
        /// The call's id on the rank's node (its notice names it; 0 until registered).
        call: u64,
    },
    /// To the coordinator: answered when `who` holds lock `key`.
    LockAcquire {
        key: String,
        who: String,
        call: u64,
    },
    LockRelease {
        key: String,
        who: String,
        call: u64,
    },
    /// To the coordinator: rank `who` exited.
    SyncGone {
        who: String,
    },
    /// From the coordinator (one-way): rank `who` of this node, waiting on `key`, may go on
    /// (or fails with `error`).
    SyncDone {
        key: String,
        who: String,
        /// The call this answers (a notice for an earlier call, given up, answers nothing).
        call: u64,
        error: Option<(psls_ipc::ErrorKind, String)>,
        /// The error is the cluster's (`SyncError::Moved`): the node the call went to no
        /// longer coordinates.
        moved: bool,
    },
    /// From job control: start this node's ranks of start `attempt` of `job`, as this node's
    /// own records say (idempotent).
    StartRanks {
        job: String,
        attempt: u32,
    },
    /// To a follower: the output of `job`'s ranks here after these numbers (rank → the last
    /// number the follower has); answered with `Output`.
    OutputSince {
        job: String,
        after: Vec<(u32, u64)>,
        /// Lines kept here alone too (the job ended), not only those kept on two nodes.
        all: bool,
    },
    /// To a restarted rank's node: the output of `job`'s rank `rank` kept here after number
    /// `after` (answered with `Output`, at most `psls_jobs::output::MAX_FETCH_BYTES`).
    OutputOf {
        job: String,
        rank: u32,
        after: u64,
    },
    /// To rank 0's node: bytes of `psls run`'s input for rank 0 of start `attempt` of `job`
    /// (see `Request::Stdin`; answered with `StdinAck`).
    Stdin {
        job: String,
        attempt: u32,
        offset: u64,
        data: Vec<u8>,
        eof: bool,
    },
    /// To a follower: per rank, the last output number of `job` kept here (answered with
    /// `OutputLast`).
    OutputLast {
        job: String,
    },
    /// From a rank node to its buddy: a copy of its ranks' output of `job`, kept there too so
    /// that it outlives the rank node (answered with `Ok`).
    OutputCopy {
        job: String,
        records: Vec<OutputRecord>,
    },
    /// To job control: this node's (incarnation `incarnation`) ranks of each job.
    JobReport {
        incarnation: u64,
        reports: Vec<psls_jobs::Report>,
    },
    /// Rollback of `job`: stop its ranks here and drop every copy of `files` and of the job's
    /// volatile segments (answered with `Dropped`: the volatile segments' ids).
    RollbackDrop {
        job: String,
        files: Vec<FileId>,
    },
    /// After every node dropped them: these files' directories are rebuilt (a restarted node
    /// serves their pages again).
    RollbackServe {
        files: Vec<FileId>,
    },
    /// After `RollbackServe` everywhere: load again the pages of `job` held here when they
    /// were dropped, at most `limit` (answered with `Prefetched`).
    RollbackPrefetch {
        job: String,
        limit: Option<u64>,
    },
    /// To the coordinator: `job` rolls back; fence every epoch begun, and at least
    /// `at_least` (the highest epoch a node saw: a memory epoch of an earlier coordinator),
    /// and answer with the committed one (`Restart`).
    CkptRollback {
        job: String,
        at_least: u64,
    },
    /// Kill this node's ranks of `job` of start `attempt` or before.
    StopRanks {
        job: String,
        attempt: u32,
    },
    /// Answered with the payload it carries (transport round-trip measurements).
    Echo,
    /// Message link round-trip measurement: answered by a `LinkPong` with the same id and
    /// payload, posted back.
    LinkPing {
        id: u64,
    },
    LinkPong {
        id: u64,
    },
    /// To a new coordinator, before any call: the locks this node's ranks hold (key, rank).
    SyncReport {
        held: Vec<(String, String)>,
    },
    /// From a coordinator that waits for this node's report: send it (again).
    SyncReportAsk,
    /// Measure this node's free disk space now (not as of its last heartbeat): answered with
    /// `DiskFree`.
    DiskFree,
    /// What this node's shared memory holds, and knows of logical node `logical` (the asker,
    /// restarted): answered with `SvmHeld`.
    SvmHeld {
        logical: u32,
    },
    /// To the metadata leader, from a watcher: its watched peers silent past the failure
    /// timeout (each with the incarnation heard), and those it reported and hears again.
    Watch {
        silent: Vec<(String, u64)>,
        back: Vec<String>,
    },
    /// To the metadata leader: this node's figures (when they changed, or now and then).
    Figures(Heartbeat),
    /// To the metadata leader: its table of every node's latest figures (`FiguresTable`).
    FiguresAsk,
    /// A heartbeat as a one-way message on the link, to a watched peer every interval (the
    /// peer's own beats are the answer; a peer that does not watch the sender answers with a
    /// `BeatBack`).
    Beat(Heartbeat),
    /// The answer to a `Beat` from a peer this node does not watch: never answered (two
    /// nodes that watch each other no longer would otherwise answer each other forever).
    BeatBack(Heartbeat),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PeerResp {
    Ok,
    /// Answer to `WritePages` and `Sync`: the incarnation that took the writes. Writes not yet
    /// synced die with an incarnation, so a writer checks that the one that synced is the one
    /// that was written to.
    Stored {
        incarnation: u64,
    },
    HeartbeatAck(Heartbeat),
    /// Payload: the pages' bytes, page i at `i * 4096`.
    Pages(Vec<PageState>),
    Scrub {
        checked: u64,
        bad: Vec<BadCopy>,
    },
    /// Answer to `RollbackPrefetch`: the pages here now.
    Prefetched {
        pages: u64,
    },
    /// Answer to `JobEnded`: the volatile segments dropped.
    Dropped {
        files: Vec<FileId>,
    },
    /// Answer to `CountMappings`.
    Mappings {
        count: u64,
    },
    /// Answer to `FenceAsk`.
    Fence(psls_svm::coherence::FenceAnswer),
    NotCoordinator,
    /// Answer to `Frames(Read)`: the page's bytes are the payload when `found`.
    Frame {
        found: bool,
    },
    /// Answer to `Frames(State)`: the last memory epoch committed here, the one held as
    /// pre-recovery copies, and the highest epoch this node's participant saw.
    MemState {
        committed: u64,
        pre: Option<u64>,
        /// The highest epoch of the job this node's participant saw.
        seen: u64,
        /// The job's files whose loads look for recovery copies here.
        files: Vec<FileId>,
        /// The job's frames here, by category.
        counts: psls_ckpt::frames::FrameCounts,
    },
    /// Answer to `Frames(Recreate)`: the copies sent.
    Recreated {
        pages: u64,
    },
    /// Answer to `CkptRun`: the checkpoint committed as `epoch`, writing `pages` pages.
    CkptDone {
        epoch: u64,
        pages: u64,
        bytes: u64,
    },
    /// Answer to `JobFiles`.
    JobFiles {
        files: Vec<FileId>,
    },
    /// Answer to `JobCommand`.
    JobAnswer {
        answer: psls_jobs::Answer,
    },
    /// Answer to `JobActivity`.
    JobActivity {
        text: String,
    },
    /// Answer to `Stdin`.
    StdinAck {
        received: u64,
        full: bool,
    },
    /// Answer to `OutputLast`.
    OutputLast {
        last: Vec<(u32, u64)>,
    },
    /// Answer to `OutputSince`: records (rank, number, stderr, bytes), and per rank the first
    /// number kept when older ones went.
    Output {
        records: Vec<OutputRecord>,
        gaps: Vec<(u32, u64)>,
    },
    /// Answer to `CkptProgress` (empty: no checkpoint in progress), with the job's last
    /// checkpoint this coordinator committed.
    Activity {
        text: String,
        last: Option<LastCkpt>,
    },
    /// Answer to `CkptRollback`: the checkpoint the job restarts from (0: its start).
    Restart {
        epoch: u64,
        /// Every epoch up to this one is fenced.
        fenced: u64,
    },
    /// Answer to `CkptArrive`: the epoch taken (0: none); `halt`: the job stops.
    SafeDone {
        epoch: u64,
        halt: bool,
        /// Pages the checkpoint took (one copy).
        pages: u64,
        /// How long it stopped the ranks (from the last rank's call to their answer).
        stopped_us: u64,
    },
    /// Answer to `MetaSubmit`: the coordinator changed while the operation was under way; it
    /// may or may not have been committed.
    Interrupted,
    /// Answer to `MetaSubmit`: applied at this index of the metadata log.
    MetaDone {
        index: u64,
    },
    /// Answer to `MetaSubmit`: not applied, and never will be (submit it again).
    MetaDropped,
    /// Answer to `MetaSnapshotChunk`: the snapshot's length (the chunk is the payload).
    MetaSnapshotChunk {
        total: u64,
    },
    /// Answer to `DiskFree`: the page store's free bytes, measured on the request.
    DiskFree {
        bytes: u64,
    },
    Error {
        kind: psls_ipc::ErrorKind,
        message: String,
    },
    /// Answer to `SvmHeld`: the segments held here; the shared-memory incarnation of the
    /// asked logical node known here, and the one seen come back while holding state (0: none).
    SvmHeld {
        segments: u64,
        knew: u64,
        fenced: u64,
    },
    /// Answer to `FiguresAsk`: each node's latest figures known to the leader.
    FiguresTable {
        nodes: Vec<(String, Heartbeat)>,
    },
}

/// Encodes a message header: `[header length u32 LE][postcard]`; the raw payload follows it
/// on the stream.
pub fn encode_header<T: Serialize>(m: &T) -> Vec<u8> {
    let header = postcard::to_stdvec(m).expect("peer message serializes");
    let mut out = Vec::with_capacity(4 + header.len());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out
}

/// Encodes a request or one-way message: its header carries the sender's incarnation first,
/// so receivers can drop whatever an incarnation declared down still sends.
pub fn encode_request(incarnation: u64, req: &PeerReq) -> Vec<u8> {
    encode_header(&(incarnation, req))
}

/// Decodes a request or one-way message: the sender's incarnation, the request, the payload.
pub fn decode_request(body: impl Into<bytes::Bytes>) -> Result<(u64, PeerReq, bytes::Bytes), String> {
    let ((incarnation, req), payload) = decode::<(u64, PeerReq)>(body)?;
    Ok((incarnation, req, payload))
}

/// The sender's side of the incarnation on every message, and the receiver's test of it:
/// messages of an incarnation the cluster declared down are dropped by their receivers, so
/// safety never rests on a paused or cut-off node noticing in time that it was fenced.
#[derive(Default)]
pub struct Stamp {
    incarnation: std::sync::atomic::AtomicU64,
    fenced: std::sync::OnceLock<FencedTest>,
}

/// Whether a message from (physical node, incarnation) must be dropped.
pub type FencedTest = std::sync::Arc<dyn Fn(&str, u64) -> bool + Send + Sync>;

impl Stamp {
    /// Set once at start-up: this daemon's incarnation and the receivers' test.
    pub fn set(&self, incarnation: u64, fenced: FencedTest) {
        self.incarnation
            .store(incarnation, std::sync::atomic::Ordering::Relaxed);
        let _ = self.fenced.set(fenced);
    }

    pub fn incarnation(&self) -> u64 {
        self.incarnation.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether a message of `incarnation` from `from` must be dropped.
    pub fn fenced(&self, from: &str, incarnation: u64) -> bool {
        self.fenced.get().is_some_and(|f| f(from, incarnation))
    }
}

/// Splits a received body into its decoded header and its payload (no copy of the payload).
pub fn decode<T: for<'de> Deserialize<'de>>(body: impl Into<bytes::Bytes>) -> Result<(T, bytes::Bytes), String> {
    let body: bytes::Bytes = body.into();
    if body.len() < 4 {
        return Err("message shorter than its length prefix".into());
    }
    let hlen = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
    if hlen > body.len() - 4 {
        return Err(format!("header length {hlen} exceeds the message"));
    }
    let msg = postcard::from_bytes(&body[4..4 + hlen]).map_err(|e| e.to_string())?;
    Ok((msg, body.slice(4 + hlen..)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_payload_roundtrip_and_garbage_is_an_error() {
        let mut b = encode_header(&PeerReq::Sync);
        b.extend_from_slice(b"abc");
        let (m, p): (PeerReq, bytes::Bytes) = decode(b).unwrap();
        assert!(matches!(m, PeerReq::Sync));
        assert_eq!(&p[..], b"abc");
        assert!(decode::<PeerReq>(vec![1, 2]).is_err());
        assert!(decode::<PeerReq>(vec![200, 0, 0, 0, 1]).is_err());
        assert!(decode::<PeerReq>(vec![3, 0, 0, 0, 0xff, 0xff, 0xff]).is_err());
    }
}
