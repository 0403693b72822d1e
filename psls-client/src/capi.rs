//! The C ABI of the client library (`include/psls.h`): one process-wide session, mappings
//! identified by their address. Every function returns 0 (or a value ≥ 0) on success and a
//! negative `PSLS_E*` code on failure; `psls_last_error` gives the message of the calling
//! thread's last failure. No function panics across the boundary.

use crate::{ClientError, Mapping, Session};
use psls_ipc::ErrorKind;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

pub const PSLS_EINIT: c_int = -1;
pub const PSLS_EINVAL: c_int = -2;
pub const PSLS_ENOENT: c_int = -3;
pub const PSLS_EEXIST: c_int = -4;
pub const PSLS_EPERM: c_int = -5;
pub const PSLS_ENOSPC: c_int = -6;
pub const PSLS_EUNAVAIL: c_int = -7;
pub const PSLS_EIO: c_int = -8;
pub const PSLS_EINTERNAL: c_int = -9;
pub const PSLS_ECONNECT: c_int = -10;
pub const PSLS_ENOTMAPPED: c_int = -11;

static SESSION: OnceLock<&'static Session> = OnceLock::new();
static MAPS: Mutex<Option<HashMap<usize, Mapping<'static>>>> = Mutex::new(None);

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

fn fail(code: c_int, message: String) -> c_int {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = c);
    code
}

fn code_of(e: &ClientError) -> c_int {
    match e {
        ClientError::Daemon { kind, .. } => match kind {
            ErrorKind::NotFound => PSLS_ENOENT,
            ErrorKind::Exists => PSLS_EEXIST,
            ErrorKind::Permission => PSLS_EPERM,
            ErrorKind::Invalid => PSLS_EINVAL,
            ErrorKind::NoSpace => PSLS_ENOSPC,
            ErrorKind::Unavailable => PSLS_EUNAVAIL,
            ErrorKind::Io => PSLS_EIO,
            ErrorKind::Internal => PSLS_EINTERNAL,
        },
        ClientError::Connect { .. } => PSLS_ECONNECT,
        ClientError::Invalid(_) => PSLS_EINVAL,
        ClientError::Frame(_) | ClientError::Protocol(_) => PSLS_EUNAVAIL,
        ClientError::Local(_) => PSLS_EIO,
    }
}

fn from(e: ClientError) -> c_int {
    fail(code_of(&e), e.to_string())
}

/// Runs `f` with the session, catching panics (none should happen) at the boundary.
fn with_session(f: impl FnOnce(&'static Session) -> c_int) -> c_int {
    let Some(s) = SESSION.get().copied() else {
        return fail(PSLS_EINIT, "psls_init has not been called (or failed)".into());
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(s)))
        .unwrap_or_else(|_| fail(PSLS_EINTERNAL, "internal error in the PSLS client library".into()))
}

fn name_of(name: *const c_char) -> Result<String, c_int> {
    if name.is_null() {
        return Err(fail(PSLS_EINVAL, "name is NULL".into()));
    }
    // SAFETY: the caller passes a NUL-terminated string (checked non-NULL above).
    let s = unsafe { CStr::from_ptr(name) };
    s.to_str()
        .map(str::to_string)
        .map_err(|_| fail(PSLS_EINVAL, "name is not UTF-8".into()))
}

/// Connects to the local daemon. Idempotent.
#[no_mangle]
pub extern "C" fn psls_init() -> c_int {
    if SESSION.get().is_some() {
        return 0;
    }
    match std::panic::catch_unwind(Session::connect) {
        Ok(Ok(s)) => {
            let s: &'static Session = Box::leak(Box::new(s));
            let _ = SESSION.set(s);
            0
        }
        Ok(Err(e)) => from(e),
        Err(_) => fail(PSLS_EINTERNAL, "internal error in psls_init".into()),
    }
}

/// Unmaps every mapping still mapped.
#[no_mangle]
pub extern "C" fn psls_finalize() -> c_int {
    with_session(|_| {
        let maps = MAPS.lock().unwrap_or_else(|e| e.into_inner()).take();
        let mut rc = 0;
        for (_, m) in maps.unwrap_or_default() {
            if let Err(e) = m.unmap() {
                rc = from(e);
            }
        }
        rc
    })
}

/// This process's rank in its job.
#[no_mangle]
pub extern "C" fn psls_rank() -> c_int {
    with_session(|s| s.rank() as c_int)
}

/// The number of ranks in the job.
#[no_mangle]
pub extern "C" fn psls_size() -> c_int {
    with_session(|s| s.size() as c_int)
}

/// Maps `size` bytes of parallel file `name` (created with that size if `create` and absent);
/// the address goes to `*addr`.
///
/// # Safety
/// `name` must be a NUL-terminated string and `addr` a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn psls_map(name: *const c_char, size: usize, create: c_int, addr: *mut *mut c_void) -> c_int {
    if addr.is_null() {
        return fail(PSLS_EINVAL, "addr is NULL".into());
    }
    let name = match name_of(name) {
        Ok(n) => n,
        Err(rc) => return rc,
    };
    with_session(|s| match s.map(&name, size as u64, create != 0) {
        Ok(m) => {
            let p = m.as_ptr();
            MAPS.lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(HashMap::new)
                .insert(p as usize, m);
            // SAFETY: addr is non-NULL and, by the caller's promise, writable.
            unsafe { *addr = p as *mut c_void };
            0
        }
        Err(e) => from(e),
    })
}

/// Maps `size` bytes of the existing parallel file `name` for reading only (read permission
/// suffices); the address goes to `*addr`. A store to the mapping is a segmentation fault.
///
/// # Safety
/// `name` must be a NUL-terminated string and `addr` a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn psls_map_ro(name: *const c_char, size: usize, addr: *mut *const c_void) -> c_int {
    if addr.is_null() {
        return fail(PSLS_EINVAL, "addr is NULL".into());
    }
    let name = match name_of(name) {
        Ok(n) => n,
        Err(rc) => return rc,
    };
    with_session(|s| match s.map_read_only(&name, size as u64) {
        Ok(m) => {
            let p = m.as_ptr();
            MAPS.lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert_with(HashMap::new)
                .insert(p as usize, m.into_inner());
            // SAFETY: addr is non-NULL and, by the caller's promise, writable.
            unsafe { *addr = p as *const c_void };
            0
        }
        Err(e) => from(e),
    })
}

/// Unmaps the mapping at `addr` (as returned by `psls_map` or `psls_map_ro`).
#[no_mangle]
pub extern "C" fn psls_unmap(addr: *const c_void) -> c_int {
    with_session(|_| {
        let m = MAPS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .and_then(|maps| maps.remove(&(addr as usize)));
        match m {
            Some(m) => m.unmap().map_or_else(from, |()| 0),
            None => fail(
                PSLS_ENOTMAPPED,
                format!("{addr:p} is not a PSLS mapping (unmapped twice?)"),
            ),
        }
    })
}

/// The safe-point call (see `Session::checkpoint`): the epoch taken, 0 when none was, or a
/// negative error.
///
/// # Safety
/// `state` must point to `len` readable bytes (or be NULL with `len` 0).
#[no_mangle]
pub unsafe extern "C" fn psls_checkpoint(state: *const c_void, len: usize) -> c_int {
    let bytes: &[u8] = if len == 0 {
        &[]
    } else if state.is_null() {
        return fail(PSLS_EINVAL, "state is NULL".into());
    } else {
        // SAFETY: the caller passes `len` readable bytes at `state` (non-NULL, checked).
        unsafe { std::slice::from_raw_parts(state as *const u8, len) }
    };
    with_session(|s| {
        s.checkpoint(bytes)
            .map_or_else(from, |c| c.epoch.min(c_int::MAX as u64) as c_int)
    })
}

/// Whether this rank restarted from a checkpoint: 1 and its saved state in `buf` (its length
/// in `*len`), 0 on a fresh start, or a negative error (`PSLS_EINVAL` if `cap` is too small:
/// `*len` then says how much is needed).
///
/// # Safety
/// `buf` must point to `cap` writable bytes (or be NULL with `cap` 0), `len` to a `size_t`.
#[no_mangle]
pub unsafe extern "C" fn psls_restarted(buf: *mut c_void, cap: usize, len: *mut usize) -> c_int {
    if len.is_null() {
        return fail(PSLS_EINVAL, "len is NULL".into());
    }
    with_session(|s| match s.restart_state() {
        Err(e) => from(e),
        Ok(None) => {
            // SAFETY: `len` points to a writable size_t (non-NULL, checked).
            unsafe { *len = 0 };
            0
        }
        Ok(Some((_, state))) => {
            // SAFETY: as above.
            unsafe { *len = state.len() };
            if state.len() > cap || (buf.is_null() && !state.is_empty()) {
                return fail(
                    PSLS_EINVAL,
                    format!("the saved state is {} bytes; the buffer holds {cap}", state.len()),
                );
            }
            if !state.is_empty() {
                // SAFETY: `buf` holds `cap` >= state.len() writable bytes, not overlapping ours.
                unsafe { std::ptr::copy_nonoverlapping(state.as_ptr(), buf as *mut u8, state.len()) };
            }
            1
        }
    })
}

/// Makes the process's writes to the files it maps writable durable (see `Session::sync`).
#[no_mangle]
pub extern "C" fn psls_sync() -> c_int {
    with_session(|s| s.sync().map_or_else(from, |_| 0))
}

/// Waits until every rank of the job has called `psls_barrier`.
#[no_mangle]
pub extern "C" fn psls_barrier() -> c_int {
    with_session(|s| s.barrier("psls").map_or_else(from, |()| 0))
}

/// Waits until `count` ranks have called the barrier `name`.
///
/// # Safety
/// `name` must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn psls_barrier_named(name: *const c_char, count: u32) -> c_int {
    let name = match name_of(name) {
        Ok(n) => n,
        Err(rc) => return rc,
    };
    with_session(|s| s.barrier_of(&name, count).map_or_else(from, |()| 0))
}

/// Waits for lock `id` of the job, then holds it.
#[no_mangle]
pub extern "C" fn psls_lock(id: u64) -> c_int {
    with_session(|s| s.lock(id).map_or_else(from, |()| 0))
}

/// Releases lock `id`.
#[no_mangle]
pub extern "C" fn psls_unlock(id: u64) -> c_int {
    with_session(|s| s.unlock(id).map_or_else(from, |()| 0))
}

/// A static description of error code `err`.
#[no_mangle]
pub extern "C" fn psls_strerror(err: c_int) -> *const c_char {
    let s: &'static CStr = match err {
        0 => c"success",
        PSLS_EINIT => c"PSLS is not initialized (call psls_init)",
        PSLS_EINVAL => c"invalid argument",
        PSLS_ENOENT => c"no such parallel file",
        PSLS_EEXIST => c"already exists",
        PSLS_EPERM => c"permission denied",
        PSLS_ENOSPC => c"no space left",
        PSLS_EUNAVAIL => c"the node daemon or the cluster is unavailable",
        PSLS_EIO => c"I/O error",
        PSLS_EINTERNAL => c"internal error",
        PSLS_ECONNECT => c"cannot connect to the node daemon",
        PSLS_ENOTMAPPED => c"not a PSLS mapping",
        _ => c"unknown error",
    };
    s.as_ptr()
}

/// The message of the calling thread's last failure ("" if none).
#[no_mangle]
pub extern "C" fn psls_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_their_codes() {
        let daemon = |kind| ClientError::Daemon {
            kind,
            message: String::new(),
        };
        assert_eq!(code_of(&daemon(ErrorKind::NotFound)), PSLS_ENOENT);
        assert_eq!(code_of(&daemon(ErrorKind::Invalid)), PSLS_EINVAL);
        assert_eq!(code_of(&ClientError::Invalid("name".into())), PSLS_EINVAL);
        let closed = ClientError::Frame(psls_ipc::proto::FrameError::Closed);
        assert_eq!(code_of(&closed), PSLS_EUNAVAIL);
    }
}
