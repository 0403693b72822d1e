//! The cost of metadata as the namespace grows, on a local cluster of 4 nodes and a spare.
//!
//! Per store size (`--sizes`, files already in the store): creates, stats and removes of 4 KiB
//! files from 1 client and from 8 concurrent clients (spread over the 4 nodes), each op's
//! latency (p50, p99) and the rate; then MGS `--vectors`² with 4 ranks and a checkpoint every
//! `--every` vectors, persistent and memory, against a run without checkpoints, on an empty
//! store and on one holding the largest size, alternated round by round (`--rounds`), each
//! cluster started fresh for its run: the total checkpoint pause and the run time.
//!
//! How the store is filled (`--populate`): `creates` through the clients (8 at once), or
//! `offline`: the cluster is stopped, the files' records are written into every node's metadata
//! store as one committed state, and it is started again (the files are all zero; their records
//! are what a `psls create` commits). Use `offline` where creates grow too slow to fill the
//! store (the code before issue 22: 100,000 creates would take about a day).
//!
//! Each measurement stops after `--ops` operations or `--budget-s` seconds, whichever comes
//! first (its count is reported).
//!
//! `meta-bench --help` lists its options.
//! Needs `psls`, `psls-node` and `mgs` next to this binary (`cargo build --release --workspace --bins`).

use anyhow::{bail, Context, Result};
use psls_bench::json_f64;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

struct Args {
    sizes: Vec<usize>,
    ops: usize,
    budget: Duration,
    rounds: usize,
    vectors: usize,
    every: usize,
    offline: bool,
    dir: Option<PathBuf>,
    skip_mgs: bool,
    skip_ops: bool,
    /// Keep n3 down while the store fills to the largest size, then time its catch-up.
    catch_up: bool,
    /// Only the store figures (in process): bytes per checkpoint record, disk after many ops.
    store_only: bool,
    /// Operations of the store figures' churn.
    churn_ops: u64,
    /// How long a cluster may take to become healthy.
    up: Duration,
    /// Client counts measured at each size.
    clients: Vec<usize>,
    /// Only the disk probe: appends against scattered pages, each with an fdatasync.
    fsync_probe: bool,
}

/// Metadata operations, MGS and the store as the namespace grows, on local clusters.
#[derive(clap::Parser)]
#[command(name = "meta-bench", version, about)]
struct Cli {
    /// Namespace sizes (files), increasing, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [100, 10_000, 100_000], value_parser = psls_bench::positive)]
    sizes: Vec<usize>,
    /// Operations timed per kind and size (at least 8).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(8..))]
    ops: u64,
    /// Time budget per size, in seconds.
    #[arg(long = "budget-s", value_name = "SECONDS", default_value_t = 60)]
    budget_s: u64,
    /// Rounds.
    #[arg(long, default_value_t = 2, value_parser = psls_bench::positive)]
    rounds: usize,
    /// MGS vectors.
    #[arg(long, default_value_t = 512, value_parser = psls_bench::positive)]
    vectors: usize,
    /// A persistent checkpoint every K vectors in the MGS runs.
    #[arg(long, value_name = "K", default_value_t = 16, value_parser = psls_bench::positive)]
    every: usize,
    /// How the namespace is filled: by `creates` through the daemons, or `offline` in the store.
    #[arg(long, value_parser = ["creates", "offline"], default_value = "creates")]
    populate: String,
    /// Folder for the clusters (default: a temporary one).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Skip the MGS runs.
    #[arg(long)]
    skip_mgs: bool,
    /// Skip the operation latencies.
    #[arg(long)]
    skip_ops: bool,
    /// How long a cluster may take to become healthy, in seconds.
    #[arg(long = "up-timeout-s", value_name = "SECONDS", default_value_t = 120)]
    up_timeout_s: u64,
    /// Keep n3 down while the store fills to the largest size, then time its catch-up.
    #[arg(long)]
    catch_up: bool,
    /// Only the store figures (in process): bytes per checkpoint record, disk after many ops.
    #[arg(long)]
    store_only: bool,
    /// Operations of the store figures' churn.
    #[arg(long, default_value_t = 1_000_000)]
    churn_ops: u64,
    /// Client counts measured at each size, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 8], value_parser = psls_bench::positive)]
    clients: Vec<usize>,
    /// Only the disk probe: appends against scattered pages, each with an fdatasync.
    #[arg(long)]
    fsync_probe: bool,
}

fn args() -> Result<Args> {
    let c = <Cli as clap::Parser>::parse();
    if c.sizes.is_empty() || !c.sizes.windows(2).all(|w| w[0] < w[1]) {
        bail!("--sizes must be increasing");
    }
    Ok(Args {
        sizes: c.sizes,
        ops: c.ops as usize,
        budget: Duration::from_secs(c.budget_s),
        rounds: c.rounds,
        vectors: c.vectors,
        every: c.every,
        offline: c.populate == "offline",
        dir: c.dir,
        skip_mgs: c.skip_mgs,
        skip_ops: c.skip_ops,
        catch_up: c.catch_up,
        store_only: c.store_only,
        churn_ops: c.churn_ops,
        up: Duration::from_secs(c.up_timeout_s),
        clients: c.clients,
        fsync_probe: c.fsync_probe,
    })
}

/// Latencies in seconds, sorted.
struct Sample {
    lat: Vec<f64>,
    wall_s: f64,
    /// Operations that failed, and the first failure.
    failed: usize,
    first_failure: Option<String>,
}

impl Sample {
    fn pct(&self, p: f64) -> f64 {
        if self.lat.is_empty() {
            return f64::NAN;
        }
        let i = ((self.lat.len() as f64 - 1.0) * p).round() as usize;
        self.lat[i.min(self.lat.len() - 1)]
    }
    fn rate(&self) -> f64 {
        self.lat.len() as f64 / self.wall_s
    }
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "ops": self.lat.len(), "p50_ms": json_f64(self.pct(0.5) * 1e3),
            "p99_ms": json_f64(self.pct(0.99) * 1e3), "per_s": json_f64(self.rate()),
            "failed": self.failed, "first_failure": self.first_failure,
        })
    }
    fn line(&self) -> String {
        format!(
            "{:5} ops, p50 {:8.2} ms, p99 {:8.2} ms, {:8.1}/s{}",
            self.lat.len(),
            self.pct(0.5) * 1e3,
            self.pct(0.99) * 1e3,
            self.rate(),
            match &self.first_failure {
                Some(f) => format!(" ({} failed, first: {f})", self.failed),
                None => String::new(),
            }
        )
    }
}

const NODES: [&str; 4] = ["n0", "n1", "n2", "n3"];

/// Runs `op(client, i)` for items `items` from `clients` threads (client `c` on node `c % 4`,
/// taking items `c, c + clients, ...`), until every item is done or `budget` is spent.
fn measure(
    cdir: &Path,
    nodes: &[&str],
    clients: usize,
    items: &[String],
    budget: Duration,
    op: fn(&mut psls_client::Client, &str) -> Result<()>,
) -> Result<(Sample, Vec<String>)> {
    let start = Instant::now();
    type Done = (Vec<f64>, Vec<String>, Vec<String>);
    let results: Vec<Result<Done>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..clients)
            .map(|c| {
                s.spawn(move || -> Result<Done> {
                    let mut cl = psls_client::cluster::connect(cdir, Some(nodes[c % nodes.len()]))?;
                    let mut lat = Vec::new();
                    let mut done = Vec::new();
                    let mut failed = Vec::new();
                    for name in items.iter().skip(c).step_by(clients) {
                        if start.elapsed() > budget {
                            break;
                        }
                        let t = Instant::now();
                        match op(&mut cl, name) {
                            Ok(()) => {
                                lat.push(t.elapsed().as_secs_f64());
                                done.push(name.clone());
                            }
                            Err(e) => failed.push(format!("{name} after {:.1} s: {e:#}", t.elapsed().as_secs_f64())),
                        }
                    }
                    Ok((lat, done, failed))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a client thread panicked")))
            })
            .collect()
    });
    let wall_s = start.elapsed().as_secs_f64();
    let mut lat = Vec::new();
    let mut done = Vec::new();
    let mut failures = Vec::new();
    for r in results {
        let (l, d, f) = r?;
        lat.extend(l);
        done.extend(d);
        failures.extend(f);
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let s = Sample {
        lat,
        wall_s,
        failed: failures.len(),
        first_failure: failures.into_iter().next(),
    };
    Ok((s, done))
}

fn create(c: &mut psls_client::Client, name: &str) -> Result<()> {
    c.create(name, 4096, 0o644)?;
    Ok(())
}
fn stat(c: &mut psls_client::Client, name: &str) -> Result<()> {
    c.stat(name)?;
    Ok(())
}
fn remove(c: &mut psls_client::Client, name: &str) -> Result<()> {
    c.rm(name)?;
    Ok(())
}

/// Files in the store now.
fn count(cdir: &Path, node: &str) -> Result<usize> {
    Ok(psls_client::cluster::connect(cdir, Some(node))?.ls()?.len())
}

/// Fills the store up to `target` files named `fill-*`.
fn populate(a: &Args, cdir: &Path, target: usize, nodes: &[&str]) -> Result<()> {
    let have = count(cdir, nodes[0])?;
    if have >= target {
        return Ok(());
    }
    let t = Instant::now();
    if a.offline {
        offline::fill(cdir, have, target, a.up)?;
    } else {
        let names: Vec<String> = (have..target).map(|i| format!("fill-{i}")).collect();
        let (s, _) = measure(cdir, nodes, 8, &names, Duration::from_secs(86_400), create)?;
        eprintln!("filled {} files by creates: {}", names.len(), s.line());
    }
    let now = count(cdir, nodes[0])?;
    if now != target {
        bail!("the store holds {now} files, not {target}");
    }
    eprintln!("store at {target} files ({:.1} s)", t.elapsed().as_secs_f64());
    Ok(())
}

/// Stops `node`'s daemon (SIGKILL).
fn stop(cdir: &Path, node: &str) -> Result<()> {
    let pid = psls_client::cluster::running_pid(cdir, node).with_context(|| format!("{node} is not running"))?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    psls_client::cluster::wait_gone(pid, Duration::from_secs(10));
    Ok(())
}

/// The store's own figures, in process: one voter (a `Log` over `MetaState` and a `LogStore` on
/// a real file with fsync), no network.
mod store {
    use super::*;
    use psls_cluster::log::{Action, Durable, Limits, Log};
    use psls_pfs::file::FileMeta;
    use psls_pfs::jobs::FileRuns;
    use psls_pfs::logstore::LogStore;
    use psls_pfs::meta::{MetaOp, MetaState};

    struct One {
        log: Log<MetaState, u64>,
        store: LogStore,
        /// Bytes handed to the store for the last operation: its log entry and its records.
        written: u64,
    }

    impl One {
        fn new(dir: &Path) -> Result<One> {
            let disk = psls_pfs::FileDisk::new(dir)?;
            let (store, opened) = LogStore::open(&disk, false)?;
            let mut durable: Durable<MetaState> = opened.durable;
            durable.amnesiac = false;
            let limits = Limits::for_timeout(1000, 50);
            let log = Log::new(0, 1, limits, durable, 1).map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut one = One { log, store, written: 0 };
            for _ in 0..100 {
                one.log.handle_tick();
                one.drain()?;
                if one.log.is_leader() {
                    break;
                }
            }
            Ok(one)
        }

        fn drain(&mut self) -> Result<()> {
            while let Some(a) = self.log.poll_action() {
                if let Action::Persist(p) = a {
                    self.written += p.entries.iter().map(|e| e.data.len() as u64 + 13).sum::<u64>();
                    self.written += postcard::to_stdvec(&(
                        &p.changes.files,
                        &p.changes.ids,
                        &p.changes.gens,
                        &p.changes.gen_deltas,
                        &p.changes.jobs,
                        &p.changes.nodes,
                    ))?
                    .len() as u64;
                    self.store.persist(&p)?;
                }
            }
            Ok(())
        }

        /// Submits a batch of operations, one write for all.
        fn batch(&mut self, ops: &[MetaOp]) -> Result<()> {
            for (i, op) in ops.iter().enumerate() {
                self.log.submit(i as u64, op);
            }
            self.drain()?;
            // The applied changes are written lazily: a tick writes them.
            self.log.handle_tick();
            self.drain()
        }
    }

    fn file(name: String, id: u64, pages: u64) -> FileMeta {
        FileMeta::zeroed(psls_svm::FileId(id), name, pages * 4096, 0, 0, 0o644, 0)
    }

    pub fn figures(churn_ops: u64) -> Result<()> {
        let tmp = tempfile::tempdir()?;
        // 1. A persistent checkpoint's records against the generation runs it changes, with
        //    100,000 other files in the store.
        let mut one = One::new(tmp.path())?;
        let others: Vec<MetaOp> = (0..100_000u64)
            .map(|i| MetaOp::CommitFile {
                meta: file(format!("other-{i}"), 1_000_000 + i, 1),
                replaces: None,
                placed_at: None,
            })
            .collect();
        for chunk in others.chunks(1000) {
            one.batch(chunk)?;
        }
        let mut rng = psls_svm::rng::SplitMix64::new(22);
        for (pattern, first_id) in [("shifting", 10u64), ("scattered", 20u64)] {
            let job = format!("bench-{pattern}");
            let files: Vec<u64> = (first_id..first_id + 4).collect();
            let mut ops: Vec<MetaOp> = files
                .iter()
                .map(|&f| MetaOp::CommitFile {
                    meta: file(format!("job-{f}"), f, 1024),
                    replaces: None,
                    placed_at: None,
                })
                .collect();
            ops.extend(files.iter().map(|&f| MetaOp::ClaimWriter {
                file: psls_svm::FileId(f),
                job: job.clone(),
            }));
            one.batch(&ops)?;
            let (mut sum_written, mut sum_runs, mut worst) = (0u64, 0u64, 0f64);
            let epochs = 200u64;
            for epoch in 1..=epochs {
                one.written = 0;
                one.batch(&[MetaOp::BeginCheckpoint {
                    job: job.clone(),
                    epoch,
                }])?;
                let begin = one.written;
                let st = one.log.state();
                let r = st.jobs.get(&job).cloned().unwrap_or_default();
                // Each file: 8 runs of 16 pages written, as a job writing blocks: shifting by
                // a page each time (the runs overlap the last checkpoint's), or anywhere.
                let runs: Vec<FileRuns> = files
                    .iter()
                    .map(|&f| FileRuns {
                        file: psls_svm::FileId(f),
                        runs: (0..8u64)
                            .map(|k| {
                                let at = match pattern {
                                    "shifting" => k * 128 + epoch % 64,
                                    _ => k * 128 + rng.below(112),
                                };
                                (at, at + 16)
                            })
                            .collect(),
                    })
                    .collect();
                let run_bytes: u64 = runs.iter().map(|f| 8 + 16 * f.runs.len() as u64).sum();
                one.written = 0;
                one.batch(&[MetaOp::Checkpoint {
                    job: job.clone(),
                    epoch,
                    gen: r.started_gen,
                    placed_at: st.map_version,
                    files: runs,
                    at_unix_ms: 0,
                    bytes: 0,
                }])?;
                let commit = one.written;
                sum_written += begin + commit;
                sum_runs += run_bytes;
                worst = worst.max((begin + commit) as f64 / run_bytes as f64);
                if epoch == epochs {
                    let gen_runs: usize = files
                        .iter()
                        .filter_map(|&f| one.log.state().file_by_id(psls_svm::FileId(f)))
                        .map(|f| f.written.runs())
                        .sum();
                    println!(
                        "persistent checkpoints ({pattern} runs) with 100,000 other files: last begin record {begin} B, commit record {commit} B, for {run_bytes} B of changed generation runs; the files hold {gen_runs} runs"
                    );
                }
            }
            let mean = sum_written as f64 / sum_runs as f64;
            println!("  {epochs} checkpoints: {mean:.2} x the changed runs (mean), worst {worst:.2} x");
            println!(
                "{}",
                serde_json::json!({"bench": "meta-ckpt-bytes", "pattern": pattern, "mean_ratio": mean, "worst_ratio": worst})
            );
        }
        drop(one);

        // 2. One create per write (no group commit), as a voter alone writes it: the cost of
        //    a write, with its fsync, apart from the network; in a fresh store and in the one
        //    holding 100,000 files.
        for (what, dir) in [
            ("a fresh store", tmp.path().join("single")),
            ("100,000 files", tmp.path().to_path_buf()),
        ] {
            std::fs::create_dir_all(&dir)?;
            let mut one = One::new(&dir)?;
            let n = 2000u64;
            let t = Instant::now();
            let cpu = cpu_s();
            for i in 0..n {
                one.batch(&[MetaOp::CommitFile {
                    meta: file(format!("single-{i}"), 5_000_000 + i, 1),
                    replaces: None,
                    placed_at: None,
                }])?;
            }
            let wall = t.elapsed().as_secs_f64() / n as f64;
            let cpu = (cpu_s() - cpu) / n as f64;
            println!(
                "one create per write, {n} writes, {what}: {:.0} µs each ({:.0} µs of CPU in this process)",
                wall * 1e6,
                cpu * 1e6
            );
        }

        // 3. Disk after many operations: creates and removes churning 10,000 live files.
        let dir = tmp.path().join("churn");
        std::fs::create_dir_all(&dir)?;
        let mut one = One::new(&dir)?;
        let live = 10_000u64;
        let t = Instant::now();
        let mut done = 0u64;
        let mut next = 0u64;
        while done < churn_ops {
            let mut ops = Vec::with_capacity(1000);
            for _ in 0..500 {
                ops.push(MetaOp::CommitFile {
                    meta: file(format!("churn-{next}"), 1 + next, 1),
                    replaces: None,
                    placed_at: None,
                });
                if next >= live {
                    let old = next - live;
                    ops.push(MetaOp::RemoveFile {
                        name: format!("churn-{old}"),
                        id: psls_svm::FileId(1 + old),
                    });
                }
                next += 1;
            }
            let before = done;
            done += ops.len() as u64;
            one.batch(&ops)?;
            for mark in [100_000u64, 250_000, 500_000] {
                if before < mark && done >= mark {
                    let st = one.log.state();
                    println!(
                        "  after {done} operations: store {:.2} MiB on disk, live state {:.2} MiB encoded",
                        one.store.bytes_on_disk() as f64 / (1 << 20) as f64,
                        st.encode().len() as f64 / (1 << 20) as f64
                    );
                }
            }
        }
        let st = one.log.state();
        let state_bytes = st.encode().len() as u64;
        let disk = one.store.bytes_on_disk();
        println!(
            "{done} operations ({:.0}/s in batches of 1000): {} live files, live state {:.2} MiB encoded, store {:.2} MiB on disk ({:.2} x), log {}..{}",
            done as f64 / t.elapsed().as_secs_f64(),
            st.files.len(),
            state_bytes as f64 / (1 << 20) as f64,
            disk as f64 / (1 << 20) as f64,
            disk as f64 / state_bytes as f64,
            one.log.first_index(),
            one.log.last_index()
        );
        println!(
            "{}",
            serde_json::json!({
                "bench": "meta-store",
                "churn_ops": done, "live_files": st.files.len(), "state_bytes": state_bytes, "disk_bytes": disk,
            })
        );
        Ok(())
    }
}

/// What one durable write costs on this disk, alone and with 5 writers at once (the voters of
/// a 5-node cluster): a 200-byte append, as a log file's record, against 16 scattered 4 KiB
/// pages, about what a redb commit writes; each followed by an fdatasync.
fn fsync_probe(dir: PathBuf) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir_in(dir)?;
    let writes = 400usize;
    let mut out = serde_json::json!({"bench": "fsync-probe", "writes": writes});
    for (what, pages) in [("append 200 B", 0usize), ("16 scattered pages", 16)] {
        for writers in [1usize, 5] {
            let lat: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..writers)
                    .map(|w| {
                        let path = tmp.path().join(format!("probe-{w}"));
                        s.spawn(move || -> Result<Vec<f64>> {
                            let f = std::fs::OpenOptions::new()
                                .create(true)
                                .truncate(true)
                                .read(true)
                                .write(true)
                                .open(&path)?;
                            f.set_len(64 << 20)?;
                            f.sync_all()?;
                            let page = vec![7u8; 4096];
                            let rec = vec![7u8; 200];
                            let mut lat = Vec::with_capacity(writes);
                            for k in 0..writes {
                                let t = Instant::now();
                                if pages == 0 {
                                    f.write_all_at(&rec, (k * rec.len()) as u64)?;
                                } else {
                                    for j in 0..pages {
                                        f.write_all_at(&page, (((k * 37 + j * 997) % 16_000) * 4096) as u64)?;
                                    }
                                }
                                f.sync_data()?;
                                lat.push(t.elapsed().as_secs_f64());
                            }
                            Ok(lat)
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a writer panicked"))))
                    .collect()
            });
            let mut all = Vec::new();
            for l in lat {
                all.extend(l?);
            }
            all.sort_by(|a, b| a.total_cmp(b));
            let p50 = all[all.len() / 2] * 1e3;
            let mean = all.iter().sum::<f64>() / all.len() as f64 * 1e3;
            println!("{what:20} + fdatasync, {writers} writer(s): p50 {p50:.3} ms, mean {mean:.3} ms");
            out[format!("{what}, {writers} writers")] = serde_json::json!({"p50_ms": p50, "mean_ms": mean});
        }
    }
    println!("{out}");
    Ok(())
}

/// CPU time this process used (user and system), in seconds.
fn cpu_s() -> f64 {
    let mut r = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `r` is a valid, writable rusage; getrusage only writes it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, r.as_mut_ptr()) };
    if rc != 0 {
        return 0.0;
    }
    // SAFETY: getrusage succeeded, so it filled `r` (and zeroed is a valid rusage anyway).
    let r = unsafe { r.assume_init() };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(r.ru_utime) + t(r.ru_stime)
}

/// Filling the store offline (the cluster stopped), for the code before issue 22.
mod offline {
    use super::*;
    use psls_pfs::meta::{FileMeta, MetaStore};
    use psls_pfs::FileDisk;

    pub fn fill(cdir: &Path, have: usize, target: usize, up: Duration) -> Result<()> {
        psls_client::cluster::down(cdir)?;
        let cfg = psls_ipc::ClusterConfig::load(&cdir.join("cluster.toml"))?;
        let mut stores = Vec::new();
        for n in cfg.all() {
            let disk = FileDisk::new(cfg.data_dir(n))?;
            let m = MetaStore::open(&disk).with_context(|| format!("metadata of {}", n.name))?;
            stores.push((n.name.clone(), m));
        }
        let first = stores[0].1.state().clone();
        if first.seq == 0 {
            bail!("--populate offline fills only stores of the format before the metadata log (this one is empty or newer): use --populate creates");
        }
        for (name, m) in &stores {
            if *m.state() != first {
                bail!("{name}'s metadata differs from {}'s: cannot fill offline", stores[0].0);
            }
        }
        let mut next = first;
        let mut rng = psls_svm::rng::SplitMix64::new(target as u64);
        for i in have..target {
            let name = format!("fill-{i}");
            next.files.insert(
                name.clone(),
                FileMeta {
                    id: psls_svm::FileId(rng.next_u64() | 1),
                    name,
                    size: 4096,
                    uid: 0,
                    gid: 0,
                    mode: 0o644,
                    gen: 0,
                    created_unix_ms: 0,
                    written: Default::default(),
                    writer: None,
                },
            );
        }
        next.seq += 1;
        for (_, m) in &mut stores {
            m.install(next.clone())?;
        }
        drop(stores);
        psls_client::cluster::up(cdir, up, true)?;
        Ok(())
    }
}

struct Mgs {
    time_s: f64,
    pause_s: f64,
    checkpoints: u64,
}

fn mgs(bin: &Path, cdir: &Path, a: &Args, level: Option<&str>) -> Result<Mgs> {
    let extra: Vec<&str> = match level {
        Some(l) => vec!["--level", l],
        None => vec![],
    };
    let j = psls_bench::run_mgs(
        bin,
        cdir,
        "n0",
        a.vectors,
        if level.is_some() { a.every } else { 0 },
        &extra,
    )?;
    Ok(Mgs {
        time_s: j["time_s"].as_f64().unwrap_or(f64::NAN),
        pause_s: j["checkpoint_pause_s"].as_f64().unwrap_or(0.0),
        checkpoints: j["checkpoints"].as_u64().unwrap_or(0),
    })
}

fn main() -> Result<()> {
    let a = args()?;
    if a.store_only {
        return store::figures(a.churn_ops);
    }
    if a.fsync_probe {
        return fsync_probe(a.dir.clone().unwrap_or_else(std::env::temp_dir));
    }
    let bin = std::env::current_exe()?.parent().context("no folder")?.to_path_buf();
    for b in ["psls", "psls-node", "mgs"] {
        if !bin.join(b).exists() {
            bail!("{b} not found next to meta-bench: run `cargo build --release --workspace --bins` first");
        }
    }
    let tmp = tempfile::Builder::new()
        .prefix("meta-bench")
        .tempdir_in(a.dir.clone().unwrap_or_else(std::env::temp_dir))?;
    let port = 30000 + (std::process::id() % 1000) as u16 * 16;
    let big = tmp.path().join("big");
    let empty = tmp.path().join("empty");
    psls_client::cluster::init(&big, 4, 1, 1024, port, false)?;
    psls_client::cluster::init(&empty, 4, 1, 1024, port + 8, false)?;
    let r = run(&a, &bin, &big, &empty);
    let _ = psls_client::cluster::down(&big);
    let _ = psls_client::cluster::down(&empty);
    r
}

fn run(a: &Args, bin: &Path, big: &Path, empty: &Path) -> Result<()> {
    let mut out = serde_json::json!({"bench": "meta", "populate": if a.offline { "offline" } else { "creates" }});
    psls_client::cluster::up(big, a.up, true)?;
    let mut sizes = Vec::new();
    let largest = *a.sizes.last().unwrap_or(&0);
    for &size in &a.sizes {
        let lagging = a.catch_up && size == largest;
        if lagging {
            stop(big, "n3")?;
        }
        let before = count(big, "n0")?;
        populate(a, big, size, if lagging { &NODES[..3] } else { &NODES })?;
        if lagging {
            let t = Instant::now();
            psls_client::cluster::up(big, a.up, true)?;
            let secs = t.elapsed().as_secs_f64();
            println!(
                "n3, down while {} operations were applied, caught up in {secs:.2} s (from its start to the cluster healthy)",
                size - before
            );
            out["catch_up"] = serde_json::json!({"missed_ops": size - before, "s": secs});
        }
        if a.skip_ops {
            continue;
        }
        let mut row = serde_json::json!({"files": size});
        for &clients in &a.clients {
            let names: Vec<String> = (0..a.ops).map(|i| format!("b{size}-{clients}-{i}")).collect();
            let (c, made) = measure(big, &NODES, clients, &names, a.budget, create)?;
            let (s, _) = measure(big, &NODES, clients, &made, a.budget, stat)?;
            let (r, removed) = measure(big, &NODES, clients, &made, a.budget, remove)?;
            // Whatever the budget left behind goes too, so the store is back at `size`.
            let left: Vec<String> = made.iter().filter(|n| !removed.contains(n)).cloned().collect();
            measure(big, &NODES, 8, &left, Duration::from_secs(86_400), remove)?;
            println!("{size:7} files, {clients} client(s): create {}", c.line());
            println!("{size:7} files, {clients} client(s): stat   {}", s.line());
            println!("{size:7} files, {clients} client(s): remove {}", r.line());
            row[format!("clients_{clients}")] =
                serde_json::json!({"create": c.json(), "stat": s.json(), "remove": r.json()});
        }
        sizes.push(row);
    }
    out["sizes"] = serde_json::json!(sizes);
    psls_client::cluster::down(big)?;
    if !a.skip_mgs {
        let largest = *a.sizes.last().unwrap_or(&0);
        let levels = [None, Some("persistent"), Some("memory")];
        // (store, level) → runs.
        let mut runs: Vec<Vec<Vec<Mgs>>> = (0..2).map(|_| (0..3).map(|_| Vec::new()).collect()).collect();
        for round in 0..a.rounds {
            for (k, cdir) in [empty, big].into_iter().enumerate() {
                for (l, level) in levels.iter().enumerate() {
                    psls_client::cluster::up(cdir, a.up, true)?;
                    let m = mgs(bin, cdir, a, *level);
                    psls_client::cluster::down(cdir)?;
                    let m = m?;
                    eprintln!(
                        "round {} {} files, {}: {:.3} s, {} checkpoints, pause {:.3} s",
                        round + 1,
                        if k == 0 { 0 } else { largest },
                        level.unwrap_or("no checkpoint"),
                        m.time_s,
                        m.checkpoints,
                        m.pause_s
                    );
                    runs[k][l].push(m);
                }
            }
        }
        let mut rows = Vec::new();
        for (l, level) in levels.iter().enumerate() {
            let span = |v: &[Mgs], f: fn(&Mgs) -> f64| {
                let lo = v.iter().map(f).fold(f64::INFINITY, f64::min);
                let hi = v.iter().map(f).fold(f64::NEG_INFINITY, f64::max);
                (lo, hi)
            };
            let (e, b) = (&runs[0][l], &runs[1][l]);
            let (ep, bp) = (span(e, |m| m.pause_s), span(b, |m| m.pause_s));
            let (et, bt) = (span(e, |m| m.time_s), span(b, |m| m.time_s));
            let name = level.unwrap_or("none");
            println!(
                "MGS {v}², {name:10}: pause {:.3}–{:.3} s / run {:.3}–{:.3} s (empty store); pause {:.3}–{:.3} s / run {:.3}–{:.3} s ({largest} files)",
                ep.0, ep.1, et.0, et.1, bp.0, bp.1, bt.0, bt.1,
                v = a.vectors
            );
            rows.push(serde_json::json!({
                "level": name, "checkpoints": e.first().map_or(0, |m| m.checkpoints),
                "empty_pause_s": [json_f64(ep.0), json_f64(ep.1)], "empty_time_s": [json_f64(et.0), json_f64(et.1)],
                "full_pause_s": [json_f64(bp.0), json_f64(bp.1)], "full_time_s": [json_f64(bt.0), json_f64(bt.1)],
            }));
        }
        out["mgs"] = serde_json::json!({"vectors": a.vectors, "every": a.every, "files": largest, "levels": rows});
    }
    println!("{out}");
    Ok(())
}
