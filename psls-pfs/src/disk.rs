//! The storage contract every byte of PSLS persistent state goes through.
//!
//! Contract of [`DiskFile`]:
//! - `write_at` may be lost entirely or partially (torn at any byte) by a crash until a later
//!   `sync` on the same file returns `Ok`. After `sync` returns `Ok`, every write that returned
//!   before the `sync` call is durable.
//! - If `sync` fails, nothing about earlier writes is known; callers must stop trusting the file.
//! - `read_at` fills the buffer completely or returns an error; bytes never written read as 0.
//!
//! Contract of [`Disk`] (a directory of named files):
//! - a newly created or removed name is durable only after `sync_dir` returns `Ok`.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One file of a [`Disk`].
pub trait DiskFile: Send + Sync + std::fmt::Debug {
    /// Reads `buf.len()` bytes at `offset`; bytes past the end of the file read as zero.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes all of `data` at `offset`, extending the file if needed.
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Makes every earlier write durable.
    fn sync(&self) -> io::Result<()>;
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// Truncates or extends (with zeros).
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Whether the file has length zero.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
}

/// A directory of files.
pub trait Disk: Send + Sync + std::fmt::Debug {
    /// Opens `name`, creating it when `create` is set.
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn DiskFile>>;
    /// Removes `name`; a missing name is not an error.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Names of all files.
    fn list(&self) -> io::Result<Vec<String>>;
    /// Makes creations and removals durable.
    fn sync_dir(&self) -> io::Result<()>;
    /// Bytes used by the files (allocated blocks).
    fn used_bytes(&self) -> io::Result<u64>;
    /// Bytes still free on the underlying file system.
    fn free_bytes(&self) -> io::Result<u64>;
}

/// The real disk: a directory on a local file system, `pwrite`/`pread`/`fdatasync`.
///
/// Writes and reads of at least [`DIRECT_MIN_BYTES`] whose buffer, offset and length are all
/// 4096-aligned (page runs built in a [`crate::buf::PageBuf`]) use a second descriptor opened
/// with `O_DIRECT`: they move between
/// the buffer and the disk without a copy into the page cache, and leave `fdatasync` little
/// to flush. Everything else goes through the page cache. Linux keeps the two coherent (a
/// direct write invalidates the cached range; a direct read first writes back dirty cached
/// pages of its range). File systems without `O_DIRECT` (tmpfs) use the cache only.
#[derive(Debug)]
pub struct FileDisk {
    root: PathBuf,
}

impl FileDisk {
    /// Uses `root` (created if missing).
    pub fn new(root: impl Into<PathBuf>) -> io::Result<Self> {
        let root = root.into();
        fs::create_dir_all(&root)?;
        Ok(FileDisk { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
}

/// The smallest access that uses `O_DIRECT`. A direct write is a round trip to the device
/// while the caller waits (about 40 µs for one page here, much more under load); a smaller
/// write goes to the page cache, and the `fdatasync` that makes it durable flushes it with
/// its neighbours (a checkpoint writes its pages to two shadow slots that alternate, so its
/// runs are often one page long). Large runs (imports, rebuilds) skip the copy instead.
pub const DIRECT_MIN_BYTES: usize = 64 * 1024;

/// A real file.
#[derive(Debug)]
pub struct RealFile {
    file: File,
    /// The same file opened with `O_DIRECT`, if the file system supports it.
    direct: Option<File>,
    /// Set when a direct access was refused as misaligned (a device with blocks larger than
    /// 4096 bytes): from then on this file goes through the page cache only.
    direct_off: std::sync::atomic::AtomicBool,
}

impl RealFile {
    /// The descriptor for an access of `len` bytes at `p` and `offset`.
    fn fd_for(&self, p: *const u8, offset: u64, len: usize) -> &File {
        match &self.direct {
            Some(d)
                if len >= DIRECT_MIN_BYTES
                    && crate::buf::is_aligned(p, offset, len)
                    && !self.direct_off.load(std::sync::atomic::Ordering::Relaxed) =>
            {
                d
            }
            _ => &self.file,
        }
    }

    /// Whether `e`, from descriptor `fd`, says direct I/O does not suit this file; if so,
    /// direct I/O is turned off for it and the caller retries through the page cache.
    fn direct_refused(&self, fd: &File, e: &io::Error) -> bool {
        let direct = self.direct.as_ref().is_some_and(|d| std::ptr::eq(d, fd));
        if direct && e.raw_os_error() == Some(libc::EINVAL) {
            self.direct_off.store(true, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(error = %e, "direct I/O refused; this file uses the page cache from now on");
            return true;
        }
        false
    }
}

impl DiskFile for RealFile {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            // After a short read (end of file) the rest may no longer be aligned; the choice
            // of descriptor is made again for every piece.
            let rest = &mut buf[done..];
            let fd = self.fd_for(rest.as_ptr(), offset + done as u64, rest.len());
            let n = match fd.read_at(rest, offset + done as u64) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted || self.direct_refused(fd, &e) => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                buf[done..].fill(0);
                break;
            }
            done += n;
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut done = 0;
        while done < data.len() {
            // As in `read_at`: a short write may leave an unaligned rest.
            let rest = &data[done..];
            let at = offset + done as u64;
            let fd = self.fd_for(rest.as_ptr(), at, rest.len());
            match fd.write_at(rest, at) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "write returned 0")),
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted || self.direct_refused(fd, &e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
}

pub(crate) fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad file name {name:?}"),
        ));
    }
    Ok(())
}

impl Disk for FileDisk {
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn DiskFile>> {
        check_name(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .open(self.root.join(name))?;
        // A second descriptor for direct I/O; a file system that refuses it gets none.
        let direct = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(self.root.join(name))
            .ok();
        Ok(Arc::new(RealFile {
            file,
            direct,
            direct_off: std::sync::atomic::AtomicBool::new(false),
        }))
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        check_name(name)?;
        match fs::remove_file(self.root.join(name)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        }
    }
    fn list(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in fs::read_dir(&self.root)? {
            let e = e?;
            if e.file_type()?.is_file() {
                if let Some(n) = e.file_name().to_str() {
                    out.push(n.to_string());
                }
            }
        }
        out.sort();
        Ok(out)
    }
    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.root)?.sync_all()
    }
    fn used_bytes(&self) -> io::Result<u64> {
        use std::os::unix::fs::MetadataExt;
        let mut total = 0;
        for e in fs::read_dir(&self.root)? {
            let m = e?.metadata()?;
            if m.is_file() {
                total += m.blocks() * 512;
            }
        }
        Ok(total)
    }
    fn free_bytes(&self) -> io::Result<u64> {
        statvfs_free(&self.root)
    }
}

/// Free bytes available to unprivileged users on the file system holding `path`.
pub fn statvfs_free(path: &Path) -> io::Result<u64> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a valid NUL-terminated path and `st` points to writable memory of the
    // size and layout of `struct statvfs`.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised the struct.
    let st = unsafe { st.assume_init() };
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_file_roundtrip_and_holes_read_zero() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        let f = disk.open("a", true).unwrap();
        f.write_at(8192, b"hello").unwrap();
        f.sync().unwrap();
        let mut buf = [7u8; 10];
        f.read_at(0, &mut buf).unwrap();
        assert_eq!(buf, [0u8; 10]);
        let mut buf = [0u8; 10];
        f.read_at(8192, &mut buf).unwrap();
        assert_eq!(&buf[..5], b"hello");
        assert_eq!(&buf[5..], &[0u8; 5]);
        assert_eq!(disk.list().unwrap(), vec!["a".to_string()]);
        assert!(disk.open("../x", true).is_err());
        assert!(disk.free_bytes().unwrap() > 0);
        disk.remove("a").unwrap();
        disk.remove("a").unwrap();
        assert!(disk.list().unwrap().is_empty());
    }

    /// Large aligned (direct) and small or unaligned (cached) accesses to one file see each
    /// other's bytes.
    #[test]
    fn direct_and_cached_io_agree() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        let f = disk.open("d", true).unwrap();
        let big = DIRECT_MIN_BYTES;
        let run = crate::buf::PageBuf::copy_of(&vec![5u8; big]);
        f.write_at(4096, &run).unwrap(); // direct
        f.write_at(4100, b"xyz").unwrap(); // cached, inside the direct range
        let one = crate::buf::PageBuf::copy_of(&[6u8; 4096]);
        f.write_at(8192, &one).unwrap(); // aligned but small: cached
        let mut back = crate::buf::PageBuf::zeroed(4096 + big + 4096);
        f.read_at(0, &mut back).unwrap(); // direct
        assert!(back[..4096].iter().all(|&b| b == 0));
        assert_eq!(&back[4096..4100], &[5u8; 4]);
        assert_eq!(&back[4100..4103], b"xyz");
        assert!(back[4103..8192].iter().all(|&b| b == 5));
        assert!(back[8192..12288].iter().all(|&b| b == 6));
        assert!(back[12288..4096 + big].iter().all(|&b| b == 5));
        assert!(back[4096 + big..].iter().all(|&b| b == 0));
        f.write_at(0, &run).unwrap(); // direct over cached-then-written ranges
        let mut small = [0u8; 8];
        f.read_at(big as u64 - 2, &mut small).unwrap(); // cached
        assert_eq!(small, [5u8; 8]);
        // Past the end: zeros, also for a direct read.
        let mut tail = crate::buf::PageBuf::zeroed(big);
        tail[0] = 1;
        f.read_at(4096 + big as u64, &mut tail).unwrap();
        assert!(tail.iter().all(|&b| b == 0));
        f.sync().unwrap();
    }
}
