/* The pixel stages of the region decode in SIMD form: the accurate and the fast 8x8 IDCTs
 * with the eight columns (then, after a transpose, the eight rows) of a block in the lanes of
 * one vector, chroma upsampling and YCbCr -> RGB.
 *
 * _idct.h includes this file once per instruction set, with PXV(name) giving this instance's
 * function names and the instruction set chosen around the #include (the build's baseline:
 * SSE2 on x86-64, NEON on aarch64; and AVX2 under #pragma GCC target). The code is GCC's
 * generic vector extension (vector_size, __builtin_shufflevector, __builtin_convertvector)
 * and plain loops the compiler vectorizes: integer operations only, each lane computing
 * exactly what the scalar reference of _idct.h computes for that column or row (int32
 * lanes, the same constants, products, sums, shifts and range checks), so every instance
 * equals the reference - and x86 equals aarch64 - by construction, with nothing to tune per
 * architecture. Where the reference indexes its range-limit tables, the lanes clamp: the
 * two agree wherever the region decode keeps the result (an output outside [-512, 511]
 * makes it answer PX_FALLBACK, whatever the pixels). */

#define PXI static inline __attribute__((always_inline))

/* Eight int16 coefficients, and eight uint16 multipliers, into int32 lanes. (Vectors pass
 * through pointers: 32-byte values returned from functions built for 16-byte registers
 * would change their ABI, which GCC warns about even where they are inlined.) */
PXI void PXV(ld16)(px_i32x8* o, const int16_t* p) {
    px_i16x8 v;
    memcpy(&v, p, sizeof v);
    *o = __builtin_convertvector(v, px_i32x8);
}

PXI void PXV(ldq)(px_i32x8* o, const uint16_t* p) {
    px_u16x8 v;
    memcpy(&v, p, sizeof v);
    *o = __builtin_convertvector(v, px_i32x8);
}

/* Lanes whose top bit is set where v leaves [-lo, span - lo], the range the reference tests
 * as (uint32_t)(v + lo) > span: there v + lo or span - lo - v is negative. Additions only,
 * in unsigned lanes (no compare: SSE2 has no unsigned one, and GCC splits the compares of
 * 32-byte vectors on 16-byte registers into scalar code). */
#define PXV_OUTSIDE(v, lo, span) \
    (((px_u32x8)(v) + (uint32_t)(lo)) | ((uint32_t)((span) - (lo)) - (px_u32x8)(v)))

PXI int PXV(any)(const px_u32x8* m) {
    uint64_t w[4];
    memcpy(w, m, sizeof w);
    return ((w[0] | w[1] | w[2] | w[3]) & 0x8000000080000000u) != 0;
}

/* v + 128 clamped to [0, 255], stored as 8 bytes. The packing instructions saturate, to
 * int16 and then to uint8: the clamp for every v in [-512, 511], the only values whose
 * pixels the region decode keeps. */
PXI void PXV(store8)(uint8_t* out, const px_i32x8* a) {
    px_i32x8 v = *a + 128;
    px_i32x4 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3);
    px_i32x4 hi = __builtin_shufflevector(v, v, 4, 5, 6, 7);
#if defined(__SSE2__)
    __m128i w = _mm_packs_epi32((__m128i)lo, (__m128i)hi);
    _mm_storel_epi64((__m128i*)out, _mm_packus_epi16(w, w));
#elif defined(__ARM_NEON)
    vst1_u8(out, vqmovun_s16(vcombine_s16(vqmovn_s32((int32x4_t)lo), vqmovn_s32((int32x4_t)hi))));
#else
    px_u8x8 b;
    (void)lo; (void)hi;
    v &= ~(v >> 31);
    v |= (255 - v) >> 31;
    b = __builtin_convertvector(v & 255, px_u8x8);
    memcpy(out, &b, sizeof b);
#endif
}

/* r[i] lane j <- r[j] lane i. */
PXI void PXV(transpose)(px_i32x8* r) {
    px_i32x8 t0 = __builtin_shufflevector(r[0], r[1], 0, 8, 1, 9, 4, 12, 5, 13);
    px_i32x8 t1 = __builtin_shufflevector(r[0], r[1], 2, 10, 3, 11, 6, 14, 7, 15);
    px_i32x8 t2 = __builtin_shufflevector(r[2], r[3], 0, 8, 1, 9, 4, 12, 5, 13);
    px_i32x8 t3 = __builtin_shufflevector(r[2], r[3], 2, 10, 3, 11, 6, 14, 7, 15);
    px_i32x8 t4 = __builtin_shufflevector(r[4], r[5], 0, 8, 1, 9, 4, 12, 5, 13);
    px_i32x8 t5 = __builtin_shufflevector(r[4], r[5], 2, 10, 3, 11, 6, 14, 7, 15);
    px_i32x8 t6 = __builtin_shufflevector(r[6], r[7], 0, 8, 1, 9, 4, 12, 5, 13);
    px_i32x8 t7 = __builtin_shufflevector(r[6], r[7], 2, 10, 3, 11, 6, 14, 7, 15);
    px_i32x8 u0 = __builtin_shufflevector(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13);
    px_i32x8 u1 = __builtin_shufflevector(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    px_i32x8 u2 = __builtin_shufflevector(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13);
    px_i32x8 u3 = __builtin_shufflevector(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    px_i32x8 u4 = __builtin_shufflevector(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13);
    px_i32x8 u5 = __builtin_shufflevector(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
    px_i32x8 u6 = __builtin_shufflevector(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13);
    px_i32x8 u7 = __builtin_shufflevector(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
    r[0] = __builtin_shufflevector(u0, u4, 0, 1, 2, 3, 8, 9, 10, 11);
    r[4] = __builtin_shufflevector(u0, u4, 4, 5, 6, 7, 12, 13, 14, 15);
    r[1] = __builtin_shufflevector(u1, u5, 0, 1, 2, 3, 8, 9, 10, 11);
    r[5] = __builtin_shufflevector(u1, u5, 4, 5, 6, 7, 12, 13, 14, 15);
    r[2] = __builtin_shufflevector(u2, u6, 0, 1, 2, 3, 8, 9, 10, 11);
    r[6] = __builtin_shufflevector(u2, u6, 4, 5, 6, 7, 12, 13, 14, 15);
    r[3] = __builtin_shufflevector(u3, u7, 0, 1, 2, 3, 8, 9, 10, 11);
    r[7] = __builtin_shufflevector(u3, u7, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* px_islow_1d on eight lanes: c[0..7] in, o[0..7] out (in place allowed). */
PXI void PXV(islow_1d)(px_i32x8* c, px_i32x8* o) {
    px_i32x8 z1 = (c[2] + c[6]) * PX_F0_541;
    px_i32x8 e2 = z1 - c[6] * PX_F1_847, e3 = z1 + c[2] * PX_F0_765;
    px_i32x8 e0 = (c[0] + c[4]) * (1 << PX_CB), e1 = (c[0] - c[4]) * (1 << PX_CB);
    px_i32x8 t10 = e0 + e3, t13 = e0 - e3, t11 = e1 + e2, t12 = e1 - e2;
    px_i32x8 s1 = c[7] + c[1], s2 = c[5] + c[3], s3 = c[7] + c[3], s4 = c[5] + c[1];
    px_i32x8 z5 = (s3 + s4) * PX_F1_175;
    px_i32x8 m3 = z5 - s3 * PX_F1_961, m4 = z5 - s4 * PX_F0_390;
    px_i32x8 m1 = -s1 * PX_F0_899, m2 = -s2 * PX_F2_562;
    px_i32x8 a0 = c[7] * PX_F0_298 + m1 + m3;
    px_i32x8 a1 = c[5] * PX_F2_053 + m2 + m4;
    px_i32x8 a2 = c[3] * PX_F3_072 + m2 + m3;
    px_i32x8 a3 = c[1] * PX_F1_501 + m1 + m4;
    o[0] = t10 + a3; o[7] = t10 - a3;
    o[1] = t11 + a2; o[6] = t11 - a2;
    o[2] = t12 + a1; o[5] = t12 - a1;
    o[3] = t13 + a0; o[4] = t13 - a0;
}

static int PXV(px_idct_islow)(const int16_t* in, const uint16_t* q, uint8_t* out,
                              size_t stride) {
    px_i32x8 v[8], m;
    px_u32x8 bad = {0};
    px_i16x8 ac = {0}, row;
    uint64_t w[2];
    int k;
    for (k = 0; k < 8; k++) {
        memcpy(&row, in + 8 * k, sizeof row);
        if (k == 0) row[0] = 0;
        ac |= row;
    }
    memcpy(w, &ac, sizeof w);
    if (!(w[0] | w[1])) return px_islow_dc(in, q, out, stride);
    for (k = 0; k < 8; k++) {
        PXV(ld16)(&v[k], in + 8 * k);
        PXV(ldq)(&m, q + 8 * k);
        v[k] *= m;
        bad |= PXV_OUTSIDE(v[k], 8191, 16382u);
    }
    if (PXV(any)(&bad)) return 1;
    PXV(islow_1d)(v, v);                /* columns */
    for (k = 0; k < 8; k++) {
        v[k] = (v[k] + (1 << (PX_CB - PX_P1 - 1))) >> (PX_CB - PX_P1);
        bad |= PXV_OUTSIDE(v[k], 16383, 32766u);
    }
    if (PXV(any)(&bad)) return 1;
    PXV(transpose)(v);
    PXV(islow_1d)(v, v);                /* rows: lane i is row i */
    for (k = 0; k < 8; k++) {
        v[k] = (v[k] + (1 << (PX_CB + PX_P1 + 2))) >> (PX_CB + PX_P1 + 3);
        bad |= PXV_OUTSIDE(v[k], 512, 1023u);
    }
    PXV(transpose)(v);
    for (k = 0; k < 8; k++) PXV(store8)(out + k * stride, &v[k]);
    return PXV(any)(&bad);
}

/* px_ifast_1d on eight lanes, with its int16 and multiplier-operand checks: the lanes that
 * fail one are set in *bad_lanes. */
#define PXV_C16(x) (bad |= PXV_OUTSIDE(x, 32768, 65535u))
#define PXV_CM(x) (bad |= PXV_OUTSIDE(x, 8191, 16382u))

PXI void PXV(ifast_1d)(px_i32x8* c, px_i32x8* o, px_u32x8* bad_lanes) {
    px_u32x8 bad = {0};
    px_i32x8 t0 = c[0], t1 = c[2], t2 = c[4], t3 = c[6];
    px_i32x8 t10 = t0 + t2, t11 = t0 - t2, t13 = t1 + t3, d = t1 - t3, t12;
    px_i32x8 t4 = c[1], t5 = c[3], t6 = c[5], t7 = c[7];
    px_i32x8 z13, z10, z11, z12, z5, u10, u12, u11;
    PXV_C16(t10); PXV_C16(t11); PXV_C16(t13); PXV_CM(d);
    t12 = ((d * PX_A1_414) >> 8) - t13;
    PXV_C16(t12);
    t0 = t10 + t13; t3 = t10 - t13; t1 = t11 + t12; t2 = t11 - t12;
    PXV_C16(t0); PXV_C16(t3); PXV_C16(t1); PXV_C16(t2);
    z13 = t6 + t5; z10 = t6 - t5; z11 = t4 + t7; z12 = t4 - t7;
    PXV_C16(z13); PXV_CM(z10); PXV_C16(z11); PXV_CM(z12);
    t7 = z11 + z13;
    PXV_C16(t7); PXV_CM(z11 - z13); PXV_CM(z10 + z12);
    u11 = ((z11 - z13) * PX_A1_414) >> 8;
    z5 = ((z10 + z12) * PX_A1_847) >> 8;
    u10 = ((z12 * PX_A1_082) >> 8) - z5;
    u12 = ((z10 * -PX_A2_613) >> 8) + z5;
    PXV_C16(u10); PXV_C16(u12);
    t6 = u12 - t7; t5 = u11 - t6; t4 = u10 + t5;
    PXV_C16(t6); PXV_C16(t5); PXV_C16(t4);
    o[0] = t0 + t7; o[7] = t0 - t7;
    o[1] = t1 + t6; o[6] = t1 - t6;
    o[2] = t2 + t5; o[5] = t2 - t5;
    o[4] = t3 + t4; o[3] = t3 - t4;
    *bad_lanes |= bad;
}

static int PXV(px_idct_ifast)(const int16_t* in, const int32_t* mq, uint8_t* out,
                              size_t stride) {
    px_i32x8 v[8], m;
    px_u32x8 bad = {0};
    int k;
    for (k = 0; k < 8; k++) {
        memcpy(&m, mq + 8 * k, sizeof m);
        PXV(ld16)(&v[k], in + 8 * k);
        v[k] *= m;
        PXV_C16(v[k]);
    }
    if (PXV(any)(&bad)) return 1;
    PXV(ifast_1d)(v, v, &bad);         /* columns */
    for (k = 0; k < 8; k++) PXV_C16(v[k]);
    if (PXV(any)(&bad)) return 1;
    PXV(transpose)(v);
    PXV(ifast_1d)(v, v, &bad);         /* rows: lane i is row i */
    for (k = 0; k < 8; k++) {
        PXV_C16(v[k]);
        v[k] >>= PX_P1 + 3;
        bad |= PXV_OUTSIDE(v[k], 512, 1023u);
    }
    PXV(transpose)(v);
    for (k = 0; k < 8; k++) PXV(store8)(out + k * stride, &v[k]);
    return PXV(any)(&bad);
}

#undef PXV_C16
#undef PXV_CM

/* v + 128 clamped to [0, 255] (as store8), the first n bytes stored. */
PXI void PXV(storen)(uint8_t* out, const px_i32x8* v, int n) {
    uint8_t b[8];
    PXV(store8)(b, v);
    memcpy(out, b, (size_t)n);
}

/* The reduced IDCTs with the columns in lanes: rows of the block in v[0..7], the lanes of
 * columns the scale discards (keep: 0 there) left out of the range checks, as the
 * reference never dequantizes them. The row pass runs on the transposed column outputs
 * (lanes beyond the output rows hold zeros, which pass every check). */

/* v where it lies in [-lo, span - lo] and its lane is kept, else 0 (the reference's px_deq
 * and px_ws: a failed value goes on as 0, so nothing downstream overflows); a failure in a
 * kept lane is set in *bad. */
PXI void PXV(checked)(px_i32x8* v, int32_t lo, uint32_t span, const px_u32x8* keep,
                      px_u32x8* bad) {
    px_i32x8 fail = (px_i32x8)PXV_OUTSIDE(*v, lo, span) >> 31;
    *bad |= (px_u32x8)fail & *keep;
    *v &= ~fail & (px_i32x8)*keep;
}
PXI void PXV(r4_1d)(px_i32x8* c, px_i32x8* o) {
    px_i32x8 e0 = c[0] * (1 << (PX_CB + 1));
    px_i32x8 e2 = c[2] * PX_F1_847 - c[6] * PX_F0_765;
    px_i32x8 t10 = e0 + e2, t12 = e0 - e2;
    px_i32x8 a0 = -c[7] * PX_F0_211 + c[5] * PX_F1_451 - c[3] * PX_F2_172 + c[1] * PX_F1_061;
    px_i32x8 a2 = -c[7] * PX_F0_509 - c[5] * PX_F0_601 + c[3] * PX_F0_899 + c[1] * PX_F2_562;
    o[0] = t10 + a2; o[3] = t10 - a2;
    o[1] = t12 + a0; o[2] = t12 - a0;
}

static int PXV(px_idct_4x4)(const int16_t* in, const uint16_t* q, uint8_t* out,
                            size_t stride) {
    const px_u32x8 keep = {~0u, ~0u, ~0u, ~0u, 0, ~0u, ~0u, ~0u};     /* column 4 discarded */
    px_i32x8 v[8], m;
    px_u32x8 bad = {0};
    int k;
    for (k = 0; k < 8; k++) {
        if (k == 4) { v[k] = (px_i32x8){0}; continue; }     /* row 4 discarded */
        PXV(ld16)(&v[k], in + 8 * k);
        PXV(ldq)(&m, q + 8 * k);
        v[k] *= m;
        PXV(checked)(&v[k], 8191, 16382u, &keep, &bad);
    }
    PXV(r4_1d)(v, v);                   /* columns: v[0..3] the four output rows */
    for (k = 0; k < 4; k++) {
        v[k] = (v[k] + (1 << (PX_CB - PX_P1))) >> (PX_CB - PX_P1 + 1);
        PXV(checked)(&v[k], 16383, 32766u, &keep, &bad);
        v[k + 4] = (px_i32x8){0};
    }
    PXV(transpose)(v);
    PXV(r4_1d)(v, v);                   /* rows: lane i is row i */
    for (k = 0; k < 4; k++) {
        v[k] = (v[k] + (1 << (PX_CB + PX_P1 + 3))) >> (PX_CB + PX_P1 + 3 + 1);
        bad |= PXV_OUTSIDE(v[k], 512, 1023u);
        v[k + 4] = (px_i32x8){0};
    }
    PXV(transpose)(v);
    for (k = 0; k < 4; k++) PXV(storen)(out + k * stride, &v[k], 4);
    return PXV(any)(&bad);
}

PXI void PXV(r2_1d)(px_i32x8* c, px_i32x8* o) {
    px_i32x8 e = c[0] * (1 << (PX_CB + 2));
    px_i32x8 a = -c[7] * PX_F0_720 + c[5] * PX_F0_850 - c[3] * PX_F1_272 + c[1] * PX_F3_624;
    o[0] = e + a; o[1] = e - a;
}

static int PXV(px_idct_2x2)(const int16_t* in, const uint16_t* q, uint8_t* out,
                            size_t stride) {
    const px_u32x8 keep = {~0u, ~0u, 0, ~0u, 0, ~0u, 0, ~0u};     /* columns 0, 1, 3, 5, 7 */
    px_i32x8 v[8], m;
    px_u32x8 bad = {0};
    int k;
    for (k = 0; k < 8; k++) {
        if (k == 2 || k == 4 || k == 6) { v[k] = (px_i32x8){0}; continue; }
        PXV(ld16)(&v[k], in + 8 * k);
        PXV(ldq)(&m, q + 8 * k);
        v[k] *= m;
        PXV(checked)(&v[k], 8191, 16382u, &keep, &bad);
    }
    PXV(r2_1d)(v, v);
    for (k = 0; k < 2; k++) {
        v[k] = (v[k] + (1 << (PX_CB - PX_P1 + 1))) >> (PX_CB - PX_P1 + 2);
        PXV(checked)(&v[k], 16383, 32766u, &keep, &bad);
    }
    for (k = 2; k < 8; k++) v[k] = (px_i32x8){0};
    PXV(transpose)(v);
    PXV(r2_1d)(v, v);
    for (k = 0; k < 2; k++) {
        v[k] = (v[k] + (1 << (PX_CB + PX_P1 + 3 + 1))) >> (PX_CB + PX_P1 + 3 + 2);
        bad |= PXV_OUTSIDE(v[k], 512, 1023u);
    }
    for (k = 2; k < 8; k++) v[k] = (px_i32x8){0};
    PXV(transpose)(v);
    for (k = 0; k < 2; k++) PXV(storen)(out + k * stride, &v[k], 2);
    return PXV(any)(&bad);
}

/* Triangle filter by 2 along a row (see px_upsample_row): output x (x0 <= x < x0 + n) from
 * e[j], the value at sample x / 2 = c0 + j - 1, and its neighbour on x's side. The pairs'
 * loop reads and writes contiguous runs, so it vectorizes. */
static void PXV(h2_filter)(const int16_t* e, int x0, int n, int b_even, int b_odd, int shift,
                           uint8_t* dst) {
    int pairs, k;
    if (x0 & 1) {                       /* an odd first output: the right half of a pair */
        *dst++ = (uint8_t)((3 * e[1] + e[2] + b_odd) >> shift);
        e++;
        n--;
    }
    pairs = n >> 1;
    for (k = 0; k < pairs; k++) {
        const int here = 3 * e[k + 1];
        dst[2 * k] = (uint8_t)((here + e[k] + b_even) >> shift);
        dst[2 * k + 1] = (uint8_t)((here + e[k + 2] + b_odd) >> shift);
    }
    if (n & 1) dst[n - 1] = (uint8_t)((3 * e[pairs + 1] + e[pairs] + b_even) >> shift);
}

/* Component ci's samples of output row y, columns [x0, x0 + n), upsampled as libjpeg-turbo
 * upsamples them, into dst (n bytes), or a pointer into the plane when no upsampling is
 * needed. tmp: n / 2 + 3 int16 values. Samples outside the image are the edge samples
 * repeated (the filter's taps at image edges), which gives libjpeg-turbo's special-cased
 * edge outputs. */
static const uint8_t* PXV(px_upsample_row)(const px_plan* p, const px_rect* r, int ci,
                                           const uint8_t* plane, int y, int x0, int n,
                                           uint8_t* dst, int16_t* tmp) {
    const int pw = r->pw[ci], sx0 = r->sx0[ci], sy0 = r->sy0[ci];
    const int dw = p->dw[ci], dh = p->dh[ci];
    const int c0 = x0 >> 1, c1 = (x0 + n - 1) >> 1, m = c1 - c0 + 1;
    int i;
    switch (p->up[ci]) {
    case PX_UP_FULL:
        return plane + (size_t)(y - sy0) * pw + (x0 - sx0);
    case PX_UP_PLAIN: {
        const int hr = p->hr[ci];
        const uint8_t* row = plane + (size_t)(y / p->vr[ci] - sy0) * pw - sx0;
        if (hr == 2) {
            const uint8_t* s = row + c0;
            uint8_t* d = dst;
            int left = n;
            if (x0 & 1) { *d++ = *s++; left--; }
            for (i = 0; i < left >> 1; i++) d[2 * i] = d[2 * i + 1] = s[i];
            if (left & 1) d[left - 1] = s[left >> 1];
        } else {
            for (i = 0; i < n; i++) dst[i] = row[(x0 + i) / hr];
        }
        return dst;
    }
    case PX_UP_H2V1: {
        const uint8_t* row = plane + (size_t)(y - sy0) * pw - sx0;
        for (i = 0; i < m; i++) tmp[i + 1] = row[c0 + i];
        tmp[0] = row[c0 > 0 ? c0 - 1 : 0];
        tmp[m + 1] = row[c1 + 1 < dw ? c1 + 1 : dw - 1];
        PXV(h2_filter)(tmp, x0, n, 1, 2, 2, dst);
        return dst;
    }
    case PX_UP_H1V2: {
        int s = y >> 1, odd = y & 1, bias = 1 + odd;
        int f = odd ? (s + 1 < dh ? s + 1 : dh - 1) : (s > 0 ? s - 1 : 0);
        const uint8_t* near = plane + (size_t)(s - sy0) * pw + (x0 - sx0);
        const uint8_t* far = plane + (size_t)(f - sy0) * pw + (x0 - sx0);
        for (i = 0; i < n; i++) dst[i] = (uint8_t)((3 * near[i] + far[i] + bias) >> 2);
        return dst;
    }
    default: {          /* PX_UP_H2V2: vertical sums first, then the filter along them */
        int s = y >> 1, odd = y & 1, lo, hi;
        int f = odd ? (s + 1 < dh ? s + 1 : dh - 1) : (s > 0 ? s - 1 : 0);
        const uint8_t* near = plane + (size_t)(s - sy0) * pw - sx0;
        const uint8_t* far = plane + (size_t)(f - sy0) * pw - sx0;
        int16_t* t;
        lo = c0 > 0 ? c0 - 1 : 0;
        hi = c1 + 1 < dw ? c1 + 1 : dw - 1;
        t = tmp + (lo - c0 + 1);
        near += lo;
        far += lo;
        for (i = 0; i <= hi - lo; i++) t[i] = (int16_t)(3 * near[i] + far[i]);
        if (c0 == 0) tmp[0] = tmp[1];
        if (c1 + 1 >= dw) tmp[m + 1] = tmp[m];
        PXV(h2_filter)(tmp, x0, n, 8, 7, 4, dst);
        return dst;
    }
    }
}

/* Three rows of 16 bytes into 16 interleaved pixels (48 bytes). */
PXI void PXV(interleave16)(const uint8_t* r, const uint8_t* g, const uint8_t* b, uint8_t* o) {
#if defined(__ARM_NEON)
    uint8x16x3_t v;
    v.val[0] = vld1q_u8(r);
    v.val[1] = vld1q_u8(g);
    v.val[2] = vld1q_u8(b);
    vst3q_u8(o, v);
#elif defined(__SSSE3__)
    __m128i vr = _mm_loadu_si128((const __m128i*)r), vg = _mm_loadu_si128((const __m128i*)g);
    __m128i vb = _mm_loadu_si128((const __m128i*)b);
    int part;
    for (part = 0; part < 3; part++) {
        const __m128i* m = (const __m128i*)px_ilv_mask[part];
        _mm_storeu_si128((__m128i*)(o + 16 * part),
                         _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(vr, _mm_load_si128(m)),
                                                   _mm_shuffle_epi8(vg, _mm_load_si128(m + 1))),
                                      _mm_shuffle_epi8(vb, _mm_load_si128(m + 2))));
    }
#else
    int i;
    for (i = 0; i < 16; i++) {
        o[3 * i] = r[i]; o[3 * i + 1] = g[i]; o[3 * i + 2] = b[i];
    }
#endif
}

/* YCbCr -> RGB of n pixels into planar rows: what px_rgb_row_ref's tables hold, y + (round(c
 * 2^16) x + 2^15) >> 16 clamped to [0, 255], in int32 lanes. */
PXI void PXV(ycc_planar)(const uint8_t* y, const uint8_t* cb, const uint8_t* cr, uint8_t* pr,
                         uint8_t* pg, uint8_t* pb, int n) {
    int x;
    for (x = 0; x < n; x++) {
        int32_t yy = y[x], b = cb[x] - 128, r = cr[x] - 128;
        int32_t vr = yy + ((91881 * r + PX_HALF) >> PX_SCALEBITS);
        int32_t vg = yy + ((-22554 * b - 46802 * r + PX_HALF) >> PX_SCALEBITS);
        int32_t vb = yy + ((116130 * b + PX_HALF) >> PX_SCALEBITS);
        pr[x] = (uint8_t)(vr < 0 ? 0 : vr > 255 ? 255 : vr);
        pg[x] = (uint8_t)(vg < 0 ? 0 : vg > 255 ? 255 : vg);
        pb[x] = (uint8_t)(vb < 0 ? 0 : vb > 255 ? 255 : vb);
    }
}

/* One output row of RGB (n pixels) from the upsampled component rows c (colour HP_GREY,
 * HP_RGB or HP_YCC), 16 pixels at a time. */
static void PXV(px_rgb_row)(int colour, const uint8_t* const* c, uint8_t* o, int n) {
    uint8_t pl[3][16];
    int x = 0, i;
    for (; x + 16 <= n; x += 16, o += 48) {
        if (colour == HP_GREY) {
            PXV(interleave16)(c[0] + x, c[0] + x, c[0] + x, o);
        } else if (colour == HP_RGB) {
            PXV(interleave16)(c[0] + x, c[1] + x, c[2] + x, o);
        } else {
            PXV(ycc_planar)(c[0] + x, c[1] + x, c[2] + x, pl[0], pl[1], pl[2], 16);
            PXV(interleave16)(pl[0], pl[1], pl[2], o);
        }
    }
    n -= x;
    if (colour == HP_YCC) {
        PXV(ycc_planar)(c[0] + x, c[1] + x, c[2] + x, pl[0], pl[1], pl[2], n);
        for (i = 0; i < n; i++) {
            o[3 * i] = pl[0][i]; o[3 * i + 1] = pl[1][i]; o[3 * i + 2] = pl[2][i];
        }
    } else {
        const uint8_t* g = c[colour == HP_GREY ? 0 : 1];
        const uint8_t* b = c[colour == HP_GREY ? 0 : 2];
        for (i = 0; i < n; i++) {
            o[3 * i] = c[0][x + i]; o[3 * i + 1] = g[x + i]; o[3 * i + 2] = b[x + i];
        }
    }
}

#undef PXI
