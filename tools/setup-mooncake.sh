#!/usr/bin/env bash
# Add the Mooncake store client and master to the test venv, for the harness's
# Mooncake scenarios (make e2e). make test does not need it.
#
#   tools/setup-mooncake.sh            # venv at .venv (override: VENV=path)
#
# mooncake-transfer-engine-non-cuda links libibverbs even for TCP transfers; the
# system library comes from apt (Debian/Ubuntu: libibverbs1). The wheel is
# installed without dependencies (its torch requirement would pull a CUDA build).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
MOONCAKE=mooncake-transfer-engine-non-cuda==0.3.13.post1

log() { printf 'setup-mooncake: %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "no venv at $VENV; run tools/setup-test-env.sh first"
    exit 1
fi
if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "installing libibverbs1 (apt-get)"
        apt-get install -y --no-install-recommends libibverbs1 >/dev/null \
            || { apt-get update >/dev/null && apt-get install -y --no-install-recommends libibverbs1 >/dev/null; }
    else
        log "Mooncake needs libibverbs.so.1: install it (Debian/Ubuntu: sudo apt-get install libibverbs1) and rerun"
        exit 1
    fi
fi
if ! "$VENV/bin/python" -c "import mooncake.store, msgpack" 2>/dev/null; then
    log "installing $MOONCAKE and msgpack into $VENV"
    "$VENV/bin/python" -m pip --disable-pip-version-check install -q --no-deps "$MOONCAKE" msgpack \
        2> >(grep -v "^WARNING: Location 'file:///opt/" >&2)
fi
MASTER=$("$VENV/bin/python" -c "import mooncake, pathlib; print(pathlib.Path(mooncake.__file__).parent / 'mooncake_master')")
[ -x "$MASTER" ] || { log "mooncake_master not found at $MASTER"; exit 1; }
log "ok: $MOONCAKE, master at $MASTER"
