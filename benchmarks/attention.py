"""Attention benchmark: jax_tk against cuDNN, XLA and Pallas (same process, same timer).

    python benchmarks/attention.py [options]        # same as: python -m jax_tk.bench attention [options]
    python benchmarks/attention.py --help

All the work is in jax_tk/bench.py; this script only makes it runnable from a checkout without
installing the package.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from jax_tk.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["attention", *sys.argv[1:]]))
