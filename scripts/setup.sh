#!/usr/bin/env bash
# Installs everything robotft needs on Debian 12 + Python 3.11: system packages (apt-get, as root),
# a virtualenv (.venv, or $ROBOTFT_VENV) and the pip packages with the pins in requirements/constraints.txt.
# Quick when already installed: a stamp records the hash of the inputs that decide the install.
# Usage: scripts/setup.sh [EXTRAS]   (default extras: maniskill,dev)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-maniskill,dev}"
venv="${ROBOTFT_VENV:-$repo/.venv}"
python="${ROBOTFT_PYTHON:-python3}"
min_free_gb=9

log() { printf '[setup] %s\n' "$*" >&2; }

vulkan_ok() {
  # ManiSkill needs Mesa >= 25 lavapipe (bookworm-backports); Debian 12's Mesa 22 does not work.
  local v
  v="$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)"
  [[ -n "$v" && "${v%%.*}" -ge 25 ]] && dpkg -s libvulkan1 >/dev/null 2>&1
}

install_system_packages() {
  local need=()
  vulkan_ok || need+=(vulkan)
  command -v ffmpeg >/dev/null || need+=(ffmpeg)
  [[ ${#need[@]} -eq 0 ]] && return 0
  if [[ "$(id -u)" != 0 ]]; then
    log "system packages missing (${need[*]}): Mesa >= 25 Vulkan (bookworm-backports) and ffmpeg."
    log "Run this script as root, or install them: apt-get install -t bookworm-backports mesa-vulkan-drivers libvulkan1 ffmpeg"
    exit 1
  fi
  log "installing system packages: ${need[*]}"
  if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
    local uris
    uris="$(grep -hs '^URIs:' /etc/apt/sources.list.d/debian.sources | head -n1 | awk '{print $2}')"
    uris="${uris:-http://deb.debian.org/debian}"
    printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$uris" >/etc/apt/sources.list.d/robotft-backports.sources
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends -t bookworm-backports mesa-vulkan-drivers libvulkan1 >/dev/null
  apt-get install -y -qq --no-install-recommends ffmpeg >/dev/null
}

check_free_disk() {
  # A full install is ~8.5 GiB (the CUDA build of torch with its NVIDIA libraries is ~5.3 GiB of it); running out
  # of disk halfway leaves a broken venv, so say so before starting.
  local parent avail_gb
  parent="$(dirname "$venv")"
  mkdir -p "$parent"
  avail_gb="$(df -Pk "$parent" | awk 'NR == 2 {printf "%d", $4 / 1048576}')"
  if ((avail_gb < min_free_gb)); then
    log "a full install needs about ${min_free_gb} GiB free in $parent; it has ${avail_gb} GiB."
    log "Free some space, or point ROBOTFT_VENV at a disk that has it."
    exit 1
  fi
}

install_python_packages() {
  local stamp="$venv/.robotft-setup" want
  want="$(cat "$repo/pyproject.toml" "$repo/requirements/constraints.txt" | sha256sum | cut -c1-16)-$extras"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    return 0
  fi
  if [[ ! -x "$venv/bin/python" ]]; then
    check_free_disk
    log "creating virtualenv $venv"
    "$python" -m venv "$venv"
  fi
  log "installing robotft[$extras] into $venv (first time: a few minutes)"
  "$venv/bin/python" -m pip install -q --no-cache-dir --upgrade pip
  # torch first, from the pair on local disk, so nothing resolves a different build.
  "$venv/bin/python" -m pip install -q --no-cache-dir -c "$repo/requirements/constraints.txt" torch torchvision
  "$venv/bin/python" -m pip install -q --no-cache-dir -c "$repo/requirements/constraints.txt" -e "$repo[$extras]"
  if [[ ",$extras," == *",lerobot,"* ]]; then
    # lerobot 0.4.4 pins torch<2.11, which excludes the torch builds on these machines: its own
    # requirements come from the extra above, lerobot itself without its pins.
    "$venv/bin/python" -m pip install -q --no-cache-dir -c "$repo/requirements/constraints.txt" --no-deps "lerobot==0.4.4"
  fi
  echo "$want" >"$stamp"
}

install_system_packages
install_python_packages
