//! The memory level in the daemon (DESIGN §7): a participant's write of a memory checkpoint
//! (its dirty pages to the pre-recovery copies of their two holders, no disk touched), a
//! cleaner round's flush of the recovery copies newer than the disks, the recovery-area
//! requests peers make (`FramesReq`), and a rollback's steps on the recovery copies (settle
//! the epoch, re-create the copies a lost node held).
//!
//! A page's recovery copies live on its PFS holders (home and mirror logical ids), so this
//! module needs no directory of where they are: `crate::frames` is the store, placement says
//! where.

use super::round::{runs_of, CkptShell};
use crate::failstop::Locked;
use crate::frames::Frame;
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
    /// the ranks' states saved here), sends each to the recovery areas of its two holders as
    /// pre-recovery copies; returns the runs kept and their bytes (one copy).
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
        for b in super::batches::batches(node.placement, &taken) {
            while inflight.len() >= STORES_IN_FLIGHT {
                reap(&mut inflight).await?;
            }
            halfway.next(node.name(), b.indices.len(), "ckpt.mem.write").await;
            let phys = node.physical_of(&st, b.holder);
            if phys != node.me.name {
                node.ckpt_pages_sent
                    .fetch_add(b.indices.len() as u64, std::sync::atomic::Ordering::Relaxed);
            }
            let req = PeerReq::Frames(FramesReq::Store {
                job: job.to_string(),
                epoch,
                committed,
                file: b.file,
                role: b.role,
                indices: b.indices,
            });
            let node = node.clone();
            inflight.spawn(async move {
                let r = node.call_data_ok(&phys, req, bytes::Bytes::from_owner(b.data)).await;
                r.map(|_| ())
            });
        }
        while !inflight.is_empty() {
            reap(&mut inflight).await?;
        }
        let store_us = t0.elapsed().as_micros() as u64 - take_us - go_us;
        tracing::info!(node = %node.name(), job, epoch, pages, take_us, go_us, store_us, "memory checkpoint pages kept");
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
    /// the disks and that the round did not write from a newer copy go to this node's disk at
    /// `gen`, durably. Returns the runs written and their bytes (primary copies only, so a
    /// page counts once).
    pub(super) async fn flush(&self, job: &str, gen: u64, seq: u64) -> Result<(Vec<FileRuns>, u64), OpError> {
        let node = &self.node;
        let todo = node.frames.to_flush(job, gen);
        let mut runs: BTreeMap<FileId, Vec<u64>> = BTreeMap::new();
        let mut bytes = 0u64;
        for (file, role, indices, data) in todo {
            for (ks, ds) in indices.chunks(BATCH_PAGES).zip(data.chunks(BATCH_PAGES)) {
                let mut buf = crate::peer::batch_pool().get();
                for d in ds {
                    buf.extend_from_slice(d);
                }
                node.write_pages(
                    file,
                    role,
                    WriteGen::New { gen, seq },
                    ks.to_vec(),
                    bytes::Bytes::from_owner(buf),
                )
                .await?;
            }
            if role == Role::Primary {
                bytes += (indices.len() * PAGE_SIZE) as u64;
            }
            runs.entry(file).or_default().extend(indices);
        }
        if !runs.is_empty() {
            let store = node.store.clone();
            crate::op::blocking(move || store.sync()).await??;
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

    /// A peer's request on this node's recovery area.
    pub async fn serve_frames(
        self: &Arc<Self>,
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
                node.check_holder(file, role, indices.iter().copied())?;
                node.frames
                    .store_pre(&job, epoch, committed, file, role, &indices, &payload)?;
                Ok((PeerResp::Ok, none))
            }
            FramesReq::Read { file, index } => Ok(match node.frames.read(file, index) {
                Some(d) => (PeerResp::Frame { found: true }, d),
                None => (PeerResp::Frame { found: false }, none),
            }),
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
                files,
            } => {
                if files.len() > super::MAX_CKPT_FILES {
                    return Err(OpError::new(ErrorKind::Invalid, "too many files"));
                }
                node.frames.settle(&job, target, fenced);
                if target > 0 {
                    node.frames.mark_memory(&job, &files);
                }
                tracing::info!(node = %node.name(), job, target, "recovery copies settled for a rollback");
                Ok((PeerResp::Ok, none))
            }
            FramesReq::Adopt { job, committed } => {
                node.frames.adopt(&job, committed);
                tracing::info!(node = %node.name(), job, committed, "re-created recovery copies adopted");
                Ok((PeerResp::Ok, none))
            }
            FramesReq::Recreate { job, lost } => {
                let pages = self.recreate(&job, &lost).await?;
                Ok((PeerResp::Recreated { pages }, none))
            }
            FramesReq::Install { job, file, role, pages } => {
                if pages.len() > BATCH_PAGES || payload.len() != pages.len() * PAGE_SIZE {
                    return Err(OpError::new(
                        ErrorKind::Invalid,
                        "a batch of recovery copies of the wrong size",
                    ));
                }
                node.check_holder(file, role, pages.iter().map(|p| p.0))?;
                let frames = pages
                    .iter()
                    .enumerate()
                    .map(|(k, &(index, epoch, saved))| {
                        (
                            index,
                            Frame {
                                epoch,
                                role,
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

    /// Sends every recovery copy of `job` held here whose other holder is one of `lost` to
    /// that holder (now a restarted node or a spare under the same logical id).
    async fn recreate(&self, job: &str, lost: &[u32]) -> Result<u64, OpError> {
        let node = &self.node;
        let st = node.meta_state();
        let p = node.placement;
        let batches = node.frames.copies_for_lost(job, lost, &p);
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

async fn reap(inflight: &mut tokio::task::JoinSet<Result<(), OpError>>) -> Result<(), OpError> {
    match inflight.join_next().await {
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(OpError::new(ErrorKind::Internal, format!("a store task failed: {e}"))),
        None => Ok(()),
    }
}
