//! `psls-bench`: benchmarks and the benchmark applications. Every figure is reported as a
//! ratio to a baseline measured in the same run, because this machine is shared and noisy.
//! Binaries (each answers `--help`): `pfs-bench` (PFS import/export throughput), `mgs` (the
//! MGS job, run with `psls run`), `fault-bench` (fault latencies), `step-bench` (barrier and
//! step against MPI, run with `psls run`), `link-bench` (a link message against plain TCP),
//! `ckpt-bench` and `mem-bench` (checkpoint costs on MGS), `figures` (the paper's Figures 5
//! and 6), `meta-bench` (metadata as the namespace grows).

/// A command-line count that must be at least 1 (clap's value parser for such arguments).
pub fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// An MGS size for the checkpoint benchmarks: at least 50 vectors (one checkpoint at the
/// smallest K).
pub fn vectors(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 50 => Ok(n),
        Ok(_) => Err("must be at least 50".into()),
        Err(e) => Err(e.to_string()),
    }
}

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

/// Runs MGS `vectors`×`vectors` as a 4-rank job on the cluster in `cdir`, from node `node`,
/// with a safe point every `every` vectors (0: none) and `extra` `psls run` options; returns
/// its result line (checked: `ok`). `bin` holds `psls` and `mgs`.
pub fn run_mgs(
    bin: &std::path::Path,
    cdir: &std::path::Path,
    node: &str,
    vectors: usize,
    every: usize,
    extra: &[&str],
) -> anyhow::Result<serde_json::Value> {
    use anyhow::{bail, Context};
    let mut c = std::process::Command::new(bin.join("psls"));
    c.arg("--dir").arg(cdir).args(["--node", node, "run", "-n", "4"]);
    c.args(extra).arg("--").arg(bin.join("mgs"));
    let v = vectors.to_string();
    c.args(["--vectors", &v, "--dim", &v, "--no-baseline"]);
    if every > 0 {
        c.args(["--checkpoint-every", &every.to_string()]);
    }
    let o = c.output().context("running psls run")?;
    let out = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() {
        bail!("mgs failed: {out}{}", String::from_utf8_lossy(&o.stderr));
    }
    let line = out
        .lines()
        .find(|l| l.contains("\"bench\":\"mgs\""))
        .with_context(|| format!("no MGS result in:\n{out}"))?;
    let j: serde_json::Value = serde_json::from_str(line.trim_start_matches("[0] "))?;
    if j["ok"] != true {
        bail!("MGS result check failed: {line}");
    }
    Ok(j)
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
