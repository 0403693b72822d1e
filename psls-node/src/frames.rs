//! The node's recovery area: the memory checkpoints' page copies this node holds (DESIGN §6),
//! outside every client-visible memfd, at most the node's memory capacity in frames. The
//! table and its rules are `psls_ckpt::frames::FrameTable` (pure, shared with the checkpoint
//! simulator); this is its lock, its page bytes and its errors as the daemon reports them.

use crate::failstop::Locked;
use crate::op::OpError;
use psls_ckpt::frames::{DiskWrite, FrameError, FrameTable, Run};
use psls_ipc::proto::ErrorKind;
use psls_pfs::Role;
use psls_svm::{FileId, PAGE_SIZE};
use std::sync::Mutex;

pub use psls_ckpt::frames::{FrameCounts, JobMem, Site};

/// A recovery copy with its page's bytes.
pub type Frame = psls_ckpt::frames::Frame<bytes::Bytes>;

/// See the module documentation.
pub struct RecoveryArea {
    table: Mutex<FrameTable<bytes::Bytes>>,
}

fn op_error(e: FrameError) -> OpError {
    let kind = match e {
        FrameError::NoRoom { .. } => ErrorKind::NoSpace,
        FrameError::Invalid(_) => ErrorKind::Invalid,
        // The rollback starts again (job control retries an unavailable step).
        FrameError::Restarted(_) => ErrorKind::Unavailable,
    };
    OpError::new(kind, e.to_string())
}

impl RecoveryArea {
    pub fn new(capacity_frames: u64) -> RecoveryArea {
        RecoveryArea {
            table: Mutex::new(FrameTable::new(capacity_frames)),
        }
    }

    pub fn capacity_frames(&self) -> u64 {
        self.table.locked().capacity()
    }

    /// Stores pre-recovery copies of `indices` of `file`, their bytes in `data` in order (see
    /// `FrameTable::store_pre`). Each page is copied out of `data`: a frame never keeps a
    /// transport buffer alive.
    #[allow(clippy::too_many_arguments)]
    pub fn store_pre(
        &self,
        job: &str,
        epoch: u64,
        committed: u64,
        file: FileId,
        role: Role,
        site: Site,
        indices: &[u64],
        data: &[u8],
    ) -> Result<(), OpError> {
        if data.len() != indices.len() * PAGE_SIZE {
            return Err(OpError::new(
                ErrorKind::Invalid,
                "one page of bytes per index is needed",
            ));
        }
        let pages = data.chunks(PAGE_SIZE).map(bytes::Bytes::copy_from_slice).collect();
        self.table
            .locked()
            .store_pre(job, epoch, committed, file, role, site, indices, pages)
            .map_err(op_error)
    }

    /// Memory epoch `epoch` of `job` keeps the mirror copies of `indices` of `file` on their
    /// writer: this node's copies go at its commit (see `FrameTable::store_moved`).
    pub fn store_moved(
        &self,
        job: &str,
        epoch: u64,
        committed: u64,
        file: FileId,
        indices: &[u64],
    ) -> Result<(), OpError> {
        self.table
            .locked()
            .store_moved(job, epoch, committed, file, indices)
            .map_err(op_error)
    }

    pub fn commit(&self, job: &str, epoch: u64) {
        self.table.locked().commit(job, epoch)
    }

    pub fn abort(&self, job: &str, epoch: u64) {
        self.table.locked().abort(job, epoch)
    }

    pub fn settle_pre(&self, job: &str, committed: u64, epoch: u64) {
        self.table.locked().settle_pre(job, committed, epoch)
    }

    pub fn job(&self, job: &str) -> JobMem {
        self.table.locked().job(job)
    }

    /// The committed recovery copy of page `index` of `file`, if held here.
    pub fn read(&self, job: &str, file: FileId, index: u64) -> Option<bytes::Bytes> {
        self.table.locked().read_of(job, file, index).cloned()
    }

    /// See `psls_ckpt::frames::FrameTable::storing`.
    pub fn storing(&self, by: DiskWrite, file: FileId, indices: &[u64], gen: u64) {
        self.table.locked().storing(by, file, indices, gen)
    }

    pub fn to_flush(&self, job: &str, gen: u64) -> Vec<Run<bytes::Bytes>> {
        self.table.locked().to_flush(job, gen)
    }

    pub fn persistent_committed(&self, job: &str, gen: u64) {
        self.table.locked().persistent_committed(job, gen)
    }

    pub fn set_policy(&self, job: &str, policy: psls_ckpt::cleaning::Policy) {
        self.table.locked().set_policy(job, policy)
    }

    /// What `by` wrote of `file` here at `gen` (`data`: the pages in order), kept aside when
    /// the job's policy keeps it (copied only then; see
    /// `psls_ckpt::frames::FrameTable::stored`).
    pub fn stored(&self, by: DiskWrite, file: FileId, role: Role, indices: &[u64], gen: u64, data: &[u8]) {
        let mut t = self.table.locked();
        if by == DiskWrite::Flush || !t.wants_written(file) || data.len() != indices.len() * PAGE_SIZE {
            return;
        }
        let pages = data.chunks(PAGE_SIZE).map(bytes::Bytes::copy_from_slice).collect();
        t.stored(by, file, role, indices, gen, pages)
    }

    pub fn persistent_aborted(&self, job: &str, gen: u64) {
        self.table.locked().persistent_aborted(job, gen)
    }

    pub fn committed_frames(&self, job: &str) -> Vec<(FileId, u64, Frame)> {
        self.table.locked().committed_frames(job)
    }

    /// The copies this node sends to re-create those the nodes in `lost` held
    /// (`psls_ckpt::frames::FrameTable::copies_for_lost`).
    #[allow(clippy::type_complexity)]
    pub fn copies_for_lost(
        &self,
        job: &str,
        target: u64,
        lost: &[u32],
        placement: &psls_pfs::Placement,
        me: u32,
    ) -> Result<std::collections::BTreeMap<(psls_svm::NodeId, FileId, psls_pfs::Role), Vec<(u64, Frame)>>, OpError>
    {
        self.table
            .locked()
            .copies_for_lost(job, target, lost, placement, me)
            .map_err(op_error)
    }

    pub fn install(&self, job: &str, file: FileId, pages: Vec<(u64, Frame)>) -> Result<(), OpError> {
        self.table.locked().install(job, file, pages).map_err(op_error)
    }

    pub fn adopt(&self, job: &str, committed: u64) -> Result<(), OpError> {
        self.table.locked().adopt(job, committed).map_err(op_error)
    }

    pub fn settle(&self, job: &str, target: u64, fenced: u64, persistent: u64) {
        self.table.locked().settle(job, target, fenced, persistent)
    }

    pub fn mark_memory(&self, job: &str, files: &[FileId]) {
        self.table.locked().mark_memory(job, files)
    }

    pub fn memory_files(&self, job: &str) -> Vec<FileId> {
        self.table.locked().memory_files(job)
    }

    pub fn in_memory(&self, file: FileId) -> bool {
        self.table.locked().in_memory(file)
    }

    /// The job whose memory checkpoints hold `file` here.
    pub fn memory_job(&self, file: FileId) -> Option<String> {
        self.table.locked().memory_job(file).map(str::to_string)
    }

    pub fn end_job(&self, job: &str) {
        self.table.locked().end_job(job)
    }

    /// The jobs that hold recovery copies or state here.
    pub fn jobs(&self) -> Vec<String> {
        self.table.locked().jobs()
    }

    pub fn counts(&self) -> FrameCounts {
        self.table.locked().counts()
    }

    /// `job`'s frames here, by category.
    pub fn job_counts(&self, job: &str) -> FrameCounts {
        self.table.locked().job_counts(job)
    }
}
