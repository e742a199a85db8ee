/* ---------------------------------------------------------------------------------------
 * A whole decoder layer for a decode step (a few rows, each one request's next token), in
 * one call and one OpenMP region: the dozen torch/ctypes calls an unfused layer needs cost a
 * sizeable fraction of the time its weights take to stream at batch 1, which this removes.
 * Rounding to bf16 happens at the same points as in the unfused path (and the reference):
 * after every projection, RoPE, attention, each residual add and the SiLU.
 */
#include "avx2_common.h"
#include "paged_cache.h"  /* paged_row_offs: the paged cache's rows */

/* The numbers phasewise/model/cpu/kernels.py must agree with, read by it once at load:
 * "row_stream_max", "max_head_dim", "sizeof DecodeLayer", a DecodeLayer field's name (its
 * byte offset), or a pw_proj_mode value's name (the value). -1 for anything else. Python's
 * ctypes mirror of DecodeLayer and its ProjMode are checked against these, field by field and
 * value by value, so the two sides cannot drift apart unnoticed. */
long pw_abi(const char *what) {
    static const struct { const char *name; long value; } table[] = {
        {"row_stream_max", ROW_STREAM_MAX}, {"amx_layer_max", AMX_LAYER_MAX},
        {"max_head_dim", MAX_HEAD_DIM}, {"max_experts", PW_MAX_EXPERTS},
        {"int8_rows_max", INT8_ROWS_MAX}, {"expert_dp_rows", EXPERT_DP_ROWS},
        {"sizeof DecodeLayer", (long)sizeof(DecodeLayer)},
#define FIELD(f) {#f, (long)offsetof(DecodeLayer, f)}
        FIELD(M), FIELD(H), FIELD(Q), FIELD(KV), FIELD(I), FIELD(n_heads), FIELD(n_kv),
        FIELD(hd), FIELD(bs), FIELD(max_blocks), FIELD(qk_norm), FIELD(nthreads), FIELD(eps),
        FIELD(scale), FIELD(hidden), FIELD(delta), FIELD(out), FIELD(w_in_norm), FIELD(w_qkv),
        FIELD(b_qkv), FIELD(w_q_norm), FIELD(w_k_norm), FIELD(w_o), FIELD(b_o),
        FIELD(w_post_norm), FIELD(w_gate_up), FIELD(b_gate_up), FIELD(w_down), FIELD(b_down),
        FIELD(k_cache), FIELD(v_cache), FIELD(slots), FIELD(block_tables), FIELD(seq_lens),
        FIELD(cos), FIELD(sin), FIELD(s_qkv), FIELD(s_o), FIELD(s_gate_up), FIELD(s_down),
        FIELD(proj_mode), FIELD(window), FIELD(n_experts), FIELD(top_k), FIELD(norm_topk),
        FIELD(w_router), FIELD(w_experts_gate_up), FIELD(w_experts_down), FIELD(experts_read),
        FIELD(shared_I), FIELD(w_shared_gate_up), FIELD(w_shared_down), FIELD(w_shared_gate),
        FIELD(experts_dp),
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
 * one thread alone leaves the others idle for each of the layer's two norms. */
static void add_norm_rows(uint16_t *hidden, const uint16_t *delta, const uint16_t *w,
                          float *xn, int M, int H, float eps) {
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        pw_add_norm_row(hidden + (long)m * H, delta ? delta + (long)m * H : NULL, w, H, eps, NULL,
                     xn + (long)m * H);
}


static void head_norm(uint16_t *v, const uint16_t *w, int hd, float eps) {
    pw_add_norm_row(v, NULL, w, hd, eps, v, NULL);  /* in place: every read precedes its write */
}

/* linear_amx.c's projection share, when the AMX files were compiled in (weak: absent
 * otherwise). */
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
/* the AVX512_BF16 files' (weak: absent when they were not compiled in) */
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
 * thousands of floats apart, thrashed L1's sets), eight values at a time (a scalar collapsed
 * loop pays a division per value). */
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
 * pw_proj_share. No barrier at the end. */
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
            pw_permute_row_any(NULL, x + (long)m * K, xf + (long)m * K, K, K / 16 * 16);
        pw_tiles_share(xf, w, NULL, NULL, NULL, res, M, N, K);
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
    pw_proj_share(x, M, w, scale, K, N, res);
}

/* The keys row `row` attends to in a layer with this window (0: none). */
static long task_keys(const int64_t *seq_lens, int window, int row) {
    return seq_lens[row] - pw_window_start(seq_lens[row], window);
}

/* This thread's share of a fused layer's attention tasks (pw_attention_request's numbering,
 * n_tasks of them): a contiguous range [lo, hi), the team's ranges balanced by keys (each
 * task goes to the thread whose equal share of all the keys holds the task's middle key),
 * so every thread computes the same split and knows which task it takes next (for
 * attention_prefetch). Not a dynamic schedule: it hands tasks out one at a time, so no
 * thread would know its next task, and each would begin on keys not yet in its caches. */
static void task_range(int n_tasks, int parts, int n_kv, const int64_t *seq_lens, int window,
                       int *lo, int *hi) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    long total = 0, before = 0;
    for (int k = 0; k < n_tasks; k++)
        total += task_keys(seq_lens, window, parts ? k / parts : k / n_kv);
    *lo = *hi = n_tasks;
    int found = 0;
    for (int k = 0; k < n_tasks; k++) {
        long len = task_keys(seq_lens, window, parts ? k / parts : k / n_kv);
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
 * themselves, one step ahead. Knowing the next task is what task_range gives over a dynamic
 * schedule (figures: benchmarks/RESULTS.md). */
#define DPA_FIRST_KEYS 32
static void attention_prefetch(int task, int cur, int end, int parts, int n_kv, int hd,
                               const DecodeLayer *L) {
    if (task >= end || (parts > 1 && cur >= 0 && task / parts == cur / parts)) return;
    int b = parts ? task / parts : task / n_kv;
    int k0 = parts ? 0 : task % n_kv, k1 = parts ? n_kv : k0 + 1;
    const int64_t *table = L->block_tables + (long)b * L->max_blocks;
    long start = pw_window_start(L->seq_lens[b], L->window);
    long len = L->seq_lens[b] - 1 - start, per_key = 4L * (k1 - k0) * hd;  /* K and V bytes */
    if (len > DPA_FIRST_KEYS) len = DPA_FIRST_KEYS;
    if (len > 16384 / per_key) len = 16384 / per_key;
    long off[DPA_FIRST_KEYS];
    paged_row_offs(table, L->bs, n_kv, hd, k0, start, (int)len, off);
    for (long j = 0; j < len; j++)
        for (long c = 0; c < (long)(k1 - k0) * hd; c += 32) {  /* a line: 32 values */
            _mm_prefetch((const char *)(L->k_cache + off[j] + c), _MM_HINT_T0);
            _mm_prefetch((const char *)(L->v_cache + off[j] + c), _MM_HINT_T0);
        }
}

/* Each row's top_k experts by the router's softmax (logits: [M][E] fp32, taken as the bf16
 * values the router's projection returns; an exact tie to the lower expert) into chosen
 * [M][top_k], best first, and their weights (renormalised where norm, then bf16) into wts
 * [M][top_k]. The one routing rule of every CPU-kernel path: the fused layer (moe_route) and
 * SparseMoE's own loop (pw_moe_route) both run it, so a row's experts and weights never
 * depend on which path, or how large a batch, ran it. A NaN logit (a broken model) still
 * chooses valid experts, lowest first, with NaN weights. */
static void route_rows(const float *logits, int M, int E, int k, int norm, float *wts,
                       int *chosen) {
    float p[PW_MAX_EXPERTS];
    for (int m = 0; m < M; m++) {
        float mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < E; e++) {
            p[e] = round_bf16(logits[(long)m * E + e]);
            if (p[e] > mx) mx = p[e];
        }
        for (int e = 0; e < E; e++) sum += p[e] = expf(p[e] - mx);
        for (int e = 0; e < E; e++) p[e] /= sum;
        unsigned char taken[PW_MAX_EXPERTS] = {0};
        float total = 0.0f;
        for (int j = 0; j < k; j++) {  /* the best left, the lowest index on a tie */
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            chosen[m * k + j] = best;
            wts[m * k + j] = p[best];
            total += p[best];
        }
        for (int j = 0; j < k; j++)
            wts[m * k + j] = round_bf16(norm ? wts[m * k + j] / total : wts[m * k + j]);
    }
}

/* SparseMoE's routing on the CPU kernels (route_rows) for M rows of E logits; chosen as
 * int32. Returns 0, or -2 for sizes it does not hold. */
int pw_moe_route(const float *logits, int M, int E, int k, int norm, float *wts,
                 int32_t *chosen) {
    if (M < 1 || E < 1 || E > PW_MAX_EXPERTS || k < 1 || k > E) return -2;
    route_rows(logits, M, E, k, norm, wts, (int *)chosen);
    return 0;
}

/* moe_route: route_rows, then the experts the step reads, in the order SparseMoE adds them
 * (a lone row: its top_k, best first; more: ascending), into used, with their (row, slot)
 * pairs in that order: pair_row, pair_slot [M top_k], expert u's from base[u] to
 * base[u + 1]. Returns how many experts are used. One thread. */
static int moe_route(const DecodeLayer *L, const float *logits, int M, float *wts,
                     int *chosen, int *used, int *base, int *pair_row, int *pair_slot) {
    int E = L->n_experts, k = L->top_k;
    route_rows(logits, M, E, k, L->norm_topk, wts, chosen);
    int n = 0;
    if (M == 1) {
        for (int j = 0; j < k; j++) used[n++] = chosen[j];
    } else {
        for (int e = 0; e < E; e++)
            for (int i = 0; i < M * k; i++)
                if (chosen[i] == e) { used[n++] = e; break; }
    }
    int np = 0;
    for (int u = 0; u < n; u++) {
        base[u] = np;
        for (int m = 0; m < M; m++)
            for (int j = 0; j < k; j++)
                if (chosen[m * k + j] == used[u]) {
                    pair_row[np] = m;
                    pair_slot[np++] = j;
                }
    }
    base[n] = np;
    return n;
}

/* A projection's share of M rows (bf16 weights), in runs of at most ROW_STREAM_MAX rows,
 * the streams' most: each run streams the weight once. SparseMoE's moe_linear cuts its rows
 * into the same runs (CpuKernelOps.moe_linear), so each row's bits agree. */
static void proj_share_runs(const float *x, int M, const uint16_t *w, int K, int N,
                            float *res) {
    for (int r = 0; r < M; r += ROW_STREAM_MAX)
        pw_proj_share(x + (long)r * K, M - r < ROW_STREAM_MAX ? M - r : ROW_STREAM_MAX, w,
                      NULL, K, N, res + (long)r * N);
}

/* The ints moe_route writes: each row's choices, the experts used and their pairs' bases,
 * and the pairs' rows and slots. */
static long moe_ints(int M, const DecodeLayer *L) {
    return 3L * M * L->top_k + 2L * L->n_experts + 1;
}

/* The floats moe_mlp needs beyond the router's results: each (expert, row) pair's input
 * row, gate/up results, activations and down results; each row's shared expert's, and its
 * gate's logit. */
static long moe_floats(int M, const DecodeLayer *L) {
    long P = (long)M * L->top_k;
    return P * (2L * L->H + 3L * L->I)
           + (L->shared_I ? (long)M * (3L * L->shared_I + L->H + 1) : 0)
           /* experts_dp: the bf16 rows the dot products read (xn's, the pairs', their
            * activations, the shared expert's), two to a float */
           + (L->experts_dp ? ((long)M * L->H + P * L->H + P * L->I + (long)M * L->shared_I)
                                  / 2 + 1
                            : 0);
}

/* A projection of the mixture's: res [M][N] fp32 = x w^T for this thread's share of w's N
 * rows, on the dot products from xb (x's values in bf16) where L->experts_dp and M is
 * EXPERT_DP_ROWS or more, else streamed from x in runs. No barrier. */
static void moe_proj(const DecodeLayer *L, const float *x, const uint16_t *xb, int M,
                     const uint16_t *w, int K, int N, float *res) {
    if (L->experts_dp && M >= EXPERT_DP_ROWS)
        pw_avx512bf16_share(xb, M, w, K, N, res);
    else
        proj_share_runs(x, M, w, K, N, res);
}

/* A mixture of experts' MLP (L->n_experts > 0), called by every thread of the fused layer's
 * region after the post-attention norm (xn [M][H]): out = the sum, over each row's top_k
 * experts in moe_route's order, of bf16(weight x expert(row)), each expert's gate/up and down
 * streamed once for all the rows that chose it, rounded to bf16 where SparseMoE rounds (each
 * projection, the SiLU, each product and each sum). Every expert's gate/up shares run before
 * one barrier, then every down share: the barriers a layer takes do not grow with top_k.
 * Where L->experts_dp, a projection of EXPERT_DP_ROWS rows or more runs on AVX512_BF16 dot
 * products from bf16 copies of its rows (moe_proj), the weight read once for all of them.
 * Scratch: res [M][E] (the router's), f (moe_floats), wts [M][top_k], ints (moe_ints);
 * *n_used: shared by the region's threads. */
static void moe_mlp(const DecodeLayer *L, const float *xn, int M, float *res, float *f,
                    float *wts, int *ints, int *n_used, uint16_t *out) {
    int H = L->H, I = L->I, E = L->n_experts, P = M * L->top_k, S = L->shared_I;
    int *chosen = ints, *used = chosen + P, *base = used + E, *pair_row = base + E + 1;
    int *pair_slot = pair_row + P;
    float *xg = f, *gu = xg + (long)P * H, *act = gu + (long)P * 2 * I, *dn = act + (long)P * I;
    /* the shared expert's (S > 0): gate/up, activations, down, the gate's logit */
    float *sgu = dn + (long)P * H, *sact = sgu + (long)M * 2 * S, *sdn = sact + (long)M * S;
    float *sgl = sdn + (long)M * H;
    /* experts_dp: xn's rows, the pairs' and the activations in bf16 (exact: bf16 values) */
    uint16_t *xnb = (uint16_t *)(dn + (long)P * H + (S ? (long)M * (3L * S + H + 1) : 0));
    uint16_t *xgb = xnb + (long)M * H, *actb = xgb + (long)P * H;
    uint16_t *sactb = actb + (long)P * I;
    /* below EXPERT_DP_ROWS rows no projection can have that many (an expert's rows are
     * some of the M): every one streams, and no bf16 copy is needed */
    int dp = L->experts_dp && M >= EXPERT_DP_ROWS;
    if (dp) pw_avx512bf16_pack_f32(xn, M, H, xnb);  /* with a barrier */
    moe_proj(L, xn, xnb, M, L->w_router, H, E, res);
#pragma omp barrier
#pragma omp single
    {  /* (single's barrier makes *n_used and the routing visible to every thread) */
        *n_used = moe_route(L, res, M, wts, chosen, used, base, pair_row, pair_slot);
        ((DecodeLayer *)L)->experts_read = *n_used;
        memset(out, 0, sizeof(uint16_t) * (size_t)M * H);
    }
    int n = *n_used;
#pragma omp for schedule(static)
    for (int q = 0; q < P; q++) {  /* (experts_dp: both, each expert reads one by its rows) */
        memcpy(xg + (long)q * H, xn + (long)pair_row[q] * H, sizeof(float) * H);
        if (dp)
            memcpy(xgb + (long)q * H, xnb + (long)pair_row[q] * H, sizeof(uint16_t) * H);
    }
    for (int u = 0; u < n; u++)
        moe_proj(L, xg + (long)base[u] * H, xgb + (long)base[u] * H, base[u + 1] - base[u],
                 L->w_experts_gate_up + (long)used[u] * 2 * I * H, H, 2 * I,
                 gu + (long)base[u] * 2 * I);
    if (S) {
        moe_proj(L, xn, xnb, M, L->w_shared_gate_up, H, 2 * S, sgu);
        moe_proj(L, xn, xnb, M, L->w_shared_gate, H, 1, sgl);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int q = 0; q < P + (S ? M : 0); q++) {  /* the pairs', then the shared expert's rows */
        int sh = q >= P, w = sh ? S : I;
        const float *g = sh ? sgu + (long)(q - P) * 2 * S : gu + (long)q * 2 * I, *up = g + w;
        float *a = sh ? sact + (long)(q - P) * S : act + (long)q * I;
        for (int i = 0; i < w; i++) a[i] = silu_mul_rounded(round_bf16(g[i]), round_bf16(up[i]));
        if (dp) {
            uint16_t *ab = sh ? sactb + (long)(q - P) * S : actb + (long)q * I;
            for (int i = 0; i < w; i++) ab[i] = f32_to_bf16(a[i]);
        }
    }
    for (int u = 0; u < n; u++)
        moe_proj(L, act + (long)base[u] * I, actb + (long)base[u] * I, base[u + 1] - base[u],
                 L->w_experts_down + (long)used[u] * H * I, I, H, dn + (long)base[u] * H);
    if (S) moe_proj(L, sact, sactb, M, L->w_shared_down, S, H, sdn);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {  /* each row's sum in the experts' order */
        uint16_t *o = out + (long)m * H;
        for (int q = 0; q < P; q++) {
            if (pair_row[q] != m) continue;
            float w = wts[m * L->top_k + pair_slot[q]];
            const float *y = dn + (long)q * H;
            for (int h = 0; h < H; h++)
                o[h] = f32_to_bf16(bf16_to_f32(o[h]) + round_bf16(round_bf16(y[h]) * w));
        }
        if (S) {  /* + the shared expert's output x sigmoid(its gate), in bf16 */
            float gate = round_bf16(1.0f / (1.0f + expf(-round_bf16(sgl[m]))));
            const float *y = sdn + (long)m * H;
            for (int h = 0; h < H; h++)
                o[h] = f32_to_bf16(bf16_to_f32(o[h]) + round_bf16(round_bf16(y[h]) * gate));
        }
    }
}

/* A dense SwiGLU MLP, called by every thread of the fused layer's region after the
 * post-attention norm (xn [M][H]): L->out = down(silu(gate) x up), on the tiles or the
 * streams as the layer's projections run (amx_glu, pk_glu: the SiLU in the tiles' epilogue). */
static void dense_mlp(const DecodeLayer *L, const float *xn, int M, int amx_glu, int pk_glu,
                      uint32_t *xp, uint16_t *wide, long wide_per_thread, float *res,
                      float *act) {
    int H = L->H, I = L->I;
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
     * walking down the rows first thrashed L1's sets). Skipped
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

/* Whether L holds a mixture of experts moe_mlp can run (a router the routing's scratch
 * holds, every weight present). */
static int moe_ok(const DecodeLayer *L) {
    return L->n_experts > 0 && L->n_experts <= PW_MAX_EXPERTS && L->top_k >= 1
           && L->top_k <= L->n_experts && L->w_router && L->w_experts_gate_up
           && L->w_experts_down
           && (!L->shared_I || (L->w_shared_gate_up && L->w_shared_down && L->w_shared_gate))
           && (!L->experts_dp || (pw_avx512bf16_share && pw_avx512bf16_pack_f32));
}

int pw_decode_layer_bf16(const DecodeLayer *L) {
    int M = L->M, H = L->H, Q = L->Q, KV = L->KV, I = L->I, hd = L->hd;
    int n_heads = L->n_heads, n_kv = L->n_kv, group = n_heads / n_kv, QKV = Q + 2 * KV;
    /* More rows than the streams take only when every projection runs on the tiles (a
     * mixture of experts': its attention's; its experts stream, up to ROW_STREAM_MAX rows). */
    int moe = L->n_experts > 0;
    int all_amx = amx_proj(L, L->s_qkv, QKV) && amx_proj(L, L->s_o, H) && H >= 16
                  && (moe || (amx_proj(L, L->s_gate_up, 2 * I) && amx_proj(L, L->s_down, H)
                              && I >= 8));
    if (M < 1 || M > (all_amx ? AMX_LAYER_MAX : ROW_STREAM_MAX) || hd > MAX_HEAD_DIM)
        return -2;
    /* experts stream: a few rows, a router the routing's scratch holds */
    if (moe && (M > ROW_STREAM_MAX || !moe_ok(L)))
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
    int parts = pw_group_parts(M, n_kv, group, L->nthreads);
    int n_tasks = parts ? M * parts : M * n_kv;
    long per_task = pw_attention_task_floats(group, hd);
    int widest = QKV > 2 * I ? QKV : 2 * I;
    if (H > widest) widest = H;
    if (moe && L->n_experts > widest) widest = L->n_experts;
    size_t n_floats = (size_t)M * H + (size_t)M * Q + (size_t)M * I
                      + (size_t)per_task * L->nthreads + (size_t)M * widest
                      + (moe ? (size_t)moe_floats(M, L) + (size_t)M * L->top_k : 0);
    int *moe_scratch = moe ? (int *)malloc(sizeof(int) * (size_t)moe_ints(M, L)) : NULL;
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
        || (L->proj_mode == PW_PROJ_AMX && any_int8 && M > ROW_STREAM_MAX && !wide)
        || (moe && !moe_scratch)) {
        free(buf); free(qkv); free(o); free(xp); free(wide); free(moe_scratch);
        return -1;
    }
    float *xn = buf, *attn = xn + (long)M * H, *act = attn + (long)M * Q;
    float *att = act + (long)M * I; /* per-thread attention scratch */
    float *res = att + per_task * L->nthreads; /* [M][N] projection results */
    float *moe_f = res + (long)M * widest;  /* the experts' (moe) */
    float *wts = moe ? moe_f + moe_floats(M, L) : NULL;
    int n_used = 0;  /* moe: the experts the step reads, shared by the region's threads */

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
            /* the row function, not pw_rope_bf16: its parallel for, nested here, would set up
             * a team for every row */
            pw_rope_row(row, L->cos + (long)m * hd, L->sin + (long)m * hd, n_heads + n_kv, hd);
            long slot = L->slots[m];
            memcpy(L->k_cache + slot * KV, row + Q, sizeof(uint16_t) * KV);
            memcpy(L->v_cache + slot * KV, row + Q + KV, sizeof(uint16_t) * KV);
        }

        {  /* attn[m][head][hd]: Q = heads * hd; this thread's tasks (task_range) */
            int lo, hi;
            task_range(n_tasks, parts, n_kv, L->seq_lens, L->window, &lo, &hi);
            attention_prefetch(lo, -1, hi, parts, n_kv, hd, L);
            for (int task = lo; task < hi; task++) {
                attention_prefetch(task + 1, task, hi, parts, n_kv, hd, L);
                pw_attention_request(task, parts, group, n_heads, n_kv, hd, qkv, QKV, L->scale,
                                  L->k_cache, L->v_cache, L->block_tables, L->max_blocks,
                                  L->seq_lens, L->window, L->bs,
                                  att + per_task * omp_get_thread_num(),
                                  NULL, attn);
            }
        }
#pragma omp barrier

        layer_proj(L, attn, M, L->w_o, L->s_o, Q, H, xp, wide, wide_per_thread, res);
#pragma omp barrier
        bias_round_rows(res, L->b_o, M, H, o);

        add_norm_rows(L->hidden, o, L->w_post_norm, xn, M, H, L->eps);

        if (moe)
            moe_mlp(L, xn, M, res, moe_f, wts, moe_scratch, &n_used, L->out);
        else
            dense_mlp(L, xn, M, amx_glu, pk_glu, xp, wide, wide_per_thread, res, act);
    }
    free(buf);
    free(qkv);
    free(o);
    free(xp);
    free(wide);
    free(moe_scratch);
    return 0;
}


/* One sparse layer's MLP alone, for the M rows of x (bf16 [M][H], after the post-attention
 * norm) into out (bf16 [M][H]), on L->nthreads threads: moe_mlp, the bits SparseMoE's
 * forward gives (each expert's rows in runs of ROW_STREAM_MAX), without its Python loop
 * over the experts. Only L's sizes (H, I, shared_I), its expert fields and nthreads are
 * read; L->experts_read is written. Returns 0, -1 out of memory, -2 not such a layer. */
int pw_moe_mlp_bf16(DecodeLayer *L, const uint16_t *x, int M, uint16_t *out) {
    if (M < 1 || L->H < 1 || L->I < 1 || L->nthreads < 1 || !moe_ok(L))
        return -2;
    long H = L->H;
    size_t n_floats = (size_t)M * H + (size_t)M * L->n_experts + (size_t)moe_floats(M, L)
                      + (size_t)M * L->top_k;
    float *buf = (float *)malloc(sizeof(float) * n_floats);
    int *ints = (int *)malloc(sizeof(int) * (size_t)moe_ints(M, L));
    if (!buf || !ints) {
        free(buf); free(ints);
        return -1;
    }
    float *xn = buf, *res = xn + (long)M * H, *f = res + (long)M * L->n_experts;
    float *wts = f + moe_floats(M, L);
    for (long i = 0; i < (long)M * H; i++) xn[i] = bf16_to_f32(x[i]);
    int n_used = 0;
#pragma omp parallel num_threads(L->nthreads)
    moe_mlp(L, xn, M, res, f, wts, ints, &n_used, out);
    free(buf);
    free(ints);
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
 * pw_decode_stack_bf16, or -2 without the panels kernel (linear_avx512bf16.c not compiled in). */
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
