/*
 * phasewise CPU kernels for AVX512_BF16 without AMX (AMD Zen 4 and 5, Intel Cooper Lake): a
 * bf16 linear layer on VDPBF16PS, for the fused decode layer's projections and for the
 * linear dispatch's rows between the weight streams and torch's GEMM; the panels layout and
 * its kernel; prefill and decode attention, SiLU-and-multiply and the RMSNorm rows of
 * cpu_kernels.c on 16 lanes (these last also on AMX machines, which compile this file too).
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
#include <math.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

#include "cpu_avx512.h"  /* exp16, exp16_fast, lazy_alpha, softmax_step: shared with cpu_amx.c */
#include "cpu_paged.h"   /* paged_row_offs: the paged cache's rows */

#define AVX512BF16_R 4          /* weight rows a tile (3 for 7-8 tokens) */
#define AVX512BF16_MT 8         /* the most tokens a tile (6 of 4 rows, 8 of 3) */
#define AVX512BF16_XBLOCK_BYTES (512L * 1024) /* a block of tokens' bf16 rows, kept in L2 */

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

/* Four fp32 values rounded to bf16 (to nearest even; a NaN keeps its sign and payload's top
 * bits and is made quiet, as avx512bf16_f32_to_bf16) and stored. */
static inline void avx512bf16_store4_bf16(uint16_t *y, __m128 f) {
    __m128i u = _mm_castps_si128(f);
    __m128i r = _mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7fff),
                                               _mm_and_si128(_mm_srli_epi32(u, 16),
                                                             _mm_set1_epi32(1))));
    __mmask8 nan = _mm_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    r = _mm_mask_or_epi32(r, nan, u, _mm_set1_epi32(0x400000));
    __m128i h = _mm_cvtepi32_epi16(_mm_srli_epi32(r, 16));
    _mm_storel_epi64((__m128i *)y, h);
}

/* avx512bf16_store4_bf16 of the first three values. */
static inline void avx512bf16_store3_bf16(uint16_t *y, __m128 f) {
    uint16_t t[4];
    avx512bf16_store4_bf16(t, f);
    y[0] = t[0];
    y[1] = t[1];
    y[2] = t[2];
}

/* The sums of four 16-lane vectors: {sum a, sum b, sum c, sum d}. */
static inline __m128 avx512bf16_hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
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
    int glu;    /* panels only (pk_share): the SiLU-and-multiply epilogue; ldr = I then */
    int widen;  /* panels only, y NULL: bf16(sum + bias) as fp32 into res (y's values) */
} Avx512bf16Out;

/* One tile: R (4 or 1) weight rows from w (row n0 of the layer: K values a row) against MT
 * tokens of x (ldx values a token), all of K; `pf`, if set, is prefetched alongside (the
 * next tile's rows). Always inlined with constant R and MT, so the accumulators stay in
 * registers (24 of the 32 at 4 x 6). */
static inline __attribute__((always_inline)) void avx512bf16_tile(
        const int R, const int MT, const uint16_t *x, long ldx, const uint16_t *w, int K,
        int n0, const uint16_t *pf, const Avx512bf16Out *out) {
    __m512 acc[AVX512BF16_MT][AVX512BF16_R];
    for (int m = 0; m < MT; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[AVX512BF16_R];
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
        __m512bh wv[AVX512BF16_R];
        for (int r = 0; r < R; r++)
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(km, w + (long)r * K + k);
        for (int m = 0; m < MT; m++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(km, x + (long)m * ldx + k);
            for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    if (R >= 3) {
        __m128 b = _mm_setzero_ps();
        __mmask8 nm = R == 4 ? 0xf : 0x7;
        if (out->y && out->bias) {
            __m128i h = _mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(nm, out->bias + n0));
            b = _mm_castsi128_ps(_mm_slli_epi32(h, 16));
        }
        for (int m = 0; m < MT; m++) {
            __m128 s = avx512bf16_hsum4(acc[m][0], acc[m][1], acc[m][2],
                                R == 4 ? acc[m][3] : _mm512_setzero_ps());
            if (out->y && R == 4)
                avx512bf16_store4_bf16(out->y + (long)m * out->ldr + n0, _mm_add_ps(s, b));
            else if (out->y)
                avx512bf16_store3_bf16(out->y + (long)m * out->ldr + n0, _mm_add_ps(s, b));
            else
                _mm_mask_storeu_ps(out->res + (long)m * out->ldr + n0, nm, s);
        }
    } else {
        float b = out->y && out->bias ? avx512bf16_bf16_to_f32(out->bias[n0]) : 0.0f;
        for (int m = 0; m < MT; m++) {
            float s = _mm512_reduce_add_ps(acc[m][0]);
            if (out->y)
                out->y[(long)m * out->ldr + n0] = avx512bf16_f32_to_bf16(s + b);
            else
                out->res[(long)m * out->ldr + n0] = s;
        }
    }
}

#define AVX512BF16_CASE(R, MT) case MT: avx512bf16_tile(R, MT, x, ldx, w, K, n0, pf, out); break;
static void avx512bf16_tile3(int mt, const uint16_t *x, long ldx, const uint16_t *w, int K, int n0,
                     const uint16_t *pf, const Avx512bf16Out *out) {
    switch (mt) { AVX512BF16_CASE(3, 1) AVX512BF16_CASE(3, 2) AVX512BF16_CASE(3, 3) AVX512BF16_CASE(3, 4) AVX512BF16_CASE(3, 5)
                  AVX512BF16_CASE(3, 6) AVX512BF16_CASE(3, 7) default: avx512bf16_tile(3, 8, x, ldx, w, K, n0, pf, out); }
}
static void avx512bf16_tile4(int mt, const uint16_t *x, long ldx, const uint16_t *w, int K, int n0,
                     const uint16_t *pf, const Avx512bf16Out *out) {
    switch (mt) { AVX512BF16_CASE(4, 1) AVX512BF16_CASE(4, 2) AVX512BF16_CASE(4, 3) AVX512BF16_CASE(4, 4) AVX512BF16_CASE(4, 5)
                  default: avx512bf16_tile(4, 6, x, ldx, w, K, n0, pf, out); }
}
static void avx512bf16_tile1(int mt, const uint16_t *x, long ldx, const uint16_t *w, int K, int n0,
                     const Avx512bf16Out *out) {
    const uint16_t *pf = NULL;
    switch (mt) { AVX512BF16_CASE(1, 1) AVX512BF16_CASE(1, 2) AVX512BF16_CASE(1, 3) AVX512BF16_CASE(1, 4) AVX512BF16_CASE(1, 5)
                  AVX512BF16_CASE(1, 6) AVX512BF16_CASE(1, 7) default: avx512bf16_tile(1, 8, x, ldx, w, K, n0, pf, out); }
}
#undef AVX512BF16_CASE

/* This thread's share of the N weight rows (in groups of 4; the last thread also takes the
 * N % 4 rows left) against the M tokens of x (bf16, K values a token): for each block of
 * tokens that fits AVX512BF16_XBLOCK_BYTES, each group of 4 rows meets every token of the block in
 * sub-blocks of up to 6 (the group's rows stay in L1 meanwhile); while the first sub-block
 * runs, the next group's rows are prefetched. Called by every thread of a parallel region;
 * no barrier. */
static void avx512bf16_share(const uint16_t *x, int M, const uint16_t *w, int K, int N,
                     const Avx512bf16Out *out) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    /* 7 or 8 tokens: 3 weight rows x all of them, one pass over the weights (4 x 4 + 4 x
     * 4 read each group twice); else 4 rows x up to 6 */
    const int R = M == 7 || M == 8 ? 3 : 4, MTMAX = R == 3 ? 8 : 6;
    int groups = N / R;
    int g_lo = (int)((long)groups * t / T), g_hi = (int)((long)groups * (t + 1) / T);
    int tail = t == T - 1 ? N - R * groups : 0;
    long row_bytes = 2L * K;
    int block = (int)(AVX512BF16_XBLOCK_BYTES / row_bytes);
    if (block < MTMAX) block = MTMAX;
    for (int m0 = 0; m0 < M; m0 += block) {
        int mb = M - m0 < block ? M - m0 : block;
        int nsub = (mb + MTMAX - 1) / MTMAX;
        for (int g = g_lo; g < g_hi; g++) {
            const uint16_t *wg = w + (long)g * R * K;
            const uint16_t *pf = g + 1 < g_hi ? wg + (long)R * K : NULL;
            int ms = m0;
            for (int s = 0; s < nsub; s++) {  /* sub-blocks of balanced sizes */
                int mt = mb / nsub + (s < mb % nsub);
                Avx512bf16Out o = *out;
                if (o.y) o.y += (long)ms * o.ldr; else o.res += (long)ms * o.ldr;
                if (R == 3)
                    avx512bf16_tile3(mt, x + (long)ms * K, K, wg, K, R * g, s == 0 ? pf : NULL, &o);
                else
                    avx512bf16_tile4(mt, x + (long)ms * K, K, wg, K, R * g, s == 0 ? pf : NULL, &o);
                ms += mt;
            }
        }
        for (int n = N - tail; n < N; n++) {
            int ms = m0;
            for (int s = 0; s < nsub; s++) {
                int mt = mb / nsub + (s < mb % nsub);
                Avx512bf16Out o = *out;
                if (o.y) o.y += (long)ms * o.ldr; else o.res += (long)ms * o.ldr;
                avx512bf16_tile1(mt, x + (long)ms * K, K, w + (long)n * K, K, n, &o);
                ms += mt;
            }
        }
    }
}

/* y = bf16(x w^T + bias): x [M, K], w [N, K], bias [N] or NULL, y [M, N], all bf16. Returns
 * 0. */
int pw_linear_avx512bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                 int M, int N, int K, int nthreads) {
    Avx512bf16Out out = {NULL, y, bias, N};
#pragma omp parallel num_threads(nthreads)
    avx512bf16_share(x, M, w, K, N, &out);
    return 0;
}

/* The fused decode layer's side (cpu_kernels.c): x fp32 [M, K] (bf16 values) -> xb bf16
 * [M, K], the rows shared by the threads of the calling region (an orphaned omp for, with
 * its barrier making them visible). */
void pw_avx512bf16_pack_f32(const float *x, int M, int K, uint16_t *xb) {
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
        for (; k < K; k++) dst[k] = avx512bf16_f32_to_bf16(src[k]);
    }
}

/* ... and its projection share: res [M, N] fp32 = xb w^T for this thread's rows. No
 * barrier. */
void pw_avx512bf16_share(const uint16_t *xb, int M, const uint16_t *w, int K, int N, float *res) {
    Avx512bf16Out out = {res, NULL, NULL, N};
    avx512bf16_share(xb, M, w, K, N, &out);
}

/* ---------------------------------------------------------------------------------------
 * Prefill attention on AVX512_BF16: one request's chunk of n queries (positions ctx ..
 * ctx + n - 1) against its ctx + n keys in the paged cache (this chunk's already written),
 * causally, flash-style and transposed, as cpu_amx.c's tile version, so the softmax never
 * reduces across a vector: per 16 queries of one head (the lanes) and 32 keys a step,
 *   S^T [32 keys] = K Q^T: Q^T in pair order (a vector of 16 queries' dims 2p, 2p + 1 per
 *       pair p), each key's pair of values broadcast from its cache row: hd/2 VDPBF16PS a
 *       key;
 *   online softmax down the keys (running max and sum per lane; the max moves only when
 *       passed by more than 8, so O^T is rarely rescaled), weights rounded to bf16 and
 *       interleaved by key pairs (P^T);
 *   O^T [hd][16] += V^T P^T: V^T in pair order (two keys' values of a dim in one 32-bit
 *       word), put so once per call per KV head, broadcast against P^T's 16 key pairs;
 * and at the end O = (O^T)^T / sum, rounded to bf16. head_dim: a multiple of 32, at most
 * 256. */
#define DPA_QB 16   /* queries a task: the lanes */
#define DPA_KB 32   /* keys a step */
#define DPA_MAX_HD 256

/* r[0..15] (16 rows of 16 words) transposed in place: r[c] lane j = row j's word c */
static inline void dpa_transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);
        __m512i b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
        __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
        __m512i d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
        r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(a, c, 0xDD);
        r[8 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
}

/* S^T for 16 keys (lanes: the queries or heads of qp, Q^T in pair order, HP pairs) from the
 * keys' rows kr (HP bf16 pairs each) into s[0..15]. */
static inline void dpa_scores16(const uint32_t *const kr[16], const __m512i *qp, int HP,
                                __m512 *s) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int p = 0; p < HP; p++)
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qp[p],
                                      (__m512bh)_mm512_set1_epi32((int)kr[j][p]));
    for (int j = 0; j < 16; j++) s[j] = acc[j];
}

static inline void dpa_prefetch_row(const uint16_t *row, int hd) {
    for (int c = 0; c < hd; c += 32) _mm_prefetch((const char *)(row + c), _MM_HINT_T0);
}

/* The decode kernels' step of DPA_KB keys from key t0 (of len): the next step's keys' rows
 * (KV head g) into nx, for the prefetch a few at a time through this step (its K rows before
 * each 16 keys' scores, its V rows beside the pairs of V they pair with): the step's 128
 * lines in one burst held up this step's own loads behind them; spread, the layers'
 * attention took 6% less at batch 8 and 32 of the reference checkpoint on the 2-core
 * AVX512_BF16 EPYC, and prefetching two steps ahead 12% more (alternating decode steps in
 * one process). Returns the next step's keys (some only if this one has DPA_KB). */
static inline int dpa_next_rows(const int64_t *table, int bs, int n_kv, int hd, int g,
                                int len, int t0, long *nx) {
    int next = len - t0 - DPA_KB;
    next = next < 0 ? 0 : next < DPA_KB ? next : DPA_KB;
    paged_row_offs(table, bs, n_kv, hd, g, t0 + DPA_KB, next, nx);
    return next;
}

/* V of a step's n keys (rows at v_cache + o[j]) as pairs of keys, vp [pair][hd] words (a
 * dim's values of keys 2c, 2c + 1; a key past n: 0), one permute per 16 values; the next
 * step's V rows (v_cache + nx[j], j < next) prefetched beside the pairs they pair with. */
static inline void dpa_pair_v(const uint16_t *v_cache, const long *o, int n, const long *nx,
                              int next, int hd, uint32_t *vp) {
    /* two rows' 16-bit lanes interleaved, from the first (idx_lo) or second 16 of 32 */
    const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10,
                                            41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3,
                                            34, 2, 33, 1, 32, 0);
    const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
    for (int c = 0; c < (n + 1) / 2; c++) {
        for (int j = 2 * c; j < 2 * c + 2 && j < next; j++)
            dpa_prefetch_row(v_cache + nx[j], hd);
        const uint16_t *a = v_cache + o[2 * c];
        const uint16_t *b = 2 * c + 1 < n ? v_cache + o[2 * c + 1] : NULL;
        for (int d = 0; d < hd; d += 32) {
            __m512i va = _mm512_loadu_si512(a + d);
            __m512i vb = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
            _mm512_store_si512(vp + (long)c * hd + d, _mm512_permutex2var_epi16(va, idx_lo, vb));
            _mm512_store_si512(vp + (long)c * hd + d + 16,
                               _mm512_permutex2var_epi16(va, idx_hi, vb));
        }
    }
}

/* V^T of KV head g for keys [32 kb, 32 kb + 32): vt[d][pair] = V[2 pair][d] | V[2 pair + 1][d]
 * << 16 (pairs counted from key 0; npairs words a dim); keys at or past L are zero. The
 * keys paired (dpa_pair_v), then 16 x 16 blocks of [pair][dim] words transposed (a word at a
 * time, this took 6% of a 512-token prompt's attention). */
static void dpa_pack_vt(const uint16_t *v_cache, const int64_t *table, int bs, int n_kv, int hd,
                        int g, long L, int kb, long npairs, uint32_t *vt) {
    uint32_t vp[DPA_KB / 2 * DPA_MAX_HD] __attribute__((aligned(64)));  /* [pair][hd] */
    long k0 = (long)kb * DPA_KB, off[DPA_KB];
    int n = L - k0 < DPA_KB ? (int)(L - k0) : DPA_KB, pairs = (n + 1) / 2;
    paged_row_offs(table, bs, n_kv, hd, g, k0, n, off);
    dpa_pair_v(v_cache, off, n, off, 0, hd, vp);
    for (int d0 = 0; d0 < hd; d0 += 16) {
        __m512i r[16];
        for (int c = 0; c < 16; c++)
            r[c] = c < pairs ? _mm512_load_si512(vp + (long)c * hd + d0) : _mm512_setzero_si512();
        dpa_transpose16(r);
        for (int i = 0; i < 16; i++)
            _mm512_store_si512(vt + (long)(d0 + i) * npairs + (long)kb * DPA_KB / 2, r[i]);
    }
}

/* One task: queries [q0, q0 + nq) (nq <= 16) of head h (KV head g) against keys [0, ctx +
 * q0 + nq). */
static void dpa_block(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                      const int64_t *table, int bs, int n_kv, int g, const uint32_t *vt,
                      long npairs, int hd, int h, long ctx, int q0, int nq, float scale,
                      uint16_t *out, long out_stride) {
    __m512i qp[DPA_MAX_HD / 2];                           /* Q^T, pair p: dims 2p, 2p + 1 */
    float ot[DPA_MAX_HD * 16] __attribute__((aligned(64)));  /* O^T: [hd][16 queries] */
    const int HP = hd / 2;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 qm = (__mmask16)((1u << nq) - 1u);
    for (int p = 0; p < HP; p++)  /* lane i: query q0 + i's dims 2p, 2p + 1 (0 past nq) */
        qp[p] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), qm,
                                            _mm512_mullo_epi32(lane, _mm512_set1_epi32(
                                                (int)q_stride)),
                                            q + (long)q0 * q_stride + (long)h * hd + 2 * p, 2);
    memset(ot, 0, sizeof(float) * 16 * hd);
    /* query i sits at ctx + q0 + i; lanes past nq copy the last query's position */
    __m512 qpos = _mm512_cvtepi32_ps(_mm512_min_epi32(
        _mm512_add_epi32(_mm512_set1_epi32((int)(ctx + q0)), lane),
        _mm512_set1_epi32((int)(ctx + q0 + nq - 1))));
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    const __m512 sc = _mm512_set1_ps(scale);
    float st[DPA_KB * 16] __attribute__((aligned(64)));        /* S^T: [key][16 queries] */
    uint32_t pt[DPA_KB / 2 * 16] __attribute__((aligned(64)));  /* P^T: [key pair][16] */
    long end = ctx + q0 + nq;  /* keys the last query sees */
    for (long k0 = 0; k0 < end; k0 += DPA_KB) {
        int kn = end - k0 < DPA_KB ? (int)(end - k0) : DPA_KB;
        long off[DPA_KB];
        paged_row_offs(table, bs, n_kv, hd, g, k0, kn, off);
        for (int j0 = 0; j0 < DPA_KB; j0 += 16) {  /* S^T, 16 keys at a time */
            const uint32_t *kr[16];
            __m512 s[16];
            for (int j = 0; j < 16; j++)  /* keys past the last one read key k0's row */
                kr[j] = (const uint32_t *)(k_cache + off[j0 + j < kn ? j0 + j : 0]);
            dpa_scores16(kr, qp, HP, s);
            for (int j = 0; j < 16; j++) _mm512_store_ps(st + 16 * (j0 + j), s[j]);
        }
        /* cpu_amx.c's step: keys past a query's position (those past kn among them) unseen */
        softmax_step(st, k0, qpos, sc, &mx, &sum, ot, hd, pt);
        __m512i pv[DPA_KB / 2];
        for (int c = 0; c < DPA_KB / 2; c++) pv[c] = _mm512_load_si512(pt + 16 * c);
        /* O^T += V^T P^T, 16 dims at a time (16 independent accumulators; with 8, each
         * product waited on the one before it: 512-token attention x0.96) */
        const uint32_t *vb = vt + k0 / 2;
        for (int d = 0; d < hd; d += 16) {
            __m512 o[16];
            for (int i = 0; i < 16; i++) o[i] = _mm512_load_ps(ot + 16 * (d + i));
            for (int c = 0; c < DPA_KB / 2; c++)
                for (int i = 0; i < 16; i++)
                    o[i] = _mm512_dpbf16_ps(o[i], (__m512bh)pv[c], (__m512bh)_mm512_set1_epi32(
                                                (int)vb[(long)(d + i) * npairs + c]));
            for (int i = 0; i < 16; i++) _mm512_store_ps(ot + 16 * (d + i), o[i]);
        }
    }
    __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
    /* O^T's 16 x 16 blocks transposed into the queries' rows (a gather a query and 16 dims
     * took 9% of a 512-token prompt's attention) */
    for (int d = 0; d < hd; d += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++)
            r[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(ot + 16 * (d + i)), inv));
        dpa_transpose16(r);
        for (int i = 0; i < nq; i++)
            _mm256_storeu_si256((__m256i *)(out + (long)(q0 + i) * out_stride + (long)h * hd + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[i])));
    }
}

/* The same contract as cpu_amx.c's pw_prefill_attention_amx: q [n][.. n_heads x hd ..] (row
 * stride q_stride), caches [blocks][bs][n_kv][hd], table: the request's blocks; out
 * [n][n_heads][hd] (row stride out_stride). Returns 0, -1 without scratch memory, -2 for a
 * head size it does not take (hd % 32, hd < 32 or hd > 256). */
int pw_prefill_attention_avx512bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                            const uint16_t *v_cache, const int64_t *table, int bs, long ctx,
                            int n, uint16_t *out, long out_stride, int n_heads, int n_kv,
                            int hd, float scale, int nthreads) {
    if (hd % 32 || hd < 32 || hd > DPA_MAX_HD || n_heads % n_kv) return -2;
    if (n <= 0) return 0;
    long L = ctx + n;
    int KB = (int)((L + DPA_KB - 1) / DPA_KB);
    /* V^T's row stride: its pairs and 16 words more (32 where that makes 4 KiB's multiple),
     * so that P V's 16 rows a step never sit a multiple of 4 KiB apart (a 4 KiB stride at
     * 2048 keys put all 16 in one set of L1, evicting each other: x0.76) */
    long npairs = (long)KB * DPA_KB / 2 + 16;
    if (npairs % 1024 == 0) npairs += 16;
    size_t per_head = (size_t)hd * npairs;
    uint32_t *vt = (uint32_t *)aligned_alloc(64, ((size_t)n_kv * per_head * 4 + 63) / 64 * 64);
    if (!vt) return -1;
    int group = n_heads / n_kv, QB = (n + DPA_QB - 1) / DPA_QB;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static) collapse(2)
        for (int g = 0; g < n_kv; g++)
            for (int kb = 0; kb < KB; kb++)
                dpa_pack_vt(v_cache, table, bs, n_kv, hd, g, L, kb, npairs,
                            vt + (size_t)g * per_head);
        /* the longest tasks (the last query blocks see the most keys) first */
#pragma omp for schedule(dynamic)
        for (int task = 0; task < n_heads * QB; task++) {
            int qb = QB - 1 - task / n_heads, h = task % n_heads, g = h / group;
            int q0 = qb * DPA_QB, nq = n - q0 < DPA_QB ? n - q0 : DPA_QB;
            dpa_block(q, q_stride, k_cache, table, bs, n_kv, g, vt + (size_t)g * per_head,
                      npairs, hd, h, ctx, q0, nq, scale, out, out_stride);
        }
    }
    free(vt);
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * SiLU-and-multiply of a prompt's gate/up projection on 16 lanes: cpu_kernels.c's
 * pw_silu_mul_bf16 (exp8, here cpu_avx512.h's exp16; the division, the two roundings; its
 * scalar tail past the last 8) step for step, so the same bits (the fused decode layer
 * computes it with the 8-lane version; the two paths must agree). Its 8 lanes took 38 ms of
 * a 512-token prefill of the reference checkpoint on a 2-core AMD EPYC with AVX512_BF16. */
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
        for (int i = vec; i < inter; i++) {  /* silu_mul_rounded of cpu_kernels.c */
            float gv = avx512bf16_bf16_to_f32(g[i]), uv = avx512bf16_bf16_to_f32(u[i]);
            float silu = avx512bf16_bf16_to_f32(avx512bf16_f32_to_bf16(gv / (1.0f + expf(-gv))));
            out[(long)r * inter + i] = avx512bf16_f32_to_bf16(silu * uv);
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * Decode attention on AVX512_BF16: one request's new token, the G <= 16 query heads that
 * share KV head kvh (the lanes), against its len keys in the paged cache, 32 keys a step:
 *   S^T [keys] = K Q^T: Q^T in pair order (gathered once), each key's pairs of values
 *       broadcast from its cache row (the rows of the next step prefetched: a request's
 *       blocks are scattered where the hardware prefetchers do not look);
 *   the online softmax of the prefill kernel down the keys (lazy max, weights as bf16 pairs);
 *   O [G][hd] += P V, two keys' rows interleaved into pairs (one permute per 16 values), a
 *       vector of 16 dims' pairs against a head's two weights broadcast (dpa_pv: G heads'
 *       work, where O^T [hd][16 lanes of heads] took 16 lanes' whatever G; the same
 *       products in the same order, so the same bits: the layers' attention x0.90 at batch 8
 *       and x0.86 at batch 32 of the reference checkpoint (G = 7) on the 2-core AMD EPYC).
 * That is the kernel for 9-16 heads; up to 8 take attend_group_kl (below: the keys in the
 * lanes, where the heads would leave lanes idle).
 * q: [G][hd] bf16, unscaled (scale multiplies the scores); out: [G][hd] fp32 (the caller
 * rounds). Returns 0, or -1 for a shape it does not take (hd % 32, hd > 256, G > 16), which
 * the caller then computes itself. The same contract as cpu_amx.c's pw_attend_group_amx. */
/* O[g0 .. g0 + HB) += P V over `pairs` pairs of keys, the lanes 16 dims (vectors dv0 .. dv0 +
 * DB of the hd / 16): oh [G][hd] fp32; vp [pair][hd] words (a dim's values of the pair's two
 * keys); pw words (head g's weights of pair c's two keys at pw[cs c + hs g]: [pair][16],
 * lane g of the softmax's vector, cs = 16, hs = 1; or [head][16 pairs], cs = 1, hs = 16).
 * HB x DB accumulators, the pairs in order. */
static inline __attribute__((always_inline)) void dpa_pv(const int HB, const int DB, float *oh,
                                                         int hd, int g0, int dv0,
                                                         const uint32_t *vp,
                                                         const uint32_t *pw, int pairs,
                                                         int cs, int hs) {
    __m512 acc[4][4];
    for (int h = 0; h < HB; h++)
        for (int b = 0; b < DB; b++)
            acc[h][b] = _mm512_load_ps(oh + (long)(g0 + h) * hd + 16 * (dv0 + b));
    for (int c = 0; c < pairs; c++) {
        __m512bh v[4];
        for (int b = 0; b < DB; b++)
            v[b] = (__m512bh)_mm512_load_si512(vp + (long)c * hd + 16 * (dv0 + b));
        for (int h = 0; h < HB; h++) {
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)pw[cs * c + hs * (g0 + h)]);
            for (int b = 0; b < DB; b++) acc[h][b] = _mm512_dpbf16_ps(acc[h][b], v[b], w);
        }
    }
    for (int h = 0; h < HB; h++)
        for (int b = 0; b < DB; b++)
            _mm512_store_ps(oh + (long)(g0 + h) * hd + 16 * (dv0 + b), acc[h][b]);
}

/* O += P V for all G heads and hd dims (hd % 32 == 0), in blocks of up to 4 heads x 4 dim
 * vectors. */
#define DPA_PV(HB, DB) dpa_pv(HB, DB, oh, hd, g0, dv0, vp, pw, pairs, cs, hs)
static void dpa_pv_all(float *oh, int G, int hd, const uint32_t *vp, const uint32_t *pw,
                       int pairs, int cs, int hs) {
    for (int g0 = 0; g0 < G; g0 += 4)
        for (int dv0 = 0; dv0 < hd / 16; dv0 += 4) {  /* hd % 32 == 0: 2 or 4 vectors */
            int four = hd / 16 - dv0 >= 4;
            switch (G - g0 < 4 ? G - g0 : 4) {
                case 1: if (four) DPA_PV(1, 4); else DPA_PV(1, 2); break;
                case 2: if (four) DPA_PV(2, 4); else DPA_PV(2, 2); break;
                case 3: if (four) DPA_PV(3, 4); else DPA_PV(3, 2); break;
                default: if (four) DPA_PV(4, 4); else DPA_PV(4, 2); break;
            }
        }
}
#undef DPA_PV

/* lazy_rescale (cpu_avx512.h) for O in rows of heads (oh [G][hd]): lazy_alpha, then the
 * rows of the heads whose max grew multiplied by their alpha (the others' alpha is 1: left
 * as they are). */
static inline void dpa_rescale(__m512 m_new, __m512 *mx, __m512 *sum, float *oh, int G,
                               int hd) {
    __m512 alpha;
    __mmask16 grew = lazy_alpha(m_new, mx, sum, &alpha);
    if (!grew) return;
    float al[16] __attribute__((aligned(64)));
    _mm512_store_ps(al, alpha);
    for (int g = 0; g < G; g++) {
        if (!(grew >> g & 1)) continue;
        __m512 a = _mm512_set1_ps(al[g]);
        float *row = oh + (long)g * hd;
        for (int d = 0; d < hd; d += 16)
            _mm512_store_ps(row + d, _mm512_mul_ps(_mm512_load_ps(row + d), a));
    }
}

/* out [G][hd] = O / den per head (den 0: 0; NaN: the head's output NaN) */
static inline void dpa_normalise(const float *ot, const float *den, int G, int hd, float *out) {
    for (int g = 0; g < G; g++) {
        float inv = den[g] > 0.0f ? 1.0f / den[g] : 0.0f;
        if (den[g] != den[g]) inv = den[g];
        for (int d = 0; d < hd; d++) out[(long)g * hd + d] = ot[(long)g * hd + d] * inv;
    }
}

/* ---------------------------------------------------------------------------------------
 * The same decode attention for G <= 8 heads with the keys in the lanes: with the heads in
 * the lanes, G = 7 (Qwen2-0.5B) left 9 of 16 idle in every score product, G = 1 (no
 * grouping) 15, and each step's exponentials ran on 32 vectors whatever G. Here:
 *   S [head][32 keys]: each 16 keys' rows transposed in registers (dpa_transpose16: 64
 *       shuffles a 16 x 16 block of pairs) into K^T [pair][16 keys], against a head's pair
 *       broadcast from q (dpa_scores_kl: G x 2 accumulators, two groups of 16 keys);
 *   the heads' maxes by one reduction across rows (dpa_hmax8), the same lazy running max
 *       and exponentials per head (G x 2 vectors a step), their sums kept lane by lane (one
 *       reduction a head at the end);
 *   a head's 32 weights as bf16 pairs in one conversion (cvtne2ps: the pair order of V), and
 *       P V as the heads-in-lanes kernel's (dpa_pv: its products in its order).
 * The same scores, maxes and weights, so the same outputs up to the sums' order (the
 * denominators; the test's tolerance). On the 2-core AVX512_BF16 EPYC, a call on keys in the
 * caches (8 requests of 190 keys): x1.22-1.24 at G = 7 (hd 64), x1.30-1.34 at G = 4 (hd 128),
 * x1.40-1.52 at G = 1, x1.04-1.21 at G = 8, x0.90-1.00 at G = 10-16 (so those keep the kernel
 * above); the reference checkpoint's decode steps x1.005-1.01 at batch 8 (blocks of steps by
 * turns; in the engine the keys' arrival sets most of the attention's time).
 * pw_avx512bf16_attn_kl = 0 sends every G to the kernel above (comparisons: a global only in
 * the benchmark build, -DPW_BENCH_KNOBS; elsewhere a constant, so no caller can switch it). */
#ifdef PW_BENCH_KNOBS
int pw_avx512bf16_attn_kl = 1;
#else
#define pw_avx512bf16_attn_kl 1
#endif

/* S of heads 0 .. HB for KG groups of 16 keys (kt: [KG][HP] vectors, lane j a key's pair p),
 * queries qw ([HB][HP] pairs): s[2 g + k] lane j = head g's score of key 16 k + j. */
static inline __attribute__((always_inline)) void dpa_scores_kl(
        const int HB, const int KG, const __m512i *kt, const uint32_t *qw, int HP,
        __m512 *s) {
    __m512 a[2][8];
    for (int k = 0; k < KG; k++)
        for (int h = 0; h < HB; h++) a[k][h] = _mm512_setzero_ps();
    for (int p = 0; p < HP; p++) {
        __m512bh kv[2];
        for (int k = 0; k < KG; k++) kv[k] = (__m512bh)kt[(long)k * HP + p];
        for (int h = 0; h < HB; h++) {
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)qw[(long)h * HP + p]);
            for (int k = 0; k < KG; k++) a[k][h] = _mm512_dpbf16_ps(a[k][h], kv[k], w);
        }
    }
    for (int h = 0; h < HB; h++)
        for (int k = 0; k < KG; k++) s[2 * h + k] = a[k][h];
}

#define DPA_SKL(HB) do { if (KG2) dpa_scores_kl(HB, 2, kt, qw, HP, s); \
                         else dpa_scores_kl(HB, 1, kt, qw, HP, s); } while (0)
static void dpa_scores_kl_all(int G, int KG2, const __m512i *kt, const uint32_t *qw, int HP,
                              __m512 *s) {  /* G <= 8 */
    switch (G) {
        case 1: DPA_SKL(1); break;
        case 2: DPA_SKL(2); break;
        case 3: DPA_SKL(3); break;
        case 4: DPA_SKL(4); break;
        case 5: DPA_SKL(5); break;
        case 6: DPA_SKL(6); break;
        case 7: DPA_SKL(7); break;
        default: DPA_SKL(8); break;
    }
}
#undef DPA_SKL

/* Lane g (< G <= 8) of the result: the largest lane of t[g] (-inf past G); t's NaNs count as
 * -inf. Pairs of rows halved lane-block-wise, then four rows' blocks folded in place. */
static inline __m512 dpa_hmax8(const __m512 *t, int G) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 x[4], z[2];
    for (int i = 0; i < 4; i++) {
        __m512 a = 2 * i < G ? t[2 * i] : ninf, b = 2 * i + 1 < G ? t[2 * i + 1] : ninf;
        a = _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), ninf);
        b = _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q), ninf);
        /* [a0 a1 b0 b1] max [a2 a3 b2 b3] (128-bit blocks) */
        x[i] = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int i = 0; i < 2; i++) {
        /* blocks: row 4i, 4i + 1, 4i + 2, 4i + 3, each four values */
        __m512 y = _mm512_max_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
        y = _mm512_max_ps(y, _mm512_permute_ps(y, 0x4E));
        z[i] = _mm512_max_ps(y, _mm512_permute_ps(y, 0xB1));
    }
    const __m512i idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    return _mm512_mask_mov_ps(ninf, (__mmask16)((1u << G) - 1u),
                              _mm512_permutex2var_ps(z[0], idx, z[1]));
}

static int attend_group_kl(const uint16_t *q, int G, float scale, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int64_t *table, int len, int bs,
                           int n_kv, int kvh, int hd, float *out) {
    const int HP = hd / 2;
    const uint32_t *qw = (const uint32_t *)q;  /* head g's pair p: qw[g HP + p] */
    __m512i kt[2 * DPA_MAX_HD / 2];  /* K^T of a step's two groups of 16 keys */
    float ot[DPA_MAX_HD * 16] __attribute__((aligned(64)));  /* O: [G][hd] */
    uint32_t vp[DPA_KB / 2 * DPA_MAX_HD] __attribute__((aligned(64)));  /* [pair][hd] */
    uint32_t pw[16 * DPA_KB / 2] __attribute__((aligned(64)));  /* [head][pair] */
    __m512 sums[8];  /* head g's weights summed lane by lane (keys 16 apart in a lane) */
    for (int g = 0; g < 8; g++) sums[g] = _mm512_setzero_ps();
    memset(ot, 0, sizeof(float) * G * hd);
    /* the heads' running maxes, lane g (sum: lazy_alpha's, unused) */
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    long off[2][DPA_KB];
    paged_row_offs(table, bs, n_kv, hd, kvh, 0, len < DPA_KB ? len : DPA_KB, off[0]);
    for (int t0 = 0, step = 0; t0 < len; t0 += DPA_KB, step ^= 1) {
        int n = len - t0 < DPA_KB ? len - t0 : DPA_KB;
        const long *o = off[step];
        long *nx = off[step ^ 1];
        int next = dpa_next_rows(table, bs, n_kv, hd, kvh, len, t0, nx);
        int KG = n > 16 ? 2 : 1;
        for (int k = 0; k < KG; k++) {
            for (int j = 16 * k; j < 16 * k + 16 && j < next; j++)
                dpa_prefetch_row(k_cache + nx[j], hd);
            for (int p0 = 0; p0 < HP; p0 += 16) {
                __m512i r[16];
                for (int j = 0; j < 16; j++) {  /* keys past n read the first key's row */
                    int jj = 16 * k + j < n ? 16 * k + j : 0;
                    r[j] = _mm512_loadu_si512((const uint32_t *)(k_cache + o[jj]) + p0);
                }
                dpa_transpose16(r);
                for (int i = 0; i < 16; i++) kt[(long)k * HP + p0 + i] = r[i];
            }
        }
        __m512 s[32];
        dpa_scores_kl_all(G, KG == 2, kt, qw, HP, s);
        __mmask16 v0 = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1u);
        __mmask16 v1 = n >= 32 ? 0xFFFF : n > 16 ? (__mmask16)((1u << (n - 16)) - 1u) : 0;
        __m512 t[8];
        for (int g = 0; g < G; g++) {
            s[2 * g] = _mm512_mask_mul_ps(ninf, v0, s[2 * g], sc);
            s[2 * g + 1] = KG == 2 ? _mm512_mask_mul_ps(ninf, v1, s[2 * g + 1], sc) : ninf;
            t[g] = _mm512_max_ps(s[2 * g], s[2 * g + 1]);
        }
        /* a NaN score leaves the max (its head's weights carry it instead) */
        __m512 m_new = _mm512_max_ps(mx, dpa_hmax8(t, G));
        __m512 alpha;
        __mmask16 grew = lazy_alpha(m_new, &mx, &sum, &alpha);
        if (grew) {
            float al[16] __attribute__((aligned(64)));
            _mm512_store_ps(al, alpha);
            for (int g = 0; g < G; g++) {
                if (!(grew >> g & 1)) continue;
                __m512 a = _mm512_set1_ps(al[g]);
                sums[g] = _mm512_mul_ps(sums[g], a);
                float *row = ot + (long)g * hd;
                for (int d = 0; d < hd; d += 16)
                    _mm512_store_ps(row + d, _mm512_mul_ps(_mm512_load_ps(row + d), a));
            }
        }
        float mxs[16] __attribute__((aligned(64)));
        _mm512_store_ps(mxs, mx);
        for (int g = 0; g < G; g++) {
            __m512 m = _mm512_set1_ps(mxs[g]);
            __m512 p0 = _mm512_maskz_mov_ps(v0, exp16_fast(_mm512_sub_ps(s[2 * g], m)));
            __m512 p1 = KG == 2
                ? _mm512_maskz_mov_ps(v1, exp16_fast(_mm512_sub_ps(s[2 * g + 1], m)))
                : _mm512_setzero_ps();
            sums[g] = _mm512_add_ps(sums[g], _mm512_add_ps(p0, p1));
            _mm512_store_si512(pw + 16 * g, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        dpa_pair_v(v_cache, o, n, nx, next, hd, vp);
        dpa_pv_all(ot, G, hd, vp, pw, (n + 1) / 2, 1, 16);  /* O += P V */
    }
    float den[8];
    for (int g = 0; g < G; g++) den[g] = _mm512_reduce_add_ps(sums[g]);
    dpa_normalise(ot, den, G, hd, out);
    return 0;
}

int pw_attend_group_avx512bf16(const uint16_t *q, int G, float scale, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int64_t *table, int len, int bs,
                       int n_kv, int kvh, int hd, float *out) {
    if (hd % 32 || hd < 32 || hd > DPA_MAX_HD || G < 1 || G > 16) return -1;
    if (pw_avx512bf16_attn_kl && G <= 8)
        return attend_group_kl(q, G, scale, k_cache, v_cache, table, len, bs, n_kv, kvh, hd,
                               out);
    __m512i qp[DPA_MAX_HD / 2];
    float ot[DPA_MAX_HD * 16] __attribute__((aligned(64)));  /* O: [G][hd], a head a row */
    uint32_t vp[DPA_KB / 2 * DPA_MAX_HD] __attribute__((aligned(64)));  /* [pair][hd] */
    const int HP = hd / 2;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 gm = (__mmask16)((1u << G) - 1u);
    for (int p = 0; p < HP; p++)
        qp[p] = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), gm,
                                            _mm512_mullo_epi32(lane, _mm512_set1_epi32(hd)),
                                            q + 2 * p, 2);
    memset(ot, 0, sizeof(float) * G * hd);
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    long off[2][DPA_KB];
    paged_row_offs(table, bs, n_kv, hd, kvh, 0, len < DPA_KB ? len : DPA_KB, off[0]);
    for (int t0 = 0, step = 0; t0 < len; t0 += DPA_KB, step ^= 1) {
        int n = len - t0 < DPA_KB ? len - t0 : DPA_KB;
        const long *o = off[step];
        long *nx = off[step ^ 1];  /* the next step's rows (dpa_next_rows) */
        int next = dpa_next_rows(table, bs, n_kv, hd, kvh, len, t0, nx);
        __m512 s[DPA_KB];
        for (int j0 = 0; j0 < n; j0 += 16) {  /* S^T, 16 keys at a time */
            const uint32_t *kr[16];
            for (int j = 0; j < 16; j++)  /* keys past n read the first key's row */
                kr[j] = (const uint32_t *)(k_cache + o[j0 + j < n ? j0 + j : 0]);
            for (int j = j0; j < j0 + 16 && j < next; j++)
                dpa_prefetch_row(k_cache + nx[j], hd);
            dpa_scores16(kr, qp, HP, s + j0);
        }
        __m512 m_new = mx;
        for (int j = 0; j < DPA_KB; j++) {
            s[j] = j < n ? _mm512_mul_ps(s[j], sc) : _mm512_set1_ps(-INFINITY);
            m_new = _mm512_max_ps(m_new, s[j]);  /* a NaN score passes through */
        }
        dpa_rescale(m_new, &mx, &sum, ot, G, hd);
        uint32_t pw[DPA_KB / 2 * 16] __attribute__((aligned(64)));
        int pairs = (n + 1) / 2;
        for (int c = 0; c < pairs; c++) {
            __m512 p0 = exp16_fast(_mm512_sub_ps(s[2 * c], mx));
            __m512 p1 = 2 * c + 1 < n ? exp16_fast(_mm512_sub_ps(s[2 * c + 1], mx))
                                      : _mm512_setzero_ps();
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            __m512i pv = _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            _mm512_store_si512(pw + 16 * c, pv);
        }
        dpa_pair_v(v_cache, o, n, nx, next, hd, vp);
        dpa_pv_all(ot, G, hd, vp, pw, pairs, 16, 1);  /* O += P V */
    }
    float den[16] __attribute__((aligned(64)));
    _mm512_store_ps(den, sum);
    dpa_normalise(ot, den, G, hd, out);
    return 0;
}

/* The fused decode layer's SiLU pass on 16 lanes (its proj_mode PW_PROJ_AVX512BF16): act[m][i] =
 * bf16(bf16(silu(g)) * u), g = bf16(res[m][i] + bias[i]), u = bf16(res[m][I + i] + bias[I +
 * i]), as fp32; the 8-lane loop of cpu_kernels.c step for step (its vectors of 8, its scalar
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


/* ---------------------------------------------------------------------------------------
 * The linear layer on weights packed once, at load, into panels (the "panels" layout): for
 * each block of 16 output channels, K/2 vectors of 16 lanes, lane c holding channel c's
 * pair of values (2p, 2p + 1) as one 32-bit word, the blocks in groups of PK_GS (the last
 * group perhaps fewer, gb) whose vectors take turns pair by pair:
 *     wp[g0 * K/2 * 16 + (p * gb + b - g0) * 16 + c]
 *         = w[16 b + c][2p] | w[16 b + c][2p + 1] << 16
 * (g0 the group's first block; pk_addr). A tile over one group reads one stream.
 * A product then needs no reduction across lanes: VDPBF16PS of a weight vector (16
 * channels' pair p) with a token's pair p broadcast to every lane adds that pair's two
 * products to each channel's sum. A register tile holds NB blocks (16 NB channels: a group)
 * x MT tokens; per pair it loads NB weight vectors and broadcasts MT words, NB x MT
 * products. (Blocks laid end to end, a tile's 2-4 blocks 2-4 streams, read up to 8% slower
 * at 1-8 tokens: README, "One stream a tile".)
 * Against the in-place kernel above (4 rows x 6 tokens, a lane reduction at the end of each
 * tile), 2-core AMD EPYC with AVX512_BF16, weights from memory, the reference checkpoint's
 * four projections: 712-777 GFLOP/s against 459-521 at 32 tokens, 370-439 against 233-328
 * at 8, and 867-910 against torch's 737-808 (oneDNN) at 512.
 *
 * Blocking: a thread takes a contiguous share of the panels (groups); a panel meets
 * the tokens in blocks of PK_MB, K in chunks of at most PK_KC pairs (the panel's chunk stays
 * in L1/L2 while every token tile of the block passes over it), and while the first tile of
 * a chunk runs, the next chunk (or the next panel's first) is prefetched, one line of each
 * block per pair (on few tokens non-temporally, and up to 6 the tile's own stream a few pairs
 * ahead instead: pk_prefetch).
 * Sums over K run pair by pair, chunk after chunk, for every token alike: a token's result
 * does not depend on how many tokens share the call, nor on the threads.
 * Sums across chunks wait in a per-thread fp32 scratch; the last chunk writes fp32 sums
 * (the fused layer's results) or bf16(sum + bias) (a plain linear layer).
 */
/* A decode call's weights on few tokens are prefetched non-temporally (PREFETCHNTA), so
 * that the 0.78 GB a step streams no longer passes through L2 into L3, evicting everything
 * else there (the layers' activations, norms and KV rows, the host's Python and torch code
 * and data between the calls). One core reading 800 MB then running a small torch call: 41
 * us for that call after plain loads, 20 after NTA prefetches 2 KiB ahead (35 at 512 bytes,
 * 34 at 8 KiB: too near and the loads catch up, too far and the lines are gone before use).
 * How, by the tokens of a block (measured on the reference checkpoint's decode steps, 2-core
 * AMD EPYC with AVX512_BF16, one process, blocks of steps by turns against the T0 prefetch of
 * the next chunk of up to PK_KC pairs):
 *   1-6 tokens: the tile's own stream 16 pairs ahead (one token) or 32 (PK_NEAR): batch 1
 *     x1.005-1.10 (the host's share of a step 0.52 -> 0.17-0.53 ms, the C call 3-7%
 *     faster), batches 2-6 x1.03-1.16. At 8 tokens that lost (x0.86; a T0 prefetch as near
 *     x0.90: a pair's eight tokens of work leave too little time before its lines are due).
 *   7-12 tokens (one tile a chunk): the next chunk, as before, but chunks of at most
 *     PK_KC_NTA pairs (12 KiB of a 2-block panel, in L1 when the tile comes to it): batch 8
 *     x1.03-1.08 (the host 0.62-0.70 -> 0.35-0.52 ms; x1.00 with such chunks and T0; 64 pairs
 *     x1.02-1.06, 128 x1.02-1.03), batch 12 x1.00-1.02.
 *   more (two tiles a chunk or more): T0 a chunk ahead; non-temporal chunks of 96 or 192
 *     pairs lost at batches 16 (x0.96-0.98) and 32 (x0.95). With 2-PK_SPREAD_TILES tiles
 *     (13-72 tokens) every tile prefetches its share of the next chunk (tile s: pairs s, s +
 *     ntile, ...), where the first tile alone fetched all of it in a third of the chunk's
 *     time at 32 tokens, faster than a core's misses go: batch 16 x1.017, 24 x1.018, 32
 *     x1.028-1.031, 48 x1.025, 64 x1.044; a prompt's blocks of 96 tokens (8 tiles) lost so
 *     (x0.99) and keep the first tile's prefetch.
 * pw_pk_nta: 0 turns the near and non-temporal modes off, pw_pk_spread the spread
 * (comparisons; a prefetch changes no value; globals only in the benchmark build,
 * -DPW_BENCH_KNOBS, constants elsewhere). */
#define PK_KC 512    /* pairs of K a chunk */
#define PK_NEAR (-2)
#define PK_KC_NTA 96 /* pairs of K a chunk where a block's one tile prefetches non-temporally */
#define PK_SPREAD_TILES 6  /* the most tiles a chunk that share its prefetch */
#ifdef PW_BENCH_KNOBS
int pw_pk_nta = 1;
int pw_pk_spread = 1;
#else
#define pw_pk_nta 1
#define pw_pk_spread 1
#endif

/* How a token block of `tokens` (ntile tiles) prefetches: *near pairs ahead in its own
 * stream (0: the next chunk instead), *nta whether non-temporally; returns the most pairs a
 * chunk. */
static inline int pk_prefetch(int tokens, int ntile, long *near, int *nta) {
    *near = !pw_pk_nta || tokens > 6 ? 0 : tokens == 1 ? 16 : 32;
    *nta = pw_pk_nta && ntile == 1;
    return *nta && !*near ? PK_KC_NTA : PK_KC;
}

#define PK_MB 96     /* tokens a block */
#define PK_MT 12     /* the most tokens a tile (a group of 2 blocks) */
#define PK_GS 2      /* blocks a group, interleaved pair by pair */

/* Where block b's vector of pair p lies (in words from wp), and how far its next pair's is:
 * blocks come in groups of PK_GS (the last group of a weight perhaps fewer: gb), a group's
 * blocks interleaved pair by pair, so a tile over a group's blocks reads one stream. */
static inline long pk_addr(int blocks, long KP, int b, long p, long *stride) {
    int g0 = b / PK_GS * PK_GS, gb = blocks - g0 < PK_GS ? blocks - g0 : PK_GS;
    *stride = 16L * gb;
    return (long)g0 * KP * 16 + (p * gb + (b - g0)) * 16;
}

/* w [N, K] bf16 row-major -> wp (N * K / 2 words), N % 16 == 0, K % 2 == 0; the groups
 * shared by the threads. wp may be w itself: a group's panel takes the bytes of its rows, so
 * each group is copied aside (one group a thread, 64 K bytes) and packed back in place, and
 * no second copy of the weight is ever made. Returns 0, or -1 without the group's scratch
 * memory. */
int pw_pk_pack(const uint16_t *w, int N, int K, uint32_t *wp, int nthreads) {
    long KP = K / 2;
    int blocks = N / 16, groups = (blocks + PK_GS - 1) / PK_GS;
    int in_place = (const void *)w == (const void *)wp, failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint32_t *tmp = in_place ? (uint32_t *)malloc(sizeof(uint32_t) * KP * 16 * PK_GS)
                                 : NULL;
        if (in_place && !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int g = 0; g < groups; g++) {
                int b0 = g * PK_GS, gb = blocks - b0 < PK_GS ? blocks - b0 : PK_GS;
                const uint32_t *rows = (const uint32_t *)(w + (long)b0 * 16 * K);
                uint32_t *dst = wp + (long)b0 * KP * 16;
                if (in_place) {
                    memcpy(tmp, rows, sizeof(uint32_t) * KP * 16 * gb);
                    rows = tmp;
                }
                for (long p = 0; p < KP; p++)
                    for (int bi = 0; bi < gb; bi++)
                        for (int c = 0; c < 16; c++)
                            dst[(p * gb + bi) * 16 + c] = rows[(long)(16 * bi + c) * KP + p];
            }
        }
        free(tmp);
    }
    return failed ? -1 : 0;
}

/* The inverse of pw_pk_pack (for tests and for handing a row-major copy back). */
void pw_pk_unpack(const uint32_t *wp, int N, int K, uint16_t *w) {
    long KP = K / 2, stride;
    int blocks = N / 16;
    for (int b = 0; b < blocks; b++) {
        uint32_t *rows = (uint32_t *)(w + (long)b * 16 * K);
        for (long p = 0; p < KP; p++) {
            const uint32_t *src = wp + pk_addr(blocks, KP, b, p, &stride);
            for (int c = 0; c < 16; c++) rows[(long)c * KP + p] = src[c];
        }
    }
}

/* Rows of a weight packed into panels, as bf16 rows: out [n][K] = rows ids[0 .. n) of the
 * [N, K] weight in wp (an embedding table that is also the LM head: a lookup reads a word
 * per pair, 16 (or 32) words apart). Returns 0, or -1 (nothing written) for an id outside
 * [0, N). */
int pw_pk_rows(const uint32_t *wp, int N, int K, const int64_t *ids, long n, uint16_t *out,
               int nthreads) {
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    const long KP = K / 2;
    const int blocks = N / 16;
#pragma omp parallel for num_threads(n >= 64 ? nthreads : 1) schedule(static)
    for (long i = 0; i < n; i++) {
        int b = (int)(ids[i] / 16), c = (int)(ids[i] % 16);
        long stride, a = pk_addr(blocks, KP, b, 0, &stride) + c;
        uint32_t *o = (uint32_t *)(out + i * K);
        for (long p = 0; p < KP; p++) o[p] = wp[a + p * stride];
    }
    return 0;
}

/* One tile: NB blocks b0 .. b0 + NB - 1 (of `blocks`) x MT tokens (x: the first token's row,
 * K values a row), pairs [p0, p0 + pc). first: start from zero, else from part (this
 * thread's scratch, PK_MB x 16 NB floats); last: write the output (out, as avx512bf16_tile's: fp32
 * sums into res, or bf16(sum + bias) into y; with out->glu, NB == 2 and the weight packed in
 * units (gate block b0 / 2, then its up block: glu_pk), bf16(bf16(silu(g)) * u), g and u
 * the two blocks' sums + bias rounded to bf16, the bits of pw_avx512bf16_glu_rows and
 * pw_silu_mul_avx512bf16), else part. pfb, pfp: the next chunk's first block and pair, whose NB
 * blocks' vectors are prefetched one line a block a pair, non-temporally if nta (pfb ==
 * PK_NEAR: instead, the tile's own blocks pfp pairs ahead, non-temporally: pk_prefetch;
 * other pfb < 0: none; a block past the weight's last: block b0's instead, a hint); the T0
 * prefetch only at pairs pfs, pfs + pfn, ... (1, 0: every pair; the tiles of a chunk share
 * it so). m0: the tile's first token within the token block (its row in part); mg: its
 * first token overall (its row in the output). */
static inline __attribute__((always_inline)) void pk_tile(
        const int NB, const int MT, const uint16_t *x, int K, const uint32_t *wp, long KP,
        int blocks, int b0, long p0, int pc, int first, int last, int pfb, long pfp, int nta,
        int pfn, int pfs, float *part, int m0, long mg, const Avx512bf16Out *out) {
    __m512 acc[PK_MT][4];
    const int ldp = 16 * NB;
    for (int m = 0; m < MT; m++)
        for (int b = 0; b < NB; b++)
            acc[m][b] = first ? _mm512_setzero_ps()
                              : _mm512_loadu_ps(part + (long)(m0 + m) * ldp + 16 * b);
    const uint32_t *xr = (const uint32_t *)x + p0;
    const uint32_t *wb[4], *pf[4];  /* block b's vector of pair p0 (and of the next chunk) */
    long st[4], pst[4];              /* and the words from one pair's to the next's */
    for (int b = 0; b < NB; b++) {
        wb[b] = wp + pk_addr(blocks, KP, b0 + b, p0, &st[b]);
        int nb = pfb + b;  /* the next chunk's block (a hint: any block will do) */
        pf[b] = pfb >= 0 ? wp + pk_addr(blocks, KP, nb < blocks ? nb : b0, pfp, &pst[b]) : NULL;
        if (pfb < 0) pst[b] = 0;
    }
    for (int p = 0; p < pc; p++) {
        __m512bh wv[4];
        for (int b = 0; b < NB; b++)
            wv[b] = (__m512bh)_mm512_loadu_si512(wb[b] + (long)p * st[b]);
        if (pfb == PK_NEAR)  /* past the chunk's end: the next chunk or panel's (a hint) */
            for (int b = 0; b < NB; b++)
                _mm_prefetch((const char *)(wb[b] + (p + pfp) * st[b]), _MM_HINT_NTA);
        else if (pfb >= 0 && nta)
            for (int b = 0; b < NB; b++)
                _mm_prefetch((const char *)(pf[b] + (long)p * pst[b]), _MM_HINT_NTA);
        else if (pfb >= 0 && p == pfs) {
            pfs += pfn;
            for (int b = 0; b < NB; b++)
                _mm_prefetch((const char *)(pf[b] + (long)p * pst[b]), _MM_HINT_T0);
        }
        for (int m = 0; m < MT; m++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xr[(long)m * (K / 2) + p]);
            for (int b = 0; b < NB; b++) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
        }
    }
    if (!last) {
        for (int m = 0; m < MT; m++)
            for (int b = 0; b < NB; b++)
                _mm512_storeu_ps(part + (long)(m0 + m) * ldp + 16 * b, acc[m][b]);
        return;
    }
    if (out->glu) {  /* NB == 2: gate block b0 (unit b0 / 2), up block b0 + 1 */
        long n = 16L * (b0 / 2);  /* the unit's first channel: act's column */
        __m512 bg = out->bias ? avx512bf16_load_bf16x16(out->bias + n, 0xffff) : _mm512_setzero_ps();
        __m512 bu = out->bias ? avx512bf16_load_bf16x16(out->bias + out->ldr + n, 0xffff)
                              : _mm512_setzero_ps();
        for (int m = 0; m < MT; m++) {
            __m512 gv = _mm512_castsi512_ps(avx512bf16_bf16_bits16(_mm512_add_ps(acc[m][0], bg)));
            __m512 uv = _mm512_castsi512_ps(avx512bf16_bf16_bits16(_mm512_add_ps(acc[m][1], bu)));
            __m512i a = avx512bf16_silu_mul16(gv, uv);
            if (out->y)
                _mm256_storeu_si256((__m256i *)(out->y + (mg + m) * out->ldr + n),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(a, 16)));
            else
                _mm512_storeu_ps(out->res + (mg + m) * out->ldr + n, _mm512_castsi512_ps(a));
        }
        return;
    }
    for (int b = 0; b < NB; b++) {
        long n = 16L * (b0 + b);
        if (!out->y && !out->widen) {
            for (int m = 0; m < MT; m++)
                _mm512_storeu_ps(out->res + (mg + m) * out->ldr + n, acc[m][b]);
            continue;
        }
        __m512 bias = out->bias ? avx512bf16_load_bf16x16(out->bias + n, 0xffff) : _mm512_setzero_ps();
        for (int m = 0; m < MT; m++) {
            __m512i r = avx512bf16_bf16_bits16(_mm512_add_ps(acc[m][b], bias));
            if (out->y)
                _mm256_storeu_si256((__m256i *)(out->y + (mg + m) * out->ldr + n),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
            else  /* widen: the bf16 value as fp32 */
                _mm512_storeu_si512(out->res + (mg + m) * out->ldr + n, r);
        }
    }
}

#define PK_ARGS x, K, wp, KP, blocks, b0, p0, pc, first, last, pfb, pfp, nta, pfn, pfs, part, m0, \
                mg, out
#define PK_CASE(NB, MT) case MT: pk_tile(NB, MT, PK_ARGS); break;
static void pk_tile2(int mt, const uint16_t *x, int K, const uint32_t *wp, long KP,
                     int blocks, int b0, long p0, int pc, int first, int last, int pfb,
                     long pfp, int nta, int pfn, int pfs, float *part, int m0, long mg,
                     const Avx512bf16Out *out) {
    switch (mt) { PK_CASE(2, 1) PK_CASE(2, 2) PK_CASE(2, 3) PK_CASE(2, 4) PK_CASE(2, 5)
                  PK_CASE(2, 6) PK_CASE(2, 7) PK_CASE(2, 8) PK_CASE(2, 9) PK_CASE(2, 10)
                  PK_CASE(2, 11) default: pk_tile(2, 12, PK_ARGS); }
}
static void pk_tile1(int mt, const uint16_t *x, int K, const uint32_t *wp, long KP,
                     int blocks, int b0, long p0, int pc, int first, int last, int pfb,
                     long pfp, int nta, int pfn, int pfs, float *part, int m0, long mg,
                     const Avx512bf16Out *out) {
    switch (mt) { PK_CASE(1, 1) PK_CASE(1, 2) PK_CASE(1, 3) PK_CASE(1, 4) PK_CASE(1, 5)
                  PK_CASE(1, 6) PK_CASE(1, 7) PK_CASE(1, 8) PK_CASE(1, 9) PK_CASE(1, 10)
                  PK_CASE(1, 11) default: pk_tile(1, 12, PK_ARGS); }
}
#undef PK_CASE
#undef PK_ARGS

/* This thread's share of the panels against the M tokens of x (bf16 [M, K]): panels of 2
 * blocks (one group of the layout: one stream of weights a tile) x up to 12 tokens (24
 * accumulators); a block left over (N / 16 odd) is a panel of its own, the last. With
 * out->glu (a SwiGLU's gate/up weight packed with glu: units of a gate block and its up
 * block), each panel is a unit and its tiles write the activations. Called by every thread
 * of a parallel region; no barrier. */
static void pk_share(const uint16_t *x, int M, const uint32_t *wp, int K, int N,
                     const Avx512bf16Out *out) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    const long KP = K / 2;
    const int blocks = N / 16, wide = blocks / 2, panels = wide + blocks % 2;
    int lo = (int)((long)panels * t / T), hi = (int)((long)panels * (t + 1) / T);
    float part[PK_MB * 32] __attribute__((aligned(64)));
    for (int mb = 0; mb < M; mb += PK_MB) {
        int mbn = M - mb < PK_MB ? M - mb : PK_MB;
        int ntile = (mbn + PK_MT - 1) / PK_MT;
        long near;
        int nta, cmax = pk_prefetch(mbn, ntile, &near, &nta);
        int nch = (int)((KP + cmax - 1) / cmax), kc = (int)((KP + nch - 1) / nch);
        for (int pn = lo; pn < hi; pn++) {
            int b0 = 2 * pn, nb = pn < wide ? 2 : 1;
            for (long p0 = 0; p0 < KP; p0 += kc) {
                int pc = KP - p0 < kc ? (int)(KP - p0) : kc;
                int first = p0 == 0, last = p0 + pc >= KP;
                int pfb = -1;  /* the next chunk's first block and pair, within this share */
                long pfp = 0;
                if (near) {
                    pfb = PK_NEAR;
                    pfp = near;
                } else if (!last) {
                    pfb = b0;
                    pfp = p0 + kc;
                } else if (pn + 1 < hi) {  /* panels are consecutive blocks */
                    pfb = b0 + nb;
                }
                int m0 = 0;
                for (int s = 0; s < ntile; s++) {  /* tiles of balanced sizes */
                    int mt = mbn / ntile + (s < mbn % ntile);
                    const uint16_t *xs = x + (long)(mb + m0) * K;
                    /* the next chunk's T0 prefetch: the first tile's, or shared */
                    int spread = pw_pk_spread && pfb >= 0 && !near && !nta
                                 && ntile <= PK_SPREAD_TILES;
                    int tpf = s == 0 || spread ? pfb : -1;
                    int pfn = spread ? ntile : 1, pfs = spread ? s : 0;
                    if (nb == 2)
                        pk_tile2(mt, xs, K, wp, KP, blocks, b0, p0, pc, first, last, tpf, pfp,
                                 nta, pfn, pfs, part, m0, mb + m0, out);
                    else
                        pk_tile1(mt, xs, K, wp, KP, blocks, b0, p0, pc, first, last, tpf, pfp,
                                 nta, pfn, pfs, part, m0, mb + m0, out);
                    m0 += mt;
                }
            }
        }
    }
}

/* The entry points' one call: every thread's share of the panels, written as out says. */
static int pk_run(const uint16_t *x, int M, const uint32_t *wp, int K, int N,
                  const Avx512bf16Out *out, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    pk_share(x, M, wp, K, N, out);
    return 0;
}

/* y = bf16(x w^T + bias) with w packed (pw_pk_pack): x [M, K] bf16, bias [N] bf16 or NULL,
 * y [M, N] bf16; N % 16 == 0, K % 2 == 0. Returns 0. */
int pw_linear_pk(const uint16_t *x, const uint32_t *wp, const uint16_t *bias, uint16_t *y,
                 int M, int N, int K, int nthreads) {
    Avx512bf16Out out = {NULL, y, bias, N};
    return pk_run(x, M, wp, K, N, &out, nthreads);
}

/* pw_linear_pk's values as fp32: y [M, N] fp32 = bf16(x w^T + bias), exactly (a bf16 value
 * widens without rounding), in one pass (a decode step's logits, which sampling reads as
 * fp32, without a bf16 copy to widen afterwards). Returns 0. */
int pw_linear_pk_f32(const uint16_t *x, const uint32_t *wp, const uint16_t *bias, float *y,
                     int M, int N, int K, int nthreads) {
    Avx512bf16Out out = {y, NULL, bias, N, 0, 1};
    return pk_run(x, M, wp, K, N, &out, nthreads);
}

/* The fused decode layer's projection share on packed weights: res [M, N] fp32 = xb w^T
 * for this thread's panels. No barrier. */
void pw_pk_share(const uint16_t *xb, int M, const uint32_t *wp, int K, int N, float *res) {
    Avx512bf16Out out = {res, NULL, NULL, N};
    pk_share(xb, M, wp, K, N, &out);
}

/* A SwiGLU MLP's first half on packed weights: y [M, I] bf16 = bf16(bf16(silu(g)) * u), g
 * and u the gate and up halves of bf16(x w^T + bias), w [2I, K] (gate rows, then up rows)
 * packed in units (its 16-row blocks reordered gate 0, up 0, gate 1, up 1, ... before
 * pw_pk_pack: cpu_kernels.pack_panels(glu=True)), bias [2I] bf16 or NULL; I % 16 == 0.
 * The bits of pw_linear_pk (over the rows packed plainly) then pw_silu_mul_avx512bf16,
 * without writing or reading back the [M, 2I] projection. Returns 0, or -2 for I % 16. */
int pw_linear_pk_glu(const uint16_t *x, const uint32_t *wp, const uint16_t *bias, uint16_t *y,
                     int M, int I, int K, int nthreads) {
    if (I % 16) return -2;
    Avx512bf16Out out = {NULL, y, bias, I, 1};
    return pk_run(x, M, wp, K, 2 * I, &out, nthreads);
}

/* The fused decode layer's gate/up share with the SiLU in the epilogue: act [M, I] bf16 as
 * pw_linear_pk_glu's y (the weight packed in units as there), for this thread's units;
 * I % 16 == 0. No barrier. */
void pw_pk_share_glu(const uint16_t *xb, int M, const uint32_t *wp, const uint16_t *bias,
                     int K, int I, uint16_t *act) {
    Avx512bf16Out out = {NULL, act, bias, I, 1};
    pk_share(xb, M, wp, K, 2 * I, &out);
}

/* add_norm_row of cpu_kernels.c with AVX-512 (bf16 rounding in one instruction, sixteen
 * lanes): if delta, h = bf16(h + delta) in place; out = bf16(w * bf16(h * rs)), rs =
 * rsqrt(mean(h^2) + eps), as bf16 (out_bf16) and/or fp32 (out_f32); out_bf16 may be h.
 * cpu_kernels.c routes every RMSNorm here once enabled (pw_enable_avx512_norm: on every CPU
 * with AVX512_BF16, AMX or not), so all paths round alike. Here rather than in cpu_amx.c
 * (where it began) so that CPUs without AMX take it too: a [1024, 896] norm 0.38 -> 0.17 ms
 * on the 2-core AMD EPYC with AVX512_BF16 (8 lanes and integer rounding before). Its
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
