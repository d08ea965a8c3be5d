# session 47: second turns of conversations sharing a ~110-token system prompt, before (706428f: a
# prompt sharing only a kept turn's prompt used it up) and after (e682319 and later: it runs on a
# copy and leaves the turn kept), one after the other; "before" is a worktree of 706428f with this
# session's bench/serve.py and bench/common.py copied in. From the repository root:
#   bash bench/results/cpu-serve-follow-ups-2026-11-30-s47/system_prompt/run.sh CLIENTS THINK_S TAG
R=bench/results/cpu-serve-follow-ups-2026-11-30-s47/system_prompt
SYS="$(cat $R/system_prompt.txt)"
for side in after before; do
  dir=$PWD; [ $side = before ] && dir=/tmp/wt706
  (cd $dir && /work/main/.venv/bin/python bench/serve.py --follow-ups --phase-s 20 \
    --clients $1 --think-s $2 --set "task.system_prompt=$SYS" --set rollout.max_prompt_len=320 \
    --set "rollout.prefill_buckets=(160,320)" --json /work/main/$R/${side}_$3.json) \
    2>&1 | grep -v -i warn > $R/${side}_$3.log
done
# runs: `run.sh 4 0 c4_think0` (its files renamed from after_1 / before_1 of an earlier version of
# this script, the same command), `run.sh 8 1.0 c8_think1`, `run.sh 8 1.0 c8_think1_rerun`
