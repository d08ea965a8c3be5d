"""Test set-up: 8 fake CPU devices, so sharding and the learner/sampler mesh split run for real;
and one persistent XLA compilation cache for the session (a fresh temporary directory, removed at
the end): tests build many learners and engines of the same tiny shapes, in this process, in xdist
workers and in the subprocesses they start (which inherit the environment), and each identical
program then compiles once. Nothing is kept between sessions. XLA:CPU compiles the tests' programs
with LLVM's optimization off (--xla_backend_optimization_level=0) and its fusions by the elemental
IR emitters instead of the MLIR fusion emitters (--xla_cpu_use_fusion_emitters=false); XLA's own
HLO passes, fusion decisions and buffer assignment run as in a real run. Most of a test's time on
CPU is compiling tiny programs: the first flag cuts that by about a quarter, the second by about
40% more; timing belongs to bench/, never to the tests."""

import atexit
import gc
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
  if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + _flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # (set: an outer session's, e.g. xdist's)
  _CACHE = tempfile.mkdtemp(prefix="areal_jax_tests_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)


def pytest_addoption(parser):
  parser.addoption("--compile-table", metavar="PATH", default=None,
                   help="write per-module test time and XLA compilations to PATH (Markdown; "
                        "tests/compile_table.py)")


def pytest_configure(config):
  path = config.getoption("--compile-table", None)
  if path:  # (xdist workers get the option too: they record, the controller writes)
    import importlib.util  # (tests/ is no package: load the plugin from its file)
    spec = importlib.util.spec_from_file_location(
        "areal_jax_tests_compile_table", pathlib.Path(__file__).with_name("compile_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config.pluginmanager.register(module.CompileTable(config, path), "compile_table")


def pytest_collection_modifyitems(items):
  """The modules that hold slow tests run first, each module's tests in their order: the long
  end-to-end tests start early and the many short ones fill in at the end, so that no xdist worker
  ends the session alone on a minute-long test while the other one idles."""
  slow = {item.path for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.path not in slow)  # stable: otherwise collection order


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
  """After each module, JAX's in-memory caches are cleared, so the programs it compiled are freed
  (the session's persistent cache still serves a later module that needs one again). An XLA:CPU
  executable holds many memory mappings; a worker that keeps every program of the session grew
  to ~65,000 mappings (the kernel's vm.max_map_count, 65530 here) and crashed in XLA's compiler
  (a segfault, or an out-of-memory kill)."""
  yield
  if "jax" in sys.modules:  # (nothing to free where no test imported it)
    sys.modules["jax"].clear_caches()
    gc.collect()
