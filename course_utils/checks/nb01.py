"""Checks for notebook 01 (one GPU): the memory a model's training state takes."""

from __future__ import annotations

import torch
from torch import nn

from ..measure import saved_activations
from ..models import FrozenMLP, ToyMLP
from .common import RefuseTorch, fail, passed


class _TiedLM(nn.Module):
    """An embedding and an output head that share one weight (as in GPT-2)."""

    def __init__(self, vocab: int = 50, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # one Parameter, two modules

    def forward(self, tokens):  # (B,) -> (B, vocab)
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _reference(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())  # each Parameter once, tied or not
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "parameters": _bytes(params),
        "gradients": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _bytes(state),
    }


def _cases():
    """(label, model, optimizer) after one training step, so that optimizer state exists."""
    torch.manual_seed(0)
    cases = []
    for label, model, make_opt in (
        ("an MLP with Adam", ToyMLP(), lambda p: torch.optim.Adam(p, lr=1e-3)),
        ("an MLP with SGD and momentum", ToyMLP(), lambda p: torch.optim.SGD(p, 0.1, momentum=0.9)),
        ("an MLP with plain SGD", ToyMLP(), lambda p: torch.optim.SGD(p, 0.1)),
        ("a model with a frozen layer, Adam", FrozenMLP(), lambda p: torch.optim.Adam(p)),
        ("a model with tied weights, AdamW", _TiedLM(), lambda p: torch.optim.AdamW(p)),
        ("an MLP in float64 with Adam", ToyMLP().double(), lambda p: torch.optim.Adam(p)),
        ("an MLP in bfloat16 with Adam", ToyMLP().bfloat16(), lambda p: torch.optim.Adam(p)),
    ):
        opt = make_opt(model.parameters())
        dtype = next(model.parameters()).dtype
        if isinstance(model, _TiedLM):
            loss = model(torch.randint(50, (8,))).square().mean()
        else:
            loss = model(torch.randn(8, 16, dtype=dtype)).square().mean()
        loss.backward()
        opt.step()
        cases.append((label, model, opt))
    return cases


HINTS = {
    "parameters": {
        "a model with tied weights, AdamW": "a Parameter used by two modules is stored once; "
        "model.parameters() lists it once",
    },
    "gradients": {
        "a model with a frozen layer, Adam": "frozen parameters (requires_grad=False) have no "
        ".grad: count only the gradients that exist",
    },
    "optimizer": {
        "an MLP with plain SGD": "plain SGD keeps no state: optimizer.state is empty",
        "a model with a frozen layer, Adam": "the optimizer keeps state only for parameters that "
        "had a gradient at a step",
        "an MLP with SGD and momentum": "SGD with momentum keeps one buffer per parameter",
    },
}


def check_state_bytes(state_bytes) -> None:
    """Exercise 01.1: ``state_bytes(model, optimizer) -> {"parameters", "gradients", "optimizer"}``."""
    cases = _cases()
    for label, model, opt in cases:
        got = state_bytes(model, opt)
        if not isinstance(got, dict) or set(got) != {"parameters", "gradients", "optimizer"}:
            fail("01.1", "return a dict with the keys 'parameters', 'gradients' and 'optimizer'")
        expected = _reference(model, opt)
        for key in ("parameters", "gradients", "optimizer"):
            if got[key] != expected[key]:
                hint = HINTS[key].get(label)
                if hint is None and ("float64" in label or "bfloat16" in label):
                    hint = "bytes per element depend on the dtype: tensor.element_size()"
                if hint is None:
                    hint = (
                        "count numel() x element_size() of every tensor, each once"
                        if key != "optimizer"
                        else "count every tensor in optimizer.state, the step counters included"
                    )
                side = "high" if got[key] > expected[key] else "low"
                fail("01.1", f"for {label}, your {key} count is too {side}: {hint}.")
    passed("01.1", f"parameters, gradients and optimizer state right for {len(cases)} models")


def _mlp(widths, dtype) -> nn.Sequential:
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(dtype)


MEASURING = (
    "your function ran a forward pass that autograd recorded, which is measuring (the check does "
    "that). Count from batch, widths and dtype alone: which tensors does each layer keep for "
    "backward, and how many bytes is each?"
)


def check_mlp_activation_bytes(mlp_activation_bytes) -> None:
    """Exercise 01.2: bytes autograd keeps for backward in an MLP's forward pass."""
    cases = [
        (8, [16, 32, 4], torch.float32),
        (1, [5, 7], torch.float32),
        (64, [3072, 512, 512, 10], torch.float32),
        (32, [10, 20, 30, 40, 5], torch.float64),
        (4, [8, 16, 8], torch.bfloat16),
    ]
    torch.manual_seed(0)
    for batch, widths, dtype in cases:
        model = _mlp(widths, dtype)
        with saved_activations() as mem:
            model(torch.randn(batch, widths[0], dtype=dtype))
        with RefuseTorch("01.2", MEASURING, autograd=True):  # by reasoning, not by measuring
            got = mlp_activation_bytes(batch, widths, dtype)
        if got == mem["bytes"]:
            continue
        e = torch.tensor([], dtype=dtype).element_size()
        where = f"batch {batch}, widths {widths}, {str(dtype).replace('torch.', '')}"
        if got == mem["bytes"] - batch * widths[0] * e:
            hint = "the first Linear keeps its input as well: its weight's gradient needs it"
        elif got == mem["bytes"] + batch * widths[-1] * e:
            hint = "the last layer's output is not kept: nothing after it needs it in backward"
        elif got == mem["bytes"] + sum(batch * w * e for w in widths[1:-1]):
            hint = (
                "ReLU keeps its output and the next Linear keeps that same tensor as its input: "
                "one tensor, counted once"
            )
        else:
            hint = "which tensors does each layer need again in backward, and how many bytes each?"
        fail(
            "01.2",
            f"for {where} your count is too {'high' if got > mem['bytes'] else 'low'}: {hint}.",
        )
    passed(
        "01.2", f"activation bytes right for {len(cases)} MLPs (measured with saved-tensor hooks)"
    )
