//! Faults a test injects from outside the daemons: network namespaces whose links can be cut
//! ([`Net`]: a partition, both ways or one way) and small filesystems that can be filled
//! ([`Mount`]: a full disk). Both need root and are `None` where they cannot be built.

use crate::*;
use std::process::Command;

/// The test's network: a bridge and, per node, a namespace and a veth pair (one end in the
/// namespace, the other on the bridge). Removed on drop.
pub struct Net {
    prefix: String,
    nodes: usize,
    /// Unique among the nets of this machine's live processes: names and subnet come from it.
    id: u32,
}

/// Nets built by this process so far (two tests of one binary build theirs at once).
static NETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .status()
        .is_ok_and(|s| s.success())
}

impl Net {
    /// `nodes` namespaces on the subnet 10.`a`.`b`.0/24 (node i at .i+1); `None` where it
    /// cannot be built here.
    pub fn build(nodes: usize) -> Option<Net> {
        let k = NETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = (std::process::id() * 8 + k % 8) % 100_000;
        let net = Net {
            prefix: format!("ps{id}"),
            nodes,
            id,
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

    pub fn bridge(&self) -> String {
        format!("{}br", self.prefix)
    }
    pub fn ns(&self, i: usize) -> String {
        format!("{}n{i}", self.prefix)
    }
    /// The veth end inside node i's namespace.
    pub fn inner(&self, i: usize) -> String {
        format!("{}a{i}", self.prefix)
    }
    /// The veth end on the bridge (what leaves it goes to node i).
    pub fn outer(&self, i: usize) -> String {
        format!("{}b{i}", self.prefix)
    }
    pub fn ip(&self, i: usize) -> String {
        let id = self.id;
        format!("10.{}.{}.{}", 100 + (id / 250) % 100, id % 250, i + 1)
    }

    /// Cuts what node `i` sends, and with `both` what it is sent.
    pub fn cut(&self, i: usize, both: bool) {
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

    pub fn heal(&self, i: usize, both: bool) {
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

/// A tmpfs of `size` mounted at `at` for the test's life (lazily unmounted at its end).
pub struct Mount(pub std::path::PathBuf);

impl Mount {
    pub fn tmpfs(at: &std::path::Path, size: &str) -> Option<Mount> {
        std::fs::create_dir_all(at).expect("mount point");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Mount(at.to_path_buf()))
    }

    /// Fills the filesystem but for `leave` bytes.
    pub fn fill(&self, leave: u64) {
        let st = nix::sys::statvfs::statvfs(&self.0).expect("statvfs");
        let free = st.blocks_available() * st.fragment_size();
        let filler = vec![0xa5u8; free.saturating_sub(leave) as usize];
        // A short write is fine: the disk is as full as it gets.
        let _ = std::fs::write(self.0.join("filler"), &filler);
    }

    pub fn free(&self) {
        std::fs::remove_file(self.0.join("filler")).expect("remove the filler");
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

impl Net {
    /// Moves `c`'s nodes onto this network: each listens on its namespace's address, and
    /// `psls cluster up` starts each daemon inside its namespace (through a wrapper script).
    pub fn place(&self, c: &mut Cluster) {
        let mut cfg = c.config();
        for (i, n) in cfg.nodes.iter_mut().enumerate() {
            let ip: std::net::IpAddr = self.ip(i).parse().expect("address");
            let link = n.link().expect("link address");
            n.addr = std::net::SocketAddr::new(ip, n.addr.port());
            n.link_addr = Some(std::net::SocketAddr::new(ip, link.port()));
        }
        std::fs::write(c.dir.join("cluster.toml"), cfg.to_toml()).expect("write config");
        let wrapper = c.tmp.path().join("in-netns.sh");
        std::fs::write(
            &wrapper,
            format!(
                "#!/bin/sh\n# Starts psls-node in its node's network namespace.\nfor a; do [ \"$prev\" = --node ] && node=$a; prev=$a; done\nexec ip netns exec {}\"${{node#n}}\" {} \"$@\"\n",
                self.ns(0).trim_end_matches('0'),
                bin_dir().join("psls-node").display()
            ),
        )
        .expect("wrapper");
        std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
        c.env.push(("PSLS_NODE_BIN".into(), wrapper.display().to_string()));
    }
}
