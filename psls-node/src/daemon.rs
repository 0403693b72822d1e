//! Daemon start-up and shutdown: checks the data folder and its identity marker, bumps the
//! incarnation, opens the store and metadata, binds the QUIC port and the client socket, and
//! runs until SIGTERM/SIGINT or an admin shutdown.

use crate::dispatch::Daemon;
use crate::node::Node;
use crate::transport::{self, Transport};
use anyhow::{bail, Context, Result};
use psls_ipc::ClusterConfig;
use psls_pfs::logstore::LogStore;
use psls_pfs::{Disk, FaultDisk, FileDisk, PageStore};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Checks (or writes, in an empty folder) the marker naming the node a data folder belongs to.
fn check_marker(dir: &Path, cluster: &str, name: &str) -> Result<()> {
    let marker = dir.join("node.id");
    let want = format!("cluster={cluster}\nnode={name}\n");
    match std::fs::read_to_string(&marker) {
        Ok(s) if s == want => Ok(()),
        Ok(s) => bail!(
            "data dir {} belongs to another node ({}); refusing to use it as {name}",
            dir.display(),
            s.trim().replace('\n', ", ")
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            crate::incarnation::write_durably(&marker, want.as_bytes())?;
            Ok(())
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", marker.display())),
    }
}

fn open_disk(dir: &Path, fault: bool) -> Result<Arc<dyn Disk>> {
    Ok(if fault {
        Arc::new(FaultDisk::new(dir)?)
    } else {
        Arc::new(FileDisk::new(dir)?)
    })
}

/// With the fault disk (`PSLS_FAULT_DISK=1`, tests only): once a file `fail-sync` appears in
/// the data folder, every later fsync of the page store fails, as a dying disk's does.
fn watch_fail_sync(dir: &Path, fault: Arc<FaultDisk>) -> Result<()> {
    let trigger = dir.join("fail-sync");
    std::thread::Builder::new()
        .name("psls-fault-disk".into())
        .spawn(move || loop {
            if trigger.exists() {
                tracing::warn!(trigger = %trigger.display(), "fault disk: every fsync of the page store fails from now on");
                fault.set_fail_sync(true);
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        })
        .context("starting the fault disk's watcher")?;
    Ok(())
}

/// Raises this process's soft limit on open descriptors to its hard limit.
/// Tells the service manager `state` (`sd_notify(3)`'s protocol: a datagram to the Unix socket
/// `$NOTIFY_SOCKET`, `@` standing for the abstract namespace); nothing when it is not set.
fn sd_notify(name: &str, state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = (|| -> std::io::Result<usize> {
        let sock = std::os::unix::net::UnixDatagram::unbound()?;
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
        match bytes.strip_prefix(b"@") {
            Some(abstract_name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(abstract_name)?;
                sock.send_to_addr(state.as_bytes(), &addr)
            }
            None => sock.send_to(state.as_bytes(), &path),
        }
    })();
    if let Err(e) = sent {
        tracing::warn!(node = name, error = %e, "cannot notify the service manager (NOTIFY_SOCKET)");
    }
}

/// Takes the data folder's lock (`DIR/lock`, an exclusive `flock` held until the process
/// ends), with this daemon's pid in the file.
fn lock_data_dir(dir: &Path) -> Result<()> {
    use std::io::{Read, Seek, Write};
    let path = dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(mut f) => {
            f.set_len(0)?;
            f.seek(std::io::SeekFrom::Start(0))?;
            writeln!(f, "{}", std::process::id())?;
            // Held for the daemon's life: the kernel lets go when the process ends, however.
            std::mem::forget(f);
            Ok(())
        }
        Err((mut file, nix::errno::Errno::EWOULDBLOCK)) => {
            // The holder writes its pid right after it locks: read until it is there (a
            // moment), so the message names it.
            let mut pid = String::new();
            for _ in 0..50 {
                pid.clear();
                let _ = file.seek(std::io::SeekFrom::Start(0));
                let _ = file.read_to_string(&mut pid);
                if !pid.trim().is_empty() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            bail!(
                "data dir {} is in use by another psls-node (pid {}): one daemon per node",
                dir.display(),
                pid.trim()
            )
        }
        Err((_, e)) => bail!("cannot lock {}: {e}", path.display()),
    }
}

fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write one `rlimit` this frame owns.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Runs node `name` of the cluster in `config` until it is told to stop.
pub async fn run(config: &Path, name: &str) -> Result<()> {
    // Fail-stop from the first instant: a panic in any thread ends the daemon.
    crate::failstop::install();
    // Client connections, peers' files and mappings each hold descriptors: the soft limit goes
    // up to the hard one (often 1024 against 500k+), so the connection bound is ours.
    raise_fd_limit();
    let cfg = Arc::new(ClusterConfig::load(config)?);
    let Some(me) = cfg.entry(name).cloned() else {
        bail!("node '{name}' is not in {}", config.display());
    };
    if let Err(e) = cfg.cluster.cleaning.parse::<psls_ckpt::cleaning::Policy>() {
        bail!("{}: cluster.cleaning: {e}", config.display());
    }
    let dir = cfg.data_dir(&me);
    if !dir.is_dir() {
        bail!(
            "data dir {} of node {name} does not exist (run `psls cluster init`, or create it for an empty node)",
            dir.display()
        );
    }
    check_marker(&dir, &cfg.cluster.name, name)?;
    // One daemon per data folder: a second one (a `psls cluster up` on the wrong host, a
    // daemon started twice) stops here, before it touches the incarnation or the metadata.
    lock_data_dir(&dir)?;
    let start = crate::incarnation::next(&dir)?;
    let incarnation = start.incarnation;
    if start.unfinished {
        tracing::warn!(node = name, incarnation, dir = %dir.display(), "blank data folder whose rejoin was not decided before this restart: a blank start again");
    } else if start.blank {
        tracing::info!(node = name, incarnation, dir = %dir.display(), "blank data folder: a new node, or a replaced disk (its copies are rebuilt from the others if the cluster knew this node)");
    }
    // PSLS_FAULT_DISK=1 keeps unsynced writes in memory: a kill -9 is then a power cut.
    let fault = std::env::var("PSLS_FAULT_DISK").is_ok_and(|v| v == "1");
    let metrics = Arc::new(crate::metrics::Metrics::new());
    metrics.know_peers(cfg.all().map(|n| n.name.as_str()).filter(|n| *n != name));
    let meta_disk: Arc<dyn Disk> = Arc::new(crate::metrics::MeteredDisk::new(
        open_disk(&dir, fault)?,
        "meta",
        &metrics,
    ));
    let pages_disk: Arc<dyn Disk> = if fault {
        let f = Arc::new(FaultDisk::new(dir.join("pages"))?);
        watch_fail_sync(&dir, f.clone())?;
        f
    } else {
        Arc::new(FileDisk::new(dir.join("pages"))?)
    };
    let pages_disk: Arc<dyn Disk> = Arc::new(crate::metrics::MeteredDisk::new(pages_disk, "pages", &metrics));
    let store = Arc::new(PageStore::new(pages_disk));
    // A store created now may belong to a node that lost its disk: it takes no part in elections
    // until it caught up, or heartbeats show the cluster is new. It records the cluster's first
    // voters (a few, spread over the failure domains), the same on every node.
    let first_voters = {
        let all: Vec<psls_ipc::config::NodeEntry> = cfg.all().cloned().collect();
        let cands: Vec<psls_cluster::voters::Candidate<'_>> = all
            .iter()
            .enumerate()
            .map(|(i, n)| psls_cluster::voters::Candidate {
                id: i as u32,
                domain: n.failure_domain(),
                usable: true,
                gone: false,
            })
            .collect();
        psls_cluster::log::conf_of(&psls_cluster::voters::initial(&cands, cfg.cluster.metadata_voters))
    };
    let meta = LogStore::open_with_voters(meta_disk.as_ref(), true, Some(&first_voters))
        .with_context(|| format!("opening metadata in {}", dir.display()))?;

    let (server, client) = crate::tls::configs(&cfg.cert_dir(), name)?;
    // Validation checked that every node has a link address.
    let link_of = |n: &psls_ipc::config::NodeEntry| n.link().unwrap_or(n.addr);
    let peers = cfg
        .all()
        .filter(|n| n.name != name)
        .map(|n| (n.name.clone(), (n.addr, link_of(n))))
        .collect();
    let known: Vec<String> = cfg.all().map(|n| n.name.clone()).collect();
    let reset_key = crate::tls::reset_key(&cfg.cert_dir(), name)?;
    let link_tls = crate::tls::link_configs(&cfg.cert_dir(), name)?;
    let net = Transport::bind(
        (me.addr, link_of(&me)),
        server,
        client,
        reset_key,
        link_tls,
        peers,
        known.clone(),
    )
    .map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            anyhow::anyhow!("cannot listen on {} and {}: a port is in use", me.addr, link_of(&me))
        } else {
            anyhow::anyhow!("cannot listen on {} and {}: {e}", me.addr, link_of(&me))
        }
    })?;
    let net = net.with_limits(
        cfg.cluster.max_connections,
        Duration::from_millis(cfg.cluster.connection_idle_ms),
    );
    let metrics_listener = match me.metrics_addr {
        None => None,
        Some(a) => {
            let l = std::net::TcpListener::bind(a).map_err(|e| {
                if e.kind() == std::io::ErrorKind::AddrInUse {
                    anyhow::anyhow!("cannot serve metrics on {a}: the port is in use")
                } else {
                    anyhow::anyhow!("cannot serve metrics on {a}: {e}")
                }
            })?;
            l.set_nonblocking(true)?;
            Some(tokio::net::TcpListener::from_std(l)?)
        }
    };
    let socket = cfg.socket_path(&me);
    let listener = crate::ipc::bind(&socket)?;

    let node = Arc::new(Node::new(
        cfg.clone(),
        me.clone(),
        incarnation,
        store,
        meta,
        net,
        Instant::now(),
        metrics,
    ));
    let channels = crate::sync_channel::Channels::new().context("creating the sync channels' epoll")?;
    let d = Daemon::new(node.clone(), channels);
    let fenced_node = Arc::downgrade(&node);
    node.net.stamp.set(
        incarnation,
        Arc::new(move |from: &str, inc: u64| fenced_node.upgrade().is_some_and(|n| !n.take_stamp(from, inc))),
    );
    if let Some(l) = metrics_listener {
        tokio::spawn(crate::exporter::serve(d.clone(), l));
    }
    tokio::spawn(transport::serve(
        node.net.endpoint().clone(),
        d.clone(),
        Arc::new(known),
        node.net.stamp.clone(),
        node.net.max_connections(),
    ));
    let (link, handler) = (
        node.net.link.clone(),
        Arc::new(crate::dispatch::LinkDelivery::new(d.clone())),
    );
    std::thread::Builder::new()
        .name("psls-link".into())
        .spawn(move || {
            // A panic here stops the daemon (`failstop`): a node whose link thread died would
            // still heartbeat but lose every coherence, barrier and lock message.
            link.run(handler)
        })
        .context("starting the message link thread")?;
    let (channels, sync) = (d.channels.clone(), d.sync.clone());
    std::thread::Builder::new()
        .name("psls-sync".into())
        .spawn(move || {
            // As for the link thread: ranks would wait forever on calls nobody reads.
            channels.run(&sync)
        })
        .context("starting the sync channel thread")?;
    // Learn the cluster's metadata before serving clients, so a restarted node never answers
    // from a stale namespace.
    // Disk figures go into every heartbeat: peers check free space with them.
    node.refresh_disk_stats();
    tokio::spawn(crate::log_task::run(node.clone()));
    node.initial_sync().await;
    // Whether other nodes hold pages an earlier incarnation of this one granted: known before
    // any coherence state is made (`svm::fault::ensure_svm`).
    d.svm.ask_peers(&node).await;
    // That ask went to every node of the map: its connections are not kept (a node's idle
    // cost must not grow with the cluster).
    node.net.close_unused();
    // The periodic work (beats to the watched peers first) runs from now on: a node waiting
    // for its start to commit is not silent to its watchers (a start that waited past the
    // failure timeout was declared down).
    tokio::spawn(d.clone().run_ticks());
    // This start's incarnation, committed before the daemon serves (when a leader answers in
    // time): every node learns of the restart from it, whether it watches this one or not.
    let boot = tokio::spawn(node.clone().boot());
    let _ = tokio::time::timeout(node.request_timeout, async {
        while !boot.is_finished() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    if start.blank {
        node.rejoin_pending.store(true, std::sync::atomic::Ordering::Relaxed);
        let n = node.clone();
        let data = dir.clone();
        tokio::spawn(async move {
            crate::pfs::rejoin_blank(n.clone(), start.unfinished).await;
            if let Err(e) = crate::incarnation::rejoin_decided(&data) {
                tracing::warn!(node = %n.name(), error = %e, "the blank start's mark stays: the next start rejoins again");
            }
            n.rejoin_pending.store(false, std::sync::atomic::Ordering::Relaxed);
        });
    }
    tokio::spawn(crate::ckpt::drop_earlier_claims(node.clone()));
    {
        // A peer known as a new incarnation: the transport forgets its connections to the old
        // one, and shared memory learns of it at once (its settled copies of the pages that
        // peer manages go before a new job can claim their file).
        let d = d.clone();
        tokio::spawn(async move {
            loop {
                d.node.peer_restarted.notified().await;
                for (peer, incarnation) in d.node.take_restarts() {
                    d.node.net.peer_restarted(&peer, incarnation);
                }
                d.svm.sync_peers(&d.node);
            }
        });
    }
    tokio::spawn(crate::jobctl::run(Arc::new(d.jobctl_shell())));
    tokio::spawn(crate::launcher::copier(d.node.clone(), d.jobs.clone()));
    tokio::spawn(crate::ipc::serve(d.clone(), listener, socket.clone()));
    tracing::info!(node = name, incarnation, addr = %me.addr, socket = %socket.display(), fault_disk = fault, "psls-node ready");
    // Taken before READY=1: a SIGTERM right after it (systemctl stop) stops the daemon cleanly
    // rather than by the signal's default action.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // systemd's Type=notify: the unit is started once clients can talk to the daemon.
    sd_notify(
        name,
        &format!(
            "READY=1\nSTATUS=node {name}, incarnation {incarnation}, serving {}",
            socket.display()
        ),
    );

    tokio::select! {
        _ = term.recv() => tracing::info!(node = name, "SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => tracing::info!(node = name, "SIGINT: stopping"),
        _ = node.shutdown.notified() => tracing::info!(node = name, "shutdown requested"),
    }
    sd_notify(name, "STOPPING=1");
    let _ = std::fs::remove_file(&socket);
    node.net.endpoint().close(0u32.into(), b"shutdown");
    node.net.link.close();
    if let Err(e) = node.store.sync() {
        tracing::error!(node = name, error = %e, "final fsync failed");
    }
    Ok(())
}
