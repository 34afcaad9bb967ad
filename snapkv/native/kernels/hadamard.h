/* The orthonormal Hadamard rotation of a head's vectors (snapkv.storage.quantize rotates a saved cache's keys and values by
 * it before quantizing), as a fast Walsh-Hadamard transform: shared by dequantize.c (undoing it on restored rows) and
 * coded_attention.c (moving it onto a question's query and output rows). The matrix is symmetric and its own
 * inverse. */
#ifndef SNAPKV_HADAMARD_H
#define SNAPKV_HADAMARD_H

#include "vectors.h"
#include <stdint.h>

#include "simd.h"

/* v's 8 lanes after the transform's first three stages (pairs, quads, halves): lane i + half gets
 * v[i] - v[i + half], lane i gets v[i + half] + v[i]. */
static inline f32x8 hadamard_8(f32x8 v) {
    const f32x8 odd_negative = f32x8_of(1, -1, 1, -1, 1, -1, 1, -1);
    const f32x8 pairs_negative = f32x8_of(1, 1, -1, -1, 1, 1, -1, -1);
    const f32x8 half_negative = f32x8_of(1, 1, 1, 1, -1, -1, -1, -1);
    v = f32x8_add(f32x8_swap_adjacent(v), f32x8_mul(v, odd_negative));
    v = f32x8_add(f32x8_swap_pairs(v), f32x8_mul(v, pairs_negative));
    return f32x8_add(f32x8_swap_halves(v), f32x8_mul(v, half_negative));
}

/* In place: 64 values times the orthonormal Hadamard matrix, in registers (the same sums, in the same order,
 * as the general loop below). */
static inline void hadamard_64(float *block, float norm) {
    f32x8 v[8];
    for (int i = 0; i < 8; i++) v[i] = hadamard_8(f32x8_load(block + 8 * i));
    for (int half = 1; half < 8; half *= 2)  /* halves of 8, 16, 32 values: whole vectors apart */
        for (int i = 0; i < 8; i += 2 * half)
            for (int j = i; j < i + half; j++) {
                f32x8 a = v[j], b = v[j + half];
                v[j] = f32x8_add(a, b);
                v[j + half] = f32x8_sub(a, b);
            }
    const f32x8 scale = f32x8_splat(norm);
    for (int i = 0; i < 8; i++) f32x8_store(block + 8 * i, f32x8_mul(v[i], scale));
}

/* In place: each block of `size` values (a power of two) times the orthonormal Hadamard matrix. */
static void hadamard_blocks(float *row, int64_t length, int64_t size, float norm) {
    for (int64_t start = 0; start < length; start += size) {
        float *block = row + start;
        int64_t half = 1;
        if (size == 64) {
            hadamard_64(block, norm);
            continue;
        }
        if (size >= 8) {  /* the first three stages inside each run of 8 lanes */
            for (int64_t i = 0; i < size; i += 8) f32x8_store(block + i, hadamard_8(f32x8_load(block + i)));
            for (half = 8; half < size; half *= 2)
                for (int64_t i = 0; i < size; i += 2 * half)
                    for (int64_t j = i; j < i + half; j += 8) {
                        f32x8 a = f32x8_load(block + j), b = f32x8_load(block + j + half);
                        f32x8_store(block + j, f32x8_add(a, b));
                        f32x8_store(block + j + half, f32x8_sub(a, b));
                    }
            const f32x8 scale = f32x8_splat(norm);
            for (int64_t j = 0; j < size; j += 8) f32x8_store(block + j, f32x8_mul(f32x8_load(block + j), scale));
            continue;
        }
        for (; half < size; half *= 2)
            for (int64_t i = 0; i < size; i += 2 * half)
                for (int64_t j = i; j < i + half; j++) {
                    float a = block[j], b = block[j + half];
                    block[j] = a + b;
                    block[j + half] = a - b;
                }
        for (int64_t j = 0; j < size; j++) block[j] *= norm;
    }
}

/* hadamard_64 with AVX-512, written to `target`: the first four stages inside each vector of 16 (pairs, quads,
 * halves of 8 as hadamard_8 does, then halves of 16), the last two across vectors. Each stage adds and subtracts
 * the same two values as hadamard_64's, so the result has the same bits. */
WIDE static inline void hadamard_64_wide(const float *block, float norm, float *target) {
    const f32x16 odd_negative = f32x16_of(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const f32x16 pairs_negative = f32x16_of(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const f32x16 quads_negative = f32x16_of(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const f32x16 eights_negative = f32x16_of(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    f32x16 v[4];
    for (int i = 0; i < 4; i++) {
        f32x16 x = f32x16_load_halves(block + 16 * i);  /* the halves were just written by 8-lane stores */
        x = f32x16_add(f32x16_swap_adjacent(x), f32x16_mul(x, odd_negative));
        x = f32x16_add(f32x16_swap_pairs(x), f32x16_mul(x, pairs_negative));
        x = f32x16_add(f32x16_swap_quarters(x), f32x16_mul(x, quads_negative));
        v[i] = f32x16_add(f32x16_swap_halves(x), f32x16_mul(x, eights_negative));
    }
    /* halves of 16 values (vectors 0 and 1, 2 and 3), then of 32 (0 and 2, 1 and 3), written out by name so that
     * they stay in registers */
    const f32x16 a0 = f32x16_add(v[0], v[1]), a1 = f32x16_sub(v[0], v[1]);
    const f32x16 a2 = f32x16_add(v[2], v[3]), a3 = f32x16_sub(v[2], v[3]);
    const f32x16 scale = f32x16_splat(norm);
    f32x16_store(target, f32x16_mul(f32x16_add(a0, a2), scale));
    f32x16_store(target + 16, f32x16_mul(f32x16_add(a1, a3), scale));
    f32x16_store(target + 32, f32x16_mul(f32x16_sub(a0, a2), scale));
    f32x16_store(target + 48, f32x16_mul(f32x16_sub(a1, a3), scale));
}

#endif
