//! The QUIC transport against bad peers: a certificate from another CA, a certificate of the
//! right CA naming no node of the cluster, malformed and oversized messages. Each is refused
//! and the node keeps serving good peers.

use bytes::Bytes;
use psls_node::peer::{self, PeerReq, PeerResp, MAX_PEER_MSG};
use psls_node::transport::{serve, BoxFuture, Handler, Transport};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

struct Probe;

impl Handler for Probe {
    fn handle(self: Arc<Self>, _from: String, req: PeerReq, payload: Bytes) -> BoxFuture<(PeerResp, Bytes)> {
        Box::pin(async move {
            match req {
                PeerReq::Sync => (PeerResp::Ok, payload),
                // Answers whether the payload arrived page-aligned (direct-I/O ready).
                PeerReq::Echo => {
                    let aligned = (payload.as_ptr() as usize).is_multiple_of(4096);
                    (PeerResp::Ok, Bytes::from(vec![aligned as u8]))
                }
                _ => (PeerResp::NotCoordinator, Bytes::new()),
            }
        })
    }
}

fn free_addr() -> SocketAddr {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.local_addr().unwrap()
}

fn free_tcp_addr() -> SocketAddr {
    let s = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    s.local_addr().unwrap()
}

fn transport(certs: &std::path::Path, me: &str, addr: SocketAddr, peers: HashMap<String, SocketAddr>) -> Transport {
    let (server, client) = psls_node::tls::configs(certs, me).unwrap();
    let key = psls_node::tls::reset_key(certs, me).unwrap();
    let link_tls = psls_node::tls::link_configs(certs, me).unwrap();
    // The message link (TCP) is not under test here: any free port will do.
    let peers = peers.into_iter().map(|(k, a)| (k, (a, free_tcp_addr()))).collect();
    let known = vec!["n0".to_string(), "n1".to_string()];
    Transport::bind((addr, free_tcp_addr()), server, client, key, link_tls, peers, known).unwrap()
}

/// A raw QUIC stream exchange as node `me` (certs from `certs`) with the server at `addr`.
async fn raw(certs: &std::path::Path, me: &str, addr: SocketAddr, body: &[u8]) -> Result<Vec<u8>, String> {
    let (_, client) = psls_node::tls::configs(certs, me).map_err(|e| e.to_string())?;
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).map_err(|e| e.to_string())?;
    ep.set_default_client_config(client);
    let conn = ep
        .connect(addr, "n0.psls")
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all(body).await.map_err(|e| e.to_string())?;
    send.finish().map_err(|e| e.to_string())?;
    recv.read_to_end(MAX_PEER_MSG).await.map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_peers_are_refused_and_good_ones_served() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let foreign = dir.path().join("foreign");
    psls_ipc::certs::generate(&certs, "t", &["n0".into(), "n1".into(), "intruder".into()]).unwrap();
    psls_ipc::certs::generate(&foreign, "t", &["n1".into()]).unwrap();

    let a0 = free_addr();
    let server = transport(&certs, "n0", a0, HashMap::new());
    let known = Arc::new(vec!["n0".to_string(), "n1".to_string()]);
    tokio::spawn(serve(
        server.endpoint().clone(),
        Arc::new(Probe),
        known,
        server.stamp.clone(),
        server.max_connections(),
    ));

    let client = transport(&certs, "n1", free_addr(), HashMap::from([("n0".to_string(), a0)]));
    let t = Duration::from_secs(5);
    let (resp, payload) = client
        .request("n0", &PeerReq::Sync, bytes::Bytes::from_static(b"echo"), t)
        .await
        .unwrap();
    assert!(matches!(resp, PeerResp::Ok));
    assert_eq!(&payload[..], b"echo");

    // A payload that arrives in many chunks is gathered with its first byte on a page
    // boundary, whatever the header's length; the bytes are intact.
    let pages: Vec<u8> = (0..(1 << 20) + 4096).map(|i| (i % 251) as u8).collect();
    let (_, aligned) = client
        .request("n0", &PeerReq::Echo, Bytes::from(pages.clone()), t)
        .await
        .unwrap();
    assert_eq!(&aligned[..], &[1], "a large payload arrives page-aligned");
    let (_, back) = client
        .request("n0", &PeerReq::Sync, Bytes::from(pages.clone()), t)
        .await
        .unwrap();
    assert!(back == pages, "a large payload comes back intact");

    // Malformed: an answer with a clear error, not a crash.
    let out = raw(&certs, "n1", a0, &[9, 0, 0, 0, 0xff, 0xff]).await.unwrap();
    let (resp, _): (PeerResp, Bytes) = peer::decode(out).unwrap();
    match resp {
        PeerResp::Error { kind, message } => {
            assert_eq!(kind, psls_ipc::ErrorKind::Invalid);
            assert!(message.contains("malformed"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Oversized: the stream is reset without reading the rest.
    let huge = vec![0u8; MAX_PEER_MSG + 1];
    assert!(raw(&certs, "n1", a0, &huge).await.is_err());
    // A certificate of another CA fails the handshake; one of this CA naming no node of the
    // cluster is closed right after it.
    assert!(raw(&foreign, "n1", a0, &peer::encode_header(&PeerReq::Sync))
        .await
        .is_err());
    assert!(raw(&certs, "intruder", a0, &peer::encode_header(&PeerReq::Sync))
        .await
        .is_err());

    // Still serving.
    let (resp, _) = client
        .request("n0", &PeerReq::Sync, bytes::Bytes::new(), t)
        .await
        .unwrap();
    assert!(matches!(resp, PeerResp::Ok));
}
