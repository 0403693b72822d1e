//! `psls-client`: the client side of a node's Unix socket. [`Client`] is a synchronous
//! connection used by the `psls` admin CLI (and, later, by the client library and the rank
//! launcher). [`cluster`] holds what the CLI does to local daemons (start, stop, find).

pub mod capi;
pub mod cluster;
pub mod session;
pub mod slurm;

pub use session::{Checkpoint, Mapping, ReadOnlyMapping, Session};

use psls_ipc::proto::{self, ClusterStatus, FileInfo, FrameError, Request, Response, ScrubReport, Stripe, CHUNK};
use psls_ipc::ErrorKind;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

/// An error from the daemon or from talking to it.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{message}")]
    Daemon { kind: ErrorKind, message: String },
    #[error("cannot reach the node daemon at {path}: {err}")]
    Connect { path: String, err: std::io::Error },
    #[error("connection to the node daemon failed: {0}")]
    Frame(FrameError),
    /// Reading the data to import, or writing the exported data, failed.
    #[error("local file error: {0}")]
    Local(std::io::Error),
    #[error("unexpected answer from the daemon: {0}")]
    Protocol(String),
    /// The caller's arguments cannot make a valid request (found before sending anything).
    #[error("invalid argument: {0}")]
    Invalid(String),
}

pub struct Client {
    r: BufReader<UnixStream>,
    w: BufWriter<UnixStream>,
}

fn unexpected(r: Response) -> ClientError {
    match r {
        Response::Error { kind, message } => ClientError::Daemon { kind, message },
        other => ClientError::Protocol(format!("{other:?}")),
    }
}

impl Client {
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let mut s = UnixStream::connect(path).map_err(|err| ClientError::Connect {
            path: path.display().to_string(),
            err,
        })?;
        s.write_all(&proto::hello()).map_err(|e| ClientError::Frame(e.into()))?;
        let r = BufReader::with_capacity(1 << 20, s.try_clone().map_err(|e| ClientError::Frame(e.into()))?);
        Ok(Client {
            r,
            w: BufWriter::with_capacity(1 << 20, s),
        })
    }

    /// Sends bytes `offset..` of the input forwarded to rank 0 of `job` (`eof`: it ends after
    /// them); returns how many bytes rank 0's node took in all, and whether its queue is full.
    pub fn stdin(&mut self, job: &str, offset: u64, data: &[u8], eof: bool) -> Result<(u64, bool), ClientError> {
        match self.call(&Request::Stdin {
            job: job.into(),
            offset,
            data: data.to_vec(),
            eof,
        })? {
            Response::StdinAck { received, full } => Ok((received, full)),
            r => Err(unexpected(r)),
        }
    }

    /// The daemon's node name and cluster name.
    pub fn whoami(&mut self) -> Result<(String, String), ClientError> {
        match self.call(&Request::Whoami)? {
            Response::Node { name, cluster } => Ok((name, cluster)),
            r => Err(unexpected(r)),
        }
    }

    fn send(&mut self, req: &Request) -> Result<(), ClientError> {
        proto::write_frame(&mut self.w, req).map_err(ClientError::Frame)?;
        self.w.flush().map_err(|e| ClientError::Frame(e.into()))
    }

    fn recv(&mut self) -> Result<Response, ClientError> {
        proto::read_frame(&mut self.r).map_err(ClientError::Frame)
    }

    fn call(&mut self, req: &Request) -> Result<Response, ClientError> {
        self.send(req)?;
        self.recv()
    }

    /// Sends `req` with `fd` attached (SCM_RIGHTS) to the frame's first byte.
    fn send_with_fd(&mut self, req: &Request, fd: BorrowedFd<'_>) -> Result<(), ClientError> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        self.w.flush().map_err(|e| ClientError::Frame(e.into()))?;
        let frame = proto::encode(req).map_err(ClientError::Frame)?;
        let sock = self.w.get_ref();
        let fds = [fd.as_raw_fd()];
        let cmsg = [ControlMessage::ScmRights(&fds)];
        let sent = sendmsg::<()>(
            sock.as_raw_fd(),
            &[std::io::IoSlice::new(&frame)],
            &cmsg,
            MsgFlags::empty(),
            None,
        )
        .map_err(|e| ClientError::Frame(std::io::Error::from(e).into()))?;
        (&mut &*sock)
            .write_all(&frame[sent..])
            .map_err(|e| ClientError::Frame(e.into()))
    }

    /// Imports `size` bytes read by the daemon from `fd` (a file, pipe or memfd opened by the
    /// caller); succeeds only after the durable commit.
    pub fn import_fd(
        &mut self,
        fd: BorrowedFd<'_>,
        size: u64,
        name: &str,
        mode: u32,
        replace: bool,
    ) -> Result<FileInfo, ClientError> {
        self.send_with_fd(
            &Request::ImportFd {
                name: name.into(),
                size,
                mode,
                replace,
            },
            fd,
        )?;
        match self.recv()? {
            Response::Files(mut f) if f.len() == 1 => Ok(f.remove(0)),
            r => Err(unexpected(r)),
        }
    }

    /// Exports `name` by having the daemon write it into `fd`; returns the size.
    pub fn export_fd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<u64, ClientError> {
        self.send_with_fd(&Request::ExportFd { name: name.into() }, fd)?;
        match self.recv()? {
            Response::Exported { size } => Ok(size),
            r => Err(unexpected(r)),
        }
    }

    /// Runs a job (`psls run`): calls `started(job)` once job control recorded it, then
    /// `output(rank, seq, is_stderr, bytes)` as its ranks' lines arrive (numbered per rank);
    /// returns the job's status and a one-line summary. If the connection is lost after the
    /// start, the job goes on: follow it again with [`Client::attach`], from another node.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &mut self,
        program: &str,
        args: &[String],
        ranks: u32,
        per_node: Option<u32>,
        env: Vec<(String, String)>,
        cwd: &str,
        checkpoint: psls_ipc::proto::CkptOptions,
        started: impl FnMut(&str),
        attempt: &mut Option<u32>,
        note: impl FnMut(&str),
        output: impl FnMut(u32, u64, bool, &[u8]),
    ) -> Result<(i32, String), ClientError> {
        self.send(&Request::RunJob {
            program: program.into(),
            args: args.to_vec(),
            ranks,
            per_node,
            env,
            cwd: cwd.into(),
            checkpoint,
        })?;
        self.follow(started, attempt, note, output)
    }

    /// Starts a job (`psls run --detach`) and returns its id once job control recorded it,
    /// without following it (the job does not depend on this connection).
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &mut self,
        program: &str,
        args: &[String],
        ranks: u32,
        per_node: Option<u32>,
        env: Vec<(String, String)>,
        cwd: &str,
        checkpoint: psls_ipc::proto::CkptOptions,
    ) -> Result<String, ClientError> {
        self.send(&Request::RunJob {
            program: program.into(),
            args: args.to_vec(),
            ranks,
            per_node,
            env,
            cwd: cwd.into(),
            checkpoint,
        })?;
        match self.recv()? {
            Response::JobStarted { job } => Ok(job),
            r => Err(unexpected(r)),
        }
    }

    /// Follows job `job` (`psls attach`, or `psls run` after losing its node): its notes and
    /// its ranks' lines after `after` (rank → the last number already had), until its end.
    /// `attempt`: the job's start this client followed last (kept up to date, as `after` is):
    /// the restarts since are noted to it.
    pub fn attach(
        &mut self,
        job: &str,
        after: &std::collections::BTreeMap<u32, u64>,
        attempt: &mut Option<u32>,
        note: impl FnMut(&str),
        output: impl FnMut(u32, u64, bool, &[u8]),
    ) -> Result<(i32, String), ClientError> {
        self.send(&Request::Attach {
            job: job.into(),
            after: after.iter().map(|(r, s)| (*r, *s)).collect(),
            attempt: *attempt,
        })?;
        self.follow(|_| {}, attempt, note, output)
    }

    fn follow(
        &mut self,
        mut started: impl FnMut(&str),
        attempt: &mut Option<u32>,
        mut note: impl FnMut(&str),
        mut output: impl FnMut(u32, u64, bool, &[u8]),
    ) -> Result<(i32, String), ClientError> {
        loop {
            match self.recv()? {
                Response::JobStarted { job } => started(&job),
                Response::JobAttempt { attempt: a } => *attempt = Some(a),
                Response::JobNote { message } => note(&message),
                Response::RankOutput { rank, seq, err, data } => output(rank, seq, err, &data),
                Response::JobDone { code, message } => return Ok((code, message)),
                r => return Err(unexpected(r)),
            }
        }
    }

    /// `psls cancel JOB`: stops the job, keeping it resumable from its newest intact
    /// checkpoint.
    pub fn cancel(&mut self, job: &str) -> Result<(), ClientError> {
        match self.call(&Request::Cancel { job: job.into() })? {
            Response::Ok => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// `psls jobs`: running and resumable jobs.
    pub fn jobs(&mut self) -> Result<Vec<psls_ipc::proto::JobInfo>, ClientError> {
        match self.call(&Request::Jobs)? {
            Response::Jobs(j) => Ok(j),
            r => Err(unexpected(r)),
        }
    }

    /// `psls jobs rm JOB`.
    pub fn job_rm(&mut self, job: &str) -> Result<(), ClientError> {
        match self.call(&Request::JobRm { job: job.into() })? {
            Response::Ok => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// `psls checkpoint JOB` (`halt`: `psls halt JOB`).
    pub fn force_checkpoint(&mut self, job: &str, halt: bool) -> Result<(), ClientError> {
        match self.call(&Request::ForceCheckpoint { job: job.into(), halt })? {
            Response::Ok => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// Round trips of `bytes` bytes with node `peer` (ns): requests over the daemons' request
    /// transport, or with `link`, one-way messages over their message link.
    pub fn peer_ping(&mut self, peer: &str, bytes: u32, count: u32, link: bool) -> Result<Vec<u64>, ClientError> {
        match self.call(&Request::PeerPing {
            peer: peer.into(),
            bytes,
            count,
            link,
        })? {
            Response::Latencies(l) => Ok(l),
            r => Err(unexpected(r)),
        }
    }

    pub fn status(&mut self) -> Result<ClusterStatus, ClientError> {
        match self.call(&Request::Status)? {
            Response::Status(s) => Ok(s),
            r => Err(unexpected(r)),
        }
    }

    pub fn create(&mut self, name: &str, size: u64, mode: u32) -> Result<FileInfo, ClientError> {
        match self.call(&Request::Create {
            name: name.into(),
            size,
            mode,
        })? {
            Response::Files(mut f) if f.len() == 1 => Ok(f.remove(0)),
            r => Err(unexpected(r)),
        }
    }

    /// Imports `size` bytes from `src`; succeeds only after the daemon's durable commit.
    pub fn import(
        &mut self,
        src: &mut impl Read,
        size: u64,
        name: &str,
        mode: u32,
        replace: bool,
    ) -> Result<FileInfo, ClientError> {
        self.send(&Request::ImportBegin {
            name: name.into(),
            size,
            mode,
            replace,
        })?;
        let mut left = size;
        let mut buf = vec![0u8; CHUNK];
        let streamed: Result<(), ClientError> = (|| {
            while left > 0 {
                let n = (left as usize).min(CHUNK);
                src.read_exact(&mut buf[..n]).map_err(ClientError::Local)?;
                proto::write_import_data(&mut self.w, &buf[..n]).map_err(ClientError::Frame)?;
                left -= n as u64;
            }
            proto::write_frame(&mut self.w, &Request::ImportCommit).map_err(ClientError::Frame)?;
            self.w.flush().map_err(|e| ClientError::Frame(e.into()))
        })();
        if let Err(ClientError::Local(_)) = &streamed {
            // Our source failed: half-close so the daemon sees the end, aborts and answers.
            let _ = self.w.get_ref().shutdown(std::net::Shutdown::Write);
        }
        // If the daemon refused midway it has sent its error and closed: report that first.
        match (streamed, self.recv()) {
            (_, Ok(Response::Files(mut f))) if f.len() == 1 => Ok(f.remove(0)),
            (Err(e @ ClientError::Local(_)), _) => Err(e),
            (_, Ok(r @ Response::Error { .. })) => Err(unexpected(r)),
            (Err(e), _) => Err(e),
            (Ok(()), Ok(r)) => Err(unexpected(r)),
            (Ok(()), Err(e)) => Err(e),
        }
    }

    /// Exports `name` into `dst`; returns the size.
    pub fn export(&mut self, name: &str, dst: &mut impl Write) -> Result<u64, ClientError> {
        let size = match self.call(&Request::Export { name: name.into() })? {
            Response::ExportBegin { size } => size,
            r => return Err(unexpected(r)),
        };
        let mut got = 0u64;
        loop {
            let body = proto::read_body(&mut self.r).map_err(ClientError::Frame)?;
            if let Some(r) = proto::data_range(&body) {
                got += r.len() as u64;
                dst.write_all(&body[r]).map_err(ClientError::Local)?;
                continue;
            }
            match proto::decode(&body).map_err(ClientError::Frame)? {
                Response::ExportEnd => break,
                r => return Err(unexpected(r)),
            }
        }
        if got != size {
            return Err(ClientError::Protocol(format!(
                "export ended after {got} of {size} bytes"
            )));
        }
        Ok(size)
    }

    pub fn ls(&mut self) -> Result<Vec<FileInfo>, ClientError> {
        match self.call(&Request::Ls)? {
            Response::Files(f) => Ok(f),
            r => Err(unexpected(r)),
        }
    }

    pub fn stat(&mut self, name: &str) -> Result<(FileInfo, Vec<Stripe>), ClientError> {
        match self.call(&Request::Stat { name: name.into() })? {
            Response::Stat { file, stripes } => Ok((file, stripes)),
            r => Err(unexpected(r)),
        }
    }

    pub fn rm(&mut self, name: &str) -> Result<(), ClientError> {
        match self.call(&Request::Rm { name: name.into() })? {
            Response::Ok => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    pub fn scrub(&mut self) -> Result<ScrubReport, ClientError> {
        match self.call(&Request::Scrub)? {
            Response::Scrub(s) => Ok(s),
            r => Err(unexpected(r)),
        }
    }

    pub fn replace(&mut self, logical: u32, spare: &str) -> Result<(), ClientError> {
        match self.call(&Request::NodeReplace {
            logical,
            spare: spare.into(),
        })? {
            Response::Ok => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    pub fn shutdown(&mut self) -> Result<(), ClientError> {
        match self.call(&Request::Shutdown)? {
            Response::Ok => Ok(()),
            r => Err(unexpected(r)),
        }
    }
}
