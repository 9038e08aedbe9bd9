"""LFM2-MoE inside slime: the layer-spec hook slime's model provider
calls (`--spec trainer.models.lfm2_slime lfm2_spec`), so slime builds exactly the model our converter wrote.

The spec hook reads the HF config.json from `--hf-checkpoint`; the model's flags, from the same file, are
`Lfm2.slime_model_flags` (trainer/models/lfm2.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .lfm2 import SLIME_SPEC as SPEC  # noqa: F401 (the flags name it; tests and the setup read it here)


def lfm2_spec(args: Any = None, config: Any = None, *_: Any, **__: Any):
    """Layer spec for slime's model provider (called as `spec(args, config, vp_stage)`): the per-layer
    conv/attention, dense/MoE block spec. The config gets the per-layer checkpoint keys the converter
    wrote (conv and attention layers hold different tensors)."""
    from .lfm2 import Lfm2

    if config is not None:
        config.hetereogenous_dist_checkpoint = True

    hf_dir = getattr(args, "hf_checkpoint", None)
    if hf_dir is None:
        from megatron.training import get_args

        hf_dir = get_args().hf_checkpoint
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    return Lfm2().layer_spec(cfg, "sdpa")
