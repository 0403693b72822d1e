//! The Prometheus endpoint: everything a scrape shows, the counts kept as things happen
//! (`crate::metrics::Metrics`) and what it reads from the daemon's state now ([`render`]),
//! served as `GET /metrics` on the node's `metrics_addr` ([`serve`], Prometheus's text format
//! 0.0.4).
//!
//! Names follow Prometheus's rules: a `psls_` prefix, the unit last (`_seconds`, `_bytes`),
//! `_total` on counters.
//! The other nodes' states are as this node sees them: a scrape of every node shows where
//! they disagree.

use crate::dispatch::Daemon;
use crate::metrics::counter;
use prometheus::{IntGaugeVec, Opts, Registry};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Most scrapes served at once; more wait for the listener.
pub const MAX_SCRAPES: usize = 8;
/// Longest request head a scrape may send, in bytes.
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// How long a scraper may take to send its request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

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
    let mut families = node.metrics.gather();
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
