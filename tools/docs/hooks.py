"""MkDocs hooks for the documentation site.

``<!-- cli-help: bench -->`` in a page becomes the help of ``recomp bench`` as its
argparse parser prints it, so the reference of the command-line options is generated
from the parsers and cannot drift from them. The parsers import no framework.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

COMMANDS = ("bench", "plan", "simulate", "report")
MARKER = re.compile(r"<!-- cli-help: (\w+) -->")


def cli_help(command: str) -> str:
    """What ``recomp COMMAND --help`` prints, at a fixed width."""
    if command not in COMMANDS:
        raise ValueError(f"no recomp command {command!r}; known: {', '.join(COMMANDS)}")
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "92"
    try:
        module = importlib.import_module(f"recomp.cli.{command}")
        return module.build_parser().format_help().rstrip()
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return MARKER.sub(lambda m: f"```text\n{cli_help(m.group(1))}\n```", markdown)
