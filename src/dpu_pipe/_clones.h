/* DP_CLONES: a pass compiled three times on x86-64 GCC, for the SSE2 baseline, for AVX2 (8 float
 * lanes) and for x86-64-v4 (AVX-512, 16), none with FMA: the same bits; the copy picked at load
 * time (ifunc). Elsewhere, once. */
#ifndef DP_CLONES_H
#define DP_CLONES_H
/* The kernels' vector code uses __builtin_shufflevector, which GCC has since 12: say so
   instead of failing on the first use. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12
#error "dpu_pipe's kernels need GCC 12 or later: install gcc-12 and build with CC=gcc-12"
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DP_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define DP_CLONES
#endif
#endif
