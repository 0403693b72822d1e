//! The node's Unix socket for local clients and the admin CLI. The caller's uid/gid come from
//! SO_PEERCRED; file owners and modes decide reads and writes, and cluster administration
//! (scrub, replace, shutdown) is for root or the daemon's own user. Every frame is bounded.

use crate::node::{Node, OpError};
use crate::pfs::{self, Caller, Importer};
use psls_ipc::proto::{self, ClusterStatus, NodeState, NodeStatus, Request, Response, MAX_FRAME};
use psls_ipc::ErrorKind;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};

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

pub async fn serve(node: Arc<Node>, listener: UnixListener, _path: PathBuf) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept on client socket failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let node = node.clone();
        tokio::spawn(async move {
            if let Err(e) = client(node, stream).await {
                tracing::debug!(error = %e, "client connection ended");
            }
        });
    }
}

/// Reads one frame body; `None` at a clean end of the connection.
async fn read_body(r: &mut OwnedReadHalf) -> Result<Option<Vec<u8>>, proto::FrameError> {
    let mut prefix = [0u8; 4];
    match r.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = proto::check_len(prefix)?;
    let mut body = Vec::with_capacity(len);
    r.take(len as u64).read_to_end(&mut body).await?;
    if body.len() != len {
        return Err(proto::FrameError::Closed);
    }
    Ok(Some(body))
}

async fn read_req(r: &mut OwnedReadHalf) -> Result<Option<Request>, proto::FrameError> {
    match read_body(r).await? {
        Some(body) => proto::decode(&body).map(Some),
        None => Ok(None),
    }
}

/// Sends `Response::Data(data)` without copying `data` into a frame buffer.
async fn send_data(w: &mut OwnedWriteHalf, data: &[u8]) -> std::io::Result<()> {
    let header = proto::data_frame_header(data.len()).map_err(|e| std::io::Error::other(e.to_string()))?;
    w.write_all(&header).await?;
    w.write_all(data).await
}

async fn send(w: &mut OwnedWriteHalf, resp: &Response) -> std::io::Result<()> {
    let bytes = proto::encode(resp).map_err(|e| std::io::Error::other(e.to_string()))?;
    w.write_all(&bytes).await
}

fn err(e: OpError) -> Response {
    Response::Error {
        kind: e.kind,
        message: e.message,
    }
}

fn check_admin(node: &Node, c: Caller) -> Result<(), OpError> {
    if c.uid == 0 || c.uid == node.euid {
        Ok(())
    } else {
        Err(OpError::new(
            ErrorKind::Permission,
            "permission denied: cluster administration needs root or the daemon's user",
        ))
    }
}

async fn client(node: Arc<Node>, stream: UnixStream) -> anyhow::Result<()> {
    let cred = stream.peer_cred()?;
    let caller = Caller {
        uid: cred.uid(),
        gid: cred.gid(),
    };
    let (mut r, mut w) = stream.into_split();
    loop {
        let req = match read_req(&mut r).await {
            Ok(Some(req)) => req,
            Ok(None) => return Ok(()),
            Err(e) => {
                tracing::warn!(uid = caller.uid, error = %e, "bad client message");
                let _ = send(
                    &mut w,
                    &err(OpError::new(ErrorKind::Invalid, format!("bad request: {e}"))),
                )
                .await;
                return Ok(());
            }
        };
        let resp = match req {
            Request::Status => Response::Status(status(&node)),
            Request::Create { name, size, mode } => match pfs::create(&node, caller, &name, size, mode).await {
                Ok(f) => Response::Files(vec![f]),
                Err(e) => err(e),
            },
            Request::ImportBegin {
                name,
                size,
                mode,
                replace,
            } => {
                let resp = import(&node, caller, &mut r, &name, size, mode, replace).await;
                let failed = matches!(resp, Response::Error { .. });
                send(&mut w, &resp).await?;
                if failed {
                    // The client may still be streaming data: close rather than misread it.
                    return Ok(());
                }
                continue;
            }
            Request::ImportData { .. } | Request::ImportCommit => {
                err(OpError::new(ErrorKind::Invalid, "import data without ImportBegin"))
            }
            Request::Export { name } => match pfs::export_stream(&node, caller, &name) {
                Ok((f, mut rx)) => {
                    send(&mut w, &Response::ExportBegin { size: f.size }).await?;
                    while let Some(chunk) = rx.recv().await {
                        match chunk {
                            Ok(d) => send_data(&mut w, &d).await?,
                            Err(e) => {
                                send(&mut w, &err(e)).await?;
                                return Ok(());
                            }
                        }
                    }
                    Response::ExportEnd
                }
                Err(e) => err(e),
            },
            Request::Ls => Response::Files(pfs::list(&node)),
            Request::Stat { name } => match pfs::stat(&node, caller, &name) {
                Ok((file, stripes)) => Response::Stat { file, stripes },
                Err(e) => err(e),
            },
            Request::Rm { name } => match pfs::remove(&node, caller, &name).await {
                Ok(()) => Response::Ok,
                Err(e) => err(e),
            },
            Request::Scrub => match check_admin(&node, caller) {
                Ok(()) => match pfs::scrub(&node).await {
                    Ok(r) => Response::Scrub(r),
                    Err(e) => err(e),
                },
                Err(e) => err(e),
            },
            Request::NodeReplace { logical, spare } => match check_admin(&node, caller) {
                Ok(()) => match pfs::replace(&node, logical, &spare).await {
                    Ok(()) => Response::Ok,
                    Err(e) => err(e),
                },
                Err(e) => err(e),
            },
            Request::Shutdown => match check_admin(&node, caller) {
                Ok(()) => {
                    send(&mut w, &Response::Ok).await?;
                    node.shutdown.notify_one();
                    return Ok(());
                }
                Err(e) => err(e),
            },
        };
        send(&mut w, &resp).await?;
    }
}

async fn import(
    node: &Arc<Node>,
    caller: Caller,
    r: &mut OwnedReadHalf,
    name: &str,
    size: u64,
    mode: u32,
    replace: bool,
) -> Response {
    let mut imp = match Importer::begin(node, caller, name, size, mode, replace).await {
        Ok(i) => i,
        Err(e) => return err(e),
    };
    loop {
        let req = match read_body(r).await {
            Ok(Some(body)) => match proto::import_data_range(&body) {
                Some(range) => {
                    // The common case: file bytes, taken straight from the frame.
                    if let Err(e) = imp.data(&body[range]).await {
                        imp.abort().await;
                        return err(e);
                    }
                    continue;
                }
                None => proto::decode::<Request>(&body).map(Some),
            },
            Ok(None) => Ok(None),
            Err(e) => Err(e),
        };
        match req {
            Ok(Some(Request::ImportData { data })) => {
                if let Err(e) = imp.data(&data).await {
                    imp.abort().await;
                    return err(e);
                }
            }
            Ok(Some(Request::ImportCommit)) => {
                return match imp.commit().await {
                    Ok(f) => Response::Files(vec![f]),
                    Err(e) => err(e),
                }
            }
            Ok(Some(other)) => {
                imp.abort().await;
                return err(OpError::new(
                    ErrorKind::Invalid,
                    format!("unexpected {other:?} during import"),
                ));
            }
            Ok(None) | Err(_) => {
                tracing::warn!(name, "client went away during import; nothing was committed");
                imp.abort().await;
                return err(OpError::new(ErrorKind::Invalid, "import interrupted"));
            }
        }
    }
}

/// The cluster as this node sees it.
pub fn status(node: &Node) -> ClusterStatus {
    let st = node.meta_state();
    let map = node.logical_map(&st);
    let coordinator = node.coordinator(&st).map(|c| c.1);
    let nodes = node
        .cfg
        .all()
        .map(|n| {
            let logical = map.iter().find(|(_, p)| **p == n.name).map(|(l, _)| *l);
            let is_spare_entry = node.cfg.spares.iter().any(|s| s.name == n.name);
            let hb = if n.name == node.me.name {
                Some(node.own_heartbeat())
            } else {
                node.members
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .view(&n.name)
                    .and_then(|v| v.heartbeat.clone())
            };
            let live_state = node.state_of(&n.name);
            let state = if logical.is_none() && !is_spare_entry {
                NodeState::Replaced
            } else {
                live_state.clone()
            };
            let up = live_state != NodeState::Down;
            NodeStatus {
                name: n.name.clone(),
                logical,
                addr: n.addr.to_string(),
                spare: logical.is_none() && is_spare_entry,
                state,
                pid: hb.as_ref().filter(|_| up).map(|h| h.pid),
                incarnation: hb.as_ref().map_or(0, |h| h.incarnation),
                memory_used_bytes: hb.as_ref().map_or(0, |h| h.memory_used_bytes),
                memory_capacity_bytes: n.memory_mb * 1024 * 1024,
                disk_used_bytes: hb.as_ref().map_or(0, |h| h.disk_used_bytes),
                disk_free_bytes: hb.as_ref().map_or(0, |h| h.disk_free_bytes),
                coordinator: coordinator.as_deref() == Some(n.name.as_str()),
                // The metadata says whether a node is rebuilding; its heartbeat only how far along.
                rebuild: logical
                    .filter(|l| st.rebuilding.get(l).is_some_and(|r| r.physical == n.name))
                    .map(|_| hb.as_ref().and_then(|h| h.rebuild).unwrap_or((0, 0))),
            }
        })
        .collect();
    ClusterStatus {
        cluster: node.cfg.cluster.name.clone(),
        via: node.me.name.clone(),
        coordinator,
        meta_seq: st.seq,
        map_version: st.map_version,
        files: st.files.len() as u64,
        nodes,
    }
}

#[allow(dead_code)]
const _: () = assert!(MAX_FRAME > proto::CHUNK);
