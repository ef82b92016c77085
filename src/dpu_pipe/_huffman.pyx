# Python face of the baseline Huffman entropy decoder (_huffman.h) and of the region decode
# built on it (_idct.h): coefficient blocks of a JPEG, or of the MCU rectangle covering a
# region; the pixels of a box, bit-identical to libjpeg-turbo's region decode (or None where
# libjpeg-turbo must decode). For tests, fuzzing and measurements; a pixel path calls the C
# functions of _huffman.pxd directly.
from libc.stdint cimport uint8_t, uint16_t, int16_t, int32_t, int64_t
from libc.stdlib cimport malloc, calloc, free
cimport dpu_pipe._libjpeg as lj
from dpu_pipe._jpeg cimport choose_scale, scale_region, JpegInfo, Region, DP_OK

import numpy as np

from dpu_pipe.errors import ConfigError, DecodeError

_MESSAGES = {
    HP_EDATA: "damaged entropy-coded data or markers",
    HP_ESIZE: "MCU rectangle outside the image",
}


def header(const uint8_t[::1] data):
    """What the decoder reads from the markers of `data`: a dict with width, height,
    components [(id, h, v, quant table)], mcus (rows, columns), restart_interval (MCUs, 0 for
    none), intervals, scan_start (byte offset); None when the stream is not one this decoder
    takes (progressive, arithmetic, 12-bit, several scans...). Raises DecodeError on markers
    that cannot be parsed."""
    cdef hp_header* h = <hp_header*>malloc(sizeof(hp_header))
    cdef int rc, i
    if h == NULL:
        raise MemoryError()
    try:
        with nogil:
            rc = hp_read_header(h, &data[0] if data.shape[0] else NULL, data.shape[0])
        if rc == HP_UNSUPPORTED:
            return None
        if rc != HP_OK:
            raise DecodeError("cannot parse the JPEG markers")
        return {"width": h.width, "height": h.height,
                "components": [(h.comp[i].id, h.comp[i].h, h.comp[i].v, h.comp[i].tq)
                               for i in range(h.ncomp)],
                "mcus": (h.mcuy, h.mcux), "restart_interval": h.restart_interval,
                "intervals": h.n_int, "scan_start": h.scan_start}
    finally:
        free(h)


cdef inline const uint8_t* _index_ptr(const uint8_t[::1] index) noexcept nogil:
    # A zero-length view has no element 0; hp_index_intervals reads nothing then.
    return &index[0] if index.shape[0] else <const uint8_t*>""


cdef int _locate(const hp_header* h, const uint8_t* p, size_t n, intervals, int64_t need,
                 size_t* starts, size_t* ends) except? -100:
    """starts/ends of the first ``need`` intervals: from the index entry ``intervals`` when
    given, else by the marker scan."""
    cdef const uint8_t[::1] index
    cdef int rc
    if intervals is None:
        with nogil:
            rc = hp_find_intervals(h, p, n, need, starts, ends)
        return rc
    index = intervals
    with nogil:
        rc = hp_index_intervals(h, p, n, _index_ptr(index), index.shape[0], need, starts, ends)
    return rc


cdef _all_intervals(const uint8_t[::1] data, index):
    """(uint32 offsets of every interval, then the last one's end) or the failing status:
    HP_UNSUPPORTED for a stream without restart markers this decoder reads, else the status
    of the marker scan (index None) or of the index entry's checks."""
    cdef hp_header* h = <hp_header*>malloc(sizeof(hp_header))
    cdef const uint8_t* p = &data[0] if data.shape[0] else NULL
    cdef size_t n = data.shape[0]
    cdef int rc
    cdef size_t[::1] starts, ends
    if h == NULL:
        raise MemoryError()
    try:
        with nogil:
            rc = hp_read_header(h, p, n)
        if rc != HP_OK or not h.restart_interval or n >= 1 << 32:
            return HP_UNSUPPORTED
        starts = np.empty(h.n_int + 1, np.uintp)
        ends = np.empty(h.n_int, np.uintp)
        rc = _locate(h, p, n, index, h.n_int, &starts[0], &ends[0])
        if rc != HP_OK:
            return rc
        starts[h.n_int] = ends[h.n_int - 1]
        return np.asarray(starts).astype(np.uint32)
    finally:
        free(h)


def find_intervals(const uint8_t[::1] data):
    """The restart-interval offsets a packed dataset's index records for ``data``: uint32
    array of ``intervals + 1`` byte offsets (each interval's first entropy-coded byte, then the
    end of the last one), found by the marker scan; None for a stream without restart markers,
    one this decoder does not take, damaged markers, or a record of 4 GiB or more."""
    got = _all_intervals(data, None)
    return None if isinstance(got, int) else got


def interval_offsets(const uint8_t[::1] data, const uint8_t[::1] index):
    """The offsets (uint32 array, as :func:`find_intervals` gives them) that the packed index
    entry ``index`` (varints, see dpu_pipe.packed.format) records for the JPEG ``data``,
    validated against its header and markers as the decoder validates them; DecodeError when
    the entry does not describe this stream's intervals."""
    got = _all_intervals(data, index)
    if isinstance(got, int):
        if got == HP_UNSUPPORTED:
            raise DecodeError("the record has an interval index but no restart markers this "
                              "decoder reads")
        raise DecodeError(f"the record's interval index ({index.shape[0]} bytes) does not "
                          f"match its restart intervals")
    return got


cdef class _CoefJob:
    """One image's part of a coefficient decode: its header, interval offsets and output
    arrays, owned here so that every exit frees them."""
    cdef hp_header* h
    cdef size_t* starts
    cdef size_t* ends
    cdef int16_t* outs[4]
    cdef object arrays
    cdef object data
    cdef int r0, r1, c0, c1

    def __cinit__(self):
        self.h = <hp_header*>malloc(sizeof(hp_header))
        if self.h == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.h)
        free(self.starts)
        free(self.ends)

    cdef int prepare(self, const uint8_t[::1] data, rect, int64_t max_pixels,
                     intervals=None) except -1:
        """Header, rectangle, zeroed arrays and interval offsets; 0, or 1 for a stream the
        decoder does not take."""
        cdef const uint8_t* p = &data[0] if data.shape[0] else NULL
        cdef size_t n = data.shape[0]
        cdef int rc, i, hh, vv
        cdef int64_t need
        cdef int16_t[:, :, ::1] view
        self.data = data
        with nogil:
            rc = hp_read_header(self.h, p, n)
        if rc == HP_UNSUPPORTED:
            return 1
        if rc != HP_OK:
            raise DecodeError("cannot parse the JPEG markers")
        h = self.h
        if <int64_t>h.width * h.height > max_pixels:
            raise DecodeError(f"image of {h.width} x {h.height} pixels exceeds the pixel "
                              f"budget (max_pixels={max_pixels})")
        if rect is None:
            self.r0, self.r1, self.c0, self.c1 = 0, h.mcuy, 0, h.mcux
        else:
            self.r0, self.r1, self.c0, self.c1 = rect
            if not (0 <= self.r0 < self.r1 <= h.mcuy and 0 <= self.c0 < self.c1 <= h.mcux):
                raise ConfigError(f"MCU rectangle {tuple(rect)} is not inside the "
                                  f"{h.mcuy} x {h.mcux} MCUs of the image")
        self.arrays = []
        for i in range(h.ncomp):
            hh = h.comp[i].h if h.interleaved else 1
            vv = h.comp[i].v if h.interleaved else 1
            self.arrays.append(np.zeros(((self.r1 - self.r0) * vv, (self.c1 - self.c0) * hh,
                                         64), np.int16))
            view = self.arrays[i]
            self.outs[i] = &view[0, 0, 0]
        # Intervals up to the one holding the rectangle's last MCU.
        need = 1
        if h.restart_interval:
            need = ((<int64_t>self.r1 - 1) * h.mcux + self.c1 - 1) // h.restart_interval + 1
        self.starts = <size_t*>malloc(need * sizeof(size_t))
        self.ends = <size_t*>malloc(need * sizeof(size_t))
        if self.starts == NULL or self.ends == NULL:
            raise MemoryError()
        rc = _locate(h, p, n, intervals, need, self.starts, self.ends)
        if rc != HP_OK and intervals is not None:
            raise DecodeError("the interval index does not match the stream's restart "
                              "intervals")
        if rc != HP_OK:
            raise DecodeError(_MESSAGES.get(rc, f"entropy decoder status {rc}"))
        return 0

    cdef void fill(self, hp_job* j) noexcept:
        cdef const uint8_t[::1] d = self.data
        j.h = self.h
        j.data = &d[0]
        j.starts = self.starts
        j.ends = self.ends
        j.r0, j.r1, j.c0, j.c1 = self.r0, self.r1, self.c0, self.c1
        j.out = self.outs


cdef int _lanes(int lanes) except -1:
    if not 1 <= lanes <= HP_MAX_LANES:
        raise ConfigError(f"lanes must be in 1..{HP_MAX_LANES}, not {lanes}")
    return lanes


def read_coefficients(const uint8_t[::1] data, rect=None, int64_t max_pixels=1 << 28,
                      int lanes=HP_LANES, intervals=None):
    """DCT coefficients of a baseline Huffman JPEG, as libjpeg-turbo's jpeg_read_coefficients
    gives them: one int16 array per component of shape (block rows, block columns, 64),
    natural order, quantized. With ``rect = (r0, r1, c0, c1)`` (MCU rows [r0, r1) and columns
    [c0, c1)) only that rectangle's blocks, reading only the restart intervals that cover it
    and stopping after its last MCU. ``lanes`` (1..8): restart intervals decoded interleaved
    (the result does not depend on it). Returns None for streams this decoder does not take
    (libjpeg-turbo's path applies); raises DecodeError for damaged data and ConfigError for a
    rectangle outside the image. Memory: 2 bytes per coefficient of the rectangle (about
    2 x 64 x blocks), bounded by ``max_pixels`` (width x height, checked from the header;
    DecodeError beyond it). ``intervals``: a packed index entry (bytes-like, see
    :func:`interval_offsets`) locating the restart intervals instead of the marker scan; one
    that does not match the stream is a DecodeError."""
    cdef _CoefJob cj = _CoefJob()
    cdef hp_job j
    cdef int rc
    _lanes(lanes)
    if cj.prepare(data, rect, max_pixels, intervals):
        return None
    cj.fill(&j)
    with nogil:
        rc = hp_decode_jobs(&j, 1, lanes)
    if rc != HP_OK:
        raise DecodeError(_MESSAGES.get(rc, f"entropy decoder status {rc}"))
    return cj.arrays


def read_coefficients_batch(datas, rects, int64_t max_pixels=1 << 28, int lanes=HP_LANES):
    """read_coefficients of several images at once, their bit streams interleaved in one
    thread: ``lanes`` (1..8) streams in flight, taken from the images in order (for files
    without restart markers each image's scan is one stream, read from its start up to its
    rectangle's last MCU, so several images make the independent streams). ``datas``: uint8
    buffers; ``rects``: one MCU rectangle (or None for the whole image) per buffer. Returns
    one entry per image: its arrays, or None for a stream the decoder does not take. Raises
    DecodeError naming the first damaged image (by position), ConfigError for a bad
    rectangle. Memory: read_coefficients' for every image at once."""
    cdef list jobs_py = []
    cdef list results = []
    cdef _CoefJob cj
    cdef hp_job* jobs
    cdef int i, n, rc
    _lanes(lanes)
    if len(datas) != len(rects):
        raise ConfigError(f"{len(datas)} buffers but {len(rects)} rectangles")
    for i in range(len(datas)):
        cj = _CoefJob()
        try:
            skip = cj.prepare(datas[i], rects[i], max_pixels)
        except DecodeError as e:
            raise DecodeError(f"image {i}: {e}") from None
        results.append(None if skip else cj)
        if not skip:
            jobs_py.append(cj)
    n = len(jobs_py)
    jobs = <hp_job*>calloc(max(n, 1), sizeof(hp_job))
    if jobs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            (<_CoefJob>jobs_py[i]).fill(&jobs[i])
        with nogil:
            hp_decode_jobs(jobs, n, lanes)
        i = 0
        for pos in range(len(results)):
            if results[pos] is None:
                continue
            rc = jobs[i].status
            i += 1
            if rc != HP_OK:
                raise DecodeError(f"image {pos}: "
                                  + _MESSAGES.get(rc, f"entropy decoder status {rc}"))
            results[pos] = (<_CoefJob>results[pos]).arrays
        return results
    finally:
        free(jobs)


px_init_tables()

# libjpeg-turbo 2.1 and later upsample 1x2 chroma (4:4:0) with the triangle filter; whether
# 2.0 does is not established here, so there the region decode leaves 4:4:0 to libjpeg-turbo.
cdef int _FANCY_H1V2 = lj.LIBJPEG_TURBO_VERSION_NUMBER >= 2001000


cdef class _Scratch:
    """Buffers one region decode needs, owned here so that every exit frees them."""
    cdef hp_header* h
    cdef size_t* starts
    cdef size_t* ends
    cdef uint8_t* coef
    cdef uint8_t* planes
    cdef uint8_t* rows

    def __cinit__(self):
        self.h = <hp_header*>malloc(sizeof(hp_header))
        if self.h == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.h)
        free(self.starts)
        free(self.ends)
        free(self.coef)
        free(self.planes)
        free(self.rows)


def simd_levels():
    """Kernel levels of the pixel stages this CPU runs: 0 the scalar reference, 1 the build's
    baseline SIMD (SSE2 on x86-64, NEON on aarch64), 2 AVX2 (x86-64 CPUs that have it). Every
    level gives the same pixels; the region decode runs simd_default()."""
    return list(range(px_simd_max + 1))


def simd_default():
    """The kernel level the region decode runs (the fastest measured on this architecture:
    2 with AVX2, else 1 on aarch64 and 0 on x86-64)."""
    return px_simd_default


def _check_simd(int simd):
    if simd > px_simd_max:
        raise ConfigError(f"kernel level {simd} is not one this CPU runs "
                          f"(simd_levels() = {simd_levels()})")


def idct_blocks(const int16_t[:, ::1] coef, const uint16_t[::1] q, int size, bint fast=False,
                int simd=-1):
    """The IDCT of each block of ``coef`` (n, 64) (quantized, natural order) with quantizers
    ``q`` (64, natural order), as the region decode computes it at kernel level ``simd``
    (simd_levels(); -1 simd_default()): ``size`` 8 the accurate IDCT (``fast``: the fast one),
    4, 2 or 1 the reduced ones. Returns (pixels uint8 (n, size, size), fallback bool (n,)):
    fallback marks blocks for which the region decode hands the image to libjpeg-turbo;
    their pixels are not defined. For tests comparing the levels."""
    cdef int32_t mq[64]
    cdef int i, level = px_simd_default if simd < 0 else simd
    cdef Py_ssize_t n = coef.shape[0]
    cdef uint8_t[:, :, ::1] out
    cdef uint8_t[::1] bad
    _check_simd(level)
    if coef.shape[1] != 64 or q.shape[0] != 64:
        raise ConfigError(f"coef must be (n, 64) and q (64,), got ({coef.shape[0]}, {coef.shape[1]}) "
                          f"and {q.shape[0]}")
    if max(q) > 32767:
        raise ConfigError("quantizers above 32767 (the region decode hands those to "
                          "libjpeg-turbo)")
    if size not in (1, 2, 4, 8):
        raise ConfigError(f"IDCT size {size} is not one of 1, 2, 4, 8")
    if fast and (size != 8 or px_ifast_multipliers(&q[0], mq)):
        raise ConfigError("the fast IDCT is 8x8 only, with multipliers within 32767")
    pixels = np.zeros((n, size, size), np.uint8)
    fallback = np.zeros(n, np.bool_)
    out = pixels
    bad = fallback.view(np.uint8)
    with nogil:
        for i in range(n):
            bad[i] = px_idct_block(level, size, &coef[i, 0], &q[0], mq if fast else NULL,
                                   &out[i, 0, 0], size) != 0
    return pixels, fallback


def decode_box(const uint8_t[::1] data, box, int scale, bint fast=False,
               int64_t max_pixels=1 << 28, int simd=-1, intervals=None):
    """The pixels of ``box = (top, left, height, width)`` (pixels of the image at DCT scale
    scale/8, scale in 1, 2, 4, 8) decoded by dpu_pipe's own decoder: a uint8 array (height,
    width, 3), equal bit for bit to libjpeg-turbo's decode of that box (accurate IDCT and
    fancy upsampling, or with ``fast`` the fast IDCT and plain upsampling), or None where that
    equality is not established or the data are damaged or beyond ``max_pixels`` (width x
    height): the caller's libjpeg-turbo decode applies and reports. Only the restart intervals covering the
    box are read, each up to the box's last MCU. Memory: 128 bytes per block of the covering
    MCU rectangle plus its samples (about 2 + 2/3 bytes per pixel for 4:2:0 at full scale),
    freed on return. ``simd``: the pixel stages' kernel level (simd_levels(); -1
    simd_default(), as the region decode runs). ``intervals``: a packed index entry
    (bytes-like, see :func:`interval_offsets`) locating the restart intervals instead of the
    marker scan; one that does not match the stream gives None, as damaged data do. Raises
    ConfigError for a box outside the scaled image or a level this CPU does not run."""
    cdef _Scratch sc = _Scratch()
    cdef px_plan plan
    cdef px_rect r
    cdef const uint8_t* p = &data[0] if data.shape[0] else NULL
    cdef size_t n = data.shape[0]
    cdef int rc, top, left, height, width
    cdef int64_t need
    cdef uint8_t[:, :, ::1] out
    top, left, height, width = box
    with nogil:
        rc = hp_read_header(sc.h, p, n)
    if rc != HP_OK:
        return None
    if <int64_t>sc.h.width * sc.h.height > max_pixels:
        return None
    rc = px_make_plan(sc.h, scale, fast, _FANCY_H1V2, &plan)
    if rc == HP_ESIZE:
        raise ConfigError(f"DCT scale {scale}/8 is not one of 1/8, 2/8, 4/8, 8/8")
    if rc != PX_OK:
        return None
    if simd >= 0:
        _check_simd(simd)
        plan.simd = simd
    if (top < 0 or left < 0 or height <= 0 or width <= 0 or top + height > plan.out_h
            or left + width > plan.out_w):
        raise ConfigError(f"box {tuple(box)} is not inside the {plan.out_w}x{plan.out_h} "
                          f"image at scale {scale}/8")
    px_make_rect(sc.h, &plan, top, left, height, width, &r)
    need = px_intervals_needed(sc.h, &r)
    sc.starts = <size_t*>malloc(need * sizeof(size_t))
    sc.ends = <size_t*>malloc(need * sizeof(size_t))
    sc.coef = <uint8_t*>calloc(r.coef_bytes, 1)
    sc.planes = <uint8_t*>malloc(r.plane_bytes)
    sc.rows = <uint8_t*>malloc(PX_ROW_BYTES(width))
    if (sc.starts == NULL or sc.ends == NULL or sc.coef == NULL or sc.planes == NULL
            or sc.rows == NULL):
        raise MemoryError()
    arr = np.empty((height, width, 3), np.uint8)
    out = arr
    rc = _locate(sc.h, p, n, intervals, need, sc.starts, sc.ends)
    with nogil:
        if rc == HP_OK:
            rc = px_decode_box(sc.h, &plan, &r, p, sc.starts, sc.ends, top, left, height, width,
                               sc.coef, sc.planes, sc.rows, &out[0, 0, 0], out.strides[0])
    return arr if rc == PX_OK else None


def decode(const uint8_t[::1] data, region, int min_h, int min_w, bint fast, bint strict,
           int64_t max_pixels, int max_scans, int simd=-1):
    """dpu_pipe._jpeg.decode with dpu_pipe's own decoder first: the region (top, left,
    height, width; full-resolution pixels, None for the whole image) at the smallest
    power-of-two DCT scale keeping it at least min_h x min_w. Returns (uint8 array (h, w, 3),
    scale in eighths, whether the own decoder produced it); where decode_box answers None,
    libjpeg-turbo decodes (and raises DecodeError for damaged data). ``simd``: as for
    decode_box."""
    from dpu_pipe import _jpeg

    cdef hp_header* h
    cdef JpegInfo info
    cdef Region r
    cdef int rc, scale, top, left, height, width
    h = <hp_header*>malloc(sizeof(hp_header))
    if h == NULL:
        raise MemoryError()
    try:
        rc = hp_read_header(h, &data[0] if data.shape[0] else NULL, data.shape[0])
        info.width, info.height = h.width, h.height
    finally:
        free(h)
    if rc == HP_OK:
        if region is None:
            top, left, height, width = 0, 0, info.height, info.width
        else:
            top, left, height, width = region
        scale = choose_scale(height, width, min_h, min_w)
        if scale_region(&info, scale, top, left, height, width, &r) == DP_OK:
            arr = decode_box(data, (r.top, r.left, r.height, r.width), scale, fast, max_pixels,
                             simd)
            if arr is not None:
                return arr, scale, True
    arr, scale = _jpeg.decode(data, region, min_h, min_w, fast, strict, max_pixels, max_scans)
    return arr, scale, False
