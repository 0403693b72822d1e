//! The metadata log's durable side on one node: the log's entries and hard state in a log file
//! of their own ([`crate::wal`]: appended records, so a write that must sync dirties only what
//! it adds), and the applied namespace in per-key tables in a redb database (`meta.redb`), both
//! over a [`Disk`] (so the fault disk tests them like page data).
//!
//! A [`Persist`] of the log machine appends its entries and hard state to the log file (synced
//! when the machine marks it `sync`: votes, terms, entries), then writes the keys its
//! operations changed, the applied index and the flags in one redb transaction.
//! That transaction is durable (fsync) when it must be: with a compaction (whose entries then
//! leave the log file, rewritten from the entries it keeps), whenever the flags change (a
//! voter that caught up must not come back amnesiac after a power cut of every voter, or none
//! would vote), and every [`DURABLE_EVERY`] table writes (so redb reclaims pages and a restart
//! re-applies little); the others become durable with the next durable one.
//! The log file is synced before any durable table write: the tables never hold the effect of
//! an entry the log file could lose.
//! So a crash loses at most applied changes whose entries are durable: on restart the machine
//! applies them again from the log.
//! A snapshot writes the tables first (durably), then rewrites the log file after it.
//!
//! On-disk layout of `meta.redb`, format [`FORMAT`] (key `format` of table `misc`):
//! - `files`: name → postcard [`FileRecord`]; `file_ids`: id → name;
//! - `gen_rows`: (file id, 0) → postcard [`PageGens`], the file's base generation map, and
//!   (file id, log index) → postcard [`GenDelta`], the pages the operation at that index set,
//!   applied over the base in key order (only files a checkpoint wrote pages of; see
//!   [`MetaState::take_changes`] for when deltas are folded into a new base);
//! - `jobs`: job → postcard [`JobRecord`];
//! - `job_runs`: job → postcard [`crate::runs::RunRow`] (job control: its current start or
//!   its end);
//! - `misc`: `nodes` → postcard [`NodesRecord`]; `next_gen` and `applied` (index, term) as u64
//!   LE; `amnesiac` and `legacy`; `claims` and `up_from` (postcard; optional, a store older
//!   builds wrote has neither); `conf`, the log's voters as of `applied` (raft's protobuf
//!   `ConfState`; optional: a store older builds wrote has none, and every node voted).
//!
//! Format 8 had no table `job_runs`: it is converted by setting the format.
//!
//! Format 7 kept the log in table `log` (index → `[term u64 LE][entry type u8][context length
//! u32 LE][context][data]`, the encoding of a log file's entries too) and `hard_state` (term,
//! vote, commit) and `compacted` (index, term) in `misc`: it is converted on open, the log
//! file written first.
//!
//! Format 6 kept each file's whole map in table `file_gens` (id → postcard [`PageGens`]):
//! it is converted on open (to format 7, then on), each map becoming a base row.
//!
//! A store of an earlier format (table `meta`, key `state`: the whole namespace, and table
//! `vote`: the one-slot Paxos vote) is converted on open, in one transaction: its committed
//! namespace becomes the applied state at the index of its sequence number, term 1, and the log
//! starts after it (see [`Opened::legacy`]). An operation its vote had accepted but not seen
//! committed was never acknowledged by that protocol (it answered only once a commit was
//! confirmed), and a submitter told it failed may have retried it: it is dropped, with a
//! warning naming it.

use crate::disk::Disk;
use crate::error::MetaError;
use crate::gens::PageGens;
use crate::meta::{Changes, FileRecord, GenDelta, JobRecord, MetaOp, MetaState, NodesRecord};
use crate::wal::Wal;
use psls_cluster::log::{Durable, Machine, Persist};
use raft::eraftpb::{ConfState, Entry, EntryType, HardState};
use redb::{Durability, ReadableDatabase, ReadableTable, TableDefinition};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Format of the store.
pub const FORMAT: u16 = 9;

/// Every this many table writes, one is durable.
pub const DURABLE_EVERY: u64 = 32;

/// Format 7's log table.
const LOG_7: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const FILES: TableDefinition<&str, &[u8]> = TableDefinition::new("files");
const IDS: TableDefinition<u64, &str> = TableDefinition::new("file_ids");
const GENS: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("gen_rows");
/// Format 6's generation maps, one row per file.
const GENS_6: TableDefinition<u64, &[u8]> = TableDefinition::new("file_gens");
const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
const RUNS: TableDefinition<&str, &[u8]> = TableDefinition::new("job_runs");
const MISC: TableDefinition<&str, &[u8]> = TableDefinition::new("misc");
/// The tables of the formats before the log.
const LEGACY_META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const LEGACY_VOTE: TableDefinition<&str, &[u8]> = TableDefinition::new("vote");

impl Machine for MetaState {
    type Op = MetaOp;
    type Error = MetaError;
    type Changes = Changes;
    fn index(&self) -> u64 {
        self.seq
    }
    fn apply(&mut self, index: u64, op: &MetaOp) -> Result<(), MetaError> {
        self.apply_at(index, op)
    }
    fn skip(&mut self, index: u64) {
        self.skip_to(index)
    }
    fn take_changes(&mut self) -> Changes {
        MetaState::take_changes(self)
    }
    fn all_changes(&self) -> Changes {
        MetaState::all_changes(self)
    }
    fn encode(&self) -> Vec<u8> {
        MetaState::encode(self)
    }
    fn decode(bytes: &[u8]) -> Result<Self, String> {
        MetaState::decode(bytes).map_err(|e| e.to_string())
    }
    fn merge_changes(earlier: &mut Changes, later: Changes) {
        earlier.merge(later)
    }
}

/// What [`LogStore::open`] found.
#[derive(Debug)]
pub struct Opened {
    /// What the log machine restarts from.
    pub durable: Durable<MetaState>,
    /// The store was converted from a format before the log (now or earlier, and no leader has
    /// confirmed its state since): the index its namespace was at.
    pub legacy: Option<u64>,
    /// The store was created now.
    pub created: bool,
}

/// See the module documentation.
pub struct LogStore {
    db: redb::Database,
    file: Arc<dyn crate::disk::DiskFile>,
    wal: Wal,
    /// The log file's entries (what a compaction's rewrite keeps comes from here).
    entries: BTreeMap<u64, Entry>,
    /// What the log file and the tables hold now.
    hard_state: HardState,
    compacted: (u64, u64),
    applied: (u64, u64),
    amnesiac: bool,
    legacy: Option<u64>,
    /// Table writes since the last durable one.
    lazy_writes: u64,
}

impl std::fmt::Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore").finish()
    }
}

fn corrupt(what: &str, e: impl std::fmt::Display) -> MetaError {
    MetaError::Corrupt(format!("{what}: {e}"))
}

fn u64s<const N: usize>(what: &str, bytes: &[u8]) -> Result<[u64; N], MetaError> {
    if bytes.len() != 8 * N {
        return Err(corrupt(what, format!("{} bytes, not {}", bytes.len(), 8 * N)));
    }
    let mut out = [0u64; N];
    for (i, c) in bytes.chunks_exact(8).enumerate() {
        out[i] = u64::from_le_bytes(c.try_into().map_err(|e| corrupt(what, e))?);
    }
    Ok(out)
}

fn le(xs: &[u64]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// An entry as the `log` table keeps it.
pub fn encode_entry(e: &Entry) -> Vec<u8> {
    let mut out = Vec::with_capacity(13 + e.context.len() + e.data.len());
    out.extend(e.term.to_le_bytes());
    out.push(e.get_entry_type() as u8);
    out.extend((e.context.len() as u32).to_le_bytes());
    out.extend_from_slice(&e.context);
    out.extend_from_slice(&e.data);
    out
}

/// The entry at `index` from its record.
pub fn decode_entry(index: u64, b: &[u8]) -> Result<Entry, MetaError> {
    let bad = |why: &str| corrupt(&format!("log entry {index}"), why);
    if b.len() < 13 {
        return Err(bad("too short"));
    }
    let term = u64::from_le_bytes(b[..8].try_into().map_err(|_| bad("term"))?);
    let ty = match b[8] {
        0 => EntryType::EntryNormal,
        1 => EntryType::EntryConfChange,
        2 => EntryType::EntryConfChangeV2,
        t => return Err(bad(&format!("entry type {t}"))),
    };
    let clen = u32::from_le_bytes(b[9..13].try_into().map_err(|_| bad("context length"))?) as usize;
    let rest = &b[13..];
    if clen > rest.len() {
        return Err(bad("context length past the end"));
    }
    let mut e = Entry {
        index,
        term,
        context: rest[..clen].to_vec().into(),
        data: rest[clen..].to_vec().into(),
        ..Default::default()
    };
    e.set_entry_type(ty);
    Ok(e)
}

fn pc<T: serde::Serialize>(x: &T) -> Result<Vec<u8>, MetaError> {
    postcard::to_stdvec(x).map_err(|e| MetaError::Corrupt(format!("record does not serialize: {e}")))
}

impl LogStore {
    /// Opens (or creates, or converts) `meta.redb` on `disk`. A store created now starts
    /// `amnesiac` (see `psls_cluster::log::Durable::amnesiac`) when the caller says this node ran
    /// before.
    pub fn open(disk: &dyn Disk, amnesiac_if_created: bool) -> Result<(LogStore, Opened), MetaError> {
        LogStore::open_with_voters(disk, amnesiac_if_created, None)
    }

    /// [`LogStore::open`], a store created now recording `first_voters` as the log's voters
    /// (`None`: every node, as before voters changed).
    pub fn open_with_voters(
        disk: &dyn Disk,
        amnesiac_if_created: bool,
        first_voters: Option<&ConfState>,
    ) -> Result<(LogStore, Opened), MetaError> {
        let file = disk
            .open("meta.redb", true)
            .map_err(|e| MetaError::Db(format!("open meta.redb: {e}")))?;
        disk.sync_dir()
            .map_err(|e| MetaError::Db(format!("fsync directory: {e}")))?;
        let db = redb::Database::builder().create_with_backend(crate::meta::Backend(file.clone()))?;
        let (wal, replayed) = Wal::open(disk)?;
        let mut store = LogStore {
            db,
            file,
            wal,
            entries: BTreeMap::new(),
            hard_state: HardState::default(),
            compacted: (0, 0),
            applied: (0, 0),
            amnesiac: false,
            legacy: None,
            lazy_writes: 0,
        };
        let mut log = replayed;
        let mut format = store.misc("format")?;
        if format.is_none() && store.convert()? {
            format = store.misc("format")?;
        }
        if format.as_deref() == Some(6u16.to_le_bytes().as_slice()) {
            store.convert_6()?;
            format = store.misc("format")?;
        }
        if format.as_deref() == Some(7u16.to_le_bytes().as_slice()) {
            log = Some(store.convert_7()?);
            format = store.misc("format")?;
        }
        if format.as_deref() == Some(8u16.to_le_bytes().as_slice()) {
            // Format 8 had no job-control table (`job_runs`): nothing to convert.
            store.set_format()?;
            format = store.misc("format")?;
        }
        let created = match format {
            Some(f) if f.as_slice() == FORMAT.to_le_bytes() => false,
            Some(f) => {
                let found = <[u8; 2]>::try_from(f.as_slice())
                    .map_or_else(|_| format!("{f:?}"), |b| u16::from_le_bytes(b).to_string());
                return Err(MetaError::Corrupt(format!(
                    "metadata store of format {found}, and this build reads formats up to {FORMAT} (written by a newer psls-node: run that build, or a newer one)"
                )));
            }
            None => {
                store.create(amnesiac_if_created, first_voters)?;
                log = Some(crate::wal::Replayed::default());
                true
            }
        };
        let Some(log) = log else {
            return Err(MetaError::Corrupt(
                "meta.redb is of the log-file format but neither meta.wal.0 nor meta.wal.1 holds a whole header".into(),
            ));
        };
        let opened = store.load(created, log)?;
        Ok((store, opened))
    }

    fn misc(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError> {
        let tx = self.db.begin_read()?;
        match tx.open_table(MISC) {
            Ok(t) => Ok(t.get(key)?.map(|v| v.value().to_vec())),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// A new store: the format, and whether it starts amnesiac.
    fn create(&mut self, amnesiac: bool, voters: Option<&ConfState>) -> Result<(), MetaError> {
        // The log file first: a store whose format is set always has one.
        self.wal.rewrite((0, 0), &HardState::default(), &[])?;
        let tx = self.db.begin_write()?;
        {
            let mut m = tx.open_table(MISC)?;
            m.insert("format", FORMAT.to_le_bytes().as_slice())?;
            m.insert("amnesiac", [amnesiac as u8].as_slice())?;
            if let Some(c) = voters {
                m.insert("conf", encode_conf(c)?.as_slice())?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Marks the store as of [`FORMAT`] (durably).
    fn set_format(&mut self) -> Result<(), MetaError> {
        let tx = self.db.begin_write()?;
        tx.open_table(MISC)?.insert("format", FORMAT.to_le_bytes().as_slice())?;
        tx.commit()?;
        Ok(())
    }

    /// Converts a store of format 7: its log table, hard state and compaction go to the log
    /// file (written and synced first; a crash before the tables change redoes it), then leave
    /// the tables.
    fn convert_7(&mut self) -> Result<crate::wal::Replayed, MetaError> {
        let mut log = crate::wal::Replayed::default();
        {
            let tx = self.db.begin_read()?;
            let m = tx.open_table(MISC)?;
            if let Some(b) = m.get("hard_state")? {
                let [term, vote, commit] = u64s::<3>("hard state", b.value())?;
                log.hard_state.term = term;
                log.hard_state.vote = vote;
                log.hard_state.commit = commit;
            }
            if let Some(b) = m.get("compacted")? {
                let [i, t] = u64s::<2>("compacted", b.value())?;
                log.compacted = (i, t);
            }
            match tx.open_table(LOG_7) {
                Ok(t) => {
                    for kv in t.iter()? {
                        let (k, v) = kv?;
                        log.entries.push(decode_entry(k.value(), v.value())?);
                    }
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.wal.rewrite(log.compacted, &log.hard_state, &log.entries)?;
        let tx = self.db.begin_write()?;
        {
            match tx.delete_table(LOG_7) {
                Ok(_) | Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(e.into()),
            }
            let mut m = tx.open_table(MISC)?;
            m.remove("hard_state")?;
            m.remove("compacted")?;
            m.insert("format", FORMAT.to_le_bytes().as_slice())?;
        }
        tx.commit()?;
        tracing::info!(
            entries = log.entries.len(),
            "metadata store converted from format 7 (the log in a file of its own)"
        );
        Ok(log)
    }

    /// Converts a store of format 6: each file's whole generation map becomes its base row.
    fn convert_6(&mut self) -> Result<(), MetaError> {
        let tx = self.db.begin_write()?;
        let mut files = 0u64;
        {
            let mut rows = tx.open_table(GENS)?;
            match tx.open_table(GENS_6) {
                Ok(old) => {
                    for kv in old.iter()? {
                        let (k, v) = kv?;
                        rows.insert((k.value(), 0), v.value())?;
                        files += 1;
                    }
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(e.into()),
            }
            drop(rows);
            match tx.delete_table(GENS_6) {
                Ok(_) => {}
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(e.into()),
            }
            tx.open_table(MISC)?.insert("format", 7u16.to_le_bytes().as_slice())?;
        }
        tx.commit()?;
        tracing::info!(
            files,
            "metadata store converted from format 6 (generation maps as rows)"
        );
        Ok(())
    }

    /// Converts a store of a format before the log, if this is one. Returns whether it was.
    fn convert(&mut self) -> Result<bool, MetaError> {
        let (state, vote) = {
            let tx = self.db.begin_read()?;
            let state = match tx.open_table(LEGACY_META) {
                Ok(t) => match t.get("state")? {
                    Some(v) => MetaState::decode(v.value())?,
                    None => return Ok(false),
                },
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(false),
                Err(e) => return Err(e.into()),
            };
            let vote = match tx.open_table(LEGACY_VOTE) {
                Ok(t) => t
                    .get("vote")?
                    .map(|v| crate::meta::decode_vote(v.value()))
                    .transpose()?,
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(e.into()),
            };
            (state, vote)
        };
        if let Some((_, Some(acc))) = &vote {
            if acc.seq > state.seq {
                tracing::warn!(
                    seq = acc.seq,
                    op = ?acc.op,
                    "converting the metadata store: an operation accepted but never seen committed is dropped (it was never acknowledged)"
                );
            }
        }
        let seq = state.seq;
        let tx = self.db.begin_write()?;
        {
            let term = u64::from(seq > 0);
            let mut m = tx.open_table(MISC)?;
            // Format 7's layout; its log then moves to the log file (`convert_7`).
            m.insert("format", 7u16.to_le_bytes().as_slice())?;
            m.insert("amnesiac", [0u8].as_slice())?;
            m.insert("hard_state", le(&[term, 0, seq]).as_slice())?;
            m.insert("compacted", le(&[seq, term]).as_slice())?;
            m.insert("applied", le(&[seq, term]).as_slice())?;
            if seq > 0 {
                m.insert("legacy", le(&[seq]).as_slice())?;
            }
            drop(m);
            tx.open_table(LOG_7)?;
            write_changes(&tx, &state.all_changes())?;
            tx.delete_table(LEGACY_META)?;
            tx.delete_table(LEGACY_VOTE)?;
        }
        tx.commit()?;
        tracing::info!(
            seq,
            files = state.files.len(),
            "metadata store converted to the log format"
        );
        Ok(true)
    }

    /// Reads everything back.
    fn load(&mut self, created: bool, log: crate::wal::Replayed) -> Result<Opened, MetaError> {
        let opened = self.load_tables(created, log)?;
        let d = &opened.durable;
        self.entries = d.entries.iter().map(|e| (e.index, e.clone())).collect();
        self.hard_state = d.hard_state.clone();
        self.compacted = d.compacted;
        self.applied = (d.state.seq, d.applied_term);
        self.amnesiac = d.amnesiac;
        self.legacy = d.legacy;
        Ok(opened)
    }

    fn load_tables(&self, created: bool, log: crate::wal::Replayed) -> Result<Opened, MetaError> {
        let tx = self.db.begin_read()?;
        let m = tx.open_table(MISC)?;
        let get = |k: &str| -> Result<Option<Vec<u8>>, MetaError> { Ok(m.get(k)?.map(|v| v.value().to_vec())) };
        let crate::wal::Replayed {
            compacted,
            hard_state,
            entries,
        } = log;
        let applied = match get("applied")? {
            Some(b) => {
                let [i, t] = u64s::<2>("applied", &b)?;
                (i, t)
            }
            None => (0, 0),
        };
        let amnesiac = get("amnesiac")?.is_some_and(|b| b.first() == Some(&1));
        // Optional: a store written before voters changed has none (every node voted).
        let conf = match get("conf")? {
            Some(b) => Some(decode_conf(&b)?),
            None => None,
        };
        let legacy = match get("legacy")? {
            Some(b) => Some(u64s::<1>("legacy", &b)?[0]),
            None => None,
        };
        let mut changes = Changes {
            nodes: match get("nodes")? {
                Some(b) => Some(postcard::from_bytes::<NodesRecord>(&b).map_err(|e| corrupt("node map", e))?),
                None => None,
            },
            next_gen: match get("next_gen")? {
                Some(b) => Some(u64s::<1>("next_gen", &b)?[0]),
                None => None,
            },
            // Optional: a store an older build wrote has none.
            claims: match get("claims")? {
                Some(b) => Some(postcard::from_bytes(&b).map_err(|e| corrupt("process claims", e))?),
                None => None,
            },
            // Optional too.
            up_from: match get("up_from")? {
                Some(b) => Some(postcard::from_bytes(&b).map_err(|e| corrupt("node incarnations", e))?),
                None => None,
            },
            ..Changes::default()
        };
        let open = |name: &str, r: Result<(), redb::TableError>| -> Result<bool, MetaError> {
            match r {
                Ok(()) => Ok(true),
                Err(redb::TableError::TableDoesNotExist(_)) => Ok(false),
                Err(e) => Err(MetaError::Db(format!("{name}: {e}"))),
            }
        };
        match tx.open_table(FILES) {
            Ok(t) => {
                for kv in t.iter()? {
                    let (k, v) = kv?;
                    let rec: FileRecord = postcard::from_bytes(v.value()).map_err(|e| corrupt("file record", e))?;
                    changes.files.push((k.value().to_string(), Some(rec)));
                }
            }
            Err(e) => {
                open("files", Err(e))?;
            }
        }
        match tx.open_table(IDS) {
            Ok(t) => {
                for kv in t.iter()? {
                    let (k, v) = kv?;
                    changes
                        .ids
                        .push((psls_svm::FileId(k.value()), Some(v.value().to_string())));
                }
            }
            Err(e) => {
                open("file_ids", Err(e))?;
            }
        }
        match tx.open_table(GENS) {
            Ok(t) => {
                for kv in t.iter()? {
                    let (k, v) = kv?;
                    let (id, index) = k.value();
                    if index == 0 {
                        let g: PageGens = postcard::from_bytes(v.value()).map_err(|e| corrupt("generation map", e))?;
                        changes.gens.push((psls_svm::FileId(id), Some(g)));
                    } else {
                        let d: GenDelta =
                            postcard::from_bytes(v.value()).map_err(|e| corrupt("generation delta", e))?;
                        changes.gen_deltas.push((psls_svm::FileId(id), index, d));
                    }
                }
            }
            Err(e) => {
                open("gen_rows", Err(e))?;
            }
        }
        match tx.open_table(JOBS) {
            Ok(t) => {
                for kv in t.iter()? {
                    let (k, v) = kv?;
                    let rec: JobRecord = postcard::from_bytes(v.value()).map_err(|e| corrupt("job record", e))?;
                    changes.jobs.push((k.value().to_string(), Some(rec)));
                }
            }
            Err(e) => {
                open("jobs", Err(e))?;
            }
        }
        match tx.open_table(RUNS) {
            Ok(t) => {
                for kv in t.iter()? {
                    let (k, v) = kv?;
                    let row: crate::runs::RunRow =
                        postcard::from_bytes(v.value()).map_err(|e| corrupt("job run", e))?;
                    changes.runs.push((k.value().to_string(), Some(row)));
                }
            }
            Err(e) => {
                open("job_runs", Err(e))?;
            }
        }
        let mut state = MetaState::default();
        state.load(changes);
        state.seq = applied.0;
        let _ = state.take_changes();
        if applied.0 < compacted.0 {
            return Err(MetaError::Corrupt(format!(
                "the tables are at index {} but the log file starts after {}: entries between are lost",
                applied.0, compacted.0
            )));
        }
        // A snapshot's tables were written and the log file not yet rewritten after them (a
        // crash between): the log starts at the tables' index, without the old log's entries.
        let (compacted, entries) =
            if applied.0 > compacted.0 && !entries.iter().any(|e| e.index == applied.0 && e.term == applied.1) {
                tracing::warn!(
                    applied = applied.0,
                    "metadata: the log file is older than the snapshot in the tables; it starts after the snapshot"
                );
                (applied, Vec::new())
            } else {
                (compacted, entries)
            };
        Ok(Opened {
            durable: Durable {
                hard_state,
                compacted,
                entries,
                state,
                applied_term: applied.1,
                amnesiac,
                legacy,
                conf,
            },
            legacy,
            created,
        })
    }

    /// Carries out one [`Persist`] of the log machine (see the module documentation).
    pub fn persist(&mut self, p: &Persist<MetaState>) -> Result<(), MetaError> {
        if let Some(snapshot) = p.snapshot {
            // The hard state first (a newer term or vote must never be lost), then the tables,
            // durably, then the log after the snapshot. A crash between the last two leaves
            // tables past the old log's entries: `load` then starts the log at the tables.
            self.wal.append(&[], Some(&p.hard_state), true)?;
            let tx = self.begin(true)?;
            {
                for t in [FILES, JOBS, RUNS] {
                    tx.open_table(t)?.retain(|_, _| false)?;
                }
                tx.open_table(IDS)?.retain(|_, _| false)?;
                tx.open_table(GENS)?.retain(|_, _| false)?;
                self.write_misc(&tx, p)?;
                write_changes(&tx, &p.changes)?;
            }
            tx.commit()?;
            self.wal.rewrite(snapshot, &p.hard_state, &p.entries)?;
            self.entries = p.entries.iter().map(|e| (e.index, e.clone())).collect();
            self.hard_state = p.hard_state.clone();
            self.compacted = snapshot;
            self.lazy_writes = 0;
            return Ok(());
        }
        // The log: new entries replace any at their indices and after.
        let hs_changed = p.hard_state != self.hard_state;
        if !p.entries.is_empty() || hs_changed || p.sync {
            self.wal
                .append(&p.entries, hs_changed.then_some(&p.hard_state), p.sync)?;
            if let Some(first) = p.entries.first() {
                self.entries.split_off(&first.index);
                self.entries.extend(p.entries.iter().map(|e| (e.index, e.clone())));
            }
            self.hard_state = p.hard_state.clone();
        }
        // The tables.
        let flags_changed = p.amnesiac != self.amnesiac || p.legacy != self.legacy;
        let tables = !p.changes.is_empty() || p.applied != self.applied || flags_changed || p.compact_to.is_some();
        if tables {
            self.lazy_writes += 1;
            let durable = p.compact_to.is_some() || flags_changed || self.lazy_writes >= DURABLE_EVERY;
            if durable {
                // The tables never hold the effect of an entry the log file could lose.
                self.wal.append(&[], None, true)?;
                self.lazy_writes = 0;
            }
            let tx = self.begin(durable)?;
            self.write_misc(&tx, p)?;
            write_changes(&tx, &p.changes)?;
            tx.commit()?;
            self.applied = p.applied;
            self.amnesiac = p.amnesiac;
            self.legacy = p.legacy;
        }
        if let Some(c) = p.compact_to {
            assert!(c.0 <= self.applied.0, "a compaction drops only applied entries");
            self.entries = self.entries.split_off(&(c.0 + 1));
            let kept: Vec<Entry> = self.entries.values().cloned().collect();
            self.wal.rewrite(c, &self.hard_state, &kept)?;
            self.compacted = c;
        }
        Ok(())
    }

    fn begin(&self, durable: bool) -> Result<redb::WriteTransaction, MetaError> {
        let mut tx = self.db.begin_write()?;
        tx.set_durability(if durable {
            Durability::Immediate
        } else {
            Durability::None
        })
        .map_err(|e| MetaError::Db(e.to_string()))?;
        Ok(tx)
    }

    fn write_misc(&self, tx: &redb::WriteTransaction, p: &Persist<MetaState>) -> Result<(), MetaError> {
        let mut m = tx.open_table(MISC)?;
        m.insert("applied", le(&[p.applied.0, p.applied.1]).as_slice())?;
        m.insert("amnesiac", [p.amnesiac as u8].as_slice())?;
        if let Some(c) = &p.conf {
            m.insert("conf", encode_conf(c)?.as_slice())?;
        }
        match p.legacy {
            Some(l) => m.insert("legacy", le(&[l]).as_slice())?,
            None => m.remove("legacy")?,
        };
        Ok(())
    }

    /// Bytes the store takes on its disk (the tables and the log file).
    pub fn bytes_on_disk(&self) -> u64 {
        self.file.len().unwrap_or(0) + self.wal.bytes()
    }
}

/// The log's voters as stored (raft's protobuf `ConfState`).
fn encode_conf(c: &ConfState) -> Result<Vec<u8>, MetaError> {
    Ok(psls_cluster::log::encode_conf(c))
}

fn decode_conf(b: &[u8]) -> Result<ConfState, MetaError> {
    psls_cluster::log::decode_conf(b).map_err(|e| corrupt("voters", e))
}

/// Writes the changed keys into the per-key tables.
fn write_changes(tx: &redb::WriteTransaction, c: &Changes) -> Result<(), MetaError> {
    if !c.files.is_empty() {
        let mut t = tx.open_table(FILES)?;
        for (name, rec) in &c.files {
            match rec {
                Some(r) => t.insert(name.as_str(), pc(r)?.as_slice())?,
                None => t.remove(name.as_str())?,
            };
        }
    }
    if !c.ids.is_empty() {
        let mut t = tx.open_table(IDS)?;
        for (id, name) in &c.ids {
            match name {
                Some(n) => t.insert(id.0, n.as_str())?,
                None => t.remove(id.0)?,
            };
        }
    }
    if !c.gens.is_empty() || !c.gen_deltas.is_empty() {
        let mut t = tx.open_table(GENS)?;
        for (id, g) in &c.gens {
            t.retain_in((id.0, 0)..=(id.0, u64::MAX), |_, _| false)?;
            if let Some(g) = g {
                t.insert((id.0, 0), pc(g)?.as_slice())?;
            }
        }
        for (id, index, d) in &c.gen_deltas {
            assert!(*index > 0, "a delta row is keyed above the base");
            t.insert((id.0, *index), pc(d)?.as_slice())?;
        }
    }
    if !c.jobs.is_empty() {
        let mut t = tx.open_table(JOBS)?;
        for (job, rec) in &c.jobs {
            match rec {
                Some(r) => t.insert(job.as_str(), pc(r)?.as_slice())?,
                None => t.remove(job.as_str())?,
            };
        }
    }
    if !c.runs.is_empty() {
        let mut t = tx.open_table(RUNS)?;
        for (job, row) in &c.runs {
            match row {
                Some(r) => t.insert(job.as_str(), pc(r)?.as_slice())?,
                None => t.remove(job.as_str())?,
            };
        }
    }
    if c.nodes.is_some() || c.next_gen.is_some() || c.claims.is_some() || c.up_from.is_some() {
        let mut m = tx.open_table(MISC)?;
        if let Some(n) = &c.nodes {
            m.insert("nodes", pc(n)?.as_slice())?;
        }
        if let Some(g) = c.next_gen {
            m.insert("next_gen", le(&[g]).as_slice())?;
        }
        if let Some(cl) = &c.claims {
            m.insert("claims", pc(cl)?.as_slice())?;
        }
        if let Some(u) = &c.up_from {
            m.insert("up_from", pc(u)?.as_slice())?;
        }
    }
    Ok(())
}
