/* SnapKV's cut of one layer's cache after a question's pass, on the CPU, in three small steps (each one call):
 *
 *   window_scores:  the window's attention weights summed over its queries, pooled along the positions, averaged
 *                   over the query heads of each KV head (snapkv.methods.SnapKV.score_weights);
 *   top_positions:  per KV head the `keep` best positions, then the window's own, in ascending order
 *                   (snapkv.scoring.kept_indices);
 *   gather_rows:    those rows of each head's keys or values, copied into a new tensor
 *                   (snapkv.scoring.gather_positions).
 *
 * PyTorch does the same in ~15 small ops per layer (at 8k tokens of the embedded model, 30 layers: ~45 ms of a
 * follow-up question's pass; ~25 ms here, most of it the row copies). The scores are PyTorch's within fp32 rounding:
 * a window's rows are summed one after another here, in PyTorch's own order there. Where the attention kernel has
 * already summed the window (few_rows.c's window_sums), window_scores gets those sums as a window of one row. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define POOL_MAX 1
#define POOL_AVG 0

/* weights: (kv_heads, group, window, columns) fp32 at the given element strides (columns contiguous);
 * scores: (kv_heads, columns) out. Returns 0, or -1 for a shape it does not take or when memory runs out. */
int window_scores(const float *weights, int64_t kv_heads, int64_t group, int64_t window, int64_t columns,
                  int64_t head_stride, int64_t group_stride, int64_t row_stride, int kernel, int pooling,
                  float *scores) {
    if (kv_heads < 1 || group < 1 || window < 1 || columns < 0 || kernel < 1 || kernel % 2 == 0) return -1;
    const int64_t half = kernel / 2;
    /* one query head's sums with `half` pads on either side (-inf for a max: never chosen; 0 for an average), and
     * its pooled scores */
    float *padded = malloc(sizeof(float) * (size_t)(2 * columns + 2 * half + 1));
    if (!padded) return -1;
    float *summed = padded + half, *pooled = padded + columns + 2 * half;
    const float pad = pooling == POOL_MAX ? -INFINITY : 0.0f;
    for (int64_t i = 0; i < half; i++) padded[i] = summed[columns + i] = pad;
    for (int64_t h = 0; h < kv_heads; h++) {
        float *out = scores + h * columns;
        for (int64_t g = 0; g < group; g++) {
            const float *first = weights + h * head_stride + g * group_stride;
            memcpy(summed, first, sizeof(float) * (size_t)columns);
            for (int64_t r = 1; r < window; r++) {
                const float *row = first + r * row_stride;
                for (int64_t j = 0; j < columns; j++) summed[j] += row[j];
            }
            /* pooled over [j - half, j + half]: one offset at a time over every column (loops that vectorize) */
            memcpy(pooled, summed - half, sizeof(float) * (size_t)columns);
            for (int64_t offset = 1 - half; offset <= half; offset++) {
                const float *shifted = summed + offset;
                if (pooling == POOL_MAX)
                    for (int64_t j = 0; j < columns; j++) pooled[j] = shifted[j] > pooled[j] ? shifted[j] : pooled[j];
                else
                    for (int64_t j = 0; j < columns; j++) pooled[j] += shifted[j];
            }
            for (int64_t j = 0; j < columns; j++) {
                const float value = pooling == POOL_MAX ? pooled[j] : pooled[j] / (float)kernel;
                out[j] = g == 0 ? value : out[j] + value;  /* the group's heads added in order */
            }
        }
        for (int64_t j = 0; j < columns; j++) out[j] /= (float)group;
    }
    free(padded);
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
                  int64_t *indices) {
    if (keep > prefix) keep = prefix;
    if (kv_heads < 1 || keep < 0 || window < 0) return -1;
    for (int64_t i = 0; i < kv_heads * prefix; i++)
        if (scores[i] != scores[i]) return -2;
    float *scratch = malloc(sizeof(float) * (size_t)(prefix > 0 ? prefix : 1));
    if (!scratch) return -1;
    for (int64_t h = 0; h < kv_heads; h++) {
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
    return 0;
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
