"""The sampling CLI on the tiny model, in process."""

from absl import flags

from areal_jax import generate


def test_cli_prints_n_completions_with_logprobs(capsys):
  flags.FLAGS(["generate", "--model=tiny", "--prompt=Hi", "--n=3", "--max_new_tokens=5",
               "--temperature=0.7", "--logprobs", "--seed=1"])
  assert generate.main([]) == 0
  out = capsys.readouterr().out
  assert out.count("--- sample") == 3
  logprob_lines = [l for l in out.splitlines() if l.startswith("  ") and l.split()[1][0] == "-"]
  assert len(logprob_lines) >= 3  # every sample prints its tokens with logprobs


def test_cli_reports_a_bad_request():
  flags.FLAGS(["generate", "--model=tiny", "--prompt=Hi", "--n=1", "--max_new_tokens=4",
               "--temperature=-1"])
  assert generate.main([]) == 1
