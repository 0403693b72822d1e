//! The memory level in the daemon (DESIGN §7): a participant's write of a memory checkpoint
//! (each dirty page's two pre-recovery copies, one of them kept by the writer when it holds
//! neither disk copy: a page crosses the network once; no disk touched), a cleaner round's
//! flush of the recovery copies newer than the disks, the recovery-area requests peers make
//! (`FramesReq`), and a rollback's steps on the recovery copies (settle the epoch, re-create
//! the copies a lost node held).
//!
//! Where a page's copies are is no record: its primary holder always has one (so a load asks
//! the holders), and each copy's node knows where the other is (`psls_ckpt::frames::Site`),
//! worked out from the placement and from who sent it, never from a peer's word.

use super::round::{runs_of, CkptShell};
use crate::failstop::Locked;
use crate::frames::{Frame, Site};
use crate::op::OpError;
use crate::peer::{FramesReq, PeerReq, PeerResp, WriteGen, BATCH_PAGES};
use crate::svm::Taken;
use psls_ipc::ErrorKind;
use psls_pfs::jobs::FileRuns;
use psls_pfs::Role;
use psls_svm::{FileId, PAGE_SIZE};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Most frame batches in flight from one participant.
const STORES_IN_FLIGHT: usize = 8;

impl CkptShell {
    /// A participant's write of memory epoch `epoch`: takes the dirty pages of `files` (and
    /// the ranks' states saved here) and makes each page's two pre-recovery copies ([`plan`]):
    /// one on each holder when this node is one, else one here and one on the primary holder
    /// (the mirror holder is told its copy goes); returns the runs kept and their bytes (one
    /// copy).
    pub(super) async fn write_memory(
        self: &Arc<Self>,
        job: &str,
        epoch: u64,
        committed: u64,
        files: &[FileId],
    ) -> Result<(Vec<FileRuns>, u64), OpError> {
        let node = &self.node;
        let t0 = std::time::Instant::now();
        let st = node.meta_state();
        let me = node
            .my_logical(&st)
            .ok_or_else(|| OpError::new(ErrorKind::Unavailable, format!("{} holds no logical id", node.name())))?;
        let super::round::Took {
            taken,
            runs,
            pages,
            take_us,
            go_us,
        } = self.take_and_tell(job, epoch, files, &st).await?;
        let mut inflight = tokio::task::JoinSet::new();
        let mut halfway = super::batches::Halfway::new(&taken);
        node.ckpt_pages_taken
            .fetch_add(pages, std::sync::atomic::Ordering::Relaxed);
        let mut local_pages = 0u64;
        for t in &taken {
            for b in plan(node.placement, me, t) {
                while inflight.len() >= STORES_IN_FLIGHT {
                    reap(&mut inflight).await?;
                }
                halfway.next(node.name(), b.indices.len(), "ckpt.mem.write").await;
                let data = || {
                    let mut data = crate::peer::batch_pool().get();
                    for &k in &b.ks {
                        data.extend_from_slice(&t.data[k * PAGE_SIZE..][..PAGE_SIZE]);
                    }
                    data
                };
                let req = match b.what {
                    Copy::Here(role, site) => {
                        node.frames
                            .store_pre(job, epoch, committed, t.file, role, site, &b.indices, &data())?;
                        local_pages += b.indices.len() as u64;
                        continue;
                    }
                    Copy::To(role) => PeerReq::Frames(FramesReq::Store {
                        job: job.to_string(),
                        epoch,
                        committed,
                        file: t.file,
                        role,
                        indices: b.indices,
                    }),
                    Copy::Moved => PeerReq::Frames(FramesReq::Moved {
                        job: job.to_string(),
                        epoch,
                        committed,
                        file: t.file,
                        indices: b.indices,
                    }),
                };
                let payload = match b.what {
                    Copy::To(_) => {
                        node.ckpt_pages_sent
                            .fetch_add(b.ks.len() as u64, std::sync::atomic::Ordering::Relaxed);
                        bytes::Bytes::from_owner(data())
                    }
                    _ => bytes::Bytes::new(),
                };
                let phys = node.physical_of(&st, b.holder);
                let node = node.clone();
                inflight.spawn(async move { node.call_data_ok(&phys, req, payload).await.map(|_| ()) });
            }
        }
        while !inflight.is_empty() {
            reap(&mut inflight).await?;
        }
        let store_us = t0.elapsed().as_micros() as u64 - take_us - go_us;
        tracing::info!(node = %node.name(), job, epoch, pages, local_pages, take_us, go_us, store_us, "memory checkpoint pages kept");
        Ok((runs, pages * PAGE_SIZE as u64))
    }

    /// Takes this node's dirty pages of `files` and the ranks' states saved here for
    /// (`job`, `epoch`), remembering them until the decision.
    pub(super) fn take_for(
        &self,
        job: &str,
        epoch: u64,
        files: &[FileId],
        st: &psls_pfs::meta::MetaState,
    ) -> Result<Vec<Taken>, OpError> {
        let mut taken = self.svm.take_dirty(files).map_err(|e| OpError::new(ErrorKind::Io, e))?;
        // The ranks' states of this job saved here go into its checkpoint area.
        let area = super::states::state_file_name(job);
        if let Some(f) = st.files.get(&area).filter(|f| files.contains(&f.id)) {
            taken.extend(self.state_pages(job, epoch, f.id));
        }
        // Files removed meanwhile: nothing to keep.
        taken.retain(|t| st.file_by_id(t.file).is_some());
        self.taken.locked().insert(
            (job.to_string(), epoch),
            taken.iter().map(|t| (t.file, t.indices.clone())).collect(),
        );
        Ok(taken)
    }

    /// A cleaner round's flush here: the job's recovery copies held here that are newer than
    /// the disks and that the round did not write from a newer copy go to the disks at `gen`,
    /// durably: to this node's disk, and the mirror copies of pages whose other copy is on
    /// their writer to their mirror holders' (a holder that restarted between the write and
    /// its sync fails the flush). Returns the runs written and their bytes (primary copies
    /// only, so a page counts once).
    pub(super) async fn flush(&self, job: &str, gen: u64, seq: u64) -> Result<(Vec<FileRuns>, u64), OpError> {
        let node = &self.node;
        let todo = node.frames.to_flush(job, gen);
        let st = node.meta_state();
        let mut runs: BTreeMap<FileId, Vec<u64>> = BTreeMap::new();
        let mut bytes = 0u64;
        let mut local = false;
        let mut remote: BTreeMap<String, u64> = BTreeMap::new();
        for (file, role, indices, data) in todo {
            let mut by_holder: BTreeMap<psls_svm::NodeId, Vec<usize>> = BTreeMap::new();
            for (k, &i) in indices.iter().enumerate() {
                by_holder
                    .entry(node.placement.holder(file, i, role))
                    .or_default()
                    .push(k);
            }
            for (holder, ks) in by_holder {
                let phys = node.physical_of(&st, holder);
                for chunk in ks.chunks(BATCH_PAGES) {
                    let mut buf = crate::peer::batch_pool().get();
                    for &k in chunk {
                        buf.extend_from_slice(&data[k]);
                    }
                    let idx: Vec<u64> = chunk.iter().map(|&k| indices[k]).collect();
                    let data = bytes::Bytes::from_owner(buf);
                    let gen = WriteGen::Flush { gen, seq };
                    if phys == node.me.name {
                        node.write_pages(file, role, gen, idx, data).await?;
                        local = true;
                    } else {
                        let inc = crate::pfs::write_to_phys(&self.node, &phys, file, role, gen, idx, data).await?;
                        if remote.insert(phys.clone(), inc).is_some_and(|was| was != inc) {
                            return Err(OpError::new(
                                ErrorKind::Unavailable,
                                format!("{phys} restarted during the flush"),
                            ));
                        }
                    }
                }
            }
            if role == Role::Primary {
                bytes += (indices.len() * PAGE_SIZE) as u64;
            }
            runs.entry(file).or_default().extend(indices);
        }
        if local {
            let store = node.store.clone();
            crate::op::blocking(move || store.sync()).await??;
        }
        for (phys, inc) in remote {
            if crate::pfs::sync_on(&self.node, &phys).await? != inc {
                return Err(OpError::new(
                    ErrorKind::Unavailable,
                    format!("{phys} restarted during the flush"),
                ));
            }
        }
        let runs = runs
            .into_iter()
            .map(|(file, mut idx)| {
                idx.sort_unstable();
                idx.dedup();
                FileRuns {
                    file,
                    runs: runs_of(&idx),
                }
            })
            .collect();
        Ok((runs, bytes))
    }

    /// Where copies of `indices` of `file` in `role` sent by node `from` stand here: one site
    /// for all of them, worked out from the placement and who sends them (never from the
    /// sender's word); refused when this node is not where such copies go.
    fn site_here(&self, from: &str, file: FileId, role: Role, indices: &[u64]) -> Result<Site, OpError> {
        let node = &self.node;
        let (me, sender) = self.logical_ids(from)?;
        let mut site = None;
        for &i in indices {
            let s = psls_ckpt::frames::site_of(&node.placement, file, i, role, me, sender);
            if s.is_none() || (site.is_some() && site != s) {
                return Err(OpError::new(
                    ErrorKind::Invalid,
                    format!(
                        "{from} cannot keep a {role:?} recovery copy of page {file}:{i} on {}",
                        node.name()
                    ),
                ));
            }
            site = s;
        }
        site.ok_or_else(|| OpError::new(ErrorKind::Invalid, "a batch of no pages"))
    }

    /// The logical ids of this node and of peer `from`, as this node's metadata says.
    fn logical_ids(&self, from: &str) -> Result<(u32, u32), OpError> {
        let node = &self.node;
        let st = node.meta_state();
        let map = node.logical_map(&st);
        let logical = |name: &str| map.iter().find(|(_, p)| *p == name).map(|(l, _)| *l);
        match (logical(node.name()), logical(from)) {
            (Some(me), Some(sender)) => Ok((me, sender)),
            _ => Err(OpError::new(
                ErrorKind::Invalid,
                format!("{from} or {} holds no logical id", node.name()),
            )),
        }
    }

    /// A peer's request on this node's recovery area (`from`: the peer, as its certificate
    /// names it).
    pub async fn serve_frames(
        self: &Arc<Self>,
        from: &str,
        req: FramesReq,
        payload: bytes::Bytes,
    ) -> Result<(PeerResp, bytes::Bytes), OpError> {
        let node = &self.node;
        let none = bytes::Bytes::new();
        match req {
            FramesReq::Store {
                job,
                epoch,
                committed,
                file,
                role,
                indices,
            } => {
                if indices.len() > BATCH_PAGES {
                    return Err(OpError::new(ErrorKind::Invalid, "too many pages in one batch"));
                }
                let site = self.site_here(from, file, role, &indices)?;
                node.frames
                    .store_pre(&job, epoch, committed, file, role, site, &indices, &payload)?;
                Ok((PeerResp::Ok, none))
            }
            FramesReq::Moved {
                job,
                epoch,
                committed,
                file,
                indices,
            } => {
                if indices.len() > BATCH_PAGES {
                    return Err(OpError::new(ErrorKind::Invalid, "too many pages in one batch"));
                }
                // This node is their mirror holder, and the sender their writer: it keeps the
                // mirror copies itself.
                node.check_holder(file, Role::Mirror, indices.iter().copied())?;
                let (_, sender) = self.logical_ids(from)?;
                if let Some(i) = indices
                    .iter()
                    .find(|&&i| node.placement.holder(file, i, Role::Primary).0 == sender)
                {
                    return Err(OpError::new(
                        ErrorKind::Invalid,
                        format!("{from} holds page {file}:{i}: it keeps no copy as its writer"),
                    ));
                }
                node.frames.store_moved(&job, epoch, committed, file, &indices)?;
                Ok((PeerResp::Ok, none))
            }
            FramesReq::Read { job, file, index } => match node.frames.read(&job, file, index) {
                Some(d) => Ok((PeerResp::Frame { found: true }, d)),
                // This node restarted since the start of the job writing the file: its recovery
                // copies of it died with its previous incarnation, so "none here" would send
                // the load to a disk copy older than them. Fail closed until the job's rollback
                // starts it again (and re-creates them).
                None => match lost_to_restart(node, file) {
                    Some(job) => Err(OpError::new(
                        ErrorKind::Unavailable,
                        format!(
                            "{} restarted since job {job} started: its recovery copies of page {file}:{index} are lost until the job rolls back",
                            node.name()
                        ),
                    )),
                    None => Ok((PeerResp::Frame { found: false }, none)),
                },
            },
            FramesReq::State { job } => {
                let m = node.frames.job(&job);
                Ok((
                    PeerResp::MemState {
                        committed: m.committed,
                        pre: m.pre,
                        seen: self.part_seen(&job),
                        files: node.frames.memory_files(&job),
                        counts: node.frames.job_counts(&job),
                    },
                    none,
                ))
            }
            FramesReq::Settle {
                job,
                target,
                fenced,
                persistent,
                files,
            } => {
                if files.len() > super::MAX_CKPT_FILES {
                    return Err(OpError::new(ErrorKind::Invalid, "too many files"));
                }
                node.frames.settle(&job, target, fenced, persistent);
                if target > 0 {
                    node.frames.mark_memory(&job, &files);
                }
                tracing::info!(node = %node.name(), job, target, "recovery copies settled for a rollback");
                Ok((PeerResp::Ok, none))
            }
            FramesReq::Adopt { job, committed } => {
                node.frames.adopt(&job, committed)?;
                tracing::info!(node = %node.name(), job, committed, "re-created recovery copies adopted");
                Ok((PeerResp::Ok, none))
            }
            FramesReq::Recreate { job, target, lost } => {
                let pages = self.recreate(&job, target, &lost).await?;
                Ok((PeerResp::Recreated { pages }, none))
            }
            FramesReq::Install { job, file, role, pages } => {
                if pages.len() > BATCH_PAGES || payload.len() != pages.len() * PAGE_SIZE {
                    return Err(OpError::new(
                        ErrorKind::Invalid,
                        "a batch of recovery copies of the wrong size",
                    ));
                }
                let indices: Vec<u64> = pages.iter().map(|p| p.0).collect();
                let site = self.site_here(from, file, role, &indices)?;
                let frames = pages
                    .iter()
                    .enumerate()
                    .map(|(k, &(index, epoch, saved))| {
                        (
                            index,
                            Frame {
                                epoch,
                                role,
                                site,
                                data: bytes::Bytes::copy_from_slice(&payload[k * PAGE_SIZE..][..PAGE_SIZE]),
                                saved,
                                superseded_gen: 0,
                            },
                        )
                    })
                    .collect();
                node.frames.install(&job, file, frames)?;
                Ok((PeerResp::Ok, none))
            }
        }
    }

    /// Sends every recovery copy of `job` held here whose other copy was on one of `lost`
    /// there (now a restarted node or a spare under the same logical id).
    async fn recreate(&self, job: &str, target: u64, lost: &[u32]) -> Result<u64, OpError> {
        let node = &self.node;
        let st = node.meta_state();
        let p = node.placement;
        let me = node
            .my_logical(&st)
            .ok_or_else(|| OpError::new(ErrorKind::Unavailable, format!("{} holds no logical id", node.name())))?;
        let batches = node.frames.copies_for_lost(job, target, lost, &p, me.0)?;
        let mut sent = 0u64;
        for ((l, file, role), frames) in batches {
            let phys = node.physical_of(&st, l);
            for chunk in frames.chunks(BATCH_PAGES) {
                let mut data = crate::peer::batch_pool().get();
                for (_, f) in chunk {
                    data.extend_from_slice(&f.data);
                }
                let req = PeerReq::Frames(FramesReq::Install {
                    job: job.to_string(),
                    file,
                    role,
                    pages: chunk.iter().map(|(i, f)| (*i, f.epoch, f.saved)).collect(),
                });
                node.call_data_ok(&phys, req, bytes::Bytes::from_owner(data)).await?;
                sent += chunk.len() as u64;
            }
        }
        Ok(sent)
    }
}

/// What one batch of a memory checkpoint does with its pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Copy {
    /// Stored here, as the copy of this role at this site.
    Here(Role, Site),
    /// Sent to the holder of this role.
    To(Role),
    /// The holder (the mirror one) is told its copies go at the commit: they are kept here.
    Moved,
}

/// One batch of a memory checkpoint: pages of one file (their indices, and their positions
/// `ks` in what was taken) for one node.
#[derive(Debug)]
struct MemBatch {
    what: Copy,
    holder: psls_svm::NodeId,
    indices: Vec<u64>,
    ks: Vec<usize>,
}

/// Where the writer `me` puts the two copies of each page it took of one file, in batches of
/// at most [`BATCH_PAGES`]: a page this node holds on disk (as primary or mirror) has a copy
/// here and one on its other holder; any other page one here, standing for the mirror copy,
/// and one on its primary holder, and its mirror holder is told (no data). Each page crosses
/// the network once.
fn plan(p: psls_pfs::Placement, me: psls_svm::NodeId, t: &Taken) -> Vec<MemBatch> {
    let mut groups: BTreeMap<(psls_svm::NodeId, Copy), Vec<usize>> = BTreeMap::new();
    for (k, &i) in t.indices.iter().enumerate() {
        let primary = p.holder(t.file, i, Role::Primary);
        let mirror = p.holder(t.file, i, Role::Mirror);
        let copies = if me == primary {
            [
                (me, Copy::Here(Role::Primary, Site::Holder)),
                (mirror, Copy::To(Role::Mirror)),
            ]
        } else if me == mirror {
            [
                (me, Copy::Here(Role::Mirror, Site::Holder)),
                (primary, Copy::To(Role::Primary)),
            ]
        } else {
            groups.entry((mirror, Copy::Moved)).or_default().push(k);
            [
                (me, Copy::Here(Role::Mirror, Site::Writer)),
                (primary, Copy::To(Role::Primary)),
            ]
        };
        for c in copies {
            groups.entry(c).or_default().push(k);
        }
    }
    let mut out = Vec::new();
    for ((holder, what), ks) in groups {
        for chunk in ks.chunks(BATCH_PAGES) {
            out.push(MemBatch {
                what,
                holder,
                indices: chunk.iter().map(|&k| t.indices[k]).collect(),
                ks: chunk.to_vec(),
            });
        }
    }
    out
}

async fn reap(inflight: &mut tokio::task::JoinSet<Result<(), OpError>>) -> Result<(), OpError> {
    match inflight.join_next().await {
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(OpError::new(ErrorKind::Internal, format!("a store task failed: {e}"))),
        None => Ok(()),
    }
}

/// The job writing `file`, if its current start ran ranks on this node as an earlier
/// incarnation: whatever recovery copies of the job this node held died with that one.
fn lost_to_restart(node: &crate::node::Node, file: FileId) -> Option<String> {
    let st = node.meta_state();
    let (job, _) = st.file_by_id(file)?.writer.clone()?;
    let run = st.runs.get(&job)?;
    // Once a rollback settled or re-created the job's copies here, a page with none is one
    // whose recovery copies are the disks'.
    let known = node.frames.job(&job);
    let restored = known.committed > 0 || known.pre.is_some() || known.floor > 0 || known.recreating.is_some();
    (!restored
        && run
            .nodes
            .values()
            .any(|(p, inc)| *p == node.me.name && *inc != node.incarnation))
    .then_some(job)
}
