//! Checkpoint commit records (DESIGN §7): one record per job names its last persistent
//! checkpoint, and the operations that change it — commit a checkpoint (every file of the job
//! at once), fence an epoch that must never commit, forget a job that ended.
//!
//! A checkpoint's pages are written to shadow slots at the checkpoint's generation and made
//! durable on both copies first; [`crate::meta::MetaOp::Checkpoint`] then sets, in one
//! replicated and durable metadata operation, the generation of every page it wrote. A power
//! cut before it leaves the previous checkpoint whole (the readers expect the old
//! generations); after it, the new one.
//!
//! A checkpoint begins with [`crate::meta::MetaOp::BeginCheckpoint`]: its epoch must be above
//! every epoch of the job begun, committed or fenced before, and it gets a generation from the
//! cluster-wide counter (`crate::meta::MetaState::next_gen`), above every page generation of every file.
//! So no two checkpoints ever write the same generation, and a write of an abandoned
//! checkpoint that arrives late can be told from a newer one's (the page store refuses to put
//! an older generation over a newer one).
//!
//! Invariants (checked by `apply`): a job's committed epoch only grows; only the epoch begun
//! last can commit, with the generation it was given, and not once fenced (so a late commit of
//! a fenced epoch, say from a coordinator that died mid-checkpoint and whose operation
//! resurfaced, is refused); a checkpoint's generation is above every generation of the pages of
//! the files it writes, so its writes never land in a page's committed slot; and it names only
//! existing files, pages inside them, with the node map its pages were placed with.

use crate::error::MetaError;
use crate::meta::MetaState;
use imbl::OrdMap;
use psls_svm::FileId;
use serde::{Deserialize, Serialize};

/// Longest job name in bytes.
pub const MAX_JOB_LEN: usize = 128;

/// Most files one checkpoint may name.
pub const MAX_CKPT_FILES: usize = 4096;

/// Most page runs one checkpoint may name (over all its files).
pub const MAX_CKPT_RUNS: usize = 1 << 20;

/// A job's checkpoint record.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobCkpt {
    /// The last committed checkpoint (0: none yet).
    pub epoch: u64,
    /// Its generation.
    pub gen: u64,
    /// When it committed (the coordinator's clock, ms since the Unix epoch).
    pub at_unix_ms: u64,
    /// Bytes of pages it wrote (one copy).
    pub bytes: u64,
    /// The highest epoch fenced: it and every lower epoch not committed never will be.
    pub fenced: u64,
    /// The epoch begun last, and the generation it was given.
    pub started: u64,
    pub started_gen: u64,
    /// What the job runs (a `psls run` job; `None` for a process outside one): what
    /// `psls run --resume` starts again and `psls jobs` shows.
    pub spec: Option<JobSummary>,
}

/// A `psls run` job, as its record keeps it (the environment comes from whoever resumes it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSummary {
    pub program: String,
    pub args: Vec<String>,
    pub ranks: u32,
    pub per_node: Option<u32>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub checkpoint_interval_ms: u64,
    pub checkpoint_timeout_ms: u64,
    pub max_restarts: u32,
    pub respawn_timeout_ms: u64,
    /// The node whose daemon launched it last, and when (ms since the Unix epoch).
    pub launcher: String,
    pub started_unix_ms: u64,
    /// How many times it was started (the first start, restarts, resumes).
    pub starts: u32,
}

/// Largest summary a record keeps (program, arguments, folder).
pub const MAX_SUMMARY_BYTES: usize = 64 * 1024;

/// How a `psls run` job checkpoints, as its record keeps it for `psls run --resume` (kept
/// beside the record, [`crate::meta::MetaState::job_options`]). The daemon parses the words.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobOptions {
    /// `auto`, `memory` or `persistent`.
    pub level: String,
    pub persistent_interval_ms: u64,
    /// Every this many-th checkpoint is a cleaner (0: by the interval only).
    pub persistent_every: u32,
    /// The cleaning policy (`p1`, `lru:N`, ...).
    pub cleaning: String,
    pub prefetch: bool,
}

/// Longest level or cleaning policy word a record keeps.
pub const MAX_OPTION_LEN: usize = 64;

/// Records (or updates) `job`'s summary and checkpoint options as it starts.
pub(crate) fn apply_start_with(
    next: &mut MetaState,
    job: &str,
    spec: &JobSummary,
    options: &JobOptions,
) -> Result<(), MetaError> {
    if options.level.len() > MAX_OPTION_LEN || options.cleaning.len() > MAX_OPTION_LEN {
        return Err(MetaError::Invalid(format!(
            "a job's level and cleaning policy take at most {MAX_OPTION_LEN} bytes each"
        )));
    }
    apply_start(next, job, spec)?;
    next.job_options.insert(job.to_string(), options.clone());
    Ok(())
}

/// Records (or updates) `job`'s summary as it starts.
pub(crate) fn apply_start(next: &mut MetaState, job: &str, spec: &JobSummary) -> Result<(), MetaError> {
    validate_job(job)?;
    let size = spec.program.len() + spec.cwd.len() + spec.args.iter().map(|a| a.len() + 1).sum::<usize>();
    if size > MAX_SUMMARY_BYTES {
        return Err(MetaError::Invalid(format!(
            "the job's command and folder take {size} bytes; at most {MAX_SUMMARY_BYTES}"
        )));
    }
    next.job_mut(job).spec = Some(spec.clone());
    Ok(())
}

/// The pages of one file a checkpoint wrote: runs `(start, end)`, end exclusive.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRuns {
    pub file: FileId,
    pub runs: Vec<(u64, u64)>,
}

/// Checks a job name.
pub fn validate_job(job: &str) -> Result<(), MetaError> {
    if job.is_empty() || job.len() > MAX_JOB_LEN || job.chars().any(|c| c.is_control()) {
        return Err(MetaError::Invalid(format!(
            "job name must be 1..={MAX_JOB_LEN} bytes without control characters"
        )));
    }
    Ok(())
}

/// The epoch the next checkpoint of `job` must be above (begun, committed or fenced), from
/// the jobs' records.
pub fn floor(jobs: &OrdMap<String, JobCkpt>, job: &str) -> u64 {
    jobs.get(job).map_or(0, |r| r.epoch.max(r.fenced).max(r.started))
}

/// Begins checkpoint `epoch` of `job`: gives it the next generation.
pub(crate) fn apply_begin(next: &mut MetaState, job: &str, epoch: u64) -> Result<(), MetaError> {
    validate_job(job)?;
    let f = floor(&next.jobs, job);
    if epoch <= f {
        return Err(MetaError::Invalid(format!(
            "checkpoint {epoch} of job {job} is stale (the job is at {f})"
        )));
    }
    // `next_gen` is above every page generation of every file (kept so by every operation that
    // sets one): no file is looked at.
    let gen = next.next_gen.max(2);
    next.set_next_gen(gen + 1);
    let rec = next.job_mut(job);
    rec.started = epoch;
    rec.started_gen = gen;
    Ok(())
}

/// Whether epoch `epoch` of `job` committed: `Some(true)` committed, `Some(false)` never will
/// (fenced, or a later epoch committed instead), `None` undecided.
pub fn decided(jobs: &OrdMap<String, JobCkpt>, job: &str, epoch: u64) -> Option<bool> {
    let r = jobs.get(job)?;
    if r.epoch == epoch {
        Some(true)
    } else if r.epoch > epoch || r.fenced >= epoch {
        Some(false)
    } else {
        None
    }
}

/// Applies a checkpoint commit record to `next` (see the module invariants).
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply_checkpoint(
    next: &mut MetaState,
    job: &str,
    epoch: u64,
    gen: u64,
    placed_at: u64,
    files: &[FileRuns],
    at_unix_ms: u64,
    bytes: u64,
) -> Result<(), MetaError> {
    validate_job(job)?;
    let rec = next.jobs.get(job).cloned().unwrap_or_default();
    if epoch <= rec.epoch.max(rec.fenced) || epoch != rec.started || gen != rec.started_gen {
        return Err(MetaError::Invalid(format!(
            "checkpoint {epoch} (generation {gen}) of job {job} is stale (committed {}, fenced {}, begun {} at generation {})",
            rec.epoch, rec.fenced, rec.started, rec.started_gen
        )));
    }
    if placed_at != next.map_version {
        return Err(MetaError::Invalid(
            "a node was replaced while the checkpoint was written; nothing was committed".into(),
        ));
    }
    if files.len() > MAX_CKPT_FILES || files.iter().map(|f| f.runs.len()).sum::<usize>() > MAX_CKPT_RUNS {
        return Err(MetaError::Invalid(
            "checkpoint names too many files or page runs".into(),
        ));
    }
    for fr in files {
        let Some(meta) = next.file_by_id(fr.file) else {
            return Err(MetaError::Invalid(format!(
                "checkpoint names file id {} that does not exist",
                fr.file
            )));
        };
        if gen <= meta.top_gen() {
            return Err(MetaError::Invalid(format!(
                "checkpoint generation {gen} is not above file '{}''s {}",
                meta.name,
                meta.top_gen()
            )));
        }
        let pages = meta.pages();
        for &(s, e) in &fr.runs {
            if s >= e || e > pages {
                return Err(MetaError::Invalid(format!(
                    "checkpoint names pages {s}..{e} of '{}' ({pages} pages)",
                    meta.name
                )));
            }
        }
        next.set_gens(fr.file, &fr.runs, gen);
    }
    next.set_next_gen(next.next_gen.max(gen + 1));
    next.touch_job(job);
    next.jobs.insert(
        job.to_string(),
        JobCkpt {
            epoch,
            gen,
            at_unix_ms,
            bytes,
            ..rec
        },
    );
    Ok(())
}

/// Fences epoch `epoch` of `job` (and every lower one not committed). An epoch at or below
/// the committed one is decided already: nothing changes (the caller reads [`decided`]).
pub(crate) fn apply_fence(next: &mut MetaState, job: &str, epoch: u64) -> Result<(), MetaError> {
    validate_job(job)?;
    let rec = next.job_mut(job);
    if epoch > rec.epoch {
        rec.fenced = rec.fenced.max(epoch);
    }
    Ok(())
}
