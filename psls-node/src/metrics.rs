//! Prometheus metrics: what a node counts as things happen ([`Metrics`]), what it reads from
//! its state at each scrape ([`render`]), and the endpoint that serves them ([`serve`]: `GET
//! /metrics` on the node's `metrics_addr`, Prometheus's text format 0.0.4).
//!
//! Names follow Prometheus's rules: a `psls_` prefix, the unit last (`_seconds`, `_bytes`),
//! `_total` on counters.
//! The other nodes' states are as this node sees them: a scrape of every node shows where
//! they disagree.

use crate::dispatch::Daemon;
use prometheus::core::Collector;
use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Buckets of a fault's service time, in seconds (a local fault takes microseconds, a remote
/// one a few hundred, one behind a failure seconds).
const FAULT_BUCKETS_S: [f64; 12] = [
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.01, 0.05, 0.25, 1.0, 5.0,
];
/// Buckets of checkpoint pauses and commit times, in seconds.
const CKPT_BUCKETS_S: [f64; 11] = [0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5, 10.0];
/// Buckets of an fsync's time, in seconds.
const FSYNC_BUCKETS_S: [f64; 10] = [0.000_1, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0];

/// Most scrapes served at once; more wait for the listener.
pub const MAX_SCRAPES: usize = 8;
/// Longest request head a scrape may send, in bytes.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// How long a scraper may take to send its request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// What a node counts as it happens (the rest is read at each scrape).
pub struct Metrics {
    registry: Registry,
    /// Faults served, by kind (`read`, `write`, `write_protect`), from the fault to the wake.
    pub faults: HistogramVec,
    /// Failure verdicts this node committed as the coordinator (a node declared down).
    pub verdicts: IntCounterVec,
    /// Checkpoints committed that this node coordinated, by level: the ranks' pause and the
    /// time to commit.
    pub ckpt_pause: HistogramVec,
    pub ckpt_commit: HistogramVec,
    /// Checkpoints this node coordinated that aborted.
    pub ckpt_aborted: IntCounter,
    /// Rollbacks job control carried out while this node drove jobs, by outcome.
    pub rollbacks: IntCounterVec,
    /// Metadata operations this node submitted, by operation and outcome.
    pub meta_ops: IntCounterVec,
    /// Disk bytes read and written, and fsync times, by disk (`pages`, `meta`).
    pub disk_bytes: IntCounterVec,
    pub fsync: HistogramVec,
}

fn histogram(name: &str, help: &str, labels: &[&str], buckets: &[f64]) -> HistogramVec {
    HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), labels)
        .expect("a valid histogram definition")
}

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("a valid counter definition")
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let m = Metrics {
            registry: Registry::new(),
            faults: histogram(
                "psls_fault_seconds",
                "Page faults served, from the fault to the wake, by kind",
                &["kind"],
                &FAULT_BUCKETS_S,
            ),
            verdicts: counter(
                "psls_verdicts_total",
                "Nodes this node declared down as the coordinator (committed)",
                &["peer"],
            ),
            ckpt_pause: histogram(
                "psls_checkpoint_pause_seconds",
                "Checkpoints this node coordinated: how long the ranks stopped, by level",
                &["level"],
                &CKPT_BUCKETS_S,
            ),
            ckpt_commit: histogram(
                "psls_checkpoint_commit_seconds",
                "Checkpoints this node coordinated: from their start to their commit, by level",
                &["level"],
                &CKPT_BUCKETS_S,
            ),
            ckpt_aborted: IntCounter::new(
                "psls_checkpoint_aborted_total",
                "Checkpoints this node coordinated that aborted",
            )
            .expect("a valid counter definition"),
            rollbacks: counter(
                "psls_rollbacks_total",
                "Job rollbacks carried out while this node drove jobs, by outcome",
                &["outcome"],
            ),
            meta_ops: counter(
                "psls_meta_ops_total",
                "Metadata operations this node submitted, by operation and outcome",
                &["op", "outcome"],
            ),
            disk_bytes: counter(
                "psls_disk_bytes_total",
                "Bytes read from and written to this node's disk, by disk and direction",
                &["disk", "direction"],
            ),
            fsync: histogram(
                "psls_fsync_seconds",
                "Time of this node's fsyncs, by disk",
                &["disk"],
                &FSYNC_BUCKETS_S,
            ),
        };
        let all: [Box<dyn Collector>; 9] = [
            Box::new(m.faults.clone()),
            Box::new(m.verdicts.clone()),
            Box::new(m.ckpt_pause.clone()),
            Box::new(m.ckpt_commit.clone()),
            Box::new(m.ckpt_aborted.clone()),
            Box::new(m.rollbacks.clone()),
            Box::new(m.meta_ops.clone()),
            Box::new(m.disk_bytes.clone()),
            Box::new(m.fsync.clone()),
        ];
        for c in all {
            m.registry.register(c).expect("metric names are unique");
        }
        // Every series a dashboard or an alert reads exists from the start, at zero.
        for kind in ["read", "write", "write_protect"] {
            m.faults.with_label_values(&[kind]);
        }
        for level in ["memory", "persistent"] {
            m.ckpt_pause.with_label_values(&[level]);
            m.ckpt_commit.with_label_values(&[level]);
        }
        for outcome in ["restored", "interrupted", "failed"] {
            m.rollbacks.with_label_values(&[outcome]);
        }
        m
    }

    /// Starts the verdict count of each of `peers` at zero.
    pub fn know_peers<'a>(&self, peers: impl Iterator<Item = &'a str>) {
        for p in peers {
            self.verdicts.with_label_values(&[p]);
        }
    }

    /// A fault of `kind` served in `took`.
    pub fn fault(&self, kind: &str, took: Duration) {
        self.faults.with_label_values(&[kind]).observe(took.as_secs_f64());
    }

    /// A committed checkpoint of `level` that this node coordinated.
    pub fn checkpoint(&self, level: &str, pause_us: u64, commit_us: u64) {
        self.ckpt_pause
            .with_label_values(&[level])
            .observe(pause_us as f64 / 1e6);
        self.ckpt_commit
            .with_label_values(&[level])
            .observe(commit_us as f64 / 1e6);
    }
}

/// Everything a scrape shows, in the text format: the counts kept as things happen, and
/// gauges and counters read from the node's state now.
pub fn render(d: &Daemon) -> String {
    let node = &d.node;
    let now = Registry::new();
    let gauge = |name: &str, help: &str, labels: &[&str]| {
        let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("a valid gauge definition");
        now.register(Box::new(g.clone())).expect("metric names are unique");
        g
    };
    let single = |name: &str, help: &str| {
        let g = prometheus::IntGauge::new(name, help).expect("a valid gauge definition");
        now.register(Box::new(g.clone())).expect("metric names are unique");
        g
    };
    let count = |name: &str, help: &str, labels: &[&str]| {
        let c = counter(name, help, labels);
        now.register(Box::new(c.clone())).expect("metric names are unique");
        c
    };
    let status = crate::ipc::admin::status(node);
    let state = gauge(
        "psls_node_state",
        "The state of this node and of each peer it watches, as this node sees it: 1 for its state (up, suspect, down, replaced), 0 for the others",
        &["node", "state"],
    );
    let incarnation = gauge(
        "psls_node_incarnation",
        "The incarnation of this node and of each peer it watches, as this node knows it (0: none)",
        &["node"],
    );
    let counts = gauge(
        "psls_cluster_nodes",
        "The cluster's nodes by state, as this node sees them",
        &["state"],
    );
    for s in ["up", "suspect", "down", "replaced"] {
        counts
            .with_label_values(&[s])
            .set(status.nodes.iter().filter(|n| n.state.to_string() == s).count() as i64);
    }
    // A node's series do not grow with the cluster: itself and the peers it watches (every
    // node is watched by a few, so each one's state is scraped somewhere).
    for n in status
        .nodes
        .iter()
        .filter(|n| n.name == node.name() || node.watches(&n.name))
    {
        let word = n.state.to_string();
        for s in ["up", "suspect", "down", "replaced"] {
            state.with_label_values(&[n.name.as_str(), s]).set(i64::from(word == s));
        }
        incarnation
            .with_label_values(&[n.name.as_str()])
            .set(n.incarnation as i64);
    }
    single(
        "psls_coordinator",
        "1 if this node is the coordinator (the metadata's leader)",
    )
    .set(i64::from(status.coordinator.as_deref() == Some(node.name())));
    if let Some(me) = status.nodes.iter().find(|n| n.name == node.name()) {
        let g = gauge(
            "psls_recovery_frames",
            "Recovery frames held, by category (recovery: of committed memory checkpoints; unsaved: of those newer than the disks; pre_recovery: of a checkpoint being taken)",
            &["category"],
        );
        g.with_label_values(&["recovery"]).set(me.recovery_frames as i64);
        g.with_label_values(&["unsaved"]).set(me.unsaved_frames as i64);
        g.with_label_values(&["pre_recovery"])
            .set(me.pre_recovery_frames as i64);
        single(
            "psls_recovery_frame_capacity",
            "Recovery frames this node's memory allows",
        )
        .set(me.frame_capacity as i64);
        single(
            "psls_dirty_pages",
            "Pages mapped writable here since their last checkpoint",
        )
        .set(me.dirty_pages as i64);
        let (done, total) = me.rebuild.unwrap_or((0, 0));
        let r = gauge(
            "psls_rebuild_pages",
            "Re-mirroring after this node replaced another: pages done and in all (0 when none runs)",
            &["of"],
        );
        r.with_label_values(&["done"]).set(done as i64);
        r.with_label_values(&["total"]).set(total as i64);
        let disk = gauge(
            "psls_disk_space_bytes",
            "This node's disk: bytes used and free",
            &["kind"],
        );
        disk.with_label_values(&["used"]).set(me.disk_used_bytes as i64);
        disk.with_label_values(&["free"]).set(me.disk_free_bytes as i64);
        single(
            "psls_disk_failed",
            "1 if this node's disk failed (it then stops serving)",
        )
        .set(i64::from(me.disk_failed.is_some()));
    }
    let log = node.replication.status();
    let m = gauge(
        "psls_meta_log_index",
        "The metadata log at this node: commit and applied index",
        &["of"],
    );
    m.with_label_values(&["commit"]).set(log.commit as i64);
    m.with_label_values(&["applied"]).set(log.applied as i64);
    single("psls_meta_log_term", "The metadata log's term at this node").set(log.term as i64);
    single(
        "psls_meta_log_voter",
        "1 if this node votes in the metadata log, 0 if it follows it",
    )
    .set(i64::from(log.is_voter));
    let conns = gauge(
        "psls_connections",
        "Connections this node holds open, by transport (message link: every one, closing ones and handshakes included; requests: established ones)",
        &["transport"],
    );
    conns
        .with_label_values(&["link"])
        .set(node.net.link.open_connections() as i64);
    conns
        .with_label_values(&["request"])
        .set(node.net.open_connections() as i64);
    count(
        "psls_link_closes_total",
        "Message-link connections closed by agreement of both ends (idle, or too many open) since start",
        &[],
    )
    .with_label_values::<&str>(&[])
    .inc_by(node.net.link.closes());
    // Shared memory: the coherence machine's counts.
    let svm = d.svm.stats();
    let c = count(
        "psls_svm_events_total",
        "Shared-memory events at this node since it started, by kind",
        &["kind"],
    );
    for (kind, v) in [
        ("local_fault", svm.local_faults),
        ("write_protect_fault", d.svm.wp_faults()),
        ("read_request", svm.read_requests),
        ("write_request", svm.write_requests),
        ("page_in", svm.pages_in),
        ("page_out", svm.pages_out),
        ("page_loaded", svm.pages_loaded),
        ("invalidation", svm.invalidations),
        ("failed_fault", svm.failed_faults),
        ("coherence_message", svm.messages_out),
    ] {
        c.with_label_values(&[kind]).inc_by(v);
    }
    let ckpt = count(
        "psls_checkpoint_pages_total",
        "Pages this node took into checkpoints, and sent to other nodes as recovery copies",
        &["of"],
    );
    ckpt.with_label_values(&["taken"])
        .inc_by(node.ckpt_pages_taken.load(Ordering::Relaxed));
    ckpt.with_label_values(&["sent"])
        .inc_by(node.ckpt_pages_sent.load(Ordering::Relaxed));
    // The message link, per peer.
    let msgs = count(
        "psls_link_messages_total",
        "Messages over the message link, by peer and direction",
        &["peer", "direction"],
    );
    let bytes = count(
        "psls_link_bytes_total",
        "Bytes over the message link (frames with their length), by peer and direction",
        &["peer", "direction"],
    );
    for (peer, c) in node.net.link.counts() {
        msgs.with_label_values(&[peer, "sent"])
            .inc_by(c.sent_messages.load(Ordering::Relaxed));
        msgs.with_label_values(&[peer, "received"])
            .inc_by(c.received_messages.load(Ordering::Relaxed));
        bytes
            .with_label_values(&[peer, "sent"])
            .inc_by(c.sent_bytes.load(Ordering::Relaxed));
        bytes
            .with_label_values(&[peer, "received"])
            .inc_by(c.received_bytes.load(Ordering::Relaxed));
    }
    let mut families = node.metrics.registry.gather();
    families.extend(now.gather());
    families.sort_by(|a, b| a.name().cmp(b.name()));
    let mut out = Vec::new();
    if let Err(e) = prometheus::Encoder::encode(&prometheus::TextEncoder::new(), &families, &mut out) {
        tracing::warn!(node = %node.name(), error = %e, "cannot encode the metrics");
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Serves `GET /metrics` on `addr` until the daemon stops: at most [`MAX_SCRAPES`] at once,
/// each request read within [`REQUEST_TIMEOUT`] and [`MAX_REQUEST_BYTES`].
pub async fn serve(d: Arc<Daemon>, listener: tokio::net::TcpListener) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_SCRAPES));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let (sock, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(node = %d.node.name(), error = %e, "metrics: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let d = d.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = scrape(&d, sock).await {
                tracing::debug!(node = %d.node.name(), error = %e, "metrics: a scrape failed");
            }
        });
    }
}

/// Answers one HTTP/1.x request on `sock` and closes it.
async fn scrape(d: &Arc<Daemon>, mut sock: tokio::net::TcpStream) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = Vec::with_capacity(1024);
    let read = async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
            if head.len() >= MAX_REQUEST_BYTES {
                return Err(std::io::Error::other("request head too long"));
            }
            let n = sock.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::Error::other("closed before the request's end"));
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok(())
    };
    tokio::time::timeout(REQUEST_TIMEOUT, read)
        .await
        .map_err(|_| std::io::Error::other("request not sent in time"))??;
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let (status, kind, body) = match (method, path.split('?').next().unwrap_or("")) {
        ("GET", "/metrics") => {
            let d = d.clone();
            let text = tokio::task::spawn_blocking(move || render(&d))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", text)
        }
        ("GET", _) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "only /metrics is served here\n".to_string(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET /metrics is served here\n".to_string(),
        ),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(reply.as_bytes()).await?;
    sock.shutdown().await
}

/// A disk that counts its bytes and times its fsyncs into [`Metrics`].
#[derive(Debug)]
pub struct MeteredDisk {
    inner: Arc<dyn psls_pfs::Disk>,
    meter: Arc<Meter>,
}

/// A disk's counters, resolved once.
#[derive(Debug)]
struct Meter {
    read: IntCounter,
    written: IntCounter,
    fsync: prometheus::Histogram,
}

impl Meter {
    /// Runs the fsync `f`, timing it.
    fn timed(&self, f: impl FnOnce() -> std::io::Result<()>) -> std::io::Result<()> {
        let t = std::time::Instant::now();
        let r = f();
        self.fsync.observe(t.elapsed().as_secs_f64());
        r
    }
}

impl MeteredDisk {
    /// `inner`, counted as disk `label` (`pages`, `meta`).
    pub fn new(inner: Arc<dyn psls_pfs::Disk>, label: &str, metrics: &Metrics) -> MeteredDisk {
        MeteredDisk {
            inner,
            meter: Arc::new(Meter {
                read: metrics.disk_bytes.with_label_values(&[label, "read"]),
                written: metrics.disk_bytes.with_label_values(&[label, "written"]),
                fsync: metrics.fsync.with_label_values(&[label]),
            }),
        }
    }
}

#[derive(Debug)]
struct MeteredFile {
    inner: Arc<dyn psls_pfs::DiskFile>,
    meter: Arc<Meter>,
}

impl psls_pfs::DiskFile for MeteredFile {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_at(offset, buf)?;
        self.meter.read.inc_by(buf.len() as u64);
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.inner.write_at(offset, data)?;
        self.meter.written.inc_by(data.len() as u64);
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        self.meter.timed(|| self.inner.sync())
    }
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.inner.set_len(len)
    }
}

impl psls_pfs::Disk for MeteredDisk {
    fn open(&self, name: &str, create: bool) -> std::io::Result<Arc<dyn psls_pfs::DiskFile>> {
        Ok(Arc::new(MeteredFile {
            inner: self.inner.open(name, create)?,
            meter: self.meter.clone(),
        }))
    }
    fn remove(&self, name: &str) -> std::io::Result<()> {
        self.inner.remove(name)
    }
    fn list(&self) -> std::io::Result<Vec<String>> {
        self.inner.list()
    }
    fn sync_dir(&self) -> std::io::Result<()> {
        self.meter.timed(|| self.inner.sync_dir())
    }
    fn used_bytes(&self) -> std::io::Result<u64> {
        self.inner.used_bytes()
    }
    fn free_bytes(&self) -> std::io::Result<u64> {
        self.inner.free_bytes()
    }
}
