//! Local clients' file requests: create, import (streamed or from a passed descriptor),
//! export (streamed or to a passed descriptor), ls, stat, rm. Reads and writes are checked
//! against the file's owner and mode (`pfs::Caller`); a passed descriptor must be a regular
//! file, pipe or character device open for the access needed.

use super::conn::{err, misrouted, one_fd, read_body, send, send_data, Access, Conn, Flow};
use crate::node::Node;
use crate::op::OpError;
use crate::pfs::{self, Caller, Importer};
use psls_ipc::proto::{self, Request, Response};
use psls_ipc::ErrorKind;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use tokio::net::unix::OwnedReadHalf;

/// Create, import, export, ls, stat, rm.
pub(super) async fn handle(c: &mut Conn, req: Request, mut fds: Vec<OwnedFd>) -> std::io::Result<Flow> {
    let (d, caller) = (c.d.clone(), c.caller);
    let node = d.node.clone();
    // Checkpoint areas are the daemon's.
    if let Request::Create { name, .. }
    | Request::ImportBegin { name, .. }
    | Request::ImportFd { name, .. }
    | Request::Rm { name } = &req
    {
        if let Err(e) = crate::ckpt::not_reserved(name) {
            send(&mut c.w, &err(e)).await?;
            // An import's data may follow: close rather than misread it.
            return Ok(if matches!(req, Request::ImportBegin { .. }) {
                Flow::Close
            } else {
                Flow::Sent
            });
        }
    }
    let resp = match req {
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
            let resp = import(&node, caller, &mut c.r, &name, size, mode, replace).await;
            let failed = matches!(resp, Response::Error { .. });
            send(&mut c.w, &resp).await?;
            if failed {
                // The client may still be streaming data: close rather than misread it.
                return Ok(Flow::Close);
            }
            return Ok(Flow::Sent);
        }
        Request::ImportData { .. } | Request::ImportCommit => {
            err(OpError::new(ErrorKind::Invalid, "import data without ImportBegin"))
        }
        Request::Export { name } => match pfs::export_stream(&node, caller, &name) {
            Ok((f, mut rx)) => {
                send(&mut c.w, &Response::ExportBegin { size: f.size }).await?;
                while let Some(chunk) = rx.recv().await {
                    match chunk {
                        Ok(pages) => send_data(&mut c.w, &pages.concat()).await?,
                        Err(e) => {
                            send(&mut c.w, &err(e)).await?;
                            return Ok(Flow::Close);
                        }
                    }
                }
                Response::ExportEnd
            }
            Err(e) => err(e),
        },
        Request::ImportFd {
            name,
            size,
            mode,
            replace,
        } => match one_fd(&mut fds, Access::Read) {
            Ok(fd) => import_from_fd(&node, caller, fd, &name, size, mode, replace).await,
            Err(e) => err(e),
        },
        Request::ExportFd { name } => match one_fd(&mut fds, Access::Write) {
            Ok(fd) => export_to_fd(&node, caller, fd, &name).await,
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
        other => misrouted(&other),
    };
    Ok(Flow::Reply(resp))
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

/// Import whose bytes the daemon reads from the client's descriptor.
async fn import_from_fd(
    node: &Arc<Node>,
    caller: Caller,
    file: std::fs::File,
    name: &str,
    size: u64,
    mode: u32,
    replace: bool,
) -> Response {
    use std::io::Read;
    let mut imp = match Importer::begin(node, caller, name, size, mode, replace).await {
        Ok(i) => i,
        Err(e) => return err(e),
    };
    let file = Arc::new(file);
    let mut left = size;
    // One buffer, reused for every chunk.
    let mut buf = vec![0u8; proto::CHUNK];
    while left > 0 {
        let n = left.min(proto::CHUNK as u64) as usize;
        let f = file.clone();
        let read = crate::op::blocking(move || {
            let r = (&*f).read_exact(&mut buf[..n]);
            (buf, r)
        })
        .await;
        let r = match read {
            Ok((b, Ok(()))) => {
                buf = b;
                imp.data(&buf[..n]).await
            }
            Ok((b, Err(e))) => {
                buf = b;
                Err(OpError::new(ErrorKind::Io, format!("reading the file to import: {e}")))
            }
            Err(e) => {
                imp.abort().await;
                return err(e);
            }
        };
        if let Err(e) = r {
            imp.abort().await;
            return err(e);
        }
        left -= n as u64;
    }
    match imp.commit().await {
        Ok(f) => Response::Files(vec![f]),
        Err(e) => err(e),
    }
}

/// Export that the daemon writes into the client's descriptor.
async fn export_to_fd(node: &Arc<Node>, caller: Caller, file: std::fs::File, name: &str) -> Response {
    let (f, mut rx) = match pfs::export_stream(node, caller, name) {
        Ok(x) => x,
        Err(e) => return err(e),
    };
    let file = Arc::new(file);
    while let Some(chunk) = rx.recv().await {
        let data = match chunk {
            Ok(d) => d,
            Err(e) => return err(e),
        };
        let out = file.clone();
        match crate::op::blocking(move || write_pages(&*out, &data)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return err(OpError::new(ErrorKind::Io, format!("writing the exported file: {e}"))),
            Err(e) => return err(e),
        }
    }
    Response::Exported { size: f.size }
}

/// Writes `pages` in order with vectored writes (no assembly copy).
fn write_pages(mut w: impl std::io::Write, pages: &[bytes::Bytes]) -> std::io::Result<()> {
    /// At most this many buffers per call (Linux's IOV_MAX).
    const MAX_IOV: usize = 1024;
    let (mut i, mut off) = (0usize, 0usize);
    loop {
        while i < pages.len() && off == pages[i].len() {
            (i, off) = (i + 1, 0);
        }
        if i == pages.len() {
            return Ok(());
        }
        let iov: Vec<std::io::IoSlice> = std::iter::once(&pages[i][off..])
            .chain(pages[i + 1..].iter().map(|p| &p[..]))
            .take(MAX_IOV)
            .map(std::io::IoSlice::new)
            .collect();
        let mut n = match w.write_vectored(&iov) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        while n > 0 {
            let rest = pages[i].len() - off;
            if n >= rest {
                (i, off, n) = (i + 1, 0, n - rest);
            } else {
                (off, n) = (off + n, 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::write_pages;

    /// Takes at most `max` bytes per call, across the buffers it is given.
    struct Trickle {
        max: usize,
        got: Vec<u8>,
        calls: usize,
    }

    impl std::io::Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.write_vectored(&[std::io::IoSlice::new(buf)])
        }
        fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
            self.calls += 1;
            let mut n = 0;
            for b in bufs {
                let take = b.len().min(self.max - n);
                self.got.extend_from_slice(&b[..take]);
                n += take;
            }
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn vectored_writes_survive_short_writes() {
        let pages: Vec<bytes::Bytes> = (0..2100u32)
            .map(|k| bytes::Bytes::from(vec![k as u8; if k % 7 == 0 { 0 } else { 1 + (k as usize * 37) % 300 }]))
            .collect();
        let want = pages.concat();
        for max in [13, 4095, 4096, 10_000, usize::MAX / 2] {
            let mut w = Trickle {
                max,
                got: Vec::new(),
                calls: 0,
            };
            write_pages(&mut w, &pages).unwrap();
            assert_eq!(w.got, want, "max {max}");
            // Every call makes progress; at most 1024 buffers per call.
            assert!(w.calls <= want.len().div_ceil(max.min(want.len())) + pages.len() / 1024 + 1);
        }
    }
}
