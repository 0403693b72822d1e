//! The node's Unix socket for local clients and the admin CLI. The caller's uid/gid come from
//! SO_PEERCRED; file owners and modes decide reads and writes, and cluster administration
//! (scrub, replace, shutdown) is for root or the daemon's own user. Every frame is bounded.

use crate::dispatch::Daemon;
use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
use crate::pfs::{self, Caller, Importer};
use psls_ipc::proto::{self, ClusterStatus, NodeState, NodeStatus, Request, Response, MAX_FRAME};
use psls_ipc::ErrorKind;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};

/// Binds the socket, refusing to steal one a live daemon listens on.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("socket {} is in use by another running daemon", path.display());
        }
        std::fs::remove_file(path)?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let l = UnixListener::bind(path).map_err(|e| anyhow::anyhow!("cannot bind socket {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(l)
}

pub async fn serve(d: Arc<Daemon>, listener: UnixListener, _path: PathBuf) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept on client socket failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let d = d.clone();
        tokio::spawn(async move {
            if let Err(e) = client(d, stream).await {
                tracing::debug!(error = %e, "client connection ended");
            }
        });
    }
}

/// Reads one frame body; `None` at a clean end of the connection.
async fn read_body(r: &mut OwnedReadHalf) -> Result<Option<Vec<u8>>, proto::FrameError> {
    let mut prefix = [0u8; 4];
    match r.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = proto::check_len(prefix)?;
    let mut body = Vec::with_capacity(len);
    r.take(len as u64).read_to_end(&mut body).await?;
    if body.len() != len {
        return Err(proto::FrameError::Closed);
    }
    Ok(Some(body))
}

/// Reads one request, with any file descriptors attached to its first bytes (they are closed
/// when dropped unless a handler takes them). `None` at a clean end of the connection.
async fn read_req_with_fds(r: &mut OwnedReadHalf) -> Result<Option<(Request, Vec<OwnedFd>)>, proto::FrameError> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let stream: &UnixStream = r.as_ref();
    let mut prefix = [0u8; 4];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < 4 {
        stream.readable().await?;
        let res = stream.try_io(tokio::io::Interest::READABLE, || {
            let mut iov = [std::io::IoSliceMut::new(&mut prefix[got..])];
            let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
            let msg = recvmsg::<()>(
                stream.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .map_err(std::io::Error::from)?;
            let mut received = Vec::new();
            for c in msg.cmsgs().map_err(std::io::Error::from)? {
                if let ControlMessageOwned::ScmRights(list) = c {
                    // SAFETY: SCM_RIGHTS gave this process new descriptors that nothing else
                    // owns; each is wrapped exactly once.
                    received.extend(list.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
                }
            }
            Ok((msg.bytes, received))
        });
        match res {
            Ok((0, _)) if got == 0 => return Ok(None),
            Ok((0, _)) => return Err(proto::FrameError::Closed),
            Ok((n, more)) => {
                got += n;
                fds.extend(more);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.into()),
        }
    }
    let len = proto::check_len(prefix)?;
    let mut body = Vec::with_capacity(len);
    r.take(len as u64).read_to_end(&mut body).await?;
    if body.len() != len {
        return Err(proto::FrameError::Closed);
    }
    Ok(Some((proto::decode(&body)?, fds)))
}

/// At most this many descriptors are taken from one message; the kernel closes any beyond.
const MAX_FDS: usize = 4;

#[derive(Clone, Copy, PartialEq)]
enum Access {
    Read,
    Write,
}

/// The single descriptor a request must carry, checked: a regular file, pipe or character
/// device, open for the access the request needs.
fn one_fd(fds: &mut Vec<OwnedFd>, need: Access) -> Result<std::fs::File, OpError> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    use nix::sys::stat::{fstat, SFlag};
    if fds.len() != 1 {
        let msg = format!("this request needs exactly one file descriptor, got {}", fds.len());
        return Err(OpError::new(ErrorKind::Invalid, msg));
    }
    let fd = fds.remove(0);
    let bad = |m: &str| OpError::new(ErrorKind::Invalid, m.to_string());
    let st = fstat(&fd).map_err(|e| bad(&format!("cannot inspect the passed descriptor: {e}")))?;
    let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
    if ![SFlag::S_IFREG, SFlag::S_IFIFO, SFlag::S_IFCHR].contains(&kind) {
        return Err(bad("the passed descriptor is not a file, pipe or device"));
    }
    let flags = OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL).map_err(|e| bad(&e.to_string()))?);
    let mode = flags & OFlag::O_ACCMODE;
    let ok = match need {
        Access::Read => mode == OFlag::O_RDONLY || mode == OFlag::O_RDWR,
        Access::Write => mode == OFlag::O_WRONLY || mode == OFlag::O_RDWR,
    };
    if !ok {
        let what = if need == Access::Read { "reading" } else { "writing" };
        return Err(bad(&format!("the passed descriptor is not open for {what}")));
    }
    Ok(std::fs::File::from(fd))
}

/// Import whose bytes the daemon reads from the client's descriptor.
async fn import_from_fd(
    node: &Arc<Node>,
    caller: Caller,
    file: std::fs::File,
    name: &str,
    size: u64,
    mode: u32,
    replace: bool,
) -> Response {
    use std::io::Read;
    let mut imp = match Importer::begin(node, caller, name, size, mode, replace).await {
        Ok(i) => i,
        Err(e) => return err(e),
    };
    let file = Arc::new(file);
    let mut left = size;
    // One buffer, reused for every chunk.
    let mut buf = vec![0u8; proto::CHUNK];
    while left > 0 {
        let n = left.min(proto::CHUNK as u64) as usize;
        let f = file.clone();
        let read = crate::op::blocking(move || {
            let r = (&*f).read_exact(&mut buf[..n]);
            (buf, r)
        })
        .await;
        let r = match read {
            Ok((b, Ok(()))) => {
                buf = b;
                imp.data(&buf[..n]).await
            }
            Ok((b, Err(e))) => {
                buf = b;
                Err(OpError::new(ErrorKind::Io, format!("reading the file to import: {e}")))
            }
            Err(e) => {
                imp.abort().await;
                return err(e);
            }
        };
        if let Err(e) = r {
            imp.abort().await;
            return err(e);
        }
        left -= n as u64;
    }
    match imp.commit().await {
        Ok(f) => Response::Files(vec![f]),
        Err(e) => err(e),
    }
}

/// Holds a client's lifeline: writes `Fatal` when one of its faults fails; returns when the
/// client closes it.
async fn lifeline(d: &Arc<Daemon>, pid: i32, mut r: OwnedReadHalf, mut w: OwnedWriteHalf) -> anyhow::Result<()> {
    let node = &d.node;
    let (id, mut rx) = d.svm.lifeline(pid);
    let mut byte = [0u8; 1];
    let r = loop {
        tokio::select! {
            m = rx.recv() => match m {
                Some(message) => {
                    if let Err(e) = send(&mut w, &Response::Fatal { message }).await {
                        break Err(e.into());
                    }
                }
                None => break Ok(()),
            },
            _ = r.read(&mut byte) => break Ok(()),
        }
    };
    // The process is gone (or closed its last session): its locks and barrier waits go with it.
    if !d.svm.end_lifeline(pid, id) {
        return r;
    }
    if let Err(e) = crate::sync::gone(&d.sync, crate::sync::who(node, pid)) {
        tracing::warn!(node = %node.name(), pid, error = %e, "could not release a dead client's locks");
    }
    r
}

/// Relays a job's output to the CLI and ends with its status; kills the job if the CLI goes.
async fn run_job(
    d: &Arc<Daemon>,
    job: &str,
    ranks: u32,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<crate::launcher::JobEvent>,
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
) -> anyhow::Result<()> {
    let node = &d.node;
    use crate::launcher::JobEvent;
    let mut exited: std::collections::BTreeMap<u32, i32> = std::collections::BTreeMap::new();
    let mut failed: Option<(u32, i32)> = None;
    let mut byte = [0u8; 1];
    while (exited.len() as u32) < ranks {
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = r.read(&mut byte) => {
                tracing::info!(node = %node.name(), job, "the CLI went away: stopping the job");
                crate::launcher::kill_everywhere(node, job).await;
                crate::launcher::finished(node, &d.jobs, job);
                return Ok(());
            }
        };
        let Some(ev) = ev else { break };
        match ev {
            JobEvent::Output { rank, err, data } => {
                send(&mut w, &Response::RankOutput { rank, err, data }).await?;
            }
            JobEvent::Exit { rank, code } => {
                if rank >= ranks || exited.contains_key(&rank) {
                    continue;
                }
                exited.insert(rank, code);
                if code != 0 && failed.is_none() {
                    failed = Some((rank, code));
                    let (node, job) = (node.clone(), job.to_string());
                    tokio::spawn(async move { crate::launcher::kill_everywhere(&node, &job).await });
                }
            }
        }
    }
    crate::launcher::finished(node, &d.jobs, job);
    let (code, message) = match failed {
        None => (0, format!("all {ranks} ranks exited with status 0")),
        Some((rank, crate::launcher::LOST_STATUS)) => (
            crate::launcher::LOST_STATUS,
            format!("rank {rank} was lost (its node went down or it could not report); the other ranks were stopped"),
        ),
        Some((rank, code)) => (
            code,
            format!("rank {rank} exited with status {code}; the other ranks were stopped"),
        ),
    };
    send(&mut w, &Response::JobDone { code, message }).await?;
    Ok(())
}

/// A stable id for a volatile segment: from its owner, job and name (high bit set, so it
/// never collides with a parallel file's id). A later job's segment of the same name is
/// another segment, so late messages about an ended job's pages touch nothing of it.
fn volatile_id(uid: u32, job: &str, name: &str) -> psls_svm::FileId {
    let mut h = psls_svm::rng::mix64(uid as u64 ^ 0x5053_4c53);
    // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
    for part in [job, name] {
        h = psls_svm::rng::mix64(h ^ part.len() as u64);
        for chunk in part.as_bytes().chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            h = psls_svm::rng::mix64(h ^ u64::from_le_bytes(b));
        }
    }
    psls_svm::FileId(h | 1 << 63)
}

/// `Map`: checks the caller's rights, creates the file if asked, opens the node's segment.
async fn map(
    d: &Arc<Daemon>,
    caller: Caller,
    name: &str,
    size: u64,
    create: bool,
    writable: bool,
    // `Some(job)` for a volatile segment of `job` (empty: outside a job).
    volatile: Option<&str>,
) -> Result<(Response, std::fs::File), OpError> {
    let node = &d.node;
    let pages_len = |n: u64| n.div_ceil(psls_svm::PAGE_SIZE as u64) * psls_svm::PAGE_SIZE as u64;
    if size == 0 {
        return Err(OpError::new(ErrorKind::Invalid, "cannot map 0 bytes"));
    }
    // A writable mapping gets the node's memfd read-write: only callers who may write the file
    // get one. A read-only mapping gets a read-only descriptor of the same memory (it cannot
    // be mapped shared for writing, nor made writable later).
    if !writable && (create || volatile.is_some()) {
        return Err(OpError::new(
            ErrorKind::Invalid,
            "a read-only mapping is of an existing parallel file (no create, no volatile segment)",
        ));
    }
    let (id, file_size, backing) = if let Some(job) = volatile {
        psls_pfs::meta::validate_name(name).map_err(|e| OpError::new(ErrorKind::Invalid, e.to_string()))?;
        if job.len() > 256 {
            return Err(OpError::new(ErrorKind::Invalid, "job id longer than 256 bytes"));
        }
        let job = (!job.is_empty()).then(|| job.to_string());
        (
            volatile_id(caller.uid, job.as_deref().unwrap_or(""), name),
            size,
            crate::svm::Backing::Volatile { job },
        )
    } else {
        let found = pfs::lookup_file(node, name);
        let f = match found {
            Ok(f) => f,
            Err(e) if e.kind == ErrorKind::NotFound && create => {
                match pfs::create(node, caller, name, size, 0o644).await {
                    Ok(_) => {}
                    // Another rank created it first.
                    Err(e) if e.kind == ErrorKind::Exists => {}
                    Err(e) => return Err(e),
                }
                pfs::lookup_file(node, name)?
            }
            Err(e) => return Err(e),
        };
        caller.check_read(&f)?;
        if writable {
            caller.check_write(&f)?;
        }
        if size > f.size {
            return Err(OpError::new(
                ErrorKind::Invalid,
                format!("cannot map {size} bytes of '{name}': the file has {} bytes", f.size),
            ));
        }
        (f.id, f.size, crate::svm::Backing::Pfs(f))
    };
    let mut memfd = d.svm.segment(node, id, name, file_size, backing)?;
    if !writable {
        memfd = read_only(&memfd)?;
    }
    let resp = Response::Mapped {
        file: id.0,
        size: file_size,
        len: pages_len(size),
        writable,
    };
    Ok((resp, memfd))
}

/// A new read-only open file description of `file` (through its /proc link).
fn read_only(file: &std::fs::File) -> Result<std::fs::File, OpError> {
    use std::os::fd::AsRawFd;
    std::fs::OpenOptions::new()
        .read(true)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|e| OpError::new(ErrorKind::Internal, format!("reopening a memfd read-only: {e}")))
}

/// Sends `resp` with `fd` attached (SCM_RIGHTS) to the frame's first bytes.
async fn send_with_fd(w: &mut OwnedWriteHalf, resp: &Response, fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let frame = proto::encode(resp).map_err(|e| std::io::Error::other(e.to_string()))?;
    let sent = loop {
        let sock: &UnixStream = w.as_ref();
        sock.writable().await?;
        let raw = sock.as_raw_fd();
        let fds = [fd.as_raw_fd()];
        let r = sock.try_io(tokio::io::Interest::WRITABLE, || {
            sendmsg::<()>(
                raw,
                &[std::io::IoSlice::new(&frame)],
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(std::io::Error::from)
        });
        match r {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    };
    w.write_all(&frame[sent..]).await
}

/// Export that the daemon writes into the client's descriptor.
async fn export_to_fd(node: &Arc<Node>, caller: Caller, file: std::fs::File, name: &str) -> Response {
    let (f, mut rx) = match pfs::export_stream(node, caller, name) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    let file = Arc::new(file);
    while let Some(chunk) = rx.recv().await {
        let data = match chunk {
            Ok(d) => d,
            Err(e) => return err(e),
        };
        let out = file.clone();
        match crate::op::blocking(move || write_pages(&*out, &data)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return err(OpError::new(ErrorKind::Io, format!("writing the exported file: {e}"))),
            Err(e) => return err(e),
        }
    }
    Response::Exported { size: f.size }
}

/// Writes `pages` in order with vectored writes (no assembly copy).
fn write_pages(mut w: impl std::io::Write, pages: &[bytes::Bytes]) -> std::io::Result<()> {
    /// At most this many buffers per call (Linux's IOV_MAX).
    const MAX_IOV: usize = 1024;
    let (mut i, mut off) = (0usize, 0usize);
    loop {
        while i < pages.len() && off == pages[i].len() {
            (i, off) = (i + 1, 0);
        }
        if i == pages.len() {
            return Ok(());
        }
        let iov: Vec<std::io::IoSlice> = std::iter::once(&pages[i][off..])
            .chain(pages[i + 1..].iter().map(|p| &p[..]))
            .take(MAX_IOV)
            .map(std::io::IoSlice::new)
            .collect();
        let mut n = match w.write_vectored(&iov) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        while n > 0 {
            let rest = pages[i].len() - off;
            if n >= rest {
                (i, off, n) = (i + 1, 0, n - rest);
            } else {
                (off, n) = (off + n, 0);
            }
        }
    }
}

/// Sends `Response::Data(data)` without copying `data` into a frame buffer.
async fn send_data(w: &mut OwnedWriteHalf, data: &[u8]) -> std::io::Result<()> {
    let header = proto::data_frame_header(data.len()).map_err(|e| std::io::Error::other(e.to_string()))?;
    w.write_all(&header).await?;
    w.write_all(data).await
}

async fn send(w: &mut OwnedWriteHalf, resp: &Response) -> std::io::Result<()> {
    let bytes = proto::encode(resp).map_err(|e| std::io::Error::other(e.to_string()))?;
    w.write_all(&bytes).await
}

fn ok_or_err(r: Result<(), OpError>) -> Response {
    match r {
        Ok(()) => Response::Ok,
        Err(e) => err(e),
    }
}

fn err(e: OpError) -> Response {
    Response::Error {
        kind: e.kind,
        message: e.message,
    }
}

fn check_admin(node: &Node, c: Caller) -> Result<(), OpError> {
    if c.uid == 0 || c.uid == node.euid {
        Ok(())
    } else {
        Err(OpError::new(
            ErrorKind::Permission,
            "permission denied: cluster administration needs root or the daemon's user",
        ))
    }
}

async fn client(d: Arc<Daemon>, stream: UnixStream) -> anyhow::Result<()> {
    let node = d.node.clone();
    let cred = stream.peer_cred()?;
    let caller = Caller {
        uid: cred.uid(),
        gid: cred.gid(),
    };
    let pid = cred.pid();
    // Files this connection was allowed to map, and whether writable.
    let mut granted: std::collections::HashMap<u64, bool> = std::collections::HashMap::new();
    let (mut r, mut w) = stream.into_split();
    loop {
        let (req, mut fds) = match read_req_with_fds(&mut r).await {
            Ok(Some(req)) => req,
            Ok(None) => return Ok(()),
            Err(e) => {
                tracing::warn!(uid = caller.uid, error = %e, "bad client message");
                let _ = send(
                    &mut w,
                    &err(OpError::new(ErrorKind::Invalid, format!("bad request: {e}"))),
                )
                .await;
                return Ok(());
            }
        };
        let resp = match req {
            Request::Status => Response::Status(status(&node)),
            Request::Create { name, size, mode } => match pfs::create(&node, caller, &name, size, mode).await {
                Ok(f) => Response::Files(vec![f]),
                Err(e) => err(e),
            },
            Request::ImportBegin {
                name,
                size,
                mode,
                replace,
            } => {
                let resp = import(&node, caller, &mut r, &name, size, mode, replace).await;
                let failed = matches!(resp, Response::Error { .. });
                send(&mut w, &resp).await?;
                if failed {
                    // The client may still be streaming data: close rather than misread it.
                    return Ok(());
                }
                continue;
            }
            Request::ImportData { .. } | Request::ImportCommit => {
                err(OpError::new(ErrorKind::Invalid, "import data without ImportBegin"))
            }
            Request::Export { name } => match pfs::export_stream(&node, caller, &name) {
                Ok((f, mut rx)) => {
                    send(&mut w, &Response::ExportBegin { size: f.size }).await?;
                    while let Some(chunk) = rx.recv().await {
                        match chunk {
                            Ok(pages) => send_data(&mut w, &pages.concat()).await?,
                            Err(e) => {
                                send(&mut w, &err(e)).await?;
                                return Ok(());
                            }
                        }
                    }
                    Response::ExportEnd
                }
                Err(e) => err(e),
            },
            Request::ImportFd {
                name,
                size,
                mode,
                replace,
            } => match one_fd(&mut fds, Access::Read) {
                Ok(fd) => import_from_fd(&node, caller, fd, &name, size, mode, replace).await,
                Err(e) => err(e),
            },
            Request::ExportFd { name } => match one_fd(&mut fds, Access::Write) {
                Ok(fd) => export_to_fd(&node, caller, fd, &name).await,
                Err(e) => err(e),
            },
            Request::Ls => Response::Files(pfs::list(&node)),
            Request::Stat { name } => match pfs::stat(&node, caller, &name) {
                Ok((file, stripes)) => Response::Stat { file, stripes },
                Err(e) => err(e),
            },
            Request::Rm { name } => match pfs::remove(&node, caller, &name).await {
                Ok(()) => Response::Ok,
                Err(e) => err(e),
            },
            Request::Scrub => match check_admin(&node, caller) {
                Ok(()) => match pfs::scrub(&node).await {
                    Ok(r) => Response::Scrub(r),
                    Err(e) => err(e),
                },
                Err(e) => err(e),
            },
            Request::NodeReplace { logical, spare } => match check_admin(&node, caller) {
                Ok(()) => match pfs::replace(&node, logical, &spare).await {
                    Ok(()) => Response::Ok,
                    Err(e) => err(e),
                },
                Err(e) => err(e),
            },
            Request::Lifeline => {
                let Some(pid) = pid else {
                    send(&mut w, &err(OpError::new(ErrorKind::Invalid, "no peer pid"))).await?;
                    return Ok(());
                };
                return lifeline(&d, pid, r, w).await;
            }
            Request::Map {
                name,
                size,
                create,
                writable,
                volatile,
                job,
            } => match map(
                &d,
                caller,
                &name,
                size,
                create,
                writable,
                volatile.then_some(job.as_str()),
            )
            .await
            {
                Ok((resp, memfd)) => {
                    if let Response::Mapped { file, writable, .. } = resp {
                        // Writable once granted on this connection, whatever came after.
                        *granted.entry(file).or_insert(false) |= writable;
                    }
                    send_with_fd(&mut w, &resp, std::os::fd::AsFd::as_fd(&memfd)).await?;
                    continue;
                }
                Err(e) => err(e),
            },
            Request::Register {
                file,
                base,
                len,
                writable,
            } => match (granted.get(&file), pid, fds.len()) {
                (None, _, _) => err(OpError::new(
                    ErrorKind::Invalid,
                    "register of a file not mapped on this connection",
                )),
                (Some(false), _, _) if writable => err(OpError::new(
                    ErrorKind::Permission,
                    "the file was mapped read-only: it cannot be registered writable",
                )),
                (_, None, _) => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
                (_, _, n) if n != 1 => err(OpError::new(
                    ErrorKind::Invalid,
                    format!("register needs exactly one descriptor (the userfaultfd), got {n}"),
                )),
                (Some(_), Some(pid), _) => {
                    let fd = fds.remove(0);
                    match d
                        .svm
                        .register(&node, pid, psls_svm::FileId(file), base, len, writable, fd)
                    {
                        Ok(()) => Response::Ok,
                        Err(e) => err(e),
                    }
                }
            },
            Request::SyncChannel => match (pid, fds.len()) {
                (None, _) => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
                (Some(_), n) if n != 1 => err(OpError::new(
                    ErrorKind::Invalid,
                    format!("a sync channel needs exactly one descriptor (the socket), got {n}"),
                )),
                (Some(pid), _) => match d.channels.add(fds.remove(0), pid, caller.uid) {
                    Ok(()) => Response::Ok,
                    Err(e) => err(e),
                },
            },
            Request::Barrier { job, name, count } => {
                let req = crate::peer::PeerReq::BarrierArrive {
                    key: crate::sync::key(caller.uid, &job, &name),
                    count,
                    who: crate::sync::who(&node, pid.unwrap_or(0)),
                    call: 0,
                };
                ok_or_err(crate::sync::call(&d.sync, req).await)
            }
            Request::Lock { job, id } => {
                let req = crate::peer::PeerReq::LockAcquire {
                    key: crate::sync::key(caller.uid, &job, &id.to_string()),
                    who: crate::sync::who(&node, pid.unwrap_or(0)),
                    call: 0,
                };
                ok_or_err(crate::sync::call(&d.sync, req).await)
            }
            Request::Unlock { job, id } => {
                let req = crate::peer::PeerReq::LockRelease {
                    key: crate::sync::key(caller.uid, &job, &id.to_string()),
                    who: crate::sync::who(&node, pid.unwrap_or(0)),
                    call: 0,
                };
                ok_or_err(crate::sync::call(&d.sync, req).await)
            }
            Request::Run {
                program,
                args,
                ranks,
                per_node,
                env,
                cwd,
            } => {
                let launched = crate::launcher::launch(
                    &node, &d.jobs, ranks, per_node, program, args, env, cwd, caller.uid, caller.gid,
                )
                .await;
                match launched {
                    Ok((job, rx)) => return run_job(&d, &job, ranks, rx, r, w).await,
                    Err(e) => err(e),
                }
            }
            Request::PeerPing {
                peer,
                bytes,
                count,
                link,
            } => {
                if bytes > 1 << 20 || count == 0 || count > 100_000 || node.cfg.entry(&peer).is_none() {
                    err(OpError::new(
                        ErrorKind::Invalid,
                        "peer ping: a node of the cluster, up to 1 MiB, 1 to 100000 round trips",
                    ))
                } else {
                    let payload = bytes::Bytes::from(vec![0x5a_u8; bytes as usize]);
                    let mut out = Vec::with_capacity(count as usize);
                    let mut failure = None;
                    for _ in 0..count {
                        let t = std::time::Instant::now();
                        if link {
                            match link_ping(&node, &peer, payload.clone()).await {
                                Ok(()) => out.push(t.elapsed().as_nanos() as u64),
                                Err(e) => {
                                    failure = Some(e);
                                    break;
                                }
                            }
                            continue;
                        }
                        match node
                            .call_data(&peer, crate::peer::PeerReq::Echo, payload.clone(), node.request_timeout)
                            .await
                        {
                            Ok((_, back)) if back.len() == payload.len() => out.push(t.elapsed().as_nanos() as u64),
                            Ok(_) => {
                                failure = Some(OpError::new(ErrorKind::Internal, "echo came back with another size"));
                                break;
                            }
                            Err(e) => {
                                failure = Some(e.into());
                                break;
                            }
                        }
                    }
                    match failure {
                        None => Response::Latencies(out),
                        Some(e) => err(e),
                    }
                }
            }
            Request::SvmStats => {
                let st = d.svm.stats();
                Response::SvmStats {
                    node: node.name().to_string(),
                    counters: vec![
                        ("local_faults".into(), st.local_faults),
                        ("read_requests".into(), st.read_requests),
                        ("write_requests".into(), st.write_requests),
                        ("pages_in".into(), st.pages_in),
                        ("pages_out".into(), st.pages_out),
                        ("pages_loaded".into(), st.pages_loaded),
                        ("invalidations".into(), st.invalidations),
                        ("failed_faults".into(), st.failed_faults),
                        ("joined_reads".into(), st.joined_reads),
                        ("implied_grants".into(), st.implied_grants),
                        ("posted_messages".into(), node.net.posted()),
                        ("link_datagrams".into(), node.net.link.datagrams()),
                        ("sync_channels".into(), d.channels.len() as u64),
                        ("sync_waits".into(), d.sync.waits() as u64),
                    ],
                }
            }
            Request::Unmap { base } => match pid {
                Some(pid) => match d.svm.unregister(pid, base) {
                    Ok(()) => Response::Ok,
                    Err(e) => err(e),
                },
                None => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
            },
            Request::Shutdown => match check_admin(&node, caller) {
                Ok(()) => {
                    send(&mut w, &Response::Ok).await?;
                    node.shutdown.notify_one();
                    return Ok(());
                }
                Err(e) => err(e),
            },
        };
        send(&mut w, &resp).await?;
    }
}

async fn import(
    node: &Arc<Node>,
    caller: Caller,
    r: &mut OwnedReadHalf,
    name: &str,
    size: u64,
    mode: u32,
    replace: bool,
) -> Response {
    let mut imp = match Importer::begin(node, caller, name, size, mode, replace).await {
        Ok(i) => i,
        Err(e) => return err(e),
    };
    loop {
        let req = match read_body(r).await {
            Ok(Some(body)) => match proto::import_data_range(&body) {
                Some(range) => {
                    // The common case: file bytes, taken straight from the frame.
                    if let Err(e) = imp.data(&body[range]).await {
                        imp.abort().await;
                        return err(e);
                    }
                    continue;
                }
                None => proto::decode::<Request>(&body).map(Some),
            },
            Ok(None) => Ok(None),
            Err(e) => Err(e),
        };
        match req {
            Ok(Some(Request::ImportData { data })) => {
                if let Err(e) = imp.data(&data).await {
                    imp.abort().await;
                    return err(e);
                }
            }
            Ok(Some(Request::ImportCommit)) => {
                return match imp.commit().await {
                    Ok(f) => Response::Files(vec![f]),
                    Err(e) => err(e),
                }
            }
            Ok(Some(other)) => {
                imp.abort().await;
                return err(OpError::new(
                    ErrorKind::Invalid,
                    format!("unexpected {other:?} during import"),
                ));
            }
            Ok(None) | Err(_) => {
                tracing::warn!(name, "client went away during import; nothing was committed");
                imp.abort().await;
                return err(OpError::new(ErrorKind::Invalid, "import interrupted"));
            }
        }
    }
}

/// The cluster as this node sees it.
pub fn status(node: &Node) -> ClusterStatus {
    let st = node.meta_state();
    let map = node.logical_map(&st);
    let coordinator = node.coordinator(&st).map(|c| c.1);
    let nodes = node
        .cfg
        .all()
        .map(|n| {
            let logical = map.iter().find(|(_, p)| **p == n.name).map(|(l, _)| *l);
            let is_spare_entry = node.cfg.spares.iter().any(|s| s.name == n.name);
            let hb = node.heartbeat_of(&n.name);
            let live_state = node.state_of(&n.name);
            let state = if logical.is_none() && !is_spare_entry {
                NodeState::Replaced
            } else {
                live_state.clone()
            };
            let up = live_state != NodeState::Down;
            NodeStatus {
                name: n.name.clone(),
                logical,
                addr: n.addr.to_string(),
                link_addr: n.link().map(|a| a.to_string()).unwrap_or_default(),
                spare: logical.is_none() && is_spare_entry,
                state,
                pid: hb.as_ref().filter(|_| up).map(|h| h.pid),
                incarnation: hb.as_ref().map_or(0, |h| h.incarnation),
                memory_used_bytes: hb.as_ref().map_or(0, |h| h.memory_used_bytes),
                memory_capacity_bytes: n.memory_mb * 1024 * 1024,
                disk_used_bytes: hb.as_ref().map_or(0, |h| h.disk_used_bytes),
                disk_free_bytes: hb.as_ref().map_or(0, |h| h.disk_free_bytes),
                coordinator: coordinator.as_deref() == Some(n.name.as_str()),
                // The metadata says whether a node is rebuilding; its heartbeat only how far along.
                rebuild: logical
                    .filter(|l| st.rebuilding.get(l).is_some_and(|r| r.physical == n.name))
                    .map(|_| hb.as_ref().and_then(|h| h.rebuild).unwrap_or((0, 0))),
            }
        })
        .collect();
    ClusterStatus {
        cluster: node.cfg.cluster.name.clone(),
        via: node.me.name.clone(),
        coordinator,
        meta_seq: st.seq,
        map_version: st.map_version,
        files: st.files.len() as u64,
        nodes,
    }
}

#[allow(dead_code)]
const _: () = assert!(MAX_FRAME > proto::CHUNK);

/// One round trip over the message link: a `LinkPing` out, its `LinkPong` back.
async fn link_ping(node: &Arc<Node>, peer: &str, payload: bytes::Bytes) -> Result<(), OpError> {
    let id = node.next_link_ping.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = tokio::sync::oneshot::channel();
    node.link_pings.locked().insert(id, tx);
    let len = payload.len();
    let r = match node.net.post(peer, &crate::peer::PeerReq::LinkPing { id }, payload) {
        Err(e) => Err(e.into()),
        Ok(()) => match tokio::time::timeout(node.request_timeout, rx).await {
            Ok(Ok(n)) if n == len => Ok(()),
            Ok(Ok(_)) => Err(OpError::new(
                ErrorKind::Internal,
                "link pong came back with another size",
            )),
            Ok(Err(_)) | Err(_) => Err(OpError::new(
                ErrorKind::Unavailable,
                format!(
                    "no link pong from {peer} within {} ms",
                    node.request_timeout.as_millis()
                ),
            )),
        },
    };
    node.link_pings.locked().remove(&id);
    r
}

#[cfg(test)]
mod tests {
    use super::write_pages;

    /// Takes at most `max` bytes per call, across the buffers it is given.
    struct Trickle {
        max: usize,
        got: Vec<u8>,
        calls: usize,
    }

    impl std::io::Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.write_vectored(&[std::io::IoSlice::new(buf)])
        }
        fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
            self.calls += 1;
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(self.max - n);
                self.got.extend_from_slice(&b[..take]);
                n += take;
            }
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn vectored_writes_survive_short_writes() {
        let pages: Vec<bytes::Bytes> = (0..2100u32)
            .map(|k| bytes::Bytes::from(vec![k as u8; if k % 7 == 0 { 0 } else { 1 + (k as usize * 37) % 300 }]))
            .collect();
        let want = pages.concat();
        for max in [13, 4095, 4096, 10_000, usize::MAX / 2] {
            let mut w = Trickle {
                max,
                got: Vec::new(),
                calls: 0,
            };
            write_pages(&mut w, &pages).unwrap();
            assert_eq!(w.got, want, "max {max}");
            // Every call makes progress; at most 1024 buffers per call.
            assert!(w.calls <= want.len().div_ceil(max.min(want.len())) + pages.len() / 1024 + 1);
        }
    }
}
