"""The workers: `python -m worker_contract.worker --store URL --run RUN [--model DIR] [--backend mlx]`.

Two backends behind one loop. The reference worker runs torch and transformers (the `worker` extra);
`--backend mlx` runs MLX and mlx-lm (the `mlx` extra: Apple silicon, or Linux CPUs through mlx[cpu]),
with the run's plane loaded natively (docs/mac-worker.md). Either reads run.json and fails closed on
any contract difference (DRL_PULSE_PLANE, DRL_N_SAMPLES, contract version, model identity), cold-joins
through the verifying reconstructor, then loops: follow new versions between groups, sample
DRL_N_SAMPLES completions of one training prompt at the run's temperature, record each token's behaviour
log-prob from the forward that sampled it, score with the task's reward, upload one record create-only.

Modules: `loop` (the loop and its settings, shared), `identity` (local model vs run.json, shared), `chat`
(prompt ids and stop ids, shared), `completion` (what a sampler returns), `episodes` and `retrieval` (psqa
search episodes and their search tool, shared); torch: `model` (the policy),
`sampling` (the sampler); MLX: `mlx_model`, `mlx_sampling`, `mlx_weights` (plane names -> mlx-lm's).
Importing this package imports neither torch nor mlx.
"""
