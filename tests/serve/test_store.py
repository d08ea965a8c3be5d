"""The turn store: committed turns are visible to other connections at once, turn indices per
session, judgement and training marks, and the rollback a trainer restart relies on."""

import threading

import pytest

from areal_jax.serve.store import TurnStore


def _row(rid="r1", candidate=0, tokens=(5, 6)):
  return dict(request_id=rid, candidate=candidate, messages=[{"role": "user", "content": "hi"}],
              prompt_tokens=[1, 2, 3], completion_tokens=list(tokens), logprobs=[-0.5] * len(tokens),
              versions=[0] * len(tokens), completion_text="ok", finish_reason="eos", temperature=0.7)


def test_committed_turn_survives_reopen_and_other_connections(tmp_path):
  path = str(tmp_path / "turns.sqlite")
  store = TurnStore(path)
  ids, index = store.add_turns("s1", [_row()])
  assert index == 0
  seen = {}
  t = threading.Thread(target=lambda: seen.update(row=TurnStore(path).get(ids[0])))
  t.start()
  t.join()
  assert seen["row"]["completion_tokens"] == [5, 6]
  assert seen["row"]["logprobs"] == [-0.5, -0.5]
  store.close()
  reopened = TurnStore(path)
  assert reopened.get(ids[0])["messages"] == [{"role": "user", "content": "hi"}]


def test_turn_indices_per_session_and_candidates(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  _, a = store.add_turns("s1", [_row("r1", 0), _row("r1", 1)])
  _, b = store.add_turns("s1", [_row("r2")])
  _, c = store.add_turns("s2", [_row("r3")])
  assert (a, b, c) == (0, 1, 0)
  assert store.next_turn("s1", 0)["request_id"] == "r2"
  assert store.next_turn("s1", 1) is None
  assert [r["candidate"] for r in store.session("s1")] == [0, 1, 0]


def test_rollback_after_undoes_later_steps_only(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  ids = [store.add_turns(f"s{i}", [_row(f"r{i}")])[0][0] for i in range(4)]
  store.set_judgements([(i, "judged", 1.0) for i in ids])
  store.mark(ids[:2], "trained", 1)
  store.mark(ids[2:], "trained", 2)
  assert store.rollback_after(1) == 2
  assert [r["id"] for r in store.trainable(10)] == ids[2:]
  counts = store.counts()
  assert counts["train_status.trained"] == 2 and counts["train_status.new"] == 2


def test_judgement_is_set_once(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  (tid,), _ = store.add_turns("s", [_row()])
  store.set_judgements([(tid, "judged", 1.0)])
  store.set_judgements([(tid, "judged", 0.0)])  # a second judge run does not overwrite
  assert store.get(tid)["score"] == 1.0


def test_a_failed_insert_leaves_nothing(tmp_path):
  store = TurnStore(str(tmp_path / "t.sqlite"))
  bad = _row("r2")
  del bad["completion_text"]
  with pytest.raises(KeyError):
    store.add_turns("s", [_row("r1"), bad])
  assert store.counts()["turns"] == 0
