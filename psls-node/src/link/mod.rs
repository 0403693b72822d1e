//! The message link: one-way messages between nodes (the coherence protocol's, barriers',
//! locks', the metadata log's, checkpoints' control), over TCP with TLS 1.3 (rustls), driven
//! from one OS thread per node and from the threads that post.
//!
//! Why TCP and not QUIC (as `DESIGN.md` chose for every transport): these messages are small
//! and on the critical path of page faults and barriers, and the kernel's TCP costs a few µs of
//! CPU per message where QUIC in user space cost 27–45 µs on this machine (its packets, acks,
//! timers and congestion control are computed per message in the process). Ordering, loss
//! recovery and flow control come from the kernel; TLS keeps the security model (cluster
//! certificates both ways, the peer's name read from its certificate). Requests that wait for
//! an answer and bulk transfers stay on QUIC ([`crate::transport`]).
//!
//! Connections: one per node pair, carrying both directions, so that the kernel's
//! acknowledgements ride on messages going back (an answer, a release) instead of costing a
//! segment of their own. A node with nothing to send on yet dials the peer; the peer, once the
//! handshake named the dialler, *adopts* that connection and sends on it too, unless it dialled
//! one of its own meanwhile (then each direction keeps its own connection, both are read, and
//! the peer's is sent on once this node's own is lost, rather than dialling again). A node
//! sends on one connection per peer until it is lost, so messages to a peer stay in order.
//! News that a peer restarted drops a connection this node dialled, and one adopted from the
//! peer only if its frames came from an older incarnation. Whoever posts encrypts and writes to the socket itself (the peer's mutex held); the
//! link thread reads every connection (a peer's under its mutex), drives handshakes and writes
//! what a full socket buffer left behind. A connection whose certificate names no node of the
//! cluster is closed before anything it sent is read. Messages are frames
//! (`u32` little-endian length, then a [`peer`] header and payload) of at most
//! [`MAX_PEER_MSG`] bytes; a longer one closes the connection. Delivery is in order and at most
//! once: messages queued on a connection that is lost are dropped (the protocols learn of dead
//! peers from membership).
//!
//! Batching: messages posted by the link thread's own handlers are only queued, and written
//! together (one TLS record and one `writev` per peer) once the handlers of a wake-up have run.
//!
//! Invariants: every queue, connection count and read has a bound; the handler runs on the
//! link thread with no lock held, so a handler may post; a peer's outgoing state is behind its
//! own mutex, never held across another peer's.

use crate::failstop::Locked;
use crate::peer::NetError;
use crate::peer::{self, PeerReq, MAX_PEER_MSG};
use bytes::{Buf, Bytes, BytesMut};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What receives the link's messages.
pub trait LinkHandler: Send + Sync + 'static {
    /// A message from node `from` (the name in its certificate). Runs on the link thread:
    /// must not block (it may post).
    fn deliver(&self, from: &str, req: PeerReq, payload: Bytes);
    /// Every message of this wake-up was delivered (their posts are still written together).
    fn delivered(&self) {}
}

/// Chunks (a message is one or two) queued for one peer, at most.
const QUEUE_CHUNKS: usize = 1 << 17;
/// Bytes queued for one peer, at most: a full queue means the peer has not taken anything for
/// a long time; the message is refused rather than memory growing.
const QUEUE_BYTES: usize = 256 << 20;
/// Plaintext handed to TLS at once, at most (then it is written out before more is taken).
const FEED_BYTES: usize = 256 << 10;
/// Bytes read from one incoming connection per wake-up, at most (then the others get their
/// turn; the connection stays readable and is read again at the next wake-up).
const READ_BUDGET_BYTES: usize = 4 << 20;
/// Events taken per `epoll_wait`.
const EVENTS_PER_WAIT: usize = 64;
/// Unacknowledged data older than this fails an outgoing connection (`TCP_USER_TIMEOUT`): a
/// peer that went away without a word is not written to for ever.
const USER_TIMEOUT: Duration = Duration::from_secs(10);
/// Socket buffers asked for (the kernel caps them at net.core.[rw]mem_max).
const SOCKET_BUFFER_BYTES: usize = 4 << 20;

/// epoll tokens: the kind in the top byte, a generation and an index below.
const TOKEN_LISTENER: u64 = 1 << 56;
const TOKEN_WAKE: u64 = 2 << 56;
const TOKEN_OUT: u64 = 3 << 56;
const TOKEN_IN: u64 = 4 << 56;
const KIND_MASK: u64 = 0xff << 56;

fn token(kind: u64, generation: u32, index: usize) -> u64 {
    kind | (u64::from(generation & 0xff_ffff) << 32) | (index as u64 & 0xffff_ffff)
}

fn untoken(t: u64) -> (u64, u32, usize) {
    (
        t & KIND_MASK,
        ((t >> 32) & 0xff_ffff) as u32,
        (t & 0xffff_ffff) as usize,
    )
}

thread_local! {
    /// On a link thread while its handlers run: that link (by address) and the peers it
    /// queued messages for, to be written when the handlers are done.
    static CORK: RefCell<Option<(usize, Vec<usize>)>> = const { RefCell::new(None) };
}

/// The connection this node sends on to one peer (dialled here, or adopted from the peer),
/// and reads the peer's messages from.
struct Conn {
    sock: TcpStream,
    tls: rustls::Connection,
    /// Chunks not yet handed to TLS, and their bytes.
    queue: VecDeque<Bytes>,
    queued_bytes: usize,
    /// What was read and not yet delivered, and who sends (known from the start: its
    /// certificate must name the peer).
    rx: Rx,
    /// Dialled by this node (else adopted: the peer dialled it).
    dialled: bool,
    /// In its epoll token.
    generation: u32,
}

/// The receiving side of a connection.
#[derive(Default)]
struct Rx {
    /// The start of a frame not yet whole.
    buf: BytesMut,
    /// The node at the other end, once its certificate named it.
    peer: Option<String>,
    /// The latest incarnation its frames carried (a connection adopted from an incarnation
    /// that restarted since is dropped: [`Link::drop_peer`]).
    incarnation: Option<u64>,
}

struct Peer {
    name: String,
    addr: SocketAddr,
    out: Mutex<Out>,
    /// Messages and bytes (frames, with their length prefix) sent to it and received from it.
    counts: LinkCounts,
}

/// A peer's message counts ([`Link::counts`]).
#[derive(Debug, Default)]
pub struct LinkCounts {
    pub sent_messages: AtomicU64,
    pub sent_bytes: AtomicU64,
    pub received_messages: AtomicU64,
    pub received_bytes: AtomicU64,
}

#[derive(Default)]
struct Out {
    /// The connection this node sends on.
    conn: Option<Conn>,
    /// A connection the peer dialled while this node sent on one it dialled itself: read, and
    /// sent on once that one is lost (rather than dialling again).
    spare: Option<Conn>,
    /// Bumped for every connection that comes here (dialled or adopted), within 24 bits:
    /// events of a connection no longer here are ignored.
    generation: u32,
    /// After dials that failed before their handshake ended: no new dial before this time,
    /// and how many failed in a row (a jittered, doubling wait, as the request transport's;
    /// cleared when the peer is heard or a connection to it worked).
    backoff: Option<(Instant, u32)>,
}

impl Out {
    /// A generation for a new connection of this peer.
    fn next_generation(&mut self) -> u32 {
        self.generation = self.generation.wrapping_add(1) & 0xff_ffff;
        self.generation
    }
}

/// A connection a peer dialled, owned by the link thread until its handshake names the peer
/// (then it goes to the peer's side: [`Link::adopt`]).
struct Incoming {
    sock: TcpStream,
    tls: rustls::Connection,
    /// What was read: nothing is cut into messages before the handshake named a node.
    rx: Rx,
    generation: u32,
    /// Accepted as the `seq`th connection (the oldest is evicted first when full).
    seq: u64,
    /// Registered for writability (the handshake's answer did not fit the socket).
    want_out: bool,
    /// Its slot in the link thread's table (in its epoll token).
    slot: usize,
    /// Offered for adoption once authenticated (kept receive-only if it was not taken).
    offered: bool,
}

pub struct Link {
    listener: TcpListener,
    epoll: OwnedFd,
    /// eventfd: wakes the link thread.
    wake: OwnedFd,
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    peers: Vec<Peer>,
    index: HashMap<String, usize>,
    known: Vec<String>,
    stop: AtomicBool,
    posted: AtomicU64,
    writes: AtomicU64,
    /// This node's incarnation on every frame, and the test of incoming ones.
    stamp: Arc<peer::Stamp>,
}

impl Link {
    /// Binds the link's TCP address. `peers`: every other node's link address; `known`: every
    /// node name of the cluster (incoming connections must be from one of them).
    pub fn bind(
        addr: SocketAddr,
        server: Arc<rustls::ServerConfig>,
        client: Arc<rustls::ClientConfig>,
        peers: HashMap<String, SocketAddr>,
        known: Vec<String>,
    ) -> std::io::Result<Link> {
        // std's listener sets SO_REUSEADDR: a restarted node binds its port again at once.
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        // SAFETY: epoll_create1 takes no pointers; the descriptor is checked and then owned.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `ep` is a fresh descriptor nobody else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        // SAFETY: eventfd(2) takes no pointers; the descriptor is checked and then owned.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        epoll_add(
            epoll.as_raw_fd(),
            listener.as_raw_fd(),
            libc::EPOLLIN as u32,
            TOKEN_LISTENER,
        )?;
        epoll_add(epoll.as_raw_fd(), wake.as_raw_fd(), libc::EPOLLIN as u32, TOKEN_WAKE)?;
        let mut list: Vec<(String, SocketAddr)> = peers.into_iter().collect();
        list.sort();
        let index = list.iter().enumerate().map(|(k, (n, _))| (n.clone(), k)).collect();
        let peers = list
            .into_iter()
            .map(|(name, addr)| Peer {
                name,
                addr,
                out: Mutex::new(Out::default()),
                counts: LinkCounts::default(),
            })
            .collect();
        Ok(Link {
            listener,
            epoll,
            wake,
            server,
            client,
            peers,
            index,
            known,
            stop: AtomicBool::new(false),
            posted: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            stamp: Arc::new(peer::Stamp::default()),
        })
    }

    /// The link of node `me` with the certificates in `certs` (benchmarks and tests).
    pub fn for_node(
        certs: &std::path::Path,
        me: &str,
        addr: SocketAddr,
        peers: HashMap<String, SocketAddr>,
        known: Vec<String>,
    ) -> anyhow::Result<Link> {
        let (s, c) = crate::tls::link_configs(certs, me)?;
        Ok(Link::bind(addr, s, c, peers, known)?)
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The same link stamping and testing incarnations with `stamp` (shared with the request
    /// transport).
    pub fn stamped(mut self, stamp: Arc<peer::Stamp>) -> Link {
        self.stamp = stamp;
        self
    }

    /// Messages posted since start.
    pub fn posted(&self) -> u64 {
        self.posted.load(Ordering::Relaxed)
    }

    /// Every peer's message counts since start.
    pub fn counts(&self) -> impl Iterator<Item = (&str, &LinkCounts)> {
        self.peers.iter().map(|p| (p.name.as_str(), &p.counts))
    }

    /// Socket writes since start (messages, several at once where they were batched, and
    /// handshakes).
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Queues `req` with `payload` for `peer` and writes what the connection allows at once.
    /// Returns without waiting for anything.
    pub fn post(&self, peer: &str, req: &PeerReq, payload: Bytes) -> Result<(), NetError> {
        let Some(&k) = self.index.get(peer) else {
            return Err(NetError::UnknownPeer(peer.into()));
        };
        let header = peer::encode_request(self.stamp.incarnation(), req);
        let len = header.len() + payload.len();
        if len > MAX_PEER_MSG {
            return Err(NetError::BadResponse {
                peer: peer.into(),
                message: format!("one-way message of {len} bytes exceeds {MAX_PEER_MSG}"),
            });
        }
        let mut head = Vec::with_capacity(4 + header.len());
        head.extend_from_slice(&(len as u32).to_le_bytes());
        head.extend_from_slice(&header);
        let c = &self.peers[k].counts;
        c.sent_messages.fetch_add(1, Ordering::Relaxed);
        c.sent_bytes.fetch_add(4 + len as u64, Ordering::Relaxed);
        self.enqueue(k, head.into(), payload)
    }

    /// Queues bytes for `peer` as they are (tests: malformed frames).
    #[cfg(test)]
    fn post_raw(&self, peer: &str, bytes: Bytes) -> Result<(), NetError> {
        let k = self.index[peer];
        self.enqueue(k, bytes, Bytes::new())
    }

    /// Queues one frame (`head`, then `payload`) on the connection to peer `k`, dialling it if
    /// needed, and writes what the socket takes (unless the link thread's handlers are
    /// running: then when they are done).
    fn enqueue(&self, k: usize, head: Bytes, payload: Bytes) -> Result<(), NetError> {
        let p = &self.peers[k];
        let mut out = p.out.locked();
        if out.conn.is_none() {
            out.conn = out.spare.take();
        }
        if out.conn.is_none() {
            if let Some((until, failures)) = out.backoff {
                let now = Instant::now();
                if now < until {
                    return Err(NetError::Unreachable {
                        peer: p.name.clone(),
                        message: format!(
                            "{failures} dials failed in a row: no new one for {:?}",
                            until.saturating_duration_since(now)
                        ),
                    });
                }
            }
            let generation = out.next_generation();
            let conn = self.dial(k, generation).map_err(|e| NetError::Unreachable {
                peer: p.name.clone(),
                message: e.to_string(),
            })?;
            out.conn = Some(conn);
        }
        let c = out.conn.as_mut().expect("dialled above");
        let len = head.len() + payload.len();
        if c.queue.len() + 2 > QUEUE_CHUNKS || c.queued_bytes + len > QUEUE_BYTES {
            return Err(NetError::Unreachable {
                peer: p.name.clone(),
                message: format!("{} bytes already queued", c.queued_bytes),
            });
        }
        c.queue.push_back(head);
        if !payload.is_empty() {
            c.queue.push_back(payload);
        }
        c.queued_bytes += len;
        self.posted.fetch_add(1, Ordering::Relaxed);
        let me = self as *const Link as usize;
        let corked = CORK.with(|cork| match cork.borrow_mut().as_mut() {
            Some((link, dirty)) if *link == me => {
                if !dirty.contains(&k) {
                    dirty.push(k);
                }
                true
            }
            _ => false,
        });
        if !corked {
            self.flush_locked(p, &mut out);
        }
        Ok(())
    }

    /// Dials peer `k` (without waiting for the connection) and registers it with the link
    /// thread.
    fn dial(&self, k: usize, generation: u32) -> std::io::Result<Conn> {
        let p = &self.peers[k];
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(p.addr),
            socket2::Type::STREAM.nonblocking().cloexec(),
            Some(socket2::Protocol::TCP),
        )?;
        sock.set_tcp_nodelay(true)?;
        sock.set_tcp_user_timeout(Some(USER_TIMEOUT))?;
        // A peer host that is off answers nothing: give up on the connection after about 15 s
        // (SYNs at 0, 1, 3, 7 s) rather than the kernel's two minutes.
        set_int_option(&sock, libc::IPPROTO_TCP, libc::TCP_SYNCNT, 3)?;
        let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
        match sock.connect(&p.addr.into()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => return Err(e),
        }
        let name = rustls_pki_types::ServerName::try_from(crate::tls::server_name(&p.name))
            .map_err(|e| std::io::Error::other(format!("server name: {e}")))?;
        let mut tls = rustls::ClientConnection::new(self.client.clone(), name).map_err(std::io::Error::other)?;
        // Bounded by the queue: TLS is handed at most FEED_BYTES at a time.
        tls.set_buffer_limit(None);
        let sock: TcpStream = sock.into();
        let events = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32;
        epoll_add(
            self.epoll.as_raw_fd(),
            sock.as_raw_fd(),
            events,
            token(TOKEN_OUT, generation, k),
        )?;
        tracing::debug!(peer = %p.name, addr = %p.addr, "message link: dialling");
        Ok(Conn {
            sock,
            tls: rustls::Connection::Client(tls),
            queue: VecDeque::new(),
            queued_bytes: 0,
            rx: Rx {
                peer: Some(p.name.clone()),
                ..Rx::default()
            },
            dialled: true,
            generation,
        })
    }

    /// Writes what peer `p`'s connection has (`out` is its locked state); a connection that
    /// fails is dropped with what it held.
    fn flush_locked(&self, p: &Peer, out: &mut Out) {
        let Some(c) = out.conn.as_mut() else { return };
        if let Err(e) = flush(c, &self.writes) {
            lost(p, out, &e.to_string());
        }
    }

    /// `peer` was heard (through the request transport): a dial to it may go at once.
    pub fn heard_from(&self, peer: &str) {
        if let Some(&k) = self.index.get(peer) {
            self.peers[k].out.locked().backoff = None;
        }
    }

    /// `peer` restarted as `incarnation`: forgets the connection this node sends to it on,
    /// if it may lead to the previous incarnation (messages still queued were for it); the
    /// next message dials afresh. A connection this node dialled goes; one adopted from the
    /// peer goes only if its frames came from an older incarnation: one the new incarnation
    /// dialled (before its heartbeat told of it) carries its messages, which must not be lost.
    pub fn drop_peer(&self, peer: &str, incarnation: u64) {
        if let Some(&k) = self.index.get(peer) {
            let mut out = self.peers[k].out.locked();
            let stale = |c: &Conn| c.dialled || c.rx.incarnation.is_some_and(|i| i < incarnation);
            if out.conn.as_ref().is_some_and(stale) {
                out.conn = None;
            }
            if out.spare.as_ref().is_some_and(stale) {
                out.spare = None;
            }
        }
    }

    /// Closes every connection and ends the link thread.
    pub fn close(&self) {
        self.stop.store(true, Ordering::Release);
        for p in &self.peers {
            let mut out = p.out.locked();
            out.conn = None;
            out.spare = None;
        }
        self.wake();
    }

    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd. A full counter (EAGAIN)
        // already means "awake".
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// The link thread: until [`Link::close`], accepts and reads connections, finishes what
    /// full sockets left, and delivers messages to `handler`.
    pub fn run(self: Arc<Self>, handler: Arc<dyn LinkHandler>) {
        let mut incoming: Vec<Option<Incoming>> = Vec::new();
        let max_incoming = 4 * self.known.len() + 8;
        let mut next_seq = 0u64;
        let mut inbox: Vec<(String, PeerReq, Bytes, usize)> = Vec::new();
        // SAFETY: epoll_event is plain data; all zeros is a valid value.
        let mut events: [libc::epoll_event; EVENTS_PER_WAIT] = unsafe { std::mem::zeroed() };
        let mut scratch = vec![0u8; 64 << 10];
        let mut rbuf = vec![0u8; 256 << 10];
        let me = Arc::as_ptr(&self) as usize;
        // Connections whose read stopped at its budget: read again after the next wait.
        let mut again: Vec<u64> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            let retry = std::mem::take(&mut again);
            let timeout_ms = if retry.is_empty() { -1 } else { 0 };
            // SAFETY: a live array of EVENTS_PER_WAIT events.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    EVENTS_PER_WAIT as i32,
                    timeout_ms,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::warn!(error = %e, "message link: epoll_wait failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
                again = retry;
                continue;
            }
            let mut cx = ReadCtx {
                known: &self.known,
                stamp: &self.stamp,
                rbuf: &mut rbuf,
                scratch: &mut scratch,
                inbox: &mut inbox,
            };
            let ready = events
                .iter()
                .take(n.max(0) as usize)
                .map(|ev| (ev.events, ev.u64))
                .chain(retry.into_iter().map(|t| (libc::EPOLLIN as u32, t)));
            for (bits, data) in ready {
                let (kind, generation, k) = untoken(data);
                match kind {
                    TOKEN_WAKE => {
                        let mut v = [0u8; 8];
                        // SAFETY: reads 8 bytes into a live buffer from our eventfd (resets it).
                        unsafe { libc::read(self.wake.as_raw_fd(), v.as_mut_ptr().cast(), v.len()) };
                    }
                    TOKEN_LISTENER => self.accept(&mut incoming, max_incoming, &mut next_seq),
                    TOKEN_OUT => self.on_conn(k, generation, bits, &mut cx, &mut again),
                    TOKEN_IN => {
                        let (keep, offer) = match incoming.get_mut(k).and_then(Option::as_mut) {
                            Some(c) if c.generation == generation => {
                                let keep = self.on_incoming(c, bits, &mut cx);
                                let offer = keep && c.rx.peer.is_some() && !c.offered;
                                c.offered |= offer;
                                (keep, offer)
                            }
                            _ => (true, false),
                        };
                        if !keep {
                            incoming[k] = None;
                        } else if offer {
                            self.adopt(&mut incoming, k);
                        }
                    }
                    _ => {}
                }
            }
            if inbox.is_empty() {
                continue;
            }
            // The handlers' posts are queued and written together afterwards.
            CORK.with(|cork| *cork.borrow_mut() = Some((me, Vec::new())));
            for (from, req, payload, bytes) in inbox.drain(..) {
                if let Some(&k) = self.index.get(&from) {
                    let c = &self.peers[k].counts;
                    c.received_messages.fetch_add(1, Ordering::Relaxed);
                    c.received_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
                }
                handler.deliver(&from, req, payload);
            }
            handler.delivered();
            let dirty = CORK
                .with(|cork| cork.borrow_mut().take())
                .map(|(_, d)| d)
                .unwrap_or_default();
            for k in dirty {
                let p = &self.peers[k];
                self.flush_locked(p, &mut p.out.locked());
            }
        }
    }

    /// Accepts what the listener holds, within the bound on incoming connections.
    fn accept(&self, incoming: &mut Vec<Option<Incoming>>, max: usize, next_seq: &mut u64) {
        for _ in 0..max {
            let (sock, from) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors, say: the connection waits in the backlog.
                    tracing::warn!(error = %e, "message link: accept failed");
                    return;
                }
            };
            let live = incoming.iter().filter(|c| c.is_some()).count();
            if live >= max && !evict(incoming) {
                tracing::warn!(%from, max, "message link: refused a connection, too many open");
                continue;
            }
            let tls = match rustls::ServerConnection::new(self.server.clone()) {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(%from, error = %e, "message link: refused a connection");
                    continue;
                }
            };
            // Keep-alives: the connection of a peer whose host went away without a word ends
            // after about 10 s instead of holding its slot.
            let keepalive = socket2::TcpKeepalive::new()
                .with_time(Duration::from_secs(5))
                .with_interval(Duration::from_secs(1))
                .with_retries(5);
            if sock.set_nonblocking(true).is_err()
                || sock.set_nodelay(true).is_err()
                || socket2::SockRef::from(&sock).set_tcp_keepalive(&keepalive).is_err()
            {
                continue;
            }
            let slot = match incoming.iter().position(Option::is_none) {
                Some(s) => s,
                None => {
                    incoming.push(None);
                    incoming.len() - 1
                }
            };
            let generation = (*next_seq & 0xff_ffff) as u32;
            if let Err(e) = epoll_add(
                self.epoll.as_raw_fd(),
                sock.as_raw_fd(),
                libc::EPOLLIN as u32,
                token(TOKEN_IN, generation, slot),
            ) {
                tracing::warn!(%from, error = %e, "message link: refused a connection");
                continue;
            }
            incoming[slot] = Some(Incoming {
                sock,
                tls: rustls::Connection::Server(tls),
                rx: Rx::default(),
                generation,
                seq: *next_seq,
                want_out: false,
                slot,
                offered: false,
            });
            *next_seq += 1;
        }
    }

    /// Handles readiness of the connection this node sends on to peer `k`: the peer's
    /// messages (into `cx.inbox`), the handshake's answers, what a full socket left, the end
    /// of the connection. A read cut short by its budget is asked again through `again`
    /// (the connection is edge-triggered).
    fn on_conn(&self, k: usize, generation: u32, bits: u32, cx: &mut ReadCtx<'_>, again: &mut Vec<u64>) {
        let Some(p) = self.peers.get(k) else { return };
        let mut out = p.out.locked();
        let sending = out.conn.as_ref().is_some_and(|c| c.generation == generation);
        let c = if sending {
            out.conn.as_mut()
        } else {
            out.spare.as_mut().filter(|c| c.generation == generation)
        };
        let Some(c) = c else { return };
        let res = (|| -> Result<ReadEnd, String> {
            let end = read_frames(&c.sock, &mut c.tls, &mut c.rx, cx)
                .map_err(|()| "failed or refused (logged)".to_string())?;
            if end == ReadEnd::Eof {
                return Err("closed by the peer".into());
            }
            if bits & (libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0 {
                return Err(socket_error(&c.sock));
            }
            flush(c, &self.writes).map_err(|e| e.to_string())?;
            Ok(end)
        })();
        match res {
            Ok(ReadEnd::Budget) => again.push(token(TOKEN_OUT, generation, k)),
            Ok(_) => {}
            Err(e) if sending => lost(p, &mut out, &e),
            Err(e) => {
                tracing::debug!(peer = %p.name, error = %e, "message link: spare connection lost");
                out.spare = None;
            }
        }
    }

    /// Handles readiness of a connection a peer dialled that this node does not send on;
    /// whole messages go to `cx.inbox`. False: the connection is done with (closed by the
    /// peer, failed, or refused).
    fn on_incoming(&self, c: &mut Incoming, bits: u32, cx: &mut ReadCtx<'_>) -> bool {
        let Ok(end) = read_frames(&c.sock, &mut c.tls, &mut c.rx, cx) else {
            return false;
        };
        // The handshake's answers.
        let mut flushed = true;
        while c.tls.wants_write() {
            match c.tls.write_tls(&mut NoSignal(&c.sock)) {
                Ok(_) => {
                    self.writes.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    flushed = false;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return false,
            }
        }
        if flushed == c.want_out {
            c.want_out = !flushed;
            let events = libc::EPOLLIN as u32 | if c.want_out { libc::EPOLLOUT as u32 } else { 0 };
            let t = token(TOKEN_IN, c.generation, c.slot);
            let _ = epoll_mod(self.epoll.as_raw_fd(), c.sock.as_raw_fd(), events, t);
        }
        if bits & libc::EPOLLERR as u32 != 0 {
            return false;
        }
        end != ReadEnd::Eof
    }

    /// Hands the authenticated connection in `slot` of `incoming` to its peer's side. It is
    /// sent on when this node has no connection to the peer, or only one the peer dialled
    /// before (the peer dialled again: it lost that one, or restarted). When this node sends
    /// on one it dialled itself, it becomes the spare: read, and sent on once that one is lost.
    fn adopt(&self, incoming: &mut [Option<Incoming>], slot: usize) {
        let Some(c) = incoming.get(slot).and_then(Option::as_ref) else {
            return;
        };
        let Some(&k) = c.rx.peer.as_deref().and_then(|n| self.index.get(n)) else {
            return;
        };
        let p = &self.peers[k];
        let mut out = p.out.locked();
        let spare = out.conn.as_ref().is_some_and(|c| c.dialled);
        let generation = out.next_generation();
        // Edge-triggered from now on, as a dialled connection (the change re-polls: data
        // already in the socket is reported).
        let events = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32;
        if let Err(e) = epoll_mod(
            self.epoll.as_raw_fd(),
            c.sock.as_raw_fd(),
            events,
            token(TOKEN_OUT, generation, k),
        ) {
            tracing::warn!(peer = %p.name, error = %e, "message link: cannot send on the peer's connection; it stays receive-only");
            return;
        }
        let Some(c) = incoming[slot].take() else { return };
        // What this node sends on it must not wait for ever on a host that went away.
        if let Err(e) = socket2::SockRef::from(&c.sock).set_tcp_user_timeout(Some(USER_TIMEOUT)) {
            tracing::debug!(peer = %p.name, error = %e, "message link: no user timeout on an adopted connection");
        }
        let conn = Conn {
            sock: c.sock,
            tls: c.tls,
            queue: VecDeque::new(),
            queued_bytes: 0,
            rx: c.rx,
            dialled: false,
            generation,
        };
        if spare {
            out.spare = Some(conn);
            return;
        }
        if let Some(old) = out.conn.replace(conn) {
            if !old.queue.is_empty() {
                tracing::warn!(peer = %p.name, chunks = old.queue.len(), "message link: the peer dialled again; messages queued on its previous connection dropped");
            }
        }
        tracing::debug!(peer = %p.name, "message link: sending on the connection the peer dialled");
    }
}

/// How reading a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadEnd {
    /// The socket is empty (epoll says when more comes).
    Drained,
    /// The read budget is spent; more may wait.
    Budget,
    /// The peer closed its side.
    Eof,
}

/// What reading a connection needs besides the connection: the link thread's buffers and
/// inbox, and what to test incoming messages against.
struct ReadCtx<'a> {
    known: &'a [String],
    stamp: &'a peer::Stamp,
    rbuf: &'a mut [u8],
    scratch: &'a mut [u8],
    inbox: &'a mut Vec<(String, PeerReq, Bytes, usize)>,
}

/// Reads what `sock` holds, within [`READ_BUDGET_BYTES`], and cuts whole frames into the inbox
/// once the handshake named the peer (`peer`: a dialled connection knows it from the start;
/// an accepted one learns it from the certificate, which must name a node of the cluster).
/// One read takes what the socket holds (up to the buffer), and TLS is fed from memory: a
/// message costs one read system call, not one per 4 KiB TLS reads plus a last one that finds
/// the socket empty. Err: the connection is done with (failed, refused or a bad frame;
/// logged here).
fn read_frames(
    sock: &TcpStream,
    tls: &mut rustls::Connection,
    rx: &mut Rx,
    cx: &mut ReadCtx<'_>,
) -> Result<ReadEnd, ()> {
    let Rx { buf, peer, incarnation } = rx;
    let mut read = 0usize;
    loop {
        if read >= READ_BUDGET_BYTES {
            return Ok(ReadEnd::Budget);
        }
        let n = match (&*sock).read(cx.rbuf) {
            Ok(0) => return Ok(ReadEnd::Eof),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(ReadEnd::Drained),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::debug!(peer = peer.as_deref().unwrap_or("?"), error = %e, "message link: connection failed");
                return Err(());
            }
        };
        read += n;
        let mut rest = &cx.rbuf[..n];
        while !rest.is_empty() {
            if let Err(e) = tls.read_tls(&mut rest) {
                tracing::warn!(peer = peer.as_deref().unwrap_or("?"), error = %e, "message link: TLS refused input; connection closed");
                return Err(());
            }
            if let Err(e) = tls.process_new_packets() {
                tracing::warn!(peer = peer.as_deref().unwrap_or("?"), remote = ?sock.peer_addr().ok(), error = %e, "message link: TLS failed; connection closed");
                // The alert, if it fits.
                let _ = tls.write_tls(&mut NoSignal(sock));
                return Err(());
            }
            if peer.is_none() && !tls.is_handshaking() {
                match tls
                    .peer_certificates()
                    .and_then(crate::tls::name_in_chain)
                    .filter(|n| cx.known.contains(n))
                {
                    Some(name) => *peer = Some(name),
                    None => {
                        tracing::warn!(remote = ?sock.peer_addr().ok(), "message link: refused peer, its certificate names no node of this cluster");
                        return Err(());
                    }
                }
            }
            if let Some(from) = peer.as_deref() {
                // Every plaintext byte TLS holds, so it can read on.
                loop {
                    match tls.reader().read(cx.scratch) {
                        Ok(0) => break,
                        Ok(k) => {
                            buf.extend_from_slice(&cx.scratch[..k]);
                            if let Err(message) = cut_frames(buf, incarnation, cx.stamp, from, cx.inbox) {
                                tracing::warn!(peer = %from, %message, "message link: dropped the connection");
                                return Err(());
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(_) => return Ok(ReadEnd::Eof),
                    }
                }
            }
        }
        // A short read emptied the socket (epoll says when more comes).
        if n < cx.rbuf.len() {
            return Ok(ReadEnd::Drained);
        }
    }
}

/// The wait after the `failures`-th dial in a row that failed before its handshake ended:
/// doubling from 100 ms to 2 s, drawn between half and all of it (so that the nodes that
/// lost one peer do not all dial it again at once).
fn dial_backoff(failures: u32) -> Duration {
    let full = Duration::from_millis(100)
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(Duration::from_secs(2));
    let half = full / 2;
    let jitter = rand::random::<u64>() % (half.as_micros() as u64 + 1);
    half + Duration::from_micros(jitter)
}

/// Drops the connection of `p` (`out` is its locked state) with what it held. A connection
/// this node dialled that failed before its handshake ended delays the next dial.
fn lost(p: &Peer, out: &mut Out, why: &str) {
    if let Some(c) = out.conn.as_ref() {
        if c.dialled && c.tls.is_handshaking() {
            let failures = out.backoff.map_or(0, |(_, f)| f).saturating_add(1);
            out.backoff = Some((Instant::now() + dial_backoff(failures), failures));
        } else {
            out.backoff = None;
        }
    }
    if let Some(c) = out.conn.take() {
        if c.queue.is_empty() {
            tracing::debug!(peer = %p.name, error = why, "message link: connection lost");
        } else {
            tracing::warn!(peer = %p.name, error = why, chunks = c.queue.len(), "message link: connection lost; queued messages dropped");
        }
    }
}

/// Evicts one incoming connection to make room: the oldest not yet authenticated, else the
/// oldest of a peer that has more than one. False: none may go (every peer has one).
fn evict(incoming: &mut [Option<Incoming>]) -> bool {
    let oldest = |f: &dyn Fn(&Incoming) -> bool| {
        incoming
            .iter()
            .enumerate()
            .filter_map(|(k, c)| c.as_ref().filter(|c| f(c)).map(|c| (c.seq, k)))
            .min()
            .map(|(_, k)| k)
    };
    let victim = oldest(&|c| c.rx.peer.is_none()).or_else(|| {
        let mut per_peer: HashMap<&str, usize> = HashMap::new();
        for c in incoming.iter().flatten() {
            if let Some(p) = c.rx.peer.as_deref() {
                *per_peer.entry(p).or_default() += 1;
            }
        }
        let crowded: Vec<String> = per_peer
            .into_iter()
            .filter(|&(_, n)| n > 1)
            .map(|(p, _)| p.to_string())
            .collect();
        oldest(&|c| c.rx.peer.as_ref().is_some_and(|p| crowded.contains(p)))
    });
    match victim {
        Some(k) => {
            incoming[k] = None;
            true
        }
        None => false,
    }
}

/// Writes what `c` has: TLS records first, then more of the queue while the socket takes it.
fn flush(c: &mut Conn, writes: &AtomicU64) -> std::io::Result<()> {
    // Bounded by the queue; the bound only guards against a bug.
    for _ in 0..(QUEUE_CHUNKS + 1024) {
        while c.tls.wants_write() {
            match c.tls.write_tls(&mut NoSignal(&c.sock)) {
                Ok(_) => {
                    writes.fetch_add(1, Ordering::Relaxed);
                }
                // The link thread writes the rest when the socket has room (EPOLLOUT).
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                // A connection still being made takes nothing yet.
                Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if c.tls.is_handshaking() || c.queue.is_empty() {
            return Ok(());
        }
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(64);
        let mut bytes = 0;
        for chunk in c.queue.iter() {
            if slices.len() == 64 || bytes >= FEED_BYTES {
                break;
            }
            slices.push(IoSlice::new(chunk));
            bytes += chunk.len();
        }
        let mut taken = c.tls.writer().write_vectored(&slices)?;
        drop(slices);
        c.queued_bytes -= taken;
        while taken > 0 {
            let Some(front) = c.queue.front_mut() else { break };
            if front.len() <= taken {
                taken -= front.len();
                c.queue.pop_front();
            } else {
                front.advance(taken);
                taken = 0;
            }
        }
    }
    Ok(())
}

/// Cuts the whole frames at the start of `buf` into `inbox`. Err: a frame longer than the
/// limit (the connection is then dropped).
fn cut_frames(
    buf: &mut BytesMut,
    incarnation: &mut Option<u64>,
    stamp: &peer::Stamp,
    from: &str,
    inbox: &mut Vec<(String, PeerReq, Bytes, usize)>,
) -> Result<(), String> {
    loop {
        if buf.len() < 4 {
            return Ok(());
        }
        let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len > MAX_PEER_MSG {
            return Err(format!("frame of {len} bytes exceeds {MAX_PEER_MSG}"));
        }
        if buf.len() < 4 + len {
            // Room for the whole frame at once, rather than growing by doubling.
            buf.reserve(4 + len - buf.len());
            return Ok(());
        }
        let frame = buf.split_to(4 + len).freeze().slice(4..);
        let decoded = peer::decode_request(frame);
        if let Ok((inc, _, _)) = &decoded {
            *incarnation = (*incarnation).max(Some(*inc));
        }
        match decoded {
            Ok((inc, _, _)) if stamp.fenced(from, inc) => {
                tracing::debug!(peer = %from, incarnation = inc, "message link: dropped a message of an incarnation declared down");
            }
            Ok((_, req, payload)) => inbox.push((from.to_string(), req, payload, 4 + len)),
            // The frame boundary is known: the next message is still read.
            Err(e) => tracing::warn!(peer = %from, error = %e, "message link: dropped a malformed message"),
        }
    }
}

/// The pending error of `sock`, as text.
fn socket_error(sock: &TcpStream) -> String {
    match sock.take_error() {
        Ok(Some(e)) => e.to_string(),
        Ok(None) => "connection closed".into(),
        Err(e) => e.to_string(),
    }
}

/// Writes to a socket without raising `SIGPIPE` when the peer is gone (an error instead).
struct NoSignal<'a>(&'a TcpStream);

impl Write for NoSignal<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        let n = bufs.len().min(libc::UIO_MAXIOV as usize);
        // SAFETY: msghdr is plain data; all zeros is valid before the fields are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is ABI-compatible with iovec (std guarantees it on Unix).
        msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = n as _;
        // SAFETY: `msg` points at `n` live iovecs borrowed for the call; no name, no control.
        let r = unsafe { libc::sendmsg(self.0.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(r as usize)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sets an integer socket option.
fn set_int_option(sock: &socket2::Socket, level: i32, name: i32, value: i32) -> std::io::Result<()> {
    // SAFETY: an int option value from a live local, with its size.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn epoll_add(ep: RawFd, fd: RawFd, events: u32, token: u64) -> std::io::Result<()> {
    epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, events, token)
}

fn epoll_mod(ep: RawFd, fd: RawFd, events: u32, token: u64) -> std::io::Result<()> {
    epoll_ctl(ep, libc::EPOLL_CTL_MOD, fd, events, token)
}

fn epoll_ctl(ep: RawFd, op: i32, fd: RawFd, events: u32, token: u64) -> std::io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: a live event struct; the kernel copies it.
    if unsafe { libc::epoll_ctl(ep, op, fd, &mut ev) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// How long the link waits for a message's answer, in tests.
#[cfg(test)]
const TEST_WAIT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests;
