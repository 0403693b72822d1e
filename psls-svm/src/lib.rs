//! `psls-svm`: identifiers shared by every PSLS crate (node, file, page, incarnation, epoch),
//! the class of an error ([`ErrorKind`]),
//! page placement's home function, and the sans-IO coherence protocol ([`coherence`]): the
//! per-node page table and directory as a deterministic state machine, tested by a seeded
//! simulator (`tests/sim.rs`).
//!
//! Invariant: nothing in this crate performs I/O, reads a clock or spawns threads.

pub mod coherence;
pub mod ids;
pub mod kind;
pub mod rng;

pub use ids::{Epoch, FileId, Incarnation, NodeId, PageId, PAGE_SIZE};
pub use kind::ErrorKind;
