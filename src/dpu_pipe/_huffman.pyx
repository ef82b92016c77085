# Python face of the baseline Huffman entropy decoder (_huffman.h): coefficient blocks of a
# JPEG, or of the MCU rectangle covering a region, for tests, fuzzing and measurements. The
# pixel path calls the C functions of _huffman.pxd directly.
from libc.stdint cimport uint8_t, int16_t, int64_t
from libc.stdlib cimport malloc, free

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


def read_coefficients(const uint8_t[::1] data, rect=None, int64_t max_pixels=1 << 28):
    """DCT coefficients of a baseline Huffman JPEG, as libjpeg-turbo's jpeg_read_coefficients
    gives them: one int16 array per component of shape (block rows, block columns, 64),
    natural order, quantized. With ``rect = (r0, r1, c0, c1)`` (MCU rows [r0, r1) and columns
    [c0, c1)) only that rectangle's blocks, reading only the restart intervals that cover it
    and stopping after its last MCU. Returns None for streams this decoder does not take
    (libjpeg-turbo's path applies); raises DecodeError for damaged data and ConfigError for a
    rectangle outside the image. Memory: 2 bytes per coefficient of the rectangle (about
    2 x 64 x blocks), bounded by ``max_pixels`` (width x height, checked from the header;
    DecodeError beyond it)."""
    cdef hp_header* h = <hp_header*>malloc(sizeof(hp_header))
    cdef size_t* starts = NULL
    cdef size_t* ends = NULL
    cdef int16_t* outs[4]
    cdef const uint8_t* p = &data[0] if data.shape[0] else NULL
    cdef size_t n = data.shape[0]
    cdef int rc, i, r0, r1, c0, c1, hh, vv
    cdef int64_t need
    cdef int16_t[:, :, ::1] view
    if h == NULL:
        raise MemoryError()
    try:
        with nogil:
            rc = hp_read_header(h, p, n)
        if rc == HP_UNSUPPORTED:
            return None
        if rc != HP_OK:
            raise DecodeError("cannot parse the JPEG markers")
        if <int64_t>h.width * h.height > max_pixels:
            raise DecodeError(f"image of {h.width} x {h.height} pixels exceeds the pixel "
                              f"budget (max_pixels={max_pixels})")
        if rect is None:
            r0, r1, c0, c1 = 0, h.mcuy, 0, h.mcux
        else:
            r0, r1, c0, c1 = rect
            if not (0 <= r0 < r1 <= h.mcuy and 0 <= c0 < c1 <= h.mcux):
                raise ConfigError(f"MCU rectangle {tuple(rect)} is not inside the "
                                  f"{h.mcuy} x {h.mcux} MCUs of the image")
        arrays = []
        for i in range(h.ncomp):
            hh = h.comp[i].h if h.interleaved else 1
            vv = h.comp[i].v if h.interleaved else 1
            arrays.append(np.zeros(((r1 - r0) * vv, (c1 - c0) * hh, 64), np.int16))
            view = arrays[i]
            outs[i] = &view[0, 0, 0]
        # Intervals up to the one holding the rectangle's last MCU.
        need = 1
        if h.restart_interval:
            need = ((<int64_t>r1 - 1) * h.mcux + c1 - 1) // h.restart_interval + 1
        starts = <size_t*>malloc(need * sizeof(size_t))
        ends = <size_t*>malloc(need * sizeof(size_t))
        if starts == NULL or ends == NULL:
            raise MemoryError()
        with nogil:
            rc = hp_find_intervals(h, p, n, need, starts, ends)
            if rc == HP_OK:
                rc = hp_decode_rect(h, p, starts, ends, r0, r1, c0, c1, outs)
        if rc != HP_OK:
            raise DecodeError(_MESSAGES.get(rc, f"entropy decoder status {rc}"))
        return arrays
    finally:
        free(h)
        free(starts)
        free(ends)
