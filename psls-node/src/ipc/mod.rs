//! The node's Unix socket for local clients and the admin CLI. The caller's uid/gid come from
//! SO_PEERCRED; file owners and modes decide reads and writes, and cluster administration
//! (scrub, replace, shutdown) is for root or the daemon's own user. Every frame is bounded.
//!
//! This module reads requests (with the descriptors passed alongside) and hands each to the
//! handler of its area: [`files`], [`memory`] (shared memory), [`ranks`] (barriers, locks,
//! jobs), [`admin`]. A handler answers, or takes the connection over (a lifeline, a job).

pub(crate) mod admin;
mod conn;
mod files;
mod memory;
mod ranks;

use crate::dispatch::Daemon;
use crate::op::OpError;
use crate::pfs::Caller;
use conn::{err, read_req_with_fds, send, Conn, Flow};
use psls_ipc::proto::{Request, Response};
use psls_ipc::ErrorKind;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::net::{UnixListener, UnixStream};

pub use admin::status;

/// Binds the socket, refusing to steal one a live daemon listens on.
pub fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("socket {} is in use by another running daemon", path.display());
        }
        std::fs::remove_file(path)?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let l = UnixListener::bind(path).map_err(|e| anyhow::anyhow!("cannot bind socket {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(l)
}

pub async fn serve(d: Arc<Daemon>, listener: UnixListener, _path: PathBuf) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CLIENTS));
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept on client socket failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Refused with one clear answer (a client reads it as the reply to its request).
            tracing::warn!(limit = MAX_CLIENTS, "client connection refused: too many connections");
            tokio::spawn(async move {
                let (_, mut w) = stream.into_split();
                let why = format!("the daemon serves at most {MAX_CLIENTS} client connections at once");
                let _ = tokio::time::timeout(
                    std::time::Duration::from_secs(1),
                    send(&mut w, &err(OpError::new(ErrorKind::Unavailable, why))),
                )
                .await;
            });
            continue;
        };
        let d = d.clone();
        tokio::spawn(async move {
            if let Err(e) = client(d, stream).await {
                tracing::debug!(error = %e, "client connection ended");
            }
            drop(slot);
        });
    }
}

/// Client connections served at once, at most (each costs a task and small buffers: a frame's
/// body is not allocated before its bytes come).
pub const MAX_CLIENTS: usize = 4096;

/// The next client connection's number.
static NEXT_CONN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

async fn client(d: Arc<Daemon>, stream: UnixStream) -> anyhow::Result<()> {
    let cred = stream.peer_cred()?;
    let caller = Caller {
        uid: cred.uid(),
        gid: cred.gid(),
    };
    let (mut r, mut w) = stream.into_split();
    // The handshake: a client of another build is refused with both protocols named. Its
    // magic first: an older client's request (at least 5 bytes) is answered at once.
    let mut hello = [0u8; 8];
    for part in [0..4, 4..8] {
        let bad_magic = part.start == 4 && hello[..4] != *b"PSLS";
        if bad_magic {
            break;
        }
        match tokio::io::AsyncReadExt::read_exact(&mut r, &mut hello[part]).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(why) = psls_ipc::proto::check_hello(&hello, env!("CARGO_PKG_VERSION")) {
        tracing::warn!(uid = caller.uid, pid = ?cred.pid(), "{why}");
        let _ = send(&mut w, &err(OpError::new(ErrorKind::Invalid, why))).await;
        return Ok(());
    }
    let mut c = Conn {
        d,
        caller,
        pid: cred.pid(),
        granted: std::collections::HashMap::new(),
        id: NEXT_CONN.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        safe_calls: 0,
        r,
        w,
    };
    loop {
        let (req, fds) = match read_req_with_fds(&mut c.r).await {
            Ok(Some(req)) => req,
            Ok(None) => return Ok(()),
            Err(e) => {
                tracing::warn!(uid = caller.uid, error = %e, "bad client message");
                let _ = send(
                    &mut c.w,
                    &err(OpError::new(ErrorKind::Invalid, format!("bad request: {e}"))),
                )
                .await;
                return Ok(());
            }
        };
        // A name is looked up in a namespace holding every operation answered before the
        // request (the leader's read index), so a file created through any node is found here.
        let fresh = matches!(
            req,
            Request::Export { .. }
                | Request::ExportFd { .. }
                | Request::Ls
                | Request::Stat { .. }
                | Request::Rm { .. }
                | Request::Map { .. }
        );
        if fresh {
            if let Err(e) = c.d.node.meta_fresh().await {
                send(&mut c.w, &err(e)).await?;
                continue;
            }
        }
        let flow = match req {
            Request::Create { .. }
            | Request::ImportBegin { .. }
            | Request::ImportData { .. }
            | Request::ImportCommit
            | Request::Export { .. }
            | Request::ImportFd { .. }
            | Request::ExportFd { .. }
            | Request::Ls
            | Request::Stat { .. }
            | Request::Rm { .. } => files::handle(&mut c, req, fds).await?,
            Request::Map { .. }
            | Request::Register { .. }
            | Request::Unmap { .. }
            | Request::Sync
            | Request::SvmStats
            | Request::Lifeline => memory::handle(&mut c, req, fds).await?,
            Request::SyncChannel
            | Request::Barrier { .. }
            | Request::Lock { .. }
            | Request::Unlock { .. }
            | Request::Run { .. }
            | Request::RunJob { .. }
            | Request::Stdin { .. }
            | Request::Jobs
            | Request::JobRm { .. }
            | Request::Attach { .. }
            | Request::Cancel { .. }
            | Request::Checkpoint { .. }
            | Request::RestartState { .. }
            | Request::ForceCheckpoint { .. } => ranks::handle(&mut c, req, fds).await?,
            Request::Whoami => Flow::Reply(Response::Node {
                name: c.d.node.name().to_string(),
                cluster: c.d.node.cfg.cluster.name.clone(),
            }),
            Request::Status
            | Request::Scrub
            | Request::NodeReplace { .. }
            | Request::PeerPing { .. }
            | Request::Shutdown => admin::handle(&mut c, req, fds).await?,
        };
        match flow {
            Flow::Reply(resp) => send(&mut c.w, &resp).await?,
            Flow::Sent => {}
            Flow::Close => return Ok(()),
            Flow::Lifeline(pid) => return memory::lifeline(&c.d, pid, c.r, c.w).await,
            Flow::Follow {
                job,
                after,
                since,
                known,
            } => return ranks::follow(&c.d, job, after, since, known, c.r, c.w).await,
        }
    }
}
