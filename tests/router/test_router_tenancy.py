"""The router's own API key check, and the tenant's cache_salt it sets from a header."""

from __future__ import annotations

import logging

import pytest

from tests.engine.entrypoints.secret_volume import SecretVolume
from tests.router.conftest import wait_until
from tests.router.test_router_proxy import COMPLETION
from tidegate.engine.entrypoints.openai.auth import KEY_FILE_POLL_S

KEY = "sk-router-secret"


@pytest.fixture
def keyed(backend, router):
    prefill, decode = backend("prefill"), backend("decode")
    return prefill, decode, router([prefill.url], [decode.url], api_key=KEY)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", COMPLETION),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/models", None),
    ],
)
@pytest.mark.parametrize(
    ("authorization", "code"),
    [(None, "invalid_api_key"), ("Bearer sk-wrong", "invalid_api_key"), (KEY, "invalid_api_key")],
    ids=["missing", "wrong", "no-scheme"],
)
def test_every_api_route_needs_the_key_and_no_leg_starts_without_it(
    keyed, path, body, authorization, code
):
    prefill, decode, router = keyed
    headers = {"Authorization": authorization} if authorization else {}
    if body is None:
        response = router.client.get(path, headers=headers)
    else:
        response = router.client.post(path, json=body, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == code
    assert KEY not in response.text
    assert prefill.engine.received == decode.engine.received == []


def test_the_right_key_passes_and_reaches_both_legs(keyed):
    prefill, decode, router = keyed
    headers = {"Authorization": f"Bearer {KEY}"}
    response = router.client.post("/v1/completions", json=COMPLETION, headers=headers)
    assert response.status_code == 200
    for engine in (prefill.engine, decode.engine):
        [leg] = engine.received
        assert leg.headers["authorization"] == f"Bearer {KEY}"


def test_a_rotated_key_file_is_followed_without_a_restart(backend, router, tmp_path):
    volume = SecretVolume(tmp_path)
    volume.write("sk-old\n")
    prefill, decode = backend("prefill"), backend("decode")
    proxy = router([prefill.url], [decode.url], api_key_file=str(volume.path))

    passed = []

    def status(key: str) -> int:
        headers = {"Authorization": f"Bearer {key}"}
        code = proxy.client.post("/v1/completions", json=COMPLETION, headers=headers).status_code
        if code == 200:
            passed.append(key)
        return code

    assert status("sk-old") == 200 and status("sk-new") == 401
    volume.write("sk-old\nsk-new\n")
    wait_until(lambda: status("sk-new") == 200, KEY_FILE_POLL_S + 2.0, "the new key")
    assert status("sk-old") == 200
    volume.write("sk-new\n")
    wait_until(lambda: status("sk-old") == 401, KEY_FILE_POLL_S + 2.0, "the old key refused")
    assert status("sk-new") == 200
    # The fake engines check no key: each 401 was the router's own, and no leg started for it.
    for engine in (prefill.engine, decode.engine):
        assert [leg.headers["authorization"] for leg in engine.received] == [
            f"Bearer {key}" for key in passed
        ]


def test_probes_and_metrics_need_no_key_and_never_show_it(keyed):
    _, _, router = keyed
    for path in ("/health", "/live", "/metrics"):
        response = router.client.get(path)
        assert response.status_code == 200, path
        assert KEY not in response.text


@pytest.mark.parametrize(
    ("headers", "body_salt", "expected"),
    [
        ({"X-Tenant-Id": "acme"}, None, "acme"),
        # A client may not choose its salt: it could choose another tenant's.
        ({"X-Tenant-Id": "acme"}, "globex", "acme"),
        ({}, "globex", None),
    ],
    ids=["from-header", "header-wins", "body-alone-dropped"],
)
def test_the_tenant_header_sets_the_cache_salt_on_both_legs(
    backend, router, headers, body_salt, expected
):
    prefill, decode = backend("prefill"), backend("decode")
    proxy = router([prefill.url], [decode.url], cache_salt_header="x-tenant-id")
    body = dict(COMPLETION, cache_salt=body_salt) if body_salt else COMPLETION
    assert proxy.client.post("/v1/completions", json=body, headers=headers).status_code == 200
    for engine in (prefill.engine, decode.engine):
        [leg] = engine.received
        assert leg.body["cache_salt"] == expected
        # An instance configured with the same header sees it too, and derives the same salt.
        assert leg.headers.get("x-tenant-id") == headers.get("X-Tenant-Id")


def test_without_a_tenant_header_the_clients_salt_passes_unchanged(pd):
    prefill, decode, router = pd
    body = dict(COMPLETION, cache_salt="mine")
    assert router.client.post("/v1/completions", json=body).status_code == 200
    assert prefill.engine.received[0].body["cache_salt"] == "mine"
    assert decode.engine.received[0].body["cache_salt"] == "mine"


def test_no_key_reaches_the_routers_log(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    _, _, router = keyed
    for key in (KEY, "sk-guessed"):
        router.client.post(
            "/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {key}"}
        )
    assert caplog.records  # the router and its client did log at DEBUG
    assert KEY not in caplog.text and "sk-guessed" not in caplog.text
