"""The serve demo hands its config overrides on: ``--config.<key>=<value>`` given to the demo
reaches its server and evaluator processes as the same values (the end-to-end demo run is
tests/serve/test_status_line.py's)."""

import pathlib
import subprocess
import sys

from absl import flags
from ml_collections import config_flags

from areal_jax.serve import demo

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = f"{ROOT}/configs/serve_arithmetic.py:tiny"


def _parse(argv: list[str]):
  """A fresh ``--config`` flag, as each of the demo's processes defines it, parsing ``argv``."""
  fv, argv = flags.FlagValues(), ["prog", f"--config={SPEC}", *argv]
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv["config"].value, config_flags.get_override_values(fv["config"])


def test_overrides_reach_another_process_as_the_same_values():
  given = ["--config.serve.signal_w_opd=0.25", "--config.serve.sim_users=3",
           "--config.serve.opd_center", "--config.serve.hint_format={message} / hint: {hint}",
           "--config.rollout.prefill_buckets=(64, 512)", "--config.serve.trainer_process=false"]
  first, values = _parse(given)
  args = demo.override_args(values)
  assert len(args) == len(given)
  second, again = _parse(args)
  assert again == values
  assert (second.serve.signal_w_opd, second.serve.sim_users, second.serve.opd_center) == \
      (0.25, 3, True)
  assert second.serve.hint_format == "{message} / hint: {hint}"
  assert tuple(second.rollout.prefill_buckets) == (64, 512) and not second.serve.trainer_process
  assert second.to_dict() == first.to_dict()


def test_no_overrides_give_no_arguments():
  _, values = _parse([])
  assert demo.override_args(values) == []


def test_importing_the_demo_defines_no_flags():
  """Its flags are the command's: a process that imports the demo (a test, a bench script) can
  still import the server's command line, which defines --config and --workdir."""
  code = "import areal_jax.serve.demo, areal_jax.serve.__main__"
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
