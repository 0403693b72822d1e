//! `psls-ipc`: what the daemon, the admin CLI and client processes must agree on:
//! the cluster configuration file ([`config`]), the cluster's certificates ([`certs`]) and the
//! client ↔ daemon protocol over the node's Unix socket ([`proto`]).
//!
//! Invariants: every frame read is bounded by [`proto::MAX_FRAME`]; a config with an unknown
//! key, a duplicate name or address, or fewer than two nodes is rejected with one message.

pub mod certs;
pub mod config;
pub mod proto;

pub use config::{ClusterConfig, ConfigError, NodeEntry};
pub use proto::{ErrorKind, Request, Response};
