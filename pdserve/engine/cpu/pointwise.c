/* The step's row-wise ops, fused: residual add + RMSNorm, rotary in place, SiLU * mul.
 *
 * Every op works on one token's row by itself, with reductions in simd.h's fixed order, so
 * a row's bits never depend on the other rows (batch invariance). bf != 0: tensors are bf16
 * (uint16_t), computed in float32 and rounded where HF rounds (noted per op); else float32.
 */
#include "parallel.h"
#include "simd.h"

/* VL elements i.. of a row of either dtype, widened; and stored back (bf16: rounded as st()). */
static inline vf ldv(const void *p, int64_t i, int bf) {
    return bf ? vload_bf16((const uint16_t *)p + i) : vload((const float *)p + i);
}
static inline void stv(void *p, int64_t i, vf v, int bf) {
    if (bf) vstore_bf16((uint16_t *)p + i, v);
    else vstore((float *)p + i, v);
}

/* Row sum of squares, in simd.h's order. */
static float sum_squares(const void *row, int64_t n, int bf) {
    vf acc = vzero();
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf v = bf ? vload_bf16((const uint16_t *)row + i) : vload((const float *)row + i);
        acc = vfma(v, v, acc);
    }
    float s = vsum(acc);
    for (; i < n; i++) {
        float v = ld(row, i, bf);
        s = fmaf(v, v, s);
    }
    return s;
}

typedef struct {
    const void *x, *weight;
    void *residual, *out;
    int64_t ldx, ldr, ldo, H;
    float eps;
    int add, bf;
} norm_args;

static void add_rmsnorm_rows(const void *args, int64_t begin, int64_t end) {
    const norm_args *a = (const norm_args *)args;
    const void *x = a->x, *weight = a->weight;
    void *residual = a->residual, *out = a->out;
    const int64_t ldx = a->ldx, ldr = a->ldr, ldo = a->ldo, H = a->H, es = a->bf ? 2 : 4;
    const float eps = a->eps;
    const int add = a->add, bf = a->bf;
    for (int64_t m = begin; m < end; m++) {
        const char *xr = (const char *)x + m * ldx * es;
        char *rr = (char *)residual + m * ldr * es, *orow = (char *)out + m * ldo * es;
        int64_t i = 0; /* vectors, then the tail: the same operations per element */
        for (; i + VL <= H; i += VL) stv(rr, i, add ? vadd(ldv(rr, i, bf), ldv(xr, i, bf)) : ldv(xr, i, bf), bf);
        for (; i < H; i++) st(rr, i, add ? ld(rr, i, bf) + ld(xr, i, bf) : ld(xr, i, bf), bf);
        float inv = 1.0f / sqrtf(sum_squares(rr, H, bf) / (float)H + eps);
        for (i = 0; i + VL <= H; i += VL) {
            vf h = vmul(ldv(rr, i, bf), vset1(inv));
            if (bf) h = vround_bf16(h);
            stv(orow, i, vmul(ldv(weight, i, bf), h), bf);
        }
        for (; i < H; i++) {
            float h = ld(rr, i, bf) * inv;
            if (bf) h = bf16_to_f32(bf16_round(h));
            st(orow, i, ld(weight, i, bf) * h, bf);
        }
    }
}

/* Rows a thread takes at least: below this a row op is not worth waking the pool for. */
#define ROWS_PER_THREAD 32

/* For each of M rows of H: residual += x (rounded to the dtype, as HF's bf16 add), unless
 * add == 0, then residual = x; out = weight * (residual * rsqrt(mean(residual^2) + eps))
 * with HF LlamaRMSNorm's two roundings in bf16 (the normalised row, then the product).
 * x, residual, out: [M, H] with row strides ldx, ldr, ldo elements; weight: [H]. Rows are
 * split among nthreads (each row by one thread: the same bits). */
void add_rmsnorm(const void *x, int64_t ldx, void *residual, int64_t ldr, int add, const void *weight, void *out, int64_t ldo,
                 int64_t M, int64_t H, float eps, int bf, int64_t nthreads) {
    norm_args a = {x, weight, residual, out, ldx, ldr, ldo, H, eps, add, bf};
    parallel_ranges(add_rmsnorm_rows, &a, M, ROWS_PER_THREAD, nthreads);
}

/* Rotary embedding in place (HF's rotate_half form, as Llama and Qwen2 use):
 * x[t, h, i] for i < D/2 becomes x_i cos_i - x_{i+D/2} sin_i; x[t, h, i + D/2] becomes
 * x_{i+D/2} cos_{i+D/2} + x_i sin_{i+D/2}; each product rounded to float32 before the sum (built
 * with -ffp-contract=off), as torch's two multiplies and an add (bf16: one rounding at the end).
 * x: [T, heads, D] with token stride ldt and head stride ldh elements; positions: [T];
 * cos, sin: [max_position, D] float32 (HF's rotary table, attention scaling included).
 * Tokens are split among nthreads. */
typedef struct {
    void *x;
    const int64_t *positions;
    const float *cos_t, *sin_t;
    int64_t heads, D, ldt, ldh;
    int bf;
} rope_args;

static void rope_rows(const void *args, int64_t begin, int64_t end) {
    const rope_args *a = (const rope_args *)args;
    void *x = a->x;
    const int64_t *positions = a->positions;
    const float *cos_t = a->cos_t, *sin_t = a->sin_t;
    const int64_t heads = a->heads, D = a->D, ldt = a->ldt, ldh = a->ldh, half = D / 2, es = a->bf ? 2 : 4;
    const int bf = a->bf;
    for (int64_t t = begin; t < end; t++) {
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            char *row = (char *)x + (t * ldt + h * ldh) * es;
            int64_t i = 0;
            for (; i + VL <= half; i += VL) { /* the same operations as the scalar tail below */
                vf a = ldv(row, i, bf), b = ldv(row, i + half, bf);
                vf p1 = vmul(a, vload(c + i)), p2 = vmul(vmul(b, vset1(-1.0f)), vload(s + i));
                vf p3 = vmul(b, vload(c + i + half)), p4 = vmul(a, vload(s + i + half));
                stv(row, i, vadd(p1, p2), bf);
                stv(row, i + half, vadd(p3, p4), bf);
            }
            for (; i < half; i++) {
                float a = ld(row, i, bf), b = ld(row, i + half, bf);
                float p1 = a * c[i], p2 = (-b) * s[i], p3 = b * c[i + half], p4 = a * s[i + half];
                st(row, i, p1 + p2, bf);
                st(row, i + half, p3 + p4, bf);
            }
        }
    }
}

void rope_inplace(void *x, int64_t T, int64_t heads, int64_t D, int64_t ldt, int64_t ldh, const int64_t *positions,
                  const float *cos_t, const float *sin_t, int bf, int64_t nthreads) {
    rope_args a = {x, positions, cos_t, sin_t, heads, D, ldt, ldh, bf};
    parallel_ranges(rope_rows, &a, T, ROWS_PER_THREAD, nthreads);
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i] (simd.h's vsilu_mul): gate and up side by side
 * (the fused gate-up linear's output). A row's tail short of VL goes through a zero-padded
 * vector, so every element takes the same operations. gu: [M, 2I] row stride ldg; out: [M, I] row stride ldo.
 * Rows are split among nthreads. */
typedef struct {
    const void *gu;
    void *out;
    int64_t ldg, ldo, I;
    int bf;
} silu_args;

static void silu_mul_rows(const void *args, int64_t begin, int64_t end) {
    const silu_args *a = (const silu_args *)args;
    const void *gu = a->gu;
    void *out = a->out;
    const int64_t ldg = a->ldg, ldo = a->ldo, I = a->I, es = a->bf ? 2 : 4;
    const int bf = a->bf;
    for (int64_t m = begin; m < end; m++) {
        const char *g = (const char *)gu + m * ldg * es;
        char *o = (char *)out + m * ldo * es;
        int64_t i = 0;
        for (; i + VL <= I; i += VL) stv(o, i, vsilu_mul(ldv(g, i, bf), ldv(g, I + i, bf), bf), bf);
        if (i < I) {
            float a[VL] = {0}, b[VL] = {0}, r[VL];
            for (int64_t j = 0; j < I - i; j++) a[j] = ld(g, i + j, bf), b[j] = ld(g, I + i + j, bf);
            vstore(r, vsilu_mul(vload(a), vload(b), bf));
            for (int64_t j = 0; j < I - i; j++) st(o, i + j, r[j], bf);
        }
    }
}

void silu_mul(const void *gu, int64_t ldg, void *out, int64_t ldo, int64_t M, int64_t I, int bf, int64_t nthreads) {
    silu_args a = {gu, out, ldg, ldo, I, bf};
    parallel_ranges(silu_mul_rows, &a, M, ROWS_PER_THREAD, nthreads);
}

const char *pointwise_isa(void) { return simd_isa(); }

/* A grammar's token mask on one row of logits, in place: x[i] = -inf where bit i % 32 of
 * words[i / 32] is clear (pdserve/structured.py fill_masks), for i < n. A word with every bit
 * set is skipped and one with none is filled whole: a JSON mask is mostly those. */
void mask_logits(void *x, int64_t n, const uint32_t *words, int bf) {
    for (int64_t w = 0; w * 32 < n; w++) {
        const uint32_t bits = words[w];
        const int64_t i0 = w * 32, m = n - i0 < 32 ? n - i0 : 32;
        if (bits == 0xFFFFFFFFu) continue;
        if (bf) {
            uint16_t *r = (uint16_t *)x + i0;
            for (int64_t j = 0; j < m; j++) r[j] = (bits >> j) & 1 ? r[j] : 0xFF80; /* bf16 -inf */
        } else {
            float *r = (float *)x + i0;
            for (int64_t j = 0; j < m; j++) r[j] = (bits >> j) & 1 ? r[j] : -INFINITY;
        }
    }
}
