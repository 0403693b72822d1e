//! A fault-injecting [`Disk`]: writes are held in memory until `sync`, so a process crash or
//! [`FaultDisk::power_cut`] loses exactly what was not durable. On a power cut, each unsynced
//! 512-byte sector independently survives or not (chosen by a seed), which also produces torn
//! pages. A file created since the last successful `sync_dir` may lose its name in a power cut
//! (the [`Disk`] contract: a new name is durable only after `sync_dir`), and with it whatever
//! was written to it. I/O failures can be switched on, and the disk can halt after a given
//! number of mutating operations (a power cut at a precise point).
//!
//! Not modelled: a removal is durable at once (a power cut never brings a removed name back).

use crate::disk::{check_name, Disk, DiskFile, FileDisk};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, Weak};

const BLOCK: u64 = 4096;
const SECTOR: usize = 512;

#[derive(Debug, Default)]
struct Control {
    fail_reads: AtomicBool,
    fail_writes: AtomicBool,
    fail_sync: AtomicBool,
    /// Mutating operations (write, sync, set_len) left before the disk halts; negative: never.
    ops_left: AtomicI64,
    halted: AtomicBool,
}

impl Control {
    fn check(&self, mutating: bool) -> io::Result<()> {
        if self.halted.load(Ordering::SeqCst) {
            return Err(io::Error::other("disk halted (simulated power cut)"));
        }
        if mutating && self.ops_left.load(Ordering::SeqCst) >= 0 && self.ops_left.fetch_sub(1, Ordering::SeqCst) <= 0 {
            self.halted.store(true, Ordering::SeqCst);
            return Err(io::Error::other("disk halted (simulated power cut)"));
        }
        Ok(())
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct FaultDisk {
    base: FileDisk,
    control: Arc<Control>,
    files: Mutex<BTreeMap<String, Weak<FaultFile>>>,
    /// Names created since the last successful `sync_dir`: a power cut may lose them.
    created: Mutex<BTreeSet<String>>,
}

#[derive(Debug)]
struct FaultFile {
    base: Arc<dyn DiskFile>,
    control: Arc<Control>,
    state: Mutex<Overlay>,
}

#[derive(Debug, Default)]
struct Overlay {
    blocks: BTreeMap<u64, Box<[u8]>>,
    /// Length including unsynced extensions.
    len: u64,
}

impl FaultDisk {
    /// A fault disk over the directory `root`; what is durable lives in real files there.
    pub fn new(root: impl Into<std::path::PathBuf>) -> io::Result<Self> {
        let control = Control {
            ops_left: AtomicI64::new(-1),
            ..Default::default()
        };
        Ok(FaultDisk {
            base: FileDisk::new(root)?,
            control: Arc::new(control),
            files: Mutex::new(BTreeMap::new()),
            created: Mutex::new(BTreeSet::new()),
        })
    }

    pub fn set_fail_reads(&self, on: bool) {
        self.control.fail_reads.store(on, Ordering::SeqCst);
    }
    pub fn set_fail_writes(&self, on: bool) {
        self.control.fail_writes.store(on, Ordering::SeqCst);
    }
    pub fn set_fail_sync(&self, on: bool) {
        self.control.fail_sync.store(on, Ordering::SeqCst);
    }
    /// Halts the disk after `n` more mutating operations (write, sync, set_len).
    pub fn halt_after(&self, n: i64) {
        self.control.ops_left.store(n, Ordering::SeqCst);
    }
    pub fn is_halted(&self) -> bool {
        self.control.halted.load(Ordering::SeqCst)
    }

    /// Simulates a power cut: every unsynced sector of every file, and every name created since
    /// the last successful `sync_dir`, survives or is lost as `seed` decides (seed 0: all
    /// lost). The disk halts; open a new `FaultDisk` on the same directory to model the reboot.
    pub fn power_cut(&self, seed: u64) {
        self.control.halted.store(true, Ordering::SeqCst);
        let mut rng = psls_svm::rng::SplitMix64::new(seed);
        let files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        for f in files.values().filter_map(Weak::upgrade) {
            let mut st = f.state.lock().unwrap_or_else(|e| e.into_inner());
            let blocks = std::mem::take(&mut st.blocks);
            for (b, data) in blocks {
                for (i, sector) in data.chunks(SECTOR).enumerate() {
                    if seed != 0 && rng.next_u64().is_multiple_of(2) {
                        let off = b * BLOCK + (i * SECTOR) as u64;
                        if off < st.len {
                            let n = ((st.len - off) as usize).min(SECTOR);
                            let _ = f.base.write_at(off, &sector[..n]);
                        }
                    }
                }
            }
            let _ = f.base.sync();
        }
        drop(files);
        let created = std::mem::take(&mut *self.created.lock().unwrap_or_else(|e| e.into_inner()));
        for name in created {
            if seed == 0 || rng.next_u64().is_multiple_of(2) {
                let _ = self.base.remove(&name);
            }
        }
    }
}

impl Disk for FaultDisk {
    fn open(&self, name: &str, create: bool) -> io::Result<Arc<dyn DiskFile>> {
        check_name(name)?;
        self.control.check(false)?;
        let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = files.get(name).and_then(Weak::upgrade) {
            return Ok(f);
        }
        let base = match self.base.open(name, false) {
            Ok(b) => b,
            Err(e) if create && e.kind() == io::ErrorKind::NotFound => {
                let b = self.base.open(name, true)?;
                self.created
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(name.to_string());
                b
            }
            Err(e) => return Err(e),
        };
        let len = base.len()?;
        let f = Arc::new(FaultFile {
            base,
            control: self.control.clone(),
            state: Mutex::new(Overlay {
                blocks: BTreeMap::new(),
                len,
            }),
        });
        files.insert(name.to_string(), Arc::downgrade(&f));
        Ok(f)
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.control.check(true)?;
        self.files.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        self.created.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        self.base.remove(name)
    }
    fn list(&self) -> io::Result<Vec<String>> {
        self.control.check(false)?;
        self.base.list()
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.control.check(true)?;
        if self.control.fail_sync.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected fsync failure"));
        }
        // Names created from here on are not covered by this sync.
        let covered = std::mem::take(&mut *self.created.lock().unwrap_or_else(|e| e.into_inner()));
        if let Err(e) = self.base.sync_dir() {
            self.created.lock().unwrap_or_else(|e| e.into_inner()).extend(covered);
            return Err(e);
        }
        Ok(())
    }
    fn used_bytes(&self) -> io::Result<u64> {
        self.base.used_bytes()
    }
    fn free_bytes(&self) -> io::Result<u64> {
        self.base.free_bytes()
    }
}

impl DiskFile for FaultFile {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.control.check(false)?;
        if self.control.fail_reads.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected read failure"));
        }
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.base.read_at(offset, buf)?;
        let end = offset + buf.len() as u64;
        for (&b, data) in st.blocks.range(offset / BLOCK..end.div_ceil(BLOCK)) {
            let bstart = b * BLOCK;
            let from = offset.max(bstart);
            let to = end.min(bstart + BLOCK);
            buf[(from - offset) as usize..(to - offset) as usize]
                .copy_from_slice(&data[(from - bstart) as usize..(to - bstart) as usize]);
        }
        // Bytes past the logical length (after a truncate) read as zero.
        if end > st.len {
            let cut = st.len.saturating_sub(offset) as usize;
            let n = buf.len();
            buf[cut.min(n)..].fill(0);
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.control.check(true)?;
        if self.control.fail_writes.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected write failure"));
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let end = offset + data.len() as u64;
        for b in offset / BLOCK..end.div_ceil(BLOCK) {
            let bstart = b * BLOCK;
            if !st.blocks.contains_key(&b) {
                let mut blk = vec![0u8; BLOCK as usize].into_boxed_slice();
                if bstart < st.len {
                    self.base.read_at(bstart, &mut blk)?;
                }
                st.blocks.insert(b, blk);
            }
            let blk = st.blocks.get_mut(&b).expect("inserted above");
            let from = offset.max(bstart);
            let to = end.min(bstart + BLOCK);
            blk[(from - bstart) as usize..(to - bstart) as usize]
                .copy_from_slice(&data[(from - offset) as usize..(to - offset) as usize]);
        }
        st.len = st.len.max(end);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        self.control.check(true)?;
        if self.control.fail_sync.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected fsync failure"));
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let len = st.len;
        if self.base.len()? != len {
            self.base.set_len(len)?;
        }
        for (&b, data) in &st.blocks {
            let off = b * BLOCK;
            if off < len {
                let n = ((len - off) as usize).min(data.len());
                self.base.write_at(off, &data[..n])?;
            }
        }
        self.base.sync()?;
        st.blocks.clear();
        Ok(())
    }
    fn len(&self) -> io::Result<u64> {
        self.control.check(false)?;
        Ok(self.state.lock().unwrap_or_else(|e| e.into_inner()).len)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.control.check(true)?;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // Truncation drops overlay data past the end; an extension reads as zeros.
        st.blocks.retain(|&b, _| b * BLOCK < len);
        if let Some((&b, blk)) = st.blocks.iter_mut().next_back() {
            let bstart = b * BLOCK;
            if bstart + BLOCK > len {
                blk[(len - bstart) as usize..].fill(0);
            }
        }
        if len < st.len {
            // Shrinking must also be visible for durable bytes: apply to the base now.
            self.base.set_len(len)?;
        }
        st.len = len;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsynced_writes_are_lost_synced_survive() {
        let dir = tempfile::tempdir().unwrap();
        {
            let d = FaultDisk::new(dir.path()).unwrap();
            let f = d.open("x", true).unwrap();
            d.sync_dir().unwrap();
            f.write_at(0, &[1u8; 5000]).unwrap();
            f.sync().unwrap();
            f.write_at(100, &[2u8; 10]).unwrap();
            let mut b = [0u8; 4];
            f.read_at(98, &mut b).unwrap();
            assert_eq!(b, [1, 1, 2, 2]);
            d.power_cut(0);
            assert!(f.write_at(0, b"x").is_err());
        }
        let d = FaultDisk::new(dir.path()).unwrap();
        let f = d.open("x", false).unwrap();
        assert_eq!(f.len().unwrap(), 5000);
        let mut b = vec![0u8; 5000];
        f.read_at(0, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 1));
    }

    #[test]
    fn a_new_name_survives_a_power_cut_only_after_sync_dir() {
        let dir = tempfile::tempdir().unwrap();
        {
            let d = FaultDisk::new(dir.path()).unwrap();
            let f = d.open("kept", true).unwrap();
            f.write_at(0, b"kept").unwrap();
            f.sync().unwrap();
            d.sync_dir().unwrap();
            // Synced data, but the name was never made durable.
            let g = d.open("lost", true).unwrap();
            g.write_at(0, b"lost").unwrap();
            g.sync().unwrap();
            // Reopening an existing name is no creation.
            drop(f);
            d.open("kept", true).unwrap();
            d.power_cut(0);
        }
        let d = FaultDisk::new(dir.path()).unwrap();
        assert_eq!(d.list().unwrap(), vec!["kept".to_string()]);
        let mut b = [0u8; 4];
        d.open("kept", false).unwrap().read_at(0, &mut b).unwrap();
        assert_eq!(&b, b"kept");
    }

    #[test]
    fn halt_after_counts_mutations() {
        let dir = tempfile::tempdir().unwrap();
        let d = FaultDisk::new(dir.path()).unwrap();
        let f = d.open("x", true).unwrap();
        d.halt_after(2);
        f.write_at(0, b"a").unwrap();
        f.sync().unwrap();
        assert!(f.write_at(0, b"b").is_err());
        assert!(d.is_halted());
    }

    #[test]
    fn injected_failures() {
        let dir = tempfile::tempdir().unwrap();
        let d = FaultDisk::new(dir.path()).unwrap();
        let f = d.open("x", true).unwrap();
        d.set_fail_writes(true);
        assert!(f.write_at(0, b"a").is_err());
        d.set_fail_writes(false);
        f.write_at(0, b"a").unwrap();
        d.set_fail_sync(true);
        assert!(f.sync().is_err());
        d.set_fail_sync(false);
        d.set_fail_reads(true);
        assert!(f.read_at(0, &mut [0u8; 1]).is_err());
    }

    #[test]
    fn power_cut_with_seed_keeps_some_sectors() {
        let dir = tempfile::tempdir().unwrap();
        {
            let d = FaultDisk::new(dir.path()).unwrap();
            let f = d.open("x", true).unwrap();
            d.sync_dir().unwrap();
            f.write_at(0, &[9u8; 64 * 1024]).unwrap();
            d.power_cut(42);
        }
        let d = FaultDisk::new(dir.path()).unwrap();
        let f = d.open("x", false).unwrap();
        let mut b = vec![0u8; 64 * 1024];
        f.read_at(0, &mut b).unwrap();
        let kept = b.chunks(SECTOR).filter(|s| s.iter().all(|&x| x == 9)).count();
        let lost = b.chunks(SECTOR).filter(|s| s.iter().all(|&x| x == 0)).count();
        assert_eq!(kept + lost, 128);
        assert!(kept > 0 && lost > 0, "kept {kept} lost {lost}");
    }
}
