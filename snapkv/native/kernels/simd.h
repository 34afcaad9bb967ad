/* SIMD helpers shared by snapkv's C kernels (written in AVX2 and FMA intrinsics; vectors.h says what they are in each
 * variant): a transpose, lane reductions, exp and a softmax row. */
#ifndef SNAPKV_SIMD_H
#define SNAPKV_SIMD_H

#include "kernels.h"
#include "vectors.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The 16-lane functions: compiled for AVX-512 in the avx512 variant, called only where wide_vectors(-1)
 * (snapkv/native/kernels/blockwise_matmul.c) says the CPU has it; plain C in the others (vectors.h). */
#if SNAPKV_WIDE_EMULATED
#define WIDE
#elif defined(__clang__) && __clang_major__ >= 18  /* clang 18 splits the 512-bit registers out as evex512 */
#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,evex512")))
#else
#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#endif

#if defined(SNAPKV_PORTABLE)
/* The generic build: gcc keeps a vector of 8 lanes in memory where the target's registers hold 4 (SSE2, NEON) and
 * writes its comparisons and roundings a lane at a time (on SSE2 a call of rintf per lane), so there exp_8 is made
 * of two exp_4 in vectors of 4 lanes, and transpose_8x8 of plain loads and stores: the same operations on every
 * lane, so the same bits. */
typedef float lanes_4 __attribute__((vector_size(16)));
typedef int32_t words_4 __attribute__((vector_size(16)));

static inline lanes_4 splat_4(float x) { return (lanes_4){x, x, x, x}; }
static inline lanes_4 fma_4(lanes_4 a, lanes_4 b, lanes_4 c) {
    lanes_4 v;
    PV_LANES(4) v[i] = PV_FMA(a[i], b[i], c[i]);
    return v;
}
static inline lanes_4 select_4(words_4 mask, lanes_4 yes, lanes_4 no) {
    return (lanes_4)((mask & (words_4)yes) | (~mask & (words_4)no));
}

/* To the nearest whole number, ties to even (as _mm256_round_ps asked for nearest): below 2^23 in size adding 2^23
 * and taking it away rounds, the sign put back after (-0.3 gives -0); from 2^23 up a float is whole already. */
static inline lanes_4 nearest_4(lanes_4 a) {
    const words_4 sign_bit = {INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
    const lanes_4 magnitude = (lanes_4)((words_4)a & ~sign_bit), big = splat_4(8388608.0f);
    const lanes_4 rounded = (lanes_4)((words_4)((magnitude + big) - big) | ((words_4)a & sign_bit));
    return select_4((words_4)(magnitude < big), rounded, a);
}

/* exp_8's operations (below) on 4 lanes. */
static inline lanes_4 exp_4(lanes_4 x) {
    const lanes_4 lowest = splat_4(-87.3f);
    const words_4 underflow = (words_4)(x < lowest);
    x = _mm_max_ps(x, lowest);  /* portable_vectors.h's, on the 4 lanes */
    const lanes_4 n = nearest_4(x * splat_4(1.44269504088896341f));
    lanes_4 r = fma_4(-n, splat_4(0.693359375f), x);
    r = fma_4(-n, splat_4(-2.12194440e-4f), r);
    lanes_4 p = splat_4(1.9875691500e-4f);
    p = fma_4(p, r, splat_4(1.3981999507e-3f));
    p = fma_4(p, r, splat_4(8.3334519073e-3f));
    p = fma_4(p, r, splat_4(4.1665795894e-2f));
    p = fma_4(p, r, splat_4(1.6666665459e-1f));
    p = fma_4(p, r, splat_4(5.0000001201e-1f));
    p = fma_4(p, r * r, r + splat_4(1.0f));
    const words_4 two_to_n = (__builtin_convertvector(n, words_4) + 127) << 23;  /* n whole, -126..128 */
    return select_4(underflow, splat_4(0.0f), p * (lanes_4)two_to_n);
}

/* e^x for 8 lanes: exp_4 on each half. */
static inline __m256 exp_8(__m256 x) {
    lanes_4 low, high;
    memcpy(&low, &x, sizeof low);
    memcpy(&high, (char *)&x + sizeof low, sizeof high);
    low = exp_4(low);
    high = exp_4(high);
    memcpy(&x, &low, sizeof low);
    memcpy((char *)&x + sizeof low, &high, sizeof high);
    return x;
}

/* dst[c * dst_stride + j] = src[j * src_stride + c] for an 8 x 8 block: four 4 x 4 blocks, each by two rounds of
 * shuffles (SSE2's unpack and move-half, NEON's zip), where the compiler has shufflevector; else plain loops. */
static inline void transpose_8x8(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
    for (int j = 0; j < 8; j += 4)
        for (int c = 0; c < 8; c += 4) {
            lanes_4 r[4];  /* rows j..j + 3 of the source, columns c..c + 3 */
            for (int i = 0; i < 4; i++) memcpy(&r[i], src + (j + i) * src_stride + c, sizeof r[i]);
            const lanes_4 t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5),
                          t1 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7),
                          t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5),
                          t3 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
            const lanes_4 columns[4] = {__builtin_shufflevector(t0, t2, 0, 1, 4, 5),
                                        __builtin_shufflevector(t0, t2, 2, 3, 6, 7),
                                        __builtin_shufflevector(t1, t3, 0, 1, 4, 5),
                                        __builtin_shufflevector(t1, t3, 2, 3, 6, 7)};
            for (int i = 0; i < 4; i++) memcpy(dst + (c + i) * dst_stride + j, &columns[i], sizeof columns[i]);
        }
#else
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < 8; j++) dst[c * dst_stride + j] = src[j * src_stride + c];
#endif
}
#else
/* dst[c * dst_stride + j] = src[j * src_stride + c] for an 8 x 8 block. */
static inline void transpose_8x8(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

#endif

/* 8 bf16 values as the 8 fp32 values they are. */
static inline __m256 bf16_as_floats(const uint16_t *p) {
#if defined(SNAPKV_PORTABLE)
    uint32_t bits[8];
    for (int i = 0; i < 8; i++) bits[i] = (uint32_t)p[i] << 16;
    __m256 v;
    memcpy(&v, bits, sizeof v);
    return v;
#else
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#endif
}

/* Asks for the cache lines of [start, start + bytes) to be loaded (a hint: never faults, even past an end).
 * Always inlined: a call of it that GCC does not inline is found to have no effect and dropped. */
__attribute__((always_inline)) static inline void prefetch_bytes(const void *start, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char *)start + line, _MM_HINT_T0);
}

#if !defined(SNAPKV_PORTABLE)
/* e^x for 8 lanes (x = n ln 2 + r, then a polynomial in r); 0 below -87.3, where expf underflows. */
static inline __m256 exp_8(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(-87.3f);
    const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lowest);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n)));
}
#endif

static inline float largest_lane(__m256 v) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

static inline float lane_sum(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

#if defined(SNAPKV_PORTABLE)
/* row_maximum and row_exponentials (below) in the generic build: each vector of 8 as two lanes_4, low and high
 * half, in the same operations and order (largest_lane and lane_sum's), so the same results. */
static inline float row_maximum(const float *row, int64_t count) {
    lanes_4 low = splat_4(-INFINITY), high = low, next;
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
        memcpy(&next, row + j, sizeof next);
        low = _mm_max_ps(low, next);
        memcpy(&next, row + j + 4, sizeof next);
        high = _mm_max_ps(high, next);
    }
    __m128 half = _mm_max_ps(low, high);
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    float top = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
    for (; j < count; j++) top = row[j] > top ? row[j] : top;
    return top;
}

static inline float row_exponentials(float *row, int64_t tokens, float top) {
    const lanes_4 shift = splat_4(top);
    lanes_4 low_total = splat_4(0.0f), high_total = low_total, low, high;
    int64_t j = 0;
    for (; j + 8 <= tokens; j += 8) {
        memcpy(&low, row + j, sizeof low);
        memcpy(&high, row + j + 4, sizeof high);
        low = exp_4(low - shift);
        high = exp_4(high - shift);
        memcpy(row + j, &low, sizeof low);
        memcpy(row + j + 4, &high, sizeof high);
        low_total += low;
        high_total += high;
    }
    __m128 half = low_total + high_total;
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    float sum = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
    for (; j < tokens; j++) {
        row[j] = expf(row[j] - top);
        sum += row[j];
    }
    return sum;
}
#else
/* The largest of row[0..count): vectors of 8 then the rest (a maximum is exact: any order gives the same). */
static inline float row_maximum(const float *row, int64_t count) {
    __m256 high = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) high = _mm256_max_ps(high, _mm256_loadu_ps(row + j));
    float top = largest_lane(high);
    for (; j < count; j++) top = row[j] > top ? row[j] : top;
    return top;
}

/* In place: row[j] = e^(row[j] - top); returns their sum (8 lanes, then the rest in order). */
static inline float row_exponentials(float *row, int64_t tokens, float top) {
    const __m256 shift = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= tokens; j += 8) {
        const __m256 e = exp_8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
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

#endif

/* One row of scores in place: the last `question` columns get tail_mask added (question 0: none), then the
 * softmax. */
static inline void softmax_row(float *row, int64_t tokens, const float *tail_mask, int64_t question) {
    for (int64_t j = 0; j < question; j++) row[tokens - question + j] += tail_mask[j];
    const float inverse = 1.0f / row_exponentials(row, tokens, row_maximum(row, tokens));
    const __m256 vector_inverse = _mm256_set1_ps(inverse);
    int64_t j = 0;
    for (; j + 8 <= tokens; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), vector_inverse));
    for (; j < tokens; j++) row[j] *= inverse;
}

#endif
