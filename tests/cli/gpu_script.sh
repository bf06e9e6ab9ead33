#!/usr/bin/env bash
# scripts/gpu, the GPU machine's entry point, checked where there is no GPU: it parses, `help`
# lists every subcommand and exits 0, an unknown subcommand or a bad argument exits 2 with one
# `error:` line on stderr (before any build), and shellcheck finds nothing when it is installed.
#   bash tests/cli/gpu_script.sh [repository root]
set -euo pipefail
root="${1:-$(dirname "$0")/../..}"
script="$root/scripts/gpu"
subcommands=(check test quick backward bench sweep dims cudnn qualify-cudnn sanitize paged inference
  python jit profile kernel-times env help)
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# Nothing below gets past argument parsing; should something, its output stays in the scratch.
export FLEXATTN_GPU_OUT="$scratch/out"
failures=0

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# Runs scripts/gpu with the arguments; sets code, and stdout/stderr in the scratch folder.
run_gpu() {
  code=0
  timeout 30 bash "$script" "$@" > "$scratch/stdout" 2> "$scratch/stderr" || code=$?
}

# Exit 2 and exactly one line on stderr, starting `error:`.
expect_usage_error() {  # DESCRIPTION
  local lines
  lines=$(wc -l < "$scratch/stderr")
  if [[ "$code" != 2 ]]; then fail "$1: exit $code, expected 2"; fi
  if [[ "$lines" != 1 ]] || ! grep -q '^error: ' "$scratch/stderr"; then
    fail "$1: stderr is not one 'error:' line:"
    cat "$scratch/stderr"
  fi
}

bash -n "$script" || fail "bash -n scripts/gpu"

run_gpu help
[[ "$code" == 0 ]] || fail "help: exit $code, expected 0"
for subcommand in "${subcommands[@]}"; do
  grep -qE "^  $subcommand( |$)" "$scratch/stdout" || fail "help does not list '$subcommand'"
done
[[ ! -s "$scratch/stderr" ]] || fail "help wrote to stderr"

run_gpu
[[ "$code" == 0 ]] || fail "no arguments: exit $code, expected 0"
grep -q '^usage: ' "$scratch/stdout" || fail "no arguments: no usage"

run_gpu no-such-subcommand
expect_usage_error "an unknown subcommand"
grep -q '^usage: ' "$scratch/stdout" || fail "an unknown subcommand: no usage"

# Every subcommand that takes options refuses one it does not know.
for subcommand in check quick backward bench sweep dims cudnn qualify-cudnn env paged jit \
  inference; do
  run_gpu "$subcommand" --no-such-option
  expect_usage_error "$subcommand --no-such-option"
done
run_gpu test
expect_usage_error "test without a program"
run_gpu test test_cuda_forward --unfinished -- '*'
expect_usage_error "test with --unfinished and a filter"
grep -q 'exclude each other' "$scratch/stderr" || fail "test --unfinished -- FILTER: wrong error"
run_gpu test test_no_such_program --unfinished
expect_usage_error "test --unfinished with nothing recorded"
grep -q 'no unfinished tests of test_no_such_program' "$scratch/stderr" ||
  fail "test --unfinished with nothing recorded: wrong error"
run_gpu sanitize test_cuda_forward
expect_usage_error "sanitize without a filter"
run_gpu jit --repeats 0
expect_usage_error "jit with a bad --repeats"
run_gpu dims --pass sideways
expect_usage_error "dims with a bad --pass"
run_gpu dims --head-dims 256,x
expect_usage_error "dims with a bad --head-dims"

# scripts/sanitizer-summary on logs shaped as compute-sanitizer writes them: memcheck clean,
# racecheck clean (its summary counts hazards, then errors), racecheck with errors, and a run
# stopped before its summary. Only the clean ones count; the others name their tests.
summary="$root/scripts/sanitizer-summary"
logs="$scratch/sanitizer"
mkdir -p "$logs"
printf '%s\n' '[ RUN      ] A.one' '[       OK ] A.one (5 ms)' \
  '========= ERROR SUMMARY: 0 errors' > "$logs/memcheck-clean"
printf '%s\n' '[ RUN      ] A.two' \
  '========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)' > "$logs/race-clean"
printf '%s\n' '[ RUN      ] B.one' '[ RUN      ] B.two' \
  '========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)' > "$logs/race-errors"
printf '%s\n' '[ RUN      ] C.one' 'flexattn: stopped at the deadline (100 s)' > "$logs/stopped"
code=0
bash "$summary" "$logs"/memcheck-clean "$logs"/race-clean > "$scratch/stdout" || code=$?
[[ "$code" == 0 ]] || fail "sanitizer-summary, clean logs: exit $code, expected 0"
grep -qx '2 of 2 clean' "$scratch/stdout" || fail "sanitizer-summary does not count 2 clean logs"
code=0
bash "$summary" "$logs"/* > "$scratch/stdout" || code=$?
[[ "$code" == 1 ]] || fail "sanitizer-summary, logs with errors: exit $code, expected 1"
grep -qx '2 of 4 clean' "$scratch/stdout" || fail "sanitizer-summary does not count 2 of 4 clean"
grep -qx 'race-errors: RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings); tests: B.one B.two' \
  "$scratch/stdout" || fail "sanitizer-summary does not name the racecheck errors and their tests"
grep -qx 'stopped: no summary (stopped or crashed); tests: C.one' "$scratch/stdout" ||
  fail "sanitizer-summary does not name a log without a summary"
if [[ "${failures}" != 0 ]]; then cat "$scratch/stdout"; fi

# scripts/gtest-unfinished: the listed tests without a verdict in the logs (a parameterised test's
# FAILED line names it before ", where"); the one running at the deadline and the ones never
# started are unfinished, a failed one is not.
unfinished="$root/scripts/gtest-unfinished"
printf '%s\n' 'Running main() from gtest_main.cc' 'Cache.' '  Compiles' '  Corrupt' \
  'Matrix/Conformance.' '  Forward/a_case  # GetParam() = a' '  Forward/b_case  # GetParam() = b' \
  '  Forward/c_case  # GetParam() = c' > "$logs/list"
printf '%s\n' '[ RUN      ] Cache.Compiles' '[       OK ] Cache.Compiles (5 ms)' \
  '[ RUN      ] Matrix/Conformance.Forward/a_case' \
  '[  FAILED  ] Matrix/Conformance.Forward/a_case, where GetParam() = a (3 ms)' \
  '[ RUN      ] Matrix/Conformance.Forward/b_case' 'flexattn: stopped at the deadline (100 s)' \
  '[  FAILED  ] 1 test, listed below:' > "$logs/shard-0"
printf '%s\n' '[ RUN      ] Cache.Corrupt' '[  SKIPPED ] Cache.Corrupt (0 ms)' > "$logs/shard-1"
bash "$unfinished" "$logs/list" "$logs/shard-0" "$logs/shard-1" > "$scratch/stdout" ||
  fail "gtest-unfinished: exit $?"
printf '%s\n' 'Matrix/Conformance.Forward/b_case' 'Matrix/Conformance.Forward/c_case' |
  cmp -s - "$scratch/stdout" || { fail "gtest-unfinished lists:"; cat "$scratch/stdout"; }


if command -v shellcheck > /dev/null; then
  shellcheck "$script" "$summary" "$unfinished" "$0" || fail "shellcheck"
else
  echo "shellcheck is not installed: skipped"
fi

[[ ! -e "$FLEXATTN_GPU_OUT" ]] || fail "a refused command wrote to its output folder"
if (( failures )); then
  echo "$failures failed"
  exit 1
fi
echo "scripts/gpu: all checks passed"
