"""Turning what the user passed to ``launch`` into something a rank can run.

Three forms are accepted:

- a callable, e.g. a function defined in a notebook cell: sent by value with
  cloudpickle, together with the notebook classes and globals it uses;
- ``"package.module:function"``: imported by name in each rank;
- a path to a ``.py`` script: run as ``__main__`` in each rank with ``argv``; the
  script sets itself up with :func:`course_utils.dist.init`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle


def _pickle_torch_namespaces() -> None:
    """``torch.ops`` and ``torch.classes`` are module objects of their own types, which pickle
    (and cloudpickle) cannot send: a class of the notebook's that reads ``self.ops`` while using
    ``torch`` drags ``torch.ops`` along and failed with "cannot pickle '_Ops' object". They are
    sent by name and imported again in the rank."""
    import copyreg
    import importlib

    import torch

    for name in ("ops", "classes"):
        namespace = getattr(torch, name, None)
        if namespace is not None and type(namespace) is not type(torch):
            copyreg.pickle(type(namespace), lambda m: (importlib.import_module, (m.__name__,)))


_pickle_torch_namespaces()


def resolve_ref(ref: str) -> Callable:
    """Import ``"package.module:function"``."""
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _check_kwargs(fn: Callable, kwargs: dict, label: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some C callables: let the rank report it
    try:
        sig.bind(object(), **kwargs)
    except TypeError as e:
        raise TypeError(
            f"worker {label}{sig} cannot be called as {label}(ctx, "
            f"{', '.join(f'{k}=...' for k in kwargs)}): {e}. The worker's first argument is ctx; "
            "every other keyword passed to launch() goes to the worker."
        ) from None


def build_spec(worker: Any, kwargs: dict, argv: list[str] | None) -> tuple[dict, str]:
    """Return ``(spec, name)``; raise a clear error for anything a rank could not run."""
    if isinstance(worker, (str, Path)) and str(worker).endswith(".py"):
        path = Path(worker).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"script {worker} does not exist (looked at {path})")
        if kwargs:
            raise TypeError(
                f"a script takes command-line arguments, not keywords: pass argv=[...] instead of "
                f"{', '.join(kwargs)}"
            )
        return {
            "kind": "script",
            "path": str(path),
            "argv": [str(a) for a in (argv or [])],
        }, path.stem
    if argv:
        raise TypeError("argv is only for script workers (a path to a .py file)")
    if isinstance(worker, str):
        if ":" not in worker:
            raise ValueError(
                f"worker {worker!r} is neither a callable, a 'package.module:function' string "
                "nor a path to a .py script"
            )
        try:
            fn = resolve_ref(worker)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import worker {worker!r}: {e}") from e
        _check_kwargs(fn, kwargs, worker.partition(":")[2])
        return {"kind": "ref", "ref": worker}, worker.partition(":")[2]
    if not callable(worker):
        raise TypeError(
            f"worker must be a callable, 'module:function' or a script path, got {type(worker).__name__}"
        )
    name = getattr(worker, "__name__", type(worker).__name__)
    _check_kwargs(worker, kwargs, name)
    try:
        blob = cloudpickle.dumps(worker)
    except Exception as e:
        raise TypeError(
            f"worker {name} cannot be sent to the ranks ({type(e).__name__}: {e}). It, or a global it "
            "uses, holds something that cannot be pickled (an open file, a lock, a CUDA stream): "
            "create that inside the worker instead."
        ) from e
    return {"kind": "value", "fn": blob}, name
