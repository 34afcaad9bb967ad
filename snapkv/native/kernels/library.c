/* What the build is: its variant (vectors.h), whether it has OpenMP, and the limits kernels.h declares. */
#include "kernels.h"

#ifndef SNAPKV_VARIANT
#define SNAPKV_VARIANT "unnamed"
#endif

const int64_t snapkv_max_rows = SNAPKV_MAX_ROWS;
const int64_t snapkv_max_attention_head_dim = SNAPKV_MAX_ATTENTION_HEAD_DIM;
const int64_t snapkv_max_stored_head_dim = SNAPKV_MAX_STORED_HEAD_DIM;
const int64_t snapkv_max_parts = SNAPKV_MAX_PARTS;
const int64_t snapkv_max_decode_head_dim = SNAPKV_MAX_DECODE_HEAD_DIM;

const char *kernel_variant(void) { return SNAPKV_VARIANT; }

int kernel_threads(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
