"""`trainer.publisher` is trainer/publish/publisher.py, under the name earlier releases and users' scripts use."""

import sys

from .publish import publisher

sys.modules[__name__] = publisher
