//! The page store of one node: for every (file, role) it holds, a data file with two 4 KB
//! slots per page and a header file with two 64-byte headers per page.
//!
//! A page version is identified by its generation. The committed generation of each page is
//! known to the caller (from the namespace metadata); a new version is written to the *shadow*
//! slot, the one that does not hold the committed generation, so the committed version stays
//! intact until a durable commit record names the new generation.
//!
//! Invariants:
//! - a read returns data only if the slot's header names this file, page and the expected
//!   generation and the crc32 over header and data matches (checked right after the read);
//! - a write never overwrites the slot holding `keep_gen` (the committed version);
//! - after a failed fsync the store is poisoned and refuses every further operation.

use crate::disk::{Disk, DiskFile};
use crate::error::StoreError;
use crate::placement::Role;
use crate::slot::{self, HeaderState, HEADER_LEN};
use psls_svm::{FileId, PAGE_SIZE};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Where a page lives in this node's store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageLoc {
    pub file: FileId,
    pub role: Role,
    /// Page index in the file.
    pub index: u64,
    /// Position in this node's dense array for (file, role), from [`crate::Placement::local_index`].
    pub local: u64,
}

/// Result of reading one page copy.
#[derive(PartialEq, Eq)]
pub enum ReadOutcome {
    Ok(Vec<u8>),
    /// Neither slot was ever written.
    Missing,
    /// Slots hold other generations (e.g. an interrupted write); `found` is the newest.
    Stale {
        found: u64,
    },
    /// The slot of the expected generation, or a header, fails its checks.
    Corrupt,
}

impl std::fmt::Debug for ReadOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadOutcome::Ok(d) => {
                write!(f, "Ok({} bytes, crc32 {:08x})", d.len(), crc32fast::hash(d))
            }
            ReadOutcome::Missing => write!(f, "Missing"),
            ReadOutcome::Stale { found } => write!(f, "Stale {{ found: {found} }}"),
            ReadOutcome::Corrupt => write!(f, "Corrupt"),
        }
    }
}

#[derive(Debug)]
struct Pair {
    dat: Arc<dyn DiskFile>,
    hdr: Arc<dyn DiskFile>,
}

const LOCK_STRIPES: usize = 64;

/// See the module documentation.
#[derive(Debug)]
pub struct PageStore {
    disk: Arc<dyn Disk>,
    open: Mutex<HashMap<(FileId, Role), Arc<Pair>>>,
    dirty: Mutex<HashSet<(FileId, Role)>>,
    dir_dirty: AtomicBool,
    poisoned: AtomicBool,
    stripes: Vec<Mutex<()>>,
}

fn names(file: FileId, role: Role) -> (String, String) {
    (
        format!("f{}.{}.dat", file, role.tag()),
        format!("f{}.{}.hdr", file, role.tag()),
    )
}

/// Parses a store file name back into (file, role).
fn parse_name(name: &str) -> Option<(FileId, Role)> {
    let rest = name.strip_prefix('f')?.strip_suffix(".dat")?;
    let (id, tag) = rest.split_once('.')?;
    let role = match tag {
        "p" => Role::Primary,
        "m" => Role::Mirror,
        _ => return None,
    };
    Some((FileId(u64::from_str_radix(id, 16).ok()?), role))
}

impl PageStore {
    pub fn new(disk: Arc<dyn Disk>) -> Self {
        PageStore {
            disk,
            open: Mutex::new(HashMap::new()),
            dirty: Mutex::new(HashSet::new()),
            dir_dirty: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            stripes: (0..LOCK_STRIPES).map(|_| Mutex::new(())).collect(),
        }
    }

    pub fn disk(&self) -> &Arc<dyn Disk> {
        &self.disk
    }

    fn check(&self) -> Result<(), StoreError> {
        if self.poisoned.load(Ordering::SeqCst) {
            return Err(StoreError::Poisoned);
        }
        Ok(())
    }

    fn pair(&self, file: FileId, role: Role, create: bool) -> Result<Option<Arc<Pair>>, StoreError> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = open.get(&(file, role)) {
            return Ok(Some(p.clone()));
        }
        let (dn, hn) = names(file, role);
        let exists = self
            .disk
            .list()
            .map_err(|e| StoreError::io("list store", e))?
            .contains(&dn);
        if !exists && !create {
            return Ok(None);
        }
        let dat = self.disk.open(&dn, true).map_err(|e| StoreError::io(&dn, e))?;
        let hdr = self.disk.open(&hn, true).map_err(|e| StoreError::io(&hn, e))?;
        if !exists {
            self.dir_dirty.store(true, Ordering::SeqCst);
        }
        let p = Arc::new(Pair { dat, hdr });
        open.insert((file, role), p.clone());
        Ok(Some(p))
    }

    fn stripe(&self, loc: &PageLoc) -> std::sync::MutexGuard<'_, ()> {
        let h = psls_svm_hash(loc.file.0 ^ loc.index.rotate_left(17) ^ (loc.role as u64) << 63);
        self.stripes[(h % LOCK_STRIPES as u64) as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn read_headers(&self, p: &Pair, loc: &PageLoc) -> Result<[[u8; HEADER_LEN]; 2], StoreError> {
        let mut buf = [0u8; 2 * HEADER_LEN];
        p.hdr
            .read_at(loc.local * 2 * HEADER_LEN as u64, &mut buf)
            .map_err(|e| StoreError::io("read header", e))?;
        let mut out = [[0u8; HEADER_LEN]; 2];
        out[0].copy_from_slice(&buf[..HEADER_LEN]);
        out[1].copy_from_slice(&buf[HEADER_LEN..]);
        Ok(out)
    }

    /// Reads the copy of generation `expected_gen` of the page at `loc`.
    pub fn read(&self, loc: PageLoc, expected_gen: u64) -> Result<ReadOutcome, StoreError> {
        self.check()?;
        let Some(p) = self.pair(loc.file, loc.role, false)? else {
            return Ok(ReadOutcome::Missing);
        };
        let _g = self.stripe(&loc);
        let hs = self.read_headers(&p, &loc)?;
        let states = [
            slot::parse(&hs[0], loc.file, loc.index),
            slot::parse(&hs[1], loc.file, loc.index),
        ];
        for s in 0..2 {
            if let HeaderState::Written { gen, crc } = states[s] {
                if gen == expected_gen {
                    let mut data = vec![0u8; PAGE_SIZE];
                    p.dat
                        .read_at((loc.local * 2 + s as u64) * PAGE_SIZE as u64, &mut data)
                        .map_err(|e| StoreError::io("read page", e))?;
                    if slot::checksum(&hs[s], &data) != crc {
                        return Ok(ReadOutcome::Corrupt);
                    }
                    return Ok(ReadOutcome::Ok(data));
                }
            }
        }
        if states.contains(&HeaderState::Garbage) {
            return Ok(ReadOutcome::Corrupt);
        }
        let found = states
            .iter()
            .filter_map(|s| match s {
                HeaderState::Written { gen, .. } => Some(*gen),
                _ => None,
            })
            .max();
        Ok(match found {
            Some(found) => ReadOutcome::Stale { found },
            None => ReadOutcome::Missing,
        })
    }

    /// Writes generation `gen` of the page at `loc` into its shadow slot, never the slot that
    /// holds `keep_gen` (pass `keep_gen == gen` to repair a copy in place). Not durable until
    /// [`PageStore::sync`] returns.
    pub fn write(&self, loc: PageLoc, gen: u64, keep_gen: u64, data: &[u8]) -> Result<(), StoreError> {
        self.check()?;
        if data.len() != PAGE_SIZE {
            return Err(StoreError::BadPageLength(data.len()));
        }
        let p = self
            .pair(loc.file, loc.role, true)?
            .ok_or(StoreError::NoSuchFile(loc.file))?;
        let _g = self.stripe(&loc);
        let hs = self.read_headers(&p, &loc)?;
        let st = [
            slot::parse(&hs[0], loc.file, loc.index),
            slot::parse(&hs[1], loc.file, loc.index),
        ];
        let gen_of = |s: HeaderState| match s {
            HeaderState::Written { gen, .. } => Some(gen),
            _ => None,
        };
        let target = if let Some(s) = (0..2).find(|&s| gen_of(st[s]) == Some(gen)) {
            s
        } else if let Some(s) = (0..2).find(|&s| gen_of(st[s]) == Some(keep_gen)) {
            1 - s
        } else if let Some(s) = (0..2).find(|&s| gen_of(st[s]).is_none()) {
            s
        } else if gen_of(st[0]) <= gen_of(st[1]) {
            0
        } else {
            1
        };
        let header = slot::encode(loc.file, loc.index, gen, data);
        // Checksum checked right before the write, against the bytes being written.
        debug_assert_eq!(
            slot::parse(&header, loc.file, loc.index),
            HeaderState::Written {
                gen,
                crc: slot::checksum(&header, data)
            }
        );
        let slot_no = loc.local * 2 + target as u64;
        p.dat
            .write_at(slot_no * PAGE_SIZE as u64, data)
            .map_err(|e| StoreError::io("write page", e))?;
        p.hdr
            .write_at(slot_no * HEADER_LEN as u64, &header)
            .map_err(|e| StoreError::io("write header", e))?;
        self.dirty
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((loc.file, loc.role));
        Ok(())
    }

    /// Makes every earlier write durable. On failure the store is poisoned.
    pub fn sync(&self) -> Result<(), StoreError> {
        self.check()?;
        let dirty: Vec<(FileId, Role)> = self.dirty.lock().unwrap_or_else(|e| e.into_inner()).drain().collect();
        let result = (|| {
            for (file, role) in &dirty {
                if let Some(p) = self.pair(*file, *role, false)? {
                    p.dat.sync().map_err(|e| StoreError::io("fsync data", e))?;
                    p.hdr.sync().map_err(|e| StoreError::io("fsync headers", e))?;
                }
            }
            if self.dir_dirty.swap(false, Ordering::SeqCst) {
                self.disk.sync_dir().map_err(|e| StoreError::io("fsync directory", e))?;
            }
            Ok(())
        })();
        if result.is_err() {
            self.poisoned.store(true, Ordering::SeqCst);
        }
        result
    }

    /// Deletes every local copy of `file` (durably).
    pub fn remove_file(&self, file: FileId) -> Result<(), StoreError> {
        self.check()?;
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        for role in [Role::Primary, Role::Mirror] {
            open.remove(&(file, role));
            self.dirty
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&(file, role));
            let (dn, hn) = names(file, role);
            self.disk.remove(&dn).map_err(|e| StoreError::io(&dn, e))?;
            self.disk.remove(&hn).map_err(|e| StoreError::io(&hn, e))?;
        }
        drop(open);
        if let Err(e) = self.disk.sync_dir() {
            self.poisoned.store(true, Ordering::SeqCst);
            return Err(StoreError::io("fsync directory", e));
        }
        Ok(())
    }

    /// Every (file, role) with local data.
    pub fn files(&self) -> Result<Vec<(FileId, Role)>, StoreError> {
        self.check()?;
        let names = self.disk.list().map_err(|e| StoreError::io("list store", e))?;
        Ok(names.iter().filter_map(|n| parse_name(n)).collect())
    }

    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::SeqCst)
    }
}

fn psls_svm_hash(x: u64) -> u64 {
    crate::placement::mix64(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FaultDisk, FileDisk};

    fn loc(index: u64) -> PageLoc {
        PageLoc {
            file: FileId(7),
            role: Role::Primary,
            index,
            local: index,
        }
    }
    fn page(b: u8) -> Vec<u8> {
        vec![b; PAGE_SIZE]
    }

    #[test]
    fn write_read_generations() {
        let dir = tempfile::tempdir().unwrap();
        let s = PageStore::new(Arc::new(FileDisk::new(dir.path()).unwrap()));
        assert_eq!(s.read(loc(4), 1).unwrap(), ReadOutcome::Missing);
        s.write(loc(4), 1, 0, &page(1)).unwrap();
        s.sync().unwrap();
        assert_eq!(s.read(loc(4), 1).unwrap(), ReadOutcome::Ok(page(1)));
        s.write(loc(4), 2, 1, &page(2)).unwrap();
        // Both versions readable until the caller commits.
        assert_eq!(s.read(loc(4), 1).unwrap(), ReadOutcome::Ok(page(1)));
        assert_eq!(s.read(loc(4), 2).unwrap(), ReadOutcome::Ok(page(2)));
        // A third generation committed on top of 2 overwrites the slot of 1, never 2.
        s.write(loc(4), 3, 2, &page(3)).unwrap();
        assert_eq!(s.read(loc(4), 2).unwrap(), ReadOutcome::Ok(page(2)));
        assert_eq!(s.read(loc(4), 1).unwrap(), ReadOutcome::Stale { found: 3 });
        // An aborted gen 4 (keep 2) then a retry of gen 4 reuses the same slot.
        s.write(loc(4), 4, 2, &page(4)).unwrap();
        s.write(loc(4), 4, 2, &page(5)).unwrap();
        assert_eq!(s.read(loc(4), 2).unwrap(), ReadOutcome::Ok(page(2)));
        assert_eq!(s.read(loc(4), 4).unwrap(), ReadOutcome::Ok(page(5)));
        assert_eq!(s.files().unwrap(), vec![(FileId(7), Role::Primary)]);
        assert!(s.write(loc(0), 1, 0, &[0u8; 10]).is_err());
        s.remove_file(FileId(7)).unwrap();
        assert_eq!(s.read(loc(4), 2).unwrap(), ReadOutcome::Missing);
    }

    #[test]
    fn flipped_byte_is_detected_and_repaired_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(FileDisk::new(dir.path()).unwrap());
        let s = PageStore::new(disk.clone());
        s.write(loc(8), 1, 0, &page(9)).unwrap();
        s.sync().unwrap();
        let f = disk.open("f0000000000000007.p.dat", false).unwrap();
        let mut all = vec![0u8; f.len().unwrap() as usize];
        f.read_at(0, &mut all).unwrap();
        let pos = all.iter().position(|&b| b == 9).unwrap() + 100;
        f.write_at(pos as u64, &[0x66]).unwrap();
        f.sync().unwrap();
        assert_eq!(s.read(loc(8), 1).unwrap(), ReadOutcome::Corrupt);
        s.write(loc(8), 1, 1, &page(9)).unwrap();
        s.sync().unwrap();
        assert_eq!(s.read(loc(8), 1).unwrap(), ReadOutcome::Ok(page(9)));
    }

    #[test]
    fn failed_fsync_poisons() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(FaultDisk::new(dir.path()).unwrap());
        let s = PageStore::new(disk.clone());
        s.write(loc(0), 1, 0, &page(1)).unwrap();
        disk.set_fail_sync(true);
        assert!(s.sync().is_err());
        disk.set_fail_sync(false);
        assert!(matches!(s.read(loc(0), 1), Err(StoreError::Poisoned)));
        assert!(matches!(s.write(loc(0), 1, 0, &page(1)), Err(StoreError::Poisoned)));
    }

    #[test]
    fn power_cut_at_every_point_keeps_committed_or_new() {
        // Version 1 of 8 pages is committed; version 2 is being written when the power fails
        // after k mutating operations. Each page must read back as version 1 (the committed
        // generation) intact, whatever k and whatever sectors survived.
        for k in 0..40 {
            for seed in [0u64, 1, 2, 3] {
                let dir = tempfile::tempdir().unwrap();
                {
                    let disk = Arc::new(FaultDisk::new(dir.path()).unwrap());
                    let s = PageStore::new(disk.clone());
                    for i in 0..8 {
                        s.write(loc(i), 1, 0, &page(i as u8 + 1)).unwrap();
                    }
                    s.sync().unwrap();
                    disk.halt_after(k);
                    let _ = (|| -> Result<(), StoreError> {
                        for i in 0..8 {
                            s.write(loc(i), 2, 1, &page(100 + i as u8))?;
                        }
                        s.sync()
                    })();
                    disk.power_cut(seed);
                }
                let s = PageStore::new(Arc::new(FaultDisk::new(dir.path()).unwrap()));
                for i in 0..8 {
                    assert_eq!(
                        s.read(loc(i), 1).unwrap(),
                        ReadOutcome::Ok(page(i as u8 + 1)),
                        "k={k} seed={seed} page {i}"
                    );
                    match s.read(loc(i), 2).unwrap() {
                        ReadOutcome::Ok(d) => assert_eq!(d, page(100 + i as u8)),
                        ReadOutcome::Stale { .. } | ReadOutcome::Corrupt => {}
                        ReadOutcome::Missing => panic!("slot of version 1 vanished"),
                    }
                }
            }
        }
    }
}
