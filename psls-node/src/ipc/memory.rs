//! Local clients' shared-memory requests: map a file or a volatile segment (the node's memfd
//! comes back with the answer), register a mapping's userfaultfd, unmap, the fault counters,
//! and the lifeline that tells a client its fault failed (and, when it closes, that the process
//! is gone). A client registers only files mapped on the same connection, and writable only if
//! it was granted writable there.

use super::conn::{err, misrouted, send, send_with_fd, Conn, Flow};
use crate::dispatch::Daemon;
use crate::op::OpError;
use crate::pfs::{self, Caller};
use psls_ipc::proto::{Request, Response};
use psls_ipc::ErrorKind;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use tokio::io::AsyncReadExt;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// Map, register, unmap, fault counters, lifeline.
pub(super) async fn handle(c: &mut Conn, req: Request, mut fds: Vec<OwnedFd>) -> std::io::Result<Flow> {
    let (d, caller, pid) = (c.d.clone(), c.caller, c.pid);
    let node = d.node.clone();
    let resp = match req {
        Request::Map {
            name,
            size,
            create,
            writable,
            volatile,
            job,
        } => match join(&d, caller, pid, &job, volatile) {
            Err(e) => err(e),
            Ok(()) => match map(
                &d,
                (caller, pid),
                &name,
                size,
                create,
                writable,
                volatile.then_some(job.as_str()),
            )
            .await
            {
                Ok((resp, memfd)) => {
                    if let Response::Mapped { file, writable, .. } = resp {
                        // Writable once granted on this connection, whatever came after.
                        *c.granted.entry(file).or_insert(false) |= writable;
                        // A rank's parallel file: the job's last checkpoint covers it.
                        if let (true, Some(pid)) = (writable && !volatile, pid) {
                            if let Some((spec, _)) = d.jobs.rank_of(pid as u32) {
                                d.jobs.note_written(&spec.job, psls_svm::FileId(file));
                            }
                        }
                    }
                    send_with_fd(&mut c.w, &resp, std::os::fd::AsFd::as_fd(&memfd)).await?;
                    return Ok(Flow::Sent);
                }
                Err(e) => err(e),
            },
        },
        Request::Register {
            file,
            base,
            len,
            writable,
        } => match (c.granted.get(&file), pid, fds.len()) {
            (None, _, _) => err(OpError::new(
                ErrorKind::Invalid,
                "register of a file not mapped on this connection",
            )),
            (Some(false), _, _) if writable => err(OpError::new(
                ErrorKind::Permission,
                "the file was mapped read-only: it cannot be registered writable",
            )),
            (_, None, _) => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
            (_, _, n) if n != 1 => err(OpError::new(
                ErrorKind::Invalid,
                format!("register needs exactly one descriptor (the userfaultfd), got {n}"),
            )),
            (Some(_), Some(pid), _) => {
                let fd = fds.remove(0);
                match d
                    .svm
                    .register(&node, pid, psls_svm::FileId(file), base, len, writable, fd)
                {
                    Ok(()) => Response::Ok,
                    Err(e) => err(e),
                }
            }
        },
        Request::Unmap { base } => match pid {
            Some(pid) => match d.svm.unregister(pid, base) {
                Ok(None) => Response::Ok,
                // A rank's: the job's checkpoints (its last at its end) make it durable.
                Ok(Some(_)) if d.jobs.rank_of(pid as u32).is_some() => Response::Ok,
                // The process's last writable mapping of a parallel file: its writes become
                // durable before the answer.
                Ok(Some(file)) => {
                    let job = job_of(&d, pid);
                    match d.ckpt.checkpoint(&job, vec![file]).await {
                        Ok(_) => {
                            // It writes the file no more: another job may.
                            match d.ckpt.release(pid, file).await {
                                Ok(()) => Response::Ok,
                                Err(e) => err(e),
                            }
                        }
                        Err(e) => err(OpError::new(
                            e.kind,
                            format!("unmapped, but the writes are not durable: {}", e.message),
                        )),
                    }
                }
                Err(e) => err(e),
            },
            None => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
        },
        Request::Sync => match pid {
            Some(pid) => {
                let files = d.svm.writable_files(pid);
                if files.is_empty() {
                    Response::Synced { epoch: 0, pages: 0 }
                } else {
                    match d.ckpt.checkpoint(&job_of(&d, pid), files).await {
                        Ok(done) => Response::Synced {
                            epoch: done.epoch,
                            pages: done.pages,
                        },
                        Err(e) => err(e),
                    }
                }
            }
            None => err(OpError::new(ErrorKind::Invalid, "no peer pid")),
        },
        Request::SvmStats => {
            let st = d.svm.stats();
            let frames = node.frames.counts();
            Response::SvmStats {
                node: node.name().to_string(),
                counters: vec![
                    ("local_faults".into(), st.local_faults),
                    ("wp_faults".into(), d.svm.wp_faults()),
                    ("read_requests".into(), st.read_requests),
                    ("write_requests".into(), st.write_requests),
                    ("pages_in".into(), st.pages_in),
                    ("pages_out".into(), st.pages_out),
                    ("pages_loaded".into(), st.pages_loaded),
                    ("invalidations".into(), st.invalidations),
                    ("failed_faults".into(), st.failed_faults),
                    ("joined_reads".into(), st.joined_reads),
                    ("implied_grants".into(), st.implied_grants),
                    ("posted_messages".into(), node.net.posted()),
                    ("coherence_messages".into(), st.messages_out),
                    ("link_writes".into(), node.net.link.writes()),
                    ("sync_channels".into(), d.channels.len() as u64),
                    ("sync_waits".into(), d.sync.waits() as u64),
                    (
                        "store_page_writes".into(),
                        node.store_page_writes.load(std::sync::atomic::Ordering::Relaxed),
                    ),
                    (
                        "ckpt_pages_taken".into(),
                        node.ckpt_pages_taken.load(std::sync::atomic::Ordering::Relaxed),
                    ),
                    (
                        "ckpt_pages_sent".into(),
                        node.ckpt_pages_sent.load(std::sync::atomic::Ordering::Relaxed),
                    ),
                    ("frames_recovery".into(), frames.recovery),
                    ("frames_pre_recovery".into(), frames.pre_recovery),
                    ("frames_unsaved".into(), frames.unsaved),
                    ("frames_peak".into(), frames.peak),
                    ("frames_peak_recovery".into(), frames.peak_recovery),
                    ("frames_peak_pre_recovery".into(), frames.peak_pre_recovery),
                ],
            }
        }
        Request::Lifeline => {
            let Some(pid) = pid else {
                send(&mut c.w, &err(OpError::new(ErrorKind::Invalid, "no peer pid"))).await?;
                return Ok(Flow::Close);
            };
            return Ok(Flow::Lifeline(pid));
        }
        other => misrouted(&other),
    };
    Ok(Flow::Reply(resp))
}

/// Holds a client's lifeline: writes `Fatal` when one of its faults fails; returns when the
/// client closes it.
pub(super) async fn lifeline(
    d: &Arc<Daemon>,
    pid: i32,
    mut r: OwnedReadHalf,
    mut w: OwnedWriteHalf,
) -> anyhow::Result<()> {
    let node = &d.node;
    let (id, mut rx) = d.svm.lifeline(pid);
    let mut byte = [0u8; 1];
    let r = loop {
        tokio::select! {
            m = rx.recv() => match m {
                Some(message) => {
                    if let Err(e) = send(&mut w, &Response::Fatal { message }).await {
                        break Err(e.into());
                    }
                }
                None => break Ok(()),
            },
            _ = r.read(&mut byte) => break Ok(()),
        }
    };
    // The process is gone (or closed its last session): its locks and barrier waits go with it.
    if !d.svm.end_lifeline(pid, id) {
        return r;
    }
    if let Err(e) = crate::sync::gone(&d.sync, crate::sync::who(node, pid)) {
        tracing::warn!(node = %node.name(), pid, error = %e, "could not release a dead client's locks");
    }
    // Its writes become durable, as at its last unmap (a process's end unmaps: with a
    // shared mapping its writes outlive it), then its writer claims go: a file nobody writes
    // holds in memory what its disks hold. (A rank's job makes them durable at its end.)
    if let Some((job, files)) = d
        .ckpt
        .claimed(pid)
        .filter(|(j, fs)| crate::ckpt::is_process_job(j) && !fs.is_empty())
    {
        if let Err(e) = d.ckpt.checkpoint(&job, files).await {
            tracing::error!(node = %node.name(), pid, job, error = %e, "an ended process's writes could not be made durable: the disks keep its last synced version");
        }
    }
    // Its writer claims, and its checkpoint record if it took checkpoints, go too.
    d.ckpt.release_all(pid).await;
    let job = process_job(d, pid);
    let st = node.meta_state();
    if st.jobs.contains_key(&job) || st.files_written_by(&job).next().is_some() {
        if let Err(e) = node.submit(psls_pfs::meta::MetaOp::EndJob { job: job.clone() }).await {
            tracing::warn!(node = %node.name(), job, error = %e, "could not drop an ended process's checkpoint record");
        }
    }
    r
}

/// The checkpoint job of a process that maps files outside `psls run`: the process itself.
pub(super) fn process_job(d: &Daemon, pid: i32) -> String {
    format!("proc:{}:{pid}", d.node.name())
}

/// A process outside `psls run` that names a job (`PSLS_JOB`) joins it at its first mapping.
fn join(d: &Daemon, caller: Caller, pid: Option<i32>, job: &str, volatile: bool) -> Result<(), OpError> {
    let Some(pid) = pid else { return Ok(()) };
    if job.is_empty() || volatile || d.jobs.rank_of(pid as u32).is_some() {
        return Ok(());
    }
    d.ckpt.join(pid, &crate::ckpt::ext_job(caller.uid, job)?);
    Ok(())
}

/// The job of process `pid`: its `psls run` job, the `PSLS_JOB` it joined, or itself.
pub(super) fn job_of(d: &Daemon, pid: i32) -> String {
    match d.jobs.rank_of(pid as u32) {
        Some((spec, _)) => spec.job,
        None => d.ckpt.ext_job_of(pid).unwrap_or_else(|| process_job(d, pid)),
    }
}

/// A stable id for a volatile segment: from its owner, job and name (high bit set, so it
/// never collides with a parallel file's id). A later job's segment of the same name is
/// another segment, so late messages about an ended job's pages touch nothing of it.
fn volatile_id(uid: u32, job: &str, name: &str) -> psls_svm::FileId {
    let mut h = psls_svm::rng::mix64(uid as u64 ^ 0x5053_4c53);
    // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
    for part in [job, name] {
        h = psls_svm::rng::mix64(h ^ part.len() as u64);
        for chunk in part.as_bytes().chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            h = psls_svm::rng::mix64(h ^ u64::from_le_bytes(b));
        }
    }
    psls_svm::FileId(h | 1 << 63)
}

/// The file in `job`'s checkpoint area that keeps its volatile segment `name` of `size` bytes
/// (created by the first rank that maps it, the caller's alone).
async fn volatile_area(
    d: &Arc<Daemon>,
    caller: Caller,
    job: &str,
    name: &str,
    size: u64,
) -> Result<psls_pfs::meta::FileMeta, OpError> {
    let node = &d.node;
    let file = crate::ckpt::volatile_file_name(job, name);
    if file.len() > psls_pfs::meta::MAX_NAME_LEN {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!(
                "volatile segment name '{name}' is too long: with job {job} it must fit in {} bytes",
                psls_pfs::meta::MAX_NAME_LEN
            ),
        ));
    }
    let f = pfs::lookup_or_create(node, caller, &file, size, 0o600).await?;
    // Only this daemon creates area files (the prefix is reserved), as the job's user.
    if f.uid != caller.uid {
        return Err(OpError::new(
            ErrorKind::Permission,
            format!(
                "job {job}'s file for volatile segment '{name}' belongs to uid {}",
                f.uid
            ),
        ));
    }
    caller.check_write(&f)?;
    if size > f.size {
        return Err(OpError::new(
            ErrorKind::Invalid,
            format!(
                "cannot map {size} bytes of volatile segment '{name}': job {job} made it {} bytes",
                f.size
            ),
        ));
    }
    Ok(f)
}

/// `Map`: checks the caller's rights, creates the file if asked, opens the node's segment.
async fn map(
    d: &Arc<Daemon>,
    (caller, pid): (Caller, Option<i32>),
    name: &str,
    size: u64,
    create: bool,
    writable: bool,
    // `Some(job)` for a volatile segment of `job` (empty: outside a job).
    volatile: Option<&str>,
) -> Result<(Response, std::fs::File), OpError> {
    let node = &d.node;
    let pages_len = |n: u64| n.div_ceil(psls_svm::PAGE_SIZE as u64) * psls_svm::PAGE_SIZE as u64;
    if size == 0 {
        return Err(OpError::new(ErrorKind::Invalid, "cannot map 0 bytes"));
    }
    // A writable mapping gets the node's memfd read-write: only callers who may write the file
    // get one. A read-only mapping gets a read-only descriptor of the same memory (it cannot
    // be mapped shared for writing, nor made writable later).
    if !writable && (create || volatile.is_some()) {
        return Err(OpError::new(
            ErrorKind::Invalid,
            "a read-only mapping is of an existing parallel file (no create, no volatile segment)",
        ));
    }
    let (id, file_size, backing) = if let Some(job) = volatile {
        psls_pfs::meta::validate_name(name).map_err(|e| OpError::new(ErrorKind::Invalid, e.to_string()))?;
        if job.len() > 256 {
            return Err(OpError::new(ErrorKind::Invalid, "job id longer than 256 bytes"));
        }
        let job = (!job.is_empty()).then(|| job.to_string());
        // A `psls run` job with a rank here, of the caller's user: the rank itself, or a
        // process it started (which names the job by the `PSLS_JOB` it inherited).
        let launched = job
            .as_deref()
            .and_then(|j| d.jobs.local_spec(j))
            .is_some_and(|spec| spec.uid == caller.uid);
        match job {
            // A segment of a `psls run` job is kept in the job's checkpoint area: its
            // checkpoints save it, a rollback restores it.
            Some(job) if launched => {
                let f = volatile_area(d, caller, &job, name, size).await?;
                (
                    f.id,
                    f.size,
                    crate::svm::Backing::Volatile {
                        job: Some(job),
                        area: Some(f),
                    },
                )
            }
            job => (
                volatile_id(caller.uid, job.as_deref().unwrap_or(""), name),
                size,
                crate::svm::Backing::Volatile { job, area: None },
            ),
        }
    } else {
        crate::ckpt::not_reserved(name)?;
        let f = if create {
            pfs::lookup_or_create(node, caller, name, size, 0o644).await?
        } else {
            pfs::lookup_file(node, name).await?
        };
        caller.check_read(&f)?;
        if writable {
            caller.check_write(&f)?;
            // One job writes a file at a time (readers are free).
            let pid = pid.unwrap_or(0);
            d.ckpt.claim(pid, &job_of(d, pid), f.id).await?;
        }
        if size > f.size {
            return Err(OpError::new(
                ErrorKind::Invalid,
                format!("cannot map {size} bytes of '{name}': the file has {} bytes", f.size),
            ));
        }
        (f.id, f.size, crate::svm::Backing::Pfs(f))
    };
    let mut memfd = d.svm.segment(node, id, name, file_size, backing)?;
    if !writable {
        memfd = read_only(&memfd)?;
    }
    let resp = Response::Mapped {
        file: id.0,
        size: file_size,
        len: pages_len(size),
        writable,
    };
    Ok((resp, memfd))
}

/// A new read-only open file description of `file` (through its /proc link).
fn read_only(file: &std::fs::File) -> Result<std::fs::File, OpError> {
    use std::os::fd::AsRawFd;
    std::fs::OpenOptions::new()
        .read(true)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|e| OpError::new(ErrorKind::Internal, format!("reopening a memfd read-only: {e}")))
}
