//! Finding and calling libmemsaver.so. The extension never links the allocator itself: one
//! process has one allocator state, the one inside libmemsaver.so, whether that library was
//! preloaded (LD_PRELOAD) or is loaded here for the in-process mode.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;

/// The stage runner's type in the C ABI (`MemsaverStageRunner` in memsaver.h).
pub type MemsaverStageRunner = Option<unsafe extern "C" fn(*const c_char) -> *mut c_char>;
/// The pause guard's type in the C ABI (`MemsaverPauseGuard` in memsaver.h).
pub type MemsaverPauseGuard = Option<unsafe extern "C" fn(c_int, *const c_char) -> *mut c_char>;

macro_rules! c_abi {
    ($($name:ident: $ty:ty,)*) => {
        /// The C functions of libmemsaver.so (torch-shim/include/memsaver.h), resolved by name.
        #[allow(non_snake_case)]
        pub struct Library {
            pub path: String,
            /// "preload" when the library was already in the process, else "inprocess".
            pub mode: &'static str,
            $(pub $name: $ty,)*
        }

        impl Library {
            /// # Safety
            /// `h` is a live handle of libmemsaver.so.
            unsafe fn resolve(h: *mut c_void, path: String, mode: &'static str) -> Result<Self, String> {
                Ok(Self { $($name: {
                    let name = concat!(stringify!($name), "\0");
                    // SAFETY: live handle, NUL-terminated name.
                    let p = unsafe { libc::dlsym(h, name.as_ptr().cast()) };
                    if p.is_null() {
                        return Err(format!("{} has no symbol {}: is it a libmemsaver.so of the same version?", path, stringify!($name)));
                    }
                    // SAFETY: the symbol is the function of this name, whose signature abi.rs
                    // copies from its definition (checked by torch-shim/tests/abi_files.rs).
                    unsafe { std::mem::transmute::<*mut c_void, $ty>(p) }
                },)* path, mode })
            }
        }
    };
}

// Every function of the C ABI, with the signature of its Rust definition: the list is
// generated from torch-shim's source into abi.rs.
crate::abi::with_functions!(c_abi);

static LIBRARY: OnceLock<Library> = OnceLock::new();

/// The loaded library, if `load` has succeeded.
pub fn get() -> Option<&'static Library> {
    LIBRARY.get()
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-null, NUL-terminated.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// The copy already in the process (preloaded), found by one of its symbols.
pub fn preloaded() -> Option<(*mut c_void, String)> {
    // SAFETY: RTLD_DEFAULT searches the global scope, where LD_PRELOAD puts the library.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"memsaver_last_error".as_ptr()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: zeroed Dl_info is a valid out-parameter.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `sym` is an address inside a loaded object.
    if unsafe { libc::dladdr(sym, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr filled in a NUL-terminated file name.
    let path = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: the object is loaded; RTLD_NOLOAD only returns a handle to it.
    let h = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    (!h.is_null()).then_some((h, path))
}

/// Uses the preloaded libmemsaver.so if there is one, else loads the one at `bundled`.
pub fn load(bundled: &str) -> Result<&'static Library, String> {
    if let Some(l) = LIBRARY.get() {
        return Ok(l);
    }
    let (h, path, mode) = match preloaded() {
        Some((h, path)) => (h, path, "preload"),
        None => {
            let c = CString::new(bundled)
                .map_err(|_| "library path contains a NUL byte".to_string())?;
            // SAFETY: NUL-terminated path. RTLD_LOCAL: its cudaMalloc/cudaFree must not
            // interpose anything in this mode.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if h.is_null() {
                return Err(format!("cannot load {bundled}: {}", dlerror()));
            }
            (h, bundled.to_owned(), "inprocess")
        }
    };
    // SAFETY: `h` is a live handle of libmemsaver.so.
    let lib = unsafe { Library::resolve(h, path, mode) }?;
    Ok(LIBRARY.get_or_init(|| lib))
}
