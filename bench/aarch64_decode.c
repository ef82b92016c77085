/* The region decodes of the batch kernel, without Python, for counting the instructions a
 * Cortex-A72 executes per image under qemu (bench/bench_aarch64_instructions.py builds it with
 * the aarch64 cross compiler and the build's flags, and runs it once per method).
 *
 *   aarch64_decode METHOD INDEX DATA
 *
 * INDEX: one line per image, "offset length scale top left height width" — the JPEG bytes at
 * DATA[offset:offset + length] and the region to decode in pixels of the image at scale/8.
 * METHOD: "none" (read the inputs only), "libjpeg" (libjpeg-turbo's region decode as
 * dpu_pipe's dec_decode runs it: crop the columns, skip the rows above, stop after the last),
 * "own" (dpu_pipe's decoder: header, marker scan, entropy decoding of the box's intervals,
 * IDCT, upsampling, colour), "entropy" (the own decoder's header, marker scan and entropy
 * decoding alone). Prints one checksum of the decoded pixels per image (own and libjpeg must
 * agree), and nothing else. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jpeglib.h>
#include "_idct.h"

#define CROP_MARGIN 4   /* as _jpeg.pyx */

static uint64_t checksum(const uint8_t* p, size_t n) {
    uint64_t s = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) s = (s ^ p[i]) * 1099511628211ull;
    return s;
}

static int decode_libjpeg(const uint8_t* data, size_t size, int scale, int top, int left,
                          int height, int width, uint8_t* out) {
    struct jpeg_decompress_struct cinfo;
    struct jpeg_error_mgr err;
    JDIMENSION xoff = 0, cw;
    cinfo.err = jpeg_std_error(&err);
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = scale;
    cinfo.scale_denom = 8;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    cw = cinfo.output_width;
    if (left > CROP_MARGIN || left + width + CROP_MARGIN < (int)cw) {
        int xend = left + width + CROP_MARGIN;
        xoff = left > CROP_MARGIN ? left - CROP_MARGIN : 0;
        if (xend > (int)cinfo.output_width) xend = cinfo.output_width;
        cw = xend - xoff;
        jpeg_crop_scanline(&cinfo, &xoff, &cw);
    }
    uint8_t* row = malloc((size_t)cw * 3);
    if (top > 0) jpeg_skip_scanlines(&cinfo, top);
    for (int y = 0; (int)cinfo.output_scanline < top + height; y++) {
        jpeg_read_scanlines(&cinfo, &row, 1);
        memcpy(out + (size_t)y * width * 3, row + (left - (int)xoff) * 3, (size_t)width * 3);
    }
    jpeg_abort_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    free(row);
    return 0;
}

static int decode_own(const uint8_t* data, size_t size, int scale, int top, int left,
                      int height, int width, uint8_t* out, int entropy_only) {
    hp_header h;
    px_plan plan;
    px_rect r;
    int rc;
    if (hp_read_header(&h, data, size) != HP_OK) return -1;
    rc = px_make_plan(&h, scale, 0, LIBJPEG_TURBO_VERSION_NUMBER >= 2001000, &plan);
    if (rc != PX_OK) return -1;
    px_make_rect(&h, &plan, top, left, height, width, &r);
    int64_t need = px_intervals_needed(&h, &r);
    size_t* starts = malloc(need * sizeof(size_t));
    size_t* ends = malloc(need * sizeof(size_t));
    uint8_t* coef = calloc(r.coef_bytes, 1);
    uint8_t* planes = malloc(r.plane_bytes);
    uint8_t* rows = malloc(PX_ROW_BYTES(width));
    rc = hp_find_intervals(&h, data, size, need, starts, ends);
    if (rc == HP_OK && entropy_only) {
        int16_t* blocks[HP_MAX_COMPS];
        for (int ci = 0; ci < h.ncomp; ci++) blocks[ci] = (int16_t*)(coef + r.coef_off[ci]);
        rc = hp_decode_rect(&h, data, starts, ends, r.r0, r.r1, r.c0, r.c1, blocks);
        memcpy(out, coef, (size_t)height * width * 3 < r.coef_bytes
               ? (size_t)height * width * 3 : r.coef_bytes);
    } else if (rc == HP_OK) {
        rc = px_decode_box(&h, &plan, &r, data, starts, ends, top, left, height, width, coef,
                           planes, rows, out, (size_t)width * 3);
    }
    free(starts); free(ends); free(coef); free(planes); free(rows);
    return rc == HP_OK ? 0 : -1;
}

int main(int argc, char** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s none|libjpeg|own|entropy INDEX DATA\n", argv[0]);
        return 2;
    }
    const char* method = argv[1];
    FILE* f = fopen(argv[3], "rb");
    if (!f) return 2;
    fseek(f, 0, SEEK_END);
    long total = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t* all = malloc(total);
    if (fread(all, 1, total, f) != (size_t)total) return 2;
    fclose(f);
    FILE* ix = fopen(argv[2], "r");
    if (!ix) return 2;
    px_init_tables();
    long off, len;
    int scale, top, left, height, width;
    while (fscanf(ix, "%ld %ld %d %d %d %d %d", &off, &len, &scale, &top, &left, &height,
                  &width) == 7) {
        uint8_t* out = calloc((size_t)height * width * 3, 1);
        int rc = 0;
        if (!strcmp(method, "libjpeg"))
            rc = decode_libjpeg(all + off, len, scale, top, left, height, width, out);
        else if (!strcmp(method, "own") || !strcmp(method, "entropy"))
            rc = decode_own(all + off, len, scale, top, left, height, width, out,
                            !strcmp(method, "entropy"));
        printf("%d %016llx\n", rc, (unsigned long long)checksum(out, (size_t)height * width * 3));
        free(out);
    }
    fclose(ix);
    free(all);
    return 0;
}
