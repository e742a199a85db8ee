/*
 * phasewise CPU kernels on AVX2, decode attention: one query token per request against its
 * paged KV cache (flash-style, fp32 inside, bf16 out), split into tasks (request, KV head,
 * share of the query group) that keep every thread busy. Where the CPU has them, a task's
 * heads go to attention_amx.c's or attention_avx512bf16.c's kernel instead, reached through
 * weak symbols (absent when those files were not compiled in). fused_layer.c runs the same
 * tasks inside its own parallel region.
 */
#include "avx2_common.h"
#include "paged_cache.h"  /* paged_row_offs: the paged cache's rows */

static int use_avx512;
/* AMX and AVX-512 BF16 (attention_amx.c's decode attention), and the norms. */
void pw_enable_avx512(int on) {
    use_avx512 = on;
    pw_enable_avx512_norm(on);
}

/* Attention of G query heads that share one KV head (GQA) against keys `start` .. `len` - 1
 * of one request's paged context (`start` > 0: a sliding window's first key), flash-style: keys in chunks of ATT_CHUNK, each chunk's K and V rows
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
                         const int64_t *table, int start, int len, int bs, int n_kv, int kvh,
                         int hd, float *scratch, float *out) {
    float *kf = scratch, *vf = kf + (long)ATT_CHUNK * hd, *p = vf + (long)ATT_CHUNK * hd;
    float *mx = p + (long)G * ATT_CHUNK, *den = mx + G;
    int hd8 = hd / 8 * 8;
    for (int g = 0; g < G; g++) {
        mx[g] = -INFINITY;
        den[g] = 0.0f;
        for (int i = 0; i < hd; i++) out[(long)g * hd + i] = 0.0f;
    }
    for (int t0 = start; t0 < len; t0 += ATT_CHUNK) {
        int n = len - t0 < ATT_CHUNK ? len - t0 : ATT_CHUNK;
        /* the chunk's rows counted (paged_row_offs: no division a key) */
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
int pw_group_parts(int B, int n_kv, int group, int nthreads) {
    /* Fewer requests than threads, but a KV head for every thread: a task per (request, KV
     * head), 0 parts (pw_attention_request). Each thread then reads its heads' rows of the
     * context alone: split by query heads instead, every thread read every KV head's rows,
     * and the context's bytes, not the arithmetic, bound a decode step's attention. */
    if (B < nthreads && B * n_kv >= nthreads) return 0;
    int tasks = B * n_kv, parts = 1;
    while (parts < group && tasks * parts < 2 * nthreads) parts++;
    /* a task covers every KV head of its request (pw_attention_request): at least a task per
     * thread */
    while (parts < group && B * parts < nthreads) parts++;
    return parts;
}

/* Scratch floats one thread needs for attention_task: the group's queries and outputs, and
 * attend_group's. */
long pw_attention_task_floats(int group, int hd) {
    return 2L * group * hd + att_scratch_floats(group, hd);
}

/* attention_amx.c's decode attention on AMX tiles (weak: absent when that file is not compiled
 * in), taken once pw_enable_avx512 has said the CPU has AMX and AVX-512 BF16. */
int pw_attend_group_amx(const uint16_t *q, int G, float scale, const uint16_t *k_cache,
                        const uint16_t *v_cache, const int64_t *table, int len, int bs,
                        int n_kv, int kvh, int hd, float *out) __attribute__((weak));
/* attention_avx512bf16.c's, the same contract (weak: absent when that file is not compiled in),
 * taken once pw_enable_avx512bf16_attention has said the CPU has AVX512_BF16, where AMX's is not. */
int pw_attend_group_avx512bf16(const uint16_t *q, int G, float scale, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int64_t *table, int start, int len,
                       int bs, int n_kv, int kvh, int hd, float *out) __attribute__((weak));
static int use_avx512bf16_attention = 0;
void pw_enable_avx512bf16_attention(int on) { use_avx512bf16_attention = on && pw_attend_group_avx512bf16 != NULL; }

/* The first key a decode row of `len` keys attends to: 0, or with a sliding window (> 0) the
 * first of its last `window` keys. */
int pw_window_start(long len, int window) {
    return window > 0 && len > window ? (int)(len - window) : 0;
}

/* Decode attention of request b, KV head kvh, and share `part` (of `parts`) of that head's
 * query group, over the keys of its window (pw_window_start; AMX's kernel takes only whole
 * contexts, so a row whose window binds goes to the others). q: rows of stride q_stride
 * holding n_heads heads of hd (bf16);
 * `mine`: this thread's scratch (pw_attention_task_floats(group, hd) floats).
 * Writes the heads' outputs at (b * n_heads + head) * hd: bf16 into out_bf16, or the
 * bf16-rounded fp32 value into out_f32. */
static void attention_task(int b, int kvh, int part, int parts, int group, int n_heads,
                           int n_kv, int hd, const uint16_t *q, long q_stride, float scale,
                           const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *block_tables, int max_blocks,
                           const int64_t *seq_lens, int window, int bs, float *mine,
                           uint16_t *out_bf16, float *out_f32) {
    int g0 = group * part / parts, g1 = group * (part + 1) / parts, G = g1 - g0;
    float *qf = mine, *acc = qf + (long)group * hd, *work = acc + (long)group * hd;
    const uint16_t *qg = q + (long)b * q_stride + (long)(kvh * group + g0) * hd;
    const int64_t *table = block_tables + (long)b * max_blocks;
    int len = (int)seq_lens[b], start = pw_window_start(len, window);
    int amx = use_avx512 && pw_attend_group_amx && start == 0;
    int done = amx || use_avx512bf16_attention;
    for (int g = 0; done && g < G; g += 16) {  /* sixteen heads at a time */
        int n = G - g < 16 ? G - g : 16;
        done = (amx ? pw_attend_group_amx(qg + (long)g * hd, n, scale, k_cache, v_cache, table,
                                          len, bs, n_kv, kvh, hd, acc + (long)g * hd)
                    : pw_attend_group_avx512bf16(qg + (long)g * hd, n, scale, k_cache, v_cache,
                                                 table, start, len, bs, n_kv, kvh, hd,
                                                 acc + (long)g * hd)) == 0;
    }
    for (int g = 0; !done && g < G; g++) {
        const uint16_t *qh = q + (long)b * q_stride + (long)(kvh * group + g0 + g) * hd;
        for (int i = 0; i < hd; i++) qf[(long)g * hd + i] = bf16_to_f32(qh[i]) * scale;
    }
    if (!done)
        attend_group(qf, G, k_cache, v_cache, table, start, len, bs, n_kv, kvh, hd, work, acc);
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
 * query group, the KV heads one after another; or, with 0 parts (pw_group_parts: fewer requests
 * than threads), task `task` of B * n_kv: request task / n_kv, KV head task % n_kv, its whole
 * group. One task per request rather than per (request,
 * KV head): a cache slot holds every KV head's row side by side ([bs][n_kv][hd]), so the
 * first head's pass brings the slots' lines, the next heads' rows beside, into the caches
 * (the hardware fetches neighbouring lines), which a task per KV head would fetch again from
 * memory, the weights read between the layers having evicted them (benchmarks/RESULTS.md). */
void pw_attention_request(int task, int parts, int group, int n_heads, int n_kv, int hd,
                          const uint16_t *q, long q_stride, float scale,
                          const uint16_t *k_cache, const uint16_t *v_cache,
                          const int64_t *block_tables, int max_blocks,
                          const int64_t *seq_lens, int window, int bs, float *mine,
                          uint16_t *out_bf16, float *out_f32) {
    if (parts == 0) {  /* task = request * n_kv + KV head, the head's whole group */
        attention_task(task / n_kv, task % n_kv, 0, 1, group, n_heads, n_kv, hd, q, q_stride,
                       scale, k_cache, v_cache, block_tables, max_blocks, seq_lens, window, bs,
                       mine, out_bf16, out_f32);
        return;
    }
    for (int kvh = 0; kvh < n_kv; kvh++)
        attention_task(task / parts, kvh, task % parts, parts, group, n_heads, n_kv, hd, q,
                       q_stride, scale, k_cache, v_cache, block_tables, max_blocks, seq_lens,
                       window, bs, mine, out_bf16, out_f32);
}

/* Decode attention over the paged cache: one query token per request.
 * q: [B][n_heads][hd] with row stride q_stride; caches: [blocks][bs][n_kv][hd];
 * block_tables: [B][max_blocks] int64; seq_lens: [B] int64 (keys to attend, incl. the new one);
 * window: the layer's sliding window (0: none), whose rows read only their last `window` keys;
 * out: [B][n_heads][hd] contiguous. Softmax and sums in fp32. */
int pw_decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                             const uint16_t *v_cache, const int64_t *block_tables,
                             int max_blocks, const int64_t *seq_lens, uint16_t *out, int B,
                             int n_heads, int n_kv, int hd, int bs, float scale, int nthreads,
                             int window) {
    int group = n_heads / n_kv, parts = pw_group_parts(B, n_kv, group, nthreads);
    int n_tasks = parts ? B * parts : B * n_kv;
    long per_task = pw_attention_task_floats(group, hd);
    float *scratch = (float *)malloc(sizeof(float) * (size_t)per_task * nthreads);
    if (!scratch) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic)
    for (int task = 0; task < n_tasks; task++)
        pw_attention_request(task, parts, group, n_heads, n_kv, hd, q, q_stride, scale, k_cache,
                          v_cache, block_tables, max_blocks, seq_lens, window, bs,
                          scratch + per_task * omp_get_thread_num(), out, NULL);
    free(scratch);
    return 0;
}
