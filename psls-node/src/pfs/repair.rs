//! Keeping two good copies: scrub (every copy checked, bad ones rewritten from the good one),
//! replacement of a lost node by a spare, the rebuild of its copies, and when to rebuild or
//! replace on its own.

use super::files::*;
use super::read::read_from;
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp, WriteGen, BATCH_PAGES};
use psls_cluster::write::{Write, WriteAction};
use psls_ipc::proto::ScrubReport;
use psls_ipc::ErrorKind;
use psls_pfs::meta::{FileMeta, MetaOp, MetaState};
use psls_pfs::Role;
use psls_svm::{FileId, NodeId};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// `psls scrub`: verifies every copy on every node and repairs bad ones from the good copy.
pub async fn scrub(node: &Arc<Node>) -> Result<ScrubReport, OpError> {
    let st = node.meta_state();
    check_all_serving(node, &st)?;
    let files: Vec<FileId> = st.files.values().map(|f| f.id).collect();
    let by_id: BTreeMap<FileId, FileMeta> = st.files.values().map(|f| (f.id, f.clone())).collect();
    let mut report = ScrubReport {
        files: files.len() as u64,
        ..Default::default()
    };
    let mut bad = Vec::new();
    for (l, p) in node.logical_map(&st) {
        match node
            .call_ok(
                &p,
                PeerReq::ScrubLocal {
                    files: files.clone(),
                    seq: st.seq,
                },
            )
            .await?
        {
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
pub(super) async fn copy_pages(
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
    let gen = WriteGen::Same {
        gens: indices.iter().map(|&i| f.page_gen(i)).collect(),
    };
    let r = write_to(node, dst, f.id, src_role.other(), gen, indices, data).await;
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
    let files: Vec<FileMeta> = st.files.values().filter(|f| !f.never_written()).cloned().collect();
    let total: u64 = files
        .iter()
        .map(|f| {
            [Role::Primary, Role::Mirror]
                .iter()
                .map(|&r| p.held(l, f.id, f.pages(), r).filter(|&i| f.page_gen(i) > 0).count() as u64)
                .sum::<u64>()
        })
        .sum();
    node.rebuild_total.store(total, Ordering::Relaxed);
    node.rebuild_done.store(0, Ordering::Relaxed);
    tracing::info!(node = %node.name(), logical = %l, pages = total, "rebuild started");
    // The copies are written here, through the two-phase write: every batch acknowledged by
    // this incarnation, one fsync by the same incarnation, then the commit record.
    let me = node.name().to_string();
    let mut write = Write::new();
    let fail = |why: String| OpError::new(ErrorKind::Unavailable, why);
    for f in &files {
        for role in [Role::Primary, Role::Mirror] {
            let src_role = role.other();
            // Pages never written (generation 0: zeros) have no copy to re-create.
            let held: Vec<u64> = p
                .held(l, f.id, f.pages(), role)
                .filter(|&i| f.page_gen(i) > 0)
                .collect();
            for chunk in held.chunks(BATCH_PAGES) {
                let src = p.holder(f.id, chunk[0], src_role);
                let (ok, bad) = read_from(node, &st, f, src_role, src, chunk.to_vec())
                    .await
                    .split(chunk);
                if let Some((i, state)) = bad.first() {
                    return Err(fail(format!("cannot copy page {}:{i} from {src}: {state:?}", f.id)));
                }
                let n = ok.indices.len() as u64;
                let (indices, data) = ok.into_parts();
                write.sent(&me);
                let gen = WriteGen::Same {
                    gens: indices.iter().map(|&i| f.page_gen(i)).collect(),
                };
                match write_to_phys(node, &me, f.id, role, gen, indices, data).await {
                    Ok(incarnation) => write.stored(&me, incarnation),
                    Err(e) => write.store_failed(&me, &e.message),
                }
                node.rebuild_done.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
    write.finish();
    while let Some(a) = write.poll_action() {
        match a {
            WriteAction::Sync { node: phys } => match sync_on(node, &phys).await {
                Ok(incarnation) => write.synced(&phys, incarnation),
                Err(e) => write.sync_failed(&phys, &e.message),
            },
            WriteAction::Commit => {
                let r = node
                    .submit(MetaOp::RebuildDone {
                        logical: l.0,
                        physical: me.clone(),
                    })
                    .await;
                write.committed(r.map_err(|e| e.message));
            }
            WriteAction::Abort { .. } => {}
            WriteAction::Done(r) => r.map_err(fail)?,
        }
    }
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

/// This daemon started on a blank data folder: if the cluster knew this node (it holds a
/// logical id in the map, and written pages that id holds), its disk was replaced. It rejoins as a spare taking its own id
/// over would: `MetaOp::Rejoin` marks it rebuilding, so its copies are re-created from the
/// others' (`maybe_rebuild`). Tried until it is recorded. `unfinished`: an earlier blank start
/// of this folder ended undecided, so what the store holds is only what was written since:
/// every written page this id holds is taken as missing.
pub async fn rejoin_blank(node: Arc<Node>, unfinished: bool) {
    crate::failpoint::pass_async(node.name(), "rejoin.blank").await;
    for attempt in 0u32.. {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let st = match node.meta_fresh().await {
            Ok(st) => st,
            Err(e) => {
                tracing::debug!(node = %node.name(), error = %e, "blank data folder: waiting for the metadata");
                continue;
            }
        };
        // This node holds no id (a spare, or replaced): nothing to rebuild.
        let map = node.logical_map(&st);
        let Some(logical) = map.iter().find(|(_, p)| **p == node.me.name).map(|(l, _)| *l) else {
            return;
        };
        // Nothing to rebuild unless a written page this id holds has no copy here: a new
        // cluster's first start holds none, and a file written since this start was written
        // here too (writes need every node).
        let p = node.placement;
        let here: std::collections::BTreeSet<(FileId, Role)> = match node.store.files() {
            Ok(f) => f.into_iter().collect(),
            Err(e) => {
                tracing::warn!(node = %node.name(), error = %e, "blank data folder: cannot list the page store");
                continue;
            }
        };
        let missing = st.files.values().any(|f| {
            [Role::Primary, Role::Mirror].iter().any(|&r| {
                (unfinished || !here.contains(&(f.id, r)))
                    && p.held(NodeId(logical), f.id, f.pages(), r).any(|i| f.page_gen(i) > 0)
            })
        });
        if !missing {
            tracing::info!(node = %node.name(), logical, "blank data folder, and no written page missing here: nothing to rebuild");
            return;
        }
        // The configured map until the first change: recorded first (as a replacement does).
        if st.logical.is_empty() {
            if let Err(e) = node.submit(MetaOp::InitMap { logical: map.clone() }).await {
                tracing::warn!(node = %node.name(), error = %e, "blank data folder: could not record the node map yet");
                continue;
            }
        }
        if st.rebuilding.get(&logical).is_some_and(|r| r.physical == node.me.name) {
            return;
        }
        let op = MetaOp::Rejoin {
            logical,
            physical: node.me.name.clone(),
        };
        match node.submit(op).await {
            Ok(()) => {
                tracing::warn!(node = %node.name(), logical, "rejoined with a blank disk: its copies are rebuilt from the other nodes'");
                return;
            }
            Err(e) => {
                tracing::warn!(node = %node.name(), error = %e, "blank data folder: could not record the rejoin yet")
            }
        }
    }
}
