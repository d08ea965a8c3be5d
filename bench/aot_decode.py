"""The sampler's decode programs compiled for a GPU or a TPU on a machine without one (XLA's AOT).

  python -m venv /tmp/cuda && /tmp/cuda/bin/pip install --no-deps -r requirements.lock -e . &&
  /tmp/cuda/bin/pip install "jax[cuda12]==$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
  /tmp/cuda/bin/python bench/aot_decode.py [--model qwen2.5-1.5b] [--target h100] [--json PATH]
                                           [--programs ours,floor] [--matmul xla,blas]
                                           [--held-layouts default,compiler]
  # a TPU: the same with "jax[tpu]==<version>" (libtpu) in its own venv and --target v5e:2x2

Compiles, for the GPU described by ``bench/aot_targets/<target>*.txtpb`` (XLA's GPU target
config; JAX's CUDA plugin and its ptxas, ~5.5 GB, in a venv of their own) or for one chip of a TPU
topology (``--target`` with a colon, e.g. ``v5e:2x2``: libtpu's compiler), our engine's decode call
as it is built for that platform (``--attention``, ``--layers``, fused projections, 16 steps per
call) and the floor loop of ``bench/decode_floor.py`` at the decode shape, once per GEMM choice:
``xla`` (XLA's flags as they are; with no device XLA cannot autotune, so on a GPU its Triton GEMMs
take default tilings) and, on a GPU, ``blas`` (``choice.compiler_options('blas')``: every matmul a
cuBLAS call). Per program: seconds to lower and to compile on this machine, and from the compiled
program, per decode step (each loop body counted by its trip count): the operations it launches
(on a GPU, kernels; a TPU runs one program, so there the count is only a size) with the matmuls by
library, and the bytes it copies (operations that only move data). Takes ~2-4 minutes on 2 cores
(building the 1.5B shape's random weights on the CPU is much of it).

What it cannot say: run time, and the time XLA spends autotuning on a real GPU (that needs the
device). What it can: whether a program compiles for the platform and how long XLA's passes take
without autotuning, which library runs each matmul, how many kernels a GPU step launches, and
what the program copies that the step does not need to read (the largest copies by result shape
and layout). Our program is compiled as the engine runs it on the target: on a TPU with the
weights and decode state held in the layouts the compiler picks (``choice.held_layouts``: JAX's
``Layout.AUTO``), on a GPU in the default ones; ``--held-layouts default,compiler`` compiles both.
Rows with the compiler's layouts also say what the compilation that found them took and whether
its program is the one compiled with them (the engine runs it as its widest decode variant).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

# no GPU or TPU here: the CUDA plugin (or libtpu) is loaded for its compiler only (the plugin's
# version check needs a driver)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import QWEN25_1P5B, SMOLLM2, decode_step_cost, finish  # noqa: E402

SHAPES = {"smollm2-135m": (SMOLLM2, 64, 128), "qwen2.5-1.5b": (QWEN25_1P5B, 128, 512)}
TARGETS = pathlib.Path(__file__).resolve().parent / "aot_targets"
# instructions that run nothing on the device (views, tuples, control flow counted by its bodies)
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
         "call", "after-all", "opt-barrier", "partition-id", "replica-id", "add-dependency",
         "domain", "async-done", "copy-done", "all-reduce-done", "all-gather-done",
         "collective-permute-done", "send-done", "recv-done", "fusion-done"}


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  """``({name: instruction lines}, entry name)`` of an HLO module's text."""
  comps, cur, entry = {}, None, None
  for line in hlo.splitlines():
    m = re.match(r"^(ENTRY )?%(\S+) .*\{\s*$", line)
    if m:
      cur, comps[m.group(2)] = m.group(2), []
      entry = m.group(2) if m.group(1) else entry
    elif line.startswith("}"):
      cur = None
    elif cur is not None and " = " in line:
      comps[cur].append(line)
  return comps, entry


def _opcode(line: str) -> str | None:
  rest = line.split(" = ", 1)[1]
  if rest.startswith("("):  # a tuple-shaped result: skip to its closing parenthesis
    depth = 0
    for i, ch in enumerate(rest):
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        break
    rest = rest[i + 1:].lstrip()
  else:
    rest = rest.split(" ", 1)[1] if " " in rest else ""
  m = re.match(r"([\w-]+)\(", rest)
  return m.group(1) if m else None


def _kind(op: str, line: str) -> str:
  """What a launching instruction is: a matmul by its library (``gemm:cublas``, ``gemm:triton``) or
  ``fusion:<kind>``, else its opcode."""
  if op == "custom-call":
    target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
    return "gemm:cublas" if "cublas" in target else f"custom-call:{target}"
  if op in ("fusion", "fusion-start"):  # (an asynchronous fusion, as JAX 0.11's XLA makes some)
    backend = re.search(r'"kind":"(\w+)"', line)
    if backend and "gemm" in backend.group(1):
      return "gemm:triton"
    kind = backend.group(1) if backend else re.search(r"kind=(\w+)", line).group(1)
    return f"fusion:{kind}"
  return "gemm:xla" if op in ("dot", "convolution") else op


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_MOVES = {"parameter", "dynamic-slice", "slice", "copy", "bitcast", "tuple", "get-tuple-element",
          "constant", "reshape", "transpose", "broadcast", "concatenate", "pad"}


def _result_bytes(line: str) -> int:
  """Bytes of an instruction's result (all leaves of a tuple)."""
  head = line.split(" = ", 1)[1]
  head = head[:head.find(")") + 1] if head.startswith("(") else head.split(" ", 1)[0]
  return sum(_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", head))


def _trip_count(line: str, comps: dict[str, list[str]]) -> int:
  """A while loop's trip count: XLA's ``known_trip_count`` (GPU and CPU programs), else the bound
  of its condition when that is one comparison of the counter with one integer constant (``i <
  N``, as TPU programs' loops from ``lax.scan``/``fori_loop`` have it); else 1."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
  if known:
    return int(known.group(1))
  cond = comps.get(re.search(r"condition=%([^,\s]+)", line).group(1), [])
  constant = re.compile(r"s32\[\](?:\{[^}]*\})? constant\((\d+)\)")
  bounds = [int(m.group(1)) for m in map(constant.search, cond) if m]
  lt = [x for x in cond if "compare(" in x and "direction=LT" in x]
  return bounds[0] if len(bounds) == 1 and len(lt) == 1 else 1


NOT_LAUNCHES = ("copied_bytes", "conditionals")  # the keys of ``launches`` that count no launch


def launch_total(counts) -> float:
  """The launches in ``launches``'s counts (its kinds, not ``NOT_LAUNCHES``)."""
  return sum(v for k, v in counts.items() if isinstance(k, str) and k not in NOT_LAUNCHES)


def launches(hlo: str, copies: collections.Counter | None = None) -> collections.Counter:
  """Device operations one run of a compiled HLO module launches, by ``_kind``: every instruction
  that runs something (fusions, library calls, copies, ...; not views or tuples), each loop's body
  counted its trip count times (``_trip_count``; a loop whose count is unknown: once; loop
  conditions are not counted), a conditional by its cheapest branch (the sampler's top-k/top-p
  branch runs only when a slot asks for it). Also ``"conditionals"``: the conditionals run (on a
  GPU each copies its predicate to the host and waits for it: ``choice.truncation_on_host``), and
  ``"copied_bytes"``: bytes written by the
  launches that only move data (a copy, or a fusion of slices, copies, pads, transposes and
  reshapes: no arithmetic but on scalars), e.g. a layer's weights sliced out of the stacked
  weights into a buffer of their own; ``copies`` (when given) gets those bytes by result type
  (shape and layout: what is copied)."""
  comps, entry = _computations(hlo)

  def moves_only(line: str, op: str) -> bool:
    if op == "copy":
      return True
    callee = re.search(r"calls=%([^,\s]+)", line)
    # (scalar arithmetic inside is index computation: a dynamic slice's clamped offsets)
    return (op in ("fusion", "fusion-start") and callee is not None and callee.group(1) in comps
            and all(_opcode(x) in _MOVES or _result_bytes(x) <= 8 for x in comps[callee.group(1)]))

  def count(name: str) -> collections.Counter:
    out = collections.Counter()
    for line in comps[name]:
      op = _opcode(line)
      if op == "while":
        body = count(re.search(r"body=%([^,\s]+)", line).group(1))
        trip = _trip_count(line, comps)
        out.update({k: v * trip for k, v in body.items()})
      elif op == "conditional":
        out["conditionals"] += 1
        names = re.search(r"branch_computations=\{([^}]*)\}", line)
        names = (re.findall(r"%([^,\s]+)", names.group(1)) if names else
                 [re.search(r"true_computation=%([^,\s]+)", line).group(1),
                  re.search(r"false_computation=%([^,\s]+)", line).group(1)])
        out.update(min((count(n) for n in names), key=launch_total))
      elif op == "call":
        out.update(count(re.search(r"to_apply=%([^,\s]+)", line).group(1)))
      elif op is not None and op not in _FREE:
        out[_kind(op, line)] += 1
        if moves_only(line, op):
          out["copied_bytes"] += _result_bytes(line)
          out[("copied", line.split(" = ", 1)[1].split(" ", 1)[0])] += _result_bytes(line)
    return out

  counted = count(entry)
  for key in [k for k in counted if isinstance(k, tuple)]:
    if copies is not None:
      copies[key[1]] += counted[key]
    del counted[key]
  return counted


def cas_kernels(dump_dir: str) -> list[str]:
  """The kernels of the GPU programs XLA dumped to ``dump_dir`` (``xla_dump_to``) whose PTX holds a
  compare-and-swap (``atom...cas``): memory updated by a loop of atomic retries (e.g. a bfloat16
  scatter XLA is not told writes each element once), by ``.entry`` name."""
  names = []  # (one per kernel: two modules may hold kernels of the same name)
  for path in pathlib.Path(dump_dir).glob("*.ptx"):
    entry = None
    for line in path.read_text().splitlines():
      found = re.match(r"\s*\.(?:visible\s+)?\.?entry\s+(\S+?)\(", line)
      if found:
        entry = found.group(1)
      elif entry and re.search(r"\batom\.\S*cas", line):
        names.append(entry)
        entry = None  # counted once
  return sorted(names)


def target_device(target: str):
  """A compile-only device of ``target``: one chip of a TPU topology (``v5e:2x2``) or the GPU
  a file under ``bench/aot_targets`` describes (``h100``, ``a100``, ``b200``, ``t4``)."""
  return target_devices(target)[0]


def target_devices(target: str, count: int = 1) -> list:
  """Compile-only devices of ``target``: every chip of a TPU topology (``v5e:2x4``: 8), or
  ``count`` of the GPU a file under ``bench/aot_targets`` describes, as on one host. A program
  over them compiles with the target's compiler (libtpu's, or XLA's GPU compiler and ptxas from
  JAX's CUDA plugin) on a machine without one; nothing runs."""
  from jax.experimental import topologies
  if ":" in target:
    try:
      return list(topologies.get_topology_desc(target, "tpu").devices)
    except Exception as e:  # noqa: BLE001 (libtpu's errors have no common type)
      raise SystemExit(f"compiling for TPU {target!r} needs libtpu, jax[tpu]=={jax.__version__} "
                       f"(see bench/aot_decode.py's docstring): {type(e).__name__}: {e}") from e
  paths = sorted(TARGETS.glob(f"{target}*.txtpb"))
  if not paths:
    raise SystemExit(f"no GPU target {target!r} in {TARGETS} (have: "
                     f"{sorted(p.stem for p in TARGETS.glob('*.txtpb'))})")
  try:
    topo = topologies.get_topology_desc("aot", "cuda", target_config=paths[0].read_text(),
                                        topology=f"1x1x{count}")
  except (NotImplementedError, KeyError, RuntimeError) as e:
    raise SystemExit(f"compiling for a GPU needs JAX's CUDA plugin, jax[cuda12]=={jax.__version__} "
                     f"(see bench/aot_decode.py's docstring): {type(e).__name__}: {e}") from e
  return list(topo.devices)


def _platform(device) -> str:
  return "tpu" if "TPU" in device.device_kind else "cuda"


def _program(what: str, cfg, slots: int, ctx: int, steps: int, attention: str, layers: str,
             device, matmul: str, model=None, page_size: int = 0, extra_options=None,
             truncate: bool = False):
  """``(jitted function, its abstract arguments on ``device``)``: our engine's decode call (of
  ``model``, a ``Transformer`` of ``cfg``; built when None; ``truncate``: the program for slots
  that ask for top-k / top-p, where the engine compiles it apart) or the floor loop, built on the
  CPU and re-targeted, compiled with ``matmul``'s options (``choice.compiler_options``) and
  ``extra_options``."""
  from areal_jax.kernels import choice
  matmul_options = {**(choice.compiler_options(matmul) or {}), **(extra_options or {})} or None
  on = lambda tree: abstract(tree, device)  # noqa: E731
  if what == "floor":
    import decode_floor
    run, state = decode_floor.make(cfg, slots, ctx + 16 * steps, jnp.bfloat16, steps, fused=True,
                                   compiler_options=matmul_options)
    return run.func, (on(run.args[0]), on(state))
  from flax import nnx

  from areal_jax.models import Transformer
  from areal_jax.sampler.engine import EngineConfig
  max_len = ctx + 16 * steps
  paged = dict(kv_pages=slots * -(-max_len // page_size), page_size=page_size) if page_size else {}
  eng = target_engine(device, model or Transformer(cfg, nnx.Rngs(0)), EngineConfig(
      num_slots=slots, max_len=max_len, prefill_buckets=(16,),
      kv_buckets=(ctx + 4 * steps + 1,), steps_per_call=steps, decode_attention=attention,
      decode_layers=layers, decode_matmul="xla", decode_projections="fused", **paged))
  # the program's GEMMs as the options compile them (what its trace pads for: choice.query_rows)
  eng.matmul_impl = matmul
  with choice.lowering_for(_platform(device)):
    fn = eng._make_generate(eng.kv_buckets[-1], slots,  # noqa: SLF001
                            truncate=truncate).__wrapped__
    args = (on(eng.params), on(eng.state_shapes()))
    if page_size:  # the slots' page tables
      args += (on(jax.ShapeDtypeStruct((slots, eng.pages_per_slot), jnp.int32)),)
    return jax.jit(fn, donate_argnums=1, compiler_options=matmul_options), args


def target_engine(device, model, engine_config, lora=None):
  """Our ``DecodeEngine`` of ``model`` built on this CPU as it builds itself for ``device``'s
  platform (its choices of layouts, forms and kernels: choice.heads_major_per_layer, scatter
  writes, vocabulary-major logits, a paged cache on a GPU), its Pallas kernels traced compiled for
  it, with its programs' mesh ``device``'s. Its jitted programs pin this CPU's shardings: lower
  fresh jits of their ``__wrapped__`` functions on arguments placed on ``device`` (``abstract``),
  inside ``choice.lowering_for``."""
  from areal_jax.kernels import choice
  from areal_jax.sampler.engine import DecodeEngine
  platform = "tpu" if _platform(device) == "tpu" else "gpu"
  on_cpu = choice.platform_of
  choice.platform_of = lambda mesh=None: platform
  held_env = os.environ.get(choice.HELD_LAYOUTS_ENV)
  os.environ[choice.HELD_LAYOUTS_ENV] = "default"  # (the compiler's: _with_auto_layouts)
  try:
    with choice.lowering_for(_platform(device)):
      eng = DecodeEngine(model, engine_config, lora=lora)
  finally:
    choice.platform_of = on_cpu
    os.environ.pop(choice.HELD_LAYOUTS_ENV)
    if held_env is not None:
      os.environ[choice.HELD_LAYOUTS_ENV] = held_env
  eng.mesh = jax.sharding.Mesh(np.array([device]).reshape(eng.mesh.devices.shape),
                               eng.mesh.axis_names)
  return eng


def abstract(tree, device):
  """``tree``'s arrays as shapes placed on ``device``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device)), tree)


def sampler_plan(device, model, engine_config, lora=None, **budget):
  """The sampler's memory plan (``sampler.memory.plan``: its weights, decode state, a weight swap
  and the largest programs' temporaries) with the programs compiled for ``device`` (a TPU chip or
  a GPU of ``target_devices``) by its own compiler, for an engine of one device
  (``target_engine``; ``lora``: merging adapters, the merge compiled for ``device`` too), the
  weights and state in the layouts the engine holds them in there (``choice.held_layouts``).
  ``budget``: ``plan``'s ``budget_bytes``, ``resident_budget``, ``shared_base``,
  ``incoming_dtype``, ``swap_while_decoding`` and ``weight_swap``."""
  from areal_jax.sampler import memory
  eng = target_engine(device, model, engine_config, lora)
  return memory.plan(eng, **_plan_args(device, eng, budget))


def sampler_fit(device, model, engine_config, lora=None, min_slots: int = 1, **budget):
  """``sampler_plan`` where the run would take it: ``sampler.memory.fit`` (the swap paused, fewer
  slots, or a paged pool sized to the budget where the configured slots do not fit), each engine
  it tries built and compiled for ``device``; the plan it settles on (MemoryError when none)."""
  import types
  from areal_jax.sampler import memory
  first = target_engine(device, model, engine_config, lora)
  args = _plan_args(device, first, budget)  # (a version's incoming bytes: whatever the slots)
  made = [first]

  def make(num_slots, **kw):
    eng = made.pop() if made else target_engine(
        device, model, dataclasses.replace(engine_config, num_slots=num_slots, **kw), lora)
    return types.SimpleNamespace(engine=eng)

  return memory.fit(make, engine_config.num_slots, min_slots, **args)[1]


def _plan_args(device, eng, budget) -> dict:
  """``memory.plan``'s keyword arguments for ``eng`` (``target_engine``) with its programs and
  a version's conversion compiled for ``device``."""
  from areal_jax import program_memory
  from areal_jax.kernels import choice
  from areal_jax.sampler import memory
  platform = _platform(device)

  def compiled(fn, *args):  # (a program the compiler refuses for want of memory: what it needed)
    with choice.lowering_for(platform):
      return program_memory.cost(choice.lower(fn, args, platform, device.device_kind), args)

  def programs(eng):  # (memory.program_bytes, compiled for the target)
    c = eng.config
    params, state = abstract(eng.params, device), abstract(eng.state_shapes(), device)
    pages = (abstract(jax.ShapeDtypeStruct((c.num_slots, eng.pages_per_slot), jnp.int32),
                      device),) if eng.paged else ()
    with choice.lowering_for(platform):  # (the widest decode call; on a GPU also its top-k /
      # top-p program: memory.planned_generates)
      generate, *sorting = [fn.__wrapped__ for fn in memory.planned_generates(eng)]
      prefills = [(eng._make_prefill(bucket, rows).__wrapped__,  # noqa: SLF001
                   abstract(jax.ShapeDtypeStruct((rows, bucket), jnp.int32), device))
                  for bucket, rows in eng.prefill_shapes_to_plan()]
    options = eng.compiler_options
    gen_fn, held = jax.jit(generate, donate_argnums=1, compiler_options=options), None
    if choice.held_layouts(platform) == "compiler":  # (a TPU) the layouts the engine holds there
      try:
        gen_fn, found = _with_auto_layouts(gen_fn, (params, state, *pages), options, platform)
        held = found["compiled"].input_formats[0][0]
      except jax.errors.JaxRuntimeError as e:  # too wide for the chip: the engine keeps the
        if not program_memory.refused(e):       # default layouts (DecodeEngine._compiler_layouts)
          raise
    pre = [compiled(jax.jit(fn, in_shardings=None if held is None else (held, None),
                            compiler_options=options), params, tokens) for fn, tokens in prefills]
    gen_temp = max(compiled(fn, params, state, *pages)["temp"] for fn in [gen_fn] + [
        jax.jit(f, donate_argnums=1, compiler_options=options) for f in sorting])
    return gen_temp, max(m["temp"] + m["out"] for m in pre)

  def merge_temp(fn, *args):  # (with LoRA: the merge and conversion as the target compiles it)
    return compiled(jax.jit(fn), *(abstract(x, device) for x in args))["temp"]

  return dict(budget_bytes=budget.get("budget_bytes"), resident_budget=budget.get("resident_budget"),
              shared_base=budget.get("shared_base", False), programs=programs,
              swap_while_decoding=budget.get("swap_while_decoding", True),
              incoming=eng.weights.incoming_bytes(budget.get("incoming_dtype"), temp=merge_temp),
              weight_swap=budget.get("weight_swap", "overlap"))


def _with_auto_layouts(fn, fargs, compiler_options, platform: str):
  """``(fn, found)``: ``fn`` (our decode call, ``(params, state)``) as the engine runs it with the
  weights and the decode state held in the layouts the compiler picks
  (``DecodeEngine._compiler_layouts``): compiled once with their layouts left to it
  (``Layout.AUTO``), then jitted with the layouts it picked for them, the state taken and
  returned in them (donated). ``found``: that first compilation (``compiled``, ``compile_s``) and
  whether it returns the state in the layouts it takes it in (``reusable``: then the engine runs
  it as the widest variant instead of compiling ``fn``)."""
  from areal_jax.kernels import choice
  from jax.experimental.layout import Format, Layout
  auto = lambda tree: jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), tree)  # noqa: E731
  params, state = fargs[:2]
  extra = tuple(x.sharding for x in fargs[2:])
  found = jax.jit(fn.__wrapped__, in_shardings=(auto(params), auto(state)) + extra,
                  out_shardings=(auto(state), None), donate_argnums=1,
                  compiler_options=compiler_options)
  t0 = time.perf_counter()
  with choice.lowering_for(platform):
    compiled = choice.lower(found, fargs, platform).compile()
  info = {"compiled": compiled, "compile_s": time.perf_counter() - t0}
  held, state_formats = compiled.input_formats[0][:2]
  info["reusable"] = jax.tree.leaves(compiled.output_formats[0]) == jax.tree.leaves(state_formats)
  return jax.jit(fn.__wrapped__, in_shardings=(held, state_formats) + extra,
                 out_shardings=(state_formats, None), donate_argnums=1,
                 compiler_options=compiler_options), info


_SOURCE_TABLES = {"FileNames", "FunctionNames", "FileLocations", "StackFrames"}


def same_program(hlo_a: str, hlo_b: str) -> bool:
  """Whether two compiled programs' texts hold the same instructions with the same layouts and the
  same entry layouts, up to instruction names, schedule order, source metadata and sharding
  annotations (which a single device ignores)."""
  # (metadata's quoted strings may hold braces; a tuple's sharding holds one per element)
  ignored = re.compile(r', metadata=\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\}'
                       r'|, sharding=\{(?:[^{}]|\{[^{}]*\})*\}')

  def signature(hlo: str):
    header, *body = hlo.splitlines()
    entry = re.search(r"entry_computation_layout=\{(.*?)\}(?=, \w+=|$)", header)
    lines, table = [], False
    for line in body:
      # the source tables (file and function names, locations, stack frames: a name line, then
      # numbered entries), after the header or at the end, as the version writes them
      if line in _SOURCE_TABLES or (table and re.match(r"\d+ ", line)):
        table = True
        continue
      table = False
      line = re.sub(r"%[\w.-]+", "%", ignored.sub("", line)).strip()
      if line:
        lines.append(line)
    return entry and entry.group(1), collections.Counter(lines)
  return signature(hlo_a) == signature(hlo_b)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-1.5b")
  ap.add_argument("--target", default="h100",
                  help="a GPU under bench/aot_targets (h100, a100, b200, t4) or a TPU topology (v5e:2x2)")
  ap.add_argument("--programs", default="ours,floor")
  ap.add_argument("--matmul", default=None,
                  help="GEMM choices (choice.MATMUL's xla, blas; default: xla,blas on a GPU, xla)")
  ap.add_argument("--attention", default="dense", help="our engine's decode attention")
  ap.add_argument("--layers", default="unrolled,scan",
                  help="our engine's decode layers (choice.LAYERS; the GPU default: unrolled)")
  ap.add_argument("--steps", type=int, default=16, help="decode steps per call")
  ap.add_argument("--context", type=int, default=0,
                  help="positions every slot decodes from (default: the shape's; our kv bound "
                       "is context + 4 x steps + 1)")
  ap.add_argument("--page-size", type=int, default=0,
                  help="our engine over a paged KV cache of pages this long (0: a row per slot)")
  ap.add_argument("--depth", type=int, default=0,
                  help="layers of the model (0: the shape's own; compile time against depth)")
  ap.add_argument("--held-layouts", default=None,
                  help="ours with the weights and the decode state held in the 'default' layouts "
                       "or the 'compiler's (JAX's Layout.AUTO), comma-separated (default: the "
                       "target's, choice.held_layouts)")
  ap.add_argument("--truncate", action="store_true",
                  help="our program for slots that ask for top-k / top-p (where the engine "
                       "compiles it apart: choice.truncation_on_host)")
  ap.add_argument("--json", default=None)
  ap.add_argument("--dump", default=None, help="write each compiled program's HLO text here")
  ap.add_argument("--atomics", action="store_true",
                  help="a GPU's programs: name the kernels whose PTX updates memory by a "
                       "compare-and-swap loop (XLA's dump of each compilation, read here)")
  args = ap.parse_args()
  from areal_jax.kernels import choice
  t_start = time.perf_counter()
  device = target_device(args.target)
  matmuls = (args.matmul or ("xla,blas" if _platform(device) == "cuda" else "xla")).split(",")
  cfg, slots, ctx = SHAPES[args.model]
  ctx = args.context or ctx
  cfg = dataclasses.replace(cfg, dtype="bfloat16", n_layers=args.depth or cfg.n_layers)
  read_MB = decode_step_cost(cfg, slots, ctx)[0] / 1e6
  print(f"compiling for {device.device_kind} on this CPU ({os.cpu_count()} cores), jax "
        f"{jax.__version__}: {args.model} shape ({cfg.n_layers} layers), {slots} slots, context "
        f"{ctx}, {args.steps} steps "
        f"per call; a step must read {read_MB:.0f} MB")
  rows, model = [], None
  if "ours" in args.programs.split(","):
    from flax import nnx

    from areal_jax.models import Transformer
    model = Transformer(cfg, nnx.Rngs(0))  # random weights, once
  held = (args.held_layouts or choice.held_layouts(
      "tpu" if _platform(device) == "tpu" else "gpu")).split(",")
  configs = [(what, layers, matmul, auto) for what in args.programs.split(",")
             for layers in (args.layers.split(",") if what == "ours" else ["scan"])
             for matmul in matmuls
             for auto in ([h == "compiler" for h in held] if what == "ours" else [False])]
  for what, layers, matmul, auto in configs:
    extra = {}
    if args.atomics:  # (a directory per compilation: the last one's kernels are read)
      dump = tempfile.mkdtemp(prefix="aot_ptx_")
      extra = {"xla_dump_to": dump}
    fn, fargs = _program(what, cfg, slots, ctx, args.steps, args.attention, layers, device,
                         matmul, model, args.page_size, extra, args.truncate)
    found = None
    if auto:
      fn, found = _with_auto_layouts(fn, fargs, {**(choice.compiler_options(matmul) or {}),
                                                 **extra} or None, _platform(device))
    t0 = time.perf_counter()
    with choice.lowering_for(_platform(device)):  # Pallas kernels are traced here: compiled ones
      lowered = choice.lower(fn, fargs, _platform(device), device.device_kind)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    hlo = compiled.as_text()
    if args.dump:
      os.makedirs(args.dump, exist_ok=True)
      pathlib.Path(args.dump, f"{what}_{layers}_{matmul}{'_auto' if auto else ''}.hlo").write_text(hlo)
    by_type = collections.Counter()
    per_step = {k: v / args.steps for k, v in sorted(launches(hlo, by_type).items())}
    copied = per_step.pop("copied_bytes", 0.0)
    conditionals = per_step.pop("conditionals", 0.0)
    largest = {t: round(b / args.steps / 1e6, 2) for t, b in by_type.most_common(6)}
    row = {"program": what, "layers": layers, "matmul": matmul,
           "truncate": args.truncate and what == "ours",
           "held_layouts": "compiler" if auto else "default", "lower_s": t1 - t0,
           "compile_s": t2 - t1, "launches_per_step": sum(per_step.values()),
           "copied_MB_per_step": copied / 1e6, "conditionals_per_step": conditionals,
           "gemms_per_step": {k: v for k, v in per_step.items() if k.startswith("gemm")},
           "by_kind_per_step": per_step, "largest_copies_MB_per_step": largest}
    if found:  # the compilation that found the layouts: the engine's widest variant if reusable
      row.update(layouts_compile_s=found["compile_s"], layouts_program_reusable=found["reusable"],
                 layouts_program_same=same_program(found["compiled"].as_text(), hlo))
    if what == "ours":  # the per-layer cache's layout and writes as the engine picks them there
      platform = "tpu" if _platform(device) == "tpu" else "gpu"
      unrolled = layers == "unrolled"
      row.update(attention=args.attention, page_size=args.page_size, cache_layout=(
          "paged" if args.page_size else "stacked" if not unrolled else
          "heads" if choice.heads_major_per_layer(args.attention, platform) else "rows"),
          scatter_writes=unrolled and choice.scatter_cache_writes(platform),
          vocab_major_logits=choice.vocab_major_logits(platform),
          paged_launch=os.environ.get(choice.PAGED_TUNING_ENV, ""),  # (writes=1: our step kernel)
          norm_matmuls=os.environ.get(choice.NORM_MATMUL_ENV, ""))  # (1: norms fused, 3 a layer)
      with choice.matmuls(matmul):  # (as the engine traces it: bfloat16 cache)
        row["query_rows"] = choice.query_rows(jnp.bfloat16)
    if args.atomics:
      row["cas_kernels"] = cas_kernels(dump)
      shutil.rmtree(dump, ignore_errors=True)
    rows.append(row)
    print(f"{what:>6} {layers:>8} {matmul:>5}{' compiler layouts' if auto else ''}: lower {row['lower_s']:5.1f} s, compile "
          f"{row['compile_s']:5.1f} s; per step {row['launches_per_step']:6.1f} launches, "
          f"{row['copied_MB_per_step']:7.1f} MB copied, {conditionals:g} conditionals, "
          f"matmuls {row['gemms_per_step']}\n"
          f"{'':>22}largest copies (MB a step, by result): {largest}", flush=True)
    if args.atomics:
      print(f"{'':>22}kernels with a compare-and-swap loop: {len(row['cas_kernels'])} "
            f"{row['cas_kernels'][:6]}", flush=True)
    if found:
      print(f"{'':>22}the compilation that found the layouts: {found['compile_s']:.1f} s, returns the "
            f"state as it takes it: {found['reusable']}, the same program: "
            f"{row['layouts_program_same']}", flush=True)
  finish({"target": device.device_kind, "model": args.model, "n_layers": cfg.n_layers,
          "slots": slots, "context": ctx,
          "step_read_MB": read_MB,
          "steps_per_call": args.steps, "jax": jax.__version__, "cpu_cores": os.cpu_count(),
          "rows": rows}, args.json, t_start)


if __name__ == "__main__":
  sys.exit(main())
