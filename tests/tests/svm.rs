//! Shared virtual memory across real daemons and real client processes (userfaultfd).

use psls_tests::{wait_for, wait_within, Cluster};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");

fn run_ok(c: &Cluster, node: &str, args: &[&str]) -> String {
    c.client_ok(node, PROBE, args)
}

fn spawn(c: &Cluster, node: &str, args: &[&str]) -> Child {
    c.client(node, PROBE)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn probe")
}

/// A counter of `node`'s daemon (`psls_client::Session::node_stats`).
fn counter(c: &Cluster, node: &str, name: &str) -> u64 {
    let cfg = c.config();
    let s = psls_client::Session::connect_to(&cfg.socket_path(cfg.entry(node).unwrap())).unwrap();
    let (_, counters) = s.node_stats().unwrap();
    counters.into_iter().find(|(k, _)| k == name).unwrap().1
}

/// Waits until `node` has at least `n` barrier or lock calls of its ranks waiting.
fn wait_sync_waits(c: &Cluster, node: &str, n: u64) {
    wait_for(Duration::from_secs(20), &format!("{n} sync waits on {node}"), || {
        counter(c, node, "sync_waits") >= n
    });
}

/// Waits until `node`'s daemon serves one more client mapping than `before` mappings logged.
fn wait_mapped(c: &Cluster, node: &str, before: usize) {
    wait_for(
        Duration::from_secs(20),
        &format!("a client never mapped on {node}"),
        || c.log(node).matches("serving faults").count() > before,
    );
}

#[test]
fn pages_move_between_processes_on_different_nodes_and_on_one_node() {
    let c = Cluster::start(4, 0);
    // Producer and consumer on different nodes, then on the same node.
    for (a, b) in [("n1", "n2"), ("n3", "n3")] {
        let name = format!("pc-{a}-{b}");
        let producer = spawn(&c, a, &["produce", &name, "16"]);
        run_ok(&c, b, &["consume", &name, "16"]);
        let o = wait_within(producer, Duration::from_secs(60));
        assert!(o.status.success(), "producer: {}", String::from_utf8_lossy(&o.stderr));
    }
    // Whole-file writes on one node, checks on every other, rewrites, checks again.
    run_ok(&c, "n3", &["fill", "g", "64", "5"]);
    for n in ["n0", "n1", "n2", "n3"] {
        run_ok(&c, n, &["check", "g", "64", "5"]);
    }
    run_ok(&c, "n1", &["fill", "g", "64", "6"]);
    let readers: Vec<Child> = ["n0", "n2", "n2", "n3"]
        .iter()
        .map(|n| spawn(&c, n, &["check", "g", "64", "6"]))
        .collect();
    for r in readers {
        let o = wait_within(r, Duration::from_secs(60));
        assert!(o.status.success(), "reader: {}", String::from_utf8_lossy(&o.stderr));
    }
}

#[test]
fn bad_maps_get_clear_errors() {
    let c = Cluster::start(2, 0);
    let out = c
        .client("n0", PROBE)
        .args(["map", "nope", "4096", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("nope") && text.contains("no file"), "{text}");
    run_ok(&c, "n0", &["map", "small", "8192", "1"]);
    let out = c
        .client("n1", PROBE)
        .args(["map", "small", "16384", "0"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && text.contains("the file has 8192 bytes"),
        "{text}"
    );
    let out = c.client("n1", PROBE).args(["map", "small", "0", "0"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && text.contains("0 bytes"), "{text}");
    // The daemons are still fine.
    run_ok(&c, "n1", &["map", "small", "8192", "0"]);
    // A forked child does not inherit a mapping (its copy would bypass the protocol): touching
    // it is a segmentation fault, and the node's copy of the page stays as it was.
    run_ok(&c, "n0", &["fill", "forked", "2", "5"]);
    let out = run_ok(&c, "n0", &["fork", "forked", "2"]);
    assert!(out.contains("child signal 11"), "{out}");
    run_ok(&c, "n1", &["check", "forked", "2", "5"]);
}

/// A user who may only read a file maps it read-only on another node: a writable map is
/// refused, the read-only one holds the contents and follows later writes from elsewhere, and
/// a store to it kills that process only. Unprivileged users map their own files writable.
#[test]
fn read_only_mappings_follow_writes_and_refuse_stores() {
    use std::io::BufRead;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    let c = Cluster::start(4, 0);
    // Let an unprivileged user reach the sockets.
    for p in [c.tmp.path(), c.dir.as_path()] {
        std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
    // Root's file, mode 644.
    run_ok(&c, "n1", &["fill", "ro", "16", "1"]);
    let cfg = c.config();
    let nobody = |node: &str, args: &[&str]| {
        let mut cmd = std::process::Command::new(PROBE);
        cmd.args(args)
            .env("PSLS_SOCKET", cfg.socket_path(cfg.entry(node).expect("node")))
            .env_remove("PSLS_HOME")
            .env_remove("PSLS_NODE")
            .current_dir("/")
            .uid(65534)
            .gid(65534);
        cmd
    };
    let o = nobody("n0", &["map", "ro", "65536", "0"]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success() && text.contains("permission denied"), "{text}");

    let mut follower = nobody("n0", &["rofollow", "ro", "16", "1", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(follower.stdout.take().unwrap()).lines();
    let first = lines.next().map(|l| l.unwrap()).unwrap_or_default();
    assert_eq!(first, "seen 1", "{}", {
        let _ = follower.kill();
        String::from_utf8_lossy(&follower.wait_with_output().unwrap().stderr).into_owned()
    });
    // Another node overwrites every page: the read-only copies on n0 are invalidated and the
    // follower reads the new contents.
    run_ok(&c, "n2", &["fill", "ro", "16", "2"]);
    let o = wait_within(follower, Duration::from_secs(60));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(lines.next().map(|l| l.unwrap()).as_deref(), Some("seen 2"));

    let o = nobody("n3", &["rostore", "ro", "16"]).output().unwrap();
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGSEGV),
        "{:?}: {}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    // The daemons carry on: the file is intact on every node.
    for n in ["n0", "n3"] {
        run_ok(&c, n, &["check", "ro", "16", "2"]);
    }
    // An unprivileged user maps its own files writable (its userfaultfd is user-mode-only:
    // it may not open /dev/userfaultfd).
    let o = nobody("n1", &["fill", "nobodys", "4", "3"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    run_ok(&c, "n2", &["check", "nobodys", "4", "3"]);
}

/// A spare that takes over a dead node's logical id outranks every incarnation of that node in
/// shared memory (whatever the daemons' own counters). While a process still writes a file
/// whose current pages only memory holds, the restarted managers refuse the pages they now
/// manage (their directory died with the node) with a clear error, never stale data from disk
/// — also to a node that restarted after the replacement and so never knew the dead one. A
/// file first used after the restarts is served at once; and once the writer ends (its end
/// makes its writes durable), its file is served again everywhere, with its latest contents.
#[test]
fn a_spare_taking_over_a_manager_refuses_its_lost_pages_and_never_serves_stale_ones() {
    let c = Cluster::start(4, 1);
    // n0 syncs pattern 9, then writes pattern 1 over every page and keeps the file mapped:
    // its memory holds the only current copies (the disks hold 9). Four runs of 16 pages:
    // each node manages one.
    let marker = c.tmp.path().join("writer-go");
    let marker_arg = marker.display().to_string();
    let mut writer = spawn(&c, "n0", &["fillsync", "sp", "64", "9", "1", "0", &marker_arg]);
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(writer.stdout.take().expect("stdout")));
    assert!(
        lines.by_ref().map_while(Result::ok).any(|l| l == "written"),
        "the writer did not write"
    );
    let probes = [0, 16, 32, 48];
    c.destroy("n3");
    c.wait_state("n3", "down");
    c.ok(&["node", "replace", "3", "--with", "s0"]);
    c.kill("n2");
    c.ok(&["cluster", "up"]);
    // How many of the probe pages a read-only check on `node` finds refused (the lifeline's
    // exit 70, with the reason); any other outcome is a failure.
    let refused_now = |node: &str| -> usize {
        probes
            .iter()
            .filter(|page| {
                let o = c
                    .client(node, PROBE)
                    .args(["rocheck", "sp", "64", "1", &page.to_string()])
                    .output()
                    .unwrap();
                let err = String::from_utf8_lossy(&o.stderr);
                match o.status.code() {
                    Some(0) => false,
                    Some(70) if err.contains("restarted") => true,
                    _ => panic!("{node} page {page}: {:?}: {err}", o.status),
                }
            })
            .count()
    };
    let refused: usize = ["n1", "n2", "s0"].iter().map(|n| refused_now(n)).sum();
    // Pages managed by logical 2 and 3 (a run each) are refused everywhere.
    assert_eq!(refused, 3 * 2, "refused faults");
    // A file first used after the restarts has no directory to lose: the fenced nodes ask the
    // others, and serve its pages at once, everywhere, while "sp" stays refused.
    run_ok(&c, "s0", &["fill", "after", "64", "7"]);
    for n in ["n0", "n1", "n2"] {
        run_ok(&c, n, &["check", "after", "64", "7"]);
    }
    for n in ["n2", "s0"] {
        assert!(
            c.log(n).contains("no node held this file before this restart"),
            "{n} never served a new file"
        );
    }
    assert_eq!(
        refused_now("n1"),
        2,
        "pages of the file written before the restarts refused"
    );
    // The writer ends: its writes become durable, the file has no writer, and every node
    // serves every page of it again, with the writer's contents.
    std::fs::write(&marker, b"").expect("marker");
    assert!(writer.wait().expect("writer").success());
    let mut want = Vec::new();
    for p in 0..64u64 {
        for k in 0..512u64 {
            want.extend_from_slice(&psls_svm::rng::mix64(1 ^ (p << 20) ^ k).to_le_bytes());
        }
    }
    // (The daemon sees the process end, then makes its writes durable.)
    wait_for(
        Duration::from_secs(10),
        "the writer's end made its writes durable",
        || c.export("sp", &[]) == want,
    );
    wait_for(Duration::from_secs(10), "the written file served again", || {
        refused_now("n1") == 0
    });
    for n in ["n0", "n1", "n2", "s0"] {
        run_ok(&c, n, &["rocheck", "sp", "64", "1"]);
    }
    // Once no node holds shared pages any more, the fenced nodes serve theirs again.
    c.ok(&["rm", "sp"]);
    c.ok(&["rm", "after"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let lifted = |n: &str| c.log(n).contains("the pages managed here are served again");
    while !(lifted("n2") && lifted("s0")) {
        assert!(Instant::now() < deadline, "the fences were not lifted");
        std::thread::sleep(Duration::from_millis(50));
    }
    run_ok(&c, "s0", &["fill", "fresh", "8", "5"]);
    for n in ["n1", "n2"] {
        run_ok(&c, n, &["check", "fresh", "8", "5"]);
    }
}

#[test]
fn a_dying_client_does_not_disturb_the_daemon_and_a_dying_daemon_stops_its_clients() {
    let c = Cluster::start(4, 0);
    // A consumer waits (faulting on word 0 again and again); kill -9 it.
    let mapped = c.log("n2").matches("serving faults").count();
    let mut waiting = spawn(&c, "n2", &["consume", "k", "4"]);
    wait_mapped(&c, "n2", mapped);
    waiting.kill().unwrap();
    waiting.wait().unwrap();
    let t = Instant::now();
    while !c.logs_contain("client process exited") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "daemon never noticed the dead client"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Others carry on with the same file.
    let producer = spawn(&c, "n1", &["produce", "k", "4"]);
    run_ok(&c, "n2", &["consume", "k", "4"]);
    assert!(wait_within(producer, Duration::from_secs(60)).status.success());

    // A client whose daemon dies ends with a clear message instead of hanging.
    let mapped = c.log("n3").matches("serving faults").count();
    let waiting = spawn(&c, "n3", &["consume", "k2", "4"]);
    wait_mapped(&c, "n3", mapped);
    c.kill("n3");
    let o = wait_within(waiting, Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(70), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("lost the node daemon"));
}

#[test]
fn locked_counter_across_nodes_counts_exactly_and_sync_errors_are_clear() {
    let c = Cluster::start(4, 0);
    let (ranks, incs) = (4u64, 150u64);
    let workers: Vec<Child> = ["n0", "n1", "n2", "n3"]
        .iter()
        .map(|n| spawn(&c, n, &["count", "ctr", "1", &incs.to_string(), &ranks.to_string()]))
        .collect();
    for w in workers {
        let o = wait_within(w, Duration::from_secs(120));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let first = String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .to_string();
        assert_eq!(
            first,
            (ranks * incs).to_string(),
            "every rank sees N*M after the barrier"
        );
    }
    let out = run_ok(&c, "n2", &["sync-errors", "e", "1"]);
    assert!(out.contains("unlock: lock 99 is not held by this rank"), "{out}");
    assert!(out.contains("relock: lock 5 is already held by this rank"), "{out}");
    // A rank that dies at a barrier fails the others there, with a clear message.
    let waiter = spawn(&c, "n1", &["count", "b", "1", "0", "3"]);
    let mut dying = spawn(&c, "n2", &["count", "b", "1", "0", "3"]);
    wait_sync_waits(&c, "n1", 1);
    wait_sync_waits(&c, "n2", 1);
    dying.kill().unwrap();
    dying.wait().unwrap();
    let o = wait_within(waiter, Duration::from_secs(20));
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("exited while waiting at barrier 'counted'"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // No node keeps a wait of either rank (the dead one's was dropped with it).
    for n in ["n1", "n2"] {
        let s = psls_client::Session::connect_to(&c.config().socket_path(c.config().entry(n).unwrap())).unwrap();
        let waits = || {
            let (_, counters) = s.node_stats().unwrap();
            counters.into_iter().find(|(k, _)| k == "sync_waits").unwrap().1
        };
        let t = std::time::Instant::now();
        while waits() != 0 {
            assert!(t.elapsed() < Duration::from_secs(10), "{n} keeps {} waits", waits());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn psls_run_spreads_ranks_prefixes_output_and_stops_on_the_first_failure() {
    let c = Cluster::start(4, 0);
    let out = c.ok(&[
        "run",
        "-n",
        "6",
        "--",
        "sh",
        "-c",
        "echo rank $PSLS_RANK of $PSLS_SIZE on $PSLS_NODE",
    ]);
    for r in 0..6 {
        let node = format!("n{}", r % 4);
        assert!(out.contains(&format!("[{r}] rank {r} of 6 on {node}")), "{out}");
    }
    let out = c.ok(&["run", "-n", "4", "--per-node", "2", "--", "sh", "-c", "echo $PSLS_NODE"]);
    for (r, n) in [(0, "n0"), (1, "n0"), (2, "n1"), (3, "n1")] {
        assert!(out.contains(&format!("[{r}] {n}")), "{out}");
    }
    // Rank 1 fails: the job ends with its status, and the sleeping ranks are stopped.
    let t = Instant::now();
    let o = c.run(&[
        "run",
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        "if [ $PSLS_RANK = 1 ]; then exit 3; fi; sleep 60",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&o.stderr).contains("rank 1 exited with status 3"));
    assert!(t.elapsed() < Duration::from_secs(20), "other ranks were not stopped");
    // The locked counter as a job.
    let out = c.ok(&["run", "-n", "4", "--", PROBE, "count", "jobctr", "1", "100", "4"]);
    for r in 0..4 {
        assert!(out.contains(&format!("[{r}] 400")), "{out}");
    }
    // A program that does not exist.
    let err = c.fails(&["run", "-n", "2", "--", "/nonexistent/prog"]);
    assert!(err.contains("cannot start '/nonexistent/prog'"), "{err}");
}

#[test]
fn mgs_gives_the_same_bits_on_one_two_and_four_nodes() {
    let c = Cluster::start(4, 0);
    let mgs = psls_tests::bin_dir().join("mgs");
    let mgs = mgs.to_str().expect("path");
    let mut sums = Vec::new();
    for ranks in ["1", "2", "4"] {
        let file = format!("mgs-{ranks}");
        let out = c.ok(&[
            "run",
            "-n",
            ranks,
            "--",
            mgs,
            "--vectors",
            "96",
            "--dim",
            "160",
            "--file",
            &file,
        ]);
        let line = out
            .lines()
            .find(|l| l.contains("\"bench\":\"mgs\""))
            .unwrap_or_else(|| panic!("{out}"));
        let j: serde_json::Value = serde_json::from_str(line.trim_start_matches("[0] ")).expect("json");
        assert_eq!(j["ok"], true, "{line}");
        assert!(j["max_err"].as_f64().unwrap() < 1e-9, "{line}");
        assert_eq!(j["checksum"], j["baseline_checksum"], "{line}");
        if ranks != "1" {
            assert!(
                j["bytes_moved"].as_u64().unwrap() > 0,
                "ranks on several nodes move pages: {line}"
            );
        }
        sums.push(j["checksum"].as_str().unwrap().to_string());
    }
    assert!(sums.iter().all(|s| *s == sums[0]), "{sums:?}");
}

#[test]
fn the_c_example_counts_exactly_through_the_c_abi() {
    let c = Cluster::start(4, 0);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let lib = psls_tests::bin_dir().join("libpsls_client.a");
    assert!(lib.exists(), "{} missing: cargo build --workspace --lib", lib.display());
    // The flags come from the psls.pc the build wrote beside the library, as the README says.
    let pc = std::process::Command::new("pkg-config")
        .args(["--cflags", "--libs", "psls"])
        .env("PKG_CONFIG_PATH", psls_tests::bin_dir())
        .output()
        .expect("run pkg-config");
    assert!(
        pc.status.success(),
        "pkg-config: {}",
        String::from_utf8_lossy(&pc.stderr)
    );
    let flags = String::from_utf8_lossy(&pc.stdout).into_owned();
    assert!(
        flags.contains("-lpsls_client") && flags.contains("-Wl,-rpath,"),
        "{flags}"
    );
    let exe = c.path("counter");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let o = std::process::Command::new(cc)
        .args(["-O2", "-Wall", "-Werror"])
        .arg(root.join("psls-client/examples/c/counter.c"))
        // The shared library, found at run time through the rpath psls.pc gives (the ranks
        // start with a clean environment).
        .args(flags.split_whitespace())
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run the C compiler");
    assert!(o.status.success(), "cc: {}", String::from_utf8_lossy(&o.stderr));
    let out = c.ok(&["run", "-n", "4", "--", exe.to_str().unwrap(), "120"]);
    // Safe-point calls at iterations 0, 40 and 80, each a checkpoint (interval 0).
    for (epoch, i) in [(1, 0), (2, 40), (3, 80)] {
        assert!(
            out.contains(&format!("[0] checkpoint {epoch} at iteration {i}")),
            "{out}"
        );
    }
    for r in 0..4 {
        assert!(
            out.contains(&format!("[{r}] rank {r} of 4: counter 480 (expected 480)")),
            "{out}"
        );
    }
}

#[test]
fn litmus_tests_across_nodes_never_show_a_forbidden_outcome() {
    let c = Cluster::start(4, 0);
    let iters = 1500;
    for test in ["sb", "mp", "iriw", "lb"] {
        let out = c.ok(&["run", "-n", "4", "--", PROBE, "litmus", test, &iters.to_string()]);
        let line = out
            .lines()
            .find(|l| l.contains(&format!("litmus {test}:")))
            .unwrap_or_else(|| panic!("{out}"));
        assert!(
            line.contains(&format!("{iters} iterations, 0 forbidden")),
            "forbidden outcome in {test}: {line}"
        );
        // The races really happened: more than one outcome was observed.
        let outcomes = line.split("outcomes {").nth(1).unwrap_or("");
        assert!(outcomes.matches(':').count() >= 2, "{test} never raced: {line}");
    }
}

#[test]
fn a_page_bounced_between_nodes_and_falsely_shared_loses_no_write() {
    let c = Cluster::start(4, 0);
    let out = c.ok(&["run", "-n", "2", "--", PROBE, "pingpong", "pp", "1", "1000"]);
    assert!(out.contains("[0] did 500 of 1000 final 1000"), "{out}");
    assert!(out.contains("[1] did 500 of 1000 final 1000"), "{out}");
    let out = c.ok(&["run", "-n", "4", "--", PROBE, "falseshare", "fs", "1", "200000"]);
    for r in 0..4 {
        assert!(
            out.contains(&format!("[{r}] words [200000, 200000, 200000, 200000]")),
            "{out}"
        );
    }
}

/// A volatile segment is shared by the ranks of a job on different nodes, starts at zero in
/// every job, and is dropped on every node that held it when its job ends.
#[test]
fn volatile_segments_are_shared_within_a_job_and_dropped_after_it() {
    let c = Cluster::start(4, 0);
    for seed in [1u64, 2] {
        let out = c.ok(&["run", "-n", "4", "--", PROBE, "vol", "v", "8", &seed.to_string()]);
        assert_eq!(out.matches("volatile ok").count(), 4, "{out}");
        // Each of the 4 nodes that ran a rank drops the job's segment (asynchronously after
        // the job returns).
        let want = 4 * seed as usize;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let dropped: usize = ["n0", "n1", "n2", "n3"]
                .iter()
                .map(|n| c.log(n).matches("volatile segment dropped at job end").count())
                .sum();
            if dropped == want {
                break;
            }
            assert!(dropped < want, "{dropped} drops, want {want}");
            assert!(
                std::time::Instant::now() < deadline,
                "{dropped} of {want} segments dropped"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A process that outlives its job (here: started by a rank in a session of its own) loses the
/// job's volatile segment: the first access after the job ended stops it with a clear message
/// instead of reading a stale, incoherent copy.
#[test]
fn a_process_outliving_its_job_loses_the_jobs_volatile_segment() {
    let c = Cluster::start(2, 0);
    let (out, err, marker) = (c.path("linger.out"), c.path("linger.err"), c.path("marker"));
    let script = format!(
        "setsid {PROBE} linger seg 4 {} >{} 2>{} & \
         for i in $(seq 400); do grep -q mapped {} && exit 0; sleep 0.05; done; exit 9",
        marker.display(),
        out.display(),
        err.display(),
        out.display()
    );
    c.ok(&["run", "-n", "1", "--", "sh", "-c", &script]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c.logs_contain("volatile segment dropped at job end") {
        assert!(Instant::now() < deadline, "the job's segment was never dropped");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::write(&marker, b"go").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let e = std::fs::read_to_string(&err).unwrap_or_default();
        if e.contains("is gone") {
            break;
        }
        let o = std::fs::read_to_string(&out).unwrap_or_default();
        assert!(!o.contains("survived"), "read the ended job's segment: {o}{e}");
        assert!(Instant::now() < deadline, "the lingering process was not ended: {o}{e}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!std::fs::read_to_string(&out).unwrap().contains("survived"));
    // The daemons serve new jobs as before.
    let out = c.ok(&["run", "-n", "2", "--", PROBE, "vol", "v", "4", "3"]);
    assert_eq!(out.matches("volatile ok").count(), 2, "{out}");
}

/// Removing a parallel file drops its pages from the nodes' memory once nobody maps it; while
/// a process still maps it, its pages stay (as an unlinked file stays with its openers).
#[test]
fn removing_a_file_frees_its_memory_once_nobody_maps_it() {
    let c = Cluster::start(2, 0);
    let drops = |c: &Cluster| {
        ["n0", "n1"]
            .iter()
            .map(|n| c.log(n).matches("segment of a removed file dropped").count())
            .sum::<usize>()
    };
    let wait_for = |what: &dyn Fn() -> bool, why: &str| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !what() {
            assert!(Instant::now() < deadline, "{why}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    run_ok(&c, "n0", &["fill", "gone", "8", "1"]);
    c.ok(&["rm", "gone"]);
    wait_for(&|| drops(&c) == 1, "the removed file's segment on n0 was not dropped");
    // The name is free: a new file of that name is a new file.
    run_ok(&c, "n1", &["fill", "gone", "8", "2"]);
    run_ok(&c, "n0", &["check", "gone", "8", "2"]);

    let served = |c: &Cluster| c.log("n1").matches("serving faults").count();
    let before = served(&c);
    let waiting = spawn(&c, "n1", &["consume", "kept", "4"]);
    wait_for(&|| served(&c) > before, "the consumer never mapped");
    c.ok(&["rm", "kept"]);
    wait_for(
        &|| c.logs_contain("removed file still mapped"),
        "the mapped removed file was not kept",
    );
    assert_eq!(drops(&c), 1);
    let mut waiting = waiting;
    waiting.kill().unwrap();
    waiting.wait().unwrap();
}

/// A rank waiting at a barrier when the coordinator (which holds the barrier) dies fails with
/// a clear message instead of waiting forever.
#[test]
fn a_barrier_wait_fails_clearly_when_the_coordinator_dies() {
    let c = Cluster::start(4, 0);
    let waiter = spawn(&c, "n1", &["count", "b", "1", "0", "2"]);
    wait_sync_waits(&c, "n1", 1);
    c.kill("n0");
    let o = wait_within(waiter, Duration::from_secs(30));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("the coordinator (n0) went down while this rank waited"),
        "{err}"
    );
}

/// A process with two sessions is one rank: ending one session ends neither the process nor
/// the other session's calls (a waiting barrier stays waiting, a lock stays the process's).
#[test]
fn a_second_session_in_a_process_works_and_ending_it_ends_nothing_else() {
    let c = Cluster::start(2, 0);
    let sock = c.config().socket_path(c.config().entry("n1").unwrap());
    let waiting = psls_client::Session::connect_to(&sock).unwrap();
    let other = psls_client::Session::connect_to(&sock).unwrap();
    other.lock(7).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            let _ = tx.send(waiting.barrier_of("counted", 2).map_err(|e| e.to_string()));
        });
        wait_sync_waits(&c, "n1", 1);
        assert!(rx.try_recv().is_err(), "the barrier opened with one rank of two");
        let channels = counter(&c, "n1", "sync_channels");
        drop(other);
        wait_for(Duration::from_secs(20), "the ended session's channel stayed", || {
            counter(&c, "n1", "sync_channels") < channels
        });
        // Deliberate: the ended session is gone; give the daemon time to (wrongly) end the
        // other session's call with it, which is what must not happen.
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            rx.try_recv().is_err(),
            "ending the other session ended the waiting call"
        );
        // A second rank (another process, of the same job as this one: none) arrives: both
        // go on.
        let probe = c
            .client("n1", PROBE)
            .env_remove("PSLS_JOB")
            .args(["count", "two-sessions", "1", "0", "2"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn probe");
        let o = wait_within(probe, Duration::from_secs(30));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let r = rx.recv_timeout(Duration::from_secs(10)).expect("the waiting call hung");
        assert_eq!(r, Ok(()));
    });
    // The lock taken through the ended session is still this process's.
    waiting.unlock(7).unwrap();
}
