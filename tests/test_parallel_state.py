"""Per-node GPU visibility and pinning of tensor-parallel ranks, and the NCCL defaults (pure)."""

from __future__ import annotations

import pytest

from workers.distributed.parallel_state import local_device_assignment, nccl_environment


def test_every_rank_sees_its_nodes_gpus_and_uses_its_own():
    # Ray handed out GPUs 3 and 1 on node a (out of order), 0 on node b.
    ranks = [("a", ["3"]), ("a", ["1"]), ("b", ["0"])]
    assert local_device_assignment(ranks) == [(["1", "3"], 1), (["1", "3"], 0), (["0"], 0)]


def test_gpu_ids_sort_numerically():
    ranks = [("n", [str(i)]) for i in (10, 2, 1, 0)]
    visible, index = local_device_assignment(ranks)[0]
    assert visible == ["0", "1", "2", "10"] and index == 3


def test_a_rank_must_hold_exactly_one_gpu():
    with pytest.raises(ValueError, match="exactly one GPU"):
        local_device_assignment([("n", ["0", "1"])])
    with pytest.raises(ValueError, match="exactly one GPU"):
        local_device_assignment([("n", [])])


def test_nccl_cumem_off_unless_the_user_chose():
    assert nccl_environment({}) == {"NCCL_CUMEM_ENABLE": "0"}
    assert nccl_environment({"NCCL_CUMEM_ENABLE": "1"}) == {}
