"""The words dpu_pipe's options accept, defined once; every module that checks or uses one of
these options imports it from here."""

__all__ = ["OUTPUT_DTYPES", "LAYOUTS", "INTERPOLATIONS", "AUTO_AUGMENT", "ON_ERROR",
           "SHARD_TAILS", "IMAGENET_MEAN", "IMAGENET_STD"]

#: Output dtypes a loader yields, by canonical name (bfloat16 needs torch output).
OUTPUT_DTYPES = ("float32", "float16", "bfloat16", "uint8")
#: Output layouts: (B, 3, H, W) or (B, H, W, 3).
LAYOUTS = ("CHW", "HWC")
#: Resampling filters of the crop and the validation resize (antialiased, as Pillow's).
INTERPOLATIONS = ("bilinear", "bicubic")
#: ``auto_augment`` policies: TrivialAugmentWide, RandAugment, AutoAugment's ImageNet policy.
AUTO_AUGMENT = ("ta_wide", "ra", "imagenet")
#: What a batch does with a sample that cannot be decoded.
ON_ERROR = ("raise", "skip")
#: How shards treat the samples left over when ``world_size`` does not divide the dataset.
SHARD_TAILS = ("pad", "drop", "uneven", "mask")
#: ImageNet's per-channel mean and standard deviation, in [0, 1] units (torchvision's).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
