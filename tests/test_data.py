"""course_utils.data: the real torchvision loaders on tiny files in the real on-disk formats,
and the synthetic stand-in (labelled, deterministic, learnable)."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest
import torch
from torch import nn

from course_utils.data import SyntheticImages, load_dataset

# make test-floor runs these on the oldest torch too: torchvision's dataset readers
pytestmark = [pytest.mark.floor]


def write_cifar10(root, n_per_batch=4):
    """CIFAR-10's python format: protocol-2 pickled dicts of uint8 rows (3072 = 3x32x32, channel-major)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    all_labels = {}
    for k, name in enumerate(names):
        data = rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8)
        data[:, 0] = k  # a marker: first red pixel of every image = batch index
        labels = [int(x) for x in rng.integers(0, 10, n_per_batch)]
        all_labels[name] = labels
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels, "batch_label": name}, f, protocol=2)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f, protocol=2)
    return all_labels


def write_cifar100(root, n=6):
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for name in ("train", "test"):
        with open(folder / name, "wb") as f:
            pickle.dump(
                {
                    "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                    "fine_labels": [int(x) for x in rng.integers(0, 100, n)],
                    "coarse_labels": [0] * n,
                },
                f,
                protocol=2,
            )
    with open(folder / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, f, protocol=2)


def write_idx(path, array: np.ndarray):
    """The idx format of (Fashion)MNIST: magic (0, 0, type=0x08 uint8, ndim), big-endian dims, data."""
    with open(path, "wb") as f:
        f.write(struct.pack(">BBBB", 0, 0, 0x08, array.ndim))
        f.write(struct.pack(f">{array.ndim}I", *array.shape))
        f.write(array.astype(np.uint8).tobytes())


def write_fashionmnist(root, n=5):
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (n, 28, 28))
    labels = np.arange(n) % 10
    for prefix in ("train", "t10k"):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return images, labels


def test_cifar10_through_torchvision(tmp_path):
    labels = write_cifar10(tmp_path)
    data = load_dataset("cifar10", root=tmp_path, verify=False, allow_synthetic=False)
    assert not data.synthetic and data.name == "CIFAR10" and len(data.dataset) == 20
    assert data.dataset.classes[3] == "class3"  # read from batches.meta
    x, y = data.dataset[5]  # second image of data_batch_2
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert y == labels["data_batch_2"][1]
    assert (x[0, 0, 0] * 0.2470 + 0.4914) * 255 == pytest.approx(
        1, abs=1e-3
    )  # the batch-index marker
    test = load_dataset("cifar10", train=False, root=tmp_path, verify=False, allow_synthetic=False)
    assert len(test.dataset) == 4 and test.dataset[0][1] == labels["test_batch"][0]
    assert len(load_dataset("cifar10", root=tmp_path, verify=False, limit=7).dataset) == 7


def test_cifar10_md5_check_rejects_tiny_files_when_verifying(tmp_path):
    write_cifar10(tmp_path)
    with pytest.raises(FileNotFoundError, match="data download"):
        load_dataset("cifar10", root=tmp_path, verify=True, allow_synthetic=False)


def test_cifar100_through_torchvision(tmp_path):
    write_cifar100(tmp_path)
    data = load_dataset("cifar100", root=tmp_path, verify=False, allow_synthetic=False)
    assert (
        data.num_classes == 100
        and len(data.dataset) == 6
        and data.dataset[0][0].shape == (3, 32, 32)
    )


def test_fashionmnist_idx_through_torchvision(tmp_path):
    images, labels = write_fashionmnist(tmp_path)
    data = load_dataset("fashionmnist", root=tmp_path, allow_synthetic=False)
    assert not data.synthetic and len(data.dataset) == 5
    x, y = data.dataset[3]
    assert x.shape == (1, 28, 28) and y == labels[3]
    mean, std = 0.2860, 0.3530  # undo the normalisation: pixels come back exactly
    restored = torch.round((x[0] * std + mean) * 255).to(torch.int64)
    assert torch.equal(restored, torch.from_numpy(images[3]).to(torch.int64))


def test_missing_data_falls_back_to_labelled_synthetic(tmp_path):
    data = load_dataset("cifar10", root=tmp_path / "empty", limit=64)
    assert data.synthetic and "SYNTHETIC" in repr(data) and "data download" in data.source
    assert len(data.dataset) == 64 and data.dataset[0][0].shape == (3, 32, 32)
    with pytest.raises(FileNotFoundError):
        load_dataset("cifar10", root=tmp_path / "empty", allow_synthetic=False)
    with pytest.raises(ValueError, match="choose one of"):
        load_dataset("imagenet")


def test_synthetic_is_deterministic_learnable_and_not_trivial():
    ds = SyntheticImages(512, 10, (3, 32, 32))
    x0, y0 = ds[7]
    x1, y1 = SyntheticImages(512, 10, (3, 32, 32))[7]
    assert torch.equal(x0, x1) and y0 == y1
    # a quarter of the labels redrawn at random (a tenth of those land on the true class again)
    flipped = (ds.labels != ds.classes).float().mean().item()
    assert abs(flipped - 0.25 * 0.9) < 0.05 and ds.ceiling == pytest.approx(0.775)
    # the best a model can score on these very samples: the labels it could name, all or a subset
    right = [ds[i][1] == int(ds.classes[i]) for i in range(len(ds))]
    assert ds.best_accuracy() == pytest.approx(sum(right) / len(right))
    assert ds.best_accuracy(range(3, 40)) == pytest.approx(sum(right[3:40]) / 37)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(128, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True)
    losses = []
    for _ in range(3):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[0] > 2.0 and np.mean(losses[-4:]) < 0.85 * losses[0], losses  # it learns
    test = SyntheticImages(512, 10, (3, 32, 32), split=1)
    with torch.no_grad():
        x = torch.stack([test[i][0] for i in range(512)])
        acc = (model(x).argmax(1) == test.labels).float().mean().item()
    assert 0.2 < acc <= test.ceiling + 0.05, acc  # better than chance, never near 100%


def test_synthetic_train_and_test_share_classes_but_not_samples():
    train = load_dataset("cifar10", root="/nonexistent", limit=8)
    test = load_dataset("cifar10", train=False, root="/nonexistent", limit=8)
    assert torch.equal(train.dataset.prototypes, test.dataset.prototypes)
    assert not torch.equal(train.dataset[0][0], test.dataset[0][0])


# ---- Size presets: every field validated ------------------------------------------------------

from dataclasses import fields as _fields  # noqa: E402

from course_utils.sizes import PRESETS, Size  # noqa: E402

COUNT_FIELDS = [f.name for f in _fields(Size) if f.name not in ("name", "compile")]


@pytest.mark.parametrize("field", COUNT_FIELDS)
@pytest.mark.parametrize("bad", ["just below", "negative", 2.5, True])
def test_size_rejects_bad_counts(field, bad):
    ci = PRESETS["ci"].asdict()
    low = {"warmup_steps": 0, "num_workers": 0, "max_message_bytes": 1024}.get(field, 1)
    value = {"just below": low - 1, "negative": -5}.get(bad, bad)
    with pytest.raises(ValueError) as info:
        Size(**{**ci, field: value})
    assert field in str(info.value) and repr(value) in str(info.value)


def test_size_rejects_cross_field_mistakes():
    ci = PRESETS["ci"].asdict()
    with pytest.raises(ValueError, match="exceeds train_samples"):
        Size(**{**ci, "batch_size": ci["train_samples"] * 2})
    with pytest.raises(ValueError, match="split evenly over world_size=3"):
        Size(**{**ci, "world_size": 3})
    with pytest.raises(ValueError, match="compile must be True or False"):
        Size(**{**ci, "compile": "yes"})
    with pytest.raises(ValueError, match="non-empty name"):
        Size(**{**ci, "name": ""})


def test_presets_are_valid():
    for name, preset in PRESETS.items():
        assert preset.name == name and Size(**preset.asdict()) == preset
