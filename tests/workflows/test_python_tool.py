"""The program-aided workflow: a Python block cuts the turn, its output is context, the model
continues; the sandbox's refusal stops it at start."""

import itertools
import pathlib
import sys

import pytest

from areal_jax import config as config_lib
from areal_jax import tasks, workflows
from areal_jax.envs.python_sandbox import Limits, Sandbox, SandboxUnavailable
from areal_jax.rollout_api import Sample, SamplingParams
from areal_jax.workflows import Context, PythonTool

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "runtime"))
from controller_fakes import FakeEngine, controller  # noqa: E402
from workflow_helpers import EOS, TOK, ScriptedClient  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASK = tasks.get_task({"name": "arithmetic", "num_train": 4, "num_test": 2})
EXAMPLE = {"id": "x", "question": "Ben has 3 boxes of 4 pencils and 1 more. How many?",
           "answer": "3 * 4 + 1 = 13\n#### 13"}


@pytest.fixture(scope="module")
def box():
  s = Sandbox(Limits(wall_s=20.0, cpu_s=1))
  if not s.isolated:
    pytest.skip(f"no namespaces on this machine: {s.unavailable}")
  return s


def run(box, script, max_turns=3, max_prompt_len=4096):
  client = ScriptedClient(script)
  ep = PythonTool(max_turns, box).run(EXAMPLE, Context(TASK, TOK, TASK.reward, max_prompt_len),
                                      client, SamplingParams())
  return ep, client


def test_program_output_and_final_answer(box):
  call = "Count:\n```python\nprint(3 * 4 + 1)\n```"
  ep, client = run(box, [(call + " and then rambling", "length", 0),
                         (" so \\boxed{13}", "eos", 1)])
  s = ep.sample
  t1 = TOK.encode(call)  # the tokens sampled after the block are dropped
  out = TOK.encode("\n```output\n13\n```\n")
  t2 = TOK.encode(" so \\boxed{13}") + [EOS]
  assert s.tokens == t1 + out + t2
  assert s.loss_mask == [1] * len(t1) + [0] * len(out) + [1] * len(t2)
  assert s.logprobs[len(t1):len(t1) + len(out)] == [0.0] * len(out)
  assert s.versions == [0] * (len(t1) + len(out)) + [1] * len(t2)
  assert client.prompts[1] == TASK.prompt_ids(EXAMPLE, TOK) + t1 + out
  assert ep.reward == 1.0 and ep.correct and ep.turns == 2 and ep.end == "answered"
  assert s.metadata["calls"] == 1 and s.metadata["call_failures"] == 0


def test_failing_programs_are_reported_to_the_model_and_max_turns_ends(box):
  ep, client = run(box, [("```python\nprint(undefined)\n```", "stop", 0),
                         ("```python\nwhile True: pass\n```", "stop", 0),
                         ("```python\nprint(7)\n```", "stop", 0)])
  inserted = TOK.decode([t for t, m in zip(ep.sample.tokens, ep.sample.loss_mask) if m == 0])
  assert "NameError: name 'undefined' is not defined" in inserted
  assert "stopped: used 1 s of CPU" in inserted
  assert ep.turns == 3 and ep.end == "max_turns" and ep.reward == 0.0 and len(client.prompts) == 3
  assert ep.sample.metadata["calls"] == 2 and ep.sample.metadata["call_failures"] == 2


def test_a_conversation_past_the_prompt_budget_ends(box):
  prompt = len(TASK.prompt_ids(EXAMPLE, TOK))
  call = "```python\nprint('x' * 500)\n```"
  ep, _ = run(box, [(call, "stop", 0)], max_prompt_len=prompt + len(TOK.encode(call)) + 100)
  assert ep.end == "context" and ep.turns == 1 and ep.reward == 0.0


def test_engine_error_ends_the_episode(box):
  ep, _ = run(box, [("```python\nprint(1)\n```", "stop", 0), ("", "error", 0)])
  assert ep.end == "error" and ep.reward == 0.0 and ep.turns == 2


def test_no_isolation_refuses_at_start_unless_allowed():
  with pytest.raises(SandboxUnavailable, match="allow_unisolated"):
    PythonTool(2, Sandbox(unshare="/nonexistent/unshare"))
  PythonTool(2, Sandbox(unshare="/nonexistent/unshare", allow_unisolated=True))


def test_presets_build_the_workflow_with_their_limits():
  c = config_lib.load(f"{ROOT}/configs/arithmetic.py:python_tool")
  w = workflows.get(c.rollout.workflow, c)
  if not w.sandbox.isolated:
    pytest.skip(f"no namespaces on this machine: {w.sandbox.unavailable}")
  assert isinstance(w, PythonTool) and w.max_turns == c.rollout.max_turns
  assert w.sandbox.limits.wall_s == c.rollout.python_tool.wall_s == 5.0
  assert config_lib.load(f"{ROOT}/configs/gsm8k.py:python_tool").rollout.workflow == "python_tool"
  config_lib.override(c, "rollout.python_tool.cpu_s", 0)
  with pytest.raises(ValueError, match="rollout.python_tool: sandbox limit cpu_s=0"):
    workflows.get("python_tool", c)


PROGRAMS = ("print(6 * 7)", "import time\ntime.sleep(600)", "print('x' * 10_000_000)",
            "print(undefined)", "import os\nos.kill(os.getppid(), 9)")


class ProgramEngine(FakeEngine):
  """First turns write the next of ``PROGRAMS``; a turn that has seen an output answers RIGHT."""

  def __init__(self):
    super().__init__()
    self._programs = itertools.cycle(PROGRAMS)

  def submit(self, request):
    if "```output" in TOK.decode(request.prompt_tokens):
      toks = TOK.encode("RIGHT") + [EOS]
    else:
      with self._lock:
        toks = TOK.encode(f"```python\n{next(self._programs)}\n```") + [EOS]
    for i in range(request.n):
      self._out.put(Sample(request.group_id, i, request.prompt_tokens, toks, [-0.5] * len(toks),
                           [0] * len(toks), "eos", metadata=dict(request.metadata)))


def test_hostile_programs_end_their_call_and_the_run_goes_on():
  """Through the rollout controller: programs that hang, flood, fail or signal their parent each
  come back as an output block, and every episode still finishes and is scored."""
  box = Sandbox(Limits(wall_s=1.0, max_output_bytes=256))
  if not box.isolated:
    pytest.skip(f"no namespaces on this machine: {box.unavailable}")
  ctrl, staleness, _ = controller(ProgramEngine(), PythonTool(2, box), n=5)
  ctrl.start()
  try:
    batch = staleness.take_batch(0, timeout=120)
    ctrl.check()
  finally:
    ctrl.stop()
  assert batch is not None and len(batch) == 2
  outputs = []
  for group in batch:
    assert group.rewards == [1.0] * 5
    for s in group.samples:
      assert s.metadata["turns"] == 2 and s.metadata["calls"] == 1
      outputs.append(TOK.decode([t for t, m in zip(s.tokens, s.loss_mask) if not m]))
  joined = "\n".join(outputs)
  for seen in ("42", "stopped: ran past 1 s", "stopped: too much output",
               "NameError: name 'undefined' is not defined", "PermissionError"):
    assert seen in joined, seen
