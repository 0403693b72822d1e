//! Plain identifier types. They are small `Copy` values with a stable serialized form,
//! because they travel in peer messages and live in on-disk records.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Size of one coherence / storage unit in bytes.
pub const PAGE_SIZE: usize = 4096;

/// Logical node id `0..N`. A spare that replaces a lost node takes over its logical id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node{}", self.0)
    }
}

/// Cluster-wide unique id of a parallel file or volatile segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct FileId(pub u64);

impl fmt::Display for FileId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// One 4 KB page of one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PageId {
    pub file: FileId,
    pub index: u64,
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.index)
    }
}

/// Incremented every time a node daemon starts; messages from an older incarnation are stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Incarnation(pub u64);

/// Cluster epoch: bumped when membership (the logical → physical map) changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Epoch(pub u64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_forms_are_stable() {
        assert_eq!(NodeId(3).to_string(), "node3");
        assert_eq!(FileId(0xab).to_string(), "00000000000000ab");
        let p = PageId {
            file: FileId(1),
            index: 7,
        };
        assert_eq!(p.to_string(), "0000000000000001:7");
    }
}
