/* Products with plain float weights, bf16 or fp32, for a few rows of fp32 activations: y (rows, n) = x (rows, k) @ W^T,
 * W (n, k) row-major. A model whose weights are not 4/8-bit blocks (a user's bf16 checkpoint, in bf16 or in fp32) is
 * decoded by the native engine through these (decode_step.c's matrices of 16 and 32 bits).
 *
 * Every sum is in fp32: a bf16 weight is its exact fp32 value (its 16 bits, then 16 zero bits), so the products are
 * those of the same weights held in fp32, summed in another order (within rounding of PyTorch's fp32 matmul, never a
 * bf16 rounding of the activations). A decoded token reads each weight once, from memory: half the bytes of fp32
 * weights for bf16 ones.
 *
 * One row: each output's dot product in two chains of FMAs, 16 floats a vector where wide_vectors() says the CPU has
 * AVX-512 (blockwise_matmul.c), else 8; outputs spread over `threads` OpenMP threads, each prefetching the weights of
 * the output AHEAD rows on. More rows (a question's): few_rows.c's register tiles (linear_rows for fp32; bf16 rows
 * widened a tile at a time by linear_rows_bf16). k a multiple of 8. */
#include "vectors.h"
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define AHEAD 4  /* outputs ahead whose weights one output's product prefetches */

/* y (n) = x (k) @ W^T, 8 floats a vector. */
static void one_row(const float *x, int64_t k, const void *weight, int bf16, int64_t n, float *y, int threads) {
    const int64_t row_bytes = k * (bf16 ? 2 : 4);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        if (out + AHEAD < n) prefetch_bytes((const char *)weight + (out + AHEAD) * row_bytes, row_bytes);
        f32x8 even = f32x8_zero(), odd = f32x8_zero();
        int64_t j = 0;
        if (bf16) {
            const uint16_t *w = (const uint16_t *)weight + out * k;
            for (; j + 16 <= k; j += 16) {
                even = f32x8_fma(f32x8_from_bf16(w + j), f32x8_load(x + j), even);
                odd = f32x8_fma(f32x8_from_bf16(w + j + 8), f32x8_load(x + j + 8), odd);
            }
            if (j < k) even = f32x8_fma(f32x8_from_bf16(w + j), f32x8_load(x + j), even);
        } else {
            const float *w = (const float *)weight + out * k;
            for (; j + 16 <= k; j += 16) {
                even = f32x8_fma(f32x8_load(w + j), f32x8_load(x + j), even);
                odd = f32x8_fma(f32x8_load(w + j + 8), f32x8_load(x + j + 8), odd);
            }
            if (j < k) even = f32x8_fma(f32x8_load(w + j), f32x8_load(x + j), even);
        }
        y[out] = f32x8_sum(f32x8_add(even, odd));
    }
}

#if !SNAPKV_WIDE_IS_PLAIN
/* one_row with 16 floats a vector (the avx512 variant only: where the 16 lanes are plain C, one_row is used). */
WIDE static void one_row_wide(const float *x, int64_t k, const void *weight, int bf16, int64_t n, float *y,
                              int threads) {
    const int64_t row_bytes = k * (bf16 ? 2 : 4);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        if (out + AHEAD < n) prefetch_bytes((const char *)weight + (out + AHEAD) * row_bytes, row_bytes);
        f32x16 even = f32x16_zero(), odd = f32x16_zero();
        int64_t j = 0;
        if (bf16) {
            const uint16_t *w = (const uint16_t *)weight + out * k;
            for (; j + 32 <= k; j += 32) {
                even = f32x16_fma(f32x16_from_bf16(w + j), f32x16_load(x + j), even);
                odd = f32x16_fma(f32x16_from_bf16(w + j + 16), f32x16_load(x + j + 16), odd);
            }
            for (; j < k; j += 8) {  /* the last 8 to 24 of a row */
                const mask16 eight = 0xFF;
                even = f32x16_fma(f32x16_from_bf16_8(w + j), f32x16_load_masked(eight, x + j), even);
            }
        } else {
            const float *w = (const float *)weight + out * k;
            for (; j + 32 <= k; j += 32) {
                even = f32x16_fma(f32x16_load(w + j), f32x16_load(x + j), even);
                odd = f32x16_fma(f32x16_load(w + j + 16), f32x16_load(x + j + 16), odd);
            }
            for (; j < k; j += 8) {
                const mask16 eight = 0xFF;
                even = f32x16_fma(f32x16_load_masked(eight, w + j), f32x16_load_masked(eight, x + j), even);
            }
        }
        y[out] = f32x16_sum(f32x16_add(even, odd));
    }
}
#endif

/* Returns 0, or -1 for a shape it does not take (rows < 1, k not a multiple of 8) or when memory runs out. */
int matmul_dense(const float *x, int64_t rows, int64_t k, const void *weight, int bf16, int64_t n, float *y,
                 int threads) {
    if (rows < 1 || k < 8 || k % 8 || n < 1) return -1;
    if (rows > 1) return bf16 ? linear_rows_bf16(x, rows, k, weight, n, y, threads)
                              : linear_rows(x, rows, k, weight, n, y, threads);
#if !SNAPKV_WIDE_IS_PLAIN
    if (wide_vectors(-1)) {
        one_row_wide(x, k, weight, bf16, n, y, threads);
        return 0;
    }
#endif
    one_row(x, k, weight, bf16, n, y, threads);
    return 0;
}
