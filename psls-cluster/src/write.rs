//! The two-phase write of page copies: what an import, a repair and a rebuild do before their
//! commit record (DESIGN §7: new versions go to shadow slots and become current only through a
//! durable commit record).
//!
//! A writer sends batches of pages to the nodes that hold their copies; each node answers with
//! the incarnation that took them. When the writer has sent everything (`finish`) and every
//! batch is acknowledged, it asks every node it wrote to for an fsync, answered again with the
//! incarnation. Writes not yet synced die with an incarnation, so the write may commit only if
//! every node synced with the incarnation that took its writes. Then the machine asks for the
//! commit record (`Commit`: the shell submits `CommitFile` or `RebuildDone`), and reports the
//! outcome. Any failure before the commit aborts: the shell removes what was written (`Abort`
//! names the nodes).
//!
//! Invariant: `Commit` is emitted only when every batch sent was stored, and every node that
//! stored one has since synced with the same incarnation. At most one of `Commit` and `Abort`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// What the shell must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteAction {
    /// fsync everything written to `node`.
    Sync { node: String },
    /// Every copy is durable: write the commit record.
    Commit,
    /// Give up: remove what was written on these nodes.
    Abort { nodes: Vec<String>, why: String },
    /// The outcome (after `Commit` and its record, or after `Abort`).
    Done(Result<(), String>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    Writing { finished: bool },
    Syncing { pending: BTreeSet<String> },
    Committing,
    Over,
}

/// One two-phase write.
#[derive(Debug)]
pub struct Write {
    /// Node → the incarnation that took its first write.
    stored: BTreeMap<String, u64>,
    /// Batches sent and not yet acknowledged, per node.
    outstanding: BTreeMap<String, u64>,
    phase: Phase,
    actions: VecDeque<WriteAction>,
}

impl Default for Write {
    fn default() -> Self {
        Write::new()
    }
}

impl Write {
    pub fn new() -> Write {
        Write {
            stored: BTreeMap::new(),
            outstanding: BTreeMap::new(),
            phase: Phase::Writing { finished: false },
            actions: VecDeque::new(),
        }
    }

    /// The next action for the shell.
    pub fn poll_action(&mut self) -> Option<WriteAction> {
        self.actions.pop_front()
    }

    /// The next action for the shell, left in place.
    pub fn peek_action(&self) -> Option<&WriteAction> {
        self.actions.front()
    }

    /// Whether it is over (committed or aborted).
    pub fn is_over(&self) -> bool {
        self.phase == Phase::Over
    }

    /// A batch goes to `node`. Refused (false) once the write is past its writing phase.
    pub fn sent(&mut self, node: &str) -> bool {
        if !matches!(self.phase, Phase::Writing { finished: false }) {
            return false;
        }
        *self.outstanding.entry(node.to_string()).or_insert(0) += 1;
        true
    }

    /// `node` stored a batch with `incarnation`.
    pub fn stored(&mut self, node: &str, incarnation: u64) {
        if !matches!(self.phase, Phase::Writing { .. }) {
            return;
        }
        match self.outstanding.get_mut(node) {
            Some(n) if *n > 0 => *n -= 1,
            _ => return self.abort(format!("{node} acknowledged a batch it was not sent")),
        }
        match self.stored.insert(node.to_string(), incarnation) {
            Some(old) if old != incarnation => {
                return self.abort(format!(
                "{node} restarted during the write (incarnation {old} -> {incarnation}); its unsynced pages are lost"
            ))
            }
            _ => {}
        }
        self.maybe_sync();
    }

    /// A batch to `node` failed.
    pub fn store_failed(&mut self, node: &str, why: &str) {
        if matches!(self.phase, Phase::Writing { .. }) {
            self.abort(format!("writing to {node}: {why}"));
        }
    }

    /// Every batch has been sent.
    pub fn finish(&mut self) {
        if let Phase::Writing { finished } = &mut self.phase {
            *finished = true;
            self.maybe_sync();
        }
    }

    fn maybe_sync(&mut self) {
        if self.phase != (Phase::Writing { finished: true }) || self.outstanding.values().any(|&n| n > 0) {
            return;
        }
        let pending: BTreeSet<String> = self.stored.keys().cloned().collect();
        for node in &pending {
            self.actions.push_back(WriteAction::Sync { node: node.clone() });
        }
        self.phase = Phase::Syncing { pending };
        self.maybe_commit();
    }

    /// `node` synced as `incarnation`.
    pub fn synced(&mut self, node: &str, incarnation: u64) {
        let Phase::Syncing { pending } = &mut self.phase else {
            return;
        };
        if !pending.remove(node) {
            return;
        }
        if self.stored.get(node) != Some(&incarnation) {
            let old = self.stored.get(node).copied().unwrap_or(0);
            return self.abort(format!(
                "{node} restarted before its fsync (incarnation {old} -> {incarnation}); its pages are lost"
            ));
        }
        self.maybe_commit();
    }

    /// The fsync on `node` failed.
    pub fn sync_failed(&mut self, node: &str, why: &str) {
        if matches!(self.phase, Phase::Syncing { .. }) {
            self.abort(format!("fsync on {node}: {why}"));
        }
    }

    fn maybe_commit(&mut self) {
        if matches!(&self.phase, Phase::Syncing { pending } if pending.is_empty()) {
            self.phase = Phase::Committing;
            self.actions.push_back(WriteAction::Commit);
        }
    }

    /// The commit record's outcome.
    pub fn committed(&mut self, result: Result<(), String>) {
        if self.phase != Phase::Committing {
            return;
        }
        match result {
            Ok(()) => {
                self.phase = Phase::Over;
                self.actions.push_back(WriteAction::Done(Ok(())));
            }
            Err(e) => self.abort(format!("commit record: {e}")),
        }
    }

    /// Gives up (the writer's own reason: the source ended early, the client went away).
    pub fn abort(&mut self, why: String) {
        if self.phase == Phase::Over {
            return;
        }
        self.phase = Phase::Over;
        let nodes: Vec<String> = self
            .stored
            .keys()
            .chain(self.outstanding.keys())
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        self.actions.push_back(WriteAction::Abort {
            nodes,
            why: why.clone(),
        });
        self.actions.push_back(WriteAction::Done(Err(why)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(w: &mut Write) -> Vec<WriteAction> {
        std::iter::from_fn(|| w.poll_action()).collect()
    }

    #[test]
    fn commits_only_after_every_copy_is_synced_by_the_incarnation_that_took_it() {
        let mut w = Write::new();
        assert!(w.sent("a") && w.sent("b") && w.sent("a"));
        w.stored("a", 1);
        w.finish();
        assert!(drain(&mut w).is_empty(), "a batch is still out");
        w.stored("b", 7);
        w.stored("a", 1);
        assert_eq!(
            drain(&mut w),
            vec![
                WriteAction::Sync { node: "a".into() },
                WriteAction::Sync { node: "b".into() }
            ]
        );
        assert!(!w.sent("c"), "nothing is sent once syncing");
        w.synced("a", 1);
        assert!(drain(&mut w).is_empty());
        w.synced("b", 7);
        assert_eq!(drain(&mut w), vec![WriteAction::Commit]);
        w.committed(Ok(()));
        assert_eq!(drain(&mut w), vec![WriteAction::Done(Ok(()))]);
        assert!(w.is_over());
    }

    #[test]
    fn a_restart_between_write_and_sync_aborts() {
        let mut w = Write::new();
        w.sent("a");
        w.stored("a", 1);
        w.finish();
        drain(&mut w);
        w.synced("a", 2);
        let a = drain(&mut w);
        assert!(
            matches!(&a[0], WriteAction::Abort { nodes, why } if nodes == &["a".to_string()] && why.contains("restarted"))
        );
        assert!(matches!(&a[1], WriteAction::Done(Err(_))));
        w.committed(Ok(()));
        assert!(drain(&mut w).is_empty(), "nothing after the end");
        let mut w = Write::new();
        w.sent("a");
        w.sent("a");
        w.stored("a", 1);
        w.stored("a", 2);
        assert!(
            matches!(drain(&mut w)[0], WriteAction::Abort { .. }),
            "restart between two batches"
        );
    }
}
