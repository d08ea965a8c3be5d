"""``areal_jax.export``: run checkpoints (full-weight and LoRA) as Hugging Face directories.

The checkpoints are a learner's state after a train step on the ``tiny`` model, saved by the run's
``Checkpointer``: the same files a run writes, without its sampler."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax import config as config_lib
from areal_jax import export, models
from areal_jax.evaluate import restore_adapters, restore_params
from areal_jax.learner import Learner
from areal_jax.models import hf_export, lora
from areal_jax.runtime.checkpoint import Checkpointer

sys.path.insert(0, str(pathlib.Path(__file__).parent / "learner"))
from learner_helpers import actor, batch, mesh  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = f"{ROOT}/configs/gsm8k.py:tiny"
LORA = {"actor.lora.rank": 4, "actor.lora.alpha": 8.0,
        "actor.lora.targets": ("q_proj", "v_proj", "down_proj")}
TOKENS = np.array([[1, 5, 9, 30, 2, 7, 11, 3], [4, 4, 8, 15, 16, 23, 29, 31]], np.int32)


def run_config(**overrides):
  c = config_lib.load(TINY)
  for key, value in overrides.items():
    config_lib.override(c, key, value)
  return c


def save_run(workdir, learner, step):
  Checkpointer(str(workdir), keep=3).save(step, learner.state, {"version": step})


def files(path):
  return {p.name: p.read_bytes() for p in sorted(pathlib.Path(path).iterdir())}


def torch_logits(path, tokens=TOKENS):
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  """(workdir sharded over 4 devices, its unsharded copy): a full-weight learner after 1 and 2
  train steps on a mesh of fsdp=4, checkpointed at both; the copy holds step 2's state on one
  device."""
  base = tmp_path_factory.mktemp("full")
  learner = Learner(models.load("tiny")[0], actor(lr=1e-2), mesh(4), temperature=1.0)
  for step in (1, 2):
    learner.train_step(*batch(step))
    save_run(base / "fsdp", learner, step)
  assert len(learner.state["params"]["embed"].sharding.device_set) == 4
  single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  Checkpointer(str(base / "single"), keep=1).save(
      2, jax.device_put(learner.state, single), {"version": 2})
  return base / "fsdp", base / "single"


@pytest.mark.slow
def test_full_weight_run_exports_a_model_transformers_and_model_source_load(full_run, tmp_path):
  workdir, single = full_run
  paths = export.export(run_config(), str(workdir), str(tmp_path / "hf"))
  assert paths == {"model": str(tmp_path / "hf")}
  names = set(os.listdir(tmp_path / "hf"))
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "generation_config.json", "chat_template.jinja"} <= names
  policy = models.load("tiny")[0]
  restore_params(str(workdir / "checkpoints" / "2"), policy)  # the latest step
  ours = np.asarray(policy(TOKENS))
  np.testing.assert_allclose(torch_logits(tmp_path / "hf"), ours, rtol=0, atol=1e-4)
  loaded, tokenizer = models.load(str(tmp_path / "hf"))  # model.source=<dir>
  assert tokenizer.vocab_size == policy.cfg.vocab_size
  for x, y in zip(jax.tree.leaves(nnx.state(loaded, nnx.Param)),
                  jax.tree.leaves(nnx.state(policy, nnx.Param))):
    np.testing.assert_array_equal(x, y)
  # the same weights saved unsharded export the same bytes
  export.export(run_config(), str(single), str(tmp_path / "hf_single"))
  assert files(tmp_path / "hf_single") == files(tmp_path / "hf")


def test_steps_shards_and_dtypes(full_run, tmp_path):
  workdir, _ = full_run
  export.export(run_config(), str(workdir), str(tmp_path / "one"), step=1)
  policy = models.load("tiny")[0]
  restore_params(str(workdir / "checkpoints" / "1"), policy)
  loaded = models.load(str(tmp_path / "one"))[0]
  np.testing.assert_array_equal(loaded.layers[0].mlp.up[...], policy.layers[0].mlp.up[...])
  # shards of at most 50 kB (the embedding, 66 kB, alone in one) with an index
  export.export(run_config(), str(workdir), str(tmp_path / "sharded"), max_shard_size="50kB",
                step=1)
  shards = sorted(n for n in os.listdir(tmp_path / "sharded") if n.endswith(".safetensors"))
  assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(tmp_path / "sharded")
  sizes = [os.path.getsize(tmp_path / "sharded" / n) for n in shards]
  assert sorted(sizes)[-2] < 51_000
  resharded = models.load(str(tmp_path / "sharded"))[0]
  for x, y in zip(jax.tree.leaves(nnx.state(resharded, nnx.Param)),
                  jax.tree.leaves(nnx.state(loaded, nnx.Param))):
    np.testing.assert_array_equal(x, y)
  export.export(run_config(), str(workdir), str(tmp_path / "bf16"), dtype="bfloat16", step=1)
  hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path / "bf16")
  assert str(hf_cfg.dtype if hasattr(hf_cfg, "dtype") else hf_cfg.torch_dtype).endswith("bfloat16")
  assert os.path.getsize(tmp_path / "bf16" / "model.safetensors") < 0.6 * os.path.getsize(
      tmp_path / "one" / "model.safetensors")
  half = models.load(str(tmp_path / "bf16"))[0]
  np.testing.assert_allclose(half.embed[...], policy.embed[...], rtol=1e-2, atol=1e-6)
  # the default dtype is the model source's: a Hugging Face source declaring bfloat16 exports it
  assert hf_export.source_dtype("tiny") == "float32"
  assert hf_export.source_dtype(str(tmp_path / "bf16")) == "bfloat16"


@pytest.mark.slow
def test_lora_run_exports_adapters_and_a_merged_model(tmp_path):
  opts = actor(lr=1e-2)
  opts.lora.rank, opts.lora.alpha, opts.lora.targets = 4, 8.0, LORA["actor.lora.targets"]
  learner = Learner(models.load("tiny")[0], opts, mesh(2), temperature=1.0)
  learner.train_step(*batch(3))
  save_run(tmp_path / "run", learner, 1)
  config = run_config(**LORA)
  paths = export.export(config, str(tmp_path / "run"), str(tmp_path / "peft"),
                        str(tmp_path / "merged"))
  assert set(paths) == {"adapter", "merged"}
  base = models.load("tiny")[0]
  lcfg = lora.LoraConfig.from_config(config.actor.lora)
  adapters = restore_adapters(str(tmp_path / "run" / "checkpoints" / "1"), base, lcfg)
  assert np.abs(np.asarray(adapters["layers"][0]["attn"]["q"]["b"])).max() > 0
  ours = np.asarray(lora.merged_model(base, adapters, lcfg)(TOKENS))
  np.testing.assert_allclose(torch_logits(tmp_path / "merged"), ours, rtol=0, atol=1e-4)
  back, _ = lora.load_peft(paths["adapter"], nnx.to_pure_dict(nnx.state(base, nnx.Param)))
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(x, y)


def test_what_cannot_be_exported_is_named(full_run, tmp_path):
  workdir, _ = full_run
  with pytest.raises(models.CheckpointError, match=r"--step=7: .* holds no finished checkpoint "
                     r"of that step; its steps: \[1, 2\]"):
    export.export(run_config(), str(workdir), str(tmp_path / "x"), step=7)
  with pytest.raises(models.CheckpointError, match="is checkpoint step 2, not --step=1"):
    export.export(run_config(), str(workdir / "checkpoints" / "2"), str(tmp_path / "x"), step=1)
  with pytest.raises(config_lib.ConfigError, match="--merged is for LoRA runs"):
    export.export(run_config(), str(workdir), str(tmp_path / "x"), str(tmp_path / "m"))
  with pytest.raises(config_lib.ConfigError, match="--max_shard_size=5 apples"):
    export.export(run_config(), str(workdir), str(tmp_path / "x"), max_shard_size="5 apples")
  with pytest.raises(models.CheckpointError, match="do not fit the model of config.model.source"):
    export.export(run_config(**{"model.source": "small"}), str(workdir), str(tmp_path / "x"))
  assert not (tmp_path / "x").exists()
  assert export.parse_size("5GB") == 5 * 10**9 and export.parse_size("2GiB") == 2 << 30


@pytest.mark.slow
def test_the_command_line_exports_and_names_a_missing_step(full_run, tmp_path):
  workdir, _ = full_run
  cmd = [sys.executable, "-m", "areal_jax.export", f"--config={TINY}", f"--checkpoint={workdir}",
         f"--output={tmp_path / 'hf'}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd + ["--step=9"], capture_output=True, text=True, cwd=ROOT, env=env,
                        check=False)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith("error: --step=9: ")
  proc = subprocess.run(cmd + ["--dtype=bfloat16"], capture_output=True, text=True, cwd=ROOT,
                        env=env, check=False)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == f"model: {tmp_path / 'hf'}"
