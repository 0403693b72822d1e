//! Failpoints: named places in the checkpoint and rollback paths where a test makes this
//! daemon die (SIGKILL itself: a kill -9 at an exact instant) or stop (pause: the test then
//! cuts every daemon's power while it waits there).
//!
//! Off unless the daemon starts with `PSLS_FAILPOINTS`, a comma-separated list of
//! `NAME[/NODE][@HIT][:pause[=MS]]` — the point `NAME`, only on node `NODE`, at its `HIT`-th
//! passage in this process (1 by default), killing, or pausing for `MS` milliseconds (a
//! minute by default) or until the test creates the marker's name + `.release` — and `PSLS_FAILPOINT_DIR`, a directory shared by
//! every daemon of the cluster: a point fires once per cluster, when it creates the file
//! `DIR/NAME` (`DIR/NAME.NODE` for a point of one node) (so a daemon restarted with the same environment does not die again), which
//! holds the node's name, and ` paused` after it for a pause. The
//! test watches that directory to know when a point fired.
//!
//! Points: `ckpt.write` (a participant, halfway through writing its pages), `ckpt.committed`
//! (the coordinator, the commit record durable, before any node hears the decision),
//! `ckpt.answer` (the coordinator, the checkpoint committed, before the ranks are answered),
//! `rollback.fence` (the coordinator, asked to fence a job's epochs), `rollback.drop` (a
//! node, asked to drop a job's pages), `ckpt.mem.write` (a participant, halfway through
//! sending its pages to their holders' recovery areas: phase 1 of a memory checkpoint),
//! `ckpt.mem.commit` (a node told a memory checkpoint committed, before its phase 2),
//! `launch.spawned` (a node, a rank started but not yet in its table of ranks; only pausing),
//! `launch.prepared` (a node, a start's ranks prepared but not yet started; only pausing),
//! `job.finish` (the job's driver, every rank exited 0, before the job's last checkpoints),
//! `job.finish.kept` (the driver, the finished result's memory checkpoint committed and
//! recorded, before the persistent one),
//! `rejoin.blank` (a node started on a blank folder, before the cluster decides what it means;
//! only pausing).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// What a failpoint does when it fires.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fire {
    /// Nothing: the point is not armed, or not now.
    No,
    /// The caller stops where it is, so that the test can act: for at most `max`, and only
    /// until the test creates the file `release`.
    Pause {
        max: std::time::Duration,
        release: std::path::PathBuf,
    },
}

struct Point {
    name: String,
    node: Option<String>,
    hit: u64,
    /// Pause this long (`None`: kill).
    pause_ms: Option<u64>,
    passed: AtomicU64,
}

struct Armed {
    points: Vec<Point>,
    dir: std::path::PathBuf,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var("PSLS_FAILPOINTS").ok()?;
            let dir = std::env::var_os("PSLS_FAILPOINT_DIR")?;
            let points = spec
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|s| {
                    let (s, pause_ms) = match s.split_once(":pause") {
                        Some((s, ms)) => (
                            s,
                            Some(ms.strip_prefix('=').and_then(|m| m.parse().ok()).unwrap_or(60_000)),
                        ),
                        None => (s, None),
                    };
                    let (s, hit) = match s.split_once('@') {
                        Some((s, n)) => (s, n.parse().unwrap_or(1)),
                        None => (s, 1),
                    };
                    let (name, node) = match s.split_once('/') {
                        Some((n, node)) => (n.to_string(), Some(node.to_string())),
                        None => (s.to_string(), None),
                    };
                    Point {
                        name,
                        node,
                        hit,
                        pause_ms,
                        passed: AtomicU64::new(0),
                    }
                })
                .collect();
            Some(Armed {
                points,
                dir: dir.into(),
            })
        })
        .as_ref()
}

/// Passes point `name` on node `node`: a killing point that fires does not return.
pub fn pass(node: &str, name: &str) -> Fire {
    let Some(a) = armed() else { return Fire::No };
    for p in &a.points {
        if p.name != name || p.node.as_deref().is_some_and(|n| n != node) {
            continue;
        }
        if p.passed.fetch_add(1, Ordering::SeqCst) + 1 != p.hit {
            continue;
        }
        let marker = a.dir.join(match &p.node {
            Some(n) => format!("{name}.{n}"),
            None => name.to_string(),
        });
        let Ok(mut f) = std::fs::OpenOptions::new().write(true).create_new(true).open(&marker) else {
            continue; // fired already (in this cluster)
        };
        // The marker names the node, for the test.
        let text = match p.pause_ms {
            Some(_) => format!("{node} paused"),
            None => node.to_string(),
        };
        let _ = std::io::Write::write_all(&mut f, text.as_bytes());
        drop(f);
        if let Some(ms) = p.pause_ms {
            tracing::error!(node, failpoint = name, ms, "failpoint: pausing here");
            let mut release = marker.into_os_string();
            release.push(".release");
            return Fire::Pause {
                max: std::time::Duration::from_millis(ms),
                release: release.into(),
            };
        }
        tracing::error!(node, failpoint = name, "failpoint: killing this daemon");
        // SIGKILL to itself: no destructor, no flush, like `kill -9`.
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        std::process::abort();
    }
    Fire::No
}

/// [`pass`] in async code: a pausing point waits here.
pub async fn pass_async(node: &str, name: &str) {
    if let Fire::Pause { max, release } = pass(node, name) {
        let until = tokio::time::Instant::now() + max;
        while tokio::time::Instant::now() < until && !release.exists() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}
