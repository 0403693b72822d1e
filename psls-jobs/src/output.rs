//! Ranks' output, kept where it is produced: each rank's lines numbered in order (its
//! sequence number, which a restart continues from its checkpoint), the last
//! [`MAX_RANK_BYTES`] of each rank kept, so a follower (`psls run`, `psls attach`) on any node
//! fetches what came after what it has, and sees every line once.
//!
//! Invariants: a rank's records are kept in sequence order without gaps; a record whose number
//! is not above the rank's last is dropped (a line printed again after a rollback); the bytes
//! kept per rank and the ranks kept are bounded.

use std::collections::{BTreeMap, VecDeque};

/// Bytes of output kept per rank (the oldest lines go first).
pub const MAX_RANK_BYTES: usize = 4 << 20;
/// Most bytes one record holds (a longer line is cut into records).
pub const MAX_RECORD_BYTES: usize = 64 << 10;
/// Most (job, rank) streams one store keeps.
pub const MAX_STREAMS: usize = 65_536;
/// Most bytes one fetch returns.
pub const MAX_FETCH_BYTES: usize = 1 << 20;

/// One line (or a piece of one) of a rank's output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub rank: u32,
    /// Its number in the rank's output (from 1).
    pub seq: u64,
    /// Standard error (else standard output).
    pub err: bool,
    pub data: Vec<u8>,
}

#[derive(Debug, Default)]
struct Stream {
    records: VecDeque<Record>,
    bytes: usize,
    /// The last number taken (kept when the records go).
    last: u64,
}

/// The output kept on one node, by job and rank.
#[derive(Debug, Default)]
pub struct Store {
    streams: BTreeMap<(String, u32), Stream>,
}

impl Store {
    /// The last number of `job`'s rank `rank` here (0: none).
    pub fn last(&self, job: &str, rank: u32) -> u64 {
        self.streams.get(&(job.to_string(), rank)).map_or(0, |s| s.last)
    }

    /// Per rank, the last number of `job` here.
    pub fn last_all(&self, job: &str) -> BTreeMap<u32, u64> {
        self.streams
            .range((job.to_string(), 0)..)
            .take_while(|((j, _), _)| j == job)
            .map(|((_, rank), s)| (*rank, s.last))
            .collect()
    }

    /// Keeps record `r` of `job`; whether it was new (a number not above the rank's last is
    /// dropped).
    pub fn push(&mut self, job: &str, r: Record) -> bool {
        let key = (job.to_string(), r.rank);
        if !self.streams.contains_key(&key) && self.streams.len() >= MAX_STREAMS {
            return false;
        }
        let s = self.streams.entry(key).or_default();
        if r.seq <= s.last {
            return false;
        }
        s.last = r.seq;
        s.bytes += r.data.len();
        s.records.push_back(r);
        while s.bytes > MAX_RANK_BYTES {
            let Some(old) = s.records.pop_front() else { break };
            s.bytes -= old.data.len();
        }
        true
    }

    /// Records of `job` after the numbers in `after` (rank → last number the follower has;
    /// absent: 0), in rank then number order, at most [`MAX_FETCH_BYTES`] (at least one record);
    /// and, per rank, the first number kept when older ones went (a gap the follower reports).
    pub fn since(&self, job: &str, after: &BTreeMap<u32, u64>) -> (Vec<Record>, BTreeMap<u32, u64>) {
        let mut out = Vec::new();
        let mut gaps = BTreeMap::new();
        let mut bytes = 0;
        let from = (job.to_string(), 0);
        for ((j, rank), s) in self.streams.range(from..) {
            if j != job {
                break;
            }
            let have = after.get(rank).copied().unwrap_or(0);
            if let Some(first) = s.records.front() {
                if first.seq > have + 1 && s.last > have {
                    gaps.insert(*rank, first.seq);
                }
            }
            for r in s.records.iter().filter(|r| r.seq > have) {
                if bytes + r.data.len() > MAX_FETCH_BYTES && !out.is_empty() {
                    return (out, gaps);
                }
                bytes += r.data.len();
                out.push(r.clone());
            }
        }
        (out, gaps)
    }

    /// Forgets `job`'s output.
    pub fn forget(&mut self, job: &str) {
        self.streams.retain(|(j, _), _| j != job);
    }

    /// The jobs with output here.
    pub fn jobs(&self) -> Vec<String> {
        let mut v: Vec<String> = self.streams.keys().map(|(j, _)| j.clone()).collect();
        v.dedup();
        v
    }
}

/// Cuts a rank's output into records: whole lines, numbered from the rank's last number; a
/// line longer than [`MAX_RECORD_BYTES`] is cut; what follows the last newline waits (see
/// [`Lines::flush`]).
#[derive(Debug, Default)]
pub struct Lines {
    partial: Vec<u8>,
}

impl Lines {
    /// The records `data` completes, numbered after `*seq` (which moves on).
    pub fn feed(&mut self, rank: u32, err: bool, data: &[u8], seq: &mut u64) -> Vec<Record> {
        let mut out = Vec::new();
        for &b in data {
            self.partial.push(b);
            if b == b'\n' || self.partial.len() >= MAX_RECORD_BYTES {
                *seq += 1;
                out.push(Record {
                    rank,
                    seq: *seq,
                    err,
                    data: std::mem::take(&mut self.partial),
                });
            }
        }
        out
    }

    /// What waits after the last newline, as a record of its own (at a safe point, at the end).
    pub fn flush(&mut self, rank: u32, err: bool, seq: &mut u64) -> Option<Record> {
        if self.partial.is_empty() {
            return None;
        }
        *seq += 1;
        Some(Record {
            rank,
            seq: *seq,
            err,
            data: std::mem::take(&mut self.partial),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_numbered_and_kept_once() {
        let mut l = Lines::default();
        let mut seq = 0;
        let rs = l.feed(2, false, b"a\nbb\nc", &mut seq);
        assert_eq!(rs.len(), 2);
        assert_eq!((rs[0].seq, rs[1].seq), (1, 2));
        let tail = l.flush(2, false, &mut seq).expect("the partial line");
        assert_eq!((tail.seq, tail.data.as_slice()), (3, b"c".as_slice()));
        let mut s = Store::default();
        for r in rs.into_iter().chain([tail]) {
            assert!(s.push("j", r));
        }
        // The same lines again (a rank restarted from a checkpoint taken after line 2).
        let mut seq = 2;
        let again = Lines::default().feed(2, false, b"c\nd\n", &mut seq);
        let new: Vec<bool> = again.into_iter().map(|r| s.push("j", r)).collect();
        assert_eq!(new, vec![false, true], "line 3 is there already, line 4 is new");
        let (got, gaps) = s.since("j", &[(2, 1)].into());
        assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert!(gaps.is_empty());
        assert!(s.since("k", &BTreeMap::new()).0.is_empty());
    }

    #[test]
    fn a_rank_keeps_its_last_bytes_and_tells_the_gap() {
        let mut s = Store::default();
        let line = vec![b'x'; 1 << 16];
        let n = (MAX_RANK_BYTES / line.len()) as u64 + 10;
        for seq in 1..=n {
            s.push(
                "j",
                Record {
                    rank: 0,
                    seq,
                    err: false,
                    data: line.clone(),
                },
            );
        }
        let (got, gaps) = s.since("j", &BTreeMap::new());
        assert!(got.iter().map(|r| r.data.len()).sum::<usize>() <= MAX_FETCH_BYTES);
        assert_eq!(gaps.get(&0), Some(&11), "the 10 oldest lines went");
        assert_eq!(s.last("j", 0), n);
        let kept: usize = s.streams.values().map(|x| x.bytes).sum();
        assert!(kept <= MAX_RANK_BYTES);
        s.forget("j");
        assert!(s.jobs().is_empty());
    }
}
