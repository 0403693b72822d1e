//! Checkpoint messages between the coordinator and the participants. Each names its job and
//! its epoch (the checkpoint's number within the job).

use psls_pfs::jobs::FileRuns;
use psls_svm::FileId;
use serde::{Deserialize, Serialize};

/// A checkpoint message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Coordinator → participant: write every dirty page of `files` you hold, to both copies
    /// at generation `gen`, durably, once your metadata has reached sequence `seq`.
    /// `committed` is the job's last committed epoch in the coordinator's metadata (it settles
    /// an earlier epoch the participant still holds in doubt).
    Prepare {
        job: String,
        epoch: u64,
        gen: u64,
        seq: u64,
        files: Vec<FileId>,
        committed: u64,
    },
    /// Participant → coordinator: every page taken for `epoch` is durable on both copies.
    Prepared {
        job: String,
        epoch: u64,
        written: Vec<FileRuns>,
        bytes: u64,
    },
    /// Participant → coordinator: the pages could not be written.
    Refused { job: String, epoch: u64, why: String },
    /// Coordinator → participant: the epoch committed (the pages taken are clean) or not
    /// (they are dirty again).
    Decide { job: String, epoch: u64, commit: bool },
    /// Participant → a new coordinator: `epoch` was prepared here and never decided.
    InDoubt { job: String, epoch: u64 },
}

impl Msg {
    pub fn job(&self) -> &str {
        match self {
            Msg::Prepare { job, .. }
            | Msg::Prepared { job, .. }
            | Msg::Refused { job, .. }
            | Msg::Decide { job, .. }
            | Msg::InDoubt { job, .. } => job,
        }
    }
    pub fn epoch(&self) -> u64 {
        match self {
            Msg::Prepare { epoch, .. }
            | Msg::Prepared { epoch, .. }
            | Msg::Refused { epoch, .. }
            | Msg::Decide { epoch, .. }
            | Msg::InDoubt { epoch, .. } => *epoch,
        }
    }
}
