"""The Megatron `torch_dist` checkpoint layout, as Megatron-LM and slime `--load` / `--ref-load` read it.

    <root>/latest_checkpointed_iteration.txt   "release" (or an iteration number); written LAST
    <root>/release/                            megatron-core dist_checkpointing output:
        metadata.json  common.pt  .metadata  __<rank>_<i>.distcp
    <root>/model_identity.json                 our identity record (identity.py)

megatron-core writes the iteration directory; the tracker file and the `release` / `iter_0000000` names
come from Megatron-LM's training loop, which we mirror (megatron/training is not in every core wheel).
The common state carries `checkpoint_version` 3.0 and `iteration` 0 as Megatron-LM's own saver does.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .hf_io import ConvertError

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
CHECKPOINT_VERSION = 3.0


def iteration_dir(root: str | Path, iteration: int | str = RELEASE) -> Path:
    return Path(root) / (RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}")


def checkpoint_dir(root: str | Path) -> Path:
    """The directory the tracker names; a clear error when the checkpoint is absent or unfinished."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        raise ConvertError(f"{tracker} is missing: {root} holds no finished Megatron checkpoint (convert it first)")
    text = tracker.read_text().strip()
    if text != RELEASE and not text.isdigit():
        raise ConvertError(f"{tracker} holds {text!r}; expected 'release' or an iteration number")
    d = iteration_dir(root, text if text == RELEASE else int(text))
    if not (d / "metadata.json").is_file():
        raise ConvertError(f"{d} is not a torch_dist checkpoint (no metadata.json)")
    return d


@contextmanager
def single_process_group():
    """A one-process gloo group + megatron parallel state, unless the caller already has them."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:  # our own loopback rendezvous; MASTER_PORT from the environment may belong to someone else
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mp_created = not parallel_state.model_parallel_is_initialized()
    if mp_created:
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if mp_created:
            parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def write_tracker(root: str | Path, iteration: int | str = RELEASE) -> None:
    """Mark the checkpoint complete (atomic rename); loaders ignore a root without it."""
    tmp = Path(root) / (TRACKER + ".tmp")
    tmp.write_text(f"{iteration}\n")
    tmp.replace(Path(root) / TRACKER)


def save(model: Any, root: str | Path, iteration: int | str = RELEASE, *, tracker: bool = True) -> Path:
    """Write `model` under `root` (every rank of its TP group calls this); the tracker is written last."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    d = iteration_dir(root, iteration)
    d.mkdir(parents=True, exist_ok=True)
    state = {"model": model.sharded_state_dict(), "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": 0 if iteration == RELEASE else int(iteration)}
    try:
        dist_checkpointing.save(state, str(d))
    except AssertionError as e:  # megatron's writer calls torch.cuda.* unconditionally
        if "CUDA" in str(e):
            raise ConvertError(  # the machine, not the code: one sentence, exit 2 (infra.convert)
                "megatron-core's torch_dist writer needs a CUDA build of torch; run the conversion on the GPU host"
            ) from None
        raise
    dist.barrier()
    if tracker and dist.get_rank() == 0:
        write_tracker(root, iteration)
    dist.barrier()
    return d


def load(model: Any, root: str | Path, directory: str | Path | None = None) -> Path:
    """Load the checkpoint the tracker names (or `directory`) into `model`, resharding to any TP layout."""
    from megatron.core import dist_checkpointing

    d = Path(directory) if directory is not None else checkpoint_dir(root)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(d))
    result = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise ConvertError(f"{d} lacks tensors the model needs: {missing[:6]}")
    return d
