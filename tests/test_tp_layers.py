"""Sharded layers on a real 2-process gloo group equal their unsharded versions.

Both ranks are spawned once for the module (torch.multiprocessing); each builds the full weights
from the same seed, loads its shard through the layer's weight loader, runs the layer, compares
with the unsharded computation and writes the worst absolute error of every check to a JSON file.
The tests below read those files. Memory: each rank's parameters of a tiny Llama loaded from
safetensors take at most 1/N of the sharded weights plus the replicated ones (the norms).
The dispatch's control channel (small and buffer-overflowing messages) is checked there too.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

WORLD_SIZE = 2
TOLERANCE = 1e-5


def _close(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, f"{tuple(actual.shape)} != {tuple(expected.shape)}"
    return float((actual - expected).abs().max())


def _check_column(tp) -> float:
    from workers.model.tp_layers import ColumnParallelLinear

    torch.manual_seed(0)
    gate, up, bias, x = torch.randn(8, 12), torch.randn(6, 12), torch.randn(14), torch.randn(3, 12)
    layer = ColumnParallelLinear(12, [8, 6], tp, bias=True)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    layer.weight_loader(layer.bias, bias[:8], 0)
    layer.weight_loader(layer.bias, bias[8:], 1)
    full_gate, full_up = F.linear(x, gate, bias[:8]), F.linear(x, up, bias[8:])
    r = tp.rank
    expected = torch.cat([full_gate[:, r * 4 : (r + 1) * 4], full_up[:, r * 3 : (r + 1) * 3]], dim=-1)
    return _close(layer(x), expected)


def _check_qkv(tp, num_kv_heads: int) -> float:
    from workers.model.tp_layers import QKVParallelLinear

    heads, head_dim, hidden = 4, 3, 10
    torch.manual_seed(1)
    wq, wk, wv = torch.randn(heads * head_dim, hidden), torch.randn(num_kv_heads * head_dim, hidden), \
        torch.randn(num_kv_heads * head_dim, hidden)
    x = torch.randn(5, hidden)
    layer = QKVParallelLinear(hidden, head_dim, heads, num_kv_heads, tp)
    for shard_id, w in enumerate((wq, wk, wv)):
        layer.weight_loader(layer.weight, w, shard_id)
    local_heads = heads // tp.world_size
    # KV heads split when there are enough, else replicated: rank r uses KV head r * KV // N.
    kv_heads_here = (list(range(tp.rank * num_kv_heads // tp.world_size, (tp.rank + 1) * num_kv_heads // tp.world_size))
                     if num_kv_heads >= tp.world_size else [tp.rank * num_kv_heads // tp.world_size])

    def rows(w: torch.Tensor, head_ids: list[int]) -> torch.Tensor:
        return torch.cat([w[h * head_dim : (h + 1) * head_dim] for h in head_ids])

    q_heads = list(range(tp.rank * local_heads, (tp.rank + 1) * local_heads))
    expected = torch.cat([x @ rows(wq, q_heads).T, x @ rows(wk, kv_heads_here).T, x @ rows(wv, kv_heads_here).T], -1)
    return _close(layer(x), expected)


def _check_row(tp) -> float:
    from workers.model.tp_layers import RowParallelLinear

    torch.manual_seed(2)
    weight, bias, x = torch.randn(5, 12), torch.randn(5), torch.randn(3, 12)
    layer = RowParallelLinear(12, 5, tp, bias=True)
    layer.weight_loader(layer.weight, weight)
    layer.weight_loader(layer.bias, bias)
    local_x = x[:, tp.rank * 6 : (tp.rank + 1) * 6]
    return _close(layer(local_x), F.linear(x, weight, bias))


def _check_embedding(tp) -> float:
    from workers.model.tp_layers import VocabParallelEmbedding

    torch.manual_seed(3)
    table = torch.randn(11, 6)  # 11 rows: not divisible by 2, the last shard is padded
    ids = torch.tensor([0, 5, 6, 10, 3, 10, 7])
    layer = VocabParallelEmbedding(11, 6, tp)
    layer.weight_loader(layer.weight, table)
    return _close(layer(ids), F.embedding(ids, table))


def _check_lm_head(tp) -> float:
    from workers.model.tp_layers import ParallelLMHead

    torch.manual_seed(4)
    table, hidden = torch.randn(11, 6), torch.randn(4, 6)
    layer = ParallelLMHead(11, 6, tp)
    layer.weight_loader(layer.weight, table)
    logits = layer.compute_logits(hidden)
    if tp.rank != 0:
        return 0.0 if logits is None else float("inf")  # only rank 0 gets logits
    return _close(logits, hidden @ table.T)


def _param_bytes(model_path: str, tp) -> dict[str, int]:
    """This rank's parameter bytes vs the checkpoint's sharded and replicated bytes."""
    from safetensors import safe_open

    from workers.model.decoder import DecoderForCausalLM
    from workers.model.config import ModelConfig

    model = DecoderForCausalLM(ModelConfig.from_pretrained(model_path), tp)
    model.load_weights(model_path)
    sharded = replicated = 0
    for file in Path(model_path).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                nbytes = 4 * int(torch.tensor(shape).prod())
                if "norm" in name:
                    replicated += nbytes
                else:
                    sharded += nbytes
    return {"rank": sum(p.numel() * p.element_size() for p in model.parameters()),
            "sharded": sharded, "replicated": replicated}


def _check_control_channel(rank: int, store_port: int) -> float:
    """The gloo dispatch's channel: rank 0 plays the engine (control rank 0). Small and large
    (overflowing the fixed buffer) messages both ways; 0.0 when all arrive intact."""
    from workers.distributed.control_channel import ControlChannel, make_control_channel, make_control_store

    store = make_control_store("127.0.0.1", store_port, WORLD_SIZE, is_engine=rank == 0)
    channel = make_control_channel(store, rank, WORLD_SIZE, timeout_s=60)
    small = {"step": 1, "ids": list(range(100))}
    large = {"step": 2, "ids": list(range(50_000))}  # ~150 KB pickled > ControlChannel.CAPACITY
    if rank == 0:
        channel.broadcast(small)
        channel.broadcast(large)
        replies = [channel.receive(src=1), channel.receive(src=1)]
        return 0.0 if replies == [large, small] else 1.0
    received = [channel.receive_broadcast(), channel.receive_broadcast()]
    channel.send(large, ControlChannel.ENGINE)
    channel.send(small, ControlChannel.ENGINE)
    return 0.0 if received == [small, large] else 1.0


def _run_rank(rank: int, port: int, out_dir: str, model_path: str, store_port: int) -> None:
    import torch.distributed as dist

    from workers.distributed.parallel_state import TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    tp = TPGroup(rank=rank, world_size=WORLD_SIZE, group=dist.group.WORLD)
    results: dict[str, object] = {}
    checks = {
        "column": lambda: _check_column(tp),
        "qkv_split_kv": lambda: _check_qkv(tp, num_kv_heads=2),
        "qkv_replicated_kv": lambda: _check_qkv(tp, num_kv_heads=1),
        "row": lambda: _check_row(tp),
        "embedding": lambda: _check_embedding(tp),
        "lm_head": lambda: _check_lm_head(tp),
        "param_bytes": lambda: _param_bytes(model_path, tp),
        "control_channel": lambda: _check_control_channel(rank, store_port),
    }
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
            results[name] = f"{type(exc).__name__}: {exc}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    from model_fixtures import make_tiny_llama

    model_path = make_tiny_llama(tmp_path_factory.mktemp("tiny-layers"), num_heads=8, num_kv_heads=4)
    out_dir = tmp_path_factory.mktemp("tp-layer-results")
    ports = []
    for _ in range(2):  # the default group's rendezvous, the control group's store
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    torch.multiprocessing.spawn(_run_rank, args=(ports[0], str(out_dir), model_path, ports[1]),
                                nprocs=WORLD_SIZE, join=True)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


@pytest.mark.parametrize("check", ["column", "qkv_split_kv", "qkv_replicated_kv", "row", "embedding", "lm_head",
                                   "control_channel"])
def test_sharded_layer_equals_unsharded(rank_results, check):
    for rank, results in enumerate(rank_results):
        error = results[check]
        assert not isinstance(error, str), f"rank {rank}: {error}"
        assert error <= TOLERANCE, f"rank {rank}: {check} differs from the unsharded layer by {error}"


def test_rank_holds_its_share_of_the_weights(rank_results):
    for rank, results in enumerate(rank_results):
        sizes = results["param_bytes"]
        assert not isinstance(sizes, str), f"rank {rank}: {sizes}"
        limit = sizes["sharded"] / WORLD_SIZE + sizes["replicated"]
        assert sizes["rank"] <= limit, f"rank {rank} holds {sizes['rank']} bytes > {limit:.0f}"
        assert sizes["rank"] >= 0.9 * limit, f"rank {rank} holds {sizes['rank']} bytes: weights missing?"
