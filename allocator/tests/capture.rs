//! A stream capture in global mode (torch's CUDA graphs) is invalidated by a call that is unsafe
//! during a capture, such as pinning host memory, from any thread not in relaxed capture mode.
//! Backups are prepared in the background at any time, so the preparation thread is relaxed.
//! On the fake driver, which stands for the capture (`fakecuda_global_capture`) and counts the
//! captures invalidated; in a process of its own (this test binary), since the capture is the
//! whole process's.

mod common;

use common::*;
use memsaver_allocator::Policy;
use memsaver_allocator::backup::PIN_CHUNK;

fn global_capture(on: bool) {
    // SAFETY: the function's C signature.
    let f: extern "C" fn(libc::c_int) -> libc::c_int =
        unsafe { std::mem::transmute(fake_fn("fakecuda_global_capture")) };
    assert_eq!(f(libc::c_int::from(on)), 0);
}

fn captures_invalidated() -> u64 {
    // SAFETY: the function's C signature.
    let f: extern "C" fn() -> u64 =
        unsafe { std::mem::transmute(fake_fn("fakecuda_captures_invalidated")) };
    f()
}

#[test]
fn backups_are_prepared_during_a_capture_without_invalidating_it() {
    let a = allocator();
    global_capture(true);
    let p = a
        .malloc(2 * PIN_CHUNK, 0, "during_capture", Policy::Cpu)
        .unwrap();
    a.wait_backups_prepared(std::time::Duration::from_secs(120))
        .expect("backups prepared within 120 s");
    let u = a.stats().tag("during_capture").unwrap().usage;
    assert_eq!(
        (u.prepared_backup_bytes, captures_invalidated()),
        ((2 * PIN_CHUNK) as u64, 0),
        "prepared while the capture ran, and the capture intact"
    );
    // The rule the preparation thread escapes: this thread, in global mode, may not pin.
    let d = a.driver();
    let ctx = d.primary_context(0).unwrap();
    let e = d.with_context(ctx, || d.host_alloc(4096)).unwrap_err();
    assert_eq!(
        (e.code, captures_invalidated()),
        (
            memsaver_allocator::driver::sys::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            1
        )
    );
    global_capture(false);
    a.free(p).unwrap();
}
