#!/usr/bin/env bash
# What the image tests (tests/images/test_images_run.py) need, installed from Debian's
# packages where they are missing and this is root on a Debian-like machine (CI here): podman,
# runc (crun cannot run containers on these hosts: images/containers.conf) and mmdebstrap (the
# local base image). Quick when all are present; elsewhere it says what is missing and leaves
# the tests to skip.
set -euo pipefail
packages=()
for tool in podman runc mmdebstrap; do
	command -v "$tool" >/dev/null 2>&1 || packages+=("$tool")
done
if [ ${#packages[@]} -eq 0 ]; then
	exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
	echo "container tools missing (${packages[*]}): the image tests will skip" >&2
	exit 0
fi
echo "installing ${packages[*]} from Debian's packages (image tests)"
export DEBIAN_FRONTEND=noninteractive
install() { nice -n 19 apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null; }
# A machine whose package lists are stale or absent needs them fetched first.
install || { nice -n 19 apt-get update -qq && install; }
