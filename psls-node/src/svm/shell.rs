//! The shell's operations ([`SvmShell`]): segments and mappings as clients open, register
//! and drop them, the lifelines, faults and peer messages fed to the coherence state machine,
//! and the end of jobs and removed files.

use super::fault::*;
use super::state::*;
use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
use crate::peer::{PeerReq, PeerResp, MAX_SVM_BATCH};
use psls_ipc::ErrorKind;
use psls_svm::coherence::{Access, Envelope, FenceAnswer, Receipt, Svm, TxnId};
use psls_svm::{FileId, Incarnation, NodeId, PageId, PAGE_SIZE};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use userfaultfd::{Event, FaultKind, ReadWrite, Uffd};

impl SvmShell {
    pub fn new(runtime: tokio::runtime::Handle) -> SvmShell {
        SvmShell {
            inner: Mutex::new(Inner::default()),
            lifelines: Mutex::new(HashMap::new()),
            next_lifeline: std::sync::atomic::AtomicU64::new(0),
            runtime,
            active: Mutex::new(HashMap::new()),
            wp_faults: std::sync::atomic::AtomicU64::new(0),
            held: Mutex::new(Default::default()),
            asking: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Asks every other node of the map what its shared memory holds and knows of this one
    /// (in parallel, each within the read timeout): at start, before any coherence state, to
    /// learn whether this node restarted while others hold pages its previous incarnation
    /// granted; and while it recovers, to learn when none holds any. One ask at a time.
    pub async fn ask_peers(self: &Arc<Self>, node: &Arc<Node>) {
        use std::sync::atomic::Ordering;
        if self.asking.swap(true, Ordering::SeqCst) {
            return;
        }
        let st = node.meta_state();
        let Some(me) = node.my_logical(&st) else {
            self.asking.store(false, Ordering::SeqCst);
            return;
        };
        let asked_for = super::fault::svm_incarnation(&st, me.0, node.incarnation);
        let mut asks = tokio::task::JoinSet::new();
        for p in node.logical_map(&st).into_values() {
            if p == node.me.name || node.is_declared_down(&p) {
                continue;
            }
            let node = node.clone();
            asks.spawn(async move {
                let r = node
                    .call_data(
                        &p,
                        PeerReq::SvmHeld { logical: me.0 },
                        bytes::Bytes::new(),
                        node.read_timeout(),
                    )
                    .await;
                let held = match r {
                    Ok((PeerResp::SvmHeld { segments, knew, fenced }, _)) => Some(PeerHeld { segments, knew, fenced }),
                    _ => None,
                };
                (p, held)
            });
        }
        let mut answers = std::collections::BTreeMap::new();
        while let Some(r) = asks.join_next().await {
            if let Ok((p, Some(h))) = r {
                answers.insert(p, h);
            }
        }
        *self.held.locked() = PeersHeld {
            asked_for: Some(asked_for),
            answers,
        };
        self.asking.store(false, Ordering::SeqCst);
    }

    /// A peer's `SvmHeld`: what this node's shared memory holds, and knows of `logical`.
    pub fn held_for(&self, logical: u32) -> (u64, u64, u64) {
        let g = self.lock();
        let (knew, fenced) = g.svm.as_ref().map_or((0, 0), |s| {
            (s.known_incarnation(NodeId(logical)).0, s.fenced(NodeId(logical)).0)
        });
        (g.segs.len() as u64, knew, fenced)
    }

    /// Whether this node refuses the pages it manages until no other node holds any.
    pub fn recovering(&self) -> bool {
        self.lock().svm.as_ref().is_some_and(|s| s.recovering())
    }

    /// Write-protect faults taken since start.
    pub fn wp_faults(&self) -> u64 {
        self.wp_faults.load(std::sync::atomic::Ordering::Relaxed)
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
        let ids = g.job_segments(job);
        let mut ended: Vec<(i32, String)> = Vec::new();
        for id in &ids {
            if let Some(mut seg) = g.segs.remove(id) {
                // A process that outlives its job loses the job's segments: their pages are
                // punched out of the memfd (no stale, incoherent view stays mapped), and its
                // fault thread keeps running to end it, with a message, at its next fault on
                // them (or now, if it waits in one).
                seg.empty(node.name(), *id, "its job ended");
                let message = format!("job {job} ended: its volatile segment '{}' is gone", seg.name);
                ended.extend(g.fail_waiters(*id, &message));
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

    /// The parallel files (and checkpointed volatile segments) process `pid` maps writable
    /// here.
    pub fn writable_files(&self, pid: i32) -> Vec<FileId> {
        let g = self.lock();
        let mut v: Vec<FileId> = g
            .segs
            .iter()
            .filter(|(_, s)| s.backing.kept_in().is_some() && s.maps.iter().any(|m| m.pid == pid && m.writable))
            .map(|(id, _)| *id)
            .collect();
        v.sort();
        v
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
    pub(super) fn end_client(&self, node: &Node, pid: i32, message: String) {
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
        ensure_svm(&mut g, node, &self.held.locked())?;
        if let Some(s) = g.segs.get(&file) {
            return s
                .memfd
                .try_clone()
                .map_err(|e| OpError::new(ErrorKind::Internal, format!("dup memfd: {e}")));
        }
        let pages = size.div_ceil(PAGE_SIZE as u64);
        let known_at_open: Vec<Incarnation> = g.svm.as_ref().map_or_else(Vec::new, |s| {
            (0..node.cfg.nodes.len() as u32)
                .map(|l| s.known_incarnation(NodeId(l)))
                .collect()
        });
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
                dirty: Dirty::new(pages),
                shadows: HashMap::new(),
                known_at_open,
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

    /// Stops serving the mapping of process `pid` at `base`. Returns the parallel file whose
    /// last writable mapping by `pid` this was (its writes are to be made durable).
    pub fn unregister(&self, pid: i32, base: u64) -> Result<Option<FileId>, OpError> {
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
        let last_writer = m.writable
            && g.segs.get(&m.file).is_some_and(|s| {
                matches!(s.backing, Backing::Pfs(_)) && !s.maps.iter().any(|x| x.pid == pid && x.writable)
            });
        Ok(last_writer.then_some(m.file))
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
                    if kind == FaultKind::WriteProtected {
                        self.wp_faults.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
                            since: std::time::Instant::now(),
                            label: match (kind, access) {
                                (FaultKind::WriteProtected, _) => "write_protect",
                                (_, Access::Write) => "write",
                                (_, Access::Read) => "read",
                            },
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
        self.on_messages(node, vec![env], payload)
    }

    /// Coherence messages from one peer that it sent together ([`PeerReq::SvmBatch`]),
    /// handled in order as if they had come one by one; `payload` holds the pages of their
    /// `Data` messages in order. A batch whose payload does not match is dropped whole.
    pub fn on_messages(self: &Arc<Self>, node: &Arc<Node>, envs: Vec<Envelope>, payload: bytes::Bytes) {
        let mut later = Deferred::default();
        self.on_messages_deferred(node, envs, payload, &mut later);
        self.dispatch_deferred(node, later);
    }

    /// [`SvmShell::on_messages`], leaving what must be done outside the lock in `later`, for
    /// [`SvmShell::dispatch_deferred`]: the link thread handles every message a wake-up
    /// brought before it sends, so that what they set off for one node goes together (the
    /// forwards of several readers' requests to one owner, say).
    pub fn on_messages_deferred(
        self: &Arc<Self>,
        node: &Arc<Node>,
        envs: Vec<Envelope>,
        payload: bytes::Bytes,
        later: &mut Deferred,
    ) {
        let out = &mut later.0;
        let from = envs.first().map(|e| e.from);
        if envs.len() > MAX_SVM_BATCH {
            tracing::warn!(node = %node.name(), peer = ?from, messages = envs.len(), "more coherence messages in one batch than allowed: dropped");
            return;
        }
        let pages = envs.iter().filter(|e| e.msg.has_payload()).count();
        if envs.len() > 1 && pages * PAGE_SIZE != payload.len() {
            tracing::warn!(node = %node.name(), peer = ?from, messages = envs.len(), pages, len = payload.len(), "coherence messages with page data of the wrong size: dropped");
            return;
        }
        {
            let mut g = self.lock();
            if ensure_svm(&mut g, node, &self.held.locked()).is_err() {
                return;
            }
            let alone = envs.len() == 1;
            let mut at = 0;
            for env in envs {
                // A message alone carries its payload as it came (`receive_one` checks its
                // size); a batch's payload was checked above to hold one page per `Data`.
                let data = if alone {
                    payload.clone()
                } else if env.msg.has_payload() && at + PAGE_SIZE <= payload.len() {
                    at += PAGE_SIZE;
                    payload.slice(at - PAGE_SIZE..at)
                } else {
                    bytes::Bytes::new()
                };
                receive_one(&mut g, node, env, &data);
                // Each message's actions run before the next message: as if they came apart.
                run(&mut g, node, out);
            }
        }
    }

    /// Does what [`SvmShell::on_messages_deferred`] left.
    pub fn dispatch_deferred(self: &Arc<Self>, node: &Arc<Node>, later: Deferred) {
        if !later.0.is_empty() {
            self.dispatch(node, later.0);
        }
    }

    /// This node restarted while others held shared pages, and a request came for a page of
    /// `file` managed here: asks every other node of the cluster whether it held any of
    /// `file` when it learnt of this incarnation. If none did, `file`'s pages are served from
    /// the disks as if nobody held them: a file first used after the restart, or a settled one
    /// (no job writes it: every node dropped its copies of the pages managed here, which equal
    /// the disks', when it learnt of the restart or when the file settled). Else a job writes
    /// it, and its requests are refused until that job rolls back or ends. A node that has
    /// not learnt of the restart yet, or does not answer, is asked again, for
    /// `FENCE_ASK_LIMIT` at most.
    async fn check_fence(self: &Arc<Self>, node: &Arc<Node>, file: FileId) {
        let Some((me, inc)) = self.lock().svm.as_ref().map(|s| (s.me(), s.incarnation())) else {
            return;
        };
        let mut clean = false;
        let mut held_by = String::new();
        let deadline = std::time::Instant::now() + FENCE_ASK_LIMIT;
        for round in 0u32.. {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            // Every other node of the cluster, whatever the state machine knows of it.
            let Some(askees) = self.lock().svm.as_ref().map(|s| s.fence_askees()) else {
                return;
            };
            let mut asks = tokio::task::JoinSet::new();
            for l in askees {
                let (node, p) = (node.clone(), node.physical_now(l));
                let req = PeerReq::FenceAsk {
                    manager: me.0,
                    incarnation: inc.0,
                    file,
                };
                let timeout = node.read_timeout().min(left);
                asks.spawn(async move {
                    let r = node.call_data(&p, req, bytes::Bytes::new(), timeout).await;
                    (p, r)
                });
            }
            let (mut held, mut unsure) = (Vec::new(), false);
            while let Some(r) = asks.join_next().await {
                match r {
                    Ok((_, Ok((PeerResp::Fence(FenceAnswer::Clean), _)))) => {}
                    Ok((p, Ok((PeerResp::Fence(FenceAnswer::Held), _)))) => held.push(p),
                    _ => unsure = true,
                }
            }
            held_by = held.join(",");
            let held = !held.is_empty();
            tracing::debug!(node = %node.name(), %file, round, held_by, unsure, "asked whether a file was held before this restart");
            if held {
                break;
            }
            if !unsure {
                clean = true;
                break;
            }
            tokio::time::sleep(FENCE_ASK_PAUSE).await;
        }
        let mut out = Vec::new();
        {
            let mut g = self.lock();
            let Some(svm) = g.svm.as_mut().filter(|s| s.incarnation() == inc) else {
                return;
            };
            if clean {
                tracing::info!(node = %node.name(), %file, "no node held this file before this restart: its pages managed here are served");
            } else {
                tracing::warn!(node = %node.name(), %file, held_by, "a job writing this file held pages before this restart: its pages managed here are refused until that job rolls back or ends");
            }
            svm.fence_checked(file, clean);
            run(&mut g, node, &mut out);
        }
        self.dispatch(node, out);
    }

    /// What this node says to restarted `manager` asking about `file` (`Svm::fence_answer`).
    pub fn fence_answer(&self, manager: NodeId, incarnation: Incarnation, file: FileId) -> FenceAnswer {
        let g = self.lock();
        // A segment opened before this node knew an incarnation counts as known as 0.
        let seg = g.segs.get(&file).map(|s| {
            s.known_at_open
                .get(manager.0 as usize)
                .copied()
                .unwrap_or(Incarnation(0))
        });
        match g.svm.as_ref() {
            Some(svm) => {
                let a = svm.fence_answer(manager, incarnation, file, seg);
                tracing::debug!(%manager, incarnation = incarnation.0, %file, ?seg, known = svm.known_incarnation(manager).0, up = svm.is_up(manager), settled = svm.is_settled(file), answer = ?a, "asked whether a file was held before a restart");
                a
            }
            // No coherence state yet: no page of any file was ever here.
            None => FenceAnswer::Clean,
        }
    }

    /// Membership changed (or may have): tells the state machine which incarnations are up.
    pub fn sync_peers(self: &Arc<Self>, node: &Arc<Node>) {
        let mut out = Vec::new();
        let nobody_holds = self.recovering() && others_hold_nothing(node, &self.held.locked());
        let st = node.meta_state();
        {
            let mut g = self.lock();
            let Inner { svm, segs, .. } = &mut *g;
            let Some(svm) = svm.as_mut() else { return };
            if nobody_holds && svm.recovering() {
                tracing::info!(node = %node.name(), "no other node holds shared pages any more: the pages managed here are served again");
                svm.end_recovery();
            }
            // Before the peers: a settled file's copies that died lose nothing.
            let mut files = svm.files();
            files.extend(segs.keys().copied());
            files.sort();
            files.dedup();
            for f in files {
                let settled = st.file_by_id(f).is_some_and(|m| m.writer.is_none());
                if settled != svm.is_settled(f) {
                    tracing::debug!(node = %node.name(), file = %f, settled, "file's writer changed");
                }
                svm.set_settled(f, settled);
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
            // The processes mapping a settled file saw only what the disks hold: nothing of it
            // died with an incarnation known now, as if the segment opened now.
            for (f, seg) in segs.iter_mut() {
                if svm.is_settled(*f) {
                    for (l, k) in seg.known_at_open.iter_mut().enumerate() {
                        *k = (*k).max(svm.known_incarnation(NodeId(l as u32)));
                    }
                }
            }
            run(&mut g, node, &mut out);
        }
        self.dispatch(node, out);
    }

    pub(super) fn dispatch(self: &Arc<Self>, node: &Arc<Node>, mut out: Vec<Outgoing>) {
        // Pages known to be all zeros (volatile segments, files never written) are installed
        // here, without a trip through the runtime; what that sets off is dispatched in the
        // next round. Each round completes at least one transaction, so this ends.
        let mut zeros: Vec<(PageId, TxnId)> = Vec::new();
        for _ in 0..MAX_STEPS {
            // Messages to one node that are ready together go in one link message (in order).
            let mut sends: Vec<(NodeId, Vec<(Envelope, bytes::Bytes)>)> = Vec::new();
            for o in out.drain(..) {
                match o {
                    Outgoing::Send { to, env, payload } => match sends.iter_mut().find(|(t, _)| *t == to) {
                        Some((_, msgs)) => msgs.push((env, payload)),
                        None => sends.push((to, vec![(env, payload)])),
                    },
                    Outgoing::Load { page, txn, backing } => match backing.kept_in().cloned() {
                        None => zeros.push((page, txn)),
                        // The page's generation now, not when the segment opened: checkpoints
                        // write pages of mapped files.
                        Some(f) => {
                            let f = node.file_by_id(f.id).unwrap_or(f);
                            let memory = node.frames.in_memory(f.id);
                            if f.page_gen(page.index) == 0 && !memory {
                                zeros.push((page, txn));
                                continue;
                            }
                            let (node, me) = (node.clone(), self.clone());
                            self.runtime.spawn(async move {
                                let data = crate::pfs::read_page(&node, &f, page.index).await;
                                let out = me.install_loaded(&node, page, txn, data);
                                me.dispatch(&node, out);
                            });
                        }
                    },
                    Outgoing::Fatal { pid, message } => self.end_client(node, pid, message),
                    Outgoing::CheckFence { file } => {
                        let (node, me) = (node.clone(), self.clone());
                        self.runtime.spawn(async move { me.check_fence(&node, file).await });
                    }
                }
            }
            for (to, msgs) in sends {
                post_coherence(node, to, msgs);
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

/// Sends coherence messages to node `to`, in order: one link message for those that fit in a
/// batch together, a plain one for a message alone.
fn post_coherence(node: &Node, to: NodeId, mut msgs: Vec<(Envelope, bytes::Bytes)>) {
    let phys = node.physical_now(to);
    while !msgs.is_empty() {
        let rest = msgs.split_off(msgs.len().min(MAX_SVM_BATCH));
        let (req, payload) = if msgs.len() == 1 {
            let (env, payload) = msgs.remove(0);
            (PeerReq::Svm(env), payload)
        } else {
            let len = msgs.iter().map(|(_, p)| p.len()).sum();
            let mut payload = bytes::BytesMut::with_capacity(len);
            let mut envs = Vec::with_capacity(msgs.len());
            for (env, p) in msgs.drain(..) {
                payload.extend_from_slice(&p);
                envs.push(env);
            }
            (PeerReq::SvmBatch(envs), payload.freeze())
        };
        if let Err(e) = node.net.post(&phys, &req, payload) {
            tracing::warn!(node = %node.name(), peer = %phys, error = %e, "coherence message not sent");
        }
        msgs = rest;
    }
}

/// Hands one coherence message to the state machine and installs its page if it says so.
fn receive_one(g: &mut Inner, node: &Node, env: Envelope, payload: &[u8]) {
    let from = env.from;
    match g.svm.as_mut().map(|s| s.receive(env)) {
        Some(Ok(Receipt::Install(page))) => {
            if payload.len() != PAGE_SIZE {
                tracing::error!(node = %node.name(), %page, len = payload.len(), "page data of the wrong size");
            } else if let Some(seg) = g.segs.get(&page.file) {
                if let Err(e) = seg.memfd.write_all_at(payload, page.index * PAGE_SIZE as u64) {
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
}
