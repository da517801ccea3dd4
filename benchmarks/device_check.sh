#!/usr/bin/env bash
# One run on a machine with one NVIDIA GPU: the environment, the tests that behave differently with
# CUDA, the Triton kernels compiled for the GPU against the reference (fixture models end to end and
# the kernel benchmark's max_err), fla-core, the kernel and step benchmarks, and one /generate request
# to a server started with --device cuda. Writes REPORT_DIR/report.md (a table of every step's result,
# exit code and wall time, then each step's summary), REPORT_DIR/logs/ (each step's whole output),
# junit xml of the pytest steps and the benchmarks' json.
#
#   bash benchmarks/device_check.sh [REPORT_DIR]   # default: $OUT if set, else ./device-report
#   bash benchmarks/device_check.sh --dry-run      # the steps, their limits and the CUDA tests; no GPU needed
#
# Every step runs under `timeout`, whatever the earlier ones did (no set -e). The step limits plus
# each step's kill grace add up to less than BUDGET_S, so a run ends within 8 minutes; --dry-run
# checks that sum and exits 1 when it is not below BUDGET_S. Installs (missing dependencies,
# fla-core) are best effort: short pip timeouts, the installed torch and triton pinned.

set -u
set -o pipefail

BUDGET_S=480
GRACE_S=2  # timeout -k: seconds between TERM and KILL

# "name limit_s", in run order; step "foo-bar" runs the function step_foo_bar.
STEPS=(
    "nvidia-smi 10"
    "deps 20"
    "fla-core 60"
    "env 20"
    "pytest-cuda 75"
    "kernel-parity 35"
    "bench-kernels 50"
    "make-model 25"
    "bench-step-builtin 20"
    "e2e 55"
    "bench-step-350m 35"
    "pytest-kernels 35"
)

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
ROOT="$(dirname "$(dirname "$SELF")")"

# ---------------------------------------------------------------------------------------------
# the helpers, the report and the main loop: benchmarks/device_check/*.sh, sourced here (so each step,
# which runs as `bash $SELF --step NAME`, has them too)

PARTS="$(dirname "$SELF")/device_check"
# shellcheck source=device_check/helpers.sh
source "$PARTS/helpers.sh" || exit 1
# shellcheck source=device_check/report.sh
source "$PARTS/report.sh" || exit 1
# shellcheck source=device_check/run.sh
source "$PARTS/run.sh" || exit 1

# ---------------------------------------------------------------------------------------------
# steps

step_nvidia_smi() {
    nvidia-smi || return $?
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_cap,clocks.max.sm,power.limit \
        --format=csv
}

step_deps() {
    write_constraints
    local missing
    missing=$("$PY" - <<'EOF'
import importlib.util
wanted = {  # import name: pip name (pyproject's dependencies and the test extra the suite uses)
    "zmq": "pyzmq", "msgspec": "msgspec", "uvicorn": "uvicorn", "uvloop": "uvloop", "starlette": "starlette",
    "safetensors": "safetensors", "tokenizers": "tokenizers", "prometheus_client": "prometheus-client",
    "jinja2": "jinja2", "tqdm": "tqdm", "setproctitle": "setproctitle", "numpy": "numpy",
    "xgrammar": "xgrammar", "triton": "triton", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
    "hypothesis": "hypothesis", "httpx": "httpx",
}
print(" ".join(pip for mod, pip in wanted.items() if importlib.util.find_spec(mod) is None))
EOF
    ) || return $?
    if [ -z "$missing" ]; then
        echo "every dependency imports: nothing to install"
        return 0
    fi
    echo "missing: $missing"
    # shellcheck disable=SC2086
    pip_install $missing
}

step_fla_core() {
    if "$PY" -c "import fla" 2>/dev/null; then
        echo "fla already importable: nothing to install"
    else
        write_constraints
        timeout -k 2 50 "$PY" -m pip install --disable-pip-version-check --no-input --progress-bar off \
            --timeout 8 --retries 0 -c "$WORK/constraints.txt" fla-core
        echo "pip install fla-core: exit $?"
    fi
    "$PY" -c 'import fla; from fla.ops.gated_delta_rule import chunk_gated_delta_rule; print("fla", fla.__version__, "imported from", fla.__file__)'
}

step_env() {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)  cores: $(nproc)"
    echo "commit: $(cd "$ROOT" && git rev-parse HEAD 2>/dev/null || echo 'no git metadata')"
    free -g | head -2
    df -h "$ROOT" | tail -1
    "$PY" - <<'EOF'
import importlib
import os
import sys

print("python:", sys.version.split()[0], sys.executable)
try:
    import torch

    print("torch:", torch.__version__, "cuda build:", torch.version.cuda)
    ok = torch.cuda.is_available()
    print("cuda_available:", ok)
    if ok:
        print("cuda_devices:", torch.cuda.device_count())
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"gpu{i}: {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
                  f"{p.multi_processor_count} SMs")
        print("bf16_supported:", torch.cuda.is_bf16_supported())
        x = torch.randn(1024, 1024, device="cuda")
        print("cuda_matmul_finite:", bool((x @ x).isfinite().all()))
except Exception as exc:
    print("torch: import failed:", repr(exc))
for mod in ("triton", "fla", "mamba_ssm", "causal_conv1d", "pytest_timeout"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod}: {getattr(m, '__version__', '?')} ({os.path.dirname(m.__file__ or '')})")
    except Exception as exc:
        print(f"{mod}: not importable ({type(exc).__name__}: {str(exc)[:200]})")
try:
    from worker_proc.plan.kernel_set import select_ops

    ops = select_ops("cuda")
    print("select_ops(cuda):", type(ops).__name__, "gdn backend:", type(ops.gdn).__name__)
except Exception as exc:
    print("select_ops(cuda): failed:", repr(exc))
EOF
}

step_pytest_cuda() {
    local nodes
    nodes=$(cuda_tests)
    echo "CUDA tests:"
    echo "$nodes" | sed 's/^/  /'
    # shellcheck disable=SC2086
    run_pytest pytest-cuda 60 $nodes
}

step_kernel_parity() {
    # Fixture models end to end in fp32: compiled Triton kernels vs the reference vs Hugging Face
    # (the filter matches no benchmark case: parity only).
    "$PY" benchmarks/bench_kernels.py --device cuda --model-parity --quick --preset tiny --filter '#parity-only#'
}

step_bench_kernels() {
    "$PY" benchmarks/bench_kernels.py --device cuda --quick --preset tiny --iters 10 \
        --output-json "$REPORT/bench_kernels.json"
    local rc=$?
    [ -f "$REPORT/bench_kernels.json" ] && "$PY" - "$REPORT/bench_kernels.json" <<'EOF'
import json
import sys

rows = json.load(open(sys.argv[1]))["rows"]
errs = sorted((r for r in rows if r["impl"] == "triton" and r["max_err"] is not None), key=lambda r: -r["max_err"])
print(f"triton rows: {sum(r['impl'] == 'triton' for r in rows)}, failed: {sum(r['impl'] == 'triton' and r['us'] is None for r in rows)}")
print("largest triton-vs-reference max_err:")
for r in errs[:6]:
    print(f"  {r['max_err']:.3e}  {r['preset']} {r['case']}")
EOF
    return $rc
}

step_make_model() {
    rm -rf "$WORK/granite-350m"
    "$PY" benchmarks/make_bench_model.py --shape granite-4.0-h-350m --dtype bfloat16 "$WORK/granite-350m"
}

step_bench_step_builtin() {
    # bfloat16: the built-in checkpoint's dtype, the one the e2e server runs (and whose kernels it reuses)
    "$PY" benchmarks/bench_step.py --device cuda --dtype bfloat16 --batches 1,8,32 --prompt-len 128 \
        --decode-steps 8 --runs 2
}

step_bench_step_350m() {
    if [ ! -f "$WORK/granite-350m/config.json" ]; then
        echo "no checkpoint at $WORK/granite-350m (step make-model failed)"
        return 3
    fi
    "$PY" benchmarks/bench_step.py --device cuda --model-path "$WORK/granite-350m" --dtype bfloat16 \
        --batches 1,8,32 --prompt-len 128 --decode-steps 8 --runs 2
}

step_e2e() {
    local port pid url rc=0 code i
    port=$(free_port) || return 1
    url="http://127.0.0.1:$port"
    setsid "$PY" launch.py --device cuda --port "$port" >"$REPORT/logs/e2e-server.log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >>"$WORK/pgids"  # the main script kills this group if the step is killed
    stop_server() {
        kill -TERM -- "-$pid" 2>/dev/null || return 0
        for _ in 1 2 3 4 5 6 7 8; do
            kill -0 -- "-$pid" 2>/dev/null || return 0
            sleep 0.5
        done
        echo "server group $pid still up after TERM: KILL"
        kill -KILL -- "-$pid" 2>/dev/null
    }
    trap 'stop_server; exit 143' TERM INT
    echo "launch.py --device cuda --port $port (pid $pid; its log: logs/e2e-server.log)"
    for i in $(seq 1 50); do  # up to 25 s
        if curl -sf -m 2 "$url/health" >/dev/null 2>&1; then
            echo "healthy after ~$((i / 2)) s"
            break
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "the server exited before it was healthy"
            break
        fi
        sleep 0.5
    done
    code=$(curl -sS -m 20 -o "$REPORT/e2e-generate.json" -w '%{http_code} %{time_total}s' \
        -H 'Content-Type: application/json' \
        -d '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}' \
        "$url/generate") || rc=1
    echo "POST /generate: HTTP $code"
    [ -f "$REPORT/e2e-generate.json" ] && { head -c 2000 "$REPORT/e2e-generate.json"; echo; }
    case "$code" in 200*) grep -q '"output_ids"' "$REPORT/e2e-generate.json" || rc=1 ;; *) rc=1 ;; esac
    curl -sS -m 3 -o "$REPORT/e2e-server-info.json" "$url/get_server_info" || true
    stop_server
    trap - TERM INT
    echo "server log (tail):"
    tail -n 15 "$REPORT/logs/e2e-server.log"
    return $rc
}

step_pytest_kernels() {
    # The rest of tests/kernels (Triton kernels under the interpreter vs the reference; tests/kernels/
    # conftest.py sets TRITON_INTERPRET=1), without the CUDA tests step pytest-cuda ran.
    local skip=() n
    while read -r n; do
        case "$n" in
            tests/kernels/*::*) skip+=(--deselect "$n") ;;
            tests/kernels/*) skip+=(--ignore "$n") ;;
        esac
    done < <(cuda_tests)
    run_pytest pytest-kernels 30 tests/kernels ${skip[@]+"${skip[@]}"}
}

case "${1:-}" in
    -h | --help)
        sed -n '2,15p' "$SELF" | sed 's/^# \{0,1\}//'
        ;;
    --dry-run)
        dry_run
        exit $?
        ;;
    --step)
        cd "$ROOT" || exit 1
        fn="step_${2//-/_}"
        declare -F "$fn" >/dev/null || { echo "unknown step $2"; exit 2; }
        "$fn"
        exit $?
        ;;
    *)
        main "$@"
        ;;
esac
