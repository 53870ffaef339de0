#!/usr/bin/env bash
# Runs scripts/sanitize_cases.py (every kernel family on small, odd and tail-heavy shapes, each
# output checked against the reference) under compute-sanitizer's tools, and prints one line per
# tool. Exits 1 if any tool reports an error or any output differs from the reference.
#
#   scripts/sanitize.sh                      # memcheck racecheck initcheck synccheck
#   scripts/sanitize.sh memcheck racecheck   # a subset
#   SANITIZE_ARGS="--family mx,weight" scripts/sanitize.sh memcheck
#
# Environment: PYTHON (default python3), COMPUTE_SANITIZER (the binary; default: PATH, then the
# CUDA toolkit folders), SANITIZE_LOG_DIR (full logs; default /tmp/cupyquant-sanitize),
# SANITIZE_ARGS (passed to sanitize_cases.py). Needs a GPU machine whose runtime lets the sanitizer
# attach (not gVisor).
#
# Flags, and why:
#   --error-exitcode 86      a sanitizer finding exits 86, told apart from a byte mismatch (3)
#   --report-api-errors no   CuPy and NVRTC probe the driver with calls that fail by design (symbol
#                            and attribute look-ups); a failed launch still surfaces as a Python
#                            exception, so nothing real hides behind this
#   --print-limit 50         a systematic bug repeats in every thread; the summary counts them all
#   memcheck --padding 512   (when this sanitizer has the flag) a guard zone after each allocation,
#                            so a small overrun cannot land in the neighbouring array
#   initcheck                unused-memory tracking stays at its default (off): allocations that a
#                            tensor's padding leaves unread are not errors. The driver turns CuPy's
#                            memory pool off, so every output starts uninitialized and no pool block
#                            counts as written by an earlier array.
#   racecheck                shared-memory hazards; the summary line gives errors and warnings, and
#                            only errors fail the run
#   positive controls        after each tool's run, sanitize_cases.py --control TOOL launches one
#                            deliberately broken kernel (out-of-bounds write, uninitialized read,
#                            shared-memory race, divergent barrier); the tool must report it, so a
#                            clean line cannot come from a sanitizer that never saw our kernels
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
LOGDIR=${SANITIZE_LOG_DIR:-/tmp/cupyquant-sanitize}
mkdir -p "$LOGDIR"
read -r -a CASE_ARGS <<<"${SANITIZE_ARGS:-}"
tools=("$@")
[ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck initcheck synccheck)

SAN=${COMPUTE_SANITIZER:-}
if [ -z "$SAN" ]; then
    SAN=$(command -v compute-sanitizer || true)
    for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
             /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/compute-sanitizer/compute-sanitizer; do
        if [ -z "$SAN" ] && [ -x "$c" ]; then SAN=$c; fi
    done
fi
if [ -z "$SAN" ] || [ ! -x "$SAN" ]; then
    echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
    exit 2
fi
echo "sanitize: $("$SAN" --version 2>/dev/null | grep -iE 'version' | head -1) at $SAN; logs in $LOGDIR"

help=$("$SAN" --help 2>&1 || true)
memcheck_flags=()
if grep -q -- '--padding' <<<"$help"; then memcheck_flags+=(--padding 512); fi

failed=()

# A plain run first: it compiles every kernel into CuPy's disk cache (so the sanitized runs load
# cached binaries) and checks the bytes without instrumentation.
start=$SECONDS
"$PY" scripts/sanitize_cases.py "${CASE_ARGS[@]}" >"$LOGDIR/plain.log" 2>&1
rc=$?
line=$(grep -E '^sanitize_cases:' "$LOGDIR/plain.log" | tail -1)
if [ $rc -eq 0 ]; then status=OK; else status="FAIL (exit $rc)"; failed+=(plain); fi
printf '%-10s %-28s %5ss  %s\n' plain "$status" $((SECONDS - start)) "${line:-no summary; see $LOGDIR/plain.log}"
if [ $rc -ne 0 ] && [ $rc -ne 3 ]; then
    tail -20 "$LOGDIR/plain.log"
    echo "sanitize: the plain run failed; not starting the sanitizer" >&2
    exit 1
fi

for tool in "${tools[@]}"; do
    case "$tool" in
        memcheck) flags=("${memcheck_flags[@]}") ;;
        racecheck | initcheck | synccheck) flags=() ;;
        *) echo "sanitize: unknown tool $tool" >&2; failed+=("$tool"); continue ;;
    esac
    log="$LOGDIR/$tool.log"
    start=$SECONDS
    "$SAN" --tool "$tool" --error-exitcode 86 --report-api-errors no --print-limit 50 "${flags[@]}" \
        "$PY" scripts/sanitize_cases.py "${CASE_ARGS[@]}" >"$log" 2>&1
    rc=$?
    summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | sed -E 's/^=+ *//' | paste -sd ';' -)
    cases=$(grep -E '^sanitize_cases:' "$log" | tail -1 | sed -E 's/^sanitize_cases: [^:]*: //')
    case $rc in
        0) status=OK ;;
        86) status="FAIL (sanitizer errors)" ;;
        3) status="FAIL (bytes differ)" ;;
        *) status="FAIL (exit $rc)" ;;
    esac
    if [ $rc -eq 0 ] && [ -z "$summary" ]; then status="FAIL (no sanitizer summary)"; fi
    # the positive control: a deliberately broken kernel that this tool must report (exit 86)
    "$SAN" --tool "$tool" --error-exitcode 86 --report-api-errors no --print-limit 5 "${flags[@]}" \
        "$PY" scripts/sanitize_cases.py --control "$tool" >"$LOGDIR/$tool.control.log" 2>&1
    crc=$?
    if [ $crc -eq 86 ]; then control="control caught"; else control="CONTROL MISSED (exit $crc)"; status="FAIL (control missed)"; fi
    printf '%-10s %-28s %5ss  %s | %s | %s\n' "$tool" "$status" $((SECONDS - start)) "${summary:-no summary}" "${cases:-no cases line}" "$control"
    [ "$status" != OK ] && failed+=("$tool")
    if [ "$status" != OK ]; then
        grep -m 5 -E '^=+ +(Invalid|Uninitialized|Error|Race|Barrier|Program hit|.*[Hh]azard)' "$log" | sed 's/^/    /'
        grep -m 5 'MISMATCH' "$log" | sed 's/^/    /'
    fi
done

if [ ${#failed[@]} -eq 0 ]; then
    echo "sanitize: clean (${tools[*]})"
    exit 0
fi
echo "sanitize: FAILED: ${failed[*]} (logs in $LOGDIR)"
exit 1
