/*
 * phasewise CPU kernels: bf16-weight linear layers for x86-64 CPUs with AVX2 and FMA.
 *
 * Why hand-written: on CPUs without native bf16 dot products (no AVX512_BF16 / AMX),
 * torch's bf16 GEMM/GEMV runs well below the memory bandwidth at batch 1 and below its own
 * fp32 GEMM at larger batches (figures: benchmarks/RESULTS.md). Decode reads every weight
 * once per step, so the weight stream must run at memory speed. These kernels widen each bf16 weight to fp32 in
 * registers (a 16-bit shift) and accumulate in fp32, reading every weight exactly once per
 * call however many rows of activations there are.
 *
 * Layout: x [M, K] bf16 row-major, w [N, K] bf16 row-major (torch's Linear weight), optional
 * bias [N] bf16, y [M, N] bf16. Accumulation in fp32, one rounding (to nearest even) at the
 * end, as torch does.
 */
#include "avx2_common.h"

/* Row streaming for very few activation rows: one weight row at a time, read once, with a
 * software prefetch ahead of the stream (at 1-4 rows this streams faster than no prefetch
 * and than the tiles below: the hardware prefetchers alone leave the stream short of memory
 * speed). */
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
#ifndef INT8_TILE_ROWS_MAX
#define INT8_TILE_ROWS_MAX 128 /* int8 tiles up to this many rows, the packed GEMM above */
#endif

/* Two weight rows (w0, w1) against M <= 3 activation rows. Streaming rows that lie far apart
 * keeps independent memory streams in flight per core: one stream a core leaves the memory
 * bandwidth short, two come close to a plain large-tensor read. */
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
 * (more streams in flight than two, for the rows that leave registers for them). o[r][m]. */
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
 * streams whose addresses agree below 4 KiB read slower (they contend for the same cache
 * sets and the loads' 4 KiB aliasing checks). Each row's dot product is unchanged, so the
 * results keep their bits. */
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

/* The few-rows linear layer: every thread streams its share of the weights (bf16, or int8
 * with `scale`), then the bias and the rounding. */
static int linear_rows(const float *x, const void *w, const float *scale, const uint16_t *bias,
                       uint16_t *y, int M, int N, int K, int nthreads) {
    float *res = (float *)malloc(sizeof(float) * (size_t)M * N);
    if (!res) return -1;
#pragma omp parallel num_threads(nthreads)
    {
        pw_proj_share(x, M, w, scale, K, N, res);
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
void pw_permute_row_any(const uint16_t *src, const float *srcf, float *dst, int K, int K16) {
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
    pw_permute_row_any(src, NULL, dst, K, K16);
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
void pw_tiles_share(const float *x, const void *w, const float *scale, const uint16_t *bias,
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
         * lines on their way cost little). */
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
        pw_tiles_share(x, w, scale, bias, y, NULL, M, N, K);
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
 * Weight-only int8 (issue 15): w [N, K] int8 with one fp32 scale per output row (symmetric,
 * per output channel: w_real[n][k] = scale[n] * w[n][k]); activations stay bf16, accumulation
 * is fp32. For the few rows of a decode step: each weight byte is read once per call, widened
 * in registers (vpmovsxbd, vcvtdq2ps: 8 weights per 8-byte load) and met by every activation
 * row; each thread streams four weight rows at once (as quad_dot), so four memory streams are
 * in flight per core. The scale multiplies the finished dot product, once per output.
 */
/* Prefetch 1 KiB ahead in each stream: an int8 row is half a bf16 row's bytes, so the
 * stream needs the lines farther ahead to cover memory latency (benchmarks/bench_quant.py
 * compares distances). The streams wait on memory, not on the vector units: fewer
 * instructions per weight byte (AVX-512) would not make them faster. */
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
void pw_proj_share(const float *x, int M, const void *w, const float *scale, int K, int N,
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

/* Read bandwidth probe: sums `n` bf16 words as fp32 with four streams per thread, the same
 * access pattern as the GEMV above, their addresses a quarter of a 4 KiB page apart (as
 * stream_skew places the GEMV's; streams a multiple of 4 KiB apart read slower). Returns
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
