"""The code blocks of the README and of the documentation site run as written.

The README's two framework examples print what they say; every other Python block under
``docs/`` and in the README runs (see ``tests/support/doc_blocks.py`` for the markers a
block may carry: a setup, a continuation, a required module, or the test that runs it
instead); the ``recomp`` command lines of the ``bash`` blocks parse.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pathlib
import re
import shlex
import sys
import warnings

import pytest

import doc_blocks
import paths

README = paths.README


def examples() -> dict[str, str]:
    text = README.read_text()
    found = {}
    for heading in ("## PyTorch", "## MindSpore (PyNative)"):
        section = text.split(heading, 1)[1]
        found[heading] = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return found


@pytest.mark.parametrize("heading", ["## PyTorch", "## MindSpore (PyNative)"])
def test_readme_example_runs(heading):
    pytest.importorskip("mindspore" if "MindSpore" in heading else "torch")
    code = examples()[heading]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README {heading}", "exec"), {"__name__": "readme_example"})
    assert out.getvalue().split() == ["1", "1"]


# The README's two examples run above, where their output is checked too.
PYTHON_BLOCKS = [
    b for b in doc_blocks.all_blocks("python")
    if not (b.page == README and b.code + "\n" in examples().values())
]


def _requires(block: doc_blocks.Block) -> list[str]:
    needed = [m for m in block.options.get("requires", "").split(",") if m]
    # What a block imports at its top is needed too (a PyTorch-only environment skips
    # the MindSpore blocks).
    for m in re.finditer(r"^(?:import|from) (mindspore|mindcv|torch|torchvision|transformers|peft)\b", block.code, re.M):
        needed.append(m.group(1))
    if re.search(r"\b(simulate|SimulatedModel|will_it_fit)\(", block.code):
        needed.append("simulation")  # the planner's simulation: PyTorch 2.13 or newer
    setup = block.options.get("setup")
    needed += {"llama": ["torch", "transformers"], "ms_net": ["mindspore"], "resnet": ["torchvision"]}.get(
        setup or "", ["torch"] if setup else []
    )
    return needed


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_code_block_runs(
    block: doc_blocks.Block, request: pytest.FixtureRequest, tmp_path, monkeypatch
) -> None:
    if "skip" in block.options:
        runner = block.options["skip"]
        assert (paths.ROOT / runner).exists(), (
            f"{block.id}: the block says {runner} runs it, and there is no such file"
        )
        pytest.skip(f"run by {runner}")
    for module in _requires(block):
        if module == "simulation":
            pytest.importorskip("torch")
            from recomp.torch import _compat

            if _compat.simulation_unsupported():
                pytest.skip(_compat.simulation_unsupported())
        elif module == "cuda":
            torch = pytest.importorskip("torch")
            if not torch.cuda.is_available():
                pytest.skip("needs a GPU")
        else:
            pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)  # what a block writes (plan.json) stays out of the tree
    cache = request.config.stash.setdefault(_NAMESPACES, {})
    if "continue" in block.options:
        previous = cache.get(block.page)
        if previous is None:
            pytest.skip("the block it continues did not run")
        names = previous
    elif "setup" in block.options:
        names = doc_blocks.SETUPS[block.options["setup"]]()
    else:
        names = {}
    names.setdefault("__name__", "docs_example")
    cache[block.page] = None
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        # The docs use the new places of moved names (NOTE [ Moved names ]).
        warnings.filterwarnings("error", r"recomp\..* moved to recomp\.", DeprecationWarning)
        exec(compile(block.code, block.id, "exec"), names)
    cache[block.page] = names


_NAMESPACES = pytest.StashKey[dict]()

RECOMP_COMMAND = re.compile(
    r"^(?:\S+=\S+\s+)*(?:\S*python\S*\s+-m\s+)?recomp\s+(bench|plan|report|simulate)\b(.*)$"
)


def command_lines() -> list[tuple[str, str, str]]:
    found = []
    # bash blocks, and the "$ recomp ..." line above a command's output in text blocks
    for block in doc_blocks.all_blocks("bash") + doc_blocks.all_blocks("text"):
        text = re.sub(r"\\\n\s*", " ", block.code)
        for line in text.split("\n"):
            if block.lang == "text" and not line.startswith("$ "):
                continue
            m = RECOMP_COMMAND.match(line.removeprefix("$ ").strip())
            if m:
                args = m.group(2).split(" #", 1)[0]
                found.append((block.id, m.group(1), args))
    return found


@pytest.mark.parametrize(("where", "command", "args"), command_lines(), ids=lambda v: str(v)[:40])
def test_command_line_parses(
    where: str, command: str, args: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module(f"recomp.cli.{command}")
    argv = shlex.split(args)
    # ``--model`` is checked as the command line is read (the module must import): the
    # docs' example package ``mypkg.models`` exists for the test, with the factories the
    # docs name, in the directory the command runs in.
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text("def build():\n    pass\n\n\ntiny_llama = build\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mypkg", raising=False)
    monkeypatch.delitem(sys.modules, "mypkg.models", raising=False)
    parser = module.build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as exit:
        assert exit.code == 0, f"{where}: `recomp {command}{args}` does not parse"
