"""Loads examples/train_gpt.py as the module `train_gpt` for the example's tests."""
import importlib.util
import os
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "train_gpt.py")


def load_example():
    if "train_gpt" in sys.modules:
        return sys.modules["train_gpt"]
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["train_gpt"]
        raise
    return module
