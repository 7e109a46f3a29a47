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
 * Built with cc -O3 -march=native by kernels/__init__.py.
 */
#include <stdint.h>
#include <string.h>

#define P1 0x9E3779B97F4A7C15ull
#define P2 0xC2B2AE3D27D4EB4Full

static inline uint64_t mix(uint64_t x) { /* splitmix64 finalizer (Steele et al., 2014) */
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

uint64_t kv_checksum_blocks(const uint8_t *base, int64_t head_stride, int64_t block_bytes, const int32_t *block_ids,
                            int64_t num_blocks, int64_t num_heads, uint64_t seed) {
    uint64_t acc[8];
    for (int j = 0; j < 8; j++) acc[j] = mix(seed + (uint64_t)j * P2);
    const int64_t words = block_bytes / 64 * 8; /* whole 64-byte lines */
    for (int64_t h = 0; h < num_heads; h++) {
        for (int64_t b = 0; b < num_blocks; b++) {
            const uint8_t *p = base + h * head_stride + (int64_t)block_ids[b] * block_bytes;
            for (int64_t i = 0; i < words; i += 8) {
                uint64_t w[8];
                memcpy(w, p + i * 8, 64);
                for (int j = 0; j < 8; j++) acc[j] = (acc[j] ^ w[j]) * P1;
            }
            for (int64_t i = words * 8; i < block_bytes; i++) acc[i % 8] = (acc[i % 8] ^ p[i]) * P1;
        }
    }
    uint64_t out = mix((uint64_t)(num_heads * num_blocks * block_bytes));
    for (int j = 0; j < 8; j++) out = mix(out ^ acc[j]);
    return out;
}

void kv_copy_blocks(const uint8_t *src, int64_t src_head_stride, uint8_t *dst, int64_t dst_head_stride,
                    int64_t block_bytes, const int32_t *src_ids, const int32_t *dst_ids, int64_t num_blocks,
                    int64_t num_heads) {
    for (int64_t h = 0; h < num_heads; h++) {
        for (int64_t b = 0; b < num_blocks;) {
            int64_t run = 1; /* merge runs of consecutive blocks on both sides into one memcpy */
            while (b + run < num_blocks && src_ids[b + run] == src_ids[b] + run && dst_ids[b + run] == dst_ids[b] + run) run++;
            memcpy(dst + h * dst_head_stride + (int64_t)dst_ids[b] * block_bytes,
                   src + h * src_head_stride + (int64_t)src_ids[b] * block_bytes, run * block_bytes);
            b += run;
        }
    }
}
