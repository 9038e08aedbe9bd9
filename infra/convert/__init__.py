"""HF <-> Megatron torch_dist conversion and the model-identity gate.

| module        | holds                                                                      |
|---------------|----------------------------------------------------------------------------|
| hf_io.py      | HF directory reading/writing (config.json, safetensors), ConvertError       |
| identity.py   | ModelIdentity, check_model_identity (used again at launch), digests         |
| registry.py   | the per-architecture registry (Architecture interface, get_architecture)    |
| qwen2.py      | Qwen2/Qwen2.5 name and layout mapping (fused QKV, fused gate/up)            |
| model.py      | GPTModel from an HF config (sdpa/local/TE specs), TP shard/unshard          |
| torch_dist.py | the Megatron-LM / slime checkpoint layout (release/, tracker file)          |
| convert.py    | convert (HF -> torch_dist) and export_hf (torch_dist -> HF)                |

Importing this package does not import torch or megatron-core.
"""

from .convert import convert, export_hf, plan
from .hf_io import ConvertError, load_hf_config, rope_theta_of
from .identity import (
    IDENTITY_FILE,
    IdentityMismatch,
    ModelIdentity,
    check_model_identity,
    identity_from_hf,
    read_identity,
)
from .registry import ARCHITECTURES, Architecture, get_architecture

__all__ = [
    "ARCHITECTURES", "Architecture", "ConvertError", "IDENTITY_FILE", "IdentityMismatch", "ModelIdentity",
    "check_model_identity", "convert", "export_hf", "get_architecture", "identity_from_hf", "load_hf_config",
    "plan", "read_identity", "rope_theta_of",
]
