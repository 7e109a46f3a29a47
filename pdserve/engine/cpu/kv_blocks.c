/* Block copies and checksums over paged KV pools, for the shm transfer backend.
 *
 * A layer of a pool is [num_heads, num_slots, head_dim]; one block of one head is
 * block_bytes contiguous bytes at base + h * head_stride + block_id * block_bytes.
 *
 * kv_checksum_blocks: a 64-bit checksum over the bytes of (head, block) pieces, heads
 * outer and blocks inner in the given order, chained from `seed`. Eight lanes of
 * (acc ^ word) * odd constant, each lane a bijection of its input, so any change to a
 * word changes the result; lanes and length are mixed at the end (splitmix64 finalizer).
 * Not cryptographic: it guards against corrupt, stale or misplaced KV, not attackers.
 *
 * Built with cc -O3 -march=native by pdserve/engine/cpu/__init__.py.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define HAVE_STREAM 1
#endif

#define P1 0x9E3779B97F4A7C15ull
#define P2 0xC2B2AE3D27D4EB4Full

static inline uint64_t mix(uint64_t x) { /* splitmix64 finalizer (Steele et al., 2014) */
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

typedef struct {
    uint64_t acc[8];
} hstate;

static void h_init(hstate *h, uint64_t seed) {
    for (int j = 0; j < 8; j++) h->acc[j] = mix(seed + (uint64_t)j * P2);
}

static inline void h_block(hstate *h, const uint8_t *p, int64_t nbytes) { /* one (head, block) piece */
    const int64_t words = nbytes / 64 * 8;
    for (int64_t i = 0; i < words; i += 8) {
        uint64_t w[8];
        memcpy(w, p + i * 8, 64);
        for (int j = 0; j < 8; j++) h->acc[j] = (h->acc[j] ^ w[j]) * P1;
    }
    for (int64_t i = words * 8; i < nbytes; i++) h->acc[i % 8] = (h->acc[i % 8] ^ p[i]) * P1;
}

static uint64_t h_final(const hstate *h, uint64_t total_bytes) {
    uint64_t out = mix(total_bytes);
    for (int j = 0; j < 8; j++) out = mix(out ^ h->acc[j]);
    return out;
}

#ifdef HAVE_STREAM
/* Copy nbytes (a multiple of 64; dst 64-byte aligned) with non-temporal stores, hashing each
 * 64-byte word on its way through the registers into the same eight lanes h_block uses
 * (lane j takes bytes 8j..8j+7 of each word), so the result equals memcpy + h_block. The
 * stores skip the cache: no read of the destination first (write-allocate), which a plain
 * copy of a transfer larger than the cache pays. */
static void h_copy_stream(hstate *h, uint8_t *dst, const uint8_t *src, int64_t nbytes) {
    __m512i acc = _mm512_loadu_si512((const void *)h->acc);
    const __m512i p1 = _mm512_set1_epi64((long long)P1);
    for (int64_t i = 0; i < nbytes; i += 64) {
        const __m512i w = _mm512_loadu_si512((const void *)(src + i));
        acc = _mm512_mullo_epi64(_mm512_xor_si512(acc, w), p1);
        _mm512_stream_si512((void *)(dst + i), w);
    }
    _mm512_storeu_si512((void *)h->acc, acc);
}
#endif

#define STREAM_MIN_BYTES (256 << 10) /* smaller copies stay in cache, where decode reads them next */

uint64_t kv_checksum_blocks(const uint8_t *base, int64_t head_stride, int64_t block_bytes, const int32_t *block_ids,
                            int64_t num_blocks, int64_t num_heads, uint64_t seed) {
    hstate h;
    h_init(&h, seed);
    for (int64_t hd = 0; hd < num_heads; hd++)
        for (int64_t b = 0; b < num_blocks; b++) h_block(&h, base + hd * head_stride + (int64_t)block_ids[b] * block_bytes, block_bytes);
    return h_final(&h, (uint64_t)(num_heads * num_blocks * block_bytes));
}

/* Copy blocks src -> dst (one memcpy per run of blocks consecutive on both sides) and
 * return kv_checksum_blocks of what landed in dst, each block hashed right after it is
 * written, while it is still in cache: one pass over memory instead of two. A copy of
 * STREAM_MIN_BYTES or more (AVX-512) hashes each word between its load and a streaming
 * store instead. */
uint64_t kv_copy_blocks_checksum(const uint8_t *src, int64_t src_head_stride, uint8_t *dst, int64_t dst_head_stride,
                                 int64_t block_bytes, const int32_t *src_ids, const int32_t *dst_ids, int64_t num_blocks,
                                 int64_t num_heads, uint64_t seed) {
    hstate h;
    h_init(&h, seed);
    int stream = 0;
#ifdef HAVE_STREAM
    stream = block_bytes % 64 == 0 && num_heads * num_blocks * block_bytes >= STREAM_MIN_BYTES;
#endif
    for (int64_t hd = 0; hd < num_heads; hd++) {
        for (int64_t b = 0; b < num_blocks;) {
            int64_t run = 1;
            while (run < 16 && b + run < num_blocks && src_ids[b + run] == src_ids[b] + run && dst_ids[b + run] == dst_ids[b] + run) run++;
            uint8_t *d = dst + hd * dst_head_stride + (int64_t)dst_ids[b] * block_bytes;
            const uint8_t *s = src + hd * src_head_stride + (int64_t)src_ids[b] * block_bytes;
#ifdef HAVE_STREAM
            if (stream && (uintptr_t)d % 64 == 0) {
                h_copy_stream(&h, d, s, run * block_bytes);
                b += run;
                continue;
            }
#endif
            memcpy(d, s, run * block_bytes);
            for (int64_t r = 0; r < run; r++) h_block(&h, d + r * block_bytes, block_bytes);
            b += run;
        }
    }
#ifdef HAVE_STREAM
    if (stream) _mm_sfence(); /* the streamed stores are visible before the caller goes on */
#endif
    return h_final(&h, (uint64_t)(num_heads * num_blocks * block_bytes));
}
