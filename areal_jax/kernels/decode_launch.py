"""The decode launches an engine times before it decodes (``launch_stages``,
``rollout.decode_tuning``): on a GPU the kernels ``kernels.choice`` leaves off by default (our
paged step kernel, ``writes``, with or without ``dot``; the fused norms), the decode loop in CUDA
graphs (XLA's command buffers, per program) and, where ``"blas"`` is the default, XLA's autotuned
GEMMs are offered to the engine, stage by stage, which times them against the launch kept so far
on its own device before it decodes and keeps the fastest that computes what its own does
(``sampler/launch_tuning.py``). Only what the environment leaves open is offered (a launch forced
by ``$AREAL_JAX_PALLAS_GPU_PAGED``, ``$AREAL_JAX_DECODE_NORM_MATMUL``, ``$AREAL_JAX_DECODE_MATMUL``
or command buffers in ``$XLA_FLAGS`` is kept). ``"off"``, CPU and TPU: the engine's own launch
only.

``kernels.choice`` re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from areal_jax.kernels import pallas_attention, pallas_norm_matmul, pallas_paged_step
from areal_jax.kernels.pallas_launch import BLOCK_PAGES_ENV, NORM_MATMUL_ENV, PAGED_TUNING_ENV

DECODE_TUNING = ("auto", "off")
GRAPHS = ("", "while", "unrolled")
# XLA's own default: autotune, with the buffers initialized and reinitialized, results checked
AUTOTUNE_LEVEL = 4
# XLA's GPU command buffers (CUDA graphs) by default, as of jax 0.10-0.11: sequences of these
# thunks outside loops; a launch's ``graphs`` adds the decode call's loop over its steps
COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"


@dataclasses.dataclass(frozen=True)
class Launch:
  """How a decode program is launched: ``norms`` (``pallas_launch.norm_matmuls``: each RMSNorm
  with the matmul after it, or None), ``paged`` (``pallas_launch.pallas_gpu_tuning``), ``graphs``
  (``GRAPHS``: on a GPU the call's loop over its steps captured in XLA's command buffers too,
  ``"while"`` as a CUDA graph loop node, ``"unrolled"`` unrolled into one graph; ``""``: XLA's
  defaults) and ``matmul`` (the decode program's matmuls, ``choice.MATMUL``; ``""``: the
  engine's, ``choice.matmul``), ``autotune``: the vendor library's GEMMs (``"blas"``) with XLA's
  autotuning on, which times the library's algorithms for each GEMM of the program when it
  compiles instead of taking its heuristics' first (XLA's Triton GEMMs stay off)."""
  norms: pallas_norm_matmul.NormTuning | None
  paged: pallas_attention.PagedTuning
  graphs: str = ""
  matmul: str = ""
  autotune: bool = False

  def compiler_options(self) -> dict:
    """The XLA options ``graphs`` and ``autotune`` add to a decode program's
    (``choice.compiler_options``)."""
    options = {"xla_gpu_autotune_level": AUTOTUNE_LEVEL} if self.autotune else {}
    if not self.graphs:
      return options
    options["xla_gpu_enable_command_buffer"] = COMMAND_BUFFERS + ",WHILE,CONDITIONAL"
    if self.graphs == "unrolled":
      options["xla_gpu_command_buffer_unroll_loops"] = True
    return options

  @property
  def name(self) -> str:
    """The fields that differ from the defaults, as the environment would force them:
    ``$AREAL_JAX_PALLAS_GPU_PAGED``'s, then ``norms`` (``$AREAL_JAX_DECODE_NORM_MATMUL``'s
    fields after a colon where they differ from its defaults), ``graphs``, ``autotune``,
    ``matmul=`` (``$AREAL_JAX_DECODE_MATMUL``'s); ``"default"`` for none."""
    def changed(obj):
      return [f"{f.name}={int(v) if isinstance(v, bool) else v}" for f in dataclasses.fields(obj)
              if (v := getattr(obj, f.name)) != f.default]
    parts = [",".join(changed(self.paged))] if changed(self.paged) else []
    if self.norms is not None:
      parts.append(":".join(["norms", ",".join(changed(self.norms))] if changed(self.norms)
                            else ["norms"]))
    if self.graphs:
      parts.append("graphs" + (":unrolled" if self.graphs == "unrolled" else ""))
    if self.autotune:
      parts.append("autotune")
    if self.matmul:
      parts.append(f"matmul={self.matmul}")
    return "+".join(parts) or "default"


def launch_stages(platform: str, requested: str, *, paged_pallas: bool, one_device: bool,
                  group: int, page_size: int, head_dim: int,
                  norm_dims: tuple[tuple[int, int], ...], no_triton: str | None = None,
                  matmul_open: bool = False, blas: bool = False
                  ) -> list[Callable[[Launch], list[Launch]]]:
  """The stages of launches an engine times before it decodes (``sampler.launch_tuning``): each
  is given the launch kept so far (first the engine's own) and returns it first, then what may
  replace it; the fastest is kept. ``requested`` (``rollout.decode_tuning``): ``"auto"`` on a GPU
  offers, each where its environment variable leaves it open:

  1. our paged step kernel (``writes``, where the engine's decode attention is ``pallas_gpu`` over
     pages, ``paged_pallas``, at a shape it takes), and it with its scores and output as
     tensor-core dots (``dot``, where ``pallas_paged_step.dot_usable``; on an H200 the engine kept
     ``writes=1,dot=1`` at both decode shapes, ``bench/results/h200-2026-11-30-2b4ab86``), then the
     last of those with Triton's loop unpipelined (``stages=1``, which made JAX's kernel faster
     there), reading two pages a step of its loop (``block_pages``: their loads issued together,
     for rows of a few pages whose attention is bound by the latency of one page's loads after
     another), and in 4 warps a program (``warps``: kept at the Qwen2.5-1.5B shape on an H200,
     ``bench/results/h200-2026-11-30-c75e3df``);
  2. the fused norms (``norms``: an engine over one device, ``norm_dims`` the ``(inputs,
     outputs)`` of the matmuls after its norms, one of which the kernel takes), with programs of
     16 output columns and with its default's (slower than the launch before them on an H200, never
     kept there: ``bench/results/h200-2026-11-30-c75e3df``);
  3. the decode call's loop in CUDA graphs (``graphs_to_time``);
  4. where the engine's decode matmuls are the vendor library's (``blas``), the same with XLA's
     autotuning picking each GEMM's algorithm (``autotune``: with ``blas`` XLA takes the
     library's heuristics' first, which read some of the 1.5B shape's weights well below the
     device's bandwidth on an H200, ``bench/results/h200-2026-11-30-c75e3df``), and XLA's own GEMMs,
     autotuned, for the decode program (``matmul="xla"``), where the engine's are ``"blas"`` by
     default (``choice.matmul_open``: neither ``rollout.decode_matmul`` nor
     ``$AREAL_JAX_DECODE_MATMUL`` names them; faster than ``"blas"`` at the SmolLM2 shape on an
     H100, ``bench/results/h100-2026-11-27-8a1f9a5``). Last, as their compiles autotune (minutes a program
     at the 1.5B shape): the stages before them are timed whatever it costs.

  1 and 2 need Triton (``no_triton``: why not). ``"off"``, CPU and TPU: none."""
  if requested not in DECODE_TUNING:
    raise ValueError(f"rollout.decode_tuning={requested!r} is not one of {DECODE_TUNING}")
  if requested == "off" or platform != "gpu":
    return []
  stages = []
  if (not no_triton and paged_pallas and pallas_paged_step.usable(group, page_size, head_dim)
      and not os.environ.get(PAGED_TUNING_ENV, "").strip()
      and not os.environ.get(BLOCK_PAGES_ENV, "").strip()):
    dots = pallas_paged_step.dot_usable(page_size, head_dim)

    def paged_step(kept: Launch) -> list[Launch]:
      writes = dataclasses.replace(kept.paged, writes=True)
      offers = [writes] + ([dataclasses.replace(writes, dot=True)] if dots else [])
      # the last, unpipelined, reading two pages a step of its loop, and in 4 warps a program
      last = offers[-1]
      offers += [dataclasses.replace(last, stages=1), dataclasses.replace(last, block_pages=2),
                 dataclasses.replace(last, warps=4)]
      return [kept] + [dataclasses.replace(kept, paged=p) for p in offers]
    stages.append(paged_step)
  if (not no_triton and one_device and os.environ.get(NORM_MATMUL_ENV, "").strip() in ("", "0")
      and any(pallas_norm_matmul.usable(*d) for d in norm_dims)):
    # (programs of 16 output columns: 4x the programs of the default's 64 at a decode step's
    # rows, 60 for SmolLM2's q/k/v, where the default's 15 leave most of a GPU's cores idle)
    stages.append(lambda kept: [kept] + [dataclasses.replace(kept, norms=n) for n in (
        pallas_norm_matmul.NormTuning(block_n=16), pallas_norm_matmul.NormTuning())])
  if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    stages.append(graphs_to_time)
  if blas or matmul_open:
    stages.append(lambda kept: [kept] + ([dataclasses.replace(kept, autotune=True)] if blas else [])
                  + ([dataclasses.replace(kept, matmul="xla")] if matmul_open else []))
  return stages


def graphs_to_time(kept: Launch) -> list[Launch]:
  """``kept``, then the same with its decode call's loop over the steps in XLA's command buffers
  (CUDA graphs; ``Launch.graphs``). A SmolLM2 decode step is ~390 small kernels, bound by their
  launches on an H100; XLA puts runs of them (cuBLAS GEMMs and custom
  calls too, with a CUDA 12.3+ driver) in graphs of their own, but each step of the loop is
  launched by the host. XLA captures a loop only if its whole body converts, and ours writes each
  step's outputs at a slice that depends on the step, which XLA takes in a graph only unrolled
  (``"unrolled"``; and CUDA 12.9+ for that slice's child commands); ``"while"`` is timed too, as
  other XLA versions may differ. On an H200 neither changed the step
  (``bench/results/h200-2026-11-30-2b4ab86``: its kernels were already in XLA's command buffers, one
  graph launch a step); a compile without a GPU cannot show it (XLA sees no driver and drops these
  command types: ``bench/results/cpu-aot-h100-graphs-2026-11-30-d291485``)."""
  if kept.graphs:
    return [kept]
  return [kept] + [dataclasses.replace(kept, graphs=g) for g in GRAPHS[1:]]
