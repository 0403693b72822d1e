//! One parallel file's metadata ([`FileMeta`]): name, size, owner and mode, the generation of
//! every page's committed version, and the job that writes it. Part of the replicated
//! namespace (`crate::meta`); on its own so that the checkpoint records (`crate::jobs`) can
//! change files without depending on the whole state.

use crate::gens::PageGens;
use psls_svm::{FileId, PAGE_SIZE};
use serde::{Deserialize, Serialize};

/// One parallel file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    pub id: FileId,
    pub name: String,
    pub size: u64,
    pub uid: u32,
    pub gid: u32,
    /// Permission bits (0o777 mask).
    pub mode: u32,
    /// Base generation: of every page no checkpoint wrote (set by the import; 0 means "all
    /// zero, never written").
    pub gen: u64,
    pub created_unix_ms: u64,
    /// Generations of the pages persistent checkpoints wrote since.
    pub written: PageGens,
    /// The job that maps the file writable (at most one at a time; readers are free).
    pub writer: Option<(String, u32)>,
}

impl FileMeta {
    /// A zero-filled file as `psls create` commits it: generation 0, no page written, no writer.
    pub fn zeroed(
        id: FileId,
        name: String,
        size: u64,
        uid: u32,
        gid: u32,
        mode: u32,
        created_unix_ms: u64,
    ) -> FileMeta {
        FileMeta {
            id,
            name,
            size,
            uid,
            gid,
            mode,
            gen: 0,
            created_unix_ms,
            written: PageGens::default(),
            writer: None,
        }
    }

    pub fn pages(&self) -> u64 {
        self.size.div_ceil(PAGE_SIZE as u64)
    }
    /// The generation of page `index`'s committed version (0: never written, all zero).
    pub fn page_gen(&self, index: u64) -> u64 {
        self.written.get(index).unwrap_or(self.gen)
    }
    /// The highest generation of any page (a new version must be above it).
    pub fn top_gen(&self) -> u64 {
        self.gen.max(self.written.max_gen())
    }
    /// Whether job `job` maps the file writable.
    pub fn written_by(&self, job: &str) -> bool {
        self.writer.as_ref().is_some_and(|(w, _)| w == job)
    }
    /// Whether every page is still all zero (nothing was ever written).
    pub fn never_written(&self) -> bool {
        self.gen == 0 && self.written.runs() == 0
    }
}

/// Format 2 of [`FileMeta`] (before `written`).
#[derive(Deserialize)]
pub(crate) struct FileMetaV2 {
    id: FileId,
    name: String,
    size: u64,
    uid: u32,
    gid: u32,
    mode: u32,
    gen: u64,
    created_unix_ms: u64,
}

impl From<FileMetaV2> for FileMeta {
    fn from(f: FileMetaV2) -> FileMeta {
        FileMeta {
            id: f.id,
            name: f.name,
            size: f.size,
            uid: f.uid,
            gid: f.gid,
            mode: f.mode,
            gen: f.gen,
            created_unix_ms: f.created_unix_ms,
            written: PageGens::default(),
            writer: None,
        }
    }
}
