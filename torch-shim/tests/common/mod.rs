//! Helpers shared by the C ABI test files.

use std::ffi::{CStr, CString};

use memsaver::memsaver_last_error;

/// A C string for a test argument.
pub fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

/// The calling thread's last memsaver error message.
pub fn last_error() -> String {
    // SAFETY: memsaver_last_error returns a NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(memsaver_last_error()) }
        .to_string_lossy()
        .into_owned()
}
