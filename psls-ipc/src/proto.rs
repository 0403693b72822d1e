//! Client ↔ daemon protocol on the node's Unix stream socket.
//!
//! Handshake: a client's first 8 bytes on a connection are [`hello`]: `PSLS` and the
//! protocol's fingerprint ([`PROTOCOL`], a hash of this file, so two builds whose messages may
//! differ never misread each other). A daemon answers a mismatch with one `Error` naming both
//! fingerprints and its version, and closes the connection; a match gets no answer.
//!
//! Framing: `[length u32 LE][postcard body]`, length ≤ [`MAX_FRAME`]. Requests and responses
//! alternate, except the two streams:
//! - import: `ImportBegin`, any number of `ImportData` (page-sized pieces, in order), then
//!   `ImportCommit`; the daemon answers once, after the durable commit (or with the first error);
//! - export: `Export` is answered by `ExportBegin`, `Data`…, `ExportEnd` (or an `Error`).
//!
//! Sync channel: with `SyncChannel` a client hands the daemon one end of a `SOCK_SEQPACKET`
//! socket pair (SCM_RIGHTS). On it each barrier, lock or unlock call is one datagram each way,
//! a `Request` (`Barrier`, `Lock` or `Unlock`) from the client and its `Response`, with no
//! length prefix, each at most [`MAX_SYNC_MSG`] bytes; one call at a time.
//!
//! `ImportFd` and `ExportFd` carry the client's file descriptor (SCM_RIGHTS, attached to the
//! frame's first byte): the daemon reads or writes the file itself and answers once. The client
//! opened the file, so the daemon gets exactly the client's access, and the bytes skip the
//! socket.

use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};

/// The client protocol's fingerprint: FNV-1a of this file's text, cut to 32 bits. Any change
/// to the messages changes it (so does one to a comment: builds of one release pair up).
pub const PROTOCOL: u32 = {
    let text = include_bytes!("proto.rs");
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < text.len() {
        h ^= text[i] as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    (h ^ (h >> 32)) as u32
};

/// What a client sends first on a connection: `PSLS` and [`PROTOCOL`] (little-endian).
pub fn hello() -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(b"PSLS");
    b[4..].copy_from_slice(&PROTOCOL.to_le_bytes());
    b
}

/// Why a connection's first bytes are refused, in words for the client: `None` when they are
/// this build's [`hello`].
pub fn check_hello(got: &[u8; 8], daemon_version: &str) -> Option<String> {
    if got[..4] != *b"PSLS" {
        return Some(format!(
            "the client did not open with the PSLS handshake (a client older than this daemon, psls-node {daemon_version}, protocol {PROTOCOL:08x}, or not a PSLS client): use the psls of the same build"
        ));
    }
    let theirs = u32::from_le_bytes([got[4], got[5], got[6], got[7]]);
    (theirs != PROTOCOL).then(|| {
        format!(
            "client protocol {theirs:08x} does not match this daemon's, {PROTOCOL:08x} (psls-node {daemon_version}): use the psls of the same build"
        )
    })
}

/// Upper bound of one frame body (a 4 MiB data chunk plus headers).
pub const MAX_FRAME: usize = 4 * 1024 * 1024 + 4096;
/// Upper bound of one datagram on a sync channel.
pub const MAX_SYNC_MSG: usize = 8 * 1024;
/// The largest private state a rank saves with a checkpoint (`Session::checkpoint`).
pub const MAX_CKPT_STATE: usize = 1 << 20;
/// Data chunk size used by the CLI for import and by the daemon for export.
pub const CHUNK: usize = 1024 * 1024;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Bytes of `psls run`'s standard input for rank 0 of the first start of `job`, from
    /// byte `offset` of the input (`data` at most [`MAX_STDIN_CHUNK`] bytes; empty: a sign of
    /// life, which keeps the input open); `eof`: the input ends after them. Answered by
    /// `StdinAck`.
    Stdin {
        job: String,
        offset: u64,
        data: Vec<u8>,
        eof: bool,
    },
    Status,
    /// Which node this daemon is: answered by `Node`.
    Whoami,
    Create {
        name: String,
        size: u64,
        mode: u32,
    },
    ImportBegin {
        name: String,
        size: u64,
        mode: u32,
        replace: bool,
    },
    ImportData {
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    ImportCommit,
    Export {
        name: String,
    },
    Ls,
    Stat {
        name: String,
    },
    Rm {
        name: String,
    },
    Scrub,
    NodeReplace {
        logical: u32,
        spare: String,
    },
    Shutdown,
    /// Import from the file descriptor passed with this frame (SCM_RIGHTS): the daemon reads
    /// `size` bytes from it. The descriptor carries the client's own access rights.
    ImportFd {
        name: String,
        size: u64,
        mode: u32,
        replace: bool,
    },
    /// Export into the file descriptor passed with this frame; answered by `Exported`.
    ExportFd {
        name: String,
    },
    /// Makes this connection the caller process's lifeline: the daemon never answers it except
    /// with `Fatal` when a fault of the process cannot be served; its closing tells the client
    /// that the daemon died.
    Lifeline,
    /// Maps a parallel file (or, with `volatile`, a volatile segment) into the caller: answered
    /// by `Mapped` with the node's memfd of the file passed along (SCM_RIGHTS).
    Map {
        name: String,
        /// Bytes wanted; with `create`, the size of a file created if it does not exist.
        size: u64,
        create: bool,
        writable: bool,
        volatile: bool,
        /// The caller's job (`PSLS_JOB`; empty outside a job). A volatile segment belongs to
        /// its job: ranks of one job share it, and it is dropped when the job ends.
        job: String,
    },
    /// Hands the daemon the userfaultfd passed with this frame, registered by the caller over
    /// `[base, base + len)`, a mapping of `file`'s memfd at offset 0.
    Register {
        file: u64,
        base: u64,
        len: u64,
        writable: bool,
    },
    /// The caller unmaps the mapping at `base`. The last writable mapping of a parallel file
    /// by a process makes its writes to the file durable first (a persistent checkpoint).
    Unmap {
        base: u64,
    },
    /// Waits until `count` ranks of the caller's job have called the barrier `name`.
    Barrier {
        job: String,
        name: String,
        count: u32,
    },
    /// Waits for, then holds, lock `id` of the caller's job.
    Lock {
        job: String,
        id: u64,
    },
    Unlock {
        job: String,
        id: u64,
    },
    /// Fault and transfer counters of this node's shared virtual memory.
    SvmStats,
    /// `count` round trips of `bytes` bytes each way with node `peer`; answered by
    /// `Latencies` (nanoseconds). Over the request transport (a request and its response), or
    /// with `link`, over the message link (a one-way message and its one-way answer, as the
    /// coherence protocol's messages travel).
    PeerPing {
        peer: String,
        bytes: u32,
        count: u32,
        #[serde(default)]
        link: bool,
    },
    /// `psls run`: starts `ranks` ranks of `program` over the cluster; answered by a stream of
    /// `RankOutput` and a final `JobDone`.
    Run {
        program: String,
        args: Vec<String>,
        ranks: u32,
        per_node: Option<u32>,
        env: Vec<(String, String)>,
        cwd: String,
    },
    // New variants go last: postcard numbers variants by position.
    /// Makes the socket passed with this frame (SCM_RIGHTS; one end of a `SOCK_SEQPACKET`
    /// pair) the caller process's sync channel: its barrier and lock calls go there.
    SyncChannel,
    /// Makes the caller's writes to the parallel files it maps writable durable (a persistent
    /// checkpoint of them); answered by `Synced`.
    Sync,
    /// The caller's safe-point call (`Session::checkpoint`) with its private state (at most
    /// 1 MiB); answered by `Checkpointed` once every rank of its job called and the
    /// coordinator's decision was carried out. A process outside `psls run` is a job of one.
    Checkpoint {
        #[serde(with = "serde_bytes")]
        state: Vec<u8>,
    },
    /// The state the caller saved at checkpoint `epoch` (a restarted rank asks); answered by
    /// `RestartState`.
    RestartState {
        epoch: u64,
    },
    /// `psls checkpoint JOB` (or, with `halt`, `psls halt JOB`): a checkpoint at the job's
    /// next safe-point call (then the job stops).
    ForceCheckpoint {
        job: String,
        halt: bool,
    },
    /// `psls jobs`: running and resumable jobs; answered by `Jobs`.
    Jobs,
    /// `psls jobs rm JOB`: drop a job that is not running (its checkpoint area and record).
    JobRm {
        job: String,
    },
    /// `psls attach JOB` (and `psls run` reconnecting): follow a job from any node; `after`:
    /// per rank, the last output number the client has. Answered like `RunJob` after its
    /// `JobStarted`: `RankOutput`s and `JobNote`s, then `JobDone`.
    Attach {
        job: String,
        after: Vec<(u32, u64)>,
        /// The job's start the client followed last (`JobAttempt`), if any: the restarts since
        /// are noted to it.
        attempt: Option<u32>,
    },
    /// `psls cancel JOB` (and Ctrl-C of `psls run`): stop the job, keeping it resumable from
    /// its newest intact checkpoint.
    Cancel {
        job: String,
    },
    /// `psls run` with checkpoint options.
    RunJob {
        program: String,
        args: Vec<String>,
        ranks: u32,
        per_node: Option<u32>,
        env: Vec<(String, String)>,
        cwd: String,
        checkpoint: CkptOptions,
    },
}

/// Most bytes of standard input in one `Request::Stdin`.
pub const MAX_STDIN_CHUNK: usize = 64 * 1024;

/// A job's checkpoint options (`psls run`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CkptOptions {
    /// A safe-point call takes a checkpoint when this many seconds passed since the last one
    /// (0: every call).
    pub interval_s: u64,
    /// A safe-point call fails when not every rank made it within this many seconds
    /// (0: the default, 60).
    pub timeout_s: u64,
    /// How many times the job may be rolled back and restarted after a node failure.
    pub max_restarts: u32,
    /// How long a rollback waits for a failed node to come back, in seconds (0: 60).
    pub respawn_timeout_s: u64,
    /// Which level safe points take: `auto` (or empty), `memory` or `persistent`.
    pub level: String,
    /// With `auto`, a safe point takes the cleaner when this many seconds passed since the
    /// job's last persistent checkpoint (0: the cluster's default).
    pub persistent_interval_s: u64,
    /// With `auto`, every this many-th checkpoint of the job is a cleaner, whatever the time
    /// (0: by the interval only).
    pub persistent_every: u32,
    /// What stays in memory after a cleaner: `none`, `total`, `p1`, `p2`, `p3` or `lru:FRAMES`
    /// (empty: the cluster's `cleaning`).
    pub cleaning: String,
    /// After a rollback, load again the pages that were active before the ranks restart.
    pub prefetch: bool,
    /// `psls run --resume JOB`: start job JOB again from its last checkpoint (its command and
    /// options come from its record; the other fields are ignored).
    pub resume: String,
    /// `psls run --job NAME`: the new job's name (empty: the daemon makes one).
    pub job: String,
    /// The physical nodes the ranks may run on (`psls run --nodes`, or the Slurm allocation's);
    /// empty: any node. A resume takes these too.
    pub nodes: Vec<String>,
    /// `psls run` forwards its standard input to rank 0 (`Request::Stdin`); else every rank
    /// reads an empty input.
    pub stdin: bool,
}

/// A job, as `psls jobs` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobInfo {
    pub job: String,
    /// `running`, or `resumable` (it has a checkpoint and no launcher runs it).
    pub state: String,
    pub ranks: u32,
    pub command: String,
    pub uid: u32,
    /// Its last committed checkpoint (0: none), when, and the bytes it kept (one copy).
    pub epoch: u64,
    pub at_unix_ms: u64,
    pub bytes: u64,
    /// That checkpoint's level (`memory` or `persistent`) and, when its coordinator saw it
    /// commit, its pause (from its start until the ranks went on: every node had taken its
    /// pages; 0: unknown) and its time to commit (from its start).
    pub level: String,
    pub pause_us: u64,
    pub commit_us: u64,
    /// A running job's recovery copies, over every live node: of its last memory checkpoint
    /// (of which `unsaved_frames` newer than the disks), and of one being taken.
    pub recovery_frames: u64,
    pub unsaved_frames: u64,
    pub pre_recovery_frames: u64,
    /// The last persistent checkpoint (what a power cut returns to).
    pub persistent_epoch: u64,
    /// What a running job goes through now, if anything but running: a checkpoint in
    /// progress (its step and the nodes it waits for) or a rollback's step, and for how long.
    /// A job not running: how its last start ended (`cancelled: ...`, `halted: ...`).
    pub activity: String,
    /// A resumable job that finished computing: why its last persistent checkpoint failed
    /// (`psls run --resume` writes its result). Empty otherwise.
    pub finished: String,
    /// How its last start ended (`finished`, `unwritten`, `failed`, `node_fail`, `halted`,
    /// `cancelled`); empty while it runs, or if no start of it ended.
    pub end: String,
}

/// Class of an error, so that callers can react without parsing text (defined with the
/// machines that decide on it).
pub use psls_svm::ErrorKind;

/// Spelt in JSON as in tables: `up`, `suspect`, `down`, `replaced`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    Up,
    Suspect,
    Down,
    /// Its logical id was given to a spare.
    Replaced,
}

impl std::fmt::Display for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NodeState::Up => "up",
            NodeState::Suspect => "suspect",
            NodeState::Down => "down",
            NodeState::Replaced => "replaced",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub name: String,
    pub logical: Option<u32>,
    pub addr: String,
    /// The node's message link address (`link_addr`, or its default).
    #[serde(default)]
    pub link_addr: String,
    pub spare: bool,
    pub state: NodeState,
    pub pid: Option<u32>,
    pub incarnation: u64,
    pub memory_used_bytes: u64,
    pub memory_capacity_bytes: u64,
    pub disk_used_bytes: u64,
    pub disk_free_bytes: u64,
    pub coordinator: bool,
    /// The node's metadata log (from its last heartbeat): its term, commit and applied indexes.
    #[serde(default)]
    pub meta_term: u64,
    #[serde(default)]
    pub meta_commit: u64,
    #[serde(default)]
    pub meta_applied: u64,
    /// Pages copied / pages to copy while this node rebuilds its copies.
    pub rebuild: Option<(u64, u64)>,
    /// Memory checkpoints' frames in the node's recovery area, by category: readable or pure
    /// recovery (of them, newer than the disks), pre-recovery; its capacity; and the pages
    /// held here modified since the last checkpoint (active, dirty).
    #[serde(default)]
    pub recovery_frames: u64,
    #[serde(default)]
    pub unsaved_frames: u64,
    #[serde(default)]
    pub pre_recovery_frames: u64,
    #[serde(default)]
    pub frame_capacity: u64,
    #[serde(default)]
    pub dirty_pages: u64,
    /// Why the node's page store failed (an fsync or I/O error), if it did: such a node is
    /// taken out of the cluster and a spare takes its place.
    #[serde(default)]
    pub disk_failed: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub cluster: String,
    /// The node that answered.
    pub via: String,
    pub coordinator: Option<String>,
    /// The applied index of the answering node's metadata log.
    pub meta_seq: u64,
    /// The metadata log's term, as the answering node knows it.
    #[serde(default)]
    pub meta_term: u64,
    /// The metadata log's voters (the other nodes follow it), as the answering node knows them.
    #[serde(default)]
    pub meta_voters: Vec<String>,
    pub map_version: u64,
    pub files: u64,
    pub nodes: Vec<NodeStatus>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileInfo {
    pub name: String,
    pub id: u64,
    pub size: u64,
    pub pages: u64,
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    pub gen: u64,
    pub created_unix_ms: u64,
}

/// One stripe unit: the pages `first, first+N, first+2N, …` share home and mirror.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stripe {
    pub first_page: u64,
    pub pages: u64,
    pub home: u32,
    pub mirror: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubReport {
    pub files: u64,
    pub copies_checked: u64,
    pub bad_copies: u64,
    pub repaired: u64,
    pub unrepairable: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Ok,
    /// Rank 0 took the input up to byte `received`; `full`: its buffer is full now (send the
    /// rest again later).
    StdinAck {
        received: u64,
        full: bool,
    },
    /// The daemon's node (its physical name) and cluster.
    Node {
        name: String,
        cluster: String,
    },
    Error {
        kind: ErrorKind,
        message: String,
    },
    Status(ClusterStatus),
    Files(Vec<FileInfo>),
    Stat {
        file: FileInfo,
        stripes: Vec<Stripe>,
    },
    ExportBegin {
        size: u64,
    },
    Data(#[serde(with = "serde_bytes")] Vec<u8>),
    ExportEnd,
    Scrub(ScrubReport),
    /// The whole file was written into the passed descriptor.
    Exported {
        size: u64,
    },
    /// Answer to `Map`: the memfd comes with it; map `len` bytes of it.
    Mapped {
        file: u64,
        size: u64,
        len: u64,
        writable: bool,
    },
    /// On a lifeline: the process cannot go on (one of its faults failed).
    Fatal {
        message: String,
    },
    /// Output of a rank of a `Run` (stderr if `err`): a line (or the piece of one a checkpoint
    /// or the rank's end cut), numbered `seq` in the rank's output.
    RankOutput {
        rank: u32,
        seq: u64,
        err: bool,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Answer to `PeerPing`: one round-trip time per request, in nanoseconds.
    Latencies(Vec<u64>),
    /// Answer to `SvmStats`: (counter, value) pairs of node `node`.
    SvmStats {
        node: String,
        counters: Vec<(String, u64)>,
    },
    /// The job is over: `code` is the first failing rank's status (0 if none failed).
    JobDone {
        code: i32,
        message: String,
    },
    /// Answer to `Sync`: the checkpoint committed as `epoch` (0: nothing was mapped
    /// writable), writing `pages` pages.
    Synced {
        epoch: u64,
        pages: u64,
    },
    /// Answer to `Checkpoint`: the epoch taken (0: none, the interval has not elapsed);
    /// `halt`: the job stops now (`psls halt`), resumable from it.
    Checkpointed {
        epoch: u64,
        halt: bool,
        /// Pages the checkpoint took (one copy).
        pages: u64,
        /// How long it stopped the job's ranks, as its coordinator saw it: from the last
        /// rank's call to their answer (the caller's own call also waited for the slowest).
        stopped_us: u64,
    },
    /// Answer to `Jobs`.
    Jobs(Vec<JobInfo>),
    /// What happened to a running job (a rollback and restart after a failure).
    JobNote {
        message: String,
    },
    /// The start of the job that the client now follows (before its notes and lines): a
    /// client that follows again elsewhere names it in `Attach`.
    JobAttempt {
        attempt: u32,
    },
    /// First answer to `RunJob`: the job's id (for `psls checkpoint`, `psls halt`).
    JobStarted {
        job: String,
    },
    /// Answer to `RestartState`.
    RestartState {
        epoch: u64,
        #[serde(with = "serde_bytes")]
        state: Vec<u8>,
    },
}

/// Errors of framing.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("connection closed")]
    Closed,
    #[error("frame of {0} bytes exceeds the limit of {MAX_FRAME}")]
    TooLarge(usize),
    #[error("sync message of {0} bytes exceeds the limit of {MAX_SYNC_MSG}")]
    DatagramTooLarge(usize),
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let body = postcard::to_stdvec(msg).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// One sync-channel datagram: the postcard body alone, at most [`MAX_SYNC_MSG`] bytes.
pub fn encode_datagram<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let body = postcard::to_stdvec(msg).map_err(|e| FrameError::Malformed(e.to_string()))?;
    if body.len() > MAX_SYNC_MSG {
        return Err(FrameError::DatagramTooLarge(body.len()));
    }
    Ok(body)
}

pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, FrameError> {
    postcard::from_bytes(body).map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Checks a frame length prefix.
pub fn check_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLarge(len));
    }
    Ok(len)
}

pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T) -> Result<(), FrameError> {
    w.write_all(&encode(msg)?)?;
    Ok(())
}

/// Reads one frame body (bounded by [`MAX_FRAME`]).
pub fn read_body(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut prefix = [0u8; 4];
    if let Err(e) = r.read_exact(&mut prefix) {
        return Err(if e.kind() == io::ErrorKind::UnexpectedEof {
            FrameError::Closed
        } else {
            e.into()
        });
    }
    let len = check_len(prefix)?;
    let mut body = Vec::with_capacity(len);
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len {
        return Err(FrameError::Closed);
    }
    Ok(body)
}

pub fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> Result<T, FrameError> {
    decode(&read_body(r)?)
}

// Bulk messages (`Request::ImportData`, `Response::Data`) are written and read without an
// extra copy of their bytes: the frame is the prefix, the postcard variant tag and length
// varint, then the bytes themselves — exactly what postcard would produce (unit-tested).
const IMPORT_DATA_TAG: u8 = 3;
const DATA_TAG: u8 = 6;

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bulk_header(tag: u8, len: usize) -> Result<Vec<u8>, FrameError> {
    let mut h = vec![0u8; 4];
    h.push(tag);
    varint(len as u64, &mut h);
    let total = h.len() - 4 + len;
    if total > MAX_FRAME {
        return Err(FrameError::TooLarge(total));
    }
    h[..4].copy_from_slice(&(total as u32).to_le_bytes());
    Ok(h)
}

/// Frame prefix and header of a `Response::Data` carrying `len` bytes (the bytes follow).
pub fn data_frame_header(len: usize) -> Result<Vec<u8>, FrameError> {
    bulk_header(DATA_TAG, len)
}

/// Writes `Request::ImportData { data }` without copying `data`.
pub fn write_import_data(w: &mut impl Write, data: &[u8]) -> Result<(), FrameError> {
    w.write_all(&bulk_header(IMPORT_DATA_TAG, data.len())?)?;
    w.write_all(data)?;
    Ok(())
}

fn bulk_range(body: &[u8], tag: u8) -> Option<std::ops::Range<usize>> {
    if body.first() != Some(&tag) {
        return None;
    }
    let (mut len, mut shift, mut i) = (0u64, 0u32, 1usize);
    loop {
        let b = *body.get(i)?;
        len |= u64::from(b & 0x7f).checked_shl(shift)?;
        i += 1;
        if b & 0x80 == 0 {
            break;
        }
        shift += 7;
        if shift > 63 {
            return None;
        }
    }
    (body.len() - i == usize::try_from(len).ok()?).then_some(i..body.len())
}

/// Where the bytes of an `ImportData` frame body are, if it is one.
pub fn import_data_range(body: &[u8]) -> Option<std::ops::Range<usize>> {
    bulk_range(body, IMPORT_DATA_TAG)
}

/// Where the bytes of a `Data` frame body are, if it is one.
pub fn data_range(body: &[u8]) -> Option<std::ops::Range<usize>> {
    bulk_range(body, DATA_TAG)
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_handshake_refuses_another_build_and_a_client_without_it() {
        assert_eq!(check_hello(&hello(), "1.0"), None);
        let mut other = hello();
        other[7] ^= 0x80;
        let why = check_hello(&other, "1.0").expect("refused");
        assert!(why.contains(&format!("{PROTOCOL:08x} (psls-node 1.0)")), "{why}");
        let old = [5, 0, 0, 0, 1, 2, 3, 4];
        assert!(check_hello(&old, "1.0").is_some_and(|w| w.contains("did not open with the PSLS handshake")));
    }

    use super::*;

    #[test]
    fn roundtrip_and_bounds() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &Request::Stat { name: "x".into() }).unwrap();
        let r: Request = read_frame(&mut buf.as_slice()).unwrap();
        assert_eq!(r, Request::Stat { name: "x".into() });
        let huge = (MAX_FRAME as u32 + 1).to_le_bytes();
        assert!(matches!(
            read_frame::<Request>(&mut huge.as_slice()),
            Err(FrameError::TooLarge(_))
        ));
        let garbage = [3u8, 0, 0, 0, 0xff, 0xff, 0xff];
        assert!(matches!(
            read_frame::<Request>(&mut garbage.as_slice()),
            Err(FrameError::Malformed(_))
        ));
        assert!(matches!(
            read_frame::<Request>(&mut [].as_slice()),
            Err(FrameError::Closed)
        ));
        assert!(encode(&Request::ImportData {
            data: vec![0; MAX_FRAME]
        })
        .is_err());
    }
}
