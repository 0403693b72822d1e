//! The fault service's free functions: the per-mapping fault thread (`run`), carrying out
//! the coherence state machine's actions (`apply`, `resolve`), a node's shared-memory state
//! coming up after a restart (`ensure_svm`), and the membership views it is fed.

use super::state::*;
use crate::node::Node;
use crate::op::OpError;
use psls_ipc::ErrorKind;
use psls_svm::coherence::{Access, Action, Svm, WaiterId};
use psls_svm::{Incarnation, NodeId, PAGE_SIZE};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use userfaultfd::FaultKind;

/// `pidfd_open(2)`.
pub(super) fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us; nobody else owns it.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

/// (logical id, incarnation, up) of every logical node: its newest known incarnation, up
/// unless that one was declared down.
pub(super) fn peer_views(node: &Node) -> Vec<(NodeId, Incarnation, bool)> {
    let st = node.meta_state();
    node.logical_map(&st)
        .into_iter()
        .map(|(l, phys)| {
            if phys == node.me.name {
                return (NodeId(l), svm_incarnation(&st, l, node.incarnation), true);
            }
            let inc = node.heard_incarnation(&phys);
            (
                NodeId(l),
                svm_incarnation(&st, l, inc),
                inc > 0 && !node.is_declared_down(&phys),
            )
        })
        .collect()
}

/// Whether every other node of the map answered its latest ask ([`SvmShell::ask_peers`])
/// that it holds no shared-memory segment at all (one that did not answer may hold some).
pub(super) fn others_hold_nothing(node: &Node, held: &PeersHeld) -> bool {
    let st = node.meta_state();
    let Some(me) = node.my_logical(&st) else { return false };
    if held.asked_for != Some(svm_incarnation(&st, me.0, node.incarnation)) {
        return false;
    }
    let held = &held.answers;
    node.logical_map(&st)
        .values()
        .filter(|p| **p != node.me.name)
        .all(|p| held.get(p).is_some_and(|h| h.segments == 0))
}

/// The shared-memory incarnation of logical node `l` run by a daemon of incarnation
/// `physical` (0: unknown): the assignment generation of `l` (which grows when a spare takes
/// it over) above the daemon's own counter, so that the spare outranks every incarnation of
/// the node it replaced, whatever their own counters say.
pub fn svm_incarnation(st: &psls_pfs::meta::MetaState, l: u32, physical: u64) -> Incarnation {
    if physical == 0 {
        return Incarnation(0);
    }
    Incarnation((st.assignment(l) << 32) | physical.min(u32::MAX as u64))
}

/// Creates the state machine on first use, given what the other nodes answered last about
/// what they hold ([`SvmShell::ask_peers`], asked before the daemon serves).
pub(super) fn ensure_svm(g: &mut Inner, node: &Node, held: &PeersHeld) -> Result<(), OpError> {
    if g.svm.is_some() {
        return Ok(());
    }
    let st = node.meta_state();
    let Some(me) = node.my_logical(&st) else {
        return Err(OpError::new(
            ErrorKind::Unavailable,
            "this node holds no logical id (a spare): it cannot serve shared memory",
        ));
    };
    let views = peer_views(node);
    let n = node.cfg.nodes.len();
    let mut peers = vec![None; n];
    for &(l, inc, up) in &views {
        if (l.0 as usize) < n && up {
            peers[l.0 as usize] = Some(inc);
        }
    }
    // If another node holds shared pages, this daemon (restarted, or a spare in a dead node's
    // place) may have lost the directory of pages it manages: fenced when a node holding
    // segments knew another incarnation of this logical id (it has not caught up yet), or saw
    // it come back as this one while it held state (it caught up before this check, so its
    // view alone would look current).
    let inc = svm_incarnation(&st, me.0, node.incarnation);
    // Answers asked for another incarnation of this node (a spare since given this logical
    // id) say nothing of this one: it starts as restarted, until the nodes answer it again.
    let stale = held.asked_for != Some(inc);
    let held = &held.answers;
    let others_hold = stale
        || node.logical_map(&st).values().any(|p| {
            *p != node.me.name
                && held
                    .get(p)
                    .is_some_and(|h| h.segments > 0 && ((h.knew != 0 && h.knew != inc.0) || h.fenced == inc.0))
        });
    g.svm = Some(if others_hold {
        tracing::warn!(node = %node.name(), "restarted while other nodes hold shared pages: each file's pages managed here are served once no node holds what the previous incarnation granted of it");
        Svm::restarted(me, inc, peers)
    } else {
        Svm::new(me, inc, peers)
    });
    Ok(())
}

pub(super) fn drop_map(g: &mut Inner, m: &Arc<ClientMap>) {
    if let Some(seg) = g.segs.get_mut(&m.file) {
        seg.maps.retain(|x| x.id != m.id);
    }
    let gone: Vec<WaiterId> = g
        .waiters
        .iter()
        .filter(|(_, w)| w.map.id == m.id)
        .map(|(k, _)| *k)
        .collect();
    for w in gone {
        g.waiters.remove(&w);
        if let Some(svm) = g.svm.as_mut() {
            svm.cancel(w);
        }
    }
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to the eventfd we own.
    unsafe { libc::write(m.stop.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
}

/// Runs the state machine's actions (and this node's messages to itself) until none is left.
pub(super) fn run(g: &mut Inner, node: &Node, out: &mut Vec<Outgoing>) {
    for _ in 0..MAX_STEPS {
        let Some(svm) = g.svm.as_mut() else { return };
        if let Some(a) = svm.poll_action() {
            apply(g, node, a, out);
            continue;
        }
        if let Some(env) = g.self_msgs.pop_front() {
            if let Err(e) = svm.receive(env) {
                tracing::error!(node = %node.name(), error = %e, "own coherence message rejected");
            }
            continue;
        }
        return;
    }
    tracing::error!(node = %node.name(), "coherence actions did not settle");
}

pub(super) fn apply(g: &mut Inner, node: &Node, a: Action, out: &mut Vec<Outgoing>) {
    let me = g.svm.as_ref().map(|s| s.me());
    match a {
        Action::Send { to, env } => {
            if Some(to) == me {
                g.self_msgs.push_back(env);
                return;
            }
            let mut payload = bytes::Bytes::new();
            if env.msg.has_payload() {
                let page = env.msg.page();
                let Some(seg) = g.segs.get(&page.file) else {
                    tracing::error!(node = %node.name(), %page, "asked to send a page of a segment not held here");
                    return;
                };
                let mut buf = vec![0u8; PAGE_SIZE];
                if let Err(e) = seg.memfd.read_exact_at(&mut buf, page.index * PAGE_SIZE as u64) {
                    tracing::error!(node = %node.name(), %page, error = %e, "reading a page to send failed");
                    return;
                }
                payload = buf.into();
            }
            out.push(Outgoing::Send { to, env, payload });
        }
        Action::Load { page, txn } => match g.segs.get(&page.file) {
            Some(seg) => out.push(Outgoing::Load {
                page,
                txn,
                backing: seg.backing.clone(),
            }),
            None => {
                if let Some(svm) = g.svm.as_mut() {
                    svm.loaded(page, txn, false);
                }
            }
        },
        Action::SetAccess { page, access } => {
            let Some(seg) = g.segs.get_mut(&page.file) else { return };
            match access {
                None => {
                    // The latest version, if this copy was it, now lives where it went.
                    seg.dirty.clear(page.index);
                    seg.shadows.remove(&page.index);
                    let r = nix::fcntl::fallocate(
                        &seg.memfd,
                        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
                        (page.index * PAGE_SIZE as u64) as i64,
                        PAGE_SIZE as i64,
                    );
                    if let Err(e) = r {
                        // Fail closed: a page that cannot be dropped must not stay readable.
                        // The daemon stops; its clients' lifelines tell them.
                        tracing::error!(node = %node.name(), %page, error = %e, "punching a page out of its memfd failed; stopping");
                        std::process::abort();
                    }
                }
                Some(Access::Read) => {
                    // Read-only mappings never map a page writable (nor are they registered
                    // for write-protection).
                    for m in seg.maps.iter().filter(|m| m.writable) {
                        if (page.index as usize) * PAGE_SIZE < m.len {
                            let addr = m.addr_of(page.index);
                            if let Err(e) = m.uffd.write_protect(addr as *mut libc::c_void, PAGE_SIZE) {
                                tracing::debug!(pid = m.pid, %page, error = %e, "write-protect (client gone?)");
                            }
                        }
                    }
                    // A page a checkpoint left writable: written since, it is dirty (compared
                    // now that no client can write it any more).
                    if let Some(taken) = seg.shadows.remove(&page.index) {
                        let mut now = vec![0u8; PAGE_SIZE];
                        let same = seg.memfd.read_exact_at(&mut now, page.index * PAGE_SIZE as u64).is_ok()
                            && now[..] == taken[..];
                        if !same {
                            seg.dirty.set(page.index);
                        }
                    }
                }
                // Write access may come with another node's dirty version (a write moves the
                // page here and drops the other copies, with their dirty bits): this copy is
                // the one a checkpoint must take.
                Some(Access::Write) => {
                    seg.dirty.set(page.index);
                    seg.shadows.remove(&page.index);
                }
            }
        }
        Action::Resolve { waiter, page, .. } => {
            let Some(w) = g.waiters.remove(&waiter) else { return };
            let node_access = g.svm.as_ref().and_then(|s| s.access(page));
            if node_access == Some(Access::Write) && w.map.writable {
                // Mapped writable in the client: from now on it may differ from the disk.
                if let Some(seg) = g.segs.get_mut(&page.file) {
                    seg.dirty.set(page.index);
                }
            }
            resolve(&w, node_access);
            node.metrics.fault(w.label, w.since.elapsed());
        }
        Action::CheckFence { file } => out.push(Outgoing::CheckFence { file }),
        Action::Fail { waiter, page, error } => {
            let Some(w) = g.waiters.remove(&waiter) else { return };
            let name = g.segs.get(&page.file).map(|s| s.name.clone()).unwrap_or_default();
            out.push(Outgoing::Fatal {
                pid: w.map.pid,
                message: format!(
                    "access to page {} of '{name}' failed on node {}: {error}",
                    page.index,
                    node.name()
                ),
            });
        }
    }
}

/// Lets a waiting fault go on, mapping the page as this node's access allows.
pub(super) fn resolve(w: &Waiter, node_access: Option<Access>) {
    let writable = node_access == Some(Access::Write) && w.map.writable;
    let addr = w.addr as *mut libc::c_void;
    let r = match w.kind {
        FaultKind::WriteProtected if writable => w
            .map
            .uffd
            .remove_write_protection(addr, PAGE_SIZE, true)
            .map_err(|e| std::io::Error::other(e.to_string())),
        FaultKind::WriteProtected => w
            .map
            .uffd
            .wake(addr, PAGE_SIZE)
            .map_err(|e| std::io::Error::other(e.to_string())),
        // Write-protected when the mapping is writable but the node may not write (a read-only
        // mapping is not registered for write-protection, and its pages are read-only anyway).
        _ => match continue_page(&w.map.uffd, w.addr, !writable && w.map.writable) {
            // Another thread of the client mapped it first: just wake this one.
            Err(e) if errno_of(&e) == libc::EEXIST => w
                .map
                .uffd
                .wake(addr, PAGE_SIZE)
                .map_err(|e| std::io::Error::other(e.to_string())),
            r => r,
        },
    };
    if let Err(e) = r {
        // The client may be gone; if not, waking it makes it fault again.
        tracing::debug!(pid = w.map.pid, addr = w.addr, error = %e, "resolving a fault failed");
        let _ = w.map.uffd.wake(addr, PAGE_SIZE);
    }
}
