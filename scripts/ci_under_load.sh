#!/usr/bin/env bash
# CI as a user's busy machine runs it (issue 29, item 3): clone main into a new folder and run
# `bash .ci/run` there while a `nice -n 19` busy loop occupies every core; RUNS times in a row,
# each in a fresh clone, stopping at the first failure. One summary line per run:
#   run 1/5 at abc1234: rc=0 1234 s, 1180 passed, 4 skipped in 1010.12s (log: /tmp/.../ci.log)
#
#   scripts/ci_under_load.sh [RUNS=1] [SOURCE=this checkout] [BRANCH=main]
set -uo pipefail
runs=${1:-1}
source=${2:-$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)}
branch=${3:-main}
burners=()
stop_burners() {
  for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null; done
  wait "${burners[@]}" 2>/dev/null
  burners=()
}
trap stop_burners EXIT INT TERM

for i in $(seq 1 "$runs"); do
  dir=$(mktemp -d /tmp/shellrl-ci-under-load-XXXXXX)
  git clone -q --branch "$branch" "$source" "$dir/shellrl" || exit 2
  commit=$(git -C "$dir/shellrl" rev-parse --short HEAD)
  for _ in $(seq 1 "$(nproc)"); do
    nice -n 19 sh -c 'while :; do :; done' &
    burners+=($!)
  done
  start=$(date +%s)
  (cd "$dir/shellrl" && bash .ci/run) >"$dir/ci.log" 2>&1
  rc=$?
  stop_burners
  summary=$(grep -E "(passed|failed|error).* in [0-9.]+s" "$dir/ci.log" | tail -1)
  echo "run $i/$runs at $commit: rc=$rc $(( $(date +%s) - start )) s, ${summary:-no pytest summary} (log: $dir/ci.log)"
  if [ "$rc" -ne 0 ]; then
    exit 1
  fi
  rm -rf "$dir/shellrl"  # the log stays
done
