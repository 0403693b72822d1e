//! The message link against real sockets on loopback: order, certificates, bounds, restarts.

use super::*;
use std::path::Path;

struct Collect(std::sync::mpsc::Sender<(String, PeerReq, Bytes)>);
impl LinkHandler for Collect {
    fn deliver(&self, from: &str, req: PeerReq, payload: Bytes) {
        let _ = self.0.send((from.to_string(), req, payload));
    }
}

/// A link of node `me` (certificates in `certs`) on `addr`, knowing one peer; the cluster
/// lists nodes "a" and "b".
fn link(certs: &Path, me: &str, addr: SocketAddr, peer: &str, peer_addr: SocketAddr) -> Arc<Link> {
    Arc::new(
        Link::for_node(
            certs,
            me,
            addr,
            [(peer.to_string(), peer_addr)].into(),
            vec!["a".into(), "b".into()],
        )
        .unwrap(),
    )
}

/// Posts pings to "b" with ids from `first` until one (or its echo) arrives on `rx` (a
/// message may be lost on a connection that is being closed); fails after [`TEST_WAIT`].
fn ping_until_delivered(a: &Link, rx: &std::sync::mpsc::Receiver<(String, PeerReq, Bytes)>, first: u64, what: &str) {
    let deadline = std::time::Instant::now() + TEST_WAIT;
    let mut id = first;
    loop {
        a.post("b", &PeerReq::LinkPing { id }, Bytes::new()).unwrap();
        if let Ok((_, PeerReq::LinkPing { id: back }, _)) = rx.recv_timeout(Duration::from_millis(200)) {
            assert!((first..=id).contains(&back), "ping {back} after {first}..={id}");
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{what}");
        id += 1;
    }
}

/// Two links with the cluster's certificates: messages arrive in order, whole, with the
/// sender's certificate name. A node of another CA, and a node of this CA that the
/// cluster does not list, get nothing delivered.
#[test]
fn messages_arrive_in_order_whole_and_only_from_the_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let names = ["a", "b", "c"].map(String::from);
    psls_ipc::certs::generate(dir.path(), "t", &names).unwrap();
    let other = tempfile::tempdir().unwrap();
    psls_ipc::certs::generate(other.path(), "u", &names).unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let make = |certs: &Path, me: &str, peer: &str, peer_addr: SocketAddr| link(certs, me, any, peer, peer_addr);
    // b listens; a, a stranger "c" of the same CA and an "a" of another CA send to it.
    let b = make(dir.path(), "b", "a", "127.0.0.1:9".parse().unwrap());
    let baddr = b.local_addr().unwrap();
    let a = make(dir.path(), "a", "b", baddr);
    let c = make(dir.path(), "c", "b", baddr);
    let fake = make(other.path(), "a", "b", baddr);
    let (tx, rx) = std::sync::mpsc::channel();
    let mut threads = Vec::new();
    for (l, h) in [(&b, Some(tx))]
        .into_iter()
        .chain([(&a, None), (&c, None), (&fake, None)])
    {
        let (l, h) = (l.clone(), h);
        threads.push(std::thread::spawn(move || {
            let (t2, _r2) = std::sync::mpsc::channel();
            l.run(Arc::new(Collect(h.unwrap_or(t2))))
        }));
    }
    c.post(
        "b",
        &PeerReq::LinkPing { id: u64::MAX },
        Bytes::from_static(b"stranger"),
    )
    .unwrap();
    fake.post("b", &PeerReq::LinkPing { id: u64::MAX }, Bytes::from_static(b"forged"))
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let n = 2000u64;
    for i in 0..n {
        let payload = Bytes::from(vec![(i % 251) as u8; (i as usize * 37) % 9000]);
        a.post("b", &PeerReq::LinkPing { id: i }, payload).unwrap();
    }
    for i in 0..n {
        let (from, req, payload) = rx.recv_timeout(TEST_WAIT).expect("message");
        assert_eq!(from, "a");
        assert!(matches!(req, PeerReq::LinkPing { id } if id == i), "{req:?} at {i}");
        assert_eq!(payload.len(), (i as usize * 37) % 9000);
        assert!(payload.iter().all(|&x| x == (i % 251) as u8));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(rx.try_recv().is_err(), "nothing but a's messages is delivered");
    assert_eq!(a.posted(), n);
    assert!(matches!(
        a.post("nobody", &PeerReq::LinkPing { id: 0 }, Bytes::new()),
        Err(NetError::UnknownPeer(_))
    ));
    let big = Bytes::from(vec![0u8; MAX_PEER_MSG]);
    assert!(a.post("b", &PeerReq::LinkPing { id: 0 }, big).is_err());
    for l in [&a, &b, &c, &fake] {
        l.close();
    }
    for t in threads {
        t.join().unwrap();
    }
}

/// A peer that restarts on the same port (a new endpoint, the same certificate and reset
/// key): after `drop_peer` (what membership does when it hears the new incarnation) the
/// next message dials afresh and arrives; and even without it, the stale connection is
/// reset by the new endpoint and later messages get through on a new one.
#[test]
fn a_restarted_peer_is_reached_again() {
    let dir = tempfile::tempdir().unwrap();
    let names = ["a", "b"].map(String::from);
    psls_ipc::certs::generate(dir.path(), "t", &names).unwrap();
    let bind =
        |me: &str, addr: SocketAddr, peer: &str, peer_addr: SocketAddr| link(dir.path(), me, addr, peer, peer_addr);
    let start = |l: &Arc<Link>| {
        let (tx, rx) = std::sync::mpsc::channel();
        let l2 = l.clone();
        (std::thread::spawn(move || l2.run(Arc::new(Collect(tx)))), rx)
    };
    let b = bind("b", "127.0.0.1:0".parse().unwrap(), "a", "127.0.0.1:9".parse().unwrap());
    let baddr = b.local_addr().unwrap();
    let a = bind("a", "127.0.0.1:0".parse().unwrap(), "b", baddr);
    let (ta, _ra) = start(&a);
    let (tb, rb) = start(&b);
    let ping = |id: u64| {
        a.post("b", &PeerReq::LinkPing { id }, Bytes::from_static(b"x"))
            .unwrap()
    };
    let got = |rx: &std::sync::mpsc::Receiver<(String, PeerReq, Bytes)>| match rx.recv_timeout(TEST_WAIT) {
        Ok((_, PeerReq::LinkPing { id }, _)) => id,
        other => panic!("{other:?}"),
    };
    ping(1);
    assert_eq!(got(&rb), 1);
    // b restarts on the same port.
    b.close();
    tb.join().unwrap();
    drop(b);
    let b = bind("b", baddr, "a", "127.0.0.1:9".parse().unwrap());
    let (tb, rb) = start(&b);
    a.drop_peer("b", 0);
    ping(2);
    assert_eq!(got(&rb), 2, "delivered to the new incarnation after drop_peer");
    // Restart again, this time without drop_peer: the first message may be lost on the
    // stale connection (the new endpoint resets it); a later one gets through.
    b.close();
    tb.join().unwrap();
    drop(b);
    let b = bind("b", baddr, "a", "127.0.0.1:9".parse().unwrap());
    let (tb, rb) = start(&b);
    ping_until_delivered(&a, &rb, 3, "never reached the restarted peer");
    for l in [&a, &b] {
        l.close();
    }
    ta.join().unwrap();
    tb.join().unwrap();
}

/// Bad frames from a peer of the cluster: a malformed message is dropped and the next one
/// on the stream still arrives; a frame longer than the limit closes the connection (the
/// sender dials again for later messages). Nothing panics.
#[test]
fn bad_frames_are_dropped_or_close_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    psls_ipc::certs::generate(dir.path(), "t", &["a".to_string(), "b".to_string()]).unwrap();
    let bind = |me: &str, peer: &str, peer_addr: SocketAddr| {
        link(dir.path(), me, "127.0.0.1:0".parse().unwrap(), peer, peer_addr)
    };
    let b = bind("b", "a", "127.0.0.1:9".parse().unwrap());
    let a = bind("a", "b", b.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let (b2, a2) = (b.clone(), a.clone());
    let tb = std::thread::spawn(move || b2.run(Arc::new(Collect(tx))));
    let (txa, _rxa) = std::sync::mpsc::channel();
    let ta = std::thread::spawn(move || a2.run(Arc::new(Collect(txa))));
    let got = || match rx.recv_timeout(TEST_WAIT) {
        Ok((_, PeerReq::LinkPing { id }, _)) => id,
        other => panic!("{other:?}"),
    };
    // A frame whose header is not a message: dropped; the stream goes on.
    let mut junk = 6u32.to_le_bytes().to_vec();
    junk.extend_from_slice(&[0xff; 6]);
    a.post_raw("b", Bytes::from(junk)).unwrap();
    a.post("b", &PeerReq::LinkPing { id: 1 }, Bytes::new()).unwrap();
    assert_eq!(got(), 1);
    // A frame announcing more than the limit: the connection is closed at once, without
    // waiting for the rest.
    let too_long = ((MAX_PEER_MSG + 1) as u32).to_le_bytes().to_vec();
    a.post_raw("b", Bytes::from(too_long)).unwrap();
    // Later messages get through again, on a new connection.
    ping_until_delivered(&a, &rx, 2, "no message after the bad frame");
    for l in [&a, &b] {
        l.close();
    }
    ta.join().unwrap();
    tb.join().unwrap();
}

/// Echoes every message back to its sender through the link it is given.
struct Echo(std::sync::OnceLock<Arc<Link>>);
impl LinkHandler for Echo {
    fn deliver(&self, from: &str, req: PeerReq, payload: Bytes) {
        if let Some(l) = self.0.get() {
            l.post(from, &req, payload).unwrap();
        }
    }
}

/// One connection carries both directions: `b` answers `a` on the connection `a` dialled
/// (the address `b` has for `a` takes no connection, so an answer that needed a dial of its
/// own would never arrive), in order, whole. News that `a` restarted drops that connection only
/// if its frames came from an older incarnation. `b` answers again on the connection `a` dials
/// after losing the first.
#[test]
fn the_peer_answers_on_the_connection_that_was_dialled() {
    let dir = tempfile::tempdir().unwrap();
    psls_ipc::certs::generate(dir.path(), "t", &["a".to_string(), "b".to_string()]).unwrap();
    let nowhere: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let b = link(dir.path(), "b", any, "a", nowhere);
    let a = link(dir.path(), "a", any, "b", b.local_addr().unwrap());
    let echo = Arc::new(Echo(std::sync::OnceLock::new()));
    let _ = echo.0.set(b.clone());
    let b2 = b.clone();
    let tb = std::thread::spawn(move || b2.run(echo));
    let (tx, rx) = std::sync::mpsc::channel();
    let a2 = a.clone();
    let ta = std::thread::spawn(move || a2.run(Arc::new(Collect(tx))));
    let n = 2000u64;
    for i in 0..n {
        let payload = Bytes::from(vec![(i % 251) as u8; (i as usize * 53) % 9000]);
        a.post("b", &PeerReq::LinkPing { id: i }, payload).unwrap();
    }
    for i in 0..n {
        let (from, req, payload) = rx.recv_timeout(TEST_WAIT).expect("an answer");
        assert_eq!(from, "b");
        assert!(matches!(req, PeerReq::LinkPing { id } if id == i), "{req:?} at {i}");
        assert_eq!(payload.len(), (i as usize * 53) % 9000);
        assert!(payload.iter().all(|&x| x == (i % 251) as u8));
    }
    assert_eq!(b.posted(), n, "b answered each message once");
    // b hears that a runs as the incarnation its frames came from (a restart whose
    // connection came before its heartbeat): the connection stays, and answers still come.
    b.drop_peer("a", 0);
    b.post("a", &PeerReq::LinkPing { id: n }, Bytes::new()).unwrap();
    match rx.recv_timeout(TEST_WAIT) {
        Ok((_, PeerReq::LinkPing { id }, _)) => assert_eq!(id, n),
        other => panic!("nothing from b after news of the same incarnation: {other:?}"),
    }
    // News of a later incarnation: b drops the connection (a sees it closed); what b sends
    // next needs a connection of its own, to an address where nobody listens.
    b.drop_peer("a", 1);
    b.post("a", &PeerReq::LinkPing { id: n + 1 }, Bytes::new()).unwrap();
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "b still sent on the dropped connection"
    );
    // a dials again; b, whose own connection failed, answers on a's.
    ping_until_delivered(&a, &rx, n + 2, "no answer after b dropped the connection");
    // a forgets the connection (as if it had restarted) and dials again: b answers on the
    // new connection (it could not dial a itself).
    a.drop_peer("b", 0);
    ping_until_delivered(&a, &rx, n + 1000, "no answer on the new connection");
    for l in [&a, &b] {
        l.close();
    }
    ta.join().unwrap();
    tb.join().unwrap();
}

/// A peer that refuses connections is not dialled again at every message: after a failed
/// dial the next waits a jittered, doubling time (posts meanwhile fail at once), and a peer
/// heard again is dialled at once.
#[test]
fn failed_dials_back_off_and_a_peer_heard_again_is_dialled_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let names = ["a", "b"].map(String::from);
    psls_ipc::certs::generate(dir.path(), "t", &names).unwrap();
    // A port with nobody listening: connections to it are refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap();
    drop(closed);
    let a = link(dir.path(), "a", "127.0.0.1:0".parse().unwrap(), "b", closed_addr);
    let runner = a.clone();
    let (tx, _rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || runner.run(Arc::new(Collect(tx))));
    let ping = |id| a.post("b", &PeerReq::LinkPing { id }, Bytes::new());
    assert!(ping(1).is_ok(), "the first post dials");
    // The refusal comes back through the link thread: then posts fail without a dial.
    let deadline = std::time::Instant::now() + TEST_WAIT;
    let mut refused = 0;
    while std::time::Instant::now() < deadline {
        match ping(2) {
            Err(NetError::Unreachable { message, .. }) if message.contains("dials failed") => {
                refused += 1;
                break;
            }
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    assert_eq!(refused, 1, "posts after a refused dial fail at once");
    let backoff = a.peers[a.index["b"]].out.locked().backoff;
    let (until, failures) = backoff.expect("a backoff");
    assert_eq!(failures, 1);
    let wait = until.saturating_duration_since(std::time::Instant::now());
    assert!(
        wait <= Duration::from_millis(100),
        "the first wait is at most 100 ms: {wait:?}"
    );
    // Heard again: the next post dials at once.
    a.heard_from("b");
    assert!(ping(3).is_ok(), "a peer heard again is dialled at once");
    // News that it restarted clears the backoff too.
    let deadline = std::time::Instant::now() + TEST_WAIT;
    while a.peers[a.index["b"]].out.locked().backoff.is_none() {
        assert!(std::time::Instant::now() < deadline, "the second dial was not refused");
        std::thread::sleep(Duration::from_millis(5));
    }
    a.drop_peer("b", 7);
    assert!(ping(4).is_ok(), "a peer that restarted is dialled at once");
    for n in 2..=6u32 {
        let full = Duration::from_millis(100) * (1 << (n - 1));
        let full = full.min(Duration::from_secs(2));
        let w = dial_backoff(n);
        assert!(
            w >= full / 2 && w <= full,
            "wait {n}: {w:?} not within {:?}..={full:?}",
            full / 2
        );
    }
    a.close();
    t.join().unwrap();
}

type Inbox = std::sync::mpsc::Receiver<(String, PeerReq, Bytes)>;

/// Running links of nodes `names` (one cluster, certificates in `certs`), each knowing all the
/// others, closing quiet connections after `idle` and keeping at most `max[i]` open; with
/// what each receives and its thread.
fn mesh(
    certs: &Path,
    names: &[&str],
    idle: Duration,
    max: &[usize],
) -> (Vec<Arc<Link>>, Vec<Inbox>, Vec<std::thread::JoinHandle<()>>) {
    mesh_tuned(certs, names, &|i, l| l.with_limits(idle, max[i]))
}

/// Running links of nodes `names` as [`mesh`], each made by `tune` (with its index).
fn mesh_tuned(
    certs: &Path,
    names: &[&str],
    tune: &dyn Fn(usize, Link) -> Link,
) -> (Vec<Arc<Link>>, Vec<Inbox>, Vec<std::thread::JoinHandle<()>>) {
    let all: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    // Free ports, taken again by the links at once (std's listener sets SO_REUSEADDR).
    let addrs: Vec<SocketAddr> = names
        .iter()
        .map(|_| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        })
        .collect();
    let (mut links, mut inboxes, mut threads) = (Vec::new(), Vec::new(), Vec::new());
    for (i, me) in names.iter().enumerate() {
        let peers = names
            .iter()
            .zip(&addrs)
            .filter(|(n, _)| *n != me)
            .map(|(n, a)| (n.to_string(), *a))
            .collect();
        let l = Arc::new(tune(
            i,
            Link::for_node(certs, me, addrs[i], peers, all.clone()).unwrap(),
        ));
        let (tx, rx) = std::sync::mpsc::channel();
        let runner = l.clone();
        threads.push(std::thread::spawn(move || runner.run(Arc::new(Collect(tx)))));
        links.push(l);
        inboxes.push(rx);
    }
    (links, inboxes, threads)
}

/// Closes `links` and waits for their threads.
fn stop_all(links: &[Arc<Link>], threads: Vec<std::thread::JoinHandle<()>>) {
    for l in links {
        l.close();
    }
    for t in threads {
        t.join().unwrap();
    }
}

/// Waits until `done` holds, for at most [`TEST_WAIT`].
fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + TEST_WAIT;
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The ids of `n` pings from `from` on `rx`, in the order they came.
fn pings(rx: &Inbox, from: &str, n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| match rx.recv_timeout(TEST_WAIT) {
            Ok((f, PeerReq::LinkPing { id }, _)) if f == from => id,
            other => panic!("message {i} of {n} from {from}: {other:?}"),
        })
        .collect()
}

/// A connection that carried nothing for the idle time is closed by both ends together (no
/// connection stays open on either), and the next message, either way, dials again.
#[test]
fn a_quiet_connection_is_closed_by_both_ends_and_the_next_message_dials_again() {
    let dir = tempfile::tempdir().unwrap();
    psls_ipc::certs::generate(dir.path(), "t", &["a".to_string(), "b".to_string()]).unwrap();
    let (links, rx, threads) = mesh(dir.path(), &["a", "b"], Duration::from_millis(100), &[256, 256]);
    let (a, b) = (&links[0], &links[1]);
    a.post("b", &PeerReq::LinkPing { id: 1 }, Bytes::new()).unwrap();
    assert_eq!(pings(&rx[1], "a", 1), [1]);
    assert_eq!(a.open_connections(), 1, "a sends on the connection it dialled");
    wait_until("the quiet connection was not closed", || {
        a.open_connections() == 0 && b.open_connections() == 0
    });
    assert_eq!((a.closes(), b.closes()), (1, 1), "one close, done by both ends");
    b.post("a", &PeerReq::LinkPing { id: 2 }, Bytes::new()).unwrap();
    assert_eq!(pings(&rx[0], "b", 1), [2], "b dials a after the close");
    wait_until("the second connection was not closed", || {
        a.open_connections() == 0 && b.open_connections() == 0
    });
    assert_eq!((a.closes(), b.closes()), (2, 2));
    stop_all(&links, threads);
}

/// Both ends post to each other with pauses around the idle time, so that connections close
/// while messages cross them both ways: every message arrives, once, in the order posted.
#[test]
fn closes_lose_nothing_and_keep_the_order_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    psls_ipc::certs::generate(dir.path(), "t", &["a".to_string(), "b".to_string()]).unwrap();
    let (links, rx, threads) = mesh(dir.path(), &["a", "b"], Duration::from_millis(12), &[256, 256]);
    let n = 1500usize;
    let senders: Vec<_> = [(0usize, "b", 11u64), (1, "a", 29)]
        .into_iter()
        .map(|(i, to, seed)| {
            let l = links[i].clone();
            std::thread::spawn(move || {
                let mut x = seed;
                for id in 0..n as u64 {
                    l.post(
                        to,
                        &PeerReq::LinkPing { id },
                        Bytes::from(vec![7u8; (x % 5000) as usize]),
                    )
                    .unwrap();
                    // xorshift: mostly back to back, now and then a pause around the idle time.
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x % 16 == 0 {
                        std::thread::sleep(Duration::from_millis(6 + x % 20));
                    }
                }
            })
        })
        .collect();
    let want: Vec<u64> = (0..n as u64).collect();
    assert_eq!(pings(&rx[1], "a", n), want, "a to b");
    assert_eq!(pings(&rx[0], "b", n), want, "b to a");
    for s in senders {
        s.join().unwrap();
    }
    let closes = links[0].closes() + links[1].closes();
    assert!(closes >= 4, "connections closed under way: {closes}");
    wait_until("connections stayed open after the last message", || {
        links.iter().all(|l| l.open_connections() == 0)
    });
    stop_all(&links, threads);
}

/// A node allowed one connection that talks to two peers in turn closes the least recently
/// used one for each new one: every message arrives in order, and it ends with one open.
#[test]
fn past_the_bound_the_least_recently_used_connection_closes() {
    let dir = tempfile::tempdir().unwrap();
    let names = ["a", "b", "c"];
    psls_ipc::certs::generate(dir.path(), "t", &names.map(String::from)).unwrap();
    let (links, rx, threads) = mesh(dir.path(), &names, Duration::from_secs(3600), &[1, 256, 256]);
    let a = &links[0];
    let rounds = 60u64;
    for id in 0..rounds {
        for to in ["b", "c"] {
            a.post(to, &PeerReq::LinkPing { id }, Bytes::new()).unwrap();
        }
        if id % 3 == 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let want: Vec<u64> = (0..rounds).collect();
    assert_eq!(pings(&rx[1], "a", rounds as usize), want, "a to b");
    assert_eq!(pings(&rx[2], "a", rounds as usize), want, "a to c");
    wait_until("a kept more than one connection", || a.open_connections() <= 1);
    assert!(
        a.closes() >= 2,
        "a closed connections to stay within its bound: {}",
        a.closes()
    );
    stop_all(&links, threads);
}

/// A node allowed two dials in flight that posts to eight peers at once holds the messages of
/// those whose dial waits for its turn, and sends them, in order, once it goes: never more
/// than two handshakes under way, and every message arrives.
#[test]
fn dials_wait_for_a_turn_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let names = ["a", "b", "c", "d", "e", "f", "g", "h", "i"];
    psls_ipc::certs::generate(dir.path(), "t", &names.map(String::from)).unwrap();
    let (links, rx, threads) = mesh_tuned(dir.path(), &names, &|i, l| if i == 0 { l.with_max_dials(2) } else { l });
    let a = links[0].clone();
    let most = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (a, most, stop) = (a.clone(), most.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                most.fetch_max(a.dials_in_flight(), Ordering::Relaxed);
                std::thread::yield_now();
            }
        })
    };
    let n = 50u64;
    for id in 0..n {
        for to in &names[1..] {
            a.post(to, &PeerReq::LinkPing { id }, Bytes::new()).unwrap();
        }
    }
    let want: Vec<u64> = (0..n).collect();
    for (i, to) in names.iter().enumerate().skip(1) {
        assert_eq!(pings(&rx[i], "a", n as usize), want, "a to {to}");
    }
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    let most = most.load(Ordering::Relaxed);
    assert!((1..=2).contains(&most), "dials in flight at once: {most}");
    assert_eq!(a.dials_in_flight(), 0);
    stop_all(&links, threads);
}
