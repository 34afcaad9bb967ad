/* Products for a few fp32 rows (a question's tokens) against many: a question's attention over a long cache, and
 * a linear layer's product with its fp32 weights. Both read the long side 64 rows at a time (a linear layer's 16 at a
 * time without AVX-512, so that its tile stays in the nearest cache), transposed into a (depth, 64) tile that feeds
 * every short row through a register tile of 6 rows x 64 columns (AVX-512) or 6 x 16: for ~20 tokens PyTorch's
 * matmuls reach about half of this CPU's fp32 rate, these about 3/4.
 *
 * attend_rows: scores, softmax and the weighted sum of the values in one call, for one batch entry.
 *   query:   (kv_heads, rows, head_dim), the query heads of each KV head one after another (row r is the
 *            question's token r % question); scaled here by `scale` before the products, as PyTorch's path
 *            scales the rows (snapkv/modeling/cpu_attention.py)
 *   keys, values: per KV head `tokens` rows of head_dim floats, heads `key_head_stride` / `value_head_stride`
 *            floats apart
 *   tail_mask: (question, question) added to the scores of the last `question` columns (0 or -inf): every
 *            row attends to all the earlier columns
 *   weights: (kv_heads, rows, tokens) out, and the scores' room: the softmax's numerators e^(score - the row's
 *            largest), left unnormalized (one pass less over them)
 *   out:     (kv_heads, rows, head_dim) out: softmax @ values, as (weights @ values) / each row's sum of weights
 *   window_sums: NULL, or (kv_heads, rows / question, tokens) out: per query head, its softmax summed over the
 *            question's last `window` tokens (SnapKV's scores before pooling, snapkv.compression.scoring.pooled_window_scores)
 *   the softmax is simd.h's (exp by Cephes' single-precision polynomial, within 2 ulp of expf), each row's largest
 *   score found tile by tile as the scores are made.
 * linear_rows: y (rows, n) = x (rows, k) @ W^T for W (n, k) row-major (snapkv.modeling.block_weights: a question's rows);
 *   linear_rows_blocks the same with W as 4-bit or 8-bit blocks, linear_rows_bf16 with W as bf16 rows, each decoded
 *   to its exact fp32 values a tile at a time.
 *
 * Work is spread over `threads` OpenMP threads (tiles of the long side; for attention then rows for the softmax
 * and row blocks for the values). head_dim a multiple of 16, at most MAX_HEAD_DIM; k a
 * multiple of 8. On a CPU with AVX-512 (wide_vectors(), snapkv/native/kernels/blockwise_matmul.c) the register tile
 * holds each row's 16 columns in one vector: the same sums in the same order, in half the instructions. */
#include "vectors.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "tiles.h"

#define VALUE_RUN 256  /* tokens of values (64 KB at head_dim 64) that every row block of a group takes in turn */

/* Returns 0, or -1 for a shape it does not take or when memory runs out. */
int attend_rows(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale,
                const float *keys, int64_t key_head_stride, const float *values, int64_t value_head_stride,
                int64_t tokens, int64_t head_dim, const float *tail_mask, float *weights, float *out,
                int64_t window, float *window_sums, int threads) {
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || kv_heads < 1 || rows < 1 || question < 1 || question > tokens || rows % question)
        return -1;
    if (window_sums && (window < 1 || window > question)) return -1;
    const int wide = wide_vectors(-1);
    const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t tiles = (tokens + WIDE_TILE - 1) / WIDE_TILE;
    float *scaled[kv_heads];  /* per KV head, its rows scaled and padded */
    int missing = 0;
    for (int64_t h = 0; h < kv_heads; h++) missing |= !(scaled[h] = padded_rows(query + h * rows * head_dim, rows, head_dim, scale));
    float *tile_maxima = malloc(sizeof(float) * (size_t)(kv_heads * tiles * rows));  /* (kv_heads, tiles, rows) */
    float *inverse_sums = malloc(sizeof(float) * (size_t)(kv_heads * rows));  /* per row, 1 / its sum of weights */
    if (missing || !tile_maxima || !inverse_sums) {
        for (int64_t h = 0; h < kv_heads; h++) free(scaled[h]);
        free(tile_maxima);
        free(inverse_sums);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        float tile[MAX_HEAD_DIM * WIDE_TILE] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * tiles; task++) {  /* scores: one tile of keys, every row */
            const int64_t h = task / tiles, first = (task % tiles) * WIDE_TILE;
            const int64_t count = tokens - first < WIDE_TILE ? tokens - first : WIDE_TILE;
            transposed_wide_tile(keys + h * key_head_stride + first * head_dim, count, head_dim, tile);
            rows_times_tile(scaled[h], rows, head_dim, tile, WIDE_TILE, count, weights + h * rows * tokens + first, tokens,
                            wide);
            finish_score_tile(weights + h * rows * tokens + first, rows, tokens, first, count, tail_mask, question,
                              tile_maxima + task * rows);
        }
        /* the softmax's numerators, row by row, each row's largest from its tiles' maxima; with window sums asked
         * for, a query head's rows in order in one task, each row's softmax (numerators times 1 / their sum) added to
         * its head's sums while the row is still in the nearest cache */
        const int64_t task_rows = window_sums ? question : 1;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * rows / task_rows; task++)
            for (int64_t r = task * task_rows; r < (task + 1) * task_rows; r++) {
                float *row = weights + r * tokens;
                const int64_t h = r / rows, i = r % question;  /* the KV head; the question's token */
                float top = -INFINITY;
                for (int64_t t = 0; t < tiles; t++) {
                    const float tile_top = tile_maxima[(h * tiles + t) * rows + r % rows];
                    top = tile_top > top ? tile_top : top;
                }
                const float inverse = 1.0f / (wide ? row_exponentials_wide(row, tokens, top)
                                                   : row_exponentials(row, tokens, top));
                inverse_sums[r] = inverse;
                if (window_sums && i >= question - window) {
                    float *sums = window_sums + r / question * tokens;
                    if (i == question - window) for (int64_t j = 0; j < tokens; j++) sums[j] = row[j] * inverse;
                    else for (int64_t j = 0; j < tokens; j++) sums[j] += row[j] * inverse;  /* multiplied, then added */
                }
            }
        /* values: a group of row blocks of one head, every channel, in runs of VALUE_RUN tokens at a time for every
         * block of the group, so that each run of values is read from memory once per group, not once per block;
         * each sum carries on from the run before (the same chain: the same bits). Channels in tiles of 64 with
         * AVX-512, the rest (all of them on AVX2) in tiles of 16. */
        const int64_t groups = threads < blocks ? threads : blocks;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * groups; task++) {
            const int64_t h = task / groups, group = task % groups;
            const int64_t first_block = blocks * group / groups, end_block = blocks * (group + 1) / groups;
            const float *head_values = values + h * value_head_stride;
            for (int64_t start = 0; start < tokens; start += VALUE_RUN) {
                const int64_t run = tokens - start < VALUE_RUN ? tokens - start : VALUE_RUN;
                for (int64_t block = first_block; block < end_block; block++) {
                    const int64_t live = rows - block * ROW_BLOCK < ROW_BLOCK ? rows - block * ROW_BLOCK : ROW_BLOCK;
                    const float *a[ROW_BLOCK];  /* rows past the last repeat it; their sums are not stored */
                    for (int i = 0; i < ROW_BLOCK; i++)
                        a[i] = weights + (h * rows + block * ROW_BLOCK + (i < live ? i : 0)) * tokens + start;
                    float *block_out = out + (h * rows + block * ROW_BLOCK) * head_dim;
                    int64_t c = 0;
                    for (; wide && c + WIDE_TILE <= head_dim; c += WIDE_TILE)
                        wide_tile_product(a, head_values + start * head_dim + c, head_dim, run, block_out + c, head_dim,
                                          (int)live, WIDE_TILE, start > 0);
                    for (; c < head_dim; c += KEY_TILE)
                        narrow_tile_product(a, head_values + start * head_dim + c, head_dim, run, block_out + c, head_dim,
                                            (int)live, start > 0, wide);
                }
            }
        }
        /* each row's weighted sum divided by its sum of weights: the softmax's */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < kv_heads * rows; r++)
            for (int64_t c = 0; c < head_dim; c++) out[r * head_dim + c] *= inverse_sums[r];
    }
    for (int64_t h = 0; h < kv_heads; h++) free(scaled[h]);
    free(tile_maxima);
    free(inverse_sums);
    return 0;
}

/* The fp32 weights of outputs first..first + count - 1, (count, k) into `rows_out`, from 4-bit or 8-bit blocks
 * (snapkv/native/kernels/blockwise_matmul.c's layout: 4-bit w = scale * q + minimum, 8-bit w = scale * q), multiplied
 * then added as snapkv.modeling.block_weights checked the blocks to give back every weight: the very fp32 values. */
static void weights_from_blocks(int bits, const uint8_t *codes, const float *scale, const float *minimum, int64_t k,
                                int64_t first, int64_t count, float *rows_out) {
    if (bits == 16) {  /* bf16 rows (n, k): each weight's 16 bits, then 16 zero bits, is its fp32 value */
        const uint16_t *halves = (const uint16_t *)codes + first * k;
        for (int64_t i = 0; i < count * k; i++) {
            const uint32_t widened = (uint32_t)halves[i] << 16;
            memcpy(rows_out + i, &widened, sizeof widened);
        }
        return;
    }
    const int64_t blocks = k / 32, code_bytes = bits == 4 ? k / 2 : k;
#if defined(SNAPKV_PORTABLE)
    /* plain loops, which the compiler vectorizes for its target (the generic build's 8-lane vectors stay in memory
     * where the target's registers hold 4): the same products and sums */
    for (int64_t j = 0; j < count; j++) {
        const int64_t out = first + j;
        for (int64_t b = 0; b < blocks; b++) {
            const float block_scale = scale[out * blocks + b];
            float *block = rows_out + j * k + b * 32;
            if (bits == 4) {
                const uint8_t *bytes = codes + out * code_bytes + b * 16;
                const float block_minimum = minimum[out * blocks + b];
                for (int e = 0; e < 16; e++) block[e] = (float)(bytes[e] & 0x0F) * block_scale + block_minimum;
                for (int e = 0; e < 16; e++) block[e + 16] = (float)(bytes[e] >> 4) * block_scale + block_minimum;
            } else {
                const int8_t *signed_codes = (const int8_t *)codes + out * code_bytes + b * 32;
                for (int e = 0; e < 32; e++) block[e] = (float)signed_codes[e] * block_scale;
            }
        }
    }
#else
    for (int64_t j = 0; j < count; j++) {
        const int64_t out = first + j;
        float *row = rows_out + j * k;
        for (int64_t b = 0; b < blocks; b++) {
            const f32x8 block_scale = f32x8_splat(scale[out * blocks + b]);
            i32x8 q[4];
            if (bits == 4) {
                block_4bit_codes(codes + out * code_bytes + b * 16, q);
            } else {
                const int8_t *signed_codes = (const int8_t *)codes + out * code_bytes + b * 32;
                for (int v = 0; v < 4; v++)
                    q[v] = i32x8_from_i8(u8x16_load8(signed_codes + 8 * v));
            }
            for (int v = 0; v < 4; v++) {
                f32x8 w = f32x8_mul(i32x8_to_floats(q[v]), block_scale);
                if (bits == 4) w = f32x8_add(w, f32x8_splat(minimum[out * blocks + b]));
                f32x8_store(row + b * 32 + 8 * v, w);
            }
        }
    }
#endif
}

/* y (rows, n) = x (rows, k) @ W^T, W given as fp32 rows (`weight`, (n, k)) or, where `weight` is NULL, as blocks
 * (`bits`, `codes`, `scale`, `minimum`; k a multiple of 32) or bf16 rows (`bits` 16, `codes`), decoded a tile of
 * outputs at a time: the same tiles, the same sums, the same bits. Returns 0, or -1 when memory runs out. */
static int product_tiles(const float *x, int64_t rows, int64_t k, const float *weight, int bits, const uint8_t *codes,
                         const float *scale, const float *minimum, int64_t n, float *y, int threads) {
    float *padded = padded_rows(x, rows, k, 1.0f);
    if (!padded) return -1;
    const int wide = wide_vectors(-1);
    const int64_t tile_width = wide ? WIDE_TILE : KEY_TILE;  /* AVX2: (k, 16) tiles, which stay in the nearest cache */
    const int64_t tiles = (n + tile_width - 1) / tile_width;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *tile = aligned_alloc(64, sizeof(float) * (size_t)(k * tile_width));  /* (k, width): too large for a stack */
        float *decoded = weight ? NULL : aligned_alloc(64, sizeof(float) * (size_t)(k * tile_width));  /* (width, k) */
        if (!tile || (!weight && !decoded)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tiles; task++) {
            if (!tile || (!weight && !decoded)) continue;
            const int64_t first = task * tile_width, count = n - first < tile_width ? n - first : tile_width;
            const float *source = weight + first * k;
            if (!weight) {
                weights_from_blocks(bits, codes, scale, minimum, k, first, count, decoded);
                source = decoded;
            }
            if (wide)
                transposed_wide_tile(source, count, k, tile);
            else
                transposed_tile(source, count, k, tile, KEY_TILE);
            rows_times_tile(padded, rows, k, tile, tile_width, count, y + first, n, wide);
        }
        free(tile);
        free(decoded);
    }
    free(padded);
    return failed ? -1 : 0;
}

/* Returns 0, or -1 for a shape it does not take or when memory runs out. */
int linear_rows(const float *x, int64_t rows, int64_t k, const float *weight, int64_t n, float *y, int threads) {
    if (rows < 1 || k < 8 || k % 8) return -1;
    return product_tiles(x, rows, k, weight, 0, NULL, NULL, NULL, n, y, threads);
}

/* linear_rows with the weights as bf16 rows (n, k), widened to their fp32 values a tile at a time: the same bits as
 * linear_rows over those fp32 values, from half the bytes. Returns 0, or -1 for a shape it does not take or when
 * memory runs out. */
int linear_rows_bf16(const float *x, int64_t rows, int64_t k, const void *weight, int64_t n, float *y, int threads) {
    if (rows < 1 || k < 8 || k % 8) return -1;
    return product_tiles(x, rows, k, NULL, 16, weight, NULL, NULL, n, y, threads);
}

/* linear_rows with the weights as 4-bit or 8-bit blocks (minimum NULL for 8-bit): the same bits, from a fifth of
 * the bytes. Returns 0, or -1 for a shape it does not take or when memory runs out. */
int linear_rows_blocks(const float *x, int64_t rows, int64_t k, int bits, const uint8_t *codes, const float *scale,
                       const float *minimum, int64_t n, float *y, int threads) {
    if (rows < 1 || k < 32 || k % 32 || !(bits == 4 || bits == 8) || (bits == 4 && !minimum)) return -1;
    return product_tiles(x, rows, k, NULL, bits, codes, scale, minimum, n, y, threads);
}
