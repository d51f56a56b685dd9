"""The table of scripts/stock-vs-patched.sh: from OUT/runs/*.json, per model and policy, the step
peak (round 1) and the step time (the median of every round's median) on each build, and their
ratios. Usage: stock_vs_patched_table.py OUT COMMIT PROFILE."""

import json
import pathlib
import platform
import statistics
import sys

out, commit, profile = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
runs = {}
for f in sorted(out.glob("runs/*.json")):
    build, rest = f.stem.split("-", 1)
    name, rnd = rest.rsplit("-r", 1)
    model, policy = name.rsplit("-", 1)
    runs.setdefault((model, policy), {}).setdefault(build, {})[int(rnd)] = json.loads(f.read_text())

cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
flags = open("/proc/cpuinfo").read()
vec = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
mib = lambda b: f"{b / 2**20:.1f} MiB"
print("# What the vendored candle-core buys (CPU)\n")
print(f"Command: `scripts/stock-vs-patched.sh` (commit {commit}; each configuration a fresh `bench-harness run-one --profile {profile}` process, the two builds in turn)  ")
print(f"Machine: {cpu}, {vec}, 2 cores\n")
print("*patched*: this repository's build, remat with `patched-candle` over `vendor/candle-core`; *stock*: the same commit on candle-core 0.11.1 as published. Step peak: the step's heap peak above the model state (round 1); step time: the median over the rounds of each round's median of 3 timed steps; grads: bit-identical to plain candle on that build.\n")
print("| model | policy | step peak patched | step peak stock | stock / patched | step time patched | step time stock | stock / patched | grads patched / stock | planner's peak stock, error |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (model, policy), builds in sorted(runs.items(), key=lambda kv: (list(runs).index(kv[0]))):
    p, s = builds.get("patched", {}), builds.get("stock", {})
    if 1 not in p or 1 not in s:
        continue
    t = lambda b: statistics.median(r["step_ms_median"] for r in b.values())
    pk = lambda b: b[1]["step_peak_bytes"]
    pred = s[1].get("predicted_peak_bytes")
    err = f"{mib(pred)}, {100 * (pred / pk(s) - 1):+.2f}%" if pred else "-"
    same = lambda b: "yes" if b[1].get("grads_bit_identical") else "no"
    print(f"| {model} | {policy} | {mib(pk(p))} | {mib(pk(s))} | {pk(s) / pk(p):.2f} | {t(p):.0f} ms | {t(s):.0f} ms | {t(s) / t(p):.2f} | {same(p)} / {same(s)} | {err} |")
