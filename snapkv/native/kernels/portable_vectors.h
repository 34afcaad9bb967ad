/* The x86 vector intrinsics snapkv's kernels are written in, in plain C with the vector extensions of GCC and clang,
 * for the builds where the CPU does not run them (vectors.h chooses):
 *   - SNAPKV_PORTABLE (the generic kernels: arm64, or an x86 CPU without AVX2): every intrinsic the kernels use, 128,
 *     256 and 512 bits wide; the compiler turns each into the vector instructions its target has (NEON, SSE2, ...).
 *   - SNAPKV_EMULATED_WIDE (the AVX2 kernels): only the AVX-512 ones, so that the 16-lane kernels (a question's
 *     attention from a saved cache's codes) run on 256-bit hardware; the 128- and 256-bit intrinsics stay the CPU's.
 * Each intrinsic keeps its Intel name through a macro naming a pv_ function, so the kernels read the same in every
 * build (each name #undef'd first: immintrin.h defines some as macros). Each function does what Intel's manual says
 * its intrinsic does, lane by lane (a fused multiply-add where the target has one, else a product then a sum); on
 * x86-64 the generic build widens bytes with SSE2, its baseline (below). Only the names the kernels use are here. */
#ifndef SNAPKV_PORTABLE_VECTORS_H
#define SNAPKV_PORTABLE_VECTORS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__FMA__) || defined(__aarch64__) || defined(__FP_FAST_FMAF)
#define PV_FMA(a, b, c) __builtin_fmaf((a), (b), (c))  /* one instruction on this target */
#else
#define PV_FMA(a, b, c) ((a) * (b) + (c))              /* no fused multiply-add here: a product, then a sum */
#endif

#define PV_LANES(n) for (int i = 0; i < (n); i++)

#if defined(SNAPKV_PORTABLE) && defined(__SSE2__) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
/* x86-64's baseline, SSE2, where the generic build runs on x86-64: the codes' bytes moved and widened to 32-bit
 * lanes, and made floats, by its shift, unpack and convert instructions (gcc writes the lane-by-lane versions below
 * as a scalar conversion per byte). Defined before the names below are mapped, so that these are the CPU's own. */
#include <emmintrin.h>
#define PV_SSE2 1
typedef __m128i pv_sse2_bytes;
typedef int32_t pv_sse2_words __attribute__((vector_size(16)));
typedef int32_t pv_sse2_words8 __attribute__((vector_size(32)));
typedef float pv_sse2_floats8 __attribute__((vector_size(32)));

/* The low 8 bytes of `bytes` as 8 int32, zero- or sign-extended. */
static inline pv_sse2_words8 pv_sse2_widen_bytes(pv_sse2_bytes bytes, int is_signed) {
    pv_sse2_bytes words, low, high;
    if (is_signed) {
        words = _mm_srai_epi16(_mm_unpacklo_epi8(bytes, bytes), 8);  /* each byte in the high half, shifted down */
        low = _mm_srai_epi32(_mm_unpacklo_epi16(words, words), 16);
        high = _mm_srai_epi32(_mm_unpackhi_epi16(words, words), 16);
    } else {
        const pv_sse2_bytes zero = _mm_setzero_si128();
        words = _mm_unpacklo_epi8(bytes, zero);
        low = _mm_unpacklo_epi16(words, zero);
        high = _mm_unpackhi_epi16(words, zero);
    }
    return __builtin_shufflevector((pv_sse2_words)low, (pv_sse2_words)high, 0, 1, 2, 3, 4, 5, 6, 7);
}

/* 8 int32 as 8 floats. */
static inline pv_sse2_floats8 pv_sse2_to_floats(pv_sse2_words8 words) {
    const __m128 low = _mm_cvtepi32_ps((pv_sse2_bytes)__builtin_shufflevector(words, words, 0, 1, 2, 3));
    const __m128 high = _mm_cvtepi32_ps((pv_sse2_bytes)__builtin_shufflevector(words, words, 4, 5, 6, 7));
    return __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7);
}

/* The high 8 bytes moved down, zeros above (the kernels' one use of a byte shift). */
static inline pv_sse2_bytes pv_sse2_high_half(pv_sse2_bytes bytes) { return _mm_srli_si128(bytes, 8); }
#endif
#endif
#ifndef PV_SSE2
#define PV_SSE2 0
#endif

/* IEEE half (binary16) bits to a float, exactly (subnormals, infinities and NaNs included). */
static inline float pv_half_to_float(uint16_t half) {
    const uint32_t sign = (uint32_t)(half & 0x8000) << 16, exponent = (half >> 10) & 0x1F, mantissa = half & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) {  /* subnormal: normalised */
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400)) m <<= 1, shift++;
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((m & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* ---- 512 bits: every build that includes this file ---- */

typedef float pv_m512 __attribute__((vector_size(64), aligned(64)));
typedef int32_t pv_m512i __attribute__((vector_size(64), aligned(64)));
typedef uint8_t pv_bytes64 __attribute__((vector_size(64), aligned(64)));
typedef uint32_t pv_words16 __attribute__((vector_size(64), aligned(64)));
typedef uint16_t pv_mask16;

#undef __m512
#define __m512 pv_m512
#undef __m512i
#define __m512i pv_m512i
#undef __mmask16
#define __mmask16 pv_mask16

static inline pv_m512 pv_mm512_setzero_ps(void) { return (pv_m512){0}; }
static inline pv_m512 pv_mm512_set1_ps(float x) { pv_m512 v; PV_LANES(16) v[i] = x; return v; }
static inline pv_m512i pv_mm512_set1_epi32(int32_t x) { pv_m512i v; PV_LANES(16) v[i] = x; return v; }
static inline pv_m512 pv_mm512_loadu_ps(const void *p) { pv_m512 v; memcpy(&v, p, 64); return v; }
static inline pv_m512i pv_mm512_loadu_si512(const void *p) { pv_m512i v; memcpy(&v, p, 64); return v; }
static inline void pv_mm512_storeu_ps(void *p, pv_m512 v) { memcpy(p, &v, 64); }
static inline pv_m512 pv_mm512_add_ps(pv_m512 a, pv_m512 b) { return a + b; }
static inline pv_m512 pv_mm512_sub_ps(pv_m512 a, pv_m512 b) { return a - b; }
static inline pv_m512 pv_mm512_mul_ps(pv_m512 a, pv_m512 b) { return a * b; }
static inline pv_m512 pv_mm512_max_ps(pv_m512 a, pv_m512 b) { pv_m512 v; PV_LANES(16) v[i] = a[i] > b[i] ? a[i] : b[i]; return v; }
static inline pv_m512 pv_mm512_fmadd_ps(pv_m512 a, pv_m512 b, pv_m512 c) {
    pv_m512 v;
    PV_LANES(16) v[i] = PV_FMA(a[i], b[i], c[i]);
    return v;
}
static inline pv_m512 pv_mm512_fnmadd_ps(pv_m512 a, pv_m512 b, pv_m512 c) {
    pv_m512 v;
    PV_LANES(16) v[i] = PV_FMA(-a[i], b[i], c[i]);
    return v;
}
static inline pv_m512i pv_mm512_add_epi32(pv_m512i a, pv_m512i b) { return (pv_m512i)((pv_words16)a + (pv_words16)b); }
static inline pv_m512i pv_mm512_mullo_epi32(pv_m512i a, pv_m512i b) { return (pv_m512i)((pv_words16)a * (pv_words16)b); }
static inline pv_m512i pv_mm512_and_si512(pv_m512i a, pv_m512i b) { return a & b; }
static inline pv_m512i pv_mm512_slli_epi32(pv_m512i a, unsigned count) {
    return count > 31 ? (pv_m512i){0} : (pv_m512i)((pv_words16)a << count);
}
static inline pv_m512i pv_mm512_srlv_epi32(pv_m512i a, pv_m512i count) {
    pv_m512i v;
    PV_LANES(16) v[i] = (uint32_t)count[i] > 31 ? 0 : (int32_t)((uint32_t)a[i] >> count[i]);
    return v;
}
static inline pv_m512 pv_mm512_cvtepi32_ps(pv_m512i a) { pv_m512 v; PV_LANES(16) v[i] = (float)a[i]; return v; }
static inline pv_m512i pv_mm512_cvtps_epi32(pv_m512 a) {
    pv_m512i v;
    PV_LANES(16) v[i] = (int32_t)rintf(a[i]);  /* to nearest, ties to even: the default rounding */
    return v;
}
static inline pv_m512 pv_mm512_castsi512_ps(pv_m512i a) { return (pv_m512)a; }
static inline pv_mask16 pv_mm512_cmp_ps_mask_lt(pv_m512 a, pv_m512 b) {
    pv_mask16 mask = 0;
    PV_LANES(16) mask |= (pv_mask16)((a[i] < b[i]) << i);
    return mask;
}
#define pv_mm512_cmp_ps_mask(a, b, predicate) pv_mm512_cmp_ps_mask_lt((a), (b))  /* the kernels ask _CMP_LT_OQ only */
/* roundscale with 0 fraction bits: rounded to an integer, to nearest (the kernels ask that only) */
static inline pv_m512 pv_mm512_roundscale_ps(pv_m512 a, int mode) {
    pv_m512 v;
    (void)mode;
    PV_LANES(16) v[i] = rintf(a[i]);
    return v;
}
static inline pv_m512 pv_mm512_maskz_mov_ps(pv_mask16 mask, pv_m512 a) {
    pv_m512 v;
    PV_LANES(16) v[i] = mask >> i & 1 ? a[i] : 0.0f;
    return v;
}
static inline pv_m512 pv_mm512_maskz_loadu_ps(pv_mask16 mask, const float *p) {  /* lanes off are not read */
    pv_m512 v = {0};
    PV_LANES(16) if (mask >> i & 1) v[i] = p[i];
    return v;
}
static inline void pv_mm512_mask_storeu_ps(float *p, pv_mask16 mask, pv_m512 a) { PV_LANES(16) if (mask >> i & 1) p[i] = a[i]; }
/* within each 128-bit lane: element j from element (imm >> 2j) & 3 */
static inline pv_m512 pv_mm512_permute_ps(pv_m512 a, int imm) {
    pv_m512 v;
    PV_LANES(16) v[i] = a[(i & ~3) + (imm >> 2 * (i & 3) & 3)];
    return v;
}
/* 128-bit lanes: two of a's, then two of b's, each chosen by two bits of imm */
static inline pv_m512 pv_mm512_shuffle_f32x4(pv_m512 a, pv_m512 b, int imm) {
    pv_m512 v;
    PV_LANES(16) {
        const int lane = i >> 2, from = imm >> 2 * lane & 3;
        v[i] = lane < 2 ? a[4 * from + (i & 3)] : b[4 * from + (i & 3)];
    }
    return v;
}
/* within each 128-bit lane: byte j from byte b[j] & 15, or zero where b[j]'s top bit is set */
static inline pv_m512i pv_mm512_shuffle_epi8(pv_m512i a, pv_m512i b) {
    const pv_bytes64 from = (pv_bytes64)a, pick = (pv_bytes64)b;
    pv_bytes64 v;
    for (int i = 0; i < 64; i++) v[i] = pick[i] & 0x80 ? 0 : from[(i & ~15) + (pick[i] & 15)];
    return (pv_m512i)v;
}
static inline float pv_mm512_reduce_add_ps(pv_m512 a) {  /* halves added, then quarters, ..., as GCC's header does */
    float x[8];
    PV_LANES(8) x[i] = a[i] + a[i + 8];
    PV_LANES(4) x[i] = x[i] + x[i + 4];
    PV_LANES(2) x[i] = x[i] + x[i + 2];
    return x[0] + x[1];
}
static inline pv_m512 pv_mm512_setr_ps(float e0, float e1, float e2, float e3, float e4, float e5, float e6, float e7,
                                       float e8, float e9, float e10, float e11, float e12, float e13, float e14,
                                       float e15) {
    return (pv_m512){e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15};
}
static inline pv_m512i pv_mm512_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8,
                                           int e9, int e10, int e11, int e12, int e13, int e14, int e15) {
    return (pv_m512i){e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15};
}
static inline pv_m512i pv_mm512_i32gather_epi32(pv_m512i index, const void *base, int scale) {
    pv_m512i v;
    PV_LANES(16) {
        int32_t word;
        memcpy(&word, (const char *)base + (int64_t)index[i] * scale, 4);
        v[i] = word;
    }
    return v;
}

#undef _mm512_setzero_ps
#define _mm512_setzero_ps pv_mm512_setzero_ps
#undef _mm512_set1_ps
#define _mm512_set1_ps pv_mm512_set1_ps
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 pv_mm512_set1_epi32
#undef _mm512_loadu_ps
#define _mm512_loadu_ps pv_mm512_loadu_ps
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 pv_mm512_loadu_si512
#undef _mm512_storeu_ps
#define _mm512_storeu_ps pv_mm512_storeu_ps
#undef _mm512_store_ps
#define _mm512_store_ps pv_mm512_storeu_ps
#undef _mm512_add_ps
#define _mm512_add_ps pv_mm512_add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps pv_mm512_sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps pv_mm512_mul_ps
#undef _mm512_max_ps
#define _mm512_max_ps pv_mm512_max_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps pv_mm512_fmadd_ps
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps pv_mm512_fnmadd_ps
#undef _mm512_add_epi32
#define _mm512_add_epi32 pv_mm512_add_epi32
#undef _mm512_mullo_epi32
#define _mm512_mullo_epi32 pv_mm512_mullo_epi32
#undef _mm512_and_si512
#define _mm512_and_si512 pv_mm512_and_si512
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 pv_mm512_slli_epi32
#undef _mm512_srlv_epi32
#define _mm512_srlv_epi32 pv_mm512_srlv_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps pv_mm512_cvtepi32_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 pv_mm512_cvtps_epi32
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps pv_mm512_castsi512_ps
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask pv_mm512_cmp_ps_mask
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps pv_mm512_roundscale_ps
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps pv_mm512_maskz_mov_ps
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps pv_mm512_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps pv_mm512_mask_storeu_ps
#undef _mm512_permute_ps
#define _mm512_permute_ps pv_mm512_permute_ps
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4 pv_mm512_shuffle_f32x4
#undef _mm512_shuffle_epi8
#define _mm512_shuffle_epi8 pv_mm512_shuffle_epi8
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps pv_mm512_reduce_add_ps
#undef _mm512_setr_ps
#define _mm512_setr_ps pv_mm512_setr_ps
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 pv_mm512_setr_epi32
#undef _mm512_i32gather_epi32
#define _mm512_i32gather_epi32 pv_mm512_i32gather_epi32

/* ---- 128 and 256 bits: the generic build only (the AVX2 build has the CPU's) ---- */
#if defined(SNAPKV_PORTABLE)

typedef float pv_m128 __attribute__((vector_size(16), aligned(16)));
typedef int64_t pv_m128i __attribute__((vector_size(16), aligned(16)));
typedef uint8_t pv_bytes16 __attribute__((vector_size(16), aligned(16)));
typedef uint16_t pv_halves8 __attribute__((vector_size(16), aligned(16)));
typedef float pv_m256 __attribute__((vector_size(32), aligned(32)));
typedef int32_t pv_m256i __attribute__((vector_size(32), aligned(32)));
typedef uint32_t pv_words8 __attribute__((vector_size(32), aligned(32)));

#undef __m128
#define __m128 pv_m128
#undef __m128i
#define __m128i pv_m128i
#undef __m256
#define __m256 pv_m256
#undef __m256i
#define __m256i pv_m256i

#define _MM_HINT_T0 3
#define _CMP_LT_OQ 0x11
#define _MM_FROUND_TO_NEAREST_INT 0
#define _MM_FROUND_NO_EXC 8

static inline float pv_cvtsh_ss(uint16_t half) { return pv_half_to_float(half); }
#define pv_mm_prefetch(address, hint) __builtin_prefetch((address), 0, 3)

static inline pv_m128 pv_mm_add_ps(pv_m128 a, pv_m128 b) { return a + b; }
/* b where a > b does not hold (b where either is NaN, as maxps), as a mask on a comparison: gcc writes the lane-by-lane
 * form as a scalar comparison per lane */
static inline pv_m128 pv_mm_max_ps(pv_m128 a, pv_m128 b) {
    typedef int32_t words __attribute__((vector_size(16)));
    const words greater = (words)(a > b);
    return (pv_m128)((greater & (words)a) | (~greater & (words)b));
}
static inline pv_m128 pv_mm_add_ss(pv_m128 a, pv_m128 b) { a[0] = a[0] + b[0]; return a; }
static inline pv_m128 pv_mm_max_ss(pv_m128 a, pv_m128 b) { a[0] = a[0] > b[0] ? a[0] : b[0]; return a; }
static inline pv_m128 pv_mm_movehl_ps(pv_m128 a, pv_m128 b) { return (pv_m128){b[2], b[3], a[2], a[3]}; }
static inline pv_m128 pv_mm_movehdup_ps(pv_m128 a) { return (pv_m128){a[1], a[1], a[3], a[3]}; }
static inline float pv_mm_cvtss_f32(pv_m128 a) { return a[0]; }
static inline pv_m128i pv_mm_loadu_si128(const void *p) { pv_m128i v; memcpy(&v, p, 16); return v; }
static inline pv_m128i pv_mm_loadl_epi64(const void *p) { pv_m128i v = {0}; memcpy(&v, p, 8); return v; }
static inline pv_m128i pv_mm_cvtsi32_si128(int x) { pv_m128i v = {0}; memcpy(&v, &x, 4); return v; }
static inline pv_m128i pv_mm_set1_epi8(char x) { pv_bytes16 v; PV_LANES(16) v[i] = (uint8_t)x; return (pv_m128i)v; }
static inline pv_m128i pv_mm_and_si128(pv_m128i a, pv_m128i b) { return a & b; }
static inline pv_m128i pv_mm_srli_epi16(pv_m128i a, unsigned count) {
    return count > 15 ? (pv_m128i){0} : (pv_m128i)((pv_halves8)a >> count);
}
static inline pv_m128i pv_mm_srli_si128(pv_m128i a, int bytes) {  /* the whole register, bytes to the right */
#if PV_SSE2
    if (bytes == 8) return (pv_m128i)pv_sse2_high_half((pv_sse2_bytes)a);
#endif
    const pv_bytes16 from = (pv_bytes16)a;
    pv_bytes16 v;
    PV_LANES(16) v[i] = i + bytes < 16 ? from[i + bytes] : 0;
    return (pv_m128i)v;
}

static inline pv_m256 pv_mm256_setzero_ps(void) { return (pv_m256){0}; }
static inline pv_m256 pv_mm256_set1_ps(float x) { pv_m256 v; PV_LANES(8) v[i] = x; return v; }
static inline pv_m256 pv_mm256_broadcast_ss(const float *p) { return pv_mm256_set1_ps(*p); }
static inline pv_m256i pv_mm256_set1_epi32(int32_t x) { pv_m256i v; PV_LANES(8) v[i] = x; return v; }
static inline pv_m256 pv_mm256_setr_ps(float e0, float e1, float e2, float e3, float e4, float e5, float e6, float e7) {
    return (pv_m256){e0, e1, e2, e3, e4, e5, e6, e7};
}
static inline pv_m256i pv_mm256_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7) {
    return (pv_m256i){e0, e1, e2, e3, e4, e5, e6, e7};
}
static inline pv_m256 pv_mm256_loadu_ps(const float *p) { pv_m256 v; memcpy(&v, p, 32); return v; }
static inline void pv_mm256_storeu_ps(float *p, pv_m256 v) { memcpy(p, &v, 32); }
static inline pv_m256 pv_mm256_add_ps(pv_m256 a, pv_m256 b) { return a + b; }
static inline pv_m256 pv_mm256_sub_ps(pv_m256 a, pv_m256 b) { return a - b; }
static inline pv_m256 pv_mm256_mul_ps(pv_m256 a, pv_m256 b) { return a * b; }
static inline pv_m256 pv_mm256_div_ps(pv_m256 a, pv_m256 b) { return a / b; }
static inline pv_m256 pv_mm256_max_ps(pv_m256 a, pv_m256 b) {  /* pv_mm_max_ps on each half */
    pv_m128 halves_a[2], halves_b[2];
    memcpy(halves_a, &a, sizeof a);
    memcpy(halves_b, &b, sizeof b);
    for (int half = 0; half < 2; half++) halves_a[half] = pv_mm_max_ps(halves_a[half], halves_b[half]);
    memcpy(&a, halves_a, sizeof a);
    return a;
}
static inline pv_m256 pv_mm256_min_ps(pv_m256 a, pv_m256 b) { pv_m256 v; PV_LANES(8) v[i] = a[i] < b[i] ? a[i] : b[i]; return v; }
static inline pv_m256 pv_mm256_fmadd_ps(pv_m256 a, pv_m256 b, pv_m256 c) {
    pv_m256 v;
    PV_LANES(8) v[i] = PV_FMA(a[i], b[i], c[i]);
    return v;
}
static inline pv_m256 pv_mm256_fnmadd_ps(pv_m256 a, pv_m256 b, pv_m256 c) {
    pv_m256 v;
    PV_LANES(8) v[i] = PV_FMA(-a[i], b[i], c[i]);
    return v;
}
static inline pv_m256 pv_mm256_andnot_ps(pv_m256 a, pv_m256 b) { return (pv_m256)(~(pv_m256i)a & (pv_m256i)b); }
static inline pv_m256 pv_mm256_cmp_ps(pv_m256 a, pv_m256 b, int predicate) {  /* the kernels ask _CMP_LT_OQ only */
    (void)predicate;
    return (pv_m256)(a < b);
}
static inline pv_m256 pv_mm256_round_ps(pv_m256 a, int mode) {  /* to nearest: the kernels ask that only */
    pv_m256 v;
    (void)mode;
    PV_LANES(8) v[i] = rintf(a[i]);
    return v;
}
static inline pv_m256i pv_mm256_cvtps_epi32(pv_m256 a) { pv_m256i v; PV_LANES(8) v[i] = (int32_t)rintf(a[i]); return v; }
static inline pv_m256 pv_mm256_cvtepi32_ps(pv_m256i a) {
#if PV_SSE2
    return pv_sse2_to_floats(a);
#endif
    pv_m256 v;
    PV_LANES(8) v[i] = (float)a[i];
    return v;
}
static inline pv_m256 pv_mm256_castsi256_ps(pv_m256i a) { return (pv_m256)a; }
static inline pv_m256i pv_mm256_add_epi32(pv_m256i a, pv_m256i b) { return (pv_m256i)((pv_words8)a + (pv_words8)b); }
static inline pv_m256i pv_mm256_and_si256(pv_m256i a, pv_m256i b) { return a & b; }
static inline pv_m256i pv_mm256_slli_epi32(pv_m256i a, unsigned count) {
    return count > 31 ? (pv_m256i){0} : (pv_m256i)((pv_words8)a << count);
}
static inline pv_m256i pv_mm256_srlv_epi32(pv_m256i a, pv_m256i count) {
    pv_m256i v;
    PV_LANES(8) v[i] = (uint32_t)count[i] > 31 ? 0 : (int32_t)((uint32_t)a[i] >> count[i]);
    return v;
}
static inline pv_m256i pv_mm256_cvtepu8_epi32(pv_m128i a) {  /* the low 8 bytes, widened */
#if PV_SSE2
    return pv_sse2_widen_bytes((pv_sse2_bytes)a, 0);
#endif
    const pv_bytes16 b = (pv_bytes16)a;
    pv_m256i v;
    PV_LANES(8) v[i] = b[i];
    return v;
}
static inline pv_m256i pv_mm256_cvtepi8_epi32(pv_m128i a) {
#if PV_SSE2
    return pv_sse2_widen_bytes((pv_sse2_bytes)a, 1);
#endif
    const pv_bytes16 b = (pv_bytes16)a;
    pv_m256i v;
    PV_LANES(8) v[i] = (int8_t)b[i];
    return v;
}
static inline pv_m128 pv_mm256_castps256_ps128(pv_m256 a) { return (pv_m128){a[0], a[1], a[2], a[3]}; }
static inline pv_m128 pv_mm256_extractf128_ps(pv_m256 a, int high) {
    const int at = high & 1 ? 4 : 0;
    return (pv_m128){a[at], a[at + 1], a[at + 2], a[at + 3]};
}
/* pairs added within each 128-bit lane: a's first, then b's */
static inline pv_m256 pv_mm256_hadd_ps(pv_m256 a, pv_m256 b) {
    return (pv_m256){a[0] + a[1], a[2] + a[3], b[0] + b[1], b[2] + b[3], a[4] + a[5], a[6] + a[7], b[4] + b[5], b[6] + b[7]};
}
/* each 128-bit half: a's low or high, b's low or high (two bits each of imm), or zero (bit 3 or 7) */
static inline pv_m256 pv_mm256_permute2f128_ps(pv_m256 a, pv_m256 b, int imm) {
    pv_m256 v;
    for (int half = 0; half < 2; half++) {
        const int control = imm >> 4 * half;
        const pv_m256 source = control & 2 ? b : a;
        PV_LANES(4) v[4 * half + i] = control & 8 ? 0.0f : source[(control & 1) * 4 + i];
    }
    return v;
}
static inline pv_m256 pv_mm256_permute_ps(pv_m256 a, int imm) {
    pv_m256 v;
    PV_LANES(8) v[i] = a[(i & ~3) + (imm >> 2 * (i & 3) & 3)];
    return v;
}
static inline pv_m256 pv_mm256_shuffle_ps(pv_m256 a, pv_m256 b, int imm) {
    pv_m256 v;
    PV_LANES(8) {
        const int lane = i & ~3, j = i & 3, from = lane + (imm >> 2 * j & 3);
        v[i] = j < 2 ? a[from] : b[from];
    }
    return v;
}
static inline pv_m256 pv_mm256_unpacklo_ps(pv_m256 a, pv_m256 b) {
    return (pv_m256){a[0], b[0], a[1], b[1], a[4], b[4], a[5], b[5]};
}
static inline pv_m256 pv_mm256_unpackhi_ps(pv_m256 a, pv_m256 b) {
    return (pv_m256){a[2], b[2], a[3], b[3], a[6], b[6], a[7], b[7]};
}

#undef _cvtsh_ss
#define _cvtsh_ss pv_cvtsh_ss
#undef _mm_prefetch
#define _mm_prefetch pv_mm_prefetch
#undef _mm_add_ps
#define _mm_add_ps pv_mm_add_ps
#undef _mm_max_ps
#define _mm_max_ps pv_mm_max_ps
#undef _mm_add_ss
#define _mm_add_ss pv_mm_add_ss
#undef _mm_max_ss
#define _mm_max_ss pv_mm_max_ss
#undef _mm_movehl_ps
#define _mm_movehl_ps pv_mm_movehl_ps
#undef _mm_movehdup_ps
#define _mm_movehdup_ps pv_mm_movehdup_ps
#undef _mm_cvtss_f32
#define _mm_cvtss_f32 pv_mm_cvtss_f32
#undef _mm_loadu_si128
#define _mm_loadu_si128 pv_mm_loadu_si128
#undef _mm_loadl_epi64
#define _mm_loadl_epi64 pv_mm_loadl_epi64
#undef _mm_cvtsi32_si128
#define _mm_cvtsi32_si128 pv_mm_cvtsi32_si128
#undef _mm_set1_epi8
#define _mm_set1_epi8 pv_mm_set1_epi8
#undef _mm_and_si128
#define _mm_and_si128 pv_mm_and_si128
#undef _mm_srli_epi16
#define _mm_srli_epi16 pv_mm_srli_epi16
#undef _mm_srli_si128
#define _mm_srli_si128 pv_mm_srli_si128
#undef _mm256_setzero_ps
#define _mm256_setzero_ps pv_mm256_setzero_ps
#undef _mm256_set1_ps
#define _mm256_set1_ps pv_mm256_set1_ps
#undef _mm256_broadcast_ss
#define _mm256_broadcast_ss pv_mm256_broadcast_ss
#undef _mm256_set1_epi32
#define _mm256_set1_epi32 pv_mm256_set1_epi32
#undef _mm256_setr_ps
#define _mm256_setr_ps pv_mm256_setr_ps
#undef _mm256_setr_epi32
#define _mm256_setr_epi32 pv_mm256_setr_epi32
#undef _mm256_loadu_ps
#define _mm256_loadu_ps pv_mm256_loadu_ps
#undef _mm256_storeu_ps
#define _mm256_storeu_ps pv_mm256_storeu_ps
#undef _mm256_add_ps
#define _mm256_add_ps pv_mm256_add_ps
#undef _mm256_sub_ps
#define _mm256_sub_ps pv_mm256_sub_ps
#undef _mm256_mul_ps
#define _mm256_mul_ps pv_mm256_mul_ps
#undef _mm256_div_ps
#define _mm256_div_ps pv_mm256_div_ps
#undef _mm256_max_ps
#define _mm256_max_ps pv_mm256_max_ps
#undef _mm256_min_ps
#define _mm256_min_ps pv_mm256_min_ps
#undef _mm256_fmadd_ps
#define _mm256_fmadd_ps pv_mm256_fmadd_ps
#undef _mm256_fnmadd_ps
#define _mm256_fnmadd_ps pv_mm256_fnmadd_ps
#undef _mm256_andnot_ps
#define _mm256_andnot_ps pv_mm256_andnot_ps
#undef _mm256_cmp_ps
#define _mm256_cmp_ps pv_mm256_cmp_ps
#undef _mm256_round_ps
#define _mm256_round_ps pv_mm256_round_ps
#undef _mm256_cvtps_epi32
#define _mm256_cvtps_epi32 pv_mm256_cvtps_epi32
#undef _mm256_cvtepi32_ps
#define _mm256_cvtepi32_ps pv_mm256_cvtepi32_ps
#undef _mm256_castsi256_ps
#define _mm256_castsi256_ps pv_mm256_castsi256_ps
#undef _mm256_add_epi32
#define _mm256_add_epi32 pv_mm256_add_epi32
#undef _mm256_and_si256
#define _mm256_and_si256 pv_mm256_and_si256
#undef _mm256_slli_epi32
#define _mm256_slli_epi32 pv_mm256_slli_epi32
#undef _mm256_srlv_epi32
#define _mm256_srlv_epi32 pv_mm256_srlv_epi32
#undef _mm256_cvtepu8_epi32
#define _mm256_cvtepu8_epi32 pv_mm256_cvtepu8_epi32
#undef _mm256_cvtepi8_epi32
#define _mm256_cvtepi8_epi32 pv_mm256_cvtepi8_epi32
#undef _mm256_castps256_ps128
#define _mm256_castps256_ps128 pv_mm256_castps256_ps128
#undef _mm256_extractf128_ps
#define _mm256_extractf128_ps pv_mm256_extractf128_ps
#undef _mm256_hadd_ps
#define _mm256_hadd_ps pv_mm256_hadd_ps
#undef _mm256_permute2f128_ps
#define _mm256_permute2f128_ps pv_mm256_permute2f128_ps
#undef _mm256_permute_ps
#define _mm256_permute_ps pv_mm256_permute_ps
#undef _mm256_shuffle_ps
#define _mm256_shuffle_ps pv_mm256_shuffle_ps
#undef _mm256_unpacklo_ps
#define _mm256_unpacklo_ps pv_mm256_unpacklo_ps
#undef _mm256_unpackhi_ps
#define _mm256_unpackhi_ps pv_mm256_unpackhi_ps

#endif /* SNAPKV_PORTABLE */

/* ---- between the widths: 512-bit intrinsics that take or give 128/256-bit vectors (the CPU's or the ones above) ---- */

static inline pv_m512 pv_mm512_castps256_ps512(__m256 a) { pv_m512 v = {0}; memcpy(&v, &a, 32); return v; }
static inline __m256 pv_mm512_castps512_ps256(pv_m512 a) { __m256 v; memcpy(&v, &a, 32); return v; }
static inline __m256 pv_mm512_extractf32x8_ps(pv_m512 a, int high) { __m256 v; memcpy(&v, (float *)&a + (high & 1) * 8, 32); return v; }
static inline pv_m512 pv_mm512_insertf32x8(pv_m512 a, __m256 b, int high) { memcpy((float *)&a + (high & 1) * 8, &b, 32); return a; }
static inline pv_m512i pv_mm512_broadcast_i32x4(__m128i a) {
    pv_m512i v;
    for (int lane = 0; lane < 4; lane++) memcpy((char *)&v + 16 * lane, &a, 16);
    return v;
}
static inline pv_m512i pv_mm512_cvtepu8_epi32(__m128i a) {
    uint8_t b[16];
    memcpy(b, &a, 16);
    pv_m512i v;
    PV_LANES(16) v[i] = b[i];
    return v;
}
static inline pv_m512i pv_mm512_cvtepi8_epi32(__m128i a) {
    int8_t b[16];
    memcpy(b, &a, 16);
    pv_m512i v;
    PV_LANES(16) v[i] = b[i];
    return v;
}
static inline __m256i pv_mm512_cvtepi32_epi16(pv_m512i a) {  /* each lane's low 16 bits */
    uint16_t h[16];
    PV_LANES(16) h[i] = (uint16_t)a[i];
    __m256i v;
    memcpy(&v, h, 32);
    return v;
}
static inline pv_m512 pv_mm512_cvtph_ps(__m256i a) {
    uint16_t h[16];
    memcpy(h, &a, 32);
    pv_m512 v;
    PV_LANES(16) v[i] = pv_half_to_float(h[i]);
    return v;
}
static inline pv_m512i pv_mm512_srl_epi32(pv_m512i a, __m128i count) {  /* every lane by count's low 64 bits */
    uint64_t by;
    memcpy(&by, &count, 8);
    return by > 31 ? (pv_m512i){0} : (pv_m512i)((pv_words16)a >> (unsigned)by);
}
static inline __m128i pv_mm_maskz_loadu_epi8(pv_mask16 mask, const void *p) {  /* bytes off are not read */
    uint8_t b[16] = {0};
    PV_LANES(16) if (mask >> i & 1) b[i] = ((const uint8_t *)p)[i];
    __m128i v;
    memcpy(&v, b, 16);
    return v;
}

#undef _mm512_castps256_ps512
#define _mm512_castps256_ps512 pv_mm512_castps256_ps512
#undef _mm512_castps512_ps256
#define _mm512_castps512_ps256 pv_mm512_castps512_ps256
#undef _mm512_extractf32x8_ps
#define _mm512_extractf32x8_ps pv_mm512_extractf32x8_ps
#undef _mm512_insertf32x8
#define _mm512_insertf32x8 pv_mm512_insertf32x8
#undef _mm512_broadcast_i32x4
#define _mm512_broadcast_i32x4 pv_mm512_broadcast_i32x4
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 pv_mm512_cvtepu8_epi32
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 pv_mm512_cvtepi8_epi32
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 pv_mm512_cvtepi32_epi16
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps pv_mm512_cvtph_ps
#undef _mm512_srl_epi32
#define _mm512_srl_epi32 pv_mm512_srl_epi32
#undef _mm_maskz_loadu_epi8
#define _mm_maskz_loadu_epi8 pv_mm_maskz_loadu_epi8

#endif
