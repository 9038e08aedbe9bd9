"""The native engine: our Ray learner (learner.py), running the model through trainer/backends/ on a Ray
started by trainer/ray_runtime.py. `python -m trainer.native` is the old command of the learner process
(__main__.py re-executes `python -m entrypoints.learner`)."""
