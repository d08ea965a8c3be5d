"""``VllmInProcessEngine``: vLLM's ``LLMEngine`` in this process, stepped by a background thread.

Only the loop thread touches vLLM after construction. ``submit`` queues requests; the loop adds them
to vLLM (which schedules up to ``num_slots`` sequences at a time), calls ``step()`` and streams each
finished sequence out. Outputs are deltas (``RequestOutputKind.DELTA``), so every token is
recorded with the policy version in use when it was produced.

Weight update (``update_params``): the caller's thread writes the safetensors directory (decoding
goes on meanwhile); then, between two steps, the loop aborts every unfinished request (keeping its
partial tokens and logprobs), runs ``reload_weights`` on the worker (see ``worker_ext.py``), resets
the prefix cache (always: cached prompt blocks hold keys and values of the old weights) and
resubmits each sequence as prompt + partial output with the remaining budget.

LoRA (``lora`` given): vLLM runs with its own LoRA support. ``update_params`` with adapters (what a
LoRA learner publishes) writes them as a PEFT adapter directory (a few MB instead of the whole
model) and, between two steps, every request from then on (the interrupted ones resubmitted) runs
with that adapter as a ``LoRARequest``; the base weights are never reloaded. Full weights still go
through ``reload_weights`` (e.g. the first version of a run that starts from merged weights).
"""

from __future__ import annotations

import collections
import logging
import os
import tempfile
import threading
import time
from typing import Any

from areal_jax.models import lora as lora_lib
from areal_jax.rollout_api import GroupRequest
from areal_jax.vllm_rollout import env as env_lib
from areal_jax.vllm_rollout import settings
from areal_jax.vllm_rollout.base import Group, Seq, VllmEngineBase
from areal_jax.vllm_rollout.weights import WeightDirs

log = logging.getLogger(__name__)

WORKER_EXTENSION = "areal_jax.vllm_rollout.worker_ext.PolicyWeightSync"


class VllmInProcessEngine(VllmEngineBase):
  """Rollout engine on an in-process vLLM ``LLMEngine``; see the module docstring.

  Args:
    model, tokenizer: the policy (its weights are written for vLLM) and its tokenizer (None: no
      tokenizer files are written; EOS ids come from the model config).
    workdir: weight versions go to ``<workdir>/weights``, vLLM caches to ``<workdir>/cache``
      (default: a fresh temporary directory).
    num_slots: vLLM's ``max_num_seqs`` (sequences decoded together).
    max_model_len: prompt + generated tokens per sequence.
    kv_cache_gib: KV cache size (0 or less: 1 GiB on CPU, on a GPU vLLM's own, from its memory
      share).
    dtype: vLLM's compute dtype (``"auto"``: float32 on CPU, bfloat16 on a GPU).
    gpu_memory_utilization: on a GPU, vLLM's share of its memory (0: what is free when the engine
      starts, less ``settings.HEADROOM_GIB``); see ``settings.py``.
    keep_weights: weight directories kept on disk.
    seed: vLLM's engine seed. per_request_seeds: seed each request (see ``base.py``: off because
      of a vLLM CPU bug with chunked prefill).
    engine_kwargs: extra ``vllm.EngineArgs`` fields.
    lora: the adapters' ``LoraConfig`` when the policy is published as LoRA adapters (vLLM's
      ``enable_lora``; ``max_lora_rank`` is the smallest rank vLLM offers that holds ``lora.rank``).
  """

  def __init__(self, model, tokenizer, *, workdir: str | None = None, num_slots: int = 8,
               max_model_len: int = 512, kv_cache_gib: float = 0.0, keep_weights: int = 2,
               num_threads: int | None = None, seed: int = 0, version: int = 0,
               per_request_seeds: bool = False, engine_kwargs: dict[str, Any] | None = None,
               lora: lora_lib.LoraConfig | None = None, dtype: str = "auto",
               gpu_memory_utilization: float = 0.0):
    env_lib.require_vllm()
    super().__init__(vocab_size=model.cfg.vocab_size,
                     eos_token_ids=tuple(getattr(tokenizer, "eos_token_ids", None)
                                         or model.cfg.eos_token_ids),
                     max_model_len=max_model_len, num_slots=num_slots, version=version)
    self.workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix="areal_vllm_"))
    self.platform = settings.platform()
    self.weights = WeightDirs(model, tokenizer, os.path.join(self.workdir, "weights"),
                              keep_weights, settings.compute_dtype(self.platform, dtype))
    self._env = settings.environment(self.platform, os.path.join(self.workdir, "cache"),
                                     kv_cache_gib, num_threads)
    self._settings = dict(dtype=dtype, kv_cache_gib=kv_cache_gib,
                          gpu_memory_utilization=gpu_memory_utilization)
    self._engine_kwargs = dict(seed=seed, **(engine_kwargs or {}))
    self.per_request_seeds = per_request_seeds
    self.lora = lora
    self._lora_request = None  # the adapter every new request runs with (None: the base weights)
    self._loaded = self.weights.write(model, version)
    self._base = self._loaded  # the full weights vLLM runs (adapters, if any, on top)
    self.weights.mark_in_use(self._loaded)
    self._llm = None
    self._lock = threading.Condition()
    self._new: collections.deque[tuple[Group, list[Seq]]] = collections.deque()
    self._running: dict[str, Seq] = {}  # vLLM request id -> sequence
    self._pending: tuple[str, int] | None = None  # (weights dir, version) to load
    self._aborts: set[int] = set()
    self._paused = self._stopping = False
    self._thread: threading.Thread | None = None
    self.stats = collections.Counter()
    self._create()

  # ---- vLLM lifecycle ----------------------------------------------------------------------------

  def _create(self) -> None:
    os.environ.update(self._env)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    t0 = time.time()
    if self.lora is not None:
      self._engine_kwargs.update(enable_lora=True, max_loras=1,
                                 max_lora_rank=vllm_lora_rank(self.lora.rank))
    fields = settings.engine_fields_here(self.platform, **self._settings)
    args = EngineArgs(
        model=self._loaded, max_model_len=self.max_model_len, max_num_seqs=self.num_slots,
        logprobs_mode="processed_logprobs", skip_tokenizer_init=True, generation_config="vllm",
        enable_prefix_caching=True, worker_extension_cls=WORKER_EXTENSION,
        **{**fields, **self._engine_kwargs})
    self._llm = LLMEngine.from_engine_args(args)
    self.stats["startup_s"] = time.time() - t0

  def close(self) -> None:
    """Stops the engine and frees vLLM (its KV cache and model); the engine cannot restart."""
    self.stop()
    if self._llm is not None:
      llm, self._llm = self._llm, None
      try:
        llm.engine_core.shutdown()
      finally:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
        cleanup_dist_env_and_memory()

  # ---- RolloutEngine -------------------------------------------------------------------------------

  def start(self) -> None:
    if self._llm is None:
      raise RuntimeError("this vLLM engine was closed")
    if self._thread is not None:
      return
    self._stopping = False
    self._thread = threading.Thread(target=self._run, name="vllm-rollout", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    with self._lock:
      self._stopping = True
      self._lock.notify_all()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._llm is not None:
      self._apply_pending()  # a version announced before stop is the one in use afterwards
      self._abort_running()
    for seq in list(self._running.values()):
      self.emit(seq, "abort")
    self._running.clear()
    with self._lock:
      while self._new:
        group, _ = self._new.popleft()
        self.emit_group(group, "abort")

  def submit(self, request: GroupRequest) -> None:
    item = self.new_group(request)
    if item is None:
      return
    with self._lock:
      self._new.append(item)
      self._lock.notify_all()

  def update_params(self, params: Any, version: int) -> None:
    if self.lora is not None and lora_lib.is_adapters(params):
      path = self.weights.write_adapters(params, self.lora, version)
    else:
      path = self.weights.write(params, version)
    with self._lock:
      previous = self._pending[0] if self._pending else None
      self._pending = (path, int(version))
      self.weights.mark_in_use(path)
      if previous not in (None, path, self._loaded):
        self.weights.mark_in_use(None, previous)
      self._lock.notify_all()
    if self._thread is None:
      self._apply_pending()

  def pause(self) -> None:
    with self._lock:
      self._paused = True

  def resume(self) -> None:
    with self._lock:
      self._paused = False
      self._lock.notify_all()

  def abort(self, group_id: int) -> None:
    with self._lock:
      self._aborts.add(int(group_id))
      self._lock.notify_all()

  # ---- the loop ----------------------------------------------------------------------------------

  def _run(self) -> None:
    while True:
      with self._lock:
        if self._stopping:
          return
        idle = self._paused or not (self._running or self._new)
        if idle and self._pending is None and not self._aborts:
          self._lock.wait(0.05)
          continue
      try:
        self._handle_aborts()
        self._apply_pending()
        if self._paused:
          continue
        self._add_new()
        if self._running:
          self._process(self._llm.step())
      except Exception as e:  # a bug or a broken engine: fail what is in flight, keep serving
        log.exception("vLLM rollout loop failed")
        self._fail_all(f"{type(e).__name__}: {e}")

  def _add(self, seq: Seq) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    rid = seq.next_request_id()
    params = SamplingParams(**seq.attempt_fields(self.per_request_seeds), detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    self._llm.add_request(rid, {"prompt_token_ids": seq.prompt}, params,
                          lora_request=self._lora_request)
    self._running[rid] = seq

  def _add_new(self) -> None:
    with self._lock:
      items, self._new = list(self._new), collections.deque()
    for group, seqs in items:
      for seq in seqs:
        try:
          self._add(seq)
        except Exception as e:  # this request only (e.g. rejected by vLLM's input checks)
          log.warning("vLLM rejected %s: %s", seq.key, e)
          self.emit(seq, "error", f"{type(e).__name__}: {e}")

  def _process(self, outputs) -> None:
    version = self._version
    for out in outputs:
      seq = self._running.get(out.request_id)
      if seq is None:
        continue
      completion = out.outputs[0]
      tokens = list(completion.token_ids)
      logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs or [], tokens)]
      seq.add(tokens, logprobs, version)
      self.stats["tokens"] += len(tokens)
      if out.finished:
        del self._running[out.request_id]
        reason = self.finish_reason(seq, completion.finish_reason)
        self.emit(seq, reason or "error", None if reason else "vLLM ended without a reason")
        self.stats["finished"] += 1

  def _abort_running(self) -> list[Seq]:
    """Aborts every unfinished vLLM request; returns their sequences (partial outputs kept)."""
    seqs = []
    if self._running:
      self._llm.abort_request(list(self._running))
      seqs = list(self._running.values())
      self._running.clear()
    return seqs

  def _handle_aborts(self) -> None:
    with self._lock:
      ids, self._aborts = self._aborts, set()
      if not ids:
        return
      kept = collections.deque()
      for group, seqs in self._new:
        if group.request.group_id in ids:
          self.emit_group(group, "abort")
        else:
          kept.append((group, seqs))
      self._new = kept
    rids = [rid for rid, s in self._running.items() if s.group.request.group_id in ids]
    if rids:
      self._llm.abort_request(rids)
      for rid in rids:
        self.emit(self._running.pop(rid), "abort")

  def _apply_pending(self) -> None:
    with self._lock:
      pending, self._pending = self._pending, None
    if pending is None:
      return
    path, version = pending
    t0 = time.time()
    interrupted = self._abort_running()
    if self.weights.is_adapter_dir(path):
      self._use_adapter(path, version)
    else:
      self._use_adapter(None, version)
      self._llm.collective_rpc("load_policy_weights", kwargs={"weights_path": path})
    if not self._llm.reset_prefix_cache():
      raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
    # The base weights' directory stays while adapters run on it (it is what vLLM's model is).
    released = {self._loaded, self._base} - {path}
    if self.weights.is_adapter_dir(path):
      released.discard(self._base)
    else:
      self._base = path
    for old in released:
      self.weights.mark_in_use(None, previous=old)
    self.weights.mark_in_use(path)
    self._loaded, self._version = path, version
    for seq in interrupted:
      if seq.remaining > 0:
        self._add(seq)
      else:  # cannot happen (it would have finished); never resubmit an empty budget
        self.emit(seq, "length")
    self.stats["swaps"] += 1
    self.stats["resubmitted"] += len(interrupted)
    self.stats["swap_s"] += time.time() - t0

  def _use_adapter(self, path: str | None, version: int) -> None:
    """Makes new requests run with the adapter in ``path`` (None: the base weights alone)."""
    from vllm.lora.request import LoRARequest

    old, self._lora_request = self._lora_request, None
    if path is not None:  # ids must be positive and unique per adapter: the version + 1
      self._lora_request = LoRARequest(f"policy-v{version}", int(version) + 1, path)
      self._llm.add_lora(self._lora_request)
    if old is not None:
      self._llm.remove_lora(old.lora_int_id)

  def _fail_all(self, message: str) -> None:
    try:
      if self._running:
        self._llm.abort_request(list(self._running))
    except Exception:  # the engine may be unusable
      log.exception("aborting after a failure failed")
    for seq in self._running.values():
      self.emit(seq, "error", message)
    self._running.clear()
    with self._lock:
      while self._new:
        group, _ = self._new.popleft()
        self.emit_group(group, "error", message)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
  """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of rank ``rank``."""
  for r in VLLM_LORA_RANKS:
    if rank <= r:
      return r
  raise ValueError(f"actor.lora.rank={rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")
