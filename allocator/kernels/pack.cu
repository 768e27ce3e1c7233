// memsaver's packed backups (allocator/src/packed.rs): a pause copies only the 4 KiB blocks of
// device memory that hold a non-zero byte, packed into pinned host memory that the device
// writes directly; a resume zero-fills the memory and puts those blocks back. Zero blocks come
// back as zeros, so the round trip is exact whatever the memory holds.
//
// The PTX beside this file is what memsaver loads (`cuModuleLoadData`); it is generated from
// this file by `regenerate.sh` on a machine with nvcc, and tests/gpu/pack_kernels.sh checks that
// the two match. Nothing is built from CUDA at install.
//
// Layout of a packed backup of `len` bytes in a host buffer of `cap_bytes` (allocator/src/packed.rs
// computes it): slot s holds one block at `dst + s * 4096`, `index[s]` is that block's number
// in the device memory, and `*out_count` receives how many blocks held something (more than
// `capacity` means the buffer was too small: the host then copies the memory whole).
//
// All launches of one device go on memsaver's stream of that device, so no two run at once:
// the module's counters below serve one launch at a time, and the last block of each launch
// sets them back to zero.

#define BLOCK_BYTES 4096
#define THREADS 256 // x 16 bytes = one block

__device__ unsigned int g_found;    // blocks found non-zero by this launch
__device__ unsigned int g_finished; // thread blocks of this launch that are done

// Loads the 16 bytes at `at` of `len` bytes of `src` (zeros beyond `len`).
__device__ __forceinline__ uint4 load16(const unsigned char *src, unsigned long long at,
                                        unsigned long long len) {
    if (at + 16 <= len) {
        return *reinterpret_cast<const uint4 *>(src + at);
    }
    unsigned char t[16];
    for (int i = 0; i < 16; i++) {
        t[i] = at + i < len ? src[at + i] : 0;
    }
    uint4 v;
    memcpy(&v, t, 16);
    return v;
}

// Stores the first `len - at` (at most 16) bytes of `v` at `dst`.
__device__ __forceinline__ void store16(unsigned char *dst, uint4 v, unsigned long long at,
                                        unsigned long long len) {
    if (at + 16 <= len) {
        *reinterpret_cast<uint4 *>(dst) = v;
        return;
    }
    unsigned char t[16];
    memcpy(t, &v, 16);
    for (int i = 0; at + i < len && i < 16; i++) {
        dst[i] = t[i];
    }
}

// Packs the non-zero blocks of `len` bytes at `src` (device memory, 16-byte aligned) into
// `dst` (host memory the device may write), their numbers into `index`, and writes how many
// there were to `*out_count`.
extern "C" __global__ void __launch_bounds__(THREADS)
    memsaver_pack(const unsigned char *__restrict__ src, unsigned long long len,
                  unsigned char *__restrict__ dst, unsigned int *__restrict__ index,
                  unsigned int *out_count, unsigned int capacity) {
    __shared__ unsigned int slot;
    unsigned long long blocks = (len + BLOCK_BYTES - 1) / BLOCK_BYTES;
    for (unsigned long long b = blockIdx.x; b < blocks; b += gridDim.x) {
        unsigned long long at = b * BLOCK_BYTES + threadIdx.x * 16ull;
        uint4 v = at < len ? load16(src, at, len) : make_uint4(0, 0, 0, 0);
        if (__syncthreads_or((v.x | v.y | v.z | v.w) != 0)) {
            if (threadIdx.x == 0) {
                slot = atomicAdd(&g_found, 1u);
            }
            __syncthreads();
            unsigned int s = slot;
            if (s < capacity) {
                if (at < len) {
                    store16(dst + (unsigned long long)s * BLOCK_BYTES + threadIdx.x * 16ull, v, at,
                            len);
                }
                if (threadIdx.x == 0) {
                    index[s] = (unsigned int)b;
                }
            }
            __syncthreads(); // `slot` is not taken again before every thread read it
        }
    }
    // The last thread block to finish reports the count and resets the counters.
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&g_finished, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) {
        __threadfence();
        *out_count = atomicExch(&g_found, 0u);
        g_finished = 0;
        __threadfence_system();
    }
}

// Puts `count` packed blocks of `src` (host memory the device may read) back at their places
// in `len` bytes of device memory at `dst`, which the caller zero-filled.
extern "C" __global__ void __launch_bounds__(THREADS)
    memsaver_unpack(unsigned char *__restrict__ dst, unsigned long long len,
                    const unsigned char *__restrict__ src, const unsigned int *__restrict__ index,
                    unsigned int count) {
    for (unsigned int s = blockIdx.x; s < count; s += gridDim.x) {
        unsigned long long at = (unsigned long long)index[s] * BLOCK_BYTES + threadIdx.x * 16ull;
        if (at < len) {
            const uint4 v =
                *reinterpret_cast<const uint4 *>(src + (unsigned long long)s * BLOCK_BYTES +
                                                 threadIdx.x * 16ull);
            store16(dst + at, v, at, len);
        }
    }
}
