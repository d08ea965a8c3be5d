"""Who may use the server: API keys, per-key request rates, bounded request bodies, loopback binds.

``serve.api_keys`` names where the keys are: ``file:PATH`` (one key a line; blank lines and lines
starting with ``#`` are skipped) or ``env:NAME`` (an environment variable holding keys separated
by commas, spaces or newlines). With keys, every ``/v1/...`` request needs ``Authorization: Bearer
<key>`` (else 401 with an OpenAI error object); ``/health`` stays open for probes. A key is compared
with every configured key in constant time (``hmac.compare_digest``) and is known afterwards only
by its *key id*, ``key-`` and the first 12 hex digits of its SHA-256: that is what the turn store
and the trainer see. Without keys the server may listen on loopback addresses only.

Untrusted input is bounded before it costs much: a body over ``serve.max_body_bytes`` is refused
unread (413), and a prompt whose text is too long for ``rollout.max_prompt_len`` tokens by a
bound from the vocabulary (``TokenBound``) is refused without tokenizing it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import os
import socket
import threading
import time

import tokenizers
from starlette.authentication import (AuthCredentials, AuthenticationBackend, AuthenticationError,
                                      SimpleUser)
from starlette.requests import HTTPConnection, Request

from areal_jax import config as config_lib
from areal_jax.serve.protocol import ApiError


def key_id(key: str) -> str:
  """The name a key is stored and counted under; the key itself cannot be read back from it."""
  return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _user_variable(name: str) -> str | None:
  """An environment variable the user named in serve.api_keys (not one of the project's own)."""
  return os.environ.get(name)


def load_keys(spec: str) -> dict[bytes, str] | None:
  """``serve.api_keys`` -> {key bytes: key id}; None for ""; a ``ConfigError`` naming the problem
  (never a key) for a bad spec, a missing file or variable, or no keys."""
  if not spec:
    return None
  kind, _, where = spec.partition(":")
  if kind == "file" and where:
    try:
      with open(os.path.expanduser(where), encoding="utf-8") as f:
        lines = f.read().splitlines()
    except OSError as e:
      raise config_lib.ConfigError(f"serve.api_keys={spec!r}: cannot read the key file "
                                   f"({e.strerror})") from e
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
  elif kind == "env" and where:
    value = _user_variable(where)
    if value is None:
      raise config_lib.ConfigError(f"serve.api_keys={spec!r}: the environment variable {where} "
                                   "is not set")
    keys = value.replace(",", " ").split()
  else:
    raise config_lib.ConfigError("serve.api_keys must be 'file:PATH' (one key a line) or "
                                 "'env:NAME' (keys separated by commas or spaces), or '' for none "
                                 "(loopback only); the value given is not shown: it may be a key")
  if not keys:
    raise config_lib.ConfigError(f"serve.api_keys={spec!r} holds no keys")
  if any(any(ch.isspace() for ch in k) or not k.isprintable() for k in keys):
    raise config_lib.ConfigError(f"serve.api_keys={spec!r}: a key holds spaces or unprintable "
                                 "characters")
  return {k.encode(): key_id(k) for k in keys}


def is_loopback(host: str) -> bool:
  """Whether every address ``host`` resolves to is a loopback address."""
  try:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
  except socket.gaierror:
    return False
  return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_bind(host: str, keys: dict | None) -> None:
  """Refuses (``ConfigError``) to listen beyond loopback without keys: whoever reached the port
  would be served, and every turn they sent would train the policy."""
  if keys is None and not is_loopback(host):
    raise config_lib.ConfigError(
        f"serve.host={host!r} is not a loopback address and serve.api_keys is empty: anyone who "
        "reaches the port would be served and would train the policy. Set serve.api_keys "
        "('file:PATH' or 'env:NAME') or listen on serve.host=127.0.0.1")


class KeyAuth(AuthenticationBackend):
  """Starlette authentication backend: ``/v1/...`` requests carry a configured Bearer key; the
  request's user is then the key id (without keys: anonymous, no key id)."""

  def __init__(self, keys: dict[bytes, str] | None):
    self.keys = keys

  async def authenticate(self, conn: HTTPConnection):
    if self.keys is None or not conn.url.path.startswith("/v1/"):
      return None
    scheme, _, given = conn.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
      raise AuthenticationError("this server needs an API key: send 'Authorization: Bearer <key>'")
    given = given.strip().encode()
    found = None
    for key, kid in self.keys.items():  # every key, no early exit: the time says nothing of which
      if hmac.compare_digest(given, key):
        found = kid
    if found is None:
      raise AuthenticationError("the API key is not valid")
    return AuthCredentials(["authenticated"]), SimpleUser(found)


def request_key_id(request: Request) -> str | None:
  user = request.scope.get("user")
  return user.display_name if user is not None and user.is_authenticated else None


class RateLimiter:
  """``per_minute`` requests per key (token bucket: bursts up to a minute's allowance, refilled
  evenly); ``check`` raises a 429 ``ApiError`` with the seconds to wait."""

  def __init__(self, per_minute: int, clock=time.monotonic):
    self.rate, self.clock = per_minute / 60.0, clock
    self.capacity = float(per_minute)
    self._buckets: dict[str, tuple[float, float]] = {}  # who -> (tokens, time)
    self._lock = threading.Lock()

  def check(self, who: str) -> None:
    if self.rate <= 0:
      return
    with self._lock:
      now = self.clock()
      tokens, then = self._buckets.get(who, (self.capacity, now))
      tokens = min(self.capacity, tokens + (now - then) * self.rate)
      if tokens < 1.0:
        self._buckets[who] = (tokens, now)
        wait = math.ceil((1.0 - tokens) / self.rate)
        raise ApiError(429, f"rate limit of {self.capacity:g} requests per minute "
                       f"(serve.rate_limit_per_min) reached; retry in {wait} s", None,
                       "rate_limit_exceeded", "rate_limit_error", headers={"Retry-After": str(wait)})
      self._buckets[who] = (tokens - 1.0, now)


async def read_body(request: Request, limit: int) -> bytes:
  """The request body, refused with 413 once it passes ``limit`` bytes: at once by its
  Content-Length, else while it streams in (never read whole). (Starlette's own body limit answers
  in plain text; clients expect an OpenAI error object.)"""
  def too_large():
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                    "(serve.max_body_bytes)", None, "request_too_large")
  length = request.headers.get("content-length")
  if length is not None and length.isdigit() and int(length) > limit:
    raise too_large()
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > limit:
      raise too_large()
    chunks.append(chunk)
  return b"".join(chunks)


class TokenBound:
  """A lower bound on a text's token count without tokenizing it: no token of a BPE vocabulary
  stands for more UTF-8 bytes of (normalized) text than its own spelling takes (byte-level
  spellings use one character per byte, byte fallbacks ``<0x..>`` six characters for one byte), so
  ``tokens >= bytes / longest spelling``. ``None`` (no bound) for other vocabularies and where a
  token can absorb text of any length (fused unknown pieces, added tokens that strip whitespace)."""

  def __init__(self, tokenizer):
    backend = getattr(tokenizer, "backend", None)
    self.backend, self.max_bytes = backend, None
    model = getattr(backend, "model", None)
    if not isinstance(model, tokenizers.models.BPE) or model.fuse_unk:
      return
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
      return
    self.max_bytes = max(len(t.encode()) for t in backend.get_vocab(with_added_tokens=True))

  def at_least(self, text: str) -> int:
    if self.max_bytes is None:
      return 0
    if self.backend.normalizer is not None:
      text = self.backend.normalizer.normalize_str(text)
    return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_bytes)
