/*
 * phasewise CPU kernels on AVX2, the sampler's steps over rows of fp32 logits: the
 * structured-output token mask, greedy argmax, sampling (temperature, top-k, top-p, min-p,
 * one draw), the repetition/presence/frequency penalties and logprobs. Each follows the
 * torch path's arithmetic and tie rules, so that either way gives the same tokens.
 */
#include "avx2_common.h"

/* Structured output's token mask: logits[i] = -inf for every token i whose bit (bit i % 32 of
 * word i / 32, as llguidance writes its bitmask) is clear, and for i at or past 32 * n_words
 * (a logits row wider than the tokenizer's vocabulary). One pass, no allocation, in place of
 * three torch ops (unpack, compare, masked_fill) and their temporaries. */
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
 * row to a scalar scan for the first one. One pass and no dispatch: faster than
 * torch.max(dim) inside an engine step. */
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
 * a sort costs O(n log n) with far larger constants. Then the draw: the first token in vocabulary order whose running
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