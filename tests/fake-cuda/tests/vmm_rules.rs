//! The real driver's VMM rules as the fake models them, one test each, on the fake loaded with
//! `dlopen` as memsaver loads libcuda. The rules were measured on an H100 (driver 580.159);
//! `tests/gpu/vmm_rules.py` checks them on a GPU (and runs on the fake too, with
//! `MEMSAVER_CUDA_LIB` naming it).
//!
//! The library is `MEMSAVER_FAKE_CUDA_LIB`, else `MEMSAVER_CUDA_LIB`, else
//! `target/fake-cuda/libcuda.so.1`: build it first (`make fake-cuda`; `make test-rust` does).

use std::ffi::{CStr, CString, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock};

use memsaver_allocator::driver::sys::*;

const MIB: usize = 1 << 20;
/// The fake's granularity (2 MiB, as on H100/H200).
const G: usize = 2 * MIB;

/// The driver's VMM entry points, and device 0's primary context.
struct Cuda {
    /// A `CUcontext` (a pointer, which is not `Sync`).
    ctx: usize,
    push: fns::cuCtxPushCurrent_v2,
    create: fns::cuMemCreate,
    release: fns::cuMemRelease,
    reserve: fns::cuMemAddressReserve,
    free: fns::cuMemAddressFree,
    map: fns::cuMemMap,
    unmap: fns::cuMemUnmap,
    set_access: fns::cuMemSetAccess,
    memset: fns::cuMemsetD8_v2,
    range: fns::cuMemGetAddressRange_v2,
}

fn lib_path() -> String {
    ["MEMSAVER_FAKE_CUDA_LIB", "MEMSAVER_CUDA_LIB"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|p| !p.is_empty()))
        .unwrap_or_else(|| {
            format!(
                "{}/../../target/fake-cuda/libcuda.so.1",
                env!("CARGO_MANIFEST_DIR")
            )
        })
}

/// The function `name` of `lib`.
///
/// # Safety
///
/// `lib` is a live handle from `dlopen`; `T` is the `fns` type of `name` (its C signature).
unsafe fn sym<T: Copy>(lib: *mut c_void, name: &CStr) -> T {
    assert_eq!(
        size_of::<T>(),
        size_of::<*mut c_void>(),
        "a function pointer"
    );
    // SAFETY: per this function's contract; `name` is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    assert!(!p.is_null(), "the fake lacks {name:?}");
    // SAFETY: `T` is a function pointer of the symbol's signature (this function's contract).
    unsafe { std::mem::transmute_copy(&p) }
}

/// The fake, loaded and initialised once per process.
fn cuda() -> &'static Cuda {
    static CUDA: OnceLock<Cuda> = OnceLock::new();
    CUDA.get_or_init(|| {
        let path = CString::new(lib_path()).expect("a path without NUL");
        // SAFETY: a NUL-terminated path; the library is the fake driver, whose initialisers
        // only set up its own state.
        let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(
            !lib.is_null(),
            "cannot load {path:?}: run `make fake-cuda` first"
        );
        // SAFETY: `lib` stays loaded (never closed); each symbol is read as its `fns` type;
        // `ctx` is a live out-pointer.
        unsafe {
            let init: fns::cuInit = sym(lib, c"cuInit");
            assert_eq!(init(0), CUDA_SUCCESS, "cuInit");
            let retain: fns::cuDevicePrimaryCtxRetain = sym(lib, c"cuDevicePrimaryCtxRetain");
            let mut ctx = std::ptr::null_mut();
            assert_eq!(
                retain(&mut ctx, 0),
                CUDA_SUCCESS,
                "cuDevicePrimaryCtxRetain"
            );
            Cuda {
                ctx: ctx as usize,
                push: sym(lib, c"cuCtxPushCurrent_v2"),
                create: sym(lib, c"cuMemCreate"),
                release: sym(lib, c"cuMemRelease"),
                reserve: sym(lib, c"cuMemAddressReserve"),
                free: sym(lib, c"cuMemAddressFree"),
                map: sym(lib, c"cuMemMap"),
                unmap: sym(lib, c"cuMemUnmap"),
                set_access: sym(lib, c"cuMemSetAccess"),
                memset: sym(lib, c"cuMemsetD8_v2"),
                range: sym(lib, c"cuMemGetAddressRange_v2"),
            }
        }
    })
}

/// Runs the tests of this file one at a time (the hint test needs the address after its first
/// reservation to stay free until its second), with device 0's context current on the thread
/// (copies need one).
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let c = cuda();
    // SAFETY: a context the fake returned; each test runs on a thread of its own.
    let r = unsafe { (c.push)(c.ctx as CUcontext) };
    assert_eq!(r, CUDA_SUCCESS, "cuCtxPushCurrent");
    guard
}

// Safe wrappers: every pointer passed is a live local, and the fake checks the addresses it is
// given against its own tables (a bad one is an error code, never a fault).

fn create(size: usize) -> CUmemGenericAllocationHandle {
    let prop = CUmemAllocationProp {
        type_: CU_MEM_ALLOCATION_TYPE_PINNED,
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        },
        ..Default::default()
    };
    let mut h = 0;
    // SAFETY: see above.
    let r = unsafe { (cuda().create)(&mut h, size, &prop, 0) };
    assert_eq!(r, CUDA_SUCCESS, "cuMemCreate of {size} bytes");
    h
}

fn release(h: CUmemGenericAllocationHandle) {
    // SAFETY: see above.
    assert_eq!(unsafe { (cuda().release)(h) }, CUDA_SUCCESS, "cuMemRelease");
}

/// `cuMemAddressReserve` at `hint` (0: anywhere); the address given.
fn reserve(size: usize, hint: CUdeviceptr) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: see above.
    let r = unsafe { (cuda().reserve)(&mut p, size, 0, hint, 0) };
    assert_eq!(r, CUDA_SUCCESS, "cuMemAddressReserve of {size} bytes");
    p
}

fn free(va: CUdeviceptr, size: usize) {
    // SAFETY: see above.
    let r = unsafe { (cuda().free)(va, size) };
    assert_eq!(r, CUDA_SUCCESS, "cuMemAddressFree");
}

fn map(va: CUdeviceptr, size: usize, offset: usize, h: CUmemGenericAllocationHandle) -> CUresult {
    // SAFETY: see above.
    unsafe { (cuda().map)(va, size, offset, h, 0) }
}

fn unmap(va: CUdeviceptr, size: usize) -> CUresult {
    // SAFETY: see above.
    unsafe { (cuda().unmap)(va, size) }
}

/// Read-write access for device 0.
fn access(va: CUdeviceptr, size: usize) -> CUresult {
    let desc = CUmemAccessDesc {
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        },
        flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: see above.
    unsafe { (cuda().set_access)(va, size, &desc, 1) }
}

/// Writes the range: it is mapped, with access.
fn memset(va: CUdeviceptr, size: usize) -> CUresult {
    // SAFETY: see above (the fake checks the range before writing).
    unsafe { (cuda().memset)(va, 7, size) }
}

/// `cuMemGetAddressRange`: the mapping holding `va`.
fn mapping_at(va: CUdeviceptr) -> Result<(CUdeviceptr, usize), CUresult> {
    let (mut base, mut size) = (0, 0);
    // SAFETY: see above.
    match unsafe { (cuda().range)(&mut base, &mut size, va) } {
        CUDA_SUCCESS => Ok((base, size)),
        e => Err(e),
    }
}

/// Two allocations of 2 granules side by side in a reservation of 4; their handles.
fn two_side_by_side(base: CUdeviceptr) -> [CUmemGenericAllocationHandle; 2] {
    let (a, b) = (create(2 * G), create(2 * G));
    assert_eq!(map(base, 2 * G, 0, a), CUDA_SUCCESS);
    assert_eq!(map(base + 2 * G as u64, 2 * G, 0, b), CUDA_SUCCESS);
    [a, b]
}

#[test]
fn one_unmap_covers_adjacent_mappings_in_one_reservation() {
    let _serial = serial();
    let base = reserve(4 * G, 0);
    let hs = two_side_by_side(base);
    assert_eq!(unmap(base, 4 * G), CUDA_SUCCESS);
    assert_eq!(mapping_at(base), Err(CUDA_ERROR_NOT_FOUND));
    assert_eq!(mapping_at(base + 2 * G as u64), Err(CUDA_ERROR_NOT_FOUND));
    hs.into_iter().for_each(release);
    free(base, 4 * G);
}

#[test]
fn one_set_access_covers_adjacent_mappings_in_one_reservation() {
    let _serial = serial();
    let base = reserve(4 * G, 0);
    let hs = two_side_by_side(base);
    assert_eq!(access(base, 4 * G), CUDA_SUCCESS);
    assert_eq!(memset(base, 4 * G), CUDA_SUCCESS, "both are accessible");
    assert_eq!(unmap(base, 4 * G), CUDA_SUCCESS);
    hs.into_iter().for_each(release);
    free(base, 4 * G);
}

#[test]
fn one_allocation_maps_whole_where_several_mappings_were() {
    let _serial = serial();
    let base = reserve(4 * G, 0);
    let hs = two_side_by_side(base);
    assert_eq!(unmap(base, 4 * G), CUDA_SUCCESS);
    hs.into_iter().for_each(release);
    let h = create(4 * G);
    assert_eq!(map(base, 4 * G, 0, h), CUDA_SUCCESS);
    assert_eq!(mapping_at(base + 3 * G as u64), Ok((base, 4 * G)));
    assert_eq!(access(base, 4 * G), CUDA_SUCCESS);
    assert_eq!(memset(base, 4 * G), CUDA_SUCCESS);
    assert_eq!(unmap(base, 4 * G), CUDA_SUCCESS);
    release(h);
    free(base, 4 * G);
}

#[test]
fn mappings_sit_anywhere_inside_a_larger_reservation() {
    let _serial = serial();
    let base = reserve(8 * G, 0);
    let (a, b) = (create(2 * G), create(G));
    let (in_middle, at_end) = (base + 3 * G as u64, base + 7 * G as u64);
    assert_eq!(map(in_middle, 2 * G, 0, a), CUDA_SUCCESS);
    assert_eq!(map(at_end, G, 0, b), CUDA_SUCCESS);
    assert_eq!(mapping_at(in_middle + G as u64), Ok((in_middle, 2 * G)));
    assert_eq!(mapping_at(at_end), Ok((at_end, G)));
    assert_eq!(access(in_middle, 2 * G), CUDA_SUCCESS);
    assert_eq!(memset(in_middle, 2 * G), CUDA_SUCCESS);
    assert_eq!(unmap(in_middle, 2 * G), CUDA_SUCCESS);
    assert_eq!(unmap(at_end, G), CUDA_SUCCESS);
    release(a);
    release(b);
    free(base, 8 * G);
}

/// Whatever the documentation says, the real driver maps whole allocations only.
#[test]
fn part_of_an_allocation_does_not_map() {
    let _serial = serial();
    let base = reserve(2 * G, 0);
    let h = create(2 * G);
    assert_eq!(
        map(base, G, 0, h),
        CUDA_ERROR_NOT_SUPPORTED,
        "less than the allocation's size"
    );
    assert_eq!(
        map(base, G, G, h),
        CUDA_ERROR_NOT_SUPPORTED,
        "a nonzero offset"
    );
    assert_eq!(
        mapping_at(base),
        Err(CUDA_ERROR_NOT_FOUND),
        "nothing mapped"
    );
    assert_eq!(map(base, 2 * G, 0, h), CUDA_SUCCESS, "the whole allocation");
    assert_eq!(unmap(base, 2 * G), CUDA_SUCCESS);
    release(h);
    free(base, 2 * G);
}

#[test]
fn part_of_a_mapping_does_not_take_access() {
    let _serial = serial();
    let base = reserve(4 * G, 0);
    let h = create(4 * G);
    assert_eq!(map(base, 4 * G, 0, h), CUDA_SUCCESS);
    assert_eq!(
        access(base + G as u64, G),
        CUDA_ERROR_INVALID_VALUE,
        "before the whole"
    );
    assert_eq!(access(base, 4 * G), CUDA_SUCCESS);
    assert_eq!(
        access(base + 2 * G as u64, G),
        CUDA_ERROR_INVALID_VALUE,
        "after"
    );
    assert_eq!(
        access(base, 3 * G),
        CUDA_ERROR_INVALID_VALUE,
        "all but its end"
    );
    assert_eq!(memset(base, 4 * G), CUDA_SUCCESS, "the whole was granted");
    assert_eq!(unmap(base, 4 * G), CUDA_SUCCESS);
    release(h);
    free(base, 4 * G);
}

#[test]
fn part_of_a_mapping_does_not_unmap() {
    let _serial = serial();
    let base = reserve(2 * G, 0);
    let h = create(2 * G);
    assert_eq!(map(base, 2 * G, 0, h), CUDA_SUCCESS);
    assert_eq!(access(base, 2 * G), CUDA_SUCCESS);
    assert_eq!(unmap(base, G), CUDA_ERROR_INVALID_VALUE, "its first half");
    assert_eq!(
        unmap(base + G as u64, G),
        CUDA_ERROR_INVALID_VALUE,
        "its second half"
    );
    assert_eq!(
        mapping_at(base + G as u64),
        Ok((base, 2 * G)),
        "still mapped"
    );
    assert_eq!(memset(base, 2 * G), CUDA_SUCCESS, "still accessible");
    assert_eq!(unmap(base, 2 * G), CUDA_SUCCESS);
    release(h);
    free(base, 2 * G);
}

/// The real driver honours a hint at the end of an existing reservation when the space there is
/// free, and one handle maps across both reservations (`tests/gpu/vmm_rules.py` on an H100,
/// driver 580.159.04, 2026-11-27; `bench/vmm_runs.py` before it); memsaver's runs rely on it
/// (`docs/architecture.md`, "Runs").
#[test]
fn a_hint_at_the_end_of_a_reservation_is_honoured_and_one_mapping_spans_both() {
    let _serial = serial();
    let a = reserve(2 * G, 0);
    let end = a + 2 * G as u64;
    let b = reserve(2 * G, end);
    assert_eq!(b, end);
    let h = create(4 * G);
    assert_eq!(map(a, 4 * G, 0, h), CUDA_SUCCESS);
    assert_eq!(access(a, 4 * G), CUDA_SUCCESS);
    assert_eq!(memset(a, 4 * G), CUDA_SUCCESS, "one write across both");
    assert_eq!(unmap(a, 4 * G), CUDA_SUCCESS);
    release(h);
    free(a, 2 * G);
    free(b, 2 * G);
}

#[test]
fn an_address_range_is_its_mapping_and_a_reservation_under_a_crossing_mapping_is_not_freed() {
    let _serial = serial();
    let a = reserve(2 * G, 0);
    let b = reserve(2 * G, a + 2 * G as u64);
    assert_eq!(b, a + 2 * G as u64);
    assert_eq!(
        mapping_at(a + G as u64),
        Err(CUDA_ERROR_NOT_FOUND),
        "nothing is mapped there yet"
    );
    let h = create(4 * G);
    assert_eq!(map(a, 4 * G, 0, h), CUDA_SUCCESS);
    // The mapping, across both reservations: not either reservation.
    assert_eq!(mapping_at(a + G as u64), Ok((a, 4 * G)));
    assert_eq!(mapping_at(b + G as u64), Ok((a, 4 * G)));
    // SAFETY: a reservation of this test's.
    let r = unsafe { (cuda().free)(b, 2 * G) };
    assert_eq!(r, CUDA_ERROR_INVALID_VALUE, "a mapping crosses it");
    assert_eq!(unmap(a, 4 * G), CUDA_SUCCESS);
    release(h);
    free(a, 2 * G);
    free(b, 2 * G);
}
