"""The workers: `python -m worker_contract.worker --store URL --run RUN [--model DIR] [--backend mlx]`.

Two backends behind one loop: the reference worker runs torch and transformers (the `worker` extra);
`--backend mlx` runs MLX and mlx-lm (the `mlx` extra; docs/mac-worker.md). Either fails closed on any
contract difference from run.json, cold-joins through the verifying reconstructor, then samples groups,
records each token's behaviour log-prob, scores them and uploads one record per group, create-only.
Importing this package imports neither torch nor mlx.
More in docs/mac-worker.md (module notes).
"""
