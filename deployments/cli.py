"""`tpserve serve`: convert the default model if needed, start Ray and Serve, deploy, block.

    tpserve serve [--host H] [--port N] [--ray-address ADDR] [--model PATH]
                  [--tensor-parallel-size N] [--max-num-seqs N] ... (every TpserveConfig field)

Ctrl-C (or SIGTERM) shuts Serve and Ray down cleanly. On an existing cluster, `serve run` /
`serve deploy serve_config.yaml` against its address is the usual route; `--ray-address` lets
this command join one too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
import types
from typing import Any, get_args

from deployments.config import ConfigError, TpserveConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TpserveConfig field; values stay strings and the config validates them."""
    for name, info in TpserveConfig.model_fields.items():
        help_text = (info.description or "") + f" (default: {info.default})"
        annotation_args = get_args(info.annotation) or (info.annotation,)
        if bool in annotation_args:
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif dict in annotation_args or any(getattr(a, "__origin__", None) is dict for a in annotation_args):
            parser.add_argument(_flag(name), dest=name, type=json.loads, default=argparse.SUPPRESS,
                                metavar="JSON", help=help_text)
        else:
            parser.add_argument(_flag(name), dest=name, default=argparse.SUPPRESS, help=help_text)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpserve", description="OpenAI-compatible LLM server on Ray Serve")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="serve a model on HTTP until Ctrl-C")
    serve_cmd.add_argument("--host", default=DEFAULT_HOST, help=f"HTTP host (default: {DEFAULT_HOST})")
    serve_cmd.add_argument("--port", type=int, default=DEFAULT_PORT,
                           help=f"HTTP port (default: {DEFAULT_PORT})")
    serve_cmd.add_argument("--ray-address", default=None,
                           help="join this Ray cluster instead of starting a local one")
    serve_cmd.add_argument("--ray-serve-fast-path", action=argparse.BooleanOptionalAction, default=True,
                           help="start the local Ray with Serve's HAProxy ingress and throughput-optimized "
                                "mode (deployments/serve_fast_path.py; default: on)")
    serve_cmd.add_argument("--ray-dashboard", action=argparse.BooleanOptionalAction, default=False,
                           help="start the local Ray with its dashboard (needed by `serve status` and "
                                "`serve deploy`; default: off, its processes take CPU from the engine)")
    _add_config_flags(serve_cmd)
    return parser


def config_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The TpserveConfig fields the user set on the command line."""
    return {k: v for k, v in vars(namespace).items() if k in TpserveConfig.model_fields}


def client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def curl_example(host: str, port: int, model_name: str) -> str:
    body = json.dumps(
        {"model": model_name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    return (
        f"curl http://{client_host(host)}:{port}/v1/chat/completions "
        f"-H 'Content-Type: application/json' -d '{body}'"
    )


def ready_message(host: str, port: int, model_name: str) -> str:
    """What `tpserve serve` prints once the server answers: where, and a request to paste."""
    return (
        f"\ntpserve is ready: {model_name} on http://{client_host(host)}:{port} "
        f"(OpenAI API under /v1, /health, /metrics). Try:\n\n  "
        f"{curl_example(host, port, model_name)}\n\nCtrl-C to stop."
    )


def served_model_name(host: str, port: int) -> str:
    """Ask the running server (also a check that it answers) which name clients should use."""
    with urllib.request.urlopen(f"http://{client_host(host)}:{port}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def _raise_keyboard_interrupt(_signum: int, _frame: types.FrameType | None) -> None:
    raise KeyboardInterrupt


def serve_command(namespace: argparse.Namespace) -> int:
    args = config_args(namespace)
    try:
        config = TpserveConfig.from_args(args)
    except ConfigError as exc:
        print(f"tpserve: {exc}", file=sys.stderr)
        return 2
    if not namespace.ray_address:
        _set_local_ray_env(namespace.ray_serve_fast_path)

    # Heavy imports after argument checks: `tpserve --help` stays instant.
    import ray
    from ray import serve

    from deployments.app import DEPLOYMENT_NAME, build_app
    from workers.model.default_model import ensure_default_model

    if config.model is None:
        # Once per machine; done here so that replicas find the folder ready.
        print("tpserve: preparing the default model (converted once, then cached) ...", flush=True)
        ensure_default_model()
    _init_ray(namespace, config.tensor_parallel_size)
    # After ray.init, which installs its own SIGTERM handler: SIGTERM takes the same clean path as
    # Ctrl-C. SIGINT is set explicitly too: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        serve.start(http_options={"host": namespace.host, "port": namespace.port})
        serve.run(build_app(args), name=DEPLOYMENT_NAME, route_prefix="/", blocking=False)
        model_name = served_model_name(namespace.host, namespace.port)
        print(ready_message(namespace.host, namespace.port, model_name), flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\ntpserve: shutting down ...", flush=True)
    finally:
        # A second Ctrl-C (a terminal signals the whole process group) must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        serve.shutdown()
        ray.shutdown()
    return 0


def _set_local_ray_env(fast_path: bool) -> None:
    """Before Ray is imported and started: Serve reads these at import time in every process of
    the cluster, which inherit this environment, and the raylet nices the workers it starts. (On
    a cluster joined with --ray-address, the environment its nodes were started with decides.)"""
    from deployments.serve_fast_path import fast_path_env, ray_start_env

    os.environ.update(ray_start_env(os.environ))
    if fast_path:
        os.environ.update(fast_path_env(os.environ))


def _init_ray(namespace: argparse.Namespace, tensor_parallel_size: int) -> None:
    import ray

    if namespace.ray_address:
        ray.init(address=namespace.ray_address)
        return
    # Always a fresh local cluster ("local"), never one someone else started here, with enough
    # logical CPUs for the tensor-parallel placement group asked for (one per rank plus the
    # replica): on a small machine Ray's default (the core count) would leave it pending forever.
    from workers.distributed.placement import local_ray_num_cpus

    # No dashboard unless asked for: its head process and ten module processes took ~0.04 cores
    # of an idle 2-core machine from a CPU engine (docs/performance.md, "Serving-path settings").
    ray.init(address="local", include_dashboard=namespace.ray_dashboard,
             num_cpus=local_ray_num_cpus(tensor_parallel_size, os.cpu_count() or 1))


def main(argv: list[str] | None = None) -> int:
    namespace = make_parser().parse_args(argv)
    if namespace.command == "serve":
        return serve_command(namespace)
    return 1


if __name__ == "__main__":
    sys.exit(main())
