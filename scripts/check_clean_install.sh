#!/usr/bin/env bash
# What a new user does: `pip install .` into a fresh virtual environment, with
# build isolation, then `import epx, deep_ep` there. PATH holds only the venv,
# nvcc and the system's directories, so CMake, Ninja, nanobind and NCCL come
# from the system (when new enough) or from PyPI through the build
# requirements, not from this checkout's development tools (on Debian 12,
# /usr/bin/cmake is 3.25: the build must fetch CMake >= 3.28 itself).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
epx_use_python
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
[ -x "$nvcc" ] || { echo "check_clean_install.sh: nvcc not found" >&2; exit 1; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/epx-clean-install.XXXXXX")
trap 'rm -rf "$dir"' EXIT
"$EPX_PY" -m venv "$dir/venv"
clean_path="$dir/venv/bin:$(dirname "$nvcc"):/usr/local/bin:/usr/bin:/bin"
t0=$(date +%s)
env -u PYTHONPATH -u VIRTUAL_ENV PATH="$clean_path" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$dir/venv/bin/python" -m pip install -v --disable-pip-version-check . > "$dir/install.log" 2>&1 || {
  tail -40 "$dir/install.log"
  echo "check_clean_install.sh: pip install . failed in a fresh virtual environment" >&2
  exit 1
}
echo "pip install . took $(( $(date +%s) - t0 )) s:"
grep -E "using CMake|EPX: NCCL" "$dir/install.log" | sort -u || true
# From outside the checkout, so that nothing but the installed packages can be imported.
(cd "$dir" && env -u PYTHONPATH PATH="$clean_path" "$dir/venv/bin/python" - <<'PYEOF'
import importlib.metadata as md
import epx, deep_ep, deep_ep.utils
assert deep_ep.Buffer is epx.Buffer and deep_ep.Config is epx.Config, "deep_ep does not serve epx"
assert "site-packages" in epx.__file__ and "site-packages" in deep_ep.__file__, \
    (epx.__file__, deep_ep.__file__)
dist = md.distribution("epx-moe")
assert dist.metadata["License"] == "MIT", dist.metadata["License"]
print(f"clean install: epx-moe {dist.version}: epx {epx.__version__} and deep_ep import "
      f"from {epx.__file__.rsplit('/epx/', 1)[0]}")
PYEOF
)
