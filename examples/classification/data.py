"""UEA multivariate classification data: an sktime ``.ts`` reader, padding masks, normalisation.

The ``.ts`` format (sktime ``load_from_tsfile``): ``#`` comment lines, a header of ``@key
value`` lines (``@problemName``, ``@timeStamps``, ``@missing``, ``@univariate``,
``@dimensions``, ``@equalLength``, ``@seriesLength``, ``@classLabel true <labels...>``), then
``@data`` and one case per line: the dimensions separated by ``:``, each a comma-separated
series (``?`` or ``NaN`` for a missing value; ``(t,v)`` tuples when ``@timeStamps true``), and
the class label last.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import numpy as np

from examples.common.paths import default_data_root

DATASETS = ("JapaneseVowels", "Handwriting")


@dataclasses.dataclass
class TSFile:
    """The content of one ``.ts`` file.

    Attributes:
      series: one [T_i, C] float32 array per case (NaN where missing).
      labels: the class label string of each case.
      class_names: the labels declared by ``@classLabel`` (their order defines class ids).
      header: the ``@`` header fields, lower-cased keys, raw string values.
    """

    series: list[np.ndarray]
    labels: list[str]
    class_names: list[str]
    header: dict[str, str]

    @property
    def num_dims(self) -> int:
        return self.series[0].shape[1]

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.series])


def _parse_values(text: str, timestamps: bool) -> np.ndarray:
    text = text.strip()
    if timestamps:  # "(t1,v1),(t2,v2)": keep the values in order
        pairs = re.findall(r"\(([^,()]*),([^()]*)\)", text)
        items = [v for _, v in pairs]
    else:
        items = text.split(",") if text else []
    return np.array(
        [np.nan if v.strip() in ("?", "NaN", "nan", "") else float(v) for v in items], np.float32
    )


def read_ts(path: str | os.PathLike) -> TSFile:
    """Reads an sktime ``.ts`` classification file.

    Args:
      path: the file.

    Returns:
      The cases (variable lengths allowed; dimensions of one case padded with NaN to its longest
      dimension), labels and header.

    Raises:
      ValueError: on a malformed file (no ``@data``, a wrong number of dimensions, an
        undeclared label).
    """
    header: dict[str, str] = {}
    series, labels = [], []
    in_data = False
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if not in_data:
                if not line.startswith("@"):
                    raise ValueError(f"{path}: unexpected line before @data: {line[:40]!r}")
                key, _, value = line[1:].partition(" ")
                if key.lower() == "data":
                    in_data = True
                else:
                    header[key.lower()] = value.strip()
                continue
            has_label = header.get("classlabel", "false").split()[0].lower() == "true"
            timestamps = header.get("timestamps", "false").lower() == "true"
            parts = line.split(":")
            if has_label:
                labels.append(parts[-1].strip())
                parts = parts[:-1]
            dims = [_parse_values(p, timestamps) for p in parts]
            length = max(len(d) for d in dims)
            case = np.full((length, len(dims)), np.nan, np.float32)
            for j, d in enumerate(dims):
                case[: len(d), j] = d
            series.append(case)
    if not in_data:
        raise ValueError(f"{path}: no @data section")
    class_names = header.get("classlabel", "false").split()[1:]
    n_dims = int(header["dimensions"]) if "dimensions" in header else series[0].shape[1]
    for i, s in enumerate(series):
        if s.shape[1] != n_dims:
            raise ValueError(f"{path}: case {i} has {s.shape[1]} dimensions, expected {n_dims}")
    unknown = set(labels) - set(class_names)
    if class_names and unknown:
        raise ValueError(f"{path}: labels {sorted(unknown)} not declared in @classLabel")
    return TSFile(series=series, labels=labels, class_names=class_names, header=header)


@dataclasses.dataclass
class ClassificationSet:
    """Padded cases of one split (a ``BatchSource``).

    Attributes:
      x: [N, T, C] float32 normalised values, 0 at padding and missing values.
      mask: [N, T] bool, True at real time steps.
      y: [N] int32 class ids.
    """

    x: np.ndarray
    mask: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Cases at ``indices``: x [B, T, C], mask [B, T], y [B]."""
        return {"x": self.x[indices], "mask": self.mask[indices], "y": self.y[indices]}


@dataclasses.dataclass
class ClassificationData:
    """Train, validation (held out from train) and test splits of a UEA dataset.

    Attributes:
      train: the training cases (without the validation ones).
      val: the stratified hold-out of the training file used for early stopping.
      test: the test file's cases.
      class_names: class id -> label.
      mean: [C] per-channel mean over the training cases' real time steps.
      std: [C] per-channel standard deviation.
    """

    train: ClassificationSet
    val: ClassificationSet
    test: ClassificationSet
    class_names: list[str]
    mean: np.ndarray
    std: np.ndarray

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def num_dims(self) -> int:
        return self.train.x.shape[-1]

    @property
    def max_len(self) -> int:
        return self.train.x.shape[1]


def stratified_split(y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, val), holding out ``fraction`` of each class (at least 1 if it has 2)."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = int(round(fraction * len(idx)))
        k = min(max(k, 1 if len(idx) > 1 and fraction > 0 else 0), len(idx) - 1)
        val.extend(idx[:k])
        train.extend(idx[k:])
    return np.sort(np.array(train, int)), np.sort(np.array(val, int))


def _pad(series: list[np.ndarray], length: int, mean, std) -> tuple[np.ndarray, np.ndarray]:
    n, c = len(series), series[0].shape[1]
    x = np.zeros((n, length, c), np.float32)
    mask = np.zeros((n, length), bool)
    for i, s in enumerate(series):
        s = s[:length]
        x[i, : len(s)] = np.nan_to_num((s - mean) / std, nan=0.0)
        mask[i, : len(s)] = True
    return x, mask


def load_dataset(
    name: str,
    data_root: str | os.PathLike | None = None,
    val_fraction: float = 0.2,
    split_seed: int = 0,
) -> ClassificationData:
    """Loads ``UEA/<name>/<name>_{TRAIN,TEST}.ts``, normalises per channel, pads with a mask.

    Args:
      name: the dataset folder, e.g. JapaneseVowels or Handwriting.
      data_root: folder holding ``UEA/``; default ``../shared/data``.
      val_fraction: share of each class of the training file held out for validation.
      split_seed: seed of that hold-out (fixed across model seeds).

    Returns:
      The three splits, padded to the longest case of either file.
    """
    root = Path(data_root) if data_root is not None else default_data_root()
    train_file = read_ts(root / "UEA" / name / f"{name}_TRAIN.ts")
    test_file = read_ts(root / "UEA" / name / f"{name}_TEST.ts")
    class_names = train_file.class_names or sorted(set(train_file.labels))
    ids = {c: i for i, c in enumerate(class_names)}
    y_train = np.array([ids[c] for c in train_file.labels], np.int32)
    y_test = np.array([ids[c] for c in test_file.labels], np.int32)
    tr_idx, va_idx = stratified_split(y_train, val_fraction, split_seed)
    fit_rows = np.concatenate([train_file.series[i] for i in tr_idx])
    mean = np.nanmean(fit_rows, axis=0)
    std = np.nanstd(fit_rows, axis=0)
    std = np.where(std > 0, std, 1.0)
    length = int(max(train_file.lengths.max(), test_file.lengths.max()))

    def make(series, y):
        x, mask = _pad(series, length, mean, std)
        return ClassificationSet(x=x, mask=mask, y=y)

    return ClassificationData(
        train=make([train_file.series[i] for i in tr_idx], y_train[tr_idx]),
        val=make([train_file.series[i] for i in va_idx], y_train[va_idx]),
        test=make(test_file.series, y_test),
        class_names=class_names,
        mean=mean.astype(np.float32),
        std=std.astype(np.float32),
    )
