"""The learner's models on megatron-core (Qwen2, Llama, LFM2), their HF name mappings, weight loading and the
model-identity gate: the learner builds and loads its model from here, and the converter (infra/convert/)
writes checkpoints with the same mappings. Importing this package does not import torch or megatron-core.
More in docs/extending.md (module notes).
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
