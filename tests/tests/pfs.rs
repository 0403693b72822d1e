//! The mirrored PFS with real daemons: data survives the loss of any one node, a permanent
//! loss with re-mirroring onto a spare, corruption on disk, interrupted imports and power cuts.

use psls_tests::{assert_same, random_bytes, Cluster};
use std::time::Duration;

const MIB: usize = 1024 * 1024;

#[test]
fn import_64mib_survives_kill_of_any_node() {
    let c = Cluster::start(4, 1);
    let st = c.status();
    assert_eq!(st.nodes.len(), 5);
    assert_eq!(st.coordinator.as_deref(), Some("n0"));
    assert!(st.nodes.iter().all(|n| n.state.to_string() == "up"), "{st:?}");
    assert_eq!(st.nodes.iter().filter(|n| n.spare).count(), 1);

    let data = random_bytes(64 * MIB + 123, 1);
    let local = c.write_local("in.bin", &data);
    c.ok(&["import", &local, "big"]);
    assert_same(&c.export("big", &[]), &data, "export after import");

    for victim in ["n0", "n1", "n2", "n3"] {
        c.kill(victim);
        // Ask a node that is alive.
        let via = if victim == "n0" { "n1" } else { "n0" };
        assert_same(
            &c.export("big", &["--node", via]),
            &data,
            &format!("export with {victim} killed"),
        );
        c.ok(&["cluster", "up"]);
    }
    // Coordinator fail-over happened when n0 was down; everything is healthy again now.
    let st = c.status();
    assert!(st.nodes.iter().all(|n| n.state.to_string() == "up"), "{st:?}");
    assert!(st.nodes.iter().filter(|n| n.name == "n0").all(|n| n.incarnation == 2));
    // Every node shows its two addresses, all distinct.
    let mut addrs: Vec<&str> = st
        .nodes
        .iter()
        .flat_map(|n| [n.addr.as_str(), n.link_addr.as_str()])
        .collect();
    addrs.sort();
    addrs.dedup();
    assert_eq!(addrs.len(), 2 * st.nodes.len(), "{st:?}");
}

#[test]
fn coordinator_fails_over_to_lowest_live_node() {
    let c = Cluster::start(3, 0);
    c.kill("n0");
    let t = std::time::Instant::now();
    loop {
        let out = c.ok(&["--node", "n2", "cluster", "status", "--json"]);
        let st: psls_ipc::proto::ClusterStatus = serde_json::from_str(&out).unwrap();
        if st.coordinator.as_deref() == Some("n1") {
            assert!(st.nodes.iter().any(|n| n.name == "n0" && n.state.to_string() == "down"));
            // Detected within the heartbeat timeout (1.5 s here) plus scheduling slack.
            assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no fail-over: {st:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Metadata operations still work through the new coordinator.
    c.ok(&["--node", "n2", "create", "after-failover", "--size", "8192"]);
    c.ok(&["cluster", "up"]);
    let ls = c.ok(&["--node", "n0", "ls"]);
    assert!(ls.contains("after-failover"), "{ls}");
}

#[test]
fn replace_wiped_node_then_lose_the_other_copies() {
    let c = Cluster::start(4, 1);
    let data = random_bytes(16 * MIB + 5000, 2);
    let local = c.write_local("in.bin", &data);
    c.ok(&["import", &local, "f"]);
    let pages = (data.len() as u64).div_ceil(4096);

    // Permanent loss of n2: process and disk.
    c.destroy("n2");
    c.wait_state("n2", "down");
    let err = c.fails(&["node", "replace", "2", "--with", "nosuch"]);
    assert!(err.contains("nosuch"), "{err}");
    let out = c.ok(&["node", "replace", "2", "--with", "s0"]);
    assert!(out.contains("re-mirroring done"), "{out}");
    let st = c.status();
    let s0 = st.nodes.iter().find(|n| n.name == "s0").unwrap();
    assert_eq!(s0.logical, Some(2));
    assert!(s0.rebuild.is_none());
    assert_eq!(
        st.nodes.iter().find(|n| n.name == "n2").unwrap().state.to_string(),
        "replaced"
    );
    // Every page has two copies again: scrub finds none missing.
    let scrub = c.ok(&["scrub"]);
    assert_eq!(
        scrub.trim(),
        format!(
            "scrub: 1 files, {} copies checked, 0 bad, 0 repaired, 0 unrepairable",
            2 * pages
        )
    );

    // Lose the node holding the other copy of logical 2's primaries (n3: their mirror) ...
    c.kill("n3");
    assert_same(&c.export("f", &[]), &data, "export with n2 replaced and n3 down");
    c.ok(&["cluster", "up"]);
    // ... and the node holding the primaries of logical 2's mirrors (n1).
    c.kill("n1");
    assert_same(
        &c.export("f", &["--node", "n0"]),
        &data,
        "export with n2 replaced and n1 down",
    );
}

fn flip_byte(path: &std::path::Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0x5a;
    f.write_all_at(&b, offset).unwrap();
    f.sync_all().unwrap();
}

fn store_file(c: &Cluster, node: &str, id: u64, role: char) -> std::path::PathBuf {
    let cfg = c.config();
    cfg.data_dir(cfg.entry(node).unwrap())
        .join("pages")
        .join(format!("f{id:016x}.{role}.d0"))
}

#[test]
fn corrupted_pages_are_detected_served_from_mirror_and_scrubbed() {
    let c = Cluster::start(4, 0);
    let data = random_bytes(2 * MIB, 3);
    let local = c.write_local("in.bin", &data);
    c.ok(&["import", &local, "f"]);
    let stat: serde_json::Value = serde_json::from_str(&c.ok(&["stat", "f", "--json"])).unwrap();
    let id = stat["file"]["id"].as_u64().unwrap();
    let pages = stat["file"]["pages"].as_u64().unwrap();
    assert_eq!(pages, 512);
    assert_eq!(stat["stripes"].as_array().unwrap().len(), 4);

    // Corrupt one primary copy on n1 and one mirror copy on n3 (in slot 0, the only slot a new
    // file has written).
    flip_byte(&store_file(&c, "n1", id, 'p'), 3 * 4096 + 777);
    flip_byte(&store_file(&c, "n3", id, 'm'), 5 * 4096 + 10);
    let out = c.ok(&["scrub"]);
    assert_eq!(
        out.trim(),
        format!(
            "scrub: 1 files, {} copies checked, 2 bad, 2 repaired, 0 unrepairable",
            2 * pages
        )
    );
    let out = c.ok(&["scrub"]);
    assert_eq!(
        out.trim(),
        format!(
            "scrub: 1 files, {} copies checked, 0 bad, 0 repaired, 0 unrepairable",
            2 * pages
        )
    );

    // A corrupt primary is detected by a read, served from the mirror, and repaired.
    flip_byte(&store_file(&c, "n2", id, 'p'), 7 * 4096 + 4095);
    assert_same(&c.export("f", &[]), &data, "export with a corrupt primary");
    let t = std::time::Instant::now();
    while !c.logs_contain("primary copies repaired from the other copy") {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "read path never repaired the primary"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = c.ok(&["scrub"]);
    assert!(out.contains(" 0 bad,"), "read path did not repair: {out}");

    // Both copies of one page bad: export fails with a clear error, scrub reports it.
    let home_of_page0 = stat["stripes"][0]["home"].as_u64().unwrap();
    let mirror_of_page0 = stat["stripes"][0]["mirror"].as_u64().unwrap();
    flip_byte(&store_file(&c, &format!("n{home_of_page0}"), id, 'p'), 100);
    flip_byte(&store_file(&c, &format!("n{mirror_of_page0}"), id, 'm'), 100);
    let err = c.fails(&["export", "f", &c.path("x").display().to_string()]);
    assert!(err.contains("page 0") && err.contains("unreadable"), "{err}");
    assert!(!c.path("x").exists(), "a failed export must not leave a file");
    let err = c.fails(&["scrub"]);
    assert!(err.contains("could not be repaired"), "{err}");
}

#[test]
fn interrupted_import_commits_nothing() {
    let c = Cluster::start(4, 0);
    let v1 = random_bytes(3 * MIB, 4);
    let local = c.write_local("v1.bin", &v1);
    c.ok(&["import", &local, "f"]);
    // A client that dies midway through a replacing import.
    struct Failing(usize);
    impl std::io::Read for Failing {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.0 == 0 {
                return Err(std::io::Error::other("source vanished"));
            }
            let n = buf.len().min(self.0);
            buf[..n].fill(7);
            self.0 -= n;
            Ok(n)
        }
    }
    let cfg = c.config();
    let sock = cfg.socket_path(cfg.entry("n1").unwrap());
    for replace in [true, false] {
        let name = if replace { "f" } else { "g" };
        let mut client = psls_client::Client::connect(&sock).unwrap();
        let r = client.import(&mut Failing(2 * MIB + 100), 3 * MIB as u64, name, 0o644, replace);
        assert!(r.is_err());
        drop(client);
    }
    std::thread::sleep(Duration::from_millis(500));
    let ls = c.ok(&["ls"]);
    assert_eq!(ls.lines().count(), 1, "{ls}");
    assert_same(&c.export("f", &[]), &v1, "old contents after an interrupted replace");
    // The aborted imports left no page files behind: only f's 6 store files per node
    // (primary and mirror × headers, slot 0, slot 1).
    let mut n = 0;
    for node in cfg.nodes.iter() {
        n += std::fs::read_dir(cfg.data_dir(node).join("pages")).unwrap().count();
    }
    assert_eq!(n, 4 * 6, "stray page files after aborted imports");
}

#[test]
fn power_cut_during_import_leaves_old_or_new() {
    let mut c = Cluster::init(4, 0, |_| {});
    c.env.push(("PSLS_FAULT_DISK".into(), "1".into()));
    c.ok(&["cluster", "up"]);
    let old = random_bytes(4 * MIB, 10);
    let new = random_bytes(4 * MIB, 11);
    let old_path = c.write_local("old.bin", &old);
    let new_path = c.write_local("new.bin", &new);
    c.ok(&["import", &old_path, "f"]);
    // Time one replacing import to spread the cut points over it.
    let t = std::time::Instant::now();
    c.ok(&["import", "--replace", &new_path, "f"]);
    let full = t.elapsed();
    c.ok(&["import", "--replace", &old_path, "f"]);
    let cuts = 12;
    // `current` is what f holds now; each round replaces it with the other version and cuts
    // the power at a point spread over (and a little past) one import's duration. The last
    // round cuts right after the import was acknowledged.
    let (mut before_commit, mut after_commit) = (0, 0);
    let mut current_is_old = true;
    for k in 0..=cuts + 1 {
        let (cur, next, next_path) = if current_is_old {
            (&old, &new, &new_path)
        } else {
            (&new, &old, &old_path)
        };
        let mut child = c
            .cmd(&["import", "--replace", next_path, "f"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let acknowledged = if k <= cuts {
            std::thread::sleep(full.mul_f64(1.3 * k as f64 / cuts as f64));
            c.kill_all();
            child.wait().unwrap().success()
        } else {
            let ok = child.wait().unwrap().success();
            c.kill_all();
            assert!(ok, "the last import failed without a power cut");
            ok
        };
        c.ok(&["cluster", "up"]);
        let got = c.export("f", &[]);
        if got == *cur {
            assert!(
                !acknowledged,
                "cut {k}: the import was acknowledged but its commit was lost"
            );
            before_commit += 1;
        } else {
            assert_same(&got, next, &format!("cut {k}: neither the old nor the new contents"));
            after_commit += 1;
            current_is_old = !current_is_old;
        }
        assert_eq!(c.ok(&["ls"]).lines().count(), 1);
    }
    assert_eq!(before_commit + after_commit, cuts + 2);
    // The first cut comes before any commit can have happened, the last after one was
    // acknowledged: both sides of the commit are always exercised.
    assert!(
        before_commit > 0 && after_commit > 0,
        "before {before_commit}, after {after_commit}"
    );
}

#[test]
fn down_node_is_replaced_automatically_by_a_free_spare() {
    let c = Cluster::init(4, 1, |cfg| cfg.cluster.replace_after_ms = 2000);
    c.ok(&["cluster", "up"]);
    let data = random_bytes(4 * MIB + 1, 7);
    let local = c.write_local("in.bin", &data);
    c.ok(&["import", &local, "f"]);
    let pages = (data.len() as u64).div_ceil(4096);
    c.destroy("n3");
    let t = std::time::Instant::now();
    loop {
        let st = c.status();
        let s0 = st.nodes.iter().find(|n| n.name == "s0").unwrap();
        if s0.logical == Some(3) && s0.rebuild.is_none() && st.nodes.iter().all(|n| n.rebuild.is_none()) {
            assert_eq!(
                st.nodes.iter().find(|n| n.name == "n3").unwrap().state.to_string(),
                "replaced"
            );
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(40),
            "no automatic replacement: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Only after the configured delay (2 s) past the failure verdict.
    assert!(
        t.elapsed() >= Duration::from_millis(2000),
        "replaced too early: {:?}",
        t.elapsed()
    );
    let scrub = c.ok(&["scrub"]);
    assert_eq!(
        scrub.trim(),
        format!(
            "scrub: 1 files, {} copies checked, 0 bad, 0 repaired, 0 unrepairable",
            2 * pages
        )
    );
    assert_same(&c.export("f", &[]), &data, "export after automatic replacement");
}

#[test]
fn storage_node_restart_during_import_fails_the_import() {
    // With the fault disk, a node that restarts loses its unsynced writes, exactly like a
    // node that loses power. The import must then fail, not commit a file with missing copies.
    let mut c = Cluster::init(4, 0, |_| {});
    c.env.push(("PSLS_FAULT_DISK".into(), "1".into()));
    c.ok(&["cluster", "up"]);
    let old = random_bytes(MIB, 8);
    let old_path = c.write_local("old.bin", &old);
    c.ok(&["import", &old_path, "f"]);

    let (half_tx, half_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    struct Paced {
        left: usize,
        sent: usize,
        half: Option<std::sync::mpsc::Sender<()>>,
        go: std::sync::mpsc::Receiver<()>,
    }
    impl std::io::Read for Paced {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.sent >= 8 * MIB {
                if let Some(h) = self.half.take() {
                    h.send(()).unwrap();
                    self.go.recv().unwrap();
                }
            }
            let n = buf.len().min(self.left).min(MIB);
            buf[..n].fill(0x42);
            self.left -= n;
            self.sent += n;
            Ok(n)
        }
    }
    let cfg = c.config();
    let sock = cfg.socket_path(cfg.entry("n0").unwrap());
    let importer = std::thread::spawn(move || {
        let mut client = psls_client::Client::connect(&sock).unwrap();
        let mut src = Paced {
            left: 16 * MIB,
            sent: 0,
            half: Some(half_tx),
            go: go_rx,
        };
        client.import(&mut src, 16 * MIB as u64, "f", 0o644, true)
    });
    half_rx.recv().unwrap();
    // Let the first half reach every node's page cache (not its disk), then restart n2.
    std::thread::sleep(Duration::from_millis(500));
    c.kill("n2");
    c.ok(&["cluster", "up"]);
    go_tx.send(()).unwrap();
    let r = importer.join().unwrap();
    let err = r.expect_err("the import must fail: n2 lost pages it had acknowledged");
    assert!(err.to_string().contains("restarted during the write"), "{err}");
    assert_same(&c.export("f", &[]), &old, "old contents after the failed import");
    assert_eq!(c.ok(&["ls"]).lines().count(), 1);
    let scrub = c.ok(&["scrub"]);
    assert!(scrub.contains(" 0 bad,"), "{scrub}");
}
