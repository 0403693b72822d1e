//! Mutual TLS for both transports (QUIC requests, the TCP message link): every node presents its certificate signed by the
//! cluster CA and accepts only peers whose certificate chains to that CA. The peer's node name
//! is read from its certificate (`NAME.psls`), never from what it claims in a message.

use anyhow::{anyhow, Context, Result};
use psls_ipc::certs::dns_name;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;

/// The peer protocol's name and version, checked in every handshake: nodes of different
/// versions refuse each other at once instead of misreading each other's messages. Bump it
/// whenever a peer message changes (2: `Fwd`/`Data` carry the acks of the grant they stand
/// for; releases are answered by notices; 3: metadata is replicated with epochs and a quorum,
/// `Meta` messages on the link instead of `MetaApply`/`MetaFetch`).
pub const ALPN: &[u8] = b"psls/11";

/// TLS 1.3 with AES-128-GCM only: 128-bit security, and the cheapest AEAD on CPUs with AES
/// instructions (10 AES rounds instead of AES-256's 14; page data is encrypted once by the
/// sender and once more decrypted by the receiver, so this is most of QUIC's per-byte cost).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256];
    Arc::new(p)
}

fn load(
    dir: &Path,
    name: &str,
) -> Result<(
    rustls::RootCertStore,
    Vec<CertificateDer<'static>>,
    PrivateKeyDer<'static>,
)> {
    let ca_path = dir.join("ca.pem");
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(&ca_path).with_context(|| format!("reading {}", ca_path.display()))? {
        roots.add(c.with_context(|| format!("parsing {}", ca_path.display()))?)?;
    }
    let cert_path = dir.join(format!("{name}.pem"));
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert_path)
        .with_context(|| format!("reading {}", cert_path.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("parsing {}", cert_path.display()))?;
    let key_path = dir.join(format!("{name}.key"));
    let key = PrivateKeyDer::from_pem_file(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
    Ok((roots, certs, key))
}

/// The largest UDP payload a node accepts (loopback's 64 KiB MTU less the IP and UDP headers).
pub const MAX_UDP_PAYLOAD: u16 = 65_535 - 28;

/// The largest datagram MTU discovery may probe for. quinn sends up to 10 datagrams in one
/// segmentation-offload (GSO) call, and the kernel takes at most 64 KiB per call: with larger
/// datagrams every batched send fails (`EMSGSIZE`), the losses look like an MTU black hole, and
/// the path falls back to 1200-byte packets — each costing about the CPU of a large one (seen
/// as 12,000-byte sends during checkpoints on loopback). A path that carries less (1500-byte
/// Ethernet) settles at its own size.
pub const MAX_DISCOVERED_PAYLOAD: u16 = MAX_UDP_PAYLOAD / 10;

/// The TLS server and client configurations of node `name`, as both transports use them:
/// TLS 1.3, the cluster CA both ways, the peer protocol's version as ALPN.
fn tls_configs(dir: &Path, name: &str) -> Result<(rustls::ServerConfig, rustls::ClientConfig)> {
    let (roots, certs, key) = load(dir, name)?;
    let roots = Arc::new(roots);
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
        .build()
        .map_err(|e| anyhow!("client verifier: {e}"))?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs.clone(), key.clone_key())
        .context("node certificate/key")?;
    server.alpn_protocols = vec![ALPN.to_vec()];
    let mut client = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_client_auth_cert(certs, key)
        .context("node certificate/key")?;
    client.alpn_protocols = vec![ALPN.to_vec()];
    Ok((server, client))
}

/// The message link's TLS configurations of node `name` (over TCP): no session tickets and no
/// resumption (a link connection lives as long as both nodes do), so nothing but handshake and
/// application records ever crosses it.
pub fn link_configs(dir: &Path, name: &str) -> Result<(Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>)> {
    let (mut server, mut client) = tls_configs(dir, name)?;
    server.send_tls13_tickets = 0;
    client.resumption = rustls::client::Resumption::disabled();
    Ok((Arc::new(server), Arc::new(client)))
}

/// QUIC server and client configurations of node `name`.
/// Most incoming connections waiting for their handshake at once (quinn refuses more).
pub const MAX_INCOMING_HANDSHAKES: usize = 64;

/// How often an otherwise silent QUIC connection sends a ping: well inside its 10 s idle
/// timeout, so that an open connection stays open until the transport closes it for want of
/// use (`transport::IDLE_CLOSE`). Not a failure detector (heartbeats are): a connection to a
/// peer that restarted is reset at its first packet, and a request on one that died times
/// out. A ping every 500 ms on each idle connection cost a node that had asked every peer at
/// its start (`SvmShell::ask_peers`) about 1 % of a core at 64 nodes until they closed.
pub const QUIC_KEEP_ALIVE_MS: u64 = 3000;

pub fn configs(dir: &Path, name: &str) -> Result<(quinn::ServerConfig, quinn::ClientConfig)> {
    let (server, client) = tls_configs(dir, name)?;

    let mut transport = quinn::TransportConfig::default();
    transport
        .max_concurrent_bidi_streams(1024u32.into())
        .max_concurrent_uni_streams(4096u32.into())
        .stream_receive_window((16u32 << 20).into())
        .receive_window((64u32 << 20).into())
        .send_window(64 << 20)
        .keep_alive_interval(Some(std::time::Duration::from_millis(QUIC_KEEP_ALIVE_MS)))
        .max_idle_timeout(Some(std::time::Duration::from_secs(10).try_into()?));
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(MAX_DISCOVERED_PAYLOAD);
    transport.mtu_discovery_config(Some(mtu));
    // Ask peers to acknowledge every 10th packet (or after 5 ms) rather than every other one:
    // most messages here are small and answered at once, so an acknowledgement usually rides
    // on the answer; separate acknowledgement packets cost about a quarter of the CPU of a
    // round trip on a loaded 2-core machine and buy nothing on a loss-free path.
    let mut acks = quinn::AckFrequencyConfig::default();
    acks.ack_eliciting_threshold(10u32.into())
        .max_ack_delay(Some(std::time::Duration::from_millis(5)));
    transport.ack_frequency_config(Some(acks));
    let transport = Arc::new(transport);

    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(quinn::crypto::rustls::QuicServerConfig::try_from(server)?));
    sc.transport_config(transport.clone());
    // Handshakes waiting to be accepted: a bound, not a queue that grows with the cluster.
    sc.max_incoming(MAX_INCOMING_HANDSHAKES);
    let mut cc = quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(client)?));
    cc.transport_config(transport);
    Ok((sc, cc))
}

/// A stateless-reset key that survives restarts (derived from the node's private key), so a
/// restarted node can tell peers at once that their old connections to it are gone, instead of
/// leaving them to time out.
pub fn reset_key(dir: &Path, name: &str) -> Result<Arc<ring::hmac::Key>> {
    let key_path = dir.join(format!("{name}.key"));
    let pem = std::fs::read(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"psls stateless reset v1\0");
    ctx.update(&pem);
    Ok(Arc::new(ring::hmac::Key::new(
        ring::hmac::HMAC_SHA256,
        ctx.finish().as_ref(),
    )))
}

/// The node name in a verified peer certificate chain.
pub fn peer_name(conn: &quinn::Connection) -> Option<String> {
    peer_name_of(conn.peer_identity())
}

/// The node name in a verified peer identity (a certificate chain), as QUIC reports it.
pub fn peer_name_of(identity: Option<Box<dyn std::any::Any>>) -> Option<String> {
    let any = identity?;
    let chain = any.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    name_in_chain(&chain)
}

/// The node name in a verified certificate chain (`NAME.psls` in the leaf's names).
pub fn name_in_chain(chain: &[CertificateDer<'_>]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(chain.first()?.as_ref()).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|g| match g {
        x509_parser::extensions::GeneralName::DNSName(d) => d.strip_suffix(".psls").map(str::to_string),
        _ => None,
    })
}

/// The server name to dial node `name` with.
pub fn server_name(name: &str) -> String {
    dns_name(name)
}

#[cfg(test)]
mod tests {
    /// Bulk transfers with the cluster's transport settings keep the path's discovered MTU:
    /// no batched send is refused (`EMSGSIZE`) and no loss burst is taken for an MTU black hole,
    /// which would leave the path on 1200-byte packets. (With MTU discovery allowed up to 64 KiB,
    /// this saw black holes and 1200 within the first megabytes.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bulk_transfers_keep_the_discovered_mtu() {
        let dir = tempfile::tempdir().unwrap();
        let names = ["a", "b"].map(String::from);
        psls_ipc::certs::generate(dir.path(), "t", &names).unwrap();
        let endpoint = |me: &str| {
            let (server, client) = super::configs(dir.path(), me).unwrap();
            let mut ecfg = quinn::EndpointConfig::new(super::reset_key(dir.path(), me).unwrap());
            ecfg.max_udp_payload_size(super::MAX_UDP_PAYLOAD).unwrap();
            let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let runtime = quinn::default_runtime().unwrap();
            let mut ep = quinn::Endpoint::new(ecfg, Some(server), socket, runtime).unwrap();
            ep.set_default_client_config(client);
            ep
        };
        let (a, b) = (endpoint("a"), endpoint("b"));
        let baddr = b.local_addr().unwrap();
        // b reads every stream to its end and answers with its length.
        let server = tokio::spawn(async move {
            let conn = b.accept().await.unwrap().await.unwrap();
            while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                tokio::spawn(async move {
                    let n = recv.read_to_end(4 << 20).await.unwrap().len() as u64;
                    send.write_all(&n.to_le_bytes()).await.unwrap();
                    send.finish().unwrap();
                });
            }
        });
        let conn = a.connect(baddr, &super::server_name("b")).unwrap().await.unwrap();
        let payload = bytes::Bytes::from(vec![7u8; 1 << 20]);
        // 64 MiB, 8 streams at a time (as a checkpoint's participant sends).
        for _ in 0..8 {
            let mut set = tokio::task::JoinSet::new();
            for _ in 0..8 {
                let (conn, payload) = (conn.clone(), payload.clone());
                set.spawn(async move {
                    let (mut send, mut recv) = conn.open_bi().await.unwrap();
                    send.write_chunk(payload).await.unwrap();
                    send.finish().unwrap();
                    u64::from_le_bytes(recv.read_to_end(8).await.unwrap().try_into().unwrap())
                });
            }
            while let Some(n) = set.join_next().await {
                assert_eq!(n.unwrap(), 1 << 20);
            }
        }
        let path = conn.stats().path;
        assert_eq!(path.black_holes_detected, 0, "{path:?}");
        assert!(path.current_mtu > 1200, "{path:?}");
        conn.close(0u32.into(), b"done");
        server.abort();
    }
}
