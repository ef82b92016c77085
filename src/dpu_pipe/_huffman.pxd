# C-level API of the baseline Huffman entropy decoder (_huffman.h, written from ITU-T T.81).
#
# hp_read_header parses the markers up to the first SOS; hp_find_intervals locates the restart
# intervals by a bounded marker scan (or a packed index supplies them); hp_decode_rect decodes
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

    int hp_read_header(hp_header* h, const uint8_t* data, size_t size) noexcept
    int hp_find_intervals(const hp_header* h, const uint8_t* data, size_t size, int64_t n,
                          size_t* starts, size_t* ends) noexcept
    int hp_decode_rect(const hp_header* h, const uint8_t* data, const size_t* starts,
                       const size_t* ends, int r0, int r1, int c0, int c1,
                       int16_t* const* out) noexcept
