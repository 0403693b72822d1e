//! Where a job's ranks run: a pure function of the live logical nodes.

use psls_pfs::runs::MAX_RANKS;

/// Rank → logical node: `per_node` consecutive ranks per node, else round robin over `nodes`
/// (sorted, live).
pub fn place(ranks: u32, nodes: &[u32], per_node: Option<u32>) -> Result<Vec<u32>, String> {
    if nodes.is_empty() {
        return Err("no node is up".into());
    }
    if ranks == 0 || ranks > MAX_RANKS {
        return Err(format!("-n {ranks}: a job has 1 to {MAX_RANKS} ranks"));
    }
    match per_node {
        Some(0) => Err("--per-node must be at least 1".into()),
        Some(k) => {
            if ranks.div_ceil(k) as usize > nodes.len() {
                return Err(format!(
                    "{ranks} ranks at {k} per node need {} nodes; {} are up",
                    ranks.div_ceil(k),
                    nodes.len()
                ));
            }
            Ok((0..ranks).map(|r| nodes[(r / k) as usize]).collect())
        }
        None => Ok((0..ranks).map(|r| nodes[r as usize % nodes.len()]).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_round_robin_or_per_node() {
        assert_eq!(place(5, &[0, 2, 3], None).expect("places"), vec![0, 2, 3, 0, 2]);
        assert_eq!(place(5, &[0, 2, 3], Some(2)).expect("places"), vec![0, 0, 2, 2, 3]);
        assert!(place(7, &[0, 2, 3], Some(2)).is_err());
        assert!(place(1, &[], None).is_err());
        assert!(place(0, &[1], None).is_err());
        assert!(place(1, &[1], Some(0)).is_err());
    }
}
