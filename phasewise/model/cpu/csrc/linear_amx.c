/*
 * phasewise CPU kernels for Intel AMX (AMX-BF16 tiles, with AVX-512 BF16): bf16 linear
 * layers (plain, and a SwiGLU gate/up projection fused with its SiLU) and the fused decode
 * layer's projections. Attention on the tiles is attention_amx.c's.
 *
 * Why hand-written: torch's bf16 F.linear on an AMX CPU goes through oneDNN, which reorders
 * the weight into its blocked layout on every call. At a decode step's few rows that
 * reorder is most of the work, and torch moves the weights well below the read bandwidth
 * (figures: benchmarks/RESULTS.md). Here the weights are
 * read where they lie, in torch's own [N, K] layout, never repacked and never copied: so no
 * second copy of the model is resident and a decode step reads each weight once.
 *
 * The trick: y^T = W x^T. A tile multiply TDPBF16PS computes C[16][16] += A[16][32] B[16][32]
 * (fp32 += bf16 pairs), where A is read row by row (16 rows of 64 bytes, any stride) and B
 * must be in "VNNI" order (row r holds the pairs k = 2r, 2r+1 of 16 columns). Sixteen rows of
 * W, 32 values of K each, are exactly an A tile, loaded straight from the weight with stride
 * 2K bytes. The activations (few, and read many times) are the ones repacked: x [M, K] is put
 * in VNNI order, 16 tokens x 32 values per 1 KiB tile, one L2-sized block of tokens at a
 * time. C then holds 16 output channels x 16 tokens in fp32; the epilogue transposes it
 * (AVX-512), adds the bias, rounds to bf16 once (to nearest even, as torch) and stores y.
 *
 * Blocking: 2 A tiles (32 channels) x 2 B tiles (32 tokens) -> 4 C tiles, all 8 tile
 * registers. Threads split the channels into 32-row panels; a panel's weights are read from
 * memory once per block of tokens (all of them when the block fits in L2) while the next
 * panel is prefetched into L2, spread over this panel's steps; with many token pairs a
 * block, K goes in chunks whose weights stay in L1 while every pair passes over them. K need
 * not be a multiple of 32 (the last partial block's weights are copied, zero-padded, once
 * per panel), nor N of 16 (the last tile is shifted back to end at N, recomputing a few
 * channels), but N >= 16. benchmarks/bench_linear.py times it against torch and the AVX2
 * kernels.
 *
 * Layout: x [M, K] bf16 row-major, w [N, K] bf16 row-major, optional bias [N] bf16, y [M, N]
 * bf16. Accumulation in fp32.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask Linux for permission to use AMX tile data (per process; needed once before the first
 * tile instruction). Returns 0 when granted. No AMX instruction here: safe on any x86-64. */
int pw_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")

#include "avx512_common.h"  /* exp16, exp16_fast, softmax_step: shared with the AVX512_BF16 files */
#include "paged_cache.h"   /* paged_kv_row: the paged cache's rows */
#include "amx_common.h"   /* TILES, transpose16, pack_tile, store_c: shared with attention_amx.c */

#define XBLOCK_MAX_BYTES (1L << 20) /* packed activations per token block: stays in L2 */
#define NT_STORE_BYTES (4L << 20)   /* outputs at least this large bypass the caches */
#define KC 8                        /* K blocks a chunk: 2 x 8 KiB of weights, in L1 */
#define KC_MIN_PAIRS 4              /* token pairs a chunk must serve to be worth its spills */
#define KO_TILES 16                 /* K-outer: 16-token tiles a token block */
#define KO_XBLOCK_BYTES (1L << 19)  /* K-outer: a thread's packed chunk of the token block */
#define KO_SPILL_MAX_BYTES (1L << 20) /* K-outer: a thread's C tiles waiting between chunks */

/* The same from fp32 rows (the fused decode layer's activations, already bf16-valued). */
static inline void pack_tile_f32(const float *src, long ld, int rows, int kt, uint32_t *dst) {
    __m512i r[16];
    __mmask16 lo = kt >= 16 ? 0xffff : (__mmask16)((1u << kt) - 1u);
    __mmask16 hi = kt >= 32 ? 0xffff : kt <= 16 ? 0 : (__mmask16)((1u << (kt - 16)) - 1u);
    for (int t = 0; t < 16; t++) {
        if (t >= rows) { r[t] = _mm512_setzero_si512(); continue; }
        __m512 a = _mm512_maskz_loadu_ps(lo, src + (long)t * ld);
        __m512 b = _mm512_maskz_loadu_ps(hi, src + (long)t * ld + 16);
        r[t] = (__m512i)_mm512_cvtne2ps_pbh(b, a);  /* exact: the values are bf16 already */
    }
    transpose16(r);
    for (int i = 0; i < 16; i++) _mm512_store_si512(dst + i * 16, r[i]);
}

static inline float bf16_to_f32_amx(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline __m512 load_bias16(const uint16_t *bias, __mmask16 nm) {
    if (!bias) return _mm512_setzero_ps();
    __m256i h = _mm256_maskz_loadu_epi16(nm, bias);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m256i round16(__m512i acc, __m512 bias) {
    return (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_castsi512_ps(acc), bias));
}

/* Two C tiles ([16 rows][16 columns] fp32 each) transposed into registers: a[j] holds
 * column j of c0, b[j] of c1. */
static inline void load_transposed(const float *c0, const float *c1, __m512i a[16],
                                   __m512i b[16]) {
    for (int i = 0; i < 16; i++) {
        a[i] = _mm512_load_si512(c0 + i * 16);
        b[i] = _mm512_load_si512(c1 + i * 16);
    }
    transpose16(a);
    transpose16(b);
}

/* Int8 weights: the 16 channels of each token's row a[t] times their scales s[0..15] (the
 * products ran on the integers; NULL: bf16 weights, nothing to do). */
static inline void scale_rows(__m512i a[16], const float *s) {
    if (!s) return;
    __m512 v = _mm512_loadu_ps(s);
    for (int t = 0; t < 16; t++)
        a[t] = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(a[t]), v));
}

/* The epilogue of a tile pair: c0 holds channels [na, na + 16), c1 [nb, nb + 16), each
 * [16 channels][16 tokens] fp32; tokens [m0, m0 + mt) go to y (bf16, x scale, + bias). When the two
 * tiles are adjacent and their 64 bytes of y are aligned, one 64-byte store per token
 * (streaming past the caches for large outputs: `nt`). */
static void store_pair(const float *c0, const float *c1, int na, int nb, uint16_t *y, int N,
                       int m0, int mt, const uint16_t *bias, const float *scale, int nt) {
    __m512i a[16], b[16];
    load_transposed(c0, c1, a, b);
    scale_rows(a, scale ? scale + na : NULL);
    scale_rows(b, scale ? scale + nb : NULL);
    __m512 ba = load_bias16(bias ? bias + na : NULL, 0xffff);
    __m512 bb = load_bias16(bias ? bias + nb : NULL, 0xffff);
    if (nb == na + 16 && ((uintptr_t)(y + (long)m0 * N + na) & 63) == 0 && (N & 31) == 0) {
        for (int t = 0; t < mt; t++) {
            __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(round16(a[t], ba)),
                                           round16(b[t], bb), 1);
            uint16_t *dst = y + (long)(m0 + t) * N + na;
            if (nt)
                _mm512_stream_si512((__m512i *)dst, v);
            else
                _mm512_store_si512(dst, v);
        }
        return;
    }
    for (int t = 0; t < mt; t++) {  /* overlapping tiles (N % 32 != 0): b last, same values */
        _mm256_storeu_si256((__m256i *)(y + (long)(m0 + t) * N + na), round16(a[t], ba));
        _mm256_storeu_si256((__m256i *)(y + (long)(m0 + t) * N + nb), round16(b[t], bb));
    }
}

/* The weights of a K tail (K % 32 values of 16 rows), zero-padded to a full A tile. */
static void tail_tile(const uint16_t *w, int K, uint16_t *dst) {
    int k0 = K / 32 * 32;
    memset(dst, 0, TILE_BYTES);
    for (int i = 0; i < 16; i++) memcpy(dst + i * 32, w + (long)i * K + k0, (size_t)(K - k0) * 2);
}

/* Prefetch cursor: columns [c0, c1) of the rows [n, n + rows) of w (of K values of eb
 * bytes each), spread evenly over `steps` calls of prefetch_step; whole rows are one
 * contiguous span. */
typedef struct {
    const char *p, *row_end;  /* the next line; the end of the current row's window */
    long span, stride;        /* a row window's bytes; the bytes from one row to the next */
    int rows;                 /* rows left after the current one */
    long per_step;
} Prefetch;

static void prefetch_window(Prefetch *pf, const void *w, int eb, int n, int rows, int K,
                            int c0, int c1, long steps) {
    long span = (long)(c1 - c0) * eb;
    if (rows <= 0) rows = 0, span = 0;
    if (c0 == 0 && c1 == K && rows > 0) span *= rows, rows = 1;  /* contiguous */
    pf->p = (const char *)w + ((long)n * K + c0) * eb;
    pf->row_end = pf->p + span;
    pf->span = span;
    pf->stride = (long)K * eb;
    pf->rows = rows > 0 ? rows - 1 : 0;
    long lines = (long)(rows > 0 ? rows : 0) * ((span + 63) / 64);
    pf->per_step = steps > 0 ? (lines + steps - 1) / steps : lines;
}

static inline void prefetch_step(Prefetch *pf) {
    for (long i = 0; i < pf->per_step; i++, pf->p += 64) {
        if (pf->p >= pf->row_end) {
            if (pf->rows == 0) return;
            pf->rows--;
            pf->p = pf->row_end - pf->span + pf->stride;
            pf->row_end = pf->p + pf->span;
        }
        _mm_prefetch(pf->p, _MM_HINT_T1);
    }
}

/* Queue columns [c0, c1) of panel i's weights (none if i is past the last panel): pf[0] its
 * first rows, pf[1] (glu) the up rows. */
static void prefetch_panel(Prefetch pf[2], const void *w, int eb, int i, int npanels, int N,
                           int K, int glu, int c0, int c1, long steps) {
    int width = glu ? 16 : 32;
    int n = i < npanels ? i * width : N;
    int rows = n + width < N ? width : N - n;
    prefetch_window(&pf[0], w, eb, n, rows, K, c0, c1, steps);
    prefetch_window(&pf[1], w, eb, glu ? N + n : n, glu ? rows : 0, K, c0, c1, steps);
}

/* A panel: the two 16-row tiles of weights that share the activations, at rows na and nb, K
 * values each, with their zero-padded K tails when K % 32 != 0. For a plain linear layer
 * they are 32 consecutive rows (nb = na + 16, unless the panel overhangs N); for the fused
 * gate/up + SiLU they are gate rows and the matching up rows (nb = I + na). */
typedef struct {
    const uint16_t *wa, *wb;
    int na, nb;
    uint16_t tail[2][TILE_BYTES / 2] __attribute__((aligned(64)));
} Panel;

static void panel_rows(Panel *p, const uint16_t *w, int na, int nb, int K) {
    p->na = na;
    p->nb = nb;
    p->wa = w + (long)na * K;
    p->wb = w + (long)nb * K;
    if (K % 32) {
        tail_tile(p->wa, K, p->tail[0]);
        tail_tile(p->wb, K, p->tail[1]);
    }
}

/* The rows of panel i of a layer: plain (glu = 0, 32 rows of N) or gate/up (glu = 1, 16 of
 * N = I, and the matching up rows). */
static inline void panel_pos(int i, int N, int glu, int *na, int *nb) {
    if (glu) {
        *na = i * 16 + 16 > N ? N - 16 : i * 16;
        *nb = N + *na;
        return;
    }
    int n0 = i * 32;
    *na = n0 + 16 > N ? N - 16 : n0;
    *nb = n0 + 32 > N ? N - 16 : n0 + 16;
}

static void panel_at(Panel *p, const uint16_t *w, int i, int N, int K, int glu) {
    int na, nb;
    panel_pos(i, N, glu, &na, &nb);
    panel_rows(p, w, na, nb, K);
}

/* 16 int8 rows (row stride K bytes), columns [c0, c1), as bf16 into dst (row stride K
 * values): exact, since every integer of -127..127 is a bf16. */
static void widen_rows(const int8_t *q, int K, int c0, int c1, uint16_t *dst, Prefetch *pf) {
    for (int r = 0; r < 16; r++) {
        prefetch_step(&pf[0]);  /* the next panel's rows keep coming meanwhile */
        prefetch_step(&pf[1]);
        const int8_t *src = q + (long)r * K;
        uint16_t *out = dst + (long)r * K;
        int c = c0;
        for (; c + 64 <= c1; c += 64) {  /* whole lines: four 16-lane widenings */
            __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                (const __m128i *)(src + c))));
            __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                (const __m128i *)(src + c + 16))));
            __m512 f2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                (const __m128i *)(src + c + 32))));
            __m512 f3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                (const __m128i *)(src + c + 48))));
            _mm512_storeu_si512(out + c, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
            _mm512_storeu_si512(out + c + 32, (__m512i)_mm512_cvtne2ps_pbh(f3, f2));
        }
        for (; c < c1; c += 32) {
            __mmask32 m = c1 - c >= 32 ? 0xffffffffu : (1u << (c1 - c)) - 1u;
            __m256i b = _mm256_maskz_loadu_epi8(m, src + c);
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
            _mm512_mask_storeu_epi16(out + c, m, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* Panel i of an int8 layer for K columns [c0, c1): its two 16-row tiles widened into wbuf
 * (32 rows of K values: the a rows, then the b rows), so that the tiles read bf16; pf (the
 * next panel's prefetch) takes WIDEN_STEPS steps meanwhile. */
#define WIDEN_STEPS 32
static void panel_at_int8(Panel *p, const int8_t *q, int i, int N, int K, int glu, int c0,
                          int c1, uint16_t *wbuf, Prefetch *pf) {
    int na, nb;
    panel_pos(i, N, glu, &na, &nb);
    widen_rows(q + (long)na * K, K, c0, c1, wbuf, pf);
    widen_rows(q + (long)nb * K, K, c0, c1, wbuf + 16L * K, pf);
    panel_rows(p, wbuf, 0, 16, K);
    p->na = na;
    p->nb = nb;
}

/* C tiles 0..3 += the panel's weights x the packed token blocks x0 (and x1 if two) over the
 * K blocks [kb0, kb1) (and the K tail when kb1 is the last full block): tile 0 = rows na x
 * x0, 1 = nb x x0, 2 = na x x1, 3 = nb x x1. x0 and x1 start at K block xk0. */
static inline void panel_steps(const Panel *p, const uint32_t *x0, const uint32_t *x1,
                               int two, int K, int kb0, int kb1, int xk0, Prefetch *pf) {
    int KF = K / 32;
    long lda = (long)K * 2;
    for (int kb = kb0; kb < kb1; kb++) {
        if (pf) {
            prefetch_step(&pf[0]);
            prefetch_step(&pf[1]);
        }
        _tile_loadd(4, p->wa + kb * 32, lda);
        _tile_loadd(6, x0 + (long)(kb - xk0) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, p->wb + kb * 32, lda);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
            _tile_loadd(7, x1 + (long)(kb - xk0) * 256, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    if (kb1 == KF && K % 32) {
        _tile_loadd(4, p->tail[0], 64);
        _tile_loadd(5, p->tail[1], 64);
        _tile_loadd(6, x0 + (long)(KF - xk0) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
            _tile_loadd(7, x1 + (long)(KF - xk0) * 256, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

static inline void zero_c(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* panel_steps over all of K into freshly zeroed C tiles. */
static inline void panel_product(const Panel *p, const uint32_t *x0, const uint32_t *x1,
                                 int two, int K, Prefetch *pf) {
    zero_c();
    panel_steps(p, x0, x1, two, K, 0, K / 32, 0, pf);
}

/* act = bf16(bf16(silu(g)) * u) for 16 channels of a token, with g and u its rounded
 * projections (+ their biases), as the unfused path computes them; as fp32. */
static inline __m512 glu16(__m512i g, __m512i u, __m512 bg, __m512 bu) {
    __m512 gv = round_bf16x16(_mm512_add_ps(_mm512_castsi512_ps(g), bg));
    __m512 uv = round_bf16x16(_mm512_add_ps(_mm512_castsi512_ps(u), bu));
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    __m512 silu = round_bf16x16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    return round_bf16x16(_mm512_mul_ps(silu, uv));
}

/* The epilogue of a gate/up tile pair (channels [n, n + 16) of gate and of up): tokens
 * [m0, m0 + mt) of act into y, bf16 (or fp32 into yf when y is NULL, for the fused layer). */
static void store_glu(const float *cg, const float *cu, int n, int N, uint16_t *y, float *yf,
                      int m0, int mt, const uint16_t *bias, const float *scale) {
    __m512i g[16], u[16];
    load_transposed(cg, cu, g, u);
    scale_rows(g, scale ? scale + n : NULL);
    scale_rows(u, scale ? scale + N + n : NULL);
    __m512 bg = load_bias16(bias ? bias + n : NULL, 0xffff);
    __m512 bu = load_bias16(bias ? bias + N + n : NULL, 0xffff);
    for (int t = 0; t < mt; t++) {
        __m512 a = glu16(g[t], u[t], bg, bu);
        if (y)
            _mm256_storeu_si256((__m256i *)(y + (long)(m0 + t) * N + n),
                                (__m256i)_mm512_cvtneps_pbh(a));  /* exact: bf16-valued */
        else
            _mm512_storeu_ps(yf + (long)(m0 + t) * N + n, a);
    }
}

/* store_glu's values for a fused MLP: channels [n, n + 16) of tokens [16 tile, 16 tile + 16)
 * written as the next projection's packed B tiles (ypack: [tile][K block of 32 channels][16
 * pair rows][16 tokens] 32-bit pairs, kbo K blocks a tile), straight from the untransposed C
 * tiles (rows = channels, the bias a scalar per row): the same elementwise values, no
 * transpose here and no packing there. n % 16 == 0 (the channels of a pair row are one
 * panel's). */
static void store_glu_packed(const float *cg, const float *cu, int n, int N, int tile, int kbo,
                             uint32_t *ypack, const uint16_t *bias) {
    static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                       15, 31};
    __m512i idx = _mm512_loadu_si512(pairs);
    uint32_t *dst = ypack + (((long)tile * kbo + n / 32) * 16 + (n % 32) / 2) * 16;
    for (int r = 0; r < 8; r++) {
        __m512 a[2];
        for (int j = 0; j < 2; j++) {
            int ch = 2 * r + j;
            __m512 bg = bias ? _mm512_set1_ps(bf16_to_f32_amx(bias[n + ch])) : _mm512_setzero_ps();
            __m512 bu = bias ? _mm512_set1_ps(bf16_to_f32_amx(bias[N + n + ch]))
                             : _mm512_setzero_ps();
            a[j] = glu16(_mm512_load_si512(cg + ch * 16), _mm512_load_si512(cu + ch * 16), bg,
                         bu);
        }
        __m512i v = (__m512i)_mm512_cvtne2ps_pbh(a[1], a[0]);  /* exact: bf16-valued */
        _mm512_store_si512(dst + r * 16, _mm512_permutexvar_epi16(idx, v));
    }
}

/* Scratch for the packed activations of one token block and the threads' spilled C tiles,
 * grown as needed and kept (no page faults per call); one per calling thread, so engines
 * running in different threads of one process never share it. */
static __thread void *xp_buf;
static __thread size_t xp_size;
static void *packed_scratch(size_t bytes) {
    if (xp_size < bytes) {
        free(xp_buf);
        xp_buf = aligned_alloc(64, (bytes + 4095) / 4096 * 4096);
        xp_size = xp_buf ? bytes : 0;
    }
    return xp_buf;
}


/* The C tiles of a finished token pair (tiles tb and tb + 1 if two) through the plain or
 * SiLU epilogue into y. */
static inline void pair_epilogue(const Panel *p, int tb, int two, int M, int N, int glu,
                                 uint16_t *y, uint32_t *ypack, const uint16_t *bias,
                                 const float *scale, int nt) {
    float c[4][256] __attribute__((aligned(64)));
    store_c(c[0], two);
    for (int half = 0; half <= two; half++) {
        int m0 = (tb + half) * 16, mt = M - m0 < 16 ? M - m0 : 16;
        if (ypack)
            store_glu_packed(c[2 * half], c[2 * half + 1], p->na, N, tb + half, N / 32, ypack,
                             bias);
        else if (glu)
            store_glu(c[2 * half], c[2 * half + 1], p->na, N, y, NULL, m0, mt, bias, scale);
        else
            store_pair(c[2 * half], c[2 * half + 1], p->na, p->nb, y, N, m0, mt, bias, scale,
                       nt);
    }
}

static inline void reload_c(const float *spill) {
    _tile_loadd(0, spill, 64);
    _tile_loadd(1, spill + 256, 64);
    _tile_loadd(2, spill + 512, 64);
    _tile_loadd(3, spill + 768, 64);
}

/* The end of the K chunk that starts at block c0: kcb blocks on, or the last; a chunk that
 * would end at the K tail (block KF of KB = KF + 1) takes it in (panel_steps does the tail
 * with the chunk's last full block). */
static inline int chunk_end(int c0, int kcb, int KB, int KF) {
    int c1 = c0 + kcb < KB ? c0 + kcb : KB;
    return c1 == KF ? KB : c1;
}

/* The driver of both entry points below: y [M, N] from w's N rows (glu = 0), or from its 2N
 * rows [gate | up] through SiLU (glu = 1). Tokens in blocks of tb_block 16-token tiles; K
 * in chunks of kcb blocks (all of K in one chunk, or fewer when the block would not fit in
 * L2 over all of K); per chunk, each panel of a thread passes its weights over the block's
 * token pairs, kc K blocks at a time (from L1 when kc = KC), the C tiles waiting between
 * chunks in the thread's spill area (one set per pair, or per panel and pair when K takes
 * several chunks: `panels` sets). Each thread packs its own copy of the activations: no
 * barriers, and no cache line that one core writes while the other has it (a shared copy,
 * packed half by each thread, bounces its lines between the cores). Every C tile takes its K blocks in order, whatever the
 * chunking: the same bits. */
static int amx_blocks(const uint16_t *x, const uint16_t *w, const int8_t *wq,
                      const float *scale, const uint16_t *bias, uint16_t *y, int M, int N, int K,
                      int nthreads, int glu, int tb_block, int kcb, int kc, int panels,
                      const uint32_t *xpre, uint32_t *ypack) {
    int KB = (K + 31) / 32, KF = K / 32, TB = (M + 15) / 16;
    int npanels = glu ? (N + 15) / 16 : (N + 31) / 32;
    int span = kcb < KB;  /* the C tiles wait per panel across chunks */
    long spill_bytes = (long)(span ? panels : 1) * (tb_block / 2) * 4 * TILE_BYTES;
    long xbytes = (long)tb_block * (kcb + 1) * TILE_BYTES;  /* + 1: a K tail joins a chunk */
    long wbytes = wq ? ((32L * K * 2) + 63) / 64 * 64 : 0;   /* int8: a widened panel */
    long per = xbytes + spill_bytes + wbytes;
    uint32_t *xp = (uint32_t *)packed_scratch((size_t)nthreads * per);
    if (!xp) return -1;
    int nt = !glu && (long)M * N * 2 >= NT_STORE_BYTES;
#pragma omp parallel num_threads(nthreads)
    {
        /* The panels are cut into nthreads slices, each with its own spill area (sized for
         * a slice's panels); a thread takes slices t, t + T, ... so that a team smaller than
         * asked for (OMP_THREAD_LIMIT, nested regions) still fits them. */
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        int first = (int)((long)npanels * t / nthreads), end = first;  /* this thread's span */
        for (int v = t; v < nthreads; v += T) end = (int)((long)npanels * (v + 1) / nthreads);
        uint32_t *xt = (uint32_t *)((char *)xp + (size_t)t * per);
        uint16_t *wbuf = (uint16_t *)((char *)xt + xbytes + spill_bytes);
        const void *wsrc = wq ? (const void *)wq : (const void *)w;
        int eb = wq ? 1 : 2;
        Prefetch pf[2];
        /* this thread's first panel's first chunk, on its way while the tokens are packed */
        int c1 = chunk_end(0, kcb, KB, KF) * 32;
        prefetch_panel(pf, wsrc, eb, first < end ? first : npanels, npanels, N, K, glu, 0,
                       c1 < K ? c1 : K, 1);
        prefetch_step(&pf[0]);
        prefetch_step(&pf[1]);
        _tile_loadconfig(&TILES);
        Panel p;
        for (int tb0 = 0; tb0 < TB && first < end; tb0 += tb_block) {
            int tb1 = tb0 + tb_block < TB ? tb0 + tb_block : TB, pairs = (tb1 - tb0 + 1) / 2;
            for (int kc0 = 0, kc1; kc0 < KB; kc0 = kc1) {
                kc1 = chunk_end(kc0, kcb, KB, KF);
                int width = kc1 - kc0;
                int kend = kc1 < KF ? kc1 : KF;  /* full K blocks of the chunk end here */
                for (int tb = tb0; tb < tb1 && !xpre; tb++)
                    for (int kb = kc0; kb < kc1; kb++) {
                        int m0 = tb * 16, rows = M - m0 < 16 ? M - m0 : 16;
                        pack_tile(x + (long)m0 * K + kb * 32, K, rows, K - kb * 32,
                                  xt + ((long)(tb - tb0) * width + kb - kc0) * 256);
                    }
                for (int v = t; v < nthreads; v += T) {
                    int lo = (int)((long)npanels * v / nthreads);
                    int hi = (int)((long)npanels * (v + 1) / nthreads);
                    float *cs = (float *)((char *)xp + (size_t)v * per + xbytes);
                    for (int i = lo; i < hi; i++) {
                        /* the next panel's chunk, or the first panel's next chunk or block */
                        int next = i + 1 < hi ? i + 1 : lo, nc0 = i + 1 < hi ? kc0 : kc1;
                        if (nc0 >= KB) nc0 = 0, next = tb1 < TB ? lo : npanels;
                        int nc1 = chunk_end(nc0, kcb, KB, KF);
                        prefetch_panel(pf, wsrc, eb, next, npanels, N, K, glu, nc0 * 32,
                                       nc1 * 32 < K ? nc1 * 32 : K,
                                       (long)pairs * width + (wq ? WIDEN_STEPS : 0));
                        if (wq)
                            panel_at_int8(&p, wq, i, N, K, glu, kc0 * 32,
                                          kc1 * 32 < K ? kc1 * 32 : K, wbuf, pf);
                        else
                            panel_at(&p, w, i, N, K, glu);
                        float *spill_i = cs + (long)(span ? i - lo : 0) * pairs * 1024;
                        for (int kb0 = kc0; kb0 < kend || kb0 == kc0; kb0 += kc) {
                            int kb1 = kb0 + kc < kend ? kb0 + kc : kend;
                            int last = kb1 == KF && kc1 == KB;
                            for (int tb = tb0; tb < tb1; tb += 2) {
                                int two = tb + 1 < tb1;
                                const uint32_t *x0 = xpre ? xpre + ((long)tb * KB + kc0) * 256
                                                          : xt + (long)(tb - tb0) * width * 256;
                                const uint32_t *x1 = x0 + (long)(xpre ? KB : width) * 256;
                                float *spill = spill_i + (long)(tb - tb0) / 2 * 1024;
                                if (kb0 == 0)
                                    zero_c();
                                else
                                    reload_c(spill);
                                panel_steps(&p, x0, x1, two, K, kb0, kb1, kc0, pf);
                                if (last)
                                    pair_epilogue(&p, tb, two, M, N, glu, y, ypack, bias, scale,
                                                  nt);
                                else
                                    store_c(spill, 1);
                            }
                            if (kb1 >= kend) break;
                        }
                    }
                }
            }
        }
        _tile_release();
        if (nt) _mm_sfence();  /* this thread's streaming stores, before the region's barrier */
    }
    return 0;
}

/* The blocking for an M x K x N call, then amx_blocks. */
static int amx_linear(const uint16_t *x, const uint16_t *w, const int8_t *wq,
                      const float *scale, const uint16_t *bias, uint16_t *y, int M, int N, int K,
                      int nthreads, int glu, const uint32_t *xpre, uint32_t *ypack) {
    if (N < 16) return -2;
    if (M <= 0) return 0;
    int KB = (K + 31) / 32, KF = K / 32, TB = (M + 15) / 16;
    int npanels = glu ? (N + 15) / 16 : (N + 31) / 32;
    int per_thread = (npanels + nthreads - 1) / nthreads;
    /* Token blocks of an even number of 16-token tiles whose packed size (all of K) fits
     * in L2. */
    int tb_block = (int)(XBLOCK_MAX_BYTES / ((long)KB * TILE_BYTES)) / 2 * 2;
    if (tb_block < 2) tb_block = 2;
    /* The weights are read once per token block: when the blocks over all of K would be
     * smaller than KO_TILES, K in chunks instead (K-outer), if the C tiles waiting between
     * chunks fit in KO_SPILL_MAX_BYTES (4864 -> 896 at 512 rows: blocks of 96 tokens read
     * its weights 6 times, and the call was bound by that). */
    if (TB > tb_block && tb_block < KO_TILES) {
        int tbk = TB < KO_TILES ? (TB + 1) / 2 * 2 : KO_TILES;
        int kcb = (int)(KO_XBLOCK_BYTES / ((long)tbk * TILE_BYTES)) / KC * KC;
        if (kcb < KC) kcb = KC;
        if ((long)per_thread * (tbk / 2) * 4 * TILE_BYTES <= KO_SPILL_MAX_BYTES)
            return amx_blocks(x, w, wq, scale, bias, y, M, N, K, nthreads, glu, tbk, kcb, KC,
                              per_thread, xpre, ypack);
    }
    /* K in chunks of KC blocks (from L1) when at least KC_MIN_PAIRS token pairs share each
     * (else the spills cost more than the L1 hits gain: a chunk's weights must serve enough
     * token pairs to pay for spilling and reloading their C tiles) */
    int kc = tb_block / 2 >= KC_MIN_PAIRS && TB >= 2 * KC_MIN_PAIRS ? KC : (KF > 0 ? KF : 1);
    if (tb_block > TB) tb_block = (TB + 1) / 2 * 2;
    return amx_blocks(x, w, wq, scale, bias, y, M, N, K, nthreads, glu, tb_block, KB, kc, 1,
                      xpre, ypack);
}

/* y = x @ w^T (+ bias). Returns 0, -1 if scratch memory could not be allocated, -2 if
 * N < 16. */
int pw_linear_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                  int M, int N, int K, int nthreads) {
    return amx_linear(x, w, NULL, NULL, bias, y, M, N, K, nthreads, 0, NULL, NULL);
}

/* A SwiGLU MLP's first half in one pass: w [2I, K] is [gate | up] (gate_up_proj), bias [2I]
 * or NULL; y [M, I] = bf16(bf16(silu(g)) * u) with g, u the bf16-rounded projections (the
 * unfused path's values, without writing and re-reading [M, 2I]). Same returns; I >= 16. */
int pw_linear_glu_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int M, int I, int K, int nthreads) {
    return amx_linear(x, w, NULL, NULL, bias, y, M, I, K, nthreads, 1, NULL, NULL);
}

/* Weight-only int8 (w int8 [N, K] or [2I, K], scale fp32 per row): pw_linear_amx and
 * pw_linear_glu_amx with each panel's rows widened to bf16 (exact) as they come in, and the
 * scales applied to the fp32 sums before the bias and the rounding. Same returns. */
int pw_linear_int8_amx(const uint16_t *x, const int8_t *w, const float *scale,
                       const uint16_t *bias, uint16_t *y, int M, int N, int K, int nthreads) {
    return amx_linear(x, NULL, w, scale, bias, y, M, N, K, nthreads, 0, NULL, NULL);
}

/* A SwiGLU MLP in two AMX passes, y [M, H] = down(bf16(silu(g)) * u) + bias, for bf16 weights
 * wgu [2I, H] (gate rows, then up rows; bias bgu [2I] or NULL) and wd [H, I] (bias bd or NULL):
 * the gate/up pass writes its activations straight into the down projection's packed tiles
 * (store_glu_packed), which the down pass reads in place, with no packing of its own: the same
 * values and sums as pw_linear_glu_amx then pw_linear_amx, so the same bits. I % 32 == 0,
 * H >= 16. Returns 0, -1 (no scratch), -2 (shapes). */
static __thread uint32_t *mlp_buf;
static __thread size_t mlp_size;
int pw_mlp_amx(const uint16_t *x, const uint16_t *wgu, const uint16_t *bgu, const uint16_t *wd,
               const uint16_t *bd, uint16_t *y, int M, int I, int H, int nthreads) {
    if (I % 32 || I < 32 || H < 16) return -2;
    if (M <= 0) return 0;
    size_t bytes = (size_t)((M + 15) / 16) * (I / 32) * TILE_BYTES;
    if (mlp_size < bytes) {
        free(mlp_buf);
        mlp_buf = (uint32_t *)aligned_alloc(64, (bytes + 4095) / 4096 * 4096);
        mlp_size = mlp_buf ? bytes : 0;
        if (!mlp_buf) return -1;
    }
    int rc = amx_linear(x, wgu, NULL, NULL, bgu, NULL, M, I, H, nthreads, 1, NULL, mlp_buf);
    if (rc) return rc;
    return amx_linear(NULL, wd, NULL, NULL, bd, y, M, H, I, nthreads, 0, mlp_buf, NULL);
}

int pw_linear_glu_int8_amx(const uint16_t *x, const int8_t *w, const float *scale,
                           const uint16_t *bias, uint16_t *y, int M, int I, int K,
                           int nthreads) {
    return amx_linear(x, NULL, w, scale, bias, y, M, I, K, nthreads, 1, NULL, NULL);
}

/* For the fused decode layer (fused_layer.c): M <= 32 fp32 activation rows (bf16-valued),
 * packed once by one thread into xp (KB tiles for tokens 0-15, then KB for tokens 16-31 when
 * M > 16), then every thread of the region computes its share of res[m * N + n] =
 * dot(x[m], w[n]) in fp32 (no bias, no rounding: the caller adds and rounds). N >= 16. No
 * barrier at the end, like proj_share. */
void pw_amx_pack_f32(const float *x, int M, int K, uint32_t *xp) {
    int KB = (K + 31) / 32, TB = (M + 15) / 16;
    /* the tiles shared by the threads of the calling region (an orphaned omp for, with its
     * barrier; alone outside one): one thread packing them would leave the others waiting */
#pragma omp for collapse(2) schedule(static)
    for (int tb = 0; tb < TB; tb++)
        for (int kb = 0; kb < KB; kb++) {
            int m0 = tb * 16, rows = M - m0 < 16 ? M - m0 : 16;
            pack_tile_f32(x + (long)m0 * K + kb * 32, K, rows, K - kb * 32,
                          xp + ((long)tb * KB + kb) * 256);
        }
}

/* The fused layer's projection share: this thread's panels (plain, 32 channels: res [M][N]
 * fp32; or glu, 16 gate beside 16 up channels: act [M][N = I], SiLU-and-multiplied) for the
 * packed rows, one or two 16-token tiles. */
static void share_panels(const uint32_t *xp, int M, const uint16_t *w, const int8_t *wq,
                         const float *scale, uint16_t *wide, const uint16_t *bias, int K, int N,
                         int glu, float *out) {
    int npanels = glu ? (N + 15) / 16 : (N + 31) / 32, two = M > 16;
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int lo = (int)((long)npanels * t / T), hi = (int)((long)npanels * (t + 1) / T);
    if (lo >= hi) return;
    _tile_loadconfig(&TILES);
    float c[4][256] __attribute__((aligned(64)));
    const uint32_t *x1 = xp + (long)((K + 31) / 32) * 256;
    const void *wsrc = wq ? (const void *)wq : (const void *)w;
    Panel p;
    Prefetch pf[2];
    for (int i = lo; i < hi; i++) {
        prefetch_panel(pf, wsrc, wq ? 1 : 2, i + 1 < hi ? i + 1 : npanels, npanels, N, K, glu,
                       0, K, K / 32 + (wq ? WIDEN_STEPS : 0));
        if (wq)
            panel_at_int8(&p, wq, i, N, K, glu, 0, K, wide, pf);
        else
            panel_at(&p, w, i, N, K, glu);
        panel_product(&p, xp, x1, two, K, pf);
        store_c(c[0], two);
        for (int half = 0; half <= two; half++) {
            int m0 = 16 * half, mt = M - m0 < 16 ? M - m0 : 16;
            if (glu) {
                store_glu(c[2 * half], c[2 * half + 1], p.na, N, NULL, out, m0, mt, bias, scale);
                continue;
            }
            __m512i a[16], b[16];
            load_transposed(c[2 * half], c[2 * half + 1], a, b);
            scale_rows(a, scale ? scale + p.na : NULL);
            scale_rows(b, scale ? scale + p.nb : NULL);
            for (int m = 0; m < mt; m++) {
                _mm512_storeu_si512(out + (long)(m0 + m) * N + p.na, a[m]);
                _mm512_storeu_si512(out + (long)(m0 + m) * N + p.nb, b[m]);
            }
        }
    }
    _tile_release();
}

void pw_amx_share(const uint32_t *xp, int M, const uint16_t *w, int K, int N, float *res) {
    share_panels(xp, M, w, NULL, NULL, NULL, NULL, K, N, 0, res);
}

/* The same for int8 weights with per-row scales: each panel widened to bf16 as it comes in
 * (into `wide`, the calling thread's 32 x K values), res = the scaled sums (what the int8
 * streams compute, up to the order of the sums). */
void pw_amx_share_int8(const uint32_t *xp, int M, const int8_t *w, const float *scale,
                       uint16_t *wide, int K, int N, float *res) {
    share_panels(xp, M, NULL, w, scale, wide, NULL, K, N, 0, res);
}

/* The fused layer's gate/up projection with its SiLU-and-multiply (w [2I, K] = [gate | up],
 * bias [2I] or NULL): act[m * I + n] = the bf16-valued fp32 of glu_amx's output, every
 * thread its share of 16-channel panels, from xp as pw_amx_pack_f32 left it. I >= 16. */
void pw_amx_share_glu(const uint32_t *xp, int M, const uint16_t *w, const uint16_t *bias,
                      int K, int I, float *act) {
    share_panels(xp, M, w, NULL, NULL, NULL, bias, K, I, 1, act);
}

void pw_amx_share_glu_int8(const uint32_t *xp, int M, const int8_t *w, const float *scale,
                           uint16_t *wide, const uint16_t *bias, int K, int I, float *act) {
    share_panels(xp, M, NULL, w, scale, wide, bias, K, I, 1, act);
}


/* The tile unit's own ceiling: `iters` rounds of four independent tile products on operands
 * that never leave the tile registers, on each of `nthreads` threads. Returns the FLOPs done
 * (the caller times the call). A probe for benchmarks, not a kernel. */
double pw_amx_tile_flops(long iters, int nthreads) {
    double flops = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : flops)
    {
        _tile_loadconfig(&TILES);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        for (long i = 0; i < iters; i++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_release();
        flops += 4.0 * iters * 16 * 16 * 32 * 2;
    }
    return flops;
}

#pragma GCC pop_options
