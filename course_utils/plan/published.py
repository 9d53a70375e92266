"""The planner against published runs: Megatron-LM's Table 1 (Narayanan et al. 2021), and the
layouts well-known runs used (GPT-3 175B on 1,024 A100s; Llama-3-style 8B and 70B on H100 nodes,
as torchtitan's recipes run them). Each case says where its numbers come from."""

from __future__ import annotations

from dataclasses import dataclass

from .layouts import Prediction, _divisors, best_of, plan, predict
from .model import A100_80GB, H100_80GB, Choice, Cluster, Transformer, flops_per_step

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
NARAYANAN_RUN = {"recompute": "full", "attention": "materialized", "sequence_parallel": False}


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
    """A public training configuration: the model, the GPUs, and the layout the run used."""

    name: str
    model: Transformer
    cluster: Cluster
    gpus: int
    tp: int
    pp: int
    dp: int
    zero: str
    """What the run used for data parallelism: 'none', 'ZeRO-1', 'FSDP (ZeRO-3)'."""
    source: str


GPT3_175B = Transformer(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=50257,
                        global_batch=1536, tied_embeddings=True, name="GPT-3 175B")  # fmt: skip
LLAMA3_8B = Transformer(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                        gated=True, seq_len=8192, vocab=128256, global_batch=256,
                        position_embeddings=False, bias=False, dropout=False,
                        name="Llama-3-style 8B")  # fmt: skip
LLAMA3_70B = Transformer(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672,
                         gated=True, seq_len=8192, vocab=128256, global_batch=512,
                         position_embeddings=False, bias=False, dropout=False,
                         name="Llama-3-style 70B")  # fmt: skip

PUBLISHED_RUNS = [
    PublishedRun(
        "GPT-3 175B on 1,024 A100",
        GPT3_175B,
        A100_80GB,
        1024,
        tp=8,
        pp=8,
        dp=16,
        zero="none (Megatron's distributed optimizer, ZeRO-1, in later versions)",
        source="Narayanan et al. 2021 (arXiv:2104.04473), §5.1: GPT-3 175B on 1,024 A100s at batch "
        "1,536; the layout is the paper's rule (tensor parallelism of 8 inside each DGX, a pipeline "
        "across them) as its Table 1 applies it to the nearest model, 145.6 B (t = 8, p = 8)",
    ),
    PublishedRun(
        "Llama-3-style 8B on 8 H100",
        LLAMA3_8B,
        H100_80GB,
        8,
        tp=1,
        pp=1,
        dp=8,
        zero="FSDP (ZeRO-3)",
        source="torchtitan, torchtitan/models/llama3/train_configs/llama3_8b.toml: "
        "data_parallel_shard_degree = -1 (FSDP over every GPU), tensor and pipeline parallel "
        "degree 1, selective activation checkpointing, sequence 8,192",
    ),
    PublishedRun(
        "Llama-3-style 70B on 64 H100",
        LLAMA3_70B,
        H100_80GB,
        64,
        tp=8,
        pp=1,
        dp=8,
        zero="FSDP (ZeRO-3)",
        source="torchtitan, torchtitan/models/llama3/train_configs/llama3_70b.toml: "
        "tensor_parallel_degree = 8, data_parallel_shard_degree = -1 (FSDP over the rest), "
        "pipeline 1, full activation checkpointing, sequence 8,192",
    ),
]


__all__ = [
    "GPT3_175B",
    "LLAMA3_70B",
    "LLAMA3_8B",
    "NARAYANAN_RUN",
    "NARAYANAN_TABLE1",
    "PUBLISHED_RUNS",
    "PublishedRun",
    "compare_narayanan",
    "measured_step_s",
    "narayanan_model",
    "paper_layout",
]
