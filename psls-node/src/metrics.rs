//! Prometheus metrics: what a node counts as things happen ([`Metrics`], held by the node), and
//! a disk that counts its bytes and times its fsyncs ([`MeteredDisk`]). What a scrape reads
//! from the daemon's state, and the endpoint, are `crate::exporter`'s.
//!
//! Names follow Prometheus's rules: a `psls_` prefix, the unit last (`_seconds`, `_bytes`),
//! `_total` on counters.

use prometheus::core::Collector;
use prometheus::{HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry};
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

pub(crate) fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("a valid counter definition")
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The counts kept as things happen, for a scrape.
    pub fn gather(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.registry.gather()
    }

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
