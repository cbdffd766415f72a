"""The start-up paths as pure functions: `tpserve serve` arguments and its ready line, the `auto`
dtype choice, CPU threads, the device of the ranks, and the Serve placement options for GPU and
CPU replicas (no Ray, no server, no GPU)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from deployments import cli
from deployments.config import TpserveConfig
from workers.distributed import placement
from workers import runtime


# ---- tpserve serve ---------------------------------------------------------------------------

def test_serve_flags_become_config_fields_of_the_right_types():
    namespace = cli.make_parser().parse_args([
        "serve", "--host", "0.0.0.0", "--port", "9123", "--model", "/models/x", "--tensor-parallel-size", "2",
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--dtype", "bfloat16",
        "--autoscaling-config", '{"min_replicas": 1, "max_replicas": 3}',
    ])
    assert (namespace.host, namespace.port) == ("0.0.0.0", 9123)
    args = cli.config_args(namespace)
    assert "host" not in args and "port" not in args  # server flags are not config fields
    config = TpserveConfig.from_args(args)
    assert config.model == "/models/x" and config.tensor_parallel_size == 2 and config.max_num_seqs == 8
    assert config.enable_prefix_caching is False and config.dtype == "bfloat16"
    assert config.autoscaling_config == {"min_replicas": 1, "max_replicas": 3}


def test_unset_flags_leave_the_config_defaults():
    namespace = cli.make_parser().parse_args(["serve"])
    assert cli.config_args(namespace) == {}
    assert (namespace.host, namespace.port, namespace.ray_address) == (cli.DEFAULT_HOST, cli.DEFAULT_PORT, None)


def test_every_config_field_has_a_flag():
    help_text = cli.make_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for name in TpserveConfig.model_fields:
        assert "--" + name.replace("_", "-") in help_text, name


def test_a_bad_value_exits_2_naming_the_field_before_starting_anything(capsys):
    assert cli.main(["serve", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    assert cli.main(["serve", "--dtype", "float8"]) == 2
    assert "dtype" in capsys.readouterr().err


def test_help_imports_neither_ray_nor_torch():
    code = ("import sys; from deployments.cli import make_parser; make_parser().format_help(); "
            "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("host, reach", [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("10.1.2.3", "10.1.2.3")])
def test_ready_line_says_where_and_gives_a_request_that_parses(host, reach):
    message = cli.ready_message(host, 8123, "SmolLM2-135M-Instruct")
    assert f"tpserve is ready: SmolLM2-135M-Instruct on http://{reach}:8123" in message
    curl_line = next(line.strip() for line in message.splitlines() if line.strip().startswith("curl "))
    argv = shlex.split(curl_line)  # valid shell: the body is one quoted word
    assert argv[1] == f"http://{reach}:8123/v1/chat/completions"
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == "SmolLM2-135M-Instruct" and body["messages"][0]["role"] == "user"
    assert "Content-Type: application/json" in argv


# ---- dtype, threads, device ------------------------------------------------------------------

@pytest.mark.parametrize("flags, fast", [
    ("fpu sse avx512f avx512_bf16 avx512_vnni", True),
    ("fpu sse amx_bf16 amx_tile", True),
    ("fpu sse avx2 avx512f", False),  # AVX-512 without AVX512-BF16: no bf16 panels in its build
    ("fpu sse avx2 fma", True),  # AVX2 + FMA: the avx2 build's bf16 panels
    ("fpu sse avx2", False),
    ("fpu sse avx512_bf16x", False),  # a longer flag name is not the flag
])
def test_fast_bf16_read_from_the_cpu_flags(tmp_path, flags, fast):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert runtime.cpu_has_fast_bf16(str(cpuinfo)) is fast


def test_avx2_counts_as_fast_bf16_only_with_the_kernels(tmp_path, monkeypatch):
    """AVX2's bf16 speed is the kernels' panels: with cpu_kernels off, auto stays float32."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert runtime.cpu_has_fast_bf16(str(cpuinfo), bf16_panels=lambda: True)
    assert not runtime.cpu_has_fast_bf16(str(cpuinfo), bf16_panels=lambda: False)
    monkeypatch.setattr(runtime, "cpu_flags", lambda *_: {"avx2", "fma"})
    monkeypatch.setattr(runtime, "kernels_serve_bf16", lambda mode: mode != "off")
    assert runtime.resolve_dtype("auto", "cpu") == torch.bfloat16
    assert runtime.resolve_dtype("auto", "cpu", "off") == torch.float32
    amx = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}
    monkeypatch.setattr(runtime, "cpu_flags", lambda *_: amx)
    assert runtime.resolve_dtype("auto", "cpu", "off") == torch.bfloat16  # oneDNN's bf16 GEMM


def test_native_bf16_never_asks_for_the_kernels(tmp_path):
    """AVX512-BF16 / AMX serve bf16 through oneDNN: resolving auto there must not build kernels."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n")

    def never():
        raise AssertionError("bf16_panels asked on a CPU with native bf16")

    assert runtime.cpu_has_fast_bf16(str(cpuinfo), bf16_panels=never)


def test_kernels_that_fail_to_load_keep_auto_on_float32(monkeypatch, caplog):
    """AVX2 with the kernels' build failing under cpu_kernels auto (no compiler, say): auto must not
    pick bf16, whose GEMMs would then be torch's emulated ones; under "on" the failure is raised."""
    from workers.cpu import kernels

    monkeypatch.setattr(runtime, "cpu_flags", lambda *_: {"avx2", "fma"})
    monkeypatch.setattr(kernels, "load", lambda mode="auto", max_variant=None: False)
    with caplog.at_level("WARNING", logger=runtime.__name__):
        assert runtime.resolve_dtype("auto", "cpu", "auto") == torch.float32
    assert "dtype auto: float32" in caplog.text

    def fail(mode="auto", max_variant=None):
        raise kernels.KernelsUnavailable("cpu_kernels: on, but ... no compiler")

    monkeypatch.setattr(kernels, "load", fail)
    with pytest.raises(kernels.KernelsUnavailable):
        runtime.resolve_dtype("auto", "cpu", "on")


def test_no_cpuinfo_means_no_fast_bf16(tmp_path):
    assert runtime.cpu_has_fast_bf16(str(tmp_path / "missing")) is False


def test_cpuinfo_field_reads_the_first_cpus_line(tmp_path):
    from workers.cpu.kernels import cpuinfo_field

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2\n\n"
                       "processor\t: 1\nmodel name\t: other\n")
    assert cpuinfo_field("model name", str(cpuinfo)) == "AMD EPYC"
    assert cpuinfo_field("flags", str(cpuinfo)) == "fpu avx2"
    assert cpuinfo_field("microcode", str(cpuinfo)) == ""
    assert cpuinfo_field("flags", str(tmp_path / "missing")) == ""


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_auto_dtype(monkeypatch, fast_bf16):
    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda *_: fast_bf16)
    assert runtime.resolve_dtype("auto", "cpu") == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert runtime.resolve_dtype("auto", "cuda") == torch.bfloat16
    for name in ("float32", "bfloat16"):
        assert runtime.resolve_dtype(name, "cpu") == getattr(torch, name)
    assert runtime.resolve_dtype("float16", "cuda") == torch.float16


def test_float16_on_cpu_is_refused_naming_the_field():
    # The CPU kernels and oneDNN paths take float32 or bfloat16 only.
    with pytest.raises(ValueError, match="dtype: float16"):
        runtime.resolve_dtype("float16", "cpu")


def test_cpu_threads_as_asked_else_every_allowed_core():
    before = torch.get_num_threads()
    try:
        runtime.set_cpu_threads(1)
        assert torch.get_num_threads() == 1
        runtime.set_cpu_threads(None)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)


def test_worker_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(placement, "cluster_has_gpus", lambda: True)
    assert runtime.worker_device(1) == "cpu"  # TP=1 runs here: this process's own devices
    assert runtime.worker_device(2) == "cuda"  # TP>1: the cluster's
    monkeypatch.setattr(placement, "cluster_has_gpus", lambda: False)
    assert runtime.worker_device(2) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.worker_device(1) == "cuda"


# ---- placement options -----------------------------------------------------------------------

def _config(tp: int, strategy: str = "STRICT_PACK") -> SimpleNamespace:
    # No fit check against whatever Ray an earlier test in this process left connected (it has
    # no GPUs): the bundles' shape is under test here, the check in test_placement_checks.py.
    return SimpleNamespace(tensor_parallel_size=tp, placement_strategy=strategy, check_placement_fits=False)


def test_tp1_uses_serve_defaults():
    assert placement.serve_deployment_ray_options(_config(1), use_gpu=True) == {}


@pytest.mark.parametrize("use_gpu", [True, False])
def test_tp_placement_group_has_one_bundle_per_rank_and_the_replica_cpu_in_bundle_0(use_gpu):
    options = placement.serve_deployment_ray_options(_config(3, "SPREAD"), use_gpu=use_gpu, replica_cpus=1.0)
    device = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    first = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 2.0}
    assert options == {
        "ray_actor_options": {"num_cpus": 1.0},
        "placement_group_bundles": [first, device, device],
        "placement_group_strategy": "SPREAD",
    }


def test_bundles_reject_a_tp_size_below_one_and_skip_a_zero_replica_share():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        placement.placement_bundles(0, use_gpu=False, replica_cpus=1.0)
    assert placement.placement_bundles(2, use_gpu=True, replica_cpus=0.0) == [{"GPU": 1.0}, {"GPU": 1.0}]


def test_gpus_found_through_the_cluster_when_this_process_sees_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake_ray = SimpleNamespace(is_initialized=lambda: True, cluster_resources=lambda: {"CPU": 8.0, "GPU": 2.0})
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    assert placement.cluster_has_gpus() is True
    fake_ray.cluster_resources = lambda: {"CPU": 8.0}
    assert placement.cluster_has_gpus() is False
    fake_ray.is_initialized = lambda: False
    assert placement.cluster_has_gpus() is False


@pytest.mark.parametrize("accelerator, cluster_gpus, wants_gpu", [
    ("auto", True, True), ("auto", False, False), ("gpu", False, True), ("cpu", True, False)])
@pytest.mark.parametrize("tp", [1, 2])
def test_accelerator_decides_what_replicas_ask_for(monkeypatch, accelerator, cluster_gpus, wants_gpu, tp):
    from deployments.app import placement_options
    from deployments.config import TpserveConfig

    monkeypatch.setattr(placement, "cluster_has_gpus", lambda: cluster_gpus)
    config = TpserveConfig(accelerator=accelerator, tensor_parallel_size=tp, check_placement_fits=False)
    options = placement_options(config)
    if tp == 1:
        assert options.get("ray_actor_options", {}).get("num_gpus", 0) == (1 if wants_gpu else 0)
    else:
        assert all(("GPU" in bundle) == wants_gpu for bundle in options["placement_group_bundles"])
