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
#include <float.h>

#include "cpu_paged.h"  /* paged_row_offs: the paged cache's rows */

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

/* Row streaming for very few activation rows: one weight row at a time, read once, with a
 * software prefetch ahead of the stream (measured +15-35% weight bandwidth on a 2-core
 * Zen 3 against no prefetch and against the tiles below, at 1-4 rows). */
/* How far ahead (bytes) the bf16 streams prefetch: set at load by pw_set_stream_prefetch
 * for the CPU at hand (the kernel plan says which distance: phasewise/model/cpu/plan.py). */
static long stream_prefetch = 256;
void pw_set_stream_prefetch(int bytes) {
    stream_prefetch = bytes < 0 ? 0 : bytes > 16384 ? 16384 : bytes / 64 * 64;
}
int pw_stream_prefetch(void) { return (int)stream_prefetch; }
#define PREFETCH_BYTES stream_prefetch
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
#define AMX_LAYER_MAX 32 /* the most rows the fused layer takes with its projections on AMX */
#define INT8_ROWS_MAX ROW_STREAM_MAX /* the most activation rows the int8 streams take */
#ifndef INT8_TILE_ROWS_MAX
#define INT8_TILE_ROWS_MAX 128 /* int8 tiles up to this many rows, the packed GEMM above */
#endif

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

/* Where stream r (of R, each walking its own block of q weight rows of row_bytes) starts in
 * its block, walking to the block's end and on from its start: the row that puts the R
 * streams' addresses evenly over a 4 KiB page. Blocks of equal rows often lie a multiple of
 * 4 KiB apart (1,216 rows of 1,792 bytes, the reference checkpoint's gate/up share), and
 * streams whose addresses agree below 4 KiB read ~4-5% slower (2-core AMX Xeon: 29.0 ->
 * 30.2 GB/s over every projection at one row; the same in the bandwidth probe). Each row's
 * dot product is unchanged, so the results keep their bits. */
static int stream_skew(int r, int R, int q, long row_bytes) {
    if (r == 0 || q < 2) return 0;
    long want = 4096L * r / R, best_d = 4096;
    int best = 0, lim = q < 64 ? q : 64; /* rows of whole 64-byte lines repeat within 64 */
    for (int s = 0; s < lim; s++) {
        long d = labs((((long)r * q + s) * row_bytes) % 4096 - want);
        if (d > 2048) d = 4096 - d;
        if (d < best_d) {
            best_d = d;
            best = s;
        }
    }
    return best;
}

/* Called by every thread of a parallel region: res[m * N + n] = dot(x[m], w[n]) for this
 * thread's contiguous share of the N weight rows. No barrier at the end. */
static void gemv_share(const float *x, int M, const uint16_t *w, int K, int N, float *res) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int lo = (int)((long)N * t / T), hi = (int)((long)N * (t + 1) / T);
    int n = lo;
    if (M <= 2) {
        int q = (hi - lo) / 4, skew[4];
        for (int r = 0; r < 4; r++) skew[r] = stream_skew(r, 4, q, 2L * K);
        for (int i = 0; i < q; i++) {
            const uint16_t *rows[4];
            int n4[4];
            float o[4][2];
            for (int r = 0; r < 4; r++) {
                int j = i + skew[r];
                n4[r] = lo + r * q + (j < q ? j : j - q);
                rows[r] = w + (long)n4[r] * K;
            }
            quad_dot(x, rows, K, M, o);
            for (int r = 0; r < 4; r++)
                for (int m = 0; m < M; m++) res[(long)m * N + n4[r]] = o[r][m];
        }
        n = lo + 4 * q;
    } else if (M <= 3) {
        int half = (hi - lo) / 2, skew = stream_skew(1, 2, half, 2L * K);
        for (int i = 0; i < half; i++) {
            int j = i + skew, n0 = lo + i, n1 = lo + half + (j < half ? j : j - half);
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

static void proj_share(const float *x, int M, const void *w, const float *scale, int K, int N,
                       float *res);

/* The few-rows linear layer: every thread streams its share of the weights (bf16, or int8
 * with `scale`), then the bias and the rounding. */
static int linear_rows(const float *x, const void *w, const float *scale, const uint16_t *bias,
                       uint16_t *y, int M, int N, int K, int nthreads) {
    float *res = (float *)malloc(sizeof(float) * (size_t)M * N);
    if (!res) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        proj_share(x, M, w, scale, K, N, res);
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

/* ---------------------------------------------------------------------------------------
 * More than ROW_STREAM_MAX rows: register tiles of 2 activation rows x 6 weight rows.
 *
 * Each tile holds 12 accumulators (fp32 dot products along K); per 16 weights of a row, one
 * 32-byte load is widened by vpunpcklwd/vpunpckhwd against zero (a bf16 is the top half of
 * its fp32), which puts weights 0-3,8-11 and 4-7,12-15 in the two registers. The activations
 * are converted to fp32 once per call in that same order (permute_row), so the weights need
 * no shuffle and no copy: they are read in torch's own [N, K] layout, never repacked.
 * Threads split the weight rows; each thread walks its tiles, and each tile meets every
 * activation row of a block (the block's fp32 rows stay in L2: XBLOCK_BYTES) before the next
 * tile starts, so a weight is read from memory once per block. While the first row pair runs
 * over a tile (every pair, for blocks of few rows), the next tile's rows are prefetched.
 * benchmarks/bench_linear.py times it against the other methods. The 2x6 tile is written in
 * assembly because gcc spilled accumulators of the intrinsic version.
 */
#define TILE_M 2
#define TILE_N 6
#define XBLOCK_BYTES (512L * 1024)
#define PREFETCH_EVERY_PASS_ROWS 16

/* The permuted fp32 copy of one activation row (K16: K rounded down to 16; the tail after it
 * keeps its order), from bf16 (src) or from fp32 (srcf: the fused decode layer's rows). */
static void permute_row_any(const uint16_t *src, const float *srcf, float *dst, int K, int K16) {
#define PW_PERM_AT(i) (srcf ? srcf[i] : bf16_to_f32(src[i]))
    for (int k = 0; k < K16; k += 16)
        for (int q = 0; q < 4; q++) {
            dst[k + q] = PW_PERM_AT(k + q);
            dst[k + 4 + q] = PW_PERM_AT(k + 8 + q);
            dst[k + 8 + q] = PW_PERM_AT(k + 4 + q);
            dst[k + 12 + q] = PW_PERM_AT(k + 12 + q);
        }
    for (int k = K16; k < K; k++) dst[k] = PW_PERM_AT(k);
#undef PW_PERM_AT
}
static void permute_row(const uint16_t *src, float *dst, int K, int K16) {
    permute_row_any(src, NULL, dst, K, K16);
}

/* The end of every tile: add the K tail, then either store the fp32 sum (yf: the fused
 * decode layer's results, whose bias and rounding come later, bias_round_rows: the same
 * bits) or add the bias, round and store (yij). acc holds 8 partial sums of x row i . w row
 * j. */
static inline void tile_store(__m256 acc, const float *xi, const uint16_t *wj, int K16, int K,
                              const uint16_t *bias_j, uint16_t *yij, float *yf) {
    float s = hsum8(acc);
    for (int k = K16; k < K; k++) s += xi[k] * bf16_to_f32(wj[k]);
    if (yf)
        *yf = s;
    else
        *yij = f32_to_bf16(s + (bias_j ? bf16_to_f32(*bias_j) : 0.0f));
}

/* Edge tiles (R <= TILE_M rows, C <= TILE_N weight rows), in intrinsics; the outputs as
 * tile_2x6's. */
#define DEFINE_EDGE(R, C)                                                                   \
static void edge_##R##_##C(const float *x, long ldx, const uint16_t *w, long ldw, int K16,   \
                           int K, uint16_t *y, float *yf, long ldy, const uint16_t *bias) { \
    __m256 acc[R][C];                                                                       \
    for (int i = 0; i < R; i++) for (int j = 0; j < C; j++) acc[i][j] = _mm256_setzero_ps(); \
    const __m256i z = _mm256_setzero_si256();                                               \
    for (int k = 0; k < K16; k += 16)                                                       \
        for (int j = 0; j < C; j++) {                                                       \
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + j * ldw + k));            \
            __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, wv));                  \
            __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, wv));                  \
            for (int i = 0; i < R; i++) {                                                   \
                acc[i][j] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + i * ldx + k), acc[i][j]); \
                acc[i][j] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + i * ldx + k + 8), acc[i][j]); \
            }                                                                               \
        }                                                                                   \
    for (int i = 0; i < R; i++)                                                             \
        for (int j = 0; j < C; j++)                                                         \
            tile_store(acc[i][j], x + i * ldx, w + j * ldw, K16, K, bias ? bias + j : NULL, \
                       y + i * ldy + j, yf ? yf + i * ldy + j : NULL);                      \
}
#define DEFINE_EDGES(R) DEFINE_EDGE(R, 1) DEFINE_EDGE(R, 2) DEFINE_EDGE(R, 3) DEFINE_EDGE(R, 4) \
    DEFINE_EDGE(R, 5) DEFINE_EDGE(R, 6)
DEFINE_EDGES(1)
DEFINE_EDGES(2)
typedef void (*edge_fn)(const float *, long, const uint16_t *, long, int, int, uint16_t *,
                        float *, long, const uint16_t *);
static const edge_fn EDGE[TILE_M][TILE_N] = {
    {edge_1_1, edge_1_2, edge_1_3, edge_1_4, edge_1_5, edge_1_6},
    {edge_2_1, edge_2_2, edge_2_3, edge_2_4, edge_2_5, edge_2_6}};

/* What both 2x6 tiles (bf16 and int8) share in assembly: zeroing the 12 accumulators
 * (ymm0-11), saving them to acc[12][8] (%[o]), and the registers they clobber. */
#define TILE_ZERO                                                                           \
    "vxorps %%ymm0, %%ymm0, %%ymm0\n\t" "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"                \
    "vxorps %%ymm2, %%ymm2, %%ymm2\n\t" "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"                \
    "vxorps %%ymm4, %%ymm4, %%ymm4\n\t" "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"                \
    "vxorps %%ymm6, %%ymm6, %%ymm6\n\t" "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"                \
    "vxorps %%ymm8, %%ymm8, %%ymm8\n\t" "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"                \
    "vxorps %%ymm10, %%ymm10, %%ymm10\n\t" "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
#define TILE_SAVE                                                                           \
    "vmovaps %%ymm0, 0(%[o])\n\t" "vmovaps %%ymm1, 32(%[o])\n\t"                          \
    "vmovaps %%ymm2, 64(%[o])\n\t" "vmovaps %%ymm3, 96(%[o])\n\t"                         \
    "vmovaps %%ymm4, 128(%[o])\n\t" "vmovaps %%ymm5, 160(%[o])\n\t"                       \
    "vmovaps %%ymm6, 192(%[o])\n\t" "vmovaps %%ymm7, 224(%[o])\n\t"                       \
    "vmovaps %%ymm8, 256(%[o])\n\t" "vmovaps %%ymm9, 288(%[o])\n\t"                       \
    "vmovaps %%ymm10, 320(%[o])\n\t" "vmovaps %%ymm11, 352(%[o])\n\t"
#define TILE_CLOBBERS                                                                       \
    "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",  \
    "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"

/* Half of 16 weights of each of the 6 rows against the 2 activation rows: ymm0-5 row 0,
 * ymm6-11 row 1, ymm12/13 the activations, ymm14 the widened weights, ymm15 zero. */
#define TILE_HALF(UNPACK, XOFF)                                                             \
    "vmovups " XOFF "(%[xp]), %%ymm12\n\t"                                                  \
    "vmovups " XOFF "(%[xp],%[lx],1), %%ymm13\n\t"                                          \
    UNPACK " (%[p0]), %%ymm15, %%ymm14\n\t"                                                 \
    "vfmadd231ps %%ymm14, %%ymm12, %%ymm0\n\t"                                              \
    "vfmadd231ps %%ymm14, %%ymm13, %%ymm6\n\t"                                              \
    UNPACK " (%[p0],%[lw],1), %%ymm15, %%ymm14\n\t"                                         \
    "vfmadd231ps %%ymm14, %%ymm12, %%ymm1\n\t"                                              \
    "vfmadd231ps %%ymm14, %%ymm13, %%ymm7\n\t"                                              \
    UNPACK " (%[p0],%[lw],2), %%ymm15, %%ymm14\n\t"                                         \
    "vfmadd231ps %%ymm14, %%ymm12, %%ymm2\n\t"                                              \
    "vfmadd231ps %%ymm14, %%ymm13, %%ymm8\n\t"                                              \
    UNPACK " (%[p3]), %%ymm15, %%ymm14\n\t"                                                 \
    "vfmadd231ps %%ymm14, %%ymm12, %%ymm3\n\t"                                              \
    "vfmadd231ps %%ymm14, %%ymm13, %%ymm9\n\t"                                              \
    UNPACK " (%[p3],%[lw],1), %%ymm15, %%ymm14\n\t"                                         \
    "vfmadd231ps %%ymm14, %%ymm12, %%ymm4\n\t"                                              \
    "vfmadd231ps %%ymm14, %%ymm13, %%ymm10\n\t"                                             \
    UNPACK " (%[p3],%[lw],2), %%ymm15, %%ymm14\n\t"                                         \
    "vfmadd231ps %%ymm14, %%ymm12, %%ymm5\n\t"                                              \
    "vfmadd231ps %%ymm14, %%ymm13, %%ymm11\n\t"
#define TILE_BODY16                                                                         \
    TILE_HALF("vpunpcklwd", "0") TILE_HALF("vpunpckhwd", "32")                              \
    "add $32, %[p0]\n\t" "add $32, %[p3]\n\t" "add $64, %[xp]\n\t"

/* The full 2x6 tile; pf: the next tile's first weight row to prefetch alongside, or NULL.
 * Its outputs: bf16 y (bias added, rounded), or where yf is given fp32 sums there (both
 * with row stride ldy). */
static void tile_2x6(const float *x, long ldx, const uint16_t *w, long ldw, int K16, int K,
                     uint16_t *y, float *yf, long ldy, const uint16_t *bias,
                     const uint16_t *pf) {
    float acc[TILE_M * TILE_N][8] __attribute__((aligned(32)));
    const uint16_t *p0 = w, *p3 = w + 3 * ldw;
    const float *xp = x;
    long lw = ldw * 2, lx = ldx * 4; /* bytes */
    long n32 = pf ? K16 / 32 : 0, n16 = (K16 - n32 * 32) / 16;
    const uint16_t *q0 = pf ? pf : w, *q3 = q0 + 3 * ldw;
    __asm__ volatile(
        TILE_ZERO
        "vpxor %%ymm15, %%ymm15, %%ymm15\n\t"
        "test %[n32], %[n32]\n\t"
        "jz 2f\n\t"
        "1:\n\t" /* 32 weights per row per pass, one prefetched line of each next row */
        "prefetcht0 (%[q0])\n\t" "prefetcht0 (%[q0],%[lw],1)\n\t" "prefetcht0 (%[q0],%[lw],2)\n\t"
        "prefetcht0 (%[q3])\n\t" "prefetcht0 (%[q3],%[lw],1)\n\t" "prefetcht0 (%[q3],%[lw],2)\n\t"
        TILE_BODY16 TILE_BODY16
        "add $64, %[q0]\n\t" "add $64, %[q3]\n\t"
        "dec %[n32]\n\t"
        "jnz 1b\n\t"
        "2:\n\t"
        "test %[n16], %[n16]\n\t"
        "jz 4f\n\t"
        "3:\n\t"
        TILE_BODY16
        "dec %[n16]\n\t"
        "jnz 3b\n\t"
        "4:\n\t"
        TILE_SAVE
        : [p0] "+r"(p0), [p3] "+r"(p3), [xp] "+r"(xp), [q0] "+r"(q0), [q3] "+r"(q3),
          [n32] "+r"(n32), [n16] "+r"(n16)
        : [lw] "r"(lw), [lx] "r"(lx), [o] "r"(acc)
        : TILE_CLOBBERS);
    for (int i = 0; i < TILE_M; i++)
        for (int j = 0; j < TILE_N; j++)
            tile_store(_mm256_load_ps(acc[i * TILE_N + j]), x + i * ldx, w + j * ldw, K16, K,
                       bias ? bias + j : NULL, y + i * ldy + j, yf ? yf + i * ldy + j : NULL);
}

typedef void (*tile_i8_fn)(const float *, long, const int8_t *, long, int, const float *,
                           uint16_t *, long, const uint16_t *, const int8_t *);
static void tile_i8_2x6(const float *x, long ldx, const int8_t *w, long ldw, int K,
                        const float *scale, uint16_t *y, long ldy, const uint16_t *bias,
                        const int8_t *pf);
static void edge_i8(int R, int C, const float *x, long ldx, const int8_t *w, long ldw, int K,
                    const float *scale, uint16_t *y, long ldy, const uint16_t *bias);

/* The tiles' share of one thread of a parallel region (no barrier): its contiguous range
 * of the N weight rows' tiles, over x's M fp32 rows (permuted by permute_row for bf16
 * weights; in order for int8 ones, with `scale`, whose tiles are tile_i8_2x6 and edge_i8,
 * below with the int8 kernels). Outputs as tile_2x6's: bf16 y with the bias, or (bf16
 * weights only) fp32 sums in yf, row stride N either way. Each tile meets every row of a
 * block (XBLOCK_BYTES of x) before the next tile starts. */
static void tiles_share(const float *x, const void *w, const float *scale, const uint16_t *bias,
                        uint16_t *y, float *yf, int M, int N, int K) {
    int K16 = K / 16 * 16;
    long block_rows = XBLOCK_BYTES / (4L * K) / TILE_M * TILE_M;
    if (block_rows < TILE_M) block_rows = TILE_M;
    int nblocks = (int)((M + block_rows - 1) / block_rows);
    int ntiles = (N + TILE_N - 1) / TILE_N;
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int lo = (int)((long)ntiles * t / T) * TILE_N;
    int hi = (int)((long)ntiles * (t + 1) / T) * TILE_N;
    if (hi > N) hi = N;
    for (int b = 0; b < nblocks; b++) {
        int m0 = (int)((long)M * b / nblocks), m1 = (int)((long)M * (b + 1) / nblocks);
        /* With few rows a tile's passes are short, and the next tile's prefetches from the
         * first pass alone did not arrive in time: every pass repeats them (prefetches of
         * lines on their way cost little). +15-28% at 8 rows, measured. */
        int few = m1 - m0 <= PREFETCH_EVERY_PASS_ROWS;
        for (int n = lo; n < hi; n += TILE_N) {
            int c = hi - n < TILE_N ? hi - n : TILE_N;
            const uint16_t *bn = bias ? bias + n : NULL;
            for (int m = m0; m < m1; m += TILE_M) {
                int r = m1 - m < TILE_M ? m1 - m : TILE_M;
                const float *xm = x + (long)m * K;
                uint16_t *ym = y ? y + (long)m * N + n : NULL;
                float *fm = yf ? yf + (long)m * N + n : NULL;
                int full = r == TILE_M && c == TILE_N;
                int prefetch = (m == m0 || few) && n + TILE_N < hi;
                if (scale) {
                    const int8_t *wn = (const int8_t *)w + (long)n * K;
                    if (full)
                        tile_i8_2x6(xm, K, wn, K, K, scale + n, ym, N, bn,
                                    prefetch ? wn + (long)TILE_N * K : NULL);
                    else
                        edge_i8(r, c, xm, K, wn, K, K, scale + n, ym, N, bn);
                    continue;
                }
                const uint16_t *wn = (const uint16_t *)w + (long)n * K;
                if (full)
                    tile_2x6(xm, K, wn, K, K16, K, ym, fm, N, bn,
                             prefetch ? wn + (long)TILE_N * K : NULL);
                else
                    EDGE[r - 1][c - 1](xm, K, wn, K, K16, K, ym, fm, N, bn);
            }
        }
    }
}

/* The tiles' driver, for bf16 weights, or (with `scale`) int8 ones (their activations keep
 * their order). */
static int linear_tiles(const uint16_t *xb, const void *w, const float *scale,
                        const uint16_t *bias, uint16_t *y, int M, int N, int K, int nthreads) {
    float *x = (float *)malloc(sizeof(float) * (size_t)M * K);
    if (!x) return -1;
    int K16 = K / 16 * 16;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            if (scale)
                for (int k = 0; k < K; k++) x[(long)m * K + k] = bf16_to_f32(xb[(long)m * K + k]);
            else
                permute_row(xb + (long)m * K, x + (long)m * K, K, K16);
        }
        /* the implicit barrier: every row is converted before any tile reads it */
        tiles_share(x, w, scale, bias, y, NULL, M, N, K);
    }
    free(x);
    return 0;
}

/* y = x @ w^T (+ bias). Returns 0, or -1 if scratch memory could not be allocated. */
int pw_linear_bf16(const uint16_t *xb, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int M, int N, int K, int nthreads) {
    if (M > ROW_STREAM_MAX) return linear_tiles(xb, w, NULL, bias, y, M, N, K, nthreads);
    float *x = (float *)malloc(sizeof(float) * (size_t)M * (size_t)K);
    if (!x) return -1;
    for (long i = 0; i < (long)M * K; i++) x[i] = bf16_to_f32(xb[i]);
    int rc = linear_rows(x, w, NULL, bias, y, M, N, K, nthreads);
    free(x);
    return rc;
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

/* Pack rows [r0, r0 + rows) of a matrix (row stride K), columns [k0, k0 + kc), into fp32
 * panels of `width` rows laid out dst[p][k][width]; rows at or past r_end are zero. The matrix
 * is bf16, or with `scale` int8 whose row r is worth scale[r] times its integers (weight-only
 * int8). Weights are packed 16 wide (GNR), activations 6 wide (GMR). */
static void pack_panels(const void *src, const float *scale, int K, int r0, int rows,
                        int r_end, int k0, int kc, int width, float *dst) {
    for (int p = 0; p < rows; p += width) {
        float *panel = dst + (long)p * kc;
        for (int j = 0; j < width; j++) {
            int r = r0 + p + j;
            if (r >= r_end) {
                for (int k = 0; k < kc; k++) panel[k * width + j] = 0.0f;
            } else if (scale) {
                const int8_t *row = (const int8_t *)src + (long)r * K + k0;
                float s = scale[r];
                for (int k = 0; k < kc; k++) panel[k * width + j] = s * (float)row[k];
            } else {
                const uint16_t *row = (const uint16_t *)src + (long)r * K + k0;
                for (int k = 0; k < kc; k++) panel[k * width + j] = bf16_to_f32(row[k]);
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

/* y = x @ w^T (+ bias) for many rows of x; w bf16, or int8 with its per-row scale. */
static int gemm(const uint16_t *x, const void *w, const float *scale, const uint16_t *bias,
                uint16_t *y, int M, int N, int K, int nthreads) {
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
                    pack_panels(w, scale, K, jc, nc_pad, jc + nc, pc, kc, GNR, bp);
                    for (int ic = 0; ic < M; ic += GMC) {
                        int mc = M - ic < GMC ? M - ic : GMC;
                        int mc_pad = (mc + GMR - 1) / GMR * GMR;
                        pack_panels(x, NULL, K, ic, mc_pad, M, pc, kc, GMR, ap);
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

/* y = x @ w^T (+ bias) for many rows of x. Same contract as pw_linear_bf16. */
int pw_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int M, int N, int K, int nthreads) {
    return gemm(x, w, NULL, bias, y, M, N, K, nthreads);
}


/* ---------------------------------------------------------------------------------------
 * Fused element-wise steps of a decoder layer (bf16 in and out, fp32 inside). Each replaces
 * several torch ops, whose per-op dispatch cost dominates at the few rows of a decode step.
 * Rounding follows the reference implementation's order where it rounds to bf16 in between.
 */

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline __m256 round_bf16x8(__m256 f);
static inline void store_bf16x8(uint16_t *p, __m256 f);

/* cpu_avx512bf16.c's AVX-512 RMSNorm row (weak: absent when that file is not compiled in,
 * then every CPU takes the 8-lane norm below, AMX ones too: a compiler that builds cpu_amx.c
 * builds that file as well), used by every norm below once pw_enable_avx512_norm says the
 * CPU has AVX512_BF16. */
void pw_norm_row_avx512(uint16_t *h, const uint16_t *delta, const uint16_t *w, int dim,
                        float eps, uint16_t *out_bf16, float *out_f32) __attribute__((weak));
static int use_avx512, use_avx512_norm;
void pw_enable_avx512_norm(int on) { use_avx512_norm = on && pw_norm_row_avx512 != NULL; }
/* AMX and AVX-512 BF16 (cpu_amx.c's decode attention), and the norms. */
void pw_enable_avx512(int on) {
    use_avx512 = on;
    pw_enable_avx512_norm(on);
}

/* One row: if delta, h = bf16(h + delta) in place; then out[i] = bf16(w * bf16(h * rs)) with
 * rs = rsqrt(mean(h^2) + eps), written as bf16 (out_bf16) and/or fp32 (out_f32). Eight lanes
 * at a time (the sum of squares in eight partial sums, then their tree), the tail scalar. */
static void add_norm_row(uint16_t *h, const uint16_t *delta, const uint16_t *w, int dim,
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

/* bf16(bf16(silu(g)) * u) for bf16-valued g and u. */
static inline float silu_mul_rounded(float g, float u) {
    return round_bf16(round_bf16(g / (1.0f + expf(-g))) * u);
}

/* Eight at a time: exp by range reduction to r in [-ln2/2, ln2/2] (x = n ln2 + r, ln2 split
 * in two for exactness) and a degree-6 polynomial for e^r, then a scale by 2^n built in the
 * exponent bits; within ~2 ulp of expf, inf where it overflows, NaN for NaN. Scalar expf in
 * these loops took ~15 ns per element. */
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

/* silu_mul_rounded for eight lanes. */
static inline __m256 silu_mul_rounded8(__m256 g, __m256 u) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return round_bf16x8(_mm256_mul_ps(round_bf16x8(silu), u));
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
static void rope_row(uint16_t *row, const float *c, const float *sn, int n_heads, int hd) {
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
        rope_row(x + (long)r * row_stride, cos_t + (long)r * hd, sin_t + (long)r * hd, n_heads,
                 hd);
}

/* Attention of G query heads that share one KV head (GQA) against one request's paged
 * context of `len` keys, flash-style: keys in chunks of ATT_CHUNK, each chunk's K and V rows
 * widened to fp32 once for all G heads, scores 8 keys at a time (8 dot products reduced
 * together by a horizontal-add tree instead of 8 separate horizontal sums), and an online
 * softmax (a running max and denominator per head) so the scratch does not grow with `len`.
 * q: [G][hd] fp32, already scaled; out: [G][hd] fp32. Scratch: att_scratch_floats(G, hd). */
#define ATT_CHUNK 64

static long att_scratch_floats(int G, int hd) {
    return 2L * ATT_CHUNK * hd + (long)G * ATT_CHUNK + 2L * G;
}

/* The 8 lanes' sums of a[0..7], in order: lane i = sum of a[i]. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                         _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

static inline float dot_f32(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void attend_group(const float *q, int G, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *table, int len, int bs, int n_kv, int kvh, int hd,
                         float *scratch, float *out) {
    float *kf = scratch, *vf = kf + (long)ATT_CHUNK * hd, *p = vf + (long)ATT_CHUNK * hd;
    float *mx = p + (long)G * ATT_CHUNK, *den = mx + G;
    int hd8 = hd / 8 * 8;
    for (int g = 0; g < G; g++) {
        mx[g] = -INFINITY;
        den[g] = 0.0f;
        for (int i = 0; i < hd; i++) out[(long)g * hd + i] = 0.0f;
    }
    for (int t0 = 0; t0 < len; t0 += ATT_CHUNK) {
        int n = len - t0 < ATT_CHUNK ? len - t0 : ATT_CHUNK;
        /* the chunk's rows counted (a division a key: x0.97-0.98 on cached keys, the 2-core
         * AVX512_BF16 EPYC running this kernel) */
        long offs[ATT_CHUNK];
        paged_row_offs(table, bs, n_kv, hd, kvh, t0, n, offs);
        for (int t = 0; t < n; t++) {
            long row = offs[t];
            const uint16_t *kr = k_cache + row, *vr = v_cache + row;
            float *kd = kf + (long)t * hd, *vd = vf + (long)t * hd;
            int i = 0;
            for (; i < hd8; i += 8) {
                _mm256_storeu_ps(kd + i, load_bf16x8(kr + i));
                _mm256_storeu_ps(vd + i, load_bf16x8(vr + i));
            }
            for (; i < hd; i++) {
                kd[i] = bf16_to_f32(kr[i]);
                vd[i] = bf16_to_f32(vr[i]);
            }
        }
        for (int g = 0; g < G; g++) {
            const float *qg = q + (long)g * hd;
            float *pg = p + (long)g * ATT_CHUNK;
            int t = 0;
            for (; t + 8 <= n; t += 8) {
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int i = 0; i < hd8; i += 8) {
                    __m256 qv = _mm256_loadu_ps(qg + i);
                    for (int j = 0; j < 8; j++)
                        acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf + (long)(t + j) * hd + i), acc[j]);
                }
                __m256 sc = hsum8x8(acc);
                if (hd8 < hd) {
                    float tail[8] __attribute__((aligned(32)));
                    for (int j = 0; j < 8; j++) {
                        tail[j] = 0.0f;
                        for (int i = hd8; i < hd; i++) tail[j] += qg[i] * kf[(long)(t + j) * hd + i];
                    }
                    sc = _mm256_add_ps(sc, _mm256_load_ps(tail));
                }
                _mm256_storeu_ps(pg + t, sc);
            }
            for (; t < n; t++) pg[t] = dot_f32(qg, kf + (long)t * hd, hd);
            float m_new = mx[g];
            for (t = 0; t < n; t++) if (pg[t] > m_new) m_new = pg[t];
            float rescale = mx[g] == -INFINITY ? 0.0f : expf(mx[g] - m_new);
            mx[g] = m_new;
            __m256 mv = _mm256_set1_ps(m_new), sum8 = _mm256_setzero_ps();
            float sum = 0.0f;
            for (t = 0; t + 8 <= n; t += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pg + t), mv));
                _mm256_storeu_ps(pg + t, e);
                sum8 = _mm256_add_ps(sum8, e);
            }
            for (; t < n; t++) {
                pg[t] = expf(pg[t] - m_new);
                sum += pg[t];
            }
            den[g] = den[g] * rescale + sum + hsum8(sum8);
            float *og = out + (long)g * hd;
            __m256 rv = _mm256_set1_ps(rescale);
            int i = 0;
            for (; i + 64 <= hd8; i += 64) { /* 8 accumulators of the output row at a time */
                __m256 o[8];
                for (int j = 0; j < 8; j++) o[j] = _mm256_mul_ps(rv, _mm256_loadu_ps(og + i + 8 * j));
                for (t = 0; t < n; t++) {
                    __m256 pt = _mm256_set1_ps(pg[t]);
                    const float *vt = vf + (long)t * hd + i;
                    for (int j = 0; j < 8; j++) o[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * j), o[j]);
                }
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(og + i + 8 * j, o[j]);
            }
            for (; i < hd8; i += 8) {
                __m256 o = _mm256_mul_ps(rv, _mm256_loadu_ps(og + i));
                for (t = 0; t < n; t++)
                    o = _mm256_fmadd_ps(_mm256_set1_ps(pg[t]), _mm256_loadu_ps(vf + (long)t * hd + i), o);
                _mm256_storeu_ps(og + i, o);
            }
            for (; i < hd; i++) {
                float o = og[i] * rescale;
                for (t = 0; t < n; t++) o += pg[t] * vf[(long)t * hd + i];
                og[i] = o;
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float inv = den[g] > 0.0f ? 1.0f / den[g] : 0.0f;
        for (int i = 0; i < hd; i++) out[(long)g * hd + i] *= inv;
    }
}

/* How many parts each KV head's query group is split into so that B * n_kv * parts
 * (request, KV head, part) passes over the keys keep every thread busy (at batch 1 with 2 KV
 * heads, 2 passes would leave threads idle), and B * parts tasks give each thread one. */
static int group_parts(int B, int n_kv, int group, int nthreads) {
    /* Fewer requests than threads, but a KV head for every thread: a task per (request, KV
     * head), 0 parts (attention_request). Each thread then reads its heads' rows of the
     * context alone: split by query heads instead, every thread read every KV head's rows.
     * Batch 1 of the reference checkpoint (2 KV heads, ~200 keys) on 2 threads: the 24
     * layers' attention 0.40 -> 0.26 ms a step (2-core AMD EPYC with AVX512_BF16, 20
     * alternating rounds in one process). */
    if (B < nthreads && B * n_kv >= nthreads) return 0;
    int tasks = B * n_kv, parts = 1;
    while (parts < group && tasks * parts < 2 * nthreads) parts++;
    /* a task covers every KV head of its request (attention_request): at least a task per
     * thread */
    while (parts < group && B * parts < nthreads) parts++;
    return parts;
}

/* Scratch floats one thread needs for attention_task: the group's queries and outputs, and
 * attend_group's. */
static long attention_task_floats(int group, int hd) {
    return 2L * group * hd + att_scratch_floats(group, hd);
}

/* cpu_amx.c's decode attention on AMX tiles (weak: absent when that file is not compiled
 * in), taken once pw_enable_avx512 has said the CPU has AMX and AVX-512 BF16. */
int pw_attend_group_amx(const uint16_t *q, int G, float scale, const uint16_t *k_cache,
                        const uint16_t *v_cache, const int64_t *table, int len, int bs,
                        int n_kv, int kvh, int hd, float *out) __attribute__((weak));
/* cpu_avx512bf16.c's, the same contract (weak: absent when that file is not compiled in),
 * taken once pw_enable_avx512bf16_attention has said the CPU has AVX512_BF16, where AMX's is not. */
int pw_attend_group_avx512bf16(const uint16_t *q, int G, float scale, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int64_t *table, int len, int bs,
                       int n_kv, int kvh, int hd, float *out) __attribute__((weak));
static int use_avx512bf16_attention = 0;
void pw_enable_avx512bf16_attention(int on) { use_avx512bf16_attention = on && pw_attend_group_avx512bf16 != NULL; }

/* Decode attention of request b, KV head kvh, and share `part` (of `parts`) of that head's
 * query group. q: rows of stride q_stride holding n_heads heads of hd (bf16);
 * `mine`: this thread's scratch (attention_task_floats(group, hd) floats).
 * Writes the heads' outputs at (b * n_heads + head) * hd: bf16 into out_bf16, or the
 * bf16-rounded fp32 value into out_f32. */
static void attention_task(int b, int kvh, int part, int parts, int group, int n_heads,
                           int n_kv, int hd, const uint16_t *q, long q_stride, float scale,
                           const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *block_tables, int max_blocks,
                           const int64_t *seq_lens, int bs, float *mine, uint16_t *out_bf16,
                           float *out_f32) {
    int g0 = group * part / parts, g1 = group * (part + 1) / parts, G = g1 - g0;
    float *qf = mine, *acc = qf + (long)group * hd, *work = acc + (long)group * hd;
    const uint16_t *qg = q + (long)b * q_stride + (long)(kvh * group + g0) * hd;
    int amx = use_avx512 && pw_attend_group_amx, done = amx || use_avx512bf16_attention;
    for (int g = 0; done && g < G; g += 16)  /* sixteen heads at a time */
        done = (amx ? pw_attend_group_amx : pw_attend_group_avx512bf16)(
                   qg + (long)g * hd, G - g < 16 ? G - g : 16, scale, k_cache, v_cache,
                   block_tables + (long)b * max_blocks, (int)seq_lens[b], bs, n_kv, kvh, hd,
                   acc + (long)g * hd) == 0;
    for (int g = 0; !done && g < G; g++) {
        const uint16_t *qh = q + (long)b * q_stride + (long)(kvh * group + g0 + g) * hd;
        for (int i = 0; i < hd; i++) qf[(long)g * hd + i] = bf16_to_f32(qh[i]) * scale;
    }
    if (!done)
        attend_group(qf, G, k_cache, v_cache, block_tables + (long)b * max_blocks,
                     (int)seq_lens[b], bs, n_kv, kvh, hd, work, acc);
    for (int g = 0; g < G; g++) {
        long o = ((long)b * n_heads + kvh * group + g0 + g) * hd;
        const float *a = acc + (long)g * hd;
        int i = 0;
        for (; i + 8 <= hd; i += 8) {  /* the scalar rounding below, eight lanes at a time */
            if (out_bf16) store_bf16x8(out_bf16 + o + i, _mm256_loadu_ps(a + i));
            else _mm256_storeu_ps(out_f32 + o + i, round_bf16x8(_mm256_loadu_ps(a + i)));
        }
        for (; i < hd; i++) {
            if (out_bf16) out_bf16[o + i] = f32_to_bf16(a[i]);
            else out_f32[o + i] = round_bf16(a[i]);
        }
    }
}

/* Task `task` of B * parts: request task / parts, share task % parts of every KV head's
 * query group, the KV heads one after another; or, with 0 parts (group_parts: fewer requests
 * than threads), task `task` of B * n_kv: request task / n_kv, KV head task % n_kv, its whole
 * group. One task per request rather than per (request,
 * KV head): a cache slot holds every KV head's row side by side ([bs][n_kv][hd]), so the
 * first head's pass brings the slots' lines, the next heads' rows beside, into the caches
 * (the hardware fetches neighbouring lines). On a 2-core AMX Xeon, batch 32 of the reference
 * checkpoint's shape (2 KV heads) at 160 keys: 24 layers' decode attention x1.19 against a
 * task per KV head, x1.17 with 32 MB read between the layers as the weights are in the
 * engine (paired in one process). */
static void attention_request(int task, int parts, int group, int n_heads, int n_kv, int hd,
                              const uint16_t *q, long q_stride, float scale,
                              const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *block_tables, int max_blocks,
                              const int64_t *seq_lens, int bs, float *mine,
                              uint16_t *out_bf16, float *out_f32) {
    if (parts == 0) {  /* task = request * n_kv + KV head, the head's whole group */
        attention_task(task / n_kv, task % n_kv, 0, 1, group, n_heads, n_kv, hd, q, q_stride,
                       scale, k_cache, v_cache, block_tables, max_blocks, seq_lens, bs, mine,
                       out_bf16, out_f32);
        return;
    }
    for (int kvh = 0; kvh < n_kv; kvh++)
        attention_task(task / parts, kvh, task % parts, parts, group, n_heads, n_kv, hd, q,
                       q_stride, scale, k_cache, v_cache, block_tables, max_blocks, seq_lens,
                       bs, mine, out_bf16, out_f32);
}

/* Decode attention over the paged cache: one query token per request.
 * q: [B][n_heads][hd] with row stride q_stride; caches: [blocks][bs][n_kv][hd];
 * block_tables: [B][max_blocks] int64; seq_lens: [B] int64 (keys to attend, incl. the new one);
 * out: [B][n_heads][hd] contiguous. Softmax and sums in fp32. */
int pw_decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *block_tables,
                             int max_blocks, const int64_t *seq_lens, uint16_t *out, int B,
                             int n_heads, int n_kv, int hd, int bs, float scale, int nthreads) {
    int group = n_heads / n_kv, parts = group_parts(B, n_kv, group, nthreads);
    int n_tasks = parts ? B * parts : B * n_kv;
    long per_task = attention_task_floats(group, hd);
    float *scratch = (float *)malloc(sizeof(float) * (size_t)per_task * nthreads);
    if (!scratch) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic)
    for (int task = 0; task < n_tasks; task++)
        attention_request(task, parts, group, n_heads, n_kv, hd, q, q_stride, scale, k_cache,
                          v_cache, block_tables, max_blocks, seq_lens, bs,
                          scratch + per_task * omp_get_thread_num(), out, NULL);
    free(scratch);
    return 0;
}


/* ---------------------------------------------------------------------------------------
 * Weight-only int8 (issue 15): w [N, K] int8 with one fp32 scale per output row (symmetric,
 * per output channel: w_real[n][k] = scale[n] * w[n][k]); activations stay bf16, accumulation
 * is fp32. For the few rows of a decode step: each weight byte is read once per call, widened
 * in registers (vpmovsxbd, vcvtdq2ps: 8 weights per 8-byte load) and met by every activation
 * row; each thread streams four weight rows at once (as quad_dot), so four memory streams are
 * in flight per core. The scale multiplies the finished dot product, once per output.
 */
/* Prefetch 1 KiB ahead in each stream: on a 2-core AMX Xeon, batch-1 int8 decode went from
 * 73% to 80% of its bandwidth roofline against 256 bytes ahead (benchmarks/bench_quant.py,
 * paired segments), while an AVX-512 version of the fixed-point kernel (half the
 * instructions per weight byte) gained nothing: the streams wait on memory, not on the
 * vector units. */
#ifndef INT8_PREFETCH_BYTES
#define INT8_PREFETCH_BYTES 1024
#endif
#ifndef INT8_PREFETCH_MASK
#define INT8_PREFETCH_MASK 31
#endif
static inline __m256 load_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The activation rows an int8 dot kernel reads: fp32 (x), or in 16-bit fixed point (xq,
 * with one scale per block of 32 in xs; see gemv_share_q16). */
typedef struct {
    const float *x;
    const int16_t *xq;
    const float *xs;
} I8Act;
typedef void (*dot_i8_fn)(const I8Act *, const int8_t *const *, int, float *);

/* o[r * M + m] = dot(x[m], w[r]) for R weight rows and M activation rows, both fixed at
 * compile time so that every accumulator stays in a register (R * M + R + 1 <= 16 ymm). */
#define DEFINE_DOT_I8(R, M)                                                                  \
    static void dot_i8_##R##x##M(const I8Act *act, const int8_t *const *w, int K, float *o) { \
        const float *x = act->x;                                                             \
        __m256 a[R * M];                                                                     \
        for (int i = 0; i < R * M; i++) a[i] = _mm256_setzero_ps();                          \
        int k = 0;                                                                           \
        for (; k + 8 <= K; k += 8) {                                                         \
            if ((k & INT8_PREFETCH_MASK) == 0)                                               \
                for (int r = 0; r < R; r++)                                                  \
                    _mm_prefetch((const char *)(w[r] + k) + INT8_PREFETCH_BYTES, PREFETCH_HINT); \
            __m256 wv[R];                                                                    \
            for (int r = 0; r < R; r++) wv[r] = load_i8x8(w[r] + k);                         \
            for (int m = 0; m < M; m++) {                                                    \
                __m256 xv = _mm256_loadu_ps(x + (long)m * K + k);                            \
                for (int r = 0; r < R; r++) a[r * M + m] = _mm256_fmadd_ps(wv[r], xv, a[r * M + m]); \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; r++)                                                          \
            for (int m = 0; m < M; m++) {                                                    \
                float s = hsum8(a[r * M + m]);                                               \
                for (int kk = k; kk < K; kk++) s += x[(long)m * K + kk] * (float)w[r][kk];   \
                o[r * M + m] = s;                                                            \
            }                                                                                \
    }
DEFINE_DOT_I8(4, 1)
DEFINE_DOT_I8(4, 2)
DEFINE_DOT_I8(2, 3)
DEFINE_DOT_I8(2, 4)
DEFINE_DOT_I8(2, 5)
DEFINE_DOT_I8(2, 6)
DEFINE_DOT_I8(1, 1)
DEFINE_DOT_I8(1, 2)
DEFINE_DOT_I8(1, 3)
DEFINE_DOT_I8(1, 4)
DEFINE_DOT_I8(1, 5)
DEFINE_DOT_I8(1, 6)


/* One or two activation rows (batch-1 and -2 decode), K a multiple of 32: the activations are
 * first put in 16-bit fixed point, one fp32 scale per block of 32 (xs = max |x| / 32767 over
 * the block: 15 bits against the block's largest value, finer than the bf16 they come from
 * for all but its smallest elements), so that each 16 weights need one widening
 * (vpmovsxbw) and one integer multiply-add of pairs (vpmaddwd) instead of two widenings to
 * fp32, two conversions and two FMAs; per block the integer sum is converted and scaled
 * once. Decode at batch 1 streams int8 at memory speed this way (the fp32 widening was
 * bound by the vector units near the read bandwidth); the results differ from the fp32 path
 * by the fixed-point rounding, within the tests' tolerance. */
#define Q16_BLOCK 32
/* Returns 0, or -1 for a NaN or an infinity (fixed point cannot carry it: the caller takes
 * the fp32 path, which propagates it as torch does). */
static int quantize_rows_q16(const float *x, int M, int K, int16_t *xq, float *xs) {
    int nb = K / Q16_BLOCK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (long)m * K + (long)b * Q16_BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < Q16_BLOCK; i++) {
                if (!isfinite(xb[i])) return -1;
                amax = fmaxf(amax, fabsf(xb[i]));
            }
            float s = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            xs[(long)m * nb + b] = s;
            int16_t *q = xq + (long)m * K + (long)b * Q16_BLOCK;
            for (int i = 0; i < Q16_BLOCK; i++) q[i] = (int16_t)lrintf(xb[i] * inv);
        }
    return 0;
}

/* o[r * M + m] = dot(xq[m] * xs[m], w[r]) for R int8 weight rows, M <= 2 fixed-point rows. */
#define DEFINE_DOT_Q16(R, M)                                                                 \
    static void dot_q16_##R##x##M(const I8Act *act, const int8_t *const *w, int K,           \
                                  float *o) {                                                \
        const int16_t *xq = act->xq;                                                         \
        const float *xs = act->xs;                                                           \
        __m256 a[R * M];                                                                     \
        for (int i = 0; i < R * M; i++) a[i] = _mm256_setzero_ps();                          \
        int nb = K / Q16_BLOCK;                                                              \
        for (int b = 0; b < nb; b++) {                                                       \
            int k = b * Q16_BLOCK;                                                           \
            if ((k & 63) == 0)                                                               \
                for (int r = 0; r < R; r++)                                                  \
                    _mm_prefetch((const char *)(w[r] + k) + INT8_PREFETCH_BYTES, PREFETCH_HINT); \
            __m256i xl[M], xh[M];                                                            \
            __m256 s[M];                                                                     \
            for (int m = 0; m < M; m++) {                                                    \
                xl[m] = _mm256_loadu_si256((const __m256i *)(xq + (long)m * K + k));         \
                xh[m] = _mm256_loadu_si256((const __m256i *)(xq + (long)m * K + k + 16));    \
                s[m] = _mm256_broadcast_ss(xs + (long)m * nb + b);                           \
            }                                                                                \
            for (int r = 0; r < R; r++) {                                                    \
                __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + k))); \
                __m256i wh = _mm256_cvtepi8_epi16(                                           \
                    _mm_loadu_si128((const __m128i *)(w[r] + k + 16)));                      \
                for (int m = 0; m < M; m++) {                                                \
                    __m256i p = _mm256_add_epi32(_mm256_madd_epi16(wl, xl[m]),               \
                                                 _mm256_madd_epi16(wh, xh[m]));              \
                    a[r * M + m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s[m], a[r * M + m]); \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        for (int i = 0; i < R * M; i++) o[i] = hsum8(a[i]);                                  \
    }
DEFINE_DOT_Q16(4, 1)
DEFINE_DOT_Q16(2, 2)
DEFINE_DOT_Q16(1, 1)
DEFINE_DOT_Q16(1, 2)

/* This thread's share of the N weight rows, R at a time through `wide` (rows far apart in
 * the share, so that they are independent streams), the rest one by one through `one`:
 * res[m * N + n] = scale[n] * dot(row m, w[n]). No barrier. */
static void share_rows_i8(const I8Act *act, int M, int R, dot_i8_fn wide, dot_i8_fn one,
                          const int8_t *w, const float *scale, int K, int N, float *res) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int lo = (int)((long)N * t / T), hi = (int)((long)N * (t + 1) / T);
    int q = (hi - lo) / R, skew[4];
    for (int r = 0; r < R; r++) skew[r] = stream_skew(r, R, q, K);
    float o[4 * INT8_ROWS_MAX];
    for (int i = 0; i < q; i++) {
        const int8_t *rows[4];
        int n[4];
        for (int r = 0; r < R; r++) {
            int j = i + skew[r];
            n[r] = lo + r * q + (j < q ? j : j - q);
            rows[r] = w + (long)n[r] * K;
        }
        wide(act, rows, K, o);
        for (int r = 0; r < R; r++)
            for (int m = 0; m < M; m++) res[(long)m * N + n[r]] = o[r * M + m] * scale[n[r]];
    }
    for (int nn = lo + R * q; nn < hi; nn++) {
        const int8_t *row = w + (long)nn * K;
        one(act, &row, K, o);
        for (int m = 0; m < M; m++) res[(long)m * N + nn] = o[m] * scale[nn];
    }
}

/* gemv_share_i8 for M <= 2 and K % 32 == 0, in fixed point (above); each thread puts the
 * activations in fixed point itself (a few microseconds), so no barrier is needed. Returns 0,
 * or -1 (the caller then takes the fp32 path) if its scratch could not be had or the
 * activations hold a NaN or an infinity; every thread sees the same activations, so all
 * threads decide alike. */
static int gemv_share_q16(const float *x, int M, const int8_t *w, const float *scale, int K,
                          int N, float *res) {
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * (size_t)M * K
                                    + sizeof(float) * (size_t)M * (K / Q16_BLOCK));
    if (!xq) return -1;
    float *xs = (float *)(xq + (size_t)M * K);
    if (quantize_rows_q16(x, M, K, xq, xs) != 0) {
        free(xq);
        return -1;
    }
    static const dot_i8_fn WIDE[3] = {0, dot_q16_4x1, dot_q16_2x2};
    static const dot_i8_fn ONE[3] = {0, dot_q16_1x1, dot_q16_1x2};
    I8Act act = {NULL, xq, xs};
    share_rows_i8(&act, M, M == 1 ? 4 : 2, WIDE[M], ONE[M], w, scale, K, N, res);
    free(xq);
    return 0;
}

/* Called by every thread of a parallel region, as gemv_share: res[m * N + n] = scale[n] *
 * dot(x[m], w[n]) for this thread's contiguous share of the N int8 weight rows, M <=
 * INT8_ROWS_MAX. R weight rows at a time (four streams for one or two activation rows, two
 * for more), far apart in the share so that they are independent streams; the rest one by
 * one. No barrier at the end. */
static void gemv_share_i8(const float *x, int M, const int8_t *w, const float *scale, int K,
                          int N, float *res) {
    static const dot_i8_fn WIDE[INT8_ROWS_MAX + 1] = {0, dot_i8_4x1, dot_i8_4x2, dot_i8_2x3,
                                                      dot_i8_2x4, dot_i8_2x5, dot_i8_2x6};
    static const dot_i8_fn ONE[INT8_ROWS_MAX + 1] = {0, dot_i8_1x1, dot_i8_1x2, dot_i8_1x3,
                                                     dot_i8_1x4, dot_i8_1x5, dot_i8_1x6};
    if (M <= 2 && K % Q16_BLOCK == 0 && gemv_share_q16(x, M, w, scale, K, N, res) == 0) return;
    I8Act act = {x, NULL, NULL};
    share_rows_i8(&act, M, M <= 2 ? 4 : 2, WIDE[M], ONE[M], w, scale, K, N, res);
}

/* A projection's share, bf16 weights or (with a scale) int8 ones. */
static void proj_share(const float *x, int M, const void *w, const float *scale, int K, int N,
                       float *res) {
    if (scale)
        gemv_share_i8(x, M, (const int8_t *)w, scale, K, N, res);
    else
        gemv_share(x, M, (const uint16_t *)w, K, N, res);
}

/* More rows than the streams take: the bf16 tiles' 2 x 6 register tiles (linear_tiles drives
 * them), over int8 weights. Per 8 weights of a row, one 8-byte load is sign-extended and
 * converted to fp32 (vpmovsxbd, vcvtdq2ps), so the activations keep their order. A row's
 * dot product is scaled once, at the end. */
static inline void tile_store_i8(__m256 acc, const float *xi, const int8_t *wj, int K8, int K,
                                 float scale_j, const uint16_t *bias_j, uint16_t *yij) {
    float s = hsum8(acc);
    for (int k = K8; k < K; k++) s += xi[k] * (float)wj[k];
    *yij = f32_to_bf16(s * scale_j + (bias_j ? bf16_to_f32(*bias_j) : 0.0f));
}

/* 8 weights of each of the 6 rows against 8 of both activation rows: ymm0-5 row 0, ymm6-11
 * row 1, ymm12/13 the activations, ymm14/15 the widened weights (alternating, so one row's
 * conversion overlaps the previous row's FMAs). */
#define I8_ROW(WOFF, BASE, ACC0, ACC1, T)                                                  \
    "vpmovsxbd " WOFF BASE ", %%ymm" T "\n\t"                                              \
    "vcvtdq2ps %%ymm" T ", %%ymm" T "\n\t"                                                 \
    "vfmadd231ps %%ymm" T ", %%ymm12, %%ymm" ACC0 "\n\t"                                   \
    "vfmadd231ps %%ymm" T ", %%ymm13, %%ymm" ACC1 "\n\t"
#define I8_STEP(XOFF, WOFF)                                                                 \
    "vmovups " XOFF "(%[xp]), %%ymm12\n\t"                                                  \
    "vmovups " XOFF "(%[xp],%[lx],1), %%ymm13\n\t"                                          \
    I8_ROW(WOFF, "(%[p0])", "0", "6", "14")                                                \
    I8_ROW(WOFF, "(%[p0],%[lw],1)", "1", "7", "15")                                        \
    I8_ROW(WOFF, "(%[p0],%[lw],2)", "2", "8", "14")                                        \
    I8_ROW(WOFF, "(%[p3])", "3", "9", "15")                                                \
    I8_ROW(WOFF, "(%[p3],%[lw],1)", "4", "10", "14")                                       \
    I8_ROW(WOFF, "(%[p3],%[lw],2)", "5", "11", "15")
#define I8_BODY64                                                                           \
    I8_STEP("0", "0") I8_STEP("32", "8") I8_STEP("64", "16") I8_STEP("96", "24")           \
    I8_STEP("128", "32") I8_STEP("160", "40") I8_STEP("192", "48") I8_STEP("224", "56")    \
    "add $64, %[p0]\n\t" "add $64, %[p3]\n\t" "add $256, %[xp]\n\t"
#define I8_BODY8 I8_STEP("0", "0") "add $8, %[p0]\n\t" "add $8, %[p3]\n\t" "add $32, %[xp]\n\t"

/* The full 2x6 int8 tile; pf: the next tile's first weight row to prefetch alongside (one
 * line of each of its rows per 64 weights), or NULL. */
static void tile_i8_2x6(const float *x, long ldx, const int8_t *w, long ldw, int K,
                        const float *scale, uint16_t *y, long ldy, const uint16_t *bias,
                        const int8_t *pf) {
    float acc[TILE_M * TILE_N][8] __attribute__((aligned(32)));
    const int8_t *p0 = w, *p3 = w + 3 * ldw;
    const float *xp = x;
    long lw = ldw, lx = ldx * 4; /* bytes */
    long n64 = K / 64, n8 = (K - n64 * 64) / 8;
    int K8 = (int)(n64 * 64 + n8 * 8);
    const int8_t *q0 = pf ? pf : w, *q3 = q0 + 3 * ldw;
    __asm__ volatile(
        TILE_ZERO
        "test %[n64], %[n64]\n\t"
        "jz 2f\n\t"
        "1:\n\t"
        "test %[pf], %[pf]\n\t"
        "jz 5f\n\t"
        "prefetcht0 (%[q0])\n\t" "prefetcht0 (%[q0],%[lw],1)\n\t" "prefetcht0 (%[q0],%[lw],2)\n\t"
        "prefetcht0 (%[q3])\n\t" "prefetcht0 (%[q3],%[lw],1)\n\t" "prefetcht0 (%[q3],%[lw],2)\n\t"
        "add $64, %[q0]\n\t" "add $64, %[q3]\n\t"
        "5:\n\t"
        I8_BODY64
        "dec %[n64]\n\t"
        "jnz 1b\n\t"
        "2:\n\t"
        "test %[n8], %[n8]\n\t"
        "jz 4f\n\t"
        "3:\n\t"
        I8_BODY8
        "dec %[n8]\n\t"
        "jnz 3b\n\t"
        "4:\n\t"
        TILE_SAVE
        : [p0] "+r"(p0), [p3] "+r"(p3), [xp] "+r"(xp), [q0] "+r"(q0), [q3] "+r"(q3),
          [n64] "+r"(n64), [n8] "+r"(n8)
        : [lw] "r"(lw), [lx] "r"(lx), [o] "r"(acc), [pf] "r"(pf)
        : TILE_CLOBBERS);
    for (int i = 0; i < TILE_M; i++)
        for (int j = 0; j < TILE_N; j++)
            tile_store_i8(_mm256_load_ps(acc[i * TILE_N + j]), x + i * ldx, w + j * ldw, K8, K,
                          scale[j], bias ? bias + j : NULL, y + i * ldy + j);
}

/* Edge tiles (R <= TILE_M rows, C <= TILE_N weight rows), in intrinsics. */
static void edge_i8(int R, int C, const float *x, long ldx, const int8_t *w, long ldw, int K,
                    const float *scale, uint16_t *y, long ldy, const uint16_t *bias) {
    __m256 acc[TILE_M][TILE_N];
    for (int i = 0; i < R; i++) for (int j = 0; j < C; j++) acc[i][j] = _mm256_setzero_ps();
    int K8 = K / 8 * 8;
    for (int k = 0; k < K8; k += 8)
        for (int j = 0; j < C; j++) {
            __m256 wv = load_i8x8(w + j * ldw + k);
            for (int i = 0; i < R; i++)
                acc[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * ldx + k), acc[i][j]);
        }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++)
            tile_store_i8(acc[i][j], x + i * ldx, w + j * ldw, K8, K, scale[j],
                          bias ? bias + j : NULL, y + i * ldy + j);
}

/* y = x @ (scale * w)^T + bias. x, bias, y bf16; w int8; scale fp32. Up to INT8_ROWS_MAX
 * rows stream the weights (each byte read once); up to INT8_TILE_ROWS_MAX the register
 * tiles; more rows the packed GEMM, widening the int8 weights into its fp32 panels. Returns
 * 0, or -1 when scratch memory could not be had. */
int pw_linear_int8(const uint16_t *xb, const int8_t *w, const float *scale,
                   const uint16_t *bias, uint16_t *y, int M, int N, int K, int nthreads) {
    if (M > INT8_TILE_ROWS_MAX) return gemm(xb, w, scale, bias, y, M, N, K, nthreads);
    if (M > INT8_ROWS_MAX) return linear_tiles(xb, w, scale, bias, y, M, N, K, nthreads);
    float *x = (float *)malloc(sizeof(float) * (size_t)M * K);
    if (!x) return -1;
    for (long i = 0; i < (long)M * K; i++) x[i] = bf16_to_f32(xb[i]);
    int rc = linear_rows(x, w, scale, bias, y, M, N, K, nthreads);
    free(x);
    return rc;
}


/* ---------------------------------------------------------------------------------------
 * A whole decoder layer for a decode step (a few rows, each one request's next token), in
 * one call and one OpenMP region. At batch 1 a layer's weights take ~2 ms to stream; the
 * dozen torch/ctypes calls an unfused layer needs cost ~0.6 ms more, which this removes.
 * Rounding to bf16 happens at the same points as in the unfused path (and the reference):
 * after every projection, RoPE, attention, each residual add and the SiLU.
 */
/* How a fused layer runs its projections (DecodeLayer.proj_mode; ProjMode in
 * phasewise/model/cpu/kernels.py mirrors it, checked value by value through pw_abi at load). */
enum pw_proj_mode {
    PW_PROJ_STREAMS = 0,    /* the AVX2 row streams (pw_linear_bf16's few rows; int8 alike) */
    PW_PROJ_AMX = 1,        /* bf16 projections on AMX tiles (cpu_amx.c), where the CPU has them;
                             * int8 ones widened on the tiles above the int8 streams' rows */
    PW_PROJ_AVX512BF16 = 2, /* on AVX512_BF16 dot products (cpu_avx512bf16.c), bf16 weights
                             * only (int8 ones stream, up to their rows) */
    PW_PROJ_PANELS = 3,     /* the same on weights packed into panels (pw_pk_pack: every
                             * projection, at any row count; no int8) */
    PW_PROJ_AVX2_TILES = 4, /* as pw_linear_bf16 runs them on AVX2: the streams up to
                             * ROW_STREAM_MAX rows, the 2 x 6 register tiles above (up to
                             * AMX_LAYER_MAX rows; bf16 weights only) */
};

typedef struct {
    int M, H, Q, KV, I, n_heads, n_kv, hd, bs, max_blocks, qk_norm, nthreads;
    float eps, scale;
    uint16_t *hidden;        /* [M][H] residual stream, updated in place */
    const uint16_t *delta;   /* [M][H] previous layer's MLP output, or NULL for the first layer */
    uint16_t *out;           /* [M][H] this layer's MLP output */
    /* w_qkv, w_o, w_gate_up and w_down are bf16, or int8 where their scale (below) is given */
    const uint16_t *w_in_norm;
    const void *w_qkv;
    const uint16_t *b_qkv, *w_q_norm, *w_k_norm;
    const void *w_o;
    const uint16_t *b_o, *w_post_norm;
    const void *w_gate_up;
    const uint16_t *b_gate_up;
    const void *w_down;
    const uint16_t *b_down;
    uint16_t *k_cache, *v_cache; /* this layer's [blocks][bs][n_kv][hd] */
    const int64_t *slots;        /* [M] cache slot of each row's new token */
    const int64_t *block_tables; /* [M][max_blocks] */
    const int64_t *seq_lens;     /* [M] keys to attend, the new token included */
    const float *cos, *sin;      /* [M][hd] */
    /* Weight-only int8 (NULL: that projection is bf16): the fp32 per-row scales of w_qkv,
     * w_o, w_gate_up and w_down, whose pointers then point at int8 weights. */
    const float *s_qkv, *s_o, *s_gate_up, *s_down;
    int proj_mode; /* an enum pw_proj_mode (an int: the field's size is the ABI's, whatever
                    * size a compiler would give the enum) */
} DecodeLayer;

#define MAX_HEAD_DIM 512 /* the largest head the kernels take (a bound on scratch sizes) */

/* The numbers phasewise/model/cpu/kernels.py must agree with, read by it once at load:
 * "row_stream_max", "max_head_dim", "sizeof DecodeLayer", a DecodeLayer field's name (its
 * byte offset), or a pw_proj_mode value's name (the value). -1 for anything else. Python's
 * ctypes mirror of DecodeLayer and its ProjMode are checked against these, field by field and
 * value by value, so the two sides cannot drift apart unnoticed. */
long pw_abi(const char *what) {
    static const struct { const char *name; long value; } table[] = {
        {"row_stream_max", ROW_STREAM_MAX}, {"amx_layer_max", AMX_LAYER_MAX},
        {"max_head_dim", MAX_HEAD_DIM},
        {"int8_rows_max", INT8_ROWS_MAX},
        {"sizeof DecodeLayer", (long)sizeof(DecodeLayer)},
#define FIELD(f) {#f, (long)offsetof(DecodeLayer, f)}
        FIELD(M), FIELD(H), FIELD(Q), FIELD(KV), FIELD(I), FIELD(n_heads), FIELD(n_kv),
        FIELD(hd), FIELD(bs), FIELD(max_blocks), FIELD(qk_norm), FIELD(nthreads), FIELD(eps),
        FIELD(scale), FIELD(hidden), FIELD(delta), FIELD(out), FIELD(w_in_norm), FIELD(w_qkv),
        FIELD(b_qkv), FIELD(w_q_norm), FIELD(w_k_norm), FIELD(w_o), FIELD(b_o),
        FIELD(w_post_norm), FIELD(w_gate_up), FIELD(b_gate_up), FIELD(w_down), FIELD(b_down),
        FIELD(k_cache), FIELD(v_cache), FIELD(slots), FIELD(block_tables), FIELD(seq_lens),
        FIELD(cos), FIELD(sin), FIELD(s_qkv), FIELD(s_o), FIELD(s_gate_up), FIELD(s_down),
        FIELD(proj_mode),
#undef FIELD
        {"PW_PROJ_STREAMS", PW_PROJ_STREAMS}, {"PW_PROJ_AMX", PW_PROJ_AMX},
        {"PW_PROJ_AVX512BF16", PW_PROJ_AVX512BF16}, {"PW_PROJ_PANELS", PW_PROJ_PANELS},
        {"PW_PROJ_AVX2_TILES", PW_PROJ_AVX2_TILES},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (strcmp(what, table[i].name) == 0) return table[i].value;
    return -1;
}

/* hidden = bf16(hidden + delta) if delta; xn = fp32 of bf16(w * bf16(norm(hidden))). The
 * rows shared by the threads of the calling region (an orphaned omp for, with its barrier):
 * one thread alone took ~0.5 ms of a batch-32 step for each of the layer's two norms. */
static void add_norm_rows(uint16_t *hidden, const uint16_t *delta, const uint16_t *w,
                          float *xn, int M, int H, float eps) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        add_norm_row(hidden + (long)m * H, delta ? delta + (long)m * H : NULL, w, H, eps, NULL,
                     xn + (long)m * H);
}


static void head_norm(uint16_t *v, const uint16_t *w, int hd, float eps) {
    add_norm_row(v, NULL, w, hd, eps, v, NULL);  /* in place: every read precedes its write */
}

/* cpu_amx.c's projection share, when that file was compiled in (weak: absent otherwise). */
void pw_amx_pack_f32(const float *x, int M, int K, uint32_t *xp) __attribute__((weak));
void pw_amx_share(const uint32_t *xp, int M, const uint16_t *w, int K, int N, float *res)
    __attribute__((weak));
void pw_amx_share_glu(const uint32_t *xp, int M, const uint16_t *w, const uint16_t *bias,
                      int K, int I, float *act) __attribute__((weak));
void pw_amx_share_int8(const uint32_t *xp, int M, const int8_t *w, const float *scale,
                       uint16_t *wide, int K, int N, float *res) __attribute__((weak));
void pw_amx_share_glu_int8(const uint32_t *xp, int M, const int8_t *w, const float *scale,
                           uint16_t *wide, const uint16_t *bias, int K, int I, float *act)
    __attribute__((weak));
/* cpu_avx512bf16.c's (weak: absent when it was not compiled in) */
void pw_avx512bf16_pack_f32(const float *x, int M, int K, uint16_t *xb) __attribute__((weak));
void pw_avx512bf16_share(const uint16_t *xb, int M, const uint16_t *w, int K, int N, float *res)
    __attribute__((weak));
void pw_avx512bf16_glu_rows(const float *res, const uint16_t *bias, int M, int I, float *act)
    __attribute__((weak));
void pw_pk_share(const uint16_t *xb, int M, const uint32_t *wp, int K, int N, float *res)
    __attribute__((weak));
void pw_pk_share_glu(const uint16_t *xb, int M, const uint32_t *wp, const uint16_t *bias,
                     int K, int I, uint16_t *act) __attribute__((weak));

/* out = bf16(res + bias) for M rows of N, shared by the threads of the calling region (an
 * orphaned omp for, with its barrier), row by row (walking down the rows first, rows of
 * thousands of floats apart, thrashed L1's sets), eight values at a time. Scalar, over a
 * collapsed loop (a division per value), this took 2.2 ms of a batch-32 step of the
 * reference checkpoint on a 2-core AMX Xeon. */
static void bias_round_rows(const float *res, const uint16_t *bias, int M, int N,
                            uint16_t *out) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        const float *r = res + (long)m * N;
        uint16_t *o = out + (long)m * N;
        int n = 0;
        for (; n + 8 <= N; n += 8) {
            /* + 0 without a bias, as below: -0 becomes +0 alike */
            __m256 b = bias ? load_bf16x8(bias + n) : _mm256_setzero_ps();
            store_bf16x8(o + n, _mm256_add_ps(_mm256_loadu_ps(r + n), b));
        }
        for (; n < N; n++) o[n] = f32_to_bf16(r[n] + (bias ? bf16_to_f32(bias[n]) : 0.0f));
    }
}

/* Whether a fused layer's projection runs on AMX tiles: the layer asks for them, and the
 * weights are bf16, or int8 (with scales) for more rows than the int8 streams take (up to
 * that, the streams read each int8 byte once at memory speed; the tiles would widen them).
 * Or, where the layer asks for AVX512_BF16 dot products (amx == 2), on those: bf16 weights
 * only (int8 ones stream, up to their rows). */
static int amx_proj(const DecodeLayer *L, const float *scale, int N) {
    if (L->proj_mode == PW_PROJ_AVX2_TILES) return !scale && N >= 16;
    if (L->proj_mode == PW_PROJ_PANELS)
        return !scale && N % 16 == 0 && pw_pk_share != NULL && pw_avx512bf16_pack_f32 != NULL;
    if (L->proj_mode == PW_PROJ_AVX512BF16)
        return !scale && N >= 16 && pw_avx512bf16_share != NULL
               && pw_avx512bf16_pack_f32 != NULL;
    if (L->proj_mode != PW_PROJ_AMX || N < 16 || !pw_amx_pack_f32) return 0;
    return scale ? L->M > ROW_STREAM_MAX && pw_amx_share_int8 != NULL : pw_amx_share != NULL;
}

/* A fused layer's projection, called by every thread of its region: on AMX tiles where
 * amx_proj says (the threads pack the activations' tiles between them; the omp for's
 * barrier makes them visible; int8 panels widened into the thread's slice of `wide`, 32 x K values), else
 * proj_share. No barrier at the end. */
static void layer_proj(const DecodeLayer *L, const float *x, int M, const void *w,
                       const float *scale, int K, int N, uint32_t *xp, uint16_t *wide,
                       long wide_per_thread, float *res) {
    if (L->proj_mode == PW_PROJ_AVX2_TILES && amx_proj(L, scale, N) && M > ROW_STREAM_MAX) {
        /* the AVX2 tiles, as pw_linear_bf16 runs these rows (up to ROW_STREAM_MAX, the
         * streams below, as it does too): x's rows permuted into xp (fp32) between the
         * threads, with the omp for's barrier, then this thread's tiles */
        float *xf = (float *)xp;
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            permute_row_any(NULL, x + (long)m * K, xf + (long)m * K, K, K / 16 * 16);
        tiles_share(xf, w, NULL, NULL, NULL, res, M, N, K);
        return;
    }
    if (amx_proj(L, scale, N)
        && (L->proj_mode == PW_PROJ_AVX512BF16 || L->proj_mode == PW_PROJ_PANELS)) {
        /* AVX512_BF16: bf16 rows, then the share */
        pw_avx512bf16_pack_f32(x, M, K, (uint16_t *)xp);  /* shared by the threads, with a barrier */
        if (L->proj_mode == PW_PROJ_PANELS)
            pw_pk_share((const uint16_t *)xp, M, (const uint32_t *)w, K, N, res);
        else
            pw_avx512bf16_share((const uint16_t *)xp, M, (const uint16_t *)w, K, N, res);
        return;
    }
    if (L->proj_mode == PW_PROJ_AMX && amx_proj(L, scale, N)) {
        pw_amx_pack_f32(x, M, K, xp);  /* shared by the threads, with a barrier */
        if (scale)
            pw_amx_share_int8(xp, M, (const int8_t *)w, scale,
                              wide + wide_per_thread * omp_get_thread_num(), K, N, res);
        else
            pw_amx_share(xp, M, (const uint16_t *)w, K, N, res);
        return;
    }
    proj_share(x, M, w, scale, K, N, res);
}

/* This thread's share of a fused layer's attention tasks (attention_request's numbering,
 * n_tasks of them): a contiguous range [lo, hi), the team's ranges balanced by keys (each
 * task goes to the thread whose equal share of all the keys holds the task's middle key),
 * so every thread computes the same split and knows which task it takes next (for
 * attention_prefetch). Before, a dynamic schedule handed out tasks one at a time: no thread
 * knew its next task, and each began on keys not yet in its caches. */
static void task_range(int n_tasks, int parts, int n_kv, const int64_t *seq_lens, int *lo,
                       int *hi) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    long total = 0, before = 0;
    for (int k = 0; k < n_tasks; k++) total += seq_lens[parts ? k / parts : k / n_kv];
    *lo = *hi = n_tasks;
    int found = 0;
    for (int k = 0; k < n_tasks; k++) {
        long len = seq_lens[parts ? k / parts : k / n_kv];
        int owner = total > 0 ? (int)((2 * before + len) * T / (2 * total)) : 0;
        if (owner > T - 1) owner = T - 1;  /* its middle key's (an empty last task's: T) */
        if (owner == t && !found) {
            *lo = k;
            found = 1;
        }
        if (owner > t) {
            *hi = k;
            break;
        }
        before += len;
    }
    if (!found) *lo = *hi;
}

/* Prefetches task `task`'s first keys (their K and V rows, of the KV heads it covers; up to
 * DPA_FIRST_KEYS, and 16 KiB, less the step's own key, just written) unless task >= end or
 * it goes on the request of task `cur` (parts > 1: those keys are read now): called with
 * each task for the next (and, before the first, for the first), so that a task does not
 * begin on keys the weights' stream has evicted. The kernels prefetch the keys after those
 * themselves, one step ahead. With task_range, against the dynamic schedule, on the 2-core
 * AMD EPYC with AVX512_BF16, the reference checkpoint's decode steps (in one process,
 * alternating): the 24 layers' attention -12% at batch 8 (1.74 -> 1.53 ms a step), -21% at
 * batch 32 (4.00 -> 3.16 ms). */
#define DPA_FIRST_KEYS 32
static void attention_prefetch(int task, int cur, int end, int parts, int n_kv, int hd,
                               const DecodeLayer *L) {
    if (task >= end || (parts > 1 && cur >= 0 && task / parts == cur / parts)) return;
    int b = parts ? task / parts : task / n_kv;
    int k0 = parts ? 0 : task % n_kv, k1 = parts ? n_kv : k0 + 1;
    const int64_t *table = L->block_tables + (long)b * L->max_blocks;
    long len = L->seq_lens[b] - 1, per_key = 4L * (k1 - k0) * hd;  /* K and V bytes */
    if (len > DPA_FIRST_KEYS) len = DPA_FIRST_KEYS;
    if (len > 16384 / per_key) len = 16384 / per_key;
    long off[DPA_FIRST_KEYS];
    paged_row_offs(table, L->bs, n_kv, hd, k0, 0, (int)len, off);
    for (long j = 0; j < len; j++)
        for (long c = 0; c < (long)(k1 - k0) * hd; c += 32) {  /* a line: 32 values */
            _mm_prefetch((const char *)(L->k_cache + off[j] + c), _MM_HINT_T0);
            _mm_prefetch((const char *)(L->v_cache + off[j] + c), _MM_HINT_T0);
        }
}

int pw_decode_layer_bf16(const DecodeLayer *L) {
    int M = L->M, H = L->H, Q = L->Q, KV = L->KV, I = L->I, hd = L->hd;
    int n_heads = L->n_heads, n_kv = L->n_kv, group = n_heads / n_kv, QKV = Q + 2 * KV;
    /* More rows than the streams take only when every projection runs on the tiles. */
    int all_amx = amx_proj(L, L->s_qkv, QKV) && amx_proj(L, L->s_o, H)
                  && amx_proj(L, L->s_gate_up, 2 * I) && amx_proj(L, L->s_down, H) && H >= 16
                  && I >= 8;
    if (M < 1 || M > (all_amx ? AMX_LAYER_MAX : ROW_STREAM_MAX) || hd > MAX_HEAD_DIM)
        return -2;
    /* panels are no rows: nothing else may read them */
    if (L->proj_mode == PW_PROJ_PANELS && !all_amx)
        return -2;
    int amx_glu = L->proj_mode == PW_PROJ_AMX && amx_proj(L, L->s_gate_up, 2 * I) && I >= 16
                  && (L->s_gate_up ? pw_amx_share_glu_int8 != NULL : pw_amx_share_glu != NULL);
    /* On panels (I % 16 == 0, where CpuKernelOps.pack_panels packs gate/up in units,
     * pack_panels(glu=True), and _static_args refuses a layer otherwise): the SiLU in the
     * gate/up tiles' epilogue too, writing act as the bf16 rows the down projection reads
     * (no [M, 2I] results, no separate pass, no packing of act; the same bits) */
    int pk_glu = L->proj_mode == PW_PROJ_PANELS && I % 16 == 0
                 && amx_proj(L, L->s_gate_up, 2 * I) && pw_pk_share_glu != NULL;
    int parts = group_parts(M, n_kv, group, L->nthreads);
    int n_tasks = parts ? M * parts : M * n_kv;
    long per_task = attention_task_floats(group, hd);
    int widest = QKV > 2 * I ? QKV : 2 * I;
    if (H > widest) widest = H;
    size_t n_floats = (size_t)M * H + (size_t)M * Q + (size_t)M * I
                      + (size_t)per_task * L->nthreads + (size_t)M * widest;
    float *buf = (float *)malloc(sizeof(float) * n_floats);
    uint16_t *qkv = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)M * QKV);
    uint16_t *o = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)M * H);
    int widest_k = H > Q ? (H > I ? H : I) : (Q > I ? Q : I);
    /* AMX: the packed activations, 1 KiB per 32 values of K and 16 tokens (AVX512_BF16: the
     * bf16 rows, 2 bytes a value, no more; the AVX2 tiles: the permuted fp32 rows) */
    size_t xp_bytes = L->proj_mode == PW_PROJ_AVX2_TILES
                          ? ((size_t)M * widest_k * sizeof(float) + 63) / 64 * 64
                          : (size_t)(widest_k + 31) / 32 * 1024 * ((M + 15) / 16);
    uint32_t *xp = L->proj_mode != PW_PROJ_STREAMS ? (uint32_t *)aligned_alloc(64, xp_bytes)
                                                   : NULL;
    /* int8 panels on the tiles: each thread's widened panel, 32 rows of the widest K */
    int any_int8 = L->s_qkv || L->s_o || L->s_gate_up || L->s_down;
    long wide_per_thread = 32L * widest_k;
    uint16_t *wide = L->proj_mode == PW_PROJ_AMX && any_int8 && M > ROW_STREAM_MAX
        ? (uint16_t *)aligned_alloc(64, ((size_t)wide_per_thread * 2 * L->nthreads + 63) / 64
                                            * 64)
        : NULL;
    if (!buf || !qkv || !o || (L->proj_mode != PW_PROJ_STREAMS && !xp)
        || (L->proj_mode == PW_PROJ_AMX && any_int8 && M > ROW_STREAM_MAX && !wide)) {
        free(buf); free(qkv); free(o); free(xp); free(wide);
        return -1;
    }
    float *xn = buf, *attn = xn + (long)M * H, *act = attn + (long)M * Q;
    float *att = act + (long)M * I; /* per-thread attention scratch */
    float *res = att + per_task * L->nthreads; /* [M][N] projection results */

#pragma omp parallel num_threads(L->nthreads)
    {
        add_norm_rows(L->hidden, L->delta, L->w_in_norm, xn, M, H, L->eps);

        layer_proj(L, xn, M, L->w_qkv, L->s_qkv, H, QKV, xp, wide, wide_per_thread, res);
#pragma omp barrier
        bias_round_rows(res, L->b_qkv, M, QKV, qkv);

        /* RoPE and the K/V writes, row by row (each row its own cache slot), shared */
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            uint16_t *row = qkv + (long)m * QKV;
            if (L->qk_norm) {
                for (int h = 0; h < n_heads; h++) head_norm(row + (long)h * hd, L->w_q_norm, hd, L->eps);
                for (int h = 0; h < n_kv; h++) head_norm(row + Q + (long)h * hd, L->w_k_norm, hd, L->eps);
            }
            /* the row function, not pw_rope_bf16: its parallel for, nested here, cost
             * 0.23 ms of a batch-32 step (2-core AMX Xeon) in team set-up alone */
            rope_row(row, L->cos + (long)m * hd, L->sin + (long)m * hd, n_heads + n_kv, hd);
            long slot = L->slots[m];
            memcpy(L->k_cache + slot * KV, row + Q, sizeof(uint16_t) * KV);
            memcpy(L->v_cache + slot * KV, row + Q + KV, sizeof(uint16_t) * KV);
        }

        {  /* attn[m][head][hd]: Q = heads * hd; this thread's tasks (task_range) */
            int lo, hi;
            task_range(n_tasks, parts, n_kv, L->seq_lens, &lo, &hi);
            attention_prefetch(lo, -1, hi, parts, n_kv, hd, L);
            for (int task = lo; task < hi; task++) {
                attention_prefetch(task + 1, task, hi, parts, n_kv, hd, L);
                attention_request(task, parts, group, n_heads, n_kv, hd, qkv, QKV, L->scale,
                                  L->k_cache, L->v_cache, L->block_tables, L->max_blocks,
                                  L->seq_lens, L->bs, att + per_task * omp_get_thread_num(),
                                  NULL, attn);
            }
        }
#pragma omp barrier

        layer_proj(L, attn, M, L->w_o, L->s_o, Q, H, xp, wide, wide_per_thread, res);
#pragma omp barrier
        bias_round_rows(res, L->b_o, M, H, o);

        add_norm_rows(L->hidden, o, L->w_post_norm, xn, M, H, L->eps);

        if (amx_glu) {  /* on the tiles, with the SiLU in their epilogue: act directly */
            pw_amx_pack_f32(xn, M, H, xp);  /* shared by the threads, with a barrier */
            if (L->s_gate_up)
                pw_amx_share_glu_int8(xp, M, (const int8_t *)L->w_gate_up, L->s_gate_up,
                                      wide + wide_per_thread * omp_get_thread_num(),
                                      L->b_gate_up, H, I, act);
            else
                pw_amx_share_glu(xp, M, (const uint16_t *)L->w_gate_up, L->b_gate_up, H, I,
                                 act);
        } else if (pk_glu) {
            pw_avx512bf16_pack_f32(xn, M, H, (uint16_t *)xp);  /* shared, with a barrier */
            pw_pk_share_glu((const uint16_t *)xp, M, (const uint32_t *)L->w_gate_up,
                            L->b_gate_up, H, I, (uint16_t *)act);
        } else {
            layer_proj(L, xn, M, L->w_gate_up, L->s_gate_up, H, 2 * I, xp, wide,
                       wide_per_thread, res);
        }
#pragma omp barrier
        /* Row by row (rows of 2I floats lie tens of KiB apart, often a multiple of 4 KiB:
         * walking down the rows first thrashed L1's sets: 8 ms a step at 32 rows). Skipped
         * alike by every thread where the tiles' epilogue wrote act (fp32 on AMX, bf16 rows
         * on panels). */
        if (!amx_glu && !pk_glu && pw_avx512bf16_glu_rows
            && (L->proj_mode == PW_PROJ_AVX512BF16 || L->proj_mode == PW_PROJ_PANELS)) {
            /* 16 lanes, same bits */
            pw_avx512bf16_glu_rows(res, L->b_gate_up, M, I, act);
        } else if (!amx_glu && !pk_glu) {
#pragma omp for collapse(2) schedule(static)
            for (int m = 0; m < M; m++) {
                for (int i = 0; i < I; i += 8) {  /* 8 at a time, the last group scalar if I % 8 */
                    int n8 = I - i < 8 ? I - i : 8;
                    const float *gr = res + (long)m * 2 * I, *ur = gr + I;
                    float *ar = act + (long)m * I;
                    if (n8 == 8) {
                        __m256 bg = _mm256_setzero_ps(), bu = bg;
                        if (L->b_gate_up) {
                            bg = load_bf16x8(L->b_gate_up + i);
                            bu = load_bf16x8(L->b_gate_up + I + i);
                        }
                        __m256 gv = round_bf16x8(_mm256_add_ps(_mm256_loadu_ps(gr + i), bg));
                        __m256 uv = round_bf16x8(_mm256_add_ps(_mm256_loadu_ps(ur + i), bu));
                        _mm256_storeu_ps(ar + i, silu_mul_rounded8(gv, uv));
                        continue;
                    }
                    for (int j = i; j < i + n8; j++) {
                        float bg = L->b_gate_up ? bf16_to_f32(L->b_gate_up[j]) : 0.0f;
                        float bu = L->b_gate_up ? bf16_to_f32(L->b_gate_up[I + j]) : 0.0f;
                        ar[j] = silu_mul_rounded(round_bf16(gr[j] + bg), round_bf16(ur[j] + bu));
                    }
                }
            }
        }

        if (pk_glu)  /* packed for it already (amx_proj(w_down) holds: all_amx) */
            pw_pk_share((const uint16_t *)act, M, (const uint32_t *)L->w_down, I, H, res);
        else
            layer_proj(L, act, M, L->w_down, L->s_down, I, H, xp, wide, wide_per_thread, res);
#pragma omp barrier
        bias_round_rows(res, L->b_down, M, H, L->out);
    }
    free(buf);
    free(qkv);
    free(o);
    free(xp);
    free(wide);
    return 0;
}


/* Every decoder layer of a decode step in one call: L[0] carries the step's fields (M,
 * max_blocks, nthreads, bs, hidden, delta, slots, block_tables, seq_lens, cos, sin), which
 * are copied into L[1..n-1]; each layer's caches come from k_caches/v_caches; outputs
 * alternate between buf_a and buf_b (layer i writes buf_a if i is even, and layer i + 1 reads
 * it as its delta). At batch 1 this replaces 24 calls from Python, each setting up its
 * arguments, with one. Returns the first layer's error, or 0. */
int pw_decode_stack_bf16(DecodeLayer *L, int n, uint16_t *const *k_caches,
                         uint16_t *const *v_caches, uint16_t *buf_a, uint16_t *buf_b) {
    for (int i = 0; i < n; i++) {
        DecodeLayer *l = L + i;
        if (i > 0) {
            l->M = L->M; l->max_blocks = L->max_blocks; l->nthreads = L->nthreads; l->bs = L->bs;
            l->hidden = L->hidden; l->slots = L->slots; l->block_tables = L->block_tables;
            l->seq_lens = L->seq_lens; l->cos = L->cos; l->sin = L->sin;
            l->proj_mode = L->proj_mode;
            l->delta = L[i - 1].out;
        }
        l->k_cache = k_caches[i];
        l->v_cache = v_caches[i];
        l->out = i % 2 == 0 ? buf_a : buf_b;
        int rc = pw_decode_layer_bf16(l);
        if (rc != 0) return rc;
    }
    return 0;
}

int pw_linear_pk_f32(const uint16_t *x, const uint32_t *wp, const uint16_t *bias, float *y,
                     int M, int N, int K, int nthreads) __attribute__((weak));

/* pw_decode_stack_bf16, then the final norm and the LM head (on panels) in the same call,
 * with no return to Python between them: hidden += the last layer's output, normed into xn
 * (bf16 [M, H]: pw_add_rmsnorm_bf16, its bits), logits (fp32 [M, V]) = pw_linear_pk(xn,
 * head)'s bf16 values, widened as they are written (pw_linear_pk_f32). Returns as
 * pw_decode_stack_bf16, or -2 without the panels kernel (cpu_avx512bf16.c not compiled in). */
int pw_decode_stack_head_bf16(DecodeLayer *L, int n, uint16_t *const *k_caches,
                              uint16_t *const *v_caches, uint16_t *buf_a, uint16_t *buf_b,
                              const uint16_t *norm_w, float eps, uint16_t *xn,
                              const uint32_t *head, int V, float *logits) {
    if (!pw_linear_pk_f32 || n < 1) return -2;
    int rc = pw_decode_stack_bf16(L, n, k_caches, v_caches, buf_a, buf_b);
    if (rc != 0) return rc;
    pw_add_rmsnorm_bf16(L[n - 1].out, L->hidden, norm_w, xn, L->M, L->H, eps, L->nthreads);
    return pw_linear_pk_f32(xn, head, NULL, logits, L->M, V, L->H, L->nthreads);
}

/* Read bandwidth probe: sums `n` bf16 words as fp32 with four streams per thread, the same
 * access pattern as the GEMV above, their addresses a quarter of a 4 KiB page apart (as
 * stream_skew places the GEMV's; streams a multiple of 4 KiB apart read ~4% slower). Returns
 * the sum (so the reads cannot be optimized away). */
float pw_stream_read_bf16(const uint16_t *buf, long n, int nthreads) {
    float total = 0.0f;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        long lo = n * t / T / 128 * 128, hi = t == T - 1 ? n / 128 * 128 : n * (t + 1) / T / 128 * 128;
        long q = (hi - lo - 3 * 512) / 4 / 32 * 32; /* stream r starts r * 1 KiB further */
        __m256 a[4];
        for (int r = 0; r < 4; r++) a[r] = _mm256_setzero_ps();
        for (long i = 0; i < q; i += 32) {
            for (int r = 0; r < 4; r++) {
                const uint16_t *p = buf + lo + r * (q + 512) + i;
                _mm_prefetch((const char *)p + PREFETCH_BYTES, PREFETCH_HINT);
                a[r] = _mm256_add_ps(a[r], _mm256_add_ps(_mm256_add_ps(load_bf16x8(p), load_bf16x8(p + 8)),
                                                         _mm256_add_ps(load_bf16x8(p + 16), load_bf16x8(p + 24))));
            }
        }
        total += hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
    }
    return total;
}


/* Structured output's token mask: logits[i] = -inf for every token i whose bit (bit i % 32 of
 * word i / 32, as llguidance writes its bitmask) is clear, and for i at or past 32 * n_words
 * (a logits row wider than the tokenizer's vocabulary). One pass, no allocation: the torch
 * ops it replaces (unpack, compare, masked_fill) cost ~40-70 us a token at 4,096 tokens. */
void pw_mask_logits(float *logits, int vocab, const uint32_t *bits, int n_words) {
    int covered = n_words * 32 < vocab ? n_words * 32 : vocab;
    for (int w = 0; w * 32 < covered; w++) {
        uint32_t word = bits[w];
        if (word == 0xffffffffu) continue;
        int end = w * 32 + 32 < covered ? w * 32 + 32 : covered;
        for (int i = w * 32; i < end; i++)
            if (!((word >> (i & 31)) & 1u)) logits[i] = -INFINITY;
    }
    for (int i = covered; i < vocab; i++) logits[i] = -INFINITY;
}

/* Each row's argmax as torch's Tensor.argmax takes it: the first maximum, the first NaN if
 * the row has one. logits [rows][cols] fp32; out [rows] int64. One pass over a row: per
 * lane the running maximum and its index (a strict > keeps a lane's first), then the
 * lanes' maximum with the smallest index among its equals; a NaN seen anywhere sends the
 * row to a scalar scan for the first one. On a 2-core AMX Xeon, inside an engine step at
 * batch 32 of the reference checkpoint ([32, 32000]): 0.34 ms against torch.max(dim)'s 0.54. */
static long argmax_row(const float *x, int n) {
    long best = 0;
    int nan = 0, j = 0;
    if (n >= 32) {
        /* four accumulators of 8 lanes (values 32 apart): a blend's latency per vector
         * otherwise bounds the loop */
        __m256 m[4];
        __m256i idx[4], at[4];
        for (int a = 0; a < 4; a++) {
            m[a] = _mm256_loadu_ps(x + 8 * a);
            idx[a] = at[a] = _mm256_add_epi32(_mm256_set1_epi32(8 * a),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(m[a], m[a], _CMP_UNORD_Q));
        }
        const __m256i step = _mm256_set1_epi32(32), one = _mm256_set1_epi32(8);
        for (j = 32; j + 32 <= n; j += 32)
            for (int a = 0; a < 4; a++) {
                __m256 v = _mm256_loadu_ps(x + j + 8 * a);
                at[a] = _mm256_add_epi32(at[a], step);
                __m256 gt = _mm256_cmp_ps(v, m[a], _CMP_GT_OQ);
                nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                m[a] = _mm256_blendv_ps(m[a], v, gt);
                idx[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(idx[a]),
                                                              _mm256_castsi256_ps(at[a]), gt));
            }
        /* whole vectors left: the first accumulator (later indices; a strict > keeps its
         * first, and the merge below takes the smallest index among equal maxima) */
        __m256i at0 = _mm256_add_epi32(at[3], one);
        for (; j + 8 <= n; j += 8) {
            __m256 v = _mm256_loadu_ps(x + j);
            __m256 gt = _mm256_cmp_ps(v, m[0], _CMP_GT_OQ);
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m[0] = _mm256_blendv_ps(m[0], v, gt);
            idx[0] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(idx[0]),
                                                          _mm256_castsi256_ps(at0), gt));
            at0 = _mm256_add_epi32(at0, one);
        }
        float mv[32];
        int iv[32];
        for (int a = 0; a < 4; a++) {
            _mm256_storeu_ps(mv + 8 * a, m[a]);
            _mm256_storeu_si256((__m256i *)(iv + 8 * a), idx[a]);
        }
        best = iv[0];
        float bv = mv[0];
        for (int l = 1; l < 32; l++)
            if (mv[l] > bv || (mv[l] == bv && iv[l] < best)) {
                bv = mv[l];
                best = iv[l];
            }
        for (; j < n; j++) {  /* the tail: later indices, so a strict > */
            if (x[j] != x[j]) nan = 1;
            else if (x[j] > bv) {
                bv = x[j];
                best = j;
            }
        }
    } else {
        for (; j < n; j++) {
            if (x[j] != x[j]) nan = 1;
            else if (x[j] > x[best]) best = j;
        }
    }
    if (nan)
        for (j = 0; j < n; j++)
            if (x[j] != x[j]) return j;
    return best;
}

void pw_argmax_f32(const float *logits, int rows, int cols, int64_t *out, int nthreads) {
#pragma omp parallel for num_threads(rows > 1 ? nthreads : 1) schedule(static)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(logits + (long)r * cols, cols);
}

/* ---- Sampling: temperature, top-k, top-p and min-p, then one draw, per row ----
 *
 * A row's weights are w_i = exp((x_i - max) / T), so the largest is 1 (e^-87 and less, and
 * NaN logits, weigh 0). A token is kept when its weight is at least the largest of:
 *  - top-k: the k-th largest weight;
 *  - top-p: the nucleus's last weight, the one at which the weights from the largest down
 *    (those top-k kept) first hold top_p of their mass: the weights strictly above it hold
 *    less, those at least it at least top_p;
 *  - min-p: min_p (of the largest weight, 1).
 * Ties at a threshold are all kept. Both selections are radix selections (sample_select):
 * a pass over the row counts (top-k) or sums (top-p) it into 2,048 bins of the top 11 bits,
 * then the picked bin's values alone go through the next 11 bits and the last 10. Top-p
 * selects on the weights' bits (non-negative floats order as their bits do). A row with
 * top-k selects on its logits' bits (logit_key) and computes weights for the tokens it
 * keeps alone (sample_row_topk). No sort: a row of 151,936 logits costs a few passes, where
 * torch's sort took ~9 ms. Then the draw: the first token in vocabulary order whose running
 * sum of kept weights passes u times their total (sample_draw). */

/* A thread's room for a row: weights (or keys), a selection's bin, candidates' indices. */
static __thread float *samp_w;
static __thread int64_t samp_cap;

static float *sample_buffer(int64_t n) {
    if (n > samp_cap) {
        free(samp_w);
        samp_w = malloc(3 * (size_t)n * sizeof(float));
        samp_cap = samp_w ? n : 0;
    }
    return samp_w;
}

/* The weights into w and their sum; 0 where no logit is finite and below +inf. */
static double sample_weights(const float *x, int64_t n, float invt, float *w) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) mx = _mm256_max_ps(_mm256_loadu_ps(x + j), mx);  /* NaN: skipped */
    float mv[8];
    _mm256_storeu_ps(mv, mx);
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = mv[l] > m ? mv[l] : m;
    for (int64_t t = j; t < n; t++) m = x[t] > m ? x[t] : m;
    if (!(m > -INFINITY) || m == INFINITY) return 0.0;
    __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(invt), lo = _mm256_set1_ps(-87.0f);
    double sum = 0.0;
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 a = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vt);
        __m256 zero = _mm256_cmp_ps(a, lo, _CMP_NGE_UQ);  /* below e^-87, or NaN */
        __m256 e = _mm256_andnot_ps(zero, exp8(a));
        _mm256_storeu_ps(w + j, e);
        _mm256_storeu_ps(mv, e);
        sum += (double)((mv[0] + mv[1]) + (mv[2] + mv[3])) + (double)((mv[4] + mv[5]) + (mv[6] + mv[7]));
    }
    for (; j < n; j++) {
        float a = (x[j] - m) * invt;
        w[j] = a >= -87.0f ? expf(a) : 0.0f;
        sum += w[j];
    }
    return sum;
}

/* The weight v (its bits) among those >= floor at which the running total from the largest
 * weight down, of their count (by_mass 0) or their mass (1), first reaches target: the
 * weights above v total less than target, those at least v at least target. 0 (keep them
 * all) where the whole total falls short of target. The first level reads the whole row;
 * the weights of the bin it picks are gathered into sel (room for n), and the two finer
 * levels read those alone. */
static uint32_t sample_select(const float *w, int64_t n, uint32_t floor, double target,
                              int by_mass, float *sel) {
    static const int shift[3] = {21, 10, 0}, bins[3] = {2048, 2048, 1024};
    double hist[2048];
    uint32_t prefix = 0, fixed = 0;
    double above = 0.0;  /* the total of the weights above the bits fixed so far */
    const float *src = w;
    int64_t len = n;
    for (int l = 0; l < 3; l++) {
        memset(hist, 0, sizeof(double) * (size_t)bins[l]);
        if (by_mass) {
            for (int64_t j = 0; j < len; j++) {
                uint32_t b;
                memcpy(&b, src + j, 4);
                if (b < floor || (b & fixed) != prefix) continue;
                hist[(b >> shift[l]) & (uint32_t)(bins[l] - 1)] += (double)src[j];
            }
        } else {  /* counts in integers: no chain of dependent floating-point adds */
            uint32_t count[2048];
            memset(count, 0, sizeof(uint32_t) * (size_t)bins[l]);
            for (int64_t j = 0; j < len; j++) {
                uint32_t b;
                memcpy(&b, src + j, 4);
                if (b < floor || (b & fixed) != prefix) continue;
                count[(b >> shift[l]) & (uint32_t)(bins[l] - 1)]++;
            }
            for (int i = 0; i < bins[l]; i++) hist[i] = (double)count[i];
        }
        int bin = bins[l] - 1, lowest = -1;
        for (; bin >= 0; bin--) {
            if (hist[bin] > 0.0) lowest = bin;
            if (above + hist[bin] >= target) break;
            above += hist[bin];
        }
        if (bin < 0) {
            if (l == 0 || lowest < 0) return 0;
            /* the level above reached target, this one's sums fall short by rounding: the
             * smallest weight of the bin */
            bin = lowest;
            above -= hist[bin];
        }
        prefix |= (uint32_t)bin << shift[l];
        fixed |= (uint32_t)(bins[l] - 1) << shift[l];
        if (l == 0) {  /* gather the bin's weights: the finer levels read only those */
            int64_t m = 0;
            for (int64_t j = 0; j < n; j++) {
                uint32_t b;
                memcpy(&b, w + j, 4);
                if (b >= floor && (b & fixed) == prefix) memcpy(sel + m++, w + j, 4);
            }
            src = sel;
            len = m;
        }
    }
    return prefix;
}

/* Sum of the weights >= tau in w[j .. j + 8). */
static inline double kept8(const float *w, __m256 tau) {
    __m256 v = _mm256_loadu_ps(w);
    v = _mm256_and_ps(v, _mm256_cmp_ps(v, tau, _CMP_GE_OQ));
    float s[8];
    _mm256_storeu_ps(s, v);
    return (double)((s[0] + s[1]) + (s[2] + s[3])) + (double)((s[4] + s[5]) + (s[6] + s[7]));
}

/* The draw among n weights w (of the tokens idx, or 0 .. n - 1 where idx is NULL, in
 * ascending order) at least tau: the first whose running sum passes u times their total. */
static int64_t sample_draw(const float *w, const int32_t *idx, int64_t n, float tau, float u) {
    __m256 vt = _mm256_set1_ps(tau);
    int64_t j = 0;
    double kept = 0.0;  /* in the order the walk below adds it */
    for (; j + 8 <= n; j += 8) kept += kept8(w + j, vt);
    for (int64_t t = j; t < n; t++) kept += w[t] >= tau ? w[t] : 0.0f;
    double target = (double)u * kept, acc = 0.0;
    int64_t pick = -1;
    for (j = 0; j + 8 <= n && pick < 0; j += 8) {
        double block = kept8(w + j, vt);
        if (acc + block > target) {
            double a = acc;
            for (int t = 0; t < 8 && pick < 0; t++)
                if (w[j + t] >= tau && w[j + t] > 0.0f && (a += w[j + t]) > target) pick = j + t;
        }
        acc += block;
    }
    for (; j < n && pick < 0; j++)
        if (w[j] >= tau && w[j] > 0.0f && (acc += w[j]) > target) pick = j;
    for (j = n - 1; j >= 0 && pick < 0; j--)  /* u * kept rounded past the sum: the last */
        if (w[j] >= tau && w[j] > 0.0f) pick = j;
    return pick < 0 ? -1 : idx ? idx[pick] : pick;
}

/* The mass a nucleus must reach: top_p of total, at least the smallest positive double
 * (a top_p that rounds to 0 in fp32 keeps the largest weight, as the sort's top_p does). */
static inline double nucleus_mass(float top_p, double total) {
    double t = (double)top_p * total;
    return t > DBL_MIN ? t : DBL_MIN;
}

/* A logit's bits in an order that follows its value; NaN the lowest, -0 as +0. */
static inline uint32_t logit_key(float f) {
    if (f != f) return 0;
    uint32_t b = f == 0.0f ? 0u : f32_bits(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* A row with top-k: the k-th largest logit by radix selection on the logits' keys (no
 * weights for the whole vocabulary), the tokens at least it gathered (in vocabulary order),
 * and the weights, top-p, min-p and the draw over those alone. */
static int64_t sample_row_topk(const float *x, int64_t n, float invt, int top_k, float top_p,
                               float min_p, float u, float *buf) {
    float *keys = buf, *sel = buf + n;
    int32_t *idx = (int32_t *)(buf + 2 * n);
    for (int64_t j = 0; j < n; j++) {
        uint32_t k = logit_key(x[j]);
        memcpy(keys + j, &k, 4);
    }
    uint32_t kt = sample_select(keys, n, 0, (double)top_k, 0, sel);
    float *cx = keys;  /* the candidates' logits, over the keys already read */
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++)
        if (x[j] == x[j] && logit_key(x[j]) >= kt) {
            cx[m] = x[j];
            idx[m++] = (int32_t)j;
        }
    double total = sample_weights(cx, m, invt, sel);
    if (!(total > 0.0) || total == INFINITY) return -1;
    uint32_t floor = 0;
    if (top_p < 1.0f) floor = sample_select(sel, m, 0, nucleus_mass(top_p, total), 1, cx);
    float tau = bits_f32(floor);
    if (min_p > tau) tau = min_p;
    return sample_draw(sel, idx, m, tau, u);
}

static int64_t sample_row(const float *x, int64_t n, float temp, int top_k, float top_p,
                          float min_p, float u) {
    float *w = sample_buffer(n);
    if (!w || !(temp > 0.0f) || n > INT32_MAX) return -1;
    if (top_k > 0 && top_k < n) return sample_row_topk(x, n, 1.0f / temp, top_k, top_p, min_p,
                                                       u, w);
    float *sel = w + n;
    double total = sample_weights(x, n, 1.0f / temp, w);
    if (!(total > 0.0) || total == INFINITY) return -1;
    uint32_t floor = 0;
    if (top_p < 1.0f) floor = sample_select(w, n, 0, nucleus_mass(top_p, total), 1, sel);
    float tau = bits_f32(floor);
    if (min_p > tau) tau = min_p;
    return sample_draw(w, NULL, n, tau, u);
}

/* One token a row of logits [rows, cols] (fp32, contiguous) with each row's temperature (>
 * 0), top_k (0: off), top_p (>= 1: off), min_p (0: off) and uniform number u in [0, 1).
 * Returns 0, or 1 where some row's logits left nothing to draw (no finite logit, +inf, a
 * temperature of 0): its out is -1 and the caller takes another way. */
int pw_sample_f32(const float *logits, int rows, int cols, const float *temps,
                  const int *top_ks, const float *top_ps, const float *min_ps, const float *u,
                  int64_t *out, int nthreads) {
    int failed = 0;
#pragma omp parallel for num_threads(rows > 1 ? nthreads : 1) schedule(dynamic) reduction(| : failed)
    for (int r = 0; r < rows; r++) {
        out[r] = sample_row(logits + (long)r * cols, cols, temps[r], top_ks[r], top_ps[r],
                            min_ps[r], u[r]);
        if (out[r] < 0) failed = 1;
    }
    return failed;
}

/* ---- Penalties: repetition (over prompt and outputs), presence and frequency (outputs) ----
 *
 * For each listed row of logits [.., cols] (fp32, contiguous, changed in place): every
 * distinct token among its ids (prompt then outputs; ids outside [0, cols) skipped) has its
 * logit divided by rep where positive, multiplied where not; then every distinct token among
 * the outputs (ids from nprompt on) loses freq * its count + pres. The torch path's order and
 * arithmetic, a token at a time instead of a gather, a sort and a bincount over the
 * vocabulary. A thread's count table (cols words, the top bit marking a token seen) is left
 * zeroed by clearing the entries the row touched. */

#define PEN_SEEN 0x80000000u

static __thread uint32_t *pen_count;
static __thread int64_t pen_cap;

static uint32_t *penalty_table(int64_t cols) {
    if (cols > pen_cap) {
        free(pen_count);
        pen_count = calloc((size_t)cols, sizeof(uint32_t));
        pen_cap = pen_count ? cols : 0;
    }
    return pen_count;
}

int pw_penalties_f32(float *logits, int cols, const int32_t *rows, int nrows,
                     const int32_t *ids, const int64_t *offs, const int64_t *nprompt,
                     const float *rep, const float *pres, const float *freq, int nthreads) {
    int failed = 0;
#pragma omp parallel for num_threads(nrows > 1 ? nthreads : 1) schedule(dynamic) reduction(| : failed)
    for (int k = 0; k < nrows; k++) {
        uint32_t *count = penalty_table(cols);
        if (!count) {
            failed = 1;
            continue;
        }
        float *x = logits + (long)rows[k] * cols;
        const int32_t *t = ids + offs[k];
        int64_t n = offs[k + 1] - offs[k], np = nprompt[k];
        if (rep[k] != 1.0f)
            for (int64_t i = 0; i < n; i++) {
                int32_t id = t[i];
                if (id < 0 || id >= cols || (count[id] & PEN_SEEN)) continue;
                count[id] |= PEN_SEEN;
                x[id] = x[id] > 0.0f ? x[id] / rep[k] : x[id] * rep[k];
            }
        if (pres[k] != 0.0f || freq[k] != 0.0f) {
            for (int64_t i = np; i < n; i++)
                if (t[i] >= 0 && t[i] < cols) count[t[i]]++;
            for (int64_t i = np; i < n; i++) {
                int32_t id = t[i];
                if (id < 0 || id >= cols) continue;
                uint32_t c = count[id] & ~PEN_SEEN;
                if (!c) continue;  /* applied already */
                float fc = freq[k] * (float)c;
                __asm__("" : "+x"(fc));  /* rounded here, as torch does: no fused multiply-add */
                x[id] -= fc + pres[k];
                count[id] &= PEN_SEEN;
            }
        }
        for (int64_t i = 0; i < n; i++)
            if (t[i] >= 0 && t[i] < cols) count[t[i]] = 0;
    }
    return failed;
}

/* ---- Logprobs: the sampled token's and the top n's, per row ----
 *
 * For each listed row of logits [.., cols] (fp32, contiguous): log-softmax's normaliser
 * max + log(sum e^(x - max)) in one exp pass (exp8, double sums), the sampled token's
 * log-probability, and the n (<= 20) largest logits with their log-probabilities, kept by
 * insertion in one pass (ties: the lower id first). Where torch took a log-softmax of the
 * whole batch and a topk a row. A row with a NaN or no finite logit fails (1): the caller
 * takes torch's way. */

#define LOGPROBS_MAX 20

int pw_logprobs_f32(const float *logits, int cols, const int32_t *rows, int nrows,
                    const int64_t *tokens, const int32_t *ns, float *token_lp, float *top_lp,
                    int64_t *top_ids, int nthreads) {
    int failed = 0;
#pragma omp parallel for num_threads(nrows > 1 ? nthreads : 1) schedule(dynamic) reduction(| : failed)
    for (int k = 0; k < nrows; k++) {
        const float *x = logits + (long)rows[k] * cols;
        int n = ns[k] < LOGPROBS_MAX ? ns[k] : LOGPROBS_MAX;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        int nan = 0;
        int64_t j = 0;
        for (; j + 8 <= cols; j += 8) {
            __m256 v = _mm256_loadu_ps(x + j);
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mx = _mm256_max_ps(v, mx);
        }
        float mv[8];
        _mm256_storeu_ps(mv, mx);
        float m = -INFINITY;
        for (int l = 0; l < 8; l++) m = mv[l] > m ? mv[l] : m;
        for (int64_t t = j; t < cols; t++) {
            nan |= x[t] != x[t];
            m = x[t] > m ? x[t] : m;
        }
        if (nan || !(m > -INFINITY) || m == INFINITY) {
            failed = 1;
            continue;
        }
        __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f);
        double sum = 0.0;
        for (j = 0; j + 8 <= cols; j += 8) {
            __m256 a = _mm256_sub_ps(_mm256_loadu_ps(x + j), vm);
            __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(a, lo, _CMP_NGE_UQ), exp8(a));
            _mm256_storeu_ps(mv, e);
            sum += (double)((mv[0] + mv[1]) + (mv[2] + mv[3])) +
                   (double)((mv[4] + mv[5]) + (mv[6] + mv[7]));
        }
        for (; j < cols; j++) {
            float a = x[j] - m;
            sum += a >= -87.0f ? expf(a) : 0.0f;
        }
        float lse = m + (float)log(sum);
        int64_t tok = tokens[k];
        token_lp[k] = tok >= 0 && tok < cols ? x[tok] - lse : -INFINITY;
        float best[LOGPROBS_MAX];
        int64_t ids[LOGPROBS_MAX];
        int have = 0;
        for (j = 0; j < cols && n > 0; j++) {
            float v = x[j];
            if (have == n && !(v > best[n - 1])) continue;
            int at = have < n ? have++ : n - 1;
            while (at > 0 && v > best[at - 1]) {  /* a later equal value stays behind */
                best[at] = best[at - 1];
                ids[at] = ids[at - 1];
                at--;
            }
            best[at] = v;
            ids[at] = j;
        }
        for (int t = 0; t < n; t++) {
            top_lp[(long)k * LOGPROBS_MAX + t] = t < have ? best[t] - lse : -INFINITY;
            top_ids[(long)k * LOGPROBS_MAX + t] = t < have ? ids[t] : -1;
        }
    }
    return failed;
}
