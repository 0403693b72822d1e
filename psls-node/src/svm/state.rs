//! The shared-memory shell's state: segments (the node's memfd per mapped file), client
//! mappings and their fault threads, waiting faults, the lifelines, the adaptive prefetch, and
//! the coherence state machine behind the shell's one lock.

use psls_pfs::meta::FileMeta;
use psls_svm::coherence::{Envelope, Svm, TxnId, WaiterId};
use psls_svm::{FileId, NodeId, PageId, PAGE_SIZE};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use userfaultfd::{FaultKind, Uffd};
/// Actions run per lock hold, at most (a bound; the state machine produces far fewer).
pub(super) const MAX_STEPS: usize = 1 << 20;
/// Fault events read per `read` on a userfaultfd.
pub(super) const EVENT_BATCH: usize = 64;
/// How long a restarted node asks the others about a file before it refuses the file's pages
/// (`SvmShell::check_fence`), and how long it waits between two rounds.
pub(super) const FENCE_ASK_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);
pub(super) const FENCE_ASK_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);
/// Largest segment a client may map.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 40;

pub(super) const UFFDIO_CONTINUE_MODE_WP: u64 = 1 << 1;

/// Where a segment's pages come from when no memory holds them.
#[derive(Clone, Debug)]
pub enum Backing {
    /// A parallel file: its committed pages in the PFS.
    Pfs(FileMeta),
    /// A volatile segment: zeros until written. With a job, it is dropped when the job ends;
    /// a `psls run` job's segment is kept in its checkpoint area (`area`, a parallel file
    /// holding the segment's pages as of the job's last checkpoint, removed with the job).
    Volatile {
        job: Option<String>,
        area: Option<FileMeta>,
    },
}

impl Backing {
    /// The parallel file that holds this segment's checkpointed pages (none: always zeros).
    pub fn kept_in(&self) -> Option<&FileMeta> {
        match self {
            Backing::Pfs(f) | Backing::Volatile { area: Some(f), .. } => Some(f),
            Backing::Volatile { area: None, .. } => None,
        }
    }
}

pub(super) struct Segment {
    pub(super) name: String,
    pub(super) memfd: std::fs::File,
    pub(super) pages: u64,
    pub(super) backing: Backing,
    pub(super) maps: Vec<Arc<ClientMap>>,
    /// Pages whose copy here may differ from the disks, since a checkpoint last took them
    /// (one bit per page): set when this node gets write access (the page may come with
    /// another node's unsaved writes) and whenever a page is mapped writable in a client;
    /// cleared when the copy is dropped or a checkpoint takes it. So every page whose latest
    /// version is not on the disks has its bit set on a node holding that version.
    pub(super) dirty: Dirty,
    /// Pages a checkpoint took while this node held them writable and left writable (not
    /// write-protected), with the bytes it took: such a page may have been written since
    /// without its dirty bit set, and the next checkpoint compares it with these bytes. A page
    /// has an entry only while this node holds it with write access (an access change compares
    /// and drops it: `fault::apply`). Bounded over all segments by [`super::dirty::MAX_SHADOW_PAGES`].
    pub(super) shadows: HashMap<u64, Box<[u8]>>,
    /// The incarnation of every logical node the coherence state knew when the segment opened
    /// (a restarted manager asks whether it was opened before its restart: `fence_answer`).
    pub(super) known_at_open: Vec<psls_svm::Incarnation>,
}

/// A bit per page.
#[derive(Default)]
pub(super) struct Dirty(Vec<u64>);

impl Dirty {
    pub(super) fn new(pages: u64) -> Dirty {
        Dirty(vec![0; pages.div_ceil(64) as usize])
    }
    pub(super) fn set(&mut self, i: u64) {
        if let Some(w) = self.0.get_mut((i / 64) as usize) {
            *w |= 1 << (i % 64);
        }
    }
    pub(super) fn clear(&mut self, i: u64) {
        if let Some(w) = self.0.get_mut((i / 64) as usize) {
            *w &= !(1 << (i % 64));
        }
    }
    /// The pages set, in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter().enumerate().flat_map(|(k, &w)| {
            (0..64u64)
                .filter(move |b| w & (1 << b) != 0)
                .map(move |b| k as u64 * 64 + b)
        })
    }
    pub(super) fn is_set(&self, i: u64) -> bool {
        self.0.get((i / 64) as usize).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
    pub(super) fn count(&self) -> u64 {
        self.0.iter().map(|w| w.count_ones() as u64).sum()
    }
}

/// One client mapping: its userfaultfd and where the file is mapped in the client.
pub struct ClientMap {
    pub(super) id: u64,
    pub(super) pid: i32,
    pub(super) file: FileId,
    pub(super) base: usize,
    pub(super) len: usize,
    pub(super) writable: bool,
    pub(super) uffd: Uffd,
    /// Wakes the fault thread for shutdown.
    pub(super) stop: OwnedFd,
    /// Only the mapping's fault thread uses it.
    pub(super) prefetch: Mutex<Prefetch>,
}

/// Adaptive next-page prefetch of one client mapping. A fault that is not on the page last
/// prefetched asks for the next page too, while prefetching pays: a prefetched page that the
/// client then touches (its first access faults, locally) is a hit, one it skips is a miss.
/// After a miss prefetching stops, and is tried again every [`Prefetch::PROBE_EVERY`] faults.
/// This serves runs of pages (a vector spanning pages: the second page comes with the
/// first), and stays off for strided access, where the next page is often one that another
/// node is writing and fetching it would only downgrade that writer.
#[derive(Debug, Default)]
pub(super) struct Prefetch {
    /// The page last prefetched, until the client touches it or faults elsewhere.
    pub(super) outstanding: Option<u64>,
    /// Hits minus misses, clamped to [-1, 2]; prefetching is on while >= 0.
    pub(super) score: i8,
    /// Faults since prefetching went off.
    pub(super) idle_faults: u32,
}

impl Prefetch {
    pub(super) const PROBE_EVERY: u32 = 32;

    /// A fault on page `index`; returns the page to prefetch, if any (`last` is the
    /// mapping's last page).
    pub(super) fn on_fault(&mut self, index: u64, last: u64) -> Option<u64> {
        match self.outstanding.take() {
            Some(p) if p == index => {
                // A hit: this page was asked for already; the run may go on past it.
                self.score = (self.score + 1).min(2);
                return None;
            }
            Some(_) => self.score = (self.score - 1).max(-1),
            None => {}
        }
        let on = if self.score >= 0 {
            true
        } else {
            self.idle_faults += 1;
            self.idle_faults.is_multiple_of(Self::PROBE_EVERY)
        };
        if on && index < last {
            self.idle_faults = 0;
            self.outstanding = Some(index + 1);
            Some(index + 1)
        } else {
            None
        }
    }
}

impl ClientMap {
    pub(super) fn addr_of(&self, index: u64) -> usize {
        self.base + index as usize * PAGE_SIZE
    }
}

pub(super) struct Waiter {
    pub(super) map: Arc<ClientMap>,
    pub(super) addr: usize,
    pub(super) kind: FaultKind,
    /// When the fault came, and its kind for the metrics (`read`, `write`, `write_protect`).
    pub(super) since: std::time::Instant,
    pub(super) label: &'static str,
}

/// What coherence messages set off that must be done outside the shell's lock, gathered over
/// several messages ([`SvmShell::on_messages_deferred`]).
#[derive(Default)]
pub struct Deferred(pub(super) Vec<Outgoing>);

/// What must be done outside the lock.
pub(super) enum Outgoing {
    Send {
        to: NodeId,
        env: Envelope,
        payload: bytes::Bytes,
    },
    Load {
        page: PageId,
        txn: TxnId,
        backing: Backing,
    },
    Fatal {
        pid: i32,
        message: String,
    },
    /// Ask the other nodes whether this restarted node may serve `file` (`Action::CheckFence`).
    CheckFence {
        file: FileId,
    },
}

#[derive(Default)]
pub(super) struct Inner {
    pub(super) svm: Option<Svm>,
    pub(super) segs: HashMap<FileId, Segment>,
    pub(super) waiters: HashMap<WaiterId, Waiter>,
    pub(super) next_waiter: WaiterId,
    pub(super) next_map: u64,
    pub(super) self_msgs: VecDeque<Envelope>,
}

impl Segment {
    /// Punches every page out of the memfd (zapping them in every client) and clears the dirty
    /// bits. Fails closed: a page that cannot be dropped must not stay readable, so the daemon
    /// stops (its clients' lifelines tell them).
    pub(super) fn empty(&mut self, node: &str, file: FileId, why: &str) {
        let len = (self.pages * PAGE_SIZE as u64) as i64;
        let punch = nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
        if let Err(e) = nix::fcntl::fallocate(&self.memfd, punch, 0, len) {
            tracing::error!(node, %file, error = %e, "emptying a segment ({why}) failed; stopping");
            std::process::abort();
        }
        self.dirty = Dirty::new(self.pages);
        self.shadows.clear();
    }
}

impl Inner {
    /// The volatile segments of `job` held here.
    pub(super) fn job_segments(&self, job: &str) -> Vec<FileId> {
        self.segs
            .iter()
            .filter(|(_, s)| matches!(&s.backing, Backing::Volatile { job: Some(j), .. } if j == job))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Removes the faults waiting on `file`; returns each one's process, with `message`.
    pub(super) fn fail_waiters(&mut self, file: FileId, message: &str) -> Vec<(i32, String)> {
        let waiting: Vec<WaiterId> = self
            .waiters
            .iter()
            .filter(|(_, w)| w.map.file == file)
            .map(|(k, _)| *k)
            .collect();
        waiting
            .into_iter()
            .filter_map(|w| self.waiters.remove(&w))
            .map(|w| (w.map.pid, message.to_string()))
            .collect()
    }
}

/// Per client process, its lifelines (one per session), by id.
pub(super) type Lifelines = HashMap<i32, Vec<(u64, tokio::sync::mpsc::UnboundedSender<String>)>>;

/// The daemon's shared-virtual-memory state.
pub struct SvmShell {
    pub(super) inner: Mutex<Inner>,
    /// Per client process, its lifelines.
    pub(super) lifelines: Mutex<Lifelines>,
    pub(super) next_lifeline: std::sync::atomic::AtomicU64,
    pub(super) runtime: tokio::runtime::Handle,
    /// Per job, the pages of its files this node held when a rollback dropped them (what
    /// `psls run --prefetch` loads again before the ranks restart).
    pub(super) active: Mutex<HashMap<String, Vec<psls_svm::PageId>>>,
    /// Write-protect faults taken since start (a store to a page mapped read-only here: after
    /// a checkpoint, or a page this node may only read).
    pub(super) wp_faults: std::sync::atomic::AtomicU64,
    /// What each other node of the map answered last to `SvmHeld` (asked at start and while
    /// recovering; a node that did not answer has no entry), and for which shared-memory
    /// incarnation of this node it was asked (a spare that took a logical id over since is
    /// another one: the answers are not about it).
    pub(super) held: Mutex<PeersHeld>,
    /// An ask of every node is under way.
    pub(super) asking: std::sync::atomic::AtomicBool,
}

/// The other nodes' answers to `SvmHeld`, asked for one shared-memory incarnation of this node.
#[derive(Debug, Default)]
pub struct PeersHeld {
    pub asked_for: Option<psls_svm::Incarnation>,
    pub answers: std::collections::BTreeMap<String, PeerHeld>,
}

/// A node's answer to `SvmHeld`.
#[derive(Clone, Copy, Debug, Default)]
pub struct PeerHeld {
    pub segments: u64,
    pub knew: u64,
    pub fenced: u64,
}

pub(super) fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// `UFFDIO_CONTINUE` on one page, write-protected if `wp` (the `userfaultfd` crate has no
/// write-protect mode for it).
pub fn continue_page(uffd: &Uffd, addr: usize, wp: bool) -> std::io::Result<()> {
    #[repr(C)]
    struct UffdioContinue {
        start: u64,
        len: u64,
        mode: u64,
        mapped: i64,
    }
    let mut c = UffdioContinue {
        start: addr as u64,
        len: PAGE_SIZE as u64,
        mode: if wp { UFFDIO_CONTINUE_MODE_WP } else { 0 },
        mapped: 0,
    };
    // SAFETY: UFFDIO_CONTINUE reads and writes only the struct passed, which lives across the
    // call and has the kernel's layout (struct uffdio_continue: range, mode, mapped).
    let r = unsafe { libc::ioctl(uffd.as_raw_fd(), userfaultfd_sys::UFFDIO_CONTINUE as _, &mut c) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}
