"""The contract between the learner and the worker fleet: bucket layout, env contract, run manifest,
rollout record schema, weight planes, PULSE patch codec, store clients and verification.

Slim by rule: this package imports nothing from `trainer` or `infra`, and its core needs no torch, so an
MLX worker on a Mac can use it as is. The reference worker (torch) lives in `worker_contract.worker`.
"""

from .layout import CONTRACT_VERSION

__all__ = ["CONTRACT_VERSION"]
