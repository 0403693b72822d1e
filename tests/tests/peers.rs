//! Running daemons against bad peers over real QUIC.
//!
//! - A client that trusts the cluster CA (so it accepts the server) but presents a foreign
//!   certificate naming a node of the cluster, or none at all: only the server's own check of
//!   client certificates can refuse it. Nothing it sends is served, on the request transport
//!   and on the message link, and the daemon goes on serving real peers.
//! - An authenticated peer sending well-formed but invalid coherence messages (unknown files,
//!   pages out of range, wrong incarnations, wrong-size page data, answers to transactions that
//!   do not exist, nodes outside the cluster): each is refused or dropped, and the daemon serves
//!   real clients with correct data afterwards.

use bytes::Bytes;
use psls_node::link::{Link, LinkHandler};
use psls_node::peer::{self, PeerReq, PeerResp, MAX_PEER_MSG};
use psls_svm::coherence::{Access, Envelope, Msg, Source, TxnId};
use psls_svm::{FileId, Incarnation, NodeId, PageId};
use psls_tests::{assert_same, random_bytes, wait_for, Cluster};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");

/// A QUIC client configuration that trusts the CA in `roots` (`ca.pem`) and presents the
/// certificate of `identity` (folder and node name), or none.
fn client_config(roots: &Path, identity: Option<(&Path, &str)>) -> quinn::ClientConfig {
    quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls_client(roots, identity)).unwrap(),
    ))
}

/// The same as a TLS client configuration (the message link's).
fn tls_client(roots: &Path, identity: Option<(&Path, &str)>) -> rustls::ClientConfig {
    let mut store = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(roots.join("ca.pem")).unwrap() {
        store.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(store);
    let mut cfg = match identity {
        Some((dir, name)) => {
            let certs = CertificateDer::pem_file_iter(dir.join(format!("{name}.pem")))
                .unwrap()
                .collect::<Result<Vec<_>, _>>()
                .unwrap();
            let key = PrivateKeyDer::from_pem_file(dir.join(format!("{name}.key"))).unwrap();
            builder.with_client_auth_cert(certs, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![psls_node::tls::ALPN.to_vec()];
    cfg
}

/// One request over a fresh connection to node `server` at `addr`; its answer or why none came.
async fn request(cfg: quinn::ClientConfig, addr: SocketAddr, server: &str, req: &PeerReq) -> Result<PeerResp, String> {
    let talk = async {
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).map_err(|e| e.to_string())?;
        ep.set_default_client_config(cfg);
        let conn = ep
            .connect(addr, &psls_node::tls::server_name(server))
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        send.write_all(&peer::encode_request(psls_tests::NEW_INCARNATION, req))
            .await
            .map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        let body = recv.read_to_end(MAX_PEER_MSG).await.map_err(|e| e.to_string())?;
        peer::decode::<PeerResp>(body).map(|(r, _)| r)
    };
    tokio::time::timeout(Duration::from_secs(10), talk)
        .await
        .map_err(|_| "no answer within 10 s".to_string())?
}

/// Collects what a link delivers.
struct Collect(Sender<(String, PeerReq)>);

impl LinkHandler for Collect {
    fn deliver(&self, from: &str, req: PeerReq, _payload: Bytes) {
        let _ = self.0.send((from.to_string(), req));
    }
}

/// A message link on `addr` with the server configuration of `me` (cluster certificates in
/// `certs`) and client configuration `client`, sending to the cluster's nodes; runs on a
/// thread of its own (stopped by [`Link::close`]).
fn link(
    c: &Cluster,
    me: &str,
    addr: SocketAddr,
    client: rustls::ClientConfig,
) -> (Arc<Link>, Receiver<(String, PeerReq)>) {
    let cfg = c.config();
    let (server, _) = psls_node::tls::link_configs(&cfg.cert_dir(), me).unwrap();
    let peers = cfg
        .all()
        .filter(|n| n.name != me)
        .map(|n| (n.name.clone(), n.link().unwrap()))
        .collect();
    let known = cfg.all().map(|n| n.name.clone()).collect();
    let l = Arc::new(
        Link::bind(addr, server, Arc::new(client), peers, known)
            .unwrap()
            .stamped(psls_tests::new_incarnation()),
    );
    let (tx, rx) = channel();
    let l2 = l.clone();
    std::thread::spawn(move || l2.run(Arc::new(Collect(tx))));
    (l, rx)
}

/// Posts pings with id `id` from `l` to `to` until the pong comes back to `rx` (a message may
/// be lost while a connection is set up); every other delivery is kept in `seen`.
fn ping(l: &Link, to: &str, id: u64, rx: &Receiver<(String, PeerReq)>, seen: &mut Vec<(String, PeerReq)>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        l.post(to, &PeerReq::LinkPing { id }, Bytes::new()).unwrap();
        let until = Instant::now() + Duration::from_millis(200);
        while let Ok(m) = rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            if matches!(m, (_, PeerReq::LinkPong { id: back }) if back == id) {
                return;
            }
            seen.push(m);
        }
        assert!(Instant::now() < deadline, "ping {id} to {to} never answered");
    }
}

fn file_id(c: &Cluster, name: &str) -> FileId {
    let stat: serde_json::Value = serde_json::from_str(&c.ok(&["stat", name, "--json"])).unwrap();
    FileId(stat["file"]["id"].as_str().and_then(|s| s.parse::<u64>().ok()).unwrap())
}

/// Store files of file `id` on `node`.
fn store_files_of(c: &Cluster, node: &str, id: FileId) -> usize {
    let cfg = c.config();
    let prefix = format!("f{:016x}.", id.0);
    std::fs::read_dir(cfg.data_dir(cfg.entry(node).unwrap()).join("pages"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        })
        .count()
}

/// The daemons' own check of client certificates. The test plays spare s0 (stopped): its
/// certificate is the control, a foreign CA's certificate naming s0 (or n1), and no
/// certificate, are the intruders. Every client trusts the cluster CA, so it accepts the
/// server: only the server can refuse.
#[test]
fn a_client_trusting_the_cluster_ca_with_a_foreign_certificate_is_refused() {
    let c = Cluster::start(4, 1);
    let data = random_bytes(1 << 20, 21);
    let local = c.write_local("in.bin", &data);
    c.ok(&["import", &local, "f"]);
    let f = file_id(&c, "f");
    c.kill("s0");
    let foreign = c.path("foreign");
    psls_ipc::certs::generate(&foreign, "evil", &["s0".into(), "n1".into()]).unwrap();
    let cfg = c.config();
    let certs = cfg.cert_dir();
    let n0 = cfg.entry("n0").unwrap().clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let _g = rt.enter();
    let intruders: [(&str, Option<(&Path, &str)>); 3] = [
        ("foreign s0", Some((&foreign, "s0"))),
        ("foreign n1", Some((&foreign, "n1"))),
        ("no certificate", None),
    ];

    // Request transport. The control: s0's own certificate is served.
    let r = rt.block_on(request(
        client_config(&certs, Some((&certs, "s0"))),
        n0.addr,
        "n0",
        &PeerReq::Echo,
    ));
    assert!(matches!(r, Ok(PeerResp::Ok)), "control: {r:?}");
    // The intruders ask n0 to delete its copies of f: never served.
    let held = store_files_of(&c, "n0", f);
    assert!(held > 0);
    let refused_before = c.log("n0").matches("refused peer connection").count();
    for (what, id) in intruders {
        let r = rt.block_on(request(
            client_config(&certs, id),
            n0.addr,
            "n0",
            &PeerReq::RemoveFile { file: f },
        ));
        assert!(r.is_err(), "{what}: the request was served: {r:?}");
    }
    wait_for(
        Duration::from_secs(10),
        "n0 did not log refusing the three handshakes",
        || c.log("n0").matches("refused peer connection").count() >= refused_before + 3,
    );
    assert_eq!(store_files_of(&c, "n0", f), held, "n0's copies of f were removed");

    // Message link. The test takes s0's link address with s0's certificate: whatever a
    // daemon posts to s0 (a pong) arrives here. The control: s0's ping is answered.
    let s0_link = cfg.entry("s0").unwrap().link().unwrap();
    let (me, rx) = link(&c, "s0", s0_link, tls_client(&certs, Some((&certs, "s0"))));
    let mut seen = Vec::new();
    ping(&me, "n0", 1, &rx, &mut seen);
    // Each intruder pings n0 for a while (a new connection after each refusal); a delivered
    // ping would be answered with a pong to s0, here.
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut fakes = Vec::new();
    for (k, (_, id)) in intruders.into_iter().enumerate() {
        let (fake, _) = link(&c, "s0", any, tls_client(&certs, id));
        for j in 0..10u64 {
            fake.post(
                "n0",
                &PeerReq::LinkPing {
                    id: 1000 + 100 * k as u64 + j,
                },
                Bytes::new(),
            )
            .unwrap();
            // Deliberate: spread the attempts over time (each may dial anew).
            std::thread::sleep(Duration::from_millis(50));
        }
        fakes.push(fake);
    }
    // A later control ping: n0 handled the intruders' attempts long before it answers this.
    ping(&me, "n0", 2, &rx, &mut seen);
    // Deliberate: a last window for a late pong of an intruder's ping to arrive.
    std::thread::sleep(Duration::from_millis(300));
    seen.extend(rx.try_iter());
    let leaked: Vec<_> = seen
        .iter()
        .filter(|(_, m)| matches!(m, PeerReq::LinkPong { id } if *id >= 1000))
        .collect();
    assert!(leaked.is_empty(), "intruders' pings were delivered: {leaked:?}");
    for l in fakes.iter().chain([&me]) {
        l.close();
    }

    // The cluster is unaffected: every copy of f is good, the file reads back whole.
    let scrub = c.ok(&["scrub"]);
    assert_eq!(
        scrub.trim(),
        "scrub: 1 files, 512 copies checked, 0 bad, 0 repaired, 0 unrepairable"
    );
    assert_same(&c.export("f", &[]), &data, "export after the intruders");
}

/// The first page index from `from` whose manager among 4 is `node`.
fn managed_by(file: FileId, node: u32, from: u64) -> PageId {
    let index = (from..)
        .find(|&i| psls_svm::coherence::manager_node(file, i, 4) == NodeId(node))
        .unwrap();
    PageId { file, index }
}

/// Invalid coherence messages from an authenticated peer: the test speaks as n1 (its
/// certificate; the real n1 keeps running) to n0, with messages that are well-formed but make
/// no sense. The daemon refuses or drops each, stays up, and its clients (and the real n1's)
/// read and write correct data afterwards.
#[test]
fn invalid_coherence_messages_are_refused_and_the_daemon_serves_on() {
    let c = Cluster::start(4, 0);
    let run_ok = |node: &str, args: &[&str]| {
        let o = c.client(node, PROBE).args(args).output().unwrap();
        assert!(
            o.status.success(),
            "probe {args:?} on {node}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    };
    // Pages of "shm" in n2's memory, managed all over the cluster (four runs of 16 pages).
    run_ok("n2", &["fill", "shm", "64", "1"]);
    let shm = file_id(&c, "shm");
    let st = c.status();
    let inc = |n: &str| Incarnation(st.nodes.iter().find(|s| s.name == n).unwrap().incarnation);
    let (me, to) = (inc("n1"), inc("n0"));
    let pid = c.pid("n0");
    let cfg = c.config();
    let (l, _rx) = link(
        &c,
        "n1",
        "127.0.0.1:0".parse().unwrap(),
        tls_client(&cfg.cert_dir(), Some((&cfg.cert_dir(), "n1"))),
    );
    let env = |msg: Msg| Envelope {
        from: NodeId(1),
        from_incarnation: me,
        to_incarnation: to,
        msg,
    };
    let txn = |node: u32, seq: u64| TxnId {
        node: NodeId(node),
        incarnation: if node == 0 { to } else { me },
        seq,
    };
    let unknown = FileId(0xdead_beef);
    let far = u64::MAX - 4096;
    let page4 = Bytes::from(vec![0x5a; 4096]);
    let mut bad: Vec<(&str, Envelope, Bytes)> = vec![
        (
            "request for a file that does not exist",
            env(Msg::Req {
                page: managed_by(unknown, 0, 0),
                txn: txn(1, 1),
                access: Access::Write,
                have: false,
            }),
            Bytes::new(),
        ),
        (
            "request for a page far beyond the file's end",
            env(Msg::Req {
                page: managed_by(shm, 0, far),
                txn: txn(1, 2),
                access: Access::Read,
                have: false,
            }),
            Bytes::new(),
        ),
        (
            "done for a transaction that does not exist",
            env(Msg::Done {
                page: managed_by(shm, 0, 0),
                txn: txn(1, 999_999),
                ok: true,
            }),
            Bytes::new(),
        ),
        (
            "nack for a transaction that does not exist",
            env(Msg::Nack {
                page: managed_by(shm, 0, 0),
                txn: txn(1, 999_998),
            }),
            Bytes::new(),
        ),
        (
            "invalidation ack for a transaction n0 never started",
            env(Msg::InvalAck {
                page: managed_by(shm, 1, 0),
                txn: txn(0, 999_997),
            }),
            Bytes::new(),
        ),
        (
            "page data of the wrong size, for no transaction",
            env(Msg::Data {
                page: managed_by(shm, 1, 0),
                txn: txn(0, 999_996),
                grant: None,
            }),
            Bytes::from_static(b"seventeen bytes!!"),
        ),
        (
            "page data that also grants a transaction n0 never started",
            env(Msg::Data {
                page: managed_by(shm, 1, far),
                txn: txn(0, 999_995),
                grant: Some(vec![(NodeId(3), me)]),
            }),
            Bytes::from(vec![1u8; 3 * 4096]),
        ),
        (
            "grant for a transaction n0 never started",
            env(Msg::Grant {
                page: managed_by(shm, 1, 0),
                txn: txn(0, 999_994),
                access: Access::Write,
                source: Source::Owner(NodeId(3), me),
                acks: vec![(NodeId(2), me), (NodeId(77), me)],
            }),
            Bytes::new(),
        ),
        (
            "grant from a node that does not manage the page",
            env(Msg::Grant {
                page: managed_by(shm, 2, 0),
                txn: txn(0, 999_993),
                access: Access::Read,
                source: Source::Disk,
                acks: vec![],
            }),
            Bytes::new(),
        ),
        (
            "forward of a page n0 does not hold, to a node outside the cluster",
            env(Msg::Fwd {
                page: managed_by(shm, 1, far),
                txn: txn(1, 3),
                to: NodeId(42),
                access: Access::Write,
                grant: None,
            }),
            Bytes::new(),
        ),
        (
            "invalidation of a page far out, acked to a node outside the cluster",
            env(Msg::Inval {
                page: managed_by(shm, 1, far),
                txn: TxnId {
                    node: NodeId(42),
                    incarnation: me,
                    seq: 4,
                },
            }),
            page4.clone(),
        ),
        (
            "deny for a transaction n0 never started",
            env(Msg::Deny {
                page: managed_by(unknown, 1, 0),
                txn: txn(0, 999_992),
                error: psls_svm::coherence::FaultError::PageLost,
            }),
            Bytes::new(),
        ),
        (
            "a message for another incarnation of n0",
            Envelope {
                to_incarnation: Incarnation(to.0 + 7),
                ..env(Msg::Req {
                    page: managed_by(shm, 0, 1),
                    txn: txn(1, 5),
                    access: Access::Write,
                    have: false,
                })
            },
            Bytes::new(),
        ),
        (
            "a message from an older incarnation of n1",
            Envelope {
                from_incarnation: Incarnation(0),
                ..env(Msg::Req {
                    page: managed_by(shm, 0, 1),
                    txn: txn(1, 6),
                    access: Access::Write,
                    have: false,
                })
            },
            Bytes::new(),
        ),
        (
            "a message from a node outside the cluster",
            Envelope {
                from: NodeId(9),
                ..env(Msg::Req {
                    page: managed_by(shm, 0, 1),
                    txn: TxnId {
                        node: NodeId(9),
                        incarnation: me,
                        seq: 7,
                    },
                    access: Access::Write,
                    have: false,
                })
            },
            Bytes::new(),
        ),
        (
            "a request for another node's transaction",
            env(Msg::Req {
                page: managed_by(unknown, 0, 5),
                txn: txn(0, 8),
                access: Access::Read,
                have: false,
            }),
            Bytes::new(),
        ),
    ];
    // Last, a marker n0 refuses with a log line of its own: once it is logged, n0 has handled
    // everything before it (one connection delivers in order).
    let marker = PageId {
        file: FileId(0x4d41_524b),
        index: (4_242_000..)
            .find(|&i| psls_svm::coherence::manager_node(FileId(0x4d41_524b), i, 4) == NodeId(3))
            .unwrap(),
    };
    bad.push((
        "marker: a request sent to a node that does not manage the page",
        env(Msg::Req {
            page: marker,
            txn: txn(1, 9),
            access: Access::Read,
            have: false,
        }),
        Bytes::new(),
    ));
    for (_, e, payload) in &bad[..bad.len() - 1] {
        l.post("n0", &PeerReq::Svm(e.clone()), payload.clone()).unwrap();
    }
    // Batches: two pages' data with one page of payload, and more messages than a batch may
    // carry. Each is dropped whole, with a line of its own.
    let data = |seq| {
        env(Msg::Data {
            page: managed_by(shm, 1, 0),
            txn: txn(0, seq),
            grant: None,
        })
    };
    l.post(
        "n0",
        &PeerReq::SvmBatch(vec![data(999_990), data(999_989)]),
        page4.clone(),
    )
    .unwrap();
    let many = vec![bad[0].1.clone(); psls_node::peer::MAX_SVM_BATCH + 1];
    l.post("n0", &PeerReq::SvmBatch(many), Bytes::new()).unwrap();
    let (_, e, payload) = &bad[bad.len() - 1];
    l.post("n0", &PeerReq::Svm(e.clone()), payload.clone()).unwrap();
    let marker_line = format!("on page {marker}: request sent to a node that does not manage the page");
    wait_for(Duration::from_secs(20), "n0 never handled the messages", || {
        let alive = psls_client::cluster::running_pid(&c.dir, "n0") == Some(pid);
        assert!(alive, "n0 died handling the messages:\n{}", c.log("n0"));
        c.log("n0").contains(&marker_line)
    });
    l.close();
    let log = c.log("n0");
    assert!(!log.contains("panicked"), "n0 panicked:\n{log}");
    assert!(
        log.matches("coherence message rejected").count() >= 3,
        "n0 logged too few refusals:\n{log}"
    );
    for line in [
        "coherence messages with page data of the wrong size: dropped",
        "more coherence messages in one batch than allowed: dropped",
    ] {
        assert_eq!(log.matches(line).count(), 1, "n0 did not log {line:?} once:\n{log}");
    }
    assert_eq!(c.pid("n0"), pid, "n0 restarted");
    assert!(
        c.status().nodes.iter().all(|n| n.state.to_string() == "up"),
        "a daemon went down"
    );
    // n0 (and the real n1, which got answers to transactions it never started) serve on:
    // reads of n2's pages, a write on n0, reads of it elsewhere, a new file.
    run_ok("n0", &["check", "shm", "64", "1"]);
    run_ok("n1", &["check", "shm", "64", "1"]);
    run_ok("n0", &["fill", "shm", "64", "2"]);
    for n in ["n1", "n2", "n3"] {
        run_ok(n, &["check", "shm", "64", "2"]);
    }
    run_ok("n1", &["fill", "after", "8", "3"]);
    run_ok("n0", &["check", "after", "8", "3"]);
}

/// A coherence message is taken as from the node its certificate names, never from the node it
/// claims: spare s0 (stopped; the test holds its certificate) tells n0 that n1 restarted. If
/// n0 believed it, it would drop every coherence message of the real n1 (an older
/// incarnation, gone for good) and n1's faults on pages n0 manages would never end.
#[test]
fn a_peer_cannot_speak_for_another_node_in_coherence_messages() {
    let c = Cluster::start(4, 1);
    let run = |node: &str, args: &[&str]| {
        let mut child = c
            .client(node, PROBE)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if t.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                panic!("probe {args:?} on {node} hung");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let o = child.wait_with_output().unwrap();
        assert!(
            o.status.success(),
            "probe {args:?} on {node}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    run("n2", &["fill", "shm", "64", "1"]);
    c.kill("s0");
    let st = c.status();
    let inc = |n: &str| Incarnation(st.nodes.iter().find(|s| s.name == n).unwrap().incarnation);
    let cfg = c.config();
    let s0_link = cfg.entry("s0").unwrap().link().unwrap();
    let (l, rx) = link(
        &c,
        "s0",
        s0_link,
        tls_client(&cfg.cert_dir(), Some((&cfg.cert_dir(), "s0"))),
    );
    // The forged message, then a ping: once s0 has its pong, n0 handled the forgery.
    let forged = Envelope {
        from: NodeId(1),
        from_incarnation: Incarnation(inc("n1").0 + 1),
        to_incarnation: inc("n0"),
        msg: Msg::Req {
            page: managed_by(FileId(0xdead_beef), 0, 0),
            txn: TxnId {
                node: NodeId(1),
                incarnation: Incarnation(inc("n1").0 + 1),
                seq: 1,
            },
            access: Access::Read,
            have: false,
        },
    };
    l.post("n0", &PeerReq::Svm(forged), Bytes::new()).unwrap();
    ping(&l, "n0", 1, &rx, &mut Vec::new());
    l.close();
    // The real n1 reads every page of shm: a run of 16 of them is managed by n0.
    run("n1", &["check", "shm", "64", "1"]);
    run("n0", &["check", "shm", "64", "1"]);
}

/// `fault-bench`'s round trips through a daemon: a request/response on the request transport
/// and a ping/pong on the message link, each answered once per round trip asked for (a
/// refactoring once answered a link ping run with nothing: the client waited forever).
#[test]
fn peer_pings_over_both_transports_answer_every_round_trip() {
    let c = Cluster::start(2, 0);
    for link in [false, true] {
        let mut client = psls_client::cluster::connect(&c.dir, Some("n0")).expect("connect to n0");
        let rtts = client.peer_ping("n1", 4096, 5, link).expect("peer ping");
        assert_eq!(rtts.len(), 5, "link={link}: one latency per round trip");
        assert!(rtts.iter().all(|&ns| ns > 0), "link={link}: {rtts:?}");
        // The connection goes on after the answer.
        let again = client.peer_ping("n1", 16, 2, link).expect("second peer ping");
        assert_eq!(again.len(), 2);
    }
    let mut client = psls_client::cluster::connect(&c.dir, Some("n0")).expect("connect to n0");
    let e = client
        .peer_ping("nobody", 4096, 1, true)
        .expect_err("an unknown peer is refused");
    assert!(e.to_string().contains("a node of the cluster"), "{e}");
}
