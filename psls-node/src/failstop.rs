//! Fail-stop, stated once (DESIGN §2: nodes are fail-stop). A panic in any thread of the
//! daemon — a fault thread, the link or sync thread, a runtime worker, a blocking task — ends
//! the process with one clear log line, so peers see the node down and a restart brings it
//! back with a new incarnation. Nothing goes on with state a panic left half-changed: the hook
//! exits before any other thread can take a lock the panic poisoned, and the lock helpers here
//! refuse a poisoned lock rather than hand its data out.

use std::sync::{Mutex, MutexGuard, Once, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Exit status of a daemon stopped by a panic.
pub const PANIC_EXIT: i32 = 70;

/// Installs the daemon's panic hook (once per process): the default report, a log line
/// naming the thread, then exit with [`PANIC_EXIT`].
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            default(info);
            let thread = std::thread::current();
            let name = thread.name().unwrap_or("unnamed");
            tracing::error!(thread = name, "panic: {info}; the daemon stops (fail-stop)");
            eprintln!("psls-node: a panic in thread '{name}' stops the daemon (fail-stop)");
            std::process::exit(PANIC_EXIT);
        }));
    });
}

/// Locking that never uses data a panic may have left half-changed.
pub trait Locked<T: ?Sized> {
    type Guard<'a>
    where
        Self: 'a;
    /// Takes the lock; panics (and so, with the hook, stops the daemon) if a panic poisoned it.
    fn locked(&self) -> Self::Guard<'_>;
}

impl<T: ?Sized> Locked<T> for Mutex<T> {
    type Guard<'a>
        = MutexGuard<'a, T>
    where
        T: 'a;
    fn locked(&self) -> MutexGuard<'_, T> {
        match self.lock() {
            Ok(g) => g,
            Err(_) => panic!("a lock was poisoned by a panic in another thread"),
        }
    }
}

/// Read and write locking of an `RwLock` with the same rule as [`Locked`].
pub trait RwLocked<T: ?Sized> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLocked<T> for RwLock<T> {
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        match self.read() {
            Ok(g) => g,
            Err(_) => panic!("a lock was poisoned by a panic in another thread"),
        }
    }
    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        match self.write() {
            Ok(g) => g,
            Err(_) => panic!("a lock was poisoned by a panic in another thread"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_refused() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.locked();
            panic!("poison it");
        })
        .join();
        let r = std::panic::catch_unwind(|| *m.locked());
        assert!(r.is_err(), "a poisoned lock handed out its data");
        let ok = Mutex::new(2);
        assert_eq!(*ok.locked(), 2);
    }
}
