#!/usr/bin/env bash
# GPU check of tpserve's serving path, in one run of under 10 minutes on one fresh H200 (torch 2.11,
# Triton 3.6, Python 3.12; no Ray, no vLLM needed):
#   1. the GPU tests (tests/gpu: graph replay vs eager in bf16 and fp32 compared as vLLM does,
#      token-row graphs serving mixed steps (test_token_row_graphs_serve_mixed_steps), the Triton
#      paged decode kernel vs the torch reference inside a CUDA graph, the KV budget vs what capture
#      took, the engine on GPU, Serve end to end when ray is importable, TP=2 when two GPUs exist)
#      and the Triton kernel tests (tests/test_triton_paged_attention.py, compiled here);
#   2. the serving figures at real shapes with dummy weights (tests/gpu/serving_bench.py): copy
#      bandwidth; Llama-3-8B bf16 decode at batch 1 vs the HBM floor (goal <= 1.25x), batch 64 and
#      256 tok/s; paged decode attention at 64 x 4k context vs copy bandwidth (goal >= 70%);
#      prefill attention TFLOP/s on a 2k chunk after 2k cached; an offline mixed workload (512
#      requests, prompts 200-4,000, 128 output tokens, max_model_len 8,192: no OOM, p99 step <= 5x
#      the median decode step, output tok/s); SmolLM2 shapes at 16 / 64 streams in-process;
#   3. SmolLM2 over HTTP at 16 / 64 streams (decode_bench.py: uvicorn + the FastAPI app, one engine;
#      the last figures were 2,258 / 3,145 tok/s);
#   4. one JSON with all of it: $OUT/summary.json (raw: env.json, gpu_tests.xml/.log,
#      serving_bench.json/.log, decode_bench.json/.log); a short table at the end of the output.
#
#   bash tests/gpu/device_check.sh --dry-run   the same script end to end on CPU with tiny shapes and
#                                              a few requests (seconds; tests/test_device_check.py runs it)
#
# Prepare once, in the repo root of a checkout with `make install` done:   make gpu-prepare
#   -> .gpu_assets/smollm2/  SmolLM2-135M's config.json and tokenizer files (~4 MB)
#   -> .whl/                 wheels of what the GPU image lacks (fastapi, starlette, pydantic,
#                            pydantic-core, uvicorn, orjson, ...; ~6 MB), the versions of .venv,
#                            for CPython 3.12 x86-64
#   Both folders are git-ignored and travel with the device tool's `carry` (64 MiB in all):
#     run(command="bash tests/gpu/device_check.sh", carry=[".whl", ".gpu_assets"], timeout_s=600)
#   No weights travel: Llama-3-8B and SmolLM2 run with `load_format: dummy` from the config.json
#   files in tests/model_configs/ (same shapes, kernels and launch counts; tokens are not text),
#   and the HTTP load's SmolLM2 is random weights built there from .gpu_assets; the Serve test skips
#   unless the image has ray.
#
# Run on the GPU machine (no network; its python3 holds PyTorch, Triton, transformers,
# safetensors, httpx, pytest): nothing is installed into the system; the wheels go to a private
# --target folder and the repo is used from its own files through PYTHONPATH:
#     bash tests/gpu/device_check.sh
# Time limits per stage (worst case in all ~9.5 min): tests 170 s, serving figures 270 s, HTTP 110 s.
set -u -o pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions
        opentelemetry-api uvicorn orjson)

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
if (( DRY_RUN )) && [[ -z "${PYTHON:-}" && -x .venv/bin/python ]]; then PY=.venv/bin/python; fi

if [[ "${1:-}" == "--prepare" ]]; then
    VENV_PY=${VENV_PY:-.venv/bin/python}
    "$VENV_PY" tests/gpu/gpu_helpers.py prepare-assets || exit 1
    pins=$("$VENV_PY" -c "import importlib.metadata as m, sys; print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" "${WHEELS[@]}") || exit 1
    rm -rf .whl && mkdir -p .whl
    # shellcheck disable=SC2086
    "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins || exit 1
    du -sh .gpu_assets .whl
    # What travels: tracked + untracked-not-ignored files + the two carried folders (limit 64 MiB).
    total=$("$VENV_PY" - <<'EOF'
import os, subprocess
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.split(b"\0")
size = sum(os.path.getsize(f) for f in listed if f and os.path.isfile(f))
for folder in (".gpu_assets", ".whl"):
    size += sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(folder) for n in names)
print(size)
EOF
) || exit 1
    echo "travels: $(( total / 1048576 )) MiB of 64 MiB"
    (( total < 64 * 1048576 )) || { echo "too large to travel"; exit 1; }
    echo 'device command: run(command="bash tests/gpu/device_check.sh", carry=[".whl", ".gpu_assets"], timeout_s=600)'
    exit 0
fi

OUT=${OUT:-$PWD/gpu_results}
mkdir -p "$OUT"
START=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TPSERVE_CACHE=${TPSERVE_CACHE:-/tmp/tpserve-cache}

# 1. Python packages: carried wheels into a private folder; the repo from its own files.
SITE=/tmp/tpserve-site
if (( ! DRY_RUN )) && compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" - > "$OUT/env.json" <<'EOF'
import importlib, json, subprocess
import torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nccl": str(torch.cuda.nccl.version()) if torch.cuda.is_available() else None}
for name in ("transformers", "safetensors", "fastapi", "pydantic", "uvicorn", "httpx", "ray", "flash_attn", "flashinfer"):
    try:
        info[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        info[name] = f"missing ({type(exc).__name__})"
try:
    info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm",
                                         "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
except Exception as exc:  # noqa: BLE001
    info["nvidia_smi"] = str(exc)
print(json.dumps(info, indent=1))
EOF
cat "$OUT/env.json"

# 2. The GPU tests and the compiled Triton kernel tests (dry run: tests/gpu only, which skip
#    without CUDA: the stage and its report still run).
if (( DRY_RUN )); then
    TEST_PATHS=(tests/gpu)
else
    MODEL=$(timeout 60 "$PY" tests/gpu/gpu_helpers.py model-path) || { echo "no model"; exit 1; }
    export TPSERVE_GPU_MODEL=$MODEL
    echo "model: $MODEL  ($(( $(date +%s) - START )) s)"
    TEST_PATHS=(tests/gpu tests/test_triton_paged_attention.py tests/test_triton_prefill.py
                tests/test_triton_fused.py tests/test_triton_decode_dot.py)
fi
timeout 170 "$PY" -m pytest "${TEST_PATHS[@]}" -q -rs -p no:cacheprovider -o timeout=150 \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
TESTS_RC=${PIPESTATUS[0]}
echo "tests rc=$TESTS_RC  ($(( $(date +%s) - START )) s)"

# Kernels per decode step, torch ops vs the fused CUDA backend (torch profiler; needs CUDA).
if (( ! DRY_RUN )); then
    timeout 60 "$PY" -m bench.kernels.decode_kernel_count --batch 8 --context 512 \
        > "$OUT/decode_kernel_count.json" 2> "$OUT/decode_kernel_count.log" || echo "kernel count failed"
fi

# 3. Serving figures at real shapes, dummy weights.
DRY_FLAG=()
(( DRY_RUN )) && DRY_FLAG=(--dry-run)
timeout 270 "$PY" tests/gpu/serving_bench.py "${DRY_FLAG[@]}" --out "$OUT/serving_bench.json" 2>&1 \
    | tee "$OUT/serving_bench.log"
SERVING_RC=${PIPESTATUS[0]}
echo "serving rc=$SERVING_RC  ($(( $(date +%s) - START )) s)"

# 4. SmolLM2 over HTTP at 16 and 64 streams (needs CUDA and the carried wheels: not in a dry run).
if (( DRY_RUN )); then
    BENCH_RC=0
else
    timeout 110 "$PY" tests/gpu/decode_bench.py --modes graphs --batch-sizes 1,64 --steps 32 --prefill-lens "" \
        --skip-hf --http --http-concurrency 16,64 --out "$OUT/decode_bench.json" 2>&1 | tee "$OUT/decode_bench.log"
    BENCH_RC=${PIPESTATUS[0]}
fi
echo "bench rc=$BENCH_RC  ($(( $(date +%s) - START )) s)"

# 5. The one JSON.
"$PY" tests/gpu/device_summary.py "$OUT" "$TESTS_RC" "$SERVING_RC" "$BENCH_RC" "$(( $(date +%s) - START ))" "$DRY_RUN"
exit $(( TESTS_RC != 0 || SERVING_RC != 0 || BENCH_RC != 0 ))
