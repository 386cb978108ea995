#!/usr/bin/env bash
# GPU validation in one command, for a fresh machine with an NVIDIA GPU:
#
#   bash benchmarks/gpu_check.sh [-o REPORT.md] [--no-install]
#
# 1. checks for a GPU and a CUDA driver (without one it stops at once, exit 3);
# 2. makes a venv (GPU_CHECK_VENV, default $TMPDIR/gpucx-gpu-check-venv) and
#    installs gpucx with the test and cuda12 extras (pip install -e); with
#    --no-install it makes no venv and uses $PYTHON (default python3) as it is:
#    gpucx, CuPy, pytest and pytest-timeout must import there (an offline GPU
#    node, a conda environment);
# 3. gpucx info: UCX must report CUDA memory and CUDA transports;
# 4. the cuda-marked test suite (python -m pytest -m cuda);
# 5. CUDA IPC between two processes and CUDA stream ordering, reported on
#    their own (tests of the cuda suite: two_processes with cuda_ipc; the
#    stream-ordering tests);
# 6. the machine's own copies at GPU_CHECK_SIZES (default 1M,64M): device to
#    device, pinned and pageable host to device and back (python -m
#    gpucx.bench.limits: cuMemcpyAsync timed with CUDA events);
# 7. gpucx bench against ucx_perftest (--vs-perftest) for tag_bw, put_bw,
#    get_bw and am_bw at GPU_CHECK_SIZES: GPU to GPU (-m cuda, with array_bw
#    too), GPU and host memory mapped by UCX both ways (-m cuda:ucx, -m
#    ucx:cuda: the host memory ucx_perftest uses), and GPU with NumPy host
#    memory both ways (-m cuda:host, -m host:cuda: pageable, so no
#    like-for-like ratio), and NumPy memory registered with the context
#    (-m reg:cuda: pinned by UCX), and put/get through the Python API
#    between NumPy memory and a GPU (--api python -m host:cuda, cuda:host:
#    gpucx's own CUDA IPC copies, docs/rma.md); each GPU row also shows its limit, the machine's
#    copy between the same memory kinds, and the fraction of it reached;
#    then the protocols UCX picks on those paths (UCX_PROTO_INFO=y), one
#    table per operation;
#    and the two array rows of issue 34 at GPU_CHECK_ARRAY_SIZES (default
#    8,64K,1M,64M), each with receiver-side staging on and off
#    (GPUCX_STAGING_BYTES=0): array_bw -m host:cuda (NumPy arrays into
#    device memory: the staging path, set against the pageable copy with
#    the pinned one beside it in the JSON) and -m cuda (GPU to GPU, the
#    receiver keeping a window of posted recv_array_nb); the staging tests
#    of the cuda suite are reported on their own;
# 8. writes one Markdown report (default benchmarks/gpu-check-report.md) with
#    the machine, every step's result and time, the tables, and the tail of
#    the log of each failed step.  Logs and bench JSON go to GPU_CHECK_LOGS
#    (default: a new $TMPDIR/gpucx-gpu-check.XXXXXX).
#
# Exit status: 0 all steps passed, 1 a step failed (see the report), 2 bad
# usage, 3 no GPU or no CUDA driver here (nothing installed, no report).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
REPORT=benchmarks/gpu-check-report.md
INSTALL=1
usage() { echo "usage: bash benchmarks/gpu_check.sh [-o REPORT.md] [--no-install]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        -o|--report) [ $# -ge 2 ] || usage; REPORT=$2; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        -h|--help) sed -n '2,/^set /p' "$0" | sed '$d'; exit 0 ;;
        *) usage ;;
    esac
done
die_no_gpu() { echo "gpu_check: error: $1; this check needs an NVIDIA GPU with its driver" >&2; exit 3; }

# -- 1. a GPU and its driver, before anything is installed --------------------
command -v nvidia-smi > /dev/null 2>&1 ||
    die_no_gpu "no NVIDIA GPU found (nvidia-smi is not installed)"
GPUS=$(timeout 20 nvidia-smi -L 2>&1) || die_no_gpu "nvidia-smi failed: $(echo "$GPUS" | head -n 1)"
echo "$GPUS" | grep -q '^GPU ' || die_no_gpu "nvidia-smi lists no GPU"
PY=${PYTHON:-python3}
DRIVER=$("$PY" - <<'PYEOF' 2>&1
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    sys.exit(f"no CUDA driver: libcuda.so.1 does not load ({exc})")
v = ctypes.c_int(0)
if cuda.cuInit(0) != 0 or cuda.cuDriverGetVersion(ctypes.byref(v)) != 0:
    sys.exit("the CUDA driver does not initialise (cuInit failed)")
print(f"{v.value // 1000}.{v.value % 1000 // 10}")
PYEOF
) || die_no_gpu "$DRIVER"

# -- the steps -------------------------------------------------------------------
VENV=${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/gpucx-gpu-check-venv}
if [ $INSTALL -eq 1 ]; then GPY=$VENV/bin/python; else GPY=$(command -v "$PY"); fi
if [ -n "${GPU_CHECK_LOGS:-}" ]; then LOGS=$GPU_CHECK_LOGS; mkdir -p "$LOGS" || exit 2
else LOGS=$(mktemp -d "${TMPDIR:-/tmp}/gpucx-gpu-check.XXXXXX"); fi
STEPS=()   # "name|status|seconds|log"
FAILED=0
step() {   # step NAME COMMAND...: run, log, record
    local name=$1; shift
    local log="$LOGS/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_').log"
    local t0=$SECONDS
    echo "gpu_check: $name ..." >&2
    ( "$@" ) > "$log" 2>&1
    local rc=$? status=ok
    [ $rc -eq 0 ] || { status="FAILED (exit $rc)"; FAILED=1; }
    STEPS+=("$name|$status|$((SECONDS - t0))|$log")
    echo "gpu_check: $name: $status" >&2
    return $rc
}
install() {
    rm -rf "$VENV" && "$PY" -m venv "$VENV" &&
        "$VENV/bin/pip" install -q --upgrade pip &&
        "$VENV/bin/pip" install -q -e "$ROOT[test,cuda12]"
}
installed() {   # --no-install: what the steps need imports in $PYTHON
    "$GPY" -c "import gpucx, cupy, pytest, pytest_timeout; print('gpucx', gpucx.__version__, gpucx.__file__); print('cupy', cupy.__version__)"
}
info_has_cuda() {
    "$GPY" -m gpucx.cli info && "$GPY" -m gpucx.cli info --json |
        "$GPY" -c "import json, sys; c = json.load(sys.stdin)['cuda']; sys.exit(0 if c['can_move_cuda_memory'] else 'CUDA: ' + str(c['problem']))"
}
pytest_cuda() { "$GPY" -m pytest -q -p no:cacheprovider -m cuda -rA "$@"; }
copy_limits() {   # the copies each GPU row of gpucx bench is set against
    "$GPY" -m gpucx.bench.limits -s "${GPU_CHECK_SIZES:-1M,64M}" --json "$LOGS/limits.json"
}
bench() {   # bench MEMORY [EXTRA_TESTS]
    "$GPY" -m gpucx.cli bench -t "tag_bw,put_bw,get_bw,am_bw${2:+,$2}" -s "${GPU_CHECK_SIZES:-1M,64M}" -m "$1" \
        --vs-perftest --no-progress --json "$LOGS/bench-${1/:/-}.json"
}
own_path() {   # MEMORY: put/get through the Python API, where gpucx's own
    # CUDA IPC copies serve host<->GPU RMA (the C loops post to UCX directly)
    "$GPY" -m gpucx.cli bench -t put_bw,get_bw --api python -s "${GPU_CHECK_SIZES:-1M,64M}" \
        -m "$1" --no-progress --json "$LOGS/own-${1/:/-}.json"
}
arrays() {   # MEMORY: array_bw alone, receiver-side staging on, then off
    local sizes=${GPU_CHECK_ARRAY_SIZES:-8,64K,1M,64M} out=$LOGS/arrays-${1/:/-}
    echo "## staging on (default GPUCX_STAGING_BYTES)" &&
        "$GPY" -m gpucx.cli bench -t array_bw -s "$sizes" -m "$1" --no-progress \
            --json "$out.json" &&
        echo "## staging off (GPUCX_STAGING_BYTES=0: UCX receives into device memory)" &&
        GPUCX_STAGING_BYTES=0 "$GPY" -m gpucx.cli bench -t array_bw -s "$sizes" \
            -m "$1" --no-progress --json "$out-off.json"
}
proto_tables() {   # UCX_PROTO_INFO output -> each table about CUDA memory, once
    sed 's/^\[[^]]*\] \[[^]]*\] *//' | awk '
        /^\+-/ { next }
        /cfg#[0-9]+ *\|$/ {
            getline; keep = ($0 ~ /cuda/ && !seen[$0]++)
            if (keep) { print ""; print }
            next
        }
        keep && /^\|/ && !/^\| *Range *\|/ { print }'
}
protocols() {   # which UCX protocols move GPU data: one line per size range
    local m rc=0
    for m in cuda cuda:ucx ucx:cuda; do
        UCX_PROTO_INFO=y "$GPY" -m gpucx.cli bench -t tag_bw,put_bw,get_bw,am_bw \
            -s "${GPU_CHECK_SIZES:-1M,64M}" -m "$m" -n 20 -w 2 --no-progress \
            > "$LOGS/proto-${m/:/-}.txt" 2>&1 || rc=1
    done
    cat "$LOGS"/proto-*.txt | proto_tables
    return $rc
}

if [ $INSTALL -eq 1 ]; then
    step "install gpucx[test,cuda12]" install
else
    step "use $GPY as it is (--no-install)" installed
fi
if [ $? -eq 0 ]; then
    step "gpucx info reports CUDA" info_has_cuda
    step "cuda-marked test suite" pytest_cuda tests
    step "CUDA IPC between two processes" pytest_cuda tests/test_cuda.py -k "two_processes and ipc"
    step "CUDA stream ordering" pytest_cuda tests/test_cuda.py \
        -k "stream_ordering or recv_with_stream or lands_after or waits_for_the_stream"
    step "copy speeds of this GPU (python -m gpucx.bench.limits)" copy_limits
    step "gpucx bench -m cuda vs ucx_perftest" bench cuda array_bw
    step "gpucx bench -m cuda:ucx vs ucx_perftest" bench cuda:ucx
    step "gpucx bench -m ucx:cuda vs ucx_perftest" bench ucx:cuda
    step "gpucx bench -m cuda:host (NumPy host memory) vs ucx_perftest" bench cuda:host
    step "gpucx bench -m host:cuda (NumPy host memory) vs ucx_perftest" bench host:cuda
    step "gpucx bench -m reg:cuda (registered NumPy memory) vs ucx_perftest" bench reg:cuda
    step "gpucx's own CUDA IPC path: put/get -m host:cuda (--api python)" own_path host:cuda
    step "gpucx's own CUDA IPC path: put/get -m cuda:host (--api python)" own_path cuda:host
    step "UCX protocols of the GPU paths (UCX_PROTO_INFO)" protocols
    step "receiver-side staging tests (cuda suite)" pytest_cuda tests/test_cuda_staging.py
    step "gpucx bench array_bw -m host:cuda (NumPy arrays into GPU memory)" arrays host:cuda
    step "gpucx bench array_bw -m cuda (GPU to GPU, posted recv_array_nb)" arrays cuda
fi

# -- the report ------------------------------------------------------------------
summary() { grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)' "$1" | tail -n 1 | tr -d '='; }
{
    echo "# gpucx GPU check"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- command: \`bash benchmarks/gpu_check.sh$([ $INSTALL -eq 1 ] || echo ' --no-install')\`"
    echo "- commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "- host: $(uname -srm), CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
    echo "- CUDA driver: $DRIVER"
    echo "$GPUS" | sed 's/^/- /'
    echo "- result: $([ $FAILED -eq 0 ] && echo 'every step passed' || echo 'FAILED: see below')"
    echo
    echo "| step | result | seconds | tests |"
    echo "|---|---|---|---|"
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name status secs log <<< "$s"
        echo "| $name | $status | $secs | $(summary "$log") |"
    done
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name status secs log <<< "$s"
        case "$name" in
            "gpucx info"*|"gpucx bench"*|"copy speeds"*)
                echo; echo "## $name"; echo; echo '```text'; grep -v '^WARNING' "$log" | tail -n 40; echo '```' ;;
            "UCX protocols"*)
                echo; echo "## $name"; echo; echo '```text'; head -n 200 "$log"; echo '```' ;;
        esac
        if [ "$status" != ok ]; then
            echo; echo "## $name: log tail"; echo; echo '```text'; tail -n 60 "$log"; echo '```'
        fi
    done
    echo
    echo "Bench ratios: gpucx/perftest, same run (1 = the speed of ucx_perftest);"
    echo "of limit: gpucx / this machine's copy between the same memory kinds (gpucx.bench.limits)."
    echo "Logs and JSON: $LOGS"
} > "$REPORT"
echo "gpu_check: report written to $REPORT" >&2
exit $FAILED
