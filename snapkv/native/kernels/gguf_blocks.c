/* Matrices stored as a GGUF file stores them (snapkv.modeling.gguf_file): each row of `k` weights a run of blocks, in
 * the block types of ggml (llama.cpp's library), read where the file is mapped, never widened to a copy.
 *
 *   type  elements bytes  layout (fp16 = IEEE half)                       one weight
 *   Q4_0     32     18    d fp16, 16 bytes of nibbles                      d * (q - 8)
 *   Q4_1     32     20    d, m fp16, 16 bytes of nibbles                   d * q + m
 *   Q5_0     32     22    d fp16, 4 bytes of 5th bits, 16 of nibbles       d * (q - 16)
 *   Q5_1     32     24    d, m fp16, 4 bytes of 5th bits, 16 of nibbles    d * q + m
 *   Q8_0     32     34    d fp16, 32 signed bytes                          d * q
 *   Q4_K    256    144    d, dmin fp16, 12 bytes of 6-bit scales and      (d * sc) * q - (dmin * m), per 32
 *                         minimums, 128 bytes of nibbles
 *   Q5_K    256    176    as Q4_K, then 32 bytes of 5th bits, 128 of nibbles
 *   Q6_K    256    210    128 bytes of low nibbles, 64 of 2 high bits,    (d * sc) * (q - 32), per 16
 *                         16 signed scales, d fp16
 *   F16       1      2    one fp16 weight
 * (In the 32-element types, byte j holds element j in its low nibble and element j + 16 in its high one.)
 *
 * Every block unpacks to codes (small integers, as floats), and per group of 16 or 32 a scale and an offset, with
 * weight = scale * code + offset computed in fp32 in the very order ggml's dequantize_row_* and gguf-py compute it:
 * gguf_dequantize gives those weights bit for bit (tests/test_gguf_blocks.py checks each type against gguf-py).
 * gguf_matmul multiplies a few rows of fp32 activations by the blocks without writing the weights anywhere: per group
 * scale * (codes . x) + offset * sum(x), summed in fp32 (another order than a product over dequantized weights, so
 * it agrees within rounding). F32 and BF16 matrices go to dense_rows.c, which reads them as they are. */
#include "vectors.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define MOST_ELEMENTS 256  /* a K-quant super-block */
#define MOST_GROUPS 16     /* Q6_K: a scale per 16 */
#define ROWS_AHEAD 4       /* rows ahead whose blocks a question's product prefetches (read once a question: from memory) */
#define STREAM_AHEAD 2048  /* bytes ahead of each block that a one-row product prefetches (a whole row ahead at once,
                              115 lines of a Q6_K row of 8960, stalled on the CPU's fill buffers) */

/* The lines of the `bytes` bytes STREAM_AHEAD past block b, fetched ahead of their use (past the matrix: harmless). */
static inline void stream_ahead(const uint8_t *b, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch((const char *)b + STREAM_AHEAD + line, 0, 3);
}

/* The block form of a type: elements per block, bytes per block, elements per group (a scale); 0 for a type these
 * kernels do not read. */
int gguf_block_form(int type, int64_t *elements, int64_t *bytes, int64_t *group) {
    int64_t e = 0, b = 0, g = 0;
    switch (type) {
    case GGUF_Q4_0: e = 32, b = 18, g = 32; break;
    case GGUF_Q4_1: e = 32, b = 20, g = 32; break;
    case GGUF_Q5_0: e = 32, b = 22, g = 32; break;
    case GGUF_Q5_1: e = 32, b = 24, g = 32; break;
    case GGUF_Q8_0: e = 32, b = 34, g = 32; break;
    case GGUF_Q4_K: e = 256, b = 144, g = 32; break;
    case GGUF_Q5_K: e = 256, b = 176, g = 32; break;
    case GGUF_Q6_K: e = 256, b = 210, g = 16; break;
    case GGUF_F16: e = 32, b = 64, g = 32; break;  /* read 32 at a time: a "block" is 32 halves */
    default: return -1;
    }
    if (elements) *elements = e;
    if (bytes) *bytes = b;
    if (group) *group = g;
    return 0;
}

static inline float half_at(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return half_to_float(bits);
}

/* Q4_K and Q5_K's 6-bit scale and minimum of group j (0..7), as ggml's get_scale_min_k4. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *scale, uint8_t *minimum) {
    if (j < 4) {
        *scale = q[j] & 63;
        *minimum = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *minimum = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One block of `type` at b -> codes (elements), scale and offset per group. Returns whether there are offsets (a
 * weight is scale * code + offset; else scale * code, so that -0.0 stays as ggml gives it). */
static int unpack_block(int type, const uint8_t *b, float *code, float *scale, float *offset) {
    switch (type) {
    case GGUF_Q4_0: {
        const uint8_t *q = b + 2;
        for (int j = 0; j < 16; j++) {
            code[j] = (float)((q[j] & 0x0F) - 8);
            code[j + 16] = (float)((q[j] >> 4) - 8);
        }
        scale[0] = half_at(b), offset[0] = 0.0f;
        return 0;
    }
    case GGUF_Q4_1: {
        const uint8_t *q = b + 4;
        for (int j = 0; j < 16; j++) {
            code[j] = (float)(q[j] & 0x0F);
            code[j + 16] = (float)(q[j] >> 4);
        }
        scale[0] = half_at(b), offset[0] = half_at(b + 2);
        return 1;
    }
    case GGUF_Q5_0:
    case GGUF_Q5_1: {
        const int with_minimum = type == GGUF_Q5_1;
        const uint8_t *high = b + (with_minimum ? 4 : 2), *q = high + 4;
        uint32_t bits;
        memcpy(&bits, high, 4);
        const int shift = with_minimum ? 0 : 16;
        for (int j = 0; j < 16; j++) {
            code[j] = (float)((int)((q[j] & 0x0F) | (((bits >> j) & 1) << 4)) - shift);
            code[j + 16] = (float)((int)((q[j] >> 4) | (((bits >> (j + 16)) & 1) << 4)) - shift);
        }
        scale[0] = half_at(b), offset[0] = with_minimum ? half_at(b + 2) : 0.0f;
        return with_minimum;
    }
    case GGUF_Q8_0: {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) code[j] = (float)q[j];
        scale[0] = half_at(b), offset[0] = 0.0f;
        return 0;
    }
    case GGUF_Q4_K:
    case GGUF_Q5_K: {
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t *scales = b + 4;
        const int five = type == GGUF_Q5_K;
        const uint8_t *high = b + 16, *q = b + (five ? 48 : 16);
        for (int pair = 0; pair < 4; pair++) {  /* 64 elements: the low nibbles of 32 bytes, then their high ones */
            for (int half = 0; half < 2; half++) {
                const int g = 2 * pair + half;
                uint8_t sc, m;
                scale_min_k4(g, scales, &sc, &m);
                scale[g] = d * (float)sc;
                offset[g] = -(dmin * (float)m);
                float *out = code + g * 32;
                for (int l = 0; l < 32; l++) {
                    int value = half ? q[l] >> 4 : q[l] & 0x0F;
                    if (five) value |= ((high[l] >> g) & 1) << 4;
                    out[l] = (float)value;
                }
            }
            q += 32;
        }
        return 1;
    }
    case GGUF_Q6_K: {
        const uint8_t *low = b, *high = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int g = 0; g < 16; g++) scale[g] = d * (float)scales[g], offset[g] = 0.0f;
        for (int n = 0; n < 2; n++) {  /* 128 elements each */
            const uint8_t *ql = low + 64 * n, *qh = high + 32 * n;
            float *out = code + 128 * n;
            for (int l = 0; l < 32; l++) {
                out[l] = (float)(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
                out[l + 32] = (float)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
                out[l + 64] = (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                out[l + 96] = (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        return 0;
    }
    case GGUF_F16:
        for (int j = 0; j < 32; j++) code[j] = half_at(b + 2 * j);
        scale[0] = 1.0f, offset[0] = 0.0f;
        return 0;
    }
    return 0;
}

/* fp32 -> bf16 bits, rounded to nearest even, as PyTorch rounds (a NaN stays a quiet NaN). */
static inline uint16_t bf16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1)) >> 16);
}

/* One block's weights, as ggml and gguf-py compute them: scale * code + offset per group (scale * code where the type
 * has no offsets), each product rounded, then the sum. Any type gguf_block_form takes. */
static void block_weights(int type, const uint8_t *b, float *weights) {
    int64_t elements, group;
    gguf_block_form(type, &elements, NULL, &group);
    float scale[MOST_GROUPS], offset[MOST_GROUPS];
    const int offsets = unpack_block(type, b, weights, scale, offset);
    for (int64_t g = 0; g < elements / group; g++)
        for (int64_t i = g * group; i < (g + 1) * group; i++)
            weights[i] = offsets ? scale[g] * weights[i] + offset[g] : scale[g] * weights[i];
}

static void block_weights_wide(int type, const uint8_t *b, float *weights);  /* below: the same, in vectors */

/* Rows of `type` blocks -> their weights, (rows, k) fp32 (bf16 = 0) or bf16 rounded from them (bf16 = 1). k a
 * multiple of the type's elements; rows `row_bytes` apart (k / elements * bytes where they follow each other). */
int gguf_dequantize(int type, const uint8_t *blocks, int64_t rows, int64_t k, int64_t row_bytes, void *out, int bf16,
                    int threads) {
    int64_t elements, bytes, group;
    if (gguf_block_form(type, &elements, &bytes, &group) != 0 || k % elements || row_bytes < k / elements * bytes)
        return -1;
    const int64_t per_row = k / elements;
    const int wide = wide_vectors(-1);
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float weights[MOST_ELEMENTS];
        for (int64_t c = 0; c < per_row; c++) {
            const uint8_t *block = blocks + r * row_bytes + c * bytes;
            if (wide) block_weights_wide(type, block, weights);
            else block_weights(type, block, weights);
            const int64_t at = r * k + c * elements;
            if (bf16) {
                uint16_t *target = (uint16_t *)out + at;
                for (int64_t i = 0; i < elements; i++) target[i] = bf16_bits(weights[i]);
            } else {
                memcpy((float *)out + at, weights, sizeof(float) * (size_t)elements);
            }
        }
    }
    return 0;
}

/* The rows `ids` (count of them, each < rows) of a matrix of `type` blocks, each `row_bytes` long -> (count, k) fp32:
 * an embedding's lookup, read from the blocks. -1 for an id out of range (nothing written past the ones before). */
int gguf_rows(int type, const uint8_t *blocks, int64_t rows, int64_t k, int64_t row_bytes, const int64_t *ids,
              int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= rows) return -1;
        if (gguf_dequantize(type, blocks + ids[i] * row_bytes, 1, k, row_bytes, out + i * k, 0, 1) != 0) return -1;
    }
    return 0;
}

/* ---- one row of activations (a decoded token): each group's codes widened straight into FMAs, nothing stored ----
 * The codes come to floats 8 at a time (i32x8); a group's products with x are summed per lane, times the group's
 * scale, into the row's accumulator; a constant part of each weight (Q4_1's minimum, the K-quants' minimums, the
 * -8, -16 and -32 of the signed types) is its group's offset times the group's sum of x, added apart. */

/* 8 bytes (the low 8 of b) widened to floats, and the products with 8 activations added to acc. */
static inline f32x8 fma8_u8(u8x16 b, const float *x, f32x8 acc) {
    return f32x8_fma(i32x8_to_floats(i32x8_from_u8(b)), f32x8_load(x), acc);
}

/* 16 codes given as bytes (0..255) times 16 activations, added to acc. */
static inline f32x8 fma16_u8(u8x16 b, const float *x, f32x8 acc) {
    return fma8_u8(u8x16_high_half(b), x + 8, fma8_u8(b, x, acc));
}

/* 8 codes given as int32 times 8 activations, added to acc. */
static inline f32x8 fma8_i32(i32x8 codes, const float *x, f32x8 acc) {
    return f32x8_fma(i32x8_to_floats(codes), f32x8_load(x), acc);
}

/* Q4_0, Q4_1: nibbles j and j + 16 of 16 bytes. Q4_0's -8 is an offset of -8 d. */
static float row_dot_q4(const uint8_t *row, int64_t blocks, const float *x, const float *sums, int with_minimum) {
    f32x8 acc = f32x8_zero();
    float constant = 0.0f;
    const int64_t bytes = with_minimum ? 20 : 18;
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *b = row + c * bytes;
        stream_ahead(b, bytes);
        const u8x16 q = u8x16_load(b + (with_minimum ? 4 : 2));
        const float *xs = x + c * 32;
        f32x8 dot = fma16_u8(u8x16_low_nibbles(q), xs, f32x8_zero());
        dot = fma16_u8(u8x16_high_nibbles(q), xs + 16, dot);
        const float d = half_at(b);
        acc = f32x8_fma(f32x8_splat(d), dot, acc);
        constant += (with_minimum ? half_at(b + 2) : -8.0f * d) * sums[c];
    }
    return f32x8_sum(acc) + constant;
}

/* Q5_0, Q5_1: as Q4_0 and Q4_1 with a fifth bit per element from 32 bits (bit j: element j). */
static float row_dot_q5(const uint8_t *row, int64_t blocks, const float *x, const float *sums, int with_minimum) {
    f32x8 acc = f32x8_zero();
    float constant = 0.0f;
    const int64_t bytes = with_minimum ? 24 : 22;
    const i32x8 lanes = i32x8_of(0, 1, 2, 3, 4, 5, 6, 7), one = i32x8_splat(1);
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *b = row + c * bytes, *high = b + (with_minimum ? 4 : 2);
        stream_ahead(b, bytes);
        uint32_t bits;
        memcpy(&bits, high, 4);
        const u8x16 q = u8x16_load(high + 4);
        const float *xs = x + c * 32;
        const u8x16 halves[2] = {u8x16_low_nibbles(q), u8x16_high_nibbles(q)};
        f32x8 dot = f32x8_zero();
        for (int part = 0; part < 4; part++) {  /* elements 8 part .. 8 part + 7 */
            const u8x16 nibbles = part & 1 ? u8x16_high_half(halves[part >> 1]) : halves[part >> 1];
            const i32x8 fifth = i32x8_and(i32x8_shift_right_each(i32x8_splat((int32_t)(bits >> (8 * part))), lanes), one);
            dot = fma8_i32(i32x8_add(i32x8_from_u8(nibbles), i32x8_shift_left(fifth, 4)), xs + 8 * part, dot);
        }
        const float d = half_at(b);
        acc = f32x8_fma(f32x8_splat(d), dot, acc);
        constant += (with_minimum ? half_at(b + 2) : -16.0f * d) * sums[c];
    }
    return f32x8_sum(acc) + constant;
}

/* Q8_0: 32 signed bytes. */
static float row_dot_q8(const uint8_t *row, int64_t blocks, const float *x) {
    f32x8 acc = f32x8_zero();
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *b = row + c * 34;
        stream_ahead(b, 34);
        const float *xs = x + c * 32;
        const u8x16 first = u8x16_load(b + 2), second = u8x16_load(b + 18);
        f32x8 dot = f32x8_mul(i32x8_to_floats(i32x8_from_i8(first)), f32x8_load(xs));
        dot = fma8_i32(i32x8_from_i8(u8x16_high_half(first)), xs + 8, dot);
        dot = fma8_i32(i32x8_from_i8(second), xs + 16, dot);
        dot = fma8_i32(i32x8_from_i8(u8x16_high_half(second)), xs + 24, dot);
        acc = f32x8_fma(f32x8_splat(half_at(b)), dot, acc);
    }
    return f32x8_sum(acc);
}

/* Q4_K, Q5_K: per 64 elements, 32 bytes whose low nibbles are group 2p and high nibbles group 2p + 1 (Q5_K: bit g of
 * high[l] the fifth bit of element l of group g); each group's 6-bit scale and minimum. */
static float row_dot_k45(const uint8_t *row, int64_t blocks, const float *x, const float *sums, int five) {
    f32x8 acc = f32x8_zero();
    float constant = 0.0f;
    const int64_t bytes = five ? 176 : 144;
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *b = row + c * bytes, *high = b + 16, *q = b + (five ? 48 : 16);
        stream_ahead(b, bytes);
        const float d = half_at(b), dmin = half_at(b + 2);
        const float *xs = x + c * 256;
        for (int g = 0; g < 8; g++) {
            uint8_t sc, m;
            scale_min_k4(g, b + 4, &sc, &m);
            const uint8_t *bytes32 = q + 32 * (g >> 1);
            const float *gx = xs + 32 * g;
            f32x8 dot = f32x8_zero();
            for (int half = 0; half < 2; half++) {
                const u8x16 raw = u8x16_load(bytes32 + 16 * half);
                const u8x16 nibbles = g & 1 ? u8x16_high_nibbles(raw) : u8x16_low_nibbles(raw);
                if (five) {
                    const u8x16 h = u8x16_load(high + 16 * half);
                    for (int part = 0; part < 2; part++) {
                        const i32x8 fifth = i32x8_and(i32x8_shift_right(i32x8_from_u8(part ? u8x16_high_half(h) : h), g),
                                                      i32x8_splat(1));
                        const i32x8 codes = i32x8_add(i32x8_from_u8(part ? u8x16_high_half(nibbles) : nibbles),
                                                      i32x8_shift_left(fifth, 4));
                        dot = fma8_i32(codes, gx + 16 * half + 8 * part, dot);
                    }
                } else {
                    dot = fma16_u8(nibbles, gx + 16 * half, dot);
                }
            }
            acc = f32x8_fma(f32x8_splat(d * (float)sc), dot, acc);
            constant -= dmin * (float)m * sums[c * 8 + g];
        }
    }
    return f32x8_sum(acc) + constant;
}

/* Q6_K: per 128 elements, 64 bytes of low nibbles and 32 of 2-bit pairs; a signed scale per 16; codes minus 32. */
static float row_dot_q6k(const uint8_t *row, int64_t blocks, const float *x, const float *sums) {
    f32x8 acc = f32x8_zero();
    float constant = 0.0f;
    const i32x8 three = i32x8_splat(3);
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *b = row + c * 210;
        stream_ahead(b, 210);
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        const float *xs = x + c * 256;
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            for (int quarter = 0; quarter < 4; quarter++) {  /* elements 32 quarter .. + 31 of these 128 */
                const uint8_t *low = ql + (quarter & 1 ? 32 : 0);
                for (int half = 0; half < 2; half++) {  /* a group of 16: one scale */
                    const int g = 8 * n + 2 * quarter + half;
                    const u8x16 raw = u8x16_load(low + 16 * half), pairs = u8x16_load(qh + 16 * half);
                    const u8x16 nibbles = quarter >= 2 ? u8x16_high_nibbles(raw) : u8x16_low_nibbles(raw);
                    const float *gx = xs + 128 * n + 32 * quarter + 16 * half;
                    f32x8 dot = f32x8_zero();
                    for (int part = 0; part < 2; part++) {
                        const i32x8 top = i32x8_and(i32x8_shift_right(i32x8_from_u8(part ? u8x16_high_half(pairs) : pairs),
                                                                      2 * quarter), three);
                        const i32x8 codes = i32x8_add(i32x8_from_u8(part ? u8x16_high_half(nibbles) : nibbles),
                                                      i32x8_shift_left(top, 4));
                        dot = fma8_i32(codes, gx + 8 * part, dot);
                    }
                    const float scale = d * (float)scales[g];
                    acc = f32x8_fma(f32x8_splat(scale), dot, acc);
                    constant -= 32.0f * scale * sums[c * 16 + g];
                }
            }
        }
    }
    return f32x8_sum(acc) + constant;
}

/* ---- the same one-row products, 16 floats a vector (AVX-512 in the avx512 build: wide_vectors()): 16 bytes widened
 * once give 16 codes, or 32 where each byte holds two nibbles ---- */

WIDE static inline f32x16 fma16_low4(i32x16 bytes, const float *x, f32x16 acc) {
    return f32x16_fma(f32x16_of_low4(bytes), f32x16_load(x), acc);
}

/* One Q4_0/Q4_1 block's scaled products added to *acc, its constant part (Q4_1's minimum, Q4_0's -8 d) to *constant. */
WIDE static inline void block_q4_wide(const uint8_t *b, const float *xs, float sum, int with_minimum, f32x16 *acc,
                                      float *constant) {
    const i32x16 q = i32x16_from_u8(u8x16_load(b + (with_minimum ? 4 : 2)));
    const f32x16 dot = fma16_low4(i32x16_shift_right(q, 4), xs + 16, f32x16_mul(f32x16_of_low4(q), f32x16_load(xs)));
    const float d = half_at(b);
    *acc = f32x16_fma(f32x16_splat(d), dot, *acc);
    *constant += (with_minimum ? half_at(b + 2) : -8.0f * d) * sum;
}

/* A row of 32-element blocks of `bytes` each through BLOCK (block_q4_wide, block_q5_wide): even blocks and odd in
 * two chains each (a chain's FMA waits on the one before: one chain held the rate). */
#define EVEN_AND_ODD_BLOCKS(BLOCK, bytes)                                                                            \
    f32x16 even = f32x16_zero(), odd = f32x16_zero();                                                               \
    float constant_even = 0.0f, constant_odd = 0.0f;                                                                \
    int64_t c = 0;                                                                                                  \
    for (; c + 2 <= blocks; c += 2) {                                                                               \
        stream_ahead(row + c * (bytes), 2 * (bytes));                                                               \
        BLOCK(row + c * (bytes), x + c * 32, sums[c], with_minimum, &even, &constant_even);                         \
        BLOCK(row + (c + 1) * (bytes), x + (c + 1) * 32, sums[c + 1], with_minimum, &odd, &constant_odd);           \
    }                                                                                                               \
    if (c < blocks) BLOCK(row + c * (bytes), x + c * 32, sums[c], with_minimum, &even, &constant_even);             \
    return f32x16_sum(f32x16_add(even, odd)) + (constant_even + constant_odd);

WIDE static inline float row_dot_q4_wide(const uint8_t *row, int64_t blocks, const float *x, const float *sums,
                                         int with_minimum) {
    EVEN_AND_ODD_BLOCKS(block_q4_wide, with_minimum ? 20 : 18)
}

/* One Q5_0/Q5_1 block, as block_q4_wide. */
WIDE static inline void block_q5_wide(const uint8_t *b, const float *xs, float sum, int with_minimum, f32x16 *acc,
                                      float *constant) {
    const i32x16 lanes = i32x16_of(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), one = i32x16_splat(1);
    const uint8_t *high = b + (with_minimum ? 4 : 2);
    uint32_t bits;
    memcpy(&bits, high, 4);
    const i32x16 q = i32x16_from_u8(u8x16_load(high + 4));
    const i32x16 fifth_low = i32x16_and(i32x16_shift_right_each(i32x16_splat((int32_t)bits), lanes), one);
    const i32x16 fifth_high = i32x16_and(i32x16_shift_right_each(i32x16_splat((int32_t)(bits >> 16)), lanes), one);
    const i32x16 low = i32x16_add(i32x16_and(q, i32x16_splat(15)), i32x16_shift_left(fifth_low, 4));
    const i32x16 upper = i32x16_add(i32x16_shift_right(q, 4), i32x16_shift_left(fifth_high, 4));
    f32x16 dot = f32x16_mul(i32x16_to_floats(low), f32x16_load(xs));
    dot = f32x16_fma(i32x16_to_floats(upper), f32x16_load(xs + 16), dot);
    const float d = half_at(b);
    *acc = f32x16_fma(f32x16_splat(d), dot, *acc);
    *constant += (with_minimum ? half_at(b + 2) : -16.0f * d) * sum;
}

WIDE static inline float row_dot_q5_wide(const uint8_t *row, int64_t blocks, const float *x, const float *sums,
                                         int with_minimum) {
    EVEN_AND_ODD_BLOCKS(block_q5_wide, with_minimum ? 24 : 22)
}

WIDE static inline float row_dot_q8_wide(const uint8_t *row, int64_t blocks, const float *x) {
    f32x16 even = f32x16_zero(), odd = f32x16_zero();
    int64_t c = 0;
    for (; c < blocks; c++) {
        const uint8_t *b = row + c * 34;
        stream_ahead(b, 34);
        const float *xs = x + c * 32;
        f32x16 dot = f32x16_mul(f32x16_from_i8(u8x16_load(b + 2)), f32x16_load(xs));
        dot = f32x16_fma(f32x16_from_i8(u8x16_load(b + 18)), f32x16_load(xs + 16), dot);
        if (c & 1) odd = f32x16_fma(f32x16_splat(half_at(b)), dot, odd);
        else even = f32x16_fma(f32x16_splat(half_at(b)), dot, even);
    }
    return f32x16_sum(f32x16_add(even, odd));
}

/* Q4_K and Q5_K's eight 6-bit scales and minimums of a super-block (its 12 bytes at q), as bytes: scales 0..7 in
 * bytes 0..7 of `out`, minimums in bytes 8..15 (as scale_min_k4 gives them; rearranged 32 bits at a time). */
static inline void scales_mins_k4(const uint8_t *q, uint32_t out[4]) {
    const uint32_t six = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    uint32_t word[3];
    memcpy(word, q, 12);
    out[0] = word[0] & six;                                            /* scales 0..3 */
    out[1] = (word[2] & low4) | (((word[0] >> 6) & top2) << 4);        /* scales 4..7 */
    out[2] = word[1] & six;                                            /* minimums 0..3 */
    out[3] = ((word[2] >> 4) & low4) | (((word[1] >> 6) & top2) << 4); /* minimums 4..7 */
}

WIDE static inline float row_dot_k45_wide(const uint8_t *row, int64_t blocks, const float *x, const float *sums, int five) {
    f32x16 acc = f32x16_zero(), odd = f32x16_zero();  /* two chains of FMAs: even groups and odd */
    f32x8 minimums = f32x8_zero();                   /* the minimums' share, per group lane */
    const int64_t bytes = five ? 176 : 144;
    const i32x16 one = i32x16_splat(1);
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *b = row + c * bytes, *high = b + 16, *q = b + (five ? 48 : 16);
        stream_ahead(b, bytes);
        const float d = half_at(b), dmin = half_at(b + 2);
        const float *xs = x + c * 256;
        uint32_t packed[4];
        scales_mins_k4(b + 4, packed);
        float scale[8];
        f32x8_store(scale, f32x8_mul(f32x8_splat(d), i32x8_to_floats(i32x8_from_u8(u8x16_load8(packed)))));
        const f32x8 minimum = i32x8_to_floats(i32x8_from_u8(u8x16_load8(packed + 2)));
        minimums = f32x8_fma(f32x8_mul(f32x8_splat(dmin), minimum), f32x8_load(sums + c * 8), minimums);
        i32x16 fifth[2];
        if (five) fifth[0] = i32x16_from_u8(u8x16_load(high)), fifth[1] = i32x16_from_u8(u8x16_load(high + 16));
        for (int pair = 0; pair < 4; pair++) {  /* groups 2 pair (low nibbles) and 2 pair + 1 (high) */
            const i32x16 first = i32x16_from_u8(u8x16_load(q + 32 * pair)),
                         second = i32x16_from_u8(u8x16_load(q + 32 * pair + 16));
            const float *gx = xs + 64 * pair;
            f32x16 low, upper;
            if (five) {
                const int g = 2 * pair;
                const i32x16 f0 = i32x16_shift_left(i32x16_and(i32x16_shift_right(fifth[0], g), one), 4),
                             f1 = i32x16_shift_left(i32x16_and(i32x16_shift_right(fifth[1], g), one), 4),
                             h0 = i32x16_shift_left(i32x16_and(i32x16_shift_right(fifth[0], g + 1), one), 4),
                             h1 = i32x16_shift_left(i32x16_and(i32x16_shift_right(fifth[1], g + 1), one), 4);
                const i32x16 nibble = i32x16_splat(15);
                low = f32x16_mul(i32x16_to_floats(i32x16_add(i32x16_and(first, nibble), f0)), f32x16_load(gx));
                low = f32x16_fma(i32x16_to_floats(i32x16_add(i32x16_and(second, nibble), f1)), f32x16_load(gx + 16), low);
                upper = f32x16_mul(i32x16_to_floats(i32x16_add(i32x16_shift_right(first, 4), h0)), f32x16_load(gx + 32));
                upper = f32x16_fma(i32x16_to_floats(i32x16_add(i32x16_shift_right(second, 4), h1)),
                                   f32x16_load(gx + 48), upper);
            } else {
                low = fma16_low4(second, gx + 16, f32x16_mul(f32x16_of_low4(first), f32x16_load(gx)));
                upper = fma16_low4(i32x16_shift_right(second, 4), gx + 48,
                                   f32x16_mul(f32x16_of_low4(i32x16_shift_right(first, 4)), f32x16_load(gx + 32)));
            }
            acc = f32x16_fma(f32x16_splat(scale[2 * pair]), low, acc);
            odd = f32x16_fma(f32x16_splat(scale[2 * pair + 1]), upper, odd);
        }
    }
    return f32x16_sum(f32x16_add(acc, odd)) - f32x8_sum(minimums);
}

/* Q6_K's 6-bit codes (0..63) of elements 16 half .. 16 half + 15 of each quarter of 128 elements (ql: its 64 bytes
 * of low nibbles, qh: its 32 bytes of 2-bit pairs): codes[quarter], 16 lanes each. */
WIDE static inline void q6k_codes_wide(const uint8_t *ql, const uint8_t *qh, int half, i32x16 codes[4]) {
    const i32x16 nibble = i32x16_splat(15), three = i32x16_splat(3);
    const i32x16 pairs = i32x16_from_u8(u8x16_load(qh + 16 * half));
    const i32x16 first = i32x16_from_u8(u8x16_load(ql + 16 * half)),
                 second = i32x16_from_u8(u8x16_load(ql + 32 + 16 * half));
    codes[0] = i32x16_add(i32x16_and(first, nibble), i32x16_shift_left(i32x16_and(pairs, three), 4));
    codes[1] = i32x16_add(i32x16_and(second, nibble), i32x16_shift_left(i32x16_and(i32x16_shift_right(pairs, 2), three), 4));
    codes[2] = i32x16_add(i32x16_shift_right(first, 4), i32x16_shift_left(i32x16_and(i32x16_shift_right(pairs, 4), three), 4));
    codes[3] = i32x16_add(i32x16_shift_right(second, 4), i32x16_shift_left(i32x16_shift_right(pairs, 6), 4));
}

WIDE static inline float row_dot_q6k_wide(const uint8_t *row, int64_t blocks, const float *x, const float *sums) {
    f32x16 acc = f32x16_zero(), odd = f32x16_zero();  /* two chains of FMAs */
    f32x16 shifts = f32x16_zero();                    /* the -32's share, per group lane */
    for (int64_t c = 0; c < blocks; c++) {
        const uint8_t *b = row + c * 210;
        stream_ahead(b, 210);
        float scale[16];
        const f32x16 scales = f32x16_mul(f32x16_splat(half_at(b + 208)), f32x16_from_i8(u8x16_load(b + 192)));
        f32x16_store(scale, scales);
        shifts = f32x16_fma(scales, f32x16_load(sums + c * 16), shifts);
        const float *xs = x + c * 256;
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            for (int half = 0; half < 2; half++) {  /* l in 16 half .. 16 half + 15 */
                i32x16 codes[4];
                q6k_codes_wide(ql, qh, half, codes);
                for (int quarter = 0; quarter < 4; quarter++) {
                    const int g = 8 * n + 2 * quarter + half;
                    const f32x16 dot = f32x16_mul(i32x16_to_floats(codes[quarter]),
                                                  f32x16_load(xs + 128 * n + 32 * quarter + 16 * half));
                    if (quarter & 1) odd = f32x16_fma(f32x16_splat(scale[g]), dot, odd);
                    else acc = f32x16_fma(f32x16_splat(scale[g]), dot, acc);
                }
            }
        }
    }
    return f32x16_sum(f32x16_add(acc, odd)) - 32.0f * f32x16_sum(shifts);
}

/* block_weights in 16-lane vectors for the types of Q4_K_M files (Q4_K, Q6_K, Q8_0, Q5_0) and Q4_0 (the same
 * products and sums, so the same bits: gguf_dequantize's test checks them against gguf-py), the others by
 * block_weights. */
WIDE static void block_weights_wide(int type, const uint8_t *b, float *weights) {
    const i32x16 nibble = i32x16_splat(15);
    switch (type) {
    case GGUF_Q4_K: {
        uint32_t packed[4];
        scales_mins_k4(b + 4, packed);
        float scale[8], minimum[8];
        f32x8_store(scale, f32x8_mul(f32x8_splat(half_at(b)), i32x8_to_floats(i32x8_from_u8(u8x16_load8(packed)))));
        f32x8_store(minimum, f32x8_mul(f32x8_splat(half_at(b + 2)),
                                       i32x8_to_floats(i32x8_from_u8(u8x16_load8(packed + 2)))));
        for (int pair = 0; pair < 4; pair++)
            for (int half = 0; half < 2; half++) {  /* bytes 16 half .. of the pair's 32: elements 16 half .. */
                const i32x16 bytes16 = i32x16_from_u8(u8x16_load(b + 16 + 32 * pair + 16 * half));
                const int low = 2 * pair, high = 2 * pair + 1;
                f32x16_store(weights + 32 * low + 16 * half,
                             f32x16_sub(f32x16_mul(f32x16_splat(scale[low]), i32x16_to_floats(i32x16_and(bytes16, nibble))),
                                        f32x16_splat(minimum[low])));
                f32x16_store(weights + 32 * high + 16 * half,
                             f32x16_sub(f32x16_mul(f32x16_splat(scale[high]),
                                                   i32x16_to_floats(i32x16_shift_right(bytes16, 4))),
                                        f32x16_splat(minimum[high])));
            }
        return;
    }
    case GGUF_Q6_K: {
        float scale[16];
        f32x16_store(scale, f32x16_mul(f32x16_splat(half_at(b + 208)), f32x16_from_i8(u8x16_load(b + 192))));
        const i32x16 minus32 = i32x16_splat(-32);
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
            for (int half = 0; half < 2; half++) {
                i32x16 codes[4];
                q6k_codes_wide(ql, qh, half, codes);
                for (int quarter = 0; quarter < 4; quarter++) {
                    const int g = 8 * n + 2 * quarter + half;
                    const f32x16 centred = i32x16_to_floats(i32x16_add(codes[quarter], minus32));
                    f32x16_store(weights + 128 * n + 32 * quarter + 16 * half, f32x16_mul(f32x16_splat(scale[g]), centred));
                }
            }
        }
        return;
    }
    case GGUF_Q8_0: {
        const f32x16 d = f32x16_splat(half_at(b));
        f32x16_store(weights, f32x16_mul(d, f32x16_from_i8(u8x16_load(b + 2))));
        f32x16_store(weights + 16, f32x16_mul(d, f32x16_from_i8(u8x16_load(b + 18))));
        return;
    }
    case GGUF_Q4_0:
    case GGUF_Q5_0: {  /* d * (q - 8), d * (q - 16): q with its fifth bit from 32 bits, element j's bit j */
        const int five = type == GGUF_Q5_0;
        const i32x16 q = i32x16_from_u8(u8x16_load(b + (five ? 6 : 2)));
        i32x16 low = i32x16_and(q, nibble), upper = i32x16_shift_right(q, 4);
        if (five) {
            const i32x16 lanes = i32x16_of(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), one = i32x16_splat(1);
            uint32_t bits;
            memcpy(&bits, b + 2, 4);
            low = i32x16_add(low, i32x16_shift_left(
                i32x16_and(i32x16_shift_right_each(i32x16_splat((int32_t)bits), lanes), one), 4));
            upper = i32x16_add(upper, i32x16_shift_left(
                i32x16_and(i32x16_shift_right_each(i32x16_splat((int32_t)(bits >> 16)), lanes), one), 4));
        }
        const i32x16 shift = i32x16_splat(five ? -16 : -8);
        const f32x16 d = f32x16_splat(half_at(b));
        f32x16_store(weights, f32x16_mul(d, i32x16_to_floats(i32x16_add(low, shift))));
        f32x16_store(weights + 16, f32x16_mul(d, i32x16_to_floats(i32x16_add(upper, shift))));
        return;
    }
    }
    block_weights(type, b, weights);
}

/* Whether a type has a one-row form (row_dot_* below). */
static int has_row_dot(int type) {
    return type == GGUF_Q4_0 || type == GGUF_Q4_1 || type == GGUF_Q5_0 || type == GGUF_Q5_1 || type == GGUF_Q8_0
           || type == GGUF_Q4_K || type == GGUF_Q5_K || type == GGUF_Q6_K;
}

/* The loop over outputs of one row of activations, each output's row of blocks by its type's row_dot_*SUFFIX
 * (inlined: the loop and the products compiled together, for AVX-512 in the _wide one). */
#define ONE_ROW_LOOP(SUFFIX)                                                                                         \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                              \
    for (int64_t out = 0; out < n; out++) {                                                                         \
        const uint8_t *row = w + out * row_bytes;                                                                   \
        float value = 0.0f;                                                                                         \
        switch (type) {                                                                                             \
        case GGUF_Q4_0: value = row_dot_q4##SUFFIX(row, k / 32, x, sums, 0); break;                                 \
        case GGUF_Q4_1: value = row_dot_q4##SUFFIX(row, k / 32, x, sums, 1); break;                                 \
        case GGUF_Q5_0: value = row_dot_q5##SUFFIX(row, k / 32, x, sums, 0); break;                                 \
        case GGUF_Q5_1: value = row_dot_q5##SUFFIX(row, k / 32, x, sums, 1); break;                                 \
        case GGUF_Q8_0: value = row_dot_q8##SUFFIX(row, k / 32, x); break;                                          \
        case GGUF_Q4_K: value = row_dot_k45##SUFFIX(row, k / 256, x, sums, 0); break;                               \
        case GGUF_Q5_K: value = row_dot_k45##SUFFIX(row, k / 256, x, sums, 1); break;                               \
        case GGUF_Q6_K: value = row_dot_q6k##SUFFIX(row, k / 256, x, sums); break;                                  \
        }                                                                                                           \
        y[out] = value;                                                                                             \
    }

/* y (n) = x (k) @ W^T, one row of activations, 16 floats a vector (a type with a one-row form only). */
WIDE static void one_row_wide(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n, const float *x,
                              const float *sums, float *y, int threads) {
    ONE_ROW_LOOP(_wide)
}

/* The same, 8 floats a vector (every build). */
static void one_row(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t n, const float *x,
                    const float *sums, float *y, int threads) {
    ONE_ROW_LOOP()
}

/* COUNT outputs from `first` on for several rows of activations, in vectors V (f32x8 or f32x16) of LANES floats: per
 * block, each output's weights made once (as gguf_dequantize gives them), then the rows' products two rows at a time,
 * each vector of x loaded once for the COUNT outputs and each weight vector once for both rows, two chains of FMAs
 * per row and output (every output's sums in the same order whatever COUNT is: the same bits). */
#define SEVERAL_ROWS_OUTPUTS(V, LANES, WEIGHTS, COUNT, first)                                                       \
    {                                                                                                               \
        float code[COUNT][MOST_ELEMENTS];                                                                           \
        V chains[SNAPKV_MAX_ROWS][COUNT][2];                                                                        \
        for (int64_t r = 0; r < rows; r++)                                                                          \
            for (int o = 0; o < (COUNT); o++) chains[r][o][0] = chains[r][o][1] = V##_zero();                       \
        for (int o = 0; o < (COUNT); o++)                                                                           \
            if ((first) + o + ROWS_AHEAD < n)                                                                       \
                prefetch_bytes((const char *)(w + ((first) + o + ROWS_AHEAD) * row_bytes), row_bytes);              \
        for (int64_t c = 0; c < per_row; c++) {                                                                     \
            for (int o = 0; o < (COUNT); o++) WEIGHTS(type, w + ((first) + o) * row_bytes + c * bytes, code[o]);    \
            int64_t r = 0;                                                                                          \
            for (; r + 2 <= rows; r += 2) {                                                                         \
                const float *x0 = x + r * k + c * elements, *x1 = x0 + k;                                           \
                V a0[COUNT], a1[COUNT], b0[COUNT], b1[COUNT];                                                       \
                for (int o = 0; o < (COUNT); o++)                                                                   \
                    a0[o] = chains[r][o][0], a1[o] = chains[r][o][1], b0[o] = chains[r + 1][o][0],                  \
                    b1[o] = chains[r + 1][o][1];                                                                    \
                for (int64_t i = 0; i < elements; i += 2 * LANES) {                                                 \
                    const V xa = V##_load(x0 + i), xb = V##_load(x0 + i + LANES), xc = V##_load(x1 + i),            \
                            xd = V##_load(x1 + i + LANES);                                                          \
                    for (int o = 0; o < (COUNT); o++) {                                                             \
                        const V w0 = V##_load(code[o] + i), w1 = V##_load(code[o] + i + LANES);                     \
                        a0[o] = V##_fma(w0, xa, a0[o]);                                                             \
                        a1[o] = V##_fma(w1, xb, a1[o]);                                                             \
                        b0[o] = V##_fma(w0, xc, b0[o]);                                                             \
                        b1[o] = V##_fma(w1, xd, b1[o]);                                                             \
                    }                                                                                               \
                }                                                                                                   \
                for (int o = 0; o < (COUNT); o++)                                                                   \
                    chains[r][o][0] = a0[o], chains[r][o][1] = a1[o], chains[r + 1][o][0] = b0[o],                  \
                    chains[r + 1][o][1] = b1[o];                                                                    \
            }                                                                                                       \
            for (; r < rows; r++) {                                                                                 \
                const float *xs = x + r * k + c * elements;                                                         \
                for (int o = 0; o < (COUNT); o++) {                                                                 \
                    V a0 = chains[r][o][0], a1 = chains[r][o][1];                                                   \
                    for (int64_t i = 0; i < elements; i += 2 * LANES) {                                             \
                        a0 = V##_fma(V##_load(code[o] + i), V##_load(xs + i), a0);                                  \
                        a1 = V##_fma(V##_load(code[o] + i + LANES), V##_load(xs + i + LANES), a1);                  \
                    }                                                                                               \
                    chains[r][o][0] = a0, chains[r][o][1] = a1;                                                     \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
        for (int64_t r = 0; r < rows; r++)                                                                          \
            for (int o = 0; o < (COUNT); o++)                                                                       \
                y[r * n + (first) + o] = V##_sum(V##_add(chains[r][o][0], chains[r][o][1]));                        \
    }

#define OUTPUTS_AT_ONCE 4  /* outputs whose weights share each load of x in a question's product (x read from L2) */

/* The loop over outputs for several rows of activations, OUTPUTS_AT_ONCE at a time (the last few one by one). */
#define SEVERAL_ROWS_LOOP(V, LANES, WEIGHTS)                                                                         \
    int64_t elements, bytes, group;                                                                                 \
    gguf_block_form(type, &elements, &bytes, &group);                                                               \
    const int64_t per_row = k / elements, sets = (n + OUTPUTS_AT_ONCE - 1) / OUTPUTS_AT_ONCE;                       \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                              \
    for (int64_t set = 0; set < sets; set++) {                                                                      \
        const int64_t first = set * OUTPUTS_AT_ONCE;                                                                \
        if (first + OUTPUTS_AT_ONCE <= n) SEVERAL_ROWS_OUTPUTS(V, LANES, WEIGHTS, OUTPUTS_AT_ONCE, first)           \
        else                                                                                                        \
            for (int64_t out = first; out < n; out++) SEVERAL_ROWS_OUTPUTS(V, LANES, WEIGHTS, 1, out)               \
    }

/* y (rows, n) = x (rows, k) @ W^T for rows > 1, 16 floats a vector (AVX-512 in the avx512 build). */
WIDE static void several_rows_wide(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t rows, int64_t n,
                                   const float *x, float *y, int threads) {
    SEVERAL_ROWS_LOOP(f32x16, 16, block_weights_wide)
}

/* The same, 8 floats a vector (every build). */
static void several_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t k, int64_t rows, int64_t n,
                         const float *x, float *y, int threads) {
    SEVERAL_ROWS_LOOP(f32x8, 8, block_weights)
}

/* y (rows, n) = x (rows, k) @ W^T, W (n, k) in `type` blocks, each output's row `row_bytes` long; rows at most
 * SNAPKV_MAX_ROWS. One row (a decoded token): one_row_wide / one_row, the codes straight into FMAs, the constant
 * parts of the weights times the groups' sums of x (taken once per call). More rows (a question): per output, per
 * block, its weights made once (as gguf_dequantize gives them), then the rows' products two rows at a time.
 * Outputs spread over `threads`. */
int gguf_matmul(const float *x, int64_t rows, int64_t k, int type, const uint8_t *w, int64_t row_bytes, int64_t n,
                float *y, int threads) {
    int64_t elements, bytes, group;
    if (rows < 1 || rows > SNAPKV_MAX_ROWS || gguf_block_form(type, &elements, &bytes, &group) != 0 || k % elements
        || row_bytes < k / elements * bytes)
        return -1;
    if (rows > 1 || !has_row_dot(type)) {
        if (wide_vectors(-1)) several_rows_wide(type, w, row_bytes, k, rows, n, x, y, threads);
        else several_rows(type, w, row_bytes, k, rows, n, x, y, threads);
        return 0;
    }
    const int64_t groups = k / group;
    float *sums = (float *)malloc(sizeof(float) * (size_t)groups);  /* (k / group): the sums of x per group */
    if (!sums) return -1;
    for (int64_t g = 0; g < groups; g++) {
        float total = 0.0f;
        for (int64_t i = 0; i < group; i++) total += x[g * group + i];
        sums[g] = total;
    }
    if (wide_vectors(-1)) one_row_wide(type, w, row_bytes, k, n, x, sums, y, threads);
    else one_row(type, w, row_bytes, k, n, x, sums, y, threads);
    free(sums);
    return 0;
}
