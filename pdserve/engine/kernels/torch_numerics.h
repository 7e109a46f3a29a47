/* Numerics shared by the attention kernels: bf16 <-> float32 conversions as torch rounds them,
 * and torch's fexp_u20. Included by paged_attention.c and prefill_attention.c (kernels/__init__.py
 * hashes this header into both builds' cache keys). */
#ifndef PDSERVE_TORCH_NUMERICS_H
#define PDSERVE_TORCH_NUMERICS_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>
/* exp(x) as torch's flash attention computes it for bf16/fp16 outputs (Vectorized<float>::fexp_u20
 * in aten/src/ATen/cpu/vec/vec512/vec512_float.h; Malossi et al., "Fast Exponential Computation
 * on SIMD Architectures", 2015): 2^(x log2 e) with the fraction's 2^f corrected by a cubic and
 * written straight into the float's bits. Note fexp(0) = 0.99989 (bits 0x3f7ffc80), not 1. */
static inline __m512 fexp_u20(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32(0xc2aeac50)), _CMP_LT_OS);
    const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x42b17218)), _CMP_GT_OS);
    __m512 src = _mm512_mul_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b))); /* x log2(e) */
    const __m512 frac = _mm512_sub_ps(src, _mm512_floor_ps(src));
    __m512 c = _mm512_fmadd_ps(frac, _mm512_set1_ps(-0.079204240219773236f), _mm512_set1_ps(-0.22433836478672356f));
    c = _mm512_fmadd_ps(frac, c, _mm512_set1_ps(0.30354260500649682f));
    c = _mm512_fmadd_ps(frac, c, _mm512_set1_ps(0.00010703434948458272f));
    src = _mm512_sub_ps(src, c);
    __m512i bits = _mm512_cvttps_epi32(_mm512_fmadd_ps(_mm512_set1_ps(8388608.f), src, _mm512_set1_ps(8388608.f * 127.f)));
    bits = _mm512_mask_mov_epi32(bits, under, _mm512_setzero_si512());
    bits = _mm512_mask_mov_epi32(bits, over, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(bits);
}


/* The vector part of torch's _exp_reduce_sum_fusion_kernel for bf16 (torch 2.13): s[t] <- exp(s[t] - max)
 * by fexp_u20 for t < end (the rest of the last 16-key piece set to 0, as exp(-inf) of the keys a
 * row cannot see), summed in two accumulators over alternate 16-key pieces, added, lanes reduced;
 * returns that sum. The caller adds its scalar tail (std::exp) after it. With one accumulator
 * ~1 in 300,000 attention outputs differed from torch's. */
static inline float fexp_sum_pieces(float *s, int64_t end, float max) {
    const __m512 vmax = _mm512_set1_ps(max);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t t = 0; t < end; t += 16) {
        const __mmask16 m = end - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (end - t)) - 1);
        const __m512 y = _mm512_maskz_mov_ps(m, fexp_u20(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmax)));
        if ((t / 16) % 2) acc1 = _mm512_add_ps(acc1, y);
        else acc0 = _mm512_add_ps(acc0, y);
        _mm512_storeu_ps(s + t, y);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

#endif
