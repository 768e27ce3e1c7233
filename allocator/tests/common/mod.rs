//! Shared set-up for the allocator's tests: they run on the fake CUDA driver
//! (`tests/fake-cuda`), loaded through the same `Driver::load` path as the real one.
#![allow(dead_code)]

use std::ffi::CString;
use std::sync::{Arc, OnceLock};

use memsaver_allocator::Allocator;
use memsaver_allocator::driver::Driver;
use parking_lot::{Mutex, MutexGuard};

pub const MIB: usize = 1 << 20;

pub fn fake_lib() -> String {
    std::env::var("MEMSAVER_CUDA_LIB").unwrap_or_else(|_| {
        format!(
            "{}/../target/fake-cuda/libcuda.so.1",
            env!("CARGO_MANIFEST_DIR")
        )
    })
}

pub fn driver() -> Arc<Driver> {
    static D: OnceLock<Arc<Driver>> = OnceLock::new();
    D.get_or_init(|| {
        Arc::new(Driver::load(&fake_lib()).unwrap_or_else(|e| {
            panic!("{e}\nrun the tests with `make test`, which builds the fake driver first")
        }))
    })
    .clone()
}

/// A fresh allocator over the fake driver, for one test. Tests of one file run one at a time
/// (the value holds a lock), because they read device-wide free memory and fault-injection
/// counters that other tests' allocations would disturb.
pub struct TestAllocator {
    // Declared first so the allocator is dropped (its memory freed) before the lock is released.
    alloc: Allocator,
    _serial: MutexGuard<'static, ()>,
}

impl std::ops::Deref for TestAllocator {
    type Target = Allocator;
    fn deref(&self) -> &Allocator {
        &self.alloc
    }
}

pub fn allocator() -> TestAllocator {
    allocator_with(&memsaver_allocator::Options::default())
}

/// Like [`allocator`], with the given options.
pub fn allocator_with(opts: &memsaver_allocator::Options) -> TestAllocator {
    static SERIAL: Mutex<()> = Mutex::new(());
    let _serial = SERIAL.lock();
    TestAllocator {
        alloc: Allocator::with_options(driver(), opts),
        _serial,
    }
}

/// The address of the fake driver's function `function` (panics when there is none).
pub fn fake_fn(function: &str) -> *mut libc::c_void {
    let path = CString::new(fake_lib()).unwrap();
    let name = CString::new(function).unwrap();
    driver();
    // SAFETY: the library is already loaded by `driver()`; RTLD_NOLOAD only returns its handle.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "fake driver not loaded");
        let f = libc::dlsym(h, name.as_ptr());
        assert!(!f.is_null(), "the fake driver has no {function}");
        f
    }
}

/// Calls one of the fake driver's fault-injection functions (`fakecuda_fail_create_at`, ...).
pub fn inject(function: &str, n: u32) {
    // SAFETY: these functions take one u32.
    let f: extern "C" fn(u32) = unsafe { std::mem::transmute(fake_fn(function)) };
    f(n);
}

/// How long a hold of the fake driver's pinning lasts at most: far above any wait a working
/// allocator makes, so only a regression meets it (and then fails instead of hanging).
pub const PIN_HOLD_MS: u64 = 60_000;

/// How the fake driver holds pinning calls (`fakecuda_hold_pinning`).
#[derive(Clone, Copy)]
pub enum PinHold {
    /// Each pinning call waits at its entry, holding nothing, until the hold ends.
    AtEntry = 1,
    /// Each pinning call, once it holds the driver lock, keeps it until a call of another
    /// thread waits behind it.
    UntilWaited = 2,
}

/// The fake driver's pinning held as [`PinHold`] says, for at most [`PIN_HOLD_MS`], until
/// dropped. Declare it after the allocator, so that it is dropped first: the allocator's drop
/// joins its preparation thread.
pub struct HeldPinning(());

impl HeldPinning {
    pub fn new(how: PinHold) -> Self {
        hold_pinning(how as u32, PIN_HOLD_MS);
        Self(())
    }

    /// Changes how pinning is held (a held call waiting at its entry is let go by a change
    /// to `UntilWaited`).
    pub fn switch(&self, how: PinHold) {
        hold_pinning(how as u32, PIN_HOLD_MS);
    }
    /// While held at the entry: lets `n` pinning calls go on, those waiting now first (they
    /// stop counting as held at once), then the next to arrive; the others stay held.
    pub fn pass(&self, n: u64) {
        // SAFETY: the function's C signature.
        let f: extern "C" fn(u64) -> libc::c_int =
            unsafe { std::mem::transmute(fake_fn("fakecuda_pass_pinning")) };
        assert_eq!(f(n), 0);
    }
}

impl Drop for HeldPinning {
    fn drop(&mut self) {
        hold_pinning(0, 0);
    }
}

fn hold_pinning(mode: u32, ms: u64) {
    // SAFETY: the function's C signature.
    let f: extern "C" fn(u32, u64) -> libc::c_int =
        unsafe { std::mem::transmute(fake_fn("fakecuda_hold_pinning")) };
    assert_eq!(f(mode, ms), 0, "hold mode {mode}");
}

/// Waits until at least `n` pinning calls wait at their entry (or [`PIN_HOLD_MS`] pass);
/// returns how many do.
pub fn wait_pinning_held(n: u64) -> u64 {
    // SAFETY: the function's C signature.
    let f: extern "C" fn(u64, u64) -> u64 =
        unsafe { std::mem::transmute(fake_fn("fakecuda_wait_pinning_held")) };
    f(n, PIN_HOLD_MS)
}

/// The fake driver's figures of held pinning (`fakecuda_pin_hold_stats`): pinning calls
/// waiting at their entry now, and pinning calls a hold's deadline let go.
pub fn fake_pin_hold() -> [u64; 2] {
    fake_figures("fakecuda_pin_hold_stats")
}

/// The fake driver's own counts of calls by kind (`fakecuda_call_counts`), in the order of
/// [`memsaver_allocator::driver::CALL_KINDS`], which is the fake's order too.
pub fn fake_calls() -> [u64; memsaver_allocator::driver::CALL_KINDS.len()] {
    fake_figures("fakecuda_call_counts")
}

/// The fake driver's figures of copies by their host side (`fakecuda_host_copy_stats`): copies
/// through registered memory, copies through pageable memory, host ranges registered now.
pub fn fake_host_copies() -> [u64; 3] {
    fake_figures("fakecuda_host_copy_stats")
}

/// Waits until `f()` holds, polling (or [`PIN_HOLD_MS`] pass: then a regression fails instead
/// of hanging); returns whether it held.
pub fn wait_until(f: impl Fn() -> bool) -> bool {
    let until = std::time::Instant::now() + std::time::Duration::from_millis(PIN_HOLD_MS);
    while !f() {
        if std::time::Instant::now() >= until {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    true
}

/// The fake driver's pinning figures (`fakecuda_pin_stats`): pinning calls, the largest one
/// (bytes), calls that waited behind one, the largest pinning call another call waited behind.
pub fn fake_pinning() -> [u64; 4] {
    fake_figures("fakecuda_pin_stats")
}

/// The figures of one of the fake driver's `fakecuda_*(out, n) -> count` functions; there must
/// be exactly `N` of them.
fn fake_figures<const N: usize>(function: &str) -> [u64; N] {
    let mut out = [0u64; N];
    // SAFETY: these functions write at most `n` figures and return how many they have.
    let f: extern "C" fn(*mut u64, usize) -> usize =
        unsafe { std::mem::transmute(fake_fn(function)) };
    assert_eq!(f(out.as_mut_ptr(), N), N, "{function} gives other figures");
    out
}

/// The count of `kind` (a name of `CALL_KINDS`) in `counts`.
pub fn kind(counts: &[u64], kind: &str) -> u64 {
    let i = memsaver_allocator::driver::CALL_KINDS
        .iter()
        .position(|k| *k == kind)
        .unwrap_or_else(|| panic!("no call kind {kind}"));
    counts[i]
}

/// On the fake driver device memory is host memory at the same address, so tests can read
/// and write it directly.
pub fn fill(ptr: u64, len: usize, seed: u8) {
    // SAFETY: `ptr..ptr+len` is a resident allocation mapped read-write by the fake driver.
    let s = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
    for (i, b) in s.iter_mut().enumerate() {
        *b = seed.wrapping_add((i / 4096) as u8).wrapping_mul(31) ^ (i as u8);
    }
}

pub fn check(ptr: u64, len: usize, seed: u8) -> bool {
    // SAFETY: as in `fill`.
    let s = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
    s.iter()
        .enumerate()
        .all(|(i, b)| *b == seed.wrapping_add((i / 4096) as u8).wrapping_mul(31) ^ (i as u8))
}

pub fn free_bytes(a: &Allocator, device: i32) -> usize {
    a.device_memory(device).unwrap().0
}

/// The fake driver's `cuMemMap` calls held at their entry (`fakecuda_hold_map`) for at most
/// [`PIN_HOLD_MS`], until dropped. The hold is process-wide: a test that takes it runs alone in
/// its test binary.
pub struct HeldMaps(());

impl HeldMaps {
    pub fn new() -> Self {
        hold_map(PIN_HOLD_MS);
        Self(())
    }

    /// Waits until at least `n` maps are held (or [`PIN_HOLD_MS`] pass); returns how many are.
    pub fn wait_held(&self, n: u64) -> u64 {
        // SAFETY: the function's C signature.
        let f: extern "C" fn(u64, u64) -> u64 =
            unsafe { std::mem::transmute(fake_fn("fakecuda_wait_map_held")) };
        f(n, PIN_HOLD_MS)
    }
}

impl Drop for HeldMaps {
    fn drop(&mut self) {
        hold_map(0);
    }
}

fn hold_map(ms: u64) {
    // SAFETY: the function's C signature.
    let f: extern "C" fn(u64) -> libc::c_int =
        unsafe { std::mem::transmute(fake_fn("fakecuda_hold_map")) };
    assert_eq!(f(ms), 0);
}
