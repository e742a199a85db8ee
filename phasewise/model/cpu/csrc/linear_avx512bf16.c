/*
 * phasewise CPU kernels for AVX512_BF16 without AMX (AMD Zen 4 and 5, Intel Cooper Lake): a
 * bf16 linear layer on VDPBF16PS, for the fused decode layer's projections and for the
 * linear dispatch's rows between the weight streams and torch's GEMM; the panels layout and
 * its kernel. Attention is attention_avx512bf16.c's, the element-wise steps
 * elementwise_avx512bf16.c's.
 *
 * Why hand-written: on these CPUs linear_avx2.c's AVX2 paths widen each bf16 weight to fp32
 * and multiply in fp32, a fraction of the bf16 dot-product rate, and torch's bf16 GEMM
 * (oneDNN) goes op by op through Python, reordering each weight on every call, far from the
 * decode step's memory roofline (figures: benchmarks/RESULTS.md).
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

#include "avx512_common.h"  /* exp16, exp16_fast, lazy_alpha, softmax_step: shared with the AMX files */
#include "paged_cache.h"   /* paged_row_offs: the paged cache's rows */

#define AVX512BF16_R 4          /* weight rows a tile (3 for 7-8 tokens) */
#define AVX512BF16_MT 8         /* the most tokens a tile (6 of 4 rows, 8 of 3) */
#define AVX512BF16_XBLOCK_BYTES (512L * 1024) /* a block of tokens' bf16 rows, kept in L2 */

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
        /* the 16 lanes summed in avx512bf16_hsum4's order, as the rows of a group of 3 or
         * 4 are: a channel's sum is the same whether it falls in a group or in the tail
         * (which of them it falls in depends on M, through R) */
        float b = out->y && out->bias ? avx512bf16_bf16_to_f32(out->bias[n0]) : 0.0f;
        const __m512 z = _mm512_setzero_ps();
        for (int m = 0; m < MT; m++) {
            float s = _mm_cvtss_f32(avx512bf16_hsum4(acc[m][0], z, z, z));
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

/* The fused decode layer's side (fused_layer.c): x fp32 [M, K] (bf16 values) -> xb bf16
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
 * products. (Blocks laid end to end, a tile's 2-4 blocks would be 2-4 streams, which read
 * slower at few tokens: docs/cpu-kernels.md, "Panels", Tiles.)
 * No lane reduction at the end of each tile, unlike the in-place kernel above (4 rows x 6
 * tokens): faster at every token count from 8 up (figures: benchmarks/RESULTS.md).
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
 * that the weights a step streams do not pass through L2 into L3, evicting everything else
 * there (the layers' activations, norms and KV rows, the host's Python and torch code and
 * data between the calls). The distance matters both ways: too near and the loads catch up,
 * too far and the lines are gone before use. By the tokens of a block:
 *   1-6 tokens: the tile's own stream 16 pairs ahead (one token) or 32 (PK_NEAR). Not at 8
 *     tokens: a pair's eight tokens of work leave too little time before its lines are due.
 *   7-12 tokens (one tile a chunk): the next chunk, non-temporally, in chunks of at most
 *     PK_KC_NTA pairs (12 KiB of a 2-block panel, still in L1 when the tile comes to it).
 *   more (two tiles a chunk or more): T0 a chunk ahead (the lines must reach L2: every tile
 *     of the chunk reads them). With 2-PK_SPREAD_TILES tiles (13-72 tokens) every tile
 *     prefetches its share of the next chunk (tile s: pairs s, s + ntile, ...): the first
 *     tile alone would issue the misses faster than a core retires them. A prompt's blocks
 *     of 96 tokens (8 tiles) keep the first tile's prefetch: their chunk's work is long
 *     enough for it.
 * The figures behind each bound: benchmarks/RESULTS.md.
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

#pragma GCC pop_options
