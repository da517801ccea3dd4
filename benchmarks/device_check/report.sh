# shellcheck shell=bash
# device_check.sh's report: REPORT_DIR/report.md from REPORT_DIR/steps.tsv and each step's log.
# Sourced by benchmarks/device_check.sh (which sets STEPS, BUDGET_S, GRACE_S, SELF and ROOT); defines
# functions only.

summary_of() {  # summary_of NAME LOG : the lines of a step's log worth reading in report.md
    local name=$1 log=$2
    case "$name" in
        pytest-*)
            grep -E '^(FAILED|ERROR|SKIPPED|XFAIL|XPASS)|pytest-timeout is not|Timeout|^=+ .*(passed|failed|error|no tests ran|skipped).* =+$' "$log" | tail -n 60
            if ! grep -qE '^=+ .* in [0-9.]+s.* =+$' "$log"; then  # cut short: where it was
                echo "(no pytest summary line; the log ends:)"
                tail -n 20 "$log"
            fi
            ;;
        env | nvidia-smi) head -n 60 "$log" ;;
        bench-kernels) tr '\r' '\n' <"$log" | grep -v '^[[:space:]]*$' | tail -n 70 ;;
        *) tr '\r' '\n' <"$log" | grep -vE '^[[:space:]]*$|[0-9]+%\|' | tail -n 30 ;;
    esac
}

result_of() {  # result_of RC WALL LIMIT
    case "$1" in
        0) echo ok ;;
        124) echo TIMEOUT ;;
        137) if awk -v w="$2" -v l="$3" 'BEGIN { exit !(w + 0.5 >= l) }'; then echo TIMEOUT; else echo "KILLED"; fi ;;
        *) echo FAIL ;;
    esac
}

write_report() {
    local md="$REPORT/report.md" total=0 n_ok=0 n_bad=0 name limit rc wall log res env_log
    env_log=$(ls "$REPORT"/logs/*-env.log 2>/dev/null | head -n 1)
    {
        echo "# hyssm device check"
        echo
        echo "- started: $STARTED (UTC), host $(hostname), repo $ROOT"
        if [ -n "$env_log" ]; then
            grep -E '^(commit|torch|cuda_available|gpu[0-9]+|triton|fla|mamba_ssm|select_ops\(cuda\)):' \
                "$env_log" | sed 's/^/- /'
        fi
        if [ -n "$env_log" ] && ! grep -q '^cuda_available: True' "$env_log"; then
            echo
            echo "**torch sees no CUDA device: the CUDA steps below did not test a GPU.**"
        fi
        echo
        echo "| # | step | result | rc | wall s | limit s | log |"
        echo "|---|------|--------|----|--------|---------|-----|"
        while IFS=$'\t' read -r idx name limit rc wall log; do
            res=$(result_of "$rc" "$wall" "$limit")
            if [ "$res" = ok ]; then n_ok=$((n_ok + 1)); else n_bad=$((n_bad + 1)); fi
            total=$(awk -v a="$total" -v b="$wall" 'BEGIN { printf "%.1f", a + b }')
            echo "| $idx | $name | $res | $rc | $wall | $limit | [$log]($log) |"
        done <"$REPORT/steps.tsv"
        echo
        echo "$n_ok ok, $n_bad not ok, ${total} s in steps (budget $BUDGET_S s)."
        ls "$REPORT"/junit-*.xml >/dev/null 2>&1 && echo "junit: $(cd "$REPORT" && ls junit-*.xml | tr '\n' ' ')"
        while IFS=$'\t' read -r idx name limit rc wall log; do
            echo
            echo "## $idx $name: $(result_of "$rc" "$wall" "$limit") (rc $rc, ${wall} s of $limit s)"
            echo
            echo '```'
            summary_of "$name" "$REPORT/$log"
            echo '```'
        done <"$REPORT/steps.tsv"
    } >"$md.tmp" && mv "$md.tmp" "$md"
}

now_ns() { date +%s%N; }
