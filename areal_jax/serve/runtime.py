"""The four loops of learning from serving, built from a config and started side by side.

  serving  - uvicorn (a thread) running the Starlette app; the rollout engine decodes in its own
             thread and applies new weights between decode steps;
  recording- inside serving: each turn is committed to the store before its response ends;
  judging  - ``JudgeLoop`` (a thread) scores turns from their next state;
  training - ``TrainerLoop`` (a thread) trains on judged turns and publishes versions; with
             ``serve.trainer_process`` it runs in its own process pinned to its own cores
             (``trainer_supervisor``), versions reach the engine through Orbax and a watcher.
None waits on another: the judge and trainer only meet serving through the store (SQLite, WAL) and
``engine.update_params``. Each can be stopped, killed or restarted on its own (``restart_judge``,
``restart_trainer``), resuming from the store and the newest checkpoint.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import jax
import uvicorn
from jax.sharding import NamedSharding, PartitionSpec as P

from areal_jax import config as config_lib
from areal_jax.models import lora as lora_lib
from areal_jax.rollout_api import SamplingParams
from areal_jax.runtime import engines, errors, meshes, model_source, weight_transfer
from areal_jax.runtime.ray_worker import pin_process
from areal_jax.serve import access, judge as judge_lib, teacher as teacher_lib
from areal_jax.serve.app import ServeContext, build_app
from areal_jax.serve.dispatch import Dispatcher
from areal_jax.serve.protocol import ApiError
from areal_jax.serve.status import ServeStatus
from areal_jax.serve.store import TurnStore, skip_reason
from areal_jax.serve import trainer_process, trainer_supervisor

log = logging.getLogger(__name__)


def check_listen(host: str, port: int) -> None:
  """A ``ConfigError`` naming ``serve.host`` / ``serve.port`` when this process cannot listen there
  (another server holds the port, an address this host does not have); ``port`` 0 (any free
  one) always can."""
  if port == 0:
    return
  where = f"serve.host={host!r}, serve.port={port}"
  try:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
  except socket.gaierror as e:
    raise config_lib.ConfigError(f"{where}: the host does not resolve ({e.strerror})") from e
  with socket.socket(family, kind, proto) as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
      sock.bind(address)
    except OSError as e:
      raise config_lib.ConfigError(
          f"{where}: cannot listen there ({e.strerror}); if another server holds the port, stop "
          "it or choose another serve.port (0: any free port)") from e


class ServeRuntime:
  """``start()`` brings up the four loops, ``stop()`` ends them (trainer checkpoints first)."""

  def __init__(self, config, workdir: str, port: int | None = None, cores=None, trainer_args=()):
    """``cores``: ``(server_cores, trainer_cores)`` when the caller already pinned itself (the CLI
    does, before importing JAX); otherwise planned here (``serve.trainer_process``) and this
    process's threads are pinned to the server's share until ``stop``."""
    s = config.serve
    self._affinity = os.sched_getaffinity(0)
    if cores is None:  # before the first JAX computation sizes XLA's CPU thread pool
      cores = trainer_supervisor.plan_cores(config)
      if cores is not None:
        pin_process(cores[0])
    config_lib.validate(config, jax.device_count())
    self.config, self.workdir = config, os.path.abspath(workdir)
    errors.make_run_dir(self.workdir)
    # who may use it, before the model loads and warms up: keys, or loopback only
    self.keys = access.load_keys(s.api_keys)
    access.check_bind(s.host, self.keys)
    check_listen(s.host, s.port if port is None else port)
    self.cores = cores
    learner_mesh, sampler_mesh = meshes.build(config.mesh)
    model, self.tokenizer = model_source.load(config)
    # the OPD teacher's copy of the start weights (serve.teacher_at = "judge"), before anything
    # trains or plans the devices
    self.teacher = teacher_lib.build(config, model, sampler_mesh, self.tokenizer, at="judge")
    # the sampler's memory plan against its devices (fewer slots when they do not fit; a
    # MemoryError naming the keys when not even a group's do), before anything is opened
    self.engine = engines.build(config, model, self.tokenizer, sampler_mesh,
                                memory_budget=engines.sampler_budget(config, sampler_mesh),
                                keep_turns=s.keep_turns)
    self.store = TurnStore(s.db_path or os.path.join(self.workdir, "turns.sqlite"))
    self.dispatcher = Dispatcher(self.engine)
    # where versions reach serving; a current-weights teacher at the judge follows them there
    publish_to = self.engine
    if self.teacher is not None and self.teacher.current:
      publish_to = teacher_lib.FollowingEngine(self.engine, self.teacher)
    self.trainer = self.watcher = None
    if s.train and s.trainer_process:  # the trainer in its own process, versions through Orbax
      self.trainer = trainer_supervisor.TrainerProcess(
          config, self.workdir, cores[1] if cores else None, trainer_args)
      # (with LoRA a version is the adapters: the engine merges them into its base)
      target = weight_transfer.version_target(
          model, sampler_mesh, lora_lib.LoraConfig.from_config(config.actor.get("lora")),
          weight_transfer.version_dtype(config))
      receiver = weight_transfer.OrbaxReceiver(trainer_process.weights_path(config, self.workdir),
                                               target)
      self.watcher = trainer_supervisor.WeightsWatcher(self.trainer, receiver, publish_to,
                                                       s.weights_poll_s)
    elif s.train:
      def transfer_fn(learner):
        shardings = weight_transfer.target_shardings(model, sampler_mesh)
        if learner.lora is not None:  # adapters only, replicated on the sampler
          shardings = jax.tree.map(lambda _: NamedSharding(sampler_mesh, P()), learner.params())
        self._new_transfer = lambda: weight_transfer.build(
            config.weights, self.workdir, learner_mesh, sampler_mesh, learner.params(),
            shardings=shardings, dtype=weight_transfer.version_dtype(config))
        return self._new_transfer()
      self.trainer = trainer_process.build_trainer(config, self.workdir, self.store, model,
                                                   self.tokenizer, learner_mesh, transfer_fn,
                                                   publish_to)
      self.trainer.restore()
      self.trainer.publish()  # serve the restored version from the first request
    self.judge = self._build_judge()
    self.status_line = ServeStatus(self._counters, s.status_every_s)
    c_roll = config.rollout
    self.context = ServeContext(
        tokenizer=self.tokenizer, dispatcher=self.dispatcher, store=self.store,
        model_name=s.model_name, max_prompt_len=c_roll.max_prompt_len,
        max_new_tokens=c_roll.max_new_tokens, temperature=c_roll.temperature,
        max_candidates=min(s.max_candidates, c_roll.num_slots),
        enable_thinking=config.task.enable_thinking,
        keep_turns=s.keep_turns, status=self.status, keys=self.keys,
        rate_limit_per_min=s.rate_limit_per_min, max_body_bytes=s.max_body_bytes)
    self.app = build_app(self.context)
    self._port = s.port if port is None else port
    self._server: uvicorn.Server | None = None
    self._server_thread: threading.Thread | None = None

  def _build_judge(self):
    s = self.config.serve
    if s.judge == "none":
      return None
    hints = None if s.signal == "binary" else judge_lib.Hints(
        s.hint_start, s.hint_end, s.hint_min_chars, s.hint_max_chars, s.hint_keep_verdict)
    if s.judge == "rule":
      judge = judge_lib.RuleJudge(hints)
    elif s.judge == "votes":
      prompt = s.judge_vote_prompt if hints is None else s.judge_hint_prompt
      judge = judge_lib.VotesJudge(self._vote_sampler(), prompt, s.judge_votes, hints)
    else:
      judge = judge_lib.ModelJudge(self._judge_completer(), s.judge_prompt, s.judge_scale)
    # While training, the judge's teacher scores only the hinted turns the trainer takes next:
    # those it may still train at the version after serving's (it is that far ahead once it has
    # published a version serving has not swapped in yet).
    temperature = self.config.rollout.temperature
    ahead = (self.config.actor.batch_size, lambda row: skip_reason(
        row, self.engine.version + 1, s.max_staleness, temperature) is None) if s.train else None
    return judge_lib.JudgeLoop(self.store, judge, s.judge_interval_s, s.judge_timeout_s,
                               s.signal, self.teacher, s.hint_cut_off, ahead)

  def _vote_sampler(self):
    """``sample(messages, n) -> n texts`` for the votes judge: one request of ``n`` samples at
    ``serve.judge_url`` (topped up one request at a time where the backend ignores ``n``), or ``n``
    samples of this server's own policy, in one group on the engine (not recorded)."""
    s = self.config.serve
    if s.judge_url:
      return judge_lib.openai_sampler(s.judge_url, s.judge_model, s.judge_vote_temperature,
                                      s.judge_vote_max_tokens)
    most = min(s.max_candidates, self.config.rollout.num_slots)
    if s.judge_votes > most:
      raise ValueError(f"serve.judge_votes={s.judge_votes} is more samples than one request may "
                       f"take here ({most}: serve.max_candidates, rollout.num_slots)")
    params = SamplingParams(temperature=s.judge_vote_temperature,  # within the engine's plan
                            max_new_tokens=min(s.judge_vote_max_tokens,
                                               self.config.rollout.max_new_tokens))

    def sample_here(messages, n):
      try:
        prompt = self.context.encode(messages, limit=self.config.rollout.max_prompt_len)
      except ApiError:  # a judge prompt over the context length: every vote abstains
        return []
      samples = self.dispatcher.generate_many(prompt, n, params)
      return [self.tokenizer.decode(x.tokens) for x in samples]
    return sample_here

  def _judge_completer(self):
    s = self.config.serve
    if s.judge_url:
      import openai  # pylint: disable=import-outside-toplevel

      client = openai.OpenAI(base_url=s.judge_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))

      def complete(messages):
        out = client.chat.completions.create(model=s.judge_model, messages=messages,
                                             temperature=0, max_tokens=16)
        return out.choices[0].message.content or ""
      return complete

    def complete_here(messages):  # this server's own policy, greedy, not recorded
      sample = self.dispatcher.generate(self.context.encode(messages),
                                        SamplingParams(greedy=True, max_new_tokens=16))
      return self.tokenizer.decode(sample.tokens)
    return complete_here

  # ---- lifecycle --------------------------------------------------------------------------------

  @property
  def url(self) -> str:
    return f"http://{self.config.serve.host}:{self.port}/v1"

  @property
  def port(self) -> int:
    if self._server is not None and self._server.servers:
      return self._server.servers[0].sockets[0].getsockname()[1]
    return self._port

  @property
  def trainer_in_process(self) -> bool:
    return isinstance(self.trainer, trainer_supervisor.TrainerProcess)

  def start(self, timeout: float = 120.0, trainer_timeout: float = 900.0) -> None:
    """Starts the loops and the HTTP server. If it fails or is interrupted (a trainer process that
    stops on a fault, KeyboardInterrupt) it stops what it started, then raises."""
    try:
      self._start(timeout, trainer_timeout)
    except BaseException:
      self.stop()
      raise

  def _start(self, timeout: float, trainer_timeout: float) -> None:
    if self.trainer_in_process:  # it loads and restores while the engine warms up
      self.trainer.start()
    if self.config.serve.warmup and hasattr(self.engine, "warmup"):
      t0 = time.time()
      self.engine.warmup(_WarmupProgress(t0), continuations=self.config.serve.keep_turns)
      print(f"engine warm-up (every decode bucket compiled): {time.time() - t0:.0f} s", flush=True)
    if self.trainer_in_process:  # serve the trainer's restored version from the first request
      self.trainer.wait_announced(trainer_timeout)
      self.watcher.poll()
      self.watcher.start()
    self.dispatcher.start()
    uv_config = uvicorn.Config(self.app, host=self.config.serve.host, port=self._port,
                               log_level="warning", lifespan="off", timeout_graceful_shutdown=10)
    self._server = uvicorn.Server(uv_config)
    self._server_thread = threading.Thread(target=self._server.run, name="serve-http", daemon=True)
    self._server_thread.start()
    deadline = time.time() + timeout
    while not self._server.started:
      if not self._server_thread.is_alive() or time.time() > deadline:
        raise RuntimeError(f"the HTTP server did not start on {self.config.serve.host}:{self._port}")
      time.sleep(0.05)
    if self.judge is not None:
      self.judge.start()
    if self.trainer is not None and not self.trainer_in_process:
      self.trainer.start()
    print(f"serving {self.config.serve.model_name} (policy version {self.engine.version}) at "
          f"{self.url}; turns in {self.store.path}", flush=True)
    if self.keys is None:
      trains = " and trains the policy" if self.config.serve.train else ""
      print(f"no serve.api_keys: listening on loopback only; every local client is served{trains}",
            flush=True)
    else:
      print(f"access: {len(self.keys)} API keys (serve.api_keys), requests without one get 401",
            flush=True)
    self.status_line.start()

  def stop(self) -> None:
    """Judge and trainer first (the trainer checkpoints), then HTTP, then the engine."""
    self.status_line.stop()
    if self.judge is not None:
      self.judge.stop()
    if self.trainer is not None:
      self.trainer.stop()
    if self._server is not None:
      self._server.should_exit = True
      self._server_thread.join(timeout=30)
    if self.watcher is not None:
      self.watcher.stop()
    self.dispatcher.stop()
    if self.trainer is not None and not self.trainer_in_process:
      self.trainer.ckpt.close()
    self.store.close()
    if self.cores is not None:
      pin_process(self._affinity)

  def restart_judge(self) -> None:
    if self.judge is not None:
      self.judge.stop()
      self.judge = self._build_judge()
      self.judge.start()

  def restart_trainer(self, checkpoint: bool = True) -> None:
    """Stops (``checkpoint=False``: kills) the trainer, then resumes it from the newest checkpoint
    and the store, republishing that version."""
    if self.trainer is None:
      return
    self.trainer.stop(checkpoint=checkpoint)
    if self.trainer_in_process:  # a new process restores; the watcher follows its announcement
      self.trainer.start()
      return
    version = self.trainer.restore()
    if version != self.engine.version:  # steps after the checkpoint were lost: serve it again
      self.trainer.transfer = self._new_transfer()  # (their versions will be published anew)
      self.trainer.publish()
    self.trainer.start()

  def _counters(self) -> dict:
    """What the status line counts its windows over."""
    steps = None
    if self.trainer is not None:
      steps = self.trainer.stats.get("steps")
    return dict(version=self.engine.version, requests=self.dispatcher.requests,
                tokens=self.dispatcher.tokens, turns=self.store.counts(), train_steps=steps)

  def status(self) -> dict:
    out = {"turns": self.store.counts(), "serving": self.status_line.numbers()}
    for name in ("judge", "trainer"):
      loop = getattr(self, name, None)
      if loop is not None:
        out[name] = {"alive": loop.alive, "error": loop.error, **loop.stats}
    for name in ("judge", "trainer"):  # the loop that runs the teacher: its seconds per turn
      if "teacher_s" in out.get(name, {}):
        out[name]["teacher_s_per_turn"] = out[name]["teacher_s"] / max(out[name]["teacher_turns"], 1)
    if self.judge is not None and isinstance(self.judge.judge, judge_lib.VotesJudge):
      out["judge"]["votes"] = dict(self.judge.judge.stats)  # cast, abstained, verdicts
    if self.trainer_in_process:
      out["trainer"].update(process=True, weights_swaps=self.watcher.swaps,
                            weights_error=self.watcher.error)
    return out


class _WarmupProgress:
  """Prints how far the engine's warm-up compiling is, at most every ``every`` seconds (one decode
  program can take minutes to compile on a GPU)."""

  def __init__(self, t0: float, every: float = 10.0, clock=time.time):
    self.t0, self.every, self.last, self.clock = t0, every, t0, clock

  def __call__(self, done: int, total: int, what: str) -> None:
    now = self.clock()
    if now - self.last >= self.every and done < total:
      self.last = now
      print(f"engine warm-up: {done}/{total} programs compiled in {now - self.t0:.0f} s "
            f"(last: {what})", flush=True)
