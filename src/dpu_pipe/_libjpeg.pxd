# The parts of libjpeg-turbo's jpeglib API that dpu_pipe uses (present in 2.0 and later).
# Only the fields read or written are declared; Cython emits no struct layouts of its own.

cdef extern from "<stdio.h>":
    pass

cdef extern from "jpeglib.h" nogil:
    # --- basic types -------------------------------------------------------------------
    ctypedef int boolean
    ctypedef unsigned int JDIMENSION
    ctypedef unsigned char* JSAMPROW

    ctypedef enum J_COLOR_SPACE:
        JCS_RGB
        JCS_CMYK
        JCS_YCCK

    ctypedef enum J_DCT_METHOD:
        JDCT_ISLOW
        JDCT_IFAST

    # --- error and progress managers, saved markers ---------------------------------------
    struct jpeg_common_struct
    ctypedef jpeg_common_struct* j_common_ptr

    struct jpeg_error_mgr:
        void (*error_exit)(j_common_ptr) noexcept nogil
        void (*emit_message)(j_common_ptr, int) noexcept nogil
        void (*output_message)(j_common_ptr) noexcept nogil
        void (*format_message)(j_common_ptr, char*) noexcept nogil
        int msg_code
        long num_warnings

    struct jpeg_progress_mgr:
        void (*progress_monitor)(j_common_ptr) noexcept nogil

    struct jpeg_common_struct:
        jpeg_error_mgr* err

    struct jpeg_marker_struct:
        jpeg_marker_struct* next
        unsigned char marker
        unsigned int data_length
        unsigned char* data
    ctypedef jpeg_marker_struct* jpeg_saved_marker_ptr

    struct jvirt_barray_control
    ctypedef jvirt_barray_control* jvirt_barray_ptr

    int JPEG_APP0
    int JPEG_COM

    # --- decompression -----------------------------------------------------------------
    struct jpeg_decompress_struct:
        jpeg_error_mgr* err
        jpeg_progress_mgr* progress

        JDIMENSION image_width
        JDIMENSION image_height
        int num_components
        J_COLOR_SPACE jpeg_color_space
        J_COLOR_SPACE out_color_space
        int data_precision
        unsigned int restart_interval
        int comps_in_scan
        jpeg_saved_marker_ptr marker_list

        unsigned int scale_num
        unsigned int scale_denom
        J_DCT_METHOD dct_method
        boolean do_fancy_upsampling

        JDIMENSION output_width
        JDIMENSION output_height
        int output_components
        JDIMENSION output_scanline

        int input_scan_number
        boolean progressive_mode
        boolean arith_code
        int max_h_samp_factor
        int max_v_samp_factor

    ctypedef jpeg_decompress_struct* j_decompress_ptr

    jpeg_error_mgr* jpeg_std_error(jpeg_error_mgr* err)
    void jpeg_create_decompress(j_decompress_ptr cinfo)
    void jpeg_destroy_decompress(j_decompress_ptr cinfo)
    void jpeg_abort_decompress(j_decompress_ptr cinfo)
    void jpeg_mem_src(j_decompress_ptr cinfo, const unsigned char* buf, unsigned long size)
    int jpeg_read_header(j_decompress_ptr cinfo, boolean require_image)
    boolean jpeg_start_decompress(j_decompress_ptr cinfo)
    JDIMENSION jpeg_read_scanlines(j_decompress_ptr cinfo, JSAMPROW* scanlines,
                                   JDIMENSION max_lines)
    JDIMENSION jpeg_skip_scanlines(j_decompress_ptr cinfo, JDIMENSION num_lines)
    void jpeg_crop_scanline(j_decompress_ptr cinfo, JDIMENSION* xoffset, JDIMENSION* width)

    # --- lossless transcoding (what jpegtran does) ----------------------------------------
    struct jpeg_compress_struct
    ctypedef jpeg_compress_struct* j_compress_ptr

    struct jpeg_destination_mgr:
        unsigned char* next_output_byte
        size_t free_in_buffer
        void (*init_destination)(j_compress_ptr) noexcept nogil
        boolean (*empty_output_buffer)(j_compress_ptr) noexcept nogil
        void (*term_destination)(j_compress_ptr) noexcept nogil

    struct jpeg_compress_struct:
        jpeg_error_mgr* err
        jpeg_destination_mgr* dest
        boolean optimize_coding
        unsigned int restart_interval
        int restart_in_rows

    void jpeg_create_compress(j_compress_ptr cinfo)
    void jpeg_destroy_compress(j_compress_ptr cinfo)
    void jpeg_save_markers(j_decompress_ptr cinfo, int marker_code, unsigned int length_limit)
    jvirt_barray_ptr* jpeg_read_coefficients(j_decompress_ptr cinfo)
    void jpeg_copy_critical_parameters(j_decompress_ptr srcinfo, j_compress_ptr dstinfo)
    void jpeg_write_coefficients(j_compress_ptr cinfo, jvirt_barray_ptr* coef_arrays)
    void jpeg_write_marker(j_compress_ptr cinfo, int marker, const unsigned char* dataptr,
                           unsigned int datalen)
    void jpeg_finish_compress(j_compress_ptr cinfo)

cdef extern from "jerror.h" nogil:
    int JWRN_JPEG_EOF

cdef extern from *:
    """
    #ifndef LIBJPEG_TURBO_VERSION_NUMBER
    #define LIBJPEG_TURBO_VERSION_NUMBER 0
    #endif
    #ifdef D_ARITH_CODING_SUPPORTED
    #define DP_ARITH_DECODING 1
    #else
    #define DP_ARITH_DECODING 0
    #endif
    """
    int LIBJPEG_TURBO_VERSION_NUMBER
    int DP_ARITH_DECODING
