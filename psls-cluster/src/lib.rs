//! `psls-cluster`: the cluster's control protocols as deterministic state machines with no I/O,
//! no clock, no threads and no randomness (the shape of `psls-svm` and of `quinn-proto`).
//! Time comes in as an argument in milliseconds (`now_ms`), messages come in through
//! `receive`, and what must happen comes out as actions the shell (`psls-node`) carries out in
//! order: sends, durable writes, answers to waiting callers.
//!
//! - [`log`]: the metadata log (raft-rs's consensus with pre-vote and check-quorum, group
//!   commit, read index, log compaction and snapshots, a few voters changed by joint
//!   consensus, followers pulling the committed entries) and the state it applies.
//! - [`membership`]: the failure detector over heartbeats (up, suspect, down) and the lease.
//! - [`meta`]: the vote records of the replication before the log (a one-slot Multi-Paxos),
//!   kept only to read stores written before the metadata log.
//! - [`sync`]: named barriers and locks at the coordinator, and each node's table of ranks
//!   waiting for their answers.
//! - [`verdicts`]: which peers the coordinator declares down, which senders every node drops,
//!   when a node fences itself, and who coordinates (the metadata's leader holding its lease).
//! - [`voters`]: which few nodes are the metadata log's voters, and who replaces one lost for
//!   good.
//! - [`watch`]: who heartbeats whom (a bounded, symmetric set per node) and when the silences
//!   nodes report to the metadata leader become a verdict it proposes.
//! - [`write`]: the two-phase write of page copies before a commit record (imports, repairs,
//!   rebuilds).
//!
//! Seeded simulators drive them (`tests/log_sim.rs`: the metadata log with crashes, pauses,
//! partitions, lost disks and snapshot installs; `tests/verdict_sim.rs`: the failure detector,
//! its lease, and the verdicts and fencing it leads to; `tests/sync_sim.rs`: barriers and
//! locks; `tests/pfs_sim.rs`: imports, disk losses and re-mirroring; `tests/watch_sim.rs`:
//! bounded heartbeats, reports and the leader's tally at 16 to 1,024 nodes): they crash and restart
//! nodes, delay and reorder messages and drop them on dead links, and check the invariants
//! after every step.
//!
//! Invariant of the crate: nothing here reads a clock, touches a socket or a file, or spawns
//! a thread; every queue is bounded.

#![forbid(unsafe_code)]

pub mod log;
pub mod membership;
pub mod meta;
pub mod sync;
pub mod verdicts;
pub mod voters;
pub mod watch;
pub mod write;
