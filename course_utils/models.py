"""Models used across the notebooks. Ordinary single-device ``nn.Module``s: parallelism
is applied to them from outside (STYLE.md, "Models stay single-device")."""

from __future__ import annotations

from dataclasses import dataclass

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


# --- A small GPT: the transformer notebooks 06 (tensor parallel) and 07 (3D) parallelize -----


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of :class:`GPT`. Megatron's letters: ``h`` = ``d_model``, ``a`` = ``n_heads``,
    ``s`` = ``seq_len``, ``v`` = ``vocab``, ``L`` = ``n_layers``."""

    vocab: int = 64
    """Vocabulary size (tokens are ``0 .. vocab-1``)."""
    seq_len: int = 16
    """Longest sequence (the position table's length)."""
    d_model: int = 32
    """Hidden size ``h``."""
    n_heads: int = 4
    """Attention heads ``a``; ``d_model`` must be a multiple of it."""
    n_layers: int = 2
    """Transformer layers."""
    ffn_mult: int = 4
    """MLP width as a multiple of ``d_model`` (4 in GPT-2 and in Megatron's formulas)."""
    dropout: float = 0.0
    """Dropout after attention's softmax, attention's output and the MLP (0: no dropout layers)."""

    def __post_init__(self):
        for name in ("vocab", "seq_len", "d_model", "n_heads", "n_layers", "ffn_mult"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a whole number >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be a multiple of n_heads={self.n_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused ``qkv`` projection.

    ``qkv``'s output features are laid out head by head, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``
    (Megatron-LM's layout), so a contiguous slice of its rows holds whole heads with their Q, K
    and V: cutting ``qkv`` column-wise into ``t`` contiguous shards gives each rank ``a/t`` heads.
    The number of heads is read from ``qkv``'s output width, so the same code runs on a shard.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim  # n_heads: of the whole model
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop, self.drop = _dropout(cfg.dropout), _dropout(cfg.dropout)
        mask = torch.full((cfg.seq_len, cfg.seq_len), float("-inf")).triu(1)
        self.register_buffer("causal", mask, persistent=False)  # added: saves nothing for backward

    def forward(self, x):  # (B, T, h) -> (B, T, h)
        qkv = self.qkv(x)  # (B, T, 3h): read B and T here, where the sequence is whole
        B, T = qkv.shape[0], qkv.shape[1]
        qkv = qkv.view(B, T, -1, 3, self.head_dim)  # (B, T, heads, 3, hd)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # each (B, heads, T, hd)
        y = self.attend(q, k, v).transpose(1, 2).reshape(B, T, -1)  # (B, T, heads * hd)
        return self.drop(self.proj(y))  # (B, T, h)

    def attend(self, q, k, v):  # (B, heads, T, hd) each -> (B, heads, T, hd)
        """Causal softmax attention over the whole sequence. Context parallelism
        (``course_utils.context_parallel.apply_cp``) replaces this method on the instance, with
        attention over a sequence sharded across ranks."""
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5  # (B, heads, T, T)
        att = self.attn_drop(torch.softmax(att + self.causal[:T, :T], dim=-1))
        return att @ v


class MLP(nn.Module):
    """``up`` (h -> 4h), GELU, ``down`` (4h -> h), dropout."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ffn_mult * cfg.d_model)
        self.down = nn.Linear(cfg.ffn_mult * cfg.d_model, cfg.d_model)
        self.drop = _dropout(cfg.dropout)

    def forward(self, x):  # (B, T, h) -> (B, T, h)
        return self.drop(self.down(nn.functional.gelu(self.up(x))))  # up: (B, T, 4h)


class Block(nn.Module):
    """A pre-LayerNorm transformer layer: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x):  # (B, T, h) -> (B, T, h)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, ``n_layers`` :class:`Block`s, a final
    LayerNorm and an untied ``head`` to the vocabulary. ``(B, T)`` token ids -> ``(B, T, vocab)``
    logits. Single-device; notebook 06 shards it with ``course_utils.tensor_parallel.apply_tp``.
    """

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = _dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx, positions=None):  # (B, T) -> (B, T, vocab)
        """``positions`` (T,): the tokens' places in the sequence, ``0..T−1`` when not given
        (context parallelism gives each rank a shard of the tokens and their positions)."""
        T = idx.shape[1]
        if positions is None:
            if self.cfg.seq_len < T:
                raise ValueError(
                    f"sequence of {T} tokens, but the model's seq_len is {self.cfg.seq_len}"
                )
            pos = self.pos.weight[:T]  # (T, h)
        else:
            if positions.shape != (T,) or int(positions.max()) >= self.cfg.seq_len:
                raise ValueError(
                    f"positions must be {T} places below seq_len={self.cfg.seq_len}, got "
                    f"shape {tuple(positions.shape)}, largest {int(positions.max())}"
                )
            pos = self.pos(positions.to(idx.device))  # (T, h)
        x = self.drop(self.embed(idx) + pos)  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)
