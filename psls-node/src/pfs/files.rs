//! Files of the namespace: who may read or write them (`Caller`), create, import (the write
//! path: batches to home and mirror, the two-phase write, the commit record), remove, stat,
//! list, and the helpers every writer shares (`write_to`, `sync_on`, incarnation checks).

use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp, WriteGen, BATCH_PAGES};
use psls_cluster::write::{Write, WriteAction};
use psls_ipc::proto::{FileInfo, Stripe};
use psls_ipc::ErrorKind;
use psls_pfs::meta::{validate_name, FileMeta, MetaOp, MetaState, MAX_FILE_SIZE};
use psls_pfs::{PooledBuf, Role};
use psls_svm::{FileId, NodeId, PAGE_SIZE};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Bytes one page copy takes on disk (data slot and header).
pub(super) const COPY_BYTES: u64 = PAGE_SIZE as u64 + psls_pfs::slot::HEADER_LEN as u64;
/// Write batches in flight per import.
pub(super) const MAX_INFLIGHT: usize = 16;
/// Pages per export chunk (4 MiB: one 1 MiB read from each of 4 nodes).
pub(super) const EXPORT_CHUNK_PAGES: usize = 4 * BATCH_PAGES;
/// Export chunks read ahead.
pub(super) const READ_AHEAD: usize = 16;

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
    pub(super) fn check(&self, f: &FileMeta, bit: u32, verb: &str) -> Result<(), OpError> {
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

pub(super) fn lookup(st: &MetaState, name: &str) -> Result<FileMeta, OpError> {
    st.files
        .get(name)
        .cloned()
        .ok_or_else(|| OpError::new(ErrorKind::NotFound, format!("no file named '{name}'")))
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Every logical node must be able to take writes.
pub fn check_all_serving(node: &Node, st: &MetaState) -> Result<(), OpError> {
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

/// Refuses a file that does not fit on some node's disk (measured afresh where the last
/// heartbeat's figure says it does not).
pub(super) async fn check_space(node: &Arc<Node>, st: &MetaState, id: FileId, size: u64) -> Result<(), OpError> {
    if size > MAX_FILE_SIZE {
        let msg = format!("a file of {size} bytes exceeds the largest PSLS file ({MAX_FILE_SIZE} bytes, 4 PiB)");
        return Err(OpError::new(ErrorKind::NoSpace, msg));
    }
    let pages = size.div_ceil(PAGE_SIZE as u64);
    node.figures_fresh().await;
    for (l, p) in node.logical_map(st) {
        let held = [Role::Primary, Role::Mirror]
            .iter()
            .map(|&r| node.placement.held_count(NodeId(l), id, pages, r))
            .sum::<u64>();
        let need = held.saturating_mul(COPY_BYTES);
        let free = node.disk_free_of(&p, need).await;
        if need > free {
            return Err(OpError::new(
                ErrorKind::NoSpace,
                format!("file of {size} bytes needs {need} bytes on node {l} ({p}), which has {free} bytes free"),
            ));
        }
    }
    Ok(())
}

pub(super) fn new_file_id(st: &MetaState) -> FileId {
    loop {
        let id = FileId(rand::random::<u64>() | 1);
        if st.file_by_id(id).is_none() {
            return id;
        }
    }
}

/// Validates a new name or a replacement; returns the id being replaced.
pub(super) fn prepare_name(
    st: &MetaState,
    caller: Caller,
    name: &str,
    replace: bool,
) -> Result<Option<FileId>, OpError> {
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

pub(super) fn check_mode(mode: u32) -> Result<(), OpError> {
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
    check_space(node, &st, id, size).await?;
    let meta = FileMeta::zeroed(id, name.into(), size, caller.uid, caller.gid, mode, now_ms());
    // Answered once the leader applied it: a map, stat or lookup that follows here catches up
    // first.
    node.submit_to_leader(MetaOp::CommitFile {
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
pub(super) struct Batch {
    pub(super) indices: Vec<u64>,
    pub(super) data: PooledBuf,
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
    pub(super) fn push(&mut self, index: u64, page: &[u8]) {
        self.indices.push(index);
        self.data.extend_from_slice(page);
    }

    /// The page indices and the pages' bytes, ready to send (no copy).
    pub(super) fn into_parts(self) -> (Vec<u64>, bytes::Bytes) {
        (self.indices, bytes::Bytes::from_owner(self.data))
    }
}

/// Incarnations of the nodes a writer has written to. Unsynced writes die with an
/// incarnation: a write is durable only if the incarnation that synced it is the one that took
/// it, so every write and sync answer is checked against the first one seen from that node.
#[derive(Default)]
pub(super) struct Incarnations(std::sync::Mutex<BTreeMap<String, u64>>);

impl Incarnations {
    pub(super) fn check(&self, phys: &str, incarnation: u64) -> Result<(), OpError> {
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

/// Writes `batch` (generation: `gen`) to `role` copies on logical `l`; returns the physical
/// node and the incarnation that took the pages.
pub async fn write_to(
    node: &Arc<Node>,
    l: NodeId,
    file: FileId,
    role: Role,
    gen: WriteGen,
    indices: Vec<u64>,
    data: bytes::Bytes,
) -> Result<(String, u64), OpError> {
    let phys = node.physical_of(&node.meta_state(), l);
    let incarnation = write_to_phys(node, &phys, file, role, gen, indices, data).await?;
    Ok((phys, incarnation))
}

/// [`write_to`] a physical node; returns the incarnation that took the pages.
pub async fn write_to_phys(
    node: &Arc<Node>,
    phys: &str,
    file: FileId,
    role: Role,
    gen: WriteGen,
    indices: Vec<u64>,
    data: bytes::Bytes,
) -> Result<u64, OpError> {
    let req = PeerReq::WritePages {
        file,
        role,
        gen,
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
pub async fn sync_on(node: &Arc<Node>, phys: &str) -> Result<u64, OpError> {
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
        check_space(node, &st, id, size).await?;
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
                written: Default::default(),
                writer: None,
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
                let r = write_to_phys(&node, &phys, file, role, WriteGen::New { gen, seq: 0 }, indices, data).await;
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
        // The writes in flight end first (each within the request timeout): one cancelled here
        // could still reach its node after the removal below, and leave its pages there for
        // ever (the suite met "stray page files" on a loaded machine).
        while self.inflight.join_next().await.is_some() {}
        if self.node.file_by_id(self.meta.id).is_some() {
            return;
        }
        tracing::info!(node = %self.node.name(), file = %self.meta.id, "import aborted; discarding its pages");
        remove_everywhere(&self.node, self.meta.id).await;
    }
}

/// fsync on every logical node; each must be the incarnation `written` saw take its writes.
pub(super) async fn sync_all(node: &Arc<Node>, written: &Arc<Incarnations>) -> Result<(), OpError> {
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

pub(super) async fn remove_everywhere(node: &Arc<Node>, file: FileId) {
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

/// The file named `name`, created (`size` bytes, `mode`, owned by `caller`) if there is none;
/// a concurrent creator (another rank) winning the race is no error.
pub async fn lookup_or_create(
    node: &Arc<Node>,
    caller: Caller,
    name: &str,
    size: u64,
    mode: u32,
) -> Result<FileMeta, OpError> {
    match lookup_file(node, name).await {
        Err(e) if e.kind == ErrorKind::NotFound => {
            match create(node, caller, name, size, mode).await {
                Ok(_) => {}
                Err(e) if e.kind == ErrorKind::Exists => {}
                Err(e) => return Err(e),
            }
            lookup_file(node, name).await
        }
        found => found,
    }
}

/// The committed file named `name`: from the applied namespace, or, if it is not there, from
/// the namespace caught up to the leader's read index (it may have been created through
/// another node a moment ago).
pub async fn lookup_file(node: &Arc<Node>, name: &str) -> Result<FileMeta, OpError> {
    match lookup(&node.meta_state(), name) {
        Err(e) if e.kind == ErrorKind::NotFound => lookup(&node.meta_fresh().await?, name),
        found => found,
    }
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
