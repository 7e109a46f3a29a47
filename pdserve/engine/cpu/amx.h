/* AMX tiles (Intel AMX-BF16: Sapphire Rapids and later) for pdserve's bf16 kernels: the
 * permission, the tile configuration and bf16 rounding in vectors. Included by linear.c
 * (linear_amx.h) and attention.c (attention_amx.h) where the compiler targets AMX.
 *
 * Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM). Where it
 * refuses, or PDSERVE_NO_AMX is set, amx_on stays 0 and the kernels keep their AVX512-BF16
 * paths for the whole process.
 *
 * TDPBF16PS (Intel SDM vol. 2, "TDPBF16PS"): C[m][n] += A[m][2i] * B[i][n][0] + A[m][2i + 1]
 * * B[i][n][1] for the pairs i in order, in float32. Each C element is computed from its own
 * row of A and its own column of B, whatever the tile's row count: a row's result does not
 * depend on the rows beside it, which is what batch invariance needs.
 */
#ifndef PDSERVE_AMX_H
#define PDSERVE_AMX_H

#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_on;

__attribute__((constructor)) static void amx_init(void) {
    const char *off = getenv("PDSERVE_NO_AMX");
    /* ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 (linux/arch/x86/include/uapi/asm/prctl.h) */
    amx_on = !(off && *off && *off != '0') && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* Tiles 0..7 with rows[t] rows of 64 bytes (0: unused). */
static void amx_configure(const int rows[8]) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(c)); /* gcc 12's _tile_loadconfig declares 8 of the 64 bytes read: the
                                                 * compiler may drop the stores to the rest (a #GP) */
}

/* TILELOADD tile t from rows of 64 bytes, stride bytes apart. gcc 12's _tile_loadd declares no
 * memory read, so stores to a buffer just written (a packed P or V, a padded row) could be
 * moved after it or dropped; the "memory" clobber keeps them before it. */
#define amx_load(t, base, stride) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(base)), "r"((long)(stride)) : "memory")

/* 16 floats rounded to bf16 as bf16_round() does (nearest even, NaN kept quiet): 16 words. */
static inline __m256i amx_round_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), nan, _mm512_set1_epi32(0x7fc0)));
}

#endif
