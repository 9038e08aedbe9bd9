"""The learner's models on megatron-core (Qwen2, Llama, LFM2), their HF name mappings, weight loading and the
model-identity gate: the learner builds and loads its model from here, and the converter (infra/convert/)
writes checkpoints with the same mappings.

| module          | holds                                                                          |
|-----------------|--------------------------------------------------------------------------------|
| hf_io.py        | HF directory reading/writing (config.json, safetensors), ConvertError           |
| identity.py     | ModelIdentity, check_model_identity (used again at launch), digests             |
| arch.py         | the Architecture interface, HfTensors (the HF tensors a conversion takes)       |
| registry.py     | the per-architecture registry (get_architecture, ARCHITECTURES)                 |
| qwen2.py        | Qwen2/Qwen2.5 name and layout mapping (fused QKV, fused gate/up)                |
| lfm2.py         | LFM2 / LFM2-MoE name and layout mapping, its TransformerConfig and layer spec   |
| lfm2_layers.py  | LFM2's megatron-core blocks (gated short conv, frozen-bias router)              |
| lfm2_slime.py   | LFM2-MoE inside slime: its Megatron flags and the `--spec` hook                 |
| layer_specs.py  | the shared layer specs (sdpa/local/te), SDPA attention with fused rope          |
| model.py        | GPTModel from an HF config, full tensors in and out of TP shards                |
| fused_linear.py | linears that accumulate weight gradients into float32 main_grad in the GEMM     |
| torch_dist.py   | the Megatron-LM / slime checkpoint layout (release/, tracker file)              |

Importing this package does not import torch or megatron-core.
"""

from .arch import Architecture
from .hf_io import ConvertError, load_hf_config, rope_theta_of
from .identity import (
    IDENTITY_FILE,
    IdentityMismatch,
    ModelIdentity,
    check_model_identity,
    identity_from_hf,
    read_identity,
)
from .registry import ARCHITECTURES, get_architecture

__all__ = [
    "ARCHITECTURES", "Architecture", "ConvertError", "IDENTITY_FILE", "IdentityMismatch", "ModelIdentity",
    "check_model_identity", "get_architecture", "identity_from_hf", "load_hf_config", "read_identity",
    "rope_theta_of",
]
