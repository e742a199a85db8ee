/*
 * phasewise CPU kernels: bf16-weight linear layers for x86-64 CPUs with AVX2 and FMA.
 *
 * Why hand-written: on CPUs without native bf16 dot products (no AVX512_BF16 / AMX),
 * torch's bf16 GEMM/GEMV runs far below this machine's limits (measured on a 2-core AVX2
 * EPYC: ~12 GB/s of weights at batch 1 against ~17 GB/s of read bandwidth, ~17 GFLOP/s at
 * batch >= 8 against ~80 GFLOP/s for fp32). Decode reads every weight once per step, so the
 * weight stream must run at memory speed. These kernels widen each bf16 weight to fp32 in
 * registers (a 16-bit shift) and accumulate in fp32, reading every weight exactly once per
 * call however many rows of activations there are.
 *
 * Layout: x [M, K] bf16 row-major, w [N, K] bf16 row-major (torch's Linear weight), optional
 * bias [N] bf16, y [M, N] bf16. Accumulation in fp32, one rounding (to nearest even) at the
 * end, as torch does.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 4 /* weight rows per micro-tile */
#define MR 4 /* activation rows per micro-tile (at most) */

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

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* out[i][j] = dot(x row i, w row j) for i < mr (x fp32, stride K), j < NR. */
#define DEFINE_TILE(R)                                                                      \
    static void tile_##R(const float *x, const uint16_t *w, int K, float out[MR][NR]) {    \
        __m256 acc[R][NR];                                                                  \
        for (int i = 0; i < R; i++)                                                         \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                   \
        int k = 0;                                                                          \
        for (; k + 8 <= K; k += 8) {                                                        \
            __m256 xv[R];                                                                   \
            for (int i = 0; i < R; i++) xv[i] = _mm256_loadu_ps(x + (long)i * K + k);       \
            for (int j = 0; j < NR; j++) {                                                  \
                __m256 wv = load_bf16x8(w + (long)j * K + k);                               \
                for (int i = 0; i < R; i++) acc[i][j] = _mm256_fmadd_ps(wv, xv[i], acc[i][j]); \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < R; i++)                                                         \
            for (int j = 0; j < NR; j++) {                                                  \
                float s = hsum8(acc[i][j]);                                                 \
                for (int kk = k; kk < K; kk++)                                              \
                    s += x[(long)i * K + kk] * bf16_to_f32(w[(long)j * K + kk]);            \
                out[i][j] = s;                                                              \
            }                                                                               \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)

static void tile_any(const float *x, const uint16_t *w, int K, int mr, int nr, float out[MR][NR]) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += x[(long)i * K + k] * bf16_to_f32(w[(long)j * K + k]);
            out[i][j] = s;
        }
}

/* y = x @ w^T (+ bias). Returns 0, or -1 if scratch memory could not be allocated. */
int pw_linear_bf16(const uint16_t *xb, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int M, int N, int K, int nthreads) {
    float *x = (float *)malloc(sizeof(float) * (size_t)M * (size_t)K);
    if (!x) return -1;
    for (long i = 0; i < (long)M * K; i++) x[i] = bf16_to_f32(xb[i]);
    int nblocks = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int b = 0; b < nblocks; b++) {
        int n0 = b * NR;
        int nr = N - n0 < NR ? N - n0 : NR;
        const uint16_t *wb = w + (long)n0 * K;
        for (int m0 = 0; m0 < M; m0 += MR) {
            int mr = M - m0 < MR ? M - m0 : MR;
            const float *xm = x + (long)m0 * K;
            float out[MR][NR];
            if (nr < NR) {
                tile_any(xm, wb, K, mr, nr, out);
            } else if (mr == 4) {
                tile_4(xm, wb, K, out);
            } else if (mr == 3) {
                tile_3(xm, wb, K, out);
            } else if (mr == 2) {
                tile_2(xm, wb, K, out);
            } else {
                tile_1(xm, wb, K, out);
            }
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    float v = out[i][j] + (bias ? bf16_to_f32(bias[n0 + j]) : 0.0f);
                    y[(long)(m0 + i) * N + n0 + j] = f32_to_bf16(v);
                }
        }
    }
    free(x);
    return 0;
}
