"""Model factories for the RemoteValidation tests, imported by producer ranks by name
(``"valmodels:..."``, with this directory on PYTHONPATH)."""

import time

from dpu_pipe.models import resnet_tiny


def broken_factory(**kwargs):
    raise RuntimeError("the factory broke on purpose")


class _BadForward(type(resnet_tiny(classes=2, width=4))):
    def forward(self, x):
        raise ValueError(f"forward refused a batch of {x.shape[0]}")


def bad_forward(**kwargs):
    model = resnet_tiny(**kwargs)
    model.__class__ = _BadForward
    return model


class _Slow(type(resnet_tiny(classes=2, width=4))):
    def forward(self, x):
        time.sleep(0.15)   # long enough that the host sees training go on meanwhile
        return super().forward(x)


def slow(**kwargs):
    model = resnet_tiny(**kwargs)
    model.__class__ = _Slow
    return model
