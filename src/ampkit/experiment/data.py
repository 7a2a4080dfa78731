"""Data for `ampkit compare`, all local: nothing is downloaded.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1797 images, in the
  wheel), upsampled to 1x28x28, fixed 80/20 train/test split.
- ``mnist:DIR``: the four standard MNIST IDX files (gzipped or not) from a local directory.
- ``text``: byte-level language modelling on the Python standard library's own
  source files (real text on every machine), for ``--model gpt``.
- ``synthetic``: Gaussian 1x28x28 images labelled by a fixed random teacher.
"""

from __future__ import annotations

import dataclasses
import gzip
import zlib
import struct
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F

DATASETS = ("digits", "mnist:DIR", "text", "synthetic")
TEXT_BYTES = 2_000_000
IDX_FILES = {
    "train_images": ("train-images-idx3-ubyte", 2051),
    "train_labels": ("train-labels-idx1-ubyte", 2049),
    "test_images": ("t10k-images-idx3-ubyte", 2051),
    "test_labels": ("t10k-labels-idx1-ubyte", 2049),
}


@dataclasses.dataclass
class Dataset:
    """Tensors of one task. Images: x float (N, 1, 28, 28), y long (N,).
    Text: x and y are the train / test byte streams (long), sampled in windows."""

    name: str
    kind: str  # "image" or "text"
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    def model_kwargs(self, context: int) -> dict[str, int]:
        """Keyword arguments that fit a model factory to this data."""
        if self.kind == "text":
            return {"vocab_size": self.num_classes, "context": context}
        return {"num_classes": self.num_classes}


def check_spec(spec: str) -> str:
    """Return ``spec`` if it names a dataset (without loading it), else raise ValueError."""
    if spec in ("digits", "text", "synthetic") or spec.startswith("mnist:"):
        return spec
    raise ValueError(f"Unknown data {spec!r}. Choose one of {list(DATASETS)}.")


def load(spec: str) -> Dataset:
    """Load a dataset by its ``--data`` name.

    Raises:
        ValueError: an unknown name, or MNIST files that are missing, truncated or corrupt.
    """
    check_spec(spec)
    if spec == "digits":
        return _digits()
    if spec == "text":
        return _text()
    if spec == "synthetic":
        return _synthetic()
    return load_mnist(Path(spec[len("mnist:") :]))


def _standardize(train: torch.Tensor, test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero mean and unit variance by the training set's statistics.

    Raises:
        ValueError: every training value is the same (a standard deviation of 0 would make every input
            NaN, and the run would be reported as diverged).
    """
    mean, std = train.mean(), train.std()
    if not float(std) > 0:
        raise ValueError(f"The training images are constant (every value {float(mean):g}): there is nothing to "
                         "learn from, and standardizing would divide by 0. Check the files.")
    return (train - mean) / std, (test - mean) / std


def _digits() -> Dataset:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_train = int(0.8 * len(labels))
    train, test = order[:n_train], order[n_train:]
    train_x, test_x = _standardize(images[train], images[test])
    return Dataset("digits", "image", train_x, labels[train], test_x, labels[test], 10)


def _synthetic(n_train: int = 2048, n_test: int = 512) -> Dataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_test, 1, 28, 28, generator=g)
    teacher = torch.randn(28 * 28, 10, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    return Dataset("synthetic", "image", x[:n_train], y[:n_train], x[n_train:], y[n_train:], 10)


def _text(limit: int = TEXT_BYTES) -> Dataset:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    stream = torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()
    if len(stream) < 10_000:
        raise ValueError(f"Only {len(stream)} bytes of Python source found under {root}; the text set needs 10000.")
    split = int(0.9 * len(stream))
    return Dataset("text", "text", stream[:split], stream[:split], stream[split:], stream[split:], 256)


def _open(path: Path) -> bytes:
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_dir():
            raise ValueError(f"MNIST file {candidate} is a directory: put the IDX file itself there (as downloaded "
                             "from the MNIST site, gzipped or not).")
        if candidate.exists():
            raw = candidate.read_bytes()
            if candidate.suffix == ".gz":
                try:
                    raw = gzip.decompress(raw)
                except (OSError, EOFError, zlib.error) as error:  # a bad header, a cut file, a corrupt stream
                    raise ValueError(f"MNIST file {candidate} is not valid gzip: {error}.") from error
            return raw
    raise ValueError(f"MNIST file {path} (or {path.name}.gz) is missing.")


def read_idx(path: Path, magic: int) -> torch.Tensor:
    """Read one IDX file (uint8 data) and check its magic number and size.

    Raises:
        ValueError: missing, wrong magic number, or fewer/more bytes than its header says.
    """
    raw = _open(path)
    if len(raw) < 8:
        raise ValueError(f"MNIST file {path} is truncated: {len(raw)} bytes, not even a header.")
    found_magic, count = struct.unpack(">II", raw[:8])
    if found_magic != magic:
        raise ValueError(f"MNIST file {path} has magic number {found_magic}, expected {magic}: wrong or corrupt file.")
    dims = [count]
    header = 8
    if magic == 2051:
        if len(raw) < 16:
            raise ValueError(f"MNIST file {path} is truncated inside its header.")
        dims += list(struct.unpack(">II", raw[8:16]))
        header = 16
    expected = header + int(torch.tensor(dims).prod())
    if len(raw) != expected:
        raise ValueError(
            f"MNIST file {path} has {len(raw)} bytes, its header promises {expected}: truncated or corrupt."
        )
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).view(*dims)


def load_mnist(directory: Path) -> Dataset:
    """The four MNIST IDX files from ``directory`` (names as distributed, optionally .gz)."""
    if not directory.is_dir():
        raise ValueError(f"MNIST directory {directory} does not exist.")
    arrays = {key: read_idx(directory / name, magic) for key, (name, magic) in IDX_FILES.items()}
    for split in ("train", "test"):
        if len(arrays[f"{split}_images"]) != len(arrays[f"{split}_labels"]):
            raise ValueError(
                f"MNIST {split} split: {len(arrays[f'{split}_images'])} images but "
                f"{len(arrays[f'{split}_labels'])} labels."
            )
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if tuple(images.shape[1:]) != (28, 28):
            raise ValueError(f"MNIST {split} images in {directory} are {images.shape[1]}x{images.shape[2]}, not 28x28: "
                             "not MNIST's files (the models here take 1x28x28 inputs).")
        if len(labels) and int(labels.max()) > 9:
            raise ValueError(f"MNIST {split} labels in {directory} go up to {int(labels.max())}; MNIST has classes "
                             "0-9: a corrupt or foreign labels file.")
    train_x = arrays["train_images"].float().unsqueeze(1) / 255.0
    test_x = arrays["test_images"].float().unsqueeze(1) / 255.0
    train_x, test_x = _standardize(train_x, test_x)
    return Dataset(
        "mnist", "image", train_x, arrays["train_labels"].long(), test_x, arrays["test_labels"].long(), 10
    )


def batches(data: Dataset, batch_size: int, steps: int, seed: int, context: int) -> list[torch.Tensor]:
    """The index tensors of every training batch, fixed by ``seed``.

    Images: epochs of shuffled sample indices. Text: window start offsets.
    Every run of a comparison draws the same list, so all see the same batches
    in the same order.
    """
    if not 1 <= batch_size <= (len(data.train_x) - context - 1 if data.kind == "text" else len(data.train_y)):
        raise ValueError(f"Batch size {batch_size} does not fit the {data.name} training set: use 1 to "
                         f"{len(data.train_y) if data.kind == 'image' else 'its length'}.")
    g = torch.Generator().manual_seed(seed)
    if data.kind == "text":
        high = len(data.train_x) - context - 1
        return [torch.randint(0, high, (batch_size,), generator=g) for _ in range(steps)]
    out: list[torch.Tensor] = []
    while len(out) < steps:
        order = torch.randperm(len(data.train_y), generator=g)
        for start in range(0, len(order) - batch_size + 1, batch_size):  # drop the ragged last batch
            out.append(order[start : start + batch_size])
    return out[:steps]


def windows(stream: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of text windows starting at ``starts``."""
    offsets = starts[:, None] + torch.arange(context + 1)
    chunk = stream[offsets]
    return chunk[:, :-1], chunk[:, 1:]


def pair(data: Dataset, index: torch.Tensor, context: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """The (input, target) batch at ``index`` (from ``batches``) of the ``split`` set."""
    xs, ys = (data.train_x, data.train_y) if split == "train" else (data.test_x, data.test_y)
    return windows(xs, index, context) if data.kind == "text" else (xs[index], ys[index])


def first_batch(data: Dataset, batch_size: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch of ``batch_size`` samples from the start of the set (the set repeated where it is
    smaller): what the plan times steps on."""
    index = torch.arange(batch_size) % len(data.train_x if data.kind == "text" else data.train_y)
    if data.kind == "text":
        return windows(data.train_x, index % (len(data.train_x) - context - 1), context)
    return data.train_x[index], data.train_y[index]
