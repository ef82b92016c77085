"""Model factories for the RemoteValidation tests, imported by producer ranks by name
(``"valmodels:..."``, with this directory on PYTHONPATH)."""

import os
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


class _Gated(type(resnet_tiny(classes=2, width=4))):
    """Evaluates only once the host has created the file ``self.gate``: the host decides
    when the evaluation may finish, so a test of what happens meanwhile needs no timing."""

    def forward(self, x):
        deadline = time.monotonic() + 120
        while not os.path.exists(self.gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the host never opened the gate {self.gate}")
            time.sleep(0.01)
        return super().forward(x)


def gated(gate, **kwargs):
    model = resnet_tiny(**kwargs)
    model.__class__ = _Gated
    model.gate = gate
    return model
