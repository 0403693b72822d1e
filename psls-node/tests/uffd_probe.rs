//! Probe of the kernel's userfaultfd behaviour on shmem that the fault service relies on.
use std::os::fd::AsRawFd;
use userfaultfd::{Event, FaultKind, ReadWrite, RegisterMode, UffdBuilder};

const PAGE: usize = 4096;

#[repr(C)]
struct UffdioContinue {
    start: u64,
    len: u64,
    mode: u64,
    mapped: i64,
}
const UFFDIO_CONTINUE_MODE_WP: u64 = 1 << 1;

fn cont(fd: i32, addr: usize, wp: bool) -> i64 {
    let mut c = UffdioContinue {
        start: addr as u64,
        len: PAGE as u64,
        mode: if wp { UFFDIO_CONTINUE_MODE_WP } else { 0 },
        mapped: 0,
    };
    let r = unsafe { libc::ioctl(fd, userfaultfd_sys::UFFDIO_CONTINUE as _, &mut c) };
    if r < 0 {
        -(std::io::Error::last_os_error().raw_os_error().unwrap() as i64)
    } else {
        c.mapped
    }
}

#[test]
fn kernel_userfaultfd_behaviour_the_fault_service_relies_on() {
    let memfd = nix::sys::memfd::memfd_create("probe", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
    let file = std::fs::File::from(memfd);
    file.set_len(4 * PAGE as u64).unwrap();
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
    eprintln!("register: {r:?}");
    r.unwrap();
    let b = base as usize;
    let toucher = std::thread::spawn(move || {
        let p = b as *mut u8;
        unsafe {
            let v = std::ptr::read_volatile(p); // read fault, page absent: MISSING
            eprintln!("toucher read {v}");
            std::ptr::write_volatile(p, 7); // write on WP page: WP fault
            eprintln!("toucher wrote");
            let v = std::ptr::read_volatile(p.add(PAGE)); // page 1: present in cache (pwrite) -> MINOR
            eprintln!("toucher read page1 {v}");
            std::ptr::write_volatile(p.add(2 * PAGE), 9); // page 2 absent, write -> MISSING write
            eprintln!("toucher wrote page2");
            let v = std::ptr::read_volatile(p); // after punch: MISSING again
            eprintln!("toucher read page0 after punch {v}");
        }
    });
    use std::os::unix::fs::FileExt;
    let fd = uffd.as_raw_fd();
    for step in 0..5 {
        let ev = uffd.read_event().unwrap().unwrap();
        eprintln!("event {step}: {ev:?}");
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
                eprintln!("continue wp: {}", cont(fd, a, true));
            }
            1 => {
                assert_eq!(kind, FaultKind::WriteProtected);
                uffd.remove_write_protection(a as _, PAGE, true).unwrap();
            }
            2 => {
                assert_eq!(kind, FaultKind::Minor);
                eprintln!("continue: {}", cont(fd, a, true));
                eprintln!("continue again (EEXIST expected): {}", cont(fd, a, true));
            }
            3 => {
                assert_eq!(kind, FaultKind::Missing);
                assert_eq!(rw, ReadWrite::Write);
                file.write_all_at(&[44u8; PAGE], 2 * PAGE as u64).unwrap();
                // Punch page 0 (it is mapped writable in the toucher).
                let r = unsafe {
                    libc::fallocate(
                        file.as_raw_fd(),
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        0,
                        PAGE as i64,
                    )
                };
                assert_eq!(r, 0);
                eprintln!("continue rw: {}", cont(fd, a, false));
            }
            4 => {
                assert_eq!(kind, FaultKind::Missing);
                file.write_all_at(&[45u8; PAGE], 0).unwrap();
                eprintln!("continue: {}", cont(fd, a, true));
            }
            _ => unreachable!(),
        }
    }
    toucher.join().unwrap();
    let mut b0 = [0u8; 1];
    file.read_exact_at(&mut b0, 0).unwrap();
    eprintln!("page0 byte {:?}", b0);
}
