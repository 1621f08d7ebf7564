#!/usr/bin/env bash
# An image's bill of materials, written next to it as JSON: pip's inspect report of its
# virtual environment (every Python distribution with its version, requirements and licence
# metadata; a documented format) and the Debian packages beneath it, with the image's
# revision label. syft, the usual tool, is in none of Debian's archive, PyPI or npm, which
# are all that CI here can reach.
#
#   tools/image_sbom.sh podman ghcr.io/tidegate/operator:0.1.0 dist/images
#     -> dist/images/operator-0.1.0.sbom.json
set -euo pipefail
engine=$1
image=$2
out_dir=$3

name=${image##*/}
mkdir -p "$out_dir"
out="$out_dir/${name/:/-}.sbom.json"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$engine" image inspect --format '{{index .Labels "org.opencontainers.image.revision"}}' \
	"$image" >"$work/revision"
"$engine" run --rm --network none --no-healthcheck --entrypoint python "$image" -m pip inspect --local \
	>"$work/python.json"
"$engine" run --rm --network none --no-healthcheck --entrypoint dpkg-query "$image" \
	--show --showformat '${Package}\t${Version}\n' >"$work/debian.tsv"
python3 - "$image" "$work" "$out" <<'PYTHON'
import json
import sys
from pathlib import Path

image, work, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
report = {
    "image": image,
    "revision": (work / "revision").read_text().strip(),
    "python": json.loads((work / "python.json").read_text()),
    "debian": [
        dict(zip(("name", "version"), line.split("\t")))
        for line in (work / "debian.tsv").read_text().splitlines()
    ],
}
Path(out).write_text(json.dumps(report, indent=1) + "\n")
PYTHON
echo "SBOM: $out"
