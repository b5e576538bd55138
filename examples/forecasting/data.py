"""Time-Series-Library (TSLib) CSV datasets for long-term forecasting, without pandas.

Splits follow TSLib exactly (``data_provider/data_loader.py``):

* ETTh1/ETTh2 (``Dataset_ETT_hour``): 12/4/4 months of 30 days at 1 hour,
  borders ``[0, 12*30*24 - L, 16*30*24 - L]`` to ``[12*30*24, 16*30*24, 20*30*24]``;
* ETTm1/ETTm2 (``Dataset_ETT_minute``): the same months at 15 minutes (x4);
* others (``Dataset_Custom``: weather, illness): 70/10/20 % by time, the target column moved
  last, with ``num_train = int(0.7 N)``, ``num_test = int(0.2 N)``, borders
  ``[0, num_train - L, N - num_test - L]`` to ``[num_train, num_train + num_vali, N]``;

where ``L`` is the input length: validation and test windows start ``L`` rows before their
split so that their first target follows the split border. A standard scaler (population
std) is fitted on the training rows of all channels (``features='M'``). Time features are
TSLib's ``timeF`` (``timeenc=1``): calendar fields scaled to [-0.5, 0.5].
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import hashlib
import logging
import os
import re
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

from examples.common.paths import default_data_root

# name -> (path under the data root, TSLib split rule)
DATASETS = {
    "ETTh1": ("ETT/ETTh1.csv", "ett_hour"),
    "ETTh2": ("ETT/ETTh2.csv", "ett_hour"),
    "ETTm1": ("ETT/ETTm1.csv", "ett_minute"),
    "ETTm2": ("ETT/ETTm2.csv", "ett_minute"),
    "weather": ("weather/weather.csv", "custom"),
    "illness": ("illness/national_illness.csv", "custom"),
}

# Official ETDataset files (zhouhaoyi/ETDataset) and their sha256 (../shared/data/ETT/SOURCE.txt).
ETT_COMMIT = "1d16c8f4f943005d613b5bc962e9eeb06058cf07"
ETT_URL = "https://raw.githubusercontent.com/zhouhaoyi/ETDataset/{commit}/ETT-small/{name}.csv"
ETT_SHA256 = {
    "ETTh1": "f18de3ad269cef59bb07b5438d79bb3042d3be49bdeecf01c1cd6d29695ee066",
    "ETTh2": "a3dc2c597b9218c7ce1cd55eb77b283fd459a1d09d753063f944967dd6b9218b",
    "ETTm1": "6ce1759b1a18e3328421d5d75fadcb316c449fcd7cec32820c8dafda71986c9e",
    "ETTm2": "db973ca252c6410a30d0469b13d696cf919648d0f3fd588c60f03fdbdbadd1fd",
}


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_ett(
    dest: str | os.PathLike, names: tuple[str, ...] = ("ETTh1", "ETTh2", "ETTm1", "ETTm2")
) -> list[Path]:
    """Downloads the official ETT CSVs into ``dest/ETT/`` and checks their sha256.

    Files already present with the right checksum are kept. The data are CC BY-ND 4.0
    (Zhou et al., Informer, AAAI 2021): use them unchanged.

    Args:
      dest: a data root (the layout of ``../shared/data``).
      names: which of ETTh1, ETTh2, ETTm1, ETTm2 to fetch.

    Returns:
      The paths of the verified files.

    Raises:
      ValueError: on a checksum mismatch (the partial download is removed).
    """
    out_dir = Path(dest) / "ETT"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        path = out_dir / f"{name}.csv"
        if path.exists() and sha256_file(path) == ETT_SHA256[name]:
            paths.append(path)
            continue
        url = ETT_URL.format(commit=ETT_COMMIT, name=name)
        logging.info("downloading %s", url)
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=60) as r:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
            digest = sha256_file(tmp)
            if digest != ETT_SHA256[name]:
                raise ValueError(f"{url}: sha256 {digest} != expected {ETT_SHA256[name]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        paths.append(path)
    return paths


@dataclasses.dataclass
class Table:
    """A TSLib CSV: a ``date`` column and numeric channels.

    Attributes:
      dates: [N] ``datetime64[s]`` time stamps.
      columns: channel names, in file order.
      values: [N, C] float64 channel values.
    """

    dates: np.ndarray
    columns: list[str]
    values: np.ndarray


# The date formats of TSLib's CSVs: ISO ("2016-07-01 00:00:00", ETT, weather, electricity,
# traffic), slashes without leading zeros ("1990/1/1 0:00", exchange_rate), a date alone
# ("2002-01-01"); seconds and a "T" separator are optional.
_DATE = re.compile(
    r"^\s*(\d{4})[-/](\d{1,2})[-/](\d{1,2})"
    r"(?:[ T](\d{1,2}):(\d{1,2})(?::(\d{1,2})(?:\.(\d{1,6}))?)?)?\s*$"
)


class CSVFormatError(ValueError):
    """A TSLib CSV that cannot be read or used; the message names file, row and column."""


def parse_date(text: str) -> np.datetime64:
    """One TSLib time stamp: ``YYYY-MM-DD[ HH:MM[:SS]]`` or ``YYYY/M/D[ H:MM[:SS]]``.

    Raises:
      ValueError: when ``text`` is in none of these formats or names no real date.
    """
    m = _DATE.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a date like 2016-07-01 00:00:00 or 1990/1/1 0:00")
    y, mo, d, hh, mm, ss, frac = m.groups()
    stamp = _dt.datetime(
        int(y),
        int(mo),
        int(d),
        int(hh or 0),
        int(mm or 0),
        int(ss or 0),
        int((frac or "0").ljust(6, "0")),
    )
    return np.datetime64(stamp, "s")


def read_csv(path: str | os.PathLike) -> Table:
    """Reads a TSLib CSV: a ``date`` column first, then one numeric column per channel.

    Dates may be ISO (``2016-07-01 00:00:00``), ``Y/M/D H:MM`` (``1990/1/1 0:00``) or a date
    alone (``2002-01-01``). Blank lines are skipped.

    Args:
      path: the CSV file.

    Returns:
      The dates, column names and values.

    Raises:
      CSVFormatError: naming the file, the row (1-based line number, header = 1) and the
        column of the first value that cannot be read.
    """
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise CSVFormatError(f"{path}: empty file")
    header = [h.strip() for h in rows[0]]
    if header[0] != "date":
        raise CSVFormatError(
            f"{path}, row 1, column 1: the first column must be 'date' (TSLib format), "
            f"got {header[0]!r}"
        )
    if len(header) < 2:
        raise CSVFormatError(f"{path}, row 1: no value columns after 'date'")
    dates, values = [], []
    for line, row in enumerate(rows[1:], start=2):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise CSVFormatError(
                f"{path}, row {line}: {len(row)} fields, the header has {len(header)}"
            )
        try:
            dates.append(parse_date(row[0]))
        except ValueError as e:
            raise CSVFormatError(f"{path}, row {line}, column 'date': {e}") from None
        try:
            values.append([float(v) for v in row[1:]])
        except ValueError:
            for j, v in enumerate(row[1:], start=1):
                try:
                    float(v)
                except ValueError:
                    raise CSVFormatError(
                        f"{path}, row {line}, column {header[j]!r}: {v!r} is not a number"
                    ) from None
    if not values:
        raise CSVFormatError(f"{path}: no data rows")
    return Table(
        dates=np.array(dates, dtype="datetime64[s]"),
        columns=header[1:],
        values=np.array(values, dtype=np.float64),
    )


FREQS = ("s", "t", "h", "d", "b", "w", "m")  # TSLib's --freq letters (t: minutes, b: business days)


def normalize_freq(freq: str) -> str:
    """A TSLib ``--freq`` value ('h', '15min', '10t', 'd', ...) as one letter of ``FREQS``.

    Raises:
      ValueError: for a frequency TSLib's ``timeF`` features do not cover.
    """
    unit = freq.strip().lstrip("0123456789").lower()
    unit = {"min": "t", "sec": "s", "hour": "h", "day": "d", "week": "w", "month": "m"}.get(
        unit, unit
    )
    if unit not in FREQS:
        raise ValueError(f"unknown frequency {freq!r}; expected one of {FREQS} (or e.g. '15min')")
    return unit


def infer_freq(dates: np.ndarray) -> str:
    """TSLib frequency letter from the median spacing: 's', 't', 'h', 'd', 'w' or 'm'."""
    step = np.median(np.diff(dates).astype("timedelta64[s]").astype(np.int64))
    if step < 60:
        return "s"
    if step < 3600:
        return "t"
    if step < 86400:
        return "h"
    if step < 7 * 86400:
        return "d"
    if step < 28 * 86400:
        return "w"
    return "m"


def time_features(dates: np.ndarray, freq: str) -> np.ndarray:
    """TSLib ``timeF`` features (``utils/timefeatures.py``), each in [-0.5, 0.5].

    'h': HourOfDay, DayOfWeek, DayOfMonth, DayOfYear; 't' (minutes): MinuteOfHour first, then
    the same; 's': SecondOfMinute first, then as 't'; 'd' and 'b': DayOfWeek, DayOfMonth,
    DayOfYear; 'w': DayOfMonth, WeekOfYear; 'm': MonthOfYear.

    Args:
      dates: [N] ``datetime64`` stamps.
      freq: one of ``FREQS``.

    Returns:
      [N, F] float32 features.
    """
    d = dates.astype("datetime64[s]")
    day = d.astype("datetime64[D]")
    second = (d - d.astype("datetime64[m]")).astype(np.int64)
    minute = (d.astype("datetime64[m]") - d.astype("datetime64[h]")).astype(np.int64)
    hour = (d.astype("datetime64[h]") - day).astype(np.int64)
    dow = (day.astype(np.int64) + 3) % 7  # 1970-01-01 was a Thursday; Monday = 0 as in pandas
    dom = (day - day.astype("datetime64[M]")).astype(np.int64) + 1
    doy = (day - day.astype("datetime64[Y]")).astype(np.int64) + 1
    month = (day.astype("datetime64[M]") - day.astype("datetime64[Y]")).astype(np.int64)
    feats = {
        "second": second / 59.0 - 0.5,
        "minute": minute / 59.0 - 0.5,
        "hour": hour / 23.0 - 0.5,
        "dow": dow / 6.0 - 0.5,
        "dom": (dom - 1) / 30.0 - 0.5,
        "doy": (doy - 1) / 365.0 - 0.5,
        "moy": month / 11.0 - 0.5,
    }
    if freq == "w":
        week = np.array([_dt.date.fromisoformat(str(x)).isocalendar()[1] for x in day])
        feats["woy"] = (week - 1) / 52.0 - 0.5
    names = {
        "s": ["second", "minute", "hour", "dow", "dom", "doy"],
        "t": ["minute", "hour", "dow", "dom", "doy"],
        "h": ["hour", "dow", "dom", "doy"],
        "d": ["dow", "dom", "doy"],
        "b": ["dow", "dom", "doy"],
        "w": ["dom", "woy"],
        "m": ["moy"],
    }[normalize_freq(freq)]
    return np.stack([feats[n] for n in names], axis=-1).astype(np.float32)


def split_borders(rule: str, n_rows: int, seq_len: int) -> tuple[list[int], list[int]]:
    """TSLib's ``border1s`` (window starts) and ``border2s`` (ends) for train/val/test."""
    if rule in ("ett_hour", "ett_minute"):
        per_month = 30 * 24 * (4 if rule == "ett_minute" else 1)
        b2 = [12 * per_month, 16 * per_month, 20 * per_month]
        b1 = [0, b2[0] - seq_len, b2[1] - seq_len]
        return b1, b2
    if rule == "custom":
        num_train = int(n_rows * 0.7)
        num_test = int(n_rows * 0.2)
        num_vali = n_rows - num_train - num_test
        b1 = [0, num_train - seq_len, n_rows - num_test - seq_len]
        b2 = [num_train, num_train + num_vali, n_rows]
        return b1, b2
    raise ValueError(f"unknown split rule {rule!r}")


@dataclasses.dataclass
class WindowDataset:
    """Sliding windows over one split (a ``BatchSource``).

    Attributes:
      data: [N, C] scaled values of the split (with the ``seq_len`` rows before it).
      marks: [N, F] time features.
      seq_len: input length L.
      pred_len: horizon P.
    """

    data: np.ndarray
    marks: np.ndarray
    seq_len: int
    pred_len: int

    def __len__(self) -> int:
        return max(len(self.data) - self.seq_len - self.pred_len + 1, 0)

    def batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Windows starting at ``indices``: x [B, L, C], x_mark [B, L, F], y [B, P, C], y_mark."""
        indices = np.asarray(indices)
        xi = indices[:, None] + np.arange(self.seq_len)
        yi = indices[:, None] + self.seq_len + np.arange(self.pred_len)
        return {
            "x": self.data[xi],
            "x_mark": self.marks[xi],
            "y": self.data[yi],
            "y_mark": self.marks[yi],
        }


@dataclasses.dataclass
class ForecastData:
    """A dataset's three splits and its scaler.

    Attributes:
      train: training windows.
      val: validation windows.
      test: test windows.
      mean: [C] scaler mean (fitted on the training rows).
      std: [C] scaler standard deviation.
      columns: channel names (target last).
      freq: the time-feature frequency letter.
      borders: TSLib's (border1s, border2s).
    """

    train: WindowDataset
    val: WindowDataset
    test: WindowDataset
    mean: np.ndarray
    std: np.ndarray
    columns: list[str]
    freq: str
    borders: tuple[list[int], list[int]]

    @property
    def num_channels(self) -> int:
        return len(self.columns)

    @property
    def num_marks(self) -> int:
        return self.train.marks.shape[-1]


SPLITS = ("auto", "custom", "ett_hour", "ett_minute")  # --split choices for a CSV


def split_rule_for(path: str | os.PathLike, split: str = "auto") -> str:
    """The TSLib split rule of a CSV: ETT's months where the file's name says ETTh or ETTm.

    Args:
      path: the CSV file.
      split: "auto" (by name: ``ETTh*`` -> "ett_hour", ``ETTm*`` -> "ett_minute", otherwise
        "custom", TSLib's 70/10/20), or one of those rules to force it.

    Returns:
      The rule for ``split_borders``.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if split != "auto":
        return split
    stem = Path(path).stem
    if stem.startswith("ETTh"):
        return "ett_hour"
    if stem.startswith("ETTm"):
        return "ett_minute"
    return "custom"


def load_dataset(
    name: str,
    seq_len: int = 96,
    pred_len: int = 96,
    data_root: str | os.PathLike | None = None,
    target: str = "OT",
    freq: str | None = None,
) -> ForecastData:
    """Loads a TSLib dataset with TSLib's splits, scaling and time features (``features='M'``).

    Args:
      name: a key of ``DATASETS`` (ETTh1, ETTh2, ETTm1, ETTm2, weather, illness).
      seq_len: input length L.
      pred_len: horizon P.
      data_root: folder holding ``ETT/``, ``weather/``, ...; default ``../shared/data``.
      target: the target column, moved last for ``Dataset_Custom`` datasets as TSLib does.
      freq: time-feature frequency; inferred from the time stamps when None.

    Returns:
      The splits, scaler and metadata.
    """
    if name not in DATASETS:
        raise ValueError(
            f"unknown dataset {name!r}; known: {sorted(DATASETS)}. "
            "For another TSLib CSV, use load_csv (main.py --csv PATH)."
        )
    rel, rule = DATASETS[name]
    root = Path(data_root) if data_root is not None else default_data_root()
    table = read_csv(root / rel)
    if rule == "custom" and target not in table.columns:
        target = None  # as before: no reordering when the default target is absent
    return _prepare(table, rule, seq_len, pred_len, target, freq, name)


def load_csv(
    path: str | os.PathLike,
    seq_len: int = 96,
    pred_len: int = 96,
    target: str = "OT",
    freq: str | None = None,
    split: str = "auto",
) -> ForecastData:
    """Loads any TSLib-format CSV (``date`` first, then numeric channels) as TSLib would.

    The split is TSLib's ``Dataset_Custom`` (70/10/20 % by time, ``target`` moved last)
    unless the file's name starts with ETTh or ETTm (``Dataset_ETT_hour``/``_minute``: 12/4/4
    months) or ``split`` says otherwise. All channels are inputs and outputs (``features='M'``).

    Args:
      path: the CSV file.
      seq_len: input length L.
      pred_len: horizon P.
      target: the target column (must exist for the 70/10/20 split, as in TSLib).
      freq: time-feature frequency (a letter of ``FREQS`` or e.g. "15min"); inferred when None.
      split: see ``split_rule_for``.

    Returns:
      The splits, scaler and metadata.

    Raises:
      CSVFormatError: for a value that cannot be read (file, row and column named), a
        missing target column, or splits too short for the windows.
    """
    rule = split_rule_for(path, split)
    table = read_csv(path)
    if rule == "custom" and target not in table.columns:
        raise CSVFormatError(
            f"{path}: target column {target!r} not found; columns are {table.columns} "
            "(pass --target NAME)"
        )
    return _prepare(table, rule, seq_len, pred_len, target, freq, str(path))


def _prepare(
    table: Table,
    rule: str,
    seq_len: int,
    pred_len: int,
    target: str | None,
    freq: str | None,
    name: str,
) -> ForecastData:
    """TSLib's column order, split, scaler and time features for one table."""
    values, columns = table.values, list(table.columns)
    if rule == "custom" and target is not None:  # TSLib: df_raw[['date'] + cols + [target]]
        order = [i for i, c in enumerate(columns) if c != target] + [columns.index(target)]
        values, columns = values[:, order], [columns[i] for i in order]
    b1, b2 = split_borders(rule, len(values), seq_len)
    if b2[-1] > len(values):
        raise CSVFormatError(
            f"{name}: {len(values)} rows, fewer than the {b2[-1]} the {rule!r} split needs "
            "(use --split custom for a 70/10/20 split)"
        )
    if min(b1) < 0:
        raise CSVFormatError(
            f"{name}: {len(values)} rows are too few for seq_len={seq_len} "
            f"(the training split has {b2[0]} rows)"
        )
    train_rows = values[b1[0] : b2[0]]
    mean = train_rows.mean(axis=0)
    std = train_rows.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    scaled = ((values - mean) / std).astype(np.float32)
    freq = normalize_freq(freq) if freq else infer_freq(table.dates)
    marks = time_features(table.dates, freq)
    splits = [
        WindowDataset(scaled[s:e], marks[s:e], seq_len, pred_len)
        for s, e in zip(b1, b2, strict=True)
    ]
    for split, n in zip(("train", "val", "test"), splits, strict=True):
        if len(n) == 0:
            raise CSVFormatError(
                f"{name}: no {split} windows for seq_len={seq_len}, pred_len={pred_len} "
                f"({b2[0]}/{b2[1] - b2[0]}/{b2[2] - b2[1]} rows in train/val/test)"
            )
    return ForecastData(*splits, mean=mean, std=std, columns=columns, freq=freq, borders=(b1, b2))
