"""The argument parser of every command (no framework imports).

:class:`CommandParser` is ``argparse.ArgumentParser`` with three changes:

* option names are matched exactly: ``--comp`` is not taken for ``--compile``, so a
  shortened option never changes meaning when a later version adds one that shares its
  start;
* an option the command does not have is named as such, with the options it is closest
  to, or with the command that has it (``recomp bench --budget``: an option of
  ``recomp plan``);
* an error is one line, ``recomp bench: ...``, with the pointer to ``--help`` below it,
  instead of the usage text above it; the exit code stays 2.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

#: The commands and the modules that hold them (``build_parser`` and ``main`` each).
COMMANDS = {
    "bench": "recomp.cli.bench",
    "plan": "recomp.cli.plan",
    "report": "recomp.cli.report",
    "simulate": "recomp.cli.simulate",
}


def close_matches(word: str, known: Sequence[str], n: int = 3) -> list[str]:
    """The entries of ``known`` that ``word`` looks like a misspelling of."""
    return difflib.get_close_matches(word, list(known), n=n, cutoff=0.6)


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """`` (did you mean X?)``, or ``""`` when nothing in ``known`` is close to ``word``."""
    matches = close_matches(word, known)
    if not matches:
        return ""
    return f" (did you mean {' or '.join(matches)}?)"


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` for a recomp command: exact option names, unknown
    options named with their closest matches, one-line errors (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.option_names: list[str] = []
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.option_names.extend(action.option_strings)
        return action

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        given = list(sys.argv[1:] if args is None else args)
        # An unknown option is named before anything else is judged: a misspelt
        # --budget would otherwise read as a missing --budget.
        unknown = [a for a in _long_options(given) if a.split("=", 1)[0] not in self.option_names]
        if unknown:
            self.error(self.unrecognized(unknown))
        parsed, extra = self.parse_known_args(given, namespace)
        if extra:
            self.error(self.unrecognized(extra))
        return parsed

    def unrecognized(self, extra: list[str]) -> str:
        """What to say about the arguments the parser did not take: the first unknown
        option, with its closest matches (this command's, or another's, saying whose),
        or else the first stray value."""
        options = [a for a in extra if a.startswith("-") and len(a) > 1]
        if not options:
            return (
                f"unexpected argument {extra[0]!r}: {self.prog} takes options only "
                "(--name value)"
            )
        name = options[0].split("=", 1)[0]
        others = other_commands(self.prog)
        owners = [prog for prog, names in others if name in names]
        if owners:
            return f"unknown option {name}: it is an option of {' and '.join(owners)}"
        own = close_matches(name, [o for o in self.option_names if o.startswith("--")])
        best = _likeness(name, own[0]) if own else 0.0
        own = [o for o in own if _likeness(name, o) >= best - 0.1]  # the close ones only
        # Another command's option only where it is closer than any of this one's.
        theirs: dict[str, str] = {}
        for prog, names in others:
            for option in names:
                if (
                    option not in self.option_names
                    and option not in theirs
                    and _likeness(name, option) > max(best, 0.6)
                ):
                    theirs[option] = prog
        closest = sorted(theirs, key=lambda o: -_likeness(name, o))[:1]
        hints = [f"{o} (an option of {theirs[o]})" for o in closest] + own
        hints = hints[:3]
        hint = f" (did you mean {' or '.join(hints)}?)" if hints else ""
        return f"unknown option {name}{hint}"

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n(`{self.prog} --help` lists every option)\n")


def _likeness(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _long_options(args: list[str]) -> list[str]:
    """The ``--name`` arguments of a command line, up to a ``--`` that ends options."""
    found = []
    for arg in args:
        if arg == "--":
            break
        if arg.startswith("--"):
            found.append(arg)
    return found


def other_commands(prog: str) -> list[tuple[str, list[str]]]:
    """The other commands and their options."""
    found = []
    for module_name in COMMANDS.values():
        parser = importlib.import_module(module_name).build_parser()
        if parser.prog != prog and isinstance(parser, CommandParser):
            found.append((parser.prog, parser.option_names))
    return found


def print_error(prog: str, message: str) -> None:
    """A command's one-line error on stderr: ``recomp bench: message``."""
    print(f"{prog}: {message}", file=sys.stderr)
