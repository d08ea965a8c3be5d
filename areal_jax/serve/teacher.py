"""The OPD teacher: logprobs of a turn's original response tokens under the hinted prompt.

Hindsight-guided on-policy distillation asks how likely the response the policy gave would have
been, had the prompt carried the hint the judge took from what came next: the hint joins the last
user message (``serve.hint_format``), the conversation is encoded with the chat template as
serving encodes it, and the teacher scores the *original* response tokens after it, teacher-forced.
Two teachers:
  * ``BaseTeacher`` (``serve.teacher_url`` ""): by default the frozen weights the run started
    from, copied once before anything trains; with ``serve.teacher_weights = "current"`` the policy
    being trained (``follow``), so that ``teacher - student`` is only what the hint changes, not
    also how far training moved the policy from its start: at the trainer its weights are read
    before each scoring; at the judge each version serving is handed (``FollowingEngine``). One
    jitted forward scores ``serve.teacher_batch`` turns of similar length at a time, lengths
    bucketed (a few shapes compile; finer on CPU), and only the response positions reach the LM
    head;
  * ``RemoteTeacher``: an OpenAI-compatible server's ``/completions`` with ``prompt_logprobs``
    (vLLM's extension: per prompt token, its logprob and the top ones by token id), the prompt being
    the hinted prompt's token ids followed by the response's.
Where it runs (``serve.teacher_at``): a ``TeacherStage`` takes the turns the judge left ``hinted``
(a hint, no teacher logprobs yet) and stores their judgement. With "trainer" the trainer loop runs
it before each step, on the learner's devices (with ``serve.trainer_process`` in that process, on
its cores: serving never waits for a teacher forward); with "judge" the judge loop runs it right
after judging, on the sampler's devices beside the engine (its forwards then share the server's
devices and cores with decoding).
Both return per turn ``{"logprobs": [c floats]}`` (with ``serve.teacher_topk`` k > 0 also
``topk_ids`` / ``topk_logprobs``, ``[c][k]``), or None when the hinted sequence is longer than the
teacher takes (the turn then gives no OPD signal). Logprobs are those of ``softmax(logits / T)``
at the sampling temperature, like the learner's (the remote server's as it computes them).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
import urllib.request
from collections.abc import Callable

import numpy as np

from areal_jax.chat_template import chat_text

log = logging.getLogger(__name__)


def hinted_messages(messages: list[dict], hint: str, fmt: str) -> list[dict]:
  """``messages`` with ``hint`` joined to the last user message (``fmt``: {message}, {hint})."""
  out = copy.deepcopy(messages)
  users = [i for i, m in enumerate(out) if m.get("role") == "user"]
  if not users:
    raise ValueError("the turn's messages have no user message to join the hint to")
  last = out[users[-1]]
  last["content"] = fmt.format(message=last.get("content") or "", hint=hint)
  return out


def _bucket(n: int, smallest: int) -> int:
  """The smallest power-of-two multiple of ``smallest`` that holds ``n``."""
  b = smallest
  while b < n:
    b *= 2
  return b


def _length_bucket(n: int, smallest: int, fine: bool) -> int:
  """``n``'s power-of-two bucket (``_bucket``), or with ``fine`` ``n`` rounded up to a multiple of
  an eighth of it: four shapes per doubling, and above ``smallest`` under a fifth of the
  length is padding (the power-of-two bucket alone pads 153 tokens, a hinted arithmetic turn, to
  256)."""
  b = _bucket(n, smallest)
  if not fine:
    return b
  step = max(b // 8, 1)
  return max(smallest, -(-n // step) * step)


class _Teacher:
  """What both teachers share: the hinted prompt's tokens, the length bound, the batch."""

  current = False  # True: scores with the weights last handed to ``follow`` (BaseTeacher)

  def __init__(self, encode: Callable[[list[dict]], list[int]], hint_format: str, topk: int,
               max_len: int):
    self.encode, self.hint_format, self.topk, self.max_len = encode, hint_format, int(topk), max_len

  def sequences(self, items: list[tuple[dict, str]]) -> list[tuple[list[int], list[int]] | None]:
    """``(hinted prompt tokens, response tokens)`` per turn; None over ``max_len`` tokens or when
    the template rejects the hinted conversation."""
    out = []
    for turn, hint in items:
      try:
        prompt = self.encode(hinted_messages(turn["messages"], hint, self.hint_format))
      except Exception:  # pylint: disable=broad-except  (the template rejects it: no OPD signal)
        out.append(None)
        continue
      response = list(turn["completion_tokens"])
      ok = prompt and response and len(prompt) + len(response) <= self.max_len
      out.append((list(prompt), response) if ok else None)
    return out

  def score(self, items: list[tuple[dict, str]]) -> list[dict | None]:
    seqs = self.sequences(items)
    found = [(i, s) for i, s in enumerate(seqs) if s is not None]
    out: list[dict | None] = [None] * len(items)
    for i, res in zip([i for i, _ in found], self.score_tokens([s for _, s in found])):
      out[i] = res
    return out

  def score_tokens(self, seqs: list[tuple[list[int], list[int]]]) -> list[dict]:
    raise NotImplementedError


class BaseTeacher(_Teacher):
  """The model's weights on ``mesh``: the frozen start weights, or with ``current`` those given to
  ``follow`` (see the module docstring)."""

  def __init__(self, model, mesh, encode, hint_format: str, temperature: float, topk: int = 0,
               batch: int = 4, max_len: int = 1024, current: bool = False):
    from flax import nnx  # pylint: disable=import-outside-toplevel

    from areal_jax.kernels import choice  # pylint: disable=import-outside-toplevel

    super().__init__(encode, hint_format, topk, max_len)
    if temperature <= 0:
      raise ValueError(f"the teacher's temperature must be > 0, got {temperature}")
    self.mesh, self.temperature, self.batch = mesh, float(temperature), max(1, int(batch))
    # On CPU a forward's time follows its length and a compile takes seconds: finer length
    # buckets. On accelerators padding costs less than the compiles more shapes would bring.
    self.fine_buckets = choice.platform_of(mesh) == "cpu"
    self.graphdef = nnx.graphdef(model)
    self.current, self._fns = current, {}  # _fns: the jitted forward, built on first use
    # with current: set by follow
    self.params = None if current else start_weights(model, mesh)

  def _fn(self):
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from flax import nnx  # pylint: disable=import-outside-toplevel

    from areal_jax import sharding  # pylint: disable=import-outside-toplevel
    from areal_jax.models import train_forward  # pylint: disable=import-outside-toplevel
    from areal_jax.models.transformer import linear  # pylint: disable=import-outside-toplevel

    if "score" in self._fns:
      return self._fns["score"]
    graphdef, mesh, temp, k = self.graphdef, self.mesh, self.temperature, self.topk

    def score(params, tokens_NxL, start_N, response_NxC):
      """Logprobs of ``response_NxC``, the tokens at ``start_N + j`` of each row (and the top k)."""
      with sharding.use(mesh):
        model = nnx.merge(graphdef, params)
        # one sequence a row from position 0 (the padding after it is never attended to)
        h_NxLxE = train_forward.hidden(model, tokens_NxL, None, jnp.ones_like(tokens_NxL))
        c = response_NxC.shape[1]
        # position p scores token p + 1: the response's token j is scored at start + j - 1
        at_NxC = jnp.clip(start_N[:, None] - 1 + jnp.arange(c), 0, tokens_NxL.shape[1] - 1)
        h_NxCxE = jnp.take_along_axis(h_NxLxE, at_NxC[..., None], axis=1)
        w, transpose_w = train_forward.head_weight(model)
        logits = linear(h_NxCxE, w, transpose_w, out_dtype=jnp.float32) / temp
        logp_NxCxV = jax.nn.log_softmax(logits, axis=-1)
        logp_NxC = jnp.take_along_axis(logp_NxCxV, response_NxC[..., None], axis=-1)[..., 0]
        if not k:
          return logp_NxC, None, None
        top_logp, top_ids = jax.lax.top_k(logp_NxCxV, k)
        return logp_NxC, top_ids, top_logp

    self._fns["score"] = jax.jit(score)
    return self._fns["score"]

  def follow(self, params) -> None:
    """With ``current``: score with ``params`` (the trained model's full parameters, an NNX pure
    dict on the mesh) from the next forward on; they are read, not copied: hand it arrays no one
    donates while it scores (the learner's right before scoring, or a version handed to serving)."""
    if not self.current:
      raise ValueError("the teacher holds the run's start weights (serve.teacher_weights='start')")
    self.params = params

  def score_tokens(self, seqs):
    import jax  # pylint: disable=import-outside-toplevel

    params = self.params  # one version for the whole call (follow may run in another thread)
    if params is None:
      raise RuntimeError("the current-weights teacher has no weights yet: call follow first")
    fn, out = self._fn(), [None] * len(seqs)
    # shortest first: a forward's rows are padded to its longest
    order = sorted(range(len(seqs)), key=lambda j: len(seqs[j][0]) + len(seqs[j][1]))
    for i in range(0, len(seqs), self.batch):
      at = order[i:i + self.batch]
      part = [seqs[j] for j in at]
      l = _length_bucket(max(len(p) + len(r) for p, r in part), 64, self.fine_buckets)
      c = _bucket(max(len(r) for _, r in part), 16)
      tokens = np.zeros((self.batch, l), np.int32)
      start = np.ones((self.batch,), np.int32)
      response = np.zeros((self.batch, c), np.int32)
      for row, (p, r) in enumerate(part):
        tokens[row, :len(p) + len(r)] = p + r
        start[row] = len(p)
        response[row, :len(r)] = r
      logp, ids, top = jax.device_get(fn(params, tokens, start, response))
      for row, (j, (_, r)) in enumerate(zip(at, part)):
        n = len(r)
        res = {"logprobs": logp[row, :n].astype(float).tolist()}
        if self.topk:
          res.update(topk_ids=ids[row, :n].tolist(), topk_logprobs=top[row, :n].astype(float).tolist())
        out[j] = res
    return out


def start_weights(model, mesh) -> dict:
  """A copy of ``model``'s parameters on ``mesh`` (an NNX pure dict): the engine's weights change
  with every version and a learner built from ``model`` may donate its arrays; these stay."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from areal_jax import sharding  # pylint: disable=import-outside-toplevel

  return jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x,
                      jax.device_put(nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                                     sharding.param_shardings(model, mesh)))


class FollowingEngine:
  """The serving engine as the weight publishers see it, with the current-weights teacher at the
  judge (``serve.teacher_at = "judge"``, ``serve.teacher_weights = "current"``): each version
  handed to ``update_params`` is handed to the teacher too, so that it scores a turn with the
  weights serving is on (those that wrote the turn, or a version or two later); everything else
  passes through. Holds one more copy of the weights, the version's as the publisher gave it."""

  def __init__(self, engine, teacher: BaseTeacher):
    self.engine, self.teacher = engine, teacher

  def update_params(self, params, version: int) -> None:
    self.engine.update_params(params, version)
    self.teacher.follow(params)

  def __getattr__(self, name):
    return getattr(self.engine, name)


class RemoteTeacher(_Teacher):
  """A teacher at an OpenAI-compatible server returning prompt logprobs (module docstring)."""

  def __init__(self, base_url: str, model: str, encode, hint_format: str, topk: int = 0,
               max_len: int = 1024, timeout_s: float = 120.0, max_bytes: int = 64 << 20):
    super().__init__(encode, hint_format, topk, max_len)
    self.url = base_url.rstrip("/") + "/completions"
    self.model, self.timeout_s, self.max_bytes = model, timeout_s, max_bytes

  def score_tokens(self, seqs):
    return [self._one(p, r) for p, r in seqs]

  def _one(self, prompt: list[int], response: list[int]) -> dict:
    body = json.dumps({"model": self.model, "prompt": prompt + response, "max_tokens": 1,
                       "temperature": 1.0, "prompt_logprobs": self.topk}).encode()
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("OPENAI_API_KEY")
    if key:
      headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
      raw = r.read(self.max_bytes + 1)
    if len(raw) > self.max_bytes:
      raise ValueError(f"the teacher at {self.url} answered more than {self.max_bytes} bytes")
    return parse_prompt_logprobs(json.loads(raw), len(prompt), response, self.topk)


def parse_prompt_logprobs(reply: dict, prompt_len: int, response: list[int], topk: int) -> dict:
  """The response's logprobs (and top k) from a ``/completions`` reply's ``prompt_logprobs``
  (per prompt token a ``{token id: {"logprob": x, "rank": r}}`` map, the first token's None)."""
  try:
    entries = reply["choices"][0]["prompt_logprobs"]
  except (KeyError, IndexError, TypeError) as e:
    raise ValueError("the teacher's reply has no choices[0].prompt_logprobs (a server that "
                     "returns prompt logprobs, e.g. vLLM, is needed)") from e
  if not isinstance(entries, list) or len(entries) != prompt_len + len(response):
    raise ValueError(f"the teacher returned prompt logprobs for "
                     f"{len(entries) if isinstance(entries, list) else 0} tokens, "
                     f"expected {prompt_len + len(response)}")
  out = {"logprobs": []}
  if topk:
    out.update(topk_ids=[], topk_logprobs=[])
  for j, token in enumerate(response):
    entry = entries[prompt_len + j] or {}
    got = entry.get(str(token))
    if got is None:
      raise ValueError(f"the teacher's prompt logprobs lack response token {j} (id {token})")
    out["logprobs"].append(float(got["logprob"]))
    if topk:
      ranked = sorted(((v.get("rank") or 1 << 30, int(t), float(v["logprob"]))
                       for t, v in entry.items()), key=lambda x: (x[0], -x[2]))[:topk]
      if len(ranked) < topk:
        raise ValueError(f"the teacher returned {len(ranked)} top logprobs for response token "
                         f"{j}, serve.teacher_topk={topk}")
      out["topk_ids"].append([t for _, t, _ in ranked])
      out["topk_logprobs"].append([lp for _, _, lp in ranked])
  return out


def judgement(signal: str, turn_id: int, score, hint=None, teacher=None) -> tuple:
  """A turn's judgement for ``TurnStore.set_judgements``: "judged" when it has what
  ``serve.signal`` trains with (binary: a score; opd: the teacher's logprobs; combined: either),
  else "unjudgeable"."""
  usable = {"binary": score is not None, "opd": teacher is not None,
            "combined": score is not None or teacher is not None}[signal]
  return turn_id, "judged" if usable else "unjudgeable", score, hint, teacher


class TeacherStage:
  """Judges ``hinted`` turns: the teacher scores their responses under their hints (one batched
  call) and each gets its judgement (``judgement``). Counts into ``stats`` (its owner's):
  ``teacher_turns`` sent, ``teacher_scored``, ``teacher_s``, ``teacher_errors``. A teacher's
  failure leaves the turns hinted: the next pass tries again."""

  def __init__(self, teacher, signal: str, stats: dict, limit: int = 64, ahead=None):
    """``ahead``: ``(batch_size, trainable)`` when a trainer in another loop takes the judged
    turns, oldest first (the judge loop's teacher while training; ``trainable(row)``: whether the
    trainer may still train the turn, ``store.skip_reason`` at the version it is expected at):
    each pass scores only the hinted turns among the next batch it will take, so that no forward
    goes to a turn that goes stale untrained (the turns of one version beyond a batch often do:
    the trainer takes the oldest it may still train). None: the newest ``limit`` hinted turns
    (when the teacher falls behind, the freshest are the ones worth training)."""
    self.teacher, self.signal, self.stats, self.limit = teacher, signal, stats, limit
    self.ahead = ahead
    for k in ("teacher_turns", "teacher_scored", "teacher_errors"):
      stats.setdefault(k, 0)
    stats.setdefault("teacher_s", 0.0)

  def run_once(self, store) -> int:
    """Scores the hinted turns due (``ahead``); returns how many got a judgement."""
    rows = store.hinted(self.limit) if self.ahead is None else self.next_hinted(store)
    return len(rows) if rows and self.score(store, rows) else 0

  def next_hinted(self, store) -> list[dict]:
    """With ``ahead``: the hinted turns among the trainer's next batch, the oldest untrained main
    turns it may still train."""
    batch, trainable = self.ahead
    due = [r for r in store.trainable(4 * batch + 64, hinted=True) if trainable(r)][:batch]
    return [r for r in due if r["judge_status"] == "hinted"][:self.limit]

  def score(self, store, rows: list[dict]) -> bool:
    """The teacher scores ``rows`` (hinted turns) and their judgements are stored; False when the
    teacher failed (the turns stay hinted)."""
    t0 = time.time()
    try:
      scored = self.teacher.score([(r, r["hint"]) for r in rows])
    except Exception as e:  # pylint: disable=broad-except  (a teacher server's outage: retry)
      self.stats["teacher_errors"] += 1
      log.warning("the teacher failed on %d turns: %s", len(rows), e)
      return False
    self.stats["teacher_s"] += time.time() - t0
    self.stats["teacher_turns"] += len(rows)
    self.stats["teacher_scored"] += sum(t is not None for t in scored)
    store.set_judgements([judgement(self.signal, r["id"], r["score"], r["hint"], t)
                          for r, t in zip(rows, scored)], from_status="hinted")
    return True

  def trains_without(self, row: dict) -> bool:
    """Whether the hinted turn ``row`` has a signal without the teacher's logprobs (combined: its
    score)."""
    return judgement(self.signal, row["id"], row["score"], row["hint"])[1] == "judged"


def release(store, signal: str, rows: list[dict]) -> None:
  """Judges hinted turns without the teacher's forward, so that they leave the hinted state: turns
  nobody will train (stale, another temperature), or, when the teacher failed, turns their score
  trains alone."""
  if rows:
    store.set_judgements([judgement(signal, r["id"], r["score"], r["hint"]) for r in rows],
                         from_status="hinted")


def chat_encoder(tokenizer, enable_thinking: bool) -> Callable[[list[dict]], list[int]]:
  """``encode(messages)``: the token ids of the conversation with the chat template, as serving
  encodes a request's messages (``chat_template.chat_text``)."""
  return lambda messages: list(tokenizer.encode(chat_text(tokenizer, messages, enable_thinking)))


def build(config, model, mesh, tokenizer, at: str):
  """The OPD teacher for the loop ``at`` ("trainer" | "judge") on ``mesh``, or None where that loop
  runs none (``serve.signal`` binary, no judge, or ``serve.teacher_at`` names the other loop).
  Build it before anything trains ``model``: the start-weights teacher copies them."""
  s, c_roll = config.serve, config.rollout
  if s.signal == "binary" or s.judge == "none" or s.teacher_at != at:
    return None
  longest = c_roll.max_prompt_len + c_roll.max_new_tokens + s.hint_max_chars  # the hint's share
  encode = chat_encoder(tokenizer, config.task.enable_thinking)
  if s.teacher_url:
    return RemoteTeacher(s.teacher_url, s.teacher_model, encode, s.hint_format, s.teacher_topk,
                         longest)
  current = s.teacher_weights == "current"
  teacher = BaseTeacher(model, mesh, encode, s.hint_format, c_roll.temperature, s.teacher_topk,
                        s.teacher_batch, longest, current=current)
  if current and at == "judge":  # until the first version arrives: the weights serving starts on
    teacher.follow(start_weights(model, mesh))
  return teacher
