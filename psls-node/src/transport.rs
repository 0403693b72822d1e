//! QUIC transport between daemons: one cached connection per peer, one bidirectional stream
//! per request. Incoming connections are accepted only from certificates of the cluster CA; the
//! peer's name comes from its certificate.
//!
//! One-way messages ([`Transport::post`]: the coherence protocol's) go on one long-lived
//! unidirectional stream per peer, as length-prefixed frames, written by one task per peer
//! that takes everything queued at once; the receiver handles a stream's frames in order on
//! one task. No stream is opened and no task spawned per message: a message costs a queue
//! push and its bytes. Delivery is in order and at most once: a batch whose write fails is
//! dropped (the peer died or restarted; the protocol learns that from membership).

use crate::peer::{self, PeerReq, PeerResp, MAX_PEER_MSG};
use crate::tls;
use psls_svm::PAGE_SIZE;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("unknown peer {0}")]
    UnknownPeer(String),
    #[error("cannot reach {peer}: {message}")]
    Unreachable { peer: String, message: String },
    #[error("request to {peer} timed out after {ms} ms")]
    Timeout { peer: String, ms: u64 },
    #[error("bad response from {peer}: {message}")]
    BadResponse { peer: String, message: String },
}

/// Socket buffer size asked for: room for bursts at full speed (measured: export throughput
/// rose ~40% over the 208 KiB default on loopback, where drops cost retransmissions).
const UDP_BUFFER_BYTES: usize = 4 << 20;

/// One-way messages written per batch, at most (and the queue is drained in such batches).
const POST_BATCH: usize = 256;
/// One-way messages queued for one peer, at most: a full queue means the peer has stopped
/// reading for a long time; the message is refused (and logged by the caller) rather than
/// memory growing without bound.
const POST_QUEUE: usize = 1 << 16;

/// A one-way message waiting for its peer's writer task.
struct Posted {
    /// Frame length prefix and encoded header.
    head: bytes::Bytes,
    payload: bytes::Bytes,
}

pub struct Transport {
    endpoint: quinn::Endpoint,
    addrs: HashMap<String, SocketAddr>,
    conns: Mutex<HashMap<String, quinn::Connection>>,
    dial: HashMap<String, tokio::sync::Mutex<()>>,
    /// Per peer, the queue of its writer task (started on the first post).
    outboxes: Mutex<HashMap<String, tokio::sync::mpsc::Sender<Posted>>>,
    /// One-way messages queued for sending since start.
    posted: std::sync::atomic::AtomicU64,
}

impl Transport {
    /// Binds the node's UDP address.
    pub fn bind(
        addr: SocketAddr,
        server: quinn::ServerConfig,
        client: quinn::ClientConfig,
        reset_key: Arc<ring::hmac::Key>,
        peers: HashMap<String, SocketAddr>,
    ) -> std::io::Result<Transport> {
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
        let dial = peers.keys().map(|k| (k.clone(), tokio::sync::Mutex::new(()))).collect();
        Ok(Transport {
            endpoint,
            addrs: peers,
            conns: Mutex::new(HashMap::new()),
            dial,
            outboxes: Mutex::new(HashMap::new()),
            posted: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// One-way messages (the coherence protocol's, barriers', locks') queued for sending
    /// since start.
    pub fn posted(&self) -> u64 {
        self.posted.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    async fn connection(&self, peer: &str) -> Result<quinn::Connection, NetError> {
        let cached = |s: &Self| {
            s.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(peer)
                .filter(|c| c.close_reason().is_none())
                .cloned()
        };
        if let Some(c) = cached(self) {
            return Ok(c);
        }
        let addr = *self.addrs.get(peer).ok_or_else(|| NetError::UnknownPeer(peer.into()))?;
        let lock = self.dial.get(peer).ok_or_else(|| NetError::UnknownPeer(peer.into()))?;
        let _g = lock.lock().await;
        if let Some(c) = cached(self) {
            return Ok(c);
        }
        let conn = self
            .endpoint
            .connect(addr, &tls::server_name(peer))
            .map_err(|e| unreachable(peer, &e))?
            .await
            .map_err(|e| unreachable(peer, &e))?;
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(peer.to_string(), conn.clone());
        Ok(conn)
    }

    /// Sends `req` with `payload` to `peer` (the payload is not copied); waits at most `timeout` for its response.
    pub async fn request(
        &self,
        peer: &str,
        req: &PeerReq,
        payload: bytes::Bytes,
        timeout: Duration,
    ) -> Result<(PeerResp, bytes::Bytes), NetError> {
        let header = peer::encode_header(req);
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

    /// Queues `req` with `payload` for `peer` as a one-way message and returns at once (see
    /// the module documentation for delivery). Must be called within the tokio runtime's
    /// reach (it may start the peer's writer task on it).
    pub fn post(
        self: &Arc<Self>,
        runtime: &tokio::runtime::Handle,
        peer: &str,
        req: &PeerReq,
        payload: bytes::Bytes,
        timeout: Duration,
    ) -> Result<(), NetError> {
        if !self.addrs.contains_key(peer) {
            return Err(NetError::UnknownPeer(peer.into()));
        }
        let header = peer::encode_header(req);
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
        let mut msg = Posted {
            head: head.into(),
            payload,
        };
        let mut boxes = self.outboxes.lock().unwrap_or_else(|e| e.into_inner());
        // At most twice: a writer task that ended (runtime shutting down) is replaced once.
        for _ in 0..2 {
            let tx = boxes.entry(peer.to_string()).or_insert_with(|| {
                let (tx, rx) = tokio::sync::mpsc::channel(POST_QUEUE);
                runtime.spawn(self.clone().pump(peer.to_string(), rx, timeout));
                tx
            });
            match tx.try_send(msg) {
                Ok(()) => {
                    self.posted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return Ok(());
                }
                Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                    return Err(unreachable(
                        peer,
                        &format!("{POST_QUEUE} one-way messages already queued"),
                    ));
                }
                Err(tokio::sync::mpsc::error::TrySendError::Closed(back)) => {
                    msg = back;
                    boxes.remove(peer);
                }
            }
        }
        Err(unreachable(peer, &"its writer task is gone"))
    }

    /// The writer task of `peer`'s one-way messages.
    async fn pump(self: Arc<Self>, peer: String, mut rx: tokio::sync::mpsc::Receiver<Posted>, timeout: Duration) {
        let mut stream: Option<(quinn::Connection, quinn::SendStream)> = None;
        let mut batch: Vec<Posted> = Vec::with_capacity(POST_BATCH);
        while let Some(first) = rx.recv().await {
            batch.push(first);
            while batch.len() < POST_BATCH {
                match rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            let mut chunks: Vec<bytes::Bytes> = Vec::with_capacity(2 * batch.len());
            for m in batch.drain(..) {
                chunks.push(m.head);
                if !m.payload.is_empty() {
                    chunks.push(m.payload);
                }
            }
            // A stream on a connection known to be closed is replaced before writing.
            if stream.as_ref().is_some_and(|(c, _)| c.close_reason().is_some()) {
                stream = None;
            }
            let n = chunks.len();
            let write = async {
                if stream.is_none() {
                    let conn = self.connection(&peer).await?;
                    let send = conn.open_uni().await.map_err(|e| unreachable(&peer, &e))?;
                    stream = Some((conn, send));
                }
                let (_, send) = stream.as_mut().expect("opened above");
                send.write_all_chunks(&mut chunks)
                    .await
                    .map_err(|e| unreachable(&peer, &e))
            };
            let r = match tokio::time::timeout(timeout, write).await {
                Ok(r) => r,
                Err(_) => Err(NetError::Timeout {
                    peer: peer.clone(),
                    ms: timeout.as_millis() as u64,
                }),
            };
            if let Err(e) = r {
                tracing::warn!(peer = %peer, error = %e, messages = n, "one-way messages dropped");
                if let Some((c, _)) = stream.take() {
                    c.close(0u32.into(), b"reset");
                }
                self.drop_connection(&peer);
            }
        }
    }

    /// Runs `talk` on the connection to `peer` within `timeout`. A timeout or a broken
    /// connection drops the cached connection: the peer may have restarted behind it, so the
    /// next call dials afresh.
    async fn exchange<T, F, Fut>(&self, peer: &str, timeout: Duration, talk: F) -> Result<T, NetError>
    where
        F: FnOnce(quinn::Connection) -> Fut,
        Fut: std::future::Future<Output = Result<T, NetError>>,
    {
        let fut = async {
            let conn = self.connection(peer).await?;
            talk(conn).await
        };
        let r = match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(NetError::Timeout {
                peer: peer.into(),
                ms: timeout.as_millis() as u64,
            }),
        };
        if matches!(r, Err(NetError::Timeout { .. } | NetError::Unreachable { .. })) {
            self.drop_connection(peer);
        }
        r
    }

    /// Forgets the cached connection to `peer` (after it restarted, say).
    pub fn drop_connection(&self, peer: &str) {
        if let Some(c) = self.conns.lock().unwrap_or_else(|e| e.into_inner()).remove(peer) {
            c.close(0u32.into(), b"reset");
        }
    }
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

/// Handles the one-way messages of one stream in order until it ends.
async fn read_posts<H: Handler>(mut recv: quinn::RecvStream, handler: Arc<H>, name: String) {
    loop {
        let mut prefix = [0u8; 4];
        match recv.read_exact(&mut prefix).await {
            Ok(()) => {}
            Err(quinn::ReadExactError::FinishedEarly(0)) => return,
            Err(e) => {
                tracing::debug!(peer = %name, error = %e, "one-way message stream ended");
                return;
            }
        }
        let len = u32::from_le_bytes(prefix) as usize;
        if len > MAX_PEER_MSG {
            tracing::warn!(peer = %name, len, "one-way message too large; stream dropped");
            let _ = recv.stop(1u32.into());
            return;
        }
        let mut body = bytes::BytesMut::with_capacity(len);
        while body.len() < len {
            match recv.read_chunk(len - body.len(), true).await {
                Ok(Some(c)) => body.extend_from_slice(&c.bytes),
                Ok(None) => {
                    tracing::warn!(peer = %name, "one-way message stream ended inside a message");
                    return;
                }
                Err(e) => {
                    tracing::debug!(peer = %name, error = %e, "one-way message stream ended");
                    return;
                }
            }
        }
        match peer::decode::<PeerReq>(body.freeze()) {
            Ok((req, payload)) => {
                handler.clone().handle(name.clone(), req, payload).await;
            }
            // The frame boundary is known, so the next message is still read.
            Err(e) => tracing::warn!(peer = %name, error = %e, "dropped malformed one-way message"),
        }
    }
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

/// Accepts connections until the endpoint closes.
pub async fn serve<H: Handler>(endpoint: quinn::Endpoint, handler: Arc<H>, known: Arc<Vec<String>>) {
    while let Some(incoming) = endpoint.accept().await {
        let handler = handler.clone();
        let known = known.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(%remote, error = %e, "refused peer connection (TLS handshake failed)");
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
                        Ok(recv) => {
                            // A stream of one-way messages: handled in order, never answered.
                            tokio::spawn(read_posts(recv, handler.clone(), name.clone()));
                            continue;
                        }
                        Err(_) => return,
                    },
                };
                let handler = handler.clone();
                let name = name.clone();
                tokio::spawn(async move {
                    let body = match read_body(&mut recv, MAX_PEER_MSG).await {
                        Ok(b) => b,
                        Err(e) => {
                            tracing::warn!(peer = %name, error = %e, "dropped peer message (too large or broken stream)");
                            let _ = send.reset(1u32.into());
                            return;
                        }
                    };
                    let (resp, payload) = match peer::decode::<PeerReq>(body) {
                        Ok((req, payload)) => handler.handle(name.clone(), req, payload).await,
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
