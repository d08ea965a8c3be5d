"""Building the CPU kernels: cached per source, compiler, jaxlib and CPU, published atomically."""

from areal_jax.kernels import cpu_attention, cpu_ffi


def test_build_is_cached_and_atomic(monkeypatch, tmp_path):
  """The library lands whole under the cache directory, once; a second build reuses it."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  path = cpu_ffi.build(cpu_attention.SOURCE)
  assert path.startswith(str(tmp_path)) and path.endswith(".so")
  mtime = (tmp_path / path).stat().st_mtime_ns
  assert cpu_ffi.build(cpu_attention.SOURCE) == path and (tmp_path / path).stat().st_mtime_ns == mtime
  assert [p.name for p in (tmp_path / "areal_jax").iterdir()] == [path.rsplit("/", 1)[1]]
