#!/usr/bin/env bash
# The package as users install it: build the sdist and the wheel, check what the sdist holds, install the wheel
# with no extras into a fresh virtualenv and run scripts/install_smoke.py there, and check that the extras resolve.
# Run by scripts/test.sh beside the suite. pip takes what it installs from its cache and the wheels on this disk
# where they are there; it installs nothing beyond the package's declared dependencies.
# --no-compile: byte-compiling torch's thousands of modules is CPU the suite beside it needs; the smoke run compiles
# what it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PY=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/distckpt-wheel-XXXXXX")
trap 'rm -rf "$work"' EXIT

.venv/bin/python -m build --no-isolation --sdist --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log"; echo "wheel check: the build failed"; exit 1; }
sdist=$(ls "$work"/dist/distckpt-*.tar.gz)
wheel=$(ls "$work"/dist/distckpt-*.whl)

# the sdist carries what a packager needs: the README, the docs, the license
listing=$(tar -tzf "$sdist")
for member in README.md LICENSE pyproject.toml docs/format.md docs/metadata.schema.json src/distckpt/__init__.py; do
  if ! grep -qx "distckpt-[^/]*/$member" <<<"$listing"; then
    echo "wheel check: the sdist lacks $member"; exit 1
  fi
done
echo "wheel check: ok: the sdist holds README.md, LICENSE, docs/ and the sources"

"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-compile -c constraints.txt "$wheel" >"$work/install.log" 2>&1 \
  || { tail -40 "$work/install.log"; echo "wheel check: pip install of the wheel failed"; exit 1; }
echo "wheel check: ok: the wheel installs with no extras"
# from outside the checkout, so that the installed package is what imports
# the smoke run's processes share the bytecode the first of them compiles (the install compiled none), whatever the
# caller's PYTHONDONTWRITEBYTECODE
(cd "$work" && env -u PYTHONDONTWRITEBYTECODE "$work/venv/bin/python" "$repo/scripts/install_smoke.py")
"$work/venv/bin/python" -m pip install -q --dry-run -c constraints.txt "$wheel[s3,zstd]" >"$work/extras.log" 2>&1 \
  || { tail -40 "$work/extras.log"; echo "wheel check: pip could not resolve distckpt[s3,zstd]"; exit 1; }
echo "wheel check: ok: distckpt[s3,zstd] resolves"
