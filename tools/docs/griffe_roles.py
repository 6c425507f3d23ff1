"""A griffe extension for the documentation site: recomp's docstrings name other objects
with Sphinx roles (:func:`checkpoint`, :class:`recomp.errors.RecompError`). This turns
each into a cross-reference that mkdocstrings resolves to the object's entry in the
reference (a public name of recomp, recomp.torch, recomp.mindspore, recomp.plan or their
public sub-modules), or
into plain code for anything the reference does not show (a private helper, an object
of another library). A role naming a ``recomp`` object that does not exist is logged
as a warning, which ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import griffe

LOG = logging.getLogger("mkdocs.plugins.recomp_roles")

# The modules whose public names (their __all__) the reference renders.
PUBLIC_MODULES = (
    "recomp",
    "recomp.errors",
    "recomp.torch",
    "recomp.torch.collectives",
    "recomp.torch.megatron",
    "recomp.torch.deepspeed",
    "recomp.mindspore",
    "recomp.mindspore.collectives",
    "recomp.plan",
    "recomp.plan.solver",
    "recomp.torch.report",
    "recomp.mindspore.report",
    # Last: names both a framework package and these have link to the package's entry.
    "recomp.torch.hyperparallel",
    "recomp.mindspore.hyperparallel",
)

# reST's "text::" before an indented literal block: Markdown reads the indented block as
# code already, so the text keeps one colon.
LITERAL_INTRO = re.compile(r"(?<=\S)::(?=\n\n)")
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|exc|data|obj|const):`~?([^`]+)`")


def _lookup(pkg: griffe.Module, path: str) -> griffe.Object | griffe.Alias | None:
    if not path.startswith("recomp"):
        return None
    try:
        return pkg.modules_collection[path]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _canonical(obj: Any) -> str | None:
    try:
        return obj.canonical_path if isinstance(obj, griffe.Alias) else obj.path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in recomp's docstrings once the package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "recomp":
            return
        # Canonical path of each rendered object -> the public path it is rendered under.
        public: dict[str, str] = {}
        for name in PUBLIC_MODULES:
            module = _lookup(pkg, name)
            if module is None:
                continue
            public.setdefault(_canonical(module) or name, name)
            for member_name in getattr(module, "exports", None) or []:
                member = module.get_member(member_name) if member_name in module.members else None
                canonical = _canonical(member) if member is not None else None
                if canonical:
                    public.setdefault(canonical, f"{name}.{member_name}")
                    target = member.final_target if isinstance(member, griffe.Alias) else member
                    for sub_name, sub in getattr(target, "members", {}).items():
                        if not sub_name.startswith("_"):
                            public.setdefault(f"{canonical}.{sub_name}", f"{name}.{member_name}.{sub_name}")
                            _ = sub
        self._public = public
        self._pkg = pkg
        self._walk(pkg)

    def _walk(self, obj: griffe.Object) -> None:
        if obj.docstring is not None:
            value = ROLE.sub(lambda m: self._link(obj, m.group(1)), obj.docstring.value)
            obj.docstring.value = LITERAL_INTRO.sub(":", value)
        for member in obj.members.values():
            if not isinstance(member, griffe.Alias) and member.parent is obj:
                self._walk(member)

    def _link(self, obj: griffe.Object, target: str) -> str:
        target = target.rstrip("()")
        text = target.rsplit(".", 1)[-1] if not target.startswith("recomp") else target
        scopes = [s for s in (obj, obj.parent, obj.module, obj.module.parent) if s is not None]
        candidates = [target] + [f"{scope.path}.{target}" for scope in scopes]
        for path in candidates:
            found = _lookup(self._pkg, path)
            if found is None:
                continue
            canonical = _canonical(found)
            if canonical in self._public:
                return f"[`{text}`][{self._public[canonical]}]"
            return f"`{text}`"
        if target.startswith("recomp"):
            LOG.warning("%s: the docstring names %s, which does not exist", obj.path, target)
        return f"`{text}`"
