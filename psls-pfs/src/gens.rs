//! Per-page generations of a file ([`PageGens`]): which committed version each page's slots
//! must hold. An import writes every page at the file's base generation; each persistent
//! checkpoint writes only the pages it found dirty, at its own generation, and its commit
//! record sets those pages' generations here. A reader therefore knows the exact generation
//! it expects of every page: a slot holding another one (an interrupted or aborted write, an
//! older version after a lost or erased slot) is never taken for the page.
//!
//! Kept as disjoint runs `start → (end, gen)` (end exclusive): programs write pages in runs,
//! so a file's map stays a few runs per checkpoint region, not one entry per page.
//! Invariants: runs are disjoint, non-empty and sorted; two adjacent runs never have the same
//! generation (they are merged).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// See the module documentation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageGens(BTreeMap<u64, (u64, u64)>);

impl PageGens {
    /// The generation set for page `index`, if a checkpoint wrote it.
    pub fn get(&self, index: u64) -> Option<u64> {
        let (_, &(end, gen)) = self.0.range(..=index).next_back()?;
        (index < end).then_some(gen)
    }

    /// Sets pages `start..end` to generation `gen`.
    pub fn set(&mut self, start: u64, end: u64, gen: u64) {
        if start >= end {
            return;
        }
        // Runs overlapping [start, end): disjoint and sorted, so their ends grow too and the
        // ones ending after `start` are a suffix of those starting before `end`.
        let overlapping: Vec<(u64, (u64, u64))> = self
            .0
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > start)
            .map(|(s, r)| (*s, *r))
            .collect();
        for (s, (e, g)) in overlapping {
            self.0.remove(&s);
            if s < start {
                self.0.insert(s, (start, g));
            }
            if e > end {
                self.0.insert(end, (e, g));
            }
        }
        let (mut start, mut end) = (start, end);
        // Merge with neighbours of the same generation.
        if let Some((&s, &(e, g))) = self.0.range(..start).next_back() {
            if e == start && g == gen {
                self.0.remove(&s);
                start = s;
            }
        }
        if let Some(&(e, g)) = self.0.get(&end) {
            if g == gen {
                self.0.remove(&end);
                end = e;
            }
        }
        self.0.insert(start, (end, gen));
    }

    /// Forgets pages from `from` on (a file that shrank).
    pub fn truncate(&mut self, from: u64) {
        let after: Vec<u64> = self.0.range(from..).map(|(s, _)| *s).collect();
        for s in after {
            self.0.remove(&s);
        }
        if let Some((_, (e, _))) = self.0.range_mut(..from).next_back() {
            *e = (*e).min(from);
        }
    }

    /// How many runs are kept.
    pub fn runs(&self) -> usize {
        self.0.len()
    }

    /// The runs: `(start, end, gen)`.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.0.iter().map(|(s, (e, g))| (*s, *e, *g))
    }

    /// The highest generation of any run (0 when there is none).
    pub fn max_gen(&self) -> u64 {
        self.0.values().map(|(_, g)| *g).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The map as a plain per-page array, for comparing with a model.
    fn model_check(p: &PageGens, model: &[Option<u64>]) {
        for (i, want) in model.iter().enumerate() {
            assert_eq!(p.get(i as u64), *want, "page {i} of {p:?}");
        }
        let runs: Vec<_> = p.iter().collect();
        for w in runs.windows(2) {
            assert!(w[0].1 <= w[1].0, "runs overlap: {runs:?}");
            assert!(!(w[0].1 == w[1].0 && w[0].2 == w[1].2), "unmerged runs: {runs:?}");
        }
        assert!(runs.iter().all(|r| r.0 < r.1), "empty run: {runs:?}");
    }

    #[test]
    fn sets_split_and_merge_like_a_per_page_array() {
        let mut rng = psls_svm::rng::SplitMix64::new(7);
        for _ in 0..300 {
            let mut p = PageGens::default();
            let mut model = vec![None; 64];
            for _ in 0..20 {
                let a = rng.below(64);
                let b = a + 1 + rng.below(64 - a);
                let g = 1 + rng.below(3);
                p.set(a, b, g);
                for m in &mut model[a as usize..b as usize] {
                    *m = Some(g);
                }
                model_check(&p, &model);
            }
            let cut = rng.below(64);
            p.truncate(cut);
            for m in &mut model[cut as usize..] {
                *m = None;
            }
            model_check(&p, &model);
        }
        let mut p = PageGens::default();
        p.set(0, 10, 4);
        p.set(10, 20, 4);
        assert_eq!(p.runs(), 1);
        assert_eq!(p.max_gen(), 4);
        p.set(5, 5, 9);
        assert_eq!(p.runs(), 1, "an empty range changes nothing");
    }
}
