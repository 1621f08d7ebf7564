"""Several API keys at once, the key file read again as it changes, and the check of a token."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os

import httpx
import pytest

from tests.engine.entrypoints.secret_volume import SecretVolume
from tidegate.engine.entrypoints.openai.auth import (
    KEY_FILE_POLL_S,
    APIKeyMiddleware,
    APIKeys,
    following_key_file,
    parse_api_keys,
)

OLD, NEW = "sk-old-4c1e9f", "sk-new-a27d03"


@pytest.fixture
def volume(tmp_path) -> SecretVolume:
    volume = SecretVolume(tmp_path)
    volume.write(f"{OLD}\n")
    return volume


def accepted(keys: APIKeys) -> set[str]:
    return {key for key in (OLD, NEW) if keys.matches(key.encode())}


def test_a_key_file_holds_one_key_a_line_and_comments():
    text = f"# {OLD} retires on 1 March\n  {OLD}  \n\n\t{NEW}\r\n{OLD}\nsk-with#hash\n   # aside\n"
    assert parse_api_keys(text) == [OLD, NEW, "sk-with#hash"]
    assert parse_api_keys("\n  \n# nothing yet\n") == []
    assert parse_api_keys(OLD) == [OLD]  # no final newline, as `kubectl create secret` writes


def test_a_token_must_be_one_of_the_keys_exactly():
    keys = APIKeys([OLD, NEW])
    assert keys.matches(OLD.encode()) and keys.matches(NEW.encode())
    for wrong in (b"", b"sk-", OLD[:-1].encode(), (OLD + "0").encode(), (OLD + NEW).encode()):
        assert not keys.matches(wrong)


def test_a_token_is_compared_with_every_key_whichever_matches(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    keys = APIKeys([OLD, NEW, "sk-third"])
    for token in (OLD, "sk-third", "sk-wrong-and-much-longer-than-any-key"):
        compared.clear()
        keys.matches(token.encode())
        # No early exit on a match, and digests of one length whatever the token's.
        assert len(compared) == 3
        assert {len(a) for pair in compared for a in pair} == {32}


def test_a_rotation_through_the_kubelets_swap_is_followed(volume, caplog):
    caplog.set_level(logging.INFO, logger="tidegate.auth")
    keys = APIKeys.from_file(str(volume.path))
    assert accepted(keys) == {OLD}
    assert not keys.reload()  # nothing changed
    volume.write(f"{OLD}\n{NEW}\n")
    assert keys.reload() and accepted(keys) == {OLD, NEW}
    volume.write(f"# {OLD} removed on 1 March\n{NEW}\n")
    assert keys.reload() and accepted(keys) == {NEW}
    volume.write(f"{NEW}\n# a comment changes no key\n")
    assert not keys.reload() and accepted(keys) == {NEW}
    changes = [r.getMessage() for r in caplog.records if r.name == "tidegate.auth"]
    assert changes == [
        f"--api-key-file {volume.path} read: keys valid now: 1",
        f"--api-key-file {volume.path} changed: keys valid now: 2 (1 added, 0 removed)",
        f"--api-key-file {volume.path} changed: keys valid now: 1 (0 added, 1 removed)",
    ]
    assert OLD not in caplog.text and NEW not in caplog.text


def test_a_file_rewritten_in_place_within_one_tick_is_seen(tmp_path):
    path = tmp_path / "api-key"
    path.write_text(f"{OLD}\n")
    keys = APIKeys.from_file(str(path))
    before = path.stat()
    path.write_text(f"{NEW}\n")  # same size, same inode
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert keys.reload() and accepted(keys) == {NEW}


@pytest.mark.parametrize(
    ("spoil", "problem"),
    [
        (lambda v: v.write("\n"), "holds no key"),
        (lambda v: v.write("# keys are being rotated\n"), "holds no key"),
        (lambda v: (v.directory / "..data").unlink(), "cannot read --api-key-file"),
        (lambda v: v.write(b"sk-\xff\n"), "not UTF-8 text"),
    ],
    ids=["empty", "only-comments", "gone", "not-utf-8"],
)
def test_a_spoilt_file_keeps_the_keys_read_before_and_says_so_once(volume, caplog, spoil, problem):
    keys = APIKeys.from_file(str(volume.path))
    volume.write(f"{OLD}\n{NEW}\n")
    keys.reload()
    caplog.set_level(logging.INFO, logger="tidegate.auth")
    spoil(volume)
    for _ in range(3):
        assert not keys.reload()
        assert accepted(keys) == {OLD, NEW}  # nobody locked out, nobody let in
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert problem in error.getMessage()
    assert "the keys read before stay valid (2)" in error.getMessage()
    caplog.clear()
    volume.write(f"{NEW}\n")
    assert keys.reload() and accepted(keys) == {NEW}
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]
    assert "readable again" in caplog.records[0].getMessage()


def test_the_keys_follow_their_file_while_the_app_runs(volume):
    asyncio.run(follow_a_rotation(volume))


async def follow_a_rotation(volume: SecretVolume) -> None:
    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    keys = APIKeys.from_file(str(volume.path))
    app = APIKeyMiddleware(ok, keys, open_paths=["/health"])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:

        async def status(key: str) -> int:
            response = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            return response.status_code

        async with following_key_file(keys):
            assert await status(OLD) == 200 and await status(NEW) == 401
            volume.write(f"{OLD}\n{NEW}\n")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + KEY_FILE_POLL_S + 2.0
            while await status(NEW) != 200:
                assert loop.time() < deadline, "the new key was not taken up"
                await asyncio.sleep(0.05)
            assert await status(OLD) == 200  # the overlap: both open the API
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "api-key-file"]


def test_a_fixed_key_is_not_followed():
    async def follow() -> None:
        async with following_key_file(APIKeys([OLD])), following_key_file(None):
            assert not [t for t in asyncio.all_tasks() if t.get_name() == "api-key-file"]

    asyncio.run(follow())
