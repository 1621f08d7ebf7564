"""Where the API keys come from, and whose cache_salt a request carries."""

from __future__ import annotations

import pytest

from tests.engine.entrypoints.fake_engine import MODEL, SyncAPI
from tidegate.engine.config import RouterArgs, ServerArgs
from tidegate.engine.entrypoints.openai.api_server import build_app
from tidegate.engine.entrypoints.openai.auth import APIKeys, load_api_keys


def only(keys: APIKeys | None, *valid: str) -> bool:
    """Whether `keys` accept exactly `valid` of the keys these tests use."""
    tried = ("sk-flag", "sk-from-file", "sk-second", "sk-from-env")
    return keys is not None and all(keys.matches(k.encode()) == (k in valid) for k in tried)


def test_the_key_comes_from_the_flag_then_the_file_then_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("  sk-from-file\n")  # as a Secret mounted from `kubectl create secret`
    env = {"TIDEGATE_API_KEY": "sk-from-env"}
    assert only(load_api_keys(ServerArgs(api_key="sk-flag"), env), "sk-flag")
    from_file = load_api_keys(ServerArgs(api_key_file=str(key_file)), env)
    assert only(from_file, "sk-from-file") and from_file.path == str(key_file)
    router_args = RouterArgs(decode=["http://d"], api_key_file=str(key_file))
    assert only(load_api_keys(router_args, {}), "sk-from-file")
    assert only(load_api_keys(ServerArgs(), env), "sk-from-env")
    assert load_api_keys(ServerArgs(), {}) is None
    assert load_api_keys(ServerArgs(), {"TIDEGATE_API_KEY": ""}) is None
    # Only the file holds several keys, and only the file is followed.
    key_file.write_text("# rotating: the second goes live on Monday\nsk-from-file\nsk-second\n")
    both = load_api_keys(ServerArgs(api_key_file=str(key_file)), {})
    assert only(both, "sk-from-file", "sk-second")
    assert load_api_keys(ServerArgs(api_key="sk-flag"), {}).path is None
    assert load_api_keys(ServerArgs(), env).path is None


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (dict(api_key="a", api_key_file="/k"), "not both"),
        (dict(api_key=""), "--api-key is empty"),
        (dict(api_key_file="{tmp}/missing"), "cannot read --api-key-file {tmp}/missing"),
        (dict(api_key_file="{tmp}/empty"), "--api-key-file {tmp}/empty holds no key"),
        (dict(api_key_file="{tmp}/comments"), "--api-key-file {tmp}/comments holds no key"),
        (dict(api_key_file="{tmp}/binary"), "--api-key-file {tmp}/binary is not UTF-8 text"),
    ],
    ids=["both", "empty-flag", "missing-file", "empty-file", "only-comments", "not-utf-8"],
)
def test_a_key_that_cannot_be_used_is_refused_with_the_reason(tmp_path, args, words):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "comments").write_text("# the key goes here\n\n")
    (tmp_path / "binary").write_bytes(b"sk-\xff\n")
    values = {k: v.format(tmp=tmp_path) for k, v in args.items()}
    with pytest.raises(ValueError) as caught:
        load_api_keys(ServerArgs(**values), {})
    assert words.format(tmp=tmp_path) in str(caught.value)


def test_the_key_never_shows_in_the_arguments_printed_form():
    args = ServerArgs(api_key="sk-do-not-print")
    assert "sk-do-not-print" not in repr(args)
    assert "sk-do-not-print" not in str(args.model_dump())
    assert "sk-do-not-print" not in args.model_dump_json()


@pytest.fixture
def tenanted(engine, tiny_llama_dir) -> SyncAPI:
    app = build_app(
        engine,
        served_model_names=[MODEL],
        model_path=str(tiny_llama_dir),
        cache_salt_header="x-tenant-id",
    )
    return SyncAPI(app)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1},
        ),
    ],
)
@pytest.mark.parametrize(
    ("headers", "body_salt", "expected"),
    [
        ({"X-Tenant-Id": "acme"}, None, "acme"),
        ({"X-Tenant-Id": "acme"}, "globex", "acme"),  # a client may not pick another's salt
        ({}, "globex", None),
    ],
    ids=["from-header", "header-wins", "body-alone-dropped"],
)
def test_the_tenant_header_decides_the_cache_salt(
    tenanted, engine, path, body, headers, body_salt, expected
):
    if body_salt is not None:
        body = dict(body, cache_salt=body_salt)
    assert tenanted.post(path, body, headers=headers).status_code == 200
    [request] = engine.submitted
    assert request.cache_salt == expected


def test_without_a_tenant_header_the_body_salt_is_kept(api, engine):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1, "cache_salt": "mine"}
    assert api.post("/v1/completions", body, headers={"X-Tenant-Id": "acme"}).status_code == 200
    [request] = engine.submitted
    assert request.cache_salt == "mine"
