"""Datasets: CIFAR-10/100 and FashionMNIST through torchvision, or a labelled stand-in.

Stage the data where compute nodes can read it (a login node has internet)::

    python -m course_utils data download --root /project/shared/data
    export COURSE_DATA_DIR=/project/shared/data

:func:`load_dataset` reads from ``COURSE_DATA_DIR`` with torchvision's own
classes. When the files are absent it returns a clearly labelled synthetic
dataset with learnable structure (a small CNN's loss falls on it), so every
notebook still runs on an offline laptop or in CI.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torch.utils.data import Dataset, Subset
from torchvision import transforms as T

DATA_ENV = "COURSE_DATA_DIR"


@dataclass(frozen=True)
class DatasetSpec:
    cls: type
    num_classes: int
    shape: tuple[int, int, int]  # (C, H, W)
    mean: tuple[float, ...]
    std: tuple[float, ...]


DATASETS: dict[str, DatasetSpec] = {
    "cifar10": DatasetSpec(
        torchvision.datasets.CIFAR10,
        10,
        (3, 32, 32),
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
    ),
    "cifar100": DatasetSpec(
        torchvision.datasets.CIFAR100,
        100,
        (3, 32, 32),
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
    ),
    "fashionmnist": DatasetSpec(
        torchvision.datasets.FashionMNIST, 10, (1, 28, 28), (0.2860,), (0.3530,)
    ),
}


def data_root(root: str | Path | None = None) -> Path:
    """``root``, else ``$COURSE_DATA_DIR``, else ``~/.cache/course_utils/data``."""
    if root is not None:
        return Path(root).expanduser()
    return Path(
        os.environ.get(DATA_ENV) or Path.home() / ".cache" / "course_utils" / "data"
    ).expanduser()


class SyntheticImages(Dataset):
    """A SYNTHETIC stand-in for an image dataset: learnable, but not trivially.

    Each class is a smooth random pattern (its prototype). A sample is its class's prototype,
    shifted by up to ``shift`` pixels, scaled by a random contrast, plus Gaussian noise; and a
    ``label_noise`` share of the labels is redrawn at random (from every class, the true one
    included), so no model can exceed ``1 - label_noise + label_noise / classes`` accuracy (77.5%
    with the defaults, on 10 classes): the stand-in learns like a real dataset, not to 100% in one
    epoch, and its accuracy says nothing about any real dataset.

    Deterministic per index (the same sample in every process and DataLoader worker), so
    data-parallel ranks agree on it.
    """

    synthetic = True

    def __init__(
        self,
        n: int,
        num_classes: int,
        shape: tuple[int, int, int],
        seed: int = 0,
        split: int = 0,
        noise: float = 1.5,
        label_noise: float = 0.25,
        shift: int = 4,
    ):
        self.n, self.num_classes, self.shape, self.noise = n, num_classes, shape, noise
        self.shift = shift
        c, h, w = shape
        # The classes (prototypes) depend on `seed` only: train and test splits share them.
        coarse = torch.randn(num_classes, c, 4, 4, generator=torch.Generator().manual_seed(seed))
        self.prototypes = torch.nn.functional.interpolate(
            coarse, size=(h, w), mode="bilinear", align_corners=False
        )
        self.sample_seed = (seed * 1_000_003 + split + 1) * 1_000_003
        g = torch.Generator().manual_seed(self.sample_seed)
        self.classes = torch.randint(num_classes, (n,), generator=g)  # what each image shows
        redrawn = torch.rand(n, generator=g) < label_noise
        self.labels = torch.where(
            redrawn, torch.randint(num_classes, (n,), generator=g), self.classes
        )
        self.ceiling = 1 - label_noise + label_noise / num_classes

    def best_accuracy(self, indices=None) -> float:
        """The share of these samples (all, or ``indices``) whose label is the class they show:
        the accuracy of a model that always names the class each image shows; :attr:`ceiling` is its
        expectation."""
        keep = slice(None) if indices is None else torch.as_tensor(list(indices), dtype=torch.long)
        return float((self.labels[keep] == self.classes[keep]).double().mean())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.sample_seed + int(i) + 1)
        dy, dx = (int(v) for v in torch.randint(-self.shift, self.shift + 1, (2,), generator=g))
        contrast = 0.5 + torch.rand((), generator=g)
        image = torch.roll(self.prototypes[int(self.classes[i])], (dy, dx), dims=(1, 2))
        x = contrast * image + self.noise * torch.randn(self.shape, generator=g)  # (C, H, W)
        return x, int(self.labels[i])

    def __repr__(self) -> str:
        return (
            f"SyntheticImages(SYNTHETIC, n={self.n}, classes={self.num_classes}, "
            f"shape={self.shape}, best possible accuracy {self.ceiling:.0%})"
        )


@dataclass
class LoadedData:
    """A dataset plus what a notebook should say about it."""

    dataset: Dataset
    name: str
    synthetic: bool
    source: str
    """Where the files came from, or why the synthetic stand-in is used."""
    num_classes: int
    shape: tuple[int, int, int]

    def __repr__(self) -> str:
        kind = "SYNTHETIC stand-in" if self.synthetic else "real"
        return f"{self.name} ({kind}, {len(self.dataset)} images, {self.num_classes} classes): {self.source}"


def _md5(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _torchvision_dataset(
    spec: DatasetSpec, root: Path, train: bool, transform, download: bool, verify: bool
):
    cls = spec.cls
    if not verify and hasattr(cls, "train_list"):
        # CIFAR compares every file's md5 with the official release. verify=False accepts staged
        # files as they are (a re-packed mirror, the tests' tiny files): torchvision's own loading
        # and checking code runs unchanged, told that the files present are the reference.
        folder = root / cls.base_folder

        def staged(entries):
            return [[name, _md5(folder / name) or md5] for name, md5 in entries]

        meta_md5 = _md5(folder / cls.meta["filename"]) or cls.meta["md5"]
        cls = type(
            f"Staged{cls.__name__}",
            (cls,),
            {
                "train_list": staged(cls.train_list),
                "test_list": staged(cls.test_list),
                "meta": {**cls.meta, "md5": meta_md5},
            },
        )
    return cls(str(root), train=train, transform=transform, download=download)


def load_dataset(
    name: str = "cifar10",
    train: bool = True,
    limit: int | None = None,
    root: str | Path | None = None,
    download: bool = False,
    allow_synthetic: bool = True,
    augment: bool = False,
    verify: bool = True,
) -> LoadedData:
    """torchvision's ``name`` dataset from the data dir (first ``limit`` images), or the stand-in.

    ``download=True`` fetches missing files (login nodes only: compute nodes are
    often offline). ``allow_synthetic=False`` turns absent files into an error.
    """
    key = name.lower().replace("-", "")
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: choose one of {sorted(DATASETS)}")
    spec = DATASETS[key]
    root = data_root(root)
    steps = [T.ToTensor(), T.Normalize(spec.mean, spec.std)]
    if augment and train and key.startswith("cifar"):
        steps = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), *steps]
    try:
        ds = _torchvision_dataset(spec, root, train, T.Compose(steps), download, verify)
        synthetic, source = False, f"torchvision {spec.cls.__name__} from {root}"
    except (RuntimeError, OSError) as e:
        if not allow_synthetic:
            raise FileNotFoundError(
                f"{spec.cls.__name__} is not under {root} ({e}). Stage it with "
                f"`python -m course_utils data download --root DIR` and set {DATA_ENV}=DIR."
            ) from e
        n = limit or (50000 if train else 10000)
        ds = SyntheticImages(n, spec.num_classes, spec.shape, seed=0, split=0 if train else 1)
        synthetic = True
        source = (
            f"no {spec.cls.__name__} files under {root}; stage them with "
            f"`python -m course_utils data download` (set {DATA_ENV})"
        )
    if limit is not None and limit < len(ds):
        ds = Subset(ds, range(limit))
    return LoadedData(ds, spec.cls.__name__, synthetic, source, spec.num_classes, spec.shape)


def download(root: str | Path | None = None, names: list[str] | None = None) -> dict[str, str]:
    """Fetch train and test splits of ``names`` into ``root``; return name -> "ok" or the error."""
    root = data_root(root)
    root.mkdir(parents=True, exist_ok=True)
    status = {}
    for name in names or list(DATASETS):
        spec = DATASETS[name]
        try:
            for train in (True, False):
                spec.cls(str(root), train=train, download=True)
            status[name] = "ok"
        except Exception as e:  # network errors come in many types; report each
            status[name] = f"failed: {type(e).__name__}: {e}"
    return status
