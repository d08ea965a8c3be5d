"""Seconds the serve recipe's engine warm-up spends on the continuation programs (serve.keep_turns)
against the rest: one warm-up with continuations, each program's time from the progress ticks.

  PYTHONPATH=. python bench/results/cpu-serve-follow-ups-2026-11-30-s47/warmup_time.py
"""
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from areal_jax import config as config_lib  # noqa: E402
from areal_jax.runtime import engines, meshes, model_source  # noqa: E402

config = config_lib.load("configs/serve_arithmetic.py")
_, sampler_mesh = meshes.build(config.mesh)
model, tokenizer = model_source.load(config)
engine = engines.build(config, model, tokenizer, sampler_mesh,
                       memory_budget=engines.sampler_budget(config, sampler_mesh), keep_turns=True)
engine.tune_launch()
ticks, t0 = [], time.time()
engine.warmup(lambda done, total, what: ticks.append((time.time(), what)), continuations=True)
spent = {"continuation": 0.0, "other": 0.0}
count = {"continuation": 0, "other": 0}
last = t0
for t, what in ticks:
  kind = "continuation" if what.startswith("continuation") else "other"
  spent[kind] += t - last
  count[kind] += 1
  last = t
print(f"warm-up {time.time() - t0:.1f} s: {count['other']} programs in {spent['other']:.1f} s, "
      f"{count['continuation']} continuation programs in {spent['continuation']:.1f} s")
