#!/usr/bin/env bash
# The Debian package, tested as a user installs it: `cpack -G DEB` in a build folder, then the
# package installed (`--system`: apt-get install into the system, removed again at the end, as CI
# does on its own machine; otherwise extracted with dpkg-deb into a fresh folder), then
# tests/consumer built and run against it through find_package and pkg-config (run.cmake).
#   bash tests/consumer/deb.sh [--system] [BUILD_DIR]     (default build/shared)
set -euo pipefail
cd "$(dirname "$0")/../.."
system=0
if [[ "${1:-}" == "--system" ]]; then
  system=1
  shift
fi
build=$(realpath "${1:-build/shared}")
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
shared=0
if [[ "$(cache_value BUILD_SHARED_LIBS)" == "ON" ]]; then
  shared=1
fi

(cd "$build" && cpack -G DEB > /dev/null)
version=$(sed -n 's/^project(flexattn VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
deb="$build/flexattn_${version}_$(dpkg --print-architecture).deb"
work="$build/tests/consumer-deb"
rm -rf "$work"
mkdir -p "$work"
if [[ $system -eq 1 ]]; then
  if dpkg-query -W -f='${Status}' flexattn 2> /dev/null | grep -q "install ok installed"; then
    echo "deb.sh: a flexattn package is installed already; not replacing it" >&2
    exit 1
  fi
  trap 'dpkg --purge flexattn > /dev/null' EXIT
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$deb" > /dev/null
  prefix=/usr
  how="installed into the system"
else
  dpkg-deb -x "$deb" "$work/root"
  prefix="$work/root/usr"
  how="extracted into $work/root"
fi
cmake -DPREFIX="$prefix" -DSOURCE_DIR="$PWD" -DWORK_DIR="$work/consumer" \
  -DCXX_COMPILER="$(cache_value CMAKE_CXX_COMPILER)" -DGENERATOR="$(cache_value CMAKE_GENERATOR)" \
  -DREADELF="$(cache_value CMAKE_READELF)" -DSHARED=$shared -P tests/consumer/run.cmake
echo "deb.sh: $(basename "$deb") ($(dpkg-deb -f "$deb" Depends)) $how, consumer built and run against it"
