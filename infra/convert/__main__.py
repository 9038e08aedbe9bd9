"""`python -m infra.convert HF_DIR --out DIR`: HF -> Megatron torch_dist (or `--to-hf` back).

A process entry point (not only an Invoke task) because megatron's checkpoint writer spawns processes
that re-import `__main__`; this module's guard keeps them from re-running the conversion.
"""

from __future__ import annotations

import argparse
import json
import sys

from worker_contract.cli import number, output_dir


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infra.convert", description=__doc__.splitlines()[0])
    p.add_argument("hf_dir", help="HF checkpoint directory (config.json, safetensors, tokenizer.json)")
    p.add_argument("--out", required=True, help="output directory (torch_dist root, or HF dir with --to-hf)")
    p.add_argument("--rotary-base", type=number(float, above=0), default=None,
                   help="refused unless it equals the HF config's rope_theta (default: take rope_theta)")
    p.add_argument("--recipe", default=None, help="also check this recipe's model.rotary_base (e.g. gsm8k)")
    p.add_argument("--padded-vocab-size", type=number(int, at_least=1), default=None, help="pad embedding rows (Megatron vocab padding)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="default: as stored")
    p.add_argument("--overwrite", action="store_true", help="replace an existing converted checkpoint in --out")
    p.add_argument("--no-verify", action="store_true", help="skip reloading the checkpoint and comparing tensors")
    p.add_argument("--to-hf", metavar="TORCH_DIST_ROOT", default=None,
                   help="export this Megatron checkpoint to HF safetensors in --out; HF_DIR supplies config/tokenizer")
    p.add_argument("--dry-run", action="store_true", help="check config, identity and shards; print the plan; write nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def recipe_rotary_base(recipe: str | None) -> float | None:
    if recipe is None:
        return None
    from trainer.config import resolve

    return resolve(recipe).model.rotary_base


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import warnings

    # megatron-core warns at import about every optional fusion it lacks (Apex, Transformer Engine): not ours
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from infra.convert.convert import convert, export_hf, plan
    from trainer.models import ConvertError, IdentityMismatch, check_model_identity, identity_from_hf

    try:
        output_dir(args.out)  # the dry run too: it promises the conversion would write there
        rb = recipe_rotary_base(args.recipe)
        if rb is not None:
            check_model_identity(identity_from_hf(args.hf_dir), rotary_base=rb,
                                 rotary_base_source=f"recipe {args.recipe!r} model.rotary_base")
        if args.to_hf:
            if args.dry_run:
                print(json.dumps({"export": args.to_hf, "to": args.out, "hf_source": args.hf_dir}, indent=2))
                return 0
            paths = export_hf(args.to_hf, args.out, hf_source=args.hf_dir, progress=not args.quiet)
            print(f"wrote {len(paths)} safetensors file(s) to {args.out}")
            return 0
        kw = dict(rotary_base=args.rotary_base, padded_vocab_size=args.padded_vocab_size, dtype=args.dtype)
        if args.dry_run:
            print(json.dumps(plan(args.hf_dir, args.out, **kw), indent=2))
            return 0
        ident = convert(args.hf_dir, args.out, overwrite=args.overwrite, verify=not args.no_verify,
                        progress=not args.quiet, **kw)
        print(f"converted {ident.architecture} (rope_theta {ident.rope_theta:g}, vocab {ident.vocab_size}) to {args.out}")
        return 0
    except (ConvertError, IdentityMismatch, ValueError) as e:
        print(f"convert: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
