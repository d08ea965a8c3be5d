"""LoRA adapters for the ``Transformer``'s projections: init, low-rank forward, merge, PEFT export.

An adapter pair for a weight ``W`` (ours ``[I, O]``, the Hugging Face weight transposed) is
``a [I, r]`` and ``b [r, O]``; the adapted layer computes ``x @ W + scale * (dropout(x) @ a) @ b`` with
``scale = alpha / rank``, so the merged weight is ``W + scale * a @ b``. In PEFT's layout
(``lora_A.weight [r, I]``, ``lora_B.weight [O, r]``) that is ``W_hf + scale * B @ A``: ``a = A.T``,
``b = B.T``. ``a`` starts uniform in ``+-1/sqrt(I)`` and ``b`` at zero (PEFT's default), so a fresh
adapter leaves the model unchanged.

Adapters are a pure dict shaped like the model's parameters, holding only the adapted leaves:
``{"layers": {i: {"attn": {"q": {"a": ..., "b": ...}}, "mlp": {...}}}}``. Targets are named as
PEFT names them (``q_proj`` ... ``down_proj``).

``wrap`` gives the training forward a parameter tree whose adapted leaves are ``LoraWeight``s
(the frozen weight plus its adapters; ``transformer.linear`` runs their low-rank side path), so the
backward never forms a full weight-sized gradient. Samplers use ``merge`` once per weight version.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import transformer

# PEFT target name -> (sub-module, parameter) inside a ``Block``
TARGETS = {"q_proj": ("attn", "q"), "k_proj": ("attn", "k"), "v_proj": ("attn", "v"),
           "o_proj": ("attn", "o"), "gate_proj": ("mlp", "gate"), "up_proj": ("mlp", "up"),
           "down_proj": ("mlp", "down")}
_HF_MODULE = {"attn": "self_attn", "mlp": "mlp"}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """``actor.lora``: rank, alpha (scale = alpha / rank), dropout on the adapters' input, targets."""

  rank: int = 16
  alpha: float = 32.0
  dropout: float = 0.0
  targets: tuple[str, ...] = tuple(TARGETS)

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    if self.rank < 1:
      raise ValueError(f"actor.lora.rank={self.rank} must be >= 1 (0 turns LoRA off)")
    if self.alpha <= 0:
      raise ValueError(f"actor.lora.alpha={self.alpha} must be > 0")
    if not 0 <= self.dropout < 1:
      raise ValueError(f"actor.lora.dropout={self.dropout} must be in [0, 1)")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or not self.targets:
      raise ValueError(f"actor.lora.targets={list(self.targets)}: unknown {unknown}; "
                       f"valid targets: {list(TARGETS)}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @classmethod
  def from_config(cls, section) -> LoraConfig | None:
    """The ``actor.lora`` config section as a ``LoraConfig``; None when ``rank`` is 0 (off)."""
    if section is None or not int(section["rank"]):
      return None
    return cls(rank=int(section["rank"]), alpha=float(section["alpha"]),
               dropout=float(section["dropout"]), targets=tuple(section["targets"]))


def adapter_paths(params: Mapping, lcfg: LoraConfig) -> Iterator[tuple[int, str, str]]:
  """(layer, sub-module, parameter) of every adapted weight of a model's pure parameter dict."""
  for i in sorted(params["layers"]):
    for target in lcfg.targets:
      yield (i, *TARGETS[target])


def init_adapters(params: Mapping, lcfg: LoraConfig, key: jax.Array) -> dict:
  """Fresh adapters (``a`` uniform in +-1/sqrt(I), ``b`` zero) for ``params`` (shapes only)."""
  out: dict = {"layers": {}}
  for n, (i, mod, name) in enumerate(adapter_paths(params, lcfg)):
    fan_in, fan_out = params["layers"][i][mod][name].shape
    bound = 1.0 / np.sqrt(fan_in)
    a = jax.random.uniform(jax.random.fold_in(key, n), (fan_in, lcfg.rank), jnp.float32,
                           -bound, bound)
    layer = out["layers"].setdefault(i, {}).setdefault(mod, {})
    layer[name] = {"a": a, "b": jnp.zeros((lcfg.rank, fan_out), jnp.float32)}
  return out


def _with(params: Mapping, adapters: Mapping, fn) -> dict:
  """``params`` (shallow-copied along the adapted paths) with ``fn(w, ab)`` at each adapted leaf."""
  out = dict(params)
  out["layers"] = dict(params["layers"])
  for i, layer in adapters["layers"].items():
    new_layer = out["layers"][i] = dict(out["layers"][i])
    for mod, weights in layer.items():
      new_mod = new_layer[mod] = dict(new_layer[mod])
      for name, ab in weights.items():
        new_mod[name] = fn(new_mod[name], ab)
  return out


def merge(params: Mapping, adapters: Mapping, lcfg: LoraConfig) -> dict:
  """``params`` with every adapted weight replaced by ``W + scale * a @ b`` (in W's dtype; the
  product and sum in float32 at full precision)."""

  def merged(w, ab):
    delta = jnp.matmul(ab["a"].astype(jnp.float32), ab["b"].astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    return (w.astype(jnp.float32) + lcfg.scale * delta).astype(w.dtype)

  return _with(params, adapters, merged)


def frozen_base(params: Mapping, dtype) -> dict:
  """The frozen base weights stored in ``dtype`` (the compute dtype): every parameter with two or
  more dimensions and the biases; norm scales stay float32."""
  return transformer.cast_weights(params, dtype)


def freeze_model_base(model: transformer.Transformer, dtype) -> None:
  """Stores ``model``'s parameters as ``frozen_base(..., dtype)`` in place: the base a LoRA learner
  trains on (``actor.dtype``), which a sampler building from ``model`` must merge into too."""
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, frozen_base(nnx.to_pure_dict(state), dtype))
  nnx.update(model, state)


def abstract_adapters(params: Mapping, lcfg: LoraConfig, sharding=None) -> dict:
  """``jax.ShapeDtypeStruct``s of the adapters of ``params`` (arrays or shapes), with ``sharding``
  on every leaf when given: e.g. the restore target of published adapters."""
  shapes = jax.eval_shape(lambda: init_adapters(params, lcfg, jax.random.key(0)))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
  """A frozen weight ``w [I, O]`` with its adapters; ``transformer.linear`` calls
  ``apply_linear``. Stands in for the array inside an ``nnx.Param`` of the training forward."""

  w: jax.Array
  a: jax.Array
  b: jax.Array
  key: jax.Array | None  # dropout key (None: no dropout)
  scale: float = dataclasses.field(metadata=dict(static=True), default=1.0)
  dropout: float = dataclasses.field(metadata=dict(static=True), default=0.0)

  @property
  def ndim(self) -> int:
    return self.w.ndim

  @property
  def shape(self):
    return self.w.shape

  def __getitem__(self, index):
    if index is not Ellipsis:
      raise TypeError("a LoraWeight supports only [...]")
    return self

  def astype(self, dtype) -> LoraWeight:
    return dataclasses.replace(self, w=self.w.astype(dtype), a=self.a.astype(dtype),
                               b=self.b.astype(dtype))

  def apply_linear(self, x_NxI, out_dtype=None):
    y = transformer.linear(x_NxI, self.w, out_dtype=out_dtype)
    h = x_NxI
    if self.dropout and self.key is not None:
      keep = jax.random.bernoulli(self.key, 1.0 - self.dropout, h.shape)
      h = jnp.where(keep, h / (1.0 - self.dropout), jnp.zeros_like(h))
    low = transformer.linear(transformer.linear(h, self.a), self.b, out_dtype=y.dtype)
    return y + (self.scale * low).astype(y.dtype)


def wrap(params: Mapping, adapters: Mapping, lcfg: LoraConfig, key: jax.Array | None = None) -> dict:
  """``params`` whose adapted leaves are ``LoraWeight``s (for the training forward). ``key``
  (optional) draws the dropout masks; without it there is no dropout."""
  counter = itertools.count()

  def lora_weight(w, ab):
    k = None if key is None or not lcfg.dropout else jax.random.fold_in(key, next(counter))
    return LoraWeight(w, ab["a"], ab["b"], k, scale=lcfg.scale, dropout=lcfg.dropout)

  return _with(params, adapters, lora_weight)


def is_adapters(tree: Mapping) -> bool:
  """Whether a pure dict holds LoRA adapters (``init_adapters``' layout) rather than a model."""
  if "embed" in tree or not tree.get("layers"):
    return False
  leaf_parent = next(iter(next(iter(tree["layers"].values())).values()))
  return all(isinstance(v, Mapping) and set(v) == {"a", "b"} for v in leaf_parent.values())


def num_params(adapters: Mapping) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))


def merged_model(model: transformer.Transformer, adapters: Mapping,
                 lcfg: LoraConfig) -> transformer.Transformer:
  """A copy of ``model`` with ``adapters`` merged into its weights (e.g. for ``save_hf``)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = nnx.to_pure_dict(params)
  return nnx.merge(graphdef, nnx.State(merge(params, adapters, lcfg)), rest, copy=True)


# --- Hugging Face PEFT adapter directories ---------------------------------------------------------

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_tensors(adapters: Mapping) -> dict[str, np.ndarray]:
  """PEFT names -> float32 host arrays in PEFT's layout (``lora_A [r, I]``, ``lora_B [O, r]``)."""
  out = {}
  for i, layer in sorted(adapters["layers"].items()):
    for mod, weights in layer.items():
      for name, ab in weights.items():
        pre = f"base_model.model.model.layers.{i}.{_HF_MODULE[mod]}.{name}_proj"
        for part, key in (("lora_A", "a"), ("lora_B", "b")):
          arr = np.asarray(jax.device_get(ab[key]), np.float32)
          out[f"{pre}.{part}.weight"] = np.ascontiguousarray(arr.T)
  return out


def save_peft(adapters: Mapping, lcfg: LoraConfig, path: str | os.PathLike,
              base_model: str = "") -> str:
  """Writes a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
  that ``peft.PeftModel.from_pretrained(base, path)`` loads onto the ``transformers`` base model."""
  from areal_jax.models import hf  # pylint: disable=import-outside-toplevel
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
      "r": lcfg.rank, "lora_alpha": lcfg.alpha, "lora_dropout": lcfg.dropout,
      "target_modules": sorted(lcfg.targets), "bias": "none", "fan_in_fan_out": False,
      "inference_mode": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
      "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
      "rank_pattern": {}, "alpha_pattern": {},
  }
  hf.write_safetensors(os.path.join(path, ADAPTER_WEIGHTS), peft_tensors(adapters))
  with open(os.path.join(path, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return path


def load_peft(path: str | os.PathLike, params: Mapping) -> tuple[dict, LoraConfig]:
  """Reads a PEFT adapter directory written by ``save_peft`` (or PEFT, same targets on every
  layer) for a model whose pure parameter dict is ``params``."""
  from areal_jax.models import hf  # pylint: disable=import-outside-toplevel
  path = os.fspath(path)
  cfg_file = os.path.join(path, ADAPTER_CONFIG)
  try:
    with open(cfg_file, encoding="utf-8") as f:
      config = json.load(f)
  except FileNotFoundError:
    raise hf.CheckpointError(f"{cfg_file} not found") from None
  if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
    raise hf.CheckpointError(f"{cfg_file}: only plain LoRA adapters are supported")
  targets = config["target_modules"]
  lcfg = LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                    dropout=float(config.get("lora_dropout") or 0.0),
                    targets=tuple(targets) if isinstance(targets, list) else (targets,))
  f = hf.SafetensorsFile(os.path.join(path, ADAPTER_WEIGHTS))
  adapters: dict[str, Any] = {"layers": {}}
  for i, mod, name in adapter_paths(params, lcfg):
    pre = f"base_model.model.model.layers.{i}.{_HF_MODULE[mod]}.{name}_proj"
    ab = {key: np.array(f.get(f"{pre}.{part}.weight"), np.float32).T
          for part, key in (("lora_A", "a"), ("lora_B", "b"))}
    want = params["layers"][i][mod][name].shape
    if (ab["a"].shape[0], ab["b"].shape[1]) != tuple(want):
      raise hf.CheckpointError(f"{f.path}: {pre} adapters fit a [{ab['a'].shape[0]}, "
                               f"{ab['b'].shape[1]}] weight, the model's is {list(want)}")
    layer = adapters["layers"].setdefault(i, {}).setdefault(mod, {})
    layer[name] = {k: jnp.asarray(v) for k, v in ab.items()}
  return adapters, lcfg
