/* The 8-lane vocabulary (vectors.h) in the CPU's own AVX2, FMA and F16C instructions: the avx512 and avx2 builds.
 * Each name does what lanes8_plain.h's does, lane by lane, so the two give the same bits. */
#ifndef SNAPKV_LANES8_X86_H
#define SNAPKV_LANES8_X86_H

#include <immintrin.h>
#include <stdint.h>

#define LANES8 static inline __attribute__((always_inline))  /* as the intrinsics themselves */
#define LANES8_COMPOSITE static inline                          /* a few instructions: inlined as gcc sees fit */

typedef __m256 f32x8;   /* 8 floats */
typedef __m256i i32x8;  /* 8 int32 */
typedef __m128i u8x16;  /* 16 bytes */

/* ---- 8 floats ---- */
LANES8 f32x8 f32x8_zero(void) { return _mm256_setzero_ps(); }
LANES8 f32x8 f32x8_splat(float x) { return _mm256_set1_ps(x); }
LANES8 f32x8 f32x8_splat_at(const float *p) { return _mm256_broadcast_ss(p); }
LANES8 f32x8 f32x8_of(float e0, float e1, float e2, float e3, float e4, float e5, float e6, float e7) {
    return _mm256_setr_ps(e0, e1, e2, e3, e4, e5, e6, e7);
}
LANES8 f32x8 f32x8_load(const float *p) { return _mm256_loadu_ps(p); }
LANES8 void f32x8_store(float *p, f32x8 v) { _mm256_storeu_ps(p, v); }
LANES8 f32x8 f32x8_add(f32x8 a, f32x8 b) { return _mm256_add_ps(a, b); }
LANES8 f32x8 f32x8_sub(f32x8 a, f32x8 b) { return _mm256_sub_ps(a, b); }
LANES8 f32x8 f32x8_mul(f32x8 a, f32x8 b) { return _mm256_mul_ps(a, b); }
LANES8 f32x8 f32x8_div(f32x8 a, f32x8 b) { return _mm256_div_ps(a, b); }
LANES8 f32x8 f32x8_max(f32x8 a, f32x8 b) { return _mm256_max_ps(a, b); }  /* b where either is NaN */
LANES8 f32x8 f32x8_min(f32x8 a, f32x8 b) { return _mm256_min_ps(a, b); }  /* b where either is NaN */
LANES8 f32x8 f32x8_fma(f32x8 a, f32x8 b, f32x8 c) { return _mm256_fmadd_ps(a, b, c); }     /* a * b + c, rounded once */
LANES8 f32x8 f32x8_fnma(f32x8 a, f32x8 b, f32x8 c) { return _mm256_fnmadd_ps(a, b, c); }   /* c - a * b, rounded once */
LANES8 f32x8 f32x8_nearest(f32x8 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
LANES8 f32x8 f32x8_less(f32x8 a, f32x8 b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }  /* all ones where a < b */
LANES8 f32x8 f32x8_zero_where(f32x8 mask, f32x8 v) { return _mm256_andnot_ps(mask, v); }
/* Pairs of lanes swapped (1 0 3 2 ...), pairs of pairs within each half (2 3 0 1 ...), the halves (4..7 0..3). */
LANES8 f32x8 f32x8_swap_adjacent(f32x8 v) { return _mm256_permute_ps(v, 0xB1); }
LANES8 f32x8 f32x8_swap_pairs(f32x8 v) { return _mm256_permute_ps(v, 0x4E); }
LANES8 f32x8 f32x8_swap_halves(f32x8 v) { return _mm256_permute2f128_ps(v, v, 1); }

/* The sum of the lanes: halves added, then their halves, then the last two. */
LANES8_COMPOSITE float f32x8_sum(f32x8 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

/* The largest lane (a maximum is exact: any order gives the same). */
LANES8_COMPOSITE float f32x8_largest(f32x8 v) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

/* Lane i = the sum of vector i's lanes, for 8 vectors: pairs added (a0 + a1, a2 + a3 of each), pairs of pairs, then
 * the halves. */
LANES8_COMPOSITE f32x8 f32x8_sums_of_eight(f32x8 a0, f32x8 a1, f32x8 a2, f32x8 a3, f32x8 a4, f32x8 a5, f32x8 a6, f32x8 a7) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* 8 bf16 values as the 8 fp32 values they are (their 16 bits, then 16 zero bits). */
LANES8_COMPOSITE f32x8 f32x8_from_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* dst[c * dst_stride + j] = src[j * src_stride + c] for an 8 x 8 block. */
LANES8_COMPOSITE void f32x8_transpose(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
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

/* ---- 8 int32 ---- */
LANES8 i32x8 i32x8_splat(int32_t x) { return _mm256_set1_epi32(x); }
LANES8 i32x8 i32x8_of(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7) {
    return _mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7);
}
LANES8 i32x8 i32x8_add(i32x8 a, i32x8 b) { return _mm256_add_epi32(a, b); }
LANES8 i32x8 i32x8_and(i32x8 a, i32x8 b) { return _mm256_and_si256(a, b); }
LANES8 i32x8 i32x8_shift_left(i32x8 a, int count) { return _mm256_slli_epi32(a, count); }  /* count 0..31 */
LANES8 i32x8 i32x8_shift_right(i32x8 a, int count) { return _mm256_srli_epi32(a, count); }  /* logical, 0..31 */
/* Each lane shifted right (logical) by its own count. */
LANES8 i32x8 i32x8_shift_right_each(i32x8 a, i32x8 counts) { return _mm256_srlv_epi32(a, counts); }
LANES8 f32x8 i32x8_to_floats(i32x8 a) { return _mm256_cvtepi32_ps(a); }
LANES8 f32x8 i32x8_as_floats(i32x8 a) { return _mm256_castsi256_ps(a); }  /* the same bits */
LANES8 i32x8 i32x8_nearest_of(f32x8 a) { return _mm256_cvtps_epi32(a); }  /* to nearest, ties to even */
/* The low 8 of 16 bytes, each widened to an int32: unsigned, or signed. */
LANES8 i32x8 i32x8_from_u8(u8x16 bytes) { return _mm256_cvtepu8_epi32(bytes); }
LANES8 i32x8 i32x8_from_i8(u8x16 bytes) { return _mm256_cvtepi8_epi32(bytes); }

/* ---- 16 bytes ---- */
LANES8 u8x16 u8x16_load(const void *p) { return _mm_loadu_si128((const __m128i *)p); }
LANES8 u8x16 u8x16_load8(const void *p) { return _mm_loadl_epi64((const __m128i *)p); }  /* 8 bytes, zeros above */
/* Each byte's low or high 4 bits, as a byte 0..15. */
LANES8 u8x16 u8x16_low_nibbles(u8x16 bytes) { return _mm_and_si128(bytes, _mm_set1_epi8(0x0F)); }
LANES8 u8x16 u8x16_high_nibbles(u8x16 bytes) { return _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F)); }
/* Bytes 8..15 moved down, zeros above. */
LANES8 u8x16 u8x16_high_half(u8x16 bytes) { return _mm_srli_si128(bytes, 8); }

/* ---- one value ---- */
LANES8 float half_to_float(uint16_t half) { return _cvtsh_ss(half); }  /* IEEE binary16 bits, exactly */

#endif
