/*
 * phasewise CPU kernels for Intel AMX, attention: prefill attention (a chunk of a prompt's
 * queries against its paged context, causally, flash-style, in transposed form) and decode
 * attention (one new token's query heads of a KV group against its paged context), both with
 * the scores on AMX-BF16 tiles and the softmax on AVX-512. Compiled into the library with
 * linear_amx.c, under the same target pragma; the tile configuration and the pieces both use
 * are amx_common.h's. attention_avx2.c reaches the decode kernel through a weak symbol, so a
 * compiler without AMX still builds the AVX2 kernels.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

#include "avx512_common.h"  /* exp16, exp16_fast, softmax_step: shared with the AVX512_BF16 files */
#include "paged_cache.h"   /* paged_kv_row: the paged cache's rows */
#include "amx_common.h"   /* TILES, transpose16, pack_tile, store_c: shared with linear_amx.c */

/* ---------------------------------------------------------------------------------------
 * Prefill attention on AMX tiles: one request's chunk of n queries (positions ctx ..
 * ctx + n - 1) against its ctx + n keys in the paged cache (this chunk's already written),
 * causally, flash-style, in transposed form so that the softmax never reduces across a
 * vector: per 16 queries of one head and 32 keys a step,
 *   S^T [32 keys][16 queries] = K Q^T          (K rows as the left tiles, Q^T in pair order)
 *   online softmax down the keys, all 16 queries a vector: running max and sum, the output
 *   rescaled when a max grows; probabilities rounded to bf16, put in pair order (P^T)
 *   O^T [hd][16 queries] += V^T P^T            (V^T tiles: 16 dims x 32 keys)
 * and at the end O = (O^T)^T / sum. K and V^T are put in tile form once per call per KV head;
 * every query head of the group reads them. head_dim: a multiple of 32, at most 128.
 */
#define ATT_QB 32  /* queries a task: two halves of 16, the columns of the tiles */
#define ATT_KB 32  /* keys a step */

/* K of KV head g as left tiles: for 16 keys and 32 dims, the 16 key rows (64 bytes each);
 * keys at or past L are zero. */
static void pack_k(const uint16_t *k_cache, const int64_t *table, int bs, int n_kv, int hd,
                   int g, long L, int kb16, uint16_t *dst) {
    for (int d = 0; d < hd; d += 32) {
        uint16_t *out = dst + ((long)kb16 * (hd / 32) + d / 32) * 512;
        for (int t = 0; t < 16; t++) {
            long j = (long)kb16 * 16 + t;
            __m512i v = j < L
                ? _mm512_loadu_si512(paged_kv_row(k_cache, table, bs, n_kv, hd, g, j) + d)
                : _mm512_setzero_si512();
            _mm512_store_si512(out + t * 32, v);
        }
    }
}

/* V^T of KV head g as left tiles: for 32 keys and 16 dims, row d = the 32 keys' values of
 * dim d (as 16 pairs of keys): the pair-interleaved rows, transposed. */
static void pack_vt(const uint16_t *v_cache, const int64_t *table, int bs, int n_kv, int hd,
                    int g, long L, int kb32, uint32_t *dst) {
    /* 16-bit lanes of two rows interleaved: a0 b0 a1 b1 ... a15 b15 */
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                         32, 0);
    for (int d = 0; d < hd; d += 16) {
        __m512i r[16];
        for (int c = 0; c < 16; c++) {  /* key pair c: keys 2c, 2c + 1 */
            long j0 = (long)kb32 * 32 + 2 * c, j1 = j0 + 1;
            __m512i va = _mm512_setzero_si512(), vb = _mm512_setzero_si512();
            if (j0 < L)
                va = _mm512_castsi256_si512(_mm256_loadu_si256(
                    (const __m256i *)(paged_kv_row(v_cache, table, bs, n_kv, hd, g, j0) + d)));
            if (j1 < L)
                vb = _mm512_castsi256_si512(_mm256_loadu_si256(
                    (const __m256i *)(paged_kv_row(v_cache, table, bs, n_kv, hd, g, j1) + d)));
            r[c] = _mm512_permutex2var_epi16(va, idx, vb);  /* [dim][pair] as dwords */
        }
        transpose16(r);  /* -> [dim][key pair] */
        uint32_t *out = dst + ((long)kb32 * (hd / 16) + d / 16) * 256;
        for (int i = 0; i < 16; i++) _mm512_store_si512(out + i * 16, r[i]);
    }
}

/* One task: queries [q0, q0 + nq) (nq <= 32: two halves of 16) of head h against keys
 * [0, ctx + q0 + nq). kp: K tiles, vtp: V^T tiles of the head's KV group. Tiles: S^T and
 * then O^T blocks in 0-3 (keys or dims x the two halves), K or V^T in 4-5, Q^T or P^T of the
 * halves in 6-7. */
static void attend_block(const uint16_t *q, long q_stride, const uint16_t *kp,
                         const uint32_t *vtp, int hd, int h, long ctx, int q0, int nq,
                         float scale, uint16_t *out, long out_stride) {
    uint32_t qt[2][4 * 256] __attribute__((aligned(64)));   /* Q^T: a tile per 32 dims */
    float st[4 * 256] __attribute__((aligned(64)));         /* S^T: 4 tiles */
    uint32_t pt[2][256] __attribute__((aligned(64)));       /* P^T of each half */
    float ot[2][128 * 16] __attribute__((aligned(64)));     /* O^T: [hd][16 queries] fp32 */
    int DB = hd / 32, n1 = nq > 16 ? nq - 16 : 0;
    for (int d = 0; d < DB; d++) {  /* Q^T tile d: the queries' dims [32 d, 32 d + 32) */
        const uint16_t *src = q + (long)q0 * q_stride + (long)h * hd + d * 32;
        pack_tile(src, q_stride, nq < 16 ? nq : 16, 32, qt[0] + d * 256);
        pack_tile(src + 16 * q_stride, q_stride, n1, 32, qt[1] + d * 256);
    }
    memset(ot[0], 0, sizeof(float) * 16 * hd);
    memset(ot[1], 0, sizeof(float) * 16 * hd);
    /* query i sits at position ctx + q0 + i; padding queries copy the last one's */
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i last = _mm512_set1_epi32((int)(ctx + q0 + nq - 1));
    __m512 qpos[2], mx[2], sum[2];
    for (int half = 0; half < 2; half++) {
        qpos[half] = _mm512_cvtepi32_ps(_mm512_min_epi32(
            _mm512_add_epi32(_mm512_set1_epi32((int)(ctx + q0 + 16 * half)), lane), last));
        mx[half] = _mm512_set1_ps(-INFINITY);
        sum[half] = _mm512_setzero_ps();
    }
    const __m512 sc = _mm512_set1_ps(scale);
    long end = ctx + q0 + nq;  /* keys the last query sees */
    for (long k0 = 0; k0 < end; k0 += ATT_KB) {
        int kb16 = (int)(k0 / 16);
        /* S^T: tile 0 = keys 0-15 x half 0, 1 = keys 16-31 x half 0, 2 and 3 half 1 */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int d = 0; d < DB; d++) {
            _tile_loadd(4, kp + ((long)kb16 * DB + d) * 512, 64);
            _tile_loadd(6, qt[0] + d * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, kp + ((long)(kb16 + 1) * DB + d) * 512, 64);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(7, qt[1] + d * 256, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        store_c(st, 1);
        softmax_step(st, k0, qpos[0], sc, &mx[0], &sum[0], ot[0], hd, pt[0]);
        softmax_step(st + 512, k0, qpos[1], sc, &mx[1], &sum[1], ot[1], hd, pt[1]);
        /* O^T += V^T P^T: per 16 dims, both halves */
        _tile_loadd(6, pt[0], 64);
        _tile_loadd(7, pt[1], 64);
        const uint32_t *vb = vtp + (long)(k0 / 32) * (hd / 16) * 256;
        for (int d = 0; d < hd; d += 32) {
            float *o0 = ot[0] + 16 * d, *o1 = ot[1] + 16 * d;
            _tile_loadd(4, vb + (d / 16) * 256, 64);
            _tile_loadd(0, o0, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(1, o1, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, vb + (d / 16 + 1) * 256, 64);
            _tile_loadd(2, o0 + 256, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_loadd(3, o1 + 256, 64);
            _tile_dpbf16ps(3, 5, 7);
            _tile_stored(0, o0, 64);
            _tile_stored(1, o1, 64);
            _tile_stored(2, o0 + 256, 64);
            _tile_stored(3, o1 + 256, 64);
        }
    }
    for (int half = 0; half < 2; half++) {
        int rows = half ? n1 : (nq < 16 ? nq : 16);
        __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), sum[half]);
        for (int d = 0; d < hd; d += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_castps_si512(
                    _mm512_mul_ps(_mm512_load_ps(ot[half] + 16 * (d + i)), inv));
            transpose16(r);  /* -> [query][16 dims] */
            for (int i = 0; i < rows; i++)
                _mm256_storeu_si256((__m256i *)(out + (long)(q0 + 16 * half + i) * out_stride
                                                + (long)h * hd + d),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[i])));
        }
    }
}

/* q [n][.. n_heads x hd ..] (row stride q_stride), caches [blocks][bs][n_kv][hd], table: the
 * request's blocks; out [n][n_heads][hd] (row stride out_stride). Returns 0, -1 without
 * scratch memory, -2 for a head size it does not take (hd % 32, hd < 32 or hd > 128). */
int pw_prefill_attention_amx(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *table, int bs, long ctx,
                             int n, uint16_t *out, long out_stride, int n_heads, int n_kv,
                             int hd, float scale, int nthreads) {
    if (hd % 32 || hd < 32 || hd > 128 || n_heads % n_kv) return -2;
    if (n <= 0) return 0;
    long L = ctx + n;
    int KB32 = (int)((L + 31) / 32);
    size_t k_tiles = (size_t)2 * KB32 * (hd / 32), v_tiles = (size_t)KB32 * (hd / 16);
    size_t per_head = (k_tiles + v_tiles) * TILE_BYTES;
    char *buf = (char *)aligned_alloc(64, (size_t)n_kv * per_head);
    if (!buf) return -1;
    int group = n_heads / n_kv, QB = (n + ATT_QB - 1) / ATT_QB;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static) collapse(2)
        for (int g = 0; g < n_kv; g++)
            for (int kb = 0; kb < KB32; kb++) {
                uint16_t *kp = (uint16_t *)(buf + (size_t)g * per_head);
                pack_k(k_cache, table, bs, n_kv, hd, g, L, 2 * kb, kp);
                pack_k(k_cache, table, bs, n_kv, hd, g, L, 2 * kb + 1, kp);
                pack_vt(v_cache, table, bs, n_kv, hd, g, L, kb,
                        (uint32_t *)(buf + (size_t)g * per_head + k_tiles * TILE_BYTES));
            }
        _tile_loadconfig(&TILES);
        /* the longest tasks (the last query blocks see the most keys) first */
#pragma omp for schedule(dynamic)
        for (int task = 0; task < n_heads * QB; task++) {
            int qb = QB - 1 - task / n_heads, h = task % n_heads;
            const char *base = buf + (size_t)(h / group) * per_head;
            int q0 = qb * ATT_QB, nq = n - q0 < ATT_QB ? n - q0 : ATT_QB;
            attend_block(q, q_stride, (const uint16_t *)base,
                         (const uint32_t *)(base + k_tiles * TILE_BYTES), hd, h, ctx, q0, nq,
                         scale, out, out_stride);
        }
        _tile_release();
    }
    free(buf);
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * Decode attention on AMX tiles: one request's new token, the G <= 16 query heads that share
 * KV head kvh, against its len keys in the paged cache ([blocks][bs][n_kv][hd]), 32 keys a
 * step, every head at once:
 *   S^T [keys][heads] = K Q^T: the keys' rows are the left tiles, loaded straight from the
 *       cache (16 consecutive slots of a block, stride n_kv * hd) when the block size is a
 *       multiple of 16, else copied; Q^T in pair order is packed once (pack_tile);
 *   online softmax down the keys with the heads as vector lanes (running max and sum per
 *       lane; exp16, the AVX2 exp's bits); probabilities rounded to bf16 (the sum adds the
 *       rounded values), interleaved by key pairs;
 *   O += P V with AVX-512 BF16: each key pair's V rows interleaved (unpack: a permuted order
 *       of the head dimension, undone at the end), one dpbf16 per pair, head and 16 values.
 * q: [G][hd] bf16, unscaled (scale multiplies the scores); out: [G][hd] fp32. hd a multiple
 * of 32, at most 256; any block size. A NaN in a key or a query makes its heads' outputs NaN,
 * as the AVX2 kernel does. The caller has loaded the tile configuration (TILES). */
#define DEC_MAX_HD 256
#define DEC_KEYS 32

/* The left tile of 16 keys' rows x values [c, c + 32), off[j] the element offset of key j's
 * row (n of them): straight from the cache when they are consecutive slots of one block
 * (returned with its stride), else copied into buf (zero rows past n). */
static inline const uint16_t *key_rows(const uint16_t *cache, const long *off, int n,
                                       int consecutive, int n_kv, int hd, int c, uint16_t *buf,
                                       long *stride) {
    if (consecutive) {
        *stride = (long)n_kv * hd * 2;
        return cache + off[0] + c;
    }
    for (int j = 0; j < 16; j++) {
        if (j < n)
            memcpy(buf + j * 32, cache + off[j] + c, 64);
        else
            memset(buf + j * 32, 0, 64);
    }
    *stride = 64;
    return buf;
}

/* The element offsets of keys [t, t + DEC_KEYS)'s rows (those before len; one division),
 * and with `prefetch`, their K and V rows fetched into L1. Returns how many. */
static inline int key_offsets(const uint16_t *k_cache, const uint16_t *v_cache,
                              const int64_t *table, int t, int len, int bs, int n_kv, int kvh,
                              int hd, long *off, int prefetch) {
    int n = len - t < DEC_KEYS ? len - t : DEC_KEYS;
    if (n <= 0) return 0;
    long blk = t / bs, o = t % bs;
    for (int j = 0; j < n; j++) {
        off[j] = ((table[blk] * bs + o) * n_kv + kvh) * (long)hd;
        if (++o == bs) {
            o = 0;
            blk++;
        }
        if (prefetch)
            for (int c = 0; c < hd; c += 32) {
                _mm_prefetch((const char *)(k_cache + off[j] + c), _MM_HINT_T0);
                _mm_prefetch((const char *)(v_cache + off[j] + c), _MM_HINT_T0);
            }
    }
    return n;
}

/* One row of probabilities: exp(s - mx) where valid (0 elsewhere), rounded to bf16. */
static inline __m512 probs16(const float *s, __m512 mx, __mmask16 valid) {
    return round_bf16x16(_mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_load_ps(s), mx))));
}

static inline __attribute__((always_inline)) void attend_keys(
        const uint16_t *q, const int G, float scale, const uint16_t *k_cache,
        const uint16_t *v_cache, const int64_t *table, int len, int bs, int n_kv, int kvh,
        int hd, float *out) {
    uint32_t qt[DEC_MAX_HD / 32][256] __attribute__((aligned(64)));  /* Q^T, per 32 values */
    float st[DEC_KEYS][16] __attribute__((aligned(64)));    /* S^T */
    /* O: [16 heads][16 values] tiles, two per 32 values of the head dimension (its values in
     * the pair order of V's interleave: the low tile holds 8L..8L+3, the high 8L+4..8L+7) */
    float ot[DEC_MAX_HD / 16][256] __attribute__((aligned(64)));
    __m512i pt[16];                                          /* P^T by key pairs, then P */
    uint32_t pa[256] __attribute__((aligned(64)));           /* P: the left tile */
    uint32_t vb[2][256] __attribute__((aligned(64)));        /* V by key pairs: right tiles */
    uint16_t kbuf[2][512] __attribute__((aligned(64)));
    for (int c = 0; c < hd; c += 32) pack_tile(q + c, hd, G, 32, qt[c / 32]);
    memset(ot, 0, sizeof(float) * 256 * (hd / 16));
    __m512 mx = _mm512_set1_ps(-INFINITY), den = _mm512_setzero_ps();
    const __m512 sv = _mm512_set1_ps(scale);
    /* pair interleave: 32-bit lane g = (bf16 of row 2j lane g, of row 2j+1 lane g) */
    const __m512i pair_idx = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    long offs[2][DEC_KEYS];
    int consecutive = bs % 16 == 0;  /* 16 keys from a multiple of 16 lie in one block */
    key_offsets(k_cache, v_cache, table, 0, len, bs, n_kv, kvh, hd, offs[0], 1);
    for (int t0 = 0, step = 0; t0 < len; t0 += DEC_KEYS, step ^= 1) {
        int n = len - t0 < DEC_KEYS ? len - t0 : DEC_KEYS;
        const long *off = offs[step];
        /* the next step's keys and values, from scattered blocks that the hardware
         * prefetchers do not foresee */
        key_offsets(k_cache, v_cache, table, t0 + DEC_KEYS, len, bs, n_kv, kvh, hd,
                    offs[step ^ 1], 1);
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < hd; c += 32) {
            long ld;
            _tile_loadd(3, qt[c / 32], 64);
            const uint16_t *k0 = key_rows(k_cache, off, n, consecutive && n >= 16, n_kv, hd, c,
                                          kbuf[0], &ld);
            _tile_loadd(2, k0, ld);
            _tile_dpbf16ps(0, 2, 3);
            if (n > 16) {
                const uint16_t *k1 = key_rows(k_cache, off + 16, n - 16, consecutive && n >= 32,
                                              n_kv, hd, c, kbuf[1], &ld);
                _tile_loadd(4, k1, ld);
                _tile_dpbf16ps(1, 4, 3);
            }
        }
        _tile_stored(0, st[0], 64);
        _tile_stored(1, st[16], 64);
        /* the softmax, the heads as lanes; up to 8 heads fold two keys' rows into one
         * vector (keys j and j + 16), halving the exps */
        const int fold = G <= 8, vecs = fold ? (n < 16 ? n : 16) : n;
        __m512 cm = _mm512_set1_ps(-INFINITY);
        __mmask16 valid[DEC_KEYS];
        for (int j = 0; j < vecs; j++) {
            __m512 x = _mm512_load_ps(st[j]);
            valid[j] = 0xffff;
            if (fold) {
                x = _mm512_insertf32x8(x, _mm256_load_ps(st[j + 16]), 1);
                valid[j] = j + 16 < n ? 0xffff : 0x00ff;
            }
            x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[j], _mm512_mul_ps(x, sv));
            _mm512_store_ps(st[j], x);
            cm = _mm512_max_ps(x, cm);  /* a NaN score passes through below */
        }
        if (fold)  /* both halves: the heads' maxima */
            cm = _mm512_max_ps(cm, _mm512_shuffle_f32x4(cm, cm, 0x4e));
        __mmask16 grew = _mm512_cmp_ps_mask(cm, mx, _CMP_GT_OQ);
        if (grew) {
            __m512 nm = _mm512_mask_mov_ps(mx, grew, cm);
            __mmask16 first = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
            __m512 rs = _mm512_maskz_mov_ps(~first, exp16(_mm512_sub_ps(mx, nm)));
            rs = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), grew, rs);
            den = _mm512_mul_ps(den, rs);
            float r[16] __attribute__((aligned(64)));
            _mm512_store_ps(r, rs);
            for (int g = 0; g < G; g++) {
                if (!((grew >> g) & 1)) continue;
                __m512 rg = _mm512_set1_ps(r[g]);
                for (int t = 0; t < hd / 16; t++)
                    _mm512_store_ps(ot[t] + g * 16,
                                    _mm512_mul_ps(rg, _mm512_load_ps(ot[t] + g * 16)));
            }
            mx = nm;
        }
        for (int r = 0; r < 16; r++) pt[r] = _mm512_setzero_si512();
        for (int j = 0; j < vecs; j += 2) {
            __m512 p0 = probs16(st[j], mx, valid[j]);
            __m512 p1 = j + 1 < vecs ? probs16(st[j + 1], mx, valid[j + 1]) : _mm512_setzero_ps();
            den = _mm512_add_ps(den, _mm512_add_ps(p0, p1));
            __m512i u = _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            if (fold) {  /* lanes 0-7: pair j / 2 of keys; 8-15: pair j / 2 + 8 */
                pt[j / 2] = _mm512_zextsi256_si512(_mm512_castsi512_si256(u));
                pt[j / 2 + 8] = _mm512_zextsi256_si512(_mm512_extracti64x4_epi64(u, 1));
            } else {
                pt[j / 2] = u;
            }
        }
        /* O += P V on the tiles: P [heads][32 keys] is P^T's pairs transposed; V's rows
         * interleaved by key pairs, 32 values of the head dimension at a time */
        transpose16(pt);
        for (int i = 0; i < 16; i++) _mm512_store_si512(pa + i * 16, pt[i]);
        _tile_loadd(5, pa, 64);
        for (int c = 0; c < hd; c += 32) {
            for (int r = 0; r < 16; r++) {
                __m512i v0 = _mm512_setzero_si512(), v1 = v0;
                if (2 * r < n) v0 = _mm512_loadu_si512(v_cache + off[2 * r] + c);
                if (2 * r + 1 < n) v1 = _mm512_loadu_si512(v_cache + off[2 * r + 1] + c);
                _mm512_store_si512(vb[0] + r * 16, _mm512_unpacklo_epi16(v0, v1));
                _mm512_store_si512(vb[1] + r * 16, _mm512_unpackhi_epi16(v0, v1));
            }
            float *o0 = ot[c / 16], *o1 = ot[c / 16 + 1];
            _tile_loadd(6, o0, 64);
            _tile_loadd(7, vb[0], 64);
            _tile_dpbf16ps(6, 5, 7);
            _tile_stored(6, o0, 64);
            _tile_loadd(4, o1, 64);
            _tile_loadd(7, vb[1], 64);
            _tile_dpbf16ps(4, 5, 7);
            _tile_stored(4, o1, 64);
        }
    }
    /* undo the pair order: lanes 4L..4L+3 of the low tile's row are values 8L..8L+3 of the
     * 32, of the high tile's 8L+4..8L+7 */
    const __m512i lo_idx = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i hi_idx = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10,
                                            9, 8);
    if (G <= 8)  /* the two halves' sums of each head */
        den = _mm512_add_ps(den, _mm512_shuffle_f32x4(den, den, 0x4e));
    float d[16] __attribute__((aligned(64)));
    _mm512_store_ps(d, den);
    for (int g = 0; g < G; g++) {
        __m512 inv = _mm512_set1_ps(d[g] > 0.0f ? 1.0f / d[g] : 0.0f);
        if (d[g] != d[g]) inv = _mm512_set1_ps(d[g]);  /* a NaN sum: NaN outputs */
        for (int c = 0; c < hd; c += 32) {
            __m512 l = _mm512_load_ps(ot[c / 16] + g * 16);
            __m512 h = _mm512_load_ps(ot[c / 16 + 1] + g * 16);
            _mm512_storeu_ps(out + g * hd + c,
                             _mm512_mul_ps(inv, _mm512_permutex2var_ps(l, lo_idx, h)));
            _mm512_storeu_ps(out + g * hd + c + 16,
                             _mm512_mul_ps(inv, _mm512_permutex2var_ps(l, hi_idx, h)));
        }
    }
}

/* Returns 0, or -1 (nothing done) for G or hd it does not take. */
int pw_attend_group_amx(const uint16_t *q, int G, float scale, const uint16_t *k_cache,
                        const uint16_t *v_cache, const int64_t *table, int len, int bs,
                        int n_kv, int kvh, int hd, float *out) {
    if (hd % 32 || hd < 32 || hd > DEC_MAX_HD || G < 1 || G > 16) return -1;
    _tile_loadconfig(&TILES);
    switch (G) {  /* the heads' count a constant: their accumulators stay in registers */
#define CASE(g) case g: attend_keys(q, g, scale, k_cache, v_cache, table, len, bs, n_kv, kvh, \
                                    hd, out); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
    }
    _tile_release();
    return 0;
}

#pragma GCC pop_options
