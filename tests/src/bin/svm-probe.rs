//! A client process for the shared-memory integration tests. Each mode maps a parallel file
//! through the client library and exercises it; exit status 0 means every check passed.
//!
//! Modes (argument 1):
//! - `produce NAME PAGES`: writes a pattern into pages 1.., then sets word 0 to 1 and waits
//!   for the consumer to set it to 2.
//! - `consume NAME PAGES`: waits for word 0 == 1, checks the pattern, sets word 0 to 2.
//! - `fill NAME PAGES SEED`: writes the pattern of SEED into every page and exits.
//! - `check NAME PAGES SEED`: checks every page holds the pattern of SEED.
//! - `map NAME BYTES CREATE`: only maps (and unmaps); prints the error if the map fails.

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
    let pages: usize = arg(3).parse().expect("PAGES");
    let words_per_page = 4096 / 8;
    let s = Session::connect().unwrap_or_else(|e| {
        eprintln!("connect: {e}");
        std::process::exit(1)
    });
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
            for p in 0..pages {
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
