"""Config tree: presets load and validate, bad settings and unknown keys fail with clear messages."""

import pathlib

import pytest

from areal_jax import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted(str(p) for p in (ROOT / "configs").glob("*.py"))


def presets(path):
  text = pathlib.Path(path).read_text()
  return ["default"] + [p for p in ("tiny", "smollm", "demo", "qwen7b", "qwen3", "qwen3_lora",
                                     "qwen3_32k_v5p", "qwen3_32k_h100")
                        if f'"{p}"' in text]


@pytest.mark.parametrize("spec", [f"{p}:{s}" for p in CONFIGS for s in presets(p)])
def test_every_preset_loads_and_validates(spec):
  c = config_lib.load(spec)
  config_lib.validate(c, n_devices=8)
  with pytest.raises(AttributeError):
    c.actor.not_a_key = 1  # locked


@pytest.mark.parametrize("spec", [f"{p}:tiny" for p in CONFIGS if "tiny" in presets(p)])
def test_tiny_presets_prompts_fit_the_prompt_budget(spec):
  """The tiny model's byte tokenizer makes long prompts: a preset must admit them."""
  from areal_jax import models, tasks

  c = config_lib.load(spec)
  task, tokenizer = tasks.get_task(c.task), models.byte_tokenizer()
  it = task.train_iterator(seed=0, epochs=1)
  lengths = [len(task.prompt_ids(example, tokenizer)) for _, example in zip(range(64), it)]
  assert max(lengths) <= c.rollout.max_prompt_len, (spec, max(lengths))


def test_unknown_preset_is_an_error():
  with pytest.raises(ValueError, match="unknown preset"):
    config_lib.load(f"{CONFIGS[0]}:nope")


def test_decoupled_loss_requires_recomputed_logprobs():
  c = config_lib.base_config()
  c.actor.recompute_logprobs = False
  with pytest.raises(ValueError, match="use_decoupled_loss=True requires actor.recompute_logprobs"):
    config_lib.validate(c)


def test_mesh_needing_more_devices_than_exist():
  c = config_lib.base_config()
  c.mesh.learner_devices, c.mesh.sampler_devices = 6, 4
  # (a ConfigError: launch.py prints it as a message, no traceback; still a ValueError)
  with pytest.raises(config_lib.ConfigError, match="needs 10 devices, but only 8 exist"):
    config_lib.validate(c, n_devices=8)


def test_batch_not_divisible_by_data_parallel_size():
  c = config_lib.base_config()
  c.actor.batch_size, c.rollout.n_samples = 3, 1  # 3 sequences over fsdp=4
  with pytest.raises(ValueError, match="not divisible by the learner's data-parallel size 4"):
    config_lib.validate(c, n_devices=8)


def test_several_errors_are_reported_together():
  c = config_lib.base_config()
  c.rollout.temperature = 0.0
  c.rollout.backend = "sglang"
  with pytest.raises(ValueError) as e:
    config_lib.validate(c)
  assert "rollout.temperature" in str(e.value) and "rollout.backend='sglang'" in str(e.value)


def test_optimizer_and_loss_coefficients_are_checked():
  c = config_lib.base_config()
  c.actor.lr, c.actor.b2, c.actor.eps_clip, c.actor.grad_clip = -1e-5, 1.0, 0.0, -1.0
  c.rollout.top_k = -1
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c)
  lines = str(e.value).splitlines()[1:]
  assert [l.strip() for l in lines] == [
      "actor.lr=-1e-05 must be >= 0", "actor.grad_clip=-1.0 must be >= 0 (0: off)",
      "rollout.top_k=-1 must be >= 0 (0: off)", "actor.eps_clip=0.0 must be > 0",
      "actor.b2=1.0 must be in [0, 1)"]
  c = config_lib.base_config()
  c.actor.lr, c.actor.grad_clip, c.actor.behav_imp_weight_cap, c.actor.b1 = 0.0, 0.0, 0.0, 0.0
  config_lib.validate(c)  # the bounds themselves are settings: no step, no clipping, no cap


def test_keep_checkpoint_every_is_checked():
  c = config_lib.base_config()
  c.train.keep_checkpoint_every = -1
  with pytest.raises(config_lib.ConfigError, match="train.keep_checkpoint_every=-1 must be >= 0"):
    config_lib.validate(c)


@pytest.mark.parametrize("judge", ["votes", "none"])
def test_a_signed_advantage_needs_a_judge_that_scores(judge):
  """serve.advantage maps a rule or model judge's score; with the votes judge (whose verdict is
  the advantage) or none it would do nothing, so it is refused rather than ignored."""
  c = config_lib.base_config()
  c.serve.signal, c.serve.judge, c.serve.advantage = "binary", judge, "signed"
  with pytest.raises(config_lib.ConfigError, match=f"serve.judge='{judge}' gives no such score"):
    config_lib.validate(c)
  for key, value in (("advantage", "baseline"), ("judge", "rule"), ("judge", "model")):
    c.serve.judge, c.serve.advantage = judge, "signed"
    setattr(c.serve, key, value)
    config_lib.validate(c)


def test_a_cut_off_penalty_is_not_negative():
  c = config_lib.base_config()
  c.serve.cut_off_penalty = -0.5
  with pytest.raises(config_lib.ConfigError, match=r"serve.cut_off_penalty=-0.5 must be >= 0"):
    config_lib.validate(c)
  c.serve.cut_off_penalty = 1.0
  config_lib.validate(c)


def test_decode_kernel_keys_are_checked():
  c = config_lib.base_config()
  config_lib.validate(c)  # "auto" and 0 steps per call (per platform) by default
  c.rollout.decode_attention, c.rollout.decode_matmul, c.rollout.steps_per_call = "flash", "mkl", -1
  with pytest.raises(ValueError) as e:
    config_lib.validate(c)
  msg = str(e.value)
  assert "rollout.decode_attention='flash'" in msg and "pallas_gpu" in msg
  assert "rollout.decode_matmul='mkl'" in msg and "rollout.steps_per_call=-1" in msg
  c = config_lib.base_config()
  c.rollout.decode_layers = "loop"
  with pytest.raises(ValueError, match="rollout.decode_layers='loop'"):
    config_lib.validate(c)
  c.rollout.decode_layers, c.rollout.decode_matmul = "scan", "cpu_packed"
  with pytest.raises(ValueError, match="decode_layers='scan' needs XLA matmuls"):
    config_lib.validate(c)
  for matmul in ("xla", "blas"):
    c.rollout.decode_matmul = matmul
    config_lib.validate(c)
  c.rollout.decode_projections = "merged"
  with pytest.raises(ValueError, match="rollout.decode_projections='merged'"):
    config_lib.validate(c)
  c = config_lib.base_config()
  c.rollout.prefill_attention, c.actor.attention = "flash", "xla"
  with pytest.raises(ValueError) as e:
    config_lib.validate(c)
  assert "rollout.prefill_attention='flash'" in str(e.value) and "pallas_tpu" in str(e.value)
  assert "actor.attention='xla'" in str(e.value)
  c.rollout.prefill_attention, c.actor.attention = "pallas_gpu", "dense"
  config_lib.validate(c)
  c.rollout.weight_swap = "later"
  with pytest.raises(ValueError, match="rollout.weight_swap='later' is not one of"):
    config_lib.validate(c)
  for swap in ("auto", "overlap", "pause"):
    c.rollout.weight_swap = swap
    config_lib.validate(c)


def test_vllm_settings_are_checked_before_anything_loads():
  c = config_lib.base_config()
  c.rollout.vllm.dtype, c.rollout.vllm.mode = "fp8", "remote"
  c.rollout.vllm.gpu_memory_utilization = 1.2
  with pytest.raises(ValueError) as e:
    config_lib.validate(c)
  for key in ("rollout.vllm.dtype='fp8'", "rollout.vllm.mode='remote'",
              "rollout.vllm.gpu_memory_utilization=1.2"):
    assert key in str(e.value)
  c.rollout.vllm.dtype, c.rollout.vllm.mode = "bfloat16", "server"
  c.rollout.vllm.gpu_memory_utilization = 0.5
  config_lib.validate(c)


def test_paged_cache_keys_are_checked():
  c = config_lib.base_config()
  c.rollout.kv_pages, c.rollout.page_size = 40, 16  # 640 positions: a sequence needs 512 + 256
  with pytest.raises(ValueError, match="rollout.kv_pages=40 pages of rollout.page_size=16 "
                                       "positions cannot hold one sequence of 768"):
    config_lib.validate(c)
  for layers in ("auto", "unrolled", "scan"):  # a paged cache runs with the layers either way
    c.rollout.kv_pages, c.rollout.decode_layers = 64, layers
    config_lib.validate(c)
  c.rollout.kv_pages = -2
  with pytest.raises(ValueError, match="rollout.kv_pages=-2 must be >= -1"):
    config_lib.validate(c)


def test_unknown_override_names_the_nearby_keys():
  spec = f"{CONFIGS[0]}:tiny"
  with pytest.raises(SystemExit) as e:
    config_lib.check_overrides([f"--config={spec}", "--config.actor.lrr=1e-6"])
  msg = str(e.value)
  assert "actor.lrr" in msg and "Did you mean lr" in msg and "eps_clip" in msg
  config_lib.check_overrides([f"--config={spec}", "--config.actor.lr=1e-6"])  # a real key passes


def test_a_config_file_or_preset_that_is_not_there_is_named_in_one_line(tmp_path):
  missing = tmp_path / "nope.py"
  with pytest.raises(SystemExit, match=f"error: --config={missing}: no such file"):
    config_lib.check_overrides([f"--config={missing}"])
  with pytest.raises(SystemExit, match=r"unknown preset 'tinyy' for configs/gsm8k.py: default, tiny"):
    config_lib.check_overrides([f"--config={ROOT}/configs/gsm8k.py:tinyy", "--config.actor.lr=1e-6"])


def test_mesh_sizes_resolves_minus_one():
  assert config_lib.mesh_sizes({"data": -1, "fsdp": 2, "tensor": 1}, 8, "m") == dict(data=4, fsdp=2, tensor=1)
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    config_lib.mesh_sizes({"data": -1, "fsdp": -1}, 8, "m")


def test_learner_memory_settings_are_checked():
  c = config_lib.base_config()
  c.actor.remat, c.actor.logits_chunk = "some", -1
  c.mesh.memory_fraction, c.mesh.device_memory_gib = 1.5, -2.0
  c.rollout.max_prefill_tokens = -1
  with pytest.raises(ValueError) as e:
    config_lib.validate(c)
  for key in ("actor.remat", "actor.logits_chunk", "mesh.memory_fraction", "mesh.device_memory_gib",
              "rollout.max_prefill_tokens"):
    assert key in str(e.value)
