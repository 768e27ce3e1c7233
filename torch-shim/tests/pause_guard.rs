//! The pause guard of the C ABI (`memsaver_set_pause_guard`), in a process of its own (this
//! test binary): called before every pause with the tags it names and after every transition,
//! its refusal fails the pause with nothing changed; and without one, a process that has
//! PyTorch's CUDA library loaded refuses to pause tensor tags (fake driver, via
//! MEMSAVER_CUDA_LIB as set by `make test`).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::Mutex;

use memsaver::*;

mod common;
use common::{c, last_error, stats, tag};

/// What the guard below was called with: (event, tags).
static CALLS: Mutex<Vec<(c_int, Option<String>)>> = Mutex::new(Vec::new());

unsafe extern "C" fn guard(event: c_int, tags: *const c_char) -> *mut c_char {
    let tags = if tags.is_null() {
        None
    } else {
        // SAFETY: memsaver passes NULL or a NUL-terminated list.
        Some(
            unsafe { CStr::from_ptr(tags) }
                .to_string_lossy()
                .into_owned(),
        )
    };
    let refuse = tags.as_deref().is_some_and(|t| t.contains("guard_refused"));
    CALLS.lock().unwrap().push((event, tags));
    if !refuse {
        return std::ptr::null_mut();
    }
    let m = c"guard_refused has an open region";
    // SAFETY: a fresh allocation of the message's size, which memsaver frees.
    unsafe {
        let p = libc::malloc(m.to_bytes_with_nul().len()).cast::<c_char>();
        std::ptr::copy_nonoverlapping(m.as_ptr(), p, m.to_bytes_with_nul().len());
        p
    }
}

fn malloc(name: &str) -> *mut c_void {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer and C strings.
    let rc =
        unsafe { memsaver_malloc(&mut p, 2 << 20, 0, c(name).as_ptr(), c("discard").as_ptr()) };
    assert_eq!(rc, 0, "{}", last_error());
    p
}

fn pause(tags: &str) -> c_int {
    // SAFETY: C string argument.
    unsafe { memsaver_pause(c(tags).as_ptr()) }
}

fn resume(tags: &str) -> c_int {
    // SAFETY: C string argument.
    unsafe { memsaver_resume(c(tags).as_ptr()) }
}

fn paused(name: &str) -> bool {
    tag(&stats(), name)["paused"] == true
}

/// A library named like PyTorch's CUDA library (its soname), loaded into this process.
fn load_a_torch_cuda_library() -> bool {
    let dir = std::env::temp_dir().join(format!("memsaver-guard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (src, lib) = (dir.join("empty.c"), dir.join("libtorch_cuda.so"));
    std::fs::write(&src, "int memsaver_test_torch_cuda_stand_in;\n").unwrap();
    let out = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-Wl,-soname,libtorch_cuda.so", "-o"])
        .arg(&lib)
        .arg(&src)
        .output();
    match out {
        Ok(o) => assert!(
            o.status.success(),
            "cc: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            memsaver_test_support::skip(
                "no cc on this machine: the torch-loaded refusal is not checked",
            );
            return false;
        }
        Err(e) => panic!("cc: {e}"),
    }
    let path = std::ffi::CString::new(lib.to_str().unwrap()).unwrap();
    // SAFETY: a library with no constructors, loaded for the rest of the process.
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!h.is_null());
    // Loaded: its files are not needed any more, and no test leaves files behind.
    std::fs::remove_dir_all(&dir).unwrap();
    true
}

// One test: the guard is process-wide, and the steps below depend on what the ones before
// installed and loaded.
#[test]
fn the_guard_is_asked_before_and_told_after_every_transition() {
    malloc("guard_a");
    malloc("guard_refused");

    // No guard and no torch: pauses go through.
    assert_eq!(pause("guard_a"), 0, "{}", last_error());
    assert_eq!(resume("guard_a"), 0, "{}", last_error());

    // SAFETY: `guard` follows MemsaverPauseGuard's contract and lives for the process.
    assert_eq!(unsafe { memsaver_set_pause_guard(Some(guard)) }, 0);
    assert_eq!(pause("guard_a"), 0, "{}", last_error());
    assert_eq!(resume("guard_a"), 0, "{}", last_error());
    assert_eq!(
        std::mem::take(&mut *CALLS.lock().unwrap()),
        vec![
            (MEMSAVER_GUARD_BEFORE_PAUSE, Some("guard_a".into())),
            (MEMSAVER_GUARD_AFTER_TRANSITION, None),
            (MEMSAVER_GUARD_AFTER_TRANSITION, None),
        ]
    );

    // A refusal: the status, the guard's message, nothing paused, and the guard told it ended.
    assert_eq!(pause("guard_a,guard_refused"), Status::PauseRefused as i32);
    assert_eq!(
        last_error(),
        "pause refused: guard_refused has an open region"
    );
    assert!(!paused("guard_a") && !paused("guard_refused"));
    assert_eq!(
        std::mem::take(&mut *CALLS.lock().unwrap()),
        vec![
            (
                MEMSAVER_GUARD_BEFORE_PAUSE,
                Some("guard_a,guard_refused".into())
            ),
            (MEMSAVER_GUARD_AFTER_TRANSITION, None),
        ]
    );

    // A pause of every tag (NULL) asks about every tag of the table by name: the guard refuses
    // it for `guard_refused` (an empty list would have let it through).
    // SAFETY: NULL names every tag.
    let rc = unsafe { memsaver_pause(std::ptr::null()) };
    assert_eq!(rc, Status::PauseRefused as i32, "{}", last_error());
    assert!(!paused("guard_a") && !paused("guard_refused"));
    let calls = std::mem::take(&mut *CALLS.lock().unwrap());
    let (event, tags) = &calls[0];
    assert_eq!(*event, MEMSAVER_GUARD_BEFORE_PAUSE, "{calls:?}");
    let tags: Vec<&str> = tags.as_deref().unwrap_or("").split(',').collect();
    assert!(
        tags.contains(&"guard_a") && tags.contains(&"guard_refused"),
        "the guard was asked about {tags:?}"
    );

    // The external tag `nccl` holds no torch memory: its pause is not asked about.
    assert_eq!(pause("nccl"), 0, "{}", last_error());
    assert_eq!(resume("nccl"), 0, "{}", last_error());
    assert!(
        CALLS
            .lock()
            .unwrap()
            .iter()
            .all(|(e, _)| *e == MEMSAVER_GUARD_AFTER_TRANSITION),
        "{:?}",
        CALLS.lock().unwrap()
    );

    // With PyTorch's CUDA library loaded and no guard, a pause of tensor tags is refused.
    // SAFETY: NULL removes the guard.
    assert_eq!(unsafe { memsaver_set_pause_guard(None) }, 0);
    if !load_a_torch_cuda_library() {
        return;
    }
    assert_eq!(pause("guard_a"), Status::PauseRefused as i32);
    let e = last_error();
    assert!(
        e.contains("libtorch_cuda.so") && e.contains("import memsaver"),
        "{e}"
    );
    assert!(!paused("guard_a"));
    assert_eq!(pause("nccl"), 0, "{}", last_error());
    assert_eq!(resume("nccl"), 0, "{}", last_error());
    // A guard installed: allowed again.
    // SAFETY: as above.
    assert_eq!(unsafe { memsaver_set_pause_guard(Some(guard)) }, 0);
    assert_eq!(pause("guard_a"), 0, "{}", last_error());
    assert_eq!(resume("guard_a"), 0, "{}", last_error());
}
