# The fused per-batch kernel: for each sample, header → augmentation parameters from the
# counter-based RNG → region decode at the best DCT scale → one resampling/flip/normalize/layout
# pass written straight into the caller's batch buffer, with the GIL released for the whole
# batch. Samples are spread over OpenMP threads, each with its own decoder and workspace; a
# sample's result never depends on the thread.
#
# Multi-view recipes: one BatchConfig per view; ONE region covering every view's crop is
# decoded, at the DCT scale the most demanding view allows, and each view cut from it.
#
# With decode_max_side a sample is decoded whole and reduced (longest side <= S), and its crop
# cut from that; a SampleCache (_cache.h) keeps the reduced image for later epochs. A hit and a
# miss run the same crop code on the same pixels, so the output never depends on the cache.
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t, INT64_MAX
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, strncpy
from libc.math cimport floor, ceil
from cython.parallel cimport parallel, prange, threadid

from dpu_pipe._jpeg cimport (BufferList, Decoder, DecodeOptions, Region, DP_OK, DP_EREGION,
                             DP_ENOMEM, dec_init, dec_free, dec_message, dec_read_header,
                             dec_decode, dec_grow, choose_scale, scale_region, scaled_size)
from dpu_pipe._ops cimport (OpsWorkspace, OpsOutput, OPS_OK, OPS_UINT8, OPS_HWC, ops_ws_init,
                            ops_ws_free, ops_output_init, ops_resize_crop, ops_center_crop_box,
                            OPS_BILINEAR, OPS_BICUBIC)
from dpu_pipe._rng cimport (CropConfig, CropBox, crop_config_init, random_resized_crop,
                            random_flip, RNG_MAX_VIEWS, RNG_VIEW_SHIFT)
from dpu_pipe._augment cimport (AugConfig, AugParams, aug_config_from, aug_sample,
                                aug_apply_convert, aug_erase, aug_tmp_bytes)

import os

import numpy as np

from dpu_pipe._ops import DTYPE_CODES, FILTER_CODES, LAYOUT_CODES
from dpu_pipe.augment import kernel_params
from dpu_pipe.errors import ConfigError
from dpu_pipe.transforms import TransformConfig


cdef extern from "_cache.h" nogil:
    ctypedef struct DpcEntry:
        uint32_t state
        uint32_t height
        uint32_t width
        uint32_t scale
        uint64_t offset
    size_t DPC_ENTRY_BYTES
    size_t DPC_ALIGN
    size_t dpc_table_bytes(uint64_t n)
    int dpc_init(void* base, size_t size, uint64_t n)
    int dpc_valid(const void* base, size_t size, uint64_t n)
    DpcEntry* dpc_entry(void* base, uint64_t index)
    int dpc_ready(void* base, uint64_t index)
    uint32_t dpc_state(void* base, uint64_t index)
    const uint8_t* dpc_lookup(void* base, uint64_t index, uint32_t* height, uint32_t* width,
                              uint32_t* scale)
    int dpc_insert_stalled(void* base, uint64_t index, uint32_t height, uint32_t width,
                           uint32_t scale, const uint8_t* pixels, uint32_t stall_ms)
    void dpc_stats(void* base, uint64_t* out)

#: Bytes of the cache's table per sample of the source (counted in ``cache_bytes``).
CACHE_ENTRY_BYTES = DPC_ENTRY_BYTES
#: Alignment of each cached sample's pixels: at most CACHE_ALIGN - 1 padding bytes each.
CACHE_ALIGN = DPC_ALIGN

cdef enum:
    MSG_LEN = 200
    # Columns of the per-sample info array filled by Pipeline.run.
    INFO_STATUS = 0      # 0, or a negative code (see STATUS_NAMES)
    INFO_TOP = 1         # crop box in full-resolution pixels (train: integers; val: floored)
    INFO_LEFT = 2
    INFO_HEIGHT = 3
    INFO_WIDTH = 4
    INFO_FLIP = 5
    INFO_SCALE = 6       # DCT scale used, in eighths
    INFO_COLS = 7
    DECODE_ROOM = 40     # _decode_region's free pixels each side: > CROP_MARGIN + an iMCU (32)

cdef enum:
    ST_OPS = -10         # the resampling kernel refused the box (never expected for valid data)
    ST_NOT_JPEG = -11    # no JPEG SOI marker: the caller may decode it another way


cdef struct Scratch:     # everything one thread owns
    Decoder dec
    OpsWorkspace ws
    uint8_t* img         # decoded region, grown on demand
    size_t img_cap
    uint8_t* red         # decode_max_side: the reduced whole image, grown on demand
    size_t red_cap
    uint8_t* crop        # augmented recipes: the uint8 (oh, ow, 3) crop (the largest view's)
    uint8_t* scratch     # and the ops' scratch (aug_tmp_bytes)
    int ready


cdef struct BatchConfig:
    int train
    int oh
    int ow
    int resize
    int filt             # OPS_BILINEAR or OPS_BICUBIC
    double flip_p
    CropConfig crop
    OpsOutput output
    DecodeOptions dopts
    int augmented        # any recipe option: aug_sample runs
    int uint8_pass       # resize to uint8, the _augment ops on it, then convert (any option
                         # but erasing, which works on the output sample)
    OpsOutput u8hwc
    AugConfig aug
    int max_side         # decode_max_side (0: off): decode whole, reduce, crop from that
    void* cache          # a SampleCache's arena, or NULL
    uint64_t stall_index # tests only: the sample whose fill stalls in FILLING (see SampleCache)
    uint32_t stall_ms


cdef int _crop(const BatchConfig* cfg, int H, int W, uint64_t seed, uint32_t epoch,
               uint64_t index, double* box, int64_t* span, int* flip, int32_t* info,
               char* message) noexcept nogil:
    """Augmentation parameters of one sample of H x W pixels: the crop ``box`` (y0, x0, h, w),
    the full-resolution ``span`` (top, left, bottom, right) to decode for it, and the flip."""
    cdef CropBox cb
    cdef int64_t margin
    flip[0] = 0
    if cfg.train:
        random_resized_crop(&cfg.crop, seed, epoch, index, H, W, &cb)
        flip[0] = random_flip(seed, epoch, index, cfg.flip_p, cfg.crop.vstream)
        box[0], box[1], box[2], box[3] = cb.top, cb.left, cb.height, cb.width
        span[0], span[1] = cb.top, cb.left
        span[2], span[3] = cb.top + cb.height, cb.left + cb.width
    else:
        if ops_center_crop_box(H, W, cfg.oh, cfg.ow, cfg.resize, box) != OPS_OK:
            strncpy(message, b"image too small for the validation crop", MSG_LEN - 1)
            return DP_EREGION
        # Validation resizes the whole image and then crops: the filter may read up to its
        # support (the downscale factor, twice that for bicubic) beyond the box, so decode
        # that much more.
        margin = <int64_t>ceil((box[2] / cfg.oh if box[2] / cfg.oh > box[3] / cfg.ow
                                else box[3] / cfg.ow) * (2 if cfg.filt == OPS_BICUBIC else 1)) + 1
        span[0] = <int64_t>floor(box[0]) - margin
        span[1] = <int64_t>floor(box[1]) - margin
        span[2] = <int64_t>ceil(box[0] + box[2]) + margin
        span[3] = <int64_t>ceil(box[1] + box[3]) + margin
        span[0], span[1] = max(span[0], 0), max(span[1], 0)
        span[2], span[3] = min(span[2], H), min(span[3], W)
    info[INFO_TOP] = <int32_t>floor(box[0])
    info[INFO_LEFT] = <int32_t>floor(box[1])
    info[INFO_HEIGHT] = <int32_t>floor(box[2])
    info[INFO_WIDTH] = <int32_t>floor(box[3])
    info[INFO_FLIP] = flip[0]
    return DP_OK


cdef int _resample(Scratch* w, const BatchConfig* cfg, const uint8_t* src, Py_ssize_t stride,
                   int h, int wd, double y0, double x0, double bh, double bw, int flip,
                   uint64_t seed, uint32_t epoch, uint64_t index, char* out,
                   char* message) noexcept nogil:
    """Box (y0, x0, bh, bw) of the decoded h x wd region -> the output sample: one fused pass
    for the plain recipe; for augmented ones the uint8 crop, the augmentation ops on it in
    torchvision's order, the conversion, then erasing."""
    cdef AugParams prm
    if ops_resize_crop(&w.ws, src, stride, h, wd, y0, x0, bh, bw, cfg.oh, cfg.ow, flip,
                       cfg.filt, &cfg.u8hwc if cfg.uint8_pass else &cfg.output,
                       <void*>w.crop if cfg.uint8_pass else <void*>out) != OPS_OK:
        strncpy(message, b"resampling kernel rejected the crop box", MSG_LEN - 1)
        return ST_OPS
    if cfg.augmented:
        aug_sample(&cfg.aug, seed, epoch, index, &prm)
        if cfg.uint8_pass and aug_apply_convert(&cfg.aug, &prm, w.crop, w.scratch, cfg.oh,
                                                cfg.ow, &cfg.output, out) != 0:
            strncpy(message, b"augmentation kernel rejected an op", MSG_LEN - 1)
            return ST_OPS
        aug_erase(&cfg.aug, &prm, cfg.oh, cfg.ow, &cfg.output, out)
    return DP_OK


cdef inline char* _row(char* const* bases, const Py_ssize_t* strides, Py_ssize_t row,
                       int v) noexcept nogil:
    return bases[v] + row * strides[v]


cdef int _process(Scratch* w, const BatchConfig* cfgs, int nv, const uint8_t* data,
                  size_t size, uint64_t seed, uint32_t epoch, uint64_t index,
                  char* const* bases, const Py_ssize_t* strides, Py_ssize_t row,
                  int32_t* info, char* message) noexcept nogil:
    """One sample: ``data`` (``size`` bytes) as sample ``index`` of ``epoch`` into row ``row``
    of each view's output (``bases[v] + row * strides[v]``); view v's info at
    ``info + v * INFO_COLS``. One region, the union of the views' spans, is decoded at the
    largest DCT scale any view asks for."""
    cdef Region r
    cdef double box[4 * RNG_MAX_VIEWS]
    cdef int flips[RNG_MAX_VIEWS]
    cdef int64_t span[4]
    cdef int64_t s[4]
    cdef double f
    cdef int v, sc, scale = 1, rc
    span[0] = span[1] = INT64_MAX   # the union of the views' spans (each inside the image)
    span[2] = span[3] = 0
    if cfgs[0].max_side:
        return _process_whole(w, cfgs, nv, data, size, seed, epoch, index, bases, strides,
                              row, info, message)
    rc = _header(w, data, size, message)
    if rc != DP_OK:
        return rc
    cdef int H = w.dec.info.height
    cdef int W = w.dec.info.width
    for v in range(nv):
        rc = _crop(&cfgs[v], H, W, seed, epoch, index, box + 4 * v, s, &flips[v],
                   info + v * INFO_COLS, message)
        if rc != DP_OK:
            return rc
        sc = choose_scale(<int64_t>floor(box[4 * v + 2]), <int64_t>floor(box[4 * v + 3]),
                          cfgs[v].oh, cfgs[v].ow)
        scale = max(scale, sc)
        span[0], span[1] = min(span[0], s[0]), min(span[1], s[1])
        span[2], span[3] = max(span[2], s[2]), max(span[3], s[3])
    for v in range(nv):
        info[v * INFO_COLS + INFO_SCALE] = scale
    rc = _decode_region(w, scale, span[0], span[1], span[2] - span[0], span[3] - span[1],
                        DECODE_ROOM, &r, b"crop box outside the image", message)
    if rc != DP_OK:
        return rc
    f = scale / 8.0
    for v in range(nv):
        rc = _resample(w, &cfgs[v], w.img + 3 * DECODE_ROOM,
                       (<Py_ssize_t>r.width + 2 * DECODE_ROOM) * 3, r.height, r.width,
                       box[4 * v] * f - r.top, box[4 * v + 1] * f - r.left,
                       box[4 * v + 2] * f, box[4 * v + 3] * f, flips[v], seed, epoch,
                       index, _row(bases, strides, row, v), message)
        if rc != DP_OK:
            return rc
    return DP_OK


cdef int _header(Scratch* w, const uint8_t* data, size_t size, char* message) noexcept nogil:
    """dec_read_header, with ST_NOT_JPEG for bytes that are not a JPEG stream at all."""
    cdef int rc = dec_read_header(&w.dec, data, size)
    if rc != DP_OK:
        if size < 2 or data[0] != 0xFF or data[1] != 0xD8:
            strncpy(message, b"not a JPEG stream (no SOI marker)", MSG_LEN - 1)
            return ST_NOT_JPEG
        strncpy(message, dec_message(&w.dec), MSG_LEN - 1)
    return rc


cdef int _decode_region(Scratch* w, int scale, int top, int left, int height,
                        int width, int room, Region* r, const char* bad_box,
                        char* message) noexcept nogil:
    """Decode the box (full-resolution pixels) of the header ``w.dec`` has read at ``scale``
    into ``w.img`` (grown to fit; RGB rows with ``room`` free pixels each side) and ``r``."""
    cdef int rc = scale_region(&w.dec.info, scale, top, left, height, width, r)
    if rc != DP_OK:
        strncpy(message, bad_box, MSG_LEN - 1)
        return rc
    if _grow(&w.img, &w.img_cap, <size_t>r.height * (r.width + 2 * room) * 3, message) != DP_OK:
        return DP_ENOMEM
    rc = dec_decode(&w.dec, scale, r, w.img + 3 * room, (<Py_ssize_t>r.width + 2 * room) * 3, room)
    if rc != DP_OK:
        strncpy(message, dec_message(&w.dec), MSG_LEN - 1)
    return rc


cdef int _grow(uint8_t** buf, size_t* cap, size_t need, char* message) noexcept nogil:
    if dec_grow(<void**>buf, cap, need):
        return DP_OK
    strncpy(message, b"out of memory for the decoded image", MSG_LEN - 1)
    return DP_ENOMEM


cdef int whole_scale(int H, int W, int max_side) noexcept nogil:
    """DCT scale (eighths) of decode_max_side's whole decode: the smallest s in 1..8 whose
    scaled longest side is still >= max_side; 8 when the image is no larger than that."""
    cdef int longest = H if H > W else W
    cdef int s
    if longest <= max_side:
        return 8
    for s in range(1, 8):
        if scaled_size(longest, s) >= max_side:
            return s
    return 8


cdef void reduced_size(int H, int W, int max_side, int* h, int* w) noexcept nogil:
    """decode_max_side's size for an H x W image: the longest side max_side exactly, the other
    round(side * max_side / longest) (half up, at least 1); the image's own size when it is
    no larger than max_side. Integer arithmetic: the same everywhere."""
    cdef int64_t longest = H if H > W else W
    if longest <= max_side:
        h[0], w[0] = H, W
    elif H >= W:
        h[0] = max_side
        w[0] = <int>((2 * <int64_t>W * max_side + longest) // (2 * longest))
    else:
        w[0] = max_side
        h[0] = <int>((2 * <int64_t>H * max_side + longest) // (2 * longest))
    h[0] = h[0] if h[0] > 0 else 1
    w[0] = w[0] if w[0] > 0 else 1


cdef int _reduce(Scratch* w, const BatchConfig* cfg, const uint8_t* src, Py_ssize_t stride,
                 int sh, int sw, int H, int W, int scale, uint64_t index, const uint8_t** px,
                 int* h, int* wd, char* message) noexcept nogil:
    """The decoded whole image (sh x sw at DCT scale ``scale`` of an H x W image) -> the
    reduced image ``px`` (h x wd, rows contiguous), stored in the cache when there is one.
    Antialiased bilinear (Pillow's triangle filter) over the whole image, whatever the
    recipe's interpolation; no resampling when the decoded size already is the reduced one."""
    cdef int y
    reduced_size(H, W, cfg.max_side, h, wd)
    if h[0] == sh and wd[0] == sw and stride == <Py_ssize_t>sw * 3:
        px[0] = src
    else:
        if _grow(&w.red, &w.red_cap, <size_t>h[0] * wd[0] * 3, message) != DP_OK:
            return DP_ENOMEM
        if h[0] == sh and wd[0] == sw:
            for y in range(sh):
                memcpy(w.red + <size_t>y * sw * 3, src + y * stride, <size_t>sw * 3)
        elif ops_resize_crop(&w.ws, src, stride, sh, sw, 0.0, 0.0, sh, sw, h[0], wd[0], 0,
                             OPS_BILINEAR, &cfg.u8hwc, w.red) != OPS_OK:
            strncpy(message, b"resampling kernel rejected the reduction", MSG_LEN - 1)
            return ST_OPS
        px[0] = w.red
    if cfg.cache != NULL:
        dpc_insert_stalled(cfg.cache, index, <uint32_t>h[0], <uint32_t>wd[0], <uint32_t>scale,
                           px[0], cfg.stall_ms if index == cfg.stall_index else 0)
    return DP_OK


cdef int _from_image(Scratch* w, const BatchConfig* cfgs, int nv, const uint8_t* img,
                     Py_ssize_t stride, int H, int W, int scale, uint64_t seed,
                     uint32_t epoch, uint64_t index, char* const* bases,
                     const Py_ssize_t* strides, Py_ssize_t row, int32_t* info,
                     char* message) noexcept nogil:
    """The views cut from a whole decoded image (H x W RGB, rows ``stride`` bytes apart),
    as _process cuts them from a JPEG decoded at scale 1: same crops, flips and spans."""
    cdef double box[4]
    cdef int64_t span[4]
    cdef int v, rc, flip = 0
    for v in range(nv):
        rc = _crop(&cfgs[v], H, W, seed, epoch, index, box, span, &flip,
                   info + v * INFO_COLS, message)
        if rc != DP_OK:
            return rc
        info[v * INFO_COLS + INFO_SCALE] = scale
        rc = _resample(w, &cfgs[v], img + span[0] * stride + span[1] * 3, stride,
                       <int>(span[2] - span[0]), <int>(span[3] - span[1]),
                       box[0] - span[0], box[1] - span[1], box[2], box[3], flip,
                       seed, epoch, index, _row(bases, strides, row, v), message)
        if rc != DP_OK:
            return rc
    return DP_OK


cdef int _process_whole(Scratch* w, const BatchConfig* cfgs, int nv, const uint8_t* data,
                        size_t size, uint64_t seed, uint32_t epoch, uint64_t index,
                        char* const* bases, const Py_ssize_t* strides, Py_ssize_t row,
                        int32_t* info, char* message) noexcept nogil:
    """decode_max_side's _process: the cached reduced image, or the JPEG decoded whole at
    the DCT scale of whole_scale, reduced (and cached); then the crop cut from it."""
    cdef const uint8_t* px
    cdef uint32_t ch, cw, cscale
    cdef Region r
    cdef int rc, scale, h, wd
    cdef const BatchConfig* cfg = cfgs
    if cfg.cache != NULL:
        px = dpc_lookup(cfg.cache, index, &ch, &cw, &cscale)
        if px != NULL:
            return _from_image(w, cfgs, nv, px, <Py_ssize_t>cw * 3, <int>ch, <int>cw,
                               <int>cscale, seed, epoch, index, bases, strides, row, info,
                               message)
    rc = _header(w, data, size, message)
    if rc != DP_OK:
        return rc
    cdef int H = w.dec.info.height
    cdef int W = w.dec.info.width
    scale = whole_scale(H, W, cfg.max_side)
    # A decode error is never cached: the entry stays empty, the next lookup a miss.
    rc = _decode_region(w, scale, 0, 0, H, W, 0, &r, b"image has no pixels", message)
    if rc != DP_OK:
        return rc
    rc = _reduce(w, cfg, w.img, <Py_ssize_t>r.width * 3, r.height, r.width, H, W, scale,
                 index, &px, &h, &wd, message)
    if rc != DP_OK:
        return rc
    return _from_image(w, cfgs, nv, px, <Py_ssize_t>wd * 3, h, wd, scale, seed, epoch, index,
                       bases, strides, row, info, message)


cdef int _process_decoded(Scratch* w, const BatchConfig* cfgs, int nv, const uint8_t* img,
                          Py_ssize_t stride, int H, int W, uint64_t seed, uint32_t epoch,
                          uint64_t index, char* const* bases, const Py_ssize_t* strides,
                          Py_ssize_t row, int32_t* info, char* message) noexcept nogil:
    """The fused pass of _process on an image decoded elsewhere (RGB, full resolution): the
    same crop, flip and span as a JPEG decoded at scale 1, so the result is identical. With
    decode_max_side the image is reduced (and cached) first, as a JPEG at scale 8/8 is."""
    cdef const uint8_t* px
    cdef int rc, h, wd
    if cfgs[0].max_side:
        rc = _reduce(w, cfgs, img, stride, H, W, H, W, 8, index, &px, &h, &wd, message)
        if rc != DP_OK:
            return rc
        return _from_image(w, cfgs, nv, px, <Py_ssize_t>wd * 3, h, wd, 8, seed, epoch, index,
                           bases, strides, row, info, message)
    return _from_image(w, cfgs, nv, img, stride, H, W, 8, seed, epoch, index, bases, strides,
                       row, info, message)


cdef class SampleCache:
    """The decoded-sample cache over memory the caller provides (see src/dpu_pipe/_cache.h).

    Parameters
    ----------
    buffer : writable bytes-like (an anonymous ``mmap``, an MPI shared-memory window)
        The arena: at least :func:`cache_table_bytes` ``(num_samples)`` bytes, 8-byte
        aligned. Kept referenced (and exported) while this object lives.
    num_samples : int
        Samples of the source: one table entry per sample index.
    init : bool
        Lay out an empty cache (one process, before any other uses the arena); False:
        attach to a cache another process laid out over the same memory (checked).
    """
    cdef void* base
    cdef uint8_t[::1] view
    cdef readonly size_t nbytes
    cdef readonly uint64_t num_samples
    cdef readonly uint64_t stall_index
    cdef readonly uint32_t stall_ms

    def __cinit__(self, buffer, uint64_t num_samples, bint init=True):
        # Tests only: DPU_PIPE_TEST_FILL_STALL="index:ms" holds that sample's entry in
        # FILLING for ms after its pixels are copied, so a test can kill its writer there.
        # Read once here; the batch kernels compare one integer per insert.
        self.stall_index = <uint64_t>-1
        self.stall_ms = 0
        stall = os.environ.get("DPU_PIPE_TEST_FILL_STALL")
        if stall:
            index, _, ms = stall.partition(":")
            self.stall_index, self.stall_ms = int(index), int(ms)
        self.view = buffer
        self.nbytes = <size_t>self.view.shape[0]
        self.num_samples = num_samples
        self.base = NULL if self.nbytes == 0 else <void*>&self.view[0]
        if init:
            if dpc_init(self.base, self.nbytes, num_samples) != 0:
                raise ConfigError(
                    f"a cache for {num_samples} samples needs more than "
                    f"{dpc_table_bytes(num_samples)} bytes (its table: "
                    f"{DPC_ENTRY_BYTES} bytes per sample), got {self.nbytes}")
        elif not dpc_valid(self.base, self.nbytes, num_samples):
            raise ConfigError(f"the memory given holds no cache of {num_samples} samples and "
                              f"{self.nbytes} bytes")

    def stats(self):
        """{"hits", "misses", "bytes", "entries", "did_not_fit"}: lookups that found / did not
        find their sample, pixel bytes stored, samples stored, samples refused for lack of
        room."""
        cdef uint64_t c[5]
        dpc_stats(self.base, c)
        return {"hits": c[0], "misses": c[1], "bytes": c[2], "entries": c[3],
                "did_not_fit": c[4]}

    def ready(self, const int64_t[::1] indices):
        """Whether each sample is stored: bool array (N,) (not counted as lookups)."""
        out = np.zeros(indices.shape[0], np.bool_)
        cdef uint8_t[::1] o = out.view(np.uint8)
        cdef Py_ssize_t i
        for i in range(indices.shape[0]):
            o[i] = indices[i] >= 0 and dpc_ready(self.base, <uint64_t>indices[i])
        return out

    def state(self, uint64_t index):
        """The state of sample ``index``'s entry: 0 empty, 1 being filled (or left so by a
        writer that died), 2 stored, 3 refused for lack of room (not counted as a lookup)."""
        if index >= self.num_samples:
            raise ConfigError(f"sample {index} out of range for {self.num_samples} samples")
        return int(dpc_state(self.base, index))

    def sample(self, uint64_t index):
        """(pixels, scale): a copy of sample ``index``'s stored image, uint8 (h, w, 3), and the
        DCT scale (eighths) it was decoded at; None when it is not stored (not counted)."""
        cdef DpcEntry* e
        if not dpc_ready(self.base, index):
            return None
        e = dpc_entry(self.base, index)
        px = np.asarray(self.view[e.offset:e.offset + <size_t>e.height * e.width * 3])
        return px.reshape(e.height, e.width, 3).copy(), int(e.scale)


def cache_table_bytes(uint64_t num_samples):
    """Bytes a cache of ``num_samples`` samples holds before any pixel: its header and one
    table entry (CACHE_ENTRY_BYTES) per sample, rounded up to 64."""
    return dpc_table_bytes(num_samples)


def decode_max_side_geometry(int height, int width, int max_side):
    """(scale, reduced height, reduced width) that decode_max_side=max_side gives an image of
    height x width pixels: the DCT scale (eighths) of its whole decode and the size of the
    reduced image its crops are cut from."""
    cdef int h, w
    if height < 1 or width < 1 or max_side < 1:
        raise ConfigError("height, width and max_side must be positive")
    reduced_size(height, width, max_side, &h, &w)
    return whole_scale(height, width, max_side), h, w


def buffer_bytes(BufferList buffers, Py_ssize_t i):
    """The bytes of ``buffers[i]`` (a copy), for decoders other than the JPEG kernel."""
    if not 0 <= i < buffers.n:
        raise ConfigError(f"buffer {i} out of range for {buffers.n} buffers")
    if buffers.sizes[i] == 0:
        return b""
    return (<const char*>buffers.ptrs[i])[:buffers.sizes[i]]


cdef class Pipeline:
    """Decode + augment batches with a fixed transform and thread count.

    ``config`` is ``TransformConfig.to_dict()``; ``num_threads`` OpenMP threads share each
    batch. Per-thread decoders and workspaces persist across batches, so a steady stream does
    not allocate. ``cache``: a :class:`SampleCache` the reduced images of ``decode_max_side``
    are kept in and served from (shared by every Pipeline given it). One Pipeline must not
    run two batches at once (each call releases the GIL,
    so give each Python thread its own Pipeline).

    With ``views`` in the config, every sample gives one output per view: :attr:`view_shapes`
    lists their sample shapes, and :meth:`run` takes one output batch per view.
    """
    cdef BatchConfig* cfgs     # one per view (one without views)
    cdef int nviews
    cdef Scratch* per_thread   # one Scratch per thread
    cdef int nthreads
    cdef readonly tuple sample_shape
    cdef readonly tuple view_shapes
    cdef readonly object dtype
    cdef readonly SampleCache cache

    def __cinit__(self, dict config, int num_threads=1, SampleCache cache=None):
        cdef int c, v
        cdef size_t crop_bytes = 0, tmp_bytes = 0
        if num_threads < 1:
            raise ConfigError("num_threads must be >= 1")
        self.nthreads = num_threads
        # Keys beyond the transform's own are decoder settings (strict, max_scans).
        tc = TransformConfig.from_dict({k: x for k, x in config.items()
                                        if k not in ("strict", "max_scans")})
        parts = [(vtc, kernel_params(vtc, view, k)) for k, (vtc, view) in
                 enumerate(tc.per_view())]
        if len(parts) > RNG_MAX_VIEWS:
            raise ConfigError(f"at most {RNG_MAX_VIEWS} views, got {len(parts)}")
        self.nviews = len(parts)
        self.cfgs = <BatchConfig*>calloc(self.nviews, sizeof(BatchConfig))
        if self.cfgs == NULL:
            raise MemoryError()
        self.cache = cache
        if cache is not None and tc.decode.decode_max_side is None:
            raise ConfigError("a sample cache needs decode_max_side (it holds the reduced "
                              "images)")
        shapes = []
        for v, (vtc, params) in enumerate(parts):
            _configure(&self.cfgs[v], vtc, params, config, cache, v)
            shapes.append(vtc.sample_shape)
            if self.cfgs[v].uint8_pass:
                crop_bytes = max(crop_bytes, <size_t>self.cfgs[v].oh * self.cfgs[v].ow * 3)
                tmp_bytes = max(tmp_bytes, aug_tmp_bytes(&self.cfgs[v].aug, self.cfgs[v].oh,
                                                         self.cfgs[v].ow))
        self.view_shapes = tuple(shapes)
        self.sample_shape = self.view_shapes[0]
        # numpy has no bfloat16: its samples are held as their uint16 bits.
        self.dtype = np.dtype(np.uint16 if config["dtype"] == "bfloat16" else config["dtype"])
        self.per_thread = <Scratch*>calloc(num_threads, sizeof(Scratch))
        if self.per_thread == NULL:
            raise MemoryError()
        for c in range(num_threads):
            dec_init(&self.per_thread[c].dec, &self.cfgs[0].dopts)
            ops_ws_init(&self.per_thread[c].ws)
            self.per_thread[c].ready = 1
            if crop_bytes:
                self.per_thread[c].crop = <uint8_t*>calloc(crop_bytes + tmp_bytes + 16, 1)
                if self.per_thread[c].crop == NULL:
                    raise MemoryError()
                self.per_thread[c].scratch = self.per_thread[c].crop + (crop_bytes + 15) // 16 * 16

    def __dealloc__(self):
        cdef int c
        if self.per_thread != NULL:
            for c in range(self.nthreads):
                if self.per_thread[c].ready:
                    dec_free(&self.per_thread[c].dec)
                    ops_ws_free(&self.per_thread[c].ws)
                    free(self.per_thread[c].img)
                    free(self.per_thread[c].red)
                    free(self.per_thread[c].crop)
            free(self.per_thread)
        free(self.cfgs)

    @property
    def num_threads(self):
        return self.nthreads

    def _outputs(self, out, Py_ssize_t n):
        """``out`` as a list of one output batch per view, each checked (>= n rows)."""
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if len(outs) != self.nviews or not all(
                isinstance(o, np.ndarray) and o.dtype == self.dtype
                and o.shape[1:] == shape and o.shape[0] >= n
                and o.flags.c_contiguous and o.flags.writeable
                for o, shape in zip(outs, self.view_shapes)):
            raise ConfigError(f"out must be {self.nviews} writable C-contiguous {self.dtype} "
                              f"array(s) of shape ({n}, *sample_shape), sample shapes "
                              f"{list(self.view_shapes)}")
        return outs

    def run(self, BufferList buffers, const int64_t[::1] indices, uint64_t seed,
            uint32_t epoch, out, int32_t[:, ::1] info):
        """Process buffers[i] as sample indices[i] of `epoch` into out[i].

        out: C-contiguous array (N, *sample_shape) of the configured dtype; with views, a list
        of them, one per view (shapes :attr:`view_shapes`).
        info: int32 (N, 7 * views) receiving, per view, status (the sample's, in column 0),
        crop top/left/height/width, flip, DCT scale.
        Returns {i: message} for the samples that failed (their out[i] is left unspecified).
        """
        cdef Py_ssize_t n = buffers.n, i
        cdef char* messages
        cdef int tid, v
        if indices.shape[0] != n or info.shape[0] != n \
                or info.shape[1] != INFO_COLS * self.nviews:
            raise ConfigError(f"indices ({indices.shape[0]}) and info ({info.shape[0]}, "
                             f"{info.shape[1]}) must match the {n} buffers; info has "
                             f"{INFO_COLS} columns per view")
        outs = self._outputs(out, n)
        cdef char** bases = <char**>calloc(self.nviews, sizeof(char*))
        cdef Py_ssize_t* strides = <Py_ssize_t*>calloc(self.nviews, sizeof(Py_ssize_t))
        messages = <char*>calloc(max(n, 1), MSG_LEN)
        try:
            if bases == NULL or strides == NULL or messages == NULL:
                raise MemoryError()
            for v in range(self.nviews):
                bases[v] = <char*><Py_ssize_t>outs[v].ctypes.data
                strides[v] = outs[v].strides[0]
            with nogil, parallel(num_threads=self.nthreads):
                tid = threadid()
                for i in prange(n, schedule="dynamic", chunksize=1):
                    info[i, INFO_STATUS] = _process(
                        &self.per_thread[tid], self.cfgs, self.nviews, buffers.ptrs[i],
                        buffers.sizes[i], seed, epoch, <uint64_t>indices[i], bases, strides, i,
                        &info[i, 0], messages + i * MSG_LEN)
            return {i: messages[i * MSG_LEN:(i + 1) * MSG_LEN].split(b"\0", 1)[0]
                    .decode("utf-8", "replace") for i in range(n) if info[i, INFO_STATUS] != 0}
        finally:
            free(messages)
            free(bases)
            free(strides)

    def run_decoded(self, const uint8_t[:, :, ::1] img, uint64_t index, uint64_t seed,
                    uint32_t epoch, out, Py_ssize_t pos, int32_t[:, ::1] info):
        """Augment ``img`` (H, W, 3) uint8 RGB, decoded by another decoder, as sample ``index``
        into row ``pos`` of ``out`` and ``info`` (as in :meth:`run`). Returns None, or the
        message of a failure (``info[pos, 0]`` then holds its code)."""
        cdef char message[MSG_LEN]
        cdef int rc, v
        cdef char* bases[RNG_MAX_VIEWS]
        cdef Py_ssize_t strides[RNG_MAX_VIEWS]
        if img.shape[2] != 3 or img.shape[0] < 1 or img.shape[1] < 1:
            raise ConfigError("img must be a non-empty (H, W, 3) uint8 array")
        if not 0 <= pos < info.shape[0] or info.shape[1] != INFO_COLS * self.nviews:
            raise ConfigError(f"info must be int32 (N, {INFO_COLS * self.nviews}) with a row "
                              f"{pos}")
        outs = self._outputs(out, pos + 1)
        for v in range(self.nviews):
            bases[v] = <char*><Py_ssize_t>outs[v].ctypes.data
            strides[v] = outs[v].strides[0]
        message[0] = 0
        with nogil:
            rc = _process_decoded(&self.per_thread[0], self.cfgs, self.nviews, &img[0, 0, 0],
                                  img.strides[0], <int>img.shape[0], <int>img.shape[1], seed,
                                  epoch, index, bases, strides, pos, &info[pos, 0], message)
        info[pos, INFO_STATUS] = rc
        if rc == DP_OK:
            return None
        return message[:MSG_LEN].split(b"\0", 1)[0].decode("utf-8", "replace")


cdef int _configure(BatchConfig* cfg, object tc, dict params, dict config,
                    SampleCache cache, int view) except -1:
    """Fill ``cfg`` for one view: ``tc`` its one-view TransformConfig, ``params`` its
    augmentation parameters (dpu_pipe.augment.kernel_params), ``config`` the decoder keys."""
    cdef double mean[3]
    cdef double std[3]
    cdef int c
    recipe = tc.recipe
    oh, ow = recipe.size
    cfg.train = bool(recipe.train)
    cfg.oh = oh
    cfg.ow = ow
    cfg.resize = recipe.resize
    cfg.flip_p = recipe.flip_p
    cfg.filt = FILTER_CODES[recipe.interpolation]
    if crop_config_init(&cfg.crop, recipe.scale[0], recipe.scale[1],
                        recipe.ratio[0], recipe.ratio[1]) != 0:
        raise ConfigError("invalid scale/ratio for RandomResizedCrop")
    cfg.crop.vstream = <uint32_t>view << RNG_VIEW_SHIFT
    for c in range(3):
        mean[c] = recipe.mean[c]
        std[c] = recipe.std[c]
    if ops_output_init(&cfg.output, DTYPE_CODES[recipe.dtype], LAYOUT_CODES[recipe.layout],
                       mean, std) != OPS_OK:
        raise ConfigError("invalid output settings (dtype, layout, mean, std)")
    cfg.dopts.fast = bool(tc.decode.fast)
    cfg.dopts.strict = bool(config.get("strict", False))
    cfg.dopts.max_pixels = tc.decode.max_pixels
    cfg.dopts.max_scans = config.get("max_scans", 1000)
    cfg.dopts.intervals = 1
    cfg.max_side = tc.decode.decode_max_side or 0
    cfg.cache = NULL
    if cache is not None:
        cfg.cache = cache.base
        cfg.stall_index = cache.stall_index
        cfg.stall_ms = cache.stall_ms
    colour = params["blur_p"] > 0 or params["solarize_p"] > 0
    cfg.augmented = tc.augmented or colour
    cfg.uint8_pass = tc.uint8_pass or colour
    if ops_output_init(&cfg.u8hwc, OPS_UINT8, OPS_HWC, NULL, NULL) != OPS_OK:
        raise ConfigError("uint8 output spec")
    aug_config_from(&cfg.aug, params)
    return 0
