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
#define WIDE_BY_DEFAULT (!SNAPKV_WIDE_EMULATED)
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

static inline __m256 bytes_to_floats(__m128i eight_bytes_low, int is_signed) {
    __m256i widened = is_signed ? _mm256_cvtepi8_epi32(eight_bytes_low) : _mm256_cvtepu8_epi32(eight_bytes_low);
    return _mm256_cvtepi32_ps(widened);
}

/* The block's 32 codes (as floats, 8 per vector) times the 32 activations xs, summed per lane. */
static inline __m256 block_products(__m256 q0, __m256 q1, __m256 q2, __m256 q3, const float *xs) {
    __m256 dot = _mm256_mul_ps(q0, _mm256_loadu_ps(xs));
    dot = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xs + 8), dot);
    dot = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xs + 16), dot);
    return _mm256_fmadd_ps(q3, _mm256_loadu_ps(xs + 24), dot);
}

/* The minimum's share of one output: sum over blocks of minimum[b] * block_sums[b]. */
WIDE static inline float minimum_share_wide(const float *minimum, const float *block_sums, int64_t blocks) {
    __m512 share = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 16 <= blocks; b += 16)
        share = _mm512_fmadd_ps(_mm512_loadu_ps(minimum + b), _mm512_loadu_ps(block_sums + b), share);
    if (b < blocks) {
        const __mmask16 rest = (__mmask16)((1u << (blocks - b)) - 1);
        share = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(rest, minimum + b), _mm512_maskz_loadu_ps(rest, block_sums + b),
                                share);
    }
    return _mm512_reduce_add_ps(share);
}

/* A block's 32 codes, as two vectors of 16 floats (elements 0..15, 16..31), times its 32 activations xs: the
 * products summed per lane. */
WIDE static inline __m512 block_products_wide(__m512 first, __m512 second, const float *xs) {
    return _mm512_fmadd_ps(second, _mm512_loadu_ps(xs + 16), _mm512_mul_ps(first, _mm512_loadu_ps(xs)));
}

/* y (n) = x (k) @ W^T for 4-bit blocks, 16 floats a vector: a block's codes 0..15 and 16..31 each one vector. */
WIDE static void one_row_4bit_wide(const float *x, int64_t blocks, const uint8_t *codes, const float *scale,
                                   const float *minimum, const float *block_sums, int64_t n, float *y, int threads) {
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        prefetch_ahead(codes, blocks * (BLOCK / 2), scale, minimum, blocks, out);
        const uint8_t *row_codes = codes + out * blocks * (BLOCK / 2);
        const float *row_scale = scale + out * blocks;
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m128i packed = _mm_loadu_si128((const __m128i *)(row_codes + b * (BLOCK / 2)));
            const __m128i low = _mm_and_si128(packed, low_nibbles);                      /* elements 0..15 */
            const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);  /* elements 16..31 */
            const __m512 products = block_products_wide(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)),
                                                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), x + b * BLOCK);
            if (b & 1) odd = _mm512_fmadd_ps(products, _mm512_set1_ps(row_scale[b]), odd);  /* two chains of FMAs */
            else even = _mm512_fmadd_ps(products, _mm512_set1_ps(row_scale[b]), even);
        }
        y[out] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd))
                 + minimum_share_wide(minimum + out * blocks, block_sums, blocks);
    }
}

/* y (n) = x (k) @ W^T for 8-bit blocks, 16 floats a vector, as one_row_4bit_wide. */
WIDE static void one_row_8bit_wide(const float *x, int64_t blocks, const int8_t *codes, const float *scale, int64_t n,
                                   float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        prefetch_ahead(codes, blocks * BLOCK, scale, NULL, blocks, out);
        const int8_t *row_codes = codes + out * blocks * BLOCK;
        const float *row_scale = scale + out * blocks;
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m128i first = _mm_loadu_si128((const __m128i *)(row_codes + b * BLOCK));
            const __m128i second = _mm_loadu_si128((const __m128i *)(row_codes + b * BLOCK + 16));
            const __m512 products = block_products_wide(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)),
                                                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)),
                                                        x + b * BLOCK);
            if (b & 1) odd = _mm512_fmadd_ps(products, _mm512_set1_ps(row_scale[b]), odd);
            else even = _mm512_fmadd_ps(products, _mm512_set1_ps(row_scale[b]), even);
        }
        y[out] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
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
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    if (rows == 1 && wide_vectors(-1)) {
        one_row_4bit_wide(x, blocks, codes, scale, minimum, block_sums, n, y, threads);
        free(block_sums);
        return 0;
    }
    if (rows == 1) {  /* a decoded token: the accumulators stay in registers */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t out = 0; out < n; out++) {
            prefetch_ahead(codes, blocks * (BLOCK / 2), scale, minimum, blocks, out);
            __m256 accumulated = _mm256_setzero_ps();
            float from_minimum = 0.0f;
            const uint8_t *row_codes = codes + out * blocks * (BLOCK / 2);
            for (int64_t b = 0; b < blocks; b++) {
                __m128i packed = _mm_loadu_si128((const __m128i *)(row_codes + b * (BLOCK / 2)));
                __m128i low = _mm_and_si128(packed, low_nibbles);
                __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);
                const float *xs = x + b * BLOCK;
                __m256 dot = _mm256_mul_ps(bytes_to_floats(low, 0), _mm256_loadu_ps(xs));
                __m256 dot2 = _mm256_mul_ps(bytes_to_floats(_mm_srli_si128(low, 8), 0), _mm256_loadu_ps(xs + 8));
                dot = _mm256_fmadd_ps(bytes_to_floats(high, 0), _mm256_loadu_ps(xs + 16), dot);
                dot2 = _mm256_fmadd_ps(bytes_to_floats(_mm_srli_si128(high, 8), 0), _mm256_loadu_ps(xs + 24), dot2);
                accumulated = _mm256_fmadd_ps(_mm256_add_ps(dot, dot2), _mm256_set1_ps(scale[out * blocks + b]),
                                              accumulated);
                from_minimum += minimum[out * blocks + b] * block_sums[b];
            }
            y[out] = lane_sum(accumulated) + from_minimum;
        }
        free(block_sums);
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        __m256 accumulated[MAX_ROWS];
        float from_minimum[MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) { accumulated[r] = _mm256_setzero_ps(); from_minimum[r] = 0.0f; }
        for (int64_t b = 0; b < blocks; b++) {
            __m128i packed = _mm_loadu_si128((const __m128i *)(codes + (out * blocks + b) * (BLOCK / 2)));
            __m128i low = _mm_and_si128(packed, low_nibbles);                      /* elements 0..15 */
            __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles);  /* elements 16..31 */
            __m256 q0 = bytes_to_floats(low, 0), q1 = bytes_to_floats(_mm_srli_si128(low, 8), 0);
            __m256 q2 = bytes_to_floats(high, 0), q3 = bytes_to_floats(_mm_srli_si128(high, 8), 0);
            __m256 block_scale = _mm256_set1_ps(scale[out * blocks + b]);
            float block_minimum = minimum[out * blocks + b];
            for (int64_t r = 0; r < rows; r++) {
                __m256 dot = block_products(q0, q1, q2, q3, x + r * k + b * BLOCK);
                accumulated[r] = _mm256_fmadd_ps(dot, block_scale, accumulated[r]);
                from_minimum[r] += block_minimum * block_sums[r * blocks + b];
            }
        }
        for (int64_t r = 0; r < rows; r++) y[r * n + out] = lane_sum(accumulated[r]) + from_minimum[r];
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
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        if (rows == 1) prefetch_ahead(codes, blocks * BLOCK, scale, NULL, blocks, out);
        __m256 accumulated[MAX_ROWS];
        for (int64_t r = 0; r < rows; r++) accumulated[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *block = codes + (out * blocks + b) * BLOCK;
            __m256 q0 = bytes_to_floats(_mm_loadl_epi64((const __m128i *)block), 1);
            __m256 q1 = bytes_to_floats(_mm_loadl_epi64((const __m128i *)(block + 8)), 1);
            __m256 q2 = bytes_to_floats(_mm_loadl_epi64((const __m128i *)(block + 16)), 1);
            __m256 q3 = bytes_to_floats(_mm_loadl_epi64((const __m128i *)(block + 24)), 1);
            __m256 block_scale = _mm256_set1_ps(scale[out * blocks + b]);
            for (int64_t r = 0; r < rows; r++) {
                __m256 dot = block_products(q0, q1, q2, q3, x + r * k + b * BLOCK);
                accumulated[r] = _mm256_fmadd_ps(dot, block_scale, accumulated[r]);
            }
        }
        for (int64_t r = 0; r < rows; r++) y[r * n + out] = lane_sum(accumulated[r]);
    }
    return 0;
}
