#!/usr/bin/env bash
# What a C++ engine does: `cmake --install` EPX into a prefix, then build
# examples/cpp against it with find_package(epx) in a fresh directory (a copy
# of the example alone, nothing else of the checkout) and run it; without a
# GPU it prints the size hints and the reference's routing and exits 0.
#
#   scripts/check_install.sh [BUILD_DIR]
#
# BUILD_DIR (default build/default) is installed as it is when it holds a
# configured build (scripts/test.sh passes the tree it just built, so nothing
# is compiled twice); otherwise it is configured with the default preset and
# built first. The installed package must not name the build tree, and its
# exported targets not the checkout either (epxConfig.cmake may: it records
# where NCCL is, which can be a virtual environment in the checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
build=${1:-build/default}
if [ ! -f "$build/CMakeCache.txt" ]; then
  [ "$build" = build/default ] || { echo "check_install.sh: $build is no configured build" >&2; exit 1; }
  cmake --preset default
fi
build=$(cd "$build" && pwd)
t0=$(date +%s.%N)
# Up to date already when test.sh calls it: nothing is compiled.
cmake --build "$build" -j"$(nproc)"

dir=$(mktemp -d "${TMPDIR:-/tmp}/epx-check-install.XXXXXX")
trap 'rm -rf "$dir"' EXIT
cmake --install "$build" --prefix "$dir/prefix" > "$dir/install.log" || {
  cat "$dir/install.log"; exit 1; }
pkg=$dir/prefix/lib/cmake/epx
if grep -lF "$build" "$pkg"/*.cmake || grep -lF "$root" "$pkg"/epxTargets*.cmake; then
  echo "check_install.sh: the installed CMake package names the build tree or the checkout" >&2
  exit 1
fi
echo "installed into the prefix:"
(cd "$dir/prefix" && find . -type f | sed 's|^\./|  |' | sort)

cp -r examples/cpp "$dir/example"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$dir/example" -B "$dir/example-build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$dir/prefix" > "$dir/configure.log" || { cat "$dir/configure.log"; exit 1; }
grep -E "^-- epx " "$dir/configure.log" | sed "s|$dir|<tmp>|g"
cmake --build "$dir/example-build" -j"$(nproc)" > "$dir/build.log" || { cat "$dir/build.log"; exit 1; }
"$dir/example-build/epx_example"
echo "check_install.sh: install, find_package(epx) build and run of examples/cpp took" \
     "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
