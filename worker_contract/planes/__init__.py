"""Weight planes: the form weights take in anchors and patches (`DRL_PULSE_PLANE`).

Each plane is a module defining `INTERFACE`: NAME; from_hf(state) -> plane tensors (numpy); from_hf_torch(state),
its torch twin (the same bits on the tensors' device, fresh copies: the publisher makes the plane on the GPU);
to_dense(plane) -> HF-named dense tensors (for a worker); quantized_tensors(plane). Plane tensors are numpy (bf16
through ml_dtypes), so a worker needs no torch; a module imports torch only inside `from_hf_torch`. A new plane
is its module plus one line in `PLANES` (or `register_plane(module)`); every schema's `PlaneName` checks this
registry when it validates. Signatures: docs/extending.md.
"""

from __future__ import annotations

from types import ModuleType
from typing import Annotated

from pydantic import AfterValidator

from . import bf16, int8g64

PLANES: dict[str, ModuleType] = {bf16.NAME: bf16, int8g64.NAME: int8g64}
#: what a plane module must define (`register_plane` refuses one that lacks a name of these)
INTERFACE = ("NAME", "from_hf", "from_hf_torch", "to_dense", "quantized_tensors")


def register_plane(module: ModuleType) -> ModuleType:
    """Register a plane module under its `NAME`; one that lacks part of `INTERFACE`, or whose name another
    module holds, is refused."""
    missing = [a for a in INTERFACE if not hasattr(module, a)]
    if missing:
        raise ValueError(f"plane module {module.__name__} lacks {', '.join(missing)} (a plane defines "
                         f"{', '.join(INTERFACE)}: worker_contract/planes/__init__.py)")
    if PLANES.get(module.NAME, module) is not module:
        raise ValueError(f"plane name {module.NAME!r} is taken by {PLANES[module.NAME].__name__}")
    PLANES[module.NAME] = module
    return module


def get_plane(name: str) -> ModuleType:
    """The plane module of a name; ValueError naming the known planes otherwise."""
    try:
        return PLANES[name]
    except KeyError:
        raise ValueError(f"DRL_PULSE_PLANE={name!r} is not a known plane; known: {', '.join(sorted(PLANES))}") from None


def _known_plane(name: str) -> str:
    if name not in PLANES:
        raise ValueError(f"{name!r} is not a known plane; known: {', '.join(sorted(PLANES))}")
    return name


#: the plane names, as the type every schema (run.json, records, the env contract, recipes) validates against:
#: the names registered when it validates
PlaneName = Annotated[str, AfterValidator(_known_plane)]


__all__ = ["PLANES", "INTERFACE", "PlaneName", "get_plane", "register_plane"]
