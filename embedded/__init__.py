"""The embedded default (`make gsm8k` / `make psqa` with no HOST, GPU or R2): the run and its watch loop
(run.py), its child processes (localprocs.py), the terminal view (view.py), the shipped base model and
its supervised build (basemodel.py, base_gsm8k/), held-out evaluation (heldout.py), and psqa's own
pieces (psqa.py, psqa_base.py, psqa_synth.py, psqa_eval.py). More in docs/embedded.md."""
