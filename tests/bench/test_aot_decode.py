"""``bench/aot_decode.launches``: the kernels and copies of a compiled program, counted per run, on a
hand-written GPU-style HLO module and on programs XLA:CPU compiles here (the CUDA plugin that
``bench/aot_decode.py`` compiles with is not installed in CI)."""

import collections
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import aot_decode  # noqa: E402

# a layer loop as XLA:GPU compiles one (trimmed): a weight sliced out of the stacked weights into a
# buffer of its own (a copy), a cuBLAS call on it, an elementwise fusion; 4 trips, from an entry
# that also runs one Triton GEMM fusion
_HLO = """HloModule m

%slice_w (p0: bf16[4,16,16], p1: s32[]) -> bf16[1,16,16] {
  %p0 = bf16[4,16,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %four = s32[] constant(4)
  %wrapped = s32[] remainder(%p1, %four)
  %ds = bf16[1,16,16]{2,1,0} dynamic-slice(%p0, %wrapped, %c0, %c0), dynamic_slice_sizes={1,16,16}
  ROOT %cp = bf16[1,16,16]{2,1,0} copy(%ds)
}

%act (p0.1: f32[8,16]) -> f32[8,16] {
  %p0.1 = f32[8,16]{1,0} parameter(0)
  ROOT %t = f32[8,16]{1,0} tanh(%p0.1)
}

%body (arg: (s32[], f32[8,16], bf16[4,16,16])) -> (s32[], f32[8,16], bf16[4,16,16]) {
  %arg = (s32[], f32[8,16]{1,0}, bf16[4,16,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[8,16]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[4,16,16]{2,1,0} get-tuple-element(%arg), index=2
  %wi = bf16[1,16,16]{2,1,0} fusion(%w, %i), kind=kCustom, calls=%slice_w, backend_config={"fusion_backend_config":{"kind":"__custom_fusion"}}
  %mm = (f32[8,16]{1,0}, s8[0]{0}) custom-call(%x, %wi), custom_call_target="__cublas$lt$matmul"
  %y = f32[8,16]{1,0} get-tuple-element(%mm), index=0
  %z = f32[8,16]{1,0} fusion(%y), kind=kLoop, calls=%act
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,16]{1,0}, bf16[4,16,16]{2,1,0}) tuple(%next, %z, %w)
}

%cond (arg.1: (s32[], f32[8,16], bf16[4,16,16])) -> pred[] {
  %arg.1 = (s32[], f32[8,16]{1,0}, bf16[4,16,16]{2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%gemm (a: f32[8,16], b: f32[16,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,16]{1,0} parameter(1)
  ROOT %d = f32[8,16]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x.0: f32[8,16], w.0: bf16[4,16,16], v.0: f32[16,16]) -> f32[8,16] {
  %x.0 = f32[8,16]{1,0} parameter(0)
  %w.0 = bf16[4,16,16]{2,1,0} parameter(1)
  %v.0 = f32[16,16]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, bf16[4,16,16]{2,1,0}) tuple(%zero, %x.0, %w.0)
  %loop = (s32[], f32[8,16]{1,0}, bf16[4,16,16]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %h = f32[8,16]{1,0} get-tuple-element(%loop), index=1
  ROOT %g = f32[8,16]{1,0} fusion(%h, %v.0), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
}
"""


def test_counts_a_gpu_layer_loop_by_its_trip_count():
  """Each launch in the loop body counted 4 times, the matmuls by library, and the weight slice's
  bytes as copied (its fusion only moves data: a slice, a copy and scalar index arithmetic)."""
  copies = collections.Counter()
  n = aot_decode.launches(_HLO, copies)
  assert n == {"fusion:__custom_fusion": 4, "gemm:cublas": 4, "fusion:kLoop": 4,
               "add": 4,  # the loop counter's increment, unfused here: an instruction of its own
               "gemm:triton": 1, "copied_bytes": 4 * 16 * 16 * 2}
  assert copies == {"bf16[1,16,16]{2,1,0}": 4 * 16 * 16 * 2}  # what was copied, by result type


def test_an_asynchronous_fusion_counts_once():
  """JAX 0.11's XLA:GPU makes some fusions asynchronous (a decode call's output writes): a
  ``fusion-start`` launches the fusion and its ``fusion-done`` only waits for it, so the pair
  counts as the one fusion it replaces (JAX 0.10's program held that fusion plainly)."""
  start = ("  %zs = ((f32[8,16]{1,0}), f32[8,16]{1,0}, u32[]) fusion-start(%y), kind=kLoop, "
           "calls=%act\n  %z = f32[8,16]{1,0} fusion-done(%zs)")
  plain = "  %z = f32[8,16]{1,0} fusion(%y), kind=kLoop, calls=%act"
  assert plain in _HLO
  assert aot_decode.launches(_HLO.replace(plain, start)) == aot_decode.launches(_HLO)


def test_a_loop_without_a_known_trip_count_takes_its_conditions_bound():
  """TPU programs carry no ``known_trip_count``: the bound of the loop's ``i < N`` condition
  stands in (layouts annotated as a TPU program's are), and a loop with neither counts once."""
  tpu = (_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
         .replace("%n = s32[] constant(4)", "%n = s32[]{:T(128)} constant(4)"))
  assert aot_decode.launches(tpu) == aot_decode.launches(_HLO)
  unknown = tpu.replace("direction=LT", "direction=NE")
  assert aot_decode.launches(unknown)["gemm:cublas"] == 1


def _compiled(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


def test_counts_scale_with_the_trip_counts_of_nested_loops():
  """A scan of ``layers`` matmuls inside a loop of ``steps``, compiled here: the matmul's kind
  launches steps x layers times, and a loop's trip count multiplies everything in its body."""
  def program(steps, layers):
    def f(w, x):
      def layer(x, wi):
        return jnp.tanh(x @ wi), None
      return jax.lax.fori_loop(0, steps, lambda i, x: jax.lax.scan(layer, x, w)[0], x)
    return aot_decode.launches(_compiled(f, jnp.ones((layers, 32, 32)), jnp.ones((4, 32))))

  base, steps2, layers2 = program(3, 5), program(6, 5), program(3, 10)
  assert any(base[k] == 15 and steps2[k] == 30 and layers2[k] == 30 for k in base), base
  assert sum(steps2.values()) > sum(base.values())


def test_a_conditional_counts_its_cheapest_branch():
  """The sampler's top-k/top-p branch (a sort of the vocabulary) runs only when asked: a
  conditional counts as its cheapest branch, so the sort is not counted; the conditionals run
  are counted apart (on a GPU each is a wait for the host), by their loops' trip counts."""
  def f(p, x):
    return jax.lax.cond(p, lambda x: jnp.sort(jnp.exp(x) * 2, axis=-1), lambda x: x + 1, x)
  n = aot_decode.launches(_compiled(f, True, jnp.ones((4, 64))))
  assert not any("sort" in k for k in n) and n["conditionals"] == 1
  assert 1 <= sum(v for k, v in n.items() if k not in ("copied_bytes", "conditionals")) <= 3
  looped = lambda p, x: jax.lax.fori_loop(0, 5, lambda i, x: f(p, x) * 0.5, x)
  assert aot_decode.launches(_compiled(looped, True, jnp.ones((4, 64))))["conditionals"] == 5


def _in_tables(lines, line):
  """Whether ``line`` is one of the source tables' lines (a name line or a numbered entry)."""
  import re  # noqa: PLC0415
  return line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames") or bool(
      re.match(r"\d+ ", line))


def test_same_program_ignores_names_schedule_and_metadata_but_not_shapes_or_layouts():
  """``same_program``: whether the program that found the held layouts is the one compiled with
  them (the engine's widest variant); on programs XLA:CPU compiles here."""
  def compiled(n):
    f = jax.jit(lambda x, y: (jnp.tanh(x @ y) + 1.0, x * 2.0), donate_argnums=0)
    return f.lower(jnp.ones((8, n)), jnp.ones((n, n))).compile().as_text()

  hlo = compiled(16)
  header, *body = hlo.splitlines()
  renamed = "\n".join([header] + [line.replace("%", "%renamed_") for line in body])
  assert renamed != hlo and aot_decode.same_program(hlo, renamed)
  # annotations a single device ignores, with braces inside (a jaxpr in an op name, a tuple's)
  k = next(i for i, line in enumerate(body) if " = " in line)
  annotated = list(body)
  annotated[k] += ', sharding={{replicated}, {maximal device=0}}, metadata={op_name="jit(f)/while[' \
                  'body_jaxpr={ lambda ; a:f32[]. let  in (a,) }]" source_line=3}'
  # the source tables (after the header in this version's text) hold other files and frames
  tables = [i for i, line in enumerate(annotated) if line in ("FileNames", "StackFrames")]
  assert tables, "no source tables in the compiled text"
  for i in tables:
    annotated[i + 1] = '1 "traced_elsewhere.py"' if annotated[i] == "FileNames" else "7 {x=1}"
  assert aot_decode.same_program(hlo, "\n".join([header] + annotated))
  # tables moved to the end (as other versions write them): the same program
  moved = [line for line in annotated if not _in_tables(annotated, line)]
  assert aot_decode.same_program(hlo, "\n".join([header] + moved + ["FileNames", '1 "x.py"']))
  # but a change in a computation's body (not in the header) is a different program
  assert "tanh(" in hlo and not aot_decode.same_program(hlo, hlo.replace("tanh(", "exponential("))
  ops = [i for i, line in enumerate(body) if " = " in line and "ROOT" not in line]
  if len(ops) >= 2:  # the schedule's order of two instructions swapped
    swapped = list(body)
    swapped[ops[0]], swapped[ops[1]] = swapped[ops[1]], swapped[ops[0]]
    assert aot_decode.same_program(hlo, "\n".join([header] + swapped))
  assert not aot_decode.same_program(hlo, compiled(32))  # other shapes
  assert not aot_decode.same_program(hlo, hlo.replace("{1,0}", "{0,1}", 1))  # another layout


def test_cas_kernels_names_the_kernels_that_update_memory_by_compare_and_swap(tmp_path):
  """``--atomics``: the entries of XLA's dumped PTX holding a compare-and-swap (a bfloat16 scatter
  XLA is not told writes each element once loops on one), not those with plain stores or other
  atomics."""
  (tmp_path / "module_0001.jit_fn.1.ptx").write_text(
      ".visible .entry input_scatter_fusion_3(\n\t.param .u64 p0\n)\n{\n"
      "\tatom.relaxed.sys.global.cas.b32 \t%r8, [%rd3+64], %r37, %r36;\n}\n"
      ".visible .entry loop_add_fusion(\n)\n{\n\tst.global.b16 \t[%rd1], %rs1;\n}\n")
  (tmp_path / "module_0001.jit_fn.2.ptx").write_text(
      ".visible .entry input_scatter_fusion_4(\n)\n{\n\tst.global.b16 \t[%rd2], %rs1;\n}\n"
      ".entry input_reduce_fusion(\n)\n{\n\tatom.global.add.f32 \t%f1, [%rd1], %f2;\n}\n")
  (tmp_path / "module_0001.jit_fn.ir-with-opt.ll").write_text("cmpxchg")  # not PTX
  assert aot_decode.cas_kernels(str(tmp_path)) == ["input_scatter_fusion_3"]


def test_target_devices_name_what_is_missing():
  """A GPU target with no file under bench/aot_targets, and a TPU topology without libtpu (CI has
  neither the CUDA plugin nor libtpu), stop with a message that names what to install or use."""
  import pytest
  with pytest.raises(SystemExit, match=r"no GPU target 'v100' .*'h100_sxm', 't4'"):
    aot_decode.target_devices("v100", 8)
  try:
    import libtpu  # noqa: F401
  except ImportError:
    with pytest.raises(SystemExit, match=r"compiling for TPU 'v5e:2x4' needs libtpu, jax\[tpu\]"):
      aot_decode.target_devices("v5e:2x4")
