# JPEG decoding over libjpeg-turbo's jpeglib API: header, region decode with early stop,
# DCT-scaled decode, colour conversion to RGB, and libjpeg errors turned into status codes.
from libc.stdint cimport uint8_t, int32_t, int64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memset, strncpy
from libc.setjmp cimport setjmp, longjmp
cimport dpu_pipe._libjpeg as lj

import numpy as np

from dpu_pipe.errors import ConfigError, DecodeError

# Extra output columns decoded on each side of a region: fancy upsampling of subsampled chroma
# reads one neighbouring chroma sample, and libjpeg treats the edge of a cropped scanline as the
# image edge. Decoding a little beyond the region keeps it identical to the full decode.
cdef enum:
    CROP_MARGIN = 4


# --- libjpeg callbacks: never print, never exit ----------------------------------------------

cdef void _error_exit(lj.j_common_ptr cinfo) noexcept nogil:
    cdef ErrorMgr* err = <ErrorMgr*>cinfo.err
    err.pub.format_message(cinfo, err.message)
    longjmp(err.jump, 1)


cdef void _emit_message(lj.j_common_ptr cinfo, int level) noexcept nogil:
    cdef ErrorMgr* err = <ErrorMgr*>cinfo.err
    if level >= 0:
        return  # trace messages
    err.pub.num_warnings += 1
    # A truncated stream is always an error: libjpeg would pad it with grey and the sample
    # would be silently wrong. Other corrupt-data warnings are errors only in strict mode.
    if err.strict or err.pub.msg_code == lj.JWRN_JPEG_EOF:
        err.pub.format_message(cinfo, err.message)
        longjmp(err.jump, 1)


cdef void _output_message(lj.j_common_ptr cinfo) noexcept nogil:
    pass


cdef void _progress(lj.j_common_ptr cinfo) noexcept nogil:
    cdef Decoder* d = <Decoder*>cinfo
    if d.cinfo.input_scan_number > d.opts.max_scans:
        strncpy(d.err.message, b"too many scans in the JPEG stream (scan limit exceeded)", 199)
        longjmp(d.err.jump, 2)


# --- decoder lifecycle --------------------------------------------------------------------------

cdef void dec_init(Decoder* d, const DecodeOptions* opts) noexcept nogil:
    memset(d, 0, sizeof(Decoder))
    d.opts = opts[0]
    d.cinfo.err = lj.jpeg_std_error(&d.err.pub)
    d.err.pub.error_exit = _error_exit
    d.err.pub.emit_message = _emit_message
    d.err.pub.output_message = _output_message
    d.err.strict = opts.strict
    d.progress.progress_monitor = _progress


cdef void dec_free(Decoder* d) noexcept nogil:
    if d.created:
        lj.jpeg_destroy_decompress(&d.cinfo)
        d.created = 0
    free(d.row)
    d.row = NULL
    d.row_cap = 0


cdef const char* dec_message(const Decoder* d) noexcept nogil:
    return d.err.message


cdef int _fail(Decoder* d, int code, const char* message) noexcept nogil:
    strncpy(d.err.message, message, 199)
    d.err.message[199] = 0
    return code


cdef int dec_read_header(Decoder* d, const uint8_t* data, size_t size) noexcept nogil:
    """Parse the markers of one image; apply the pixel budget. The decoder may hold a previous
    image: it is released first."""
    d.header_ok = 0
    d.err.message[0] = 0
    if size == 0:
        return _fail(d, DP_EDECODE, b"empty input (0 bytes)")
    # A fresh decompress object per image: libjpeg keeps quantization and Huffman tables from
    # one image to the next (for abbreviated streams), so a stream missing its tables would
    # silently decode with its predecessor's, and a sample would depend on its neighbours.
    if d.created:
        lj.jpeg_destroy_decompress(&d.cinfo)
        d.created = 0
    if setjmp(d.err.jump):
        if d.created:
            lj.jpeg_abort_decompress(&d.cinfo)
        return DP_EDECODE
    lj.jpeg_create_decompress(&d.cinfo)
    d.created = 1
    d.cinfo.progress = &d.progress
    lj.jpeg_mem_src(&d.cinfo, data, size)
    lj.jpeg_read_header(&d.cinfo, 1)
    d.info.width = d.cinfo.image_width
    d.info.height = d.cinfo.image_height
    d.info.components = d.cinfo.num_components
    d.info.colorspace = d.cinfo.jpeg_color_space
    d.info.progressive = d.cinfo.progressive_mode
    d.info.arithmetic = d.cinfo.arith_code
    if <int64_t>d.info.width * d.info.height > d.opts.max_pixels:
        lj.jpeg_abort_decompress(&d.cinfo)
        return _fail(d, DP_EBUDGET, b"image exceeds the pixel budget (max_pixels)")
    d.header_ok = 1
    return DP_OK


cdef inline uint8_t _muldiv255(int a, int b) noexcept nogil:
    # Pillow's rounding for a*b/255, so CMYK converts exactly as Pillow does.
    cdef int t = a * b + 128
    return <uint8_t>(((t >> 8) + t) >> 8)


cdef void _cmyk_to_rgb(const uint8_t* src, uint8_t* dst, int n) noexcept nogil:
    # JPEG CMYK is stored inverted by Adobe's convention, which Pillow and OpenCV assume for
    # every CMYK JPEG: with the stored values c and k, R = k - (255 - c) * k / 255.
    cdef int i, k
    for i in range(n):
        k = src[4 * i + 3]
        dst[3 * i] = k - _muldiv255(255 - src[4 * i], k)
        dst[3 * i + 1] = k - _muldiv255(255 - src[4 * i + 1], k)
        dst[3 * i + 2] = k - _muldiv255(255 - src[4 * i + 2], k)


cdef int dec_decode(Decoder* d, int scale, const Region* region,
                    uint8_t* out, Py_ssize_t out_stride) noexcept nogil:
    """Decode `region` (in pixels of the image scaled by scale/8) into `out` (rows of
    region.width * 3 bytes, `out_stride` bytes apart) and stop after its last row."""
    cdef lj.j_decompress_ptr cinfo = &d.cinfo
    cdef lj.JDIMENSION xoff, cw, skip
    cdef lj.JSAMPROW rowptr
    cdef int cmyk, y, r_end, xend, comps, shift
    cdef size_t need
    if not d.header_ok:
        return _fail(d, DP_EDECODE, b"no header read")
    d.header_ok = 0
    if setjmp(d.err.jump):
        lj.jpeg_abort_decompress(cinfo)
        return DP_EDECODE
    cmyk = cinfo.jpeg_color_space == lj.JCS_CMYK or cinfo.jpeg_color_space == lj.JCS_YCCK
    cinfo.out_color_space = lj.JCS_CMYK if cmyk else lj.JCS_RGB
    cinfo.scale_num = scale
    cinfo.scale_denom = 8
    cinfo.dct_method = lj.JDCT_IFAST if d.opts.fast else lj.JDCT_ISLOW
    cinfo.do_fancy_upsampling = 0 if d.opts.fast else 1
    lj.jpeg_start_decompress(cinfo)

    if (region.top < 0 or region.left < 0 or region.height <= 0 or region.width <= 0
            or region.top + region.height > <int>cinfo.output_height
            or region.left + region.width > <int>cinfo.output_width):
        lj.jpeg_abort_decompress(cinfo)
        return _fail(d, DP_EREGION, b"region outside the image")

    # Horizontal crop: libjpeg moves xoff down to an iMCU boundary and reports it.
    xoff = 0
    cw = cinfo.output_width
    if region.left > CROP_MARGIN or region.left + region.width + CROP_MARGIN < <int>cw:
        xoff = region.left - CROP_MARGIN if region.left > CROP_MARGIN else 0
        xend = region.left + region.width + CROP_MARGIN
        if xend > <int>cinfo.output_width:
            xend = cinfo.output_width
        cw = xend - xoff
        lj.jpeg_crop_scanline(cinfo, &xoff, &cw)
    comps = cinfo.output_components
    need = <size_t>cw * comps
    if need > d.row_cap:
        rowptr = <lj.JSAMPROW>realloc(d.row, need)
        if rowptr == NULL:
            lj.jpeg_abort_decompress(cinfo)
            return _fail(d, DP_ENOMEM, b"out of memory for a scanline")
        d.row = rowptr
        d.row_cap = need
    shift = (region.left - <int>xoff) * comps

    if region.top > 0:
        skip = lj.jpeg_skip_scanlines(cinfo, region.top)
        if skip != <lj.JDIMENSION>region.top:
            lj.jpeg_abort_decompress(cinfo)
            return _fail(d, DP_EDECODE, b"could not skip to the region's first row")
    r_end = region.top + region.height
    rowptr = d.row
    y = 0
    while <int>cinfo.output_scanline < r_end:
        if lj.jpeg_read_scanlines(cinfo, &rowptr, 1) != 1:
            lj.jpeg_abort_decompress(cinfo)
            return _fail(d, DP_EDECODE, b"decoder returned no scanline")
        if cmyk:
            _cmyk_to_rgb(d.row + shift, out + y * out_stride, region.width)
        else:
            memcpy(out + y * out_stride, d.row + shift, <size_t>region.width * 3)
        y += 1
    # Early stop: the rest of the entropy-coded data is never decoded.
    lj.jpeg_abort_decompress(cinfo)
    return DP_OK


# --- scale and region arithmetic ----------------------------------------------------------------

cdef int scaled_size(int size, int scale) noexcept nogil:
    """libjpeg's output size of `size` pixels at DCT scale scale/8 (rounded up)."""
    return <int>((<int64_t>size * scale + 7) // 8)


cdef int choose_scale(int64_t height, int64_t width, int min_h, int min_w) noexcept nogil:
    """Smallest power-of-two DCT scale (1, 2, 4 or 8 eighths) keeping a region of
    height x width full-resolution pixels at least min_h x min_w. libjpeg-turbo has SIMD
    IDCTs only for the power-of-two scales; 3/8..7/8 decode slower than full scale."""
    cdef int s = 1
    if min_h <= 0 and min_w <= 0:
        return 8
    while s < 8:
        if height * s >= <int64_t>min_h * 8 and width * s >= <int64_t>min_w * 8:
            return s
        s *= 2
    return 8


cdef int scale_region(const JpegInfo* info, int scale, int top, int left, int height, int width,
                      Region* out) noexcept nogil:
    """The pixels of the scale/8 image that cover a full-resolution region (rounded outwards,
    clipped to the scaled image). Returns DP_EREGION when the region is not inside the image."""
    cdef int64_t sh = scaled_size(info.height, scale)
    cdef int64_t sw = scaled_size(info.width, scale)
    cdef int64_t r0, c0, r1, c1
    if (top < 0 or left < 0 or height <= 0 or width <= 0
            or <int64_t>top + height > info.height or <int64_t>left + width > info.width):
        return DP_EREGION
    r0 = (<int64_t>top * scale) // 8
    c0 = (<int64_t>left * scale) // 8
    r1 = ((<int64_t>top + height) * scale + 7) // 8
    c1 = ((<int64_t>left + width) * scale + 7) // 8
    out.top = r0
    out.left = c0
    out.height = (r1 if r1 < sh else sh) - r0
    out.width = (c1 if c1 < sw else sw) - c0
    return DP_OK


# --- Python boundary ------------------------------------------------------------------------------

cdef class BufferList:
    """Pointers to N encoded images, gathered once so batch kernels never touch Python objects
    per image. Build it from a sequence of bytes-like objects or from packed storage."""

    def __cinit__(self):
        self.n = 0
        self.ptrs = NULL
        self.sizes = NULL

    def __dealloc__(self):
        free(self.ptrs)
        free(self.sizes)

    cdef void _alloc(self, Py_ssize_t n) except *:
        self.ptrs = <const uint8_t**>malloc(max(n, 1) * sizeof(uint8_t*))
        self.sizes = <size_t*>malloc(max(n, 1) * sizeof(size_t))
        if self.ptrs == NULL or self.sizes == NULL:
            raise MemoryError()
        self.n = n

    @staticmethod
    def from_buffers(buffers):
        """From a sequence of bytes-like objects (bytes, bytearray, memoryview, uint8 arrays)."""
        cdef BufferList self = BufferList()
        cdef const uint8_t[::1] view
        cdef Py_ssize_t i
        items = list(buffers)
        self._alloc(len(items))
        self.keep = []
        for i in range(self.n):
            obj = items[i]
            if isinstance(obj, memoryview) and obj.ndim != 1:
                obj = obj.cast("B")
            view = obj
            self.sizes[i] = view.shape[0]
            self.ptrs[i] = &view[0] if view.shape[0] > 0 else NULL
            self.keep.append(view)
        return self

    @staticmethod
    def from_packed(const uint8_t[::1] data, const int64_t[::1] offsets,
                    const int64_t[::1] lengths):
        """From one byte buffer holding N images at offsets[i] with lengths[i] bytes."""
        cdef BufferList self = BufferList()
        cdef Py_ssize_t i
        cdef Py_ssize_t total = data.shape[0]
        if offsets.shape[0] != lengths.shape[0]:
            raise ConfigError("offsets and lengths differ in length")
        self._alloc(offsets.shape[0])
        self.keep = data
        for i in range(self.n):
            if offsets[i] < 0 or lengths[i] < 0 or offsets[i] + lengths[i] > total:
                raise ConfigError(f"record {i} (offset {offsets[i]}, length {lengths[i]}) "
                                 f"lies outside the {total}-byte buffer")
            self.sizes[i] = lengths[i]
            self.ptrs[i] = &data[0] + offsets[i] if lengths[i] > 0 else NULL
        return self

    def __len__(self):
        return self.n


cdef DecodeOptions _options(bint fast, bint strict, int64_t max_pixels, int max_scans):
    cdef DecodeOptions o
    o.fast = fast
    o.strict = strict
    o.max_pixels = max_pixels
    o.max_scans = max_scans
    return o


def py_choose_scale(int64_t height, int64_t width, int min_h, int min_w):
    """choose_scale for Python callers."""
    return choose_scale(height, width, min_h, min_w)


cdef _header_or_raise(Decoder* d, const uint8_t[::1] data):
    cdef int rc
    with nogil:
        rc = dec_read_header(d, &data[0] if data.shape[0] else NULL, data.shape[0])
    if rc != DP_OK:
        raise DecodeError(dec_message(d).decode("utf-8", "replace"))


def read_header(const uint8_t[::1] data, int64_t max_pixels, int max_scans):
    """(width, height, components, colorspace code, progressive, arithmetic) of one JPEG.
    Raises DecodeError with libjpeg's message when the header cannot be read."""
    cdef Decoder d
    cdef DecodeOptions o = _options(0, 0, max_pixels, max_scans)
    cdef int rc
    dec_init(&d, &o)
    try:
        _header_or_raise(&d, data)
        return (d.info.width, d.info.height, d.info.components, d.info.colorspace,
                bool(d.info.progressive), bool(d.info.arithmetic))
    finally:
        dec_free(&d)


def decode(const uint8_t[::1] data, region, int min_h, int min_w, bint fast, bint strict,
           int64_t max_pixels, int max_scans):
    """Decode one JPEG (or the region (top, left, height, width) of it, full-resolution pixels)
    at the smallest power-of-two DCT scale that keeps the region at least min_h x min_w.
    Returns (uint8 array (h, w, 3), scale in eighths). Raises DecodeError on bad data,
    ConfigError for a region outside the image."""
    cdef Decoder d
    cdef DecodeOptions o = _options(fast, strict, max_pixels, max_scans)
    cdef Region r
    cdef int rc, scale, top, left, height, width
    cdef uint8_t[:, :, ::1] out
    dec_init(&d, &o)
    try:
        _header_or_raise(&d, data)
        if region is None:
            top, left, height, width = 0, 0, d.info.height, d.info.width
        else:
            top, left, height, width = region
        scale = choose_scale(height, width, min_h, min_w)
        if scale_region(&d.info, scale, top, left, height, width, &r) != DP_OK:
            raise ConfigError(f"region (top={top}, left={left}, height={height}, "
                             f"width={width}) is not inside the {d.info.width}x{d.info.height} image")
        arr = np.empty((r.height, r.width, 3), dtype=np.uint8)
        out = arr
        with nogil:
            rc = dec_decode(&d, scale, &r, &out[0, 0, 0], out.strides[0])
        if rc != DP_OK:
            raise DecodeError(dec_message(&d).decode("utf-8", "replace"))
        return arr, scale
    finally:
        dec_free(&d)


def decode_batch(BufferList buffers, uint8_t[:, :, :, ::1] out, const int64_t[:, ::1] regions,
                 int min_h, int min_w, bint fast, bint strict, int64_t max_pixels,
                 int max_scans, int32_t[:, ::1] shapes, int32_t[::1] status):
    """Decode buffers[i] (region regions[i] if given) into out[i, :h, :w] with the GIL released
    for the whole batch. Fills shapes[i] = (h, w, scale) and status[i] (0 or a DP_E* code);
    returns {i: message} for the failed samples."""
    cdef Py_ssize_t n = buffers.n, i
    cdef Decoder d
    cdef DecodeOptions o = _options(fast, strict, max_pixels, max_scans)
    cdef Region r
    cdef int rc, scale, top, left, height, width
    cdef int use_regions = regions is not None
    cdef char* messages
    if out.shape[0] < n or shapes.shape[0] < n or status.shape[0] < n:
        raise ConfigError("out, shapes and status need one entry per buffer")
    if use_regions and (regions.shape[0] < n or regions.shape[1] != 4):
        raise ConfigError("regions must have shape (N, 4): top, left, height, width")
    messages = <char*>malloc(max(n, 1) * 200)
    if messages == NULL:
        raise MemoryError()
    dec_init(&d, &o)
    try:
        with nogil:
            for i in range(n):
                messages[i * 200] = 0
                rc = dec_read_header(&d, buffers.ptrs[i], buffers.sizes[i])
                if rc == DP_OK:
                    if use_regions:
                        top = regions[i, 0]
                        left = regions[i, 1]
                        height = regions[i, 2]
                        width = regions[i, 3]
                    else:
                        top, left, height, width = 0, 0, d.info.height, d.info.width
                    scale = choose_scale(height, width, min_h, min_w)
                    rc = scale_region(&d.info, scale, top, left, height, width, &r)
                    if rc != DP_OK:
                        rc = _fail(&d, DP_EREGION, b"region outside the image")
                    elif r.height > out.shape[1] or r.width > out.shape[2]:
                        rc = _fail(&d, DP_EREGION, b"decoded region larger than the output slot")
                    else:
                        rc = dec_decode(&d, scale, &r, &out[i, 0, 0, 0], out.strides[1])
                        shapes[i, 0] = r.height
                        shapes[i, 1] = r.width
                        shapes[i, 2] = scale
                if rc != DP_OK:
                    strncpy(messages + i * 200, dec_message(&d), 199)
                    messages[i * 200 + 199] = 0
                    shapes[i, 0] = 0
                    shapes[i, 1] = 0
                    shapes[i, 2] = 0
                status[i] = rc
        return {i: messages[i * 200:].split(b"\0", 1)[0].decode("utf-8", "replace")
                for i in range(n) if status[i] != DP_OK}
    finally:
        dec_free(&d)
        free(messages)


cdef extern from *:
    """
    #if defined(__AVX512F__)
    #define DP_SIMD "AVX-512"
    #elif defined(__AVX2__)
    #define DP_SIMD "AVX2"
    #elif defined(__AVX__)
    #define DP_SIMD "AVX"
    #elif defined(__SSE4_2__)
    #define DP_SIMD "SSE4.2"
    #elif defined(__ARM_NEON) || defined(__aarch64__)
    #define DP_SIMD "NEON"
    #elif defined(__SSE2__)
    #define DP_SIMD "SSE2"
    #else
    #define DP_SIMD "none"
    #endif
    #if defined(__clang__)
    #define DP_COMPILER "clang " __clang_version__
    #elif defined(__GNUC__)
    #define DP_COMPILER "gcc " __VERSION__
    #else
    #define DP_COMPILER "unknown"
    #endif
    #ifdef _OPENMP
    #define DP_OPENMP _OPENMP
    #else
    #define DP_OPENMP 0
    #endif
    """
    const char* DP_SIMD
    const char* DP_COMPILER
    const char* DPU_PIPE_MARCH
    int DPU_PIPE_DEBUG
    int DP_OPENMP


def build_flags():
    """What this extension was compiled with: libjpeg-turbo version, SIMD and compiler."""
    cdef int v = lj.LIBJPEG_TURBO_VERSION_NUMBER
    return {
        "libjpeg_turbo": f"{v // 1000000}.{v // 1000 % 1000}.{v % 1000}" if v else "unknown",
        "arithmetic_decoding": bool(lj.DP_ARITH_DECODING),
        "simd": DP_SIMD.decode(),
        "march": DPU_PIPE_MARCH.decode(),
        "compiler": DP_COMPILER.decode(),
        "debug_build": bool(DPU_PIPE_DEBUG),
        "openmp": DP_OPENMP,
    }
