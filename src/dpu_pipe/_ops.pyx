# Per-image transform kernel: antialiased bilinear or bicubic resampling of a source box
# (Pillow's filters, in float32), horizontal flip, dtype conversion, normalization and layout,
# written straight into the caller's sample buffer. Contract in _ops.pxd; dpu_pipe/ops.py is
# the Python face; the Gaussian blur's passes are in _blur.h.
#
# ops_run, per output row (pass order OPS_H_FIRST): source rows are converted to float32 and
# resampled horizontally on demand into a ring buffer (each needed row once, in order); the
# vertical pass sums the ring rows, its last one or two taps inside the loop that converts the
# sum into the output row. Rows are planar (R, G, B) for CHW output and interleaved for HWC, so
# every loop runs over contiguous memory, which GCC vectorizes. When the box shrinks
# vertically, OPS_V_FIRST is cheaper: the vertical taps are summed straight from the uint8
# source rows, then the horizontal pass runs on oh rows (for float32 CHW it also converts).
# ops_plan picks the order from the sizes only. The inner loops are C (_resample.h).
#
# Bit-identical everywhere (docs/design/determinism.md): the tables use only IEEE + - * / and
# ceil on doubles, in Pillow's order; the passes float32 in a fixed order (literals cast to
# float), SIMD across output elements only, no FMA. Unlike Pillow, which rounds coefficients
# to 22-bit fixed point and the intermediate image to uint8, both stay float32 here: closer to
# the exact filter (the tests bound the difference to Pillow at one level of 255).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int32_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy
from libc.math cimport ceil, rint

from dpu_pipe._rng cimport portable_exp

from dpu_pipe.errors import ConfigError

cdef extern from "_resample.h":
    # The inner loops of both passes and of the uint8 rounding, compiled for AVX2 as well
    # on x86-64 (same bits).
    void ops_h_interleaved(const float* buf, const int32_t* start, const float* w4,
                           Py_ssize_t n_pad, Py_ssize_t lo, Py_ssize_t K,
                           float* dst) noexcept nogil
    void ops_h_planar(const float* buf, const int32_t* start, const float* w4,
                      Py_ssize_t n_pad, Py_ssize_t lo, Py_ssize_t K, float* dst,
                      Py_ssize_t plane) noexcept nogil
    void ops_h_planar_affine(const float* buf, const int32_t* start, const float* w4,
                             Py_ssize_t n_pad, Py_ssize_t lo, Py_ssize_t K, float* dst,
                             Py_ssize_t plane, const float* affine) noexcept nogil
    void ops_v_row_u8(const uint8_t* s, Py_ssize_t stride, const float* k, Py_ssize_t taps,
                      float* d, Py_ssize_t n) noexcept nogil
    void ops_fin_u8(const float* a, const float* r0, const float* r1, float w0, float w1,
                    uint8_t* out, Py_ssize_t n, int ones) noexcept nogil
    Py_ssize_t OPS_HW4_AT(Py_ssize_t i, Py_ssize_t t, Py_ssize_t K) noexcept nogil

    ctypedef float* ops_f32_rp
    ctypedef const float* ops_cf32_rp
    ctypedef const uint8_t* ops_cu8_rp
    ctypedef uint16_t* ops_u16_rp

cdef extern from "_blur.h":
    size_t blur_scratch_floats(Py_ssize_t w, int kx, int ky) noexcept nogil
    int blur_rgb_u8(const uint8_t* src, Py_ssize_t src_stride, int h, int w, uint8_t* dst,
                    Py_ssize_t dst_stride, const float* wx, int kx, const float* wy, int ky,
                    float* scratch) noexcept nogil


DTYPE_CODES = {"float32": OPS_FLOAT32, "uint8": OPS_UINT8, "float16": OPS_FLOAT16,
               "bfloat16": OPS_BFLOAT16}
LAYOUT_CODES = {"CHW": OPS_CHW, "HWC": OPS_HWC}
FILTER_CODES = {"bilinear": OPS_BILINEAR, "bicubic": OPS_BICUBIC}
BOX_SLACK = OPS_BOX_SLACK


# --- workspace ------------------------------------------------------------------------------

cdef inline size_t _align64(size_t n) noexcept nogil:
    return (n + 63) & ~(<size_t>63)


cdef void ops_ws_init(OpsWorkspace* ws) noexcept nogil:
    ws.raw = NULL
    ws.mem = NULL
    ws.cap = 0


cdef void ops_ws_free(OpsWorkspace* ws) noexcept nogil:
    free(ws.raw)
    ops_ws_init(ws)


cdef int ops_ws_reserve(OpsWorkspace* ws, size_t nbytes) noexcept nogil:
    """Make ws hold at least nbytes (64-byte aligned). Contents are not kept when it grows."""
    cdef void* raw
    if nbytes <= ws.cap:
        return OPS_OK
    # Grow geometrically so that a stream of slowly growing boxes allocates O(log n) times.
    if nbytes < ws.cap + ws.cap // 2:
        nbytes = ws.cap + ws.cap // 2
    raw = malloc(nbytes + 64)
    if raw == NULL:
        return OPS_ENOMEM
    free(ws.raw)
    ws.raw = raw
    ws.mem = <char*>_align64(<uintptr_t>raw)
    ws.cap = nbytes
    return OPS_OK


cdef inline double _support(double length, int n_out, int filt) noexcept nogil:
    """Pillow's filter support in source pixels: at scale 1 (triangle 1, its bicubic 2) times
    max(scale, 1)."""
    cdef double scale = length / n_out
    return (scale if scale > 1.0 else 1.0) * (2.0 if filt == OPS_BICUBIC else 1.0)


cdef inline int _ksize(double length, int n_out, int filt) noexcept nogil:
    """Pillow's bound on taps per output: 2*ceil(support) + 1."""
    return <int>ceil(_support(length, n_out, filt)) * 2 + 1


cdef inline int _span_bound(int src_w, double w, int ow, int filt) noexcept nogil:
    """Upper bound on the source columns one row's outputs read: the first window starts at
    most 1 + support - scale/2 left of x0 (truncation), the last ends at most as far right of
    x0 + w, so the span is below w + 2 support + 1."""
    cdef double b = w + 2.0 * _support(w, ow, filt) + 3.0
    return src_w if b >= src_w else <int>b


cdef inline Py_ssize_t _pad4(Py_ssize_t n) noexcept nogil:
    return (n + 3) & ~(<Py_ssize_t>3)


cdef inline Py_ssize_t _rstride(int ow) noexcept nogil:
    # Room for 3 * _pad4(ow) floats plus the spare lane an interleaved store writes past them.
    return ((3 * _pad4(ow) + 4 + 15) // 16) * 16


cdef inline void* _take(uintptr_t m, size_t* n, size_t nbytes) noexcept nogil:
    cdef void* at = <void*>(m + n[0])
    n[0] += _align64(nbytes)
    return at


cdef size_t _layout(OpsPlan* p, uintptr_t m, size_t oh, size_t ow, size_t kh, size_t kv,
                    size_t span) noexcept nogil:
    """Point p's tables and rows into the workspace at m (64-byte aligned) for kh, kv taps
    and a source span of `span` pixels; returns the bytes they take."""
    cdef size_t ow4 = _pad4(ow), rs = _rstride(ow), n = 0
    p.h.start = <int32_t*>_take(m, &n, 4 * ow4)
    p.h.count = <int32_t*>_take(m, &n, 4 * ow4)
    p.h.weight = <float*>_take(m, &n, 4 * ow4 * kh)
    p.hw4 = <float*>_take(m, &n, 16 * ow4 * kh)
    p.v.start = <int32_t*>_take(m, &n, 4 * oh)
    p.v.count = <int32_t*>_take(m, &n, 4 * oh)
    p.v.weight = <float*>_take(m, &n, 4 * oh * kv)
    p.src_row = <float*>_take(m, &n, 4 * (3 * (span + kh) + 4))
    p.scale3 = <float*>_take(m, &n, 4 * 3 * ow)
    p.bias3 = <float*>_take(m, &n, 4 * 3 * ow)
    p.ring = <float*>_take(m, &n, 4 * rs * kv)
    p.acc = <float*>_take(m, &n, 4 * rs)
    p.zero = <float*>_take(m, &n, 4 * rs)
    p.tmp = <float*>_take(m, &n, 4 * rs)
    p.rstride = rs
    return n


cdef size_t ops_workspace_bytes(int src_w, double h, double w, int oh, int ow,
                               int filt) noexcept nogil:
    """Bytes of workspace ops_plan needs for this source width (pixels), box size (h, w, in
    source pixels) and output size (oh, ow); 0 if the sizes are invalid. Lets a caller
    preallocate for its largest box with ops_ws_reserve."""
    cdef OpsPlan p
    if src_w < 1 or oh < 1 or ow < 1 or not (h > 0.0 and w > 0.0 and w <= src_w):
        return 0
    if filt != OPS_BILINEAR and filt != OPS_BICUBIC:
        return 0
    return _layout(&p, 0, oh, ow, _ksize(w, ow, filt), _ksize(h, oh, filt),
                   _span_bound(src_w, w, ow, filt))


# --- coefficient tables ---------------------------------------------------------------------

cdef inline double _triangle(double x) noexcept nogil:
    if x < 0.0:
        x = -x
    if x < 1.0:
        return 1.0 - x
    return 0.0


cdef inline double _bicubic(double x) noexcept nogil:
    # Pillow's bicubic (Keys, a = -0.5), the filter torchvision's antialiased bicubic uses too.
    cdef double a = -0.5
    if x < 0.0:
        x = -x
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return 0.0


cdef inline double _filter(int filt, double x) noexcept nogil:
    return _bicubic(x) if filt == OPS_BICUBIC else _triangle(x)


cdef int _plan_axis(OpsAxis* ax, int in_size, double in0, double length, int n_out, int n_pad,
                    int flip, int filt) noexcept nogil:
    """Fill ax (start/count/weight point at storage for n_pad entries of _ksize() weights) the
    way Pillow's precompute_coeffs does for box [in0, in0 + length) of an axis of in_size
    pixels, in double precision; trim zero-weight taps at both ends (bit-exact: they add +0);
    repack the weights in rows of max_taps, zero-padded after count[i]; entries n_out..n_pad-1
    repeat the last one (padding the horizontal pass computes and never uses)."""
    cdef double scale = length / n_out
    cdef double filterscale = scale if scale > 1.0 else 1.0
    cdef double support = _support(length, n_out, filt)
    cdef double ss = 1.0 / filterscale
    cdef double center, ww, wt
    cdef int i, xx, x, xmin, xmax, first, last, n
    cdef Py_ssize_t t, K, bound = _ksize(length, n_out, filt)
    cdef float* k
    ax.n_out = n_out
    ax.n_pad = n_pad
    ax.max_taps = 0
    ax.src_lo = in_size
    ax.src_hi = 0
    for i in range(n_out):
        # A flipped axis stores output n_out-1-i at i, so the pass writes mirrored rows in
        # forward order; each output's own taps stay in ascending source order, which makes
        # a flipped result bit-identical to the mirrored unflipped one.
        xx = n_out - 1 - i if flip else i
        center = in0 + (xx + 0.5) * scale
        xmin = <int>(center - support + 0.5)   # truncation toward zero, as in Pillow
        if xmin < 0:
            xmin = 0
        xmax = <int>(center + support + 0.5)
        if xmax > in_size:
            xmax = in_size
        n = xmax - xmin
        ww = 0.0
        first = -1
        last = -1
        for x in range(n):
            wt = _filter(filt, (x + xmin - center + 0.5) * ss)
            ww = ww + wt
            if wt != 0.0:
                if first < 0:
                    first = x
                last = x
        if first < 0:
            return OPS_EINTERNAL
        if filt == OPS_BICUBIC:
            # Bicubic is exactly 0 at distances 1 and 2: an output centred on a source pixel
            # would trim to one tap, and the windows would then move backwards, which the
            # vertical ring cannot follow. The whole window is kept: the extra taps weigh
            # +0.0 and leave every sum's bits as they were.
            first = 0
            last = n - 1
        k = ax.weight + i * bound
        for x in range(first, last + 1):
            # Recomputed rather than stored: the same double expression gives the same bits.
            wt = _filter(filt, (x + xmin - center + 0.5) * ss)
            k[x - first] = <float>(wt / ww)
        ax.start[i] = xmin + first
        ax.count[i] = last - first + 1
        if ax.count[i] > ax.max_taps:
            ax.max_taps = ax.count[i]
        if ax.start[i] < ax.src_lo:
            ax.src_lo = ax.start[i]
        if ax.start[i] + ax.count[i] > ax.src_hi:
            ax.src_hi = ax.start[i] + ax.count[i]
    # Repack in place: row i moves from i*bound down to i*K, never over a row not yet moved.
    K = ax.max_taps
    ax.ksize = <int>K
    for i in range(n_out):
        for t in range(K):
            ax.weight[i * K + t] = ax.weight[i * bound + t] if t < ax.count[i] else <float>0.0
    for i in range(n_out, n_pad):
        ax.start[i] = ax.start[n_out - 1]
        ax.count[i] = ax.count[n_out - 1]
        for t in range(K):
            ax.weight[i * K + t] = ax.weight[(n_out - 1) * K + t]
    return OPS_OK


cdef int _choose_order(const OpsAxis* h, const OpsAxis* v) noexcept nogil:
    """The cheaper pass order by an estimate of the work of each, in integers (so the choice,
    and with it the bits of the result, depend on the sizes only). Units: tenths of an
    instruction, per element (float) or pixel (4-lane vector) and tap, from instruction counts
    of the passes on x86-64 (float32 CHW output)."""
    cdef int64_t rows = v.src_hi - v.src_lo
    cdef int64_t span3 = 3 * <int64_t>(h.src_hi - h.src_lo)
    cdef int64_t hwork = <int64_t>h.n_pad * h.ksize         # pixel-taps per row
    cdef int64_t taps = 0, extra = 0
    cdef int i
    for i in range(v.n_out):
        taps += v.count[i]
        if v.count[i] > 2:
            extra += v.count[i] - 2
    cdef int64_t cost_h = (rows * (span3 * 15 + hwork * 50)
                           + 3 * <int64_t>h.n_pad * (extra * 37 + <int64_t>v.n_out * 17))
    cdef int64_t cost_v = span3 * taps * 14 + <int64_t>v.n_out * hwork * 44
    return OPS_V_FIRST if cost_v < cost_h else OPS_H_FIRST


cdef int ops_plan(OpsPlan* p, OpsWorkspace* ws, int src_h, int src_w,
                  double y0, double x0, double h, double w,
                  int oh, int ow, int flip, int filt) noexcept nogil:
    """Tables for resampling box (y0, x0, h, w) — source pixels, fractional, inside the
    src_h x src_w image (OPS_BOX_SLACK of overshoot is clamped) — to oh x ow, mirrored
    left-right if flip. Pointers in p refer to ws: they stay valid until ws is reserved again
    or freed (the next ops_plan on ws)."""
    cdef int rc
    cdef Py_ssize_t i, t, c, K
    cdef size_t kh, kv, span
    if src_h < 1 or src_w < 1 or oh < 1 or ow < 1:
        return OPS_EARG
    if filt != OPS_BILINEAR and filt != OPS_BICUBIC:
        return OPS_EARG
    # A box scaled into a DCT-scaled region can overshoot its edges by rounding; up to
    # OPS_BOX_SLACK pixels is clamped, more is an error. Written so that NaN fails every test.
    if not (y0 >= -OPS_BOX_SLACK and x0 >= -OPS_BOX_SLACK and h > 0.0 and w > 0.0
            and y0 + h <= src_h + OPS_BOX_SLACK and x0 + w <= src_w + OPS_BOX_SLACK):
        return OPS_EARG
    if y0 < 0.0:
        h = h + y0
        y0 = 0.0
    if x0 < 0.0:
        w = w + x0
        x0 = 0.0
    if y0 + h > src_h:
        h = src_h - y0
    if x0 + w > src_w:
        w = src_w - x0
    if not (h > 0.0 and w > 0.0):
        return OPS_EARG
    rc = ops_ws_reserve(ws, ops_workspace_bytes(src_w, h, w, oh, ow, filt))
    if rc != OPS_OK:
        return rc
    kh = _ksize(w, ow, filt)
    kv = _ksize(h, oh, filt)
    span = _span_bound(src_w, w, ow, filt)
    _layout(p, <uintptr_t>ws.mem, oh, ow, kh, kv, span)
    p.src_h = src_h
    p.src_w = src_w
    rc = _plan_axis(&p.h, src_w, x0, w, ow, <int>_pad4(ow), flip, filt)
    if rc != OPS_OK:
        return rc
    rc = _plan_axis(&p.v, src_h, y0, h, oh, oh, 0, filt)
    if rc != OPS_OK:
        return rc
    if <size_t>(p.h.src_hi - p.h.src_lo) > span or <size_t>p.v.max_taps > kv:
        return OPS_EINTERNAL
    # The ring buffer in ops_run relies on row windows that only move forward.
    for i in range(1, oh):
        if (p.v.start[i] < p.v.start[i - 1]
                or p.v.start[i] + p.v.count[i] < p.v.start[i - 1] + p.v.count[i - 1]):
            return OPS_EINTERNAL
    # Each horizontal weight four times over: the pass loads it as a vector instead of
    # broadcasting a scalar at every tap. Laid out per pair of output pixels (OPS_HW4_AT):
    # tap t of both pixels of a pair is one run of 8 floats.
    K = p.h.ksize
    for i in range(p.h.n_pad):
        for t in range(K):
            for c in range(4):
                p.hw4[OPS_HW4_AT(i, t, K) + c] = p.h.weight[i * K + t]
    p.order = _choose_order(&p.h, &p.v)
    for i in range(p.rstride):
        p.zero[i] = 0.0
    # Zero-padded taps and the spare lane read past the converted span: keep that zero.
    for i in range(3 * (p.h.src_hi - p.h.src_lo), 3 * (p.h.src_hi - p.h.src_lo + p.h.ksize) + 4):
        p.src_row[i] = 0.0
    return OPS_OK


# --- horizontal pass ------------------------------------------------------------------------

cdef inline void _u8_to_f32(ops_cu8_rp s, ops_f32_rp d, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        d[i] = <float>s[i]


cdef void _h_row_f32_chw(const OpsAxis* ax, const float* w4, const float* buf, float* out,
                         Py_ssize_t plane, const float* aff, float* tmp) noexcept nogil:
    """Horizontal pass of one vertically summed row straight into output row `out` of a
    float32 CHW sample (planes `plane` floats apart), converted. The last group of four pixels,
    when ow is not a multiple of 4, goes through tmp: a direct store would run past the row."""
    cdef Py_ssize_t K = ax.ksize, ow = ax.n_out, lo = ax.src_lo
    cdef Py_ssize_t n = ow & ~(<Py_ssize_t>3), j, c
    if n > 0:
        ops_h_planar_affine(buf, ax.start, w4, n, lo, K, out, plane, aff)
    if n < ow:
        ops_h_planar_affine(buf, ax.start + n, w4 + 4 * n * K, 4, lo, K, tmp, 4, aff)
        for c in range(3):
            for j in range(ow - n):
                out[c * plane + n + j] = tmp[4 * c + j]


cdef inline void _h_row(const OpsPlan* p, const uint8_t* src_row, float* dst,
                        int planar) noexcept nogil:
    """One source row -> n_pad resampled pixels at dst: planes of n_pad floats (R, G, B) if
    planar, else interleaved RGB (plus one spare float)."""
    # Converting the used span once is cheaper than widening bytes at every tap: each source
    # pixel feeds about two outputs (more when upscaling).
    _u8_to_f32(src_row + 3 * p.h.src_lo, p.src_row, 3 * (p.h.src_hi - p.h.src_lo))
    if planar:
        ops_h_planar(p.src_row, p.h.start, p.hw4, p.h.n_pad, p.h.src_lo, p.h.ksize, dst,
                     p.h.n_pad)
    else:
        ops_h_interleaved(p.src_row, p.h.start, p.hw4, p.h.n_pad, p.h.src_lo, p.h.ksize, dst)


# --- vertical pass --------------------------------------------------------------------------

cdef inline void _v_set2(ops_f32_rp acc, ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1,
                         Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        acc[i] = w0 * r0[i] + w1 * r1[i]


cdef inline void _v_add2(ops_f32_rp acc, ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1,
                         Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        acc[i] = (acc[i] + w0 * r0[i]) + w1 * r1[i]


# --- output conversion ----------------------------------------------------------------------
# The float16 and bfloat16 conversions (_to_f16, ops_f16c_convert, _to_bf16) are in _ops.pxd.

# The conversion loops also finish the vertical pass: value = (a + w0 * r0) + w1 * r1, the
# last one or two taps of the sum (w1 = 0 when one is left; a = zeros when the sum has at most
# two taps; both add an exact +0.0). That saves a pass over the accumulator row.

cdef inline void _fin_f32(ops_cf32_rp a, ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1,
                          ops_f32_rp o, Py_ssize_t n, float s, float b) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        o[i] = ((a[i] + w0 * r0[i]) + w1 * r1[i]) * s + b


cdef inline void _fin2_f32(ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1, ops_f32_rp o,
                           Py_ssize_t n, float s, float b) noexcept nogil:
    # _fin_f32 for a sum of at most two taps (a = zeros): 0 + x is x for the x >= +0 here.
    cdef Py_ssize_t i
    for i in range(n):
        o[i] = (w0 * r0[i] + w1 * r1[i]) * s + b


cdef inline void _fin_f16(ops_cf32_rp a, ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1,
                          ops_u16_rp o, Py_ssize_t n, float s, float b) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        o[i] = _to_f16(((a[i] + w0 * r0[i]) + w1 * r1[i]) * s + b)


cdef inline void _fin_bf16(ops_cf32_rp a, ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1,
                           ops_u16_rp o, Py_ssize_t n, float s, float b) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        o[i] = _to_bf16(((a[i] + w0 * r0[i]) + w1 * r1[i]) * s + b)


cdef inline void _fin3_f32(ops_cf32_rp a, ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1,
                           ops_f32_rp o, Py_ssize_t n, ops_cf32_rp s,
                           ops_cf32_rp b) noexcept nogil:
    # s, b repeat the three channels' constants per pixel: an elementwise loop vectorizes on
    # every target, a stride-3 one does not on SSE2.
    cdef Py_ssize_t i
    for i in range(n):
        o[i] = ((a[i] + w0 * r0[i]) + w1 * r1[i]) * s[i] + b[i]


cdef inline void _fin32_f32(ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1,
                            ops_f32_rp o, Py_ssize_t n, ops_cf32_rp s,
                            ops_cf32_rp b) noexcept nogil:
    # _fin3_f32 for a sum of at most two taps, as _fin2_f32.
    cdef Py_ssize_t i
    for i in range(n):
        o[i] = (w0 * r0[i] + w1 * r1[i]) * s[i] + b[i]


cdef inline void _fin3_f16(ops_cf32_rp a, ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1,
                           ops_u16_rp o, Py_ssize_t n, ops_cf32_rp s,
                           ops_cf32_rp b) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        o[i] = _to_f16(((a[i] + w0 * r0[i]) + w1 * r1[i]) * s[i] + b[i])


cdef inline void _fin3_bf16(ops_cf32_rp a, ops_cf32_rp r0, ops_cf32_rp r1, float w0, float w1,
                            ops_u16_rp o, Py_ssize_t n, ops_cf32_rp s,
                            ops_cf32_rp b) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        o[i] = _to_bf16(((a[i] + w0 * r0[i]) + w1 * r1[i]) * s[i] + b[i])


cdef void _finish_row(const OpsPlan* p, const OpsOutput* c, const float* a, const float* r0,
                      const float* r1, float w0, float w1, void* out, Py_ssize_t i,
                      int f16c) noexcept nogil:
    """Last vertical taps and conversion of output row i; a, r0, r1 are planar rows (R, G, B
    planes of h.n_pad floats) for CHW and interleaved rows for HWC. f16c: convert float16
    with the F16C instructions (x86) instead of _to_f16."""
    cdef Py_ssize_t oh = p.v.n_out, ow = p.h.n_out, n4 = p.h.n_pad, ch, off
    cdef Py_ssize_t plane = oh * ow
    # The value is r0 itself: the uint8 rounding can skip the sum.
    cdef int ones = a == p.zero and w0 == <float>1.0 and w1 == <float>0.0
    if c.layout == OPS_CHW:
        for ch in range(3):
            off = ch * n4
            if c.dtype == OPS_FLOAT32 and a == p.zero:
                _fin2_f32(r0 + off, r1 + off, w0, w1, <float*>out + ch * plane + i * ow, ow,
                          c.scale[ch], c.bias[ch])
            elif c.dtype == OPS_FLOAT32:
                _fin_f32(a + off, r0 + off, r1 + off, w0, w1,
                         <float*>out + ch * plane + i * ow, ow, c.scale[ch], c.bias[ch])
            elif c.dtype == OPS_UINT8:
                ops_fin_u8(a + off, r0 + off, r1 + off, w0, w1,
                           <uint8_t*>out + ch * plane + i * ow, ow, ones)
            elif c.dtype == OPS_BFLOAT16:
                _fin_bf16(a + off, r0 + off, r1 + off, w0, w1,
                          <uint16_t*>out + ch * plane + i * ow, ow, c.scale[ch], c.bias[ch])
            elif f16c:
                _fin_f32(a + off, r0 + off, r1 + off, w0, w1, p.tmp, ow, c.scale[ch],
                         c.bias[ch])
                ops_f16c_convert(p.tmp, <uint16_t*>out + ch * plane + i * ow, ow)
            else:
                _fin_f16(a + off, r0 + off, r1 + off, w0, w1,
                         <uint16_t*>out + ch * plane + i * ow, ow, c.scale[ch], c.bias[ch])
    else:
        if c.dtype == OPS_FLOAT32 and a == p.zero:
            _fin32_f32(r0, r1, w0, w1, <float*>out + i * 3 * ow, 3 * ow, p.scale3, p.bias3)
        elif c.dtype == OPS_FLOAT32:
            _fin3_f32(a, r0, r1, w0, w1, <float*>out + i * 3 * ow, 3 * ow, p.scale3, p.bias3)
        elif c.dtype == OPS_UINT8:
            ops_fin_u8(a, r0, r1, w0, w1, <uint8_t*>out + i * 3 * ow, 3 * ow, ones)
        elif c.dtype == OPS_BFLOAT16:
            _fin3_bf16(a, r0, r1, w0, w1, <uint16_t*>out + i * 3 * ow, 3 * ow,
                       p.scale3, p.bias3)
        elif f16c:
            _fin3_f32(a, r0, r1, w0, w1, p.tmp, 3 * ow, p.scale3, p.bias3)
            ops_f16c_convert(p.tmp, <uint16_t*>out + i * 3 * ow, 3 * ow)
        else:
            _fin3_f16(a, r0, r1, w0, w1, <uint16_t*>out + i * 3 * ow, 3 * ow,
                      p.scale3, p.bias3)


# --- public C API ---------------------------------------------------------------------------

cdef int ops_output_init(OpsOutput* o, int dtype, int layout,
                         const double* mean, const double* std) noexcept nogil:
    """Output spec. mean/std: 3 doubles each, on the 0..1 scale (ImageNet convention); used for
    float32/float16/bfloat16 (value*scale + bias with scale = 1/(255 std), bias = -mean/std, both
    rounded once to float32), ignored for uint8 (may be NULL then)."""
    cdef int c
    if dtype != OPS_FLOAT32 and dtype != OPS_UINT8 and dtype != OPS_FLOAT16 \
            and dtype != OPS_BFLOAT16:
        return OPS_EARG
    if layout != OPS_CHW and layout != OPS_HWC:
        return OPS_EARG
    o.dtype = dtype
    o.layout = layout
    for c in range(3):
        o.scale[c] = 1.0
        o.bias[c] = 0.0
    if dtype == OPS_UINT8:
        return OPS_OK
    if mean == NULL or std == NULL:
        return OPS_EARG
    for c in range(3):
        if not (std[c] > 0.0 and std[c] < 1e300 and mean[c] == mean[c]
                and -1e300 < mean[c] < 1e300):
            return OPS_EARG
        o.scale[c] = <float>(1.0 / (255.0 * std[c]))
        o.bias[c] = <float>(-mean[c] / std[c])
    return OPS_OK


cdef int ops_run(const OpsPlan* p, const uint8_t* src, Py_ssize_t src_stride,
                 const OpsOutput* o, void* out) noexcept nogil:
    """Resample per plan p from src (uint8 RGB, the src_h x src_w image of ops_plan; rows
    src_stride bytes apart, pixels 3 bytes apart) into out: one sample of o.dtype, laid out
    (3, oh, ow) for OPS_CHW or (oh, ow, 3) for OPS_HWC, contiguous."""
    cdef Py_ssize_t oh = p.v.n_out, ow = p.h.n_out
    cdef Py_ssize_t n3 = 3 * p.h.n_pad, rs = p.rstride, R = p.v.max_taps
    cdef Py_ssize_t i, t, a, n, r, next_row
    cdef int planar = o.layout == OPS_CHW
    cdef int f16c = o.dtype == OPS_FLOAT16 and ops_have_f16c()
    cdef const float* k
    cdef const float* base
    cdef const float* r0
    cdef float* acc = p.acc
    cdef float* ring = p.ring
    cdef float aff[6]
    if o.dtype != OPS_FLOAT32 and o.dtype != OPS_UINT8 and o.dtype != OPS_FLOAT16 \
            and o.dtype != OPS_BFLOAT16:
        return OPS_EARG
    if o.layout != OPS_CHW and o.layout != OPS_HWC:
        return OPS_EARG
    if not planar:
        for i in range(3 * ow):
            p.scale3[i] = o.scale[i % 3]
            p.bias3[i] = o.bias[i % 3]
    if p.order == OPS_V_FIRST:
        for i in range(3):
            aff[i] = o.scale[i]
            aff[3 + i] = o.bias[i]
        # Each output row: the vertical sum over the source span (into src_row, whose zero
        # tail the plan keeps), resampled horizontally into the first ring row, converted.
        for i in range(oh):
            ops_v_row_u8(src + p.v.start[i] * src_stride + 3 * p.h.src_lo, src_stride,
                         p.v.weight + i * p.v.ksize, p.v.count[i], p.src_row,
                         3 * (p.h.src_hi - p.h.src_lo))
            if planar and o.dtype == OPS_FLOAT32:
                _h_row_f32_chw(&p.h, p.hw4, p.src_row, <float*>out + i * ow, oh * ow, aff,
                               ring)
                continue
            if planar:
                ops_h_planar(p.src_row, p.h.start, p.hw4, p.h.n_pad, p.h.src_lo, p.h.ksize,
                             ring, p.h.n_pad)
            else:
                ops_h_interleaved(p.src_row, p.h.start, p.hw4, p.h.n_pad, p.h.src_lo,
                                  p.h.ksize, ring)
            _finish_row(p, o, p.zero, ring, ring, <float>1.0, <float>0.0, out, i, f16c)
        return OPS_OK
    next_row = 0
    for i in range(oh):
        a = p.v.start[i]
        n = p.v.count[i]
        # Horizontal pass on demand: row r lives in ring slot r % R until R newer rows
        # replace it; windows only move forward and hold at most R rows.
        r = next_row if next_row > a else a
        while r < a + n:
            _h_row(p, src + r * src_stride, ring + (r % R) * rs, planar)
            r += 1
        next_row = r
        # Vertical pass: taps in ascending row order, two at a time to halve acc traffic; the
        # last one or two are summed by _finish_row.
        k = p.v.weight + i * p.v.ksize
        base = p.zero
        t = 0
        if n > 2:
            _v_set2(acc, ring + (a % R) * rs, ring + ((a + 1) % R) * rs, k[0], k[1], n3)
            t = 2
            while n - t > 2:
                _v_add2(acc, ring + ((a + t) % R) * rs, ring + ((a + t + 1) % R) * rs,
                        k[t], k[t + 1], n3)
                t += 2
            base = acc
        r0 = ring + ((a + t) % R) * rs
        if n - t == 2:
            _finish_row(p, o, base, r0, ring + ((a + t + 1) % R) * rs, k[t], k[t + 1], out, i,
                        f16c)
        else:
            _finish_row(p, o, base, r0, r0, k[t], <float>0.0, out, i, f16c)
    return OPS_OK


cdef int ops_resize_crop(OpsWorkspace* ws, const uint8_t* src, Py_ssize_t src_stride,
                         int src_h, int src_w, double y0, double x0, double h, double w,
                         int oh, int ow, int flip, int filt, const OpsOutput* o,
                         void* out) noexcept nogil:
    """ops_plan then ops_run: the whole per-sample transform in one call."""
    cdef OpsPlan p
    cdef int rc = ops_plan(&p, ws, src_h, src_w, y0, x0, h, w, oh, ow, flip, filt)
    if rc != OPS_OK:
        return rc
    return ops_run(&p, src, src_stride, o, out)


cdef int ops_center_crop_box(int height, int width, int size_h, int size_w, int resize,
                             double* box) noexcept nogil:
    """Validation transform as a source box: torchvision's Resize(resize) (shorter side to
    resize, longer side int(resize * long / short)) then CenterCrop((size_h, size_w)) (offset
    round-half-even of half the excess). box receives (y0, x0, h, w) in source pixels of the
    height x width image; resampling that box to (size_h, size_w) equals resizing the whole
    image and cropping, because Pillow's filter centres and support depend only on the scale.
    When the crop is larger than the resized image (a non-square crop on an image of another
    aspect), torchvision pads with zeros; here the image is instead scaled just enough to
    cover the crop, so every image gives a full sample."""
    cdef int64_t nh, nw
    cdef double sy, sx, cover
    if height < 1 or width < 1 or size_h < 1 or size_w < 1 or resize < 1:
        return OPS_EARG
    if width <= height:
        nw = resize
        nh = <int64_t>(<double>(<int64_t>resize * height) / width)
    else:
        nh = resize
        nw = <int64_t>(<double>(<int64_t>resize * width) / height)
    if size_h > nh or size_w > nw:
        cover = <double>size_h / height
        if <double>size_w / width > cover:
            cover = <double>size_w / width
        nh = <int64_t>(height * cover)
        nw = <int64_t>(width * cover)
        nh = nh if nh > size_h else size_h
        nw = nw if nw > size_w else size_w
    sy = <double>height / nh
    sx = <double>width / nw
    box[0] = rint((nh - size_h) / 2.0) * sy
    box[1] = rint((nw - size_w) / 2.0) * sx
    box[2] = size_h * sy
    box[3] = size_w * sx
    # top*sy + size_h*sy can exceed height by an ulp; the kernel requires the box inside.
    if box[0] + box[2] > height:
        box[2] = height - box[0]
    if box[1] + box[3] > width:
        box[3] = width - box[1]
    return OPS_OK


# --- Gaussian blur --------------------------------------------------------------------------

cdef int ops_gaussian_kernel(float* k, int ksize, double sigma) noexcept nogil:
    """k[t] = exp(-(t - r)**2 / (2 sigma**2)) / sum, r = ksize // 2: torchvision's kernel
    (softmax of -(x / sigma)**2 over x = linspace(-r, r, ksize) / sqrt(2)), in double with the
    portable exp, then rounded to float32 (within an ulp or so of torchvision's float32
    weights; exactly symmetric, which the passes rely on)."""
    cdef double total = 0.0, u
    cdef int t, r = ksize // 2
    if ksize < 1 or ksize % 2 == 0 or not (sigma > 0.0) or sigma > 1e300:
        return OPS_EARG
    for t in range(ksize):
        u = (t - r) / sigma
        total = total + portable_exp(-0.5 * (u * u))
    for t in range(ksize):
        u = (t - r) / sigma
        k[t] = <float>(portable_exp(-0.5 * (u * u)) / total)
    return OPS_OK


# --- Python face (dpu_pipe/ops.py validates arguments before calling these) -----------------

cdef _raise(int rc, what):
    if rc == OPS_EARG:
        raise ConfigError(f"{what}: argument outside what the kernel accepts")
    if rc == OPS_ENOMEM:
        raise MemoryError(f"{what}: out of memory for the resampling workspace")
    raise RuntimeError(f"{what}: internal table invariant failed (code {rc})")


cdef class Workspace:
    """Reusable scratch memory of the kernel (coefficient tables and intermediate rows).
    One per thread; ops.py keeps one per thread for its callers."""
    cdef OpsWorkspace ws
    cdef public bint busy

    def __cinit__(self):
        ops_ws_init(&self.ws)
        self.busy = False

    def __dealloc__(self):
        ops_ws_free(&self.ws)

    @property
    def nbytes(self):
        """Bytes currently reserved."""
        return self.ws.cap


def resize_crop_into(const uint8_t[:, :, :] img, double y0, double x0, double h, double w,
                     uint8_t[::1] out, int oh, int ow, bint flip, int dtype, int layout,
                     mean, std, Workspace ws, int filt=OPS_BILINEAR):
    """Run the kernel on img (H, W, 3) uint8 with pixel stride 3 (rows may be strided) into the
    bytes of out, which hold one (3, oh, ow) or (oh, ow, 3) sample of the given dtype code."""
    cdef double m[3]
    cdef double s[3]
    cdef OpsOutput o
    cdef int rc, c
    cdef int src_h = <int>img.shape[0], src_w = <int>img.shape[1]
    cdef Py_ssize_t stride = img.strides[0]
    cdef Py_ssize_t esize = 4 if dtype == OPS_FLOAT32 else (1 if dtype == OPS_UINT8 else 2)
    if img.shape[0] < 1 or img.shape[1] < 1 or img.shape[2] != 3 or img.strides[1] != 3 \
            or img.strides[2] != 1:
        raise ConfigError("image must be non-empty (H, W, 3) uint8 with 3-byte pixels")
    if out.shape[0] != esize * 3 * <Py_ssize_t>oh * ow:
        raise ConfigError(f"output buffer holds {out.shape[0]} bytes, "
                          f"needs {esize * 3 * oh * ow}")
    for c in range(3):
        m[c] = mean[c]
        s[c] = std[c]
    rc = ops_output_init(&o, dtype, layout, m, s)
    if rc != OPS_OK:
        _raise(rc, "output spec")
    with nogil:
        rc = ops_resize_crop(&ws.ws, &img[0, 0, 0], stride, src_h, src_w, y0, x0, h, w,
                             oh, ow, flip, filt, &o, &out[0])
    if rc != OPS_OK:
        _raise(rc, "resize_crop")


def center_crop_box(int height, int width, int size_h, int size_w, int resize):
    """(y0, x0, h, w) of ops_center_crop_box."""
    cdef double box[4]
    if ops_center_crop_box(height, width, size_h, size_w, resize, box) != OPS_OK:
        raise ConfigError(f"center crop {size_h}x{size_w} does not fit in image {height}x{width} "
                          f"resized to shorter side {resize}")
    return (box[0], box[1], box[2], box[3])


def gaussian_blur_into(const uint8_t[:, :, :] img, uint8_t[:, :, :] out, int kx, int ky,
                       double sx, double sy):
    """Blur img (H, W, 3) uint8, pixel stride 3 (rows may be strided), into out (the same
    shape, pixel stride 3, not overlapping img): kx x ky taps (width first, as torchvision),
    sigmas sx, sy in pixels."""
    cdef int h = <int>img.shape[0], w = <int>img.shape[1], rc = OPS_OK
    cdef float* wts
    if img.shape[0] < 1 or img.shape[1] < 1 or img.shape[2] != 3 or img.strides[1] != 3 \
            or img.strides[2] != 1:
        raise ConfigError("image must be non-empty (H, W, 3) uint8 with 3-byte pixels")
    if out.shape[0] != img.shape[0] or out.shape[1] != img.shape[1] or out.shape[2] != 3 \
            or out.strides[1] != 3 or out.strides[2] != 1:
        raise ConfigError("out must be (H, W, 3) uint8 with 3-byte pixels, as the image")
    if kx < 1 or ky < 1 or kx % 2 == 0 or ky % 2 == 0 or kx // 2 >= w or ky // 2 >= h:
        raise ConfigError(f"kernel {kx}x{ky} does not fit the {h}x{w} image: odd sizes whose "
                          f"half is below the image's width and height")
    wts = <float*>malloc((<size_t>kx + ky + blur_scratch_floats(w, kx, ky)) * sizeof(float))
    if wts == NULL:
        raise MemoryError("gaussian_blur: out of memory for the blur's scratch rows")
    try:
        with nogil:
            rc = ops_gaussian_kernel(wts, kx, sx)
            if rc == OPS_OK:
                rc = ops_gaussian_kernel(wts + kx, ky, sy)
            if rc == OPS_OK:
                if blur_rgb_u8(&img[0, 0, 0], img.strides[0], h, w, &out[0, 0, 0],
                               out.strides[0], wts, kx, wts + kx, ky, wts + kx + ky) != 0:
                    rc = OPS_EARG
    finally:
        free(wts)
    if rc != OPS_OK:
        _raise(rc, "gaussian_blur")
