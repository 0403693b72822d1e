//! `psls-svm`: identifiers shared by every PSLS crate (node, file, page, incarnation, epoch)
//! and, in later work, the sans-IO coherence protocol and per-node page table.
//!
//! Invariant: nothing in this crate performs I/O, reads a clock or spawns threads.

pub mod ids;
pub mod rng;

pub use ids::{Epoch, FileId, Incarnation, NodeId, PageId, PAGE_SIZE};
