//! What the cluster simulators share: the seeds a run covers. `PSLS_SIM_SEED=N` runs seed N
//! alone; `PSLS_SIM_SEEDS=N` runs seeds 0..N (`PSLS_SIM_FROM=M`: M..N, to split a long run
//! over several processes); otherwise seeds 0..`default`.

/// The seeds to run.
pub fn seeds(default: u64) -> std::ops::Range<u64> {
    let var = |name: &str| std::env::var(name).ok().and_then(|s| s.parse::<u64>().ok());
    match var("PSLS_SIM_SEED") {
        Some(s) => s..s + 1,
        None => var("PSLS_SIM_FROM").unwrap_or(0)..var("PSLS_SIM_SEEDS").unwrap_or(default),
    }
}
