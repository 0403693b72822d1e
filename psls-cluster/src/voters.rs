//! Which nodes are the metadata log's voters: a few (the configured count, odd), spread over
//! failure domains; and, at the leader, the change that replaces voters lost for good with
//! followers, or brings a cluster whose every node votes (a store written before voters
//! changed) down to that few.
//!
//! Pure functions over the nodes as the leader sees them ([`Candidate`]): the shell gathers the
//! facts (verdicts, domains), [`plan`] decides, [`crate::log::Log::propose_voters`] carries it
//! out as one raft `ConfChangeV2`.
//!
//! Invariant: a planned configuration keeps the leader, adds only usable nodes, and has a
//! usable majority, so the joint configuration it passes through can commit.

/// Fewest voters a cluster may be configured with.
pub const MIN_VOTERS: usize = 3;
/// Most voters a cluster may be configured with.
pub const MAX_VOTERS: usize = 7;
/// Voters when the configuration says nothing (etcd's and Ceph's monitors' usual count).
pub const DEFAULT_VOTERS: usize = 5;

/// How many voters a cluster of `nodes` has with `max` configured: at most both, and odd (an
/// even count tolerates no more failures than the odd one below it, and costs a voter more).
pub fn target(max: usize, nodes: usize) -> usize {
    let n = max.min(nodes).max(1);
    if n.is_multiple_of(2) {
        n - 1
    } else {
        n
    }
}

/// One node as the leader sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate<'a> {
    pub id: u32,
    /// Its failure domain (a rack; by default its host).
    pub domain: &'a str,
    /// Up, not fencing, its disk working: it may be made a voter, and counts toward a usable
    /// majority.
    pub usable: bool,
    /// Lost for good (declared down past the replacement time, or replaced by a spare): a voter
    /// that is, is replaced.
    pub gone: bool,
}

/// Picks `count` more of `from` (in order of preference) after `chosen`: each time the first
/// whose domain holds the fewest of the chosen.
fn spread(chosen: &mut Vec<u32>, from: &[&Candidate<'_>], count: usize, all: &[Candidate<'_>]) {
    let domain_of = |id: u32| all.iter().find(|c| c.id == id).map_or("", |c| c.domain);
    let mut left: Vec<&Candidate<'_>> = from.iter().copied().filter(|c| !chosen.contains(&c.id)).collect();
    for _ in 0..count {
        let best = left
            .iter()
            .enumerate()
            .min_by_key(|(i, c)| (chosen.iter().filter(|v| domain_of(**v) == c.domain).count(), *i))
            .map(|(i, _)| i);
        let Some(i) = best else { break };
        chosen.push(left.remove(i).id);
    }
}

/// The first voters of a new cluster of the nodes `all` (in config order): [`target`] of them,
/// spread over the domains, the lowest-numbered first.
pub fn initial(all: &[Candidate<'_>], max: usize) -> Vec<u32> {
    let mut chosen = Vec::new();
    let from: Vec<&Candidate<'_>> = all.iter().collect();
    spread(&mut chosen, &from, target(max, all.len()), all);
    chosen.sort_unstable();
    chosen
}

/// The voters the leader should propose now instead of `current`, if any: voters lost for good
/// replaced by usable followers (other domains first), and a configuration larger than
/// [`target`] cut down to it (the leader kept, usable voters before others). `None` when
/// nothing should change, or when no change could commit (a usable majority of the new
/// voters is needed).
pub fn plan(current: &[u32], leader: u32, max: usize, all: &[Candidate<'_>]) -> Option<Vec<u32>> {
    let want = target(max, all.len());
    let find = |id: u32| all.iter().find(|c| c.id == id);
    // Voters still worth keeping: configured, not lost for good.
    let keep: Vec<&Candidate<'_>> = current
        .iter()
        .filter_map(|v| find(*v))
        .filter(|c| !c.gone || c.id == leader)
        .collect();
    let mut chosen: Vec<u32> = Vec::new();
    if find(leader).is_some() {
        chosen.push(leader);
    }
    // The kept voters, usable ones first.
    let mut ranked: Vec<&Candidate<'_>> = keep.iter().copied().filter(|c| c.usable).collect();
    ranked.extend(keep.iter().copied().filter(|c| !c.usable));
    let room = want.saturating_sub(chosen.len());
    spread(&mut chosen, &ranked, room, all);
    // Followers for the places left.
    let fresh: Vec<&Candidate<'_>> = all
        .iter()
        .filter(|c| c.usable && !c.gone && !current.contains(&c.id))
        .collect();
    let room = want.saturating_sub(chosen.len());
    spread(&mut chosen, &fresh, room, all);
    chosen.sort_unstable();
    let mut now = current.to_vec();
    now.sort_unstable();
    if chosen == now || chosen.is_empty() {
        return None;
    }
    let usable = chosen.iter().filter(|v| find(**v).is_some_and(|c| c.usable)).count();
    if usable < chosen.len() / 2 + 1 {
        return None;
    }
    // Only a change that replaces a lost voter or trims the excess: a voter merely down for a
    // while stays (its disk holds the log; it comes back).
    let lost = current
        .iter()
        .any(|v| find(*v).is_none_or(|c| c.gone && c.id != leader));
    let excess = current.len() > want;
    let short = current.len() < want && !fresh.is_empty();
    (lost || excess || short).then_some(chosen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes<'a>(domains: &'a [&'a str]) -> Vec<Candidate<'a>> {
        domains
            .iter()
            .enumerate()
            .map(|(i, d)| Candidate {
                id: i as u32,
                domain: d,
                usable: true,
                gone: false,
            })
            .collect()
    }

    #[test]
    fn the_count_is_odd_and_bounded_by_the_nodes() {
        assert_eq!(
            [1, 2, 3, 4, 5, 6, 7, 64].map(|n| target(5, n)),
            [1, 1, 3, 3, 5, 5, 5, 5]
        );
        assert_eq!(target(7, 64), 7);
        assert_eq!(target(3, 64), 3);
    }

    #[test]
    fn first_voters_spread_over_domains_lowest_first() {
        let d = ["a", "a", "a", "b", "b", "c", "c", "c"];
        assert_eq!(initial(&nodes(&d), 5), vec![0, 1, 3, 4, 5]);
        let one = ["h"; 10];
        assert_eq!(initial(&nodes(&one), 5), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_voter_lost_for_good_is_replaced_by_a_follower_of_another_domain() {
        let d = ["a", "a", "b", "b", "c", "c", "d"];
        let mut all = nodes(&d);
        let current = vec![0, 1, 2, 4, 6];
        assert_eq!(plan(&current, 0, 5, &all), None);
        all[4].gone = true;
        all[4].usable = false;
        // Domain c lost its voter: 5 (domain c) takes its place.
        assert_eq!(plan(&current, 0, 5, &all), Some(vec![0, 1, 2, 5, 6]));
        // Down for a while only: kept.
        all[4].gone = false;
        assert_eq!(plan(&current, 0, 5, &all), None);
    }

    #[test]
    fn every_node_a_voter_is_cut_down_keeping_the_leader() {
        let d = ["h"; 9];
        let mut all = nodes(&d);
        all[1].usable = false;
        let current: Vec<u32> = (0..9).collect();
        assert_eq!(plan(&current, 3, 5, &all), Some(vec![0, 2, 3, 4, 5]));
    }

    #[test]
    fn no_change_without_a_usable_majority() {
        let d = ["h"; 5];
        let mut all = nodes(&d);
        for c in all.iter_mut().skip(2) {
            c.usable = false;
        }
        all[4].gone = true;
        // 0 leads, 1 usable; 2, 3 down; 4 gone and no follower to take its place.
        assert_eq!(plan(&[0, 1, 2, 3, 4], 0, 5, &all), None);
    }
}
