"""``python -m recomp`` / the ``recomp`` console script.

Sub-commands are imported lazily, so ``import recomp`` stays free of framework imports.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = """usage: recomp <command> [options]

commands:
  bench    measure activation memory, replayed FLOPs and step time of checkpointing
           strategies side by side (`recomp bench --help`)
  report   show what one forward holds for backward, by layer, region and op, and
           why (`recomp report --help`)
  plan     choose per layer what to checkpoint and exclude so that a memory budget is
           met at the least step time, then run the plan (`recomp plan --help`)
  simulate will a published model fit? Memory per device and step overhead per
           strategy and pipeline rank, on fake tensors: no GPU (`recomp simulate --help`)
"""


def command_main(command: str) -> Callable[[list[str]], int] | None:
    """The ``main`` of ``command`` (imported now), or None for an unknown command."""
    if command == "bench":
        from recomp.cli.bench import main as bench_main

        return bench_main
    if command == "plan":
        from recomp.cli.plan import main as plan_main

        return plan_main
    if command == "report":
        from recomp.cli.report import main as report_main

        return report_main
    if command == "simulate":
        from recomp.cli.simulate import main as simulate_main

        return simulate_main
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    command, rest = args[0], args[1:]
    run = command_main(command)
    if run is None:
        print(f"recomp: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    try:
        return run(rest)
    except KeyboardInterrupt:
        # The command has stopped its child processes and removed its files on the way.
        print(f"recomp {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
