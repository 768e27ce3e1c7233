//! The helpers every exported function of the C ABI (`lib.rs`) is written with: running its
//! body so that neither an error nor a panic crosses into C ([`ffi`]: a status code, and the
//! message kept per thread for `memsaver_last_error`), reading its C string arguments (tags,
//! tag lists, policies) and writing JSON into a caller's buffer ([`write_json`]).

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};

use memsaver_allocator::{Error, Policy};

use crate::Status;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Stores `msg` for [`memsaver_last_error`](crate::memsaver_last_error). Never panics: during thread teardown (a free from
/// a thread-local destructor) the message is dropped instead.
pub(crate) fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// What a failed C function reports: its status code and the message
/// [`memsaver_last_error`](crate::memsaver_last_error) gives.
pub(crate) struct Failure {
    status: Status,
    message: String,
}

impl Failure {
    pub(crate) fn new(status: Status, message: String) -> Self {
        Failure { status, message }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure {
            status: Status::of(&e),
            message: e.to_string(),
        }
    }
}

impl From<memsaver_profile::ProfileError> for Failure {
    fn from(e: memsaver_profile::ProfileError) -> Self {
        Failure {
            status: Status::Profile,
            message: e.to_string(),
        }
    }
}

/// Runs `f`, turning errors and panics into a status code and a stored message.
pub(crate) fn ffi(f: impl FnOnce() -> Result<(), Error>) -> c_int {
    ffi_with(|| f().map_err(Failure::from))
}

/// [`ffi`] for functions whose errors are not all the core's.
pub(crate) fn ffi_with(f: impl FnOnce() -> Result<(), Failure>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Status::Ok as c_int,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            e.status as c_int
        }
        Err(_) => {
            set_last_error(
                "internal error in memsaver (a bug: please report it with MEMSAVER_LOG=debug output)",
            );
            Status::Internal as c_int
        }
    }
}

/// Reads a C string argument; NULL gives `None`.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string.
pub(crate) unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Error> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map(Some)
        .map_err(|_| Error::InvalidArgument(format!("{what} is not valid UTF-8")))
}

/// Reads a backup policy argument (`"discard"`, `"cpu"`, `"mmap"` or `"disk"`); NULL means
/// discard.
///
/// # Safety
/// As [`opt_str`].
pub(crate) unsafe fn opt_policy(p: *const c_char) -> Result<Policy, Error> {
    // SAFETY: forwarded contract.
    match unsafe { opt_str(p, "policy") }? {
        Some(p) => p.parse(),
        None => Ok(Policy::Discard),
    }
}

/// # Safety
/// As [`opt_str`].
pub(crate) unsafe fn req_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, Error> {
    // SAFETY: forwarded contract.
    unsafe { opt_str(p, what) }?.ok_or_else(|| Error::InvalidArgument(format!("{what} is NULL")))
}

/// Splits a C tag list. NULL means every tag (an empty list for the core); a string must name
/// at least one tag, and every item between commas must be a tag: `""`, `" "`, `","` and
/// `"a,,b"` are refused rather than read as "every tag".
pub(crate) fn split_tags(s: Option<&str>) -> Result<Vec<&str>, Error> {
    let Some(s) = s else {
        return Ok(Vec::new());
    };
    let tags: Vec<&str> = s.split(',').map(str::trim).collect();
    if tags.iter().any(|t| t.is_empty()) {
        return Err(Error::InvalidArgument(format!(
            "tag list {s:?} has an empty tag: name tags separated by commas (\"weights,kv_cache\"), \
             or pass NULL for every tag"
        )));
    }
    Ok(tags)
}

/// Runs the body of an entry point that answers with an exit status (`memsaver_cli_main`):
/// an error is a usage error (2) and a panic an internal error (1), each said on stderr.
pub(crate) fn exit_code(f: impl FnOnce() -> Result<c_int, Error>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(code)) => code,
        Ok(Err(e)) => {
            eprintln!("memsaver: error: {e}");
            2
        }
        Err(_) => {
            eprintln!("memsaver: internal error (a bug: please report it with MEMSAVER_LOG=debug)");
            1
        }
    }
}

/// Reads a C `argc`/`argv` pair (a NULL argument reads as "").
///
/// # Safety
/// `argv` holds `argc` NUL-terminated strings (or NULL pointers).
pub(crate) unsafe fn c_args(argc: c_int, argv: *const *const c_char) -> Result<Vec<String>, Error> {
    let mut args = Vec::new();
    for i in 0..usize::try_from(argc).unwrap_or(0) {
        // SAFETY: `argv` holds `argc` pointers per the contract.
        let p = unsafe { *argv.add(i) };
        // SAFETY: each is a NUL-terminated string per the contract.
        args.push(unsafe { opt_str(p, "argument") }?.unwrap_or("").to_owned());
    }
    Ok(args)
}

/// The text of a NUL-terminated string from `malloc` (NULL: `None`), which is freed.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string allocated with `malloc`, used by nobody after this.
pub(crate) unsafe fn take_malloc_c_string(p: *mut c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: NUL-terminated, per the contract.
    let text = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    // SAFETY: allocated with malloc and not used after this, per the contract.
    unsafe { libc::free(p.cast()) };
    Some(text)
}

/// A copy of `text` in memory from `malloc`, NUL-terminated (empty if `text` holds a NUL), for
/// the caller to `free`.
pub(crate) fn malloc_c_string(text: &str) -> Result<*mut c_char, Error> {
    let text = CString::new(text).unwrap_or_default();
    let bytes = text.as_bytes_with_nul();
    // SAFETY: a fresh allocation of the text's size, checked below.
    let out = unsafe { libc::malloc(bytes.len()) }.cast::<u8>();
    if out.is_null() {
        return Err(Error::InvalidArgument(
            "out of host memory for the answer".into(),
        ));
    }
    // SAFETY: `out` holds `bytes.len()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out, bytes.len()) };
    Ok(out.cast())
}

/// The calling thread's last error message, for `memsaver_last_error` (empty if none; valid
/// until the next memsaver call on this thread).
pub(crate) fn last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// Encodes the value `make` returns as JSON into a caller's buffer, the protocol of the
/// `*_json` functions: `*needed` gets the size including the NUL; a NULL or short buffer gives
/// `MEMSAVER_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `buf` is valid for `len` bytes of writes (or NULL with `len == 0`); `needed` is NULL or a
/// valid out-pointer.
pub(crate) unsafe fn write_json(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
    make: impl FnOnce() -> Result<serde_json::Result<String>, Error>,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { write_json_with(buf, len, needed, || make().map_err(Failure::from)) }
}

/// [`write_json`] for functions whose errors are not all the core's.
///
/// # Safety
/// As [`write_json`].
pub(crate) unsafe fn write_json_with(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
    make: impl FnOnce() -> Result<serde_json::Result<String>, Failure>,
) -> c_int {
    let mut too_small = false;
    let code = ffi_with(|| {
        let json = make()?.map_err(|e| {
            Failure::from(Error::InvalidArgument(format!(
                "cannot encode the JSON: {e}"
            )))
        })?;
        let n = json.len() + 1;
        if !needed.is_null() {
            // SAFETY: non-null out-pointer per the contract.
            unsafe { *needed = n };
        }
        if buf.is_null() || len < n {
            too_small = true;
            return Ok(());
        }
        // SAFETY: `buf` has room for `n <= len` bytes per the contract.
        unsafe {
            std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), json.len());
            *buf.add(json.len()) = 0;
        }
        Ok(())
    });
    if code == Status::Ok as c_int && too_small {
        set_last_error("the buffer is too small; call again with the size written to *needed");
        return Status::BufferTooSmall as c_int;
    }
    code
}
