"""What the planner plans for: the model (a GPT or a Llama-style transformer), the cluster, a layout.

Megatron's letters: ``L`` layers, ``h`` hidden, ``a`` heads, ``s`` sequence, ``V`` vocabulary,
``B`` global batch, ``b`` micro-batch, ``m`` micro-batches per replica, ``t``/``p``/``d`` the tensor-,
pipeline- and data-parallel degrees, ``v`` model chunks per pipeline stage (interleaving).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..comm_model import AlphaBeta
from ..zero import STAGES

GB = 1e9


def _positive(owner: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{owner}: {name} must be a whole number >= 1, got {value!r}")


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer as the planner sees it.

    The defaults describe the course's GPT (:class:`course_utils.models.GPT`): LayerNorms with
    biases, biased linear layers, a GeLU MLP ``ffn_mult·h`` wide, learned position embeddings, an
    untied head, dropout. A Llama-3-style model sets ``ffn_hidden`` (any width), ``gated=True``
    (SwiGLU: gate, up and down matrices), ``kv_heads`` (grouped-query attention), ``bias=False``,
    ``position_embeddings=False`` (rotary) and ``dropout=False``.
    """

    layers: int
    """``L``: transformer layers."""
    hidden: int
    """``h``: hidden size."""
    heads: int
    """``a``: attention (query) heads; ``hidden`` must be a multiple."""
    seq_len: int
    """``s``: tokens per sequence."""
    vocab: int
    """``V``: vocabulary size, before padding."""
    global_batch: int
    """``B``: sequences per optimizer step, over all data-parallel replicas."""
    ffn_mult: int = 4
    """MLP width as a multiple of ``h`` when ``ffn_hidden`` is not given (4 in Megatron's formulas)."""
    name: str = ""
    ffn_hidden: int | None = None
    """MLP width in units, any whole number (Llama 3 8B: 14,336); overrides ``ffn_mult``."""
    gated: bool = False
    """SwiGLU MLP: three ``h × ffn`` matrices (gate, up, down) instead of two."""
    kv_heads: int | None = None
    """Grouped-query attention: key/value heads (``None``: as many as query heads)."""
    tied_embeddings: bool = False
    """The head reuses the token embedding's matrix."""
    position_embeddings: bool = True
    """A learned ``s × h`` position table (GPT); ``False`` for rotary embeddings (Llama)."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms (GPT); ``False`` for Llama (RMSNorm, no biases)."""
    dropout: bool = True
    """Dropout after attention and the MLP, and on the attention probabilities (its masks are kept)."""
    vocab_multiple: int = 128
    """Megatron pads the vocabulary to a multiple of ``vocab_multiple · t``
    (``--make-vocab-size-divisible-by``), so that every ``t`` splits it; 1 = no padding (then
    ``t`` must divide ``V``: the course's own GPT)."""

    def __post_init__(self):
        names = ("layers", "hidden", "heads", "seq_len", "vocab", "global_batch", "ffn_mult")
        _positive("Transformer", **{n: getattr(self, n) for n in names})
        _positive("Transformer", vocab_multiple=self.vocab_multiple)
        if self.hidden % self.heads:
            raise ValueError(
                f"Transformer: hidden={self.hidden} must be a multiple of heads={self.heads}"
            )
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(
                f"Transformer: kv_heads={self.kv_heads} must divide heads={self.heads}"
            )
        if self.ffn_hidden is not None:
            _positive("Transformer", ffn_hidden=self.ffn_hidden)

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def ffn(self) -> int:
        """The MLP's width."""
        return self.ffn_hidden if self.ffn_hidden is not None else self.ffn_mult * self.hidden

    @property
    def kv(self) -> int:
        """Key/value heads."""
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def padded_vocab(self, t: int = 1) -> int:
        """``V`` rounded up to a multiple of ``vocab_multiple · t`` (Megatron's padding); ``V``
        itself when ``vocab_multiple`` is 1 (no padding: ``t`` must divide ``V``)."""
        if self.vocab_multiple == 1:
            return self.vocab
        unit = self.vocab_multiple * t
        return -(-self.vocab // unit) * unit

    # ---- parameters ---------------------------------------------------------------------------
    def matmul_params(self) -> int:
        """One layer's matrix weights: Q and O ``h²`` each, K and V ``h·kv·hd`` each, the MLP
        ``2·h·ffn`` (three with SwiGLU)."""
        h, kvd = self.hidden, self.kv * self.head_dim
        return 2 * h * h + 2 * h * kvd + (3 if self.gated else 2) * h * self.ffn

    def layer_params(self) -> int:
        """One layer: the matrices, and with ``bias`` the biases and LayerNorm shifts (GPT:
        ``(4+2f)h² + (9+f)h``)."""
        h, kvd, f = self.hidden, self.kv * self.head_dim, self.ffn
        norms = 2 * (2 * h if self.bias else h)
        biases = (2 * h + 2 * kvd + (2 if self.gated else 1) * f + h) if self.bias else 0
        return self.matmul_params() + norms + biases

    def embedding_params(self, t: int = 1) -> int:
        """Token embedding, head (unless tied), position table and final norm, vocabulary padded
        for ``t``: what the first and last stages hold besides their layers."""
        h, V = self.hidden, self.padded_vocab(t)
        pos = self.seq_len * h if self.position_embeddings else 0
        norm = 2 * h if self.bias else h
        return V * h * (1 if self.tied_embeddings else 2) + pos + norm

    @property
    def params(self) -> int:
        """All parameters, vocabulary not padded (the model's own count)."""
        h, V = self.hidden, self.vocab
        pos = self.seq_len * h if self.position_embeddings else 0
        norm = 2 * h if self.bias else h
        return (
            self.layers * self.layer_params()
            + V * h * (1 if self.tied_embeddings else 2)
            + pos
            + norm
        )

    @classmethod
    def from_gpt_config(cls, cfg, global_batch: int) -> Transformer:
        """The planner's view of :class:`course_utils.models.GPTConfig` (no vocabulary padding:
        the course's model splits its own vocabulary, and ``t`` must divide it)."""
        return cls(
            layers=cfg.n_layers,
            hidden=cfg.d_model,
            heads=cfg.n_heads,
            seq_len=cfg.seq_len,
            vocab=cfg.vocab,
            global_batch=global_batch,
            ffn_mult=cfg.ffn_mult,
            dropout=cfg.dropout > 0,
            vocab_multiple=1,
        )


@dataclass(frozen=True)
class Cluster:
    """GPUs and the two links between them, as the α–β model of notebook 03 describes them."""

    gpus_per_node: int
    memory_bytes: float
    """One GPU's memory."""
    peak_flops: float
    """One GPU's dense 16-bit peak, FLOP/s."""
    intra: AlphaBeta
    """Between GPUs of one node (NVLink), per GPU."""
    inter: AlphaBeta
    """Between nodes (InfiniBand), per GPU: its own NIC's share."""
    efficiency: float = 0.75
    """Fraction of ``peak_flops`` the matrix products reach when they are large: compute only,
    not end to end (no bubble, no communication, both of which the planner adds)."""
    name: str = ""
    half_efficiency_tokens: float = 0.0
    """Tokens per micro-batch (``b·s``) at which the matrix products run at half of
    ``efficiency``'s rate: small micro-batches make small matrices, which run further from peak.
    ``efficiency · bs / (bs + half_efficiency_tokens)``; 0 = the same rate at every size."""
    memory_bandwidth: float = 0.0
    """One GPU's memory bandwidth, bytes/s: the element-wise operations between the matrix
    products (norms, softmax, dropout, GeLU, residuals) are bound by it, not by FLOP/s. 0 = left
    out (a CPU calibrated end to end)."""

    def __post_init__(self):
        _positive("Cluster", gpus_per_node=self.gpus_per_node)
        if self.memory_bytes <= 0 or self.peak_flops <= 0 or not 0 < self.efficiency <= 1:
            raise ValueError(
                f"Cluster: need memory_bytes > 0, peak_flops > 0 and 0 < efficiency <= 1, got "
                f"{self.memory_bytes}, {self.peak_flops}, {self.efficiency}"
            )
        if self.half_efficiency_tokens < 0 or self.memory_bandwidth < 0:
            raise ValueError("Cluster: half_efficiency_tokens and memory_bandwidth must be >= 0")

    def matmul_efficiency(self, tokens: float) -> float:
        """Fraction of peak the matrix products of a ``tokens``-token micro-batch reach."""
        return self.efficiency * tokens / (tokens + self.half_efficiency_tokens)


# The matrix-product efficiency (compute only): cuBLAS reaches about three quarters of the 16-bit
# dense peak on the large GEMMs of a transformer (an assumption from published GEMM benchmarks,
# not measured here; notebook 07 says so), less on small micro-batches: half of it at 256 tokens
# per micro-batch, so 89% of it at b=1, s=2048 (the trend of Narayanan et al. 2021, Figure 7:
# per-GPU throughput grows with the micro-batch).
_EFFICIENCY, _HALF_TOKENS = 0.75, 256.0

# Selene's DGX A100 nodes (Narayanan et al. 2021, §5): 8 A100-80GB, 312 TFLOP/s bf16 dense (A100
# datasheet); NVLink 3 at 600 GB/s per GPU both ways, 300 GB/s each way; 8 × 200 Gb/s HDR
# InfiniBand HCAs per node, one per GPU: 25 GB/s. α (our choice, not measured): 5 µs per ring
# step inside a node, twice that across the network.
A100_80GB = Cluster(
    gpus_per_node=8,
    memory_bytes=80e9,
    peak_flops=312e12,
    intra=AlphaBeta(alpha=5e-6, beta=300e9),
    inter=AlphaBeta(alpha=10e-6, beta=25e9),
    efficiency=_EFFICIENCY,
    half_efficiency_tokens=_HALF_TOKENS,
    memory_bandwidth=2.0e12,  # HBM2e, 2,039 GB/s (A100 80GB SXM datasheet)
    name="DGX A100 80GB, HDR InfiniBand (Selene)",
)

# DGX H100 nodes: 8 H100 SXM 80GB, 989 TFLOP/s bf16 dense (H100 datasheet); NVLink 4 at 900 GB/s
# per GPU both ways, 450 GB/s each way; one 400 Gb/s NDR InfiniBand port per GPU: 50 GB/s.
H100_80GB = Cluster(
    gpus_per_node=8,
    memory_bytes=80e9,
    peak_flops=989e12,
    intra=AlphaBeta(alpha=5e-6, beta=450e9),
    inter=AlphaBeta(alpha=10e-6, beta=50e9),
    efficiency=_EFFICIENCY,
    half_efficiency_tokens=_HALF_TOKENS,
    memory_bandwidth=3.35e12,  # HBM3, 3.35 TB/s (H100 SXM datasheet)
    name="DGX H100 80GB, NDR InfiniBand",
)


@dataclass(frozen=True)
class Choice:
    """One layout: ``dp × pp × tp`` GPUs, a ZeRO stage over ``dp``, ``m`` micro-batches, and
    ``interleave`` model chunks per pipeline stage (``v``; 1 = plain 1F1B)."""

    dp: int
    pp: int
    tp: int
    zero: int = 0
    micro_batches: int = 1
    """``m``: micro-batches per replica and step (pipeline or gradient accumulation)."""
    interleave: int = 1
    """``v``: chunks per stage for interleaved 1F1B (Megatron-LM); the bubble shrinks by ``v``."""

    def __post_init__(self):
        _positive("Choice", dp=self.dp, pp=self.pp, tp=self.tp, micro_batches=self.micro_batches,
                  interleave=self.interleave)  # fmt: skip
        if self.zero not in STAGES:
            raise ValueError(f"Choice: zero must be 0, 1, 2 or 3, not {self.zero!r}")

    @property
    def n_gpus(self) -> int:
        return self.dp * self.pp * self.tp

    def micro_batch_size(self, model: Transformer) -> int:
        """``b = B / (dp · m)``; it must be whole."""
        b, rest = divmod(model.global_batch, self.dp * self.micro_batches)
        if rest or b == 0:
            raise ValueError(
                f"global batch {model.global_batch} is not divisible by dp={self.dp} × "
                f"m={self.micro_batches} = {self.dp * self.micro_batches}: pick m dividing "
                f"{model.global_batch}/dp"
            )
        return b


def layers_per_stage(model: Transformer, choice: Choice) -> int:
    """Layers on the fullest stage: ``⌈L / (p·v)⌉ · v`` (each of the ``v`` chunks rounded up)."""
    return math.ceil(model.layers / (choice.pp * choice.interleave)) * choice.interleave


def shard_params(model: Transformer, pp: int, tp: int, interleave: int = 1) -> float:
    """Parameters one GPU holds on the heavier end stage of a ``pp × tp`` split (Megatron's):
    the matrices split by ``t`` (QKV and MLP-in by columns, O and MLP-out by rows), biases of
    column-parallel layers split too, the rest (norms, row-parallel biases) whole; the
    vocabulary-parallel embedding (and head) ``V·h/t`` with the vocabulary padded."""
    h, t = model.hidden, tp
    kvd = model.kv * model.head_dim
    split = model.matmul_params() / t
    if model.bias:
        split += (h + 2 * kvd + (2 if model.gated else 1) * model.ffn) / t  # qkv and MLP-in biases
        whole = 2 * 2 * h + 2 * h  # LayerNorms, the biases of O and MLP-out
    else:
        whole = 2 * h
    per_layer = split + whole
    V = model.padded_vocab(t)
    pos = model.seq_len * h if model.position_embeddings else 0
    norm = 2 * h if model.bias else h
    layers = math.ceil(model.layers / (pp * interleave)) * interleave
    if pp == 1:
        return (
            model.layers * per_layer + V * h / t * (1 if model.tied_embeddings else 2) + pos + norm
        )
    first = layers * per_layer + V * h / t + pos
    last = layers * per_layer + norm + V * h / t  # tied: the head keeps a copy on the last stage
    return max(first, last)


def forward_layer_flops(model: Transformer, tokens_per_seq: int, sequences: float) -> float:
    """FLOPs of one layer's forward: ``2·(matrix weights)`` per token, and ``4·s²·h`` per
    sequence for the attention scores and their product with V (Narayanan et al. 2021 count them
    without the causal saving)."""
    s = tokens_per_seq
    return 2 * model.matmul_params() * sequences * s + 4 * sequences * s * s * model.hidden


def flops_per_step(model: Transformer, recompute: bool | str = False) -> float:
    """FLOPs of one step. Three passes (forward, and backward at twice the forward) over the
    layers and the logit layer; full recomputation adds one forward of the layers (Narayanan et al.
    2021, eq. 3: ``96·B·s·L·h²·(1 + s/6h + V/16Lh)`` for their GPT), selective recomputation only
    the attention scores' part (``4·B·s²·h`` per layer, Korthikanti et al. 2022)."""
    mode = _recompute_mode(recompute)
    B, s, L = model.global_batch, model.seq_len, model.layers
    fwd = forward_layer_flops(model, s, B)
    extra = {"none": 0.0, "selective": 4 * B * s * s * model.hidden, "full": fwd}[mode]
    return L * (3 * fwd + extra) + 6 * B * s * model.hidden * model.vocab


RECOMPUTE = ("none", "selective", "full")


def _recompute_mode(recompute: bool | str) -> str:
    if recompute is True:
        return "full"
    if recompute is False or recompute is None:
        return "none"
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE} (or True/False), not {recompute!r}")
    return recompute


__all__ = [
    "A100_80GB",
    "GB",
    "H100_80GB",
    "RECOMPUTE",
    "Choice",
    "Cluster",
    "Transformer",
    "flops_per_step",
    "forward_layer_flops",
    "layers_per_stage",
    "shard_params",
]
