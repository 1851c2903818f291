#!/usr/bin/env bash
# Installs the pinned real harnesses of versions.txt once, into a cache keyed by that file:
#   $TRACETAP_HARNESSES (default ~/.cache/tracetap-harnesses)/<key>/npm/bin   the CLIs
#   $TRACETAP_HARNESSES/<key>/venv/bin/python                                the frameworks
# The frameworks get a venv of their own so their openai/pydantic pins never change the
# suite's. Same pins, nothing to do; a bumped pin installs the new set (old ones stay
# until removed by hand). tests/test_harness_matrix.py finds the set by the same key.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=${TRACETAP_HARNESSES:-$HOME/.cache/tracetap-harnesses}
key=$(sha256sum "$here/versions.txt" | cut -c1-16)
dest=$root/$key
if [ -f "$dest/.installed" ]; then
  echo "harnesses: $dest (cached)"
  exit 0
fi
npm_specs=()
pypi_specs=()
while read -r registry name version _; do
  case "$registry" in
    ''|'#'*) ;;
    npm) npm_specs+=("$name@$version") ;;
    pypi) pypi_specs+=("$name==$version") ;;
    *) echo "versions.txt: unknown registry $registry" >&2; exit 1 ;;
  esac
done < "$here/versions.txt"
rm -rf "$dest"  # a half-finished earlier attempt
mkdir -p "$dest"
# Both registries at once: the install is mostly waiting on downloads.
npm install --global --prefix "$dest/npm" --no-audit --no-fund --loglevel=error \
  "${npm_specs[@]}" >/dev/null &
npm_job=$!
"${PYTHON:-python3}" -m venv "$dest/venv"
"$dest/venv/bin/pip" install -q --disable-pip-version-check "${pypi_specs[@]}"
wait "$npm_job"
touch "$dest/.installed"
echo "harnesses: $dest (installed)"
