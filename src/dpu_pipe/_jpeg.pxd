# C-level API of the JPEG decoder, cimported by the fused batch module.
#
# A Decoder owns one libjpeg decompress object and is reused image after image by one thread.
# Decoding one image is two calls: dec_read_header (parses markers, applies the pixel budget),
# then dec_decode (a region of the image at DCT scale num/8, written to the caller's buffer).
# Every call returns 0 on success or a negative DP_E* code with the reason in dec_message().
from libc.stdint cimport uint8_t, int64_t
from libc.setjmp cimport jmp_buf
from dpu_pipe._libjpeg cimport jpeg_decompress_struct, jpeg_error_mgr, jpeg_progress_mgr

cdef enum:
    DP_OK = 0
    DP_EDECODE = -1      # libjpeg error, or a warning promoted to an error
    DP_EBUDGET = -2      # pixel budget or scan limit exceeded
    DP_EREGION = -3      # region outside the image or output too small for it
    DP_ENOMEM = -4

cdef struct DecodeOptions:
    int fast             # JDCT_IFAST + plain (non-fancy) upsampling
    int strict           # corrupt-data warnings are errors
    int64_t max_pixels   # budget on width * height, checked from the header alone
    int max_scans        # bound on SOS markers (progressive scan bombs)
    int intervals        # region decodes of restart-interval streams read only the covering
                         # intervals (0: always the plain region decode)

cdef struct JpegInfo:
    int width
    int height
    int components
    int colorspace       # J_COLOR_SPACE of the stream
    int progressive
    int arithmetic

cdef struct Region:      # rows/cols in pixels of the image at the chosen scale
    int top
    int left
    int height
    int width

cdef struct ErrorMgr:
    jpeg_error_mgr pub   # first member: libjpeg hands us a pointer to it
    jmp_buf jump
    int strict
    char message[200]    # JMSG_LENGTH_MAX

cdef struct Decoder:
    jpeg_decompress_struct cinfo   # first member: callbacks recover the Decoder from cinfo
    ErrorMgr err
    jpeg_progress_mgr progress
    DecodeOptions opts
    JpegInfo info
    int created
    int header_ok
    uint8_t* row                   # scratch scanline, grown on demand
    size_t row_cap
    int save_markers               # keep APPn/COM markers in cinfo.marker_list (transcoding)
    const uint8_t* src             # the bytes dec_read_header was given
    size_t src_size
    uint8_t* scratch               # sub-stream assembled from restart intervals, grown on demand
    size_t scratch_cap
    size_t scratch_len
    size_t* marks                  # [start, end) of each restart interval the sub-stream takes
    size_t marks_cap
    int assembled                  # the last dec_decode read an assembled sub-stream

cdef void dec_init(Decoder* d, const DecodeOptions* opts) noexcept nogil
cdef void dec_free(Decoder* d) noexcept nogil
cdef const char* dec_message(const Decoder* d) noexcept nogil
cdef int dec_read_header(Decoder* d, const uint8_t* data, size_t size) noexcept nogil
cdef int dec_decode(Decoder* d, int scale, const Region* region,
                    uint8_t* out, Py_ssize_t out_stride, int room) noexcept nogil

cdef int dec_assemble(Decoder* d, int scale, const Region* region, Region* sub) noexcept nogil
cdef int dec_grow(void** buf, size_t* cap, size_t need) noexcept nogil  # 1, or 0: no memory

cdef int choose_scale(int64_t height, int64_t width, int min_h, int min_w) noexcept nogil
cdef int scaled_size(int size, int scale) noexcept nogil
cdef int scale_region(const JpegInfo* info, int scale, int top, int left, int height, int width,
                      Region* out) noexcept nogil

cdef class BufferList:
    cdef Py_ssize_t n
    cdef const uint8_t** ptrs
    cdef size_t* sizes
    cdef object keep      # the Python objects owning the bytes the pointers refer to
    cdef void _alloc(self, Py_ssize_t n) except *
