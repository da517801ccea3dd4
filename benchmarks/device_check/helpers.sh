# shellcheck shell=bash
# device_check.sh's helpers (also available to each step, which runs as `bash $SELF --step NAME`).
# Sourced by benchmarks/device_check.sh (which sets STEPS, BUDGET_S, GRACE_S, SELF and ROOT); defines
# functions only.

pick_python() {
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    command -v python >/dev/null 2>&1 && { echo python; return; }
    echo python3
}

# Test files under tests/ that mention CUDA: the tests that skip, return early or choose another
# path without a GPU. A mention inside a top-level `def test_*` selects that test (file::name);
# one anywhere else (module level, a decorator, a helper, a class) selects the whole file.
cuda_tests() {
    local f
    (cd "$ROOT" && grep -rilE 'cuda' tests --include='test_*.py' | sort) | while read -r f; do
        awk -v f="$f" '
            /^(async[ \t]+)?def[ \t]+test_/ {
                match($0, /test_[A-Za-z0-9_]*/); cur = substr($0, RSTART, RLENGTH)
                if (tolower($0) ~ /cuda/) nodes[cur] = 1
                next
            }
            /^[^ \t#]/ { cur = "" }
            tolower($0) ~ /cuda/ { if (cur != "") nodes[cur] = 1; else whole = 1 }
            END {
                if (whole) { print f; exit }
                n = 0; for (k in nodes) keys[n++] = k
                for (i = 0; i < n; i++) for (j = i + 1; j < n; j++) if (keys[j] < keys[i]) { t = keys[i]; keys[i] = keys[j]; keys[j] = t }
                for (i = 0; i < n; i++) print f "::" keys[i]
            }' "$ROOT/$f"
    done
}

# pip constraints that keep the installed torch and triton (a resolver that wants another torch
# fails instead of replacing the CUDA build).
write_constraints() {
    "$PY" - >"$WORK/constraints.txt" <<'EOF'
import importlib.metadata as md
for dist in ("torch", "triton", "pytorch-triton"):
    try:
        print(f"{dist}=={md.version(dist)}")
    except md.PackageNotFoundError:
        pass
EOF
    echo "pip constraints: $(tr '\n' ' ' <"$WORK/constraints.txt")"
}

pip_install() {  # pip_install PKG... : best effort, short network timeouts, constraints applied
    "$PY" -m pip install --disable-pip-version-check --no-input --progress-bar off \
        --timeout 8 --retries 0 -c "$WORK/constraints.txt" "$@"
}

run_pytest() {  # run_pytest NAME PER_TEST_S ARGS... : verbose, skips and failures listed, junit xml
    local name=$1 per=$2
    shift 2
    local per_test=()
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then
        per_test=(--timeout "$per")
    else
        echo "pytest-timeout is not installed: no per-test limit (the step limit still applies)"
    fi
    "$PY" -m pytest -p no:cacheprovider -v -rsfE ${per_test[@]+"${per_test[@]}"} \
        --junitxml="$REPORT/junit-$name.xml" "$@"
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
