#!/usr/bin/env bash
# The images' base without a registry: Debian bookworm (minbase) with its Python 3.11, made by
# mmdebstrap and imported as an image. It stands in for python:3.11.*-slim: python3, venv and
# the C headers (inductor compiles its CPU kernels as Python extensions at run time).
#
#   tools/local_base.sh podman localhost/tidegate-base:bookworm-py3.11
#
# An existing image of that name is kept: a new import has a new id, which would void every
# layer the images have cached on top of it. `podman rmi` it to make a fresh one.
set -euo pipefail
engine=$1
image=$2

if "$engine" image inspect "$image" >/dev/null 2>&1; then
	echo "local base $image exists; kept"
	exit 0
fi
if ! command -v mmdebstrap >/dev/null; then
	echo "mmdebstrap is needed to make $image (apt-get install mmdebstrap)" >&2
	exit 1
fi
# The packages come from this machine's own apt sources (mmdebstrap reads them when no mirror
# is given and the host is bookworm too); elsewhere LOCAL_BASE_MIRROR names a bookworm mirror.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Security updates come with the release's own archive. Slim like python:*-slim: no
# recommended packages, no manuals, docs or translations (the copyright files stay), and /usr
# merged by mmdebstrap's own hook rather than the usrmerge package (which pulls in perl). The
# static libpython (50 MB) goes too: nothing links against it.
nice -n 19 mmdebstrap --variant=minbase --quiet \
	--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
	--aptopt='APT::Install-Recommends "false"' \
	--dpkgopt='path-exclude=/usr/share/man/*' \
	--dpkgopt='path-exclude=/usr/share/locale/*' \
	--dpkgopt='path-exclude=/usr/share/doc/*' \
	--dpkgopt='path-include=/usr/share/doc/*/copyright' \
	--include=python3,python3-venv,libpython3.11-dev \
	--customize-hook='rm -f "$1"/usr/lib/python3.11/config-3.11-x86_64-linux-gnu/libpython3.11*.a' \
	--customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
	bookworm "$work/rootfs.tar" ${LOCAL_BASE_MIRROR:+"$LOCAL_BASE_MIRROR"}
nice -n 19 "$engine" import \
	--change 'CMD ["python3"]' \
	--change 'ENV LANG=C.UTF-8' \
	"$work/rootfs.tar" "$image"
