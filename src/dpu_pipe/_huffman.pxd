# C-level API of the baseline Huffman entropy decoder (_huffman.h, written from ITU-T T.81).
#
# hp_read_header parses the markers up to the first SOS; hp_find_intervals locates the restart
# intervals by a bounded marker scan, hp_index_intervals takes them from a packed dataset's
# index entry (validated: no scan); hp_decode_rect decodes
# the MCUs of a rectangle into coefficient blocks laid out as libjpeg-turbo's
# jpeg_read_coefficients lays them out. Every call returns HP_OK or a negative HP_E* code.
from libc.stdint cimport uint8_t, uint16_t, int16_t, int32_t, int64_t

cdef extern from "_huffman.h" nogil:
    enum:
        HP_OK
        HP_EDATA
        HP_ESIZE
        HP_UNSUPPORTED
        HP_MAX_COMPS
        HP_MAX_LANES
        HP_LANES

    ctypedef struct hp_table:
        int defined

    ctypedef struct hp_comp:
        int id, h, v, tq, td, ta
        int bw, bh

    ctypedef struct hp_header:
        int width, height, ncomp, hmax, vmax
        int interleaved
        int mcux, mcuy
        int blocks_in_mcu
        int restart_interval
        int64_t n_mcu, n_int
        size_t scan_start
        hp_comp comp[4]
        uint16_t qt[4][64]
        int qt_defined[4]

    ctypedef struct hp_job:
        const hp_header* h
        const uint8_t* data
        const size_t* starts
        const size_t* ends
        int r0, r1, c0, c1
        int16_t* const* out
        int status

    int hp_read_header(hp_header* h, const uint8_t* data, size_t size) noexcept
    int hp_find_intervals(const hp_header* h, const uint8_t* data, size_t size, int64_t n,
                          size_t* starts, size_t* ends) noexcept
    int hp_index_intervals(const hp_header* h, const uint8_t* data, size_t size,
                           const uint8_t* idx, size_t len, int64_t n, size_t* starts,
                           size_t* ends) noexcept
    int hp_decode_rect(const hp_header* h, const uint8_t* data, const size_t* starts,
                       const size_t* ends, int r0, int r1, int c0, int c1,
                       int16_t* const* out) noexcept
    int hp_decode_rect_lanes(const hp_header* h, const uint8_t* data, const size_t* starts,
                             const size_t* ends, int r0, int r1, int c0, int c1,
                             int16_t* const* out, int lanes) noexcept
    int hp_decode_jobs(hp_job* jobs, int n, int lanes) noexcept


# Dequantization, IDCTs, upsampling and colour conversion bit-identical to libjpeg-turbo, and
# the region decode over hp_decode_rect (_idct.h).
cdef extern from "_idct.h" nogil:
    enum:
        PX_OK
        PX_FALLBACK

    ctypedef struct px_plan:
        int scale
        int out_w, out_h
        int colour
        int simd            # px_kern level: 0 scalar reference, 1 baseline SIMD, 2 AVX2

    ctypedef struct px_rect:
        int r0, r1, c0, c1
        size_t coef_bytes, plane_bytes

    size_t PX_ROW_BYTES(int width)
    int px_simd_max, px_simd_default
    int px_ifast_multipliers(const uint16_t* q, int32_t* mq) noexcept
    int px_idct_block(int simd, int size, const int16_t* input, const uint16_t* q,
                      const int32_t* mq, uint8_t* out, size_t stride) noexcept
    void px_init_tables() noexcept
    int px_make_plan(const hp_header* h, int scale, int fast, int fancy_h1v2,
                     px_plan* p) noexcept
    void px_make_rect(const hp_header* h, const px_plan* p, int top, int left, int height,
                      int width, px_rect* r) noexcept
    int64_t px_intervals_needed(const hp_header* h, const px_rect* r) noexcept
    int px_decode_box(const hp_header* h, const px_plan* p, const px_rect* r,
                      const uint8_t* data, const size_t* starts, const size_t* ends,
                      int top, int left, int height, int width, uint8_t* coef,
                      uint8_t* planes, uint8_t* rows, uint8_t* out, size_t out_stride) noexcept
