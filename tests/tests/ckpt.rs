//! Persistent checkpoints with real daemons: what a process writes through a mapping reaches
//! both disk copies at its last unmap or its `sync`, and only then; exports and new mappings
//! after a restart of every daemon read it back.

use psls_tests::*;
const PROBE: &str = env!("CARGO_BIN_EXE_svm-probe");

fn probe(c: &Cluster, node: &str, args: &[&str]) -> String {
    let o = c.client(node, PROBE).args(args).output().expect("run probe");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "probe {args:?} on {node} failed ({}): {out}{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// The bytes svm-probe's `fill` writes: word k of page p is `mix64(seed ^ p << 20 ^ k)`.
fn pattern(seed: u64, pages: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(pages * 4096);
    for p in 0..pages {
        for k in 0..512usize {
            out.extend_from_slice(&psls_svm::rng::mix64(seed ^ ((p as u64) << 20) ^ k as u64).to_le_bytes());
        }
    }
    out
}

#[test]
fn writes_reach_the_disks_at_the_last_unmap_and_survive_a_restart_of_every_daemon() {
    let c = Cluster::start(4, 0);
    // A new file, filled through a mapping and unmapped: the export shows the writes.
    probe(&c, "n1", &["fill", "d", "64", "9"]);
    assert_same(&c.export("d", &[]), &pattern(9, 64), "export after the unmap");
    // Rewritten from another node: the new bytes replace the old on disk.
    probe(&c, "n2", &["fill", "d", "64", "10"]);
    assert_same(&c.export("d", &[]), &pattern(10, 64), "export after a rewrite");
    // Every daemon stops and starts: memory is gone, the disks hold the writes.
    c.ok(&["cluster", "down"]);
    c.ok(&["cluster", "up"]);
    probe(&c, "n3", &["check", "d", "64", "10"]);
    assert_same(&c.export("d", &[]), &pattern(10, 64), "export after a restart");
}

#[test]
fn sync_makes_writes_durable_and_later_writes_stay_off_the_disks() {
    let c = Cluster::start(4, 0);
    // Fill with 3, sync, overwrite the second half with 4, exit without unmapping.
    let out = probe(&c, "n0", &["fillsync", "s", "32", "3", "4", "16"]);
    assert!(out.contains("synced 32"), "{out}");
    // The disks hold exactly the synced version: the writes after it reached no disk.
    assert_same(&c.export("s", &[]), &pattern(3, 32), "export after sync");
    // The pages written after the sync are still the file's contents in memory (on n0). A
    // process on n2 writes one page and unmaps: that checkpoint takes every page written since
    // the last one, wherever it is — page 20 from n2, the rest of 16.. from n0's memory —
    // and leaves pages 0..16 at the generation of the first.
    probe(&c, "n2", &["fill", "s", "32", "7", "20"]);
    let mut want = pattern(3, 32);
    want[16 * 4096..].copy_from_slice(&pattern(4, 32)[16 * 4096..]);
    want[20 * 4096..21 * 4096].copy_from_slice(&pattern(7, 32)[20 * 4096..21 * 4096]);
    assert_same(&c.export("s", &[]), &want, "export after the second checkpoint");
    c.ok(&["cluster", "down"]);
    c.ok(&["cluster", "up"]);
    assert_same(&c.export("s", &[]), &want, "export after a restart");
    probe(&c, "n1", &["check", "s", "32", "7", "20"]);
    probe(&c, "n3", &["check", "s", "32", "3", "5"]);
}
