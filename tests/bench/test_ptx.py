"""``bench/ptx.py``: a kernel's PTX (as Triton writes it: several instructions a line, inline
assembly, predicates, cache hints) counted by kind and in order; the dump directory read kernel by
kernel; ``--ptx`` only with ``--compile-only``."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import paged_kernel  # noqa: E402
import ptx  # noqa: E402

KERNEL = """
.visible .entry paged_decode_step(
	mov.u32 %r20, 0x0; ld.global.b32 { %r20 }, [ %rd6 + 0 ];
	mov.u16 %rs2, 0x0; ld.global.L1::evict_last.b16 { %rs2 }, [ %rd8 + 0 ];
	@%p3 st.global.b16 [ %rd9 + 0 ], { %rs2 };
	bar.sync 	0;
	@%p1 cp.async.cg.shared.global [ %r1 + 0 ], [ %rd2 + 0 ], 0x10, %r3;
	@%p1 cp.async.cg.shared.global [ %r4 + 0 ], [ %rd5 + 0 ], 0x10, %r3;
	cp.async.wait_group 0x0;
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %f1 }, { %r5 }, { %r6 }, { %f2 };
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 { %f3 }, %rd1, %rd2;
	mov.u32 %r130, 0x0; ld.global.v4.b32 { %r130, %r131, %r132, %r133 }, [ %rd84 + 0 ];
"""


def test_instructions_are_counted_by_kind_in_order():
  s = ptx.summary(KERNEL)
  assert s["counts"] == {"ld.global.v": 1, "ld.global.b16": 1, "ld.global.b32": 1, "cp.async": 2,
                         "cp.async.wait": 1, "bar.sync": 1, "mma": 1, "wgmma": 1,
                         "st.global": 1}
  assert s["order"] == ("ld.global.b32 x1, ld.global.b16 x1, st.global x1, bar.sync x1, "
                        "cp.async x2, cp.async.wait x1, mma x1, wgmma x1, ld.global.v x1")
  assert ptx.summary("")["counts"]["mma"] == 0


def test_a_kernels_ptx_is_taken_by_name_and_the_dump_emptied(tmp_path):
  (tmp_path / "module_0001.jit_f.1.ptx").write_text(".visible .entry input_fusion_3(\n bar.sync 0;")
  (tmp_path / "module_0001.jit_f.2.ptx").write_text(KERNEL)
  (tmp_path / "module_0001.jit_f.ir").mkdir()
  assert ptx.take(str(tmp_path), "paged_decode") == KERNEL
  assert list(tmp_path.iterdir()) == []
  (tmp_path / "m.ptx").write_text(KERNEL)
  assert ptx.take(str(tmp_path), "norm_matmul") is None and list(tmp_path.iterdir()) == []


def test_ptx_needs_compile_only(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["paged_kernel.py", "--model", "tiny", "--ptx"])
  with pytest.raises(SystemExit):
    paged_kernel.main()
