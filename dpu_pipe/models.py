"""Small ResNet-style CNNs for the demo and the training benchmark, importable by producer
ranks as ``"dpu_pipe.models:resnet_tiny"`` (a :class:`~dpu_pipe.RemoteValidation` model
factory). Needs torch (``pip install dpu_pipe[torch]``)."""

from .evaluate import require_torch

__all__ = ["resnet_tiny"]


def resnet_tiny(classes=10, width=16, blocks=(1, 1, 1), seed=0):
    """A ResNet of basic blocks: 3x3 stem (stride 2), stages of ``blocks[i]`` residual blocks
    with ``width * 2**i`` channels (stride 2 from the second stage on), global average pool,
    linear head to ``classes`` logits. Input: float (B, 3, H, W). Weights are initialized from
    ``seed`` (torch's default initialization under ``torch.manual_seed(seed)``), so every
    process that calls it with the same arguments builds the same model."""
    torch = require_torch()
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.short = None
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                           nn.BatchNorm2d(cout))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return torch.relu(out + (x if self.short is None else self.short(x)))

    state = torch.random.get_rng_state()
    torch.manual_seed(int(seed))
    try:
        layers = [nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        cin = width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            for j in range(int(n)):
                layers.append(Block(cin, cout, 2 if (i > 0 and j == 0) else 1))
                cin = cout
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, int(classes))]
        return nn.Sequential(*layers)
    finally:
        torch.random.set_rng_state(state)
