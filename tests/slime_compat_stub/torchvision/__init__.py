"""Stand-in for torchvision in the slime_compat venv: the index's wheel needs CUDA libraries, and sglang and
transformers only import names from it at module load (for vision models no check here uses). Every
submodule and name resolves to a placeholder; calling one raises."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _MissingMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls

    def __getitem__(cls, item):
        return cls


class _Missing(metaclass=_MissingMeta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a stand-in in this venv")


def _getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing


__getattr__ = _getattr


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__getattr__ = _getattr
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
