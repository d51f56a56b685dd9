#!/usr/bin/env python3
"""Shape of the codebase: lines per crate, the largest files and functions, public functions that
take a bare `bool`, and import circles.

    python3 scripts/code_stats.py            # the whole workspace
    python3 scripts/code_stats.py --limit 80 # list every function longer than 80 lines

A `pub fn` (not `pub(crate)` or `pub(super)`) takes a bare `bool` when one of its parameters is
typed `bool`: its call site shows `true` or `false`, not what they mean.

A function is measured from its `fn` line to the closing brace at the same indentation (the code
is rustfmt-formatted, so that is where it ends). A crate's import graph has an edge from module A
to module B when A's files name `crate::B`, `super::B` (from a child module) or `B::` of a sibling
declared with `mod B;`; circles are its strongly connected components of more than one module.
"""
import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FN = re.compile(r"^(\s*)(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?(?:extern\s+\"C\"\s+)?fn\s+(\w+)")


def crates():
    """Every workspace member: (name, directory)."""
    for toml in sorted(ROOT.glob("**/Cargo.toml")):
        if "target" in toml.parts or "vendor" in toml.parts or toml.parent == ROOT:
            continue
        name = re.search(r'^name\s*=\s*"([^"]+)"', toml.read_text(), re.M)
        if name:
            yield name.group(1), toml.parent


def rust_files(directory):
    return sorted(p for p in directory.rglob("*.rs") if "target" not in p.parts)


def functions(path):
    """(name, first line, length in lines) of every fn in a file."""
    lines = path.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        m = FN.match(line)
        if not m or line.rstrip().endswith(";"):
            continue
        indent = m.group(1)
        for j in range(i, len(lines)):
            if lines[j].rstrip().endswith("{") or "{" in lines[j]:
                break
        end = None
        if lines[j].rstrip().endswith("}") and lines[j].count("{") == lines[j].count("}"):
            end = j  # a one-line body
        else:
            for k in range(j + 1, len(lines)):
                if lines[k].startswith(indent + "}") and not lines[k].startswith(indent + " "):
                    end = k
                    break
        if end is not None:
            found.append((m.group(2), i + 1, end - i + 1))
    return found


PUB_FN = re.compile(r"\bpub\s+(?:const\s+)?(?:unsafe\s+)?fn\s+(\w+)\s*(?:<[^(]*?>)?\s*\(([^)]*(?:\([^)]*\)[^)]*)*)\)", re.S)


def bool_params(path):
    """(name, line) of every `pub fn` in a file with a parameter typed `bool`."""
    text = path.read_text()
    return [
        (m.group(1), text[: m.start()].count("\n") + 1)
        for m in PUB_FN.finditer(text)
        if re.search(r":\s*bool\b", m.group(2))
    ]


def module_of(src, path):
    """The module path of a source file under src/, e.g. fused/mod.rs -> fused, a/b.rs -> a::b."""
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return "::".join(parts) or "crate"


def import_graph(src):
    """Edges between a crate's top-level modules (children fold into their parent)."""
    files = {p: module_of(src, p) for p in rust_files(src)}
    top = lambda m: m.split("::")[0]
    modules = {top(m) for m in files.values()}
    edges = {m: set() for m in modules}
    for path, module in files.items():
        text = re.sub(r"//.*", "", path.read_text())
        names = set(re.findall(r"crate::(\w+)", text))
        if "::" not in module and module != "crate":
            names |= set(re.findall(r"super::(\w+)", text)) if path.name != "mod.rs" else set()
        if module == "crate":
            continue  # the root declares everything; it is not a module that imports
        for name in names:
            if name in modules and name != top(module):
                edges[top(module)].add(name)
    return edges


def circles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=80, help="list functions longer than this many lines")
    parser.add_argument("--files", type=int, default=10, help="how many of the largest files to list")
    args = parser.parse_args()

    print("## Lines per crate (src / tests and benches)")
    all_files, long_fns, all_circles, bools = [], [], [], []
    for name, directory in crates():
        src = directory / "src"
        in_src = sum(len(p.read_text().splitlines()) for p in rust_files(src))
        other = sum(len(p.read_text().splitlines()) for p in rust_files(directory) if src not in p.parents)
        print(f"{name:16} {in_src:6} / {other:6}")
        for p in rust_files(directory):
            all_files.append((len(p.read_text().splitlines()), p.relative_to(ROOT)))
            long_fns += [(n, p.relative_to(ROOT), f, line) for f, line, n in functions(p) if n > args.limit and src in p.parents]
            bools += [(p.relative_to(ROOT), line, f) for f, line in bool_params(p)]
        all_circles += [(name, c) for c in circles(import_graph(src))]

    print(f"\n## The {args.files} largest files")
    for n, p in sorted(all_files, reverse=True)[: args.files]:
        print(f"{n:6} {p}")
    print(f"\n## Library and binary functions over {args.limit} lines")
    for n, p, f, line in sorted(long_fns, reverse=True):
        print(f"{n:6} {p}:{line} {f}")
    print("\n## Public functions that take a bare bool")
    for p, line, f in bools:
        print(f"{p}:{line} {f}")
    if not bools:
        print("none")
    print("\n## Import circles between a crate's modules")
    for name, c in all_circles:
        print(f"{name}: {' <-> '.join(c)}")
    if not all_circles:
        print("none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
