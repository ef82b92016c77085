# libjpeg-turbo's own DCT coefficients of a JPEG (jpeg_read_coefficients), the reference
# tests/test_entropy.py holds dpu_pipe's entropy decoder (_huffman.h) to. Built by
# tests/kernel_probes.py with the package's compiler flags and libjpeg.
from libc.stdint cimport uint8_t, int16_t
from libc.stdlib cimport malloc, free

import numpy as np

cdef extern from *:
    """
    #include <stdio.h>
    #include <setjmp.h>
    #include <string.h>
    #include <jpeglib.h>

    typedef struct { struct jpeg_error_mgr pub; jmp_buf jump; char msg[JMSG_LENGTH_MAX];
                     char warning[JMSG_LENGTH_MAX]; } probe_err;

    static void probe_error_exit(j_common_ptr c) {
        probe_err* e = (probe_err*)c->err;
        e->pub.format_message(c, e->msg);
        longjmp(e->jump, 1);
    }
    static void probe_silent(j_common_ptr c) { (void)c; }
    static void probe_emit(j_common_ptr c, int level) {
        probe_err* e = (probe_err*)c->err;
        if (level < 0) {       /* a corrupt-data warning: count it, keep the first */
            if (e->pub.num_warnings++ == 0) e->pub.format_message(c, e->warning);
        }
    }

    /* dims: per component rows, cols of the coefficient array (padded as libjpeg pads it),
     * then rows, cols of the blocks the component really has. With out == NULL only dims. */
    static int probe_coefficients(const unsigned char* data, size_t size, int* ncomp,
                                  int* dims, int16_t** out, char* msg) {
        struct jpeg_decompress_struct cinfo;
        probe_err err;
        jvirt_barray_ptr* arrays;
        int ci;
        cinfo.err = jpeg_std_error(&err.pub);
        err.pub.error_exit = probe_error_exit;
        err.pub.output_message = probe_silent;
        err.pub.emit_message = probe_emit;
        err.warning[0] = 0;
        if (setjmp(err.jump)) {
            strcpy(msg, err.msg);
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, data, (unsigned long)size);
        jpeg_read_header(&cinfo, TRUE);
        /* The block counts are known once the header is read (at the first SOS). */
        arrays = out ? jpeg_read_coefficients(&cinfo) : NULL;
        *ncomp = cinfo.num_components;
        for (ci = 0; ci < cinfo.num_components && ci < 4; ci++) {
            jpeg_component_info* c = &cinfo.comp_info[ci];
            int hs = cinfo.comps_in_scan > 1 ? c->h_samp_factor : 1;
            int vs = cinfo.comps_in_scan > 1 ? c->v_samp_factor : 1;
            int rows = (int)((c->height_in_blocks + vs - 1) / vs * vs);
            int cols = (int)((c->width_in_blocks + hs - 1) / hs * hs);
            dims[4 * ci] = rows; dims[4 * ci + 1] = cols;
            dims[4 * ci + 2] = (int)c->height_in_blocks; dims[4 * ci + 3] = (int)c->width_in_blocks;
            if (out) {
                int r;
                for (r = 0; r < rows; r++) {
                    JBLOCKARRAY b = cinfo.mem->access_virt_barray((j_common_ptr)&cinfo,
                                                                  arrays[ci], r, 1, FALSE);
                    memcpy(out[ci] + (size_t)r * cols * 64, b[0], (size_t)cols * 64 * sizeof(JCOEF));
                }
            }
        }
        snprintf(msg, 200, "%ld %s", err.pub.num_warnings, err.warning);
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    """
    int probe_coefficients(const unsigned char* data, size_t size, int* ncomp, int* dims,
                           int16_t** out, char* msg)


def coefficients(const uint8_t[::1] data):
    """(list of int16 arrays (rows, cols, 64) per component — libjpeg's coefficient arrays,
    padded to whole MCUs as it allocates them —, list of (rows, cols) of the component's own
    blocks, number of corrupt-data warnings, the first warning's message). ValueError with libjpeg's message when it fails."""
    cdef int ncomp = 0, i
    cdef int dims[16]
    cdef char msg[200]
    cdef int16_t* outs[4]
    cdef int16_t[:, :, ::1] v
    if probe_coefficients(&data[0], data.shape[0], &ncomp, dims, NULL, msg) != 0:
        raise ValueError(msg.decode())
    arrays = []
    for i in range(min(ncomp, 4)):
        arrays.append(np.zeros((dims[4 * i], dims[4 * i + 1], 64), np.int16))
        v = arrays[i]
        outs[i] = &v[0, 0, 0]
    if probe_coefficients(&data[0], data.shape[0], &ncomp, dims, outs, msg) != 0:
        raise ValueError(msg.decode())
    count, last = msg.decode("utf-8", "replace").split(" ", 1)
    return arrays, [(dims[4 * i + 2], dims[4 * i + 3]) for i in range(len(arrays))], int(count), last
