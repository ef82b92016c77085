# The one random-number scheme of dpu_pipe, as inline C kernels other modules cimport:
#
#     from dpu_pipe._rng cimport CropConfig, CropBox, crop_config_init, random_resized_crop
#
# dpu_pipe/rng.py is the numpy twin of every function here and documents the scheme. Both
# twins give the same bits on x86-64 and aarch64 (docs/design/determinism.md): only IEEE
# + - * / sqrt, rint, floor, frexp and ldexp on doubles (exactly rounded everywhere), no libm
# exp/log (glibc's FMA and non-FMA variants may differ in the last bit), no FMA
# (-ffp-contract=off), and coefficients as decimal literals that round-trip (Python repr).

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.math cimport INFINITY, NAN, floor, frexp, isfinite, ldexp, rint, sqrt

cdef enum:
    # Stream ids (the top 16 bits of counter word 3); one per purpose so that purposes never
    # share random numbers. New purposes take ids from RNG_STREAM_USER upwards and are
    # recorded in dpu_pipe/rng.py.
    RNG_STREAM_SHUFFLE = 0     # the epoch permutation: block r is Feistel round r
    RNG_STREAM_CROP = 1        # RandomResizedCrop: blocks 0..9 attempts, block 10 position
    RNG_STREAM_FLIP = 2        # horizontal flip
    RNG_STREAM_AUGMENT = 256   # auto-augment ops and magnitudes (_augment.pyx: aug_sample)
    RNG_STREAM_JITTER = 257    # colour jitter order and factors
    RNG_STREAM_GRAYSCALE = 258 # random grayscale
    RNG_STREAM_ERASE = 259     # random erasing
    RNG_STREAM_MIX = 260       # batch ops: mix, switch, CutMix box, Beta draw (dpu_pipe/mix.py)
    RNG_STREAM_HOOK = 261      # batch_hook's Generator seed (dpu_pipe/mix.py)
    RNG_STREAM_STICK = 262     # stick_to_shard's permutation keys (dpu_pipe/sampler.py)
    RNG_STREAM_BLUR = 263      # multi-view Gaussian blur: applied?, sigma
    RNG_STREAM_SOLARIZE = 264  # multi-view solarize: applied?
    RNG_STREAM_USER = 265
    RNG_STREAM_ERASE_NOISE = 512  # erase_value="random": streams 512..527 (_augment: aug_erase)
    RNG_ERASE_NOISE_STREAMS = 16
    # View v of a multi-view recipe draws from stream id ``stream + (v << RNG_VIEW_SHIFT)``
    # (every id above is below 1 << RNG_VIEW_SHIFT): view 0 draws what the one-view recipe
    # draws, and no two views share a stream.
    RNG_VIEW_SHIFT = 10
    RNG_MAX_VIEWS = 64
    RNG_CROP_ATTEMPTS = 10     # torchvision's attempt count before the central-crop fallback
    RNG_PERM_ROUNDS = 8        # Feistel rounds of the epoch permutation
    RNG_PERM_MIN_BITS = 8      # smallest Feistel domain: 2**8 (see perm_init)
    RNG_PERM_MAX_BITS = 62     # permutations of [0, n) for n <= 2**62

ctypedef struct CropConfig:
    # Filled by crop_config_init; log_ratio_* are computed once, with portable_log.
    double scale_lo
    double scale_hi
    double ratio_lo
    double ratio_hi
    double log_ratio_lo
    double log_ratio_hi
    uint32_t vstream           # view v's stream offset, v << RNG_VIEW_SHIFT (0: one view)

ctypedef struct PermDomain:
    # The Feistel domain [0, 2**(bits_l + bits_r)) that holds [0, n); filled by perm_init.
    uint64_t n
    uint32_t bits_l            # width of the left half: floor(bits / 2)
    uint32_t bits_r            # width of the right half: ceil(bits / 2)

ctypedef struct CropBox:
    # Crop in full-resolution pixels of the source image.
    int64_t top
    int64_t left
    int64_t height
    int64_t width
    int32_t attempt            # accepted attempt 0..9, or -1 for the central-crop fallback


# --- Philox-4x32-10 (Salmon et al., SC 2011) ---------------------------------------------

cdef inline void philox4x32_10(const uint32_t* ctr, const uint32_t* key,
                               uint32_t* out) noexcept nogil:
    """out[0:4] = Philox-4x32-10(counter ctr[0:4], key key[0:2]); out may alias ctr."""
    cdef uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3]
    cdef uint32_t k0 = key[0], k1 = key[1]
    cdef uint64_t p0, p1
    cdef int r
    for r in range(10):
        if r:
            k0 = k0 + <uint32_t>0x9E3779B9
            k1 = k1 + <uint32_t>0xBB67AE85
        p0 = <uint64_t>0xD2511F53 * c0
        p1 = <uint64_t>0xCD9E8D57 * c2
        c0 = <uint32_t>(p1 >> 32) ^ c1 ^ k0
        c1 = <uint32_t>p1
        c2 = <uint32_t>(p0 >> 32) ^ c3 ^ k1
        c3 = <uint32_t>p0
    out[0], out[1], out[2], out[3] = c0, c1, c2, c3


cdef inline void rng_block(uint64_t seed, uint32_t epoch, uint64_t index, uint32_t stream,
                           uint32_t block, uint32_t* out) noexcept nogil:
    """The 4 words of block `block` of stream `stream` for one sample (scheme in rng.py).
    stream and block must be < 2**16."""
    cdef uint32_t key[2]
    cdef uint32_t ctr[4]
    key[0], key[1] = <uint32_t>seed, <uint32_t>(seed >> 32)
    ctr[0], ctr[1] = <uint32_t>index, <uint32_t>(index >> 32)
    ctr[2], ctr[3] = epoch, (stream << 16) | (block & 0xFFFF)
    philox4x32_10(ctr, key, out)


cdef inline uint64_t rng_u64(uint64_t seed, uint32_t epoch, uint64_t index, uint32_t stream,
                             uint32_t block) noexcept nogil:
    """First 64-bit word of a block: words 0 (low half) and 1 (high half)."""
    cdef uint32_t w[4]
    rng_block(seed, epoch, index, stream, block, w)
    return <uint64_t>w[0] | (<uint64_t>w[1] << 32)


cdef inline double rng_unit(uint32_t lo, uint32_t hi) noexcept nogil:
    """Uniform double in [0, 1) from the top 53 bits of the 64-bit word hi:lo (exact)."""
    return <double>(((<uint64_t>hi << 32) | lo) >> 11) * 1.1102230246251565e-16  # 2**-53


cdef inline void rng_uniform2(uint64_t seed, uint32_t epoch, uint64_t index, uint32_t stream,
                              uint32_t block, double* u0, double* u1) noexcept nogil:
    """Both uniforms of a block: u0 from words 0-1, u1 from words 2-3, each in [0, 1)."""
    cdef uint32_t w[4]
    rng_block(seed, epoch, index, stream, block, w)
    u0[0] = rng_unit(w[0], w[1])
    u1[0] = rng_unit(w[2], w[3])


# --- the epoch permutation: a keyed bijection of [0, n), one position at a time ------------

cdef inline int perm_init(PermDomain* d, uint64_t n) noexcept nogil:
    """Fill d for permutations of [0, n). Returns 0, or -1 unless 1 <= n <= 2**62.

    The domain has at least RNG_PERM_MIN_BITS bits: on halves of one or two bits, eight
    rounds leave the permutation measurably non-uniform (chi-square over many keys), while
    walking a 256-value domain costs little for a dataset that small."""
    cdef uint32_t bits = RNG_PERM_MIN_BITS
    if n < 1 or n > (<uint64_t>1 << RNG_PERM_MAX_BITS):
        return -1
    while (<uint64_t>1 << bits) < n:
        bits += 1
    d.n = n
    d.bits_l = bits // 2
    d.bits_r = bits - bits // 2
    return 0


cdef inline uint64_t perm_feistel(const PermDomain* d, uint64_t seed, uint32_t epoch,
                                  uint64_t x) noexcept nogil:
    """One pass of the Feistel network over [0, 2**bits) (a bijection of that range).

    x = L << bits_r | R. Round r: (L, R) <- (R, L ^ F_r(R)), F_r(R) = low bits of the first
    64-bit word of rng_block(seed, epoch, R, RNG_STREAM_SHUFFLE, r); the halves swap widths
    every round, so odd bit counts need no special case and an even round count ends on the
    starting widths."""
    cdef uint32_t a = d.bits_l, b = d.bits_r
    cdef uint64_t left = x >> b
    cdef uint64_t right = x & ((<uint64_t>1 << b) - 1)
    cdef uint64_t f
    cdef int r
    for r in range(RNG_PERM_ROUNDS):
        f = rng_u64(seed, epoch, right, RNG_STREAM_SHUFFLE, <uint32_t>r)
        left, right = right, (left ^ f) & ((<uint64_t>1 << a) - 1)
        a, b = b, a
    return (left << b) | right


cdef inline uint64_t perm_index(const PermDomain* d, uint64_t seed, uint32_t epoch,
                                uint64_t pos) noexcept nogil:
    """The sample index at position pos (< d.n) of the permutation keyed by (seed, epoch).

    Cycle-walking: the Feistel bijection of [0, 2**bits) is applied until the value falls in
    [0, n); it terminates because pos's cycle returns to pos, and takes fewer than 2 passes on
    average when n > 2**RNG_PERM_MIN_BITS (2**bits < 2 n), 2**8 / n for smaller n. Integer
    operations only."""
    cdef uint64_t x = pos
    if d.n == 1:
        return 0
    x = perm_feistel(d, seed, epoch, x)
    while x >= d.n:
        x = perm_feistel(d, seed, epoch, x)
    return x


# --- exp and log from + - * / only ----------------------------------------------------------

cdef inline double portable_exp(double x) noexcept nogil:
    """e**x within ~1 ulp, bit-identical everywhere (not libm's exp)."""
    cdef double k, r, p
    if x != x:
        return x
    if x > 709.782712893384:     # log(DBL_MAX)
        return INFINITY
    if x < -745.2:               # below half the smallest subnormal
        return 0.0
    # x = k ln2 + r with |r| <= ln2/2; ln2_hi has 21 trailing zero bits, so k*ln2_hi is exact.
    k = rint(x * 1.4426950408889634)
    r = (x - k * 0.6931471803691238) - k * 1.9082149292705877e-10
    # Taylor series to r**13/13!: truncation < 4e-18 for |r| <= 0.347.
    p = 1.6059043836821613e-10
    p = p * r + 2.08767569878681e-09
    p = p * r + 2.505210838544172e-08
    p = p * r + 2.755731922398589e-07
    p = p * r + 2.7557319223985893e-06
    p = p * r + 2.48015873015873e-05
    p = p * r + 0.0001984126984126984
    p = p * r + 0.001388888888888889
    p = p * r + 0.008333333333333333
    p = p * r + 0.041666666666666664
    p = p * r + 0.16666666666666666
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    return ldexp(p, <int>k)


cdef inline double portable_log(double x) noexcept nogil:
    """Natural log within ~1 ulp, bit-identical everywhere (not libm's log); -inf for 0,
    nan for negative or nan input, inf for inf."""
    cdef double m, f, s, z, q, e, hfsq
    cdef int ei
    if x == 0.0:
        return -INFINITY
    if not (x > 0.0):            # negative or nan
        return NAN
    if x == INFINITY:
        return x
    # x = m * 2**e with m in [sqrt(1/2), sqrt(2)); log m = log(1 + f) = 2 atanh(s) with
    # s = f / (2 + f), rearranged as fdlibm does so that the exact f carries the result:
    # log(1 + f) = f - f*f/2 + s * (f*f/2 + R),  R = z (2/3 + 2/5 z + ...), z = s*s.
    m = frexp(x, &ei)
    if m < 0.7071067811865476:
        m = m * 2.0
        ei = ei - 1
    e = <double>ei
    f = m - 1.0                  # exact (Sterbenz)
    s = f / (2.0 + f)            # |s| <= 0.1716
    z = s * s
    # Taylor terms to z**10 (2/21): truncation < 1e-18.
    q = 0.09523809523809523
    q = q * z + 0.10526315789473684
    q = q * z + 0.11764705882352941
    q = q * z + 0.13333333333333333
    q = q * z + 0.15384615384615385
    q = q * z + 0.18181818181818182
    q = q * z + 0.2222222222222222
    q = q * z + 0.2857142857142857
    q = q * z + 0.4
    q = q * z + 0.6666666666666666
    hfsq = 0.5 * f * f
    return (e * 0.6931471803691238
            - ((hfsq - (s * (hfsq + z * q) + e * 1.9082149292705877e-10)) - f))


# --- augmentation parameters ---------------------------------------------------------------

cdef inline int crop_config_init(CropConfig* cfg, double scale_lo, double scale_hi,
                                 double ratio_lo, double ratio_hi) noexcept nogil:
    """Fill cfg for RandomResizedCrop(scale=(scale_lo, scale_hi), ratio=(ratio_lo, ratio_hi)).
    Returns 0, or -1 unless 0 <= scale_lo <= scale_hi, 0 < scale_hi, 0 < ratio_lo <= ratio_hi,
    all finite (rng.py's check gives the message)."""
    if not (isfinite(scale_lo) and isfinite(scale_hi) and isfinite(ratio_lo)
            and isfinite(ratio_hi)):
        return -1
    if not (0.0 <= scale_lo <= scale_hi and scale_hi > 0.0 and 0.0 < ratio_lo <= ratio_hi):
        return -1
    cfg.scale_lo, cfg.scale_hi = scale_lo, scale_hi
    cfg.ratio_lo, cfg.ratio_hi = ratio_lo, ratio_hi
    cfg.log_ratio_lo = portable_log(ratio_lo)
    cfg.log_ratio_hi = portable_log(ratio_hi)
    cfg.vstream = 0
    return 0


cdef inline int random_resized_crop(const CropConfig* cfg, uint64_t seed, uint32_t epoch,
                                    uint64_t index, int64_t height, int64_t width,
                                    CropBox* out) noexcept nogil:
    """torchvision's RandomResizedCrop.get_params for an image of height x width pixels, with
    randomness from stream RNG_STREAM_CROP of (seed, epoch, index). Returns 0, or -1 unless
    1 <= height, width < 2**31."""
    cdef double area, target, aspect, wf, hf, us, ur, ut, ul, in_ratio
    cdef int64_t w, h
    cdef int a
    if height < 1 or width < 1 or height > 2147483647 or width > 2147483647:
        return -1
    area = <double>(height * width)
    for a in range(RNG_CROP_ATTEMPTS):
        rng_uniform2(seed, epoch, index, RNG_STREAM_CROP + cfg.vstream, <uint32_t>a, &us, &ur)
        target = area * (cfg.scale_lo + (cfg.scale_hi - cfg.scale_lo) * us)
        aspect = portable_exp(cfg.log_ratio_lo + (cfg.log_ratio_hi - cfg.log_ratio_lo) * ur)
        wf = rint(sqrt(target * aspect))       # rint: round half to even, as Python's round
        hf = rint(sqrt(target / aspect))
        if 0.0 < wf <= <double>width and 0.0 < hf <= <double>height:
            w = <int64_t>wf
            h = <int64_t>hf
            rng_uniform2(seed, epoch, index, RNG_STREAM_CROP + cfg.vstream, RNG_CROP_ATTEMPTS,
                         &ut, &ul)
            out.top = <int64_t>floor(ut * <double>(height - h + 1))
            out.left = <int64_t>floor(ul * <double>(width - w + 1))
            # u < 1 keeps floor(u * n) < n already; the clamp documents the bound.
            if out.top > height - h:
                out.top = height - h
            if out.left > width - w:
                out.left = width - w
            out.height, out.width, out.attempt = h, w, a
            return 0
    # Central crop with the aspect ratio clamped into [ratio_lo, ratio_hi], as torchvision.
    in_ratio = <double>width / <double>height
    hf = <double>height
    wf = <double>width
    if in_ratio < cfg.ratio_lo:
        hf = rint(<double>width / cfg.ratio_lo)
    elif in_ratio > cfg.ratio_hi:
        wf = rint(<double>height * cfg.ratio_hi)
    # torchvision can return an empty crop here (ratio bounds far from 1 on a tiny image);
    # one pixel is the nearest crop that can be resized. Clamping in double keeps an infinite
    # quotient away from the int conversion.
    hf = min(max(hf, 1.0), <double>height)
    wf = min(max(wf, 1.0), <double>width)
    h = <int64_t>hf
    w = <int64_t>wf
    out.top = (height - h) // 2
    out.left = (width - w) // 2
    out.height, out.width, out.attempt = h, w, -1
    return 0


cdef inline int random_flip(uint64_t seed, uint32_t epoch, uint64_t index,
                            double p, uint32_t vstream=0) noexcept nogil:
    """1 if the sample is flipped horizontally (probability p), else 0: u < p with u the first
    uniform of stream RNG_STREAM_FLIP (+ vstream: view v's offset), as torchvision's
    `torch.rand(1) < p`."""
    cdef double u0, u1
    rng_uniform2(seed, epoch, index, RNG_STREAM_FLIP + vstream, 0, &u0, &u1)
    return 1 if u0 < p else 0
