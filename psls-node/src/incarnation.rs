//! A daemon's incarnation: the counter in its data folder (bumped durably at every start; in a
//! blank folder, drawn from the clock so it never repeats one of a lost disk) and rejoining as
//! a new incarnation, which is what a fenced daemon does (DESIGN §2).
//!
//! A node the cluster declared down — or that learns it was, after a pause or a partition —
//! must not go on with its old state: others rolled back without it, and every message of its
//! old incarnation is dropped. It stops its ranks (SIGKILL to their process groups, then reaps
//! them), makes sure its next incarnation is above the one declared down, and re-executes the
//! daemon with the same arguments and environment: the new image starts as after a crash, with
//! an empty memory, a new incarnation and the same pid (so `psls cluster down` still finds it).
//! Descriptors are close-on-exec, so the ports and the socket are free for the new image.

use anyhow::{Context, Result};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::Path;

/// Writes `data` to `path` atomically and durably (a temporary file, fsync, rename, fsync of
/// the folder).
pub fn write_durably(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(data)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The name of the counter's file in a data folder: a folder without it is blank (a new
/// node's, or a replaced disk).
pub const COUNTER_FILE: &str = "incarnation";

/// A blank start's mark, kept until the cluster decided what the node's blank disk means
/// ([`rejoin_decided`]): a start that finds it is a blank start again, whatever the folder
/// holds by then (the node restarted, killed or fenced, before its copies were rebuilt).
pub const REJOIN_FILE: &str = "rejoin-pending";

/// The highest incarnation a daemon may have: the shared-memory incarnation keeps it in 32 bits.
pub const MAX_INCARNATION: u64 = u32::MAX as u64;

fn read_counter(dir: &Path) -> Result<Option<u64>> {
    let p = dir.join(COUNTER_FILE);
    match std::fs::read_to_string(&p) {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .map(Some)
            .with_context(|| format!("{} is corrupt", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

/// A daemon's incarnation for this start ([`next`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Start {
    pub incarnation: u64,
    /// The data folder had no counter: a new node's, or a disk replaced since the last start;
    /// or it is `unfinished`.
    pub blank: bool,
    /// An earlier blank start of this folder ended before the cluster decided what it meant
    /// (what the folder holds is only what was written since; the rest is missing).
    pub unfinished: bool,
}

/// Bumps the incarnation counter in `dir` durably and returns the new incarnation. In a blank
/// folder (no counter), where the previous incarnations of this node are unknown, it is the
/// time in seconds since the Unix epoch (as Cassandra's generation; the start waits for that
/// second to end, so no two blank starts draw the same): above any earlier one unless the node
/// restarted more than once a second on average since — and should a peer have heard a higher
/// one, this one fences itself and comes back above it.
pub fn next(dir: &Path) -> Result<Start> {
    let unfinished = dir.join(REJOIN_FILE).exists();
    let (incarnation, blank) = match read_counter(dir)? {
        Some(c) => (c + 1, false),
        None => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            // Not before this second is over: a later blank start of this node (its disk
            // replaced again) then draws a later second.
            std::thread::sleep(
                std::time::Duration::from_secs(1)
                    .saturating_sub(std::time::Duration::from_nanos(u64::from(now.subsec_nanos()))),
            );
            (now.as_secs().max(1), true)
        }
    };
    if incarnation > MAX_INCARNATION {
        anyhow::bail!(
            "the incarnation counter in {} reached {incarnation}, above {MAX_INCARNATION}",
            dir.display()
        );
    }
    // The mark before the counter: a folder with a counter and no mark is never blank.
    if blank {
        write_durably(&dir.join(REJOIN_FILE), b"")?;
    }
    write_durably(&dir.join(COUNTER_FILE), incarnation.to_string().as_bytes())?;
    Ok(Start {
        incarnation,
        blank: blank || unfinished,
        unfinished,
    })
}

/// The cluster decided what this node's blank start means (a rejoin recorded, or nothing to
/// rebuild): the next start is an ordinary one.
pub fn rejoin_decided(dir: &Path) -> Result<()> {
    match std::fs::remove_file(dir.join(REJOIN_FILE)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("removing {}", dir.join(REJOIN_FILE).display())),
    }
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// Raises the counter in `dir` to at least `at_least` (the next start is above it).
pub fn raise(dir: &Path, at_least: u64) -> Result<()> {
    if read_counter(dir)?.is_some_and(|c| c >= at_least) {
        return Ok(());
    }
    write_durably(&dir.join(COUNTER_FILE), at_least.to_string().as_bytes())
}

/// Kills `ranks` (process ids, each the leader of its group) and reaps them, so they do not
/// linger as zombies of a new image (which does not know them).
pub fn stop_ranks(ranks: &[u32]) {
    for &pid in ranks {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    for &pid in ranks {
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid as i32), None);
    }
}

/// Stops `ranks` (process ids, each the leader of its group), raises the incarnation counter in
/// `dir` to at least `declared`, and re-executes this daemon. Returns only if the exec failed,
/// after which the caller must exit.
pub fn rejoin(dir: &Path, ranks: &[u32], declared: u64) -> std::io::Error {
    stop_ranks(ranks);
    if let Err(e) = raise(dir, declared) {
        return std::io::Error::other(format!("{e:#}"));
    }
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_else(|| "psls-node".into());
    // The same binary (even if its file was replaced since), under the same argv[0]: tools
    // that recognise the daemon by its command line still do.
    std::process::Command::new("/proc/self/exe")
        .arg0(argv0)
        .args(args)
        .exec()
}
