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
//! the peer's is sent on once this node's own is lost or closed, rather than dialling again).
//! A node sends on one connection per peer until it is lost or closed, so messages to a peer
//! stay in order.
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
//! Connections on demand: a node's only connection to a peer that carried nothing either way
//! for the link's idle time ([`IDLE_CLOSE`] in production) is closed, and so are the least
//! recently used ones while more than the link's bound are open. A close loses nothing and
//! keeps the order: the closer sends a *last* frame (length 0) and holds what it posts to the
//! peer meanwhile; the peer, having read everything before it, answers with its own last
//! frame after what it had queued, and sends later messages on another connection; the closer
//! reads the peer's other connections only once it read that answer, then sends what it held.
//! A close not answered within [`CLOSE_WAIT`] counts as a lost connection. At most
//! [`DEFAULT_MAX_DIALS`] dials are in flight; what is posted to a peer whose dial waits for
//! its turn is held, in order, and sent once it goes.
//!
//! Invariants: every queue, connection count and read has a bound; the handler runs on the
//! link thread with no lock held, so a handler may post; a peer's outgoing state is behind its
//! own mutex, never held across another peer's (the list of connections to read again is
//! locked inside a peer's, never the other way); a peer has at most one connection closing, and
//! nothing this node posts to it goes out while the one it sent on closes.

use crate::failstop::Locked;
use crate::peer::NetError;
use crate::peer::{self, PeerReq, MAX_PEER_MSG};
use bytes::{Buf, Bytes, BytesMut};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
/// A node's only connection to a peer that carried nothing for this long is closed.
pub const IDLE_CLOSE: Duration = Duration::from_secs(30);
/// A close the peer did not answer in this long counts as a lost connection (what was held
/// meanwhile goes on a new one).
pub const CLOSE_WAIT: Duration = Duration::from_secs(30);
/// Connections open at once (dialled, adopted, closing, and accepted ones being
/// authenticated) past which the least recently used idle ones are closed.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// How often connections are swept while more than the bound are open.
const OVER_BOUND_SWEEP: Duration = Duration::from_millis(10);
/// Accepted connections whose handshake has not named a node yet, at most (the oldest goes).
const MAX_HANDSHAKES: usize = 64;
/// Dials whose handshake has not ended, at most (as the request transport's); what is posted
/// to a peer whose dial waits for its turn is held, in order, until it goes.
pub const DEFAULT_MAX_DIALS: usize = 16;
/// Connections open at once, at most: past it, incoming ones are refused (the bound on
/// connections plus the handshakes that may be under way beyond it).
fn hard_bound(max_connections: usize) -> usize {
    max_connections + MAX_HANDSHAKES
}
/// The frame that ends a connection's stream (a frame of length 0; a message is never empty).
const LAST_FRAME: [u8; 4] = [0; 4];

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
    /// When it last carried a frame either way (or was opened).
    used: Instant,
    /// Counted among the link's open connections while it lives.
    _open: Open,
    /// A dial's turn among those in flight, until its handshake ends.
    dial_turn: Option<Open>,
}

/// One open connection in the link's count ([`Link::open_connections`]), for its lifetime.
struct Open(Arc<AtomicUsize>);

impl Open {
    fn new(count: &Arc<AtomicUsize>) -> Open {
        count.fetch_add(1, Ordering::Relaxed);
        Open(count.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
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
    /// The peer sent its last frame on it (nothing may follow).
    last: bool,
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
    /// A connection being closed: this node queued its last frame on it; done once the
    /// peer's last frame was read and everything was written. Meanwhile the peer's other
    /// connections are not read.
    closing: Option<Closing>,
    /// Posted while the connection sent on is closing, or while a dial waits for its turn;
    /// sent once the close is done or the dial goes (and their bytes): bounded as a
    /// connection's queue.
    pending: VecDeque<Bytes>,
    pending_bytes: usize,
    /// In the link's queue of dials waiting for a turn.
    awaiting_dial: bool,
}

/// A connection being closed ([`Out::closing`]).
struct Closing {
    conn: Conn,
    /// Since when.
    since: Instant,
    /// It was the connection this node sent on: posts wait in [`Out::pending`].
    sending: bool,
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
    /// Not polled: its peer has a connection closing, whose end must be read first.
    parked: bool,
    _open: Open,
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
    /// This node's name (the one of `known` that is no peer).
    me: String,
    stop: AtomicBool,
    posted: AtomicU64,
    writes: AtomicU64,
    /// This node's incarnation on every frame, and the test of incoming ones.
    stamp: Arc<peer::Stamp>,
    /// A node's only connection to a peer is closed after carrying nothing for this long.
    idle_close: Duration,
    /// Connections open at once past which the least recently used idle ones are closed.
    max_connections: usize,
    /// Connections open now (every [`Conn`] and [`Incoming`]).
    open: Arc<AtomicUsize>,
    /// Tokens of connections to read again (the peer's close that held them is done).
    rearm: Mutex<Vec<u64>>,
    /// More connections are open than the bound: sweep at the next wake-up.
    sweep_now: AtomicBool,
    /// Closes done (both last frames went) since start.
    closes: AtomicU64,
    /// Dials in flight (handshake not ended) at most, and how many are now.
    max_dials: usize,
    dialing: Arc<AtomicUsize>,
    /// Peers waiting for a dial's turn, in order (each once: [`Out::awaiting_dial`]).
    waiting: Mutex<VecDeque<usize>>,
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
        let index: HashMap<String, usize> = list.iter().enumerate().map(|(k, (n, _))| (n.clone(), k)).collect();
        let me = known
            .iter()
            .find(|n| !index.contains_key(*n))
            .cloned()
            .unwrap_or_default();
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
            me,
            stop: AtomicBool::new(false),
            posted: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            stamp: Arc::new(peer::Stamp::default()),
            idle_close: IDLE_CLOSE,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            open: Arc::new(AtomicUsize::new(0)),
            rearm: Mutex::new(Vec::new()),
            sweep_now: AtomicBool::new(false),
            closes: AtomicU64::new(0),
            max_dials: DEFAULT_MAX_DIALS,
            dialing: Arc::new(AtomicUsize::new(0)),
            waiting: Mutex::new(VecDeque::new()),
        })
    }

    /// The same link closing a peer's only connection after `idle_close` without a frame, and
    /// closing the least recently used ones while more than `max_connections` are open
    /// (at least 1).
    pub fn with_limits(mut self, idle_close: Duration, max_connections: usize) -> Link {
        self.set_limits(idle_close, max_connections);
        self
    }

    /// Sets the limits of [`Link::with_limits`] before the link runs.
    pub fn set_limits(&mut self, idle_close: Duration, max_connections: usize) {
        self.idle_close = idle_close.max(Duration::from_millis(1));
        self.max_connections = max_connections.max(1);
    }

    /// The same link with at most `max_dials` dials in flight (at least 1).
    pub fn with_max_dials(mut self, max_dials: usize) -> Link {
        self.max_dials = max_dials.max(1);
        self
    }

    /// Dials whose handshake has not ended.
    pub fn dials_in_flight(&self) -> usize {
        self.dialing.load(Ordering::Relaxed)
    }

    /// Connections open now: dialled, adopted, closing, and accepted ones not yet adopted.
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections closed since start by the close both ends agree on (idle, or too many
    /// open), not counting lost ones.
    pub fn closes(&self) -> u64 {
        self.closes.load(Ordering::Relaxed)
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
        let held = out.closing.as_ref().is_some_and(|c| c.sending)
            || out.awaiting_dial
            || !self.connect_locked(k, &mut out)?;
        if held {
            // Held, in order, until the peer answered the close or the dial got its turn (then
            // sent by the link thread).
            let o = &mut *out;
            push_frame(&mut o.pending, &mut o.pending_bytes, head, payload, &p.name, "held")?;
            self.posted.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let c = out.conn.as_mut().expect("connected above");
        push_frame(&mut c.queue, &mut c.queued_bytes, head, payload, &p.name, "queued")?;
        c.used = Instant::now();
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

    /// Makes sure peer `k` (`out` is its locked state) has a connection to send on: the one
    /// it has, else the peer's spare, else a dial (unless dials failed less than their
    /// backoff ago). False: the dial waits for a turn (the peer is queued for one; hold what
    /// is posted in [`Out::pending`]).
    fn connect_locked(&self, k: usize, out: &mut Out) -> Result<bool, NetError> {
        let p = &self.peers[k];
        if out.conn.is_none() {
            out.conn = out.spare.take();
        }
        if out.conn.is_some() {
            return Ok(true);
        }
        if out.awaiting_dial {
            return Ok(false);
        }
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
        if self.open.load(Ordering::Relaxed) >= hard_bound(self.max_connections) {
            self.sweep_soon();
            return Err(NetError::Unreachable {
                peer: p.name.clone(),
                message: format!(
                    "{} connections open: no new one until idle ones are closed",
                    self.open.load(Ordering::Relaxed)
                ),
            });
        }
        let Some(turn) = self.dial_turn() else {
            out.awaiting_dial = true;
            self.waiting.locked().push_back(k);
            return Ok(false);
        };
        let generation = out.next_generation();
        let mut conn = self.dial(k, generation).map_err(|e| NetError::Unreachable {
            peer: p.name.clone(),
            message: e.to_string(),
        })?;
        conn.dial_turn = Some(turn);
        out.conn = Some(conn);
        if self.open.load(Ordering::Relaxed) > self.max_connections {
            self.sweep_soon();
        }
        Ok(true)
    }

    /// A turn among the dials in flight, if one is free.
    fn dial_turn(&self) -> Option<Open> {
        self.dialing
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_dials).then_some(n + 1)
            })
            .ok()?;
        // The count was taken above: the guard gives it back.
        Some(Open(self.dialing.clone()))
    }

    /// Dials the peers waiting for a turn, while turns are free (the link thread, no lock
    /// held).
    fn dial_waiting(&self) {
        while self.dialing.load(Ordering::Acquire) < self.max_dials {
            let Some(k) = self.waiting.locked().pop_front() else {
                return;
            };
            let p = &self.peers[k];
            let mut out = p.out.locked();
            if !out.awaiting_dial {
                continue;
            }
            out.awaiting_dial = false;
            self.send_held(k, &mut out, "messages held for a dial dropped");
        }
    }

    /// Asks the link thread to close idle connections at its next wake-up (too many are
    /// open).
    fn sweep_soon(&self) {
        if !self.sweep_now.swap(true, Ordering::AcqRel) {
            self.wake();
        }
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
            used: Instant::now(),
            _open: Open::new(&self.open),
            dial_turn: None,
        })
    }

    /// Writes what peer `p`'s connection has (`out` is its locked state); a connection that
    /// fails is dropped with what it held.
    fn flush_locked(&self, p: &Peer, out: &mut Out) {
        let Some(c) = out.conn.as_mut() else { return };
        if let Err(e) = flush(c, &self.writes) {
            let turn = c.dial_turn.is_some();
            lost(p, out, &e.to_string());
            if turn {
                // Its turn is free: the link thread dials whoever waits.
                self.wake();
            }
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
            // Dials that failed before it restarted say nothing of it now: the next message
            // dials at once (held back, it would be refused, and a protocol that lost it could
            // wait for ever: the nemesis met a coherence message refused 24 ms after the news).
            out.backoff = None;
            let stale = |c: &Conn| c.dialled || c.rx.incarnation.is_some_and(|i| i < incarnation);
            if out.conn.as_ref().is_some_and(stale) {
                out.conn = None;
            }
            if out.spare.as_ref().is_some_and(stale) {
                out.spare = None;
            }
            if out.closing.as_ref().is_some_and(|c| stale(&c.conn)) {
                // What was held for the previous incarnation goes with its connection.
                out.closing = None;
                out.pending.clear();
                out.pending_bytes = 0;
                self.rearm_locked(k, &out);
                self.wake();
            }
        }
        if !self.waiting.locked().is_empty() {
            // A dial dropped above may have freed a turn.
            self.wake();
        }
    }

    /// Asks the link thread to read peer `k`'s connections (`out`, locked) again: the close
    /// that held them is over, and what they hold was not read.
    fn rearm_locked(&self, k: usize, out: &Out) {
        let mut rearm = self.rearm.locked();
        for c in out.conn.iter().chain(out.spare.iter()) {
            rearm.push(token(TOKEN_OUT, c.generation, k));
        }
    }

    /// Closes every connection and ends the link thread.
    pub fn close(&self) {
        self.stop.store(true, Ordering::Release);
        for p in &self.peers {
            let mut out = p.out.locked();
            out.conn = None;
            out.spare = None;
            out.closing = None;
            out.pending.clear();
            out.pending_bytes = 0;
            out.awaiting_dial = false;
        }
        self.waiting.locked().clear();
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
        let mut next_seq = 0u64;
        let sweep_every = (self.idle_close / 4).clamp(Duration::from_millis(1), Duration::from_secs(5));
        let mut next_sweep = Instant::now() + sweep_every;
        let mut inbox: Vec<(String, PeerReq, Bytes, usize)> = Vec::new();
        // SAFETY: epoll_event is plain data; all zeros is a valid value.
        let mut events: [libc::epoll_event; EVENTS_PER_WAIT] = unsafe { std::mem::zeroed() };
        let mut scratch = vec![0u8; 64 << 10];
        let mut rbuf = vec![0u8; 256 << 10];
        let me = Arc::as_ptr(&self) as usize;
        // Connections whose read stopped at its budget: read again after the next wait.
        let mut again: Vec<u64> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            let mut retry = std::mem::take(&mut again);
            retry.append(&mut self.rearm.locked());
            let timeout_ms = if retry.is_empty() {
                let wait = next_sweep.saturating_duration_since(Instant::now());
                // Rounded up: a wake-up before the sweep is due would find nothing to do.
                wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            } else {
                0
            };
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
                    TOKEN_LISTENER => self.accept(&mut incoming, &mut next_seq),
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
            self.dial_waiting();
            let now = Instant::now();
            if now >= next_sweep || self.sweep_now.swap(false, Ordering::AcqRel) {
                self.sweep(&mut incoming);
                // Past the bound (connections busy, or closes under way): look again soon.
                let over = self.open.load(Ordering::Relaxed) > self.max_connections;
                next_sweep = now
                    + if over {
                        sweep_every.min(OVER_BOUND_SWEEP)
                    } else {
                        sweep_every
                    };
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

    /// Accepts what the listener holds, within the bounds on handshakes and connections.
    fn accept(&self, incoming: &mut Vec<Option<Incoming>>, next_seq: &mut u64) {
        for _ in 0..MAX_HANDSHAKES {
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
            let handshaking = incoming.iter().flatten().filter(|c| c.rx.peer.is_none()).count();
            let open = self.open.load(Ordering::Relaxed);
            if (handshaking >= MAX_HANDSHAKES || open >= hard_bound(self.max_connections)) && !evict(incoming) {
                self.sweep_now.store(true, Ordering::Release);
                tracing::warn!(%from, open, "message link: refused a connection, too many open");
                continue;
            }
            if open + 1 > self.max_connections {
                self.sweep_now.store(true, Ordering::Release);
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
                parked: false,
                _open: Open::new(&self.open),
            });
            *next_seq += 1;
        }
    }

    /// Handles readiness of a connection of peer `k` (the one this node sends on, the spare,
    /// or the closing one): the peer's messages (into `cx.inbox`), the handshake's answers,
    /// what a full socket left, the close's last frames, the end of the connection. A read
    /// cut short by its budget is asked again through `again` (the connection is
    /// edge-triggered); one held by a close is asked again once the close is done.
    fn on_conn(&self, k: usize, generation: u32, bits: u32, cx: &mut ReadCtx<'_>, again: &mut Vec<u64>) {
        let Some(p) = self.peers.get(k) else { return };
        let mut out = p.out.locked();
        let out = &mut *out;
        let which = if out.conn.as_ref().is_some_and(|c| c.generation == generation) {
            Which::Conn
        } else if out.spare.as_ref().is_some_and(|c| c.generation == generation) {
            Which::Spare
        } else if out.closing.as_ref().is_some_and(|c| c.conn.generation == generation) {
            Which::Closing
        } else {
            return;
        };
        // The peer's frames on another connection wait until the closing one's end was read.
        let held = which != Which::Closing && out.closing.is_some();
        let c = match which {
            Which::Conn => out.conn.as_mut(),
            Which::Spare => out.spare.as_mut(),
            Which::Closing => out.closing.as_mut().map(|c| &mut c.conn),
        };
        let Some(c) = c else { return };
        let before = cx.inbox.len();
        let res = (|| -> Result<ReadEnd, String> {
            let end = read_frames(&c.sock, &mut c.tls, &mut c.rx, cx, &|_| held)
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
        if cx.inbox.len() > before {
            c.used = Instant::now();
        }
        if c.dial_turn.is_some() && !c.tls.is_handshaking() {
            // The handshake ended: the turn goes to a waiting dial (after this event).
            c.dial_turn = None;
        }
        match (res, which) {
            (Ok(ReadEnd::Budget), _) => again.push(token(TOKEN_OUT, generation, k)),
            (Ok(_), _) => {}
            (Err(e), Which::Conn) => lost(p, out, &e),
            (Err(e), Which::Spare) => {
                tracing::debug!(peer = %p.name, error = %e, "message link: spare connection lost");
                out.spare = None;
            }
            (Err(e), Which::Closing) => {
                tracing::debug!(peer = %p.name, error = %e, "message link: closing connection lost");
                out.closing = None;
                self.settle(k, out);
            }
        }
        self.advance_close(k, out);
    }

    /// Moves peer `k`'s close on (`out` is its locked state): a connection on which the peer
    /// sent its last frame is answered with this node's (after what was queued on it) and
    /// closes; a closing connection whose last frames both went is done with.
    fn advance_close(&self, k: usize, out: &mut Out) {
        let p = &self.peers[k];
        for sending in [true, false] {
            let slot = if sending { &mut out.conn } else { &mut out.spare };
            if !slot.as_ref().is_some_and(|c| c.rx.last) {
                continue;
            }
            let Some(conn) = slot.take() else { continue };
            if out.closing.is_some() {
                // Not read while another closes: cannot happen; dropping it loses nothing read.
                tracing::warn!(peer = %p.name, "message link: the peer closed a second connection at once; dropped");
                continue;
            }
            tracing::debug!(peer = %p.name, "message link: the peer closes a connection");
            out.closing = Some(Closing {
                conn,
                since: Instant::now(),
                sending,
            });
            self.send_last(k, out);
            return;
        }
        if out
            .closing
            .as_ref()
            .is_some_and(|c| c.conn.rx.last && c.conn.queue.is_empty() && !c.conn.tls.wants_write())
        {
            tracing::debug!(peer = %p.name, "message link: connection closed");
            self.closes.fetch_add(1, Ordering::Relaxed);
            out.closing = None;
            self.settle(k, out);
        }
    }

    /// Queues this node's last frame on peer `k`'s closing connection (`out` is its locked
    /// state) and writes what the socket takes.
    fn send_last(&self, k: usize, out: &mut Out) {
        let Some(cl) = out.closing.as_mut() else { return };
        cl.conn.queue.push_back(Bytes::from_static(&LAST_FRAME));
        cl.conn.queued_bytes += LAST_FRAME.len();
        if let Err(e) = flush(&mut cl.conn, &self.writes) {
            tracing::debug!(peer = %self.peers[k].name, error = %e, "message link: closing connection lost");
            out.closing = None;
            self.settle(k, out);
            return;
        }
        self.advance_close(k, out);
    }

    /// Peer `k`'s close is over (`out` is its locked state, with no closing connection): its
    /// other connections are read again, and what was held is sent (on the connection there
    /// is, the spare, or a new dial).
    fn settle(&self, k: usize, out: &mut Out) {
        debug_assert!(out.closing.is_none(), "settled while a connection still closes");
        self.rearm_locked(k, out);
        self.send_held(k, out, "messages held during a close dropped");
    }

    /// Sends what peer `k` (`out` is its locked state) held, on its connection or a new dial
    /// (or holds it on, if the dial waits for a turn); if no connection can be had, drops it
    /// saying `dropped`.
    fn send_held(&self, k: usize, out: &mut Out, dropped: &str) {
        if out.pending.is_empty() {
            return;
        }
        let p = &self.peers[k];
        match self.connect_locked(k, out) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                tracing::warn!(peer = %p.name, chunks = out.pending.len(), error = %e, "message link: {dropped}");
                out.pending.clear();
                out.pending_bytes = 0;
                return;
            }
        }
        let Some(c) = out.conn.as_mut() else { return };
        c.queue.append(&mut out.pending);
        c.queued_bytes += std::mem::take(&mut out.pending_bytes);
        c.used = Instant::now();
        self.flush_locked(p, out);
    }

    /// Whether peer `name` has a connection closing (its other connections are not read).
    fn closing_with(&self, name: &str) -> bool {
        self.index
            .get(name)
            .is_some_and(|&k| self.peers[k].out.locked().closing.is_some())
    }

    /// Closes the connections that carried nothing for the idle time (a peer's only one),
    /// and the least recently used quiet ones while more than the bound are open; drops a
    /// close the peer did not answer in time; polls again the accepted connections that a
    /// close held.
    fn sweep(&self, incoming: &mut [Option<Incoming>]) {
        let now = Instant::now();
        let mut quiet: Vec<(Instant, usize)> = Vec::new();
        for (k, p) in self.peers.iter().enumerate() {
            let mut out = p.out.locked();
            if out
                .closing
                .as_ref()
                .is_some_and(|c| now.saturating_duration_since(c.since) >= CLOSE_WAIT)
            {
                tracing::warn!(peer = %p.name, wait_ms = CLOSE_WAIT.as_millis() as u64, "message link: the peer did not answer a close; connection dropped");
                out.closing = None;
                self.settle(k, &mut out);
            }
            if let Some((used, _)) = closable(&out, self.first_here(k)) {
                quiet.push((used, k));
            }
        }
        for c in incoming.iter_mut().flatten() {
            if c.parked && !c.rx.peer.as_deref().is_some_and(|n| self.closing_with(n)) {
                c.parked = false;
                let t = token(TOKEN_IN, c.generation, c.slot);
                let _ = epoll_mod(self.epoll.as_raw_fd(), c.sock.as_raw_fd(), libc::EPOLLIN as u32, t);
            }
        }
        quiet.sort_unstable();
        let mut open = self.open.load(Ordering::Relaxed);
        for (used, k) in quiet {
            let idle = now.saturating_duration_since(used) >= self.idle_close;
            if !idle && open <= self.max_connections {
                // The rest were used more recently still.
                break;
            }
            self.start_close(k, now.saturating_duration_since(used));
            open = open.saturating_sub(1);
        }
    }

    /// Whether this node's name sorts before peer `k`'s.
    fn first_here(&self, k: usize) -> bool {
        self.me.as_str() < self.peers[k].name.as_str()
    }

    /// Starts closing one of peer `k`'s connections, if they are still quiet.
    fn start_close(&self, k: usize, idle: Duration) {
        let p = &self.peers[k];
        let mut out = p.out.locked();
        let out = &mut *out;
        let Some((_, which)) = closable(out, self.first_here(k)) else {
            return;
        };
        let (conn, sending) = match which {
            Which::Conn => (out.conn.take(), true),
            _ => (out.spare.take(), false),
        };
        let Some(conn) = conn else { return };
        tracing::debug!(peer = %p.name, idle_ms = idle.as_millis() as u64, "message link: closing a quiet connection");
        out.closing = Some(Closing {
            conn,
            since: Instant::now(),
            sending,
        });
        self.send_last(k, out);
    }

    /// Handles readiness of a connection a peer dialled that this node does not send on;
    /// whole messages go to `cx.inbox`. False: the connection is done with (closed by the
    /// peer, failed, or refused).
    fn on_incoming(&self, c: &mut Incoming, bits: u32, cx: &mut ReadCtx<'_>) -> bool {
        let Ok(end) = read_frames(&c.sock, &mut c.tls, &mut c.rx, cx, &|n| self.closing_with(n)) else {
            return false;
        };
        if c.rx.last {
            // A close on a connection this node does not send on: nothing to answer with; the
            // peer sees it end.
            return false;
        }
        if end == ReadEnd::Held && !c.parked {
            // Level-triggered: not polled until the peer's close is done (or it is adopted).
            c.parked = true;
            let t = token(TOKEN_IN, c.generation, c.slot);
            let _ = epoll_mod(self.epoll.as_raw_fd(), c.sock.as_raw_fd(), 0, t);
            return true;
        }
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
        if flushed == c.want_out && !c.parked {
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
            used: Instant::now(),
            _open: c._open,
            dial_turn: None,
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
    /// Not read on: the peer's frames wait for the end of its connection that closes.
    Held,
}

/// Which of a peer's connections an event is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Which {
    /// The one this node sends on.
    Conn,
    /// One the peer dialled, read only.
    Spare,
    /// The one closing.
    Closing,
}

/// Which of a peer's connections may be closed now, and when it (or the other one) last
/// carried a frame: every one quiet (nothing queued, read or closing, handshakes done). Of
/// two, the one the node whose name sorts first dialled (`first_dialled_here`: this node's
/// name sorts first), so that both ends pick the same one: had each closed a different one,
/// each would wait for the end of its own before reading the other.
fn closable(out: &Out, first_dialled_here: bool) -> Option<(Instant, Which)> {
    if out.closing.is_some() || !out.pending.is_empty() {
        return None;
    }
    let quiet = |c: &Conn| {
        c.rx.peer.is_some()
            && !c.tls.is_handshaking()
            && c.queue.is_empty()
            && !c.tls.wants_write()
            && c.rx.buf.is_empty()
            && !c.rx.last
    };
    match (&out.conn, &out.spare) {
        (Some(c), None) => quiet(c).then_some((c.used, Which::Conn)),
        (None, Some(c)) => quiet(c).then_some((c.used, Which::Spare)),
        (Some(c), Some(s)) if quiet(c) && quiet(s) => {
            let which = if c.dialled == first_dialled_here {
                Which::Conn
            } else {
                Which::Spare
            };
            Some((c.used.max(s.used), which))
        }
        _ => None,
    }
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
/// the socket empty. While `held` says so of the peer, nothing more is read from the socket
/// and what was read stays whole in the buffer (a read that learns the peer mid-way keeps
/// its plaintext there); it is cut once reading goes on. Err: the connection is done with
/// (failed, refused or a bad frame; logged here).
fn read_frames(
    sock: &TcpStream,
    tls: &mut rustls::Connection,
    rx: &mut Rx,
    cx: &mut ReadCtx<'_>,
    held: &dyn Fn(&str) -> bool,
) -> Result<ReadEnd, ()> {
    let Rx {
        buf,
        peer,
        incarnation,
        last,
    } = rx;
    let mut hold = false;
    if let Some(from) = peer.as_deref() {
        if held(from) {
            return Ok(ReadEnd::Held);
        }
        // What a held read left.
        if let Err(message) = cut_frames(buf, incarnation, last, cx.stamp, from, cx.inbox) {
            tracing::warn!(peer = %from, %message, "message link: dropped the connection");
            return Err(());
        }
    }
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
                    Some(name) => {
                        hold = held(&name);
                        *peer = Some(name);
                    }
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
                            if hold {
                                continue;
                            }
                            if let Err(message) = cut_frames(buf, incarnation, last, cx.stamp, from, cx.inbox) {
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
        if hold {
            return Ok(ReadEnd::Held);
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

/// Appends one frame (`head`, then `payload`) to a peer's `queue` of `bytes`, within the
/// bounds of one; `what` says which queue in the refusal.
fn push_frame(
    queue: &mut VecDeque<Bytes>,
    bytes: &mut usize,
    head: Bytes,
    payload: Bytes,
    peer: &str,
    what: &str,
) -> Result<(), NetError> {
    let len = head.len() + payload.len();
    if queue.len() + 2 > QUEUE_CHUNKS || *bytes + len > QUEUE_BYTES {
        return Err(NetError::Unreachable {
            peer: peer.into(),
            message: format!("{} bytes already {what}", *bytes),
        });
    }
    queue.push_back(head);
    if !payload.is_empty() {
        queue.push_back(payload);
    }
    *bytes += len;
    Ok(())
}

/// Cuts the whole frames at the start of `buf` into `inbox`; the last frame sets `last`.
/// Err: a frame longer than the limit, or anything after the last frame (the connection is
/// then dropped).
fn cut_frames(
    buf: &mut BytesMut,
    incarnation: &mut Option<u64>,
    last: &mut bool,
    stamp: &peer::Stamp,
    from: &str,
    inbox: &mut Vec<(String, PeerReq, Bytes, usize)>,
) -> Result<(), String> {
    loop {
        if *last && !buf.is_empty() {
            return Err(format!("{} bytes after the connection's last frame", buf.len()));
        }
        if buf.len() < 4 {
            return Ok(());
        }
        let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len == 0 {
            buf.advance(4);
            *last = true;
            continue;
        }
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
