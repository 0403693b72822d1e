//! Bad input from outside — config, CLI, clients, peers — gets one clear error and changes
//! nothing: the daemons keep running and committed files stay as they were.

use psls_tests::{assert_same, psls_bin, random_bytes, Cluster};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

fn node_bin() -> std::path::PathBuf {
    psls_tests::bin_dir().join("psls-node")
}

/// Runs psls-node, which must exit non-zero at once with a message containing `want`.
fn daemon_fails(config: &std::path::Path, node: &str, want: &str) {
    let o = Command::new(node_bin())
        .arg("--config")
        .arg(config)
        .arg("--node")
        .arg(node)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "psls-node should have failed");
    assert!(err.contains(want), "expected '{want}' in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn daemon_refuses_bad_config_missing_dir_and_busy_port() {
    let c = Cluster::init(2, 0, |_| {});
    let cfg_path = c.dir.join("cluster.toml");
    let good = std::fs::read_to_string(&cfg_path).unwrap();

    // `psls config check` says what is wrong before any daemon starts.
    assert!(c
        .ok(&["config", "check"])
        .contains("cluster.toml: valid (2 nodes, 0 spares)"));
    std::fs::write(&cfg_path, good.replace("[cluster]", "[cluster]\nbogus_key = 1")).unwrap();
    assert!(c.fails(&["config", "check"]).contains("bogus_key"));
    daemon_fails(&cfg_path, "n0", "bogus_key");
    // Warnings: a port in the kernel's ephemeral range, a missing certificate.
    std::fs::write(&cfg_path, &good).unwrap();
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
    let low: u16 = range.split_whitespace().next().unwrap().parse().unwrap();
    let n0_port = c.config().entry("n0").unwrap().addr.port();
    let ephemeral = good.replacen(&format!(":{n0_port}\""), &format!(":{}\"", low + 7), 1);
    assert_ne!(ephemeral, good);
    std::fs::write(&cfg_path, &ephemeral).unwrap();
    let cert = c.config().cert_dir().join("n1.pem");
    std::fs::rename(&cert, c.path("n1.pem")).unwrap();
    let o = c.run(&["config", "check"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("valid (2 nodes, 0 spares), 2 warnings"));
    assert!(
        err.contains(&format!(
            "node n0: addr port {} is in this machine's ephemeral port range",
            low + 7
        )),
        "{err}"
    );
    assert!(err.contains("n1.pem is missing"), "{err}");
    std::fs::rename(c.path("n1.pem"), &cert).unwrap();
    std::fs::write(
        &cfg_path,
        good.replace("heartbeat_timeout_ms = 1500", "heartbeat_timeout_ms = \"soon\""),
    )
    .unwrap();
    daemon_fails(&cfg_path, "n0", "heartbeat_timeout_ms");
    std::fs::write(&cfg_path, &good).unwrap();
    daemon_fails(&cfg_path, "n9", "not in");
    // Logs as JSON, one object a line, for operators' collectors; a bad log setting is refused.
    let logged = |envs: &[(&str, &str)]| {
        let o = Command::new(node_bin())
            .arg("--config")
            .arg(&cfg_path)
            .args(["--node", "n9"])
            .envs(envs.iter().copied())
            .output()
            .unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (code, err) = logged(&[("PSLS_LOG_FORMAT", "json")]);
    assert_eq!(code, Some(2), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON log line: {err}"));
    let j: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    assert_eq!(j["level"], "ERROR", "{line}");
    assert!(
        j["fields"]["message"].as_str().is_some_and(|m| m.contains("not in")),
        "{line}"
    );
    let (code, err) = logged(&[("PSLS_LOG_FORMAT", "xml")]);
    assert!(
        code == Some(2) && err.contains("PSLS_LOG_FORMAT=\"xml\": use text or json"),
        "{err}"
    );
    let (code, err) = logged(&[("PSLS_LOG", "info,quinn=loud")]);
    assert!(code == Some(2) && err.contains("is not a log filter"), "{err}");
    let err = c.fails(&["cluster", "status", "--dir", "/nonexistent/psls"]);
    assert!(err.contains("no cluster at"), "{err}");

    let cfg = c.config();
    let n0 = cfg.entry("n0").unwrap().clone();
    std::fs::rename(cfg.data_dir(&n0), c.path("moved")).unwrap();
    daemon_fails(&cfg_path, "n0", "does not exist");
    std::fs::rename(c.path("moved"), cfg.data_dir(&n0)).unwrap();

    let busy = std::net::UdpSocket::bind(n0.addr).unwrap();
    daemon_fails(&cfg_path, "n0", "port is in use");
    drop(busy);

    // A data dir that belongs to another node is refused.
    let n1 = cfg.entry("n1").unwrap().clone();
    std::fs::write(cfg.data_dir(&n1).join("node.id"), "cluster=psls\nnode=n0\n").unwrap();
    daemon_fails(&cfg_path, "n1", "belongs to another node");
    std::fs::remove_file(cfg.data_dir(&n1).join("node.id")).unwrap();

    // `cluster up` reports a daemon that cannot start.
    let busy = std::net::UdpSocket::bind(n1.addr).unwrap();
    let err = c.fails(&["cluster", "up", "--timeout-s", "20"]);
    assert!(err.contains("n1") && err.contains("in use"), "{err}");
    drop(busy);
    c.ok(&["cluster", "up"]);
}

#[test]
fn cli_errors_leave_files_intact() {
    let c = Cluster::start(4, 1);
    let data = random_bytes(300_000, 5);
    let local = c.write_local("a.bin", &data);
    c.ok(&["import", &local, "a"]);

    let cases: &[(&[&str], &str)] = &[
        (&["import", &local, "a"], "already exists"),
        (&["create", "a", "--size", "10"], "already exists"),
        (&["export", "nope", "/tmp/x"], "no file named 'nope'"),
        (&["stat", "nope"], "no file named 'nope'"),
        (&["rm", "nope"], "no file named 'nope'"),
        (&["import", "/nonexistent/file", "b"], "/nonexistent/file"),
        (&["create", "bad/name", "--size", "10"], "'/'"),
        (&["create", "huge", "--size", "1000000000000000"], "free"),
        (
            &["create", "huger", "--size", "18446744073709551615"],
            "largest PSLS file",
        ),
        (&["create", "m", "--size", "10", "--mode", "999"], "octal"),
        (&["create", "m", "--size", "ten"], "ten"),
        (&["create", "m", "--size", "1Q"], "unknown unit 'Q'"),
        (
            &["run", "-n", "1", "--checkpoint-timeout", "soon", "--", "true"],
            "'soon' is not a duration",
        ),
        (&["node", "replace", "1", "--with", "s0"], "is up"),
        (&["node", "replace", "7", "--with", "s0"], "no logical node 7"),
        (&["node", "replace", "1", "--with", "n2"], "already holds"),
        (&["cluster", "init"], "already exists"),
        (&["--node", "zz", "ls"], "no node named 'zz'"),
    ];
    for (args, want) in cases {
        let err = c.fails(args);
        assert!(err.contains(want), "psls {args:?}: expected '{want}' in: {err}");
    }
    let ls = c.ok(&["ls"]);
    assert_eq!(ls.lines().count(), 1, "{ls}");
    assert_same(&c.export("a", &[]), &data, "file after bad commands");
    assert!(c.status().nodes.iter().all(|n| n.state.to_string() == "up"));
}

#[test]
fn permissions_follow_owner_and_mode() {
    let c = Cluster::start(2, 0);
    // Let an unprivileged user reach the socket.
    for p in [c.tmp.path(), c.dir.as_path()] {
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    let data = random_bytes(10_000, 6);
    let local = c.write_local("p.bin", &data);
    c.ok(&["import", "--mode", "600", &local, "private"]);
    c.ok(&["import", "--mode", "644", &local, "public"]);
    let sock = c.config().socket_path(c.config().entry("n0").unwrap());
    let nobody = |args: &[&str]| {
        let o = Command::new(psls_bin())
            .args(args)
            .env("PSLS_SOCKET", &sock)
            .current_dir("/")
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (ok, err) = nobody(&["export", "private", "/dev/null"]);
    assert!(!ok && err.contains("permission denied"), "{err}");
    let (ok, err) = nobody(&["stat", "private"]);
    assert!(!ok && err.contains("permission denied"), "{err}");
    let (ok, err) = nobody(&["export", "public", "/dev/null"]);
    assert!(ok, "{err}");
    let o = Command::new(psls_bin())
        .args(["export", "public", "-"])
        .env("PSLS_SOCKET", &sock)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert!(o.status.success());
    assert_same(&o.stdout, &data, "export to stdout as another user");
    let (ok, err) = nobody(&["rm", "public"]);
    assert!(!ok && err.contains("permission denied"), "{err}");
    let (ok, err) = nobody(&["scrub"]);
    assert!(!ok && err.contains("permission denied"), "{err}");
    let (ok, err) = nobody(&["node", "replace", "1", "--with", "n1"]);
    assert!(!ok && err.contains("permission denied"), "{err}");
    // `cluster down` as another user stops nothing, and says so (it said "stopped 2 daemons").
    let o = Command::new(psls_bin())
        .arg("--dir")
        .arg(&c.dir)
        .args(["cluster", "down"])
        .current_dir("/")
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("could not stop 2 of the cluster's daemons")
            && err.contains("n0 (pid ")
            && err.contains("Operation not permitted"),
        "{err}"
    );
    assert!(c.status().nodes.iter().all(|n| n.state.to_string() == "up"));
    // Files nobody creates belong to nobody.
    let (ok, err) = nobody(&["create", "mine", "--size", "8K", "--mode", "600"]);
    assert!(ok, "{err}");
    let stat: serde_json::Value = serde_json::from_str(&c.ok(&["stat", "mine", "--json"])).unwrap();
    assert_eq!(stat["file"]["uid"], 65534);
    assert_eq!(stat["file"]["size"], 8192);
    assert_eq!(c.ok(&["ls"]).lines().count(), 3);
    assert_same(&c.export("private", &[]), &data, "private file");
}

#[test]
fn malformed_and_oversized_client_messages_are_refused() {
    let c = Cluster::start(2, 0);
    let sock = c.config().socket_path(c.config().entry("n1").unwrap());
    // One request, one answer frame (the daemon keeps the connection open after an error).
    let reply_raw = |bytes: &[u8]| -> String {
        let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(bytes).unwrap();
        let r: psls_ipc::Response = psls_ipc::proto::read_frame(&mut s).expect("an answer frame");
        format!("{r:?}")
    };
    let reply = |bytes: &[u8]| reply_raw(&[&psls_ipc::proto::hello()[..], bytes].concat());
    // A client of another build, or of none, is refused before its request is read.
    let ls = psls_ipc::proto::encode(&psls_ipc::Request::Ls).unwrap();
    let r = reply_raw(&ls);
    assert!(r.contains("did not open with the PSLS handshake"), "{r}");
    let mut other = psls_ipc::proto::hello();
    other[4] ^= 1;
    let r = reply_raw(&[&other[..], &ls].concat());
    let ours = format!("{:08x}", psls_ipc::proto::PROTOCOL);
    let theirs = format!("{:08x}", u32::from_le_bytes([other[4], other[5], other[6], other[7]]));
    assert!(
        r.contains(&format!(
            "client protocol {theirs} does not match this daemon's, {ours}"
        )),
        "{r}"
    );
    let r = reply(&ls);
    assert!(r.contains("Files"), "{r}");
    let r = reply(&u32::MAX.to_le_bytes());
    assert!(r.contains("exceeds the limit"), "{r}");
    let r = reply(&[5, 0, 0, 0, 0xee, 0xee, 0xee, 0xee, 0xee]);
    assert!(r.contains("malformed"), "{r}");
    // Import data without a begin.
    let r = reply(&psls_ipc::proto::encode(&psls_ipc::Request::ImportCommit).unwrap());
    assert!(r.contains("without ImportBegin"), "{r}");
    // More data than announced.
    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    s.write_all(&psls_ipc::proto::hello()).unwrap();
    s.write_all(
        &psls_ipc::proto::encode(&psls_ipc::Request::ImportBegin {
            name: "x".into(),
            size: 10,
            mode: 0o644,
            replace: false,
        })
        .unwrap(),
    )
    .unwrap();
    s.write_all(&psls_ipc::proto::encode(&psls_ipc::Request::ImportData { data: vec![1; 11] }).unwrap())
        .unwrap();
    let r: psls_ipc::Response = psls_ipc::proto::read_frame(&mut s).unwrap();
    assert!(format!("{r:?}").contains("more than the announced"), "{r:?}");
    // Descriptors: the wrong access mode, the wrong kind, or none at all.
    use std::os::fd::AsFd;
    let mut client = psls_client::Client::connect(&sock).unwrap();
    let write_only = std::fs::OpenOptions::new().write(true).open("/dev/null").unwrap();
    let e = client
        .import_fd(write_only.as_fd(), 10, "y", 0o644, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not open for reading"), "{e}");
    let dir = std::fs::File::open(c.tmp.path()).unwrap();
    let e = client
        .import_fd(dir.as_fd(), 10, "y", 0o644, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a file, pipe or device"), "{e}");
    let short = std::fs::File::open(c.write_local("short.bin", b"abc")).unwrap();
    let e = client
        .import_fd(short.as_fd(), 5000, "y", 0o644, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("reading the file to import"), "{e}");
    let r = reply(&psls_ipc::proto::encode(&psls_ipc::Request::ExportFd { name: "x".into() }).unwrap());
    assert!(r.contains("exactly one file descriptor"), "{r}");
    // The daemon is fine and nothing was created.
    assert!(c.status().nodes.iter().all(|n| n.state.to_string() == "up"));
    assert_eq!(c.ok(&["ls"]).lines().count(), 0);
}

#[test]
fn foreign_certificate_is_refused() {
    let a = Cluster::start(3, 0);
    // Cluster B has its own CA; its n0 is pointed at A's n1 and n2.
    let b = Cluster::init(3, 0, |_| {});
    let mut bcfg = b.config();
    let acfg = a.config();
    for i in 1..3 {
        bcfg.nodes[i].addr = acfg.nodes[i].addr;
    }
    bcfg.base_dir = b.dir.clone();
    std::fs::write(b.dir.join("cluster.toml"), bcfg.to_toml()).unwrap();
    let mut intruder = Command::new(node_bin())
        .arg("--config")
        .arg(b.dir.join("cluster.toml"))
        .arg("--node")
        .arg("n0")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while !(a.log("n1").contains("refused peer") && a.log("n2").contains("refused peer")) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "foreign node was not refused:\n{}",
            a.log("n1")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = intruder.kill();
    let _ = intruder.wait();
    // Cluster A is unaffected.
    let st = a.status();
    assert!(st.nodes.iter().all(|n| n.state.to_string() == "up"), "{st:?}");
}

/// A sync channel (a rank's barrier and lock calls, one datagram each way): a wrong or missing
/// descriptor is refused; a malformed, oversized or foreign request gets one clear error and
/// the channel goes on serving; so does a second call while one waits.
#[test]
fn sync_channel_bad_input_gets_clear_errors_and_the_channel_goes_on() {
    use nix::sys::socket::{
        recv, send, sendmsg, socketpair, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType,
    };
    use psls_ipc::proto::{self, Request, Response, MAX_SYNC_MSG};
    use std::os::fd::{AsRawFd, OwnedFd};
    let c = Cluster::start(2, 0);
    let sock = c.config().socket_path(c.config().entry("n1").unwrap());
    let mut conn = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    conn.write_all(&proto::hello()).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // SyncChannel on `conn` with the given descriptors; the daemon's answer.
    let register_on = |conn: &std::os::unix::net::UnixStream, fds: &[i32]| -> String {
        let frame = proto::encode(&Request::SyncChannel).unwrap();
        let cmsg = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
        let n = sendmsg::<()>(
            conn.as_raw_fd(),
            &[std::io::IoSlice::new(&frame)],
            cmsgs,
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        assert_eq!(n, frame.len());
        let r: Response = proto::read_frame(&mut &*conn).expect("an answer frame");
        format!("{r:?}")
    };
    let register = |fds: &[i32]| register_on(&conn, fds);
    let r = register(&[]);
    assert!(r.contains("exactly one descriptor"), "{r}");
    let (pipe_r, _pipe_w) = nix::unistd::pipe().unwrap();
    let r = register(&[pipe_r.as_raw_fd()]);
    assert!(r.contains("must be a SOCK_SEQPACKET socket"), "{r}");
    let pair = || socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();
    let (mine, theirs): (OwnedFd, OwnedFd) = pair();
    assert_eq!(register(&[theirs.as_raw_fd()]), "Ok");
    drop(theirs);
    let ten_s = nix::sys::time::TimeVal::new(10, 0);
    nix::sys::socket::setsockopt(&mine, nix::sys::socket::sockopt::ReceiveTimeout, &ten_s).unwrap();
    let call = |bytes: &[u8]| -> String {
        assert_eq!(send(mine.as_raw_fd(), bytes, MsgFlags::empty()).unwrap(), bytes.len());
        let mut buf = vec![0u8; MAX_SYNC_MSG];
        let n = recv(mine.as_raw_fd(), &mut buf, MsgFlags::empty()).expect("an answer datagram");
        let r: Response = proto::decode(&buf[..n]).unwrap();
        format!("{r:?}")
    };
    let req = |r: &Request| proto::encode_datagram(r).unwrap();
    let r = call(&[0xee; 7]);
    assert!(r.contains("bad sync request"), "{r}");
    let r = call(&vec![1u8; MAX_SYNC_MSG + 100]);
    assert!(r.contains("exceeds the limit"), "{r}");
    let r = call(&req(&Request::Status));
    assert!(r.contains("only Barrier, Lock and Unlock"), "{r}");
    // The channel still works: a barrier of one, a lock and its release, a second release.
    let job = "bad-input".to_string();
    let barrier = Request::Barrier {
        job: job.clone(),
        name: "b".into(),
        count: 1,
    };
    assert_eq!(call(&req(&barrier)), "Ok");
    assert_eq!(
        call(&req(&Request::Lock {
            job: job.clone(),
            id: 7
        })),
        "Ok"
    );
    assert_eq!(
        call(&req(&Request::Unlock {
            job: job.clone(),
            id: 7
        })),
        "Ok"
    );
    let r = call(&req(&Request::Unlock {
        job: job.clone(),
        id: 7,
    }));
    assert!(r.contains("lock 7 is not held by this rank"), "{r}");
    // A second call while one waits is refused; the waiting one is answered later.
    let two = Request::Barrier {
        job: job.clone(),
        name: "two".into(),
        count: 2,
    };
    assert_eq!(
        send(mine.as_raw_fd(), &req(&two), MsgFlags::empty()).unwrap(),
        req(&two).len()
    );
    let r = call(&req(&barrier));
    assert!(r.contains("one call at a time"), "{r}");
    let (mine2, theirs2) = pair();
    let mut conn2 = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    conn2.write_all(&proto::hello()).unwrap();
    assert_eq!(register_on(&conn2, &[theirs2.as_raw_fd()]), "Ok");
    // A second channel of the same process (the daemon names ranks by pid): arriving there
    // too is this rank arriving twice, which is refused.
    assert_eq!(
        send(mine2.as_raw_fd(), &req(&two), MsgFlags::empty()).unwrap(),
        req(&two).len()
    );
    let mut buf = vec![0u8; MAX_SYNC_MSG];
    let n = recv(mine2.as_raw_fd(), &mut buf, MsgFlags::empty()).unwrap();
    let r: Response = proto::decode(&buf[..n]).unwrap();
    assert!(format!("{r:?}").contains("already waits"), "{r:?}");
    // A process has at most 16 channels: 2 so far, 14 more, then a clear refusal.
    let mut more = Vec::new();
    for k in 0..15 {
        let (m, t) = pair();
        let r = register_on(&conn2, &[t.as_raw_fd()]);
        if k < 14 {
            assert_eq!(r, "Ok", "channel {}", k + 3);
        } else {
            assert!(r.contains("already has 16 sync channels"), "{r}");
        }
        more.push(m);
    }
    // Closed channels are dropped: once they are, a session (of this same process) gets one,
    // and it is the only one left.
    drop((mine, mine2, more));
    let t = std::time::Instant::now();
    let s = loop {
        match psls_client::Session::connect_to(&sock) {
            Ok(s) => break s,
            Err(e) => {
                assert!(t.elapsed() < Duration::from_secs(10), "{e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    let channels = || {
        s.node_stats()
            .unwrap()
            .1
            .into_iter()
            .find(|(k, _)| k == "sync_channels")
            .unwrap()
            .1
    };
    while channels() != 1 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} sync channels left",
            channels()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Through the client library: a name too long for a sync call is the caller's error, and
    // the session goes on.
    let e = s.barrier_of(&"x".repeat(MAX_SYNC_MSG), 1).unwrap_err();
    assert!(matches!(e, psls_client::ClientError::Invalid(_)), "{e:?}");
    assert!(e.to_string().contains("use a shorter name"), "{e}");
    s.barrier_of("after", 1).unwrap();
    // The daemon is fine.
    assert!(c.status().nodes.iter().all(|n| n.state.to_string() == "up"));
}

/// Resident memory of process `pid`, in bytes.
fn rss_bytes(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .expect("VmRSS")
        * 1024
}

#[test]
fn a_thousand_idle_client_connections_cost_little_and_the_next_client_is_served() {
    let c = Cluster::start(2, 0);
    let cfg = c.config();
    let socket = cfg.socket_path(cfg.entry("n0").expect("n0"));
    let pid = c.pid("n0");
    let before = rss_bytes(pid);
    // Half idle from the start, half idle inside a frame that announced the largest body.
    let mut conns = Vec::new();
    for i in 0..1000 {
        let mut s = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        if i % 2 == 1 {
            s.write_all(&psls_ipc::proto::hello()).expect("hello");
            s.write_all(&(psls_ipc::proto::MAX_FRAME as u32).to_le_bytes())
                .expect("prefix");
        }
        conns.push(s);
    }
    std::thread::sleep(Duration::from_millis(500));
    let held = rss_bytes(pid);
    assert!(
        held < 64 << 20,
        "1000 idle connections: {} MiB resident (from {} MiB)",
        held >> 20,
        before >> 20
    );
    // The next client is served while they are all open.
    let ls = c.ok(&["--node", "n0", "ls"]);
    assert!(ls.trim().is_empty(), "{ls}");
    c.ok(&["--node", "n0", "create", "after-idle", "--size", "4096"]);
    drop(conns);
    eprintln!(
        "1000 idle connections: {} MiB resident, {} MiB before",
        held >> 20,
        before >> 20
    );
}
