"""The tokens a new user message adds to a conversation, after the assistant's generated turn.

The generated tokens are kept exactly as sampled (never re-tokenized); only the text that follows
them is rendered. With the chat template that text is what the template puts after the assistant's
content: the end-of-turn marker, the user message, and the generation prompt of the next assistant
turn. It is found by rendering the conversation with a placeholder as the assistant's content and
taking everything after the placeholder. If the turn already ended with the end-of-turn token
(the model's EOS), that token is not repeated. Without the chat template, messages are separated
by blank lines, as ``tasks.prompts.PromptFormat.text`` joins them.
"""

from __future__ import annotations

from areal_jax.chat_template import chat_text

_PLACEHOLDER = "\u2063ASSISTANT-TURN\u2063"


def user_turn_text(task, tokenizer, example: dict, message: str) -> str:
  """The text that follows an assistant turn when the user answers ``message``."""
  fmt = task.prompt_format
  if not fmt.use_chat_template:
    return f"\n\n{message}\n"
  msgs = task.prompt_messages(example) + [{"role": "assistant", "content": _PLACEHOLDER},
                                          {"role": "user", "content": message}]
  text = chat_text(tokenizer, msgs, fmt.enable_thinking)
  at = text.rfind(_PLACEHOLDER)
  if at < 0:
    raise ValueError(f"{type(tokenizer).__name__}'s chat template drops the assistant's content; "
                     f"multi-turn conversations need a template that renders it")
  return text[at + len(_PLACEHOLDER):]


def user_turn_tokens(task, tokenizer, example: dict, message: str,
                     last_token: int | None) -> list[int]:
  """Token ids of :func:`user_turn_text`, without a leading end-of-turn token the turn already has."""
  text = user_turn_text(task, tokenizer, example, message)
  if last_token is not None:
    closing = tokenizer.decode([last_token], skip_special_tokens=False)
    if closing and text.startswith(closing):
      text = text[len(closing):]
  return list(tokenizer.encode(text)) if text else []
