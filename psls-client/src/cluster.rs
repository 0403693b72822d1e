//! Local cluster management for the CLI: the cluster folder layout, starting daemons in the
//! background, stopping them, and finding a reachable node socket.
//!
//! Folder layout (`$PSLS_HOME` or `./.psls`): `cluster.toml`, `certs/`, `data/NAME/`,
//! `run/NAME.sock`, `run/NAME.pid`, `logs/NAME.log`.

use crate::Client;
use anyhow::{anyhow, bail, Context, Result};
use psls_ipc::proto::NodeState;
use psls_ipc::{ClusterConfig, NodeEntry};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub fn config_path(dir: &Path) -> PathBuf {
    dir.join("cluster.toml")
}

pub fn load(dir: &Path) -> Result<ClusterConfig> {
    let p = config_path(dir);
    if !p.exists() {
        bail!(
            "no cluster at {} (run `psls cluster init` first, or set PSLS_HOME / --dir)",
            dir.display()
        );
    }
    Ok(ClusterConfig::load(&p)?)
}

/// `psls config check`: the cluster folder's config parses and keeps every rule (an error
/// names the first rule broken), and what would trouble the daemons on this machine, as
/// warnings: ports the kernel also hands out to outgoing connections (its ephemeral range), and
/// missing certificates or keys. Returns the config and the warnings.
pub fn check(dir: &Path) -> Result<(ClusterConfig, Vec<String>)> {
    let cfg = load(dir)?;
    let mut warnings = Vec::new();
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            let mut it = t.split_whitespace().map(|x| x.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        });
    // A host has only its own nodes' certificates and keys, and binds only its own ports.
    for n in local_nodes(&cfg) {
        let link = n.link().map(|l| l.port());
        for (what, port) in [("addr", Some(n.addr.port())), ("link_addr", link)] {
            if let (Some(port), Some((lo, hi))) = (port, range) {
                if (lo..=hi).contains(&port) {
                    warnings.push(format!(
                        "node {}: {what} port {port} is in this machine's ephemeral port range {lo}-{hi} \
                         (net.ipv4.ip_local_port_range): an outgoing connection may hold it when the daemon starts",
                        n.name
                    ));
                }
            }
        }
    }
    for n in cfg.all() {
        if let Some(m) = n.metrics_addr {
            if m.ip().is_loopback() && !n.addr.ip().is_loopback() {
                warnings.push(format!(
                    "node {}: metrics_addr {m} is on loopback: only this host can scrape it",
                    n.name
                ));
            }
        }
    }
    let certs = cfg.cert_dir();
    let names = ["ca".to_string()]
        .into_iter()
        .chain(local_nodes(&cfg).into_iter().map(|n| n.name.clone()));
    for name in names {
        // The CA's key signs new certificates only; a node needs the CA's certificate.
        let exts: &[&str] = if name == "ca" { &["pem"] } else { &["pem", "key"] };
        for ext in exts {
            let f = certs.join(format!("{name}.{ext}"));
            if !f.exists() {
                warnings.push(format!("{} is missing", f.display()));
            }
        }
    }
    Ok((cfg, warnings))
}

/// `psls cluster init`.
pub fn init(dir: &Path, nodes: u32, spares: u32, memory_mb: u64, base_port: u16, force: bool) -> Result<ClusterConfig> {
    if config_path(dir).exists() && !force {
        bail!(
            "a cluster already exists at {} (use --force to overwrite it)",
            dir.display()
        );
    }
    if !(2..=1024).contains(&nodes) {
        bail!("--nodes must be between 2 and 1024");
    }
    if base_port as u32 + 3 * (nodes + spares) > 65535 || base_port == 0 {
        bail!(
            "--base-port {base_port} leaves no room for {} ports",
            3 * (nodes + spares)
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut cfg = ClusterConfig::local(nodes, spares, memory_mb, base_port);
    cfg.validate().map_err(|e| anyhow!(e))?;
    cfg.base_dir = dir.to_path_buf();
    let names: Vec<String> = cfg.all().map(|n| n.name.clone()).collect();
    psls_ipc::certs::generate(&cfg.cert_dir(), &cfg.cluster.name, &names)?;
    for n in cfg.all() {
        std::fs::create_dir_all(cfg.data_dir(n))?;
    }
    std::fs::create_dir_all(dir.join("run"))?;
    std::fs::create_dir_all(dir.join("logs"))?;
    std::fs::write(config_path(dir), cfg.to_toml())?;
    Ok(cfg)
}

/// Whether node `n`'s address is one of this machine's (its daemon runs here).
pub fn is_local(n: &NodeEntry) -> bool {
    std::net::UdpSocket::bind((n.addr.ip(), 0)).is_ok()
}

/// The nodes whose daemons run on this machine: those with an address of this machine, or
/// every node when none has one (`PSLS_NODE_BIN` may start them elsewhere, in network
/// namespaces say).
pub fn local_nodes(cfg: &ClusterConfig) -> Vec<&NodeEntry> {
    let here: Vec<&NodeEntry> = cfg.all().filter(|n| is_local(n)).collect();
    if here.is_empty() {
        cfg.all().collect()
    } else {
        here
    }
}

fn pid_file(dir: &Path, name: &str) -> PathBuf {
    dir.join("run").join(format!("{name}.pid"))
}

pub fn log_file(dir: &Path, name: &str) -> PathBuf {
    dir.join("logs").join(format!("{name}.log"))
}

/// The pid of node `name`'s daemon if it is running.
pub fn running_pid(dir: &Path, name: &str) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(pid_file(dir, name)).ok()?.trim().parse().ok()?;
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
    let is_ours = args.first().is_some_and(|a| a.ends_with(b"psls-node"))
        && args.windows(2).any(|w| w[0] == b"--node" && w[1] == name.as_bytes());
    // A zombie (killed but not reaped) is not running.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let zombie = stat.rsplit(')').next().is_some_and(|s| s.trim_start().starts_with('Z'));
    (is_ours && !zombie).then_some(pid)
}

/// The pid of node `name`'s last daemon if it is still exiting (killed, its threads not all
/// gone yet: its cmdline is empty then), or still running.
fn exiting_pid(dir: &Path, name: &str) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(pid_file(dir, name)).ok()?.trim().parse().ok()?;
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    // An unrelated process that took the pid over is not waited for.
    let ours = cmd.is_empty() || cmd.split(|&b| b == 0).next().is_some_and(|a| a.ends_with(b"psls-node"));
    (ours && !process_gone(pid)).then_some(pid)
}

/// Whether process `pid` has fully exited: gone, or a zombie all of whose threads have exited
/// (only then are its sockets closed). A dying process's cmdline empties, and its leader turns
/// zombie, while other threads still hold its files, so neither is enough on its own.
pub fn process_gone(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    tasks
        .filter_map(Result::ok)
        .all(|t| match std::fs::read_to_string(t.path().join("stat")) {
            Err(_) => true,
            Ok(stat) => stat
                .rsplit(')')
                .next()
                .is_some_and(|s| matches!(s.trim_start().chars().next(), Some('Z' | 'X'))),
        })
}

/// Waits until `pid` has exited; false on timeout.
pub fn wait_gone(pid: i32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while !process_gone(pid) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

fn node_binary() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("PSLS_NODE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe()?;
    let p = me.with_file_name("psls-node");
    if p.exists() {
        Ok(p)
    } else {
        bail!("psls-node not found next to {} (set PSLS_NODE_BIN)", me.display())
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Async worker threads for each daemon of a cluster of `daemons` on this one machine: the
/// cores shared out, at least one. Several daemons with a worker per core each would wake
/// each other's idle workers for every message (measured on 2 cores, 4 daemons: a 4 KiB peer
/// round trip took 157 µs with 2 workers each, 110 µs with 1).
fn workers_per_daemon(daemons: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / daemons.max(1)).max(1)
}

/// Starts daemon `n` in the background with `workers` async worker threads.
fn spawn(dir: &Path, n: &NodeEntry, workers: usize) -> Result<std::process::Child> {
    let path = log_file(dir, &n.name);
    if let Some(logs) = path.parent() {
        std::fs::create_dir_all(logs).with_context(|| format!("creating {}", logs.display()))?;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    let child = Command::new(node_binary()?)
        .arg("--config")
        .arg(config_path(dir))
        .arg("--node")
        .arg(&n.name)
        .arg("--workers")
        .arg(workers.to_string())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("starting psls-node")?;
    let pid = pid_file(dir, &n.name);
    if let Some(run) = pid.parent() {
        std::fs::create_dir_all(run).with_context(|| format!("creating {}", run.display()))?;
    }
    std::fs::write(&pid, child.id().to_string()).with_context(|| format!("writing {}", pid.display()))?;
    Ok(child)
}

/// Takes the cluster folder's start lock (`run/up.lock`), waiting (and saying so) while another
/// `psls cluster up` holds it. Released when the returned lock is dropped.
fn lock_starts(dir: &Path, quiet: bool) -> Result<nix::fcntl::Flock<std::fs::File>> {
    use nix::fcntl::{Flock, FlockArg};
    let run = dir.join("run");
    std::fs::create_dir_all(&run).with_context(|| format!("creating {}", run.display()))?;
    let path = run.join("up.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(l),
        Err((file, nix::errno::Errno::EWOULDBLOCK)) => {
            if !quiet {
                eprintln!("psls: another `psls cluster up` is starting daemons here; waiting for it");
            }
            Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| anyhow!("locking {}: {e}", path.display()))
        }
        Err((_, e)) => bail!("locking {}: {e}", path.display()),
    }
}

/// `psls cluster up`: starts every daemon that is not running, waits until all are healthy.
pub fn up(dir: &Path, timeout: Duration, quiet: bool) -> Result<()> {
    let cfg = load(dir)?;
    // One `cluster up` starts daemons at a time: a second one waits, then finds them running
    // (two would start the same node twice, and one of them lose its data folder's lock).
    let starting = lock_starts(dir, quiet)?;
    let mut children = Vec::new();
    let mut expected = Vec::new();
    let mut waited = Vec::new();
    // On a cluster of separate hosts, each host starts its own daemons (under systemd).
    let here = local_nodes(&cfg);
    for n in here.iter().copied() {
        if let Some(pid) = running_pid(dir, &n.name) {
            expected.push(n.clone());
            waited.push((n.name.clone(), pid));
            continue;
        }
        // A daemon killed a moment ago may still be exiting: its threads hold its ports and
        // its socket until the last one is gone, and a new one would fail to bind them. (One
        // that re-executes itself in place shows an empty command line for a moment: it is
        // running again once it shows its own.)
        if let Some(pid) = exiting_pid(dir, &n.name) {
            let deadline = Instant::now() + Duration::from_secs(10);
            let running = loop {
                if running_pid(dir, &n.name) == Some(pid) {
                    break true;
                }
                if process_gone(pid) {
                    break false;
                }
                if Instant::now() > deadline {
                    bail!(
                        "{}: its previous daemon (pid {pid}) is still exiting; try again",
                        n.name
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            if running {
                expected.push(n.clone());
                waited.push((n.name.clone(), pid));
                continue;
            }
        }
        if !cfg.data_dir(n).is_dir() {
            if !quiet {
                eprintln!(
                    "psls: {}: data dir {} is missing; not started (replace it with `psls node replace`)",
                    n.name,
                    cfg.data_dir(n).display()
                );
            }
            continue;
        }
        children.push((n.name.clone(), spawn(dir, n, workers_per_daemon(here.len()))?));
        expected.push(n.clone());
        if !quiet {
            println!("started {}", n.name);
        }
    }
    drop(starting);
    let deadline = Instant::now() + timeout;
    loop {
        for (name, child) in &mut children {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "{name} exited ({status}) during start-up:\n{}",
                    tail(&log_file(dir, name), 5)
                );
            }
        }
        // A node that was running when this began and is gone now will not become healthy.
        if let Some((name, _)) = waited.iter().find(|(name, pid)| running_pid(dir, name) != Some(*pid)) {
            bail!("{name} stopped while the cluster came up (see {}/logs)", dir.display());
        }
        if healthy(&cfg, &expected) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the cluster did not become healthy within {} s (see {}/logs)",
                timeout.as_secs(),
                dir.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every expected node answers on its socket, sees every other expected node up, and all
/// hold the same metadata (sequence number).
fn healthy(cfg: &ClusterConfig, expected: &[NodeEntry]) -> bool {
    let mut seqs = Vec::new();
    let mut coordinators = Vec::new();
    // Each node's own incarnation, and every incarnation each node knows of the others.
    let mut own: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    let mut seen: Vec<(String, u64)> = Vec::new();
    let all_up = expected.iter().all(|n| {
        let Ok(mut c) = Client::connect(&cfg.socket_path(n)) else {
            return false;
        };
        let Ok(st) = c.status() else { return false };
        seqs.push(st.meta_seq);
        coordinators.push(st.coordinator.clone());
        for s in &st.nodes {
            if s.name == n.name {
                own.insert(s.name.clone(), s.incarnation);
            } else if s.state == NodeState::Up {
                seen.push((s.name.clone(), s.incarnation));
            }
        }
        expected.iter().all(|e| {
            st.nodes
                .iter()
                .any(|s| s.name == e.name && (s.state == NodeState::Up || s.state == NodeState::Replaced))
        })
    });
    // Every node knows the same coordinator (the metadata's leader), holds the same metadata,
    // and knows every other up node as the incarnation it runs (a node restarted a moment ago
    // is known as such everywhere before a job starts).
    all_up
        && seen.iter().all(|(name, inc)| own.get(name).is_none_or(|o| o == inc))
        && seqs.windows(2).all(|w| w[0] == w[1])
        && coordinators.first().is_some_and(|c| c.is_some())
        && coordinators.windows(2).all(|w| w[0] == w[1])
}

/// `psls cluster down`: SIGTERM every daemon, SIGKILL after 10 s. Returns the nodes whose
/// daemons stopped; fails, naming each, when a daemon could not be signalled (another user's,
/// say) or outlived its SIGKILL, or when its pid file could not be read: those daemons still
/// run, and their pid files stay.
pub fn down(dir: &Path) -> Result<Vec<String>> {
    use nix::errno::Errno;
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let cfg = load(dir)?;
    let mut stopped = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    let mut pids = Vec::new();
    for n in cfg.all() {
        if let Err(e) = std::fs::read_to_string(pid_file(dir, &n.name)) {
            if e.kind() != std::io::ErrorKind::NotFound {
                failed.push(format!("{} ({}: {e})", n.name, pid_file(dir, &n.name).display()));
            }
            continue;
        }
        if let Some(pid) = running_pid(dir, &n.name) {
            match kill(Pid::from_raw(pid), Signal::SIGTERM) {
                Ok(()) => pids.push((n.name.clone(), pid)),
                Err(Errno::ESRCH) => pids.push((n.name.clone(), pid)),
                Err(e) => failed.push(format!("{} (pid {pid}): {}", n.name, e.desc())),
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for (name, pid) in pids {
        if !wait_gone(pid, deadline.saturating_duration_since(Instant::now())) {
            if let Err(e) = kill(Pid::from_raw(pid), Signal::SIGKILL) {
                if e != Errno::ESRCH {
                    failed.push(format!("{name} (pid {pid}): {}", e.desc()));
                    continue;
                }
            }
            if !wait_gone(pid, Duration::from_secs(5)) {
                failed.push(format!("{name} (pid {pid}): still running 5 s after SIGKILL"));
                continue;
            }
        }
        let _ = std::fs::remove_file(pid_file(dir, &name));
        stopped.push(name);
    }
    if !failed.is_empty() {
        let done = if stopped.is_empty() {
            String::new()
        } else {
            format!(" (stopped: {})", stopped.join(", "))
        };
        bail!(
            "could not stop {} of the cluster's daemons: {}{done}; they still run (stop them as their user, or as root)",
            failed.len(),
            failed.join("; ")
        );
    }
    Ok(stopped)
}

/// A connection to `node` (or the first node that answers).
pub fn connect(dir: &Path, node: Option<&str>) -> Result<Client> {
    if let Ok(s) = std::env::var("PSLS_SOCKET") {
        return Ok(Client::connect(Path::new(&s))?);
    }
    let cfg = load(dir)?;
    if let Some(name) = node {
        let n = cfg
            .entry(name)
            .ok_or_else(|| anyhow!("no node named '{name}' in {}", config_path(dir).display()))?;
        let path = cfg.socket_path(n);
        let mut c = Client::connect(&path)?;
        // On a cluster of separate hosts every node may have the same socket path: the daemon
        // that answers here is this host's.
        let (me, _) = c.whoami()?;
        if me != name {
            bail!(
                "{} is node {me}'s socket: node {name} runs on another host (run psls there, or use --node {me})",
                path.display()
            );
        }
        return Ok(c);
    }
    for n in cfg.all() {
        if let Ok(c) = Client::connect(&cfg.socket_path(n)) {
            return Ok(c);
        }
    }
    bail!(
        "no node daemon of the cluster at {} is running (run `psls cluster up`)",
        dir.display()
    )
}
