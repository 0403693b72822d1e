//! `nemesis [--secs N] [--seed S]`: runs the nemesis (`psls_tests::nemesis`) on a 4-node
//! cluster of this machine for N seconds (default 3600), prints each job and fault as it
//! goes, then one JSON line with the counts; exits 1 if it found a wrong result, a lost job or
//! a lost operation. Build the workspace's binaries first (`cargo build --workspace --bins`).

fn main() -> std::process::ExitCode {
    let mut secs = 3600u64;
    let mut seed: Option<u64> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().and_then(|v| v.parse::<u64>().ok());
        match (a.as_str(), v) {
            ("--secs", Some(v)) => secs = v,
            ("--seed", Some(v)) => seed = Some(v),
            _ => {
                eprintln!("usage: nemesis [--secs N] [--seed S]");
                return std::process::ExitCode::from(2);
            }
        }
    }
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let report = psls_tests::nemesis::run(seed, std::time::Duration::from_secs(secs), &mut |l| eprintln!("{l}"));
    println!("{}", report.json());
    if report.ok() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
