//! The nemesis (`psls_tests::nemesis`) for a few minutes of the suite: random jobs while nodes
//! are killed, paused (within and past the failure timeout), cut off (both ways and one way),
//! given blank disks and full disks; every job must end with the unfailed run's result and
//! every acknowledged create must stay. `PSLS_NEMESIS_SECS` sets how long
//! (default 180), `PSLS_NEMESIS_SEED` the seed (default: from the clock, printed); a longer
//! run: `cargo run -p psls-tests --bin nemesis -- --secs 3600`.

#[test]
fn the_nemesis_finds_no_wrong_result_no_lost_job_and_no_lost_operation() {
    let secs: u64 = std::env::var("PSLS_NEMESIS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(180);
    let seed: u64 = std::env::var("PSLS_NEMESIS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    // Every fault the nemesis binary strikes with, anywhere in a job; partitions and full
    // disks need root (network namespaces, a filesystem per page store) and iproute2.
    let root = nix::unistd::geteuid().is_root();
    let ip = std::process::Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    let options = if root && ip {
        psls_tests::nemesis::Options::default()
    } else {
        psls_tests::cannot_run("the nemesis's partitions and full disks need root and iproute2");
        psls_tests::nemesis::Options {
            no_partitions: true,
            no_full_disks: true,
            ..Default::default()
        }
    };
    let report = psls_tests::nemesis::run_with(seed, std::time::Duration::from_secs(secs), options, &mut |l| {
        eprintln!("{l}")
    });
    eprintln!("{}", report.json());
    assert!(
        report.ok(),
        "nemesis seed {seed} (PSLS_NEMESIS_SEED={seed} to replay): {}",
        report.json()
    );
    assert!(report.jobs.values().sum::<u64>() > 0, "no job ran");
    assert!(report.acked_ops > 0, "no create was acknowledged");
}
