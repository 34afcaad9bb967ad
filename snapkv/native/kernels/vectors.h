/* The vector types and intrinsics the kernels are written in, for the variant being built (snapkv.native builds each
 * variant from the same sources and loads the one the CPU runs):
 *   avx512  the CPU's own intrinsics; the 16-lane (WIDE) functions compiled for AVX-512, chosen at run time
 *   avx2    the CPU's own 128/256-bit intrinsics; the 16-lane ones in plain C (SNAPKV_EMULATED_WIDE), so that what
 *           only exists 16 lanes wide (a question's attention from a saved cache's codes) runs on AVX2 too
 *   generic every intrinsic in plain C (SNAPKV_PORTABLE): any CPU and C compiler with GCC's vector extensions
 *           (gcc, clang), x86-64 without AVX2, arm64. */
#ifndef SNAPKV_VECTORS_H
#define SNAPKV_VECTORS_H

#if defined(SNAPKV_PORTABLE)
#include "portable_vectors.h"
#define SNAPKV_WIDE_EMULATED 1
#else
#include <immintrin.h>
#if defined(SNAPKV_EMULATED_WIDE)
#include "portable_vectors.h"
#define SNAPKV_WIDE_EMULATED 1
#else
#define SNAPKV_WIDE_EMULATED 0
#endif
#endif

#endif
