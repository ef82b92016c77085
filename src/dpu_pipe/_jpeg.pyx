# JPEG decoding over libjpeg-turbo's jpeglib API: header, region decode with early stop,
# DCT-scaled decode, colour conversion to RGB, and libjpeg errors turned into status codes.
from libc.stdint cimport uint8_t, int32_t, int64_t
from libc.stdlib cimport calloc, malloc, realloc, free
from libc.string cimport memchr, memcmp, memcpy, memset, strncpy
from libc.setjmp cimport setjmp, longjmp
cimport dpu_pipe._libjpeg as lj

import numpy as np

from dpu_pipe.errors import ConfigError, DecodeError

# Extra output columns decoded on each side of a region: fancy upsampling of subsampled chroma
# reads one neighbouring chroma sample, and libjpeg treats the edge of a cropped scanline as the
# image edge. Decoding a little beyond the region keeps it identical to the full decode.
cdef enum:
    CROP_MARGIN = 4

# Output pixels of the sub-image kept on each side of a region read from restart intervals.
# Fancy (triangle) chroma upsampling by 2 reads one chroma sample beyond an output pixel, so an
# output pixel two or more pixels inside a sub-image edge is the image's own; chroma upsampled by
# other factors, or by DCT scaling, reads nothing beyond its block.
cdef enum:
    ASSEMBLY_MARGIN = 2


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
    free(d.scratch)
    free(d.marks)
    d.row, d.scratch, d.marks = NULL, NULL, NULL
    d.row_cap = d.scratch_cap = d.marks_cap = 0


cdef const char* dec_message(const Decoder* d) noexcept nogil:
    return d.err.message


cdef int _fail(Decoder* d, int code, const char* message) noexcept nogil:
    strncpy(d.err.message, message, 199)
    d.err.message[199] = 0
    return code


cdef int dec_read_header(Decoder* d, const uint8_t* data, size_t size) noexcept nogil:
    """Parse the markers of one image; apply the pixel budget. The decoder may hold a previous
    image: it is released first."""
    cdef int m
    d.header_ok = 0
    d.err.message[0] = 0
    d.src = data
    d.src_size = size
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
    if d.save_markers:
        lj.jpeg_save_markers(&d.cinfo, lj.JPEG_COM, 0xFFFF)
        for m in range(16):
            lj.jpeg_save_markers(&d.cinfo, lj.JPEG_APP0 + m, 0xFFFF)
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
                    uint8_t* out, Py_ssize_t out_stride, int room) noexcept nogil:
    """Decode `region` (in pixels of the image scaled by scale/8) into `out` (rows of
    region.width * 3 bytes, `out_stride` bytes apart) and stop after its last row; with `room`
    free pixels each side of a row, libjpeg writes it there (a copy's cost varies with layout).

    A baseline Huffman stream with restart markers is decoded from a sub-stream holding only
    the restart intervals that cover the region (dec_assemble); its pixels are the same."""
    cdef Region sub
    cdef JpegInfo info
    cdef const uint8_t* src
    cdef size_t size
    cdef int rc
    d.assembled = 0
    if (d.header_ok and d.opts.intervals and d.cinfo.restart_interval
            and dec_assemble(d, scale, region, &sub)):
        src, size, info = d.src, d.src_size, d.info
        rc = dec_read_header(d, d.scratch, d.scratch_len)
        if rc == DP_OK:
            rc = _decode_plain(d, scale, &sub, out, out_stride, room)
        d.src, d.src_size, d.info = src, size, info
        if rc == DP_OK:
            d.assembled = 1
            return DP_OK
        # The original's own decode says what is wrong with the data (or decodes it).
        rc = dec_read_header(d, src, size)
        if rc != DP_OK:
            return rc
    return _decode_plain(d, scale, region, out, out_stride, room)


cdef int _decode_plain(Decoder* d, int scale, const Region* region,
                       uint8_t* out, Py_ssize_t out_stride, int room) noexcept nogil:
    # Region decode of the stream as it is: crop columns, skip rows, stop after the last row.
    cdef lj.j_decompress_ptr cinfo = &d.cinfo
    cdef lj.JDIMENSION xoff, cw, skip
    cdef lj.JSAMPROW rowptr
    cdef int cmyk, y, r_end, xend, comps, shift, direct
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
    # libjpeg-turbo before 2.1 (2.0.x: Ubuntu 20.04, the wheels' bundled library) overruns the
    # heap when jpeg_crop_scanline meets its merged upsampler (plain chroma upsampling: fast
    # mode); whole rows are decoded there instead, the same pixels.
    if d.opts.fast and lj.LIBJPEG_TURBO_VERSION_NUMBER < 2001000:
        pass
    elif region.left > CROP_MARGIN or region.left + region.width + CROP_MARGIN < <int>cw:
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
    direct = not cmyk and shift <= 3 * room and <int>need - shift <= 3 * (region.width + room)

    if region.top > 0:
        skip = lj.jpeg_skip_scanlines(cinfo, region.top)
        if skip != <lj.JDIMENSION>region.top:
            lj.jpeg_abort_decompress(cinfo)
            return _fail(d, DP_EDECODE, b"could not skip to the region's first row")
    r_end = region.top + region.height
    y = 0
    while <int>cinfo.output_scanline < r_end:
        rowptr = out + y * out_stride - shift if direct else d.row
        if lj.jpeg_read_scanlines(cinfo, &rowptr, 1) != 1:
            lj.jpeg_abort_decompress(cinfo)
            return _fail(d, DP_EDECODE, b"decoder returned no scanline")
        if cmyk:
            _cmyk_to_rgb(d.row + shift, out + y * out_stride, region.width)
        elif not direct:
            memcpy(out + y * out_stride, d.row + shift, <size_t>region.width * 3)
        y += 1
    # Early stop: the rest of the entropy-coded data is never decoded.
    lj.jpeg_abort_decompress(cinfo)
    return DP_OK


# --- region decode from the restart intervals that cover it ---------------------------------------
#
# In a baseline Huffman stream with restart markers every R MCUs, each interval is a byte-aligned
# segment that decodes on its own (DC predictors reset at each marker). The intervals covering a
# region plus ASSEMBLY_MARGIN pixels, concatenated under a SOF that claims the sub-image's size
# and with renumbered RST markers, form a valid JPEG whose decode is the original's decode there,
# bit for bit, at any DCT scale, without Huffman-decoding the rows above the region. Nothing in
# the stream is trusted: any surprise returns 0 so that the plain decode handles the data.

cdef inline int _be16(const uint8_t* p) noexcept nogil:
    return (<int>p[0] << 8) | p[1]


cdef inline int64_t _ceil_div(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


cdef int64_t _next_marker(const uint8_t* p, size_t pos, size_t n, int* code,
                          size_t* after) noexcept nogil:
    """Offset of the next marker at or after pos in entropy-coded data (its first 0xFF; fill
    bytes and stuffed 0xFF 0x00 skipped as libjpeg does), its code and the offset past it;
    -1 when the data ends first."""
    cdef const uint8_t* f
    cdef size_t m, j
    while pos < n:
        f = <const uint8_t*>memchr(p + pos, 0xFF, n - pos)
        if f == NULL:
            return -1
        m = f - p
        j = m + 1
        while j < n and p[j] == 0xFF:
            j += 1
        if j >= n:
            return -1
        if p[j] == 0:
            pos = j + 1
            continue
        code[0] = p[j]
        after[0] = j + 1
        return <int64_t>m
    return -1


cdef int dec_grow(void** buf, size_t* cap, size_t need) noexcept nogil:
    cdef void* grown
    if need <= cap[0]:
        return 1
    grown = realloc(buf[0], need)
    if grown == NULL:
        return 0
    buf[0] = grown
    cap[0] = need
    return 1


cdef int dec_assemble(Decoder* d, int scale, const Region* region, Region* sub) noexcept nogil:
    """After dec_read_header: write to d.scratch (d.scratch_len bytes) a JPEG made of the
    restart intervals covering `region` (pixels at scale/8) plus ASSEMBLY_MARGIN, and set
    *sub to the region in that sub-image's pixels. Returns 1, or 0 (scratch unspecified) when
    the stream is not a single-scan baseline Huffman stream with restart intervals, when its
    markers are not where and what they must be, or when the sub-stream would hold every row the
    plain decode reads anyway. Columns are skipped when the interval divides an MCU row; else
    whole rows are taken, from the nearest row above the region where an interval starts."""
    cdef lj.j_decompress_ptr c = &d.cinfo
    cdef const uint8_t* p = d.src
    cdef uint8_t* s
    cdef size_t n = d.src_size, pos, seg, out, sof = 0, after
    cdef int64_t mpr, rows, R, n_int, r0, r1, c0, c1, r, k, k_first, k_last
    cdef int64_t ka, kb, emitted, at
    cdef int mcu_w, mcu_h, mhs, mws, marker, length, code, sub_h, sub_w, H, W, by_rows
    if (c.progressive_mode or c.arith_code or c.data_precision != 8 or c.restart_interval == 0
            or c.comps_in_scan != c.num_components or scale < 1 or scale > 8 or p == NULL):
        return 0
    H = c.image_height
    W = c.image_width
    if c.num_components == 1:      # a non-interleaved scan: one block per MCU
        mcu_w = mcu_h = 8
    else:
        mcu_w = 8 * c.max_h_samp_factor
        mcu_h = 8 * c.max_v_samp_factor
    if (mcu_w * scale) % 8 or (mcu_h * scale) % 8:
        return 0
    mws = mcu_w * scale // 8       # one MCU in output pixels
    mhs = mcu_h * scale // 8
    mpr = _ceil_div(W, mcu_w)
    rows = _ceil_div(H, mcu_h)
    R = c.restart_interval
    n_int = _ceil_div(mpr * rows, R)
    if region.top < 0 or region.left < 0 or region.height <= 0 or region.width <= 0:
        return 0
    r0 = (region.top - ASSEMBLY_MARGIN) // mhs
    r1 = _ceil_div(region.top + region.height + ASSEMBLY_MARGIN, mhs)
    c0 = (region.left - ASSEMBLY_MARGIN) // mws
    c1 = _ceil_div(region.left + region.width + ASSEMBLY_MARGIN, mws)
    r0 = 0 if r0 < 0 else r0
    c0 = 0 if c0 < 0 else c0
    r1 = rows if r1 > rows else r1
    c1 = mpr if c1 > mpr else c1
    # libjpeg upsamples chroma plainly when a component is at most 2 samples wide: keep the
    # sub-image at least 2 MCUs wide and high, as every image of more than one MCU is.
    if r1 - r0 < 2 and rows >= 2:
        r0, r1 = (r0, r1 + 1) if r1 < rows else (r0 - 1, r1)
    if c1 - c0 < 2 and mpr >= 2:
        c0, c1 = (c0, c1 + 1) if c1 < mpr else (c0 - 1, c1)
    by_rows = mpr % R == 0
    if by_rows:
        # Every MCU row is a whole number of intervals: take the columns' intervals row by row.
        c0 -= c0 % R
        c1 = _ceil_div(c1, R) * R
    else:
        # Intervals run across row ends: whole rows, from one where an interval starts (the
        # last interval taken may reach past r1; the decoder stops before its extra MCUs).
        c0, c1 = 0, mpr
        while (r0 * mpr) % R:
            r0 -= 1
    if r0 >= r1 or c0 >= c1 or (r0 == 0 and c0 == 0 and c1 == mpr):
        return 0
    sub_h = H - r0 * mcu_h if r1 == rows else (r1 - r0) * mcu_h
    sub_w = W - c0 * mcu_w if c1 == mpr else (c1 - c0) * mcu_w
    sub.top = region.top - r0 * mhs
    sub.left = region.left - c0 * mws
    sub.height = region.height
    sub.width = region.width
    if (sub.top + sub.height > scaled_size(sub_h, scale)
            or sub.left + sub.width > scaled_size(sub_w, scale)):
        return 0

    # Every byte written comes from a distinct byte range of the source followed there by a
    # marker at least as long as what is written in its place, so n + 2 bytes always suffice.
    if not dec_grow(<void**>&d.scratch, &d.scratch_cap, n + 16):
        return 0
    s = d.scratch
    # Header: the original's segments up to and including the first SOS, without the APPn/COM
    # segments libjpeg ignores when decoding (EXIF, ICC, XMP and comments: often kilobytes).
    if n < 4 or p[0] != 0xFF or p[1] != 0xD8:
        return 0
    s[0] = 0xFF
    s[1] = 0xD8
    out = 2
    pos = 2
    while True:
        while pos + 1 < n and p[pos] == 0xFF and p[pos + 1] == 0xFF:
            pos += 1               # fill bytes
        if pos + 4 > n or p[pos] != 0xFF:
            return 0
        marker = p[pos + 1]
        length = _be16(p + pos + 2)
        if length < 2 or pos + 2 + length > n:
            return 0
        if marker == 0xC0 or marker == 0xC1:
            if (sof or length != 8 + 3 * c.num_components or p[pos + 4] != 8
                    or _be16(p + pos + 5) != H or _be16(p + pos + 7) != W
                    or p[pos + 9] != c.num_components):
                return 0
            sof = out
        elif (0xC2 <= marker <= 0xCF and marker != 0xC4 and marker != 0xC8
                and marker != 0xCC) or marker < 0xC0 or marker == 0xD8 or marker == 0xD9 \
                or 0xD0 <= marker <= 0xD7:
            return 0               # another frame type, or a marker that has no place here
        if not ((0xE1 <= marker <= 0xED) or marker == 0xEF or marker == 0xFE):
            memcpy(s + out, p + pos, 2 + length)
            out += 2 + length
        pos += 2 + length
        if marker == 0xDA:
            break
    if not sof:
        return 0
    s[sof + 5] = <uint8_t>(sub_h >> 8)
    s[sof + 6] = <uint8_t>(sub_h & 0xFF)
    s[sof + 7] = <uint8_t>(sub_w >> 8)
    s[sof + 8] = <uint8_t>(sub_w & 0xFF)

    # Find [start, end) of intervals k_first..k_last by a scan of the entropy-coded data that
    # stops at the last one needed; each must end with the RST marker of its number.
    k_first = (r0 * mpr + c0) // R
    k_last = ((r1 - 1) * mpr + c1 - 1) // R
    if not dec_grow(<void**>&d.marks, &d.marks_cap, <size_t>(k_last - k_first + 1) * 2 * sizeof(size_t)):
        return 0
    seg = pos
    for k in range(k_last + 1):
        at = _next_marker(p, seg, n, &code, &after)
        if at < 0:
            return 0               # cut short: the plain decode reports it
        if k < n_int - 1:
            if code != 0xD0 + k % 8:
                return 0           # missing, extra or misnumbered restart marker
        elif 0xD0 <= code <= 0xD7:
            return 0               # more restart markers than intervals
        if k >= k_first:
            d.marks[2 * (k - k_first)] = seg
            d.marks[2 * (k - k_first) + 1] = <size_t>at
        seg = after

    emitted = 0
    r = r0
    while r < r1:
        ka = (r * mpr + c0) // R
        kb = (r * mpr + c1 - 1) // R
        if not by_rows:
            ka, kb, r = k_first, k_last, r1
        for k in range(ka, kb + 1):
            if emitted:
                s[out] = 0xFF
                s[out + 1] = <uint8_t>(0xD0 + (emitted - 1) % 8)
                out += 2
            seg = d.marks[2 * (k - k_first)]
            after = d.marks[2 * (k - k_first) + 1]
            memcpy(s + out, p + seg, after - seg)
            out += after - seg
            emitted += 1
        r += 1
    s[out] = 0xFF
    s[out + 1] = 0xD9
    d.scratch_len = out + 2
    return 1


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
            # offsets[i] + lengths[i] could overflow int64 and pass a sum test.
            if (offsets[i] < 0 or lengths[i] < 0 or offsets[i] > total
                    or lengths[i] > total - offsets[i]):
                raise ConfigError(f"record {i} (offset {offsets[i]}, length {lengths[i]}) "
                                 f"lies outside the {total}-byte buffer")
            self.sizes[i] = lengths[i]
            self.ptrs[i] = &data[0] + offsets[i] if lengths[i] > 0 else NULL
        return self

    def __len__(self):
        return self.n


cdef DecodeOptions _options(bint fast, bint strict, int64_t max_pixels, int max_scans,
                           bint intervals=True):
    return DecodeOptions(fast, strict, max_pixels, max_scans, intervals)


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
    dec_init(&d, &o)
    try:
        _header_or_raise(&d, data)
        return (d.info.width, d.info.height, d.info.components, d.info.colorspace,
                bool(d.info.progressive), bool(d.info.arithmetic))
    finally:
        dec_free(&d)


def decode(const uint8_t[::1] data, region, int min_h, int min_w, bint fast, bint strict,
           int64_t max_pixels, int max_scans, bint intervals=True, bint report=False,
           int scale=0):
    """Decode one JPEG (or the region (top, left, height, width) of it, full-resolution pixels)
    at the smallest power-of-two DCT scale that keeps the region at least min_h x min_w, or at
    DCT scale ``scale``/8 when it is given (1..8).
    Returns (uint8 array (h, w, 3), scale in eighths), and with ``report`` a third item: whether
    only the covering restart intervals were decoded. ``intervals=False`` forces the plain
    region decode. Raises DecodeError on bad data, ConfigError for a region outside the image."""
    cdef Decoder d
    cdef DecodeOptions o = _options(fast, strict, max_pixels, max_scans, intervals)
    cdef Region r
    cdef int rc, top, left, height, width
    cdef uint8_t[:, :, ::1] out
    if not 0 <= scale <= 8:
        raise ConfigError(f"scale must be 1..8 eighths (0: chosen from min_h, min_w), got {scale}")
    dec_init(&d, &o)
    try:
        _header_or_raise(&d, data)
        if region is None:
            top, left, height, width = 0, 0, d.info.height, d.info.width
        else:
            top, left, height, width = region
        if scale == 0:
            scale = choose_scale(height, width, min_h, min_w)
        if scale_region(&d.info, scale, top, left, height, width, &r) != DP_OK:
            raise ConfigError(f"region (top={top}, left={left}, height={height}, "
                             f"width={width}) is not inside the {d.info.width}x{d.info.height} image")
        arr = np.empty((r.height, r.width, 3), dtype=np.uint8)
        out = arr
        with nogil:
            rc = dec_decode(&d, scale, &r, &out[0, 0, 0], out.strides[0], 0)
        if rc != DP_OK:
            raise DecodeError(dec_message(&d).decode("utf-8", "replace"))
        return (arr, scale, bool(d.assembled)) if report else (arr, scale)
    finally:
        dec_free(&d)


def assemble(const uint8_t[::1] data, region, int min_h, int min_w):
    """The sub-stream a region decode of `data` reads instead of the whole stream:
    (JPEG bytes, region (top, left, height, width) in that image's pixels at the chosen DCT
    scale, scale in eighths, (top, left) of the sub-image in the full-resolution image), or
    None when the plain region decode applies. For tests and measurements; decode() does this
    internally."""
    cdef Decoder d
    cdef DecodeOptions o = _options(0, 0, 1 << 62, 1000)
    cdef Region r, sub
    cdef int rc, scale, ok
    dec_init(&d, &o)
    try:
        _header_or_raise(&d, data)
        top, left, height, width = region
        scale = choose_scale(height, width, min_h, min_w)
        if scale_region(&d.info, scale, top, left, height, width, &r) != DP_OK:
            raise ConfigError(f"region {region} lies outside the image")
        with nogil:
            ok = dec_assemble(&d, scale, &r, &sub)
        if not ok:
            return None
        return (bytes(d.scratch[:d.scratch_len]), (sub.top, sub.left, sub.height, sub.width),
                scale, ((r.top - sub.top) * 8 // scale, (r.left - sub.left) * 8 // scale))
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
                        top, left = regions[i, 0], regions[i, 1]
                        height, width = regions[i, 2], regions[i, 3]
                    else:
                        top, left, height, width = 0, 0, d.info.height, d.info.width
                    scale = choose_scale(height, width, min_h, min_w)
                    rc = scale_region(&d.info, scale, top, left, height, width, &r)
                    if rc != DP_OK:
                        rc = _fail(&d, DP_EREGION, b"region outside the image")
                    elif r.height > out.shape[1] or r.width > out.shape[2]:
                        rc = _fail(&d, DP_EREGION, b"decoded region larger than the output slot")
                    else:
                        rc = dec_decode(&d, scale, &r, &out[i, 0, 0, 0], out.strides[1], 0)
                        shapes[i, 0], shapes[i, 1], shapes[i, 2] = r.height, r.width, scale
                if rc != DP_OK:
                    strncpy(messages + i * 200, dec_message(&d), 199)
                    messages[i * 200 + 199] = 0
                    shapes[i, 0] = shapes[i, 1] = shapes[i, 2] = 0
                status[i] = rc
        return {i: messages[i * 200:].split(b"\0", 1)[0].decode("utf-8", "replace")
                for i in range(n) if status[i] != DP_OK}
    finally:
        dec_free(&d)
        free(messages)


# --- lossless transcoding to baseline Huffman with restart markers --------------------------------

cdef enum:
    TR_OK = 0
    TR_ERROR = -1        # libjpeg cannot read the data (or a budget is exceeded)
    TR_WARNING = -5      # libjpeg reads it only with a corrupt-data warning
    TR_UNSUPPORTED = -6  # readable, but this build cannot transcode it


cdef struct MemDest:     # libjpeg destination writing to a buffer this module owns
    lj.jpeg_destination_mgr pub
    uint8_t* buf
    size_t cap
    size_t size


cdef struct Transcoder:
    Decoder dec          # reads the coefficients, with the decoder's budgets and error manager
    lj.jpeg_compress_struct cinfo
    int created
    MemDest dest


cdef void _dest_init(lj.j_compress_ptr cinfo) noexcept nogil:
    cdef MemDest* md = <MemDest*>cinfo.dest
    md.pub.next_output_byte = md.buf
    md.pub.free_in_buffer = md.cap


cdef lj.boolean _dest_empty(lj.j_compress_ptr cinfo) noexcept nogil:
    # Called with the whole buffer full: double it (libjpeg's own memory destination leaks its
    # buffer when a later error longjmps out; this one is freed by the transcoder's owner).
    cdef MemDest* md = <MemDest*>cinfo.dest
    cdef ErrorMgr* err = <ErrorMgr*>cinfo.err
    cdef uint8_t* grown = <uint8_t*>realloc(md.buf, md.cap * 2)
    if grown == NULL:
        strncpy(err.message, b"out of memory for the transcoded stream", 199)
        longjmp(err.jump, 3)
    md.buf = grown
    md.pub.next_output_byte = grown + md.cap
    md.pub.free_in_buffer = md.cap
    md.cap *= 2
    return 1


cdef void _dest_term(lj.j_compress_ptr cinfo) noexcept nogil:
    cdef MemDest* md = <MemDest*>cinfo.dest
    md.size = md.cap - md.pub.free_in_buffer


cdef int _is_written_by_libjpeg(lj.jpeg_saved_marker_ptr m) noexcept nogil:
    # jpeg_write_coefficients writes its own JFIF APP0 or Adobe APP14 for the colour space.
    if m.marker == lj.JPEG_APP0 and m.data_length >= 5:
        return memcmp(m.data, b"JFIF\0", 5) == 0
    if m.marker == lj.JPEG_APP0 + 14 and m.data_length >= 5:
        return memcmp(m.data, b"Adobe", 5) == 0
    return 0


cdef int _transcode(Transcoder* t, const uint8_t* data, size_t size, int interval, int in_rows,
                    int optimize, int copy_markers) noexcept nogil:
    """Read the DCT coefficients of `data` and write them as one baseline Huffman scan with a
    restart marker every `interval` MCUs (or every `in_rows` MCU rows) to t.dest. Returns TR_*;
    the reason is in dec_message(&t.dec)."""
    cdef Decoder* d = &t.dec
    cdef lj.jvirt_barray_ptr* coefs
    cdef lj.jpeg_saved_marker_ptr m
    cdef int rc, jumped
    d.save_markers = copy_markers
    rc = dec_read_header(d, data, size)
    if rc != DP_OK:
        return TR_WARNING if rc == DP_EDECODE and d.err.pub.num_warnings > 0 else rc
    if d.cinfo.arith_code and not lj.DP_ARITH_DECODING:
        lj.jpeg_abort_decompress(&d.cinfo)
        return _fail(d, TR_UNSUPPORTED, b"arithmetic-coded JPEG: this libjpeg build cannot "
                                        b"read its coefficients")
    jumped = setjmp(d.err.jump)
    if jumped:
        if t.created:
            lj.jpeg_destroy_compress(&t.cinfo)
            t.created = 0
        lj.jpeg_abort_decompress(&d.cinfo)
        if jumped == 3:
            return DP_ENOMEM
        return TR_WARNING if jumped == 1 and d.err.pub.num_warnings > 0 else TR_ERROR
    coefs = lj.jpeg_read_coefficients(&d.cinfo)
    t.cinfo.err = &d.err.pub
    lj.jpeg_create_compress(&t.cinfo)
    t.created = 1
    lj.jpeg_copy_critical_parameters(&d.cinfo, &t.cinfo)
    t.cinfo.optimize_coding = optimize
    t.cinfo.restart_interval = interval
    t.cinfo.restart_in_rows = in_rows
    t.dest.cap = size + size // 4 + 4096
    t.dest.buf = <uint8_t*>malloc(t.dest.cap)
    if t.dest.buf == NULL:
        strncpy(d.err.message, b"out of memory for the transcoded stream", 199)
        longjmp(d.err.jump, 3)
    t.dest.pub.init_destination = _dest_init
    t.dest.pub.empty_output_buffer = _dest_empty
    t.dest.pub.term_destination = _dest_term
    t.cinfo.dest = &t.dest.pub
    lj.jpeg_write_coefficients(&t.cinfo, coefs)
    m = d.cinfo.marker_list
    while m != NULL:
        if not _is_written_by_libjpeg(m):
            lj.jpeg_write_marker(&t.cinfo, m.marker, m.data, m.data_length)
        m = m.next
    lj.jpeg_finish_compress(&t.cinfo)
    lj.jpeg_destroy_compress(&t.cinfo)
    t.created = 0
    lj.jpeg_abort_decompress(&d.cinfo)
    return TR_OK


def transcode(const uint8_t[::1] data, int restart_interval, int restart_rows, bint optimize,
              bint copy_markers, int64_t max_pixels, int max_scans):
    """Lossless transcode (see dpu_pipe.jpeg.transcode). Returns the new JPEG as bytes; raises
    TranscodeUnsupported or DecodeError (dpu_pipe.errors), MemoryError."""
    from dpu_pipe.errors import DecodeError, TranscodeUnsupported
    cdef Transcoder* t = <Transcoder*>calloc(1, sizeof(Transcoder))
    cdef DecodeOptions o = _options(0, 1, max_pixels, max_scans)
    cdef int rc
    if t == NULL:
        raise MemoryError()
    dec_init(&t.dec, &o)
    try:
        with nogil:
            rc = _transcode(t, &data[0] if data.shape[0] else NULL, data.shape[0],
                            restart_interval, restart_rows, optimize, copy_markers)
        message = dec_message(&t.dec).decode("utf-8", "replace")
        if rc == TR_OK:
            return bytes(t.dest.buf[:t.dest.size])
        if rc == DP_ENOMEM:
            raise MemoryError(message)
        if rc == TR_WARNING or rc == TR_UNSUPPORTED:
            raise TranscodeUnsupported(message)
        raise DecodeError(message)
    finally:
        if t.created:
            lj.jpeg_destroy_compress(&t.cinfo)
        dec_free(&t.dec)
        free(t.dest.buf)
        free(t)


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
