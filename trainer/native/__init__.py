"""The native engine: our Ray learner (learner.py), running the model through trainer/backends/ on a Ray
started by trainer/ray_runtime.py. The learner process is `python -m entrypoints.learner`."""
