//! Every benchmark binary answers `--help` and `--version`, and a bad argument gets one error
//! that names it (clap's), without a backtrace.

use std::process::Command;

const BINS: [(&str, &str); 9] = [
    ("mgs", env!("CARGO_BIN_EXE_mgs")),
    ("fault-bench", env!("CARGO_BIN_EXE_fault-bench")),
    ("pfs-bench", env!("CARGO_BIN_EXE_pfs-bench")),
    ("ckpt-bench", env!("CARGO_BIN_EXE_ckpt-bench")),
    ("mem-bench", env!("CARGO_BIN_EXE_mem-bench")),
    ("figures", env!("CARGO_BIN_EXE_figures")),
    ("step-bench", env!("CARGO_BIN_EXE_step-bench")),
    ("link-bench", env!("CARGO_BIN_EXE_link-bench")),
    ("meta-bench", env!("CARGO_BIN_EXE_meta-bench")),
];

fn run(bin: &str, args: &[&str]) -> (i32, String, String) {
    let o = Command::new(bin)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("the binary runs");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn every_bench_binary_has_help_version_and_names_a_bad_argument() {
    for (name, bin) in BINS {
        let (code, out, err) = run(bin, &["--help"]);
        assert_eq!(code, 0, "{name} --help: {err}");
        assert!(out.contains(&format!("Usage: {name}")), "{name} --help:\n{out}");
        let (code, out, _) = run(bin, &["--version"]);
        assert_eq!(
            (code, out.trim()),
            (0, format!("{name} {}", env!("CARGO_PKG_VERSION")).as_str())
        );
        let (code, _, err) = run(bin, &["--no-such-option"]);
        assert_eq!(code, 2, "{name}: {err}");
        assert!(err.contains("'--no-such-option'"), "{name}: {err}");
        assert!(!err.contains("backtrace"), "{name}: {err}");
    }
    // A value that is not a number names its argument.
    for (name, arg) in [
        ("fault-bench", "--pages"),
        ("mgs", "--vectors"),
        ("pfs-bench", "--size-mb"),
        ("link-bench", "--sizes"),
    ] {
        let bin = BINS.iter().find(|b| b.0 == name).map(|b| b.1).expect("a bench binary");
        let (code, _, err) = run(bin, &[arg, "abc"]);
        assert_eq!(code, 2, "{name} {arg} abc: {err}");
        assert!(
            err.contains(&format!("for '{arg}")) && err.contains("invalid digit"),
            "{name}: {err}"
        );
    }
    // Bounds are checked before anything runs.
    let (code, _, err) = run(BINS[0].1, &["--vectors", "0"]);
    assert!(code == 2 && err.contains("must be at least 1"), "{err}");
    let (code, _, err) = run(BINS[0].1, &["--vectors", "64", "--dim", "32"]);
    assert!(code != 0 && err.contains("--vectors must be at most --dim"), "{err}");
}
