// memsaver's packed backups (allocator/src/packed.rs): a pause copies only the 4 KiB blocks of
// device memory that hold a non-zero byte, packed into pinned host memory that the device
// writes directly; a resume zero-fills the memory and puts those blocks back. Zero blocks come
// back as zeros, so the round trip is exact whatever the memory holds.
//
// The PTX beside this file is what memsaver loads (`cuModuleLoadData`); it is generated from
// this file by `regenerate.sh` on a machine with nvcc, and tests/gpu/pack_kernels.sh checks that
// the two match. Nothing is built from CUDA at install.
//
// Layout of a packed backup of `len` bytes in a host buffer (allocator/src/packed.rs computes
// it): slot s holds one block at `dst + s * 4096`, `index[s]` is that block's number in the
// device memory, and `*count` receives how many blocks held something (more than `slots` means
// the buffer was too small: the host then copies the memory whole).
//
// One launch serves up to MAX_PIECES pieces, described in its parameters (a batch), so that a
// pause or resume launches once per batch and not once per buffer. Their blocks (slots, for
// unpack) are numbered one after the other through the batch: `first` is a piece's first.
//
// All launches of one device go on memsaver's stream of that device, so no two run at once:
// the module's counters below serve one launch at a time, and the last thread block of each
// launch sets them back to zero.

#define BLOCK_BYTES 4096
#define THREADS 256 // x 16 bytes = one block

#define MAX_PIECES 64

struct PackPiece {
    const unsigned char *src;
    unsigned long long len;
    unsigned char *dst;
    unsigned int *index;
    unsigned int *count;
    unsigned int slots;
    unsigned int first; // the piece's first block in the batch
};

struct PackBatch {
    PackPiece piece[MAX_PIECES];
    unsigned int pieces;
    unsigned int blocks; // of all pieces
};

struct UnpackPiece {
    unsigned char *dst;
    unsigned long long len;
    const unsigned char *src;
    const unsigned int *index;
    unsigned int count;
    unsigned int first; // the piece's first slot in the batch
};

struct UnpackBatch {
    UnpackPiece piece[MAX_PIECES];
    unsigned int pieces;
    unsigned int slots; // of all pieces
};

__device__ unsigned int g_found[MAX_PIECES]; // blocks found non-zero by this launch, per piece
__device__ unsigned int g_finished;          // thread blocks of this launch that are done

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

// Packs the non-zero blocks of each piece's `len` bytes at `src` (device memory, 16-byte
// aligned) into its `dst` (host memory the device may write), their numbers into its `index`,
// and writes how many there were to its `*count`.
extern "C" __global__ void __launch_bounds__(THREADS) memsaver_pack(const PackBatch batch) {
    __shared__ unsigned int slot;
    unsigned int p = 0;
    for (unsigned int g = blockIdx.x; g < batch.blocks; g += gridDim.x) {
        while (p + 1 < batch.pieces && g >= batch.piece[p + 1].first) {
            p++;
        }
        const PackPiece &q = batch.piece[p];
        unsigned long long b = g - q.first;
        unsigned long long at = b * BLOCK_BYTES + threadIdx.x * 16ull;
        uint4 v = at < q.len ? load16(q.src, at, q.len) : make_uint4(0, 0, 0, 0);
        if (__syncthreads_or((v.x | v.y | v.z | v.w) != 0)) {
            if (threadIdx.x == 0) {
                slot = atomicAdd(&g_found[p], 1u);
            }
            __syncthreads();
            unsigned int s = slot;
            if (s < q.slots) {
                if (at < q.len) {
                    store16(q.dst + (unsigned long long)s * BLOCK_BYTES + threadIdx.x * 16ull, v,
                            at, q.len);
                }
                if (threadIdx.x == 0) {
                    q.index[s] = (unsigned int)b;
                }
            }
            __syncthreads(); // `slot` is not taken again before every thread read it
        }
    }
    // The last thread block to finish reports the counts and resets the counters.
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&g_finished, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {
        __threadfence();
        for (unsigned int i = threadIdx.x; i < batch.pieces; i += blockDim.x) {
            *batch.piece[i].count = atomicExch(&g_found[i], 0u);
        }
        if (threadIdx.x == 0) {
            g_finished = 0;
        }
        __threadfence_system();
    }
}

// Puts each piece's `count` packed blocks of `src` (host memory the device may read) back at
// their places in its `len` bytes of device memory at `dst`, which the caller zero-filled.
extern "C" __global__ void __launch_bounds__(THREADS) memsaver_unpack(const UnpackBatch batch) {
    unsigned int p = 0;
    for (unsigned int g = blockIdx.x; g < batch.slots; g += gridDim.x) {
        while (p + 1 < batch.pieces && g >= batch.piece[p + 1].first) {
            p++;
        }
        const UnpackPiece &q = batch.piece[p];
        unsigned long long s = g - q.first;
        unsigned long long at = (unsigned long long)q.index[s] * BLOCK_BYTES + threadIdx.x * 16ull;
        if (at < q.len) {
            const uint4 v = *reinterpret_cast<const uint4 *>(q.src + s * BLOCK_BYTES +
                                                             threadIdx.x * 16ull);
            store16(q.dst + at, v, at, q.len);
        }
    }
}
