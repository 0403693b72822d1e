//! The metadata log's few voters on real daemons (issue 40): a cluster of six with three
//! voters loses two of them for good, one at a time (kill -9, never restarted); each time the
//! leader replaces the lost voter with a follower (a joint configuration) once it was down
//! `voter_replace_after_ms`, and the metadata goes on — it would have lost its majority with
//! the first voters fixed. A lost voter that comes back after all is a follower, and follows
//! the log to its end.

use psls_tests::*;
use std::time::Duration;

fn status(c: &Cluster, via: &str) -> psls_ipc::proto::ClusterStatus {
    let out = c.ok(&["--node", via, "cluster", "status", "--json"]);
    serde_json::from_str(&out).expect("status json")
}

#[test]
fn voters_lost_for_good_one_at_a_time_are_replaced_and_the_metadata_goes_on() {
    let c = Cluster::init(6, 0, |cfg| {
        cfg.cluster.metadata_voters = 3;
        cfg.cluster.voter_replace_after_ms = 2000;
    });
    c.ok(&["cluster", "up"]);
    // The CLI asks a follower: the first voters are the first three nodes.
    let via = "n5";
    let first = status(&c, via).meta_voters;
    assert_eq!(first, vec!["n0", "n1", "n2"], "the first voters");
    c.ok(&["--node", via, "create", "before", "--size", "4K"]);
    let mut lost: Vec<String> = Vec::new();
    for round in 0..2 {
        let st = status(&c, via);
        let leader = st.coordinator.clone().expect("a coordinator");
        let victim = st
            .meta_voters
            .iter()
            .find(|v| **v != leader)
            .expect("a voter that does not lead")
            .clone();
        c.kill(&victim);
        lost.push(victim.clone());
        wait_for(
            Duration::from_secs(60),
            &format!("{victim} replaced among the voters"),
            || {
                let v = status(&c, via).meta_voters;
                v.len() == 3 && !v.iter().any(|x| lost.contains(x))
            },
        );
        let name = format!("after-{round}");
        c.ok(&["--node", via, "create", &name, "--size", "4K"]);
        let listed = c.ok(&["--node", via, "ls"]);
        assert!(
            listed.contains("before") && listed.contains(&name),
            "round {round}: {listed}"
        );
    }
    // Two of the first three voters are gone for good: the log goes on with the new ones.
    let now = status(&c, via).meta_voters;
    assert_eq!(
        now.iter().filter(|v| first.contains(v)).count(),
        1,
        "voters now {now:?}, first {first:?}"
    );
    // The first one lost comes back: a follower now, it follows the log to its end.
    c.ok(&["--node", via, "cluster", "up"]);
    let back = &lost[0];
    wait_for(Duration::from_secs(60), &format!("{back} following the log"), || {
        c.run(&["--node", back, "ls"]).status.success() && c.ok(&["--node", back, "ls"]).contains("after-1")
    });
    let after = status(&c, back);
    assert_eq!(after.meta_voters.len(), 3, "{:?}", after.meta_voters);
    assert!(
        !after.meta_voters.contains(back),
        "{back} came back as a follower: {:?}",
        after.meta_voters
    );
    assert!(
        c.log(back).contains("not a voter of the metadata log"),
        "{back} left raft"
    );
}
