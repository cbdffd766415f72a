"""init_local_ray: one more try, with fresh arguments, only when Ray's node start window passes."""

from __future__ import annotations

import pytest
import ray

import local_ray


class FakeInit:
    """Stands in for ray.init: raises the queued errors in turn, then succeeds."""

    def __init__(self, errors: list[Exception]):
        self.errors = errors
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.errors:
            raise self.errors.pop(0)


START_TIMEOUT = Exception("The current node timed out during startup. This could happen because ...")


@pytest.fixture
def no_cleanup(monkeypatch):
    stopped = []
    monkeypatch.setattr(local_ray, "_stop_orphaned_ray_processes", lambda: stopped.append(True))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    return stopped


def test_a_missed_start_window_is_tried_again_with_fresh_arguments(monkeypatch, no_cleanup):
    fake = FakeInit([START_TIMEOUT])
    monkeypatch.setattr(ray, "init", fake)
    ports = iter([6001, 6002])
    local_ray.init_local_ray(lambda: {"port": next(ports)})
    assert fake.calls == [{"port": 6001}, {"port": 6002}]
    assert no_cleanup == [True]


def test_a_second_miss_is_raised(monkeypatch, no_cleanup):
    monkeypatch.setattr(ray, "init", FakeInit([START_TIMEOUT, START_TIMEOUT]))
    with pytest.raises(Exception, match="timed out during startup"):
        local_ray.init_local_ray(dict)


def test_other_errors_are_raised_at_once(monkeypatch, no_cleanup):
    fake = FakeInit([ValueError("bad argument")])
    monkeypatch.setattr(ray, "init", fake)
    with pytest.raises(ValueError):
        local_ray.init_local_ray(dict)
    assert len(fake.calls) == 1 and no_cleanup == []
