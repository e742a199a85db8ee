/*
 * phasewise CPU kernels for AVX512_BF16 without AMX (AMD Zen 4 and 5, Intel Cooper Lake),
 * attention: prefill attention (a chunk of a prompt's queries against its paged context,
 * causally, flash-style) and decode attention (one new token's query heads of a KV group),
 * both on VDPBF16PS dot products. The same contracts as attention_amx.c's kernels; the
 * softmax step they share is avx512_common.h's.
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
 * Prefill attention on AVX512_BF16: one request's chunk of n queries (positions ctx ..
 * ctx + n - 1) against its ctx + n keys in the paged cache (this chunk's already written),
 * causally, flash-style and transposed, as attention_amx.c's tile version, so the softmax never
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
 * lines in one burst hold up this step's own loads behind them, so they are spread; one
 * step ahead, not two (two steps' lines in flight evict this step's before their use).
 * Returns the next step's keys (some only if this one has DPA_KB). */
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
 * keys paired (dpa_pair_v), then 16 x 16 blocks of [pair][dim] words transposed (in
 * registers: a word at a time is a gather a word). */
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
        /* attention_amx.c's step: keys past a query's position (those past kn among them) unseen */
        softmax_step(st, k0, qpos, sc, &mx, &sum, ot, hd, pt);
        __m512i pv[DPA_KB / 2];
        for (int c = 0; c < DPA_KB / 2; c++) pv[c] = _mm512_load_si512(pt + 16 * c);
        /* O^T += V^T P^T, 16 dims at a time (16 independent accumulators: with 8, each
         * product would wait on the one before it) */
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
    /* O^T's 16 x 16 blocks transposed into the queries' rows (in registers, not a gather a
     * query and 16 dims) */
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

/* The same contract as attention_amx.c's pw_prefill_attention_amx: q [n][.. n_heads x hd ..] (row
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
     * so that P V's 16 rows a step never sit a multiple of 4 KiB apart (a 4 KiB stride puts
     * all 16 in one set of L1, evicting each other) */
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
 * Decode attention on AVX512_BF16: one request's new token, the G <= 16 query heads that
 * share KV head kvh (the lanes), against its keys start .. len - 1 in the paged cache (start
 * > 0: a sliding window's first key), 32 keys a step:
 *   S^T [keys] = K Q^T: Q^T in pair order (gathered once), each key's pairs of values
 *       broadcast from its cache row (the rows of the next step prefetched: a request's
 *       blocks are scattered where the hardware prefetchers do not look);
 *   the online softmax of the prefill kernel down the keys (lazy max, weights as bf16 pairs);
 *   O [G][hd] += P V, two keys' rows interleaved into pairs (one permute per 16 values), a
 *       vector of 16 dims' pairs against a head's two weights broadcast (dpa_pv: G heads'
 *       work, where O^T [hd][16 lanes of heads] took 16 lanes' whatever G; the same
 *       products in the same order, so the same bits).
 * That is the kernel for 9-16 heads; up to 8 take attend_group_kl (below: the keys in the
 * lanes, where the heads would leave lanes idle).
 * q: [G][hd] bf16, unscaled (scale multiplies the scores); out: [G][hd] fp32 (the caller
 * rounds). Returns 0, or -1 for a shape it does not take (hd % 32, hd > 256, G > 16), which
 * the caller then computes itself. attention_amx.c's pw_attend_group_amx has the same
 * contract without `start` (whole contexts only). */
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

/* lazy_rescale (avx512_common.h) for O in rows of heads (oh [G][hd]): lazy_alpha, then the
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
 * denominators; the test's tolerance). Up to 8 heads leave most of the heads-in-lanes
 * kernel's 16 lanes idle, so the keys take the lanes there; from 9 heads on the lanes are
 * full either way and the kernel above keeps them (figures: benchmarks/RESULTS.md).
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
                           const uint16_t *v_cache, const int64_t *table, int start, int len,
                           int bs, int n_kv, int kvh, int hd, float *out) {
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
    paged_row_offs(table, bs, n_kv, hd, kvh, start, len - start < DPA_KB ? len - start : DPA_KB,
                   off[0]);
    for (int t0 = start, step = 0; t0 < len; t0 += DPA_KB, step ^= 1) {
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
                       const uint16_t *v_cache, const int64_t *table, int start, int len,
                       int bs, int n_kv, int kvh, int hd, float *out) {
    if (hd % 32 || hd < 32 || hd > DPA_MAX_HD || G < 1 || G > 16 || start < 0) return -1;
    if (pw_avx512bf16_attn_kl && G <= 8)
        return attend_group_kl(q, G, scale, k_cache, v_cache, table, start, len, bs, n_kv,
                               kvh, hd, out);
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
    paged_row_offs(table, bs, n_kv, hd, kvh, start, len - start < DPA_KB ? len - start : DPA_KB,
                   off[0]);
    for (int t0 = start, step = 0; t0 < len; t0 += DPA_KB, step ^= 1) {
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

#pragma GCC pop_options
