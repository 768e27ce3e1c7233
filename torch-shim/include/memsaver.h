/* memsaver: the C ABI of libmemsaver.so.
 *
 * Every function returns a memsaver_status (MEMSAVER_OK on success). On failure the calling
 * thread's last error message, read with memsaver_last_error(), says what went wrong and what
 * to do. No function aborts or exits the process.
 *
 * Tags: 1 to 64 characters from letters, digits, '_', '-' and '.' ("nccl" is memsaver's own).
 * Tag lists are comma-separated ("weights,kv_cache"; whitespace around a tag is ignored).
 * Only NULL means every tag: "", " ", "," or "a,,b" give MEMSAVER_ERR_INVALID_ARGUMENT.
 * Policies: "discard" (contents dropped on pause), "cpu" (kept in pinned host memory), "mmap"
 * (kept in pageable anonymous host memory, unmapped when released so the RSS drops) or "disk"
 * (kept in a file of the disk backup directory, copied through a bounded staging buffer).
 */
#ifndef MEMSAVER_H
#define MEMSAVER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum memsaver_status {
    MEMSAVER_OK = 0,
    MEMSAVER_ERR_INVALID_ARGUMENT = 1,
    MEMSAVER_ERR_UNKNOWN_TAG = 2,
    MEMSAVER_ERR_TAG_PAUSED = 3,
    MEMSAVER_ERR_UNKNOWN_POINTER = 4,
    MEMSAVER_ERR_OUT_OF_MEMORY = 5,
    MEMSAVER_ERR_RESUME_OUT_OF_MEMORY = 6, /* partly resumed; free memory and resume again */
    MEMSAVER_ERR_DRIVER = 7,
    MEMSAVER_ERR_DRIVER_NOT_LOADED = 8,
    MEMSAVER_ERR_INCOMPLETE = 9,           /* some allocations kept their previous state */
    MEMSAVER_ERR_BUFFER_TOO_SMALL = 10,
    MEMSAVER_ERR_PEER = 11,                /* a peer process did not take part (nccl tag) */
    MEMSAVER_ERR_PROFILE = 12,             /* an invalid profile: file:line:column: reason */
    MEMSAVER_ERR_BACKUP = 13,              /* host memory or a file for a backup failed */
    MEMSAVER_ERR_INTERNAL = 99
} memsaver_status;

/* Message of the last failed call on this thread; valid until the next call on this thread. */
const char *memsaver_last_error(void);

int memsaver_malloc(void **ptr, size_t size, int device, const char *tag, const char *policy);
int memsaver_free(void *ptr);
int memsaver_register_tag(const char *tag);

int memsaver_pause(const char *tags);
int memsaver_resume(const char *tags);

/* Stats as JSON: {"tags":[{"tag","paused","allocations","reserved_bytes","resident_bytes",
 * "backup_bytes","pinned_backup_bytes","mmap_backup_bytes","disk_backup_bytes","devices":[...]}],
 * "total":{...}}. backup_bytes is host memory (pinned + mmap); disk files are counted apart.
 * *needed gets the size including the NUL. */
int memsaver_stats_json(char *buf, size_t len, size_t *needed);

/* NCCL's memory as the hook sees it (JSON), like memsaver_stats_json. */
int memsaver_nccl_stats_json(char *buf, size_t len, size_t *needed);

/* Group id of the nccl tag (processes coordinate NCCL memory within one group). Set it before
 * NCCL initialises: once NCCL shared memory with a peer, another value is refused. */
int memsaver_nccl_set_group(int64_t group);
int memsaver_nccl_group(int64_t *group);

/* Parses and validates a YAML pause/resume profile; writes it as JSON like memsaver_stats_json. */
int memsaver_profile_parse(const char *text, const char *file, char *buf, size_t len, size_t *needed);

/* Free and total bytes of a device, as the driver reports them. */
int memsaver_device_memory(int device, size_t *free, size_t *total);

/* Thread-local regions: allocations made through the hooks inside get this tag and policy. */
int memsaver_region_enter(const char *tag, const char *policy);
int memsaver_region_disable(void); /* allocations inside are not tagged; close with region_exit */
int memsaver_region_exit(void);
/* What applies to an allocation on this thread now, as JSON like memsaver_stats_json:
 * {"tag","policy","disabled","process","depth","process_tag"} (tag and policy null when
 * untagged; process: the whole-process tag of MEMSAVER_PROCESS_TAG / TMS_INIT_ENABLE applies, no
 * region is open; process_tag: that tag if one is configured, whether or not it applies now). */
int memsaver_region_current_json(char *buf, size_t len, size_t *needed);

/* Backups. Retention (default on; MEMSAVER_RETAIN_BACKUP): on, a backup (host memory or disk
 * file) is kept after its allocation resumed, for the next pause; off, it is released when its
 * allocation has resumed, and the next resume also releases retained backups of resident
 * allocations of the tags it names. Backups are always released with their allocation. */
int memsaver_set_retain_backups(int on);
int memsaver_retain_backups(int *out);

/* For a device range [ptr, ptr+size) inside one allocation (ptr may point inside it) whose host
 * backup ("cpu" or "mmap") exists, writes the host address of byte ptr in it to *out: it holds
 * the contents as of the last pause and stays valid until the backup is released (resume
 * without retention, or free). Otherwise writes NULL, which is not an error. */
int memsaver_backup_pointer(uint64_t ptr, size_t size, void **out);

/* Directory of "disk" backup files (MEMSAVER_DISK_DIR): created with mode 0700 if missing, must
 * be a directory; NULL or "" unsets it. Pausing a disk-backed allocation without one fails with
 * MEMSAVER_ERR_INVALID_ARGUMENT and changes nothing. Files are named memsaver-<pid>-<addr>.bin. */
int memsaver_set_disk_dir(const char *dir);

/* Resume refuses to map an allocation that would leave less than bytes free on its device
 * (MEMSAVER_ERR_RESUME_OUT_OF_MEMORY; what was resumed stays resumed). 0 (the default) turns
 * the check off. MEMSAVER_MEMORY_MARGIN_MB sets it at start. */
int memsaver_set_memory_margin(size_t bytes);

/* Hooks. Under LD_PRELOAD this library defines cudaMalloc and cudaFree: inside a region the
 * memory comes from memsaver, outside the call goes to libcudart untouched, unless
 * MEMSAVER_PROCESS_TAG (or TMS_INIT_ENABLE=1: tag "default") is set: then allocations outside
 * any region get that tag and MEMSAVER_PROCESS_BACKUP's policy (whole-process mode; the process
 * tag accepts new, resident allocations while paused, and resume skips them). For
 * torch.cuda.memory.CUDAPluggableAllocator (no preload), inside regions only: */
void *memsaver_torch_malloc(ptrdiff_t size, int device, void *stream);
void memsaver_torch_free(void *ptr, ptrdiff_t size, int device, void *stream);

/* Reads the profile file at path (at most 1 MiB of UTF-8 YAML), validates it and writes it as
 * JSON into buf, like memsaver_profile_parse. An invalid file (too large and not UTF-8
 * included) gives MEMSAVER_ERR_PROFILE with "path:line:column: what was expected"; a file that
 * cannot be read, "path: cannot read the profile: why". */
int memsaver_profile_load(const char *path, char *buf, size_t len, size_t *needed);

/* Runs one of the allocator core's commands of the memsaver command line ("demo", "bench",
 * "options"; argv[0] is the command) and returns its exit status (0 done, 1 failed, 2 usage
 * error). It prints to stdout and stderr: for the memsaver command only. */
int memsaver_cli_main(int argc, const char *const *argv);

/* Writes the path of the runtime directory (sockets of processes coordinating the nccl tag:
 * MEMSAVER_RUNTIME_DIR, else $XDG_RUNTIME_DIR/memsaver, else /tmp/memsaver-<uid>) into buf,
 * with the protocol of memsaver_stats_json. Creates nothing. */
int memsaver_runtime_dir(char *buf, size_t len, size_t *needed);

#ifdef __cplusplus
}
#endif

#endif /* MEMSAVER_H */
