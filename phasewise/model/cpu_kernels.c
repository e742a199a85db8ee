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
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <math.h>

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

/* Row streaming for very few activation rows: one weight row at a time, read once, with a
 * software prefetch ahead of the stream (measured +15-35% weight bandwidth on a 2-core
 * Zen 3 against no prefetch and against the tiles below, at 1-4 rows). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 256
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif

static float row_dot1(const float *x, const uint16_t *wr, int K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(wr + k) + PREFETCH_BYTES, PREFETCH_HINT);
        a0 = _mm256_fmadd_ps(load_bf16x8(wr + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(load_bf16x8(wr + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(load_bf16x8(wr + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(load_bf16x8(wr + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load_bf16x8(wr + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; k++) s += x[k] * bf16_to_f32(wr[k]);
    return s;
}

#define DEFINE_ROWS(R)                                                                      \
    static void rows_##R(const float *x, const uint16_t *wr, int K, float *out) {          \
        __m256 a[R][2];                                                                     \
        for (int i = 0; i < R; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();                \
        int k = 0;                                                                          \
        for (; k + 16 <= K; k += 16) {                                                      \
            _mm_prefetch((const char *)(wr + k) + PREFETCH_BYTES, PREFETCH_HINT);             \
            __m256 w0 = load_bf16x8(wr + k), w1 = load_bf16x8(wr + k + 8);                  \
            for (int i = 0; i < R; i++) {                                                   \
                a[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (long)i * K + k), a[i][0]);     \
                a[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + (long)i * K + k + 8), a[i][1]); \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < R; i++) {                                                       \
            float s = hsum8(_mm256_add_ps(a[i][0], a[i][1]));                               \
            for (int kk = k; kk < K; kk++) s += x[(long)i * K + kk] * bf16_to_f32(wr[kk]);  \
            out[i] = s;                                                                     \
        }                                                                                   \
    }
DEFINE_ROWS(2)
DEFINE_ROWS(3)
DEFINE_ROWS(4)
DEFINE_ROWS(5)
DEFINE_ROWS(6)
#define ROW_STREAM_MAX 6 /* the most activation rows dot_rows (and the fused layer) take */

/* Two weight rows (w0, w1) against M <= 3 activation rows. Streaming rows that lie far apart
 * keeps independent memory streams in flight per core: on a 2-core Zen 3, two streams lifted
 * the weight stream from ~88% to ~100% of torch's large-tensor sum. */
static void pair_dot(const float *x, const uint16_t *w0, const uint16_t *w1, int K, int M,
                     float *o0, float *o1) {
    __m256 a[3][2], b[3][2];
    for (int m = 0; m < 3; m++) a[m][0] = a[m][1] = b[m][0] = b[m][1] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        _mm_prefetch((const char *)(w0 + k) + PREFETCH_BYTES, PREFETCH_HINT);
        _mm_prefetch((const char *)(w1 + k) + PREFETCH_BYTES, PREFETCH_HINT);
        __m256 u0 = load_bf16x8(w0 + k), u1 = load_bf16x8(w0 + k + 8);
        __m256 v0 = load_bf16x8(w1 + k), v1 = load_bf16x8(w1 + k + 8);
        for (int m = 0; m < M; m++) {
            __m256 x0 = _mm256_loadu_ps(x + (long)m * K + k);
            __m256 x1 = _mm256_loadu_ps(x + (long)m * K + k + 8);
            a[m][0] = _mm256_fmadd_ps(u0, x0, a[m][0]);
            a[m][1] = _mm256_fmadd_ps(u1, x1, a[m][1]);
            b[m][0] = _mm256_fmadd_ps(v0, x0, b[m][0]);
            b[m][1] = _mm256_fmadd_ps(v1, x1, b[m][1]);
        }
    }
    for (int m = 0; m < M; m++) {
        float s0 = hsum8(_mm256_add_ps(a[m][0], a[m][1]));
        float s1 = hsum8(_mm256_add_ps(b[m][0], b[m][1]));
        for (int kk = k; kk < K; kk++) {
            s0 += x[(long)m * K + kk] * bf16_to_f32(w0[kk]);
            s1 += x[(long)m * K + kk] * bf16_to_f32(w1[kk]);
        }
        o0[m] = s0;
        o1[m] = s1;
    }
}

/* out[m] = dot(x[m], w row) for m < M (M <= ROW_STREAM_MAX); x fp32 stride K. */
static inline void dot_rows(const float *x, const uint16_t *wr, int K, int M, float *out) {
    switch (M) {
        case 1: out[0] = row_dot1(x, wr, K); break;
        case 2: rows_2(x, wr, K, out); break;
        case 3: rows_3(x, wr, K, out); break;
        case 4: rows_4(x, wr, K, out); break;
        case 5: rows_5(x, wr, K, out); break;
        default: rows_6(x, wr, K, out);
    }
}

/* Four weight rows against M <= 2 activation rows: four memory streams in flight per core
 * (measured a further ~6% over two streams on the same machine). o[r][m]. */
static void quad_dot(const float *x, const uint16_t *const w[4], int K, int M, float o[4][2]) {
    __m256 a[4][2];
    for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int r = 0; r < 4; r++)
            _mm_prefetch((const char *)(w[r] + k) + PREFETCH_BYTES, PREFETCH_HINT);
        for (int kk = k; kk < k + 32; kk += 8) {
            __m256 x0 = _mm256_loadu_ps(x + kk);
            __m256 x1 = M > 1 ? _mm256_loadu_ps(x + K + kk) : x0;
            for (int r = 0; r < 4; r++) {
                __m256 wv = load_bf16x8(w[r] + kk);
                a[r][0] = _mm256_fmadd_ps(wv, x0, a[r][0]);
                if (M > 1) a[r][1] = _mm256_fmadd_ps(wv, x1, a[r][1]);
            }
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 x0 = _mm256_loadu_ps(x + k);
        __m256 x1 = M > 1 ? _mm256_loadu_ps(x + K + k) : x0;
        for (int r = 0; r < 4; r++) {
            __m256 wv = load_bf16x8(w[r] + k);
            a[r][0] = _mm256_fmadd_ps(wv, x0, a[r][0]);
            if (M > 1) a[r][1] = _mm256_fmadd_ps(wv, x1, a[r][1]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < M; m++) {
            float sum = hsum8(a[r][m]);
            for (int kk = k; kk < K; kk++) sum += x[(long)m * K + kk] * bf16_to_f32(w[r][kk]);
            o[r][m] = sum;
        }
}

/* Called by every thread of a parallel region: res[m * N + n] = dot(x[m], w[n]) for this
 * thread's contiguous share of the N weight rows. No barrier at the end. */
static void gemv_share(const float *x, int M, const uint16_t *w, int K, int N, float *res) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int lo = (int)((long)N * t / T), hi = (int)((long)N * (t + 1) / T);
    int n = lo;
    if (M <= 2) {
        int q = (hi - lo) / 4;
        for (int i = 0; i < q; i++) {
            const uint16_t *rows[4];
            float o[4][2];
            for (int r = 0; r < 4; r++) rows[r] = w + (long)(lo + r * q + i) * K;
            quad_dot(x, rows, K, M, o);
            for (int r = 0; r < 4; r++)
                for (int m = 0; m < M; m++) res[(long)m * N + lo + r * q + i] = o[r][m];
        }
        n = lo + 4 * q;
    } else if (M <= 3) {
        int half = (hi - lo) / 2;
        for (int i = 0; i < half; i++) {
            int n0 = lo + i, n1 = lo + half + i;
            float o0[3], o1[3];
            pair_dot(x, w + (long)n0 * K, w + (long)n1 * K, K, M, o0, o1);
            for (int m = 0; m < M; m++) {
                res[(long)m * N + n0] = o0[m];
                res[(long)m * N + n1] = o1[m];
            }
        }
        n = lo + 2 * half;
    }
    for (; n < hi; n++) {
        float o[ROW_STREAM_MAX];
        dot_rows(x, w + (long)n * K, K, M, o);
        for (int m = 0; m < M; m++) res[(long)m * N + n] = o[m];
    }
}

static int linear_rows(const float *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int M, int N, int K, int nthreads) {
    float *res = (float *)malloc(sizeof(float) * (size_t)M * N);
    if (!res) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        gemv_share(x, M, w, K, N, res);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            float b = bias ? bf16_to_f32(bias[n]) : 0.0f;
            for (int m = 0; m < M; m++) y[(long)m * N + n] = f32_to_bf16(res[(long)m * N + n] + b);
        }
    }
    free(res);
    return 0;
}

/* y = x @ w^T (+ bias). Returns 0, or -1 if scratch memory could not be allocated. */
int pw_linear_bf16(const uint16_t *xb, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int M, int N, int K, int nthreads) {
    float *x = (float *)malloc(sizeof(float) * (size_t)M * (size_t)K);
    if (!x) return -1;
    for (long i = 0; i < (long)M * K; i++) x[i] = bf16_to_f32(xb[i]);
    if (M <= ROW_STREAM_MAX) {
        int rc = linear_rows(x, w, bias, y, M, N, K, nthreads);
        free(x);
        return rc;
    }
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


/* ---------------------------------------------------------------------------------------
 * Many activation rows (prefill): a packed, cache-blocked GEMM.
 *
 * Weights are widened to fp32 while being packed into 16-column panels, activations into
 * 6-row panels; a 6x16 register tile (12 accumulators) runs the FMAs. Blocking: NC weight
 * rows x KC of K are packed once and reused by every activation panel; the fp32 result block
 * (M x NC) stays in a per-thread buffer across the K blocks and is rounded to bf16 at the end.
 * Threads split the weight rows (N).
 */
#define GMR 6
#define GNR 16
#define GKC 256
#define GMC 96
#define GNC 256

/* Pack rows [r0, r0 + rows) of a bf16 matrix (row stride K), columns [k0, k0 + kc), into
 * fp32 panels of `width` rows laid out dst[p][k][width]; rows at or past r_end are zero.
 * Weights are packed 16 wide (GNR), activations 6 wide (GMR). */
static void pack_panels(const uint16_t *src, int K, int r0, int rows, int r_end, int k0, int kc,
                        int width, float *dst) {
    for (int p = 0; p < rows; p += width) {
        float *panel = dst + (long)p * kc;
        for (int j = 0; j < width; j++) {
            int r = r0 + p + j;
            if (r < r_end) {
                const uint16_t *row = src + (long)r * K + k0;
                for (int k = 0; k < kc; k++) panel[k * width + j] = bf16_to_f32(row[k]);
            } else {
                for (int k = 0; k < kc; k++) panel[k * width + j] = 0.0f;
            }
        }
    }
}

/* c[6][ldc] (+)= a-panel x b-panel over kc */
static void micro_6x16(int kc, const float *a, const float *b, float *c, int ldc, int acc) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int k = 0; k < kc; k++) {
        __m256 b0 = _mm256_loadu_ps(b + k * GNR), b1 = _mm256_loadu_ps(b + k * GNR + 8);
        const float *ak = a + k * GMR;
        __m256 av = _mm256_broadcast_ss(ak + 0);
        c00 = _mm256_fmadd_ps(av, b0, c00); c01 = _mm256_fmadd_ps(av, b1, c01);
        av = _mm256_broadcast_ss(ak + 1);
        c10 = _mm256_fmadd_ps(av, b0, c10); c11 = _mm256_fmadd_ps(av, b1, c11);
        av = _mm256_broadcast_ss(ak + 2);
        c20 = _mm256_fmadd_ps(av, b0, c20); c21 = _mm256_fmadd_ps(av, b1, c21);
        av = _mm256_broadcast_ss(ak + 3);
        c30 = _mm256_fmadd_ps(av, b0, c30); c31 = _mm256_fmadd_ps(av, b1, c31);
        av = _mm256_broadcast_ss(ak + 4);
        c40 = _mm256_fmadd_ps(av, b0, c40); c41 = _mm256_fmadd_ps(av, b1, c41);
        av = _mm256_broadcast_ss(ak + 5);
        c50 = _mm256_fmadd_ps(av, b0, c50); c51 = _mm256_fmadd_ps(av, b1, c51);
    }
    __m256 r[GMR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int i = 0; i < GMR; i++) {
        float *ci = c + (long)i * ldc;
        if (acc) {
            r[i][0] = _mm256_add_ps(r[i][0], _mm256_loadu_ps(ci));
            r[i][1] = _mm256_add_ps(r[i][1], _mm256_loadu_ps(ci + 8));
        }
        _mm256_storeu_ps(ci, r[i][0]);
        _mm256_storeu_ps(ci + 8, r[i][1]);
    }
}

/* y = x @ w^T (+ bias) for many rows of x. Same contract as pw_linear_bf16. */
int pw_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int M, int N, int K, int nthreads) {
    int n_panels = (N + GNR - 1) / GNR;
    int m_pad = (M + GMR - 1) / GMR * GMR;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int p_lo = (int)((long)n_panels * t / nt), p_hi = (int)((long)n_panels * (t + 1) / nt);
        int n_lo = p_lo * GNR, n_hi = p_hi * GNR < N ? p_hi * GNR : N;
        float *bp = (float *)malloc(sizeof(float) * GNC * GKC);
        float *ap = (float *)malloc(sizeof(float) * GMC * GKC);
        float *cb = (float *)malloc(sizeof(float) * (size_t)m_pad * GNC);
        if (!bp || !ap || !cb) {
            failed = 1;
        } else {
            for (int jc = n_lo; jc < n_hi; jc += GNC) {
                int nc = n_hi - jc < GNC ? n_hi - jc : GNC;
                int nc_pad = (nc + GNR - 1) / GNR * GNR;
                for (int pc = 0; pc < K; pc += GKC) {
                    int kc = K - pc < GKC ? K - pc : GKC;
                    pack_panels(w, K, jc, nc_pad, jc + nc, pc, kc, GNR, bp);
                    for (int ic = 0; ic < M; ic += GMC) {
                        int mc = M - ic < GMC ? M - ic : GMC;
                        int mc_pad = (mc + GMR - 1) / GMR * GMR;
                        pack_panels(x, K, ic, mc_pad, M, pc, kc, GMR, ap);
                        for (int jr = 0; jr < nc_pad; jr += GNR)
                            for (int ir = 0; ir < mc_pad; ir += GMR)
                                micro_6x16(kc, ap + (long)ir * kc, bp + (long)jr * kc,
                                           cb + (long)(ic + ir) * GNC + jr, GNC, pc > 0);
                    }
                }
                for (int m = 0; m < M; m++)
                    for (int j = 0; j < nc; j++) {
                        float v = cb[(long)m * GNC + j] + (bias ? bf16_to_f32(bias[jc + j]) : 0.0f);
                        y[(long)m * N + jc + j] = f32_to_bf16(v);
                    }
            }
        }
        free(bp);
        free(ap);
        free(cb);
    }
    return failed ? -1 : 0;
}


/* ---------------------------------------------------------------------------------------
 * Fused element-wise steps of a decoder layer (bf16 in and out, fp32 inside). Each replaces
 * several torch ops, whose per-op dispatch cost dominates at the few rows of a decode step.
 * Rounding follows the reference implementation's order where it rounds to bf16 in between.
 */

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* One row: if delta, h = bf16(h + delta) in place; then out[i] = bf16(w * bf16(h * rs)) with
 * rs = rsqrt(mean(h^2) + eps), written as bf16 (out_bf16) and/or fp32 (out_f32). */
static void add_norm_row(uint16_t *h, const uint16_t *delta, const uint16_t *w, int dim,
                         float eps, uint16_t *out_bf16, float *out_f32) {
    if (delta)
        for (int i = 0; i < dim; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(delta[i]));
    float ss = 0.0f;
    for (int i = 0; i < dim; i++) ss += bf16_to_f32(h[i]) * bf16_to_f32(h[i]);
    float rs = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = 0; i < dim; i++) {
        float v = round_bf16(round_bf16(bf16_to_f32(h[i]) * rs) * bf16_to_f32(w[i]));
        if (out_bf16) out_bf16[i] = f32_to_bf16(v);
        if (out_f32) out_f32[i] = v;
    }
}

/* bf16(bf16(silu(g)) * u) for bf16-valued g and u. */
static inline float silu_mul_rounded(float g, float u) {
    return round_bf16(round_bf16(g / (1.0f + expf(-g))) * u);
}

/* If delta: hidden = bf16(hidden + delta) (in place). Then
 * y = bf16(w * bf16(hidden * rsqrt(mean(hidden^2) + eps))). */
void pw_add_rmsnorm_bf16(const uint16_t *delta, uint16_t *hidden, const uint16_t *w,
                         uint16_t *y, int rows, int dim, float eps, int nthreads) {
#pragma omp parallel for num_threads(rows > 1 ? nthreads : 1) schedule(static)
    for (int r = 0; r < rows; r++)
        add_norm_row(hidden + (long)r * dim, delta ? delta + (long)r * dim : NULL, w, dim, eps,
                     y + (long)r * dim, NULL);
}

/* out[r][i] = bf16(bf16(silu(gate[r][i])) * up[r][i]) with gate_up[r] = [gate | up]. */
void pw_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter, int nthreads) {
#pragma omp parallel for num_threads(rows > 1 ? nthreads : 1) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (long)r * 2 * inter, *u = g + inter;
        for (int i = 0; i < inter; i++)
            out[(long)r * inter + i] = f32_to_bf16(silu_mul_rounded(bf16_to_f32(g[i]), bf16_to_f32(u[i])));
    }
}

/* Rotate heads in place: x row r (stride row_stride elements) holds n_heads heads of hd.
 * cos/sin: fp32 [rows][hd] (the table rows of each token's position). */
void pw_rope_bf16(uint16_t *x, long row_stride, const float *cos_t, const float *sin_t,
                  int rows, int n_heads, int hd) {
    int half = hd / 2;
    for (int r = 0; r < rows; r++) {
        const float *c = cos_t + (long)r * hd, *sn = sin_t + (long)r * hd;
        for (int h = 0; h < n_heads; h++) {
            uint16_t *v = x + (long)r * row_stride + (long)h * hd;
            for (int i = 0; i < half; i++) {
                float a = bf16_to_f32(v[i]), b = bf16_to_f32(v[i + half]);
                v[i] = f32_to_bf16(a * c[i] - b * sn[i]);
                v[i + half] = f32_to_bf16(b * c[i + half] + a * sn[i + half]);
            }
        }
    }
}

/* One query head (qf: fp32, already scaled) against one request's paged context of `len`
 * keys of KV head kvh: out = softmax(q . K^T) V, in fp32. `scores` holds `len` floats. */
static void attend_head(const float *qf, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int64_t *table, int len, int bs, int n_kv, int kvh, int hd,
                        float *scores, float *out) {
    float mx = -INFINITY;
    for (int t = 0; t < len; t++) {
        const uint16_t *kr = k_cache + ((table[t / bs] * bs + t % bs) * n_kv + kvh) * (long)hd;
        __m256 a = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= hd; i += 8) a = _mm256_fmadd_ps(load_bf16x8(kr + i), _mm256_loadu_ps(qf + i), a);
        float v = hsum8(a);
        for (; i < hd; i++) v += bf16_to_f32(kr[i]) * qf[i];
        scores[t] = v;
        if (v > mx) mx = v;
    }
    float den = 0.0f;
    for (int t = 0; t < len; t++) {
        scores[t] = expf(scores[t] - mx);
        den += scores[t];
    }
    for (int i = 0; i < hd; i++) out[i] = 0.0f;
    for (int t = 0; t < len; t++) {
        const uint16_t *vr = v_cache + ((table[t / bs] * bs + t % bs) * n_kv + kvh) * (long)hd;
        __m256 p = _mm256_set1_ps(scores[t]);
        int i = 0;
        for (; i + 8 <= hd; i += 8)
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(p, load_bf16x8(vr + i), _mm256_loadu_ps(out + i)));
        for (; i < hd; i++) out[i] += scores[t] * bf16_to_f32(vr[i]);
    }
    for (int i = 0; i < hd; i++) out[i] /= den;
}

/* Decode attention over the paged cache: one query token per request.
 * q: [B][n_heads][hd] with row stride q_stride; caches: [blocks][bs][n_kv][hd];
 * block_tables: [B][max_blocks] int64; seq_lens: [B] int64 (keys to attend, incl. the new one);
 * out: [B][n_heads][hd] contiguous. Softmax and sums in fp32. */
int pw_decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *block_tables,
                             int max_blocks, const int64_t *seq_lens, uint16_t *out, int B,
                             int n_heads, int n_kv, int hd, int bs, float scale, int nthreads) {
    int group = n_heads / n_kv;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic) reduction(| : failed)
    for (int task = 0; task < B * n_heads; task++) {
        int b = task / n_heads, h = task % n_heads;
        int len = (int)seq_lens[b];
        float *buf = (float *)malloc(sizeof(float) * ((size_t)len + 2 * (size_t)hd));
        if (!buf) { failed = 1; continue; }
        float *qf = buf + len, *acc = qf + hd;
        for (int i = 0; i < hd; i++) qf[i] = bf16_to_f32(q[(long)b * q_stride + (long)h * hd + i]) * scale;
        attend_head(qf, k_cache, v_cache, block_tables + (long)b * max_blocks, len, bs, n_kv,
                    h / group, hd, buf, acc);
        for (int i = 0; i < hd; i++) out[((long)b * n_heads + h) * hd + i] = f32_to_bf16(acc[i]);
        free(buf);
    }
    return failed ? -1 : 0;
}


/* ---------------------------------------------------------------------------------------
 * A whole decoder layer for a decode step (a few rows, each one request's next token), in
 * one call and one OpenMP region. At batch 1 a layer's weights take ~2 ms to stream; the
 * dozen torch/ctypes calls an unfused layer needs cost ~0.6 ms more, which this removes.
 * Rounding to bf16 happens at the same points as in the unfused path (and the reference):
 * after every projection, RoPE, attention, each residual add and the SiLU.
 */
typedef struct {
    int M, H, Q, KV, I, n_heads, n_kv, hd, bs, max_blocks, qk_norm, nthreads;
    float eps, scale;
    uint16_t *hidden;        /* [M][H] residual stream, updated in place */
    const uint16_t *delta;   /* [M][H] previous layer's MLP output, or NULL for the first layer */
    uint16_t *out;           /* [M][H] this layer's MLP output */
    const uint16_t *w_in_norm, *w_qkv, *b_qkv, *w_q_norm, *w_k_norm, *w_o, *b_o;
    const uint16_t *w_post_norm, *w_gate_up, *b_gate_up, *w_down, *b_down;
    uint16_t *k_cache, *v_cache; /* this layer's [blocks][bs][n_kv][hd] */
    const int64_t *slots;        /* [M] cache slot of each row's new token */
    const int64_t *block_tables; /* [M][max_blocks] */
    const int64_t *seq_lens;     /* [M] keys to attend, the new token included */
    const float *cos, *sin;      /* [M][hd] */
} DecodeLayer;

#define MAX_HEAD_DIM 512 /* the fused layer keeps one head's query and output on the stack */

/* The numbers cpu_kernels.py must agree with, read by it once when the library loads:
 * "row_stream_max", "max_head_dim", "sizeof DecodeLayer", or a DecodeLayer field's name
 * (its byte offset). -1 for anything else. Python's ctypes mirror of DecodeLayer is checked
 * against these, field by field, so the two layouts cannot drift apart unnoticed. */
long pw_abi(const char *what) {
    static const struct { const char *name; long value; } table[] = {
        {"row_stream_max", ROW_STREAM_MAX}, {"max_head_dim", MAX_HEAD_DIM},
        {"sizeof DecodeLayer", (long)sizeof(DecodeLayer)},
#define FIELD(f) {#f, (long)offsetof(DecodeLayer, f)}
        FIELD(M), FIELD(H), FIELD(Q), FIELD(KV), FIELD(I), FIELD(n_heads), FIELD(n_kv),
        FIELD(hd), FIELD(bs), FIELD(max_blocks), FIELD(qk_norm), FIELD(nthreads), FIELD(eps),
        FIELD(scale), FIELD(hidden), FIELD(delta), FIELD(out), FIELD(w_in_norm), FIELD(w_qkv),
        FIELD(b_qkv), FIELD(w_q_norm), FIELD(w_k_norm), FIELD(w_o), FIELD(b_o),
        FIELD(w_post_norm), FIELD(w_gate_up), FIELD(b_gate_up), FIELD(w_down), FIELD(b_down),
        FIELD(k_cache), FIELD(v_cache), FIELD(slots), FIELD(block_tables), FIELD(seq_lens),
        FIELD(cos), FIELD(sin),
#undef FIELD
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (strcmp(what, table[i].name) == 0) return table[i].value;
    return -1;
}

/* hidden = bf16(hidden + delta) if delta; xn = fp32 of bf16(w * bf16(norm(hidden))). */
static void add_norm_rows(uint16_t *hidden, const uint16_t *delta, const uint16_t *w,
                          float *xn, int M, int H, float eps) {
    for (int m = 0; m < M; m++)
        add_norm_row(hidden + (long)m * H, delta ? delta + (long)m * H : NULL, w, H, eps, NULL,
                     xn + (long)m * H);
}


static void head_norm(uint16_t *v, const uint16_t *w, int hd, float eps) {
    add_norm_row(v, NULL, w, hd, eps, v, NULL);  /* in place: every read precedes its write */
}

int pw_decode_layer_bf16(const DecodeLayer *L) {
    int M = L->M, H = L->H, Q = L->Q, KV = L->KV, I = L->I, hd = L->hd;
    int n_heads = L->n_heads, n_kv = L->n_kv, group = n_heads / n_kv, QKV = Q + 2 * KV;
    if (M < 1 || M > ROW_STREAM_MAX || hd > MAX_HEAD_DIM) return -2;
    long max_len = 0;
    for (int m = 0; m < M; m++) if (L->seq_lens[m] > max_len) max_len = L->seq_lens[m];
    int widest = QKV > 2 * I ? QKV : 2 * I;
    if (H > widest) widest = H;
    size_t n_floats = (size_t)M * H + (size_t)M * Q + (size_t)M * I + (size_t)M * n_heads * max_len
                      + (size_t)M * widest;
    float *buf = (float *)malloc(sizeof(float) * n_floats);
    uint16_t *qkv = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)M * QKV);
    uint16_t *o = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)M * H);
    if (!buf || !qkv || !o) { free(buf); free(qkv); free(o); return -1; }
    float *xn = buf, *attn = xn + (long)M * H, *act = attn + (long)M * Q;
    float *scores = act + (long)M * I;
    float *res = scores + (long)M * n_heads * max_len; /* [M][N] projection results */

#pragma omp parallel num_threads(L->nthreads)
    {
#pragma omp single
        add_norm_rows(L->hidden, L->delta, L->w_in_norm, xn, M, H, L->eps);

        gemv_share(xn, M, L->w_qkv, H, QKV, res);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int n = 0; n < QKV; n++) {
            float b = L->b_qkv ? bf16_to_f32(L->b_qkv[n]) : 0.0f;
            for (int m = 0; m < M; m++) qkv[(long)m * QKV + n] = f32_to_bf16(res[(long)m * QKV + n] + b);
        }

#pragma omp single
        for (int m = 0; m < M; m++) {
            uint16_t *row = qkv + (long)m * QKV;
            if (L->qk_norm) {
                for (int h = 0; h < n_heads; h++) head_norm(row + (long)h * hd, L->w_q_norm, hd, L->eps);
                for (int h = 0; h < n_kv; h++) head_norm(row + Q + (long)h * hd, L->w_k_norm, hd, L->eps);
            }
            pw_rope_bf16(row, QKV, L->cos + (long)m * hd, L->sin + (long)m * hd, 1, n_heads + n_kv, hd);
            long slot = L->slots[m];
            memcpy(L->k_cache + slot * KV, row + Q, sizeof(uint16_t) * KV);
            memcpy(L->v_cache + slot * KV, row + Q + KV, sizeof(uint16_t) * KV);
        }

#pragma omp for schedule(dynamic)
        for (int task = 0; task < M * n_heads; task++) {
            int m = task / n_heads, h = task % n_heads;
            const uint16_t *qh = qkv + (long)m * QKV + (long)h * hd;
            float qf[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
            for (int i = 0; i < hd; i++) qf[i] = bf16_to_f32(qh[i]) * L->scale;
            attend_head(qf, L->k_cache, L->v_cache, L->block_tables + (long)m * L->max_blocks,
                        (int)L->seq_lens[m], L->bs, n_kv, h / group, hd,
                        scores + (long)task * max_len, acc);
            for (int i = 0; i < hd; i++) attn[(long)m * Q + (long)h * hd + i] = round_bf16(acc[i]);
        }

        gemv_share(attn, M, L->w_o, Q, H, res);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int n = 0; n < H; n++) {
            float b = L->b_o ? bf16_to_f32(L->b_o[n]) : 0.0f;
            for (int m = 0; m < M; m++) o[(long)m * H + n] = f32_to_bf16(res[(long)m * H + n] + b);
        }

#pragma omp single
        add_norm_rows(L->hidden, o, L->w_post_norm, xn, M, H, L->eps);

        gemv_share(xn, M, L->w_gate_up, H, 2 * I, res);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int i = 0; i < I; i++) {
            float bg = L->b_gate_up ? bf16_to_f32(L->b_gate_up[i]) : 0.0f;
            float bu = L->b_gate_up ? bf16_to_f32(L->b_gate_up[I + i]) : 0.0f;
            for (int m = 0; m < M; m++) {
                float gv = round_bf16(res[(long)m * 2 * I + i] + bg);
                float uv = round_bf16(res[(long)m * 2 * I + I + i] + bu);
                act[(long)m * I + i] = silu_mul_rounded(gv, uv);
            }
        }

        gemv_share(act, M, L->w_down, I, H, res);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int n = 0; n < H; n++) {
            float b = L->b_down ? bf16_to_f32(L->b_down[n]) : 0.0f;
            for (int m = 0; m < M; m++) L->out[(long)m * H + n] = f32_to_bf16(res[(long)m * H + n] + b);
        }
    }
    free(buf);
    free(qkv);
    free(o);
    return 0;
}


/* Read bandwidth probe: sums `n` bf16 words as fp32 with four streams per thread, the same
 * access pattern as the GEMV above. Returns the sum (so the reads cannot be optimized away). */
float pw_stream_read_bf16(const uint16_t *buf, long n, int nthreads) {
    float total = 0.0f;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        long lo = n * t / T / 128 * 128, hi = t == T - 1 ? n / 128 * 128 : n * (t + 1) / T / 128 * 128;
        long q = (hi - lo) / 4 / 32 * 32;
        __m256 a[4];
        for (int r = 0; r < 4; r++) a[r] = _mm256_setzero_ps();
        for (long i = 0; i < q; i += 32) {
            for (int r = 0; r < 4; r++) {
                const uint16_t *p = buf + lo + r * q + i;
                _mm_prefetch((const char *)p + PREFETCH_BYTES, PREFETCH_HINT);
                a[r] = _mm256_add_ps(a[r], _mm256_add_ps(_mm256_add_ps(load_bf16x8(p), load_bf16x8(p + 8)),
                                                         _mm256_add_ps(load_bf16x8(p + 16), load_bf16x8(p + 24))));
            }
        }
        total += hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    }
    return total;
}
