"""llama.cpp's server as a peer: built once from source, the same model as a GGUF, one server per level.

The source is llama.cpp as vendored in the `llama-cpp-python` sdist on PyPI (pinned below), so the
build needs nothing but PyPI, cmake and a C++ compiler. Everything lives under
`$TPSERVE_CACHE/llama.cpp/` (default ~/.cache/tpserve/llama.cpp/), outside the repository:

    python -m bench.peers.llamacpp_peer build            # `make bench-llamacpp-build`: sdist, cmake, llama-server
    python -m bench.peers.llamacpp_peer convert [--dtype float32]   # the default model as a GGUF
    python -m bench.peers.llamacpp_peer serve --parallel 16          # start it, print the URL, stop on Ctrl-C

The build is CPU only, Release, `-march=native` (GGML_NATIVE), without libcurl, OpenSSL or the web
UI (no network at build or run time), and only the `llama-server` target; it runs at nice 19 on
every CPU we may use (several minutes on 2 cores). The GGUF comes from llama.cpp's own
`convert_hf_to_gguf.py` (with the `gguf` package from the same source tree) run on the HF folder
tpserve serves, in the dtype the other servers run in: a comparison of engines, not of number
formats.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bench.peers.managed_server import ManagedServer, launch, serve_until_stopped
from workers.distributed.ports import free_port

logger = logging.getLogger(__name__)

# The sdist whose vendor/llama.cpp is built (llama.cpp's ggml 0.25.3, commit 0c1e570).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# -DLLAMA_CURL=OFF: the server never downloads a model (the option is deprecated upstream and
# ignored there; kept for older trees). The prebuilt web UI would be fetched at build time.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
)
# tpserve's dtype names -> convert_hf_to_gguf.py's --outtype.
GGUF_OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# Written last into the build folder: its presence means the binary is complete and from these flags.
_BUILD_STAMP = ".tpserve-llamacpp-built"


def cache_root() -> Path:
    from workers.model.default_model import cache_dir

    return cache_dir() / "llama.cpp"


def source_dir() -> Path:
    return cache_root() / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"


def server_binary() -> Path:
    return source_dir() / "build" / "bin" / "llama-server"


def _nice() -> None:
    os.nice(19)  # a build on a shared machine yields to everything else


def ensure_llama_server() -> Path:
    """Download the pinned sdist, build `llama-server` from its vendored llama.cpp (once); return it."""
    binary = server_binary()
    build = source_dir() / "build"
    if (build / _BUILD_STAMP).exists() and binary.exists():
        return binary
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    if not (source_dir() / "CMakeLists.txt").exists():
        sdist = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        if not sdist.exists():
            logger.info("downloading the llama-cpp-python %s sdist (~75 MB) into %s", LLAMA_CPP_PYTHON_VERSION, root)
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(root)], check=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    jobs = str(len(os.sched_getaffinity(0)))
    logger.info("building llama-server in %s (several minutes)", build)
    subprocess.run(["cmake", "-S", str(source_dir()), "-B", str(build), *CMAKE_FLAGS], check=True, preexec_fn=_nice)
    subprocess.run(["cmake", "--build", str(build), "--config", "Release", "--target", "llama-server", "-j", jobs],
                   check=True, preexec_fn=_nice)
    if not binary.exists():
        raise RuntimeError(f"the llama.cpp build finished without {binary}")
    (build / _BUILD_STAMP).write_text(" ".join(CMAKE_FLAGS) + "\n")
    return binary


def gguf_outtype(dtype: str) -> str:
    if dtype not in GGUF_OUTTYPES:
        raise ValueError(f"no GGUF type for dtype {dtype!r}; one of {sorted(GGUF_OUTTYPES)}")
    return GGUF_OUTTYPES[dtype]


def ensure_gguf(model_dir: str | Path, dtype: str) -> Path:
    """The HF folder `model_dir` as a GGUF of `dtype`, converted once by llama.cpp's converter."""
    model_dir = Path(model_dir)
    outtype = gguf_outtype(dtype)
    target = cache_root() / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    if target.exists():
        return target
    converter = source_dir() / "convert_hf_to_gguf.py"
    if not converter.exists():
        ensure_llama_server()  # fetches the source tree the converter is part of
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    logger.info("converting %s to %s", model_dir, target)
    # The converter puts the tree's gguf-py first on its path itself (unless NO_LOCAL_GGUF is set).
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    subprocess.run([sys.executable, str(converter), str(model_dir), "--outtype", outtype, "--outfile", str(partial)],
                   check=True, env=env, preexec_fn=_nice)
    partial.rename(target)  # only a finished conversion carries the final name
    return target


@dataclass(frozen=True)
class LlamaServerSettings:
    # Server slots = concurrent streams of the level being measured (`--parallel`).
    parallel: int
    # Context of each slot: the longest sequence, as max_model_len on the other servers.
    max_model_len: int
    # OpenMP-style worker threads for decode and for prompt batches.
    threads: int
    # Name the server answers to in /v1/models and `model` (the HF folder's name, as on the others).
    alias: str


def server_command(binary: Path, gguf: Path, port: int, s: LlamaServerSettings) -> list[str]:
    """llama-server's command line: continuous batching on, `parallel` slots of `max_model_len`."""
    return [
        str(binary), "--model", str(gguf), "--alias", s.alias, "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(s.parallel), "--cont-batching",
        # llama.cpp splits --ctx-size evenly over the slots.
        "--ctx-size", str(s.parallel * s.max_model_len),
        "--threads", str(s.threads), "--threads-batch", str(s.threads),
        "--no-webui",
    ]


def start_llamacpp_server(model_dir: str | Path, parallel: int, dtype: str = "float32", max_model_len: int = 2048,
                          threads: int | None = None, startup_timeout_s: float = 600.0,
                          log_path: str | Path | None = None) -> ManagedServer:
    """Build/convert if needed, start llama-server on a free port and wait for /health (200 once loaded)."""
    binary = ensure_llama_server()
    model_dir = Path(model_dir)
    gguf = ensure_gguf(model_dir, dtype)
    port = free_port()
    settings = LlamaServerSettings(parallel=parallel, max_model_len=max_model_len,
                                   threads=threads or len(os.sched_getaffinity(0)), alias=model_dir.name)
    return launch(server_command(binary, gguf, port, settings), dict(os.environ), port, log_path, "llamacpp",
                  "/health", startup_timeout_s, model_dir.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["build", "convert", "serve"])
    p.add_argument("model_dir", nargs="?", default=None, help="HF folder (default: tpserve's default model)")
    p.add_argument("--dtype", default="float32", choices=sorted(GGUF_OUTTYPES))
    p.add_argument("--parallel", type=int, default=1, help="server slots")
    p.add_argument("--max-model-len", type=int, default=2048)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.action == "build":
        print(ensure_llama_server())
        return 0
    if a.model_dir is None:
        from workers.model.default_model import ensure_default_model

        a.model_dir = ensure_default_model()
    if a.action == "convert":
        print(ensure_gguf(a.model_dir, a.dtype))
        return 0
    return serve_until_stopped(lambda: start_llamacpp_server(a.model_dir, a.parallel, a.dtype, a.max_model_len))


if __name__ == "__main__":
    sys.exit(main())
