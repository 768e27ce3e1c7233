//! Helpers shared by the C ABI test files.

use std::ffi::{CStr, CString};

use memsaver::{Status, memsaver_last_error, memsaver_stats_json};

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

/// `memsaver_stats_json`, parsed.
pub fn stats() -> serde_json::Value {
    let mut needed = 0usize;
    // SAFETY: NULL buffer with len 0 asks for the size.
    let rc = unsafe { memsaver_stats_json(std::ptr::null_mut(), 0, &mut needed) };
    assert_eq!(rc, Status::BufferTooSmall as i32);
    // Other tests of this process add tags concurrently: grow the buffer until the text fits.
    loop {
        let mut buf = vec![0u8; needed];
        // SAFETY: `buf` has `buf.len()` bytes.
        let rc = unsafe { memsaver_stats_json(buf.as_mut_ptr().cast(), buf.len(), &mut needed) };
        if rc == Status::BufferTooSmall as i32 {
            continue;
        }
        assert_eq!(rc, 0, "{}", last_error());
        return serde_json::from_slice(&buf[..needed - 1]).unwrap();
    }
}

/// The entry of tag `name` in [`stats`].
pub fn tag<'a>(s: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    s["tags"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tag"] == name)
        .unwrap()
}
