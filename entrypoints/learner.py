"""`python -m entrypoints.learner --recipe-json R --model-dir D --state-dir S [--env-file F]`: the learner.

The one learner process, whichever launcher starts it: the native launch on a GPU box (detached,
infra/native_launch.py) and the embedded run (a child of the launcher, embedded/localprocs.py). Its work is
trainer.native.learner.serve (Ray on 127.0.0.1, run_learner until `train.num_steps` steps or SIGTERM/SIGINT, which
stop it after the step in hand); its last line is `{"learner_done": {...}}`. `python -m trainer.native`
re-executes this. A missing or invalid input is one sentence and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

PROG = "python -m entrypoints.learner"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe-json", required=True, help="the resolved recipe (written by the launcher)")
    ap.add_argument("--model-dir", required=True, help="the HF model directory (config, tokenizer, weights)")
    ap.add_argument("--state-dir", required=True, help="the run's state dir: trainer.key, checkpoints, metrics")
    ap.add_argument("--env-file", default=None, help="credentials file (mode 0600), e.g. <remote_dir>/.r2env; "
                                                     "default: .r2env here when there")
    args = ap.parse_args(argv)
    from trainer.config import RecipeConfig
    from trainer.native.learner import serve
    from worker_contract.cli import EXIT_BAD_INPUT, one_sentence

    try:
        cfg = RecipeConfig.model_validate_json(Path(args.recipe_json).read_text())
        key = Path(args.state_dir) / "trainer.key"
        for path, what in ((Path(args.model_dir), "--model-dir"), (key, "the run's key")):
            if not path.exists():
                raise FileNotFoundError(f"{what} {path} does not exist")
    except (OSError, ValueError) as e:
        print(f"{PROG}: {one_sentence(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    res = serve(cfg, args.model_dir, args.state_dir, env_file=args.env_file)
    print(json.dumps({"learner_done": {"step": res.step, "version": res.version,
                                       "first_version": res.first_version}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
