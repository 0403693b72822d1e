//! The daemon as systemd runs it (`deploy/psls-node.service`, `Type=notify`): it sends
//! `READY=1` to `$NOTIFY_SOCKET` once its socket serves clients, and `STOPPING=1` on SIGTERM.

use psls_tests::*;
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

#[test]
fn the_daemon_notifies_systemd_when_it_serves_and_when_it_stops() {
    let c = Cluster::init(2, 0, |_| {});
    let notify_path = c.tmp.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("bind the notify socket");
    notify
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("read timeout");
    let cfg = c.config();
    let socket = cfg.socket_path(cfg.entry("n0").expect("n0"));
    let mut daemon = std::process::Command::new(bin_dir().join("psls-node"))
        .arg("--config")
        .arg(c.dir.join("cluster.toml"))
        .arg("--node")
        .arg("n0")
        .env("NOTIFY_SOCKET", &notify_path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start psls-node");
    let mut buf = [0u8; 1024];
    let n = notify.recv(&mut buf).expect("a notification within a minute");
    let ready = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(ready.starts_with("READY=1\n"), "{ready}");
    assert!(ready.contains("STATUS=node n0"), "{ready}");
    // Ready means serving: a client connects at once (its request may wait for the cluster).
    psls_client::Client::connect(&socket).expect("the socket serves once READY=1 came");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let n = notify.recv(&mut buf).expect("a notification on SIGTERM");
    assert_eq!(String::from_utf8_lossy(&buf[..n]), "STOPPING=1");
    let status = daemon.wait().expect("the daemon ends");
    assert!(status.success(), "{status}");
}
