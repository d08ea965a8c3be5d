"""Tokenizer: a thin wrapper over the ``tokenizers`` library plus a Jinja chat template.

``Tokenizer.from_dir(path)`` reads a Hugging Face tokenizer directory (``tokenizer.json``,
``tokenizer_config.json``, the chat template inline or in ``chat_template.jinja``, and the eos ids of
``generation_config.json`` when present); ``save(path)`` writes one back that ``transformers`` can read.
``byte_tokenizer()`` builds a tiny byte-level tokenizer in code (256 byte tokens, id == byte value,
plus ChatML specials) for tests and the ``tiny`` model preset.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class TemplateError(ValueError):
  """Raised by a chat template through ``raise_exception(message)``."""


def _token_str(value: Any) -> str | None:
  """A special token from tokenizer_config: a string or an AddedToken dict ``{"content": ...}``."""
  if isinstance(value, dict):
    return value.get("content")
  return value


def _as_ids(value: Any) -> tuple[int, ...]:
  if value is None:
    return ()
  if isinstance(value, int):
    return (value,)
  return tuple(int(v) for v in value)


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not valid JSON ({e})") from e


class Tokenizer:
  """Text <-> token ids, special-token ids and the chat template of one model."""

  def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
               bos_token: str | None = None, eos_token: str | None = None,
               pad_token: str | None = None, eos_token_ids: Sequence[int] | None = None):
    self.backend = backend
    self.chat_template = chat_template
    self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
    self.bos_token_id = self._id_of(bos_token, "bos_token")
    eos_id = self._id_of(eos_token, "eos_token")
    ids = list(dict.fromkeys(int(i) for i in eos_token_ids or ()))
    if eos_id is not None and eos_id not in ids:
      ids.insert(0, eos_id)
    self.eos_token_ids: tuple[int, ...] = tuple(ids)
    pad_id = self._id_of(pad_token, "pad_token")
    if pad_id is None and self.eos_token_ids:
      pad_id = self.eos_token_ids[0]
    self.pad_token_id: int | None = pad_id
    self._template_cache: tuple[str, jinja2.Template] | None = None

  def _id_of(self, token: str | None, what: str) -> int | None:
    if token is None:
      return None
    token_id = self.backend.token_to_id(token)
    if token_id is None:
      raise ValueError(f"{what} {token!r} is not in the vocabulary")
    return token_id

  # --- encoding -------------------------------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self.backend.id_to_token(int(token_id))

  # --- chat template --------------------------------------------------------------------------

  def _compiled_template(self) -> jinja2.Template:
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template")
    if self._template_cache is None or self._template_cache[0] != self.chat_template:
      env = jinja2.sandbox.ImmutableSandboxedEnvironment(
          trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

      def raise_exception(message):
        raise TemplateError(message)

      def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

      def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

      env.filters["tojson"] = tojson
      env.globals["raise_exception"] = raise_exception
      env.globals["strftime_now"] = strftime_now
      self._template_cache = (self.chat_template, env.from_string(self.chat_template))
    return self._template_cache[1]

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          **kwargs) -> str:
    """Renders ``messages`` ([{"role": ..., "content": ...}]) to the prompt text."""
    return self._compiled_template().render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

  # --- files ----------------------------------------------------------------------------------

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
      raise FileNotFoundError(f"{tok_file} not found (only fast tokenizers, tokenizer.json, load)")
    try:
      backend = tokenizers.Tokenizer.from_file(tok_file)
    except Exception as e:  # tokenizers raises a plain Exception
      raise ValueError(f"{tok_file}: cannot be read by the tokenizers library ({e})") from e
    config_file = os.path.join(path, "tokenizer_config.json")
    config = _read_json(config_file) if os.path.exists(config_file) else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      by_name = {t.get("name"): t.get("template") for t in template}
      template = by_name.get("default", next(iter(by_name.values()), None))
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_file):
      with open(jinja_file, encoding="utf-8") as f:
        template = f.read()
    eos_ids: tuple[int, ...] = ()
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_file):
      eos_ids = _as_ids(_read_json(gen_file).get("eos_token_id"))
    return cls(backend, chat_template=template, bos_token=_token_str(config.get("bos_token")),
               eos_token=_token_str(config.get("eos_token")),
               pad_token=_token_str(config.get("pad_token")), eos_token_ids=eos_ids)

  def save(self, path: str | os.PathLike) -> None:
    """Writes ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` and, when the
    directory has none yet, a ``generation_config.json`` holding the eos ids."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    self.backend.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": self.bos_token,
        "eos_token": self.eos_token,
        "pad_token": self.pad_token,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
    jinja_file = os.path.join(path, "chat_template.jinja")
    if self.chat_template is not None:
      with open(jinja_file, "w", encoding="utf-8") as f:
        f.write(self.chat_template)
    gen_file = os.path.join(path, "generation_config.json")
    if not os.path.exists(gen_file):
      with open(gen_file, "w", encoding="utf-8") as f:
        json.dump(self.generation_config(), f, indent=2)

  def generation_config(self) -> dict:
    """The special-token ids of ``generation_config.json``."""
    eos = list(self.eos_token_ids)
    return {"bos_token_id": self.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": self.pad_token_id}

  def __repr__(self):
    return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids}, "
            f"bos_token_id={self.bos_token_id}, pad_token_id={self.pad_token_id})")


def bytes_to_unicode() -> dict[int, str]:
  """The byte-level BPE alphabet: printable bytes map to themselves, the rest to code points 256+."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def byte_tokenizer(specials: Sequence[str] = BYTE_SPECIALS) -> Tokenizer:
  """Byte-level tokenizer without merges: ids 0..255 are bytes, then ``specials`` in order.

  eos is ``<|im_end|>`` (``<|endoftext|>`` also stops generation), pad is ``<|endoftext|>``, no bos;
  the chat template is ChatML.
  """
  vocab = {ch: b for b, ch in bytes_to_unicode().items()}
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False)
                              for s in specials])
  eos = "<|im_end|>" if "<|im_end|>" in specials else specials[-1]
  pad = "<|endoftext|>" if "<|endoftext|>" in specials else eos
  extra_eos = [backend.token_to_id("<|endoftext|>")] if "<|endoftext|>" in specials else []
  return Tokenizer(backend, chat_template=CHATML_TEMPLATE, eos_token=eos, pad_token=pad,
                   eos_token_ids=[backend.token_to_id(eos), *extra_eos])
