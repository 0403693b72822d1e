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
//! Invariants: the daemon never maps the memfds (it reads and writes them with pread/pwrite,
//! so it cannot create pages by touching them); a page is mapped writable in a client only
//! while this node holds write access; a fault that cannot be served leaves the client blocked
//! and tells its lifeline, never maps anything.

use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
use crate::peer::PeerReq;
use psls_ipc::ErrorKind;
use psls_pfs::meta::FileMeta;
use psls_svm::coherence::{Access, Action, Envelope, Receipt, Svm, TxnId, WaiterId};
use psls_svm::{FileId, Incarnation, NodeId, PageId, PAGE_SIZE};
use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use userfaultfd::{Event, FaultKind, ReadWrite, Uffd};

/// Actions run per lock hold, at most (a bound; the state machine produces far fewer).
const MAX_STEPS: usize = 1 << 20;
/// Fault events read per `read` on a userfaultfd.
const EVENT_BATCH: usize = 64;
/// Largest segment a client may map.
pub const MAX_SEGMENT_BYTES: u64 = 1 << 40;

const UFFDIO_CONTINUE_MODE_WP: u64 = 1 << 1;

/// Where a segment's pages come from when no memory holds them.
#[derive(Clone, Debug)]
pub enum Backing {
    /// A parallel file: its committed pages in the PFS.
    Pfs(FileMeta),
    /// A volatile segment: zeros. With a job, it is dropped when the job ends.
    Volatile { job: Option<String> },
}

struct Segment {
    name: String,
    memfd: std::fs::File,
    pages: u64,
    backing: Backing,
    maps: Vec<Arc<ClientMap>>,
}

/// One client mapping: its userfaultfd and where the file is mapped in the client.
pub struct ClientMap {
    id: u64,
    pid: i32,
    file: FileId,
    base: usize,
    len: usize,
    writable: bool,
    uffd: Uffd,
    /// Wakes the fault thread for shutdown.
    stop: OwnedFd,
    /// Only the mapping's fault thread uses it.
    prefetch: Mutex<Prefetch>,
}

/// Adaptive next-page prefetch of one client mapping. A fault that is not on the page last
/// prefetched asks for the next page too, while prefetching pays: a prefetched page that the
/// client then touches (its first access faults, locally) is a hit, one it skips is a miss.
/// After a miss prefetching stops, and is tried again every [`Prefetch::PROBE_EVERY`] faults.
/// This serves runs of pages (a vector spanning pages: the second page comes with the
/// first), and stays off for strided access, where the next page is often one that another
/// node is writing and fetching it would only downgrade that writer.
#[derive(Debug, Default)]
struct Prefetch {
    /// The page last prefetched, until the client touches it or faults elsewhere.
    outstanding: Option<u64>,
    /// Hits minus misses, clamped to [-1, 2]; prefetching is on while >= 0.
    score: i8,
    /// Faults since prefetching went off.
    idle_faults: u32,
}

impl Prefetch {
    const PROBE_EVERY: u32 = 32;

    /// A fault on page `index`; returns the page to prefetch, if any (`last` is the
    /// mapping's last page).
    fn on_fault(&mut self, index: u64, last: u64) -> Option<u64> {
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
    fn addr_of(&self, index: u64) -> usize {
        self.base + index as usize * PAGE_SIZE
    }
}

struct Waiter {
    map: Arc<ClientMap>,
    addr: usize,
    kind: FaultKind,
}

/// What must be done outside the lock.
enum Outgoing {
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
}

#[derive(Default)]
struct Inner {
    svm: Option<Svm>,
    segs: HashMap<FileId, Segment>,
    waiters: HashMap<WaiterId, Waiter>,
    next_waiter: WaiterId,
    next_map: u64,
    self_msgs: VecDeque<Envelope>,
}

/// Per client process, its lifelines (one per session), by id.
type Lifelines = HashMap<i32, Vec<(u64, tokio::sync::mpsc::UnboundedSender<String>)>>;

/// The daemon's shared-virtual-memory state.
pub struct SvmShell {
    inner: Mutex<Inner>,
    /// Per client process, its lifelines.
    lifelines: Mutex<Lifelines>,
    next_lifeline: std::sync::atomic::AtomicU64,
    runtime: tokio::runtime::Handle,
}

fn errno_of(e: &std::io::Error) -> i32 {
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

impl SvmShell {
    pub fn new(runtime: tokio::runtime::Handle) -> SvmShell {
        SvmShell {
            inner: Mutex::new(Inner::default()),
            lifelines: Mutex::new(HashMap::new()),
            next_lifeline: std::sync::atomic::AtomicU64::new(0),
            runtime,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// Job `job` ended: its volatile segments go — the node's memory of them, their coherence
    /// state here, and any mapping of them that outlived the job (such a process keeps a
    /// private, no longer coherent view). Returns the segments' ids, for the nodes that manage
    /// their pages without holding them ([`SvmShell::forget`]).
    pub fn end_job(&self, node: &Node, job: &str) -> Vec<FileId> {
        let mut g = self.lock();
        let ids: Vec<FileId> = g
            .segs
            .iter()
            .filter(|(_, s)| matches!(&s.backing, Backing::Volatile { job: Some(j) } if j == job))
            .map(|(id, _)| *id)
            .collect();
        let mut ended: Vec<(i32, String)> = Vec::new();
        for id in &ids {
            if let Some(seg) = g.segs.remove(id) {
                // A process that outlives its job loses the job's segments: their pages are
                // punched out of the memfd (no stale, incoherent view stays mapped), and its
                // fault thread keeps running to end it, with a message, at its next fault on
                // them (or now, if it waits in one).
                let len = (seg.pages * PAGE_SIZE as u64) as i64;
                let punch =
                    nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
                if let Err(e) = nix::fcntl::fallocate(&seg.memfd, punch, 0, len) {
                    tracing::error!(node = %node.name(), file = %id, error = %e, "emptying an ended job's segment failed; stopping");
                    std::process::abort();
                }
                let message = format!("job {job} ended: its volatile segment '{}' is gone", seg.name);
                let waiting: Vec<WaiterId> = g
                    .waiters
                    .iter()
                    .filter(|(_, w)| w.map.file == *id)
                    .map(|(k, _)| *k)
                    .collect();
                for w in waiting {
                    if let Some(w) = g.waiters.remove(&w) {
                        ended.push((w.map.pid, message.clone()));
                    }
                }
                tracing::info!(node = %node.name(), file = %id, name = %seg.name, job, clients = seg.maps.len(), "volatile segment dropped at job end");
            }
            if let Some(svm) = g.svm.as_mut() {
                svm.forget_file(*id);
            }
        }
        drop(g);
        for (pid, message) in ended {
            self.end_client(node, pid, message);
        }
        ids
    }

    /// Client mappings of `file` served here.
    pub fn mappings(&self, file: FileId) -> u64 {
        self.lock().segs.get(&file).map_or(0, |s| s.maps.len() as u64)
    }

    /// A removed parallel file that no client maps anywhere any more: its memory here and its
    /// coherence state go (a mapping made since the count keeps both here).
    pub fn drop_removed(&self, node: &Node, file: FileId) {
        let mut g = self.lock();
        if g.segs.get(&file).is_some_and(|s| !s.maps.is_empty()) {
            tracing::warn!(node = %node.name(), %file, "a removed file was mapped again meanwhile: kept");
            return;
        }
        if let Some(seg) = g.segs.remove(&file) {
            tracing::info!(node = %node.name(), %file, name = %seg.name, pages = seg.pages, "segment of a removed file dropped");
        }
        let forgotten = g.svm.as_mut().map_or(0, |s| s.forget_file(file));
        tracing::debug!(node = %node.name(), %file, forgotten, "coherence state of a removed file forgotten");
    }

    /// Tells client process `pid` (through its lifeline) that a fault failed and it must end,
    /// and why.
    fn end_client(&self, node: &Node, pid: i32, message: String) {
        tracing::error!(node = %node.name(), pid, %message, "client fault failed");
        if let Some(lines) = self.lifelines.locked().get(&pid) {
            for (_, tx) in lines {
                let _ = tx.send(message.clone());
            }
        }
    }

    /// Forgets the coherence state of volatile segments of an ended job (a segment still
    /// held here is left alone). Returns how many page entries went.
    pub fn forget(&self, files: &[FileId]) -> usize {
        let mut g = self.lock();
        let mut n = 0;
        for f in files {
            if g.segs.contains_key(f) {
                continue;
            }
            n += g.svm.as_mut().map_or(0, |s| s.forget_file(*f));
        }
        n
    }

    /// Segments held (reported in heartbeats).
    pub fn segments(&self) -> u64 {
        self.lock().segs.len() as u64
    }

    /// Per logical node, the incarnation the coherence state knows it by, and the one it saw
    /// it come back as while holding state (0: none).
    pub fn view(&self, nodes: usize) -> (Vec<u64>, Vec<u64>) {
        let g = self.lock();
        let of = |f: &dyn Fn(&Svm, NodeId) -> Incarnation| -> Vec<u64> {
            (0..nodes)
                .map(|l| g.svm.as_ref().map(|s| f(s, NodeId(l as u32)).0).unwrap_or(0))
                .collect()
        };
        (of(&|s, n| s.known_incarnation(n)), of(&|s, n| s.fenced(n)))
    }

    /// Fault and transfer counters of this node.
    pub fn stats(&self) -> psls_svm::coherence::Stats {
        self.lock().svm.as_ref().map(|s| s.stats()).unwrap_or_default()
    }

    /// Registers the lifeline of process `pid`; returns what to write on it.
    pub fn lifeline(&self, pid: i32) -> (u64, tokio::sync::mpsc::UnboundedReceiver<String>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let id = self.next_lifeline.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lifelines.locked().entry(pid).or_default().push((id, tx));
        (id, rx)
    }

    /// Lifeline `id` of process `pid` closed; whether it was the process's last (the process
    /// is gone, or has no session left).
    pub fn end_lifeline(&self, pid: i32, id: u64) -> bool {
        let mut all = self.lifelines.locked();
        let Some(lines) = all.get_mut(&pid) else { return true };
        lines.retain(|(i, _)| *i != id);
        if lines.is_empty() {
            all.remove(&pid);
            return true;
        }
        false
    }

    /// The memfd of `file` on this node (created on first use), for a client to map.
    pub fn segment(
        &self,
        node: &Arc<Node>,
        file: FileId,
        name: &str,
        size: u64,
        backing: Backing,
    ) -> Result<std::fs::File, OpError> {
        if size == 0 || size > MAX_SEGMENT_BYTES {
            return Err(OpError::new(
                ErrorKind::Invalid,
                format!("cannot map {size} bytes (1 byte to {MAX_SEGMENT_BYTES})"),
            ));
        }
        let mut g = self.lock();
        ensure_svm(&mut g, node)?;
        if let Some(s) = g.segs.get(&file) {
            return s
                .memfd
                .try_clone()
                .map_err(|e| OpError::new(ErrorKind::Internal, format!("dup memfd: {e}")));
        }
        let pages = size.div_ceil(PAGE_SIZE as u64);
        let fd = nix::sys::memfd::memfd_create(format!("psls-{file}").as_str(), nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .map_err(|e| OpError::new(ErrorKind::Internal, format!("memfd_create: {e}")))?;
        let memfd = std::fs::File::from(fd);
        memfd
            .set_len(pages * PAGE_SIZE as u64)
            .map_err(|e| OpError::new(ErrorKind::Internal, format!("sizing memfd: {e}")))?;
        let dup = memfd
            .try_clone()
            .map_err(|e| OpError::new(ErrorKind::Internal, format!("dup memfd: {e}")))?;
        g.segs.insert(
            file,
            Segment {
                name: name.to_string(),
                memfd,
                pages,
                backing,
                maps: Vec::new(),
            },
        );
        tracing::info!(node = %node.name(), %file, name, pages, "segment opened");
        Ok(dup)
    }

    /// Takes over a client's userfaultfd registered over `[base, base + len)` of `file`; a
    /// thread serves its faults until the client unmaps or dies.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        self: &Arc<Self>,
        node: &Arc<Node>,
        pid: i32,
        file: FileId,
        base: u64,
        len: u64,
        writable: bool,
        uffd_fd: OwnedFd,
    ) -> Result<(), OpError> {
        let bad = |m: String| OpError::new(ErrorKind::Invalid, m);
        if !base.is_multiple_of(PAGE_SIZE as u64)
            || len == 0
            || !len.is_multiple_of(PAGE_SIZE as u64)
            || base.checked_add(len).is_none()
        {
            return Err(bad(format!("bad mapping range {base:#x}+{len:#x}")));
        }
        // The descriptor must be a userfaultfd: its /proc link says so.
        let link = std::fs::read_link(format!("/proc/self/fd/{}", uffd_fd.as_raw_fd()))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if !link.contains("userfaultfd") {
            return Err(bad(format!("the descriptor passed is not a userfaultfd ({link})")));
        }
        nix::fcntl::fcntl(&uffd_fd, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))
            .map_err(|e| bad(format!("userfaultfd: {e}")))?;
        let pidfd = pidfd_open(pid).map_err(|e| bad(format!("pidfd_open({pid}): {e}")))?;
        let stop = nix::sys::eventfd::EventFd::from_value_and_flags(0, nix::sys::eventfd::EfdFlags::EFD_CLOEXEC)
            .map_err(|e| OpError::new(ErrorKind::Internal, format!("eventfd: {e}")))?;
        let map = {
            let mut g = self.lock();
            let id = g.next_map;
            g.next_map += 1;
            let Some(seg) = g.segs.get_mut(&file) else {
                return Err(OpError::new(
                    ErrorKind::NotFound,
                    format!("segment {file} is not mapped on this node"),
                ));
            };
            if len > seg.pages * PAGE_SIZE as u64 {
                return Err(bad(format!(
                    "mapping of {len} bytes is larger than the segment ({} pages)",
                    seg.pages
                )));
            }
            // SAFETY: the descriptor is a userfaultfd (checked above) that we own from here on.
            let uffd =
                unsafe { <Uffd as std::os::fd::FromRawFd>::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(uffd_fd)) };
            let map = Arc::new(ClientMap {
                id,
                pid,
                file,
                base: base as usize,
                len: len as usize,
                writable,
                uffd,
                stop: stop.into(),
                prefetch: Mutex::new(Prefetch::default()),
            });
            seg.maps.push(map.clone());
            map
        };
        let (me, node2) = (self.clone(), node.clone());
        std::thread::Builder::new()
            .name(format!("uffd-{pid}-{}", map.id))
            .spawn(move || me.serve_faults(&node2, map, pidfd))
            .map_err(|e| OpError::new(ErrorKind::Internal, format!("fault thread: {e}")))?;
        Ok(())
    }

    /// Stops serving the mapping of process `pid` at `base`.
    pub fn unregister(&self, pid: i32, base: u64) -> Result<(), OpError> {
        let mut g = self.lock();
        let found = g
            .segs
            .values()
            .flat_map(|s| s.maps.iter())
            .find(|m| m.pid == pid && m.base as u64 == base)
            .cloned();
        let Some(m) = found else {
            return Err(OpError::new(
                ErrorKind::Invalid,
                format!("no mapping at {base:#x} (already unmapped?)"),
            ));
        };
        drop_map(&mut g, &m);
        Ok(())
    }

    /// The thread serving one client mapping.
    fn serve_faults(self: Arc<Self>, node: &Arc<Node>, map: Arc<ClientMap>, pidfd: OwnedFd) {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut buf = userfaultfd::EventBuffer::new(EVENT_BATCH);
        tracing::info!(node = %node.name(), pid = map.pid, file = %map.file, writable = map.writable, "serving faults");
        loop {
            let (uffd_ready, gone, stopped) = {
                let mut fds = [
                    PollFd::new(std::os::fd::AsFd::as_fd(&map.uffd), PollFlags::POLLIN),
                    PollFd::new(std::os::fd::AsFd::as_fd(&pidfd), PollFlags::POLLIN),
                    PollFd::new(std::os::fd::AsFd::as_fd(&map.stop), PollFlags::POLLIN),
                ];
                match poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        tracing::error!(pid = map.pid, error = %e, "poll on a userfaultfd failed");
                        break;
                    }
                }
                let ready = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
                (ready(&fds[0]), ready(&fds[1]), ready(&fds[2]))
            };
            if gone {
                tracing::info!(node = %node.name(), pid = map.pid, "client process exited; its mapping is released");
                break;
            }
            if stopped {
                return;
            }
            if !uffd_ready {
                continue;
            }
            let events: Vec<(usize, FaultKind, ReadWrite)> = match map.uffd.read_events(&mut buf) {
                Ok(evs) => evs
                    .filter_map(|e| match e {
                        Ok(Event::Pagefault { kind, rw, addr, .. }) => Some((addr as usize, kind, rw)),
                        _ => None,
                    })
                    .collect(),
                Err(e) => {
                    tracing::error!(pid = map.pid, error = %e, "reading a userfaultfd failed");
                    break;
                }
            };
            if events.is_empty() {
                continue;
            }
            let mut out = Vec::new();
            {
                let mut g = self.lock();
                for (addr, kind, rw) in events {
                    if addr < map.base || addr >= map.base + map.len {
                        tracing::warn!(pid = map.pid, addr, "fault outside the registered range ignored");
                        continue;
                    }
                    let index = ((addr - map.base) / PAGE_SIZE) as u64;
                    let page = PageId { file: map.file, index };
                    if !g.segs.contains_key(&map.file) {
                        out.push(Outgoing::Fatal {
                            pid: map.pid,
                            message: format!("segment {} is gone (its job ended): fault on page {index}", map.file),
                        });
                        continue;
                    }
                    let access = if rw == ReadWrite::Write || kind == FaultKind::WriteProtected {
                        Access::Write
                    } else {
                        Access::Read
                    };
                    if access == Access::Write && !map.writable {
                        // The kernel refuses stores to a read-only mapping before they fault
                        // here; a write fault means the client remapped it writable itself.
                        out.push(Outgoing::Fatal {
                            pid: map.pid,
                            message: format!("a store to read-only mapping of segment {} (page {index})", map.file),
                        });
                        continue;
                    }
                    let w = g.next_waiter;
                    g.next_waiter += 1;
                    g.waiters.insert(
                        w,
                        Waiter {
                            map: map.clone(),
                            addr: map.addr_of(index),
                            kind,
                        },
                    );
                    if let Some(svm) = g.svm.as_mut() {
                        svm.fault(page, access, w);
                        let last = (map.len / PAGE_SIZE) as u64 - 1;
                        let next = map.prefetch.locked().on_fault(index, last);
                        if let Some(next) = next {
                            svm.prefetch(
                                PageId {
                                    file: map.file,
                                    index: next,
                                },
                                access,
                            );
                        }
                    }
                }
                run(&mut g, node, &mut out);
            }
            self.dispatch(node, out);
        }
        let mut g = self.lock();
        drop_map(&mut g, &map);
    }

    /// A coherence message from a peer.
    pub fn on_message(self: &Arc<Self>, node: &Arc<Node>, env: Envelope, payload: bytes::Bytes) {
        let mut out = Vec::new();
        {
            let mut g = self.lock();
            if ensure_svm(&mut g, node).is_err() {
                return;
            }
            let from = env.from;
            let r = g.svm.as_mut().map(|s| s.receive(env));
            match r {
                Some(Ok(Receipt::Install(page))) => {
                    if payload.len() != PAGE_SIZE {
                        tracing::error!(node = %node.name(), %page, len = payload.len(), "page data of the wrong size");
                    } else if let Some(seg) = g.segs.get(&page.file) {
                        if let Err(e) = seg.memfd.write_all_at(&payload, page.index * PAGE_SIZE as u64) {
                            tracing::error!(node = %node.name(), %page, error = %e, "installing a page failed");
                        }
                    } else {
                        tracing::error!(node = %node.name(), %page, "page data for a segment not held here");
                    }
                }
                Some(Ok(_)) | None => {}
                Some(Err(e)) => {
                    tracing::warn!(node = %node.name(), peer = %from, error = %e, "coherence message rejected")
                }
            }
            run(&mut g, node, &mut out);
        }
        self.dispatch(node, out);
    }

    /// Membership changed (or may have): tells the state machine which incarnations are up.
    pub fn sync_peers(self: &Arc<Self>, node: &Arc<Node>) {
        let mut out = Vec::new();
        let nobody_holds = self.lock().svm.as_ref().is_some_and(|s| s.recovering()) && others_hold_nothing(node);
        {
            let mut g = self.lock();
            let Some(svm) = g.svm.as_mut() else { return };
            if nobody_holds && svm.recovering() {
                tracing::info!(node = %node.name(), "no other node holds shared pages any more: the pages managed here are served again");
                svm.end_recovery();
            }
            for (l, inc, up) in peer_views(node) {
                if l == svm.me() {
                    continue;
                }
                if up {
                    svm.peer_up(l, inc);
                } else {
                    svm.peer_down(l, inc);
                }
            }
            run(&mut g, node, &mut out);
        }
        self.dispatch(node, out);
    }

    fn dispatch(self: &Arc<Self>, node: &Arc<Node>, mut out: Vec<Outgoing>) {
        // Pages known to be all zeros (volatile segments, files never written) are installed
        // here, without a trip through the runtime; what that sets off is dispatched in the
        // next round. Each round completes at least one transaction, so this ends.
        let mut zeros: Vec<(PageId, TxnId)> = Vec::new();
        for _ in 0..MAX_STEPS {
            for o in out.drain(..) {
                match o {
                    Outgoing::Send { to, env, payload } => {
                        let phys = node.physical_now(to);
                        let req = PeerReq::Svm(env);
                        if let Err(e) = node.net.post(&phys, &req, payload) {
                            tracing::warn!(node = %node.name(), peer = %phys, error = %e, "coherence message not sent");
                        }
                    }
                    Outgoing::Load { page, txn, backing } => match backing {
                        Backing::Volatile { .. } => zeros.push((page, txn)),
                        Backing::Pfs(f) if f.gen == 0 => zeros.push((page, txn)),
                        Backing::Pfs(f) => {
                            let (node, me) = (node.clone(), self.clone());
                            self.runtime.spawn(async move {
                                let data = crate::pfs::read_page(&node, &f, page.index).await;
                                let out = me.install_loaded(&node, page, txn, data);
                                me.dispatch(&node, out);
                            });
                        }
                    },
                    Outgoing::Fatal { pid, message } => self.end_client(node, pid, message),
                }
            }
            if zeros.is_empty() {
                return;
            }
            for (page, txn) in zeros.drain(..) {
                let data = Ok(bytes::Bytes::from_static(&[0u8; PAGE_SIZE]));
                out.extend(self.install_loaded(node, page, txn, data));
            }
        }
        tracing::error!(node = %node.name(), "coherence dispatch did not settle");
    }

    /// Installs a page loaded from the PFS (or known to be zeros) and runs what follows;
    /// returns what must be done outside the lock.
    fn install_loaded(
        &self,
        node: &Arc<Node>,
        page: PageId,
        txn: TxnId,
        data: Result<bytes::Bytes, OpError>,
    ) -> Vec<Outgoing> {
        let mut out = Vec::new();
        let mut g = self.lock();
        let ok = match (&data, g.segs.get(&page.file)) {
            (Ok(d), Some(seg)) if d.len() == PAGE_SIZE => {
                match seg.memfd.write_all_at(d, page.index * PAGE_SIZE as u64) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::error!(node = %node.name(), %page, error = %e, "installing a loaded page failed");
                        false
                    }
                }
            }
            (Err(e), _) => {
                tracing::error!(node = %node.name(), %page, error = %e, "loading a page from the PFS failed");
                false
            }
            _ => false,
        };
        if let Some(svm) = g.svm.as_mut() {
            svm.loaded(page, txn, ok);
        }
        run(&mut g, node, &mut out);
        out
    }
}

/// `pidfd_open(2)`.
fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us; nobody else owns it.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

/// (logical id, incarnation, up) of every logical node, as membership sees them.
fn peer_views(node: &Node) -> Vec<(NodeId, Incarnation, bool)> {
    let st = node.meta_state();
    node.logical_map(&st)
        .into_iter()
        .map(|(l, phys)| {
            if phys == node.me.name {
                return (NodeId(l), svm_incarnation(&st, l, node.incarnation), true);
            }
            let inc = node.with_heartbeats(|m| m.heartbeat(&phys).map_or(0, |h| h.incarnation));
            (NodeId(l), svm_incarnation(&st, l, inc), inc > 0 && node.is_live(&phys))
        })
        .collect()
}

/// Whether every other node of the map has reported (in its latest heartbeat, sent after it
/// was last heard to hold any) that it holds no shared-memory segment at all.
fn others_hold_nothing(node: &Node) -> bool {
    let st = node.meta_state();
    node.with_heartbeats(|m| {
        node.logical_map(&st)
            .values()
            .filter(|p| **p != node.me.name)
            .all(|p| m.heartbeat(p).is_some_and(|h| h.svm_segments == 0))
    })
}

/// The shared-memory incarnation of logical node `l` run by a daemon of incarnation
/// `physical` (0: unknown): the assignment generation of `l` (which grows when a spare takes
/// it over) above the daemon's own counter, so that the spare outranks every incarnation of
/// the node it replaced, whatever their own counters say.
pub fn svm_incarnation(st: &psls_pfs::meta::MetaState, l: u32, physical: u64) -> Incarnation {
    if physical == 0 {
        return Incarnation(0);
    }
    Incarnation((st.assignment(l) << 32) | physical.min(u32::MAX as u64))
}

/// Creates the state machine on first use.
fn ensure_svm(g: &mut Inner, node: &Node) -> Result<(), OpError> {
    if g.svm.is_some() {
        return Ok(());
    }
    let st = node.meta_state();
    let Some(me) = node.my_logical(&st) else {
        return Err(OpError::new(
            ErrorKind::Unavailable,
            "this node holds no logical id (a spare): it cannot serve shared memory",
        ));
    };
    let views = peer_views(node);
    let n = node.cfg.nodes.len();
    let mut peers = vec![None; n];
    for &(l, inc, up) in &views {
        if (l.0 as usize) < n && up {
            peers[l.0 as usize] = Some(inc);
        }
    }
    // If another node holds shared pages, this daemon (restarted, or a spare in a dead node's
    // place) may have lost the directory of pages it manages: fenced when a node holding
    // segments knew another incarnation of this logical id (it has not caught up yet), or saw
    // it come back as this one while it held state (it caught up before this check, so its
    // view alone would look current).
    let inc = svm_incarnation(&st, me.0, node.incarnation);
    let others_hold = {
        node.with_heartbeats(|m| {
            node.logical_map(&st).values().any(|p| {
                *p != node.me.name
                    && m.heartbeat(p).is_some_and(|h| {
                        let knew = h.svm_view.get(me.0 as usize).copied().unwrap_or(0);
                        let fenced = h.svm_fenced.get(me.0 as usize).copied().unwrap_or(0);
                        h.svm_segments > 0 && ((knew != 0 && knew != inc.0) || fenced == inc.0)
                    })
            })
        })
    };
    g.svm = Some(if others_hold {
        tracing::warn!(node = %node.name(), "restarted while other nodes hold shared pages: pages managed here are unavailable until no other node holds any");
        Svm::restarted(me, inc, peers)
    } else {
        Svm::new(me, inc, peers)
    });
    Ok(())
}

fn drop_map(g: &mut Inner, m: &Arc<ClientMap>) {
    if let Some(seg) = g.segs.get_mut(&m.file) {
        seg.maps.retain(|x| x.id != m.id);
    }
    let gone: Vec<WaiterId> = g
        .waiters
        .iter()
        .filter(|(_, w)| w.map.id == m.id)
        .map(|(k, _)| *k)
        .collect();
    for w in gone {
        g.waiters.remove(&w);
        if let Some(svm) = g.svm.as_mut() {
            svm.cancel(w);
        }
    }
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to the eventfd we own.
    unsafe { libc::write(m.stop.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
}

/// Runs the state machine's actions (and this node's messages to itself) until none is left.
fn run(g: &mut Inner, node: &Node, out: &mut Vec<Outgoing>) {
    for _ in 0..MAX_STEPS {
        let Some(svm) = g.svm.as_mut() else { return };
        if let Some(a) = svm.poll_action() {
            apply(g, node, a, out);
            continue;
        }
        if let Some(env) = g.self_msgs.pop_front() {
            if let Err(e) = svm.receive(env) {
                tracing::error!(node = %node.name(), error = %e, "own coherence message rejected");
            }
            continue;
        }
        return;
    }
    tracing::error!(node = %node.name(), "coherence actions did not settle");
}

fn apply(g: &mut Inner, node: &Node, a: Action, out: &mut Vec<Outgoing>) {
    let me = g.svm.as_ref().map(|s| s.me());
    match a {
        Action::Send { to, env } => {
            if Some(to) == me {
                g.self_msgs.push_back(env);
                return;
            }
            let mut payload = bytes::Bytes::new();
            if env.msg.has_payload() {
                let page = env.msg.page();
                let Some(seg) = g.segs.get(&page.file) else {
                    tracing::error!(node = %node.name(), %page, "asked to send a page of a segment not held here");
                    return;
                };
                let mut buf = vec![0u8; PAGE_SIZE];
                if let Err(e) = seg.memfd.read_exact_at(&mut buf, page.index * PAGE_SIZE as u64) {
                    tracing::error!(node = %node.name(), %page, error = %e, "reading a page to send failed");
                    return;
                }
                payload = buf.into();
            }
            out.push(Outgoing::Send { to, env, payload });
        }
        Action::Load { page, txn } => match g.segs.get(&page.file) {
            Some(seg) => out.push(Outgoing::Load {
                page,
                txn,
                backing: seg.backing.clone(),
            }),
            None => {
                if let Some(svm) = g.svm.as_mut() {
                    svm.loaded(page, txn, false);
                }
            }
        },
        Action::SetAccess { page, access } => {
            let Some(seg) = g.segs.get(&page.file) else { return };
            match access {
                None => {
                    let r = nix::fcntl::fallocate(
                        &seg.memfd,
                        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
                        (page.index * PAGE_SIZE as u64) as i64,
                        PAGE_SIZE as i64,
                    );
                    if let Err(e) = r {
                        // Fail closed: a page that cannot be dropped must not stay readable.
                        // The daemon stops; its clients' lifelines tell them.
                        tracing::error!(node = %node.name(), %page, error = %e, "punching a page out of its memfd failed; stopping");
                        std::process::abort();
                    }
                }
                Some(Access::Read) => {
                    // Read-only mappings never map a page writable (nor are they registered
                    // for write-protection).
                    for m in seg.maps.iter().filter(|m| m.writable) {
                        if (page.index as usize) * PAGE_SIZE < m.len {
                            let addr = m.addr_of(page.index);
                            if let Err(e) = m.uffd.write_protect(addr as *mut libc::c_void, PAGE_SIZE) {
                                tracing::debug!(pid = m.pid, %page, error = %e, "write-protect (client gone?)");
                            }
                        }
                    }
                }
                Some(Access::Write) => {}
            }
        }
        Action::Resolve { waiter, page, .. } => {
            let Some(w) = g.waiters.remove(&waiter) else { return };
            let node_access = g.svm.as_ref().and_then(|s| s.access(page));
            resolve(&w, node_access);
        }
        Action::Fail { waiter, page, error } => {
            let Some(w) = g.waiters.remove(&waiter) else { return };
            let name = g.segs.get(&page.file).map(|s| s.name.clone()).unwrap_or_default();
            out.push(Outgoing::Fatal {
                pid: w.map.pid,
                message: format!(
                    "access to page {} of '{name}' failed on node {}: {error}",
                    page.index,
                    node.name()
                ),
            });
        }
    }
}

/// Lets a waiting fault go on, mapping the page as this node's access allows.
fn resolve(w: &Waiter, node_access: Option<Access>) {
    let writable = node_access == Some(Access::Write) && w.map.writable;
    let addr = w.addr as *mut libc::c_void;
    let r = match w.kind {
        FaultKind::WriteProtected if writable => w
            .map
            .uffd
            .remove_write_protection(addr, PAGE_SIZE, true)
            .map_err(|e| std::io::Error::other(e.to_string())),
        FaultKind::WriteProtected => w
            .map
            .uffd
            .wake(addr, PAGE_SIZE)
            .map_err(|e| std::io::Error::other(e.to_string())),
        // Write-protected when the mapping is writable but the node may not write (a read-only
        // mapping is not registered for write-protection, and its pages are read-only anyway).
        _ => match continue_page(&w.map.uffd, w.addr, !writable && w.map.writable) {
            // Another thread of the client mapped it first: just wake this one.
            Err(e) if errno_of(&e) == libc::EEXIST => w
                .map
                .uffd
                .wake(addr, PAGE_SIZE)
                .map_err(|e| std::io::Error::other(e.to_string())),
            r => r,
        },
    };
    if let Err(e) = r {
        // The client may be gone; if not, waking it makes it fault again.
        tracing::debug!(pid = w.map.pid, addr = w.addr, error = %e, "resolving a fault failed");
        let _ = w.map.uffd.wake(addr, PAGE_SIZE);
    }
}

#[cfg(test)]
mod tests {
    use super::Prefetch;

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
