//! Namespace metadata: file names, sizes, owners and modes, the commit record (generation) of
//! each file, and the versioned logical → physical node map.
//!
//! The whole state is one [`MetaState`] value. It changes only through [`MetaOp`]s, applied in
//! sequence-number order: `apply` is a pure function (validated, deterministic), and
//! [`MetaStore`] persists each new state in redb with immediate durability, so a committed
//! operation survives a power cut and an uncommitted one leaves no trace. Every node keeps a
//! replica; the coordinator orders operations (see `psls-node`).
//!
//! On-disk record (redb table `meta`, key `"state"`): `[format version u16 LE][postcard state]`.
//! Format 2 added `assigned`; a format-1 record is read as having every logical id on its
//! initial node. Format 3 added per-page generations (`FileMeta::written`) and the jobs'
//! checkpoint records (`jobs`); older records read with none. Format 4 added the jobs'
//! checkpoint options (`job_options`); older records read with none (a resumed job then
//! takes the defaults). Format 5 added the committed down verdicts (`down`) and the jobs that
//! finished computing but whose last persistent checkpoint failed (`finished`); older records
//! read with none. The replication vote (table
//! `vote`, key `"vote"`, written in its own transaction): `[format version u16 LE = 2][postcard
//! (promised epoch, accepted operation)]` (format 1, whose operations carry format-2 files,
//! still reads); a store without one has promised nothing and accepted nothing.
//!
//! [`MetaState`] is the state the metadata log (`psls_cluster::log`) builds on every node
//! (its `Machine`, in `crate::logstore`); it still implements the old protocol's
//! [`Replicated`] only to read stores written before the log.

use crate::disk::{Disk, DiskFile};
use crate::error::MetaError;
pub use crate::file::FileMeta;
use crate::file::FileMetaV2;
use crate::gens::PageGens;
use crate::jobs::{FileRuns, JobCkpt};
use imbl::{OrdMap, OrdSet};
use psls_cluster::meta::{Accepted, Durable, Epoch, Replicated};
use psls_svm::FileId;
#[cfg(test)]
use psls_svm::PAGE_SIZE;
use redb::{ReadableDatabase, TableDefinition};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::Arc;

const META_TABLE: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const STATE_KEY: &str = "state";
/// Format of an encoded [`MetaState`] (a snapshot of the metadata log): the state, then job
/// control's records (`runs`, `ended`). Format 6 had no job-control records; formats up to 5
/// are the records of the store before the log, read once to convert it.
const SNAPSHOT_FORMAT: u16 = 7;
const VOTE_TABLE: TableDefinition<&str, &[u8]> = TableDefinition::new("vote");
const VOTE_KEY: &str = "vote";
const VOTE_FORMAT: u16 = 2;

/// What a node promised and accepted in metadata replication.
type Vote = (Epoch, Option<Accepted<MetaOp>>);

/// Longest reason kept with a finished job, in bytes.
pub const MAX_WHY_LEN: usize = 1024;
/// Most files a finished job keeps.
pub const MAX_FINISHED_FILES: usize = 4096;

/// Longest accepted file name in bytes.
pub const MAX_NAME_LEN: usize = 255;

/// Largest file: 4 PiB.
pub const MAX_FILE_SIZE: u64 = 1 << 52;

/// A logical node whose copies are being re-created on a new physical node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rebuild {
    pub physical: String,
}

/// The replicated namespace.
///
/// Its maps are persistent (`imbl`): a clone is O(1) and shares everything, so a reader takes a
/// snapshot of the whole namespace for the price of a pointer, and an operation copies only the
/// path to what it changes. Lookups go by key: a file by name ([`MetaState::files`]) or by id
/// ([`MetaState::file_by_id`]), the files a job writes ([`MetaState::files_written_by`]), a job
/// by name; no operation scans every file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaState {
    /// Index of the last applied operation (of the metadata log).
    pub seq: u64,
    pub files: OrdMap<String, FileMeta>,
    /// Logical node id → physical node name. Empty until the cluster first starts.
    pub logical: BTreeMap<u32, String>,
    /// Bumped at every change of `logical`.
    pub map_version: u64,
    /// Logical nodes whose copies are being rebuilt (not yet readable).
    pub rebuilding: BTreeMap<u32, Rebuild>,
    /// The `map_version` at which each replaced logical id got its current physical node
    /// (absent: still on its initial node, 0). It orders the nodes that held one logical id,
    /// whose own incarnation counters are unrelated.
    pub assigned: BTreeMap<u32, u64>,
    /// Every job's checkpoint record, by job name.
    pub jobs: OrdMap<String, JobCkpt>,
    /// The generation the next checkpoint gets (cluster-wide, only grows): above every page
    /// generation of every file, kept so by every operation that sets one.
    pub next_gen: u64,
    /// How each `psls run` job checkpoints (its level, cleaner interval and policy), kept as
    /// long as its record for `psls run --resume`.
    pub job_options: OrdMap<String, crate::jobs::JobOptions>,
    /// Committed failure verdicts: physical node → the highest incarnation declared down.
    /// Every incarnation up to it is dead for good: its messages are dropped, it serves
    /// nothing, and it rejoins only as a newer one.
    pub down: BTreeMap<String, u64>,
    /// Jobs whose ranks all exited 0 and whose result is in their last (memory) checkpoint,
    /// but whose last persistent checkpoint failed (job → why): `psls run --resume` only has
    /// to write it.
    pub finished: OrdMap<String, Finished>,
    /// Each running `psls run` job's current start (see [`crate::runs`]). Encoded after the
    /// rest of the state (format 7 of a snapshot).
    #[serde(skip)]
    pub runs: OrdMap<String, crate::runs::RunRecord>,
    /// Jobs that ended, with the log index of their end (at most [`crate::runs::MAX_ENDED`]).
    #[serde(skip)]
    pub ended: OrdMap<String, (u64, crate::runs::JobEnd)>,
    /// The writer claims of processes outside `psls run` (`ext:` and `proc:` jobs), per file:
    /// counted by the node incarnation each was made on. A claim goes with its incarnation
    /// (once that is down, its process is gone), so a node's crash leaves no file claimed for
    /// good. Kept in the store's `claims` record and after the job records of a snapshot
    /// (both optional: older stores and snapshots have none).
    #[serde(skip)]
    pub process_claims: OrdMap<FileId, ProcessClaims>,
    /// Each physical node's current incarnation, committed by the node itself before it
    /// serves (`MetaOp::Boot`, Ceph's `up_from`): a node is up iff this incarnation is above
    /// its verdict in `down`. Every node learns a peer's restart from it, whether it watches
    /// that peer or not. Kept in the store's `up_from` record and after the claims of a
    /// snapshot (both optional: older stores and snapshots have none).
    #[serde(skip)]
    pub up_from: BTreeMap<String, u64>,
    /// File id → name (an index of `files`, rebuilt when a state is decoded).
    #[serde(skip)]
    ids: OrdMap<FileId, String>,
    /// Job → the files it maps writable (an index of `files`).
    #[serde(skip)]
    writing: OrdMap<String, OrdSet<FileId>>,
    /// The keys changed since the last [`MetaState::take_changes`].
    #[serde(skip)]
    touched: Touched,
    /// File id → the generation deltas its store row set holds beyond its base (rows, bytes):
    /// what decides when the deltas are folded into a new base.
    #[serde(skip)]
    gen_rows: GenRows,
}

/// A file's writer claims made by processes outside `psls run`: (node, incarnation) → how
/// many processes there claim it.
pub type ProcessClaims = BTreeMap<(String, u64), u32>;

/// Most files the processes outside `psls run` may claim at once, cluster-wide.
pub const MAX_PROCESS_CLAIMED_FILES: usize = 65_536;

/// Most physical nodes whose incarnation the metadata records (`MetaState::up_from`).
pub const MAX_BOOTED_NODES: usize = 65_536;

/// See [`MetaState`]'s field; equal whatever they hold: how the store keeps the maps is not
/// part of the state.
#[derive(Clone, Debug, Default)]
struct GenRows(OrdMap<FileId, (u32, u64)>);

impl PartialEq for GenRows {
    fn eq(&self, _: &GenRows) -> bool {
        true
    }
}
impl Eq for GenRows {}

/// The pages one operation set to one generation in one file: a row of the store's generation
/// table, so a checkpoint writes what it changed, not the file's whole map.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenDelta {
    pub gen: u64,
    /// Page runs `(start, end)`, set in this order.
    pub runs: Vec<(u64, u64)>,
}

/// Most delta rows a file keeps beside its base before they are folded into it.
pub const MAX_GEN_DELTAS: u32 = 64;

/// Keys changed by operations, to be written.
#[derive(Clone, Debug, Default)]
struct Touched {
    files: BTreeSet<String>,
    ids: BTreeSet<FileId>,
    /// Files whose generation map is rewritten whole (a base row).
    gens: BTreeSet<FileId>,
    /// Files whose generation map changed by sets only: the deltas, with their log index.
    deltas: BTreeMap<FileId, Vec<(u64, GenDelta)>>,
    jobs: BTreeSet<String>,
    nodes: bool,
    next_gen: bool,
    claims: bool,
    up_from: bool,
}

/// Equal whatever they hold: which keys wait to be written is not part of the state.
impl PartialEq for Touched {
    fn eq(&self, _: &Touched) -> bool {
        true
    }
}
impl Eq for Touched {}

/// What an operation (or a batch of them) changed, key by key, with the values now (`None`:
/// the key goes): what the metadata store writes to its per-key tables.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Changes {
    /// File name → its record (without its generation runs).
    pub files: Vec<(String, Option<FileRecord>)>,
    /// File id → its name.
    pub ids: Vec<(FileId, Option<String>)>,
    /// File id → the generations of the pages checkpoints wrote, whole: the base row that
    /// replaces every row of the file (`None`: the file has none).
    pub gens: Vec<(FileId, Option<PageGens>)>,
    /// Delta rows, keyed by file id and the index of the operation that set them (above 0),
    /// applied in key order over the file's base.
    pub gen_deltas: Vec<(FileId, u64, GenDelta)>,
    /// Job → its records.
    pub jobs: Vec<(String, Option<JobRecord>)>,
    /// Job → its current start and its end (job control's records).
    pub runs: Vec<(String, Option<crate::runs::RunRow>)>,
    /// The node map and the verdicts, when they changed.
    pub nodes: Option<NodesRecord>,
    pub next_gen: Option<u64>,
    /// The processes' writer claims, whole, when they changed.
    pub claims: Option<BTreeMap<FileId, ProcessClaims>>,
    /// The nodes' current incarnations, whole, when they changed.
    pub up_from: Option<BTreeMap<String, u64>>,
}

impl Changes {
    /// Folds `later` changes into these: writing the result is writing both in order (a later
    /// value of a key wins; a later base of a file's generation map drops the earlier deltas).
    pub fn merge(&mut self, later: Changes) {
        self.files.extend(later.files);
        self.ids.extend(later.ids);
        if !later.gens.is_empty() {
            let rebased: BTreeSet<FileId> = later.gens.iter().map(|(id, _)| *id).collect();
            self.gen_deltas.retain(|(id, _, _)| !rebased.contains(id));
        }
        self.gens.extend(later.gens);
        self.gen_deltas.extend(later.gen_deltas);
        self.jobs.extend(later.jobs);
        self.runs.extend(later.runs);
        if later.nodes.is_some() {
            self.nodes = later.nodes;
        }
        if later.next_gen.is_some() {
            self.next_gen = later.next_gen;
        }
        if later.up_from.is_some() {
            self.up_from = later.up_from;
        }
        if later.claims.is_some() {
            self.claims = later.claims;
        }
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
            && self.ids.is_empty()
            && self.gens.is_empty()
            && self.gen_deltas.is_empty()
            && self.jobs.is_empty()
            && self.runs.is_empty()
            && self.nodes.is_none()
            && self.claims.is_none()
            && self.next_gen.is_none()
    }
}

/// A file's record in the store: [`FileMeta`] without its generation runs (kept apart, so an
/// operation that does not change them does not write them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    pub id: FileId,
    pub size: u64,
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    pub gen: u64,
    pub created_unix_ms: u64,
    pub writer: Option<(String, u32)>,
}

impl FileRecord {
    fn of(f: &FileMeta) -> FileRecord {
        FileRecord {
            id: f.id,
            size: f.size,
            uid: f.uid,
            gid: f.gid,
            mode: f.mode,
            gen: f.gen,
            created_unix_ms: f.created_unix_ms,
            writer: f.writer.clone(),
        }
    }

    /// The file named `name` with these fields and generation runs `written`.
    pub fn into_meta(self, name: String, written: PageGens) -> FileMeta {
        FileMeta {
            id: self.id,
            name,
            size: self.size,
            uid: self.uid,
            gid: self.gid,
            mode: self.mode,
            gen: self.gen,
            created_unix_ms: self.created_unix_ms,
            written,
            writer: self.writer,
        }
    }
}

/// A job's records in the store.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub ckpt: Option<JobCkpt>,
    pub options: Option<crate::jobs::JobOptions>,
    pub finished: Option<Finished>,
}

/// The node map and the verdicts, in the store (one small record).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodesRecord {
    pub logical: BTreeMap<u32, String>,
    pub map_version: u64,
    pub rebuilding: BTreeMap<u32, Rebuild>,
    pub assigned: BTreeMap<u32, u64>,
    pub down: BTreeMap<String, u64>,
}

impl MetaState {
    /// Writes `changes` into this state (a store loading its tables, or a check that the tables
    /// equal the state).
    pub fn load(&mut self, changes: Changes) {
        for (id, name) in changes.ids {
            match name {
                Some(n) => self.ids.insert(id, n),
                None => self.ids.remove(&id),
            };
        }
        let mut gens: BTreeMap<FileId, PageGens> = BTreeMap::new();
        for (id, g) in changes.gens {
            self.gen_rows.0.remove(&id);
            if let Some(g) = g {
                gens.insert(id, g);
            }
        }
        for (name, rec) in changes.files {
            match rec {
                Some(r) => {
                    let written = gens.remove(&r.id).unwrap_or_default();
                    self.files.insert(name.clone(), r.into_meta(name, written));
                }
                None => {
                    self.files.remove(&name);
                }
            }
        }
        for (job, rec) in changes.jobs {
            let rec = rec.unwrap_or_default();
            match rec.ckpt {
                Some(c) => self.jobs.insert(job.clone(), c),
                None => self.jobs.remove(&job),
            };
            match rec.options {
                Some(o) => self.job_options.insert(job.clone(), o),
                None => self.job_options.remove(&job),
            };
            match rec.finished {
                Some(f) => self.finished.insert(job, f),
                None => self.finished.remove(&job),
            };
        }
        for (job, row) in changes.runs {
            let row = row.unwrap_or_default();
            match row.run {
                Some(r) => self.runs.insert(job.clone(), r),
                None => self.runs.remove(&job),
            };
            match row.end {
                Some(e) => self.ended.insert(job, e),
                None => self.ended.remove(&job),
            };
        }
        if let Some(n) = changes.nodes {
            self.logical = n.logical;
            self.map_version = n.map_version;
            self.rebuilding = n.rebuilding;
            self.assigned = n.assigned;
            self.down = n.down;
        }
        if let Some(g) = changes.next_gen {
            self.next_gen = g;
        }
        if let Some(c) = changes.claims {
            self.process_claims = c.into_iter().collect();
        }
        if let Some(u) = changes.up_from {
            self.up_from = u;
        }
        self.reindex();
        // Bases of files whose record did not change, then the deltas over them.
        for (id, g) in gens {
            if let Some(name) = self.ids.get(&id).cloned() {
                if let Some(f) = self.files.get_mut(&name) {
                    f.written = g;
                }
            }
        }
        for (id, _, d) in changes.gen_deltas {
            let Some(name) = self.ids.get(&id).cloned() else {
                continue;
            };
            if let Some(f) = self.files.get_mut(&name) {
                for &(s, e) in &d.runs {
                    f.written.set(s, e, d.gen);
                }
            }
            let rows = self.gen_rows.0.entry(id).or_insert((0, 0));
            rows.0 += 1;
            rows.1 += delta_bytes(&d);
        }
    }
}

/// The bytes a delta row takes in the store (its encoding; the key is fixed).
fn delta_bytes(d: &GenDelta) -> u64 {
    postcard::to_stdvec(d).map_or(0, |b| b.len() as u64)
}

/// A job whose ranks all exited 0 but whose last persistent checkpoint failed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finished {
    /// Why its last persistent checkpoint failed.
    pub why: String,
    /// The parallel files its ranks wrote (it keeps their writer claims until it is written).
    pub files: Vec<FileId>,
    /// The (memory) checkpoint that holds its result: a rollback to it restores the result.
    pub epoch: u64,
}

/// Format 4 of [`MetaState`] (before `down`).
#[derive(Deserialize)]
struct MetaStateV4 {
    seq: u64,
    files: BTreeMap<String, FileMeta>,
    logical: BTreeMap<u32, String>,
    map_version: u64,
    rebuilding: BTreeMap<u32, Rebuild>,
    assigned: BTreeMap<u32, u64>,
    jobs: BTreeMap<String, JobCkpt>,
    next_gen: u64,
    job_options: BTreeMap<String, crate::jobs::JobOptions>,
}

/// Format 3 of [`MetaState`] (before `job_options`).
#[derive(Deserialize)]
struct MetaStateV3 {
    seq: u64,
    files: BTreeMap<String, FileMeta>,
    logical: BTreeMap<u32, String>,
    map_version: u64,
    rebuilding: BTreeMap<u32, Rebuild>,
    assigned: BTreeMap<u32, u64>,
    jobs: BTreeMap<String, JobCkpt>,
    next_gen: u64,
}

/// Format 1 of [`MetaState`] (before `assigned`).
#[derive(Deserialize)]
struct MetaStateV1 {
    seq: u64,
    files: BTreeMap<String, FileMetaV2>,
    logical: BTreeMap<u32, String>,
    map_version: u64,
    rebuilding: BTreeMap<u32, Rebuild>,
}

/// Format 2 of [`MetaState`] (before per-page generations and jobs).
#[derive(Deserialize)]
struct MetaStateV2 {
    seq: u64,
    files: BTreeMap<String, FileMetaV2>,
    logical: BTreeMap<u32, String>,
    map_version: u64,
    rebuilding: BTreeMap<u32, Rebuild>,
    assigned: BTreeMap<u32, u64>,
}

fn files_v2(files: BTreeMap<String, FileMetaV2>) -> BTreeMap<String, FileMeta> {
    files.into_iter().map(|(n, f)| (n, f.into())).collect()
}

/// A change to the namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaOp {
    /// Sets the initial logical map if none is set yet.
    InitMap {
        logical: BTreeMap<u32, String>,
    },
    /// Commit record of a file whose pages are durable on both copies. With `replaces`, the
    /// name must still point to that id (atomic replace); without it the name must be free.
    CommitFile {
        meta: FileMeta,
        replaces: Option<FileId>,
        /// The `map_version` the file's pages were placed with (`None`: no page was written).
        /// Refused if the map changed since: a copy may have gone to a node that was replaced
        /// after its spare planned the rebuild, which would then never re-mirror it.
        placed_at: Option<u64>,
    },
    RemoveFile {
        name: String,
        id: FileId,
    },
    /// A spare takes over a logical id; its copies must be rebuilt.
    Replace {
        logical: u32,
        physical: String,
    },
    RebuildDone {
        logical: u32,
        physical: String,
    },
    /// Checkpoint `epoch` of `job` begins: it gets the next generation (see [`crate::jobs`]).
    BeginCheckpoint {
        job: String,
        epoch: u64,
    },
    /// Commit record of checkpoint `epoch` of `job`: the pages it names are durable on both
    /// copies at generation `gen`, which they have from now on (see [`crate::jobs`]).
    Checkpoint {
        job: String,
        epoch: u64,
        gen: u64,
        /// The `map_version` the pages were placed with (refused if the map changed since).
        placed_at: u64,
        files: Vec<FileRuns>,
        at_unix_ms: u64,
        bytes: u64,
    },
    /// Checkpoint `epoch` of `job` will never commit (nothing changes if it did).
    FenceCheckpoint {
        job: String,
        epoch: u64,
    },
    /// Job `job` is over: its checkpoint record goes, and it writes no file any more.
    EndJob {
        job: String,
    },
    /// `psls run` job `job` starts (or restarts): its record keeps what it runs.
    StartJob {
        job: String,
        spec: crate::jobs::JobSummary,
    },
    /// A process of job `job` maps file `file` writable (refused if another job does).
    ClaimWriter {
        file: FileId,
        job: String,
    },
    /// A process of job `job` no longer maps file `file` writable.
    ReleaseWriter {
        file: FileId,
        job: String,
    },
    /// `psls run` job `job` starts (or restarts): its record keeps what it runs and how it
    /// checkpoints. (After `StartJob`, so that votes of format 2 still read.)
    StartJobWith {
        job: String,
        spec: Box<crate::jobs::JobSummary>,
        options: Box<crate::jobs::JobOptions>,
    },
    /// The coordinator's verdict: incarnation `incarnation` of physical node `physical` (and
    /// every older one) is down for good.
    DeclareDown {
        physical: String,
        incarnation: u64,
    },
    /// Job `job`'s ranks all exited 0 and its last checkpoint holds their result, but its
    /// last persistent checkpoint failed (`why`): it stays resumable, to be written.
    JobFinished {
        job: String,
        why: String,
        files: Vec<FileId>,
        epoch: u64,
    },
    /// Job control: `psls run` job `job` starts (first start, or a resume after it ended);
    /// its record keeps what it runs and how it checkpoints, like `StartJobWith`.
    JobStart {
        job: String,
        spec: Box<crate::jobs::JobSummary>,
        options: Box<crate::jobs::JobOptions>,
        run: Box<crate::runs::RunRecord>,
    },
    /// Job control: start `attempt` of `job` is followed by `run` (its number plus one).
    JobRestart {
        job: String,
        attempt: u32,
        run: Box<crate::runs::RunRecord>,
    },
    /// Job control: start `attempt` of `job` moves to `phase`.
    JobPhase {
        job: String,
        attempt: u32,
        phase: crate::runs::RunPhase,
    },
    /// Job control: `job` halts at its next safe point.
    JobHalt {
        job: String,
    },
    /// Job control: `job` ended (its start `end.attempt`).
    JobEnd {
        job: String,
        end: crate::runs::JobEnd,
    },
    /// Physical node `physical`, which holds logical id `logical`, came back with a blank data
    /// folder (a replaced disk): as for a spare taking the id over, its copies are rebuilt from
    /// the other nodes' (`rebuilding`). The map is unchanged: its new incarnation (drawn from
    /// the clock) already outranks every earlier one, and a change of the id's assignment now
    /// would look like another restart to the jobs it runs.
    Rejoin {
        logical: u32,
        physical: String,
    },
    /// A process outside `psls run` (of `ext:` or `proc:` job `job`) on incarnation
    /// `incarnation` of node `node` maps file `file` writable (refused if another job does).
    /// Its claim goes with that incarnation: once it is down, the claim holds nothing.
    ClaimWriterOn {
        file: FileId,
        job: String,
        node: String,
        incarnation: u64,
    },
    /// That process no longer maps `file` writable.
    ReleaseWriterOn {
        file: FileId,
        job: String,
        node: String,
        incarnation: u64,
    },
    /// Physical node `physical` started as incarnation `incarnation` (submitted by that node
    /// itself, once per start): refused when that incarnation was declared down or a later one
    /// booted (the node then fences itself and starts above it).
    Boot {
        physical: String,
        incarnation: u64,
    },
}

/// Format 1 of the operation in a vote record (files of format 2).
#[derive(Deserialize)]
enum MetaOpV1 {
    InitMap {
        logical: BTreeMap<u32, String>,
    },
    CommitFile {
        meta: FileMetaV2,
        replaces: Option<FileId>,
        placed_at: Option<u64>,
    },
    RemoveFile {
        name: String,
        id: FileId,
    },
    Replace {
        logical: u32,
        physical: String,
    },
    RebuildDone {
        logical: u32,
        physical: String,
    },
}

impl From<MetaOpV1> for MetaOp {
    fn from(op: MetaOpV1) -> MetaOp {
        match op {
            MetaOpV1::InitMap { logical } => MetaOp::InitMap { logical },
            MetaOpV1::CommitFile {
                meta,
                replaces,
                placed_at,
            } => MetaOp::CommitFile {
                meta: meta.into(),
                replaces,
                placed_at,
            },
            MetaOpV1::RemoveFile { name, id } => MetaOp::RemoveFile { name, id },
            MetaOpV1::Replace { logical, physical } => MetaOp::Replace { logical, physical },
            MetaOpV1::RebuildDone { logical, physical } => MetaOp::RebuildDone { logical, physical },
        }
    }
}

impl MetaOp {
    /// The operation's name (metrics and logs): `commit_file`, `declare_down`, ...
    pub fn kind(&self) -> &'static str {
        match self {
            MetaOp::InitMap { .. } => "init_map",
            MetaOp::CommitFile { .. } => "commit_file",
            MetaOp::RemoveFile { .. } => "remove_file",
            MetaOp::Replace { .. } => "replace",
            MetaOp::RebuildDone { .. } => "rebuild_done",
            MetaOp::Rejoin { .. } => "rejoin",
            MetaOp::BeginCheckpoint { .. } => "begin_checkpoint",
            MetaOp::Checkpoint { .. } => "checkpoint",
            MetaOp::FenceCheckpoint { .. } => "fence_checkpoint",
            MetaOp::EndJob { .. } => "end_job",
            MetaOp::StartJob { .. } => "start_job",
            MetaOp::ClaimWriter { .. } => "claim_writer",
            MetaOp::ReleaseWriter { .. } => "release_writer",
            MetaOp::ClaimWriterOn { .. } => "claim_writer_on",
            MetaOp::ReleaseWriterOn { .. } => "release_writer_on",
            MetaOp::StartJobWith { .. } => "start_job_with",
            MetaOp::DeclareDown { .. } => "declare_down",
            MetaOp::Boot { .. } => "boot",
            MetaOp::JobFinished { .. } => "job_finished",
            MetaOp::JobStart { .. } => "job_start",
            MetaOp::JobRestart { .. } => "job_restart",
            MetaOp::JobPhase { .. } => "job_phase",
            MetaOp::JobHalt { .. } => "job_halt",
            MetaOp::JobEnd { .. } => "job_end",
        }
    }

    /// Whether `st` shows this operation's effect (a submitter whose coordinator changed
    /// mid-operation looks there to learn whether it was applied).
    pub fn reflected_in(&self, st: &MetaState) -> bool {
        match self {
            MetaOp::InitMap { .. } => !st.logical.is_empty(),
            MetaOp::CommitFile { meta, .. } => st.files.get(&meta.name).is_some_and(|f| f.id == meta.id),
            MetaOp::RemoveFile { name, id } => st.files.get(name).is_none_or(|f| f.id != *id),
            MetaOp::Replace { logical, physical } => st.logical.get(logical) == Some(physical),
            MetaOp::Rejoin { logical, physical } => st.rebuilding.get(logical).is_some_and(|r| &r.physical == physical),
            MetaOp::RebuildDone { logical, physical } => {
                st.logical.get(logical) == Some(physical)
                    && st.rebuilding.get(logical).is_none_or(|r| &r.physical != physical)
            }
            MetaOp::BeginCheckpoint { job, epoch } => st.job_floor(job) >= *epoch,
            MetaOp::Checkpoint { job, epoch, .. } => st.jobs.get(job).is_some_and(|r| r.epoch >= *epoch),
            MetaOp::FenceCheckpoint { job, epoch } => st.job_decided(job, *epoch).is_some(),
            MetaOp::EndJob { job } => !st.jobs.contains_key(job) && st.files_written_by(job).next().is_none(),
            // Counted claims: a resubmission cannot tell whether it was applied.
            MetaOp::ClaimWriter { .. }
            | MetaOp::ReleaseWriter { .. }
            | MetaOp::ClaimWriterOn { .. }
            | MetaOp::ReleaseWriterOn { .. } => false,
            MetaOp::StartJob { job, spec } => st.jobs.get(job).and_then(|r| r.spec.as_ref()) == Some(spec),
            MetaOp::StartJobWith { job, spec, options } => {
                st.jobs.get(job).and_then(|r| r.spec.as_ref()) == Some(&**spec)
                    && st.job_options.get(job) == Some(&**options)
            }
            MetaOp::DeclareDown { physical, incarnation } => st.is_down(physical, *incarnation),
            MetaOp::Boot { physical, incarnation } => st.up_from.get(physical).is_some_and(|u| u >= incarnation),
            MetaOp::JobFinished { job, why, files, epoch } => st
                .finished
                .get(job)
                .is_some_and(|f| f.why == *why && f.files == *files && f.epoch == *epoch),
            MetaOp::JobStart { job, run, .. } => st.runs.get(job) == Some(&**run),
            MetaOp::JobRestart { job, run, .. } => st.runs.get(job).is_some_and(|r| r.attempt >= run.attempt),
            MetaOp::JobPhase { job, attempt, phase } => st
                .runs
                .get(job)
                .is_some_and(|r| r.attempt == *attempt && r.phase == *phase),
            MetaOp::JobHalt { job } => st.runs.get(job).is_none_or(|r| r.halt),
            MetaOp::JobEnd { job, end } => st.ended.get(job).is_some_and(|(_, e)| e == end),
        }
    }
}

impl Replicated for MetaState {
    type Op = MetaOp;
    type Error = MetaError;
    fn seq(&self) -> u64 {
        self.seq
    }
    fn apply(&mut self, op: &MetaOp) -> Result<(), MetaError> {
        MetaState::apply(self, op)
    }
}

/// Checks a user-supplied file name.
pub fn validate_name(name: &str) -> Result<(), MetaError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(MetaError::Invalid(format!(
            "file name must be 1..={MAX_NAME_LEN} bytes"
        )));
    }
    if name.chars().any(|c| c.is_control() || c == '/') {
        return Err(MetaError::Invalid(
            "file name must not contain '/' or control characters".into(),
        ));
    }
    Ok(())
}

impl MetaState {
    /// Applies `op` as operation number `self.seq + 1`; on error `self` is unchanged (its
    /// sequence number too).
    pub fn apply(&mut self, op: &MetaOp) -> Result<(), MetaError> {
        let mut next = self.clone();
        next.change(op)?;
        next.seq += 1;
        *self = next;
        Ok(())
    }

    /// Applies `op` as entry `index` of the metadata log: on error only the index moves.
    pub fn apply_at(&mut self, index: u64, op: &MetaOp) -> Result<(), MetaError> {
        assert_eq!(index, self.seq + 1, "metadata operations apply in order");
        // The changed keys are not copied with the state: a failed operation's extra keys are
        // written with their unchanged values, but its deltas must go.
        let touched = std::mem::take(&mut self.touched);
        let mut next = self.clone();
        next.touched = touched;
        let r = next.change(op);
        if r.is_ok() {
            *self = next;
        } else {
            let mut t = std::mem::take(&mut next.touched);
            for ds in t.deltas.values_mut() {
                ds.retain(|(i, _)| *i != index);
            }
            t.deltas.retain(|_, ds| !ds.is_empty());
            self.touched = t;
        }
        self.seq = index;
        r
    }

    /// Entry `index` carries no operation: only the index moves.
    pub fn skip_to(&mut self, index: u64) {
        assert_eq!(index, self.seq + 1, "metadata operations apply in order");
        self.seq = index;
    }

    // ---- reads by key ----

    /// The file with id `id`.
    pub fn file_by_id(&self, id: FileId) -> Option<&FileMeta> {
        self.ids.get(&id).and_then(|n| self.files.get(n))
    }

    /// The files job `job` maps writable.
    pub fn files_written_by<'a>(&'a self, job: &str) -> impl Iterator<Item = &'a FileMeta> + 'a {
        self.writing
            .get(job)
            .into_iter()
            .flat_map(|ids| ids.iter())
            .filter_map(|id| self.file_by_id(*id))
    }

    // ---- changes, keeping the indexes and the changed keys ----

    /// Puts `meta` under its name (replacing whatever file was there).
    pub(crate) fn put_file(&mut self, meta: FileMeta) {
        let old = self.files.get(&meta.name).cloned();
        if let Some(old) = &old {
            if old.id == meta.id {
                self.unindex_writer(old);
            } else {
                self.unindex(old);
            }
            if old.written != meta.written {
                self.touched.gens.insert(old.id);
            }
        } else if meta.written.runs() > 0 {
            self.touched.gens.insert(meta.id);
        }
        if old.as_ref().is_some_and(|o| o.id != meta.id) {
            self.touched.gens.insert(meta.id);
        }
        if meta.top_gen() >= self.next_gen {
            self.set_next_gen(meta.top_gen() + 1);
        }
        if self.ids.insert(meta.id, meta.name.clone()).as_ref() != Some(&meta.name) {
            self.touched.ids.insert(meta.id);
        }
        if let Some((job, _)) = &meta.writer {
            self.writing.entry(job.clone()).or_default().insert(meta.id);
        }
        // Claims are of a file with a process job writing it.
        if meta
            .writer
            .as_ref()
            .is_none_or(|(j, _)| !(j.starts_with("ext:") || j.starts_with("proc:")))
            && self.process_claims.remove(&meta.id).is_some()
        {
            self.touched.claims = true;
        }
        if let Some(old) = old.as_ref().filter(|o| o.id != meta.id) {
            if self.process_claims.remove(&old.id).is_some() {
                self.touched.claims = true;
            }
        }
        if old.as_ref().is_none_or(|o| FileRecord::of(o) != FileRecord::of(&meta)) {
            self.touched.files.insert(meta.name.clone());
        }
        self.files.insert(meta.name.clone(), meta);
    }

    /// Sets pages `runs` of file `id` (which exists) to generation `gen`, as one delta row.
    pub(crate) fn set_gens(&mut self, id: FileId, runs: &[(u64, u64)], gen: u64) {
        let Some(name) = self.ids.get(&id).cloned() else {
            return;
        };
        let Some(f) = self.files.get_mut(&name) else {
            return;
        };
        for &(s, e) in runs {
            f.written.set(s, e, gen);
        }
        if gen >= self.next_gen {
            self.set_next_gen(gen + 1);
        }
        let index = self.seq + 1;
        let ds = self.touched.deltas.entry(id).or_default();
        match ds.last_mut() {
            Some((i, d)) if *i == index && d.gen == gen => d.runs.extend_from_slice(runs),
            Some((i, _)) if *i == index => {
                // Two generations from one operation: the whole map is simpler.
                self.touched.gens.insert(id);
            }
            _ => ds.push((
                index,
                GenDelta {
                    gen,
                    runs: runs.to_vec(),
                },
            )),
        }
    }

    /// Removes file `name`.
    pub(crate) fn remove_file(&mut self, name: &str) {
        if let Some(old) = self.files.remove(name) {
            self.unindex(&old);
            self.touched.files.insert(old.name.clone());
            self.touched.ids.insert(old.id);
            self.touched.gens.insert(old.id);
        }
    }

    fn unindex(&mut self, f: &FileMeta) {
        if self.ids.get(&f.id) == Some(&f.name) {
            self.ids.remove(&f.id);
            self.touched.ids.insert(f.id);
        }
        if self.process_claims.remove(&f.id).is_some() {
            self.touched.claims = true;
        }
        self.unindex_writer(f);
    }

    /// A process of `job` maps `file` writable: one more claim (refused if another job writes
    /// it; claims of processes gone with their node incarnation go first).
    fn claim_writer(&mut self, file: FileId, job: &str) -> Result<(), MetaError> {
        self.prune_claims(file);
        let Some(mut f) = self.file_by_id(file).cloned() else {
            return Err(MetaError::Invalid(format!("no file with id {file}")));
        };
        match &mut f.writer {
            Some((w, _)) if w != job => {
                return Err(MetaError::WriterBusy {
                    name: f.name.clone(),
                    job: w.clone(),
                })
            }
            Some((_, n)) => *n = n.saturating_add(1),
            None => f.writer = Some((job.to_string(), 1)),
        }
        self.put_file(f);
        Ok(())
    }

    /// A process of `job` no longer maps `file` writable: one claim less (the file is free at
    /// none); nothing if `job` does not write it.
    fn release_writer(&mut self, file: FileId, job: &str) {
        if let Some(mut f) = self.file_by_id(file).filter(|f| f.written_by(job)).cloned() {
            match &mut f.writer {
                Some((_, n)) if *n > 1 => *n -= 1,
                _ => f.writer = None,
            }
            self.put_file(f);
        }
    }

    /// Drops the claims on `file` made on node incarnations now down (their processes went
    /// with them): the writer's count falls by theirs, and at 0 the file is free.
    fn prune_claims(&mut self, file: FileId) {
        let Some(claims) = self.process_claims.get(&file) else {
            return;
        };
        let (dead, live): (ProcessClaims, ProcessClaims) = claims
            .iter()
            .map(|(k, n)| (k.clone(), *n))
            .partition(|((node, inc), _)| self.is_down(node, *inc));
        if dead.is_empty() {
            return;
        }
        let gone: u32 = dead.values().sum();
        self.touched.claims = true;
        if live.is_empty() {
            self.process_claims.remove(&file);
        } else {
            self.process_claims.insert(file, live);
        }
        if let Some(mut f) = self.file_by_id(file).cloned() {
            match &mut f.writer {
                Some((_, n)) if *n > gone => *n -= gone,
                _ => f.writer = None,
            }
            self.put_file(f);
        }
    }

    fn unindex_writer(&mut self, f: &FileMeta) {
        if let Some((job, _)) = &f.writer {
            if let Some(set) = self.writing.get_mut(job) {
                set.remove(&f.id);
                if set.is_empty() {
                    self.writing.remove(job);
                }
            }
        }
    }

    /// Job `job`'s checkpoint record (created empty if there is none).
    pub(crate) fn job_mut(&mut self, job: &str) -> &mut JobCkpt {
        self.touched.jobs.insert(job.to_string());
        self.jobs.entry(job.to_string()).or_default()
    }

    /// Marks job `job`'s records changed.
    pub(crate) fn touch_job(&mut self, job: &str) {
        self.touched.jobs.insert(job.to_string());
    }

    pub(crate) fn set_next_gen(&mut self, gen: u64) {
        self.next_gen = gen;
        self.touched.next_gen = true;
    }

    fn touch_nodes(&mut self) {
        self.touched.nodes = true;
    }

    /// Rebuilds the indexes from `files` (after decoding a state).
    fn reindex(&mut self) {
        self.ids = OrdMap::new();
        self.writing = OrdMap::new();
        for f in self.files.values() {
            self.ids.insert(f.id, f.name.clone());
            if let Some((job, _)) = &f.writer {
                self.writing.entry(job.clone()).or_default().insert(f.id);
            }
        }
    }

    /// A state decoded from a record of a format before the metadata log: its indexes rebuilt,
    /// and `next_gen` raised above every page generation (those formats found it by a scan).
    fn from_legacy(mut st: MetaState) -> MetaState {
        st.reindex();
        let top = st.files.values().map(|f| f.top_gen()).max().unwrap_or(0);
        st.next_gen = st.next_gen.max(top + 1);
        st
    }

    /// The keys changed since the last call, with their values now.
    ///
    /// A file whose generation map changed only by sets gets delta rows, until its deltas would
    /// outgrow its map (or number [`MAX_GEN_DELTAS`]): then its map is written whole instead,
    /// as a new base replacing every row of the file. So a checkpoint writes about what it
    /// changed (amortized: at most twice, with the folds), and a file's rows stay within
    /// twice its map.
    pub fn take_changes(&mut self) -> Changes {
        let mut t = std::mem::take(&mut self.touched);
        let mut deltas = Vec::new();
        for (id, ds) in std::mem::take(&mut t.deltas) {
            if t.gens.contains(&id) {
                continue;
            }
            let Some(f) = self.file_by_id(id) else {
                t.gens.insert(id);
                continue;
            };
            let map_bytes = 8 * f.written.runs() as u64;
            let (rows, bytes) = self.gen_rows.0.get(&id).copied().unwrap_or((0, 0));
            let rows = rows + ds.len() as u32;
            let bytes = bytes + ds.iter().map(|(_, d)| delta_bytes(d)).sum::<u64>();
            if rows > MAX_GEN_DELTAS || bytes > map_bytes {
                t.gens.insert(id);
            } else {
                self.gen_rows.0.insert(id, (rows, bytes));
                deltas.extend(ds.into_iter().map(|(i, d)| (id, i, d)));
            }
        }
        for id in &t.gens {
            self.gen_rows.0.remove(id);
        }
        let mut c = self.changes_of(t);
        c.gen_deltas = deltas;
        c
    }

    /// The whole state as changes (after it replaced another).
    pub fn all_changes(&self) -> Changes {
        let mut t = Touched {
            nodes: true,
            next_gen: true,
            claims: true,
            up_from: true,
            ..Touched::default()
        };
        for f in self.files.values() {
            t.files.insert(f.name.clone());
            t.ids.insert(f.id);
            if f.written.runs() > 0 {
                t.gens.insert(f.id);
            }
        }
        t.jobs.extend(self.jobs.keys().cloned());
        t.jobs.extend(self.job_options.keys().cloned());
        t.jobs.extend(self.finished.keys().cloned());
        t.jobs.extend(self.runs.keys().cloned());
        t.jobs.extend(self.ended.keys().cloned());
        self.changes_of(t)
    }

    fn changes_of(&self, t: Touched) -> Changes {
        let runs = t
            .jobs
            .iter()
            .map(|j| {
                let row = crate::runs::RunRow {
                    run: self.runs.get(j).cloned(),
                    end: self.ended.get(j).cloned(),
                };
                (j.clone(), (row.run.is_some() || row.end.is_some()).then_some(row))
            })
            .collect();
        Changes {
            runs,
            files: t
                .files
                .into_iter()
                .map(|n| {
                    let rec = self.files.get(&n).map(FileRecord::of);
                    (n, rec)
                })
                .collect(),
            ids: t.ids.into_iter().map(|id| (id, self.ids.get(&id).cloned())).collect(),
            gens: t
                .gens
                .into_iter()
                .map(|id| {
                    let g = self.file_by_id(id).map(|f| f.written.clone()).filter(|g| g.runs() > 0);
                    (id, g)
                })
                .collect(),
            jobs: t
                .jobs
                .into_iter()
                .map(|j| {
                    let rec = JobRecord {
                        ckpt: self.jobs.get(&j).cloned(),
                        options: self.job_options.get(&j).cloned(),
                        finished: self.finished.get(&j).cloned(),
                    };
                    let rec = (rec.ckpt.is_some() || rec.options.is_some() || rec.finished.is_some()).then_some(rec);
                    (j, rec)
                })
                .collect(),
            nodes: t.nodes.then(|| NodesRecord {
                logical: self.logical.clone(),
                map_version: self.map_version,
                rebuilding: self.rebuilding.clone(),
                assigned: self.assigned.clone(),
                down: self.down.clone(),
            }),
            next_gen: t.next_gen.then_some(self.next_gen),
            claims: t
                .claims
                .then(|| self.process_claims.iter().map(|(f, c)| (*f, c.clone())).collect()),
            up_from: t.up_from.then(|| self.up_from.clone()),
            gen_deltas: Vec::new(),
        }
    }

    /// Validates `op` and makes its changes; on error the state may be half changed (callers
    /// work on a clone).
    fn change(&mut self, op: &MetaOp) -> Result<(), MetaError> {
        match op {
            MetaOp::InitMap { logical } => {
                if self.logical.is_empty() {
                    self.logical = logical.clone();
                    self.map_version += 1;
                    self.touch_nodes();
                }
            }
            MetaOp::CommitFile {
                meta,
                replaces,
                placed_at,
            } => {
                validate_name(&meta.name)?;
                if placed_at.is_some_and(|v| v != self.map_version) {
                    return Err(MetaError::Invalid(
                        "a node was replaced while the file was written; nothing was committed (write it again)".into(),
                    ));
                }
                match (self.files.get(&meta.name), replaces) {
                    (Some(_), None) => return Err(MetaError::Exists(meta.name.clone())),
                    (Some(cur), Some(old)) if cur.id != *old => {
                        return Err(MetaError::Conflict {
                            name: meta.name.clone(),
                            expected: *old,
                            found: cur.id,
                        })
                    }
                    (None, Some(old)) => {
                        return Err(MetaError::Conflict {
                            name: meta.name.clone(),
                            expected: *old,
                            found: FileId(0),
                        })
                    }
                    _ => {}
                }
                if self.ids.get(&meta.id).is_some_and(|n| *n != meta.name) {
                    return Err(MetaError::Invalid(format!("file id {} already in use", meta.id)));
                }
                self.put_file(meta.clone());
            }
            MetaOp::RemoveFile { name, id } => match self.files.get(name) {
                Some(f) if f.id == *id => self.remove_file(name),
                Some(f) => {
                    return Err(MetaError::Conflict {
                        name: name.clone(),
                        expected: *id,
                        found: f.id,
                    })
                }
                None => return Err(MetaError::NotFound(name.clone())),
            },
            MetaOp::Replace { logical, physical } => {
                if !self.logical.contains_key(logical) {
                    return Err(MetaError::Invalid(format!("no logical node {logical}")));
                }
                if self.logical.values().any(|p| p == physical) {
                    return Err(MetaError::Invalid(format!("{physical} already holds a logical id")));
                }
                self.logical.insert(*logical, physical.clone());
                self.map_version += 1;
                self.assigned.insert(*logical, self.map_version);
                self.rebuilding.insert(
                    *logical,
                    Rebuild {
                        physical: physical.clone(),
                    },
                );
                self.touch_nodes();
            }
            MetaOp::Rejoin { logical, physical } => {
                if self.logical.get(logical) != Some(physical) {
                    return Err(MetaError::Invalid(format!(
                        "{physical} does not hold logical id {logical}"
                    )));
                }
                self.rebuilding.insert(
                    *logical,
                    Rebuild {
                        physical: physical.clone(),
                    },
                );
                self.touch_nodes();
            }
            MetaOp::RebuildDone { logical, physical } => {
                if self.rebuilding.get(logical).map(|r| &r.physical) == Some(physical) {
                    self.rebuilding.remove(logical);
                    self.touch_nodes();
                }
            }
            MetaOp::Checkpoint {
                job,
                epoch,
                gen,
                placed_at,
                files,
                at_unix_ms,
                bytes,
            } => crate::jobs::apply_checkpoint(self, job, *epoch, *gen, *placed_at, files, *at_unix_ms, *bytes)?,
            MetaOp::BeginCheckpoint { job, epoch } => crate::jobs::apply_begin(self, job, *epoch)?,
            MetaOp::FenceCheckpoint { job, epoch } => crate::jobs::apply_fence(self, job, *epoch)?,
            MetaOp::EndJob { job } => {
                self.touch_job(job);
                self.jobs.remove(job);
                self.job_options.remove(job);
                self.finished.remove(job);
                let written: Vec<FileMeta> = self.files_written_by(job).cloned().collect();
                for mut f in written {
                    f.writer = None;
                    self.put_file(f);
                }
            }
            MetaOp::StartJob { job, spec } => crate::jobs::apply_start(self, job, spec)?,
            MetaOp::StartJobWith { job, spec, options } => {
                // A new start computes again: a finished result it had is not its any more.
                self.finished.remove(job);
                crate::jobs::apply_start_with(self, job, spec, options)?
            }
            MetaOp::Boot { physical, incarnation } => {
                if physical.is_empty() || *incarnation == 0 {
                    return Err(MetaError::Invalid("a boot names a node and an incarnation".into()));
                }
                if let Some(&d) = self.down.get(physical).filter(|&&d| d >= *incarnation) {
                    return Err(MetaError::Invalid(format!(
                        "incarnation {incarnation} of {physical} was declared down (verdicts up to {d}): it must start as a later one"
                    )));
                }
                match self.up_from.get(physical).copied() {
                    Some(u) if u > *incarnation => {
                        return Err(MetaError::Invalid(format!(
                            "{physical} already started as incarnation {u}, later than {incarnation}: it must start as a later one"
                        )))
                    }
                    Some(u) if u == *incarnation => {}
                    _ => {
                        if !self.up_from.contains_key(physical) && self.up_from.len() >= MAX_BOOTED_NODES {
                            return Err(MetaError::Invalid(format!(
                                "the metadata records {MAX_BOOTED_NODES} nodes' incarnations: no room for {physical}"
                            )));
                        }
                        self.up_from.insert(physical.clone(), *incarnation);
                        self.touched.up_from = true;
                    }
                }
            }
            MetaOp::DeclareDown { physical, incarnation } => {
                if physical.is_empty() || *incarnation == 0 {
                    return Err(MetaError::Invalid(
                        "a down verdict names a node and an incarnation".into(),
                    ));
                }
                let d = self.down.entry(physical.clone()).or_insert(0);
                *d = (*d).max(*incarnation);
                self.touch_nodes();
                // The claims of that node's processes went with them.
                let claimed: Vec<FileId> = self
                    .process_claims
                    .iter()
                    .filter(|(_, c)| c.keys().any(|(n, _)| n == physical))
                    .map(|(f, _)| *f)
                    .collect();
                for f in claimed {
                    self.prune_claims(f);
                }
            }
            MetaOp::JobFinished { job, why, files, epoch } => {
                // Its result is in a memory checkpoint (which has no record): the job's record
                // is what must exist.
                if !self.jobs.contains_key(job) {
                    return Err(MetaError::Invalid(format!("no job {job} to keep the result of")));
                }
                if why.len() > MAX_WHY_LEN || files.len() > MAX_FINISHED_FILES {
                    return Err(MetaError::Invalid(format!(
                        "a finished job keeps a reason of at most {MAX_WHY_LEN} bytes and at most {MAX_FINISHED_FILES} files"
                    )));
                }
                // The job keeps writing its files until its result is written (a rank's late
                // release of its own claim leaves this one).
                for id in files {
                    let Some(mut f) = self.file_by_id(*id).cloned() else {
                        return Err(MetaError::Invalid(format!("no file with id {id}")));
                    };
                    match &mut f.writer {
                        Some((w, _)) if w != job => {
                            return Err(MetaError::Invalid(format!("'{}' is written by job {w} now", f.name)))
                        }
                        Some((_, n)) => *n = n.saturating_add(1),
                        None => f.writer = Some((job.clone(), 1)),
                    }
                    self.put_file(f);
                }
                let kept = Finished {
                    why: why.clone(),
                    files: files.clone(),
                    epoch: *epoch,
                };
                self.touch_job(job);
                self.finished.insert(job.clone(), kept);
            }
            MetaOp::JobStart {
                job,
                spec,
                options,
                run,
            } => {
                // A resume keeps a finished result to write (`finished`); a restart drops it.
                crate::runs::apply_start(self, job, run)?;
                crate::jobs::apply_start_with(self, job, spec, options)?
            }
            MetaOp::JobRestart { job, attempt, run } => crate::runs::apply_restart(self, job, *attempt, run)?,
            MetaOp::JobPhase { job, attempt, phase } => crate::runs::apply_phase(self, job, *attempt, phase)?,
            MetaOp::JobHalt { job } => crate::runs::apply_halt(self, job)?,
            MetaOp::JobEnd { job, end } => {
                let index = self.seq + 1;
                crate::runs::apply_end(self, index, job, end)?
            }
            MetaOp::ClaimWriter { file, job } => {
                crate::jobs::validate_job(job)?;
                self.claim_writer(*file, job)?;
            }
            MetaOp::ReleaseWriter { file, job } => self.release_writer(*file, job),
            MetaOp::ClaimWriterOn {
                file,
                job,
                node,
                incarnation,
            } => {
                crate::jobs::validate_job(job)?;
                if !(job.starts_with("ext:") || job.starts_with("proc:")) || node.is_empty() || *incarnation == 0 {
                    return Err(MetaError::Invalid(format!(
                        "a claim of a node's process names an ext: or proc: job, a node and an incarnation (not {job})"
                    )));
                }
                if self.is_down(node, *incarnation) {
                    return Err(MetaError::Invalid(format!("{node} incarnation {incarnation} is down")));
                }
                if !self.process_claims.contains_key(file) && self.process_claims.len() >= MAX_PROCESS_CLAIMED_FILES {
                    return Err(MetaError::Invalid(format!(
                        "processes outside psls run claim {MAX_PROCESS_CLAIMED_FILES} files already"
                    )));
                }
                self.claim_writer(*file, job)?;
                let mut claims = self.process_claims.get(file).cloned().unwrap_or_default();
                let n = claims.entry((node.clone(), *incarnation)).or_insert(0);
                *n = n.saturating_add(1);
                self.process_claims.insert(*file, claims);
                self.touched.claims = true;
            }
            MetaOp::ReleaseWriterOn {
                file,
                job,
                node,
                incarnation,
            } => {
                self.prune_claims(*file);
                let key = (node.clone(), *incarnation);
                let held = self.process_claims.get(file).is_some_and(|c| c.contains_key(&key))
                    && self.file_by_id(*file).is_some_and(|f| f.written_by(job));
                if held {
                    let mut claims = self.process_claims.get(file).cloned().unwrap_or_default();
                    if let Some(n) = claims.get_mut(&key) {
                        *n -= 1;
                        if *n == 0 {
                            claims.remove(&key);
                        }
                    }
                    self.process_claims.insert(*file, claims);
                    self.touched.claims = true;
                    self.release_writer(*file, job);
                }
            }
        }
        Ok(())
    }

    /// Encodes the state (format version first).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = SNAPSHOT_FORMAT.to_le_bytes().to_vec();
        out.extend(postcard::to_stdvec(self).expect("MetaState serializes"));
        out.extend(postcard::to_stdvec(&(&self.runs, &self.ended)).expect("job records serialize"));
        // Optional (older snapshots end before it; older builds ignore it).
        let claims: BTreeMap<FileId, ProcessClaims> =
            self.process_claims.iter().map(|(f, c)| (*f, c.clone())).collect();
        out.extend(postcard::to_stdvec(&claims).expect("claims serialize"));
        // Optional too (snapshots before it end after the claims).
        out.extend(postcard::to_stdvec(&self.up_from).expect("incarnations serialize"));
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<MetaState, MetaError> {
        if bytes.len() < 2 {
            return Err(MetaError::Corrupt("metadata record too short".into()));
        }
        let v = u16::from_le_bytes([bytes[0], bytes[1]]);
        let corrupt = |e: postcard::Error| MetaError::Corrupt(e.to_string());
        match v {
            SNAPSHOT_FORMAT => {
                let (mut st, rest): (MetaState, _) = postcard::take_from_bytes(&bytes[2..]).map_err(corrupt)?;
                let (jobs, rest) = postcard::take_from_bytes(rest).map_err(corrupt)?;
                (st.runs, st.ended) = jobs;
                if !rest.is_empty() {
                    let (claims, rest): (BTreeMap<FileId, ProcessClaims>, _) =
                        postcard::take_from_bytes(rest).map_err(corrupt)?;
                    st.process_claims = claims.into_iter().collect();
                    if !rest.is_empty() {
                        st.up_from = postcard::from_bytes(rest).map_err(corrupt)?;
                    }
                }
                st.reindex();
                Ok(st)
            }
            6 => postcard::from_bytes(&bytes[2..])
                .map_err(corrupt)
                .map(|mut st: MetaState| {
                    st.reindex();
                    st
                }),
            5 => postcard::from_bytes(&bytes[2..])
                .map_err(corrupt)
                .map(MetaState::from_legacy),
            4 => {
                let old: MetaStateV4 = postcard::from_bytes(&bytes[2..]).map_err(corrupt)?;
                Ok(MetaState::from_legacy(MetaState {
                    seq: old.seq,
                    files: old.files.into_iter().collect(),
                    logical: old.logical,
                    map_version: old.map_version,
                    rebuilding: old.rebuilding,
                    assigned: old.assigned,
                    jobs: old.jobs.into_iter().collect(),
                    next_gen: old.next_gen,
                    job_options: old.job_options.into_iter().collect(),
                    down: BTreeMap::new(),
                    finished: OrdMap::new(),
                    ..MetaState::default()
                }))
            }
            3 => {
                let old: MetaStateV3 = postcard::from_bytes(&bytes[2..]).map_err(corrupt)?;
                Ok(MetaState::from_legacy(MetaState {
                    seq: old.seq,
                    files: old.files.into_iter().collect(),
                    logical: old.logical,
                    map_version: old.map_version,
                    rebuilding: old.rebuilding,
                    assigned: old.assigned,
                    jobs: old.jobs.into_iter().collect(),
                    next_gen: old.next_gen,
                    job_options: OrdMap::new(),
                    down: BTreeMap::new(),
                    finished: OrdMap::new(),
                    ..MetaState::default()
                }))
            }
            2 => {
                let old: MetaStateV2 = postcard::from_bytes(&bytes[2..]).map_err(corrupt)?;
                Ok(MetaState::from_legacy(MetaState {
                    seq: old.seq,
                    files: files_v2(old.files).into_iter().collect(),
                    logical: old.logical,
                    map_version: old.map_version,
                    rebuilding: old.rebuilding,
                    assigned: old.assigned,
                    jobs: OrdMap::new(),
                    next_gen: 0,
                    job_options: OrdMap::new(),
                    down: BTreeMap::new(),
                    finished: OrdMap::new(),
                    ..MetaState::default()
                }))
            }
            1 => {
                let old: MetaStateV1 = postcard::from_bytes(&bytes[2..]).map_err(corrupt)?;
                Ok(MetaState::from_legacy(MetaState {
                    seq: old.seq,
                    files: files_v2(old.files).into_iter().collect(),
                    logical: old.logical,
                    map_version: old.map_version,
                    rebuilding: old.rebuilding,
                    assigned: BTreeMap::new(),
                    jobs: OrdMap::new(),
                    next_gen: 0,
                    job_options: OrdMap::new(),
                    down: BTreeMap::new(),
                    finished: OrdMap::new(),
                    ..MetaState::default()
                }))
            }
            v => Err(MetaError::Corrupt(format!("unknown metadata format version {v}"))),
        }
    }

    /// Whether incarnation `incarnation` of `physical` was declared down (committed verdict).
    pub fn is_down(&self, physical: &str, incarnation: u64) -> bool {
        self.down.get(physical).is_some_and(|&d| d >= incarnation)
    }

    /// The epoch `job`'s next checkpoint must be above ([`crate::jobs::floor`]).
    pub fn job_floor(&self, job: &str) -> u64 {
        crate::jobs::floor(&self.jobs, job)
    }

    /// Whether epoch `epoch` of `job` committed ([`crate::jobs::decided`]).
    pub fn job_decided(&self, job: &str, epoch: u64) -> Option<bool> {
        crate::jobs::decided(&self.jobs, job, epoch)
    }

    /// The generation of logical id `logical`'s current physical node: 0 for its initial node,
    /// then the map version at which each replacement took effect (so it only grows).
    pub fn assignment(&self, logical: u32) -> u64 {
        self.assigned.get(&logical).copied().unwrap_or(0)
    }
}

/// redb storage backend over a [`DiskFile`], so metadata obeys the same durability contract
/// (and the same fault injection) as page data.
#[derive(Debug)]
pub(crate) struct Backend(pub(crate) Arc<dyn DiskFile>);

impl redb::StorageBackend for Backend {
    fn len(&self) -> Result<u64, io::Error> {
        self.0.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        if offset + out.len() as u64 > self.0.len()? {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past end of metadata file",
            ));
        }
        self.0.read_at(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        self.0.set_len(len)
    }
    fn sync_data(&self) -> Result<(), io::Error> {
        self.0.sync()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        self.0.write_at(offset, data)
    }
}

/// The durable replica of [`MetaState`] on one node, with its replication vote.
pub struct MetaStore {
    db: redb::Database,
    state: MetaState,
    vote: Vote,
}

impl std::fmt::Debug for MetaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaStore").field("seq", &self.state.seq).finish()
    }
}

pub(crate) fn decode_vote(bytes: &[u8]) -> Result<Vote, MetaError> {
    if bytes.len() < 2 {
        return Err(MetaError::Corrupt("vote record too short".into()));
    }
    let corrupt = |e: postcard::Error| MetaError::Corrupt(e.to_string());
    match u16::from_le_bytes([bytes[0], bytes[1]]) {
        VOTE_FORMAT => postcard::from_bytes(&bytes[2..]).map_err(corrupt),
        1 => {
            let (promised, accepted): (Epoch, Option<Accepted<MetaOpV1>>) =
                postcard::from_bytes(&bytes[2..]).map_err(corrupt)?;
            let accepted = accepted.map(|a| Accepted {
                epoch: a.epoch,
                seq: a.seq,
                op: a.op.into(),
            });
            Ok((promised, accepted))
        }
        v => Err(MetaError::Corrupt(format!("unknown vote format version {v}"))),
    }
}

impl MetaStore {
    /// Opens (or creates) `meta.redb` on `disk`.
    pub fn open(disk: &dyn Disk) -> Result<MetaStore, MetaError> {
        let file = disk
            .open("meta.redb", true)
            .map_err(|e| MetaError::Db(format!("open meta.redb: {e}")))?;
        disk.sync_dir()
            .map_err(|e| MetaError::Db(format!("fsync directory: {e}")))?;
        let db = redb::Database::builder().create_with_backend(Backend(file))?;
        let (state, vote) = {
            let tx = db.begin_read()?;
            let state = match tx.open_table(META_TABLE) {
                Ok(t) => match t.get(STATE_KEY)? {
                    Some(v) => MetaState::decode(v.value())?,
                    None => MetaState::default(),
                },
                Err(redb::TableError::TableDoesNotExist(_)) => MetaState::default(),
                Err(e) => return Err(e.into()),
            };
            let vote = match tx.open_table(VOTE_TABLE) {
                Ok(t) => match t.get(VOTE_KEY)? {
                    Some(v) => decode_vote(v.value())?,
                    None => (Epoch::default(), None),
                },
                Err(redb::TableError::TableDoesNotExist(_)) => (Epoch::default(), None),
                Err(e) => return Err(e.into()),
            };
            (state, vote)
        };
        Ok(MetaStore { db, state, vote })
    }

    pub fn state(&self) -> &MetaState {
        &self.state
    }

    /// Everything replication keeps on disk (to restart its state machine from).
    pub fn durable(&self) -> Durable<MetaState> {
        Durable {
            promised: self.vote.0,
            committed: self.state.clone(),
            accepted: self.vote.1.clone(),
        }
        .normalized()
    }

    fn persist(&mut self, next: MetaState) -> Result<(), MetaError> {
        let tx = self.db.begin_write()?;
        {
            let mut t = tx.open_table(META_TABLE)?;
            t.insert(STATE_KEY, next.encode().as_slice())?;
        }
        tx.commit()?;
        self.state = next;
        Ok(())
    }

    /// Validates, applies and durably records `op` as the next operation.
    pub fn apply(&mut self, op: &MetaOp) -> Result<(), MetaError> {
        let mut next = self.state.clone();
        next.apply(op)?;
        self.persist(next)
    }

    /// Replaces the whole state (a newer committed state from replication).
    pub fn install(&mut self, state: MetaState) -> Result<(), MetaError> {
        self.persist(state)
    }

    /// Durably records the replication vote: the epoch promised and the operation accepted.
    pub fn persist_vote(&mut self, promised: Epoch, accepted: Option<Accepted<MetaOp>>) -> Result<(), MetaError> {
        let vote: Vote = (promised, accepted);
        let mut rec = VOTE_FORMAT.to_le_bytes().to_vec();
        rec.extend(postcard::to_stdvec(&vote).map_err(|e| MetaError::Corrupt(e.to_string()))?);
        let tx = self.db.begin_write()?;
        {
            let mut t = tx.open_table(VOTE_TABLE)?;
            t.insert(VOTE_KEY, rec.as_slice())?;
        }
        tx.commit()?;
        self.vote = vote;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FaultDisk, FileDisk};

    fn meta(name: &str, id: u64) -> FileMeta {
        FileMeta {
            id: FileId(id),
            name: name.into(),
            size: 10_000,
            uid: 1,
            gid: 1,
            mode: 0o644,
            gen: 1,
            created_unix_ms: 0,
            written: PageGens::default(),
            writer: None,
        }
    }

    #[test]
    fn ops_validate_and_persist() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        {
            let mut m = MetaStore::open(&disk).unwrap();
            m.apply(&MetaOp::CommitFile {
                meta: meta("a", 1),
                replaces: None,
                placed_at: None,
            })
            .unwrap();
            assert!(matches!(
                m.apply(&MetaOp::CommitFile {
                    meta: meta("a", 2),
                    replaces: None,
                    placed_at: None,
                }),
                Err(MetaError::Exists(_))
            ));
            assert!(matches!(
                m.apply(&MetaOp::CommitFile {
                    meta: meta("a", 3),
                    replaces: Some(FileId(9)),
                    placed_at: None,
                }),
                Err(MetaError::Conflict { .. })
            ));
            m.apply(&MetaOp::CommitFile {
                meta: meta("a", 3),
                replaces: Some(FileId(1)),
                placed_at: None,
            })
            .unwrap();
            assert!(m
                .apply(&MetaOp::CommitFile {
                    meta: meta("b/c", 4),
                    replaces: None,
                    placed_at: None,
                })
                .is_err());
            assert!(matches!(
                m.apply(&MetaOp::RemoveFile {
                    name: "zz".into(),
                    id: FileId(1)
                }),
                Err(MetaError::NotFound(_))
            ));
            assert_eq!(m.state().seq, 2);
            assert_eq!(m.state().files["a"].pages(), 3);
        }
        let m = MetaStore::open(&disk).unwrap();
        assert_eq!(m.state().seq, 2);
        assert_eq!(m.state().files["a"].id, FileId(3));
    }

    #[test]
    fn the_vote_survives_a_reopen_and_ops_tell_whether_they_are_reflected() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        let op = MetaOp::CommitFile {
            meta: meta("a", 5),
            replaces: None,
            placed_at: Some(0),
        };
        {
            let m = MetaStore::open(&disk).unwrap();
            assert_eq!(m.durable().promised, Epoch::default(), "a new store promised nothing");
            let mut m = m;
            let acc = Accepted {
                epoch: Epoch { n: 3, by: 1 },
                seq: 1,
                op: op.clone(),
            };
            m.persist_vote(Epoch { n: 4, by: 2 }, Some(acc.clone())).unwrap();
        }
        let mut m = MetaStore::open(&disk).unwrap();
        let d = m.durable();
        assert_eq!(d.promised, Epoch { n: 4, by: 2 });
        assert_eq!(d.accepted.as_ref().map(|a| a.seq), Some(1));
        assert!(!op.reflected_in(m.state()));
        m.apply(&op).unwrap();
        assert!(op.reflected_in(m.state()));
        drop(m);
        let m = MetaStore::open(&disk).unwrap();
        assert!(
            m.durable().accepted.is_none(),
            "an accepted op the state covers is dropped"
        );
        let rm = MetaOp::RemoveFile {
            name: "a".into(),
            id: FileId(5),
        };
        assert!(!rm.reflected_in(m.state()));
    }

    #[test]
    fn a_file_placed_with_an_older_map_is_not_committed() {
        let mut s = MetaState::default();
        let map: BTreeMap<u32, String> = (0..4).map(|i| (i, format!("n{i}"))).collect();
        s.apply(&MetaOp::InitMap { logical: map }).unwrap();
        let placed_at = Some(s.map_version);
        s.apply(&MetaOp::Replace {
            logical: 2,
            physical: "s0".into(),
        })
        .unwrap();
        let op = MetaOp::CommitFile {
            meta: meta("late", 9),
            replaces: None,
            placed_at,
        };
        let e = s.clone().apply(&op).unwrap_err();
        assert!(e.to_string().contains("replaced while the file was written"), "{e}");
        let op = MetaOp::CommitFile {
            meta: meta("late", 9),
            replaces: None,
            placed_at: Some(s.map_version),
        };
        s.apply(&op).unwrap();
    }

    #[test]
    fn replace_map() {
        let mut s = MetaState::default();
        let map: BTreeMap<u32, String> = (0..4).map(|i| (i, format!("n{i}"))).collect();
        s.apply(&MetaOp::InitMap { logical: map.clone() }).unwrap();
        s.apply(&MetaOp::InitMap {
            logical: BTreeMap::new(),
        })
        .unwrap();
        assert_eq!(s.logical, map);
        assert!(s
            .apply(&MetaOp::Replace {
                logical: 2,
                physical: "n3".into()
            })
            .is_err());
        assert!(s
            .apply(&MetaOp::Replace {
                logical: 9,
                physical: "s0".into()
            })
            .is_err());
        s.apply(&MetaOp::Replace {
            logical: 2,
            physical: "s0".into(),
        })
        .unwrap();
        assert_eq!(s.logical[&2], "s0");
        assert!(s.rebuilding.contains_key(&2));
        s.apply(&MetaOp::RebuildDone {
            logical: 2,
            physical: "s0".into(),
        })
        .unwrap();
        assert!(s.rebuilding.is_empty());
        // Assignment generations only grow, and only for the replaced id.
        assert_eq!((s.assignment(2), s.assignment(1)), (s.map_version, 0));
        let first = s.assignment(2);
        s.apply(&MetaOp::Replace {
            logical: 2,
            physical: "s1".into(),
        })
        .unwrap();
        assert!(s.assignment(2) > first);
        assert_eq!(MetaState::decode(&s.encode()).unwrap(), s);
        assert!(MetaState::decode(&[9, 9, 1]).is_err());
        assert!(MetaState::decode(&[1]).is_err());
        // A format-1 record (no `assigned`) still reads, with every id on its first node.
        #[derive(Serialize)]
        struct V1<'a>(
            u64,
            &'a OrdMap<String, FileMeta>,
            &'a BTreeMap<u32, String>,
            u64,
            &'a BTreeMap<u32, Rebuild>,
        );
        let mut v1 = 1u16.to_le_bytes().to_vec();
        v1.extend(postcard::to_stdvec(&V1(s.seq, &s.files, &s.logical, s.map_version, &s.rebuilding)).unwrap());
        let old = MetaState::decode(&v1).unwrap();
        assert_eq!((old.seq, &old.logical, old.assignment(2)), (s.seq, &s.logical, 0));
    }

    /// A checkpoint's changes are its generation deltas, its job and `next_gen`: not its files'
    /// records, ids or whole maps; deltas fold into a base before they outgrow the map, and a
    /// failed operation leaves no delta.
    #[test]
    fn a_checkpoint_changes_its_deltas_only_and_folds_them_in_bounds() {
        let mut s = MetaState::default();
        let mut f = meta("a", 7);
        f.size = 4096 * PAGE_SIZE as u64;
        let mut index = 0;
        let mut apply = |s: &mut MetaState, op: &MetaOp| {
            index += 1;
            s.apply_at(index, op)
        };
        apply(
            &mut s,
            &MetaOp::InitMap {
                logical: (0..2).map(|i| (i, format!("n{i}"))).collect(),
            },
        )
        .unwrap();
        apply(
            &mut s,
            &MetaOp::CommitFile {
                meta: f,
                replaces: None,
                placed_at: None,
            },
        )
        .unwrap();
        apply(
            &mut s,
            &MetaOp::ClaimWriter {
                file: FileId(7),
                job: "j".into(),
            },
        )
        .unwrap();
        let _ = s.take_changes();
        let (mut deltas, mut folds) = (0, 0);
        let mut replay = MetaState::default();
        replay.load(s.all_changes());
        for epoch in 1..=300u64 {
            apply(&mut s, &MetaOp::BeginCheckpoint { job: "j".into(), epoch }).unwrap();
            let gen = s.jobs["j"].started_gen;
            let runs: Vec<(u64, u64)> = (0..4).map(|k| (k * 1000 + epoch, k * 1000 + epoch + 3)).collect();
            let bad = MetaOp::Checkpoint {
                job: "j".into(),
                epoch,
                gen,
                placed_at: 1,
                files: vec![
                    FileRuns {
                        file: FileId(7),
                        runs: runs.clone(),
                    },
                    FileRuns {
                        file: FileId(99),
                        runs: vec![(0, 1)],
                    },
                ],
                at_unix_ms: 5,
                bytes: 4096,
            };
            assert!(apply(&mut s, &bad).is_err(), "names a file that does not exist");
            let good = MetaOp::Checkpoint {
                job: "j".into(),
                epoch,
                gen,
                placed_at: 1,
                files: vec![FileRuns { file: FileId(7), runs }],
                at_unix_ms: 5,
                bytes: 4096,
            };
            apply(&mut s, &good).unwrap();
            let c = s.take_changes();
            assert!(c.files.is_empty() && c.ids.is_empty(), "epoch {epoch}: {c:?}");
            assert_eq!(c.jobs.len(), 1);
            assert!(
                c.gen_deltas.iter().all(|(_, i, _)| *i == s.seq),
                "only the good operation's delta"
            );
            match (c.gens.len(), c.gen_deltas.len()) {
                (0, 1) => deltas += 1,
                (1, 0) => folds += 1,
                other => panic!("epoch {epoch}: {other:?}"),
            }
            let (rows, bytes) = s.gen_rows.0.get(&FileId(7)).copied().unwrap_or((0, 0));
            assert!(rows <= MAX_GEN_DELTAS && bytes <= 8 * s.files["a"].written.runs() as u64);
            replay.load(c);
            assert_eq!(replay.files["a"].written, s.files["a"].written, "epoch {epoch}");
        }
        assert!(deltas > 200 && folds > 2, "{deltas} deltas, {folds} folds");
    }

    #[test]
    fn checkpoints_commit_once_above_every_earlier_epoch_and_set_page_generations() {
        let mut s = MetaState::default();
        let map: BTreeMap<u32, String> = (0..4).map(|i| (i, format!("n{i}"))).collect();
        s.apply(&MetaOp::InitMap { logical: map }).unwrap();
        let mut f = meta("a", 7);
        f.size = 10 * PAGE_SIZE as u64;
        s.apply(&MetaOp::CommitFile {
            meta: f,
            replaces: None,
            placed_at: None,
        })
        .unwrap();
        let ck = |epoch: u64, gen: u64, runs: Vec<(u64, u64)>| MetaOp::Checkpoint {
            job: "j".into(),
            epoch,
            gen,
            placed_at: 1,
            files: vec![FileRuns { file: FileId(7), runs }],
            at_unix_ms: 5,
            bytes: 4096,
        };
        let begin = |epoch: u64| MetaOp::BeginCheckpoint { job: "j".into(), epoch };
        assert_eq!(s.job_decided("j", 1), None);
        assert!(s.clone().apply(&ck(1, 2, vec![(2, 4)])).is_err(), "not begun");
        s.apply(&begin(1)).unwrap();
        assert_eq!(s.jobs["j"].started_gen, 2, "above the file's generation 1");
        assert!(s.clone().apply(&begin(1)).is_err(), "begun twice");
        assert!(s.clone().apply(&ck(1, 5, vec![(2, 4)])).is_err(), "another generation");
        s.apply(&ck(1, 2, vec![(2, 4)])).unwrap();
        let fm = &s.files["a"];
        assert_eq!(
            (fm.page_gen(1), fm.page_gen(2), fm.page_gen(3), fm.page_gen(4)),
            (1, 2, 2, 1)
        );
        assert_eq!(s.job_decided("j", 1), Some(true));
        assert!(ck(1, 2, vec![]).reflected_in(&s));
        // Stale epochs, epochs not begun, pages outside the file: refused.
        s.apply(&begin(2)).unwrap();
        assert_eq!(s.jobs["j"].started_gen, 3);
        for bad in [
            ck(1, 3, vec![]),
            ck(3, 3, vec![(0, 1)]),
            ck(2, 3, vec![(9, 11)]),
            ck(2, 3, vec![(3, 3)]),
        ] {
            assert!(s.clone().apply(&bad).is_err(), "{bad:?}");
        }
        // A fenced epoch never commits; fencing a committed one changes nothing.
        s.apply(&MetaOp::FenceCheckpoint {
            job: "j".into(),
            epoch: 2,
        })
        .unwrap();
        assert_eq!(s.job_decided("j", 2), Some(false));
        assert!(s.clone().apply(&ck(2, 3, vec![(0, 1)])).is_err());
        // Fencing a committed epoch changes nothing: it stays committed.
        let mut t = s.clone();
        t.apply(&MetaOp::FenceCheckpoint {
            job: "j".into(),
            epoch: 1,
        })
        .unwrap();
        assert_eq!(t.job_decided("j", 1), Some(true));
        assert_eq!(t.jobs["j"].fenced, s.jobs["j"].fenced);
        assert!(
            s.clone().apply(&begin(2)).is_err(),
            "a fenced epoch does not begin again"
        );
        s.apply(&begin(3)).unwrap();
        s.apply(&ck(3, 4, vec![(3, 5)])).unwrap();
        let fm = &s.files["a"];
        assert_eq!(
            (fm.page_gen(2), fm.page_gen(3), fm.page_gen(4), fm.top_gen()),
            (2, 4, 4, 4)
        );
        assert_eq!(s.job_floor("j"), 3);
        // A replaced node between placement and commit: refused.
        s.apply(&MetaOp::Replace {
            logical: 1,
            physical: "s0".into(),
        })
        .unwrap();
        s.apply(&begin(4)).unwrap();
        assert!(s.clone().apply(&ck(4, 5, vec![(0, 1)])).is_err());
        assert_eq!(MetaState::decode(&s.encode()).unwrap(), s);
        // One writer job per file: a second is refused until the first releases or ends.
        let claim = |job: &str| MetaOp::ClaimWriter {
            file: FileId(7),
            job: job.into(),
        };
        let release = |job: &str| MetaOp::ReleaseWriter {
            file: FileId(7),
            job: job.into(),
        };
        s.apply(&claim("j")).unwrap();
        s.apply(&claim("j")).unwrap();
        let e = s.clone().apply(&claim("k")).unwrap_err();
        assert!(e.to_string().contains("mapped writable by job j"), "{e}");
        s.apply(&release("k")).unwrap();
        assert!(s.files["a"].written_by("j"), "only the writer releases");
        s.apply(&release("j")).unwrap();
        assert!(s.files["a"].written_by("j"), "two processes claimed it; one released");
        let mut t = s.clone();
        t.apply(&release("j")).unwrap();
        assert_eq!(t.files["a"].writer, None, "the last release frees it");
        s.apply(&MetaOp::EndJob { job: "j".into() }).unwrap();
        assert!(s.jobs.is_empty());
        assert_eq!(s.files["a"].writer, None, "a job's end releases its files");
        s.apply(&claim("k")).unwrap();
    }

    /// A process outside `psls run` lost with its node leaves no claim: its claims go with
    /// the incarnation they were made on, once it is down; they persist in the store and in a
    /// snapshot.
    #[test]
    fn a_node_boots_above_its_verdict_and_its_last_start_and_the_store_and_snapshots_keep_it() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        let boot = |node: &str, incarnation: u64| MetaOp::Boot {
            physical: node.into(),
            incarnation,
        };
        {
            let mut m = MetaStore::open(&disk).unwrap();
            m.apply(&boot("n1", 3)).unwrap();
            m.apply(&boot("n2", 1)).unwrap();
            assert!(boot("n1", 3).reflected_in(m.state()));
            m.apply(&boot("n1", 3)).unwrap();
            assert!(
                matches!(m.apply(&boot("n1", 2)), Err(MetaError::Invalid(_))),
                "an earlier start"
            );
            m.apply(&MetaOp::DeclareDown {
                physical: "n1".into(),
                incarnation: 5,
            })
            .unwrap();
            assert!(m.apply(&boot("n1", 5)).is_err(), "an incarnation declared down");
            assert!(m.apply(&boot("", 5)).is_err() && m.apply(&boot("n1", 0)).is_err());
            assert_eq!(
                m.state().up_from,
                BTreeMap::from([("n1".to_string(), 3), ("n2".to_string(), 1)])
            );
            m.apply(&boot("n1", 6)).unwrap();
            let snap = m.state().clone();
            assert_eq!(MetaState::decode(&snap.encode()).unwrap(), snap);
            // A snapshot of the previous release (it ends after the claims) still reads.
            let mut old = snap.encode();
            old.truncate(old.len() - postcard::to_stdvec(&snap.up_from).unwrap().len());
            let st = MetaState::decode(&old).unwrap();
            assert!(st.up_from.is_empty());
            assert_eq!(st.down, snap.down);
        }
        let m = MetaStore::open(&disk).unwrap();
        assert_eq!(
            m.state().up_from,
            BTreeMap::from([("n1".to_string(), 6), ("n2".to_string(), 1)]),
            "kept by the store"
        );
    }

    #[test]
    fn a_processs_claim_goes_with_its_node_incarnation() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        let claim = |job: &str, node: &str, incarnation: u64| MetaOp::ClaimWriterOn {
            file: FileId(7),
            job: job.into(),
            node: node.into(),
            incarnation,
        };
        let release = |job: &str, node: &str, incarnation: u64| MetaOp::ReleaseWriterOn {
            file: FileId(7),
            job: job.into(),
            node: node.into(),
            incarnation,
        };
        let down = |node: &str, incarnation: u64| MetaOp::DeclareDown {
            physical: node.into(),
            incarnation,
        };
        {
            let mut m = MetaStore::open(&disk).unwrap();
            m.apply(&MetaOp::CommitFile {
                meta: meta("a", 7),
                replaces: None,
                placed_at: None,
            })
            .unwrap();
            m.apply(&claim("ext:0:first", "n1", 5)).unwrap();
            m.apply(&claim("ext:0:first", "n1", 5)).unwrap();
            m.apply(&claim("ext:0:first", "n2", 3)).unwrap();
            assert_eq!(m.state().files["a"].writer, Some(("ext:0:first".into(), 3)));
            assert!(matches!(
                m.apply(&claim("ext:0:second", "n3", 1)),
                Err(MetaError::WriterBusy { .. })
            ));
            assert!(m.apply(&claim("j", "n3", 1)).is_err(), "only a process's job");
            // An older incarnation of n1 down: nothing of 5's goes.
            m.apply(&down("n1", 4)).unwrap();
            assert_eq!(m.state().files["a"].writer, Some(("ext:0:first".into(), 3)));
            m.apply(&down("n1", 5)).unwrap();
            assert_eq!(m.state().files["a"].writer, Some(("ext:0:first".into(), 1)));
            assert!(
                m.apply(&claim("ext:0:first", "n1", 5)).is_err(),
                "a down incarnation claims nothing"
            );
            // A release of a claim that went changes nothing.
            m.apply(&release("ext:0:first", "n1", 5)).unwrap();
            assert_eq!(m.state().files["a"].writer, Some(("ext:0:first".into(), 1)));
            let snap = m.state().clone();
            assert_eq!(MetaState::decode(&snap.encode()).unwrap(), snap);
        }
        let mut m = MetaStore::open(&disk).unwrap();
        assert_eq!(
            m.state().process_claims[&FileId(7)],
            BTreeMap::from([(("n2".to_string(), 3), 1)]),
            "kept by the store"
        );
        m.apply(&release("ext:0:first", "n2", 3)).unwrap();
        assert_eq!(m.state().files["a"].writer, None);
        assert!(m.state().process_claims.is_empty());
        m.apply(&claim("ext:0:second", "n3", 1)).unwrap();
        // n3 restarts: its process's claim goes, and the file with it.
        m.apply(&down("n3", 1)).unwrap();
        assert_eq!(m.state().files["a"].writer, None);
        assert!(m.state().process_claims.is_empty());
    }

    #[test]
    fn format_2_records_and_format_1_votes_still_read() {
        #[derive(Serialize)]
        struct F2<'a>(u64, &'a str, u64, u32, u32, u32, u64, u64);
        #[derive(Serialize)]
        struct S2<'a>(
            u64,
            BTreeMap<&'a str, F2<'a>>,
            BTreeMap<u32, String>,
            u64,
            BTreeMap<u32, Rebuild>,
            BTreeMap<u32, u64>,
        );
        let files = BTreeMap::from([("a", F2(3, "a", 100, 1, 1, 0o644, 4, 9))]);
        let mut rec = 2u16.to_le_bytes().to_vec();
        rec.extend(postcard::to_stdvec(&S2(5, files, BTreeMap::new(), 0, BTreeMap::new(), BTreeMap::new())).unwrap());
        let st = MetaState::decode(&rec).unwrap();
        assert_eq!((st.seq, st.files["a"].id, st.files["a"].page_gen(0)), (5, FileId(3), 4));
        #[derive(Serialize)]
        enum Op1<'a> {
            _InitMap,
            CommitFile {
                meta: F2<'a>,
                replaces: Option<FileId>,
                placed_at: Option<u64>,
            },
        }
        let acc = Accepted {
            epoch: Epoch { n: 2, by: 0 },
            seq: 6,
            op: Op1::CommitFile {
                meta: F2(3, "a", 100, 1, 1, 0o644, 4, 9),
                replaces: None,
                placed_at: Some(1),
            },
        };
        let mut v = 1u16.to_le_bytes().to_vec();
        v.extend(postcard::to_stdvec(&(Epoch { n: 3, by: 1 }, Some(acc))).unwrap());
        let (promised, accepted) = decode_vote(&v).unwrap();
        assert_eq!(promised, Epoch { n: 3, by: 1 });
        match accepted.map(|a| a.op) {
            Some(MetaOp::CommitFile { meta, .. }) => assert_eq!((meta.id, meta.gen), (FileId(3), 4)),
            other => panic!("{other:?}"),
        }
    }

    /// A finished job's result is kept only with a checkpoint, with a bounded reason, and goes
    /// with the job's end.
    #[test]
    fn a_finished_job_needs_a_checkpoint_and_goes_with_its_end() {
        let mut s = MetaState::default();
        let fin = |why: &str| MetaOp::JobFinished {
            job: "j".into(),
            why: why.into(),
            files: Vec::new(),
            epoch: 7,
        };
        assert!(s.apply(&fin("disk full")).is_err(), "no record");
        s.apply(&MetaOp::BeginCheckpoint {
            job: "j".into(),
            epoch: 1,
        })
        .unwrap();
        let before = s.clone();
        assert!(s.apply(&fin(&"x".repeat(MAX_WHY_LEN + 1))).is_err());
        assert_eq!(s, before);
        assert!(!fin("disk full").reflected_in(&s));
        s.apply(&fin("disk full")).unwrap();
        assert!(fin("disk full").reflected_in(&s));
        assert_eq!(MetaState::decode(&s.encode()).unwrap(), s);
        s.apply(&MetaOp::EndJob { job: "j".into() }).unwrap();
        assert!(s.finished.is_empty());
    }

    /// Down verdicts only grow, name a node and an incarnation, and cover every older
    /// incarnation; a format-4 state (before them) still reads, with none.
    #[test]
    fn down_verdicts_grow_and_format_4_states_still_read() {
        let mut s = MetaState::default();
        let down = |physical: &str, incarnation| MetaOp::DeclareDown {
            physical: physical.into(),
            incarnation,
        };
        assert!(!s.is_down("n1", 1));
        assert!(!down("n1", 3).reflected_in(&s));
        s.apply(&down("n1", 3)).unwrap();
        assert!(down("n1", 3).reflected_in(&s) && down("n1", 2).reflected_in(&s));
        assert!(s.is_down("n1", 1) && s.is_down("n1", 3) && !s.is_down("n1", 4) && !s.is_down("n2", 1));
        s.apply(&down("n1", 2)).unwrap();
        assert_eq!(s.down["n1"], 3, "an older verdict changes nothing");
        let before = s.clone();
        assert!(s.apply(&down("", 5)).is_err() && s.apply(&down("n2", 0)).is_err());
        assert_eq!(s, before, "a refused verdict changes nothing");
        assert_eq!(MetaState::decode(&s.encode()).unwrap(), s);
        #[derive(Serialize)]
        struct S4<'a>(
            u64,
            &'a OrdMap<String, FileMeta>,
            &'a BTreeMap<u32, String>,
            u64,
            &'a BTreeMap<u32, Rebuild>,
            &'a BTreeMap<u32, u64>,
            &'a OrdMap<String, JobCkpt>,
            u64,
            &'a OrdMap<String, crate::jobs::JobOptions>,
        );
        let mut v4 = 4u16.to_le_bytes().to_vec();
        v4.extend(
            postcard::to_stdvec(&S4(
                s.seq,
                &s.files,
                &s.logical,
                s.map_version,
                &s.rebuilding,
                &s.assigned,
                &s.jobs,
                s.next_gen,
                &s.job_options,
            ))
            .unwrap(),
        );
        let old = MetaState::decode(&v4).unwrap();
        assert_eq!(old.seq, s.seq);
        assert!(old.down.is_empty());
    }

    /// A job's checkpoint options live with its record: set as it starts, gone at its end,
    /// bounded; a format-3 state (before them) still reads, with none.
    #[test]
    fn job_options_follow_the_job_record_and_format_3_states_still_read() {
        let mut s = MetaState::default();
        let spec = crate::jobs::JobSummary {
            program: "mgs".into(),
            ranks: 4,
            ..Default::default()
        };
        let options = crate::jobs::JobOptions {
            level: "memory".into(),
            persistent_interval_ms: 5000,
            persistent_every: 4,
            cleaning: "lru:300".into(),
            prefetch: true,
        };
        let start = MetaOp::StartJobWith {
            job: "j".into(),
            spec: Box::new(spec.clone()),
            options: Box::new(options.clone()),
        };
        assert!(!start.reflected_in(&s));
        s.apply(&start).unwrap();
        assert!(start.reflected_in(&s));
        assert_eq!(s.job_options["j"], options);
        assert_eq!(s.jobs["j"].spec.as_ref(), Some(&spec));
        assert_eq!(MetaState::decode(&s.encode()).unwrap(), s);
        let long = MetaOp::StartJobWith {
            job: "k".into(),
            spec: Box::new(spec.clone()),
            options: Box::new(crate::jobs::JobOptions {
                cleaning: "x".repeat(crate::jobs::MAX_OPTION_LEN + 1),
                ..options.clone()
            }),
        };
        let before = s.clone();
        assert!(s.apply(&long).is_err());
        assert_eq!(s, before, "a refused start changes nothing");
        // Format 3: the same fields, without the options.
        #[derive(Serialize)]
        struct S3<'a>(
            u64,
            &'a OrdMap<String, FileMeta>,
            &'a BTreeMap<u32, String>,
            u64,
            &'a BTreeMap<u32, Rebuild>,
            &'a BTreeMap<u32, u64>,
            &'a OrdMap<String, JobCkpt>,
            u64,
        );
        let mut v3 = 3u16.to_le_bytes().to_vec();
        v3.extend(
            postcard::to_stdvec(&S3(
                s.seq,
                &s.files,
                &s.logical,
                s.map_version,
                &s.rebuilding,
                &s.assigned,
                &s.jobs,
                s.next_gen,
            ))
            .unwrap(),
        );
        let old = MetaState::decode(&v3).unwrap();
        assert_eq!(old.jobs, s.jobs);
        assert!(old.job_options.is_empty());
        s.apply(&MetaOp::EndJob { job: "j".into() }).unwrap();
        assert!(
            s.jobs.is_empty() && s.job_options.is_empty(),
            "the end of a job drops both"
        );
    }

    #[test]
    fn power_cut_during_commit_keeps_old_or_new() {
        for k in 0..30 {
            for seed in [0u64, 7, 8] {
                let dir = tempfile::tempdir().unwrap();
                let committed;
                {
                    let disk = FaultDisk::new(dir.path()).unwrap();
                    let mut m = MetaStore::open(&disk).unwrap();
                    m.apply(&MetaOp::CommitFile {
                        meta: meta("a", 1),
                        replaces: None,
                        placed_at: None,
                    })
                    .unwrap();
                    disk.halt_after(k);
                    committed = m
                        .apply(&MetaOp::CommitFile {
                            meta: meta("a", 2),
                            replaces: Some(FileId(1)),
                            placed_at: None,
                        })
                        .is_ok();
                    disk.power_cut(seed);
                }
                let disk = FaultDisk::new(dir.path()).unwrap();
                let m = MetaStore::open(&disk).unwrap_or_else(|e| panic!("k={k} seed={seed}: {e}"));
                let id = m.state().files["a"].id;
                if committed {
                    assert_eq!(id, FileId(2), "k={k} seed={seed}: acknowledged commit lost");
                } else {
                    assert!(id == FileId(1) || id == FileId(2), "k={k}");
                }
            }
        }
    }
}
