/* Tensor-parallel collectives over one shared-memory segment, for the ranks of one replica
 * on one node (engine/tensor_parallel/comm.py maps the segment in every rank).
 *
 * Segment layout (every rank maps the same file):
 *   [0, 64 * world)                       arrive[r]: how far rank r has come, one cache line each;
 *                                         the 8 bytes after arrive[0]: the abort word (tp_abort)
 *   [64 * world, + 2 * (world + 1) * cap) two banks of world slots and one result area of cap
 *                                         bytes each; collective number g uses bank g % 2, so a
 *                                         rank that runs ahead into g + 1 never overwrites what a
 *                                         slower rank still reads for g (it cannot reach g + 2
 *                                         before every rank has finished g + 1, which each
 *                                         begins only after it has read g)
 *
 * all-reduce of n elements: rank r copies its part into slot r and waits for every rank; each
 * rank then sums its 1/world of the elements over the slots in rank order 0, 1, .., world - 1
 * (bf16 parts widened and summed in float32, rounded once to nearest even) into the result
 * area, waits for every rank again, and copies the whole result out. An element's sum has one
 * order wherever it is computed, so every rank holds the same bits, and they do not depend on
 * the batch: each element's sum involves only that element.
 *
 * A wait spins, yields the core after a while (more ranks than cores), and gives up after
 * timeout_s (-1: a peer that hung), or at once when any rank has set the abort word (-2: rank
 * 0 saw a peer die, or a rank saw rank 0 gone); the caller raises.
 */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline uint64_t *arrive(char *base, int r) { return (uint64_t *)(base + 64 * (int64_t)r); }
static inline char *slot(char *base, int world, int64_t cap, uint64_t g, int r) {
    return base + 64 * (int64_t)world + ((int64_t)(g % 2) * (world + 1) + r) * cap;
}
static inline char *result_area(char *base, int world, int64_t cap, uint64_t g) { return slot(base, world, cap, g, world); }
static inline uint64_t *abort_word(char *base) { return (uint64_t *)(base + 8); }

/* Make every wait of every rank on this segment, present and future, return -2. */
void tp_abort(char *base) { __atomic_store_n(abort_word(base), 1, __ATOMIC_RELEASE); }

/* Announce `value` for rank and wait until every rank has announced at least it. 0, -1 after
 * timeout_s, or -2 once aborted. Collective g ends at value 2g (an all-reduce announces
 * 2g - 1 midway). */
static int wait_all(char *base, int rank, int world, uint64_t value, double timeout_s) {
    __atomic_store_n(arrive(base, rank), value, __ATOMIC_RELEASE);
    double deadline = 0;
    for (int r = 0; r < world; r++) {
        for (int64_t spin = 0; __atomic_load_n(arrive(base, r), __ATOMIC_ACQUIRE) < value; spin++) {
            if (spin < 2000) continue;
            sched_yield();
            if (__atomic_load_n(abort_word(base), __ATOMIC_ACQUIRE)) return -2;
            if ((spin & 255) == 0) {
                double t = now_s();
                if (deadline == 0) deadline = t + timeout_s;
                else if (t > deadline) return -1;
            }
        }
    }
    return 0;
}

/* Collective g (1, 2, ...) as a barrier: every rank has reached it. 0, or wait_all's error. */
int tp_barrier(char *base, int rank, int world, uint64_t g, double timeout_s) { return wait_all(base, rank, world, 2 * g, timeout_s); }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* nearest even; NaN stays NaN (a select, so loops vectorize) */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16), nan = (uint16_t)((u >> 16) | 0x40);
    return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

#define CHUNK 1024 /* elements summed through one float32 buffer on the stack */

/* out[i] = sum over ranks r = 0, 1, .. of s[r][i] for i in [lo, hi), in that order. */
static void sum_range(void *out, char *const *s, int world, int64_t lo, int64_t hi, int bf) {
    float acc[CHUNK];
    for (int64_t c = lo; c < hi; c += CHUNK) {
        const int64_t n = hi - c < CHUNK ? hi - c : CHUNK;
        if (bf) {
            const uint16_t *s0 = (const uint16_t *)s[0] + c;
            for (int64_t i = 0; i < n; i++) acc[i] = bf16_to_f32(s0[i]);
            for (int r = 1; r < world; r++) {
                const uint16_t *sr = (const uint16_t *)s[r] + c;
                for (int64_t i = 0; i < n; i++) acc[i] += bf16_to_f32(sr[i]);
            }
            uint16_t *o = (uint16_t *)out + c;
            for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(acc[i]);
        } else {
            const float *s0 = (const float *)s[0] + c;
            for (int64_t i = 0; i < n; i++) acc[i] = s0[i];
            for (int r = 1; r < world; r++) {
                const float *sr = (const float *)s[r] + c;
                for (int64_t i = 0; i < n; i++) acc[i] += sr[i];
            }
            memcpy((float *)out + c, acc, (size_t)n * 4);
        }
    }
}

/* buf: n elements (bf16 when bf, else float32), this rank's part in, the sum over ranks out.
 * n * element size <= cap. Reduce-scatter then all-gather through the bank: every rank sums
 * its 1/world of the elements over all slots into the bank's result area (a 64-byte aligned
 * split), then copies the whole result out; each element's sum is the same wherever it is
 * computed. 0, or wait_all's error. */
int tp_allreduce(char *base, int rank, int world, int64_t cap, uint64_t g, void *buf, int64_t n, int bf, double timeout_s) {
    const int64_t es = bf ? 2 : 4, align = 64 / es;
    memcpy(slot(base, world, cap, g, rank), buf, (size_t)(n * es));
    int rc = wait_all(base, rank, world, 2 * g - 1, timeout_s);
    if (rc) return rc;
    char *s[64];
    for (int r = 0; r < world; r++) s[r] = slot(base, world, cap, g, r);
    char *result = result_area(base, world, cap, g);
    const int64_t per = (n / world + align - 1) / align * align;
    const int64_t lo = rank * per < n ? rank * per : n, hi = lo + per < n ? lo + per : n;
    sum_range(result, s, world, lo, hi, bf);
    if ((rc = wait_all(base, rank, world, 2 * g, timeout_s))) return rc;
    memcpy(buf, result, (size_t)(n * es));
    return 0;
}

/* The per-rank slot address of collective g, for a gather that the caller reads after
 * tp_barrier (rank 0 concatenating every rank's part). */
char *tp_slot(char *base, int world, int64_t cap, uint64_t g, int r) { return slot(base, world, cap, g, r); }

/* The all-reduce as decoder.c calls it: ctx is a tp_ctx this library's caller fills. */
typedef struct {
    char *base;
    int64_t rank, world, cap, bf;
    uint64_t g; /* the last collective's number; each call takes the next */
    double timeout_s;
    double spent_s; /* seconds in all-reduces so far, waits for slower ranks included (the bench reads it) */
} tp_ctx;

int tp_ctx_allreduce(void *ctx, void *buf, int64_t n) {
    tp_ctx *c = ctx;
    const double t0 = now_s();
    c->g++;
    const int rc = tp_allreduce(c->base, (int)c->rank, (int)c->world, c->cap, c->g, buf, n, (int)c->bf, c->timeout_s);
    c->spent_s += now_s() - t0;
    return rc;
}
