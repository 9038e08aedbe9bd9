"""`trainer.basemodel` is trainer/embedded/basemodel.py, under the name earlier releases and users' scripts use."""

import sys

from .embedded import basemodel

sys.modules[__name__] = basemodel
