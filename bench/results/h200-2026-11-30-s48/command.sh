#!/usr/bin/env bash
# Session 48's two device calls (tool `run`, carry [".whl", ".old"]), after `bash bench/device_prep.sh`
# here (flax 0.12.12 as a wheel; .old = `git archive 955fbb8^ areal_jax`, the code before #18).
# Code: 74899aa. Call 1 (timeout_s 600; 1_*):
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; OUT=$OUT ACC_DEADLINE=560 bash bench/accelerator_check.sh $PWD/.old > $OUT/log.txt 2>&1; tail -c 11000 $OUT/log.txt
# Call 2 (timeout_s 235, a fresh machine; 2_*): the same with ACC_DEADLINE=205 (the must-shows again)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; OUT=$OUT ACC_DEADLINE=205 bash bench/accelerator_check.sh $PWD/.old > $OUT/log.txt 2>&1; grep -v -E "^Finished|^Compiling|Persistent compilation" $OUT/log.txt | tail -c 9000
