"""Engine parity as data: the optimizer each engine really builds from a recipe is the same one.

The native learner's settings are read off its optimizer (param groups, state dtypes, the learning rate
after steps); the slime engine's off the flags its launch passes to Megatron. A setting hard-coded in
either engine, or read from different recipe fields, makes them differ and fails here.
"""

from __future__ import annotations

import pytest
import torch

from tests import megatron_cpu
from trainer.config import resolve

VOCAB = 64
#: non-default values, so an engine that ignores the recipe shows up as a difference
ODD = {"optim.lr": 3e-4, "optim.weight_decay": 0.05, "optim.grad_clip": 0.7, "optim.beta1": 0.85,
       "optim.beta2": 0.95, "optim.eps": 1e-6}


def _cfg(recipe: str, backend: str, over: dict):
    return resolve(recipe, env={"DRL_RUN": "parity"},
                   overrides={"train.backend": backend, "model.dtype": "float32", **over})


def _flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} appears {args.count(name)} times in the slime command"
    return args[args.index(name) + 1]


def slime_settings(cfg) -> dict:
    """What Megatron's optimizer gets from the slime launch (fp32 masters and moments are its defaults)."""
    from infra import slime_launch as sl

    hf = sl.KNOWN_HF_CONFIGS[cfg.model.hf_id]
    args = sl.slime_args(cfg, sl.BoxPaths(remote_dir="/root/dRL", run="parity"), hf)
    assert _flag(args, "--optimizer") == "adam"
    warmup = int(_flag(args, "--lr-warmup-iters"))
    return {"lr": float(_flag(args, "--lr")), "betas": (float(_flag(args, "--adam-beta1")),
            float(_flag(args, "--adam-beta2"))), "eps": float(_flag(args, "--adam-eps")),
            "weight_decay": float(_flag(args, "--weight-decay")), "clip": float(_flag(args, "--clip-grad")),
            "schedule": _flag(args, "--lr-decay-style") if warmup == 0 else f"warmup-{warmup}",
            "master_dtype": "float32", "moment_dtype": _moments(args),
            "offload": float(_flag(args, "--optimizer-offload-fraction")) if "--optimizer-cpu-offload" in args else 0.0}


def _moments(args: list[str]) -> str:
    """Megatron's Adam moments: float32 unless its precision-aware optimizer is given both moment dtypes."""
    if "--use-precision-aware-optimizer" not in args:
        return "float32"
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    first, second = names[_flag(args, "--exp-avg-dtype")], names[_flag(args, "--exp-avg-sq-dtype")]
    assert first == second, f"Megatron's moments differ: exp_avg {first}, exp_avg_sq {second}"
    return second


def native_settings(backend, batch) -> dict:
    """What the native learner's AdamW holds, and what its learning rate does over two steps."""
    from trainer.objectives import policy_loss

    opt = backend.optimizer if hasattr(backend, "optimizer") else backend._local.optimizer
    cfg = backend.cfg if hasattr(backend, "cfg") else backend._local.cfg
    algo = cfg.algo
    fn = lambda lp, mb: policy_loss(lp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask, algo)  # noqa: E731
    batch.ref_logp = backend.logprobs(batch, reference=True)
    lrs = [backend.train_step(batch, fn)["lr"] for _ in range(2)]
    (group,) = opt.param_groups
    state = next(iter(opt.state.values()))
    return {"lr": lrs[0], "betas": tuple(group["betas"]), "eps": group["eps"],
            "weight_decay": group["weight_decay"], "clip": cfg.optim.grad_clip,
            "schedule": "constant" if lrs[0] == lrs[1] else "varies",
            "master_dtype": str(group["params"][0].dtype).removeprefix("torch."),
            "moment_dtype": str(state["exp_avg_sq"].dtype).removeprefix("torch."),
            "offload": _host_share(opt)}


def _host_share(opt) -> float:
    """The share of optimizer state elements the native optimizer keeps in host memory."""
    if not hasattr(opt, "bytes_by_place"):  # torch's AdamW: every state where its parameter is
        return 0.0
    places = opt.bytes_by_place()
    return places["host"] / max(1, places["host"] + places["device"])


@pytest.fixture(scope="module")
def mcore():
    torch.set_num_threads(1)
    megatron_cpu.init_distributed()
    yield


@pytest.mark.parametrize("over", [{}, ODD], ids=["recipe", "odd"])
@pytest.mark.parametrize("recipe", ["gsm8k", "psqa"])
@pytest.mark.parametrize("backend", ["hf", "megatron"])
def test_native_and_slime_build_the_same_optimizer(tmp_path, mcore, recipe, backend, over):
    from trainer.backends import get_backend

    megatron_cpu.make_tiny_qwen2(tmp_path, vocab=VOCAB, hidden=32, ffn=64)
    if backend == "hf":  # the hf backend has no memory plan (refused there): both engines without one
        over = {**over, "optim.moment_dtype": "float32", "optim.offload": 0.0}
    cfg = _cfg(recipe, backend, over)
    kw = {"attention": "sdpa"} if backend == "megatron" else {}
    native = native_settings(get_backend(backend).load(tmp_path, cfg, device="cpu", **kw),
                             megatron_cpu.random_batch(4, VOCAB))
    slime = slime_settings(_cfg(recipe, backend, {**over, "train.engine": "slime"}))
    assert native["lr"] == pytest.approx(slime["lr"])
    for key in ("betas", "eps", "weight_decay", "clip", "schedule", "master_dtype", "moment_dtype", "offload"):
        assert native[key] == pytest.approx(slime[key]) if key != "schedule" and "dtype" not in key \
            else native[key] == slime[key], f"{recipe}/{backend}: {key} native {native[key]} != slime {slime[key]}"
