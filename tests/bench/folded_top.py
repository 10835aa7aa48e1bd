"""Reads folded stacks (`quince bench --host-profile`) and prints where the samples are.

    python3 tests/bench/folded_top.py FILE [--thread NAME] [--top N]

Prints the functions with the most samples on top of the stack (self) and anywhere in it
(inclusive), as shares of the thread's samples. Names are shortened: argument lists and
template arguments dropped.
"""

import argparse
import collections
import re


def short(name: str) -> str:
    # Drop template arguments and parameter lists, innermost first.
    prev = None
    while prev != name:
        prev = name
        name = re.sub(r"<[^<>]*>", "", name)
        name = re.sub(r"\([^()]*\)", "", name)
    return name.strip()[:110]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--thread", default=None, help="only stacks of this thread name")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    own = collections.Counter()
    incl = collections.Counter()
    threads = collections.Counter()
    total = 0
    for line in open(a.file):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        threads[frames[0]] += n
        if a.thread and frames[0] != a.thread:
            continue
        total += n
        names = [short(f) for f in frames[1:]]
        if names:
            own[names[-1]] += n
        for f in set(names):
            incl[f] += n
    print("threads:", ", ".join(f"{t} {n}" for t, n in threads.most_common()))
    print(f"samples: {total}")
    for title, counter in (("self", own), ("inclusive", incl)):
        print(f"\n== {title}")
        for f, n in counter.most_common(a.top):
            print(f"{100 * n / max(total, 1):6.1f}%  {n:6d}  {f}")


if __name__ == "__main__":
    main()
