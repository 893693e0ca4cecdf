"""Summarizes a `py-spy record --threads -f raw` file: samples per thread, then per
function (inclusive and self %) within the frames named on the command line (the first
stack frame whose function matches starts the count), so the device returns a page of
text instead of megabytes of stacks.

    python benchmarks/scripts/spy_aggregate.py spy.txt "Runtime.step" "_process_outputs" [--top 50]
"""
import collections, re, sys

path, *roots = [a for a in sys.argv[1:] if not a.startswith("--")]
top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 50
roots = [r for r in roots if not r.isdigit()]
threads = collections.Counter()
inclusive = {root: collections.Counter() for root in roots}
own = {root: collections.Counter() for root in roots}
lines = {root: collections.Counter() for root in roots}
totals = collections.Counter()
for line in open(path):
    stack, _, count = line.rstrip("\n").rpartition(" ")
    if not count.isdigit():
        continue
    count, frames = int(count), stack.split(";")
    threads[frames[0]] += count
    for root in roots:
        start = next((i for i, f in enumerate(frames) if f.split(" (")[0].endswith(root)), None)
        if start is None:
            continue
        totals[root] += count
        names = [re.sub(r":\d+\)$", ")", f) for f in frames[start:]]
        for name in set(names):
            inclusive[root][name] += count
        own[root][names[-1]] += count
        lines[root][frames[-1]] += count
print("samples per thread:", ", ".join(f"{t} {n}" for t, n in threads.most_common(8)))
for root in roots:
    total = totals[root] or 1
    print(f"\n== within {root}: {totals[root]} samples; inclusive %, self %, function")
    for name, n in inclusive[root].most_common(top):
        print(f"{100 * n / total:6.1f} {100 * own[root][name] / total:6.1f}  {name}")
    print(f"-- hottest lines within {root}")
    for name, n in lines[root].most_common(25):
        print(f"{100 * n / total:6.1f}  {name}")
