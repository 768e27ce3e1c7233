//! Per-process VMM tables: allocation handles, reserved virtual ranges, mappings, and pinned
//! host blocks; and the operations on them.
//!
//! Vocabulary, as in the CUDA driver: a *handle* names a physical allocation in this process
//! (created, imported or retained; reference-counted, released with `cuMemRelease`); a
//! *reservation* is a range of virtual addresses (`cuMemAddressReserve`); a *mapping* puts an
//! allocation at a range inside a reservation (`cuMemMap`); *access* makes it readable/writable
//! (`cuMemSetAccess`).
//!
//! Virtual addresses are real addresses of this process: a reservation is a `PROT_NONE`
//! anonymous mapping, a mapping replaces part of it with a `MAP_SHARED` mapping of the
//! allocation's file, and unmapping puts a `PROT_NONE` anonymous mapping back, so the range stays
//! reserved and the file reference is dropped.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{IntoRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memsaver_allocator::driver::sys::{
    CU_MEM_ACCESS_FLAGS_PROT_NONE, CU_MEM_ACCESS_FLAGS_PROT_READ,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ALLOCATION_TYPE_PINNED,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_LOCATION_TYPE_DEVICE,
    CU_MEM_LOCATION_TYPE_HOST, CU_MEM_LOCATION_TYPE_HOST_NUMA,
    CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT, CUDA_ERROR_ALREADY_MAPPED, CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN,
    CUdeviceptr, CUmemAccessDesc, CUmemAllocFlags, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUmemLocation, CUresult,
};
use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::config::Config;
use crate::context;
use crate::faults;
use crate::physical::{self, PhysFile, Place};

/// Allocation granularity (minimum and recommended), as on H100/H200.
pub const GRANULARITY: u64 = 2 << 20;

/// Handle types this fake can export on Linux (POSIX fds only; no fabric, no Win32).
const SUPPORTED_HANDLE_TYPES: c_uint = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// The tables. One lock, because map, unmap and free must check and change reservations,
/// mappings and handles together; copies hold it for reading so that no range they touch can
/// be unmapped under them.
static STATE: RwLock<State> = RwLock::new(State::new());

/// Pinned host blocks from `cuMemHostAlloc`: address -> size. Guarded separately because it is
/// unrelated to the VMM tables.
static HOST_BLOCKS: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// Handle values are process-unique and never reused.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(0x7e57_0000_0001);

struct State {
    /// Handle value -> the allocation and its user references (create/import/retain add one,
    /// `cuMemRelease` removes one; the entry goes at zero).
    handles: BTreeMap<CUmemGenericAllocationHandle, HandleEntry>,
    /// Reservation start -> size.
    reservations: BTreeMap<u64, u64>,
    /// Mapping start -> mapping. Mappings never overlap and each lies in reservations that follow
    /// each other without a gap (usually one).
    mappings: BTreeMap<u64, Mapping>,
}

struct HandleEntry {
    alloc: Arc<Allocation>,
    refs: u32,
}

/// One physical allocation as this process knows it, under one handle value.
struct Allocation {
    handle: CUmemGenericAllocationHandle,
    phys: PhysFile,
    prop: Prop,
}

/// `CUmemAllocationProp` without its (Windows-only) pointer field.
#[derive(Clone, Copy)]
struct Prop {
    type_: c_uint,
    requested_handle_types: c_uint,
    location: CUmemLocation,
    alloc_flags: CUmemAllocFlags,
}

impl Prop {
    fn to_c(self) -> CUmemAllocationProp {
        CUmemAllocationProp {
            type_: self.type_,
            requestedHandleTypes: self.requested_handle_types,
            location: self.location,
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: self.alloc_flags,
        }
    }
}

/// A whole allocation mapped at one range (`cuMemMap` maps nothing less), so `size` is the
/// allocation's size.
struct Mapping {
    size: u64,
    /// Keeps this process's fd on the allocation for as long as the mapping exists (the `mmap`
    /// would keep the memory alive anyway) and remembers the handle for
    /// `cuMemRetainAllocationHandle`.
    alloc: Arc<Allocation>,
    /// Access flags per granule (`CU_MEM_ACCESS_FLAGS_*`), as set by `cuMemSetAccess`.
    access: Vec<c_uint>,
}

impl State {
    const fn new() -> Self {
        Self {
            handles: BTreeMap::new(),
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
        }
    }

    fn handle(&self, h: CUmemGenericAllocationHandle) -> Result<&Arc<Allocation>, CUresult> {
        self.handles
            .get(&h)
            .map(|e| &e.alloc)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    fn add_handle(&mut self, alloc: Arc<Allocation>) {
        self.handles
            .entry(alloc.handle)
            .or_insert_with(|| HandleEntry { alloc, refs: 0 })
            .refs += 1;
    }

    /// The reservation that contains `[ptr, ptr + size)`.
    fn reservation_containing(&self, ptr: u64, size: u64) -> Option<(u64, u64)> {
        let (&start, &len) = self.reservations.range(..=ptr).next_back()?;
        (ptr + size <= start + len).then_some((start, len))
    }

    /// Whether `[ptr, ptr + size)` is covered by reservations that follow each other without a
    /// gap. The real driver maps one handle across adjacent reservations (measured on an H100,
    /// driver 580: `bench/vmm_runs.py`), so the fake does too.
    fn reserved_without_gaps(&self, ptr: u64, size: u64) -> bool {
        let mut at = ptr;
        while at < ptr + size {
            match self.reservation_containing(at, 1) {
                Some((start, len)) => at = start + len,
                None => return false,
            }
        }
        true
    }

    /// Whether a mapping reaches into `[ptr, ptr + size)` from outside it.
    fn mapping_crosses(&self, ptr: u64, size: u64) -> bool {
        let before = self.mapping_at(ptr.wrapping_sub(1));
        let last = self.mapping_at(ptr + size - 1);
        before.is_some_and(|(s, m)| s + m.size > ptr)
            || last.is_some_and(|(s, m)| s + m.size > ptr + size)
    }

    /// The mapping that contains `addr`.
    fn mapping_at(&self, addr: u64) -> Option<(u64, &Mapping)> {
        let (&start, m) = self.mappings.range(..=addr).next_back()?;
        (addr < start + m.size).then_some((start, m))
    }

    fn overlaps_mapping(&self, ptr: u64, size: u64) -> bool {
        self.mappings
            .range(..ptr + size)
            .next_back()
            .is_some_and(|(&s, m)| s + m.size > ptr)
    }

    /// The starts of the mappings that together cover `[ptr, ptr + size)` without a gap.
    fn covering(&self, ptr: u64, size: u64) -> Option<Vec<u64>> {
        let mut starts = Vec::new();
        let mut at = ptr;
        let end = ptr + size;
        while at < end {
            let (start, m) = self.mapping_at(at)?;
            starts.push(start);
            at = start + m.size;
        }
        Some(starts)
    }
}

fn aligned(x: u64) -> bool {
    x.is_multiple_of(GRANULARITY)
}

fn valid_range(ptr: u64, size: u64) -> Result<(), CUresult> {
    if size == 0 || !aligned(ptr) || !aligned(size) || ptr.checked_add(size).is_none() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

/// Where a property's location points: device memory of a valid ordinal, or host memory.
fn place_of(cfg: &Config, location: CUmemLocation) -> Result<Place, CUresult> {
    match location.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => Ok(Place::Device(context::device(cfg, location.id)?)),
        CU_MEM_LOCATION_TYPE_HOST
        | CU_MEM_LOCATION_TYPE_HOST_NUMA
        | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => Ok(Place::Host),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// `cuMemGetAllocationGranularity`.
pub fn granularity(
    cfg: &Config,
    prop: &CUmemAllocationProp,
    option: c_uint,
) -> Result<usize, CUresult> {
    if option > 1 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    place_of(cfg, prop.location)?;
    Ok(GRANULARITY as usize)
}

/// `cuMemCreate`.
pub fn create(
    cfg: &Config,
    size: usize,
    prop: &CUmemAllocationProp,
    flags: u64,
) -> Result<CUmemGenericAllocationHandle, CUresult> {
    if faults::CREATE.hit(cfg.fail_create_at) || faults::over_create_limit(size as u64) {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let size = size as u64;
    if flags != 0 || prop.type_ != CU_MEM_ALLOCATION_TYPE_PINNED || size == 0 || !aligned(size) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if prop.requestedHandleTypes & !SUPPORTED_HANDLE_TYPES != 0 {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let place = place_of(cfg, prop.location)?;
    let phys = physical::create(cfg, place, size)?;
    let prop = Prop {
        type_: prop.type_,
        requested_handle_types: prop.requestedHandleTypes,
        location: prop.location,
        alloc_flags: prop.allocFlags,
    };
    Ok(insert_handle(phys, prop))
}

fn insert_handle(phys: PhysFile, prop: Prop) -> CUmemGenericAllocationHandle {
    let handle = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
    STATE
        .write()
        .add_handle(Arc::new(Allocation { handle, phys, prop }));
    handle
}

/// `cuMemRelease`: drops one reference; the fd closes when no handle reference and no mapping
/// of this process is left (mappings keep the memory alive, as on the real driver).
pub fn release(handle: CUmemGenericAllocationHandle) -> Result<(), CUresult> {
    let dropped = {
        let mut st = STATE.write();
        let entry = st
            .handles
            .get_mut(&handle)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        entry.refs -= 1;
        if entry.refs == 0 {
            st.handles.remove(&handle)
        } else {
            None
        }
    };
    // The fd may close here, and closing may reap the file: outside the table lock.
    drop(dropped);
    Ok(())
}

/// Number of handle values of this process not yet fully released.
pub fn live_handles() -> u64 {
    STATE.read().handles.len() as u64
}

/// `cuMemAddressReserve`.
pub fn reserve(
    size: usize,
    alignment: usize,
    hint: CUdeviceptr,
    flags: u64,
) -> Result<CUdeviceptr, CUresult> {
    let (size, alignment) = (size as u64, alignment as u64);
    if flags != 0 || size == 0 || !aligned(size) || (alignment != 0 && !alignment.is_power_of_two())
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if faults::RESERVE.hit(None) {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let align = alignment.max(GRANULARITY);
    let mut st = STATE.write();
    let ptr = match try_reserve_at(hint, size, align) {
        Some(p) => p,
        None => reserve_anywhere(size, align)?,
    };
    st.reservations.insert(ptr, size);
    Ok(ptr)
}

const RESERVE_FLAGS: c_int = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;

/// Reserves exactly at `hint` if it is aligned and free (the hint is only a hint).
fn try_reserve_at(hint: u64, size: u64, align: u64) -> Option<u64> {
    if hint == 0 || !hint.is_multiple_of(align) {
        return None;
    }
    // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; the kernel picks or refuses.
    let p = unsafe {
        libc::mmap(
            hint as *mut c_void,
            size as usize,
            libc::PROT_NONE,
            RESERVE_FLAGS | libc::MAP_FIXED_NOREPLACE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    if p as u64 == hint {
        return Some(hint);
    }
    // SAFETY: an old kernel ignored NOREPLACE and put a fresh mapping elsewhere; it is ours.
    unsafe { libc::munmap(p, size as usize) };
    None
}

/// Free address space left above a reservation made anywhere. The real driver keeps device
/// addresses apart from host mappings and honours a hint right after a reservation, so
/// reservations can be made one after the other; the host's mmap allocates top-down and would
/// fill the space above at once. Leaving a gap there keeps hints working as on a GPU; it must
/// outlast the host memory a process maps meanwhile (pinned backups of every buffer of a job
/// with 8 ranks and 8 communicators fill 1 GiB from the top down).
const HEADROOM: u64 = 16 << 30;

/// Reserves `size` bytes aligned to `align`: over-reserve, then trim both ends, keeping the
/// bottom of the range (see [`HEADROOM`]).
fn reserve_anywhere(size: u64, align: u64) -> Result<u64, CUresult> {
    let total = size
        .checked_add(align)
        .and_then(|t| t.checked_add(HEADROOM))
        .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
    // SAFETY: a new anonymous PROT_NONE mapping at a kernel-chosen address touches nothing else.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total as usize,
            libc::PROT_NONE,
            RESERVE_FLAGS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let base = p as u64;
    let start = base.next_multiple_of(align);
    let (head, tail) = (start - base, base + total - (start + size));
    // SAFETY: both trimmed pieces lie inside the mapping just created and are not used.
    unsafe {
        if head > 0 {
            libc::munmap(p, head as usize);
        }
        if tail > 0 {
            libc::munmap((start + size) as *mut c_void, tail as usize);
        }
    }
    Ok(start)
}

/// `cuMemAddressFree`: `[ptr, ptr + size)` must be exactly one reservation. Lenient where the
/// real driver is not: mappings still inside it are dropped.
pub fn address_free(ptr: CUdeviceptr, size: usize) -> Result<(), CUresult> {
    let size = size as u64;
    let dropped = {
        let mut st = STATE.write();
        if st.reservations.get(&ptr) != Some(&size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // A mapping across this reservation and its neighbour cannot be half freed.
        if st.mapping_crosses(ptr, size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inside: Vec<u64> = st
            .mappings
            .range(ptr..ptr + size)
            .map(|(&s, _)| s)
            .collect();
        let dropped: Vec<Mapping> = inside
            .iter()
            .filter_map(|s| st.mappings.remove(s))
            .collect();
        // SAFETY: the range is a reservation of this library (checked above), so unmapping it
        // (file mappings included) frees nothing that anyone else owns.
        if unsafe { libc::munmap(ptr as *mut c_void, size as usize) } != 0 {
            return Err(CUDA_ERROR_UNKNOWN);
        }
        st.reservations.remove(&ptr);
        dropped
    };
    drop(dropped);
    Ok(())
}

/// `cuMemMap`.
pub fn map(
    cfg: &Config,
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> Result<(), CUresult> {
    if faults::MAP.hit(cfg.fail_map_at) {
        // A generic driver failure, distinct from running out of memory (which the memory
        // limit and the create fault already model).
        return Err(CUDA_ERROR_UNKNOWN);
    }
    let size = size as u64;
    valid_range(ptr, size)?;
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut st = STATE.write();
    let alloc = Arc::clone(st.handle(handle)?);
    if size > alloc.phys.size() || !st.reserved_without_gaps(ptr, size) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // Only whole allocations map: part of one (a nonzero offset, or less than its size) is
    // CUDA_ERROR_NOT_SUPPORTED on the real driver (H100, driver 580), whatever its documentation
    // says (`tests/gpu/vmm_rules.py`).
    if offset != 0 || size < alloc.phys.size() {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    if st.overlaps_mapping(ptr, size) {
        return Err(CUDA_ERROR_ALREADY_MAPPED);
    }
    // SAFETY: [ptr, ptr + size) lies in a reservation of this library with no mapping in it, so
    // MAP_FIXED replaces only our own PROT_NONE placeholder; the fd is open (held by `alloc`).
    let p = unsafe {
        libc::mmap(
            ptr as *mut c_void,
            size as usize,
            libc::PROT_NONE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            alloc.phys.raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    let granules = (size / GRANULARITY) as usize;
    st.mappings.insert(
        ptr,
        Mapping {
            size,
            alloc,
            access: vec![CU_MEM_ACCESS_FLAGS_PROT_NONE; granules],
        },
    );
    Ok(())
}

/// `cuMemUnmap`: `[ptr, ptr + size)` must be made of whole mappings, without gaps.
pub fn unmap(ptr: CUdeviceptr, size: usize) -> Result<(), CUresult> {
    if faults::UNMAP.hit(None) {
        return Err(CUDA_ERROR_UNKNOWN);
    }
    let size = size as u64;
    valid_range(ptr, size)?;
    let dropped = {
        let mut st = STATE.write();
        let starts = st.covering(ptr, size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let last = starts
            .last()
            .and_then(|s| st.mappings.get(s))
            .map(|m| m.size);
        if starts.first() != Some(&ptr)
            || starts.last().zip(last).map(|(s, l)| s + l) != Some(ptr + size)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the range is exactly our mappings (checked above); MAP_FIXED swaps them for a
        // PROT_NONE placeholder, which keeps the range reserved and drops the file references.
        let p = unsafe {
            libc::mmap(
                ptr as *mut c_void,
                size as usize,
                libc::PROT_NONE,
                RESERVE_FLAGS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_UNKNOWN);
        }
        starts
            .iter()
            .filter_map(|s| st.mappings.remove(s))
            .collect::<Vec<_>>()
    };
    drop(dropped);
    Ok(())
}

/// `cuMemSetAccess`: the range must be fully mapped; the fake has one memory, so the widest
/// access any descriptor grants applies.
pub fn set_access(
    cfg: &Config,
    ptr: CUdeviceptr,
    size: usize,
    descs: &[CUmemAccessDesc],
) -> Result<(), CUresult> {
    let size = size as u64;
    valid_range(ptr, size)?;
    if descs.is_empty() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    for d in descs {
        if d.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        context::device(cfg, d.location.id)?;
        match d.flags {
            CU_MEM_ACCESS_FLAGS_PROT_NONE
            | CU_MEM_ACCESS_FLAGS_PROT_READ
            | CU_MEM_ACCESS_FLAGS_PROT_READWRITE => flags = flags.max(d.flags),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
    let prot = match flags {
        CU_MEM_ACCESS_FLAGS_PROT_READWRITE => libc::PROT_READ | libc::PROT_WRITE,
        CU_MEM_ACCESS_FLAGS_PROT_READ => libc::PROT_READ,
        _ => libc::PROT_NONE,
    };
    let mut st = STATE.write();
    let starts = st.covering(ptr, size).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // Whole mappings only, as on the real driver (an H200, driver 580.159.04: part of one
    // mapping is CUDA_ERROR_INVALID_VALUE, before and after the whole was granted).
    let whole = starts.first() == Some(&ptr)
        && starts
            .last()
            .is_some_and(|last| last + st.mappings[last].size == ptr + size);
    if !whole {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the range is fully covered by our file mappings (checked above); mprotect
    // changes only their protection.
    if unsafe { libc::mprotect(ptr as *mut c_void, size as usize, prot) } != 0 {
        return Err(CUDA_ERROR_UNKNOWN);
    }
    for start in starts {
        let m = st
            .mappings
            .get_mut(&start)
            .expect("covering returned a mapping start");
        let from = ptr.max(start);
        let to = (ptr + size).min(start + m.size);
        let granules =
            ((from - start) / GRANULARITY) as usize..((to - start) / GRANULARITY) as usize;
        m.access[granules].fill(flags);
    }
    Ok(())
}

/// `cuMemRetainAllocationHandle`: the handle the mapping at `addr` was made with, one more
/// reference on it. An unmapped address fails with `CUDA_ERROR_INVALID_VALUE`, as on the real
/// driver.
pub fn retain(addr: u64) -> Result<CUmemGenericAllocationHandle, CUresult> {
    let mut st = STATE.write();
    let alloc = Arc::clone(&st.mapping_at(addr).ok_or(CUDA_ERROR_INVALID_VALUE)?.1.alloc);
    let handle = alloc.handle;
    st.add_handle(alloc);
    Ok(handle)
}

/// `cuMemGetAddressRange_v2`: the mapping containing `addr`.
pub fn address_range(addr: CUdeviceptr) -> Result<(CUdeviceptr, usize), CUresult> {
    let st = STATE.read();
    let (start, m) = st.mapping_at(addr).ok_or(CUDA_ERROR_NOT_FOUND)?;
    Ok((start, m.size as usize))
}

/// `cuMemGetAllocationPropertiesFromHandle`.
pub fn properties(handle: CUmemGenericAllocationHandle) -> Result<CUmemAllocationProp, CUresult> {
    Ok(STATE.read().handle(handle)?.prop.to_c())
}

/// `cuMemExportToShareableHandle` for POSIX fds: a new fd each call, owned by the caller.
pub fn export(
    handle: CUmemGenericAllocationHandle,
    handle_type: c_uint,
    flags: u64,
) -> Result<RawFd, CUresult> {
    if handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let st = STATE.read();
    let alloc = st.handle(handle)?;
    if alloc.prop.requested_handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(alloc.phys.export()?.into_raw_fd())
}

/// `cuMemImportFromShareableHandle` for POSIX fds: a new handle holding its own `dup` of `fd`.
pub fn import(fd: RawFd, handle_type: c_uint) -> Result<CUmemGenericAllocationHandle, CUresult> {
    if handle_type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    let phys = physical::import(fd)?;
    let location = match phys.place() {
        Place::Device(dev) => CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        Place::Host => CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_HOST_NUMA,
            id: 0,
        },
    };
    let prop = Prop {
        type_: CU_MEM_ALLOCATION_TYPE_PINNED,
        requested_handle_types: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location,
        alloc_flags: CUmemAllocFlags::default(),
    };
    Ok(insert_handle(phys, prop))
}

/// A byte range that a copy or memset may touch, checked and held: while the guard lives, no
/// mapping in it can be removed.
pub struct Access {
    _guard: RwLockReadGuard<'static, State>,
}

/// Checks that `[addr, addr + len)` is device memory mapped with the needed access, or a pinned
/// host block; `CUDA_ERROR_INVALID_VALUE` otherwise (the fake faults nothing: it would crash
/// the process instead of returning an error).
pub fn access(addr: CUdeviceptr, len: usize, write: bool) -> Result<Access, CUresult> {
    let guard = STATE.read();
    let len = len as u64;
    let end = addr.checked_add(len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // Device memory: in reservations, which may follow each other without a gap (one mapping
    // may span them).
    if guard.reservation_containing(addr, len).is_some()
        || (len > 0 && guard.reserved_without_gaps(addr, len))
    {
        let need = if write {
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            CU_MEM_ACCESS_FLAGS_PROT_READ
        };
        let starts = guard.covering(addr, len).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        for start in starts {
            let m = &guard.mappings[&start];
            let from = (addr.max(start) - start) / GRANULARITY;
            let to = (end.min(start + m.size) - start).div_ceil(GRANULARITY);
            if m.access[from as usize..to as usize]
                .iter()
                .any(|&a| a & need != need)
            {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
        return Ok(Access { _guard: guard });
    }
    if is_host_block(addr, len) {
        Ok(Access { _guard: guard })
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

/// Whether `[p, p + len)` lies in one block of `cuMemHostAlloc` memory.
pub fn is_host_block(p: u64, len: u64) -> bool {
    let blocks = HOST_BLOCKS.lock();
    matches!(blocks.range(..=p as usize).next_back(),
        Some((&start, &size)) if p + len <= (start + size) as u64)
}

/// `cuMemHostAlloc`: page-aligned host memory (it is not device memory and is not counted).
pub fn host_alloc(bytes: usize) -> Result<*mut c_void, CUresult> {
    if bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer; 4096 is a power of two multiple of the pointer size.
    if unsafe { libc::posix_memalign(&mut p, 4096, bytes) } != 0 {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    HOST_BLOCKS.lock().insert(p as usize, bytes);
    Ok(p)
}

/// `cuMemFreeHost`.
pub fn host_free(p: *mut c_void) -> Result<(), CUresult> {
    if HOST_BLOCKS.lock().remove(&(p as usize)).is_none() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `p` came from posix_memalign in host_alloc and was just removed from the table,
    // so it is freed exactly once.
    unsafe { libc::free(p) };
    Ok(())
}
