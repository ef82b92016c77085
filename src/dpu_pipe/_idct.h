/* From DCT coefficients to RGB pixels, bit-identical to libjpeg-turbo's decoder: dequantization
 * and the inverse DCTs (the accurate and the fast 8x8 ones, and the reduced 4x4, 2x2 and 1x1
 * ones of DCT scaling), chroma upsampling (triangle-filter "fancy" and plain replication) and YCbCr -> RGB
 * conversion; and a region decode built on the entropy decoder of _huffman.h.
 *
 * The integer algorithms are those libjpeg specifies by their constants and rounding:
 *  - the accurate IDCT is the Loeffler-Ligtenberg-Moschytz factorisation (12 multiplies per 8
 *    points) in fixed point with 13 fraction bits (CONST_BITS) and 2 extra bits kept between
 *    the column and the row pass (PASS1_BITS); each pass rounds half up when it drops bits;
 *  - the reduced IDCTs compute the 4-, 2- and 1-point outputs of the 8-point transform directly
 *    from the low-frequency coefficients (the others are discarded, never dequantized), with
 *    the same fixed point and their own odd-part constants;
 *  - every IDCT output indexes libjpeg's "range limit" table with its 10 low bits: values in
 *    [-512, 511] are clamped to [0, 255] after adding 128, larger ones wrap;
 *  - YCbCr -> RGB uses 16-bit fixed-point tables (SCALEBITS = 16) rounded half up.
 *
 * libjpeg-turbo runs SIMD versions of the 8x8 (and, on Arm, 4x4 and 2x2) IDCTs with 16-bit
 * intermediates, equal to its C code as long as nothing overflows 16 bits - always so for the
 * coefficients of real 8-bit images. A block whose values leave the range where that holds
 * (accurate IDCT: |dequantized coefficient| > 8191, |column-pass output| > 16383, |output|
 * > 511; fast IDCT: see px_idct_ifast; a multiplier above 32767) makes the region decode answer PX_FALLBACK: the caller then decodes
 * with libjpeg-turbo, so what is returned never differs from what it would return.
 *
 * The functions below are the scalar reference; _pxsimd.h holds the same computations in
 * vector form (SSE2 / NEON, AVX2), lane for lane equal to them, and px_kern picks the level
 * a decode runs (see "kernels per instruction set").
 *
 * Pure C over caller-owned buffers, no global state but constant tables filled once
 * (px_init_tables, before any thread runs): safe without the GIL on any number of threads.
 */
#ifndef DPU_PIPE_IDCT_H
#define DPU_PIPE_IDCT_H

#include <math.h>
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "_clones.h"         /* the compiler check */
#include "_huffman.h"

enum {
    PX_OK = 0,
    PX_FALLBACK = -7      /* not (or not yet) bit-identical here: decode with libjpeg-turbo */
};

/* --- tables ------------------------------------------------------------------------------ */

static uint8_t px_range[1024];            /* IDCT output (10 low bits) -> sample */
static uint8_t px_limit_tab[1024];        /* v + 384 -> v clamped to [0, 255] */
static int32_t px_cr_r[256], px_cb_b[256], px_cr_g[256], px_cb_g[256];

/* Byte shuffles interleaving three rows of 16 bytes into 16 pixels (SSSE3 pshufb): for
 * output bytes [16 p, 16 p + 16), channel c's mask px_ilv_mask[p][c] (-128: not this one). */
static int8_t px_ilv_mask[3][3][16] __attribute__((aligned(16)));

/* The highest level of px_kern (below) this CPU runs, and the one the region decode uses:
 * set once by px_init_tables. */
static int px_simd_max = 1, px_simd_default = 1;

#define PX_SCALEBITS 16
#define PX_HALF ((int32_t)1 << (PX_SCALEBITS - 1))

/* The fast IDCT's (Arai-Agui-Nakajima) prescaling: round(2^14 s(u) s(v)), s(0) = 1,
 * s(k) = sqrt(2) cos(k pi / 16), row-major. */
static int32_t px_aan[64];

static void px_init_simd(void);

static void px_init_tables(void) {
    int i;
    px_init_simd();
    for (i = 0; i < 48; i++) {
        int c;
        for (c = 0; c < 3; c++)
            px_ilv_mask[i / 16][c][i % 16] = (int8_t)(i % 3 == c ? i / 3 : -128);
    }
    for (i = 0; i < 64; i++) {
        double su = (i >> 3) ? sqrt(2.0) * cos((i >> 3) * 3.14159265358979323846 / 16) : 1.0;
        double sv = (i & 7) ? sqrt(2.0) * cos((i & 7) * 3.14159265358979323846 / 16) : 1.0;
        px_aan[i] = (int32_t)floor(16384.0 * su * sv + 0.5);
    }
    for (i = 0; i < 1024; i++) {
        int v = ((i ^ 512) - 512) + 128;  /* the 10 bits as a signed value, level-shifted */
        px_range[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
        v = i - 384;
        px_limit_tab[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
    }
    for (i = 0; i < 256; i++) {
        int32_t x = i - 128;
        /* round(c * 2^16) of 1.402, 1.772, 0.71414, 0.34414 (JFIF's conversion) */
        px_cr_r[i] = (91881 * x + PX_HALF) >> PX_SCALEBITS;
        px_cb_b[i] = (116130 * x + PX_HALF) >> PX_SCALEBITS;
        px_cr_g[i] = -46802 * x;
        px_cb_g[i] = -22554 * x + PX_HALF;
    }
}

/* --- inverse DCTs -------------------------------------------------------------------------
 * in: 64 quantized coefficients, natural order; q: the component's quantizers (natural
 * order); out: rows `stride` bytes apart. Each returns nonzero when the block left the range
 * in which libjpeg-turbo's SIMD and C IDCTs agree (see the top of this file). */

#define PX_CB 13                        /* CONST_BITS */
#define PX_P1 2                         /* PASS1_BITS */
#define PX_ROUND(x, n) (((x) + ((int32_t)1 << ((n) - 1))) >> (n))
/* round(c * 2^13) */
#define PX_F0_211 1730
#define PX_F0_298 2446
#define PX_F0_390 3196
#define PX_F0_509 4176
#define PX_F0_541 4433
#define PX_F0_601 4926
#define PX_F0_720 5906
#define PX_F0_765 6270
#define PX_F0_850 6967
#define PX_F0_899 7373
#define PX_F1_061 8697
#define PX_F1_175 9633
#define PX_F1_272 10426
#define PX_F1_451 11893
#define PX_F1_501 12299
#define PX_F1_847 15137
#define PX_F1_961 16069
#define PX_F2_053 16819
#define PX_F2_172 17799
#define PX_F2_562 20995
#define PX_F3_072 25172
#define PX_F3_624 29692

/* A dequantized coefficient, or 0 with *over set outside [-8191, 8191]. */
static inline int32_t px_deq(const int16_t* in, const uint16_t* q, int k, uint32_t* over) {
    int32_t v = (int32_t)in[k] * q[k];
    uint32_t bad = (uint32_t)(v + 8191) > 16382u;
    *over |= bad;
    return bad ? 0 : v;
}

static inline int32_t px_ws(int32_t v, uint32_t* over) {
    uint32_t bad = (uint32_t)(v + 16383) > 32766u;
    *over |= bad;
    return bad ? 0 : v;
}

static inline uint8_t px_out(int32_t v, uint32_t* over) {
    *over |= (uint32_t)(v + 512) > 1023u;
    return px_range[v & 1023];
}

/* One 8-point accurate IDCT: c[0..7] in, o[0..7] out scaled by 2^13 (before descaling). */
static inline void px_islow_1d(int32_t c0, int32_t c1, int32_t c2, int32_t c3, int32_t c4,
                               int32_t c5, int32_t c6, int32_t c7, int32_t* o) {
    /* Even part: rotation of (c2, c6) by sqrt(2) c6, butterflies with c0 +- c4. */
    int32_t z1 = (c2 + c6) * PX_F0_541;
    int32_t e2 = z1 - c6 * PX_F1_847, e3 = z1 + c2 * PX_F0_765;
    int32_t e0 = (c0 + c4) * (1 << PX_CB), e1 = (c0 - c4) * (1 << PX_CB);
    int32_t t10 = e0 + e3, t13 = e0 - e3, t11 = e1 + e2, t12 = e1 - e2;
    /* Odd part (c7, c5, c3, c1): the four-multiply lattice of Loeffler et al., figure 1. */
    int32_t s1 = c7 + c1, s2 = c5 + c3, s3 = c7 + c3, s4 = c5 + c1;
    int32_t z5 = (s3 + s4) * PX_F1_175;
    int32_t m3 = z5 - s3 * PX_F1_961, m4 = z5 - s4 * PX_F0_390;
    int32_t m1 = -s1 * PX_F0_899, m2 = -s2 * PX_F2_562;
    int32_t a0 = c7 * PX_F0_298 + m1 + m3;
    int32_t a1 = c5 * PX_F2_053 + m2 + m4;
    int32_t a2 = c3 * PX_F3_072 + m2 + m3;
    int32_t a3 = c1 * PX_F1_501 + m1 + m4;
    o[0] = t10 + a3; o[7] = t10 - a3;
    o[1] = t11 + a2; o[6] = t11 - a2;
    o[2] = t12 + a1; o[5] = t12 - a1;
    o[3] = t13 + a0; o[4] = t13 - a0;
}

/* Dequantize a block into v; nonzero when a value leaves [-8191, 8191] (see the top). */
static inline int px_dequantize(const int16_t* in, const uint16_t* q, int32_t* v) {
    uint32_t bad = 0;
    int k;
    for (k = 0; k < 64; k++) {
        v[k] = (int32_t)in[k] * q[k];
        bad |= (uint32_t)(v[k] + 8191) > 16382u;
    }
    return bad != 0;
}

/* Nonzero when any of in[1..63] is. */
static inline int px_has_ac(const int16_t* in) {
    uint16_t any = 0;
    int k;
    for (k = 1; k < 64; k++) any |= (uint16_t)in[k];
    return any != 0;
}

/* A block with no AC coefficient: every output is the same (the full computation gives it
 * too, range checks included). */
static inline int px_islow_dc(const int16_t* in, const uint16_t* q, uint8_t* out,
                              size_t stride) {
    int32_t dc = (int32_t)in[0] * q[0];
    uint32_t over = 0;
    uint8_t px;
    int k;
    if ((uint32_t)(dc + 4095) > 8190u) return 1;     /* dc * 2^PASS1_BITS > 16383 */
    px = px_out(PX_ROUND(dc * (1 << PX_P1), PX_P1 + 3), &over);
    for (k = 0; k < 8; k++) memset(out + k * stride, px, 8);
    return over != 0;
}

static int px_idct_islow(const int16_t* in, const uint16_t* q, uint8_t* out, size_t stride) {
    int32_t v[64], ws[64], o[8];
    uint32_t over = 0;
    int i, k;
    if (!px_has_ac(in)) return px_islow_dc(in, q, out, stride);
    if (px_dequantize(in, q, v)) return 1;
    /* Columns, all eight alike (no zero-column shortcut: the loop vectorizes over them). */
    for (i = 0; i < 8; i++) {
        int32_t c0 = v[i], c1 = v[8 + i], c2 = v[16 + i], c3 = v[24 + i];
        int32_t c4 = v[32 + i], c5 = v[40 + i], c6 = v[48 + i], c7 = v[56 + i];
        int32_t z1 = (c2 + c6) * PX_F0_541;
        int32_t e2 = z1 - c6 * PX_F1_847, e3 = z1 + c2 * PX_F0_765;
        int32_t e0 = (c0 + c4) * (1 << PX_CB), e1 = (c0 - c4) * (1 << PX_CB);
        int32_t t10 = e0 + e3, t13 = e0 - e3, t11 = e1 + e2, t12 = e1 - e2;
        int32_t s1 = c7 + c1, s2 = c5 + c3, s3 = c7 + c3, s4 = c5 + c1;
        int32_t z5 = (s3 + s4) * PX_F1_175;
        int32_t m3 = z5 - s3 * PX_F1_961, m4 = z5 - s4 * PX_F0_390;
        int32_t m1 = -s1 * PX_F0_899, m2 = -s2 * PX_F2_562;
        int32_t a0 = c7 * PX_F0_298 + m1 + m3;
        int32_t a1 = c5 * PX_F2_053 + m2 + m4;
        int32_t a2 = c3 * PX_F3_072 + m2 + m3;
        int32_t a3 = c1 * PX_F1_501 + m1 + m4;
        ws[i] = PX_ROUND(t10 + a3, PX_CB - PX_P1);
        ws[56 + i] = PX_ROUND(t10 - a3, PX_CB - PX_P1);
        ws[8 + i] = PX_ROUND(t11 + a2, PX_CB - PX_P1);
        ws[48 + i] = PX_ROUND(t11 - a2, PX_CB - PX_P1);
        ws[16 + i] = PX_ROUND(t12 + a1, PX_CB - PX_P1);
        ws[40 + i] = PX_ROUND(t12 - a1, PX_CB - PX_P1);
        ws[24 + i] = PX_ROUND(t13 + a0, PX_CB - PX_P1);
        ws[32 + i] = PX_ROUND(t13 - a0, PX_CB - PX_P1);
    }
    for (k = 0; k < 64; k++) over |= (uint32_t)(ws[k] + 16383) > 32766u;
    if (over) return 1;
    for (i = 0; i < 8; i++) {           /* rows */
        const int32_t* w = ws + 8 * i;
        uint8_t* r = out + i * stride;
        if (!(w[1] | w[2] | w[3] | w[4] | w[5] | w[6] | w[7])) {
            memset(r, px_out(PX_ROUND(w[0], PX_P1 + 3), &over), 8);
            continue;
        }
        px_islow_1d(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], o);
        for (k = 0; k < 8; k++) r[k] = px_out(PX_ROUND(o[k], PX_CB + PX_P1 + 3), &over);
    }
    return over != 0;
}

/* The fast IDCT (Arai, Agui, Nakajima; 5 multiplies per 8 points) as libjpeg specifies it:
 * quantizers prescaled by the AAN factors to 2 fraction bits (mq, px_make_plan), constants
 * with 8 fraction bits, every product truncated (shifted right, no rounding), the output
 * shifted by PASS1_BITS + 3 without rounding. libjpeg-turbo's SIMD version holds every value
 * in 16 bits and shifts each multiplier operand left by 2 first: *over is set when any value
 * leaves int16 or an operand leaves [-8191, 8191]. */
#define PX_A1_082 277
#define PX_A1_414 362
#define PX_A1_847 473
#define PX_A2_613 669
#define PX_C16(x) (over |= (uint32_t)((x) + 32768) > 65535u)
#define PX_CM(x) (over |= (uint32_t)((x) + 8191) > 16382u)

static inline uint32_t px_ifast_1d(const int32_t* c, int step, int32_t* o, int ostep) {
    uint32_t over = 0;
    int32_t t0 = c[0], t1 = c[2 * step], t2 = c[4 * step], t3 = c[6 * step];
    int32_t t10 = t0 + t2, t11 = t0 - t2, t13 = t1 + t3, d = t1 - t3, t12;
    int32_t t4 = c[step], t5 = c[3 * step], t6 = c[5 * step], t7 = c[7 * step];
    int32_t z13, z10, z11, z12, z5, u10, u12, u11;
    PX_C16(t10); PX_C16(t11); PX_C16(t13); PX_CM(d);
    t12 = ((d * PX_A1_414) >> 8) - t13;
    PX_C16(t12);
    t0 = t10 + t13; t3 = t10 - t13; t1 = t11 + t12; t2 = t11 - t12;
    PX_C16(t0); PX_C16(t3); PX_C16(t1); PX_C16(t2);
    z13 = t6 + t5; z10 = t6 - t5; z11 = t4 + t7; z12 = t4 - t7;
    PX_C16(z13); PX_CM(z10); PX_C16(z11); PX_CM(z12);
    t7 = z11 + z13;
    PX_C16(t7); PX_CM(z11 - z13); PX_CM(z10 + z12);
    u11 = ((z11 - z13) * PX_A1_414) >> 8;
    z5 = ((z10 + z12) * PX_A1_847) >> 8;
    u10 = ((z12 * PX_A1_082) >> 8) - z5;
    u12 = ((z10 * -PX_A2_613) >> 8) + z5;
    PX_C16(u10); PX_C16(u12);
    t6 = u12 - t7; t5 = u11 - t6; t4 = u10 + t5;
    PX_C16(t6); PX_C16(t5); PX_C16(t4);
    o[0] = t0 + t7; o[7 * ostep] = t0 - t7;
    o[ostep] = t1 + t6; o[6 * ostep] = t1 - t6;
    o[2 * ostep] = t2 + t5; o[5 * ostep] = t2 - t5;
    o[4 * ostep] = t3 + t4; o[3 * ostep] = t3 - t4;
    return over;
}

static int px_idct_ifast(const int16_t* in, const int32_t* mq, uint8_t* out, size_t stride) {
    int32_t v[64], ws[64], o[8];
    uint32_t over = 0;
    int i, k;
    for (k = 0; k < 64; k++) {
        v[k] = (int32_t)in[k] * mq[k];
        over |= (uint32_t)(v[k] + 32768) > 65535u;
    }
    if (over) return 1;
    for (i = 0; i < 8; i++) over |= px_ifast_1d(v + i, 8, ws + i, 8);
    for (k = 0; k < 64; k++) over |= (uint32_t)(ws[k] + 32768) > 65535u;
    if (over) return 1;
    for (i = 0; i < 8; i++) {
        uint8_t* r = out + i * stride;
        over |= px_ifast_1d(ws + 8 * i, 1, o, 1);
        for (k = 0; k < 8; k++) {
            PX_C16(o[k]);
            r[k] = px_out(o[k] >> (PX_P1 + 3), &over);
        }
    }
    return over != 0;
}

/* 4x4 outputs from coefficients 0-3, 5-7 of each row and column (4 is discarded). */
static inline void px_4_1d(int32_t c0, int32_t c1, int32_t c2, int32_t c3, int32_t c5,
                           int32_t c6, int32_t c7, int32_t* o) {
    int32_t e0 = c0 * (1 << (PX_CB + 1));
    int32_t e2 = c2 * PX_F1_847 - c6 * PX_F0_765;
    int32_t t10 = e0 + e2, t12 = e0 - e2;
    int32_t a0 = -c7 * PX_F0_211 + c5 * PX_F1_451 - c3 * PX_F2_172 + c1 * PX_F1_061;
    int32_t a2 = -c7 * PX_F0_509 - c5 * PX_F0_601 + c3 * PX_F0_899 + c1 * PX_F2_562;
    o[0] = t10 + a2; o[3] = t10 - a2;
    o[1] = t12 + a0; o[2] = t12 - a0;
}

static int px_idct_4x4(const int16_t* in, const uint16_t* q, uint8_t* out, size_t stride) {
    int32_t ws[32], o[4];
    uint32_t over = 0;
    int i, k;
    for (i = 0; i < 8; i++) {           /* columns; column 4 is not needed */
        if (i == 4) continue;
        px_4_1d(px_deq(in, q, i, &over), px_deq(in, q, i + 8, &over),
                px_deq(in, q, i + 16, &over), px_deq(in, q, i + 24, &over),
                px_deq(in, q, i + 40, &over), px_deq(in, q, i + 48, &over),
                px_deq(in, q, i + 56, &over), o);
        for (k = 0; k < 4; k++)
            ws[8 * k + i] = px_ws(PX_ROUND(o[k], PX_CB - PX_P1 + 1), &over);
    }
    for (i = 0; i < 4; i++) {
        const int32_t* w = ws + 8 * i;
        uint8_t* r = out + i * stride;
        px_4_1d(w[0], w[1], w[2], w[3], w[5], w[6], w[7], o);
        for (k = 0; k < 4; k++) r[k] = px_out(PX_ROUND(o[k], PX_CB + PX_P1 + 3 + 1), &over);
    }
    return over != 0;
}

/* 2x2 outputs from coefficients 0, 1, 3, 5, 7 of each row and column. */
static inline void px_2_1d(int32_t c0, int32_t c1, int32_t c3, int32_t c5, int32_t c7,
                           int32_t* o) {
    int32_t e = c0 * (1 << (PX_CB + 2));
    int32_t a = -c7 * PX_F0_720 + c5 * PX_F0_850 - c3 * PX_F1_272 + c1 * PX_F3_624;
    o[0] = e + a; o[1] = e - a;
}

static int px_idct_2x2(const int16_t* in, const uint16_t* q, uint8_t* out, size_t stride) {
    int32_t ws[16], o[2];
    uint32_t over = 0;
    int i, k;
    static const int cols[5] = {0, 1, 3, 5, 7};
    for (k = 0; k < 5; k++) {
        i = cols[k];
        px_2_1d(px_deq(in, q, i, &over), px_deq(in, q, i + 8, &over),
                px_deq(in, q, i + 24, &over), px_deq(in, q, i + 40, &over),
                px_deq(in, q, i + 56, &over), o);
        ws[i] = px_ws(PX_ROUND(o[0], PX_CB - PX_P1 + 2), &over);
        ws[8 + i] = px_ws(PX_ROUND(o[1], PX_CB - PX_P1 + 2), &over);
    }
    for (i = 0; i < 2; i++) {
        const int32_t* w = ws + 8 * i;
        uint8_t* r = out + i * stride;
        px_2_1d(w[0], w[1], w[3], w[5], w[7], o);
        r[0] = px_out(PX_ROUND(o[0], PX_CB + PX_P1 + 3 + 2), &over);
        r[1] = px_out(PX_ROUND(o[1], PX_CB + PX_P1 + 3 + 2), &over);
    }
    return over != 0;
}

/* 1x1: the DC coefficient alone (libjpeg's 1x1 IDCT has no SIMD version: no range check). */
static int px_idct_1x1(const int16_t* in, const uint16_t* q, uint8_t* out, size_t stride) {
    int32_t v = (int32_t)in[0] * q[0];
    (void)stride;
    out[0] = px_range[PX_ROUND(v, 3) & 1023];
    return 0;
}

/* --- region decode ------------------------------------------------------------------------ */

enum { PX_UP_FULL, PX_UP_PLAIN, PX_UP_H2V1, PX_UP_H2V2, PX_UP_H1V2 };

typedef struct {
    int scale;                  /* eighths: 1, 2, 4 or 8 */
    int out_w, out_h;           /* the scaled image */
    int colour;                 /* HP_GREY, HP_YCC, HP_RGB */
    int ds[HP_MAX_COMPS];       /* each component's IDCT size (1, 2, 4, 8) */
    int hr[HP_MAX_COMPS], vr[HP_MAX_COMPS];   /* output pixels per component sample */
    int dw[HP_MAX_COMPS], dh[HP_MAX_COMPS];   /* component samples inside the image */
    int up[HP_MAX_COMPS];       /* PX_UP_* */
    int ifast;                  /* 8x8 IDCTs are the fast one (fast mode) */
    int32_t mq[HP_MAX_COMPS][64];   /* its prescaled quantizers */
    int simd;                   /* px_kern level: px_simd_default (tests pick others) */
} px_plan;

/* The fast IDCT's multipliers for quantizers q: libjpeg-turbo's 16-bit tables, round(q * aan
 * / 2^12). Nonzero when one exceeds 32767 (libjpeg-turbo's SIMD cannot hold it). */
static int px_ifast_multipliers(const uint16_t* q, int32_t* mq) {
    int k;
    for (k = 0; k < 64; k++) {
        mq[k] = (int32_t)(((int64_t)q[k] * px_aan[k] + 2048) >> 12);
        if (mq[k] > 32767) return 1;
    }
    return 0;
}

/* How libjpeg-turbo decodes this frame at DCT scale scale/8 (its jpeg_calc_output_dimensions
 * and jinit_upsampler): a component's IDCT is enlarged (up to 8x8) while that keeps its
 * samples an integer factor of the output's, so chroma is scaled by the IDCT rather than
 * upsampled where it can be; the upsampler left is fancy (triangle filter) only in accurate
 * mode, above 1/8 scale, and (horizontally) for components more than 2 samples wide.
 * `fancy_h1v2`: this libjpeg-turbo upsamples 1x2 (4:4:0) chroma with the triangle filter.
 * Returns PX_FALLBACK for what is not (yet) reproduced here: fractional sampling, colour
 * spaces other than grey, YCbCr and RGB, multipliers beyond libjpeg-turbo's 16-bit tables. */
static int px_make_plan(const hp_header* h, int scale, int fast, int fancy_h1v2,
                        px_plan* p) {
    int ci, fancy = !fast && scale > 1;
    p->ifast = fast;
    p->simd = px_simd_default;
    if (scale != 1 && scale != 2 && scale != 4 && scale != 8) return HP_ESIZE;
    p->scale = scale;
    p->colour = hp_colour_space(h);
    if (p->colour < 0) return PX_FALLBACK;
    /* libjpeg-turbo warns about bytes before a marker (an error in strict mode). */
    if (h->junk) return PX_FALLBACK;
    p->out_w = (int)(((int64_t)h->width * scale + 7) / 8);
    p->out_h = (int)(((int64_t)h->height * scale + 7) / 8);
    for (ci = 0; ci < h->ncomp; ci++) {
        const hp_comp* c = &h->comp[ci];
        int s = scale, hin, vin, i, k;
        if (!h->qt_defined[c->tq]) return PX_FALLBACK;   /* libjpeg-turbo's error to report */
        for (k = 0; k < 64; k++)
            if (h->qt[c->tq][k] > 32767) return PX_FALLBACK;   /* its 16-bit multipliers */
        while (s < 8 && (h->hmax * scale) % (c->h * s * 2) == 0
               && (h->vmax * scale) % (c->v * s * 2) == 0)
            s *= 2;
        p->ds[ci] = s;
        if (fast && s == 8 && px_ifast_multipliers(h->qt[c->tq], p->mq[ci]))
            return PX_FALLBACK;
        hin = c->h * s / scale;
        vin = c->v * s / scale;
        if (h->hmax % hin || h->vmax % vin) return PX_FALLBACK;
        p->hr[ci] = h->hmax / hin;
        p->vr[ci] = h->vmax / vin;
        p->dw[ci] = (int)(((int64_t)h->width * c->h * s + 8 * h->hmax - 1) / (8 * h->hmax));
        p->dh[ci] = (int)(((int64_t)h->height * c->v * s + 8 * h->vmax - 1) / (8 * h->vmax));
        if (p->hr[ci] == 1 && p->vr[ci] == 1) i = PX_UP_FULL;
        else if (p->hr[ci] == 2 && p->vr[ci] == 1) i = fancy && p->dw[ci] > 2 ? PX_UP_H2V1 : PX_UP_PLAIN;
        else if (p->hr[ci] == 1 && p->vr[ci] == 2 && fancy) {
            if (!fancy_h1v2) return PX_FALLBACK;
            i = PX_UP_H1V2;
        } else if (p->hr[ci] == 2 && p->vr[ci] == 2) i = fancy && p->dw[ci] > 2 ? PX_UP_H2V2 : PX_UP_PLAIN;
        else i = PX_UP_PLAIN;
        p->up[ci] = i;
    }
    return PX_OK;
}

/* The MCU rectangle [r0, r1) x [c0, c1) whose samples the output box needs (the filter taps of
 * fancy upsampling included), and the component sample windows it spans. */
typedef struct {
    int r0, r1, c0, c1;
    int sx0[HP_MAX_COMPS], sy0[HP_MAX_COMPS];   /* sample coordinates of the window's origin */
    int pw[HP_MAX_COMPS], ph[HP_MAX_COMPS];     /* window size in samples (whole blocks) */
    size_t coef_off[HP_MAX_COMPS], plane_off[HP_MAX_COMPS];
    size_t coef_bytes, plane_bytes;             /* scratch the decode needs */
} px_rect;

static void px_make_rect(const hp_header* h, const px_plan* p, int top, int left, int height,
                         int width, px_rect* r) {
    int ci;
    size_t coef = 0, plane = 0;
    r->r0 = r->c0 = 0x7FFFFFFF;
    r->r1 = r->c1 = 0;
    for (ci = 0; ci < h->ncomp; ci++) {
        int hr = p->hr[ci], vr = p->vr[ci], ds = p->ds[ci];
        int hh = h->interleaved ? h->comp[ci].h : 1, vv = h->interleaved ? h->comp[ci].v : 1;
        int x0 = left / hr, x1 = (left + width - 1) / hr;
        int y0 = top / vr, y1 = (top + height - 1) / vr;
        int a;
        if (p->up[ci] == PX_UP_H2V1 || p->up[ci] == PX_UP_H2V2) {
            x0 = x0 > 0 ? x0 - 1 : 0;
            x1 = x1 + 1 < p->dw[ci] ? x1 + 1 : p->dw[ci] - 1;
        }
        if (p->up[ci] == PX_UP_H2V2 || p->up[ci] == PX_UP_H1V2) {
            y0 = y0 > 0 ? y0 - 1 : 0;
            y1 = y1 + 1 < p->dh[ci] ? y1 + 1 : p->dh[ci] - 1;
        }
        /* samples -> blocks -> MCUs */
        a = x0 / ds / hh; if (a < r->c0) r->c0 = a;
        a = x1 / ds / hh + 1; if (a > r->c1) r->c1 = a;
        a = y0 / ds / vv; if (a < r->r0) r->r0 = a;
        a = y1 / ds / vv + 1; if (a > r->r1) r->r1 = a;
    }
    if (r->c1 > h->mcux) r->c1 = h->mcux;
    if (r->r1 > h->mcuy) r->r1 = h->mcuy;
    for (ci = 0; ci < h->ncomp; ci++) {
        int ds = p->ds[ci];
        int hh = h->interleaved ? h->comp[ci].h : 1, vv = h->interleaved ? h->comp[ci].v : 1;
        size_t blocks = (size_t)(r->r1 - r->r0) * vv * (size_t)(r->c1 - r->c0) * hh;
        r->sx0[ci] = r->c0 * hh * ds;
        r->sy0[ci] = r->r0 * vv * ds;
        r->pw[ci] = (r->c1 - r->c0) * hh * ds;
        r->ph[ci] = (r->r1 - r->r0) * vv * ds;
        r->coef_off[ci] = coef;
        r->plane_off[ci] = plane;
        coef += blocks * 64 * sizeof(int16_t);
        plane += (size_t)r->pw[ci] * r->ph[ci];
    }
    r->coef_bytes = coef;
    r->plane_bytes = plane;
}

/* --- kernels per instruction set ----------------------------------------------------------
 * px_kern[level]: 0 the scalar reference (the IDCTs above, table colour conversion), 1 the
 * build's baseline SIMD (SSE2 on x86-64, NEON on aarch64), 2 AVX2 (x86-64, when the CPU has
 * it). px_make_plan picks px_simd_default (the fastest level this CPU runs); tests pick
 * each. The upsampling of levels 0 and 1 is the same code. */

typedef int32_t px_i32x8 __attribute__((vector_size(32)));
typedef uint32_t px_u32x8 __attribute__((vector_size(32)));
typedef int32_t px_i32x4 __attribute__((vector_size(16)));
typedef int16_t px_i16x8 __attribute__((vector_size(16)));
typedef uint16_t px_u16x8 __attribute__((vector_size(16)));
typedef uint8_t px_u8x8 __attribute__((vector_size(8)));

/* 32-byte vectors in functions built for 16-byte registers: passed in memory, never across
 * an interface between instances (all helpers are inlined). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

#define PXV(name) name##_base
#include "_pxsimd.h"
#undef PXV

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PX_HAVE_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2")
#define PXV(name) name##_avx2
#include "_pxsimd.h"
#undef PXV
#pragma GCC pop_options
#else
#define PX_HAVE_AVX2 0
#endif

#pragma GCC diagnostic pop

/* YCbCr -> RGB through the tables (the reference of px_rgb_row's arithmetic). */
static void px_rgb_row_ref(int colour, const uint8_t* const* c, uint8_t* o, int n) {
    const uint8_t* px_limit = px_limit_tab + 384;
    int x;
    if (colour != HP_YCC) {
        px_rgb_row_base(colour, c, o, n);
        return;
    }
    for (x = 0; x < n; x++) {
        int yy = c[0][x], cb = c[1][x], cr = c[2][x];
        /* y + any table entry lies in [-227, 482]: one lookup clamps it */
        o[3 * x] = px_limit[yy + px_cr_r[cr]];
        o[3 * x + 1] = px_limit[yy + ((px_cb_g[cb] + px_cr_g[cr]) >> PX_SCALEBITS)];
        o[3 * x + 2] = px_limit[yy + px_cb_b[cb]];
    }
}

typedef struct {
    int (*islow)(const int16_t*, const uint16_t*, uint8_t*, size_t);
    int (*ifast)(const int16_t*, const int32_t*, uint8_t*, size_t);
    int (*idct4)(const int16_t*, const uint16_t*, uint8_t*, size_t);
    int (*idct2)(const int16_t*, const uint16_t*, uint8_t*, size_t);
    const uint8_t* (*upsample_row)(const px_plan*, const px_rect*, int, const uint8_t*, int,
                                   int, int, uint8_t*, int16_t*);
    void (*rgb_row)(int, const uint8_t* const*, uint8_t*, int);
} px_kernels;

enum { PX_SIMD_LEVELS = 3 };

static const px_kernels px_kern[PX_SIMD_LEVELS] = {
    {px_idct_islow, px_idct_ifast, px_idct_4x4, px_idct_2x2, px_upsample_row_base,
     px_rgb_row_ref},
    {px_idct_islow_base, px_idct_ifast_base, px_idct_4x4_base, px_idct_2x2_base,
     px_upsample_row_base, px_rgb_row_base},
#if PX_HAVE_AVX2
    {px_idct_islow_avx2, px_idct_ifast_avx2, px_idct_4x4_avx2, px_idct_2x2_avx2,
     px_upsample_row_avx2, px_rgb_row_avx2},
#else
    {px_idct_islow_base, px_idct_ifast_base, px_idct_4x4_base, px_idct_2x2_base,
     px_upsample_row_base, px_rgb_row_base},
#endif
};

static void px_init_simd(void) {
#if PX_HAVE_AVX2
    __builtin_cpu_init();
    px_simd_max = __builtin_cpu_supports("avx2") ? 2 : 1;
    /* SSE2 has no 32-bit multiply: there the int32 lanes of level 1 cost more than the
     * scalar reference (measured: docs/design/entropy.md), so without AVX2 x86 runs level 0. */
    px_simd_default = px_simd_max == 2 ? 2 : 0;
#elif defined(__x86_64__)
    px_simd_max = 1;
    px_simd_default = 0;
#else
    px_simd_max = px_simd_default = 1;
#endif
}

/* One block's IDCT with the kernels of level simd (px_kern; tests compare the levels): size
 * 8 the accurate one, or with mq (px_ifast_multipliers) the fast one; 4, 2, 1 the reduced
 * ones. Returns what the IDCT returns (nonzero: the region decode would answer
 * PX_FALLBACK, and out holds nothing that counts). */
static int px_idct_block(int simd, int size, const int16_t* in, const uint16_t* q,
                         const int32_t* mq, uint8_t* out, size_t stride) {
    const px_kernels* k = &px_kern[simd];
    switch (size) {
    case 8: return mq ? k->ifast(in, mq, out, stride) : k->islow(in, q, out, stride);
    case 4: return k->idct4(in, q, out, stride);
    case 2: return k->idct2(in, q, out, stride);
    default: return px_idct_1x1(in, q, out, stride);
    }
}

/* Decode the box rows [top, top + height) x columns [left, left + width) of the image at DCT
 * scale scale/8 (pixels of the scaled image) into out (RGB, rows out_stride bytes apart).
 * data/starts/ends: the stream and its restart intervals (hp_find_intervals, up to the one
 * holding the rectangle's last MCU: px_intervals_needed). coef (r.coef_bytes, zeroed by the
 * caller), planes (r.plane_bytes) and rows (PX_ROW_BYTES(width)) are the caller's scratch.
 * Returns PX_OK, HP_EDATA (damaged data), or PX_FALLBACK (see px_idct_islow). */
static int px_decode_box(const hp_header* h, const px_plan* p, const px_rect* r,
                         const uint8_t* data, const size_t* starts, const size_t* ends,
                         int top, int left, int height, int width, uint8_t* coef,
                         uint8_t* planes, uint8_t* rows, uint8_t* out, size_t out_stride) {
    const px_kernels* k = &px_kern[p->simd];
    int16_t* blocks[HP_MAX_COMPS];
    int16_t* tmp = (int16_t*)(rows + 3 * (size_t)width + (width & 1));
    int ci, y, rc;
    for (ci = 0; ci < h->ncomp; ci++) blocks[ci] = (int16_t*)(coef + r->coef_off[ci]);
    rc = hp_decode_rect(h, data, starts, ends, r->r0, r->r1, r->c0, r->c1, blocks);
    if (rc != HP_OK) return rc;
    for (ci = 0; ci < h->ncomp; ci++) {
        int (*idct)(const int16_t*, const uint16_t*, uint8_t*, size_t);
        const int ds = p->ds[ci], pw = r->pw[ci];
        const int bw = pw / ds, bh = r->ph[ci] / ds;
        const uint16_t* q = h->qt[h->comp[ci].tq];
        uint8_t* plane = planes + r->plane_off[ci];
        const int16_t* b = blocks[ci];
        int over = 0, by, bx;
        idct = ds == 8 ? k->islow : ds == 4 ? k->idct4 : ds == 2 ? k->idct2
                                                                : px_idct_1x1;
        for (by = 0; by < bh; by++)
            for (bx = 0; bx < bw; bx++, b += 64) {
                uint8_t* at = plane + (size_t)by * ds * pw + (size_t)bx * ds;
                over |= ds == 8 && p->ifast ? k->ifast(b, p->mq[ci], at, (size_t)pw)
                                            : idct(b, q, at, (size_t)pw);
            }
        if (over) return PX_FALLBACK;
    }
    for (y = 0; y < height; y++) {
        const uint8_t* c[3];
        for (ci = 0; ci < h->ncomp; ci++)
            c[ci] = k->upsample_row(p, r, ci, planes + r->plane_off[ci], top + y, left, width,
                                    rows + (size_t)ci * width, tmp);
        k->rgb_row(p->colour, c, out + (size_t)y * out_stride, width);
    }
    return PX_OK;
}

/* Scratch px_decode_box needs for a box `width` pixels wide: three upsampled rows and the
 * filter's padded row of int16. */
#define PX_ROW_BYTES(width) (3 * (size_t)(width) + 1 + 2 * ((size_t)(width) / 2 + 4))

/* Restart intervals hp_find_intervals must locate for rectangle r (1 without markers). */
static int64_t px_intervals_needed(const hp_header* h, const px_rect* r) {
    if (!h->restart_interval) return 1;
    return ((int64_t)(r->r1 - 1) * h->mcux + r->c1 - 1) / h->restart_interval + 1;
}

#endif
