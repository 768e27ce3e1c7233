//! Wrappers of the driver's VMM entry points, handed to libnccl by [`crate::interpose::procaddr`]:
//! here those that make, map and free NCCL's memory in this process (create, retain, release,
//! map, set access, unmap, reserve, free, and the queries), and what every wrapper shares (the
//! refusal of a paused range, backups prepared for new buffers, the release of a physical
//! allocation); `sharing` holds those that hand the memory beyond this process's mappings.
//!
//! Each calls the driver's own function (the one NCCL asked for, [`crate::interpose::real`])
//! and keeps [`crate::registry`] up to date. Handles are virtual (see the registry): the
//! wrappers that take a handle translate it, and a paused range is answered from the registry.

use std::ffi::{c_ulonglong, c_void};

use crate::interpose::{real, tokens};
use crate::options::{self, NcclBackup};
use crate::registry::{self, Carved, Gone, Kind, Mapping, Physical, Real, Registration, Run};
use memsaver_allocator::driver::Handle;
use memsaver_allocator::driver::sys::*;
use memsaver_allocator::options::Pack;
use memsaver_allocator::steps::external_key;

/// Returned when NCCL touches its memory while the `nccl` tag is paused.
const PAUSED: CUresult = CUDA_ERROR_NOT_PERMITTED;

/// NCCL used released memory: of its own (the `nccl` tag is paused) or, for `p` a peer's
/// registered buffer, of a peer whose tag is paused.
pub(super) fn paused_use(what: &str, p: &Physical) -> CUresult {
    match p.registration {
        Some(Registration::Imported { owner, .. }) => tracing::error!(
            "NCCL called {what} on a buffer that process {} registered and has paused (its tag); \
             resume that tag in process {} first",
            owner.pid,
            owner.pid
        ),
        _ => tracing::error!(
            "NCCL called {what} on memory of the paused tag 'nccl'; resume('nccl') first"
        ),
    }
    PAUSED
}

/// Runs bookkeeping that must not unwind into NCCL.
pub(super) fn quietly(f: impl FnOnce()) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

/// Runs a wrapper's own work, which must not unwind into NCCL: a panic is an unknown error.
pub(super) fn answered(f: impl FnOnce() -> CUresult) -> CUresult {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(CUDA_ERROR_UNKNOWN)
}

/// Asks for the pinned backup of NCCL's new buffer `vh` (`size` bytes on `device`) to be
/// prepared in the background, as for any `cpu` allocation, so that the first pause of `nccl`
/// only copies (with `headers` too: whole until NCCL shares the buffer, see
/// [`prepare_header`]). A packed backup (`MEMSAVER_PACK`, on for `nccl` by default) starts at
/// a sixteenth of the buffer (`packed::start_len`): NCCL's buffers hold a few KiB each. Bounded
/// by the prepare budget and off with retention, like every tag's. Starts the allocator: call
/// with no lock held.
fn prepare_backup(vh: u64, device: i32, size: usize) {
    if !matches!(
        options::get().nccl_backup,
        NcclBackup::Discard | NcclBackup::Mmap | NcclBackup::Disk
    ) && let Ok(a) = memsaver_allocator::global()
        && a.retain_backups()
    {
        let len = match a.pack() {
            Pack::Off => size,
            Pack::Nccl | Pack::All => memsaver_allocator::packed::start_len(size),
        };
        a.prepare_backup(external_key(vh), device, len);
    }
}

/// Whether `MEMSAVER_NCCL_BACKUP=headers` may trim NCCL's shared buffers in this process: only
/// on an NCCL whose buffer layouts were checked (up to [`options::LAST_CHECKED_NCCL`]), or when
/// the user opted in (`MEMSAVER_NCCL_HEADERS_UNCHECKED=1`). Otherwise they are backed up whole,
/// and the log says why, once.
pub(crate) fn headers_apply() -> bool {
    static DECIDED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DECIDED.get_or_init(|| {
        let version = crate::interpose::guard::nccl_version();
        if version.is_some_and(|v| v <= options::LAST_CHECKED_NCCL) {
            return true;
        }
        let opted_in = options::get().nccl_headers_unchecked;
        let name = |v: i32| format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
        let seen = version.map_or_else(
            || "an NCCL whose version cannot be asked".to_owned(),
            |v| format!("NCCL {}", name(v)),
        );
        let checked = name(options::LAST_CHECKED_NCCL);
        if opted_in {
            tracing::warn!(
                "memsaver: {seen} is newer than the last NCCL whose buffers were checked for \
                 MEMSAVER_NCCL_BACKUP=headers ({checked}); keeping only their headers, as \
                 MEMSAVER_NCCL_HEADERS_UNCHECKED=1 asks"
            );
        } else {
            tracing::warn!(
                "memsaver: {seen} is newer than the last NCCL whose buffers were checked for \
                 MEMSAVER_NCCL_BACKUP=headers ({checked}): NCCL's shared buffers are backed up \
                 whole. Set MEMSAVER_NCCL_HEADERS_UNCHECKED=1 to keep only their headers"
            );
        }
        opted_in
    })
}

/// NCCL shares its buffer `vh` for the first time: with `headers`, its backup is its header
/// only, so what was prepared for the whole buffer is given back and the header prepared
/// instead. Call with no lock held.
pub(super) fn prepare_header(vh: u64, device: i32, size: u64) {
    if options::get().nccl_backup == NcclBackup::Headers && headers_apply() {
        forget_backup(vh);
        prepare_backup(vh, device, size.min(options::HEADER_BYTES) as usize);
    }
}

/// Frees what was prepared for NCCL's buffer `vh`, which NCCL has released.
fn forget_backup(vh: u64) {
    if let Some(a) = memsaver_allocator::global_if_started() {
        a.forget_prepared_backup(external_key(vh));
    }
}

/// Forgets `vh` if NCCL no longer references or maps it ([`registry::Registry::collect`]); an
/// exported buffer that goes is forgotten by the owner's ledger too (under the registry lock:
/// no peer is served it meanwhile, and its token opens nothing any more), and so are the
/// buffers retired in a run that goes with it; an exported buffer of a run that lives on is
/// retired instead: its importers map the whole run ([`registry::Retired`]).
fn collect(reg: &mut registry::Registry, vh: u64) -> Option<Gone> {
    use memsaver_ipc::shared::{Delivery, forget};
    let mut gone = reg.collect(vh);
    if let Some(Gone::Run {
        base, run, retired, ..
    }) = &mut gone
    {
        for id in retired.iter() {
            forget(Delivery::Collective, *id);
        }
        unmap_run(reg, *base, run);
    }
    if gone.as_ref().is_some_and(|g| g.physical().exported) && !reg.retired.contains_key(&vh) {
        forget(Delivery::Collective, vh);
    }
    gone
}

/// Tells the driver what the registry just forgot: releases the driver handle of a physical
/// object, or unmaps and releases a run NCCL no longer uses and frees the reservations NCCL
/// freed inside it; an import of a peer's memory also tells its owner
/// ([`tokens::import_gone`]).
fn release_real(gone: Option<Gone>) {
    let Some(gone) = gone else { return };
    tokens::import_gone(gone.physical());
    match gone {
        Gone::Member(_) => {}
        Gone::Handle(p) => release_handle(p.real()),
        Gone::Run { run, .. } => take_down_run(run),
    }
}

/// Releases a driver handle memsaver held on NCCL's behalf: through the function NCCL looked up,
/// or memsaver's own driver where NCCL has not looked it up yet.
fn release_handle(h: Option<Real>) {
    let Some(h) = h else { return };
    let r = match real::RELEASE() {
        // SAFETY: a driver handle memsaver held on NCCL's behalf; released once, here.
        Some(release) => unsafe { release(h) },
        None => match memsaver_allocator::global_if_started() {
            Some(a) => a
                .driver()
                .release(Handle(h))
                .map_or(CUDA_ERROR_UNKNOWN, |()| CUDA_SUCCESS),
            None => CUDA_ERROR_NOT_INITIALIZED,
        },
    };
    if r != CUDA_SUCCESS {
        tracing::warn!(code = r, "cuMemRelease of an NCCL handle failed");
    }
}

/// Unmaps a run that no buffer uses any more, just taken out of the registry `reg` (whose
/// lock the caller holds from then until now, so that no range of the run is handed out again
/// while it is still mapped), gives its spare space and the reservations of memsaver's that
/// NCCL freed inside it back; `run.dead` keeps the driver's, for [`take_down_run`].
fn unmap_run(reg: &mut registry::Registry, base: CUdeviceptr, run: &mut Run) {
    if let Some(unmap) = real::UNMAP() {
        // SAFETY: the run's mapping; NCCL has let go of every buffer in it.
        let r = unsafe { unmap(base, run.size as usize) };
        if r != CUDA_SUCCESS {
            tracing::warn!(code = r, "cuMemUnmap of a run of NCCL's buffers failed");
        }
    }
    reg.run_unmapped(base, run);
    run.dead.retain(|(ptr, _)| !reg.free_range(*ptr));
}

/// After [`unmap_run`], with the registry unlocked: frees the reservations of the driver's
/// that NCCL freed inside the run and those memsaver made around it, and releases the run's
/// driver handle.
fn take_down_run(run: Run) {
    if let Some(free) = real::FREE() {
        for (ptr, size) in run.dead.into_iter().chain(run.around) {
            // SAFETY: a reservation NCCL freed while the run covered it.
            let r = unsafe { free(ptr, size as usize) };
            if r != CUDA_SUCCESS {
                tracing::warn!(code = r, "cuMemAddressFree of NCCL's freed range failed");
            }
        }
    }
    release_handle(Some(run.real));
}

/// NCCL asked for `what` on one of its buffers that memsaver backs in a run (from a resume, or
/// carved from a chunk at its creation): the driver's handle behind it is the run's, which
/// cannot be mapped, exported or bound in part.
pub(super) fn in_run(what: &str) -> CUresult {
    tracing::error!(
        "NCCL called {what} on a buffer that memsaver backs together with its neighbours (one \
         physical allocation for several buffers), which the driver cannot hand out in part; \
         set MEMSAVER_NCCL_CHUNK_MB=0 and MEMSAVER_NCCL_MERGE_MB=0 so that every NCCL buffer \
         keeps its own"
    );
    CUDA_ERROR_NOT_SUPPORTED
}

thread_local! {
    /// The size of the device memory NCCL created last on this thread, and its virtual handle
    /// when it was carved from a chunk (else 0), until its next `cuMemAddressReserve`: NCCL
    /// creates, then reserves, maps and grants access.
    static CREATED: std::cell::Cell<(usize, u64)> = const { std::cell::Cell::new((0, 0)) };
    /// The peer's buffer NCCL imported last on this thread, until its next
    /// `cuMemAddressReserve`: (owner, its address there, its length). NCCL imports, then
    /// reserves, maps and grants access.
    pub(super) static PLACE: std::cell::Cell<Option<(u32, u64, u64)>> = const { std::cell::Cell::new(None) };
}

pub(super) unsafe extern "C" fn mem_create(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    let Some(f) = real::CREATE() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !handle.is_null() && !prop.is_null() && !crate::interpose::appmem::in_application_alloc() {
        // SAFETY: valid input per cuMemCreate's contract.
        let p = unsafe { *prop };
        let mut vh = None;
        quietly(|| vh = create_in_chunk(size as u64, &p, f));
        if let Some(vh) = vh {
            // SAFETY: the caller's out-pointer.
            unsafe { *handle = vh };
            return CUDA_SUCCESS;
        }
    }
    // SAFETY: forwarding the caller's arguments.
    let r = unsafe { f(handle, size, prop, flags) };
    // The application's own memory from libnccl's `ncclMemAlloc` (no tag applies): not NCCL's,
    // never paused; the driver's handle stays unrecorded, so every later call on it is
    // forwarded as for any memory that is not NCCL's.
    if r != CUDA_SUCCESS
        || handle.is_null()
        || prop.is_null()
        || crate::interpose::appmem::in_application_alloc()
    {
        return r;
    }
    quietly(|| {
        // SAFETY: valid input per cuMemCreate's contract; the handle was written on success.
        let (prop, h) = unsafe { (*prop, *handle) };
        let kind = match prop.location.type_ {
            CU_MEM_LOCATION_TYPE_DEVICE
                if prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC != 0 =>
            {
                Kind::Fabric
            }
            CU_MEM_LOCATION_TYPE_DEVICE => Kind::Device,
            _ => Kind::Host,
        };
        let p = Physical::created(h, size as u64, prop, kind);
        let vh = registry::lock().insert(p);
        // SAFETY: the caller's out-pointer.
        unsafe { *handle = vh };
        if kind == Kind::Device {
            CREATED.set((size, 0));
            prepare_backup(vh, prop.location.id, size);
        }
    });
    r
}

/// NCCL's new buffer of `size` bytes, carved from a chunk ([`registry::Registry::carve_in_chunk`])
/// when chunks are on (`MEMSAVER_NCCL_CHUNK_MB`) and it may join one: device memory of at most
/// a sixteenth of a chunk, exportable as a POSIX fd or not at all, in a process that can serve
/// its peers tokens (a buffer of a chunk is exported only through one: the driver's fd would
/// be the chunk's). `create` makes a chunk's memory. Its virtual handle, or `None`: the caller
/// creates it alone.
fn create_in_chunk(size: u64, prop: &CUmemAllocationProp, create: fns::cuMemCreate) -> Option<u64> {
    let o = options::get();
    let chunk = o.nccl_chunk.min(o.nccl_merge_limit);
    let eligible = size > 0
        && size <= chunk / 16
        && prop.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE
        && prop.requestedHandleTypes & !CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 0;
    if !eligible
        || CHUNKS_FAILED.load(std::sync::atomic::Ordering::Relaxed)
        || !tokens::enabled()
        || memsaver_ipc::server::ensure_server().is_err()
    {
        return None;
    }
    let map = real::MAP()?;
    let failed = std::cell::Cell::new(None);
    let make = |base: CUdeviceptr, len: u64| {
        let mut h = 0;
        // SAFETY: a valid out-pointer and the properties NCCL asked for.
        let r = unsafe { create(&mut h, len as usize, prop, 0) };
        if r != CUDA_SUCCESS {
            failed.set(Some(("cuMemCreate", r)));
            return None;
        }
        // SAFETY: `base` is memsaver's own space, nothing mapped there.
        let r = unsafe { map(base, len as usize, 0, h, 0) };
        if r != CUDA_SUCCESS {
            failed.set(Some(("cuMemMap", r)));
            release_handle(Some(h));
            return None;
        }
        Some(h)
    };
    let mut reg = registry::lock();
    let carved = reg.carve_in_chunk(size, prop, chunk, reserve_space, make);
    if let Some((call, code)) = failed.get() {
        drop(reg);
        chunks_failed(call, code, chunk);
        return None;
    }
    let (base, at) = carved?;
    let mut p = Physical::created(reg.runs[&base].real, size, *prop, Kind::Device);
    p.run = Some(base);
    p.carved = Some(Carved {
        at,
        reserved: false,
    });
    let vh = reg.insert(p);
    drop(reg);
    CREATED.set((size as usize, vh));
    prepare_backup(vh, prop.location.id, size as usize);
    Some(vh)
}

/// Set once making a chunk failed: NCCL's buffers are then made alone for the rest of the
/// process, instead of each small buffer trying (and failing) to make a chunk again.
static CHUNKS_FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Making a chunk of `chunk` bytes failed in the driver's `call` with `code`: chunks are off
/// from now on (said once; the buffer that asked is made alone, as every later one).
fn chunks_failed(call: &str, code: CUresult, chunk: u64) {
    if !CHUNKS_FAILED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            code,
            "memsaver: making a chunk of {} MiB for NCCL's buffers failed ({call}: CUDA error \
             {code}); NCCL's buffers get memory of their own from now on. Out of memory: set \
             MEMSAVER_NCCL_CHUNK_MB lower or to 0; CUDA_ERROR_INVALID_VALUE: make it a multiple \
             of the device's allocation granularity (2 MiB on H100 and H200)",
            chunk >> 20
        );
    }
}

/// Address space for memsaver's ranges, reserved from the driver for the process's life.
fn reserve_space(size: u64, align: u64) -> Option<CUdeviceptr> {
    let f = real::RESERVE()?;
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    let r = unsafe { f(&mut p, size as usize, align as usize, 0, 0) };
    (r == CUDA_SUCCESS).then_some(p)
}

/// NCCL reserves the range for its buffer `vh`, carved from a chunk: the carved range when it
/// has the alignment NCCL asks, else the buffer leaves the chunk for memory of its own (its
/// carved range goes with the run) and `None` says to reserve as for any buffer. An error
/// when that memory cannot be made.
fn reserve_carved(vh: u64, align: u64) -> Result<Option<CUdeviceptr>, CUresult> {
    let mut reg = registry::lock();
    let Some(p) = reg.physicals.get_mut(&vh) else {
        return Ok(None);
    };
    let (Some(c), Some(base)) = (p.carved.filter(|c| !c.reserved), p.run) else {
        return Ok(None);
    };
    if align <= 1 || c.at.is_multiple_of(align) {
        p.carved = Some(Carved {
            at: c.at,
            reserved: true,
        });
        return Ok(Some(c.at));
    }
    let create = real::CREATE().ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
    let mut h = 0;
    // SAFETY: a valid out-pointer and the buffer's own properties.
    let r = unsafe { create(&mut h, p.size as usize, &p.prop, 0) };
    if r != CUDA_SUCCESS {
        return Err(r);
    }
    let size = p.size;
    if p.rebacked(h).is_err() {
        release_handle(Some(h));
        return Err(CUDA_ERROR_UNKNOWN);
    }
    // Called from NCCL's wrapped call: a broken record is logged, never a panic.
    let Some(run) = reg.runs.get_mut(&base) else {
        tracing::error!(
            base,
            "internal: an NCCL buffer names a run memsaver has no record of"
        );
        return Ok(None);
    };
    run.dead.push((c.at, size));
    run.live = run.live.saturating_sub(1);
    if run.live == 0
        && let Some(mut run) = reg.runs.remove(&base)
    {
        unmap_run(&mut reg, base, &mut run);
        drop(reg);
        take_down_run(run);
    }
    Ok(None)
}

pub(super) unsafe extern "C" fn mem_release(handle: CUmemGenericAllocationHandle) -> CUresult {
    let mut reg = registry::lock();
    let Some(p) = reg.physicals.get_mut(&handle) else {
        drop(reg);
        let Some(f) = real::RELEASE() else {
            return CUDA_ERROR_NOT_INITIALIZED;
        };
        // SAFETY: not one of ours: forwarded unchanged.
        return unsafe { f(handle) };
    };
    p.refs = p.refs.saturating_sub(1);
    let gone = collect(&mut reg, handle);
    let forgotten = !reg.physicals.contains_key(&handle);
    drop(reg);
    release_real(gone);
    if forgotten {
        forget_backup(handle);
    }
    CUDA_SUCCESS
}

pub(super) unsafe extern "C" fn mem_retain(
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CUresult {
    let mut reg = registry::lock();
    if let Some((_, m)) = reg.mapping_at(addr as CUdeviceptr) {
        let vh = m.vh;
        if let Some(p) = reg.physicals.get_mut(&vh) {
            p.refs += 1;
            // SAFETY: the caller's out-pointer.
            unsafe { *handle = vh };
            return CUDA_SUCCESS;
        }
    }
    drop(reg);
    let Some(f) = real::RETAIN() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: not one of NCCL's own: forwarded unchanged.
    let r = unsafe { f(handle, addr) };
    if r == CUDA_SUCCESS && !handle.is_null() {
        quietly(|| {
            // SAFETY: written by the driver on success.
            let h = unsafe { *handle };
            if let Some(vh) = retained_tagged(h, addr as u64) {
                // SAFETY: the caller's out-pointer.
                unsafe { *handle = vh };
            }
        });
    }
    r
}

thread_local! {
    /// The last range NCCL asked of memory it did not allocate, on this thread: (the range's
    /// base, the address asked). NCCL asks `cuMemGetAddressRange` of the user's buffer, then
    /// retains the handle at the range's base: when that base is a run of several memsaver
    /// allocations, the address asked says which allocation NCCL registers.
    static RANGE_ASKED: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// NCCL retained the driver's handle `h` at `addr`: when that is memsaver memory (a tensor of some
/// tag that NCCL registers), records it and returns the virtual handle to give NCCL, so that its
/// export hands out a token that makes the peers' imports follow the tag
/// ([`mem_export`](super::sharing::mem_export)). `None`: not memsaver memory (NCCL keeps the
/// driver's handle).
fn retained_tagged(h: CUmemGenericAllocationHandle, addr: u64) -> Option<u64> {
    let a = memsaver_allocator::global_if_started()?;
    let (asked_base, asked) = RANGE_ASKED.get();
    let at = if asked_base == addr { asked } else { addr };
    // Shared from now on: its resumes give it memory of its own, whole, as NCCL retained it,
    // and its pauses and resumes release and rebuild what NCCL holds of it.
    let s = a.share(at).ok()?;
    let prop = a.driver().properties(Handle(h)).ok().unwrap_or_default();
    Some(registry::lock().insert(Physical::retained(h, 0, prop, s.base, s.id)))
}

pub(super) unsafe extern "C" fn mem_map(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: c_ulonglong,
) -> CUresult {
    let Some(f) = real::MAP() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let mut reg = registry::lock();
    let Some(p) = reg.physicals.get_mut(&handle) else {
        drop(reg);
        // SAFETY: not one of ours: forwarded unchanged.
        return unsafe { f(ptr, size, offset, handle, flags) };
    };
    let Some(h) = p.real() else {
        return paused_use("cuMemMap", p);
    };
    if let Some(c) = p.carved {
        // Carved from a chunk, whose mapping covers it already: only the record is made.
        if (c.at, size as u64, offset) != (ptr, p.size, 0) {
            return in_run("cuMemMap");
        }
        p.carved = None;
        let access = Vec::new();
        reg.mappings.insert(
            ptr,
            Mapping {
                size: size as u64,
                vh: handle,
                access,
            },
        );
        return CUDA_SUCCESS;
    }
    if p.run.is_some() {
        return in_run("cuMemMap");
    }
    if p.kind == Kind::Imported && p.served.1 != 0 && p.served != (0, size as u64) {
        return answered(|| map_import_in_run(&mut reg, handle, ptr, size as u64, flags, f));
    }
    // SAFETY: the caller's arguments with the driver's handle behind the virtual one.
    let r = unsafe { f(ptr, size, offset, h, flags) };
    if r == CUDA_SUCCESS {
        if matches!(p.kind, Kind::Imported | Kind::Registered) {
            p.size = p.size.max(size as u64);
        }
        reg.mappings.insert(
            ptr,
            Mapping {
                size: size as u64,
                vh: handle,
                access: Vec::new(),
            },
        );
    }
    r
}

/// NCCL maps its import `vh` of a peer's buffer that the owner backs together with its
/// neighbours (a chunk, or a run of a resume: `Physical::served`), which maps only whole: the
/// first import of that memory here maps it whole at the buffer's offset before `ptr`, where
/// this process lays out its imports of that owner as the owner lays out its buffers
/// ([`registry::MIRROR_BLOCK`]), as a resume maps it (`crate::tag::peer`); later imports of
/// the same memory and generation join that mapping and give their own driver handle back.
fn map_import_in_run(
    reg: &mut registry::Registry,
    vh: u64,
    ptr: CUdeviceptr,
    size: u64,
    flags: c_ulonglong,
    map: fns::cuMemMap,
) -> CUresult {
    let p = &reg.physicals[&vh];
    let (offset, len) = p.served;
    let (Some(source), Some(generation), Some(h)) = (p.source, p.mapped_generation(), p.real())
    else {
        return in_run("cuMemMap");
    };
    let source = Some((source.owner, generation));
    let base = ptr.wrapping_sub(offset);
    let record = |reg: &mut registry::Registry, real: Option<Real>| {
        let p = reg.physicals.get_mut(&vh).expect("seen above");
        let old = real.map(|r| p.joined(r));
        p.run = Some(base);
        p.size = p.size.max(size);
        let access = Vec::new();
        reg.mappings.insert(ptr, Mapping { size, vh, access });
        old
    };
    if let Some(run) = reg.runs.get_mut(&base)
        && (run.size, run.source) == (len, source)
    {
        run.live += 1;
        let real = run.real;
        match record(reg, Some(real)) {
            Some(Ok(old)) => release_handle(Some(old)),
            _ => return CUDA_ERROR_UNKNOWN,
        }
        return CUDA_SUCCESS;
    }
    if offset + size > len || !reg.in_mirror(base, len) {
        tracing::error!(
            "memsaver: NCCL imports a buffer that its owner backs together with its neighbours, \
             and maps it elsewhere than where memsaver lays out that owner's buffers; set \
             MEMSAVER_NCCL_CHUNK_MB=0 and MEMSAVER_NCCL_MERGE_MB=0 in the owner so that every \
             NCCL buffer keeps its own memory"
        );
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    // SAFETY: the run's whole memory at its place in this process's copy of the owner's
    // layout, reserved by memsaver (checked above).
    let r = unsafe { map(base, len as usize, 0, h, flags) };
    if r != CUDA_SUCCESS {
        return r;
    }
    let mut run = Run::new(len, h, 1);
    run.source = source;
    reg.runs.insert(base, run);
    record(reg, None);
    CUDA_SUCCESS
}

pub(super) unsafe extern "C" fn mem_set_access(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    let Some(f) = real::SET_ACCESS() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    if !desc.is_null() && count > 0 {
        // SAFETY: `desc` holds `count` entries per cuMemSetAccess's contract.
        let access = unsafe { std::slice::from_raw_parts(desc, count) };
        let mut reg = registry::lock();
        if let Some(r) = grant_to_run(&mut reg, ptr, size as u64, access, f) {
            return r;
        }
    }
    // SAFETY: forwarded unchanged.
    let r = unsafe { f(ptr, size, desc, count) };
    if r == CUDA_SUCCESS && !desc.is_null() {
        quietly(|| {
            // SAFETY: `desc` holds `count` entries per cuMemSetAccess's contract.
            let access = unsafe { std::slice::from_raw_parts(desc, count) };
            let mut reg = registry::lock();
            // Every mapping in the range (NCCL sets access once over a registration's segments).
            for (_, m) in reg.mappings.range_mut(ptr..ptr + size as u64) {
                m.access = access.to_vec();
            }
        });
    }
    r
}

/// NCCL grants `access` to its buffer at `[ptr, ptr + size)` inside a run, whose mapping takes
/// access only whole: each location not granted to the run yet is granted over all of it (the
/// run's buffers are NCCL's alike, and NCCL grants each of them the same locations), and the
/// buffer's mapping records what NCCL asked, for the resume. `None` when no run holds the
/// range (the caller forwards the call).
fn grant_to_run(
    reg: &mut registry::Registry,
    ptr: CUdeviceptr,
    size: u64,
    access: &[CUmemAccessDesc],
    set_access: fns::cuMemSetAccess,
) -> Option<CUresult> {
    let (&base, run) = reg.runs.range_mut(..=ptr).next_back()?;
    if ptr.saturating_add(size) > base + run.size {
        return None;
    }
    for d in access {
        if run.access.contains(d) {
            continue;
        }
        // SAFETY: the run's whole mapping, one descriptor NCCL passed.
        let r = unsafe { set_access(base, run.size as usize, d, 1) };
        if r != CUDA_SUCCESS {
            return Some(r);
        }
        run.access.retain(|a| a.location != d.location);
        run.access.push(*d);
    }
    for (_, m) in reg.mappings.range_mut(ptr..ptr + size) {
        m.access = access.to_vec();
    }
    Some(CUDA_SUCCESS)
}

pub(super) unsafe extern "C" fn mem_unmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    let Some(f) = real::UNMAP() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let mut reg = registry::lock();
    let Some(vh) = reg.mappings.get(&ptr).map(|m| m.vh) else {
        drop(reg);
        // SAFETY: not one of ours: forwarded unchanged.
        return unsafe { f(ptr, size) };
    };
    let p = reg.physicals.get(&vh);
    // Paused, the range is already unmapped; in a run, it stays mapped until the run goes.
    let unmapped = p.is_some_and(|p| p.real().is_none() || p.run.is_some());
    if !unmapped {
        // Where the memory is mapped: NCCL's range, or the window of a registered import
        // whose owner re-created it smaller.
        let (at, len) = registry::in_window(ptr, size as u64, p.and_then(Physical::window));
        // SAFETY: NCCL's own mapping, unmapped as it asks.
        let r = unsafe { f(at, len as usize) };
        if r != CUDA_SUCCESS {
            return r;
        }
    }
    // Only the record goes.
    reg.mappings.remove(&ptr);
    let gone = collect(&mut reg, vh);
    drop(reg);
    release_real(gone);
    CUDA_SUCCESS
}
/// NCCL reserves an address range. Right after creating a buffer of that size: the range is carved
/// from address space memsaver reserved for NCCL's buffers, lowest address first
/// ([`registry::Registry::carve_own`]), so that buffers NCCL allocates one after another are
/// adjacent and a resume can back them with one physical allocation ([`crate::tag::restore`]).
/// Right after importing a peer's buffer: at its place in the owner's layout
/// ([`registry::Registry::place_import`]). Any other reservation (a fixed address, host memory) is
/// forwarded as it is.
pub(super) unsafe extern "C" fn mem_reserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    align: usize,
    addr: CUdeviceptr,
    flags: c_ulonglong,
) -> CUresult {
    let Some(f) = real::RESERVE() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let asked_anywhere = addr == 0 && flags == 0 && !ptr.is_null();
    let (created, carved) = CREATED.replace((0, 0));
    let own = created == size && size > 0 && asked_anywhere;
    if own && carved != 0 {
        match reserve_carved(carved, align as u64) {
            Ok(Some(at)) => {
                // SAFETY: the caller's out-pointer.
                unsafe { *ptr = at };
                return CUDA_SUCCESS;
            }
            Ok(None) => {}
            Err(r) => return r,
        }
    }
    let import = PLACE
        .take()
        .filter(|p| p.2 == size as u64 && asked_anywhere);
    if !own && import.is_none() {
        // SAFETY: forwarded unchanged.
        return unsafe { f(ptr, size, align, addr, flags) };
    }
    let mut reg = registry::lock();
    let at = match import {
        Some((owner, place, len)) => {
            reg.place_import(owner, place, len, align as u64, reserve_space)
        }
        None => reg.carve_own(size as u64, align as u64, reserve_space),
    };
    drop(reg);
    if let Some(at) = at {
        // SAFETY: the caller's out-pointer.
        unsafe { *ptr = at };
        return CUDA_SUCCESS;
    }
    tracing::debug!(
        size,
        "memsaver: NCCL's reservation keeps the driver's address"
    );
    // SAFETY: forwarded unchanged.
    unsafe { f(ptr, size, align, addr, flags) }
}

/// NCCL frees an address range: while a run's mapping covers it, the range stays reserved
/// until the run is unmapped (part of a mapping cannot be unmapped, nor a reservation under
/// a mapping freed), and its bytes are counted in `nccl_stats()` until then.
pub(super) unsafe extern "C" fn mem_address_free(ptr: CUdeviceptr, size: usize) -> CUresult {
    let Some(f) = real::FREE() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    let mut reg = registry::lock();
    if let Some(run) = reg.run_over(ptr, size as u64) {
        run.dead.push((ptr, size as u64));
        return CUDA_SUCCESS;
    }
    // A range of memsaver's reservations: its record goes (own space is free again).
    if reg.free_range(ptr) {
        return CUDA_SUCCESS;
    }
    drop(reg);
    // SAFETY: forwarded unchanged.
    unsafe { f(ptr, size) }
}

pub(super) unsafe extern "C" fn mem_props(
    prop: *mut CUmemAllocationProp,
    handle: CUmemGenericAllocationHandle,
) -> CUresult {
    if let Some(p) = registry::lock().physicals.get(&handle) {
        if prop.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: the caller's out-pointer.
        unsafe { *prop = p.prop };
        return CUDA_SUCCESS;
    }
    let Some(f) = real::PROPS() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: not one of ours: forwarded unchanged.
    unsafe { f(prop, handle) }
}

pub(super) unsafe extern "C" fn mem_range(
    base: *mut CUdeviceptr,
    size: *mut usize,
    ptr: CUdeviceptr,
) -> CUresult {
    {
        let reg = registry::lock();
        if let Some((b, m)) = reg.mapping_at(ptr)
            && reg.physicals.get(&m.vh).is_some_and(|p| {
                p.real().is_none() || p.run.is_some() || p.kind == Kind::Registered
            })
        {
            // Paused, the driver no longer knows the range; in a run, it knows the run's; a
            // peer's registered buffer may be mapped in a window of NCCL's range: answer from
            // the record.
            // SAFETY: the caller's out-pointers (either may be NULL).
            unsafe {
                if !base.is_null() {
                    *base = b;
                }
                if !size.is_null() {
                    *size = m.size as usize;
                }
            }
            return CUDA_SUCCESS;
        }
    }
    let Some(f) = real::RANGE() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: forwarded unchanged.
    let r = unsafe { f(base, size, ptr) };
    if r == CUDA_SUCCESS && !base.is_null() {
        // SAFETY: written by the driver on success.
        RANGE_ASKED.set((unsafe { *base }, ptr));
    }
    r
}
