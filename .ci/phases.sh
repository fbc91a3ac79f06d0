#!/usr/bin/env bash
# Runs each phase given as "NAME=COMMAND", in turn, every one whatever the earlier ones gave, then
# prints one line per phase (passed or FAILED, and its time) and the total time. Exit status 1
# when any phase failed, 0 when all passed. `make test` runs its phases through it.
set -u
duration() {
  local s=$1
  if ((s >= 60)); then printf '%d min %02d s' $((s / 60)) $((s % 60)); else printf '%d s' "$s"; fi
}
start=$SECONDS
lines=()
failed=()
for spec in "$@"; do
  name=${spec%%=*}
  command=${spec#*=}
  echo "=== $name: $command"
  began=$SECONDS
  if bash -c "$command"; then result=passed; else result=FAILED; failed+=("$name"); fi
  lines+=("$(printf '%-16s %-7s %s' "$name" "$result" "$(duration $((SECONDS - began)))")")
done
echo "=== ${#lines[@]} phases in $(duration $((SECONDS - start))):"
printf '  %s\n' "${lines[@]}"
if ((${#failed[@]})); then
  echo "FAILED: $(IFS=,; echo "${failed[*]}" | sed 's/,/, /g')"
  exit 1
fi
echo "all passed"
