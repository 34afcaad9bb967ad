/* Matrix products with weights stored in blocks of 32 along the input dimension, for a few rows of
 * activations in fp32 (a decoded token, a question): y (rows, n) = x (rows, k) @ W^T, W (n, k).
 *
 * 4-bit blocks: w = scale * q + minimum, q in 0..15; the 16 bytes of a block hold element j in the low
 *               nibble of byte j and element j + 16 in its high nibble.
 * 8-bit blocks: w = scale * q, q in -127..127, one signed byte per element.
 * scale, minimum: one fp32 per block, (n, k / 32) row-major.
 *
 * The block's products are summed in fp32 and scaled once per block; the minimum's share is
 * minimum * (sum of the block's x), with the x sums taken once per call. Output rows are spread over
 * `threads` OpenMP threads. One row (a decoded token) on a CPU with AVX-512 is multiplied with 16-float vectors
 * (compiled for it function by function, chosen at run time; wide_vectors() turns it off to compare), and each output prefetches the codes and scales of the output
 * AHEAD rows on: the weights are read once per token, so they come from memory, and the prefetch keeps
 * those reads going while the block arithmetic runs. */
#include "vectors.h"
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

#define BLOCK 32
#define MAX_ROWS SNAPKV_MAX_ROWS
#define AHEAD 8  /* outputs ahead whose weights one row's products prefetch */

/* Whether the 16-lane functions are used: by default where they are the CPU's own (the avx512 variant, which
 * snapkv.native loads only where the CPU has AVX-512 F, BW, VL and DQ); in the others, where they are plain C
 * (vectors.h), only on request (tests compare them with the 8-lane ones) and by what exists only 16 lanes wide
 * (coded_attention.c). */
#define WIDE_BY_DEFAULT (!SNAPKV_WIDE_IS_PLAIN)
static int wide_chosen = -1;  /* -1: not yet decided */

/* request 1 or 0 to choose, -1 to ask; returns the choice in force after the call. */
int wide_vectors(int request) {
    if (request >= 0) wide_chosen = request != 0;
    else if (wide_chosen < 0) wide_chosen = WIDE_BY_DEFAULT;
    return wide_chosen;
}

/* The weights of output `out` + AHEAD: its codes (code_bytes per output) and its scales (and minimums). Always
 * inlined, as prefetch_bytes. */
__attribute__((always_inline)) static inline void prefetch_ahead(const void *codes, int64_t code_bytes,
                                                                 const float *scale, const float *minimum,
                                                                 int64_t blocks, int64_t out) {
    prefetch_bytes((const char *)codes + (out + AHEAD) * code_bytes, code_bytes);
    prefetch_bytes(scale + (out + AHEAD) * blocks, blocks * (int64_t)sizeof(float));
    if (minimum) prefetch_bytes(minimum + (out + AHEAD) * blocks, blocks * (int64_t)sizeof(float));
}

/* 8 signed bytes (the low 8 of 16) as floats. */
static inline f32x8 bytes_to_floats(u8x16 eight_bytes_low) {
    return i32x8_to_floats(i32x8_from_i8(eight_bytes_low));
}

/* The block's 32 codes (as floats, 8 per vector) times the 32 activations xs, summed per lane. */
static inline f32x8 block_products(f32x8 q0, f32x8 q1, f32x8 q2, f32x8 q3, const float *xs) {
    f32x8 dot = f32x8_mul(q0, f32x8_load(xs));
    dot = f32x8_fma(q1, f32x8_load(xs + 8), dot);
    dot = f32x8_fma(q2, f32x8_load(xs + 16), dot);
    return f32x8_fma(q3, f32x8_load(xs + 24), dot);
}

/* The minimum's share of one output: sum over blocks of minimum[b] * block_sums[b]. */
WIDE static inline float minimum_share_wide(const float *minimum, const float *block_sums, int64_t blocks) {
    f32x16 share = f32x16_zero();
    int64_t b = 0;
    for (; b + 16 <= blocks; b += 16)
        share = f32x16_fma(f32x16_load(minimum + b), f32x16_load(block_sums + b), share);
    if (b < blocks) {
        const mask16 rest = (mask16)((1u << (blocks - b)) - 1);
        share = f32x16_fma(f32x16_load_masked(rest, minimum + b), f32x16_load_masked(rest, block_sums + b),
                                share);
    }
    return f32x16_sum(share);
}

/* A block's 32 codes, as two vectors of 16 floats (elements 0..15, 16..31), times its 32 activations xs: the
 * products summed per lane. */
WIDE static inline f32x16 block_products_wide(f32x16 first, f32x16 second, const float *xs) {
    return f32x16_fma(second, f32x16_load(xs + 16), f32x16_mul(first, f32x16_load(xs)));
}

/* A 4-bit block's 32 codes times its 32 activations xs, summed per lane: byte j of the block (widened to lane j) holds
 * element j in its low 4 bits and element j + 16 in its high 4. */
WIDE static inline f32x16 block_4bit_wide(const uint8_t *packed, const float *xs) {
    const i32x16 bytes = i32x16_from_u8(u8x16_load(packed));
    return block_products_wide(f32x16_of_low4(bytes), f32x16_of_low4(i32x16_shift_right(bytes, 4)), xs);
}

/* An 8-bit block's 32 codes times its 32 activations xs, summed per lane. */
WIDE static inline f32x16 block_8bit_wide(const int8_t *block, const float *xs) {
    return block_products_wide(f32x16_from_i8(u8x16_load(block)), f32x16_from_i8(u8x16_load(block + 16)), xs);
}

/* y (n) = x (k) @ W^T for 4-bit blocks, 16 floats a vector: a block's codes 0..15 and 16..31 each one vector. The
 * blocks' scaled products go into two chains of FMAs, even blocks and odd, two blocks a step (no branch in the loop). */
WIDE static void one_row_4bit_wide(const float *x, int64_t blocks, const uint8_t *codes, const float *scale,
                                   const float *minimum, const float *block_sums, int64_t n, float *y, int threads) {
    const int64_t code_bytes = BLOCK / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        prefetch_ahead(codes, blocks * code_bytes, scale, minimum, blocks, out);
        const uint8_t *row_codes = codes + out * blocks * code_bytes;
        const float *row_scale = scale + out * blocks;
        f32x16 even = f32x16_zero(), odd = f32x16_zero();
        int64_t b = 0;
        for (; b + 2 <= blocks; b += 2) {
            even = f32x16_fma(block_4bit_wide(row_codes + b * code_bytes, x + b * BLOCK), f32x16_splat(row_scale[b]),
                              even);
            odd = f32x16_fma(block_4bit_wide(row_codes + (b + 1) * code_bytes, x + (b + 1) * BLOCK),
                             f32x16_splat(row_scale[b + 1]), odd);
        }
        if (b < blocks)
            even = f32x16_fma(block_4bit_wide(row_codes + b * code_bytes, x + b * BLOCK), f32x16_splat(row_scale[b]),
                              even);
        y[out] = f32x16_sum(f32x16_add(even, odd))
                 + minimum_share_wide(minimum + out * blocks, block_sums, blocks);
    }
}

/* y (n) = x (k) @ W^T for 8-bit blocks, 16 floats a vector: even and odd blocks in two chains of FMAs (unrolled as
 * one_row_4bit_wide's, the output head, read from memory, ran 1.2x slower). */
WIDE static void one_row_8bit_wide(const float *x, int64_t blocks, const int8_t *codes, const float *scale, int64_t n,
                                   float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        prefetch_ahead(codes, blocks * BLOCK, scale, NULL, blocks, out);
        const int8_t *row_codes = codes + out * blocks * BLOCK;
        const float *row_scale = scale + out * blocks;
        f32x16 even = f32x16_zero(), odd = f32x16_zero();
        for (int64_t b = 0; b < blocks; b++) {
            const f32x16 products = block_8bit_wide(row_codes + b * BLOCK, x + b * BLOCK);
            if (b & 1) odd = f32x16_fma(products, f32x16_splat(row_scale[b]), odd);
            else even = f32x16_fma(products, f32x16_splat(row_scale[b]), even);
        }
        y[out] = f32x16_sum(f32x16_add(even, odd));
    }
}

/* Returns 0, or -1 when rows or k do not fit (rows > MAX_ROWS, k not a multiple of 32). */
int matmul_4bit(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                const float *minimum, int64_t n, float *y, int threads) {
    if (rows < 1 || rows > MAX_ROWS || k % BLOCK) return -1;
    const int64_t blocks = k / BLOCK;
    float *block_sums = malloc(sizeof(float) * rows * blocks);  /* (rows, blocks): sum of x per block */
    if (!block_sums) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            float total = 0.0f;
            for (int j = 0; j < BLOCK; j++) total += x[r * k + b * BLOCK + j];
            block_sums[r * blocks + b] = total;
        }
    if (rows == 1 && wide_vectors(-1)) {
        one_row_4bit_wide(x, blocks, codes, scale, minimum, block_sums, n, y, threads);
        free(block_sums);
        return 0;
    }
    if (rows == 1) {  /* a decoded token: the accumulators stay in registers */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t out = 0; out < n; out++) {
            prefetch_ahead(codes, blocks * (BLOCK / 2), scale, minimum, blocks, out);
            f32x8 accumulated = f32x8_zero();
            float from_minimum = 0.0f;
            const uint8_t *row_codes = codes + out * blocks * (BLOCK / 2);
            for (int64_t b = 0; b < blocks; b++) {
                i32x8 q[4];
                block_4bit_codes(row_codes + b * (BLOCK / 2), q);
                const float *xs = x + b * BLOCK;
                f32x8 dot = f32x8_mul(i32x8_to_floats(q[0]), f32x8_load(xs));
                f32x8 dot2 = f32x8_mul(i32x8_to_floats(q[1]), f32x8_load(xs + 8));
                dot = f32x8_fma(i32x8_to_floats(q[2]), f32x8_load(xs + 16), dot);
                dot2 = f32x8_fma(i32x8_to_floats(q[3]), f32x8_load(xs + 24), dot2);
                accumulated = f32x8_fma(f32x8_add(dot, dot2), f32x8_splat(scale[out * blocks + b]),
                                              accumulated);
                from_minimum += minimum[out * blocks + b] * block_sums[b];
            }
            y[out] = f32x8_sum(accumulated) + from_minimum;
        }
        free(block_sums);
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        f32x8 accumulated[MAX_ROWS];
        float from_minimum[MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) { accumulated[r] = f32x8_zero(); from_minimum[r] = 0.0f; }
        for (int64_t b = 0; b < blocks; b++) {
            i32x8 q[4];
            block_4bit_codes(codes + (out * blocks + b) * (BLOCK / 2), q);
            f32x8 q0 = i32x8_to_floats(q[0]), q1 = i32x8_to_floats(q[1]);
            f32x8 q2 = i32x8_to_floats(q[2]), q3 = i32x8_to_floats(q[3]);
            f32x8 block_scale = f32x8_splat(scale[out * blocks + b]);
            float block_minimum = minimum[out * blocks + b];
            for (int64_t r = 0; r < rows; r++) {
                f32x8 dot = block_products(q0, q1, q2, q3, x + r * k + b * BLOCK);
                accumulated[r] = f32x8_fma(dot, block_scale, accumulated[r]);
                from_minimum[r] += block_minimum * block_sums[r * blocks + b];
            }
        }
        for (int64_t r = 0; r < rows; r++) y[r * n + out] = f32x8_sum(accumulated[r]) + from_minimum[r];
    }
    free(block_sums);
    return 0;
}

int matmul_8bit(const float *x, int64_t rows, int64_t k, const int8_t *codes, const float *scale, int64_t n,
                float *y, int threads) {
    if (rows < 1 || rows > MAX_ROWS || k % BLOCK) return -1;
    const int64_t blocks = k / BLOCK;
    if (rows == 1 && wide_vectors(-1)) {
        one_row_8bit_wide(x, blocks, codes, scale, n, y, threads);
        return 0;
    }
    if (rows == 1) {  /* a decoded token: the sum in a register, not in the rows' array below (the same bits, 2x faster) */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t out = 0; out < n; out++) {
            prefetch_ahead(codes, blocks * BLOCK, scale, NULL, blocks, out);
            f32x8 accumulated = f32x8_zero();
            for (int64_t b = 0; b < blocks; b++) {
                const int8_t *block = codes + (out * blocks + b) * BLOCK;
                const f32x8 dot = block_products(bytes_to_floats(u8x16_load8(block)),
                                                 bytes_to_floats(u8x16_load8(block + 8)),
                                                 bytes_to_floats(u8x16_load8(block + 16)),
                                                 bytes_to_floats(u8x16_load8(block + 24)), x + b * BLOCK);
                accumulated = f32x8_fma(dot, f32x8_splat(scale[out * blocks + b]), accumulated);
            }
            y[out] = f32x8_sum(accumulated);
        }
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        f32x8 accumulated[MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) accumulated[r] = f32x8_zero();
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *block = codes + (out * blocks + b) * BLOCK;
            f32x8 q0 = bytes_to_floats(u8x16_load8(block));
            f32x8 q1 = bytes_to_floats(u8x16_load8(block + 8));
            f32x8 q2 = bytes_to_floats(u8x16_load8(block + 16));
            f32x8 q3 = bytes_to_floats(u8x16_load8(block + 24));
            f32x8 block_scale = f32x8_splat(scale[out * blocks + b]);
            for (int64_t r = 0; r < rows; r++) {
                f32x8 dot = block_products(q0, q1, q2, q3, x + r * k + b * BLOCK);
                accumulated[r] = f32x8_fma(dot, block_scale, accumulated[r]);
            }
        }
        for (int64_t r = 0; r < rows; r++) y[r * n + out] = f32x8_sum(accumulated[r]);
    }
    return 0;
}
