//! QUIC transport between daemons: one cached connection per peer, one bidirectional stream
//! per request. Incoming connections are accepted only from certificates of the cluster CA; the
//! peer's name comes from its certificate.
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
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Socket buffer size asked for: room for bursts at full speed (measured: export throughput
/// rose ~40% over the 208 KiB default on loopback, where drops cost retransmissions).
const UDP_BUFFER_BYTES: usize = 4 << 20;

pub struct Transport {
    endpoint: quinn::Endpoint,
    addrs: HashMap<String, SocketAddr>,
    conns: Mutex<HashMap<String, quinn::Connection>>,
    dial: HashMap<String, tokio::sync::Mutex<()>>,
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
        let dial = peers.keys().map(|k| (k.clone(), tokio::sync::Mutex::new(()))).collect();
        Ok(Transport {
            endpoint,
            addrs: peers,
            conns: Mutex::new(HashMap::new()),
            dial,
            link: Arc::new(link),
            stamp,
        })
    }

    /// One-way messages (the coherence protocol's, barriers', locks') queued for sending
    /// since start.
    pub fn posted(&self) -> u64 {
        self.link.posted()
    }

    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    async fn connection(&self, peer: &str) -> Result<quinn::Connection, NetError> {
        let cached = |s: &Self| {
            s.conns
                .locked()
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
        self.conns.locked().insert(peer.to_string(), conn.clone());
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

    /// `peer` restarted as `incarnation`: forgets both cached connections to it (messages
    /// still queued on the link were for its previous incarnation).
    pub fn peer_restarted(&self, peer: &str, incarnation: u64) {
        self.link.drop_peer(peer, incarnation);
        self.drop_connection(peer);
    }

    /// Forgets the cached request connection to `peer` (it timed out or broke).
    pub fn drop_connection(&self, peer: &str) {
        if let Some(c) = self.conns.locked().remove(peer) {
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
pub async fn serve<H: Handler>(
    endpoint: quinn::Endpoint,
    handler: Arc<H>,
    known: Arc<Vec<String>>,
    stamp: Arc<peer::Stamp>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let handler = handler.clone();
        let known = known.clone();
        let stamp = stamp.clone();
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
