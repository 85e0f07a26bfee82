#!/usr/bin/env bash
# The gateway of several source trees (commits) at one concurrency, in one run against the
# in-process ceiling: what changed between them, measured where run-to-run spread cannot hide
# it. A tree is a folder holding gateway/, worker/ and shared/ (e.g. `git archive COMMIT
# gateway worker shared pyproject.toml | tar -x -C DIR`); each gateway starts from its own
# folder, since `python -m` puts the working directory first on sys.path (a tree named only
# on PYTHONPATH while another is the working directory runs the other's code). Each tree's
# first log line says which files it imported.
#
#   benchmarks/compare_trees.sh OUT MODEL_DIR LEVEL NAME=DIR...
#
# Run from the repository root (its benchmarks/ drives the load) with MLX and the project's
# dependencies importable by $PYTHON (default python3); $SITE (default /tmp/site) goes on
# each tree's PYTHONPATH before it. The config is the same for every tree and uses only what
# every version knows: max_running = prefill_batch_size = LEVEL, the rest its own defaults.
set -euo pipefail
OUT=${1:?usage: benchmarks/compare_trees.sh OUT MODEL_DIR LEVEL NAME=DIR...}
MODEL=$2 LEVEL=$3
shift 3
PY=${PYTHON:-python3}
mkdir -p "$OUT/logs"
RUN=$(mktemp -d /tmp/treesXXXX)
cat >"$RUN/run.sh" <<'SH'
#!/bin/sh
# run.sh DIR CONFIG PORT PYTHON: one tree's gateway, from its own folder
cd "$1" && export PYTHONPATH=${SITE:-/tmp/site}:$1
"$4" -c 'import gateway, worker; print("TREE", gateway.__file__, worker.__file__)'
exec "$4" -m gateway --config "$2" serve --port "$3"
SH
chmod +x "$RUN/run.sh"
launch=()
for pair in "$@"; do
  name=${pair%%=*} dir=$(cd "${pair#*=}" && pwd)
  cfg=$RUN/$name.toml
  printf '[server]\nhost = "127.0.0.1"\nrun_dir = "%s"\n\n[[models]]\nname = "bench"\nsource = "%s"\n[models.engine]\nmax_running = %s\nprefill_batch_size = %s\n' \
    "$(mktemp -d /tmp/gwXXXX)" "$MODEL" "$LEVEL" "$LEVEL" >"$cfg"
  launch+=(--launch-cmd "$name=$RUN/run.sh $dir $cfg {port} {python}" --served-model "$name=bench")
done
$PY -m benchmarks.serving --model "$MODEL" --inprocess "${launch[@]}" --concurrency "$LEVEL" \
  --min-requests 16 --no-interleave --steal-retries 0 --wait-idle 0 --warm-levels \
  --log-dir "$OUT/logs" --out "$OUT/trees.json" 2>&1 | tee "$OUT/trees.log"
grep -h "^TREE" "$OUT"/logs/*.log | sort | uniq -c
