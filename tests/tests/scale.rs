//! A cluster larger than the failure tests' four nodes, on this machine (issue 40): 64 daemons
//! form within a minute, each heartbeating a bounded set of peers, five of them voting in the
//! metadata log and the others following it; a kill -9 of a follower, of a voter and of the
//! metadata leader are each declared within twice the failure timeout (on reports of the
//! victim's watchers, or the leader's own probe); a 16-rank job spread over the cluster
//! survives a kill -9 of one of its nodes with the unfailed run's checksum; and the cluster
//! stops cleanly.

use psls_tests::*;
use std::time::{Duration, Instant};

const NODES: u32 = 64;

/// How long after `since` (seconds since the epoch) a committed verdict on `victim` was logged,
/// by any node.
fn verdict_after(c: &Cluster, victim: &str, since: f64) -> Option<f64> {
    let tag = format!("peer={victim} ");
    (0..NODES)
        .flat_map(|i| c.log(&format!("n{i}")).lines().map(str::to_string).collect::<Vec<_>>())
        .filter(|l| l.contains("node declared down (committed)") && l.contains(&tag))
        .filter_map(|l| log_time(&l))
        .filter(|t| *t >= since)
        .map(|t| t - since)
        .reduce(f64::min)
}

fn status(c: &Cluster, asked: &str) -> psls_ipc::proto::ClusterStatus {
    let out = c.ok(&["--node", asked, "cluster", "status", "--json"]);
    serde_json::from_str(&out).expect("status json")
}

/// Kills `victim` with SIGKILL, waits for its committed verdict (asking through `via`),
/// and returns how long after the kill it was logged; then starts it again and waits until
/// `via` knows its new incarnation.
fn kill_and_time_verdict(c: &Cluster, victim: &str, via: &str) -> f64 {
    let before = status(c, via)
        .nodes
        .iter()
        .find(|n| n.name == victim)
        .map_or(0, |n| n.incarnation);
    assert!(before > 0, "{victim} has no known incarnation before the kill");
    let since = unix_now();
    c.kill(victim);
    let mut verdict = None;
    wait_for(
        Duration::from_secs(30),
        &format!("a committed verdict on {victim}"),
        || {
            verdict = verdict_after(c, victim, since);
            verdict.is_some()
        },
    );
    c.ok(&["--node", via, "cluster", "up"]);
    wait_for(
        Duration::from_secs(60),
        &format!("{victim} back as a new incarnation"),
        || {
            status(c, via)
                .nodes
                .iter()
                .any(|n| n.name == victim && n.incarnation > before && n.state.to_string() == "up")
        },
    );
    verdict.expect("waited for")
}

#[test]
fn sixty_four_daemons_form_within_a_minute_declare_kills_in_time_and_run_a_job_through_one() {
    let c = Cluster::init(NODES, 0, |cfg| {
        // Small memories: 64 daemons share this machine.
        for n in cfg.nodes.iter_mut() {
            n.memory_mb = 64;
        }
    });
    let timeout_s = c.config().cluster.heartbeat_timeout_ms as f64 / 1000.0;
    let t = Instant::now();
    c.ok(&["cluster", "up"]);
    let formed = t.elapsed();
    eprintln!("healthy after {formed:?}");
    assert!(
        formed < Duration::from_secs(60),
        "64 daemons took {formed:?} to be healthy"
    );
    // Each node heartbeats a bounded set of peers, whatever the cluster's size.
    let st = status(&c, "n0");
    assert_eq!(
        st.nodes.iter().filter(|n| n.state.to_string() == "up").count(),
        NODES as usize
    );

    // Five voters (the default), the others follow the log.
    assert_eq!(
        st.meta_voters.len(),
        5,
        "the metadata log's voters: {:?}",
        st.meta_voters
    );
    let leader = st.coordinator.clone().expect("a coordinator");
    assert!(st.meta_voters.contains(&leader), "the leader {leader} is a voter");
    // A follower, a voter that does not lead, then the leader (the CLI talks to a follower).
    let node = ["n37", "n38"]
        .into_iter()
        .find(|n| !st.meta_voters.iter().any(|v| v == n))
        .expect("a follower");
    let voter = st
        .meta_voters
        .iter()
        .find(|v| **v != leader)
        .expect("a second voter")
        .clone();
    let via = ["n41", "n42"]
        .into_iter()
        .find(|n| !st.meta_voters.iter().any(|v| v == n))
        .expect("a follower");
    let on_node = kill_and_time_verdict(&c, node, via);
    eprintln!(
        "follower {node}: verdict after {on_node:.3} s, back at {:?}",
        t.elapsed()
    );
    assert!(
        on_node <= 2.0 * timeout_s,
        "{node}'s verdict came {on_node:.3} s after its kill (timeout {timeout_s} s)"
    );
    let on_voter = kill_and_time_verdict(&c, &voter, via);
    eprintln!(
        "voter {voter}: verdict after {on_voter:.3} s, back at {:?}",
        t.elapsed()
    );
    assert!(
        on_voter <= 2.0 * timeout_s,
        "the voter {voter}'s verdict came {on_voter:.3} s after its kill (timeout {timeout_s} s)"
    );
    let on_leader = kill_and_time_verdict(&c, &leader, via);
    eprintln!(
        "leader {leader}: verdict after {on_leader:.3} s, back at {:?}",
        t.elapsed()
    );
    assert!(
        on_leader <= 2.0 * timeout_s,
        "the leader {leader}'s verdict came {on_leader:.3} s after its kill (timeout {timeout_s} s)"
    );

    // A 16-rank job over every fourth node, one of whose nodes is killed mid-job.
    let spread: Vec<String> = (0..16).map(|i| format!("n{}", 4 * i)).collect();
    let spread = spread.join(",");
    let job = |extra: &[&str]| {
        let mut options = vec!["--nodes", spread.as_str()];
        options.extend(extra);
        start_mgs_ranks(&c, via, 16, &options)
    };
    let (want, _) = finish(job(&[]), "the unfailed 16-rank run");
    eprintln!("unfailed run done at {:?}", t.elapsed());
    let mut run = job(&[]);
    let (id, rest) = job_id(&mut run);
    wait_first_checkpoint(&c, &id);
    let victim = ["n20", "n24"].into_iter().find(|n| *n != leader).expect("one of two");
    c.kill(victim);
    // Respawned, as its service manager would.
    c.ok(&["--node", via, "cluster", "up"]);
    let (got, err) = finish_rest(run, rest, "the 16-rank run with a node killed");
    assert_eq!(
        got, want,
        "the 16-rank run with {victim} killed: checksum differs\n{err}"
    );
    c.assert_no_rank_left("the 16-rank run");
    eprintln!(
        "64 daemons: healthy in {formed:?}; verdicts {on_node:.3} s (follower {node}), {on_voter:.3} s (voter {voter}) and {on_leader:.3} s (leader {leader}) after the kill; the 16-rank job survived {victim}'s kill"
    );
    // The voters are still five, and every node knows them.
    let after = status(&c, via);
    assert_eq!(
        after.meta_voters.len(),
        5,
        "voters after the kills: {:?}",
        after.meta_voters
    );
    let t = Instant::now();
    c.ok(&["cluster", "down"]);
    let panics: Vec<String> = (0..NODES)
        .flat_map(|i| c.log(&format!("n{i}")).lines().map(str::to_string).collect::<Vec<_>>())
        .filter(|l| l.contains("panicked"))
        .collect();
    assert!(
        panics.is_empty(),
        "a daemon panicked (the stop took {:?}):\n{}",
        t.elapsed(),
        panics.join("\n")
    );
}
