#!/usr/bin/env bash
# The declared floors, for real: a venv with every runtime dependency of pyproject.toml pinned at its
# floor (`>=X` read as `==X`, markers honoured), then test suites run in it batch by batch.
#
#   tools/floors/run.sh                               # build (or reuse) the venv, run the default batches
#   tools/floors/run.sh tests/unit tests/lightning    # these batches instead (each a pytest path or node id)
#   FRESH=1 tools/floors/run.sh                       # rebuild the venv first
#   LDC_REV=HEAD tools/floors/run.sh                  # a git archive of that commit (the shared tree may be mid-edit)
#
# Env: VENV (/tmp/venv-floor), OUT (logs, /tmp/floors_out), TORCH (2.13.0: the one CPU wheel on the
# machine; torch's own floor is not tested, older ones pull CUDA builds), PINS ("pkg==v ..." overriding
# or adding pins, e.g. PINS="numpy==1.26.4"), TEST_DEPS (the test extra's packages installed, at whatever
# pip picks under the pins), PYTEST_ARGS (extra pytest arguments for every batch), LDC_REV/LDC_OVERLAY
# (as in tools/peer_suites: run a git archive of LDC_REV with the working tree's LDC_OVERLAY files over it).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${VENV:-/tmp/venv-floor}
OUT=${OUT:-/tmp/floors_out}
TORCH=${TORCH:-2.13.0}
TEST_DEPS=${TEST_DEPS:-"pytest hypothesis jsonargparse megatron-core psutil"}
mkdir -p "$OUT"
PIP() { "$VENV/bin/python" -m pip "$@" 2>&1 | grep -v "^WARNING: Location"; return "${PIPESTATUS[0]}"; }

"$VENV/bin/python" -V >/dev/null 2>&1 && [ "${FRESH:-0}" != 1 ] || { rm -rf "$VENV"; python3 -m venv "$VENV"; }
PIP install -q -U pip >/dev/null
# pkg==floor for each runtime dependency (torch: $TORCH), then $PINS; and the test extra's specs named in TEST_DEPS
read -r -d '' PLAN <<'EOF'
import os, sys, tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
project = tomllib.load(open(os.path.join(sys.argv[1], "pyproject.toml"), "rb"))["project"]
pins = {}
for spec in project["dependencies"]:
    req = Requirement(spec)
    if req.marker and not req.marker.evaluate():
        continue
    floor = [s.version for s in req.specifier if s.operator in (">=", "==")]
    if floor:
        pins[canon(req.name)] = floor[0]
pins["torch"] = os.environ["TORCH"]
for extra in os.environ.get("PINS", "").split():
    name, _, version = extra.partition("==")
    pins[canon(name)] = version
wanted = {canon(n) for n in os.environ["TEST_DEPS"].split()}
tests = [s for s in project["optional-dependencies"]["test"] if canon(Requirement(s).name) in wanted]
print(" ".join(f"{n}=={v}" for n, v in pins.items()))
print(" ".join(tests))
EOF
PIP install -q packaging >/dev/null
mapfile -t LINES < <(TORCH=$TORCH TEST_DEPS=$TEST_DEPS PINS=${PINS:-} "$VENV/bin/python" -c "$PLAN" "$REPO")
read -r -a RUNTIME <<<"${LINES[0]}"
read -r -a TESTS <<<"${LINES[1]:-}"
printf '%s\n' "${RUNTIME[@]}" >"$OUT/pins.txt"
echo "pins: ${RUNTIME[*]}"
# pinned as constraints, so the test packages resolve around them; a floor that cannot install stops here
PIP install -q -c "$OUT/pins.txt" "${RUNTIME[@]}" "${TESTS[@]}" || { echo "the floors do not install together" >&2; exit 2; }
PIP install -q --no-deps -e "$REPO" >/dev/null || exit 2
PIP check
"$VENV/bin/python" -m pip list 2>/dev/null >"$OUT/installed.txt"

SRC=$REPO
if [ -n "${LDC_REV:-}" ]; then
    SRC=$OUT/src; rm -rf "$SRC"; mkdir -p "$SRC"
    git -C "$REPO" archive "$LDC_REV" | tar -x -C "$SRC"
    for f in ${LDC_OVERLAY:-}; do cp "$REPO/$f" "$SRC/$f"; done
    echo "lightning_distckpt from $LDC_REV ($(git -C "$REPO" rev-parse --short "$LDC_REV"))"
fi
[ $# -eq 0 ] && set -- tests/unit tests/conformance tests/tiers tests/distributed tests/lightning
cd "$SRC"
rc=0
for batch in "$@"; do
    log="$OUT/$(echo "$batch" | tr '/:' '__').log"
    # shellcheck disable=SC2086
    PYTHONPATH=$SRC "$VENV/bin/python" -m pytest -q -p no:cacheprovider --tb=short ${PYTEST_ARGS:-} $batch >"$log" 2>&1
    status=$?
    [ $status -eq 0 ] || [ $status -eq 5 ] || rc=1
    echo "== $batch: $(tail -1 "$log")"
done
exit $rc
