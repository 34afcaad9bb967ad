/* SnapKV's cut of one layer's cache after a question's pass, on the CPU, in three small steps (each one call):
 *
 *   window_scores:  the window's attention weights summed over its queries, pooled along the positions, averaged
 *                   over the query heads of each KV head (snapkv.compression.methods.SnapKV.score);
 *   top_positions:  per KV head the `keep` best positions, then the window's own, in ascending order
 *                   (snapkv.compression.scoring.kept_indices);
 *   gather_rows:    those rows of each head's keys or values, copied into a new tensor
 *                   (snapkv.compression.scoring.gather_positions).
 *
 * PyTorch does the same in ~15 small ops per layer (at 8k tokens of the embedded model, 30 layers: ~45 ms of a
 * follow-up question's pass; ~15 ms here, most of it the row copies). The scores are PyTorch's within fp32 rounding:
 * a window's rows are summed one after another here, in PyTorch's own order there. Where the attention kernel has
 * already summed the window (few_rows.c's window_sums), window_scores gets those sums as a window of one row. A max
 * pooling takes the largest of two runs of a power of two found by doubling (4 passes for a kernel of 15, not 15);
 * each step spreads its query heads, KV heads or rows over the OpenMP threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define POOL_MAX 1
#define POOL_AVG 0

/* In place over padded[0..length): each value becomes the largest of itself and the `run` - 1 after it, for the
 * first length - run + 1 values (runs doubled from 1 up to `run`, a power of two: log2(run) passes). */
static void running_maxima(float *padded, int64_t length, int64_t run) {
    for (int64_t span = 1; span < run; span *= 2)
        for (int64_t i = 0; i + 2 * span <= length; i++)  /* reads i + span before it is written: vectorizes */
            padded[i] = padded[i + span] > padded[i] ? padded[i + span] : padded[i];
}

/* weights: (kv_heads, group, window, columns) fp32 at the given element strides (columns contiguous);
 * scores: (kv_heads, columns) out. Each query head's pooling is a task of its own, over `threads` OpenMP threads;
 * the group's heads are then added in order. Returns 0, or -1 for a shape it does not take or when memory runs out. */
int window_scores(const float *weights, int64_t kv_heads, int64_t group, int64_t window, int64_t columns,
                  int64_t head_stride, int64_t group_stride, int64_t row_stride, int kernel, int pooling,
                  float *scores, int threads) {
    if (kv_heads < 1 || group < 1 || window < 1 || columns < 0 || kernel < 1 || kernel % 2 == 0) return -1;
    const int64_t half = kernel / 2, padded_length = columns + 2 * half;
    float *pooled_heads = malloc(sizeof(float) * (size_t)(kv_heads * group * columns + 1));  /* (kv_heads, group, columns) */
    if (!pooled_heads) return -1;
    int failed = 0;
    const float pad = pooling == POOL_MAX ? -INFINITY : 0.0f;  /* never chosen by a max; nothing to an average */
#pragma omp parallel num_threads(threads)
    {
        /* one query head's sums with `half` pads on either side */
        float *padded = malloc(sizeof(float) * (size_t)(padded_length + 1));
        if (!padded) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * group; task++) {
            if (!padded) continue;
            const int64_t h = task / group, g = task % group;
            float *summed = padded + half, *pooled = pooled_heads + task * columns;
            for (int64_t i = 0; i < half; i++) padded[i] = summed[columns + i] = pad;
            const float *first = weights + h * head_stride + g * group_stride;
            memcpy(summed, first, sizeof(float) * (size_t)columns);
            for (int64_t r = 1; r < window; r++) {
                const float *row = first + r * row_stride;
                for (int64_t j = 0; j < columns; j++) summed[j] += row[j];
            }
            if (pooling == POOL_MAX) {
                /* the largest over [j - half, j + half]: two runs of the largest power of two <= kernel that cover
                 * it, from running maxima (a maximum is exact: the same value as one offset at a time) */
                int64_t run = 1;
                while (2 * run <= kernel) run *= 2;
                running_maxima(padded, padded_length, run);
                for (int64_t j = 0; j < columns; j++)
                    pooled[j] = padded[j + kernel - run] > padded[j] ? padded[j + kernel - run] : padded[j];
            } else {  /* the sum over [j - half, j + half], one offset at a time in order, then the mean */
                memcpy(pooled, summed - half, sizeof(float) * (size_t)columns);
                for (int64_t offset = 1 - half; offset <= half; offset++) {
                    const float *shifted = summed + offset;
                    for (int64_t j = 0; j < columns; j++) pooled[j] += shifted[j];
                }
                for (int64_t j = 0; j < columns; j++) pooled[j] /= (float)kernel;
            }
        }
        free(padded);
#pragma omp for schedule(static)
        for (int64_t h = 0; h < kv_heads; h++) {  /* the group's heads added in order, then averaged */
            float *out = scores + h * columns;
            memcpy(out, pooled_heads + h * group * columns, sizeof(float) * (size_t)columns);
            for (int64_t g = 1; g < group; g++) {
                const float *pooled = pooled_heads + (h * group + g) * columns;
                for (int64_t j = 0; j < columns; j++) out[j] += pooled[j];
            }
            for (int64_t j = 0; j < columns; j++) out[j] /= (float)group;
        }
    }
    free(pooled_heads);
    return failed ? -1 : 0;
}

/* In place over scores (rows, columns): each position's score becomes the mean of its chunk of `size` positions
 * (chunks from column 0; the last may be shorter), summed in order, so that a chunk ranks as one
 * (snapkv.compression.scoring.chunk_means, ChunkKV). Returns 0, or -1 for a size below 1. */
int chunk_means(float *scores, int64_t rows, int64_t columns, int64_t size) {
    if (size < 1 || rows < 0 || columns < 0) return -1;
    if (size == 1) return 0;
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * columns;
        for (int64_t start = 0; start < columns; start += size) {
            const int64_t stop = start + size < columns ? start + size : columns;
            float sum = 0.0f;
            for (int64_t j = start; j < stop; j++) sum += row[j];
            const float mean = sum / (float)(stop - start);
            for (int64_t j = start; j < stop; j++) row[j] = mean;
        }
    }
    return 0;
}

/* In place over scores (rows, columns): each position's score becomes the largest of its word's, words[r, j] the word
 * id of row r's position j, ascending along a row (one word's positions side by side), so that a word ranks as one
 * (snapkv.compression.scoring.word_maxima). A maximum is exact: the same values as PyTorch's scatter. Returns 0. */
int word_maxima(float *scores, const int64_t *words, int64_t rows, int64_t columns) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = scores + r * columns;
        const int64_t *word = words + r * columns;
        for (int64_t start = 0, stop; start < columns; start = stop) {
            float best = row[start];
            for (stop = start + 1; stop < columns && word[stop] == word[start]; stop++)
                best = row[stop] > best ? row[stop] : best;
            for (int64_t j = start; j < stop; j++) row[j] = best;
        }
    }
    return 0;
}

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* The k-th largest of values[0..n) (1 <= k <= n), found in `scratch` (n floats, reordered). */
static float kth_largest(const float *values, int64_t n, int64_t k, float *scratch) {
    memcpy(scratch, values, sizeof(float) * (size_t)n);
    int64_t low = 0, high = n - 1, target = k - 1;
    while (high - low > 16) {  /* quickselect, the median of three as pivot; larger values to the left */
        const int64_t middle = low + (high - low) / 2;
        float a = scratch[low], b = scratch[middle], c = scratch[high];
        const float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = low, j = high;
        while (i <= j) {
            while (scratch[i] > pivot) i++;
            while (scratch[j] < pivot) j--;
            if (i <= j) {
                const float swap = scratch[i];
                scratch[i++] = scratch[j];
                scratch[j--] = swap;
            }
        }
        if (target <= j) high = j;
        else if (target >= i) low = i;
        else return scratch[target];  /* between the two halves: equal to the pivot */
    }
    qsort(scratch + low, (size_t)(high - low + 1), sizeof(float), descending);
    return scratch[target];
}

/* scores: (kv_heads, prefix) fp32; indices: (kv_heads, min(keep, prefix) + window) int64 out: per head the
 * min(keep, prefix) highest-scoring positions (among equal scores the earlier ones), then prefix..prefix + window - 1,
 * all ascending. Returns 0, -1 when memory runs out, -2 (nothing written) for a NaN score. */
int top_positions(const float *scores, int64_t kv_heads, int64_t prefix, int64_t keep, int64_t window,
                  int64_t *indices, int threads) {
    if (keep > prefix) keep = prefix;
    if (kv_heads < 1 || keep < 0 || window < 0) return -1;
    for (int64_t i = 0; i < kv_heads * prefix; i++)
        if (scores[i] != scores[i]) return -2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = malloc(sizeof(float) * (size_t)(prefix > 0 ? prefix : 1));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < kv_heads; h++) {  /* a head a task */
            if (!scratch) continue;
            const float *row = scores + h * prefix;
            int64_t *out = indices + h * (keep + window), taken = 0;
            if (keep > 0) {
                const float threshold = kth_largest(row, prefix, keep, scratch);
                int64_t above = 0;
                for (int64_t j = 0; j < prefix; j++) above += row[j] > threshold;
                int64_t equal_wanted = keep - above;  /* the rest are the earliest positions at the threshold */
                for (int64_t j = 0; j < prefix; j++)
                    if (row[j] > threshold || (row[j] == threshold && equal_wanted-- > 0)) out[taken++] = j;
            }
            for (int64_t j = 0; j < window; j++) out[taken++] = prefix + j;
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* out (heads, count, row_bytes) = the rows indices[h][i] of head h of `states` (heads at head_stride bytes apart,
 * rows of row_bytes contiguous), over `threads` OpenMP threads. Returns 0, or -1 (nothing written) where an index
 * is not below `rows`. */
int gather_rows(const uint8_t *states, int64_t heads, int64_t head_stride, int64_t rows, int64_t row_bytes,
                const int64_t *indices, int64_t count, uint8_t *out, int threads) {
    for (int64_t i = 0; i < heads * count; i++)
        if (indices[i] < 0 || indices[i] >= rows) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < heads * count; i++)  /* row i of the output: head i / count's i % count-th index */
        memcpy(out + i * row_bytes, states + i / count * head_stride + indices[i] * row_bytes, (size_t)row_bytes);
    return 0;
}
