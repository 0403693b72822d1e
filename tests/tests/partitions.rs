//! A cut-off node is fenced, not fatal (DESIGN §2): the daemons run in network namespaces of
//! their own, joined by a bridge, and a node's link is cut for 3 s — both ways, and one way
//! (what it sends is lost, what it is sent arrives) — during an MGS job, for a plain node
//! and for the coordinator. This kernel has no `netem`: a `pfifo` qdisc with `limit 0` on a
//! veth drops everything leaving through it. Each time the job ends with an unfailed run's
//! checksum, the node is back as a new incarnation, and the next job runs at once.
//!
//! Needs root (network namespaces) and iproute2 (`ip`, `tc`): skipped with one line without.

mod common;

use psls_tests::*;
use std::process::Command;
use std::time::Duration;

/// The test's network: a bridge and, per node, a namespace and a veth pair (one end in the
/// namespace, the other on the bridge). Removed on drop.
struct Net {
    prefix: String,
    nodes: usize,
}

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .status()
        .is_ok_and(|s| s.success())
}

impl Net {
    /// `nodes` namespaces on the subnet 10.`a`.`b`.0/24 (node i at .i+1); `None` where it
    /// cannot be built here.
    fn build(nodes: usize) -> Option<Net> {
        let id = std::process::id() % 100_000;
        let net = Net {
            prefix: format!("ps{id}"),
            nodes,
        };
        let (a, b) = (100 + (id / 250) % 100, id % 250);
        let br = net.bridge();
        if !sh(&["ip", "link", "add", &br, "type", "bridge"]) || !sh(&["ip", "link", "set", &br, "up"]) {
            return None;
        }
        for i in 0..nodes {
            let (ns, inner, outer) = (net.ns(i), net.inner(i), net.outer(i));
            let addr = format!("10.{a}.{b}.{}/24", i + 1);
            let ok = sh(&["ip", "netns", "add", &ns])
                && sh(&["ip", "link", "add", &inner, "type", "veth", "peer", "name", &outer])
                && sh(&["ip", "link", "set", &inner, "netns", &ns])
                && sh(&["ip", "link", "set", &outer, "master", &br])
                && sh(&["ip", "link", "set", &outer, "up"])
                && sh(&["ip", "netns", "exec", &ns, "ip", "addr", "add", &addr, "dev", &inner])
                && sh(&["ip", "netns", "exec", &ns, "ip", "link", "set", &inner, "up"])
                && sh(&["ip", "netns", "exec", &ns, "ip", "link", "set", "lo", "up"]);
            if !ok {
                return None;
            }
        }
        Some(net)
    }

    fn bridge(&self) -> String {
        format!("{}br", self.prefix)
    }
    fn ns(&self, i: usize) -> String {
        format!("{}n{i}", self.prefix)
    }
    /// The veth end inside node i's namespace.
    fn inner(&self, i: usize) -> String {
        format!("{}a{i}", self.prefix)
    }
    /// The veth end on the bridge (what leaves it goes to node i).
    fn outer(&self, i: usize) -> String {
        format!("{}b{i}", self.prefix)
    }
    fn ip(&self, i: usize) -> String {
        let id = std::process::id() % 100_000;
        format!("10.{}.{}.{}", 100 + (id / 250) % 100, id % 250, i + 1)
    }

    /// Cuts what node `i` sends, and with `both` what it is sent.
    fn cut(&self, i: usize, both: bool) {
        let (ns, inner) = (self.ns(i), self.inner(i));
        assert!(sh(&[
            "ip", "netns", "exec", &ns, "tc", "qdisc", "add", "dev", &inner, "root", "pfifo", "limit", "0"
        ]));
        if both {
            assert!(sh(&[
                "tc",
                "qdisc",
                "add",
                "dev",
                &self.outer(i),
                "root",
                "pfifo",
                "limit",
                "0"
            ]));
        }
    }

    fn heal(&self, i: usize, both: bool) {
        let (ns, inner) = (self.ns(i), self.inner(i));
        assert!(sh(&[
            "ip", "netns", "exec", &ns, "tc", "qdisc", "del", "dev", &inner, "root"
        ]));
        if both {
            assert!(sh(&["tc", "qdisc", "del", "dev", &self.outer(i), "root"]));
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(i)]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge()]).status();
    }
}

#[test]
fn a_partitioned_node_and_a_partitioned_coordinator_are_fenced_and_the_job_completes() {
    let Some(net) = Net::build(4) else {
        eprintln!("skipped: cannot build network namespaces here (needs root and iproute2)");
        return;
    };
    // Each daemon in its node's namespace, listening on its own address.
    let c = Cluster::init(4, 0, |cfg| {
        for (i, n) in cfg.nodes.iter_mut().enumerate() {
            let ip: std::net::IpAddr = net.ip(i).parse().expect("address");
            let link = n.link().expect("link address");
            n.addr = std::net::SocketAddr::new(ip, n.addr.port());
            n.link_addr = Some(std::net::SocketAddr::new(ip, link.port()));
        }
    });
    let wrapper = c.tmp.path().join("in-netns.sh");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n# Starts psls-node in its node's network namespace.\nfor a; do [ \"$prev\" = --node ] && node=$a; prev=$a; done\nexec ip netns exec {}\"${{node#n}}\" {} \"$@\"\n",
            net.ns(0).trim_end_matches('0'),
            bin_dir().join("psls-node").display()
        ),
    )
    .expect("wrapper");
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let mut c = c;
    c.env.push(("PSLS_NODE_BIN".into(), wrapper.display().to_string()));
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
