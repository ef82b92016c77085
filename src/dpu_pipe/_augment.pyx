# Augmentation kernels on the uint8 crop at output size: torchvision's auto-augment op set
# (TrivialAugmentWide, RandAugment, AutoAugment's ImageNet policy), colour jitter, grayscale
# and random erasing, with the arithmetic of torchvision.transforms.v2.functional on uint8
# tensors (float32 where it computes in float32, truncation where it converts with .to(uint8),
# round half to even where it rounds). Contract in _augment.pxd; the augmentation spaces and
# magnitude tables are built in dpu_pipe/augment.py and handed over as a dict.
#
# Images are (h, w, 3) uint8, rows contiguous. Ops work out of place into `tmp` where they must
# (the affine ops) and copy back, so every op leaves its result in `img`.
from libc.stdint cimport uint8_t, uint16_t, int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memchr, memcpy, memset
from libc.math cimport floor, fmod, sqrt, rint

from dpu_pipe._ops cimport (OpsOutput, OPS_FLOAT32, OPS_UINT8, OPS_FLOAT16, OPS_BFLOAT16,
                            OPS_CHW, OPS_OK, _to_f16, _to_bf16, ops_gaussian_kernel)
from dpu_pipe._rng cimport (rng_block, rng_uniform2, portable_log, portable_exp,
                            RNG_STREAM_AUGMENT, RNG_STREAM_JITTER, RNG_STREAM_GRAYSCALE,
                            RNG_STREAM_ERASE, RNG_STREAM_ERASE_NOISE, RNG_STREAM_BLUR,
                            RNG_STREAM_SOLARIZE)

import numpy as np

from dpu_pipe.errors import ConfigError

cdef extern from "_blur.h":
    size_t blur_scratch_floats(Py_ssize_t w, int kx, int ky) noexcept nogil
    int blur_rgb_u8(const uint8_t* src, Py_ssize_t src_stride, int h, int w, uint8_t* dst,
                    Py_ssize_t dst_stride, const float* wx, int kx, const float* wy, int ky,
                    float* scratch) noexcept nogil

cdef extern from *:
    # Cython lowers a conditional expression to if/else, which GCC does not vectorize here.
    """
    static inline uint8_t dp_u8min(uint8_t a, uint8_t b) { return a < b ? a : b; }
    static inline uint8_t dp_u8max(uint8_t a, uint8_t b) { return a > b ? a : b; }
    """
    uint8_t dp_u8min(uint8_t a, uint8_t b) noexcept nogil
    uint8_t dp_u8max(uint8_t a, uint8_t b) noexcept nogil

cdef extern from *:
    # The colour passes and the float32 output conversion on interleaved RGB without gathers
    # or strided scalar loops: 16 pixels (48 bytes) widen to twelve 4-float vectors; per 4
    # pixels, shuffles give the R, G and B lanes (for the grayscale, or the CHW planes), and
    # saturation spreads a * floor(gray) back to the interleaved order. GCC's generic vectors
    # (SSE2, NEON), plus an AVX2 copy of each pass on x86-64 (about 7 % fewer instructions
    # per sample of the ViT recipe); each lane does the scalar formula's float32 operations.
    """
    #include "_clones.h"
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #elif defined(__ARM_NEON)
    #include <arm_neon.h>
    #endif
    typedef float dp_f4 __attribute__((vector_size(16)));
    typedef int32_t dp_i4 __attribute__((vector_size(16)));
    typedef uint16_t dp_h8 __attribute__((vector_size(16)));
    typedef uint8_t dp_b16 __attribute__((vector_size(16)));

    /* 16 bytes to four 4-float vectors, by interleaving with zeros as the unpack instructions
       do (GCC scalarizes a direct conversion on SSE2). Little-endian lanes, as on both targets. */
    static inline void dp_widen(const uint8_t* p, dp_f4* x) {
        dp_b16 b, z = {0};
        dp_h8 hz = {0};
        memcpy(&b, p, 16);
        dp_h8 lo = (dp_h8)__builtin_shufflevector(b, z, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        dp_h8 hi = (dp_h8)__builtin_shufflevector(b, z, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        x[0] = __builtin_convertvector((dp_i4)__builtin_shufflevector(lo, hz, 0, 8, 1, 9, 2, 10, 3, 11), dp_f4);
        x[1] = __builtin_convertvector((dp_i4)__builtin_shufflevector(lo, hz, 4, 12, 5, 13, 6, 14, 7, 15), dp_f4);
        x[2] = __builtin_convertvector((dp_i4)__builtin_shufflevector(hi, hz, 0, 8, 1, 9, 2, 10, 3, 11), dp_f4);
        x[3] = __builtin_convertvector((dp_i4)__builtin_shufflevector(hi, hz, 4, 12, 5, 13, 6, 14, 7, 15), dp_f4);
    }

    /* Four 4-float vectors of values in [0, 255] truncated to 16 bytes. */
    static inline void dp_narrow(const dp_f4* x, uint8_t* p) {
        dp_i4 a = __builtin_convertvector(x[0], dp_i4), b = __builtin_convertvector(x[1], dp_i4);
        dp_i4 c = __builtin_convertvector(x[2], dp_i4), d = __builtin_convertvector(x[3], dp_i4);
    #if defined(__SSE2__)
        __m128i v = _mm_packus_epi16(_mm_packs_epi32((__m128i)a, (__m128i)b),
                                     _mm_packs_epi32((__m128i)c, (__m128i)d));
        _mm_storeu_si128((__m128i*)p, v);
    #elif defined(__ARM_NEON)
        uint16x8_t lo = vcombine_u16(vmovn_u32((uint32x4_t)a), vmovn_u32((uint32x4_t)b));
        uint16x8_t hi = vcombine_u16(vmovn_u32((uint32x4_t)c), vmovn_u32((uint32x4_t)d));
        vst1q_u8(p, vcombine_u8(vmovn_u16(lo), vmovn_u16(hi)));
    #else
        dp_h8 lo = (dp_h8)__builtin_shufflevector((dp_h8)a, (dp_h8)b, 0, 2, 4, 6, 8, 10, 12, 14);
        dp_h8 hi = (dp_h8)__builtin_shufflevector((dp_h8)c, (dp_h8)d, 0, 2, 4, 6, 8, 10, 12, 14);
        dp_b16 v = __builtin_shufflevector((dp_b16)lo, (dp_b16)hi, 0, 2, 4, 6, 8, 10, 12, 14,
                                           16, 18, 20, 22, 24, 26, 28, 30);
        memcpy(p, &v, 16);
    #endif
    }

    static inline dp_f4 dp_sat4(dp_f4 v, dp_f4 r, dp_f4 ay) {
        dp_f4 f = v * r + ay;
        dp_i4 pos = f > 0.0f, big = f < 255.0f;
        dp_i4 b = (dp_i4)f & pos;
        return (dp_f4)((b & big) | ((dp_i4)(dp_f4){255.0f, 255.0f, 255.0f, 255.0f} & ~big));
    }

    /* The R, G and B lanes of 4 pixels from their 12 interleaved values in x0..x2. */
    static inline void dp_planes4(dp_f4 x0, dp_f4 x1, dp_f4 x2, dp_f4* R, dp_f4* G, dp_f4* B) {
        *R = __builtin_shufflevector(__builtin_shufflevector(x0, x1, 0, 3, 6, 5), x2, 0, 1, 2, 5);
        *G = __builtin_shufflevector(__builtin_shufflevector(x0, x1, 1, 4, 7, 7), x2, 0, 1, 2, 6);
        *B = __builtin_shufflevector(__builtin_shufflevector(x0, x1, 2, 5, 5, 5), x2, 0, 1, 4, 7);
    }

    /* Floor of the grayscale of 4 pixels, (0.2989 r + 0.587 g) + 0.114 b in float32, from
       their 12 interleaved values in x0..x2. */
    static inline dp_f4 dp_gray4(dp_f4 x0, dp_f4 x1, dp_f4 x2) {
        dp_f4 R, G, B;
        dp_planes4(x0, x1, x2, &R, &G, &B);
        dp_f4 y = (R * 0.2989f + 0.587f * G) + 0.114f * B;
        return __builtin_convertvector(__builtin_convertvector(y, dp_i4), dp_f4);   /* y >= 0 */
    }

    /* The 48 interleaved values at p through the maps, as floats: lf[256 c + v] is
       (float)lut[256 c + v]. Gathering the floats straight into the lanes takes about a third
       of the instructions of mapping the bytes and then widening them (GCC merges mapped
       bytes through partial registers). Four pixels fill three vectors. */
    static inline __attribute__((always_inline)) void dp_gather48(const uint8_t* p,
                                                                  const float* lf, dp_f4* x) {
        const float *lr = lf, *lg = lf + 256, *lb = lf + 512;
        for (int g = 0; g < 4; g++, p += 12, x += 3) {
            x[0] = (dp_f4){lr[p[0]], lg[p[1]], lb[p[2]], lr[p[3]]};
            x[1] = (dp_f4){lg[p[4]], lb[p[5]], lr[p[6]], lg[p[7]]};
            x[2] = (dp_f4){lb[p[8]], lr[p[9]], lg[p[10]], lb[p[11]]};
        }
    }

    enum { DP_SATURATION, DP_GRAYSCALE, DP_GRAY_SUM };

    /* The vector part of the passes below on the 16 pixels of x[12] (as dp_widen or
       dp_gather48 give them: four pixels in three vectors), in place: saturation
       (x * r + a * floor(gray), clamped), grayscale (floor(gray) in all three channels), or
       neither, adding floor(gray) to *sum. */
    static inline __attribute__((always_inline)) void dp_gray_block4(
            dp_f4* x, float r, float a, int mode, dp_i4* sum) {
        const dp_f4 rv = {r, r, r, r}, av = {a, a, a, a};
        for (int g = 0; g < 12; g += 3) {
            dp_f4 y = dp_gray4(x[g], x[g + 1], x[g + 2]);
            if (mode == DP_GRAY_SUM) {
                *sum += __builtin_convertvector(y, dp_i4);
                continue;
            }
            if (mode == DP_SATURATION)
                y = av * y;
            dp_f4 e0 = __builtin_shufflevector(y, y, 0, 0, 0, 1);
            dp_f4 e1 = __builtin_shufflevector(y, y, 1, 1, 2, 2);
            dp_f4 e2 = __builtin_shufflevector(y, y, 2, 3, 3, 3);
            if (mode == DP_SATURATION) {
                e0 = dp_sat4(x[g], rv, e0);
                e1 = dp_sat4(x[g + 1], rv, e1);
                e2 = dp_sat4(x[g + 2], rv, e2);
            }
            x[g] = e0;
            x[g + 1] = e1;
            x[g + 2] = e2;
        }
    }

    #if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    /* dp_gray_block4 with eight pixels to a vector of 8 lanes, for the AVX2 build of the
       passes: the halves are two groups of four pixels, every shuffle of the 4-lane code runs
       in both halves (so AVX's in-lane shuffles do it), and each lane does the 4-lane code's
       operations. (Only on x86-64: 16-byte targets split 8-lane vectors poorly.) */
    typedef float dp_f8 __attribute__((vector_size(32)));
    typedef int32_t dp_i8 __attribute__((vector_size(32)));
    #define DP_M(i) ((i) < 4 ? (i) : (i) + 4)
    #define DP_SHUF8(x, y, a, b, c, d) __builtin_shufflevector(x, y, DP_M(a), DP_M(b), \
        DP_M(c), DP_M(d), DP_M(a) + 4, DP_M(b) + 4, DP_M(c) + 4, DP_M(d) + 4)
    #define DP_CAT(lo, hi) __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7)
    #define DP_LO(v) __builtin_shufflevector(v, v, 0, 1, 2, 3)
    #define DP_HI(v) __builtin_shufflevector(v, v, 4, 5, 6, 7)

    /* The six vectors x[0..5] (8 pixels, as dp_widen gives them) as three of 8 lanes, the
       pixels 0-3 in the low halves and 4-7 in the high ones; dp_split8 is the way back. */
    static inline __attribute__((always_inline)) void dp_join8(
            const dp_f4* x, dp_f8* x0, dp_f8* x1, dp_f8* x2) {
        *x0 = DP_CAT(x[0], x[3]);
        *x1 = DP_CAT(x[1], x[4]);
        *x2 = DP_CAT(x[2], x[5]);
    }

    static inline __attribute__((always_inline)) void dp_split8(
            const dp_f8* x0, const dp_f8* x1, const dp_f8* x2, dp_f4* x) {
        x[0] = DP_LO(*x0);
        x[3] = DP_HI(*x0);
        x[1] = DP_LO(*x1);
        x[4] = DP_HI(*x1);
        x[2] = DP_LO(*x2);
        x[5] = DP_HI(*x2);
    }

    /* dp_planes4 in both halves. (8-lane vectors pass through pointers: 32-byte values
       passed to functions built for 16-byte registers would change their ABI.) */
    static inline __attribute__((always_inline)) void dp_planes8(
            const dp_f8* x0, const dp_f8* x1, const dp_f8* x2, dp_f8* R, dp_f8* G, dp_f8* B) {
        *R = DP_SHUF8(DP_SHUF8(*x0, *x1, 0, 3, 6, 5), *x2, 0, 1, 2, 5);
        *G = DP_SHUF8(DP_SHUF8(*x0, *x1, 1, 4, 7, 7), *x2, 0, 1, 2, 6);
        *B = DP_SHUF8(DP_SHUF8(*x0, *x1, 2, 5, 5, 5), *x2, 0, 1, 4, 7);
    }

    static inline __attribute__((always_inline)) void dp_gray_block8(
            dp_f4* x, float r, float a, int mode, dp_i4* sum) {
        const dp_f8 rv = {r, r, r, r, r, r, r, r}, av = {a, a, a, a, a, a, a, a};
        for (int g = 0; g < 12; g += 6) {
            dp_f8 x0, x1, x2, R, G, B;
            dp_join8(x + g, &x0, &x1, &x2);
            dp_planes8(&x0, &x1, &x2, &R, &G, &B);
            dp_f8 y = (R * 0.2989f + 0.587f * G) + 0.114f * B;
            dp_i8 yi = __builtin_convertvector(y, dp_i8);                  /* y >= 0 */
            if (mode == DP_GRAY_SUM) {
                *sum += DP_LO(yi) + DP_HI(yi);
                continue;
            }
            y = __builtin_convertvector(yi, dp_f8);
            if (mode == DP_SATURATION)
                y = av * y;
            dp_f8 e0 = DP_SHUF8(y, y, 0, 0, 0, 1);
            dp_f8 e1 = DP_SHUF8(y, y, 1, 1, 2, 2);
            dp_f8 e2 = DP_SHUF8(y, y, 2, 3, 3, 3);
            if (mode == DP_SATURATION) {
                dp_f8 v[3] = {x0, x1, x2}, *e[3] = {&e0, &e1, &e2};
                for (int k = 0; k < 3; k++) {          /* dp_sat4 */
                    dp_f8 f = v[k] * rv + *e[k];
                    dp_i8 pos = f > 0.0f, big = f < 255.0f;
                    dp_i8 b = (dp_i8)f & pos;
                    *e[k] = (dp_f8)((b & big) | ((dp_i8)(dp_f8){255.0f, 255.0f, 255.0f, 255.0f,
                                    255.0f, 255.0f, 255.0f, 255.0f} & ~big));
                }
            }
            dp_split8(&e0, &e1, &e2, x + g);
        }
    }

    #define DP_WIDE_BLOCK 1
    #endif

    /* One block of 16 pixels at p, in place unless mode is DP_GRAY_SUM: saturation
       (img * r + a * floor(gray), clamped, truncated), grayscale (floor(gray) in all three
       channels), or neither, adding floor(gray) to *sum. With lf (the maps as floats), the
       block runs on the mapped values. wide: 8 lanes (only inside a function built for AVX2). */
    static inline __attribute__((always_inline)) void dp_gray_block(
            uint8_t* p, float r, float a, int mode, const float* lf, int wide, dp_i4* sum) {
        dp_f4 x[12];
        if (lf) {
            dp_gather48(p, lf, x);
        } else {
            for (int k = 0; k < 3; k++)
                dp_widen(p + 16 * k, x + 4 * k);
        }
    #ifdef DP_WIDE_BLOCK
        if (wide)
            dp_gray_block8(x, r, a, mode, sum);
        else
    #endif
            dp_gray_block4(x, r, a, mode, sum);
        if (mode != DP_GRAY_SUM)
            for (int k = 0; k < 3; k++)
                dp_narrow(x + 4 * k, p + 16 * k);
    }

    /* dp_gray_block over npix pixels, returning the sum of floor(gray); with lut (3 x 256) on
       lut[256 c + value] instead of the values: pending maps applied on the way. The last
       npix % 16 pixels are mapped into a zero-padded block (gray 0: the sum is unchanged). */
    static inline __attribute__((always_inline)) int64_t dp_gray_pass(
            uint8_t* img, Py_ssize_t npix, float r, float a, int mode, const uint8_t* lut,
            int wide) {
        dp_i4 sum = {0, 0, 0, 0};      /* flushed every 2**20 pixels: lanes stay below 2**27 */
        int64_t total = 0;
        Py_ssize_t i = 0;
        float lf[768];
        if (lut)
            for (int v = 0; v < 768; v++)
                lf[v] = (float)lut[v];
        for (; i + 16 <= npix; i += 16) {
            dp_gray_block(img + 3 * i, r, a, mode, lut ? lf : NULL, wide, &sum);
            if (mode == DP_GRAY_SUM && (i & ((1 << 20) - 1)) == 0) {
                total += (int64_t)sum[0] + sum[1] + sum[2] + sum[3];
                sum = (dp_i4){0, 0, 0, 0};
            }
        }
        if (i < npix) {
            uint8_t t[48] = {0};
            for (Py_ssize_t k = 0; k < 3 * (npix - i); k++)
                t[k] = lut ? lut[256 * (k % 3) + img[3 * i + k]] : img[3 * i + k];
            dp_gray_block(t, r, a, mode, NULL, wide, &sum);
            if (mode != DP_GRAY_SUM)
                memcpy(img + 3 * i, t, (size_t)(3 * (npix - i)));
        }
        return total + ((int64_t)sum[0] + sum[1] + sum[2] + sum[3]);
    }

    /* The pass for the baseline and (x86-64) for AVX2 with 8-lane blocks, picked by the CPU. */
    static int64_t dp_gray_pass_base(uint8_t* img, Py_ssize_t npix, float r, float a, int mode,
                                     const uint8_t* lut) {
        return dp_gray_pass(img, npix, r, a, mode, lut, 0);
    }
    #ifdef DP_WIDE_BLOCK
    __attribute__((target("avx2")))
    static int64_t dp_gray_pass_avx2(uint8_t* img, Py_ssize_t npix, float r, float a, int mode,
                                     const uint8_t* lut) {
        return dp_gray_pass(img, npix, r, a, mode, lut, 1);
    }
    #define dp_gray_run (__builtin_cpu_supports("avx2") ? dp_gray_pass_avx2 : dp_gray_pass_base)
    #else
    #define dp_gray_run dp_gray_pass_base
    #endif

    /* dp_hue4: _hue's formula for 4 pixels in the lanes (_hue_lanes.h); on aarch64 floor and
       trunc are one instruction each (FRINTM, FRINTZ), SSE2 has none. */
    #define DP_HUE_F dp_f4
    #define DP_HUE_I dp_i4
    #define DP_HUE_NAME(name) name##4
    #if defined(__aarch64__)
    #define DP_HUE_FLOOR(x) ((dp_f4)vrndmq_f32((float32x4_t)(x)))
    #define DP_HUE_TRUNC(x) ((dp_f4)vrndq_f32((float32x4_t)(x)))
    #endif
    #include "_hue_lanes.h"

    /* The result of dp_hue4 (planes R, G, B of 4 pixels) back in the interleaved order. */
    #define DP_INTERLEAVE(SHUF, R, G, B, x0, x1, x2) do { \
        x0 = SHUF(SHUF(R, G, 0, 4, 1, 5), B, 0, 1, 4, 2); \
        x1 = SHUF(SHUF(G, B, 1, 5, 2, 6), R, 0, 1, 6, 2); \
        x2 = SHUF(SHUF(R, G, 3, 7, 3, 7), B, 6, 0, 1, 7); } while (0)
    #define DP_SHUF4(x, y, a, b, c, d) __builtin_shufflevector(x, y, a, b, c, d)

    /* _hue on the 16 pixels of x (dp_widen's twelve vectors), four to a vector, in place. */
    static inline __attribute__((always_inline)) void dp_hue_groups4(
            dp_f4* x, float sc, float hf, float back) {
        for (int g = 0; g < 12; g += 3) {
            dp_f4 R, G, B;
            dp_planes4(x[g], x[g + 1], x[g + 2], &R, &G, &B);
            dp_hue4(&R, &G, &B, sc, hf, back);
            DP_INTERLEAVE(DP_SHUF4, R, G, B, x[g], x[g + 1], x[g + 2]);
        }
    }

    /* _hue on the 16 pixels at px through GROUPS: widened, the result interleaved back and
       truncated to bytes (values in [0, 256): truncation is _trunc_u8 there). */
    #define DP_HUE_BLOCK(GROUPS, px, sc, hf, back) do { \
        dp_f4 x_[12]; \
        for (int k = 0; k < 3; k++) \
            dp_widen((px) + 16 * k, x_ + 4 * k); \
        GROUPS(x_, sc, hf, back); \
        for (int k = 0; k < 3; k++) \
            dp_narrow(x_ + 4 * k, (px) + 16 * k); } while (0)

    /* _hue on npix pixels, 16 at a time; the last npix % 16 through a zero-padded block (each
       lane's result depends on its own pixel only). */
    #define DP_HUE_PASS(GROUPS, img, npix, sc, hf, back) do { \
        Py_ssize_t i = 0; \
        for (; i + 16 <= npix; i += 16) \
            DP_HUE_BLOCK(GROUPS, img + 3 * i, sc, hf, back); \
        if (i < npix) { \
            uint8_t t[48] = {0}; \
            memcpy(t, img + 3 * i, (size_t)(3 * (npix - i))); \
            DP_HUE_BLOCK(GROUPS, t, sc, hf, back); \
            memcpy(img + 3 * i, t, (size_t)(3 * (npix - i))); \
        } } while (0)

    static void dp_hue_base(uint8_t* img, Py_ssize_t npix, float sc, float hf, float back) {
        DP_HUE_PASS(dp_hue_groups4, img, npix, sc, hf, back);
    }
    #ifdef DP_WIDE_BLOCK
    /* The AVX2 copy: eight pixels to a vector, floor and trunc one VROUNDPS each (exact, as
       the conversions of the baseline), the selects of max, min and the clamps one VMAXPS or
       VMINPS. Compiled for AVX2 as a whole, so that the intrinsics inline. */
    #pragma GCC push_options
    #pragma GCC target("avx2")
    #include <immintrin.h>
    #define DP_HUE_F dp_f8
    #define DP_HUE_I dp_i8
    #define DP_HUE_NAME(name) name##8
    #define DP_HUE_FLOOR(x) ((dp_f8)_mm256_floor_ps((__m256)(x)))
    #define DP_HUE_TRUNC(x) ((dp_f8)_mm256_round_ps((__m256)(x), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC))
    #define DP_HUE_MAX(x, y) ((dp_f8)_mm256_max_ps((__m256)(x), (__m256)(y)))
    #define DP_HUE_MIN(x, y) ((dp_f8)_mm256_min_ps((__m256)(x), (__m256)(y)))
    #include "_hue_lanes.h"

    static inline __attribute__((always_inline)) void dp_hue_groups8(
            dp_f4* x, float sc, float hf, float back) {
        for (int g = 0; g < 12; g += 6) {
            dp_f8 R, G, B, y0, y1, y2;
            dp_join8(x + g, &y0, &y1, &y2);
            dp_planes8(&y0, &y1, &y2, &R, &G, &B);
            dp_hue8(&R, &G, &B, sc, hf, back);
            DP_INTERLEAVE(DP_SHUF8, R, G, B, y0, y1, y2);
            dp_split8(&y0, &y1, &y2, x + g);
        }
    }

    static void dp_hue_avx2(uint8_t* img, Py_ssize_t npix, float sc, float hf, float back) {
        DP_HUE_PASS(dp_hue_groups8, img, npix, sc, hf, back);
    }
    #pragma GCC pop_options
    #define dp_hue (__builtin_cpu_supports("avx2") ? dp_hue_avx2 : dp_hue_base)
    #else
    #define dp_hue dp_hue_base
    #endif

    /* out = value * scale[c] + bias[c] per element, float32, CHW (planes of npix) or HWC. */
    DP_CLONES static void dp_convert_f32(const uint8_t* img, Py_ssize_t npix, const float* s,
                               const float* b, float* out, int chw) {
        const dp_f4 s0 = {s[0], s[1], s[2], s[0]}, s1 = {s[1], s[2], s[0], s[1]},
                    s2 = {s[2], s[0], s[1], s[2]};
        const dp_f4 b0 = {b[0], b[1], b[2], b[0]}, b1 = {b[1], b[2], b[0], b[1]},
                    b2 = {b[2], b[0], b[1], b[2]};
        /* In registers: out may alias s and b as far as the compiler knows, which would
           reload them at every store. */
        const dp_f4 sr = {s[0], s[0], s[0], s[0]}, sg = {s[1], s[1], s[1], s[1]},
                    sb = {s[2], s[2], s[2], s[2]};
        const dp_f4 br = {b[0], b[0], b[0], b[0]}, bg = {b[1], b[1], b[1], b[1]},
                    bb = {b[2], b[2], b[2], b[2]};
        Py_ssize_t i = 0;
        for (; i + 16 <= npix; i += 16) {
            dp_f4 x[12];
            for (int k = 0; k < 3; k++)
                dp_widen(img + 3 * i + 16 * k, x + 4 * k);
            for (int g = 0; g < 12; g += 3) {
                dp_f4 x0 = x[g], x1 = x[g + 1], x2 = x[g + 2];
                if (chw) {
                    Py_ssize_t at = i + 4 * (g / 3);
                    dp_f4 R, G, B;
                    dp_planes4(x0, x1, x2, &R, &G, &B);
                    R = R * sr + br;
                    G = G * sg + bg;
                    B = B * sb + bb;
                    memcpy(out + at, &R, 16);
                    memcpy(out + npix + at, &G, 16);
                    memcpy(out + 2 * npix + at, &B, 16);
                } else {
                    x0 = x0 * s0 + b0;
                    x1 = x1 * s1 + b1;
                    x2 = x2 * s2 + b2;
                    memcpy(out + 3 * i + 4 * g, &x0, 16);
                    memcpy(out + 3 * i + 4 * g + 4, &x1, 16);
                    memcpy(out + 3 * i + 4 * g + 8, &x2, 16);
                }
            }
        }
        for (; i < npix; i++)
            for (int c = 0; c < 3; c++)
                out[chw ? c * npix + i : 3 * i + c] = (float)img[3 * i + c] * s[c] + b[c];
    }

    /* out = lf[256 c + value] per element (lf: the 3 x 256 converted values), float32, CHW
       (planes of npix) or HWC: the table's floats gathered straight into vector lanes. */
    DP_CLONES static void dp_convert_lut_f32(const uint8_t* img, Py_ssize_t npix,
                                             const float* lf, float* out, int chw) {
        const float *lr = lf, *lg = lf + 256, *lb = lf + 512;
        Py_ssize_t i = 0;
        for (; i + 16 <= npix; i += 16) {
            const uint8_t* p = img + 3 * i;
            if (chw) {
                for (int g = 0; g < 4; g++, p += 12) {
                    dp_f4 R = {lr[p[0]], lr[p[3]], lr[p[6]], lr[p[9]]};
                    dp_f4 G = {lg[p[1]], lg[p[4]], lg[p[7]], lg[p[10]]};
                    dp_f4 B = {lb[p[2]], lb[p[5]], lb[p[8]], lb[p[11]]};
                    memcpy(out + i + 4 * g, &R, 16);
                    memcpy(out + npix + i + 4 * g, &G, 16);
                    memcpy(out + 2 * npix + i + 4 * g, &B, 16);
                }
            } else {
                dp_f4 x[12];
                dp_gather48(p, lf, x);
                memcpy(out + 3 * i, x, sizeof x);
            }
        }
        for (; i < npix; i++)
            for (int c = 0; c < 3; c++)
                out[chw ? c * npix + i : 3 * i + c] = lf[256 * c + img[3 * i + c]];
    }

    /* One row of _sharpness: t[j] for j in [3, r - 3) from the rows u (above), p and d
       (below), r bytes each. The blur sum S <= 13 * 255 and 2 S + 13 fit 16 bits, and
       ((2 S + 13) * 10083) >> 18 is the high half of a 16-bit product shifted by 2, which
       GCC vectorizes as such; the blend is float32 as in the scalar formula. */
    DP_CLONES static void dp_sharpen_row(const uint8_t* __restrict__ u,
                                         const uint8_t* __restrict__ p,
                                         const uint8_t* __restrict__ d,
                                         uint8_t* __restrict__ t, Py_ssize_t r, float alpha) {
        for (Py_ssize_t j = 3; j < r - 3; j++) {
            uint16_t s = (uint16_t)((u[j - 3] + u[j] + u[j + 3]) + (p[j - 3] + 5 * p[j] + p[j + 3])
                                    + (d[j - 3] + d[j] + d[j + 3]));
            uint16_t m = (uint16_t)(2 * s + 13);
            uint16_t blur = (uint16_t)(((uint32_t)m * 10083u) >> 16) >> 2;
            float v = (float)p[j];
            float f = v + alpha * ((float)blur - v);
            f = f > 0.0f ? f : 0.0f;
            f = f < 255.0f ? f : 255.0f;
            t[j] = (uint8_t)(int)f;
        }
    }
    """
    void dp_sharpen_row(const uint8_t* u, const uint8_t* p, const uint8_t* d, uint8_t* t,
                        Py_ssize_t r, float alpha) noexcept nogil
    void dp_convert_lut_f32(const uint8_t* img, Py_ssize_t npix, const float* lf, float* out,
                            int chw) noexcept nogil
    enum: DP_SATURATION, DP_GRAYSCALE, DP_GRAY_SUM
    int64_t dp_gray_run(uint8_t* img, Py_ssize_t npix, float r, float a, int mode,
                        const uint8_t* lut) noexcept nogil
    void dp_convert_f32(const uint8_t* img, Py_ssize_t npix, const float* s, const float* b,
                        float* out, int chw) noexcept nogil
    void dp_hue(uint8_t* img, Py_ssize_t npix, float sc, float hf, float back) noexcept nogil

#: torchvision's names of the ops, indexed by the AUG_* codes of _augment.pxd.
OP_NAMES = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness",
            "Color", "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast",
            "Equalize", "Invert", "brightness", "contrast", "saturation", "hue", "grayscale",
            "blur", "solarize")
OP_CODES = {name: i for i, name in enumerate(OP_NAMES)}

DEF PI = 3.141592653589793


# --- sin and cos from + - * / only (rotation matrices; bit-identical everywhere) -----------

cdef void _sincos(double x, double* s, double* c) noexcept nogil:
    """sin and cos of x (|x| <= 8) within ~1 ulp: reduction by pi/2 in three parts (exact
    products: each part has 33 or fewer significant bits) and Taylor series on |r| <= pi/4."""
    cdef double k = rint(x * 0.6366197723675814)
    cdef double r = ((x - k * 1.5707963267341256) - k * 6.077100506506192e-11) \
        - k * 2.0222662487959506e-21
    cdef double r2 = r * r
    cdef double ps, pc
    ps = -7.647163731819816e-13
    ps = ps * r2 + 1.6059043836821613e-10
    ps = ps * r2 - 2.505210838544172e-08
    ps = ps * r2 + 2.7557319223985893e-06
    ps = ps * r2 - 0.0001984126984126984
    ps = ps * r2 + 0.008333333333333333
    ps = ps * r2 - 0.16666666666666666
    ps = r + r * (r2 * ps)
    pc = 4.779477332387385e-14
    pc = pc * r2 - 1.1470745597729725e-11
    pc = pc * r2 + 2.08767569878681e-09
    pc = pc * r2 - 2.755731922398589e-07
    pc = pc * r2 + 2.48015873015873e-05
    pc = pc * r2 - 0.001388888888888889
    pc = pc * r2 + 0.041666666666666664
    pc = pc * r2 - 0.5
    pc = 1.0 + r2 * pc
    cdef int q = (<int>k) & 3
    if q == 0:
        s[0], c[0] = ps, pc
    elif q == 1:
        s[0], c[0] = pc, -ps
    elif q == 2:
        s[0], c[0] = -ps, -pc
    else:
        s[0], c[0] = -pc, ps


cdef double _normal(double u) noexcept nogil:
    """Standard normal quantile of u in [0, 1) (Acklam's rational approximation, relative
    error < 1.2e-9), from portable_log and sqrt: a Gaussian from one uniform."""
    cdef double q, r, p = (floor(u * 9007199254740992.0) + 0.5) * 1.1102230246251565e-16
    if p < 0.02425 or p > 1.0 - 0.02425:    # the tails, odd: negating is exact
        q = sqrt(-2.0 * portable_log(p if p < 0.5 else 1.0 - p))
        r = (((((-7.784894002430293e-03 * q - 3.223964580411365e-01) * q
                - 2.400758277161838e+00) * q - 2.549732539343734e+00) * q
              + 4.374664141464968e+00) * q + 2.938163982698783e+00) / \
            ((((7.784695709041462e-03 * q + 3.224671290700398e-01) * q
               + 2.445134137142996e+00) * q + 3.754408661907416e+00) * q + 1.0)
        return r if p < 0.5 else -r
    q = p - 0.5
    r = q * q
    return (((((-3.969683028665376e+01 * r + 2.209460984245205e+02) * r
               - 2.759285104469687e+02) * r + 1.383577518672690e+02) * r
             - 3.066479806614716e+01) * r + 2.506628277459239e+00) * q / \
           (((((-5.447609879822406e+01 * r + 1.615858368580409e+02) * r
               - 1.556989798598866e+02) * r + 6.680131188771972e+01) * r
             - 1.328068155288572e+01) * r + 1.0)


# --- sampling -------------------------------------------------------------------------------

cdef inline int _randint(double u, int n) noexcept nogil:
    cdef int k = <int>floor(u * n)
    return k if k < n else n - 1


cdef double _level_magnitude(const AugConfig* cfg, const AugSpaceOp* sp, double level) noexcept nogil:
    """Magnitude of a continuous level (RandAugment with mstd): the bins' formula, float32."""
    cdef double m
    if sp.kind == 1:
        return rint(8.0 - level / ((cfg.num_bins - 1) / cfg.posterize_div))
    m = sp.start + (sp.end - sp.start) * (level / (cfg.num_bins - 1))
    return <double><float>m


cdef inline void _push(AugParams* out, int op, double mag) noexcept nogil:
    if out.n < AUG_MAX_STEPS:
        out.step[out.n].op = op
        out.step[out.n].mag = mag
        out.n += 1


cdef void aug_sample(const AugConfig* cfg, uint64_t seed, uint32_t epoch, uint64_t index,
                     AugParams* out) noexcept nogil:
    """All random parameters of one sample, in the order they apply. Each purpose has its own
    stream; blocks within it: TA block 0 (op, bin), 1 (sign); RA op k blocks 2k (op, sign),
    2k+1 (level noise); AutoAugment block 0 (sub-policy), 1 + s (probability, sign) of step s;
    jitter blocks 0-1 (order), 1-3 (factors); grayscale block 0; erasing block 0 (p), 1 + a
    (scale, ratio) and 11 + a (position) of attempt a."""
    cdef double u0, u1, u2, u3, mag, level, area, target, aspect, hf, wf
    cdef const AugSpaceOp* sp
    cdef int k, s, pol, t, j, hh, ww
    cdef int perm[4]
    cdef double fac[4]
    cdef uint32_t vs = cfg.vstream
    out.n = 0
    out.erase = 0
    out.seed, out.epoch, out.index = seed, epoch, index
    if cfg.mode == AUG_MODE_TA_WIDE:
        rng_uniform2(seed, epoch, index, RNG_STREAM_AUGMENT + vs, 0, &u0, &u1)
        sp = &cfg.space[_randint(u0, cfg.n_space)]
        mag = 0.0
        if sp.has_mag:
            mag = sp.bins[_randint(u1, cfg.num_bins)]
            rng_uniform2(seed, epoch, index, RNG_STREAM_AUGMENT + vs, 1, &u2, &u3)
            if sp.is_signed and u2 <= 0.5:
                mag = -mag
        _push(out, sp.op, mag)
    elif cfg.mode == AUG_MODE_RA:
        for k in range(cfg.num_ops):
            rng_uniform2(seed, epoch, index, RNG_STREAM_AUGMENT + vs, 2 * k, &u0, &u1)
            sp = &cfg.space[_randint(u0, cfg.n_space)]
            mag = 0.0
            if sp.has_mag:
                if cfg.mstd > 0.0:
                    rng_uniform2(seed, epoch, index, RNG_STREAM_AUGMENT + vs, 2 * k + 1, &u2, &u3)
                    level = cfg.magnitude + cfg.mstd * _normal(u2)
                    level = 0.0 if level < 0.0 else level
                    level = <double>(cfg.num_bins - 1) if level > cfg.num_bins - 1 else level
                    mag = _level_magnitude(cfg, sp, level)
                else:
                    mag = sp.bins[cfg.magnitude]
                if sp.is_signed and u1 <= 0.5:
                    mag = -mag
            _push(out, sp.op, mag)
    elif cfg.mode == AUG_MODE_IMAGENET:
        rng_uniform2(seed, epoch, index, RNG_STREAM_AUGMENT + vs, 0, &u0, &u1)
        pol = _randint(u0, cfg.n_policies)
        for s in range(2):
            rng_uniform2(seed, epoch, index, RNG_STREAM_AUGMENT + vs, 1 + s, &u2, &u3)
            if not u2 <= cfg.pol_p[pol][s]:
                continue
            mag = cfg.pol_mag[pol][s]
            if cfg.pol_signed[pol][s] and u3 <= 0.5:
                mag = -mag
            _push(out, cfg.pol_op[pol][s], mag)
    if cfg.jitter[0] or cfg.jitter[1] or cfg.jitter[2] or cfg.jitter[3]:
        # torchvision draws a random order of the four (randperm), then each factor.
        rng_uniform2(seed, epoch, index, RNG_STREAM_JITTER + vs, 0, &u0, &u1)
        rng_uniform2(seed, epoch, index, RNG_STREAM_JITTER + vs, 1, &u2, &u3)
        perm[0], perm[1], perm[2], perm[3] = 0, 1, 2, 3
        fac[0], fac[1], fac[2] = u0, u1, u2    # Fisher-Yates: position k swaps with j <= k
        for k in range(3, 0, -1):
            j = _randint(fac[3 - k], k + 1)
            t = perm[k]
            perm[k] = perm[j]
            perm[j] = t
        rng_uniform2(seed, epoch, index, RNG_STREAM_JITTER + vs, 2, &u0, &u1)
        fac[0] = cfg.jlo[0] + (cfg.jhi[0] - cfg.jlo[0]) * u3
        fac[1] = cfg.jlo[1] + (cfg.jhi[1] - cfg.jlo[1]) * u0
        fac[2] = cfg.jlo[2] + (cfg.jhi[2] - cfg.jlo[2]) * u1
        rng_uniform2(seed, epoch, index, RNG_STREAM_JITTER + vs, 3, &u0, &u1)
        fac[3] = cfg.jlo[3] + (cfg.jhi[3] - cfg.jlo[3]) * u0
        u1 = 0.0                # RandomApply(p): block 4, drawn only when p < 1
        if cfg.jitter_p < 1.0:
            rng_uniform2(seed, epoch, index, RNG_STREAM_JITTER + vs, 4, &u1, &u2)
        for k in range(4):
            if cfg.jitter[perm[k]] and u1 < cfg.jitter_p:
                _push(out, AUG_J_BRIGHTNESS + perm[k], fac[perm[k]])
    if cfg.gray_p > 0.0:
        rng_uniform2(seed, epoch, index, RNG_STREAM_GRAYSCALE + vs, 0, &u0, &u1)
        if u0 < cfg.gray_p:
            _push(out, AUG_GRAYSCALE, 0.0)
    if cfg.blur_p > 0.0:        # GaussianBlur: sigma uniform in [lo, hi]
        rng_uniform2(seed, epoch, index, RNG_STREAM_BLUR + vs, 0, &u0, &u1)
        if u0 < cfg.blur_p:
            _push(out, AUG_BLUR, cfg.blur_sigma[0] + (cfg.blur_sigma[1] - cfg.blur_sigma[0]) * u1)
    if cfg.sol_p > 0.0:
        rng_uniform2(seed, epoch, index, RNG_STREAM_SOLARIZE + vs, 0, &u0, &u1)
        if u0 < cfg.sol_p:
            _push(out, AUG_V_SOLARIZE, cfg.sol_thr)
    if cfg.erase_p > 0.0:
        rng_uniform2(seed, epoch, index, RNG_STREAM_ERASE + vs, 0, &u0, &u1)
        if u0 < cfg.erase_p:
            area = <double>cfg.oh * cfg.ow
            for k in range(10):
                rng_uniform2(seed, epoch, index, RNG_STREAM_ERASE + vs, 1 + k, &u0, &u1)
                target = area * (cfg.erase_scale[0] + (cfg.erase_scale[1] - cfg.erase_scale[0]) * u0)
                aspect = portable_exp(cfg.erase_log_ratio[0]
                                      + (cfg.erase_log_ratio[1] - cfg.erase_log_ratio[0]) * u1)
                hf = rint(sqrt(target * aspect))
                wf = rint(sqrt(target / aspect))
                if not (hf < cfg.oh and wf < cfg.ow):
                    continue
                hh = <int>hf
                ww = <int>wf
                rng_uniform2(seed, epoch, index, RNG_STREAM_ERASE + vs, 11 + k, &u0, &u1)
                out.ebox[0] = _randint(u0, cfg.oh - hh + 1)
                out.ebox[1] = _randint(u1, cfg.ow - ww + 1)
                out.ebox[2] = hh
                out.ebox[3] = ww
                out.erase = 1
                break


# --- geometric ops: torchvision's affine grid, nearest, in float32 --------------------------

DEF AFFINE_CHUNK = 256      # pixels whose source offsets one pass of _affine computes at once
DEF ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: (x + M) - M is x rounded half to even, |x| <= 2**22


cdef void _affine(const uint8_t* src, uint8_t* dst, int h, int w, const double* m,
                  const uint8_t* fill) noexcept nogil:
    """dst = src sampled at the inverse affine map m (torchvision's _get_inverse_affine_matrix
    layout) the way v2's _affine_grid + grid_sample(nearest, zeros, align_corners=False) does:
    theta in float32 divided by half the size, base grid (x - (w-1)/2, y - (h-1)/2), then
    ((g + 1) * size / 2 - 0.5) rounded half to even; outside -> fill.

    Each row runs in two passes over AFFINE_CHUNK pixels: their source coordinates (a
    branch-free float32 loop, so it vectorizes), then the copies: runs of consecutive source
    pixels (memcpy) when the source row does not depend on x (ShearX, TranslateX/Y), else
    per-pixel gathers (Rotate, ShearY)."""
    cdef float hw = <float>(0.5 * w), hh = <float>(0.5 * h)
    cdef float r00 = <float>m[0] / hw, r10 = <float>m[1] / hw, r20 = <float>m[2] / hw
    cdef float r01 = <float>m[3] / hh, r11 = <float>m[4] / hh, r21 = <float>m[5] / hh
    cdef float sx = <float>w / <float>2.0, sy = <float>h / <float>2.0
    cdef float cw = <float>((w - 1) * 0.5)
    cdef float magic = <float>ROUND_MAGIC
    cdef float yb, cx, cy, xb, ix, iy
    cdef int32_t off[AFFINE_CHUNK]
    cdef uint8_t brk[AFFINE_CHUNK]
    cdef const uint8_t* pk
    cdef int32_t xi, yi, inside
    cdef int x, y, x0, n, j, k
    cdef const uint8_t* p
    cdef const uint8_t* srow
    cdef uint8_t* q
    # No x term from y (TranslateX/Y: r10 == 0): cx is +-0 on every row, which leaves every
    # sum it enters unchanged, so a row of one chunk has the same source columns on every row.
    cdef int same_cols = r10 == <float>0.0 and w <= AFFINE_CHUNK, have_cols = 0
    for y in range(h):
        yb = <float>(y - (h - 1) * 0.5)
        cx = yb * r10
        cy = yb * r11
        q = dst + <Py_ssize_t>y * w * 3
        if r01 == <float>0.0:
            # xb * r01 is +-0 for every x, and cy + (+-0) has cy's value: one yi per row.
            iy = ((<float>0.0 + cy) + r21 + <float>1.0) * sy - <float>0.5
            yi = <int32_t>((iy + magic) - magic)
            if <uint32_t>yi >= <uint32_t>h:
                for x in range(w):
                    q[3 * x], q[3 * x + 1], q[3 * x + 2] = fill[0], fill[1], fill[2]
                continue
            srow = src + <Py_ssize_t>yi * w * 3
            for x0 in range(0, w, AFFINE_CHUNK):
                n = w - x0 if w - x0 < AFFINE_CHUNK else AFFINE_CHUNK
                if not have_cols:
                    for j in range(n):
                        xb = <float>(x0 + j) - cw
                        ix = ((xb * r00 + cx) + r20 + <float>1.0) * sx - <float>0.5
                        off[j] = <int32_t>((ix + magic) - magic)
                    # brk[k]: pixel k cannot continue a run of consecutive in-image source
                    # pixels (a vectorized pass; the runs are then found by memchr).
                    brk[0] = 1
                    for j in range(1, n):
                        brk[j] = (off[j] != off[j - 1] + 1) | (off[j] < 0) | (off[j] >= w)
                    have_cols = same_cols
                j = 0
                while j < n:
                    xi = off[j]
                    if <uint32_t>xi >= <uint32_t>w:
                        x = 3 * (x0 + j)
                        q[x], q[x + 1], q[x + 2] = fill[0], fill[1], fill[2]
                        j += 1
                        continue
                    pk = <const uint8_t*>memchr(brk + j + 1, 1, <size_t>(n - j - 1))
                    k = n if pk == NULL else <int>(pk - brk)
                    memcpy(q + 3 * (x0 + j), srow + 3 * xi, <size_t>(3 * (k - j)))
                    j = k
            continue
        for x0 in range(0, w, AFFINE_CHUNK):
            n = w - x0 if w - x0 < AFFINE_CHUNK else AFFINE_CHUNK
            for j in range(n):
                xb = <float>(x0 + j) - cw
                ix = ((xb * r00 + cx) + r20 + <float>1.0) * sx - <float>0.5
                iy = ((xb * r01 + cy) + r21 + <float>1.0) * sy - <float>0.5
                # |ix|, |iy| stay below a few times the size (|shear| < 1, finite matrices):
                # the rounding is exact below 2**22, and anything beyond is outside anyway.
                xi = <int32_t>((ix + magic) - magic)
                yi = <int32_t>((iy + magic) - magic)
                inside = (<uint32_t>xi < <uint32_t>w) & (<uint32_t>yi < <uint32_t>h)
                off[j] = ((yi * w + xi) * 3 + 1) * inside - 1      # -1: outside
            for j in range(n):
                x = 3 * (x0 + j)
                p = src + off[j] if off[j] >= 0 else fill
                q[x], q[x + 1], q[x + 2] = p[0], p[1], p[2]


cdef void _rot90(const uint8_t* src, uint8_t* dst, int h, int w, int k) noexcept nogil:
    """torch.rot90(k) over (H, W) for k = 1, 2, 3 (k = 1, 3 need h == w)."""
    cdef int x, y, sy, sx
    cdef Py_ssize_t r = <Py_ssize_t>w * 3
    cdef const uint8_t* p
    cdef uint8_t* q
    for y in range(h):
        q = dst + y * r
        for x in range(w):
            if k == 1:
                sy, sx = x, w - 1 - y
            elif k == 2:
                sy, sx = h - 1 - y, w - 1 - x
            else:
                sy, sx = h - 1 - x, y
            p = src + sy * r + 3 * sx
            q[3 * x], q[3 * x + 1], q[3 * x + 2] = p[0], p[1], p[2]


cdef int _geometric(int op, double mag, uint8_t* img, uint8_t* tmp, int h, int w,
                    const uint8_t* fill) noexcept nogil:
    cdef double m[6]
    cdef double s, c, a, t
    m[0], m[1], m[2], m[3], m[4], m[5] = 1.0, 0.0, 0.0, 0.0, 1.0, 0.0
    if op == AUG_SHEAR_X:
        # center [0, 0]: the image centre is at (-w/2, -h/2) of the grid's frame.
        m[1] = mag
        m[2] = 0.0 - mag * (-0.5 * h)
    elif op == AUG_SHEAR_Y:
        m[3] = mag
        m[5] = ((-0.5 * h) - mag * (-0.5 * w)) - (-0.5 * h)
    elif op == AUG_TRANSLATE_X:
        m[2] = -<double><int64_t>mag          # int(magnitude): truncation toward zero
    elif op == AUG_TRANSLATE_Y:
        m[5] = -<double><int64_t>mag
    else:                                     # AUG_ROTATE: F.rotate(angle=mag)
        a = fmod(mag, 360.0)
        if a != 0.0 and a < 0.0:
            a = a + 360.0
        if a == 0.0:
            return 0
        if a == 180.0 or (h == w and (a == 90.0 or a == 270.0)):
            _rot90(img, tmp, h, w, 2 if a == 180.0 else (1 if a == 90.0 else 3))
            memcpy(img, tmp, <size_t>h * w * 3)
            return 0
        _sincos(-a * (PI / 180.0), &s, &c)
        m[0], m[1], m[3], m[4] = c, s, -s, c
    _affine(img, tmp, h, w, m, fill)
    memcpy(img, tmp, <size_t>h * w * 3)
    return 0


# --- colour ops: v2.functional's uint8 arithmetic -----------------------------------------
#
# Every op whose result is a function of the value alone (per channel) is a 256-entry map
# built with torchvision's float32 formula: Brightness, Posterize, Solarize, Invert, and (from
# the image's statistics) Contrast, AutoContrast, Equalize; _steps composes consecutive maps.
# The grayscale ops run in vector lanes (dp_gray_pass).

cdef inline uint8_t _trunc_u8(float v) noexcept nogil:
    # clamp_(0, 255) then .to(uint8): truncation toward zero.
    if not (v > <float>0.0):
        return 0
    if v >= <float>255.0:
        return 255
    return <uint8_t><int>v


cdef void _lut_apply(uint8_t* img, Py_ssize_t npix, const uint8_t* lut) noexcept nogil:
    """img[., c] = lut[256 c + img[., c]] (lut: 3 x 256)."""
    cdef const uint8_t* l1 = lut + 256
    cdef const uint8_t* l2 = lut + 512
    cdef Py_ssize_t i
    for i in range(npix):
        img[3 * i] = lut[img[3 * i]]
        img[3 * i + 1] = l1[img[3 * i + 1]]
        img[3 * i + 2] = l2[img[3 * i + 2]]


cdef void _map_same(uint8_t* lut, const uint8_t* m) noexcept nogil:
    """The 256-entry map m for all three channels."""
    memcpy(lut, m, 256)
    memcpy(lut + 256, m, 256)
    memcpy(lut + 512, m, 256)


cdef void _blend_map(uint8_t* lut, double ratio, float other) noexcept nogil:
    # _blend(img, other, ratio) with a constant other: img * r + (1 - r) * other, float32
    cdef float r = <float>ratio, a = <float>(1.0 - ratio)
    cdef float o = a * other
    cdef int v
    for v in range(256):
        lut[v] = _trunc_u8(<float>v * r + o)
    _map_same(lut, lut)


cdef void _saturation(uint8_t* img, Py_ssize_t npix, double ratio,
                      const uint8_t* lut) noexcept nogil:
    # img * r + (1 - r) * floor(gray), float32, clamped and truncated as torchvision; on
    # lut(img) when lut is not NULL.
    dp_gray_run(img, npix, <float>ratio, <float>(1.0 - ratio), DP_SATURATION, lut)


cdef float _gray_mean(const uint8_t* img, Py_ssize_t npix, const uint8_t* lut) noexcept nogil:
    # The mean of the floored grayscale (of lut(img) when lut is not NULL): integers below
    # 2**24 in total, so float32 sums of them are exact in any order and the sum here equals
    # torch's.
    return <float>dp_gray_run(<uint8_t*>img, npix, 0, 0, DP_GRAY_SUM, lut) / <float>npix


cdef void _sharpness(uint8_t* img, uint8_t* tmp, int h, int w, double factor) noexcept nogil:
    """adjust_sharpness: the 3x3 blur [[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13 rounded, blended
    with the image in float32 (v + (1 - factor) * (blur - v)), borders kept.

    torchvision sums the nine float32 products and rounds; the exact sum S / 13 is never within
    1/26 of a half-integer (13 is odd) while the float32 sum is off by under 1e-3, so the
    rounded blur is round(S / 13) = (2 S + 13) // 26 = ((2 S + 13) * 10083) >> 18 (exact for
    S <= 13 * 255): an integer pass over contiguous bytes, then the blend in float32."""
    cdef float alpha = <float>(1.0 - factor)
    cdef int y
    cdef Py_ssize_t r = <Py_ssize_t>w * 3
    cdef const uint8_t* p
    if h <= 2 or w <= 2:
        return
    for y in range(1, h - 1):
        p = img + y * r
        dp_sharpen_row(p - r, p, p + r, tmp + y * r, r, alpha)
    # The pass reads img and writes tmp (a row's blur needs the rows around it unchanged).
    for y in range(1, h - 1):
        memcpy(img + y * r + 3, tmp + y * r + 3, <size_t>(r - 6))


cdef void _posterize_map(uint8_t* lut, double mag) noexcept nogil:
    cdef int bits = <int>mag, v
    bits = 8 if bits > 8 else (bits if bits > 0 else 0)
    cdef uint8_t mask = <uint8_t>(((1 << bits) - 1) << (8 - bits))
    for v in range(256):
        lut[v] = <uint8_t>v & mask
    _map_same(lut, lut)


cdef void _solarize_lut(uint8_t* lut, float thr) noexcept nogil:
    # torch.where(img >= thr, 255 - img, img): uint8 compared with a float threshold in float32.
    cdef int v
    for v in range(256):
        lut[v] = <uint8_t>(255 - v) if <float>v >= thr else <uint8_t>v
    _map_same(lut, lut)


cdef void _brightness_map(uint8_t* lut, double factor) noexcept nogil:
    cdef float f = <float>factor
    cdef int v
    for v in range(256):
        lut[v] = _trunc_u8(<float>v * f)
    _map_same(lut, lut)


cdef void _autocontrast_map(uint8_t* lut, const uint8_t* img, Py_ssize_t npix) noexcept nogil:
    # Per-channel min and max over 48-byte blocks (16 pixels: a whole number of them, so byte
    # j of a block is channel j % 3) kept element-wise, which vectorizes, then folded.
    cdef uint8_t blo[48]
    cdef uint8_t bhi[48]
    cdef int lo[3]
    cdef int hi[3]
    cdef float mn, inv
    cdef Py_ssize_t i, n = 3 * npix, nb = n - n % 48
    cdef const uint8_t* blk
    cdef int c, v, x, j
    memset(blo, 255, 48)
    memset(bhi, 0, 48)
    for i in range(0, nb, 48):
        blk = img + i
        for j in range(48):
            blo[j] = dp_u8min(blk[j], blo[j])
            bhi[j] = dp_u8max(blk[j], bhi[j])
    for c in range(3):
        lo[c], hi[c] = 255, 0
    for j in range(48):
        lo[j % 3] = blo[j] if blo[j] < lo[j % 3] else lo[j % 3]
        hi[j % 3] = bhi[j] if bhi[j] > hi[j % 3] else hi[j % 3]
    for i in range(nb, n):
        x = img[i]
        c = <int>(i % 3)
        lo[c] = x if x < lo[c] else lo[c]
        hi[c] = x if x > hi[c] else hi[c]
    for c in range(3):
        if lo[c] == hi[c]:
            mn, inv = 0.0, 1.0
        else:
            mn = <float>lo[c]
            inv = (<float>hi[c] - <float>lo[c]) * <float>(1.0 / 255.0)
        for v in range(256):
            lut[256 * c + v] = _trunc_u8((<float>v - mn) / inv)


cdef void _equalize_map(uint8_t* lut, const uint8_t* img, Py_ssize_t npix) noexcept nogil:
    # Four banks of counts, pixel i in bank i % 4: runs of equal values (smooth images) then
    # do not make each increment wait for the one before.
    cdef uint32_t banks[4][768]
    cdef int64_t hist[768]
    cdef int64_t cum, step, last
    cdef int64_t* hc
    cdef Py_ssize_t i, n4 = npix - npix % 4
    cdef const uint8_t* px
    cdef int c, v, k
    memset(banks, 0, sizeof(banks))
    for i in range(0, n4, 4):
        for k in range(4):          # a constant count: GCC unrolls it
            px = img + 3 * (i + k)
            banks[k][px[0]] += 1
            banks[k][256 + px[1]] += 1
            banks[k][512 + px[2]] += 1
    for i in range(n4, npix):
        banks[0][img[3 * i]] += 1
        banks[0][256 + img[3 * i + 1]] += 1
        banks[0][512 + img[3 * i + 2]] += 1
    for v in range(768):
        hist[v] = <int64_t>banks[0][v] + banks[1][v] + banks[2][v] + banks[3][v]
    for c in range(3):
        hc = hist + 256 * c
        last = 0
        for v in range(256):
            if hc[v]:
                last = v
        step = (npix - hc[last]) // 255
        if step == 0:
            for v in range(256):
                lut[256 * c + v] = <uint8_t>v
            continue
        lut[256 * c] = 0
        cum = 0
        for v in range(255):
            cum += hc[v]
            lut[256 * c + v + 1] = <uint8_t>min(255, (cum + step // 2) // step)


cdef void _bitwise(uint8_t* img, Py_ssize_t n, int op, double mag) noexcept nogil:
    """Posterize (x & mask) or Invert (255 - x) on its own: a vectorized loop beats a table."""
    cdef uint8_t lut[768]
    cdef uint8_t mask
    cdef Py_ssize_t i
    if op == AUG_INVERT:
        for i in range(n):
            img[i] = 255 - img[i]
        return
    _posterize_map(lut, mag)
    mask = lut[255]
    for i in range(n):
        img[i] = img[i] & mask


cdef int _op_map(int op, double mag, const uint8_t* img, Py_ssize_t npix,
                 uint8_t* lut, const uint8_t* pending) noexcept nogil:
    """The op as a per-channel map of values (3 x 256 into lut), statistics taken from img,
    or from pending(img) when the maps pending (3 x 256, or NULL) have not been applied yet
    (only ops that _takes_pending accepts); 0 when the op is not one."""
    if op == AUG_BRIGHTNESS or op == AUG_J_BRIGHTNESS:
        _brightness_map(lut, 1.0 + mag if op == AUG_BRIGHTNESS else mag)
    elif op == AUG_CONTRAST or op == AUG_J_CONTRAST:
        _blend_map(lut, 1.0 + mag if op == AUG_CONTRAST else mag, _gray_mean(img, npix, pending))
    elif op == AUG_POSTERIZE:
        _posterize_map(lut, mag)
    elif op == AUG_SOLARIZE:
        _solarize_lut(lut, <float>(255.0 * mag))
    elif op == AUG_V_SOLARIZE:
        _solarize_lut(lut, <float>mag)
    elif op == AUG_INVERT:
        _solarize_lut(lut, <float>0.0)
    elif op == AUG_AUTOCONTRAST:
        _autocontrast_map(lut, img, npix)
    elif op == AUG_EQUALIZE:
        _equalize_map(lut, img, npix)
    else:
        return 0
    return 1


cdef inline int _takes_pending(int op) noexcept nogil:
    """Whether the op can run before the pending maps are applied: maps of values that do not
    look at the image, Contrast (its mean is taken through the maps), and the grayscale ops,
    which apply the maps as they read the pixels."""
    return op == AUG_BRIGHTNESS or op == AUG_J_BRIGHTNESS or op == AUG_POSTERIZE \
        or op == AUG_SOLARIZE or op == AUG_V_SOLARIZE or op == AUG_INVERT or op == AUG_CONTRAST \
        or op == AUG_J_CONTRAST or op == AUG_COLOR or op == AUG_J_SATURATION \
        or op == AUG_GRAYSCALE


cdef void _hue(uint8_t* img, Py_ssize_t npix, double factor) noexcept nogil:
    """v2's adjust_hue on uint8: to float32 (x / 255), HSV, hue + factor mod 1, back, then
    x * (256 - 1e-3) truncated; in vector lanes (dp_hue, _hue_lanes.h)."""
    dp_hue(img, npix, <float>(1.0 / 255.0), <float>factor, <float>(255.0 + 1.0 - 1e-3))


cdef int aug_apply_op(int op, double mag, uint8_t* img, uint8_t* tmp, int h, int w,
                      const uint8_t* fill) noexcept nogil:
    """The dispatcher: one op of the table with torchvision's magnitude (jitter: factor)."""
    cdef Py_ssize_t npix = <Py_ssize_t>h * w
    cdef uint8_t lut[768]
    if op == AUG_IDENTITY:
        return 0
    if AUG_SHEAR_X <= op <= AUG_ROTATE:
        return _geometric(op, mag, img, tmp, h, w, fill)
    if op == AUG_POSTERIZE or op == AUG_INVERT:
        _bitwise(img, 3 * npix, op, mag)
    elif _op_map(op, mag, img, npix, lut, NULL):
        _lut_apply(img, npix, lut)
    elif op == AUG_COLOR or op == AUG_J_SATURATION:
        _saturation(img, npix, 1.0 + mag if op == AUG_COLOR else mag, NULL)
    elif op == AUG_SHARPNESS:
        _sharpness(img, tmp, h, w, 1.0 + mag)
    elif op == AUG_J_HUE:
        _hue(img, npix, mag)
    elif op == AUG_GRAYSCALE:
        dp_gray_run(img, npix, 0, 0, DP_GRAYSCALE, NULL)  # gray <= 0.9999 * 255: no clamp
    else:
        return -1
    return 0


cdef int _steps(const AugConfig* cfg, const AugParams* prm, uint8_t* img, uint8_t* tmp,
                int h, int w, uint8_t* tail) noexcept nogil:
    """The steps of prm in order; runs of value maps are composed and applied in one pass, or
    by the grayscale op that follows them (Contrast takes its mean through them). With tail, a
    final run of maps is left in it (3 x 256) for the caller's conversion to absorb: returns 1
    then, 0 when nothing is left, or an op's error code."""
    cdef Py_ssize_t npix = <Py_ssize_t>h * w
    cdef uint8_t lut[768]
    cdef uint8_t m[768]
    cdef int k, v, op, rc, pending = 0, first = 0
    for k in range(prm.n + 1):
        op = prm.step[k].op if k < prm.n else AUG_IDENTITY
        if op == AUG_IDENTITY and k < prm.n:
            continue
        if pending and k == prm.n and tail != NULL:
            memcpy(tail, lut, 768)
            return 1
        if pending and (k == prm.n or not _takes_pending(op)):
            if pending == 1 and (prm.step[first].op == AUG_POSTERIZE
                                 or prm.step[first].op == AUG_INVERT):
                _bitwise(img, 3 * npix, prm.step[first].op, prm.step[first].mag)
            else:
                _lut_apply(img, npix, lut)
            pending = 0
        if k == prm.n:
            break
        if _op_map(op, prm.step[k].mag, img, npix, m, lut if pending else NULL):
            if pending:
                for v in range(768):
                    lut[v] = m[(v & ~255) + lut[v]]
            else:
                memcpy(lut, m, 768)
                first = k
            pending += 1
            continue
        if pending:                 # a grayscale op: it applies the maps as it reads
            if op == AUG_GRAYSCALE:
                dp_gray_run(img, npix, 0, 0, DP_GRAYSCALE, lut)
            else:
                _saturation(img, npix, 1.0 + prm.step[k].mag if op == AUG_COLOR
                            else prm.step[k].mag, lut)
            pending = 0
            continue
        if op == AUG_BLUR:
            rc = _blur(cfg, prm.step[k].mag, img, tmp, h, w)
        else:
            rc = aug_apply_op(op, prm.step[k].mag, img, tmp, h, w, cfg.fill)
        if rc != 0:
            return rc
    return 0


cdef inline size_t _blur_at(int h, int w) noexcept nogil:
    return (<size_t>h * w * 3 + 15) // 16 * 16     # the float part of tmp, 16-byte aligned


cdef size_t aug_tmp_bytes(const AugConfig* cfg, int h, int w) noexcept nogil:
    """Bytes of the ``tmp`` aug_apply_convert needs for an h x w image: the image's size,
    and with blur the kernel's weights and scratch rows (floats) after it."""
    if cfg.blur_p <= 0.0:
        return <size_t>h * w * 3
    return _blur_at(h, w) + (2 * <size_t>cfg.blur_k
                             + blur_scratch_floats(w, cfg.blur_k, cfg.blur_k)) * sizeof(float)


cdef int _blur(const AugConfig* cfg, double sigma, uint8_t* img, uint8_t* tmp, int h,
               int w) noexcept nogil:
    """v2's gaussian_blur(img, [k, k], [sigma, sigma]) in place, through tmp (aug_tmp_bytes)."""
    cdef int k = cfg.blur_k
    cdef float* wts = <float*>(tmp + _blur_at(h, w))
    if ops_gaussian_kernel(wts, k, sigma) != OPS_OK or blur_rgb_u8(
            img, <Py_ssize_t>w * 3, h, w, tmp, <Py_ssize_t>w * 3, wts, k, wts, k, wts + k) != 0:
        return -1
    memcpy(img, tmp, <size_t>h * w * 3)
    return 0


cdef int aug_apply_convert(const AugConfig* cfg, const AugParams* prm, uint8_t* img,
                           uint8_t* tmp, int h, int w, const OpsOutput* o,
                           void* out) noexcept nogil:
    """The steps of prm on img (in place), then the output sample from it; a final run of
    value maps is folded into the conversion's tables (one pass less; the same bits)."""
    cdef uint8_t tail[768]
    cdef int rc = _steps(cfg, prm, img, tmp, h, w, tail)
    if rc < 0:
        return rc
    _convert(img, h, w, o, out, tail if rc == 1 else NULL)
    return 0


# --- output conversion and erasing ----------------------------------------------------------

cdef void _convert(const uint8_t* img, int h, int w, const OpsOutput* o, void* out,
                   const uint8_t* maps) noexcept nogil:
    """One output sample from the uint8 image, through maps[256 c + value] (3 x 256, or NULL):
    value * scale + bias per channel in float32 (ops_run's formula), as o.dtype in o.layout,
    by a 3 x 256 table of the converted values (float32 without maps: in vector lanes)."""
    cdef Py_ssize_t npix = <Py_ssize_t>h * w, i
    cdef Py_ssize_t cs = npix if o.layout == OPS_CHW else 1     # channel and pixel strides
    cdef Py_ssize_t ps = 1 if o.layout == OPS_CHW else 3
    cdef int c, v
    cdef float lf[768]
    cdef uint16_t lh[768]
    cdef float* f32 = <float*>out
    cdef uint16_t* u16 = <uint16_t*>out
    cdef uint8_t* u8 = <uint8_t*>out
    if o.dtype == OPS_UINT8 and maps != NULL:
        for i in range(npix):
            u8[i * ps] = maps[img[3 * i]]
            u8[cs + i * ps] = maps[256 + img[3 * i + 1]]
            u8[2 * cs + i * ps] = maps[512 + img[3 * i + 2]]
        return
    if o.dtype == OPS_UINT8:
        if o.layout == OPS_CHW:
            for i in range(npix):
                u8[i] = img[3 * i]
                u8[npix + i] = img[3 * i + 1]
                u8[2 * npix + i] = img[3 * i + 2]
        else:
            memcpy(u8, img, <size_t>npix * 3)
        return
    if o.dtype == OPS_FLOAT32 and maps == NULL:     # arithmetic in lanes: the table's bits
        dp_convert_f32(img, npix, o.scale, o.bias, f32, o.layout == OPS_CHW)
        return
    for c in range(3):
        for v in range(256):
            lf[256 * c + v] = <float>(maps[256 * c + v] if maps != NULL else v) * o.scale[c] \
                + o.bias[c]
    if o.dtype == OPS_FLOAT32:
        dp_convert_lut_f32(img, npix, lf, f32, o.layout == OPS_CHW)
        return
    for v in range(768):
        lh[v] = _to_f16(lf[v]) if o.dtype == OPS_FLOAT16 else _to_bf16(lf[v])
    for i in range(npix):
        u16[i * ps] = lh[img[3 * i]]
        u16[cs + i * ps] = lh[256 + img[3 * i + 1]]
        u16[2 * cs + i * ps] = lh[512 + img[3 * i + 2]]


cdef inline void _erase_put(const OpsOutput* o, void* out, Py_ssize_t at, float v) noexcept nogil:
    cdef int32_t vi
    if o.dtype == OPS_FLOAT32:
        (<float*>out)[at] = v
    elif o.dtype == OPS_FLOAT16:
        (<uint16_t*>out)[at] = _to_f16(v)
    elif o.dtype == OPS_BFLOAT16:
        (<uint16_t*>out)[at] = _to_bf16(v)
    else:
        vi = <int32_t>rint(v)
        (<uint8_t*>out)[at] = <uint8_t>(0 if vi < 0 else (255 if vi > 255 else vi))


cdef void aug_erase(const AugConfig* cfg, const AugParams* prm, int h, int w,
                    const OpsOutput* o, void* out) noexcept nogil:
    """RandomErasing after normalize: the box of prm set to cfg.erase_value (output units), or
    with erase_random to standard normal values (torchvision's value="random": one per
    element of the (3, bh, bw) box, in that order). Element k's value is the Acklam quantile
    of word k % 4 of block (k // 4) % 2**16 of stream RNG_STREAM_ERASE_NOISE + k // 2**18 —
    float64 arithmetic from + - * / sqrt and portable_log, the same on every machine."""
    cdef int y, x, c, bh = prm.ebox[2], bw = prm.ebox[3]
    cdef Py_ssize_t at, npix = <Py_ssize_t>h * w, k = 0
    cdef uint32_t words[4]
    cdef float v
    cdef float* row
    if not prm.erase:
        return
    if not cfg.erase_random and o.dtype == OPS_FLOAT32 and o.layout == OPS_CHW:
        # The common case as plain row fills.
        for c in range(3):
            v = cfg.erase_value[c]
            for y in range(prm.ebox[0], prm.ebox[0] + bh):
                row = <float*>out + c * npix + <Py_ssize_t>y * w + prm.ebox[1]
                for x in range(bw):
                    row[x] = v
        return
    for c in range(3):
        v = cfg.erase_value[c]
        for y in range(prm.ebox[0], prm.ebox[0] + bh):
            at = c * npix + <Py_ssize_t>y * w + prm.ebox[1] if o.layout == OPS_CHW \
                else (<Py_ssize_t>y * w + prm.ebox[1]) * 3 + c
            for x in range(bw):
                if cfg.erase_random:
                    if k % 4 == 0:
                        rng_block(prm.seed, prm.epoch, prm.index,
                                  RNG_STREAM_ERASE_NOISE + <uint32_t>(k >> 18),
                                  <uint32_t>((k >> 2) & 0xFFFF), words)
                    # (word + 1/2) / 2**32: in (0, 1), exact
                    v = <float>_normal((<double>words[k % 4] + 0.5) * 2.3283064365386963e-10)
                    k += 1
                _erase_put(o, out, at, v)
                at += 1 if o.layout == OPS_CHW else 3


# --- configuration from dpu_pipe/augment.py's spec ------------------------------------------

cdef int aug_config_from(AugConfig* cfg, dict spec) except -1:
    cdef int k, s, b
    memset(cfg, 0, sizeof(AugConfig))
    cfg.mode = spec["mode"]
    cfg.oh, cfg.ow = spec["size"]
    space = spec["space"]
    if len(space) > AUG_MAX_SPACE or spec["num_bins"] > AUG_MAX_BINS:
        raise ConfigError("augmentation space too large for the kernel")
    cfg.n_space = len(space)
    for k, (name, signed, kind, start, end, bins) in enumerate(space):
        cfg.space[k].op = OP_CODES[name]
        cfg.space[k].is_signed = signed
        cfg.space[k].kind = kind
        cfg.space[k].has_mag = kind != 2
        cfg.space[k].start = start
        cfg.space[k].end = end
        for b, v in enumerate(bins):
            cfg.space[k].bins[b] = v
    cfg.num_bins = spec["num_bins"]
    cfg.num_ops = spec["num_ops"]
    cfg.magnitude = spec["magnitude"]
    cfg.mstd = spec["mstd"]
    cfg.posterize_div = spec["posterize_div"]
    policies = spec["policies"]
    if len(policies) > AUG_MAX_POLICIES or cfg.num_ops > AUG_MAX_RA_OPS:
        raise ConfigError("too many sub-policies or RandAugment ops for the kernel")
    cfg.n_policies = len(policies)
    for k, pol in enumerate(policies):
        for s, (name, p, mag, signed) in enumerate(pol):
            cfg.pol_op[k][s] = OP_CODES[name]
            cfg.pol_p[k][s] = p
            cfg.pol_mag[k][s] = mag
            cfg.pol_signed[k][s] = signed
    for k in range(3):
        cfg.fill[k] = spec["fill"][k]
        cfg.erase_value[k] = spec["erase_value"][k]
    cfg.erase_random = spec["erase_random"]
    for k in range(4):
        cfg.jitter[k] = spec["jitter"][k] is not None
        if cfg.jitter[k]:
            cfg.jlo[k], cfg.jhi[k] = spec["jitter"][k]
    cfg.gray_p = spec["grayscale_p"]
    cfg.jitter_p = spec.get("jitter_p", 1.0)
    cfg.blur_p = spec.get("blur_p", 0.0)
    cfg.blur_sigma[0], cfg.blur_sigma[1] = spec.get("blur_sigma", (0.1, 2.0))
    cfg.blur_k = spec.get("blur_kernel", 1)
    cfg.sol_p = spec.get("solarize_p", 0.0)
    cfg.sol_thr = spec.get("solarize_threshold", 128.0)
    cfg.vstream = spec.get("vstream", 0)
    cfg.erase_p = spec["erase_p"]
    cfg.erase_scale[0], cfg.erase_scale[1] = spec["erase_scale"]
    cfg.erase_log_ratio[0] = portable_log(spec["erase_ratio"][0])
    cfg.erase_log_ratio[1] = portable_log(spec["erase_ratio"][1])
    return 0


# --- Python face: describe() and the tests ---------------------------------------------------

cdef class Augmenter:
    """The augmentation of one transform (the parameters from dpu_pipe.augment.kernel_params): the
    parameters a sample gets and the ops applied to a uint8 image, as the batch kernel does."""
    cdef AugConfig cfg

    def __cinit__(self, dict spec):
        aug_config_from(&self.cfg, spec)

    def params(self, uint64_t seed, uint32_t epoch, uint64_t index):
        """{"ops": [[name, magnitude], ...], "jitter": {name: factor} in the order applied,
        "grayscale": bool, "erase": [i, j, h, w] or None, "blur": {"sigma", "kernel"} or
        None, "solarize": threshold or None} of sample ``index``."""
        cdef AugParams p
        aug_sample(&self.cfg, seed, epoch, index, &p)
        ops, jitter, gray, blur, sol = [], {}, False, None, None
        for k in range(p.n):
            op = p.step[k].op
            name = OP_NAMES[op]
            if op == AUG_GRAYSCALE:
                gray = True
            elif op == AUG_BLUR:
                blur = {"sigma": p.step[k].mag, "kernel": self.cfg.blur_k}
            elif op == AUG_V_SOLARIZE:
                sol = p.step[k].mag
            elif op >= AUG_J_BRIGHTNESS:
                jitter[name] = p.step[k].mag
            else:
                ops.append([name, p.step[k].mag])
        erase = [p.ebox[0], p.ebox[1], p.ebox[2], p.ebox[3]] if p.erase else None
        return {"ops": ops, "jitter": jitter, "grayscale": gray, "erase": erase,
                "blur": blur, "solarize": sol}

    def apply_op(self, uint8_t[:, :, ::1] img, name, double magnitude):
        """Apply op ``name`` (an OP_NAMES entry) with ``magnitude`` to img (h, w, 3) in place,
        with this transform's fill."""
        if name not in OP_CODES:
            raise ConfigError(f"unknown op {name!r}; ops: {', '.join(OP_NAMES)}")
        if img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
            raise ConfigError("img must be a non-empty (h, w, 3) uint8 array")
        cdef int h = <int>img.shape[0], w = <int>img.shape[1], op = OP_CODES[name], rc
        tmp = np.empty((h, w, 3), np.uint8)
        cdef uint8_t[:, :, ::1] t = tmp
        with nogil:
            rc = aug_apply_op(op, magnitude, &img[0, 0, 0], &t[0, 0, 0], h, w, self.cfg.fill)
        if rc != 0:
            raise ConfigError(f"op {name!r} failed (code {rc})")


def solarize(uint8_t[::1] values, double threshold):
    """v2's solarize on uint8 values, in place: every value >= threshold (compared in float32)
    becomes 255 - value."""
    cdef uint8_t lut[768]
    cdef Py_ssize_t i
    _solarize_lut(lut, <float>threshold)
    with nogil:
        for i in range(values.shape[0]):
            values[i] = lut[values[i]]
