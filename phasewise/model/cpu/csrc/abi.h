/*
 * The numbers and the argument struct that the C side and phasewise/model/cpu/kernels.py must
 * agree on: the fused decode layer's row limits and head size, its projection modes
 * (enum pw_proj_mode, ProjMode in Python) and its argument struct (DecodeLayer,
 * DecodeLayerArgs in Python). fused_layer.c's pw_abi reports every one of them, and loading
 * checks the Python mirror against it, so the two sides cannot drift apart unnoticed. Plain
 * C: no ISA.
 */
#ifndef PW_ABI_H
#define PW_ABI_H

#include <stdint.h>

#define ROW_STREAM_MAX 6 /* the most activation rows dot_rows (and the fused layer) take */
#define AMX_LAYER_MAX 32 /* the most rows the fused layer takes with its projections on AMX */
#define INT8_ROWS_MAX ROW_STREAM_MAX /* the most activation rows the int8 streams take */
#define MAX_HEAD_DIM 512 /* the largest head the kernels take (a bound on scratch sizes) */
#define PW_MAX_EXPERTS 512 /* the most experts the fused layer routes among (its stack scratch) */
/* With DecodeLayer.experts_dp, a mixture's projection of this many rows or more runs on the
 * AVX512_BF16 dot products; fewer stream in one run (ROW_STREAM_MAX or fewer rows: the
 * stream's prefetch reads a weight faster for one to three rows, the dot products' tiles win
 * from about four, and the streams would read a weight again past six) */
#define EXPERT_DP_ROWS 4

/* How a fused layer runs its projections (DecodeLayer.proj_mode; ProjMode in
 * phasewise/model/cpu/kernels.py mirrors it, checked value by value through pw_abi at load). */
enum pw_proj_mode {
    PW_PROJ_STREAMS = 0,    /* the AVX2 row streams (pw_linear_bf16's few rows; int8 alike) */
    PW_PROJ_AMX = 1,        /* bf16 projections on AMX tiles (linear_amx.c), where the CPU has them;
                             * int8 ones widened on the tiles above the int8 streams' rows */
    PW_PROJ_AVX512BF16 = 2, /* on AVX512_BF16 dot products (linear_avx512bf16.c), bf16 weights
                             * only (int8 ones stream, up to their rows) */
    PW_PROJ_PANELS = 3,     /* the same on weights packed into panels (pw_pk_pack: every
                             * projection, at any row count; no int8) */
    PW_PROJ_AVX2_TILES = 4, /* as pw_linear_bf16 runs them on AVX2: the streams up to
                             * ROW_STREAM_MAX rows, the 2 x 6 register tiles above (up to
                             * AMX_LAYER_MAX rows; bf16 weights only) */
};

typedef struct {
    int M, H, Q, KV, I, n_heads, n_kv, hd, bs, max_blocks, qk_norm, nthreads;
    float eps, scale;
    uint16_t *hidden;        /* [M][H] residual stream, updated in place */
    const uint16_t *delta;   /* [M][H] previous layer's MLP output, or NULL for the first layer */
    uint16_t *out;           /* [M][H] this layer's MLP output */
    /* w_qkv, w_o, w_gate_up and w_down are bf16, or int8 where their scale (below) is given */
    const uint16_t *w_in_norm;
    const void *w_qkv;
    const uint16_t *b_qkv, *w_q_norm, *w_k_norm;
    const void *w_o;
    const uint16_t *b_o, *w_post_norm;
    const void *w_gate_up;
    const uint16_t *b_gate_up;
    const void *w_down;
    const uint16_t *b_down;
    uint16_t *k_cache, *v_cache; /* this layer's [blocks][bs][n_kv][hd] */
    const int64_t *slots;        /* [M] cache slot of each row's new token */
    const int64_t *block_tables; /* [M][max_blocks] */
    const int64_t *seq_lens;     /* [M] keys to attend, the new token included */
    const float *cos, *sin;      /* [M][hd] */
    /* Weight-only int8 (NULL: that projection is bf16): the fp32 per-row scales of w_qkv,
     * w_o, w_gate_up and w_down, whose pointers then point at int8 weights. */
    const float *s_qkv, *s_o, *s_gate_up, *s_down;
    int proj_mode; /* an enum pw_proj_mode (an int: the field's size is the ABI's, whatever
                    * size a compiler would give the enum) */
    int window;    /* the layer's sliding attention window (0: none): a row attends to its
                    * last `window` keys only */
    /* A mixture of experts in place of the dense MLP where n_experts > 0 (w_gate_up, w_down
     * and their biases and scales unused; I is an expert's width): the router [n_experts][H],
     * the experts' gate/up rows [n_experts][2 I][H] (gate, then up) and down rows
     * [n_experts][H][I], all bf16 and streamed, in runs of up to ROW_STREAM_MAX rows (the
     * fused layer takes that many; pw_moe_mlp_bf16, the MLP alone, more); each row's top_k
     * experts by the router's softmax, their weights renormalised where norm_topk. */
    int n_experts, top_k, norm_topk;
    const uint16_t *w_router, *w_experts_gate_up, *w_experts_down;
    int experts_read; /* written by the call: the distinct experts the step's rows chose */
    /* and a shared expert every row goes through (shared_I > 0: its width; Qwen2-MoE), its
     * output weighed by sigmoid(its gate [1][H]): gate/up [2 shared_I][H], down
     * [H][shared_I], bf16, streamed */
    int shared_I;
    const uint16_t *w_shared_gate_up, *w_shared_down, *w_shared_gate;
    /* 1: the router's, the experts' and the shared expert's projections of EXPERT_DP_ROWS
     * rows or more run on AVX512_BF16 dot products (pw_avx512bf16_share), all their rows in
     * one call, the weight read once however many rows chose it (a batch's experts turn
     * compute-bound on the streams' fp32 arithmetic); fewer stream in one run. 0: every one
     * streamed in runs of up to ROW_STREAM_MAX rows. */
    int experts_dp;
} DecodeLayer;

#endif
