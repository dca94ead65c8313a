"""NVGROUP_CUDA_ARCH lists (scripts/cuda_arch.py, used by setup.py and the scripts)."""
import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH = os.path.join(REPO, "scripts", "cuda_arch.py")
_spec = importlib.util.spec_from_file_location("cuda_arch", PATH)
cuda_arch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_arch)


def test_lists_give_sass_for_each_and_ptx_for_the_highest():
    assert cuda_arch.gencode_flags("90") == ["-gencode", "arch=compute_90,code=sm_90",
                                             "-gencode", "arch=compute_90,code=compute_90"]
    flags = cuda_arch.gencode_flags("90;70, 80 70")
    assert flags == ["-gencode", "arch=compute_70,code=sm_70", "-gencode", "arch=compute_80,code=sm_80",
                     "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
    assert "arch=compute_90a,code=sm_90a" in cuda_arch.gencode_flags("80;90a")


@pytest.mark.parametrize("bad", ["", "sm_70", "7", "70;x"])
def test_bad_values_are_errors_naming_the_variable(bad):
    with pytest.raises(ValueError, match="NVGROUP_CUDA_ARCH"):
        cuda_arch.gencode_flags(bad)
    res = subprocess.run([sys.executable, PATH, bad], capture_output=True, text=True)
    assert res.returncode == 2 and "NVGROUP_CUDA_ARCH" in res.stderr


def test_scripts_and_setup_use_it():
    for rel in ("setup.py", "scripts/check_gpu_build.sh", "scripts/device/build_tools.sh"):
        with open(os.path.join(REPO, rel)) as f:
            assert "cuda_arch" in f.read(), rel
    with open(os.path.join(REPO, "examples", "resnet50", "submit_summit.lsf")) as f:
        assert "NVGROUP_CUDA_ARCH:-70" in f.read()
