//! The page store of one node. For every (file, role) it holds, three files:
//! - `f<id>.<p|m>.hdr`: 128 bytes per local page — the headers of slot 0 and slot 1;
//! - `f<id>.<p|m>.d0` and `.d1`: 4 KB per local page — the data of slot 0, resp. slot 1.
//!
//! Each slot file is dense by local index, so a batch of consecutive pages written to the same
//! slot is one contiguous write (and one extent on disk), and reading both headers of a run of
//! pages is one read.
//!
//! A page version is identified by its generation. The committed generation of each page is
//! known to the caller (from the namespace metadata, per page: [`crate::gens`]) and passed with
//! every page ([`PageRef::gen`]); a new version is written to the *shadow* slot, the one that
//! does not hold the committed generation, so the committed version stays intact until a
//! durable commit record names the new generation.
//!
//! Invariants:
//! - a read returns data only if the slot's header names this file, page and the expected
//!   generation and the crc32 over header and data matches (checked right after the read);
//! - a write never overwrites the slot holding `keep_gen` (the committed version), nor a slot
//!   holding a newer generation than its own, and its header is encoded from the very bytes
//!   written;
//! - after a failed fsync the store is poisoned and refuses every further operation.

use crate::disk::{Disk, DiskFile};
use crate::error::StoreError;
use crate::placement::Role;
use crate::slot::{self, HeaderState, HEADER_LEN};
use psls_svm::{FileId, PAGE_SIZE};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

const PAIR_LEN: usize = 2 * HEADER_LEN;

/// Largest local page position (4 PiB of pages per node and role): offsets stay far from
/// overflow whatever index a caller sends.
pub const MAX_LOCAL: u64 = 1 << 40;

fn check_refs(pages: &[PageRef]) -> Result<(), StoreError> {
    match pages.iter().find(|p| p.local > MAX_LOCAL) {
        Some(p) => Err(StoreError::BadPageIndex(p.local)),
        None => Ok(()),
    }
}

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

/// One page of a batch: its index in the file, its local position, and the generation of its
/// committed version (what a read expects; what a write must spare).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRef {
    pub index: u64,
    pub local: u64,
    pub gen: u64,
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

/// Status of one page of a batch read (its data is in the caller's buffer when `Ok`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ReadStatus {
    Ok,
    Missing,
    Stale { found: u64 },
    Corrupt,
}

impl std::fmt::Debug for ReadOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadOutcome::Ok(d) => write!(f, "Ok({} bytes, crc32 {:08x})", d.len(), crc32fast::hash(d)),
            ReadOutcome::Missing => write!(f, "Missing"),
            ReadOutcome::Stale { found } => write!(f, "Stale {{ found: {found} }}"),
            ReadOutcome::Corrupt => write!(f, "Corrupt"),
        }
    }
}

/// Files flushed at once by one [`PageStore::sync`] (a bound on the threads it starts).
const MAX_PARALLEL_SYNCS: usize = 16;

#[derive(Debug)]
struct SlotFiles {
    hdr: Arc<dyn DiskFile>,
    data: [Arc<dyn DiskFile>; 2],
    /// Writers (read-modify-write of headers) take it exclusively, readers shared: reads of
    /// one (file, role) run in parallel, and never see a half-done write.
    lock: std::sync::RwLock<()>,
}

impl SlotFiles {
    /// Both slots' headers of `len` consecutive local pages from `l0`.
    fn headers(&self, l0: u64, len: usize) -> Result<Vec<u8>, StoreError> {
        let mut hb = vec![0u8; len * PAIR_LEN];
        self.hdr
            .read_at(l0 * PAIR_LEN as u64, &mut hb)
            .map_err(|e| StoreError::io("read headers", e))?;
        Ok(hb)
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct PageStore {
    disk: Arc<dyn Disk>,
    open: Mutex<HashMap<(FileId, Role), Arc<SlotFiles>>>,
    dirty: Mutex<HashSet<(FileId, Role)>>,
    dir_dirty: AtomicBool,
    poisoned: AtomicBool,
    /// One `sync` at a time: a caller returns only after a flush that started after its
    /// writes (a second caller finding `dirty` emptied by a flush still running must wait for
    /// it, and learn if it failed).
    syncing: Mutex<()>,
}

fn names(file: FileId, role: Role) -> [String; 3] {
    let r = role.tag();
    [
        format!("f{file}.{r}.hdr"),
        format!("f{file}.{r}.d0"),
        format!("f{file}.{r}.d1"),
    ]
}

/// Parses a header file name back into (file, role).
fn parse_name(name: &str) -> Option<(FileId, Role)> {
    let rest = name.strip_prefix('f')?.strip_suffix(".hdr")?;
    let (id, tag) = rest.split_once('.')?;
    let role = match tag {
        "p" => Role::Primary,
        "m" => Role::Mirror,
        _ => return None,
    };
    Some((FileId(u64::from_str_radix(id, 16).ok()?), role))
}

/// Splits `pages` into runs of consecutive local indices: (start, len).
fn runs(pages: &[PageRef]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=pages.len() {
        if i == pages.len() || pages[i].local != pages[i - 1].local + 1 {
            out.push((start, i - start));
            start = i;
        }
    }
    out
}

fn header_at(buf: &[u8], j: usize, slot: usize) -> &[u8; HEADER_LEN] {
    buf[j * PAIR_LEN + slot * HEADER_LEN..][..HEADER_LEN]
        .try_into()
        .expect("64 bytes")
}

/// A header of a later format: refused, naming both formats.
fn refuse_newer(st: &[HeaderState; 2], file: FileId, index: u64) -> Result<(), StoreError> {
    match st.iter().find_map(|s| match s {
        HeaderState::Newer { version } => Some(*version),
        _ => None,
    }) {
        Some(found) => Err(StoreError::NewerFormat {
            file,
            index,
            found,
            supported: slot::FORMAT_VERSION,
        }),
        None => Ok(()),
    }
}

fn gen_of(s: HeaderState) -> Option<u64> {
    match s {
        HeaderState::Written { gen, .. } => Some(gen),
        _ => None,
    }
}

impl PageStore {
    pub fn new(disk: Arc<dyn Disk>) -> Self {
        PageStore {
            disk,
            open: Mutex::new(HashMap::new()),
            dirty: Mutex::new(HashSet::new()),
            dir_dirty: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            syncing: Mutex::new(()),
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

    fn slot_files(&self, file: FileId, role: Role, create: bool) -> Result<Option<Arc<SlotFiles>>, StoreError> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = open.get(&(file, role)) {
            return Ok(Some(p.clone()));
        }
        let [hn, d0, d1] = names(file, role);
        let exists = self
            .disk
            .list()
            .map_err(|e| StoreError::io("list store", e))?
            .contains(&hn);
        if !exists && !create {
            return Ok(None);
        }
        let open_one = |n: &str| self.disk.open(n, true).map_err(|e| StoreError::io(n, e));
        // Data files first: a header file exists only with its data files.
        let data = [open_one(&d0)?, open_one(&d1)?];
        let hdr = open_one(&hn)?;
        if !exists {
            self.dir_dirty.store(true, Ordering::SeqCst);
        }
        let p = Arc::new(SlotFiles {
            hdr,
            data,
            lock: std::sync::RwLock::new(()),
        });
        open.insert((file, role), p.clone());
        Ok(Some(p))
    }

    /// Reads `pages` (of one file and role; each at its generation [`PageRef::gen`]) into `out`
    /// (`pages.len()` × 4096 bytes; page i at `i * 4096`). Pages not `Ok` read as zero.
    pub fn read_batch(
        &self,
        file: FileId,
        role: Role,
        pages: &[PageRef],
        out: &mut [u8],
    ) -> Result<Vec<ReadStatus>, StoreError> {
        self.check()?;
        if out.len() != pages.len() * PAGE_SIZE {
            return Err(StoreError::BadPageLength(out.len()));
        }
        check_refs(pages)?;
        let Some(f) = self.slot_files(file, role, false)? else {
            out.fill(0);
            return Ok(vec![ReadStatus::Missing; pages.len()]);
        };
        let _g = f.lock.read().unwrap_or_else(|e| e.into_inner());
        let mut status = vec![ReadStatus::Missing; pages.len()];
        for (start, len) in runs(pages) {
            let l0 = pages[start].local;
            let hb = f.headers(l0, len)?;
            // Which slot holds the expected generation, per page.
            let mut want: Vec<Option<(usize, u32)>> = vec![None; len];
            for j in 0..len {
                let PageRef {
                    index,
                    gen: expected_gen,
                    ..
                } = pages[start + j];
                let st = [0, 1].map(|s| slot::parse(header_at(&hb, j, s), file, index));
                refuse_newer(&st, file, index)?;
                if let Some(s) = (0..2).find(|&s| gen_of(st[s]) == Some(expected_gen)) {
                    if let HeaderState::Written { crc, .. } = st[s] {
                        want[j] = Some((s, crc));
                    }
                } else if st.contains(&HeaderState::Garbage) {
                    status[start + j] = ReadStatus::Corrupt;
                } else if let Some(found) = st.iter().filter_map(|s| gen_of(*s)).max() {
                    status[start + j] = ReadStatus::Stale { found };
                }
            }
            // One read per sub-run of pages wanted from the same slot.
            let mut j = 0;
            while j < len {
                let Some((s, _)) = want[j] else {
                    j += 1;
                    continue;
                };
                let mut k = j + 1;
                while k < len && want[k].map(|w| w.0) == Some(s) {
                    k += 1;
                }
                let dst = &mut out[(start + j) * PAGE_SIZE..(start + k) * PAGE_SIZE];
                f.data[s]
                    .read_at((l0 + j as u64) * PAGE_SIZE as u64, dst)
                    .map_err(|e| StoreError::io("read page", e))?;
                j = k;
            }
            for j in 0..len {
                if let Some((s, crc)) = want[j] {
                    let page = &mut out[(start + j) * PAGE_SIZE..][..PAGE_SIZE];
                    if slot::checksum(header_at(&hb, j, s), page) == crc {
                        status[start + j] = ReadStatus::Ok;
                    } else {
                        status[start + j] = ReadStatus::Corrupt;
                    }
                }
            }
        }
        // Only the pages read are known: zero the others (no blanket memset up front).
        for (j, st) in status.iter().enumerate() {
            if *st != ReadStatus::Ok {
                out[j * PAGE_SIZE..][..PAGE_SIZE].fill(0);
            }
        }
        Ok(status)
    }

    /// Writes generation `gen` of `pages` (of one file and role; page i's bytes at
    /// `data[i * 4096..]`) into their shadow slots, never the slot holding a page's committed
    /// generation [`PageRef::gen`] (pass `gen` itself there to repair a copy in place). Not
    /// durable until [`PageStore::sync`].
    pub fn write_batch(
        &self,
        file: FileId,
        role: Role,
        gen: u64,
        pages: &[PageRef],
        data: &[u8],
    ) -> Result<(), StoreError> {
        self.check()?;
        if data.len() != pages.len() * PAGE_SIZE {
            return Err(StoreError::BadPageLength(data.len()));
        }
        check_refs(pages)?;
        let f = self.slot_files(file, role, true)?.ok_or(StoreError::NoSuchFile(file))?;
        let _g = f.lock.write().unwrap_or_else(|e| e.into_inner());
        for (start, len) in runs(pages) {
            let l0 = pages[start].local;
            let mut hb = f.headers(l0, len)?;
            let mut target = vec![0usize; len];
            for j in 0..len {
                let PageRef {
                    index, gen: keep_gen, ..
                } = pages[start + j];
                let st = [0, 1].map(|s| slot::parse(header_at(&hb, j, s), file, index));
                refuse_newer(&st, file, index)?;
                target[j] = if let Some(s) = (0..2).find(|&s| gen_of(st[s]) == Some(gen)) {
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
                // A late write of an abandoned version never replaces a newer one.
                if let Some(found) = gen_of(st[target[j]]).filter(|&g| g > gen) {
                    return Err(StoreError::Newer {
                        file,
                        index,
                        found,
                        gen,
                    });
                }
                let page = &data[(start + j) * PAGE_SIZE..][..PAGE_SIZE];
                // The header's checksum is computed from the very bytes written below.
                let h = slot::encode(file, index, gen, page);
                hb[j * PAIR_LEN + target[j] * HEADER_LEN..][..HEADER_LEN].copy_from_slice(&h);
            }
            let mut j = 0;
            while j < len {
                let s = target[j];
                let mut k = j + 1;
                while k < len && target[k] == s {
                    k += 1;
                }
                let src = &data[(start + j) * PAGE_SIZE..(start + k) * PAGE_SIZE];
                f.data[s]
                    .write_at((l0 + j as u64) * PAGE_SIZE as u64, src)
                    .map_err(|e| StoreError::io("write page", e))?;
                j = k;
            }
            f.hdr
                .write_at(l0 * PAIR_LEN as u64, &hb)
                .map_err(|e| StoreError::io("write headers", e))?;
        }
        self.dirty
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((file, role));
        Ok(())
    }

    /// Reads the copy of generation `expected_gen` of the page at `loc`.
    pub fn read(&self, loc: PageLoc, expected_gen: u64) -> Result<ReadOutcome, StoreError> {
        let mut buf = vec![0u8; PAGE_SIZE];
        let r = PageRef {
            index: loc.index,
            local: loc.local,
            gen: expected_gen,
        };
        let st = self.read_batch(loc.file, loc.role, &[r], &mut buf)?;
        Ok(match st[0] {
            ReadStatus::Ok => ReadOutcome::Ok(buf),
            ReadStatus::Missing => ReadOutcome::Missing,
            ReadStatus::Stale { found } => ReadOutcome::Stale { found },
            ReadStatus::Corrupt => ReadOutcome::Corrupt,
        })
    }

    /// Writes generation `gen` of the page at `loc` (see [`PageStore::write_batch`]).
    pub fn write(&self, loc: PageLoc, gen: u64, keep_gen: u64, data: &[u8]) -> Result<(), StoreError> {
        if data.len() != PAGE_SIZE {
            return Err(StoreError::BadPageLength(data.len()));
        }
        self.write_batch(
            loc.file,
            loc.role,
            gen,
            &[PageRef {
                index: loc.index,
                local: loc.local,
                gen: keep_gen,
            }],
            data,
        )
    }

    /// Makes every earlier write durable. On failure the store is poisoned.
    pub fn sync(&self) -> Result<(), StoreError> {
        let _one_at_a_time = self.syncing.lock().unwrap_or_else(|e| e.into_inner());
        // After the lock: a flush that ran meanwhile and failed is known here.
        self.check()?;
        let dirty: Vec<(FileId, Role)> = self.dirty.lock().unwrap_or_else(|e| e.into_inner()).drain().collect();
        let result = (|| {
            let mut files: Vec<(Arc<dyn DiskFile>, &'static str)> = Vec::new();
            for (file, role) in &dirty {
                if let Some(f) = self.slot_files(*file, *role, false)? {
                    for d in &f.data {
                        files.push((d.clone(), "fsync data"));
                    }
                    files.push((f.hdr.clone(), "fsync headers"));
                }
            }
            // Side by side: the file system joins concurrent flushes into one journal commit,
            // where one after the other each waits for its own device flush.
            for group in files.chunks(MAX_PARALLEL_SYNCS) {
                std::thread::scope(|s| {
                    let mut results: Vec<Result<(), StoreError>> = Vec::new();
                    let mut running = Vec::new();
                    for (f, what) in group {
                        // A thread that cannot be started: this file is flushed here instead.
                        match std::thread::Builder::new()
                            .name("psls-fsync".into())
                            .spawn_scoped(s, move || f.sync().map_err(|e| StoreError::io(*what, e)))
                        {
                            Ok(h) => running.push(h),
                            Err(_) => results.push(f.sync().map_err(|e| StoreError::io(*what, e))),
                        }
                    }
                    for h in running {
                        results.push(
                            h.join()
                                .unwrap_or_else(|_| Err(StoreError::io("fsync", std::io::Error::other("panicked")))),
                        );
                    }
                    results.into_iter().collect::<Result<Vec<()>, StoreError>>()
                })?;
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
            // Header file first: a data file without its header file holds nothing readable.
            for n in names(file, role) {
                self.disk.remove(&n).map_err(|e| StoreError::io(&n, e))?;
            }
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
        let far = PageLoc {
            local: u64::MAX / 2,
            index: u64::MAX - 3,
            ..loc(0)
        };
        assert!(matches!(s.write(far, 1, 0, &page(1)), Err(StoreError::BadPageIndex(_))));
        assert!(matches!(s.read(far, 1), Err(StoreError::BadPageIndex(_))));
        s.remove_file(FileId(7)).unwrap();
        assert_eq!(s.read(loc(4), 2).unwrap(), ReadOutcome::Missing);
    }

    #[test]
    fn an_older_generation_never_replaces_a_newer_shadow() {
        let dir = tempfile::tempdir().unwrap();
        let s = PageStore::new(Arc::new(FileDisk::new(dir.path()).unwrap()));
        s.write(loc(3), 1, 0, &page(1)).unwrap();
        s.write(loc(3), 5, 1, &page(5)).unwrap();
        // A late write at generation 4, sparing committed 1: its slot holds 5.
        assert!(matches!(
            s.write(loc(3), 4, 1, &page(4)),
            Err(StoreError::Newer { found: 5, gen: 4, .. })
        ));
        assert_eq!(s.read(loc(3), 5).unwrap(), ReadOutcome::Ok(page(5)));
        assert_eq!(s.read(loc(3), 1).unwrap(), ReadOutcome::Ok(page(1)));
        // Once 5 is committed, 1 is garbage: a later generation goes there.
        s.write(loc(3), 6, 5, &page(6)).unwrap();
        assert_eq!(s.read(loc(3), 6).unwrap(), ReadOutcome::Ok(page(6)));
        assert_eq!(s.read(loc(3), 5).unwrap(), ReadOutcome::Ok(page(5)));
    }

    #[test]
    fn flipped_byte_is_detected_and_repaired_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(FileDisk::new(dir.path()).unwrap());
        let s = PageStore::new(disk.clone());
        s.write(loc(8), 1, 0, &page(9)).unwrap();
        s.sync().unwrap();
        let f = disk.open("f0000000000000007.p.d0", false).unwrap();
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

    /// A slot a newer build wrote is refused, naming both formats: neither read as garbage
    /// (and "repaired" from the other copy) nor written over.
    #[test]
    fn a_slot_of_a_later_format_is_refused_naming_both_formats() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(FileDisk::new(dir.path()).unwrap());
        let s = PageStore::new(disk.clone());
        s.write(loc(8), 1, 0, &page(9)).unwrap();
        s.sync().unwrap();
        let h = disk.open("f0000000000000007.p.hdr", false).unwrap();
        h.write_at((8 * PAIR_LEN + 4) as u64, &2u16.to_le_bytes()).unwrap();
        h.sync().unwrap();
        let s = PageStore::new(disk);
        let later = |r: Result<(), StoreError>| match r {
            Err(
                e @ StoreError::NewerFormat {
                    found: 2, supported: 1, ..
                },
            ) => e.to_string(),
            other => panic!("{other:?}"),
        };
        let said = later(s.read(loc(8), 1).map(|_| ()));
        assert!(said.contains("format 2") && said.contains("up to 1"), "{said}");
        later(s.write(loc(8), 2, 1, &page(3)));
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

    const PAGES: u64 = 8;

    /// The bytes of version `gen` of page `i` (distinct for every version and page).
    fn version(gen: u64, i: u64) -> Vec<u8> {
        psls_svm::rng::random_bytes(PAGE_SIZE, gen << 32 | i)
    }

    /// Writes version `gen` of every page over the committed version `keep`, then syncs.
    fn write_version(s: &PageStore, gen: u64, keep: u64) -> Result<(), StoreError> {
        for i in 0..PAGES {
            s.write(loc(i), gen, keep, &version(gen, i))?;
        }
        s.sync()
    }

    /// A new file's version 1, then version 2 over it, then version 3 over version 2, each
    /// synced (the caller commits a version only once its sync returned Ok); the power fails
    /// after k mutating operations (whatever was under way fails from there on). Whatever k
    /// and whichever unsynced sectors and names survive: the newest version whose sync
    /// returned Ok reads back bit-identical, and the version being written reads back as
    /// exactly its own bytes or not at all (never as a torn or mixed page).
    #[test]
    fn power_cut_at_every_point_keeps_what_sync_acknowledged() {
        let mut seen = [false; 4];
        for k in 0..=60 {
            for seed in [0u64, 1, 2, 3] {
                let dir = tempfile::tempdir().unwrap();
                let synced = {
                    let disk = Arc::new(FaultDisk::new(dir.path()).unwrap());
                    let s = PageStore::new(disk.clone());
                    disk.halt_after(k);
                    let mut synced = 0;
                    for gen in 1..=3 {
                        if write_version(&s, gen, gen - 1).is_err() {
                            break;
                        }
                        synced = gen;
                    }
                    disk.power_cut(seed);
                    synced
                };
                seen[synced as usize] = true;
                let s = PageStore::new(Arc::new(FaultDisk::new(dir.path()).unwrap()));
                for i in 0..PAGES {
                    if synced > 0 {
                        assert_eq!(
                            s.read(loc(i), synced).unwrap(),
                            ReadOutcome::Ok(version(synced, i)),
                            "k={k} seed={seed} page {i}: version {synced} was synced (Ok) before the power cut"
                        );
                    }
                    if synced < 3 {
                        let next = synced + 1;
                        if let ReadOutcome::Ok(d) = s.read(loc(i), next).unwrap() {
                            assert!(
                                d == version(next, i),
                                "k={k} seed={seed} page {i}: unsynced version {next} reads back with other bytes"
                            );
                        }
                    }
                }
            }
        }
        // The cut points cover every stage: before the first sync, between, after the last.
        assert_eq!(seen, [true; 4], "newest synced versions seen (0..=3)");
    }
}
