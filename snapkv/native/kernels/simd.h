/* Helpers shared by snapkv's C kernels, written in vectors.h's vocabulary: e^x in 8 lanes, a softmax row, a
 * prefetch. */
#ifndef SNAPKV_SIMD_H
#define SNAPKV_SIMD_H

#include "kernels.h"
#include "vectors.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x's constants, one set for exp_4 and exp_8 (here) and exp_16 (tiles.h): x = n ln 2 + r, ln 2 in two parts (the
 * first exact in few bits, so n ln 2 is subtracted without rounding), then e^r = 1 + r + r^2 (P5 + r (P4 + ...));
 * 0 below EXP_LOWEST, where expf underflows. */
#define EXP_LOWEST (-87.3f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HIGH 0.693359375f
#define EXP_LN2_LOW (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

#if defined(SNAPKV_PORTABLE)
/* The generic build: gcc keeps a vector of 8 lanes in memory where the target's registers hold 4 (SSE2, NEON) and
 * writes its comparisons and roundings a lane at a time (on SSE2 a call of rintf per lane), so there exp_8 is made
 * of two exp_4 in vectors of 4 lanes: the same operations on every lane, so the same bits. */
typedef float lanes_4 __attribute__((vector_size(16)));
typedef int32_t words_4 __attribute__((vector_size(16)));

static inline lanes_4 splat_4(float x) { return (lanes_4){x, x, x, x}; }
static inline lanes_4 fma_4(lanes_4 a, lanes_4 b, lanes_4 c) {
    lanes_4 v;
    EACH_LANE(4) v[i] = PLAIN_FMA(a[i], b[i], c[i]);
    return v;
}
static inline lanes_4 select_4(words_4 mask, lanes_4 yes, lanes_4 no) {
    return (lanes_4)((mask & (words_4)yes) | (~mask & (words_4)no));
}

/* To the nearest whole number, ties to even (as f32x8_nearest): below 2^23 in size adding 2^23 and taking it away
 * rounds, the sign put back after (-0.3 gives -0); from 2^23 up a float is whole already. */
static inline lanes_4 nearest_4(lanes_4 a) {
    const words_4 sign_bit = {INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
    const lanes_4 magnitude = (lanes_4)((words_4)a & ~sign_bit), big = splat_4(8388608.0f);
    const lanes_4 rounded = (lanes_4)((words_4)((magnitude + big) - big) | ((words_4)a & sign_bit));
    return select_4((words_4)(magnitude < big), rounded, a);
}

/* exp_8's operations (below) on 4 lanes. */
static inline lanes_4 exp_4(lanes_4 x) {
    const lanes_4 lowest = splat_4(EXP_LOWEST);
    const words_4 underflow = (words_4)(x < lowest);
    x = plain_max4(x, lowest);
    const lanes_4 n = nearest_4(x * splat_4(EXP_LOG2E));
    lanes_4 r = fma_4(-n, splat_4(EXP_LN2_HIGH), x);
    r = fma_4(-n, splat_4(EXP_LN2_LOW), r);
    lanes_4 p = splat_4(EXP_P0);
    p = fma_4(p, r, splat_4(EXP_P1));
    p = fma_4(p, r, splat_4(EXP_P2));
    p = fma_4(p, r, splat_4(EXP_P3));
    p = fma_4(p, r, splat_4(EXP_P4));
    p = fma_4(p, r, splat_4(EXP_P5));
    p = fma_4(p, r * r, r + splat_4(1.0f));
    const words_4 two_to_n = (__builtin_convertvector(n, words_4) + 127) << 23;  /* n whole, -126..128 */
    return select_4(underflow, splat_4(0.0f), p * (lanes_4)two_to_n);
}

/* e^x for 8 lanes: exp_4 on each half. */
static inline f32x8 exp_8(f32x8 x) {
    lanes_4 low, high;
    memcpy(&low, &x, sizeof low);
    memcpy(&high, (char *)&x + sizeof low, sizeof high);
    low = exp_4(low);
    high = exp_4(high);
    memcpy(&x, &low, sizeof low);
    memcpy((char *)&x + sizeof low, &high, sizeof high);
    return x;
}
#else
/* e^x for 8 lanes (x = n ln 2 + r, then a polynomial in r); 0 below -87.3, where expf underflows. */
static inline f32x8 exp_8(f32x8 x) {
    const f32x8 lowest = f32x8_splat(EXP_LOWEST);
    const f32x8 underflow = f32x8_less(x, lowest);
    x = f32x8_max(x, lowest);
    const f32x8 n = f32x8_nearest(f32x8_mul(x, f32x8_splat(EXP_LOG2E)));
    f32x8 r = f32x8_fnma(n, f32x8_splat(EXP_LN2_HIGH), x);
    r = f32x8_fnma(n, f32x8_splat(EXP_LN2_LOW), r);
    f32x8 p = f32x8_splat(EXP_P0);
    p = f32x8_fma(p, r, f32x8_splat(EXP_P1));
    p = f32x8_fma(p, r, f32x8_splat(EXP_P2));
    p = f32x8_fma(p, r, f32x8_splat(EXP_P3));
    p = f32x8_fma(p, r, f32x8_splat(EXP_P4));
    p = f32x8_fma(p, r, f32x8_splat(EXP_P5));
    p = f32x8_fma(p, f32x8_mul(r, r), f32x8_add(r, f32x8_splat(1.0f)));
    const i32x8 two_to_n = i32x8_shift_left(i32x8_add(i32x8_nearest_of(n), i32x8_splat(127)), 23);
    return f32x8_zero_where(underflow, f32x8_mul(p, i32x8_as_floats(two_to_n)));
}
#endif

/* Asks for the cache lines of [start, start + bytes) to be loaded (a hint: never faults, even past an end).
 * Always inlined: a call of it that GCC does not inline is found to have no effect and dropped. */
__attribute__((always_inline)) static inline void prefetch_bytes(const void *start, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch((const char *)start + line, 0, 3);
}

#if defined(SNAPKV_PORTABLE)
/* row_maximum and row_exponentials (below) in the generic build: each vector of 8 as two lanes_4, low and high
 * half, in the same operations and order (f32x8_largest's and f32x8_sum's), so the same results. */
static inline float row_maximum(const float *row, int64_t count) {
    lanes_4 low = splat_4(-INFINITY), high = low, next;
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
        memcpy(&next, row + j, sizeof next);
        low = plain_max4(low, next);
        memcpy(&next, row + j + 4, sizeof next);
        high = plain_max4(high, next);
    }
    f32x8 both;
    memcpy(&both, &low, sizeof low);
    memcpy((char *)&both + sizeof low, &high, sizeof high);
    float top = f32x8_largest(both);
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
    f32x8 totals;
    memcpy(&totals, &low_total, sizeof low_total);
    memcpy((char *)&totals + sizeof low_total, &high_total, sizeof high_total);
    float sum = f32x8_sum(totals);
    for (; j < tokens; j++) {
        row[j] = expf(row[j] - top);
        sum += row[j];
    }
    return sum;
}
#else
/* The largest of row[0..count): vectors of 8 then the rest (a maximum is exact: any order gives the same). */
static inline float row_maximum(const float *row, int64_t count) {
    f32x8 high = f32x8_splat(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) high = f32x8_max(high, f32x8_load(row + j));
    float top = f32x8_largest(high);
    for (; j < count; j++) top = row[j] > top ? row[j] : top;
    return top;
}

/* In place: row[j] = e^(row[j] - top); returns their sum (8 lanes, then the rest in order). */
static inline float row_exponentials(float *row, int64_t tokens, float top) {
    const f32x8 shift = f32x8_splat(top);
    f32x8 total = f32x8_zero();
    int64_t j = 0;
    for (; j + 8 <= tokens; j += 8) {
        const f32x8 e = exp_8(f32x8_sub(f32x8_load(row + j), shift));
        f32x8_store(row + j, e);
        total = f32x8_add(total, e);
    }
    float sum = f32x8_sum(total);
    for (; j < tokens; j++) {
        row[j] = expf(row[j] - top);
        sum += row[j];
    }
    return sum;
}
#endif

/* A 4-bit block's 32 codes (blockwise_matmul.c's layout: element j in the low 4 bits of byte j, element j + 16 in
 * its high 4) as int32 lanes: q[0] elements 0..7, q[1] 8..15, q[2] 16..23, q[3] 24..31. With the CPU's own
 * instructions each 8 bytes are widened once and their nibbles taken apart in 32-bit lanes: two widenings where
 * taking the nibbles apart as bytes first needs four and two moves (the AVX2 build's one-row product 1.16x faster).
 * In plain C the bytes' nibbles are taken apart first: gcc keeps that form in SSE2 registers, the other in memory
 * (1.24x slower). The same codes either way. */
static inline void block_4bit_codes(const uint8_t *packed, i32x8 q[4]) {
#if defined(SNAPKV_PORTABLE)
    const u8x16 bytes = u8x16_load(packed);
    const u8x16 low = u8x16_low_nibbles(bytes), high = u8x16_high_nibbles(bytes);
    q[0] = i32x8_from_u8(low);
    q[1] = i32x8_from_u8(u8x16_high_half(low));
    q[2] = i32x8_from_u8(high);
    q[3] = i32x8_from_u8(u8x16_high_half(high));
#else
    const i32x8 first = i32x8_from_u8(u8x16_load8(packed)), second = i32x8_from_u8(u8x16_load8(packed + 8));
    const i32x8 low_four = i32x8_splat(0x0F);
    q[0] = i32x8_and(first, low_four);
    q[1] = i32x8_and(second, low_four);
    q[2] = i32x8_shift_right(first, 4);  /* a byte's high 4 bits: nothing above them in its lane */
    q[3] = i32x8_shift_right(second, 4);
#endif
}

/* One row of scores in place: the last `question` columns get tail_mask added (question 0: none), then the
 * softmax. */
static inline void softmax_row(float *row, int64_t tokens, const float *tail_mask, int64_t question) {
    for (int64_t j = 0; j < question; j++) row[tokens - question + j] += tail_mask[j];
    const float inverse = 1.0f / row_exponentials(row, tokens, row_maximum(row, tokens));
    const f32x8 vector_inverse = f32x8_splat(inverse);
    int64_t j = 0;
    for (; j + 8 <= tokens; j += 8) f32x8_store(row + j, f32x8_mul(f32x8_load(row + j), vector_inverse));
    for (; j < tokens; j++) row[j] *= inverse;
}

#endif
