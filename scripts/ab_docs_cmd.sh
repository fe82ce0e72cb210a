#!/usr/bin/env bash
# The command of the documents A/B (scripts/ab.sh OUT ROUNDS bash scripts/ab_docs_cmd.sh): the packing
# steps of docs_bound_probe.py, then the feature rows $AB_FEATURES (default documents), jax_tk only.
PROBE_SET=steps python3 -P scripts/docs_bound_probe.py 2>&1 | grep "TF/s"
python3 -P -m jax_tk.bench attention --features ${AB_FEATURES:-documents} --providers jax_tk --no-check --png none --out /tmp/benchout 2>&1 | grep -E "^ *(plain|documents|window) |== features"
