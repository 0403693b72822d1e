//! The message link: a node's second QUIC endpoint, for one-way messages (the coherence
//! protocol's, barriers', locks'), driven by `quinn-proto` from one OS thread of its own
//! instead of through quinn's async tasks.
//!
//! Why: these messages are small and on the critical path of page faults and barriers. Through
//! quinn's shell a message crossed four tasks on each side (caller, writer, connection driver,
//! endpoint driver, then reader) and cost about 50 µs of CPU and 80–100 µs per hop on this
//! 2-core machine. Here whoever sends (a fault thread, or the link thread handling a message)
//! writes into the connection and puts the datagram on the socket itself, and the link thread
//! reads datagrams and hands each complete message to the handler in place. The same TLS
//! configuration (cluster certificates both ways), flow control, loss recovery and congestion
//! control apply: it is the same protocol, minus the hand-offs.
//!
//! Connections: a node sends only on connections it dialled (one unidirectional stream each)
//! and receives on connections peers dialled. An incoming connection whose certificate names
//! no node of the cluster is closed before anything it sent is read. Messages are frames
//! (`u32` little-endian length, then a [`peer`] header and payload) of at most
//! [`MAX_PEER_MSG`] bytes; a longer one closes the connection. Delivery is in order and at most
//! once: messages queued on a connection that is lost are dropped (the protocols learn of dead
//! peers from membership). Every queue and loop has a bound.
//!
//! Invariants: the state ([`Inner`]) is behind one mutex; the handler runs without it, on the
//! link thread, so a handler may post. The link thread sleeps until its next timer or a
//! datagram; a sender that makes a timer earlier than that wakes it (eventfd).

use crate::failstop::Locked;
use crate::peer::NetError;
use crate::peer::{self, PeerReq, MAX_PEER_MSG};
use bytes::{Bytes, BytesMut};
use quinn_proto::{
    ClientConfig, Connection, ConnectionHandle, DatagramEvent, Dir, Endpoint, EndpointConfig, Event, ServerConfig,
    StreamEvent, StreamId,
};
use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
#[cfg(test)]
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
#[cfg(test)]
use std::time::Duration;
use std::time::Instant;

/// What receives the link's messages.
pub trait LinkHandler: Send + Sync + 'static {
    /// A message from node `from` (the name in its certificate). Runs on the link thread:
    /// must not block (it may post).
    fn deliver(&self, from: &str, req: PeerReq, payload: Bytes);
}

/// Chunks (a message is one or two) queued for one peer, at most: a full queue means the peer
/// has not taken anything for a long time; the message is refused rather than memory growing.
const QUEUE_CHUNKS: usize = 1 << 17;
/// Datagrams read per wake-up, at most (then timers and sends get their turn).
const DATAGRAMS_PER_WAKE: usize = 256;
/// Streams a peer may have open towards us at once (it uses one).
const MAX_STREAMS_IN: usize = 4;
/// Socket buffers asked for (the kernel caps them at net.core.[rw]mem_max).
const UDP_BUFFER_BYTES: usize = 4 << 20;
/// Receive buffer: the largest UDP payload.
const DATAGRAM_BYTES: usize = 1 << 16;

struct Conn {
    conn: Connection,
    /// The peer: the node dialled, or (incoming) the node its certificate names, once the
    /// handshake is done and the name is known. Nothing is read before.
    peer: Option<String>,
    outgoing: bool,
    /// Outgoing: the stream messages go on (opened once connected).
    stream: Option<StreamId>,
    /// Outgoing: chunks not yet taken by the stream.
    queue: VecDeque<Bytes>,
    /// Incoming: partial frames per stream.
    readers: HashMap<StreamId, BytesMut>,
    /// Lost or closed: no new message goes on it.
    dead: bool,
}

struct Inner {
    ep: Endpoint,
    conns: HashMap<ConnectionHandle, Conn>,
    /// Per peer, the connection this node sends on.
    dialed: HashMap<String, ConnectionHandle>,
    /// When the link thread wakes by itself next (`None`: it waits for a datagram or a wake).
    sleeping_until: Option<Instant>,
    /// Scratch for outgoing datagrams.
    tx: Vec<u8>,
    stop: bool,
}

pub struct Link {
    inner: Mutex<Inner>,
    socket: UdpSocket,
    /// eventfd: wakes the link thread.
    wake: OwnedFd,
    client: ClientConfig,
    addrs: HashMap<String, SocketAddr>,
    known: Vec<String>,
    posted: AtomicU64,
    datagrams: AtomicU64,
    /// This node's incarnation on every frame, and the test of incoming ones.
    stamp: Arc<peer::Stamp>,
}

impl Link {
    /// Binds the link's UDP address. `peers`: every other node's link address; `known`: every
    /// node name of the cluster (incoming connections must be from one of them).
    pub fn bind(
        addr: SocketAddr,
        server: ServerConfig,
        client: ClientConfig,
        reset_key: Arc<ring::hmac::Key>,
        peers: HashMap<String, SocketAddr>,
        known: Vec<String>,
    ) -> std::io::Result<Link> {
        let socket = UdpSocket::bind(addr)?;
        socket.set_nonblocking(true)?;
        let s2 = socket2::SockRef::from(&socket);
        let _ = s2.set_recv_buffer_size(UDP_BUFFER_BYTES);
        let _ = s2.set_send_buffer_size(UDP_BUFFER_BYTES);
        // Never fragment: MTU discovery then learns the path's real limit (a probe that is too
        // big is refused or lost, and QUIC stays at the size that got through).
        dont_fragment(&socket, addr)?;
        let mut ecfg = EndpointConfig::new(reset_key);
        ecfg.max_udp_payload_size(crate::tls::MAX_UDP_PAYLOAD)
            .map_err(|e| std::io::Error::other(format!("QUIC endpoint: {e}")))?;
        let ep = Endpoint::new(Arc::new(ecfg), Some(Arc::new(server)), true, None);
        // SAFETY: eventfd(2) takes no pointers; the descriptor is checked and then owned.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Link {
            inner: Mutex::new(Inner {
                ep,
                conns: HashMap::new(),
                dialed: HashMap::new(),
                sleeping_until: None,
                tx: Vec::with_capacity(DATAGRAM_BYTES),
                stop: false,
            }),
            socket,
            wake,
            client,
            addrs: peers,
            known,
            posted: AtomicU64::new(0),
            datagrams: AtomicU64::new(0),
            stamp: Arc::new(peer::Stamp::default()),
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.socket.local_addr()
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

    /// Datagrams sent since start (messages, acknowledgements, handshakes, keep-alives).
    pub fn datagrams(&self) -> u64 {
        self.datagrams.load(Ordering::Relaxed)
    }

    fn sent(&self, n: u64) {
        self.datagrams.fetch_add(n, Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// Queues `req` with `payload` for `peer` and sends what the connection allows at once.
    /// Returns without waiting for anything.
    pub fn post(&self, peer: &str, req: &PeerReq, payload: Bytes) -> Result<(), NetError> {
        if !self.addrs.contains_key(peer) {
            return Err(NetError::UnknownPeer(peer.into()));
        }
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
        self.enqueue(peer, head.into(), payload)
    }

    /// Queues bytes for `peer` as they are (tests: malformed frames).
    #[cfg(test)]
    fn post_raw(&self, peer: &str, bytes: Bytes) -> Result<(), NetError> {
        self.enqueue(peer, bytes, Bytes::new())
    }

    /// Queues one frame (`head`, then `payload`) on the connection to `peer`, dialling it if
    /// needed, and sends what the connection allows.
    fn enqueue(&self, peer: &str, head: Bytes, payload: Bytes) -> Result<(), NetError> {
        let Some(&addr) = self.addrs.get(peer) else {
            return Err(NetError::UnknownPeer(peer.into()));
        };
        let now = Instant::now();
        let mut guard = self.lock();
        let g = &mut *guard;
        let ch = match g.dialed.get(peer) {
            Some(&ch) if g.conns.get(&ch).is_some_and(|c| !c.dead) => ch,
            _ => {
                let (ch, conn) =
                    g.ep.connect(now, self.client.clone(), addr, &crate::tls::server_name(peer))
                        .map_err(|e| NetError::Unreachable {
                            peer: peer.into(),
                            message: e.to_string(),
                        })?;
                g.conns.insert(
                    ch,
                    Conn {
                        conn,
                        peer: Some(peer.to_string()),
                        outgoing: true,
                        stream: None,
                        queue: VecDeque::new(),
                        readers: HashMap::new(),
                        dead: false,
                    },
                );
                g.dialed.insert(peer.to_string(), ch);
                ch
            }
        };
        let c = g.conns.get_mut(&ch).expect("inserted or checked above");
        if c.queue.len() + 2 > QUEUE_CHUNKS {
            return Err(NetError::Unreachable {
                peer: peer.into(),
                message: format!("{QUEUE_CHUNKS} chunks already queued"),
            });
        }
        c.queue.push_back(head);
        if !payload.is_empty() {
            c.queue.push_back(payload);
        }
        write_queue(c);
        self.posted.fetch_add(1, Ordering::Relaxed);
        self.sent(drive(&mut g.ep, ch, c, now, &self.socket, &mut g.tx));
        let wake = match (c.conn.poll_timeout(), g.sleeping_until) {
            (Some(t), Some(s)) => t < s,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if wake {
            g.sleeping_until = c.conn.poll_timeout();
            self.wake();
        }
        Ok(())
    }

    /// Forgets the connection to `peer` (it restarted: messages still queued were for its
    /// previous incarnation); the next message dials afresh.
    pub fn drop_peer(&self, peer: &str) {
        let now = Instant::now();
        let mut guard = self.lock();
        let g = &mut *guard;
        if let Some(ch) = g.dialed.remove(peer) {
            if let Some(c) = g.conns.get_mut(&ch) {
                c.dead = true;
                c.queue.clear();
                c.conn.close(now, 0u32.into(), Bytes::from_static(b"reset"));
                self.sent(drive(&mut g.ep, ch, c, now, &self.socket, &mut g.tx));
            }
        }
        drop(guard);
        self.wake();
    }

    /// Closes every connection and ends the link thread.
    pub fn close(&self) {
        let now = Instant::now();
        let mut guard = self.lock();
        let g = &mut *guard;
        g.stop = true;
        for (&ch, c) in g.conns.iter_mut() {
            c.conn.close(now, 0u32.into(), Bytes::from_static(b"shutdown"));
            self.sent(drive(&mut g.ep, ch, c, now, &self.socket, &mut g.tx));
        }
        drop(guard);
        self.wake();
    }

    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd. A full counter (EAGAIN)
        // already means "awake".
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// The link thread: until [`Link::close`], reads datagrams, runs timers and delivers
    /// messages to `handler`.
    pub fn run(self: Arc<Self>, handler: Arc<dyn LinkHandler>) {
        let mut rx = RecvBatch::new();
        let mut inbox: Vec<(String, PeerReq, Bytes)> = Vec::new();
        let mut touched: Vec<ConnectionHandle> = Vec::new();
        loop {
            let timeout = {
                let mut g = self.lock();
                if g.stop {
                    return;
                }
                let next = g.conns.values_mut().filter_map(|c| c.conn.poll_timeout()).min();
                g.sleeping_until = next;
                next
            };
            self.wait(timeout);
            let now = Instant::now();
            let mut guard = self.lock();
            let g = &mut *guard;
            let mut read = 0;
            while read < DATAGRAMS_PER_WAKE {
                match rx.recv(&self.socket) {
                    Ok(n) => {
                        for k in 0..n {
                            let (from, data) = rx.get(k);
                            if let Some(ch) = self.on_datagram(g, now, from, data) {
                                touched.push(ch);
                            }
                        }
                        read += n;
                        // A short batch drained the socket.
                        if n < RECV_BATCH {
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    // ICMP errors (a peer's port closed) surface here; QUIC recovers or times out.
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "message link: receiving failed");
                        break;
                    }
                }
            }
            // Only connections that got datagrams or whose timer is due have anything to do:
            // senders on other threads drive their connection themselves.
            for (&ch, c) in g.conns.iter_mut() {
                if c.conn.poll_timeout().is_some_and(|t| t <= now) {
                    c.conn.handle_timeout(now);
                    touched.push(ch);
                }
            }
            touched.sort_unstable();
            touched.dedup();
            for ch in touched.drain(..) {
                let Some(c) = g.conns.get_mut(&ch) else { continue };
                self.events(c, now, &mut inbox);
                self.sent(drive(&mut g.ep, ch, c, now, &self.socket, &mut g.tx));
                if c.conn.is_drained() {
                    if let Some(p) = c.peer.clone().filter(|_| c.outgoing) {
                        if g.dialed.get(&p) == Some(&ch) {
                            g.dialed.remove(&p);
                        }
                    }
                    g.conns.remove(&ch);
                }
            }
            drop(guard);
            for (from, req, payload) in inbox.drain(..) {
                handler.deliver(&from, req, payload);
            }
        }
    }

    /// Sleeps until a datagram, a wake or `until`.
    fn wait(&self, until: Option<Instant>) {
        let mut fds = [
            libc::pollfd {
                fd: self.socket.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ts = until.map(|t| {
            let d = t.saturating_duration_since(Instant::now());
            libc::timespec {
                tv_sec: d.as_secs() as libc::time_t,
                tv_nsec: d.subsec_nanos() as libc::c_long,
            }
        });
        let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: two live pollfds, a live timespec or null, no signal mask.
        let r = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, tsp, std::ptr::null()) };
        if r > 0 && fds[1].revents != 0 {
            let mut v = [0u8; 8];
            // SAFETY: reads 8 bytes into a live buffer from our eventfd (resets it).
            unsafe { libc::read(self.wake.as_raw_fd(), v.as_mut_ptr().cast(), v.len()) };
        }
    }

    /// Hands one datagram to the endpoint; the connection it concerns, if any.
    fn on_datagram(&self, g: &mut Inner, now: Instant, from: SocketAddr, data: &[u8]) -> Option<ConnectionHandle> {
        let mut out = Vec::new();
        match g.ep.handle(now, from, None, None, BytesMut::from(data), &mut out) {
            Some(DatagramEvent::ConnectionEvent(ch, ev)) => {
                let c = g.conns.get_mut(&ch)?;
                c.conn.handle_event(ev);
                Some(ch)
            }
            Some(DatagramEvent::NewConnection(incoming)) => match g.ep.accept(incoming, now, &mut out, None) {
                Ok((ch, conn)) => {
                    g.conns.insert(
                        ch,
                        Conn {
                            conn,
                            peer: None,
                            outgoing: false,
                            stream: None,
                            queue: VecDeque::new(),
                            readers: HashMap::new(),
                            dead: false,
                        },
                    );
                    Some(ch)
                }
                Err(e) => {
                    tracing::warn!(%from, error = %e.cause, "message link: refused a connection");
                    if let Some(t) = e.response {
                        send(&self.socket, &out[..t.size], t.destination);
                    }
                    None
                }
            },
            Some(DatagramEvent::Response(t)) => {
                send(&self.socket, &out[..t.size], t.destination);
                None
            }
            None => None,
        }
    }

    /// Handles `c`'s events: the handshake's end, streams, loss. Complete messages go to
    /// `inbox`.
    fn events(&self, c: &mut Conn, now: Instant, inbox: &mut Vec<(String, PeerReq, Bytes)>) {
        // At most as many events as can be pending, plus a margin: a bound, not a limit.
        for _ in 0..1024 {
            let Some(ev) = c.conn.poll() else { break };
            match ev {
                Event::Connected => {
                    if c.outgoing {
                        c.stream = c.conn.streams().open(Dir::Uni);
                        write_queue(c);
                    } else {
                        match crate::tls::peer_name_of(c.conn.crypto_session().peer_identity())
                            .filter(|n| self.known.contains(n))
                        {
                            Some(name) => c.peer = Some(name),
                            None => {
                                tracing::warn!(remote = %c.conn.remote_address(), "message link: refused peer, its certificate names no node of this cluster");
                                c.dead = true;
                                c.conn.close(now, 1u32.into(), Bytes::from_static(b"unknown node"));
                            }
                        }
                    }
                }
                Event::ConnectionLost { reason } => {
                    c.dead = true;
                    if c.outgoing && !c.queue.is_empty() {
                        tracing::warn!(peer = c.peer.as_deref().unwrap_or("?"), error = %reason, chunks = c.queue.len(), "message link: connection lost; queued messages dropped");
                    } else {
                        tracing::debug!(peer = c.peer.as_deref().unwrap_or("?"), error = %reason, "message link: connection lost");
                    }
                    c.queue.clear();
                }
                Event::Stream(StreamEvent::Opened { dir: Dir::Uni }) => {
                    while let Some(id) = c.conn.streams().accept(Dir::Uni) {
                        if c.readers.len() >= MAX_STREAMS_IN {
                            let _ = c.conn.recv_stream(id).stop(1u32.into());
                            continue;
                        }
                        c.readers.insert(id, BytesMut::new());
                    }
                }
                Event::Stream(StreamEvent::Writable { .. }) => write_queue(c),
                _ => {}
            }
        }
        if c.dead {
            return;
        }
        let Some(from) = c.peer.clone().filter(|_| !c.outgoing) else {
            return;
        };
        let ids: Vec<StreamId> = c.readers.keys().copied().collect();
        for id in ids {
            if let Err(message) = read_stream(c, id, &self.stamp, &from, inbox) {
                tracing::warn!(peer = %from, %message, "message link: dropped the connection");
                c.dead = true;
                c.conn.close(now, 2u32.into(), Bytes::from_static(b"bad message"));
                return;
            }
        }
    }
}

/// Reads what stream `id` of `c` holds and moves its complete messages to `inbox`.
fn read_stream(
    c: &mut Conn,
    id: StreamId,
    stamp: &peer::Stamp,
    from: &str,
    inbox: &mut Vec<(String, PeerReq, Bytes)>,
) -> Result<(), String> {
    let mut finished = false;
    {
        let Some(buf) = c.readers.get_mut(&id) else {
            return Ok(());
        };
        let mut rs = c.conn.recv_stream(id);
        let chunks = rs.read(true);
        if let Ok(mut chunks) = chunks {
            loop {
                match chunks.next(usize::MAX) {
                    Ok(Some(ch)) => {
                        buf.extend_from_slice(&ch.bytes);
                        // Frames are cut as soon as whole, so a reader never holds more than
                        // one frame and a chunk.
                        if buf.len() > MAX_PEER_MSG + 4 + DATAGRAM_BYTES {
                            let _ = chunks.finalize();
                            return Err("message longer than the limit".into());
                        }
                    }
                    Ok(None) => {
                        finished = true;
                        break;
                    }
                    Err(quinn_proto::ReadError::Blocked) => break,
                    Err(quinn_proto::ReadError::Reset(_)) => {
                        finished = true;
                        break;
                    }
                }
            }
            let _ = chunks.finalize();
        }
        loop {
            if buf.len() < 4 {
                break;
            }
            let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            if len > MAX_PEER_MSG {
                return Err(format!("frame of {len} bytes exceeds {MAX_PEER_MSG}"));
            }
            if buf.len() < 4 + len {
                break;
            }
            let frame = buf.split_to(4 + len).freeze().slice(4..);
            match peer::decode_request(frame) {
                Ok((inc, _, _)) if stamp.fenced(from, inc) => {
                    tracing::debug!(peer = %from, incarnation = inc, "message link: dropped a message of an incarnation declared down");
                }
                Ok((_, req, payload)) => inbox.push((from.to_string(), req, payload)),
                // The frame boundary is known: the next message is still read.
                Err(e) => tracing::warn!(peer = %from, error = %e, "message link: dropped a malformed message"),
            }
        }
    }
    if finished {
        c.readers.remove(&id);
    }
    Ok(())
}

/// Moves queued chunks into the outgoing stream while it takes them.
fn write_queue(c: &mut Conn) {
    let Some(id) = c.stream else { return };
    while !c.queue.is_empty() {
        let (a, _) = c.queue.as_mut_slices();
        match c.conn.send_stream(id).write_chunks(a) {
            Ok(w) => {
                c.queue.drain(..w.chunks);
                if w.bytes == 0 {
                    break;
                }
            }
            Err(quinn_proto::WriteError::Blocked) => break,
            Err(e) => {
                tracing::warn!(peer = c.peer.as_deref().unwrap_or("?"), error = %e, chunks = c.queue.len(), "message link: stream closed; queued messages dropped");
                c.queue.clear();
                c.dead = true;
                break;
            }
        }
    }
}

/// Runs `c`'s endpoint bookkeeping and puts everything it has to send on the socket; how
/// many datagrams it sent.
fn drive(
    ep: &mut Endpoint,
    ch: ConnectionHandle,
    c: &mut Conn,
    now: Instant,
    socket: &UdpSocket,
    tx: &mut Vec<u8>,
) -> u64 {
    for _ in 0..1024 {
        let Some(ev) = c.conn.poll_endpoint_events() else { break };
        if let Some(back) = ep.handle_event(ch, ev) {
            c.conn.handle_event(back);
        }
    }
    // Bounded by the congestion window; the bound here only guards against a bug.
    let mut sent = 0;
    for _ in 0..4096 {
        tx.clear();
        let Some(t) = c.conn.poll_transmit(now, 1, tx) else {
            break;
        };
        send(socket, &tx[..t.size], t.destination);
        sent += 1;
    }
    sent
}

/// Datagrams taken per `recvmmsg`.
const RECV_BATCH: usize = 16;

/// Buffers for taking up to [`RECV_BATCH`] datagrams with one `recvmmsg`.
struct RecvBatch {
    bufs: Vec<u8>,
    addrs: Vec<libc::sockaddr_storage>,
    lens: [usize; RECV_BATCH],
}

impl RecvBatch {
    fn new() -> RecvBatch {
        RecvBatch {
            bufs: vec![0u8; RECV_BATCH * DATAGRAM_BYTES],
            // SAFETY: sockaddr_storage is plain data; all zeros is a valid (empty) value.
            addrs: vec![unsafe { std::mem::zeroed() }; RECV_BATCH],
            lens: [0; RECV_BATCH],
        }
    }

    /// Takes up to [`RECV_BATCH`] datagrams without blocking; how many.
    fn recv(&mut self, socket: &UdpSocket) -> std::io::Result<usize> {
        let mut iovs: Vec<libc::iovec> = self
            .bufs
            .chunks_mut(DATAGRAM_BYTES)
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: mmsghdr is plain data; all zeros is valid before the fields are set below.
        let mut hdrs: [libc::mmsghdr; RECV_BATCH] = unsafe { std::mem::zeroed() };
        for (k, h) in hdrs.iter_mut().enumerate() {
            h.msg_hdr.msg_name = (&mut self.addrs[k] as *mut libc::sockaddr_storage).cast();
            h.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            h.msg_hdr.msg_iov = &mut iovs[k];
            h.msg_hdr.msg_iovlen = 1;
        }
        // SAFETY: RECV_BATCH headers, each pointing at its own live address slot and one
        // iovec over its own DATAGRAM_BYTES of `bufs`; all outlive the call.
        let n = unsafe {
            libc::recvmmsg(
                socket.as_raw_fd(),
                hdrs.as_mut_ptr(),
                RECV_BATCH as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = n as usize;
        for (k, h) in hdrs.iter().enumerate().take(n) {
            self.lens[k] = h.msg_len as usize;
        }
        Ok(n)
    }

    /// Datagram `k` of the last batch: its sender and bytes.
    fn get(&self, k: usize) -> (SocketAddr, &[u8]) {
        let data = &self.bufs[k * DATAGRAM_BYTES..k * DATAGRAM_BYTES + self.lens[k]];
        (sockaddr_to(&self.addrs[k]), data)
    }
}

/// The socket address in `s` (unspecified for a family other than IPv4 or IPv6; QUIC then
/// finds no connection for it).
fn sockaddr_to(s: &libc::sockaddr_storage) -> SocketAddr {
    match s.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a = unsafe { &*(s as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            SocketAddr::from((
                std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            ))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a = unsafe { &*(s as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            SocketAddr::V6(std::net::SocketAddrV6::new(
                std::net::Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            ))
        }
        _ => SocketAddr::from(([0, 0, 0, 0], 0)),
    }
}

/// Sends one datagram; a full socket buffer drops it (QUIC retransmits what was lost).
fn send(socket: &UdpSocket, data: &[u8], to: SocketAddr) {
    match socket.send_to(data, to) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        Err(e) => tracing::debug!(%to, error = %e, len = data.len(), "message link: datagram not sent"),
    }
}

/// Sets "don't fragment" on `socket` (IPv4 or IPv6, after `addr`).
fn dont_fragment(socket: &UdpSocket, addr: SocketAddr) -> std::io::Result<()> {
    let (level, name, value) = match addr {
        SocketAddr::V4(_) => (libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_PROBE),
        SocketAddr::V6(_) => (libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IPV6_PMTUDISC_PROBE),
    };
    // SAFETY: an int option value from a live local, with its size.
    let r = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// How long the link waits for a message's answer, in tests.
#[cfg(test)]
const TEST_WAIT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests;
