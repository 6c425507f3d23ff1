"""A model factory that raises: the commands show the exception's type, its message and
where it was raised (file:line), not only its message."""

from __future__ import annotations

import sys
import textwrap

import pytest

from recomp.cli.config import BenchConfig, FactoryError, call_factory

FACTORY = textwrap.dedent(
    """\
    def helper(hidden):
        raise RuntimeError(f"no model of width {hidden}")


    def build(layers=2, hidden=16):
        return helper(hidden)
    """
)


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "broken_factory_mod.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "broken_factory_mod.py"
    sys.modules.pop("broken_factory_mod", None)


def test_a_raising_factory_names_type_message_and_place(factory_module):
    import broken_factory_mod

    with pytest.raises(FactoryError) as info:
        call_factory(broken_factory_mod.build, BenchConfig(layers=3, hidden=32))
    message = str(info.value)
    assert "\n" not in message
    assert "model factory broken_factory_mod:build raised RuntimeError" in message
    assert f"at {factory_module}:2 in helper" in message  # where it was raised
    assert f"(from {factory_module}:6 in build)" in message  # the factory's own line
    assert "no model of width 32" in message and "layers=3, hidden=32" in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_recomp_report_prints_it(factory_module, capsys):
    pytest.importorskip("torch")
    from recomp.cli.report import main

    assert main(["--model", "broken_factory_mod:build", "--layers", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("recomp report: model factory broken_factory_mod:build raised RuntimeError at ")
    assert f"{factory_module}:2 in helper" in err and "no model of width" in err
