"""A scripted engine client for workflow tests: returns chosen texts, records the prompts."""

from areal_jax.models import byte_tokenizer
from areal_jax.rollout_api import Sample

TOK = byte_tokenizer()
EOS = TOK.eos_token_ids[0]


class ScriptedClient:
  """Turn k answers ``script[k] = (text, finish_reason, versions)``.

  ``versions`` is a list (one per token, e.g. a weight swap inside the turn) or an int; an "eos"
  finish appends the EOS token. Logprobs are distinct per turn and position: -(k + 1) - j / 100.
  """

  def __init__(self, script):
    self.script, self.prompts, self.params = list(script), [], []

  def generate(self, prompt_tokens, params):
    k = len(self.prompts)
    self.prompts.append(list(prompt_tokens))
    self.params.append(params)
    text, finish, versions = self.script[k]
    if finish == "error":
      return Sample(0, 0, list(prompt_tokens), [], [], [], "error", error="scripted failure")
    tokens = TOK.encode(text) + ([EOS] if finish == "eos" else [])
    if isinstance(versions, int):
      versions = [versions] * len(tokens)
    assert len(versions) == len(tokens), (len(versions), len(tokens))
    logprobs = [-(k + 1) - j / 100 for j in range(len(tokens))]
    return Sample(0, 0, list(prompt_tokens), tokens, logprobs, list(versions), finish)
