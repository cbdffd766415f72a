"""Each tensor-parallel rank on its own GPU: everything a rank allocates names cuda:{local_rank},
and every actor method that touches CUDA binds that device in its own thread first (CUDA's
current device is per thread; the Ray actor runs methods on a pool of threads). No GPU here: the
torch.cuda calls are faked and each allocation's device is recorded."""

from __future__ import annotations

import threading

import pytest
import torch

from model_configs.scaled import scaled_config
from workers.distributed.device_binding import rank_device
from workers.distributed.parallel_state import TPGroup
from workers.runner.kv_cache import GiB, MemoryProfile
from workers.worker import WorkerConfig, WorkerCore


class FakeCuda:
    """torch.cuda.set_device / current_device as CUDA keeps them: per thread, 0 until set."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.calls: list[tuple[str, torch.device]] = []

    def set_device(self, device) -> None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self._local.index = device.index
        self.calls.append((threading.current_thread().name, device))

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)


@pytest.fixture
def fake_cuda(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "set_device", cuda.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", cuda.current_device)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return cuda


def _config(path: str) -> WorkerConfig:
    return WorkerConfig(model_path=path, dtype=torch.float32, block_size=16, max_model_len=64,
                        kv_cache_memory_gib=0.01, gpu_memory_utilization=0.9, device="cuda", max_num_seqs=4,
                        load_format="dummy")


def test_rank_device_is_explicit_on_gpu_and_plain_elsewhere(fake_cuda):
    assert rank_device("cuda", 3) == torch.device("cuda", 3)
    assert rank_device("cpu", 3) == torch.device("cpu")
    fake_cuda.set_device(2)
    assert rank_device("cuda", None) == torch.device("cuda", 2)  # one in-process rank: its current GPU


def test_every_allocation_of_a_rank_asks_for_its_own_gpu(tmp_path, monkeypatch, fake_cuda):
    import workers.runner.profiling as profiling
    import workers.worker as worker_module

    asked: dict[str, torch.device] = {}

    def build_model(*args, **kwargs):
        asked["weights"] = torch.get_default_device()  # inside WorkerCore's `with torch.device(...)`
        with torch.device("cpu"):
            return real_build_model(*args, **kwargs)

    def profile_memory(model, device, config, weights_bytes):
        asked["profile"] = device
        return MemoryProfile(total=80 * GiB, in_use=1 * GiB, weights=weights_bytes, activation_peak=0, graph_pool=0)

    def allocate_kv_cache(spec, num_blocks, device):
        asked["kv_cache"] = device
        return real_allocate(spec, 4, torch.device("meta"))

    def make_graph_runner(model, kv_caches, **kwargs):
        asked["graphs"] = kwargs["device"]

        class NoCapture:
            def capture(self):
                asked["capture_thread_device"] = torch.device("cuda", torch.cuda.current_device())
        return NoCapture()

    class RecordingRunner:
        def __init__(self, model, kv_caches, block_size, device, *args, **kwargs):
            asked["runner"] = device

    real_build_model, real_allocate = worker_module.build_model, worker_module.allocate_kv_cache
    monkeypatch.setattr(worker_module, "build_model", build_model)
    monkeypatch.setattr(profiling, "profile_memory", profile_memory)
    monkeypatch.setattr(worker_module, "allocate_kv_cache", allocate_kv_cache)
    monkeypatch.setattr(worker_module, "make_graph_runner", make_graph_runner)
    monkeypatch.setattr(worker_module, "ModelRunner", RecordingRunner)

    core = WorkerCore(_config(scaled_config("llama-3-8b", tmp_path / "m")), TPGroup(rank=1, world_size=2),
                      local_rank=1)
    # Another thread (as Ray's pool would run it), whose current device starts at GPU 0.
    thread = threading.Thread(target=lambda: (core.init_kv_cache(core.load_model().num_blocks)), name="pool-1")
    thread.start()
    thread.join()
    assert asked == {name: torch.device("cuda", 1) for name in
                     ("weights", "profile", "kv_cache", "graphs", "runner", "capture_thread_device")}
    assert ("pool-1", torch.device("cuda", 1)) in fake_cuda.calls


def test_actor_methods_bind_the_rank_gpu_in_whichever_thread_runs_them(tmp_path, monkeypatch, fake_cuda):
    import torch.distributed as dist

    from workers.executors.ray_worker import Worker

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test; pin_device sets it
    seen: dict[str, int] = {}

    class FakeCore:
        def load_model(self):
            seen["load_model"] = torch.cuda.current_device()

        def init_kv_cache(self, num_blocks):
            seen["init_kv_cache"] = torch.cuda.current_device()

        def execute_model(self, out):
            seen["execute_model"] = torch.cuda.current_device()

    init_kwargs = {}
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: init_kwargs.update(k))
    monkeypatch.setattr(dist, "group", type("G", (), {"WORLD": None}))
    worker = Worker(rank=1, world_size=2, config=_config(scaled_config("llama-3-8b", tmp_path / "m")), num_threads=1)
    worker.pin_device(["4", "6"], 1)
    assert init_kwargs == {}

    def in_fresh_thread(fn, *args):
        thread = threading.Thread(target=fn, args=args)
        thread.start()
        thread.join()

    in_fresh_thread(worker.init_distributed, "127.0.0.1", 1, 5.0)
    assert init_kwargs["device_id"] == torch.device("cuda", 1)
    assert worker.core.device == torch.device("cuda", 1)
    worker.core = FakeCore()
    in_fresh_thread(worker.load_model)
    in_fresh_thread(worker.init_kv_cache, 8)
    in_fresh_thread(worker.execute_model, None)
    assert seen == {"load_model": 1, "init_kv_cache": 1, "execute_model": 1}
