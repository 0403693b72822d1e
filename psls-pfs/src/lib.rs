//! `psls-pfs`: the mirrored on-disk page store of one node, page placement, and the
//! namespace metadata store.
//!
//! What this crate owns:
//! - [`buf::PageBuf`]: page-aligned buffers, so page runs can use direct I/O.
//! - [`disk`]: the `Disk`/`DiskFile` storage contract, the real implementation, and
//!   [`fault::FaultDisk`], which keeps every write that was not fsync'd in memory so that a
//!   crash of the process (or [`fault::FaultDisk::power_cut`]) loses exactly those writes.
//! - [`slot`]: the little-endian, versioned, checksummed on-disk slot header.
//! - [`store::PageStore`]: two slots per page (current + shadow) selected by generation.
//! - [`placement`]: home and mirror node of every page.
//! - [`meta`]: the replicated namespace (names, sizes, owners, commit records, logical map)
//!   persisted in redb through the same `Disk` contract; [`gens`]: each page's committed
//!   generation; [`jobs`]: the jobs' checkpoint commit records.
//!
//! The crate does no networking; the node daemon decides which node's store a page goes to.

pub mod buf;
pub mod disk;
pub mod error;
pub mod fault;
pub mod file;
pub mod gens;
pub mod jobs;
pub mod logstore;
pub mod meta;
pub mod placement;
pub mod runs;
pub mod slot;
pub mod store;
pub mod wal;

pub use buf::{BufPool, PageBuf, PooledBuf};
pub use disk::{Disk, DiskFile, FileDisk};
pub use error::{MetaError, StoreError};
pub use fault::FaultDisk;
pub use placement::{Placement, Role};
pub use store::{PageRef, PageStore, ReadOutcome, ReadStatus};
