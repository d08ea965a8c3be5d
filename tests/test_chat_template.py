"""The chat prompt text: the generation prompt appended, enable_thinking passed only when off."""

from areal_jax.chat_template import chat_text


class _Template:
  def apply_chat_template(self, messages, **kwargs):
    self.kwargs = kwargs
    return "|".join(m["content"] for m in messages)


def test_enable_thinking_reaches_the_template_only_when_off():
  tok, messages = _Template(), [{"role": "user", "content": "2+2?"}]
  assert chat_text(tok, messages) == "2+2?" and tok.kwargs == {"add_generation_prompt": True}
  chat_text(tok, messages, enable_thinking=False)
  assert tok.kwargs == {"add_generation_prompt": True, "enable_thinking": False}
