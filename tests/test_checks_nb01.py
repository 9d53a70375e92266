"""Notebook 01's exercise checks (01.1 state bytes, 01.2 activation bytes, 01.3 gradient
accumulation): a right answer passes; typical wrong ones get the hint, never the answer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from course_utils import checks
from course_utils.checks.nb01 import _cases, _reference
from course_utils.measure import saved_activations
from course_utils.zero.memory import count_model_states as package_count
from tests.checks_support import fails

# make test-floor runs these on the oldest torch too: the checks' dispatch-mode and profile-hook watchers of c10d ops
pytestmark = [pytest.mark.floor]


# ---- 01.1 state bytes -------------------------------------------------------------------------


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def state_bytes(model, optimizer):
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"parameters": _nbytes(params), "gradients": _nbytes(grads), "optimizer": _nbytes(state)}


def _expected_01_1(label: str, key: str) -> int:
    (found,) = [_reference(m, o)[key] for lab, m, o in _cases() if lab == label]
    return found


def test_01_1_state_bytes(capsys):
    checks.check_state_bytes(state_bytes)
    assert "✓ exercise 01.1" in capsys.readouterr().out


def test_01_1_frozen_parameters_have_no_gradient():
    def grads_of_every_parameter(model, optimizer):
        out = state_bytes(model, optimizer)
        out["gradients"] = _nbytes(model.parameters())
        return out

    want = _expected_01_1("a model with a frozen layer, Adam", "gradients")
    fails(checks.check_state_bytes, grads_of_every_parameter, "frozen parameters", [want])


def test_01_1_step_counters_are_state():
    def without_step(model, optimizer):
        out = state_bytes(model, optimizer)
        state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
        out["optimizer"] = _nbytes(state)
        return out

    want = _expected_01_1("an MLP with Adam", "optimizer")
    fails(checks.check_state_bytes, without_step, "the step counters included", [want])


# ---- 01.2 activation bytes --------------------------------------------------------------------


def mlp_activation_bytes(batch, widths, dtype=torch.float32, activation="relu"):
    size_of = torch.tensor([], dtype=dtype).element_size()
    per_hidden = (
        1 if activation == "relu" else 2
    )  # GELU keeps its input; the next Linear, its output
    kept = [widths[0]] + [w for w in widths[1:-1] for _ in range(per_hidden)]
    return sum(batch * w * size_of for w in kept)


FIRST_CASE_BYTES = 8 * (16 + 32) * 4  # batch 8, widths [16, 32, 4], float32


def test_01_2_activation_bytes(capsys):
    checks.check_mlp_activation_bytes(mlp_activation_bytes)
    assert "✓ exercise 01.2" in capsys.readouterr().out


def test_01_2_typical_mistakes():
    def without_input(batch, widths, dtype=torch.float32, activation="relu"):
        size_of = torch.tensor([], dtype=dtype).element_size()
        return mlp_activation_bytes(batch, widths, dtype, activation) - batch * widths[0] * size_of

    def relu_twice(batch, widths, dtype=torch.float32, activation="relu"):
        return mlp_activation_bytes(batch, widths, dtype, "gelu")  # one tensor counted twice

    def gelu_like_relu(batch, widths, dtype=torch.float32, activation="relu"):
        return mlp_activation_bytes(batch, widths, dtype, "relu")

    absent = [FIRST_CASE_BYTES]
    fails(checks.check_mlp_activation_bytes, without_input, "the first Linear needs", absent)
    fails(checks.check_mlp_activation_bytes, relu_twice, "count it once", absent)
    fails(checks.check_mlp_activation_bytes, gelu_like_relu, "GELU's derivative", absent)


def test_01_2_measuring_is_refused():
    def measured(batch, widths, dtype=torch.float32, activation="relu"):  # saved_activations
        layers = []
        for i in range(len(widths) - 1):
            layers += [nn.Linear(widths[i], widths[i + 1]), nn.ReLU()]
        model = nn.Sequential(*layers[:-1]).to(dtype)
        with saved_activations() as mem:
            model(torch.randn(batch, widths[0], dtype=dtype))
        return mem["bytes"]

    assert measured(8, [16, 32, 4]) == FIRST_CASE_BYTES  # it would pass without the guard
    fails(checks.check_mlp_activation_bytes, measured, "autograd recorded", [FIRST_CASE_BYTES])
    # the guard is gone afterwards: autograd records again
    assert nn.Linear(2, 2)(torch.randn(1, 2)).grad_fn is not None


# ---- 01.3 gradient accumulation ---------------------------------------------------------------


def accumulated_step(model, optimizer, x, y, k):
    optimizer.zero_grad(set_to_none=True)
    for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
        (nn.functional.cross_entropy(model(xm), ym) * len(xm) / len(x)).backward()
    optimizer.step()


def test_01_3_accumulated_step(capsys):
    checks.check_accumulated_step(accumulated_step)
    assert "✓ exercise 01.3" in capsys.readouterr().out


def test_01_3_typical_mistakes():
    def divided_by_k(model, optimizer, x, y, k):
        optimizer.zero_grad()
        for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
            (nn.functional.cross_entropy(model(xm), ym) / k).backward()
        optimizer.step()

    def stale_gradients(model, optimizer, x, y, k):
        for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
            (nn.functional.cross_entropy(model(xm), ym) * len(xm) / len(x)).backward()
        optimizer.step()

    def step_per_micro_batch(model, optimizer, x, y, k):
        for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xm), ym).backward()
            optimizer.step()

    def whole_batch(model, optimizer, x, y, k):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    fails(checks.check_accumulated_step, divided_by_k, "weigh each micro-batch's mean loss")
    fails(checks.check_accumulated_step, stale_gradients, "clear last step's gradients")
    fails(checks.check_accumulated_step, step_per_micro_batch, "step once")
    fails(checks.check_accumulated_step, whole_batch, "micro-batches of at most")


def state_via_package(model, optimizer):  # as a notebook cell writes it: the import is global
    s = package_count(model, optimizer)
    return {k: s.bytes(k) for k in ("parameters", "gradients", "optimizer")}


def test_01_1_the_package_count_is_refused():
    fails(
        checks.check_state_bytes, state_via_package, "count_model_states is this exercise's answer"
    )
    fails(checks.check_state_bytes, package_count, "count_model_states")
    from course_utils.checks.nb01 import _reference

    fails(checks.check_state_bytes, _reference, "count_model_states")  # the check's own, too
