/*
 * phasewise CPU kernels for AVX512_BF16 without AMX (AMD Zen 4 and 5, Intel Cooper Lake): a
 * bf16 linear layer on VDPBF16PS, for the fused decode layer's projections and for the
 * linear dispatch's rows between the weight streams and torch's GEMM.
 *
 * Why hand-written: on these CPUs cpu_kernels.c's AVX2 paths widen each bf16 weight to fp32
 * and multiply in fp32, a fifth of the bf16 dot-product rate (2-core AMD EPYC with
 * AVX512_BF16: torch's bf16 matmul 1046 GFLOP/s, its fp32 one 237), and torch's bf16 GEMM
 * (oneDNN) goes op by op through Python, reordering each weight on every call: a batch-32
 * decode step of the reference checkpoint took 65-75 ms against a 27 ms roofline there.
 *
 * The arithmetic: VDPBF16PS adds to each of 16 fp32 lanes the two products of a pair of
 * bf16 values (exact in fp32) from each operand. Both operands here run along K: 32 values
 * of a weight row (torch's [N, K] layout, read in place, never repacked) against the same
 * 32 values of an activation row (converted to bf16 once per call, exactly: they are bf16
 * values already), so a lane holds a partial dot product of one (token, channel) pair. A
 * register tile keeps 4 weight rows x up to 6 tokens (24 accumulators), reads K once, and
 * reduces the 16 lanes of each accumulator at the end (4 channels of a token at once). The
 * fp32 sums (up to summation order: the weight streams' and torch's sums are ordered
 * differently too) go to the fused layer's results, or take the bias and one rounding to
 * bf16 (to nearest even; NaN stays NaN) for a plain linear layer.
 *
 * The inputs' denormals count as zero in VDPBF16PS (it always does; |x| < 1.2e-38 in bf16).
 *
 * Layout: x [M, K] bf16 row-major, w [N, K] bf16 row-major, optional bias [N] bf16,
 * y [M, N] bf16; fused-layer results res [M, N] fp32.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

#define DP_R 4          /* weight rows a tile */
#define DP_MT 6         /* the most tokens a tile */
#define DP_XBLOCK_BYTES (512L * 1024) /* a block of tokens' bf16 rows, kept in L2 */

static inline float dp_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t dp_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t u = v.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Four fp32 values rounded to bf16 (to nearest even; a NaN keeps its sign and payload's top
 * bits and is made quiet, as dp_f32_to_bf16) and stored. */
static inline void dp_store4_bf16(uint16_t *y, __m128 f) {
    __m128i u = _mm_castps_si128(f);
    __m128i r = _mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7fff),
                                               _mm_and_si128(_mm_srli_epi32(u, 16),
                                                             _mm_set1_epi32(1))));
    __mmask8 nan = _mm_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm_mask_or_epi32(r, nan, u, _mm_set1_epi32(0x400000));
    __m128i h = _mm_cvtepi32_epi16(_mm_srli_epi32(r, 16));
    _mm_storel_epi64((__m128i *)y, h);
}

/* The sums of four 16-lane vectors: {sum a, sum b, sum c, sum d}. */
static inline __m128 dp_hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Where a tile's results go: fp32 sums into res (ldr floats a token), or, when y is set,
 * bf16(sum + bias) into y (ldr values a token). */
typedef struct {
    float *res;
    uint16_t *y;
    const uint16_t *bias;
    long ldr;
} DpOut;

/* One tile: R (4 or 1) weight rows from w (row n0 of the layer: K values a row) against MT
 * tokens of x (ldx values a token), all of K; `pf`, if set, is prefetched alongside (the
 * next tile's rows). Always inlined with constant R and MT, so the accumulators stay in
 * registers (24 of the 32 at 4 x 6). */
static inline __attribute__((always_inline)) void dp_tile(
        const int R, const int MT, const uint16_t *x, long ldx, const uint16_t *w, int K,
        int n0, const uint16_t *pf, const DpOut *out) {
    __m512 acc[DP_MT][DP_R];
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[DP_R];
        for (int r = 0; r < R; r++) {
            if (pf) _mm_prefetch((const char *)(pf + (long)r * K + k), _MM_HINT_T0);
            wv[r] = (__m512bh)_mm512_loadu_si512(w + (long)r * K + k);
        }
        for (int m = 0; m < MT; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (long)m * ldx + k);
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    if (k < K) {  /* the last K % 32 values, both operands masked (no NaN from past the end) */
        __mmask32 km = (__mmask32)((1ull << (K - k)) - 1u);
        __m512bh wv[DP_R];
        for (int r = 0; r < R; r++)
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(km, w + (long)r * K + k);
        for (int m = 0; m < MT; m++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(km, x + (long)m * ldx + k);
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    if (R == 4) {
        __m128 b = _mm_setzero_ps();
        if (out->y && out->bias) {
            __m128i h = _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)(out->bias + n0)));
            b = _mm_castsi128_ps(_mm_slli_epi32(h, 16));
        }
        for (int m = 0; m < MT; m++) {
            __m128 s = dp_hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
            if (out->y)
                dp_store4_bf16(out->y + (long)m * out->ldr + n0, _mm_add_ps(s, b));
            else
                _mm_storeu_ps(out->res + (long)m * out->ldr + n0, s);
        }
    } else {
        float b = out->y && out->bias ? dp_bf16_to_f32(out->bias[n0]) : 0.0f;
        for (int m = 0; m < MT; m++) {
            float s = _mm512_reduce_add_ps(acc[m][0]);
            if (out->y)
                out->y[(long)m * out->ldr + n0] = dp_f32_to_bf16(s + b);
            else
                out->res[(long)m * out->ldr + n0] = s;
        }
    }
}

#define DP_CASE(R, MT) case MT: dp_tile(R, MT, x, ldx, w, K, n0, pf, out); break;
static void dp_tile4(int mt, const uint16_t *x, long ldx, const uint16_t *w, int K, int n0,
                     const uint16_t *pf, const DpOut *out) {
    switch (mt) { DP_CASE(4, 1) DP_CASE(4, 2) DP_CASE(4, 3) DP_CASE(4, 4) DP_CASE(4, 5)
                  default: dp_tile(4, 6, x, ldx, w, K, n0, pf, out); }
}
static void dp_tile1(int mt, const uint16_t *x, long ldx, const uint16_t *w, int K, int n0,
                     const DpOut *out) {
    const uint16_t *pf = NULL;
    switch (mt) { DP_CASE(1, 1) DP_CASE(1, 2) DP_CASE(1, 3) DP_CASE(1, 4) DP_CASE(1, 5)
                  default: dp_tile(1, 6, x, ldx, w, K, n0, pf, out); }
}
#undef DP_CASE

/* This thread's share of the N weight rows (in groups of 4; the last thread also takes the
 * N % 4 rows left) against the M tokens of x (bf16, K values a token): for each block of
 * tokens that fits DP_XBLOCK_BYTES, each group of 4 rows meets every token of the block in
 * sub-blocks of up to 6 (the group's rows stay in L1 meanwhile); while the first sub-block
 * runs, the next group's rows are prefetched. Called by every thread of a parallel region;
 * no barrier. */
static void dp_share(const uint16_t *x, int M, const uint16_t *w, int K, int N,
                     const DpOut *out) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int groups = N / 4;
    int g_lo = (int)((long)groups * t / T), g_hi = (int)((long)groups * (t + 1) / T);
    int tail = t == T - 1 ? N - 4 * groups : 0;
    long row_bytes = 2L * K;
    int block = (int)(DP_XBLOCK_BYTES / row_bytes);
    if (block < DP_MT) block = DP_MT;
    for (int m0 = 0; m0 < M; m0 += block) {
        int mb = M - m0 < block ? M - m0 : block;
        int nsub = (mb + DP_MT - 1) / DP_MT;
        for (int g = g_lo; g < g_hi; g++) {
            const uint16_t *wg = w + (long)g * 4 * K;
            const uint16_t *pf = g + 1 < g_hi ? wg + 4L * K : NULL;
            int ms = m0;
            for (int s = 0; s < nsub; s++) {  /* sub-blocks of balanced sizes, at most 6 */
                int mt = mb / nsub + (s < mb % nsub);
                DpOut o = *out;
                if (o.y) o.y += (long)ms * o.ldr; else o.res += (long)ms * o.ldr;
                dp_tile4(mt, x + (long)ms * K, K, wg, K, 4 * g, s == 0 ? pf : NULL, &o);
                ms += mt;
            }
        }
        for (int n = N - tail; n < N; n++) {
            int ms = m0;
            for (int s = 0; s < nsub; s++) {
                int mt = mb / nsub + (s < mb % nsub);
                DpOut o = *out;
                if (o.y) o.y += (long)ms * o.ldr; else o.res += (long)ms * o.ldr;
                dp_tile1(mt, x + (long)ms * K, K, w + (long)n * K, K, n, &o);
                ms += mt;
            }
        }
    }
}

/* y = bf16(x w^T + bias): x [M, K], w [N, K], bias [N] or NULL, y [M, N], all bf16. Returns
 * 0. */
int pw_linear_dp(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int M, int N, int K, int nthreads) {
    DpOut out = {NULL, y, bias, N};
#pragma omp parallel num_threads(nthreads)
    dp_share(x, M, w, K, N, &out);
    return 0;
}

/* The fused decode layer's side (cpu_kernels.c): x fp32 [M, K] (bf16 values) -> xb bf16
 * [M, K], the rows shared by the threads of the calling region (an orphaned omp for, with
 * its barrier making them visible). */
void pw_dp_pack_f32(const float *x, int M, int K, uint16_t *xb) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        const float *src = x + (long)m * K;
        uint16_t *dst = xb + (long)m * K;
        int k = 0;
        for (; k + 32 <= K; k += 32) {
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16),
                                             _mm512_loadu_ps(src + k));
            _mm512_storeu_si512(dst + k, (__m512i)v);
        }
        for (; k < K; k++) dst[k] = dp_f32_to_bf16(src[k]);
    }
}

/* ... and its projection share: res [M, N] fp32 = xb w^T for this thread's rows. No
 * barrier. */
void pw_dp_share(const uint16_t *xb, int M, const uint16_t *w, int K, int N, float *res) {
    DpOut out = {res, NULL, NULL, N};
    dp_share(xb, M, w, K, N, &out);
}

#pragma GCC pop_options
