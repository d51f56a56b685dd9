"""The table of scripts/stock-vs-patched.sh: from OUT/runs/*.json, per model and policy, the step
peak (round 1) on each build, patch by patch, beside PyTorch's on the same segments, and the step
time (the median of every round's median). Usage: stock_vs_patched_table.py OUT COMMIT PROFILE."""

import json
import pathlib
import platform
import statistics
import sys

out, commit, profile = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
BUILDS = ["release", "units", "0001", "0002", "0003", "patched"]
HEADS = ["release", "release, +units=auto", "+0001", "+0002", "+0003", "+0004 = patched"]
runs = {}
for f in sorted(out.glob("runs/*.json")):
    build, rest = f.stem.split("-", 1)
    name, rnd = rest.rsplit("-r", 1)
    model, policy = name.rsplit("-", 1)
    runs.setdefault((model, policy), {}).setdefault(build, {})[int(rnd)] = json.loads(f.read_text())
rows = [(key, b) for key, b in runs.items() if all(1 in b.get(x, {}) for x in BUILDS)]

cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
flags = open("/proc/cpuinfo").read()
vec = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
mib = lambda b: f"{b / 2**20:.1f}"
peak = lambda b: b[1]["step_peak_bytes"]
time = lambda b: statistics.median(r["step_ms_median"] for r in b.values())


def head(*columns):
    """A Markdown table's header and separator lines."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


print("# What the vendored candle-core buys, patch by patch (CPU)\n")
print(f"Command: `scripts/stock-vs-patched.sh` (commit {commit}; each configuration a fresh `bench-harness run-one --profile {profile}` process per build, the builds in turn; PyTorch by `scripts/torch_baseline.py` on the segments our policy chose)  ")
print(f"Machine: {cpu}, {vec}, 2 cores\n")
print("Builds of one commit, each adding one patch of `vendor/patches` to the one before (they apply in that order): *release* is candle-core 0.11.1 as published, remat without `patched-candle` (a stage graph reads each float input through a copy, `Var::from_tensor`); *release, +units=auto* is the same build under the policy with `+units=auto` (each segment run backward in the units of stages the planner predicts lowest: a unit reads what its own stages produce without copies, and holds its gradients until its whole backward returns); *+0002* switches remat to `patched-candle` (`Var::sharing`: no copies); *+0004* is this repository's build. From *+0001* on, a column's change from the one before is its patch's.\n")
print("## Step peak (MiB above the model state, round 1)\n")
head("model", "policy", *HEADS, "release / patched", "units / patched", "PyTorch", "units / PyTorch", "patched / PyTorch")
for (model, policy), b in rows:
    pt = b.get("pytorch", {}).get(1, {}).get("step_peak_bytes")
    vs = lambda x: f"{x / pt:.2f}" if pt else "-"
    print(f"| {model} | {policy} | " + " | ".join(mib(peak(b[x])) for x in BUILDS)
          + f" | {peak(b['release']) / peak(b['patched']):.2f} | {peak(b['units']) / peak(b['patched']):.2f} | {mib(pt) if pt else '-'} | {vs(peak(b['units']))} | {vs(peak(b['patched']))} |")
print("\n## Where the release's extra peak is (the planner's breakdown at the peak, release minus patched, MiB)\n")
print("*held*: activations and the stage graphs' inputs (remat's copies on the release); *in backward*: the buffers of the backward running at the peak (candle's gradient sums: zeros, the gradient, their sum); *gradients*: parameter and value gradients held.\n")
head("model", "policy", "held", "in backward", "gradients", "total")
for (model, policy), b in rows:
    at = lambda x: b[x][1]["estimate"]["at_peak"]
    d = lambda k: at("release")[k] - at("patched")[k]
    grads = d("param_grads") + d("value_grads")
    held = d("live") + d("stored") + d("kept")
    print(f"| {model} | {policy} | {mib(held)} | {mib(d('transient'))} | {mib(grads)} | {mib(held + d('transient') + grads)} |")
print("\n## Step time (ms) and checks\n")
print("Step time: the median of 3 timed steps after a warm-up; release, units and patched: the median over the rounds (round 1 and the time-only rounds), the others round 1's. Units: the units the planner chose. Grads: bit-identical to plain candle on that build (all six runs). Planner: the predicted step peak's error.\n")
head("model", "policy", *HEADS, "release / patched", "PyTorch", "units", "grads", "planner, release / units / patched")
for (model, policy), b in rows:
    pt = b.get("pytorch", {}).get(1, {}).get("step_ms_median")
    same = "yes" if all(b[x][1].get("grads_bit_identical") for x in BUILDS) else "no: " + ", ".join(x for x in BUILDS if not b[x][1].get("grads_bit_identical"))
    def err(x):
        pred = b[x][1].get("predicted_peak_bytes")
        return f"{100 * (pred / peak(b[x]) - 1):+.2f}%" if pred else "-"
    print(f"| {model} | {policy} | " + " | ".join(f"{time(b[x]):.0f}" for x in BUILDS)
          + f" | {time(b['release']) / time(b['patched']):.2f} | {f'{pt:.0f}' if pt else '-'} | `{b['units'][1].get('plan') or '-'}` | {same} | {err('release')} / {err('units')} / {err('patched')} |")
