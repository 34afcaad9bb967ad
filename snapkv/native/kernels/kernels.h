/* Everything snapkv's kernel library exports: its structs, its functions and its limits, in one place. Every .c file
 * includes this header (so the compiler checks each definition against it), and snapkv/native/__init__.py's BINDINGS table
 * declares the same functions to ctypes (tests/test_kernel_interface.py checks the two agree).
 *
 * Pointers are to C-contiguous arrays in the shapes each function's comment gives; int64_t counts; `threads` the
 * OpenMP threads to use (ignored by a build without OpenMP). Functions returning int return 0 on success and a
 * negative number for a shape they do not take (nothing written then, unless the comment says otherwise). */
#ifndef SNAPKV_KERNELS_H
#define SNAPKV_KERNELS_H

#include <stdint.h>

/* ---- limits (library.c exports them to Python) ---- */
#define SNAPKV_MAX_ROWS 64                  /* rows of activations a block product takes at once */
#define SNAPKV_MAX_ATTENTION_HEAD_DIM 256   /* head_dim of the attention kernels' register tiles */
#define SNAPKV_MAX_STORED_HEAD_DIM 1024     /* head_dim a saved cache's rows are restored at */
#define SNAPKV_MAX_PARTS 2                  /* parts of a saved layer (a sharper share and the rest) */
#define SNAPKV_MAX_DECODE_HEAD_DIM 512      /* head_dim of the decode step (8 keys widened on its stack) */
extern const int64_t snapkv_max_rows, snapkv_max_attention_head_dim, snapkv_max_stored_head_dim, snapkv_max_parts,
    snapkv_max_decode_head_dim;

/* ---- the build (library.c) ---- */
const char *kernel_variant(void);  /* "avx512", "avx2" or "generic" */
int kernel_threads(void);          /* 1 where built with OpenMP, else 0 (one thread) */
int wide_vectors(int request);     /* the 16-lane functions: 1/0 to choose (where they run), -1 to ask */

/* ---- structs (decode_step.c) ---- */
typedef struct {
    int64_t bits;          /* 4 or 8: blocks; 16 or 32: plain bf16 or fp32 rows (dense_rows.c); 0: a GGUF type's blocks */
    const void *codes;     /* as blockwise_matmul.c reads them; for 16/32 the weights (outputs, inputs); for 0 the
                              file's rows of blocks, row_bytes apart (gguf_blocks.c) */
    const float *scale;    /* blocks only */
    const float *minimum;  /* 4-bit only */
    int64_t outputs, inputs;
    int64_t gguf_type, row_bytes;     /* bits 0 only */
    const void *next;      /* NULL, or the block_matrix whose outputs follow these (q, then k, then v: parts of other
                              forms stacked), its inputs the same */
} block_matrix;

typedef struct {
    const float *input_norm, *post_norm;  /* (hidden) */
    block_matrix qkv, o, gate_up, down;
    const void *held_keys, *held_values;  /* (kv_heads, held, head_dim): the cache as the question's pass left it */
    int64_t held, held_bits;              /* its rows; 32: fp32, 16: bf16 */
    float *keys, *values;                 /* (kv_heads, capacity, head_dim): the answer's own rows, fp32 */
    int64_t capacity, filled;
    const float *qkv_bias;                /* NULL, or ((heads + 2 kv_heads) * head_dim): added to q, k, v (Qwen2) */
    const float *q_norm, *k_norm;         /* NULL, or (head_dim) each: RMSNorm of every q and k head after the
                                             projection, before RoPE (Qwen3), with the shape's norm_eps */
} decoder_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float norm_eps, scaling;
} decoder_shape;

/* ---- products with weights in 4/8-bit blocks (blockwise_matmul.c), fp32 and bf16 rows (few_rows.c) ---- */
int matmul_4bit(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                const float *minimum, int64_t n, float *y, int threads);
int matmul_8bit(const float *x, int64_t rows, int64_t k, const int8_t *codes, const float *scale, int64_t n,
                float *y, int threads);
int linear_rows(const float *x, int64_t rows, int64_t k, const float *weight, int64_t n, float *y, int threads);
int linear_rows_blocks(const float *x, int64_t rows, int64_t k, int bits, const uint8_t *codes, const float *scale,
                       const float *minimum, int64_t n, float *y, int threads);
int linear_rows_bf16(const float *x, int64_t rows, int64_t k, const void *weight, int64_t n, float *y, int threads);

/* ---- products with plain bf16 (bf16 = 1) or fp32 weights (n, k), summed in fp32 (dense_rows.c) ---- */
int matmul_dense(const float *x, int64_t rows, int64_t k, const void *weight, int bf16, int64_t n, float *y,
                 int threads);

/* ---- a question's attention (few_rows.c over fp32 rows, coded_attention.c over a saved layer's codes) ---- */
int attend_rows(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale,
                const float *keys, int64_t key_head_stride, const float *values, int64_t value_head_stride,
                int64_t tokens, int64_t head_dim, const float *tail_mask, float *weights, float *out,
                int64_t window, float *window_sums, int threads);
int attend_coded(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale, int64_t head_dim,
                 int parts, const void *const *part_pointers, const int64_t *part_shapes, int64_t rotation_block,
                 int values_rotated, const float *question_keys, const float *question_values, const uint8_t *sharp,
                 int64_t window, float *out, float *window_sums, int threads);

/* ---- a decoded token and a question's layers (decode_step.c) ---- */
int rope_rows(const float *x, int64_t rows, int64_t heads, int64_t head_dim, const float *cos, const float *sin,
              float *out);
int decode_token(const decoder_shape *shape, decoder_layer *layers, int64_t layer_count, float *hidden,
                 const float *cos, const float *sin, int threads);
int final_logits(const float *hidden, int64_t n, const float *norm, float eps, const block_matrix *head,
                 float *logits, int threads);
int question_before_attention(const decoder_shape *shape, const decoder_layer *layer, int64_t rows, const float *hidden,
                              const float *cos, const float *sin, float *normed, float *query, float *key,
                              float *value, int threads);
int question_after_attention(const decoder_shape *shape, const decoder_layer *layer, int64_t rows,
                             const float *attended, float *hidden, int threads);

/* ---- SnapKV's cut (window_cut.c) ---- */
int window_scores(const float *weights, int64_t kv_heads, int64_t group, int64_t window, int64_t columns,
                  int64_t head_stride, int64_t group_stride, int64_t row_stride, int kernel, int pooling,
                  float *scores, int threads);
int chunk_means(float *scores, int64_t rows, int64_t columns, int64_t size);
int word_maxima(float *scores, const int64_t *words, int64_t rows, int64_t columns);
int top_positions(const float *scores, int64_t kv_heads, int64_t prefix, int64_t keep, int64_t window,
                  int64_t *indices, int threads);
int gather_rows(const uint8_t *states, int64_t heads, int64_t head_stride, int64_t rows, int64_t row_bytes,
                const int64_t *indices, int64_t count, uint8_t *out, int threads);

/* ---- a saved cache's rows restored (dequantize.c) ---- */
int dequantize_rows(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum, int64_t heads,
                    int64_t tokens, int64_t head_dim, int bits, int along_tokens, int64_t group,
                    int64_t rotation_block, const int64_t *destination, void *out, int out_kind, int threads);
int dequantize_positions(const void *const *part_pointers, const int64_t *part_shapes, int parts,
                         const int64_t *column_of, int64_t heads, int64_t stored, int64_t head_dim,
                         const int64_t *positions, int64_t kept, const float *question_rows, int64_t question,
                         float *out, int threads);
int64_t mask_positions(const uint8_t *mask, int64_t heads, int64_t length, int64_t bytes, int64_t *positions,
                       int64_t count);
int part_rows(const uint8_t *sharp, int64_t heads, int64_t tokens, int64_t room, int64_t *high, int64_t high_count,
              int64_t *low, int64_t low_count);
void part_columns(const uint8_t *sharp, int64_t heads, int64_t tokens, int64_t *columns);
int half_all_finite(const uint16_t *const *arrays, const int64_t *counts, int64_t parts);

/* ---- matrices in a GGUF file's own blocks, read where the file is mapped (gguf_blocks.c) ---- */
enum { GGUF_F32 = 0, GGUF_F16 = 1, GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7, GGUF_Q8_0 = 8,
       GGUF_Q4_K = 12, GGUF_Q5_K = 13, GGUF_Q6_K = 14, GGUF_BF16 = 30 };  /* ggml's type ids, as the file stores them */
int gguf_block_form(int type, int64_t *elements, int64_t *bytes, int64_t *group);
int gguf_dequantize(int type, const uint8_t *blocks, int64_t rows, int64_t k, int64_t row_bytes, void *out, int bf16,
                    int threads);
int gguf_rows(int type, const uint8_t *blocks, int64_t rows, int64_t k, int64_t row_bytes, const int64_t *ids,
              int64_t count, float *out);
int gguf_matmul(const float *x, int64_t rows, int64_t k, int type, const uint8_t *w, int64_t row_bytes, int64_t n,
                float *y, int threads);

/* ---- scalar references (reference.c): each vector kernel above as plain loops, the oracle the tests compare every
 * build against; the same arguments as the kernel, `threads` ignored; never called by snapkv ---- */
int matmul_4bit_generic(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const float *scale,
                        const float *minimum, int64_t n, float *y, int threads);
int matmul_8bit_generic(const float *x, int64_t rows, int64_t k, const int8_t *codes, const float *scale, int64_t n,
                        float *y, int threads);
int linear_rows_generic(const float *x, int64_t rows, int64_t k, const float *weight, int64_t n, float *y,
                        int threads);
int linear_rows_blocks_generic(const float *x, int64_t rows, int64_t k, int bits, const uint8_t *codes,
                               const float *scale, const float *minimum, int64_t n, float *y, int threads);
int linear_rows_bf16_generic(const float *x, int64_t rows, int64_t k, const void *weight, int64_t n, float *y,
                             int threads);
int matmul_dense_generic(const float *x, int64_t rows, int64_t k, const void *weight, int bf16, int64_t n, float *y,
                         int threads);
int attend_rows_generic(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale,
                        const float *keys, int64_t key_head_stride, const float *values, int64_t value_head_stride,
                        int64_t tokens, int64_t head_dim, const float *tail_mask, float *weights, float *out,
                        int64_t window, float *window_sums, int threads);
int dequantize_rows_generic(const uint8_t *packed, const uint16_t *scale, const uint16_t *minimum, int64_t heads,
                            int64_t tokens, int64_t head_dim, int bits, int along_tokens, int64_t group,
                            int64_t rotation_block, const int64_t *destination, void *out, int out_kind,
                            int threads);
int dequantize_positions_generic(const void *const *part_pointers, const int64_t *part_shapes, int parts,
                                 const int64_t *column_of, int64_t heads, int64_t stored, int64_t head_dim,
                                 const int64_t *positions, int64_t kept, const float *question_rows, int64_t question,
                                 float *out, int threads);
int decode_token_generic(const decoder_shape *shape, decoder_layer *layers, int64_t layer_count, float *hidden,
                         const float *cos, const float *sin, int threads);
int final_logits_generic(const float *hidden, int64_t n, const float *norm, float eps, const block_matrix *head,
                         float *logits, int threads);
int question_before_attention_generic(const decoder_shape *shape, const decoder_layer *layer, int64_t rows,
                                      const float *hidden, const float *cos, const float *sin, float *normed,
                                      float *query, float *key, float *value, int threads);
int attend_coded_generic(const float *query, int64_t kv_heads, int64_t rows, int64_t question, float scale,
                         int64_t head_dim, int parts, const void *const *part_pointers, const int64_t *part_shapes,
                         int64_t rotation_block, int values_rotated, const float *question_keys,
                         const float *question_values, const uint8_t *sharp, int64_t window, float *out,
                         float *window_sums, int threads);
int question_after_attention_generic(const decoder_shape *shape, const decoder_layer *layer, int64_t rows,
                                     const float *attended, float *hidden, int threads);
int gguf_matmul_generic(const float *x, int64_t rows, int64_t k, int type, const uint8_t *w, int64_t row_bytes,
                        int64_t n, float *y, int threads);

#endif
