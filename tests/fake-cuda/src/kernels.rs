//! Modules and kernels: memsaver's packing kernels (`allocator/kernels/pack.cu`), run on the
//! host over the fake's memory, so that tests see what they copy.
//!
//! `cuModuleLoadData` accepts PTX text (NUL-terminated, with `.version`, `.target` and at least
//! one `.entry`) and remembers its entry names; `cuModuleGetFunction` finds one. A launch of
//! `memsaver_pack` or `memsaver_unpack` does what the kernel does to each piece of its batch
//! (the structs of `memsaver_allocator::packed`), at once; any other kernel is
//! `CUDA_ERROR_NOT_SUPPORTED` (the fake runs no code it was not written for). As on a GPU, a
//! kernel reaches host memory only where it is registered (or from `cuMemHostAlloc`): anything
//! else is `CUDA_ERROR_ILLEGAL_ADDRESS` and loses the context, as a fault would. The device
//! reaches registered memory at its host address unless `FAKE_CUDA_HOST_POINTER=0`
//! (`CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`).
//!
//! `fakecuda_transfer_stats(out, n)` gives, in this order: bytes copied device to host and host
//! to device by `cuMemcpy*`, bytes the kernels wrote to host memory and read from it, and the
//! launches of each kernel (pack, unpack).

use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use memsaver_allocator::driver::sys::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_SUPPORTED, CUresult,
};
use memsaver_allocator::packed::{PackBatch, PackPiece, UnpackBatch, UnpackPiece};
use parking_lot::Mutex;

use crate::{context, pinning, state};

/// `CUDA_ERROR_INVALID_IMAGE`.
const INVALID_IMAGE: CUresult = 200;
/// `CUDA_ERROR_ILLEGAL_ADDRESS`.
const ILLEGAL_ADDRESS: CUresult = 700;
/// The kernels' block and thread count (`pack.cu`).
const BLOCK: u64 = 4096;
const THREADS: u32 = 256;

/// Figures of `fakecuda_transfer_stats`, in its order.
pub static COPIED_TO_HOST: AtomicU64 = AtomicU64::new(0);
pub static COPIED_TO_DEVICE: AtomicU64 = AtomicU64::new(0);
static KERNEL_TO_HOST: AtomicU64 = AtomicU64::new(0);
static KERNEL_FROM_HOST: AtomicU64 = AtomicU64::new(0);
static PACKS: AtomicU64 = AtomicU64::new(0);
static UNPACKS: AtomicU64 = AtomicU64::new(0);
/// How many figures `fakecuda_transfer_stats` gives.
pub const STATS: usize = 6;

pub fn read_stats(out: &mut [u64]) {
    let all = [
        &COPIED_TO_HOST,
        &COPIED_TO_DEVICE,
        &KERNEL_TO_HOST,
        &KERNEL_FROM_HOST,
        &PACKS,
        &UNPACKS,
    ];
    for (o, c) in out.iter_mut().zip(all) {
        *o = c.load(Ordering::Relaxed);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Pack,
    Unpack,
    Other,
}

/// Loaded modules (their entry names) and functions handed out, by token.
struct Table {
    modules: HashMap<usize, Vec<String>>,
    functions: HashMap<usize, Kernel>,
    next: usize,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);
/// Tokens are addresses of nothing, apart from other tokens.
const TOKEN_BASE: usize = 0x7e00_0000_0000;

fn with_table<T>(f: impl FnOnce(&mut Table) -> T) -> T {
    let mut g = TABLE.lock();
    f(g.get_or_insert_with(|| Table {
        modules: HashMap::new(),
        functions: HashMap::new(),
        next: TOKEN_BASE,
    }))
}

/// `cuModuleLoadData` of PTX text.
pub fn load(image: &CStr) -> Result<*mut c_void, CUresult> {
    let text = image.to_str().map_err(|_| INVALID_IMAGE)?;
    if !text.contains(".version") || !text.contains(".target") {
        return Err(INVALID_IMAGE);
    }
    let entries: Vec<String> = text
        .split(".entry ")
        .skip(1)
        .filter_map(|rest| rest.split('(').next())
        .map(|name| name.trim().to_owned())
        .collect();
    if entries.is_empty() {
        return Err(INVALID_IMAGE);
    }
    Ok(with_table(|t| {
        t.next += 16;
        t.modules.insert(t.next, entries);
        t.next as *mut c_void
    }))
}

/// `cuModuleGetFunction`.
pub fn function(module: *mut c_void, name: &CStr) -> Result<*mut c_void, CUresult> {
    let name = name.to_str().map_err(|_| CUDA_ERROR_NOT_FOUND)?;
    with_table(|t| {
        let entries = t
            .modules
            .get(&(module as usize))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !entries.iter().any(|e| e == name) {
            return Err(CUDA_ERROR_NOT_FOUND);
        }
        let kind = match name {
            "memsaver_pack" => Kernel::Pack,
            "memsaver_unpack" => Kernel::Unpack,
            _ => Kernel::Other,
        };
        t.next += 16;
        t.functions.insert(t.next, kind);
        Ok(t.next as *mut c_void)
    })
}

/// `cuLaunchKernel` of a function of [`function`], with `threads` threads per block: runs it.
///
/// # Safety
/// `params` holds one pointer per parameter of the kernel, each to a value of its type (for
/// memsaver's kernels, one: their batch).
pub unsafe fn launch(
    f: *mut c_void,
    threads: u32,
    params: *mut *mut c_void,
) -> Result<(), CUresult> {
    let kind =
        with_table(|t| t.functions.get(&(f as usize)).copied()).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if params.is_null() || threads == 0 || threads > THREADS {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dev = context::require_current()?;
    context::alive(dev)?;
    // SAFETY: per this function's contract, the first parameter is the kernel's batch.
    let first = unsafe { *params };
    let r = match kind {
        // SAFETY: memsaver_pack's one parameter (pack.cu, packed.rs).
        Kernel::Pack => pack(&unsafe { first.cast::<PackBatch>().read_unaligned() }),
        // SAFETY: memsaver_unpack's one parameter.
        Kernel::Unpack => unpack(&unsafe { first.cast::<UnpackBatch>().read_unaligned() }),
        Kernel::Other => return Err(CUDA_ERROR_NOT_SUPPORTED),
    };
    if r == Err(ILLEGAL_ADDRESS) {
        context::lose(dev);
    }
    r
}

/// Host memory `[p, p + len)` a kernel touches: registered or from `cuMemHostAlloc`, else the
/// fault of a GPU.
fn host(p: u64, len: u64) -> Result<*mut u8, CUresult> {
    if len == 0 || pinning::registered(p as usize, len as usize) || state::is_host_block(p, len) {
        Ok(p as *mut u8)
    } else {
        Err(ILLEGAL_ADDRESS)
    }
}

/// `memsaver_pack`: each piece of the batch.
fn pack(b: &PackBatch) -> Result<(), CUresult> {
    PACKS.fetch_add(1, Ordering::Relaxed);
    let units = |q: &PackPiece| q.len.div_ceil(BLOCK);
    each(&b.piece, b.pieces, b.blocks, |q| q.first, units, pack_one)
}

/// Runs `one` on the first `n` pieces of a batch, each of whose `first` unit (block or slot) must
/// be where the units of those before it end, as they must add up to `total`.
fn each<P>(
    pieces: &[P],
    n: u32,
    total: u32,
    first: impl Fn(&P) -> u32,
    units: impl Fn(&P) -> u64,
    one: impl Fn(&P) -> Result<(), CUresult>,
) -> Result<(), CUresult> {
    let pieces = pieces.get(..n as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let mut at = 0u64;
    for q in pieces {
        if first(q) as u64 != at {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        at += units(q);
        one(q)?;
    }
    if at != total as u64 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

fn pack_one(q: &PackPiece) -> Result<(), CUresult> {
    let _held = state::access(q.src, q.len as usize, false).map_err(|_| ILLEGAL_ADDRESS)?;
    let mut found: u32 = 0;
    for b in 0..q.len.div_ceil(BLOCK) {
        let n = BLOCK.min(q.len - b * BLOCK);
        let at = q.src + b * BLOCK;
        // SAFETY: inside the mapped range held above.
        let bytes = unsafe { std::slice::from_raw_parts(at as *const u8, n as usize) };
        if bytes.iter().all(|&x| x == 0) {
            continue;
        }
        let slot = found;
        found += 1;
        if slot >= q.slots {
            continue;
        }
        let out = host(q.dst + slot as u64 * BLOCK, n)?;
        let ix = host(q.index + 4 * slot as u64, 4)?;
        // SAFETY: both checked to be host memory the kernel may write.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, n as usize);
            ix.cast::<u32>().write_unaligned(b as u32);
        }
        KERNEL_TO_HOST.fetch_add(n + 4, Ordering::Relaxed);
    }
    let c = host(q.count, 4)?;
    // SAFETY: checked to be host memory the kernel may write.
    unsafe { c.cast::<u32>().write_unaligned(found) };
    Ok(())
}

/// `memsaver_unpack`: each piece of the batch.
fn unpack(b: &UnpackBatch) -> Result<(), CUresult> {
    UNPACKS.fetch_add(1, Ordering::Relaxed);
    let units = |q: &UnpackPiece| q.count as u64;
    each(&b.piece, b.pieces, b.slots, |q| q.first, units, unpack_one)
}

fn unpack_one(q: &UnpackPiece) -> Result<(), CUresult> {
    let _held = state::access(q.dst, q.len as usize, true).map_err(|_| ILLEGAL_ADDRESS)?;
    for s in 0..q.count as u64 {
        let ix = host(q.index + 4 * s, 4)?;
        // SAFETY: checked to be host memory the kernel may read.
        let b = unsafe { ix.cast::<u32>().read_unaligned() } as u64;
        let at = b * BLOCK;
        if at >= q.len {
            continue;
        }
        let n = BLOCK.min(q.len - at);
        let from = host(q.src + s * BLOCK, n)?;
        // SAFETY: `from` checked above; `dst + at .. + n` inside the mapped range held above.
        unsafe { std::ptr::copy_nonoverlapping(from, (q.dst + at) as *mut u8, n as usize) };
        KERNEL_FROM_HOST.fetch_add(n + 4, Ordering::Relaxed);
    }
    Ok(())
}
