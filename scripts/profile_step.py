"""Where a training step's CPU time goes, ours beside PyTorch's, by `perf` samples.

One configuration of a results folder (the model and policy of a `matrix.json` row; its batch,
input and segments as that row recorded them) is run four times, interleaved: ours
(`bench-harness run-one --time-only`) and PyTorch eager (`scripts/torch_baseline.py
--time-only`), each with a few timed steps and with more, every run under `perf record`. Each
symbol's CPU time in the short run is taken from the long run's, so what is left is the time of
the extra steps alone (start-up, model building and the warm-up step cancel), divided by their
number: CPU milliseconds per step, summed over the threads. Symbols are grouped into a few kinds
(the matrix product, the kernel's page handling, threads waiting, ...), and the largest are
listed.

    python scripts/profile_step.py --model smollm2-135m-lora --policy off \
        --python /work/pyenv/bin/python --out results/profile-intel-cpu/smollm2-135m-lora-off

Writes `profile.json` and `profile.md` into `--out` (a new folder: nothing is written over) and
keeps the `perf.data` files under `--out/raw` only with `--keep-raw`. Needs `perf` (Linux) and a
release build of the harness from the checked-out tree, whose commit it records (`cargo build
--release -p bench-harness` first). Run it on an idle machine: other processes' load is not sampled,
but it slows the threads it shares cores with.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

# The kinds, first match wins, matched against "dso symbol".
KINDS = [
    ("threads waiting or spinning", r"gomp_|do_spin|do_wait|rayon_core::sleep|wait_until|sched_yield|futex|crossbeam|parking_lot"),
    ("matrix product (gemm, BLAS)", r"gemm|mkl_blas|sgemm|cblas|dnnl|brgemm"),
    ("kernel (page faults, zeroing, system calls)", r"\[kernel"),
    ("memory copy and fill", r"memmove|memcpy|memset|copy_strided|copy_kernel|\bcopy_\w*<"),
    ("allocator", r"malloc|\bfree\b|_int_free|mi_|realloc|cfree"),
    ("random numbers", r"rng|philox|uniform|bernoulli|mt19937"),
    ("Python interpreter", r"libpython|python3"),
]


def kind_of(dso, sym):
    key = f"{dso} {sym}"
    for name, pattern in KINDS:
        if re.search(pattern, key):
            return name
    return "other compute (elementwise, reductions, softmax, ...)"


def row(results, model, policy):
    path = os.path.join(results, "matrix.json")
    with open(path) as f:
        matrix = json.load(f)
    for r in matrix["records"]:
        if r["model"] == model and r["policy"] == policy and r.get("segment_ranges"):
            return r
    found = sorted({(r["model"], r["policy"]) for r in matrix["records"]})
    sys.exit(f"profile_step: {path} has no measured row of {model} {policy}; it has: " + ", ".join(f"{m} {p}" for m, p in found))


def commands(a, r, steps):
    input_size = r["input"].split()[-1]
    segments = ",".join(f"{s}:{e}" for s, e in r["segment_ranges"])
    ours = [a.harness, "run-one", "--model", a.model, "--policy", a.policy, "--profile", a.profile,
            "--steps", str(steps), "--seed", "0", "--device", "cpu", "--time-only"]
    torch = [a.python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_baseline.py"),
             "--model", a.model, "--policy", a.policy, "--segments", segments,
             "--batch", str(r["batch"]), "--input-size", input_size, "--steps", str(steps),
             "--threads", str(r["threads"]), "--seed", "0", "--device", "cpu", "--time-only"]
    return {"ours": ours, "pytorch": torch}


def recorded(cmd, data, frequency):
    """Runs `cmd` under perf; returns the JSON line it prints (its step time, commit or version)
    and its samples."""
    out = subprocess.run(["perf", "record", "-q", "-F", str(frequency), "-o", data, "--"] + cmd,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"profile_step: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    line = [l for l in out.stdout.splitlines() if l.startswith("{")][-1]
    report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym",
                             "--stdio", "-F", "period,dso,sym", "-t", "\t"],
                            capture_output=True, text=True, check=True).stdout
    ns = defaultdict(int)
    for l in report.splitlines():
        parts = [p.strip() for p in l.split("\t")]
        if l.startswith("#") or len(parts) < 3 or not parts[0].isdigit():
            continue
        ns[(parts[1], re.sub(r"^\[[.kug]\] ", "", parts[2]))] += int(parts[0])
    return json.loads(line), ns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--policy", default="off")
    ap.add_argument("--results", default="results/cpu-cpu", help="the folder whose matrix.json has the configuration")
    ap.add_argument("--profile", default="cpu", help="the harness's profile the model belongs to")
    ap.add_argument("--python", default=sys.executable, help="the Python that has torch and transformers")
    ap.add_argument("--harness", default="target/release/bench-harness")
    ap.add_argument("--steps", default="1,4", help="timed steps of the short and the long run")
    ap.add_argument("--frequency", type=int, default=999, help="perf samples a second")
    ap.add_argument("--top", type=int, default=12, help="symbols listed per side")
    ap.add_argument("--out", required=True, help="a new folder for profile.json and profile.md")
    ap.add_argument("--keep-raw", action="store_true", help="keep the perf.data files under --out/raw")
    a = ap.parse_args()
    short, long = (int(s) for s in a.steps.split(","))
    if not 0 < short < long:
        sys.exit(f"profile_step: --steps {a.steps}: the short run's steps must be fewer than the long run's, both above 0")
    if os.path.exists(a.out):
        sys.exit(f"profile_step: {a.out} exists; give a new folder")
    r = row(a.results, a.model, a.policy)
    os.makedirs(a.out)
    raw = os.path.join(a.out, "raw") if a.keep_raw else tempfile.mkdtemp(prefix="profile_step-")
    os.makedirs(raw, exist_ok=True)

    runs = {}
    for steps in (short, long):
        for side, cmd in commands(a, r, steps).items():
            print(f"profiling {side}, {steps} step(s): {' '.join(cmd)}", file=sys.stderr)
            runs[(side, steps)] = recorded(cmd, os.path.join(raw, f"{side}-{steps}.data"), a.frequency)
    if not a.keep_raw:
        for f in os.listdir(raw):
            os.remove(os.path.join(raw, f))
        os.rmdir(raw)

    n = long - short
    # The harness is taken to be built from this tree (build it first): its commit, "-dirty" where
    # code differs from it (results and documentation aside), as the harness names its own.
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
    tree = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results", ":(exclude)docs", ":(exclude)*.md"):
        tree += "-dirty"
    sides = {}
    for side in ("ours", "pytorch"):
        (_, a_ns), (printed, b_ns) = runs[(side, short)], runs[(side, long)]
        per_step = {k: (b_ns.get(k, 0) - a_ns.get(k, 0)) / n / 1e6 for k in set(a_ns) | set(b_ns)}
        kinds = defaultdict(float)
        for (dso, sym), ms in per_step.items():
            kinds[kind_of(dso, sym)] += ms
        top = sorted(per_step.items(), key=lambda kv: -kv[1])[: a.top]
        sides[side] = {
            "version": tree if side == "ours" else printed["framework_version"],
            "step_ms": printed["step_ms_median"],
            "cpu_ms_per_step": sum(per_step.values()),
            "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"dso": d, "symbol": s, "cpu_ms": ms, "kind": kind_of(d, s)} for (d, s), ms in top],
        }
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True).stdout.strip()
    result = {"model": a.model, "policy": a.policy, "machine": cpu, "steps": [short, long],
              "frequency": a.frequency, "command": " ".join(sys.argv), "sides": sides}
    with open(os.path.join(a.out, "profile.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(a.out, "profile.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))


def markdown(p):
    o, t = p["sides"]["ours"], p["sides"]["pytorch"]
    lines = [f"# {p['model']} `{p['policy']}`: where a step's CPU time goes, ours and PyTorch eager", "",
             f"{p['machine']}; `perf record -F {p['frequency']}`, the difference of a {p['steps'][1]}-step "
             f"and a {p['steps'][0]}-step run per extra step; ours built from {o['version']}, PyTorch "
             f"{t['version']}. Command: `{p['command']}`", "",
             "| | ours (CPU ms / step) | PyTorch (CPU ms / step) | ours / PyTorch |", "|---|---|---|---|",
             f"| step time (wall, ms, median of the long run) | {o['step_ms']:.0f} | {t['step_ms']:.0f} | {o['step_ms'] / t['step_ms']:.2f}x |",
             f"| CPU time, all threads | {o['cpu_ms_per_step']:.0f} | {t['cpu_ms_per_step']:.0f} | {o['cpu_ms_per_step'] / t['cpu_ms_per_step']:.2f}x |"]
    for kind in sorted(set(o["kinds"]) | set(t["kinds"]), key=lambda k: -(o["kinds"].get(k, 0) + t["kinds"].get(k, 0))):
        a, b = o["kinds"].get(kind, 0.0), t["kinds"].get(kind, 0.0)
        ratio = f"{a / b:.2f}x" if b > 1 else ""
        lines.append(f"| {kind} | {a:.0f} | {b:.0f} | {ratio} |")
    for side, name in ((o, "ours"), (t, "PyTorch")):
        lines += ["", f"Largest symbols, {name} (CPU ms / step):", "", "| CPU ms | kind | symbol |", "|---|---|---|"]
        for s in side["top"]:
            sym = s["symbol"] if len(s["symbol"]) < 110 else s["symbol"][:107] + "..."
            lines.append(f"| {s['cpu_ms']:.0f} | {s['kind']} | `{sym.replace('|', '/')}` ({s['dso']}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
