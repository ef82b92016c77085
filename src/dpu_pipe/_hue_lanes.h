/* v2's adjust_hue on uint8 (_rgb_to_hsv, hue + factor mod 1, _hsv_to_rgb, in float32) in
 * vector lanes, one pixel a lane: the channels R, G, B (0..255) in, the channels times `back`
 * out. Every branch of torchvision's formula is computed and selected, so each lane does its
 * float32 operations on its pixel; fmod(x, 1) is x - trunc(x), exact for the x > 0 it gets.
 *
 * _augment.pyx includes this file once per vector width, with DP_HUE_F / DP_HUE_I the float
 * and int vector types (4 lanes everywhere, 8 for the AVX2 build on x86-64),
 * DP_HUE_NAME(name) this instance's name, and optionally DP_HUE_FLOOR(x) / DP_HUE_TRUNC(x),
 * the target's exact floor and trunc instructions, and DP_HUE_MAX / DP_HUE_MIN. All of them
 * are undefined at the end, ready for the next include. */

#define DP_HSEL(m, x, y) ((DP_HUE_F)(((DP_HUE_I)(x) & (m)) | ((DP_HUE_I)(y) & ~(m))))
/* x > y ? x : y and x < y ? x : y lane by lane (x86's MAXPS and MINPS are exactly these, NaN
   and signed zeros included; NEON's FMAX and FMIN are not, so it keeps the select). */
#ifndef DP_HUE_MAX
#define DP_HUE_MAX(x, y) DP_HSEL((x) > (y), x, y)
#define DP_HUE_MIN(x, y) DP_HSEL((x) < (y), x, y)
#endif

/* *x = floor(*x), exact for |x| < 2**31: the includer's DP_HUE_FLOOR (one rounding
   instruction) where the target has one, else through the integer conversion. (Vectors pass
   through pointers: 32-byte values returned from functions built for 16-byte registers would
   change their ABI.) The arguments here are never -0, so either way gives the same bits. */
static inline __attribute__((always_inline)) void DP_HUE_NAME(dp_floor)(DP_HUE_F* x) {
#ifdef DP_HUE_FLOOR
    *x = DP_HUE_FLOOR(*x);
#else
    const DP_HUE_F zero = {0}, one = zero + 1.0f;
    DP_HUE_F t = __builtin_convertvector(__builtin_convertvector(*x, DP_HUE_I), DP_HUE_F);
    *x = t - DP_HSEL(t > *x, one, zero);
#endif
}

static inline __attribute__((always_inline)) void DP_HUE_NAME(dp_hue)(
        DP_HUE_F* R, DP_HUE_F* G, DP_HUE_F* B, float sc, float hf, float back) {
    const DP_HUE_F zero = {0}, one = zero + 1.0f;
    DP_HUE_F r = *R * sc, g = *G * sc, b = *B * sc;
    DP_HUE_F mx = DP_HUE_MAX(r, g);
    mx = DP_HUE_MAX(mx, b);
    DP_HUE_F mn = DP_HUE_MIN(r, g);
    mn = DP_HUE_MIN(mn, b);
    DP_HUE_I flat = mx == mn;
    DP_HUE_F cr = mx - mn;
    DP_HUE_F s = cr / DP_HSEL(flat, one, mx);
    cr = DP_HSEL(flat, one, cr);
    DP_HUE_F rc = (mx - r) / cr, gc = (mx - g) / cr, bc = (mx - b) / cr;
    DP_HUE_F hh = DP_HSEL(mx != r, DP_HSEL(mx == g, (rc + 2.0f) - bc, (gc + 4.0f) - rc), bc - gc);
    hh = hh * (float)(1.0 / 6.0) + 1.0f;
#ifdef DP_HUE_TRUNC
    hh = hh - DP_HUE_TRUNC(hh);
#else
    hh = hh - __builtin_convertvector(__builtin_convertvector(hh, DP_HUE_I), DP_HUE_F);
#endif
    hh = hh + hf;
    DP_HUE_F fh = hh;
    DP_HUE_NAME(dp_floor)(&fh);
    hh = hh - fh;
    DP_HUE_F h6 = hh * 6.0f;
    DP_HUE_F fl = h6;
    DP_HUE_NAME(dp_floor)(&fl);
    DP_HUE_I k = __builtin_convertvector(fl, DP_HUE_I);
    DP_HUE_F f = h6 - fl;
    DP_HUE_F sxf = s * f, oms = 1.0f - s;
    DP_HUE_F q = (1.0f - sxf) * mx, t = (sxf + oms) * mx, p = oms * mx;
    q = DP_HUE_MAX(q, zero);
    q = DP_HUE_MIN(q, one);
    t = DP_HUE_MAX(t, zero);
    t = DP_HUE_MIN(t, one);
    p = DP_HUE_MAX(p, zero);
    p = DP_HUE_MIN(p, one);
    k = k - ((k >= 6) & 6);         /* h6 rounds up to 6.0 just below hue 1 */
    DP_HUE_I k0 = k == 0, k1 = k == 1, k2 = k == 2, k3 = k == 3, k4 = k == 4;
    DP_HUE_F o0 = DP_HSEL(k0, mx, DP_HSEL(k1, q, DP_HSEL(k2 | k3, p, DP_HSEL(k4, t, mx))));
    DP_HUE_F o1 = DP_HSEL(k0, t, DP_HSEL(k1 | k2, mx, DP_HSEL(k3, q, p)));
    DP_HUE_F o2 = DP_HSEL(k0 | k1, p, DP_HSEL(k2, t, DP_HSEL(k3 | k4, mx, q)));
    *R = o0 * back;
    *G = o1 * back;
    *B = o2 * back;
}

#undef DP_HSEL
#undef DP_HUE_F
#undef DP_HUE_I
#undef DP_HUE_NAME
#undef DP_HUE_FLOOR
#undef DP_HUE_TRUNC
#undef DP_HUE_MAX
#undef DP_HUE_MIN
