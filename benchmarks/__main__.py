"""``python -m benchmarks <suite> [args]``: run one benchmark suite or GPU check; ``--list`` (or no suite) lists
them with the question each answers. The suite's own ``--help`` gives its arguments."""

from __future__ import annotations

import runpy
import sys

from benchmarks import SUITES


def listing() -> str:
    width = max(map(len, SUITES))
    lines = ["usage: python -m benchmarks <suite> [suite arguments]   (python -m benchmarks <suite> --help)", ""]
    lines += [f"  {name:<{width}}  {suite.question}" for name, suite in SUITES.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("--list", "-l", "--help", "-h", "list"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUITES:
        print(f"python -m benchmarks: unknown suite {name!r}; choose one of: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    suite = SUITES[name]
    sys.argv = [f"benchmarks/{suite.module}.py", *suite.args, *rest]
    runpy.run_module(f"benchmarks.{suite.module}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
