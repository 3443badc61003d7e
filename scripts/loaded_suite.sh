#!/usr/bin/env bash
# The fast suite N times in a row on a fresh clone of HEAD while two CPU-bound processes run
# beside it (issue 17's flake check). Usage: scripts/loaded_suite.sh [N=5] [DIR=runs/loaded-suite]
# The clone, the burners and each round's log live under DIR (ignored); one line per round on
# stdout, then a JSON summary. Stops at the first failing round. The burners stop on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
dir=${2:-runs/loaded-suite}
commit=$(git rev-parse HEAD)
rm -rf "$dir"
mkdir -p "$dir"
git clone -q . "$dir/clone"
git -C "$dir/clone" checkout -q "$commit"
burners=()
for _ in 1 2; do python3 -c "while True: pass" & burners+=($!); done
trap 'kill "${burners[@]}" 2>/dev/null || true' EXIT
start=$(date +%s)
(cd "$dir/clone" && bash scripts/setup.sh) > "$dir/setup.log" 2>&1
setup_s=$(( $(date +%s) - start ))
echo "setup: ${setup_s}s (beside 2 burners)"
passed=0; times=()
for round in $(seq 1 "$rounds"); do
  t0=$(date +%s)
  if (cd "$dir/clone" && bash .ci/run) > "$dir/round-$round.log" 2>&1; then status=pass; else status=fail; fi
  took=$(( $(date +%s) - t0 )); times+=("$took")
  echo "round $round: $status in ${took}s: $(tail -n 1 "$dir/round-$round.log")"
  [ "$status" = pass ] || break
  passed=$((passed + 1))
done
printf '{"commit": "%s", "rounds": %d, "passed_in_a_row": %d, "seconds": [%s], "setup_s": %d, "burners": 2}\n' \
  "$commit" "$rounds" "$passed" "$(IFS=,; echo "${times[*]}")" "$setup_s"
[ "$passed" = "$rounds" ]
