//! A client process for the shared-memory integration tests. Each mode maps a parallel file
//! through the client library and exercises it; exit status 0 means every check passed.
//!
//! Modes (argument 1):
//! - `produce NAME PAGES`: writes a pattern into pages 1.., then sets word 0 to 1 and waits
//!   for the consumer to set it to 2.
//! - `consume NAME PAGES`: waits for word 0 == 1, checks the pattern, sets word 0 to 2.
//! - `fill NAME PAGES SEED`: writes the pattern of SEED into every page and exits.
//! - `check NAME PAGES SEED [ONLY]`: checks every page (or only page ONLY) holds the pattern
//!   of SEED.
//! - `map NAME BYTES CREATE`: only maps (and unmaps); prints the error if the map fails.
//! - `rofollow NAME PAGES SEED1 SEED2`: maps read-only, checks every page holds the pattern
//!   of SEED1, prints `seen SEED1`, then waits until they hold SEED2 (written elsewhere).
//! - `rostore NAME PAGES`: maps read-only and stores to it (must die of SIGSEGV).
//! - `linger NAME PAGES MARKER`: a process that outlives its job, mapping the job's volatile
//!   segment (see the mode's comment).
//! - `litmus TEST ITERATIONS` (as a 4-rank job): the sequential-consistency litmus test TEST
//!   (sb, mp, iriw, lb) with its shared variables on different pages; rank 0 prints
//!   `litmus TEST: N iterations, F forbidden, outcomes {..}`.

use psls_client::Session;
use std::time::{Duration, Instant};

fn pattern(seed: u64, page: usize, word: usize) -> u64 {
    psls_svm::rng::mix64(seed ^ ((page as u64) << 20) ^ word as u64)
}

fn wait_for(words: &[u64], want: u64, what: &str) {
    let t = Instant::now();
    // SAFETY: reads one shared word; volatile so that every poll really reads memory.
    while unsafe { std::ptr::read_volatile(&words[0]) } != want {
        if t.elapsed() > Duration::from_secs(60) {
            eprintln!("timed out waiting for {what}");
            std::process::exit(3);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| {
        args.get(i).cloned().unwrap_or_else(|| {
            eprintln!("usage: svm-probe produce|consume|fill|check NAME PAGES [SEED]");
            std::process::exit(2)
        })
    };
    let (mode, name) = (arg(1), arg(2));
    if mode == "litmus" {
        litmus(&name, arg(3).parse().expect("ITERATIONS"));
        return;
    }
    let pages: usize = arg(3).parse().expect("PAGES");
    let words_per_page = 4096 / 8;
    let s = Session::connect().unwrap_or_else(|e| {
        eprintln!("connect: {e}");
        std::process::exit(1)
    });
    if mode == "linger" {
        // `linger NAME PAGES MARKER` (started by a rank, outliving the job): maps the job's
        // volatile segment NAME, writes page 0, prints `mapped`, waits for file MARKER (the
        // job has ended by then), then reads every page: the daemon must end this process
        // there; if the reads complete it prints `survived` and exits 5.
        let marker = arg(4);
        let mut m = s.create_volatile(&name, (pages * 4096) as u64).unwrap_or_else(|e| {
            eprintln!("create_volatile: {e}");
            std::process::exit(1)
        });
        let w: &mut [u64] = m.as_mut_slice();
        w[0] = 42;
        println!("mapped");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let t = Instant::now();
        while !std::path::Path::new(&marker).exists() {
            if t.elapsed() > Duration::from_secs(60) {
                eprintln!("timed out waiting for {marker}");
                std::process::exit(3);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // SAFETY: plain volatile loads inside the mapping.
        let sum: u64 = (0..pages)
            .map(|p| unsafe { std::ptr::read_volatile(&w[p * words_per_page]) })
            .sum();
        println!("survived with {sum}");
        std::process::exit(5)
    }
    if mode == "vol" {
        // `vol NAME PAGES SEED` (under `psls run`): the job's volatile segment NAME starts at
        // zero on every rank; rank 0 fills it; after a barrier every rank reads the fill.
        let seed: u64 = arg(4).parse().expect("SEED");
        let mut m = s.create_volatile(&name, (pages * 4096) as u64).unwrap_or_else(|e| {
            eprintln!("create_volatile: {e}");
            std::process::exit(1)
        });
        let w: &mut [u64] = m.as_mut_slice();
        if let Some(i) = w.iter().position(|&x| x != 0) {
            eprintln!("word {i} of a new volatile segment is {:#x}, not 0", w[i]);
            std::process::exit(4);
        }
        s.barrier("vol-checked").expect("barrier");
        if s.rank() == 0 {
            for p in 0..pages {
                for k in 0..words_per_page {
                    w[p * words_per_page + k] = pattern(seed, p, k);
                }
            }
        }
        s.barrier("vol-filled").expect("barrier");
        for p in 0..pages {
            for k in 0..words_per_page {
                let got = w[p * words_per_page + k];
                if got != pattern(seed, p, k) {
                    eprintln!("page {p} word {k}: {got:#x}, want {:#x}", pattern(seed, p, k));
                    std::process::exit(4);
                }
            }
        }
        println!("volatile ok");
        std::process::exit(0)
    }
    if mode == "rofollow" || mode == "rostore" {
        let m = s.map_read_only(&name, (pages * 4096) as u64).unwrap_or_else(|e| {
            println!("error: {e}");
            std::process::exit(1)
        });
        let w: &[u64] = m.as_slice();
        if mode == "rostore" {
            // SAFETY: deliberately stores to a read-only mapping: the process must die here.
            unsafe { std::ptr::write_volatile(w.as_ptr() as *mut u64, 1) };
            println!("stored to a read-only mapping");
            std::process::exit(5);
        }
        let (s1, s2): (u64, u64) = (arg(4).parse().expect("SEED1"), arg(5).parse().expect("SEED2"));
        let holds = |seed: u64| {
            (0..pages).all(|p| {
                (0..words_per_page).all(|k| {
                    // SAFETY: a plain load inside the mapping (volatile: others write it).
                    unsafe { std::ptr::read_volatile(&w[p * words_per_page + k]) == pattern(seed, p, k) }
                })
            })
        };
        if !holds(s1) {
            eprintln!("the read-only mapping does not hold the pattern of {s1}");
            std::process::exit(4);
        }
        println!("seen {s1}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let t = Instant::now();
        while !holds(s2) {
            if t.elapsed() > Duration::from_secs(60) {
                eprintln!("timed out waiting for the pattern of {s2}");
                std::process::exit(3);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        m.unmap().expect("unmap");
        println!("seen {s2}");
        std::process::exit(0)
    }
    if mode == "rocheck" {
        // `rocheck NAME PAGES SEED [ONLY]`: `check` through a read-only mapping (no writer
        // claim: another job may write the file meanwhile).
        let seed: u64 = arg(4).parse().expect("SEED");
        let only: Option<usize> = args.get(5).map(|a| a.parse().expect("ONLY"));
        let m = s.map_read_only(&name, (pages * 4096) as u64).unwrap_or_else(|e| {
            eprintln!("map: {e}");
            std::process::exit(1)
        });
        let w: &[u64] = m.as_slice();
        for p in (0..pages).filter(|p| only.is_none_or(|o| o == *p)) {
            for k in 0..words_per_page {
                // SAFETY: a plain load inside the mapping (volatile: others write it).
                let got = unsafe { std::ptr::read_volatile(&w[p * words_per_page + k]) };
                if got != pattern(seed, p, k) {
                    eprintln!("page {p} word {k}: {got:#x}, want {:#x}", pattern(seed, p, k));
                    std::process::exit(4);
                }
            }
        }
        m.unmap().expect("unmap");
        println!("ok");
        std::process::exit(0)
    }
    if mode == "map" {
        // Only the mapping: `map NAME BYTES CREATE(0|1)`; prints the error if any.
        let create = arg(4) == "1";
        match s.map(&name, pages as u64, create) {
            Ok(m) => {
                println!("mapped {} bytes", m.len());
                m.unmap().expect("unmap");
                std::process::exit(0)
            }
            Err(e) => {
                println!("error: {e}");
                std::process::exit(1)
            }
        }
    }
    let mut m = s.map(&name, (pages * 4096) as u64, true).unwrap_or_else(|e| {
        eprintln!("map: {e}");
        std::process::exit(1)
    });
    let w: &mut [u64] = m.as_mut_slice();
    if mode == "steps" {
        // `steps NAME PAGES STEPS SKIP STATE_BYTES SLEEP_MS` (under `psls run`): a main loop
        // with a safe-point call at its top (state: the step, padded to STATE_BYTES); each
        // step adds step + 1 to word 0 of the rank's page. Rank SKIP (if < size) never calls
        // checkpoint. Prints `step S epoch E` for every checkpoint taken and `done SUM`.
        // With an 8th argument `vol`, the step is also added to word 0 of the rank's page of
        // the job's volatile segment NAME.vol, and `done` prints its sum too.
        // With PROBE_LINES=1 in the environment it prints `line S` after every step's call
        // instead, and nothing else before `done`: the lines of a run that never failed.
        let lines = std::env::var_os("PROBE_LINES").is_some();
        let steps: u64 = arg(4).parse().expect("STEPS");
        let mut vol = (args.get(8).map(String::as_str) == Some("vol")).then(|| {
            s.create_volatile(&format!("{name}.vol"), (pages * 4096) as u64)
                .unwrap_or_else(|e| {
                    eprintln!("create_volatile: {e}");
                    std::process::exit(1)
                })
        });
        let skip: u32 = arg(5).parse().expect("SKIP");
        let state_bytes: usize = arg(6).parse().expect("STATE_BYTES");
        let sleep_ms: u64 = arg(7).parse().expect("SLEEP_MS");
        let rank = s.rank();
        let mut first = 0u64;
        match s.restart_state() {
            Ok(Some((epoch, state))) => {
                first = u64::from_le_bytes(state[..8].try_into().expect("8 bytes"));
                if !lines {
                    println!("restarted from epoch {epoch} at step {first}");
                }
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("restart_state: {e}");
                std::process::exit(3)
            }
        }
        let me = rank as usize * words_per_page % w.len();
        for step in first..steps {
            if rank != skip {
                let mut state = step.to_le_bytes().to_vec();
                state.resize(state_bytes.max(8), 0xA5);
                match s.checkpoint(&state) {
                    Ok(c) if c.taken() && !lines => {
                        println!("step {step} epoch {}{}", c.epoch, if c.halt { " halt" } else { "" })
                    }
                    Ok(_) => {}
                    Err(e) => {
                        println!("checkpoint error: {e}");
                        use std::io::Write;
                        let _ = std::io::stdout().flush();
                        std::process::exit(3)
                    }
                }
            }
            // SAFETY: plain volatile loads and stores of this rank's own word.
            unsafe { std::ptr::write_volatile(&mut w[me], std::ptr::read_volatile(&w[me]) + step + 1) };
            if let Some(v) = vol.as_mut() {
                let v: &mut [u64] = v.as_mut_slice();
                // SAFETY: as above, in the volatile segment.
                unsafe { std::ptr::write_volatile(&mut v[me], std::ptr::read_volatile(&v[me]) + step + 1) };
            }
            if lines {
                println!("line {step}");
            }
            std::thread::sleep(Duration::from_millis(sleep_ms));
        }
        // SAFETY: as above.
        let sum = unsafe { std::ptr::read_volatile(&w[me]) };
        match vol.as_ref() {
            // SAFETY: as above.
            Some(v) => println!("done {sum} {}", unsafe {
                std::ptr::read_volatile(&v.as_slice::<u64>()[me])
            }),
            None => println!("done {sum}"),
        }
        drop(vol);
        drop(m);
        std::process::exit(0)
    }
    if mode == "hold" {
        // `hold NAME PAGES MARKER`: keeps the file mapped writable until file MARKER exists.
        println!("mapped");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let marker = arg(4);
        let t = Instant::now();
        while !std::path::Path::new(&marker).exists() && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(m);
        std::process::exit(0)
    }
    if mode == "fillsync" {
        // `fillsync NAME PAGES SEED SEED2 FROM [MARKER]`: fills every page with SEED's
        // pattern, syncs (prints the pages written), writes SEED2's pattern over pages FROM..,
        // prints "written", waits (still mapped: only what the sync made durable is on the
        // disks) until file MARKER exists, if given, and exits without unmapping (its end
        // makes the rest durable).
        let (seed, seed2): (u64, u64) = (arg(4).parse().expect("SEED"), arg(5).parse().expect("SEED2"));
        let from: usize = arg(6).parse().expect("FROM");
        for p in 0..pages {
            for k in 0..words_per_page {
                w[p * words_per_page + k] = pattern(seed, p, k);
            }
        }
        match s.sync() {
            Ok(n) => println!("synced {n}"),
            Err(e) => {
                eprintln!("sync: {e}");
                std::process::exit(1)
            }
        }
        for p in from..pages {
            for k in 0..words_per_page {
                w[p * words_per_page + k] = pattern(seed2, p, k);
            }
        }
        println!("written");
        use std::io::Write;
        let _ = std::io::stdout().flush();
        if let Some(marker) = args.get(7) {
            let t = Instant::now();
            while !std::path::Path::new(marker).exists() && t.elapsed() < Duration::from_secs(120) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        std::process::exit(0)
    }
    match mode.as_str() {
        "produce" => {
            for p in 1..pages {
                for k in 0..words_per_page {
                    w[p * words_per_page + k] = pattern(7, p, k);
                }
            }
            // SAFETY: a plain store to a shared word (volatile: the consumer polls it).
            unsafe { std::ptr::write_volatile(&mut w[0], 1) };
            wait_for(w, 2, "the consumer");
        }
        "consume" => {
            wait_for(w, 1, "the producer");
            for p in 1..pages {
                for k in 0..words_per_page {
                    let got = w[p * words_per_page + k];
                    if got != pattern(7, p, k) {
                        eprintln!("page {p} word {k}: {got:#x}, want {:#x}", pattern(7, p, k));
                        std::process::exit(4);
                    }
                }
            }
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(&mut w[0], 2) };
        }
        "fill" | "check" => {
            let seed: u64 = arg(4).parse().expect("SEED");
            let only: Option<usize> = args.get(5).map(|a| a.parse().expect("ONLY"));
            for p in (0..pages).filter(|p| only.is_none_or(|o| o == *p)) {
                for k in 0..words_per_page {
                    let i = p * words_per_page + k;
                    if mode == "fill" {
                        w[i] = pattern(seed, p, k);
                    } else if w[i] != pattern(seed, p, k) {
                        eprintln!("page {p} word {k}: {:#x}, want {:#x}", w[i], pattern(seed, p, k));
                        std::process::exit(4);
                    }
                }
            }
        }
        "count" => {
            // `count NAME PAGES INCREMENTS COUNT`: INCREMENTS times, under lock 1, adds one
            // to word 0; then a barrier of COUNT ranks; then prints word 0.
            let (incs, ranks): (u64, u32) = (arg(4).parse().expect("INCREMENTS"), arg(5).parse().expect("COUNT"));
            for _ in 0..incs {
                s.lock(1).expect("lock");
                // SAFETY: plain loads and stores of one shared word, under the lock.
                unsafe { std::ptr::write_volatile(&mut w[0], std::ptr::read_volatile(&w[0]) + 1) };
                s.unlock(1).expect("unlock");
            }
            s.barrier_of("counted", ranks).expect("barrier");
            // SAFETY: a plain load of a shared word.
            println!("{}", unsafe { std::ptr::read_volatile(&w[0]) });
        }
        "pingpong" => {
            // `pingpong NAME PAGES ROUNDS` (2 ranks): rank r adds one to word 0 whenever it is
            // r's turn (word 0 % 2 == r), until ROUNDS: the page moves between the two nodes
            // ROUNDS times and no increment may be lost.
            let rounds: u64 = arg(4).parse().expect("ROUNDS");
            let rank = s.rank() as u64;
            let mut mine = 0u64;
            let t = Instant::now();
            loop {
                // SAFETY: plain volatile loads and stores of a shared word.
                let v = unsafe { std::ptr::read_volatile(&w[0]) };
                if v >= rounds {
                    break;
                }
                if v % 2 == rank {
                    // SAFETY: a volatile store to a word of the mapping (a valid `&mut u64`).
                    unsafe { std::ptr::write_volatile(&mut w[0], v + 1) };
                    mine += 1;
                } else if t.elapsed() > Duration::from_secs(120) {
                    eprintln!("stuck at {v}");
                    std::process::exit(3);
                }
            }
            s.barrier_of("pingpong", 2).expect("barrier");
            // SAFETY: a volatile load of a word of the mapping.
            let last = unsafe { std::ptr::read_volatile(&w[0]) };
            println!("did {mine} of {} final {}", rounds, last);
        }
        "falseshare" => {
            // `falseshare NAME PAGES TIMES`: each rank adds one to its own word of page 0,
            // TIMES times, without locks; after a barrier every rank's word must be TIMES.
            let times: u64 = arg(4).parse().expect("TIMES");
            let (rank, size) = (s.rank() as usize, s.size() as usize);
            for _ in 0..times {
                // SAFETY: plain volatile loads and stores of this rank's own word.
                unsafe { std::ptr::write_volatile(&mut w[rank], std::ptr::read_volatile(&w[rank]) + 1) };
            }
            s.barrier("falseshare").expect("barrier");
            let words: Vec<u64> = (0..size)
                // SAFETY: volatile loads of words of the mapping.
                .map(|r| unsafe { std::ptr::read_volatile(&w[r]) })
                .collect();
            println!("words {words:?}");
            if words.iter().any(|&x| x != times) {
                std::process::exit(4);
            }
        }
        "fork" => {
            // `fork NAME PAGES`: a forked child touches the mapping; prints how it ended.
            // SAFETY: fork in a process whose other threads only wait in blocking calls; the
            // child touches one byte, then leaves with _exit.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: one volatile load inside the parent's mapping (gone in the child).
                let v = unsafe { std::ptr::read_volatile(&w[0]) };
                // SAFETY: _exit ends the child at once.
                unsafe { libc::_exit((v & 0x7f) as i32) };
            }
            let mut status = 0;
            // SAFETY: waits for our own child, writing its status into a live int.
            if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
                eprintln!("waitpid failed");
                std::process::exit(5);
            }
            if libc::WIFSIGNALED(status) {
                println!("child signal {}", libc::WTERMSIG(status));
            } else {
                println!("child exit {}", libc::WEXITSTATUS(status));
            }
        }
        "sync-errors" => {
            // Unlocking a lock not held, a barrier with a mismatched count.
            let e = s.unlock(99).expect_err("unlock of a lock not held");
            println!("unlock: {e}");
            s.lock(5).expect("lock");
            let e = s.lock(5).expect_err("locking twice");
            println!("relock: {e}");
            s.unlock(5).expect("unlock");
        }
        other => {
            eprintln!("unknown mode {other}");
            std::process::exit(2);
        }
    }
    drop(m);
    println!("ok");
}

/// One litmus test, ITERATIONS times, one barrier between iterations. Iteration `it` writes
/// the value `it + 1`, so a read "sees the write" iff it reads at least `it + 1` (values only
/// grow), and no reset is needed between iterations.
fn litmus(test: &str, iters: usize) {
    let s = Session::connect().unwrap_or_else(|e| {
        eprintln!("connect: {e}");
        std::process::exit(1)
    });
    let (rank, size) = (s.rank() as usize, s.size() as usize);
    if size < 4 {
        eprintln!("litmus needs 4 ranks");
        std::process::exit(2);
    }
    const W: usize = 512; // words per page
    let res_pages = (iters * 2).div_ceil(W);
    let pages = 2 + 4 * res_pages;
    let job = std::env::var("PSLS_JOB").unwrap_or_default();
    let mut m = s
        .map(&format!("litmus-{test}-{job}"), (pages * 4096) as u64, true)
        .unwrap_or_else(|e| {
            eprintln!("map: {e}");
            std::process::exit(1)
        });
    let w: &mut [u64] = m.as_mut_slice();
    let base = w.as_mut_ptr();
    // x on page 0, y on page 1, each rank's results on its own pages.
    // SAFETY: page 1 of the mapping, which has at least 2 + ranks * res_pages pages.
    let (x, y) = (base, unsafe { base.add(W) });
    // SAFETY: a word of rank r's result pages, inside the mapping for every r < size.
    let res = |r: usize, it: usize, k: usize| unsafe { base.add(2 * W + r * res_pages * W + it * 2 + k) };
    // SAFETY: plain volatile loads of words inside the mapping (pointers from x, y, res).
    let ld = |p: *mut u64| unsafe { std::ptr::read_volatile(p) };
    // SAFETY: plain volatile stores of words inside the mapping (pointers from x, y, res).
    let st = |p: *mut u64, v: u64| unsafe { std::ptr::write_volatile(p, v) };
    s.barrier("litmus-start").expect("barrier");
    for it in 0..iters {
        let v = it as u64 + 1;
        let seen = |p: *mut u64| (ld(p) >= v) as u64;
        match (test, rank) {
            ("sb", 0) => {
                st(x, v);
                st(res(0, it, 0), seen(y));
            }
            ("sb", 1) => {
                st(y, v);
                st(res(1, it, 0), seen(x));
            }
            ("mp", 0) => {
                st(x, v); // data
                st(y, v); // flag
            }
            ("mp", 1) => {
                let flag = seen(y);
                let data = seen(x);
                st(res(1, it, 0), flag);
                st(res(1, it, 1), data);
            }
            ("iriw", 0) => st(x, v),
            ("iriw", 1) => st(y, v),
            ("iriw", 2) => {
                let a = seen(x);
                let b = seen(y);
                st(res(2, it, 0), a);
                st(res(2, it, 1), b);
            }
            ("iriw", 3) => {
                let c = seen(y);
                let d = seen(x);
                st(res(3, it, 0), c);
                st(res(3, it, 1), d);
            }
            ("lb", 0) => {
                let r = seen(x);
                st(y, v);
                st(res(0, it, 0), r);
            }
            ("lb", 1) => {
                let r = seen(y);
                st(x, v);
                st(res(1, it, 0), r);
            }
            ("sb" | "mp" | "iriw" | "lb", _) => {}
            _ => {
                eprintln!("unknown litmus test {test}");
                std::process::exit(2);
            }
        }
        s.barrier("litmus").expect("barrier");
    }
    if rank == 0 {
        let mut outcomes: std::collections::BTreeMap<String, usize> = Default::default();
        let mut forbidden = 0;
        for it in 0..iters {
            let r = |rk: usize, k: usize| ld(res(rk, it, k));
            let (key, bad) = match test {
                "sb" => (format!("{}{}", r(0, 0), r(1, 0)), r(0, 0) == 0 && r(1, 0) == 0),
                "mp" => (format!("{}{}", r(1, 0), r(1, 1)), r(1, 0) == 1 && r(1, 1) == 0),
                "iriw" => (
                    format!("{}{}{}{}", r(2, 0), r(2, 1), r(3, 0), r(3, 1)),
                    r(2, 0) == 1 && r(2, 1) == 0 && r(3, 0) == 1 && r(3, 1) == 0,
                ),
                _ => (format!("{}{}", r(0, 0), r(1, 0)), r(0, 0) == 1 && r(1, 0) == 1),
            };
            *outcomes.entry(key).or_default() += 1;
            forbidden += bad as usize;
        }
        println!("litmus {test}: {iters} iterations, {forbidden} forbidden, outcomes {outcomes:?}");
    }
    s.barrier("litmus-end").expect("barrier");
    drop(m);
}
