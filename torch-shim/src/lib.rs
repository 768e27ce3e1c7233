//! memsaver: the C ABI of libmemsaver.so, for LD_PRELOAD and for dlopen by the Python package,
//! over the process-wide allocator.
//!
//! Every function returns a `memsaver_status` code as an int (`MEMSAVER_OK`, 0, on success).
//! On failure the calling thread's last error message, read with `memsaver_last_error()`, says
//! what went wrong and what to do. No function aborts, exits the process or unwinds into C: a
//! panic is caught and reported as `MEMSAVER_ERR_INTERNAL`.
//!
//! Tags: 1 to 64 characters from letters, digits, '_', '-' and '.' ("nccl" is memsaver's own).
//! Tag lists are comma-separated ("weights,kv_cache"; whitespace around a tag is ignored).
//! Only NULL means every tag: "", " ", "," or "a,,b" give `MEMSAVER_ERR_INVALID_ARGUMENT`.
//!
//! Policies: "discard" (contents dropped on pause), "cpu" (kept in pinned host memory), "mmap"
//! (kept in pageable anonymous host memory, unmapped when released so the RSS drops) or "disk"
//! (kept in a file of the disk backup directory, copied through a bounded staging buffer).
//!
//! JSON out-parameters (`*_json`, `memsaver_profile_parse`): the text, NUL-terminated, is
//! written into `buf` of `len` bytes and the size needed, NUL included, into `*needed` (may be
//! NULL); a NULL or short buffer gives `MEMSAVER_ERR_BUFFER_TOO_SMALL`: call again with a buffer
//! of `*needed` bytes.
//!
//! Hooks: under LD_PRELOAD this library also defines cudaMalloc and cudaFree (not declared
//! here): inside a region the memory comes from memsaver, outside the call goes to libcudart
//! untouched, unless `MEMSAVER_PROCESS_TAG` (or `TMS_INIT_ENABLE=1`: tag "default") is set:
//! then allocations outside any region get that tag and `MEMSAVER_PROCESS_BACKUP`'s policy
//! (whole-process mode; the process tag accepts new, resident allocations while paused, and
//! resume skips them). Without preload, torch's CUDAPluggableAllocator calls
//! `memsaver_torch_malloc` and `memsaver_torch_free`, inside regions only. Under LD_PRELOAD it
//! also defines cudaIpcGetMemHandle, cudaIpcOpenMemHandle and cudaIpcCloseMemHandle: memory
//! memsaver allocated is shared with other memsaver processes of the same user, group and pid
//! namespace through handles of memsaver's own, and an opened handle follows its owner's
//! pauses and resumes (docs/architecture.md, "Memory shared with other processes"); other
//! memory goes to libcudart untouched.
//!
//! Control (`memsaver_control_*`): a process that opted in (`MEMSAVER_CONTROL=1`, or
//! `memsaver_control_serve`) serves pause, resume, stats and profile-stage requests from
//! other processes of its user and group over its memsaver socket (docs/security.md).
//!
//! This text, the doc comment of each exported function and the status codes (`Status`) are
//! the only definition of the C ABI: `include/memsaver.h` and the Python binding's table
//! (`python/src/abi.rs`) are generated from them by `tests/abi_files.rs` (`make abi`), which
//! fails when a checked-in copy differs: edit the Rust source, not those files.

pub mod cli;
mod control;
mod ffi;
mod guard;
pub mod hooks;
pub mod options;
pub mod region;
mod status;

pub use status::Status;

use std::ffi::{c_char, c_int, c_void};

use memsaver_allocator::{Error, Policy};

use ffi::{
    Failure, c_args, exit_code, ffi, ffi_with, malloc_c_string, opt_policy, opt_str, req_str,
    split_tags, write_json, write_json_with,
};

/// The process-wide allocator for operations done for the application, started on first use
/// with every layer's start hooks run (nccl-hook registers the `nccl` tag): the core's
/// `memsaver_allocator::global`, re-exported. The hooks' `cudaFree` path uses
/// `memsaver_allocator::global_if_started` instead, which never starts it.
pub use memsaver_allocator::global as allocator;

/// The message of the last failed call on this thread (empty if none). The pointer stays
/// valid until the next memsaver call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_last_error() -> *const c_char {
    ffi::last_error()
}

/// Allocates `size` bytes on `device` with an explicit tag and policy (`"discard"`, `"cpu"`,
/// `"mmap"` or `"disk"`; NULL means discard) and writes the device address to `*ptr`.
///
/// # Safety
/// `ptr` is a valid out-pointer; `tag` and `policy` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_malloc(
    ptr: *mut *mut c_void,
    size: usize,
    device: c_int,
    tag: *const c_char,
    policy: *const c_char,
) -> c_int {
    ffi(|| {
        if ptr.is_null() {
            return Err(Error::InvalidArgument("ptr is NULL".into()));
        }
        // SAFETY: per this function's contract.
        let tag = unsafe { req_str(tag, "tag") }?;
        // SAFETY: per this function's contract.
        let policy = unsafe { opt_policy(policy) }?;
        let p = allocator()?.malloc(size, device, tag, policy)?;
        // SAFETY: `ptr` is a valid out-pointer (checked non-null above).
        unsafe { *ptr = p as *mut c_void };
        Ok(())
    })
}

/// Frees memory returned by `memsaver_malloc`, in any state (paused included).
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_free(ptr: *mut c_void) -> c_int {
    ffi(|| allocator()?.free(ptr as u64))
}

/// Pauses the given tags (comma-separated; NULL for all; an empty or blank item is an error).
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_pause(tags: *const c_char) -> c_int {
    ffi(|| {
        // SAFETY: per this function's contract.
        let tags = unsafe { opt_str(tags, "tags") }?;
        allocator()?.pause(&split_tags(tags)?).map(drop)
    })
}

/// Resumes the given tags (comma-separated; NULL for all; an empty or blank item is an error).
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_resume(tags: *const c_char) -> c_int {
    ffi(|| {
        // SAFETY: per this function's contract.
        let tags = unsafe { opt_str(tags, "tags") }?;
        allocator()?.resume(&split_tags(tags)?).map(drop)
    })
}

/// Pauses the given tags (as `memsaver_pause`) with the backup policy chosen now: every
/// allocation this call pauses is paused as if `backup` (`"discard"`, `"cpu"`, `"mmap"` or
/// `"disk"`) were its policy; NULL keeps each allocation's own (`memsaver_pause`). With
/// `"discard"` the contents are dropped, with the backup an earlier cycle left; with a keeping
/// policy the next resume restores what this pause copied. Allocations already paused keep
/// what their pause did. An unknown policy is `MEMSAVER_ERR_INVALID_ARGUMENT`, and so is naming
/// `nccl` with a policy (its backups follow `MEMSAVER_NCCL_BACKUP`; with NULL tags it pauses as
/// always).
///
/// # Safety
/// `tags` and `backup` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_pause_with_backup(
    tags: *const c_char,
    backup: *const c_char,
) -> c_int {
    ffi(|| {
        // SAFETY: per this function's contract.
        let tags = unsafe { opt_str(tags, "tags") }?;
        // SAFETY: per this function's contract.
        let backup = unsafe { opt_str(backup, "backup") }?
            .map(str::parse::<Policy>)
            .transpose()?;
        allocator()?
            .pause_with_backup(&split_tags(tags)?, backup)
            .map(drop)
    })
}

/// Drops the contents and the backups of the given tags (comma-separated; NULL for every tag
/// of allocations): resident allocations are paused without a copy and paused ones lose their
/// backup, so the next resume maps memory holding arbitrary bytes. The tags are paused
/// afterwards. `nccl` cannot be discarded (`MEMSAVER_ERR_INVALID_ARGUMENT`; NULL leaves it
/// alone).
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_discard(tags: *const c_char) -> c_int {
    ffi(|| {
        // SAFETY: per this function's contract.
        let tags = unsafe { opt_str(tags, "tags") }?;
        allocator()?.discard(&split_tags(tags)?).map(drop)
    })
}

/// Resumes the given tags (as `memsaver_resume`), then keeps (`keep` > 0) or releases
/// (`keep` == 0) the backups of what it resumed, whatever `memsaver_set_retain_backups` says;
/// `keep` < 0 follows that setting. Releasing also drops the backups retained by resident
/// allocations of the tags.
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_resume_keep_backups(tags: *const c_char, keep: c_int) -> c_int {
    ffi(|| {
        // SAFETY: per this function's contract.
        let tags = unsafe { opt_str(tags, "tags") }?;
        let keep = (keep >= 0).then_some(keep > 0);
        allocator()?
            .resume_keep_backups(&split_tags(tags)?, keep)
            .map(drop)
    })
}

/// Writes the allocations of the given tags (comma-separated; NULL for every tag) as JSON, like
/// `memsaver_stats_json`: [{"ptr","size","device","tag","policy","state","backup",
/// "backup_bytes"}] by address; `policy` is the one it was allocated with, `state` one of
/// "resident", "pausing", "paused", "resuming", `backup` "pinned", "mmap", "disk" or null. An
/// unknown tag is `MEMSAVER_ERR_UNKNOWN_TAG`; `nccl` has no allocations to list
/// (`MEMSAVER_ERR_INVALID_ARGUMENT`: see `memsaver_nccl_stats_json`).
///
/// # Safety
/// `tags` is NULL or a NUL-terminated string; `buf` and `needed` as for `memsaver_stats_json`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_allocations_json(
    tags: *const c_char,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        write_json(buf, len, needed, || {
            let tags = opt_str(tags, "tags")?;
            Ok(serde_json::to_string(
                &allocator()?.allocations(&split_tags(tags)?)?,
            ))
        })
    }
}

/// Registers a tag without allocating, so that it can be paused and listed.
///
/// # Safety
/// `tag` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_register_tag(tag: *const c_char) -> c_int {
    ffi(|| {
        // SAFETY: per this function's contract.
        let tag = unsafe { req_str(tag, "tag") }?;
        allocator()?.register_tag(tag)
    })
}

/// Writes the stats as JSON (see "JSON out-parameters" above): {"tags":[{"tag","paused",
/// "allocations","reserved_bytes","resident_bytes","backup_bytes","pinned_backup_bytes",
/// "mmap_backup_bytes","disk_backup_bytes","devices":[...]}],"total":{...}}. backup_bytes is
/// host memory (pinned + mmap); disk files are counted apart. "shared": memory shared with
/// other processes (CUDA IPC handles, NCCL's registration of tagged buffers):
/// {"exports":{TAG:{"handles","bytes","importers"}},"imports":[{"owner_pid","bytes","paused",
/// "opens","via"}]}, "via" being "cuda_ipc" or "nccl".
///
/// # Safety
/// `buf` is valid for `len` bytes of writes (or NULL with `len == 0`); `needed` is NULL or a
/// valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_stats_json(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        write_json(buf, len, needed, || {
            let stats = allocator()?.stats();
            Ok(serde_json::to_value(&stats).and_then(|mut doc| {
                // Memory shared with other processes through CUDA IPC handles: this process's
                // exports per tag, and its imports of other processes' memory.
                doc["shared"] = serde_json::json!({
                    "exports": memsaver_ipc::shared::exports(),
                    "imports": memsaver_ipc::shared::imports(),
                });
                serde_json::to_string(&doc)
            }))
        })
    }
}

/// Writes NCCL's memory, as the hook sees it, as JSON like `memsaver_stats_json`; the fields
/// are those of `memsaver_nccl_hook::NcclStats`.
///
/// # Safety
/// As `memsaver_stats_json`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_nccl_stats_json(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        write_json(buf, len, needed, || {
            Ok(serde_json::to_string(&memsaver_nccl_hook::stats()))
        })
    }
}

/// Writes what `memsaver diagnostics` reports about the `nccl` tag's coordination (JSON, like
/// `memsaver_stats_json`): `runtime_dir` and `runtime_dir_state`, `group` and `group_dir_state`
/// (each `{"state": "ok" | "missing" | "problem", "detail": why}`, checked without creating
/// anything), `owners` (`[socket name, pid, alive]` of the processes serving the group) and
/// `fallback_reason` (why NCCL's exports fell back to plain fds here, or null).
///
/// # Safety
/// As `memsaver_stats_json`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_nccl_diagnose_json(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        write_json(buf, len, needed, || {
            Ok(serde_json::to_string(&memsaver_nccl_hook::diagnose()))
        })
    }
}

/// Writes what `memsaver diagnostics` reports about disk backups (JSON, like
/// `memsaver_stats_json`): `dir` (the disk backup directory in force, or null), `state`
/// (`{"state": "ok" | "missing" | "problem", "detail": why}`, checked as a pause would check
/// it, without creating or removing anything) and `files`, the backup files in it
/// (`{"name", "pid", "bytes", "running", "other_namespace", "own"}`; a file of this pid
/// namespace whose process is no longer running is stale: the next process that opens the
/// directory removes it; files of another pid namespace are never removed from this one). Does
/// not start the allocator.
///
/// # Safety
/// As `memsaver_stats_json`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_disk_diagnose_json(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        write_json(buf, len, needed, || {
            let dir = match memsaver_allocator::global_if_started() {
                Some(a) => a.disk_dir(),
                None => memsaver_allocator::options::get().disk_dir.clone(),
            };
            Ok(serde_json::to_string(&memsaver_allocator::disk_backups(
                dir.as_deref(),
            )))
        })
    }
}

/// Sets the group id of the `nccl` tag: processes coordinate NCCL's memory with peers of the
/// same group only. Call it before NCCL initialises; once NCCL has shared memory with a peer
/// the group is fixed and another value gives `MEMSAVER_ERR_INVALID_ARGUMENT`.
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_nccl_set_group(group: i64) -> c_int {
    ffi(|| memsaver_nccl_hook::amem::set_group_id(group))
}

/// Writes the group id of the `nccl` tag (`MEMSAVER_GROUP`, `AMEM_GROUPID`, a set value, or 0)
/// into `*group`.
///
/// # Safety
/// `group` is NULL (an error) or a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_nccl_group(group: *mut i64) -> c_int {
    ffi(|| {
        if group.is_null() {
            return Err(Error::InvalidArgument("group is NULL".into()));
        }
        // SAFETY: non-null out-pointer per the contract.
        unsafe { *group = memsaver_ipc::group::id() };
        Ok(())
    })
}

/// Parses and validates a staged pause/resume profile (YAML text; `file` names it in
/// messages) and writes it as JSON, like `memsaver_stats_json`; the JSON is
/// `memsaver_profile::Profile::to_json`'s. An invalid profile gives `MEMSAVER_ERR_PROFILE` with
/// `file:line:column: what was expected`.
///
/// # Safety
/// `text` is a NUL-terminated string, `file` NULL or one; `buf` and `needed` as for
/// `memsaver_stats_json`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_profile_parse(
    text: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        write_json_with(buf, len, needed, || {
            let text = req_str(text, "text")?;
            let file = opt_str(file, "file")?.unwrap_or("<profile>");
            let p = memsaver_profile::parse(text, file)?;
            Ok(serde_json::to_string(&p.to_json()))
        })
    }
}

/// Free and total bytes of `device` as the driver reports them.
///
/// # Safety
/// `free` and `total` are valid out-pointers.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_device_memory(
    device: c_int,
    free: *mut usize,
    total: *mut usize,
) -> c_int {
    ffi(|| {
        if free.is_null() || total.is_null() {
            return Err(Error::InvalidArgument(
                "free and total must not be NULL".into(),
            ));
        }
        let (f, t) = allocator()?.device_memory(device)?;
        // SAFETY: non-null out-pointers per the contract.
        unsafe {
            *free = f;
            *total = t;
        }
        Ok(())
    })
}

/// Enters a region on the calling thread: allocations made through the hooks on this thread
/// get `tag` and `policy` until the matching `memsaver_region_exit`. Regions nest.
///
/// # Safety
/// `tag` is a NUL-terminated string; `policy` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_region_enter(tag: *const c_char, policy: *const c_char) -> c_int {
    ffi(|| {
        // SAFETY: per this function's contract.
        let tag = unsafe { req_str(tag, "tag") }?;
        // SAFETY: per this function's contract.
        let policy = unsafe { opt_policy(policy) }?;
        region::enter(tag, policy)
    })
}

/// Opens a scope on the calling thread in which hooked allocations are not tagged (they go to
/// the real allocator and are never paused), even inside a region. Close it with
/// `memsaver_region_exit`.
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_region_disable() -> c_int {
    ffi(|| {
        region::disable();
        Ok(())
    })
}

/// Leaves the innermost region (or disabled scope) of the calling thread.
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_region_exit() -> c_int {
    ffi(region::exit)
}

/// Sets backup retention (non-zero: on; default on, `MEMSAVER_RETAIN_BACKUP`). On, a backup
/// (host memory or disk file) is kept after its allocation resumed, for the next pause; off, it
/// is released when its allocation has resumed, and the next resume also releases the retained
/// backups of resident allocations of the tags it names. Backups are always released with their
/// allocation.
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_set_retain_backups(on: c_int) -> c_int {
    ffi(|| {
        allocator()?.set_retain_backups(on != 0);
        Ok(())
    })
}

/// Writes 1 to `*out` if backups are retained, else 0. An invalid `MEMSAVER_RETAIN_BACKUP`
/// (or `TMS_RETAIN_CPU_BACKUP`) not overridden by `memsaver_set_retain_backups` is an error.
///
/// # Safety
/// `out` is NULL (an error) or a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_retain_backups(out: *mut c_int) -> c_int {
    ffi(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        let on = allocator()?.retain_backups();
        // SAFETY: non-null out-pointer per the contract.
        unsafe { *out = c_int::from(on) };
        Ok(())
    })
}

/// For the device range `[ptr, ptr + size)` inside one memsaver allocation (`ptr` may point
/// inside it) whose host backup (`cpu` or `mmap`) exists, writes the host address of byte `ptr`
/// in that backup to `*out`; it holds the contents as of the allocation's last pause and stays
/// valid until the backup is released (a resume with retention off, or free). Otherwise
/// writes NULL: that is not an error.
///
/// # Safety
/// `out` is NULL (an error) or a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_backup_pointer(
    ptr: u64,
    size: usize,
    out: *mut *mut c_void,
) -> c_int {
    ffi(|| {
        if out.is_null() {
            return Err(Error::InvalidArgument("out is NULL".into()));
        }
        let p = allocator()?
            .backup_pointer(ptr, size)
            .map_or(std::ptr::null_mut(), |p| p.cast::<c_void>());
        // SAFETY: non-null out-pointer per the contract.
        unsafe { *out = p };
        Ok(())
    })
}

/// Sets the directory of "disk" backup files (`MEMSAVER_DISK_DIR` at start), creating it with
/// mode 0700 if missing; an existing one must be a directory of this user's that group and
/// others cannot write, else `MEMSAVER_ERR_INVALID_ARGUMENT` naming its owner and mode. It is
/// opened and held now, and stale backup files of processes no longer running are removed
/// from it. NULL or "" unsets it. Pausing a disk-backed allocation without one fails with
/// `MEMSAVER_ERR_INVALID_ARGUMENT` and changes nothing. Files are named
/// `memsaver-<pidns>-<pid>-<start time>-<nonce>-<n>.bin` (`<pidns>`: the inode of this
/// process's pid namespace), mode 0600 (docs/security.md, "Backup files").
///
/// # Safety
/// `dir` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_set_disk_dir(dir: *const c_char) -> c_int {
    ffi(|| {
        // SAFETY: per this function's contract.
        let dir = unsafe { opt_str(dir, "dir") }?.filter(|d| !d.is_empty());
        allocator()?.set_disk_dir(dir.map(std::path::Path::new))
    })
}

/// Resume refuses to map an allocation that would leave less than `bytes` free on its device
/// (`MEMSAVER_ERR_RESUME_OUT_OF_MEMORY`; what was resumed stays resumed). 0 (the default) turns
/// the check off. `MEMSAVER_MEMORY_MARGIN_MB` sets it at start.
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_set_memory_margin(bytes: usize) -> c_int {
    ffi(|| {
        allocator()?.set_memory_margin(bytes as u64);
        Ok(())
    })
}

/// At most `bytes` of pinned host memory are allocated ahead of the first pauses of `cpu`
/// allocations (on a background thread, when each allocation is made, with retention on); 0
/// turns that off for allocations made from now on. `MEMSAVER_BACKUP_PREPARE_MB` sets it at
/// start (default: no limit).
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_set_backup_prepare_limit(bytes: u64) -> c_int {
    ffi(|| {
        allocator()?.set_backup_prepare_limit(bytes);
        Ok(())
    })
}

/// Keeps `bytes` of pinned host memory (rounded up to 2 MiB) that the pinned backups of `cpu`
/// allocations are carved from at once: a background thread maps and pins it in 16 MiB steps,
/// starting now in the calling thread's current device's context (else once memsaver opens a
/// device), so that a first pause right after allocating copies into pinned memory only.
/// Backups released go back to it; backups beyond it are prepared as
/// `memsaver_set_backup_prepare_limit` says, which does not count the reserve. Less than
/// before releases the free part beyond `bytes` (memory lent to backups stays until a later
/// call finds it free); 0 releases all that is free. Returns at once. More than the host's
/// memory is `MEMSAVER_ERR_INVALID_ARGUMENT`; a reserve the host cannot pin whole keeps what it
/// got (a warning in the log; `memsaver_stats_json`: `backup_reserve_bytes`,
/// `backup_reserve_pinned_bytes`, `backup_reserve_used_bytes`). `MEMSAVER_BACKUP_RESERVE_MB`
/// sets it at start (default 0: none).
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_reserve_backups(bytes: u64) -> c_int {
    ffi(|| allocator()?.reserve_backups(bytes))
}

/// Writes what applies to an allocation on the calling thread now, as JSON like
/// `memsaver_stats_json`: {"tag","policy","disabled","process","depth","process_tag"} (tag and
/// policy are null when allocations are not tagged; process: the whole-process tag of
/// `MEMSAVER_PROCESS_TAG` / `TMS_INIT_ENABLE` applies, no region is open; process_tag: that tag
/// if one is configured, whether or not it applies now).
///
/// # Safety
/// As `memsaver_stats_json`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_region_current_json(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        write_json(buf, len, needed, || {
            Ok(serde_json::to_string(&region::describe()?))
        })
    }
}

/// Reads the profile file at `path` (at most 1 MiB; UTF-8), validates it and writes it as
/// JSON into `buf`, like [`memsaver_profile_parse`]. Every invalid file, a too large or not
/// UTF-8 one included, gives `MEMSAVER_ERR_PROFILE` with `path:line:column: what was
/// expected`; a file that cannot be read gives `path: cannot read the profile: why`.
///
/// # Safety
/// `path` is NUL-terminated; `buf`/`needed` as for [`memsaver_stats_json`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_profile_load(
    path: *const c_char,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        write_json_with(buf, len, needed, || {
            let path = req_str(path, "path")?;
            let p = memsaver_profile::load(std::path::Path::new(path))?;
            Ok(serde_json::to_string(&p.to_json()))
        })
    }
}

/// Runs one of the allocator core's commands of the `memsaver` command line (`demo`,
/// `bench`, `options`; `argv[0]` is the command) and returns its exit status: 0 done, 1
/// failed, 2 a usage error. It prints to stdout and stderr: only the `memsaver` command
/// calls it.
///
/// # Safety
/// `argv` holds `argc` NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_cli_main(argc: c_int, argv: *const *const c_char) -> c_int {
    exit_code(|| {
        // SAFETY: per this function's contract.
        let args = unsafe { c_args(argc, argv) }?;
        Ok(cli::main(&args, &mut std::io::stdout().lock()))
    })
}

/// Writes the core's commands of the `memsaver` command line and their flags, the ones
/// `memsaver_cli_main` runs, as JSON into `buf`, with the protocol of [`memsaver_stats_json`]:
/// {"commands": [{"name", "help", "flags": [{"name", "value", "default", "help"}]}]}, where
/// `value` (the metavar) and `default` are null for a flag that takes no value. The Python
/// command builds its parsers for these commands from it.
///
/// # Safety
/// As [`memsaver_stats_json`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_cli_spec_json(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { write_json(buf, len, needed, || Ok(cli::spec_json())) }
}

/// Writes the path of the runtime directory (where processes coordinating the `nccl` tag put
/// their sockets: `MEMSAVER_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/memsaver`, else
/// `/tmp/memsaver-<uid>`) into `buf`, with the protocol of [`memsaver_stats_json`]. It
/// creates nothing.
///
/// # Safety
/// As [`memsaver_stats_json`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_runtime_dir(
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        write_json(buf, len, needed, || {
            Ok(Ok(memsaver_ipc::rundir::runtime_dir()
                .to_string_lossy()
                .into_owned()))
        })
    }
}

/// A function that runs a profile stage for a control request, on memsaver's control thread:
/// it receives the request as JSON (`{"source", "stage", "profile", "from"}`: the profile's
/// name, the stage, the profile's text and the requesting pid) and returns a `malloc`ed,
/// NUL-terminated JSON text, `{"ok": true, "report": ...}` or `{"ok": false, "status": code,
/// "error": message}`, which memsaver frees. The Python package installs one.
pub type MemsaverStageRunner = Option<unsafe extern "C" fn(*const c_char) -> *mut c_char>;

/// A pause guard: a function of the layer that caches freed device memory above memsaver (the
/// Python package installs one for PyTorch's caching allocator), which memsaver calls under its
/// transition lock, on the thread of the pause or resume (memsaver's control thread for
/// requests from other processes):
/// - `event` `MEMSAVER_GUARD_BEFORE_PAUSE`, before a pause changes anything, with `tags` the
///   tags of allocations it will pause, separated by commas: the guard makes sure nothing
///   hands out their memory until they resume, and returns NULL, or refuses the pause by
///   returning a message (the pause then fails with `MEMSAVER_ERR_PAUSE_REFUSED` and that
///   message, nothing paused);
/// - `event` `MEMSAVER_GUARD_AFTER_TRANSITION`, `tags` NULL, once a pause or resume has
///   ended (whatever its outcome, a refused pause included): tags that are no longer paused may
///   hand out memory again. What it returns is logged.
///
/// A message is a `malloc`ed NUL-terminated text, which memsaver frees.
pub type MemsaverPauseGuard = Option<unsafe extern "C" fn(c_int, *const c_char) -> *mut c_char>;

/// `event` of a pause guard's call before a pause (see `MemsaverPauseGuard`).
pub const MEMSAVER_GUARD_BEFORE_PAUSE: c_int = 0;
/// `event` of a pause guard's call once a pause or resume has ended.
pub const MEMSAVER_GUARD_AFTER_TRANSITION: c_int = 1;

/// Installs the pause guard (NULL removes it); it replaces the one installed before and
/// applies from the next pause or resume. Never starts the allocator.
///
/// # Safety
/// `guard` is NULL or a function with the contract of `MemsaverPauseGuard`, callable from any
/// thread for as long as it is installed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_set_pause_guard(guard: MemsaverPauseGuard) -> c_int {
    ffi_with(|| {
        guard::set(guard);
        Ok(())
    })
}

/// Opts this process in to control requests from other processes of its user and group
/// (as `MEMSAVER_CONTROL=1` does when the allocator starts), starting its memsaver socket
/// now if needed. Fails with `MEMSAVER_ERR_CONTROL` when the socket cannot be served (the
/// runtime directory is not usable: the message says why).
#[unsafe(no_mangle)]
pub extern "C" fn memsaver_control_serve() -> c_int {
    ffi_with(|| {
        memsaver_ipc::control::serve().map_err(|e| Failure::new(Status::Control, e.to_string()))
    })
}

/// Installs the function that runs profile stages for control requests (NULL removes it;
/// without one, such requests fail saying that the Python package is not loaded).
///
/// # Safety
/// `runner` is NULL or a function with the contract of `MemsaverStageRunner`, callable from
/// any thread for as long as it is installed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_control_set_runner(runner: MemsaverStageRunner) -> c_int {
    ffi_with(|| {
        control::set_runner(runner);
        Ok(())
    })
}

/// Sends a control request to other processes and gives their answers as JSON in `*answer`:
/// a NUL-terminated text allocated with `malloc`, which the caller releases with `free` (not
/// the protocol of `memsaver_stats_json`: a request is sent once, never again to learn the
/// size of its answer). The request is JSON: {"op": "pause" | "resume" | "stats" | "run",
/// "pid": P or null, "group": G or null (this process's group), "tags": [...] (pause,
/// resume; none: every tag), "source", "stage", "profile" (run: the profile's name, stage and
/// text), "timeout_s" (per process; default 600)}. With a pid it goes to that process of the
/// group, else to every live process of the group but this one, all at once. The answer:
/// {"op", "targets": [{"pid", "group", "ok", "status", "error", "result"}]}, one per
/// process: `status` is the code of its failure (its operation's own, or
/// `MEMSAVER_ERR_CONTROL` when it was not reached, refused or did not answer), `result` the
/// stats or the stage's report. `MEMSAVER_ERR_CONTROL` for the call itself (and `*answer`
/// NULL) when there is no such process or group: the message says where it looked and what
/// to check.
///
/// # Safety
/// `request` is a NUL-terminated string; `answer` is a valid out-pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memsaver_control_json(
    request: *const c_char,
    answer: *mut *mut c_char,
) -> c_int {
    ffi_with(|| {
        if answer.is_null() {
            return Err(Error::InvalidArgument("answer is NULL".into()).into());
        }
        // SAFETY: a valid out-pointer per the contract.
        unsafe { *answer = std::ptr::null_mut() };
        // SAFETY: per this function's contract.
        let request = unsafe { req_str(request, "request") }?;
        let text = control::client(request)
            .map_err(|control::ClientError(message)| Failure::new(Status::Control, message))?;
        let out = malloc_c_string(&text)?;
        // SAFETY: a valid out-pointer per the contract.
        unsafe { *answer = out };
        Ok(())
    })
}
