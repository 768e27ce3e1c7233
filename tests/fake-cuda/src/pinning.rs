//! Pinned host memory and the driver lock it holds.
//!
//! Measured on an H100 (driver 580): while one thread pins host memory (`cuMemHostAlloc`,
//! `cuMemAllocHost`, `cudaHostAlloc`, `cuMemHostRegister`), the process's other driver calls
//! on other threads (`cuMemCreate`/`cuMemMap`, kernel launches and synchronisation) wait until
//! it returns, for a time that grows with the bytes pinned: a 1 GiB `cuMemHostAlloc` held a
//! 2 MiB device allocation for 1.29 s. So the fake has one lock per process that every entry
//! point takes shared and a pinning call takes exclusive, for `FAKE_CUDA_PIN_MS_PER_GIB`
//! (default 100) per GiB. What the tests read is not time but counts: how many pinning calls,
//! the largest one, how many calls of other threads waited behind one, and the largest pinning
//! call anybody waited behind (`fakecuda_pin_stats`).
//!
//! A test that must order the application's calls against a pinning call without timing them
//! holds pinning (`fakecuda_hold_pinning`): either every pinning call waits at its entry, before
//! it takes the driver lock, until the test lets it go (so preparation is in progress and holds
//! nothing back: a call that waits for it would wait until the hold ends), or each one, once it
//! holds the lock, keeps it until a call of another thread waits behind it (so the application
//! runs into every pinning call, deterministically). Each hold ends by itself after a deadline
//! the test gives, so a regression fails the test instead of hanging it; a call let go by the
//! deadline is counted (`fakecuda_pin_hold_stats`).
//!
//! Registrations (`cuMemHostRegister`) are a table of host ranges. As on the real driver, a
//! copy whose host side crosses from one registration into another (or out of one) fails with
//! `CUDA_ERROR_INVALID_VALUE` (a 1 GiB `cuMemcpyDtoHAsync` into one mapping registered in 4 MiB
//! pieces did, on an H100); pageable memory that no registration touches is accepted (the real
//! driver stages such a copy and returns once the host side is done with). Copies are counted
//! by what their host side was, registered or pageable, with the registrations live now
//! (`fakecuda_host_copy_stats`).
//!
//! A test may also let exactly `n` held pinning calls go while the hold stays
//! (`fakecuda_pass_pinning`), to step a background pinner one call at a time.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use memsaver_allocator::driver::sys::{CUDA_ERROR_INVALID_VALUE, CUresult};
use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
const ALREADY_REGISTERED: CUresult = 712;
/// `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`.
const NOT_REGISTERED: CUresult = 713;

/// The driver lock of this process.
static DRIVER: RwLock<()> = RwLock::new(());
/// Bytes of the pinning call holding the lock now (0: none).
static PINNING: AtomicUsize = AtomicUsize::new(0);

/// `fakecuda_pin_stats`, in its order.
static PIN_CALLS: AtomicU64 = AtomicU64::new(0);
static LARGEST_PIN: AtomicU64 = AtomicU64::new(0);
static WAITS: AtomicU64 = AtomicU64::new(0);
static LARGEST_WAITED_BEHIND: AtomicU64 = AtomicU64::new(0);
/// How many figures `fakecuda_pin_stats` gives.
pub const STATS: usize = 4;

/// Calls of other threads waiting behind a pinning call now.
static BLOCKED: AtomicUsize = AtomicUsize::new(0);

/// How pinning calls are held (`fakecuda_hold_pinning`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Hold {
    /// Not held: a pinning call takes the lock as soon as it can.
    Free,
    /// Each pinning call waits at its entry, holding nothing, until the hold ends.
    AtEntry,
    /// Each pinning call, once it holds the lock, keeps it until a call of another thread
    /// waits behind it.
    UntilWaited,
}

struct Holding {
    hold: Hold,
    /// When the hold ends by itself.
    deadline: Instant,
    /// Pinning calls waiting at their entry now (not counting those let go by [`pass`] that
    /// have not woken yet).
    at_entry: u64,
    /// Pinning calls that went on because the deadline passed, not because the hold ended.
    let_go_by_deadline: u64,
    /// Calls waiting at their entry that [`pass`] let go and that have not woken yet.
    tickets: u64,
    /// Calls still to arrive that [`pass`] lets go (`AtEntry` only).
    passes: u64,
}

static HOLDING: Mutex<Option<Holding>> = Mutex::new(None);
/// Signalled when the hold changes, a call arrives at the entry, or a call waits behind a
/// pinning call.
static HOLD_CHANGED: Condvar = Condvar::new();
/// How many figures `fakecuda_pin_hold_stats` gives.
pub const HOLD_STATS: usize = 2;

fn holding<R>(f: impl FnOnce(&mut Holding) -> R) -> R {
    let mut h = HOLDING.lock();
    f(h.get_or_insert_with(|| Holding {
        hold: Hold::Free,
        deadline: Instant::now(),
        at_entry: 0,
        let_go_by_deadline: 0,
        tickets: 0,
        passes: 0,
    }))
}

/// Holds pinning calls as `hold` says for at most `ms` from now (`Hold::Free` ends a hold and
/// lets every held call go).
pub fn hold(hold: Hold, ms: u64) {
    holding(|h| {
        h.hold = hold;
        h.deadline = Instant::now() + Duration::from_millis(ms);
        h.passes = 0;
    });
    HOLD_CHANGED.notify_all();
}

/// While pinning is held at the entry, lets `n` pinning calls go on: those waiting there now
/// first (they stop counting as waiting at once), then the next ones to arrive; the hold stays
/// for the others.
pub fn pass(n: u64) {
    holding(|h| {
        let now = n.min(h.at_entry);
        h.at_entry -= now;
        h.tickets += now;
        h.passes += n - now;
    });
    HOLD_CHANGED.notify_all();
}

/// Waits until at least `n` pinning calls wait at their entry, or `ms` pass; returns how many
/// do.
pub fn wait_held(n: u64, ms: u64) -> u64 {
    let until = Instant::now() + Duration::from_millis(ms);
    let mut g = HOLDING.lock();
    loop {
        let now = g.as_ref().map_or(0, |h| h.at_entry);
        if now >= n || HOLD_CHANGED.wait_until(&mut g, until).timed_out() {
            return g.as_ref().map_or(0, |h| h.at_entry);
        }
    }
}

/// `fakecuda_pin_hold_stats`: pinning calls waiting at their entry now, and pinning calls the
/// deadline let go.
pub fn read_hold(out: &mut [u64]) {
    let all = holding(|h| [h.at_entry, h.let_go_by_deadline]);
    for (o, c) in out.iter_mut().zip(all) {
        *o = c;
    }
}

/// Waits while `held` says the call is held and the deadline has not passed; counts a call
/// the deadline lets go.
fn wait_while(held: impl Fn(&Holding) -> bool) {
    let mut g = HOLDING.lock();
    loop {
        let Some(h) = g.as_mut() else { return };
        if !held(h) {
            return;
        }
        if Instant::now() >= h.deadline {
            h.let_go_by_deadline += 1;
            return;
        }
        let deadline = h.deadline;
        HOLD_CHANGED.wait_until(&mut g, deadline);
    }
}

/// A pinning call's entry: waits while pinning is held there, unless [`pass`] lets it go.
fn enter() {
    let arrived = holding(|h| {
        if h.hold != Hold::AtEntry {
            return false;
        }
        if h.passes > 0 {
            h.passes -= 1;
            return false;
        }
        h.at_entry += 1;
        true
    });
    if !arrived {
        return;
    }
    HOLD_CHANGED.notify_all();
    wait_while(|h| h.hold == Hold::AtEntry && h.tickets == 0);
    holding(|h| {
        if h.tickets > 0 {
            // Let go by `pass`, which stopped counting it already.
            h.tickets -= 1;
        } else {
            h.at_entry -= 1;
        }
    });
}

/// Registered host ranges: start -> length.
static REGISTERED: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// `fakecuda_host_copy_stats`, in its order (the third, registrations now, is read from
/// [`REGISTERED`]).
static COPIES_REGISTERED: AtomicU64 = AtomicU64::new(0);
static COPIES_PAGEABLE: AtomicU64 = AtomicU64::new(0);
/// How many figures `fakecuda_host_copy_stats` gives.
pub const COPY_STATS: usize = 3;

/// `fakecuda_host_copy_stats`: copies whose host side lay in one registration, copies whose
/// host side touched none (pageable memory, which the real driver accepts: it stages the copy
/// and returns once the host side is done with), and host ranges registered now.
pub fn read_copies(out: &mut [u64]) {
    let all = [
        COPIES_REGISTERED.load(Ordering::Relaxed),
        COPIES_PAGEABLE.load(Ordering::Relaxed),
        REGISTERED.lock().len() as u64,
    ];
    for (o, c) in out.iter_mut().zip(all) {
        *o = c;
    }
}

/// Held by every entry point but the pinning ones for the length of the call.
pub struct Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>);

/// Takes the lock shared, counting a wait when a pinning call holds it. Recursive (an entry
/// point may reach another), so a pinning call waiting for the lock does not block readers
/// that arrive meanwhile; one holding it does.
pub fn shared() -> Shared {
    if let Some(g) = DRIVER.try_read_recursive() {
        return Shared(g);
    }
    // The pinning call records its size as waited behind when it ends ([`Exclusive`]): here it
    // may still be waiting for other readers to leave, its size not yet known.
    WAITS.fetch_add(1, Ordering::Relaxed);
    BLOCKED.fetch_add(1, Ordering::SeqCst);
    {
        // Under the hold's lock, so a pinning call that found nobody waiting is already
        // waiting for this signal.
        let _h = HOLDING.lock();
        HOLD_CHANGED.notify_all();
    }
    let g = DRIVER.read_recursive();
    BLOCKED.fetch_sub(1, Ordering::SeqCst);
    Shared(g)
}

/// Held by a pinning call of `bytes` for as long as the driver would take to pin them.
pub struct Exclusive(#[allow(dead_code)] RwLockWriteGuard<'static, ()>);

impl Drop for Exclusive {
    /// Before the lock is released: a call blocked now waited behind this one.
    fn drop(&mut self) {
        let bytes = PINNING.swap(0, Ordering::Relaxed);
        if BLOCKED.load(Ordering::SeqCst) > 0 {
            LARGEST_WAITED_BEHIND.fetch_max(bytes as u64, Ordering::Relaxed);
        }
    }
}

/// Takes the lock exclusive for a pinning call of `bytes` and holds it for the modelled time
/// (after the hold, if pinning is held).
pub fn exclusive(bytes: usize, ms_per_gib: u64) -> Exclusive {
    enter();
    let g = DRIVER.write();
    PINNING.store(bytes.max(1), Ordering::Relaxed);
    PIN_CALLS.fetch_add(1, Ordering::Relaxed);
    LARGEST_PIN.fetch_max(bytes as u64, Ordering::Relaxed);
    wait_while(|h| h.hold == Hold::UntilWaited && BLOCKED.load(Ordering::SeqCst) == 0);
    let nanos = (bytes as u128 * ms_per_gib as u128 * 1_000_000) >> 30;
    std::thread::sleep(Duration::from_nanos(nanos.min(u64::MAX as u128) as u64));
    Exclusive(g)
}

/// `fakecuda_pin_stats`: pinning calls, the largest one in bytes, calls that waited behind
/// one, and the largest pinning call (bytes) that another call waited behind.
pub fn read(out: &mut [u64]) {
    let all = [&PIN_CALLS, &LARGEST_PIN, &WAITS, &LARGEST_WAITED_BEHIND];
    for (o, c) in out.iter_mut().zip(all) {
        *o = c.load(Ordering::Relaxed);
    }
}

pub fn reset() {
    for c in [&PIN_CALLS, &LARGEST_PIN, &WAITS, &LARGEST_WAITED_BEHIND] {
        c.store(0, Ordering::Relaxed);
    }
}

/// `cuMemHostRegister`: `[p, p + bytes)` must not overlap a registration.
pub fn register(p: *mut c_void, bytes: usize) -> Result<(), CUresult> {
    if p.is_null() || bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let start = p as usize;
    let end = start.checked_add(bytes).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut r = REGISTERED.lock();
    let before = r.range(..end).next_back();
    if before.is_some_and(|(&s, &n)| s + n > start) {
        return Err(ALREADY_REGISTERED);
    }
    let limit = crate::faults::REGISTER_LIMIT.load(Ordering::Relaxed);
    if limit > 0 && r.values().sum::<usize>() as u64 + bytes as u64 > limit {
        return Err(memsaver_allocator::driver::sys::CUDA_ERROR_OUT_OF_MEMORY);
    }
    r.insert(start, bytes);
    Ok(())
}

/// `cuMemHostUnregister`: `p` must be the start of a registration.
pub fn unregister(p: *mut c_void) -> Result<(), CUresult> {
    REGISTERED
        .lock()
        .remove(&(p as usize))
        .map(drop)
        .ok_or(NOT_REGISTERED)
}

/// Whether `[p, p + bytes)` is registered throughout (in one registration or in several that
/// follow each other): what a kernel may touch.
pub fn registered(p: usize, bytes: usize) -> bool {
    let Some(end) = p.checked_add(bytes) else {
        return false;
    };
    let r = REGISTERED.lock();
    let mut at = p;
    while at < end {
        match r.range(..=at).next_back() {
            Some((&s, &n)) if s + n > at => at = s + n,
            _ => return false,
        }
    }
    true
}

/// The host side of a copy: `[p, p + bytes)` lies in one registration or touches none
/// (counted as such, for `fakecuda_host_copy_stats`).
pub fn check_host_side(p: *const c_void, bytes: usize) -> Result<(), CUresult> {
    let start = p as usize;
    let end = start.checked_add(bytes).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let r = REGISTERED.lock();
    let mut touching = r.range(..end).rev().take_while(|&(&s, &n)| s + n > start);
    let counter = match (touching.next(), touching.next()) {
        (None, _) => &COPIES_PAGEABLE,
        (Some((&s, &n)), None) if s <= start && end <= s + n => &COPIES_REGISTERED,
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    counter.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_may_not_cross_registrations() {
        let mut buf = vec![0u8; 4 << 12];
        let base = buf.as_mut_ptr() as usize;
        let at = |off: usize| (base + off) as *mut c_void;
        register(at(0), 2 << 12).unwrap();
        register(at(2 << 12), 2 << 12).unwrap();
        assert_eq!(register(at(4096), 4096), Err(ALREADY_REGISTERED));
        assert_eq!(check_host_side(at(0), 2 << 12), Ok(()));
        assert_eq!(check_host_side(at(4096), 4096), Ok(()));
        assert_eq!(
            check_host_side(at(4096), 2 << 12),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        // Out of a registration into unregistered memory.
        assert_eq!(
            check_host_side(at(2 << 12), 3 << 12),
            Err(CUDA_ERROR_INVALID_VALUE)
        );
        assert_eq!(check_host_side(at(4 << 12), 4096), Ok(()), "pageable");
        unregister(at(0)).unwrap();
        unregister(at(2 << 12)).unwrap();
        assert_eq!(unregister(at(0)), Err(NOT_REGISTERED));
        drop(buf);
    }
}
