//! `psls-node`: the daemon run on every cluster node. It is the I/O shell around the PSLS
//! protocol and storage crates: QUIC with mutual TLS between nodes ([`transport`] for requests, [`link`] for one-way
//! messages, [`tls`]),
//! the Unix socket for local clients ([`ipc_server`]), heartbeats (the failure detector of `psls-cluster`), the
//! mirrored parallel file system across nodes ([`pfs`]), the shared virtual memory fault
//! service ([`svm`]), barriers and locks ([`sync`]), jobs of ranks ([`launcher`]), and the node state that ties them together ([`node`]).

pub mod daemon;
pub mod failstop;
pub mod ipc_server;
pub mod launcher;
pub mod link;
pub mod node;
pub mod peer;
pub mod pfs;
pub mod replication;
pub mod svm;
pub mod sync;
pub mod sync_channel;
pub mod tls;
pub mod transport;
