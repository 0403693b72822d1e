//! Failure detection at a bounded cost per node, as pure machines (no clock, no I/O): who
//! heartbeats whom ([`Topology`]), and when the silences nodes report become a verdict the
//! metadata leader proposes ([`Tally`]).
//!
//! - **Watching.** Each node heartbeats a bounded set of peers: its ring neighbours, peers at
//!   halving distances around the ring (N/2, N/4, …, so a few are far away and likely in other
//!   failure domains) until a minimum (Ceph's `osd_heartbeat_min_peers`), and at least
//!   one peer in another failure domain when there is one. The relation is symmetric (a node
//!   watches whoever watches it), so a node's degree stays near the minimum whatever the size
//!   of the cluster.
//! - **Reporting.** A node whose watched peer is silent past the failure timeout reports it to
//!   the metadata leader (again each heartbeat interval while the silence lasts, so a new leader
//!   hears it too) and takes the report back when it hears the peer again.
//! - **Deciding** ([`Tally::confirmed`]): the leader proposes a verdict on a peer only on reports
//!   from two distinct reporters in different failure domains (from any two when the cluster
//!   has a single domain; a reporter that finds most of its peers silent is not counted: it
//!   more likely hears nothing itself), or on its own observation: a peer it watches, or one it started to
//!   probe on a first report, silent to it past the timeout (Ceph's `mon_osd_min_down_reporters`
//!   with the monitor's own probe). A node cut off from everyone is reported by all its
//!   watchers, so it is declared about one timeout after its silence began.
//!
//! Invariant: one reporter alone never makes a verdict; a report is for one incarnation and
//! lapses when not renewed ([`Tally::REPORT_TTL_INTERVALS`] intervals).

use std::collections::{BTreeMap, BTreeSet};

/// Ceph's `osd_heartbeat_min_peers`: how many peers a node watches at least (all of them in a
/// smaller cluster).
pub const DEFAULT_MIN_PEERS: usize = 10;

/// Who watches whom (names are physical node names, in the cluster's configured order, which
/// is the ring's).
#[derive(Clone, Debug)]
pub struct Topology {
    names: Vec<String>,
    domains: Vec<String>,
    index: BTreeMap<String, usize>,
    /// Per node, the peers it watches (sorted, symmetric).
    peers: Vec<Vec<usize>>,
}

impl Topology {
    /// The topology of `members` (name, failure domain), each watching at least `min_peers`
    /// peers (every other node when there are no more). A name given twice counts once.
    pub fn new(members: impl IntoIterator<Item = (String, String)>, min_peers: usize) -> Topology {
        let mut names = Vec::new();
        let mut domains = Vec::new();
        let mut index = BTreeMap::new();
        for (name, domain) in members {
            if index.contains_key(&name) {
                continue;
            }
            index.insert(name.clone(), names.len());
            names.push(name);
            domains.push(domain);
        }
        let n = names.len();
        let min_peers = min_peers.max(2);
        let mut chosen: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); n];
        if n <= min_peers + 1 {
            for (i, c) in chosen.iter_mut().enumerate() {
                c.extend((0..n).filter(|&j| j != i));
            }
        } else {
            // The same distances for every node, far ones first, until the minimum: the ring
            // part is symmetric by itself, and its degree does not grow with the cluster.
            let mut distances = vec![1];
            let mut d = n / 2;
            while d >= 2 && ring_degree(n, &distances) < min_peers {
                distances.push(d);
                d /= 2;
            }
            let mut next = 2;
            loop {
                let degree = ring_degree(n, &distances);
                if degree >= min_peers || next > n / 2 {
                    break;
                }
                if !distances.contains(&next) {
                    distances.push(next);
                }
                next += 1;
            }
            for (i, c) in chosen.iter_mut().enumerate() {
                for &d in &distances {
                    c.insert((i + d) % n);
                    c.insert((i + n - d) % n);
                }
                c.remove(&i);
            }
            // At least one peer in another failure domain: the one of another domain nearest
            // to the opposite side of the ring (which spreads them over that domain).
            for i in 0..n {
                if chosen[i].iter().any(|&j| domains[j] != domains[i]) {
                    continue;
                }
                let far = (0..n).map(|k| (i + n / 2 + k) % n).find(|&j| domains[j] != domains[i]);
                if let Some(j) = far {
                    chosen[i].insert(j);
                }
            }
        }
        // Symmetric: a node also watches whoever watches it.
        let mut peers: Vec<BTreeSet<usize>> = chosen.clone();
        for (i, c) in chosen.iter().enumerate() {
            for &j in c {
                peers[j].insert(i);
            }
        }
        Topology {
            names,
            domains,
            index,
            peers: peers.into_iter().map(|s| s.into_iter().collect()).collect(),
        }
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The peers `name` watches (none for a name not in the cluster).
    pub fn peers_of(&self, name: &str) -> Vec<&str> {
        self.index
            .get(name)
            .map(|&i| self.peers[i].iter().map(|&j| self.names[j].as_str()).collect())
            .unwrap_or_default()
    }

    /// Whether `a` watches `b` (and so `b` watches `a`).
    pub fn watches(&self, a: &str, b: &str) -> bool {
        match (self.index.get(a), self.index.get(b)) {
            (Some(&i), Some(&j)) => self.peers[i].binary_search(&j).is_ok(),
            _ => false,
        }
    }

    /// `name`'s failure domain.
    pub fn domain(&self, name: &str) -> Option<&str> {
        self.index.get(name).map(|&i| self.domains[i].as_str())
    }

    /// How many failure domains the cluster spans.
    pub fn domain_count(&self) -> usize {
        self.domains.iter().collect::<BTreeSet<_>>().len()
    }

    /// The most peers any node watches.
    pub fn max_degree(&self) -> usize {
        self.peers.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// How many distinct peers the distances `ds` give a node of a ring of `n`.
fn ring_degree(n: usize, ds: &[usize]) -> usize {
    let mut s = BTreeSet::new();
    for &d in ds {
        s.insert(d % n);
        s.insert((n - d % n) % n);
    }
    s.remove(&0);
    s.len()
}

/// What the leader knows of one reported peer.
#[derive(Clone, Debug, Default)]
struct Suspicion {
    /// The incarnation the reports are about.
    incarnation: u64,
    /// Reporter → when it last reported.
    reporters: BTreeMap<String, u64>,
}

/// The metadata leader's tally of silences its nodes report (see the module doc).
#[derive(Clone, Debug)]
pub struct Tally {
    me: String,
    interval_ms: u64,
    timeout_ms: u64,
    suspicions: BTreeMap<String, Suspicion>,
    /// When the leader itself last heard each reported peer, and at which incarnation.
    heard: BTreeMap<String, (u64, u64)>,
}

impl Tally {
    /// A report lapses when not renewed within this many heartbeat intervals.
    pub const REPORT_TTL_INTERVALS: u64 = 3;

    /// The tally of leader `me`; reporters renew their reports every `interval_ms`; the
    /// failure timeout is `timeout_ms`.
    pub fn new(me: impl Into<String>, interval_ms: u64, timeout_ms: u64) -> Tally {
        Tally {
            me: me.into(),
            interval_ms: interval_ms.max(1),
            timeout_ms,
            suspicions: BTreeMap::new(),
            heard: BTreeMap::new(),
        }
    }

    fn ttl_ms(&self) -> u64 {
        Self::REPORT_TTL_INTERVALS * self.interval_ms
    }

    /// `reporter` found `target`'s incarnation `incarnation` silent past the timeout. A
    /// report on an older incarnation than one already reported is ignored; a newer one
    /// starts the tally again. A node never reports itself.
    pub fn handle_report(&mut self, now_ms: u64, reporter: &str, target: &str, incarnation: u64) {
        if reporter == target || incarnation == 0 {
            return;
        }
        let s = self.suspicions.entry(target.to_string()).or_default();
        if incarnation < s.incarnation {
            return;
        }
        if incarnation > s.incarnation {
            *s = Suspicion {
                incarnation,
                reporters: BTreeMap::new(),
            };
        }
        s.reporters.insert(reporter.to_string(), now_ms);
    }

    /// `reporter` heard `target` again.
    pub fn handle_retract(&mut self, reporter: &str, target: &str) {
        if let Some(s) = self.suspicions.get_mut(target) {
            s.reporters.remove(reporter);
            if s.reporters.is_empty() {
                self.suspicions.remove(target);
            }
        }
    }

    /// The leader heard `target` at `incarnation` (its probe answered, or a message came):
    /// no verdict on that incarnation while that is less than a failure timeout ago, whoever
    /// reports it; a report on an earlier incarnation is history.
    pub fn handle_heard(&mut self, now_ms: u64, target: &str, incarnation: u64) {
        if self.suspicions.get(target).is_some_and(|s| s.incarnation < incarnation) {
            self.suspicions.remove(target);
        }
        if self.suspicions.contains_key(target) {
            self.heard.insert(target.to_string(), (now_ms, incarnation));
        }
    }

    /// Drops reports not renewed in time.
    pub fn tick(&mut self, now_ms: u64) {
        let ttl = self.ttl_ms();
        self.suspicions.retain(|_, s| {
            s.reporters.retain(|_, at| now_ms.saturating_sub(*at) <= ttl);
            !s.reporters.is_empty()
        });
        let (timeout, suspicions) = (self.timeout_ms, &self.suspicions);
        self.heard
            .retain(|t, (at, _)| suspicions.contains_key(t) && now_ms.saturating_sub(*at) <= timeout);
    }

    /// The reported peers the leader should watch itself (its probe): those reported by
    /// someone and not in `watched` already.
    pub fn probes<'a>(&'a self, watched: &'a BTreeSet<String>) -> impl Iterator<Item = &'a str> + 'a {
        self.suspicions
            .keys()
            .filter(move |t| !watched.contains(*t) && **t != self.me)
            .map(String::as_str)
    }

    /// The peers a verdict may be proposed on at `now_ms`, with the incarnation reported:
    /// reported by two credible reporters in different failure domains of `topology` (any two
    /// when it has one domain) and not heard by the leader within the failure timeout, or by
    /// the leader itself (its own observation or probe; `Tally::handle_report` with the leader
    /// as the reporter).
    pub fn confirmed(&self, topology: &Topology, now_ms: u64) -> Vec<(String, u64)> {
        let single_domain = topology.domain_count() <= 1;
        // A reporter that finds most of its watched peers silent more likely hears nothing
        // itself (its incoming messages lost, or it stalled): its reports do not count — the
        // leader's own neither (a node just back from hearing nothing may be elected).
        let mut reports: BTreeMap<&str, usize> = BTreeMap::new();
        for s in self.suspicions.values() {
            for r in s.reporters.keys() {
                *reports.entry(r.as_str()).or_default() += 1;
            }
        }
        let credible = |r: &str| reports.get(r).copied().unwrap_or(0) * 2 <= topology.peers_of(r).len();
        let mut out = Vec::new();
        for (target, s) in &self.suspicions {
            let own = s.reporters.contains_key(&self.me) && credible(&self.me);
            let counted: Vec<&str> = s.reporters.keys().map(String::as_str).filter(|r| credible(r)).collect();
            let domains: BTreeSet<Option<&str>> = counted.iter().map(|r| topology.domain(r)).collect();
            let heard = self
                .heard
                .get(target)
                .is_some_and(|&(at, inc)| inc >= s.incarnation && now_ms.saturating_sub(at) <= self.timeout_ms);
            let two = counted.len() >= 2 && (single_domain || domains.len() >= 2) && !heard;
            if own || two {
                out.push((target.clone(), s.incarnation));
            }
        }
        out
    }

    /// How many reporters `target` has now (for the log and the metrics).
    pub fn reporters(&self, target: &str) -> usize {
        self.suspicions.get(target).map_or(0, |s| s.reporters.len())
    }

    /// Who reported `target` (for the log).
    pub fn reporters_of(&self, target: &str) -> Vec<&str> {
        self.suspicions
            .get(target)
            .map(|s| s.reporters.keys().map(String::as_str).collect())
            .unwrap_or_default()
    }
}

/// What a node's failure-detection duties ask of its shell ([`Duties::handle_tick`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Duty {
    /// Tell the metadata leader `leader` (another node) these silences `(peer, incarnation
    /// heard)` and these peers heard again (the daemon's `Watch` request).
    Report {
        leader: String,
        silent: Vec<(String, u64)>,
        back: Vec<String>,
    },
    /// Commit a verdict: `peer`'s incarnation `incarnation` is down; `reporters` for the log.
    /// Its end (committed or not) goes to [`crate::verdicts::Verdicts::handle_declared`].
    Declare {
        peer: String,
        incarnation: u64,
        reporters: Vec<String>,
    },
}

/// One node's failure-detection duties, every heartbeat interval, as the daemon and the
/// simulators run them (one copy):
/// - as a watcher: its watched peers silent past the failure timeout (not declared already)
///   are reported to the metadata leader, again every interval while the silence lasts, and
///   taken back once heard again;
/// - as the leader holding its lease: the tally of everyone's reports (its own among them),
///   probes of reported peers it does not watch ([`Duties::probes`]), and a verdict on every
///   peer the tally confirms or whose disk failed, at the incarnation reported. Its probes and
///   tally end with its leadership.
///
/// Invariant: only a leading node's tally holds reports, and a verdict is asked only while
/// leading.
#[derive(Clone, Debug)]
pub struct Duties {
    me: String,
    interval_ms: u64,
    timeout_ms: u64,
    tally: Tally,
    /// Whether this node led (with its lease) at its last tick.
    leading: bool,
    /// The watched peers this node reported silent (to the leader, or its own tally).
    reported: BTreeSet<String>,
    /// Each node's committed start as this node first saw it: (incarnation, when in ms; 0 for
    /// one found at start-up).
    boot_seen: BTreeMap<String, (u64, u64)>,
}

impl Duties {
    /// The duties of node `me`, which heartbeats every `interval_ms`, with failure timeout
    /// `timeout_ms`.
    pub fn new(me: impl Into<String>, interval_ms: u64, timeout_ms: u64) -> Duties {
        let me = me.into();
        Duties {
            tally: Tally::new(me.clone(), interval_ms, timeout_ms),
            me,
            interval_ms,
            timeout_ms,
            leading: false,
            reported: BTreeSet::new(),
            boot_seen: BTreeMap::new(),
        }
    }

    /// Whether this node led at its last tick.
    pub fn is_leading(&self) -> bool {
        self.leading
    }

    /// The leader's tally (empty while not leading).
    pub fn tally(&self) -> &Tally {
        &self.tally
    }

    /// The reported peers this node, leading, probes beyond those it watches (`own`).
    pub fn probes(&self, own: &BTreeSet<String>) -> BTreeSet<String> {
        if !self.leading {
            return BTreeSet::new();
        }
        self.tally.probes(own).map(String::from).collect()
    }

    /// The records' starts of every node `(node, incarnation)`, at `now_ms` (every install
    /// of the metadata). The first ones are taken as seen long ago.
    pub fn handle_boots<'a>(&mut self, now_ms: u64, up_from: impl IntoIterator<Item = (&'a String, &'a u64)>) {
        let first = self.boot_seen.is_empty();
        for (p, &inc) in up_from {
            if self.boot_seen.get(p).is_none_or(|&(i, _)| i != inc) {
                self.boot_seen.insert(p.clone(), (inc, if first { 0 } else { now_ms }));
            }
        }
    }

    /// This node heard `peer` at `incarnation` (a heartbeat taken).
    pub fn handle_heard(&mut self, now_ms: u64, peer: &str, incarnation: u64) {
        if self.leading {
            self.tally.handle_heard(now_ms, peer, incarnation);
        }
    }

    /// `from`'s reports of silences and of peers heard again, taken while this node leads
    /// with its lease (`leading`, as at a tick); the verdicts they confirm are asked at once.
    /// `known`: whether a name is a node of the cluster (others are dropped).
    #[allow(clippy::too_many_arguments)]
    pub fn handle_reports(
        &mut self,
        now_ms: u64,
        from: &str,
        silent: Vec<(String, u64)>,
        back: Vec<String>,
        leading: bool,
        known: impl Fn(&str) -> bool,
        topology: &Topology,
        verdicts: &mut crate::verdicts::Verdicts,
    ) -> Vec<Duty> {
        self.set_leading(leading);
        if !leading {
            return Vec::new();
        }
        for (p, inc) in silent {
            if !known(&p) || p == self.me {
                continue;
            }
            let inc = self.report_incarnation(&p, inc, now_ms);
            self.tally.handle_report(now_ms, from, &p, inc);
        }
        for p in back {
            self.tally.handle_retract(from, &p);
        }
        self.declarations(now_ms, Vec::new(), topology, verdicts)
    }

    /// A leadership that ends ends its tally (and its probes); one that starts starts afresh.
    fn set_leading(&mut self, leading: bool) {
        if self.leading != leading {
            self.tally = Tally::new(self.me.clone(), self.interval_ms, self.timeout_ms);
        }
        self.leading = leading;
    }

    /// The verdicts the leader asks now: on every peer its tally confirms, and on every peer
    /// whose disk failed.
    fn declarations(
        &mut self,
        now_ms: u64,
        disk_failed: Vec<(String, u64)>,
        topology: &Topology,
        verdicts: &mut crate::verdicts::Verdicts,
    ) -> Vec<Duty> {
        self.tally.tick(now_ms);
        let suspects = self.tally.confirmed(topology, now_ms).into_iter().chain(disk_failed);
        let mut out = Vec::new();
        for (peer, incarnation) in verdicts.poll_declarations(true, suspects) {
            let reporters = self.tally.reporters_of(&peer).into_iter().map(String::from).collect();
            out.push(Duty::Declare {
                peer,
                incarnation,
                reporters,
            });
        }
        out
    }

    /// The incarnation a report made now on `target` is about: the one the reporter heard,
    /// or the one committed as its start if that was committed more than a failure timeout
    /// ago (the reporter heard nothing for a timeout: not that one either).
    fn report_incarnation(&self, target: &str, heard: u64, now_ms: u64) -> u64 {
        match self.boot_seen.get(target) {
            Some(&(inc, at)) if inc > heard && now_ms >= at + self.timeout_ms => inc,
            _ => heard,
        }
    }

    /// Every heartbeat interval. `silent`: the watched peers the detector finds silent past
    /// the timeout and not declared, with the incarnation heard; `leading`: this node leads
    /// the metadata with its lease (and is not fencing); `leader`: the leader as this node
    /// knows it; `disk_failed`: peers whose heartbeats say their disk failed, with the
    /// incarnation heard. The verdicts asked are registered in `verdicts` (one at a time per
    /// peer).
    #[allow(clippy::too_many_arguments)]
    pub fn handle_tick(
        &mut self,
        now_ms: u64,
        silent: Vec<(String, u64)>,
        leading: bool,
        leader: Option<&str>,
        disk_failed: Vec<(String, u64)>,
        topology: &Topology,
        verdicts: &mut crate::verdicts::Verdicts,
    ) -> Vec<Duty> {
        let now_silent: BTreeSet<String> = silent.iter().map(|(p, _)| p.clone()).collect();
        let back: Vec<String> = self.reported.difference(&now_silent).cloned().collect();
        self.reported = now_silent;
        self.set_leading(leading);
        if !leading {
            if let Some(l) = leader.filter(|l| *l != self.me) {
                if !silent.is_empty() || !back.is_empty() {
                    return vec![Duty::Report {
                        leader: l.to_string(),
                        silent,
                        back,
                    }];
                }
            }
            return Vec::new();
        }
        for (p, inc) in &silent {
            let inc = self.report_incarnation(p, *inc, now_ms);
            self.tally.handle_report(now_ms, &self.me, p, inc);
        }
        for p in &back {
            self.tally.handle_retract(&self.me, p);
        }
        self.declarations(now_ms, disk_failed, topology, verdicts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(n: usize, domain: impl Fn(usize) -> String, min: usize) -> Topology {
        Topology::new((0..n).map(|i| (format!("n{i}"), domain(i))), min)
    }

    #[test]
    fn a_small_cluster_watches_everyone_and_a_large_one_a_bounded_symmetric_set() {
        let t = topo(8, |i| format!("h{i}"), 10);
        assert_eq!(t.peers_of("n3").len(), 7);
        assert!(!t.peers_of("n3").contains(&"n3"));
        for n in [12, 16, 64, 128, 1000, 1024] {
            let t = topo(n, |i| format!("h{i}"), DEFAULT_MIN_PEERS);
            for i in 0..n {
                let me = format!("n{i}");
                let peers = t.peers_of(&me);
                assert!(peers.len() >= DEFAULT_MIN_PEERS, "n={n} {me}: {peers:?}");
                assert!(!peers.contains(&me.as_str()));
                let (left, right) = (format!("n{}", (i + n - 1) % n), format!("n{}", (i + 1) % n));
                assert!(t.watches(&me, &left) && t.watches(&me, &right), "ring neighbours");
                for p in peers {
                    assert!(t.watches(p, &me), "symmetric: n={n} {me} {p}");
                }
            }
            assert!(t.max_degree() <= DEFAULT_MIN_PEERS + 1, "n={n}: {}", t.max_degree());
        }
    }

    #[test]
    fn every_node_watches_another_domain_and_the_degree_stays_bounded_with_racks() {
        // Racks of 40 consecutive nodes, and racks striped over the ring.
        for (n, rack) in [(1024, 40), (128, 16), (64, 32)] {
            for striped in [false, true] {
                let domain = |i: usize| {
                    let r = if striped { i % (n / rack) } else { i / rack };
                    format!("r{r}")
                };
                let t = topo(n, domain, DEFAULT_MIN_PEERS);
                for i in 0..n {
                    let me = format!("n{i}");
                    let mine = t.domain(&me).map(str::to_string);
                    assert!(
                        t.peers_of(&me).iter().any(|p| t.domain(p).map(str::to_string) != mine),
                        "n={n} rack={rack} striped={striped}: {me} watches no other rack"
                    );
                }
                assert!(t.max_degree() <= 3 * DEFAULT_MIN_PEERS, "{}", t.max_degree());
            }
        }
        // One domain: nothing to add.
        let t = topo(64, |_| "all".into(), DEFAULT_MIN_PEERS);
        assert_eq!(t.domain_count(), 1);
        assert!(t.max_degree() <= DEFAULT_MIN_PEERS + 1);
    }

    #[test]
    fn one_reporter_is_not_a_verdict_two_in_different_domains_or_the_leaders_own_are() {
        let t = Topology::new(
            [("a", "r1"), ("b", "r1"), ("c", "r2"), ("d", "r2"), ("e", "r3")].map(|(n, d)| (n.into(), d.into())),
            10,
        );
        let mut y = Tally::new("e", 100, 1000);
        y.handle_report(0, "a", "d", 5);
        assert!(y.confirmed(&t, 0).is_empty(), "one reporter");
        y.handle_report(10, "a", "d", 5);
        assert!(y.confirmed(&t, 0).is_empty(), "the same reporter again");
        y.handle_report(20, "b", "d", 5);
        assert!(y.confirmed(&t, 0).is_empty(), "two reporters of one domain");
        let watched = BTreeSet::from(["a".to_string()]);
        assert_eq!(y.probes(&watched).collect::<Vec<_>>(), vec!["d"], "the leader probes d");
        y.handle_report(30, "c", "d", 5);
        assert_eq!(y.confirmed(&t, 0), vec![("d".to_string(), 5)]);
        // A newer incarnation starts again; an older one is ignored.
        y.handle_report(40, "a", "d", 6);
        assert!(y.confirmed(&t, 0).is_empty());
        y.handle_report(50, "c", "d", 5);
        assert_eq!(y.reporters("d"), 1);
        // The leader's own observation is enough.
        y.handle_report(60, "e", "d", 6);
        assert_eq!(y.confirmed(&t, 60), vec![("d".to_string(), 6)]);
        // The leader hears it (and takes its own report back): two reporters confirm nothing
        // until a failure timeout after the leader last heard it.
        y.handle_retract("e", "d");
        y.handle_report(70, "c", "d", 6);
        y.handle_heard(80, "d", 6);
        assert!(y.confirmed(&t, 90).is_empty());
        assert!(y.confirmed(&t, 1080).is_empty());
        assert_eq!(y.confirmed(&t, 1081), vec![("d".to_string(), 6)]);
        // A newer incarnation heard: the reports on the old one are history.
        y.handle_heard(1100, "d", 7);
        assert_eq!(y.reporters("d"), 0);
        assert!(y.confirmed(&t, 1100).is_empty());
    }

    /// A reporter that finds most of its peers silent, the leader included, hears nothing
    /// itself more likely than they all failed: its reports do not count.
    #[test]
    fn a_reporter_of_most_of_its_peers_is_not_counted() {
        let t = topo(16, |i| format!("h{i}"), 10);
        let mut y = Tally::new("n0", 100, 1000);
        let deaf = "n5";
        for p in t.peers_of(deaf) {
            y.handle_report(0, deaf, p, 1);
        }
        y.handle_report(0, "n9", "n4", 1);
        assert!(y.confirmed(&t, 0).is_empty(), "{:?}", y.confirmed(&t, 0));
        // The leader, just back from hearing nothing, neither.
        let mut y = Tally::new("n0", 100, 1000);
        for p in t.peers_of("n0") {
            y.handle_report(0, "n0", p, 1);
        }
        assert!(y.confirmed(&t, 0).is_empty());
        // One silent peer of the leader's is its own observation.
        let mut y = Tally::new("n0", 100, 1000);
        y.handle_report(0, "n0", "n1", 1);
        assert_eq!(y.confirmed(&t, 0), vec![("n1".to_string(), 1)]);
    }

    #[test]
    fn reports_lapse_unless_renewed_and_are_taken_back() {
        let t = topo(4, |_| "one".into(), 10);
        let mut y = Tally::new("n0", 100, 1000);
        y.handle_report(0, "n1", "n3", 1);
        y.handle_report(250, "n2", "n3", 1);
        assert_eq!(y.confirmed(&t, 0).len(), 1, "two reporters of the only domain");
        y.tick(301);
        assert_eq!(y.reporters("n3"), 1, "n1's report lapsed");
        assert!(y.confirmed(&t, 0).is_empty());
        y.handle_report(320, "n1", "n3", 1);
        y.handle_retract("n2", "n3");
        assert!(y.confirmed(&t, 0).is_empty());
        y.handle_retract("n1", "n3");
        assert_eq!(y.reporters("n3"), 0);
        y.handle_report(400, "n3", "n3", 1);
        assert_eq!(y.reporters("n3"), 0, "nobody reports itself");
    }
}
