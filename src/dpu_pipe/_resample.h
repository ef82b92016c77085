/* The inner loops of the resampling kernel (_ops.pyx): the horizontal pass, the vertical pass
 * from uint8 source rows, and the rounding to uint8, in C so that each can be compiled for AVX2
 * beside the baseline (_clones.h). Each output element is the scalar formula in float32, taps
 * ascending; SIMD runs across output elements only (the horizontal pass keeps one RGB pixel in
 * a vector's four lanes, the fourth spare), so every copy gives the same bits. */
#ifndef DP_RESAMPLE_H
#define DP_RESAMPLE_H

#if !defined(__GNUC__)
#error "dpu_pipe._ops needs GCC or Clang vector extensions"
#endif
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#include "_clones.h"

#define OPS_INLINE static inline __attribute__((always_inline))

typedef float ops_v4f __attribute__((vector_size(16)));
typedef int32_t ops_v4i __attribute__((vector_size(16)));
#define OPS_SHUF(a, b, i0, i1, i2, i3) __builtin_shufflevector(a, b, i0, i1, i2, i3)

typedef float *__restrict__ ops_f32_rp;
typedef const float *__restrict__ ops_cf32_rp;
typedef const unsigned char *__restrict__ ops_cu8_rp;
typedef unsigned short *__restrict__ ops_u16_rp;

OPS_INLINE ops_v4f ops_v4f_load(const float *p) {
    ops_v4f v;
    memcpy(&v, p, sizeof v);
    return v;
}
OPS_INLINE void ops_v4f_store(float *p, ops_v4f v) { memcpy(p, &v, sizeof v); }
static inline ops_v4f ops_v4f_set1(float x) { return (ops_v4f){x, x, x, x}; }

/* Four RGBx pixels -> four R, four G, four B stored at r, g, b (a 4x4 transpose without the
   spare row); with aff, each plane then mapped to x * s + b (the float32 output conversion:
   two roundings, as in _fin_f32). aff: s_R, s_G, s_B, b_R, b_G, b_B, each in four lanes. */
OPS_INLINE void ops_store_planar(ops_v4f p0, ops_v4f p1, ops_v4f p2, ops_v4f p3,
                                 float *r, float *g, float *b, const ops_v4f *aff) {
    ops_v4f lo01 = OPS_SHUF(p0, p1, 0, 4, 1, 5);   /* R0 R1 G0 G1 */
    ops_v4f lo23 = OPS_SHUF(p2, p3, 0, 4, 1, 5);   /* R2 R3 G2 G3 */
    ops_v4f hi01 = OPS_SHUF(p0, p1, 2, 6, 3, 7);   /* B0 B1 x  x  */
    ops_v4f hi23 = OPS_SHUF(p2, p3, 2, 6, 3, 7);   /* B2 B3 x  x  */
    ops_v4f R = OPS_SHUF(lo01, lo23, 0, 1, 4, 5);
    ops_v4f G = OPS_SHUF(lo01, lo23, 2, 3, 6, 7);
    ops_v4f B = OPS_SHUF(hi01, hi23, 0, 1, 4, 5);
    if (aff) {
        R = R * aff[0] + aff[3];
        G = G * aff[1] + aff[4];
        B = B * aff[2] + aff[5];
    }
    ops_v4f_store(r, R);
    ops_v4f_store(g, G);
    ops_v4f_store(b, B);
}

/* The horizontal weight table (OpsPlan.hw4): weight t of output pixel i four times over, at
   float offset OPS_HW4_AT(i, t, K). Pixels pair up (2m, 2m + 1), and tap t of a pair is 8
   consecutive floats, pixel 2m first: with 8-lane vectors one load gives both. */
#define OPS_HW4_AT(i, t, K) ((((i) >> 1) * (K) + (t)) * 8 + ((i) & 1) * 4)

/* Output pixels j..j+3: the weights of each pair (k01, k23) and each pixel's first source
   value (q0..q3). */
#define OPS_H_GROUP()                                                                          \
    const float *k01 = w4 + OPS_HW4_AT(j, 0, K), *k23 = w4 + OPS_HW4_AT(j + 2, 0, K);          \
    const float *q0 = buf + 3 * (start[j] - lo), *q1 = buf + 3 * (start[j + 1] - lo);          \
    const float *q2 = buf + 3 * (start[j + 2] - lo), *q3 = buf + 3 * (start[j + 3] - lo);

#define OPS_H_STORE()                                                                          \
    if (planar) {                                                                              \
        ops_store_planar(a0, a1, a2, a3, dst + j, dst + plane + j, dst + 2 * plane + j, aff);  \
    } else { /* In order: each store's spare lane is overwritten by the next pixel. */         \
        ops_v4f_store(dst + 3 * j, a0);                                                        \
        ops_v4f_store(dst + 3 * j + 3, a1);                                                    \
        ops_v4f_store(dst + 3 * j + 6, a2);                                                    \
        ops_v4f_store(dst + 3 * j + 9, a3);                                                    \
    }

/* Horizontal pass over n_pad output pixels (a multiple of 4): pixel j is
   sum(weight(j, t) * buf[3 (start[j] - lo + t) + c] for t < K), four pixels per step (four
   independent sums keep the adder busy). Every output takes exactly K taps (zero-padded): a
   loop count that never changes is predicted perfectly, and a constant K unrolls it. A zero
   tap adds +0.0 to a non-negative sum, which changes no bit. Planar: R, G, B planes `plane`
   floats apart (each mapped by aff when not NULL); else interleaved RGB, one spare float
   after the last pixel. */
OPS_INLINE void ops_h_pixels_k(const float *buf, const int32_t *start, const float *w4,
                               Py_ssize_t n_pad, Py_ssize_t lo, Py_ssize_t K, float *dst,
                               Py_ssize_t plane, int planar, const ops_v4f *aff) {
    for (Py_ssize_t j = 0; j < n_pad; j += 4) {
        OPS_H_GROUP()
        ops_v4f a0 = ops_v4f_load(q0) * ops_v4f_load(k01);
        ops_v4f a1 = ops_v4f_load(q1) * ops_v4f_load(k01 + 4);
        ops_v4f a2 = ops_v4f_load(q2) * ops_v4f_load(k23);
        ops_v4f a3 = ops_v4f_load(q3) * ops_v4f_load(k23 + 4);
        for (Py_ssize_t t = 1; t < K; t++) {
            a0 = a0 + ops_v4f_load(q0 + 3 * t) * ops_v4f_load(k01 + 8 * t);
            a1 = a1 + ops_v4f_load(q1 + 3 * t) * ops_v4f_load(k01 + 8 * t + 4);
            a2 = a2 + ops_v4f_load(q2 + 3 * t) * ops_v4f_load(k23 + 8 * t);
            a3 = a3 + ops_v4f_load(q3 + 3 * t) * ops_v4f_load(k23 + 8 * t + 4);
        }
        OPS_H_STORE()
    }
}

/* ops_h_pixels_k with K a constant for the common tap counts (bilinear up to 5 after the DCT
   scaling, bicubic up to 9); `pix` names the version. */
#define OPS_H_BY_K(pix, planar, aff)                                                           \
    switch (K) {                                                                               \
    case 2: pix(buf, start, w4, n_pad, lo, 2, dst, plane, planar, aff); break;                 \
    case 3: pix(buf, start, w4, n_pad, lo, 3, dst, plane, planar, aff); break;                 \
    case 4: pix(buf, start, w4, n_pad, lo, 4, dst, plane, planar, aff); break;                 \
    case 5: pix(buf, start, w4, n_pad, lo, 5, dst, plane, planar, aff); break;                 \
    case 6: pix(buf, start, w4, n_pad, lo, 6, dst, plane, planar, aff); break;                 \
    case 7: pix(buf, start, w4, n_pad, lo, 7, dst, plane, planar, aff); break;                 \
    case 8: pix(buf, start, w4, n_pad, lo, 8, dst, plane, planar, aff); break;                 \
    case 9: pix(buf, start, w4, n_pad, lo, 9, dst, plane, planar, aff); break;                 \
    case 10: pix(buf, start, w4, n_pad, lo, 10, dst, plane, planar, aff); break;               \
    default: pix(buf, start, w4, n_pad, lo, K, dst, plane, planar, aff);                       \
    }

/* The three entry points of one version of the pass: interleaved, planar, planar with the
   float32 conversion (affine: 6 floats s_R, s_G, s_B, b_R, b_G, b_B). */
#define OPS_H_ENTRIES(suffix, attr, pix)                                                       \
    attr static void ops_h_interleaved##suffix(const float *buf, const int32_t *start,         \
            const float *w4, Py_ssize_t n_pad, Py_ssize_t lo, Py_ssize_t K, float *dst) {      \
        const Py_ssize_t plane = 0;                                                            \
        OPS_H_BY_K(pix, 0, (const ops_v4f *)0)                                                 \
    }                                                                                          \
    attr static void ops_h_planar##suffix(const float *buf, const int32_t *start,              \
            const float *w4, Py_ssize_t n_pad, Py_ssize_t lo, Py_ssize_t K, float *dst,        \
            Py_ssize_t plane) {                                                                \
        OPS_H_BY_K(pix, 1, (const ops_v4f *)0)                                                 \
    }                                                                                          \
    attr static void ops_h_planar_affine##suffix(const float *buf, const int32_t *start,       \
            const float *w4, Py_ssize_t n_pad, Py_ssize_t lo, Py_ssize_t K, float *dst,        \
            Py_ssize_t plane, const float *affine) {                                           \
        ops_v4f aff[6];                                                                        \
        for (int i = 0; i < 6; i++)                                                            \
            aff[i] = ops_v4f_set1(affine[i]);                                                  \
        OPS_H_BY_K(pix, 1, aff)                                                                \
    }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
/* On AVX2 a pair of output pixels shares one 8-lane vector: its two source spans are loaded
   into the halves, tap t's weights of both (8 consecutive floats, OPS_HW4_AT) are one load,
   and each lane does exactly the 4-lane version's operations. (Only here: on 16-byte targets
   GCC splits 8-lane vectors poorly, so they keep ops_h_pixels_k.) */
typedef float ops_v8f __attribute__((vector_size(32)));

__attribute__((target("avx2")))
OPS_INLINE void ops_h_pixels_k8(const float *buf, const int32_t *start, const float *w4,
                                Py_ssize_t n_pad, Py_ssize_t lo, Py_ssize_t K, float *dst,
                                Py_ssize_t plane, int planar, const ops_v4f *aff) {
    for (Py_ssize_t j = 0; j < n_pad; j += 4) {
        OPS_H_GROUP()
        ops_v8f w, a01, a23;
/* The second half straight from memory (vinsertf128 m128): GCC does not fold the load of a
   generic shuffle. */
#define OPS_CAT(p, q) ((ops_v8f)_mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p)), \
                                                      _mm_loadu_ps(q), 1))
        memcpy(&w, k01, sizeof w);
        a01 = OPS_CAT(q0, q1) * w;
        memcpy(&w, k23, sizeof w);
        a23 = OPS_CAT(q2, q3) * w;
        for (Py_ssize_t t = 1; t < K; t++) {
            memcpy(&w, k01 + 8 * t, sizeof w);
            a01 = a01 + OPS_CAT(q0 + 3 * t, q1 + 3 * t) * w;
            memcpy(&w, k23 + 8 * t, sizeof w);
            a23 = a23 + OPS_CAT(q2 + 3 * t, q3 + 3 * t) * w;
        }
#undef OPS_CAT
        ops_v4f a0 = __builtin_shufflevector(a01, a01, 0, 1, 2, 3);
        ops_v4f a1 = __builtin_shufflevector(a01, a01, 4, 5, 6, 7);
        ops_v4f a2 = __builtin_shufflevector(a23, a23, 0, 1, 2, 3);
        ops_v4f a3 = __builtin_shufflevector(a23, a23, 4, 5, 6, 7);
        OPS_H_STORE()
    }
}

OPS_H_ENTRIES(_base, , ops_h_pixels_k)
OPS_H_ENTRIES(_avx2, __attribute__((target("avx2"))), ops_h_pixels_k8)

/* Which version runs: a load and a test of libgcc's CPU model (filled when it loads). */
#define OPS_PICK(f) (__builtin_cpu_supports("avx2") ? f##_avx2 : f##_base)
#define ops_h_interleaved OPS_PICK(ops_h_interleaved)
#define ops_h_planar OPS_PICK(ops_h_planar)
#define ops_h_planar_affine OPS_PICK(ops_h_planar_affine)
#else
OPS_H_ENTRIES(, , ops_h_pixels_k)
#endif

/* Vertical pass straight from uint8 source rows (pass order OPS_V_FIRST): d[0:n] =
   sum(k[t] * s[t * stride + 0:n] for t < taps), t ascending, four taps per sweep over d.
   uint8 -> float32 is exact; GCC vectorizes each sweep across i. */
DP_CLONES static void ops_v_row_u8(const uint8_t *s, Py_ssize_t stride, const float *k,
                                   Py_ssize_t taps, float *dst, Py_ssize_t n) {
    ops_f32_rp d = dst;
    Py_ssize_t t = taps < 4 ? taps : 4;
    if (t == 1) {
        ops_cu8_rp r0 = s;
        const float w0 = k[0];
        for (Py_ssize_t i = 0; i < n; i++)
            d[i] = w0 * r0[i];
    } else if (t == 2) {
        ops_cu8_rp r0 = s, r1 = s + stride;
        const float w0 = k[0], w1 = k[1];
        for (Py_ssize_t i = 0; i < n; i++)
            d[i] = w0 * r0[i] + w1 * r1[i];
    } else if (t == 3) {
        ops_cu8_rp r0 = s, r1 = s + stride, r2 = s + 2 * stride;
        const float w0 = k[0], w1 = k[1], w2 = k[2];
        for (Py_ssize_t i = 0; i < n; i++)
            d[i] = (w0 * r0[i] + w1 * r1[i]) + w2 * r2[i];
    } else {
        ops_cu8_rp r0 = s, r1 = s + stride, r2 = s + 2 * stride, r3 = s + 3 * stride;
        const float w0 = k[0], w1 = k[1], w2 = k[2], w3 = k[3];
        for (Py_ssize_t i = 0; i < n; i++)
            d[i] = ((w0 * r0[i] + w1 * r1[i]) + w2 * r2[i]) + w3 * r3[i];
    }
    while (t < taps) {
        const Py_ssize_t c = taps - t;
        const uint8_t *b = s + t * stride;
        if (c >= 4) {
            ops_cu8_rp r0 = b, r1 = b + stride, r2 = b + 2 * stride, r3 = b + 3 * stride;
            const float w0 = k[t], w1 = k[t + 1], w2 = k[t + 2], w3 = k[t + 3];
            for (Py_ssize_t i = 0; i < n; i++)
                d[i] = (((d[i] + w0 * r0[i]) + w1 * r1[i]) + w2 * r2[i]) + w3 * r3[i];
            t += 4;
        } else if (c == 3) {
            ops_cu8_rp r0 = b, r1 = b + stride, r2 = b + 2 * stride;
            const float w0 = k[t], w1 = k[t + 1], w2 = k[t + 2];
            for (Py_ssize_t i = 0; i < n; i++)
                d[i] = ((d[i] + w0 * r0[i]) + w1 * r1[i]) + w2 * r2[i];
            t += 3;
        } else if (c == 2) {
            ops_cu8_rp r0 = b, r1 = b + stride;
            const float w0 = k[t], w1 = k[t + 1];
            for (Py_ssize_t i = 0; i < n; i++)
                d[i] = (d[i] + w0 * r0[i]) + w1 * r1[i];
            t += 2;
        } else {
            ops_cu8_rp r0 = b;
            const float w0 = k[t];
            for (Py_ssize_t i = 0; i < n; i++)
                d[i] = d[i] + w0 * r0[i];
            t += 1;
        }
    }
}

/* Round half up, as Pillow's fixed point does, clamped to 0..255: (int32)(v + 0.5) then the
   clamp. (Bilinear sums of non-negative terms with weights summing to 1 stay in 0..255.0001;
   bicubic's negative lobes overshoot, by far less than the int32 range.) */
static inline uint8_t ops_to_u8(float v) {
    int32_t i = (int32_t)(v + 0.5f);
    i = i < 255 ? i : 255;
    i = i > 0 ? i : 0;
    return (uint8_t)i;
}

/* 16 values rounded as ops_to_u8: truncation to int32, then the saturating narrowing
   instructions (to int16, then to uint8; on NEON to uint16, then uint8) do the clamp. */
OPS_INLINE void ops_round16(ops_v4f x0, ops_v4f x1, ops_v4f x2, ops_v4f x3, uint8_t *o) {
    const ops_v4f h = {0.5f, 0.5f, 0.5f, 0.5f};
    ops_v4i a = __builtin_convertvector(x0 + h, ops_v4i);
    ops_v4i b = __builtin_convertvector(x1 + h, ops_v4i);
    ops_v4i c = __builtin_convertvector(x2 + h, ops_v4i);
    ops_v4i e = __builtin_convertvector(x3 + h, ops_v4i);
#if defined(__SSE2__)
    _mm_storeu_si128((__m128i *)o, _mm_packus_epi16(_mm_packs_epi32((__m128i)a, (__m128i)b),
                                                    _mm_packs_epi32((__m128i)c, (__m128i)e)));
#elif defined(__ARM_NEON)
    uint16x8_t lo = vcombine_u16(vqmovun_s32((int32x4_t)a), vqmovun_s32((int32x4_t)b));
    uint16x8_t hi = vcombine_u16(vqmovun_s32((int32x4_t)c), vqmovun_s32((int32x4_t)e));
    vst1q_u8(o, vcombine_u8(vqmovn_u16(lo), vqmovn_u16(hi)));
#else
    int32_t v[16];
    memcpy(v, &a, 16);
    memcpy(v + 4, &b, 16);
    memcpy(v + 8, &c, 16);
    memcpy(v + 12, &e, 16);
    for (int i = 0; i < 16; i++)
        o[i] = (uint8_t)(v[i] < 0 ? 0 : (v[i] > 255 ? 255 : v[i]));
#endif
}

/* o[0:n] = ops_to_u8((a + w0 * r0) + w1 * r1): the last vertical taps and the rounding of an
   output row. ones: the caller's a is zeros, w0 = 1 and w1 = 0, so the value is r0 itself
   ((+0 + r) + 0 * r' is r, or +0 for r = -0, which rounds the same). */
DP_CLONES static void ops_fin_u8(const float *a, const float *r0, const float *r1, float w0,
                                 float w1, uint8_t *out, Py_ssize_t n, int ones) {
    Py_ssize_t i = 0;
    if (ones) {
        for (; i + 16 <= n; i += 16)
            ops_round16(ops_v4f_load(r0 + i), ops_v4f_load(r0 + i + 4), ops_v4f_load(r0 + i + 8),
                        ops_v4f_load(r0 + i + 12), out + i);
        for (; i < n; i++)
            out[i] = ops_to_u8(r0[i]);
        return;
    }
    const ops_v4f v0 = ops_v4f_set1(w0), v1 = ops_v4f_set1(w1);
    ops_v4f x[4];
    for (; i + 16 <= n; i += 16) {
        for (int j = 0; j < 4; j++)
            x[j] = (ops_v4f_load(a + i + 4 * j) + v0 * ops_v4f_load(r0 + i + 4 * j))
                   + v1 * ops_v4f_load(r1 + i + 4 * j);
        ops_round16(x[0], x[1], x[2], x[3], out + i);
    }
    for (; i < n; i++)
        out[i] = ops_to_u8((a[i] + w0 * r0[i]) + w1 * r1[i]);
}

#endif
