/* The paged KV cache's addressing, shared by the attention files and fused_layer.c
 * (plain C: each file includes it under its own target flags). A layer's cache holds
 * [blocks][bs][n_kv][hd] values; a request's key j (of KV head g) lies in its block table's
 * block j / bs, slot j % bs. */
#ifndef PW_PAGED_CACHE_H
#define PW_PAGED_CACHE_H

#include <stdint.h>

/* Key j's row of KV head g: its offset in values from the cache's start. */
static inline long paged_row(const int64_t *table, int bs, int n_kv, int hd, int g, long j) {
    return ((table[j / bs] * bs + j % bs) * n_kv + g) * (long)hd;
}

static inline const uint16_t *paged_kv_row(const uint16_t *cache, const int64_t *table,
                                           int bs, int n_kv, int hd, int g, long j) {
    return cache + paged_row(table, bs, n_kv, hd, g, j);
}

/* paged_row of keys j0 .. j0 + n - 1 into off: one division, then the offset counted up a
 * stride a key and recomputed at each block: a division (and three multiplies) a key is a
 * visible share of a decode attention task's time when its keys are in the caches. */
static inline void paged_row_offs(const int64_t *table, int bs, int n_kv, int hd, int g,
                                  long j0, int n, long *off) {
    if (n <= 0) return;  /* no key: no table entry read (j0 may lie past the table) */
    long b = j0 / bs, step = (long)n_kv * hd;
    int w = (int)(j0 - b * bs);
    long cur = (table[b] * bs * n_kv + g) * (long)hd + w * step;
    for (int j = 0; j < n; j++) {
        if (w == bs) {  /* the next block (read only when a key lies in it) */
            w = 0;
            cur = (table[++b] * bs * n_kv + g) * (long)hd;
        }
        off[j] = cur;
        cur += step;
        w++;
    }
}

#endif
