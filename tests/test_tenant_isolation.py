"""Tenant isolation of the prefix cache (issue 42 goal 6).

By default the prefix cache is shared and `usage.prompt_tokens_details.cached_tokens` is exact, so
one client learns whether another sent a prompt (docs/security.md). With `cache_salt_header`
set, each request's cache salt is derived from that header (hashed; the raw value is kept
nowhere), so tenants never share cached prefixes; a client's own `cache_salt` splits its tenant's
cache further but cannot reach another tenant's.

Fast: the salt the engine receives, over the scripted fake engine. Slow (the real model): the
cross-tenant probe sees `cached_tokens` 0 where the same tenant gets the hit.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from deployments.config import TpserveConfig
from deployments.http.api_server import make_api
from deployments.http.serving_common import tenant_cache_salt
from test_serving_fake_engine import FakeEngine, run

HEADER = "X-Tenant-Key"
SECRET_A = "sk-tenant-a-0123456789"
SECRET_B = "sk-tenant-b-9876543210"


class TenantEngine(FakeEngine):
    def __init__(self, **config) -> None:
        super().__init__()
        self.config = TpserveConfig(**config)


def salt_seen(engine: FakeEngine, headers: dict[str, str], body_extra: dict | None = None) -> str | None:
    async def send() -> None:
        transport = httpx.ASGITransport(app=make_api(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://tpserve") as client:
            response = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, **(body_extra or {})},
                                         headers=headers)
            assert response.status_code == 200, response.text

    before = len(engine.calls)
    run(send())
    (call,) = engine.calls[before:]
    return call[2].cache_salt


def test_off_by_default_the_clients_salt_passes_through_and_headers_do_nothing():
    engine = TenantEngine()
    assert salt_seen(engine, {HEADER: SECRET_A}) is None
    assert salt_seen(engine, {HEADER: SECRET_A}, {"cache_salt": "mine"}) == "mine"


def test_tenants_get_distinct_salts_derived_from_the_header_never_holding_its_value(caplog):
    engine = TenantEngine(cache_salt_header=HEADER)
    with caplog.at_level(logging.DEBUG):
        a1 = salt_seen(engine, {HEADER: SECRET_A})
        a2 = salt_seen(engine, {HEADER.lower(): SECRET_A})  # header names match case-insensitively
        b = salt_seen(engine, {HEADER: SECRET_B})
        anonymous = salt_seen(engine, {})
    assert a1 == a2 and len({a1, b, anonymous}) == 3
    assert SECRET_A not in a1 and SECRET_B not in b
    assert SECRET_A not in caplog.text and SECRET_B not in caplog.text


def test_a_clients_salt_combines_with_its_tenants_and_cannot_name_another_tenants():
    engine = TenantEngine(cache_salt_header=HEADER)
    a = salt_seen(engine, {HEADER: SECRET_A})
    b = salt_seen(engine, {HEADER: SECRET_B})
    a_split = salt_seen(engine, {HEADER: SECRET_A}, {"cache_salt": "project-1"})
    assert a_split not in (a, b) and a_split.startswith(a)
    # Tenant B (or a request with no header) sending A's salt string as its own gets neither A's nor B's.
    for headers in ({HEADER: SECRET_B}, {}):
        forged = salt_seen(engine, headers, {"cache_salt": a})
        assert forged not in (a, b, a_split)
    assert tenant_cache_salt(SECRET_A, None) == a


# ---- the probe, on the real engine --------------------------------------------------------------

# Long enough for several whole KV blocks (16 tokens each).
SECRET_PROMPT = ("Internal memo: the merger with Northwind closes on March 3rd; do not share the "
                 "price of 41 dollars per share with anyone outside the deal team. ") * 3


@pytest.fixture(scope="module")
def live():
    from live_app import LiveApp
    from model_fixtures import default_model_path

    config = TpserveConfig(model=default_model_path(), dtype="float32", kv_cache_memory_gib=0.05,
                           max_model_len=512, max_num_seqs=4, cache_salt_header=HEADER)
    app = LiveApp(config)
    yield app
    app.close()


def cached_tokens(live, headers: dict[str, str], prompt: str = SECRET_PROMPT) -> int:
    async def send() -> int:
        transport = httpx.ASGITransport(app=live.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tpserve", timeout=120) as client:
            response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                                         headers=headers)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    return live.call(send())


@pytest.mark.slow
def test_a_probe_across_tenants_sees_no_cached_tokens_while_the_same_tenant_hits(live):
    assert cached_tokens(live, {HEADER: SECRET_A}) == 0  # A sends the prompt first
    # B probes with the same prompt: nothing of A's is visible (with one shared cache, the
    # whole-block prefix would show as cached here).
    assert cached_tokens(live, {HEADER: SECRET_B}) == 0
    assert cached_tokens(live, {}) == 0  # nor to a request without the header
    assert cached_tokens(live, {HEADER: SECRET_B, "x-other": "1"}) > 0  # B's own send is B's hit
    hit = cached_tokens(live, {HEADER: SECRET_A})
    assert hit >= 32, "the same tenant reuses its prefix"


@pytest.mark.slow
def test_a_shared_prefix_within_a_tenant_still_hits(live):
    # The control: the cache works under salting, for requests of one tenant.
    other = SECRET_PROMPT.replace("Northwind", "Southwind")
    cached_tokens(live, {HEADER: "tenant-c"}, other)
    assert cached_tokens(live, {HEADER: "tenant-c"}, other) >= 32
