#!/usr/bin/env python3
"""Which kernels' SASS differs between two builds.

Usage: scripts/sass_diff.py OLD NEW [FUNCTION_REGEX]

Dumps the SASS (cuobjdump -sass) of the two executables or objects, splits it
per function, drops addresses and encodings, and prints, for every function
whose mangled name matches FUNCTION_REGEX (default: all), whether it is the
same, differs (with the first differing instruction) or exists in one build
only. Exit status 1 when any matching function differs or is missing. For
checking that a change leaves some instantiations (the NVLink ones) untouched.

cuobjdump: $CUOBJDUMP, else on PATH, else CUDA's bin directory (the pip wheel
nvidia-cuda-cuobjdump has one).
"""
import re
import subprocess
import sys

from sass_load_groups import cuobjdump  # this folder: $CUOBJDUMP, PATH, CUDA's bin


def normalized(name):
    """The mangled name without the per-build hashes of anonymous namespaces
    (_GLOBAL__N__<hash>_<len>_<file>_<hash>_<n>) and of relocatable code's
    static names (__nv_static_..., _INTERNAL_...), which differ between two checkouts of the
    same source."""
    # Relocatable device code names its static functions the same way.
    name = re.sub(r"__nv_static_\d+__[0-9a-f]+_\d+_([A-Za-z0-9_]+?)_[0-9a-f]{8}_\d+__",
                  r"__nv_static_\1__", name)
    name = re.sub(r"\d*_INTERNAL_[0-9a-f]+_\d+_([A-Za-z0-9_]+?)_[0-9a-f]{8}_\d+",
                  r"_INTERNAL_\1", name)
    out, at = [], 0
    for m in re.finditer(r"_GLOBAL__N__[0-9a-f]+_(\d+)_", name):
        if m.start() < at:
            continue
        n = int(m.group(1))
        file_end = m.end() + n
        # the file's hash (8 hex digits), then _<n> or directly the next name's length
        tail = re.match(r"_[0-9a-f]{8}(?:_\d+)?", name[file_end:])
        # (the identifier's length before it counts the hashes too)
        out.append(re.sub(r"\d+$", "", name[at:m.start()]) + "_GLOBAL__N_" + name[m.end():file_end])
        at = file_end + (tail.end() if tail else 0)
    out.append(name[at:])
    return "".join(out)


def functions(path):
    out = subprocess.run([cuobjdump(), "-sass", path], check=True, capture_output=True,
                         text=True).stdout
    funcs, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = normalized(m.group(1))
            funcs[name] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if name and m:
            funcs[name].append(re.sub(r"\s+", " ", m.group(1)))
    return funcs


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    pattern = re.compile(sys.argv[3] if len(sys.argv) > 3 else ".")
    old, new = functions(sys.argv[1]), functions(sys.argv[2])
    bad = same = 0
    for name in sorted(set(old) | set(new)):
        if not pattern.search(name):
            continue
        if name not in old or name not in new:
            print(f"only in {'new' if name in new else 'old'}: {name}")
            bad += 1
        elif old[name] != new[name]:
            i = next((k for k, (a, b) in enumerate(zip(old[name], new[name])) if a != b),
                     min(len(old[name]), len(new[name])))
            print(f"differs: {name} ({len(old[name])} -> {len(new[name])} instructions; first at "
                  f"{i}: {old[name][i] if i < len(old[name]) else '-'} | "
                  f"{new[name][i] if i < len(new[name]) else '-'})")
            bad += 1
        else:
            same += 1
    print(f"{same} functions the same, {bad} differ or are missing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
