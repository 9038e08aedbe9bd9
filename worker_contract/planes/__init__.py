"""Weight planes: the form weights take in anchors and patches (`DRL_PULSE_PLANE`).

Each plane is a module with one small interface:
    NAME                          the plane's name in run.json and the env contract
    from_hf(state) -> plane       HF-named tensors (torch or numpy, any float dtype) -> the plane's tensors
    to_dense(plane) -> dense      plane tensors -> HF-named dense tensors, for a worker running a dense model
    quantized_tensors(plane)      names of the plane tensors that are quantized
Plane tensors are numpy arrays (bf16 through ml_dtypes), so a worker needs no torch. A new plane adds a
module here and one line to `PLANES`; every schema's plane type (`PlaneName`) follows.
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal

from . import bf16, int8g64

PLANES: dict[str, ModuleType] = {bf16.NAME: bf16, int8g64.NAME: int8g64}
#: the plane names, as the type every schema (run.json, records, the env contract, recipes) validates against
PlaneName = Literal[tuple(PLANES)]  # type: ignore[valid-type]


def get_plane(name: str) -> ModuleType:
    """The plane module of a name; ValueError naming the known planes otherwise."""
    try:
        return PLANES[name]
    except KeyError:
        raise ValueError(f"DRL_PULSE_PLANE={name!r} is not a known plane; known: {', '.join(sorted(PLANES))}") from None


__all__ = ["PLANES", "PlaneName", "get_plane"]
