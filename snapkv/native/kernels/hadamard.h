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
static inline __m256 hadamard_8(__m256 v) {
    const __m256 odd_negative = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
    const __m256 pairs_negative = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
    const __m256 half_negative = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
    v = _mm256_add_ps(_mm256_permute_ps(v, 0xB1), _mm256_mul_ps(v, odd_negative));
    v = _mm256_add_ps(_mm256_permute_ps(v, 0x4E), _mm256_mul_ps(v, pairs_negative));
    return _mm256_add_ps(_mm256_permute2f128_ps(v, v, 1), _mm256_mul_ps(v, half_negative));
}

/* In place: 64 values times the orthonormal Hadamard matrix, in registers (the same sums, in the same order,
 * as the general loop below). */
static inline void hadamard_64(float *block, float norm) {
    __m256 v[8];
    for (int i = 0; i < 8; i++) v[i] = hadamard_8(_mm256_loadu_ps(block + 8 * i));
    for (int half = 1; half < 8; half *= 2)  /* halves of 8, 16, 32 values: whole vectors apart */
        for (int i = 0; i < 8; i += 2 * half)
            for (int j = i; j < i + half; j++) {
                __m256 a = v[j], b = v[j + half];
                v[j] = _mm256_add_ps(a, b);
                v[j + half] = _mm256_sub_ps(a, b);
            }
    const __m256 scale = _mm256_set1_ps(norm);
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(block + 8 * i, _mm256_mul_ps(v[i], scale));
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
            for (int64_t i = 0; i < size; i += 8) _mm256_storeu_ps(block + i, hadamard_8(_mm256_loadu_ps(block + i)));
            for (half = 8; half < size; half *= 2)
                for (int64_t i = 0; i < size; i += 2 * half)
                    for (int64_t j = i; j < i + half; j += 8) {
                        __m256 a = _mm256_loadu_ps(block + j), b = _mm256_loadu_ps(block + j + half);
                        _mm256_storeu_ps(block + j, _mm256_add_ps(a, b));
                        _mm256_storeu_ps(block + j + half, _mm256_sub_ps(a, b));
                    }
            const __m256 scale = _mm256_set1_ps(norm);
            for (int64_t j = 0; j < size; j += 8) _mm256_storeu_ps(block + j, _mm256_mul_ps(_mm256_loadu_ps(block + j), scale));
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
    const __m512 odd_negative = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const __m512 pairs_negative = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const __m512 quads_negative = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const __m512 eights_negative = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m512 v[4];
    for (int i = 0; i < 4; i++) {
        /* two 32-byte loads: the halves were just written by 32-byte stores, which forward to loads of their size
         * (a 64-byte load would wait for both stores to reach the cache) */
        __m512 x = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(block + 16 * i)),
                                      _mm256_loadu_ps(block + 16 * i + 8), 1);
        x = _mm512_add_ps(_mm512_permute_ps(x, 0xB1), _mm512_mul_ps(x, odd_negative));
        x = _mm512_add_ps(_mm512_permute_ps(x, 0x4E), _mm512_mul_ps(x, pairs_negative));
        x = _mm512_add_ps(_mm512_shuffle_f32x4(x, x, 0xB1), _mm512_mul_ps(x, quads_negative));
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, x, 0x4E), _mm512_mul_ps(x, eights_negative));
    }
    /* halves of 16 values (vectors 0 and 1, 2 and 3), then of 32 (0 and 2, 1 and 3), written out by name so that
     * they stay in registers */
    const __m512 a0 = _mm512_add_ps(v[0], v[1]), a1 = _mm512_sub_ps(v[0], v[1]);
    const __m512 a2 = _mm512_add_ps(v[2], v[3]), a3 = _mm512_sub_ps(v[2], v[3]);
    const __m512 scale = _mm512_set1_ps(norm);
    _mm512_storeu_ps(target, _mm512_mul_ps(_mm512_add_ps(a0, a2), scale));
    _mm512_storeu_ps(target + 16, _mm512_mul_ps(_mm512_add_ps(a1, a3), scale));
    _mm512_storeu_ps(target + 32, _mm512_mul_ps(_mm512_sub_ps(a0, a2), scale));
    _mm512_storeu_ps(target + 48, _mm512_mul_ps(_mm512_sub_ps(a1, a3), scale));
}

#endif
