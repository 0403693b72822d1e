//! The level of each checkpoint a job's safe points take (DESIGN §7), decided at the
//! coordinator: what the job's ranks asked for (`psls run --level`, `--persistent-interval`,
//! `--persistent-every`), when its last persistent checkpoint committed, how many memory ones
//! committed since, and whether its last memory round did not fit after its ranks went on.
//!
//! A checkpoint is persistent (the cleaner) when an operator asked for one (`psls checkpoint`,
//! `psls halt`), when the job pins it, when its last memory round did not fit after its ranks
//! went on, when a memory checkpoint might not fit now, or — for `auto` — at the job's first
//! checkpoint here, once the persistent interval elapsed since the last one, and at every
//! `persistent_every`-th one (so a power cut never loses a whole run). Memory otherwise.
//!
//! Invariants: a job pinned to persistent never gets a memory checkpoint, nor does a job whose
//! last memory round found no room; the table holds at most [`crate::MAX_ROUNDS`] jobs (past
//! it, a new job's choice is not kept, and it gets the safe side: persistent checkpoints).

use crate::cleaning::Policy;
use crate::msg::{Choice, Level};
use psls_svm::ErrorKind;
use std::collections::BTreeMap;

/// What a job's ranks asked for its checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobChoice {
    pub level: Choice,
    /// For `auto`: a persistent checkpoint once this long passed since the last one.
    pub persistent_interval_ms: u64,
    /// Every this many-th checkpoint is a cleaner (0: by the interval only).
    pub persistent_every: u32,
    /// What stays in memory after a cleaner checkpoint.
    pub cleaning: Policy,
}

/// What the level's choice knows of one job.
#[derive(Clone, Debug, Default)]
struct JobLevel {
    choice: Option<JobChoice>,
    /// When its last persistent checkpoint committed here.
    last_persistent_ms: Option<u64>,
    /// Memory checkpoints committed since its last persistent one.
    memory_since_persistent: u32,
    /// Its last memory round did not fit after its ranks went on: the next is the cleaner.
    cleaner_next: bool,
}

/// The coordinator's choice of each job's checkpoint level.
#[derive(Clone, Debug, Default)]
pub struct Levels {
    jobs: BTreeMap<String, JobLevel>,
}

impl Levels {
    pub fn new() -> Levels {
        Levels::default()
    }

    /// `job`'s ranks called a safe point asking for `choice`.
    pub fn called(&mut self, job: &str, choice: JobChoice) {
        if let Some(j) = self.job_mut(job) {
            j.choice = Some(choice);
        }
    }

    /// What `job`'s ranks asked for, if they called here.
    pub fn choice(&self, job: &str) -> Option<JobChoice> {
        self.jobs.get(job).and_then(|j| j.choice)
    }

    /// The level of `job`'s checkpoint at a safe point at `now_ms`: `forced` when an operator
    /// asked for a persistent one (a halt, `psls checkpoint`); `memory_fits` when every node
    /// has room for a memory checkpoint by the figures the coordinator has. Takes back a
    /// cleaner that was owed for want of room.
    pub fn choose(&mut self, job: &str, now_ms: u64, forced: bool, memory_fits: bool) -> Level {
        let j = self.jobs.get_mut(job);
        let owed = j.as_ref().is_some_and(|j| j.cleaner_next);
        let (choice, last, since) = match j {
            Some(j) => {
                j.cleaner_next = false;
                (j.choice, j.last_persistent_ms, j.memory_since_persistent)
            }
            None => (None, None, 0),
        };
        // A job whose choice is not known gets what `auto` with no interval gives: persistent.
        let c = choice.unwrap_or(JobChoice {
            level: Choice::Auto,
            persistent_interval_ms: 0,
            persistent_every: 0,
            cleaning: Policy::NoCleaning,
        });
        if forced || c.level == Choice::Persistent || owed || !memory_fits {
            return Level::Persistent;
        }
        if c.level == Choice::Auto {
            if last.is_none_or(|last| now_ms.saturating_sub(last) >= c.persistent_interval_ms) {
                return Level::Persistent;
            }
            if c.persistent_every > 0 && since.saturating_add(1) >= c.persistent_every {
                return Level::Persistent;
            }
        }
        Level::Memory
    }

    /// A checkpoint of `job` at `level` committed at `now_ms`.
    pub fn committed(&mut self, job: &str, level: Level, now_ms: u64) {
        let Some(j) = self.job_mut(job) else { return };
        match level {
            Level::Memory => {
                debug_assert!(
                    j.choice.is_none_or(|c| c.level != Choice::Persistent),
                    "a memory checkpoint committed for a job pinned to persistent ones"
                );
                j.memory_since_persistent = j.memory_since_persistent.saturating_add(1);
            }
            Level::Persistent => {
                j.last_persistent_ms = Some(now_ms);
                j.memory_since_persistent = 0;
            }
        }
    }

    /// `job`'s memory round did not fit on a holder after its ranks went on: its next
    /// checkpoint is the cleaner.
    pub fn no_room(&mut self, job: &str) {
        if let Some(j) = self.job_mut(job) {
            j.cleaner_next = true;
        }
    }

    /// `job`'s round at `level` failed with an error of class `kind`; `went_on`: its ranks
    /// went on meanwhile. Returns the level of a round to run at once, at the same safe point.
    ///
    /// Only a memory round that did not fit (`NoSpace`) is followed, by the cleaner: at once
    /// while the ranks wait (the pages are still the safe point's), else at the job's next
    /// safe point ([`Levels::no_room`]). After any other failure, a node that died took its
    /// pages and ranks' states with it: a persistent round now would commit a checkpoint
    /// without them (the rollback that follows restores the last one).
    pub fn failed(&mut self, job: &str, level: Level, kind: ErrorKind, went_on: bool) -> Option<Level> {
        match (level, kind) {
            (Level::Memory, ErrorKind::NoSpace) if went_on => {
                self.no_room(job);
                None
            }
            (Level::Memory, ErrorKind::NoSpace) => Some(Level::Persistent),
            _ => None,
        }
    }

    /// `job` ended or was forgotten here.
    pub fn forget(&mut self, job: &str) {
        self.jobs.remove(job);
    }

    /// Jobs known.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// `job`'s entry, made if there is room for it.
    fn job_mut(&mut self, job: &str) -> Option<&mut JobLevel> {
        if !self.jobs.contains_key(job) && self.jobs.len() >= crate::MAX_ROUNDS {
            return None;
        }
        Some(self.jobs.entry(job.to_string()).or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_memory_round_without_room_is_followed_by_the_cleaner() {
        let mut l = Levels::new();
        l.called("j", auto(1000, 0));
        l.committed("j", Level::Persistent, 0);
        assert_eq!(l.choose("j", 10, false, true), Level::Memory);
        assert_eq!(
            l.failed("j", Level::Memory, ErrorKind::NoSpace, false),
            Some(Level::Persistent),
            "at once while the ranks wait"
        );
        assert_eq!(l.choose("j", 20, false, true), Level::Memory, "nothing owed");
        assert_eq!(l.failed("j", Level::Memory, ErrorKind::NoSpace, true), None);
        assert_eq!(
            l.choose("j", 30, false, true),
            Level::Persistent,
            "owed once the ranks went on"
        );
        assert_eq!(l.choose("j", 40, false, true), Level::Memory);
        for kind in [
            ErrorKind::Unavailable,
            ErrorKind::Io,
            ErrorKind::Internal,
            ErrorKind::Invalid,
        ] {
            assert_eq!(l.failed("j", Level::Memory, kind, false), None, "{kind:?}");
            assert_eq!(l.choose("j", 50, false, true), Level::Memory, "{kind:?}: nothing owed");
        }
        assert_eq!(l.failed("j", Level::Persistent, ErrorKind::NoSpace, false), None);
    }

    fn auto(interval_ms: u64, every: u32) -> JobChoice {
        JobChoice {
            level: Choice::Auto,
            persistent_interval_ms: interval_ms,
            persistent_every: every,
            cleaning: Policy::NoCleaning,
        }
    }

    /// `auto`: the first checkpoint is persistent, then memory ones until the interval elapsed
    /// since the last persistent one; an operator's request, a job pinned to persistent, a
    /// memory checkpoint that might not fit, and one that found no room all take the cleaner.
    #[test]
    fn auto_takes_the_cleaner_first_after_the_interval_and_when_memory_may_not_fit() {
        let mut l = Levels::new();
        assert_eq!(
            l.choose("j", 0, false, true),
            Level::Persistent,
            "unknown job: safe side"
        );
        l.called("j", auto(1000, 0));
        assert_eq!(l.choose("j", 0, false, true), Level::Persistent, "the first one");
        l.committed("j", Level::Persistent, 10);
        assert_eq!(l.choose("j", 500, false, true), Level::Memory);
        l.committed("j", Level::Memory, 510);
        assert_eq!(l.choose("j", 600, true, true), Level::Persistent, "an operator's");
        assert_eq!(l.choose("j", 600, false, false), Level::Persistent, "might not fit");
        l.no_room("j");
        assert_eq!(l.choose("j", 700, false, true), Level::Persistent, "owed after no room");
        assert_eq!(l.choose("j", 700, false, true), Level::Memory, "owed once");
        assert_eq!(
            l.choose("j", 1010, false, true),
            Level::Persistent,
            "the interval elapsed"
        );
        l.called(
            "j",
            JobChoice {
                level: Choice::Persistent,
                ..auto(1000, 0)
            },
        );
        assert_eq!(l.choose("j", 1020, false, true), Level::Persistent, "pinned");
        l.called(
            "j",
            JobChoice {
                level: Choice::Memory,
                ..auto(1000, 0)
            },
        );
        assert_eq!(
            l.choose("j", 5000, false, true),
            Level::Memory,
            "memory ignores the interval"
        );
        l.forget("j");
        assert!(l.is_empty());
    }

    /// `--persistent-every 3`: two memory checkpoints, then a persistent one.
    #[test]
    fn every_nth_checkpoint_is_persistent() {
        let mut l = Levels::new();
        l.called("j", auto(u64::MAX, 3));
        l.committed("j", Level::Persistent, 0);
        let mut got = Vec::new();
        for t in 1..=9 {
            let level = l.choose("j", t, false, true);
            l.committed("j", level, t);
            got.push(level);
        }
        use Level::{Memory as M, Persistent as P};
        assert_eq!(got, [M, M, P, M, M, P, M, M, P]);
    }

    /// Past the bound, a new job's choice is not kept: its checkpoints are persistent.
    #[test]
    fn the_table_is_bounded() {
        let mut l = Levels::new();
        for i in 0..crate::MAX_ROUNDS {
            l.called(&format!("j{i}"), auto(u64::MAX, 0));
        }
        l.called("late", auto(u64::MAX, 0));
        l.committed("late", Level::Persistent, 0);
        assert_eq!(l.len(), crate::MAX_ROUNDS);
        assert_eq!(l.choice("late"), None);
        assert_eq!(l.choose("late", 1, false, true), Level::Persistent);
    }
}
