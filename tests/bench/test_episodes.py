"""``bench/episodes.py``'s keyed figures: ``episodes_for_90pct[L]`` is the fewest episodes in
flight whose tokens/s reach 90% of the best at L = 0, latency keys as written, and the long tail's
draws have mean L."""

import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import episodes  # noqa: E402


def point(lat, n, tok, busy=1.0, fill=0.9):
  return dict(L=lat, n=n, tokens_per_s=tok, busy_frac=busy, slot_fill=fill,
              host_rss_kib_per_episode=1.0, episode_cpu_ms_per_s_per_episode=0.1)


def test_episodes_for_90pct_against_the_best_point_without_latency():
  points = [point("0", 1, 100.0, fill=0.01), point("0", 64, 1000.0), point("0", 256, 950.0),
            point("1", 64, 300.0, busy=0.3), point("1", 256, 899.0), point("1", 512, 905.0),
            point("5", 512, 100.0, busy=0.1)]
  out = episodes.summary(points)
  assert out["episodes_for_90pct"] == {"0": 64, "1": 512, "5": None}
  assert out["tokens_per_s"]["1"]["256"] == 899.0 and out["busy_frac"]["1"]["64"] == 0.3
  assert out["episodes_for_90pct_slot_use"] == {"0": 64, "1": 256, "5": None}
  assert episodes.summary([point("1", 64, 300.0)])["episodes_for_90pct"] == {"1": None}


def test_latency_keys_and_the_long_tail():
  assert [episodes.Latency(s).key for s in ("0", "0.10", "1", "5.0", "1t")] == \
      ["0", "0.1", "1", "5", "1t"]
  fixed, tail = episodes.Latency("1"), episodes.Latency("1t")
  assert fixed.draw() == 1.0
  draws = [tail.draw() for _ in range(20000)]
  assert min(draws) >= 0.5 and abs(statistics.mean(draws) - 1.0) < 0.1
  assert max(draws) > 5.0  # a tail: some steps take several times the mean
