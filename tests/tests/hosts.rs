//! Separate hosts, tested: four `psls-node` daemons, each in its own network namespace with its
//! own address (a veth pair into a bridge) and its own mount namespace, in which `/etc/psls`,
//! `/var/lib/psls` and `/run/psls` are that host's own folders — nothing shared but the
//! read-only binaries. Each host gets only what deploy/README.md gives it (§3: `cluster.toml`,
//! `certs/ca.pem`, its own certificate and key; §4: an empty `data_dir`), and its daemon runs as
//! deploy/psls-node.service runs it (`psls-node --config /etc/psls/cluster.toml --node NAME`,
//! Restart=on-failure after 2 s, emulated by a supervisor script).
//!
//! Checked, with the CLI run inside the hosts (`nsenter` into their namespaces, `--dir
//! /etc/psls`): host 0 sees all four nodes up; its `config check` passes and misses nothing;
//! `--node n2` there says n2 runs on another host; a file imported on host 0 exports
//! byte-identical on host 2; a 4-rank checkpointing job launched from host 0 survives a kill -9
//! of host 2's daemon (its supervisor restarts it): it rolls back, its ranks run on all four
//! hosts, every rank ends with the sum of a run that never failed, in its output and in the
//! parallel file; and all four nodes are up again afterwards, n2 as a new incarnation.
//!
//! Needs root (`ip netns`, `unshare -m`, bind mounts); skips with one line otherwise.
//! `PSLS_KEEP_CLUSTER=1` keeps a failed run's folder (the hosts' logs).

use psls_ipc::proto::{ClusterStatus, NodeState};
use psls_ipc::ClusterConfig;
use psls_tests::*;
use std::io::BufRead;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");
const HOSTS: usize = 4;
/// The job's steps (one checkpoint each) and the pause after each: about 10 s without failure.
const STEPS: u64 = 40;
const SLEEP_MS: u64 = 250;
const PAGE: usize = 4096;

/// Each host's folders (under its folder in the test's temporary folder) and where its mount
/// namespace shows them: the paths deploy/README.md and psls-node.service use.
const MOUNTS: [(&str, &str); 3] = [
    ("etc-psls", "/etc/psls"),
    ("var-lib-psls", "/var/lib/psls"),
    ("run-psls", "/run/psls"),
];

/// One host, run as `ip netns exec NS unshare -m --propagation private bash WRAPPER HOST NODE
/// BIN`: binds the host's folders over /etc/psls, /var/lib/psls and /run/psls in its private
/// mount namespace, then runs the daemon as psls-node.service does (a clean environment,
/// PSLS_NODE from /etc/default/psls-node, stderr to the journal: here HOST/log), restarting it
/// 2 s after it exits with a non-zero status (Restart=on-failure, RestartSec=2). HOST/daemon.pid
/// holds the running daemon's pid. SIGTERM (systemctl stop) stops the daemon and the supervisor.
const WRAPPER: &str = r#"#!/bin/bash
set -u
H=$1 NODE=$2 BIN=$3
mount --bind "$H/etc-psls" /etc/psls &&
    mount --bind "$H/var-lib-psls" /var/lib/psls &&
    mount --bind "$H/run-psls" /run/psls || exit 1
cd /
child=
trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null; exit 0' TERM
while :; do
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PSLS_NODE="$NODE" \
        "$BIN/psls-node" --config /etc/psls/cluster.toml --node "$NODE" </dev/null >>"$H/log" 2>&1 &
    child=$!
    echo "$child" >"$H/daemon.pid.new" && mv "$H/daemon.pid.new" "$H/daemon.pid"
    wait "$child"
    rc=$?
    echo "supervisor: psls-node exited with status $rc" >>"$H/log"
    [ "$rc" = 0 ] && exit 0
    sleep 2 &
    wait $!
done
"#;

/// Runs `cmd`; its output, or why it could not start.
fn run(cmd: &mut Command) -> Result<Output, String> {
    cmd.stdin(Stdio::null()).output().map_err(|e| format!("{cmd:?}: {e}"))
}

/// Runs `cmd`; an error naming it and its stderr unless it succeeds.
fn try_sh(cmd: &mut Command) -> Result<(), String> {
    let o = run(cmd)?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?}: {}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

/// `ip ARGS`, which must succeed.
fn ip(args: &[&str]) {
    if let Err(e) = try_sh(Command::new("ip").args(args)) {
        panic!("{e}");
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Whether `pid` is a live `psls-node`.
fn is_daemon(pid: i32) -> bool {
    !psls_client::cluster::process_gone(pid)
        && std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains("psls-node"))
}

fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

/// The four hosts: their namespaces, bridge, folders and supervisors. Dropping it stops every
/// daemon and supervisor and removes every namespace, interface and mount point it made, also
/// when the test fails half-way.
struct Hosts {
    tmp: Option<tempfile::TempDir>,
    tag: String,
    subnet: u8,
    /// Namespaces made, to delete (the bridge and the veths go with them).
    netns: Vec<String>,
    /// Veth ends made in this namespace (deleted if still here: a set-up that failed half-way).
    veths: Vec<String>,
    /// Mount points made on the root file system.
    mount_points: Vec<PathBuf>,
    /// Whether `ip netns add` made /run/netns (removed if no namespace is left there).
    made_run_netns: bool,
    supervisors: Vec<Child>,
}

impl Hosts {
    /// Makes the bridge's namespace; why not if namespaces cannot be had here.
    fn new() -> Result<Hosts, String> {
        try_sh(Command::new("unshare").args(["-m", "--propagation", "private", "true"]))?;
        let pid = std::process::id();
        let tmp = tempfile::Builder::new()
            .prefix("psls-hosts")
            // /tmp: not under a folder a host's mount namespace replaces.
            .tempdir_in("/tmp")
            .map_err(|e| format!("temporary folder: {e}"))?;
        let mut h = Hosts {
            tmp: Some(tmp),
            tag: format!("psls{pid}"),
            subnet: (pid % 200 + 20) as u8,
            netns: Vec::new(),
            veths: Vec::new(),
            mount_points: Vec::new(),
            made_run_netns: !Path::new("/run/netns").exists(),
            supervisors: Vec::new(),
        };
        let br = h.bridge_ns();
        try_sh(Command::new("ip").args(["netns", "add", &br]))?;
        h.netns.push(br);
        Ok(h)
    }

    fn dir(&self) -> &Path {
        self.tmp.as_ref().expect("temporary folder").path()
    }

    fn bridge_ns(&self) -> String {
        format!("{}br", self.tag)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}h{i}", self.tag)
    }

    fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.subnet, 10 + i as u8)
    }

    /// Host `i`'s own folder (its /etc/psls, /var/lib/psls, /run/psls, its log).
    fn host(&self, i: usize) -> PathBuf {
        self.dir().join(format!("host{i}"))
    }

    fn admin(&self) -> PathBuf {
        self.dir().join("admin")
    }

    /// A bridge in its own namespace, and per host a namespace whose `eth0` is a veth into it.
    fn network(&mut self) {
        let br = self.bridge_ns();
        let bridge = format!("pb{}", std::process::id());
        ip(&["-n", &br, "link", "set", "lo", "up"]);
        ip(&["-n", &br, "link", "add", &bridge, "type", "bridge"]);
        ip(&["-n", &br, "link", "set", &bridge, "up"]);
        for i in 0..HOSTS {
            let ns = self.ns(i);
            ip(&["netns", "add", &ns]);
            self.netns.push(ns.clone());
            let veth = format!("pv{}h{i}", std::process::id());
            assert!(veth.len() <= 15, "interface name {veth} too long");
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]);
            self.veths.push(veth.clone());
            ip(&["link", "set", &veth, "netns", &br]);
            ip(&["-n", &br, "link", "set", &veth, "master", &bridge, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", self.addr(i)), "dev", "eth0"]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        }
    }

    /// The admin's side (README §1): `cluster init`, each node's address and local paths in
    /// `cluster.toml`, `config check`.
    fn init(&self) {
        let admin = self.admin();
        let admin_s = admin.display().to_string();
        let psls = |args: &[&str]| {
            let o = run(Command::new(psls_bin())
                .arg("--dir")
                .arg(&admin)
                .args(args)
                .env_remove("PSLS_SOCKET"))
            .expect("psls");
            assert!(o.status.success(), "psls --dir {admin_s} {args:?}: {}", text(&o));
        };
        psls(&["cluster", "init", "--nodes", &HOSTS.to_string(), "--spares", "0"]);
        let path = admin.join("cluster.toml");
        let mut cfg = ClusterConfig::load(&path).expect("the config init wrote loads");
        assert_eq!(cfg.nodes.len(), HOSTS);
        for (i, n) in cfg.nodes.iter_mut().enumerate() {
            let ip = IpAddr::V4(self.addr(i));
            n.addr = SocketAddr::new(ip, 7400);
            n.link_addr = Some(SocketAddr::new(ip, 7500));
            n.metrics_addr = Some(SocketAddr::new(ip, 7600));
            n.data_dir = PathBuf::from("/var/lib/psls");
            n.socket = PathBuf::from("/run/psls/psls.sock");
        }
        std::fs::write(&path, cfg.to_toml()).expect("write cluster.toml");
        psls(&["config", "check"]);
    }

    /// What each host gets (README §3 and §4), the mount points on the root file system, and
    /// the supervisor script.
    fn install(&mut self) {
        let admin = self.admin();
        for i in 0..HOSTS {
            let name = format!("n{i}");
            let h = self.host(i);
            let certs = h.join("etc-psls/certs");
            std::fs::create_dir_all(&certs).expect("host's /etc/psls/certs");
            std::fs::copy(admin.join("cluster.toml"), h.join("etc-psls/cluster.toml")).expect("copy cluster.toml");
            for f in ["ca.pem".to_string(), format!("{name}.pem"), format!("{name}.key")] {
                std::fs::copy(admin.join("certs").join(&f), certs.join(&f)).expect("copy a certificate");
            }
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(
                certs.join(format!("{name}.key")),
                std::fs::Permissions::from_mode(0o600),
            )
            .expect("chmod 600 the key");
            // `cluster init` leaves the node's data folder empty (the daemon writes its marker,
            // `node.id`, at its first start: daemon.rs `check_marker`): the operator's
            // `mkdir /var/lib/psls` is all there is to copy.
            let initialised = std::fs::read_dir(admin.join("data").join(&name))
                .expect("init's data folder")
                .count();
            assert_eq!(
                initialised, 0,
                "init put files in {name}'s data folder: deploy/README.md §4 says only to create data_dir"
            );
            std::fs::create_dir_all(h.join("var-lib-psls")).expect("host's data folder");
            std::fs::create_dir_all(h.join("run-psls")).expect("host's run folder");
        }
        for (_, at) in MOUNTS {
            let at = Path::new(at);
            if !at.exists() {
                std::fs::create_dir(at).unwrap_or_else(|e| panic!("mount point {}: {e}", at.display()));
                self.mount_points.push(at.to_path_buf());
            }
        }
        std::fs::write(self.dir().join("hostwrap.sh"), WRAPPER).expect("write the supervisor script");
    }

    /// Starts every host's supervisor; waits for every daemon's socket.
    fn start(&mut self) {
        let wrapper = self.dir().join("hostwrap.sh");
        let bin = bin_dir();
        for i in 0..HOSTS {
            let h = self.host(i);
            let out = std::fs::File::create(h.join("supervisor.out")).expect("supervisor output");
            let err = out.try_clone().expect("supervisor output");
            let child = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &self.ns(i),
                    "unshare",
                    "-m",
                    "--propagation",
                    "private",
                    "bash",
                ])
                .arg(&wrapper)
                .arg(&h)
                .arg(format!("n{i}"))
                .arg(&bin)
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .expect("start a host's supervisor");
            self.supervisors.push(child);
        }
        for i in 0..HOSTS {
            let sock = self.host(i).join("run-psls/psls.sock");
            wait_for(Duration::from_secs(20), &format!("host {i}'s daemon socket"), || {
                sock.exists()
            });
        }
    }

    /// The pid of host `i`'s daemon as its supervisor wrote it.
    fn daemon_pid(&self, i: usize) -> Option<i32> {
        std::fs::read_to_string(self.host(i).join("daemon.pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    /// `psls --dir /etc/psls ARGS` inside host `i` (its supervisor's network and mount
    /// namespaces, which its daemon shares and which outlive a daemon's restart).
    fn psls(&self, i: usize, args: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg("-t")
            .arg(self.supervisors[i].id().to_string())
            .args(["-n", "-m", "--"])
            .arg(psls_bin())
            .args(["--dir", "/etc/psls"])
            .args(args)
            .current_dir("/")
            .env_remove("PSLS_SOCKET")
            .env_remove("PSLS_QUIET");
        cmd
    }

    fn output(&self, i: usize, args: &[&str]) -> Output {
        run(&mut self.psls(i, args)).expect("nsenter psls")
    }

    /// `psls ARGS` on host `i`, which must succeed; its stdout.
    fn ok(&self, i: usize, args: &[&str]) -> String {
        let o = self.output(i, args);
        assert!(o.status.success(), "host {i}: psls {args:?}: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// The cluster as host `i`'s daemon sees it (None: no answer).
    fn status(&self, i: usize) -> Option<ClusterStatus> {
        let o = self.output(i, &["cluster", "status", "--json"]);
        o.status
            .success()
            .then(|| serde_json::from_slice(&o.stdout).ok())
            .flatten()
    }

    /// Waits until host `i` sees every node up; the status then.
    fn wait_all_up(&self, i: usize, what: &str) -> ClusterStatus {
        let mut last = None;
        let t = Instant::now();
        loop {
            if let Some(s) = self.status(i) {
                if s.nodes.len() == HOSTS && s.nodes.iter().all(|n| n.state == NodeState::Up) {
                    return s;
                }
                last = Some(s);
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{what}: host {i} did not see all {HOSTS} nodes up within 30 s: {last:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Host `i`'s daemon log (its journal).
    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.host(i).join("log")).unwrap_or_default()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for i in 0..self.supervisors.len() {
                let log = self.log(i);
                let lines: Vec<&str> = log.lines().collect();
                let sup = std::fs::read_to_string(self.host(i).join("supervisor.out")).unwrap_or_default();
                eprintln!(
                    "--- host {i}: supervisor: {}\n--- host {i}: daemon log, last 30 lines:\n{}",
                    sup.trim(),
                    lines[lines.len().saturating_sub(30)..].join("\n")
                );
            }
        }
        // systemctl stop: SIGTERM to each supervisor, which passes it to its daemon.
        for s in &self.supervisors {
            signal(s.id() as i32, nix::sys::signal::Signal::SIGTERM);
        }
        let t = Instant::now();
        for i in 0..self.supervisors.len() {
            if let Some(pid) = self.daemon_pid(i).filter(|p| is_daemon(*p)) {
                let left = Duration::from_secs(10).saturating_sub(t.elapsed());
                if !psls_client::cluster::wait_gone(pid, left) && is_daemon(pid) {
                    signal(pid, nix::sys::signal::Signal::SIGKILL);
                    psls_client::cluster::wait_gone(pid, Duration::from_secs(5));
                }
            }
        }
        for s in &mut self.supervisors {
            let _ = s.kill();
            let _ = s.wait();
        }
        for ns in self.netns.iter().rev() {
            let _ = run(Command::new("ip").args(["netns", "del", ns]));
        }
        for veth in &self.veths {
            // Gone with its namespace unless the set-up stopped before moving it.
            if Path::new("/sys/class/net").join(veth).exists() {
                let _ = run(Command::new("ip").args(["link", "del", veth]));
            }
        }
        for at in &self.mount_points {
            let _ = std::fs::remove_dir(at);
        }
        if self.made_run_netns
            && std::fs::read_dir("/run/netns").is_ok_and(|mut d| d.next().is_none())
            && run(Command::new("umount").arg("/run/netns")).is_ok_and(|o| o.status.success())
        {
            let _ = std::fs::remove_dir("/run/netns");
        }
        let keep = std::env::var("PSLS_KEEP_CLUSTER").ok();
        if keep.as_deref() == Some("always") || (std::thread::panicking() && keep.is_some()) {
            if let Some(tmp) = self.tmp.take() {
                eprintln!("hosts kept in {}", tmp.keep().display());
            }
        }
    }
}

/// A child killed (and reaped) when dropped: a `psls run` left behind by a failed assertion
/// would wait for its cluster to come back.
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Lines a child wrote, as they come: (from stderr, line).
fn read_lines(child: &mut Child) -> (mpsc::Receiver<(bool, String)>, Vec<std::thread::JoinHandle<()>>) {
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().expect("stdout piped");
    let err = child.stderr.take().expect("stderr piped");
    let pipe = |r: Box<dyn std::io::Read + Send>, is_err: bool, tx: mpsc::Sender<(bool, String)>| {
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(r).lines().map_while(Result::ok) {
                if tx.send((is_err, line)).is_err() {
                    return;
                }
            }
        })
    };
    let threads = vec![pipe(Box::new(out), false, tx.clone()), pipe(Box::new(err), true, tx)];
    (rx, threads)
}

/// Appends a line from [`read_lines`] to the child's stdout or stderr text.
fn take(out: &mut String, err: &mut String, (is_err, line): (bool, String)) {
    let to = if is_err { err } else { out };
    to.push_str(&line);
    to.push('\n');
}

/// Processes still running the job's probe (its ranks, on any host).
fn probes_of(file: &str) -> Vec<String> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .filter_map(Result::ok)
        .filter_map(|p| {
            let pid: i32 = p.file_name().to_str()?.parse().ok()?;
            let cmd = String::from_utf8_lossy(&std::fs::read(p.path().join("cmdline")).ok()?).replace('\0', " ");
            (cmd.contains(PROBE) && cmd.contains(&format!(" {file} ")) && !psls_client::cluster::process_gone(pid))
                .then(|| format!("{pid}: {cmd}"))
        })
        .collect()
}

#[test]
fn four_separate_hosts_run_a_job_through_a_kill_9_of_one_of_them() {
    let mut h = match Hosts::new() {
        Ok(h) => h,
        Err(why) => {
            cannot_run(&format!("network namespaces are not available here: {why}"));
            return;
        }
    };
    h.network();
    h.init();
    h.install();
    h.start();

    // 1. Host 0 sees the whole cluster up, each node at its own address.
    let st = h.wait_all_up(0, "after the start");
    assert_eq!(st.via, "n0", "host 0's socket is n0's");
    for n in &st.nodes {
        let i: usize = n.name[1..].parse().expect("node names n0..n3");
        assert_eq!(n.addr, format!("{}:7400", h.addr(i)), "{n:?}");
    }

    // 2. Host 0 has only its own key: `config check` misses nothing it needs; the same socket
    // path on host 0 is n0's, not n2's.
    let o = h.output(0, &["config", "check"]);
    assert!(o.status.success(), "config check on host 0: {}", text(&o));
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("missing")
            && !String::from_utf8_lossy(&o.stderr).contains("missing"),
        "config check on host 0 warns about a missing file: {}",
        text(&o)
    );
    let o = h.output(0, &["--node", "n2", "ls"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "psls --node n2 ls succeeded on host 0: {}",
        text(&o)
    );
    assert!(
        err.contains("node n2 runs on another host"),
        "psls --node n2 ls on host 0: {}",
        text(&o)
    );

    // 3. A file imported on host 0 exports byte-identical on host 2.
    let data = random_bytes(3_000_000, 77);
    let local = h.dir().join("in.bin");
    std::fs::write(&local, &data).expect("write the local file");
    h.ok(0, &["import", &local.display().to_string(), "f1"]);
    let back = h.dir().join("out2.bin");
    h.ok(2, &["export", "f1", &back.display().to_string()]);
    assert_same(
        &std::fs::read(&back).expect("read the export"),
        &data,
        "f1 exported on host 2",
    );

    // 4. A checkpointing job from host 0; host 2's daemon killed with SIGKILL while it runs.
    let n2_before = st
        .nodes
        .iter()
        .find(|n| n.name == "n2")
        .expect("n2 in the status")
        .incarnation;
    let file = format!("kp{}", std::process::id());
    let (steps, sleep) = (STEPS.to_string(), SLEEP_MS.to_string());
    let t = Instant::now();
    let mut job = Reap(
        h.psls(
            0,
            &[
                "run", "-n", "4", "--", PROBE, "steps", &file, "4", &steps, "99", "64", &sleep,
            ],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run on host 0"),
    );
    let (lines, readers) = read_lines(&mut job.0);
    let (mut out, mut err) = (String::new(), String::new());
    // Every rank past its third checkpoint.
    let third = |out: &str| (0..4).all(|r| out.contains(&format!("[{r}] step 2 ")));
    while !third(&out) {
        let left = Duration::from_secs(60).saturating_sub(t.elapsed());
        match lines.recv_timeout(left) {
            Ok(l) => take(&mut out, &mut err, l),
            Err(e) => {
                panic!("the job did not reach its third checkpoint ({e}):\n{out}\n{err}");
            }
        }
    }
    let victim = h.daemon_pid(2).expect("n2's pid file");
    assert!(is_daemon(victim), "n2's daemon {victim} is not running");
    signal(victim, nix::sys::signal::Signal::SIGKILL);
    assert!(
        psls_client::cluster::wait_gone(victim, Duration::from_secs(10)),
        "n2's daemon survived SIGKILL"
    );
    // Its supervisor starts it again 2 s later.
    wait_for(
        Duration::from_secs(15),
        "n2's daemon restarted by its supervisor",
        || h.daemon_pid(2).is_some_and(|p| p != victim && is_daemon(p)),
    );
    let status = loop {
        while let Ok(l) = lines.try_recv() {
            take(&mut out, &mut err, l);
        }
        if let Some(s) = job.0.try_wait().expect("wait for psls run") {
            break s;
        }
        if t.elapsed() > Duration::from_secs(120) {
            panic!("the job did not end within 120 s:\n{out}\n{err}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    for r in readers {
        r.join().expect("output reader");
    }
    while let Ok(l) = lines.try_recv() {
        take(&mut out, &mut err, l);
    }
    let job_secs = t.elapsed().as_secs_f64();
    assert!(status.success(), "the job failed ({status}):\n{out}\n{err}");
    let id = err
        .lines()
        .find_map(|l| l.strip_prefix("psls: job ")?.strip_suffix(" started"))
        .unwrap_or_else(|| panic!("no job id:\n{err}"))
        .to_string();
    assert!(
        err.contains("n2 went down: rolling job") && err.contains(&format!("job {id} restarted from checkpoint")),
        "no rollback to a checkpoint after n2's kill:\n{out}\n{err}"
    );
    let sum = STEPS * (STEPS + 1) / 2;
    for r in 0..4 {
        assert!(
            out.contains(&format!("[{r}] restarted from epoch ")),
            "rank {r} did not restart from a checkpoint:\n{out}\n{err}"
        );
        assert!(
            out.lines().any(|l| l == format!("[{r}] done {sum}")),
            "rank {r} did not end with {sum}:\n{out}\n{err}"
        );
    }
    // The ranks ran on the four hosts, and host 2's again after its daemon came back.
    let tag = format!("job=\"{id}\"");
    let starts = |i: usize| {
        h.log(i)
            .lines()
            .filter(|l| l.contains("starting ranks") && l.contains(&tag))
            .count()
    };
    for i in 0..HOSTS {
        assert!(starts(i) > 0, "host {i} started no rank of {id}:\n{}", h.log(i));
    }
    assert!(starts(2) >= 2, "host 2 did not start its rank again:\n{}", h.log(2));
    wait_for(Duration::from_secs(5), "the job's ranks gone", || {
        probes_of(&file).is_empty()
    });
    // The parallel file holds the same sums.
    let exported = h.dir().join("kp.out");
    h.ok(0, &["export", &file, &exported.display().to_string()]);
    let bytes = std::fs::read(&exported).expect("read the exported parallel file");
    assert!(bytes.len() >= 4 * PAGE, "{file} has {} bytes", bytes.len());
    for p in 0..4 {
        let word = u64::from_le_bytes(bytes[p * PAGE..p * PAGE + 8].try_into().expect("8 bytes"));
        assert_eq!(word, sum, "word 0 of page {p} of {file}");
    }

    // 5. Every node is up again, n2 as a new incarnation.
    let st = h.wait_all_up(0, "after the job");
    let n2 = st.nodes.iter().find(|n| n.name == "n2").expect("n2 in the status");
    assert!(
        n2.incarnation > n2_before,
        "n2 is up as incarnation {}, as before its kill",
        n2.incarnation
    );
    eprintln!("the job took {job_secs:.1} s");
}
