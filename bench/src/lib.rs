//! `psls-bench`: benchmarks and the benchmark applications. Every figure is reported as a
//! ratio to a baseline measured in the same run, because this machine is shared and noisy.
//! Binaries: `pfs-bench` (PFS import/export throughput).

/// Median of a non-empty sample.
pub fn median(v: &mut [f64]) -> f64 {
    assert!(!v.is_empty(), "median of nothing");
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Deterministic pseudo-random bytes (splitmix64).
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut s = seed;
    for chunk in out.chunks_mut(8) {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_picks_middle() {
        assert_eq!(super::median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::random_bytes(16, 1), super::random_bytes(16, 1));
        assert_ne!(super::random_bytes(16, 1), super::random_bytes(16, 2));
    }
}
