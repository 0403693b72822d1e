//! A cut-off node is fenced, not fatal (DESIGN §2): the daemons run in network namespaces of
//! their own, joined by a bridge, and a node's link is cut for 3 s — both ways, and one way
//! (what it sends is lost, what it is sent arrives) — during an MGS job, for a plain node
//! and for the coordinator. This kernel has no `netem`: a `pfifo` qdisc with `limit 0` on a
//! veth drops everything leaving through it. Each time the job ends with an unfailed run's
//! checksum, the node is back as a new incarnation, and the next job runs at once.
//!
//! Needs root (network namespaces) and iproute2 (`ip`, `tc`): skipped with one line without.

mod common;

use psls_tests::faults::Net;
use psls_tests::*;
use std::time::Duration;

#[test]
fn a_partitioned_node_and_a_partitioned_coordinator_are_fenced_and_the_job_completes() {
    let Some(net) = Net::build(4) else {
        eprintln!("skipped: cannot build network namespaces here (needs root and iproute2)");
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
