//! `nccl-rank`: one rank of a multi-process NCCL-like job on the fake driver, for the
//! cross-process scenarios of the `nccl` tag. Run under `LD_PRELOAD=libmemsaver.so`.
//!
//! `nccl-rank <libnccl.so.2> <libcuda.so.1> <rendezvous dir> <rank> <world>`, then one command
//! per line on stdin, one answer line on stdout (`ok ...` or `err ...`):
//!
//! ```text
//! alloc MIB        allocate this rank's buffer through the fake NCCL and export it
//! private N MIB    allocate N more buffers of MIB that are never shared (NCCL's metadata)
//! shared N MIB     allocate N more exported buffers of MIB, sent by the next `exchange`
//! comms C MIB      set up C communicators over all ranks as NCCL lays them out: per
//!                  communicator 2 private buffers of 2 MiB (its structures), then per peer one
//!                  buffer of MIB exported to that peer only (sent to it by the next `exchange`)
//!                  and one private buffer of 2 MiB (the connection's)
//! exchange         send the exported fds to every other rank (as NCCL's proxy does) and
//!                  import and map every peer's buffers
//! write SEED       fill this rank's buffer with a pattern
//! check RANK SEED [BYTES [FROM]]  read rank RANK's buffer through this rank's import of it
//!                  (BYTES of it from byte FROM, compared with SEED's pattern there)
//! zeros RANK [BYTES [FROM]]  rank RANK's buffer (BYTES of it from byte FROM) holds zeros,
//!                  read through this rank's import -> ok | err mismatch at byte N: X
//! pause / resume [TAGS]  memsaver_pause/resume(TAGS, "nccl" by default) -> ok | err CODE MESSAGE
//! tensor MIB [TAG] allocate a tensor of TAG (`weights` by default, cpu backups) through
//!                  memsaver_malloc (more tensors of one tag are adjacent)
//! register [I]     NCCL's registration of tensor I (the last by default): this rank's buffer
//!                  becomes the range NCCL exports, sent by the next `exchange`
//! allreduce        ncclAllReduce on this rank's buffer, as the application calls it -> the rc
//! memalloc MIB [TAG]  the application's buffer from ncclMemAlloc (looked up in libnccl's
//!                  handle, as ctypes does), inside a region of TAG (cpu backups) or outside any
//!                  region: it becomes this rank's buffer
//! memfree          ncclMemFree of that buffer
//! ncclce MIB       NCCL's own ncclMemAlloc (its copy-engine buffers, called from libnccl),
//!                  made inside a region of `weights`: NCCL's memory all the same
//! ncclregister     ncclCommRegister of this rank's buffer (NCCL's IPC registration): its fd is
//!                  sent by the next `exchange`
//! window           ncclCommWindowRegister of this rank's buffer: NCCL retains its handle, maps
//!                  it a second time in its own address space and exports it (sent by the next
//!                  `exchange`)
//! unwindow         ncclCommWindowDeregister of that window
//! mine SEED        this rank's buffer holds SEED's pattern (read at its address)
//! wcheck SEED      the same, read through the window's own mapping of it
//! unimport         NCCL's free path on the imports of peers' buffers (a deregistration)
//! unimport-extra   the same for the imports other than each peer's latest
//! tfree I          memsaver_free of tensor I
//! ofree            NCCL's free path on this rank's buffer (of `alloc`) alone
//! sfree I          NCCL's free path on shared buffer I (of `shared`; the others keep their
//!                  numbers): a later `exchange` no longer sends it
//! used             device memory in use (all processes, fake driver) in bytes
//! free             free imports and the own buffer through NCCL's free path
//! pwrite SEED      fill every private buffer with a pattern of SEED and its address
//! pcheck SEED      every private buffer holds what `pwrite SEED` wrote
//! pfree I          NCCL's free path on private buffer I (the others keep their numbers)
//! pexport I        NCCL's proxy exports private buffer I as a POSIX fd -> ok | err CODE
//! pnic I           NCCL's network transport gives private buffer I to a NIC (dmabuf)
//! failreserve N    the Nth cuMemAddressReserve of this process from now fails (fake driver)
//! failcreate N     the Nth cuMemCreate of this process from now fails, out of memory
//! failmap N        the Nth cuMemMap of this process from now fails (CUDA_ERROR_UNKNOWN)
//! failunmap N      the Nth cuMemUnmap of this process from now fails (CUDA_ERROR_UNKNOWN)
//! stats            memsaver_nccl_stats_json on one line
//! mstats           memsaver_stats_json on one line
//! prepared         waits (up to 30 s) until memsaver has prepared every pinned backup it was
//!                  asked for in the background (memsaver_stats_json's backups_preparing is 0)
//! pid              this process's pid (in its own pid namespace)
//! calls            the fake driver's call counts of this process since the last `calls`, by
//!                  kind, and the wall time of the last pause or resume, then resets the
//!                  counts: `ok create=N map=N set_access=N unmap=N release=N export=N
//!                  import=N copy=N reserve=N address_free=N us=N`
//! ```

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use memsaver_scenarios::{
    Alloc, CALL_KINDS, FakeNcclAlloc, Free, Import, TagCall, make_context_current, pattern, serve,
    sym, used_bytes,
};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use memsaver_allocator::driver::sys::fns;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, recvmsg, sendmsg};

/// The most fds one `exchange` message carries (the kernel's `SCM_MAX_FD`).
const MAX_FDS: usize = 253;

type LastError = unsafe extern "C" fn() -> *const c_char;
/// `fake_nccl_export`: an fd, or minus the driver's error code.
type Export = unsafe extern "C" fn(*const c_char, *const FakeNcclAlloc) -> c_int;
/// `fake_nccl_give_to_nic`: 0 or the driver's error code.
type GiveToNic = unsafe extern "C" fn(*const c_char, u64, usize) -> c_int;
type MapHeld = unsafe extern "C" fn(*const c_char, *mut FakeNcclAlloc) -> c_int;

/// The pattern seed of private buffer `a` for `pwrite`/`pcheck SEED`: its own for each buffer.
fn private_seed(seed: u64, a: &FakeNcclAlloc) -> u64 {
    seed ^ (a.ptr >> 21)
}

struct Rank {
    cuda: CString,
    dir: PathBuf,
    rank: usize,
    world: usize,
    alloc: Alloc,
    register: Register,
    import: Import,
    free: Free,
    export: Export,
    give_to_nic: GiveToNic,
    map_held: MapHeld,
    pause: TagCall,
    resume: TagCall,
    last_error: LastError,
    mem_info: fns::cuMemGetInfo_v2,
    own: Option<FakeNcclAlloc>,
    peers: Vec<Option<FakeNcclAlloc>>,
    /// Buffers of `private` and the private ones of `comms` (`None` once `pfree` freed it).
    private: Vec<Option<FakeNcclAlloc>>,
    /// Buffers of `shared` (`None` once `sfree` freed it).
    shared: Vec<Option<FakeNcclAlloc>>,
    /// Buffers of `comms` exported to one peer each: (the peer, the buffer).
    peered: Vec<(usize, FakeNcclAlloc)>,
    extra_imports: Vec<FakeNcclAlloc>,
    /// Buffers of `hold`: created, not mapped yet (NCCL between its create and its map).
    held: Vec<FakeNcclAlloc>,
    counts: CallCounts,
    /// The fake driver's test controls: the Nth call of a kind from now fails.
    fail_reserve: extern "C" fn(u32) -> i32,
    fail_create: extern "C" fn(u32) -> i32,
    fail_map: extern "C" fn(u32) -> i32,
    fail_unmap: extern "C" fn(u32) -> i32,
    reset_counts: extern "C" fn(),
    /// The wall time of the last pause or resume.
    last: std::time::Duration,
    /// Tensors of `tensor`: pointer and size.
    tensors: Vec<(u64, usize)>,
    malloc: MemsaverMalloc,
    /// The fake NCCL's handle (`dlsym` on it, as ctypes does).
    nccl: usize,
    /// The window of `window`: NCCL's registration record.
    window: Option<*mut c_void>,
}

/// The fake NCCL's record of a registration or a window (`FakeNcclRegistration`).
#[repr(C)]
struct Registration {
    range: FakeNcclAlloc,
    alias: u64,
    retained: u64,
}

/// `fake_nccl_register` of the fake NCCL.
type Register = unsafe extern "C" fn(*const c_char, u64, *mut FakeNcclAlloc) -> c_int;
type MemsaverMalloc =
    unsafe extern "C" fn(*mut *mut c_void, usize, c_int, *const c_char, *const c_char) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    *mut c_void,
    *mut c_void,
) -> c_int;

/// `fakecuda_call_counts` of the fake driver.
type CallCounts = unsafe extern "C" fn(*mut u64, usize) -> usize;

impl Rank {
    fn last_error(&self) -> String {
        // SAFETY: NUL-terminated thread-local message.
        unsafe { CStr::from_ptr((self.last_error)()) }
            .to_string_lossy()
            .into_owned()
    }

    fn run(&mut self, line: &str) -> Result<String, String> {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| {
            f.get(i)
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or("bad argument")
        };
        match f.first().copied() {
            Some("alloc") => {
                let mut a = FakeNcclAlloc::default();
                // `alloc MIB [host]`: device memory, or host memory as NCCL's SHM transport.
                let kind = if f.get(2) == Some(&"host") { 2 } else { 1 };
                // SAFETY: per the fake NCCL's contract.
                let rc = unsafe {
                    (self.alloc)(self.cuda.as_ptr(), (num(1)? << 20) as usize, kind, &mut a)
                };
                if rc != 0 {
                    return Err(format!("alloc {rc}"));
                }
                self.own = Some(a);
                Ok(String::new())
            }
            Some(what @ ("private" | "shared")) => {
                let (n, mib) = (num(1)?, num(2)?);
                for _ in 0..n {
                    let mut a = FakeNcclAlloc::default();
                    let export = i32::from(what == "shared");
                    // SAFETY: per the fake NCCL's contract.
                    let rc = unsafe {
                        (self.alloc)(self.cuda.as_ptr(), (mib << 20) as usize, export, &mut a)
                    };
                    if rc != 0 {
                        return Err(format!("alloc {rc}"));
                    }
                    if export == 1 {
                        self.shared.push(Some(a));
                    } else {
                        self.private.push(Some(a));
                    }
                }
                Ok(String::new())
            }
            Some("hold") => {
                // `hold MIB`: device memory created, not mapped (NCCL between its cuMemCreate
                // and its cuMemMap); `mapheld` maps it and makes it a private buffer.
                let mut a = FakeNcclAlloc::default();
                // SAFETY: per the fake NCCL's contract.
                let rc = unsafe {
                    (self.alloc)(self.cuda.as_ptr(), (num(1)? << 20) as usize, 3, &mut a)
                };
                if rc != 0 {
                    return Err(format!("alloc {rc}"));
                }
                self.held.push(a);
                Ok(String::new())
            }
            Some("mapheld") => {
                for mut a in std::mem::take(&mut self.held) {
                    // SAFETY: created by `hold`, not mapped yet.
                    let rc = unsafe { (self.map_held)(self.cuda.as_ptr(), &mut a) };
                    if rc != 0 {
                        return Err(format!("map {rc}"));
                    }
                    self.private.push(Some(a));
                }
                Ok(String::new())
            }
            Some("comms") => {
                let (comms, mib) = (num(1)?, num(2)?);
                let alloc = |size: u64, export: i32| {
                    let mut a = FakeNcclAlloc::default();
                    // SAFETY: per the fake NCCL's contract.
                    let rc =
                        unsafe { (self.alloc)(self.cuda.as_ptr(), size as usize, export, &mut a) };
                    if rc != 0 {
                        Err(format!("alloc {rc}"))
                    } else {
                        Ok(a)
                    }
                };
                let mut made = Vec::new();
                for _ in 0..comms {
                    for _ in 0..2 {
                        self.private.push(Some(alloc(2 << 20, 0)?));
                    }
                    for peer in (0..self.world).filter(|p| *p != self.rank) {
                        made.push((peer, alloc(mib << 20, 1)?));
                        self.private.push(Some(alloc(2 << 20, 0)?));
                    }
                }
                self.peered.extend(made);
                Ok(String::new())
            }
            Some("calls") => {
                let mut c = [0u64; CALL_KINDS.len()];
                // SAFETY: `c` has room for its length.
                let kinds = unsafe { (self.counts)(c.as_mut_ptr(), c.len()) };
                if kinds != c.len() {
                    return Err(format!("the fake driver counts {kinds} kinds"));
                }
                (self.reset_counts)();
                let mut v: Vec<String> = CALL_KINDS
                    .iter()
                    .zip(c)
                    .map(|(k, n)| format!("{k}={n}"))
                    .collect();
                v.push(format!("us={}", self.last.as_micros()));
                Ok(v.join(" "))
            }
            Some("exchange") => self.exchange(),
            Some("write") => {
                let a = self.own.ok_or("no buffer")?;
                // SAFETY: on the fake driver the mapped buffer is host memory at its address.
                let b = unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut u8, a.size) };
                let seed = num(1)?;
                b.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = pattern(seed, i));
                Ok(String::new())
            }
            // `check PEER SEED [BYTES [FROM]]`: the import of PEER's buffer holds SEED's
            // pattern (in BYTES bytes from byte FROM).
            Some("check") => {
                let (b, from) = self.peer_bytes(num(1)?, num(3).ok(), num(4).ok())?;
                let seed = num(2)?;
                if b.iter()
                    .enumerate()
                    .all(|(i, x)| *x == pattern(seed, from + i))
                {
                    Ok(String::new())
                } else {
                    Err("mismatch".into())
                }
            }
            Some("zeros") => {
                let (b, from) = self.peer_bytes(num(1)?, num(2).ok(), num(3).ok())?;
                match b.iter().position(|x| *x != 0) {
                    None => Ok(String::new()),
                    Some(i) => Err(format!("mismatch at byte {}: {:#x}", from + i, b[i])),
                }
            }
            Some(op @ ("pause" | "resume")) => {
                let tags = CString::new(f.get(1).copied().unwrap_or("nccl")).unwrap();
                let f = if op == "pause" {
                    self.pause
                } else {
                    self.resume
                };
                let t = std::time::Instant::now();
                // SAFETY: NUL-terminated tag list.
                let rc = unsafe { f(tags.as_ptr()) };
                self.last = t.elapsed();
                if rc == 0 {
                    Ok(String::new())
                } else {
                    // SAFETY: NUL-terminated thread-local message.
                    let msg = unsafe { CStr::from_ptr((self.last_error)()) }
                        .to_string_lossy()
                        .into_owned();
                    Err(format!("{rc} {msg}"))
                }
            }
            // `group N`: memsaver_nccl_set_group(N).
            Some("group") => {
                let set: unsafe extern "C" fn(i64) -> c_int =
                    sym(libc::RTLD_DEFAULT, c"memsaver_nccl_set_group");
                // SAFETY: plain value argument.
                let rc = unsafe { set(num(1)? as i64) };
                if rc == 0 {
                    Ok(String::new())
                } else {
                    // SAFETY: NUL-terminated thread-local message.
                    let msg = unsafe { CStr::from_ptr((self.last_error)()) }.to_string_lossy();
                    Err(format!("{rc} {msg}"))
                }
            }
            Some(which @ ("stats" | "mstats")) => {
                type StatsJson = unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int;
                let name = if which == "stats" {
                    c"memsaver_nccl_stats_json"
                } else {
                    c"memsaver_stats_json"
                };
                let f: StatsJson = sym(libc::RTLD_DEFAULT, name);
                let mut buf = vec![0u8; 1 << 16];
                let mut needed = 0;
                // SAFETY: `buf` has its length in writable bytes.
                let rc = unsafe { f(buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
                if rc != 0 {
                    return Err(format!("stats {rc}"));
                }
                Ok(String::from_utf8_lossy(&buf[..needed - 1]).into_owned())
            }
            Some("prepared") => {
                type StatsJson = unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int;
                let f: StatsJson = sym(libc::RTLD_DEFAULT, c"memsaver_stats_json");
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                loop {
                    let mut buf = vec![0u8; 1 << 16];
                    let mut needed = 0;
                    // SAFETY: `buf` has its length in writable bytes.
                    let rc = unsafe { f(buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
                    if rc != 0 {
                        return Err(format!("stats {rc}"));
                    }
                    let doc: serde_json::Value = serde_json::from_slice(&buf[..needed - 1])
                        .map_err(|e| format!("stats json: {e}"))?;
                    if doc["backups_preparing"] == 0 {
                        return Ok(doc["total"]["prepared_backup_bytes"].to_string());
                    }
                    if std::time::Instant::now() > deadline {
                        return Err("backups still preparing after 30 s".into());
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
            Some("tensor") => {
                let size = (num(1)? << 20) as usize;
                let tag = CString::new(f.get(2).copied().unwrap_or("weights")).unwrap();
                let mut p = std::ptr::null_mut();
                // SAFETY: valid out-pointer, NUL-terminated tag and policy.
                let rc = unsafe { (self.malloc)(&mut p, size, 0, tag.as_ptr(), c"cpu".as_ptr()) };
                if rc != 0 {
                    return Err(format!("{rc} {}", self.last_error()));
                }
                self.tensors.push((p as u64, size));
                Ok(String::new())
            }
            // `tfree I`: memsaver_free of tensor I.
            Some("tfree") => {
                let (ptr, _) = *self.tensors.get(num(1)? as usize).ok_or("no such tensor")?;
                let free: unsafe extern "C" fn(*mut c_void) -> c_int =
                    sym(libc::RTLD_DEFAULT, c"memsaver_free");
                // SAFETY: a pointer memsaver_malloc returned, freed once.
                let rc = unsafe { free(ptr as *mut c_void) };
                if rc != 0 {
                    return Err(format!("{rc} {}", self.last_error()));
                }
                Ok(String::new())
            }
            Some("register") => {
                let i = num(1).map_or(self.tensors.len().wrapping_sub(1), |i| i as usize);
                let (ptr, _) = *self.tensors.get(i).ok_or("no such tensor")?;
                let mut a = FakeNcclAlloc::default();
                // SAFETY: per the fake NCCL's contract.
                let rc = unsafe { (self.register)(self.cuda.as_ptr(), ptr, &mut a) };
                if rc != 0 {
                    return Err(format!("register {rc}"));
                }
                self.own = Some(a);
                Ok(format!("{:#x} {}", a.ptr, a.size))
            }
            Some("memalloc") => {
                let size = (num(1)? << 20) as usize;
                type MemAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
                let tag = f.get(2).map(|t| CString::new(*t).unwrap());
                let f: MemAlloc = sym(self.nccl as *mut c_void, c"ncclMemAlloc");
                if let Some(tag) = &tag {
                    let enter: unsafe extern "C" fn(*const c_char, *const c_char) -> c_int =
                        sym(libc::RTLD_DEFAULT, c"memsaver_region_enter");
                    // SAFETY: NUL-terminated tag and policy.
                    let rc = unsafe { enter(tag.as_ptr(), c"cpu".as_ptr()) };
                    if rc != 0 {
                        return Err(format!("{rc} {}", self.last_error()));
                    }
                }
                let mut p = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                let rc = unsafe { f(&mut p, size) };
                if tag.is_some() {
                    let exit: extern "C" fn() -> c_int =
                        sym(libc::RTLD_DEFAULT, c"memsaver_region_exit");
                    exit();
                }
                if rc != 0 {
                    return Err(format!("ncclMemAlloc {rc}"));
                }
                self.own = Some(FakeNcclAlloc {
                    ptr: p as u64,
                    size,
                    exported_fd: -1,
                    ..Default::default()
                });
                Ok(String::new())
            }
            Some("ncclce") => {
                let f: extern "C" fn(usize) -> u64 =
                    sym(self.nccl as *mut c_void, c"fake_nccl_ce_alloc");
                let enter: unsafe extern "C" fn(*const c_char, *const c_char) -> c_int =
                    sym(libc::RTLD_DEFAULT, c"memsaver_region_enter");
                let exit: extern "C" fn() -> c_int =
                    sym(libc::RTLD_DEFAULT, c"memsaver_region_exit");
                // SAFETY: NUL-terminated tag and policy.
                if unsafe { enter(c"weights".as_ptr(), c"cpu".as_ptr()) } != 0 {
                    return Err(self.last_error());
                }
                let p = f((num(1)? << 20) as usize);
                exit();
                if p == 0 {
                    return Err("ncclMemAlloc failed".into());
                }
                Ok(String::new())
            }
            Some("memfree") => {
                let a = self.own.take().ok_or("no buffer")?;
                type MemFree = unsafe extern "C" fn(*mut c_void) -> c_int;
                let f: MemFree = sym(self.nccl as *mut c_void, c"ncclMemFree");
                // SAFETY: the buffer ncclMemAlloc returned, freed once.
                let rc = unsafe { f(a.ptr as *mut c_void) };
                if a.exported_fd >= 0 {
                    // SAFETY: this rank's copy of the registration's fd.
                    unsafe { libc::close(a.exported_fd) };
                }
                if rc != 0 {
                    return Err(format!("ncclMemFree {rc}"));
                }
                Ok(String::new())
            }
            Some(what @ ("ncclregister" | "window")) => {
                let own = self.own.ok_or("no buffer")?;
                let mut h: *mut c_void = std::ptr::null_mut();
                let (buf, size) = (own.ptr as *mut c_void, own.size);
                let rc = if what == "window" {
                    type Register = unsafe extern "C" fn(
                        *mut c_void,
                        *mut c_void,
                        usize,
                        *mut *mut c_void,
                        c_int,
                    ) -> c_int;
                    let f: Register = sym(self.nccl as *mut c_void, c"ncclCommWindowRegister");
                    // SAFETY: a valid out-pointer; NCCL_WIN_COLL_SYMMETRIC.
                    unsafe { f(std::ptr::null_mut(), buf, size, &mut h, 1) }
                } else {
                    type Register = unsafe extern "C" fn(
                        *mut c_void,
                        *mut c_void,
                        usize,
                        *mut *mut c_void,
                    ) -> c_int;
                    let f: Register = sym(self.nccl as *mut c_void, c"ncclCommRegister");
                    // SAFETY: a valid out-pointer.
                    unsafe { f(std::ptr::null_mut(), buf, size, &mut h) }
                };
                if rc != 0 {
                    return Err(format!("{what} {rc}"));
                }
                // SAFETY: the fake NCCL's registration record, live until deregistered.
                let reg = unsafe { &mut *h.cast::<Registration>() };
                // The fd is this rank's to send (NCCL's proxy sends it and closes it).
                let fd = std::mem::replace(&mut reg.range.exported_fd, -1);
                if let Some(own) = &mut self.own {
                    own.exported_fd = fd;
                }
                if what == "window" {
                    self.window = Some(h);
                }
                Ok(format!("{:#x} {}", reg.range.ptr, reg.range.size))
            }
            Some("unwindow") => {
                let w = self.window.take().ok_or("no window")?;
                type Deregister = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
                let f: Deregister = sym(self.nccl as *mut c_void, c"ncclCommWindowDeregister");
                // SAFETY: the window ncclCommWindowRegister made, given back once.
                let rc = unsafe { f(std::ptr::null_mut(), w) };
                if rc != 0 {
                    return Err(format!("ncclCommWindowDeregister {rc}"));
                }
                Ok(String::new())
            }
            Some(what @ ("mine" | "wcheck")) => {
                let own = self.own.ok_or("no buffer")?;
                let at = if what == "wcheck" {
                    let w = self.window.ok_or("no window")?;
                    // SAFETY: the fake NCCL's window record, live until deregistered.
                    unsafe { (*w.cast::<Registration>()).alias }
                } else {
                    own.ptr
                };
                // SAFETY: on the fake driver a mapped buffer is host memory at its address.
                let b = unsafe { std::slice::from_raw_parts(at as *const u8, own.size) };
                let seed = num(1)?;
                match b
                    .iter()
                    .enumerate()
                    .position(|(i, x)| *x != pattern(seed, i))
                {
                    None => Ok(String::new()),
                    Some(i) => Err(format!("mismatch at byte {i}: {:#x}", b[i])),
                }
            }
            Some("allreduce") => {
                let a = self.own.ok_or("no buffer")?;
                let f: AllReduce = sym(libc::RTLD_DEFAULT, c"ncclAllReduce");
                let p = a.ptr as *mut c_void;
                // SAFETY: the guarded entry point; the fake NCCL touches no argument.
                let rc = unsafe {
                    f(
                        p,
                        p,
                        a.size,
                        0,
                        0,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    )
                };
                Ok(rc.to_string())
            }
            Some("unimport") => {
                let imports = self.take_imports();
                self.free_all(imports)
            }
            // `unimport-extra`: NCCL's free path on the imports other than each peer's latest.
            Some("unimport-extra") => {
                let extra = std::mem::take(&mut self.extra_imports);
                self.free_all(extra)
            }
            Some("ofree") => {
                let own = self.own.take().ok_or("no buffer of `alloc` to free")?;
                self.free_all(vec![own])
            }
            Some("sfree") => {
                let a = self
                    .shared
                    .get_mut(num(1)? as usize)
                    .and_then(Option::take)
                    .ok_or("no such shared buffer")?;
                self.free_all(vec![a])
            }
            Some("pid") => Ok(std::process::id().to_string()),
            // The context pushed at start-up is current.
            Some("used") => used_bytes(self.mem_info),
            Some(op @ ("pwrite" | "pcheck")) => {
                let seed = num(1)?;
                for a in self.private.iter().flatten() {
                    // SAFETY: on the fake driver a mapped buffer is host memory at its address.
                    let b = unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut u8, a.size) };
                    let seed = private_seed(seed, a);
                    if op == "pwrite" {
                        b.iter_mut()
                            .enumerate()
                            .for_each(|(i, x)| *x = pattern(seed, i));
                    } else if !b.iter().enumerate().all(|(i, x)| *x == pattern(seed, i)) {
                        return Err(format!("mismatch in the buffer at {:#x}", a.ptr));
                    }
                }
                Ok(String::new())
            }
            Some("pfree") => {
                let a = self
                    .private
                    .get_mut(num(1)? as usize)
                    .and_then(Option::take)
                    .ok_or("no such private buffer")?;
                self.free_all(vec![a])
            }
            Some(kind @ ("failreserve" | "failcreate" | "failmap" | "failunmap")) => {
                let arm = match kind {
                    "failreserve" => self.fail_reserve,
                    "failcreate" => self.fail_create,
                    "failmap" => self.fail_map,
                    _ => self.fail_unmap,
                };
                match arm(num(1)? as u32) {
                    0 => Ok(String::new()),
                    rc => Err(rc.to_string()),
                }
            }
            Some("pnic") => {
                let a = self.private_buffer(num(1)?)?;
                // SAFETY: a buffer of the fake NCCL's.
                match unsafe { (self.give_to_nic)(self.cuda.as_ptr(), a.ptr, a.size) } {
                    0 => Ok(String::new()),
                    rc => Err(rc.to_string()),
                }
            }
            Some("pexport") => {
                let a = self.private_buffer(num(1)?)?;
                // SAFETY: a buffer of the fake NCCL's.
                let fd = unsafe { (self.export)(self.cuda.as_ptr(), &a) };
                if fd < 0 {
                    return Err((-fd).to_string());
                }
                // SAFETY: the fd is ours.
                unsafe { libc::close(fd) };
                Ok(String::new())
            }
            Some("free") => {
                let mut all = self.take_imports();
                all.extend(self.own.take());
                all.extend(self.shared.drain(..).flatten());
                all.extend(self.peered.drain(..).map(|(_, a)| a));
                all.extend(self.private.drain(..).flatten());
                self.free_all(all)
            }
            _ => Err(format!("unknown command {line:?}")),
        }
    }

    /// Private buffer `i` (of `private` and `comms`), if NCCL has not freed it.
    fn private_buffer(&self, i: u64) -> Result<FakeNcclAlloc, String> {
        let found = self.private.get(i as usize).copied().flatten();
        found.ok_or_else(|| "no such private buffer".into())
    }

    /// `bytes` of this rank's import of `peer`'s buffer from byte `from` (all of it from 0 by
    /// default), and `from`.
    fn peer_bytes(
        &self,
        peer: u64,
        bytes: Option<u64>,
        from: Option<u64>,
    ) -> Result<(&[u8], usize), String> {
        let a = self
            .peers
            .get(peer as usize)
            .copied()
            .flatten()
            .ok_or("no such import")?;
        let from = from.map_or(0, |n| (n as usize).min(a.size));
        let len = bytes.map_or(a.size - from, |n| (a.size - from).min(n as usize));
        // SAFETY: the import is mapped read-write at its address (fake driver) while this
        // rank holds it, which outlives the borrow of `self`.
        let b = unsafe { std::slice::from_raw_parts((a.ptr as usize + from) as *const u8, len) };
        Ok((b, from))
    }

    /// The imports of peers' buffers, taken out of this rank's records.
    fn take_imports(&mut self) -> Vec<FakeNcclAlloc> {
        let mut all: Vec<FakeNcclAlloc> = self.peers.drain(..).flatten().collect();
        all.append(&mut self.extra_imports);
        all
    }

    /// Frees `all` through NCCL's free path, in order.
    fn free_all(&self, all: Vec<FakeNcclAlloc>) -> Result<String, String> {
        for a in all {
            // SAFETY: allocations made by the fake NCCL, freed once.
            let rc = unsafe { (self.free)(self.cuda.as_ptr(), &a) };
            if rc != 0 {
                return Err(format!("free {rc}"));
            }
        }
        Ok(String::new())
    }

    /// Every rank sends its exported fd to every other rank and imports theirs.
    fn exchange(&mut self) -> Result<String, String> {
        let own = self.own.ok_or("no buffer")?;
        let me = self.dir.join(format!("{}.sock", self.rank));
        // An earlier exchange's socket: nobody listens on it any more.
        let _ = std::fs::remove_file(&me);
        let listener = UnixListener::bind(&me).map_err(|e| e.to_string())?;
        let (rank, world, dir) = (self.rank, self.world, self.dir.clone());
        // Per peer: the main buffer's fd first, then those of `shared`, then those of `comms`
        // for that peer (one message: at most 253 fds).
        let mut per_peer: Vec<(Vec<RawFd>, Vec<usize>)> = Vec::new();
        for peer in 0..world {
            let mine: Vec<FakeNcclAlloc> = std::iter::once(own)
                .chain(self.shared.iter().flatten().copied())
                .chain(
                    self.peered
                        .iter()
                        .filter(|(p, _)| *p == peer)
                        .map(|(_, a)| *a),
                )
                .collect();
            if mine.len() > MAX_FDS {
                return Err(format!("at most {MAX_FDS} exported buffers per peer"));
            }
            per_peer.push((
                mine.iter().map(|a| a.exported_fd).collect(),
                mine.iter().map(|a| a.size).collect(),
            ));
        }
        let sender = std::thread::spawn(move || -> Result<(), String> {
            for peer in (0..world).filter(|p| *p != rank) {
                let (fds, sizes) = &per_peer[peer];
                let path = dir.join(format!("{peer}.sock"));
                let s = loop {
                    match UnixStream::connect(&path) {
                        Ok(s) => break s,
                        Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
                    }
                };
                let payload: Vec<u8> = (rank as u32)
                    .to_le_bytes()
                    .into_iter()
                    .chain(sizes.iter().flat_map(|s| (*s as u64).to_le_bytes()))
                    .collect();
                sendmsg::<UnixAddr>(
                    s.as_raw_fd(),
                    &[IoSlice::new(&payload)],
                    &[ControlMessage::ScmRights(fds)],
                    MsgFlags::empty(),
                    None,
                )
                .map_err(|e| e.to_string())?;
            }
            Ok(())
        });
        self.peers.resize(self.world, None);
        for _ in 1..self.world {
            let (s, _) = listener.accept().map_err(|e| e.to_string())?;
            let mut payload = [0u8; 4 + 8 * MAX_FDS];
            let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
            let mut iov = [IoSliceMut::new(&mut payload)];
            let msg =
                recvmsg::<UnixAddr>(s.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::empty())
                    .map_err(|e| e.to_string())?;
            let len = msg.bytes;
            if len < 4 {
                return Err("a peer closed the exchange without sending its buffers".into());
            }
            let mut fds = Vec::new();
            for c in msg.cmsgs().map_err(|e| e.to_string())? {
                if let ControlMessageOwned::ScmRights(f) = c {
                    fds.extend(f);
                }
            }
            let from = u32::from_le_bytes(payload[..4].try_into().unwrap()) as usize;
            let sizes: Vec<usize> = payload[4..len]
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
                .collect();
            if fds.is_empty() || sizes.len() != fds.len() {
                return Err(format!(
                    "rank {from} sent {} fds, {} sizes",
                    fds.len(),
                    sizes.len()
                ));
            }
            for (i, (fd, size)) in fds.into_iter().zip(sizes).enumerate() {
                let mut a = FakeNcclAlloc::default();
                // SAFETY: an fd received from the peer; the fake NCCL closes it.
                let rc = unsafe { (self.import)(self.cuda.as_ptr(), fd, size, &mut a) };
                if rc != 0 {
                    return Err(format!("import from rank {from}: {rc}"));
                }
                if i == 0 {
                    // A second exchange of one buffer (registered again): the earlier import
                    // is kept as an extra one.
                    if let Some(old) = self.peers[from].replace(a) {
                        self.extra_imports.push(old);
                    }
                } else {
                    self.extra_imports.push(a);
                }
            }
        }
        sender.join().map_err(|_| "sender panicked".to_string())??;
        // NCCL closes its copy of the exported fd once every peer has it.
        let peered = self.peered.iter_mut().map(|(_, a)| a);
        for a in self
            .own
            .iter_mut()
            .chain(self.shared.iter_mut().flatten())
            .chain(peered)
        {
            // SAFETY: our own exported fd, closed once.
            unsafe { libc::close(a.exported_fd) };
            a.exported_fd = -1;
        }
        Ok(String::new())
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (nccl, cuda) = (
        CString::new(a[1].as_str()).unwrap(),
        CString::new(a[2].as_str()).unwrap(),
    );
    // SAFETY: NUL-terminated paths.
    let (hn, hc) = unsafe {
        (
            libc::dlopen(nccl.as_ptr(), libc::RTLD_NOW),
            libc::dlopen(cuda.as_ptr(), libc::RTLD_NOW),
        )
    };
    assert!(
        !hn.is_null() && !hc.is_null(),
        "cannot open the fake libraries"
    );
    make_context_current(hc);
    let set_cuda: unsafe extern "C" fn(*const c_char) = sym(hn, c"fake_nccl_set_cuda_lib");
    // SAFETY: a NUL-terminated path.
    unsafe { set_cuda(cuda.as_ptr()) };
    let mut r = Rank {
        cuda,
        dir: PathBuf::from(&a[3]),
        rank: a[4].parse().unwrap(),
        world: a[5].parse().unwrap(),
        alloc: sym(hn, c"fake_nccl_alloc"),
        register: sym(hn, c"fake_nccl_register"),
        import: sym(hn, c"fake_nccl_import"),
        free: sym(hn, c"fake_nccl_free"),
        export: sym(hn, c"fake_nccl_export"),
        give_to_nic: sym(hn, c"fake_nccl_give_to_nic"),
        map_held: sym(hn, c"fake_nccl_map"),
        pause: sym(libc::RTLD_DEFAULT, c"memsaver_pause"),
        resume: sym(libc::RTLD_DEFAULT, c"memsaver_resume"),
        last_error: sym(libc::RTLD_DEFAULT, c"memsaver_last_error"),
        mem_info: sym(hc, c"cuMemGetInfo_v2"),
        own: None,
        peers: Vec::new(),
        private: Vec::new(),
        shared: Vec::new(),
        peered: Vec::new(),
        extra_imports: Vec::new(),
        held: Vec::new(),
        counts: sym(hc, c"fakecuda_call_counts"),
        fail_reserve: sym(hc, c"fakecuda_fail_reserve_at"),
        fail_create: sym(hc, c"fakecuda_fail_create_at"),
        fail_map: sym(hc, c"fakecuda_fail_map_at"),
        fail_unmap: sym(hc, c"fakecuda_fail_unmap_at"),
        reset_counts: sym(hc, c"fakecuda_reset_call_counts"),
        last: std::time::Duration::ZERO,
        tensors: Vec::new(),
        malloc: sym(libc::RTLD_DEFAULT, c"memsaver_malloc"),
        nccl: hn as usize,
        window: None,
    };
    serve(|line| r.run(line));
}
