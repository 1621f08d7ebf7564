"""Which node folders an LLMDeployment may mount: the operator's hostPath allow-lists.

A hostPath volume gives a pod a folder of its node's disk. Without a list, whoever may create
an LLMDeployment, though not a pod, could mount any folder of every node (`/`, `/etc`,
`/var/lib/kubelet`) into pods that run an image of their choosing (spec.image). So
`tidegate operator` mounts only what its flags allow, and none by default:

- `--allowed-host-path PREFIX`: model and adapter sources, mounted read-only, at PREFIX or
  below it, whole components only (`/models` allows `/models/a`, not `/models-evil`);
- `--allowed-cache-host-path FOLDER`: spec.model.cache.hostPath, exactly FOLDER. Engine pods
  write there, so they could leave a link in it pointing anywhere on the node, and the kubelet
  follows links when it mounts a path that runs through one. A cache folder is therefore
  allowed only whole, and no read-only prefix may contain one or lie inside one.

A path is checked as the kernel will read it: repeated slashes, `.` and a trailing slash are
dropped; a `..` is refused outright, since the kernel resolves it after links, so that its
meaning depends on the node. Links are resolved (`os.path.realpath`) where the operator can
see them, and the resolved path must be allowed too. In a cluster the operator's filesystem is
its own image's, not a node's: resolving there can only refuse more, and catches a link only
where the operator sees the node's folders (run on the node itself, or with the allowed
folders mounted at the same paths). The allowed folders must therefore hold no link that
leads out of them; no pod can write to a read-only prefix, and cache folders are matched
whole for that reason.

`tidegate plan` and `tidegate up` apply no list (RenderOptions.host_paths None): up runs as
the user, on folders the user can read anyway.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from tidegate.operator.spec import LLMDeploymentSpec, SpecError

REASON = "HostPathRefused"
READ_ONLY_FLAG = "--allowed-host-path"
CACHE_FLAG = "--allowed-cache-host-path"
# The chart's values that become those flags.
READ_ONLY_VALUE = "hostPaths.readOnly"
CACHE_VALUE = "hostPaths.cache"


class HostPathRefused(SpecError):
    """A hostPath the operator's allow-lists do not admit."""


def normalised(path: str) -> str:
    """`path` as the kernel reads it: absolute, one slash between components, no `.`.

    ValueError for a relative path or one with a `..` component.
    """
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ValueError(
            f"{path!r} has a '..' component, which the kernel resolves after links: its "
            "meaning depends on the node"
        )
    return "/" + "/".join(parts)


def within(path: str, folder: str) -> bool:
    """Whether normalised `path` is `folder` or lies below it, component by component."""
    return folder == "/" or path == folder or path.startswith(folder + "/")


@dataclass(frozen=True)
class HostPathPolicy:
    """The node folders engine pods may mount; the default allows none."""

    read_only: tuple[str, ...] = ()
    cache: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        read_only = tuple(dict.fromkeys(normalised(p) for p in self.read_only))
        cache = tuple(dict.fromkeys(normalised(p) for p in self.cache))
        for folder in cache:
            for prefix in read_only:
                if within(folder, prefix) or within(prefix, folder):
                    raise ValueError(
                        f"{READ_ONLY_FLAG} {prefix} and {CACHE_FLAG} {folder} overlap: pods "
                        "write to a cache folder, so no read-only prefix may contain one or "
                        "lie inside one"
                    )
        object.__setattr__(self, "read_only", read_only)
        object.__setattr__(self, "cache", cache)

    def check(self, spec: LLMDeploymentSpec) -> None:
        """HostPathRefused naming each hostPath of `spec` that the lists do not admit."""
        refusals = [
            f"{where} {refusal}"
            for where, path, is_cache in host_paths(spec)
            if (refusal := self.refusal(path, is_cache)) is not None
        ]
        if refusals:
            raise HostPathRefused("; ".join(refusals))

    def refusal(self, path: str, is_cache: bool) -> str | None:
        """Why `path` may not be mounted (a cache folder when `is_cache`), or None."""
        if is_cache:
            what, flag, value, listed = "a cache folder", CACHE_FLAG, CACHE_VALUE, self.cache
        else:
            what, flag, value, listed = (
                "below a folder",
                READ_ONLY_FLAG,
                READ_ONLY_VALUE,
                self.read_only,
            )
        allows = f"(its {flag} flag, the chart's {value}; allowed: {', '.join(listed) or 'none'})"
        try:
            lexical = normalised(path)
        except ValueError as error:
            return f"is refused: {error}; the operator mounts only what it allows {allows}"
        resolved = _resolved(lexical)
        if resolved is None:
            # Something on the way the operator may not read: it cannot tell where it leads.
            return f"is refused: the operator cannot follow the links of {path!r} {allows}"
        if is_cache:
            allowed = any(c == lexical and (_resolved(c) or c) == resolved for c in listed)
        else:
            allowed = any(
                within(lexical, p) and within(resolved, _resolved(p) or p) for p in listed
            )
        if allowed:
            return None
        shown = repr(path) if lexical == path else f"{path!r} (read as {lexical!r})"
        if resolved != lexical:
            shown += f", which the operator sees as a link to {resolved!r},"
        return f"{shown} is not {what} the operator allows {allows}"


def _resolved(path: str) -> str | None:
    """`path` with the links the operator can see followed; None where it may not look."""
    try:
        return os.path.realpath(path)
    except OSError:
        return None


def host_paths(spec: LLMDeploymentSpec) -> Iterator[tuple[str, str, bool]]:
    """Every hostPath of `spec`: (its field, the path, whether it is the writable cache)."""
    source = spec.model.source.host_path
    if source is not None:
        yield "spec.model.source.hostPath.path", source.path, False
    cache = spec.model.cache.host_path if spec.model.cache is not None else None
    if cache is not None:
        yield "spec.model.cache.hostPath.path", cache.path, True
    for index, adapter in enumerate(spec.adapters or []):
        if adapter.source.host_path is not None:
            where = f"spec.adapters[{index}].source.hostPath.path"
            yield where, adapter.source.host_path.path, False
