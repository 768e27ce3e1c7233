//! `fake-peer`: one process of a multi-process scenario on the fake CUDA driver.
//!
//! It loads the driver named by `MEMSAVER_CUDA_LIB` with `dlopen`, exactly as memsaver loads
//! libcuda, then reads one command per line on stdin and answers one line on stdout:
//! `ok [values...]` or `err <code>`. The test drives several peers step by step, so that the
//! order of events across processes is the test's to choose. Names (`H`, `V`, `F`, ...) are
//! variables of this process: handles, reserved ranges, file descriptors. Sizes and offsets are
//! in MiB.
//!
//! ```text
//! init [dev]                         cuInit, retain and push device dev's primary context
//! create H MIB [dev=N] [type=posix|none] [loc=device|host]
//! release H                          cuMemRelease
//! handle H                           -> the handle's value
//! props H                            -> type requestedHandleTypes location.type location.id
//! reserve V MIB [align=MIB] [at=ADDR]  -> base address
//! addrfree V                         cuMemAddressFree of the whole range
//! map V OFF H MIB                    cuMemMap at V+OFF
//! unmap V OFF MIB
//! access V OFF MIB rw|r|none         cuMemSetAccess for the current device
//! write V OFF MIB SEED               async copy of a seeded pattern, stream + event sync
//! verify V OFF MIB SEED              sync copy back and compare
//! memset V OFF MIB BYTE / expect V OFF MIB BYTE
//! pinned V OFF MIB SEED              copy into cuMemHostAlloc memory and compare
//! retain H V OFF                     cuMemRetainAllocationHandle(V+OFF) -> handle value
//! range V OFF                        cuMemGetAddressRange(V+OFF) -> base size
//! export F H                         -> fd number
//! import H F                         cuMemImportFromShareableHandle
//! closefd F / devnull F              close an fd / open /dev/null as F
//! listen PATH / accept / connect PATH / sendfd F / recvfd F
//! info                               cuMemGetInfo -> free total (bytes)
//! device                             cuCtxGetDevice -> ordinal
//! sync                               cuCtxSynchronize
//! live                               fakecuda_live_handles
//! failcreate N / failmap N / resetfaults
//! stress THREADS ITERS MIB           threads create/map/write/verify/unmap/release at once
//! exit
//! ```

use std::collections::HashMap;
use std::ffi::{CString, c_int, c_void};
use std::io::{BufRead, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};

use memsaver_allocator::driver::sys::*;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, recvmsg, sendmsg};

const MIB: u64 = 1 << 20;

type FailAt = unsafe extern "C" fn(n: u32) -> CUresult;
type ResetFaults = unsafe extern "C" fn() -> CUresult;
type LiveHandles = unsafe extern "C" fn() -> u64;

/// A symbol address as the function-pointer type `T`.
///
/// # Safety
///
/// `p` must be a function whose signature is `T`, and `T` a function-pointer type.
unsafe fn fn_ptr<T: Copy>(p: *mut c_void) -> T {
    assert_eq!(size_of::<T>(), size_of::<*mut c_void>());
    // SAFETY: pointer-sized, and a function of type T per this function's contract.
    unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) }
}

macro_rules! driver {
    ($($name:ident),* $(,)?) => {
        /// The driver entry points this peer calls, resolved with `dlsym`.
        #[allow(non_snake_case)]
        struct Driver {
            $($name: fns::$name,)*
            fakecuda_fail_create_at: FailAt,
            fakecuda_fail_map_at: FailAt,
            fakecuda_reset_faults: ResetFaults,
            fakecuda_live_handles: LiveHandles,
        }

        impl Driver {
            fn load(path: &str) -> Result<Self, String> {
                let cpath = CString::new(path).map_err(|e| e.to_string())?;
                // SAFETY: a NUL-terminated path; loading the fake driver runs no constructors
                // that need anything from us.
                let lib = unsafe {
                    libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL)
                };
                if lib.is_null() {
                    return Err(format!("dlopen({path}) failed"));
                }
                let sym = |name: &str| -> Result<*mut c_void, String> {
                    let cname = CString::new(name).expect("symbol names have no NUL");
                    // SAFETY: `lib` is a live handle from dlopen; the name is NUL-terminated.
                    let p = unsafe { libc::dlsym(lib, cname.as_ptr()) };
                    if p.is_null() { Err(format!("{path} lacks {name}")) } else { Ok(p) }
                };
                // SAFETY: each symbol is the C function of that name, whose signature is the
                // `fns` type of the same name (the fake checks this at compile time).
                unsafe {
                    Ok(Self {
                        $($name: fn_ptr(sym(stringify!($name))?),)*
                        fakecuda_fail_create_at: fn_ptr(sym("fakecuda_fail_create_at")?),
                        fakecuda_fail_map_at: fn_ptr(sym("fakecuda_fail_map_at")?),
                        fakecuda_reset_faults: fn_ptr(sym("fakecuda_reset_faults")?),
                        fakecuda_live_handles: fn_ptr(sym("fakecuda_live_handles")?),
                    })
                }
            }
        }
    };
}

driver!(
    cuInit,
    cuDevicePrimaryCtxRetain,
    cuCtxPushCurrent_v2,
    cuCtxPopCurrent_v2,
    cuCtxSynchronize,
    cuMemGetInfo_v2,
    cuMemGetAllocationGranularity,
    cuMemCreate,
    cuMemRelease,
    cuMemAddressReserve,
    cuMemAddressFree,
    cuMemMap,
    cuMemUnmap,
    cuMemSetAccess,
    cuMemExportToShareableHandle,
    cuMemImportFromShareableHandle,
    cuMemRetainAllocationHandle,
    cuMemGetAllocationPropertiesFromHandle,
    cuMemGetAddressRange_v2,
    cuStreamCreate,
    cuStreamSynchronize,
    cuStreamDestroy_v2,
    cuEventCreate,
    cuEventRecord,
    cuEventSynchronize,
    cuEventDestroy_v2,
    cuMemcpyDtoHAsync_v2,
    cuMemcpyHtoDAsync_v2,
    cuMemsetD8_v2,
    cuMemHostAlloc,
    cuMemFreeHost,
);

/// `cuCtxGetDevice` and the sync copies are not in `sys::fns`: their types, from `cuda.h`.
type CtxGetDevice = unsafe extern "C" fn(dev: *mut CUdevice) -> CUresult;
type MemcpyDtoH = unsafe extern "C" fn(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult;

/// A failed step: a CUDA code, or a usage/IO problem described in words.
enum Failure {
    Cuda(CUresult),
    Other(String),
}

impl From<String> for Failure {
    fn from(s: String) -> Self {
        Failure::Other(s)
    }
}

type Step<T = String> = Result<T, Failure>;

fn cu(code: CUresult) -> Step<()> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Failure::Cuda(code))
    }
}

/// `len` bytes of the pattern `seed`: pseudo-random within each 64 KiB block, and each block
/// starts with its own index, so that data landing at the wrong place is noticed. Built from
/// one block and copies, so that it stays cheap in debug builds.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    let block_len = len.min(64 << 10).next_multiple_of(8);
    let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(seed);
    let mut block = Vec::with_capacity(block_len);
    while block.len() < block_len {
        // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        block.extend_from_slice(&x.to_le_bytes());
    }
    let mut out = Vec::with_capacity(len + block_len);
    for index in 0..len.div_ceil(block_len) {
        let start = out.len();
        out.extend_from_slice(&block);
        out[start..start + 8].copy_from_slice(&(index as u64 ^ u64::from(seed)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Where `got` first differs from `want`.
fn compare(got: &[u8], want: &[u8]) -> Step<()> {
    if got == want {
        return Ok(());
    }
    let i = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    Err(Failure::Other(format!(
        "mismatch at byte {i} of {}",
        want.len()
    )))
}

struct Peer {
    drv: Driver,
    lib: *mut c_void,
    dev: CUdevice,
    handles: HashMap<String, CUmemGenericAllocationHandle>,
    /// name -> (base, size)
    ranges: HashMap<String, (u64, u64)>,
    fds: HashMap<String, OwnedFd>,
    listener: Option<UnixListener>,
    stream: Option<UnixStream>,
}

fn arg<'a>(args: &[&'a str], i: usize) -> Step<&'a str> {
    args.get(i)
        .copied()
        .ok_or_else(|| Failure::Other(format!("missing argument {i}")))
}

fn num(args: &[&str], i: usize) -> Step<u64> {
    let s = arg(args, i)?;
    let parsed = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|_| Failure::Other(format!("not a number: {s}")))
}

/// `key=value` options after the positional arguments.
fn opt<'a>(args: &[&'a str], key: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(key)?.strip_prefix('='))
}

impl Peer {
    fn handle(&self, name: &str) -> Step<CUmemGenericAllocationHandle> {
        self.handles
            .get(name)
            .copied()
            .ok_or_else(|| Failure::Other(format!("no handle {name}")))
    }

    fn range(&self, name: &str) -> Step<(u64, u64)> {
        self.ranges
            .get(name)
            .copied()
            .ok_or_else(|| Failure::Other(format!("no range {name}")))
    }

    /// `V OFF MIB` -> (address, bytes)
    fn span(&self, args: &[&str], at: usize) -> Step<(u64, usize)> {
        let (base, _) = self.range(arg(args, at)?)?;
        Ok((
            base + num(args, at + 1)? * MIB,
            (num(args, at + 2)? * MIB) as usize,
        ))
    }

    fn symbol<T: Copy>(&self, name: &str) -> Step<T> {
        let cname = CString::new(name).expect("no NUL");
        // SAFETY: `lib` is a live dlopen handle; the name is NUL-terminated.
        let p = unsafe { libc::dlsym(self.lib, cname.as_ptr()) };
        if p.is_null() {
            return Err(Failure::Other(format!("no symbol {name}")));
        }
        // SAFETY: T is the function-pointer type of `name` (the callers say which).
        Ok(unsafe { fn_ptr(p) })
    }

    fn run(&mut self, line: &str) -> Step {
        let args: Vec<&str> = line.split_whitespace().collect();
        let Some((&cmd, args)) = args.split_first() else {
            return Ok(String::new());
        };
        let d = &self.drv;
        // SAFETY (for every driver call below): the arguments are valid pointers to locals or
        // values the driver handed out, as each function's contract asks.
        match cmd {
            "init" => {
                let dev = args.first().map_or(Ok(0), |_| num(args, 0))? as CUdevice;
                let mut ctx = std::ptr::null_mut();
                // SAFETY: see above.
                unsafe {
                    cu((d.cuInit)(0))?;
                    cu((d.cuDevicePrimaryCtxRetain)(&mut ctx, dev))?;
                    cu((d.cuCtxPushCurrent_v2)(ctx))?;
                }
                self.dev = dev;
                Ok(String::new())
            }
            "create" => {
                let size = num(args, 1)? * MIB;
                let dev = opt(args, "dev")
                    .map_or(Ok(self.dev), |s| s.parse().map_err(|_| format!("dev={s}")))?;
                let mut prop = CUmemAllocationProp {
                    type_: CU_MEM_ALLOCATION_TYPE_PINNED,
                    requestedHandleTypes: match opt(args, "type") {
                        Some("none") => CU_MEM_HANDLE_TYPE_NONE,
                        _ => CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    },
                    ..Default::default()
                };
                prop.location = match opt(args, "loc") {
                    Some("host") => CUmemLocation {
                        type_: CU_MEM_LOCATION_TYPE_HOST_NUMA,
                        id: 0,
                    },
                    _ => CUmemLocation {
                        type_: CU_MEM_LOCATION_TYPE_DEVICE,
                        id: dev,
                    },
                };
                let mut gran = 0usize;
                let mut h = 0;
                // SAFETY: see above.
                unsafe {
                    cu((d.cuMemGetAllocationGranularity)(
                        &mut gran,
                        &prop,
                        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                    ))?;
                    cu((d.cuMemCreate)(&mut h, size as usize, &prop, 0))?;
                }
                self.handles.insert(arg(args, 0)?.to_owned(), h);
                Ok(format!("{h}"))
            }
            "release" => {
                let h = self.handle(arg(args, 0)?)?;
                // SAFETY: see above.
                cu(unsafe { (d.cuMemRelease)(h) })?;
                Ok(String::new())
            }
            "handle" => Ok(format!("{}", self.handle(arg(args, 0)?)?)),
            "props" => {
                let h = self.handle(arg(args, 0)?)?;
                let mut p = CUmemAllocationProp::default();
                // SAFETY: see above.
                cu(unsafe { (d.cuMemGetAllocationPropertiesFromHandle)(&mut p, h) })?;
                Ok(format!(
                    "{} {} {} {}",
                    p.type_, p.requestedHandleTypes, p.location.type_, p.location.id
                ))
            }
            "reserve" => {
                let size = num(args, 1)? * MIB;
                let align = opt(args, "align").map_or(0, |a| a.parse::<u64>().unwrap_or(0) * MIB);
                let at = opt(args, "at").map_or(0, |a| a.parse::<u64>().unwrap_or(0));
                let mut p = 0;
                // SAFETY: see above.
                cu(unsafe {
                    (d.cuMemAddressReserve)(&mut p, size as usize, align as usize, at, 0)
                })?;
                self.ranges.insert(arg(args, 0)?.to_owned(), (p, size));
                Ok(format!("{p}"))
            }
            "addrfree" => {
                let (base, size) = self.range(arg(args, 0)?)?;
                // SAFETY: see above.
                cu(unsafe { (d.cuMemAddressFree)(base, size as usize) })?;
                Ok(String::new())
            }
            "map" => {
                let (base, _) = self.range(arg(args, 0)?)?;
                let ptr = base + num(args, 1)? * MIB;
                let h = self.handle(arg(args, 2)?)?;
                let size = num(args, 3)? * MIB;
                // SAFETY: see above.
                cu(unsafe { (d.cuMemMap)(ptr, size as usize, 0, h, 0) })?;
                Ok(String::new())
            }
            "unmap" => {
                let (ptr, len) = self.span(args, 0)?;
                // SAFETY: see above.
                cu(unsafe { (d.cuMemUnmap)(ptr, len) })?;
                Ok(String::new())
            }
            "access" => {
                let (ptr, len) = self.span(args, 0)?;
                let flags = match arg(args, 3)? {
                    "rw" => CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                    "r" => CU_MEM_ACCESS_FLAGS_PROT_READ,
                    _ => CU_MEM_ACCESS_FLAGS_PROT_NONE,
                };
                let desc = CUmemAccessDesc {
                    location: CUmemLocation {
                        type_: CU_MEM_LOCATION_TYPE_DEVICE,
                        id: self.dev,
                    },
                    flags,
                };
                // SAFETY: see above.
                cu(unsafe { (d.cuMemSetAccess)(ptr, len, &desc, 1) })?;
                Ok(String::new())
            }
            "write" => {
                let (ptr, len) = self.span(args, 0)?;
                let seed = num(args, 3)? as u8;
                let buf = pattern(seed, len);
                let (mut stream, mut event) = (std::ptr::null_mut(), std::ptr::null_mut());
                // SAFETY: see above; `buf` outlives the copy, which completes before the
                // event synchronises.
                unsafe {
                    cu((d.cuStreamCreate)(&mut stream, CU_STREAM_NON_BLOCKING))?;
                    cu((d.cuEventCreate)(&mut event, CU_EVENT_DISABLE_TIMING))?;
                    cu((d.cuMemcpyHtoDAsync_v2)(
                        ptr,
                        buf.as_ptr().cast(),
                        len,
                        stream,
                    ))?;
                    cu((d.cuEventRecord)(event, stream))?;
                    cu((d.cuEventSynchronize)(event))?;
                    cu((d.cuStreamSynchronize)(stream))?;
                    cu((d.cuEventDestroy_v2)(event))?;
                    cu((d.cuStreamDestroy_v2)(stream))?;
                }
                Ok(String::new())
            }
            "verify" | "expect" => {
                let (ptr, len) = self.span(args, 0)?;
                let value = num(args, 3)? as u8;
                let dtoh: MemcpyDtoH = self.symbol("cuMemcpyDtoH_v2")?;
                let mut buf = vec![0u8; len];
                // SAFETY: `buf` has room for `len` bytes.
                cu(unsafe { dtoh(buf.as_mut_ptr().cast(), ptr, len) })?;
                let want = if cmd == "verify" {
                    pattern(value, len)
                } else {
                    vec![value; len]
                };
                compare(&buf, &want)?;
                Ok(String::new())
            }
            "memset" => {
                let (ptr, len) = self.span(args, 0)?;
                // SAFETY: see above.
                cu(unsafe { (d.cuMemsetD8_v2)(ptr, num(args, 3)? as u8, len) })?;
                Ok(String::new())
            }
            "pinned" => {
                let (ptr, len) = self.span(args, 0)?;
                let seed = num(args, 3)? as u8;
                let mut host = std::ptr::null_mut();
                // SAFETY: see above; `host` holds `len` bytes until freed below.
                unsafe {
                    cu((d.cuMemHostAlloc)(&mut host, len, CU_MEMHOSTALLOC_PORTABLE))?;
                    let copied = cu((d.cuMemcpyDtoHAsync_v2)(
                        host,
                        ptr,
                        len,
                        std::ptr::null_mut(),
                    ));
                    let same = compare(
                        std::slice::from_raw_parts(host.cast::<u8>(), len),
                        &pattern(seed, len),
                    );
                    cu((d.cuMemFreeHost)(host))?;
                    copied?;
                    same?;
                }
                Ok(String::new())
            }
            "retain" => {
                let (base, _) = self.range(arg(args, 1)?)?;
                let addr = base + num(args, 2)? * MIB;
                let mut h = 0;
                // SAFETY: see above.
                cu(unsafe { (d.cuMemRetainAllocationHandle)(&mut h, addr as *mut c_void) })?;
                self.handles.insert(arg(args, 0)?.to_owned(), h);
                Ok(format!("{h}"))
            }
            "range" => {
                let (base, _) = self.range(arg(args, 0)?)?;
                let addr = base + num(args, 1)? * MIB;
                let (mut b, mut s) = (0, 0);
                // SAFETY: see above.
                cu(unsafe { (d.cuMemGetAddressRange_v2)(&mut b, &mut s, addr) })?;
                Ok(format!("{b} {s}"))
            }
            "export" => {
                let h = self.handle(arg(args, 1)?)?;
                let mut fd: c_int = -1;
                // SAFETY: see above; for POSIX fds the out-parameter is an int.
                cu(unsafe {
                    (d.cuMemExportToShareableHandle)(
                        (&raw mut fd).cast(),
                        h,
                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        0,
                    )
                })?;
                // SAFETY: the driver just handed us this new fd to own.
                self.fds.insert(arg(args, 0)?.to_owned(), unsafe {
                    OwnedFd::from_raw_fd(fd)
                });
                Ok(format!("{fd}"))
            }
            "import" => {
                let fd = self.fd(arg(args, 1)?)?;
                let mut h = 0;
                // SAFETY: see above; the fd is passed by value, as NCCL does.
                cu(unsafe {
                    (d.cuMemImportFromShareableHandle)(
                        &mut h,
                        fd as isize as *mut c_void,
                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                })?;
                self.handles.insert(arg(args, 0)?.to_owned(), h);
                Ok(format!("{h}"))
            }
            "closefd" => {
                let fd = self
                    .fds
                    .remove(arg(args, 0)?)
                    .ok_or_else(|| format!("no fd {}", args[0]))?;
                drop(fd);
                Ok(String::new())
            }
            "devnull" => {
                let f = std::fs::File::open("/dev/null").map_err(|e| e.to_string())?;
                let fd = OwnedFd::from(f);
                let n = fd.as_raw_fd();
                self.fds.insert(arg(args, 0)?.to_owned(), fd);
                Ok(format!("{n}"))
            }
            "listen" => {
                self.listener = Some(UnixListener::bind(arg(args, 0)?).map_err(|e| e.to_string())?);
                Ok(String::new())
            }
            "accept" => {
                let l = self.listener.as_ref().ok_or("not listening".to_owned())?;
                self.stream = Some(l.accept().map_err(|e| e.to_string())?.0);
                Ok(String::new())
            }
            "connect" => {
                self.stream = Some(UnixStream::connect(arg(args, 0)?).map_err(|e| e.to_string())?);
                Ok(String::new())
            }
            "sendfd" => {
                let fd = self.fd(arg(args, 0)?)?;
                let sock = self.stream.as_ref().ok_or("not connected".to_owned())?;
                let fds = [fd];
                sendmsg::<UnixAddr>(
                    sock.as_raw_fd(),
                    &[IoSlice::new(b"F")],
                    &[ControlMessage::ScmRights(&fds)],
                    MsgFlags::empty(),
                    None,
                )
                .map_err(|e| format!("sendmsg: {e}"))?;
                Ok(String::new())
            }
            "recvfd" => {
                let sock = self.stream.as_ref().ok_or("not connected".to_owned())?;
                let mut byte = [0u8; 1];
                let mut iov = [IoSliceMut::new(&mut byte)];
                let mut space = nix::cmsg_space!([RawFd; 1]);
                let msg = recvmsg::<UnixAddr>(
                    sock.as_raw_fd(),
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                )
                .map_err(|e| format!("recvmsg: {e}"))?;
                let mut got = None;
                for c in msg.cmsgs().map_err(|e| format!("cmsgs: {e}"))? {
                    if let ControlMessageOwned::ScmRights(fds) = c {
                        got = fds.first().copied();
                    }
                }
                let fd = got.ok_or("no fd received".to_owned())?;
                // SAFETY: SCM_RIGHTS installed this fd in our table for us to own.
                self.fds.insert(arg(args, 0)?.to_owned(), unsafe {
                    OwnedFd::from_raw_fd(fd)
                });
                Ok(format!("{fd}"))
            }
            "info" => {
                let (mut free, mut total) = (0, 0);
                // SAFETY: see above.
                cu(unsafe { (d.cuMemGetInfo_v2)(&mut free, &mut total) })?;
                Ok(format!("{free} {total}"))
            }
            "sync" => {
                // SAFETY: no arguments.
                cu(unsafe { (d.cuCtxSynchronize)() })?;
                Ok(String::new())
            }
            "device" => {
                let get: CtxGetDevice = self.symbol("cuCtxGetDevice")?;
                let mut dev = -1;
                // SAFETY: a valid out-pointer.
                cu(unsafe { get(&mut dev) })?;
                Ok(format!("{dev}"))
            }
            "live" => {
                // SAFETY: no arguments.
                let n = unsafe { (d.fakecuda_live_handles)() };
                Ok(format!("{n}"))
            }
            "failcreate" => {
                // SAFETY: see above.
                cu(unsafe { (d.fakecuda_fail_create_at)(num(args, 0)? as u32) })?;
                Ok(String::new())
            }
            "failmap" => {
                // SAFETY: see above.
                cu(unsafe { (d.fakecuda_fail_map_at)(num(args, 0)? as u32) })?;
                Ok(String::new())
            }
            "resetfaults" => {
                // SAFETY: see above.
                cu(unsafe { (d.fakecuda_reset_faults)() })?;
                Ok(String::new())
            }
            "stress" => self.stress(
                num(args, 0)? as usize,
                num(args, 1)? as usize,
                num(args, 2)? * MIB,
            ),
            "exit" => std::process::exit(0),
            other => Err(Failure::Other(format!("unknown command {other}"))),
        }
    }

    fn fd(&self, name: &str) -> Step<RawFd> {
        self.fds
            .get(name)
            .map(|f| f.as_raw_fd())
            .ok_or_else(|| Failure::Other(format!("no fd {name}")))
    }

    /// Many threads through the whole VMM cycle at once, each checking its own contents.
    fn stress(&self, threads: usize, iters: usize, size: u64) -> Step {
        let d = &self.drv;
        let dev = self.dev;
        let failures: Vec<String> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    s.spawn(move || -> Result<(), String> {
                        for i in 0..iters {
                            one_cycle(d, dev, size, (t * 31 + i) as u8)
                                .map_err(|c| format!("thread {t} iteration {i}: {c}"))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .filter_map(|w| w.join().expect("worker panicked").err())
                .collect()
        });
        if failures.is_empty() {
            Ok(String::new())
        } else {
            Err(Failure::Other(failures.join("; ")))
        }
    }
}

/// create, reserve, map, set access, write, read back, unmap, release, free.
fn one_cycle(d: &Driver, dev: CUdevice, size: u64, seed: u8) -> Result<(), String> {
    let prop = CUmemAllocationProp {
        type_: CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: dev,
        },
        ..Default::default()
    };
    let desc = CUmemAccessDesc {
        location: prop.location,
        flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    let len = size as usize;
    let data = pattern(seed, len);
    let mut back = vec![0u8; len];
    let (mut h, mut p) = (0, 0);
    let check = |what: &str, code: CUresult| {
        if code == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what}: {code}"))
        }
    };
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid pointers to locals; `data` and `back` hold `len` bytes. Each worker thread
    // makes the device's primary context current, as copies need one.
    unsafe {
        check("retain", (d.cuDevicePrimaryCtxRetain)(&mut ctx, dev))?;
        check("push", (d.cuCtxPushCurrent_v2)(ctx))?;
        check("create", (d.cuMemCreate)(&mut h, len, &prop, 0))?;
        check("reserve", (d.cuMemAddressReserve)(&mut p, len, 0, 0, 0))?;
        check("map", (d.cuMemMap)(p, len, 0, h, 0))?;
        check("access", (d.cuMemSetAccess)(p, len, &desc, 1))?;
        check(
            "htod",
            (d.cuMemcpyHtoDAsync_v2)(p, data.as_ptr().cast(), len, std::ptr::null_mut()),
        )?;
        check(
            "dtoh",
            (d.cuMemcpyDtoHAsync_v2)(back.as_mut_ptr().cast(), p, len, std::ptr::null_mut()),
        )?;
        check("unmap", (d.cuMemUnmap)(p, len))?;
        check("release", (d.cuMemRelease)(h))?;
        check("free", (d.cuMemAddressFree)(p, len))?;
        check("pop", (d.cuCtxPopCurrent_v2)(&mut ctx))?;
    }
    if back != data {
        return Err("contents differ".into());
    }
    Ok(())
}

fn main() {
    let path = std::env::var("MEMSAVER_CUDA_LIB").unwrap_or_else(|_| {
        eprintln!("fake-peer: set MEMSAVER_CUDA_LIB to the fake driver's path");
        std::process::exit(2)
    });
    let drv = Driver::load(&path).unwrap_or_else(|e| {
        eprintln!("fake-peer: {e}");
        std::process::exit(2)
    });
    let cpath = CString::new(path).expect("no NUL");
    // SAFETY: the library is already loaded; RTLD_NOLOAD only returns its handle.
    let lib = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    let mut peer = Peer {
        drv,
        lib,
        dev: 0,
        handles: HashMap::new(),
        ranges: HashMap::new(),
        fds: HashMap::new(),
        listener: None,
        stream: None,
    };
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let reply = match peer.run(&line) {
            Ok(v) if v.is_empty() => "ok".to_owned(),
            Ok(v) => format!("ok {v}"),
            Err(Failure::Cuda(code)) => format!("err {code}"),
            Err(Failure::Other(msg)) => format!("fail {msg}"),
        };
        if writeln!(out, "{reply}").and_then(|()| out.flush()).is_err() {
            break;
        }
    }
}
