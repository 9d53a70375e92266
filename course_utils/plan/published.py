"""The planner against published runs: Megatron-LM's Table 1 (Narayanan et al. 2021), and the
layouts well-known runs used (GPT-3 175B on 1,024 A100s; Llama-3-style 8B and 70B on H100 nodes,
as torchtitan's recipes run them). Each case says where its numbers come from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..comm.model import AlphaBeta
from .layouts import Prediction, _divisors, best_of, plan, predict
from .model import A100_80GB, H100_80GB, H800_80GB, Choice, Cluster, Transformer, flops_per_step

# Narayanan et al. 2021 (arXiv:2104.04473), Table 1: weak scaling on Selene, sequence 2048,
# vocabulary 51,200, mixed precision, full recomputation; params in billions, achieved teraFLOP/s
# per GPU. Numbers from the paper, checked against a structured transcription of its Table 1.
NARAYANAN_SEQ_LEN, NARAYANAN_VOCAB = 2048, 51200
NARAYANAN_TABLE1: list[dict] = [
    dict(params_b=p, heads=a, hidden=h, layers=L, t=t, p=pp, gpus=n, batch=B, tflops_per_gpu=x)
    for p, a, h, L, t, pp, n, B, x in [
        (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
        (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
        (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
        (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
        (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
        (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
        (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
        (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
        (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
        (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
    ]
]
# How the paper ran: the GPT of 2021 (LayerNorm, GeLU MLP of 4h, learned positions, the head tied
# to the embedding as eq. 2 counts it), attention scores materialised (no FlashAttention yet),
# full recomputation, no sequence parallelism (it came in 2022), ZeRO off.
NARAYANAN_RUN = {"recompute": "full", "attention": "materialized", "sequence_parallel": False,
                 "states": "megatron"}  # fmt: skip


def narayanan_model(row: dict) -> Transformer:
    """The :class:`Transformer` of one :data:`NARAYANAN_TABLE1` row."""
    return Transformer(
        layers=row["layers"],
        hidden=row["hidden"],
        heads=row["heads"],
        seq_len=NARAYANAN_SEQ_LEN,
        vocab=NARAYANAN_VOCAB,
        global_batch=row["batch"],
        tied_embeddings=True,
        name=f"GPT-{row['params_b']}B",
    )


def paper_layout(row: dict, cluster: Cluster = A100_80GB, **kw) -> Prediction:
    """The paper's own ``(t, p)``, ZeRO off, run as the paper ran it, at the fastest ``m``."""
    model, n = narayanan_model(row), row["gpus"]
    dp = n // (row["t"] * row["p"])
    kw = {**NARAYANAN_RUN, **kw}
    return best_of(
        predict(model, cluster, Choice(dp, row["p"], row["t"], 0, m), n_gpus=n, **kw)
        for m in _divisors(row["batch"] // dp)
    )


def measured_step_s(row: dict) -> float:
    """The paper's step time, from its teraFLOP/s per GPU and its FLOP count (eq. 3)."""
    model = narayanan_model(row)
    return flops_per_step(model, "full") / (row["gpus"] * row["tflops_per_gpu"] * 1e12)


def compare_narayanan(cluster: Cluster = A100_80GB, **kw) -> list[dict]:
    """For each row of Table 1: the paper's layout predicted as the paper ran it against the step
    time it measured, and the planner's own pick at the paper's GPU count and batch (its defaults:
    FlashAttention, sequence parallelism with TP, the cheapest recomputation that fits, ZeRO)."""
    out = []
    for row in NARAYANAN_TABLE1:
        model, n = narayanan_model(row), row["gpus"]
        theirs = paper_layout(row, cluster)
        ours = plan(model, cluster, n, **kw)[0]
        c = ours.choice
        out.append({
            "model": model.name, "gpus": n, "batch": row["batch"],
            "paper_t": row["t"], "paper_p": row["p"],
            "paper_layout_step_s": theirs.time["total"], "paper_m": theirs.choice.micro_batches,
            "paper_measured_step_s": measured_step_s(row),
            "t": c.tp, "p": c.pp, "dp": c.dp, "m": c.micro_batches, "zero": c.zero,
            "recompute": ours.detail["recompute"], "fits": ours.fits,
            "memory_gb": ours.memory["total"] / 1e9, "step_s": ours.time["total"],
        })  # fmt: skip
    return out


@dataclass(frozen=True)
class PublishedRun:
    """A public training configuration: the model, the GPUs, the layout the run used, and the
    techniques of its time (passed to the planner so that it plans with what the run had)."""

    name: str
    model: Transformer
    cluster: Cluster
    gpus: int
    layout: Choice
    """The run's ``dp``, ``pp``, ``tp``, ``cp``, ``ep`` and ZeRO stage (``micro_batches`` and
    ``interleave`` as published where given)."""
    source: str
    settings: dict = field(default_factory=dict)
    """What the run had, as :func:`~.layouts.predict` keywords: ``attention``,
    ``sequence_parallel``, ``states``, ``tp_overlap``, ``ep_overlap``, ``recompute``..."""
    tflops_per_gpu: float | None = None
    """Published model TFLOP/s per GPU, where the source gives it (or its MFU times the peak)."""
    differs: str = ""
    """Why the run could not, or did not, use the planner's pick, where they differ."""

    @property
    def settings_for_predict(self) -> dict:
        """:attr:`settings` without the planner-only keys (the ZeRO stages to search)."""
        return {k: v for k, v in self.settings.items() if k != "zero_stages"}

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp


def _llama(name, layers, hidden, heads, ffn, batch, seq=8192):
    return Transformer(layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn_hidden=ffn,
                       gated=True, seq_len=seq, vocab=128256, global_batch=batch,
                       position_embeddings=False, bias=False, dropout=False, name=name)  # fmt: skip


GPT3_175B = Transformer(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=50257,
                        global_batch=1536, tied_embeddings=True, name="GPT-3 175B")  # fmt: skip
LLAMA3_8B = _llama("Llama-3-style 8B", 32, 4096, 32, 14336, 256)
LLAMA3_70B = _llama("Llama-3-style 70B", 80, 8192, 64, 28672, 512)
LLAMA3_405B = _llama("Llama 3 405B", 126, 16384, 128, 53248, 2048)
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3, inference/configs/config_671B.json): 61 layers, the first
# 3 dense (MLP 18,432), then 256 routed experts of 2,048 (8 per token) and one shared; latent
# attention (MLA): q rank 1,536, kv rank 512, 128 heads of 128 + 64 (rope) for QK and 128 for V.
_MLA = 7168 * 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 * 128 * 256 + 128 * 128 * 7168
DEEPSEEK_V3 = Transformer(layers=61, hidden=7168, heads=128, ffn_hidden=18432, gated=True,
                          seq_len=4096, vocab=129280, global_batch=15360, experts=256, top_k=8,
                          expert_ffn=2048, shared_experts=1, dense_layers=3, attention_params=_MLA,
                          attention_width=128 * (192 + 128) // 2, position_embeddings=False,
                          bias=False, dropout=False, name="DeepSeek-V3 671B")  # fmt: skip
# Mixtral (Megatron-LM's examples/mixtral): 8 experts, 2 per token, SwiGLU 14,336 / 16,384.
MIXTRAL_8X7B = Transformer(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                           gated=True, seq_len=4096, vocab=32000, global_batch=256, experts=8,
                           top_k=2, position_embeddings=False, bias=False, dropout=False,
                           name="Mixtral 8x7B")  # fmt: skip
MIXTRAL_8X22B = Transformer(layers=56, hidden=6144, heads=48, kv_heads=8, ffn_hidden=16384,
                            gated=True, seq_len=4096, vocab=32768, global_batch=256, experts=8,
                            top_k=2, position_embeddings=False, bias=False, dropout=False,
                            name="Mixtral 8x22B")  # fmt: skip
# BLOOM (bigscience-workshop/bigscience, train/tr11-176B-ml/README.md): 70 layers, h = 14,336,
# 112 heads, ALiBi (no position table), vocabulary 250,680, tied, sequence 2,048, batch 2,048.
BLOOM_176B = Transformer(layers=70, hidden=14336, heads=112, seq_len=2048, vocab=250680,
                         global_batch=2048, tied_embeddings=True, position_embeddings=False,
                         name="BLOOM 176B")  # fmt: skip
# Jean Zay's A100 nodes as BLOOM ran on them: NVLink inside, 4 Omni-Path links of 100 Gb/s per
# node of 8 GPUs: 50 GB/s per node, 6.25 GB/s per GPU (the README above).
JEAN_ZAY_A100 = replace(A100_80GB, inter=AlphaBeta(alpha=10e-6, beta=6.25e9),
                        name="Jean Zay A100 80GB, 4 × 100 Gb/s Omni-Path per node")  # fmt: skip
# torchtitan's benchmark hosts: "Each H100 GPU is equipped with 96GB HBM2e" (the file below).
TORCHTITAN_H100 = replace(H100_80GB, memory_bytes=96e9, memory_bandwidth=2.4e12,
                          name="torchtitan's H100 96GB hosts")  # fmt: skip

_TT = "pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md"
_L3 = "Dubey et al. 2024 (arXiv:2407.21783), §3.3 and Table 4"
_MOE = (
    "NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md, 'Reference Best Parallel Mapping'"
)
_FLASH = {"attention": "flash", "sequence_parallel": True}
# What each framework offers for data parallelism (the planner is given only those stages):
# Megatron-LM, Megatron-DeepSpeed and DeepSeek's HAI-LLM: DDP or the distributed optimizer
# (ZeRO-1); torchtitan: DDP, FSDP or HSDP; Llama 3's trainer: FSDP.
_MEGATRON = {"states": "megatron", "zero_stages": (0, 1)}
_TORCHTITAN = {"states": "fsdp", "zero_stages": (0, 3)}
_FSDP = {"states": "fsdp", "zero_stages": (3,)}

PUBLISHED_RUNS = [
    PublishedRun(
        "GPT-3 175B on 1,024 A100",
        GPT3_175B,
        A100_80GB,
        1024,
        Choice(16, 8, 8, 0),
        "Narayanan et al. 2021 (arXiv:2104.04473): GPT-3 175B on 1,024 A100s at batch 1,536; the "
        "layout is the paper's rule (tensor parallelism of 8 inside each DGX, a pipeline across "
        "them) as its Table 1 applies it to the nearest model, 145.6 B (t = 8, p = 8)",
        {
            "attention": "materialized",
            "sequence_parallel": False,
            "states": "megatron",
            "zero_stages": (0,),
        },  # Megatron-LM in 2021: no distributed optimizer yet
    ),
    PublishedRun(
        "Llama 3 405B on 8,192 H100",
        LLAMA3_405B,
        H100_80GB,
        8192,
        Choice(64, 16, 8, 3, 32, reshard=False),
        f"{_L3}: TP 8, CP 1, PP 16, DP 64, 32 sequences of 8,192 per DP group; FSDP that "
        "does not reshard after forward, gradients reduce-scattered in fp32; 430 TFLOP/s per GPU",
        {**_FLASH, **_FSDP},
        430,
    ),
    PublishedRun(
        "Llama 3 405B on 16,384 H100",
        replace(LLAMA3_405B),
        H100_80GB,
        16384,
        Choice(128, 16, 8, 3, 16, reshard=False),
        f"{_L3}: TP 8, CP 1, PP 16, DP 128, 16 sequences per DP group; 400 TFLOP/s per GPU",
        {**_FLASH, **_FSDP},
        400,
    ),
    PublishedRun(
        "Llama 3 405B, 131K tokens, on 16,384 H100",
        replace(LLAMA3_405B, seq_len=131072, global_batch=128, name="Llama 3 405B (131K)"),
        H100_80GB,
        16384,
        Choice(8, 16, 8, 3, 16, cp=16, reshard=False),
        f"{_L3}: TP 8, CP 16, PP 16, DP 8, sequences of 131,072 tokens; 380 TFLOP/s per GPU",
        {**_FLASH, **_FSDP},
        380,
    ),
    PublishedRun(
        "torchtitan Llama 3.1 8B on 8 H100",
        replace(LLAMA3_8B, global_batch=16),
        TORCHTITAN_H100,
        8,
        Choice(8, 1, 1, 3, 1),
        f"{_TT}, Table 1: FSDP over 8 GPUs, local batch 2 (global 16), selective activation "
        "checkpointing",
        {**_FLASH, **_TORCHTITAN},
    ),
    PublishedRun(
        "torchtitan Llama 3.1 70B on 256 H100",
        replace(LLAMA3_70B, global_batch=512),
        TORCHTITAN_H100,
        256,
        Choice(32, 1, 8, 3, 1),
        f"{_TT}, Table 4: FSDP 32, TP 8, local batch 16 (global 512), full activation "
        "checkpointing, async TP, Float8",
        {**_FLASH, **_TORCHTITAN, "tp_overlap": True},
        differs=(
            "the benchmark shows 2D parallelism (FSDP + TP) with Float8, which the planner does not "
            "model (Float8 halves the matrix products' time and the gathered bytes; its async TP "
            "is modelled); without Float8 it finds a short pipeline a few percent faster"
        ),
    ),
    PublishedRun(
        "torchtitan Llama 3.1 405B on 512 H100",
        replace(LLAMA3_405B, global_batch=256),
        TORCHTITAN_H100,
        512,
        Choice(8, 8, 8, 3, 32, reshard=False),
        f"{_TT}, Table 5: FSDP 8, TP 8, PP 8, local batch 32 (global 256), full activation "
        "checkpointing, async TP, Float8, 1F1B or interleaved 1F1B",
        {**_FLASH, **_TORCHTITAN, "tp_overlap": True},
        differs=(
            "Table 5 demonstrates 3D parallelism (its title) with Float8, not the fastest layout; the "
            "planner finds FSDP with TP 4 and no pipeline among the equals (full recomputation, one "
            "sequence per GPU), ordered first by the fast-network rule (no pipeline)"
        ),
    ),
    PublishedRun(
        "torchtitan Llama 3.1 8B, 65K tokens, on 8 H100",
        replace(LLAMA3_8B, seq_len=65536, global_batch=4, name="Llama-3-style 8B (65K)"),
        TORCHTITAN_H100,
        8,
        Choice(4, 1, 1, 3, 1, cp=2),
        f"{_TT}, Table 2: FSDP 4, CP 2, sequence 65,536, local batch 1, full activation "
        "checkpointing",
        {**_FLASH, **_TORCHTITAN},
        differs=(
            "Table 2 sweeps CP with the sequence length (CP 1 at 32K, 2 at 65K, 4 at 131K, 8 at 262K) "
            "to show that CP scales, each row at FSDP = 8/CP; it does not pick a layout per length"
        ),
    ),
    PublishedRun(
        "Megatron-Core Mixtral 8x7B on 64 H100",
        MIXTRAL_8X7B,
        H100_80GB,
        64,
        Choice(16, 4, 1, 1, 16, 8, ep=8),
        f"{_MOE}: 64 GPUs, TP 1, EP 8, PP 4, VP 8, micro-batch 1, global batch 256, sequence "
        "4,096; examples/mixtral/README.md: 'the recommended model parallel config is TP1EP8PP4'",
        {**_FLASH, **_MEGATRON},
        differs=(
            "the published TP 1 × EP 8 × PP 4 lies within the tie band; the fast-network rule orders "
            "fewer stages first and puts TP 2 × EP 4 × PP 2 ahead, where Megatron's measurement (moe/"
            "README.md: 'For Mixtral 8x7B, EP8×TP1 outperforms EP4×TP2') decides what the model cannot"
        ),
    ),
    PublishedRun(
        "Megatron-Core Mixtral 8x22B on 128 H100",
        MIXTRAL_8X22B,
        H100_80GB,
        128,
        Choice(4, 8, 4, 1, 64, 7, ep=2),
        f"{_MOE}: 128 GPUs, TP 4, EP 2, PP 8, VP 7, micro-batch 1, global batch 256",
        {**_FLASH, **_MEGATRON},
        differs=(
            "the published TP 4 × EP 2 × PP 8 (VP 7) lies within the tie band; the fast-network rule "
            "orders fewer stages first (PP 2 with EP 8); the reference mapping was found by measuring"
        ),
    ),
    PublishedRun(
        "DeepSeek-V3 on 2,048 H800",
        DEEPSEEK_V3,
        H800_80GB,
        2048,
        Choice(128, 16, 1, 1, 120, ep=64),
        "DeepSeek-V3 technical report (arXiv:2412.19437), §3.2: 16-way pipeline (DualPipe), "
        "64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism; "
        "batch 15,360 sequences of 4,096 (§4.2)",
        {**_FLASH, **_MEGATRON, "ep_overlap": True},
        differs=(
            "DeepSeek co-designed the layout with what the planner does not model: DualPipe (a bubble "
            "of (PP/2 - 1) chunks and the all-to-alls hidden behind another micro-batch's compute), FP8 "
            "matrix products, 20 of 132 SMs kept for communication, node-limited routing (each token to "
            "at most 4 nodes), and no TP so that all of it overlaps; with TP's all-reduces on H800's "
            "160 GB/s NVLink and a 1F1B bubble the planner ranks the published layout far down"
        ),
    ),
    PublishedRun(
        "BLOOM 176B on 384 A100 (Omni-Path)",
        BLOOM_176B,
        JEAN_ZAY_A100,
        384,
        Choice(8, 12, 4, 1, 128),
        "bigscience-workshop/bigscience, train/tr11-176B-ml/README.md: 48 nodes of 8 A100 80GB, "
        "'TP=4 PP=12 DP=8 MBS=2', ZeRO-1 (Megatron-DeepSpeed), 4 Omni-Path links per node",
        {"attention": "materialized", "sequence_parallel": False, **_MEGATRON},
    ),
]


# Megatron-LM's README, weak scaling on H100 (images/model_table.png, Megatron-Core r0.8.0): GPT
# models, sequence 4,096, vocabulary 131,072, with --overlap-grad-reduce, --overlap-param-gather
# and --tp-comm-overlap; per-GPU TFLOP/s as published. (params B, heads, hidden, layers, t, p, dp,
# batch, TFLOP/s per GPU.)
MEGATRON_H100_TABLE: list[dict] = [
    dict(
        zip(
            ("params_b", "heads", "hidden", "layers", "t", "p", "dp", "batch", "tflops_per_gpu"),
            row,
        )
    )
    for row in [
        (1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8),
        (7.1, 32, 4096, 30, 2, 1, 48, 192, 465.9),
        (16, 48, 6144, 32, 4, 1, 48, 192, 489.1),
        (32, 56, 7168, 48, 8, 1, 48, 192, 459.6),
        (70, 64, 8192, 84, 8, 2, 48, 384, 419.7),
        (119, 80, 10240, 92, 8, 4, 48, 768, 420.5),
        (177, 96, 12288, 96, 8, 6, 48, 1152, 432.8),
        (314, 128, 16384, 96, 8, 8, 48, 1536, 474.4),
        (462, 144, 18432, 112, 8, 16, 48, 3072, 459.9),
    ]
]


def predicted_tflops(model: Transformer, cluster: Cluster, layout: Choice, **kw) -> float:
    """Model TFLOP/s per GPU the planner predicts for a published layout, at the best ``m``,
    interleaving and the least recomputation that fits (what the run's authors tuned)."""
    n = layout.n_gpus
    best = None
    for m in _divisors(model.global_batch // layout.dp):
        for v in (1, 2, 4, 8) if layout.pp > 1 else (1,):
            c = replace(layout, micro_batches=m, interleave=v)
            if v > 1 and (m % layout.pp or model.layers < layout.pp * v):
                continue
            for r in ("none", "selective", "full"):
                p = predict(model, cluster, c, n_gpus=n, recompute=r, **kw)
                if p.fits:
                    if best is None or p.time["total"] < best.time["total"]:
                        best = p
                    break
    if best is None:
        raise ValueError(f"{layout} does not fit {model.name} on {cluster.name}")
    return flops_per_step(model) / best.time["total"] / n / 1e12


def calibration() -> list[dict]:
    """Predicted against published TFLOP/s per GPU: Megatron-LM's H100 table and Llama 3 405B's
    three rows (H100), Narayanan et al.'s Table 1 (A100, counted with recomputation as the paper
    counts it)."""
    out = []
    for row in MEGATRON_H100_TABLE:
        model = Transformer(row["layers"], row["hidden"], row["heads"], 4096, 131072,
                            row["batch"], bias=False, dropout=False, position_embeddings=False,
                            name=f"GPT {row['params_b']}B")  # fmt: skip
        layout = Choice(row["dp"], row["p"], row["t"], 1)
        x = predicted_tflops(model, H100_80GB, layout, tp_overlap=True, states="megatron")
        out.append({"run": f"Megatron-LM H100 {row['params_b']}B", "gpu": "H100",
                    "predicted": x, "published": row["tflops_per_gpu"]})  # fmt: skip
    for run in PUBLISHED_RUNS:
        if run.tflops_per_gpu:
            x = predicted_tflops(run.model, run.cluster, run.layout, **run.settings_for_predict)
            out.append({"run": run.name, "gpu": "H100", "predicted": x,
                        "published": run.tflops_per_gpu})  # fmt: skip
    for row in NARAYANAN_TABLE1:
        p = paper_layout(row)
        x = flops_per_step(narayanan_model(row), "full") / p.time["total"] / row["gpus"] / 1e12
        out.append({"run": f"Narayanan Table 1 {row['params_b']}B", "gpu": "A100",
                    "predicted": x, "published": row["tflops_per_gpu"]})  # fmt: skip
    return out


def rank_of(run: PublishedRun, preds: list[Prediction]) -> int | None:
    """Where the run's layout (its dp, pp, tp, cp, ep and data-parallel family) stands in the
    planner's list, 1 = first; ``None`` if no such row fits."""
    want = run.layout
    for i, p in enumerate(preds, 1):
        c = p.choice
        if (
            (c.dp, c.pp, c.tp, c.cp, c.ep) == (want.dp, want.pp, want.tp, want.cp, want.ep)
            and (_family(c) == _family(want))
            and p.fits
        ):
            return i
    return None


def _family(c: Choice) -> str:
    return "ZeRO-0" if c.zero == 0 else ("ZeRO-1/2" if c.zero < 3 else "FSDP")


def agrees(run: PublishedRun, pick: Choice) -> bool:
    """The test's criterion: tp equal, pp within 2× (both 1 or both > 1), the same data-parallel
    family (none, ZeRO-1/2, FSDP), cp and ep equal."""
    w = run.layout
    pp_ok = (w.pp == 1) == (pick.pp == 1) and max(w.pp, pick.pp) <= 2 * min(w.pp, pick.pp)
    return (pick.tp == w.tp and pp_ok and _family(pick) == _family(w) and pick.cp == w.cp
            and pick.ep == w.ep)  # fmt: skip


def compare_public_runs() -> list[dict]:
    """For each of :data:`PUBLISHED_RUNS`, planned with what the run had: the planner's first
    pick, whether it agrees with the published layout (:func:`agrees`), the published layout's
    rank in the planner's list, and both predicted step times."""
    out = []
    for run in PUBLISHED_RUNS:
        preds = plan(run.model, run.cluster, run.gpus, **run.settings)
        rank = rank_of(run, preds)
        out.append({"run": run.name, "published": run.layout, "pick": preds[0],
                    "agrees": agrees(run, preds[0].choice), "rank": rank, "of": len(preds),
                    "equals": sum(p.tied for p in preds),
                    "published_s": preds[rank - 1].time["total"] if rank else None,
                    "differs": run.differs})  # fmt: skip
    return out


def _layout_words(c: Choice) -> str:
    extra = "".join(f" · {k} {getattr(c, k)}" for k in ("cp", "ep") if getattr(c, k) > 1)
    return f"dp {c.dp} · pp {c.pp} · tp {c.tp}{extra}, {c.family}"


def public_runs_table() -> str:
    """:func:`compare_public_runs` and :func:`calibration` as markdown tables."""
    lines = ["| run | published layout | planner's first pick | agrees | published layout's "
             "rank (of; equals) | predicted s: published / first |",
             "|---|---|---|:-:|---:|---:|"]  # fmt: skip
    for r in compare_public_runs():
        p = r["pick"]
        pick = (f"{_layout_words(p.choice)}, m {p.choice.micro_batches}, v {p.choice.interleave}, "
                f"recompute {p.detail['recompute']}")  # fmt: skip
        lines.append(f"| {r['run']} | {_layout_words(r['published'])} | {pick} | "
                     f"{'yes' if r['agrees'] else 'no'} | {r['rank']} ({r['of']}; {r['equals']}) | "
                     f"{r['published_s']:.3g} / {p.time['total']:.3g} |")  # fmt: skip
    lines += ["", "| published layout | GPU | predicted TFLOP/s per GPU | published | ratio |",
              "|---|---|---:|---:|---:|"]  # fmt: skip
    for r in calibration():
        lines.append(f"| {r['run']} | {r['gpu']} | {r['predicted']:.0f} | {r['published']:g} | "
                     f"{r['predicted'] / r['published']:.2f} |")  # fmt: skip
    return "\n".join(lines)


__all__ = [
    "BLOOM_176B",
    "DEEPSEEK_V3",
    "GPT3_175B",
    "LLAMA3_405B",
    "LLAMA3_70B",
    "LLAMA3_8B",
    "MIXTRAL_8X22B",
    "MEGATRON_H100_TABLE",
    "MIXTRAL_8X7B",
    "NARAYANAN_RUN",
    "NARAYANAN_TABLE1",
    "PUBLISHED_RUNS",
    "PublishedRun",
    "agrees",
    "calibration",
    "compare_public_runs",
    "public_runs_table",
    "predicted_tflops",
    "compare_narayanan",
    "measured_step_s",
    "narayanan_model",
    "paper_layout",
    "rank_of",
]
