/* Separable Gaussian blur of a uint8 interleaved RGB image (torchvision v2's gaussian_blur on
 * uint8: float32 convolution over a reflect-padded image, rounded half to even), included by
 * _ops.pyx and _augment.pyx; plain C over raw pointers so that a batch kernel can run it per
 * view, and so that each pass can be compiled for AVX2 beside the SSE2 baseline (_clones.h).
 *
 * Per output row y: the vertical pass sums the 1-D kernel's source rows (reflected at the
 * image's edges; each converted to float32 once, into a ring of ky rows) into a float32 row,
 * the row is reflect-padded by kx/2 pixels at both ends, the horizontal pass sums it over
 * interleaved RGB (tap t of element i is element i + 3t), and the sums are rounded to uint8;
 * both passes are one function over a list of row pointers (blur_sum_row). Outer taps whose
 * weights are negligible are left out (blur_cut).
 * Every pass runs over contiguous memory, which GCC vectorizes across elements on SSE2, AVX2
 * and NEON alike.
 *
 * The kernel is symmetric (k[t] == k[K-1-t]), so each pass adds the two source values of a
 * pair of taps before one multiply. Every output element is the same float32 expression,
 * centre tap first, then the pairs from the inside out: every build gives the same bits. */
#ifndef DP_BLUR_H
#define DP_BLUR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#include "_clones.h"

typedef float blur_v4f __attribute__((vector_size(16)));
typedef int32_t blur_v4i __attribute__((vector_size(16)));

/* Index i in [-(n - 1), 2 (n - 1)] mirrored into [0, n) without repeating the edge pixel
   (torch.nn.functional.pad's "reflect"). */
static inline ptrdiff_t blur_reflect(ptrdiff_t i, ptrdiff_t n) {
    return i < 0 ? -i : (i >= n ? 2 * (n - 1) - i : i);
}

/* A source row converted once to float32 (exact), into the ring of rows the vertical pass reads:
   each row is read by up to K output rows, and converting it per use cost more than the sums. */
DP_CLONES static void blur_u8_to_f32(const uint8_t *src, float *dst, ptrdiff_t n) {
    const uint8_t *__restrict__ s = src;
    float *__restrict__ d = dst;
    for (ptrdiff_t i = 0; i < n; i++)
        d[i] = (float)s[i];
}

/* One output row of either pass: d[i] = k[r] row[r][i] + sum over t = r-1 down to 0 of
   k[t] (row[t][i] + row[K-1-t][i]), r = K / 2. The vertical pass gives the ring slots of the
   reflected source rows (integer values: each pair's sum is exact), the horizontal pass the
   padded row at offsets of 3 t floats. */
DP_CLONES static void blur_sum_row(const float *const *row, const float *k, int K, float *dst,
                                   ptrdiff_t n) {
    const int r = K / 2;
    float *__restrict__ d = dst;
    const float *__restrict__ c = row[r];
    const float wc = k[r];
    int t = r - 1;
    if (t >= 1) {
        const float *__restrict__ a0 = row[t], *__restrict__ b0 = row[K - 1 - t];
        const float *__restrict__ a1 = row[t - 1], *__restrict__ b1 = row[K - t];
        const float w0 = k[t], w1 = k[t - 1];
        for (ptrdiff_t i = 0; i < n; i++)
            d[i] = (wc * c[i] + w0 * (a0[i] + b0[i])) + w1 * (a1[i] + b1[i]);
        t -= 2;
    } else if (t == 0) {
        const float *__restrict__ a0 = row[0], *__restrict__ b0 = row[K - 1];
        const float w0 = k[0];
        for (ptrdiff_t i = 0; i < n; i++)
            d[i] = wc * c[i] + w0 * (a0[i] + b0[i]);
        t = -1;
    } else {
        for (ptrdiff_t i = 0; i < n; i++)
            d[i] = wc * c[i];
    }
    for (; t >= 1; t -= 2) {
        const float *__restrict__ a0 = row[t], *__restrict__ b0 = row[K - 1 - t];
        const float *__restrict__ a1 = row[t - 1], *__restrict__ b1 = row[K - t];
        const float w0 = k[t], w1 = k[t - 1];
        for (ptrdiff_t i = 0; i < n; i++)
            d[i] = (d[i] + w0 * (a0[i] + b0[i])) + w1 * (a1[i] + b1[i]);
    }
    if (t == 0) {
        const float *__restrict__ a0 = row[0], *__restrict__ b0 = row[K - 1];
        const float w0 = k[0];
        for (ptrdiff_t i = 0; i < n; i++)
            d[i] = d[i] + w0 * (a0[i] + b0[i]);
    }
}

/* Round half to even (torch's round_), for 0 <= x < 2**22: adding 1.5 * 2**23 leaves the
   rounded integer in the low mantissa bits, by the IEEE adder in its default mode on every
   target. Sums of non-negative values with weights summing to 1 stay in 0..255 (plus a few
   float32 ulp); the saturating narrowing clamps anyway. */
#define BLUR_MAGIC 12582912.0f
#define BLUR_MAGIC_BITS 0x4B400000

static inline uint8_t blur_to_u8(float x) {
    float m = x + BLUR_MAGIC;
    int32_t i;
    memcpy(&i, &m, sizeof i);
    i -= BLUR_MAGIC_BITS;
    return (uint8_t)(i < 0 ? 0 : (i > 255 ? 255 : i));
}

static inline blur_v4i blur_round4(const float *p) {
    blur_v4f v;
    memcpy(&v, p, sizeof v);
    v = v + BLUR_MAGIC;
    return (blur_v4i)v - BLUR_MAGIC_BITS;
}

DP_CLONES static void blur_round_row(const float *a, uint8_t *o, ptrdiff_t n) {
    ptrdiff_t i = 0;
#if defined(__SSE2__) || defined(__ARM_NEON)
    for (; i + 16 <= n; i += 16) {
        blur_v4i x0 = blur_round4(a + i), x1 = blur_round4(a + i + 4);
        blur_v4i x2 = blur_round4(a + i + 8), x3 = blur_round4(a + i + 12);
#if defined(__SSE2__)
        _mm_storeu_si128((__m128i *)(o + i),
                         _mm_packus_epi16(_mm_packs_epi32((__m128i)x0, (__m128i)x1),
                                          _mm_packs_epi32((__m128i)x2, (__m128i)x3)));
#else
        uint16x8_t lo = vcombine_u16(vqmovun_s32((int32x4_t)x0), vqmovun_s32((int32x4_t)x1));
        uint16x8_t hi = vcombine_u16(vqmovun_s32((int32x4_t)x2), vqmovun_s32((int32x4_t)x3));
        vst1q_u8(o + i, vcombine_u8(vqmovn_u16(lo), vqmovn_u16(hi)));
#endif
    }
#endif
    for (; i < n; i++)
        o[i] = blur_to_u8(a[i]);
}

/* How many outer taps at each end of the K weights k the passes leave out: the most whose
   weights sum (per end) to at most 2**-24. SimCLR's and DINO's sigmas (0.1 to 2) put most of a
   23-tap kernel's weight within 5.5 sigma, so a blur costs about half; what is left out moves
   a sum by at most 2 * 255 * 2**-24 (3e-5 of a level) a pass, below the float32 rounding of the
   sums themselves. A function of the float32 weights alone: the same on every target. */
static inline int blur_cut(const float *k, int K) {
    double tail = 0.0;
    int c = 0;
    while (c < K / 2 && tail + k[c] <= 0x1p-24) {
        tail += k[c];
        c++;
    }
    return c;
}

/* Floats between ring rows: 3 w rounded up to 64 bytes. */
static inline ptrdiff_t blur_ring_stride(ptrdiff_t w) { return (3 * w + 15) & ~(ptrdiff_t)15; }

/* Floats of scratch blur_rgb_u8 needs for an image w pixels wide and a kernel of kx x ky taps:
   a ring of ky float32 source rows, one padded row and one row of sums. */
static inline size_t blur_scratch_floats(ptrdiff_t w, int kx, int ky) {
    return (size_t)ky * (size_t)blur_ring_stride(w) + (size_t)3 * (size_t)(2 * w + 2 * (kx / 2));
}

/* Blur the h x w RGB image at src (rows src_stride bytes apart, pixels 3 bytes) into dst (rows
   dst_stride bytes apart), kx horizontal taps wx and ky vertical taps wy (odd counts,
   symmetric weights), with blur_scratch_floats(w, kx, ky) floats at scratch. dst must not overlap
   src. 0, or -1 when a size is out of range (even or non-positive tap count, or a kernel
   half-width not below the image's size along its axis: reflection needs pad < size). */
static int blur_rgb_u8(const uint8_t *src, ptrdiff_t src_stride, int h, int w, uint8_t *dst,
                       ptrdiff_t dst_stride, const float *wx, int kx, const float *wy, int ky,
                       float *scratch) {
    if (h < 1 || w < 1 || kx < 1 || ky < 1 || (kx & 1) == 0 || (ky & 1) == 0
        || kx / 2 >= w || ky / 2 >= h)
        return -1;
    const int rx = kx / 2, ry = ky / 2, cx = blur_cut(wx, kx), cy = blur_cut(wy, ky);
    const ptrdiff_t n = (ptrdiff_t)3 * w, rs = blur_ring_stride(w);
    float *ring = scratch, *pad = ring + (ptrdiff_t)ky * rs;
    float *sums = pad + 3 * ((ptrdiff_t)w + 2 * rx), *row = pad + 3 * rx;
    const float *vrow[ky], *hrow[kx];
    for (int t = cx; t < kx - cx; t++)
        hrow[t - cx] = pad + 3 * t;
    /* Output row y reads source rows max(0, y - ry) .. min(h - 1, y + ry) only (reflection
       stays inside that span), at most ky consecutive rows: distinct ring slots. */
    ptrdiff_t next = 0;
    for (ptrdiff_t y = 0; y < h; y++) {
        for (; next < h && next <= y + ry; next++)
            blur_u8_to_f32(src + next * src_stride, ring + (next % ky) * rs, n);
        for (int t = cy; t < ky - cy; t++)
            vrow[t - cy] = ring + (blur_reflect(y - ry + t, h) % ky) * rs;
        blur_sum_row(vrow, wy + cy, ky - 2 * cy, row, n);
        for (int j = 1; j <= rx; j++) {
            memcpy(row - 3 * j, row + 3 * j, 3 * sizeof(float));
            memcpy(row + 3 * (w - 1 + j), row + 3 * (w - 1 - j), 3 * sizeof(float));
        }
        blur_sum_row(hrow, wx + cx, kx - 2 * cx, sums, n);
        blur_round_row(sums, dst + y * dst_stride, n);
    }
    return 0;
}

#endif
