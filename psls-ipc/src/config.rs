//! The cluster configuration (TOML). Relative paths are relative to the config file's folder.
//! `deploy/README.md` is the reference of every key, its default and bounds.
//!
//! ```toml
//! [cluster]
//! name = "psls"
//! heartbeat_interval_ms = 200
//! heartbeat_timeout_ms = 1000
//! replace_after_ms = 0          # 0: never replace a down node automatically
//! request_timeout_ms = 5000
//! cert_dir = "certs"
//!
//! [[node]]                      # logical ids are the order of [[node]] entries
//! name = "n0"
//! addr = "127.0.0.1:7400"       # QUIC: requests, page transfers, heartbeats
//! link_addr = "127.0.0.1:7500"  # TCP+TLS: the message link (coherence, barriers, locks);
//!                               # default: addr's IP, port + 100
//! data_dir = "data/n0"
//! socket = "run/n0.sock"
//! memory_mb = 1024
//!
//! [[spare]]                     # same fields; takes over a lost node's logical id
//! ```

use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Errors loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    #[error("config {path} is invalid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config {path} is invalid: {message}")]
    Invalid { path: PathBuf, message: String },
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    #[serde(default = "default_name")]
    pub name: String,
    #[serde(default = "default_hb_interval")]
    pub heartbeat_interval_ms: u64,
    #[serde(default = "default_hb_timeout")]
    pub heartbeat_timeout_ms: u64,
    #[serde(default)]
    pub replace_after_ms: u64,
    #[serde(default = "default_request_timeout")]
    pub request_timeout_ms: u64,
    #[serde(default = "default_cert_dir")]
    pub cert_dir: PathBuf,
    /// A job's safe points take a persistent (cleaner) checkpoint when this many seconds
    /// passed since its last one (`psls run --persistent-interval` overrides).
    #[serde(default = "default_persistent_interval")]
    pub persistent_interval_s: u64,
    /// What stays in memory after a cleaner checkpoint (DESIGN §7): `none`, `total`, `p1`,
    /// `p2`, `p3` or `lru:FRAMES` (`psls run --cleaning` overrides); checked when a daemon
    /// starts.
    #[serde(default = "default_cleaning")]
    pub cleaning: String,
    /// How many peers each node heartbeats at least (Ceph's `osd_heartbeat_min_peers`): its
    /// ring neighbours, far peers and one in another failure domain, topped up to this; every
    /// other node in a smaller cluster. 2 to 64.
    #[serde(default = "default_min_peers")]
    pub heartbeat_min_peers: usize,
    /// How many nodes vote in the metadata log (odd, 3 to 7; a smaller cluster has as many as
    /// it has nodes, made odd), spread over failure domains; the others follow it.
    #[serde(default = "default_metadata_voters")]
    pub metadata_voters: usize,
    /// A voter declared down this long (or replaced by a spare) is replaced by a follower in
    /// the metadata log's voters.
    #[serde(default = "default_voter_replace_after")]
    pub voter_replace_after_ms: u64,
    /// How many connections a daemon keeps open at once, on each of its two transports (the
    /// message link and the request transport): past it, the least recently used idle ones
    /// are closed. 16 to 65536.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// A connection that carried nothing for this long is closed (the next message dials
    /// again). 50 to 3600000.
    #[serde(default = "default_connection_idle")]
    pub connection_idle_ms: u64,
}

fn default_name() -> String {
    "psls".into()
}
fn default_hb_interval() -> u64 {
    200
}
fn default_hb_timeout() -> u64 {
    1000
}
fn default_request_timeout() -> u64 {
    5000
}
fn default_cert_dir() -> PathBuf {
    "certs".into()
}
fn default_persistent_interval() -> u64 {
    60
}
fn default_cleaning() -> String {
    "p1".into()
}
fn default_min_peers() -> usize {
    10
}
fn default_metadata_voters() -> usize {
    5
}
fn default_voter_replace_after() -> u64 {
    60_000
}
fn default_max_connections() -> usize {
    256
}
fn default_connection_idle() -> u64 {
    30_000
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            name: default_name(),
            heartbeat_interval_ms: default_hb_interval(),
            heartbeat_timeout_ms: default_hb_timeout(),
            replace_after_ms: 0,
            request_timeout_ms: default_request_timeout(),
            persistent_interval_s: default_persistent_interval(),
            cleaning: default_cleaning(),
            cert_dir: default_cert_dir(),
            heartbeat_min_peers: default_min_peers(),
            metadata_voters: default_metadata_voters(),
            voter_replace_after_ms: default_voter_replace_after(),
            max_connections: default_max_connections(),
            connection_idle_ms: default_connection_idle(),
        }
    }
}

/// One physical node (a daemon).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    pub name: String,
    pub addr: SocketAddr,
    /// TCP address of the node's message link (TLS: coherence, barrier, lock and metadata-log
    /// messages, served by its own thread). Default: [`NodeEntry::DEFAULT_LINK_OFFSET`] ports
    /// above `addr`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_addr: Option<SocketAddr>,
    pub data_dir: PathBuf,
    pub socket: PathBuf,
    #[serde(default = "default_memory_mb")]
    pub memory_mb: u64,
    /// The host's name as the batch system knows it (Slurm's node name): `psls run` inside an
    /// allocation runs ranks on the nodes whose `host` its node list names. Default: `name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Where the node serves its metrics (HTTP, Prometheus text format, `GET /metrics`);
    /// none: no metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<SocketAddr>,
    /// The node's failure domain (a rack, a power feed): a node is declared down only on
    /// the word of watchers in two domains (or the metadata leader's own). Default: the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
}

impl NodeEntry {
    /// How far above `addr`'s port the message link listens when `link_addr` is not given.
    pub const DEFAULT_LINK_OFFSET: u16 = 100;

    /// The host's name as the batch system knows it ([`NodeEntry::host`]).
    pub fn host_name(&self) -> &str {
        self.host.as_deref().unwrap_or(&self.name)
    }

    /// The node's failure domain ([`NodeEntry::domain`]; default: its host).
    pub fn failure_domain(&self) -> &str {
        self.domain.as_deref().unwrap_or_else(|| self.host_name())
    }

    /// The message link's address (see [`NodeEntry::link_addr`]); `None` when the default
    /// would pass port 65535.
    pub fn link(&self) -> Option<SocketAddr> {
        match self.link_addr {
            Some(a) => Some(a),
            None => {
                let port = self.addr.port().checked_add(Self::DEFAULT_LINK_OFFSET)?;
                Some(SocketAddr::new(self.addr.ip(), port))
            }
        }
    }
}

fn default_memory_mb() -> u64 {
    1024
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    #[serde(default)]
    pub cluster: ClusterSection,
    #[serde(default, rename = "node")]
    pub nodes: Vec<NodeEntry>,
    #[serde(default, rename = "spare")]
    pub spares: Vec<NodeEntry>,
    /// Folder of the config file; relative paths are resolved against it. Not serialized.
    #[serde(skip)]
    pub base_dir: PathBuf,
}

impl ClusterConfig {
    /// Reads, parses and validates `path`.
    pub fn load(path: &Path) -> Result<ClusterConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read { path: path.into(), err })?;
        let mut cfg = Self::parse(&text).map_err(|message| ConfigError::Parse {
            path: path.into(),
            message,
        })?;
        cfg.base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        if cfg.base_dir.as_os_str().is_empty() {
            cfg.base_dir = PathBuf::from(".");
        }
        cfg.validate().map_err(|message| ConfigError::Invalid {
            path: path.into(),
            message,
        })?;
        Ok(cfg)
    }

    /// Parses TOML text (no validation).
    pub fn parse(text: &str) -> Result<ClusterConfig, String> {
        toml::from_str(text).map_err(|e| e.to_string().trim().replace('\n', " "))
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("config serializes")
    }

    /// Checks the semantic rules.
    pub fn validate(&self) -> Result<(), String> {
        if self.nodes.len() < 2 {
            return Err("at least two [[node]] entries are needed for mirroring".into());
        }
        if self.nodes.len() > 1024 {
            return Err("at most 1024 nodes are supported".into());
        }
        let c = &self.cluster;
        if c.heartbeat_interval_ms == 0 || c.heartbeat_timeout_ms < 2 * c.heartbeat_interval_ms {
            return Err("heartbeat_timeout_ms must be at least twice heartbeat_interval_ms (> 0)".into());
        }
        if c.request_timeout_ms == 0 {
            return Err("request_timeout_ms must be > 0".into());
        }
        if !(2..=64).contains(&c.heartbeat_min_peers) {
            return Err(format!(
                "heartbeat_min_peers must be 2 to 64, not {}",
                c.heartbeat_min_peers
            ));
        }
        if !(3..=7).contains(&c.metadata_voters) || c.metadata_voters.is_multiple_of(2) {
            return Err(format!("metadata_voters must be 3, 5 or 7, not {}", c.metadata_voters));
        }
        if c.voter_replace_after_ms < c.heartbeat_timeout_ms {
            return Err(format!(
                "voter_replace_after_ms ({}) must be at least heartbeat_timeout_ms ({})",
                c.voter_replace_after_ms, c.heartbeat_timeout_ms
            ));
        }
        if !(16..=65536).contains(&c.max_connections) {
            return Err(format!(
                "max_connections must be 16 to 65536, not {}",
                c.max_connections
            ));
        }
        if !(50..=3_600_000).contains(&c.connection_idle_ms) {
            return Err(format!(
                "connection_idle_ms must be 50 to 3600000, not {}",
                c.connection_idle_ms
            ));
        }
        let mut names = HashSet::new();
        let mut addrs = HashSet::new();
        for n in self.all() {
            if n.name.is_empty() || n.name.len() > 63 || !n.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            {
                return Err(format!("node name {:?} must be 1..63 letters, digits or '-'", n.name));
            }
            if !names.insert(n.name.clone()) {
                return Err(format!("node name {:?} appears twice", n.name));
            }
            if !addrs.insert(n.addr) {
                return Err(format!("address {} appears twice", n.addr));
            }
            let Some(link) = n.link() else {
                return Err(format!(
                    "node {}: addr's port is too high for the default link_addr (port + {}); give link_addr",
                    n.name,
                    NodeEntry::DEFAULT_LINK_OFFSET
                ));
            };
            if !addrs.insert(link) {
                return Err(format!("address {link} (node {}'s link) appears twice", n.name));
            }
            // The other nodes reach both: one on loopback and one not is a half-edited config
            // (`cluster init` writes loopback addresses for both).
            if link.ip().is_loopback() != n.addr.ip().is_loopback() {
                return Err(format!(
                    "node {}: addr {} and link_addr {link} must both be loopback or both not (set link_addr to the node's address too)",
                    n.name, n.addr
                ));
            }
            if n.memory_mb == 0 {
                return Err(format!("node {}: memory_mb must be > 0", n.name));
            }
            if let Some(m) = n.metrics_addr {
                if !addrs.insert(m) {
                    return Err(format!("address {m} (node {}'s metrics) appears twice", n.name));
                }
            }
            if n.domain
                .as_ref()
                .is_some_and(|d| d.is_empty() || d.len() > 255 || d.contains(|c: char| c.is_whitespace()))
            {
                return Err(format!("node {}: domain must be 1..255 bytes, without spaces", n.name));
            }
            if n.host
                .as_ref()
                .is_some_and(|h| h.is_empty() || h.len() > 255 || h.contains(|c: char| c.is_whitespace() || c == ','))
            {
                return Err(format!(
                    "node {}: host must be 1..255 bytes, without spaces or commas",
                    n.name
                ));
            }
        }
        Ok(())
    }

    /// Nodes then spares.
    pub fn all(&self) -> impl Iterator<Item = &NodeEntry> {
        self.nodes.iter().chain(self.spares.iter())
    }

    pub fn entry(&self, name: &str) -> Option<&NodeEntry> {
        self.all().find(|n| n.name == name)
    }

    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }

    pub fn data_dir(&self, n: &NodeEntry) -> PathBuf {
        self.resolve(&n.data_dir)
    }
    pub fn socket_path(&self, n: &NodeEntry) -> PathBuf {
        self.resolve(&n.socket)
    }
    pub fn cert_dir(&self) -> PathBuf {
        self.resolve(&self.cluster.cert_dir)
    }

    /// The default local cluster: `nodes` daemons and `spares` spares on loopback, on the
    /// `3 × (nodes + spares)` ports from `base_port`: first every node's `addr`, then every
    /// node's `link_addr`, then every node's `metrics_addr`.
    pub fn local(nodes: u32, spares: u32, memory_mb: u64, base_port: u16) -> ClusterConfig {
        let total = nodes + spares;
        let entry = |name: String, i: u32| NodeEntry {
            addr: SocketAddr::from(([127, 0, 0, 1], base_port.wrapping_add(i as u16))),
            link_addr: Some(SocketAddr::from((
                [127, 0, 0, 1],
                base_port.wrapping_add((total + i) as u16),
            ))),
            data_dir: PathBuf::from("data").join(&name),
            socket: PathBuf::from("run").join(format!("{name}.sock")),
            memory_mb,
            host: None,
            domain: None,
            metrics_addr: Some(SocketAddr::from((
                [127, 0, 0, 1],
                base_port.wrapping_add((2 * total + i) as u16),
            ))),
            name,
        };
        ClusterConfig {
            cluster: ClusterSection::default(),
            nodes: (0..nodes).map(|i| entry(format!("n{i}"), i)).collect(),
            spares: (0..spares).map(|i| entry(format!("s{i}"), nodes + i)).collect(),
            base_dir: PathBuf::from("."),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_roundtrip_and_validation() {
        let c = ClusterConfig::local(4, 1, 512, 7400);
        c.validate().unwrap();
        let mut back = ClusterConfig::parse(&c.to_toml()).unwrap();
        back.base_dir = c.base_dir.clone();
        assert_eq!(back, c);
        assert_eq!(c.spares[0].addr.port(), 7404);
        assert_eq!(c.nodes[1].link(), Some("127.0.0.1:7406".parse().unwrap()));
    }

    #[test]
    fn link_addresses_default_and_must_not_collide() {
        let mut c = ClusterConfig::local(2, 0, 512, 7400);
        for n in &mut c.nodes {
            n.link_addr = None;
        }
        c.validate().unwrap();
        assert_eq!(c.nodes[0].link(), Some("127.0.0.1:7500".parse().unwrap()));
        // A link on another node's address is refused.
        c.nodes[0].link_addr = Some(c.nodes[1].addr);
        assert!(c.validate().unwrap_err().contains("twice"), "{:?}", c.validate());
        // No default above port 65435.
        c.nodes[0].link_addr = None;
        c.nodes[0].addr = "127.0.0.1:65500".parse().unwrap();
        assert!(c.validate().unwrap_err().contains("link_addr"));
    }

    #[test]
    fn unknown_keys_and_bad_values_are_rejected() {
        let c = ClusterConfig::local(2, 0, 512, 7400);
        let t = c.to_toml().replace("[cluster]", "[cluster]\nbogus = 1");
        let e = ClusterConfig::parse(&t).unwrap_err();
        assert!(e.contains("bogus"), "{e}");
        let t = c.to_toml().replace("memory_mb = 512", "memory_mb = \"lots\"");
        assert!(ClusterConfig::parse(&t).is_err());
        let mut d = c.clone();
        d.nodes[1].name = "n0".into();
        assert!(d.validate().unwrap_err().contains("twice"));
        let mut d = c.clone();
        d.nodes.pop();
        assert!(d.validate().is_err());
        let mut d = c.clone();
        d.cluster.heartbeat_timeout_ms = 100;
        assert!(d.validate().is_err());
        let mut d = c.clone();
        d.cluster.connection_idle_ms = 10;
        assert!(d
            .validate()
            .unwrap_err()
            .contains("connection_idle_ms must be 50 to 3600000"));
        for (n, ok) in [(15, false), (16, true), (65536, true), (65537, false)] {
            let mut d = c.clone();
            d.cluster.max_connections = n;
            match d.validate() {
                Ok(()) => assert!(ok, "{n} connections accepted"),
                Err(e) => assert!(!ok && e.contains("max_connections must be 16 to 65536"), "{n}: {e}"),
            }
        }
    }

    #[test]
    fn load_reports_path() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        let e = ClusterConfig::load(&p).unwrap_err().to_string();
        assert!(e.contains("c.toml"), "{e}");
        std::fs::write(&p, "[[node]]\nname=1").unwrap();
        assert!(ClusterConfig::load(&p).is_err());
    }
}
