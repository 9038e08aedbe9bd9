"""The reference worker: `python -m worker_contract.worker --store URL --run RUN [--model DIR]`.

A conforming worker in torch and transformers (the `worker` extra): it reads run.json and fails closed on
any contract difference (DRL_PULSE_PLANE, DRL_N_SAMPLES, contract version, model identity), cold-joins
through the verifying reconstructor, then loops: follow new versions between groups, sample
DRL_N_SAMPLES completions of one training prompt at the run's temperature, record each token's behaviour
log-prob from the forward that sampled it, score with the task's reward, upload one record create-only.

Modules: `loop` (the loop and its settings), `model` (the policy built from the run's config),
`sampling` (the sampler), `identity` (local model vs run.json). Importing this package imports no torch.
"""
