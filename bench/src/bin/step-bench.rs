//! The step micro-benchmark (issue 24): what one step of a shared-memory program costs, run as
//! a job (`psls run -n 2 -- step-bench`), the baseline being `bench/mpi/step_mpi.c` in the same
//! script (`bench/mpi.sh`).
//!
//! - barrier: `--iters` barriers, each timed on every rank;
//! - step: rank 0 writes two pages of a mapped file (taking them back from the reader: a
//!   write fault each), a barrier, then the last rank reads both (a read fault each); timed on
//!   the last rank from the barrier that starts the iteration to the end of its reads, as
//!   `step_mpi` times an 8 KiB `MPI_Bcast` on its last rank.
//!
//! - with `--ckpt-pages N` (run under `psls run --level memory`), barriers while memory
//!   checkpoints are copied: every `--ckpt-every K` iterations each rank writes the N pages of
//!   a file of its own and makes the safe-point call (a memory checkpoint whose copies go on
//!   after the call returns); only the barriers are timed, so the figure shows what the
//!   checkpoints' traffic costs the job's control messages.
//!
//! The last rank prints one JSON line: the median and the 90th percentile of each, in µs.

use anyhow::{bail, Context, Result};
use psls_client::Session;
use std::time::Instant;

const PAGE: usize = 4096;

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p) as usize]
}

/// The step micro-benchmark, run as a job: `psls run -n 2 [--level memory] -- step-bench`.
#[derive(clap::Parser)]
#[command(name = "step-bench", version, about)]
struct Args {
    /// Iterations (at least 10).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(10..))]
    iters: u64,
    /// Pages each rank writes and checkpoints during the barrier run (0: no checkpoints).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    ckpt_pages: u64,
    /// A checkpoint every K barriers (with `--ckpt-pages`).
    #[arg(long, value_name = "K", default_value_t = 50, value_parser = psls_bench::positive)]
    ckpt_every: usize,
}

fn main() -> Result<()> {
    let a = <Args as clap::Parser>::parse();
    let (iters, ckpt_pages, ckpt_every) = (a.iters as usize, a.ckpt_pages as usize, a.ckpt_every);
    let s = Session::connect().context("connecting to the node daemon")?;
    let (rank, size) = (s.rank() as usize, s.size() as usize);
    if size < 2 {
        bail!("run it with at least 2 ranks");
    }
    let name = format!("step-bench-{}", std::env::var("PSLS_JOB").unwrap_or_default());
    let mut m = s.map(&name, 2 * PAGE as u64, true).context("mapping the pages")?;
    let pages: &mut [u64] = m.as_mut_slice();
    for _ in 0..100 {
        s.barrier("warm")?;
    }
    let mut barrier_us = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        s.barrier("b")?;
        barrier_us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let last = size - 1;
    let words = PAGE / 8;
    let mut step_us = Vec::with_capacity(iters);
    let mut check = 0u64;
    for i in 0..iters {
        s.barrier("s0")?;
        let t = Instant::now();
        if rank == 0 {
            // Plain writes to the mapping; the reader reads only after the barrier below.
            pages[0] = i as u64;
            pages[words] = i as u64;
        }
        s.barrier("s1")?;
        if rank == last {
            let (a, b) = (std::hint::black_box(pages[0]), std::hint::black_box(pages[words]));
            if a != i as u64 || b != i as u64 {
                bail!("step {i}: read {a} and {b}, not {i}");
            }
            check += a;
            step_us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    // Barriers while memory checkpoints are copied.
    let mut ckpt_barrier_us = Vec::new();
    let mut checkpoints = 0u64;
    if ckpt_pages > 0 {
        let own = format!("{name}-ckpt-{rank}");
        let mut c = s
            .map(&own, (ckpt_pages * PAGE) as u64, true)
            .context("mapping the checkpointed pages")?;
        let words: &mut [u64] = c.as_mut_slice();
        ckpt_barrier_us.reserve(iters);
        for i in 0..iters {
            if i % ckpt_every == 0 {
                for p in 0..ckpt_pages {
                    words[p * (PAGE / 8)] = i as u64;
                }
                if s.checkpoint(&(i as u64).to_le_bytes()).context("checkpoint")?.epoch > 0 {
                    checkpoints += 1;
                }
            }
            let t = Instant::now();
            s.barrier("c")?;
            ckpt_barrier_us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    s.barrier("end")?;
    if rank == last {
        let (cp50, cp90) = if ckpt_barrier_us.is_empty() {
            (0.0, 0.0)
        } else {
            (
                percentile(&mut ckpt_barrier_us, 0.5),
                percentile(&mut ckpt_barrier_us, 0.9),
            )
        };
        let j = serde_json::json!({
            "ckpt_pages": ckpt_pages,
            "ckpt_every": ckpt_every,
            "checkpoints": checkpoints,
            "ckpt_barrier_p50_us": cp50,
            "ckpt_barrier_p90_us": cp90,
            "bench": "step",
            "ranks": size,
            "iters": iters,
            "barrier_p50_us": percentile(&mut barrier_us, 0.5),
            "barrier_p90_us": percentile(&mut barrier_us, 0.9),
            "step_p50_us": percentile(&mut step_us, 0.5),
            "step_p90_us": percentile(&mut step_us, 0.9),
            "check": check,
        });
        println!("{j}");
    }
    Ok(())
}
