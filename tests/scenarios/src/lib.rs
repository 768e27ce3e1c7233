//! Pieces shared by the scenario programs (`src/bin/`) that drive the fake libnccl.so.2.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::io::{BufRead, BufReader, Read};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub mod wire;

/// What `fake_nccl_alloc` / `fake_nccl_import` report (layout of the fake NCCL's struct).
#[repr(C)]
#[derive(Default, Clone, Copy)]
pub struct FakeNcclAlloc {
    pub get_proc_address: usize,
    pub mem_create: usize,
    pub handle: u64,
    pub ptr: u64,
    pub size: usize,
    pub exported_fd: c_int,
}

pub type Alloc = unsafe extern "C" fn(*const c_char, usize, c_int, *mut FakeNcclAlloc) -> c_int;
pub type Import = unsafe extern "C" fn(*const c_char, c_int, usize, *mut FakeNcclAlloc) -> c_int;
pub type Free = unsafe extern "C" fn(*const c_char, *const FakeNcclAlloc) -> c_int;
/// The kinds of driver calls the fake driver counts, in the order `fakecuda_call_counts`
/// writes them (and `nccl-rank`'s `calls` command reports them): memsaver's own list, which the
/// fake driver follows (`allocator/tests/backups.rs` compares the two counts).
pub use memsaver_allocator::driver::CALL_KINDS;

/// `memsaver_pause` / `memsaver_resume`.
pub type TagCall = unsafe extern "C" fn(*const c_char) -> c_int;

/// The byte a scenario program writes at offset `i` of a buffer filled with `seed`.
pub fn pattern(seed: u64, i: usize) -> u8 {
    (seed as usize * 131 + i / 4096 * 7 + i) as u8
}

/// Makes device 0's primary context current on this thread through the driver `hc` (a dlopen
/// handle), as a process does before its first driver call.
pub fn make_context_current(hc: *mut c_void) {
    use memsaver_allocator::driver::sys::fns;
    let init: fns::cuInit = sym(hc, c"cuInit");
    let retain: fns::cuDevicePrimaryCtxRetain = sym(hc, c"cuDevicePrimaryCtxRetain");
    let push: fns::cuCtxPushCurrent_v2 = sym(hc, c"cuCtxPushCurrent_v2");
    let mut ctx = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the context stays current on this thread.
    unsafe {
        assert_eq!(init(0), 0);
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(push(ctx), 0);
    }
}

/// Device 0's bytes in use (total less free), asked of the driver's `cuMemGetInfo` with the
/// context current.
pub fn used_bytes(
    mem_info: memsaver_allocator::driver::sys::fns::cuMemGetInfo_v2,
) -> Result<String, String> {
    let (mut free, mut total) = (0, 0);
    // SAFETY: valid out-pointers.
    let rc = unsafe { mem_info(&mut free, &mut total) };
    if rc != 0 {
        return Err(format!("cuMemGetInfo {rc}"));
    }
    Ok((total - free).to_string())
}

/// Answers the commands read from stdin, one per line, until `exit` or the end of input:
/// `ok`, `ok <value>` or `err <message>` (on one line), as the scenario tests expect.
pub fn serve(mut run: impl FnMut(&str) -> Result<String, String>) {
    use std::io::{BufRead, Write};
    let mut out = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line.trim() == "exit" {
            break;
        }
        let answer = match run(&line) {
            Ok(v) if v.is_empty() => "ok".to_string(),
            Ok(v) => format!("ok {v}"),
            Err(e) => format!("err {}", e.replace('\n', " ")),
        };
        writeln!(out, "{answer}").unwrap();
        out.flush().unwrap();
    }
}

/// The function `name` of `h` (a dlopen handle or RTLD_DEFAULT) as type `T`; panics if missing.
/// Test support: every caller passes a handle it got from `dlopen` (or RTLD_DEFAULT).
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn sym<T: Copy>(h: *mut c_void, name: &CStr) -> T {
    // SAFETY: live handle (or RTLD_DEFAULT), NUL-terminated name.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    assert!(!p.is_null(), "missing symbol {name:?}");
    // SAFETY: the caller names the function's type.
    unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) }
}

/// The file name of the object containing `addr`.
pub fn object_of(addr: usize) -> String {
    // SAFETY: zeroed Dl_info is a valid out-parameter.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: any address may be asked about.
    if unsafe { libc::dladdr(addr as *const c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return "?".into();
    }
    // SAFETY: NUL-terminated file name from dladdr.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    path.rsplit('/').next().unwrap_or(&path).to_owned()
}

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The fake driver (`target/fake-cuda/libcuda.so.1`), or `MEMSAVER_CUDA_LIB` when set.
pub fn cuda_lib() -> PathBuf {
    let path = std::env::var_os("MEMSAVER_CUDA_LIB").map_or_else(
        || root().join("target/fake-cuda/libcuda.so.1"),
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "fake driver not found at {}: build it with `make fake-cuda`, or set MEMSAVER_CUDA_LIB",
        path.display()
    );
    path
}

/// The `libnccl.so.2` stand-in (`make fake-cuda` builds it).
pub fn fake_nccl() -> PathBuf {
    root().join("target/fake-nccl/libnccl.so.2")
}

/// libmemsaver.so of the build profile of the running test (`target/<profile>/`).
pub fn preload_lib() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let lib = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("tests run from target/<profile>/deps")
        .join("libmemsaver.so");
    assert!(
        lib.exists(),
        "{} is missing: build it first (`make test` does)",
        lib.display()
    );
    lib
}

/// A new directory `memsaver-<what>-<pid>-<n>` in the temp dir, mode 0700 (memsaver refuses
/// a runtime directory others can read).
pub fn tempdir(what: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "memsaver-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).expect("create a temp dir");
    std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .expect("make the temp dir private");
    d
}

/// Runs a scenario program with `FAKE_CUDA_DIR` set to a fresh directory (removed afterwards),
/// asserts that it succeeded, and returns the `key=value` lines it printed.
pub fn run_lines(
    cmd: &mut std::process::Command,
    what: &str,
) -> std::collections::HashMap<String, String> {
    let dir = tempdir(what);
    let out = cmd
        .env("FAKE_CUDA_DIR", &dir)
        .output()
        .expect("start the scenario program");
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Opens the fake libnccl.so.2 and libcuda.so.1 at the paths a scenario program was given
/// (`RTLD_LOCAL`, as the CUDA runtime opens the driver); panics if either cannot be opened.
pub fn open_fake_libs(nccl: &str, cuda: &str) -> (*mut c_void, *mut c_void) {
    let (nccl, cuda) = (
        std::ffi::CString::new(nccl).expect("a path without NUL"),
        std::ffi::CString::new(cuda).expect("a path without NUL"),
    );
    // SAFETY: NUL-terminated paths.
    let (hn, hc) = unsafe {
        (
            libc::dlopen(nccl.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL),
            libc::dlopen(cuda.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL),
        )
    };
    assert!(
        !hn.is_null() && !hc.is_null(),
        "cannot open the fake libraries"
    );
    (hn, hc)
}

/// How long a test waits for a scenario program's answer to one command: generous, since the
/// outcome, not the time, is what is checked; a program that is stuck fails the test then,
/// instead of blocking it.
pub const ANSWER_WAIT: Duration = Duration::from_secs(60);

/// One line from `reader` (a scenario program's stdout) by `deadline`, with its newline:
/// `Ok("")` at the end of the stream (the program exited), a `TimedOut` error when no whole
/// line came by then (what did come stays with the caller's error, not in the reader).
pub fn read_line_within<R: Read + AsFd>(
    reader: &mut BufReader<R>,
    deadline: Instant,
) -> std::io::Result<String> {
    use std::os::fd::AsRawFd;
    let mut line = Vec::new();
    loop {
        let buffered = reader.buffer();
        if let Some(i) = buffered.iter().position(|&b| b == b'\n') {
            line.extend_from_slice(&buffered[..=i]);
            reader.consume(i + 1);
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        line.extend_from_slice(buffered);
        let n = buffered.len();
        reader.consume(n);
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: reader.get_ref().as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Rounded up: a wait of 0 ms before the deadline would spin.
        let ms = libc::c_int::try_from(left.as_millis() + 1).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd; the fd stays open (borrowed from the reader) meanwhile.
        let ready = match unsafe { libc::poll(&mut pfd, 1, ms) } {
            n if n > 0 => true,
            0 => false,
            _ => match std::io::Error::last_os_error() {
                e if e.kind() == std::io::ErrorKind::Interrupted => false,
                e => return Err(e),
            },
        };
        if !ready {
            if Instant::now() >= deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no whole line within the time given (got {:?})",
                        String::from_utf8_lossy(&line)
                    ),
                ));
            }
            continue;
        }
        // Readable (or closed): one read, which does not block.
        if reader.fill_buf()?.is_empty() {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_line_comes_whole_in_pieces_and_a_silent_writer_times_out() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut r = BufReader::new(b);
        let soon = || Instant::now() + Duration::from_secs(10);
        (&a).write_all(b"ok 1\nok").unwrap();
        assert_eq!(read_line_within(&mut r, soon()).unwrap(), "ok 1\n");
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            (&a).write_all(b" 2\npartial").unwrap();
            a
        });
        assert_eq!(read_line_within(&mut r, soon()).unwrap(), "ok 2\n");
        let a = writer.join().unwrap();
        // A line that never ends: the deadline, not a blocked test (the read runs on a thread
        // this test gives 10 s).
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let t = Instant::now();
            let e = read_line_within(&mut r, t + Duration::from_millis(200));
            let _ = tx.send((e.map_err(|e| (e.kind(), e.to_string())), t.elapsed()));
            r
        });
        let (e, took) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a read past its deadline returns");
        let (kind, text) = e.unwrap_err();
        assert_eq!(kind, std::io::ErrorKind::TimedOut);
        assert!(text.contains("\"partial\""), "{text}");
        assert!(took >= Duration::from_millis(200), "{took:?}");
        let mut r = reader.join().unwrap();
        drop(a);
        assert_eq!(
            read_line_within(&mut r, soon()).unwrap(),
            "",
            "the end of the stream"
        );
    }
}
