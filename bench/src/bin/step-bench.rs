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
//! The last rank prints one JSON line: the median and the 90th percentile of each, in µs.

use anyhow::{bail, Context, Result};
use psls_client::Session;
use std::time::Instant;

const PAGE: usize = 4096;

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p) as usize]
}

fn main() -> Result<()> {
    let mut iters = 2000usize;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        match k.as_str() {
            "--iters" => {
                iters = it
                    .next()
                    .context("--iters needs a value")?
                    .parse()
                    .context("--iters: not a number")?
            }
            "-h" | "--help" => {
                println!("usage: psls run -n 2 -- step-bench [--iters N]");
                return Ok(());
            }
            _ => bail!("unknown argument {k} (use --iters N)"),
        }
    }
    if iters < 10 {
        bail!("--iters must be at least 10");
    }
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
    s.barrier("end")?;
    if rank == last {
        let j = serde_json::json!({
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
