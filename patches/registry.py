"""A registry of import-time patches: replace `module.attribute` with our object, everywhere it was bound.

Replacing an attribute in its defining module is not enough when other modules already did
`from module import name`: they hold the original. `apply()` therefore also rebinds every attribute of an
already-imported module (under the given prefixes) that *is* the original object. Only classes, functions
and modules are rebound this way; plain values (flags such as `HAVE_TE = False`) are patched only where they
are registered, since an identity match on `False` or `None` would hit unrelated names. Modules imported after
`apply()` import the replacement from the patched module. `revert()` restores every binding it changed.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Patch", "PatchRegistry", "PatchError", "SUPPORTED_MEGATRON_CORE", "installed_megatron_core",
           "has_module", "megatron_versions", "resolve", "supported_release"]

_MISSING = object()
# The megatron-core release lines the patches support (each is tested, see README's support table); what differs
# between them is detected from the installed Megatron (mindspeed_te/megatron/compat.py), not from this table.
SUPPORTED_MEGATRON_CORE = ("0.12", "0.13", "0.14", "0.15", "0.16", "0.17", "0.18", "0.19")
# target -> the registry whose applied patch holds it (one owner per target in the process)
_APPLIED: dict[str, PatchRegistry] = {}


def installed_megatron_core() -> str:
    """The version of the megatron.core that imports here (a Megatron-LM checkout on sys.path included),
    else of the installed package, else "not installed"."""
    try:
        return importlib.import_module("megatron.core.package_info").__version__
    except ImportError:
        pass
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def supported_release(version: str) -> bool:
    """Whether `version` ("0.15.3", "0.18.0rc0") belongs to a supported release line."""
    return ".".join(version.split(".")[:2]) in SUPPORTED_MEGATRON_CORE


def megatron_versions() -> str:
    """"installed megatron-core X, supported 0.12-0.19": every patch error carries it, since a missing target
    usually means another Megatron version."""
    return (f"installed megatron-core {installed_megatron_core()}, supported "
            f"{SUPPORTED_MEGATRON_CORE[0]}-{SUPPORTED_MEGATRON_CORE[-1]}")


class PatchError(RuntimeError):
    """A patch target that cannot be resolved, is registered twice, or is already patched by another
    registry. The message names the target and the installed and supported megatron-core versions."""


@dataclass
class Patch:
    target: str  # "package.module.attribute" or "package.module.Class.attribute"
    replacement: Any
    create: bool = False  # the attribute may be absent (added by the patch)
    original: Any = _MISSING
    rebound: list[tuple[Any, str]] = field(default_factory=list)  # (module or class, attribute) changed

    @property
    def module_name(self) -> str:
        return self.target.rpartition(".")[0]

    @property
    def attribute(self) -> str:
        return self.target.rpartition(".")[2]


_SHARED_VALUES = (bool, int, float, complex, str, bytes, tuple, frozenset, type(None))


def _owner(path: str) -> Any:
    """The module, or a class inside one, that `path` names: "pkg.mod" or "pkg.mod.Class"."""
    try:
        return importlib.import_module(path)
    except ImportError:
        parent, _, name = path.rpartition(".")
        if not parent:
            raise
        owner = _owner(parent)
        if not hasattr(owner, name):
            raise
        return getattr(owner, name)


def has_module(name: str) -> bool:
    """Whether module `name` can be found here (its parent packages included): which of Megatron's modules the
    installed release has."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def resolve(target: str) -> Any:
    """The object `target` ("package.module.attribute" or "package.module.Class.attribute") names, read while
    the patches are being built; a PatchError naming the target and the megatron-core versions when its module
    does not import or lacks the attribute."""
    module_name, _, attribute = target.rpartition(".")
    try:
        owner = _owner(module_name)
    except ImportError as error:
        raise PatchError(f"cannot build the patch of {target!r}: module {module_name!r} does not import "
                         f"({error}; {megatron_versions()})") from error
    try:
        return getattr(owner, attribute)
    except AttributeError as error:
        raise PatchError(f"cannot build the patch of {target!r}: {module_name!r} has no attribute {attribute!r} "
                         f"({megatron_versions()})") from error


def _rebindable(obj: Any) -> bool:
    """Whether identity identifies `obj` well enough to follow its bindings across modules: not for plain
    values, which the interpreter shares between unrelated names (True, None, small ints, strings)."""
    return type(obj) not in _SHARED_VALUES  # exact types: a MagicMock(spec=str) passes isinstance(str)


class PatchRegistry:
    """register(target, replacement) any number of times, then apply() once; revert() undoes it."""

    def __init__(self, rebind_prefixes: tuple[str, ...] = ("megatron",)) -> None:
        self.rebind_prefixes = rebind_prefixes
        self._patches: dict[str, Patch] = {}
        self._modules: set[str] = set()  # targets that are whole modules (register_module)
        self.applied = False

    def register(self, target: str, replacement: Any, *, create: bool = False, force: bool = False) -> None:
        """Replace `target` ("package.module.attribute", or an attribute of a class in a module) with
        `replacement` at apply(). A second
        registration of the same target is an error unless `force` (the later one wins)."""
        if self.applied:
            raise PatchError(f"cannot register {target!r}: the patches are already applied ({megatron_versions()})")
        if target.count(".") < 1:
            raise PatchError(f"patch target {target!r} must be 'module.attribute' ({megatron_versions()})")
        if target in self._patches and not force:
            raise PatchError(f"{target!r} is already patched; pass force=True to replace that patch "
                             f"({megatron_versions()})")
        self._patches[target] = Patch(target, replacement, create)

    def register_module(self, name: str, module: types.ModuleType) -> None:
        """Make `module` importable as `name` at apply() (in sys.modules and on its parent package), for a module
        the installed release has but cannot import here; revert() removes it again."""
        self.register(name, module, create=True)
        self._modules.add(name)

    @property
    def patches(self) -> list[Patch]:
        return list(self._patches.values())

    def apply(self) -> None:
        """Import each target module, swap the attribute and rebind the importers. All targets are resolved
        before anything changes, so a bad target leaves every module untouched."""
        if self.applied:
            return
        resolved = []
        for patch in self._patches.values():
            try:
                module = _owner(patch.module_name)
            except ImportError as error:
                raise PatchError(f"cannot patch {patch.target!r}: module {patch.module_name!r} does not import "
                                 f"({error}; {megatron_versions()})") from error
            original = getattr(module, patch.attribute, _MISSING)
            if original is _MISSING and not patch.create:
                raise PatchError(f"cannot patch {patch.target!r}: {patch.module_name!r} has no attribute "
                                 f"{patch.attribute!r} ({megatron_versions()})")
            owner = _APPLIED.get(patch.target)
            if owner is not None and owner is not self and owner.applied \
                    and original is owner._patches[patch.target].replacement:
                raise PatchError(f"cannot patch {patch.target!r}: another patch registry has already patched it (e.g. "
                                 "`import mindspeed_te.megatron_adaptor` did); revert that one first or use it "
                                 f"({megatron_versions()})")
            resolved.append((patch, module, original))
        for patch, module, original in resolved:
            patch.original = original
            setattr(module, patch.attribute, patch.replacement)
            if patch.target in self._modules:
                sys.modules[patch.target] = patch.replacement
            patch.rebound = [(module, patch.attribute)]
            if original is not _MISSING and _rebindable(original):
                patch.rebound += self._rebind(original, patch.replacement, skip=module)
            _APPLIED[patch.target] = self
        self.applied = True

    def _rebind(self, original: Any, replacement: Any, skip: Any) -> list[tuple[types.ModuleType, str]]:
        changed = []
        for name, module in list(sys.modules.items()):
            if module is None or module is skip or not name.startswith(self.rebind_prefixes):
                continue
            for attribute, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attribute, replacement)
                    changed.append((module, attribute))
        return changed

    def revert(self) -> None:
        """Restore every binding `apply()` changed (in reverse order)."""
        if not self.applied:
            return
        for patch in reversed(list(self._patches.values())):
            for module, attribute in patch.rebound:
                if patch.original is _MISSING:
                    delattr(module, attribute)
                else:
                    setattr(module, attribute, patch.original)
            if patch.target in self._modules:
                sys.modules.pop(patch.target, None)
            patch.rebound = []
            _APPLIED.pop(patch.target, None)
        self.applied = False
