# shellcheck shell=bash
# device_check.sh's main: the dry run (--dry-run) and the run of every step under its limit.
# Sourced by benchmarks/device_check.sh (which sets STEPS, BUDGET_S, GRACE_S, SELF and ROOT); defines
# functions only.

dry_run() {
    local entry name limit i=0 sum=0 missing=0 fn
    echo "device_check dry run: ${#STEPS[@]} steps"
    for entry in "${STEPS[@]}"; do
        read -r name limit <<<"$entry"
        i=$((i + 1))
        fn="step_${name//-/_}"
        if ! declare -F "$fn" >/dev/null; then
            echo "  no function $fn for step $name"
            missing=1
        fi
        printf '  %02d %-20s %4d s\n' "$i" "$name" "$limit"
        sum=$((sum + limit + GRACE_S))
    done
    echo "CUDA tests (step pytest-cuda):"
    cuda_tests | sed 's/^/  /'
    if [ "$sum" -lt "$BUDGET_S" ]; then
        echo "total: $sum s with ${GRACE_S} s kill grace per step (budget $BUDGET_S s): OK"
    else
        echo "total: $sum s with ${GRACE_S} s kill grace per step (budget $BUDGET_S s): OVER BUDGET"
        return 1
    fi
    return $missing
}

main() {
    local report=${1:-${OUT:-./device-report}}
    mkdir -p "$report/logs" || exit 1
    REPORT=$(cd "$report" && pwd)
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/hyssm-device-check.XXXXXX") || exit 1
    PY=$(pick_python)
    STARTED=$(date -u +%Y-%m-%dT%H:%M:%S)
    export REPORT WORK PY STARTED
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    cd "$ROOT" || exit 1
    : >"$REPORT/steps.tsv"
    : >"$WORK/pgids"
    local entry name limit i=0 log t0 rc wall pg
    for entry in "${STEPS[@]}"; do
        read -r name limit <<<"$entry"
        i=$((i + 1))
        log=$(printf 'logs/%02d-%s.log' "$i" "$name")
        echo "== [$i/${#STEPS[@]}] $name (limit $limit s)"
        t0=$(now_ns)
        timeout -k "$GRACE_S" "$limit" bash "$SELF" --step "$name" >"$REPORT/$log" 2>&1 </dev/null
        rc=$?
        wall=$(awk -v a="$t0" -v b="$(now_ns)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
        while read -r pg; do  # a server whose step was killed before it could stop it
            [ -n "$pg" ] && kill -KILL -- "-$pg" 2>/dev/null
        done <"$WORK/pgids"
        : >"$WORK/pgids"
        printf '%02d\t%s\t%s\t%s\t%s\t%s\n' "$i" "$name" "$limit" "$rc" "$wall" "$log" >>"$REPORT/steps.tsv"
        echo "   $(result_of "$rc" "$wall" "$limit") rc=$rc ${wall}s"
        write_report
    done
    rm -rf "$WORK"
    echo "report: $REPORT/report.md"
}
