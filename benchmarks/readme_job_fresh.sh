#!/bin/bash
# README main job as a user runs it: fresh processes, auto (plan cache filled by one earlier run) vs plain.
export SGLANG_TEV_CACHE=/tmp/m37/cache
cd /tmp/m37
P="def fibonacci(n):"
for T in 0 1; do sglang-tev generate "$P" --temperature $T > /dev/null 2> warm_T$T.err; done   # fills the cache
for rep in 1 2 3; do for T in 0 1; do
  sglang-tev generate "$P" --temperature $T --seed $rep > /dev/null 2> auto_T${T}_$rep.err
  sglang-tev generate "$P" --temperature $T --seed $rep --method autoregressive > /dev/null 2> plain_T${T}_$rep.err
done; done
python - <<'PY'
import re, glob, statistics
def tps(f): return float(re.search(r"([\d.]+) tok/s", open(f).read()).group(1))
for T in (0, 1):
    r = [tps(f"auto_T{T}_{i}.err") / tps(f"plain_T{T}_{i}.err") for i in (1, 2, 3)]
    print(f"T={T}: auto/plain per pair {[round(x,2) for x in r]} median {statistics.median(r):.2f}")
    for i in (1,2,3): print("  ", open(f"auto_T{T}_{i}.err").read().strip()[:200])
PY
