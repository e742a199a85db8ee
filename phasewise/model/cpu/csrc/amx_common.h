/*
 * What the AMX files (linear_amx.c, attention_amx.c) share: the tile configuration, the
 * 16 x 16 transpose, a B tile's packing in VNNI order and the store of the C tiles. Static
 * inline, included by each inside its own target pragma (AVX-512 and AMX).
 */
#ifndef PW_AMX_COMMON_H
#define PW_AMX_COMMON_H

#include <immintrin.h>
#include <stdint.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Eight tiles of 16 rows x 64 bytes. A global constant, not a stack struct: gcc 12 assumes
 * ldtilecfg reads only 8 bytes of its operand and drops the stores that fill the rest of a
 * local struct (a fault at the first ldtilecfg). */
static const TileConfig TILES = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

#define TILE_BYTES 1024

/* A 16 x 16 transpose of 32-bit lanes, in place. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            __m512i a = r[8 * i + j], b = r[8 * i + 4 + j];
            t[8 * i + j] = _mm512_shuffle_i32x4(a, b, 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(a, b, 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

/* One B tile: `rows` (<= 16) token rows of 32 bf16 values from src (row stride ld), only the
 * first kt (<= 32) of them, zero elsewhere, in VNNI order: dst row r = the pairs (2r, 2r + 1)
 * of the 16 tokens. A pair of bf16 is one 32-bit lane, so this is a 16 x 16 transpose. */
static inline void pack_tile(const uint16_t *src, long ld, int rows, int kt, uint32_t *dst) {
    __m512i r[16];
    __mmask32 km = kt >= 32 ? 0xffffffffu : (1u << kt) - 1u;
    for (int t = 0; t < 16; t++)
        r[t] = t < rows ? _mm512_maskz_loadu_epi16(km, src + (long)t * ld) : _mm512_setzero_si512();
    transpose16(r);
    for (int i = 0; i < 16; i++) _mm512_store_si512(dst + i * 16, r[i]);
}


/* C tiles 0 and 1 (and 2 and 3 if two) to c, 256 floats each, one after the other: for an
 * epilogue, a spill between K chunks, or a softmax. */
static inline void store_c(float *c, int two) {
    _tile_stored(0, c, 64);  /* tile numbers must be constants */
    _tile_stored(1, c + 256, 64);
    if (two) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
}

#endif
