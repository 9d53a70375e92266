"""What the planner plans for: the model (a GPT or a Llama-style transformer), the cluster, a layout.

Megatron's letters: ``L`` layers, ``h`` hidden, ``a`` heads, ``s`` sequence, ``V`` vocabulary,
``B`` global batch, ``b`` micro-batch, ``m`` micro-batches per replica, ``t``/``p``/``d`` the tensor-,
pipeline- and data-parallel degrees, ``v`` model chunks per pipeline stage (interleaving).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..comm.model import AlphaBeta
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
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    top_k: int = 1
    """Experts each token is routed to."""
    expert_ffn: int | None = None
    """One expert's MLP width (default: ``ffn``)."""
    shared_experts: int = 0
    """Experts every token passes through besides its routed ones (DeepSeek's shared expert)."""
    dense_layers: int = 0
    """The first ``dense_layers`` layers have a dense MLP of width ``ffn`` (DeepSeek-V3: 3)."""
    attention_params: int | None = None
    """One layer's attention matrices when they are not Q, K, V, O of ``h`` (DeepSeek's latent
    attention, MLA); default: ``2h² + 2·h·kv·head_dim``."""
    attention_width: int | None = None
    """``a · head_dim`` of the scores' products, ``QKᵀ`` and ``PV``, averaged (MLA: (192 + 128) / 2 ·
    128 = 20,480); default ``h``."""
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
        if self.experts:
            _positive("Transformer", experts=self.experts, top_k=self.top_k)
            if self.top_k > self.experts or not 0 <= self.dense_layers < self.layers:
                raise ValueError(
                    f"Transformer: need top_k <= experts and 0 <= dense_layers < layers, got "
                    f"top_k={self.top_k}, experts={self.experts}, dense_layers={self.dense_layers}"
                )

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

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def score_width(self) -> int:
        return self.attention_width or self.hidden

    # ---- parameters ---------------------------------------------------------------------------
    def attn_params(self) -> int:
        """One layer's attention matrices: Q and O ``h²`` each, K and V ``h·kv·hd`` each."""
        if self.attention_params is not None:
            return self.attention_params
        h, kvd = self.hidden, self.kv * self.head_dim
        return 2 * h * h + 2 * h * kvd

    def expert_params(self) -> int:
        """One expert's matrices (gate, up and down with SwiGLU)."""
        return (3 if self.gated else 2) * self.hidden * (self.expert_ffn or self.ffn)

    def matmul_params(self) -> int:
        """One dense layer's matrix weights: the attention's and the MLP's ``2·h·ffn`` (three
        with SwiGLU)."""
        return self.attn_params() + (3 if self.gated else 2) * self.hidden * self.ffn

    def active_matmul_params(self) -> float:
        """Matrix weights a token passes through, averaged over the layers: a MoE layer's
        attention, router, ``top_k`` routed and the shared experts."""
        if not self.moe:
            return self.matmul_params()
        moe = (
            self.attn_params()
            + self.hidden * self.experts
            + (self.top_k + self.shared_experts) * self.expert_params()
        )
        return (self.dense_layers * self.matmul_params() + self.moe_layers * moe) / self.layers

    def moe_layer_expert_params(self) -> int:
        """A MoE layer's routed experts (what expert parallelism splits)."""
        return self.experts * self.expert_params()

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

    def moe_layer_params(self) -> int:
        """One MoE layer: attention, norms, router, routed and shared experts."""
        dense_mlp = (3 if self.gated else 2) * self.hidden * self.ffn
        return (
            self.layer_params()
            - dense_mlp
            + self.hidden * self.experts
            + (self.experts + self.shared_experts) * self.expert_params()
        )

    @property
    def params(self) -> int:
        """All parameters, vocabulary not padded (the model's own count)."""
        h, V = self.hidden, self.vocab
        pos = self.seq_len * h if self.position_embeddings else 0
        norm = 2 * h if self.bias else h
        layers = (self.layers - self.moe_layers) * self.layer_params()
        layers += self.moe_layers * self.moe_layer_params() if self.moe else 0
        return layers + V * h * (1 if self.tied_embeddings else 2) + pos + norm

    @property
    def active_params(self) -> float:
        """Parameters one token passes through (a MoE model's "activated" count)."""
        if not self.moe:
            return self.params
        per_layer = self.layer_params() - self.matmul_params() + self.active_matmul_params()
        h, V = self.hidden, self.vocab
        return self.layers * per_layer + V * h * (1 if self.tied_embeddings else 2) + h

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
    half_efficiency_width: float = 0.0
    """Per-GPU width of a matrix product (``h/t`` for the attention's, ``ffn/t`` for the MLP's)
    at which it runs at half speed: TP's narrow matrices run further from peak.
    ``width / (width + half_efficiency_width)``; 0 = no penalty."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self):
        _positive("Cluster", gpus_per_node=self.gpus_per_node)
        if self.memory_bytes <= 0 or self.peak_flops <= 0 or not 0 < self.efficiency <= 1:
            raise ValueError(
                f"Cluster: need memory_bytes > 0, peak_flops > 0 and 0 < efficiency <= 1, got "
                f"{self.memory_bytes}, {self.peak_flops}, {self.efficiency}"
            )
        if min(self.half_efficiency_tokens, self.memory_bandwidth, self.half_efficiency_width) < 0:
            raise ValueError(
                "Cluster: half_efficiency_tokens, half_efficiency_width and memory_bandwidth "
                "must be >= 0"
            )

    def matmul_efficiency(self, tokens: float, width: float | None = None) -> float:
        """Fraction of peak the matrix products of a ``tokens``-token micro-batch reach, on
        matrices ``width`` wide per GPU (``h/t``; ``None``: wide enough not to matter)."""
        eff = self.efficiency * tokens / (tokens + self.half_efficiency_tokens)
        if width is not None and self.half_efficiency_width:
            eff *= width / (width + self.half_efficiency_width)
        return eff


# The matrix-product efficiency (compute only), per GPU generation. Two shape terms: small
# micro-batches make short matrices (half speed at 256 tokens per micro-batch: the trend of
# Narayanan et al. 2021, Figure 7), tensor parallelism narrow ones (half speed at 256 columns per
# GPU: a product 1,024 wide per GPU at 80% of a wide one's rate, 512 at 67%; the attention's h/t
# and the MLP's ffn/t weighted by their FLOPs). Both are assumptions, checked only through the
# fit to the published runs below, not measured here.
# The large-GEMM fraction of peak, ``efficiency``, is calibrated per generation so that the
# published layouts of `published.py` are predicted at their published throughput (the test
# `test_calibration_per_generation` holds each within 25%):
# - A100: Narayanan et al. 2021 Table 1 (137–163 TFLOP/s per GPU of 312, full recomputation);
# - H100: Llama 3 405B (Dubey et al. 2024, arXiv:2407.21783, Table 4: 380–430 TFLOP/s per GPU
#   of 989, BF16 MFU 38–43%); the H100's peak is harder to reach than the A100's;
# - H200 and H800: the H100's compute (989 TFLOP/s dense bf16), more memory (H200) or a slower
#   NVLink (H800); no published MFU of their own is used;
# - MI250X: one GCD (half a card) is a GPU here, 191.5 TFLOP/s dense bf16 (383 per card).
#   Dash et al. 2023 (arXiv:2312.12705, abstract) report 38.4%, 36.1% and 32.0% of peak for 22 B,
#   175 B and 1 T models on Frontier; their layouts are not transcribed here, so the efficiency is
#   scaled from the A100's by the ratio of published MFU at 175 B: 36.1% on MI250X against OPT-175B's
#   147 of 312 TFLOP/s (47%, Zhang et al. 2022, arXiv:2205.01068, §2.4) on A100: 0.75 · 0.77.
_HALF_TOKENS, _HALF_WIDTH = 256.0, 256.0

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
    efficiency=0.75,
    half_efficiency_tokens=_HALF_TOKENS,
    half_efficiency_width=_HALF_WIDTH,
    memory_bandwidth=2.0e12,  # HBM2e, 2,039 GB/s (A100 80GB SXM datasheet)
    name="DGX A100 80GB, HDR InfiniBand (Selene)",
    source="A100 datasheet; Narayanan et al. 2021 §5 (Selene)",
)

# DGX H100 nodes: 8 H100 SXM 80GB, 989 TFLOP/s bf16 dense (H100 datasheet); NVLink 4 at 900 GB/s
# per GPU both ways, 450 GB/s each way; one 400 Gb/s NDR InfiniBand port per GPU: 50 GB/s.
H100_80GB = Cluster(
    gpus_per_node=8,
    memory_bytes=80e9,
    peak_flops=989e12,
    intra=AlphaBeta(alpha=5e-6, beta=450e9),
    inter=AlphaBeta(alpha=10e-6, beta=50e9),
    efficiency=0.72,
    half_efficiency_tokens=_HALF_TOKENS,
    half_efficiency_width=_HALF_WIDTH,
    memory_bandwidth=3.35e12,  # HBM3, 3.35 TB/s (H100 SXM datasheet)
    name="DGX H100 80GB, NDR InfiniBand",
    source="H100 SXM datasheet; efficiency from Llama 3 405B (arXiv:2407.21783, Table 4)",
)

# HGX H200: the H100's compute with 141 GB of HBM3e at 4.8 TB/s (H200 datasheet).
H200_141GB = replace(
    H100_80GB,
    memory_bytes=141e9,
    memory_bandwidth=4.8e12,
    name="HGX H200 141GB, NDR InfiniBand",
    source="H200 datasheet; efficiency as the H100's (same compute)",
)

# DeepSeek's H800 nodes (DeepSeek-V3 technical report, arXiv:2412.19437, §3.1): 8 GPUs linked by
# NVLink at 160 GB/s and by InfiniBand at 50 GB/s per GPU; the H100's compute.
H800_80GB = replace(
    H100_80GB,
    intra=AlphaBeta(alpha=5e-6, beta=160e9),
    name="H800 80GB nodes (DeepSeek)",
    source="DeepSeek-V3 report (arXiv:2412.19437) §3.1; efficiency as the H100's",
)

# Frontier / LUMI nodes: 4 MI250X = 8 GCDs, each 64 GB of HBM2e at 1.6 TB/s and 191.5 TFLOP/s
# dense bf16 (AMD datasheet); Infinity Fabric between GCDs, 50 GB/s each way per GCD pair link
# (the slowest of the node's links, so the ring's); 4 Slingshot NICs of 25 GB/s per node:
# 12.5 GB/s per GCD.
MI250X_GCD = Cluster(
    gpus_per_node=8,
    memory_bytes=64e9,
    peak_flops=191.5e12,
    intra=AlphaBeta(alpha=5e-6, beta=50e9),
    inter=AlphaBeta(alpha=10e-6, beta=12.5e9),
    efficiency=0.58,
    half_efficiency_tokens=_HALF_TOKENS,
    half_efficiency_width=_HALF_WIDTH,
    memory_bandwidth=1.6e12,
    name="MI250X (one GCD per GPU), Slingshot (Frontier, LUMI)",
    source="AMD MI250X datasheet; Frontier node architecture (OLCF user guide); efficiency from "
    "Dash et al. 2023 (arXiv:2312.12705) against OPT-175B (arXiv:2205.01068)",
)

CLUSTERS = {"A100": A100_80GB, "H100": H100_80GB, "H200": H200_141GB, "H800": H800_80GB,
            "MI250X": MI250X_GCD}  # fmt: skip


@dataclass(frozen=True)
class Choice:
    """One layout: ``dp × cp × pp × tp`` GPUs, a ZeRO stage over the data-parallel ranks, ``m``
    micro-batches, ``interleave`` model chunks per pipeline stage (``v``; 1 = plain 1F1B), and
    ``ep`` expert-parallel ranks carved out of the ``dp × cp`` ones (a MoE model's experts are
    split ``ep`` ways and replicated ``dp·cp/ep`` times).

    ``zero=3`` is FSDP: parameters gathered and gradients reduce-scattered one layer at a time;
    ``reshard=False`` keeps each layer gathered from its forward to its backward (FSDP's
    ``reshard_after_forward=False``, ZeRO-2-like: one gather per layer and micro-batch instead of
    two). ``shard`` > 0 is HSDP: the states sharded over groups of ``shard`` data-parallel ranks
    and replicated across the ``dp/shard`` groups (0: sharded over all ``dp``)."""

    dp: int
    pp: int
    tp: int
    zero: int = 0
    micro_batches: int = 1
    """``m``: micro-batches per replica and step (pipeline or gradient accumulation)."""
    interleave: int = 1
    """``v``: chunks per stage for interleaved 1F1B (Megatron-LM); the bubble shrinks by ``v``."""
    cp: int = 1
    """Context parallelism: each sequence split over ``cp`` ranks (notebook 09)."""
    ep: int = 1
    """Expert parallelism: each MoE layer's experts split over ``ep`` ranks (notebook 10)."""
    reshard: bool = True
    """FSDP (``zero=3``) only: free each layer's gathered parameters after its forward."""
    shard: int = 0
    """HSDP: shard over groups of this many data-parallel ranks (0: over all ``dp``)."""

    def __post_init__(self):
        _positive("Choice", dp=self.dp, pp=self.pp, tp=self.tp, micro_batches=self.micro_batches,
                  interleave=self.interleave, cp=self.cp, ep=self.ep)  # fmt: skip
        if self.zero not in STAGES:
            raise ValueError(f"Choice: zero must be 0, 1, 2 or 3, not {self.zero!r}")
        if self.shard and (self.shard < 1 or self.dp % self.shard):
            raise ValueError(f"Choice: shard={self.shard} must divide dp={self.dp}")
        if (not self.reshard or self.shard) and self.zero != 3:
            raise ValueError("Choice: reshard=False and shard (HSDP) are FSDP options: zero=3")

    @property
    def n_gpus(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def shard_degree(self) -> int:
        """Ranks the dense model states are sharded over: ``dp·cp`` (the context-parallel ranks
        hold the same weights and join the sharding, as in Megatron-Core and torchtitan), or
        ``shard·cp`` with HSDP."""
        return (self.shard or self.dp) * self.cp

    @property
    def replicas(self) -> int:
        """HSDP: groups that hold the same shards (1 without HSDP)."""
        return self.dp // self.shard if self.shard else 1

    @property
    def family(self) -> str:
        """The data-parallel family in practitioners' words."""
        if self.zero < 3:
            return ("DDP", "ZeRO-1", "ZeRO-2")[self.zero]
        kind = "HSDP" if self.shard and self.shard < self.dp else "FSDP"
        return kind + ("" if self.reshard else " (no reshard after forward)")

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


def shard_split(model: Transformer, pp: int, tp: int, interleave: int = 1, ep: int = 1) -> dict:
    """Parameters one GPU holds on the heavier end stage of a ``pp × tp`` split (Megatron's), in
    two parts: ``dense`` (sharded by ZeRO over the data-parallel ranks) and ``expert`` (a MoE
    stage's routed experts, ``experts/ep`` of them, each split by ``t``; sharded over the
    ``dp·cp/ep`` ranks that hold the same experts). The matrices are split by ``t`` (QKV and
    MLP-in by columns, O and MLP-out by rows), biases of column-parallel layers split too, the rest
    (norms, row-parallel biases, a MoE router) whole; the vocabulary-parallel embedding (and head)
    ``V·h/t`` with the vocabulary padded."""
    h, t = model.hidden, tp
    kvd = model.kv * model.head_dim
    split = model.matmul_params() / t
    if model.bias:
        split += (h + 2 * kvd + (2 if model.gated else 1) * model.ffn) / t  # qkv and MLP-in biases
        whole = 2 * 2 * h + 2 * h  # LayerNorms, the biases of O and MLP-out
    else:
        whole = 2 * h
    per_layer = split + whole
    layers = math.ceil(model.layers / (pp * interleave)) * interleave
    dense_layers, expert = layers, 0.0
    body = layers * per_layer
    if model.moe:
        moe = min(layers, model.moe_layers)  # the fullest stage: as many MoE layers as it can hold
        dense_layers = layers - moe
        dense_mlp = (3 if model.gated else 2) * h * model.ffn / t
        moe_dense = per_layer - dense_mlp + h * model.experts
        moe_dense += model.shared_experts * model.expert_params() / t
        body = dense_layers * per_layer + moe * moe_dense
        expert = moe * -(-model.experts // ep) * model.expert_params() / t
    V = model.padded_vocab(t)
    pos = model.seq_len * h if model.position_embeddings else 0
    norm = 2 * h if model.bias else h
    if pp == 1:
        dense = body + V * h / t * (1 if model.tied_embeddings else 2) + pos + norm
    else:
        first = body + V * h / t + pos
        last = body + norm + V * h / t  # tied: the head keeps a copy on the last stage
        dense = max(first, last)
    return {"dense": dense, "expert": expert, "dense_layers": dense_layers}


def shard_params(model: Transformer, pp: int, tp: int, interleave: int = 1, ep: int = 1) -> float:
    """Parameters one GPU holds on the heavier end stage (:func:`shard_split`'s two parts)."""
    part = shard_split(model, pp, tp, interleave, ep)
    return part["dense"] + part["expert"]


def forward_layer_flops(model: Transformer, tokens_per_seq: int, sequences: float) -> float:
    """FLOPs of one layer's forward, averaged over the layers: ``2·(matrix weights a token passes
    through)`` per token (a MoE layer's ``top_k`` and shared experts, not all of them), and
    ``4·s²·w`` per sequence for the attention scores and their product with V (``w = h``, or the
    latent attention's width; Narayanan et al. 2021 count them without the causal saving)."""
    s = tokens_per_seq
    return (
        2 * model.active_matmul_params() * sequences * s + 4 * sequences * s * s * model.score_width
    )


def flops_per_step(model: Transformer, recompute: bool | str = False) -> float:
    """FLOPs of one step. Three passes (forward, and backward at twice the forward) over the
    layers and the logit layer; full recomputation adds one forward of the layers (Narayanan et al.
    2021, eq. 3: ``96·B·s·L·h²·(1 + s/6h + V/16Lh)`` for their GPT), selective recomputation only
    the attention scores' part (``4·B·s²·h`` per layer, Korthikanti et al. 2022)."""
    mode = _recompute_mode(recompute)
    B, s, L = model.global_batch, model.seq_len, model.layers
    fwd = forward_layer_flops(model, s, B)
    extra = {"none": 0.0, "selective": 4 * B * s * s * model.score_width, "full": fwd}[mode]
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
    "CLUSTERS",
    "H200_141GB",
    "H800_80GB",
    "MI250X_GCD",
    "shard_split",
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
