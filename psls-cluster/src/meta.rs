//! The records of the metadata replication before the metadata log ([`crate::log`]): a
//! one-slot Multi-Paxos whose voters kept a promised [`Epoch`], their committed state and the
//! operation they had [`Accepted`] for the next slot. Nothing replicates with them any more:
//! they remain only to read stores written before the metadata log (`psls_pfs::meta::MetaStore`
//! and its vote record, which `psls_pfs::logstore` converts once into the log's format).
//!
//! Invariant: [`Epoch`] and [`Accepted`] are serialized (postcard) in those stores; their fields
//! and field order stay as they were, or the old records no longer read.

use serde::{Deserialize, Serialize};
use std::fmt::{Debug, Display};

/// The state the old replication carried (`psls_pfs::meta::MetaState`): a sequence number and
/// a deterministic, validated transition. Only [`Replicated::seq`] and [`Replicated::Op`] still
/// matter, for [`Durable`]; `Error` and `apply` stay because `psls_pfs` implements them.
pub trait Replicated: Clone + Debug + PartialEq {
    type Op: Clone + Debug + PartialEq;
    type Error: Clone + Debug + Display;
    /// Sequence number of the last applied operation.
    fn seq(&self) -> u64;
    /// Applies `op` as operation `seq() + 1`; on error the state is unchanged.
    fn apply(&mut self, op: &Self::Op) -> Result<(), Self::Error>;
}

/// A coordinator's term in the old replication: ordered by `n`, then by the claiming voter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Epoch {
    pub n: u64,
    pub by: u32,
}

/// An operation a voter accepted for slot `seq` in `epoch` (committed or not).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Accepted<Op> {
    pub epoch: Epoch,
    pub seq: u64,
    pub op: Op,
}

/// What a voter of the old replication kept on disk.
#[derive(Clone, Debug, PartialEq)]
pub struct Durable<S: Replicated> {
    pub promised: Epoch,
    pub committed: S,
    pub accepted: Option<Accepted<S::Op>>,
}

impl<S: Replicated> Durable<S> {
    /// The same record with an accepted operation that the committed state already covers
    /// dropped (it was kept on disk until the next vote was written, and means nothing).
    pub fn normalized(mut self) -> Self {
        if self.accepted.as_ref().is_some_and(|a| a.seq <= self.committed.seq()) {
            self.accepted = None;
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log of numbers.
    #[derive(Clone, Debug, Default, PartialEq)]
    struct Log(Vec<u32>);

    impl Replicated for Log {
        type Op = u32;
        type Error = String;
        fn seq(&self) -> u64 {
            self.0.len() as u64
        }
        fn apply(&mut self, op: &u32) -> Result<(), String> {
            self.0.push(*op);
            Ok(())
        }
    }

    #[test]
    fn an_accepted_operation_the_committed_state_covers_is_dropped() {
        let accepted = |seq| Accepted {
            epoch: Epoch { n: 2, by: 1 },
            seq,
            op: 9,
        };
        let d = |seq| Durable {
            promised: Epoch { n: 3, by: 0 },
            committed: Log(vec![5, 6]),
            accepted: Some(accepted(seq)),
        };
        assert_eq!(d(2).normalized().accepted, None);
        assert_eq!(d(3).normalized().accepted, Some(accepted(3)));
    }

    /// The vote record's bytes, as stores before the log hold them: the shape must not change.
    #[test]
    fn a_vote_keeps_its_encoding() {
        let vote = (
            Epoch { n: 3, by: 1 },
            Some(Accepted {
                epoch: Epoch { n: 2, by: 0 },
                seq: 6,
                op: 5u32,
            }),
        );
        let bytes = postcard::to_stdvec(&vote).unwrap();
        assert_eq!(bytes, [3, 1, 1, 2, 0, 6, 5]);
        let back: (Epoch, Option<Accepted<u32>>) = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, vote);
    }
}
