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
 *   weights: (kv_heads, rows, tokens) out, and the scores' room: the softmax's numerators e^(score - the row's
 *            largest), left unnormalized (one pass less over them)
 *   out:     (kv_heads, rows, head_dim) out: softmax @ values, as (weights @ values) / each row's sum of weights
 *   window_sums: NULL, or (kv_heads, rows / question, tokens) out: per query head, its softmax summed over the
 *            question's last `window` tokens (SnapKV's scores before pooling, snapkv.scoring.pooled_window_scores)
 *   the softmax is simd.h's (exp by Cephes' single-precision polynomial, within 2 ulp of expf), each row's largest
 *   score found tile by tile as the scores are made.
 * linear_rows: y (rows, n) = x (rows, k) @ W^T for W (n, k) row-major (snapkv.block_weights: a question's rows);
 *   linear_rows_blocks the same with W as 4-bit or 8-bit blocks, decoded to its exact fp32 values a tile at a time.
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
#define WIDE_TILE 64  /* columns of the AVX-512 register tile: ROW_BLOCK rows x 4 vectors of 16 */
#define VALUE_RUN 256  /* tokens of values (64 KB at head_dim 64) that every row block of a group takes in turn */
#define MAX_HEAD_DIM 256

/* tile (depth, KEY_TILE), rows `tile_stride` floats apart = the `count` rows of `long_rows` (each `depth` floats)
 * transposed, zero past count. */
static void transposed_tile(const float *long_rows, int64_t count, int64_t depth, float *tile, int64_t tile_stride) {
    if (count == KEY_TILE) {
        for (int64_t c = 0; c < depth; c += 8) {
            transpose_8x8(long_rows + c, depth, tile + c * tile_stride, tile_stride);
            transpose_8x8(long_rows + 8 * depth + c, depth, tile + c * tile_stride + 8, tile_stride);
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

/* The lanes of vector v (columns v * 16..v * 16 + 15) that lie before column `count`. */
static inline __mmask16 columns_before(int64_t count, int v) {
    const int64_t left = count - v * 16;
    return left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
}

/* out[i * out_stride + j] = sum over k < depth of a[i][k] * b[k * b_stride + j] for i < live rows and j < count
 * <= WIDE_TILE columns: ROW_BLOCK rows x 64 columns in 24 AVX-512 accumulators, so that each step loads 4 vectors
 * and 6 broadcasts for 24 FMAs (the 6 x 16 tile loads 7 for 6). Every sum runs over k in order, as tile_product's:
 * the same bits. `accumulate`: the sums start from what out holds (the same chain carried on from an earlier run of
 * k), else from 0. Columns past `count` are computed from what b holds there and not stored. */
WIDE static void wide_tile_product(const float *const a[ROW_BLOCK], const float *b, int64_t b_stride, int64_t depth,
                                   float *out, int64_t out_stride, int live, int64_t count, int accumulate) {
    __m512 s[ROW_BLOCK][4];
    for (int i = 0; i < ROW_BLOCK; i++)
        for (int v = 0; v < 4; v++)
            s[i][v] = accumulate && i < live ? _mm512_maskz_loadu_ps(columns_before(count, v), out + i * out_stride + v * 16)
                                             : _mm512_setzero_ps();
    for (int64_t k = 0; k < depth; k++, b += b_stride) {
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32),
                     b3 = _mm512_loadu_ps(b + 48);
        for (int i = 0; i < ROW_BLOCK; i++) {
            const __m512 x = _mm512_set1_ps(a[i][k]);
            s[i][0] = _mm512_fmadd_ps(x, b0, s[i][0]);
            s[i][1] = _mm512_fmadd_ps(x, b1, s[i][1]);
            s[i][2] = _mm512_fmadd_ps(x, b2, s[i][2]);
            s[i][3] = _mm512_fmadd_ps(x, b3, s[i][3]);
        }
    }
    for (int i = 0; i < live; i++)
        for (int v = 0; v < 4 && v * 16 < count; v++)
            _mm512_mask_storeu_ps(out + i * out_stride + v * 16, columns_before(count, v), s[i][v]);
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

/* exp_8 (simd.h) in 16 lanes: the same operations, so the same bits in every lane. */
WIDE static inline __m512 exp_16(__m512 x) {
    const __m512 lowest = _mm512_set1_ps(-87.3f);
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lowest);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i two_to_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~underflow, _mm512_mul_ps(p, _mm512_castsi512_ps(two_to_n)));
}

/* row_exponentials (simd.h) 16 lanes at a time: the same bits. The exponentials are summed into 8 lanes, the low
 * half of each vector before the high, which is the order row_exponentials adds them in. */
WIDE static float row_exponentials_wide(float *row, int64_t tokens, float top) {
    const __m512 shift = _mm512_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= tokens; j += 16) {
        const __m512 e = exp_16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
        _mm512_storeu_ps(row + j, e);
        total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
        total = _mm256_add_ps(total, _mm512_extractf32x8_ps(e, 1));
    }
    for (; j + 8 <= tokens; j += 8) {
        const __m256 e = exp_8(_mm256_sub_ps(_mm256_loadu_ps(row + j), _mm512_castps512_ps256(shift)));
        _mm256_storeu_ps(row + j, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = lane_sum(total);
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

/* out[r * out_stride + j] = sum over c < depth of a[r][c] * tile[c][j], for r < rows, j < count: every short row
 * (`a`, padded by padded_rows) against one transposed tile: (depth, WIDE_TILE) where `wide`, else
 * (depth, KEY_TILE). */
static void rows_times_tile(const float *a, int64_t rows, int64_t depth, const float *tile, int64_t count,
                            float *out, int64_t out_stride, int wide) {
    for (int64_t first = 0; first < rows; first += ROW_BLOCK) {
        const float *block[ROW_BLOCK];
        for (int i = 0; i < ROW_BLOCK; i++) block[i] = a + (first + i) * depth;
        const int live = rows - first < ROW_BLOCK ? (int)(rows - first) : ROW_BLOCK;
        if (wide) {
            wide_tile_product(block, tile, WIDE_TILE, depth, out + first * out_stride, out_stride, live, count, 0);
            continue;
        }
        float sums[ROW_BLOCK][KEY_TILE];
        tile_product_any(block, tile, KEY_TILE, depth, sums, wide);
        for (int i = 0; i < ROW_BLOCK && first + i < rows; i++)
            memcpy(out + (first + i) * out_stride, sums[i], sizeof(float) * count);
    }
}

/* Returns 0, or -1 for a shape it does not take or when memory runs out. */
int attend_rows(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale,
                const float *keys, int64_t key_head_stride, const float *values, int64_t value_head_stride,
                int64_t tokens, int64_t head_dim, const float *tail_mask, float *weights, float *out,
                int64_t window, float *window_sums, int threads) {
    if (head_dim % 16 || head_dim > MAX_HEAD_DIM || kv_heads < 1 || rows < 1 || question < 1 || question > tokens || rows % question)
        return -1;
    if (window_sums && (window < 1 || window > question)) return -1;
    const int wide = wide_vectors(-1);
    const int64_t tile_width = wide ? WIDE_TILE : KEY_TILE;
    const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t tiles = (tokens + tile_width - 1) / tile_width;
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
            const int64_t h = task / tiles, first = (task % tiles) * tile_width;
            const int64_t count = tokens - first < tile_width ? tokens - first : tile_width;
            const float *tile_keys = keys + h * key_head_stride + first * head_dim;
            if (wide)
                transposed_wide_tile(tile_keys, count, head_dim, tile);
            else
                transposed_tile(tile_keys, count, head_dim, tile, KEY_TILE);
            rows_times_tile(scaled[h], rows, head_dim, tile, count, weights + h * rows * tokens + first, tokens, wide);
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
        /* values: a group of row blocks of one head, every channel. With AVX-512, runs of VALUE_RUN tokens at a
         * time for every block of the group, so that each run of values is read from memory once per group, not
         * once per block; each sum carries on from the run before (the same chain: the same bits). */
        const int64_t groups = threads < blocks ? threads : blocks;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * groups; task++) {
            const int64_t h = task / groups, group = task % groups;
            const int64_t first_block = blocks * group / groups, end_block = blocks * (group + 1) / groups;
            const float *head_values = values + h * value_head_stride;
            for (int64_t block = first_block; block < end_block; block++) {
                const int64_t live = rows - block * ROW_BLOCK < ROW_BLOCK ? rows - block * ROW_BLOCK : ROW_BLOCK;
                const float *a[ROW_BLOCK];  /* rows past the last repeat it; their sums are not stored */
                for (int i = 0; i < ROW_BLOCK; i++)
                    a[i] = weights + (h * rows + block * ROW_BLOCK + (i < live ? i : 0)) * tokens;
                for (int64_t c = wide ? head_dim / WIDE_TILE * WIDE_TILE : 0; c < head_dim; c += 16) {
                    float sums[ROW_BLOCK][KEY_TILE];  /* channels past the whole runs of 64 (all of them in AVX2) */
                    tile_product_any(a, head_values + c, head_dim, tokens, sums, wide);
                    for (int i = 0; i < live; i++)
                        memcpy(out + (h * rows + block * ROW_BLOCK + i) * head_dim + c, sums[i], sizeof(float) * KEY_TILE);
                }
            }
            if (wide && head_dim >= WIDE_TILE)
                for (int64_t start = 0; start < tokens; start += VALUE_RUN) {
                    const int64_t run = tokens - start < VALUE_RUN ? tokens - start : VALUE_RUN;
                    for (int64_t block = first_block; block < end_block; block++) {
                        const int64_t live = rows - block * ROW_BLOCK < ROW_BLOCK ? rows - block * ROW_BLOCK : ROW_BLOCK;
                        const float *a[ROW_BLOCK];
                        for (int i = 0; i < ROW_BLOCK; i++)
                            a[i] = weights + (h * rows + block * ROW_BLOCK + (i < live ? i : 0)) * tokens + start;
                        for (int64_t c = 0; c + WIDE_TILE <= head_dim; c += WIDE_TILE)
                            wide_tile_product(a, head_values + start * head_dim + c, head_dim, run,
                                              out + (h * rows + block * ROW_BLOCK) * head_dim + c, head_dim, (int)live,
                                              WIDE_TILE, start > 0);
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
 * (snapkv/kernels/blockwise_matmul.c's layout: 4-bit w = scale * q + minimum, 8-bit w = scale * q), multiplied
 * then added as snapkv.block_weights checked the blocks to give back every weight: the very fp32 values. */
static void weights_from_blocks(int bits, const uint8_t *codes, const float *scale, const float *minimum, int64_t k,
                                int64_t first, int64_t count, float *rows_out) {
    const int64_t blocks = k / 32, code_bytes = bits == 4 ? k / 2 : k;
    for (int64_t j = 0; j < count; j++) {
        const int64_t out = first + j;
        float *row = rows_out + j * k;
        for (int64_t b = 0; b < blocks; b++) {
            const __m256 block_scale = _mm256_set1_ps(scale[out * blocks + b]);
            __m256i q[4];
            if (bits == 4) {  /* element i in the low nibble of byte i, element i + 16 in its high nibble */
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + out * code_bytes + b * 16));
                const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
                const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
                q[0] = _mm256_cvtepu8_epi32(low);
                q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(low, 8));
                q[2] = _mm256_cvtepu8_epi32(high);
                q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(high, 8));
            } else {
                const int8_t *signed_codes = (const int8_t *)codes + out * code_bytes + b * 32;
                for (int v = 0; v < 4; v++)
                    q[v] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(signed_codes + 8 * v)));
            }
            for (int v = 0; v < 4; v++) {
                __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(q[v]), block_scale);
                if (bits == 4) w = _mm256_add_ps(w, _mm256_set1_ps(minimum[out * blocks + b]));
                _mm256_storeu_ps(row + b * 32 + 8 * v, w);
            }
        }
    }
}

/* y (rows, n) = x (rows, k) @ W^T, W given as fp32 rows (`weight`, (n, k)) or, where `weight` is NULL, as blocks
 * (`bits`, `codes`, `scale`, `minimum`; k a multiple of 32), decoded a tile of outputs at a time: the same tiles,
 * the same sums, the same bits. Returns 0, or -1 when memory runs out. */
static int product_tiles(const float *x, int64_t rows, int64_t k, const float *weight, int bits, const uint8_t *codes,
                         const float *scale, const float *minimum, int64_t n, float *y, int threads) {
    float *padded = padded_rows(x, rows, k, 1.0f);
    if (!padded) return -1;
    const int wide = wide_vectors(-1);
    const int64_t tile_width = wide ? WIDE_TILE : KEY_TILE;
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
            rows_times_tile(padded, rows, k, tile, count, y + first, n, wide);
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

/* linear_rows with the weights as 4-bit or 8-bit blocks (minimum NULL for 8-bit): the same bits, from a fifth of
 * the bytes. Returns 0, or -1 for a shape it does not take or when memory runs out. */
int linear_rows_blocks(const float *x, int64_t rows, int64_t k, int bits, const uint8_t *codes, const float *scale,
                       const float *minimum, int64_t n, float *y, int threads) {
    if (rows < 1 || k < 32 || k % 32 || !(bits == 4 || bits == 8) || (bits == 4 && !minimum)) return -1;
    return product_tiles(x, rows, k, NULL, bits, codes, scale, minimum, n, y, threads);
}
