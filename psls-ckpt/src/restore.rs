//! [`Restore`]: the order of a job's restore, the step of a rollback that job control asks for
//! (`psls_jobs::Action::Restore`) once the job's ranks are stopped and every logical node is
//! live again.
//!
//! The steps, each sent to every logical node and answered by all before the next:
//! 1. **Seen**: every node's memory-checkpoint state, for the highest epoch any node saw
//!    (memory epochs leave no metadata record).
//! 2. **Fence**: the coordinator fences every epoch begun and every epoch seen
//!    ([`crate::frames::fence_epoch`]); what is committed then is the persistent checkpoint.
//! 3. **States** again, after the fence: a decision that was in flight has landed.
//! 4. **Settle**: the memory level of the rollback ([`crate::frames::rollback_target`]): every
//!    node settles its recovery copies to the target epoch.
//! 5. **Recreate** (only when the target is a memory checkpoint and some node lost its
//!    copies): every holder sends the copies whose other holder lost them.
//!    Then every lost node **adopts** the target: a restore cut short mid-way leaves it lost (its
//!    committed epoch unchanged), so the next restore re-creates its copies whole.
//! 6. **Drop**: every node drops every copy of the job's pages (each answers with the volatile
//!    segments it holds), so every page is next loaded from the restored checkpoint.
//! 7. **Serve**: every node rebuilds the directories of the job's files, then
//! 8. **Prefetch** (when the job asked for it), and [`RestoreAction::Done`].
//!
//! A failed step fails the whole restore: the shell drops the machine and job control asks
//! again later; every step is idempotent, so a restore cut short is done again whole.
//!
//! Invariants (asserted): no step starts before every node answered the one before; the epoch
//! restored is at least the persistent checkpoint, and never a fenced epoch's successor.
//! Bounds: one answer per node per step; an answer not awaited is a [`RestoreError`].

use psls_svm::FileId;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// A node's memory-checkpoint state of the job.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeState {
    /// Its last committed memory epoch.
    pub committed: u64,
    /// The epoch of the pre-recovery copies it holds.
    pub pre: Option<u64>,
    /// The highest epoch it saw begin.
    pub seen: u64,
    /// The files it holds recovery copies of.
    pub files: Vec<FileId>,
}

/// What the shell must do; each is answered by the `handle_*` of the same name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestoreAction {
    /// Ask node `node` (logical `logical`) for its [`NodeState`].
    AskState { logical: u32, node: String },
    /// Fence every epoch the coordinator began and every epoch up to `seen`; answer with the
    /// persistent checkpoint and the fenced epoch.
    Fence { seen: u64 },
    /// Settle node `node`'s recovery copies to memory epoch `target` (0: none), dropping those
    /// of epochs up to `fenced` that did not commit, and writers' copies of epochs up to the
    /// persistent checkpoint `persistent`; `files`: the job's checkpointed files.
    Settle {
        node: String,
        target: u64,
        fenced: u64,
        persistent: u64,
        files: Vec<FileId>,
    },
    /// Node `node` sends the copies of memory checkpoint `target` whose other holder is one of
    /// `lost` to that holder.
    Recreate { node: String, target: u64, lost: Vec<u32> },
    /// Node `node` (a lost one) received every re-created copy: memory checkpoint `target` is
    /// committed there.
    Adopt { node: String, target: u64 },
    /// Node `node` drops every copy of `files` and of the job's volatile segments.
    Drop { node: String, files: Vec<FileId> },
    /// Node `node` serves `files` again (their directories rebuilt).
    Serve { node: String, files: Vec<FileId> },
    /// Every node loads again the pages it held (answered by [`Restore::handle_prefetched`]).
    Prefetch { nodes: Vec<String> },
    /// The job is back at checkpoint `epoch` (0: its start); `memory`: the memory level's
    /// target (0: the persistent checkpoint), `lost`: the nodes whose copies were re-created;
    /// `given_up`: a memory checkpoint newer than the persistent one that could not be
    /// restored, because both recovery copies of some pages are lost (0: none).
    Done {
        epoch: u64,
        memory: u64,
        persistent: u64,
        lost: Vec<u32>,
        given_up: u64,
    },
}

/// An answer the machine did not wait for (a late or a foreign one).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("restore of job {job}: unexpected {what} from {node}")]
pub struct RestoreError {
    pub job: String,
    pub node: String,
    pub what: &'static str,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Seen,
    Fence,
    States,
    Settle,
    Recreate,
    Adopt,
    Drop,
    Serve,
    Prefetch,
    Done,
}

impl Stage {
    fn name(self) -> &'static str {
        match self {
            Stage::Seen | Stage::States => "state",
            Stage::Fence => "fence",
            Stage::Settle => "settle",
            Stage::Recreate => "recreate",
            Stage::Adopt => "adopt",
            Stage::Drop => "drop",
            Stage::Serve => "serve",
            Stage::Prefetch => "prefetch",
            Stage::Done => "answer",
        }
    }
}

/// One restore of one job (see the module doc).
#[derive(Debug)]
pub struct Restore {
    job: String,
    /// Logical id → physical node, every logical node of the job.
    nodes: BTreeMap<u32, String>,
    /// The job's files (its checkpointed files and its state file).
    files: Vec<FileId>,
    prefetch: bool,
    stage: Stage,
    /// Nodes that have not answered the current step.
    waiting: BTreeSet<String>,
    states: BTreeMap<u32, NodeState>,
    seen: u64,
    persistent: u64,
    fenced: u64,
    target: u64,
    lost: Vec<u32>,
    /// Files to serve: the job's, and the volatile segments the drops named.
    serve: BTreeSet<FileId>,
    actions: VecDeque<RestoreAction>,
}

impl Restore {
    /// A restore of `job` over its logical nodes `nodes` (logical id, physical name), whose
    /// files are `files`; `prefetch`: load the pages again afterwards.
    pub fn new(job: &str, nodes: &[(u32, String)], files: &[FileId], prefetch: bool) -> Restore {
        let mut r = Restore {
            job: job.to_string(),
            nodes: nodes.iter().cloned().collect(),
            files: files.iter().copied().collect::<BTreeSet<_>>().into_iter().collect(),
            prefetch,
            stage: Stage::Seen,
            waiting: BTreeSet::new(),
            states: BTreeMap::new(),
            seen: 0,
            persistent: 0,
            fenced: 0,
            target: 0,
            lost: Vec::new(),
            serve: BTreeSet::new(),
            actions: VecDeque::new(),
        };
        r.ask_states(Stage::Seen);
        r
    }

    /// The job restored.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// Whether the restore is over ([`RestoreAction::Done`] was given).
    pub fn is_done(&self) -> bool {
        self.stage == Stage::Done
    }

    /// The next action.
    pub fn poll_action(&mut self) -> Option<RestoreAction> {
        self.actions.pop_front()
    }

    fn unexpected(&self, node: &str, what: &'static str) -> RestoreError {
        RestoreError {
            job: self.job.clone(),
            node: node.to_string(),
            what,
        }
    }

    /// Takes `node`'s answer to step `stage`; true once every node answered it.
    fn answered(&mut self, node: &str, stage: Stage) -> Result<bool, RestoreError> {
        if self.stage != stage || !self.waiting.remove(node) {
            return Err(self.unexpected(node, stage.name()));
        }
        Ok(self.waiting.is_empty())
    }

    fn all(&mut self, stage: Stage, action: impl Fn(&str) -> RestoreAction) {
        assert!(
            self.waiting.is_empty(),
            "a step of the restore began before the last ended"
        );
        self.stage = stage;
        for p in self.nodes.values() {
            self.waiting.insert(p.clone());
            self.actions.push_back(action(p));
        }
    }

    fn ask_states(&mut self, stage: Stage) {
        self.states.clear();
        assert!(
            self.waiting.is_empty(),
            "a step of the restore began before the last ended"
        );
        self.stage = stage;
        for (&logical, p) in &self.nodes {
            self.waiting.insert(p.clone());
            self.actions.push_back(RestoreAction::AskState {
                logical,
                node: p.clone(),
            });
        }
    }

    /// Node `node`'s (logical `logical`) memory-checkpoint state.
    pub fn handle_state(&mut self, logical: u32, node: &str, state: NodeState) -> Result<(), RestoreError> {
        if self.nodes.get(&logical).map(String::as_str) != Some(node) {
            return Err(self.unexpected(node, "state"));
        }
        let stage = self.stage;
        if !matches!(stage, Stage::Seen | Stage::States) {
            return Err(self.unexpected(node, "state"));
        }
        let last = self.answered(node, stage)?;
        self.states.insert(logical, state);
        if !last {
            return Ok(());
        }
        match stage {
            Stage::Seen => {
                self.seen = self.states.values().map(|s| s.seen).max().unwrap_or(0);
                self.stage = Stage::Fence;
                self.actions.push_back(RestoreAction::Fence { seen: self.seen });
            }
            _ => self.settle(),
        }
        Ok(())
    }

    /// The fence is applied: `persistent` is the committed persistent checkpoint, `fenced` the
    /// epoch fenced.
    pub fn handle_fenced(&mut self, persistent: u64, fenced: u64) -> Result<(), RestoreError> {
        if self.stage != Stage::Fence {
            return Err(self.unexpected("the coordinator", "fence"));
        }
        self.persistent = persistent;
        self.fenced = fenced;
        self.ask_states(Stage::States);
        Ok(())
    }

    fn settle(&mut self) {
        let table: Vec<(u32, u64, Option<u64>)> = self.states.iter().map(|(&l, s)| (l, s.committed, s.pre)).collect();
        let (target, lost) = crate::frames::rollback_target(&table, self.persistent, self.nodes.len() as u32);
        assert!(
            target == 0 || target > self.persistent,
            "a memory target at or below the persistent checkpoint"
        );
        self.target = target;
        self.lost = lost;
        let files: Vec<FileId> = self
            .states
            .values()
            .flat_map(|s| s.files.iter().copied())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let (fenced, target, persistent) = (self.fenced, self.target, self.persistent);
        self.all(Stage::Settle, |p| RestoreAction::Settle {
            node: p.to_string(),
            target,
            fenced,
            persistent,
            files: files.clone(),
        });
    }

    /// Node `node` settled its copies.
    pub fn handle_settled(&mut self, node: &str) -> Result<(), RestoreError> {
        if !self.answered(node, Stage::Settle)? {
            return Ok(());
        }
        if self.target > 0 && !self.lost.is_empty() {
            let (target, lost) = (self.target, self.lost.clone());
            self.all(Stage::Recreate, |p| RestoreAction::Recreate {
                node: p.to_string(),
                target,
                lost: lost.clone(),
            });
        } else {
            self.drop_pages();
        }
        Ok(())
    }

    /// Node `node` sent the copies the lost nodes held.
    pub fn handle_recreated(&mut self, node: &str) -> Result<(), RestoreError> {
        if !self.answered(node, Stage::Recreate)? {
            return Ok(());
        }
        self.stage = Stage::Adopt;
        let target = self.target;
        for l in &self.lost {
            if let Some(p) = self.nodes.get(l) {
                self.waiting.insert(p.clone());
                self.actions.push_back(RestoreAction::Adopt {
                    node: p.clone(),
                    target,
                });
            }
        }
        if self.waiting.is_empty() {
            self.drop_pages();
        }
        Ok(())
    }

    /// Lost node `node` adopted the target.
    pub fn handle_adopted(&mut self, node: &str) -> Result<(), RestoreError> {
        if self.answered(node, Stage::Adopt)? {
            self.drop_pages();
        }
        Ok(())
    }

    fn drop_pages(&mut self) {
        self.serve = self.files.iter().copied().collect();
        let files = self.files.clone();
        self.all(Stage::Drop, |p| RestoreAction::Drop {
            node: p.to_string(),
            files: files.clone(),
        });
    }

    /// Node `node` dropped the job's pages; `volatile`: the volatile segments it held.
    pub fn handle_dropped(&mut self, node: &str, volatile: &[FileId]) -> Result<(), RestoreError> {
        if !self.answered(node, Stage::Drop)? {
            self.serve.extend(volatile.iter().copied());
            return Ok(());
        }
        self.serve.extend(volatile.iter().copied());
        let files: Vec<FileId> = self.serve.iter().copied().collect();
        self.all(Stage::Serve, |p| RestoreAction::Serve {
            node: p.to_string(),
            files: files.clone(),
        });
        Ok(())
    }

    /// Node `node` serves the job's files again.
    pub fn handle_served(&mut self, node: &str) -> Result<(), RestoreError> {
        if !self.answered(node, Stage::Serve)? {
            return Ok(());
        }
        if self.prefetch {
            self.stage = Stage::Prefetch;
            self.actions.push_back(RestoreAction::Prefetch {
                nodes: self.nodes.values().cloned().collect(),
            });
        } else {
            self.finish();
        }
        Ok(())
    }

    /// The prefetch is over (a node that failed it only lost its prefetch).
    pub fn handle_prefetched(&mut self) -> Result<(), RestoreError> {
        if self.stage != Stage::Prefetch {
            return Err(self.unexpected("the nodes", "prefetch"));
        }
        self.finish();
        Ok(())
    }

    fn finish(&mut self) {
        self.stage = Stage::Done;
        let epoch = self.target.max(self.persistent);
        let newest = self.states.values().map(|s| s.committed).max().unwrap_or(0);
        let given_up = if self.target == 0 && newest > self.persistent {
            newest
        } else {
            0
        };
        self.actions.push_back(RestoreAction::Done {
            epoch,
            memory: self.target,
            persistent: self.persistent,
            lost: self.lost.clone(),
            given_up,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes() -> Vec<(u32, String)> {
        (0..3).map(|l| (l, format!("n{l}"))).collect()
    }

    fn drain(r: &mut Restore) -> Vec<RestoreAction> {
        std::iter::from_fn(|| r.poll_action()).collect()
    }

    fn state(committed: u64, pre: Option<u64>, seen: u64) -> NodeState {
        NodeState {
            committed,
            pre,
            seen,
            files: vec![FileId(7)],
        }
    }

    fn answer_states(r: &mut Restore, s: [NodeState; 3]) {
        for (l, st) in s.into_iter().enumerate() {
            r.handle_state(l as u32, &format!("n{l}"), st).unwrap();
        }
    }

    #[test]
    fn a_node_that_lost_its_copies_gets_them_back_before_the_pages_are_dropped() {
        let mut r = Restore::new("j", &nodes(), &[FileId(7), FileId(9)], false);
        assert_eq!(drain(&mut r).len(), 3);
        answer_states(&mut r, [state(4, None, 5), state(4, None, 4), state(0, None, 0)]);
        assert_eq!(drain(&mut r), vec![RestoreAction::Fence { seen: 5 }]);
        r.handle_fenced(2, 5).unwrap();
        assert_eq!(drain(&mut r).len(), 3);
        answer_states(&mut r, [state(4, None, 5), state(4, None, 4), state(0, None, 0)]);
        let a = drain(&mut r);
        assert!(
            matches!(&a[0], RestoreAction::Settle { target: 4, fenced: 5, files, .. } if files == &vec![FileId(7)])
        );
        for l in 0..3 {
            // Not yet: the settle is not over.
            assert!(r.handle_recreated(&format!("n{l}")).is_err());
            r.handle_settled(&format!("n{l}")).unwrap();
        }
        let a = drain(&mut r);
        assert!(matches!(&a[..], [RestoreAction::Recreate { target: 4, lost, .. }, ..] if lost == &vec![2]));
        for l in 0..3 {
            r.handle_recreated(&format!("n{l}")).unwrap();
        }
        // Only the lost node adopts, once every holder sent.
        assert_eq!(
            drain(&mut r),
            vec![RestoreAction::Adopt {
                node: "n2".into(),
                target: 4
            }]
        );
        assert!(r.handle_adopted("n1").is_err());
        r.handle_adopted("n2").unwrap();
        assert_eq!(drain(&mut r).len(), 3);
        r.handle_dropped("n0", &[FileId(11)]).unwrap();
        r.handle_dropped("n1", &[]).unwrap();
        // One answer per node per step.
        assert!(r.handle_dropped("n1", &[]).is_err());
        r.handle_dropped("n2", &[FileId(12)]).unwrap();
        let a = drain(&mut r);
        assert!(
            matches!(&a[0], RestoreAction::Serve { files, .. } if files == &vec![FileId(7), FileId(9), FileId(11), FileId(12)])
        );
        for l in 0..3 {
            r.handle_served(&format!("n{l}")).unwrap();
        }
        assert_eq!(
            drain(&mut r),
            vec![RestoreAction::Done {
                epoch: 4,
                memory: 4,
                persistent: 2,
                lost: vec![2],
                given_up: 0,
            }]
        );
        assert!(r.is_done());
    }

    #[test]
    fn two_neighbours_that_lost_their_copies_give_the_memory_checkpoint_up() {
        let mut r = Restore::new("j", &nodes(), &[], false);
        drain(&mut r);
        let s = || [state(5, None, 5), state(0, None, 0), state(0, None, 0)];
        answer_states(&mut r, s());
        drain(&mut r);
        r.handle_fenced(2, 5).unwrap();
        drain(&mut r);
        answer_states(&mut r, s());
        assert!(matches!(drain(&mut r)[0], RestoreAction::Settle { target: 0, .. }));
        for l in 0..3 {
            r.handle_settled(&format!("n{l}")).unwrap();
        }
        // Nothing to re-create: straight to the drop.
        assert!(matches!(drain(&mut r)[0], RestoreAction::Drop { .. }));
        for l in 0..3 {
            r.handle_dropped(&format!("n{l}"), &[]).unwrap();
        }
        drain(&mut r);
        for l in 0..3 {
            r.handle_served(&format!("n{l}")).unwrap();
        }
        assert!(matches!(
            drain(&mut r)[..],
            [RestoreAction::Done {
                epoch: 2,
                memory: 0,
                given_up: 5,
                ..
            }]
        ));
    }

    #[test]
    fn without_a_newer_memory_checkpoint_the_persistent_one_is_restored_and_nothing_recreated() {
        let mut r = Restore::new("j", &nodes(), &[], true);
        drain(&mut r);
        answer_states(&mut r, [state(3, None, 3), state(0, None, 3), state(3, None, 3)]);
        drain(&mut r);
        // A stranger's state is refused.
        assert!(r.handle_state(1, "n9", state(0, None, 0)).is_err());
        r.handle_fenced(6, 6).unwrap();
        drain(&mut r);
        answer_states(&mut r, [state(3, None, 3), state(0, None, 3), state(3, None, 3)]);
        assert!(matches!(drain(&mut r)[0], RestoreAction::Settle { target: 0, .. }));
        for l in 0..3 {
            r.handle_settled(&format!("n{l}")).unwrap();
        }
        assert!(matches!(drain(&mut r)[0], RestoreAction::Drop { .. }));
        for l in 0..3 {
            r.handle_dropped(&format!("n{l}"), &[]).unwrap();
        }
        drain(&mut r);
        for l in 0..3 {
            r.handle_served(&format!("n{l}")).unwrap();
        }
        assert!(matches!(drain(&mut r)[..], [RestoreAction::Prefetch { .. }]));
        r.handle_prefetched().unwrap();
        assert!(matches!(
            drain(&mut r)[..],
            [RestoreAction::Done {
                epoch: 6,
                memory: 0,
                given_up: 0,
                ..
            }]
        ));
    }
}
