//! `psls-ckpt`: the checkpoint coordinator and participant logic (DESIGN §7–§8) as a sans-IO
//! state machine. This issue only reserves the crate and the names it will own; the memory
//! and cleaner checkpoints, the cleaning policies and rollback planning land with the
//! checkpoint work.
//!
//! Invariant (to hold once implemented): no PFS write is requested outside a cleaner
//! checkpoint, and the previous checkpoint is never discarded before the next one commits.

/// Kind of checkpoint the coordinator decides on at a safe point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointKind {
    /// Two-phase checkpoint in the nodes' memories.
    Memory,
    /// Persistent checkpoint to the mirrored disks.
    Cleaner,
}
