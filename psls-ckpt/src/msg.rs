//! Checkpoint messages between the coordinator and the participants. Each names its job and
//! its epoch (the checkpoint's number within the job), and [`Level`], the two kinds of
//! checkpoint.

use psls_pfs::jobs::FileRuns;
use psls_svm::FileId;
use serde::{Deserialize, Serialize};

/// Where a checkpoint keeps the pages it takes (DESIGN §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Level {
    /// Two recovery copies in two nodes' memories (the pages' home and mirror nodes); no disk
    /// is touched, and the commit is the coordinator's decision, with no record.
    Memory,
    /// The cleaner: the pages, and every recovery copy newer than the disks, written to both
    /// disk copies, then a commit record.
    Persistent,
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Level::Memory => "memory",
            Level::Persistent => "persistent",
        })
    }
}

/// Which level a job's safe points take (`psls run --level`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Choice {
    /// Memory checkpoints, and the cleaner when the persistent interval elapsed, on a halt, or
    /// when a memory checkpoint might not fit.
    #[default]
    Auto,
    /// Memory checkpoints only (the cleaner still when one would not fit, or on a halt).
    Memory,
    /// Persistent checkpoints only.
    Persistent,
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Choice::Auto => "auto",
            Choice::Memory => "memory",
            Choice::Persistent => "persistent",
        })
    }
}

impl std::str::FromStr for Choice {
    type Err = String;
    fn from_str(s: &str) -> Result<Choice, String> {
        match s {
            "" | "auto" => Ok(Choice::Auto),
            "memory" => Ok(Choice::Memory),
            "persistent" => Ok(Choice::Persistent),
            other => Err(format!(
                "checkpoint level '{other}': expected auto, memory or persistent"
            )),
        }
    }
}

/// A checkpoint message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Msg {
    /// Coordinator → participant: take every dirty page of `files` you hold and keep it at
    /// `level`: as pre-recovery copies in the memories of its two holders, or written to both
    /// disk copies at generation `gen`, durably, once your metadata has reached sequence `seq`
    /// (both 0 for a memory checkpoint). `committed` is the job's last committed epoch the
    /// coordinator knows (it settles an earlier epoch the participant still holds in doubt).
    Prepare {
        job: String,
        epoch: u64,
        level: Level,
        gen: u64,
        seq: u64,
        files: Vec<FileId>,
        committed: u64,
        /// The job's cleaning policy: what stays in memory after a cleaner.
        cleaning: crate::cleaning::Policy,
        /// The incarnation of the coordinator that started the round: with the epoch, it
        /// names the round (a restarted coordinator may start a memory epoch its predecessor
        /// started too; the answers and decisions of the two rounds must not mix).
        coord_inc: u64,
    },
    /// Participant → coordinator: the dirty pages of `epoch` (and the ranks' states) are
    /// taken here — copied out of the memfds, write-protected in the clients — and are now
    /// being kept at their level; `pages` of them. Once every participant said so, the job's
    /// ranks may go on (the checkpoint commits in the background).
    Taken {
        job: String,
        epoch: u64,
        coord_inc: u64,
        /// The participant's incarnation (a node that restarted since its ranks reached the
        /// safe point lost their pages: the round must not commit without them).
        part_inc: u64,
        pages: u64,
    },
    /// Coordinator → participant: every participant took its pages; keep yours now (held
    /// back until then, the transfers of the nodes that took first would slow down those
    /// that had not yet, and the ranks wait for the last one).
    Go { job: String, epoch: u64, coord_inc: u64 },
    /// Participant → coordinator: every page taken for `epoch` is kept at its level (for a
    /// persistent one: durable on both copies).
    Prepared {
        job: String,
        epoch: u64,
        level: Level,
        coord_inc: u64,
        part_inc: u64,
        written: Vec<FileRuns>,
        bytes: u64,
    },
    /// Coordinator → participant, in a persistent checkpoint once every participant
    /// prepared: write the job's recovery copies held here that are newer than the disks and
    /// were not overwritten by this checkpoint to this node's disk at `gen`, durably.
    Flush {
        job: String,
        epoch: u64,
        coord_inc: u64,
        gen: u64,
        seq: u64,
    },
    /// Participant → coordinator: the recovery copies are durable (the runs written here).
    Flushed {
        job: String,
        epoch: u64,
        coord_inc: u64,
        written: Vec<FileRuns>,
        bytes: u64,
    },
    /// Participant → coordinator: the pages could not be kept. `seen` is the highest epoch of
    /// the job seen here when the `Prepare` was not above it (0 otherwise); `no_room`: the
    /// memory level had no room for the recovery copies (the cleaner may take over).
    Refused {
        job: String,
        epoch: u64,
        coord_inc: u64,
        why: String,
        seen: u64,
        #[serde(default)]
        no_room: bool,
    },
    /// Coordinator → participant: the epoch committed (the pages taken are clean) or not
    /// (they are dirty again).
    Decide {
        job: String,
        epoch: u64,
        /// The round's coordinator incarnation (a fenced persistent epoch's outcome, told by
        /// any coordinator, is taken whatever it says: the record decides).
        coord_inc: u64,
        commit: bool,
    },
    /// Participant → a new coordinator: `epoch` was prepared here and never decided.
    InDoubt { job: String, epoch: u64 },
}

impl Msg {
    pub fn job(&self) -> &str {
        match self {
            Msg::Prepare { job, .. }
            | Msg::Taken { job, .. }
            | Msg::Go { job, .. }
            | Msg::Prepared { job, .. }
            | Msg::Flush { job, .. }
            | Msg::Flushed { job, .. }
            | Msg::Refused { job, .. }
            | Msg::Decide { job, .. }
            | Msg::InDoubt { job, .. } => job,
        }
    }
    pub fn epoch(&self) -> u64 {
        match self {
            Msg::Prepare { epoch, .. }
            | Msg::Taken { epoch, .. }
            | Msg::Go { epoch, .. }
            | Msg::Prepared { epoch, .. }
            | Msg::Flush { epoch, .. }
            | Msg::Flushed { epoch, .. }
            | Msg::Refused { epoch, .. }
            | Msg::Decide { epoch, .. }
            | Msg::InDoubt { epoch, .. } => *epoch,
        }
    }
}

/// Why a participant could not keep its pages (the shell's write failed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub why: String,
    /// No room for the memory level's recovery copies (`frames::FrameError::NoRoom`).
    pub no_room: bool,
}

impl Refusal {
    /// A write at `level` failed with an error of class `kind`: a memory write that found no
    /// room refuses with `no_room` (its round is followed by the cleaner).
    pub fn of(kind: psls_svm::ErrorKind, level: Level, why: String) -> Refusal {
        Refusal {
            no_room: kind == psls_svm::ErrorKind::NoSpace && level == Level::Memory,
            why,
        }
    }
}

impl From<String> for Refusal {
    fn from(why: String) -> Refusal {
        Refusal { why, no_room: false }
    }
}

impl From<&str> for Refusal {
    fn from(why: &str) -> Refusal {
        Refusal::from(why.to_string())
    }
}
