//! A seeded nemesis (Jepsen's word): random jobs on a real 4-node cluster while faults hit it,
//! each job's result checked against an unfailed run's, and every acknowledged metadata
//! operation checked to be kept.
//!
//! Jobs: MGS 1024² on a reused file and on a new one, the probe's checkpointing steps (sums in
//! a parallel file and a volatile segment), and the C example counting under a lock (when a C
//! compiler and the library are there). Faults, during a job or between two: kill -9 of a node
//! (the CLI's node included) and a restart, a pause (SIGSTOP) shorter or longer than the
//! failure timeout, a node restarted with a blank data folder (a replaced disk), a partition
//! of a node (both ways or only what it sends; its daemon runs in a network namespace of its
//! own) and a full disk (each node's page store is a small filesystem, filled for a while).
//! Beside them, a thread creates small files through random nodes and remembers those
//! acknowledged.
//!
//! A job that ends resumable (exit 75: its nodes failed more often than it may restart) is
//! resumed until it ends; one that fails otherwise is a lost job, one with another result a
//! wrong one. The seed fixes the schedule (which job, which fault, which node, when); the
//! cluster's own timing is not reproduced, so a replay re-runs the same schedule.

use crate::*;
use psls_svm::rng::SplitMix64;
use std::collections::BTreeMap;
use std::io::Read;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const NODES: [&str; 4] = ["n0", "n1", "n2", "n3"];
/// A job (with its resumes) that takes longer than this is lost.
const JOB_LIMIT: Duration = Duration::from_secs(300);
/// The probe job: steps, and the sum of 1..=STEPS each rank ends with.
const PROBE_STEPS: u64 = 30;
/// The C example's iterations per rank.
const COUNTER_ITERATIONS: u64 = 400;

/// What a run found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub seed: u64,
    pub elapsed_s: u64,
    /// Jobs run, by kind, and how many needed a resume.
    pub jobs: BTreeMap<&'static str, u64>,
    pub resumed: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<&'static str, u64>,
    /// Jobs whose result differs from the unfailed run's.
    pub wrong: Vec<String>,
    /// Jobs that failed, or did not end.
    pub lost: Vec<String>,
    /// Jobs refused with a clear error because a disk their file needed was full (a fault of
    /// this run): what a user is right to get.
    pub refused_full: u64,
    /// Metadata operations acknowledged, and those not found afterwards.
    pub acked_ops: u64,
    pub lost_ops: Vec<String>,
    /// Where the cluster's folder (logs, disks) was kept, when something was found.
    pub kept: Option<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.wrong.is_empty() && self.lost.is_empty() && self.lost_ops.is_empty()
    }

    /// One JSON object.
    pub fn json(&self) -> String {
        serde_json::json!({
            "seed": self.seed,
            "elapsed_s": self.elapsed_s,
            "jobs": self.jobs,
            "resumed": self.resumed,
            "faults": self.faults,
            "wrong": self.wrong,
            "lost": self.lost,
            "refused_full": self.refused_full,
            "acked_ops": self.acked_ops,
            "lost_ops": self.lost_ops,
            "kept": self.kept,
        })
        .to_string()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    MgsReused,
    MgsNew,
    Probe,
    Counter,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::MgsReused => "mgs_reused_file",
            Kind::MgsNew => "mgs_new_file",
            Kind::Probe => "probe_steps",
            Kind::Counter => "c_counter",
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    /// kill -9, then up again after a pause.
    Kill { node: usize, down_ms: u64 },
    /// SIGSTOP for a while, then SIGCONT.
    Pause { node: usize, ms: u64 },
    /// kill -9, the data folder emptied (a replaced disk), up again.
    Wipe { node: usize },
    /// The node's link cut for a while: both ways, or only what it sends.
    Partition { node: usize, ms: u64, both: bool },
    /// The node's page store filled (but for 16 KiB) for a while.
    FullDisk { node: usize, ms: u64 },
}

impl Fault {
    fn name(self, timeout_ms: u64) -> &'static str {
        match self {
            Fault::Kill { .. } => "kill_9",
            Fault::Pause { ms, .. } if ms > timeout_ms => "pause_past_timeout",
            Fault::Pause { .. } => "pause_within_timeout",
            Fault::Wipe { .. } => "blank_disk",
            Fault::Partition { both: true, .. } => "partition_both_ways",
            Fault::Partition { both: false, .. } => "partition_outgoing",
            Fault::FullDisk { .. } => "full_disk",
        }
    }
}

/// What the nemesis may do.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// No fault in a job's first this many ms (0: anywhere in its first 2 s).
    pub spare_start_ms: u64,
    /// No pauses: kills where pauses would be.
    pub no_pauses: bool,
    /// No blank disks: kills where they would be.
    pub no_wipes: bool,
    /// No partitions (they need root and iproute2): kills where they would be.
    pub no_partitions: bool,
    /// No full disks (they need root to mount a filesystem): kills where they would be.
    pub no_full_disks: bool,
}

/// The outside fault makers a run needs: a network of namespaces, a filesystem per page store.
struct Rig {
    net: Option<crate::faults::Net>,
    disks: Vec<crate::faults::Mount>,
}

/// How long a connection of the nemesis's cluster stays open without a message.
const NEMESIS_IDLE_MS: u64 = 300;

/// Runs the nemesis with `seed` for about `duration`; `say` gets one line per event.
pub fn run(seed: u64, duration: Duration, say: &mut dyn FnMut(&str)) -> Report {
    run_with(seed, duration, Options::default(), say)
}

/// [`run`] with `options`.
pub fn run_with(seed: u64, duration: Duration, options: Options, say: &mut dyn FnMut(&str)) -> Report {
    let t0 = Instant::now();
    let mut rng = SplitMix64::new(seed);
    let mut report = Report {
        seed,
        ..Report::default()
    };
    // The rig is made before the cluster and dropped after it (its daemons stopped first).
    let mut rig = Rig {
        net: None,
        disks: Vec::new(),
    };
    // Connections close after 300 ms without a message (30 s by default), and each node
    // heartbeats only its two ring neighbours (as in a large cluster), so that the pairs that
    // do not heartbeat each other close and dial their connections all the time, under every
    // fault, rather than almost never.
    let mut c = Cluster::init(4, 0, |cfg| {
        cfg.cluster.connection_idle_ms = NEMESIS_IDLE_MS;
        cfg.cluster.heartbeat_min_peers = 2;
    });
    if !options.no_partitions {
        let net = crate::faults::Net::build(4)
            .expect("network namespaces for partitions (root and iproute2; or Options::no_partitions)");
        net.place(&mut c);
        rig.net = Some(net);
    }
    if !options.no_full_disks {
        let cfg = c.config();
        for node in NODES {
            let pages = cfg.data_dir(cfg.entry(node).expect("node")).join("pages");
            let m = crate::faults::Mount::tmpfs(&pages, "768m")
                .expect("a filesystem per page store for full disks (root; or Options::no_full_disks)");
            rig.disks.push(m);
        }
    }
    c.ok(&["cluster", "up"]);
    let timeout_ms = c.config().cluster.heartbeat_timeout_ms;
    let counter = build_counter(&c);
    say(&format!(
        "nemesis seed {seed} (PSLS_NEMESIS_SEED={seed} replays the schedule){}",
        if counter.is_none() {
            "; no C compiler or library: the C job is left out"
        } else {
            ""
        }
    ));
    // The unfailed results.
    let (mgs_want, _) = finish(start_mgs_job(&c, "n0", &[]), "the unfailed MGS run");
    let mgs_file = c.export(MGS_ARGS[1], &[]);
    say(&format!("unfailed MGS checksum {mgs_want}"));

    // Creates through random nodes, beside everything; the acknowledged ones must stay.
    let stop = Arc::new(AtomicBool::new(false));
    let acked: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    let creator = {
        let (stop, acked) = (stop.clone(), acked.clone());
        let dir = c.dir.clone();
        let mut r = SplitMix64::new(seed ^ 0x006e_656d_6573_6973);
        std::thread::spawn(move || {
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let node = NODES[r.below(4) as usize];
                let name = format!("nem-{seed}-{k}");
                k += 1;
                let o = std::process::Command::new(psls_bin())
                    .arg("--dir")
                    .arg(&dir)
                    .args(["--node", node, "create", &name, "--size", "4K"])
                    .env_remove("PSLS_SOCKET")
                    .output();
                if o.is_ok_and(|o| o.status.success()) {
                    if let Ok(mut a) = acked.lock() {
                        a.push(name);
                    }
                }
                std::thread::sleep(Duration::from_millis(150));
            }
        })
    };

    let mut n = 0u64;
    while t0.elapsed() < duration {
        n += 1;
        let kind = match rng.below(if counter.is_some() { 4 } else { 3 }) {
            0 => Kind::MgsReused,
            1 => Kind::MgsNew,
            2 => Kind::Probe,
            _ => Kind::Counter,
        };
        let launcher = NODES[rng.below(4) as usize];
        let faults: Vec<(u64, Fault)> = (0..rng.below(3))
            .map(|_| {
                (
                    options.spare_start_ms + rng.below(2000),
                    pick_fault(&mut rng, timeout_ms, options),
                )
            })
            .collect();
        let between = (rng.below(3) == 0).then(|| pick_fault(&mut rng, timeout_ms, options));
        *report.jobs.entry(kind.name()).or_default() += 1;
        let what = format!("job {n} ({}, through {launcher}, faults {faults:?})", kind.name());
        say(&format!("{:>6.1} s: {what}", t0.elapsed().as_secs_f64()));
        let child = start(&c, kind, launcher, n, counter.as_deref());
        let (id, rest) = job_id_of(child);
        let Some((mut child, rest)) = rest else {
            report.lost.push(format!("{what}: did not start: {id}"));
            continue;
        };
        // The job's stderr, read as it comes (the faults take their time).
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let mut rest = rest;
            let _ = rest.read_to_string(&mut s);
            s
        });
        let started = Instant::now();
        let mut full = Vec::new();
        for (at_ms, f) in &faults {
            let wait = Duration::from_millis(*at_ms).saturating_sub(started.elapsed());
            std::thread::sleep(wait);
            if child.try_wait().ok().flatten().is_some() {
                break;
            }
            *report.faults.entry(f.name(timeout_ms)).or_default() += 1;
            say(&format!("  {f:?}"));
            inject(&c, &rig, *f, &mut report);
            if let Fault::FullDisk { node, .. } = f {
                full.push(*node);
            }
        }
        let out = wait_job(&mut child, JOB_LIMIT);
        let err = err_reader.join().unwrap_or_default();
        // Every daemon up again before the verdict on the job (a resume needs them).
        bring_up(&c);
        let (code, out, err) = match out {
            Some(code) => (code, stdout_of(&mut child), err),
            None => {
                let _ = child.kill();
                say(&format!(
                    "  LOST: did not end within {JOB_LIMIT:?}\n{}",
                    indent(&tail(&err))
                ));
                report
                    .lost
                    .push(format!("{what}: did not end within {JOB_LIMIT:?}\n{}", tail(&err)));
                continue;
            }
        };
        let (mut code, mut out, mut err) = (code, out, err);
        let mut resumes = 0;
        while code == Some(75) && resumes < 5 {
            resumes += 1;
            report.resumed += 1;
            say(&format!("  resumable: psls run --resume {id}"));
            let o = c.run(&["run", "--resume", &id]);
            code = o.status.code();
            out.push_str(&String::from_utf8_lossy(&o.stdout));
            err.push_str(&String::from_utf8_lossy(&o.stderr));
        }
        // A file that could not get room on a disk filled during the job: a clear refusal.
        let refused = full
            .iter()
            .any(|n| err.contains(&format!("on node {n} (n{n}), which has")));
        // A clear refusal is an exit with a status (a kill by a signal is not one).
        if code.is_some_and(|c| c != 0) && refused {
            report.refused_full += 1;
            say("  refused: a disk its file needed was full");
            let _ = c.run(&["jobs", "rm", &id]);
        } else if code != Some(0) {
            report
                .lost
                .push(format!("{what} {id}: exit {code:?}\n{}\n{}", tail(&out), tail(&err)));
            say(&format!("  LOST: exit {code:?}\n{}", indent(&tail(&err))));
            // As an operator would: the failed job is dropped, so that it does not keep its
            // files from the next jobs (each later failure would be this one again).
            let _ = c.run(&["jobs", "rm", &id]);
        } else if let Err(why) = check(kind, &out, &mgs_want).and_then(|()| check_file(&c, kind, n, &mgs_file)) {
            report
                .wrong
                .push(format!("{what} {id}: {why}\n{}\n{}", tail(&out), tail(&err)));
            say(&format!("  WRONG: {why}\n{}", indent(&tail(&err))));
        }
        // A job's own file goes once checked (the disks are small filesystems; a file a
        // resumable job still holds stays).
        let own = match kind {
            Kind::MgsNew => Some(format!("mgs-nem-{n}")),
            Kind::Probe => Some(format!("nemesis-steps-{n}")),
            Kind::MgsReused | Kind::Counter => None,
        };
        if let Some(name) = own {
            let _ = c.run(&["rm", &name]);
        }
        if let Some(f) = between {
            *report.faults.entry(f.name(timeout_ms)).or_default() += 1;
            say(&format!("  between jobs: {f:?}"));
            inject(&c, &rig, f, &mut report);
            bring_up(&c);
        }
        check_ops(&c, &acked, &mut report);
    }
    stop.store(true, Ordering::Relaxed);
    let _ = creator.join();
    bring_up(&c);
    check_ops(&c, &acked, &mut report);
    report.acked_ops = acked.lock().map_or(0, |a| a.len() as u64);
    report.elapsed_s = t0.elapsed().as_secs();
    if !report.ok() {
        // The logs and disks, to read.
        let _ = c.cmd(&["cluster", "down"]).output();
        let mut c = c;
        let kept = std::mem::replace(&mut c.tmp, tempfile::tempdir().expect("tempdir")).keep();
        report.kept = Some(kept.display().to_string());
    }
    report
}

/// Lines indented under a job's line in the log.
fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    | {l}")).collect::<Vec<_>>().join("\n")
}

/// The last lines of a job's output, for a report (without the frames of a backtrace).
fn tail(s: &str) -> String {
    let frame = |l: &&str| {
        let l = l.split_once("] ").map_or(*l, |(_, r)| r).trim_start();
        l.starts_with("at ")
            || l.split_once(": ")
                .is_some_and(|(n, _)| n.chars().all(|c| c.is_ascii_digit()))
    };
    let lines: Vec<&str> = s.lines().filter(|l| !frame(l)).collect();
    lines[lines.len().saturating_sub(12)..].join("\n")
}

fn pick_fault(rng: &mut SplitMix64, timeout_ms: u64, options: Options) -> Fault {
    let node = rng.below(4) as usize;
    let (kind, down_ms, ms) = (rng.below(14), rng.below(1500), 200 + rng.below(3 * timeout_ms));
    let (both, full_ms) = (rng.below(2) == 0, 1000 + rng.below(4000));
    match kind {
        4..=6 if !options.no_pauses => Fault::Pause { node, ms },
        7 | 8 if !options.no_wipes => Fault::Wipe { node },
        9 | 10 if !options.no_partitions => Fault::Partition { node, ms, both },
        11 | 12 if !options.no_full_disks => Fault::FullDisk { node, ms: full_ms },
        _ => Fault::Kill { node, down_ms },
    }
}

fn signal(pid: i32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

fn inject(c: &Cluster, rig: &Rig, f: Fault, report: &mut Report) {
    match f {
        Fault::Kill { node, down_ms } => {
            if psls_client::cluster::running_pid(&c.dir, NODES[node]).is_some() {
                c.kill(NODES[node]);
            }
            std::thread::sleep(Duration::from_millis(down_ms));
            bring_up(c);
        }
        Fault::Pause { node, ms } => {
            let Some(pid) = psls_client::cluster::running_pid(&c.dir, NODES[node]) else {
                return;
            };
            signal(pid, nix::sys::signal::Signal::SIGSTOP);
            std::thread::sleep(Duration::from_millis(ms));
            signal(pid, nix::sys::signal::Signal::SIGCONT);
        }
        Fault::Wipe { node } => {
            // One lost disk at a time (the fault model: one failed node and its disk): a second
            // one while a node still rebuilds its copies may take both copies of a page. A
            // rebuild that does not end is a finding; the disk is then spared.
            if let Err(why) = wait_rebuilt(c) {
                report.lost.push(format!("a rebuild did not end: {why}"));
                return;
            }
            if psls_client::cluster::running_pid(&c.dir, NODES[node]).is_some() {
                c.kill(NODES[node]);
            }
            let cfg = c.config();
            let dir = cfg.data_dir(cfg.entry(NODES[node]).expect("node"));
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for e in entries.flatten() {
                    let p = e.path();
                    let _ = if p.is_dir() {
                        std::fs::remove_dir_all(&p)
                    } else {
                        std::fs::remove_file(&p)
                    };
                }
            }
            bring_up(c);
        }
        Fault::Partition { node, ms, both } => {
            let Some(net) = &rig.net else { return };
            net.cut(node, both);
            std::thread::sleep(Duration::from_millis(ms));
            net.heal(node, both);
        }
        Fault::FullDisk { node, ms } => {
            let Some(disk) = rig.disks.get(node) else { return };
            disk.fill(16 * 1024);
            std::thread::sleep(Duration::from_millis(ms));
            // A blank disk between fill and free may have taken the filler already.
            let _ = std::fs::remove_file(disk.0.join("filler"));
        }
    }
}

/// How `cluster status --json` names a node that is up.
const STATE_UP: &str = "up";

/// Waits (at most two minutes) until every node is up and none rebuilds its copies; the
/// status otherwise.
fn wait_rebuilt(c: &Cluster) -> Result<(), String> {
    let t = Instant::now();
    let mut last = String::new();
    while t.elapsed() < Duration::from_secs(120) {
        let o = c.run(&["cluster", "status", "--json"]);
        let st: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        // Every node up too: a node down or re-executing may still have a rebuild to do.
        let settled = st["nodes"].as_array().is_some_and(|ns| {
            ns.iter()
                .filter(|n| !n["logical"].is_null())
                .all(|n| n["rebuild"].is_null() && n["state"] == STATE_UP)
        });
        if o.status.success() && settled {
            return Ok(());
        }
        last = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(last)
}

/// `psls cluster up` until it succeeds (a paused node re-executing itself may make one fail).
fn bring_up(c: &Cluster) {
    let t = Instant::now();
    loop {
        let o = c.run(&["cluster", "up"]);
        if o.status.success() {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the cluster did not come up: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Compiles the C example against the built library, if a compiler and pkg-config are there.
fn build_counter(c: &Cluster) -> Option<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if !bin_dir().join("libpsls_client.a").exists() {
        return None;
    }
    let pc = std::process::Command::new("pkg-config")
        .args(["--cflags", "--libs", "psls"])
        .env("PKG_CONFIG_PATH", bin_dir())
        .output()
        .ok()?;
    if !pc.status.success() {
        return None;
    }
    let flags = String::from_utf8_lossy(&pc.stdout).into_owned();
    let exe = c.path("counter");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let o = std::process::Command::new(cc)
        .args(["-O2", "-Wall", "-Werror"])
        .arg(root.join("psls-client/examples/c/counter.c"))
        .arg("-o")
        .arg(&exe)
        .args(flags.split_whitespace())
        .output()
        .ok()?;
    o.status.success().then(|| exe.display().to_string())
}

fn start(c: &Cluster, kind: Kind, launcher: &str, n: u64, counter: Option<&str>) -> Child {
    let probe = bin_dir().join("svm-probe").display().to_string();
    let mgs = mgs_bin();
    let new_file = format!("mgs-nem-{n}");
    let probe_file = format!("nemesis-steps-{n}");
    let steps = PROBE_STEPS.to_string();
    let iterations = COUNTER_ITERATIONS.to_string();
    let mut args: Vec<&str> = vec!["--node", launcher, "run", "-n", "4", "--max-restarts", "10", "--"];
    match kind {
        Kind::MgsReused => {
            args.push(&mgs);
            args.extend(MGS_ARGS);
        }
        Kind::MgsNew => {
            args.push(&mgs);
            // MGS_ARGS but their file: a new one.
            args.extend(["--file", &new_file]);
            args.extend(MGS_ARGS.iter().skip(2));
        }
        Kind::Probe => {
            args.push(&probe);
            // A file of its own: the steps add to what the file holds.
            args.extend(["steps", &probe_file, "4", &steps, "99", "64", "40", "vol"]);
        }
        Kind::Counter => {
            args.push(counter.unwrap_or("false"));
            args.push(&iterations);
        }
    }
    c.cmd(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("psls run")
}

/// The job's id (or why there is none) and the rest of its stderr.
fn job_id_of(mut ch: Child) -> (String, Option<(Child, std::io::BufReader<std::process::ChildStderr>)>) {
    let Some(err) = ch.stderr.take() else {
        return ("no stderr".into(), None);
    };
    let mut err = std::io::BufReader::new(err);
    let mut line = String::new();
    let _ = std::io::BufRead::read_line(&mut err, &mut line);
    match line
        .strip_prefix("psls: job ")
        .and_then(|l| l.strip_suffix(" started\n"))
    {
        Some(id) => (id.to_string(), Some((ch, err))),
        None => {
            let mut rest = String::new();
            let _ = err.read_to_string(&mut rest);
            let _ = ch.wait();
            (format!("{line}{rest}"), None)
        }
    }
}

fn wait_job(ch: &mut Child, limit: Duration) -> Option<Option<i32>> {
    let t = Instant::now();
    loop {
        if let Ok(Some(st)) = ch.try_wait() {
            return Some(st.code());
        }
        if t.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stdout_of(ch: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut o) = ch.stdout.take() {
        let _ = o.read_to_string(&mut s);
    }
    s
}

/// The job's result against an unfailed run's.
fn check(kind: Kind, out: &str, mgs_want: &str) -> Result<(), String> {
    match kind {
        Kind::MgsReused | Kind::MgsNew => {
            // The last result line (a resume prints one of its own).
            let line = out
                .lines()
                .rev()
                .find(|l| l.contains("\"bench\":\"mgs\""))
                .ok_or("no result line")?;
            let j: serde_json::Value =
                serde_json::from_str(line.trim_start_matches("[0] ")).map_err(|e| format!("result line: {e}"))?;
            if j["ok"] != true {
                return Err(format!("the result does not check: {line}"));
            }
            let got = j["checksum"].as_str().unwrap_or_default();
            if got == mgs_want {
                Ok(())
            } else {
                Err(format!("checksum {got}, the unfailed run's {mgs_want}"))
            }
        }
        Kind::Probe => {
            let sum = PROBE_STEPS * (PROBE_STEPS + 1) / 2;
            match (0..4).find(|r| !out.contains(&format!("[{r}] done {sum} {sum}"))) {
                None => Ok(()),
                Some(r) => Err(format!("rank {r} did not end with {sum} {sum}")),
            }
        }
        Kind::Counter => {
            let want = 4 * COUNTER_ITERATIONS;
            let good = out.matches(&format!("counter {want} (expected {want})")).count();
            if good >= 4 {
                Ok(())
            } else {
                Err(format!("{good} of 4 ranks counted {want}"))
            }
        }
    }
}

/// What the job left on the disks (the last persistent checkpoint: its result, durable at its
/// end) against an unfailed run's.
fn check_file(c: &Cluster, kind: Kind, n: u64, mgs_file: &[u8]) -> Result<(), String> {
    let o = |name: &str| -> Result<Vec<u8>, String> {
        let path = c.path(&format!("nemesis-export-{n}"));
        let out = c.run(&["export", name, &path.display().to_string()]);
        if !out.status.success() {
            return Err(format!("export of {name}: {}", String::from_utf8_lossy(&out.stderr)));
        }
        let data = std::fs::read(&path).map_err(|e| e.to_string())?;
        let _ = std::fs::remove_file(&path);
        Ok(data)
    };
    let word = |data: &[u8], at: usize| {
        data.get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    match kind {
        Kind::MgsReused | Kind::MgsNew => {
            let name = if kind == Kind::MgsReused {
                MGS_ARGS[1].to_string()
            } else {
                format!("mgs-nem-{n}")
            };
            let data = o(&name)?;
            if data == mgs_file {
                Ok(())
            } else {
                let at = data.iter().zip(mgs_file).position(|(a, b)| a != b);
                Err(format!(
                    "{name} on the disks differs from the unfailed run's (first at byte {at:?})"
                ))
            }
        }
        Kind::Probe => {
            let data = o(&format!("nemesis-steps-{n}"))?;
            let sum = PROBE_STEPS * (PROBE_STEPS + 1) / 2;
            match (0..4).find(|r| word(&data, r * 4096) != Some(sum)) {
                None => Ok(()),
                Some(r) => Err(format!(
                    "rank {r}'s word on the disks is {:?}, not {sum}",
                    word(&data, r * 4096)
                )),
            }
        }
        Kind::Counter => {
            let data = o("c-counter")?;
            let want = 4 * COUNTER_ITERATIONS;
            if word(&data, 0) == Some(want) {
                Ok(())
            } else {
                Err(format!("the counter on the disks is {:?}, not {want}", word(&data, 0)))
            }
        }
    }
}

/// Every acknowledged create is listed (asked of a node that answers).
fn check_ops(c: &Cluster, acked: &Arc<Mutex<Vec<String>>>, report: &mut Report) {
    let acked: Vec<String> = acked.lock().map(|a| a.clone()).unwrap_or_default();
    for node in NODES {
        let o = c.run(&["--node", node, "ls", "--json"]);
        if !o.status.success() {
            continue;
        }
        let ls: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        let names: std::collections::BTreeSet<&str> = ls["files"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|f| f["name"].as_str())
            .collect();
        for a in &acked {
            if !names.contains(a.as_str()) && !report.lost_ops.contains(a) {
                report.lost_ops.push(a.clone());
            }
        }
        return;
    }
}
