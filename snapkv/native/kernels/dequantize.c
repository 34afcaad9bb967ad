/* Saved keys or values back to fp32 (or bf16) in one pass: unpack the codes, scale and shift them, undo the Hadamard
 * rotation with a fast Walsh-Hadamard transform, and write each row where it belongs.
 *
 * The layout is snapkv.storage.quantize's (see Quantized there), for a (heads, tokens, head_dim) tensor:
 *   packed:         (heads, other, groups, group * bits / 8) uint8, codes little-endian in a bit stream
 *                   (the first code in the lowest bits of the first byte; a 3-bit code may span two bytes)
 *   scale, minimum: (heads, other, groups) fp16
 * where groups run along the tokens (other = head_dim: a channel's `group` consecutive tokens) or along the
 * channels (other = tokens). x = code * scale + minimum, multiplied then added in fp32 as PyTorch does
 * (this file is compiled with -ffp-contract=off, so the two are never fused), so an unrotated tensor comes
 * back bit for bit as snapkv.storage.quantize.dequantize's; a rotated one within rounding (the transform sums in
 * another order than a matmul with the Hadamard matrix).
 *
 * Output row (h, t) goes to row destination[h * tokens + t] of `out` (head_dim values per row), or to row
 * h * tokens + t when destination is NULL; `out` holds fp32, or bf16 rounded to nearest even as PyTorch
 * rounds fp32 (OUT_BF16). Rows are spread over `threads` OpenMP threads. */
#include "vectors.h"
#include <stdint.h>
#include <string.h>

#include "hadamard.h"
#include "kernels.h"

#define MAX_HEAD_DIM SNAPKV_MAX_STORED_HEAD_DIM
#define OUT_FP32 0
#define OUT_BF16 1

static inline unsigned code_at(const uint8_t *stream, int64_t index, int bits) {
    int64_t offset = index * bits;
    unsigned word = stream[offset >> 3];
    if ((offset & 7) + bits > 8) word |= (unsigned)stream[(offset >> 3) + 1] << 8;
    return (word >> (offset & 7)) & ((1u << bits) - 1);
}

/* Codes first..first + 7 of a group (first a multiple of 8), times scale plus minimum, multiplied then added (as
 * the scalar path and PyTorch do), into out[0..7]. The 8 codes fill `bits` whole bytes. */
#if defined(SNAPKV_PORTABLE)
/* The generic build: the codes taken apart by scalar shifts (SSE2 has no shift by a count per lane, and gcc writes
 * the 8-lane plain one a lane at a time through memory), then made floats 4 lanes at a time (simd.h's lanes_4):
 * the same values. */
static inline void decode_8(const uint8_t *codes, int64_t first, int bits, float scale, float minimum, float *out) {
    int32_t q[8];
    if (bits == 8) {
        for (int i = 0; i < 8; i++) q[i] = codes[first + i];
    } else {
        const uint8_t *bytes = codes + first * bits / 8;
        uint32_t word = bytes[0] | (uint32_t)bytes[1] << 8;  /* 2, 3 or 4 bytes */
        if (bits >= 3) word |= (uint32_t)bytes[2] << 16;
        if (bits == 4) word |= (uint32_t)bytes[3] << 24;
        for (int i = 0; i < 8; i++) q[i] = (int32_t)((word >> (i * bits)) & ((1u << bits) - 1));
    }
    for (int half = 0; half < 8; half += 4) {
        words_4 quarter;
        memcpy(&quarter, q + half, sizeof quarter);
        const lanes_4 value = __builtin_convertvector(quarter, lanes_4) * splat_4(scale) + splat_4(minimum);
        memcpy(out + half, &value, sizeof value);
    }
}
#else
static inline void decode_8(const uint8_t *codes, int64_t first, int bits, float scale, float minimum, float *out) {
    i32x8 q;
    if (bits == 8) {
        q = i32x8_from_u8(u8x16_load8(codes + first));
    } else {
        const uint8_t *bytes = codes + first * bits / 8;
        uint32_t word = bytes[0] | (uint32_t)bytes[1] << 8;  /* 2, 3 or 4 bytes: a constant-size read each */
        if (bits >= 3) word |= (uint32_t)bytes[2] << 16;
        if (bits == 4) word |= (uint32_t)bytes[3] << 24;
        const i32x8 shifts = bits == 2 ? i32x8_of(0, 2, 4, 6, 8, 10, 12, 14)
                             : bits == 3 ? i32x8_of(0, 3, 6, 9, 12, 15, 18, 21)
                                         : i32x8_of(0, 4, 8, 12, 16, 20, 24, 28);
        q = i32x8_and(i32x8_shift_right_each(i32x8_splat((int)word), shifts), i32x8_splat((1 << bits) - 1));
    }
    f32x8_store(out, f32x8_add(f32x8_mul(i32x8_to_floats(q), f32x8_splat(scale)),
                                        f32x8_splat(minimum)));
}
#endif

static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    __builtin_memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* A row's values, decoded: the rotation undone, then written to its destination row of `out`. `wide`: the CPU has
 * AVX-512 (wide_vectors). */
static inline void finish_row(float *values, int64_t head_dim, int64_t rotation_block, float norm,
                              const int64_t *destination, int64_t row, void *out, int out_kind, int wide) {
    if (wide && rotation_block == 64 && head_dim == 64 && out_kind == OUT_FP32) {  /* the embedded model's rows */
        hadamard_64_wide(values, norm, (float *)out + (destination ? destination[row] : row) * head_dim);
        return;
    }
    if (rotation_block) hadamard_blocks(values, head_dim, rotation_block, norm);
    const int64_t target = (destination ? destination[row] : row) * head_dim;
    if (out_kind == OUT_BF16)
        for (int64_t c = 0; c < head_dim; c++) ((uint16_t *)out)[target + c] = float_to_bf16(values[c]);
    else
        for (int64_t c = 0; c < head_dim; c++) ((float *)out)[target + c] = values[c];
}

/* Row `row` (h * tokens + t) of a tensor whose groups run along the channels: its channels, group after group. */
static void token_row(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum, int64_t row,
                      int64_t head_dim, int bits, int64_t group, float *values) {
    const int64_t groups = (head_dim + group - 1) / group, group_bytes = group * bits / 8;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t at = row * groups + g, start = g * group;
        const int64_t end = start + group < head_dim ? start + group : head_dim;
        const float group_scale = half_to_float(scale[at]), group_minimum = half_to_float(minimum[at]);
        const uint8_t *codes = packed + at * group_bytes;
        int64_t c = start;
        for (; c + 8 <= end; c += 8) decode_8(codes, c - start, bits, group_scale, group_minimum, values + c);
        for (; c < end; c++) {
            const float scaled = (float)code_at(codes, c - start, bits) * group_scale;
            values[c] = scaled + group_minimum;
        }
    }
}

/* Returns 0, or -1 for a shape this kernel does not take (head_dim past MAX_HEAD_DIM, bits not 2/3/4/8, a
 * rotation block that is not a power of two dividing head_dim). */
int dequantize_rows(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum, int64_t heads,
                    int64_t tokens, int64_t head_dim, int bits, int along_tokens, int64_t group,
                    int64_t rotation_block, const int64_t *destination, void *out, int out_kind, int threads) {
    if (head_dim < 1 || head_dim > MAX_HEAD_DIM || !(bits == 2 || bits == 3 || bits == 4 || bits == 8) || group < 1
        || !(out_kind == OUT_FP32 || out_kind == OUT_BF16))
        return -1;
    if (rotation_block && (rotation_block & (rotation_block - 1) || head_dim % rotation_block)) return -1;
    const int64_t extent = along_tokens ? tokens : head_dim;  /* the axis the groups run along */
    const int64_t groups = (extent + group - 1) / group;
    const int64_t group_bytes = group * bits / 8;
    const float norm = rotation_block ? (float)(1.0 / __builtin_sqrt((double)rotation_block)) : 1.0f;
    /* a task: a group of tokens that share their scales (keys), or a run of 32 rows (values) */
    const int64_t tokens_per_task = along_tokens ? group : 32;
    const int64_t token_groups = (tokens + tokens_per_task - 1) / tokens_per_task;
    const int wide = wide_vectors(-1);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < heads * token_groups; task++) {
        const int64_t h = task / token_groups, first_token = (task % token_groups) * tokens_per_task;
        const int64_t last_token = first_token + tokens_per_task < tokens ? first_token + tokens_per_task : tokens;
        float values[MAX_HEAD_DIM], channel_scale[MAX_HEAD_DIM], channel_minimum[MAX_HEAD_DIM];
        if (along_tokens)  /* channel c's group over these tokens: (h, c, task's group) */
            for (int64_t c = 0; c < head_dim; c++) {
                const int64_t at = (h * head_dim + c) * groups + first_token / group;
                channel_scale[c] = half_to_float(scale[at]);
                channel_minimum[c] = half_to_float(minimum[at]);
            }
        const uint8_t *group_codes =  /* channel 0's codes of the task's group (keys) */
            along_tokens ? packed + ((h * head_dim) * groups + first_token / group) * group_bytes : NULL;
        const int64_t channel_bytes = groups * group_bytes;  /* from one channel's group to the next channel's */
        int64_t t = first_token;
        if (along_tokens && head_dim % 8 == 0)  /* 8 tokens at a time: each channel's 8 codes, then transposed */
            for (; t + 8 <= last_token; t += 8) {
                float tile[MAX_HEAD_DIM * 8], rows[8][MAX_HEAD_DIM];  /* tile: (head_dim, 8 tokens) */
                for (int64_t c = 0; c < head_dim; c++)
                    decode_8(group_codes + c * channel_bytes, t - first_token, bits, channel_scale[c],
                             channel_minimum[c], tile + c * 8);
                for (int64_t c = 0; c < head_dim; c += 8) f32x8_transpose(tile + c * 8, 8, &rows[0][c], MAX_HEAD_DIM);
                for (int i = 0; i < 8; i++)
                    finish_row(rows[i], head_dim, rotation_block, norm, destination, h * tokens + t + i, out, out_kind,
                               wide);
            }
        for (; t < last_token; t++) {
            const int64_t row = h * tokens + t;
            if (along_tokens)  /* the same place in each channel's group */
                for (int64_t c = 0; c < head_dim; c++) {
                    const float scaled = (float)code_at(group_codes + c * channel_bytes, t - first_token, bits) * channel_scale[c];
                    values[c] = scaled + channel_minimum[c];
                }
            else
                token_row(packed, scale, minimum, row, head_dim, bits, group, values);
            finish_row(values, head_dim, rotation_block, norm, destination, row, out, out_kind, wide);
        }
    }
    return 0;
}

/* Channels from..head_dim - 1 of row t of head h of a tensor whose groups run along the tokens (keys): each channel's
 * code in its group holding t, (h, c, t / group), times scale plus minimum, multiplied then added. */
static void key_row_channels(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum, int64_t tokens,
                             int64_t head_dim, int bits, int64_t group, int64_t h, int64_t t, int64_t from,
                             float *values) {
    const int64_t groups = (tokens + group - 1) / group, group_bytes = group * bits / 8;
    for (int64_t c = from; c < head_dim; c++) {
        const int64_t at = (h * head_dim + c) * groups + t / group;
        const float scaled = (float)code_at(packed + at * group_bytes, t % group, bits) * half_to_float(scale[at]);
        values[c] = scaled + half_to_float(minimum[at]);
    }
}

/* stored_row's keys (groups along the tokens) 16 channels at a time with AVX-512 gathers: the same values. Channels
 * whose 4-byte reads would pass the end of the codes or scales take the scalar path. */
WIDE static void stored_key_row_wide(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum,
                                     int64_t heads, int64_t tokens, int64_t head_dim, int bits, int64_t group,
                                     int64_t h, int64_t t, float *values) {
    const int64_t groups = (tokens + group - 1) / group, group_bytes = group * bits / 8;
    const int64_t bit = (t % group) * bits, entries = heads * head_dim * groups;
    const i32x16 lanes = i32x16_of(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int shift = (int)(bit & 7);
    const i32x16 keep = i32x16_splat((1 << bits) - 1);
    int64_t c = 0;
    for (; c + 16 <= head_dim; c += 16) {
        const int64_t first = (h * head_dim + c) * groups + t / group;  /* channel c's group holding t */
        const int64_t last = first + 15 * groups;
        if ((last + 1) * 2 + 2 > entries * 2 || last * group_bytes + (bit >> 3) + 4 > entries * group_bytes) break;
        const i32x16 at = i32x16_add(i32x16_splat((int)first), i32x16_mul(lanes, i32x16_splat((int)groups)));
        const i32x16 words = i32x16_gather(
            i32x16_add(i32x16_mul(at, i32x16_splat((int)group_bytes)), i32x16_splat((int)(bit >> 3))),
            packed, 1);
        const f32x16 codes = i32x16_to_floats(i32x16_and(i32x16_shift_right(words, shift), keep));
        const f32x16 s = i32x16_halves_to_floats(i32x16_gather(at, scale, 2));
        const f32x16 m = i32x16_halves_to_floats(i32x16_gather(at, minimum, 2));
        f32x16_store(values + c, f32x16_add(f32x16_mul(codes, s), m));
    }
    key_row_channels(packed, scale, minimum, tokens, head_dim, bits, group, h, t, c, values);
}

/* Row t of head h of a stored tensor (dequantize_rows' layout), decoded into `values` (not rotated back). */
static void stored_row(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum, int64_t tokens,
                       int64_t head_dim, int bits, int along_tokens, int64_t group, int64_t h, int64_t t, float *values) {
    if (!along_tokens) {
        token_row(packed, scale, minimum, h * tokens + t, head_dim, bits, group, values);
        return;
    }
    key_row_channels(packed, scale, minimum, tokens, head_dim, bits, group, h, t, 0, values);
}

/* A question's cut of a saved layer (snapkv.engine.coded_attention): the keys or values at `positions` (heads, kept), into
 * `out` (heads * kept, head_dim) fp32, a head's rows in order. The layer is stored as `parts` parts read one after
 * the other (part_pointers: per part codes, scale, minimum; part_shapes: per part tokens, bits, along_tokens, group,
 * rotation_block), position p of head h in column column_of[h * stored + p] of them (column_of NULL: column p);
 * positions from `stored` on are the question's own rows (question_rows (heads, question, head_dim), fp32, copied).
 * Stored rows are decoded and rotated back as dequantize_rows does: the same bits. Returns 0, or -1 for a shape it
 * does not take or a position or column out of range (then `out` is not all written). */
int dequantize_positions(const void *const *part_pointers, const int64_t *part_shapes, int parts,
                         const int64_t *column_of, int64_t heads, int64_t stored, int64_t head_dim,
                         const int64_t *positions, int64_t kept, const float *question_rows, int64_t question,
                         float *out, int threads) {
    if (head_dim < 1 || head_dim > MAX_HEAD_DIM || parts < 1) return -1;
    int64_t columns = 0;
    for (int i = 0; i < parts; i++) {
        const int64_t *shape = part_shapes + 5 * i;
        const int bits = (int)shape[1];
        if (!(bits == 2 || bits == 3 || bits == 4 || bits == 8) || shape[3] < 1 || shape[0] < 0
            || (shape[4] && (shape[4] & (shape[4] - 1) || head_dim % shape[4])))
            return -1;
        columns += shape[0];
    }
    if (columns != stored) return -1;
    const int wide = wide_vectors(-1);
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(|:failed)
    for (int64_t row = 0; row < heads * kept; row++) {
        const int64_t h = row / kept, p = positions[row];
        if (p < 0 || p >= stored + question) {
            failed = 1;
            continue;
        }
        if (p >= stored) {
            memcpy(out + row * head_dim, question_rows + (h * question + p - stored) * head_dim, sizeof(float) * head_dim);
            continue;
        }
        int64_t column = column_of ? column_of[h * stored + p] : p;
        int i = 0;
        while (i < parts && column >= part_shapes[5 * i]) column -= part_shapes[5 * i++];
        if (column < 0 || i == parts) {
            failed = 1;
            continue;
        }
        const void *const *pointers = part_pointers + 3 * i;
        const int64_t *shape = part_shapes + 5 * i;
        float values[MAX_HEAD_DIM];
        if (wide && shape[2] && heads * head_dim * ((shape[0] + shape[3] - 1) / shape[3]) * shape[3] < INT32_MAX / 8)
            stored_key_row_wide(pointers[0], pointers[1], pointers[2], heads, shape[0], head_dim, (int)shape[1],
                                shape[3], h, column, values);
        else
            stored_row(pointers[0], pointers[1], pointers[2], shape[0], head_dim, (int)shape[1], (int)shape[2],
                       shape[3], h, column, values);
        const float norm = shape[4] ? (float)(1.0 / __builtin_sqrt((double)shape[4])) : 1.0f;
        finish_row(values, head_dim, shape[4], norm, NULL, row, out, OUT_FP32, wide);
    }
    return failed ? -1 : 0;
}

/* The kept positions of a saved layer from its bit mask (snapkv.storage.cachefile: bit p % 8 of byte p // 8 set where
 * position p is kept). mask: (heads, bytes), `length` positions each. positions NULL: returns how many positions
 * every head keeps, or -1 where heads keep different numbers. Else positions: (heads, count) out, ascending; returns
 * count, or -1 (nothing written past a head's count) where a head keeps another number. */
int64_t mask_positions(const uint8_t *mask, int64_t heads, int64_t length, int64_t bytes, int64_t *positions,
                       int64_t count) {
    if (length > bytes * 8) return -1;
    for (int64_t h = 0; h < heads; h++) {
        const uint8_t *row = mask + h * bytes;
        int64_t found = 0;
        for (int64_t start = 0; start < length; start += 64) {  /* 64 positions a word, each set bit by its index */
            uint64_t word = 0;
            const int64_t first_byte = start / 8, word_bytes = (length - start + 7) / 8 < 8 ? (length - start + 7) / 8 : 8;
            for (int64_t b = 0; b < word_bytes; b++) word |= (uint64_t)row[first_byte + b] << (8 * b);
            if (length - start < 64) word &= ((uint64_t)1 << (length - start)) - 1;  /* no bits past the length */
            if (!positions) {
                found += __builtin_popcountll(word);
                continue;
            }
            for (; word; word &= word - 1) {
                if (found == count) return -1;
                positions[h * count + found++] = start + __builtin_ctzll(word);
            }
        }
        if (!positions && h == 0) count = found;
        if (found != count) return -1;
    }
    return heads ? count : 0;
}

/* The rows of a (heads * (tokens + room), head_dim) buffer that a Mixed part's rows go to (snapkv.storage.quantize.Mixed:
 * a head's sharper tokens in order, then the next head's; the same for the rest). sharp: (heads, tokens) bool;
 * high, low: high_count / low_count rows out. Returns 0, or -1 (nothing past them written) where the sharper and
 * other tokens are not that many. */
int part_rows(const uint8_t *sharp, int64_t heads, int64_t tokens, int64_t room, int64_t *high, int64_t high_count,
              int64_t *low, int64_t low_count) {
    int64_t sharper = 0;
    for (int64_t i = 0; i < heads * tokens; i++) sharper += sharp[i] != 0;
    if (sharper != high_count || heads * tokens - sharper != low_count) return -1;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t row = h * (tokens + room) + t;
            if (sharp[h * tokens + t]) *high++ = row;
            else *low++ = row;
        }
    return 0;
}

/* Each position's column when a Mixed part's rows are read one part after the other (a head's sharper tokens in
 * order, then its other tokens: coded_attention.c). sharp: (heads, tokens) bool; columns: (heads, tokens) out. */
void part_columns(const uint8_t *sharp, int64_t heads, int64_t tokens, int64_t *columns) {
    for (int64_t h = 0; h < heads; h++) {
        int64_t sharper = 0;
        for (int64_t t = 0; t < tokens; t++) sharper += sharp[h * tokens + t] != 0;
        int64_t high = 0, low = sharper;
        for (int64_t t = 0; t < tokens; t++) columns[h * tokens + t] = sharp[h * tokens + t] ? high++ : low++;
    }
}

/* 1 where none of the `parts` fp16 arrays (arrays[i], counts[i] values each) holds an infinity or a NaN (all exponent
 * bits set), else 0: a saved cache's scales and minimums checked at load in one pass (snapkv.storage.cachefile). */
int half_all_finite(const uint16_t *const *arrays, const int64_t *counts, int64_t parts) {
    uint16_t exponents_seen = 0;
    for (int64_t i = 0; i < parts; i++) {
        const uint16_t *array = arrays[i];
        uint16_t worst = 0;  /* the largest exponent field met, as bits: a run without branches */
        for (int64_t j = 0; j < counts[i]; j++) {
            const uint16_t exponent = array[j] & 0x7C00u;
            worst = exponent > worst ? exponent : worst;
        }
        exponents_seen = worst > exponents_seen ? worst : exponents_seen;
    }
    return exponents_seen != 0x7C00u;
}
