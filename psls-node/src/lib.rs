//! `psls-node`: the daemon run on every cluster node, the I/O shell around the PSLS protocol
//! and storage crates. Its modules by role:
//! - wire and plumbing: [`peer`] (messages), [`op`] (errors), [`failstop`], [`failpoint`],
//!   [`incarnation`], [`tls`], [`transport`] (requests), [`link`] (one-way messages);
//! - the core: [`node`] (identity, store, metadata, membership, peer calls) and
//!   [`replication`] (the shell of `psls_cluster::log`);
//! - subsystems: [`pfs`] (the mirrored file system across nodes), [`svm`] (shared virtual
//!   memory), [`frames`] and [`ckpt`] (checkpoints), [`sync`] and [`sync_channel`] (barriers
//!   and locks), [`launcher`], [`jobctl`] and [`recovery`] (jobs);
//! - the top: [`dispatch`] (the daemon assembled, and what peers send routed to its
//!   subsystem), [`ipc`] (local clients), [`metrics`], [`daemon`] (start-up).
//!
//! These roles are not yet layers: `dispatch`, `ipc`, `jobctl`, `launcher`, `metrics`, `node`,
//! `recovery`, `replication`, `sync` and `sync_channel` import one another in a circle, and
//! some of them reach up to the assembled daemon (issue 41 removes that).

pub mod ckpt;
pub mod daemon;
pub mod dispatch;
pub mod failpoint;
pub mod failstop;
pub mod frames;
pub mod incarnation;
pub mod ipc;
pub mod jobctl;
pub mod launcher;
pub mod link;
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
