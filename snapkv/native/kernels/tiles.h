/* The register tiles a few fp32 rows (a question's tokens) multiply many rows by, shared by snapkv's attention
 * kernels (few_rows.c over fp32 keys and values, coded_attention.c over a saved cache's codes): the long side
 * transposed into a (depth, 16 or 64) tile that feeds every short row through a register tile of 6 rows x 16 columns
 * (AVX2) or 6 rows x 64 columns (AVX-512), and the softmax's pieces in 16 lanes. */
#ifndef SNAPKV_TILES_H
#define SNAPKV_TILES_H

#include "vectors.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define ROW_BLOCK 6
#define KEY_TILE 16
#define WIDE_TILE 64  /* columns of the AVX-512 register tile: ROW_BLOCK rows x 4 vectors of 16 */
#define MAX_HEAD_DIM SNAPKV_MAX_ATTENTION_HEAD_DIM

/* tile (depth, KEY_TILE), rows `tile_stride` floats apart = the `count` rows of `long_rows` (each `depth` floats)
 * transposed, zero past count. */
static void transposed_tile(const float *long_rows, int64_t count, int64_t depth, float *tile, int64_t tile_stride) {
    if (count == KEY_TILE) {
        for (int64_t c = 0; c < depth; c += 8) {
            f32x8_transpose(long_rows + c, depth, tile + c * tile_stride, tile_stride);
            f32x8_transpose(long_rows + 8 * depth + c, depth, tile + c * tile_stride + 8, tile_stride);
        }
        return;
    }
    for (int64_t c = 0; c < depth; c++)
        for (int64_t j = 0; j < KEY_TILE; j++) tile[c * tile_stride + j] = j < count ? long_rows[j * depth + c] : 0.0f;
}

/* tile (depth, WIDE_TILE) = up to WIDE_TILE rows of `long_rows` transposed, 16 at a time, zero past count. */
static void transposed_wide_tile(const float *long_rows, int64_t count, int64_t depth, float *tile) {
    for (int64_t part = 0; part < WIDE_TILE; part += KEY_TILE) {
        const int64_t left = count - part, part_count = left < 0 ? 0 : left < KEY_TILE ? left : KEY_TILE;
        transposed_tile(long_rows + (part_count ? part * depth : 0), part_count, depth, tile + part, WIDE_TILE);
    }
}

#if defined(SNAPKV_PORTABLE)
/* tile_product (below) in the generic build: in vectors of 4 lanes (simd.h's lanes_4: gcc keeps vectors of 8 in
 * memory where the target's registers hold 4), 8 columns per pass where the target has 16 vector registers (x86-64)
 * and all 16 at once where it has 32 (arm64). The same sums in the same order: a fused multiply-add where the
 * target has one, else a product then a sum (as PLAIN_FMA). */
#if defined(__aarch64__)
#define PASS_VECTORS 4  /* 6 rows x 16 columns: 24 accumulators of 32 registers */
#else
#define PASS_VECTORS 2  /* 6 rows x 8 columns: 12 accumulators of 16 registers */
#endif

__attribute__((noinline))  /* compiled on its own: inlined into attend_rows, gcc spilled an accumulator */
static void tile_product(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride, int64_t depth,
                         f32x8 sums[ROW_BLOCK][2]) {
    float (*lanes)[KEY_TILE] = (float (*)[KEY_TILE])sums;  /* each row's 16 sums */
    for (int pass = 0; pass < 4 / PASS_VECTORS; pass++) {
        const int first = pass * PASS_VECTORS * 4;  /* the pass's first column */
        lanes_4 s[ROW_BLOCK][PASS_VECTORS];
        for (int i = 0; i < ROW_BLOCK; i++)
            for (int v = 0; v < PASS_VECTORS; v++) memcpy(&s[i][v], lanes[i] + first + 4 * v, sizeof(lanes_4));
        const float *column = b + first;
        for (int64_t k = 0; k < depth; k++, column += b_stride) {
            lanes_4 row[PASS_VECTORS];
            for (int v = 0; v < PASS_VECTORS; v++) memcpy(&row[v], column + 4 * v, sizeof(lanes_4));
            for (int i = 0; i < ROW_BLOCK; i++) {
                const lanes_4 broadcast = splat_4(a[i][k]);
                for (int v = 0; v < PASS_VECTORS; v++) s[i][v] = fma_4(broadcast, row[v], s[i][v]);
            }
        }
        for (int i = 0; i < ROW_BLOCK; i++)
            for (int v = 0; v < PASS_VECTORS; v++) memcpy(lanes[i] + first + 4 * v, &s[i][v], sizeof(lanes_4));
    }
}
#else
/* sums[i] (16 lanes in two vectors) += sum over k < depth of a[i][k] * b[k * b_stride + 0..15], for ROW_BLOCK rows
 * of a, each sum carried on from what sums holds: the register tile shared by the scores and the values (12
 * accumulators, named so that they stay in registers). */
static inline void tile_product(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride, int64_t depth,
                                f32x8 sums[ROW_BLOCK][2]) {
    f32x8 s00 = sums[0][0], s01 = sums[0][1], s10 = sums[1][0], s11 = sums[1][1], s20 = sums[2][0], s21 = sums[2][1],
           s30 = sums[3][0], s31 = sums[3][1], s40 = sums[4][0], s41 = sums[4][1], s50 = sums[5][0], s51 = sums[5][1];
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
    for (int64_t k = 0; k < depth; k++, b += b_stride) {
        const f32x8 b0 = f32x8_load(b), b1 = f32x8_load(b + 8);
        f32x8 x;
        x = f32x8_splat_at(a0 + k); s00 = f32x8_fma(x, b0, s00); s01 = f32x8_fma(x, b1, s01);
        x = f32x8_splat_at(a1 + k); s10 = f32x8_fma(x, b0, s10); s11 = f32x8_fma(x, b1, s11);
        x = f32x8_splat_at(a2 + k); s20 = f32x8_fma(x, b0, s20); s21 = f32x8_fma(x, b1, s21);
        x = f32x8_splat_at(a3 + k); s30 = f32x8_fma(x, b0, s30); s31 = f32x8_fma(x, b1, s31);
        x = f32x8_splat_at(a4 + k); s40 = f32x8_fma(x, b0, s40); s41 = f32x8_fma(x, b1, s41);
        x = f32x8_splat_at(a5 + k); s50 = f32x8_fma(x, b0, s50); s51 = f32x8_fma(x, b1, s51);
    }
    sums[0][0] = s00; sums[0][1] = s01; sums[1][0] = s10; sums[1][1] = s11; sums[2][0] = s20; sums[2][1] = s21;
    sums[3][0] = s30; sums[3][1] = s31; sums[4][0] = s40; sums[4][1] = s41; sums[5][0] = s50; sums[5][1] = s51;
}
#endif

/* tile_product with 16 columns in one AVX-512 vector: the same sums, lane by lane in the same order. */
WIDE static inline void tile_product_wide(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride,
                                          int64_t depth, f32x16 sums[ROW_BLOCK]) {
    f32x16 s0 = sums[0], s1 = sums[1], s2 = sums[2], s3 = sums[3], s4 = sums[4], s5 = sums[5];
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
    for (int64_t k = 0; k < depth; k++, b += b_stride) {
        const f32x16 row = f32x16_load(b);
        s0 = f32x16_fma(f32x16_splat(a0[k]), row, s0);
        s1 = f32x16_fma(f32x16_splat(a1[k]), row, s1);
        s2 = f32x16_fma(f32x16_splat(a2[k]), row, s2);
        s3 = f32x16_fma(f32x16_splat(a3[k]), row, s3);
        s4 = f32x16_fma(f32x16_splat(a4[k]), row, s4);
        s5 = f32x16_fma(f32x16_splat(a5[k]), row, s5);
    }
    sums[0] = s0; sums[1] = s1; sums[2] = s2; sums[3] = s3; sums[4] = s4; sums[5] = s5;
}

/* tile_product_wide over sums held as 16 floats per row (a function of its own: AVX-512 inside, none outside). */
WIDE static void tile_product_wide_stored(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride,
                                          int64_t depth, float sums[ROW_BLOCK][KEY_TILE]) {
    f32x16 wide_sums[ROW_BLOCK];
    for (int i = 0; i < ROW_BLOCK; i++) wide_sums[i] = f32x16_load(sums[i]);
    tile_product_wide(a, b, b_stride, depth, wide_sums);
    for (int i = 0; i < ROW_BLOCK; i++) f32x16_store(sums[i], wide_sums[i]);
}

/* The lanes of vector v (columns v * 16..v * 16 + 15) that lie before column `count`. */
static inline mask16 columns_before(int64_t count, int v) {
    const int64_t left = count - v * 16;
    return left >= 16 ? (mask16)0xFFFF : left > 0 ? (mask16)((1u << left) - 1) : 0;
}

/* out[i * out_stride + j] = sum over k < depth of a[i][k] * b[k * b_stride + j] for i < live rows and j < count
 * <= WIDE_TILE columns: ROW_BLOCK rows x 64 columns in 24 AVX-512 accumulators, so that each step loads 4 vectors
 * and 6 broadcasts for 24 FMAs (the 6 x 16 tile loads 7 for 6). Every sum runs over k in order, as tile_product's:
 * the same bits. `accumulate`: the sums start from what out holds (the same chain carried on from an earlier run of
 * k), else from 0. Columns past `count` are computed from what b holds there and not stored. */
WIDE static void wide_tile_product(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride, int64_t depth,
                                   float *out, int64_t out_stride, int live, int64_t count, int accumulate) {
    f32x16 s[ROW_BLOCK][4];
    for (int i = 0; i < ROW_BLOCK; i++)
        for (int v = 0; v < 4; v++)
            s[i][v] = accumulate && i < live ? f32x16_load_masked(columns_before(count, v), out + i * out_stride + v * 16)
                                             : f32x16_zero();
    for (int64_t k = 0; k < depth; k++, b += b_stride) {
        const f32x16 b0 = f32x16_load(b), b1 = f32x16_load(b + 16), b2 = f32x16_load(b + 32),
                     b3 = f32x16_load(b + 48);
        for (int i = 0; i < ROW_BLOCK; i++) {
            const f32x16 x = f32x16_splat(a[i][k]);
            s[i][0] = f32x16_fma(x, b0, s[i][0]);
            s[i][1] = f32x16_fma(x, b1, s[i][1]);
            s[i][2] = f32x16_fma(x, b2, s[i][2]);
            s[i][3] = f32x16_fma(x, b3, s[i][3]);
        }
    }
    for (int i = 0; i < live; i++)
        for (int v = 0; v < 4 && v * 16 < count; v++)
            f32x16_store_masked(out + i * out_stride + v * 16, columns_before(count, v), s[i][v]);
}

/* sums (ROW_BLOCK rows x 16 columns, 16 floats per row) += the tile's products, each sum carried on from what sums
 * holds: with AVX-512 where `wide`. */
static inline void tile_product_any(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride, int64_t depth,
                                    float sums[ROW_BLOCK][KEY_TILE], int wide) {
    if (wide) {
        tile_product_wide_stored(a, b, b_stride, depth, sums);
        return;
    }
    f32x8 narrow[ROW_BLOCK][2];
    for (int i = 0; i < ROW_BLOCK; i++) {
        narrow[i][0] = f32x8_load(sums[i]);
        narrow[i][1] = f32x8_load(sums[i] + 8);
    }
    tile_product(a, b, b_stride, depth, narrow);
    for (int i = 0; i < ROW_BLOCK; i++) {
        f32x8_store(sums[i], narrow[i][0]);
        f32x8_store(sums[i] + 8, narrow[i][1]);
    }
}

/* out[i * out_stride + 0..15] = sum over k < depth of a[i][k] * b[k * b_stride + 0..15] for the `live` rows, carried
 * on from what out holds where `accumulate` (the same chain continued from an earlier run of k: the same bits), else
 * from 0: tile_product_any's 16 columns. */
static inline void narrow_tile_product(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride,
                                       int64_t depth, float *out, int64_t out_stride, int live, int accumulate,
                                       int wide) {
    float sums[ROW_BLOCK][KEY_TILE];
    for (int i = 0; i < ROW_BLOCK; i++)
        if (accumulate && i < live)
            memcpy(sums[i], out + i * out_stride, sizeof(float) * KEY_TILE);
        else
            memset(sums[i], 0, sizeof(float) * KEY_TILE);
    tile_product_any(a, b, b_stride, depth, sums, wide);
    for (int i = 0; i < live; i++) memcpy(out + i * out_stride, sums[i], sizeof(float) * KEY_TILE);
}

/* exp_8 (simd.h) in 16 lanes: the same operations, so the same bits in every lane. */
WIDE static inline f32x16 exp_16(f32x16 x) {
    const f32x16 lowest = f32x16_splat(EXP_LOWEST);
    const mask16 underflow = f32x16_less(x, lowest);
    x = f32x16_max(x, lowest);
    const f32x16 n = f32x16_nearest(f32x16_mul(x, f32x16_splat(EXP_LOG2E)));
    f32x16 r = f32x16_fnma(n, f32x16_splat(EXP_LN2_HIGH), x);
    r = f32x16_fnma(n, f32x16_splat(EXP_LN2_LOW), r);
    f32x16 p = f32x16_splat(EXP_P0);
    p = f32x16_fma(p, r, f32x16_splat(EXP_P1));
    p = f32x16_fma(p, r, f32x16_splat(EXP_P2));
    p = f32x16_fma(p, r, f32x16_splat(EXP_P3));
    p = f32x16_fma(p, r, f32x16_splat(EXP_P4));
    p = f32x16_fma(p, r, f32x16_splat(EXP_P5));
    p = f32x16_fma(p, f32x16_mul(r, r), f32x16_add(r, f32x16_splat(1.0f)));
    const i32x16 two_to_n = i32x16_shift_left(i32x16_add(i32x16_nearest_of(n), i32x16_splat(127)), 23);
    return f32x16_keep_where((mask16)~underflow, f32x16_mul(p, i32x16_as_floats(two_to_n)));
}

/* row_exponentials (simd.h) 16 lanes at a time: the same bits. The exponentials are summed into 8 lanes, the low
 * half of each vector before the high, which is the order row_exponentials adds them in. */
WIDE static float row_exponentials_wide(float *row, int64_t tokens, float top) {
    const f32x16 shift = f32x16_splat(top);
    f32x8 total = f32x8_zero();
    int64_t j = 0;
    for (; j + 16 <= tokens; j += 16) {
        const f32x16 e = exp_16(f32x16_sub(f32x16_load(row + j), shift));
        f32x16_store(row + j, e);
        total = f32x8_add(total, f32x16_low_half(e));
        total = f32x8_add(total, f32x16_high_half(e));
    }
    for (; j + 8 <= tokens; j += 8) {
        const f32x8 e = exp_8(f32x8_sub(f32x8_load(row + j), f32x16_low_half(shift)));
        f32x8_store(row + j, e);
        total = f32x8_add(total, e);
    }
    float sum = f32x8_sum(total);
    for (; j < tokens; j++) {
        row[j] = expf(row[j] - top);
        sum += row[j];
    }
    return sum;
}

/* A tile of scores just computed (every row of a head, `count` columns from column `first`; rows `tokens` floats
 * apart): the question's own columns among them get tail_mask added, and each row's largest score in the tile is
 * written to maxima[row], while the tile is still in the nearest cache (the softmax then needs no pass of its own to
 * find each row's largest). */
static void finish_score_tile(float *scores, int64_t rows, int64_t tokens, int64_t first, int64_t count,
                              const float *tail_mask, int64_t question, float *maxima) {
    const int64_t question_start = tokens - question;  /* the question's first own column */
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * tokens;
        const float *mask = tail_mask + (r % question) * question;  /* row r is the question's token r % question */
        for (int64_t c = first > question_start ? first : question_start; c < first + count; c++)
            row[c - first] += mask[c - question_start];
        maxima[r] = row_maximum(row, count);
    }
}

/* (rows, depth) zero-padded to whole blocks of ROW_BLOCK rows, times `scale`; NULL when memory runs out. */
static float *padded_rows(const float *rows_in, int64_t rows, int64_t depth, float scale) {
    const int64_t padded = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    float *padded_copy = calloc((size_t)(padded * depth), sizeof(float));
    if (padded_copy)
        for (int64_t i = 0; i < rows * depth; i++) padded_copy[i] = rows_in[i] * scale;
    return padded_copy;
}

/* out[r * out_stride + j] = sum over c < depth of a[r][c] * tile[c][j], for r < rows, j < count <= tile_width: every
 * short row (`a`, padded by padded_rows) against one transposed tile (depth, tile_width): in AVX-512's 6 x 64 register
 * tile where `wide` (tile_width WIDE_TILE), else 16 columns at a time (tile_width a multiple of 16). */
static void rows_times_tile(const float *a, int64_t rows, int64_t depth, const float *tile, int64_t tile_width,
                            int64_t count, float *out, int64_t out_stride, int wide) {
    for (int64_t first = 0; first < rows; first += ROW_BLOCK) {
        const float *block[ROW_BLOCK];
        for (int i = 0; i < ROW_BLOCK; i++) block[i] = a + (first + i) * depth;
        const int live = rows - first < ROW_BLOCK ? (int)(rows - first) : ROW_BLOCK;
        if (wide) {
            wide_tile_product(block, tile, WIDE_TILE, depth, out + first * out_stride, out_stride, live, count, 0);
            continue;
        }
        for (int64_t c = 0; c < count; c += KEY_TILE) {
            float sums[ROW_BLOCK][KEY_TILE] = {{0}};
            tile_product_any(block, tile + c, tile_width, depth, sums, wide);
            const int64_t columns = count - c < KEY_TILE ? count - c : KEY_TILE;
            for (int i = 0; i < live; i++)  /* a copy of a known size where the tile is whole: a few moves, no call */
                if (columns == KEY_TILE) memcpy(out + (first + i) * out_stride + c, sums[i], sizeof(float) * KEY_TILE);
                else memcpy(out + (first + i) * out_stride + c, sums[i], sizeof(float) * columns);
        }
    }
}

#endif
