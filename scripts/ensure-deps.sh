#!/usr/bin/env bash
# Installs the Debian packages that provide the given commands, when they are missing.
# Usage: scripts/ensure-deps.sh command[:package] ...
# Uses apt-get as root, or through sudo; otherwise says exactly what to install.
set -euo pipefail

missing=()
for spec in "$@"; do
  cmd=${spec%%:*}
  pkg=${spec#*:}
  # Daemons such as nginx live in /usr/sbin, which a non-root PATH may lack.
  if ! command -v "$cmd" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$cmd" ]; then
    missing+=("$pkg")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "error: missing ${missing[*]}; install with: sudo apt-get install ${missing[*]}" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: missing ${missing[*]} and no apt-get here; install them with your package manager" >&2
  exit 1
fi

echo "installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
