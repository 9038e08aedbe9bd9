"""The embedded default (`make gsm8k` / `make psqa` with no HOST, GPU or R2), a package above `trainer` and
`infra`, which never import it: its settings (config.py, the recipe's `embedded:` section), the run and its
watch loop (run.py), its child processes (localprocs.py), the terminal view (view.py), the shipped base
model and its supervised build (basemodel.py, base_gsm8k/), held-out evaluation (heldout.py), and psqa's
own pieces (psqa.py, psqa_base.py, psqa_synth.py; the curve itself is trainer/psqa_eval.py). More in
docs/embedded.md."""
