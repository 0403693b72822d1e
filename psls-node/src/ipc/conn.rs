//! A client connection and its framing: requests read with the descriptors passed alongside,
//! answers written (with a descriptor, or raw data), every frame bounded; and what a handler
//! tells the connection to do next ([`Flow`]).

use crate::dispatch::Daemon;
use crate::op::OpError;
use crate::pfs::Caller;
use psls_ipc::proto::{self, Request, Response, MAX_FRAME};
use psls_ipc::ErrorKind;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// One client connection.
pub(crate) struct Conn {
    pub(super) d: Arc<Daemon>,
    pub(super) caller: Caller,
    pub(super) pid: Option<i32>,
    /// Files this connection was allowed to map, and whether writable.
    pub(super) granted: std::collections::HashMap<u64, bool>,
    /// This connection's number (unique in this daemon's run).
    pub(super) id: u64,
    /// The safe-point calls made on it so far.
    pub(super) safe_calls: u64,
    pub(super) r: OwnedReadHalf,
    pub(super) w: OwnedWriteHalf,
}

/// What a handler did with a request.
pub(crate) enum Flow {
    /// Send this answer, then read the next request.
    Reply(Response),
    /// The handler answered itself; read the next request.
    Sent,
    /// Close the connection.
    Close,
    /// The connection becomes the process's lifeline.
    Lifeline(i32),
    /// The connection follows a job until its end (`after`: per rank, the last output number
    /// the client has; `since`: the first start followed, an end of an earlier one is stale;
    /// `known`: the start the client followed last, whose restarts since it is told of).
    Follow {
        job: String,
        after: std::collections::BTreeMap<u32, u64>,
        since: u32,
        known: Option<u32>,
    },
}

/// A request routed to a handler not of its area (a bug in the routing, answered as one).
pub(super) fn misrouted(req: &Request) -> Response {
    err(OpError::new(
        ErrorKind::Internal,
        format!("request {:?} reached the wrong handler", std::mem::discriminant(req)),
    ))
}

/// Reads one frame body; `None` at a clean end of the connection.
pub(super) async fn read_body(r: &mut OwnedReadHalf) -> Result<Option<Vec<u8>>, proto::FrameError> {
    let mut prefix = [0u8; 4];
    match r.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = proto::check_len(prefix)?;
    Ok(Some(read_frame_body(r, len).await?))
}

/// Memory given to a frame's body before its bytes arrive: a client that announces a large
/// frame and sends nothing holds no more than this.
const BODY_PREALLOC_BYTES: usize = 64 * 1024;
/// Once a frame's length is read, its body must arrive within this long (a client idle
/// between frames is fine: lifelines and jobs are; one stalled inside a frame is not).
pub(super) const BODY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads a frame body of `len` bytes (checked against `MAX_FRAME` already) within
/// [`BODY_DEADLINE`], growing the buffer as bytes come.
async fn read_frame_body(r: &mut OwnedReadHalf, len: usize) -> Result<Vec<u8>, proto::FrameError> {
    let mut body = Vec::with_capacity(len.min(BODY_PREALLOC_BYTES));
    match tokio::time::timeout(BODY_DEADLINE, r.take(len as u64).read_to_end(&mut body)).await {
        Ok(read) => {
            read?;
        }
        Err(_) => {
            return Err(proto::FrameError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "a frame's {len} bytes did not arrive within {} s",
                    BODY_DEADLINE.as_secs()
                ),
            )))
        }
    }
    if body.len() != len {
        return Err(proto::FrameError::Closed);
    }
    Ok(body)
}

/// Reads one request, with any file descriptors attached to its first bytes (they are closed
/// when dropped unless a handler takes them). `None` at a clean end of the connection.
pub(super) async fn read_req_with_fds(
    r: &mut OwnedReadHalf,
) -> Result<Option<(Request, Vec<OwnedFd>)>, proto::FrameError> {
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
    let body = read_frame_body(r, len).await?;
    Ok(Some((proto::decode(&body)?, fds)))
}

/// At most this many descriptors are taken from one message; the kernel closes any beyond.
pub(super) const MAX_FDS: usize = 4;

#[derive(Clone, Copy, PartialEq)]
pub(super) enum Access {
    Read,
    Write,
}

/// The single descriptor a request must carry, checked: a regular file, pipe or character
/// device, open for the access the request needs.
pub(super) fn one_fd(fds: &mut Vec<OwnedFd>, need: Access) -> Result<std::fs::File, OpError> {
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

/// Sends `resp` with `fd` attached (SCM_RIGHTS) to the frame's first bytes.
pub(super) async fn send_with_fd(
    w: &mut OwnedWriteHalf,
    resp: &Response,
    fd: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<()> {
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

/// Sends `Response::Data(data)` without copying `data` into a frame buffer.
pub(super) async fn send_data(w: &mut OwnedWriteHalf, data: &[u8]) -> std::io::Result<()> {
    let header = proto::data_frame_header(data.len()).map_err(|e| std::io::Error::other(e.to_string()))?;
    w.write_all(&header).await?;
    w.write_all(data).await
}

pub(super) async fn send(w: &mut OwnedWriteHalf, resp: &Response) -> std::io::Result<()> {
    let bytes = proto::encode(resp).map_err(|e| std::io::Error::other(e.to_string()))?;
    w.write_all(&bytes).await
}

pub(super) fn ok_or_err(r: Result<(), OpError>) -> Response {
    match r {
        Ok(()) => Response::Ok,
        Err(e) => err(e),
    }
}

pub(super) fn err(e: OpError) -> Response {
    Response::Error {
        kind: e.kind,
        message: e.message,
    }
}

#[allow(dead_code)]
const _: () = assert!(MAX_FRAME > proto::CHUNK);
