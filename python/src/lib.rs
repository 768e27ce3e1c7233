//! `memsaver._memsaver`: the Python extension. Thin: it finds libmemsaver.so (the preloaded
//! copy, or the one bundled in the wheel) and calls its C ABI, turning status codes into
//! exceptions. The Python package (`python/memsaver`) builds the user API on top.

mod abi;
mod error;
mod library;

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use pyo3::prelude::*;

use library::Library;

fn lib() -> PyResult<&'static Library> {
    library::get().ok_or_else(|| {
        error::MemsaverError::new_err(
            "memsaver is not initialised: call memsaver._memsaver.load(path) first",
        )
    })
}

fn cstr(s: &str, what: &str) -> PyResult<CString> {
    CString::new(s).map_err(|_| {
        error::InvalidArgumentError::new_err(format!("{what} contains a NUL character"))
    })
}

/// Turns a status code into `Ok` or the matching exception with the library's message.
fn check(l: &Library, code: c_int) -> PyResult<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: memsaver_last_error returns a NUL-terminated thread-local string.
    let msg = unsafe { CStr::from_ptr((l.memsaver_last_error)()) }
        .to_string_lossy()
        .into_owned();
    Err(error::from_status(code, msg))
}

/// Loads libmemsaver.so: the preloaded copy if the process has one, else `bundled`.
/// Returns (mode, path) with mode "preload" or "inprocess".
#[pyfunction]
fn load(bundled: &str) -> PyResult<(&'static str, String)> {
    let l = library::load(bundled).map_err(error::MemsaverError::new_err)?;
    Ok((l.mode, l.path.clone()))
}

/// Whether this process has libmemsaver.so preloaded (finding it loads and starts nothing).
#[pyfunction]
fn is_preloaded() -> bool {
    library::preloaded().is_some()
}

/// (mode, path) of the loaded library, or None before `load`.
#[pyfunction]
fn loaded() -> Option<(&'static str, String)> {
    library::get().map(|l| (l.mode, l.path.clone()))
}

/// The C tag list for `tags`: NULL (every tag) for an empty list. A name containing a comma
/// would split into two tags in the C list, so it is refused here.
fn tag_list(tags: Vec<String>) -> PyResult<Option<CString>> {
    if tags.is_empty() {
        return Ok(None);
    }
    if let Some(t) = tags.iter().find(|t| t.contains(',')) {
        return Err(error::InvalidArgumentError::new_err(format!(
            "invalid tag {t:?}: pass tags as separate arguments, e.g. pause('weights', 'kv_cache')"
        )));
    }
    cstr(&tags.join(","), "tag").map(Some)
}

fn list_ptr(t: &Option<CString>) -> *const c_char {
    t.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())
}

/// Pauses tags (all when the list is empty), with each allocation's policy or `backup` chosen
/// now. Releases the GIL while it works.
#[pyfunction]
#[pyo3(signature = (tags, backup=None))]
fn pause(py: Python<'_>, tags: Vec<String>, backup: Option<&str>) -> PyResult<()> {
    let (l, t) = (lib()?, tag_list(tags)?);
    let b = backup.map(|b| cstr(b, "backup")).transpose()?;
    let p = list_ptr(&t) as usize;
    let bp = b.as_ref().map_or(std::ptr::null(), |b| b.as_ptr()) as usize;
    let code = py.detach(|| {
        let (p, bp) = (p as *const c_char, bp as *const c_char);
        // SAFETY: NULL or NUL-terminated strings that outlive the call.
        unsafe {
            if bp.is_null() {
                (l.memsaver_pause)(p)
            } else {
                (l.memsaver_pause_with_backup)(p, bp)
            }
        }
    });
    check(l, code)
}

/// Drops the contents and backups of tags (every tag of allocations when the list is empty).
/// Releases the GIL while it works.
#[pyfunction]
fn discard(py: Python<'_>, tags: Vec<String>) -> PyResult<()> {
    let (l, t) = (lib()?, tag_list(tags)?);
    let p = list_ptr(&t) as usize;
    // SAFETY: NULL or a NUL-terminated string that outlives the call.
    let code = py.detach(|| unsafe { (l.memsaver_discard)(p as *const c_char) });
    check(l, code)
}

/// Resumes tags (all when the list is empty), keeping or releasing their backups as
/// `keep_backups` says (None: the retention setting). Releases the GIL while it works.
#[pyfunction]
#[pyo3(signature = (tags, keep_backups=None))]
fn resume(py: Python<'_>, tags: Vec<String>, keep_backups: Option<bool>) -> PyResult<()> {
    let (l, t) = (lib()?, tag_list(tags)?);
    let p = list_ptr(&t) as usize;
    let code = py.detach(|| {
        let p = p as *const c_char;
        // SAFETY: NULL or a NUL-terminated string that outlives the call.
        unsafe {
            match keep_backups {
                None => (l.memsaver_resume)(p),
                Some(keep) => (l.memsaver_resume_keep_backups)(p, c_int::from(keep)),
            }
        }
    });
    check(l, code)
}

/// The allocations of tags (all when the list is empty) as a JSON string.
#[pyfunction]
fn allocations_json(tags: Vec<String>) -> PyResult<String> {
    let (l, t) = (lib()?, tag_list(tags)?);
    let p = list_ptr(&t);
    // SAFETY: NULL or a NUL-terminated string that outlives the call; the buffer protocol of
    // read_json.
    read_json(l, |b, n, nd| unsafe {
        (l.memsaver_allocations_json)(p, b, n, nd)
    })
}

/// The stats as a JSON string.
#[pyfunction]
fn stats_json() -> PyResult<String> {
    let l = lib()?;
    // SAFETY: the buffer protocol of read_json.
    read_json(l, |b, n, nd| unsafe { (l.memsaver_stats_json)(b, n, nd) })
}

/// NCCL's memory as the hook sees it, as a JSON string.
#[pyfunction]
fn nccl_stats_json() -> PyResult<String> {
    let l = lib()?;
    // SAFETY: the buffer protocol of read_json.
    read_json(l, |b, n, nd| unsafe {
        (l.memsaver_nccl_stats_json)(b, n, nd)
    })
}

/// The C ABI status code of exception `e` (see `error::status_of`).
#[pyfunction]
fn status_of(e: &Bound<'_, PyAny>) -> PyResult<i32> {
    error::status_of(e)
}

/// The exception a failed call with status `code` raises, carrying `message` (not raised).
#[pyfunction]
fn error_from_status(py: Python<'_>, code: i32, message: String) -> Py<PyAny> {
    error::from_status(code, message).into_value(py).into_any()
}

/// The `nccl` tag's coordination (runtime directory, group, owners) as a JSON string.
#[pyfunction]
fn nccl_diagnose_json() -> PyResult<String> {
    let l = lib()?;
    // SAFETY: the buffer protocol of read_json.
    read_json(l, |b, n, nd| unsafe {
        (l.memsaver_nccl_diagnose_json)(b, n, nd)
    })
}

/// The disk backup directory and the backup files in it, as a JSON string.
#[pyfunction]
fn disk_diagnose_json() -> PyResult<String> {
    let l = lib()?;
    // SAFETY: the buffer protocol of read_json.
    read_json(l, |b, n, nd| unsafe {
        (l.memsaver_disk_diagnose_json)(b, n, nd)
    })
}

/// Sets the group id of the `nccl` tag.
#[pyfunction]
fn nccl_set_group(group: i64) -> PyResult<()> {
    let l = lib()?;
    // SAFETY: plain value argument.
    check(l, unsafe { (l.memsaver_nccl_set_group)(group) })
}

/// The group id of the `nccl` tag.
#[pyfunction]
fn nccl_group() -> PyResult<i64> {
    let l = lib()?;
    let mut g = 0i64;
    // SAFETY: valid out-pointer.
    check(l, unsafe { (l.memsaver_nccl_group)(&mut g) })?;
    Ok(g)
}

/// Calls one of the `*_json` functions (through `f`, which receives a buffer, its length and
/// the out-pointer for the needed size), growing the buffer until the text fits.
fn read_json(l: &Library, f: impl Fn(*mut c_char, usize, *mut usize) -> c_int) -> PyResult<String> {
    let mut needed = 0usize;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        // `f` gets a buffer of `buf.len()` writable bytes and a valid out-pointer.
        let code = f(buf.as_mut_ptr().cast::<c_char>(), buf.len(), &mut needed);
        if abi::Status::from_code(code) == Some(abi::Status::BufferTooSmall) && needed > buf.len() {
            buf.resize(needed, 0);
            continue;
        }
        check(l, code)?;
        buf.truncate(needed.saturating_sub(1));
        return String::from_utf8(buf).map_err(|e| error::MemsaverError::new_err(e.to_string()));
    }
}

/// Parses and validates a profile; returns it as JSON.
#[pyfunction]
fn parse_profile(text: &str, file: &str) -> PyResult<String> {
    let l = lib()?;
    let (t, f) = (cstr(text, "profile text")?, cstr(file, "file name")?);
    read_json(l, |buf, len, needed| {
        // SAFETY: NUL-terminated strings that outlive the call; the buffer protocol of read_json.
        unsafe { (l.memsaver_profile_parse)(t.as_ptr(), f.as_ptr(), buf, len, needed) }
    })
}

/// Reads and validates the profile file at `path`; returns it as JSON.
#[pyfunction]
fn load_profile(path: &str) -> PyResult<String> {
    let l = lib()?;
    let p = cstr(path, "path")?;
    read_json(l, |buf, len, needed| {
        // SAFETY: a NUL-terminated string that outlives the call; the buffer protocol of read_json.
        unsafe { (l.memsaver_profile_load)(p.as_ptr(), buf, len, needed) }
    })
}

/// Runs one of the core's commands (`["bench", "--cycles", "3"]`); returns its exit status.
/// It prints to the process's stdout and stderr; the GIL is released while it runs.
#[pyfunction]
fn cli_main(py: Python<'_>, args: Vec<String>) -> PyResult<i32> {
    let l = lib()?;
    let args = args
        .iter()
        .map(|a| cstr(a, "argument"))
        .collect::<PyResult<Vec<_>>>()?;
    let ptrs: Vec<usize> = args.iter().map(|a| a.as_ptr() as usize).collect();
    let argc = c_int::try_from(ptrs.len())
        .map_err(|_| error::InvalidArgumentError::new_err("too many arguments"))?;
    // SAFETY: `ptrs` holds `argc` NUL-terminated strings that outlive the call.
    Ok(py.detach(|| unsafe { (l.memsaver_cli_main)(argc, ptrs.as_ptr().cast::<*const c_char>()) }))
}

/// The core's commands of the command line and their flags, as JSON (`memsaver_cli_spec_json`).
#[pyfunction]
fn cli_spec() -> PyResult<String> {
    let l = lib()?;
    // SAFETY: the buffer protocol of read_json.
    read_json(l, |b, n, nd| unsafe {
        (l.memsaver_cli_spec_json)(b, n, nd)
    })
}

/// The runtime directory of the `nccl` tag's sockets (not created).
#[pyfunction]
fn runtime_dir() -> PyResult<String> {
    let l = lib()?;
    // SAFETY: the buffer protocol of read_json.
    read_json(l, |b, n, nd| unsafe { (l.memsaver_runtime_dir)(b, n, nd) })
}

/// (free, total) bytes of `device`.
#[pyfunction]
fn device_memory(device: i32) -> PyResult<(usize, usize)> {
    let l = lib()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    check(l, unsafe {
        (l.memsaver_device_memory)(device, &mut free, &mut total)
    })?;
    Ok((free, total))
}

#[pyfunction]
fn register_tag(tag: &str) -> PyResult<()> {
    let (l, t) = (lib()?, cstr(tag, "tag")?);
    // SAFETY: NUL-terminated string.
    check(l, unsafe { (l.memsaver_register_tag)(t.as_ptr()) })
}

/// Enters a region on the calling thread (`policy`: "discard", "cpu", "mmap" or "disk").
#[pyfunction]
fn region_enter(tag: &str, policy: &str) -> PyResult<()> {
    let (l, t, p) = (lib()?, cstr(tag, "tag")?, cstr(policy, "policy")?);
    // SAFETY: NUL-terminated strings.
    check(l, unsafe {
        (l.memsaver_region_enter)(t.as_ptr(), p.as_ptr())
    })
}

/// Enters a scope in which allocations on this thread are not tagged.
#[pyfunction]
fn region_disable() -> PyResult<()> {
    let l = lib()?;
    // SAFETY: no arguments.
    check(l, unsafe { (l.memsaver_region_disable)() })
}

#[pyfunction]
fn region_exit() -> PyResult<()> {
    let l = lib()?;
    // SAFETY: no arguments.
    check(l, unsafe { (l.memsaver_region_exit)() })
}

/// What applies to an allocation on this thread now, as JSON: {"tag", "policy", "disabled",
/// "process", "depth"}.
#[pyfunction]
fn region_current_json() -> PyResult<String> {
    let l = lib()?;
    // SAFETY: the buffer protocol of read_json.
    read_json(l, |b, n, nd| unsafe {
        (l.memsaver_region_current_json)(b, n, nd)
    })
}

/// Turns backup retention on or off.
#[pyfunction]
fn set_retain_backups(on: bool) -> PyResult<()> {
    let l = lib()?;
    // SAFETY: plain value argument.
    check(l, unsafe {
        (l.memsaver_set_retain_backups)(c_int::from(on))
    })
}

/// Whether backups are retained across cycles.
#[pyfunction]
fn retain_backups() -> PyResult<bool> {
    let l = lib()?;
    let mut on: c_int = 0;
    // SAFETY: valid out-pointer.
    check(l, unsafe { (l.memsaver_retain_backups)(&mut on) })?;
    Ok(on != 0)
}

/// The host address of byte `ptr` in the host backup of its allocation, or 0 if none.
#[pyfunction]
fn backup_pointer(ptr: u64, size: usize) -> PyResult<u64> {
    let l = lib()?;
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check(l, unsafe {
        (l.memsaver_backup_pointer)(ptr, size, &mut out)
    })?;
    Ok(out as u64)
}

/// Sets the disk backup directory (None unsets it).
#[pyfunction]
#[pyo3(signature = (path))]
fn set_disk_dir(path: Option<&str>) -> PyResult<()> {
    let l = lib()?;
    let p = path.map(|p| cstr(p, "path")).transpose()?;
    let ptr = p.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
    // SAFETY: NULL or a NUL-terminated string that outlives the call.
    check(l, unsafe { (l.memsaver_set_disk_dir)(ptr) })
}

/// Sets the memory margin resume keeps free on each device, in bytes.
#[pyfunction]
fn set_memory_margin(bytes: usize) -> PyResult<()> {
    let l = lib()?;
    // SAFETY: plain value argument.
    check(l, unsafe { (l.memsaver_set_memory_margin)(bytes) })
}

/// Sets the most pinned host memory prepared ahead of first pauses, in bytes.
#[pyfunction]
fn set_backup_prepare_limit(bytes: u64) -> PyResult<()> {
    let l = lib()?;
    // SAFETY: plain value argument.
    check(l, unsafe { (l.memsaver_set_backup_prepare_limit)(bytes) })
}

/// Keeps this many bytes of pinned host memory for cpu backups, pinned in the background.
#[pyfunction]
fn reserve_backups(bytes: u64) -> PyResult<()> {
    let l = lib()?;
    // SAFETY: plain value argument.
    check(l, unsafe { (l.memsaver_reserve_backups)(bytes) })
}

/// Allocates tagged device memory directly (no torch); returns the device address.
#[pyfunction]
fn malloc(size: usize, device: i32, tag: &str, policy: &str) -> PyResult<u64> {
    let (l, t, p) = (lib()?, cstr(tag, "tag")?, cstr(policy, "policy")?);
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer and NUL-terminated strings.
    check(l, unsafe {
        (l.memsaver_malloc)(&mut ptr, size, device, t.as_ptr(), p.as_ptr())
    })?;
    Ok(ptr as u64)
}

#[pyfunction]
fn free(ptr: u64) -> PyResult<()> {
    let l = lib()?;
    // SAFETY: the library checks the pointer against its own table.
    check(l, unsafe { (l.memsaver_free)(ptr as *mut c_void) })
}

/// Opts this process in to control requests from other processes (its socket starts now).
#[pyfunction]
fn control_serve() -> PyResult<()> {
    let l = lib()?;
    // SAFETY: no arguments.
    check(l, unsafe { (l.memsaver_control_serve)() })
}

/// The Python function that runs profile stages for control requests (str -> str, JSON).
static RUNNER: std::sync::Mutex<Option<Py<PyAny>>> = std::sync::Mutex::new(None);

/// The C stage runner: calls the Python runner with the GIL taken, on memsaver's control
/// thread, and returns its answer in malloc'ed memory (libmemsaver.so frees it).
unsafe extern "C" fn run_stage(request: *const c_char) -> *mut c_char {
    let answer = std::panic::catch_unwind(|| {
        // SAFETY: libmemsaver.so passes a NUL-terminated request.
        let request = unsafe { CStr::from_ptr(request) }
            .to_string_lossy()
            .into_owned();
        Python::attach(|py| -> String {
            let runner = RUNNER
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map(|r| r.clone_ref(py));
            let failed = |e: String| {
                format!(
                    "{{\"ok\": false, \"status\": 99, \"error\": {}}}",
                    json_string(&e)
                )
            };
            match runner {
                None => failed("the stage runner was removed".into()),
                Some(r) => match r
                    .call1(py, (request,))
                    .and_then(|v| v.extract::<String>(py))
                {
                    Ok(s) => s,
                    Err(e) => failed(format!("the stage runner raised {e}")),
                },
            }
        })
    })
    .unwrap_or_else(|_| "{\"ok\": false, \"status\": 99, \"error\": \"a panic\"}".into());
    malloc_text(&answer)
}

/// `text` (NULs replaced) in a fresh NUL-terminated allocation from `malloc`, which
/// libmemsaver.so frees; NULL when there is no memory.
fn malloc_text(text: &str) -> *mut c_char {
    let bytes = text.replace('\0', " ");
    // SAFETY: a fresh allocation of len + 1 bytes, filled and NUL-terminated below.
    let out = unsafe { libc::malloc(bytes.len() + 1) }.cast::<u8>();
    if out.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: `out` holds len + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, bytes.len());
        *out.add(bytes.len()) = 0;
    }
    out.cast()
}

/// The Python pause guard: `guard(event, tags)` (0 before a pause with its tags, 1 after a
/// transition with None) returning None or a refusal message.
static GUARD: std::sync::Mutex<Option<Py<PyAny>>> = std::sync::Mutex::new(None);

/// The C pause guard (`MemsaverPauseGuard`): calls the Python guard with the GIL taken, on the
/// thread of the pause or resume. An exception it raises refuses the pause, named.
unsafe extern "C" fn pause_guard(event: c_int, tags: *const c_char) -> *mut c_char {
    let answer = std::panic::catch_unwind(|| {
        let tags: Option<Vec<String>> = (!tags.is_null()).then(|| {
            // SAFETY: libmemsaver.so passes NULL or a NUL-terminated list.
            let list = unsafe { CStr::from_ptr(tags) }.to_string_lossy();
            list.split(',')
                .filter(|t| !t.is_empty())
                .map(str::to_owned)
                .collect()
        });
        Python::attach(|py| -> Option<String> {
            let guard = GUARD
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map(|g| g.clone_ref(py))?;
            match guard
                .call1(py, (event, tags))
                .and_then(|v| v.extract::<Option<String>>(py))
            {
                Ok(refusal) => refusal,
                Err(e) => Some(format!(
                    "the pause guard of the memsaver package raised {e}"
                )),
            }
        })
    })
    .unwrap_or_else(|_| Some("the pause guard of the memsaver package panicked".into()));
    answer.map_or(std::ptr::null_mut(), |m| malloc_text(&m))
}

/// Installs `guard` (event: int, tags: list[str] | None) -> str | None as the process's pause
/// guard; None removes it.
#[pyfunction]
#[pyo3(signature = (guard))]
fn set_pause_guard(guard: Option<Py<PyAny>>) -> PyResult<()> {
    let l = lib()?;
    let installed: library::MemsaverPauseGuard = guard
        .as_ref()
        .map(|_| pause_guard as unsafe extern "C" fn(c_int, *const c_char) -> *mut c_char);
    *GUARD.lock().unwrap_or_else(|p| p.into_inner()) = guard;
    // SAFETY: `pause_guard` is callable from any thread for the life of the process.
    check(l, unsafe { (l.memsaver_set_pause_guard)(installed) })
}

/// A JSON string literal of `s`.
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Installs `runner` (a function taking and returning JSON text) as the runner of profile
/// stages for control requests; None removes it.
#[pyfunction]
#[pyo3(signature = (runner))]
fn control_set_runner(runner: Option<Py<PyAny>>) -> PyResult<()> {
    let l = lib()?;
    let installed: library::MemsaverStageRunner = runner
        .as_ref()
        .map(|_| run_stage as unsafe extern "C" fn(*const c_char) -> *mut c_char);
    *RUNNER.lock().unwrap_or_else(|p| p.into_inner()) = runner;
    // SAFETY: `run_stage` is callable from any thread for the life of the process.
    check(l, unsafe { (l.memsaver_control_set_runner)(installed) })
}

/// Sends a control request (JSON) to other processes; returns their answers (JSON). The GIL
/// is released while it waits. The request is sent once.
#[pyfunction]
fn control_json(py: Python<'_>, request: &str) -> PyResult<String> {
    let l = lib()?;
    let r = cstr(request, "request")?;
    let rp = r.as_ptr() as usize;
    let (code, answer) = py.detach(|| {
        let mut answer: *mut c_char = std::ptr::null_mut();
        // SAFETY: a NUL-terminated request that outlives the call; a valid out-pointer.
        let code = unsafe { (l.memsaver_control_json)(rp as *const c_char, &mut answer) };
        (code, answer as usize)
    });
    check(l, code)?;
    let answer = answer as *mut c_char;
    if answer.is_null() {
        return Err(error::MemsaverError::new_err("control request: no answer"));
    }
    // SAFETY: a malloc'ed NUL-terminated text, ours to free after copying it.
    let text = unsafe { CStr::from_ptr(answer) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: allocated with malloc by libmemsaver.so, not used after this.
    unsafe { libc::free(answer.cast()) };
    Ok(text)
}

#[pymodule]
fn _memsaver(m: &Bound<'_, PyModule>) -> PyResult<()> {
    error::register(m)?;
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(loaded, m)?)?;
    m.add_function(wrap_pyfunction!(is_preloaded, m)?)?;
    m.add_function(wrap_pyfunction!(pause, m)?)?;
    m.add_function(wrap_pyfunction!(resume, m)?)?;
    m.add_function(wrap_pyfunction!(discard, m)?)?;
    m.add_function(wrap_pyfunction!(allocations_json, m)?)?;
    m.add_function(wrap_pyfunction!(stats_json, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_stats_json, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_diagnose_json, m)?)?;
    m.add_function(wrap_pyfunction!(disk_diagnose_json, m)?)?;
    m.add_function(wrap_pyfunction!(status_of, m)?)?;
    m.add_function(wrap_pyfunction!(error_from_status, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_set_group, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_group, m)?)?;
    m.add_function(wrap_pyfunction!(parse_profile, m)?)?;
    m.add_function(wrap_pyfunction!(load_profile, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(cli_spec, m)?)?;
    m.add_function(wrap_pyfunction!(runtime_dir, m)?)?;
    m.add_function(wrap_pyfunction!(device_memory, m)?)?;
    m.add_function(wrap_pyfunction!(register_tag, m)?)?;
    m.add_function(wrap_pyfunction!(region_enter, m)?)?;
    m.add_function(wrap_pyfunction!(region_disable, m)?)?;
    m.add_function(wrap_pyfunction!(region_exit, m)?)?;
    m.add_function(wrap_pyfunction!(region_current_json, m)?)?;
    m.add_function(wrap_pyfunction!(set_retain_backups, m)?)?;
    m.add_function(wrap_pyfunction!(retain_backups, m)?)?;
    m.add_function(wrap_pyfunction!(backup_pointer, m)?)?;
    m.add_function(wrap_pyfunction!(set_disk_dir, m)?)?;
    m.add_function(wrap_pyfunction!(set_memory_margin, m)?)?;
    m.add_function(wrap_pyfunction!(set_backup_prepare_limit, m)?)?;
    m.add_function(wrap_pyfunction!(reserve_backups, m)?)?;
    m.add_function(wrap_pyfunction!(malloc, m)?)?;
    m.add_function(wrap_pyfunction!(free, m)?)?;
    m.add_function(wrap_pyfunction!(control_serve, m)?)?;
    m.add_function(wrap_pyfunction!(control_set_runner, m)?)?;
    m.add_function(wrap_pyfunction!(set_pause_guard, m)?)?;
    m.add_function(wrap_pyfunction!(control_json, m)?)?;
    Ok(())
}
