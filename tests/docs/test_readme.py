"""The README's framework examples run as written and print what they say."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

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
