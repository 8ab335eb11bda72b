"""Builds half_kernels.cpp for this CPU and torch (`make cpu-kernels`): the decode kernels of CPUs
that only emulate half precision. Needs a C++ compiler and ninja; the build lands in build/."""

import os
import shlex
import shutil
import sys
from pathlib import Path

from cpu_backend import CPU_CAPABILITY, HALF_KERNELS_FLAGS, HALF_KERNELS_SOURCE, LIBRARY_NAME, kernels_build_dir


def build() -> Path:
    """Compiles the kernels where the build is missing; returns the library. One-line errors."""
    from torch.utils import cpp_extension

    if CPU_CAPABILITY not in HALF_KERNELS_FLAGS:
        raise RuntimeError(f"the kernels need AVX2 or AVX512, this CPU has {CPU_CAPABILITY}")
    compiler = (shlex.split(os.environ.get("CXX", "")) or ["c++"])[0]
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler}) on PATH; install g++")
    # ninja from the requirements sits beside this Python, on PATH only where its environment is active
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed; pip install ninja")
    directory = kernels_build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "lock").unlink(missing_ok=True)  # left by a build killed midway, it would hang this one
    cpp_extension.load(
        LIBRARY_NAME,
        [str(HALF_KERNELS_SOURCE)],
        extra_cflags=["-O3", *HALF_KERNELS_FLAGS[CPU_CAPABILITY], "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        is_python_module=False,
    )
    return directory / f"{LIBRARY_NAME}.so"


def main() -> int:
    try:
        library = build()
    except Exception as error:  # a failed build: the plain kernels still work
        reason = (str(error).strip() or type(error).__name__).splitlines()[0][:300]
        print(f"error: half_kernels.cpp was not built: {reason}", file=sys.stderr)
        return 1
    print(f"built {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
