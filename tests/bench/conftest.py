"""The benchmark lives beside the library, in benchmarks/ at the repository root (outside the wheel).
``python -m pytest`` from the root finds it; for ``pytest``, ``python -P``, or PYTHONPATH pointing at
an installed build, the root is appended to sys.path (appended: a jax_tk installed earlier on the
path stays the one imported). A copy of tests/ without benchmarks/ beside it skips these tests."""
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

if importlib.util.find_spec("benchmarks") is None and (ROOT / "benchmarks" / "__init__.py").is_file():
    sys.path.append(str(ROOT))
if importlib.util.find_spec("benchmarks") is None:
    collect_ignore_glob = ["test_*.py"]
