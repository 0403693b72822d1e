//! PSLS under a real Slurm (Debian's `slurm-wlm` and `munge`, started on this machine by
//! `scripts/slurm-local.sh`): a job that needs longer than its allocation's time limit runs as
//! a chain of Slurm jobs submitted by `deploy/slurm/submit-chain.sh`, each running the
//! example `deploy/slurm/psls-job.sbatch`.
//! The first link halts the job before its limit (`--halt-before`), the second is halted by
//! SIGUSR1 (as `sbatch --signal=B:USR1@T` sends it), a later one finishes it with an unfailed
//! run's result, and the links after that exit 0 at once.
//! The ranks run only on the PSLS nodes of the allocation's host (`host` in cluster.toml).

use psls_tests::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A Slurm of this machine, stopped when dropped.
struct Slurm {
    dir: tempfile::TempDir,
    conf: String,
}

impl Slurm {
    /// Starts it; `None` (with one line saying why) where this machine cannot run Slurm.
    fn start() -> Option<Slurm> {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = Command::new("bash")
            .arg(repo().join("scripts/slurm-local.sh"))
            .arg("start")
            .arg(dir.path())
            .output()
            .expect("run slurm-local.sh");
        let err = String::from_utf8_lossy(&o.stderr);
        if o.status.code() == Some(3) {
            let why = err.lines().find(|l| l.contains("cannot start Slurm")).unwrap_or("");
            println!("skipped: Slurm cannot run on this machine: {why}");
            return None;
        }
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "slurm-local.sh start failed:\n{out}\n{err}");
        let conf = out
            .lines()
            .find_map(|l| l.strip_prefix("export SLURM_CONF="))
            .expect("slurm-local.sh names SLURM_CONF")
            .trim_matches(|c| c == '\'' || c == '"')
            .to_string();
        Some(Slurm { dir, conf })
    }

    fn cmd(&self, prog: &str) -> Command {
        let mut c = Command::new(prog);
        let path = format!(
            "{}:/usr/sbin:{}",
            bin_dir().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        c.env("SLURM_CONF", &self.conf).env("PATH", path);
        c
    }

    fn ok(&self, prog: &str, args: &[&str]) -> String {
        let o = self.cmd(prog).args(args).output().expect("run a Slurm command");
        assert!(
            o.status.success(),
            "{prog} {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// `scontrol show job ID` as key → value (`None`: Slurm forgot it, or does not know it).
    fn job(&self, id: &str) -> Option<BTreeMap<String, String>> {
        let o = self.cmd("scontrol").args(["show", "job", "-o", id]).output().ok()?;
        if !o.status.success() {
            return None;
        }
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        Some(
            text.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(repo().join("scripts/slurm-local.sh"))
            .arg("stop")
            .arg(self.dir.path())
            .output();
    }
}

/// Slurm's `RunTime` (`[D-]HH:MM:SS`) in seconds.
fn run_time_s(t: &str) -> u64 {
    psls_client::slurm::parse_time_left(t).unwrap_or_else(|| panic!("RunTime {t:?}"))
}

#[test]
fn a_job_longer_than_its_allocation_is_halted_before_the_limit_and_finished_by_a_dependent_job() {
    let Some(slurm) = Slurm::start() else { return };
    let host = slurm.ok("sinfo", &["-h", "-o", "%N"]);
    assert!(
        !host.is_empty() && !host.contains(['[', ',']),
        "one Slurm node: {host:?}"
    );
    // n0..n2 are on the allocation's host; n3 is on a host outside it.
    let c = Cluster::init(4, 0, |cfg| {
        for (i, n) in cfg.nodes.iter_mut().enumerate() {
            n.host = Some(if i < 3 { host.clone() } else { "elsewhere".into() });
        }
    });
    c.ok(&["cluster", "up"]);
    c.ok(&["create", "st", "--size", "16K"]);
    let out_dir = c.tmp.path().join("slurm-out");
    std::fs::create_dir_all(&out_dir).expect("output folder");
    // 650 steps of 100 ms: longer than the 1-minute limit, whatever the checkpoints cost.
    const STEPS: u64 = 650;
    let output = format!("--output={}/link-%j.out", out_dir.display());
    let steps = STEPS.to_string();
    let submitted = slurm
        .cmd("bash")
        .arg(repo().join("deploy/slurm/submit-chain.sh"))
        .args(["tjob", "4", "--time=1", "--ntasks=4", "--overcommit", &output, "--"])
        .args([PROBE, "steps", "st", "4", &steps, "99", "64", "100"])
        .env("PSLS_HOME", &c.dir)
        .env("PSLS_HALT_BEFORE", "25s")
        .current_dir(c.tmp.path())
        .output()
        .expect("submit-chain.sh");
    assert!(
        submitted.status.success(),
        "{}",
        String::from_utf8_lossy(&submitted.stderr)
    );
    let ids: Vec<String> = String::from_utf8_lossy(&submitted.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(ids.len(), 4, "{ids:?}");
    let out_of = |id: &str| std::fs::read_to_string(out_dir.join(format!("link-{id}.out"))).unwrap_or_default();

    // Each link's end as Slurm recorded it: (state, exit code, run time in seconds).
    let mut ends: BTreeMap<String, (String, String, u64)> = BTreeMap::new();
    let mut signalled = false;
    let deadline = Instant::now() + Duration::from_secs(600);
    while ends.len() < ids.len() {
        assert!(
            Instant::now() < deadline,
            "the chain did not end in 10 minutes: {ends:?}\n{}",
            ids.iter().map(|i| out_of(i)).collect::<Vec<_>>().join("\n----\n")
        );
        for id in &ids {
            if ends.contains_key(id) {
                continue;
            }
            let Some(j) = slurm.job(id) else { continue };
            let state = j.get("JobState").cloned().unwrap_or_default();
            // The second link: halted by SIGUSR1 once its ranks run (`scancel -b` signals the
            // batch shell, as `sbatch --signal=B:USR1@T` does).
            if id == &ids[1] && state == "RUNNING" && !signalled && out_of(id).matches("[0] step").count() >= 5 {
                slurm.ok("scancel", &["-b", "-s", "USR1", id]);
                signalled = true;
            }
            if !["PENDING", "RUNNING", "CONFIGURING", "COMPLETING"].contains(&state.as_str()) {
                let exit = j.get("ExitCode").cloned().unwrap_or_default();
                let run = run_time_s(j.get("RunTime").map_or("", String::as_str));
                ends.insert(id.clone(), (state, exit, run));
            }
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    let all_out = ids
        .iter()
        .map(|i| format!("{i}:\n{}", out_of(i)))
        .collect::<Vec<_>>()
        .join("\n----\n");
    // The first link: halted by --halt-before, well before its limit, with a checkpoint.
    let (state, exit, run) = &ends[&ids[0]];
    assert_eq!((state.as_str(), exit.as_str()), ("FAILED", "75:0"), "{all_out}");
    assert!(*run < 60, "the first link halted before its limit: {run} s\n{all_out}");
    let first = out_of(&ids[0]);
    assert!(
        first.contains("the allocation ends soon: halting job tjob"),
        "{all_out}"
    );
    assert!(first.contains("job tjob halted after checkpoint"), "{all_out}");
    // The second: resumed, then halted by SIGUSR1.
    let (state, exit, _) = &ends[&ids[1]];
    assert_eq!((state.as_str(), exit.as_str()), ("FAILED", "75:0"), "{all_out}");
    let second = out_of(&ids[1]);
    assert!(second.contains("restarted from epoch"), "{all_out}");
    assert!(second.contains("SIGUSR1: halting job tjob"), "{all_out}");
    // A later link finished the job (one more halt is allowed on a slow day); the links after
    // it exited 0 at once.
    let done = ids
        .iter()
        .position(|i| out_of(i).contains("[0] done"))
        .unwrap_or_else(|| panic!("no link finished the job\n{all_out}"));
    assert!(done >= 2, "{all_out}");
    for (k, id) in ids.iter().enumerate() {
        let (state, exit, _) = &ends[id];
        match k {
            k if k < done => assert_eq!(exit, "75:0", "link {k} halted\n{all_out}"),
            k if k == done => assert_eq!((state.as_str(), exit.as_str()), ("COMPLETED", "0:0"), "{all_out}"),
            _ => {
                assert_eq!((state.as_str(), exit.as_str()), ("COMPLETED", "0:0"), "{all_out}");
                assert!(out_of(id).contains("job tjob finished already"), "{all_out}");
            }
        }
    }
    // An unfailed run's result: every step added once to each rank's word.
    let sum = STEPS * (STEPS + 1) / 2;
    assert!(out_of(&ids[done]).contains(&format!("[0] done {sum}")), "{all_out}");
    let data = c.export("st", &[]);
    let words: Vec<u64> = (0..4)
        .map(|p| u64::from_le_bytes(data[p * 4096..p * 4096 + 8].try_into().expect("8 bytes")))
        .collect();
    assert_eq!(words, vec![sum; 4], "{all_out}");
    // Only the allocation's nodes ran ranks.
    assert!(c.log("n0").contains("starting ranks"), "n0 ran ranks");
    assert!(
        !c.log("n3").contains("starting ranks"),
        "n3 is outside the allocation: {}",
        c.log("n3")
    );
}
