//! `psls-ckpt`: checkpoints as deterministic state machines with no I/O, no clock, no threads
//! and no randomness (the shape of `psls-svm`, `psls-cluster` and `quinn-proto`). Time comes in
//! as `now_ms`, messages through `receive`, and what must happen comes out of `poll_action`
//! for the shell (`psls-node`) to carry out in order.
//!
//! - [`coordinator::Coordinator`]: the cluster coordinator's side of persistent (cleaner)
//!   checkpoints (DESIGN §7): prepare on every node, collect, write the commit record, decide,
//!   finish; abort on a refusal, a node going down or a timeout; and after a coordinator
//!   change, finish or abort the rounds nodes report in doubt — the commit record decides.
//! - [`participant::Participant`]: one node's side: write the job's dirty pages when asked
//!   (one write at a time per job), report, and mark them clean or dirty again on the decision.
//! - [`safepoint::SafePoints`]: the ranks' collective safe-point call, at the coordinator:
//!   once every rank of a job called, one decision for all (take a checkpoint, or nothing).
//! - [`level::Levels`]: the level of each checkpoint a job's safe points take (memory, or the
//!   cleaner: first, after the persistent interval, every N-th, on an operator's request, or
//!   when memory may not have room).
//! - [`pages::PageTable`]: page categories (active, readable recovery, pure recovery,
//!   pre-recovery; dirty, modified) of a job's copies across the nodes, frame counters per
//!   category, and whether a memory checkpoint fits.
//! - [`memory`]: the memory level's page transitions on a page table — copy-on-write of
//!   recovery copies, a memory checkpoint's two phases and abort, a cleaner checkpoint, the
//!   rollback after node failures — held to DESIGN §9 by a seeded model run
//!   (`tests/memory_sim.rs`).
//! - [`frames::FrameTable`]: a node's memory-checkpoint recovery copies (pre-recovery,
//!   committed, saved to the disks or not), and [`frames::rollback_target`], the memory level
//!   of a rollback.
//! - [`restore::Restore`]: the order of a job's restore in a rollback (states, fence, settle,
//!   re-create lost copies, drop the pages, serve them again), for the shell to carry out.
//! - [`cleaning::Policy`]: which copies stay in memory after a cleaner checkpoint (no
//!   cleaning, total, P1, P2, P3, LRU down to a threshold).
//! - [`msg::Msg`]: what they send each other. Every message names the job and the epoch; a
//!   message of another epoch than the one in progress, or from a node that is not the
//!   coordinator, is dropped.
//!
//! Invariants of the crate: nothing here reads a clock, touches a socket or a file, or spawns a
//! thread; every queue and table is bounded ([`MAX_ROUNDS`], [`MAX_IN_DOUBT`]); a participant
//! marks a checkpoint's pages clean only when the coordinator says it committed (a doubt is
//! resolved toward "dirty again", which costs a rewrite and never loses a write).

#![forbid(unsafe_code)]

pub mod cleaning;
pub mod coordinator;
pub mod frames;
pub mod level;
pub mod memory;
pub mod msg;
pub mod pages;
pub mod participant;
pub mod restore;
pub mod safepoint;

pub use coordinator::{CoordAction, Coordinator, Outcome, Progress, Step};
pub use msg::Msg;
pub use participant::{PartAction, Participant};
pub use safepoint::{Decision, SafeAction, SafePoints};

/// Rounds in progress at one coordinator, at most (one per job).
pub const MAX_ROUNDS: usize = 4096;

/// Epochs reported in doubt and not yet resolved, at most.
pub const MAX_IN_DOUBT: usize = 4096;
