"""Sample completions from any loadable model with the JAX rollout engine.

  python -m areal_jax.generate --model=smollm2 --prompt="What is the capital of France?" --chat \
      --n=4 --max_new_tokens=32 --temperature=0.7 --logprobs

``--model`` is anything ``areal_jax.models.load`` accepts (a Hugging Face directory, ``gguf:<path>``,
``smollm2``, ``tiny``). ``--logprobs`` prints every generated token with its behaviour logprob
(log softmax of logits / temperature, before top-k / top-p).
"""

from __future__ import annotations

import logging
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "tiny", "model source for areal_jax.models.load")
_PROMPT = flags.DEFINE_string("prompt", "Hello", "prompt text")
_N = flags.DEFINE_integer("n", 1, "samples of the prompt")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate at most")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "sampling temperature")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (1: off)")
_TOP_K = flags.DEFINE_integer("top_k", 0, "top-k sampling (0: off)")
_GREEDY = flags.DEFINE_bool("greedy", False, "argmax decoding")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_LOGPROBS = flags.DEFINE_bool("logprobs", False, "print per-token logprobs")
_CHAT = flags.DEFINE_bool("chat", False, "wrap the prompt in the model's chat template")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "KV cache positions per slot (0: prompt + max_new)")
_DTYPE = flags.DEFINE_string("dtype", "float32", "compute dtype")


def build_prompt(tokenizer, text: str, chat: bool) -> list[int]:
  if chat:
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
  ids = tokenizer.encode(text)
  if not chat and tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
    ids = [tokenizer.bos_token_id] + ids
  return ids


def format_sample(tokenizer, sample, with_logprobs: bool) -> str:
  lines = [f"--- sample {sample.index} ({sample.finish_reason}, {len(sample.tokens)} tokens, "
           f"{sample.finished_s - sample.started_s:.2f} s)"]
  if sample.error:
    lines.append(f"error: {sample.error}")
  lines.append(tokenizer.decode(sample.tokens))
  if with_logprobs:
    for t, lp in zip(sample.tokens, sample.logprobs):
      lines.append(f"  {t:>7d} {lp:9.4f}  {tokenizer.decode([t], skip_special_tokens=False)!r}")
  return "\n".join(lines)


def main(argv):
  del argv
  from areal_jax import cli
  from areal_jax.models import load
  from areal_jax.rollout_api import GroupRequest, SamplingParams
  from areal_jax.sampler.service import JaxRolloutEngine

  cli.set_up_logging(logging.INFO)  # the sampler's compile lines
  t0 = time.time()
  with cli.reported_faults():  # a model that is not there: one line naming it
    model, tokenizer = load(_MODEL.value, dtype=_DTYPE.value)
  prompt = build_prompt(tokenizer, _PROMPT.value, _CHAT.value)
  max_len = _MAX_LEN.value or len(prompt) + _MAX_NEW.value
  print(f"loaded {_MODEL.value} in {time.time() - t0:.1f} s; prompt {len(prompt)} tokens",
        file=sys.stderr)
  engine = JaxRolloutEngine(model, num_slots=max(_N.value, 1), max_len=max(max_len, 2),
                            eos_token_ids=tuple(tokenizer.eos_token_ids))
  params = SamplingParams(temperature=_TEMPERATURE.value, top_p=_TOP_P.value, top_k=_TOP_K.value,
                          greedy=_GREEDY.value, max_new_tokens=_MAX_NEW.value, seed=_SEED.value)
  engine.start()
  try:
    engine.submit(GroupRequest(0, prompt, n=_N.value, params=params))
    samples = []
    while len(samples) < max(_N.value, 1):
      for s in engine.poll(timeout=1.0):
        samples.append(s)
        print(format_sample(tokenizer, s, _LOGPROBS.value), flush=True)
  finally:
    engine.stop()
  return 1 if any(s.finish_reason == "error" for s in samples) else 0


if __name__ == "__main__":
  app.run(main)
