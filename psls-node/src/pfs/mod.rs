//! The mirrored parallel file system across nodes: import, export, create, remove, scrub,
//! node replacement and the rebuild of a replaced node's copies.
//!
//! Write protocol (import, create): pages of a new file id are written to the shadow slots on
//! the home and the mirror node, every node is fsync'd, and only then is the commit record
//! (`MetaOp::CommitFile`) ordered by the coordinator. A crash before the commit leaves the old
//! name binding (old contents or no file); after it, the new. Replacing a file writes a new id,
//! so readers of the old contents are never disturbed.
//!
//! Checkpoints (`crate::ckpt`) write pages of existing files through the same page writes
//! (`write_to_phys` with a new generation, `sync_on`); their commit record sets the pages'
//! generations ([`psls_pfs::gens`]), and reads ask for each page's own generation.
//!
//! Read protocol: from a copy on the reading node if it holds one, else from the primary; on
//! a missing, stale, corrupt or unreachable copy, from the other one, and the bad copy is then
//! repaired in place from the good one.

mod files;
mod read;
mod repair;

pub use files::{
    check_all_serving, create, info, list, lookup_file, lookup_or_create, now_ms as unix_ms, remove, stat, sync_on,
    write_to_phys, Caller, Importer,
};
pub use read::{export_stream, read_page, ExportChunks, Pages};
pub use repair::{maybe_rebuild, rebuild, rejoin_blank, replace, scrub};
