//! Job control as one deterministic machine, with no I/O and no clock (the shape of
//! quinn-proto's `Connection`): [`Control`] takes `handle_*` inputs — the committed metadata,
//! the cluster as heartbeats show it, the nodes' reports of their ranks, operator commands,
//! the outcomes of the steps it asked for, time — and hands out [`Action`]s through
//! [`Control::poll_action`]: record a decision in the metadata log, start or stop ranks, roll a
//! job back, take its last checkpoints, answer a command.
//!
//! Every node runs one; only the metadata log's leader (with its lease) drives, every job at
//! once. A job's durable state is its [`psls_pfs::runs::RunRecord`] in the metadata log; the
//! machine decides from it (level-triggered), so a new leader takes over every job the old one
//! drove and finishes whatever was in flight, every step being idempotent.
//! The rank nodes' side is in [`local`]: which ranks a node may run, given the same records.
//! Output: [`output`] numbers and keeps the ranks' lines; [`follow::Follower`] tells a client
//! following a job its notes, each line once and in order, and its end.

#![forbid(unsafe_code)]

pub mod control;
pub mod follow;
pub mod local;
pub mod output;
pub mod place;

pub use control::{Action, Answer, Command, CommandError, Config, Control, Done, NodeView, Report, StepError};
