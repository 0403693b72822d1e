//! `psls`: the PSLS admin and user CLI.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use psls_client::cluster;
use psls_ipc::proto::{ClusterStatus, NodeState};
use std::io::{IsTerminal, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(name = "psls", version, about = "PSLS: a parallel single-level store")]
struct Cli {
    /// Cluster folder (default: $PSLS_HOME or ./.psls).
    #[arg(long, global = true)]
    dir: Option<PathBuf>,
    /// Talk to this node's daemon (default: the first that answers, or $PSLS_SOCKET).
    #[arg(long, global = true)]
    node: Option<String>,
    /// Output: `table` (for people) or `json` (for scripts: one document with a
    /// `schema_version`, ids as strings); `--json` on a command is the same as `--output json`.
    #[arg(long, global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Table,
    Json,
}

/// The version of every JSON document the CLI prints: it changes when a field changes meaning
/// or goes (new fields may come without it).
const SCHEMA_VERSION: u32 = 1;

/// Prints `doc` (an object) as JSON with the schema version first, pretty.
fn print_json(mut doc: serde_json::Value) -> Result<()> {
    let mut out = serde_json::Map::new();
    out.insert("schema_version".into(), SCHEMA_VERSION.into());
    if let serde_json::Value::Object(fields) = doc.take() {
        out.extend(fields);
    }
    println!("{}", serde_json::to_string_pretty(&serde_json::Value::Object(out))?);
    Ok(())
}

/// A file as JSON: its 64-bit id as a decimal string (a JSON number loses its low digits in
/// most readers, `jq` among them).
fn file_json(f: &psls_ipc::proto::FileInfo) -> Result<serde_json::Value> {
    let mut v = serde_json::to_value(f)?;
    v["id"] = f.id.to_string().into();
    Ok(v)
}

#[derive(Subcommand)]
enum Cmd {
    /// Cluster set-up and state.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Node administration.
    #[command(subcommand, name = "node")]
    NodeAdmin(NodeCmd),
    /// The cluster's config.
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Create a zero-filled parallel file.
    Create {
        name: String,
        /// Size: bytes, or with a unit (4K, 1M, 2G, 1T; binary: 1M = 1 MiB).
        #[arg(long, value_parser = parse_size)]
        size: u64,
        /// Permission bits, octal.
        #[arg(long, default_value = "644", value_parser = parse_mode)]
        mode: u32,
    },
    /// Copy a local file into the PFS (atomic: all or nothing).
    Import {
        local: PathBuf,
        name: String,
        /// Replace an existing file atomically.
        #[arg(long)]
        replace: bool,
        #[arg(long, default_value = "644", value_parser = parse_mode)]
        mode: u32,
    },
    /// Copy a parallel file to a local file.
    Export { name: String, local: PathBuf },
    /// List parallel files.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Size, pages, owner, and the home and mirror node of each stripe.
    Stat {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Remove a parallel file.
    Rm { name: String },
    /// Verify every copy of every page; repair bad copies from the good one.
    Scrub,
    /// Run a parallel program: N ranks spread over the cluster's nodes, each started by its
    /// node's daemon with PSLS_RANK, PSLS_SIZE and PSLS_SOCKET set; output is prefixed with
    /// the rank; the exit status is the first failing rank's.
    Run {
        /// Number of ranks [default inside a Slurm allocation: SLURM_NTASKS].
        #[arg(short = 'n', long = "ranks")]
        n: Option<u32>,
        /// Place this many consecutive ranks per node (default: round robin).
        #[arg(long)]
        per_node: Option<u32>,
        /// A safe-point call (psls_checkpoint) takes a checkpoint when this long passed since
        /// the job's last one (0: every call). Durations: seconds, or with units (90s, 2m, 1h).
        #[arg(long, value_name = "DURATION", default_value = "0", value_parser = parse_duration_s)]
        checkpoint_interval: u64,
        /// A safe-point call fails when not every rank made it within this long.
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration_s)]
        checkpoint_timeout: u64,
        /// After a node failure the job is rolled back to its last checkpoint and restarted,
        /// at most this many times.
        #[arg(long, default_value_t = 3)]
        max_restarts: u32,
        /// How long a rollback waits for a failed node to come back.
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration_s)]
        respawn_timeout: u64,
        /// Which level a safe point's checkpoint takes: auto (memory checkpoints, and the
        /// cleaner when the persistent interval elapsed or memory runs short), memory or
        /// persistent.
        #[arg(long, default_value = "auto", value_parser = ["auto", "memory", "persistent"])]
        level: String,
        /// With --level auto, take a persistent checkpoint when this long passed since the
        /// job's last one [default: the cluster's, 60s].
        #[arg(long, value_name = "DURATION", value_parser = parse_duration_s)]
        persistent_interval: Option<u64>,
        /// With --level auto, also make every N-th checkpoint a persistent one, whatever the
        /// time (as SCR's flush frequency; 0: by the interval only).
        #[arg(long, default_value_t = 0, value_name = "N")]
        persistent_every: u32,
        /// What stays in memory after a persistent checkpoint: none, total, p1, p2, p3 or
        /// lru:FRAMES [default: the cluster's, p1].
        #[arg(long)]
        cleaning: Option<String>,
        /// After a rollback, load again the pages each node held (as many as the cleaning
        /// policy keeps in memory) before the ranks restart.
        #[arg(long)]
        prefetch: bool,
        /// Start job JOB again from its last checkpoint (after a power cut, a halt, or too
        /// many failures): its command and options are the ones it was started with.
        #[arg(long, value_name = "JOB", conflicts_with = "command")]
        resume: Option<String>,
        /// Start the job and print its id, without following it (like sbatch): `psls attach
        /// JOB` follows it, from any node.
        #[arg(long)]
        detach: bool,
        /// Run job NAME to its end, whatever link of a chain this is: start it under that name
        /// if there is no such job, follow it if it runs, resume it if it was halted, cancelled
        /// or lost its nodes, and exit 0 at once if it finished. One batch script serves
        /// every job of a Slurm dependency chain.
        #[arg(long, value_name = "NAME", conflicts_with = "resume")]
        job: Option<String>,
        /// Run the ranks on these PSLS nodes only (a hostlist: names, or the `host` keys of
        /// cluster.toml, as in n[0-3,7]) [default inside a Slurm allocation: its nodes,
        /// SLURM_JOB_NODELIST].
        #[arg(long, value_name = "HOSTLIST")]
        nodes: Option<String>,
        /// Halt the job this long before the allocation ends (SLURM_JOB_END_TIME, else the
        /// time left squeue reports): a persistent checkpoint at its next safe-point call,
        /// then it stops and `psls run` exits 75, resumable. SIGUSR1 (`sbatch
        /// --signal=B:USR1@SECONDS`) halts it the same way at any time.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration_s, conflicts_with = "detach")]
        halt_before: Option<u64>,
        /// The program and its arguments.
        #[arg(
            required_unless_present_any = ["resume", "job"],
            trailing_var_arg = true,
            allow_hyphen_values = true
        )]
        command: Vec<String>,
    },
    /// Running and resumable jobs: ranks, command, last checkpoint (epoch, time, size).
    Jobs {
        #[arg(long)]
        json: bool,
        #[command(subcommand)]
        cmd: Option<JobsCmd>,
    },
    /// Take a persistent checkpoint of a running job at its next safe-point call.
    Checkpoint { job: String },
    /// Follow a running (or ended) job from any node: its output from its first kept line,
    /// its notes, and its end (the exit status is the job's).
    Attach { job: String },
    /// Stop a running job, keeping it resumable from its newest intact checkpoint.
    Cancel { job: String },
    /// Take a persistent checkpoint of a running job at its next safe-point call, then stop
    /// it (it can be resumed from that checkpoint).
    Halt { job: String },
    /// The main job: bring up a local 4-node cluster, import a file, lose a node, export the
    /// file intact, show status.
    Demo {
        #[arg(long, default_value_t = 64)]
        size_mb: u64,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Write the cluster config, a cluster CA and one certificate per node.
    Init {
        #[arg(long, default_value_t = 4)]
        nodes: u32,
        #[arg(long, default_value_t = 1)]
        spares: u32,
        #[arg(long, default_value_t = 1024)]
        memory_mb: u64,
        #[arg(long, default_value_t = 7400)]
        base_port: u16,
        /// Overwrite an existing cluster folder's config and certificates.
        #[arg(long)]
        force: bool,
    },
    /// Start every daemon that is not running; wait until the cluster is healthy.
    Up {
        /// How long to wait for the cluster to become healthy.
        #[arg(long = "timeout", visible_alias = "timeout-s", value_name = "DURATION", default_value = "30s", value_parser = parse_duration_s)]
        timeout_s: u64,
    },
    /// Stop every daemon.
    Down,
    /// The cluster's state: counts of nodes per state, then the nodes that need a look (not
    /// up, a failed disk, re-mirroring).
    #[command(after_help = "Example: psls cluster status --all")]
    Status {
        /// Print JSON (every node, always).
        #[arg(long)]
        json: bool,
        /// List every node, not only those that need a look.
        #[arg(long)]
        all: bool,
    },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Check the cluster folder's cluster.toml: every rule (errors), and what would trouble
    /// the daemons on this machine (warnings: ports in the ephemeral range, missing
    /// certificates). Exits 1 on an error, 0 otherwise.
    Check,
}

#[derive(Subcommand)]
enum JobsCmd {
    /// Drop a job that is not running: its checkpoint and its checkpoint area.
    Rm { job: String },
}

#[derive(Subcommand)]
enum NodeCmd {
    /// Give a lost node's logical id to a spare and re-mirror its pages.
    Replace {
        id: u32,
        #[arg(long = "with")]
        spare: String,
        /// Return at once instead of waiting for the re-mirroring.
        #[arg(long)]
        no_wait: bool,
    },
}

/// A size: bytes, or a number with a binary unit (K, M, G, T, optionally followed by `iB` or
/// `B`: 1M = 1MiB = 1MB = 1,048,576 bytes).
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (bytes, or a number with K, M, G or T)"))?;
    let shift = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("'{s}': unknown unit '{unit}' (use K, M, G or T)")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// A duration in whole seconds: a number of seconds, or with units (`90s`, `2m`, `1h 30m`).
fn parse_duration_s(s: &str) -> Result<u64, String> {
    if let Ok(n) = s.trim().parse::<u64>() {
        return Ok(n);
    }
    let d =
        humantime::parse_duration(s).map_err(|e| format!("'{s}' is not a duration (seconds, or 90s, 2m, 1h): {e}"))?;
    if d.subsec_nanos() != 0 {
        return Err(format!("'{s}': whole seconds only"));
    }
    Ok(d.as_secs())
}

fn parse_mode(s: &str) -> Result<u32, String> {
    let m = u32::from_str_radix(s, 8).map_err(|_| format!("'{s}' is not an octal mode"))?;
    if m > 0o777 {
        return Err(format!("mode {s} has bits outside 777"));
    }
    Ok(m)
}

fn home(cli: &Cli) -> PathBuf {
    cli.dir
        .clone()
        .or_else(|| std::env::var_os("PSLS_HOME").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(".psls"))
}

/// What `psls run` was asked, beside its checkpoint options.
struct RunAsk<'a> {
    n: Option<u32>,
    per_node: Option<u32>,
    detach: bool,
    job: Option<&'a str>,
    nodes: Option<&'a str>,
    halt_before_s: Option<u64>,
    command: &'a [String],
}

/// Which link of a chain `psls run --job NAME` is.
#[derive(Debug, PartialEq, Eq)]
enum Chain {
    /// No job NAME: start it.
    Start,
    /// Halted, cancelled, lost its nodes, or its result unwritten: resume it.
    Resume,
    /// It runs (a `psls run` of it was killed, or runs elsewhere): follow it.
    Follow,
    /// It finished: nothing to do.
    Finished,
}

/// What `psls run --job NAME` does with `job`, as `psls jobs` shows it (`None`: no such job).
fn chain_step(name: &str, job: Option<&psls_ipc::proto::JobInfo>) -> Result<Chain> {
    let Some(j) = job else { return Ok(Chain::Start) };
    Ok(match (j.state.as_str(), j.end.as_str()) {
        ("running", _) => Chain::Follow,
        (_, "failed") => bail!(
            "job {name} failed ({}); `psls run --resume {name}` runs it again from its last checkpoint",
            j.activity
        ),
        ("resumable", _) => Chain::Resume,
        (_, "finished") => Chain::Finished,
        // It ended and kept nothing to resume from (cancelled before its first checkpoint):
        // it starts again.
        _ => Chain::Start,
    })
}

fn unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `psls run`: relays the ranks' output, prefixed, and returns the job's status.
fn run_job(cli: &Cli, ask: RunAsk, mut checkpoint: psls_ipc::proto::CkptOptions) -> Result<i32> {
    let dir = home(cli);
    // Ctrl-C or SIGTERM cancels the job (it stays resumable from its newest checkpoint);
    // SIGUSR1 and the allocation's end halt it; a `psls run` killed otherwise leaves it
    // running. The signals are taken before anything else can arrive.
    let started: std::sync::Arc<std::sync::Mutex<Option<String>>> = Default::default();
    if !ask.detach {
        on_signals(&dir, cli.node.clone(), started.clone());
    }
    let cwd = std::env::current_dir().context("current folder")?;
    let slurm = psls_client::slurm::allocation(
        |k| std::env::var(k).ok(),
        unix_s(),
        psls_client::slurm::squeue_time_left,
    )?;
    // Where the ranks run: the nodes asked for, else the allocation's, else any.
    let hosts = match (ask.nodes, &slurm) {
        (Some(list), _) => Some(psls_client::slurm::expand_hostlist(list)?),
        (None, Some(a)) => Some(a.hosts.clone()),
        (None, None) => None,
    };
    if let Some(hosts) = hosts {
        checkpoint.nodes = psls_client::slurm::nodes_on(&cluster::load(&dir)?, &hosts)?;
    }
    let halt_at_unix_s = match ask.halt_before_s {
        None => None,
        Some(before) => {
            let end = slurm.as_ref().and_then(|a| a.end_unix_s).context(
                "--halt-before counts from the allocation's end: run inside a Slurm job with a time limit (SLURM_JOB_END_TIME, or squeue's time left)",
            )?;
            Some(end.saturating_sub(before))
        }
    };
    let mut client = cluster::connect(&dir, cli.node.as_deref())?;
    let mut follow_only = None;
    if let Some(name) = ask.job {
        let jobs = client.jobs()?;
        match chain_step(name, jobs.iter().find(|j| j.job == name))? {
            Chain::Start => checkpoint.job = name.to_string(),
            Chain::Resume => checkpoint.resume = name.to_string(),
            Chain::Follow => follow_only = Some(name.to_string()),
            Chain::Finished => {
                eprintln!("psls: job {name} finished already");
                return Ok(0);
            }
        }
        if checkpoint.resume.is_empty() && follow_only.is_none() && ask.command.is_empty() {
            bail!("there is no job {name} yet: give the command that starts it");
        }
    }
    // A resumed job runs the command it was started with.
    let resumed = !checkpoint.resume.is_empty();
    // A first start followed here reads this process's input at rank 0 (as under mpirun and
    // srun); a detached, resumed or followed job's ranks read an empty input.
    checkpoint.stdin = !ask.detach && !resumed && follow_only.is_none();
    let forward = checkpoint.stdin;
    let n = match ask.n.or(slurm.as_ref().and_then(|a| a.ntasks)) {
        Some(n) => n,
        None if resumed || follow_only.is_some() => 0,
        None => bail!("how many ranks? give -n (inside a Slurm allocation, SLURM_NTASKS gives it)"),
    };
    let mut program = if resumed || follow_only.is_some() {
        String::new()
    } else {
        ask.command.first().cloned().context("no program given")?
    };
    if program.contains('/') && !program.starts_with('/') {
        program = cwd.join(&program).display().to_string();
    }
    let args: Vec<String> = ask.command.iter().skip(1).cloned().collect();
    let env: Vec<(String, String)> = std::env::vars().collect();
    if ask.detach {
        let job = match follow_only {
            Some(j) => j,
            None => client.start(
                &program,
                &args,
                n,
                ask.per_node,
                env,
                &cwd.display().to_string(),
                checkpoint,
            )?,
        };
        println!("{job}");
        return Ok(0);
    }
    if let Some(at) = halt_at_unix_s {
        halt_at(&dir, cli.node.clone(), started.clone(), at);
    }
    // Per rank, the last line printed, and the start followed: a follower from another node
    // goes on after them.
    let mut after: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
    let mut attempt: Option<u32> = None;
    if let Some(j) = follow_only {
        if let Ok(mut s) = started.lock() {
            *s = Some(j.clone());
        }
        eprintln!("psls: job {j} is running: following it");
        let (code, message) = follow_job(&dir, cli.node.as_deref(), &j, &mut after, &mut attempt, false)?;
        let _ = std::io::stdout().flush();
        if code != 0 {
            eprintln!("psls: {message}");
        }
        return Ok(code);
    }
    let mut job: Option<String> = None;
    let note = |message: &str| eprintln!("psls: {message}");
    let first = client.run(
        &program,
        &args,
        n,
        ask.per_node,
        env,
        &cwd.display().to_string(),
        checkpoint,
        |j| {
            job = Some(j.to_string());
            if let Ok(mut s) = started.lock() {
                *s = Some(j.to_string());
            }
            if forward {
                forward_stdin(dir.clone(), cli.node.clone(), j.to_string());
            }
            if std::env::var_os("PSLS_QUIET").is_none() {
                eprintln!("psls: job {j} started");
            }
        },
        &mut attempt,
        note,
        |rank, seq, err, data| {
            after.insert(rank, seq);
            emit_line(rank, err, data);
        },
    );
    let (code, message) = match first {
        Ok(done) => done,
        // The node daemon went away (killed, paused, restarted): the job goes on; follow it
        // from any node that answers.
        Err(e) => match job.clone().filter(|_| lost_daemon(&e)) {
            Some(j) => {
                eprintln!("psls: lost the node daemon ({e}); following job {j} from another node");
                std::thread::sleep(std::time::Duration::from_millis(500));
                follow_job(&dir, None, &j, &mut after, &mut attempt, true)?
            }
            None => return Err(e.into()),
        },
    };
    let _ = std::io::stdout().flush();
    if code != 0 || resumed {
        eprintln!("psls: {message}");
    }
    Ok(code)
}

/// How long the input forwarder goes on trying while no node takes its input (rank 0 not
/// started yet, its node or ours restarting).
const STDIN_TRY_S: u64 = 30;

/// Where the forwarding of the input stands.
struct Forward {
    client: Option<psls_client::Client>,
    /// Bytes rank 0's node took.
    sent: u64,
    /// The input ended, or rank 0 reads no more: nothing more to send.
    done: bool,
}

/// Forwards this process's standard input to rank 0 of `job`, on threads of its own: chunks
/// with their offset (sent again while rank 0's queue is full), a sign of life every
/// `STDIN_ALIVE` while the input stays open (without them rank 0's input ends, as when this
/// process is killed), and the end of the input last. Stops quietly once rank 0 reads no more.
fn forward_stdin(dir: PathBuf, node: Option<String>, job: String) {
    use std::sync::{Arc, Mutex};
    let fwd = Arc::new(Mutex::new(Forward {
        client: None,
        sent: 0,
        done: false,
    }));
    // Sends `data` (the bytes after `sent`), and the end if `eof`; false: stop forwarding.
    let send = {
        let (dir, job) = (dir.clone(), job.clone());
        move |f: &mut Forward, mut data: &[u8], eof: bool| -> bool {
            let mut since = Instant::now();
            loop {
                if f.client.is_none() {
                    f.client = cluster::connect(&dir, node.as_deref())
                        .or_else(|_| cluster::connect(&dir, None))
                        .ok();
                }
                let r = match f.client.as_mut() {
                    Some(c) => c.stdin(&job, f.sent, data, eof),
                    None => Err(psls_client::ClientError::Daemon {
                        kind: psls_ipc::ErrorKind::Unavailable,
                        message: "no node daemon answers".into(),
                    }),
                };
                match r {
                    Ok((received, full)) => {
                        let took = (received.saturating_sub(f.sent) as usize).min(data.len());
                        f.sent += took as u64;
                        data = &data[took..];
                        since = Instant::now();
                        if data.is_empty() && !full {
                            return true;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(psls_client::ClientError::Daemon {
                        kind: psls_ipc::ErrorKind::Unavailable,
                        ..
                    })
                    | Err(psls_client::ClientError::Frame(_))
                    | Err(psls_client::ClientError::Connect { .. }) => {
                        if since.elapsed() > Duration::from_secs(STDIN_TRY_S) {
                            return false;
                        }
                        f.client = None;
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    // Rank 0 reads no more (it exited, the job restarted or ended).
                    Err(_) => return false,
                }
            }
        }
    };
    let send = Arc::new(send);
    {
        let (fwd, send) = (fwd.clone(), send.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; psls_ipc::proto::MAX_STDIN_CHUNK];
            let mut input = std::io::stdin().lock();
            loop {
                let n = match std::io::Read::read(&mut input, &mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => 0,
                };
                let Ok(mut f) = fwd.lock() else { return };
                let go_on = send(&mut f, &buf[..n], n == 0);
                if n == 0 || !go_on {
                    f.done = true;
                    return;
                }
            }
        });
    }
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_secs(2));
        // A send in progress is a sign of life already.
        let Ok(mut f) = fwd.try_lock() else { continue };
        if f.done {
            return;
        }
        if !send(&mut f, &[], false) {
            f.done = true;
            return;
        }
    });
}

/// Asks job `name` to halt: a persistent checkpoint at its next safe-point call, then it stops
/// (through the node `node`, else any). `why` says what asked.
fn ask_halt(dir: &Path, node: Option<&str>, name: &str, why: &str) {
    let asked = cluster::connect(dir, node)
        .or_else(|_| cluster::connect(dir, None))
        .and_then(|mut c| c.force_checkpoint(name, true).map_err(anyhow::Error::from));
    match asked {
        Ok(()) => eprintln!(
            "psls: {why}: halting job {name} at its next safe-point call (a persistent checkpoint; then `psls run --resume {name}` or `--job {name}` goes on)"
        ),
        Err(e) => eprintln!("psls: {why}: could not halt job {name}: {e}"),
    }
}

/// The job's name once it is known (waiting for it).
fn job_name(job: &std::sync::Mutex<Option<String>>) -> String {
    loop {
        if let Some(n) = job.lock().ok().and_then(|j| j.clone()) {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Halts the job named in `job` at `at_unix_s` (seconds since the Unix epoch), on a thread of
/// its own.
fn halt_at(dir: &Path, node: Option<String>, job: std::sync::Arc<std::sync::Mutex<Option<String>>>, at_unix_s: u64) {
    let dir = dir.to_path_buf();
    let now = unix_s();
    if at_unix_s <= now {
        eprintln!(
            "psls: the allocation ends before --halt-before allows a run: the job halts at its first safe-point call"
        );
    }
    std::thread::spawn(move || {
        while unix_s() < at_unix_s {
            std::thread::sleep(std::time::Duration::from_millis(250));
        }
        let name = job_name(&job);
        ask_halt(&dir, node.as_deref(), &name, "the allocation ends soon");
    });
}

/// Waits, on a thread of its own, for SIGINT or SIGTERM and cancels the job named in `job`
/// (through the node `node`, else any), or for SIGUSR1 and halts it; the caller follows the
/// job to its end as usual. A second SIGINT or SIGTERM, or one before the job has a name, ends
/// `psls run` at once (status 130).
fn on_signals(dir: &Path, node: Option<String>, job: std::sync::Arc<std::sync::Mutex<Option<String>>>) {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGUSR1);
    // Blocked here before any other thread exists, so only the waiter takes them.
    if set.thread_block().is_err() {
        return;
    }
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let mut cancelled = false;
        while let Ok(sig) = set.wait() {
            let name = job.lock().ok().and_then(|j| j.clone());
            if sig == Signal::SIGUSR1 {
                // Before the job has a name, the halt waits for it.
                let (dir, node, job) = (dir.clone(), node.clone(), job.clone());
                std::thread::spawn(move || {
                    let name = name.unwrap_or_else(|| job_name(&job));
                    ask_halt(&dir, node.as_deref(), &name, "SIGUSR1");
                });
                continue;
            }
            let Some(name) = name.filter(|_| !cancelled) else {
                eprintln!("psls: {sig}: leaving");
                std::process::exit(130);
            };
            cancelled = true;
            eprintln!("psls: {sig}: cancelling job {name} (it stays resumable: `psls run --resume {name}`)");
            let asked = cluster::connect(&dir, node.as_deref())
                .or_else(|_| cluster::connect(&dir, None))
                .and_then(|mut c| c.cancel(&name).map_err(anyhow::Error::from));
            if let Err(e) = asked {
                eprintln!("psls: could not cancel job {name}: {e}; it goes on (`psls cancel {name}`)");
                std::process::exit(130);
            }
        }
    });
}

/// `psls attach JOB`: follows the job to its end; returns its status.
fn attach(dir: &Path, node: Option<&str>, job: &str) -> Result<i32> {
    let mut after = std::collections::BTreeMap::new();
    let (code, message) = follow_job(dir, node, job, &mut after, &mut None, false)?;
    let _ = std::io::stdout().flush();
    if code != 0 {
        eprintln!("psls: {message}");
    }
    Ok(code)
}

/// Prints a rank's line as `[rank] text` (on standard error if the rank wrote it there).
fn emit_line(rank: u32, err: bool, line: &[u8]) {
    let text = String::from_utf8_lossy(line);
    let text = text.strip_suffix('\n').unwrap_or(&text);
    if err {
        eprintln!("[{rank}] {text}");
    } else {
        println!("[{rank}] {text}");
    }
}

/// Follows `job` to its end through `node` (else any node), printing each rank's lines after
/// `after` and the notes of the restarts after start `attempt` (both kept up to date); after losing its node daemon it follows again from any node that
/// answers, for as long as the cluster takes to recover ([`FOLLOW_AGAIN_S`]). Returns the end's
/// status and message. `psls run` and `psls attach` both follow this way; `again`: a node
/// daemon was lost already (no node answering is then waited out too).
fn follow_job(
    dir: &Path,
    node: Option<&str>,
    job: &str,
    after: &mut std::collections::BTreeMap<u32, u64>,
    attempt: &mut Option<u32>,
    mut again: bool,
) -> Result<(i32, String)> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(FOLLOW_AGAIN_S);
    let mut target = node;
    loop {
        let r = match cluster::connect(dir, target) {
            Ok(mut c) => c.attach(
                job,
                &after.clone(),
                attempt,
                |m| eprintln!("psls: {m}"),
                |rank, seq, err, data| {
                    after.insert(rank, seq);
                    emit_line(rank, err, data);
                },
            ),
            // No node answers now, after one was lost: try again until the deadline.
            Err(_) if again && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(500));
                continue;
            }
            Err(e) => return Err(e),
        };
        match r {
            Ok(done) => return Ok(done),
            Err(e) if lost_daemon(&e) => {
                if std::time::Instant::now() >= deadline {
                    return Err(anyhow::anyhow!(
                        "lost job {job}'s node daemon ({e}) and none answered since; it may still run: `psls attach {job}`"
                    ));
                }
                eprintln!("psls: lost the node daemon ({e}); following job {job} from another node");
                target = None;
                again = true;
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Whether `e` means the node daemon went away (killed, paused, restarted) rather than a
/// refusal: a follower then follows the job again from another node.
fn lost_daemon(e: &psls_client::ClientError) -> bool {
    matches!(
        e,
        psls_client::ClientError::Frame(_)
            | psls_client::ClientError::Connect { .. }
            | psls_client::ClientError::Daemon {
                kind: psls_ipc::ErrorKind::Unavailable,
                ..
            }
    )
}

/// How long `psls run` tries to follow its job again after losing its node daemon.
const FOLLOW_AGAIN_S: u64 = 300;

fn main() -> std::process::ExitCode {
    // `psls ... | head` ends quietly, as a Unix tool does, instead of panicking in println!.
    // SAFETY: setting a signal's disposition to its default before any thread exists touches
    // no memory of ours.
    unsafe {
        let _ = nix::sys::signal::signal(nix::sys::signal::Signal::SIGPIPE, nix::sys::signal::SigHandler::SigDfl);
    }
    let cli = Cli::parse();
    if let Cmd::Run {
        n,
        per_node,
        checkpoint_interval,
        checkpoint_timeout,
        max_restarts,
        respawn_timeout,
        level,
        persistent_interval,
        persistent_every,
        cleaning,
        prefetch,
        resume,
        detach,
        job,
        nodes,
        halt_before,
        command,
    } = &cli.cmd
    {
        let ckpt = psls_ipc::proto::CkptOptions {
            interval_s: *checkpoint_interval,
            timeout_s: (*checkpoint_timeout).max(1),
            max_restarts: *max_restarts,
            respawn_timeout_s: (*respawn_timeout).max(1),
            level: level.clone(),
            persistent_interval_s: persistent_interval.unwrap_or(0),
            persistent_every: *persistent_every,
            cleaning: cleaning.clone().unwrap_or_default(),
            prefetch: *prefetch,
            resume: resume.clone().unwrap_or_default(),
            job: String::new(),
            nodes: Vec::new(),
            stdin: false,
        };
        let ask = RunAsk {
            n: *n,
            per_node: *per_node,
            detach: *detach,
            job: job.as_deref(),
            nodes: nodes.as_deref(),
            halt_before_s: *halt_before,
            command,
        };
        return match run_job(&cli, ask, ckpt) {
            Ok(code) => std::process::ExitCode::from(code.clamp(0, 255) as u8),
            Err(e) => {
                eprintln!("psls: error: {e:#}");
                std::process::ExitCode::from(1)
            }
        };
    }
    match run(&cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("psls: error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

/// Whether `n` needs an operator's look: not up, its disk failed, or re-mirroring.
fn needs_look(n: &psls_ipc::proto::NodeStatus) -> bool {
    n.state != NodeState::Up || n.disk_failed.is_some() || n.rebuild.is_some_and(|(done, total)| done < total)
}

fn print_status(s: &ClusterStatus, all: bool) {
    println!(
        "cluster {} (answered by {}, coordinator {}, metadata term {} applied {}, map v{}, {} files)",
        s.cluster,
        s.via,
        s.coordinator.as_deref().unwrap_or("none"),
        s.meta_term,
        s.meta_seq,
        s.map_version,
        s.files
    );
    if !s.meta_voters.is_empty() {
        println!("metadata voters: {}", s.meta_voters.join(", "));
    }
    // Counts per state, nodes and spares apart: a line whatever the cluster's size.
    let count = |spare: bool| {
        let mut by: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
        for n in s.nodes.iter().filter(|n| n.spare == spare) {
            *by.entry(n.state.to_string()).or_default() += 1;
        }
        by.iter()
            .map(|(st, k)| format!("{k} {st}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let spares = s.nodes.iter().filter(|n| n.spare).count();
    if spares == 0 {
        println!("nodes: {}", count(false));
    } else {
        println!("nodes: {}; spares: {}", count(false), count(true));
    }
    let shown: Vec<&psls_ipc::proto::NodeStatus> = s.nodes.iter().filter(|n| all || needs_look(n)).collect();
    if shown.is_empty() {
        println!("every node is up (psls cluster status --all lists them)");
        return;
    }
    println!(
        "{:<6} {:>3} {:<21} {:<21} {:>8} {:>4} {:<9} {:>22} {:>12} {:>12}",
        "NODE", "ID", "ADDRESS", "LINK", "PID", "INC", "STATE", "MEMORY", "DISK USED", "DISK FREE"
    );
    let tty = std::io::stdout().is_terminal();
    for n in shown {
        let state = match (&n.state, n.spare, n.coordinator) {
            (st, _, true) => format!("{st}*"),
            (NodeState::Up, true, _) => "spare".into(),
            (st, _, _) => st.to_string(),
        };
        println!(
            "{:<6} {:>3} {:<21} {:<21} {:>8} {:>4} {:<9} {:>22} {:>12} {:>12}",
            n.name,
            n.logical.map_or("-".into(), |l| l.to_string()),
            n.addr,
            n.link_addr,
            n.pid.map_or("-".into(), |p| p.to_string()),
            n.incarnation,
            state,
            format!("{} / {}", mib(n.memory_used_bytes), mib(n.memory_capacity_bytes)),
            mib(n.disk_used_bytes),
            mib(n.disk_free_bytes)
        );
        if n.pid.is_some() {
            println!(
                "       metadata log: term {}, commit {}, applied {}",
                n.meta_term, n.meta_commit, n.meta_applied
            );
        }
        if let Some(why) = &n.disk_failed {
            println!("       disk failed: {why}");
        }
        if n.recovery_frames + n.pre_recovery_frames + n.dirty_pages > 0 {
            println!(
                "       frames: {} recovery ({} newer than the disks), {} pre-recovery, of {}; {} dirty pages",
                n.recovery_frames, n.unsaved_frames, n.pre_recovery_frames, n.frame_capacity, n.dirty_pages
            );
        }
        if let Some((done, total)) = n.rebuild {
            let pct = if total == 0 {
                100.0
            } else {
                done as f64 * 100.0 / total as f64
            };
            if tty {
                let filled = (pct / 5.0) as usize;
                println!(
                    "       re-mirroring [{}{}] {pct:5.1}% {done}/{total} pages",
                    "#".repeat(filled),
                    "-".repeat(20 - filled.min(20))
                );
            } else {
                println!("       re-mirroring {done}/{total} pages ({pct:.1}%)");
            }
        }
    }
    println!("(* coordinator)");
}

fn run(cli: &Cli) -> Result<()> {
    let dir = home(cli);
    let node = cli.node.as_deref();
    match &cli.cmd {
        Cmd::Cluster(ClusterCmd::Init {
            nodes,
            spares,
            memory_mb,
            base_port,
            force,
        }) => {
            let cfg = cluster::init(&dir, *nodes, *spares, *memory_mb, *base_port, *force)?;
            println!(
                "initialised cluster '{}' in {}: {} nodes, {} spares, ports {}..{}",
                cfg.cluster.name,
                dir.display(),
                nodes,
                spares,
                base_port,
                *base_port as u32 + 3 * (nodes + spares) - 1
            );
        }
        Cmd::Cluster(ClusterCmd::Up { timeout_s }) => {
            cluster::up(&dir, Duration::from_secs(*timeout_s), false)?;
            println!("cluster is up");
        }
        Cmd::Config(ConfigCmd::Check) => {
            let (cfg, warnings) = cluster::check(&dir)?;
            for w in &warnings {
                eprintln!("warning: {w}");
            }
            println!(
                "{}: valid ({} nodes, {} spares){}",
                cluster::config_path(&dir).display(),
                cfg.nodes.len(),
                cfg.spares.len(),
                if warnings.is_empty() {
                    String::new()
                } else {
                    format!(", {} warnings", warnings.len())
                }
            );
        }
        Cmd::Cluster(ClusterCmd::Down) => {
            let stopped = cluster::down(&dir)?;
            if stopped.is_empty() {
                println!("no daemon that `psls cluster up` started here runs (a daemon under systemd: `systemctl stop psls-node`)");
            } else {
                println!("stopped {} daemons", stopped.len());
            }
        }
        Cmd::Cluster(ClusterCmd::Status { json, all }) => {
            let s = cluster::connect(&dir, node)?.status()?;
            if *json || cli.output == Output::Json {
                print_json(serde_json::to_value(&s)?)?;
            } else {
                print_status(&s, *all);
            }
        }
        Cmd::NodeAdmin(NodeCmd::Replace { id, spare, no_wait }) => {
            cluster::connect(&dir, node)?.replace(*id, spare)?;
            println!("{spare} now holds logical id {id}; re-mirroring its pages");
            if !no_wait {
                wait_rebuild(&dir, spare)?;
            }
        }
        Cmd::Create { name, size, mode } => {
            let f = cluster::connect(&dir, node)?.create(name, *size, *mode)?;
            println!("created {} ({} bytes, {} pages)", f.name, f.size, f.pages);
        }
        Cmd::Import {
            local,
            name,
            replace,
            mode,
        } => {
            // The daemon reads the file through the descriptor we pass: our own access rights.
            let file = std::fs::File::open(local).with_context(|| format!("opening {}", local.display()))?;
            let size = file.metadata()?.len();
            let t = Instant::now();
            let f = cluster::connect(&dir, node)?.import_fd(file.as_fd(), size, name, *mode, *replace)?;
            let secs = t.elapsed().as_secs_f64();
            println!(
                "imported {} ({} bytes, {} pages) in {secs:.2} s ({:.0} MiB/s)",
                f.name,
                f.size,
                f.pages,
                size as f64 / 1048576.0 / secs.max(1e-9)
            );
        }
        Cmd::Export { name, local } => {
            let t = Instant::now();
            let direct = local.as_os_str() == "-" || local.metadata().is_ok_and(|m| !m.is_file());
            // The daemon writes through the descriptor we pass (our own access rights).
            let size = if local.as_os_str() == "-" {
                std::io::stdout().flush()?;
                cluster::connect(&dir, node)?.export_fd(name, std::io::stdout().as_fd())?
            } else if direct {
                // A device or a pipe: write straight into it.
                let out = std::fs::OpenOptions::new()
                    .write(true)
                    .open(local)
                    .with_context(|| format!("opening {}", local.display()))?;
                cluster::connect(&dir, node)?.export_fd(name, out.as_fd())?
            } else {
                // A regular file appears only once complete.
                let tmp = local.with_extension("psls-partial");
                let out = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
                let r = cluster::connect(&dir, node).and_then(|mut c| Ok(c.export_fd(name, out.as_fd())?));
                if r.is_err() {
                    let _ = std::fs::remove_file(&tmp);
                }
                let size = r?;
                std::fs::rename(&tmp, local)?;
                size
            };
            if local.as_os_str() != "-" {
                let secs = t.elapsed().as_secs_f64();
                println!(
                    "exported {name} to {} ({size} bytes) in {secs:.2} s ({:.0} MiB/s)",
                    local.display(),
                    size as f64 / 1048576.0 / secs.max(1e-9)
                );
            }
        }
        Cmd::Ls { json } => {
            let files = cluster::connect(&dir, node)?.ls()?;
            if *json || cli.output == Output::Json {
                let files = files.iter().map(file_json).collect::<Result<Vec<_>>>()?;
                print_json(serde_json::json!({ "files": files }))?;
            } else {
                for f in files {
                    println!("{:>4o} {:>6} {:>6} {:>14} {}", f.mode, f.uid, f.gid, f.size, f.name);
                }
            }
        }
        Cmd::Stat { name, json } => {
            let (f, stripes) = cluster::connect(&dir, node)?.stat(name)?;
            if *json || cli.output == Output::Json {
                print_json(serde_json::json!({ "file": file_json(&f)?, "stripes": stripes }))?;
            } else {
                println!("name: {}\nid: {:016x}\nsize: {} bytes\npages: {}\nowner: uid {} gid {}\nmode: {:o}\ngeneration: {}", f.name, f.id, f.size, f.pages, f.uid, f.gid, f.mode, f.gen);
                println!("stripes (pages first, first+N, ...):");
                for s in stripes {
                    println!(
                        "  first page {:>6}: {:>8} pages  home node {}  mirror node {}",
                        s.first_page, s.pages, s.home, s.mirror
                    );
                }
            }
        }
        Cmd::Rm { name } => {
            cluster::connect(&dir, node)?.rm(name)?;
            println!("removed {name}");
        }
        Cmd::Scrub => {
            let r = cluster::connect(&dir, node)?.scrub()?;
            println!(
                "scrub: {} files, {} copies checked, {} bad, {} repaired, {} unrepairable",
                r.files, r.copies_checked, r.bad_copies, r.repaired, r.unrepairable
            );
            if r.unrepairable > 0 {
                bail!("{} copies could not be repaired", r.unrepairable);
            }
        }
        Cmd::Jobs { json, cmd } => match cmd {
            Some(JobsCmd::Rm { job }) => {
                cluster::connect(&dir, node)?.job_rm(job)?;
                println!("job {job} removed");
            }
            None => {
                let list = cluster::connect(&dir, node)?.jobs()?;
                if *json || cli.output == Output::Json {
                    print_json(serde_json::json!({ "jobs": list }))?;
                } else {
                    println!(
                        "{:<24} {:<10} {:>5} {:>6} {:<10} {:>21} {:>12} {:>10} {:>10} {:>6} {:>17}  COMMAND",
                        "JOB",
                        "STATE",
                        "RANKS",
                        "EPOCH",
                        "LEVEL",
                        "CHECKPOINT TIME (UTC)",
                        "SIZE",
                        "PAUSE",
                        "COMMIT",
                        "DISK",
                        "FRAMES R/U/P"
                    );
                    for j in list {
                        let when = if j.epoch == 0 {
                            "-".to_string()
                        } else {
                            utc(j.at_unix_ms)
                        };
                        let ms = |us: u64| {
                            if us == 0 {
                                "-".to_string()
                            } else {
                                format!("{:.1} ms", us as f64 / 1000.0)
                            }
                        };
                        // Recovery copies over the live nodes: of the last memory checkpoint,
                        // of them newer than the disks, and being taken.
                        let frames = if j.state == "running" {
                            format!("{}/{}/{}", j.recovery_frames, j.unsaved_frames, j.pre_recovery_frames)
                        } else {
                            "-".to_string()
                        };
                        println!(
                            "{:<24} {:<10} {:>5} {:>6} {:<10} {:>21} {:>12} {:>10} {:>10} {:>6} {:>17}  {}",
                            j.job,
                            j.state,
                            j.ranks,
                            j.epoch,
                            if j.level.is_empty() { "-" } else { &j.level },
                            when,
                            format!("{:.1} MiB", j.bytes as f64 / (1 << 20) as f64),
                            ms(j.pause_us),
                            ms(j.commit_us),
                            j.persistent_epoch,
                            frames,
                            j.command
                        );
                        if !j.finished.is_empty() {
                            println!("{:<24} finished computing, but {}", "", j.finished);
                        }
                        if !j.activity.is_empty() {
                            let when = if j.state == "running" { "now" } else { "ended" };
                            println!("{:<24} {when}: {}", "", j.activity);
                        }
                    }
                }
            }
        },
        Cmd::Checkpoint { job } => {
            cluster::connect(&dir, node)?.force_checkpoint(job, false)?;
            println!("job {job} takes a checkpoint at its next safe-point call");
        }
        Cmd::Halt { job } => {
            cluster::connect(&dir, node)?.force_checkpoint(job, true)?;
            println!("job {job} takes a checkpoint at its next safe-point call, then stops");
        }
        Cmd::Attach { job } => {
            let code = attach(&dir, node, job)?;
            if code != 0 {
                std::process::exit(code.clamp(0, 255));
            }
        }
        Cmd::Cancel { job } => {
            cluster::connect(&dir, node)?.cancel(job)?;
            println!("job {job} is stopping; it can be resumed from its newest intact checkpoint");
        }
        Cmd::Demo { size_mb } => demo(&dir, *size_mb)?,
        Cmd::Run { .. } => unreachable!("handled in main"),
    }
    Ok(())
}

fn wait_rebuild(dir: &Path, spare: &str) -> Result<()> {
    let bar = std::io::stdout().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template("re-mirroring {bar:40} {pos}/{len} pages ({eta})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let deadline = Instant::now() + Duration::from_secs(3600);
    loop {
        // Any node's status will do once it has applied the replacement: until the spare has
        // its logical id, that node has not.
        let st = cluster::connect(dir, None)?.status()?;
        let n = st
            .nodes
            .iter()
            .find(|n| n.name == spare)
            .context("spare vanished from status")?;
        match (n.logical, n.rebuild) {
            (Some(_), None) => {
                if let Some(b) = &bar {
                    b.finish_and_clear();
                }
                println!("re-mirroring done: every page has two copies again");
                return Ok(());
            }
            (_, Some((done, total))) => {
                if let Some(b) = &bar {
                    b.set_length(total);
                    b.set_position(done);
                }
            }
            (None, None) => {}
        }
        if Instant::now() > deadline {
            bail!("re-mirroring did not finish within an hour");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn demo(dir: &Path, size_mb: u64) -> Result<()> {
    use nix::sys::signal::{kill, Signal};
    if !cluster::config_path(dir).exists() {
        cluster::init(dir, 4, 1, 1024, 7400, false)?;
        println!("[1/7] initialised a 4-node cluster (+1 spare) in {}", dir.display());
    } else {
        println!("[1/7] using the cluster in {}", dir.display());
    }
    cluster::up(dir, Duration::from_secs(30), true)?;
    println!("[2/7] cluster is up");
    let size = size_mb * 1024 * 1024;
    let data = psls_svm::rng::random_bytes(size as usize, 2026);
    let t = Instant::now();
    let exists = cluster::connect(dir, Some("n0"))?
        .ls()?
        .iter()
        .any(|f| f.name == "demo.dat");
    let f = cluster::connect(dir, Some("n0"))?.import(&mut data.as_slice(), size, "demo.dat", 0o644, exists)?;
    println!(
        "[3/7] imported demo.dat: {} MiB, {} pages, in {:.2} s",
        size_mb,
        f.pages,
        t.elapsed().as_secs_f64()
    );
    let victim = "n2";
    let pid = cluster::running_pid(dir, victim).context("n2 is not running")?;
    kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL)?;
    println!("[4/7] killed {victim} (pid {pid}) with SIGKILL");
    let mut out = Vec::with_capacity(size as usize);
    let t = Instant::now();
    cluster::connect(dir, Some("n0"))?.export("demo.dat", &mut out)?;
    let same = out == data;
    println!(
        "[5/7] exported demo.dat with {victim} down in {:.2} s: {}",
        t.elapsed().as_secs_f64(),
        if same {
            "bit-identical to the original"
        } else {
            "DIFFERENT from the original"
        }
    );
    if !same {
        bail!("exported data differs from what was imported");
    }
    cluster::up(dir, Duration::from_secs(30), true)?;
    println!("[6/7] restarted {victim}; cluster status:");
    print_status(&cluster::connect(dir, Some("n0"))?.status()?, true);
    // The shared-memory job: MGS over a parallel file, one rank per node, next to the same
    // kernel on threads in one process (its JSON line carries the ratio and the checks).
    let mgs = std::env::current_exe()?.with_file_name("mgs");
    if mgs.exists() {
        println!("[7/7] MGS 1024x1024 as a 4-rank job (`psls run -n 4 -- mgs`), one rank per node:");
        let status = std::process::Command::new(std::env::current_exe()?)
            .arg("--dir")
            .arg(dir)
            .args(["run", "-n", "4", "--"])
            .arg(&mgs)
            // One file across demo runs: a node restarted since the last run costs nothing.
            .args(["--file", "mgs-demo"])
            .status()
            .context("running MGS")?;
        if !status.success() {
            bail!("MGS failed ({status})");
        }
    } else {
        println!(
            "[7/7] skipped MGS: {} not found (cargo build --release --workspace --bins)",
            mgs.display()
        );
    }
    println!(
        "the cluster is still running: `psls --dir {} cluster down` stops it",
        dir.display()
    );
    Ok(())
}

/// `YYYY-MM-DD hh:mm:ss` (UTC) of a time in ms since the Unix epoch.
fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::{parse_duration_s, parse_size};

    #[test]
    fn sizes_take_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        for s in ["1M", "1m", "1MiB", "1MB", "1 M"] {
            assert_eq!(parse_size(s), Ok(1 << 20), "{s}");
        }
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert!(parse_size("1Q").is_err_and(|e| e.contains("unknown unit")));
        assert!(parse_size("M").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err_and(|e| e.contains("too large")));
    }

    #[test]
    fn durations_are_seconds_or_take_units() {
        assert_eq!(parse_duration_s("60"), Ok(60));
        assert_eq!(parse_duration_s("90s"), Ok(90));
        assert_eq!(parse_duration_s("2m"), Ok(120));
        assert_eq!(parse_duration_s("1h 30m"), Ok(5400));
        assert!(parse_duration_s("1.5s").is_err());
        assert!(parse_duration_s("soon").is_err());
    }
}

#[cfg(test)]
mod chain_tests {
    use super::*;

    fn info(state: &str, end: &str) -> psls_ipc::proto::JobInfo {
        psls_ipc::proto::JobInfo {
            job: "j".into(),
            state: state.into(),
            end: end.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_chain_link_starts_follows_resumes_or_stops() {
        let step = |state: &str, end: &str| chain_step("j", Some(&info(state, end))).ok();
        assert_eq!(chain_step("j", None).ok(), Some(Chain::Start));
        assert_eq!(step("running", ""), Some(Chain::Follow));
        for end in ["halted", "cancelled", "node_fail", "unwritten"] {
            assert_eq!(step("resumable", end), Some(Chain::Resume), "{end}");
        }
        assert_eq!(step("finished", "finished"), Some(Chain::Finished));
        assert_eq!(step("cancelled", "cancelled"), Some(Chain::Start));
        assert_eq!(step("resumable", "failed"), None);
        assert_eq!(step("failed", "failed"), None);
    }
}
