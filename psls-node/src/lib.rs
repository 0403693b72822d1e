//! `psls-node`: the daemon run on every cluster node, the I/O shell around the PSLS protocol
//! and storage crates. Its modules by layer, each importing only from the layers below it
//! (no import circle, no import that runs back up):
//! - wire and plumbing: [`peer`] (messages), [`op`] (errors), [`failstop`], [`failpoint`],
//!   [`incarnation`], [`tls`], [`transport`] (requests), [`link`] (one-way messages),
//!   [`metrics`] (what a node counts);
//! - the core: [`node`] (identity, store, metadata, membership, peer calls), and
//!   [`replication`] (the door to the metadata log, held by the node);
//! - subsystems: [`log_task`] (the metadata log's task), [`pfs`] (the mirrored file system
//!   across nodes), [`sync`] and [`sync_channel`] (barriers and locks), [`svm`] (shared
//!   virtual memory), [`frames`] and [`ckpt`] (checkpoints), [`launcher`] (rank processes),
//!   [`recovery`] (a job's restore) and [`jobctl`] (job control's task, through its narrow
//!   `jobctl::Shell`);
//! - the top: [`dispatch`] (the daemon assembled, and what peers send routed to its
//!   subsystem), [`ipc`] (local clients), [`exporter`] (the metrics endpoint), [`daemon`]
//!   (start-up).
//!
//! Lock order: `Node::watching` is taken before `Node::verdicts` (failure detection's duties
//! hold both).
//! The daemon's other locks have no written order yet.

pub mod ckpt;
pub mod daemon;
pub mod dispatch;
pub mod exporter;
pub mod failpoint;
pub mod failstop;
pub mod frames;
pub mod incarnation;
pub mod ipc;
pub mod jobctl;
pub mod launcher;
pub mod link;
pub mod log_task;
pub mod metrics;
pub mod node;
pub mod op;
pub mod peer;
pub mod pfs;
pub mod recovery;
pub mod replication;
pub mod svm;
pub mod sync;
pub mod sync_channel;
pub mod tls;
pub mod transport;
