"""Loads examples/train_gpt.py as the module `train_gpt` for the example's tests."""
from helpers import load_example as _load


def load_example():
    return _load("train_gpt.py", "train_gpt")
