//! Local clients' cluster requests: status (anyone), scrub, node replacement and shutdown
//! (root or the daemon's user), and round-trip measurements to a peer (fault-bench).

use super::conn::{err, misrouted, send, Conn, Flow};
use crate::failstop::Locked;
use crate::node::Node;
use crate::op::OpError;
use crate::pfs::{self, Caller};
use psls_ipc::proto::{ClusterStatus, NodeState, NodeStatus, Request, Response};
use psls_ipc::ErrorKind;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// Status, scrub, replace, peer ping, shutdown.
pub(super) async fn handle(c: &mut Conn, req: Request, _fds: Vec<OwnedFd>) -> std::io::Result<Flow> {
    let (d, caller) = (c.d.clone(), c.caller);
    let node = d.node.clone();
    let resp = match req {
        Request::Status => {
            node.figures_fresh().await;
            Response::Status(status(&node))
        }
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
        Request::PeerPing {
            peer,
            bytes,
            count,
            link,
        } => {
            if bytes > 1 << 20 || count == 0 || count > 100_000 || node.cfg.entry(&peer).is_none() {
                err(OpError::new(
                    ErrorKind::Invalid,
                    "peer ping: a node of the cluster, up to 1 MiB, 1 to 100000 round trips",
                ))
            } else {
                let payload = bytes::Bytes::from(vec![0x5a_u8; bytes as usize]);
                let mut out = Vec::with_capacity(count as usize);
                let mut failure = None;
                for _ in 0..count {
                    let t = std::time::Instant::now();
                    if link {
                        match link_ping(&node, &peer, payload.clone()).await {
                            Ok(()) => out.push(t.elapsed().as_nanos() as u64),
                            Err(e) => {
                                failure = Some(e);
                                break;
                            }
                        }
                        continue;
                    }
                    match node
                        .call_data(&peer, crate::peer::PeerReq::Echo, payload.clone(), node.request_timeout)
                        .await
                    {
                        Ok((_, back)) if back.len() == payload.len() => out.push(t.elapsed().as_nanos() as u64),
                        Ok(_) => {
                            failure = Some(OpError::new(ErrorKind::Internal, "echo came back with another size"));
                            break;
                        }
                        Err(e) => {
                            failure = Some(e.into());
                            break;
                        }
                    }
                }
                match failure {
                    None => Response::Latencies(out),
                    Some(e) => err(e),
                }
            }
        }
        Request::Shutdown => match check_admin(&node, caller) {
            Ok(()) => {
                send(&mut c.w, &Response::Ok).await?;
                node.shutdown.notify_one();
                return Ok(Flow::Close);
            }
            Err(e) => err(e),
        },
        other => misrouted(&other),
    };
    Ok(Flow::Reply(resp))
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
            let hb = node.heartbeat_of(&n.name);
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
                link_addr: n.link().map(|a| a.to_string()).unwrap_or_default(),
                spare: logical.is_none() && is_spare_entry,
                state,
                pid: hb.as_ref().filter(|_| up).map(|h| h.pid),
                incarnation: node.heard_incarnation(&n.name),
                memory_used_bytes: hb.as_ref().map_or(0, |h| h.memory_used_bytes),
                memory_capacity_bytes: n.memory_mb * 1024 * 1024,
                disk_used_bytes: hb.as_ref().map_or(0, |h| h.disk_used_bytes),
                disk_free_bytes: hb.as_ref().map_or(0, |h| h.disk_free_bytes),
                coordinator: coordinator.as_deref() == Some(n.name.as_str()),
                meta_term: hb.as_ref().map_or(0, |h| h.meta_log.0),
                meta_commit: hb.as_ref().map_or(0, |h| h.meta_log.1),
                meta_applied: hb.as_ref().map_or(0, |h| h.meta_log.2),
                // The metadata says whether a node is rebuilding, its heartbeat how far along;
                // a node back on a blank disk says so itself until its rebuild is recorded.
                rebuild: logical
                    .filter(|l| st.rebuilding.get(l).is_some_and(|r| r.physical == n.name))
                    .map(|_| hb.as_ref().and_then(|h| h.rebuild).unwrap_or((0, 0)))
                    .or_else(|| hb.as_ref().filter(|_| up).and_then(|h| h.rebuild)),
                recovery_frames: hb.as_ref().map_or(0, |h| h.frames.recovery),
                unsaved_frames: hb.as_ref().map_or(0, |h| h.frames.unsaved),
                pre_recovery_frames: hb.as_ref().map_or(0, |h| h.frames.pre_recovery),
                frame_capacity: hb.as_ref().map_or(0, |h| h.frame_capacity),
                dirty_pages: hb.as_ref().map_or(0, |h| h.dirty_pages),
                disk_failed: hb.as_ref().and_then(|h| h.disk_failed.clone()),
            }
        })
        .collect();
    ClusterStatus {
        cluster: node.cfg.cluster.name.clone(),
        via: node.me.name.clone(),
        coordinator,
        meta_seq: st.seq,
        meta_term: node.replication.status().term,
        meta_voters: node.replication.status().voters,
        map_version: st.map_version,
        files: st.files.len() as u64,
        nodes,
    }
}

/// One round trip over the message link: a `LinkPing` out, its `LinkPong` back.
async fn link_ping(node: &Arc<Node>, peer: &str, payload: bytes::Bytes) -> Result<(), OpError> {
    let id = node.next_link_ping.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = tokio::sync::oneshot::channel();
    node.link_pings.locked().insert(id, tx);
    let len = payload.len();
    let r = match node.net.post(peer, &crate::peer::PeerReq::LinkPing { id }, payload) {
        Err(e) => Err(e.into()),
        Ok(()) => match tokio::time::timeout(node.request_timeout, rx).await {
            Ok(Ok(n)) if n == len => Ok(()),
            Ok(Ok(_)) => Err(OpError::new(
                ErrorKind::Internal,
                "link pong came back with another size",
            )),
            Ok(Err(_)) | Err(_) => Err(OpError::new(
                ErrorKind::Unavailable,
                format!(
                    "no link pong from {peer} within {} ms",
                    node.request_timeout.as_millis()
                ),
            )),
        },
    };
    node.link_pings.locked().remove(&id);
    r
}
