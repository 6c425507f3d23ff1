"""What a command needs installed, and what to install when it is missing (no framework
imports: whether a package is there is asked of the import system, which finds it
without running it).

A command checks what it needs before it builds anything (:func:`check`); a model
factory that imports a package that is not there fails later, in a child process or
in the model's code, and :func:`missing_in` reads the package's name from the error
(``No module named 'transformers'``). Either way the command prints one line naming
what to install (:func:`install_line`) and exits with :data:`EXIT_MISSING`.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterable

#: The exit code of a command that stops for a missing package (2 is a usage error).
EXIT_MISSING = 1

#: Per importable name: what it is, and the command that installs it (an extra of
#: recomp where one brings it: pyproject.toml).
INSTALLS: dict[str, tuple[str, str]] = {
    "torch": ("PyTorch", 'pip install "recomp[torch]"'),
    "mindspore": ("MindSpore", 'pip install "recomp[mindspore]"'),
    "torch_remat": ("torch-remat", 'pip install "recomp[bench]"'),
    "matplotlib": ("matplotlib", 'pip install "recomp[bench]"'),
    "transformers": ("Hugging Face transformers", "pip install transformers"),
}

# What Python says of a module it cannot import: not found, or blocked (None in
# sys.modules, as an environment that hides a package leaves it).
_NO_MODULE = re.compile(r"No module named '([A-Za-z0-9_]+)|import of ([A-Za-z0-9_]+) halted")


def installed(module: str) -> bool:
    """Whether ``module`` (a top-level name) can be imported here."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing(modules: Iterable[str]) -> list[str]:
    """The entries of ``modules`` that cannot be imported here, in order."""
    return [m for m in modules if not installed(m)]


def install_line(prog: str, module: str, what: str = "") -> str:
    """``recomp bench needs PyTorch: pip install "recomp[torch]"`` (``what``: for what, when
    not the whole command)."""
    name, command = INSTALLS.get(module, (module, f"pip install {module}"))
    needs = f"{what} needs" if what else "needs"
    return f"{prog}: {needs} {name}, which is not installed: {command}"


def check(prog: str, modules: Iterable[str], what: str = "") -> bool:
    """True if every module in ``modules`` is installed; else print the line for the first
    one that is not (on stderr) and return False."""
    absent = missing(modules)
    if absent:
        print(install_line(prog, absent[0], what), file=sys.stderr)
    return not absent


def missing_in(error: str) -> str | None:
    """The package an error says is not there (``No module named 'transformers'``), if it
    is one that :data:`INSTALLS` knows; None otherwise (a module of the user's own is the
    user's to find)."""
    found = _NO_MODULE.search(error)
    if found is None:
        return None
    top = (found.group(1) or found.group(2)).split(".")[0]
    return top if top in INSTALLS else None
