# session 47, AMD EPYC 2 cores, from the repository root (.venv):
python bench/serve.py --follow-ups --phase-s 30 --json bench/results/cpu-serve-follow-ups-2026-11-30-s47/follow_ups.json > bench/results/cpu-serve-follow-ups-2026-11-30-s47/log.txt 2>&1
PYTHONPATH=. python bench/results/cpu-serve-follow-ups-2026-11-30-s47/warmup_time.py   # printed: warm-up 56.2 s: 45 programs in 39.0 s, 35 continuation programs in 16.3 s
