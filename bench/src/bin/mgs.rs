//! The MGS job (DESIGN §11): Modified Gram-Schmidt over `--vectors` vectors of `--dim` doubles
//! stored in a mapped PFS file, page-aligned vectors distributed cyclically over the ranks,
//! one barrier per step. Run it as a job: `psls run -n 4 -- mgs`.
//!
//! Rank 0 checks the result (max |QᵀQ − I| below 1e-9), runs the same kernel on plain shared
//! memory with as many threads as there are ranks (the baseline, in the same run), and prints
//! one JSON line: times (`init_s`: until rank 0 finished writing its initial vectors, the
//! first touch of every page included), their ratio, fault counts per node, bytes moved, and a
//! checksum of Q (bit-identical whatever the number of ranks: every vector sees the same
//! operations in the same order).
//!
//! With `--checkpoint-every K` every rank makes the safe-point call (`Session::checkpoint`) at
//! the top of every K-th step with the step number as its state; a rank restarted from a
//! checkpoint (`Session::restart_state`) goes on from that step, so a run that survived
//! failures ends with the same checksum as one that did not.

use anyhow::{bail, Context, Result};
use psls_client::Session;
use std::time::Instant;

/// Modified Gram-Schmidt on a PSLS file, run as a job: `psls run -n 4 -- mgs`.
#[derive(clap::Parser)]
#[command(name = "mgs", version, about)]
struct Args {
    /// Vectors to orthogonalize.
    #[arg(long, default_value_t = 1024, value_parser = psls_bench::positive)]
    vectors: usize,
    /// Doubles per vector (at least the number of vectors).
    #[arg(long, default_value_t = 1024, value_parser = psls_bench::positive)]
    dim: usize,
    /// The PSLS file to keep the vectors in (default: `mgs-JOB-VECTORSxDIM`, named after the
    /// job; `mgs-VECTORSxDIM` outside `psls run`).
    #[arg(long, value_name = "NAME")]
    file: Option<String>,
    /// Skip the plain-threads baseline.
    #[arg(long)]
    no_baseline: bool,
    /// Make the safe-point call every K steps (0: never).
    #[arg(long, value_name = "K", default_value_t = 0)]
    checkpoint_every: usize,
}

fn args() -> Result<Args> {
    let a = <Args as clap::Parser>::parse();
    if a.vectors > a.dim {
        bail!(
            "--vectors must be at most --dim (got {} vectors of {})",
            a.vectors,
            a.dim
        );
    }
    Ok(a)
}

/// Doubles between vector starts: each vector starts on a page.
/// Words per rank in the stats segment: the node's number, then its counters.
const SLOT: usize = 19;

fn stride(dim: usize) -> usize {
    (dim * 8).div_ceil(4096) * 4096 / 8
}

/// The initial value of element `k` of vector `i` (well conditioned: a random perturbation of
/// a diagonally dominant matrix).
fn initial(i: usize, k: usize) -> f64 {
    let r = psls_svm::rng::mix64(((i as u64) << 32) ^ k as u64 ^ 0x4d47_5300);
    let noise = (r >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
    noise + if i == k { 4.0 } else { 0.0 }
}

/// Raw access to the vectors, shared by the ranks (or threads) of one run.
#[derive(Clone, Copy)]
struct Vectors {
    base: *mut f64,
    stride: usize,
    dim: usize,
}

// SAFETY: ranks write only their own vectors and read others' only after a barrier that
// follows the last write (see `kernel`), so no access races.
unsafe impl Send for Vectors {}
// SAFETY: as above.
unsafe impl Sync for Vectors {}

impl Vectors {
    /// Vector `i`.
    ///
    /// # Safety
    /// No other rank may write vector `i` while the slice lives.
    unsafe fn get(&self, i: usize) -> &[f64] {
        // SAFETY: the caller's promise; the range lies inside the mapping.
        unsafe { std::slice::from_raw_parts(self.base.add(i * self.stride), self.dim) }
    }
    /// Vector `i`, for writing.
    ///
    /// # Safety
    /// Only the owner of vector `i` writes it, and nobody reads it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut(&self, i: usize) -> &mut [f64] {
        // SAFETY: the caller's promise; the range lies inside the mapping.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(i * self.stride), self.dim) }
    }
}

/// The safe-point call at the top of step `i`, if any.
type SafePoint<'a> = &'a dyn Fn(usize) -> Result<()>;

/// Rank `rank` of `size`: initialize its vectors (unless restarting at step `start` > 0), then
/// orthonormalize all of them in place, calling `safe_point` at the top of every step.
fn kernel(
    v: Vectors,
    n: usize,
    (rank, size): (usize, usize),
    start: usize,
    barrier: &dyn Fn() -> Result<()>,
    safe_point: SafePoint<'_>,
) -> Result<()> {
    if start == 0 {
        for i in (rank..n).step_by(size) {
            // SAFETY: vector i is this rank's.
            let x = unsafe { v.get_mut(i) };
            for (k, e) in x.iter_mut().enumerate() {
                *e = initial(i, k);
            }
        }
        barrier()?;
    }
    for i in start..n {
        safe_point(i)?;
        if i % size == rank {
            // SAFETY: vector i is this rank's; others read it only after the barrier below.
            let q = unsafe { v.get_mut(i) };
            let norm = q.iter().map(|e| e * e).sum::<f64>().sqrt();
            for e in q.iter_mut() {
                *e /= norm;
            }
        }
        barrier()?;
        // SAFETY: q_i is final (written before the barrier, never again).
        let q = unsafe { v.get(i) };
        for j in (i + 1..n).filter(|j| j % size == rank) {
            // SAFETY: vector j is this rank's.
            let x = unsafe { v.get_mut(j) };
            let d: f64 = q.iter().zip(x.iter()).map(|(a, b)| a * b).sum();
            for (e, qe) in x.iter_mut().zip(q) {
                *e -= d * qe;
            }
        }
    }
    Ok(())
}

/// max |QᵀQ − I| and a checksum of Q's bits.
fn check(v: Vectors, n: usize) -> (f64, u64) {
    let mut worst = 0f64;
    let mut sum = 0u64;
    for i in 0..n {
        // SAFETY: the run is over; nobody writes any more.
        let qi = unsafe { v.get(i) };
        for e in qi {
            sum = psls_svm::rng::mix64(sum ^ e.to_bits());
        }
        for j in i..n {
            // SAFETY: as above.
            let qj = unsafe { v.get(j) };
            let d: f64 = qi.iter().zip(qj).map(|(a, b)| a * b).sum();
            let want = if i == j { 1.0 } else { 0.0 };
            worst = worst.max((d - want).abs());
        }
    }
    (worst, sum)
}

/// The kernel on plain shared memory with `threads` threads; seconds and checksum.
fn baseline(n: usize, dim: usize, threads: usize) -> Result<(f64, f64, u64)> {
    let s = stride(dim);
    let mut mem = vec![0f64; n * s];
    let v = Vectors {
        base: mem.as_mut_ptr(),
        stride: s,
        dim,
    };
    let bar = std::sync::Barrier::new(threads);
    let t = Instant::now();
    std::thread::scope(|sc| -> Result<()> {
        let hs: Vec<_> = (0..threads)
            .map(|r| {
                let bar = &bar;
                sc.spawn(move || {
                    let wait = || {
                        bar.wait();
                        Ok(())
                    };
                    kernel(v, n, (r, threads), 0, &wait, &|_| Ok(()))
                })
            })
            .collect();
        for h in hs {
            h.join().map_err(|_| anyhow::anyhow!("baseline thread panicked"))??;
        }
        Ok(())
    })?;
    let secs = t.elapsed().as_secs_f64();
    let (err, sum) = check(v, n);
    drop(mem);
    Ok((secs, err, sum))
}

fn counters(s: &Session) -> Result<(String, std::collections::BTreeMap<String, u64>)> {
    let (node, c) = s.node_stats()?;
    Ok((node, c.into_iter().collect()))
}

fn main() -> Result<()> {
    let a = args()?;
    let s = Session::connect().context("connecting to the node daemon")?;
    let (rank, size) = (s.rank() as usize, s.size() as usize);
    let st = stride(a.dim);
    let bytes = (a.vectors * st * 8) as u64;
    // The default file is the job's own: two jobs never write one file by accident, and a
    // resumed job (same name) finds its vectors.
    let name = a.file.clone().unwrap_or_else(|| match std::env::var("PSLS_JOB") {
        Ok(job) if !job.is_empty() => format!("mgs-{job}-{}x{}", a.vectors, a.dim),
        _ => format!("mgs-{}x{}", a.vectors, a.dim),
    });
    let mut m = s.map(&name, bytes, true).with_context(|| format!("mapping '{name}'"))?;
    let v = Vectors {
        base: m.as_mut_slice::<f64>().as_mut_ptr(),
        stride: st,
        dim: a.dim,
    };
    // Each rank reports its node's counters through a volatile segment: before and after.
    let mut stats_seg = s.create_volatile(
        &format!("{name}-stats-{}", std::env::var("PSLS_JOB").unwrap_or_default()),
        4096 * 64,
    )?;
    let barrier_ns = std::sync::atomic::AtomicU64::new(0);
    let barrier = || -> Result<()> {
        let t = Instant::now();
        let r = s.barrier("mgs").map_err(Into::into);
        barrier_ns.fetch_add(t.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        r
    };
    barrier()?;
    let before = counters(&s)?;
    barrier()?;
    barrier_ns.store(0, std::sync::atomic::Ordering::Relaxed);
    let t = Instant::now();
    let init_ns = std::sync::atomic::AtomicU64::new(0);
    let counted = || -> Result<()> {
        let _ = init_ns.compare_exchange(
            0,
            t.elapsed().as_nanos() as u64,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
        barrier()
    };
    // A restarted rank goes on from the step of the checkpoint it restarts from.
    let start = match s.restart_state().context("restart state")? {
        Some((epoch, state)) => {
            let step = state
                .get(..8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as usize)
                .context("a restart state of fewer than 8 bytes")?;
            eprintln!("rank {rank}: restarted from checkpoint {epoch} at step {step}");
            step
        }
        None => 0,
    };
    let every = a.checkpoint_every;
    let checkpoints = std::sync::atomic::AtomicU64::new(0);
    let checkpoint_pages = std::sync::atomic::AtomicU64::new(0);
    let checkpoint_ns = std::sync::atomic::AtomicU64::new(0);
    let stopped_us = std::sync::atomic::AtomicU64::new(0);
    let safe_point = |i: usize| -> Result<()> {
        if every > 0 && i > start && i.is_multiple_of(every) {
            let t = Instant::now();
            let c = s.checkpoint(&(i as u64).to_le_bytes()).context("checkpoint")?;
            if c.taken() {
                checkpoints.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                checkpoint_pages.fetch_add(c.pages, std::sync::atomic::Ordering::Relaxed);
                checkpoint_ns.fetch_add(t.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
                stopped_us.fetch_add(c.stopped_us, std::sync::atomic::Ordering::Relaxed);
            }
        }
        Ok(())
    };
    kernel(v, a.vectors, (rank, size), start, &counted, &safe_point)?;
    barrier()?;
    let secs = t.elapsed().as_secs_f64();
    let barrier_s = barrier_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9;
    let after = counters(&s)?;
    {
        // Slot per rank: node index (from its name's digits), then the counter deltas.
        let slots: &mut [u64] = stats_seg.as_mut_slice();
        let keys = [
            "local_faults",
            "read_requests",
            "write_requests",
            "pages_in",
            "pages_out",
            "pages_loaded",
            "joined_reads",
            "posted_messages",
            "link_writes",
            "store_page_writes",
            "frames_peak",
            "frames_peak_recovery",
            "frames_peak_pre_recovery",
            "wp_faults",
            "ckpt_pages_taken",
            "ckpt_pages_sent",
            "coherence_messages",
        ];
        let base = rank * SLOT;
        if base + SLOT <= slots.len() {
            let node_no: u64 = after
                .0
                .trim_start_matches(|c: char| !c.is_ascii_digit())
                .parse()
                .unwrap_or(u64::MAX);
            slots[base] = node_no.saturating_add(1);
            for (k, key) in keys.iter().enumerate() {
                let now = *after.1.get(*key).unwrap_or(&0);
                // The peak is a level, not a count: as it stands after the run.
                slots[base + 1 + k] = if key.starts_with("frames_peak") {
                    now
                } else {
                    now.saturating_sub(*before.1.get(*key).unwrap_or(&0))
                };
            }
        }
    }
    barrier()?;
    if rank == 0 {
        let (max_err, checksum) = check(v, a.vectors);
        let slots: &[u64] = stats_seg.as_slice();
        let mut per_node = serde_json::Map::new();
        let mut pages_moved = 0u64;
        let mut posted = 0u64;
        let mut datagrams = 0u64;
        let mut disk_pages = 0u64;
        let (mut ckpt_taken, mut ckpt_sent) = (0u64, 0u64);
        let mut coherence = 0u64;
        for r in 0..size.min(slots.len() / SLOT) {
            let b = r * SLOT;
            if slots[b] == 0 {
                continue;
            }
            // Counters are per node: ranks sharing a node report the same ones, counted once.
            let node = format!("n{}", slots[b] - 1);
            if per_node.contains_key(&node) {
                continue;
            }
            pages_moved += slots[b + 4];
            disk_pages += slots[b + 10];
            ckpt_taken += slots[b + 15];
            ckpt_sent += slots[b + 16];
            coherence += slots[b + 17];
            posted += slots[b + 8];
            datagrams += slots[b + 9];
            per_node.insert(
                node,
                serde_json::json!({
                    "local_faults": slots[b + 1],
                    "read_faults": slots[b + 2],
                    "write_faults": slots[b + 3],
                    "pages_in": slots[b + 4],
                    "pages_out": slots[b + 5],
                    "pages_loaded": slots[b + 6],
                    "joined_reads": slots[b + 7],
                    "posted_messages": slots[b + 8],
                    "link_writes": slots[b + 9],
                    "store_page_writes": slots[b + 10],
                    "frames_peak": slots[b + 11],
                    "frames_peak_recovery": slots[b + 12],
                    "frames_peak_pre_recovery": slots[b + 13],
                    "wp_faults": slots[b + 14],
                    "ckpt_pages_taken": slots[b + 15],
                    "ckpt_pages_sent": slots[b + 16],
                    "coherence_messages": slots[b + 17],
                }),
            );
        }
        let (base_s, base_err, base_sum) = if a.no_baseline {
            (f64::NAN, 0.0, checksum)
        } else {
            baseline(a.vectors, a.dim, size)?
        };
        let ok = max_err < 1e-9 && base_err < 1e-9 && base_sum == checksum;
        let j = psls_bench::json_f64;
        println!(
            "{}",
            serde_json::json!({
                "bench": "mgs",
                "vectors": a.vectors,
                "dim": a.dim,
                "ranks": size,
                "time_s": secs,
                "checkpoint_every": every,
                "checkpoints": checkpoints.load(std::sync::atomic::Ordering::Relaxed),
                "checkpoint_bytes": checkpoint_pages.load(std::sync::atomic::Ordering::Relaxed) * 4096,
                "checkpoint_pause_s": checkpoint_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9,
                "checkpoint_stop_s": stopped_us.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6,
                "restarted_at_step": start,
                "rank0_barrier_wait_s": barrier_s,
                "init_s": init_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9,
                "baseline_threads": size,
                "baseline_s": j(base_s),
                "ratio": j(secs / base_s),
                "max_err": max_err,
                "checksum": format!("{checksum:016x}"),
                "baseline_checksum": format!("{base_sum:016x}"),
                "ok": ok,
                "faults_per_node": per_node,
                "bytes_moved": pages_moved * 4096,
                "messages": posted,
                "messages_per_step": posted as f64 / a.vectors as f64,
                "coherence_messages_per_step": coherence as f64 / a.vectors as f64,
                "link_writes": datagrams,
                "disk_pages_written": disk_pages,
                "ckpt_pages_taken": ckpt_taken,
                "ckpt_pages_sent": ckpt_sent,
                "ckpt_transfers_per_page": j(ckpt_sent as f64 / ckpt_taken as f64),
            })
        );
        if !ok {
            bail!("MGS result check failed: max |QᵀQ − I| = {max_err:e} (baseline {base_err:e}), checksums {checksum:016x} / {base_sum:016x}");
        }
    }
    barrier()?;
    drop(stats_seg);
    drop(m);
    Ok(())
}
