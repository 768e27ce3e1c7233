/*
 * memsaver: the C ABI of libmemsaver.so, for LD_PRELOAD and for dlopen by the Python package,
 * over the process-wide allocator.
 *
 * Every function returns a `memsaver_status` code as an int (`MEMSAVER_OK`, 0, on success).
 * On failure the calling thread's last error message, read with `memsaver_last_error()`, says
 * what went wrong and what to do. No function aborts, exits the process or unwinds into C: a
 * panic is caught and reported as `MEMSAVER_ERR_INTERNAL`.
 *
 * Tags: 1 to 64 characters from letters, digits, '_', '-' and '.' ("nccl" is memsaver's own).
 * Tag lists are comma-separated ("weights,kv_cache"; whitespace around a tag is ignored).
 * Only NULL means every tag: "", " ", "," or "a,,b" give `MEMSAVER_ERR_INVALID_ARGUMENT`.
 *
 * Policies: "discard" (contents dropped on pause), "cpu" (kept in pinned host memory), "mmap"
 * (kept in pageable anonymous host memory, unmapped when released so the RSS drops) or "disk"
 * (kept in a file of the disk backup directory, copied through a bounded staging buffer).
 *
 * JSON out-parameters (`*_json`, `memsaver_profile_parse`): the text, NUL-terminated, is
 * written into `buf` of `len` bytes and the size needed, NUL included, into `*needed` (may be
 * NULL); a NULL or short buffer gives `MEMSAVER_ERR_BUFFER_TOO_SMALL`: call again with a buffer
 * of `*needed` bytes.
 *
 * Hooks: under LD_PRELOAD this library also defines cudaMalloc and cudaFree (not declared
 * here): inside a region the memory comes from memsaver, outside the call goes to libcudart
 * untouched, unless `MEMSAVER_PROCESS_TAG` (or `TMS_INIT_ENABLE=1`: tag "default") is set:
 * then allocations outside any region get that tag and `MEMSAVER_PROCESS_BACKUP`'s policy
 * (whole-process mode; the process tag accepts new, resident allocations while paused, and
 * resume skips them). Without preload, torch's CUDAPluggableAllocator calls
 * `memsaver_torch_malloc` and `memsaver_torch_free`, inside regions only. Under LD_PRELOAD it
 * also defines cudaIpcGetMemHandle, cudaIpcOpenMemHandle and cudaIpcCloseMemHandle: memory
 * memsaver allocated is shared with other memsaver processes of the same user, group and pid
 * namespace through handles of memsaver's own, and an opened handle follows its owner's
 * pauses and resumes (docs/architecture.md, "Memory shared with other processes"); other
 * memory goes to libcudart untouched.
 *
 * Control (`memsaver_control_*`): a process that opted in (`MEMSAVER_CONTROL=1`, or
 * `memsaver_control_serve`) serves pause, resume, stats and profile-stage requests from
 * other processes of its user and group over its memsaver socket (docs/security.md).
 *
 * This text, the doc comment of each exported function and the status codes (`Status`) are
 * the only definition of the C ABI: `include/memsaver.h` and the Python binding's table
 * (`python/src/abi.rs`) are generated from them by `tests/abi_files.rs` (`make abi`), which
 * fails when a checked-in copy differs: edit the Rust source, not those files.
 */

#ifndef MEMSAVER_H
#define MEMSAVER_H

#include <stddef.h>
#include <stdint.h>

/* Status codes (`Status` in status.rs). Stable: new codes are added, never renumbered. */
typedef enum memsaver_status {
    /* Success. */
    MEMSAVER_OK = 0,
    /* A bad argument: tag name, tag list, policy, size, NULL pointer, option value. */
    MEMSAVER_ERR_INVALID_ARGUMENT = 1,
    /* A tag that was never used or registered. */
    MEMSAVER_ERR_UNKNOWN_TAG = 2,
    /* An allocation with a tag that is paused. */
    MEMSAVER_ERR_TAG_PAUSED = 3,
    /* A pointer memsaver did not allocate. */
    MEMSAVER_ERR_UNKNOWN_POINTER = 4,
    /* The device ran out of memory. */
    MEMSAVER_ERR_OUT_OF_MEMORY = 5,
    /* Resume ran out of device memory: partly resumed; free memory and resume again. */
    MEMSAVER_ERR_RESUME_OUT_OF_MEMORY = 6,
    /* A CUDA driver call failed. */
    MEMSAVER_ERR_DRIVER = 7,
    /* The CUDA driver could not be loaded. */
    MEMSAVER_ERR_DRIVER_NOT_LOADED = 8,
    /* A pause or resume left some allocations in their previous state. */
    MEMSAVER_ERR_INCOMPLETE = 9,
    /* The caller's buffer is too small; call again with the size written to `*needed`. */
    MEMSAVER_ERR_BUFFER_TOO_SMALL = 10,
    /* A peer process did not take part in a pause or resume (nccl tag). */
    MEMSAVER_ERR_PEER = 11,
    /* An invalid profile: file:line:column: what was expected. */
    MEMSAVER_ERR_PROFILE = 12,
    /* Host memory or a file for a backup failed. */
    MEMSAVER_ERR_BACKUP = 13,
    /*
     * A control request to another process could not be delivered, was refused or got no
     * answer (not its operation's own error, which keeps its status).
     */
    MEMSAVER_ERR_CONTROL = 14,
    /*
     * A pause refused before anything changed: memory of a tag it names could be handed out
     * again while paused (a region of the tag is open); the message says what to do.
     */
    MEMSAVER_ERR_PAUSE_REFUSED = 15,
    /* A bug in memsaver (a caught panic): please report it with MEMSAVER_LOG=debug output. */
    MEMSAVER_ERR_INTERNAL = 99,
} memsaver_status;

/**
 * `event` of a pause guard's call before a pause (see `MemsaverPauseGuard`).
 */
#define MEMSAVER_GUARD_BEFORE_PAUSE 0

/**
 * `event` of a pause guard's call once a pause or resume has ended.
 */
#define MEMSAVER_GUARD_AFTER_TRANSITION 1

/**
 * A pause guard: a function of the layer that caches freed device memory above memsaver (the
 * Python package installs one for PyTorch's caching allocator), which memsaver calls under its
 * transition lock, on the thread of the pause or resume (memsaver's control thread for
 * requests from other processes):
 * - `event` `MEMSAVER_GUARD_BEFORE_PAUSE`, before a pause changes anything, with `tags` the
 *   tags of allocations it will pause, separated by commas: the guard makes sure nothing
 *   hands out their memory until they resume, and returns NULL, or refuses the pause by
 *   returning a message (the pause then fails with `MEMSAVER_ERR_PAUSE_REFUSED` and that
 *   message, nothing paused);
 * - `event` `MEMSAVER_GUARD_AFTER_TRANSITION`, `tags` NULL, once a pause or resume has
 *   ended (whatever its outcome, a refused pause included): tags that are no longer paused may
 *   hand out memory again. What it returns is logged.
 *
 * A message is a `malloc`ed NUL-terminated text, which memsaver frees.
 */
typedef char *(*MemsaverPauseGuard)(int, const char*);

/**
 * A function that runs a profile stage for a control request, on memsaver's control thread:
 * it receives the request as JSON (`{"source", "stage", "profile", "from"}`: the profile's
 * name, the stage, the profile's text and the requesting pid) and returns a `malloc`ed,
 * NUL-terminated JSON text, `{"ok": true, "report": ...}` or `{"ok": false, "status": code,
 * "error": message}`, which memsaver frees. The Python package installs one.
 */
typedef char *(*MemsaverStageRunner)(const char*);

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

/**
 * The message of the last failed call on this thread (empty if none). The pointer stays
 * valid until the next memsaver call on this thread.
 */
const char *memsaver_last_error(void);

/**
 * Allocates `size` bytes on `device` with an explicit tag and policy (`"discard"`, `"cpu"`,
 * `"mmap"` or `"disk"`; NULL means discard) and writes the device address to `*ptr`.
 *
 * # Safety
 * `ptr` is a valid out-pointer; `tag` and `policy` are NULL or NUL-terminated strings.
 */
int memsaver_malloc(void **ptr, size_t size, int device, const char *tag, const char *policy);

/**
 * Frees memory returned by `memsaver_malloc`, in any state (paused included).
 */
int memsaver_free(void *ptr);

/**
 * Pauses the given tags (comma-separated; NULL for all; an empty or blank item is an error).
 *
 * # Safety
 * `tags` is NULL or a NUL-terminated string.
 */
int memsaver_pause(const char *tags);

/**
 * Resumes the given tags (comma-separated; NULL for all; an empty or blank item is an error).
 *
 * # Safety
 * `tags` is NULL or a NUL-terminated string.
 */
int memsaver_resume(const char *tags);

/**
 * Pauses the given tags (as `memsaver_pause`) with the backup policy chosen now: every
 * allocation this call pauses is paused as if `backup` (`"discard"`, `"cpu"`, `"mmap"` or
 * `"disk"`) were its policy; NULL keeps each allocation's own (`memsaver_pause`). With
 * `"discard"` the contents are dropped, with the backup an earlier cycle left; with a keeping
 * policy the next resume restores what this pause copied. Allocations already paused keep
 * what their pause did. An unknown policy is `MEMSAVER_ERR_INVALID_ARGUMENT`, and so is naming
 * `nccl` with a policy (its backups follow `MEMSAVER_NCCL_BACKUP`; with NULL tags it pauses as
 * always).
 *
 * # Safety
 * `tags` and `backup` are NULL or NUL-terminated strings.
 */
int memsaver_pause_with_backup(const char *tags, const char *backup);

/**
 * Drops the contents and the backups of the given tags (comma-separated; NULL for every tag
 * of allocations): resident allocations are paused without a copy and paused ones lose their
 * backup, so the next resume maps memory holding arbitrary bytes. The tags are paused
 * afterwards. `nccl` cannot be discarded (`MEMSAVER_ERR_INVALID_ARGUMENT`; NULL leaves it
 * alone).
 *
 * # Safety
 * `tags` is NULL or a NUL-terminated string.
 */
int memsaver_discard(const char *tags);

/**
 * Resumes the given tags (as `memsaver_resume`), then keeps (`keep` > 0) or releases
 * (`keep` == 0) the backups of what it resumed, whatever `memsaver_set_retain_backups` says;
 * `keep` < 0 follows that setting. Releasing also drops the backups retained by resident
 * allocations of the tags.
 *
 * # Safety
 * `tags` is NULL or a NUL-terminated string.
 */
int memsaver_resume_keep_backups(const char *tags, int keep);

/**
 * Writes the allocations of the given tags (comma-separated; NULL for every tag) as JSON, like
 * `memsaver_stats_json`: [{"ptr","size","device","tag","policy","state","backup",
 * "backup_bytes"}] by address; `policy` is the one it was allocated with, `state` one of
 * "resident", "pausing", "paused", "resuming", `backup` "pinned", "mmap", "disk" or null. An
 * unknown tag is `MEMSAVER_ERR_UNKNOWN_TAG`; `nccl` has no allocations to list
 * (`MEMSAVER_ERR_INVALID_ARGUMENT`: see `memsaver_nccl_stats_json`).
 *
 * # Safety
 * `tags` is NULL or a NUL-terminated string; `buf` and `needed` as for `memsaver_stats_json`.
 */
int memsaver_allocations_json(const char *tags, char *buf, size_t len, size_t *needed);

/**
 * Registers a tag without allocating, so that it can be paused and listed.
 *
 * # Safety
 * `tag` is a NUL-terminated string.
 */
int memsaver_register_tag(const char *tag);

/**
 * Writes the stats as JSON (see "JSON out-parameters" above): {"tags":[{"tag","paused",
 * "allocations","reserved_bytes","resident_bytes","backup_bytes","pinned_backup_bytes",
 * "mmap_backup_bytes","disk_backup_bytes","devices":[...]}],"total":{...}}. backup_bytes is
 * host memory (pinned + mmap); disk files are counted apart. "shared": memory shared with
 * other processes (CUDA IPC handles, NCCL's registration of tagged buffers):
 * {"exports":{TAG:{"handles","bytes","importers"}},"imports":[{"owner_pid","bytes","paused",
 * "opens","via"}]}, "via" being "cuda_ipc" or "nccl".
 *
 * # Safety
 * `buf` is valid for `len` bytes of writes (or NULL with `len == 0`); `needed` is NULL or a
 * valid out-pointer.
 */
int memsaver_stats_json(char *buf, size_t len, size_t *needed);

/**
 * Writes NCCL's memory, as the hook sees it, as JSON like `memsaver_stats_json`; the fields
 * are those of `memsaver_nccl_hook::NcclStats`.
 *
 * # Safety
 * As `memsaver_stats_json`.
 */
int memsaver_nccl_stats_json(char *buf, size_t len, size_t *needed);

/**
 * Writes what `memsaver diagnostics` reports about the `nccl` tag's coordination (JSON, like
 * `memsaver_stats_json`): `runtime_dir` and `runtime_dir_state`, `group` and `group_dir_state`
 * (each `{"state": "ok" | "missing" | "problem", "detail": why}`, checked without creating
 * anything), `owners` (`[socket name, pid, alive]` of the processes serving the group) and
 * `fallback_reason` (why NCCL's exports fell back to plain fds here, or null).
 *
 * # Safety
 * As `memsaver_stats_json`.
 */
int memsaver_nccl_diagnose_json(char *buf, size_t len, size_t *needed);

/**
 * Writes what `memsaver diagnostics` reports about disk backups (JSON, like
 * `memsaver_stats_json`): `dir` (the disk backup directory in force, or null), `state`
 * (`{"state": "ok" | "missing" | "problem", "detail": why}`, checked as a pause would check
 * it, without creating or removing anything) and `files`, the backup files in it
 * (`{"name", "pid", "bytes", "running", "other_namespace", "own"}`; a file of this pid
 * namespace whose process is no longer running is stale: the next process that opens the
 * directory removes it; files of another pid namespace are never removed from this one). Does
 * not start the allocator.
 *
 * # Safety
 * As `memsaver_stats_json`.
 */
int memsaver_disk_diagnose_json(char *buf, size_t len, size_t *needed);

/**
 * Sets the group id of the `nccl` tag: processes coordinate NCCL's memory with peers of the
 * same group only. Call it before NCCL initialises; once NCCL has shared memory with a peer
 * the group is fixed and another value gives `MEMSAVER_ERR_INVALID_ARGUMENT`.
 */
int memsaver_nccl_set_group(int64_t group);

/**
 * Writes the group id of the `nccl` tag (`MEMSAVER_GROUP`, `AMEM_GROUPID`, a set value, or 0)
 * into `*group`.
 *
 * # Safety
 * `group` is NULL (an error) or a valid out-pointer.
 */
int memsaver_nccl_group(int64_t *group);

/**
 * Parses and validates a staged pause/resume profile (YAML text; `file` names it in
 * messages) and writes it as JSON, like `memsaver_stats_json`; the JSON is
 * `memsaver_profile::Profile::to_json`'s. An invalid profile gives `MEMSAVER_ERR_PROFILE` with
 * `file:line:column: what was expected`.
 *
 * # Safety
 * `text` is a NUL-terminated string, `file` NULL or one; `buf` and `needed` as for
 * `memsaver_stats_json`.
 */
int memsaver_profile_parse(const char *text, const char *file, char *buf, size_t len, size_t *needed);

/**
 * Free and total bytes of `device` as the driver reports them.
 *
 * # Safety
 * `free` and `total` are valid out-pointers.
 */
int memsaver_device_memory(int device, size_t *free, size_t *total);

/**
 * Enters a region on the calling thread: allocations made through the hooks on this thread
 * get `tag` and `policy` until the matching `memsaver_region_exit`. Regions nest.
 *
 * # Safety
 * `tag` is a NUL-terminated string; `policy` is NULL or a NUL-terminated string.
 */
int memsaver_region_enter(const char *tag, const char *policy);

/**
 * Opens a scope on the calling thread in which hooked allocations are not tagged (they go to
 * the real allocator and are never paused), even inside a region. Close it with
 * `memsaver_region_exit`.
 */
int memsaver_region_disable(void);

/**
 * Leaves the innermost region (or disabled scope) of the calling thread.
 */
int memsaver_region_exit(void);

/**
 * Sets backup retention (non-zero: on; default on, `MEMSAVER_RETAIN_BACKUP`). On, a backup
 * (host memory or disk file) is kept after its allocation resumed, for the next pause; off, it
 * is released when its allocation has resumed, and the next resume also releases the retained
 * backups of resident allocations of the tags it names. Backups are always released with their
 * allocation.
 */
int memsaver_set_retain_backups(int on);

/**
 * Writes 1 to `*out` if backups are retained, else 0. An invalid `MEMSAVER_RETAIN_BACKUP`
 * (or `TMS_RETAIN_CPU_BACKUP`) not overridden by `memsaver_set_retain_backups` is an error.
 *
 * # Safety
 * `out` is NULL (an error) or a valid out-pointer.
 */
int memsaver_retain_backups(int *out);

/**
 * For the device range `[ptr, ptr + size)` inside one memsaver allocation (`ptr` may point
 * inside it) whose host backup (`cpu` or `mmap`) exists, writes the host address of byte `ptr`
 * in that backup to `*out`; it holds the contents as of the allocation's last pause and stays
 * valid until the backup is released (a resume with retention off, or free). Otherwise
 * writes NULL: that is not an error.
 *
 * # Safety
 * `out` is NULL (an error) or a valid out-pointer.
 */
int memsaver_backup_pointer(uint64_t ptr, size_t size, void **out);

/**
 * Sets the directory of "disk" backup files (`MEMSAVER_DISK_DIR` at start), creating it with
 * mode 0700 if missing; an existing one must be a directory of this user's that group and
 * others cannot write, else `MEMSAVER_ERR_INVALID_ARGUMENT` naming its owner and mode. It is
 * opened and held now, and stale backup files of processes no longer running are removed
 * from it. NULL or "" unsets it. Pausing a disk-backed allocation without one fails with
 * `MEMSAVER_ERR_INVALID_ARGUMENT` and changes nothing. Files are named
 * `memsaver-<pidns>-<pid>-<start time>-<nonce>-<n>.bin` (`<pidns>`: the inode of this
 * process's pid namespace), mode 0600 (docs/security.md, "Backup files").
 *
 * # Safety
 * `dir` is NULL or a NUL-terminated string.
 */
int memsaver_set_disk_dir(const char *dir);

/**
 * Resume refuses to map an allocation that would leave less than `bytes` free on its device
 * (`MEMSAVER_ERR_RESUME_OUT_OF_MEMORY`; what was resumed stays resumed). 0 (the default) turns
 * the check off. `MEMSAVER_MEMORY_MARGIN_MB` sets it at start.
 */
int memsaver_set_memory_margin(size_t bytes);

/**
 * At most `bytes` of pinned host memory are allocated ahead of the first pauses of `cpu`
 * allocations (on a background thread, when each allocation is made, with retention on); 0
 * turns that off for allocations made from now on. `MEMSAVER_BACKUP_PREPARE_MB` sets it at
 * start (default: no limit).
 */
int memsaver_set_backup_prepare_limit(uint64_t bytes);

/**
 * Keeps `bytes` of pinned host memory (rounded up to 2 MiB) that the pinned backups of `cpu`
 * allocations are carved from at once: a background thread maps and pins it in 16 MiB steps,
 * starting now in the calling thread's current device's context (else once memsaver opens a
 * device), so that a first pause right after allocating copies into pinned memory only.
 * Backups released go back to it; backups beyond it are prepared as
 * `memsaver_set_backup_prepare_limit` says, which does not count the reserve. Less than
 * before releases the free part beyond `bytes` (memory lent to backups stays until a later
 * call finds it free); 0 releases all that is free. Returns at once. More than the host's
 * memory is `MEMSAVER_ERR_INVALID_ARGUMENT`; a reserve the host cannot pin whole keeps what it
 * got (a warning in the log; `memsaver_stats_json`: `backup_reserve_bytes`,
 * `backup_reserve_pinned_bytes`, `backup_reserve_used_bytes`). `MEMSAVER_BACKUP_RESERVE_MB`
 * sets it at start (default 0: none).
 */
int memsaver_reserve_backups(uint64_t bytes);

/**
 * Writes what applies to an allocation on the calling thread now, as JSON like
 * `memsaver_stats_json`: {"tag","policy","disabled","process","depth","process_tag"} (tag and
 * policy are null when allocations are not tagged; process: the whole-process tag of
 * `MEMSAVER_PROCESS_TAG` / `TMS_INIT_ENABLE` applies, no region is open; process_tag: that tag
 * if one is configured, whether or not it applies now).
 *
 * # Safety
 * As `memsaver_stats_json`.
 */
int memsaver_region_current_json(char *buf, size_t len, size_t *needed);

/**
 * Reads the profile file at `path` (at most 1 MiB; UTF-8), validates it and writes it as
 * JSON into `buf`, like [`memsaver_profile_parse`]. Every invalid file, a too large or not
 * UTF-8 one included, gives `MEMSAVER_ERR_PROFILE` with `path:line:column: what was
 * expected`; a file that cannot be read gives `path: cannot read the profile: why`.
 *
 * # Safety
 * `path` is NUL-terminated; `buf`/`needed` as for [`memsaver_stats_json`].
 */
int memsaver_profile_load(const char *path, char *buf, size_t len, size_t *needed);

/**
 * Runs one of the allocator core's commands of the `memsaver` command line (`demo`,
 * `bench`, `options`; `argv[0]` is the command) and returns its exit status: 0 done, 1
 * failed, 2 a usage error. It prints to stdout and stderr: only the `memsaver` command
 * calls it.
 *
 * # Safety
 * `argv` holds `argc` NUL-terminated strings.
 */
int memsaver_cli_main(int argc, const char *const *argv);

/**
 * Writes the core's commands of the `memsaver` command line and their flags, the ones
 * `memsaver_cli_main` runs, as JSON into `buf`, with the protocol of [`memsaver_stats_json`]:
 * {"commands": [{"name", "help", "flags": [{"name", "value", "default", "help"}]}]}, where
 * `value` (the metavar) and `default` are null for a flag that takes no value. The Python
 * command builds its parsers for these commands from it.
 *
 * # Safety
 * As [`memsaver_stats_json`].
 */
int memsaver_cli_spec_json(char *buf, size_t len, size_t *needed);

/**
 * Writes the path of the runtime directory (where processes coordinating the `nccl` tag put
 * their sockets: `MEMSAVER_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/memsaver`, else
 * `/tmp/memsaver-<uid>`) into `buf`, with the protocol of [`memsaver_stats_json`]. It
 * creates nothing.
 *
 * # Safety
 * As [`memsaver_stats_json`].
 */
int memsaver_runtime_dir(char *buf, size_t len, size_t *needed);

/**
 * Installs the pause guard (NULL removes it); it replaces the one installed before and
 * applies from the next pause or resume. Never starts the allocator.
 *
 * # Safety
 * `guard` is NULL or a function with the contract of `MemsaverPauseGuard`, callable from any
 * thread for as long as it is installed.
 */
int memsaver_set_pause_guard(MemsaverPauseGuard guard);

/**
 * Opts this process in to control requests from other processes of its user and group
 * (as `MEMSAVER_CONTROL=1` does when the allocator starts), starting its memsaver socket
 * now if needed. Fails with `MEMSAVER_ERR_CONTROL` when the socket cannot be served (the
 * runtime directory is not usable: the message says why).
 */
int memsaver_control_serve(void);

/**
 * Installs the function that runs profile stages for control requests (NULL removes it;
 * without one, such requests fail saying that the Python package is not loaded).
 *
 * # Safety
 * `runner` is NULL or a function with the contract of `MemsaverStageRunner`, callable from
 * any thread for as long as it is installed.
 */
int memsaver_control_set_runner(MemsaverStageRunner runner);

/**
 * Sends a control request to other processes and gives their answers as JSON in `*answer`:
 * a NUL-terminated text allocated with `malloc`, which the caller releases with `free` (not
 * the protocol of `memsaver_stats_json`: a request is sent once, never again to learn the
 * size of its answer). The request is JSON: {"op": "pause" | "resume" | "stats" | "run",
 * "pid": P or null, "group": G or null (this process's group), "tags": [...] (pause,
 * resume; none: every tag), "source", "stage", "profile" (run: the profile's name, stage and
 * text), "timeout_s" (per process; default 600)}. With a pid it goes to that process of the
 * group, else to every live process of the group but this one, all at once. The answer:
 * {"op", "targets": [{"pid", "group", "ok", "status", "error", "result"}]}, one per
 * process: `status` is the code of its failure (its operation's own, or
 * `MEMSAVER_ERR_CONTROL` when it was not reached, refused or did not answer), `result` the
 * stats or the stage's report. `MEMSAVER_ERR_CONTROL` for the call itself (and `*answer`
 * NULL) when there is no such process or group: the message says where it looked and what
 * to check.
 *
 * # Safety
 * `request` is a NUL-terminated string; `answer` is a valid out-pointer.
 */
int memsaver_control_json(const char *request, char **answer);

/**
 * Allocation entry point for `CUDAPluggableAllocator`. Returns NULL (torch reports out of
 * memory) with the reason in `memsaver_last_error` when outside a region or on failure.
 */
void *memsaver_torch_malloc(ptrdiff_t size, int device, void *stream);

/**
 * Free entry point for `CUDAPluggableAllocator`.
 */
void memsaver_torch_free(void *ptr, ptrdiff_t size, int device, void *stream);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* MEMSAVER_H */
