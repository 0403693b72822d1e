//! A cut-off node is fenced, not fatal (DESIGN §2): the daemons run in network namespaces of
//! their own, joined by a bridge, and a node's link is cut for 3 s — both ways, and one way
//! (what it sends is lost, what it is sent arrives) — during an MGS job, for a plain node
//! and for the coordinator. This kernel has no `netem`: a `pfifo` qdisc with `limit 0` on a
//! veth drops everything leaving through it. Each time the job ends with an unfailed run's
//! checksum, the node is back as a new incarnation, and the next job runs at once.
//!
//! Needs root (network namespaces) and iproute2 (`ip`, `tc`): skipped with one line without,
//! failed under `CI=true`.

mod common;

use psls_tests::faults::Net;
use psls_tests::*;
use std::time::Duration;

#[test]
fn a_partitioned_node_and_a_partitioned_coordinator_are_fenced_and_the_job_completes() {
    let Some(net) = Net::build(4) else {
        cannot_run("cannot build network namespaces here (needs root and iproute2)");
        return;
    };
    // Each daemon in its node's namespace, listening on its own address.
    let mut c = Cluster::init(4, 0, |_| {});
    net.place(&mut c);
    c.ok(&["cluster", "up"]);
    let hold = Duration::from_secs(3);
    let timeout = Duration::from_millis(c.config().cluster.heartbeat_timeout_ms);
    let (want, _) = common::finish_unfailed(&c, "n1");
    for both in [true, false] {
        let how = if both {
            "two-way partition"
        } else {
            "one-way partition (outgoing)"
        };
        // A plain node, then the coordinator (with a launcher that is neither).
        let coord = common::coordinator(&c, "n1");
        for victim in ["n2".to_string(), coord] {
            let i: usize = victim.trim_start_matches('n').parse().expect("node index");
            let launcher = if victim == "n1" { "n3" } else { "n1" };
            let (verdict, back) = common::disrupt_during_job(
                &c,
                how,
                &victim,
                launcher,
                &want,
                &[],
                false,
                hold,
                &mut || net.cut(i, both),
                &mut || net.heal(i, both),
            );
            assert!(
                verdict < 2.0 * timeout.as_secs_f64(),
                "{how} of {victim}: verdict after {verdict} s"
            );
            assert!(back < 4 * timeout, "{how} of {victim}: back {back:?} after the heal");
        }
    }
    c.ok(&["cluster", "down"]);
}

/// A rank's lines printed while its node is cut off from every other node stay unshown until
/// a second node keeps them: the cut-off node is declared down, re-executes with an empty
/// store, and the restarted rank's lines are numbered after what the other nodes kept. (Shown
/// at once, they moved the client past numbers the restarted rank then used again, and its
/// last lines were dropped as already printed: a job that ended 0 without rank 0's result,
/// found by the nemesis.)
#[test]
fn lines_printed_on_a_cut_off_node_never_hide_the_restarted_ranks_lines() {
    let Some(net) = Net::build(4) else {
        cannot_run("cannot build network namespaces here (needs root and iproute2)");
        return;
    };
    let mut c = Cluster::init(4, 0, |_| {});
    net.place(&mut c);
    c.ok(&["cluster", "up"]);
    let dir = c.path("marks");
    std::fs::create_dir_all(&dir).expect("marks folder");
    let d = dir.display();
    // Rank 0's first start waits for `go`, prints ten lines and stays; its restart prints its
    // result and ends. The other ranks print one line and end.
    let script = format!(
        "if [ \"$PSLS_RANK\" != 0 ]; then echo \"rank $PSLS_RANK\"; exit 0; fi
         if [ -e {d}/started ]; then echo restarted; echo 'result 0'; exit 0; fi
         touch {d}/started
         while [ ! -e {d}/go ]; do sleep 0.05; done
         for i in 1 2 3 4 5 6 7 8 9 10; do echo \"early $i\"; done
         touch {d}/printed
         sleep 600"
    );
    let run = c
        .cmd(&["--node", "n0", "run", "-n", "4", "--", "sh", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("psls run");
    let exists = |f: &str| dir.join(f).exists();
    wait_for(Duration::from_secs(60), "rank 0 started", || exists("started"));
    // n0 cut off until the others declared it down and it takes every other node as down (no
    // second node to keep lines).
    net.cut(0, true);
    let states = |via: &str| -> Vec<(String, String)> {
        let o = c.run(&["--node", via, "cluster", "status", "--json"]);
        let st: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        st["nodes"]
            .as_array()
            .map(|ns| {
                ns.iter()
                    .map(|n| {
                        (
                            n["name"].as_str().unwrap_or("").to_string(),
                            n["state"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    wait_for(
        Duration::from_secs(30),
        "n0 declared down, and alone in its view",
        || {
            states("n1").iter().any(|(n, s)| n == "n0" && s == "down")
                && states("n0").iter().filter(|(n, _)| n != "n0").all(|(_, s)| s != "up")
        },
    );
    std::fs::write(dir.join("go"), b"").expect("go");
    wait_for(Duration::from_secs(30), "rank 0 printed", || exists("printed"));
    // Its node's relay takes the lines in.
    std::thread::sleep(Duration::from_millis(500));
    net.heal(0, true);
    let o = wait_within(run, Duration::from_secs(120));
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "the job failed ({}):\n{out}\n{err}", o.status);
    assert!(
        c.logs_contain("job rolls back"),
        "n0 was declared down and the job rolled back:\n{err}"
    );
    // The client hears of it, though its daemon re-executed and it followed again elsewhere.
    assert!(
        err.contains("rolling job") || err.contains("restarted"),
        "the client was told of the rollback:\n{err}"
    );
    assert!(
        out.contains("[0] result 0"),
        "rank 0's result is missing:\n{out}\n{err}"
    );
    assert_eq!(out.matches("[0] result 0").count(), 1, "{out}");
    c.ok(&["cluster", "down"]);
}
