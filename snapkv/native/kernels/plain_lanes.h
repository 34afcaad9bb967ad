/* What lanes8_plain.h and lanes16_plain.h share: a multiply-add as the target makes it, and a loop over the lanes. */
#ifndef SNAPKV_PLAIN_LANES_H
#define SNAPKV_PLAIN_LANES_H

#if defined(__FMA__) || defined(__aarch64__) || defined(__FP_FAST_FMAF)
#define PLAIN_HAS_FMA 1
#define PLAIN_FMA(a, b, c) __builtin_fmaf((a), (b), (c))  /* one instruction on this target */
#else
#define PLAIN_HAS_FMA 0
#define PLAIN_FMA(a, b, c) ((a) * (b) + (c))              /* no fused multiply-add here: a product, then a sum */
#endif

#define EACH_LANE(n) for (int i = 0; i < (n); i++)

#endif
