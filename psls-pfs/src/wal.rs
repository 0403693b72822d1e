//! The metadata log's own file: raft's entries and hard state as appended records, so a write
//! that must reach the disk dirties only the bytes it adds.
//! On this machine an fdatasync after a 200-byte append costs a tenth of one after the dozen
//! scattered pages a redb commit writes (`meta-bench --fsync-probe`).
//!
//! Two files, `meta.wal.0` and `meta.wal.1`: the log is the one whose header is valid and of the
//! higher generation.
//! Header ([`HEADER_LEN`] bytes): `[magic "PSLSWAL\0"][format u16 LE][generation u64 LE]
//! [crc32 of the 18 bytes before, u32 LE]`.
//! Records follow: `[payload length u32 LE][crc32 of the payload u32 LE][payload]`, payload:
//! - `1` hard state: term, vote, commit (u64 LE each);
//! - `2` entries: per entry `[index u64 LE][length u32 LE][crate::logstore::encode_entry]`;
//!   they replace any entry at their indices and after (raft overwrites a log's tail);
//! - `3` compacted: index, term (u64 LE): the log starts after it (a file's first record).
//!
//! Replay stops at the first record whose length or CRC is wrong, or whose length is zero (a
//! write a crash tore: it was never synced, since records are only appended), and cuts the
//! file there, so later appends follow the last whole record.
//! A rewrite (compaction, snapshot) writes the kept log into the other file from its first
//! record, syncs it, then writes and syncs its header with the next generation: until that
//! header is whole on the disk the old file stays the log.
//!
//! Bounds: a record holds at most [`MAX_RECORD_BYTES`]; the files grow only by appends between
//! rewrites, which the caller makes at every compaction.

use crate::disk::{Disk, DiskFile};
use crate::error::MetaError;
use raft::eraftpb::{Entry, HardState};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Format of the files.
pub const FORMAT: u16 = 1;
/// Bytes of a header.
pub const HEADER_LEN: u64 = 22;
/// Largest record payload.
pub const MAX_RECORD_BYTES: usize = 64 << 20;
const MAGIC: &[u8; 8] = b"PSLSWAL\0";
const NAMES: [&str; 2] = ["meta.wal.0", "meta.wal.1"];
const HARD_STATE: u8 = 1;
const ENTRIES: u8 = 2;
const COMPACTED: u8 = 3;

/// What the log file holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Replayed {
    /// The log starts after this index and term.
    pub compacted: (u64, u64),
    pub hard_state: HardState,
    /// In index order, after `compacted`.
    pub entries: Vec<Entry>,
}

/// See the module documentation.
pub struct Wal {
    files: [Arc<dyn DiskFile>; 2],
    /// The file that is the log, its generation, and where the next record goes.
    active: usize,
    generation: u64,
    end: u64,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal")
            .field("active", &self.active)
            .field("generation", &self.generation)
            .field("end", &self.end)
            .finish()
    }
}

fn io(what: &str, e: std::io::Error) -> MetaError {
    MetaError::Db(format!("{what}: {e}"))
}

fn header(generation: u64) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend(FORMAT.to_le_bytes());
    h.extend(generation.to_le_bytes());
    let crc = crc32fast::hash(&h);
    h.extend(crc.to_le_bytes());
    debug_assert_eq!(h.len() as u64, HEADER_LEN);
    h
}

/// A whole header's format and generation, if `h` is one.
fn read_header(h: &[u8]) -> Option<(u16, u64)> {
    if h.len() != HEADER_LEN as usize || &h[..8] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(h[18..22].try_into().ok()?);
    if crc32fast::hash(&h[..18]) != crc {
        return None;
    }
    let format = u16::from_le_bytes(h[8..10].try_into().ok()?);
    Some((format, u64::from_le_bytes(h[10..18].try_into().unwrap_or_default())))
}

fn record(payload: &[u8], out: &mut Vec<u8>) {
    out.extend((payload.len() as u32).to_le_bytes());
    out.extend(crc32fast::hash(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

fn hard_state_payload(hs: &HardState) -> Vec<u8> {
    let mut p = vec![HARD_STATE];
    for x in [hs.term, hs.vote, hs.commit] {
        p.extend(x.to_le_bytes());
    }
    p
}

fn entries_payload(entries: &[Entry]) -> Vec<u8> {
    let mut p = vec![ENTRIES];
    for e in entries {
        let b = crate::logstore::encode_entry(e);
        p.extend(e.index.to_le_bytes());
        p.extend((b.len() as u32).to_le_bytes());
        p.extend(b);
    }
    p
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Applies one record's payload to `log`; an error names what does not decode.
fn replay_record(p: &[u8], log: &mut Replayed, entries: &mut BTreeMap<u64, Entry>) -> Result<(), MetaError> {
    let bad = |what: &str| MetaError::Corrupt(format!("metadata log file: {what}"));
    match p.first() {
        Some(&HARD_STATE) => {
            let (Some(term), Some(vote), Some(commit)) = (u64_at(p, 1), u64_at(p, 9), u64_at(p, 17)) else {
                return Err(bad("short hard state"));
            };
            log.hard_state.term = term;
            log.hard_state.vote = vote;
            log.hard_state.commit = commit;
        }
        Some(&ENTRIES) => {
            let mut at = 1;
            let mut first = true;
            while at < p.len() {
                let index = u64_at(p, at).ok_or_else(|| bad("short entry"))?;
                let len = p
                    .get(at + 8..at + 12)
                    .and_then(|b| b.try_into().ok())
                    .map(u32::from_le_bytes)
                    .ok_or_else(|| bad("short entry"))? as usize;
                let body = p.get(at + 12..at + 12 + len).ok_or_else(|| bad("short entry"))?;
                if first {
                    entries.split_off(&index);
                    first = false;
                }
                entries.insert(index, crate::logstore::decode_entry(index, body)?);
                at += 12 + len;
            }
        }
        Some(&COMPACTED) => {
            let (Some(index), Some(term)) = (u64_at(p, 1), u64_at(p, 9)) else {
                return Err(bad("short compaction"));
            };
            log.compacted = (index, term);
            *entries = entries.split_off(&(index + 1));
        }
        _ => return Err(bad("unknown record")),
    }
    Ok(())
}

impl Wal {
    /// Opens the log file on `disk` (creating both files if missing): the log it holds, or
    /// `None` when neither file has a whole header (a new log, or one never rewritten: see
    /// [`Wal::rewrite`], which a new log starts with).
    pub fn open(disk: &dyn Disk) -> Result<(Wal, Option<Replayed>), MetaError> {
        let mut files = Vec::with_capacity(2);
        for name in NAMES {
            files.push(disk.open(name, true).map_err(|e| io(name, e))?);
        }
        disk.sync_dir().map_err(|e| io("fsync directory", e))?;
        let files: [Arc<dyn DiskFile>; 2] = [files[0].clone(), files[1].clone()];
        let mut best: Option<(usize, u64)> = None;
        for (i, f) in files.iter().enumerate() {
            let mut h = vec![0u8; HEADER_LEN as usize];
            if f.len().map_err(|e| io(NAMES[i], e))? < HEADER_LEN {
                continue;
            }
            f.read_at(0, &mut h).map_err(|e| io(NAMES[i], e))?;
            match read_header(&h) {
                Some((FORMAT, g)) if best.is_none_or(|(_, b)| g > b) => best = Some((i, g)),
                Some((FORMAT, _)) => {}
                // A whole header of another format: refused, not taken for no header.
                Some((format, _)) => {
                    return Err(MetaError::Corrupt(format!(
                        "metadata log file {} of format {format}, and this build reads format {FORMAT} (written by a newer psls-node: run that build, or a newer one)",
                        NAMES[i]
                    )))
                }
                None => {}
            }
        }
        let Some((active, generation)) = best else {
            return Ok((
                Wal {
                    files,
                    active: 1,
                    generation: 0,
                    end: HEADER_LEN,
                },
                None,
            ));
        };
        let f = &files[active];
        let len = f.len().map_err(|e| io(NAMES[active], e))?;
        let mut bytes = vec![0u8; (len - HEADER_LEN) as usize];
        f.read_at(HEADER_LEN, &mut bytes).map_err(|e| io(NAMES[active], e))?;
        let mut log = Replayed::default();
        let mut entries = BTreeMap::new();
        let mut at = 0usize;
        while at + 8 <= bytes.len() {
            let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or_default()) as usize;
            let crc = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap_or_default());
            if len == 0 || len > MAX_RECORD_BYTES || at + 8 + len > bytes.len() {
                break;
            }
            let p = &bytes[at + 8..at + 8 + len];
            if crc32fast::hash(p) != crc {
                break;
            }
            replay_record(p, &mut log, &mut entries)?;
            at += 8 + len;
        }
        let end = HEADER_LEN + at as u64;
        if end < len {
            tracing::warn!(
                file = NAMES[active],
                cut_bytes = len - end,
                "metadata log file: a torn tail (never synced) is cut"
            );
            f.set_len(end).map_err(|e| io(NAMES[active], e))?;
            f.sync().map_err(|e| io(NAMES[active], e))?;
        }
        log.entries = entries.into_values().collect();
        Ok((
            Wal {
                files,
                active,
                generation,
                end,
            },
            Some(log),
        ))
    }

    /// Appends `entries` (replacing any at their indices and after) and the hard state; with
    /// `sync`, durable when this returns.
    pub fn append(&mut self, entries: &[Entry], hard_state: Option<&HardState>, sync: bool) -> Result<(), MetaError> {
        assert!(self.generation > 0, "a log file is rewritten once before any append");
        let mut buf = Vec::new();
        if !entries.is_empty() {
            let p = entries_payload(entries);
            if p.len() > MAX_RECORD_BYTES {
                return Err(MetaError::Invalid(format!(
                    "{} entries take {} bytes, more than a log record's {MAX_RECORD_BYTES}",
                    entries.len(),
                    p.len()
                )));
            }
            record(&p, &mut buf);
        }
        if let Some(hs) = hard_state {
            record(&hard_state_payload(hs), &mut buf);
        }
        let f = &self.files[self.active];
        if !buf.is_empty() {
            f.write_at(self.end, &buf).map_err(|e| io(NAMES[self.active], e))?;
            self.end += buf.len() as u64;
        }
        if sync {
            f.sync().map_err(|e| io(NAMES[self.active], e))?;
        }
        Ok(())
    }

    /// Replaces the log with one that starts after `compacted` and holds `entries` and
    /// `hard_state`, in the other file; durable when this returns.
    pub fn rewrite(
        &mut self,
        compacted: (u64, u64),
        hard_state: &HardState,
        entries: &[Entry],
    ) -> Result<(), MetaError> {
        let next = 1 - self.active;
        let f = &self.files[next];
        let mut buf = Vec::new();
        let mut c = vec![COMPACTED];
        c.extend(compacted.0.to_le_bytes());
        c.extend(compacted.1.to_le_bytes());
        record(&c, &mut buf);
        for chunk in entries.chunks(4096) {
            record(&entries_payload(chunk), &mut buf);
        }
        record(&hard_state_payload(hard_state), &mut buf);
        let name = NAMES[next];
        // The old header goes first: a crash before the new one is whole leaves this file no
        // log at all.
        f.set_len(0).map_err(|e| io(name, e))?;
        f.write_at(0, &[0u8; HEADER_LEN as usize]).map_err(|e| io(name, e))?;
        f.write_at(HEADER_LEN, &buf).map_err(|e| io(name, e))?;
        f.sync().map_err(|e| io(name, e))?;
        let generation = self.generation + 1;
        f.write_at(0, &header(generation)).map_err(|e| io(name, e))?;
        f.sync().map_err(|e| io(name, e))?;
        self.active = next;
        self.generation = generation;
        self.end = HEADER_LEN + buf.len() as u64;
        Ok(())
    }

    /// Bytes of the two files.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.len().unwrap_or(0)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FaultDisk, FileDisk};
    use raft::eraftpb::EntryType;

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        let mut e = Entry {
            index,
            term,
            data: data.to_vec().into(),
            ..Default::default()
        };
        e.set_entry_type(EntryType::EntryNormal);
        e
    }

    fn hs(term: u64, commit: u64) -> HardState {
        HardState {
            term,
            vote: 1,
            commit,
            ..Default::default()
        }
    }

    #[test]
    fn records_replay_with_overwritten_tails_and_compaction() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        let (mut w, got) = Wal::open(&disk).unwrap();
        assert!(got.is_none());
        w.rewrite((0, 0), &hs(1, 0), &[]).unwrap();
        w.append(
            &[entry(1, 1, b"a"), entry(2, 1, b"b"), entry(3, 1, b"c")],
            Some(&hs(1, 1)),
            true,
        )
        .unwrap();
        // A new leader overwrites the tail from 2.
        w.append(&[entry(2, 2, b"x")], Some(&hs(2, 2)), true).unwrap();
        drop(w);
        let (mut w, got) = Wal::open(&disk).unwrap();
        let got = got.unwrap();
        assert_eq!(got.hard_state, hs(2, 2));
        assert_eq!(got.entries, vec![entry(1, 1, b"a"), entry(2, 2, b"x")]);
        w.rewrite((1, 1), &got.hard_state, &got.entries[1..]).unwrap();
        w.append(&[entry(3, 2, b"y")], None, true).unwrap();
        let (_, got) = Wal::open(&disk).unwrap();
        let got = got.unwrap();
        assert_eq!(got.compacted, (1, 1));
        assert_eq!(got.entries, vec![entry(2, 2, b"x"), entry(3, 2, b"y")]);
    }

    /// A log file a newer build wrote (a whole header of another format) is refused with one
    /// line naming both formats, not taken for a file with no header (whose log would then be
    /// lost).
    #[test]
    fn a_log_file_of_a_newer_format_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        let mut h = MAGIC.to_vec();
        h.extend((FORMAT + 1).to_le_bytes());
        h.extend(7u64.to_le_bytes());
        let crc = crc32fast::hash(&h);
        h.extend(crc.to_le_bytes());
        std::fs::write(dir.path().join(NAMES[0]), &h).unwrap();
        let e = Wal::open(&disk).unwrap_err().to_string();
        assert!(
            e.contains(&format!("of format {}", FORMAT + 1)) && e.contains(&format!("reads format {FORMAT}")),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
    }

    #[test]
    fn a_torn_tail_is_cut_and_appends_follow_the_last_whole_record() {
        let dir = tempfile::tempdir().unwrap();
        let disk = FileDisk::new(dir.path()).unwrap();
        let (mut w, _) = Wal::open(&disk).unwrap();
        w.rewrite((0, 0), &hs(1, 0), &[]).unwrap();
        w.append(&[entry(1, 1, b"a")], Some(&hs(1, 1)), true).unwrap();
        let whole = w.end;
        w.append(&[entry(2, 1, b"bbbbbbbb")], None, true).unwrap();
        // Tear the last record: its last bytes never reached the disk; then zeros past the end.
        let f = disk.open(NAMES[w.active], false).unwrap();
        let len = f.len().unwrap();
        f.set_len(len - 3).unwrap();
        f.set_len(len + 4096).unwrap();
        drop(w);
        let (mut w, got) = Wal::open(&disk).unwrap();
        assert_eq!(got.unwrap().entries, vec![entry(1, 1, b"a")]);
        assert_eq!(w.end, whole);
        w.append(&[entry(2, 1, b"c")], None, true).unwrap();
        let (_, got) = Wal::open(&disk).unwrap();
        assert_eq!(got.unwrap().entries, vec![entry(1, 1, b"a"), entry(2, 1, b"c")]);
    }

    /// Power cuts at random points of appends and rewrites: the log after a restart is what it
    /// was at its last sync or later (never less, never a state it never had).
    #[test]
    fn power_cuts_keep_every_synced_record() {
        for seed in 1..=40u64 {
            let dir = tempfile::tempdir().unwrap();
            let disk = FaultDisk::new(dir.path()).unwrap();
            let mut rng = psls_svm::rng::SplitMix64::new(seed);
            let (mut w, _) = Wal::open(&disk).unwrap();
            w.rewrite((0, 0), &hs(1, 0), &[]).unwrap();
            // The model: the log after each write, and which of them were synced.
            let mut model = Replayed {
                hard_state: hs(1, 0),
                ..Replayed::default()
            };
            let mut states = vec![model.clone()];
            let mut synced_at = 0usize;
            let mut next = 1u64;
            for _ in 0..rng.below(60) + 5 {
                match rng.below(10) {
                    0 => {
                        // Compaction: keep the last half.
                        let keep = model.entries.len() / 2;
                        let cut = model.entries.len() - keep;
                        if cut > 0 {
                            let last = &model.entries[cut - 1];
                            model.compacted = (last.index, last.term);
                            model.entries.drain(..cut);
                        }
                        w.rewrite(model.compacted, &model.hard_state, &model.entries).unwrap();
                        states.push(model.clone());
                        synced_at = states.len() - 1;
                    }
                    _ => {
                        // Sometimes a new term overwrites the tail.
                        if rng.below(5) == 0 && next > model.compacted.0 + 2 {
                            next -= 1;
                        }
                        let term = model.hard_state.term + u64::from(rng.below(4) == 0);
                        let es: Vec<Entry> = (0..rng.below(3) + 1)
                            .map(|k| entry(next + k, term, &[seed as u8; 40]))
                            .collect();
                        next += es.len() as u64;
                        model.entries.retain(|e| e.index < es[0].index);
                        model.entries.extend(es.iter().cloned());
                        // Two records: the entries, then the hard state.
                        states.push(model.clone());
                        model.hard_state = hs(term, model.hard_state.commit.max(es[0].index - 1));
                        let sync = rng.below(3) != 0;
                        w.append(&es, Some(&model.hard_state), sync).unwrap();
                        states.push(model.clone());
                        if sync {
                            synced_at = states.len() - 1;
                        }
                    }
                }
            }
            disk.power_cut(seed);
            drop(w);
            let disk = FaultDisk::new(dir.path()).unwrap();
            let (_, got) = Wal::open(&disk).unwrap();
            let got = got.unwrap();
            assert!(
                states[synced_at..].contains(&got),
                "seed {seed}: after the cut the log is {got:?}, not a state at or after the last sync"
            );
        }
    }
}
