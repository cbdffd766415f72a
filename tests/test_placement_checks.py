"""Issue 12 item 9: a placement group the cluster can never hold fails at deploy time, saying
what is needed, what the cluster has and what to do; `tpserve serve` sizes its local Ray."""

from __future__ import annotations

import pytest

from deployments.config import TpserveConfig
from workers.distributed.placement import (
    PlacementError,
    local_ray_num_cpus,
    placement_bundles,
    serve_deployment_ray_options,
    unmet_placement,
)


def test_strict_pack_needs_the_sum_on_one_node():
    bundles = placement_bundles(3, use_gpu=False, replica_cpus=1)  # 2 + 1 + 1 CPU
    assert unmet_placement(bundles, "STRICT_PACK", [{"CPU": 4.0}]) is None
    problem = unmet_placement(bundles, "STRICT_PACK", [{"CPU": 2.0}, {"CPU": 2.0}])
    assert problem is not None and "4 CPU on one node" in problem and "2 CPU" in problem
    # The same two nodes can hold it when the group may spread.
    assert unmet_placement(bundles, "SPREAD", [{"CPU": 2.0}, {"CPU": 2.0}]) is None


def test_spread_needs_every_bundle_to_fit_somewhere_and_the_sum_overall():
    gpu_bundles = placement_bundles(2, use_gpu=True, replica_cpus=1)
    assert "GPU" in unmet_placement(gpu_bundles, "PACK", [{"CPU": 64.0}])
    assert "2 GPU" in unmet_placement(gpu_bundles, "SPREAD", [{"CPU": 8.0, "GPU": 1.0}])
    assert unmet_placement(gpu_bundles, "SPREAD", [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]) is None


def test_local_ray_gets_a_cpu_per_rank_plus_the_replica():
    assert local_ray_num_cpus(3, available_cpus=2) >= 4
    assert local_ray_num_cpus(1, available_cpus=16) == 16


def test_an_impossible_group_fails_at_deploy_time_with_both_sides_and_a_remedy(ray_cluster):
    import ray

    total_cpus = int(ray.cluster_resources()["CPU"])
    config = TpserveConfig(tensor_parallel_size=total_cpus + 1)
    with pytest.raises(PlacementError) as failure:
        serve_deployment_ray_options(config, use_gpu=False)
    message = str(failure.value)
    assert f"tensor_parallel_size={total_cpus + 1}" in message
    assert f"{total_cpus + 2:g} CPU" in message  # needed: one per rank + the replica's
    assert f"{total_cpus:g} CPU" in message  # what the (one-node) cluster has
    assert "ray start" in message and "lower tensor_parallel_size" in message
    # The check can be turned off for autoscaling clusters; a group that fits passes.
    relaxed = TpserveConfig(tensor_parallel_size=total_cpus + 1, check_placement_fits=False)
    assert serve_deployment_ray_options(relaxed, use_gpu=False)["placement_group_strategy"] == "STRICT_PACK"
    serve_deployment_ray_options(TpserveConfig(tensor_parallel_size=2), use_gpu=False)


def test_tpserve_serve_starts_a_local_ray_big_enough_for_the_tp_degree(monkeypatch, tmp_path):
    import ray

    from deployments import cli

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    namespace = cli.make_parser().parse_args(
        ["serve", "--model", str(tmp_path), "--tensor-parallel-size", "3"]
    )
    with pytest.raises(Stop):
        cli.serve_command(namespace)
    assert seen["address"] == "local" and seen["num_cpus"] >= 4  # 3 ranks + the replica
