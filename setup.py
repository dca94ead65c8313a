"""Builds nvgroup_tf's native parts.

Two shared objects come out of the same engine sources (cc/):
  * nvgroup_tf/lib/libnvgroup_tf_ops.so -- engine + TF custom ops (ops/), built
    only when TensorFlow is importable, with tf.sysconfig's flags;
  * nvgroup_tf/_engine*.so -- engine + pybind11 module (cc/python/), built always,
    so the engine runs and is tested on machines without TensorFlow (the GPU boxes).

CUDA (cc/**/*.cu and cc/**/*_cuda.cc, ops/*_gpu.cc) is compiled when
NVGROUP_WITH_CUDA=1 (default 0), for NVGROUP_CUDA_ARCH (default 90; a list like "70;80;90").

Objects are cached under build/obj/<flavor>/ and rebuilt when the source or any
header under cc/ or ops/ is newer. Compiles run in parallel (one per core).

Usage:  python setup.py build_ext --inplace      (or: pip install --no-build-isolation -e .)
"""
import concurrent.futures
import glob
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
WITH_CUDA = os.environ.get("NVGROUP_WITH_CUDA", "0") == "1"
CUDA_ARCH = os.environ.get("NVGROUP_CUDA_ARCH", "90")  # a list: "70;80;90" (scripts/cuda_arch.py)
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
JOBS = int(os.environ.get("NVGROUP_BUILD_JOBS", str(os.cpu_count() or 1)))


def cuda_gencode_flags():
    """nvcc -gencode flags for NVGROUP_CUDA_ARCH (one list syntax for setup.py and
    the scripts: scripts/cuda_arch.py)."""
    spec = importlib.util.spec_from_file_location("nvgroup_cuda_arch",
                                                  os.path.join(ROOT, "scripts", "cuda_arch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        return mod.gencode_flags(CUDA_ARCH)
    except ValueError as e:
        raise SystemExit("setup.py: %s" % e)


def rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def engine_sources():
    """Engine sources (not the front ends), host part and CUDA part."""
    all_cc = rel(glob.glob(os.path.join(ROOT, "cc", "**", "*.cc"), recursive=True))
    front_ends = ("cc/python/", "cc/tools/", "cc/tests/")
    host = [s for s in all_cc if not s.startswith(front_ends) and not s.endswith("_cuda.cc")]
    cuda = [s for s in all_cc if not s.startswith(front_ends) and s.endswith("_cuda.cc")]
    cuda += rel(glob.glob(os.path.join(ROOT, "cc", "**", "*.cu"), recursive=True))
    return host, (cuda if WITH_CUDA else [])


def mpi_flags():
    """Compile and link flags of the system MPI (Open MPI's or MPICH's wrapper)."""
    for wrapper in ("mpicxx", "mpic++", "mpiCC"):
        path = shutil.which(wrapper)
        if not path:
            continue
        try:
            comp = subprocess.check_output([path, "--showme:compile"], text=True).split()
            link = subprocess.check_output([path, "--showme:link"], text=True).split()
            return comp, link
        except (subprocess.CalledProcessError, OSError):
            pass
        try:  # MPICH: "-show" prints the whole command line
            words = subprocess.check_output([path, "-show"], text=True).split()[1:]
            comp = [w for w in words if w.startswith(("-I", "-D"))]
            link = [w for w in words if w.startswith(("-L", "-l", "-Wl"))]
            return comp, link
        except (subprocess.CalledProcessError, OSError):
            pass
    raise RuntimeError(
        "No MPI compiler wrapper (mpicxx) found. Install Open MPI first, e.g. "
        "'apt-get install openmpi-bin libopenmpi-dev' (scripts/setup.sh does this).")


def tf_flags():
    try:
        import tensorflow as tf  # noqa: F401 (heavy; only when building the op library)
    except ImportError:
        return None
    comp = tf.sysconfig.get_compile_flags()
    link = tf.sysconfig.get_link_flags()
    return comp, link


def tf_xla_flags():
    """Extra flags of the XLA lowerings (ops/xla_*.cc): TF's XLA headers include
    highwayhash and farmhash by their own paths, which the wheel ships under
    include/external/; their symbols (tf2xla, XlaBuilder, the XLA FFI) live in
    libtensorflow_cc.so.2, which TF's Python module has loaded already."""
    import tensorflow as tf
    inc = tf.sysconfig.get_include()
    comp = ["-I" + os.path.join(inc, "external", "highwayhash"),
            "-I" + os.path.join(inc, "external", "farmhash_archive", "src")]
    link = ["-L" + tf.sysconfig.get_lib(), "-l:libtensorflow_cc.so.2"]
    return comp, link


def newest_header_mtime():
    headers = glob.glob(os.path.join(ROOT, "cc", "**", "*.h"), recursive=True)
    headers += glob.glob(os.path.join(ROOT, "cc", "**", "*.cuh"), recursive=True)
    headers += glob.glob(os.path.join(ROOT, "ops", "**", "*.h"), recursive=True)
    return max((os.path.getmtime(h) for h in headers), default=0.0)


class NativeBuilder:
    """Compiles sources to cached objects and links shared objects."""

    def __init__(self, verbose=True):
        self.verbose = verbose
        self.header_mtime = newest_header_mtime()
        self.mpi_compile, self.mpi_link = mpi_flags()
        self.common = ["-O3", "-fPIC", "-std=c++17", "-Wall", "-Wno-unused-function",
                       "-DOMPI_SKIP_MPICXX=1", "-DMPICH_SKIP_MPICXX=1",
                       "-I" + os.path.join(ROOT, "cc", "include"), "-I" + os.path.join(ROOT, "cc")]
        if WITH_CUDA:
            self.common += ["-DNVGROUP_WITH_CUDA=1", "-I" + os.path.join(CUDA_HOME, "include")]

    def _stale(self, src, obj):
        if not os.path.exists(obj):
            return True
        t = os.path.getmtime(obj)
        return os.path.getmtime(os.path.join(ROOT, src)) > t or self.header_mtime > t

    def _run(self, cmd):
        if self.verbose:
            print(" ".join(shlex.quote(c) for c in cmd), flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError("command failed:\n%s\n%s%s" % (" ".join(cmd), proc.stdout, proc.stderr))
        if proc.stderr.strip() and self.verbose:
            print(proc.stderr, file=sys.stderr)

    def compile(self, sources, flavor, extra_flags):
        objdir = os.path.join(ROOT, "build", "obj", flavor)
        jobs, objects = [], []
        for src in sources:
            obj = os.path.join(objdir, src.replace("/", "__") + ".o")
            objects.append(obj)
            if not self._stale(src, obj):
                continue
            os.makedirs(objdir, exist_ok=True)
            if src.endswith(".cu"):
                cmd = ["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC"] + cuda_gencode_flags() + \
                      ["-DNVGROUP_WITH_CUDA=1", "-I" + os.path.join(ROOT, "cc", "include"),
                       "-I" + os.path.join(ROOT, "cc")] + \
                      [f for f in self.mpi_compile if f.startswith("-I")] + \
                      ["-c", src, "-o", obj]
            else:
                cmd = ["g++"] + self.common + self.mpi_compile + extra_flags + ["-c", src, "-o", obj]
            jobs.append(cmd)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, JOBS)) as pool:
            for f in [pool.submit(self._run, c) for c in jobs]:
                f.result()
        return objects

    def link(self, objects, output, extra_link):
        """Links `output` unless the same command already linked it from older objects (the command
        is kept beside it in build/); into a temporary file renamed over it, so a process loading the
        library meanwhile sees the old file or the new one, never a half-written one."""
        os.makedirs(os.path.dirname(output), exist_ok=True)
        cuda_link = ["-L" + os.path.join(CUDA_HOME, "lib64"), "-lcudart"] if WITH_CUDA else []
        partial = output + ".partial"
        cmd = (["g++", "-shared", "-o", partial] + objects + self.mpi_link + cuda_link +
               extra_link + ["-lrt", "-lpthread"])
        stamp = os.path.join(ROOT, "build", "link_" + os.path.basename(output) + ".cmd")
        if (os.path.exists(output) and os.path.exists(stamp) and open(stamp).read() == " ".join(cmd)
                and all(os.path.getmtime(o) < os.path.getmtime(output) for o in objects)):
            return
        self._run(cmd)
        os.replace(partial, output)
        with open(stamp, "w") as f:
            f.write(" ".join(cmd))


# TF's headers trip these warnings by the hundred; they are not ours.
TF_EXTRA = ["-U__GCC_DESTRUCTIVE_SIZE", "-U__GCC_CONSTRUCTIVE_SIZE",
            "-Wno-deprecated-declarations", "-Wno-sign-compare"]


def tf_cuda_include_tree():
    """TF's GPU headers include "third_party/gpus/cuda/include/...", a path that
    exists only inside TF's own build; tensorflow-cpu wheels ship no CUDA
    headers. A build-local tree maps it onto CUDA_HOME/include."""
    tree = os.path.join(ROOT, "build", "tf_cuda_include")
    link = os.path.join(tree, "third_party", "gpus", "cuda", "include")
    if not os.path.islink(link):
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.join(CUDA_HOME, "include"), link)
    return ["-I" + tree]


class BuildNative(build_ext):
    def run(self):
        builder = NativeBuilder()
        host, cuda = engine_sources()

        # 1. pybind11 module: engine compiled without TF's flags.
        import pybind11
        py_inc = ["-I" + pybind11.get_include(), "-I" + sysconfig.get_paths()["include"]]
        py_srcs = rel(glob.glob(os.path.join(ROOT, "cc", "python", "*.cc")))
        if py_srcs:
            objs = builder.compile(host + cuda, "plain", [])
            objs += builder.compile(py_srcs, "pybind", py_inc)
            suffix = sysconfig.get_config_var("EXT_SUFFIX")
            builder.link(objs, os.path.join(ROOT, "nvgroup_tf", "_engine" + suffix), [])

        # 2. TF op library: engine + ops/ with TF's flags (ABI must match TF's).
        tf = None if os.environ.get("NVGROUP_WITHOUT_TF") == "1" else tf_flags()
        op_srcs = rel(glob.glob(os.path.join(ROOT, "ops", "*.cc")))
        if tf is not None and op_srcs:
            tf_comp, tf_link = tf
            host_ops = [s for s in op_srcs if not s.endswith("_gpu.cc")]
            gpu_ops = [s for s in op_srcs if s.endswith("_gpu.cc")] if WITH_CUDA else []
            gpu_flags = ["-DGOOGLE_CUDA=1"] + tf_cuda_include_tree() if WITH_CUDA else []
            xla_comp, xla_link = tf_xla_flags()
            objs = builder.compile(host + cuda, "tf", tf_comp + TF_EXTRA)
            objs += builder.compile(host_ops + gpu_ops, "tf_ops",
                                    ["-I" + ROOT] + tf_comp + TF_EXTRA + xla_comp + gpu_flags)
            builder.link(objs, os.path.join(ROOT, "nvgroup_tf", "lib", "libnvgroup_tf_ops.so"),
                         tf_link + xla_link)
        elif tf is None:
            print("TensorFlow not importable: built the engine's pybind11 module only.")

        # Copy into the build directory too, for non-editable installs.
        if not self.inplace:
            for pattern in ("nvgroup_tf/_engine*.so", "nvgroup_tf/lib/*.so"):
                for f in glob.glob(os.path.join(ROOT, pattern)):
                    dst = os.path.join(self.build_lib, os.path.relpath(f, ROOT))
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    shutil.copy2(f, dst)


setup(
    name="nvgroup_tf",
    version="0.1.0",
    description="NV-group hierarchical allreduce for TensorFlow (Horovod-compatible API)",
    packages=find_packages(include=["nvgroup_tf", "nvgroup_tf.*"]),
    ext_modules=[Extension("nvgroup_tf._native_placeholder", sources=[])],
    cmdclass={"build_ext": BuildNative},
    entry_points={"console_scripts": ["nvgrouprun=nvgroup_tf.runner.launch:main"]},
    python_requires=">=3.9",
    zip_safe=False,
)
