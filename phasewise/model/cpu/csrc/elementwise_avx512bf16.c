/*
 * phasewise CPU kernels for AVX512_BF16, element-wise steps on 16 lanes: SiLU-and-multiply
 * (a prompt's pass and the fused decode layer's), and the RMSNorm row that every norm of
 * elementwise_avx2.c takes once enabled. Each is its 8-lane AVX2 version step for step, so
 * every path gives the same bits. Compiled on AMX machines too (their norms run here).
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <math.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

#include "avx512_common.h"  /* exp16, exp16_fast, lazy_alpha, softmax_step: shared with the AMX files */
#include "paged_cache.h"   /* paged_row_offs: the paged cache's rows */

/* ---------------------------------------------------------------------------------------
 * SiLU-and-multiply of a prompt's gate/up projection on 16 lanes: elementwise_avx2.c's
 * pw_silu_mul_bf16 (exp8, here avx512_common.h's exp16; the division, the two roundings; its
 * scalar tail past the last 8) step for step, so the same bits (the fused decode layer
 * computes it with the 8-lane version; the two paths must agree). 16 lanes: a prompt's
 * pass is long enough for the width to matter. */
void pw_silu_mul_avx512bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter,
                    int nthreads) {
#pragma omp parallel for num_threads(rows > 1 ? nthreads : 1) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (long)r * 2 * inter, *u = g + inter;
        int vec = inter / 8 * 8;  /* the 8-lane version's vectors; its tail is scalar */
        for (int i = 0; i < vec; i += 16) {
            __mmask16 m = vec - i >= 16 ? 0xffff : 0xff;
            __m512i a = avx512bf16_silu_mul16(avx512bf16_load_bf16x16(g + i, m), avx512bf16_load_bf16x16(u + i, m));
            __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(a, 16));
            _mm256_mask_storeu_epi16(out + (long)r * inter + i, m, h);
        }
        for (int i = vec; i < inter; i++) {  /* silu_mul_rounded of avx2_common.h */
            float gv = avx512bf16_bf16_to_f32(g[i]), uv = avx512bf16_bf16_to_f32(u[i]);
            float silu = avx512bf16_bf16_to_f32(avx512bf16_f32_to_bf16(gv / (1.0f + expf(-gv))));
            out[(long)r * inter + i] = avx512bf16_f32_to_bf16(silu * uv);
        }
    }
}

/* The fused decode layer's SiLU pass on 16 lanes (its proj_mode PW_PROJ_AVX512BF16): act[m][i] =
 * bf16(bf16(silu(g)) * u), g = bf16(res[m][i] + bias[i]), u = bf16(res[m][I + i] + bias[I +
 * i]), as fp32; the 8-lane loop of fused_layer.c step for step (its vectors of 8, its scalar
 * tail past the last 8), so the same bits. Rows and 16-wide groups shared by the threads of
 * the calling region (an orphaned omp for, with its barrier). */
void pw_avx512bf16_glu_rows(const float *res, const uint16_t *bias, int M, int I, float *act) {
    int vec = I / 8 * 8, groups = (I + 15) / 16;
#pragma omp for collapse(2) schedule(static)
    for (int m = 0; m < M; m++)
        for (int q = 0; q < groups; q++) {
            int i = 16 * q;
            const float *gr = res + (long)m * 2 * I, *ur = gr + I;
            float *ar = act + (long)m * I;
            if (i < vec) {
                __mmask16 k = vec - i >= 16 ? 0xffff : 0xff;
                __m512 bg = bias ? avx512bf16_load_bf16x16(bias + i, k) : _mm512_setzero_ps();
                __m512 bu = bias ? avx512bf16_load_bf16x16(bias + I + i, k) : _mm512_setzero_ps();
                __m512 gv = _mm512_castsi512_ps(avx512bf16_bf16_bits16(
                    _mm512_add_ps(_mm512_maskz_loadu_ps(k, gr + i), bg)));
                __m512 uv = _mm512_castsi512_ps(avx512bf16_bf16_bits16(
                    _mm512_add_ps(_mm512_maskz_loadu_ps(k, ur + i), bu)));
                _mm512_mask_storeu_ps(ar + i, k, _mm512_castsi512_ps(avx512bf16_silu_mul16(gv, uv)));
            }
            for (int j = i > vec ? i : vec; j < i + 16 && j < I; j++) {  /* the scalar tail */
                float bg = bias ? avx512bf16_bf16_to_f32(bias[j]) : 0.0f;
                float bu = bias ? avx512bf16_bf16_to_f32(bias[I + j]) : 0.0f;
                float gv = avx512bf16_bf16_to_f32(avx512bf16_f32_to_bf16(gr[j] + bg));
                float uv = avx512bf16_bf16_to_f32(avx512bf16_f32_to_bf16(ur[j] + bu));
                float sl = avx512bf16_bf16_to_f32(avx512bf16_f32_to_bf16(gv / (1.0f + expf(-gv))));
                ar[j] = avx512bf16_bf16_to_f32(avx512bf16_f32_to_bf16(sl * uv));
            }
        }
}

/* pw_add_norm_row of elementwise_avx2.c with AVX-512 (bf16 rounding in one instruction, sixteen
 * lanes): if delta, h = bf16(h + delta) in place; out = bf16(w * bf16(h * rs)), rs =
 * rsqrt(mean(h^2) + eps), as bf16 (out_bf16) and/or fp32 (out_f32); out_bf16 may be h.
 * elementwise_avx2.c routes every RMSNorm here once enabled (pw_enable_avx512_norm: on every
 * CPU with AVX512_BF16, AMX or not), so all paths round alike. Here, not in the AMX files, so
 * that CPUs without AMX take it too: twice the lanes of the 8-lane norm,
 * and the rounding in one instruction instead of integer steps. Its
 * VCVTNEPS2BF16 counts denormal inputs as zero, as the AMX machines' norms always did. */
void pw_norm_row_avx512(uint16_t *h, const uint16_t *delta, const uint16_t *w, int dim,
                        float eps, uint16_t *out_bf16, float *out_f32) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < dim; i += 16) {
        __mmask16 m = dim - i >= 16 ? 0xffff : (__mmask16)((1u << (dim - i)) - 1u);
        __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, h + i)), 16));
        if (delta) {
            __m512 d = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, delta + i)), 16));
            __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(v, d));
            _mm256_mask_storeu_epi16(h + i, m, r);
            v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
        }
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float rs = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps);
    __m512 rsv = _mm512_set1_ps(rs);
    for (int i = 0; i < dim; i += 16) {
        __mmask16 m = dim - i >= 16 ? 0xffff : (__mmask16)((1u << (dim - i)) - 1u);
        __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, h + i)), 16));
        __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w + i)), 16));
        __m512 o = _mm512_mul_ps(round_bf16x16(_mm512_mul_ps(v, rsv)), wv);
        __m256i r = (__m256i)_mm512_cvtneps_pbh(o);
        if (out_bf16) _mm256_mask_storeu_epi16(out_bf16 + i, m, r);
        if (out_f32)
            _mm512_mask_storeu_ps(out_f32 + i, m, _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
    }
}

#pragma GCC pop_options
