/* Scalar references: what each vector kernel computes, as plain loops over one value at a time in the order the
 * mathematics reads, each sum in double. `<kernel>_generic` takes the kernel's own arguments and writes what it
 * writes; it is the oracle tests/test_kernel_references.py compares every build's kernel against (the kernel within
 * fp32 rounding of it). Nothing in snapkv calls these: they are written to be read, not to be fast, and use no
 * vector types, no OpenMP (`threads` is ignored) and no helper from the other files, so that a kernel and its
 * reference share no code that could be wrong in both. A new vector kernel starts here.
 *
 * Layouts are the kernels' (kernels.h, and the comment at the top of each kernel's file):
 *   4-bit blocks: 32 weights along the inputs in 16 bytes, weight j in the low nibble of byte j and weight j + 16
 *                 in its high nibble; w = scale * q + minimum (blockwise_matmul.c)
 *   8-bit blocks: 32 signed bytes; w = scale * q
 *   bf16 weights: the high 16 bits of the fp32 value
 *   saved codes:  snapkv.storage.quantize's layout (dequantize.c). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define BLOCK 32

static float bf16_to_float(uint16_t half) {
    const uint32_t widened = (uint32_t)half << 16;
    float value;
    memcpy(&value, &widened, sizeof value);
    return value;
}

static uint16_t float_to_bf16(float value) {  /* to nearest, ties to even, as PyTorch rounds */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static float half_to_float(uint16_t half) {  /* IEEE binary16, every case */
    const int exponent = (half >> 10) & 0x1F, mantissa = half & 0x3FF;
    const float sign = half & 0x8000 ? -1.0f : 1.0f;
    if (exponent == 0x1F) return mantissa ? NAN : sign * INFINITY;
    if (exponent == 0) return sign * ldexpf((float)mantissa, -24);
    return sign * ldexpf((float)(mantissa | 0x400), exponent - 25);
}

/* Weight i (0 <= i < k) of output row `out` of a matrix in 4- or 8-bit blocks. */
static float block_weight(int bits, const uint8_t *codes, const float *scale, const float *minimum, int64_t k,
                          int64_t out, int64_t i) {
    const int64_t blocks = k / BLOCK, b = i / BLOCK, j = i % BLOCK;
    if (bits == 8) return scale[out * blocks + b] * (float)((const int8_t *)codes)[out * k + i];
    const uint8_t byte = codes[out * (k / 2) + b * (BLOCK / 2) + j % (BLOCK / 2)];
    const int q = j < BLOCK / 2 ? byte & 0x0F : byte >> 4;
    return scale[out * blocks + b] * (float)q + minimum[out * blocks + b];
}

/* y (rows, n) = x (rows, k) @ W^T, weight(out, i) giving W. */
#define PRODUCT(weight_of)                                                 \
    for (int64_t r = 0; r < rows; r++)                                     \
        for (int64_t out = 0; out < n; out++) {                            \
            double total = 0.0;                                            \
            for (int64_t i = 0; i < k; i++) total += (double)x[r * k + i] * (double)(weight_of); \
            y[r * n + out] = (float)total;                                 \
        }

int matmul_4bit_generic(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                        const float *minimum, int64_t n, float *y, int threads) {
    (void)threads;
    if (rows < 1 || rows > SNAPKV_MAX_ROWS || k % BLOCK) return -1;
    PRODUCT(block_weight(4, codes, scale, minimum, k, out, i))
    return 0;
}

int matmul_8bit_generic(const float *x, int64_t rows, int64_t k, const int8_t *codes, const float *scale, int64_t n,
                        float *y, int threads) {
    (void)threads;
    if (rows < 1 || rows > SNAPKV_MAX_ROWS || k % BLOCK) return -1;
    PRODUCT(block_weight(8, (const uint8_t *)codes, scale, NULL, k, out, i))
    return 0;
}

int linear_rows_generic(const float *x, int64_t rows, int64_t k, const float *weight, int64_t n, float *y,
                        int threads) {
    (void)threads;
    if (rows < 1 || k < 8 || k % 8) return -1;
    PRODUCT(weight[out * k + i])
    return 0;
}

int linear_rows_blocks_generic(const float *x, int64_t rows, int64_t k, int bits, const uint8_t *codes,
                               const float *scale, const float *minimum, int64_t n, float *y, int threads) {
    (void)threads;
    if (rows < 1 || k < 32 || k % 32 || !(bits == 4 || bits == 8) || (bits == 4 && !minimum)) return -1;
    PRODUCT(block_weight(bits, codes, scale, minimum, k, out, i))
    return 0;
}

int linear_rows_bf16_generic(const float *x, int64_t rows, int64_t k, const void *weight, int64_t n, float *y,
                             int threads) {
    (void)threads;
    if (rows < 1 || k < 8 || k % 8) return -1;
    PRODUCT(bf16_to_float(((const uint16_t *)weight)[out * k + i]))
    return 0;
}

int matmul_dense_generic(const float *x, int64_t rows, int64_t k, const void *weight, int bf16, int64_t n, float *y,
                         int threads) {
    (void)threads;
    if (rows < 1 || k < 8 || k % 8 || n < 1) return -1;
    PRODUCT(bf16 ? bf16_to_float(((const uint16_t *)weight)[out * k + i]) : ((const float *)weight)[out * k + i])
    return 0;
}

/* few_rows.c's attend_rows: each row's scores (the row scaled, then its dot product with each key; the tail mask
 * added on the last `question` columns), weights = e^(score - the row's largest), out = weights @ values / their
 * sum, window_sums: per query head the softmax of its question's last `window` rows, added. */
int attend_rows_generic(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale,
                        const float *keys, int64_t key_head_stride, const float *values, int64_t value_head_stride,
                        int64_t tokens, int64_t head_dim, const float *tail_mask, float *weights, float *out,
                        int64_t window, float *window_sums, int threads) {
    (void)threads;
    if (head_dim % 16 || head_dim > SNAPKV_MAX_ATTENTION_HEAD_DIM || kv_heads < 1 || rows < 1 || question < 1
        || question > tokens || rows % question)
        return -1;
    if (window_sums && (window < 1 || window > question)) return -1;
    for (int64_t h = 0; h < kv_heads; h++)
        for (int64_t r = 0; r < rows; r++) {
            const float *q = query + (h * rows + r) * head_dim;
            float *w = weights + (h * rows + r) * tokens;
            const int64_t i = r % question;  /* the question's token */
            float largest = -INFINITY;
            for (int64_t t = 0; t < tokens; t++) {
                const float *key = keys + h * key_head_stride + t * head_dim;
                double dot = 0.0;
                for (int64_t c = 0; c < head_dim; c++) dot += (double)(q[c] * scale) * (double)key[c];
                float score = (float)dot;
                if (t >= tokens - question) score += tail_mask[i * question + (t - (tokens - question))];
                w[t] = score;
                largest = score > largest ? score : largest;
            }
            double sum = 0.0;
            for (int64_t t = 0; t < tokens; t++) {
                w[t] = expf(w[t] - largest);
                sum += w[t];
            }
            for (int64_t c = 0; c < head_dim; c++) {
                double weighted = 0.0;
                for (int64_t t = 0; t < tokens; t++)
                    weighted += (double)w[t] * (double)values[h * value_head_stride + t * head_dim + c];
                out[(h * rows + r) * head_dim + c] = (float)(weighted / sum);
            }
            if (window_sums && i >= question - window) {
                float *sums = window_sums + (h * rows + r) / question * tokens;
                for (int64_t t = 0; t < tokens; t++)
                    sums[t] = (float)((i == question - window ? 0.0 : (double)sums[t]) + (double)w[t] / sum);
            }
        }
    return 0;
}

/* Code `index` of a little-endian bit stream of `bits`-bit codes. */
static unsigned code_at(const uint8_t *stream, int64_t index, int bits) {
    unsigned code = 0;
    for (int b = 0; b < bits; b++) {
        const int64_t bit = index * bits + b;
        code |= (unsigned)(stream[bit / 8] >> (bit % 8) & 1) << b;
    }
    return code;
}

/* Row t of head h of a saved tensor (dequantize_rows' layout, `tokens` rows a head), decoded and rotated back. */
static void saved_row(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum, int64_t tokens,
                      int64_t head_dim, int bits, int along_tokens, int64_t group, int64_t rotation_block, int64_t h,
                      int64_t t, float *row) {
    const int64_t groups = ((along_tokens ? tokens : head_dim) + group - 1) / group, group_bytes = group * bits / 8;
    float decoded[SNAPKV_MAX_STORED_HEAD_DIM];
    for (int64_t c = 0; c < head_dim; c++) {
        /* the value's group, and its place in it: along the tokens, channel c's group of tokens */
        const int64_t at = along_tokens ? (h * head_dim + c) * groups + t / group : (h * tokens + t) * groups + c / group;
        const int64_t place = along_tokens ? t % group : c % group;
        const float scaled = (float)code_at(packed + at * group_bytes, place, bits) * half_to_float(scale[at]);
        decoded[c] = scaled + half_to_float(minimum[at]);
    }
    for (int64_t c = 0; c < head_dim; c++) {
        if (!rotation_block) {
            row[c] = decoded[c];
            continue;
        }
        const int64_t start = c - c % rotation_block;
        double total = 0.0;
        for (int64_t j = 0; j < rotation_block; j++)
            total += (__builtin_popcountll((unsigned long long)(j & (c - start))) & 1 ? -1.0 : 1.0) * (double)decoded[start + j];
        row[c] = (float)(total / sqrt((double)rotation_block));
    }
}

/* dequantize.c's dequantize_rows: each value its code times its group's scale plus its minimum; a rotated tensor's
 * rows then times the orthonormal Hadamard matrix of `rotation_block` (entry (i, j): (-1)^popcount(i & j) over
 * sqrt(rotation_block)), block by block; row (h, t) written to row destination[h * tokens + t] (or h * tokens + t),
 * fp32 or bf16 (out_kind 0 or 1). */
int dequantize_rows_generic(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum, int64_t heads,
                            int64_t tokens, int64_t head_dim, int bits, int along_tokens, int64_t group,
                            int64_t rotation_block, const int64_t *destination, void *out, int out_kind,
                            int threads) {
    (void)threads;
    if (head_dim < 1 || head_dim > SNAPKV_MAX_STORED_HEAD_DIM || !(bits == 2 || bits == 3 || bits == 4 || bits == 8)
        || group < 1 || !(out_kind == 0 || out_kind == 1))
        return -1;
    if (rotation_block && (rotation_block & (rotation_block - 1) || head_dim % rotation_block)) return -1;
    float row[SNAPKV_MAX_STORED_HEAD_DIM];
    for (int64_t h = 0; h < heads; h++)
        for (int64_t t = 0; t < tokens; t++) {
            saved_row(packed, scale, minimum, tokens, head_dim, bits, along_tokens, group, rotation_block, h, t, row);
            const int64_t at = (destination ? destination[h * tokens + t] : h * tokens + t) * head_dim;
            for (int64_t c = 0; c < head_dim; c++) {
                if (out_kind == 1) ((uint16_t *)out)[at + c] = float_to_bf16(row[c]);
                else ((float *)out)[at + c] = row[c];
            }
        }
    return 0;
}


/* dequantize.c's dequantize_positions: out row (h, i) is position positions[h * kept + i] of head h: a stored
 * position's row from the part its column (column_of, or the position itself) falls in, the parts' columns one after
 * another (part_shapes: per part tokens, bits, along_tokens, group, rotation_block; part_pointers: codes, scale,
 * minimum); from `stored` on, the question's own fp32 rows. */
int dequantize_positions_generic(const void *const *part_pointers, const int64_t *part_shapes, int parts,
                                 const int64_t *column_of, int64_t heads, int64_t stored, int64_t head_dim,
                                 const int64_t *positions, int64_t kept, const float *question_rows, int64_t question,
                                 float *out, int threads) {
    (void)threads;
    if (head_dim < 1 || head_dim > SNAPKV_MAX_STORED_HEAD_DIM || parts < 1) return -1;
    int64_t columns = 0;
    for (int i = 0; i < parts; i++) columns += part_shapes[5 * i];
    if (columns != stored) return -1;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t i = 0; i < kept; i++) {
            const int64_t p = positions[h * kept + i];
            float *row = out + (h * kept + i) * head_dim;
            if (p < 0 || p >= stored + question) return -1;
            if (p >= stored) {
                for (int64_t c = 0; c < head_dim; c++) row[c] = question_rows[(h * question + p - stored) * head_dim + c];
                continue;
            }
            int64_t column = column_of ? column_of[h * stored + p] : p;
            int part = 0;
            while (part < parts && column >= part_shapes[5 * part]) column -= part_shapes[5 * part++];
            if (column < 0 || part == parts) return -1;
            const int64_t *shape = part_shapes + 5 * part;
            const void *const *pointers = part_pointers + 3 * part;
            saved_row(pointers[0], pointers[1], pointers[2], shape[0], head_dim, (int)shape[1], (int)shape[2], shape[3],
                      shape[4], h, column, row);
        }
    return 0;
}

/* ---- the decoder layer (decode_step.c), one formula at a time ---- */

/* Weight (out, i) of a decoder's matrix: 4/8-bit blocks, bf16 (16) or fp32 (32) rows, a GGUF type's blocks (0: the
 * block holding it dequantized by gguf_dequantize, exact); out counts over the parts stacked by `next`. */
static float matrix_weight(const block_matrix *m, int64_t out, int64_t i) {
    while (out >= m->outputs) out -= m->outputs, m = (const block_matrix *)m->next;
    if (m->bits == 0) {
        int64_t elements, bytes;
        float block[256];
        gguf_block_form((int)m->gguf_type, &elements, &bytes, NULL);
        gguf_dequantize((int)m->gguf_type, (const uint8_t *)m->codes + out * m->row_bytes + i / elements * bytes, 1,
                        elements, bytes, block, 0, 1);
        return block[i % elements];
    }
    if (m->bits == 32) return ((const float *)m->codes)[out * m->inputs + i];
    if (m->bits == 16) return bf16_to_float(((const uint16_t *)m->codes)[out * m->inputs + i]);
    return block_weight((int)m->bits, m->codes, m->scale, m->minimum, m->inputs, out, i);
}

static int64_t matrix_outputs(const block_matrix *m) {
    int64_t total = 0;
    for (; m; m = (const block_matrix *)m->next) total += m->outputs;
    return total;
}

static int matrix_fits(const block_matrix *m, int64_t inputs, int64_t outputs) {
    if (matrix_outputs(m) != outputs) return 0;
    for (; m; m = (const block_matrix *)m->next) {
        int64_t elements, bytes;
        if (!m->codes || m->inputs != inputs) return 0;
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

/* y (rows, matrix_outputs(m)) = x (rows, m->inputs) @ W^T. */
static void matrix_product(const block_matrix *m, const float *x, int64_t rows, float *y) {
    const int64_t n = matrix_outputs(m), k = m->inputs;
    PRODUCT(matrix_weight(m, out, i))
}

/* x (n) -> weight * x / sqrt(mean(x^2) + eps). */
static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    double squares = 0.0;
    for (int64_t j = 0; j < n; j++) squares += (double)x[j] * (double)x[j];
    const float inverse = (float)(1.0 / sqrt(squares / (double)n + (double)eps));
    for (int64_t j = 0; j < n; j++) out[j] = weight[j] * (x[j] * inverse);
}

/* The q, k, v biases added, then each q and k head RMS-normed, where the layer has them. */
static void before_rope(const decoder_shape *shape, const decoder_layer *layer, float *qkv, int64_t rows) {
    const int64_t d = shape->head_dim, heads = shape->heads, kv_heads = shape->kv_heads;
    const int64_t projected = (heads + 2 * kv_heads) * d;
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * projected;
        for (int64_t j = 0; j < projected && layer->qkv_bias; j++) row[j] += layer->qkv_bias[j];
        for (int64_t h = 0; h < heads && layer->q_norm; h++)
            rms_norm(row + h * d, layer->q_norm, d, shape->norm_eps, row + h * d);
        for (int64_t h = 0; h < kv_heads && layer->k_norm; h++)
            rms_norm(row + (heads + h) * d, layer->k_norm, d, shape->norm_eps, row + (heads + h) * d);
    }
}

/* v * cos + rotate_half(v) * sin, rotate_half(v) = (-v[half:], v[:half]): RoPE. */
static void rope(const float *v, const float *cos, const float *sin, int64_t head_dim, float *out) {
    const int64_t half = head_dim / 2;
    for (int64_t c = 0; c < head_dim; c++) {
        const float rotated = c < half ? -v[c + half] : v[c - half];
        out[c] = v[c] * cos[c] + rotated * sin[c];
    }
}

/* hidden (rows, hidden) += attended @ Wo^T, then += (silu(gate) * up) @ Wdown^T, gate and up from the post norm. */
static int after_attention(const decoder_shape *shape, const decoder_layer *layer, int64_t rows, const float *attended,
                           float *hidden) {
    const int64_t n = shape->hidden, inner = shape->intermediate;
    float *added = malloc(sizeof(float) * (size_t)(rows * n)), *normed = malloc(sizeof(float) * (size_t)(rows * n));
    float *gate_up = malloc(sizeof(float) * (size_t)(rows * 2 * inner));
    float *activation = malloc(sizeof(float) * (size_t)(rows * inner));
    const int ok = added && normed && gate_up && activation;
    if (ok) {
        matrix_product(&layer->o, attended, rows, added);
        for (int64_t j = 0; j < rows * n; j++) hidden[j] += added[j];
        for (int64_t r = 0; r < rows; r++) rms_norm(hidden + r * n, layer->post_norm, n, shape->norm_eps, normed + r * n);
        matrix_product(&layer->gate_up, normed, rows, gate_up);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < inner; j++) {
                const float gate = gate_up[r * 2 * inner + j], up = gate_up[r * 2 * inner + inner + j];
                activation[r * inner + j] = (float)((double)gate / (1.0 + exp(-(double)gate))) * up;
            }
        matrix_product(&layer->down, activation, rows, added);
        for (int64_t j = 0; j < rows * n; j++) hidden[j] += added[j];
    }
    free(added);
    free(normed);
    free(gate_up);
    free(activation);
    return ok ? 0 : -1;
}

/* Key (values = 0) or value (values = 1) row t of KV head kv: the held rows (fp32 or bf16), then the answer's own. */
static const float *cache_row(const decoder_layer *layer, int64_t kv, int64_t t, int64_t head_dim, int values,
                              float *widened) {
    if (t >= layer->held) return (values ? layer->values : layer->keys) + (kv * layer->capacity + t - layer->held) * head_dim;
    const void *held = values ? layer->held_values : layer->held_keys;
    if (layer->held_bits == 32) return (const float *)held + (kv * layer->held + t) * head_dim;
    for (int64_t c = 0; c < head_dim; c++) widened[c] = bf16_to_float(((const uint16_t *)held)[(kv * layer->held + t) * head_dim + c]);
    return widened;
}

int final_logits_generic(const float *hidden, int64_t n, const float *norm, float eps, const block_matrix *head,
                         float *logits, int threads) {
    (void)threads;
    if (!matrix_fits(head, n, matrix_outputs(head))) return -1;
    float *normed = malloc(sizeof(float) * (size_t)n);
    if (!normed) return -1;
    rms_norm(hidden, norm, n, eps, normed);
    matrix_product(head, normed, 1, logits);
    free(normed);
    return 0;
}

int decode_token_generic(const decoder_shape *shape, decoder_layer *layers, int64_t layer_count, float *hidden,
                         const float *cos, const float *sin, int threads) {
    (void)threads;
    const int64_t d = shape->head_dim, heads = shape->heads, kv_heads = shape->kv_heads, n = shape->hidden;
    if (d % 8 || d > SNAPKV_MAX_DECODE_HEAD_DIM || kv_heads < 1 || heads % kv_heads) return -1;
    const int64_t projected = (heads + 2 * kv_heads) * d;
    for (int64_t l = 0; l < layer_count; l++) {
        const decoder_layer *layer = &layers[l];
        if (!matrix_fits(&layer->qkv, n, projected) || !matrix_fits(&layer->o, heads * d, n)
            || !matrix_fits(&layer->gate_up, n, 2 * shape->intermediate)
            || !matrix_fits(&layer->down, shape->intermediate, n) || (layer->held_bits != 16 && layer->held_bits != 32))
            return -1;
        if (layer->filled >= layer->capacity) return -2;
    }
    float *normed = malloc(sizeof(float) * (size_t)n), *qkv = malloc(sizeof(float) * (size_t)projected);
    float *query = malloc(sizeof(float) * (size_t)(heads * d)), *attended = malloc(sizeof(float) * (size_t)(heads * d));
    int status = normed && qkv && query && attended ? 0 : -1;
    for (int64_t l = 0; l < layer_count && status == 0; l++) {
        decoder_layer *layer = &layers[l];
        rms_norm(hidden, layer->input_norm, n, shape->norm_eps, normed);
        matrix_product(&layer->qkv, normed, 1, qkv);
        before_rope(shape, layer, qkv, 1);
        for (int64_t h = 0; h < heads; h++) {
            rope(qkv + h * d, cos, sin, d, query + h * d);
            for (int64_t c = 0; c < d; c++) query[h * d + c] *= shape->scaling;
        }
        for (int64_t kv = 0; kv < kv_heads; kv++) {  /* the token's key and value into the answer's next slot */
            float *key = layer->keys + (kv * layer->capacity + layer->filled) * d;
            rope(qkv + (heads + kv) * d, cos, sin, d, key);
            for (int64_t c = 0; c < d; c++)
                layer->values[(kv * layer->capacity + layer->filled) * d + c] = qkv[(heads + kv_heads + kv) * d + c];
        }
        layer->filled++;
        const int64_t tokens = layer->held + layer->filled;
        double *scores = malloc(sizeof(double) * (size_t)tokens);
        if (!scores) {
            status = -1;
            break;
        }
        for (int64_t h = 0; h < heads; h++) {  /* softmax(q . K^T) @ V over KV head h / (heads / kv_heads) */
            const int64_t kv = h / (heads / kv_heads);
            float widened[SNAPKV_MAX_DECODE_HEAD_DIM];
            double largest = -INFINITY, sum = 0.0;
            for (int64_t t = 0; t < tokens; t++) {
                const float *key = cache_row(layer, kv, t, d, 0, widened);
                double dot = 0.0;
                for (int64_t c = 0; c < d; c++) dot += (double)query[h * d + c] * (double)key[c];
                scores[t] = dot;
                largest = dot > largest ? dot : largest;
            }
            for (int64_t t = 0; t < tokens; t++) sum += scores[t] = exp(scores[t] - largest);
            double weighted[SNAPKV_MAX_DECODE_HEAD_DIM] = {0};
            for (int64_t t = 0; t < tokens; t++) {
                const float *value = cache_row(layer, kv, t, d, 1, widened);
                for (int64_t c = 0; c < d; c++) weighted[c] += scores[t] * (double)value[c];
            }
            for (int64_t c = 0; c < d; c++) attended[h * d + c] = (float)(weighted[c] / sum);
        }
        free(scores);
        status = after_attention(shape, layer, 1, attended, hidden);
    }
    free(normed);
    free(qkv);
    free(query);
    free(attended);
    return status;
}

int question_before_attention_generic(const decoder_shape *shape, const decoder_layer *layer, int64_t rows,
                                      const float *hidden, const float *cos, const float *sin, float *normed,
                                      float *query, float *key, float *value, int threads) {
    (void)threads;
    const int64_t d = shape->head_dim, heads = shape->heads, kv_heads = shape->kv_heads, n = shape->hidden;
    const int64_t projected = (heads + 2 * kv_heads) * d;
    if (d % 8 || kv_heads < 1 || heads % kv_heads || rows < 1 || !matrix_fits(&layer->qkv, n, projected)) return -1;
    float *qkv = malloc(sizeof(float) * (size_t)(rows * projected));  /* (rows, q + k + v) */
    if (!qkv) return -1;
    for (int64_t r = 0; r < rows; r++) rms_norm(hidden + r * n, layer->input_norm, n, shape->norm_eps, normed + r * n);
    matrix_product(&layer->qkv, normed, rows, qkv);
    before_rope(shape, layer, qkv, rows);
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * projected;
        for (int64_t h = 0; h < heads; h++) rope(row + h * d, cos + r * d, sin + r * d, d, query + (h * rows + r) * d);
        for (int64_t h = 0; h < kv_heads; h++) {
            rope(row + (heads + h) * d, cos + r * d, sin + r * d, d, key + (h * rows + r) * d);
            for (int64_t c = 0; c < d; c++) value[(h * rows + r) * d + c] = row[(heads + kv_heads + h) * d + c];
        }
    }
    free(qkv);
    return 0;
}

int question_after_attention_generic(const decoder_shape *shape, const decoder_layer *layer, int64_t rows,
                                     const float *attended, float *hidden, int threads) {
    (void)threads;
    const int64_t n = shape->hidden, inner = shape->intermediate, width = shape->heads * shape->head_dim;
    if (rows < 1 || !matrix_fits(&layer->o, width, n) || !matrix_fits(&layer->gate_up, n, 2 * inner)
        || !matrix_fits(&layer->down, inner, n))
        return -1;
    return after_attention(shape, layer, rows, attended, hidden);
}

/* ---- a question's attention over a saved layer (coded_attention.c) ---- */

/* coded_attention.c's attend_coded, one formula at a time: the layer restored whole (every stored position's key and
 * value decoded and rotated back, in position order, then the question's own), the question's attention over it
 * (attend_rows_generic's, causal among the question's tokens), and each query head's softmax summed over the
 * question's last `window` rows, in position order. */
int attend_coded_generic(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale,
                         int64_t head_dim, int parts, const void *const *part_pointers, const int64_t *part_shapes,
                         int64_t rotation_block, int values_rotated, const float *question_keys,
                         const float *question_values, const uint8_t *sharp, int64_t window, float *out,
                         float *window_sums, int threads) {
    (void)threads;
    if (parts < 1 || parts > SNAPKV_MAX_PARTS || rows < 1 || question < 1 || rows % question || window < 1
        || window > question || head_dim > SNAPKV_MAX_ATTENTION_HEAD_DIM
        || (rotation_block && (rotation_block & (rotation_block - 1) || head_dim % rotation_block)))
        return -1;
    int64_t stored = 0;
    for (int i = 0; i < parts; i++) stored += part_shapes[6 * i];
    const int64_t tokens = stored + question, group = rows / question;
    float *keys = malloc(sizeof(float) * (size_t)(kv_heads * tokens * head_dim));    /* (kv_heads, tokens, head_dim) */
    float *values = malloc(sizeof(float) * (size_t)(kv_heads * tokens * head_dim));
    double *weights = malloc(sizeof(double) * (size_t)tokens);
    double *sums = malloc(sizeof(double) * (size_t)(group * tokens));                 /* one KV head's (group, tokens) */
    int status = keys && values && weights && sums ? 0 : -1;
    for (int64_t h = 0; h < kv_heads && status == 0; h++) {
        int64_t sharper = 0;  /* a sharper share's positions come first among the columns */
        for (int64_t p = 0; sharp && p < stored; p++) sharper += sharp[h * stored + p] != 0;
        int64_t high = 0, low = sharper;
        for (int64_t p = 0; p < tokens; p++) {
            float *key = keys + (h * tokens + p) * head_dim, *value = values + (h * tokens + p) * head_dim;
            if (p >= stored) {
                memcpy(key, question_keys + (h * question + p - stored) * head_dim, sizeof(float) * (size_t)head_dim);
                memcpy(value, question_values + (h * question + p - stored) * head_dim, sizeof(float) * (size_t)head_dim);
                continue;
            }
            int64_t column = sharp ? (sharp[h * stored + p] ? high++ : low++) : p;
            int part = 0;
            while (column >= part_shapes[6 * part]) column -= part_shapes[6 * part++];
            const int64_t *shape = part_shapes + 6 * part;  /* tokens, key bits, key group, keys rotated, value bits, group */
            const void *const *pointers = part_pointers + 6 * part;
            saved_row(pointers[0], pointers[1], pointers[2], shape[0], head_dim, (int)shape[1], 1, shape[2],
                      shape[3] ? rotation_block : 0, h, column, key);
            saved_row(pointers[3], pointers[4], pointers[5], shape[0], head_dim, (int)shape[4], 0, shape[5],
                      values_rotated ? rotation_block : 0, h, column, value);
        }
        for (int64_t r = 0; r < rows; r++) {
            const float *q = query + (h * rows + r) * head_dim;
            const int64_t i = r % question;  /* the question's token */
            double largest = -INFINITY, total = 0.0;
            for (int64_t t = 0; t < tokens; t++) {
                double dot = 0.0;
                for (int64_t c = 0; c < head_dim; c++) dot += (double)(q[c] * scale) * (double)keys[(h * tokens + t) * head_dim + c];
                weights[t] = t - stored > i ? -INFINITY : dot;
                largest = weights[t] > largest ? weights[t] : largest;
            }
            for (int64_t t = 0; t < tokens; t++) total += weights[t] = exp(weights[t] - largest);
            for (int64_t c = 0; c < head_dim; c++) {
                double weighted = 0.0;
                for (int64_t t = 0; t < tokens; t++) weighted += weights[t] * (double)values[(h * tokens + t) * head_dim + c];
                out[(h * rows + r) * head_dim + c] = (float)(weighted / total);
            }
            double *head_sums = sums + r / question * tokens;
            for (int64_t t = 0; i >= question - window && t < tokens; t++)
                head_sums[t] = (i == question - window ? 0.0 : head_sums[t]) + weights[t] / total;
        }
        for (int64_t t = 0; t < group * tokens; t++) window_sums[h * group * tokens + t] = (float)sums[t];
    }
    free(keys);
    free(values);
    free(weights);
    free(sums);
    return status;
}

/* ---- gguf_blocks.c ---- */

/* gguf_matmul's oracle: every weight dequantized as gguf_dequantize gives it, then each output's products summed
 * one after another in double precision, rounded to fp32 once. */
int gguf_matmul_generic(const float *x, int64_t rows, int64_t k, int type, const uint8_t *w, int64_t row_bytes,
                        int64_t n, float *y, int threads) {
    (void)threads;
    if (rows < 1 || rows > SNAPKV_MAX_ROWS) return -1;
    float *weights = (float *)malloc(sizeof(float) * (size_t)k);
    if (!weights) return -1;
    for (int64_t out = 0; out < n; out++) {
        if (gguf_dequantize(type, w + out * row_bytes, 1, k, row_bytes, weights, 0, 1) != 0) {
            free(weights);
            return -1;
        }
        for (int64_t r = 0; r < rows; r++) {
            double total = 0.0;
            for (int64_t i = 0; i < k; i++) total += (double)x[r * k + i] * (double)weights[i];
            y[r * n + out] = (float)total;
        }
    }
    free(weights);
    return 0;
}
