/* A question's attention over a saved layer straight from its codes (snapkv.storage.quantize's layout), with the window's
 * sums SnapKV's cut scores from (attend_coded, for snapkv.engine.coded_attention): the layer is never restored to fp32
 * as a whole. Each tile of 64 keys or values is decoded into the nearest cache just before the register tiles
 * (tiles.h) read it, so an 8k-token layer of the embedded model is read as ~0.8 MB of codes rather than written and
 * read again as 12 MB of floats; only the positions the cut keeps are restored afterwards (by the cut:
 * snapkv.compression.compress.cut_layer, through dequantize.c's dequantize_positions, the same bits as the whole
 * layer's restore).
 *
 * A layer is stored as one or two parts (snapkv.storage.quantize.Quantized, or a Mixed's sharper and other tokens, each in
 * its own bits), then come the question's own keys and values in fp32: the columns of each KV head's rows are
 * [part 0's tokens, part 1's tokens, the question's tokens]. Keys' groups run along the tokens (a channel's `group`
 * tokens share a scale and a minimum, stored channel by channel: the (head_dim, 64 tokens) tile the scores need, with
 * no transposes); values' groups along the channels (a token's row). A rotated part (a Hadamard rotation of each
 * head's vectors) is never rotated back here: q . k = (H q) . (H k), so its scores take the query rows rotated; the
 * values' weighted sum is made in the basis they are stored in (every part's the same; the question's own values are
 * rotated into it) and the few output rows are rotated back. Decoding is x = code * scale + minimum, multiplied then
 * added, as dequantize.c decodes.
 *
 * The attention (attend_coded_wide) is one pass a tile at a time per task (a KV head's share of the tiles, every
 * query row): the tile's scores, their softmax numerators against each row's largest score so far (the online
 * softmax of FlashAttention, arXiv 2205.14135: what a row summed before is scaled down where its largest grows),
 * then the tile's values added in while the numerators are still in the nearest cache; the shares are brought to
 * each row's largest score and added at the end. The window's sums of the softmax, which SnapKV scores from, are made
 * from the kept numerators and each tile's reference. So the output and the sums agree with few_rows.c's attend_rows
 * over the restored layer within fp32 rounding, not to the bit (another order of sums, the rotation moved).
 *
 * Layout of a part's codes: (kv_heads, other, groups, group * bits / 8) uint8, scale and minimum (kv_heads, other,
 * groups) fp16; keys: other = head_dim, groups along the part's tokens; values: other = tokens, groups along the
 * channels. Needs the 16-lane functions (AVX-512, or their plain C in the other variants: vectors.h); head_dim a multiple of 64 up to MAX_HEAD_DIM; groups multiples of 16 (a
 * value group dividing head_dim); bits 2, 3, 4 or 8. */
#include "hadamard.h"
#include "kernels.h"
#include "tiles.h"

#define MAX_PARTS SNAPKV_MAX_PARTS

typedef struct {
    const uint8_t *codes;
    const uint16_t *scale, *minimum;  /* fp16 */
    int64_t group, group_bytes, groups;
    int bits;
} coded;

typedef struct {
    coded keys, values;
    int64_t tokens;
    int rotated_keys;
} part;

/* How 16 codes of `bits` bits, a little-endian bit stream from a byte boundary, come out of 2 x bits bytes: each lane
 * takes the two bytes its code starts in (vpshufb picks them from the 16 bytes loaded, repeated in every 128-bit
 * lane), shifts right by where in the first byte the code starts, and keeps `bits` bits. */
typedef struct {
    i32x16 pick, shift, keep;
    mask16 bytes;
} unpacker;

WIDE static unpacker unpacker_for(int bits) {
    int8_t pick[64];
    int32_t shift[16];
    for (int i = 0; i < 16; i++) {
        const int first = i * bits >> 3;  /* at most 15: the second byte's index wraps to 0, and is masked away */
        pick[4 * i] = (int8_t)first;
        pick[4 * i + 1] = (int8_t)((first + 1) & 15);
        pick[4 * i + 2] = pick[4 * i + 3] = (int8_t)0x80;  /* zero */
        shift[i] = i * bits & 7;
    }
    unpacker u;
    u.pick = i32x16_load(pick);
    u.shift = i32x16_load(shift);
    u.keep = i32x16_splat((1 << bits) - 1);
    u.bytes = (mask16)(bits == 8 ? 0xFFFF : (1u << (2 * bits)) - 1);
    return u;
}

/* 16 codes starting at `bytes` (a whole byte), times scale plus minimum: multiplied, then added. */
WIDE static inline f32x16 decoded_16(const uint8_t *bytes, const unpacker *u, float scale, float minimum) {
    const i32x16 raw = i32x16_repeat_bytes(u->bytes, bytes);
    const i32x16 codes = i32x16_and(i32x16_shift_right_each(i32x16_pick_bytes(raw, u->pick), u->shift), u->keep);
    return f32x16_add(f32x16_mul(i32x16_to_floats(codes), f32x16_splat(scale)), f32x16_splat(minimum));
}

/* tile (head_dim, WIDE_TILE): head h's keys first..first + 63 of part p, channel-major as they are stored; zero past
 * the part's tokens. */
WIDE static void key_tile(const part *p, const unpacker *u, int64_t h, int64_t first, int64_t head_dim, float *tile) {
    const coded *k = &p->keys;
    for (int64_t c = 0; c < head_dim; c++) {
        const int64_t channel = (h * head_dim + c) * k->groups;  /* channel c's first group */
        for (int v = 0; v < WIDE_TILE / 16; v++) {
            const int64_t t = first + 16 * v;
            f32x16 x = f32x16_zero();
            if (t < p->tokens) {  /* 16 tokens inside one group: groups are multiples of 16 */
                const int64_t at = channel + t / k->group;
                x = decoded_16(k->codes + at * k->group_bytes + (t % k->group) * k->bits / 8, u,
                               half_to_float(k->scale[at]), half_to_float(k->minimum[at]));
            }
            f32x16_store_aligned(tile + c * WIDE_TILE + 16 * v, x);
        }
    }
}

/* tile (count, head_dim): head h's value rows first..first + count - 1 of part p. */
WIDE static void value_tile(const part *p, const unpacker *u, int64_t h, int64_t first, int64_t count,
                            int64_t head_dim, float *tile) {
    const coded *v = &p->values;
    for (int64_t i = 0; i < count; i++) {
        const int64_t row = (h * p->tokens + first + i) * v->groups;  /* the token's first group */
        for (int64_t c = 0; c < head_dim; c += 16) {
            const int64_t at = row + c / v->group;
            f32x16_store_aligned(tile + i * head_dim + c,
                                 decoded_16(v->codes + at * v->group_bytes + (c % v->group) * v->bits / 8, u,
                                            half_to_float(v->scale[at]), half_to_float(v->minimum[at])));
        }
    }
}

/* Where a head's tile t lies: returns the part it is in (parts: the question's own rows); first: its first token in
 * that part, column: its first column of the head's rows, count: its columns (at most WIDE_TILE). first_tile and
 * first_column: per part, then the question, then the end. */
static inline int tile_place(int64_t t, const int64_t *first_tile, const int64_t *first_column, int64_t *first,
                             int64_t *column, int64_t *count) {
    int i = 0;
    while (t >= first_tile[i + 1]) i++;
    *first = (t - first_tile[i]) * WIDE_TILE;
    *column = first_column[i] + *first;
    *count = first_column[i + 1] - *column < WIDE_TILE ? first_column[i + 1] - *column : WIDE_TILE;
    return i;
}

static int readable(const coded *c, int64_t extent) {
    if (!(c->bits == 2 || c->bits == 3 || c->bits == 4 || c->bits == 8) || c->group < 16 || c->group % 16) return 0;
    return extent > 0;
}

/* The attention, for attend_coded: as few_rows.c's attend_rows (query rows, tail mask, output, window sums)
 * over the parts' codes and the question's own rows.
 *   part_pointers: per part 6 pointers: key codes, key scale, key minimum, value codes, value scale, value minimum
 *   part_shapes:   per part 6 int64: tokens, key bits, key group, keys rotated (0/1), value bits, value group
 *   query, rotated_query: (kv_heads, rows, head_dim) each (rotated_query read for a rotated part's keys)
 *   question_keys, question_values: (kv_heads, question, head_dim), the values in the basis of the parts' values
 *   weights: (kv_heads, rows, tokens) room for the scores and numerators
 * Returns 0, or -1 for a shape it does not take or when memory runs out. */
WIDE static int attend_coded_wide(const float *query, const float *rotated_query, int64_t kv_heads, int64_t rows,
                                  int64_t question, float scale, int64_t head_dim, int parts,
                                  const void *const *part_pointers, const int64_t *part_shapes,
                                  const float *question_keys, const float *question_values, const float *tail_mask,
                                  float *weights, float *out, int64_t window, float *window_sums, int threads) {
    if (head_dim % WIDE_TILE || head_dim > MAX_HEAD_DIM || kv_heads < 1 || rows < 1
        || question < 1 || rows % question || parts < 1 || parts > MAX_PARTS)
        return -1;
    if (window_sums && (window < 1 || window > question)) return -1;
    part stored[MAX_PARTS];
    int64_t first_column[MAX_PARTS + 2], first_tile[MAX_PARTS + 2];  /* per part, then the question, then the end */
    first_column[0] = first_tile[0] = 0;
    for (int i = 0; i < parts; i++) {
        const void *const *pointers = part_pointers + 6 * i;
        const int64_t *shape = part_shapes + 6 * i;
        part *p = &stored[i];
        p->tokens = shape[0];
        p->rotated_keys = (int)shape[3];
        p->keys = (coded){pointers[0], pointers[1], pointers[2], shape[2], shape[2] * shape[1] / 8, 0, (int)shape[1]};
        p->values = (coded){pointers[3], pointers[4], pointers[5], shape[5], shape[5] * shape[4] / 8, 0, (int)shape[4]};
        p->keys.groups = (p->tokens + p->keys.group - 1) / p->keys.group;
        p->values.groups = head_dim / p->values.group;
        if (!readable(&p->keys, p->tokens) || !readable(&p->values, p->tokens) || head_dim % p->values.group)
            return -1;
        first_column[i + 1] = first_column[i] + p->tokens;
        first_tile[i + 1] = first_tile[i] + (p->tokens + WIDE_TILE - 1) / WIDE_TILE;
    }
    first_column[parts + 1] = first_column[parts] + question;
    first_tile[parts + 1] = first_tile[parts] + (question + WIDE_TILE - 1) / WIDE_TILE;
    const int64_t tokens = first_column[parts + 1], tiles = first_tile[parts + 1];
    const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t shares = threads > 1 ? threads : 1;  /* of each head's tiles: a task each */
    float *scaled[kv_heads], *rotated[kv_heads];  /* per KV head, its rows scaled and padded, as they are and rotated */
    int missing = 0;
    for (int64_t h = 0; h < kv_heads; h++) {
        missing |= !(scaled[h] = padded_rows(query + h * rows * head_dim, rows, head_dim, scale));
        missing |= !(rotated[h] = padded_rows(rotated_query + h * rows * head_dim, rows, head_dim, scale));
    }
    /* per task (kv_heads, shares): each row's weighted values, running largest score and sum of numerators; per tile
     * (kv_heads, tiles, rows): the largest score its numerators were taken against */
    float *partials = calloc((size_t)(kv_heads * shares * rows * head_dim), sizeof(float));
    float *running = malloc(sizeof(float) * (size_t)(kv_heads * shares * rows * 2));
    float *references = malloc(sizeof(float) * (size_t)(kv_heads * tiles * rows));
    float *finals = malloc(sizeof(float) * (size_t)(kv_heads * rows * 2));  /* per row: its largest score, 1 / sum */
    if (missing || !partials || !running || !references || !finals) {
        for (int64_t h = 0; h < kv_heads; h++) free(scaled[h]), free(rotated[h]);
        free(partials), free(running), free(references), free(finals);
        return -1;
    }
    unpacker key_unpackers[MAX_PARTS], value_unpackers[MAX_PARTS];
    for (int i = 0; i < parts; i++) {
        key_unpackers[i] = unpacker_for(stored[i].keys.bits);
        value_unpackers[i] = unpacker_for(stored[i].values.bits);
    }
#pragma omp parallel num_threads(threads)
    {
        float tile[MAX_HEAD_DIM * WIDE_TILE] __attribute__((aligned(64)));  /* keys (head_dim, 64), then values (64, head_dim) */
        float maxima[rows];
        /* each task: one share of a head's tiles, every row, in one pass a tile at a time (the online softmax of
         * FlashAttention, arXiv 2205.14135): the tile's scores, their numerators against each row's largest score so
         * far (the row's earlier sums scaled down where it grew), then the tile's values added in while its numerators
         * are still in the nearest cache */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * shares; task++) {
            const int64_t h = task / shares, share = task % shares;
            float *partial = partials + task * rows * head_dim;  /* (rows, head_dim) */
            float *top = running + task * rows * 2, *total = top + rows;
            for (int64_t r = 0; r < rows; r++) top[r] = -INFINITY, total[r] = 0.0f;
            for (int64_t t = tiles * share / shares; t < tiles * (share + 1) / shares; t++) {
                int64_t first, column, count;
                const int i = tile_place(t, first_tile, first_column, &first, &column, &count);
                const float *rows_in = scaled[h];
                if (i == parts) {
                    transposed_wide_tile(question_keys + (h * question + first) * head_dim, count, head_dim, tile);
                } else {
                    key_tile(&stored[i], &key_unpackers[i], h, first, head_dim, tile);
                    if (stored[i].rotated_keys) rows_in = rotated[h];
                }
                float *scores = weights + h * rows * tokens + column;  /* (rows, count), rows `tokens` apart */
                rows_times_tile(rows_in, rows, head_dim, tile, WIDE_TILE, count, scores, tokens, 1);
                finish_score_tile(scores, rows, tokens, column, count, tail_mask, question, maxima);
                for (int64_t r = 0; r < rows; r++) {
                    if (maxima[r] > top[r]) {  /* a larger score: what the row summed so far, scaled to it */
                        const float shrink = expf(top[r] - maxima[r]);  /* 0 while top is -inf */
                        total[r] *= shrink;
                        for (int64_t c = 0; c < head_dim; c++) partial[r * head_dim + c] *= shrink;
                        top[r] = maxima[r];
                    }
                    references[(h * tiles + t) * rows + r] = top[r];
                    if (top[r] == -INFINITY) {  /* every score so far masked: no weight */
                        memset(scores + r * tokens, 0, sizeof(float) * (size_t)count);
                        continue;
                    }
                    total[r] += row_exponentials_wide(scores + r * tokens, count, top[r]);
                }
                const float *values = question_values + (h * question + first) * head_dim;
                if (i < parts) {
                    value_tile(&stored[i], &value_unpackers[i], h, first, count, head_dim, tile);
                    values = tile;
                }
                for (int64_t block = 0; block < blocks; block++) {
                    const int64_t live = rows - block * ROW_BLOCK < ROW_BLOCK ? rows - block * ROW_BLOCK : ROW_BLOCK;
                    const float *a[ROW_BLOCK];  /* rows past the last repeat it; their sums are not stored */
                    for (int r = 0; r < ROW_BLOCK; r++)
                        a[r] = scores + (block * ROW_BLOCK + (r < live ? r : 0)) * tokens;
                    for (int64_t c = 0; c < head_dim; c += WIDE_TILE)
                        wide_tile_product(a, values + c, head_dim, count, partial + block * ROW_BLOCK * head_dim + c,
                                          head_dim, (int)live, WIDE_TILE, 1);
                }
            }
        }
        /* each row's shares brought to its largest score and added: the softmax's weighted sum */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < kv_heads * rows; r++) {
            const int64_t h = r / rows, row = r % rows;
            float largest = -INFINITY, sum = 0.0f, factors[shares];
            for (int64_t share = 0; share < shares; share++) {
                const float share_top = running[((h * shares + share) * rows) * 2 + row];
                largest = share_top > largest ? share_top : largest;
            }
            for (int64_t share = 0; share < shares; share++) {
                const float *task_top = running + (h * shares + share) * rows * 2;
                factors[share] = task_top[row] == -INFINITY ? 0.0f : expf(task_top[row] - largest);
                sum += task_top[rows + row] * factors[share];
            }
            const float inverse = 1.0f / sum;
            finals[2 * r] = largest;
            finals[2 * r + 1] = inverse;
            for (int64_t c = 0; c < head_dim; c++) {
                float weighted = 0.0f;
                for (int64_t share = 0; share < shares; share++)
                    weighted += partials[((h * shares + share) * rows + row) * head_dim + c] * factors[share];
                out[r * head_dim + c] = weighted * inverse;
            }
        }
        /* the window's rows' softmax summed per query head, a tile of columns at a time: each numerator brought to
         * its row's largest score and divided by its row's sum */
        if (window_sums) {
            const int64_t heads_per_kv = rows / question;
#pragma omp for schedule(static)
            for (int64_t task = 0; task < kv_heads * heads_per_kv * tiles; task++) {
                const int64_t h = task / (heads_per_kv * tiles), g = task / tiles % heads_per_kv, t = task % tiles;
                int64_t first, column, count;
                tile_place(t, first_tile, first_column, &first, &column, &count);
                float *sums = window_sums + (h * heads_per_kv + g) * tokens + column;
                for (int64_t j = 0; j < count; j++) sums[j] = 0.0f;
                for (int64_t q = question - window; q < question; q++) {
                    const int64_t row = g * question + q, r = h * rows + row;
                    const float reference = references[(h * tiles + t) * rows + row];
                    if (reference == -INFINITY) continue;
                    const f32x16 factor = f32x16_splat(expf(reference - finals[2 * r]) * finals[2 * r + 1]);
                    const float *numerators = weights + r * tokens + column;
                    for (int v = 0; v * 16 < count; v++) {
                        const mask16 lanes = columns_before(count, v);
                        const f32x16 added = f32x16_mul(f32x16_load_masked(lanes, numerators + 16 * v), factor);
                        f32x16_store_masked(sums + 16 * v, lanes, f32x16_add(f32x16_load_masked(lanes, sums + 16 * v), added));
                    }
                }
            }
        }
    }
    for (int64_t h = 0; h < kv_heads; h++) free(scaled[h]), free(rotated[h]);
    free(partials), free(running), free(references), free(finals);
    return 0;
}

/* rows (count, head_dim) copied to `to`, each block of `block` channels times the orthonormal Hadamard matrix. */
static void rotated_rows(const float *rows, int64_t count, int64_t head_dim, int64_t block, float *to) {
    const float norm = (float)(1.0 / sqrt((double)block));
    memcpy(to, rows, sizeof(float) * (size_t)(count * head_dim));
    for (int64_t r = 0; r < count; r++) hadamard_blocks(to + r * head_dim, head_dim, block, norm);
}

/* A question's attention over a saved layer's parts with its own rows after them (attend_coded_wide), for
 * snapkv.engine.coded_attention: the query rows, the question's values and the output rotated here (rotation_block:
 * the Hadamard block of the rotated parts; values_rotated: the values' basis), and each query head's softmax summed over
 * the question's last `window` rows, put back in position order (sharp: a sharper share's (kv_heads, stored) bool mask,
 * its positions read first; NULL for one part). SnapKV's cut of the layer follows in
 * snapkv.compression.compress.cut_layer, which scores from those sums as from any attention's and restores only the
 * positions it keeps (dequantize.c's dequantize_positions: the same bits as the whole layer's restore).
 *   query: (kv_heads, rows, head_dim) after RoPE, not rotated; question_keys, question_values: (kv_heads, question,
 *   head_dim) as the layer computed them; out: (kv_heads, rows, head_dim); window_sums: (kv_heads, rows / question,
 *   stored + question) out.
 * Returns 0, or -1 for a shape it does not take or when memory runs out (nothing to use then). */
int attend_coded(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale, int64_t head_dim,
                 int parts, const void *const *part_pointers, const int64_t *part_shapes, int64_t rotation_block,
                 int values_rotated, const float *question_keys, const float *question_values, const uint8_t *sharp,
                 int64_t window, float *out, float *window_sums, int threads) {
    if (!(wide_vectors(-1) || SNAPKV_WIDE_IS_PLAIN) || parts < 1 || parts > MAX_PARTS || rows < 1 || question < 1
        || rows % question || window < 1 || window > question || head_dim > MAX_HEAD_DIM
        || (rotation_block && (rotation_block & (rotation_block - 1) || head_dim % rotation_block)))
        return -1;
    int64_t stored = 0;
    for (int i = 0; i < parts; i++) {
        const int64_t *shape = part_shapes + 6 * i;  /* tokens, key bits, key group, keys rotated, value bits, group */
        stored += shape[0];
        if ((shape[3] || values_rotated) && !rotation_block) return -1;
    }
    const int64_t tokens = stored + question, group = rows / question;
    float *rotated = malloc(sizeof(float) * (size_t)(kv_heads * rows * head_dim));
    float *own_values = malloc(sizeof(float) * (size_t)(kv_heads * question * head_dim));
    float *tail = malloc(sizeof(float) * (size_t)(question * question));
    float *weights = malloc(sizeof(float) * (size_t)(kv_heads * rows * tokens));
    /* (kv_heads, stored): each position's column, a sharper share's positions read first (none for one part) */
    int64_t *column_of = sharp ? malloc(sizeof(int64_t) * (size_t)(kv_heads * stored)) : NULL;
    int status = -1;
    if (!rotated || !own_values || !tail || !weights || (sharp && !column_of)) goto done;
    if (rotation_block) rotated_rows(query, kv_heads * rows, head_dim, rotation_block, rotated);
    else memcpy(rotated, query, sizeof(float) * (size_t)(kv_heads * rows * head_dim));
    if (values_rotated) rotated_rows(question_values, kv_heads * question, head_dim, rotation_block, own_values);
    else memcpy(own_values, question_values, sizeof(float) * (size_t)(kv_heads * question * head_dim));
    for (int64_t i = 0; i < question; i++)  /* causal among the question's own tokens */
        for (int64_t j = 0; j < question; j++) tail[i * question + j] = j > i ? -INFINITY : 0.0f;
    status = attend_coded_wide(query, rotated, kv_heads, rows, question, scale, head_dim, parts, part_pointers,
                               part_shapes, question_keys, own_values, tail, weights, out, window, window_sums,
                               threads);
    if (status) goto done;
    if (values_rotated)  /* the output back from the values' basis */
        for (int64_t r = 0; r < kv_heads * rows; r++)
            hadamard_blocks(out + r * head_dim, head_dim, rotation_block, (float)(1.0 / sqrt((double)rotation_block)));
    if (sharp) {  /* the stored columns back in position order (weights is free again: its room is used) */
        part_columns(sharp, kv_heads, stored, column_of);
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t g = 0; g < group; g++) {
                const float *from = window_sums + (h * group + g) * tokens;
                float *to = weights + (h * group + g) * tokens;
                for (int64_t p = 0; p < stored; p++) to[p] = from[column_of[h * stored + p]];
                memcpy(to + stored, from + stored, sizeof(float) * (size_t)question);
            }
        memcpy(window_sums, weights, sizeof(float) * (size_t)(kv_heads * group * tokens));
    }
done:
    free(rotated), free(own_values), free(tail), free(weights), free(column_of);
    return status;
}
