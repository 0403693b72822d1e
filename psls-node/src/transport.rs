//! QUIC transport between daemons: one cached connection per peer, one bidirectional stream
//! per request. Incoming connections are accepted only from certificates of the cluster CA; the
//! peer's name comes from its certificate.
//!
//! Connections are made on demand and bounded (DESIGN §2b): a connection is dialled when a
//! request first needs it, by one background dial that every waiting request shares (a caller
//! that gives up does not abort the handshake, so a slow handshake is not started again and
//! again); at most [`MAX_DIALS_IN_FLIGHT`] handshakes are under way at once; a failed dial is
//! not tried again before a jittered, doubling wait ([`DIAL_BACKOFF_MIN`] to
//! [`DIAL_BACKOFF_MAX`], reset when the peer is heard); a connection unused for [`IDLE_CLOSE`]
//! is closed, and at most the bound ([`MAX_CONNECTIONS`] unless configured) are kept (the least
//! recently used idle one goes). Incoming connections past twice the bound are refused.
//!
//! One-way messages ([`Transport::post`]: the coherence protocol's, barriers', locks') do not
//! go through here but through the node's message link ([`crate::link`]), TLS over TCP.

use crate::failstop::Locked;
pub use crate::peer::NetError;
use crate::peer::{self, PeerReq, PeerResp, MAX_PEER_MSG};
use crate::tls;
use psls_svm::PAGE_SIZE;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most handshakes this node dials at once; more wait their turn.
pub const MAX_DIALS_IN_FLIGHT: usize = 8;
/// Most request connections this node keeps open to its peers.
pub const MAX_CONNECTIONS: usize = 256;
/// Most connections (both ways) the endpoint holds: more incoming ones are refused.
/// A connection no request used for this long is closed.
pub const IDLE_CLOSE: Duration = Duration::from_secs(30);
/// The wait after a first failed dial before the next; it doubles per failure up to
/// [`DIAL_BACKOFF_MAX`], and each wait is drawn between half and all of it.
pub const DIAL_BACKOFF_MIN: Duration = Duration::from_millis(100);
pub const DIAL_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Socket buffer size asked for: room for bursts at full speed (measured: export throughput
/// rose ~40% over the 208 KiB default on loopback, where drops cost retransmissions).
const UDP_BUFFER_BYTES: usize = 4 << 20;

/// What a dial gives the requests waiting for it.
type Dialled = Option<Result<quinn::Connection, String>>;

/// The request connection to one peer.
enum Slot {
    Ready {
        conn: quinn::Connection,
        /// When a request last took it.
        used: Instant,
        /// Requests under way on it (an idle close skips it while any is).
        busy: Arc<AtomicUsize>,
    },
    /// A dial under way: its result comes on the channel.
    Dialing(tokio::sync::watch::Receiver<Dialled>),
    /// The last dial failed: none before `until`.
    Failed { until: Instant, failures: u32, why: String },
}

type Slots = Arc<Mutex<HashMap<String, Slot>>>;

/// One request under way on a connection (see [`Slot::Ready::busy`]).
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn new(c: Arc<AtomicUsize>) -> Busy {
        c.fetch_add(1, Ordering::Relaxed);
        Busy(c)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

pub struct Transport {
    endpoint: quinn::Endpoint,
    addrs: HashMap<String, SocketAddr>,
    slots: Slots,
    dials: Arc<tokio::sync::Semaphore>,
    /// Connections kept open at once, at most, on each transport (the least recently used idle
    /// one goes).
    max_connections: usize,
    /// A connection no request used for this long is closed.
    idle_close: Duration,
    /// The state of the jitter's generator (xorshift).
    jitter: AtomicU64,
    /// One-way messages.
    pub link: Arc<crate::link::Link>,
    /// This node's incarnation on what it sends, and the test of what it receives.
    pub stamp: Arc<peer::Stamp>,
}

impl Transport {
    /// Binds the node's addresses: `addr` (UDP) for requests, `link` (TCP) for one-way messages.
    /// `peers`: every other node's two addresses; `known`: every node name of the cluster.
    pub fn bind(
        (addr, link): (SocketAddr, SocketAddr),
        server: quinn::ServerConfig,
        client: quinn::ClientConfig,
        reset_key: Arc<ring::hmac::Key>,
        link_tls: (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>),
        peers: HashMap<String, (SocketAddr, SocketAddr)>,
        known: Vec<String>,
    ) -> std::io::Result<Transport> {
        let stamp = Arc::new(peer::Stamp::default());
        let link = crate::link::Link::bind(
            link,
            link_tls.0,
            link_tls.1,
            peers.iter().map(|(k, v)| (k.clone(), v.1)).collect(),
            known,
        )?
        .stamped(stamp.clone());
        let peers: HashMap<String, SocketAddr> = peers.into_iter().map(|(k, v)| (k, v.0)).collect();
        let socket = std::net::UdpSocket::bind(addr)?;
        // Bigger socket buffers than the default 208 KiB, so bursts of large datagrams are not
        // dropped (the kernel caps them at net.core.[rw]mem_max).
        let s2 = socket2::SockRef::from(&socket);
        let _ = s2.set_recv_buffer_size(UDP_BUFFER_BYTES);
        let _ = s2.set_send_buffer_size(UDP_BUFFER_BYTES);
        let runtime = quinn::default_runtime().ok_or_else(|| std::io::Error::other("no async runtime"))?;
        let mut ecfg = quinn::EndpointConfig::new(reset_key);
        ecfg.max_udp_payload_size(crate::tls::MAX_UDP_PAYLOAD)
            .map_err(|e| std::io::Error::other(format!("QUIC endpoint: {e}")))?;
        let mut endpoint = quinn::Endpoint::new(ecfg, Some(server), socket, runtime)?;
        endpoint.set_default_client_config(client);
        // Different nodes draw different waits (their ports and pids differ).
        let seed = (u64::from(std::process::id()) << 16) ^ u64::from(addr.port()) ^ 0x9e37_79b9_7f4a_7c15;
        Ok(Transport {
            endpoint,
            addrs: peers,
            slots: Arc::new(Mutex::new(HashMap::new())),
            dials: Arc::new(tokio::sync::Semaphore::new(MAX_DIALS_IN_FLIGHT)),
            max_connections: MAX_CONNECTIONS,
            idle_close: IDLE_CLOSE,
            jitter: AtomicU64::new(seed | 1),
            link: Arc::new(link),
            stamp,
        })
    }

    /// The same transport keeping at most `max_connections` connections open at once (at
    /// least 1) and closing one unused for `idle_close`, on the request transport and on the
    /// message link, before either runs.
    pub fn with_limits(mut self, max_connections: usize, idle_close: Duration) -> Transport {
        self.max_connections = max_connections.max(1);
        self.idle_close = idle_close;
        if let Some(link) = Arc::get_mut(&mut self.link) {
            link.set_limits(idle_close, max_connections);
        }
        self
    }

    /// Connections kept open at once, at most, on each transport.
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// One-way messages (the coherence protocol's, barriers', locks') queued for sending
    /// since start.
    pub fn posted(&self) -> u64 {
        self.link.posted()
    }

    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    /// The connection to `peer`, and its count of requests under way: the cached one, or the
    /// result of the dial under way (started now if none is, unless the last one failed less
    /// than its backoff ago).
    async fn connection(&self, peer: &str) -> Result<(quinn::Connection, Arc<AtomicUsize>), NetError> {
        let addr = *self.addrs.get(peer).ok_or_else(|| NetError::UnknownPeer(peer.into()))?;
        let mut rx = {
            let mut slots = self.slots.locked();
            // Ok: a dial to wait for; Err: dial now, after that many failures in a row.
            let next = match slots.get_mut(peer) {
                Some(Slot::Ready { conn, used, busy }) if conn.close_reason().is_none() => {
                    *used = Instant::now();
                    return Ok((conn.clone(), busy.clone()));
                }
                Some(Slot::Dialing(rx)) => Ok(rx.clone()),
                Some(Slot::Failed { until, failures, why }) => {
                    let now = Instant::now();
                    if now < *until {
                        return Err(NetError::Unreachable {
                            peer: peer.into(),
                            message: format!(
                                "{why} (dialling again in {} ms)",
                                until.saturating_duration_since(now).as_millis()
                            ),
                        });
                    }
                    Err(*failures)
                }
                _ => Err(0),
            };
            match next {
                Ok(rx) => rx,
                Err(failures) => self.dial(&mut slots, peer, addr, failures),
            }
        };
        loop {
            let got = rx.borrow_and_update().clone();
            if let Some(r) = got {
                return match r {
                    Ok(conn) => {
                        let busy = match self.slots.locked().get(peer) {
                            Some(Slot::Ready { conn: c, busy, .. }) if c.stable_id() == conn.stable_id() => {
                                busy.clone()
                            }
                            _ => Arc::new(AtomicUsize::new(0)),
                        };
                        Ok((conn, busy))
                    }
                    Err(why) => Err(unreachable(peer, &why)),
                };
            }
            if rx.changed().await.is_err() {
                return Err(unreachable(peer, &"the dial was abandoned"));
            }
        }
    }

    /// Starts a dial of `peer` at `addr` in the background (`failures`: dials of it that failed
    /// in a row before); its result goes into `slots` and to the receiver returned.
    fn dial(
        &self,
        slots: &mut HashMap<String, Slot>,
        peer: &str,
        addr: SocketAddr,
        failures: u32,
    ) -> tokio::sync::watch::Receiver<Dialled> {
        let (tx, rx) = tokio::sync::watch::channel(None);
        slots.insert(peer.to_string(), Slot::Dialing(rx.clone()));
        let (endpoint, dials, all) = (self.endpoint.clone(), self.dials.clone(), self.slots.clone());
        let wait = self.backoff(failures + 1);
        let peer = peer.to_string();
        let max_connections = self.max_connections;
        tokio::spawn(async move {
            let r = async {
                let _turn = dials.acquire_owned().await.map_err(|e| e.to_string())?;
                let connecting = endpoint
                    .connect(addr, &tls::server_name(&peer))
                    .map_err(|e| e.to_string())?;
                connecting.await.map_err(|e| e.to_string())
            }
            .await;
            {
                let mut slots = all.locked();
                // Replaced meanwhile (the peer restarted): this dial's result is its waiters' only.
                if matches!(slots.get(&peer), Some(Slot::Dialing(r)) if r.same_channel(&tx.subscribe())) {
                    match &r {
                        Ok(conn) => {
                            evict_idle(&mut slots, max_connections.saturating_sub(1));
                            let ready = Slot::Ready {
                                conn: conn.clone(),
                                used: Instant::now(),
                                busy: Arc::new(AtomicUsize::new(0)),
                            };
                            slots.insert(peer.clone(), ready);
                        }
                        Err(why) => {
                            tracing::debug!(%peer, error = %why, wait_ms = wait.as_millis() as u64, "dial failed");
                            let failed = Slot::Failed {
                                until: Instant::now() + wait,
                                failures: failures.saturating_add(1),
                                why: why.clone(),
                            };
                            slots.insert(peer.clone(), failed);
                        }
                    }
                }
            }
            let _ = tx.send(Some(r));
        });
        rx
    }

    /// The wait after the `failures`-th failed dial in a row: doubling from
    /// [`DIAL_BACKOFF_MIN`] to [`DIAL_BACKOFF_MAX`], drawn between half and all of it.
    fn backoff(&self, failures: u32) -> Duration {
        let full = DIAL_BACKOFF_MIN
            .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
            .min(DIAL_BACKOFF_MAX);
        let mut x = self.jitter.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.jitter.store(x, Ordering::Relaxed);
        let half = full / 2;
        half + Duration::from_micros(x % (half.as_micros() as u64 + 1))
    }

    /// `peer` was heard: a dial to it may go at once (on the message link too).
    pub fn heard_from(&self, peer: &str) {
        {
            let mut slots = self.slots.locked();
            if matches!(slots.get(peer), Some(Slot::Failed { .. })) {
                slots.remove(peer);
            }
        }
        self.link.heard_from(peer);
    }

    /// Closes the connections no request used for the idle time ([`IDLE_CLOSE`] unless
    /// configured; none under way on them).
    pub fn close_idle(&self) {
        self.close_idle_for(self.idle_close)
    }

    /// Closes every connection no request is under way on now: after a one-off ask of many
    /// peers (a start's [`crate::svm::SvmShell::ask_peers`]), whose connections would
    /// otherwise stay open, pinging, for [`IDLE_CLOSE`]. The next request dials again.
    pub fn close_unused(&self) {
        self.close_idle_for(Duration::ZERO)
    }

    /// Closes the connections no request used for `idle`.
    fn close_idle_for(&self, idle: Duration) {
        let mut slots = self.slots.locked();
        let now = Instant::now();
        slots.retain(|_, s| match s {
            Slot::Ready { conn, used, busy } => {
                let unused = busy.load(Ordering::Relaxed) == 0 && now.duration_since(*used) >= idle;
                if unused {
                    conn.close(0u32.into(), b"idle");
                }
                !unused && conn.close_reason().is_none()
            }
            Slot::Failed { until, .. } => now < *until + DIAL_BACKOFF_MAX,
            Slot::Dialing(_) => true,
        });
    }

    /// How many request connections this node holds open.
    pub fn open_connections(&self) -> usize {
        self.slots
            .locked()
            .values()
            .filter(|s| matches!(s, Slot::Ready { .. }))
            .count()
    }

    /// Sends `req` with `payload` to `peer` (the payload is not copied); waits at most `timeout` for its response.
    pub async fn request(
        &self,
        peer: &str,
        req: &PeerReq,
        payload: bytes::Bytes,
        timeout: Duration,
    ) -> Result<(PeerResp, bytes::Bytes), NetError> {
        let header = peer::encode_request(self.stamp.incarnation(), req);
        self.exchange(peer, timeout, |conn| async move {
            let broken = |e: &dyn std::fmt::Display| unreachable(peer, e);
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| broken(&e))?;
            send.write_all(&header).await.map_err(|e| broken(&e))?;
            // Handed to quinn as is: no copy of the payload into its send buffer.
            send.write_chunk(payload).await.map_err(|e| broken(&e))?;
            send.finish().map_err(|e| broken(&e))?;
            let resp = read_body(&mut recv, MAX_PEER_MSG).await.map_err(|e| broken(&e))?;
            peer::decode::<PeerResp>(resp).map_err(|message| NetError::BadResponse {
                peer: peer.into(),
                message,
            })
        })
        .await
    }

    /// Sends `req` with `payload` to `peer` as a one-way message over the message link and
    /// returns at once (see [`crate::link`] for delivery).
    pub fn post(&self, peer: &str, req: &PeerReq, payload: bytes::Bytes) -> Result<(), NetError> {
        self.link.post(peer, req, payload)
    }

    /// Runs `talk` on the connection to `peer` within `timeout`. A timeout or a broken
    /// connection drops the cached connection: the peer may have restarted behind it, so the
    /// next call dials afresh.
    async fn exchange<T, F, Fut>(&self, peer: &str, timeout: Duration, talk: F) -> Result<T, NetError>
    where
        F: FnOnce(quinn::Connection) -> Fut,
        Fut: std::future::Future<Output = Result<T, NetError>>,
    {
        let mut used: Option<u64> = None;
        let fut = async {
            let (conn, busy) = self.connection(peer).await?;
            used = Some(conn.stable_id() as u64);
            let _busy = Busy::new(busy);
            talk(conn).await
        };
        let r = match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(NetError::Timeout {
                peer: peer.into(),
                ms: timeout.as_millis() as u64,
            }),
        };
        // Only a connection that failed a request goes (a dial still under way goes on).
        if let (Some(id), Err(NetError::Timeout { .. } | NetError::Unreachable { .. })) = (used, &r) {
            let mut slots = self.slots.locked();
            if matches!(slots.get(peer), Some(Slot::Ready { conn, .. }) if conn.stable_id() as u64 == id) {
                if let Some(Slot::Ready { conn, .. }) = slots.remove(peer) {
                    conn.close(0u32.into(), b"reset");
                }
            }
        }
        r
    }

    /// `peer` restarted as `incarnation`: forgets both cached connections to it (messages
    /// still queued on the link were for its previous incarnation), and the backoff of dials
    /// that failed before it restarted (the next request or message dials at once).
    pub fn peer_restarted(&self, peer: &str, incarnation: u64) {
        self.link.drop_peer(peer, incarnation);
        self.drop_connection(peer);
        let mut slots = self.slots.locked();
        if matches!(slots.get(peer), Some(Slot::Failed { .. })) {
            slots.remove(peer);
        }
    }

    /// Whether the last dial to `peer` failed (and nothing was heard from it since): the
    /// impression that it is unreachable, for a peer the failure detector does not watch.
    pub fn dial_failing(&self, peer: &str) -> bool {
        matches!(self.slots.locked().get(peer), Some(Slot::Failed { .. }))
    }

    /// Forgets the request connection to `peer` and any wait before dialling it again (it
    /// restarted: the next request dials afresh).
    pub fn drop_connection(&self, peer: &str) {
        if let Some(Slot::Ready { conn, .. }) = self.slots.locked().remove(peer) {
            conn.close(0u32.into(), b"reset");
        }
    }
}

/// Closes idle connections, least recently used first, until at most `keep` are open.
fn evict_idle(slots: &mut HashMap<String, Slot>, keep: usize) {
    loop {
        let ready = slots.values().filter(|s| matches!(s, Slot::Ready { .. })).count();
        if ready <= keep {
            return;
        }
        let oldest = slots
            .iter()
            .filter_map(|(p, s)| match s {
                Slot::Ready { used, busy, .. } if busy.load(Ordering::Relaxed) == 0 => Some((*used, p.clone())),
                _ => None,
            })
            .min();
        let Some((_, p)) = oldest else { return };
        if let Some(Slot::Ready { conn, .. }) = slots.remove(&p) {
            conn.close(0u32.into(), b"too many connections");
        }
    }
}

/// Warnings about refused handshakes: at most [`REFUSED_LOG_LINES`] lines per window of
/// [`REFUSED_LOG_EVERY_MS`], the first of a window with the count of those not logged before
/// it (a storm of them must not fill the disk; a few intruders are each logged).
const REFUSED_LOG_EVERY_MS: u64 = 5_000;
const REFUSED_LOG_LINES: u64 = 10;
/// The current window's start (ms since the first refusal, plus a window) and its lines.
static REFUSED_WINDOW: Mutex<(u64, u64)> = Mutex::new((0, 0));
static REFUSED_UNLOGGED: AtomicU64 = AtomicU64::new(0);

fn warn_refused(remote: SocketAddr, why: &dyn std::fmt::Display) {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let now_ms = START.get_or_init(Instant::now).elapsed().as_millis() as u64 + REFUSED_LOG_EVERY_MS;
    {
        let mut w = REFUSED_WINDOW.locked();
        if now_ms.saturating_sub(w.0) >= REFUSED_LOG_EVERY_MS {
            *w = (now_ms, 0);
        }
        if w.1 >= REFUSED_LOG_LINES {
            REFUSED_UNLOGGED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        w.1 += 1;
    }
    let more = REFUSED_UNLOGGED.swap(0, Ordering::Relaxed);
    tracing::warn!(%remote, error = %why, unlogged_before = more, "refused peer connection");
}

/// Why a message could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("message longer than {0} bytes")]
    TooLong(usize),
    #[error(transparent)]
    Stream(#[from] quinn::ReadError),
}

/// Reads a whole stream of at most `limit` bytes. Unlike `read_to_end`, nothing is zeroed or
/// resized: the chunks are gathered once into a buffer of the exact size (or kept as is when
/// the stream arrived in one chunk).
async fn read_body(recv: &mut quinn::RecvStream, limit: usize) -> Result<bytes::Bytes, ReadError> {
    let mut chunks: Vec<bytes::Bytes> = Vec::new();
    let mut total = 0usize;
    while let Some(c) = recv.read_chunk(usize::MAX, true).await? {
        total += c.bytes.len();
        if total > limit {
            return Err(ReadError::TooLong(limit));
        }
        chunks.push(c.bytes);
    }
    if chunks.len() == 1 {
        return Ok(chunks.pop().unwrap_or_default());
    }
    Ok(gather_aligned(&chunks, total))
}

/// Gathers a message that arrived in several chunks into one buffer placed so that its
/// payload (after the length-prefixed header) starts on a page boundary: page runs in it can
/// then go to the disk with direct I/O, without another copy.
fn gather_aligned(chunks: &[bytes::Bytes], total: usize) -> bytes::Bytes {
    let mut prefix = [0u8; 4];
    let mut got = 0;
    for c in chunks {
        let take = (4 - got).min(c.len());
        prefix[got..got + take].copy_from_slice(&c[..take]);
        got += take;
        if got == 4 {
            break;
        }
    }
    // A malformed prefix only misplaces the payload; decoding reports the error.
    let header_end = 4 + u32::from_le_bytes(prefix) as usize;
    let pad = (PAGE_SIZE - header_end % PAGE_SIZE) % PAGE_SIZE;
    let mut buf = peer::batch_pool().get_at_least(pad + total);
    buf.extend_from_slice(&[0u8; PAGE_SIZE][..pad]);
    for c in chunks {
        buf.extend_from_slice(c);
    }
    bytes::Bytes::from_owner(buf).slice(pad..)
}

/// A stream to `peer` broke.
fn unreachable(peer: &str, e: &dyn std::fmt::Display) -> NetError {
    NetError::Unreachable {
        peer: peer.into(),
        message: e.to_string(),
    }
}

/// What serves incoming requests.
pub trait Handler: Send + Sync + 'static {
    fn handle(
        self: Arc<Self>,
        from: String,
        req: PeerReq,
        payload: bytes::Bytes,
    ) -> BoxFuture<(PeerResp, bytes::Bytes)>;
}

/// A boxed, sendable future (boxing breaks the type cycle of a node calling itself).
pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// Accepts connections until the endpoint closes; past twice `max_connections` open, refuses
/// them.
pub async fn serve<H: Handler>(
    endpoint: quinn::Endpoint,
    handler: Arc<H>,
    known: Arc<Vec<String>>,
    stamp: Arc<peer::Stamp>,
    max_connections: usize,
) {
    while let Some(incoming) = endpoint.accept().await {
        if endpoint.open_connections() > 2 * max_connections {
            warn_refused(incoming.remote_address(), &"too many connections");
            incoming.refuse();
            continue;
        }
        let handler = handler.clone();
        let known = known.clone();
        let stamp = stamp.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    warn_refused(remote, &format_args!("TLS handshake failed: {e}"));
                    return;
                }
            };
            let Some(name) = tls::peer_name(&conn).filter(|n| known.contains(n)) else {
                tracing::warn!(%remote, "refused peer: certificate names no node of this cluster");
                conn.close(1u32.into(), b"unknown node");
                return;
            };
            loop {
                let (mut send, mut recv) = tokio::select! {
                    bi = conn.accept_bi() => match bi {
                        Ok(s) => s,
                        Err(_) => return,
                    },
                    uni = conn.accept_uni() => match uni {
                        Ok(mut recv) => {
                            // One-way messages come over the message link, not here.
                            let _ = recv.stop(1u32.into());
                            continue;
                        }
                        Err(_) => return,
                    },
                };
                let handler = handler.clone();
                let name = name.clone();
                let stamp = stamp.clone();
                tokio::spawn(async move {
                    let body = match read_body(&mut recv, MAX_PEER_MSG).await {
                        Ok(b) => b,
                        Err(e) => {
                            tracing::warn!(peer = %name, error = %e, "dropped peer message (too large or broken stream)");
                            let _ = send.reset(1u32.into());
                            return;
                        }
                    };
                    let (resp, payload) = match peer::decode_request(body) {
                        // A heartbeat still gets its answer: it carries the verdict, from
                        // which the fenced node learns that it must rejoin.
                        Ok((inc, req, _)) if !matches!(req, PeerReq::Heartbeat(_)) && stamp.fenced(&name, inc) => {
                            tracing::debug!(peer = %name, incarnation = inc, "request from an incarnation declared down: refused");
                            (
                                PeerResp::Error {
                                    kind: psls_ipc::ErrorKind::Unavailable,
                                    message: format!("incarnation {inc} of {name} was declared down"),
                                },
                                bytes::Bytes::new(),
                            )
                        }
                        Ok((_, req, payload)) => handler.handle(name.clone(), req, payload).await,
                        Err(e) => {
                            tracing::warn!(peer = %name, error = %e, "malformed peer message");
                            let kind = psls_ipc::ErrorKind::Invalid;
                            (
                                PeerResp::Error {
                                    kind,
                                    message: format!("malformed message: {e}"),
                                },
                                bytes::Bytes::new(),
                            )
                        }
                    };
                    if send.write_all(&peer::encode_header(&resp)).await.is_ok() {
                        let _ = send.write_chunk(payload).await;
                    }
                    let _ = send.finish();
                });
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct Answer;
    impl Handler for Answer {
        fn handle(
            self: Arc<Self>,
            _from: String,
            _req: PeerReq,
            _p: bytes::Bytes,
        ) -> BoxFuture<(PeerResp, bytes::Bytes)> {
            Box::pin(async { (PeerResp::Ok, bytes::Bytes::new()) })
        }
    }

    /// Node `me`'s transport (certificates in `certs`), knowing peer "b" at `b` (its request
    /// address; its link address unused).
    fn transport(certs: &std::path::Path, me: &str, b: SocketAddr) -> Transport {
        let (server, client) = tls::configs(certs, me).unwrap();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        Transport::bind(
            (any, any),
            server,
            client,
            tls::reset_key(certs, me).unwrap(),
            tls::link_configs(certs, me).unwrap(),
            [("b".to_string(), (b, "127.0.0.1:9".parse().unwrap()))].into(),
            vec!["a".into(), "b".into()],
        )
        .unwrap()
    }

    /// A peer whose handshakes fail (it has another CA's certificate) is dialled once by many
    /// requests at once, not again before the backoff, and again after it; a peer heard is
    /// dialled at once; an idle connection is closed, and the next request dials again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failed_dials_are_shared_and_backed_off_and_idle_connections_close() {
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let names = ["a", "b"].map(String::from);
        psls_ipc::certs::generate(dir.path(), "t", &names).unwrap();
        psls_ipc::certs::generate(other.path(), "u", &names).unwrap();
        // A "b" of another CA that counts the handshakes it is offered.
        let stranger = transport(other.path(), "b", "127.0.0.1:9".parse().unwrap());
        let offered = Arc::new(AtomicUsize::new(0));
        {
            let (ep, offered) = (stranger.endpoint().clone(), offered.clone());
            tokio::spawn(async move {
                while let Some(incoming) = ep.accept().await {
                    offered.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(async move { incoming.await.is_err() });
                }
            });
        }
        let a = Arc::new(transport(dir.path(), "a", stranger.endpoint().local_addr().unwrap()));
        let ask = |a: Arc<Transport>| async move {
            a.request("b", &PeerReq::Echo, bytes::Bytes::new(), Duration::from_secs(5))
                .await
        };
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..16 {
            set.spawn(ask(a.clone()));
        }
        while let Some(r) = set.join_next().await {
            assert!(matches!(r.unwrap(), Err(NetError::Unreachable { .. })));
        }
        assert_eq!(offered.load(Ordering::Relaxed), 1, "sixteen requests, one dial");
        // Within the backoff: refused at once, nothing dialled.
        match ask(a.clone()).await {
            Err(NetError::Unreachable { message, .. }) => assert!(message.contains("dialling again in"), "{message}"),
            r => panic!("{r:?}"),
        }
        assert_eq!(offered.load(Ordering::Relaxed), 1);
        // After it: dialled again, and the wait doubles (a third try right after is refused).
        tokio::time::sleep(DIAL_BACKOFF_MIN + Duration::from_millis(20)).await;
        assert!(ask(a.clone()).await.is_err());
        assert_eq!(offered.load(Ordering::Relaxed), 2);
        assert!(ask(a.clone()).await.is_err());
        assert_eq!(offered.load(Ordering::Relaxed), 2);
        // Heard: dialled at once.
        a.heard_from("b");
        assert!(ask(a.clone()).await.is_err());
        assert_eq!(offered.load(Ordering::Relaxed), 3);
        // News that it restarted: dialled at once too.
        a.peer_restarted("b", 2);
        assert!(ask(a.clone()).await.is_err());
        assert_eq!(offered.load(Ordering::Relaxed), 4);

        // The real b: answered; an idle connection is closed, the next request dials again.
        let b = transport(dir.path(), "b", "127.0.0.1:9".parse().unwrap());
        tokio::spawn(serve(
            b.endpoint().clone(),
            Arc::new(Answer),
            Arc::new(names.to_vec()),
            Arc::new(peer::Stamp::default()),
            MAX_CONNECTIONS,
        ));
        let a = Arc::new(transport(dir.path(), "a", b.endpoint().local_addr().unwrap()));
        assert!(matches!(ask(a.clone()).await, Ok((PeerResp::Ok, _))));
        assert_eq!(a.open_connections(), 1);
        a.close_idle_for(Duration::from_secs(60));
        assert_eq!(a.open_connections(), 1, "used just now");
        a.close_idle_for(Duration::ZERO);
        assert_eq!(a.open_connections(), 0);
        assert!(matches!(ask(a.clone()).await, Ok((PeerResp::Ok, _))));
        assert_eq!(a.open_connections(), 1);
    }

    #[test]
    fn the_backoff_doubles_to_its_cap_and_is_jittered() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let _g = rt.enter();
        let dir = tempfile::tempdir().unwrap();
        psls_ipc::certs::generate(dir.path(), "t", &["a".to_string(), "b".to_string()]).unwrap();
        let a = transport(dir.path(), "a", "127.0.0.1:9".parse().unwrap());
        for failures in 1..20u32 {
            let full = DIAL_BACKOFF_MIN
                .saturating_mul(1 << (failures - 1).min(16))
                .min(DIAL_BACKOFF_MAX);
            let draws: Vec<Duration> = (0..20).map(|_| a.backoff(failures)).collect();
            assert!(
                draws.iter().all(|d| *d >= full / 2 && *d <= full),
                "{failures}: {draws:?}"
            );
            assert!(draws.iter().any(|d| *d != draws[0]), "jittered");
        }
    }
}
