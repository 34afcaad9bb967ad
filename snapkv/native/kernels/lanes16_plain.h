/* The 16-lane vocabulary (vectors.h) in plain C with the vector extensions of GCC and clang: the avx2 build (so that
 * what exists only 16 lanes wide, a question's attention from a saved cache's codes, runs on AVX2 too) and the
 * generic build. It comes after the 8-lane header (f32x8, u8x16 and half_to_float are that header's). Each name does
 * what lanes16_avx512.h's does, lane by lane (a fused multiply-add where the target has one, else a product then a
 * sum), so the builds give the same bits. */
#ifndef SNAPKV_LANES16_PLAIN_H
#define SNAPKV_LANES16_PLAIN_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "plain_lanes.h"

#define WIDE  /* nothing to turn on: plain C */
#define LANES16 static inline

typedef float f32x16 __attribute__((vector_size(64), aligned(64)));
typedef int32_t i32x16 __attribute__((vector_size(64), aligned(64)));
typedef uint8_t plain_bytes64 __attribute__((vector_size(64), aligned(64)));
typedef uint32_t plain_words16 __attribute__((vector_size(64), aligned(64)));
typedef uint16_t mask16;

/* ---- 16 floats ---- */
LANES16 f32x16 f32x16_zero(void) { return (f32x16){0}; }
LANES16 f32x16 f32x16_splat(float x) { f32x16 v; EACH_LANE(16) v[i] = x; return v; }
LANES16 f32x16 f32x16_of(float e0, float e1, float e2, float e3, float e4, float e5, float e6, float e7, float e8,
                         float e9, float e10, float e11, float e12, float e13, float e14, float e15) {
    return (f32x16){e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15};
}
LANES16 f32x16 f32x16_load(const float *p) { f32x16 v; memcpy(&v, p, 64); return v; }
LANES16 f32x16 f32x16_load_halves(const float *p) { return f32x16_load(p); }
LANES16 f32x16 f32x16_load_masked(mask16 lanes, const float *p) {  /* lanes off are not read */
    f32x16 v = {0};
    EACH_LANE(16) if (lanes >> i & 1) v[i] = p[i];
    return v;
}
LANES16 void f32x16_store(float *p, f32x16 v) { memcpy(p, &v, 64); }
LANES16 void f32x16_store_aligned(float *p, f32x16 v) { memcpy(p, &v, 64); }
LANES16 void f32x16_store_masked(float *p, mask16 lanes, f32x16 v) { EACH_LANE(16) if (lanes >> i & 1) p[i] = v[i]; }
LANES16 f32x16 f32x16_add(f32x16 a, f32x16 b) { return a + b; }
LANES16 f32x16 f32x16_sub(f32x16 a, f32x16 b) { return a - b; }
LANES16 f32x16 f32x16_mul(f32x16 a, f32x16 b) { return a * b; }
LANES16 f32x16 f32x16_max(f32x16 a, f32x16 b) { f32x16 v; EACH_LANE(16) v[i] = a[i] > b[i] ? a[i] : b[i]; return v; }
LANES16 f32x16 f32x16_fma(f32x16 a, f32x16 b, f32x16 c) {
#if PLAIN_HAS_FMA
    f32x16 v;
    EACH_LANE(16) v[i] = PLAIN_FMA(a[i], b[i], c[i]);
    return v;
#else  /* whole vectors, the same product then sum: gcc 12 made the lane-by-lane form's sums a lane at a time */
    return a * b + c;
#endif
}
LANES16 f32x16 f32x16_fnma(f32x16 a, f32x16 b, f32x16 c) {
#if PLAIN_HAS_FMA
    f32x16 v;
    EACH_LANE(16) v[i] = PLAIN_FMA(-a[i], b[i], c[i]);
    return v;
#else  /* whole vectors, the same product then sum: gcc 12 made the lane-by-lane form's sums a lane at a time */
    return -a * b + c;
#endif
}
LANES16 f32x16 f32x16_nearest(f32x16 a) { f32x16 v; EACH_LANE(16) v[i] = rintf(a[i]); return v; }  /* ties to even */
LANES16 mask16 f32x16_less(f32x16 a, f32x16 b) {
    mask16 lanes = 0;
    EACH_LANE(16) lanes |= (mask16)((a[i] < b[i]) << i);
    return lanes;
}
LANES16 f32x16 f32x16_keep_where(mask16 lanes, f32x16 v) {
    EACH_LANE(16) v[i] = lanes >> i & 1 ? v[i] : 0.0f;
    return v;
}
LANES16 f32x16 f32x16_swap_adjacent(f32x16 v) { f32x16 s; EACH_LANE(16) s[i] = v[i ^ 1]; return s; }
LANES16 f32x16 f32x16_swap_pairs(f32x16 v) { f32x16 s; EACH_LANE(16) s[i] = v[i ^ 2]; return s; }
LANES16 f32x16 f32x16_swap_quarters(f32x16 v) { f32x16 s; EACH_LANE(16) s[i] = v[i ^ 4]; return s; }
LANES16 f32x16 f32x16_swap_halves(f32x16 v) { f32x16 s; EACH_LANE(16) s[i] = v[i ^ 8]; return s; }
LANES16 float f32x16_sum(f32x16 v) {  /* halves added, then quarters, ..., as lanes16_avx512.h's */
    float x[8];
    for (int i = 0; i < 8; i++) x[i] = v[i] + v[i + 8];
    for (int i = 0; i < 4; i++) x[i] = x[i] + x[i + 4];
    for (int i = 0; i < 2; i++) x[i] = x[i] + x[i + 2];
    return x[0] + x[1];
}
LANES16 f32x8 f32x16_low_half(f32x16 v) { f32x8 half; memcpy(&half, &v, 32); return half; }
LANES16 f32x8 f32x16_high_half(f32x16 v) { f32x8 half; memcpy(&half, (const float *)&v + 8, 32); return half; }
LANES16 f32x16 f32x16_from_u8(u8x16 bytes) {
    uint8_t b[16];
    memcpy(b, &bytes, 16);
    f32x16 v;
    EACH_LANE(16) v[i] = (float)b[i];
    return v;
}
LANES16 f32x16 f32x16_from_i8(u8x16 bytes) {
    int8_t b[16];
    memcpy(b, &bytes, 16);
    f32x16 v;
    EACH_LANE(16) v[i] = (float)b[i];
    return v;
}
LANES16 f32x16 f32x16_of_low4(i32x16 a) { f32x16 v; EACH_LANE(16) v[i] = (float)(a[i] & 15); return v; }
LANES16 f32x16 f32x16_from_bf16(const uint16_t *p) {
    uint32_t bits[16];
    EACH_LANE(16) bits[i] = (uint32_t)p[i] << 16;
    f32x16 v;
    memcpy(&v, bits, 64);
    return v;
}
LANES16 f32x16 f32x16_from_bf16_8(const uint16_t *p) {
    uint32_t bits[16] = {0};
    for (int i = 0; i < 8; i++) bits[i] = (uint32_t)p[i] << 16;
    f32x16 v;
    memcpy(&v, bits, 64);
    return v;
}

/* ---- 16 int32 ---- */
LANES16 i32x16 i32x16_splat(int32_t x) { i32x16 v; EACH_LANE(16) v[i] = x; return v; }
LANES16 i32x16 i32x16_of(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8, int e9, int e10,
                         int e11, int e12, int e13, int e14, int e15) {
    return (i32x16){e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15};
}
LANES16 i32x16 i32x16_load(const void *p) { i32x16 v; memcpy(&v, p, 64); return v; }
LANES16 i32x16 i32x16_from_u8(u8x16 bytes) {
    uint8_t b[16];
    memcpy(b, &bytes, 16);
    i32x16 v;
    EACH_LANE(16) v[i] = b[i];
    return v;
}
LANES16 i32x16 i32x16_add(i32x16 a, i32x16 b) { return (i32x16)((plain_words16)a + (plain_words16)b); }
LANES16 i32x16 i32x16_mul(i32x16 a, i32x16 b) { return (i32x16)((plain_words16)a * (plain_words16)b); }
LANES16 i32x16 i32x16_and(i32x16 a, i32x16 b) { return a & b; }
LANES16 i32x16 i32x16_shift_left(i32x16 a, int count) {
    return count > 31 ? (i32x16){0} : (i32x16)((plain_words16)a << (unsigned)count);
}
LANES16 i32x16 i32x16_shift_right(i32x16 a, int count) {  /* logical */
    return count > 31 ? (i32x16){0} : (i32x16)((plain_words16)a >> (unsigned)count);
}
LANES16 i32x16 i32x16_shift_right_each(i32x16 a, i32x16 counts) {
    i32x16 v;
    EACH_LANE(16) v[i] = (uint32_t)counts[i] > 31 ? 0 : (int32_t)((uint32_t)a[i] >> counts[i]);
    return v;
}
LANES16 f32x16 i32x16_to_floats(i32x16 a) { f32x16 v; EACH_LANE(16) v[i] = (float)a[i]; return v; }
LANES16 f32x16 i32x16_as_floats(i32x16 a) { return (f32x16)a; }
LANES16 i32x16 i32x16_nearest_of(f32x16 a) { i32x16 v; EACH_LANE(16) v[i] = (int32_t)rintf(a[i]); return v; }
LANES16 i32x16 i32x16_gather(i32x16 index, const void *base, int scale) {
    i32x16 v;
    EACH_LANE(16) {
        int32_t word;
        memcpy(&word, (const char *)base + (int64_t)index[i] * scale, 4);
        v[i] = word;
    }
    return v;
}
LANES16 f32x16 i32x16_halves_to_floats(i32x16 a) {
    f32x16 v;
    EACH_LANE(16) v[i] = half_to_float((uint16_t)a[i]);
    return v;
}
LANES16 i32x16 i32x16_repeat_bytes(mask16 lanes, const void *p) {  /* bytes off are not read */
    uint8_t b[16] = {0};
    EACH_LANE(16) if (lanes >> i & 1) b[i] = ((const uint8_t *)p)[i];
    i32x16 v;
    for (int quarter = 0; quarter < 4; quarter++) memcpy((char *)&v + 16 * quarter, b, 16);
    return v;
}
LANES16 i32x16 i32x16_pick_bytes(i32x16 a, i32x16 pick) {
    const plain_bytes64 from = (plain_bytes64)a, which = (plain_bytes64)pick;
    plain_bytes64 v;
    for (int i = 0; i < 64; i++) v[i] = which[i] & 0x80 ? 0 : from[(i & ~15) + (which[i] & 15)];
    return (i32x16)v;
}

#endif
