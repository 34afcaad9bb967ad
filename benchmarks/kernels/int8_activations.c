/* A candidate, measured by benchmarks/decode.py int8, not part of snapkv: it changes the arithmetic, so it would
 * need the needle grid to stay equal before the library could use it.
 *
 * One row of activations times 4/8-bit weight blocks with the activations rounded to 8 bits per block of 32, as
 * llama.cpp multiplies a GGUF's Q4_1 and Q8_0 matrices on a CPU (against Q8_1 / Q8_0 activations):
 *   x's block b -> codes xq (int8) and a scale xs = max |x| / 127 (xq = round(x / xs));
 *   y[o] = sum over blocks of  scale[o, b] * xs[b] * (q . xq)  +  minimum[o, b] * sum(x's block b)
 * q . xq is an exact integer product (_mm256_maddubs_epi16: unsigned 4-bit or |8-bit| codes times signed 8-bit
 * activations, pairs added in 16 bits without overflow: at most 2 * 127 * 127), the minimum's share uses x's exact
 * fp32 sums. The only rounding beyond fp32's is x's to 8 bits: about 0.4% of a block's largest |x| per value.
 * Layouts as in blockwise_matmul.c. Output rows are spread over `threads` OpenMP threads. Needs AVX2 and FMA. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"  /* with vectors.h: f32x8_sum, the lanes' sum */

#define BLOCK 32

/* x (k) -> xq (k) int8, xs (k / 32) scales, sums (k / 32) exact fp32 sums of each block. */
static void round_activations(const float *x, int64_t k, int8_t *xq, float *xs, float *sums) {
    for (int64_t b = 0; b < k / BLOCK; b++) {
        const float *block = x + b * BLOCK;
        float largest = 0.0f, total = 0.0f;
        for (int j = 0; j < BLOCK; j++) {
            largest = fabsf(block[j]) > largest ? fabsf(block[j]) : largest;
            total += block[j];
        }
        const float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        for (int j = 0; j < BLOCK; j++) xq[b * BLOCK + j] = (int8_t)lrintf(block[j] * inverse);
        xs[b] = scale;
        sums[b] = total;
    }
}

typedef struct {
    int8_t *codes;       /* (k) */
    float *scales, *sums; /* (k / 32) */
} rounded_row;

static void free_row(rounded_row *row) {
    free(row->codes), free(row->scales), free(row->sums);
}

/* row = x rounded to 8 bits per block (round_activations); 0, or -1 when memory runs out. */
static int round_row(const float *x, int64_t k, rounded_row *row) {
    row->codes = malloc((size_t)k);
    row->scales = malloc(sizeof(float) * (size_t)(k / BLOCK));
    row->sums = malloc(sizeof(float) * (size_t)(k / BLOCK));
    if (!row->codes || !row->scales || !row->sums) {
        free_row(row);
        return -1;
    }
    round_activations(x, k, row->codes, row->scales, row->sums);
    return 0;
}

/* The 8 lanes of 16 pairs of 16-bit products, added pairwise into 32-bit integers, as floats. */
static inline __m256 pair_sums(__m256i products) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(products, _mm256_set1_epi16(1)));
}

/* Returns 0, or -1 when k is not a multiple of 32 or memory runs out. */
int matmul_4bit_int8(const float *x, int64_t k, const uint8_t *codes, const float *scale, const float *minimum,
                     int64_t n, float *y, int threads) {
    if (k % BLOCK || k < BLOCK) return -1;
    const int64_t blocks = k / BLOCK;
    rounded_row row;
    if (round_row(x, k, &row)) return -1;
    const int8_t *xq = row.codes;
    const float *xs = row.scales, *sums = row.sums;
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        const uint8_t *row_codes = codes + out * blocks * (BLOCK / 2);
        const float *row_scale = scale + out * blocks, *row_minimum = minimum + out * blocks;
        __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();  /* two chains: blocks 0, 2, .. and 1, 3, .. */
        float from_minimum = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const __m128i packed = _mm_loadu_si128((const __m128i *)(row_codes + b * (BLOCK / 2)));
            const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low_nibbles),
                                               _mm_and_si128(packed, low_nibbles));  /* elements 0..15, 16..31 */
            const __m256i products = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK)));
            const __m256 block_scale = _mm256_set1_ps(row_scale[b] * xs[b]);
            if (b & 1)
                odd = _mm256_fmadd_ps(pair_sums(products), block_scale, odd);
            else
                even = _mm256_fmadd_ps(pair_sums(products), block_scale, even);
            from_minimum += row_minimum[b] * sums[b];
        }
        y[out] = f32x8_sum(_mm256_add_ps(even, odd)) + from_minimum;
    }
    free_row(&row);
    return 0;
}

/* Returns 0, or -1 when k is not a multiple of 32 or memory runs out. */
int matmul_8bit_int8(const float *x, int64_t k, const int8_t *codes, const float *scale, int64_t n, float *y,
                     int threads) {
    if (k % BLOCK || k < BLOCK) return -1;
    const int64_t blocks = k / BLOCK;
    rounded_row row;
    if (round_row(x, k, &row)) return -1;
    const int8_t *xq = row.codes;
    const float *xs = row.scales;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t out = 0; out < n; out++) {
        const int8_t *row_codes = codes + out * k;
        const float *row_scale = scale + out * blocks;
        __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(row_codes + b * BLOCK));
            const __m256i a = _mm256_loadu_si256((const __m256i *)(xq + b * BLOCK));
            /* |w| (unsigned) times a with w's sign: the same products, in the form maddubs takes */
            const __m256i products = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
            const __m256 block_scale = _mm256_set1_ps(row_scale[b] * xs[b]);
            if (b & 1)
                odd = _mm256_fmadd_ps(pair_sums(products), block_scale, odd);
            else
                even = _mm256_fmadd_ps(pair_sums(products), block_scale, even);
        }
        y[out] = f32x8_sum(_mm256_add_ps(even, odd));
    }
    free_row(&row);
    return 0;
}
