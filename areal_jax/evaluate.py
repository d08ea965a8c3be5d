"""Evaluates a model on its task's test split: greedy pass@1 and, optionally, sampled mean@k.

  python -m areal_jax.evaluate --config=configs/gsm8k.py:tiny --checkpoint=/tmp/gsm8k_tiny
  python -m areal_jax.evaluate --config=configs/gsm8k.py:smollm --config.train.eval_size=200 \
      --config.train.eval_samples=4 --output=/tmp/smollm_eval.json

``--checkpoint`` is one of
  * a run workdir: its latest finished checkpoint under ``<workdir>/checkpoints``;
  * one checkpoint step of a run, ``<workdir>/checkpoints/<step>``;
  * a Hugging Face model directory (``config.json`` and safetensors, e.g. from ``models.save_hf``);
  * nothing: ``config.model.source`` as it is (the starting model of a run).
A run checkpoint only holds parameters, so the architecture and tokenizer come from
``config.model.source``: pass the config (and preset) the run was trained with.

The first ``train.eval_size`` test examples are decoded greedily (pass@1) and, when
``train.eval_samples`` k > 1, sampled k times at ``train.eval_temperature`` (mean@k: the mean
reward over all k x n completions). Generation goes through the same path as evaluation during
training (the rollout engine of ``rollout.backend`` on the sampler mesh, a ``RolloutController``
without training data, ``trainer.evaluate_groups``). The results JSON (``--output``, default
``eval_results.json`` in the current directory) holds the accuracies, n, k, what was evaluated, the
config, timings and one record per example (id, question, reference and extracted answers,
completions, rewards).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from fractions import Fraction
from typing import Any, TextIO

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from areal_jax import cli
from areal_jax import config as config_lib
from areal_jax import models, tasks, workflows
from areal_jax.models import lora as lora_lib
from areal_jax.rollout_api import SamplingParams
from areal_jax.runtime import engines, meshes, trainer, weight_transfer
from areal_jax.runtime.controller import RolloutController
from areal_jax.runtime.rewards import RewardPool
from areal_jax.runtime.staleness import StalenessController
from areal_jax.tasks import reward as reward_lib

RESULTS_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """What to evaluate. ``kind``: "source" (``config.model.source``), "hf" or "run_checkpoint"."""

  kind: str
  path: str  # the model source, the Hugging Face dir or the checkpoint step dir
  step: int | None = None  # the run checkpoint's step (policy version)


def resolve_checkpoint(checkpoint: str, model_source: str) -> ModelSpec:
  """Classifies ``--checkpoint`` (see the module docstring); fails naming what is missing."""
  if not checkpoint:
    return ModelSpec("source", model_source)
  path = os.path.abspath(os.path.expanduser(checkpoint))
  if not os.path.exists(path):
    raise models.CheckpointError(f"--checkpoint={checkpoint}: no such file or directory")
  if not os.path.isdir(path):
    raise models.CheckpointError(f"--checkpoint={checkpoint} is a file; expected a run workdir, a "
                                 "checkpoint step directory or a Hugging Face model directory")
  ckpt_dir = os.path.join(path, "checkpoints")
  if os.path.isdir(ckpt_dir):  # a run workdir (it also holds a config.json: check this first)
    steps = weight_transfer.list_versions(ckpt_dir)  # finished (committed) steps only
    if not steps:
      raise models.CheckpointError(f"{ckpt_dir} holds no finished checkpoint (no <step>/"
                                   f"{weight_transfer.COMMIT_FILE}); has the run saved one yet?")
    return ModelSpec("run_checkpoint", os.path.join(ckpt_dir, str(steps[-1])), steps[-1])
  name = os.path.basename(path)
  if name.isdigit() and os.path.isdir(os.path.join(path, "state")):
    return ModelSpec("run_checkpoint", path, int(name))
  files = os.listdir(path)
  if "config.json" in files and any(f.endswith(".safetensors") for f in files):
    return ModelSpec("hf", path)
  raise models.CheckpointError(
      f"--checkpoint={checkpoint} is neither a run workdir (no checkpoints/ in it), a checkpoint "
      "step (<workdir>/checkpoints/<step> with a state/ item) nor a Hugging Face model directory "
      "(config.json and *.safetensors)")


def key_name(path) -> str:
  """A pytree path as a dotted name (``layers.0.attn.q``), as checkpoint metadata is compared."""
  return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def restore_params(step_dir: str, model, mesh=None) -> None:
  """Loads the parameters of run checkpoint ``step_dir`` into ``model`` (in place).

  The checkpoint's ``state`` item is the learner's state pytree (``Learner.state``:
  ``{"params", "opt", "step", "version"}``); only ``params`` is read (no optimizer state). The
  parameters are placed with the sharding ``model``'s logical axes give on ``mesh`` (default: the
  first device).
  """
  state_dir = os.path.join(step_dir, "state")
  if not os.path.isdir(state_dir):
    raise models.CheckpointError(f"{step_dir}: no 'state' item (is it a run checkpoint step?)")
  handler = ocp.PyTreeCheckpointHandler()  # item-level metadata: no step metadata file wanted
  try:
    tree = handler.metadata(epath.Path(state_dir))
  finally:
    handler.close()
  if "params" not in tree:
    raise KeyError(f"{state_dir}: the checkpointed state has no 'params' (keys: {sorted(tree)}); "
                   "expected the learner's state layout")
  params = nnx.state(model, nnx.Param)
  expected = {key_name(p): x.shape
              for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]}
  found = {key_name(p): tuple(m.shape)
           for p, m in jax.tree_util.tree_flatten_with_path(tree["params"])[0]}
  problems = sorted(set(expected) ^ set(found))
  problems += [f"{k}: checkpoint {found[k]} vs model {expected[k]}"
               for k in sorted(set(expected) & set(found)) if found[k] != expected[k]]
  if problems:
    raise models.CheckpointError(f"{state_dir}: the checkpointed params do not fit the model of "
                                 f"config.model.source (pass the run's config): {problems[:8]}")
  if mesh is None:
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: single, nnx.to_pure_dict(params))
  else:
    shardings = weight_transfer.target_shardings(params, mesh)
  target = {"params": weight_transfer.abstract_params(params, shardings)}
  restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
      partial_restore=True))
  nnx.replace_by_pure_dict(params, restored["params"])
  nnx.update(model, params)


def restore_adapters(step_dir: str, model, lcfg: lora_lib.LoraConfig) -> dict:
  """The LoRA adapters (``Learner.state["params"]`` of a run with ``actor.lora``) of run checkpoint
  ``step_dir``, on the first device, for the base ``model``."""
  state_dir = os.path.join(step_dir, "state")
  if not os.path.isdir(state_dir):
    raise models.CheckpointError(f"{step_dir}: no 'state' item (is it a run checkpoint step?)")
  base = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  shapes = jax.eval_shape(lambda: lora_lib.init_adapters(base, lcfg, jax.random.key(0)))
  single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {"params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=single), shapes)}
  try:
    restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  except (ValueError, KeyError) as e:
    raise models.CheckpointError(
        f"{state_dir}: the checkpoint does not hold LoRA adapters of actor.lora (rank "
        f"{lcfg.rank}, targets {list(lcfg.targets)}) for config.model.source (pass the run's "
        f"config): {e}") from e
  return restored["params"]


def _fraction_text(value: Fraction | None) -> str | None:
  if value is None:
    return None
  return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _completion(tokenizer, sample, reward: float) -> dict:

  text = tokenizer.decode(sample.tokens)
  return dict(completion=text, extracted=_fraction_text(reward_lib.extract_answer(text)),
              reward=float(reward), finish_reason=sample.finish_reason, num_tokens=len(sample.tokens))


def example_records(greedy, sampled, tokenizer) -> list[dict]:
  """One record per test example from the scored groups of ``trainer.evaluate_groups``.

  ``extracted`` is the final answer the GSM8K-style extractor reads from a completion (None when
  it finds none); ``correct`` is the greedy reward > 0.5, the test of pass@1.
  """

  records = []
  for i, group in enumerate(greedy):
    ex = group.example
    reference = ex.get("answer")
    rec = dict(id=ex.get("id", i), question=ex.get("question"),
               reference=_fraction_text(reward_lib.reference_answer(reference))
               if isinstance(reference, str) else None,
               greedy=_completion(tokenizer, group.samples[0], group.rewards[0]))
    rec["reward"] = rec["greedy"]["reward"]
    rec["correct"] = rec["reward"] > 0.5
    if sampled:
      group_k = sampled[i]
      rec["samples"] = [_completion(tokenizer, s, r) for s, r in zip(group_k.samples, group_k.rewards)]
      rec["sampled_reward_mean"] = sum(r > 0.5 for r in group_k.rewards) / len(group_k.rewards)
    records.append(rec)
  return records


class _Progress:
  """Prints ``greedy: 12/64 examples (3.1 s)`` lines, at most one a second per phase."""

  def __init__(self, stream: TextIO | None):
    self.stream, self._t0, self._last = stream, time.time(), {}

  def __call__(self, phase: str, done: int, total: int) -> None:
    now = time.time()
    if self.stream is None or (done < total and now - self._last.get(phase, 0.0) < 1.0):
      return
    self._last[phase] = now
    print(f"  {phase}: {done}/{total} examples ({now - self._t0:.1f} s)", file=self.stream, flush=True)


def evaluate(config, checkpoint: str = "", *, config_name: str = "", output: str | None = None,
             stream: TextIO | None | str = "stdout") -> dict[str, Any]:
  """Evaluates ``checkpoint`` (see the module docstring) under ``config``; returns the results.

  Writes them as JSON to ``output`` when given. Progress and a summary go to ``stream`` (the
  current ``sys.stdout`` by default; None: silent).
  """
  if stream == "stdout":
    stream = sys.stdout
  say = (lambda msg: print(msg, file=stream, flush=True)) if stream is not None else (lambda msg: None)
  t_start = time.time()
  config_lib.validate(config, jax.device_count())
  c_roll, c_train = config.rollout, config.train
  if c_train.eval_size < 1:
    raise config_lib.ConfigError(f"train.eval_size={c_train.eval_size} must be >= 1")
  if c_train.eval_samples < 1:
    raise config_lib.ConfigError(f"train.eval_samples={c_train.eval_samples} must be >= 1")
  if c_train.eval_samples > 1 and c_train.eval_temperature <= 0:
    raise config_lib.ConfigError(
        f"train.eval_temperature={c_train.eval_temperature} must be > 0 for mean@k")
  spec = resolve_checkpoint(checkpoint, config.model.source)
  _, sampler_mesh = meshes.build(config.mesh)

  say(f"loading {spec.kind} {spec.path}" + (f" (step {spec.step})" if spec.step is not None else ""))
  source = config.model.source if spec.kind == "run_checkpoint" else spec.path
  model, tokenizer = models.load(source, dtype=config.model.dtype, seed=config.seed)
  lcfg = lora_lib.LoraConfig.from_config(config.actor.lora)
  if spec.kind == "run_checkpoint" and lcfg is not None:  # a LoRA run checkpoints its adapters
    model = lora_lib.merged_model(model, restore_adapters(spec.path, model, lcfg), lcfg)
  elif spec.kind == "run_checkpoint":
    restore_params(spec.path, model, sampler_mesh)
  task = tasks.get_task(config.task)
  load_s = time.time() - t_start

  engine = engines.build(config, model, tokenizer, sampler_mesh)
  del model  # (the engine holds its own copy of the weights, in the layout its programs read)
  rewards = RewardPool(task.reward_fn, c_roll.reward_workers, c_roll.reward_timeout_s)
  controller = RolloutController(
      engine, task, tokenizer, StalenessController(1, 0), iter(()), rewards, n_samples=1,
      params=SamplingParams(max_new_tokens=c_roll.max_new_tokens), max_prompt_len=c_roll.max_prompt_len,
      filter_uniform_groups=False, seed=config.seed,
      workflow=workflows.get(c_roll.workflow, config))  # multi-turn configs: episodes, as in training
  controller.pause_admission()  # no training data: evaluation groups only
  n = len(task.test_examples(c_train.eval_size))
  say(f"evaluating on {n} {task.name} test examples: greedy pass@1"
      + (f", mean@{c_train.eval_samples} at temperature {c_train.eval_temperature}"
         if c_train.eval_samples > 1 else ""))
  t_eval = time.time()
  engine.start()
  controller.start()
  try:
    metrics, greedy, sampled = trainer.evaluate_groups(controller, task, c_train,
                                                       progress=_Progress(stream))
  finally:
    controller.stop()
    engine.stop()
    rewards.close()
  eval_s = time.time() - t_eval

  k = c_train.eval_samples
  results = {
      "results_version": RESULTS_VERSION,
      "config": config_name,
      "task": task.name,
      "model": dict(kind=spec.kind, path=spec.path, step=spec.step, model_source=config.model.source,
                    dtype=config.model.dtype),
      "n": n,
      "k": k,
      "pass@1": metrics["eval_accuracy"],
      "mean@k": metrics.get(f"eval_mean@{k}") if k > 1 else None,
      "eval_temperature": c_train.eval_temperature if k > 1 else None,
      "max_new_tokens": c_roll.max_new_tokens,
      "seconds": time.time() - t_start,
      "load_seconds": load_s,
      "eval_seconds": eval_s,
      "records": example_records(greedy, sampled, tokenizer),
  }
  say(summary(results))
  if output:
    write_results(results, output)
    say(f"results: {os.path.abspath(output)}")
  return results


def summary(results: dict) -> str:
  """A few lines for the terminal."""
  what = results["model"]["path"] + (f" (step {results['model']['step']})"
                                     if results["model"]["step"] is not None else "")
  lines = [f"{results['task']} test, n={results['n']}: {what}",
           f"  greedy pass@1 = {results['pass@1']:.4f}"]
  if results["mean@k"] is not None:
    lines.append(f"  mean@{results['k']} = {results['mean@k']:.4f} (temperature {results['eval_temperature']})")
  lines.append(f"  {results['seconds']:.1f} s ({results['eval_seconds']:.1f} s generating and scoring)")
  return "\n".join(lines)


def write_results(results: dict, path: str) -> None:
  """Writes ``results`` as JSON, atomically (a temporary file renamed into place)."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  os.replace(tmp, path)


def main(argv) -> None:
  if len(argv) > 1:
    raise SystemExit(f"error: unexpected arguments {argv[1:]}")
  cli.set_up_logging()  # the results are printed; Orbax logs every restore at INFO
  name = config_flags.get_config_filename(flags.FLAGS["config"])  # path[:preset] as given
  with cli.reported_faults(quiet_exit=True):  # what to fix, in one line
    evaluate(_CONFIG.value, _CHECKPOINT.value, config_name=name,
             output=_OUTPUT.value or "eval_results.json")


if __name__ == "__main__":
  # On a CPU-only host, expose 8 virtual devices as launch.py does, so the config's meshes fit
  # (read when JAX first touches a backend, which none of the imports above does).
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  from absl import app, flags
  from ml_collections import config_flags

  # Flags are defined here, not at import, so importing this module never defines --config.
  _CONFIG = config_flags.DEFINE_config_file("config", None, "path/to/config.py[:preset]")
  _CHECKPOINT = flags.DEFINE_string(
      "checkpoint", "", "a run workdir, <workdir>/checkpoints/<step>, or a Hugging Face model dir; "
      "empty: config.model.source as is")
  _OUTPUT = flags.DEFINE_string("output", "", "results JSON path (default: ./eval_results.json)")
  flags.mark_flags_as_required(["config"])
  config_lib.check_overrides(sys.argv)
  app.run(main)
