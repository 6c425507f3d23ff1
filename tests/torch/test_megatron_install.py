"""``recomp.torch.megatron`` where Megatron-Core cannot be imported: the module imports
nothing of it, and ``install()`` says what is missing; the copies of a trainer's function
that other modules imported by name are replaced too. (With Megatron-Core installed,
tests/trainers/test_megatron.py tests the installation itself.)"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import paths

BLOCK_MEGATRON = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] == 'megatron':\n"
    "            raise ImportError('blocked: ' + name)\n"
    "sys.meta_path.insert(0, Block())\n"
)


def test_without_megatron_install_says_what_is_missing():
    code = BLOCK_MEGATRON + (
        "import recomp.torch.megatron as m\n"
        "assert not [n for n in sys.modules if n.split('.')[0] == 'megatron']\n"
        "try:\n"
        "    m.install(exclude=['router'])\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('install() did not raise')\n"
    )
    path = os.pathsep.join(filter(None, [str(paths.SRC), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stderr
    assert "recomp.torch.megatron.install() needs Megatron-Core" in proc.stdout
    assert "pip install megatron-core" in proc.stdout


def test_replace_attributes_rebinds_copies_imported_by_name(monkeypatch):
    from recomp.torch._trainer_patch import replace_attributes

    def original():
        return "trainer"

    def replacement():
        return "recomp"

    trainer = types.ModuleType("a_trainer.checkpointing")
    trainer.checkpoint = original
    user = types.ModuleType("user_model_code")
    user.ckpt = original  # from a_trainer.checkpointing import checkpoint as ckpt
    user.unrelated = len
    for module in (trainer, user):
        monkeypatch.setitem(sys.modules, module.__name__, module)

    with replace_attributes("a_trainer", [(trainer.__name__, "checkpoint")], replacement):
        assert trainer.checkpoint is replacement
        assert user.ckpt is original  # not asked for
    with replace_attributes(
        "a_trainer", [(trainer.__name__, "checkpoint")], replacement, rebind_imports=True
    ):
        assert trainer.checkpoint is replacement
        assert user.ckpt is replacement
        assert user.unrelated is len
    assert trainer.checkpoint is original
    assert user.ckpt is original
