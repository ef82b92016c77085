# C-level API of the augmentation kernels the fused batch module runs on the uint8 crop at output
# size (after the resize and the flip, where torchvision applies them):
#
#   aug_sample   the parameters of one sample from the counter-based RNG, one stream per
#                purpose, so that turning one on never changes the crop, the flip or another
#                op's draws;
#   aug_apply_convert  the ops of an AugParams, in order, on an (h, w, 3) uint8 image, in
#                place, then one output sample (dtype, layout, normalize) as ops_run converts;
#   aug_tmp_bytes  the scratch aug_apply_convert needs (the image's size; more with blur);
#   aug_erase    RandomErasing's box set to a constant, or to standard normal values.
# One table of ops (OP_NAMES in _augment.pyx, torchvision's names) and one dispatcher
# (aug_apply_op); integer or float32 arithmetic in a fixed order, the same bits everywhere.
from libc.stdint cimport uint8_t, int32_t, uint32_t, uint64_t

from dpu_pipe._ops cimport OpsOutput

cdef enum:
    AUG_IDENTITY = 0
    AUG_SHEAR_X = 1
    AUG_SHEAR_Y = 2
    AUG_TRANSLATE_X = 3
    AUG_TRANSLATE_Y = 4
    AUG_ROTATE = 5
    AUG_BRIGHTNESS = 6       # auto-augment ops take torchvision's signed magnitude m:
    AUG_COLOR = 7            #   factor 1 + m for these four
    AUG_CONTRAST = 8
    AUG_SHARPNESS = 9
    AUG_POSTERIZE = 10       # bits
    AUG_SOLARIZE = 11        # threshold 255 * m
    AUG_AUTOCONTRAST = 12
    AUG_EQUALIZE = 13
    AUG_INVERT = 14
    AUG_J_BRIGHTNESS = 15    # colour jitter: the factor itself
    AUG_J_CONTRAST = 16
    AUG_J_SATURATION = 17
    AUG_J_HUE = 18           # hue shift in turns, [-0.5, 0.5]
    AUG_GRAYSCALE = 19
    AUG_BLUR = 20            # multi-view Gaussian blur: sigma (kernel size in AugConfig)
    AUG_V_SOLARIZE = 21      # multi-view solarize: the threshold itself (0..255)
    AUG_NUM_OPS = 22

cdef enum:
    AUG_MODE_NONE = 0
    AUG_MODE_TA_WIDE = 1
    AUG_MODE_RA = 2
    AUG_MODE_IMAGENET = 3

cdef enum:
    AUG_MAX_SPACE = 16       # ops in an augmentation space
    AUG_MAX_BINS = 64        # magnitude bins
    AUG_MAX_POLICIES = 32    # AutoAugment sub-policies
    AUG_MAX_RA_OPS = 16      # RandAugment num_ops
    AUG_MAX_STEPS = 26       # auto-augment ops + 4 jitter ops + grayscale, blur, solarize

ctypedef struct AugSpaceOp:
    int op
    int is_signed
    int has_mag
    int kind                 # 0 linear in the level, 1 posterize, 2 no magnitude
    double start             # linear: magnitude = start + (end - start) * level / (bins - 1)
    double end
    double bins[AUG_MAX_BINS]  # torchvision's float32 table (posterize: its integer bits)

ctypedef struct AugConfig:
    int mode
    int oh
    int ow
    int n_space
    AugSpaceOp space[AUG_MAX_SPACE]
    int num_bins
    int num_ops              # RandAugment
    int magnitude            # RandAugment level (bin index)
    double mstd              # RandAugment level std (timm's mstd), 0 = torchvision's
    double posterize_div     # posterize: bits = round(8 - level / ((bins - 1) / div))
    int n_policies           # AutoAugment: sub-policies of two (op, probability, magnitude)
    int pol_op[AUG_MAX_POLICIES][2]
    double pol_p[AUG_MAX_POLICIES][2]
    double pol_mag[AUG_MAX_POLICIES][2]
    int pol_signed[AUG_MAX_POLICIES][2]
    uint8_t fill[3]          # affine ops: value outside the image
    int jitter[4]            # brightness, contrast, saturation, hue on?
    double jlo[4]
    double jhi[4]
    double jitter_p          # RandomApply's probability of the colour jitter (1: always)
    double gray_p
    double blur_p            # multi-view ops: probability, sigma range, taps; solarize
    double blur_sigma[2]
    int blur_k
    double sol_p
    double sol_thr
    uint32_t vstream         # view v's RNG stream offset (v << RNG_VIEW_SHIFT)
    double erase_p
    double erase_scale[2]
    double erase_log_ratio[2]
    float erase_value[3]     # in output units (normalized for float outputs)
    int erase_random         # erase_value="random": standard normal values instead

ctypedef struct AugStep:
    int op
    double mag               # what torchvision's _apply_op receives (jitter: the factor)

ctypedef struct AugParams:
    int n
    AugStep step[AUG_MAX_STEPS]
    int erase                # 1 when the box below is erased
    int32_t ebox[4]          # i, j, h, w in output pixels
    uint64_t seed            # the sample's key (erase_random draws its values from it)
    uint32_t epoch
    uint64_t index


cdef void aug_sample(const AugConfig* cfg, uint64_t seed, uint32_t epoch, uint64_t index,
                     AugParams* out) noexcept nogil
cdef int aug_apply_convert(const AugConfig* cfg, const AugParams* prm, uint8_t* img,
                           uint8_t* tmp, int h, int w, const OpsOutput* o,
                           void* out) noexcept nogil
cdef size_t aug_tmp_bytes(const AugConfig* cfg, int h, int w) noexcept nogil
cdef void aug_erase(const AugConfig* cfg, const AugParams* prm, int h, int w,
                    const OpsOutput* o, void* out) noexcept nogil
cdef int aug_config_from(AugConfig* cfg, dict spec) except -1
