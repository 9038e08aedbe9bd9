"""Invoke task: HF checkpoint -> Megatron torch_dist checkpoint (the slime `--load` / `--ref-load` layout).

The work runs in `python -m infra.convert` (megatron's writer spawns processes that re-import __main__);
this task only builds that command.
"""

from __future__ import annotations

import os
import sys

from .taskkit import REPO_ROOT, UsageError, int_flag, stoa_task


def convert_command(hf_dir: str, out: str, *, rotary_base: float | None = None, recipe: str | None = None,
                    padded_vocab_size: int | None = None, dtype: str | None = None, overwrite: bool = False,
                    verify: bool = True, to_hf: str | None = None, dry_run: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "infra.convert", hf_dir, "--out", out]
    opts = {"--rotary-base": rotary_base, "--recipe": recipe, "--padded-vocab-size": padded_vocab_size,
            "--dtype": dtype, "--to-hf": to_hf}
    for flag, value in opts.items():
        if value is not None:
            cmd += [flag, str(value)]
    cmd += [flag for flag, on in (("--overwrite", overwrite), ("--no-verify", not verify), ("--dry-run", dry_run)) if on]
    return cmd


@stoa_task(help={
    "hf-dir": "HF checkpoint directory (config.json, *.safetensors, tokenizer.json); required",
    "out": "output directory: the torch_dist root (release/ + latest_checkpointed_iteration.txt); required",
    "rotary-base": "only accepted if equal to the HF config's rope_theta (it is refused otherwise)",
    "recipe": "also check this recipe's model.rotary_base (e.g. gsm8k)",
    "padded-vocab-size": "pad the embedding rows to this size (Megatron vocab padding)",
    "dtype": "bfloat16 | float16 | float32 (default: as stored)",
    "overwrite": "replace an existing converted checkpoint in --out",
    "no-verify": "skip the reload-and-compare check",
    "to-hf": "reverse: export this torch_dist root to HF safetensors in --out (HF_DIR gives config/tokenizer)",
    "dry-run": "check config, identity and shards, print the plan, write nothing",
})
def convert(c, hf_dir=None, out=None, rotary_base=None, recipe=None, padded_vocab_size=None, dtype=None,
            overwrite=False, no_verify=False, to_hf=None, dry_run=False):
    """Convert an HF checkpoint to a Megatron torch_dist checkpoint, refusing a mismatched rotary base."""
    import subprocess

    if not hf_dir or not out:
        raise UsageError("--hf-dir and --out are required: invoke convert --hf-dir /path/to/hf-model --out "
                         "/path/to/torch_dist")
    if rotary_base is not None:
        try:
            rotary_base = float(rotary_base)
        except ValueError:
            raise UsageError(f"--rotary-base={rotary_base!r} must be a number (the HF config's rope_theta)") from None
    vocab = int_flag("--padded-vocab-size", padded_vocab_size, 0, minimum=1) if padded_vocab_size else None
    cmd = convert_command(hf_dir, out, rotary_base=rotary_base, recipe=recipe, padded_vocab_size=vocab,
                          dtype=dtype, overwrite=overwrite, verify=not no_verify, to_hf=to_hf, dry_run=dry_run)
    # one argv, no shell: every flag value reaches the converter as one argument
    code = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, check=False).returncode
    if code:
        from invoke import Exit

        raise Exit(code=code)
