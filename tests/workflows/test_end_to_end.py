"""A multi-turn run end to end on the tiny model (configs/arithmetic.py:multi_turn_tiny, shortened):
trained trajectories carry their loss masks, environment tokens the version of the turn before
them, and the staleness bound holds per trajectory's oldest token."""

import glob
import json
import os
import pathlib

import pytest

from areal_jax import config as config_lib
from areal_jax.models import byte_tokenizer
from areal_jax.workflows import multi_turn

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_multi_turn_tiny_run(tmp_path):
  from areal_jax.runtime import trainer

  c = config_lib.load(f"{ROOT}/configs/arithmetic.py:multi_turn_tiny")
  for key, value in {"train.total_steps": 2, "train.eval_every": 0, "actor.batch_size": 2,
                     "rollout.n_samples": 2, "rollout.max_new_tokens": 16,
                     "rollout.max_head_offpolicyness": 1, "train.dump_trajectories": True,
                     "train.checkpoint_every": 2}.items():
    config_lib.override(c, key, value)
  row = trainer.run(c, str(tmp_path))
  assert row["step"] == 2 and row["staleness_max"] <= 1 and 1 <= row["turns_mean"] <= 2
  rows = []
  for path in sorted(glob.glob(os.path.join(tmp_path, "trajectories", "step_*.jsonl"))):
    with open(path) as f:
      rows += [json.loads(line) for line in f]
  assert len(rows) == 2 * 2 * 2
  tok = byte_tokenizer()
  inserted = 0
  for s in rows:
    mask, versions = s["loss_mask"], s["versions"]
    assert len(mask) == len(s["tokens"]) == len(versions) == len(s["logprobs"])
    assert 0 <= s["staleness"] == s["trained_at_version"] - min(versions) <= 1
    assert all(lp == 0.0 for lp, m in zip(s["logprobs"], mask) if not m)
    assert all(lp < 0.0 for lp, m in zip(s["logprobs"], mask) if m)
    for i, m in enumerate(mask):
      if not m:  # an inserted token: the version of the token before it
        assert i > 0 and versions[i] == versions[i - 1]
    text = tok.decode([t for t, m in zip(s["tokens"], mask) if not m])
    inserted += multi_turn.FEEDBACK in text
    turns = text.count(multi_turn.FEEDBACK) + 1
    assert s["reward"] == (0.0 if s["reward"] == 0.0 else c.rollout.turn_discount ** (turns - 1))
  assert inserted > 0  # the random tiny model is wrong most of the time: retries happen
