//! Test harness for multi-process integration tests: a local cluster of real `psls-node`
//! daemons on loopback ports, driven through the real `psls` CLI. Binaries come from the
//! workspace target folder (`cargo build --workspace --bins` first; the test script does).
//!
//! Every cluster lives in its own temporary folder and port range and is stopped on drop.
//! Tests wait for states ([`wait_for`]), never for fixed times; [`Peer`] talks to the
//! daemons as one of the cluster's nodes (its certificate), to observe or to misbehave.

use psls_ipc::proto::ClusterStatus;
use psls_ipc::ClusterConfig;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Folder holding the `psls` and `psls-node` binaries.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // A test runs from target/<profile>/deps, a binary of this crate from target/<profile>.
    let here = exe.parent().expect("the executable's folder");
    let dir = if here.join("psls").exists() {
        here.to_path_buf()
    } else {
        here.parent().expect("target/<profile>").to_path_buf()
    };
    for b in ["psls", "psls-node"] {
        assert!(
            dir.join(b).exists(),
            "{} missing: run `cargo build --workspace --bins` before the tests",
            dir.join(b).display()
        );
    }
    dir
}

pub fn psls_bin() -> PathBuf {
    bin_dir().join("psls")
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A base port with `count` ports after it free for both UDP (requests) and TCP (the link).
///
/// Ports are taken from 20000..32000, below Linux's ephemeral range (32768 and up): a port
/// there can be taken at any moment by some other cluster's outgoing TCP connection, and a
/// daemon starting later would then find its link port in use.
fn free_ports(count: u16) -> u16 {
    const FIRST_PORT: u32 = 20000;
    const SPAN_PORTS: u32 = 12000;
    const STRIDE_PORTS: u32 = 32;
    // A large cluster takes several strides at once.
    let strides = u32::from(count).div_ceil(STRIDE_PORTS).max(1);
    assert!(
        strides * STRIDE_PORTS <= SPAN_PORTS / 4,
        "a test cluster of {count} ports does not fit"
    );
    let free = |port: u16| {
        std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
    };
    loop {
        let k = NEXT.fetch_add(strides, Ordering::SeqCst);
        let offset = ((std::process::id() % 375) * STRIDE_PORTS + k * STRIDE_PORTS) % SPAN_PORTS;
        if offset + strides * STRIDE_PORTS > SPAN_PORTS {
            continue;
        }
        let base = (FIRST_PORT + offset) as u16;
        if (0..count).all(|i| free(base + i)) {
            return base;
        }
    }
}

pub use psls_svm::rng::random_bytes;

pub mod faults;
pub mod nemesis;

pub struct Cluster {
    pub tmp: tempfile::TempDir,
    pub dir: PathBuf,
    pub env: Vec<(String, String)>,
}

impl Cluster {
    /// Initialises (not starts) a cluster; `tune` may edit the config before it is written.
    pub fn init(nodes: u32, spares: u32, tune: impl FnOnce(&mut ClusterConfig)) -> Cluster {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("c");
        let base = free_ports(3 * (nodes + spares) as u16);
        let c = Cluster {
            tmp,
            dir,
            env: Vec::new(),
        };
        c.ok(&[
            "cluster",
            "init",
            "--nodes",
            &nodes.to_string(),
            "--spares",
            &spares.to_string(),
            "--base-port",
            &base.to_string(),
            "--memory-mb",
            "256",
        ]);
        let path = c.dir.join("cluster.toml");
        let mut cfg = ClusterConfig::load(&path).expect("config written by init loads");
        cfg.cluster.heartbeat_timeout_ms = 1500;
        tune(&mut cfg);
        std::fs::write(&path, cfg.to_toml()).expect("write config");
        c
    }

    /// A cluster folder copied from `from` (a fixture: config, certificates, data folders) to
    /// `at` (replaced if it exists), its nodes given free ports; not started. Dropped, it is
    /// stopped and `at` removed.
    pub fn adopt(from: &std::path::Path, at: &std::path::Path) -> Cluster {
        let _ = std::fs::remove_dir_all(at);
        copy_tree(from, at);
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = at.join("cluster.toml");
        let mut cfg = ClusterConfig::load(&path).expect("the fixture's config loads");
        let n = cfg.all().count() as u16;
        let base = free_ports(3 * n);
        for (i, e) in cfg.nodes.iter_mut().chain(cfg.spares.iter_mut()).enumerate() {
            let i = i as u16;
            e.addr.set_port(base + i);
            e.link_addr = Some(std::net::SocketAddr::new(e.addr.ip(), base + n + i));
            e.metrics_addr = Some(std::net::SocketAddr::new(e.addr.ip(), base + 2 * n + i));
        }
        std::fs::write(&path, cfg.to_toml()).expect("write config");
        Cluster {
            tmp,
            dir: at.to_path_buf(),
            env: Vec::new(),
        }
    }

    /// Initialises and starts a cluster.
    pub fn start(nodes: u32, spares: u32) -> Cluster {
        let c = Cluster::init(nodes, spares, |_| {});
        c.ok(&["cluster", "up"]);
        c
    }

    pub fn config(&self) -> ClusterConfig {
        ClusterConfig::load(&self.dir.join("cluster.toml")).expect("config")
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(psls_bin());
        cmd.arg("--dir").arg(&self.dir).args(args).env_remove("PSLS_SOCKET");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("run psls")
    }

    /// Runs `psls ARGS`, panics with its output unless it succeeds; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        if !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("in use") {
            // Diagnose who holds the ports.
            let ss = Command::new("ss")
                .arg("-uapn")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
            let ps = Command::new("ps")
                .args(["-eo", "pid,ppid,stat,args"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
            eprintln!("ss:\n{}\nps:\n{}", ss.unwrap_or_default(), ps.unwrap_or_default());
        }
        assert!(
            o.status.success(),
            "psls {args:?} failed ({}):\nstdout: {}\nstderr: {}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Runs `psls ARGS`, which must fail with exactly one error line; returns that line.
    pub fn fails(&self, args: &[&str]) -> String {
        let o = self.run(args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(
            !o.status.success(),
            "psls {args:?} should fail but succeeded: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(!lines.is_empty(), "psls {args:?} failed without a message");
        assert!(!err.contains("panicked"), "psls {args:?} panicked: {err}");
        lines.join("\n")
    }

    pub fn status(&self) -> ClusterStatus {
        let out = self.ok(&["cluster", "status", "--json"]);
        serde_json::from_str(&out).expect("status json")
    }

    pub fn pid(&self, node: &str) -> i32 {
        psls_client::cluster::running_pid(&self.dir, node).unwrap_or_else(|| panic!("{node} is not running"))
    }

    /// kill -9 of one daemon; waits until the process is gone.
    pub fn kill(&self, node: &str) {
        let pid = self.pid(node);
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).expect("kill");
        assert!(
            psls_client::cluster::wait_gone(pid, Duration::from_secs(10)),
            "{node} survived SIGKILL"
        );
    }

    /// Permanent loss of `node`: kill -9, then its data folder is deleted.
    pub fn destroy(&self, node: &str) {
        self.kill(node);
        let cfg = self.config();
        let entry = cfg.entry(node).unwrap_or_else(|| panic!("no node {node}"));
        std::fs::remove_dir_all(cfg.data_dir(entry)).expect("wipe data dir");
    }

    /// A power cut under a running `psls run` (`run`): every daemon killed at once, the job
    /// fails with them, and the cluster comes back up.
    pub fn power_cut_during(&self, mut run: std::process::Child) {
        self.kill_all();
        // The terminal goes with the power (a `psls run` left alone waits for the cluster and
        // follows its job again: `tests/tests/rollback.rs`).
        let _ = run.kill();
        let o = run.wait_with_output().expect("psls run");
        assert!(!o.status.success(), "the job cannot finish without its daemons");
        self.ok(&["cluster", "up"]);
    }

    /// `job`'s entry in `psls jobs --json` (it must be listed).
    pub fn job_entry(&self, job: &str) -> serde_json::Value {
        let list: serde_json::Value =
            serde_json::from_str::<serde_json::Value>(&self.ok(&["jobs", "--json"])).expect("json")["jobs"].clone();
        list.as_array()
            .and_then(|a| a.iter().find(|j| j["job"] == job))
            .cloned()
            .unwrap_or_else(|| panic!("{job} not listed: {list}"))
    }

    /// kill -9 of every daemon at once (a power cut when the daemons use the fault disk).
    pub fn kill_all(&self) {
        let cfg = self.config();
        let pids: Vec<(String, i32)> = cfg
            .all()
            .filter_map(|n| psls_client::cluster::running_pid(&self.dir, &n.name).map(|p| (n.name.clone(), p)))
            .collect();
        for (_, pid) in &pids {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL);
        }
        for (name, pid) in &pids {
            assert!(
                psls_client::cluster::wait_gone(*pid, Duration::from_secs(10)),
                "{name} survived SIGKILL"
            );
        }
    }

    /// Processes started by this cluster's daemons (ranks and what they started) still alive:
    /// (pid, command line). They carry the cluster's socket in `PSLS_SOCKET`.
    pub fn ranks_left(&self) -> Vec<(i32, String)> {
        let mine = format!("PSLS_SOCKET={}", self.dir.display());
        let mut left = Vec::new();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return left;
        };
        for p in procs.filter_map(Result::ok) {
            let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(env) = std::fs::read(p.path().join("environ")) else {
                continue;
            };
            if !env.split(|&b| b == 0).any(|v| v.starts_with(mine.as_bytes())) {
                continue;
            }
            // A zombie has ended.
            let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
            if stat.rsplit(')').next().is_some_and(|s| s.trim_start().starts_with('Z')) {
                continue;
            }
            let cmd = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            // The CLI itself (psls run) carries no PSLS_SOCKET; daemons neither.
            left.push((pid, cmd));
        }
        left
    }

    /// No process of a rank of this cluster outlives its job: checked within 5 s (a rank whose
    /// daemon died ends at once by its lifeline; one of a fenced node is killed). Those left
    /// are killed, then the test fails.
    pub fn assert_no_rank_left(&self, what: &str) {
        let t = Instant::now();
        loop {
            let left = self.ranks_left();
            if left.is_empty() {
                return;
            }
            if t.elapsed() > Duration::from_secs(5) {
                for (pid, _) in &left {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL);
                }
                panic!("{what}: ranks outlived their job: {left:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `node` is seen in `state` by the answering daemon.
    pub fn wait_state(&self, node: &str, state: &str) {
        let t = Instant::now();
        loop {
            let s = self.status();
            if s.nodes.iter().any(|n| n.name == node && n.state.to_string() == state) {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{node} never became {state}: {s:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    pub fn write_local(&self, name: &str, data: &[u8]) -> String {
        let p = self.path(name);
        std::fs::write(&p, data).expect("write local file");
        p.display().to_string()
    }

    /// Exports `name` and returns its bytes.
    pub fn export(&self, name: &str, extra: &[&str]) -> Vec<u8> {
        let out = self.path("export.out");
        let o = out.display().to_string();
        let mut args: Vec<&str> = extra.to_vec();
        args.extend(["export", name, o.as_str()]);
        self.ok(&args);
        let d = std::fs::read(&out).expect("read export");
        std::fs::remove_file(&out).expect("rm export");
        d
    }

    /// A client process `bin` that talks to the daemon of `node`.
    pub fn client(&self, node: &str, bin: &str) -> Command {
        let mut cmd = Command::new(bin);
        // The tests' client processes form one job (they share files, barriers and locks):
        // one writer job per file holds between them and other jobs.
        cmd.env("PSLS_HOME", &self.dir)
            .env("PSLS_NODE", node)
            .env("PSLS_JOB", "tests")
            .env_remove("PSLS_SOCKET");
        cmd
    }

    /// A process outside `psls run` of job `job` (`PSLS_JOB`) on `node` that maps 4 pages of
    /// `file` writable and holds them until the file `marker` exists (svm-probe's `hold`);
    /// returned once it mapped them.
    pub fn hold_writable(&self, node: &str, job: &str, file: &str, marker: &std::path::Path) -> std::process::Child {
        let probe = bin_dir().join("svm-probe");
        let mut holder = self
            .client(node, probe.to_str().expect("path"))
            .env("PSLS_JOB", job)
            .args(["hold", file, "4", marker.to_str().expect("path")])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("holder");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(holder.stdout.as_mut().expect("stdout")),
            &mut line,
        )
        .expect("read");
        assert_eq!(line.trim(), "mapped");
        holder
    }

    /// Runs client `bin ARGS` on `node`, which must succeed; returns its stdout.
    pub fn client_ok(&self, node: &str, bin: &str, args: &[&str]) -> String {
        let o = self.client(node, bin).args(args).output().expect("run client");
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(
            o.status.success(),
            "{bin} {args:?} on {node} failed ({}): {out}{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        out
    }

    /// Whether any daemon's log contains `text`.
    pub fn logs_contain(&self, text: &str) -> bool {
        self.config().all().any(|n| self.log(&n.name).contains(text))
    }

    pub fn log(&self, node: &str) -> String {
        std::fs::read_to_string(psls_client::cluster::log_file(&self.dir, node)).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.cmd(&["cluster", "down"]).output();
        // PSLS_KEEP_CLUSTER=1 keeps a failed test's cluster directory (logs, disks) to read;
        // PSLS_KEEP_CLUSTER=always keeps every test's.
        let keep = std::env::var("PSLS_KEEP_CLUSTER").ok();
        if keep.as_deref() == Some("always") || (std::thread::panicking() && keep.is_some()) {
            let kept = std::mem::replace(&mut self.tmp, tempfile::tempdir().expect("tempdir")).keep();
            eprintln!("cluster kept in {}", kept.display());
        }
    }
}

/// Copies folder `from` to `to`, files and folders.
pub fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("create folder");
    for e in std::fs::read_dir(from).expect("read folder") {
        let e = e.expect("entry");
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type().expect("file type").is_dir() {
            copy_tree(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).unwrap_or_else(|err| panic!("copy {}: {err}", src.display()));
        }
    }
}

/// A test that needs what this machine lacks (`why`): skipped with one line, but under
/// `CI=true` it fails (a green CI must not hide tests that did not run).
pub fn cannot_run(why: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true and this test cannot run here: {why}");
    }
    eprintln!("skipped: {why}");
}

/// Waits for child `ch` at most `limit` (killed and its output shown past it); its output.
pub fn wait_within(mut ch: std::process::Child, limit: Duration) -> std::process::Output {
    let t = Instant::now();
    while ch.try_wait().expect("wait").is_none() {
        if t.elapsed() > limit {
            let _ = ch.kill();
            let o = ch.wait_with_output().expect("output");
            panic!(
                "the client did not finish within {limit:?}: {}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ch.wait_with_output().expect("output")
}

/// Polls `done` every 20 ms until it holds; panics with `what` (and the time waited) if it
/// does not within `limit`.
pub fn wait_for(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The request transport of one of the cluster's nodes, run by the test: requests to the
/// daemons carry that node's certificate (a daemon takes them as from that node).
pub struct Peer {
    pub rt: tokio::runtime::Runtime,
    pub net: psls_node::transport::Transport,
}

impl Peer {
    /// Speaks as node `me` of cluster `c` (its certificate and key), from fresh local ports.
    pub fn new(c: &Cluster, me: &str) -> Peer {
        let cfg = c.config();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let (server, client) = psls_node::tls::configs(&cfg.cert_dir(), me).expect("node certificate");
        let key = psls_node::tls::reset_key(&cfg.cert_dir(), me).expect("node key");
        let link_tls = psls_node::tls::link_configs(&cfg.cert_dir(), me).expect("node certificate");
        let peers = cfg
            .all()
            .filter(|n| n.name != me)
            .map(|n| (n.name.clone(), (n.addr, n.link().unwrap_or(n.addr))))
            .collect();
        let known = cfg.all().map(|n| n.name.clone()).collect();
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().expect("address");
        let net = {
            let _g = rt.enter();
            psls_node::transport::Transport::bind((any, any), server, client, key, link_tls, peers, known)
                .expect("bind")
        };
        net.stamp
            .set(NEW_INCARNATION, std::sync::Arc::new(|_: &str, _: u64| false));
        Peer { rt, net }
    }

    /// One request to node `to`; its answer.
    pub fn request(
        &self,
        to: &str,
        req: &psls_node::peer::PeerReq,
        payload: bytes::Bytes,
    ) -> Result<(psls_node::peer::PeerResp, bytes::Bytes), psls_node::transport::NetError> {
        self.rt
            .block_on(self.net.request(to, req, payload, Duration::from_secs(10)))
    }
}

/// The incarnation a test's stand-in for a node speaks as: above any the daemons declared down
/// (a node killed by the test was; a stand-in is a new incarnation of it), and within the
/// incarnations a daemon may have (the node it stands in for starts above it afterwards).
pub const NEW_INCARNATION: u64 = 1 << 31;

/// A message stamp of [`NEW_INCARNATION`] that fences nobody (for a bare `Link`).
pub fn new_incarnation() -> std::sync::Arc<psls_node::peer::Stamp> {
    let s = psls_node::peer::Stamp::default();
    s.set(NEW_INCARNATION, std::sync::Arc::new(|_: &str, _: u64| false));
    std::sync::Arc::new(s)
}

/// Writes all of `data` into the pipe `fd` (switched to non-blocking), waiting for its reader
/// to make room; panics if the reader takes less than all of it within `limit`.
pub fn pipe_feed(fd: std::os::fd::BorrowedFd<'_>, data: &[u8], limit: Duration) {
    use std::os::fd::AsRawFd;
    let fd = fd.as_raw_fd();
    // SAFETY: fcntl on a descriptor the caller keeps open.
    unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
    let t = Instant::now();
    let mut off = 0;
    while off < data.len() {
        // SAFETY: writes from a live slice.
        let n = unsafe { libc::write(fd, data[off..].as_ptr().cast(), data.len() - off) };
        if n > 0 {
            off += n as usize;
            continue;
        }
        let e = std::io::Error::last_os_error();
        assert!(
            e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::Interrupted,
            "writing into the pipe: {e}"
        );
        assert!(
            t.elapsed() < limit,
            "the pipe's reader took {off} of {} bytes in {limit:?}",
            data.len()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Bytes written into a pipe and not yet read (`fd`: either end of it).
pub fn pipe_unread(fd: std::os::fd::BorrowedFd<'_>) -> usize {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD stores one int through a pointer to a live local.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut n as *mut libc::c_int) };
    assert_eq!(r, 0, "FIONREAD: {}", std::io::Error::last_os_error());
    n as usize
}

/// Asserts two byte strings are equal without printing megabytes.
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b);
        panic!(
            "{what}: {} bytes vs {} expected; first difference at {first:?}",
            got.len(),
            want.len()
        );
    }
}

/// The job id a `psls run` child prints first on stderr, and the rest of its stderr.
pub fn job_id(ch: &mut std::process::Child) -> (String, std::io::BufReader<std::process::ChildStderr>) {
    let mut err = std::io::BufReader::new(ch.stderr.take().expect("stderr piped"));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut err, &mut line).expect("read stderr");
    let job = line
        .strip_prefix("psls: job ")
        .and_then(|l| l.strip_suffix(" started\n"))
        .unwrap_or_else(|| panic!("no job id: {line}"))
        .to_string();
    (job, err)
}

// ---- MGS jobs (`psls run ... mgs`) ----

/// The MGS benchmark's binary.
pub fn mgs_bin() -> String {
    bin_dir().join("mgs").display().to_string()
}

/// MGS 1024² with a safe-point call every 50 vectors: the job the failure tests run.
pub const MGS_ARGS: [&str; 9] = [
    "--file",
    "mgs-1024x1024",
    "--vectors",
    "1024",
    "--dim",
    "1024",
    "--no-baseline",
    "--checkpoint-every",
    "50",
];

/// Starts [`MGS_ARGS`] as a 4-rank `psls run` job through `launcher` with `options`, its
/// output piped.
pub fn start_mgs_job(c: &Cluster, launcher: &str, options: &[&str]) -> std::process::Child {
    start_mgs_ranks(c, launcher, 4, options)
}

/// [`start_mgs_job`] with `ranks` ranks.
pub fn start_mgs_ranks(c: &Cluster, launcher: &str, ranks: u32, options: &[&str]) -> std::process::Child {
    let mgs = mgs_bin();
    let ranks = ranks.to_string();
    let mut args = vec!["--node", launcher, "run", "-n", ranks.as_str()];
    args.extend(options);
    args.extend(["--", mgs.as_str()]);
    args.extend(MGS_ARGS);
    c.cmd(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("psls run")
}

/// Waits for an MGS job; returns its checksum and what it said on stderr.
pub fn finish(ch: std::process::Child, what: &str) -> (String, String) {
    let (j, err) = finish_json(ch, what);
    (j["checksum"].as_str().expect("checksum").to_string(), err)
}

/// [`finish`], with MGS's whole result line.
pub fn finish_json(mut ch: std::process::Child, what: &str) -> (serde_json::Value, String) {
    use std::io::Read;
    let mut err = String::new();
    if let Some(mut e) = ch.stderr.take() {
        e.read_to_string(&mut err).expect("read");
    }
    finished(ch, err, what)
}

/// [`finish`] for a job whose stderr is read from `rest` (after its id, `job_id`).
pub fn finish_rest(ch: std::process::Child, mut rest: impl std::io::Read, what: &str) -> (String, String) {
    let mut err = String::new();
    rest.read_to_string(&mut err).expect("read");
    let (j, err) = finished(ch, err, what);
    (j["checksum"].as_str().expect("checksum").to_string(), err)
}

fn finished(ch: std::process::Child, err: String, what: &str) -> (serde_json::Value, String) {
    let o = ch.wait_with_output().expect("wait");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{what}: job failed ({}):\n{out}\n{err}", o.status);
    let line = out
        .lines()
        .find(|l| l.contains("\"bench\":\"mgs\""))
        .unwrap_or_else(|| panic!("{what}: no result line:\n{out}\n{err}"));
    let j: serde_json::Value = serde_json::from_str(line.trim_start_matches("[0] ")).expect("json");
    assert_eq!(j["ok"], true, "{what}: {line}");
    (j, err)
}

/// Waits until `job` committed a checkpoint (its first is persistent).
pub fn wait_first_checkpoint(c: &Cluster, job: &str) {
    wait_for(Duration::from_secs(60), "the job's first checkpoint", || {
        let list: serde_json::Value =
            serde_json::from_str::<serde_json::Value>(&c.ok(&["jobs", "--json"])).unwrap_or_default()["jobs"].clone();
        list.as_array().is_some_and(|a| {
            a.iter()
                .any(|j| j["job"] == job && j["persistent_epoch"].as_u64().unwrap_or(0) > 0)
        })
    });
}

/// The time a daemon's log line was written (its RFC 3339 UTC stamp), in seconds since the
/// Unix epoch.
pub fn log_time(line: &str) -> Option<f64> {
    let stamp = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = stamp.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (h, min) = (t.next()?.parse::<f64>().ok()?, t.next()?.parse::<f64>().ok()?);
    let s = t.next()?.parse::<f64>().ok()?;
    // Days from the civil date (H. Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + h * 3600.0 + min * 60.0 + s)
}

impl Cluster {
    /// When the last node started its ranks of start `attempt` of `job` (seconds since the
    /// Unix epoch, from the daemons' logs).
    pub fn ranks_started_at(&self, job: &str, attempt: u32) -> Option<f64> {
        let job = format!("job=\"{job}\"");
        let attempt = format!("attempt={attempt} ");
        self.config()
            .all()
            .flat_map(|n| {
                self.log(&n.name)
                    .lines()
                    .filter(|l| l.contains("starting ranks") && l.contains(&job) && l.contains(&attempt))
                    .filter_map(log_time)
                    .collect::<Vec<_>>()
            })
            .reduce(f64::max)
    }
}

/// Now, in seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_log_stamp_reads_as_unix_time() {
        let t = super::log_time("2026-11-26T13:31:18.568249Z  INFO psls_node::launcher: starting ranks").unwrap();
        assert!((t - 1_795_699_878.568249).abs() < 1e-3, "{t}");
        assert_eq!(super::log_time("1970-01-01T00:00:01.5Z x"), Some(1.5));
        assert_eq!(super::log_time("garbage"), None);
    }
}
