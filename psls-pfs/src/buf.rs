//! [`PageBuf`]: a growable byte buffer whose start is aligned to [`BUF_ALIGN`] (4096) bytes, so
//! that page runs built in it can go to the disk with direct I/O (no copy into the page cache).
//!
//! [`BufPool`] keeps a bounded number of equal-sized buffers for reuse, so that a stream of
//! batches does not pay for fresh memory (page faults and zeroing by the kernel) every time.
//!
//! Invariants: the allocation is `cap` bytes at an address that is a multiple of `BUF_ALIGN`
//! (`cap` > 0); bytes `[0, init)` are initialised, `[0, len)` are the only ones ever exposed;
//! `len <= init <= cap`. A reused buffer keeps `init`, so growing it back
//! ([`PageBuf::resize_reusing`]) costs nothing where it was written before.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

/// Alignment of a [`PageBuf`]'s start: the page size, which is also a multiple of every
/// logical block size direct I/O asks for.
pub const BUF_ALIGN: usize = 4096;

/// See the module documentation.
pub struct PageBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    /// Bytes `[0, init)` have been written (or zeroed) at some time.
    init: usize,
}

// SAFETY: `PageBuf` owns its allocation exclusively (like `Vec<u8>`); shared references only
// give out `&[u8]`.
unsafe impl Send for PageBuf {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for PageBuf {}

impl PageBuf {
    /// An empty buffer with room for `cap` bytes (at least one byte is allocated).
    pub fn with_capacity(cap: usize) -> PageBuf {
        let cap = cap.max(1);
        let layout = Self::layout(cap);
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(p) else {
            handle_alloc_error(layout)
        };
        PageBuf {
            ptr,
            len: 0,
            cap,
            init: 0,
        }
    }

    /// A copy of `data`, aligned.
    pub fn copy_of(data: &[u8]) -> PageBuf {
        let mut b = PageBuf::with_capacity(data.len());
        b.extend_from_slice(data);
        b
    }

    /// `len` zero bytes, aligned.
    pub fn zeroed(len: usize) -> PageBuf {
        let mut b = PageBuf::with_capacity(len);
        // SAFETY: `len <= cap`; `write_bytes` initialises exactly bytes `[0, len)`.
        unsafe { std::ptr::write_bytes(b.ptr.as_ptr(), 0, len) };
        b.len = len;
        b.init = len;
        b
    }

    fn layout(cap: usize) -> Layout {
        Layout::from_size_align(cap, BUF_ALIGN).expect("buffer size below isize::MAX")
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the length to `len`, the bytes past the old length zero (growing if needed).
    pub fn resize_zeroed(&mut self, len: usize) {
        if len <= self.len {
            self.len = len;
            return;
        }
        if len > self.cap {
            let mut bigger = PageBuf::with_capacity(len);
            bigger.extend_from_slice(self);
            *self = bigger;
        }
        // SAFETY: `[self.len, len)` lies inside the allocation (`len <= cap`, ensured above).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(self.len), 0, len - self.len) };
        self.len = len;
        self.init = self.init.max(len);
    }

    /// Sets the length to `len` (growing if needed). Bytes past the old length keep what they
    /// last held in this buffer, and are zero where it never held anything: for a buffer the
    /// caller overwrites anyway (a read), reuse costs no zeroing.
    pub fn resize_reusing(&mut self, len: usize) {
        if len > self.cap {
            let mut bigger = PageBuf::with_capacity(len);
            bigger.extend_from_slice(self);
            *self = bigger;
        }
        if len > self.init {
            // SAFETY: `[init, len)` lies inside the allocation (`len <= cap`, ensured above).
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(self.init), 0, len - self.init) };
            self.init = len;
        }
        self.len = len;
    }

    /// Appends `data`, moving to a larger aligned allocation when it does not fit.
    pub fn extend_from_slice(&mut self, data: &[u8]) {
        if data.len() > self.cap - self.len {
            let need = self.len.checked_add(data.len()).expect("buffer size below usize::MAX");
            let mut bigger = PageBuf::with_capacity(need.max(self.cap.saturating_mul(2)));
            bigger.extend_from_slice(self);
            *self = bigger;
        }
        // SAFETY: the destination `[len, len + data.len())` lies inside the allocation
        // (ensured above) and cannot overlap `data`, which is borrowed shared while `self` is
        // borrowed mutably.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(self.len), data.len());
        }
        self.len += data.len();
        self.init = self.init.max(self.len);
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated in `with_capacity` with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) };
    }
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: bytes `[0, len)` are initialised and owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: bytes `[0, len)` are initialised and owned by `self`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for PageBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageBuf({} of {} bytes)", self.len, self.cap)
    }
}

/// A bounded free list of [`PageBuf`]s of one capacity.
#[derive(Debug)]
pub struct BufPool {
    free: std::sync::Mutex<Vec<PageBuf>>,
    cap: usize,
    max_free: usize,
}

impl BufPool {
    /// Buffers of `cap` bytes; at most `max_free` are kept when returned.
    pub fn new(cap: usize, max_free: usize) -> std::sync::Arc<BufPool> {
        std::sync::Arc::new(BufPool {
            free: std::sync::Mutex::new(Vec::new()),
            cap,
            max_free,
        })
    }

    /// Capacity of every buffer of this pool.
    pub fn buf_capacity(&self) -> usize {
        self.cap
    }

    /// An empty buffer of the pool's capacity, reused when one is free.
    pub fn get(self: &std::sync::Arc<Self>) -> PooledBuf {
        let reused = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let buf = reused.unwrap_or_else(|| PageBuf::with_capacity(self.cap));
        PooledBuf {
            buf: Some(buf),
            pool: self.clone(),
        }
    }

    /// A buffer with room for `len` bytes: one of the pool's when they are large enough, else
    /// a new one that is not kept when dropped.
    pub fn get_at_least(self: &std::sync::Arc<Self>, len: usize) -> PooledBuf {
        let mut b = self.get();
        if len > self.cap {
            // Grown past the pool's size: dropped, not kept, when done.
            b.buf = Some(PageBuf::with_capacity(len));
        }
        b
    }

    /// Buffers currently free.
    pub fn free_count(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// A [`PageBuf`] that goes back to its pool when dropped.
#[derive(Debug)]
pub struct PooledBuf {
    /// Always `Some` until dropped.
    buf: Option<PageBuf>,
    pool: std::sync::Arc<BufPool>,
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(mut b) = self.buf.take() {
            b.len = 0;
            let mut free = self.pool.free.lock().unwrap_or_else(|e| e.into_inner());
            // A buffer that grew past the pool's size is not kept.
            if free.len() < self.pool.max_free && b.cap == self.pool.cap {
                free.push(b);
            }
        }
    }
}

impl std::ops::Deref for PooledBuf {
    type Target = PageBuf;
    fn deref(&self) -> &PageBuf {
        self.buf.as_ref().expect("present until dropped")
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut PageBuf {
        self.buf.as_mut().expect("present until dropped")
    }
}

impl AsRef<[u8]> for PooledBuf {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_deref().unwrap_or(&[])
    }
}

/// Whether `p`, `offset` and `len` all suit direct I/O.
pub fn is_aligned(p: *const u8, offset: u64, len: usize) -> bool {
    (p as usize).is_multiple_of(BUF_ALIGN) && offset.is_multiple_of(BUF_ALIGN as u64) && len.is_multiple_of(BUF_ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_bounded() {
        for cap in [1, 4095, 4096, 1 << 20] {
            let mut b = PageBuf::with_capacity(cap);
            assert!(b.is_empty());
            assert!((b.as_ptr() as usize).is_multiple_of(BUF_ALIGN));
            b.extend_from_slice(&vec![7u8; cap]);
            assert_eq!(b.len(), cap);
            assert!(b.iter().all(|&x| x == 7));
        }
        let z = PageBuf::zeroed(8192);
        assert!(z.iter().all(|&x| x == 0));
        let mut r = PageBuf::copy_of(b"xy");
        r.resize_zeroed(5000);
        assert_eq!(&r[..3], b"xy\0");
        assert!(r[2..].iter().all(|&x| x == 0));
        r.resize_zeroed(1);
        assert_eq!(&*r, b"x");
        assert_eq!(&*PageBuf::copy_of(b"abc"), b"abc");
    }

    #[test]
    fn pool_reuses_and_is_bounded() {
        let pool = BufPool::new(8192, 2);
        let mut a = pool.get();
        a.extend_from_slice(&[1; 8192]);
        let addr = a.as_ptr();
        drop(a);
        assert_eq!(pool.free_count(), 1);
        let b = pool.get();
        assert_eq!(b.as_ptr(), addr, "the freed buffer is reused");
        assert!(b.is_empty(), "a reused buffer starts empty");
        let (c, d, e) = (pool.get(), pool.get(), pool.get());
        drop((b, c, d, e));
        assert_eq!(pool.free_count(), 2);
    }

    #[test]
    fn reuse_skips_zeroing_only_where_written_before() {
        let pool = BufPool::new(8192, 1);
        let mut a = pool.get();
        a.extend_from_slice(&[7; 4096]);
        drop(a);
        let mut b = pool.get();
        b.resize_reusing(8192);
        // The first page keeps what it held; the second was never written: zero.
        assert!(b[..4096].iter().all(|&x| x == 7));
        assert!(b[4096..].iter().all(|&x| x == 0));
        b.resize_reusing(2);
        b.resize_zeroed(4);
        assert_eq!(&b[..], &[7, 7, 0, 0]);
        // Growing past the capacity keeps the exposed bytes.
        b.resize_reusing(10_000);
        assert_eq!(&b[..4], &[7, 7, 0, 0]);
        assert!(b[4..].iter().all(|&x| x == 0 || x == 7));
        assert!((b.as_ptr() as usize).is_multiple_of(BUF_ALIGN));
    }

    #[test]
    fn grows_and_stays_aligned() {
        let mut b = PageBuf::with_capacity(4);
        b.extend_from_slice(b"abcd");
        b.extend_from_slice(b"efghij");
        assert_eq!(&*b, b"abcdefghij");
        assert!(b.capacity() >= 10);
        assert!((b.as_ptr() as usize).is_multiple_of(BUF_ALIGN));
        let pool = BufPool::new(8, 4);
        let mut g = pool.get();
        g.extend_from_slice(&[0; 9]);
        drop(g);
        assert_eq!(pool.free_count(), 0, "a grown buffer is not pooled");
    }
}
