#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md: one NVIDIA GPU, MLX's CUDA backend, random-weight
# models of Llama-3.2-1B's and Llama-3.1-8B's shapes in bf16 (vocab 128,256).
#
#   benchmarks/h200.sh OUT [1b] [8b] [agent] [agent8b] [turns] [kernels] [forward] [arrivals] [steps]
#                      [steps8b] [shapes] [leaving] [prefills] [prefill-profile] [profile]
#                      [first-use]
#   (default: 1b 8b agent)
#
# Run from the repository root with MLX (CUDA), mlx-lm and the project importable by
# $PYTHON (default python3). Models are built under $MODELS (default /tmp/models) on first use.
# SMALL=1 swaps in tiny shapes, to rehearse the whole script on a CPU machine; SERVING_ARGS
# and AGENT_ARGS add flags to benchmarks.serving and benchmarks.agent_session; SOURCES picks
# the servers of 1b / 8b (default gateway-compiled,mlx_lm: the gateway's defaults and mlx_lm
# server; gateway is BatchGenerator's batch,
# gateway-rows the rows batch with mlx-lm's forward pass, gateway-compiled the rows batch with
# the compiled decode step, gateway-compiled-mask the same with MLX's masked attention
# instead of the ragged-attention kernel (engine.decode_attention = "mlx"), gateway-compiled-stacked
# the compiled step with stacked projections (engine.decode_projections = "stacked"),
# gateway-compiled-buckets the compiled step with prefills at a few shapes
# (engine.prefill_shapes = "buckets": the default "auto" is that under CUDA),
# gateway-compiled-exact the same with prefills at exact shapes (as runs A-F of
# docs/benchmarks.md), gateway-compiled-stepfirst the compiled step with each
# request's first token from the batch's next step after its prefill (engine.first_token =
# "step", mlx-lm's way; the default takes it from the prefill), gateway-compiled-early the
# compiled step with a lone request's first token read before the next step is built
# (engine.first_token_read = "early"),
# gateway-compiled-env the same with $GATEWAY_ENV in its environment
# (e.g. GATEWAY_ENV="MLX_MAX_OPS_PER_BUFFER=250": MLX settings under test; gateway-compiled-env2
# reads $GATEWAY_ENV2, and so on, to compare several in one run), gateway-rows-settle
# the rows batch with engine.join_settle_steps = $SETTLE, default 2) and LEVELS_1B / LEVELS_8B
# their concurrency levels (default 1,8,32,64,128 and 1,32,128).
# - 1b / 8b: benchmarks.serving, closed loop, 128-token prompts and outputs: mlx-lm's
#   BatchGenerator in one process (the ceiling), then each of $SOURCES, one after another on
#   the same prompts (each launched once for all levels, every level run once unrecorded
#   first: MLX CUDA compiles kernels on first use of a shape, and a server meets
#   many more batch shapes than the ceiling); the servers' logs land in OUT/1b-logs/ and
#   OUT/8b-logs/.
# - agent / agent8b: benchmarks.agent_session on the 1b / 8b shape: 8 turns over a 4k-token
#   system prompt, 1 and 4 concurrent sessions, the gateway (its defaults) with its prefix
#   cache on and off, mlx_lm server (OUT/agent.json, OUT/agent8b.json, the servers' logs in
#   OUT/agent-logs/ and OUT/agent8b-logs/; AGENT_ARGS="--sources
#   ..." picks others, e.g. gateway-rows-whole: prompts tokenized whole).
# - turns: benchmarks.cached_turns on the 1b shape: the agent trace's lengths in one process,
#   the engine alone with its prefix cache and without, first-token ms per turn (what
#   serving adds to agent's turns: OUT/turns.jsonl, MLX's messages in OUT/turns.log), with
#   MLX as workers run it (off cuDNN's attention), then on cuDNN's
#   (AGENT_ARGS="--sources gateway-rows-cudnn,..." is the same served).
# - kernels: benchmarks.turn_kernels on the 1b shape: the agent trace's cached turns in one
#   process, the device's kernels from each turn's add to its first token (PyTorch's profiler,
#   CUPTI: OUT/kernels.jsonl, MLX's messages in OUT/kernels.log).
# - forward: benchmarks.cached_prefill on the 1b shape: a cached turn's forward pass (16, 128
#   and 250 new tokens on 4,400 cached; plain, on mlx-lm's batch cache and through the
#   prefill buckets) and MLX's attention alone at those shapes (causal, with the batch cache's
#   mask array, over a bucket of keys with the buckets' mask), off cuDNN's attention then on
#   it (OUT/forward.jsonl; MLX's messages in OUT/forward.log).
# - arrivals: benchmarks.arrivals on the 1b shape in one process: mlx-lm's BatchGenerator and
#   the project's rows batch (joins at once and settled) with sequences starting together
#   and spread, and what one join costs each.
# - steps / steps8b: benchmarks.engine_steps on the 1b / 8b shape: the decode step of
#   BatchGenerator alone, of mlx-lm's generate_step (1 row) and of the engine on each batch and
#   decode step, in one process, at 1, 32 and 128 rows ($STEPS_DRIVERS: the drivers;
#   $STEPS_ARGS: more flags, e.g. --ragged for rows of different lengths).
# - shapes: benchmarks.new_shapes on the 1b shape: the first step at a new row count against
#   later ones, mlx-lm's forward pass and the compiled step.
# - prefills: benchmarks.prefill_shapes on the 1b shape, with MLX's cuDNN attention and
#   without (MLX_CUDA_USE_CUDNN_SDPA=1, 0): a joining group's prefill at a shape met for the
#   first time against later ones, and a long prompt's ($PREFILLS_ARGS: more flags).
# - prefill-profile: py-spy --native over benchmarks.prefill_shapes meeting 228 new shapes
#   (rows $PROFILE_ROWS, default 1,2,3,4,6,8, by 90-127 tokens) without cuDNN, $PROFILE_RATE
#   samples a second (default 50: at 200, py-spy fell minutes behind and the step timed out):
#   OUT/prefill-profile.json and, ranked by total share, OUT/prefill-profile.txt.
# - first-use: benchmarks.first_use on the 1b shape: a worker's engine with nothing compiled
#   (empty MLX_PTX_CACHE_DIR and CUDA_CACHE_PATH), its load's probe and 400 requests, then
#   again with what that run kept: OUT/first-use.jsonl ($FIRST_USE_ARGS: more flags).
# - leaving: benchmarks.leaving on the 1b and 8b shapes: rows' KV taken out of a batch for the
#   prefix cache, row by row (mlx-lm's extract) against shelves (a gather, a concatenation).
# - profile: the gateway on the $PROFILE_SHAPE shape (1b or 8b, default 1b) at
#   c=$PROFILE_LEVEL (default 64; max_running $PROFILE_MAX, default the level; engine.batcher
#   $PROFILE_BATCHER, default rows, with engine.decode_step $PROFILE_DECODE, default compiled) while
#   py-spy samples the worker's and the gateway's threads for 20 s, idle time included
#   (OUT/worker-profile.json and OUT/gateway-profile.json, speedscope format, and
#   OUT/profile-summary.txt) after $PROFILE_WARM seconds (default 15) of load; PROFILE_NATIVE=1
#   samples C++ frames too (pausing the process at each sample, which slows its host side),
#   PROFILE_NONBLOCKING=1 Python frames without pausing it; needs py-spy on PATH (a wheel:
#   pip download py-spy).
# INTERLEAVE=1 runs 1b / 8b level by level, every source back to back, in an order reversed on
# every other repeat (with SERVING_ARGS="--repeats N"; each source is then launched for each
# level and repeat): for settings compared within a run.
# STEP_TRACE=1 has the gateways' workers time each engine step (MLX_GATEWAY_STEP_TRACE) in
# 1b / 8b and writes OUT/1b-steps.jsonl / OUT/8b-steps.jsonl (benchmarks.step_trace: per
# source and level, the wall time in steps, between them and with the batch empty), and the
# traces themselves to OUT/1b-trace/ / OUT/8b-trace/.
set -euo pipefail
OUT=${1:?usage: benchmarks/h200.sh OUT [1b] [8b] [agent]}
shift
STEPS=${*:-1b 8b agent}
LEVEL_PROFILE=${PROFILE_LEVEL:-64}
PY=${PYTHON:-python3}
SOURCES=${SOURCES:-gateway-compiled,mlx_lm}
M=${MODELS:-/tmp/models}
mkdir -p "$OUT" "$M"

if [ "${SMALL:-0}" = 1 ]; then
  SHAPE_1B="--hidden 128 --layers 4 --heads 4 --kv-heads 2 --intermediate 256 --vocab 2048"
  SHAPE_8B="--hidden 192 --layers 6 --heads 6 --kv-heads 2 --intermediate 384 --vocab 2048"
  LEVELS_1B=1,4 LEVELS_8B=1,4 AGENT_SYSTEM=512 AGENT_TURNS=3 LEVEL_PROFILE=4
  LEVELS_ARRIVALS=4 ARRIVALS_REQUESTS=16 ROWS_STEPS=1,4
else
  SHAPE_1B="--hidden 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 128256"
  SHAPE_8B="--hidden 4096 --layers 32 --heads 32 --kv-heads 8 --intermediate 14336 --vocab 128256"
  LEVELS_1B=${LEVELS_1B:-1,8,32,64,128} LEVELS_8B=${LEVELS_8B:-1,32,128}
  AGENT_SYSTEM=4096 AGENT_TURNS=8
  LEVELS_ARRIVALS=64,128 ARRIVALS_REQUESTS=512 ROWS_STEPS=${ROWS_STEPS:-1,32,128}
fi

model() {  # NAME SHAPE...
  local name=$1
  shift
  [ -f "$M/$name/model.safetensors" ] ||
    $PY -m worker.modelgen "$M/$name" "$@" --max-position 16384 --dtype bfloat16 >&2
  echo "$M/$name"
}

gateway_config() {  # MODEL_DIR MAX_CONCURRENCY [BATCHER] [SETTLE] [DECODE_STEP] [ATTENTION] [PROJECTIONS] [PREFILL_SHAPES] [FIRST_TOKEN] [FIRST_TOKEN_READ] -> config path; the ceiling's batch sizes
  local cfg run
  cfg=$(mktemp /tmp/gw-XXXX.toml)
  run=$(mktemp -d /tmp/gwXXXX)
  cat >"$cfg" <<TOML
[server]
host = "127.0.0.1"
run_dir = "$run"

[[models]]
name = "bench"
source = "$1"
[models.engine]
max_running = $2
prefill_batch_size = $2
max_prefill_tokens = 65536
batcher = "${3:-mlx_lm}"
join_settle_steps = ${4:-0}
decode_step = "${5:-model}"
decode_attention = "${6:-auto}"
decode_projections = "${7:-separate}"
prefill_shapes = "${8:-auto}"
first_token = "${9:-auto}"
first_token_read = "${10:-pipelined}"
TOML
  echo "$cfg"
}

throughput() {  # NAME SHAPE LEVELS: the ceiling, then each of $SOURCES
  local dir max src cfg
  local -a launch=()
  dir=$(model "$1" $2)
  max=${3##*,}
  for src in ${SOURCES//,/ }; do
    case $src in
      gateway | gateway-rows | gateway-rows-settle | gateway-compiled | gateway-compiled-mask | gateway-compiled-stacked | gateway-compiled-buckets | gateway-compiled-exact | gateway-compiled-stepfirst | gateway-compiled-early | gateway-compiled-env*)
        local env=""
        case $src in
          gateway) cfg=$(gateway_config "$dir" "$max" mlx_lm) ;;
          gateway-rows) cfg=$(gateway_config "$dir" "$max" rows 0 model) ;;
          gateway-compiled) cfg=$(gateway_config "$dir" "$max" rows 0 compiled) ;;
          gateway-compiled-mask) cfg=$(gateway_config "$dir" "$max" rows 0 compiled mlx) ;;
          gateway-compiled-stacked) cfg=$(gateway_config "$dir" "$max" rows 0 compiled auto stacked) ;;
          gateway-compiled-buckets) cfg=$(gateway_config "$dir" "$max" rows 0 compiled auto separate buckets) ;;
          gateway-compiled-exact) cfg=$(gateway_config "$dir" "$max" rows 0 compiled auto separate exact) ;;
          gateway-compiled-stepfirst) cfg=$(gateway_config "$dir" "$max" rows 0 compiled auto separate auto step) ;;
          gateway-compiled-early) cfg=$(gateway_config "$dir" "$max" rows 0 compiled auto separate auto auto early) ;;
          gateway-compiled-env*)  # gateway-compiled-envX reads GATEWAY_ENVX
            local var=GATEWAY_ENV${src#gateway-compiled-env}
            cfg=$(gateway_config "$dir" "$max" rows 0 compiled)
            [ -n "${!var:-}" ] || { echo "$src needs $var" >&2; exit 2; }
            env="env ${!var} "
            ;;
          *) cfg=$(gateway_config "$dir" "$max" rows "${SETTLE:-2}") ;;
        esac
        launch+=(--launch-cmd "$src=$env{python} -m gateway --config $cfg serve --port {port}"
          --served-model "$src=bench")
        ;;
      mlx_lm)
        launch+=(--launch-cmd "mlx_lm={python} -m mlx_lm server --model {model} --host 127.0.0.1 --port {port} --decode-concurrency {max_concurrency} --prompt-concurrency {max_concurrency} --log-level WARNING")
        ;;
      *) echo "unknown source $src" >&2; exit 2 ;;
    esac
  done
  local trace=/tmp/steptrace-$1
  rm -rf "$trace"
  if [ "${STEP_TRACE:-0}" = 1 ]; then export MLX_GATEWAY_STEP_TRACE=$trace; fi
  local order=--no-interleave  # INTERLEAVE=1: level by level, the order reversed each repeat
  [ "${INTERLEAVE:-0}" = 1 ] && order=""
  $PY -m benchmarks.serving --model "$dir" --inprocess "${launch[@]}" \
    --concurrency "$3" --min-requests 16 $order \
    --steal-retries 0 --wait-idle 0 --warm-levels --log-dir "$OUT/$1-logs" ${SERVING_ARGS:-} --out "$OUT/$1.json" 2>&1 |
    tee "$OUT/$1.log"
  unset MLX_GATEWAY_STEP_TRACE
  if [ "${STEP_TRACE:-0}" = 1 ]; then
    $PY -m benchmarks.step_trace "$trace" --serving "$OUT/$1.json" | tee "$OUT/$1-steps.jsonl"
    cp -r "$trace" "$OUT/$1-trace"
  fi
}

profile() {  # the worker's threads sampled by py-spy while the gateway serves c=LEVEL_PROFILE
  local dir cfg port gw worker
  local native=""
  [ "${PROFILE_NATIVE:-0}" = 1 ] && native=--native  # C++ frames too (MLX's waits)
  # sampling without pausing the process (a paused engine thread makes the host look slower)
  if [ "${PROFILE_NONBLOCKING:-0}" = 1 ]; then
    if [ -n "$native" ]; then
      echo "PROFILE_NATIVE and PROFILE_NONBLOCKING: py-spy samples C++ frames only by pausing" >&2
      exit 2
    fi
    native=--nonblocking
  fi
  if [ "${PROFILE_SHAPE:-1b}" = 8b ]; then dir=$(model 8b $SHAPE_8B); else dir=$(model 1b $SHAPE_1B); fi
  cfg=$(gateway_config "$dir" "${PROFILE_MAX:-$LEVEL_PROFILE}" "${PROFILE_BATCHER:-rows}" 0 \
    "${PROFILE_DECODE:-compiled}")
  port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  $PY -m gateway --config "$cfg" serve --port "$port" >"$OUT/profile-gateway.log" 2>&1 &
  gw=$!
  for _ in $(seq 300); do
    worker=$(pgrep -f -- "-m worker --id" | head -1 || true)
    [ -n "$worker" ] && curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
    sleep 1
  done
  $PY -m benchmarks.serving --target "gateway=http://127.0.0.1:$port" --tokenizer "$dir" \
    --served-model gateway=bench --concurrency "$LEVEL_PROFILE" --requests $((LEVEL_PROFILE * 40 > 400 ? LEVEL_PROFILE * 40 : 400)) \
    --wait-idle 0 --out "$OUT/profile-load.json" >"$OUT/profile-load.log" 2>&1 &
  local load=$!
  sleep "${PROFILE_WARM:-15}"  # the warm-up and the first waves: kernels compiled, the batch full
  local app
  app=$(ps -o ppid= -p "$worker" | tr -d ' ')  # the app process (Granian's child) spawned it
  py-spy record --pid "$app" --duration 20 --rate 250 --threads --idle $native --format speedscope \
    --output "$OUT/gateway-profile.json" >"$OUT/profile-pyspy-gateway.log" 2>&1 &
  local spy=$!
  py-spy record --pid "$worker" --duration 20 --rate 250 --threads --idle $native --format speedscope \
    --output "$OUT/worker-profile.json" >"$OUT/profile-pyspy.log" 2>&1 || true
  wait "$spy" || true
  for who in worker gateway; do
    [ -f "$OUT/$who-profile.json" ] && $PY -m benchmarks.profile_summary \
      "$OUT/$who-profile.json" >>"$OUT/profile-summary.txt"
  done
  kill "$load" 2>/dev/null || true  # enough: its figures are not the point here
  wait "$load" || true
  kill "$gw"
  wait "$gw" || true
}

for step in $STEPS; do
  case $step in
    1b) throughput 1b "$SHAPE_1B" "$LEVELS_1B" ;;
    8b) throughput 8b "$SHAPE_8B" "$LEVELS_8B" ;;
    agent | agent8b)
      if [ "$step" = agent ]; then dir=$(model 1b $SHAPE_1B); else dir=$(model 8b $SHAPE_8B); fi
      $PY -m benchmarks.agent_session --model "$dir" \
        --sources gateway-rows,gateway-rows-nocache,mlx_lm --sessions 1,4 --turns "$AGENT_TURNS" \
        --system-tokens "$AGENT_SYSTEM" --wait-idle 0 --baseline gateway-rows --log-dir "$OUT/$step-logs" \
        ${AGENT_ARGS:-} --out "$OUT/$step.json" 2>&1 |
        tee "$OUT/$step.log"
      ;;
    turns)  # as workers run MLX (off cuDNN's attention), then on it
      : >"$OUT/turns.jsonl"
      for cudnn in 0 1; do
        MLX_CUDA_USE_CUDNN_SDPA=$cudnn $PY -m benchmarks.cached_turns "$(model 1b $SHAPE_1B)" \
          --system "$AGENT_SYSTEM" --turns "$AGENT_TURNS" 2>>"$OUT/turns.log" |
          tee -a "$OUT/turns.jsonl"
      done
      ;;
    kernels)
      $PY -m benchmarks.turn_kernels "$(model 1b $SHAPE_1B)" --system "$AGENT_SYSTEM" \
        --turns "$AGENT_TURNS" 2>"$OUT/kernels.log" | tee "$OUT/kernels.jsonl"
      ;;
    forward)
      : >"$OUT/forward.jsonl"
      for cudnn in 0 1; do
        MLX_CUDA_USE_CUDNN_SDPA=$cudnn $PY -m benchmarks.cached_prefill "$(model 1b $SHAPE_1B)" \
          2>>"$OUT/forward.log" | tee -a "$OUT/forward.jsonl"
      done
      ;;
    arrivals)
      $PY -m benchmarks.arrivals "$(model 1b $SHAPE_1B)" --concurrency "$LEVELS_ARRIVALS" \
        --requests "$ARRIVALS_REQUESTS" --batchers mlx_lm,rows --settle 0,2 2>&1 |
        tee "$OUT/arrivals.jsonl"
      $PY -m benchmarks.arrivals "$(model 1b $SHAPE_1B)" --modes join --concurrency 48 \
        --join 1,16,64 --batchers mlx_lm,rows 2>&1 | tee -a "$OUT/arrivals.jsonl"
      ;;
    steps | steps8b)
      if [ "$step" = steps ]; then dir=$(model 1b $SHAPE_1B); else dir=$(model 8b $SHAPE_8B); fi
      $PY -m benchmarks.engine_steps "$dir" --rows "$ROWS_STEPS" \
        --max-running "${ROWS_STEPS##*,}" ${STEPS_DRIVERS:+--drivers $STEPS_DRIVERS} ${STEPS_ARGS:-} 2>&1 |
        tee "$OUT/$step.jsonl"
      ;;
    prefills)  # cuDNN's attention (MLX's default on CUDA) and MLX's separate operations
      for cudnn in 1 0; do
        MLX_CUDA_USE_CUDNN_SDPA=$cudnn $PY -m benchmarks.prefill_shapes "$(model 1b $SHAPE_1B)" \
          ${PREFILLS_ARGS:-} 2>&1 | tee -a "$OUT/prefills.jsonl"
      done
      ;;
    prefill-profile)  # where new shapes' prefills go, C++ frames included (workers' setting)
      MLX_CUDA_USE_CUDNN_SDPA=0 py-spy record --native --rate "${PROFILE_RATE:-50}" --format speedscope \
        --output "$OUT/prefill-profile.json" -- $PY -m benchmarks.prefill_shapes \
        "$(model 1b $SHAPE_1B)" --long 0 --again 0 --rows "${PROFILE_ROWS:-1,2,3,4,6,8}" \
        --lengths "$(seq -s, 90 127)" >"$OUT/prefill-profile.log" 2>&1 || true
      [ -f "$OUT/prefill-profile.json" ] && $PY -m benchmarks.profile_summary \
        "$OUT/prefill-profile.json" --by total --under prefill_ms --top 80 >"$OUT/prefill-profile.txt"
      ;;
    first-use)  # nothing compiled, then what that run kept
      ptx=$(mktemp -d /tmp/ptx-XXXX)
      driver=$(mktemp -d /tmp/nv-XXXX)
      for run in fresh cached; do
        CUDA_CACHE_PATH=$driver $PY -m benchmarks.first_use "$(model 1b $SHAPE_1B)" \
          --ptx-cache "$ptx" --label $run ${FIRST_USE_ARGS:-} | tee -a "$OUT/first-use.jsonl"
      done
      rm -rf "$ptx" "$driver"
      ;;
    shapes)
      $PY -m benchmarks.new_shapes "$(model 1b $SHAPE_1B)" ${SHAPES_ARGS:-} 2>&1 | tee "$OUT/shapes.jsonl"
      ;;
    leaving)
      for size in 1b 8b; do
        if [ $size = 1b ]; then dir=$(model 1b $SHAPE_1B); else dir=$(model 8b $SHAPE_8B); fi
        $PY -m benchmarks.leaving "$dir" ${LEAVING_ARGS:-} 2>&1 | tee -a "$OUT/leaving.jsonl"
      done
      ;;
    profile) profile ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
