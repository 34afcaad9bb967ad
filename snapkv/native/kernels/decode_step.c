/* One decoded token through every layer of a plain Llama-family decoder whose projections are 4/8-bit blocks
 * (snapkv.modeling.block_weights) or plain bf16/fp32 rows (snapkv.modeling.dense_weights), in one call: no Python
 * between the layers (snapkv/engine/native_decode.py).
 *
 * Each layer, as transformers' LlamaDecoderLayer computes it for one token:
 *   normed = RMSNorm(hidden)                      x * 1/sqrt(mean(x^2) + eps), times the norm's weight
 *   q, k, v = normed @ [Wq; Wk; Wv]^T             one product over the fused blocks, q then k then v
 *   q, k = q * cos + rotate_half(q) * sin, ...    RoPE at the token's position (cos, sin given, head_dim each)
 *   k, v written into the layer's cache buffers   slot `filled`, which then grows by one
 *   a = softmax(q . K^T * scaling) @ V            query head h reads KV head h / (heads / kv_heads)
 *   hidden += a @ Wo^T
 *   normed = RMSNorm(hidden)
 *   gate, up = normed @ [Wgate; Wup]^T
 *   hidden += (silu(gate) * up) @ Wdown^T
 * The same formulas in fp32, summed in another order (so logits agree within rounding, not to the bit); exp
 * for the softmax and SiLU is simd.h's polynomial.
 *
 * The cache: per layer, the rows the question's pass left, read where they are (held_keys, held_values: (kv_heads,
 * held, head_dim), fp32 or bf16, bf16 widened exactly: no copy of a cache in memory), then the answer's own rows in
 * fp32 buffers (keys, values: (kv_heads, capacity, head_dim), rows [0, filled) written). When any layer is full
 * nothing is written and -2 is returned (the caller hands over to other steps); -1, also before anything is
 * written, for a matrix of another shape or form; -1 past that only when memory runs out. Work is spread over
 * `threads` OpenMP threads inside each product and the attention. head_dim a multiple of 8, at most
 * SNAPKV_MAX_DECODE_HEAD_DIM. */
#include "vectors.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

/* y (rows, m->outputs) = x (rows, m->inputs) @ W^T for one part of a matrix: plain bf16/fp32 rows by
 * snapkv/native/kernels/dense_rows.c; blocks by the block kernel for one row (snapkv/native/kernels/blockwise_matmul.c),
 * by snapkv/native/kernels/few_rows.c's for a question's rows; a GGUF type's blocks by gguf_blocks.c. */
static int part_products(const block_matrix *m, const float *x, int64_t rows, float *y, int threads) {
    if (m->bits == 0) return gguf_matmul(x, rows, m->inputs, (int)m->gguf_type, m->codes, m->row_bytes, m->outputs, y,
                                         threads);
    if (m->bits == 16 || m->bits == 32) return matmul_dense(x, rows, m->inputs, m->codes, m->bits == 16, m->outputs, y,
                                                            threads);
    if (rows == 1 && m->bits == 4)
        return matmul_4bit(x, 1, m->inputs, m->codes, m->scale, m->minimum, m->outputs, y, threads);
    if (rows == 1 && m->bits == 8) return matmul_8bit(x, 1, m->inputs, m->codes, m->scale, m->outputs, y, threads);
    return linear_rows_blocks(x, rows, m->inputs, (int)m->bits, m->codes, m->scale, m->minimum, m->outputs, y, threads);
}

/* All of m's outputs, its parts' one after another (matrix_outputs of them), y (rows, all outputs). */
static int64_t matrix_outputs(const block_matrix *m) {
    int64_t total = 0;
    for (; m; m = (const block_matrix *)m->next) total += m->outputs;
    return total;
}

/* y (rows, matrix_outputs(m)) = x (rows, m->inputs) @ W^T, each part into its columns. */
static int products(const block_matrix *m, const float *x, int64_t rows, float *y, int threads) {
    if (!m->next) return part_products(m, x, rows, y, threads);
    const int64_t total = matrix_outputs(m);
    if (rows == 1) {
        for (int64_t start = 0; m; start += m->outputs, m = (const block_matrix *)m->next)
            if (part_products(m, x, 1, y + start, threads)) return -1;
        return 0;
    }
    float *part = malloc(sizeof(float) * (size_t)(rows * total));
    if (!part) return -1;
    int status = 0;
    for (int64_t start = 0; m && status == 0; start += m->outputs, m = (const block_matrix *)m->next) {
        status = part_products(m, x, rows, part, threads);
        for (int64_t r = 0; r < rows && status == 0; r++)
            memcpy(y + r * total + start, part + r * m->outputs, sizeof(float) * (size_t)m->outputs);
    }
    free(part);
    return status;
}

/* Whether m multiplies `inputs` values into `outputs` (its parts' together), in a form products() takes. */
static int fits(const block_matrix *m, int64_t inputs, int64_t outputs) {
    if (matrix_outputs(m) != outputs) return 0;
    for (; m; m = (const block_matrix *)m->next) {
        if (!m->codes || m->inputs != inputs || m->outputs < 1) return 0;
        int64_t elements, bytes;
        if (m->bits == 0) {
            if (gguf_block_form((int)m->gguf_type, &elements, &bytes, NULL) || inputs % elements
                || m->row_bytes < inputs / elements * bytes)
                return 0;
        } else if (m->bits == 16 || m->bits == 32) {
            if (inputs % 8) return 0;
        } else if (!(((m->bits == 4 && m->minimum) || m->bits == 8) && m->scale && inputs % 32 == 0)) {
            return 0;
        }
    }
    return 1;
}

static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    f32x8 squares = f32x8_zero();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const f32x8 v = f32x8_load(x + j);
        squares = f32x8_fma(v, v, squares);
    }
    float total = f32x8_sum(squares);
    for (; j < n; j++) total += x[j] * x[j];
    const float inverse = 1.0f / sqrtf(total / (float)n + eps);
    for (j = 0; j < n; j++) out[j] = weight[j] * (x[j] * inverse);
}

/* Rows of a layer's q, k, v projections (rows, (heads + 2 kv_heads) * head_dim) in place, before RoPE: plus the
 * biases (Qwen2), then each q and k head RMS-normed (Qwen3), where the layer has them. */
static void before_rope(const decoder_shape *shape, const decoder_layer *layer, float *qkv, int64_t rows) {
    const int64_t d = shape->head_dim, heads = shape->heads, kv_heads = shape->kv_heads;
    const int64_t projected = (heads + 2 * kv_heads) * d;
    for (int64_t r = 0; r < rows && layer->qkv_bias; r++)
        for (int64_t j = 0; j < projected; j++) qkv[r * projected + j] += layer->qkv_bias[j];
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * projected;
        for (int64_t h = 0; h < heads && layer->q_norm; h++)
            rms_norm(row + h * d, layer->q_norm, d, shape->norm_eps, row + h * d);
        for (int64_t h = 0; h < kv_heads && layer->k_norm; h++)
            rms_norm(row + (heads + h) * d, layer->k_norm, d, shape->norm_eps, row + (heads + h) * d);
    }
}

/* v (head_dim) in place: v * cos + rotate_half(v) * sin, rotate_half(v) = (-v[half:], v[:half]). */
static void rotate_into(const float *v, const float *cos, const float *sin, int64_t head_dim, float *out) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float first = v[i], second = v[i + half];
        out[i] = first * cos[i] - second * sin[i];
        out[i + half] = second * cos[i + half] + first * sin[i + half];
    }
}

static void rotate(float *v, const float *cos, const float *sin, int64_t head_dim) {
    rotate_into(v, cos, sin, head_dim, v);
}

/* RoPE for a question's rows of one projection, as transformers' apply_rotary_pos_emb computes it (each product
 * rounded, then the sum: with rotate_half's negation, the same bits): x (rows, heads, head_dim), the projection's
 * output; cos, sin (rows, head_dim); out (heads, rows, head_dim), the layout attention reads. Returns 0, or -1 for an
 * odd head_dim. */
int rope_rows(const float *x, int64_t rows, int64_t heads, int64_t head_dim, const float *cos, const float *sin,
              float *out) {
    if (head_dim < 2 || head_dim % 2) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++)
            rotate_into(x + (r * heads + h) * head_dim, cos + r * head_dim, sin + r * head_dim, head_dim,
                        out + (h * rows + r) * head_dim);
    return 0;
}

#define ROWS_AHEAD 8  /* keys or values ahead of the one read that the attention prefetches */

/* One KV head's keys or values as the attention reads them: rows [0, held_rows) where the question's pass left
 * them (the cache, fp32 or bf16: no copy), rows from held_rows on from the answer's own fp32 buffer. */
typedef struct {
    const void *held;     /* (held_rows, head_dim), fp32 or bf16 */
    const float *answer;  /* (rows written, head_dim) */
    int64_t held_rows;
    int bf16;
} kv_rows;

/* The 8 values from element `index` of `buffer` as floats: fp32 as they are, bf16 exactly widened. Inlined where
 * `bf16` is a constant, so each loop below is compiled once per element type. */
__attribute__((always_inline)) static inline f32x8 row_floats(const void *buffer, int64_t index, const int bf16) {
    return bf16 ? f32x8_from_bf16((const uint16_t *)buffer + index) : f32x8_load((const float *)buffer + index);
}

/* Row t of `rows` (head_dim values) as floats into out. */
static void row_as_floats(const kv_rows *rows, int64_t t, int64_t head_dim, float *out) {
    if (t >= rows->held_rows) {
        memcpy(out, rows->answer + (t - rows->held_rows) * head_dim, sizeof(float) * (size_t)head_dim);
    } else if (rows->bf16) {
        const uint16_t *row = (const uint16_t *)rows->held + t * head_dim;
        for (int64_t c = 0; c < head_dim; c += 8) f32x8_store(out + c, f32x8_from_bf16(row + c));
    } else {
        memcpy(out, (const float *)rows->held + t * head_dim, sizeof(float) * (size_t)head_dim);
    }
}

/* query . key for the 8 keys from element `start` of `keys` (rows head_dim apart). */
__attribute__((always_inline)) static inline f32x8 eight_scores(const float *query, const void *keys, int64_t start,
                                                                  int64_t head_dim, const int bf16) {
    f32x8 a0 = f32x8_zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t c = 0; c < head_dim; c += 8) {
        const f32x8 q = f32x8_load(query + c);
        const int64_t k = start + c;
        a0 = f32x8_fma(q, row_floats(keys, k, bf16), a0);
        a1 = f32x8_fma(q, row_floats(keys, k + head_dim, bf16), a1);
        a2 = f32x8_fma(q, row_floats(keys, k + 2 * head_dim, bf16), a2);
        a3 = f32x8_fma(q, row_floats(keys, k + 3 * head_dim, bf16), a3);
        a4 = f32x8_fma(q, row_floats(keys, k + 4 * head_dim, bf16), a4);
        a5 = f32x8_fma(q, row_floats(keys, k + 5 * head_dim, bf16), a5);
        a6 = f32x8_fma(q, row_floats(keys, k + 6 * head_dim, bf16), a6);
        a7 = f32x8_fma(q, row_floats(keys, k + 7 * head_dim, bf16), a7);
    }
    return f32x8_sums_of_eight(a0, a1, a2, a3, a4, a5, a6, a7);
}

/* query . key for the key at element `start` of `keys`. */
__attribute__((always_inline)) static inline float one_score(const float *query, const void *keys, int64_t start,
                                                             int64_t head_dim, const int bf16) {
    f32x8 a = f32x8_zero();
    for (int64_t c = 0; c < head_dim; c += 8)
        a = f32x8_fma(f32x8_load(query + c), row_floats(keys, start + c, bf16), a);
    return f32x8_sum(a);
}

/* scores[h * stride + t] = query[h] . keys[t] for the `count` query heads h and t in [first, end): eight keys at a
 * time, every head over those eight before the next eight (read from memory once, while the stream runs on; a head at
 * a time over the whole chunk left the memory idle for the group's other heads: 1.10x the decode at 4k kept positions),
 * from the same t as over one buffer, so the scores are the same bits wherever the two parts meet. */
static void dot_keys(const float *query, int64_t count, const kv_rows *keys, int64_t first, int64_t end,
                     int64_t head_dim, float *scores, int64_t stride) {
    const int64_t held = keys->held_rows;
    int64_t t = first;
    for (; t + 8 <= end; t += 8) {
        float rows[8 * SNAPKV_MAX_DECODE_HEAD_DIM];
        const void *block = NULL;  /* the eight keys: in keys->held (fp32 or bf16), keys->answer, or rows */
        int64_t start = 0;
        int bf16 = 0;
        if (t >= held) block = keys->answer, start = (t - held) * head_dim;
        else if (t + 8 <= held) block = keys->held, start = t * head_dim, bf16 = keys->bf16;
        else {  /* the 8 keys where the cache's rows end and the answer's begin */
            for (int r = 0; r < 8; r++) row_as_floats(keys, t + r, head_dim, rows + r * head_dim);
            block = rows;
        }
        const int64_t key_bytes = bf16 ? 2 : 4;  /* prefetched once for all the group's heads (1.02x the full cache) */
        prefetch_bytes((const char *)block + (start + ROWS_AHEAD * head_dim) * key_bytes, 8 * head_dim * key_bytes);
        for (int64_t h = 0; h < count; h++) {
            const float *q = query + h * head_dim;
            const f32x8 eight = bf16 ? eight_scores(q, block, start, head_dim, 1)
                                     : eight_scores(q, block, start, head_dim, 0);
            f32x8_store(scores + h * stride + t, eight);
        }
    }
    for (; t < end; t++)
        for (int64_t h = 0; h < count; h++) {
            const float *q = query + h * head_dim;
            float *score = scores + h * stride + t;
            if (t >= held) *score = one_score(q, keys->answer, (t - held) * head_dim, head_dim, 0);
            else if (keys->bf16) *score = one_score(q, keys->held, t * head_dim, head_dim, 1);
            else *score = one_score(q, keys->held, t * head_dim, head_dim, 0);
        }
}

#define CHUNK 128       /* keys per task: a chunk of one KV head's keys or values stays in L1 for its whole group */
#define VALUE_ROWS 3    /* query heads summed together over a chunk of values (a register tile of 3 x 64 channels) */

/* target[i * target_stride + 0 .. 8 * blocks] = sum over t in [first, end) of w[i][t] * v[(t - first) * head_dim + ..]
 * for i < live: `blocks` (8, 4 or 1) vectors of 8 channels, 3 rows, 24 (12, 3) independent sums in registers, started
 * from zero or, with `carry`, from what target holds (a sum going on from another part's rows: the same bits as one
 * loop over both); v fp32 or bf16. */
__attribute__((always_inline)) static inline void weigh_values(const float *const w[VALUE_ROWS], const void *v,
                                                                int64_t first, int64_t end, int64_t head_dim,
                                                                const int blocks, int64_t live, float *target,
                                                                int64_t target_stride, const int bf16, int carry) {
    const int64_t value_bytes = bf16 ? 2 : 4;
    f32x8 sums[VALUE_ROWS][8];
    for (int i = 0; i < VALUE_ROWS; i++)
        for (int b = 0; b < 8; b++)
            sums[i][b] = carry && i < live && b < blocks ? f32x8_load(target + i * target_stride + 8 * b)
                                                         : f32x8_zero();
    for (int64_t t = first, row_start = 0; t < end; t++, row_start += head_dim) {
        prefetch_bytes((const char *)v + (row_start + ROWS_AHEAD * head_dim) * value_bytes, 8 * blocks * value_bytes);
        for (int b = 0; b < blocks; b++) {
            const f32x8 row = row_floats(v, row_start + 8 * b, bf16);
            for (int i = 0; i < VALUE_ROWS; i++)
                sums[i][b] = f32x8_fma(f32x8_splat_at(w[i] + t), row, sums[i][b]);
        }
    }
    for (int i = 0; i < live; i++)
        for (int b = 0; b < blocks; b++) f32x8_store(target + i * target_stride + 8 * b, sums[i][b]);
}

/* The values of rows [first, end) of one KV head (the cache's part, then the answer's) weighed for up to VALUE_ROWS
 * query heads (w), into target: 64 channels at a time (a row of a head_dim of 64 in one pass, so that each row is read
 * from memory in one go: 1.18x the decode at 4k kept positions against 32 at a time), then 32, then 8 (head_dim a
 * multiple of 8). Each channel's sum runs over the rows in the same order whatever the width: the same bits. */
static void weigh_chunk(const float *const w[VALUE_ROWS], const kv_rows *values, int64_t first, int64_t end,
                        int64_t head_dim, int64_t live, float *target) {
    const int64_t held = values->held_rows, held_bytes = values->bf16 ? 2 : 4;
    const int64_t held_end = end < held ? end : held, answer_first = first > held ? first : held;
    for (int64_t c = 0; c < head_dim;) {
        const int blocks = c + 64 <= head_dim ? 8 : c + 32 <= head_dim ? 4 : 1;
        if (first < held_end) {
            const void *v = (const char *)values->held + (first * head_dim + c) * held_bytes;
            float *out = target + c;
            if (values->bf16 && blocks == 8)
                weigh_values(w, v, first, held_end, head_dim, 8, live, out, head_dim, 1, 0);
            else if (values->bf16 && blocks == 4)
                weigh_values(w, v, first, held_end, head_dim, 4, live, out, head_dim, 1, 0);
            else if (values->bf16) weigh_values(w, v, first, held_end, head_dim, 1, live, out, head_dim, 1, 0);
            else if (blocks == 8) weigh_values(w, v, first, held_end, head_dim, 8, live, out, head_dim, 0, 0);
            else if (blocks == 4) weigh_values(w, v, first, held_end, head_dim, 4, live, out, head_dim, 0, 0);
            else weigh_values(w, v, first, held_end, head_dim, 1, live, out, head_dim, 0, 0);
        }
        if (answer_first < end) {
            const float *v = values->answer + (answer_first - held) * head_dim + c;
            const int carry = first < held_end;
            if (blocks == 8) weigh_values(w, v, answer_first, end, head_dim, 8, live, target + c, head_dim, 0, carry);
            else if (blocks == 4)
                weigh_values(w, v, answer_first, end, head_dim, 4, live, target + c, head_dim, 0, carry);
            else weigh_values(w, v, answer_first, end, head_dim, 1, live, target + c, head_dim, 0, carry);
        }
        c += 8 * blocks;
    }
}

/* Scratch floats attend_one needs for `tokens` keys. */
static int64_t attention_scratch(int64_t heads, int64_t head_dim, int64_t tokens) {
    return heads * tokens + ((tokens + CHUNK - 1) / CHUNK) * heads * head_dim;
}

/* KV head kv's keys (values = 0) or values (values = 1) of `layer`. */
static kv_rows layer_rows(const decoder_layer *layer, int64_t kv, int64_t head_dim, int values) {
    const int bf16 = layer->held_bits == 16;
    const char *held = (const char *)(values ? layer->held_values : layer->held_keys);
    const float *answer = values ? layer->values : layer->keys;
    return (kv_rows){held + kv * layer->held * head_dim * (bf16 ? 2 : 4), answer + kv * layer->capacity * head_dim,
                     layer->held, bf16};
}

/* out (heads, head_dim) = softmax(query . K^T) @ V per query head over the layer's held rows and the answer's;
 * query already scaled. scratch: attention_scratch floats. Each chunk of keys and of values is read from memory once
 * for all the query heads of its KV head; the values' chunks give partial sums, added up at the end. */
static void attend_one(const float *query, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       const decoder_layer *layer, float *scratch, float *out, int threads) {
    const int64_t tokens = layer->held + layer->filled;
    const int64_t group = heads / kv_heads, chunks = (tokens + CHUNK - 1) / CHUNK;
    float *scores = scratch;                   /* (heads, tokens) */
    float *partial = scratch + heads * tokens; /* (chunks, heads, head_dim) */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * chunks; task++) {
            const int64_t kv = task / chunks, first = (task % chunks) * CHUNK;
            const int64_t end = first + CHUNK < tokens ? first + CHUNK : tokens;
            const kv_rows keys = layer_rows(layer, kv, head_dim, 0);
            dot_keys(query + kv * group * head_dim, group, &keys, first, end, head_dim, scores + kv * group * tokens,
                     tokens);
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < heads; h++) softmax_row(scores + h * tokens, tokens, NULL, 0);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * chunks; task++) {
            const int64_t kv = task / chunks, chunk = task % chunks, first = chunk * CHUNK;
            const int64_t end = first + CHUNK < tokens ? first + CHUNK : tokens;
            const kv_rows values = layer_rows(layer, kv, head_dim, 1);
            for (int64_t block = 0; block * VALUE_ROWS < group; block++) {
                const int64_t first_head = kv * group + block * VALUE_ROWS;
                const int64_t live = group - block * VALUE_ROWS < VALUE_ROWS ? group - block * VALUE_ROWS : VALUE_ROWS;
                const float *w[VALUE_ROWS];  /* rows past the group's last repeat its first; not stored */
                for (int i = 0; i < VALUE_ROWS; i++) w[i] = scores + (first_head + (i < live ? i : 0)) * tokens;
                weigh_chunk(w, &values, first, end, head_dim, live, partial + (chunk * heads + first_head) * head_dim);
            }
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t c = 0; c < head_dim; c += 8) {
                f32x8 total = f32x8_load(partial + h * head_dim + c);
                for (int64_t chunk = 1; chunk < chunks; chunk++)
                    total = f32x8_add(total, f32x8_load(partial + (chunk * heads + h) * head_dim + c));
                f32x8_store(out + h * head_dim + c, total);
            }
    }
}

/* x / (1 + e^-x), the input clamped where e^-x would overflow (the result there is 0 in fp32 anyway). */
static void silu_times(const float *gate, const float *up, int64_t n, float *out) {
    const f32x8 one = f32x8_splat(1.0f), highest = f32x8_splat(88.0f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const f32x8 x = f32x8_load(gate + j);
        const f32x8 e = exp_8(f32x8_min(f32x8_sub(f32x8_zero(), x), highest));
        f32x8_store(out + j, f32x8_mul(f32x8_div(x, f32x8_add(one, e)), f32x8_load(up + j)));
    }
    for (; j < n; j++) out[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}

static void add_into(float *hidden, const float *added, int64_t n) {
    for (int64_t j = 0; j < n; j++) hidden[j] += added[j];
}

/* The part of a layer after its attention, for `rows` rows: hidden += attended @ Wo^T; then hidden +=
 * (silu(gate) * up) @ Wdown^T with gate, up = RMSNorm(hidden) @ [Wgate; Wup]^T. attended (rows, heads * head_dim);
 * hidden (rows, shape->hidden) in and out; added and normed (rows, hidden), gate_up (rows, 2 * intermediate) and
 * activation (rows, intermediate) its scratch. Returns 0, or -1 (no memory; hidden then as it came, or past the
 * attention's sum only). */
static int after_attention(const decoder_shape *shape, const decoder_layer *layer, int64_t rows, const float *attended,
                           float *hidden, float *added, float *normed, float *gate_up, float *activation, int threads) {
    const int64_t n = shape->hidden, inner = shape->intermediate;
    int status = products(&layer->o, attended, rows, added, threads);
    if (status == 0) {
        add_into(hidden, added, rows * n);
        for (int64_t r = 0; r < rows; r++) rms_norm(hidden + r * n, layer->post_norm, n, shape->norm_eps, normed + r * n);
        status = products(&layer->gate_up, normed, rows, gate_up, threads);
    }
    if (status == 0) {
        for (int64_t r = 0; r < rows; r++)  /* each row's gate, then its up */
            silu_times(gate_up + r * 2 * inner, gate_up + r * 2 * inner + inner, inner, activation + r * inner);
        status = products(&layer->down, activation, rows, added, threads);
    }
    if (status == 0) add_into(hidden, added, rows * n);
    return status;
}

/* hidden (shape->hidden) in and out: the token's embedding in, the last layer's output (before the final norm)
 * out. Returns 0, -1 (a matrix it does not take, no memory) or -2 (a cache full: nothing written). */
int decode_token(const decoder_shape *shape, decoder_layer *layers, int64_t layer_count, float *hidden,
                 const float *cos, const float *sin, int threads) {
    const int64_t d = shape->head_dim, heads = shape->heads, kv_heads = shape->kv_heads;
    if (d % 8 || d > SNAPKV_MAX_DECODE_HEAD_DIM || kv_heads < 1 || heads % kv_heads) return -1;
    const int64_t n = shape->hidden, projected = (heads + 2 * kv_heads) * d;
    int64_t longest = 0;
    for (int64_t l = 0; l < layer_count; l++) {  /* everything checked before anything is written */
        const decoder_layer *layer = &layers[l];
        if (!fits(&layer->qkv, n, projected) || !fits(&layer->o, heads * d, n)
            || !fits(&layer->gate_up, n, 2 * shape->intermediate) || !fits(&layer->down, shape->intermediate, n))
            return -1;
        if (layer->held_bits != 16 && layer->held_bits != 32) return -1;
        if (layer->filled >= layer->capacity) return -2;
        longest = layer->held + layer->filled + 1 > longest ? layer->held + layer->filled + 1 : longest;
    }
    const int64_t widest = projected > 2 * shape->intermediate ? projected : 2 * shape->intermediate;
    float *scratch = malloc(sizeof(float) * (size_t)(2 * n + widest + heads * d + shape->intermediate
                                                     + attention_scratch(heads, d, longest)));
    if (!scratch) return -1;
    float *normed = scratch, *added = normed + n, *wide = added + n, *attended = wide + widest;
    float *activation = attended + heads * d, *attention = activation + shape->intermediate;
    int status = 0;
    for (int64_t l = 0; l < layer_count && status == 0; l++) {
        decoder_layer *layer = &layers[l];
        rms_norm(hidden, layer->input_norm, n, shape->norm_eps, normed);
        if ((status = products(&layer->qkv, normed, 1, wide, threads))) break;
        before_rope(shape, layer, wide, 1);
        float *query = wide, *key = wide + heads * d, *value = key + kv_heads * d;
        for (int64_t h = 0; h < heads; h++) {
            rotate(query + h * d, cos, sin, d);
            for (int64_t c = 0; c < d; c++) query[h * d + c] *= shape->scaling;
        }
        const int64_t head_stride = layer->capacity * d, slot = layer->filled;
        for (int64_t h = 0; h < kv_heads; h++) {
            rotate(key + h * d, cos, sin, d);
            memcpy(layer->keys + h * head_stride + slot * d, key + h * d, sizeof(float) * (size_t)d);
            memcpy(layer->values + h * head_stride + slot * d, value + h * d, sizeof(float) * (size_t)d);
        }
        layer->filled = slot + 1;
        attend_one(query, heads, kv_heads, d, layer, attention, attended, threads);
        status = after_attention(shape, layer, 1, attended, hidden, added, normed, wide, activation, threads);
    }
    free(scratch);
    return status;
}

/* The next token's logits from the last layer's output: logits (head->outputs) = RMSNorm(hidden) @ head^T, hidden
 * (n) and the final norm's weight (n) fp32. Returns 0, or -1 (a head of another form or inputs, no memory). */
int final_logits(const float *hidden, int64_t n, const float *norm, float eps, const block_matrix *head,
                 float *logits, int threads) {
    if (!fits(head, n, matrix_outputs(head))) return -1;
    float *normed = malloc(sizeof(float) * (size_t)n);
    if (!normed) return -1;
    rms_norm(hidden, norm, n, eps, normed);
    const int status = products(head, normed, 1, logits, threads);
    free(normed);
    return status;
}

/* A question's rows through the part of a layer before its attention, as decode_token computes one token's:
 * hidden (rows, shape->hidden) in; normed = RMSNorm(hidden) (rows, hidden) out; q, k, v = normed @ [Wq; Wk; Wv]^T
 * with RoPE on q and k at each row's position (cos, sin: (rows, head_dim)), out as query (heads, rows, head_dim),
 * key and value (kv_heads, rows, head_dim): the layouts the attention and the cache take (query not yet scaled).
 * Returns 0, or -1 (a matrix of another shape or form, no memory). */
int question_before_attention(const decoder_shape *shape, const decoder_layer *layer, int64_t rows, const float *hidden,
                              const float *cos, const float *sin, float *normed, float *query, float *key,
                              float *value, int threads) {
    const int64_t d = shape->head_dim, heads = shape->heads, kv_heads = shape->kv_heads, n = shape->hidden;
    const int64_t projected = (heads + 2 * kv_heads) * d;
    if (d % 8 || kv_heads < 1 || heads % kv_heads || rows < 1 || !fits(&layer->qkv, n, projected)) return -1;
    float *wide = malloc(sizeof(float) * (size_t)(rows * projected));  /* (rows, q + k + v) */
    if (!wide) return -1;
    for (int64_t r = 0; r < rows; r++) rms_norm(hidden + r * n, layer->input_norm, n, shape->norm_eps, normed + r * n);
    const int status = products(&layer->qkv, normed, rows, wide, threads);
    if (status == 0) before_rope(shape, layer, wide, rows);
    for (int64_t r = 0; r < rows && status == 0; r++) {
        const float *row = wide + r * projected, *row_cos = cos + r * d, *row_sin = sin + r * d;
        for (int64_t h = 0; h < heads; h++) rotate_into(row + h * d, row_cos, row_sin, d, query + (h * rows + r) * d);
        for (int64_t h = 0; h < kv_heads; h++) {
            rotate_into(row + (heads + h) * d, row_cos, row_sin, d, key + (h * rows + r) * d);
            memcpy(value + (h * rows + r) * d, row + (heads + kv_heads + h) * d, sizeof(float) * (size_t)d);
        }
    }
    free(wide);
    return status;
}

/* after_attention for a question's rows, as decode_token computes one token's. Returns 0, or -1 (a matrix of another
 * shape or form, no memory). */
int question_after_attention(const decoder_shape *shape, const decoder_layer *layer, int64_t rows,
                             const float *attended, float *hidden, int threads) {
    const int64_t n = shape->hidden, inner = shape->intermediate, width = shape->heads * shape->head_dim;
    if (rows < 1 || !fits(&layer->o, width, n) || !fits(&layer->gate_up, n, 2 * inner) || !fits(&layer->down, inner, n))
        return -1;
    float *scratch = malloc(sizeof(float) * (size_t)(rows * (2 * n + 3 * inner)));
    if (!scratch) return -1;
    const int status = after_attention(shape, layer, rows, attended, hidden, scratch, scratch + rows * n,
                                       scratch + 2 * rows * n, scratch + rows * (2 * n + 2 * inner), threads);
    free(scratch);
    return status;
}
