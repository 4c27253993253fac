"""Fuzz sdcreplay with hash-valid semantic bundle mutations (and raw byte damage); count the bugs.

Each mutation is applied to a fresh copy of a small recorded bundle, every
SHA-256 recomputed (for semantic ones), then ``info`` and ``diff`` run through
the CLI in this process and the bundle is replayed with the library. A bug is
a traceback, a catch-all "unexpected ..." message or a hang (no answer in 60 s);
the goal is 0 of each. Run from the repository root:

    PYTHONPATH=.:tests python bench/fuzz_bundles.py --mutations 2000 --raw 200
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import bundle_fuzz  # noqa: E402
import torch  # noqa: E402
from conftest import SMALL  # noqa: E402

from sdcreplay import record  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutations", type=int, default=2000, help="hash-valid semantic mutations")
    parser.add_argument(
        "--raw", type=int, default=200, help="raw byte mutations (hashes not fixed)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=20, help="bugs to print in full")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="sdcreplay-fuzz-"))
    original = work / "original.bundle"
    record("builtin:tiny-llama", original, steps=2, seed=0, kwargs=dict(SMALL))
    baseline = bundle_fuzz.original_verdict(original)
    rng = random.Random(args.seed)
    plan = [
        ("semantic", name) for name in rng.choices(sorted(bundle_fuzz.SEMANTIC), k=args.mutations)
    ]
    plan += [("raw", "raw_bytes")] * args.raw
    counts: collections.Counter = collections.Counter()
    per_mutation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    bugs = []
    started = time.time()
    for number, (family, name) in enumerate(plan):
        copy = work / f"m{number}.bundle"
        shutil.copytree(original, copy)
        mutate = bundle_fuzz.raw_bytes if family == "raw" else bundle_fuzz.SEMANTIC[name]
        try:
            what = mutate(copy, random.Random(rng.random()))
        except (RecursionError, ValueError, TypeError, KeyError, IndexError, OSError):
            counts["mutation not applicable"] += (
                1  # e.g. a 978-deep value json.dumps refuses to write
            )
            shutil.rmtree(copy)
            continue
        outcome = bundle_fuzz.judge(copy, original)
        kind = outcome.kind
        if name in bundle_fuzz.INERT and kind == "verdict" and outcome.detail != baseline:
            kind = "changed verdict"
        counts[f"{family} {kind}"] += 1
        per_mutation[name][kind] += 1
        if outcome.is_bug or kind == "changed verdict":
            bugs.append((what, kind, outcome.detail))
            if len(bugs) <= args.show:
                print(f"BUG {kind}: {what}: {outcome.detail}", file=sys.stderr, flush=True)
        shutil.rmtree(copy)
        for extra in work.glob("outside-*"):
            extra.unlink()
        if number % 100 == 99:
            print(
                f"{number + 1}/{len(plan)} in {time.time() - started:.0f} s: {dict(counts)}",
                file=sys.stderr,
            )
    summary = {
        "mutations": {"semantic": args.mutations, "raw": args.raw},
        "seed": args.seed,
        "seconds": round(time.time() - started),
        "baseline": baseline,
        "outcomes": dict(sorted(counts.items())),
        "per_mutation": {name: dict(c) for name, c in sorted(per_mutation.items())},
        "tracebacks": sum(1 for _, kind, _ in bugs if kind == "traceback"),
        "catch_all": sum(1 for _, kind, _ in bugs if kind == "catch_all"),
        "hangs": sum(1 for _, kind, _ in bugs if kind == "hang"),
        "changed_verdicts_of_inert_edits": sum(
            1 for _, kind, _ in bugs if kind == "changed verdict"
        ),
    }
    print(json.dumps(summary, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
