/* memsaver: the C ABI of libmemsaver.so.
 *
 * Every function returns a memsaver_status (MEMSAVER_OK on success). On failure the calling
 * thread's last error message, read with memsaver_last_error(), says what went wrong and what
 * to do. No function aborts or exits the process.
 *
 * Tags: 1 to 64 characters from letters, digits, '_', '-' and '.' ("nccl" is memsaver's own).
 * Tag lists are comma-separated ("weights,kv_cache"; whitespace around a tag is ignored).
 * Only NULL means every tag: "", " ", "," or "a,,b" give MEMSAVER_ERR_INVALID_ARGUMENT.
 * Policies: "discard" (contents dropped on
 * pause) or "cpu" (contents kept in pinned host memory).
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
 * "backup_bytes","devices":[...]}],"total":{...}}. *needed gets the size including the NUL. */
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

/* Hooks. Under LD_PRELOAD this library defines cudaMalloc and cudaFree: inside a region the
 * memory comes from memsaver, outside the call goes to libcudart untouched. For
 * torch.cuda.memory.CUDAPluggableAllocator (no preload), inside regions only: */
void *memsaver_torch_malloc(ptrdiff_t size, int device, void *stream);
void memsaver_torch_free(void *ptr, ptrdiff_t size, int device, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MEMSAVER_H */
