"""The recipe cases the tests run, named "<recipe>/<format>" once here, so that a case of one name is the
same recipe in every test file. Each call builds a fresh recipe (recipes are mutable dataclasses)."""
from __future__ import annotations

from typing import Callable, Optional

from mindspeed_te import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, Recipe

_KINDS = {"delayed": DelayedScaling, "tensorwise": Float8CurrentScaling, "blockwise": Float8BlockScaling,
          "mxfp8": MXFP8BlockScaling}
_FORMATS = {"e4m3": Format.E4M3, "hybrid": Format.HYBRID, "hif8": Format.HIF8}

# Every case: each recipe in each format it supports (MX elements are E4M3/E5M2 only), and no recipe.
NAMES = ("high precision", *(f"{kind}/{fmt}" for kind in _KINDS for fmt in _FORMATS
                              if not (kind == "mxfp8" and fmt == "hif8")))


def recipe(name: str, amax_history_len: Optional[int] = None) -> Optional[Recipe]:
    """The recipe of case `name` (None for "high precision"); `amax_history_len` applies to delayed scaling."""
    if name not in NAMES:
        raise KeyError(f"no recipe case {name!r}; the cases are {', '.join(NAMES)}")
    if name == "high precision":
        return None
    kind, fmt = name.split("/")
    extra = {"amax_history_len": amax_history_len} if kind == "delayed" and amax_history_len is not None else {}
    return _KINDS[kind](fp8_format=_FORMATS[fmt], **extra)


def recipes(*names: str) -> dict[str, Optional[Recipe]]:
    """{name: recipe} for the named cases, in order."""
    return {name: recipe(name) for name in names}


def recipe_factories(*names: str, amax_history_len: Optional[int] = None
                     ) -> dict[str, Optional[Callable[[], Recipe]]]:
    """{name: a function building that case's recipe afresh}, for tests that want a new recipe per run; None
    for "high precision" (no recipe, so callers can tell it apart without calling it)."""
    return {name: None if name == "high precision" else (lambda name=name: recipe(name, amax_history_len))
            for name in names}
