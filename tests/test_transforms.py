"""TransformConfig's parts: flat options routed to the part that owns them, each part
checking its own fields, and the flat dict that producers and saved states carry."""
import dataclasses

import pytest

from dpu_pipe import ConfigError, constants
from dpu_pipe.transforms import BatchOptions, DecodeOptions, SampleRecipe, TransformConfig


def test_flat_options_land_in_their_part():
    cfg = TransformConfig(train=False, size=96, fast=True, auto_augment="ra",
                          mixup_alpha=0.2, num_classes=10)
    assert cfg.decode == DecodeOptions(fast=True)
    assert cfg.recipe == SampleRecipe(train=False, size=(96, 96), auto_augment="ra")
    assert cfg.batch_ops == BatchOptions(mixup_alpha=0.2, num_classes=10)
    assert not cfg.train and cfg.sample_shape == (3, 96, 96)
    # Validation never mixes, whatever the batch options say.
    assert not cfg.soft_labels
    assert TransformConfig(size=96, mixup_alpha=0.2, num_classes=10).soft_labels


def test_parts_and_flat_options_build_the_same_config():
    recipe = SampleRecipe(size=64, color_jitter=0.4)
    by_parts = TransformConfig(recipe=recipe, batch_ops=BatchOptions(label_smoothing=0.1,
                                                                     num_classes=5))
    flat = TransformConfig(size=64, color_jitter=0.4, label_smoothing=0.1, num_classes=5)
    assert by_parts == flat and hash(by_parts) == hash(flat)
    # A flat option overrides the field of a part given whole.
    assert TransformConfig(recipe=recipe, size=32).recipe.size == (32, 32)
    with pytest.raises(ConfigError, match="recipe must be a SampleRecipe"):
        TransformConfig(recipe=DecodeOptions())


def test_to_dict_is_flat_and_round_trips():
    cfg = TransformConfig(train=True, size=(64, 48), auto_augment="ta_wide", random_erase=0.25,
                          cutmix_alpha=1.0, num_classes=3, max_pixels=10**6)
    d = cfg.to_dict()
    names = {f.name for part in (DecodeOptions, SampleRecipe, BatchOptions)
             for f in dataclasses.fields(part)}
    # decode_max_side and views appear only when set: the dicts of the streams without them
    # (saved states, producers' stream keys) stay what they were.
    assert set(d) == names - {"decode_max_side", "views"}
    assert d["size"] == [64, 48] and d["max_pixels"] == 10**6 and d["cutmix_alpha"] == 1.0
    assert TransformConfig.from_dict(d) == cfg
    with pytest.raises(ConfigError, match="unknown transform settings"):
        TransformConfig.from_dict({**d, "colour": 1})
    reduced = TransformConfig(decode_max_side=256)
    assert reduced.to_dict()["decode_max_side"] == 256
    assert TransformConfig.from_dict(reduced.to_dict()) == reduced != TransformConfig()
    for bad in (0, -3, 2.5, True, 70000):
        with pytest.raises(ConfigError, match="decode_max_side"):
            TransformConfig(decode_max_side=bad)


def test_each_part_checks_its_own_fields():
    with pytest.raises(TypeError, match="colour"):
        TransformConfig(colour="red")
    with pytest.raises(ConfigError, match="max_pixels"):
        DecodeOptions(max_pixels=0)
    with pytest.raises(ConfigError, match="color_jitter"):
        SampleRecipe(color_jitter=(0.1, 0.1, 0.1, 0.9))
    with pytest.raises(ConfigError, match="num_classes"):
        BatchOptions(mixup_alpha=0.2)
    # A uint8 output has no normalized domain for random erasing values.
    with pytest.raises(ConfigError, match="erase_value"):
        SampleRecipe(dtype="uint8", erase_value="random")


def test_constants_are_defined_once():
    from dpu_pipe import _validate, augment, ops, sampler, spec, transforms
    assert ops.IMAGENET_MEAN is constants.IMAGENET_MEAN is transforms.IMAGENET_MEAN
    assert augment.AUTO_AUGMENT is constants.AUTO_AUGMENT
    assert _validate.OUTPUT_DTYPES is constants.OUTPUT_DTYPES
    assert spec.ON_ERROR is constants.ON_ERROR and sampler.SHARD_TAILS is constants.SHARD_TAILS
