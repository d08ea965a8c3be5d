"""The OpenAI chat-completions wire format: request parsing with clear errors, response objects.

``parse_chat_request`` turns a decoded JSON body into a ``ChatRequest`` or raises ``ApiError`` with
the HTTP status and the OpenAI error object (``{"error": {"message", "type", "param", "code"}}``)
the client libraries expect; ``session_headers`` reads the session protocol's headers.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class ApiError(Exception):

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, kind: str = "invalid_request_error",
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
    self.headers = headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


@dataclasses.dataclass
class ChatRequest:
  model: str
  messages: list[dict]
  n: int = 1
  stream: bool = False
  temperature: float = 1.0
  top_p: float = 1.0
  max_tokens: int | None = None
  seed: int | None = None
  user: str | None = None
  logprobs: bool = False


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
  value = body.get(key, default)
  if value is None:
    return default
  ok = isinstance(value, int) if integer else isinstance(value, (int, float))
  if isinstance(value, bool) or not ok or not lo <= value <= hi:
    kind = "an integer" if integer else "a number"
    raise ApiError(400, f"'{key}' must be {kind} in [{lo}, {hi}], got {value!r}", key)
  return value


def _content(message: dict, i: int) -> str:
  content = message.get("content")
  if content is None and message.get("role") == "assistant":
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
    parts = []
    for part in content:
      if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
        raise ApiError(400, f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
      parts.append(part["text"])
    return "".join(parts)
  raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                 f"messages[{i}].content")


def parse_chat_request(body: Any, max_candidates: int) -> ChatRequest:
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise ApiError(400, "'model' is required (a string)", "model")
  raw = body.get("messages")
  if not isinstance(raw, list) or not raw:
    raise ApiError(400, "'messages' must be a non-empty list", "messages")
  messages = []
  for i, m in enumerate(raw):
    if not isinstance(m, dict) or m.get("role") not in ROLES:
      raise ApiError(400, f"messages[{i}] must be an object with 'role' one of {ROLES}",
                     f"messages[{i}].role")
    messages.append({"role": m["role"], "content": _content(m, i)})
  if messages[-1]["role"] == "assistant":
    raise ApiError(400, "the last message must not be the assistant's (nothing to reply to)", "messages")
  for key in ("stop", "tools", "functions"):
    if body.get(key):
      raise ApiError(400, f"'{key}' is not supported by this server", key)
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise ApiError(400, f"'stream' must be a boolean, got {stream!r}", "stream")
  logprobs = body.get("logprobs", False) or False
  if not isinstance(logprobs, bool):
    raise ApiError(400, f"'logprobs' must be a boolean, got {logprobs!r}", "logprobs")
  user = body.get("user")
  if user is not None and not isinstance(user, str):
    raise ApiError(400, "'user' must be a string", "user")
  max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
  max_tokens = None if max_tokens is None else _number(
      {"max_tokens": max_tokens}, "max_tokens", None, 1, 1 << 30, integer=True)
  return ChatRequest(
      model=model, messages=messages, stream=stream, user=user, logprobs=logprobs,
      n=_number(body, "n", 1, 1, max_candidates, integer=True),
      temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
      top_p=float(_number(body, "top_p", 1.0, 1e-6, 1.0)),
      max_tokens=max_tokens, seed=_number(body, "seed", None, 0, 2**31 - 1, integer=True))


TURN_TYPES = ("main", "side")
_FLAGS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def session_headers(headers) -> tuple[str, bool]:
  """The session protocol's ``X-Turn-Type`` (``main`` | ``side``, default ``main``) and
  ``X-Session-Done`` (``true`` | ``false``, default ``false``) of a request."""
  turn_type = headers.get("x-turn-type", "main").strip().lower()
  if turn_type not in TURN_TYPES:
    raise ApiError(400, f"X-Turn-Type must be one of {TURN_TYPES}, got {turn_type[:40]!r}",
                   "X-Turn-Type")
  done = headers.get("x-session-done", "false").strip().lower()
  if done not in _FLAGS:
    raise ApiError(400, f"X-Session-Done must be 'true' or 'false', got {done[:40]!r}",
                   "X-Session-Done")
  return turn_type, _FLAGS[done]


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cache_full": "length"}


def finish_reason(engine_reason: str) -> str:
  return FINISH.get(engine_reason, engine_reason)


def logprobs_content(tokenizer, tokens: list[int], logprobs: list[float]) -> dict:
  return {"content": [{"token": tokenizer.decode([t], skip_special_tokens=False), "logprob": lp,
                       "bytes": None, "top_logprobs": []} for t, lp in zip(tokens, logprobs)]}


def completion_body(rid: str, model: str, choices: list[dict], usage: dict, extra: dict) -> dict:
  return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
          "choices": choices, "usage": usage, **extra}


def chunk_body(rid: str, model: str, created: int, index: int, delta: dict,
               finish: str | None = None, logprobs: dict | None = None) -> dict:
  choice = {"index": index, "delta": delta, "finish_reason": finish}
  if logprobs is not None:
    choice["logprobs"] = logprobs
  return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
          "choices": [choice]}
