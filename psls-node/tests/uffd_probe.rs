//! Probe of the kernel's userfaultfd behaviour on shmem that the fault service relies on.
use std::os::fd::AsRawFd;
use userfaultfd::{Event, FaultKind, ReadWrite, RegisterMode, UffdBuilder};

const PAGE: usize = 4096;

fn cont(uffd: &userfaultfd::Uffd, addr: usize, wp: bool) -> i64 {
    match psls_node::svm::continue_page(uffd, addr, wp) {
        Ok(()) => PAGE as i64,
        Err(e) => -(e.raw_os_error().unwrap_or(0) as i64),
    }
}

#[test]
fn kernel_userfaultfd_behaviour_the_fault_service_relies_on() {
    let memfd = nix::sys::memfd::memfd_create("probe", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    let file = std::fs::File::from(memfd);
    file.set_len(4 * PAGE as u64).unwrap();
    // SAFETY: a fresh shared mapping of a memfd this test owns; nothing else maps that range.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4 * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let uffd = UffdBuilder::new()
        .close_on_exec(true)
        .user_mode_only(false)
        .create()
        .unwrap();
    let r = uffd.register_with_mode(
        base,
        4 * PAGE,
        RegisterMode::MISSING | RegisterMode::MINOR | RegisterMode::WRITE_PROTECT,
    );
    r.unwrap();
    let b = base as usize;
    let toucher = std::thread::spawn(move || {
        // SAFETY: volatile accesses to bytes of the four mapped pages, which stay mapped until
        // the test ends.
        unsafe {
            let p = b as *mut u8;
            let first = std::ptr::read_volatile(p); // read fault, page absent: MISSING
            std::ptr::write_volatile(p, 7); // write on a write-protected page: WP fault
            let second = std::ptr::read_volatile(p.add(PAGE)); // page 1 in the memfd already: MINOR
            std::ptr::write_volatile(p.add(2 * PAGE), 9); // page 2 absent, a write: MISSING
            let after_punch = std::ptr::read_volatile(p); // page 0 punched out: MISSING again
            (first, second, after_punch)
        }
    });
    use std::os::unix::fs::FileExt;
    for step in 0..5 {
        let ev = uffd.read_event().unwrap().unwrap();
        let Event::Pagefault { kind, rw, addr, .. } = ev else {
            panic!()
        };
        let a = addr as usize & !(PAGE - 1);
        match step {
            0 => {
                assert_eq!(kind, FaultKind::Missing);
                assert_eq!(rw, ReadWrite::Read);
                file.write_all_at(&[42u8; PAGE], 0).unwrap();
                file.write_all_at(&[43u8; PAGE], PAGE as u64).unwrap();
                assert_eq!(
                    cont(&uffd, a, true),
                    PAGE as i64,
                    "CONTINUE resolves a missing fault once the page is in the memfd"
                );
            }
            1 => {
                assert_eq!(kind, FaultKind::WriteProtected);
                uffd.remove_write_protection(a as _, PAGE, true).unwrap();
            }
            2 => {
                assert_eq!(kind, FaultKind::Minor);
                assert_eq!(cont(&uffd, a, true), PAGE as i64);
                assert_eq!(
                    cont(&uffd, a, true),
                    -(libc::EEXIST as i64),
                    "a second CONTINUE is a benign EEXIST"
                );
            }
            3 => {
                assert_eq!(kind, FaultKind::Missing);
                assert_eq!(rw, ReadWrite::Write);
                file.write_all_at(&[44u8; PAGE], 2 * PAGE as u64).unwrap();
                // Punch page 0 (it is mapped writable in the toucher).
                // SAFETY: fallocate on a descriptor this test owns; no memory is touched.
                let r = unsafe {
                    libc::fallocate(
                        file.as_raw_fd(),
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        0,
                        PAGE as i64,
                    )
                };
                assert_eq!(r, 0);
                assert_eq!(cont(&uffd, a, false), PAGE as i64);
            }
            4 => {
                assert_eq!(kind, FaultKind::Missing);
                file.write_all_at(&[45u8; PAGE], 0).unwrap();
                assert_eq!(cont(&uffd, a, true), PAGE as i64);
            }
            _ => unreachable!(),
        }
    }
    let (first, second, after_punch) = toucher.join().unwrap();
    assert_eq!(
        (first, second, after_punch),
        (42, 43, 45),
        "each access saw the page installed for it"
    );
    let mut b0 = [0u8; 1];
    file.read_exact_at(&mut b0, 0).unwrap();
    assert_eq!(b0, [45], "the memfd holds what was installed");
}
