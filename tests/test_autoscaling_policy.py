"""The engine-load autoscaling decision and how it is wired into Serve's autoscaling_config."""

from __future__ import annotations

from types import SimpleNamespace

from deployments.autoscaling import (
    POLICY_PATH,
    EngineLoad,
    EngineLoadPolicy,
    desired_replicas,
    engine_load_autoscaling_config,
)
from deployments.config import TpserveConfig
from deployments.scale_out import scale_out_options


def load(waiting=0.0, unfinished=0.0, kv_used=0.0, serve_requests=0.0) -> EngineLoad:
    return EngineLoad(waiting, unfinished, kv_used, serve_requests)


def test_idle_deployment_wants_no_replicas_beyond_serves_minimum():
    assert desired_replicas(load(), current=3, target_unfinished=8, max_waiting=2, max_kv_used=0.85) == 0


def test_request_count_sets_the_replica_count():
    assert desired_replicas(load(unfinished=20), 1, 8, 2, 0.85) == 3
    # Serve's own count covers requests the engines have not reported yet.
    assert desired_replicas(load(unfinished=0, serve_requests=9), 1, 8, 2, 0.85) == 2


def test_a_waiting_queue_adds_a_replica_even_below_the_request_target():
    # 4 requests on 1 replica is below the target of 8, but 3 of them wait for a batch slot.
    assert desired_replicas(load(waiting=3, unfinished=4), 1, 8, 2, 0.85) == 2


def test_a_nearly_full_kv_cache_adds_a_replica():
    assert desired_replicas(load(unfinished=4, kv_used=0.95), 2, 8, 2, 0.85) == 3
    assert desired_replicas(load(unfinished=4, kv_used=0.5), 2, 8, 2, 0.85) == 1


def test_policy_reads_serves_aggregated_replica_metrics():
    ctx = SimpleNamespace(
        aggregated_metrics={"engine_waiting": {"r1": 5.0, "r2": 1.0}, "engine_unfinished": {"r1": 9.0, "r2": 3.0},
                            "kv_used_fraction": {"r1": 0.5, "r2": 0.3}},
        total_num_requests=12.0, current_num_replicas=2, policy_state={})
    wanted, state = EngineLoadPolicy(target_unfinished_per_replica=4, max_waiting_per_replica=2)(ctx)
    assert wanted == 3
    assert state["last_engine_load"] == {"waiting": 6.0, "unfinished": 12.0, "kv_used": 0.4, "serve_requests": 12.0}


def test_config_selects_the_policy_and_passes_its_knobs():
    user = {"min_replicas": 1, "max_replicas": 3, "downscale_delay_s": 5, "max_waiting_per_replica": 1}
    serve_config = engine_load_autoscaling_config(user)
    assert serve_config["policy"] == {"policy_function": POLICY_PATH, "policy_kwargs": {"max_waiting_per_replica": 1}}
    assert "max_waiting_per_replica" not in serve_config and serve_config["max_replicas"] == 3
    options = scale_out_options(TpserveConfig(autoscaling_config=user, autoscaling_signal="engine_load"))
    from ray.serve.config import AutoscalingConfig

    parsed = AutoscalingConfig(**options["autoscaling_config"])
    assert parsed.policy.policy_function == POLICY_PATH and parsed.max_replicas == 3
    assert options["graceful_shutdown_timeout_s"] > 20
    # Serve's own policy unless asked.
    assert "autoscaling_config" not in scale_out_options(TpserveConfig(autoscaling_config=user))
