/* ---------------------------------------------------------------------------------------
 * Fused element-wise steps of a decoder layer (bf16 in and out, fp32 inside). Each replaces
 * several torch ops, whose per-op dispatch cost dominates at the few rows of a decode step.
 * Rounding follows the reference implementation's order where it rounds to bf16 in between.
 */

#include "avx2_common.h"

/* elementwise_avx512bf16.c's AVX-512 RMSNorm row (weak: absent when that file is not
 * compiled in, then every CPU takes the 8-lane norm below, AMX ones too: a compiler that
 * builds the AMX files builds the AVX512_BF16 ones as well), used by every norm below once pw_enable_avx512_norm says the
 * CPU has AVX512_BF16. */
void pw_norm_row_avx512(uint16_t *h, const uint16_t *delta, const uint16_t *w, int dim,
                        float eps, uint16_t *out_bf16, float *out_f32) __attribute__((weak));
static int use_avx512_norm;
void pw_enable_avx512_norm(int on) { use_avx512_norm = on && pw_norm_row_avx512 != NULL; }

/* One row: if delta, h = bf16(h + delta) in place; then out[i] = bf16(w * bf16(h * rs)) with
 * rs = rsqrt(mean(h^2) + eps), written as bf16 (out_bf16) and/or fp32 (out_f32). Eight lanes
 * at a time (the sum of squares in eight partial sums, then their tree), the tail scalar. */
void pw_add_norm_row(uint16_t *h, const uint16_t *delta, const uint16_t *w, int dim,
                     float eps, uint16_t *out_bf16, float *out_f32) {
    if (use_avx512_norm) {
        pw_norm_row_avx512(h, delta, w, dim, eps, out_bf16, out_f32);
        return;
    }
    int d8 = dim / 8 * 8;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < d8; i += 8) {
        __m256 v = load_bf16x8(h + i);
        if (delta) {
            v = round_bf16x8(_mm256_add_ps(v, load_bf16x8(delta + i)));
            store_bf16x8(h + i, v);
        }
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (int i = d8; i < dim; i++) {
        if (delta) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(delta[i]));
        ss += bf16_to_f32(h[i]) * bf16_to_f32(h[i]);
    }
    float rs = 1.0f / sqrtf(ss / (float)dim + eps);
    __m256 rsv = _mm256_set1_ps(rs);
    for (int i = 0; i < d8; i += 8) {
        __m256 v = round_bf16x8(_mm256_mul_ps(round_bf16x8(_mm256_mul_ps(load_bf16x8(h + i), rsv)),
                                              load_bf16x8(w + i)));
        if (out_bf16) store_bf16x8(out_bf16 + i, v);
        if (out_f32) _mm256_storeu_ps(out_f32 + i, v);
    }
    for (int i = d8; i < dim; i++) {
        float v = round_bf16(round_bf16(bf16_to_f32(h[i]) * rs) * bf16_to_f32(w[i]));
        if (out_bf16) out_bf16[i] = f32_to_bf16(v);
        if (out_f32) out_f32[i] = v;
    }
}

/* If delta: hidden = bf16(hidden + delta) (in place). Then
 * y = bf16(w * bf16(hidden * rsqrt(mean(hidden^2) + eps))). */
void pw_add_rmsnorm_bf16(const uint16_t *delta, uint16_t *hidden, const uint16_t *w,
                         uint16_t *y, int rows, int dim, float eps, int nthreads) {
#pragma omp parallel for num_threads(rows > 1 ? nthreads : 1) schedule(static)
    for (int r = 0; r < rows; r++)
        pw_add_norm_row(hidden + (long)r * dim, delta ? delta + (long)r * dim : NULL, w, dim, eps,
                     y + (long)r * dim, NULL);
}

/* out[r][i] = bf16(bf16(silu(gate[r][i])) * up[r][i]) with gate_up[r] = [gate | up]. */
void pw_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter, int nthreads) {
#pragma omp parallel for num_threads(rows > 1 ? nthreads : 1) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (long)r * 2 * inter, *u = g + inter;
        int i = 0;
        for (; i + 8 <= inter; i += 8)
            store_bf16x8(out + (long)r * inter + i,
                         silu_mul_rounded8(load_bf16x8(g + i), load_bf16x8(u + i)));
        for (; i < inter; i++)
            out[(long)r * inter + i] = f32_to_bf16(silu_mul_rounded(bf16_to_f32(g[i]), bf16_to_f32(u[i])));
    }
}

/* RoPE on one row's n_heads heads of hd (in place), with that row's cos/sin. Eight pairs at
 * a time when hd / 2 is a multiple of 8. */
void pw_rope_row(uint16_t *row, const float *c, const float *sn, int n_heads, int hd) {
    int half = hd / 2, h8 = half % 8 == 0 ? half : 0;
    for (int h = 0; h < n_heads; h++) {
        uint16_t *v = row + (long)h * hd;
        for (int i = 0; i < h8; i += 8) {
            __m256 a = load_bf16x8(v + i), b = load_bf16x8(v + i + half);
            __m256 ra = _mm256_fmsub_ps(a, _mm256_loadu_ps(c + i),
                                        _mm256_mul_ps(b, _mm256_loadu_ps(sn + i)));
            __m256 rb = _mm256_fmadd_ps(b, _mm256_loadu_ps(c + i + half),
                                        _mm256_mul_ps(a, _mm256_loadu_ps(sn + i + half)));
            store_bf16x8(v + i, ra);
            store_bf16x8(v + i + half, rb);
        }
        for (int i = h8; i < half; i++) {
            float a = bf16_to_f32(v[i]), b = bf16_to_f32(v[i + half]);
            v[i] = f32_to_bf16(a * c[i] - b * sn[i]);
            v[i + half] = f32_to_bf16(b * c[i + half] + a * sn[i + half]);
        }
    }
}

/* Rotate heads in place: x row r (stride row_stride elements) holds n_heads heads of hd.
 * cos/sin: fp32 [rows][hd] (the table rows of each token's position). */
void pw_rope_bf16(uint16_t *x, long row_stride, const float *cos_t, const float *sin_t,
                  int rows, int n_heads, int hd, int nthreads) {
#pragma omp parallel for num_threads(rows >= 16 ? nthreads : 1) schedule(static)
    for (int r = 0; r < rows; r++)
        pw_rope_row(x + (long)r * row_stride, cos_t + (long)r * hd, sin_t + (long)r * hd, n_heads,
                 hd);
}
