#!/usr/bin/env bash
# Debian packages the test suite runs for real: redis-server (shared state), promtool (metrics
# and alert rules) and docker-compose v1 (compose file validation). Installed when missing and
# we are root; otherwise the tests that need them say what is missing.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: missing ${need[*]} (not root or no apt-get); tests that need them will fail" >&2
  exit 0
fi
echo "system-deps: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Debian starts the services it installs; the tests start their own on free ports.
for svc in redis-server prometheus; do
  (command -v service >/dev/null && service "$svc" stop >/dev/null 2>&1) || true
done
