/* The 8-lane vocabulary (vectors.h) in plain C with the vector extensions of GCC and clang: the generic build (arm64,
 * an x86-64 CPU without AVX2), where the compiler turns each into the vector instructions its target has (NEON,
 * SSE2, ...). Each name does what lanes8_x86.h's does, lane by lane (a fused multiply-add where the target has one,
 * else a product then a sum), so the builds give the same bits; on x86-64 bytes are widened with SSE2, its baseline. */
#ifndef SNAPKV_LANES8_PLAIN_H
#define SNAPKV_LANES8_PLAIN_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "plain_lanes.h"
#define LANES8 static inline
#define LANES8_COMPOSITE static inline

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint32_t plain_words8 __attribute__((vector_size(32)));
typedef uint16_t plain_halves8 __attribute__((vector_size(16)));
typedef uint64_t plain_words2 __attribute__((vector_size(16)));
typedef float plain_floats4 __attribute__((vector_size(16)));
typedef int32_t plain_ints4 __attribute__((vector_size(16)));

#if defined(__SSE2__)
/* x86-64's baseline, SSE2: bytes widened to 32-bit lanes and made floats by its shift, unpack and convert
 * instructions (gcc writes the lane-by-lane versions below as a scalar conversion per byte). */
#include <emmintrin.h>
#define PLAIN_SSE2 1
static inline i32x8 plain_sse2_widen(u8x16 bytes16, int is_signed) {
    const __m128i bytes = (__m128i)bytes16;
    __m128i words, low, high;
    if (is_signed) {
        words = _mm_srai_epi16(_mm_unpacklo_epi8(bytes, bytes), 8);  /* each byte in the high half, shifted down */
        low = _mm_srai_epi32(_mm_unpacklo_epi16(words, words), 16);
        high = _mm_srai_epi32(_mm_unpackhi_epi16(words, words), 16);
    } else {
        const __m128i zero = _mm_setzero_si128();
        words = _mm_unpacklo_epi8(bytes, zero);
        low = _mm_unpacklo_epi16(words, zero);
        high = _mm_unpackhi_epi16(words, zero);
    }
    /* the halves joined and split by memcpy: gcc 12 rebuilt a shufflevector's identity halves lane by lane (ten
     * shuffles per 4 lanes), which made the generic build's products 1.9x slower */
    i32x8 joined;
    memcpy(&joined, &low, 16);
    memcpy((char *)&joined + 16, &high, 16);
    return joined;
}
static inline f32x8 plain_sse2_floats(i32x8 words) {
    __m128i halves[2];
    memcpy(halves, &words, 32);
    const __m128 floats[2] = {_mm_cvtepi32_ps(halves[0]), _mm_cvtepi32_ps(halves[1])};
    f32x8 joined;
    memcpy(&joined, floats, 32);
    return joined;
}
#endif
#ifndef PLAIN_SSE2
#define PLAIN_SSE2 0
#endif

/* 4 lanes: b where a > b does not hold (b where either is NaN), as a mask on a comparison (gcc writes the
 * lane-by-lane form as a scalar comparison per lane). */
static inline plain_floats4 plain_max4(plain_floats4 a, plain_floats4 b) {
    const plain_ints4 greater = (plain_ints4)(a > b);
    return (plain_floats4)((greater & (plain_ints4)a) | (~greater & (plain_ints4)b));
}

/* ---- 8 floats ---- */
LANES8 f32x8 f32x8_zero(void) { return (f32x8){0}; }
LANES8 f32x8 f32x8_splat(float x) { f32x8 v; EACH_LANE(8) v[i] = x; return v; }
LANES8 f32x8 f32x8_splat_at(const float *p) { return f32x8_splat(*p); }
LANES8 f32x8 f32x8_of(float e0, float e1, float e2, float e3, float e4, float e5, float e6, float e7) {
    return (f32x8){e0, e1, e2, e3, e4, e5, e6, e7};
}
LANES8 f32x8 f32x8_load(const float *p) { f32x8 v; memcpy(&v, p, 32); return v; }
LANES8 void f32x8_store(float *p, f32x8 v) { memcpy(p, &v, 32); }
LANES8 f32x8 f32x8_add(f32x8 a, f32x8 b) { return a + b; }
LANES8 f32x8 f32x8_sub(f32x8 a, f32x8 b) { return a - b; }
LANES8 f32x8 f32x8_mul(f32x8 a, f32x8 b) { return a * b; }
LANES8 f32x8 f32x8_div(f32x8 a, f32x8 b) { return a / b; }
LANES8 f32x8 f32x8_max(f32x8 a, f32x8 b) {  /* plain_max4 on each half */
    plain_floats4 halves_a[2], halves_b[2];
    memcpy(halves_a, &a, sizeof a);
    memcpy(halves_b, &b, sizeof b);
    for (int half = 0; half < 2; half++) halves_a[half] = plain_max4(halves_a[half], halves_b[half]);
    memcpy(&a, halves_a, sizeof a);
    return a;
}
LANES8 f32x8 f32x8_min(f32x8 a, f32x8 b) { f32x8 v; EACH_LANE(8) v[i] = a[i] < b[i] ? a[i] : b[i]; return v; }
LANES8 f32x8 f32x8_fma(f32x8 a, f32x8 b, f32x8 c) {
#if PLAIN_HAS_FMA
    f32x8 v;
    EACH_LANE(8) v[i] = PLAIN_FMA(a[i], b[i], c[i]);
    return v;
#else  /* whole vectors, the same product then sum: gcc 12 made the lane-by-lane form's sums a lane at a time */
    return a * b + c;
#endif
}
LANES8 f32x8 f32x8_fnma(f32x8 a, f32x8 b, f32x8 c) {
#if PLAIN_HAS_FMA
    f32x8 v;
    EACH_LANE(8) v[i] = PLAIN_FMA(-a[i], b[i], c[i]);
    return v;
#else  /* whole vectors, the same product then sum: gcc 12 made the lane-by-lane form's sums a lane at a time */
    return -a * b + c;
#endif
}
LANES8 f32x8 f32x8_nearest(f32x8 a) { f32x8 v; EACH_LANE(8) v[i] = rintf(a[i]); return v; }  /* ties to even */
LANES8 f32x8 f32x8_less(f32x8 a, f32x8 b) { return (f32x8)(a < b); }
LANES8 f32x8 f32x8_zero_where(f32x8 mask, f32x8 v) { return (f32x8)(~(i32x8)mask & (i32x8)v); }
LANES8 f32x8 f32x8_swap_adjacent(f32x8 v) { return (f32x8){v[1], v[0], v[3], v[2], v[5], v[4], v[7], v[6]}; }
LANES8 f32x8 f32x8_swap_pairs(f32x8 v) { return (f32x8){v[2], v[3], v[0], v[1], v[6], v[7], v[4], v[5]}; }
LANES8 f32x8 f32x8_swap_halves(f32x8 v) { return (f32x8){v[4], v[5], v[6], v[7], v[0], v[1], v[2], v[3]}; }

/* The lanes' sum and largest, in lanes8_x86.h's order: the halves, then their halves, then the last two. */
LANES8_COMPOSITE float f32x8_sum(f32x8 v) {
    plain_floats4 low, high;
    memcpy(&low, &v, sizeof low);
    memcpy(&high, (char *)&v + sizeof low, sizeof high);
    plain_floats4 half = low + high;
    half = half + (plain_floats4){half[2], half[3], half[2], half[3]};
    return half[0] + half[1];
}
LANES8_COMPOSITE float f32x8_largest(f32x8 v) {
    plain_floats4 low, high;
    memcpy(&low, &v, sizeof low);
    memcpy(&high, (char *)&v + sizeof low, sizeof high);
    plain_floats4 half = plain_max4(low, high);
    half = plain_max4(half, (plain_floats4){half[2], half[3], half[2], half[3]});
    return half[0] > half[1] ? half[0] : half[1];
}

/* Lane i = the sum of vector i's lanes, in lanes8_x86.h's order: within each half of 4, pairs then pairs of pairs;
 * then the halves. */
LANES8_COMPOSITE float plain_half_sum(f32x8 v, int half) {
    const int at = 4 * half;
    return (v[at] + v[at + 1]) + (v[at + 2] + v[at + 3]);
}
LANES8_COMPOSITE f32x8 f32x8_sums_of_eight(f32x8 a0, f32x8 a1, f32x8 a2, f32x8 a3, f32x8 a4, f32x8 a5, f32x8 a6, f32x8 a7) {
    const f32x8 a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    f32x8 v;
    EACH_LANE(8) v[i] = plain_half_sum(a[i], 0) + plain_half_sum(a[i], 1);
    return v;
}

LANES8_COMPOSITE f32x8 f32x8_from_bf16(const uint16_t *p) {
    uint32_t bits[8];
    for (int i = 0; i < 8; i++) bits[i] = (uint32_t)p[i] << 16;
    f32x8 v;
    memcpy(&v, bits, sizeof v);
    return v;
}

/* dst[c * dst_stride + j] = src[j * src_stride + c] for an 8 x 8 block: four 4 x 4 blocks, each by two rounds of
 * shuffles (SSE2's unpack and move-half, NEON's zip), where the compiler has shufflevector; else plain loops. */
LANES8_COMPOSITE void f32x8_transpose(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
    for (int j = 0; j < 8; j += 4)
        for (int c = 0; c < 8; c += 4) {
            plain_floats4 r[4];  /* rows j..j + 3 of the source, columns c..c + 3 */
            for (int i = 0; i < 4; i++) memcpy(&r[i], src + (j + i) * src_stride + c, sizeof r[i]);
            const plain_floats4 t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5),
                                t1 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7),
                                t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5),
                                t3 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
            const plain_floats4 columns[4] = {__builtin_shufflevector(t0, t2, 0, 1, 4, 5),
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

/* ---- 8 int32 ---- */
LANES8 i32x8 i32x8_splat(int32_t x) { i32x8 v; EACH_LANE(8) v[i] = x; return v; }
LANES8 i32x8 i32x8_of(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7) {
    return (i32x8){e0, e1, e2, e3, e4, e5, e6, e7};
}
LANES8 i32x8 i32x8_add(i32x8 a, i32x8 b) { return (i32x8)((plain_words8)a + (plain_words8)b); }
LANES8 i32x8 i32x8_and(i32x8 a, i32x8 b) { return a & b; }
LANES8 i32x8 i32x8_shift_left(i32x8 a, int count) { return (i32x8)((plain_words8)a << count); }
LANES8 i32x8 i32x8_shift_right(i32x8 a, int count) { return (i32x8)((plain_words8)a >> count); }  /* logical */
LANES8 i32x8 i32x8_shift_right_each(i32x8 a, i32x8 counts) {
    i32x8 v;
    EACH_LANE(8) v[i] = (uint32_t)counts[i] > 31 ? 0 : (int32_t)((uint32_t)a[i] >> counts[i]);
    return v;
}
LANES8 f32x8 i32x8_to_floats(i32x8 a) {
#if PLAIN_SSE2
    return plain_sse2_floats(a);
#else
    f32x8 v;
    EACH_LANE(8) v[i] = (float)a[i];
    return v;
#endif
}
LANES8 f32x8 i32x8_as_floats(i32x8 a) { return (f32x8)a; }
LANES8 i32x8 i32x8_nearest_of(f32x8 a) { i32x8 v; EACH_LANE(8) v[i] = (int32_t)rintf(a[i]); return v; }
LANES8 i32x8 i32x8_from_u8(u8x16 bytes) {
#if PLAIN_SSE2
    return plain_sse2_widen(bytes, 0);
#else
    i32x8 v;
    EACH_LANE(8) v[i] = bytes[i];
    return v;
#endif
}
LANES8 i32x8 i32x8_from_i8(u8x16 bytes) {
#if PLAIN_SSE2
    return plain_sse2_widen(bytes, 1);
#else
    i32x8 v;
    EACH_LANE(8) v[i] = (int8_t)bytes[i];
    return v;
#endif
}

/* ---- 16 bytes ---- */
LANES8 u8x16 u8x16_load(const void *p) { u8x16 v; memcpy(&v, p, 16); return v; }
LANES8 u8x16 u8x16_load8(const void *p) {  /* as two 64-bit lanes: gcc fills a vector of bytes a byte at a time */
    uint64_t low;
    memcpy(&low, p, sizeof low);
    return (u8x16)(plain_words2){low, 0};
}
LANES8 u8x16 u8x16_low_nibbles(u8x16 bytes) { return bytes & 0x0F; }
LANES8 u8x16 u8x16_high_nibbles(u8x16 bytes) { return (u8x16)((plain_halves8)bytes >> 4) & 0x0F; }
LANES8 u8x16 u8x16_high_half(u8x16 bytes) {
#if PLAIN_SSE2
    return (u8x16)_mm_srli_si128((__m128i)bytes, 8);
#else
    u8x16 v = {0};
    EACH_LANE(8) v[i] = bytes[i + 8];
    return v;
#endif
}

/* ---- one value ---- */
/* IEEE half (binary16) bits to a float, exactly (subnormals, infinities and NaNs included). */
LANES8 float half_to_float(uint16_t half) {
    const uint32_t sign = (uint32_t)(half & 0x8000) << 16, exponent = (half >> 10) & 0x1F, mantissa = half & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) {  /* subnormal: normalised */
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400)) m <<= 1, shift++;
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

#endif
