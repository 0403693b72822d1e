//! The client library proper: a [`Session`] with the local node daemon through which a process
//! maps parallel files and volatile segments as plain memory ([`Mapping`]).
//!
//! Mapping a file: the daemon hands over the node's memfd of the file; the process maps it
//! `MAP_SHARED`, creates a userfaultfd, registers the mapping (missing, minor and
//! write-protect faults) and passes the userfaultfd to the daemon, which from then on serves
//! every fault of the mapping (DESIGN §4). The process keeps its own copy of the userfaultfd
//! open, so that if the daemon dies a faulting thread stays blocked instead of reading memory
//! nobody manages; a watchdog thread on the session's *lifeline* connection then ends the
//! process with a clear message. It does the same when the daemon reports that one of the
//! process's faults cannot be served; once the session is dropped it ends quietly.
//!
//! Mappings are not inherited by forked children (`MADV_DONTFORK`): their copies would not be
//! registered with the userfaultfd and would bypass the coherence protocol.
//!
//! Barrier and lock calls go over the session's *sync channel*, a `SOCK_SEQPACKET` socket
//! pair whose other end the daemon holds: one datagram each way, answered by the daemon
//! without going through its async runtime.

use crate::ClientError;
use psls_ipc::proto::{self, FrameError, Request, Response};
use psls_ipc::ErrorKind;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The socket of the local daemon: `PSLS_SOCKET`, else the node `PSLS_NODE` (default: the
/// first node whose socket answers) of the cluster in `$PSLS_HOME` (default `./.psls`).
pub fn socket_path() -> Result<PathBuf, ClientError> {
    if let Ok(s) = std::env::var("PSLS_SOCKET") {
        return Ok(PathBuf::from(s));
    }
    let dir = std::env::var_os("PSLS_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".psls"));
    let cfg_path = dir.join("cluster.toml");
    let cfg = psls_ipc::ClusterConfig::load(&cfg_path).map_err(|e| ClientError::Connect {
        path: cfg_path.display().to_string(),
        err: std::io::Error::other(format!("{e} (set PSLS_SOCKET or PSLS_HOME)")),
    })?;
    if let Ok(name) = std::env::var("PSLS_NODE") {
        let n = cfg.entry(&name).ok_or_else(|| ClientError::Connect {
            path: cfg_path.display().to_string(),
            err: std::io::Error::other(format!("no node named '{name}'")),
        })?;
        return Ok(cfg.socket_path(n));
    }
    for n in cfg.all() {
        let p = cfg.socket_path(n);
        if UnixStream::connect(&p).is_ok() {
            return Ok(p);
        }
    }
    Err(ClientError::Connect {
        path: cfg_path.display().to_string(),
        err: std::io::Error::other("no node daemon of this cluster answers"),
    })
}

fn frame_err(e: impl Into<FrameError>) -> ClientError {
    ClientError::Frame(e.into())
}

/// One frame connection whose reads also collect passed descriptors.
struct Conn {
    sock: UnixStream,
}

impl Conn {
    fn connect(path: &Path) -> Result<Conn, ClientError> {
        let mut sock = UnixStream::connect(path).map_err(|err| ClientError::Connect {
            path: path.display().to_string(),
            err,
        })?;
        sock.write_all(&proto::hello()).map_err(frame_err)?;
        Ok(Conn { sock })
    }

    fn send(&mut self, req: &Request, fd: Option<BorrowedFd<'_>>) -> Result<(), ClientError> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let frame = proto::encode(req).map_err(ClientError::Frame)?;
        let mut sent = 0;
        if let Some(fd) = fd {
            let fds = [fd.as_raw_fd()];
            sent = sendmsg::<()>(
                self.sock.as_raw_fd(),
                &[std::io::IoSlice::new(&frame)],
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(|e| frame_err(std::io::Error::from(e)))?;
        }
        self.sock.write_all(&frame[sent..]).map_err(frame_err)
    }

    /// Reads one frame and the descriptors passed with it.
    fn recv(&mut self) -> Result<(Response, Vec<OwnedFd>), ClientError> {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        let mut len = [0u8; 4];
        let mut got = 0;
        let mut fds = Vec::new();
        while got < 4 {
            let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 4]);
            let mut iov = [std::io::IoSliceMut::new(&mut len[got..])];
            let msg = recvmsg::<()>(
                self.sock.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .map_err(|e| frame_err(std::io::Error::from(e)))?;
            if msg.bytes == 0 {
                return Err(ClientError::Frame(FrameError::Closed));
            }
            for c in msg.cmsgs().map_err(|e| frame_err(std::io::Error::from(e)))? {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    for fd in raw {
                        // SAFETY: the kernel installed this descriptor for us; we own it.
                        fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
            got += msg.bytes;
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > proto::MAX_FRAME {
            return Err(ClientError::Frame(FrameError::TooLarge(n)));
        }
        let mut body = vec![0u8; n];
        self.sock.read_exact(&mut body).map_err(frame_err)?;
        Ok((proto::decode(&body).map_err(ClientError::Frame)?, fds))
    }

    fn call(&mut self, req: &Request, fd: Option<BorrowedFd<'_>>) -> Result<(Response, Vec<OwnedFd>), ClientError> {
        self.send(req, fd)?;
        self.recv()
    }
}

fn daemon_error(r: Response) -> ClientError {
    match r {
        Response::Error { kind, message } => ClientError::Daemon { kind, message },
        other => ClientError::Protocol(format!("{other:?}")),
    }
}

/// The client end of a sync channel (see `psls_ipc::proto`): barrier and lock calls, one
/// datagram each way, answered by the daemon without its runtime.
struct SyncChannel {
    sock: OwnedFd,
}

impl SyncChannel {
    /// Makes a socket pair and hands the daemon its end over `conn`.
    fn open(conn: &mut Conn) -> Result<SyncChannel, ClientError> {
        use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
        let (mine, theirs) = socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
            .map_err(|e| ClientError::Local(std::io::Error::from(e)))?;
        match conn.call(&Request::SyncChannel, Some(std::os::fd::AsFd::as_fd(&theirs)))? {
            (Response::Ok, _) => Ok(SyncChannel { sock: mine }),
            (other, _) => Err(daemon_error(other)),
        }
    }

    fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        use nix::sys::socket::{recv, send, MsgFlags};
        let bytes = proto::encode_datagram(req).map_err(|e| match e {
            FrameError::DatagramTooLarge(n) => ClientError::Invalid(format!(
                "the call takes {n} bytes, more than a barrier or lock call may ({}): use a shorter name",
                proto::MAX_SYNC_MSG
            )),
            e => ClientError::Frame(e),
        })?;
        let io = |e: nix::errno::Errno| frame_err(std::io::Error::from(e));
        loop {
            match send(self.sock.as_raw_fd(), &bytes, MsgFlags::MSG_NOSIGNAL) {
                Err(nix::errno::Errno::EINTR) => continue,
                r => {
                    r.map_err(io)?;
                    break;
                }
            }
        }
        let mut buf = vec![0u8; proto::MAX_SYNC_MSG + 1];
        let n = loop {
            match recv(self.sock.as_raw_fd(), &mut buf, MsgFlags::MSG_TRUNC) {
                Err(nix::errno::Errno::EINTR) => continue,
                r => break r.map_err(io)?,
            }
        };
        if n == 0 {
            return Err(ClientError::Frame(FrameError::Closed));
        }
        if n > proto::MAX_SYNC_MSG {
            return Err(ClientError::Frame(FrameError::DatagramTooLarge(n)));
        }
        proto::decode(&buf[..n]).map_err(ClientError::Frame)
    }
}

/// The session's end of its lifeline: closed when the session is dropped, after which the
/// watchdog ends quietly (the process no longer depends on the daemon).
struct Lifeline {
    closed: Arc<AtomicBool>,
    sock: UnixStream,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.lifeline.closed.store(true, Ordering::SeqCst);
        let _ = self.lifeline.sock.shutdown(std::net::Shutdown::Both);
    }
}

/// What a safe-point call did ([`Session::checkpoint`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// The checkpoint taken (its number in the job), 0 when none was.
    pub epoch: u64,
    /// The job halts (`psls halt`): its ranks are being stopped; it can be resumed from
    /// `epoch`.
    pub halt: bool,
    /// Pages the checkpoint took (one copy; it keeps two, in memory or on disks).
    pub pages: u64,
    /// How long the checkpoint stopped the job's ranks: from the last rank's call to their
    /// answer, as the coordinator saw it (this call also waited for the slowest rank).
    pub stopped_us: u64,
}

impl Checkpoint {
    /// Whether this call took a checkpoint.
    pub fn taken(&self) -> bool {
        self.epoch > 0
    }
}

/// A process's session with its node daemon.
pub struct Session {
    conn: Mutex<Conn>,
    sync: Mutex<SyncChannel>,
    lifeline: Lifeline,
    rank: u32,
    size: u32,
    job: String,
}

impl Session {
    /// Connects to the local daemon (see [`socket_path`]) and starts the lifeline watchdog.
    pub fn connect() -> Result<Session, ClientError> {
        Session::connect_to(&socket_path()?)
    }

    /// Connects to the daemon listening at `path` (rank, size and job still come from the
    /// environment).
    pub fn connect_to(path: &Path) -> Result<Session, ClientError> {
        let path = path.to_path_buf();
        let mut conn = Conn::connect(&path)?;
        let sync = SyncChannel::open(&mut conn)?;
        let mut life = Conn::connect(&path)?;
        life.send(&Request::Lifeline, None)?;
        let lifeline = Lifeline {
            closed: Arc::new(AtomicBool::new(false)),
            sock: life.sock.try_clone().map_err(ClientError::Local)?,
        };
        let closed = lifeline.closed.clone();
        std::thread::Builder::new()
            .name("psls-lifeline".into())
            .spawn(move || watchdog(life, closed))
            .map_err(|e| ClientError::Local(std::io::Error::other(e)))?;
        let env_u32 = |k: &str, d: u32| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
        Ok(Session {
            conn: Mutex::new(conn),
            sync: Mutex::new(sync),
            lifeline,
            rank: env_u32("PSLS_RANK", 0),
            size: env_u32("PSLS_SIZE", 1).max(1),
            job: std::env::var("PSLS_JOB").unwrap_or_default(),
        })
    }

    /// Waits until every rank of the job ([`Session::size`]) has called `barrier(name)`.
    pub fn barrier(&self, name: &str) -> Result<(), ClientError> {
        self.barrier_of(name, self.size)
    }

    /// A barrier or lock call, on the sync channel.
    fn sync_call(&self, req: &Request) -> Result<(), ClientError> {
        match self.sync.lock().unwrap_or_else(|e| e.into_inner()).call(req)? {
            Response::Ok => Ok(()),
            other => Err(daemon_error(other)),
        }
    }

    /// Waits until `count` ranks of the job have called this barrier.
    pub fn barrier_of(&self, name: &str, count: u32) -> Result<(), ClientError> {
        self.sync_call(&Request::Barrier {
            job: self.job.clone(),
            name: name.into(),
            count,
        })
    }

    /// This node's shared-memory counters: (node name, [(counter, value)]).
    pub fn node_stats(&self) -> Result<(String, Vec<(String, u64)>), ClientError> {
        match self.call(&Request::SvmStats, None)? {
            (Response::SvmStats { node, counters }, _) => Ok((node, counters)),
            (other, _) => Err(daemon_error(other)),
        }
    }

    /// The safe-point call (the shape of SCR's and VeloC's): every rank of the job calls it at
    /// the same point of its main loop with its private state (loop counters and the like, at
    /// most 1 MiB). Once every rank has called, the coordinator decides for all of them: take
    /// a persistent checkpoint of the files the job maps writable and of the ranks' states
    /// (the interval of `psls run --checkpoint-interval` elapsed, or `psls checkpoint` /
    /// `psls halt` asked), or nothing. After a halt the job's ranks are stopped.
    /// A process outside `psls run` is a job of one rank.
    pub fn checkpoint(&self, state: &[u8]) -> Result<Checkpoint, ClientError> {
        if state.len() > proto::MAX_CKPT_STATE {
            return Err(ClientError::Invalid(format!(
                "a rank's checkpoint state is at most {} bytes; this one is {}",
                proto::MAX_CKPT_STATE,
                state.len()
            )));
        }
        // What the rank printed before its safe point reaches its pipes first: the checkpoint
        // keeps the number of its last line, and a rollback's reprinted lines are dropped.
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let _ = std::io::stderr().flush();
        // SAFETY: fflush(NULL) flushes every C stdio output stream of this process; it takes
        // no pointer from here and is thread-safe (stdio locks each stream).
        unsafe { libc::fflush(std::ptr::null_mut()) };
        let req = Request::Checkpoint { state: state.to_vec() };
        match self.call(&req, None)? {
            (
                Response::Checkpointed {
                    epoch,
                    halt,
                    pages,
                    stopped_us,
                },
                _,
            ) => Ok(Checkpoint {
                epoch,
                halt,
                pages,
                stopped_us,
            }),
            (other, _) => Err(daemon_error(other)),
        }
    }

    /// The checkpoint this rank restarts from, and the state it saved there; `None` on a fresh
    /// start. A restarted rank runs the same code as a fresh one and asks this first.
    pub fn restart_state(&self) -> Result<Option<(u64, Vec<u8>)>, ClientError> {
        let Some(epoch) = std::env::var("PSLS_RESTART_EPOCH")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        else {
            return Ok(None);
        };
        if epoch == 0 {
            return Ok(None);
        }
        match self.call(&Request::RestartState { epoch }, None)? {
            (Response::RestartState { epoch, state }, _) => Ok(Some((epoch, state))),
            (other, _) => Err(daemon_error(other)),
        }
    }

    /// Makes this process's writes to the parallel files it maps writable durable: a
    /// persistent checkpoint of those files, committed on both disk copies before it returns.
    /// Returns the number of pages written (0 when nothing was mapped writable or dirty).
    /// The last unmap of a writable mapping does the same for its file.
    pub fn sync(&self) -> Result<u64, ClientError> {
        match self.call(&Request::Sync, None)? {
            (Response::Synced { pages, .. }, _) => Ok(pages),
            (other, _) => Err(daemon_error(other)),
        }
    }

    /// Waits for lock `id` of the job and holds it.
    pub fn lock(&self, id: u64) -> Result<(), ClientError> {
        self.sync_call(&Request::Lock {
            job: self.job.clone(),
            id,
        })
    }

    /// Releases lock `id`; an error if this process does not hold it.
    pub fn unlock(&self, id: u64) -> Result<(), ClientError> {
        self.sync_call(&Request::Unlock {
            job: self.job.clone(),
            id,
        })
    }

    /// This process's rank in its job (0 outside `psls run`).
    pub fn rank(&self) -> u32 {
        self.rank
    }
    /// The number of ranks of the job (1 outside `psls run`).
    pub fn size(&self) -> u32 {
        self.size
    }

    fn call(&self, req: &Request, fd: Option<BorrowedFd<'_>>) -> Result<(Response, Vec<OwnedFd>), ClientError> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner()).call(req, fd)
    }

    /// Maps `size` bytes of the parallel file `name`, creating it with that size if `create`
    /// and it does not exist. The caller must be allowed to read and write it.
    pub fn map(&self, name: &str, size: u64, create: bool) -> Result<Mapping<'_>, ClientError> {
        self.map_with(name, size, create, false, true)
    }

    /// Maps `size` bytes of an existing parallel file for reading only: the caller needs read
    /// permission only. The mapping sees every write made anywhere in the cluster (it is as
    /// coherent as a writable one); a store to it is a segmentation fault.
    pub fn map_read_only(&self, name: &str, size: u64) -> Result<ReadOnlyMapping<'_>, ClientError> {
        Ok(ReadOnlyMapping {
            inner: self.map_with(name, size, false, false, false)?,
        })
    }

    /// Maps a volatile segment: shared by every process of the caller's job (`psls run`)
    /// that maps the same name, zero at first, never written to disk, and dropped when the job
    /// ends. Outside a job, processes of one user share it until the daemons stop.
    pub fn create_volatile(&self, name: &str, size: u64) -> Result<Mapping<'_>, ClientError> {
        self.map_with(name, size, true, true, true)
    }

    fn map_with(
        &self,
        name: &str,
        size: u64,
        create: bool,
        volatile: bool,
        writable: bool,
    ) -> Result<Mapping<'_>, ClientError> {
        let req = Request::Map {
            name: name.into(),
            size,
            create,
            writable,
            volatile,
            job: self.job.clone(),
        };
        let (resp, mut fds) = self.call(&req, None)?;
        let Response::Mapped { file, len, .. } = resp else {
            return Err(daemon_error(resp));
        };
        if fds.len() != 1 {
            return Err(ClientError::Protocol(format!(
                "Mapped came with {} descriptors",
                fds.len()
            )));
        }
        let memfd = fds.remove(0);
        let len_usize = usize::try_from(len).map_err(|_| ClientError::Protocol(format!("mapping length {len}")))?;
        let nz = std::num::NonZeroUsize::new(len_usize).ok_or_else(|| ClientError::Protocol("empty mapping".into()))?;
        // A read-only mapping gets a read-only descriptor, which cannot be mapped shared for
        // writing; userfaultfd only takes mappings that may become writable, so it is mapped
        // private (the memfd's pages are installed read-only in it, never copied, and a hole
        // punched in the memfd still drops them).
        use nix::sys::mman::{MapFlags, ProtFlags};
        let (prot, flags) = if writable {
            (ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED)
        } else {
            (ProtFlags::PROT_READ, MapFlags::MAP_PRIVATE)
        };
        // SAFETY: a fresh mapping of the daemon's memfd at an address the kernel picks;
        // nothing else refers to that range yet.
        let base = unsafe { nix::sys::mman::mmap(None, nz, prot, flags, &memfd, 0) }
            .map_err(|e| ClientError::Local(std::io::Error::other(format!("mmap: {e}"))))?;
        let unmap = |base: std::ptr::NonNull<libc::c_void>| {
            // SAFETY: unmaps exactly the range mapped above, which nothing else uses.
            let _ = unsafe { nix::sys::mman::munmap(base, len_usize) };
        };
        // A forked child must not inherit the mapping: its copy would not be registered with
        // the userfaultfd, so touching a page the node does not hold would create a zero page
        // in the node's memfd, and its stores would bypass the protocol. Without the mapping, a
        // child's access is a segmentation fault instead.
        // SAFETY: advice on exactly the range mapped above.
        if let Err(e) = unsafe { nix::sys::mman::madvise(base, len_usize, nix::sys::mman::MmapAdvise::MADV_DONTFORK) } {
            unmap(base);
            return Err(ClientError::Local(std::io::Error::other(format!(
                "madvise(MADV_DONTFORK): {e}"
            ))));
        }
        let uffd = match create_uffd() {
            Ok(u) => u,
            Err(e) => {
                unmap(base);
                return Err(e);
            }
        };
        // Write-protection is how the daemon downgrades a writable mapping; a read-only one
        // never needs it.
        let mut modes = userfaultfd::RegisterMode::MISSING | userfaultfd::RegisterMode::MINOR;
        if writable {
            modes |= userfaultfd::RegisterMode::WRITE_PROTECT;
        }
        if let Err(e) = uffd.register_with_mode(base.as_ptr(), len_usize, modes) {
            unmap(base);
            return Err(ClientError::Local(std::io::Error::other(format!(
                "registering the mapping with userfaultfd: {e}"
            ))));
        }
        let reg = Request::Register {
            file,
            base: base.as_ptr() as u64,
            len,
            writable,
        };
        // SAFETY: the userfaultfd stays open (owned by `uffd`) for the duration of the call.
        let uffd_fd = unsafe { BorrowedFd::borrow_raw(uffd.as_raw_fd()) };
        match self.call(&reg, Some(uffd_fd)) {
            Ok((Response::Ok, _)) => {}
            Ok((other, _)) => {
                unmap(base);
                return Err(daemon_error(other));
            }
            Err(e) => {
                unmap(base);
                return Err(e);
            }
        }
        Ok(Mapping {
            session: self,
            base: base.as_ptr() as *mut u8,
            len: len_usize,
            _uffd: uffd,
            _memfd: memfd,
            unmapped: false,
        })
    }
}

/// A userfaultfd that also sees faults from the kernel (e.g. `read(2)` into a mapping) when
/// allowed, else one for user-mode faults only. An unprivileged process usually may not open
/// `/dev/userfaultfd` (mode 600) nor ask for kernel faults, but may always make a user-mode-only
/// one with the system call (Linux ≥ 5.11).
fn create_uffd() -> Result<userfaultfd::Uffd, ClientError> {
    let mut b = userfaultfd::UffdBuilder::new();
    b.close_on_exec(true).non_blocking(true);
    b.user_mode_only(false)
        .create()
        .or_else(|_| b.user_mode_only(true).create())
        .or_else(|e| user_mode_uffd().map_err(|e2| format!("{e}; and by the system call: {e2}")))
        .map_err(|e| ClientError::Local(std::io::Error::other(format!("cannot create a userfaultfd: {e}"))))
}

/// A user-mode-only userfaultfd from the `userfaultfd(2)` system call (the `userfaultfd`
/// crate does not fall back to it when the device exists but may not be opened).
fn user_mode_uffd() -> std::io::Result<userfaultfd::Uffd> {
    use std::os::fd::{FromRawFd, IntoRawFd};
    /// `UFFD_USER_MODE_ONLY` (linux/userfaultfd.h).
    const USER_MODE_ONLY: libc::c_long = 1;
    #[repr(C)]
    struct UffdioApi {
        api: u64,
        features: u64,
        ioctls: u64,
    }
    let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as libc::c_long | USER_MODE_ONLY;
    // SAFETY: userfaultfd(2) takes one integer of flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor the call above just created, owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
    let mut api = UffdioApi {
        api: userfaultfd_sys::UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API reads and writes only the struct passed, which has the kernel's
    // layout (struct uffdio_api) and lives across the call.
    let r = unsafe { libc::ioctl(owned.as_raw_fd(), userfaultfd_sys::UFFDIO_API as _, &mut api) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a userfaultfd after its API handshake, handed over to the wrapper that closes it.
    Ok(unsafe { userfaultfd::Uffd::from_raw_fd(owned.into_raw_fd()) })
}

/// Ends the process when the daemon says a fault failed or when the daemon goes away.
fn watchdog(mut life: Conn, closed: Arc<AtomicBool>) {
    let got = life.recv();
    if closed.load(Ordering::SeqCst) {
        return;
    }
    let message = match got {
        Ok((Response::Fatal { message }, _)) => format!("psls: {message}"),
        Ok((other, _)) => format!("psls: unexpected message on the lifeline: {other:?}"),
        Err(_) => {
            "psls: lost the node daemon (it stopped or crashed); this process's shared memory cannot be served any more"
                .to_string()
        }
    };
    // Written without std's stderr lock: a thread blocked in a fault that will never be served
    // may hold it (a print of mapped memory faults while it holds the lock).
    let line = format!("{message}\n");
    // SAFETY: write(2) of a live buffer to descriptor 2; a short or failed write is ignored.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    // SAFETY: _exit ends the process at once, without running anything else: other threads
    // may be blocked in faults that will never be served.
    unsafe { libc::_exit(70) };
}

/// A mapped parallel file or volatile segment. Unmapped on drop.
pub struct Mapping<'s> {
    session: &'s Session,
    base: *mut u8,
    len: usize,
    _uffd: userfaultfd::Uffd,
    _memfd: OwnedFd,
    unmapped: bool,
}

// SAFETY: the mapping is plain shared memory; access rules are those of the slices it hands out.
unsafe impl Send for Mapping<'_> {}
// SAFETY: as above; shared references only give out shared slices.
unsafe impl Sync for Mapping<'_> {}

impl Mapping<'_> {
    /// Length in bytes (the size asked for, rounded up to whole pages).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base
    }
    /// The mapping as a slice of plain-old-data values.
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        // SAFETY: base is page-aligned (so aligned for any Pod type) and len bytes are mapped
        // for as long as self lives; any bit pattern is a valid T.
        unsafe { std::slice::from_raw_parts(self.base as *const T, self.len / std::mem::size_of::<T>().max(1)) }
    }
    /// The mapping as a mutable slice of plain-old-data values.
    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        // SAFETY: as for `as_slice`; `&mut self` makes this the only slice of this mapping in
        // this process.
        unsafe { std::slice::from_raw_parts_mut(self.base as *mut T, self.len / std::mem::size_of::<T>().max(1)) }
    }

    /// Unmaps; an error if the daemon does not know the mapping.
    pub fn unmap(mut self) -> Result<(), ClientError> {
        self.do_unmap()
    }

    fn do_unmap(&mut self) -> Result<(), ClientError> {
        if self.unmapped {
            return Err(ClientError::Daemon {
                kind: ErrorKind::Invalid,
                message: "already unmapped".into(),
            });
        }
        self.unmapped = true;
        let r = self.session.call(&Request::Unmap { base: self.base as u64 }, None);
        if let Some(p) = std::ptr::NonNull::new(self.base as *mut libc::c_void) {
            // SAFETY: unmaps exactly this mapping's range; no slice of it outlives `self`.
            let _ = unsafe { nix::sys::mman::munmap(p, self.len) };
        }
        match r? {
            (Response::Ok, _) => Ok(()),
            (other, _) => Err(daemon_error(other)),
        }
    }
}

/// A parallel file mapped for reading only ([`Session::map_read_only`]). Unmapped on drop.
pub struct ReadOnlyMapping<'s> {
    inner: Mapping<'s>,
}

impl<'s> ReadOnlyMapping<'s> {
    /// Length in bytes (the size asked for, rounded up to whole pages).
    pub fn len(&self) -> usize {
        self.inner.len
    }
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// The start address.
    pub fn as_ptr(&self) -> *const u8 {
        self.inner.base
    }
    /// The mapping as a slice of plain-old-data values.
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        self.inner.as_slice()
    }
    /// Unmaps; an error if the daemon does not know the mapping.
    pub fn unmap(self) -> Result<(), ClientError> {
        self.inner.unmap()
    }
    /// The mapping underneath (the C ABI keeps both kinds in one table).
    pub(crate) fn into_inner(self) -> Mapping<'s> {
        self.inner
    }
}

impl Drop for Mapping<'_> {
    fn drop(&mut self) {
        if !self.unmapped {
            let _ = self.do_unmap();
        }
    }
}
