"""The OpenAI-compatible HTTP API (Starlette): ``/v1/models``, ``/v1/chat/completions``, ``/health``.

Every request is tokenized with the model's chat template and sampled by the rollout engine with
the policy version current at each decode step. With ``keep_turns`` the engine keeps each finished
candidate's KV (the JAX sampler: ``sampler/continuation.py``; while the weights that made it are in
use), so a conversation's next request, whose prompt starts with this one's prompt and answer,
runs only its new messages through the model instead of the whole history. Its candidates are
written to the turn store (committed) before the last byte of the response: the body of a plain
response, the finish chunks and ``[DONE]`` of a stream. A conversation's turns are tied by the
session id: the ``X-Session-Id`` header, else the ``user`` field, else a new session per request
(returned in the ``X-Session-Id`` response header either way; such a one-turn session is done at
once). The session protocol's other headers: ``X-Turn-Type: main | side`` (a side turn is served
and recorded, never trained) and ``X-Session-Done: true`` (this request ends the session: its
turn is the last).

Access (``serve/access.py``): with ``serve.api_keys`` a ``/v1/...`` request needs a valid Bearer
key (401 ``invalid_api_key``); then each chat request passes the key's rate limit (429
``rate_limit_exceeded``, with ``Retry-After``) and the body limit (413 ``request_too_large``,
before the body is read when its Content-Length says so).

Errors are OpenAI error objects: 400 for malformed JSON (also nested too deep to parse), bad fields
and headers and a prompt over the context length (code ``context_length_exceeded``), 404 for an
unknown model (``model_not_found``), 503 when the engine stopped mid-request, 500 when generation
failed (or anything else did); 404 / 405 for a path or method not served, naming those that are.
A client that disconnects mid-stream has its request aborted in the engine (its slots free at the
next decode step) and nothing recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
import uuid
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from areal_jax.chat_template import chat_text
from areal_jax.rollout_api import Sample, SamplingParams
from areal_jax.serve import access, protocol
from areal_jax.serve.dispatch import Dispatcher
from areal_jax.serve.protocol import ApiError
from areal_jax.serve.store import TurnStore


@dataclasses.dataclass
class ServeContext:
  tokenizer: object
  dispatcher: Dispatcher
  store: TurnStore
  model_name: str
  max_prompt_len: int
  max_new_tokens: int
  temperature: float  # the default, and the one the learner trains at
  max_candidates: int = 8
  enable_thinking: bool = True  # task.enable_thinking, passed to the chat template
  keep_turns: bool = False  # the sampler keeps each turn's KV for the conversation's next request
  status: Callable[[], dict] = dict  # extra fields for /health (loop liveness)
  keys: dict[bytes, str] | None = None  # API key -> key id (access.load_keys); None: no keys
  rate_limit_per_min: int = 0  # chat requests per minute per key (per client address without keys)
  max_body_bytes: int = 1 << 20

  def __post_init__(self):
    self.limiter = access.RateLimiter(self.rate_limit_per_min)
    self.token_bound = access.TokenBound(self.tokenizer)

  def encode(self, messages: list[dict], limit: int | None = None) -> list[int]:
    """The prompt's token ids; with ``limit``, a 400 ``context_length_exceeded`` for more tokens
    (before tokenizing when the text alone shows it)."""
    try:
      text = chat_text(self.tokenizer, messages, self.enable_thinking)
      least = 0 if limit is None else self.token_bound.at_least(text)
      prompt = [] if limit is not None and least > limit else list(self.tokenizer.encode(text))
    except Exception as e:  # pylint: disable=broad-except  (the template rejects the conversation)
      raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from e
    if limit is not None and max(least, len(prompt)) > limit:
      what = f"at least {least}" if least > limit else f"{len(prompt)}"
      raise ApiError(400, f"this model's maximum context length for prompts is {limit} tokens; the "
                     f"messages take {what} tokens", "messages", "context_length_exceeded")
    return prompt


def _error(e: ApiError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _unauthorized(_: HTTPConnection, exc: Exception) -> JSONResponse:
  return _error(ApiError(401, str(exc), None, "invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"}))


async def _failed(_: Request, exc: Exception) -> JSONResponse:
  # anything unforeseen: still an OpenAI error object (Starlette logs the traceback)
  return _error(ApiError(500, f"internal error: {type(exc).__name__}", None, "internal_error",
                         "server_error"))


def build_app(ctx: ServeContext) -> Starlette:

  async def models(_: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [
        {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "areal_jax"}]})

  async def health(_: Request) -> JSONResponse:
    return JSONResponse({"status": "ok", "policy_version": ctx.dispatcher.engine.version,
                         "inflight": ctx.dispatcher.inflight(),
                         "finished": dict(ctx.dispatcher.finished), **ctx.status()})

  async def chat(request: Request):
    try:
      return await _chat(ctx, request)
    except ApiError as e:
      return _error(e)

  routes = [Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"])]
  served = ", ".join(f"{m} {r.path}" for r in routes for m in sorted(r.methods - {"HEAD"}))

  async def not_served(request: Request, exc: HTTPException) -> JSONResponse:
    # (an OpenAI error object, as for the API's own errors, so that clients report it as one)
    what = ("is not an endpoint of this server" if exc.status_code == 404 else
            "is not a method this endpoint takes" if exc.status_code == 405 else exc.detail)
    response = _error(ApiError(exc.status_code, f"{request.method} {request.url.path} {what}; "
                               f"this server serves {served}"))
    response.headers.update(exc.headers or {})  # (a 405's Allow)
    return response

  return Starlette(routes=routes, exception_handlers={HTTPException: not_served, Exception: _failed},
                   middleware=[Middleware(AuthenticationMiddleware, backend=access.KeyAuth(ctx.keys),
                                          on_error=_unauthorized)])


async def _chat(ctx: ServeContext, request: Request):
  key_id = access.request_key_id(request)
  ctx.limiter.check(key_id or (request.client.host if request.client else ""))
  raw = await access.read_body(request, ctx.max_body_bytes)
  turn_type, done = protocol.session_headers(request.headers)
  try:
    body = json.loads(raw)
  except RecursionError as e:
    raise ApiError(400, "malformed JSON in the request body: nested too deeply") from e
  except ValueError as e:  # (also invalid UTF-8 and integers too long to convert)
    raise ApiError(400, f"malformed JSON in the request body: {e}") from e
  req = protocol.parse_chat_request(body, ctx.max_candidates)
  if req.model != ctx.model_name:
    raise ApiError(404, f"the model {req.model!r} does not exist; this server serves "
                   f"{ctx.model_name!r} (GET /v1/models)", "model", "model_not_found")
  session = request.headers.get("x-session-id") or req.user
  if not session:  # a session of one turn: nothing can follow it, it is done
    session, done = f"s-{uuid.uuid4().hex}", True
  prompt = ctx.encode(req.messages, ctx.max_prompt_len)
  max_tokens = ctx.max_new_tokens if req.max_tokens is None else req.max_tokens
  if max_tokens > ctx.max_new_tokens:
    raise ApiError(400, f"max_tokens={max_tokens} exceeds this server's limit of "
                   f"{ctx.max_new_tokens} completion tokens", "max_tokens")
  temperature = ctx.temperature if "temperature" not in body or body["temperature"] is None \
      else req.temperature
  params = SamplingParams(temperature=temperature or 1.0, greedy=temperature == 0,
                          top_p=req.top_p, max_new_tokens=max_tokens,
                          seed=random.getrandbits(31) if req.seed is None else req.seed)
  group_id, queue = ctx.dispatcher.submit(prompt, req.n, params,
                                          {"continue": True} if ctx.keep_turns else None)
  rid = f"chatcmpl-{uuid.uuid4().hex}"
  turn = _Turn(ctx, req, session, rid, prompt, temperature, key_id, turn_type, done)
  headers = {"x-session-id": session}
  if req.stream:
    return StreamingResponse(_stream(ctx, turn, group_id, queue), media_type="text/event-stream",
                             headers=headers)
  done = False
  try:
    samples = {}
    while len(samples) < req.n:
      item = await queue.get()
      if item[0] == "done":
        samples[item[1].index] = item[1]
    done = True
  finally:
    ctx.dispatcher.release(group_id, abort=not done)
  ordered = [samples[i] for i in range(req.n)]
  _raise_failed(ordered)
  ids, index = await turn.record(ordered)
  choices = []
  for s in ordered:
    choice = {"index": s.index, "finish_reason": protocol.finish_reason(s.finish_reason),
              "message": {"role": "assistant", "content": ctx.tokenizer.decode(s.tokens)}}
    if req.logprobs:
      choice["logprobs"] = protocol.logprobs_content(ctx.tokenizer, s.tokens, s.logprobs)
    choices.append(choice)
  completion = sum(len(s.tokens) for s in ordered)
  usage = {"prompt_tokens": len(prompt), "completion_tokens": completion,
           "total_tokens": len(prompt) + completion}
  return JSONResponse(protocol.completion_body(rid, ctx.model_name, choices, usage, turn.extra(ids, index, ordered)),
                      headers=headers)


def _raise_failed(samples: list[Sample]) -> None:
  for s in samples:
    if s.finish_reason == "abort":
      raise ApiError(503, "the engine stopped before the request finished; retry", None,
                     "engine_stopped", "server_error")
    if s.finish_reason == "error":
      raise ApiError(500, f"generation failed: {s.error}", None, "generation_failed", "server_error")


@dataclasses.dataclass
class _Turn:
  ctx: ServeContext
  req: protocol.ChatRequest
  session: str
  rid: str
  prompt: list[int]
  temperature: float
  key_id: str | None = None
  turn_type: str = "main"
  done: bool = False

  async def record(self, samples: list[Sample]) -> tuple[list[int], int]:
    """Commits the candidates to the store; returns their row ids and the turn index."""
    rows = [dict(session_id=self.session, request_id=self.rid, candidate=s.index,
                 messages=self.req.messages, prompt_tokens=self.prompt, completion_tokens=s.tokens,
                 logprobs=s.logprobs, versions=s.versions,
                 completion_text=self.ctx.tokenizer.decode(s.tokens),
                 finish_reason=s.finish_reason, temperature=self.temperature) for s in samples]
    try:
      return await asyncio.to_thread(self.ctx.store.add_turns, self.session, rows, self.key_id,
                                     self.turn_type, self.done)
    except Exception as e:  # pylint: disable=broad-except  (never acknowledge an unrecorded turn)
      raise ApiError(500, f"could not record the turn: {type(e).__name__}: {e}", None,
                     "store_failed", "server_error") from e

  def extra(self, ids: list[int], index: int, samples: list[Sample]) -> dict:
    versions = [v for s in samples for v in s.versions]
    return {"session_id": self.session, "turn_index": index, "turn_ids": ids,
            "policy_versions": [min(versions), max(versions)] if versions else []}


def _sse(obj) -> str:
  return f"data: {json.dumps(obj)}\n\n"


async def _stream(ctx: ServeContext, turn: _Turn, group_id: int, queue: asyncio.Queue):
  n, model, created = turn.req.n, ctx.model_name, int(time.time())
  tokens: list[list[int]] = [[] for _ in range(n)]
  sent: list[str] = [""] * n
  finals: dict[int, Sample] = {}
  done = False

  def delta(i: int, new_tokens: list[int], final: bool = False) -> str | None:
    tokens[i].extend(new_tokens)
    text = ctx.tokenizer.decode(tokens[i])
    if (text.endswith("\ufffd") and not final) or len(text) <= len(sent[i]):
      return None  # wait for the rest of a UTF-8 character (at the end: it is what was generated)
    piece, sent[i] = text[len(sent[i]):], text
    return _sse(protocol.chunk_body(turn.rid, model, created, i, {"content": piece}))

  try:
    for i in range(n):
      yield _sse(protocol.chunk_body(turn.rid, model, created, i, {"role": "assistant", "content": ""}))
    while len(finals) < n:
      item = await queue.get()
      if item[0] == "tokens":
        _, i, new = item
        out = None if i in finals else delta(i, new)
      else:
        s = item[1]
        finals[s.index] = s
        out = delta(s.index, s.tokens[len(tokens[s.index]):], final=True) if s.finish_reason not in (
            "error", "abort") else None
      if out:
        yield out
    ordered = [finals[i] for i in range(n)]
    try:
      _raise_failed(ordered)
    except ApiError as e:
      done = True
      yield _sse(e.body())
      return
    try:
      ids, index = await turn.record(ordered)
    except ApiError as e:
      done = True
      yield _sse(e.body())
      return
    done = True
    for s in ordered:
      lp = protocol.logprobs_content(ctx.tokenizer, s.tokens, s.logprobs) if turn.req.logprobs else None
      chunk = protocol.chunk_body(turn.rid, model, created, s.index, {},
                                  protocol.finish_reason(s.finish_reason), lp)
      yield _sse({**chunk, **turn.extra(ids, index, [s])})
    yield "data: [DONE]\n\n"
  finally:  # also on a disconnect (cancellation or aclose): free the engine's slots
    ctx.dispatcher.release(group_id, abort=not done)
