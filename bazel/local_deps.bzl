"""Repository rules that expose the machine's TensorFlow and MPI to Bazel.

tf_local: runs `python -c "import tensorflow"` (NVGROUP_PYTHON, default
.venv/bin/python of the workspace, else python3) and exposes
  @local_tf//:headers    tf.sysconfig.get_include(), symlinked into the repo;
  @local_tf//:framework  libtensorflow_framework.so.2 of tf.sysconfig.get_lib();
  TF_COPTS in @local_tf//:defs.bzl: the compile flags tf.sysconfig reports
  other than -I (ABI and Eigen alignment macros that must match TF's build).
mpi_local: asks the MPI compiler wrapper (mpicxx --showme) and exposes
  @local_mpi//:mpi       its include directory (symlinked) and link flags.
Headers are symlinked into the external repository, not passed as absolute
-I paths, so Bazel's include checking sees them as declared inputs.
"""

def _run(ctx, argv, what):
    result = ctx.execute(argv)
    if result.return_code != 0:
        fail("%s failed (%s): %s%s" % (what, " ".join(argv), result.stdout, result.stderr))
    return result.stdout.strip()

def _words(text):
    return [w for w in text.replace("\n", " ").split(" ") if w]

def _python(ctx):
    explicit = ctx.os.environ.get("NVGROUP_PYTHON")
    if explicit:
        return explicit
    venv = ctx.path(Label("//:BUILD")).dirname.get_child(".venv").get_child("bin").get_child("python")
    return str(venv) if venv.exists else "python3"

def _tf_local_impl(ctx):
    script = ";".join([
        "import tensorflow as tf",
        "print(tf.sysconfig.get_include())",
        "print(tf.sysconfig.get_lib())",
        "print(' '.join(f for f in tf.sysconfig.get_compile_flags() if not f.startswith('-I')))",
    ])
    lines = _run(ctx, [_python(ctx), "-c", script], "Locating TensorFlow").split("\n")[-3:]
    include, lib, flags = lines[0], lines[1], lines[2]
    ctx.symlink(include, "include")
    ctx.symlink(lib + "/libtensorflow_framework.so.2", "libtensorflow_framework.so.2")
    ctx.file("defs.bzl", "TF_COPTS = %r\nTF_LIB_DIR = %r\n" % (_words(flags), lib))
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "headers",
    hdrs = glob(["include/**"]),
    includes = ["include"],
)

cc_import(
    name = "framework",
    shared_library = "libtensorflow_framework.so.2",
)
""")

tf_local = repository_rule(
    implementation = _tf_local_impl,
    environ = ["NVGROUP_PYTHON"],
    local = True,
)

def _mpi_local_impl(ctx):
    compile_flags = _words(_run(ctx, ["mpicxx", "--showme:compile"], "Asking mpicxx"))
    link_flags = _words(_run(ctx, ["mpicxx", "--showme:link"], "Asking mpicxx"))
    includes = [f[2:] for f in compile_flags if f.startswith("-I")]
    if not includes:
        fail("mpicxx --showme:compile names no include directory: %s" % compile_flags)
    for i, directory in enumerate(includes):
        ctx.symlink(directory, "include%d" % i)
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "mpi",
    hdrs = glob([%s]),
    includes = %r,
    defines = ["OMPI_SKIP_MPICXX=1", "MPICH_SKIP_MPICXX=1"],
    linkopts = %r,
)
""" % (", ".join(['"include%d/**"' % i for i in range(len(includes))]),
       ["include%d" % i for i in range(len(includes))], link_flags))

mpi_local = repository_rule(
    implementation = _mpi_local_impl,
    local = True,
)
