"""Publishing off the step: the queue the learner hands each new state to (queue.py), the publisher that
makes the plane, diffs it into a PULSE patch and uploads it (publisher.py), and the signed pointer with
the claims that say which versions are the trainer's (pointer.py)."""
