"""Prints the before/after table of this folder's JSON files (run.sh)."""
import glob
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
print(f"{'variant':<10} {'rep':>3} {'side':<7} {'max_len':>7} {'reprefill s':>11} {'continue s':>10}"
      f" {'ratio':>6} {'load':>5}")
for variant in ("rows", "paged", "rows2048", "paged2048"):
  for rep in (1, 2):
    for side in ("before", "after"):
      path = os.path.join(here, f"{side}_{variant}_{rep}.json")
      if not os.path.exists(path):
        continue
      d = json.load(open(path))
      r = d["rows"]
      print(f"{variant:<10} {rep:>3} {side:<7} {d['max_len']:>7} {r['reprefill']['turns_2_3_s']:>11.2f}"
            f" {r['continue']['turns_2_3_s']:>10.2f} {d['speedup']:>6.2f} {d['machine']['load_avg']:>5.2f}")
