//! `ipc-proc`: one process of a CUDA IPC scenario on the fake driver, run under
//! `LD_PRELOAD=libmemsaver.so` in whole-process mode (`MEMSAVER_PROCESS_TAG`), calling the
//! interposed `cudaMalloc` and `cudaIpc*MemHandle` as torch does.
//!
//! `ipc-proc <libcuda.so.1>`, then one command per line on stdin, one answer line on stdout
//! (`ok ...` or `err ...`):
//!
//! ```text
//! alloc MIB          cudaMalloc: a buffer of this process (the process tag)
//! free               cudaFree of the last buffer
//! handle [N]         cudaIpcGetMemHandle of the last buffer (or buffer N): 64 bytes in hex
//! open HEX           cudaIpcOpenMemHandle: a new import's pointer
//! close              cudaIpcCloseMemHandle of the last import
//! write WHICH SEED   fill a buffer or an import with a pattern
//! check WHICH SEED   compare a buffer or an import with a pattern
//! pause / resume     memsaver_pause/resume of the process tag -> ok | err CODE MESSAGE
//! used               device memory in use (all processes, fake driver) in bytes
//! stats              memsaver_stats_json on one line
//! pid                this process's pid
//! threads            this process's thread count
//! die                SIGKILL itself (no answer): no exit handler runs
//! ```
//!
//! WHICH is `own` or `imp` (the last buffer or import), or `own:N` / `imp:N` (the Nth, from
//! 0). An import's size is the one its handle gives.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

use memsaver_allocator::driver::sys::fns;
use memsaver_scenarios::{TagCall, make_context_current, pattern, serve, sym, used_bytes};

type Malloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetHandle = unsafe extern "C" fn(*mut [u8; 64], *mut c_void) -> c_int;
type OpenHandle = unsafe extern "C" fn(*mut *mut c_void, [u8; 64], c_uint) -> c_int;
type CloseHandle = unsafe extern "C" fn(*mut c_void) -> c_int;
type LastError = unsafe extern "C" fn() -> *const c_char;
type StatsJson = unsafe extern "C" fn(*mut c_char, usize, *mut usize) -> c_int;

struct Proc {
    tag: CString,
    malloc: Malloc,
    free: FreeFn,
    get: GetHandle,
    open: OpenHandle,
    close: CloseHandle,
    pause: TagCall,
    resume: TagCall,
    last_error: LastError,
    stats: StatsJson,
    mem_info: fns::cuMemGetInfo_v2,
    own: Vec<(u64, usize)>,
    /// The imports' pointers and sizes.
    imported: Vec<(u64, usize)>,
}

impl Proc {
    fn last_error(&self) -> String {
        // SAFETY: memsaver_last_error returns a NUL-terminated thread-local string.
        unsafe { CStr::from_ptr((self.last_error)()) }
            .to_string_lossy()
            .into_owned()
    }

    fn range(&self, which: &str) -> Result<(u64, usize), String> {
        let (list, n) = which.split_once(':').unwrap_or((which, ""));
        let list = match list {
            "own" => &self.own,
            "imp" => &self.imported,
            w => return Err(format!("own or imp, not {w}")),
        };
        let n = match n {
            "" => list.len().checked_sub(1),
            n => n.parse::<usize>().ok(),
        };
        n.and_then(|n| list.get(n).copied())
            .ok_or_else(|| format!("no {which}"))
    }

    fn run(&mut self, line: &str) -> Result<String, String> {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| {
            f.get(i)
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or_else(|| format!("argument {i} missing or not a number"))
        };
        match f.first().copied() {
            Some("alloc") => {
                let size = (num(1)? << 20) as usize;
                let mut p = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                let rc = unsafe { (self.malloc)(&mut p, size) };
                if rc != 0 {
                    return Err(format!("cudaMalloc {rc} {}", self.last_error()));
                }
                self.own.push((p as u64, size));
                Ok(format!("{:#x}", p as u64))
            }
            Some("free") => {
                let (p, _) = self.own.pop().ok_or("no buffer")?;
                // SAFETY: a pointer cudaMalloc returned.
                let rc = unsafe { (self.free)(p as *mut c_void) };
                if rc != 0 {
                    return Err(format!("cudaFree {rc} {}", self.last_error()));
                }
                Ok(String::new())
            }
            Some("handle") => {
                let (p, _) = match f.get(1) {
                    Some(n) => self.range(&format!("own:{n}"))?,
                    None => self.range("own")?,
                };
                let mut h = [0u8; 64];
                // SAFETY: valid out-pointer.
                let rc = unsafe { (self.get)(&mut h, p as *mut c_void) };
                if rc != 0 {
                    return Err(format!("cudaIpcGetMemHandle {rc} {}", self.last_error()));
                }
                Ok(h.iter().map(|b| format!("{b:02x}")).collect())
            }
            Some("open") => {
                let hex = f.get(1).ok_or("open HEX")?;
                let mut h = [0u8; 64];
                if hex.len() != 128 {
                    return Err("a handle is 128 hex digits".into());
                }
                for (i, b) in h.iter_mut().enumerate() {
                    *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                        .map_err(|e| e.to_string())?;
                }
                let mut p = std::ptr::null_mut();
                // SAFETY: valid out-pointer; 1 = cudaIpcMemLazyEnablePeerAccess.
                let rc = unsafe { (self.open)(&mut p, h, 1) };
                if rc != 0 {
                    return Err(format!("cudaIpcOpenMemHandle {rc} {}", self.last_error()));
                }
                let size = u64::from_le_bytes(h[52..60].try_into().expect("8 bytes"));
                self.imported.push((p as u64, size as usize));
                Ok(format!("{:#x}", p as u64))
            }
            Some("close") => {
                let (p, _) = self.imported.pop().ok_or("nothing opened")?;
                // SAFETY: a pointer cudaIpcOpenMemHandle returned.
                let rc = unsafe { (self.close)(p as *mut c_void) };
                if rc != 0 {
                    return Err(format!("cudaIpcCloseMemHandle {rc} {}", self.last_error()));
                }
                Ok(String::new())
            }
            Some("write") => {
                let (p, len) = self.range(f.get(1).copied().unwrap_or(""))?;
                let seed = num(2)?;
                // SAFETY: the fake driver maps device memory at its device address.
                let b = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, len) };
                for (i, x) in b.iter_mut().enumerate() {
                    *x = pattern(seed, i);
                }
                Ok(String::new())
            }
            Some("check") => {
                let (p, len) = self.range(f.get(1).copied().unwrap_or(""))?;
                let seed = num(2)?;
                // SAFETY: as for write.
                let b = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
                match b.iter().enumerate().find(|(i, x)| **x != pattern(seed, *i)) {
                    None => Ok(String::new()),
                    Some((i, x)) => Err(format!(
                        "byte {i} is {x}, not {} (seed {seed})",
                        pattern(seed, i)
                    )),
                }
            }
            Some(op @ ("pause" | "resume")) => {
                let call = if op == "pause" {
                    self.pause
                } else {
                    self.resume
                };
                // SAFETY: NUL-terminated tag list.
                let rc = unsafe { call(self.tag.as_ptr()) };
                if rc != 0 {
                    return Err(format!("{rc} {}", self.last_error()));
                }
                Ok(String::new())
            }
            // The context pushed at start-up is current.
            Some("used") => used_bytes(self.mem_info),
            Some("stats") => {
                let mut buf = vec![0u8; 1 << 20];
                let mut needed = 0;
                // SAFETY: a buffer of its length and an out-pointer.
                let rc = unsafe { (self.stats)(buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
                if rc != 0 {
                    return Err(format!("stats {rc} {}", self.last_error()));
                }
                let text = CStr::from_bytes_until_nul(&buf).map_err(|e| e.to_string())?;
                Ok(text.to_string_lossy().replace('\n', " "))
            }
            Some("pid") => Ok(std::process::id().to_string()),
            Some("die") => {
                // SAFETY: signals this very process.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                Err("still alive".into())
            }
            Some("threads") => std::fs::read_dir("/proc/self/task")
                .map(|d| d.count().to_string())
                .map_err(|e| e.to_string()),
            other => Err(format!("unknown command {other:?}")),
        }
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let cuda = CString::new(a[1].as_str()).unwrap();
    // SAFETY: NUL-terminated path.
    let hc = unsafe { libc::dlopen(cuda.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!hc.is_null(), "cannot open the fake driver");
    make_context_current(hc);
    let d = libc::RTLD_DEFAULT;
    let mut p = Proc {
        tag: CString::new(std::env::var("MEMSAVER_PROCESS_TAG").unwrap_or_default()).unwrap(),
        malloc: sym(d, c"cudaMalloc"),
        free: sym(d, c"cudaFree"),
        get: sym(d, c"cudaIpcGetMemHandle"),
        open: sym(d, c"cudaIpcOpenMemHandle"),
        close: sym(d, c"cudaIpcCloseMemHandle"),
        pause: sym(d, c"memsaver_pause"),
        resume: sym(d, c"memsaver_resume"),
        last_error: sym(d, c"memsaver_last_error"),
        stats: sym(d, c"memsaver_stats_json"),
        mem_info: sym(hc, c"cuMemGetInfo_v2"),
        own: Vec::new(),
        imported: Vec::new(),
    };
    serve(|line| p.run(line));
}
