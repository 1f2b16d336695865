# The CUDA extension tqkv_vllm._C (csrc/), built against the torch that vLLM pins; everything
# else is in pyproject.toml. Build with the target environment's torch:
#   pip install --no-build-isolation ./vllm_plugin
# TQKV_VLLM_CUDA_ARCH: the gencode arch list (default "90": Hopper, the kernels' target);
# TQKV_VLLM_NO_CUDA=1: no extension (the plugin then leaves vLLM's own kernels in place).
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("TQKV_VLLM_NO_CUDA", "0") != "1":
    import torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    # The torch the extension is built against: register() refuses another one at run time
    # (a C++ extension is tied to its torch's ABI).
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tqkv_vllm", "_build_info.py"), "w") as f:
        f.write(f"# Written by setup.py.\nTORCH_VERSION = {torch.__version__!r}\n")

    archs = os.environ.get("TQKV_VLLM_CUDA_ARCH", "90").replace(";", ",").split(",")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    here = os.path.dirname(os.path.abspath(__file__))
    sources = ["ops.cpp", "store.cu", "decode.cu", "dequant.cu",
               "decode_k8v4.cu", "decode_k4v4.cu", "decode_k3v4.cu", "decode_k3v3.cu"]
    ext_modules.append(CUDAExtension(
        "tqkv_vllm._C",
        [os.path.join("csrc", s) for s in sources],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                            "nvcc": ["-O3", "-std=c++17", "-lineinfo", *gencode]},
        include_dirs=[os.path.join(here, "csrc")],
    ))
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
