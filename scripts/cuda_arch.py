"""NVGROUP_CUDA_ARCH -> nvcc -gencode flags, one implementation for setup.py and
the shell scripts (scripts/check_gpu_build.sh, scripts/device/build_tools.sh).

A list of compute capabilities separated by ';', ',' or spaces: "90" (default),
"70;80;90", "70 90a". Each gets SASS (code=sm_XX); the highest also gets PTX
(code=compute_XX) so newer GPUs can JIT-compile it. Summit's V100 is 70, which
needs CUDA <= 12.x (CUDA 13's nvcc starts at 75).

    python scripts/cuda_arch.py "70;80;90"   # prints the flags, one per line
"""
import re
import sys

DEFAULT = "90"


def parse_archs(spec):
    """'70;80;90' -> ['70', '80', '90'] (sorted by number, duplicates dropped)."""
    items = [s for s in re.split(r"[;,\s]+", (spec or "").strip()) if s]
    if not items:
        raise ValueError("NVGROUP_CUDA_ARCH is empty (give e.g. 90 or \"70;80;90\")")
    for s in items:
        if not re.fullmatch(r"[1-9][0-9]{1,2}[af]?", s):
            raise ValueError("NVGROUP_CUDA_ARCH: %r is not a compute capability like 70, 90 or 90a "
                             "(list them separated by ';')" % s)
    def key(s):
        return (int(re.match(r"\d+", s).group()), s)
    return sorted(set(items), key=key)


def gencode_flags(spec):
    archs = parse_archs(spec)
    flags = []
    for a in archs:
        flags += ["-gencode", "arch=compute_%s,code=sm_%s" % (a, a)]
    top = archs[-1]
    flags += ["-gencode", "arch=compute_%s,code=compute_%s" % (top, top)]
    return flags


if __name__ == "__main__":
    try:
        print("\n".join(gencode_flags(sys.argv[1] if len(sys.argv) > 1 else DEFAULT)))
    except ValueError as e:
        print("cuda_arch: %s" % e, file=sys.stderr)
        sys.exit(2)
