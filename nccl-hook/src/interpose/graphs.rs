//! The kernel stack limit: what the `nccl` pause must know before it lowers a device's
//! per-thread stack limit, and the lowering and raising themselves ([`lower_stacks`],
//! [`restore_stacks`]).
//!
//! NCCL's kernels make the driver grow the context's stack limit (`CU_LIMIT_STACK_SIZE`,
//! 1024 -> 1744-1984 bytes with 2+ ranks), and the driver keeps local memory for it on every
//! SM (~186 MiB on an H200); pause gives that back by lowering the limit. But a CUDA graph
//! executable instantiated while the limit was S fails to launch once the limit is below S
//! (`CUDA_ERROR_LAUNCH_FAILED`, and the context is lost for good), and a limit the application
//! set itself may be what its kernels need. So pause lowers a device's limit only to
//!
//! ```text
//! floor = max(1024, largest limit a non-NCCL caller set with cuCtxSetLimit,
//!             largest limit in force when a still-live executable was instantiated)
//! ```
//!
//! and not at all once an executable this module never saw instantiated was launched on the
//! device (some instantiation path escaped the wrappers). Resume never lowers: it restores
//! max(saved, current), first, before NCCL's memory is mapped again.
//!
//! The events come from wrappers of `cuGraphInstantiate*`, `cuGraphExecDestroy`, `cuGraphLaunch`
//! and `cuCtxSetLimit`, handed out by [`crate::interpose::procaddr`]'s `cuGetProcAddress` wrappers
//! (to every caller but memsaver itself; `cuCtxSetLimit` only to non-NCCL callers) and by
//! [`crate::interpose::dlsym`] for direct `dlsym` lookups of those names.

use std::collections::BTreeMap;
use std::ffi::{c_uint, c_ulonglong, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};

use memsaver_allocator::Allocator;
use memsaver_allocator::driver::sys::{fns, *};

/// CUDA's default per-thread stack size (bytes): pause never goes below it.
pub(crate) const DEFAULT_STACK_SIZE: usize = 1024;

/// Why a device's stack limit cannot go lower than its floor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Keep {
    /// A live executable was instantiated at this limit.
    Graph(usize),
    /// A non-NCCL caller set the limit to this value.
    Explicit(usize),
    /// An executable never seen instantiated was launched: nothing is known, keep it all.
    Unknown,
}

impl Keep {
    fn bytes(self) -> usize {
        match self {
            Self::Graph(b) | Self::Explicit(b) => b,
            Self::Unknown => usize::MAX,
        }
    }

    pub(crate) fn reason(self) -> String {
        match self {
            Self::Graph(b) => format!("a live CUDA graph was instantiated at {b} B/thread"),
            Self::Explicit(b) => format!("the application set the limit to {b} B/thread"),
            Self::Unknown => {
                "a CUDA graph instantiated outside memsaver's view was launched".to_owned()
            }
        }
    }
}

/// What the current pause did to one device's limit.
#[derive(Clone, Debug)]
pub(crate) struct StackPause {
    /// The limit before the pause: resume restores max(this, the limit then).
    pub saved: usize,
    /// Local memory freed: (saved - new limit) x resident threads.
    pub lowered_bytes: u64,
    /// Local memory kept above CUDA's default because of `why`.
    pub kept_bytes: u64,
    pub why: Option<Keep>,
}

#[derive(Default)]
struct Device {
    /// Largest stack limit a non-NCCL caller set explicitly.
    explicit_max: usize,
    /// An executable never seen instantiated was launched here: never lower again.
    unknown: bool,
}

pub(crate) struct Graphs {
    /// Live executables: handle -> (device, stack limit read right after instantiation).
    execs: BTreeMap<usize, (i32, usize)>,
    devices: BTreeMap<i32, Device>,
    /// The device could not be told (no driver for memsaver): every device counts as unknown.
    unknown_anywhere: bool,
    /// What the current `nccl` pause did, per device; emptied by resume.
    pub paused: BTreeMap<i32, StackPause>,
}

/// Guards all of the above. Held by the instantiate, destroy and `cuCtxSetLimit` wrappers
/// across their driver call (so a pause cannot lower the limit between an instantiation and its
/// record), by the launch wrapper for one map lookup, by the `nccl` pause and resume while
/// they read the floor and set the limit (taking the allocator's `devices` for the copy
/// stream), and by `stats` after it dropped `REGISTRY`. Never taken on the `dlsym` path, never
/// with `REGISTRY` held. `current` may start the allocator under it (the start takes
/// `external` and `table`, which come after this lock).
static GRAPHS: Mutex<Graphs> = Mutex::new(Graphs {
    execs: BTreeMap::new(),
    devices: BTreeMap::new(),
    unknown_anywhere: false,
    paused: BTreeMap::new(),
});

pub(crate) fn lock() -> MutexGuard<'static, Graphs> {
    GRAPHS.lock()
}

impl Graphs {
    /// The lowest limit pause may set on `dev` and why (`None`: CUDA's default, nothing kept).
    pub fn floor(&self, dev: i32) -> (usize, Option<Keep>) {
        let d = self.devices.get(&dev);
        if self.unknown_anywhere || d.is_some_and(|d| d.unknown) {
            return (usize::MAX, Some(Keep::Unknown));
        }
        let graph = self
            .execs
            .values()
            .filter(|(gd, _)| *gd == dev)
            .map(|(_, s)| *s)
            .max()
            .unwrap_or(0);
        let explicit = d.map_or(0, |d| d.explicit_max);
        // A tie names the graph: it is what fails to launch.
        let keep = if graph >= explicit {
            Keep::Graph(graph)
        } else {
            Keep::Explicit(explicit)
        };
        if keep.bytes() > DEFAULT_STACK_SIZE {
            (keep.bytes(), Some(keep))
        } else {
            (DEFAULT_STACK_SIZE, None)
        }
    }
}

/// The calling thread's current device and its stack limit, through memsaver's driver (the
/// same libcuda as the caller's). May start the allocator (under `GRAPHS`, which comes before
/// the locks the start takes).
fn current() -> Option<(i32, usize)> {
    let d = memsaver_allocator::global_driver().ok()?;
    Some((d.current_device()?, d.stack_size().ok()?))
}

/// Bookkeeping must never unwind into the caller.
fn quietly(f: impl FnOnce()) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

/// Records a successful instantiation (`g` held across it) at the limit in force now.
fn instantiated(g: &mut Graphs, exec: *mut CUgraphExec) {
    quietly(|| {
        if exec.is_null() {
            return;
        }
        // SAFETY: the driver wrote the executable on success.
        let e = unsafe { *exec } as usize;
        match current() {
            Some((dev, limit)) => {
                g.execs.insert(e, (dev, limit));
            }
            None => {
                g.unknown_anywhere = true;
                tracing::warn!(
                    "memsaver: a CUDA graph was instantiated but its device or stack limit could not be read; the nccl pause will not lower the kernel stack size"
                );
            }
        }
    })
}

/// How many different driver functions one wrapper kind can stand for (the driver may hand
/// out per-thread-stream variants, or another version, under one name).
const SLOTS: usize = 4;

/// The driver functions behind one kind of wrapper: slot `i` is called by the wrapper
/// instantiated with `S = i`.
struct Real([AtomicUsize; SLOTS]);

impl Real {
    const fn new() -> Self {
        Self([const { AtomicUsize::new(0) }; SLOTS])
    }

    /// The slot holding `real`, claimed if new; `None` once every slot holds another function.
    /// Lock-free and allocation-free: called on the `dlsym` path.
    fn slot(&self, real: usize) -> Option<usize> {
        self.0.iter().position(|s| {
            match s.compare_exchange(0, real, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => true,
                Err(cur) => cur == real,
            }
        })
    }

    /// The driver function of slot `S`, as `F`.
    ///
    /// # Safety
    /// `F` is the function-pointer type the slot was filled with.
    unsafe fn get<F: Copy, const S: usize>(&self) -> F {
        let p = self.0[S].load(Ordering::Acquire);
        // SAFETY: a wrapper of slot S is only handed out after slot S was filled with a
        // function of type F (per this function's contract).
        unsafe { std::mem::transmute_copy::<usize, F>(&p) }
    }
}

/// The wrapper kinds, with the table of their per-slot instances.
macro_rules! kinds {
    ($($kind:ident: $real:ident => $wrapper:ident;)*) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        enum Kind { $($kind,)* }
        $(static $real: Real = Real::new();)*

        /// Our wrapper of kind `k` for the driver function `real` (`None` when out of slots).
        fn wrapper(k: Kind, real: *mut c_void) -> Option<*mut c_void> {
            match k {
                $(Kind::$kind => {
                    let s = $real.slot(real as usize)?;
                    let table = [
                        $wrapper::<0> as *mut c_void,
                        $wrapper::<1> as *mut c_void,
                        $wrapper::<2> as *mut c_void,
                        $wrapper::<3> as *mut c_void,
                    ];
                    Some(table[s])
                })*
            }
        }
    };
}

kinds! {
    InstantiateWithFlags: INSTANTIATE_WITH_FLAGS => instantiate_with_flags;
    Instantiate5: INSTANTIATE_5 => instantiate_5;
    InstantiateWithParams: INSTANTIATE_WITH_PARAMS => instantiate_with_params;
    ExecDestroy: EXEC_DESTROY => exec_destroy;
    Launch: LAUNCH => launch;
    SetLimit: SET_LIMIT => set_limit;
}

/// The kind of wrapper for `name`: looked up through `cuGetProcAddress` for CUDA `version`,
/// or (`None`) with `dlsym`, which finds the exported symbol of that exact name.
fn kind(name: &[u8], version: Option<i32>, set_limit: bool) -> Option<Kind> {
    Some(match name {
        // CUDA 12.0 made the name mean the flags form for cuGetProcAddress; the exported
        // symbol keeps the five-argument signature.
        b"cuGraphInstantiate" if version.is_some_and(|v| v >= 12000) => Kind::InstantiateWithFlags,
        b"cuGraphInstantiate" | b"cuGraphInstantiate_v2" => Kind::Instantiate5,
        b"cuGraphInstantiateWithFlags" => Kind::InstantiateWithFlags,
        b"cuGraphInstantiateWithParams" | b"cuGraphInstantiateWithParams_ptsz" => {
            Kind::InstantiateWithParams
        }
        b"cuGraphExecDestroy" => Kind::ExecDestroy,
        b"cuGraphLaunch" | b"cuGraphLaunch_ptsz" => Kind::Launch,
        b"cuCtxSetLimit" if set_limit => Kind::SetLimit,
        _ => return None,
    })
}

/// Whether a `dlsym` of `name` may be answered here (cheap: runs on every lookup).
pub(crate) fn is_direct_name(name: &[u8]) -> bool {
    name.starts_with(b"cuGraph") || name == b"cuCtxSetLimit"
}

/// Our wrapper for `name` whose driver function is `real`, or `None` to hand out `real`.
/// `version` as for [`kind`]; `set_limit`: the caller is not NCCL, so its `cuCtxSetLimit`
/// counts as the application's. Lock-free and allocation-free (the `dlsym` path calls it).
pub(crate) fn wrap(
    name: &[u8],
    version: Option<i32>,
    set_limit: bool,
    real: *mut c_void,
) -> Option<*mut c_void> {
    if real.is_null() {
        return None;
    }
    wrapper(kind(name, version, set_limit)?, real)
}

unsafe extern "C" fn instantiate_with_flags<const S: usize>(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    flags: c_ulonglong,
) -> CUresult {
    // SAFETY: the slot was filled with a function of this kind's signature.
    let f: fns::cuGraphInstantiateWithFlags = unsafe { INSTANTIATE_WITH_FLAGS.get::<_, S>() };
    let mut g = lock();
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { f(exec, graph, flags) };
    if r == CUDA_SUCCESS {
        instantiated(&mut g, exec);
    }
    r
}

unsafe extern "C" fn instantiate_5<const S: usize>(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    error_node: *mut CUgraphNode,
    log: *mut std::ffi::c_char,
    log_size: usize,
) -> CUresult {
    // SAFETY: the slot was filled with a function of this kind's signature.
    let f: fns::cuGraphInstantiate_v2 = unsafe { INSTANTIATE_5.get::<_, S>() };
    let mut g = lock();
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { f(exec, graph, error_node, log, log_size) };
    if r == CUDA_SUCCESS {
        instantiated(&mut g, exec);
    }
    r
}

unsafe extern "C" fn instantiate_with_params<const S: usize>(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    params: *mut CUDA_GRAPH_INSTANTIATE_PARAMS,
) -> CUresult {
    // SAFETY: the slot was filled with a function of this kind's signature.
    let f: fns::cuGraphInstantiateWithParams = unsafe { INSTANTIATE_WITH_PARAMS.get::<_, S>() };
    let mut g = lock();
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { f(exec, graph, params) };
    if r == CUDA_SUCCESS {
        instantiated(&mut g, exec);
    }
    r
}

unsafe extern "C" fn exec_destroy<const S: usize>(exec: CUgraphExec) -> CUresult {
    // SAFETY: the slot was filled with a function of this kind's signature.
    let f: fns::cuGraphExecDestroy = unsafe { EXEC_DESTROY.get::<_, S>() };
    // Held across the call: the handle may be reused by an instantiation right after.
    let mut g = lock();
    // SAFETY: forwarding the caller's argument.
    let r = unsafe { f(exec) };
    if r == CUDA_SUCCESS {
        g.execs.remove(&(exec as usize));
    }
    r
}

unsafe extern "C" fn launch<const S: usize>(exec: CUgraphExec, stream: CUstream) -> CUresult {
    // SAFETY: the slot was filled with a function of this kind's signature.
    let f: fns::cuGraphLaunch = unsafe { LAUNCH.get::<_, S>() };
    // The hot path: one map lookup.
    let seen = lock().execs.contains_key(&(exec as usize));
    if !seen {
        quietly(unseen_launch);
    }
    // SAFETY: forwarding the caller's arguments.
    unsafe { f(exec, stream) }
}

/// An executable we never saw instantiated is launched: some instantiation path escaped the
/// wrappers, so nothing is known about the limits this device's graphs need.
fn unseen_launch() {
    let dev = current().map(|(d, _)| d);
    let mut g = lock();
    let first = match dev {
        Some(dev) => !std::mem::replace(&mut g.devices.entry(dev).or_default().unknown, true),
        None => !std::mem::replace(&mut g.unknown_anywhere, true),
    };
    drop(g);
    if first {
        memsaver_allocator::init_logging();
        tracing::warn!(
            device = dev,
            "memsaver: a CUDA graph instantiated outside memsaver's view was launched; the nccl pause will never lower this device's kernel stack size"
        );
    }
}

unsafe extern "C" fn set_limit<const S: usize>(limit: c_uint, value: usize) -> CUresult {
    // SAFETY: the slot was filled with a function of this kind's signature.
    let f: fns::cuCtxSetLimit = unsafe { SET_LIMIT.get::<_, S>() };
    if limit != CU_LIMIT_STACK_SIZE {
        // SAFETY: forwarding the caller's arguments.
        return unsafe { f(limit, value) };
    }
    let mut g = lock();
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { f(limit, value) };
    if r == CUDA_SUCCESS {
        quietly(|| match current() {
            Some((dev, _)) => {
                let d = g.devices.entry(dev).or_default();
                d.explicit_max = d.explicit_max.max(value);
            }
            None => g.unknown_anywhere = true,
        });
    }
    r
}
/// NCCL's kernels make the driver raise the context's per-thread stack size (to 1744 bytes
/// with NCCL 2.28 and 2+ ranks) and keep local memory for it on every SM: 186 MiB on an
/// H200. Pause lowers it on the devices NCCL uses, to the floor [`Graphs::floor`] gives (CUDA's
/// default unless a live graph or the application needs more), which frees that memory;
/// kernels that need more while paused grow it again, as the driver always does.
pub(crate) fn lower_stacks(a: &'static Allocator, devices: &[i32]) {
    let d = a.driver();
    // Held throughout: no graph is instantiated or limit set between reading the floor and
    // setting the limit.
    let mut g = lock();
    for &dev in devices {
        let (floor, why) = g.floor(dev);
        let r = a.device(dev).and_then(|device| {
            Ok(d.with_context(device.ctx, || {
                let cur = d.stack_size()?;
                let to = floor.min(cur);
                if to < cur {
                    d.set_stack_size(to)?;
                }
                Ok((cur, to))
            })?)
        });
        let (cur, to) = match r {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(
                    device = dev,
                    error = %e,
                    "memsaver: could not lower the kernel stack size NCCL raised; its local memory stays"
                );
                continue;
            }
        };
        if cur <= DEFAULT_STACK_SIZE {
            continue; // nothing was raised
        }
        let per_byte = d.stack_bytes_per_thread_byte(dev).unwrap_or_else(|e| {
            tracing::warn!(device = dev, error = %e, "memsaver: cannot size local memory");
            0
        });
        let kept = to.saturating_sub(DEFAULT_STACK_SIZE);
        let why = why.filter(|_| kept > 0);
        let p = g.paused.entry(dev).or_insert(StackPause {
            saved: cur,
            lowered_bytes: 0,
            kept_bytes: 0,
            why: None,
        });
        p.lowered_bytes += ((cur - to) as u64) * per_byte;
        p.kept_bytes = kept as u64 * per_byte;
        p.why = why;
        tracing::info!(
            device = dev,
            from = cur,
            to,
            lowered_bytes = (cur - to) as u64 * per_byte,
            kept_bytes = p.kept_bytes,
            reason = why.map(Keep::reason),
            "nccl pause: kernel stack size"
        );
    }
}

/// Resume, first: gives NCCL's kernels their stack size back now rather than at their next
/// launch, never lowering it (a graph instantiated while paused may have needed more). Called
/// before NCCL's memory is mapped again, when the driver's `cuCtxSetLimit` is cheapest.
pub(crate) fn restore_stacks(a: &'static Allocator) {
    let d = a.driver();
    let mut g = lock();
    for (dev, p) in std::mem::take(&mut g.paused) {
        let r = a.device(dev).and_then(|device| {
            Ok(d.with_context(device.ctx, || {
                if d.stack_size()? < p.saved {
                    d.set_stack_size(p.saved)?;
                }
                Ok(())
            })?)
        });
        if let Err(e) = r {
            tracing::warn!(
                device = dev,
                bytes = p.saved,
                error = %e,
                "memsaver: could not give NCCL's kernels their stack size back; the driver grows it again at their next launch"
            );
        }
    }
}
