"""Rewrite every generated block of README.md and docs/*.md from a real run (``make docs``).

``python tests/docs/regenerate.py [--force] [SESSION...]`` runs the named sessions (default:
all), writes the blocks whose output changed by more than what varies between runs (times,
stamps, sizes; ``--force``: every block, as this run printed it) and lists the commands that did
not run as their page says (exit 1 then; those blocks are left as they were).
"""

from __future__ import annotations

import sys
import time

import doccheck


def main(arguments: list[str]) -> int:
    force = "--force" in arguments
    names = [name for name in arguments if name != "--force"]
    started = time.monotonic()
    known = doccheck.sessions()
    unknown = sorted(set(names) - set(known))
    if unknown:
        print(f"Error: no session named {', '.join(unknown)} (sessions: {', '.join(known)})")
        return 3
    runs = doccheck.run_all(names or None)
    problems = [
        problem
        for name in runs
        for block in known[name]
        for problem in doccheck.failures(block, runs[name])
    ]
    changed = [
        str(path.relative_to(doccheck.REPO))
        for path in doccheck.DOCS
        if doccheck.rewrite(path, runs, force)
    ]
    print(
        f"{len(runs)} sessions run in {time.monotonic() - started:.0f} s; rewritten: "
        f"{', '.join(changed) or 'nothing'}"
    )
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
