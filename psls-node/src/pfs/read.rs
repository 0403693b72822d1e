//! Reads of committed pages: from a copy on this node when it holds one, else the primary;
//! on a missing, stale, corrupt or unreachable copy, from the other one, and the bad copy is
//! then repaired in place. Exports stream chunks read ahead.

use super::files::*;
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{FramesReq, PageState, PeerReq, PeerResp, WriteGen};
use psls_ipc::ErrorKind;
use psls_pfs::meta::{FileMeta, MetaState};
use psls_pfs::Role;
use psls_svm::{FileId, NodeId, PAGE_SIZE};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// What a read of several pages from one node returned: a state per page and, for the `Ok`
/// ones, the bytes at `i * 4096`.
pub(super) struct PagesRead {
    states: Vec<PageState>,
    data: bytes::Bytes,
}

impl PagesRead {
    pub(super) fn failed(n: usize, why: String) -> PagesRead {
        PagesRead {
            states: vec![PageState::Error(why); n],
            data: bytes::Bytes::new(),
        }
    }
    pub(super) fn page(&self, i: usize) -> &[u8] {
        &self.data[i * PAGE_SIZE..][..PAGE_SIZE]
    }
    /// The `Ok` pages among `indices` as a batch, and the others with their states.
    pub(super) fn split(self, indices: &[u64]) -> (Batch, Vec<(u64, PageState)>) {
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
pub(super) async fn read_from_within(
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
    let gens = indices.iter().map(|&i| f.page_gen(i)).collect();
    let req = PeerReq::ReadPages {
        file: f.id,
        role,
        indices,
        gens,
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
pub(super) async fn read_from(
    node: &Arc<Node>,
    st: &MetaState,
    f: &FileMeta,
    role: Role,
    l: NodeId,
    indices: Vec<u64>,
) -> PagesRead {
    read_from_within(node, st, f, role, l, indices, node.request_timeout).await
}

pub(super) fn group_by<K: Ord, F: Fn(u64) -> K>(indices: impl Iterator<Item = u64>, key: F) -> BTreeMap<K, Vec<u64>> {
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
pub(super) async fn read_chunk(node: Arc<Node>, f: FileMeta, first: u64, count: u64) -> Result<Pages, OpError> {
    let zero = bytes::Bytes::from_static(&ZERO_PAGE);
    if f.never_written() {
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
    // Pages never written (generation 0) are zeros, on no disk.
    for i in first..first + count {
        if f.page_gen(i) == 0 {
            out[slot(i)] = Some(zero.clone());
        }
    }
    // Page → (why its first copy failed, whether that copy answered and was bad).
    let mut failed: BTreeMap<u64, (String, bool)> = BTreeMap::new();
    let mut reads = tokio::task::JoinSet::new();
    for ((l, role), idx) in group_by((first..first + count).filter(|&i| f.page_gen(i) > 0), |i| copies(i)[0]) {
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
            let f = f.clone();
            tokio::spawn(async move {
                let n = batch.indices.len();
                let file = f.id;
                let r = async {
                    let written = Incarnations::default();
                    let (indices, data) = batch.into_parts();
                    let gens = indices.iter().map(|&i| f.page_gen(i)).collect();
                    let gen = WriteGen::Same { gens };
                    let (phys, incarnation) = write_to(&node, l, file, role, gen, indices, data).await?;
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

/// Reads page `index` of `f` as of the job's last checkpoint: its memory checkpoint's
/// recovery copy when its file took memory checkpoints and one is held, else the committed
/// page on the disks (mirror fallback and repair as for an export).
pub async fn read_page(node: &Arc<Node>, f: &FileMeta, index: u64) -> Result<bytes::Bytes, OpError> {
    if index >= f.pages() {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!("page {index} is beyond the end of '{}'", f.name),
        ));
    }
    // A memory checkpoint's recovery copy is newer than the disks': the one kept by the job
    // whose memory checkpoints hold the file here (no other job's). (Not the file's writer:
    // a job's state area has none.)
    if let Some(job) = node.frames.memory_job(f.id) {
        if let Some(d) = read_recovery_copy(node, &job, f.id, index).await? {
            return Ok(d);
        }
    }
    if f.page_gen(index) == 0 {
        return Ok(bytes::Bytes::from_static(&[0u8; PAGE_SIZE]));
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

/// Reads the committed recovery copy job `job` keeps of page `index` of `file` from one of
/// its holders:
/// `Ok(None)` only when both answered that they hold none (the disks' checkpoint is the
/// page's). Fails closed: a holder that cannot be asked (down, or not yet heard from by a
/// node that just restarted) is an error, never a reason to fall back to the disks, whose copy
/// may be older than the checkpoint the job is at.
async fn read_recovery_copy(
    node: &Arc<crate::node::Node>,
    job: &str,
    file: FileId,
    index: u64,
) -> Result<Option<bytes::Bytes>, OpError> {
    let st = node.meta_state();
    for role in [Role::Primary, Role::Mirror] {
        let l = node.placement.holder(file, index, role);
        let phys = node.physical_of(&st, l);
        let req = PeerReq::Frames(FramesReq::Read {
            job: job.to_string(),
            file,
            index,
        });
        match node.call_data_ok(&phys, req, bytes::Bytes::new()).await? {
            (PeerResp::Frame { found: true }, d) if d.len() == PAGE_SIZE => return Ok(Some(d)),
            // The other holder may hold one this one lost (a restart not yet repaired).
            (PeerResp::Frame { found: false }, _) => {}
            (other, _) => {
                return Err(OpError::new(
                    ErrorKind::Internal,
                    format!("{phys}: unexpected answer {other:?}"),
                ))
            }
        }
    }
    Ok(None)
}
