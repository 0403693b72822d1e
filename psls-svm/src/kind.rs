//! [`ErrorKind`]: the class of an error, shared by every crate so that a caller reacts to what
//! went wrong without reading its text (the machines decide on it; clients and peers receive it
//! on the wire, `psls_ipc::proto`).

use serde::{Deserialize, Serialize};

/// The class of an error. Its order is part of the wire format (postcard encodes the variant's
/// index): a new class goes last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    NotFound,
    Exists,
    Permission,
    Invalid,
    NoSpace,
    /// Something needed is not there now (a node down, a coordinator changing).
    Unavailable,
    Io,
    Internal,
}
