//! Sync channels: the short path for a rank's barrier and lock calls, off the tokio runtime.
//!
//! A client makes a `SOCK_SEQPACKET` socket pair and hands one end to its daemon
//! (`Request::SyncChannel`). On it each call is one datagram each way: a `Request` (`Barrier`,
//! `Lock` or `Unlock`) in, a `Response` out. One `psls-sync` thread per node waits on every
//! channel with epoll, starts each call ([`crate::sync::start`]: the arrival is posted to the
//! coordinator from this thread), and whichever thread learns the outcome (the link thread, on
//! the coordinator's notice) writes the answer straight into the channel. A barrier thus wakes
//! one daemon thread on the way in and none on the way out, where the runtime took two hand-offs
//! each way.
//!
//! The same thread also ends the waits whose coordinator went down ([`crate::sync::sweep`]),
//! for channel calls and runtime calls alike.
//!
//! Invariants and bounds: a channel belongs to the process that registered it (its pid and uid
//! come from the registering connection's credentials, never from the channel); at most
//! [`MAX_CHANNELS`] channels per node and [`MAX_CHANNELS_PER_PROCESS`] per process; one call
//! at a time per channel (a second one while the first waits is refused); a datagram longer
//! than [`psls_ipc::proto::MAX_SYNC_MSG`] or not a sync request gets an error answer and the
//! channel stays usable; a channel whose client end is closed is dropped.

use crate::failstop::Locked;
use crate::op::OpError;
use psls_ipc::proto::{self, Request, Response, MAX_SYNC_MSG};
use psls_ipc::ErrorKind;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Most sync channels registered on one node.
pub const MAX_CHANNELS: usize = 4096;
/// Most sync channels of one process (a session has one).
pub const MAX_CHANNELS_PER_PROCESS: usize = 16;
/// Events taken per `epoll_wait`.
const EVENTS_PER_WAIT: usize = 64;

/// One client's sync channel (the daemon's end).
pub struct Channel {
    fd: OwnedFd,
    pid: i32,
    uid: u32,
    /// The `psls run` job the process is a rank of, and which start of it (see
    /// [`crate::sync::scope`]).
    start: Option<(String, u32)>,
    /// A call is under way: its answer is still to be written.
    busy: AtomicBool,
}

impl crate::sync::ReplySink for Channel {
    fn answer(&self, r: Result<(), OpError>) {
        Channel::answer(self, r)
    }
}

impl Channel {
    /// Writes the answer to the call under way. Never blocks: the client waits for exactly
    /// this datagram, so the socket has room; if the client is gone, the answer is dropped.
    pub fn answer(&self, r: Result<(), OpError>) {
        // Cleared before the write: the client may send its next call as soon as it reads this.
        self.busy.store(false, Ordering::Release);
        self.send(r);
    }

    fn send(&self, r: Result<(), OpError>) {
        let resp = match r {
            Ok(()) => Response::Ok,
            Err(e) => Response::Error {
                kind: e.kind,
                message: e.message,
            },
        };
        let bytes = match proto::encode_datagram(&resp) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(pid = self.pid, error = %e, "sync answer could not be encoded");
                return;
            }
        };
        let flags = nix::sys::socket::MsgFlags::MSG_DONTWAIT | nix::sys::socket::MsgFlags::MSG_NOSIGNAL;
        if let Err(e) = nix::sys::socket::send(self.fd.as_raw_fd(), &bytes, flags) {
            tracing::debug!(pid = self.pid, error = %e, "sync answer not delivered (client gone?)");
        }
    }
}

/// The node's sync channels.
pub struct Channels {
    epoll: nix::sys::epoll::Epoll,
    map: Mutex<HashMap<u64, Arc<Channel>>>,
    next: AtomicU64,
}

impl Channels {
    pub fn new() -> std::io::Result<Channels> {
        let epoll = nix::sys::epoll::Epoll::new(nix::sys::epoll::EpollCreateFlags::EPOLL_CLOEXEC)?;
        Ok(Channels {
            epoll,
            map: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Channel>>> {
        self.map.locked()
    }

    /// Registers the channel end `fd` for process `pid` of user `uid` (a rank of `start`:
    /// job and start, if it is one).
    pub fn add(&self, fd: OwnedFd, pid: i32, uid: u32, start: Option<(String, u32)>) -> Result<(), OpError> {
        use nix::sys::socket::{getsockopt, sockopt, SockType};
        let invalid = |m: &str| OpError::new(ErrorKind::Invalid, m.to_string());
        match getsockopt(&fd, sockopt::SockType) {
            Ok(SockType::SeqPacket) => {}
            _ => return Err(invalid("a sync channel must be a SOCK_SEQPACKET socket")),
        }
        let flags = nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_GETFL)
            .map_err(|e| OpError::new(ErrorKind::Internal, format!("sync channel flags: {e}")))?;
        let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(flags))
            .map_err(|e| OpError::new(ErrorKind::Internal, format!("sync channel flags: {e}")))?;
        let mut map = self.lock();
        if map.len() >= MAX_CHANNELS {
            return Err(OpError::new(
                ErrorKind::Unavailable,
                format!("this node already serves {MAX_CHANNELS} sync channels"),
            ));
        }
        if map.values().filter(|c| c.pid == pid).count() >= MAX_CHANNELS_PER_PROCESS {
            return Err(OpError::new(
                ErrorKind::Unavailable,
                format!("this process already has {MAX_CHANNELS_PER_PROCESS} sync channels"),
            ));
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        use nix::sys::epoll::{EpollEvent, EpollFlags};
        let ev = EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP, id);
        self.epoll
            .add(fd.as_fd(), ev)
            .map_err(|e| OpError::new(ErrorKind::Internal, format!("watching a sync channel: {e}")))?;
        map.insert(
            id,
            Arc::new(Channel {
                fd,
                pid,
                uid,
                start,
                busy: AtomicBool::new(false),
            }),
        );
        Ok(())
    }

    /// Channels registered now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn remove(&self, id: u64) {
        if let Some(ch) = self.lock().remove(&id) {
            let _ = self.epoll.delete(ch.fd.as_fd());
        }
    }

    /// The `psls-sync` thread: serves the channels' calls and sweeps waits whose coordinator
    /// changed, every heartbeat interval at most. Runs until the process ends.
    pub fn run(&self, sync: &Arc<crate::sync::SyncShell>) {
        let node = &sync.node;
        use nix::sys::epoll::{EpollEvent, EpollFlags};
        let sweep_ms = node.cfg.cluster.heartbeat_interval_ms.clamp(10, u16::MAX as u64) as u16;
        let mut events = [EpollEvent::empty(); EVENTS_PER_WAIT];
        let mut buf = vec![0u8; MAX_SYNC_MSG + 1];
        let mut last_sweep = std::time::Instant::now();
        loop {
            let n = match self.epoll.wait(&mut events, sweep_ms) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => 0,
                Err(e) => {
                    tracing::error!(node = %node.name(), error = %e, "waiting on sync channels failed");
                    std::thread::sleep(std::time::Duration::from_millis(sweep_ms as u64));
                    0
                }
            };
            for ev in &events[..n] {
                let id = ev.data();
                let Some(ch) = self.lock().get(&id).cloned() else {
                    continue;
                };
                if ev.events().contains(EpollFlags::EPOLLIN) {
                    // Every datagram waiting, bounded: a channel has one call at a time.
                    for _ in 0..EVENTS_PER_WAIT {
                        match self.take(sync, &ch, &mut buf) {
                            Ok(true) => {}
                            Ok(false) => break,
                            Err(()) => {
                                self.remove(id);
                                break;
                            }
                        }
                    }
                } else if ev
                    .events()
                    .intersects(EpollFlags::EPOLLRDHUP | EpollFlags::EPOLLHUP | EpollFlags::EPOLLERR)
                {
                    self.remove(id);
                }
            }
            if last_sweep.elapsed().as_millis() as u64 >= sweep_ms as u64 {
                last_sweep = std::time::Instant::now();
                crate::sync::sweep(sync);
            }
        }
    }

    /// Reads and starts one call from `ch`: `Ok(true)` if one was there, `Ok(false)` if none
    /// is, `Err` if the channel is closed.
    fn take(&self, sync: &Arc<crate::sync::SyncShell>, ch: &Arc<Channel>, buf: &mut [u8]) -> Result<bool, ()> {
        let node = &sync.node;
        use nix::sys::socket::{recv, MsgFlags};
        let n = match recv(ch.fd.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC) {
            Ok(0) => return Err(()),
            Ok(n) => n,
            Err(nix::errno::Errno::EAGAIN) => return Ok(false),
            Err(nix::errno::Errno::EINTR) => return Ok(true),
            Err(e) => {
                tracing::debug!(node = %node.name(), pid = ch.pid, error = %e, "sync channel read failed");
                return Err(());
            }
        };
        let refuse = |m: String| ch.answer(Err(OpError::new(ErrorKind::Invalid, m)));
        if ch.busy.swap(true, Ordering::AcqRel) {
            // Refused; the call under way still gets its own answer (and clears `busy`).
            ch.send(Err(OpError::new(
                ErrorKind::Invalid,
                "one call at a time on a sync channel",
            )));
            return Ok(true);
        }
        if n > MAX_SYNC_MSG {
            refuse(format!("sync request of {n} bytes exceeds the limit of {MAX_SYNC_MSG}"));
            return Ok(true);
        }
        let req = match proto::decode::<Request>(&buf[..n]) {
            Ok(r) => r,
            Err(e) => {
                refuse(format!("bad sync request: {e}"));
                return Ok(true);
            }
        };
        let who = crate::sync::who(node, ch.pid);
        let peer_req = match req {
            Request::Barrier { job, name, count } => crate::peer::PeerReq::BarrierArrive {
                key: crate::sync::key(ch.uid, &crate::sync::scope(&job, &ch.start), &name),
                count,
                who,
                call: 0,
            },
            Request::Lock { job, id } => crate::peer::PeerReq::LockAcquire {
                key: crate::sync::key(ch.uid, &crate::sync::scope(&job, &ch.start), &id.to_string()),
                who,
                call: 0,
            },
            Request::Unlock { job, id } => crate::peer::PeerReq::LockRelease {
                key: crate::sync::key(ch.uid, &crate::sync::scope(&job, &ch.start), &id.to_string()),
                who,
                call: 0,
            },
            _ => {
                refuse("only Barrier, Lock and Unlock go on a sync channel".into());
                return Ok(true);
            }
        };
        crate::sync::start(sync, peer_req, crate::sync::Replier::Sink(ch.clone()));
        Ok(true)
    }
}
