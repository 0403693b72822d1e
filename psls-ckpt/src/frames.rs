//! A node's table of memory-checkpoint recovery copies (DESIGN §6), pure: the daemon keeps
//! one behind a lock (`psls-node`'s recovery area, with page bytes), the checkpoint simulator
//! one per simulated node (with a value per page).
//!
//! A page of a memory checkpoint has two recovery copies ([`Site`]): one on its primary PFS
//! holder (its home), the other on its mirror holder when one of the two holders wrote it,
//! else on the node that wrote it — the writer keeps its own copy, so a checkpointed page
//! crosses the network once (DESIGN §6, as in the paper: a unique page becomes pre-recovery
//! data where it is, and one replica is made on another node). Whoever must read a copy (a
//! page load after a rollback) asks the holders, the primary first; the primary holder knows
//! where the other copy is, and each copy's node knows its partner, so a rollback re-creates
//! the copies a lost node held from the survivors' word, with no per-page record anywhere.
//! The mirror holder is told when a round keeps the mirror copy on the writer instead
//! ([`FrameTable::store_moved`]): its own, older copy goes with the round's commit, so a
//! holder never keeps a copy older than the checkpoint. A writer's copy may be older than
//! a later writer's (it is never read nor flushed; a re-creation takes the newest epoch),
//! and every writer's copy goes when a cleaner commits (the disks then hold the page).
//! Two lost nodes may have held both copies of some page, and nothing left says which: a
//! memory checkpoint survives the loss of one node ([`rollback_target`]).
//! Per page a table keeps at most two frames: `cur`, the copy of the last committed memory
//! checkpoint that wrote it (readable recovery while the page is unchanged since, pure
//! recovery once written again), and `pre`, the copy of the round in progress
//! (pre-recovery), which becomes `cur` on the commit and goes on an abort.
//!
//! A frame is `saved` once a cleaner checkpoint wrote it to the disks; the cleaner writes the
//! unsaved ones ([`FrameTable::to_flush`]) except those the same round wrote from a newer
//! dirty copy ([`FrameTable::supersede`], marked by the page writes of the round's
//! participants).
//!
//! After a cleaner checkpoint commits, the job's cleaning policy (DESIGN §7, on recovery
//! copies: the daemon does not evict active copies) says what stays: the recovery copies of
//! pages checkpointed in memory before (kept by none, P1, P3 and LRU; dropped by total and
//! P2), and a copy of each page the cleaner wrote from a newer dirty copy, which a holder
//! keeps aside while the round runs (`keep_written`) and which P1 and P2 keep as its two
//! readable recovery copies; LRU then drops the oldest until the node holds its threshold.
//!
//! [`rollback_target`] is the memory level of a rollback: which epoch the job returns to, and
//! which nodes lost their copies.
//!
//! Invariants: at most one `cur` and one `pre` per page; a `pre` never serves a read; the
//! frame count never exceeds the capacity (a store that would is refused before anything is
//! stored); every frame names the job it belongs to, and goes with it; the tables are bounded
//! ([`MAX_JOBS`], [`MAX_MEMORY_FILES`]).

use crate::cleaning::Policy;
use psls_pfs::Role;
use psls_svm::FileId;
use std::collections::{BTreeMap, HashMap};

/// Why a store of recovery copies is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// The frames would exceed the capacity.
    NoRoom { need: u64, used: u64, capacity: u64 },
    /// The request does not fit the table's state (another job's file, an old epoch).
    Invalid(String),
    /// A rollback's step finds this node without the state the rollback settled here: it
    /// restarted since (or held another checkpoint). Not a failure of the job: the rollback
    /// starts again.
    Restarted(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::NoRoom { need, used, capacity } => {
                write!(
                    f,
                    "{NO_ROOM} {need} recovery copies: {used} of {capacity} frames in use"
                )
            }
            FrameError::Invalid(why) | FrameError::Restarted(why) => f.write_str(why),
        }
    }
}

/// How a refusal for lack of room starts (its text; callers tell it by
/// [`FrameError::NoRoom`], `msg::Refusal::no_room` and `Outcome::NoRoom`).
pub const NO_ROOM: &str = "no room for";

/// Jobs with memory state in one table, at most.
pub const MAX_JOBS: usize = 4096;

/// Files marked as taking memory checkpoints, at most.
pub const MAX_MEMORY_FILES: usize = 1 << 18;

/// Where a recovery copy is among its page's two.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Site {
    /// On the page's holder of the frame's role; the other copy is on the other holder.
    Holder,
    /// On the page's primary holder; the other copy (standing for the mirror's) is on the
    /// page's writer, logical node `.0`, which holds neither of the page's disk copies.
    HolderWithWriter(u32),
    /// On the page's writer, which holds neither of its disk copies: it stands for the mirror
    /// copy (its role is `Mirror`); the other copy is on the primary holder.
    Writer,
}

/// Where a copy of page `index` of `file` in role `role`, stored on logical node `me` at the
/// word of logical node `from` (its writer, or the survivor re-creating it), stands; `None`
/// when `me` is not where such a copy goes (a peer's request to refuse).
pub fn site_of(p: &psls_pfs::Placement, file: FileId, index: u64, role: Role, me: u32, from: u32) -> Option<Site> {
    let primary = p.holder(file, index, Role::Primary).0;
    let mirror = p.holder(file, index, Role::Mirror).0;
    let other = if role == Role::Primary { mirror } else { primary };
    let holder = if role == Role::Primary { primary } else { mirror };
    if me == holder {
        if from == me || from == other {
            Some(Site::Holder)
        } else if role == Role::Primary {
            Some(Site::HolderWithWriter(from))
        } else {
            None
        }
    } else if role == Role::Mirror && me != primary && (from == me || from == primary) {
        Some(Site::Writer)
    } else {
        None
    }
}

/// One recovery copy of a page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame<D> {
    /// The memory checkpoint that took it.
    pub epoch: u64,
    /// Which of the page's two disk copies it stands for.
    pub role: Role,
    /// Where it is among the page's two copies.
    pub site: Site,
    pub data: D,
    /// Equal to the page's copy on the disks.
    pub saved: bool,
    /// The generation of a cleaner round that wrote a newer version of the page here (0:
    /// none).
    pub superseded_gen: u64,
}

#[derive(Debug)]
struct Slots<D> {
    cur: Option<Frame<D>>,
    pre: Option<Frame<D>>,
    /// What a cleaner round at this generation wrote to this node's disk (kept aside for a
    /// policy that keeps the pages it wrote in memory).
    written: Option<(u64, Frame<D>)>,
    /// The memory round of this epoch keeps the page's mirror copy on its writer: the copy
    /// held here goes when it commits (see [`FrameTable::store_moved`]).
    moved: Option<u64>,
}

impl<D> Default for Slots<D> {
    fn default() -> Self {
        Slots {
            cur: None,
            pre: None,
            written: None,
            moved: None,
        }
    }
}

impl<D> Slots<D> {
    fn count(&self) -> u64 {
        self.cur.is_some() as u64 + self.pre.is_some() as u64 + self.written.is_some() as u64
    }

    fn is_empty(&self) -> bool {
        self.count() == 0 && self.moved.is_none()
    }
}

#[derive(Debug)]
struct FileFrames<D> {
    job: String,
    pages: BTreeMap<u64, Slots<D>>,
}

/// A job's memory-checkpoint state in a table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JobMem {
    /// The last memory epoch committed here.
    pub committed: u64,
    /// The memory epoch whose pre-recovery copies are held here, if any.
    pub pre: Option<u64>,
    /// Stores of epochs up to this one are refused: their rounds are over (a later round
    /// began, or a rollback fenced them), and a late store must not become part of another
    /// checkpoint.
    pub floor: u64,
    /// A rollback to this memory epoch settled this node without it (it lost its copies):
    /// re-created copies are installed and the epoch adopted only while it is set. A node
    /// that restarts in the middle has it no more, so it never adopts a checkpoint with the
    /// copies of only the survivors that sent theirs after its restart (found by the
    /// simulator).
    pub recreating: Option<u64>,
}

/// Frame counts by category, over every job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FrameCounts {
    /// Copies of the last memory checkpoint (readable or pure recovery).
    pub recovery: u64,
    /// Copies of a memory checkpoint being taken.
    pub pre_recovery: u64,
    /// Of `recovery`, those newer than the disks.
    pub unsaved: u64,
    /// The most frames in use at once since the table was made, or last held none (the jobs
    /// before had all ended), and how many of them were recovery and pre-recovery copies then.
    pub peak: u64,
    pub peak_recovery: u64,
    pub peak_pre_recovery: u64,
}

impl FrameCounts {
    pub fn frames(&self) -> u64 {
        self.recovery + self.pre_recovery
    }
}

/// Pages of one file and role: their indices and data.
pub type Run<D> = (FileId, Role, Vec<u64>, Vec<D>);

/// Who writes pages to a node's disk during a cleaner round (see [`FrameTable::storing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskWrite {
    /// The round's writes of the pages its ranks wrote since the last checkpoint.
    Round,
    /// The round's flush of the recovery copies held in memory.
    Flush,
}

/// See the module documentation.
#[derive(Debug)]
pub struct FrameTable<D> {
    files: HashMap<FileId, FileFrames<D>>,
    jobs: HashMap<String, JobMem>,
    frames: u64,
    /// The most frames in use at once (see [`FrameCounts::peak`]), and the recovery and
    /// pre-recovery copies among them then.
    peak: u64,
    peak_split: (u64, u64),
    capacity: u64,
    /// Files of jobs that took memory checkpoints (on every node: loads of their pages look
    /// for recovery copies first), with their job.
    memory_files: HashMap<FileId, String>,
    /// Each job's cleaning policy, as its rounds' `Prepare` said.
    policies: HashMap<String, Policy>,
}

impl<D: Clone> FrameTable<D> {
    /// A table holding at most `capacity` frames.
    pub fn new(capacity: u64) -> FrameTable<D> {
        FrameTable {
            files: HashMap::new(),
            jobs: HashMap::new(),
            frames: 0,
            peak: 0,
            peak_split: (0, 0),
            capacity,
            memory_files: HashMap::new(),
            policies: HashMap::new(),
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Frames in use.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    fn file_of(&mut self, job: &str, file: FileId) -> Result<&mut FileFrames<D>, FrameError> {
        if !self.jobs.contains_key(job) && self.jobs.len() >= MAX_JOBS {
            return Err(FrameError::Invalid("too many jobs hold recovery copies here".into()));
        }
        let ff = self.files.entry(file).or_insert_with(|| FileFrames {
            job: job.to_string(),
            pages: BTreeMap::new(),
        });
        if ff.job != job {
            return Err(FrameError::Invalid(format!(
                "{file} has recovery copies of job {}",
                ff.job
            )));
        }
        Ok(ff)
    }

    /// Stores pre-recovery copies of `indices` of `file` (their data in order) for memory
    /// epoch `epoch` of `job`, whose last committed epoch was `committed` when the round
    /// began: a pre-recovery copy of an earlier epoch is settled by it first (its decision may
    /// still be on its way). Refused as a whole when the frames would not fit, when the file's
    /// frames belong to another job, or for an epoch not above the one committed here.
    #[allow(clippy::too_many_arguments)]
    pub fn store_pre(
        &mut self,
        job: &str,
        epoch: u64,
        committed: u64,
        file: FileId,
        role: Role,
        site: Site,
        indices: &[u64],
        data: Vec<D>,
    ) -> Result<(), FrameError> {
        if data.len() != indices.len() {
            return Err(FrameError::Invalid("one page of data per index is needed".into()));
        }
        // A page twice would be counted twice (a peer's malformed batch: refused whole).
        let mut seen = std::collections::HashSet::with_capacity(indices.len());
        if let Some(i) = indices.iter().find(|i| !seen.insert(**i)) {
            return Err(FrameError::Invalid(format!(
                "page {file}:{i} appears twice in one batch"
            )));
        }
        if (site == Site::Writer && role != Role::Mirror)
            || (matches!(site, Site::HolderWithWriter(_)) && role != Role::Primary)
        {
            return Err(FrameError::Invalid(format!("a {role:?} copy cannot be at {site:?}")));
        }
        self.check_round(job, epoch, committed)?;
        let (used, capacity) = (self.frames, self.capacity);
        let ff = self.file_of(job, file)?;
        let need = indices
            .iter()
            .filter(|i| ff.pages.get(i).is_none_or(|s| s.pre.is_none()))
            .count() as u64;
        if used + need > capacity {
            return Err(FrameError::NoRoom { need, used, capacity });
        }
        for (&i, d) in indices.iter().zip(data) {
            ff.pages.entry(i).or_default().pre = Some(Frame {
                epoch,
                role,
                site,
                data: d,
                saved: false,
                superseded_gen: 0,
            });
        }
        self.frames += need;
        self.note_peak();
        self.jobs.entry(job.to_string()).or_default().pre = Some(epoch);
        Ok(())
    }

    /// Settles the rounds before `epoch` of `job` (see [`FrameTable::settle_pre`]) and checks
    /// that a store of `epoch` is taken: above the epoch committed here and every fenced one,
    /// and the round whose copies are held here, if any.
    fn check_round(&mut self, job: &str, epoch: u64, committed: u64) -> Result<(), FrameError> {
        self.settle_pre(job, committed, epoch);
        let jm = self.jobs.get(job).copied().unwrap_or_default();
        if epoch <= jm.committed || epoch <= jm.floor || jm.pre.is_some_and(|p| p != epoch) {
            return Err(FrameError::Invalid(format!(
                "recovery copies of epoch {epoch} of {job}: epoch {} is held here",
                jm.pre.unwrap_or(jm.committed.max(jm.floor))
            )));
        }
        Ok(())
    }

    /// Memory epoch `epoch` of `job` keeps the mirror copies of `indices` of `file` on their
    /// writer (this node is their mirror holder): the copies held here go when the epoch
    /// commits, and stay if it does not. Taken and refused as [`FrameTable::store_pre`] is;
    /// needs no frame.
    pub fn store_moved(
        &mut self,
        job: &str,
        epoch: u64,
        committed: u64,
        file: FileId,
        indices: &[u64],
    ) -> Result<(), FrameError> {
        self.check_round(job, epoch, committed)?;
        let ff = self.file_of(job, file)?;
        for &i in indices {
            ff.pages.entry(i).or_default().moved = Some(epoch);
        }
        self.jobs.entry(job.to_string()).or_default().pre = Some(epoch);
        Ok(())
    }

    /// Memory epoch `epoch` of `job` committed: its pre-recovery copies are the recovery copies
    /// (those they replace, pure recovery of the previous checkpoint, go). A pre-recovery copy
    /// of an earlier epoch still here is a late store of a round that is over: it goes.
    pub fn commit(&mut self, job: &str, epoch: u64) {
        if !self.jobs.contains_key(job) && self.jobs.len() >= MAX_JOBS {
            return;
        }
        let jm = self.jobs.entry(job.to_string()).or_default();
        if jm.committed >= epoch {
            return;
        }
        jm.committed = epoch;
        jm.floor = jm.floor.max(epoch);
        if jm.pre.is_some_and(|p| p <= epoch) {
            jm.pre = None;
        }
        for ff in self.files.values_mut().filter(|f| f.job == job) {
            for s in ff.pages.values_mut() {
                match s.moved {
                    Some(e) if e == epoch => {
                        if s.cur.take().is_some() {
                            self.frames -= 1;
                        }
                        s.moved = None;
                    }
                    Some(e) if e < epoch => s.moved = None,
                    _ => {}
                }
                match s.pre.as_ref().map(|p| p.epoch) {
                    Some(e) if e == epoch => {
                        if s.cur.is_some() {
                            self.frames -= 1;
                        }
                        s.cur = s.pre.take();
                    }
                    Some(e) if e < epoch => {
                        s.pre = None;
                        self.frames -= 1;
                    }
                    _ => {}
                }
            }
        }
        self.prune();
    }

    /// Memory epoch `epoch` of `job` did not commit: its pre-recovery copies go (not those
    /// of a later round, which may already be arriving).
    pub fn abort(&mut self, job: &str, epoch: u64) {
        self.drop_pre(job, |e| e == epoch);
    }

    /// Drops the pre-recovery copies of `job` of the epochs `which` names.
    fn drop_pre(&mut self, job: &str, which: impl Fn(u64) -> bool) {
        if let Some(jm) = self.jobs.get_mut(job) {
            if jm.pre.is_some_and(&which) {
                jm.pre = None;
            }
        }
        for ff in self.files.values_mut().filter(|f| f.job == job) {
            for s in ff.pages.values_mut() {
                if s.pre.as_ref().is_some_and(|p| which(p.epoch)) {
                    s.pre = None;
                    self.frames -= 1;
                }
                if s.moved.is_some_and(&which) {
                    s.moved = None;
                }
            }
        }
        self.prune();
    }

    /// A round of `job` at `epoch` whose coordinator says `committed` is the last committed
    /// epoch: a pre-recovery copy of an earlier epoch held here is committed if that is it,
    /// and goes otherwise.
    pub fn settle_pre(&mut self, job: &str, committed: u64, epoch: u64) {
        if let Some(p) = self.job(job).pre.filter(|&p| p < epoch) {
            if p == committed {
                self.commit(job, p);
            } else {
                self.abort(job, p);
            }
        }
        // Earlier rounds are over: a late store of one is refused.
        if let Some(jm) = self.jobs.get_mut(job) {
            jm.floor = jm.floor.max(epoch.saturating_sub(1));
        } else if self.jobs.len() < MAX_JOBS {
            self.jobs.insert(
                job.to_string(),
                JobMem {
                    floor: epoch.saturating_sub(1),
                    ..JobMem::default()
                },
            );
        }
    }

    /// The job's state here.
    pub fn job(&self, job: &str) -> JobMem {
        self.jobs.get(job).copied().unwrap_or_default()
    }

    /// The committed recovery copy of page `index` of `file`, if held here.
    pub fn read(&self, file: FileId, index: u64) -> Option<&D> {
        self.files.get(&file)?.pages.get(&index)?.cur.as_ref().map(|f| &f.data)
    }

    /// [`FrameTable::read`] for a load of `job`: a copy another job keeps is not this job's
    /// checkpoint (the frames of a job that ended and was not dropped here must never be
    /// served to the next job writing the file: found by the nemesis, a job computing on
    /// another job's pages).
    pub fn read_of(&self, job: &str, file: FileId, index: u64) -> Option<&D> {
        self.files.get(&file).filter(|ff| ff.job == job)?;
        self.read(file, index)
    }

    /// The jobs that hold recovery copies or state here.
    pub fn jobs(&self) -> Vec<String> {
        let mut out: Vec<String> = self.jobs.keys().cloned().collect();
        for ff in self.files.values() {
            if !out.contains(&ff.job) {
                out.push(ff.job.clone());
            }
        }
        out
    }

    /// The pre-recovery copy of page `index` of `file`, if held here (for checks).
    pub fn read_pre(&self, file: FileId, index: u64) -> Option<&Frame<D>> {
        self.files.get(&file)?.pages.get(&index)?.pre.as_ref()
    }

    /// Pages `indices` of `file` are about to be written to this node's disk at `gen` by `by`:
    /// a round's own writes supersede the older recovery copies held here (the round's flush
    /// must not write those over them); the flush of the recovery copies supersedes nothing
    /// (marked, they would go at the commit whatever the cleaning policy keeps).
    pub fn storing(&mut self, by: DiskWrite, file: FileId, indices: &[u64], gen: u64) {
        match by {
            DiskWrite::Round => self.supersede(file, indices, gen),
            DiskWrite::Flush => {}
        }
    }

    /// Pages `indices` of `file` were written to this node's disk at `gen` by `by` (`data`,
    /// in order): a round's own writes are kept aside for a policy that keeps them; the
    /// flushed recovery copies are held already.
    pub fn stored(&mut self, by: DiskWrite, file: FileId, role: Role, indices: &[u64], gen: u64, data: Vec<D>) {
        match by {
            DiskWrite::Round => self.keep_written(file, role, indices, gen, data),
            DiskWrite::Flush => {}
        }
    }

    /// A cleaner round at generation `gen` wrote newer versions of `indices` of `file` here
    /// (found by the simulator: a mark kept per round, not overwritten by an older one):
    /// their recovery copies are not to be flushed by it — the committed one, and a
    /// pre-recovery one of the memory round before whose decision has not arrived here yet
    /// (it comes before the round's flush, and the mark goes with it).
    pub fn supersede(&mut self, file: FileId, indices: &[u64], gen: u64) {
        let Some(ff) = self.files.get_mut(&file) else { return };
        for i in indices {
            let Some(s) = ff.pages.get_mut(i) else { continue };
            // The newest round's mark stays: a late write of an abandoned round must not
            // take it away.
            for f in [s.cur.as_mut(), s.pre.as_mut()].into_iter().flatten() {
                f.superseded_gen = f.superseded_gen.max(gen);
            }
        }
    }

    /// The recovery copies of `job` a cleaner round at `gen` writes to the disks, per (file,
    /// role): this node's holder copies to its own disk, and the mirror copies of the pages
    /// whose other copy is on their writer to their mirror holders' (a writer's copy is never
    /// written: the primary holder's is the same or newer).
    pub fn to_flush(&self, job: &str, gen: u64) -> Vec<Run<D>> {
        let mut out: BTreeMap<(FileId, bool), Run<D>> = BTreeMap::new();
        for (file, ff) in self.files.iter().filter(|(_, f)| f.job == job) {
            for (i, s) in &ff.pages {
                let Some(f) = &s.cur else { continue };
                if f.saved || f.superseded_gen == gen || f.site == Site::Writer {
                    continue;
                }
                let mut roles = vec![f.role];
                if matches!(f.site, Site::HolderWithWriter(_)) {
                    roles.push(Role::Mirror);
                }
                for role in roles {
                    let e = out
                        .entry((*file, role == Role::Mirror))
                        .or_insert_with(|| (*file, role, Vec::new(), Vec::new()));
                    e.2.push(*i);
                    e.3.push(f.data.clone());
                }
            }
        }
        out.into_values().collect()
    }

    /// `job`'s cleaning policy (from its rounds' `Prepare`).
    pub fn set_policy(&mut self, job: &str, policy: Policy) {
        if self.policies.contains_key(job) || self.policies.len() < MAX_JOBS {
            self.policies.insert(job.to_string(), policy);
        }
    }

    /// The policy of the job `file` belongs to, if known here.
    fn policy_of_file(&self, file: FileId) -> Option<Policy> {
        let job = self
            .memory_files
            .get(&file)
            .or_else(|| self.files.get(&file).map(|f| &f.job))?;
        self.policies.get(job).copied()
    }

    /// Whether this node should keep aside what a cleaner writes of `file` here (its job's
    /// policy keeps the pages a cleaner wrote: P1, P2).
    pub fn wants_written(&self, file: FileId) -> bool {
        matches!(self.policy_of_file(file), Some(Policy::P1 | Policy::P2))
    }

    /// A cleaner round at `gen` wrote `indices` of `file` (`data`, in order) to this node's
    /// disk as its `role` holder: kept aside if the job's policy keeps them and they fit (an
    /// optimization: nothing depends on it), until the round's decision.
    pub fn keep_written(&mut self, file: FileId, role: Role, indices: &[u64], gen: u64, data: Vec<D>) {
        if !self.wants_written(file) || indices.len() != data.len() {
            return;
        }
        let Some(job) = self
            .memory_files
            .get(&file)
            .cloned()
            .or_else(|| self.files.get(&file).map(|f| f.job.clone()))
        else {
            return;
        };
        let (used, capacity) = (self.frames, self.capacity);
        let Ok(ff) = self.file_of(&job, file) else { return };
        let need = indices
            .iter()
            .filter(|i| ff.pages.get(i).is_none_or(|s| s.written.is_none()))
            .count() as u64;
        if used + need > capacity {
            return;
        }
        for (&i, d) in indices.iter().zip(data) {
            let frame = Frame {
                epoch: 0,
                role,
                site: Site::Holder,
                data: d,
                saved: true,
                superseded_gen: 0,
            };
            ff.pages.entry(i).or_default().written = Some((gen, frame));
        }
        self.frames += need;
        self.note_peak();
    }

    /// The cleaner round at `gen` of `job` committed: the copies it flushed are on the disks,
    /// those it superseded are stale and go; then the job's cleaning policy says which stay
    /// (see the module documentation).
    pub fn persistent_committed(&mut self, job: &str, gen: u64) {
        let policy = self.policies.get(job).copied().unwrap_or(Policy::NoCleaning);
        let keep_before = matches!(
            policy,
            Policy::NoCleaning | Policy::P1 | Policy::P3 | Policy::Lru { .. }
        );
        let keep_written = matches!(policy, Policy::P1 | Policy::P2);
        for ff in self.files.values_mut().filter(|f| f.job == job) {
            for s in ff.pages.values_mut() {
                if let Some(f) = s.cur.as_mut() {
                    // A writer's copy goes whatever the policy: the disks hold its page now
                    // (flushed from the primary holder's copy, or newer).
                    if !keep_before || f.superseded_gen == gen || f.site == Site::Writer {
                        s.cur = None;
                        self.frames -= 1;
                    } else {
                        f.saved = true;
                        f.superseded_gen = 0;
                        f.site = Site::Holder;
                    }
                }
                if let Some((g, w)) = s.written.take() {
                    if keep_written && g == gen {
                        if s.cur.is_none() {
                            s.cur = Some(w);
                        } else {
                            // Its page was rewritten by this round: the written copy is the
                            // newer one.
                            s.cur = Some(w);
                            self.frames -= 1;
                        }
                    } else {
                        self.frames -= 1;
                    }
                }
            }
        }
        if let Policy::Lru { frames: limit } = policy {
            // The oldest recovery copies of the job go until the node holds the threshold
            // (copies newer than the disks are never dropped: here every one is saved).
            let mut old: Vec<(u64, FileId, u64)> = self
                .files
                .iter()
                .filter(|(_, f)| f.job == job)
                .flat_map(|(file, ff)| {
                    ff.pages
                        .iter()
                        .filter_map(|(i, s)| s.cur.as_ref().filter(|f| f.saved).map(|f| (f.epoch, *file, *i)))
                })
                .collect();
            old.sort_unstable();
            for (_, file, i) in old {
                if self.frames <= limit {
                    break;
                }
                if let Some(s) = self.files.get_mut(&file).and_then(|ff| ff.pages.get_mut(&i)) {
                    s.cur = None;
                    self.frames -= 1;
                }
            }
        }
        self.prune();
    }

    /// The cleaner round at `gen` of `job` did not commit: nothing it marked or kept aside
    /// counts.
    pub fn persistent_aborted(&mut self, job: &str, gen: u64) {
        for ff in self.files.values_mut().filter(|f| f.job == job) {
            for s in ff.pages.values_mut() {
                if let Some(f) = s.cur.as_mut().filter(|f| f.superseded_gen == gen) {
                    f.superseded_gen = 0;
                }
                if s.written.as_ref().is_some_and(|(g, _)| *g <= gen) {
                    s.written = None;
                    self.frames -= 1;
                }
            }
        }
        self.prune();
    }

    /// Every committed recovery copy of `job` held here: (file, page, frame).
    pub fn committed_frames(&self, job: &str) -> Vec<(FileId, u64, Frame<D>)> {
        let mut out = Vec::new();
        for (file, ff) in self.files.iter().filter(|(_, f)| f.job == job) {
            for (i, s) in &ff.pages {
                if let Some(f) = &s.cur {
                    out.push((*file, *i, f.clone()));
                }
            }
        }
        out
    }

    /// The copies this node (logical `me`) sends to re-create those the nodes in `lost` held
    /// (a rollback to memory checkpoint `target` after they lost theirs): per (node, file, role
    /// it holds them as), the pages and this node's committed copies of them, in page order,
    /// each at the site it has there. A page's copy goes to where its other copy was: the
    /// other holder, the writer (from the primary holder), or the primary holder (from the
    /// writer). A lost node sends nothing; any other that does not hold `target` (it restarted
    /// since the rollback asked its state: found by the simulator, a lost node then adopted the
    /// checkpoint without the copies this one had) refuses, and the rollback starts again.
    #[allow(clippy::type_complexity)]
    pub fn copies_for_lost(
        &self,
        job: &str,
        target: u64,
        lost: &[u32],
        placement: &psls_pfs::Placement,
        me: u32,
    ) -> Result<BTreeMap<(psls_svm::NodeId, FileId, Role), Vec<(u64, Frame<D>)>>, FrameError> {
        let mut out: BTreeMap<_, Vec<_>> = BTreeMap::new();
        if lost.contains(&me) {
            return Ok(out);
        }
        let held = self.job(job).committed;
        if held != target {
            return Err(FrameError::Restarted(format!(
                "recovery copies of {job}: this node holds checkpoint {held}, not {target}"
            )));
        }
        for (file, index, frame) in self.committed_frames(job) {
            let (to, role, site) = match frame.site {
                Site::Holder => {
                    let role = match frame.role {
                        Role::Primary => Role::Mirror,
                        Role::Mirror => Role::Primary,
                    };
                    (placement.holder(file, index, role), role, Site::Holder)
                }
                Site::HolderWithWriter(w) => (psls_svm::NodeId(w), Role::Mirror, Site::Writer),
                Site::Writer => (
                    placement.holder(file, index, Role::Primary),
                    Role::Primary,
                    Site::HolderWithWriter(me),
                ),
            };
            if lost.contains(&to.0) {
                out.entry((to, file, role))
                    .or_default()
                    .push((index, Frame { role, site, ..frame }));
            }
        }
        Ok(out)
    }

    /// Installs recovery copies re-created from the other copy (a rollback). Refused as a
    /// whole when they do not fit. Where two survivors send a copy of one page (a writer's
    /// copy may be older than a later writer's), the newest epoch stays. The job's committed
    /// epoch stays: it is [`FrameTable::adopt`]ed once every survivor sent its copies, so a
    /// restore cut short leaves this node lost, and its copies are re-created whole by the next.
    pub fn install(&mut self, job: &str, file: FileId, pages: Vec<(u64, Frame<D>)>) -> Result<(), FrameError> {
        let Some(target) = self.job(job).recreating else {
            return Err(FrameError::Restarted(format!(
                "recovery copies of {job} re-created here, where no rollback awaits them"
            )));
        };
        if let Some((i, f)) = pages.iter().find(|(_, f)| f.epoch > target) {
            return Err(FrameError::Invalid(format!(
                "a re-created copy of page {file}:{i} of epoch {} is newer than the rollback's {target}",
                f.epoch
            )));
        }
        let (used, capacity) = (self.frames, self.capacity);
        let ff = self.file_of(job, file)?;
        let mut fresh: Vec<u64> = pages
            .iter()
            .filter(|(i, _)| ff.pages.get(i).is_none_or(|s| s.cur.is_none()))
            .map(|(i, _)| *i)
            .collect();
        fresh.sort_unstable();
        fresh.dedup();
        let need = fresh.len() as u64;
        if used + need > capacity {
            return Err(FrameError::NoRoom { need, used, capacity });
        }
        for (i, f) in pages {
            let s = ff.pages.entry(i).or_default();
            if s.cur.as_ref().is_none_or(|c| c.epoch <= f.epoch) {
                s.cur = Some(f);
            }
        }
        self.frames += need;
        self.note_peak();
        Ok(())
    }

    /// Every survivor re-created this node's copies of `job`'s memory checkpoint `committed`:
    /// it is committed here. Refused unless the rollback that settled this node to it is the
    /// one re-creating them ([`JobMem::recreating`]).
    pub fn adopt(&mut self, job: &str, committed: u64) -> Result<(), FrameError> {
        match self.jobs.get_mut(job) {
            Some(jm) if jm.recreating == Some(committed) => {
                jm.committed = jm.committed.max(committed);
                jm.recreating = None;
                Ok(())
            }
            _ => Err(FrameError::Restarted(format!(
                "checkpoint {committed} of {job} is not being re-created here (a restart since the rollback settled it?)"
            ))),
        }
    }

    /// A rollback of `job` to memory epoch `target` (0: the persistent checkpoint), with every
    /// epoch up to `fenced` fenced: a pre-recovery copy of `target` is committed, later ones
    /// go, and no store of a fenced epoch is taken any more; with `target` 0 every copy that
    /// may differ from the disks goes too — unsaved, or marked by a cleaner round (which may
    /// have committed without this node hearing it).
    /// A node that does not hold `target` (it lost its copies: the rollback re-creates them)
    /// keeps its older committed epoch until it [`FrameTable::adopt`]s the target, so a
    /// rollback cut short before every copy came back finds it lost again.
    /// A writer's copy of an epoch up to `persistent` (the job's persistent checkpoint) goes
    /// too: the disks hold its page, or a newer version (a node that missed a cleaner's commit
    /// keeps its writer's copies).
    pub fn settle(&mut self, job: &str, target: u64, fenced: u64, persistent: u64) {
        let was = self.job(job);
        let holds = target == 0 || was.committed == target || was.pre == Some(target);
        if target > 0 && self.job(job).pre == Some(target) {
            self.commit(job, target);
        }
        self.drop_pre(job, |e| e > target);
        for ff in self.files.values_mut().filter(|f| f.job == job) {
            for s in ff.pages.values_mut() {
                let stale = s.cur.as_ref().is_some_and(|f| {
                    if target == 0 {
                        !f.saved || f.superseded_gen != 0
                    } else {
                        f.epoch > target || (f.site == Site::Writer && f.epoch <= persistent)
                    }
                });
                if stale {
                    s.cur = None;
                    self.frames -= 1;
                }
                if let Some(f) = s.cur.as_mut() {
                    f.superseded_gen = 0;
                }
                // A cleaner in progress is over.
                if s.written.take().is_some() {
                    self.frames -= 1;
                }
            }
        }
        self.prune();
        if self.jobs.contains_key(job) || self.jobs.len() < MAX_JOBS {
            let jm = self.jobs.entry(job.to_string()).or_default();
            jm.committed = if holds { target } else { jm.committed.min(target) };
            jm.floor = jm.floor.max(fenced).max(target);
            jm.recreating = (!holds).then_some(target);
        }
    }

    /// A memory round of `job` over `files` begins: loads of their pages look for recovery
    /// copies first from now on, until the job ends.
    pub fn mark_memory(&mut self, job: &str, files: &[FileId]) {
        for f in files {
            if self.memory_files.len() >= MAX_MEMORY_FILES && !self.memory_files.contains_key(f) {
                return; // bounded: a later round marks it again
            }
            self.memory_files.insert(*f, job.to_string());
        }
    }

    /// The files of `job` whose loads look for recovery copies.
    pub fn memory_files(&self, job: &str) -> Vec<FileId> {
        let mut v: Vec<FileId> = self
            .memory_files
            .iter()
            .filter(|(_, j)| *j == job)
            .map(|(f, _)| *f)
            .collect();
        v.sort_unstable();
        v
    }

    /// Whether loads of `file`'s pages must look for recovery copies.
    pub fn in_memory(&self, file: FileId) -> bool {
        self.memory_files.contains_key(&file)
    }

    /// The job whose memory checkpoints hold `file` here (its loads look for that job's
    /// recovery copies first).
    pub fn memory_job(&self, file: FileId) -> Option<&str> {
        self.memory_files.get(&file).map(String::as_str)
    }

    /// Whether `file` has recovery copies here.
    pub fn holds(&self, file: FileId) -> bool {
        self.files.contains_key(&file)
    }

    /// `job` is over: everything of it goes (and with the last frame, the peak: the next job's
    /// peak is its own).
    pub fn end_job(&mut self, job: &str) {
        self.memory_files.retain(|_, j| j != job);
        self.jobs.remove(job);
        self.policies.remove(job);
        let frames = &mut self.frames;
        self.files.retain(|_, ff| {
            if ff.job == job {
                *frames -= ff.pages.values().map(Slots::count).sum::<u64>();
                false
            } else {
                true
            }
        });
        if self.frames == 0 {
            self.peak = 0;
            self.peak_split = (0, 0);
        }
    }

    pub fn counts(&self) -> FrameCounts {
        let c = self.counts_where(|_| true);
        assert_eq!(c.frames(), self.frames, "the frame count drifted");
        FrameCounts {
            peak: self.peak,
            peak_recovery: self.peak_split.0,
            peak_pre_recovery: self.peak_split.1,
            ..c
        }
    }

    /// The frames of `job` held here, by category (no peak).
    pub fn job_counts(&self, job: &str) -> FrameCounts {
        self.counts_where(|j| j == job)
    }

    fn counts_where(&self, want: impl Fn(&str) -> bool) -> FrameCounts {
        let mut c = FrameCounts::default();
        for ff in self.files.values().filter(|ff| want(&ff.job)) {
            for s in ff.pages.values() {
                if let Some(f) = &s.cur {
                    c.recovery += 1;
                    c.unsaved += !f.saved as u64;
                }
                // A copy a cleaner wrote, kept aside until its decision, is one in the making.
                c.pre_recovery += s.pre.is_some() as u64 + s.written.is_some() as u64;
            }
        }
        c
    }

    /// A new peak: remembered with its categories (one pass over the frames, only while the
    /// count climbs above every earlier one).
    fn note_peak(&mut self) {
        if self.frames > self.peak {
            self.peak = self.frames;
            let c = self.counts_where(|_| true);
            self.peak_split = (c.recovery, c.pre_recovery);
        }
    }

    fn prune(&mut self) {
        for ff in self.files.values_mut() {
            ff.pages.retain(|_, s| !s.is_empty());
        }
        self.files.retain(|_, f| !f.pages.is_empty());
    }
}

/// The epoch a rollback fences: above the job's metadata floor (`floor`: every epoch the
/// metadata began or fenced), the coordinator's last started round (`started`) and every
/// epoch a node saw (`seen`: memory epochs leave no record), so no round of the stopped run can
/// commit later.
pub fn fence_epoch(floor: u64, started: u64, seen: u64) -> u64 {
    floor.max(started).max(seen)
}

/// The memory level of a rollback (DESIGN §8). `states`: per live logical node, its last
/// committed memory epoch and the epoch of the pre-recovery copies it holds; `persistent`:
/// the job's last persistent checkpoint; `nodes`: how many logical nodes. Returns the memory
/// epoch to return to (0: the persistent checkpoint) and the nodes that lost their copies
/// (every live node heard every memory commit, or holds its pre-recovery copies; one that
/// did neither restarted, or is a spare in a lost node's place). A page's two copies are on
/// its primary holder and on its mirror holder or its writer: two nodes that both lost theirs
/// may have held both copies of some page, and no survivor knows which: back to the
/// persistent checkpoint.
pub fn rollback_target(states: &[(u32, u64, Option<u64>)], persistent: u64, nodes: u32) -> (u64, Vec<u32>) {
    let newest = states.iter().map(|s| s.1).max().unwrap_or(0);
    let lost: Vec<u32> = states
        .iter()
        .filter(|(_, c, pre)| *c < newest && *pre != Some(newest))
        .map(|s| s.0)
        .collect();
    if newest <= persistent || nodes == 0 || lost.len() > 1 {
        return (0, lost);
    }
    (newest, lost)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_commit_abort_flush_and_settle() {
        let mut a: FrameTable<u8> = FrameTable::new(4);
        let f = FileId(7);
        a.store_pre("j", 1, 0, f, Role::Primary, Site::Holder, &[0, 1], vec![1, 2])
            .unwrap();
        assert_eq!(a.read(f, 0), None, "a pre-recovery copy serves no read");
        assert_eq!(a.counts().pre_recovery, 2);
        a.commit("j", 1);
        assert_eq!(a.read(f, 1), Some(&2));
        assert_eq!(
            a.job("j"),
            JobMem {
                committed: 1,
                pre: None,
                floor: 1,
                recreating: None,
            }
        );
        // Epoch 2 rewrites page 0: the old copy stays until the commit.
        a.store_pre("j", 2, 1, f, Role::Primary, Site::Holder, &[0], vec![3])
            .unwrap();
        assert_eq!(a.frames(), 3);
        // The peak, with what it was made of: two recovery copies and one pre-recovery.
        let c = a.counts();
        assert_eq!((c.peak, c.peak_recovery, c.peak_pre_recovery), (3, 2, 1));
        assert_eq!(a.job_counts("j").recovery, 2);
        assert_eq!(a.job_counts("other"), FrameCounts::default());
        let err = a.store_pre("j", 2, 1, f, Role::Primary, Site::Holder, &[2, 3], vec![0, 0]);
        assert_eq!(
            err,
            Err(FrameError::NoRoom {
                need: 2,
                used: 3,
                capacity: 4
            })
        );
        assert_eq!(a.frames(), 3, "a refusal stores nothing");
        assert!(a
            .store_pre("other", 1, 0, f, Role::Primary, Site::Holder, &[9], vec![0])
            .is_err());
        // Found by a review: a page twice in one batch was counted twice (the daemon's count
        // check then panicked); the batch is refused whole.
        let twice = a.store_pre("j", 2, 1, f, Role::Primary, Site::Holder, &[2, 2], vec![7, 8]);
        assert!(
            matches!(twice, Err(FrameError::Invalid(ref m)) if m.contains("appears twice")),
            "{twice:?}"
        );
        assert_eq!((a.frames(), a.counts().frames()), (3, 3), "a refusal stores nothing");
        a.abort("j", 2);
        assert_eq!((a.frames(), a.read(f, 0)), (2, Some(&1)));
        // Epoch 3's store arrives before epoch 2's decision: settled by what the round says.
        a.store_pre("j", 3, 1, f, Role::Primary, Site::Holder, &[0], vec![4])
            .unwrap();
        a.store_pre("j", 4, 3, f, Role::Primary, Site::Holder, &[1], vec![5])
            .unwrap();
        assert_eq!(
            (a.read(f, 0), a.job("j").committed),
            (Some(&4), 3),
            "3 committed by 4's store"
        );
        a.abort("j", 4);
        assert_eq!((a.frames(), a.read(f, 1)), (2, Some(&2)));
        // A cleaner at generation 9 wrote page 1 from a newer copy; page 0 is flushed.
        a.supersede(f, &[1], 9);
        let fl = a.to_flush("j", 9);
        assert_eq!(fl, vec![(f, Role::Primary, vec![0], vec![4])]);
        a.persistent_aborted("j", 9);
        assert_eq!(a.to_flush("j", 10)[0].2, vec![0, 1]);
        a.supersede(f, &[1], 11);
        a.persistent_committed("j", 11);
        assert_eq!((a.frames(), a.counts().unsaved), (1, 0));
        assert!(a.to_flush("j", 12).is_empty());
        // A rollback to the persistent checkpoint keeps saved copies, drops the rest.
        a.store_pre("j", 5, 3, f, Role::Primary, Site::Holder, &[2], vec![5])
            .unwrap();
        a.commit("j", 5);
        a.store_pre("j", 6, 5, f, Role::Primary, Site::Holder, &[3], vec![6])
            .unwrap();
        a.settle("j", 5, 6, 0);
        assert_eq!(a.frames(), 2, "the pre-recovery copy of 6 went");
        a.settle("j", 0, 6, 0);
        assert_eq!(a.frames(), 1);
        assert_eq!(a.read(f, 0), Some(&4));
        // A late store of a fenced epoch is refused.
        assert!(a
            .store_pre("j", 6, 0, f, Role::Primary, Site::Holder, &[9], vec![1])
            .is_err());
        a.mark_memory("j", &[f]);
        assert!(a.in_memory(f));
        a.end_job("j");
        assert_eq!(a.frames(), 0);
        assert!(!a.holds(f) && !a.in_memory(f));
        // No frame left: the next job's peak is its own.
        assert_eq!(a.counts().peak, 0);
    }

    #[test]
    fn each_cleaning_policy_keeps_exactly_its_recovery_copies() {
        let f = FileId(3);
        // Page 0 was checkpointed in memory and not written since (the cleaner flushes it),
        // page 1 too but written since (the cleaner writes the newer copy), page 2 was only
        // written (the cleaner writes it); all as this node's primary copies.
        let run = |policy: Policy| {
            let mut a: FrameTable<u8> = FrameTable::new(16);
            a.set_policy("j", policy);
            a.mark_memory("j", &[f]);
            a.store_pre("j", 3, 2, f, Role::Primary, Site::Holder, &[0, 1], vec![10, 11])
                .unwrap();
            a.commit("j", 3);
            a.supersede(f, &[1, 2], 9);
            a.keep_written(f, Role::Primary, &[1, 2], 9, vec![21, 22]);
            assert_eq!(a.to_flush("j", 9), vec![(f, Role::Primary, vec![0], vec![10])]);
            a.persistent_committed("j", 9);
            let kept: Vec<(u64, u8)> = (0..3).filter_map(|i| a.read(f, i).map(|d| (i, *d))).collect();
            assert_eq!(a.counts().frames(), kept.len() as u64, "{policy}: nothing else held");
            assert_eq!(a.counts().unsaved, 0, "{policy}: every copy kept is on the disks");
            kept
        };
        assert_eq!(run(Policy::NoCleaning), vec![(0, 10)]);
        assert_eq!(run(Policy::Total), vec![]);
        assert_eq!(run(Policy::P1), vec![(0, 10), (1, 21), (2, 22)]);
        assert_eq!(run(Policy::P2), vec![(1, 21), (2, 22)]);
        assert_eq!(run(Policy::P3), vec![(0, 10)]);
        assert_eq!(run(Policy::Lru { frames: 0 }), vec![]);
        assert_eq!(run(Policy::Lru { frames: 1 }), vec![(0, 10)]);
        // An aborted cleaner keeps nothing aside.
        let mut a: FrameTable<u8> = FrameTable::new(16);
        a.set_policy("j", Policy::P1);
        a.mark_memory("j", &[f]);
        a.keep_written(f, Role::Mirror, &[5], 4, vec![1]);
        assert_eq!(a.counts().pre_recovery, 1);
        a.persistent_aborted("j", 4);
        assert_eq!(a.frames(), 0);
    }

    /// A review finding: the daemon marked the copies a cleaner flushed as superseded by the
    /// flush's own write, so a policy keeping recovery copies lost them at the commit.
    #[test]
    fn a_flush_supersedes_nothing_and_a_rounds_write_supersedes_the_older_copy() {
        let f = FileId(3);
        let run = |by: DiskWrite| {
            let mut a: FrameTable<u8> = FrameTable::new(16);
            a.set_policy("j", Policy::P1);
            a.mark_memory("j", &[f]);
            a.store_pre("j", 3, 2, f, Role::Primary, Site::Holder, &[0], vec![10])
                .unwrap();
            a.commit("j", 3);
            let flushed = a.to_flush("j", 9);
            assert_eq!(flushed, vec![(f, Role::Primary, vec![0], vec![10])]);
            a.storing(by, f, &[0], 9);
            a.stored(by, f, Role::Primary, &[0], 9, vec![21]);
            a.persistent_committed("j", 9);
            (a.read(f, 0).copied(), a.counts().frames())
        };
        assert_eq!(
            run(DiskWrite::Flush),
            (Some(10), 1),
            "the flushed copy stays (P1 keeps it)"
        );
        assert_eq!(
            run(DiskWrite::Round),
            (Some(21), 1),
            "the round's newer copy replaces it"
        );
    }

    #[test]
    fn a_rollback_commits_a_pre_recovery_copy_of_its_target() {
        let mut a: FrameTable<u8> = FrameTable::new(8);
        let f = FileId(1);
        a.store_pre("j", 2, 0, f, Role::Mirror, Site::Holder, &[5], vec![9])
            .unwrap();
        a.settle("j", 2, 2, 0);
        assert_eq!(a.read(f, 5), Some(&9));
        assert_eq!(a.job("j").committed, 2);
    }

    /// Found by the checkpoint simulator: a restore cut short after the settle, with only one
    /// of two holders' copies re-created, must find the node lost again.
    #[test]
    fn a_node_that_lost_its_copies_stays_lost_until_it_adopts_the_re_created_ones() {
        let mut a: FrameTable<u8> = FrameTable::new(8);
        let f = FileId(1);
        let frame = Frame {
            epoch: 3,
            role: Role::Mirror,
            site: Site::Holder,
            data: 7,
            saved: false,
            superseded_gen: 0,
        };
        a.settle("j", 3, 3, 0);
        assert_eq!(a.job("j").committed, 0, "a restarted node does not hold checkpoint 3");
        a.install("j", f, vec![(4, frame.clone())]).unwrap();
        assert_eq!(a.job("j").committed, 0, "one holder's copies are not all of them");
        assert_eq!(
            rollback_target(&[(0, 3, None), (1, a.job("j").committed, None), (2, 3, None)], 1, 3).1,
            vec![1]
        );
        assert!(a.adopt("j", 2).is_err(), "2 is not the rollback's checkpoint");
        a.adopt("j", 3).unwrap();
        assert_eq!((a.job("j").committed, a.read(f, 4)), (3, Some(&7)));
        // Another job's load is not served this job's copies.
        assert_eq!((a.read_of("j", f, 4), a.read_of("k", f, 4)), (Some(&7), None));
        // Found by the simulator: a lost node that restarts while its copies are re-created
        // takes no more of them, and adopts nothing.
        // (A restart, not a failure of the job: the rollback starts again. The daemon once took
        // it for a failure and failed the job, found by the nemesis.)
        let mut b: FrameTable<u8> = FrameTable::new(8);
        assert!(matches!(
            b.install("j", f, vec![(4, frame.clone())]),
            Err(FrameError::Restarted(_))
        ));
        assert!(matches!(b.adopt("j", 3), Err(FrameError::Restarted(_))));
        let placement = psls_pfs::Placement::new(4).expect("4 nodes");
        assert!(matches!(
            b.copies_for_lost("j", 3, &[1], &placement, 0),
            Err(FrameError::Restarted(_))
        ));
        b.settle("j", 3, 3, 0);
        assert!(
            b.install("j", f, vec![(4, Frame { epoch: 4, ..frame })]).is_err(),
            "newer than the target"
        );
        // A rollback to the persistent checkpoint: every node is at 0.
        a.settle("j", 0, 4, 0);
        assert_eq!(a.job("j").committed, 0);
    }

    #[test]
    fn the_rollback_target_is_the_newest_memory_epoch_unless_two_nodes_lost_theirs() {
        // Node 1 restarted (nothing), node 2 missed the decision of 5 but holds its copies.
        let s = [(0, 5, None), (1, 0, None), (2, 4, Some(5)), (3, 5, None)];
        assert_eq!(rollback_target(&s, 3, 4), (5, vec![1]));
        // Older than the persistent checkpoint: that one.
        assert_eq!(rollback_target(&s, 5, 4).0, 0);
        // Two nodes lost theirs, neighbours or not: some page may have had both copies there.
        let s = [(0, 0, None), (1, 5, None), (2, 5, None), (3, 0, None)];
        assert_eq!(rollback_target(&s, 3, 4), (0, vec![0, 3]));
        let s = [(0, 0, None), (1, 5, None), (2, 0, None), (3, 5, None)];
        assert_eq!(rollback_target(&s, 3, 4), (0, vec![0, 2]));
    }

    /// Four nodes; page 0 of `F` is homed on 0 and mirrored on 1 (placement), written by node
    /// 2, which holds neither disk copy.
    const F: FileId = FileId(11);

    fn holders(p: &psls_pfs::Placement, i: u64) -> (u32, u32) {
        (p.holder(F, i, Role::Primary).0, p.holder(F, i, Role::Mirror).0)
    }

    #[test]
    fn a_page_written_by_neither_holder_keeps_one_copy_on_its_writer() {
        let p = psls_pfs::Placement::new(4).expect("4 nodes");
        let (h1, h2) = holders(&p, 0);
        let w = (0..4).find(|n| *n != h1 && *n != h2).unwrap();
        // Where each copy stands, as the nodes work it out from who sends it.
        assert_eq!(site_of(&p, F, 0, Role::Primary, h1, w), Some(Site::HolderWithWriter(w)));
        assert_eq!(site_of(&p, F, 0, Role::Primary, h1, h2), Some(Site::Holder));
        assert_eq!(site_of(&p, F, 0, Role::Primary, h1, h1), Some(Site::Holder));
        assert_eq!(site_of(&p, F, 0, Role::Mirror, h2, h1), Some(Site::Holder));
        assert_eq!(site_of(&p, F, 0, Role::Mirror, w, w), Some(Site::Writer));
        assert_eq!(
            site_of(&p, F, 0, Role::Mirror, w, h1),
            Some(Site::Writer),
            "re-created by the primary holder"
        );
        assert_eq!(
            site_of(&p, F, 0, Role::Mirror, h2, w),
            None,
            "the writer sends no mirror copy"
        );
        assert_eq!(site_of(&p, F, 0, Role::Primary, w, w), None);
        assert_eq!(site_of(&p, F, 0, Role::Mirror, w, h2), None);
        // Epoch 1: the mirror holder wrote the page (both copies on the holders).
        let mut t: Vec<FrameTable<u8>> = (0..4).map(|_| FrameTable::new(8)).collect();
        t[h1 as usize]
            .store_pre("j", 1, 0, F, Role::Primary, Site::Holder, &[0], vec![1])
            .unwrap();
        t[h2 as usize]
            .store_pre("j", 1, 0, F, Role::Mirror, Site::Holder, &[0], vec![1])
            .unwrap();
        t.iter_mut().for_each(|a| a.commit("j", 1));
        // Epoch 2: node w wrote it: its own copy, one to the primary holder, and word to the
        // mirror holder, whose copy goes only when the epoch commits.
        t[w as usize]
            .store_pre("j", 2, 1, F, Role::Mirror, Site::Writer, &[0], vec![2])
            .unwrap();
        t[h1 as usize]
            .store_pre("j", 2, 1, F, Role::Primary, Site::HolderWithWriter(w), &[0], vec![2])
            .unwrap();
        t[h2 as usize].store_moved("j", 2, 1, F, &[0]).unwrap();
        assert_eq!(t[h2 as usize].job("j").pre, Some(2));
        let mut aborted: Vec<FrameTable<u8>> = (0..4).map(|_| FrameTable::new(8)).collect();
        aborted[h2 as usize]
            .store_pre("j", 1, 0, F, Role::Mirror, Site::Holder, &[0], vec![1])
            .unwrap();
        aborted[h2 as usize].commit("j", 1);
        aborted[h2 as usize].store_moved("j", 2, 1, F, &[0]).unwrap();
        aborted[h2 as usize].abort("j", 2);
        assert_eq!(
            aborted[h2 as usize].read(F, 0),
            Some(&1),
            "an aborted round moves nothing"
        );
        t.iter_mut().for_each(|a| a.commit("j", 2));
        assert_eq!(t[h1 as usize].read(F, 0), Some(&2));
        assert_eq!(t[w as usize].read(F, 0), Some(&2));
        assert_eq!(t[h2 as usize].read(F, 0), None, "the mirror holder keeps no older copy");
        assert_eq!(t.iter().map(FrameTable::frames).sum::<u64>(), 2);
        // The writer lost its copies: the primary holder re-creates it there, as a writer's.
        let c = t[h1 as usize].copies_for_lost("j", 2, &[w], &p, h1).unwrap();
        let ((to, file, role), pages) = c.into_iter().next().unwrap();
        assert_eq!((to.0, file, role), (w, F, Role::Mirror));
        assert_eq!((pages[0].1.site, pages[0].1.data), (Site::Writer, 2));
        assert!(t[h1 as usize]
            .copies_for_lost("j", 2, &[h2], &p, h1)
            .unwrap()
            .is_empty());
        assert!(
            t[h1 as usize].copies_for_lost("j", 3, &[w], &p, h1).is_err(),
            "checkpoint 3 is not held here"
        );
        assert!(
            FrameTable::<u8>::new(1)
                .copies_for_lost("j", 2, &[w], &p, w)
                .unwrap()
                .is_empty(),
            "a lost node sends nothing"
        );
        // The primary holder lost its copies: the writer re-creates it; an older writer's copy
        // sent too (another node wrote the page at epoch 1) loses to the newer.
        let c = t[w as usize].copies_for_lost("j", 2, &[h1], &p, w).unwrap();
        let ((to, _, role), pages) = c.into_iter().next().unwrap();
        assert_eq!(
            (to.0, role, pages[0].1.site),
            (h1, Role::Primary, Site::HolderWithWriter(w))
        );
        let mut fresh: FrameTable<u8> = FrameTable::new(8);
        fresh.settle("j", 2, 2, 0);
        fresh.install("j", F, pages.clone()).unwrap();
        let older = Frame {
            epoch: 1,
            data: 1,
            ..pages[0].1.clone()
        };
        fresh.install("j", F, vec![(0, older)]).unwrap();
        assert_eq!((fresh.read(F, 0), fresh.frames()), (Some(&2), 1));
        // A cleaner: the primary holder writes both disk copies; the writer's copy is never
        // written, and goes when the cleaner commits.
        assert_eq!(
            t[h1 as usize].to_flush("j", 9),
            vec![
                (F, Role::Primary, vec![0], vec![2]),
                (F, Role::Mirror, vec![0], vec![2])
            ]
        );
        assert!(t[w as usize].to_flush("j", 9).is_empty());
        t.iter_mut().for_each(|a| a.persistent_committed("j", 9));
        assert_eq!((t[w as usize].frames(), t[h1 as usize].frames()), (0, 1));
        // A writer that missed a cleaner's commit drops its copies older than the persistent
        // checkpoint when settling a rollback.
        let mut late: FrameTable<u8> = FrameTable::new(8);
        late.store_pre("j", 2, 1, F, Role::Mirror, Site::Writer, &[0], vec![2])
            .unwrap();
        late.commit("j", 2);
        late.settle("j", 4, 4, 3);
        assert_eq!(late.frames(), 0);
    }
}
