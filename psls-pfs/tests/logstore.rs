//! The metadata log on its real store: three voters, each a `psls_cluster::log::Log` over
//! `MetaState` with a `LogStore` on a fault disk (writes not synced are lost in a power cut, torn
//! by sector), metadata operations of every kind, and power cuts of any voter at any point.
//!
//! Checked: after every restart, the voter's per-key tables equal the log applied from the start
//! up to its applied index; no two voters apply different entries at an index; every operation
//! answered `Ok` is applied on every voter at the end; the store on disk stays bounded while
//! the log is compacted. And a store written by the code before the log converts, keeping its
//! namespace and dropping an operation its vote accepted but never saw committed.

use psls_cluster::log::{Action, Durable, Limits, Log, SubmitError, Wire};
use psls_pfs::file::FileMeta;
use psls_pfs::jobs::FileRuns;
use psls_pfs::logstore::LogStore;
use psls_pfs::meta::{MetaOp, MetaState};
use psls_pfs::FaultDisk;
use psls_svm::FileId;
use raft::eraftpb::Entry;
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;

const VOTERS: u32 = 3;

struct Voter {
    dir: PathBuf,
    disk: FaultDisk,
    store: LogStore,
    log: Log<MetaState, u64>,
    /// Entries as written (index → entry), to learn what was applied.
    mirror: BTreeMap<u64, Entry>,
    applied: u64,
}

fn limits() -> Limits {
    Limits {
        election_ticks: 10,
        heartbeat_ticks: 2,
        max_pending: 256,
        max_reads: 64,
        max_msg_bytes: 64 << 10,
        max_inflight: 16,
        compact_after: 40,
        keep_behind: 10,
        read_retry_ticks: 10,
        follow_wait_ticks: 20,
        follow_fanout: 2,
    }
}

type Opened = (
    FaultDisk,
    LogStore,
    Log<MetaState, u64>,
    MetaState,
    BTreeMap<u64, Entry>,
);

fn open(dir: &PathBuf, v: u32, seed: u64) -> Opened {
    let disk = FaultDisk::new(dir).expect("fault disk");
    let (store, opened) = LogStore::open(&disk, false).expect("opens");
    let state = opened.durable.state.clone();
    let mirror = opened.durable.entries.iter().map(|e| (e.index, e.clone())).collect();
    let log = Log::new(v, VOTERS, limits(), opened.durable, seed).expect("log starts");
    (disk, store, log, state, mirror)
}

struct Cluster {
    voters: Vec<Voter>,
    net: VecDeque<(u32, u32, Wire)>,
    record: BTreeMap<u64, Option<MetaOp>>,
    /// The state after each index of `record` (index 0: empty).
    states: Vec<MetaState>,
    acked: BTreeMap<u64, MetaOp>,
    pending: BTreeMap<u64, MetaOp>,
    next_token: u64,
    seed: u64,
    rng: psls_svm::rng::SplitMix64,
    _tmp: tempfile::TempDir,
    max_bytes: u64,
}

impl Cluster {
    fn new(seed: u64) -> Cluster {
        Cluster::prepared(seed, |_, _| {})
    }

    /// A cluster whose voters' folders `prep` fills first.
    fn prepared(seed: u64, prep: impl Fn(&std::path::Path, u32)) -> Cluster {
        let tmp = tempfile::tempdir().expect("tmp");
        let voters = (0..VOTERS)
            .map(|v| {
                let dir = tmp.path().join(format!("n{v}"));
                std::fs::create_dir_all(&dir).expect("dir");
                prep(&dir, v);
                let (disk, store, log, _, _) = open(&dir, v, seed * 10 + v as u64);
                Voter {
                    dir,
                    disk,
                    store,
                    log,
                    mirror: BTreeMap::new(),
                    applied: 0,
                }
            })
            .collect();
        Cluster {
            voters,
            net: VecDeque::new(),
            record: BTreeMap::new(),
            states: vec![MetaState::default()],
            acked: BTreeMap::new(),
            pending: BTreeMap::new(),
            next_token: 1,
            seed,
            rng: psls_svm::rng::SplitMix64::new(seed),
            _tmp: tmp,
            max_bytes: 0,
        }
    }

    fn drain(&mut self, v: u32) {
        // Answers are checked once every action is carried out: a voter answers for entries a
        // quorum committed before it wrote them itself.
        let mut answered = Vec::new();
        while let Some(a) = self.voters[v as usize].log.poll_action() {
            match a {
                Action::Persist(p) => {
                    let n = &mut self.voters[v as usize];
                    n.store.persist(&p).expect("persists");
                    self.max_bytes = self.max_bytes.max(n.store.bytes_on_disk());
                    if p.snapshot.is_some() {
                        n.mirror.clear();
                    }
                    if let Some(first) = p.entries.first() {
                        n.mirror.split_off(&first.index);
                        for e in &p.entries {
                            n.mirror.insert(e.index, e.clone());
                        }
                    }
                    let from = n.applied;
                    n.applied = p.applied.0;
                    let learnt: Vec<Entry> = if p.applied.0 > from {
                        n.mirror.range(from + 1..=p.applied.0).map(|(_, e)| e.clone()).collect()
                    } else {
                        Vec::new()
                    };
                    for e in learnt {
                        self.learn(v, &e);
                    }
                    if let Some((i, _)) = p.compact_to {
                        let n = &mut self.voters[v as usize];
                        n.mirror = n.mirror.split_off(&(i + 1));
                    }
                }
                Action::Send { to, msg } => {
                    if psls_cluster::log::is_snapshot(&msg) {
                        self.voters[v as usize].log.handle_snapshot_sent(to);
                    }
                    self.net.push_back((v, to, msg));
                }
                Action::Done { token, result } => {
                    let op = self.pending.remove(&token).expect("answered once");
                    answered.push((op, result));
                }
                Action::Read { .. } => {}
                Action::Halt { reason } => panic!("seed {}: voter {v} halted: {reason}", self.seed),
            }
        }
        // Applied in memory; the changes may not be written yet.
        let n = &self.voters[v as usize];
        let learnt: Vec<Entry> = if n.log.applied() > n.applied {
            n.mirror
                .range(n.applied + 1..=n.log.applied())
                .map(|(_, e)| e.clone())
                .collect()
        } else {
            Vec::new()
        };
        for e in learnt {
            self.learn(v, &e);
        }
        for (op, result) in answered {
            match result {
                Ok(i) => {
                    assert_eq!(
                        self.record.get(&i),
                        Some(&Some(op.clone())),
                        "seed {}: acked op at {i}",
                        self.seed
                    );
                    self.acked.insert(i, op);
                }
                Err(SubmitError::Halted) => panic!("seed {}: halted", self.seed),
                Err(_) => {}
            }
        }
    }

    fn learn(&mut self, v: u32, e: &Entry) {
        let op = (!e.data.is_empty()).then(|| psls_cluster::log::decode_op::<MetaOp>(&e.data).expect("decodes"));
        match self.record.get(&e.index) {
            Some(x) => assert_eq!(
                x, &op,
                "seed {}: voter {v} applied another entry at {}",
                self.seed, e.index
            ),
            None => {
                assert_eq!(
                    e.index as usize,
                    self.states.len(),
                    "seed {}: gap at {}",
                    self.seed,
                    e.index
                );
                let mut next = self.states.last().expect("states").clone();
                match &op {
                    Some(op) => {
                        let _ = next.apply_at(e.index, op);
                    }
                    None => next.skip_to(e.index),
                }
                let _ = next.take_changes();
                self.states.push(next);
                self.record.insert(e.index, op);
            }
        }
    }

    fn leader(&self) -> Option<u32> {
        (0..VOTERS).find(|v| self.voters[*v as usize].log.is_leader())
    }

    fn tick(&mut self) {
        for v in 0..VOTERS {
            self.voters[v as usize].log.handle_tick();
            self.drain(v);
        }
        while let Some((from, to, msg)) = self.net.pop_front() {
            self.voters[to as usize].log.handle_message(from, msg);
            self.drain(to);
        }
    }

    fn submit(&mut self, op: MetaOp) {
        let Some(l) = self.leader() else { return };
        let token = self.next_token;
        self.next_token += 1;
        self.pending.insert(token, op.clone());
        self.voters[l as usize].log.submit(token, &op);
        self.drain(l);
    }

    /// A power cut of voter `v`: unsynced writes torn or lost; it restarts from its disk.
    fn power_cut(&mut self, v: u32) {
        let cut_seed = self.rng.next_u64();
        let n = &mut self.voters[v as usize];
        n.disk.power_cut(cut_seed);
        let (disk, store, log, state, mirror) = open(&n.dir, v, cut_seed);
        // Every entry is written with an fsync (and compactions rewrite the log synced): the
        // log after the cut is the log before it.
        assert_eq!(
            mirror.keys().collect::<Vec<_>>(),
            n.mirror.keys().collect::<Vec<_>>(),
            "seed {}: voter {v}'s log after a power cut",
            self.seed
        );
        assert!(
            mirror.iter().all(|(i, e)| n.mirror.get(i) == Some(e)),
            "seed {}: voter {v}'s entries after a power cut",
            self.seed
        );
        // Its per-key tables are the log applied from the start up to its applied index.
        let want = &self.states[state.seq as usize];
        assert_eq!(&state, want, "seed {}: voter {v}'s tables after a power cut", self.seed);
        n.disk = disk;
        n.store = store;
        n.log = log;
        n.applied = state.seq;
        n.mirror = mirror;
        // Its unanswered submissions die with it; messages to it are lost.
        self.net.retain(|(_, to, _)| *to != v);
    }
}

fn meta(name: &str, id: u64) -> FileMeta {
    FileMeta::zeroed(FileId(id), name.into(), 64 * 4096, 0, 0, 0o644, 0)
}

/// A random operation on a small namespace (so many are refused, some are not).
fn random_op(rng: &mut psls_svm::rng::SplitMix64, c: &Cluster) -> MetaOp {
    let st = c.states.last().expect("states");
    let k = rng.below(8);
    let name = format!("f{k}");
    let job = format!("j{}", rng.below(2));
    match rng.below(11) {
        9 => {
            // Job control: a start, a restart or an end of a job's run record.
            let run = |attempt| psls_pfs::runs::RunRecord {
                attempt,
                placement: vec![0],
                nodes: [(0, ("n0".to_string(), 1))].into(),
                ..Default::default()
            };
            match (st.runs.get(&job).map(|r| r.attempt), rng.below(2)) {
                (None, _) => MetaOp::JobStart {
                    run: Box::new(run(st.ended.get(&job).map_or(0, |(_, e)| e.attempt + 1))),
                    job,
                    spec: Box::default(),
                    options: Box::default(),
                },
                (Some(a), 0) => MetaOp::JobRestart {
                    job,
                    attempt: a,
                    run: Box::new(run(a + 1)),
                },
                (Some(a), _) => MetaOp::JobEnd {
                    job,
                    end: psls_pfs::runs::JobEnd {
                        how: psls_pfs::runs::EndHow::Finished,
                        code: 0,
                        message: "done".into(),
                        attempt: a,
                        at_unix_ms: 1,
                    },
                },
            }
        }
        0 | 1 => MetaOp::CommitFile {
            meta: meta(&name, 100 + rng.below(1000)),
            replaces: st.files.get(&name).map(|f| f.id),
            placed_at: None,
        },
        2 => MetaOp::RemoveFile {
            name: name.clone(),
            id: st.files.get(&name).map_or(FileId(1), |f| f.id),
        },
        3 => MetaOp::ClaimWriter {
            file: st.files.get(&name).map_or(FileId(1), |f| f.id),
            job,
        },
        4 => MetaOp::ReleaseWriter {
            file: st.files.get(&name).map_or(FileId(1), |f| f.id),
            job,
        },
        5 => MetaOp::BeginCheckpoint {
            epoch: st.jobs.get(&job).map_or(0, |r| r.started.max(r.epoch).max(r.fenced)) + 1,
            job,
        },
        6 => {
            let r = st.jobs.get(&job).cloned().unwrap_or_default();
            let files = st
                .files_written_by(&job)
                .map(|f| FileRuns {
                    file: f.id,
                    runs: (0..1 + rng.below(3))
                        .map(|_| {
                            let a = rng.below(60);
                            (a, a + 1 + rng.below(4))
                        })
                        .collect(),
                })
                .collect();
            MetaOp::Checkpoint {
                job,
                epoch: r.started,
                gen: r.started_gen,
                placed_at: st.map_version,
                files,
                at_unix_ms: 1,
                bytes: 4096,
            }
        }
        7 => MetaOp::EndJob { job },
        _ => MetaOp::DeclareDown {
            physical: format!("n{}", rng.below(3)),
            incarnation: 1 + rng.below(5),
        },
    }
}

#[test]
fn the_store_keeps_every_acknowledged_operation_across_power_cuts() {
    let seeds = std::env::var("PSLS_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8u64);
    for seed in 0..seeds {
        let mut c = Cluster::new(seed);
        let mut rng = psls_svm::rng::SplitMix64::new(seed ^ 0xabc);
        let mut cuts = 0;
        for step in 0..600 {
            c.tick();
            if c.states.last().is_some_and(|s| s.logical.is_empty()) {
                c.submit(MetaOp::InitMap {
                    logical: (0..3).map(|i| (i, format!("n{i}"))).collect(),
                });
            }
            for _ in 0..rng.below(4) {
                let op = random_op(&mut rng, &c);
                c.submit(op);
            }
            if step % 37 == 36 {
                let v = rng.below(VOTERS as u64) as u32;
                c.power_cut(v);
                cuts += 1;
            }
        }
        // Settle: everyone applies everything.
        for _ in 0..200 {
            c.tick();
        }
        let top = c.states.len() as u64 - 1;
        for v in 0..VOTERS {
            let st = c.voters[v as usize].log.state();
            assert_eq!(st.seq, top, "seed {seed}: voter {v} did not catch up");
            assert_eq!(st, &c.states[top as usize], "seed {seed}: voter {v}'s state");
        }
        for (i, op) in &c.acked {
            assert_eq!(c.record.get(i), Some(&Some(op.clone())), "seed {seed}: acked op lost");
        }
        assert!(
            c.acked.len() > 100 && cuts > 10,
            "seed {seed}: {} acked, {cuts} cuts",
            c.acked.len()
        );
        // Compaction bounds the store: the log holds at most 50 entries of a few hundred bytes.
        assert!(
            c.max_bytes < 4 << 20,
            "seed {seed}: the store grew to {} bytes",
            c.max_bytes
        );
    }
}

#[test]
fn a_store_of_the_format_before_the_log_converts() {
    let tmp = tempfile::tempdir().expect("tmp");
    let disk = psls_pfs::FileDisk::new(tmp.path()).expect("disk");
    let committed = {
        let mut old = psls_pfs::meta::MetaStore::open(&disk).expect("old store");
        old.apply(&MetaOp::InitMap {
            logical: (0..3).map(|i| (i, format!("n{i}"))).collect(),
        })
        .expect("applies");
        for i in 0..5 {
            old.apply(&MetaOp::CommitFile {
                meta: meta(&format!("f{i}"), 10 + i),
                replaces: None,
                placed_at: None,
            })
            .expect("applies");
        }
        // A vote holding an operation accepted for the next slot, never seen committed.
        let dangling = MetaOp::CommitFile {
            meta: meta("dangling", 99),
            replaces: None,
            placed_at: None,
        };
        old.persist_vote(
            psls_cluster::meta::Epoch { n: 7, by: 1 },
            Some(psls_cluster::meta::Accepted {
                epoch: psls_cluster::meta::Epoch { n: 7, by: 1 },
                seq: 7,
                op: dangling,
            }),
        )
        .expect("vote");
        old.state().clone()
    };
    assert_eq!(committed.seq, 6);
    let (store, opened) = LogStore::open(&disk, false).expect("converts");
    assert_eq!(opened.legacy, Some(6));
    assert!(!opened.created);
    assert_eq!(opened.durable.state, committed, "the namespace is kept");
    assert!(!opened.durable.state.files.contains_key("dangling"));
    assert_eq!(opened.durable.compacted, (6, 1));
    assert_eq!(
        (opened.durable.hard_state.term, opened.durable.hard_state.commit),
        (1, 6)
    );
    drop(store);
    // Opened again: the converted store, not converted twice.
    let (_, again) = LogStore::open(&disk, false).expect("reopens");
    assert_eq!(again.durable.state, committed);
    assert_eq!(again.legacy, Some(6));
    // A voter starts from it.
    let log: Log<MetaState, u64> = Log::new(0, 3, limits(), again.durable, 1).expect("starts");
    assert_eq!(log.applied(), 6);
    let fresh: Durable<MetaState> = Durable::fresh(false);
    assert_eq!(fresh.state.seq, 0);
}

/// Voters converted from stores before the log at different sequence numbers: the one that
/// held a state no majority had (an operation committed on it alone, never acknowledged) drops
/// it when a leader with the majority's state appends, and catches up from that leader.
#[test]
fn a_converted_voter_ahead_of_the_leader_drops_its_state_and_catches_up() {
    let mut c = Cluster::prepared(5, |dir, v| {
        let disk = psls_pfs::FileDisk::new(dir).expect("disk");
        let mut old = psls_pfs::meta::MetaStore::open(&disk).expect("old store");
        for i in 0..6 {
            old.apply(&MetaOp::CommitFile {
                meta: meta(&format!("f{i}"), 10 + i),
                replaces: None,
                placed_at: None,
            })
            .expect("applies");
        }
        if v == 2 {
            old.apply(&MetaOp::CommitFile {
                meta: meta("extra", 99),
                replaces: None,
                placed_at: None,
            })
            .expect("applies");
        }
    });
    assert_eq!(c.voters[2].log.legacy(), Some(7));
    assert_eq!(c.voters[0].log.legacy(), Some(6));
    // The reference log starts from the majority's converted state.
    let base = c.voters[0].log.state().clone();
    c.states = (0..=6).map(|_| base.clone()).collect();
    for i in 1..=6 {
        c.record.insert(i, None);
    }
    // Voter 2 does not campaign: voter 0 (the majority's state) leads.
    c.voters[2].log.set_eligible(false);
    for _ in 0..300 {
        c.tick();
        if c.leader() == Some(0) && c.voters[2].log.legacy().is_none() {
            break;
        }
    }
    assert_eq!(c.leader(), Some(0));
    c.submit(MetaOp::CommitFile {
        meta: meta("after", 50),
        replaces: None,
        placed_at: None,
    });
    for _ in 0..100 {
        c.tick();
    }
    let want = c.voters[0].log.state().clone();
    assert!(want.files.contains_key("after") && !want.files.contains_key("extra"));
    for v in 0..VOTERS {
        assert_eq!(c.voters[v as usize].log.state(), &want, "voter {v}");
        assert_eq!(c.voters[v as usize].log.legacy(), None, "voter {v}");
    }
    // What voter 2 has on disk is the leader's lineage too (its tables were checked against the
    // log by the power cut); it applies the rest again.
    c.power_cut(2);
    assert!(!c.voters[2].log.state().files.contains_key("extra"));
    for _ in 0..50 {
        c.tick();
    }
    assert_eq!(c.voters[2].log.state(), &want);
}

/// A store of format 6 (each file's whole generation map in one row of `file_gens`, the log in
/// table `log`) converts: each map becomes a base row, the log moves to its file, and the
/// namespace and the log are the same. Format 6 is written here by hand from a store of the
/// current format, table by table.
#[test]
fn a_store_of_format_6_converts() {
    use psls_pfs::gens::PageGens;
    use redb::{ReadableDatabase, ReadableTable, TableDefinition};
    let tmp = tempfile::tempdir().expect("tmp");
    let disk = psls_pfs::FileDisk::new(tmp.path()).expect("disk");
    let (mut store, opened) = LogStore::open(&disk, false).expect("opens");
    let mut log: Log<MetaState, u64> = Log::new(0, 1, limits(), opened.durable, 1).expect("starts");
    let mut drain = |log: &mut Log<MetaState, u64>| {
        while let Some(a) = log.poll_action() {
            if let Action::Persist(p) = a {
                store.persist(&p).expect("persists");
            }
        }
    };
    for _ in 0..40 {
        log.handle_tick();
        drain(&mut log);
    }
    assert!(log.is_leader());
    let mut ops = vec![MetaOp::InitMap {
        logical: (0..1).map(|i| (i, format!("n{i}"))).collect(),
    }];
    for i in 0..3 {
        ops.push(MetaOp::CommitFile {
            meta: meta(&format!("f{i}"), 10 + i),
            replaces: None,
            placed_at: None,
        });
        ops.push(MetaOp::ClaimWriter {
            file: FileId(10 + i),
            job: "j".into(),
        });
    }
    for (t, op) in ops.iter().enumerate() {
        log.submit(t as u64, op);
    }
    drain(&mut log);
    for epoch in 1..=6u64 {
        log.submit(100 + epoch, &MetaOp::BeginCheckpoint { job: "j".into(), epoch });
        drain(&mut log);
        let r = log.state().jobs["j"].clone();
        let files = (0..3)
            .map(|i| FileRuns {
                file: FileId(10 + i),
                runs: vec![(epoch * 3 + i, epoch * 3 + i + 2), (40 + epoch, 41 + epoch)],
            })
            .collect();
        log.submit(
            200 + epoch,
            &MetaOp::Checkpoint {
                job: "j".into(),
                epoch,
                gen: r.started_gen,
                placed_at: log.state().map_version,
                files,
                at_unix_ms: 1,
                bytes: 1,
            },
        );
        drain(&mut log);
    }
    // The applied changes are written lazily: a tick writes them.
    log.handle_tick();
    drain(&mut log);
    let want = log.state().clone();
    assert!(want.files["f1"].written.runs() > 6, "{:?}", want.files["f1"].written);
    drop(log);
    drop(store);

    const MISC: TableDefinition<&str, &[u8]> = TableDefinition::new("misc");
    const ROWS: TableDefinition<(u64, u64), &[u8]> = TableDefinition::new("gen_rows");
    const GENS_6: TableDefinition<u64, &[u8]> = TableDefinition::new("file_gens");
    const LOG_6: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
    // The log as format 6 kept it: a table, with the hard state and the compaction in `misc`.
    let (_, wal) = psls_pfs::wal::Wal::open(&disk).expect("log file");
    let wal = wal.expect("a log file");
    assert!(!wal.entries.is_empty());
    for name in ["meta.wal.0", "meta.wal.1"] {
        psls_pfs::Disk::remove(&disk, name).expect("remove");
    }
    let le = |xs: &[u64]| -> Vec<u8> { xs.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let db = redb::Database::open(tmp.path().join("meta.redb")).expect("redb");
    let mut maps: BTreeMap<u64, PageGens> = BTreeMap::new();
    {
        let tx = db.begin_read().expect("read");
        let rows = tx.open_table(ROWS).expect("rows");
        let mut deltas = 0;
        for kv in rows.iter().expect("iter") {
            let (k, v) = kv.expect("row");
            let (id, index) = k.value();
            if index == 0 {
                maps.insert(id, postcard::from_bytes(v.value()).expect("base"));
            } else {
                let d: psls_pfs::meta::GenDelta = postcard::from_bytes(v.value()).expect("delta");
                let m = maps.entry(id).or_default();
                for (s, e) in d.runs {
                    m.set(s, e, d.gen);
                }
                deltas += 1;
            }
        }
        assert!(deltas > 0, "the store kept delta rows");
    }
    let tx = db.begin_write().expect("write");
    {
        let mut old = tx.open_table(GENS_6).expect("file_gens");
        for (id, m) in &maps {
            old.insert(*id, postcard::to_stdvec(m).expect("encodes").as_slice())
                .expect("insert");
        }
        drop(old);
        tx.delete_table(ROWS).expect("delete");
        let mut log = tx.open_table(LOG_6).expect("log");
        for e in &wal.entries {
            log.insert(e.index, psls_pfs::logstore::encode_entry(e).as_slice())
                .expect("entry");
        }
        drop(log);
        let mut m = tx.open_table(MISC).expect("misc");
        m.insert("format", 6u16.to_le_bytes().as_slice()).expect("format");
        let hs = &wal.hard_state;
        m.insert("hard_state", le(&[hs.term, hs.vote, hs.commit]).as_slice())
            .expect("hard state");
        m.insert("compacted", le(&[wal.compacted.0, wal.compacted.1]).as_slice())
            .expect("compacted");
    }
    tx.commit().expect("commit");
    drop(db);

    let (_, opened) = LogStore::open(&disk, false).expect("converts");
    assert_eq!(opened.durable.state, want, "the namespace is kept");
    assert_eq!(opened.durable.entries, wal.entries, "the log is kept");
    assert_eq!(opened.durable.hard_state, wal.hard_state);
    assert_eq!(opened.durable.state.files["f1"].written, want.files["f1"].written);
    let (_, again) = LogStore::open(&disk, false).expect("reopens");
    assert_eq!(again.durable.state, want);
}

/// A snapshot's write cut at every point (the disk halts after n mutations, then a power cut):
/// the store always opens; its state is the old one or the snapshot's; once the new term was
/// written it is never lost; its log is contiguous from its compaction point and reaches its
/// state.
#[test]
fn a_snapshot_cut_at_any_point_leaves_a_store_that_opens() {
    use psls_cluster::log::Persist;
    use raft::eraftpb::HardState;
    for n in 0..40i64 {
        let tmp = tempfile::tempdir().expect("tmp");
        let disk = FaultDisk::new(tmp.path()).expect("disk");
        let (mut store, opened) = LogStore::open(&disk, false).expect("opens");
        let mut log: Log<MetaState, u64> = Log::new(0, 1, limits(), opened.durable, 1).expect("starts");
        let drain = |log: &mut Log<MetaState, u64>, store: &mut LogStore| {
            while let Some(a) = log.poll_action() {
                if let Action::Persist(p) = a {
                    store.persist(&p).expect("persists");
                }
            }
        };
        for _ in 0..40 {
            log.handle_tick();
            drain(&mut log, &mut store);
        }
        assert!(log.is_leader());
        log.submit(
            0,
            &MetaOp::InitMap {
                logical: (0..1).map(|i| (i, format!("n{i}"))).collect(),
            },
        );
        for i in 0..6 {
            log.submit(
                1 + i,
                &MetaOp::CommitFile {
                    meta: meta(&format!("f{i}"), 10 + i),
                    replaces: None,
                    placed_at: None,
                },
            );
        }
        drain(&mut log, &mut store);
        log.handle_tick();
        drain(&mut log, &mut store);
        let old = log.state().clone();
        let old_term = log.term();
        // A leader's snapshot, further on: 3 more files, at index old + 10, a newer term.
        let mut snap = old.clone();
        let mut at = snap.seq;
        for i in 0..3 {
            at += 1;
            snap.apply_at(
                at,
                &MetaOp::CommitFile {
                    meta: meta(&format!("s{i}"), 50 + i),
                    replaces: None,
                    placed_at: None,
                },
            )
            .expect("applies");
        }
        for _ in 0..7 {
            at += 1;
            snap.skip_to(at);
        }
        let _ = snap.take_changes();
        let new_term = old_term + 3;
        let hs = HardState {
            term: new_term,
            vote: 2,
            commit: at,
            ..Default::default()
        };
        let p = Persist::<MetaState> {
            sync: true,
            hard_state: hs,
            entries: Vec::new(),
            snapshot: Some((at, new_term)),
            compact_to: None,
            applied: (at, new_term),
            changes: snap.all_changes(),
            amnesiac: false,
            legacy: None,
            conf: None,
        };
        drop(log);
        disk.halt_after(n);
        let finished = store.persist(&p).is_ok();
        disk.power_cut(n as u64 + 1);
        drop(store);
        let disk = FaultDisk::new(tmp.path()).expect("disk");
        let (_, got) = LogStore::open(&disk, false).unwrap_or_else(|e| panic!("cut after {n}: does not open: {e}"));
        let term = got.durable.hard_state.term;
        // The log restarts from this (the machine checks contiguity and reach) and applies
        // what was committed.
        let mut log = Log::<MetaState, u64>::new(0, 1, limits(), got.durable, 1)
            .unwrap_or_else(|e| panic!("cut after {n}: the log does not start: {e}"));
        // Alone, it leads again and commits every entry its log file kept (all were synced).
        for _ in 0..40 {
            log.handle_tick();
            while log.poll_action().is_some() {}
        }
        assert!(log.is_leader(), "cut after {n}: leads again");
        let files = &log.state().files;
        assert!(
            *files == old.files || *files == snap.files,
            "cut after {n}: the namespace is neither the old one nor the snapshot's"
        );
        if finished {
            assert_eq!(*files, snap.files, "cut after {n}: the finished snapshot is kept");
        }
        if *files == snap.files {
            assert!(term >= new_term, "cut after {n}: the snapshot's term went back");
        }
        assert!(term >= old_term, "cut after {n}: term {term} went back");
        if finished {
            break;
        }
    }
}

/// A voter's catching-up flag cleared by a write that needs no sync (a tick's write of the
/// tables) survives a power cut right after it: otherwise every voter of a cluster that lost
/// power together comes back amnesiac, none will vote, and no leader is ever elected.
#[test]
fn a_cleared_catching_up_flag_survives_a_power_cut() {
    use psls_cluster::log::Persist;
    let tmp = tempfile::tempdir().expect("tmp");
    let disk = FaultDisk::new(tmp.path()).expect("disk");
    let (mut store, opened) = LogStore::open(&disk, true).expect("opens");
    assert!(
        opened.durable.amnesiac,
        "a store created for a node that ran before starts amnesiac"
    );
    let p = Persist::<MetaState> {
        sync: false,
        hard_state: opened.durable.hard_state.clone(),
        entries: Vec::new(),
        snapshot: None,
        compact_to: None,
        applied: (0, 0),
        changes: Default::default(),
        amnesiac: false,
        legacy: None,
        conf: None,
    };
    store.persist(&p).expect("persists");
    disk.power_cut(1);
    drop(store);
    let disk = FaultDisk::new(tmp.path()).expect("disk");
    let (_, got) = LogStore::open(&disk, false).expect("reopens");
    assert!(!got.durable.amnesiac, "the cleared flag was lost in the power cut");
}
