"""Models used across the notebooks. Ordinary single-device ``nn.Module``s: parallelism
is applied to them from outside (STYLE.md, "Models stay single-device")."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (He et al., 2016)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x):  # (B, c_in, H, W) -> (B, c_out, H/stride, W/stride)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet-style CNN for 32x32 (CIFAR) or 28x28 (FashionMNIST) images.

    Stem conv -> three stages of ``blocks`` BasicBlocks (width w, 2w, 4w; the
    last two halve the resolution) -> global average pool -> linear classifier.
    ``width=64, blocks=2`` is ResNet-18's layout on CIFAR without its fourth stage.
    """

    def __init__(
        self, num_classes: int = 10, width: int = 16, blocks: int = 1, in_channels: int = 3
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        layers, c = [], width
        for i, c_out in enumerate((width, 2 * width, 4 * width)):
            for j in range(blocks):
                layers.append(BasicBlock(c, c_out, stride=2 if (i > 0 and j == 0) else 1))
                c = c_out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x):  # (B, C, H, W) -> (B, num_classes)
        x = self.layers(self.stem(x))  # (B, 4w, H/4, W/4)
        return self.fc(self.pool(x).flatten(1))  # (B, num_classes)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class ToyMLP(nn.Module):
    """The plain case for parity tests: ``(B, 16) -> (B, 4)``."""

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (
            nn.Linear(d_in, hidden),
            nn.Linear(hidden, hidden),
            nn.Linear(hidden, classes),
        )

    def forward(self, x):  # (B, d_in) -> (B, classes)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class TiedMLP(ToyMLP):
    """One ``Parameter`` used twice (``fc2`` applied two times): one gradient, summed from both uses."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(torch.relu(self.fc2(h))))  # the same weights, twice
        return self.fc3(h)


class FrozenMLP(ToyMLP):
    """``fc1`` frozen (``requires_grad=False``, as in fine-tuning): never communicated."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fc1.requires_grad_(False)


class UnusedParamMLP(ToyMLP):
    """A layer that forward never calls: its gradient stays ``None`` on every rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unused = nn.Linear(32, 32)


class RankDependentMLP(nn.Module):
    """Ranks that do not behave alike: forward depends on ``self.rank``.

    - even ranks run ``a(h) + b(h)``, odd ranks ``b(h) + a(h)``: backward computes the later
      branch first, so ``a``'s and ``b``'s gradients become ready in opposite orders;
    - ``extra`` runs on odd ranks only: even ranks have no gradient for it.

    ``rank`` is an ordinary attribute set by the caller (the parity harness sets it to the
    rank, and loops over every rank's behaviour for the single-process reference).
    """

    def __init__(self, d_in: int = 16, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.a, self.b = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.extra = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)
        self.rank = 0

    def forward(self, x):  # (B, d_in) -> (B, classes)
        h = torch.relu(self.fc1(x))
        h = self.a(h) + self.b(h) if self.rank % 2 == 0 else self.b(h) + self.a(h)
        if self.rank % 2 == 1:
            h = self.extra(torch.relu(h))
        return self.head(torch.relu(h))


class BatchNormMLP(ToyMLP):
    """An MLP with a ``BatchNorm1d`` (buffers: running mean and variance) after ``fc1``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bn = nn.BatchNorm1d(self.fc1.out_features)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


def pipeline_mlp(
    d_in: int = 16, width: int = 64, depth: int = 8, classes: int = 4
) -> nn.Sequential:
    """A stack of ``depth`` Linear+Tanh blocks and a linear head: ``depth + 1`` layers to cut into stages."""
    layers = [
        nn.Sequential(nn.Linear(d_in if i == 0 else width, width), nn.Tanh()) for i in range(depth)
    ]
    return nn.Sequential(*layers, nn.Linear(width, classes))
