/* Products for a few fp32 rows (a question's tokens) against many: a question's attention over a long cache, and
 * a linear layer's product with its fp32 weights. Both read the long side 16 rows at a time, transposed in
 * registers into a (depth, 16) tile that feeds every short row through a register tile of 6 rows x 16 columns:
 * for ~20 tokens PyTorch's matmuls reach about half of this CPU's fp32 rate, these about 3/4.
 *
 * attend_rows: scores, softmax and the weighted sum of the values in one call, for one batch entry.
 *   query:   (kv_heads, rows, head_dim), the query heads of each KV head one after another (row r is the
 *            question's token r % question); scaled here by `scale` before the products, as PyTorch's path
 *            scales the rows (snapkv/cpu_attention.py)
 *   keys, values: per KV head `tokens` rows of head_dim floats, heads `key_head_stride` / `value_head_stride`
 *            floats apart
 *   tail_mask: (question, question) added to the scores of the last `question` columns (0 or -inf): every
 *            row attends to all the earlier columns
 *   weights: (kv_heads, rows, tokens) out: the softmax, kept (snapkv.compress scores SnapKV from it)
 *   out:     (kv_heads, rows, head_dim) out: weights @ values
 *   the softmax is simd.h's softmax_row (exp by Cephes' single-precision polynomial, within 2 ulp of expf).
 * linear_rows: y (rows, n) = x (rows, k) @ W^T for W (n, k) row-major (snapkv.block_weights: a question's rows).
 *
 * Work is spread over `threads` OpenMP threads (tiles of the long side; for attention then rows for the softmax
 * and row blocks for the values). Needs AVX2 and FMA; head_dim a multiple of 16, at most MAX_HEAD_DIM; k a
 * multiple of 8. On a CPU with AVX-512 (wide_vectors(), snapkv/kernels/blockwise_matmul.c) the register tile
 * holds each row's 16 columns in one vector: the same sums in the same order, in half the instructions. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define ROW_BLOCK 6
#define KEY_TILE 16
#define MAX_HEAD_DIM 256

/* tile (depth, KEY_TILE) = the `count` rows of `long_rows` (each `depth` floats) transposed, zero past count. */
static void transposed_tile(const float *long_rows, int64_t count, int64_t depth, float *tile) {
    if (count == KEY_TILE) {
        for (int64_t c = 0; c < depth; c += 8) {
            transpose_8x8(long_rows + c, depth, tile + c * KEY_TILE, KEY_TILE);
            transpose_8x8(long_rows + 8 * depth + c, depth, tile + c * KEY_TILE + 8, KEY_TILE);
        }
        return;
    }
    for (int64_t c = 0; c < depth; c++)
        for (int64_t j = 0; j < KEY_TILE; j++) tile[c * KEY_TILE + j] = j < count ? long_rows[j * depth + c] : 0.0f;
}

/* sums[i] (16 lanes in two vectors) = sum over k < depth of a[i][k] * b[k * b_stride + 0..15], for ROW_BLOCK
 * rows of a: the register tile shared by the scores and the values (12 accumulators, named so that they stay
 * in registers). */
static inline void tile_product(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride, int64_t depth,
                                __m256 sums[ROW_BLOCK][2]) {
    __m256 s00 = _mm256_setzero_ps(), s01 = s00, s10 = s00, s11 = s00, s20 = s00, s21 = s00,
           s30 = s00, s31 = s00, s40 = s00, s41 = s00, s50 = s00, s51 = s00;
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
    for (int64_t k = 0; k < depth; k++, b += b_stride) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        __m256 x;
        x = _mm256_broadcast_ss(a0 + k); s00 = _mm256_fmadd_ps(x, b0, s00); s01 = _mm256_fmadd_ps(x, b1, s01);
        x = _mm256_broadcast_ss(a1 + k); s10 = _mm256_fmadd_ps(x, b0, s10); s11 = _mm256_fmadd_ps(x, b1, s11);
        x = _mm256_broadcast_ss(a2 + k); s20 = _mm256_fmadd_ps(x, b0, s20); s21 = _mm256_fmadd_ps(x, b1, s21);
        x = _mm256_broadcast_ss(a3 + k); s30 = _mm256_fmadd_ps(x, b0, s30); s31 = _mm256_fmadd_ps(x, b1, s31);
        x = _mm256_broadcast_ss(a4 + k); s40 = _mm256_fmadd_ps(x, b0, s40); s41 = _mm256_fmadd_ps(x, b1, s41);
        x = _mm256_broadcast_ss(a5 + k); s50 = _mm256_fmadd_ps(x, b0, s50); s51 = _mm256_fmadd_ps(x, b1, s51);
    }
    sums[0][0] = s00; sums[0][1] = s01; sums[1][0] = s10; sums[1][1] = s11; sums[2][0] = s20; sums[2][1] = s21;
    sums[3][0] = s30; sums[3][1] = s31; sums[4][0] = s40; sums[4][1] = s41; sums[5][0] = s50; sums[5][1] = s51;
}

/* tile_product with 16 columns in one AVX-512 vector: the same sums, lane by lane in the same order. */
WIDE static inline void tile_product_wide(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride,
                                          int64_t depth, __m512 sums[ROW_BLOCK]) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0;
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3], *a4 = a[4], *a5 = a[5];
    for (int64_t k = 0; k < depth; k++, b += b_stride) {
        const __m512 row = _mm512_loadu_ps(b);
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(a0[k]), row, s0);
        s1 = _mm512_fmadd_ps(_mm512_set1_ps(a1[k]), row, s1);
        s2 = _mm512_fmadd_ps(_mm512_set1_ps(a2[k]), row, s2);
        s3 = _mm512_fmadd_ps(_mm512_set1_ps(a3[k]), row, s3);
        s4 = _mm512_fmadd_ps(_mm512_set1_ps(a4[k]), row, s4);
        s5 = _mm512_fmadd_ps(_mm512_set1_ps(a5[k]), row, s5);
    }
    sums[0] = s0; sums[1] = s1; sums[2] = s2; sums[3] = s3; sums[4] = s4; sums[5] = s5;
}

/* tile_product_wide's sums stored as 16 floats per row (a function of its own: AVX-512 inside, none outside). */
WIDE static void tile_product_wide_stored(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride,
                                          int64_t depth, float sums[ROW_BLOCK][KEY_TILE]) {
    __m512 wide_sums[ROW_BLOCK];
    tile_product_wide(a, b, b_stride, depth, wide_sums);
    for (int i = 0; i < ROW_BLOCK; i++) _mm512_storeu_ps(sums[i], wide_sums[i]);
}

/* sums (ROW_BLOCK rows x 16 columns) stored as 16 floats per row: with AVX-512 where `wide`. */
static inline void tile_product_any(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride, int64_t depth,
                                    float sums[ROW_BLOCK][KEY_TILE], int wide) {
    if (wide) {
        tile_product_wide_stored(a, b, b_stride, depth, sums);
        return;
    }
    __m256 narrow[ROW_BLOCK][2];
    tile_product(a, b, b_stride, depth, narrow);
    for (int i = 0; i < ROW_BLOCK; i++) {
        _mm256_storeu_ps(sums[i], narrow[i][0]);
        _mm256_storeu_ps(sums[i] + 8, narrow[i][1]);
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

/* out[r * out_stride + j] = sum over c < depth of a[r][c] * tile[c][j], for r < rows, j < count: every short row
 * (`a`, padded by padded_rows) against one transposed tile. */
static void rows_times_tile(const float *a, int64_t rows, int64_t depth, const float *tile, int64_t count,
                            float *out, int64_t out_stride, int wide) {
    for (int64_t first = 0; first < rows; first += ROW_BLOCK) {
        const float *block[ROW_BLOCK];
        for (int i = 0; i < ROW_BLOCK; i++) block[i] = a + (first + i) * depth;
        float sums[ROW_BLOCK][KEY_TILE];
        tile_product_any(block, tile, KEY_TILE, depth, sums, wide);
        for (int i = 0; i < ROW_BLOCK && first + i < rows; i++)
            memcpy(out + (first + i) * out_stride, sums[i], sizeof(float) * count);
    }
}

/* Returns 0, or -1 for a shape it does not take or when memory runs out. */
int attend_rows(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale,
                const float *keys, int64_t key_head_stride, const float *values, int64_t value_head_stride,
                int64_t tokens, int64_t head_dim, const float *tail_mask, float *weights, float *out, int threads) {
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || kv_heads < 1 || rows < 1 || question < 1 || question > tokens || rows % question)
        return -1;
    const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t tiles = (tokens + KEY_TILE - 1) / KEY_TILE;
    float *scaled[kv_heads];  /* per KV head, its rows scaled and padded */
    int missing = 0;
    for (int64_t h = 0; h < kv_heads; h++) missing |= !(scaled[h] = padded_rows(query + h * rows * head_dim, rows, head_dim, scale));
    if (missing) {
        for (int64_t h = 0; h < kv_heads; h++) free(scaled[h]);
        return -1;
    }
    const int wide = wide_vectors(-1);
#pragma omp parallel num_threads(threads)
    {
        float tile[MAX_HEAD_DIM * KEY_TILE] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * tiles; task++) {  /* scores: one tile of keys, every row */
            const int64_t h = task / tiles, first = (task % tiles) * KEY_TILE;
            const int64_t count = tokens - first < KEY_TILE ? tokens - first : KEY_TILE;
            transposed_tile(keys + h * key_head_stride + first * head_dim, count, head_dim, tile);
            rows_times_tile(scaled[h], rows, head_dim, tile, count, weights + h * rows * tokens + first, tokens, wide);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < kv_heads * rows; r++)
            softmax_row(weights + r * tokens, tokens, tail_mask + ((r % rows) % question) * question, question);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < kv_heads * blocks; task++) {  /* values: a block of rows, every channel */
            const int64_t h = task / blocks, block = task % blocks;
            const int64_t live = rows - block * ROW_BLOCK < ROW_BLOCK ? rows - block * ROW_BLOCK : ROW_BLOCK;
            const float *a[ROW_BLOCK];  /* rows past the last repeat it; their sums are not stored */
            for (int i = 0; i < ROW_BLOCK; i++) a[i] = weights + (h * rows + block * ROW_BLOCK + (i < live ? i : 0)) * tokens;
            for (int64_t c = 0; c < head_dim; c += 16) {
                float sums[ROW_BLOCK][KEY_TILE];
                tile_product_any(a, values + h * value_head_stride + c, head_dim, tokens, sums, wide);
                for (int i = 0; i < live; i++)
                    memcpy(out + (h * rows + block * ROW_BLOCK + i) * head_dim + c, sums[i], sizeof(float) * KEY_TILE);
            }
        }
    }
    for (int64_t h = 0; h < kv_heads; h++) free(scaled[h]);
    return 0;
}

/* Returns 0, or -1 for a shape it does not take or when memory runs out. */
int linear_rows(const float *x, int64_t rows, int64_t k, const float *weight, int64_t n, float *y, int threads) {
    if (rows < 1 || k < 8 || k % 8) return -1;
    float *padded = padded_rows(x, rows, k, 1.0f);
    if (!padded) return -1;
    const int64_t tiles = (n + KEY_TILE - 1) / KEY_TILE;
    const int wide = wide_vectors(-1);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *tile = aligned_alloc(32, sizeof(float) * (size_t)(k * KEY_TILE));  /* (k, 16): too large for a stack */
        if (!tile) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tiles; task++) {
            if (!tile) continue;
            const int64_t first = task * KEY_TILE, count = n - first < KEY_TILE ? n - first : KEY_TILE;
            transposed_tile(weight + first * k, count, k, tile);
            rows_times_tile(padded, rows, k, tile, count, y + first, n, wide);
        }
        free(tile);
    }
    free(padded);
    return failed ? -1 : 0;
}
