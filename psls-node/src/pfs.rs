//! The mirrored parallel file system across nodes: import, export, create, remove, scrub,
//! node replacement and the rebuild of a replaced node's copies.
//!
//! Write protocol (import, create): pages of a new file id are written to the shadow slots on
//! the home and the mirror node, every node is fsync'd, and only then is the commit record
//! (`MetaOp::CommitFile`) ordered by the coordinator. A crash before the commit leaves the old
//! name binding (old contents or no file); after it, the new. Replacing a file writes a new id,
//! so readers of the old contents are never disturbed.
//!
//! Read protocol: from a copy on the reading node if it holds one, else from the primary; on
//! a missing, stale, corrupt or unreachable copy, from the other one, and the bad copy is then
//! repaired in place from the good one.

use crate::failstop::Locked;
use crate::node::Node;
use crate::op::{blocking, OpError};
use crate::peer::{PageState, PeerReq, PeerResp, BATCH_PAGES};
use psls_cluster::write::{Write, WriteAction};
use psls_ipc::proto::{FileInfo, ScrubReport, Stripe};
use psls_ipc::ErrorKind;
use psls_pfs::meta::{validate_name, FileMeta, MetaOp, MetaState, MAX_FILE_SIZE};
use psls_pfs::{PooledBuf, Role};
use psls_svm::{FileId, NodeId, PAGE_SIZE};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Bytes one page copy takes on disk (data slot and header).
const COPY_BYTES: u64 = PAGE_SIZE as u64 + psls_pfs::slot::HEADER_LEN as u64;
/// Write batches in flight per import.
const MAX_INFLIGHT: usize = 16;
/// Pages per export chunk (4 MiB: one 1 MiB read from each of 4 nodes).
const EXPORT_CHUNK_PAGES: usize = 4 * BATCH_PAGES;
/// Export chunks read ahead.
const READ_AHEAD: usize = 16;

/// Who is asking (from SO_PEERCRED).
#[derive(Clone, Copy, Debug)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

impl Caller {
    fn may(&self, f: &FileMeta, bit: u32) -> bool {
        self.uid == 0
            || (self.uid == f.uid && f.mode & (bit << 6) != 0)
            || (self.gid == f.gid && f.mode & (bit << 3) != 0)
            || f.mode & bit != 0
    }
    fn check(&self, f: &FileMeta, bit: u32, verb: &str) -> Result<(), OpError> {
        if self.may(f, bit) {
            return Ok(());
        }
        let msg = format!("permission denied: cannot {verb} '{}'", f.name);
        Err(OpError::new(ErrorKind::Permission, msg))
    }
    pub fn check_read(&self, f: &FileMeta) -> Result<(), OpError> {
        self.check(f, 4, "read")
    }
    pub fn check_write(&self, f: &FileMeta) -> Result<(), OpError> {
        self.check(f, 2, "write")
    }
}

pub fn info(f: &FileMeta) -> FileInfo {
    FileInfo {
        name: f.name.clone(),
        id: f.id.0,
        size: f.size,
        pages: f.pages(),
        uid: f.uid,
        gid: f.gid,
        mode: f.mode,
        gen: f.gen,
        created_unix_ms: f.created_unix_ms,
    }
}

fn lookup(st: &MetaState, name: &str) -> Result<FileMeta, OpError> {
    st.files
        .get(name)
        .cloned()
        .ok_or_else(|| OpError::new(ErrorKind::NotFound, format!("no file named '{name}'")))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Every logical node must be able to take writes.
fn check_all_serving(node: &Node, st: &MetaState) -> Result<(), OpError> {
    for (l, p) in node.logical_map(st) {
        if st.rebuilding.contains_key(&l) {
            return Err(OpError::new(
                ErrorKind::Unavailable,
                format!("node {l} ({p}) is rebuilding its copies; writes wait until it is done"),
            ));
        }
        if !node.is_live(&p) {
            return Err(OpError::new(
                ErrorKind::Unavailable,
                format!("node {l} ({p}) is down; writes need both copies (replace it or restart it)"),
            ));
        }
    }
    Ok(())
}

/// Refuses a file that does not fit on some node's disk.
fn check_space(node: &Node, st: &MetaState, id: FileId, size: u64) -> Result<(), OpError> {
    if size > MAX_FILE_SIZE {
        let msg = format!("a file of {size} bytes exceeds the largest PSLS file ({MAX_FILE_SIZE} bytes, 4 PiB)");
        return Err(OpError::new(ErrorKind::NoSpace, msg));
    }
    let pages = size.div_ceil(PAGE_SIZE as u64);
    for (l, p) in node.logical_map(st) {
        let held = [Role::Primary, Role::Mirror]
            .iter()
            .map(|&r| node.placement.held_count(NodeId(l), id, pages, r))
            .sum::<u64>();
        let need = held.saturating_mul(COPY_BYTES);
        let free = node.heartbeat_of(&p).map_or(0, |h| h.disk_free_bytes);
        if need > free {
            return Err(OpError::new(
                ErrorKind::NoSpace,
                format!("file of {size} bytes needs {need} bytes on node {l} ({p}), which has {free} bytes free"),
            ));
        }
    }
    Ok(())
}

fn new_file_id(st: &MetaState) -> FileId {
    loop {
        let id = FileId(rand::random::<u64>() | 1);
        if !st.files.values().any(|f| f.id == id) {
            return id;
        }
    }
}

/// Validates a new name or a replacement; returns the id being replaced.
fn prepare_name(st: &MetaState, caller: Caller, name: &str, replace: bool) -> Result<Option<FileId>, OpError> {
    validate_name(name).map_err(OpError::from)?;
    match st.files.get(name) {
        Some(_) if !replace => Err(OpError::new(ErrorKind::Exists, format!("file '{name}' already exists"))),
        Some(f) => {
            caller.check_write(f)?;
            Ok(Some(f.id))
        }
        None => Ok(None),
    }
}

fn check_mode(mode: u32) -> Result<(), OpError> {
    if mode & !0o777 != 0 {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("mode {mode:o} has bits outside 0777"),
        ));
    }
    Ok(())
}

/// `psls create`: a zero-filled file (generation 0: no page written yet).
pub async fn create(node: &Arc<Node>, caller: Caller, name: &str, size: u64, mode: u32) -> Result<FileInfo, OpError> {
    check_mode(mode)?;
    let st = node.meta_state();
    prepare_name(&st, caller, name, false)?;
    let id = new_file_id(&st);
    check_space(node, &st, id, size)?;
    let meta = FileMeta {
        id,
        name: name.into(),
        size,
        uid: caller.uid,
        gid: caller.gid,
        mode,
        gen: 0,
        created_unix_ms: now_ms(),
    };
    node.submit(MetaOp::CommitFile {
        meta: meta.clone(),
        replaces: None,
        placed_at: None,
    })
    .await?;
    Ok(info(&meta))
}

/// Pages of one file with their bytes side by side: page `indices[i]` at `data[i * 4096..]`.
/// The buffer is page-aligned, so the node holding the pages can write it with direct I/O,
/// and comes from [`crate::peer::batch_pool`].
struct Batch {
    indices: Vec<u64>,
    data: PooledBuf,
}

impl Default for Batch {
    fn default() -> Batch {
        Batch {
            indices: Vec::with_capacity(BATCH_PAGES),
            data: crate::peer::batch_pool().get(),
        }
    }
}

impl Batch {
    /// Appends a page (the buffer grows past `BATCH_PAGES` if a caller goes on).
    fn push(&mut self, index: u64, page: &[u8]) {
        self.indices.push(index);
        self.data.extend_from_slice(page);
    }

    /// The page indices and the pages' bytes, ready to send (no copy).
    fn into_parts(self) -> (Vec<u64>, bytes::Bytes) {
        (self.indices, bytes::Bytes::from_owner(self.data))
    }
}

/// Incarnations of the nodes a writer has written to. Unsynced writes die with an
/// incarnation: a write is durable only if the incarnation that synced it is the one that took
/// it, so every write and sync answer is checked against the first one seen from that node.
#[derive(Default)]
struct Incarnations(std::sync::Mutex<BTreeMap<String, u64>>);

impl Incarnations {
    fn check(&self, phys: &str, incarnation: u64) -> Result<(), OpError> {
        let mut m = self.0.locked();
        match m.insert(phys.to_string(), incarnation) {
            Some(old) if old != incarnation => Err(OpError::new(
                ErrorKind::Unavailable,
                format!("{phys} restarted during the write (incarnation {old} -> {incarnation}); its unsynced pages are lost"),
            )),
            _ => Ok(()),
        }
    }
}

/// Writes `batch` as generation `gen` (sparing `keep_gen`) to `role` copies on logical `l`;
/// returns the physical node and the incarnation that took the pages.
#[allow(clippy::too_many_arguments)]
async fn write_to(
    node: &Arc<Node>,
    l: NodeId,
    file: FileId,
    role: Role,
    gen: u64,
    keep_gen: u64,
    indices: Vec<u64>,
    data: bytes::Bytes,
) -> Result<(String, u64), OpError> {
    let phys = node.physical_of(&node.meta_state(), l);
    let incarnation = write_to_phys(node, &phys, file, role, gen, keep_gen, indices, data).await?;
    Ok((phys, incarnation))
}

/// [`write_to`] a physical node; returns the incarnation that took the pages.
#[allow(clippy::too_many_arguments)]
async fn write_to_phys(
    node: &Arc<Node>,
    phys: &str,
    file: FileId,
    role: Role,
    gen: u64,
    keep_gen: u64,
    indices: Vec<u64>,
    data: bytes::Bytes,
) -> Result<u64, OpError> {
    let req = PeerReq::WritePages {
        file,
        role,
        gen,
        keep_gen,
        indices,
    };
    match node.call_data_ok(phys, req, data).await? {
        (PeerResp::Stored { incarnation }, _) => Ok(incarnation),
        (other, _) => Err(OpError::new(
            ErrorKind::Internal,
            format!("{phys}: unexpected answer {other:?}"),
        )),
    }
}

/// fsync on one node; returns the incarnation that synced.
async fn sync_on(node: &Arc<Node>, phys: &str) -> Result<u64, OpError> {
    match node.call_ok(phys, PeerReq::Sync).await? {
        PeerResp::Stored { incarnation } => Ok(incarnation),
        other => Err(OpError::new(
            ErrorKind::Internal,
            format!("{phys}: unexpected answer {other:?}"),
        )),
    }
}

/// An import in progress.
pub struct Importer {
    node: Arc<Node>,
    meta: FileMeta,
    replaces: Option<FileId>,
    received: u64,
    partial: Vec<u8>,
    /// Pages waiting to be written, by home node. The mirror copies of a home node's pages
    /// are the same pages in the same order on the next node, so one batch serves both.
    batches: BTreeMap<u32, Batch>,
    /// Batches under way: each ends with the node that got it and the incarnation that took
    /// it, or why not.
    inflight: tokio::task::JoinSet<(String, Result<u64, OpError>)>,
    /// The two-phase write (`psls_cluster::write`): acknowledgements and fsyncs with their
    /// incarnations, and when the commit record may be written.
    write: Write,
    /// The logical map the pages were placed with (the commit record is refused if it changed).
    placed_at: u64,
}

impl Importer {
    pub async fn begin(
        node: &Arc<Node>,
        caller: Caller,
        name: &str,
        size: u64,
        mode: u32,
        replace: bool,
    ) -> Result<Importer, OpError> {
        check_mode(mode)?;
        let st = node.meta_state();
        let replaces = prepare_name(&st, caller, name, replace)?;
        check_all_serving(node, &st)?;
        let id = new_file_id(&st);
        check_space(node, &st, id, size)?;
        tracing::info!(node = %node.name(), file = %id, name, size, "import started");
        let (uid, gid, created_unix_ms) = (caller.uid, caller.gid, now_ms());
        let placed_at = st.map_version;
        Ok(Importer {
            node: node.clone(),
            meta: FileMeta {
                id,
                name: name.into(),
                size,
                uid,
                gid,
                mode,
                gen: 1,
                created_unix_ms,
            },
            replaces,
            received: 0,
            partial: Vec::with_capacity(PAGE_SIZE),
            batches: BTreeMap::new(),
            inflight: tokio::task::JoinSet::new(),
            write: Write::new(),
            placed_at,
        })
    }

    /// Waits until at most `limit` batches are under way, feeding their answers to the write.
    async fn reap(&mut self, limit: usize) -> Result<(), OpError> {
        while self.inflight.len() > limit {
            match self.inflight.join_next().await {
                Some(Ok((phys, Ok(incarnation)))) => self.write.stored(&phys, incarnation),
                Some(Ok((phys, Err(e)))) => self.write.store_failed(&phys, &e.message),
                Some(Err(e)) => self.write.abort(format!("write task failed: {e}")),
                None => break,
            }
            self.failed()?;
        }
        Ok(())
    }

    /// The write's failure, if it failed.
    fn failed(&mut self) -> Result<(), OpError> {
        while let Some(a) = self.write.poll_action() {
            if let WriteAction::Done(Err(why)) = a {
                return Err(OpError::new(ErrorKind::Unavailable, why));
            }
        }
        Ok(())
    }

    /// Sends the batch of home node `home` to it and to its mirror node.
    fn flush_batch(&mut self, home: u32) {
        let Some(batch) = self.batches.remove(&home) else {
            return;
        };
        if batch.indices.is_empty() {
            return;
        }
        let (indices, data) = batch.into_parts();
        let (file, gen) = (self.meta.id, self.meta.gen);
        let mirror = self.node.placement.mirror(file, indices[0]);
        let st = self.node.meta_state();
        for (l, role) in [(NodeId(home), Role::Primary), (mirror, Role::Mirror)] {
            let node = self.node.clone();
            let phys = node.physical_of(&st, l);
            if !self.write.sent(&phys) {
                return;
            }
            let (indices, data) = (indices.clone(), data.clone());
            self.inflight.spawn(async move {
                let r = write_to_phys(&node, &phys, file, role, gen, 0, indices, data).await;
                (phys, r)
            });
        }
    }

    /// Queues page `index` for its home and its mirror.
    fn push_page(&mut self, index: u64, page: &[u8]) {
        let home = self.node.placement.home(self.meta.id, index).0;
        let batch = self.batches.entry(home).or_default();
        batch.push(index, page);
        if batch.indices.len() >= BATCH_PAGES {
            self.flush_batch(home);
        }
    }

    /// Takes the next piece of the file's bytes.
    pub async fn data(&mut self, bytes: &[u8]) -> Result<(), OpError> {
        if self.received + bytes.len() as u64 > self.meta.size {
            let msg = format!("import sent more than the announced {} bytes", self.meta.size);
            return Err(OpError::new(ErrorKind::Invalid, msg));
        }
        let mut rest = bytes;
        while !rest.is_empty() {
            if self.partial.is_empty() && rest.len() >= PAGE_SIZE {
                // Whole pages straight from the client's buffer.
                let index = self.received / PAGE_SIZE as u64;
                self.push_page(index, &rest[..PAGE_SIZE]);
                rest = &rest[PAGE_SIZE..];
                self.received += PAGE_SIZE as u64;
                continue;
            }
            let take = (PAGE_SIZE - self.partial.len()).min(rest.len());
            self.partial.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            self.received += take as u64;
            if self.partial.len() == PAGE_SIZE {
                let index = (self.received - 1) / PAGE_SIZE as u64;
                let page = std::mem::take(&mut self.partial);
                self.push_page(index, &page);
            }
        }
        self.reap(MAX_INFLIGHT).await
    }

    /// Writes the rest, makes every copy durable, then commits.
    pub async fn commit(mut self) -> Result<FileInfo, OpError> {
        let r = self.finish().await;
        if r.is_err() {
            self.abort().await;
        }
        r
    }

    async fn finish(&mut self) -> Result<FileInfo, OpError> {
        if self.received != self.meta.size {
            return Err(OpError::new(
                ErrorKind::Invalid,
                format!("import ended after {} of {} bytes", self.received, self.meta.size),
            ));
        }
        if !self.partial.is_empty() {
            let index = self.received / PAGE_SIZE as u64;
            let mut page = std::mem::take(&mut self.partial);
            page.resize(PAGE_SIZE, 0);
            self.push_page(index, &page);
        }
        let keys: Vec<u32> = self.batches.keys().copied().collect();
        for k in keys {
            self.flush_batch(k);
        }
        let t = std::time::Instant::now();
        self.reap(0).await?;
        let drain_ms = t.elapsed().as_millis() as u64;
        // Phase two: fsync every node written to, then the commit record, as the write says.
        let t = std::time::Instant::now();
        self.write.finish();
        let mut sync_ms = 0;
        let mut syncs: tokio::task::JoinSet<(String, Result<u64, OpError>)> = tokio::task::JoinSet::new();
        loop {
            let Some(a) = self.write.poll_action() else {
                match syncs.join_next().await {
                    Some(Ok((phys, Ok(incarnation)))) => self.write.synced(&phys, incarnation),
                    Some(Ok((phys, Err(e)))) => self.write.sync_failed(&phys, &e.message),
                    Some(Err(e)) => self.write.abort(format!("fsync task failed: {e}")),
                    None => {
                        return Err(OpError::new(ErrorKind::Internal, "the import's write stalled"));
                    }
                }
                continue;
            };
            match a {
                WriteAction::Sync { node: phys } => {
                    let node = self.node.clone();
                    syncs.spawn(async move {
                        let r = sync_on(&node, &phys).await;
                        (phys, r)
                    });
                }
                WriteAction::Commit => {
                    sync_ms = t.elapsed().as_millis() as u64;
                    let op = MetaOp::CommitFile {
                        meta: self.meta.clone(),
                        replaces: self.replaces,
                        placed_at: Some(self.placed_at),
                    };
                    let r = self.node.submit(op).await;
                    self.write.committed(r.map_err(|e| e.message));
                }
                // The caller removes what was written (`abort`).
                WriteAction::Abort { .. } => {}
                WriteAction::Done(Ok(())) => break,
                WriteAction::Done(Err(why)) => return Err(OpError::new(ErrorKind::Unavailable, why)),
            }
        }
        let commit_ms = t.elapsed().as_millis() as u64 - sync_ms;
        tracing::info!(node = %self.node.name(), file = %self.meta.id, name = %self.meta.name,
            drain_ms, sync_ms, commit_ms, "import committed");
        if let Some(old) = self.replaces {
            let node = self.node.clone();
            tokio::spawn(async move { remove_everywhere(&node, old).await });
        }
        Ok(info(&self.meta))
    }

    /// Drops what was written (best effort; nothing was committed).
    pub async fn abort(mut self) {
        self.inflight.abort_all();
        while self.inflight.join_next().await.is_some() {}
        if self.node.meta_state().files.values().any(|f| f.id == self.meta.id) {
            return;
        }
        tracing::info!(node = %self.node.name(), file = %self.meta.id, "import aborted; discarding its pages");
        remove_everywhere(&self.node, self.meta.id).await;
    }
}

/// fsync on every logical node; each must be the incarnation `written` saw take its writes.
async fn sync_all(node: &Arc<Node>, written: &Arc<Incarnations>) -> Result<(), OpError> {
    let st = node.meta_state();
    let mut tasks = tokio::task::JoinSet::new();
    for (_, p) in node.logical_map(&st) {
        let (node, written) = (node.clone(), written.clone());
        tasks.spawn(async move { written.check(&p, sync_on(&node, &p).await?) });
    }
    while let Some(r) = tasks.join_next().await {
        r.map_err(|e| OpError::new(ErrorKind::Internal, e.to_string()))??;
    }
    Ok(())
}

async fn remove_everywhere(node: &Arc<Node>, file: FileId) {
    let live: Vec<String> = node
        .cfg
        .all()
        .map(|n| n.name.clone())
        .filter(|n| node.is_live(n))
        .collect();
    for n in &live {
        if let Err(e) = node.call_ok(n, PeerReq::RemoveFile { file }).await {
            tracing::warn!(node = %n, %file, error = %e, "could not remove file data");
        }
    }
    // Shared memory: when no client maps the file anywhere (its name is gone, so no new
    // mapping can start), every node drops its pages in memory and its coherence state.
    // Otherwise they stay with their mappers, as an unlinked file stays with its openers.
    let mut maps = 0;
    for n in &live {
        match node.call_ok(n, PeerReq::CountMappings { file }).await {
            Ok(PeerResp::Mappings { count }) => maps += count,
            other => {
                tracing::warn!(node = %n, %file, answer = ?other.map(|_| ()), "could not count a removed file's mappings: its memory stays");
                return;
            }
        }
    }
    if maps > 0 {
        tracing::info!(%file, maps, "removed file still mapped: its memory stays until the daemons restart");
        return;
    }
    for n in &live {
        if let Err(e) = node.call_ok(n, PeerReq::DropRemoved { file }).await {
            tracing::warn!(node = %n, %file, error = %e, "could not drop a removed file's memory");
        }
    }
}

/// `psls rm`.
pub async fn remove(node: &Arc<Node>, caller: Caller, name: &str) -> Result<(), OpError> {
    let st = node.meta_state();
    let f = lookup(&st, name)?;
    caller.check_write(&f)?;
    node.submit(MetaOp::RemoveFile {
        name: name.into(),
        id: f.id,
    })
    .await?;
    remove_everywhere(node, f.id).await;
    Ok(())
}

/// The committed file named `name`.
pub fn lookup_file(node: &Node, name: &str) -> Result<FileMeta, OpError> {
    lookup(&node.meta_state(), name)
}

pub fn stat(node: &Node, caller: Caller, name: &str) -> Result<(FileInfo, Vec<Stripe>), OpError> {
    let st = node.meta_state();
    let f = lookup(&st, name)?;
    caller.check_read(&f)?;
    let n = node.placement.nodes() as u64;
    let stripes = (0..n.min(f.pages()))
        .map(|first| Stripe {
            first_page: first,
            pages: (f.pages() - first).div_ceil(n),
            home: node.placement.home(f.id, first).0,
            mirror: node.placement.mirror(f.id, first).0,
        })
        .collect();
    Ok((info(&f), stripes))
}

pub fn list(node: &Node) -> Vec<FileInfo> {
    node.meta_state().files.values().map(info).collect()
}

/// What a read of several pages from one node returned: a state per page and, for the `Ok`
/// ones, the bytes at `i * 4096`.
struct PagesRead {
    states: Vec<PageState>,
    data: bytes::Bytes,
}

impl PagesRead {
    fn failed(n: usize, why: String) -> PagesRead {
        PagesRead {
            states: vec![PageState::Error(why); n],
            data: bytes::Bytes::new(),
        }
    }
    fn page(&self, i: usize) -> &[u8] {
        &self.data[i * PAGE_SIZE..][..PAGE_SIZE]
    }
    /// The `Ok` pages among `indices` as a batch, and the others with their states.
    fn split(self, indices: &[u64]) -> (Batch, Vec<(u64, PageState)>) {
        let mut ok = Batch::default();
        let mut bad = Vec::new();
        for (k, &i) in indices.iter().enumerate() {
            match &self.states[k] {
                PageState::Ok => ok.push(i, self.page(k)),
                other => bad.push((i, other.clone())),
            }
        }
        (ok, bad)
    }
}

/// Reads pages `indices` of `role` copies from logical node `l`, waiting at most `timeout`.
async fn read_from_within(
    node: &Arc<Node>,
    st: &MetaState,
    f: &FileMeta,
    role: Role,
    l: NodeId,
    indices: Vec<u64>,
    timeout: std::time::Duration,
) -> PagesRead {
    let n = indices.len();
    if !node.can_serve(st, l) {
        return PagesRead::failed(n, format!("{l} is not available"));
    }
    let phys = node.physical_of(st, l);
    let req = PeerReq::ReadPages {
        file: f.id,
        role,
        gen: f.gen,
        indices,
    };
    match node.call_data(&phys, req, bytes::Bytes::new(), timeout).await {
        Ok((PeerResp::Pages(states), data)) if states.len() == n && data.len() == n * PAGE_SIZE => {
            PagesRead { states, data }
        }
        Ok((PeerResp::Error { message, .. }, _)) => PagesRead::failed(n, format!("{phys}: {message}")),
        Ok((other, _)) => PagesRead::failed(n, format!("{phys}: unexpected answer {other:?}")),
        Err(e) => PagesRead::failed(n, e.to_string()),
    }
}

/// Reads pages `indices` of `role` copies from logical node `l`.
async fn read_from(
    node: &Arc<Node>,
    st: &MetaState,
    f: &FileMeta,
    role: Role,
    l: NodeId,
    indices: Vec<u64>,
) -> PagesRead {
    read_from_within(node, st, f, role, l, indices, node.request_timeout).await
}

fn group_by<K: Ord, F: Fn(u64) -> K>(indices: impl Iterator<Item = u64>, key: F) -> BTreeMap<K, Vec<u64>> {
    let mut m: BTreeMap<K, Vec<u64>> = BTreeMap::new();
    for i in indices {
        m.entry(key(i)).or_default().push(i);
    }
    m
}

/// Zeros of one page: what a never-written page reads as.
static ZERO_PAGE: [u8; PAGE_SIZE] = [0; PAGE_SIZE];

/// One page's bytes per page, in order: slices of the buffers the pages arrived in, so that a
/// chunk is written out (vectored) without being assembled first.
pub type Pages = Vec<bytes::Bytes>;

/// Reads pages `first..first+count` of `f`. Each page is read first from a copy on this node
/// when one can serve (no transfer), else from its primary; on a failure, from the other copy,
/// and a bad first copy is then repaired in place from the good one.
async fn read_chunk(node: Arc<Node>, f: FileMeta, first: u64, count: u64) -> Result<Pages, OpError> {
    let zero = bytes::Bytes::from_static(&ZERO_PAGE);
    if f.gen == 0 {
        return Ok(vec![zero; count as usize]);
    }
    let st = node.meta_state();
    let p = node.placement;
    let me = node.my_logical(&st);
    // The copies of page i, in the order they are tried.
    let copies = |i: u64| -> [(NodeId, Role); 2] {
        let (home, mirror) = (p.home(f.id, i), p.mirror(f.id, i));
        if Some(mirror) == me && Some(home) != me && node.can_serve(&st, mirror) {
            [(mirror, Role::Mirror), (home, Role::Primary)]
        } else {
            [(home, Role::Primary), (mirror, Role::Mirror)]
        }
    };
    let mut out: Vec<Option<bytes::Bytes>> = vec![None; count as usize];
    let slot = |i: u64| (i - first) as usize;
    // Page → (why its first copy failed, whether that copy answered and was bad).
    let mut failed: BTreeMap<u64, (String, bool)> = BTreeMap::new();
    let mut reads = tokio::task::JoinSet::new();
    for ((l, role), idx) in group_by(first..first + count, |i| copies(i)[0]) {
        let (node, st, f) = (node.clone(), st.clone(), f.clone());
        // Wait briefly for the first copy only when every second copy can take over.
        let others_serve = idx.iter().all(|&i| node.can_serve(&st, copies(i)[1].0));
        reads.spawn(async move {
            let timeout = if others_serve {
                node.read_timeout()
            } else {
                node.request_timeout
            };
            let r = read_from_within(&node, &st, &f, role, l, idx.clone(), timeout).await;
            (idx, r)
        });
    }
    while let Some(r) = reads.join_next().await {
        let (idx, got) = r.map_err(|e| OpError::new(ErrorKind::Internal, e.to_string()))?;
        for (k, &i) in idx.iter().enumerate() {
            match &got.states[k] {
                PageState::Ok => out[slot(i)] = Some(got.data.slice(k * PAGE_SIZE..(k + 1) * PAGE_SIZE)),
                other => {
                    failed.insert(i, (format!("{other:?}"), other.is_bad_copy()));
                }
            }
        }
    }
    let mut unreadable: Vec<(u64, String)> = Vec::new();
    for ((l, role), idx) in group_by(failed.keys().copied(), |i| copies(i)[1]) {
        let got = read_from(&node, &st, &f, role, l, idx.clone()).await;
        let mut repairs: BTreeMap<(NodeId, Role), Batch> = BTreeMap::new();
        for (k, &i) in idx.iter().enumerate() {
            if got.states[k] != PageState::Ok {
                unreadable.push((i, format!("{:?}", got.states[k])));
                continue;
            }
            out[slot(i)] = Some(got.data.slice(k * PAGE_SIZE..(k + 1) * PAGE_SIZE));
            let bad = copies(i)[0];
            let (why, bad_copy) = &failed[&i];
            tracing::debug!(node = %node.name(), page = %format!("{}:{i}", f.id), first = %why, ?role, "served from the other copy");
            if *bad_copy && node.can_serve(&st, bad.0) {
                repairs.entry(bad).or_default().push(i, got.page(k));
            }
        }
        for ((l, role), batch) in repairs {
            let node = node.clone();
            let (file, gen) = (f.id, f.gen);
            tokio::spawn(async move {
                let n = batch.indices.len();
                let r = async {
                    let written = Incarnations::default();
                    let (indices, data) = batch.into_parts();
                    let (phys, incarnation) = write_to(&node, l, file, role, gen, gen, indices, data).await?;
                    written.check(&phys, incarnation)?;
                    written.check(&phys, sync_on(&node, &phys).await?)
                }
                .await;
                let copy = if role == Role::Primary { "primary" } else { "mirror" };
                match r {
                    Ok(_) => tracing::info!(node = %l, %file, pages = n, "{copy} copies repaired from the other copy"),
                    Err(e) => tracing::warn!(node = %l, %file, error = %e, "{copy} repair failed"),
                }
            });
        }
    }
    // A first copy that only timed out may have been slow, not dead: one more try with the
    // full request timeout, batched per node.
    let retry = group_by(unreadable.iter().filter(|(i, _)| !failed[i].1).map(|(i, _)| *i), |i| {
        copies(i)[0]
    });
    for ((l, role), idx) in retry {
        let got = read_from(&node, &st, &f, role, l, idx.clone()).await;
        for (k, &i) in idx.iter().enumerate() {
            if got.states[k] == PageState::Ok {
                out[slot(i)] = Some(got.data.slice(k * PAGE_SIZE..(k + 1) * PAGE_SIZE));
            }
        }
    }
    if let Some((i, second_err)) = unreadable.iter().find(|(i, _)| out[slot(*i)].is_none()) {
        let msg = format!(
            "page {i} of '{}' is unreadable: one copy {}, the other {second_err}",
            f.name, failed[i].0
        );
        return Err(OpError::new(ErrorKind::Io, msg));
    }
    out.into_iter()
        .enumerate()
        .map(|(k, page)| {
            page.ok_or_else(|| {
                OpError::new(
                    ErrorKind::Internal,
                    format!("page {} of '{}' was not read", first + k as u64, f.name),
                )
            })
        })
        .collect()
}

/// Reads the committed page `index` of `f` (mirror fallback and repair as for an export).
pub async fn read_page(node: &Arc<Node>, f: &FileMeta, index: u64) -> Result<bytes::Bytes, OpError> {
    if index >= f.pages() {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("page {index} is beyond the end of '{}'", f.name),
        ));
    }
    let mut pages = read_chunk(node.clone(), f.clone(), index, 1).await?;
    pages
        .pop()
        .ok_or_else(|| OpError::new(ErrorKind::Internal, "empty read"))
}

/// The bytes of an export, chunk by chunk; an error ends the stream.
pub type ExportChunks = tokio::sync::mpsc::Receiver<Result<Pages, OpError>>;

/// Starts an export: returns the file and a channel of its chunks (the last one cut to the
/// file's size).
pub fn export_stream(node: &Arc<Node>, caller: Caller, name: &str) -> Result<(FileMeta, ExportChunks), OpError> {
    let st = node.meta_state();
    let f = lookup(&st, name)?;
    caller.check_read(&f)?;
    let (tx, rx) = tokio::sync::mpsc::channel(READ_AHEAD);
    let node = node.clone();
    let f2 = f.clone();
    tokio::spawn(async move {
        let f = f2;
        let pages = f.pages();
        let mut next = 0u64;
        let mut pending: VecDeque<tokio::task::JoinHandle<Result<Pages, OpError>>> = VecDeque::new();
        let mut left = f.size;
        loop {
            while pending.len() < READ_AHEAD && next < pages {
                let count = (EXPORT_CHUNK_PAGES as u64).min(pages - next);
                pending.push_back(tokio::spawn(read_chunk(node.clone(), f.clone(), next, count)));
                next += count;
            }
            let Some(h) = pending.pop_front() else { break };
            let r = h
                .await
                .unwrap_or_else(|e| Err(OpError::new(ErrorKind::Internal, e.to_string())));
            let r = r.map(|mut chunk| {
                for page in chunk.iter_mut() {
                    let keep = left.min(page.len() as u64) as usize;
                    page.truncate(keep);
                    left -= keep as u64;
                }
                chunk.retain(|p| !p.is_empty());
                chunk
            });
            let stop = r.is_err();
            if tx.send(r).await.is_err() || stop {
                for h in pending {
                    h.abort();
                }
                return;
            }
        }
    });
    Ok((f, rx))
}

/// `psls scrub`: verifies every copy on every node and repairs bad ones from the good copy.
pub async fn scrub(node: &Arc<Node>) -> Result<ScrubReport, OpError> {
    let st = node.meta_state();
    check_all_serving(node, &st)?;
    let files: Vec<(FileId, u64, u64)> = st.files.values().map(|f| (f.id, f.pages(), f.gen)).collect();
    let by_id: BTreeMap<FileId, FileMeta> = st.files.values().map(|f| (f.id, f.clone())).collect();
    let mut report = ScrubReport {
        files: files.len() as u64,
        ..Default::default()
    };
    let mut bad = Vec::new();
    for (l, p) in node.logical_map(&st) {
        match node.call_ok(&p, PeerReq::ScrubLocal { files: files.clone() }).await? {
            PeerResp::Scrub { checked, bad: b } => {
                report.copies_checked += checked;
                report.bad_copies += b.len() as u64;
                bad.extend(b.into_iter().map(|c| (NodeId(l), c)));
            }
            other => {
                return Err(OpError::new(
                    ErrorKind::Internal,
                    format!("{p}: unexpected answer {other:?}"),
                ))
            }
        }
    }
    let written = Arc::new(Incarnations::default());
    // Group: (file, bad role, bad holder, good holder) → indices.
    let mut groups: BTreeMap<(FileId, Role, NodeId, NodeId), Vec<u64>> = BTreeMap::new();
    for (l, c) in bad {
        let good = node.placement.holder(c.file, c.index, c.role.other());
        groups.entry((c.file, c.role, l, good)).or_default().push(c.index);
    }
    for ((file, role, dst, src), idx) in groups {
        let Some(f) = by_id.get(&file) else { continue };
        for chunk in idx.chunks(BATCH_PAGES) {
            let (ok, failed) = copy_pages(node, &st, f, (role.other(), src, dst), chunk.to_vec(), &written).await;
            report.repaired += ok;
            report.unrepairable += failed;
        }
    }
    if report.repaired > 0 {
        // A node that restarted before this sync lost the repairs: the scrub fails; run it again.
        sync_all(node, &written).await?;
    }
    tracing::info!(node = %node.name(), ?report, "scrub finished");
    Ok(report)
}

/// Copies pages from `src`'s `src_role` copies into `dst`'s other-role copies (checking the
/// storing incarnation against `written`); returns
/// (copied, failed).
async fn copy_pages(
    node: &Arc<Node>,
    st: &MetaState,
    f: &FileMeta,
    (src_role, src, dst): (Role, NodeId, NodeId),
    idx: Vec<u64>,
    written: &Incarnations,
) -> (u64, u64) {
    let (ok, bad) = read_from(node, st, f, src_role, src, idx.clone()).await.split(&idx);
    for (i, state) in &bad {
        tracing::error!(file = %f.id, page = i, ?state, "both copies bad: cannot repair");
    }
    let n = ok.indices.len() as u64;
    if n == 0 {
        return (0, bad.len() as u64);
    }
    let (indices, data) = ok.into_parts();
    let r = write_to(node, dst, f.id, src_role.other(), f.gen, f.gen, indices, data).await;
    match r.and_then(|(phys, incarnation)| written.check(&phys, incarnation)) {
        Ok(()) => (n, bad.len() as u64),
        Err(e) => {
            tracing::error!(node = %dst, error = %e, "repair write failed");
            (0, bad.len() as u64 + n)
        }
    }
}

/// `psls node replace`: gives logical id `logical` to `spare`; the spare then rebuilds.
pub async fn replace(node: &Arc<Node>, logical: u32, spare: &str) -> Result<(), OpError> {
    let st = node.meta_state();
    let map = node.logical_map(&st);
    let Some(old) = map.get(&logical).cloned() else {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("there is no logical node {logical} (the cluster has {})", map.len()),
        ));
    };
    if node.cfg.entry(spare).is_none() {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("no node named '{spare}' in the cluster config"),
        ));
    }
    if map.values().any(|p| p == spare) {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("'{spare}' already holds a logical id"),
        ));
    }
    if node.is_live(&old) {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("node {logical} ({old}) is up; only a down node can be replaced"),
        ));
    }
    if !node.is_live(spare) {
        return Err(OpError::new(
            ErrorKind::Unavailable,
            format!("spare '{spare}' is not up"),
        ));
    }
    if st.logical.is_empty() {
        node.submit(MetaOp::InitMap { logical: map.clone() }).await?;
    }
    node.submit(MetaOp::Replace {
        logical,
        physical: spare.into(),
    })
    .await?;
    tracing::warn!(logical, old = %old, new = %spare, "node replaced; rebuilding its copies");
    Ok(())
}

/// Re-creates every copy logical node `l` (this node) must hold, from the other copies.
pub async fn rebuild(node: &Arc<Node>, l: NodeId) -> Result<(), OpError> {
    let st = node.meta_state();
    let p = node.placement;
    let files: Vec<FileMeta> = st.files.values().filter(|f| f.gen > 0).cloned().collect();
    let total: u64 = files
        .iter()
        .map(|f| {
            [Role::Primary, Role::Mirror]
                .iter()
                .map(|&r| p.held_count(l, f.id, f.pages(), r))
                .sum::<u64>()
        })
        .sum();
    node.rebuild_total.store(total, Ordering::Relaxed);
    node.rebuild_done.store(0, Ordering::Relaxed);
    tracing::info!(node = %node.name(), logical = %l, pages = total, "rebuild started");
    for f in &files {
        for role in [Role::Primary, Role::Mirror] {
            let src_role = role.other();
            let held: Vec<u64> = p.held(l, f.id, f.pages(), role).collect();
            for chunk in held.chunks(BATCH_PAGES) {
                let src = p.holder(f.id, chunk[0], src_role);
                let (ok, bad) = read_from(node, &st, f, src_role, src, chunk.to_vec())
                    .await
                    .split(chunk);
                if let Some((i, state)) = bad.first() {
                    let msg = format!("cannot copy page {}:{i} from {src}: {state:?}", f.id);
                    return Err(OpError::new(ErrorKind::Unavailable, msg));
                }
                let n = ok.indices.len() as u64;
                let (indices, data) = ok.into_parts();
                write_to(node, l, f.id, role, f.gen, f.gen, indices, data).await?;
                node.rebuild_done.fetch_add(n, Ordering::Relaxed);
            }
        }
        let store = node.store.clone();
        blocking(move || store.sync()).await??;
    }
    node.submit(MetaOp::RebuildDone {
        logical: l.0,
        physical: node.name().to_string(),
    })
    .await?;
    tracing::info!(node = %node.name(), logical = %l, pages = total, "rebuild finished: every page has two copies again");
    Ok(())
}

/// Starts this node's rebuild if the metadata says it is rebuilding a logical id and none runs.
pub fn maybe_rebuild(node: &Arc<Node>) {
    let st = node.meta_state();
    let Some(l) = node.my_logical(&st) else {
        return;
    };
    if st.rebuilding.get(&l.0).is_none_or(|r| r.physical != node.me.name) {
        return;
    }
    if node.rebuild_running.swap(true, Ordering::SeqCst) {
        return;
    }
    let me = node.clone();
    tokio::spawn(async move {
        let r = rebuild(&me, l).await;
        if let Err(e) = &r {
            tracing::warn!(node = %me.me.name, error = %e, "rebuild interrupted; will retry");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        me.rebuild_running.store(false, Ordering::SeqCst);
    });
}

/// At the coordinator: gives a logical id down longer than `replace_after_ms` to a free spare.
pub async fn maybe_auto_replace(node: &Arc<Node>) {
    let after = node.cfg.cluster.replace_after_ms;
    let downs = node.down_peers();
    if after == 0 {
        return;
    }
    let st = node.meta_state();
    if node.coordinator(&st).map(|c| c.1) != Some(node.me.name.clone()) {
        return;
    }
    let map = node.logical_map(&st);
    for (peer, down_for) in downs {
        if down_for < after {
            continue;
        }
        let Some((&logical, _)) = map.iter().find(|(_, p)| **p == peer) else {
            continue;
        };
        let spare = node
            .cfg
            .spares
            .iter()
            .find(|s| !map.values().any(|p| *p == s.name) && node.state_of(&s.name) == psls_ipc::proto::NodeState::Up)
            .map(|s| s.name.clone());
        if let Some(spare) = spare {
            tracing::warn!(logical, down = %peer, %spare, "node down too long: replacing it with a spare");
            if let Err(e) = replace(node, logical, &spare).await {
                tracing::warn!(error = %e, "automatic replacement failed");
            }
            return;
        }
    }
}
