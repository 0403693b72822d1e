//! The shared-virtual-memory shell (DESIGN §4): drives the coherence state machine
//! ([`psls_svm::coherence::Svm`]) with real page faults, peer messages and PFS loads.
//!
//! Owns, per mapped file on this node, one memfd (the node's memory copy of the file's pages,
//! shared by every local client mapping) and the clients' userfaultfds. Each registered
//! userfaultfd has its own OS thread (the fault path stays off the tokio runtime); peer
//! messages come in on the link thread, PFS loads from async tasks (pages known to be zeros
//! are installed in place, without one). All of them take one lock, feed the state
//! machine and execute its actions in order:
//! - `SetAccess(None)` punches the page out of the memfd (zapping it in every client),
//!   `SetAccess(Read)` write-protects it in every client mapping;
//! - `Resolve` maps the page in the faulting client with `UFFDIO_CONTINUE` (write-protected
//!   unless this node may write) or lifts the write protection;
//! - `Send` snapshots the page (for `Data`) before anything after it runs.
//!
//! It also keeps, per segment, which pages clients here may have written since a checkpoint
//! last took them (`dirty`: set when a page is mapped writable in a client, cleared when the
//! copy goes or a checkpoint takes it).
//!
//! Invariants: the daemon never maps the memfds (it reads and writes them with pread/pwrite,
//! so it cannot create pages by touching them); a page is mapped writable in a client only
//! while this node holds write access; a fault that cannot be served leaves the client blocked
//! and tells its lifeline, never maps anything.

mod dirty;
mod fault;
mod rollback;
mod shell;
mod state;

pub use dirty::Taken;
pub use fault::svm_incarnation;
pub use state::{continue_page, Backing, ClientMap, Deferred, SvmShell, MAX_SEGMENT_BYTES};

#[cfg(test)]
mod tests {
    use super::state::Prefetch;

    #[test]
    fn runs_are_prefetched_strides_are_not() {
        let mut p = Prefetch::default();
        // Two-page vectors read one after the other: every second page comes with the first.
        for v in 0..10u64 {
            assert_eq!(p.on_fault(2 * v, 100), Some(2 * v + 1), "vector {v}");
            assert_eq!(p.on_fault(2 * v + 1, 100), None, "the prefetched page is a hit");
        }
        // A stride of two: one miss turns prefetching off; it is probed now and then.
        let mut p = Prefetch::default();
        assert_eq!(p.on_fault(0, 1000), Some(1));
        let issued = (1..=200u64).filter(|i| p.on_fault(2 * i, 1000).is_some()).count();
        assert!(
            issued <= 200 / Prefetch::PROBE_EVERY as usize + 1,
            "{issued} prefetches"
        );
        // The last page has no next page.
        assert_eq!(Prefetch::default().on_fault(7, 7), None);
    }
}
