//! Slurm: what `psls run` reads of the allocation it runs in.
//!
//! Inside an allocation (`SLURM_JOB_ID` set) `psls run` places ranks on the PSLS nodes of the
//! allocation's hosts (`SLURM_JOB_NODELIST`, a hostlist expression such as `n[0-3,7]`, each
//! host matched to the nodes whose `host` key, else name, it is), takes `-n` from
//! `SLURM_NTASKS`, and learns when the allocation ends (`SLURM_JOB_END_TIME`, else the time
//! left that `squeue` reports) for `--halt-before`.

use psls_ipc::config::ClusterConfig;

/// Most hosts one hostlist expression may name (a bound on what an environment can make us
/// allocate).
pub const MAX_HOSTS: usize = 65_536;

/// Why an allocation's description is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlurmError {
    #[error("hostlist {list:?}: {why}")]
    Hostlist { list: String, why: String },
    #[error("{var}={value:?} is not {what}")]
    Var {
        var: &'static str,
        value: String,
        what: &'static str,
    },
    #[error("none of the hosts {hosts} runs a PSLS node (a node matches by its name, or its `host` in cluster.toml)")]
    NoNode { hosts: String },
}

/// The Slurm allocation `psls run` runs in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub job_id: String,
    /// Its hosts, expanded.
    pub hosts: Vec<String>,
    /// `SLURM_NTASKS`, if set.
    pub ntasks: Option<u32>,
    /// When it ends (seconds since the Unix epoch), if Slurm says.
    pub end_unix_s: Option<u64>,
}

/// The allocation described by the environment `var` reads (`None`: not in one). `time_left`
/// asks Slurm for the seconds left when the environment does not give the end.
pub fn allocation(
    var: impl Fn(&str) -> Option<String>,
    now_unix_s: u64,
    time_left: impl FnOnce(&str) -> Option<u64>,
) -> Result<Option<Allocation>, SlurmError> {
    let Some(job_id) = var("SLURM_JOB_ID").filter(|j| !j.is_empty()) else {
        return Ok(None);
    };
    let list = var("SLURM_JOB_NODELIST")
        .or_else(|| var("SLURM_NODELIST"))
        .unwrap_or_default();
    let hosts = expand_hostlist(&list)?;
    let ntasks = match var("SLURM_NTASKS").filter(|v| !v.is_empty()) {
        None => None,
        Some(v) => Some(v.trim().parse::<u32>().map_err(|_| SlurmError::Var {
            var: "SLURM_NTASKS",
            value: v.clone(),
            what: "a number of tasks",
        })?),
    };
    let end_unix_s = match var("SLURM_JOB_END_TIME").filter(|v| !v.is_empty()) {
        Some(v) => Some(v.trim().parse::<u64>().map_err(|_| SlurmError::Var {
            var: "SLURM_JOB_END_TIME",
            value: v.clone(),
            what: "a Unix time",
        })?),
        None => time_left(&job_id).map(|left| now_unix_s.saturating_add(left)),
    };
    Ok(Some(Allocation {
        job_id,
        hosts,
        ntasks,
        end_unix_s,
    }))
}

/// The seconds left to Slurm job `job_id`, as `squeue -o %L` prints them (`None`: squeue did
/// not answer, or the job has no limit).
pub fn squeue_time_left(job_id: &str) -> Option<u64> {
    let out = std::process::Command::new("squeue")
        .args(["-h", "-j", job_id, "-o", "%L"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    parse_time_left(String::from_utf8_lossy(&out.stdout).trim())
}

/// Slurm's time format (`[D-]HH:MM:SS`, `MM:SS`, `SS`) in seconds; `None` for `UNLIMITED`,
/// `INVALID` and anything else.
pub fn parse_time_left(s: &str) -> Option<u64> {
    let (days, rest) = match s.split_once('-') {
        Some((d, r)) => (d.parse::<u64>().ok()?, r),
        None => (0, s),
    };
    let parts: Vec<u64> = rest
        .split(':')
        .map(|p| p.parse::<u64>().ok())
        .collect::<Option<Vec<u64>>>()?;
    let (h, m, sec) = match parts.as_slice() {
        [sec] => (0, 0, *sec),
        [m, sec] => (0, *m, *sec),
        [h, m, sec] => (*h, *m, *sec),
        _ => return None,
    };
    Some(((days * 24 + h) * 60 + m) * 60 + sec)
}

/// Expands a Slurm hostlist expression: `n[0-3,7]` → n0 n1 n2 n3 n7; `a,b[01-02]` → a b01
/// b02 (a range's lower bound gives the width); several bracket groups in one name multiply
/// (`r[1-2]n[1-2]` → r1n1 r1n2 r2n1 r2n2). At most [`MAX_HOSTS`] hosts.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, SlurmError> {
    let bad = |why: &str| SlurmError::Hostlist {
        list: list.to_string(),
        why: why.to_string(),
    };
    let mut out = Vec::new();
    for item in split_top(list).map_err(|w| bad(&w))? {
        if item.is_empty() {
            continue;
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while !rest.is_empty() {
            match rest.find('[') {
                None => {
                    if rest.contains(']') {
                        return Err(bad("a ']' without its '['"));
                    }
                    names.iter_mut().for_each(|n| n.push_str(rest));
                    rest = "";
                }
                Some(open) => {
                    let (prefix, tail) = rest.split_at(open);
                    if prefix.contains(']') {
                        return Err(bad("a ']' without its '['"));
                    }
                    let close = tail.find(']').ok_or_else(|| bad("a '[' without its ']'"))?;
                    let suffixes = expand_ranges(&tail[1..close]).map_err(|w| bad(&w))?;
                    if names.len().saturating_mul(suffixes.len()) + out.len() > MAX_HOSTS {
                        return Err(bad(&format!("more than {MAX_HOSTS} hosts")));
                    }
                    names = names
                        .iter()
                        .flat_map(|n| suffixes.iter().map(move |s| format!("{n}{prefix}{s}")))
                        .collect();
                    rest = &tail[close + 1..];
                }
            }
        }
        out.extend(names);
        if out.len() > MAX_HOSTS {
            return Err(bad(&format!("more than {MAX_HOSTS} hosts")));
        }
    }
    if out.is_empty() {
        return Err(bad("it names no host"));
    }
    Ok(out)
}

/// Splits at the commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0u32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth > 0 => return Err("nested '['".into()),
            '[' => depth = 1,
            ']' if depth == 0 => return Err("a ']' without its '['".into()),
            ']' => depth = 0,
            ',' if depth == 0 => {
                items.push(list[start..i].trim());
                start = i + 1;
            }
            c if c.is_whitespace() => return Err("a space in a host name".into()),
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a '[' without its ']'".into());
    }
    items.push(list[start..].trim());
    Ok(items)
}

/// `0-3,7,09-11` → 0 1 2 3 7 09 10 11.
fn expand_ranges(ranges: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for r in ranges.split(',') {
        let (lo, hi) = r.split_once('-').unwrap_or((r, r));
        let width = lo.len();
        let num = |s: &str| {
            if s.is_empty() || s.len() > 18 || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{r:?} is not a number or a range of numbers"));
            }
            s.parse::<u64>().map_err(|e| e.to_string())
        };
        let (a, b) = (num(lo)?, num(hi)?);
        if b < a {
            return Err(format!("range {r:?} goes down"));
        }
        if (b - a) as usize >= MAX_HOSTS || out.len() + (b - a) as usize >= MAX_HOSTS {
            return Err(format!("more than {MAX_HOSTS} hosts"));
        }
        out.extend((a..=b).map(|i| format!("{i:0width$}")));
    }
    Ok(out)
}

/// The PSLS nodes (physical names, nodes then spares) on `hosts`: those whose `host` (else
/// name) one of them is.
pub fn nodes_on(cfg: &ClusterConfig, hosts: &[String]) -> Result<Vec<String>, SlurmError> {
    let nodes: Vec<String> = cfg
        .all()
        .filter(|n| hosts.iter().any(|h| h == n.host_name()))
        .map(|n| n.name.clone())
        .collect();
    if nodes.is_empty() {
        let mut shown: Vec<&str> = hosts.iter().take(8).map(String::as_str).collect();
        if hosts.len() > 8 {
            shown.push("...");
        }
        return Err(SlurmError::NoNode {
            hosts: shown.join(", "),
        });
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn expands_hostlists() {
        assert_eq!(
            expand_hostlist("n[0-3,7]").expect("expands"),
            names(&["n0", "n1", "n2", "n3", "n7"])
        );
        assert_eq!(expand_hostlist("n5").expect("one host"), names(&["n5"]));
        assert_eq!(
            expand_hostlist("login1,gpu[01-03]").expect("padded"),
            names(&["login1", "gpu01", "gpu02", "gpu03"])
        );
        assert_eq!(
            expand_hostlist("r[1-2]n[8-9]-ib").expect("two groups"),
            names(&["r1n8-ib", "r1n9-ib", "r2n8-ib", "r2n9-ib"])
        );
        assert_eq!(
            expand_hostlist("a[1,3],b[098-100]").expect("mixed"),
            names(&["a1", "a3", "b098", "b099", "b100"])
        );
        for bad in [
            "",
            "n[0-3",
            "n0-3]",
            "n[3-0]",
            "n[a-b]",
            "n[[1]]",
            "n[0-99999999]",
            "n 1",
            "n[]",
        ] {
            assert!(expand_hostlist(bad).is_err(), "{bad:?} is refused");
        }
    }

    #[test]
    fn reads_time_left() {
        assert_eq!(parse_time_left("45"), Some(45));
        assert_eq!(parse_time_left("1:05"), Some(65));
        assert_eq!(parse_time_left("2:00:01"), Some(7201));
        assert_eq!(parse_time_left("1-00:00:10"), Some(86_410));
        assert_eq!(parse_time_left("UNLIMITED"), None);
        assert_eq!(parse_time_left("INVALID"), None);
        assert_eq!(parse_time_left("1:2:3:4"), None);
    }

    #[test]
    fn reads_the_allocation() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(allocation(env(&[]), 100, |_| Some(1)).expect("none"), None);
        let a = allocation(
            env(&[
                ("SLURM_JOB_ID", "42"),
                ("SLURM_JOB_NODELIST", "n[0-1]"),
                ("SLURM_NTASKS", "4"),
            ]),
            1000,
            |job| (job == "42").then_some(60),
        )
        .expect("parses")
        .expect("an allocation");
        assert_eq!(a.hosts, names(&["n0", "n1"]));
        assert_eq!((a.ntasks, a.end_unix_s), (Some(4), Some(1060)));
        let b = allocation(
            env(&[
                ("SLURM_JOB_ID", "7"),
                ("SLURM_NODELIST", "h1"),
                ("SLURM_JOB_END_TIME", "5000"),
            ]),
            1000,
            |_| panic!("the environment gave the end"),
        )
        .expect("parses")
        .expect("an allocation");
        assert_eq!((b.ntasks, b.end_unix_s), (None, Some(5000)));
        assert!(allocation(
            env(&[("SLURM_JOB_ID", "7"), ("SLURM_NODELIST", "h1"), ("SLURM_NTASKS", "x")]),
            0,
            |_| None
        )
        .is_err());
    }

    #[test]
    fn maps_hosts_to_nodes() {
        let mut cfg = ClusterConfig::local(4, 1, 64, 7400);
        assert_eq!(
            nodes_on(&cfg, &names(&["n1", "n3", "other"])).expect("maps"),
            names(&["n1", "n3"])
        );
        for n in cfg.nodes.iter_mut().chain(cfg.spares.iter_mut()) {
            n.host = Some("box".into());
        }
        assert_eq!(nodes_on(&cfg, &names(&["box"])).expect("maps").len(), 5);
        assert!(matches!(
            nodes_on(&cfg, &names(&["n1"])),
            Err(SlurmError::NoNode { .. })
        ));
    }
}
