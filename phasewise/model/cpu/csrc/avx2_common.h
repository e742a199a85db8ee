/*
 * What the AVX2 files (linear_avx2.c, elementwise_avx2.c, attention_avx2.c, fused_layer.c,
 * sampler_avx2.c) share: bf16 <-> fp32 conversions and rounding (to nearest even, NaN kept
 * quiet, as torch rounds), the 8-lane exp and SiLU-and-multiply, as static inline helpers so
 * every file computes the same bits; and the declarations of the functions one file calls in
 * another. Compiled with -mavx2 -mfma (kernels.py's CFLAGS).
 */
#ifndef PW_AVX2_COMMON_H
#define PW_AVX2_COMMON_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <math.h>
#include <float.h>

#include "abi.h"  /* the limits, ProjMode and DecodeLayer: what Python mirrors */

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

/* A float's bits and back (memcpy: no aliasing of one type through the other). */
static inline uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static inline float bits_f32(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* f32_to_bf16 for eight lanes, as fp32 (the rounded value) or as the 16-bit words. */
static inline __m256i bf16_bits8(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_and_si256(rounded, _mm256_set1_epi32((int)0xffff0000u));
}
static inline __m256 round_bf16x8(__m256 f) { return _mm256_castsi256_ps(bf16_bits8(f)); }
static inline void store_bf16x8(uint16_t *p, __m256 f) {
    __m256i w = _mm256_srli_epi32(bf16_bits8(f), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

/* bf16(bf16(silu(g)) * u) for bf16-valued g and u. */
static inline float silu_mul_rounded(float g, float u) {
    return round_bf16(round_bf16(g / (1.0f + expf(-g))) * u);
}

/* Eight at a time: exp by range reduction to r in [-ln2/2, ln2/2] (x = n ln2 + r, ln2 split
 * in two for exactness) and a degree-6 polynomial for e^r, then a scale by 2^n built in the
 * exponent bits; within ~2 ulp of expf, inf where it overflows, NaN for NaN. Scalar expf
 * (a libm call an element) would bound these loops. */
static inline __m256 exp8(__m256 x) {
    /* expf overflows to inf past 88.72; below -87.3 the result is the smallest normal
     * instead of a denormal or 0, which no caller can tell apart (they add 1 to it, or sum
     * it with e^0 = 1). The clamps take x as their second operand so that a NaN passes
     * through (max/min return the second operand when either is NaN). */
    __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(88.72f), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY),
                            overflow);
}


/* silu_mul_rounded for eight lanes. */
static inline __m256 silu_mul_rounded8(__m256 g, __m256 u) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return round_bf16x8(_mm256_mul_ps(round_bf16x8(silu), u));
}

/* Functions one AVX2 file defines and another calls. Hidden: they link the files together
 * and stay out of the library's exported symbols (the ABI is the pw_ functions that
 * kernels.py binds). */
#define PW_INTERNAL __attribute__((visibility("hidden")))

/* linear_avx2.c */
PW_INTERNAL void pw_permute_row_any(const uint16_t *src, const float *srcf, float *dst, int K,
                                    int K16);
PW_INTERNAL void pw_tiles_share(const float *x, const void *w, const float *scale,
                                const uint16_t *bias, uint16_t *y, float *yf, int M, int N,
                                int K);
PW_INTERNAL void pw_proj_share(const float *x, int M, const void *w, const float *scale, int K,
                               int N, float *res);
/* elementwise_avx2.c */
PW_INTERNAL void pw_add_norm_row(uint16_t *h, const uint16_t *delta, const uint16_t *w, int dim,
                                 float eps, uint16_t *out_bf16, float *out_f32);
PW_INTERNAL void pw_rope_row(uint16_t *row, const float *c, const float *sn, int n_heads,
                             int hd);
/* attention_avx2.c */
PW_INTERNAL int pw_group_parts(int B, int n_kv, int group, int nthreads);
PW_INTERNAL long pw_attention_task_floats(int group, int hd);
PW_INTERNAL int pw_window_start(long len, int window);
PW_INTERNAL void pw_attention_request(int task, int parts, int group, int n_heads, int n_kv,
                                      int hd, const uint16_t *q, long q_stride, float scale,
                                      const uint16_t *k_cache, const uint16_t *v_cache,
                                      const int64_t *block_tables, int max_blocks,
                                      const int64_t *seq_lens, int window, int bs, float *mine,
                                      uint16_t *out_bf16, float *out_f32);

/* Exported entry points that another AVX2 file calls too (elementwise_avx2.c's). */
void pw_enable_avx512_norm(int on);
void pw_add_rmsnorm_bf16(const uint16_t *delta, uint16_t *hidden, const uint16_t *w,
                         uint16_t *y, int rows, int dim, float eps, int nthreads);

#endif
