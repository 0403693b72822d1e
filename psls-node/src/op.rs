//! The error every daemon operation reports to a client or a peer (a class and one line of
//! text), and the helper that runs blocking work off the async workers. At the bottom of the
//! daemon: imports nothing of it but the wire types.

use crate::peer::{NetError, PeerResp};
use psls_ipc::ErrorKind;
use psls_pfs::MetaError;

/// An error to report to a client or peer: a class and one line of text.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{message}")]
pub struct OpError {
    pub kind: ErrorKind,
    pub message: String,
}

impl OpError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        OpError {
            kind,
            message: message.into(),
        }
    }
}

impl From<MetaError> for OpError {
    fn from(e: MetaError) -> Self {
        let kind = match &e {
            MetaError::Exists(_) | MetaError::WriterBusy { .. } => ErrorKind::Exists,
            MetaError::NotFound(_) => ErrorKind::NotFound,
            MetaError::Conflict { .. } | MetaError::Invalid(_) => ErrorKind::Invalid,
            MetaError::Db(_) | MetaError::Corrupt(_) => ErrorKind::Io,
        };
        OpError::new(kind, e.to_string())
    }
}

impl From<NetError> for OpError {
    fn from(e: NetError) -> Self {
        OpError::new(ErrorKind::Unavailable, e.to_string())
    }
}

impl From<psls_pfs::StoreError> for OpError {
    fn from(e: psls_pfs::StoreError) -> Self {
        OpError::new(ErrorKind::Io, e.to_string())
    }
}

pub fn peer_error(e: OpError) -> PeerResp {
    PeerResp::Error {
        kind: e.kind,
        message: e.message,
    }
}

/// Runs blocking work on the blocking pool.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, OpError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| OpError::new(ErrorKind::Internal, format!("worker failed: {e}")))
}
