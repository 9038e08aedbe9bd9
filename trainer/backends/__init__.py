"""Learner backends, one registry: `get_backend(name)` returns the class.

    hf        transformers; CPU and one GPU (trainer/backends/hf.py)
    megatron  megatron-core; GPU scale (trainer/backends/megatron.py)

Both implement `trainer.backends.base.Backend`. Modules are imported only when asked for, so choosing
`hf` never imports megatron-core. An unknown name is refused with the list of known ones.
"""

from __future__ import annotations

import importlib

from .base import Backend

#: name -> "module:Class"
BACKENDS: dict[str, str] = {
    "hf": "trainer.backends.hf:HFBackend",
    "megatron": "trainer.backends.megatron:MegatronBackend",
}


def get_backend(name: str) -> type[Backend]:
    """The backend class registered under `name` (train.backend in the recipe)."""
    if name not in BACKENDS:
        raise ValueError(f"train.backend={name!r} is not a known backend; known: {', '.join(sorted(BACKENDS))}")
    module, cls = BACKENDS[name].split(":")
    backend = getattr(importlib.import_module(module), cls)
    assert issubclass(backend, Backend) and backend.name == name, (name, backend)
    return backend


__all__ = ["BACKENDS", "Backend", "get_backend"]
