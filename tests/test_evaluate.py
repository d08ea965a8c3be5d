"""Standalone evaluation: what ``--checkpoint`` means, restoring a run's parameters, the results
JSON, and whole evaluations of the tiny model from a Hugging Face dir (the CLI) and from a run
checkpoint (the Python API)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from areal_jax import config as config_lib
from areal_jax import evaluate as ev
from areal_jax import models
from areal_jax.rollout_api import Sample
from areal_jax.runtime import meshes, trainer
from areal_jax.runtime.checkpoint import Checkpointer
from areal_jax.runtime.controller import Group

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{ROOT}/configs/gsm8k.py:tiny"
RESULT_KEYS = {"results_version", "config", "task", "model", "n", "k", "pass@1", "mean@k",
               "eval_temperature", "max_new_tokens", "seconds", "load_seconds", "eval_seconds",
               "records"}


def tiny_config(**overrides):
  c = config_lib.load(TINY)
  for key, value in {"train.eval_size": 3, "rollout.max_new_tokens": 12, **overrides}.items():
    config_lib.override(c, key, value)
  return c


def params_of(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def save_run_checkpoint(workdir, step, shift=0.0):
  """A run checkpoint as ``trainer.run`` writes it: the real learner's state pytree + meta."""
  from areal_jax import learner as learner_lib

  c = tiny_config()
  learner_mesh, _ = meshes.build(c.mesh)
  model, _ = models.load("tiny", seed=c.seed)
  learner = learner_lib.Learner(model, c.actor, learner_mesh)
  state = dict(learner.state)
  state["params"] = jax.tree.map(lambda x: x + shift, state["params"])  # tell it from the start
  ckpt = Checkpointer(str(workdir), keep=3)
  ckpt.save(step, state, dict(version=step))
  ckpt.close()
  return jax.tree.map(np.asarray, state["params"])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """(workdir, its saved parameters): a run checkpoint at step 2 whose parameters are the
  learner's initial ones shifted by 0.5 (told apart from a fresh model's), written once for the
  module's tests that restore or evaluate one."""
  workdir = tmp_path_factory.mktemp("run")
  return workdir, save_run_checkpoint(workdir, 2, shift=0.5)


def check_results(results, n, k):
  assert RESULT_KEYS <= set(results)
  assert results["n"] == n and results["k"] == k
  assert len(results["records"]) == n
  assert 0.0 <= results["pass@1"] <= 1.0
  assert results["pass@1"] == pytest.approx(np.mean([r["reward"] for r in results["records"]]))
  for rec in results["records"]:
    assert {"id", "question", "reference", "greedy", "reward", "correct"} <= set(rec)
    assert {"completion", "extracted", "reward", "finish_reason", "num_tokens"} <= set(rec["greedy"])
    assert isinstance(rec["greedy"]["completion"], str)
    assert rec["reference"] is not None  # every GSM8K test row has a numeric answer
  if k > 1:
    assert 0.0 <= results["mean@k"] <= 1.0
    assert all(len(rec["samples"]) == k for rec in results["records"])
    assert results["mean@k"] == pytest.approx(
        np.mean([s["reward"] for rec in results["records"] for s in rec["samples"]]))
  else:
    assert results["mean@k"] is None and "samples" not in results["records"][0]
  assert results["seconds"] > 0


# ---- --checkpoint resolution ---------------------------------------------------------------------

def test_no_checkpoint_is_the_config_model():
  assert ev.resolve_checkpoint("", "tiny") == ev.ModelSpec("source", "tiny")


def test_workdir_resolves_to_its_latest_finished_step(tmp_path):
  for step in (3, 6, 9):
    os.makedirs(tmp_path / "checkpoints" / str(step) / "state")
    if step != 9:  # 9 is unfinished (no commit marker): skipped
      (tmp_path / "checkpoints" / str(step) / "commit_success.txt").write_text("ok")
  os.makedirs(tmp_path / "checkpoints" / "12.orbax-checkpoint-tmp-1")
  (tmp_path / "config.json").write_text("{}")  # a workdir holds the run config too
  spec = ev.resolve_checkpoint(str(tmp_path), "tiny")
  assert spec == ev.ModelSpec("run_checkpoint", str(tmp_path / "checkpoints" / "6"), 6)
  step_dir = str(tmp_path / "checkpoints" / "3")
  assert ev.resolve_checkpoint(step_dir, "tiny") == ev.ModelSpec("run_checkpoint", step_dir, 3)


def test_hf_dir_and_bad_paths(tmp_path):
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text("{}")
  (hf / "model.safetensors").write_bytes(b"")
  assert ev.resolve_checkpoint(str(hf), "tiny") == ev.ModelSpec("hf", str(hf))
  with pytest.raises(models.CheckpointError, match="no such file"):
    ev.resolve_checkpoint(str(tmp_path / "missing"), "tiny")
  with pytest.raises(models.CheckpointError, match="neither a run workdir"):
    ev.resolve_checkpoint(str(tmp_path), "tiny")  # holds hf/, nothing else
  (tmp_path / "file.txt").write_text("x")
  with pytest.raises(models.CheckpointError, match="is a file"):
    ev.resolve_checkpoint(str(tmp_path / "file.txt"), "tiny")
  os.makedirs(tmp_path / "run" / "checkpoints")
  with pytest.raises(models.CheckpointError, match="no finished checkpoint"):
    ev.resolve_checkpoint(str(tmp_path / "run"), "tiny")


# ---- restoring parameters --------------------------------------------------------------------

@pytest.mark.slow
def test_restore_params_reads_the_learner_state_params(run_dir):
  workdir, saved = run_dir
  model, _ = models.load("tiny", seed=123)  # different initial weights: all must be replaced
  _, sampler_mesh = meshes.build(tiny_config().mesh)
  ev.restore_params(str(workdir / "checkpoints" / "2"), model, sampler_mesh)
  got = jax.tree.map(np.asarray, params_of(model))
  assert jax.tree.structure(got) == jax.tree.structure(saved)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(a, b)
  logits = model(np.array([[1, 2, 3]], np.int32))  # the updated model still runs
  assert np.isfinite(np.asarray(logits)).all()

  wrong = models.Transformer(models.ModelConfig(
      arch="llama", vocab_size=259, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
      d_ff=64, tie_embeddings=True), nnx.Rngs(0))
  with pytest.raises(models.CheckpointError, match="do not fit the model"):
    ev.restore_params(str(workdir / "checkpoints" / "2"), wrong)
  with pytest.raises(models.CheckpointError, match="no 'state' item"):
    ev.restore_params(str(workdir), model)


# ---- records and accuracies ----------------------------------------------------------------------

def fake_sample(text, index=0):
  return Sample(group_id=-1, index=index, prompt_tokens=[1], tokens=list(text.encode()),
                logprobs=[0.0] * len(text), versions=[0] * len(text), finish_reason="eos")


class FakeController:
  """Returns pre-scored groups: 'the answer is 18' scores 1, anything else 0."""

  params = ml_collections.ConfigDict(dict(max_new_tokens=8))

  def evaluate(self, examples, k, params, progress=None):
    groups = []
    for i, ex in enumerate(examples):
      texts = [("the answer is 18" if (i + j) % 2 == 0 else "no idea") for j in range(k)]
      groups.append(Group(-1 - i, ex, [fake_sample(t, j) for j, t in enumerate(texts)],
                          [float(t.endswith("18")) for t in texts], -1))
      if progress:
        progress(i + 1, len(examples))
    return groups


def test_records_agree_with_the_accuracies():
  from areal_jax import tasks
  from areal_jax.models import byte_tokenizer

  c = tiny_config(**{"train.eval_size": 5, "train.eval_samples": 3})
  seen = []
  metrics, greedy, sampled = trainer.evaluate_groups(
      FakeController(), tasks.get_task(c.task), c.train, progress=lambda *a: seen.append(a))
  assert seen[-1] == ("sampled", 5, 5) and ("greedy", 5, 5) in seen
  records = ev.example_records(greedy, sampled, byte_tokenizer())
  assert metrics["eval_accuracy"] == pytest.approx(0.6)  # examples 0, 2, 4
  assert metrics["eval_accuracy"] == pytest.approx(np.mean([r["reward"] for r in records]))
  assert [r["correct"] for r in records] == [True, False, True, False, True]
  assert records[0]["greedy"]["extracted"] == "18" and records[1]["greedy"]["extracted"] is None
  assert records[0]["reference"] == "18"  # Janet's ducks
  assert records[0]["id"] == "gsm8k-test-0"
  assert metrics["eval_mean@3"] == pytest.approx(
      np.mean([s["reward"] for r in records for s in r["samples"]]))
  assert [r["sampled_reward_mean"] for r in records][:2] == [pytest.approx(2 / 3), pytest.approx(1 / 3)]


# ---- whole evaluations -------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_evaluates_a_hugging_face_dir(tmp_path):
  model, tokenizer = models.load("tiny", seed=7)
  models.save_hf(model, tokenizer, str(tmp_path / "hf"))
  out = tmp_path / "results.json"
  proc = subprocess.run(
      [sys.executable, "-m", "areal_jax.evaluate", f"--config={TINY}",
       f"--checkpoint={tmp_path / 'hf'}", "--config.train.eval_size=3",
       "--config.rollout.max_new_tokens=12", f"--output={out}"],
      cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "greedy pass@1 =" in proc.stdout and "greedy: 3/3 examples" in proc.stdout
  results = json.loads(out.read_text())
  check_results(results, n=3, k=1)
  assert results["config"] == TINY
  assert results["model"]["kind"] == "hf" and results["model"]["path"] == str(tmp_path / "hf")


def test_cli_rejects_a_misspelt_key(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "areal_jax.evaluate", f"--config={TINY}", "--config.train.eval_sise=3"],
      cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode != 0 and "eval_size" in proc.stderr


@pytest.mark.slow
def test_cli_says_a_model_that_is_not_there_in_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "areal_jax.evaluate", f"--config={TINY}",
       f"--config.model.source={tmp_path / 'missing'}"],
      cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert f"error: model source '{tmp_path / 'missing'}': no such directory" in proc.stderr


@pytest.mark.slow
def test_run_checkpoint_through_the_python_api(run_dir, tmp_path):
  workdir, _ = run_dir
  c = tiny_config(**{"train.eval_samples": 2})
  out = tmp_path / "eval" / "results.json"
  results = ev.evaluate(c, str(workdir), config_name="gsm8k:tiny", output=str(out), stream=None)
  check_results(results, n=3, k=2)
  assert results["model"] == dict(kind="run_checkpoint", path=str(workdir / "checkpoints" / "2"),
                                  step=2, model_source="tiny", dtype="float32")
  assert results["eval_temperature"] == c.train.eval_temperature
  assert json.loads(out.read_text()) == results


@pytest.mark.slow
def test_no_checkpoint_evaluates_the_config_model(tmp_path, capsys):
  c = tiny_config(**{"train.eval_size": 2})
  results = ev.evaluate(c, "", config_name="tiny", output=str(tmp_path / "r.json"))
  check_results(results, n=2, k=1)
  assert results["model"]["kind"] == "source" and results["model"]["path"] == "tiny"
  out = capsys.readouterr().out
  assert "greedy: 2/2 examples" in out and "greedy pass@1 =" in out and "results: " in out
