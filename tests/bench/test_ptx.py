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


# XLA's thunk sequence as it dumps it (``*.thunk_sequence.txt``), compiled for an H100
THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] input_concatenate_fusion grid: [288, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
002: kCustomKernel [prev=001 (1) | next=003 (1)] paged_decode_step grid: [128, 2, 1] threads: [256, 1, 1]  shared_memory: 133120 bytes
003: kCustomKernel [prev=002 (1) | next=004 (1)] paged_decode_step grid: [128, 2, 1] threads: [256, 1, 1]  shared_memory: 133120 bytes
"""


def test_a_kernels_launch_is_read_off_the_thunk_sequence(tmp_path):
  (tmp_path / "module_0001.jit_f.thunk_sequence_after_thunk_passes.txt").write_text("")
  (tmp_path / "module_0001.jit_f.thunk_sequence.txt").write_text(THUNKS)
  launch = ptx.geometry(str(tmp_path), "paged_decode")
  assert launch == {"grid": [128, 2, 1], "threads": 256, "shared_bytes": 133120, "programs": 256}
  assert ptx.geometry(str(tmp_path), "input_concatenate")["shared_bytes"] == 0
  assert ptx.geometry(str(tmp_path), "norm_matmul") is None


def test_blocks_a_sm_holds_and_the_waves_of_a_grid():
  h100 = ptx.gpu("h100")
  assert h100 == {"core_count": 132, "shared_memory_per_core": 233472,
                  "threads_per_core_limit": 2048}
  launch = {"grid": [128, 2, 1], "threads": 256, "shared_bytes": 133120, "programs": 256}
  # 228 KiB an SM holds one block of 130 KiB (+1 KiB CUDA keeps): 256 blocks on 132 SMs, 2 waves
  assert ptx.residency(launch, h100) == {"per_sm": 1, "bound": "shared memory", "waves": 2,
                                         "sms": 132}
  # two blocks of 113.5 KiB would fit 228 KiB but for the 1 KiB CUDA keeps for each
  assert ptx.residency(dict(launch, shared_bytes=116224), h100)["per_sm"] == 1
  small = dict(launch, shared_bytes=1024)  # 8 blocks of 256 threads fill an SM's 2048
  assert ptx.residency(small, h100) == {"per_sm": 8, "bound": "threads", "waves": 1, "sms": 132}
  tiny = dict(launch, threads=32, shared_bytes=0, grid=[5000, 1, 1], programs=5000)
  assert ptx.residency(tiny, h100)["bound"] == "blocks"  # 32 a SM: 4224 at once, 2 waves
  assert ptx.residency(tiny, h100)["waves"] == 2
  text = ptx.launch_text({**launch, "residency": ptx.residency(launch, h100)})
  assert text == ("grid 128x2x1 of 256 threads, 130.0 KiB shared: <= 1 a SM (shared memory), "
                  ">= 2 wave(s) on 132 SMs")
  with pytest.raises(ValueError, match="no GPU description"):
    ptx.gpu("v100")
