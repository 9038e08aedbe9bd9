"""`trainer.learner` is trainer/native/learner.py, under the name earlier releases and users' scripts use."""

import sys

from .native import learner

sys.modules[__name__] = learner
