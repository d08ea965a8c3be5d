"""``VllmServerEngine``: a vLLM OpenAI-compatible server on 127.0.0.1, driven over HTTP.

The engine starts ``python -m vllm.entrypoints.openai.api_server`` (same interpreter, with the
settings of vLLM's platform, ``settings.py``, ``VLLM_SERVER_DEV_MODE=1`` for the weight endpoints
and this package's worker extension) or attaches to a running one (``server_url``). A server it
starts runs under a lifeline, and guards itself (``lifeline.py``): it stops, with every process
it started, when this process ends, even by a signal that runs no exit handler, or when the
lifeline is killed (as Ray kills a worker's direct children); ``close`` returns once they are
gone. Up to ``num_slots``
sequences are in flight at once, each a streaming ``/v1/completions`` request on token ids
(``prompt`` is a list of ids, ``return_token_ids`` gives the generated ids, ``logprobs=0`` the
sampled token's logprob), read by one worker thread per slot.

Weight update (``update_params``): write the safetensors directory, stop starting attempts, then
``POST /pause?mode=abort`` (vLLM aborts every running request), close any stream still open (a
request that reached the server during the pause would otherwise run later under the new weights
while labelled with the old version), ``POST /abort_requests`` for such late arrivals,
``POST /collective_rpc`` (``load_policy_weights``), ``POST /reset_prefix_cache`` (always; retried
until vLLM reports success), ``POST /resume``. Interrupted sequences keep the tokens and logprobs
streamed so far and are resubmitted first, as prompt + partial output with the remaining budget.
Tokens are labelled with the version current when their attempt started; no attempt spans a swap.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from typing import Any

from areal_jax.rollout_api import GroupRequest
from areal_jax.vllm_rollout import env as env_lib
from areal_jax.vllm_rollout import lifeline
from areal_jax.vllm_rollout import settings
from areal_jax.vllm_rollout.base import Seq, VllmEngineBase
from areal_jax.vllm_rollout.weights import WeightDirs

log = logging.getLogger(__name__)

WORKER_EXTENSION = "areal_jax.vllm_rollout.worker_ext.PolicyWeightSync"
SERVED_NAME = "policy"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
STOP_GRACE_S = 30.0  # from SIGTERM to SIGKILL when the server (and what it started) is stopped


class ServerError(RuntimeError):
  """The vLLM server failed to start or answered an endpoint with an error."""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def server_args(model_dir: str, port: int, *, num_slots: int, max_model_len: int, seed: int,
                fields: dict) -> list[str]:
  """The arguments of ``python -m SERVER_MODULE``: a vLLM server for this backend, with
  ``fields`` (``settings.engine_fields``: its platform's) on its command line."""
  return ["--model", model_dir,
          "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
          "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
          "--max-model-len", str(max_model_len), "--max-num-seqs", str(num_slots),
          "--seed", str(seed), "--enable-prefix-caching",
          "--worker-extension-cls", WORKER_EXTENSION, "--disable-uvicorn-access-log",
          *settings.cli_args(fields)]


@dataclasses.dataclass
class _Attempt:
  seq: Seq
  version: int
  conn: http.client.HTTPConnection | None = None
  preempted: bool = False  # ended by a weight update: resubmit


class VllmServerEngine(VllmEngineBase):
  """Rollout engine on a vLLM HTTP server; see the module docstring.

  Args: as ``VllmInProcessEngine``, plus ``server_url`` (attach instead of starting a server; it
  must run this backend's worker extension and ``VLLM_SERVER_DEV_MODE=1``; ``kv_cache_gib``,
  ``num_threads``, ``dtype`` and ``gpu_memory_utilization`` are then the server's own) and
  ``startup_timeout``.
  """

  def __init__(self, model, tokenizer, *, server_url: str | None = None,
               workdir: str | None = None, num_slots: int = 8, max_model_len: int = 512,
               kv_cache_gib: float = 0.0, keep_weights: int = 2, num_threads: int | None = None,
               seed: int = 0, version: int = 0, per_request_seeds: bool = False,
               startup_timeout: float = 600.0, request_timeout: float = 600.0,
               dtype: str = "auto", gpu_memory_utilization: float = 0.0):
    if server_url is None:
      env_lib.require_vllm()
    super().__init__(vocab_size=model.cfg.vocab_size,
                     eos_token_ids=tuple(getattr(tokenizer, "eos_token_ids", None)
                                         or model.cfg.eos_token_ids),
                     max_model_len=max_model_len, num_slots=num_slots, version=version)
    self.workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix="areal_vllm_server_"))
    self.platform = settings.platform() if server_url is None else None
    # (an attached server's platform is not known here: float32 unless dtype says, which any
    # vLLM reads)
    self.weights = WeightDirs(model, tokenizer, os.path.join(self.workdir, "weights"),
                              keep_weights, settings.compute_dtype(self.platform or "cpu", dtype))
    self.request_timeout = request_timeout
    self.per_request_seeds = per_request_seeds
    self._lock = threading.Condition()
    self._swap_lock = threading.Lock()
    self._queue: collections.deque[Seq] = collections.deque()
    self._active: dict[int, _Attempt] = {}  # id(attempt) -> attempt
    self._swapping = self._paused = self._stopping = False
    self._workers: list[threading.Thread] = []
    self._proc: subprocess.Popen | None = None
    self.stats = collections.Counter()
    self._loaded = self.weights.write(model, version)
    self.weights.mark_in_use(self._loaded)
    if server_url is None:
      port = free_port()
      self.server_url = f"http://127.0.0.1:{port}"
      self._start_server(port, num_slots, max_model_len, seed, startup_timeout,
                         dict(dtype=dtype, kv_cache_gib=kv_cache_gib,
                              gpu_memory_utilization=gpu_memory_utilization), num_threads)
    else:
      self.server_url = server_url.rstrip("/")
      self._wait_healthy(startup_timeout)
      self._swap(self._loaded, version)  # an attached server must serve these weights
    parsed = urllib.parse.urlparse(self.server_url)
    self._host, self._port = parsed.hostname, parsed.port or 80

  # ---- the server process ------------------------------------------------------------------------

  def _start_server(self, port, num_slots, max_model_len, seed, timeout, chosen,
                    num_threads) -> None:
    """Starts the server on vLLM's platform here with ``chosen`` (``settings.engine_fields``'
    keyword arguments) and ``num_threads``."""
    env = dict(os.environ, **settings.environment(
        self.platform, os.path.join(self.workdir, "cache"), chosen["kv_cache_gib"], num_threads))
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.pop("JAX_PLATFORMS", None)
    self.pid_file = os.path.join(self.workdir, "server.pid")
    if os.path.exists(self.pid_file):
      os.remove(self.pid_file)
    # the server runs under a lifeline and guards itself: it is stopped (with the engine core it
    # starts) when this process ends, even by a signal that runs no exit handler, or when the
    # lifeline is killed (Ray kills a worker's direct children when it exits)
    args = server_args(self._loaded, port, num_slots=num_slots, max_model_len=max_model_len,
                       seed=seed, fields=settings.engine_fields_here(self.platform, **chosen))
    cmd = lifeline.command(lifeline.guarded(SERVER_MODULE, args, grace_s=STOP_GRACE_S),
                           owner=os.getpid(), grace_s=STOP_GRACE_S, pid_file=self.pid_file)
    self.log_path = os.path.join(self.workdir, "server.log")
    t0 = time.time()
    with open(self.log_path, "ab") as logf:
      self._proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    atexit.register(self.close)
    self._wait_healthy(timeout)
    self.stats["startup_s"] = time.time() - t0

  def _log_tail(self, n: int = 4000) -> str:
    try:
      with open(self.log_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - n))
        return f.read().decode(errors="replace")
    except (OSError, AttributeError):
      return ""

  def _wait_healthy(self, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
      if self._proc is not None and self._proc.poll() is not None:
        raise ServerError(f"the vLLM server exited with code {self._proc.returncode} during "
                          f"startup; end of {self.log_path}:\n{self._log_tail()}")
      try:
        status, _ = self._call("GET", "/health", timeout=5)
        if status == 200:
          return
      except OSError:
        pass
      time.sleep(0.5)
    raise ServerError(f"the vLLM server at {self.server_url} was not healthy after {timeout:.0f} s"
                      + (f"; end of {self.log_path}:\n{self._log_tail()}" if self._proc else ""))

  @property
  def server_pid(self) -> int | None:
    """The pid of the server this engine started (it leads its own process group), or None."""
    try:
      with open(self.pid_file, encoding="utf-8") as f:
        pid = int(f.read())
    except (AttributeError, OSError, ValueError):
      return None
    return pid if pid > 1 else None  # never 0: os.killpg(0, ...) would signal our own group

  def close(self) -> None:
    """Stops the engine and the server this engine started, with every process the server started;
    returns when they are gone."""
    self.stop()
    proc, self._proc = self._proc, None
    if proc is not None and proc.poll() is None:
      proc.terminate()  # the lifeline stops the server's group (SIGKILL after STOP_GRACE_S)
      try:
        proc.wait(STOP_GRACE_S + 15)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pid = self.server_pid
        if pid is not None:
          try:
            os.killpg(pid, signal.SIGKILL)
          except OSError:
            pass

  # ---- HTTP ----------------------------------------------------------------------------------------

  def _call(self, method: str, path: str, body: dict | None = None,
            timeout: float = 600.0) -> tuple[int, Any]:
    parsed = urllib.parse.urlparse(self.server_url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=timeout)
    try:
      data = None if body is None else json.dumps(body).encode()
      conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
      resp = conn.getresponse()
      raw = resp.read()
      try:
        payload = json.loads(raw) if raw else None
      except json.JSONDecodeError:
        payload = raw.decode(errors="replace")
      return resp.status, payload
    finally:
      conn.close()

  def _post(self, path: str, body: dict | None = None) -> Any:
    status, payload = self._call("POST", path, body if body is not None else {})
    if status != 200:
      raise ServerError(f"POST {path} -> HTTP {status}: {payload}")
    return payload

  # ---- RolloutEngine -------------------------------------------------------------------------------

  def start(self) -> None:
    if self._workers:
      return
    self._stopping = False
    self._workers = [threading.Thread(target=self._worker, name=f"vllm-http-{i}", daemon=True)
                     for i in range(self.num_slots)]
    for t in self._workers:
      t.start()

  def stop(self) -> None:
    with self._lock:
      self._stopping = True
      for a in self._active.values():
        self._close_stream(a)
      self._lock.notify_all()
    for t in self._workers:
      t.join()
    self._workers = []
    with self._lock:
      while self._queue:
        self.emit(self._queue.popleft(), "abort")

  def submit(self, request: GroupRequest) -> None:
    item = self.new_group(request)
    if item is None:
      return
    with self._lock:
      self._queue.extend(item[1])
      self._lock.notify_all()

  def update_params(self, params: Any, version: int) -> None:
    path = self.weights.write(params, version)
    self.weights.mark_in_use(path)
    self._swap(path, int(version))

  def pause(self) -> None:
    with self._lock:
      self._paused = True
    self._post("/pause?mode=keep")

  def resume(self) -> None:
    self._post("/resume")
    with self._lock:
      self._paused = False
      self._lock.notify_all()

  def abort(self, group_id: int) -> None:
    with self._lock:
      kept = collections.deque()
      for seq in self._queue:
        if seq.group.request.group_id == group_id:
          seq.group.aborted = True
          self.emit(seq, "abort")
        else:
          kept.append(seq)
      self._queue = kept
      for a in self._active.values():
        if a.seq.group.request.group_id == group_id:
          a.seq.group.aborted = True
          self._close_stream(a)

  # ---- weight swap ---------------------------------------------------------------------------------

  def _swap(self, path: str, version: int) -> None:
    with self._swap_lock:
      t0 = time.time()
      with self._lock:
        self._swapping = True
        for a in self._active.values():
          a.preempted = True
      try:
        self._post("/pause?mode=abort")
        with self._lock:  # streams end with finish_reason "abort"; close stragglers
          if not self._lock.wait_for(lambda: not self._active, timeout=2.0):
            for a in self._active.values():
              self._close_stream(a)
            self._lock.wait_for(lambda: not self._active)
        self._post("/abort_requests", {})
        self._post("/collective_rpc", {"method": "load_policy_weights",
                                       "kwargs": {"weights_path": path}})
        for _ in range(100):
          if (self._post("/reset_prefix_cache") or {}).get("success"):
            break
          time.sleep(0.05)
        else:
          raise ServerError("vLLM did not reset its prefix cache after a weight update")
        if not self._paused:
          self._post("/resume")
      finally:
        with self._lock:
          self._swapping = False
          self._lock.notify_all()
      self.weights.mark_in_use(path, previous=self._loaded if self._loaded != path else None)
      with self._lock:
        self._loaded, self._version = path, version
        self._lock.notify_all()
      self.stats["swaps"] += 1
      self.stats["swap_s"] += time.time() - t0

  # ---- workers -------------------------------------------------------------------------------------

  @staticmethod
  def _close_stream(attempt: _Attempt) -> None:
    conn = attempt.conn
    if conn is not None and conn.sock is not None:
      try:
        conn.sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass

  def _worker(self) -> None:
    while True:
      with self._lock:
        self._lock.wait_for(lambda: self._stopping or (
            self._queue and not self._swapping and not self._paused))
        if self._stopping:
          return
        seq = self._queue.popleft()
        attempt = _Attempt(seq, self._version)
        self._active[id(attempt)] = attempt
      try:
        reason, error = self._stream(attempt)
      except Exception as e:  # connection reset by a swap / stop, or a broken server
        reason, error = None, f"{type(e).__name__}: {e}"
      with self._lock:
        del self._active[id(attempt)]
        self._lock.notify_all()
        self._settle(attempt, reason, error)

  def _settle(self, attempt: _Attempt, reason: str | None, error: str | None) -> None:
    """Called with the lock held when an attempt has ended."""
    seq = attempt.seq
    ours = self.finish_reason(seq, reason) if reason not in (None, "abort") else None
    if ours is not None and ours != "error":
      self.emit(seq, ours)
      self.stats["finished"] += 1
    elif seq.group.aborted or self._stopping:
      self.emit(seq, "abort")
    elif attempt.preempted and seq.remaining > 0:
      self._queue.appendleft(seq)  # continue under the new weights, before new work
      self.stats["resubmitted"] += 1
    else:
      self.emit(seq, "error", error or f"vLLM ended the request with finish_reason={reason!r}")

  def _stream(self, attempt: _Attempt) -> tuple[str | None, str | None]:
    """Runs one attempt; returns (vLLM finish reason or None, error text or None)."""
    seq = attempt.seq
    body = dict(model=SERVED_NAME, prompt=seq.prompt, stream=True, return_token_ids=True,
                **seq.attempt_fields(self.per_request_seeds))
    conn = http.client.HTTPConnection(self._host, self._port, timeout=self.request_timeout)
    attempt.conn = conn
    try:
      conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                   headers={"Content-Type": "application/json"})
      with self._lock:
        if attempt.preempted or seq.group.aborted or self._stopping:
          self._close_stream(attempt)
      resp = conn.getresponse()
      if resp.status != 200:
        return None, f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:2000]}"
      reason = None
      while True:
        line = resp.readline()
        if not line:
          break
        line = line.strip()
        if not line.startswith(b"data:"):
          continue
        data = line[5:].strip()
        if data == b"[DONE]":
          break
        chunk = json.loads(data)
        if "error" in chunk:
          return None, f"vLLM: {chunk['error']}"
        for choice in chunk.get("choices", ()):
          tokens = choice.get("token_ids") or []
          logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
          seq.add(tokens, logprobs, attempt.version)
          self.stats["tokens"] += len(tokens)
          reason = choice.get("finish_reason") or reason
      return reason, None
    finally:
      conn.close()
