#!/usr/bin/env python3
"""How many 128-bit global loads each kernel has in flight before it uses one.

Usage: scripts/sass_load_groups.py OBJECT_OR_CUBIN [FUNCTION_REGEX]

Reads the SASS (cuobjdump -sass) of every function whose mangled name matches
FUNCTION_REGEX (default: all) and prints, per function, the sizes of its load
groups: the LDG.*.128 instructions issued before the first instruction that
reads a register one of them wrote (or feeds an address from one). A copy
loop meant to keep 16 vectors in flight should show 16s; a run of 2s means
the compiler serialized the loads, e.g. when a load that a condition may skip
lands in a temporary that has to be moved out before the next load reuses
it (the LL combine send had that, see docs/benchmarks.md). It is a heuristic
over straight-line code: branches are ignored, so read the SASS around a
suspicious group before changing anything.

cuobjdump: $CUOBJDUMP, else on PATH, else CUDA's bin directory. Minimal CUDA
installs lack it; `pip download nvidia-cuda-cuobjdump --no-deps` and unzip
the wheel to get one.
"""
import os
import re
import shutil
import subprocess
import sys


def cuobjdump():
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                 "/usr/local/cuda/bin/cuobjdump"):
        if cand and os.path.exists(cand):
            return cand
    sys.exit("no cuobjdump: set CUOBJDUMP (see this script's docstring)")


def regs(text):
    return [int(r) for r in re.findall(r"\bR(\d+)\b", text)]


def groups(sass_lines):
    """Sizes of the load groups of one function's SASS lines."""
    out, pending, count = [], set(), 0

    def close():
        nonlocal count
        if count:
            out.append(count)
        count = 0
        pending.clear()

    for line in sass_lines:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if not m:
            continue
        body = re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip())
        op = body.split()[0]
        args = body[len(op):]
        dst, _, rest = args.partition(",")
        if op.startswith("LDG") and ".128" in op:
            if pending & set(regs(rest)):  # its address comes from a pending load
                close()
            first = regs(dst)[0]
            pending.update(range(first, first + 4))
            count += 1
            continue
        srcs = regs(args) if op.startswith(("ST", "ISETP", "BRA")) else regs(rest)
        if pending & set(srcs):
            close()
        for r in regs(dst)[:1]:
            pending.discard(r)  # overwritten before any use
    close()
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    pattern = re.compile(sys.argv[2] if len(sys.argv) > 2 else ".")
    sass = subprocess.run([cuobjdump(), "-sass", sys.argv[1]], check=True, capture_output=True,
                          text=True).stdout
    name, lines = None, []
    for line in sass.splitlines() + ["Function : <end>"]:
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name and pattern.search(name):
                print(f"{name}: {groups(lines)}")
            name, lines = m.group(1), []
        else:
            lines.append(line)


if __name__ == "__main__":
    main()
