"""python -m benchmarks <op> [options]: see the package's docstring and README.md."""
import sys

from benchmarks.cli import main

sys.exit(main())
