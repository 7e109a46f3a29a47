/* One vector abstraction for pdserve's CPU kernels, chosen at build time (-march=native).
 *
 * VL float lanes: 16 (AVX-512F), 8 (AVX2 + FMA) or 1 (portable C). Every reduction in the
 * kernels is written over these: lane j of an accumulator sums elements j, j + VL, j + 2VL,
 * ... in order, then vsum() adds the lanes in a fixed tree. The order depends on nothing but
 * the row's own length, which is what makes the kernels batch invariant.
 *
 * bf16 values are uint16_t holding the top half of a float32 (Brain float, as torch's
 * bfloat16); bf16_round() rounds to nearest even as torch does (c10/util/BFloat16.h).
 */
#ifndef PDSERVE_SIMD_H
#define PDSERVE_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float a) { return _mm512_set1_ps(a); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline float vsum(vf a) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
/* exp(x), Cephes' expf polynomial (deterministic, ~1 ulp; input clamped to [-87.3, 88.4]). */
static inline vf vexp(vf v) {
    v = _mm512_max_ps(_mm512_min_ps(v, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447504f));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_sub_ps(v, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
    v = _mm512_sub_ps(v, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, v, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(v, v), _mm512_add_ps(v, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
/* tanh(x), Cephes' tanhf (deterministic, ~2 ulp): x + x^3 P(x^2) where |x| < 0.625, else
 * 1 - 2 / (exp(2|x|) + 1) with x's sign (vexp's clamp makes it +-1 past |x| = 44). */
static inline vf vtanh(vf x) {
    const __m512 ax = _mm512_abs_ps(x), z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(-5.70498872745E-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954E-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531E-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036E-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422E-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    __m512 big = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(vexp(_mm512_add_ps(ax, ax)), _mm512_set1_ps(1.0f))));
    big = _mm512_mask_sub_ps(big, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), big);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ), big, small);
}
/* Each lane rounded to bf16 as bf16_round() does, kept as a float. */
static inline vf vround_bf16(vf a) {
    __m512i u = _mm512_castps_si512(a);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)), nan, _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}
static inline void vstore_bf16(uint16_t *p, vf a) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(vround_bf16(a)), 16)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float a) { return _mm256_set1_ps(a); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline float vsum(vf a) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vexp(vf v) { /* as the AVX-512 vexp */
    v = _mm256_max_ps(_mm256_min_ps(v, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_sub_ps(v, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    v = _mm256_sub_ps(v, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(v, v), _mm256_add_ps(v, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
static inline vf vtanh(vf x) { /* as the AVX-512 vtanh */
    const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(-5.70498872745E-3f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954E-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531E-2f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036E-1f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422E-1f));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(vexp(_mm256_add_ps(ax, ax)), _mm256_set1_ps(1.0f))));
    big = _mm256_or_ps(big, _mm256_and_ps(x, _mm256_set1_ps(-0.0f))); /* x's sign */
    return _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}
static inline vf vround_bf16(vf a) {
    __m256i u = _mm256_castps_si256(a);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)), _mm256_set1_epi32(0x7fc00000), nan);
    return _mm256_castsi256_ps(r);
}
static inline void vstore_bf16(uint16_t *p, vf a) {
    __m256i w = _mm256_srli_epi32(_mm256_castps_si256(vround_bf16(a)), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
#else
#define VL 1
typedef float vf;
static inline vf vzero(void) { return 0.0f; }
static inline vf vset1(float a) { return a; }
static inline vf vload(const float *p) { return *p; }
static inline void vstore(float *p, vf a) { *p = a; }
static inline vf vfma(vf a, vf b, vf c) { return fmaf(a, b, c); }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline float vsum(vf a) { return a; }
static inline vf vload_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline vf vexp(vf a) { return expf(a); }
static inline vf vtanh(vf a) { return tanhf(a); }
static inline vf vround_bf16(vf a) { return bf16_to_f32(bf16_round(a)); }
static inline void vstore_bf16(uint16_t *p, vf a) { *p = bf16_round(a); }
#endif

/* VL outputs of SwiGLU's product: silu(g) * u with silu(g) = g / (1 + exp(-g)) (vexp); bf16
 * rounds silu(g), then the product as it is stored, as HF does. One definition for
 * pointwise.c's silu_mul and the AMX gate-up projection that applies it as it stores
 * (linear_amx.h), so both give the same bits. */
static inline vf vsilu_mul(vf g, vf u, int bf) {
    vf act = vdiv(g, vadd(vset1(1.0f), vexp(vmul(g, vset1(-1.0f)))));
    if (bf) act = vround_bf16(act);
    return vmul(act, u);
}

/* A float row of either dtype: bf != 0 means uint16_t bf16 elements. */
static inline float ld(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void st(void *p, int64_t i, float v, int bf) {
    if (bf) ((uint16_t *)p)[i] = bf16_round(v);
    else ((float *)p)[i] = v;
}

/* The ISA this build runs: reported to Python (engine.json, logs). */
static inline const char *simd_isa(void) {
#if defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512f";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}

#endif
