# C-level API of the per-image transform kernel, cimported by the fused batch module: a source
# box of a decoded uint8 RGB image resampled to (oh, ow) with Pillow's antialiased filters, in
# float32, optionally mirrored, converted and normalized, written straight into the caller's
# sample buffer (training: RandomResizedCrop + flip; validation: ops_center_crop_box).
#
# Per image, two calls (or ops_resize_crop for both):
#   ops_plan   coefficient tables of both axes, carved out of an OpsWorkspace the caller owns
#              (one per thread; it grows on demand and is reused); plan.h/v.src_lo/src_hi tell
#              which source columns/rows will be read (a decoder may stop there).
#   ops_run    the two resampling passes plus the output conversion, under nogil.
# Every call returns OPS_OK or a negative OPS_E* code.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, int32_t
from libc.string cimport memcpy

cdef enum:
    OPS_OK = 0
    OPS_EARG = -1         # a size, box, dtype or layout outside what the kernel accepts
    OPS_ENOMEM = -2
    OPS_EINTERNAL = -3    # a table invariant did not hold (a bug, never bad input)

cdef extern from *:
    """
    /* How far (pixels) a box may overshoot the image and still be accepted (and clamped):
       room for the rounding of a crop box scaled by s/8 into a decoded region. */
    #define OPS_BOX_SLACK 1e-6
    """
    const double OPS_BOX_SLACK

cdef enum:                # output element type
    OPS_FLOAT32 = 0       # (x/255 - mean) / std
    OPS_UINT8 = 1         # round-half-up, clamped to 0..255, not normalized
    OPS_FLOAT16 = 2       # IEEE binary16 bits of the float32 result (round to nearest even)
    OPS_BFLOAT16 = 3      # bfloat16 bits (top half) of the float32 result, nearest even

cdef enum:                # output layout of one sample
    OPS_CHW = 0
    OPS_HWC = 1

cdef enum:                # resampling filter (Pillow's, antialiased: support scales with the
    OPS_BILINEAR = 0      # downscale factor)
    OPS_BICUBIC = 1       # Keys a = -0.5; negative lobes: uint8 output clamps, floats do not

cdef enum:                # pass order of ops_run (OpsPlan.order)
    OPS_H_FIRST = 0       # rows resampled horizontally, then summed vertically
    OPS_V_FIRST = 1       # source rows summed vertically, then each sum resampled horizontally

ctypedef struct OpsAxis:
    # Resampling table of one axis: output i (in output order, i.e. already mirrored for a
    # flipped axis) is sum(weight[i*ksize + t] * src[start[i] + t] for t < count[i]), summed
    # in ascending t; weights after count[i] are 0 up to ksize.
    int n_out
    int n_pad             # entries in the table: n_out, or for columns n_out rounded up to 4
                          # (the padding repeats the last entry)
    int ksize             # row length of `weight` (== max_taps)
    int max_taps          # largest count[i]
    int src_lo            # source pixels read by this axis: [src_lo, src_hi)
    int src_hi
    int32_t* start
    int32_t* count
    float* weight

ctypedef struct OpsWorkspace:
    void* raw             # malloc'd block (owned), NULL when empty
    char* mem             # raw aligned to 64 bytes
    size_t cap            # usable bytes at mem

ctypedef struct OpsPlan:
    OpsAxis h             # columns; mirrored when flipping
    OpsAxis v             # rows
    int src_h             # size of the source image the plan was made for, pixels
    int src_w
    Py_ssize_t rstride    # floats between intermediate rows (>= 3*h.n_pad + 4, multiple of 16)
    float* hw4            # h.weight with every weight repeated 4 times (vector loads), by
                          # pairs of output pixels: _resample.h OPS_HW4_AT
    float* src_row        # one source row span as float32, then 3*h.ksize + 4 zeros
    float* scale3         # 3*ow: OpsOutput.scale repeated per pixel (HWC conversion)
    float* bias3
    float* ring           # v.max_taps horizontally resampled rows (a ring buffer)
    float* acc            # one vertically accumulated output row
    float* zero           # rstride zeros
    float* tmp            # one float row before its float16 conversion (F16C path)
    int order             # OPS_H_FIRST or OPS_V_FIRST: which pass runs on the source rows
                          # (ops_plan picks the cheaper one, a function of the sizes only)

ctypedef struct OpsOutput:
    int dtype             # OPS_FLOAT32 / OPS_UINT8 / OPS_FLOAT16
    int layout            # OPS_CHW / OPS_HWC
    float scale[3]        # per channel: out = value * scale + bias, value in 0..255
    float bias[3]


cdef void ops_ws_init(OpsWorkspace* ws) noexcept nogil
cdef void ops_ws_free(OpsWorkspace* ws) noexcept nogil
cdef int ops_ws_reserve(OpsWorkspace* ws, size_t nbytes) noexcept nogil
cdef size_t ops_workspace_bytes(int src_w, double h, double w, int oh, int ow,
                               int filt) noexcept nogil

cdef int ops_output_init(OpsOutput* o, int dtype, int layout,
                         const double* mean, const double* std) noexcept nogil
cdef int ops_plan(OpsPlan* p, OpsWorkspace* ws, int src_h, int src_w,
                  double y0, double x0, double h, double w,
                  int oh, int ow, int flip, int filt) noexcept nogil
cdef int ops_run(const OpsPlan* p, const uint8_t* src, Py_ssize_t src_stride,
                 const OpsOutput* o, void* out) noexcept nogil
cdef int ops_resize_crop(OpsWorkspace* ws, const uint8_t* src, Py_ssize_t src_stride,
                         int src_h, int src_w, double y0, double x0, double h, double w,
                         int oh, int ow, int flip, int filt, const OpsOutput* o,
                         void* out) noexcept nogil
cdef int ops_center_crop_box(int height, int width, int size_h, int size_w, int resize,
                             double* box) noexcept nogil


# Gaussian blur (torchvision v2's gaussian_blur on uint8 RGB): the weights of one axis, odd
# size K from sigma; OPS_EARG for an even or non-positive K or a bad sigma. The passes are
# _blur.h's blur_rgb_u8, which a module includes itself.
cdef int ops_gaussian_kernel(float* k, int ksize, double sigma) noexcept nogil

# --- float16 conversion ---------------------------------------------------------------------
# Here rather than in _ops.pyx so that the tests' extension (tests/kernels/) compiles exactly
# this code: the portable one, and the F16C one, which ops_run picks when the CPU has it.

cdef extern from *:
    """
    /* float32 -> float16 with x86's F16C instructions (not in the SSE2 baseline), round to
       nearest even as _to_f16. Marked unused: every module that cimports this file gets a
       copy, most never call it. */
    #if defined(__x86_64__) && defined(__GNUC__)
    #include <immintrin.h>
    __attribute__((target("avx,f16c"), unused))
    static void ops_f16c_convert(const float *src, unsigned short *dst, Py_ssize_t n) {
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++)
            dst[i] = (unsigned short)_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
    }
    #if defined(__clang__) && __clang_major__ < 16
    /* Clang before 16 does not know "f16c" in __builtin_cpu_supports: read CPUID instead
       ("avx" also checks that the OS saves the YMM registers F16C needs). */
    #include <cpuid.h>
    __attribute__((unused)) static int ops_have_f16c(void) {
        unsigned int a, b, c, d;
        return __builtin_cpu_supports("avx") && __get_cpuid(1, &a, &b, &c, &d)
               && (c & bit_F16C) != 0;
    }
    #else
    __attribute__((unused))
    static int ops_have_f16c(void) { return __builtin_cpu_supports("f16c"); }
    #endif
    #else
    __attribute__((unused))
    static void ops_f16c_convert(const float *src, unsigned short *dst, Py_ssize_t n) {
        (void)src; (void)dst; (void)n;
    }
    __attribute__((unused)) static int ops_have_f16c(void) { return 0; }
    #endif

    """
    void ops_f16c_convert(const float* src, uint16_t* dst, Py_ssize_t n) noexcept nogil
    int ops_have_f16c() noexcept nogil


cdef inline uint16_t _to_f16(float x) noexcept nogil:
    """IEEE binary16 bits of x, round to nearest even; NaN -> quiet NaN, overflow -> inf.
    Integer and mask arithmetic only (no branches), so loops around it vectorize and give the
    same bits everywhere; matches numpy's float32 -> float16 cast on finite values and inf."""
    cdef uint32_t f, sign, odd, normal, sub, special, m_sub, m_big, res
    cdef float af
    memcpy(&f, &x, 4)
    sign = f & 0x80000000u
    f = f ^ sign                               # |x|; below 2**31, so signed compares work
    # Normal half: rebias the exponent (-112 << 23) and round at bit 13 to nearest even.
    odd = (f >> 13) & 1u
    normal = (f + 0xC8000FFFu + odd) >> 13
    # Subnormal half or zero: adding 0.5f lines the 10 mantissa bits up at the bottom and lets
    # the float adder round to nearest even; then remove 0.5f's bits.
    memcpy(&af, &f, 4)
    af = af + <float>0.5
    memcpy(&sub, &af, 4)
    sub = sub - 0x3F000000u
    special = 0x7C00u | (<uint32_t>(<int32_t>f > <int32_t>0x7F800000) << 9)
    m_sub = 0u - <uint32_t>(<int32_t>f < <int32_t>0x38800000)
    m_big = 0u - <uint32_t>(<int32_t>f >= <int32_t>0x47800000)
    res = (sub & m_sub) | (normal & ~m_sub)
    res = (special & m_big) | (res & ~m_big)
    return <uint16_t>(res | (sign >> 16))


cdef inline uint16_t _to_bf16(float x) noexcept nogil:
    """bfloat16 bits of x: the top 16 bits of its float32 bits, rounded to nearest even, NaN ->
    0x7FC0 — what torch's float32 -> bfloat16 conversion gives. Integer arithmetic only."""
    cdef uint32_t f, nan
    memcpy(&f, &x, 4)
    nan = 0u - <uint32_t>((f & 0x7FFFFFFFu) > 0x7F800000u)
    f = (f + 0x7FFFu + ((f >> 16) & 1u)) >> 16
    return <uint16_t>((0x7FC0u & nan) | (f & ~nan))
