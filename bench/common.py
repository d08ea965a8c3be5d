"""What the benchmarks share: the model shapes they measure, the machine's description, timing, and
the hardware probes (memory read bandwidth, float32 matmul throughput) results are stated against."""

from __future__ import annotations

import ast
import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models import ModelConfig

SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                      n_kv_heads=3, head_dim=64, d_ff=1536, rope_theta=1e5, norm_eps=1e-5)
# The recipes' models (configs/gsm8k.py), for the memory plan on abstract shapes (no weights).
QWEN25_1P5B = ModelConfig(arch="qwen2", vocab_size=151936, d_model=1536, n_layers=28, n_heads=12,
                          n_kv_heads=2, head_dim=128, d_ff=8960, rope_theta=1e6, norm_eps=1e-6,
                          qkv_bias=True, tie_embeddings=True, dtype="bfloat16")
QWEN25_7B = ModelConfig(arch="qwen2", vocab_size=152064, d_model=3584, n_layers=28, n_heads=28,
                        n_kv_heads=4, head_dim=128, d_ff=18944, rope_theta=1e6, qkv_bias=True,
                        tie_embeddings=False, dtype="bfloat16")
QWEN3_1P7B = ModelConfig(arch="qwen3", vocab_size=151936, d_model=2048, n_layers=28, n_heads=16,
                         n_kv_heads=8, head_dim=128, d_ff=6144, rope_theta=1e6, norm_eps=1e-6,
                         qk_norm=True, tie_embeddings=True, dtype="bfloat16")


def override_all(config, items) -> None:
  """``--set KEY=VALUE`` items onto ``config`` (``config.override``: an unknown key fails naming
  the ones close to it), each value a Python literal, else a string."""
  from areal_jax import config as config_lib  # pylint: disable=import-outside-toplevel

  for item in items:
    key, value = item.split("=", 1)
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass
    config_lib.override(config, key, value)


def finish(result: dict, json_path: str | None, t_start: float) -> None:
  """The end of a benchmark: its wall time and the machine's load, then ``result`` as JSON."""
  print(f"bench took {time.perf_counter() - t_start:.0f} s; load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
  if json_path:
    with open(json_path, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {json_path}")


TINY = ModelConfig(arch="llama", vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=16, d_ff=128)


def own_pages(engine) -> dict:
  """A ``DecodeEngine``'s ``pages`` keyword for ``insert`` and ``generate`` where its cache is
  paged (every slot its own pages for all its positions: the pool must hold them, as the pool
  ``kernels.choice.kv_pages`` sizes does), else nothing."""
  if not engine.paged:
    return {}
  n, per = engine.config.num_slots, engine.pages_per_slot
  if engine.config.kv_pages < n * per:
    raise ValueError(f"a pool of {engine.config.kv_pages} pages cannot give {n} slots "
                     f"{per} pages each")
  return {"pages": np.arange(n * per, dtype=np.int32).reshape(n, per)}


def decode_step_cost(cfg: ModelConfig, slots: int, context: int) -> tuple[float, float]:
  """``(bytes, flops)`` one decode step of ``slots`` slots at position ``context`` must move and
  compute: every weight read once in the compute dtype (a tied embedding is the LM head's weight,
  read once) and each slot's KV up to its position; 2 FLOPs per matmul weight and slot plus the
  attention's."""
  n_params = cfg.num_params()
  matmul_params = n_params - cfg.d_model * (2 * cfg.n_layers + 1)  # minus the norm scales
  itemsize = cfg.compute_dtype.itemsize  # weights and cache are held in the compute dtype
  kv_per_token = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * itemsize
  ctx = context + 1
  bytes_step = n_params * itemsize + slots * ctx * kv_per_token
  flops_step = 2 * matmul_params * slots + slots * cfg.n_layers * 4 * ctx * cfg.n_heads * cfg.head_dim
  return bytes_step, flops_step


def machine() -> dict:
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__,
          "devices": f"{len(jax.devices())} x {jax.devices()[0].platform}",
          "device_kind": jax.devices()[0].device_kind,
          "load_avg": os.getloadavg()[0]}


def best_time(fn, *args, reps=5) -> float:
  """Seconds of the fastest of ``reps`` calls of ``fn(*args)``, after one untimed call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return min(times)


def against(us: float, out, base: tuple, nbytes: int, read_GBps: float, ratio: str
            ) -> tuple[dict, str]:
  """``(figures, line)`` of a kernel row timed at ``us`` microseconds a layer that reads
  ``nbytes`` a layer: its bandwidth, that over the read probe's, ``ratio``: its time over the
  first row's (``base``: that row's ``(us, outputs)``), and its outputs' largest difference from
  the first's (the same computation: a launch that computes wrong shows); ``line`` prints them."""
  row = {"us_per_layer": us, "GBps": nbytes / us / 1e3, "read_frac": nbytes / us / 1e3 / read_GBps,
         ratio: us / base[0], "max_abs_diff": float(np.abs(out - base[1]).max())}
  return row, (f"{us:8.1f} us a layer  {row['GBps']:7.0f} GB/s ({row['read_frac']:.2f} of the "
               f"probe)  x{row[ratio]:.2f}  max |diff| {row['max_abs_diff']:.1e}")


def _passes(reduce, n: int, x):
  """``reduce`` of ``x`` scaled by each pass's number, ``n`` passes: each reads all of ``x`` (the
  scale differs per pass, so no pass is hoisted out of the loop or shared with another)."""
  if n == 1:
    return reduce(x)
  return jax.lax.fori_loop(0, n, lambda i, acc: acc + reduce(x * (i + 1).astype(x.dtype)),
                           jnp.zeros(jax.eval_shape(reduce, x).shape, x.dtype))


class Hardware:
  """Memory read bandwidth (a sum over 128 MiB; 1 GiB off CPU, past an accelerator's caches, read
  ``READS`` times in one call so the call's launch and the host's wait weigh little) and matmul
  throughput (2048^3 float32 on CPU; 8192^3 bfloat16 off CPU, the accelerators' decode dtype), best
  of the probes so far; ``probe()`` can be interleaved with other measurements."""

  READS = 8  # off CPU: passes over the buffer in one call (a pass at 4 TB/s is ~0.27 ms; with one
  # pass a call its launch and wait count against it and the figure reads low)

  def __init__(self):
    on_cpu = jax.default_backend() == "cpu"
    self.n = 2048 if on_cpu else 8192
    mib = 128 if on_cpu else 1024
    self.x = jnp.ones((mib * 1024 * 1024 // 4,), jnp.float32) * 1.5  # far beyond the caches
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    self.a = jax.random.normal(jax.random.key(0), (self.n, self.n), jnp.float32).astype(dtype)
    # off CPU three reduction shapes, the fastest counts (XLA's one-dimensional sum leaves an
    # accelerator's memory bandwidth partly unused)
    shapes = [jnp.sum] + ([] if on_cpu else [lambda x: x.reshape(-1, 4096).sum(0),
                                             lambda x: x.reshape(-1, 4096).sum(1)])
    self.reads = 1 if on_cpu else self.READS
    self.sums = [jax.jit(functools.partial(_passes, shape, self.reads)) for shape in shapes]
    self.mm = jax.jit(lambda a: a @ a)
    self.read_s, self.mm_s = float("inf"), float("inf")
    jax.block_until_ready(([f(self.x) for f in self.sums], self.mm(self.a)))

  def probe(self, reps=1):
    for _ in range(reps):
      self.read_s = min([self.read_s] + [best_time(f, self.x, reps=1) for f in self.sums])
      self.mm_s = min(self.mm_s, best_time(self.mm, self.a, reps=1))
    return self

  def figures(self) -> dict:
    return {"read_GBps": self.reads * self.x.nbytes / self.read_s / 1e9,
            "matmul_GFLOPps": 2 * self.n**3 / self.mm_s / 1e9,
            "matmul_dtype": jnp.dtype(self.a.dtype).name, "read_MiB": self.x.nbytes / 2**20}
