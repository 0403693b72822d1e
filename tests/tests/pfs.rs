//! The mirrored PFS with real daemons: data survives the loss of any one node, a permanent
//! loss with re-mirroring onto a spare, corruption on disk, interrupted imports and power cuts.

use psls_tests::{assert_same, pipe_feed, pipe_unread, random_bytes, wait_for, Cluster};
use std::collections::BTreeSet;
use std::time::Duration;

const MIB: usize = 1024 * 1024;

#[test]
fn import_64mib_survives_kill_of_any_node() {
    let c = Cluster::start(4, 1);
    let st = c.status();
    let first_n0 = st.nodes.iter().find(|n| n.name == "n0").map_or(0, |n| n.incarnation);
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
    // n0's first start drew its incarnation (a blank folder); its restart is the next one.
    assert!(st
        .nodes
        .iter()
        .filter(|n| n.name == "n0")
        .all(|n| n.incarnation == first_n0 + 1));
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
    let id = stat["file"]["id"].as_str().and_then(|s| s.parse::<u64>().ok()).unwrap();
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

/// Ids of the files whose store files `node` holds (names `f<id, hex>.<role>.<part>`).
fn stored_ids(c: &Cluster, node: &str) -> BTreeSet<u64> {
    let cfg = c.config();
    std::fs::read_dir(cfg.data_dir(cfg.entry(node).unwrap()).join("pages"))
        .unwrap()
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            u64::from_str_radix(name.strip_prefix('f')?.split('.').next()?, 16).ok()
        })
        .collect()
}

/// Store files on all the logical nodes together.
fn store_file_count(c: &Cluster) -> usize {
    let cfg = c.config();
    cfg.nodes
        .iter()
        .map(|n| std::fs::read_dir(cfg.data_dir(n).join("pages")).unwrap().count())
        .sum()
}

/// Whether every logical node holds store files of a file id not in `known`: pages of an
/// import in progress have reached all of them.
fn new_pages_everywhere(c: &Cluster, known: &BTreeSet<u64>) -> bool {
    c.config()
        .nodes
        .iter()
        .all(|n| stored_ids(c, &n.name).iter().any(|id| !known.contains(id)))
}

/// Every file id stored on any logical node.
fn all_stored_ids(c: &Cluster) -> BTreeSet<u64> {
    c.config().nodes.iter().flat_map(|n| stored_ids(c, &n.name)).collect()
}

/// Imports interrupted midway, once pages of the new version are on every node: by killing
/// the client process (streamed import), and by killing the process writing the pipe the
/// daemon reads (descriptor import). Each fails with the error the interruption causes, and
/// commits nothing: a replaced file keeps its old contents bit for bit, a new name does not
/// appear, and the aborted pages are removed from every node.
#[test]
fn interrupted_import_commits_nothing() {
    use std::os::fd::AsFd;
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, Stdio};
    let c = Cluster::start(4, 0);
    let v1 = random_bytes(3 * MIB, 4);
    let local = c.write_local("v1.bin", &v1);
    c.ok(&["import", &local, "f"]);
    let cfg = c.config();
    let sock = cfg.socket_path(cfg.entry("n1").unwrap());
    let files_of_f = store_file_count(&c);
    // 12 MiB announced, 6 MiB sent: the first 4 MiB fill a batch for every home node, so the
    // daemon writes pages to every node while it waits for the rest.
    let (size, sent) = (12 * MIB, 6 * MIB);
    let check_nothing_committed = |name: &str, what: &str| {
        // The abort removes the new pages from every node (after the answer, for a dead client).
        wait_for(Duration::from_secs(20), &format!("{what}: stray page files"), || {
            store_file_count(&c) == files_of_f
        });
        let ls = c.ok(&["ls"]);
        assert_eq!(ls.lines().count(), 1, "{what}: {ls}");
        if name == "f" {
            assert_same(&c.export("f", &[]), &v1, &format!("{what}: old contents"));
        } else {
            let err = c.fails(&["stat", name]);
            assert!(err.contains(name), "{what}: {err}");
        }
    };

    // The client process dies midway through a streamed import.
    for name in ["f", "g"] {
        let known = all_stored_ids(&c);
        let gone_before = c.log("n1").matches("client went away during import").count();
        let mut client = Command::new(env!("CARGO_BIN_EXE_import-probe"))
            .args([sock.to_str().unwrap(), name, &size.to_string(), "replace"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = client.stdin.take().unwrap();
        pipe_feed(stdin.as_fd(), &vec![7u8; sent], Duration::from_secs(30));
        wait_for(
            Duration::from_secs(20),
            "the import's pages never reached every node",
            || new_pages_everywhere(&c, &known),
        );
        assert!(client.try_wait().unwrap().is_none(), "the client ended by itself");
        client.kill().unwrap();
        let st = client.wait().unwrap();
        assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
        drop(stdin);
        // The daemon saw its client vanish mid-import, and said so.
        wait_for(
            Duration::from_secs(20),
            "the daemon never noticed the dead client",
            || c.log("n1").matches("client went away during import").count() > gone_before,
        );
        check_nothing_committed(name, &format!("killed client, {name}"));
    }

    // The process writing the pipe the daemon imports from dies midway.
    for (name, replace) in [("f", true), ("g", false)] {
        let known = all_stored_ids(&c);
        let mut source = Command::new("sh")
            .args(["-c", &format!("head -c {sent} /dev/zero; exec sleep 600")])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let pipe = source.stdout.take().unwrap();
        let sock = sock.clone();
        let importer = std::thread::spawn(move || {
            psls_client::Client::connect(&sock)
                .and_then(|mut cl| cl.import_fd(pipe.as_fd(), size as u64, name, 0o644, replace))
        });
        wait_for(
            Duration::from_secs(20),
            "the import's pages never reached every node",
            || new_pages_everywhere(&c, &known),
        );
        assert!(!importer.is_finished(), "the import ended before its source died");
        assert!(source.try_wait().unwrap().is_none(), "the source ended by itself");
        source.kill().unwrap();
        source.wait().unwrap();
        let err = importer
            .join()
            .unwrap()
            .expect_err("an import whose source died must fail");
        // The source's end came early: that, and nothing else, is what the daemon reports.
        let err = err.to_string();
        assert!(
            err.contains("reading the file to import") && err.contains("fill whole buffer"),
            "{err}"
        );
        check_nothing_committed(name, &format!("killed source, {name}"));
    }
}

/// Where a power cut strikes a replacing import fed through a pipe, as observed state.
#[derive(Clone, Copy, Debug)]
enum Cut {
    /// The daemon has read this many MiB of the source and waits for more.
    Fed(usize),
    /// The daemon has read the whole source (the import is writing, syncing or committing).
    SourceRead,
    /// The import was acknowledged.
    Acknowledged,
}

/// Power cuts (kill -9 of every daemon over the fault disk: unsynced writes are lost) at
/// observed points of a replacing import. Before the source is complete the old contents must
/// survive; after the acknowledgement the new; in between either, never a mix. After every
/// cut the restarted cluster's scrub finds every copy of the file good.
#[test]
fn power_cut_during_import_leaves_old_or_new() {
    use std::os::fd::AsFd;
    let mut c = Cluster::init(4, 0, |_| {});
    c.env.push(("PSLS_FAULT_DISK".into(), "1".into()));
    c.ok(&["cluster", "up"]);
    let size = 16 * MIB;
    let pages = size / 4096;
    let old = random_bytes(size, 10);
    let new = random_bytes(size, 11);
    let old_path = c.write_local("old.bin", &old);
    c.ok(&["import", &old_path, "f"]);
    let cfg = c.config();
    let sock = cfg.socket_path(cfg.entry("n1").unwrap());
    let cuts = [
        Cut::Fed(1),
        Cut::Fed(6),
        Cut::Fed(14),
        Cut::SourceRead,
        Cut::SourceRead,
        Cut::Acknowledged,
    ];
    let (mut before_commit, mut after_commit) = (0, 0);
    let mut current_is_old = true;
    for (k, cut) in cuts.into_iter().enumerate() {
        let (cur, next) = if current_is_old { (&old, &new) } else { (&new, &old) };
        let known = all_stored_ids(&c);
        let (r, w) = nix::unistd::pipe().unwrap();
        let probe = r.try_clone().unwrap();
        let sock = sock.clone();
        let importer = std::thread::spawn(move || {
            psls_client::Client::connect(&sock)
                .and_then(|mut cl| cl.import_fd(r.as_fd(), size as u64, "f", 0o644, true))
        });
        let fed = match cut {
            Cut::Fed(mib) => mib * MIB,
            Cut::SourceRead | Cut::Acknowledged => size,
        };
        pipe_feed(w.as_fd(), &next[..fed], Duration::from_secs(30));
        // Short of the whole source, the pipe stays open: the daemon waits for the rest.
        let open_source = matches!(cut, Cut::Fed(_)).then_some(w);
        wait_for(
            Duration::from_secs(20),
            &format!("cut {k}: the daemon never read the source"),
            || pipe_unread(probe.as_fd()) == 0,
        );
        if fed >= 4 * MIB && matches!(cut, Cut::Fed(_)) {
            // A full batch per home node went out: new pages are on every node, unsynced.
            wait_for(
                Duration::from_secs(20),
                &format!("cut {k}: the import's pages never reached every node"),
                || new_pages_everywhere(&c, &known),
            );
        }
        if matches!(cut, Cut::Acknowledged) {
            wait_for(Duration::from_secs(60), "the import was never answered", || {
                importer.is_finished()
            });
        }
        c.kill_all();
        drop(open_source);
        let acknowledged = importer.join().unwrap().is_ok();
        match cut {
            Cut::Fed(_) => assert!(
                !acknowledged,
                "cut {k}: an import of part of its source was acknowledged"
            ),
            Cut::Acknowledged => assert!(acknowledged, "cut {k}: the import failed without a power cut"),
            Cut::SourceRead => {}
        }
        drop(probe);
        c.ok(&["cluster", "up"]);
        let got = c.export("f", &[]);
        if got == *cur {
            assert!(
                !acknowledged,
                "cut {k} ({cut:?}): the import was acknowledged but its commit was lost"
            );
            before_commit += 1;
        } else {
            assert!(
                !matches!(cut, Cut::Fed(_)),
                "cut {k} ({cut:?}): contents changed by an import whose source was incomplete"
            );
            assert_same(
                &got,
                next,
                &format!("cut {k} ({cut:?}): neither the old nor the new contents"),
            );
            after_commit += 1;
            current_is_old = !current_is_old;
        }
        assert_eq!(c.ok(&["ls"]).lines().count(), 1);
        // Every copy of what was committed was synced before the commit: all good.
        let scrub = c.ok(&["scrub"]);
        assert_eq!(
            scrub.trim(),
            format!(
                "scrub: 1 files, {} copies checked, 0 bad, 0 repaired, 0 unrepairable",
                2 * pages
            ),
            "cut {k} ({cut:?})"
        );
    }
    assert!(
        before_commit >= 3 && after_commit >= 1,
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
    let known = all_stored_ids(&c);
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
    // Wait until n2 holds (unsynced, in its fault disk's memory) every page of the first half
    // it must hold, read back as a peer would, then restart it.
    let mut id = None;
    wait_for(Duration::from_secs(20), "the import's pages never reached n2", || {
        id = stored_ids(&c, "n2").into_iter().find(|i| !known.contains(i));
        id.is_some()
    });
    let file = psls_svm::FileId(id.unwrap());
    let placement = psls_pfs::Placement::new(4).unwrap();
    let peer = psls_tests::Peer::new(&c, "n3");
    let first_half = (8 * MIB / 4096) as u64;
    for role in [psls_pfs::Role::Primary, psls_pfs::Role::Mirror] {
        let held: Vec<u64> = (0..first_half)
            .filter(|&i| placement.holder(file, i, role) == psls_svm::NodeId(2))
            .collect();
        assert!(!held.is_empty());
        for chunk in held.chunks(512) {
            let req = psls_node::peer::PeerReq::ReadPages {
                file,
                role,
                indices: chunk.to_vec(),
                gens: vec![1; chunk.len()],
            };
            wait_for(
                Duration::from_secs(20),
                &format!("n2 never held its {role:?} pages"),
                || match peer.request("n2", &req, bytes::Bytes::new()) {
                    Ok((psls_node::peer::PeerResp::Pages(st), _)) => {
                        st.iter().all(|s| *s == psls_node::peer::PageState::Ok)
                    }
                    other => panic!("reading n2's pages: {other:?}"),
                },
            );
        }
    }
    c.kill("n2");
    c.ok(&["cluster", "up"]);
    go_tx.send(()).unwrap();
    let r = importer.join().unwrap();
    let err = r.expect_err("the import must fail: n2 lost pages it had acknowledged");
    assert!(err.to_string().contains("restarted during the write"), "{err}");
    assert_same(&c.export("f", &[]), &old, "old contents after the failed import");
    assert_eq!(c.ok(&["ls"]).lines().count(), 1);
    let scrub = c.ok(&["scrub"]);
    assert_eq!(
        scrub.trim(),
        format!(
            "scrub: 1 files, {} copies checked, 0 bad, 0 repaired, 0 unrepairable",
            2 * MIB / 4096
        )
    );
}

#[test]
fn json_documents_carry_a_schema_version_ids_as_strings_and_the_tables_state_words() {
    let c = Cluster::start(2, 0);
    c.ok(&["create", "j", "--size", "8K"]);
    let doc = |args: &[&str]| -> serde_json::Value {
        let out = c.ok(args);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}\n{out}"))
    };
    // The global --output json and each command's --json print the same document.
    for args in [&["--output", "json", "ls"][..], &["ls", "--json"][..]] {
        let ls = doc(args);
        assert_eq!(ls["schema_version"], 1, "{ls}");
        let f = &ls["files"][0];
        let id = f["id"].as_str().expect("the id is a string");
        assert!(id.parse::<u64>().is_ok(), "{f}");
    }
    let stat = doc(&["--output", "json", "stat", "j"]);
    assert_eq!(stat["schema_version"], 1);
    assert_eq!(stat["file"]["id"], doc(&["ls", "--json"])["files"][0]["id"]);
    let status = doc(&["--output", "json", "cluster", "status"]);
    assert_eq!(status["schema_version"], 1);
    // The table counts nodes per state and lists only those that need a look; --all lists
    // every node; the JSON always has every node.
    let table = c.ok(&["cluster", "status"]);
    let all = c.ok(&["cluster", "status", "--all"]);
    let nodes = status["nodes"].as_array().expect("nodes");
    assert!(table.contains(&format!("nodes: {} up", nodes.len())), "{table}");
    assert!(table.contains("every node is up"), "{table}");
    for n in nodes {
        let state = n["state"].as_str().expect("a state word");
        assert_eq!(state, "up", "{n}");
        let name = n["name"].as_str().expect("a name");
        assert!(!table.contains(&format!("\n{name} ")), "{table}");
        assert!(all.contains(&format!("\n{name} ")), "{all}");
    }
    let jobs = doc(&["--output", "json", "jobs"]);
    assert_eq!(
        (jobs["schema_version"].as_u64(), jobs["jobs"].is_array()),
        (Some(1), true),
        "{jobs}"
    );
    // A bad value names the choices.
    let e = c.fails(&["--output", "yaml", "ls"]);
    assert!(e.contains("possible values: table, json"), "{e}");
}
