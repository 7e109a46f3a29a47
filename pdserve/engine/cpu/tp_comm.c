/* Tensor-parallel collectives over one shared-memory segment, for the ranks of one replica
 * on one node (engine/tensor_parallel/comm.py maps the segment in every rank).
 *
 * Segment layout (every rank maps the same file):
 *   [0, 64 * world)                 arrive[r]: rank r's count of collectives begun, one cache line each
 *   [64 * world, + 2 * world * cap) two banks of world slots of cap bytes; collective number g
 *                                   uses bank g % 2, so a rank that runs ahead into g + 1
 *                                   never overwrites a slot that a slower rank still reads for g
 *                                   (it cannot reach g + 2 before every rank has begun g + 1,
 *                                   which each does only after it has read g)
 *
 * all-reduce of n elements: rank r copies its part into slot r, announces g, waits until every
 * rank has announced g, then sums the slots in rank order 0, 1, .., world - 1 (bf16 parts
 * widened and summed in float32, rounded once to nearest even). Every rank computes the same
 * sum in the same order, so every rank holds the same bits, and they do not depend on the
 * batch: each element's sum involves only that element.
 *
 * A wait spins, yields the core after a while (more ranks than cores), and gives up after
 * timeout_s: -1, a peer that died or hung; the caller raises.
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
    return base + 64 * (int64_t)world + ((int64_t)(g % 2) * world + r) * cap;
}

/* Announce collective g (1, 2, ...) for rank and wait for every rank to announce it. 0, or -1
 * after timeout_s. */
int tp_barrier(char *base, int rank, int world, uint64_t g, double timeout_s) {
    __atomic_store_n(arrive(base, rank), g, __ATOMIC_RELEASE);
    double deadline = 0;
    for (int r = 0; r < world; r++) {
        for (int64_t spin = 0; __atomic_load_n(arrive(base, r), __ATOMIC_ACQUIRE) < g; spin++) {
            if (spin < 2000) continue;
            sched_yield();
            if ((spin & 255) == 0) {
                double t = now_s();
                if (deadline == 0) deadline = t + timeout_s;
                else if (t > deadline) return -1;
            }
        }
    }
    return 0;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* buf: n elements (bf16 when bf, else float32), this rank's part in, the sum over ranks out.
 * n * element size <= cap. 0, or -1 on timeout. */
int tp_allreduce(char *base, int rank, int world, int64_t cap, uint64_t g, void *buf, int64_t n, int bf, double timeout_s) {
    const int64_t es = bf ? 2 : 4;
    memcpy(slot(base, world, cap, g, rank), buf, (size_t)(n * es));
    if (tp_barrier(base, rank, world, g, timeout_s)) return -1;
    if (bf) {
        const uint16_t *s[64];
        for (int r = 0; r < world; r++) s[r] = (const uint16_t *)slot(base, world, cap, g, r);
        uint16_t *o = buf;
        for (int64_t i = 0; i < n; i++) {
            float acc = bf16_to_f32(s[0][i]);
            for (int r = 1; r < world; r++) acc += bf16_to_f32(s[r][i]);
            o[i] = f32_to_bf16(acc);
        }
    } else {
        const float *s[64];
        for (int r = 0; r < world; r++) s[r] = (const float *)slot(base, world, cap, g, r);
        float *o = buf;
        for (int64_t i = 0; i < n; i++) {
            float acc = s[0][i];
            for (int r = 1; r < world; r++) acc += s[r][i];
            o[i] = acc;
        }
    }
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
