//! `psls-bench`: benchmarks and the benchmark applications. Every figure is reported as a
//! ratio to a baseline measured in the same run, because this machine is shared and noisy.
//! Binaries: `pfs-bench` (PFS import/export throughput), `mgs` (the MGS job, run with
//! `psls run`), `fault-bench` (fault latencies).

/// Median of a non-empty sample.
pub fn median(v: &mut [f64]) -> f64 {
    assert!(!v.is_empty(), "median of nothing");
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub use psls_svm::rng::random_bytes;

/// A figure as JSON: the number, or `null` when it is not finite (not measured).
pub fn json_f64(x: f64) -> serde_json::Value {
    if x.is_finite() {
        serde_json::json!(x)
    } else {
        serde_json::Value::Null
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_picks_middle() {
        assert_eq!(super::median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::random_bytes(16, 1), super::random_bytes(16, 1));
        assert_ne!(super::random_bytes(16, 1), super::random_bytes(16, 2));
        assert_eq!(super::json_f64(1.5), serde_json::json!(1.5));
        assert!(super::json_f64(f64::NAN).is_null());
    }
}
