"""Reading question/answer rows from disk and feeding them through grain.

Readers return plain ``dict`` rows. JSON lines (``.jsonl``) are read with the standard library; a
Hugging Face dataset stored locally (``.parquet`` files from the hub, or the ``.arrow`` files that
``Dataset.save_to_disk`` and the datasets cache write) needs ``pyarrow``, which is imported only on
that path. A path may be one file or a directory, in which case every data file below it is read in
sorted path order (only the requested split's files when the directory holds several splits).

Every row goes through a task-supplied ``validate(row) -> problem | None``. A bad row raises
:class:`MalformedRowError` naming the file and line (row number for columnar files), unless
``skip_malformed`` is set: then it is skipped and counted in :attr:`Rows.skipped`.

:func:`train_dataset` builds the grain pipeline (seeded shuffle that changes every epoch, repeat)
and :func:`train_iterator` returns its ``grain.DatasetIterator``, whose ``get_state()`` is a small
JSON-serializable dict that ``set_state()`` resumes from exactly (also through Orbax with grain's
checkpoint handler).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re
from collections.abc import Callable, Sequence

import grain

DATA_SUFFIXES = (".jsonl", ".parquet", ".arrow")
PYARROW_HINT = ("reading {kind} files needs pyarrow, which is not installed. Install it with "
                "`pip install pyarrow` (or convert the data to JSON lines, one object per line).")

Validator = Callable[[dict], "str | None"]


class DataError(ValueError):
  """Task data that cannot be used (``task.train_path`` / ``task.test_path``); the message names
  the file (and line). The command lines report it in one line (``areal_jax.cli``)."""


class DataNotFoundError(DataError, FileNotFoundError):
  """A data path with no data files under it (or none of the split asked for)."""


class MalformedRowError(DataError):
  """A data row that cannot be used; the message starts with ``file:line:``."""

  def __init__(self, path: str | pathlib.Path, line: int, problem: str, unit: str = "line"):
    self.path, self.line, self.problem = str(path), line, problem
    where = f"{path}:{line}" if unit == "line" else f"{path}:{line} (row {line})"
    super().__init__(f"{where}: {problem}")


@dataclasses.dataclass
class Rows:
  """Rows read from one path, with how many malformed rows were skipped and where."""

  rows: list[dict]
  skipped: int = 0
  skipped_where: list[str] = dataclasses.field(default_factory=list)  # the first few file:line


def _import_pyarrow(kind: str):
  try:
    import pyarrow  # noqa: F401  pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(PYARROW_HINT.format(kind=kind)) from e
  return pyarrow


_SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")


def _split_of(relative: pathlib.Path) -> str | None:
  """The split a data file's path names (``main/train-00000-of-00001.parquet``), if any."""
  for part in reversed(relative.parts):
    for token in re.split(r"[^a-z]+", part.lower()):
      if token in _SPLIT_NAMES:
        return token
  return None


def data_files(path: str | pathlib.Path, split: str | None = None) -> list[pathlib.Path]:
  """The data files a path names: itself, or every ``.jsonl/.parquet/.arrow`` file below it.

  For a directory that holds several splits (a Hugging Face snapshot ``main/train-*.parquet`` and
  ``main/test-*.parquet``, or a datasets cache folder with ``gsm8k-train.arrow`` and
  ``gsm8k-test.arrow``), only the files whose path names ``split`` are used.
  """
  p = pathlib.Path(path).expanduser()
  if not p.exists():
    raise DataNotFoundError(f"data path not found: {p}")
  if p.is_file():
    if p.suffix not in DATA_SUFFIXES:
      raise DataError(f"{p}: unsupported data file type {p.suffix!r}; expected one of {DATA_SUFFIXES}")
    return [p]
  files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES
                 and not any(part.startswith(".") for part in f.relative_to(p).parts))
  if not files:
    raise DataNotFoundError(f"no {'/'.join(DATA_SUFFIXES)} files found under directory {p}")
  splits = {f: _split_of(f.relative_to(p)) for f in files}
  if split is not None and len(set(splits.values()) - {None}) > 1:
    files = [f for f in files if splits[f] == split]
    if not files:
      raise DataNotFoundError(f"{p} holds the splits {sorted(set(splits.values()) - {None})} "
                              f"but no {split!r} files; point at the {split} file or folder")
  return files


def _jsonl_records(path: pathlib.Path):
  """Yields ``(line_number, row_or_problem)``; blank lines are ignored."""
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
      except UnicodeDecodeError as e:
        yield lineno, f"not valid UTF-8 ({e.reason} at byte {e.start})"
        continue
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        yield lineno, f"invalid JSON ({e.msg} at column {e.colno})"
        continue
      yield lineno, row


def _arrow_table(path: pathlib.Path):
  pa = _import_pyarrow("Arrow")
  import pyarrow.ipc  # pylint: disable=import-outside-toplevel
  # `datasets` writes the streaming IPC format; plain Arrow files use the random-access one.
  try:
    with pa.memory_map(str(path)) as source:
      return pyarrow.ipc.open_stream(source).read_all()
  except pa.ArrowInvalid:
    with pa.memory_map(str(path)) as source:
      return pyarrow.ipc.open_file(source).read_all()


def _parquet_table(path: pathlib.Path):
  _import_pyarrow("Parquet")
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  return pq.read_table(str(path))


def _columnar_records(path: pathlib.Path):
  """Yields ``(row_number, row)`` (1-based) from a Parquet or Arrow file."""
  table = _parquet_table(path) if path.suffix == ".parquet" else _arrow_table(path)
  for i, row in enumerate(table.to_pylist(), start=1):
    yield i, row


def read_rows(path: str | pathlib.Path, validate: Validator, skip_malformed: bool = False,
              split: str | None = None) -> Rows:
  """Reads and validates every row under ``path`` (``split``: see :func:`data_files`)."""
  out = Rows(rows=[])
  for file in data_files(path, split):
    records = _jsonl_records(file) if file.suffix == ".jsonl" else _columnar_records(file)
    unit = "line" if file.suffix == ".jsonl" else "row"
    for line, row in records:
      if isinstance(row, str):
        problem = row
      elif not isinstance(row, dict):
        problem = f"expected a JSON object, got {type(row).__name__}"
      else:
        problem = validate(row)
      if problem is None:
        out.rows.append(row)
        continue
      if not skip_malformed:
        raise MalformedRowError(file, line, problem, unit)
      out.skipped += 1
      if len(out.skipped_where) < 10:
        out.skipped_where.append(f"{file}:{line}: {problem}")
  if out.skipped:
    logging.warning("skipped %d malformed rows under %s (task.skip_malformed=True); first: %s",
                    out.skipped, path, "; ".join(out.skipped_where[:3]))
  if not out.rows:
    raise DataError(f"no usable rows under {path}" +
                    (f" ({out.skipped} malformed rows skipped)" if out.skipped else ""))
  return out


def _copy(example: dict) -> dict:
  return dict(example)  # consumers may modify what they get; the source rows stay intact


def train_dataset(examples: Sequence[dict], seed: int, epochs: int | None = 1,
                  shuffle: bool = True) -> grain.MapDataset:
  """``examples`` in a seeded order that differs every epoch, repeated ``epochs`` times.

  ``epochs=None`` repeats forever. The result is random-access (``ds[i]``) and deterministic: the
  same seed gives the same sequence on every machine. (grain's index shuffle costs about
  ``50 / len(examples)`` ms per element: negligible from a few hundred examples on.)
  """
  if epochs is not None and epochs < 1:
    raise ValueError(f"epochs={epochs} must be >= 1 (or None for endless)")
  if not len(examples):
    raise ValueError("cannot build a dataset from zero examples")
  ds = grain.MapDataset.source(examples)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  return ds.repeat(epochs).map(_copy)


def train_iterator(examples: Sequence[dict], seed: int, epochs: int | None = 1,
                   shuffle: bool = True) -> grain.DatasetIterator:
  """An iterator over :func:`train_dataset` with ``get_state()`` / ``set_state()`` for resuming."""
  options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # rows are in memory already
  return iter(train_dataset(examples, seed, epochs, shuffle).to_iter_dataset(options))
