#!/bin/bash
# Before (HEAD d1751db, /tmp/before worktree with this session's bench/continuation.py) and after
# (the working tree), interleaved, twice, row cache and paged cache; default sizes, max_len the
# conversation's (401) and 2048 (as a reasoning recipe's).
set -e
OUT=$(cd "$(dirname "$0")" && pwd)
for rep in 1 2; do
  for variant in rows paged rows2048 paged2048; do
    flag=$(case $variant in paged) echo --paged;; rows2048) echo --max-len 2048;;
           paged2048) echo --paged --max-len 2048;; esac)
    for side in before after; do
      root=$([ $side = before ] && echo /tmp/before || echo /work/main)
      (cd $root/bench && PYTHONPATH=$root /work/main/.venv/bin/python continuation.py $flag \
        --json $OUT/${side}_${variant}_$rep.json > $OUT/${side}_${variant}_$rep.log 2>&1)
      echo "$side $variant $rep: $(grep 'reprefill /' $OUT/${side}_${variant}_$rep.log)"
    done
  done
done
