"""python -m jax_tk.bench <op> [options]: see jax_tk.bench."""
import sys

from jax_tk.bench.cli import main

sys.exit(main())
