/*
 * AVX-512 pieces that the AMX files and the AVX512_BF16 files (for CPUs without AMX) share,
 * static inline, included by each inside its own target pragma (AVX-512 F/BW/VL/DQ and BF16).
 * exp16 must keep avx2_common.h's exp8 results (the fused SiLU of every path rounds alike),
 * and both prefill attention kernels take the same softmax step.
 */
#ifndef PW_AVX512_COMMON_H
#define PW_AVX512_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define RESCALE_MARGIN 8.0f /* a running max moves only when passed by more than this */

/* exp8 of avx2_common.h on sixteen lanes: the same steps and constants (so the same
 * results: the fused SiLU must round as the AVX2 one does), the same clamps (a NaN passes
 * through: max/min return their second operand). A copy by design, not by accident. */
static inline __m512 exp16(__m512 x) {
    __mmask16 overflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72f), _CMP_GT_OQ);
    x = _mm512_min_ps(_mm512_set1_ps(88.3f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mask_blend_ps(overflow, _mm512_mul_ps(p, _mm512_castsi512_ps(e)),
                                _mm512_set1_ps(INFINITY));
}

/* bf16 rounding (to nearest even, in one instruction; denormal inputs count as zero, as
 * VCVTNEPS2BF16 always does) as fp32 */
static inline __m512 round_bf16x16(__m512 f) {
    __m256i h = (__m256i)_mm512_cvtneps_pbh(f);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* e^x for attention weights (rounded to bf16 afterwards): 2^(x log2 e) as 2^n 2^f, f in
 * [-1/2, 1/2], a degree-5 polynomial for 2^f (relative error ~2e-7) and vscalefps; x below
 * -87 counts as -87 (e^-87 ~ 1.6e-38: nothing next to the weight of the max, e^0, and still
 * a normal float: a denormal result costs a microcode assist, which made this step 4x
 * slower); NaN stays NaN. Masked keys must be zeroed by the caller. */
static inline __m512 exp16_fast(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lazy rescaling of an online softmax whose lanes are queries (or heads): the reference max
 * mx moves only where this step's max m_new passes it by more than RESCALE_MARGIN (e^8 ~
 * 3e3: the weights and sums stay far inside fp32 and bf16), so the rescale of the running
 * sum and of the outputs is rare after the first keys. lazy_alpha moves mx and rescales sum
 * where it grew, and gives alpha (1 in the other lanes) for the outputs; returns the lanes
 * that grew (none: nothing to rescale). */
static inline __mmask16 lazy_alpha(__m512 m_new, __m512 *mx, __m512 *sum, __m512 *alpha) {
    __mmask16 grew = _mm512_cmp_ps_mask(m_new, _mm512_add_ps(*mx, _mm512_set1_ps(RESCALE_MARGIN)),
                                        _CMP_GT_OQ);
    if (grew) {
        __m512 ref = _mm512_mask_mov_ps(*mx, grew, m_new);
        __m512 a = exp16_fast(_mm512_sub_ps(*mx, ref));  /* 0 where nothing was seen */
        *alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), grew, a);
        *sum = _mm512_mul_ps(*sum, *alpha);
        *mx = ref;
    }
    return grew;
}

/* lazy_alpha, then O^T (ot, [hd][16 lanes]) rescaled. */
static inline void lazy_rescale(__m512 m_new, __m512 *mx, __m512 *sum, float *ot, int hd) {
    __m512 alpha;
    if (!lazy_alpha(m_new, mx, sum, &alpha)) return;
    for (int d = 0; d < hd; d++)
        _mm512_store_ps(ot + 16 * d, _mm512_mul_ps(_mm512_load_ps(ot + 16 * d), alpha));
}

/* The softmax of one step for one half (16 queries): the scores S^T (32 keys, a vector of
 * the 16 queries each, at st with a row stride of 16 floats) against the keys k0.. that the
 * queries at qpos see; updates the running max mx and sum, rescales O^T (ot, [hd][16]) when
 * the max moves, and writes the weights P^T in pair order (pt, 16 rows of 16 pairs). */
static inline void softmax_step(const float *st, long k0, __m512 qpos, __m512 sc, __m512 *mx,
                                __m512 *sum, float *ot, int hd, uint32_t *pt) {
    /* 16-bit lanes of two vectors' bf16 interleaved (a: the first 16 of the 32, b the last) */
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    __m512 s[32];
    __mmask16 seen[32];
    __m512 m_new = *mx;  /* this step's max, beside the reference one */
    for (int j = 0; j < 32; j++) {
        /* key k0 + j is seen by the queries at or after it */
        seen[j] = _mm512_cmp_ps_mask(_mm512_set1_ps((float)(k0 + j)), qpos, _CMP_LE_OQ);
        s[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen[j],
                                  _mm512_load_ps(st + 16 * j), sc);
        m_new = _mm512_max_ps(m_new, s[j]);
    }
    lazy_rescale(m_new, mx, sum, ot, hd);
    for (int c = 0; c < 16; c++) {
        __m512 p0 = _mm512_maskz_mov_ps(seen[2 * c], exp16_fast(_mm512_sub_ps(s[2 * c], *mx)));
        __m512 p1 = _mm512_maskz_mov_ps(seen[2 * c + 1],
                                        exp16_fast(_mm512_sub_ps(s[2 * c + 1], *mx)));
        *sum = _mm512_add_ps(*sum, _mm512_add_ps(p0, p1));
        __m512i pb = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  /* [p0 | p1] as bf16 */
        _mm512_store_si512(pt + 16 * c, _mm512_permutexvar_epi16(inter, pb));
    }
}


/* bf16 <-> fp32 on the AVX512_BF16 files' scalar tails and on 16 lanes, and their
 * SiLU-and-multiply: the same rounding as avx2_common.h's, so every path gives the same
 * bits. */
static inline float avx512bf16_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t avx512bf16_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}


/* f32_to_bf16 on 16 lanes (to nearest even; NaN made quiet), as the fp32 bit pattern. */
static inline __m512i avx512bf16_bf16_bits16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(
        _mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                    _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

static inline __m512 avx512bf16_load_bf16x16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* bf16(bf16(silu(g)) * u) on 16 lanes, g and u bf16 values (as fp32), as the fp32 bit
 * pattern (avx512bf16_bf16_bits16): the one SiLU-and-multiply of every 16-lane path (a prompt's
 * pass, the fused layer's pass, the panels' epilogue), so all of them give the same bits. */
static inline __m512i avx512bf16_silu_mul16(__m512 gv, __m512 uv) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    return avx512bf16_bf16_bits16(_mm512_mul_ps(_mm512_castsi512_ps(avx512bf16_bf16_bits16(silu)), uv));
}

#endif
