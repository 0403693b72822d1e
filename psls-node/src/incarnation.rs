//! A daemon's incarnation: the counter in its data folder (bumped durably at every start) and
//! rejoining as a new incarnation, which is what a fenced daemon does (DESIGN §2).
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

fn read_counter(dir: &Path) -> Result<u64> {
    let p = dir.join("incarnation");
    match std::fs::read_to_string(&p) {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .with_context(|| format!("{} is corrupt", p.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

/// Bumps the incarnation counter in `dir` durably and returns the new incarnation.
pub fn next(dir: &Path) -> Result<u64> {
    let next = read_counter(dir)? + 1;
    write_durably(&dir.join("incarnation"), next.to_string().as_bytes())?;
    Ok(next)
}

/// Raises the counter in `dir` to at least `at_least` (the next start is above it).
pub fn raise(dir: &Path, at_least: u64) -> Result<()> {
    if read_counter(dir)? >= at_least {
        return Ok(());
    }
    write_durably(&dir.join("incarnation"), at_least.to_string().as_bytes())
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
