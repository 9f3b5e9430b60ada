# scripts/python_env.sh - sourced by install_deps.sh and test.sh.
#
# epx_use_python sets EPX_PY, the Python they install packages into and run,
# and puts its scripts directory (pip's cmake, pytest) first on PATH:
#   - $PYTHON when set;
#   - else python3, when pip may install into it: a virtual environment, or an
#     interpreter not marked externally managed (PEP 668: the system Python of
#     Debian 12 and Ubuntu 23.04+ is);
#   - else the project's virtual environment .venv (git-ignored), made from
#     python3 on first use (Debian/Ubuntu need the python3-venv package).

# Status 0 when the Python $1 is one that PEP 668 closes to pip.
epx_externally_managed() {
  "$1" - <<'PYEOF'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if not in_venv and os.path.exists(marker) else 1)
PYEOF
}

# Status 0 when epx_use_python will make (or use) the project's .venv.
epx_needs_venv() {
  [ -z "${PYTHON:-}" ] && epx_externally_managed python3
}

epx_use_python() {
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if [ -n "${PYTHON:-}" ]; then
    EPX_PY=$PYTHON
  elif epx_externally_managed python3; then
    if [ ! -x "$root/.venv/bin/python" ]; then
      echo "python_env.sh: $(command -v python3) is externally managed (PEP 668);" \
        "using the virtual environment $root/.venv" >&2
      python3 -m venv "$root/.venv" || {
        echo "python_env.sh: python3 -m venv failed (Debian/Ubuntu: apt-get install python3-venv)" >&2
        return 1
      }
    fi
    EPX_PY=$root/.venv/bin/python
  else
    EPX_PY=$(python3 -c 'import sys; print(sys.executable)')
  fi
  export EPX_PY
  PATH="$("$EPX_PY" -c 'import sysconfig; print(sysconfig.get_paths()["scripts"])'):$PATH"
  export PATH
}
