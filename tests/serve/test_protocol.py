"""Chat request parsing: what is accepted, and the status and parameter named when it is not."""

import pytest

from areal_jax.serve import protocol
from areal_jax.serve.protocol import ApiError

Q = [{"role": "user", "content": "2+2?"}]


def test_accepts_text_parts_and_defaults():
  req = protocol.parse_chat_request(dict(model="m", messages=[
      {"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]}]), 4)
  assert req.messages[1] == {"role": "user", "content": "2+2?"}
  assert (req.n, req.stream, req.max_tokens, req.seed) == (1, False, None, None)
  assert protocol.parse_chat_request(dict(model="m", messages=Q, max_completion_tokens=7), 4).max_tokens == 7


@pytest.mark.parametrize("body,param", [
    (dict(model="m", messages=Q, n=5), "n"),
    (dict(model="m", messages=Q, n=True), "n"),
    (dict(model="m", messages=Q, top_p=0), "top_p"),
    (dict(model="m", messages=Q, temperature=3), "temperature"),
    (dict(model="m", messages=Q, stream="yes"), "stream"),
    (dict(model="m", messages=Q, stop=["\n"]), "stop"),
    (dict(model="m", messages=Q + [{"role": "assistant", "content": "4"}]), "messages"),
    (dict(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content"),
    (dict(model="m", messages=[]), "messages"),
    (dict(messages=Q), "model"),
])
def test_rejects_with_the_parameter_named(body, param):
  with pytest.raises(ApiError) as e:
    protocol.parse_chat_request(body, 4)
  assert e.value.status == 400 and e.value.param == param
  assert e.value.body()["error"]["type"] == "invalid_request_error"
