//! Ranks' output, kept where it is produced: each rank's lines numbered in order, line k as
//! k·[`LINE_STEP`] (its sequence number), the last [`MAX_RANK_BYTES`] of each rank kept, so a
//! follower (`psls run`, `psls attach`) on any node fetches what came after what it has, and
//! sees every line once.
//!
//! A restarted rank ([`Numbering::replay`]) prints again the lines it printed after its
//! checkpoint: each that matches the next line kept of the earlier start takes that line's
//! number (a follower that printed it drops it); a line that does not (a notice printed only
//! on a restart) takes a number between the last kept line and the next one, so it is printed
//! once, after what was printed before.
//!
//! Invariants: a rank's records are kept in sequence order, a record whose number is kept
//! already is dropped (a line printed again after a rollback, a copy sent again), and one below
//! the last goes in its place; a follower is given a rank's lines only up to the first one not
//! yet known kept on a second node; the bytes kept per rank, the ranks kept and the bytes of
//! the whole store are bounded.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// The numbers between two lines, for lines a restarted rank prints that its earlier start
/// did not.
pub const LINE_STEP: u64 = 1 << 16;
/// How many kept lines ahead a restarted rank's line is looked for (past lines only an earlier
/// start printed, such as its restart notice).
pub const LOOKAHEAD: usize = 64;
/// Lines a restarted rank prints that match no kept line, in a row, before its numbering
/// gives up matching (it then numbers on after every kept line: a line may be printed twice,
/// none is lost).
pub const MAX_MISSES: u64 = 16;

/// The line index of number `seq`.
pub fn line_of(seq: u64) -> u64 {
    seq / LINE_STEP
}

/// Bytes of output kept per rank (the oldest lines go first).
pub const MAX_RANK_BYTES: usize = 4 << 20;
/// Most bytes one record holds (a longer line is cut into records).
pub const MAX_RECORD_BYTES: usize = 64 << 10;
/// Most (job, rank) streams one store keeps.
pub const MAX_STREAMS: usize = 65_536;
/// Most bytes one store keeps over every stream: past it, the oldest lines of the largest
/// streams go until it holds [`LOW_STORE_BYTES`].
pub const MAX_STORE_BYTES: usize = 256 << 20;
/// What a store over [`MAX_STORE_BYTES`] comes back to.
pub const LOW_STORE_BYTES: usize = MAX_STORE_BYTES - MAX_STORE_BYTES / 16;
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
    /// The numbers kept here not yet known kept on a second node too: followers are given no
    /// line from the first of them on while the job runs (a line they print must outlive this
    /// node, so that a restarted rank that prints it again is matched to it). Per record, not a
    /// mark: a restarted rank's line matched to a kept one may come after a higher-numbered
    /// line of its own (its notice), and is not durable because that one is.
    pending: BTreeSet<u64>,
}

/// The output kept on one node, by job and rank.
#[derive(Debug, Default)]
pub struct Store {
    streams: BTreeMap<(String, u32), Stream>,
    /// Bytes kept over every stream.
    bytes: usize,
}

impl Store {
    /// The last number of `job`'s rank `rank` here (0: none).
    pub fn last(&self, job: &str, rank: u32) -> u64 {
        self.streams.get(&(job.to_string(), rank)).map_or(0, |s| s.last)
    }

    /// The records of `job`'s rank `rank` after number `after`, in order, at most
    /// [`MAX_FETCH_BYTES`] (at least one record).
    pub fn of_rank(&self, job: &str, rank: u32, after: u64) -> Vec<Record> {
        let mut out = Vec::new();
        let mut bytes = 0;
        if let Some(s) = self.streams.get(&(job.to_string(), rank)) {
            for r in s.records.iter().filter(|r| r.seq > after) {
                if bytes + r.data.len() > MAX_FETCH_BYTES && !out.is_empty() {
                    break;
                }
                bytes += r.data.len();
                out.push(r.clone());
            }
        }
        out
    }

    /// Per rank, the last number of `job` here.
    pub fn last_all(&self, job: &str) -> BTreeMap<u32, u64> {
        self.streams
            .range((job.to_string(), 0)..)
            .take_while(|((j, _), _)| j == job)
            .map(|((_, rank), s)| (*rank, s.last))
            .collect()
    }

    /// Keeps a copy of another node's record `r` of `job` (kept there too: durable); whether
    /// it was new.
    pub fn push_copy(&mut self, job: &str, r: Record) -> bool {
        let (rank, seq) = (r.rank, r.seq);
        let new = self.push(job, r);
        self.mark_durable(job, rank, seq);
        new
    }

    /// The last number of `job`'s rank `rank` such that every record kept here up to it is
    /// known kept on a second node too (0: none).
    pub fn durable(&self, job: &str, rank: u32) -> u64 {
        self.streams
            .get(&(job.to_string(), rank))
            .map_or(0, |s| match s.pending.first() {
                Some(p) => s
                    .records
                    .iter()
                    .map(|r| r.seq)
                    .take_while(|q| q < p)
                    .last()
                    .unwrap_or(0),
                None => s.last,
            })
    }

    /// `job`'s rank `rank`'s record number `seq` is kept on a second node too.
    pub fn mark_durable(&mut self, job: &str, rank: u32, seq: u64) {
        if let Some(s) = self.streams.get_mut(&(job.to_string(), rank)) {
            s.pending.remove(&seq);
        }
    }

    /// Keeps record `r` of `job` (not yet durable), in order; whether it was new (a number
    /// kept already is dropped).
    pub fn push(&mut self, job: &str, r: Record) -> bool {
        let key = (job.to_string(), r.rank);
        if !self.streams.contains_key(&key) && self.streams.len() >= MAX_STREAMS {
            return false;
        }
        let s = self.streams.entry(key).or_default();
        let at = if r.seq > s.last {
            s.records.len()
        } else {
            // Below the last: a restarted rank's line matched to a kept number after a line of
            // its own above it, or a copy sent again.
            match s.records.binary_search_by_key(&r.seq, |x| x.seq) {
                Ok(_) => return false,
                Err(at) => at,
            }
        };
        s.last = s.last.max(r.seq);
        s.bytes += r.data.len();
        self.bytes += r.data.len();
        // (Bounded with the records: every pending number is a kept record's.)
        s.pending.insert(r.seq);
        s.records.insert(at, r);
        while s.bytes > MAX_RANK_BYTES {
            let Some(old) = s.records.pop_front() else { break };
            s.bytes -= old.data.len();
            self.bytes -= old.data.len();
            s.pending.remove(&old.seq);
        }
        if self.bytes > MAX_STORE_BYTES {
            self.shrink();
        }
        debug_assert_eq!(self.bytes, self.streams.values().map(|s| s.bytes).sum::<usize>());
        true
    }

    /// Drops the oldest lines of the largest streams until the store holds at most
    /// [`LOW_STORE_BYTES`]: every stream is cut to one cap, the largest under which the rest
    /// fits (run at most once per `MAX_STORE_BYTES / 16` bytes pushed).
    fn shrink(&mut self) {
        let mut sizes: Vec<usize> = self.streams.values().map(|s| s.bytes).collect();
        sizes.sort_unstable();
        // The cap: with the k smallest streams whole, the others share what is left.
        let mut left = LOW_STORE_BYTES;
        let mut cap = 0;
        for (k, &b) in sizes.iter().enumerate() {
            let share = left / (sizes.len() - k);
            if b > share {
                cap = share;
                break;
            }
            left -= b;
            cap = b;
        }
        for st in self.streams.values_mut() {
            while st.bytes > cap {
                let Some(old) = st.records.pop_front() else { break };
                st.pending.remove(&old.seq);
                st.bytes -= old.data.len();
                self.bytes -= old.data.len();
            }
        }
    }

    /// Bytes kept over every stream.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Records of `job` after the numbers in `after` (rank → last number the follower has;
    /// absent: 0), in rank then number order, at most [`MAX_FETCH_BYTES`] (at least one record),
    /// only durable ones unless `all` (the job ended); and, per rank, the first number kept
    /// when older ones went (a gap the follower reports).
    pub fn since(&self, job: &str, after: &BTreeMap<u32, u64>, all: bool) -> (Vec<Record>, BTreeMap<u32, u64>) {
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
                if line_of(first.seq) > line_of(have) + 1 && s.last > have {
                    gaps.insert(*rank, first.seq);
                }
            }
            for r in s.records.iter().filter(|r| r.seq > have) {
                if s.pending.contains(&r.seq) && !all {
                    break;
                }
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
        let mut freed = 0;
        self.streams.retain(|(j, _), s| {
            if j == job {
                freed += s.bytes;
            }
            j != job
        });
        self.bytes -= freed;
    }

    /// The jobs with output here.
    pub fn jobs(&self) -> Vec<String> {
        let mut v: Vec<String> = self.streams.keys().map(|(j, _)| j.clone()).collect();
        v.dedup();
        v
    }
}

/// How a rank's lines are numbered: on from its last number, or, for a restarted rank, first
/// as the kept lines of its earlier start that it prints again.
#[derive(Debug, Default)]
pub struct Numbering {
    /// The last number taken by a line of this start's own order (the mark a checkpoint
    /// keeps).
    last: u64,
    /// The kept lines after the checkpoint, in order, that the rank is expected to print again.
    expect: VecDeque<Record>,
    /// The last kept number of the earlier start (the replay's lines are numbered below it,
    /// the lines only this start prints just above it).
    top: u64,
    /// Lines numbered above `top` so far, and mismatches in a row.
    extra: u64,
    misses: u64,
}

impl Numbering {
    /// Numbering on from `last` (0: from the first line).
    pub fn after(last: u64) -> Numbering {
        Numbering {
            last,
            top: last,
            ..Numbering::default()
        }
    }

    /// A restarted rank's numbering: its checkpoint's number `mark` and the lines kept after
    /// it, in order (`kept`, of this rank).
    pub fn replay(mark: u64, kept: Vec<Record>) -> Numbering {
        let top = kept.iter().map(|r| r.seq).max().unwrap_or(mark).max(mark);
        Numbering {
            last: mark,
            expect: kept.into_iter().filter(|r| r.seq > mark).collect(),
            top,
            extra: 0,
            misses: 0,
        }
    }

    /// The number of the rank's last line in its own order (what a checkpoint keeps).
    pub fn mark(&self) -> u64 {
        self.last
    }

    /// The number of the next line, `data` on standard error if `err`.
    pub fn number(&mut self, err: bool, data: &[u8]) -> u64 {
        if !self.expect.is_empty() {
            // The next kept line, or one a little further: the kept lines between were printed
            // only by an earlier start (its restart notice), and this start skips them.
            let hit = self
                .expect
                .iter()
                .take(LOOKAHEAD)
                .position(|e| e.err == err && e.data == data);
            if let Some(k) = hit {
                self.expect.drain(..k);
                let seq = self.expect.pop_front().map_or(self.last, |e| e.seq);
                self.misses = 0;
                self.last = seq;
                return seq;
            }
            self.misses += 1;
            if self.misses <= MAX_MISSES && self.extra + 1 < LINE_STEP {
                self.extra += 1;
                return self.top + self.extra;
            }
            // Not the same lines: numbered on after every kept one.
            self.expect.clear();
        }
        let base = self.last.max(self.top + self.extra);
        self.last = (line_of(base) + 1) * LINE_STEP;
        self.top = self.last;
        self.extra = 0;
        self.last
    }
}

/// Cuts a rank's output into records: whole lines, numbered by the rank's [`Numbering`]; a
/// line longer than [`MAX_RECORD_BYTES`] is cut; what follows the last newline waits (see
/// [`Lines::flush`]).
#[derive(Debug, Default)]
pub struct Lines {
    partial: Vec<u8>,
}

impl Lines {
    /// The records `data` completes, numbered by `n`.
    pub fn feed(&mut self, rank: u32, err: bool, data: &[u8], n: &mut Numbering) -> Vec<Record> {
        let mut out = Vec::new();
        for &b in data {
            self.partial.push(b);
            if b == b'\n' || self.partial.len() >= MAX_RECORD_BYTES {
                let data = std::mem::take(&mut self.partial);
                out.push(Record {
                    rank,
                    seq: n.number(err, &data),
                    err,
                    data,
                });
            }
        }
        out
    }

    /// What waits after the last newline, as a record of its own (at a safe point, at the end).
    pub fn flush(&mut self, rank: u32, err: bool, n: &mut Numbering) -> Option<Record> {
        if self.partial.is_empty() {
            return None;
        }
        let data = std::mem::take(&mut self.partial);
        Some(Record {
            rank,
            seq: n.number(err, &data),
            err,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_numbered_and_kept_once() {
        const L: u64 = LINE_STEP;
        let mut l = Lines::default();
        let mut n = Numbering::after(0);
        let mut rs = l.feed(2, false, b"a\nbb\nc\nx", &mut n);
        assert_eq!(rs.len(), 3);
        assert_eq!((rs[0].seq, rs[1].seq, rs[2].seq), (L, 2 * L, 3 * L));
        let tail = l.flush(2, false, &mut n).expect("the partial line");
        assert_eq!((tail.seq, tail.data.as_slice()), (4 * L, b"x".as_slice()));
        // (The partial line is left out below.)
        let tail = rs.pop().expect("line 3");
        let mut s = Store::default();
        for r in rs.into_iter().chain([tail]) {
            assert!(s.push("j", r));
        }
        // A rank restarted from a checkpoint taken after line 1: it says so first, then prints
        // lines 2 and 3 again, then a new one.
        let mut n = Numbering::replay(L, s.of_rank("j", 2, L));
        let again = Lines::default().feed(2, false, b"restarted\nbb\nc\nd\n", &mut n);
        let seqs: Vec<u64> = again.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![3 * L + 1, 2 * L, 3 * L, 4 * L]);
        assert_eq!(n.mark(), 4 * L);
        let new: Vec<bool> = again.into_iter().map(|r| s.push("j", r)).collect();
        assert_eq!(new, vec![true, false, false, true], "the notice and line 4 are new");
        // Nothing is given to a follower before a second node keeps it.
        assert!(s.since("j", &[(2, L)].into(), false).0.is_empty());
        s.mark_durable("j", 2, 3 * L);
        assert!(
            s.since("j", &[(2, L)].into(), false).0.is_empty(),
            "line 2 is not known kept elsewhere: nothing after it either"
        );
        s.mark_durable("j", 2, 2 * L);
        let durable: Vec<u64> = s.since("j", &[(2, L)].into(), false).0.iter().map(|r| r.seq).collect();
        assert_eq!(durable, vec![2 * L, 3 * L]);
        let (got, gaps) = s.since("j", &[(2, L)].into(), true);
        assert_eq!(
            got.iter().map(|r| r.seq).collect::<Vec<_>>(),
            vec![2 * L, 3 * L, 3 * L + 1, 4 * L]
        );
        let texts: Vec<&[u8]> = got.iter().map(|r| r.data.as_slice()).collect();
        assert_eq!(texts, vec![b"bb\n".as_slice(), b"c\n", b"restarted\n", b"d\n"]);
        assert!(gaps.is_empty());
        assert!(s.since("k", &BTreeMap::new(), true).0.is_empty());
        // A copy is durable where it is kept: the other node keeps it too.
        let mut b = Store::default();
        b.push_copy("j", got[3].clone());
        assert_eq!(b.since("j", &BTreeMap::new(), false).0.len(), 1);
    }

    /// Found by the job-control simulator: the kept lines hold an earlier restart's notice,
    /// which a later restart does not print again; its lines must still match theirs.
    #[test]
    fn a_second_restart_matches_past_the_notice_of_the_first() {
        const L: u64 = LINE_STEP;
        let line = |k: u64| format!("line {k}\n").into_bytes();
        let mut kept = vec![Record {
            rank: 0,
            seq: 2 * L,
            err: false,
            data: b"restarted in start 1\n".to_vec(),
        }];
        kept.extend((2..=4).map(|k| Record {
            rank: 0,
            seq: (k + 1) * L,
            err: false,
            data: line(k),
        }));
        let mut n = Numbering::replay(L, kept);
        assert_eq!(
            n.number(false, b"restarted in start 2\n"),
            5 * L + 1,
            "a new line: above the kept ones"
        );
        assert_eq!(n.number(false, &line(2)), 3 * L, "past the first restart's notice");
        assert_eq!(n.number(false, &line(3)), 4 * L);
        assert_eq!(n.number(false, &line(4)), 5 * L);
        assert_eq!(n.number(false, &line(5)), 6 * L);
    }

    #[test]
    fn a_restarted_rank_that_prints_other_lines_gives_up_matching_and_loses_none() {
        const L: u64 = LINE_STEP;
        let kept: Vec<Record> = (1..=40)
            .map(|k| Record {
                rank: 0,
                seq: k * L,
                err: false,
                data: format!("at {k}\n").into_bytes(),
            })
            .collect();
        let mut n = Numbering::replay(10 * L, kept);
        let seqs: Vec<u64> = (0..20)
            .map(|k| n.number(false, format!("other {k}\n").as_bytes()))
            .collect();
        // The first MAX_MISSES after the kept lines, in order; then on after every kept line.
        for (k, s) in seqs.iter().enumerate().take(MAX_MISSES as usize) {
            assert_eq!(*s, 40 * L + k as u64 + 1);
        }
        assert_eq!(seqs[MAX_MISSES as usize], 41 * L);
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    }

    #[test]
    fn a_rank_keeps_its_last_bytes_and_tells_the_gap() {
        let mut s = Store::default();
        let line = vec![b'x'; 1 << 16];
        let n = (MAX_RANK_BYTES / line.len()) as u64 + 10;
        for k in 1..=n {
            s.push(
                "j",
                Record {
                    rank: 0,
                    seq: k * LINE_STEP,
                    err: false,
                    data: line.clone(),
                },
            );
        }
        let (got, gaps) = s.since("j", &BTreeMap::new(), true);
        assert!(got.iter().map(|r| r.data.len()).sum::<usize>() <= MAX_FETCH_BYTES);
        assert_eq!(gaps.get(&0), Some(&(11 * LINE_STEP)), "the 10 oldest lines went");
        assert_eq!(s.last("j", 0), n * LINE_STEP);
        let kept: usize = s.streams.values().map(|x| x.bytes).sum();
        assert!(kept <= MAX_RANK_BYTES);
        s.forget("j");
        assert!(s.jobs().is_empty());
        assert_eq!(s.bytes(), 0);
    }

    #[test]
    fn the_whole_store_is_bounded_and_the_largest_streams_give_way() {
        let mut s = Store::default();
        let line = vec![b'y'; 1 << 16];
        // 100 ranks writing 4 MiB each: 400 MiB offered.
        let per_rank = MAX_RANK_BYTES / line.len();
        for seq in 1..=per_rank as u64 {
            for rank in 0..100 {
                let r = Record {
                    rank,
                    seq,
                    err: false,
                    data: line.clone(),
                };
                assert!(s.push("j", r));
                assert!(s.bytes() <= MAX_STORE_BYTES);
            }
        }
        assert!(s.bytes() > LOW_STORE_BYTES / 2, "{}", s.bytes());
        // Every rank keeps its newest lines; no rank was emptied to spare another.
        for rank in 0..100 {
            assert_eq!(s.of_rank("j", rank, per_rank as u64 - 1).len(), 1, "rank {rank}");
        }
        let kept: Vec<usize> = s.streams.values().map(|x| x.bytes).collect();
        let (lo, hi) = (kept.iter().min().unwrap(), kept.iter().max().unwrap());
        assert!(hi - lo <= 2 * line.len(), "{lo} .. {hi}");
    }

    /// Found by the job-control simulator: a restarted rank's line matched to a kept number
    /// comes after its own notice, numbered above it; it is kept in its place, and a follower
    /// gets neither before both are copied.
    #[test]
    fn a_line_numbered_below_the_last_is_kept_in_order_and_durable_by_itself() {
        const L: u64 = LINE_STEP;
        let rec = |seq: u64, text: &str| Record {
            rank: 0,
            seq,
            err: false,
            data: text.as_bytes().to_vec(),
        };
        let mut s = Store::default();
        assert!(s.push("j", rec(L + 1, "restarted\n")));
        assert!(s.push("j", rec(L, "line 1\n")), "below the last, not kept yet: kept");
        assert!(!s.push("j", rec(L, "line 1\n")), "kept already: dropped");
        s.mark_durable("j", 0, L + 1);
        assert!(
            s.since("j", &BTreeMap::new(), false).0.is_empty(),
            "line 1 is not copied yet"
        );
        assert_eq!(s.durable("j", 0), 0);
        s.mark_durable("j", 0, L);
        let seqs: Vec<u64> = s.since("j", &BTreeMap::new(), false).0.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![L, L + 1]);
        assert_eq!(s.durable("j", 0), L + 1);
    }
}
