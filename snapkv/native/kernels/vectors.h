/* The vector vocabulary the kernels are written in: one small mapping header per vector width, in the CPU's own
 * instructions or in plain C (GCC's and clang's vector extensions), for the variant being built (snapkv.native
 * builds each variant from the same sources and loads the one the CPU runs):
 *   avx512  lanes8_x86.h and lanes16_avx512.h: the 16-lane (WIDE) functions compiled for AVX-512, chosen at run
 *           time (wide_vectors(), blockwise_matmul.c)
 *   avx2    lanes8_x86.h and lanes16_plain.h (SNAPKV_PLAIN_WIDE), so that what exists only 16 lanes wide (a
 *           question's attention from a saved cache's codes) runs on AVX2 too
 *   generic lanes8_plain.h and lanes16_plain.h (SNAPKV_PORTABLE): any CPU and C compiler with the vector
 *           extensions (gcc, clang), x86-64 without AVX2, arm64.
 * The names say the lane count and type (f32x8: 8 floats, i32x16: 16 int32, u8x16: 16 bytes, mask16: a bit per
 * lane), then what they do; each width's two headers give the same bits (the plain ones share plain_lanes.h). A
 * new operation is one function in each header of its width; reference.c's scalar loops are the oracle every build
 * is tested against. */
#ifndef SNAPKV_VECTORS_H
#define SNAPKV_VECTORS_H

#if defined(SNAPKV_PORTABLE)
#include "lanes8_plain.h"
#else
#include "lanes8_x86.h"
#endif

#if defined(SNAPKV_PORTABLE) || defined(SNAPKV_PLAIN_WIDE)
#include "lanes16_plain.h"
#define SNAPKV_WIDE_IS_PLAIN 1  /* the 16-lane functions are plain C here: used by default only where nothing else is */
#else
#include "lanes16_avx512.h"
#define SNAPKV_WIDE_IS_PLAIN 0
#endif

#endif
