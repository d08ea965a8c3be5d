"""Readers (JSON lines, Parquet, Arrow), malformed rows, and the resumable grain pipeline."""

import json
import pickle
import sys

import grain
import pytest

from areal_jax.tasks import MalformedRowError, data, get_task
from areal_jax.tasks.gsm8k import validate_row

ROWS = [{"id": f"r{i}", "question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
        for i in range(10)]


def write_jsonl(path, rows, extra_lines=()):
  lines = [json.dumps(r) for r in rows] + list(extra_lines)
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return path


def ids(items):
  return [x["id"] for x in items]


# --- the grain pipeline ---------------------------------------------------------------------------


def test_shuffle_is_deterministic_per_seed():
  a = ids(data.train_iterator(ROWS, seed=3))
  assert a == ids(data.train_iterator(ROWS, seed=3))
  assert sorted(a) == sorted(ids(ROWS)) and a != ids(ROWS)
  assert a != ids(data.train_iterator(ROWS, seed=4))
  assert ids(data.train_iterator(ROWS, seed=3, shuffle=False)) == ids(ROWS)


def test_epochs_are_each_a_permutation_in_a_new_order():
  out = ids(data.train_iterator(ROWS, seed=0, epochs=3))
  assert len(out) == 30
  epochs = [out[i * 10:(i + 1) * 10] for i in range(3)]
  assert all(sorted(e) == sorted(ids(ROWS)) for e in epochs)
  assert len({tuple(e) for e in epochs}) == 3


def test_endless_and_invalid_epochs():
  it = data.train_iterator(ROWS, seed=0, epochs=None)
  assert len([next(it) for _ in range(55)]) == 55
  with pytest.raises(ValueError, match="epochs"):
    data.train_iterator(ROWS, seed=0, epochs=0)
  with pytest.raises(ValueError, match="zero examples"):
    data.train_iterator([], seed=0)


@pytest.mark.parametrize("consumed", [0, 4, 10, 17, 29])
def test_resume_mid_epoch_gives_the_same_continuation(consumed):
  it = data.train_iterator(ROWS, seed=7, epochs=3)
  for _ in range(consumed):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # must survive a JSON checkpoint
  rest = ids(it)
  resumed = data.train_iterator(ROWS, seed=7, epochs=3)
  resumed.set_state(state)
  assert ids(resumed) == rest
  assert len(rest) == 30 - consumed


def test_resume_through_orbax(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  it = data.train_iterator(ROWS, seed=1, epochs=2)
  for _ in range(13):
    next(it)
  ckpt = ocp.Checkpointer(grain.checkpoint.CheckpointHandler())
  ckpt.save(tmp_path / "it", args=grain.checkpoint.CheckpointSave(it))
  resumed = data.train_iterator(ROWS, seed=1, epochs=2)
  ckpt.restore(tmp_path / "it", args=grain.checkpoint.CheckpointRestore(resumed))
  assert ids(resumed) == ids(it)


def test_iterator_hands_out_copies():
  it = data.train_iterator(ROWS, seed=0)
  first = next(it)
  first["question"] = "changed"
  assert all(r["question"] != "changed" for r in ROWS)


def test_task_iterator_is_a_grain_iterator_and_resumes():
  task = get_task({"name": "arithmetic", "num_train": 50, "num_test": 10})
  it = task.train_iterator(seed=5, epochs=2)
  assert isinstance(it, grain.DatasetIterator)
  head = [next(it) for _ in range(20)]
  assert {"id", "question", "answer"} <= set(head[0])
  state = it.get_state()
  rest = ids(it)
  again = get_task({"name": "arithmetic", "num_train": 50, "num_test": 10}).train_iterator(seed=5, epochs=2)
  again.set_state(state)
  assert ids(again) == rest and len(rest) == 80


# --- JSON lines ------------------------------------------------------------------------------------


def test_read_jsonl_and_directories(tmp_path):
  write_jsonl(tmp_path / "a.jsonl", ROWS[:4], extra_lines=["", "   "])  # blank lines are ignored
  (tmp_path / "sub").mkdir()
  write_jsonl(tmp_path / "sub" / "b.jsonl", ROWS[4:])
  (tmp_path / "notes.txt").write_text("not data")
  assert ids(data.read_rows(tmp_path / "a.jsonl", validate_row).rows) == ids(ROWS[:4])
  assert ids(data.read_rows(tmp_path, validate_row).rows) == ids(ROWS)


def test_directory_with_several_splits(tmp_path):
  main = tmp_path / "main"
  main.mkdir()
  write_jsonl(main / "train-00000-of-00002.jsonl", ROWS[:3])
  write_jsonl(main / "train-00001-of-00002.jsonl", ROWS[3:6])
  write_jsonl(main / "test-00000-of-00001.jsonl", ROWS[6:])
  task = get_task({"name": "gsm8k", "train_path": str(tmp_path), "test_path": str(tmp_path)})
  assert ids(task.examples("train")) == ids(ROWS[:6])
  assert ids(task.test_examples()) == ids(ROWS[6:])
  assert len(data.read_rows(tmp_path, validate_row).rows) == 10  # no split asked: everything
  with pytest.raises(FileNotFoundError, match="no 'validation' files"):
    data.data_files(tmp_path, "validation")


def test_path_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="not found"):
    data.read_rows(tmp_path / "missing.jsonl", validate_row)
  with pytest.raises(FileNotFoundError, match="no .jsonl"):
    data.read_rows(tmp_path, validate_row)
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="unsupported data file type '.csv'"):
    data.read_rows(tmp_path / "x.csv", validate_row)


@pytest.mark.parametrize("bad_line,message", [
    ('{"question": "q", "answer": "#### 1"', "invalid JSON"),
    ('["a list"]', "expected a JSON object, got list"),
    ('{"question": "", "answer": "#### 1"}', "'question' must be a non-empty string"),
    ('{"question": "q"}', "'answer' must be a string, got None"),
    ('{"question": "q", "answer": "it is 5"}', "no '#### <number>'"),
    ('{"question": "q", "answer": "#### five"}', "not a number"),
])
def test_malformed_row_names_file_and_line(tmp_path, bad_line, message):
  path = write_jsonl(tmp_path / "train.jsonl", ROWS[:3], extra_lines=[bad_line] + [json.dumps(ROWS[3])])
  with pytest.raises(MalformedRowError, match=message) as info:
    data.read_rows(path, validate_row)
  assert str(info.value).startswith(f"{path}:4: ")
  assert info.value.line == 4 and info.value.path == str(path)


def test_invalid_utf8_names_the_line(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n\xff\xfe\n")
  with pytest.raises(MalformedRowError, match=r":2: not valid UTF-8"):
    data.read_rows(path, validate_row)


def test_skip_malformed_counts(tmp_path):
  path = write_jsonl(tmp_path / "t.jsonl", ROWS[:2], extra_lines=["{oops", '{"question": "q"}', "7"])
  rows = data.read_rows(path, validate_row, skip_malformed=True)
  assert ids(rows.rows) == ids(ROWS[:2])
  assert rows.skipped == 3
  assert rows.skipped_where[0].startswith(f"{path}:3: ")
  write_jsonl(tmp_path / "bad.jsonl", [], extra_lines=["{oops"])
  with pytest.raises(ValueError, match="no usable rows.*1 malformed"):
    data.read_rows(tmp_path / "bad.jsonl", validate_row, skip_malformed=True)


def test_gsm8k_task_from_a_path_with_skipping(tmp_path):
  train = write_jsonl(tmp_path / "train.jsonl", [{k: v for k, v in r.items() if k != "id"} for r in ROWS],
                      extra_lines=["{broken"])
  test = write_jsonl(tmp_path / "test.jsonl", ROWS[:2])
  strict = get_task({"name": "gsm8k", "train_path": str(train), "test_path": str(test)})
  with pytest.raises(MalformedRowError, match=r"train\.jsonl:11: invalid JSON"):
    strict.examples("train")
  task = get_task({"name": "gsm8k", "train_path": str(train), "test_path": str(test),
                   "skip_malformed": True})
  assert len(task.examples("train")) == 10 and task.skipped == {"train": 1}
  assert ids(task.examples("train"))[:2] == ["gsm8k-train-0", "gsm8k-train-1"]  # numbered when no id
  assert ids(task.test_examples()) == ["r0", "r1"]  # ids kept when present
  assert task.skipped == {"train": 1, "test": 0}


def test_shipped_gsm8k():
  task = get_task(None)
  train, test = task.examples("train"), task.test_examples()
  assert (len(train), len(test)) == (7473, 1319)
  assert len(set(ids(train))) == len(train)
  assert ids(task.test_examples(5)) == ids(test[:5])
  assert train[0]["answer"].endswith("#### 72")
  assert all(task.reward(e["answer"], e) == 1.0 for e in test)  # every reference scores itself


def test_task_pickles_without_rows():
  task = get_task({"name": "arithmetic", "num_train": 30, "num_test": 5})
  task.examples("train")
  blob = pickle.dumps(task)
  assert len(blob) < 4000
  clone = pickle.loads(blob)
  assert ids(clone.examples("train")) == ids(task.examples("train"))
  fn = pickle.loads(pickle.dumps(task.reward_fn))
  assert fn("\\boxed{2}", {"answer": "#### 2"}) == 1.0


# --- Parquet / Arrow (Hugging Face datasets stored locally) ---------------------------------------


def test_columnar_files_without_pyarrow_say_how_to_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
  for name in ("train-00000-of-00001.parquet", "data-00000-of-00001.arrow"):
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(ImportError, match="pip install pyarrow"):
      data.read_rows(tmp_path / name, validate_row)


def test_parquet_and_arrow(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.ipc
  import pyarrow.parquet as pq
  bad = {"id": "bad", "question": "q", "answer": "no final answer"}
  table = pa.Table.from_pylist(ROWS[:5] + [bad])
  pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
  with pyarrow.ipc.new_stream(tmp_path / "stream.arrow", table.schema) as w:  # what `datasets` writes
    w.write_table(table)
  with pyarrow.ipc.new_file(tmp_path / "file.arrow", table.schema) as w:
    w.write_table(table)
  for name in ("train-00000-of-00001.parquet", "stream.arrow", "file.arrow"):
    path = tmp_path / name
    with pytest.raises(MalformedRowError, match=r":6 \(row 6\): 'answer' has no"):
      data.read_rows(path, validate_row)
    rows = data.read_rows(path, validate_row, skip_malformed=True)
    assert ids(rows.rows) == ids(ROWS[:5]) and rows.skipped == 1
  task = get_task({"name": "gsm8k", "train_path": str(tmp_path / "train-00000-of-00001.parquet"),
                   "skip_malformed": True})
  assert ids(task.examples("train")) == ids(ROWS[:5])
