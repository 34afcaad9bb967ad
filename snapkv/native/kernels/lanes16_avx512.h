/* The 16-lane vocabulary (vectors.h) in the CPU's own AVX-512 (F, BW, VL, DQ) instructions: the avx512 build. Each
 * function carries that target itself (WIDE: the rest of the build is AVX2), and is called only from WIDE functions,
 * which run only where wide_vectors() says the CPU has it. Each name does what lanes16_plain.h's does, lane by lane,
 * so the two give the same bits. */
#ifndef SNAPKV_LANES16_AVX512_H
#define SNAPKV_LANES16_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "lanes8_x86.h"

/* clang 18 to 21 split the 512-bit registers out as a feature of their own, evex512; clang 22 dropped it again */
#if defined(__clang__) && __clang_major__ >= 18 && __clang_major__ < 22
#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,evex512")))
#else
#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#endif
#define LANES16 WIDE static inline __attribute__((always_inline))

typedef __m512 f32x16;   /* 16 floats */
typedef __m512i i32x16;  /* 16 int32 */
typedef __mmask16 mask16;  /* a bit per lane, lane 0 the lowest */

/* ---- 16 floats ---- */
LANES16 f32x16 f32x16_zero(void) { return _mm512_setzero_ps(); }
LANES16 f32x16 f32x16_splat(float x) { return _mm512_set1_ps(x); }
LANES16 f32x16 f32x16_of(float e0, float e1, float e2, float e3, float e4, float e5, float e6, float e7, float e8,
                         float e9, float e10, float e11, float e12, float e13, float e14, float e15) {
    return _mm512_setr_ps(e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15);
}
LANES16 f32x16 f32x16_load(const float *p) { return _mm512_loadu_ps(p); }
/* Two loads of 8 (halves just written by 8-lane stores forward to loads of their size; one load of 16 would wait
 * for both stores to reach the cache). */
LANES16 f32x16 f32x16_load_halves(const float *p) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p)), _mm256_loadu_ps(p + 8), 1);
}
LANES16 f32x16 f32x16_load_masked(mask16 lanes, const float *p) { return _mm512_maskz_loadu_ps(lanes, p); }  /* 0 off */
LANES16 void f32x16_store(float *p, f32x16 v) { _mm512_storeu_ps(p, v); }
LANES16 void f32x16_store_aligned(float *p, f32x16 v) { _mm512_store_ps(p, v); }  /* p 64-byte aligned */
LANES16 void f32x16_store_masked(float *p, mask16 lanes, f32x16 v) { _mm512_mask_storeu_ps(p, lanes, v); }
LANES16 f32x16 f32x16_add(f32x16 a, f32x16 b) { return _mm512_add_ps(a, b); }
LANES16 f32x16 f32x16_sub(f32x16 a, f32x16 b) { return _mm512_sub_ps(a, b); }
LANES16 f32x16 f32x16_mul(f32x16 a, f32x16 b) { return _mm512_mul_ps(a, b); }
LANES16 f32x16 f32x16_max(f32x16 a, f32x16 b) { return _mm512_max_ps(a, b); }  /* b where either is NaN */
LANES16 f32x16 f32x16_fma(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(a, b, c); }    /* a * b + c */
LANES16 f32x16 f32x16_fnma(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fnmadd_ps(a, b, c); }  /* c - a * b */
LANES16 f32x16 f32x16_nearest(f32x16 a) {  /* ties to even */
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
LANES16 mask16 f32x16_less(f32x16 a, f32x16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
LANES16 f32x16 f32x16_keep_where(mask16 lanes, f32x16 v) { return _mm512_maskz_mov_ps(lanes, v); }  /* 0 elsewhere */
/* Lanes swapped in pairs (1 0 3 2 ...), pairs of pairs (2 3 0 1 ...), quarters of 4 (4..7 0..3 12..15 8..11), and
 * halves of 8. */
LANES16 f32x16 f32x16_swap_adjacent(f32x16 v) { return _mm512_permute_ps(v, 0xB1); }
LANES16 f32x16 f32x16_swap_pairs(f32x16 v) { return _mm512_permute_ps(v, 0x4E); }
LANES16 f32x16 f32x16_swap_quarters(f32x16 v) { return _mm512_shuffle_f32x4(v, v, 0xB1); }
LANES16 f32x16 f32x16_swap_halves(f32x16 v) { return _mm512_shuffle_f32x4(v, v, 0x4E); }
/* The sum of the lanes: halves added, then their halves, and so on. */
LANES16 float f32x16_sum(f32x16 v) { return _mm512_reduce_add_ps(v); }
LANES16 f32x8 f32x16_low_half(f32x16 v) { return _mm512_castps512_ps256(v); }
LANES16 f32x8 f32x16_high_half(f32x16 v) { return _mm512_extractf32x8_ps(v, 1); }

/* 16 bytes widened to floats: unsigned, or signed. */
LANES16 f32x16 f32x16_from_u8(u8x16 bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }
LANES16 f32x16 f32x16_from_i8(u8x16 bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
/* The float 0..15 that each lane's low 4 bits count, its other bits ignored: a lookup in a table of 16 floats, the
 * same values as a conversion, off the pipes the conversion and the multiply-adds share (4-bit codes 1.2x faster). */
LANES16 f32x16 f32x16_of_low4(i32x16 a) {
    return _mm512_permutexvar_ps(a, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
/* 16 bf16 values as the fp32 values they are; and 8 of them, zeros above. */
LANES16 f32x16 f32x16_from_bf16(const uint16_t *p) {
    const __m512i widened = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(widened, 16));
}
LANES16 f32x16 f32x16_from_bf16_8(const uint16_t *p) {
    const __m512i widened = _mm512_cvtepu16_epi32(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(widened, 16));
}

/* ---- 16 int32 ---- */
LANES16 i32x16 i32x16_splat(int32_t x) { return _mm512_set1_epi32(x); }
LANES16 i32x16 i32x16_of(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8, int e9, int e10,
                         int e11, int e12, int e13, int e14, int e15) {
    return _mm512_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15);
}
LANES16 i32x16 i32x16_load(const void *p) { return _mm512_loadu_si512(p); }
LANES16 i32x16 i32x16_from_u8(u8x16 bytes) { return _mm512_cvtepu8_epi32(bytes); }  /* 16 bytes widened */
LANES16 i32x16 i32x16_add(i32x16 a, i32x16 b) { return _mm512_add_epi32(a, b); }
LANES16 i32x16 i32x16_mul(i32x16 a, i32x16 b) { return _mm512_mullo_epi32(a, b); }  /* the low 32 bits */
LANES16 i32x16 i32x16_and(i32x16 a, i32x16 b) { return _mm512_and_si512(a, b); }
LANES16 i32x16 i32x16_shift_left(i32x16 a, int count) { return _mm512_slli_epi32(a, count); }
LANES16 i32x16 i32x16_shift_right(i32x16 a, int count) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(count)); }
LANES16 i32x16 i32x16_shift_right_each(i32x16 a, i32x16 counts) { return _mm512_srlv_epi32(a, counts); }
LANES16 f32x16 i32x16_to_floats(i32x16 a) { return _mm512_cvtepi32_ps(a); }
LANES16 f32x16 i32x16_as_floats(i32x16 a) { return _mm512_castsi512_ps(a); }
LANES16 i32x16 i32x16_nearest_of(f32x16 a) { return _mm512_cvtps_epi32(a); }  /* to nearest, ties to even */
/* Lane i = the 4 bytes at base + index[i] * scale. */
LANES16 i32x16 i32x16_gather(i32x16 index, const void *base, int scale) {
    switch (scale) {  /* the instruction takes its scale as a constant */
    case 1: return _mm512_i32gather_epi32(index, base, 1);
    case 2: return _mm512_i32gather_epi32(index, base, 2);
    default: return _mm512_i32gather_epi32(index, base, 4);
    }
}
/* Each lane's low 16 bits as IEEE binary16, made a float exactly. */
LANES16 f32x16 i32x16_halves_to_floats(i32x16 a) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(a)); }
/* The bytes of p that `lanes` names (the others 0, not read), as 16 bytes repeated in each quarter of 16 bytes. */
LANES16 i32x16 i32x16_repeat_bytes(mask16 lanes, const void *p) {
    return _mm512_broadcast_i32x4(_mm_maskz_loadu_epi8(lanes, p));
}
/* Within each quarter of 16 bytes: byte j = byte pick[j] & 15 of that quarter, or 0 where pick[j]'s top bit is set. */
LANES16 i32x16 i32x16_pick_bytes(i32x16 a, i32x16 pick) { return _mm512_shuffle_epi8(a, pick); }

#endif
