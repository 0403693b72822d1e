//! Messages between node daemons. One request and one response per QUIC bidirectional stream;
//! each body is postcard, bounded by [`MAX_PEER_MSG`].

use psls_pfs::meta::MetaOp;
use psls_pfs::Role;
use psls_svm::FileId;
use serde::{Deserialize, Serialize};

/// Largest accepted peer message body.
pub const MAX_PEER_MSG: usize = 8 * 1024 * 1024;
/// Pages per write/read batch (1 MiB of data).
pub const BATCH_PAGES: usize = 256;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Heartbeat {
    pub incarnation: u64,
    pub pid: u32,
    pub meta_seq: u64,
    pub memory_used_bytes: u64,
    pub memory_capacity_bytes: u64,
    pub disk_used_bytes: u64,
    pub disk_free_bytes: u64,
    pub rebuild: Option<(u64, u64)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PageData {
    pub index: u64,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum PageRead {
    Ok(#[serde(with = "serde_bytes")] Vec<u8>),
    Missing,
    Stale(u64),
    Corrupt,
    Error(String),
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct BadCopy {
    pub file: FileId,
    pub role: Role,
    pub index: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PeerReq {
    Heartbeat(Heartbeat),
    WritePages {
        file: FileId,
        role: Role,
        gen: u64,
        keep_gen: u64,
        pages: Vec<PageData>,
    },
    Sync,
    ReadPages {
        file: FileId,
        role: Role,
        gen: u64,
        indices: Vec<u64>,
    },
    RemoveFile {
        file: FileId,
    },
    /// Check every local copy of these (file, pages, gen).
    ScrubLocal {
        files: Vec<(FileId, u64, u64)>,
    },
    MetaSubmit {
        op: MetaOp,
    },
    MetaApply {
        seq: u64,
        op: MetaOp,
    },
    MetaFetch,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PeerResp {
    Ok,
    HeartbeatAck(Heartbeat),
    Pages(Vec<PageRead>),
    Scrub { checked: u64, bad: Vec<BadCopy> },
    Snapshot(Vec<u8>),
    NotCoordinator,
    Error { kind: psls_ipc::ErrorKind, message: String },
}

pub fn encode<T: Serialize>(m: &T) -> Vec<u8> {
    postcard::to_stdvec(m).expect("peer message serializes")
}

pub fn decode<T: for<'de> Deserialize<'de>>(b: &[u8]) -> Result<T, String> {
    postcard::from_bytes(b).map_err(|e| e.to_string())
}
