"""Checks for notebook 01 (one GPU): the memory a model's training state takes, and gradient
accumulation."""

from __future__ import annotations

import torch
from torch import nn

from ..measure import max_abs_diff, saved_activations
from ..models import FrozenMLP, ToyMLP
from ..zero.memory import count_model_states
from .common import RefuseTorch, fail, passed, refuse_calls


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
    message = (
        "count the tensors yourself: course_utils.zero's count_model_states is this exercise's "
        "answer"
    )
    for label, model, opt in cases:
        with refuse_calls("01.1", [count_model_states, _reference], message):
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


def _mlp(widths, dtype, activation="relu") -> nn.Sequential:
    act = {"relu": nn.ReLU, "gelu": nn.GELU}[activation]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(act())
    return nn.Sequential(*layers).to(dtype)


MEASURING = (
    "your function ran a forward pass that autograd recorded, which is measuring (the check does "
    "that). Count from the arguments alone: which tensors does each layer keep for "
    "backward, and how many bytes is each?"
)


def check_mlp_activation_bytes(mlp_activation_bytes) -> None:
    """Exercise 01.2: ``mlp_activation_bytes(batch, widths, dtype, activation)``: bytes autograd
    keeps for backward in an MLP's forward pass, with ReLU or GELU between the Linear layers."""
    cases = [
        (8, [16, 32, 4], torch.float32, "relu"),
        (1, [5, 7], torch.float32, "relu"),
        (64, [3072, 512, 512, 10], torch.float32, "relu"),
        (32, [10, 20, 30, 40, 5], torch.float64, "relu"),
        (4, [8, 16, 8], torch.bfloat16, "relu"),
        (8, [16, 32, 4], torch.float32, "gelu"),
        (16, [12, 24, 36, 6], torch.float64, "gelu"),
    ]
    torch.manual_seed(0)
    for batch, widths, dtype, activation in cases:
        model = _mlp(widths, dtype, activation)
        with saved_activations() as mem:
            model(torch.randn(batch, widths[0], dtype=dtype))
        with RefuseTorch("01.2", MEASURING, autograd=True):  # by reasoning, not by measuring
            got = mlp_activation_bytes(batch, widths, dtype, activation)
        if got == mem["bytes"]:
            continue
        e = torch.tensor([], dtype=dtype).element_size()
        hidden = sum(batch * w * e for w in widths[1:-1])
        where = (
            f"batch {batch}, widths {widths}, {str(dtype).replace('torch.', '')}, "
            f"{activation.upper()}"
        )
        if got == mem["bytes"] - batch * widths[0] * e:
            hint = "the first Linear needs something again in backward too: what?"
        elif got == mem["bytes"] + batch * widths[-1] * e:
            hint = "is the last layer's output needed by anything in backward?"
        elif activation == "relu" and got == mem["bytes"] + hidden:
            hint = "a tensor kept by two layers is stored once: count it once"
        elif activation == "gelu" and got == mem["bytes"] - hidden:
            hint = (
                "GELU's derivative is not a function of its output, as ReLU's is: what does "
                "GELU need in backward, and is that the tensor the next Linear keeps?"
            )
        else:
            hint = "which tensors does each layer need again in backward, and how many bytes each?"
        fail(
            "01.2",
            f"for {where} your count is too {'high' if got > mem['bytes'] else 'low'}: {hint}.",
        )
    # a size no machine can run (4 TiB of input alone), so measuring it, in any thread, fails:
    # the formula the cases above were measured to agree with gives the answer
    batch, widths, dtype, activation = 2**22, [2**18, 2**18, 2**18, 10], torch.float32, "gelu"
    e = torch.tensor([], dtype=dtype).element_size()
    want = batch * (widths[0] + 2 * sum(widths[1:-1])) * e
    try:
        with RefuseTorch("01.2", MEASURING, autograd=True):
            got = mlp_activation_bytes(batch, widths, dtype, activation)
    except (RuntimeError, MemoryError) as err:
        fail("01.2", f"for batch {batch:,}, widths {widths}, your function failed ({str(err)[:80]}"
             "...): it tried to build the model or its input, terabytes here. Count from the "
             "arguments alone")  # fmt: skip
    if got != want:
        fail("01.2", f"for batch {batch:,}, widths {widths}, float32, GELU, your count is too "
             f"{'high' if got > want else 'low'}: count from the arguments alone; the same rules "
             "as for the small MLPs hold at any size (watch for integer overflow too)")  # fmt: skip
    passed(
        "01.2",
        f"activation bytes right for {len(cases)} MLPs with ReLU and GELU (measured with "
        "saved-tensor hooks) and for one too large to run",
    )


class _Counted(nn.Module):
    """A model that remembers the batch size of every forward call, and the order in which
    forward passes ran and their outputs' gradients came back (``events``: ("F" or "B", call))."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.seen, self.events = inner, [], []

    def forward(self, x):
        call = len(self.seen)
        self.seen.append(x.shape[0])
        self.events.append(("F", call))
        out = self.inner(x)
        if out.requires_grad:
            out.register_hook(lambda g: self.events.append(("B", call)))
        return out


def _alive_at_once(events, seen) -> tuple[int, int] | None:
    """(earlier, later) forward calls whose activations were alive together: ``later``'s forward
    ran before ``earlier``'s backward (or ``earlier`` had none); None if each micro-batch's
    backward came before the next forward."""
    calls = [c for c in range(len(seen)) if seen[c] > 0]
    order = {e: i for i, e in enumerate(events)}
    for a, b in zip(calls, calls[1:]):
        if order.get(("B", a), len(events)) > order[("F", b)]:
            return a, b
    return None


def _accumulation_cases():
    """(label, make model, make optimizer, global batch, k)."""
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731 - one step of Adam is not linear
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3)  # noqa: E731
    return [
        ("an MLP, 32 samples in 4 micro-batches, SGD", ToyMLP, sgd, 32, 4),
        ("an MLP, 30 samples in 4 micro-batches (8, 8, 7, 7), SGD", ToyMLP, sgd, 30, 4),
        ("an MLP, 10 samples in 3 micro-batches (4, 3, 3), Adam", ToyMLP, adam, 10, 3),
        (
            "an MLP with a frozen layer, 12 samples in 12 micro-batches, Adam",
            FrozenMLP,
            adam,
            12,
            12,
        ),
        ("an MLP, 16 samples in 1 micro-batch, Adam", ToyMLP, adam, 16, 1),
        (
            "an MLP, 3 samples and k = 5 (tensor_split leaves 2 micro-batches empty), SGD",
            ToyMLP,
            sgd,
            3,
            5,
        ),  # fmt: skip
    ]


def check_accumulated_step(accumulated_step) -> None:
    """Exercise 01.3: ``accumulated_step(model, optimizer, x, y, k)``: one optimizer step on the
    batch ``(x, y)`` computed in ``k`` micro-batches, equal to one step on the whole batch."""
    for label, make, make_opt, batch, k in _accumulation_cases():
        torch.manual_seed(1)
        ref_model = make().double()
        model = _Counted(make().double())
        model.inner.load_state_dict(ref_model.state_dict())
        opt_ref, opt = make_opt(ref_model.parameters()), make_opt(model.parameters())
        g = torch.Generator().manual_seed(batch * 10 + k)
        x = torch.randn(batch, 16, generator=g, dtype=torch.float64)
        y = torch.randint(4, (batch,), generator=g)
        for p in model.parameters():  # last step's gradients, left behind: they must not count
            p.grad = torch.ones_like(p) if p.requires_grad else None
        opt_ref.zero_grad()
        nn.functional.cross_entropy(ref_model(x), y).backward()
        opt_ref.step()
        accumulated_step(model, opt, x, y, k)
        biggest = -(-batch // k)
        if not model.seen or max(model.seen) > biggest:
            fail("01.3", f"for {label}, the model saw a batch of {max(model.seen, default=0)}: "
                 f"run it on micro-batches of at most {biggest} samples, one after another")  # fmt: skip
        seen = [s for s in model.seen if s > 0]
        if sum(seen) != batch or len(seen) != min(k, batch):
            fail("01.3", f"for {label}, the model saw {len(seen)} micro-batches of "
                 f"{sum(seen)} samples in all: run each of the k micro-batches once")  # fmt: skip
        together = _alive_at_once(model.events, model.seen)
        if together is not None:
            a, b = (seen_index + 1 for seen_index in together)
            fail("01.3", f"for {label}, micro-batch {b}'s forward ran before micro-batch {a}'s "
                 "backward, so their activations were alive at once (one backward at the end "
                 "keeps all k alive, as the whole batch does): call backward on each micro-batch's "
                 "loss before the next forward, and let the gradients add up in .grad")  # fmt: skip
        err = max_abs_diff(zip(model.inner.parameters(), ref_model.parameters()))
        if err < 1e-12:  # a NaN goes on to the failure below
            continue
        if "(8, 8, 7, 7)" in label or "(4, 3, 3)" in label:
            hint = (
                "with micro-batches of different sizes, dividing each loss by k weighs the small "
                "ones too much: weigh each micro-batch's mean loss by its share of the samples"
            )
        else:
            hint = (
                "the whole batch's loss is the mean over all its samples: scale each micro-batch's "
                "loss so the gradients add up to that (and clear last step's gradients first, "
                "then step once)"
            )
        fail("01.3", f"for {label}, the parameters after your step differ from one step on the "
             f"whole batch by {err:.2g}: {hint}.")  # fmt: skip
    passed("01.3", "equal to one full-batch step, to 1e-12, with even and uneven micro-batches, "
           "each micro-batch's backward before the next forward")  # fmt: skip
