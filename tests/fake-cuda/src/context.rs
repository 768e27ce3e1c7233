//! Initialisation, devices, primary contexts and the per-thread context stack, streams and
//! events. Contexts, streams and events are opaque tokens: nothing behind them runs
//! asynchronously (every copy completes before it returns), so they only need validating.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use memsaver_allocator::driver::sys::{
    CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_LAUNCH_FAILED, CUDA_ERROR_NO_DEVICE,
    CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_UNKNOWN, CUcontext, CUdevice, CUevent, CUresult,
    CUstream,
};
use parking_lot::Mutex;

use crate::config::{self, Config, MAX_DEVICES};
use crate::physical;

/// Set once `cuInit` has succeeded.
static INITIALISED: AtomicBool = AtomicBool::new(false);

/// The primary context of device `d` is the address of `PRIMARY_CTX[d]`: stable, non-null,
/// distinct per device, and never dereferenced by anyone.
static PRIMARY_CTX: [u8; MAX_DEVICES] = [0; MAX_DEVICES];

thread_local! {
    /// The calling thread's context stack (device ordinals; the top is the current context).
    static CTX_STACK: RefCell<Vec<CUdevice>> = const { RefCell::new(Vec::new()) };
}

/// `cuInit(flags)`: reads the knobs and prepares the shared store.
pub fn init(flags: u32) -> Result<(), CUresult> {
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let cfg = config::get().map_err(|msg| {
        report_once(&format!("fake-cuda: bad knob: {msg}"));
        CUDA_ERROR_INVALID_VALUE
    })?;
    if cfg.devices == 0 {
        return Err(CUDA_ERROR_NO_DEVICE);
    }
    physical::prepare(cfg).map_err(|err| {
        report_once(&format!(
            "fake-cuda: cannot prepare {}: {err}",
            cfg.dir.display()
        ));
        CUDA_ERROR_UNKNOWN
    })?;
    INITIALISED.store(true, Ordering::Release);
    Ok(())
}

/// Tells the user (on stderr, once per process) why initialisation failed; a bare error code
/// would leave them guessing which knob is wrong.
fn report_once(msg: &str) {
    static REPORTED: AtomicBool = AtomicBool::new(false);
    if !REPORTED.swap(true, Ordering::Relaxed) {
        eprintln!("{msg}");
    }
}

/// The configuration, or `CUDA_ERROR_NOT_INITIALIZED` before a successful `cuInit`.
pub fn initialised() -> Result<&'static Config, CUresult> {
    if !INITIALISED.load(Ordering::Acquire) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    config::get().map_err(|_| CUDA_ERROR_NOT_INITIALIZED)
}

/// Validates a device ordinal.
pub fn device(cfg: &Config, ordinal: CUdevice) -> Result<CUdevice, CUresult> {
    if (0..cfg.devices).contains(&ordinal) {
        Ok(ordinal)
    } else {
        Err(CUDA_ERROR_INVALID_DEVICE)
    }
}

pub fn primary_context(dev: CUdevice) -> CUcontext {
    // Only the address is used; the byte is never written through it.
    PRIMARY_CTX[dev as usize..]
        .as_ptr()
        .cast::<c_void>()
        .cast_mut()
}

/// The device of a context token; `CUDA_ERROR_INVALID_CONTEXT` for anything else.
pub fn context_device(cfg: &Config, ctx: CUcontext) -> Result<CUdevice, CUresult> {
    let base = PRIMARY_CTX.as_ptr() as usize;
    let offset = (ctx as usize).wrapping_sub(base);
    if ctx.is_null() || offset >= cfg.devices as usize {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    Ok(offset as CUdevice)
}

pub fn push_current(dev: CUdevice) {
    CTX_STACK.with_borrow_mut(|s| s.push(dev));
}

pub fn pop_current() -> Result<CUdevice, CUresult> {
    CTX_STACK
        .with_borrow_mut(|s| s.pop())
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

/// `cuCtxSetCurrent`: replaces the top of the stack; `None` unbinds (pops) it.
pub fn set_current(dev: Option<CUdevice>) {
    CTX_STACK.with_borrow_mut(|s| match dev {
        Some(d) => match s.last_mut() {
            Some(top) => *top = d,
            None => s.push(d),
        },
        None => {
            s.pop();
        }
    });
}

/// The current context's device, or `CUDA_ERROR_INVALID_CONTEXT` when the calling thread has
/// none: like the real driver, calls that work "in the current context" (copies, streams,
/// events, pinned host memory, memory info) refuse to run without one.
pub fn require_current() -> Result<CUdevice, CUresult> {
    current().ok_or(CUDA_ERROR_INVALID_CONTEXT)
}

pub fn current() -> Option<CUdevice> {
    CTX_STACK.with_borrow(|s| s.last().copied())
}

/// Per-device stack size limit (`cuCtxSetLimit`), per process; the real driver's default.
static STACK_SIZES: Mutex<BTreeMap<CUdevice, usize>> = Mutex::new(BTreeMap::new());
const DEFAULT_STACK_SIZE: usize = 1024;

pub fn stack_size(dev: CUdevice) -> usize {
    *STACK_SIZES.lock().get(&dev).unwrap_or(&DEFAULT_STACK_SIZE)
}

pub fn set_stack_size(dev: CUdevice, bytes: usize) {
    STACK_SIZES.lock().insert(dev, bytes);
}

/// Devices whose context was lost (a graph launched below its stack limit): sticky.
static LOST: [AtomicBool; MAX_DEVICES] = [const { AtomicBool::new(false) }; MAX_DEVICES];

/// Marks the context of `dev` lost: every later call in it fails.
pub fn lose(dev: CUdevice) {
    LOST[dev as usize].store(true, Ordering::Relaxed);
}

/// `CUDA_ERROR_LAUNCH_FAILED` once the context of `dev` is lost.
pub fn alive(dev: CUdevice) -> Result<(), CUresult> {
    if LOST[dev as usize].load(Ordering::Relaxed) {
        Err(CUDA_ERROR_LAUNCH_FAILED)
    } else {
        Ok(())
    }
}

/// [`alive`] for the calling thread's current context, if it has one.
pub fn current_alive() -> Result<(), CUresult> {
    current().map_or(Ok(()), alive)
}

/// Registry of live streams and events, so that a destroyed or made-up one is rejected.
pub struct Tokens {
    /// Guards the set of live token addresses of one kind.
    live: Mutex<BTreeSet<usize>>,
    /// Base address of this kind's tokens (never dereferenced).
    base: usize,
}

/// The next token number, shared by streams and events so that no two tokens are equal.
static NEXT_TOKEN: AtomicUsize = AtomicUsize::new(1);

pub static STREAMS: Tokens = Tokens::new(0x5757_0000_0000);
pub static EVENTS: Tokens = Tokens::new(0xe7e7_0000_0000);

impl Tokens {
    pub const fn new(base: usize) -> Self {
        Self {
            live: Mutex::new(BTreeSet::new()),
            base,
        }
    }

    pub fn create(&self) -> *mut c_void {
        let addr = self.base + 16 * NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        self.live.lock().insert(addr);
        std::ptr::without_provenance_mut(addr)
    }

    pub fn destroy(&self, token: *mut c_void) -> Result<(), CUresult> {
        if self.live.lock().remove(&(token as usize)) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_HANDLE)
        }
    }

    pub fn check(&self, token: *mut c_void) -> Result<(), CUresult> {
        if self.live.lock().contains(&(token as usize)) {
            Ok(())
        } else {
            Err(CUDA_ERROR_INVALID_HANDLE)
        }
    }
}

/// Streams: null (the legacy default stream), `CU_STREAM_LEGACY` (1) and
/// `CU_STREAM_PER_THREAD` (2) are always valid.
pub fn check_stream(stream: CUstream) -> Result<(), CUresult> {
    match stream as usize {
        0..=2 => Ok(()),
        _ => STREAMS.check(stream),
    }
}

pub fn check_event(event: CUevent) -> Result<(), CUresult> {
    EVENTS.check(event)
}
