//! Error types of the page store and of the metadata store.

use psls_svm::FileId;
use std::io;

/// Errors of [`crate::PageStore`] operations.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("disk I/O error on {what}: {err}")]
    Io { what: String, err: io::Error },
    /// An fsync failed earlier: the store can no longer tell what is durable and refuses
    /// every further operation until the daemon restarts (see redb / PostgreSQL fsyncgate).
    #[error("page store is poisoned after a failed fsync; restart the node")]
    Poisoned,
    #[error("page data must be exactly 4096 bytes, got {0}")]
    BadPageLength(usize),
    #[error("file {0} has no local data")]
    NoSuchFile(FileId),
    #[error("page position {0} is beyond the largest file the store holds")]
    BadPageIndex(u64),
    #[error("page {file}:{index} is stored in page slot format {found}; this build reads formats up to {supported} (a newer build wrote it)")]
    NewerFormat {
        file: FileId,
        index: u64,
        found: u16,
        supported: u16,
    },
    #[error("page {file}:{index} holds generation {found}: a write of older generation {gen} is refused")]
    Newer {
        file: FileId,
        index: u64,
        found: u64,
        gen: u64,
    },
}

impl StoreError {
    pub fn io(what: impl Into<String>, source: io::Error) -> Self {
        StoreError::Io {
            what: what.into(),
            err: source,
        }
    }
}

/// Errors of [`crate::meta::MetaStore`] and of applying metadata operations.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    #[error("metadata database error: {0}")]
    Db(String),
    #[error("metadata record is corrupt: {0}")]
    Corrupt(String),
    #[error("file '{0}' already exists")]
    Exists(String),
    #[error("no file named '{0}'")]
    NotFound(String),
    #[error("file '{name}' changed while it was being replaced (expected id {expected}, found {found})")]
    Conflict {
        name: String,
        expected: FileId,
        found: FileId,
    },
    #[error("invalid metadata operation: {0}")]
    Invalid(String),
    #[error("'{name}' is mapped writable by job {job}: one job writes a file at a time (map it read-only, or wait for that job to end)")]
    WriterBusy { name: String, job: String },
}

macro_rules! db_err {
    ($($t:ty),*) => {$(
        impl From<$t> for MetaError {
            fn from(e: $t) -> Self { MetaError::Db(e.to_string()) }
        }
    )*};
}
db_err!(
    redb::Error,
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);
