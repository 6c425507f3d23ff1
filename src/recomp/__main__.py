"""``python -m recomp`` / the ``recomp`` console script.

Sub-commands are imported lazily, so ``import recomp`` stays free of framework imports.
"""

from __future__ import annotations

import sys

USAGE = """usage: recomp <command> [options]

commands:
  bench    measure activation memory, replayed FLOPs and step time of checkpointing
           strategies side by side (`recomp bench --help`)
  report   show what one forward holds for backward, by layer, region and op, and
           why (`recomp report --help`)
  plan     choose per layer what to checkpoint and exclude so that a memory budget is
           met at the least step time, then run the plan (`recomp plan --help`)
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    command, rest = args[0], args[1:]
    if command == "bench":
        from recomp.bench.cli import main as bench_main

        return bench_main(rest)
    if command == "plan":
        from recomp.bench.plan_cli import main as plan_main

        return plan_main(rest)
    if command == "report":
        from recomp.bench.memory_cli import main as report_main

        return report_main(rest)
    print(f"recomp: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
