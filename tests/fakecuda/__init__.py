"""A recording fake ``libcuda.so.1`` that reads real cubins (see ``fake_cuda.c``).

``build_fake_cuda(directory)`` compiles it into ``directory/libcuda.so.1``; ``fake_cuda_env``
gives the environment that points both Triton's CUDA driver (``TRITON_LIBCUDA_PATH`` and
``LD_LIBRARY_PATH``, which must be set when the process starts) and aotriton-rt
(``AOTRITON_RT_CUDA_LIB``) at it. Load it only in subprocesses: under its real soname it would
shadow a real driver for the rest of the process.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.fake_driver import compile_shared

SOURCE = Path(__file__).with_name("fake_cuda.c")


def build_fake_cuda(directory: Path) -> Path:
    """Compile the fake into ``directory/libcuda.so.1`` and return its path."""
    return compile_shared(SOURCE, Path(directory) / "libcuda.so.1", "libcuda.so.1")


#: Shared memory per block with opt-in, bytes, of the GPUs the fake plays (A100, H100).
OPTIN = {80: 166912, 90: 232448}


def fake_cuda_env(library: Path, log: Path | None = None, *, capability: int = 90,
                  optin: int | None = None) -> dict[str, str]:
    """Environment for a subprocess whose CUDA is the fake, a device of ``capability``."""
    optin = OPTIN.get(capability, 49152) if optin is None else optin
    folder = str(Path(library).parent)
    return {
        "AOTRITON_RT_CUDA_LIB": str(library),
        "TRITON_LIBCUDA_PATH": folder,
        "LD_LIBRARY_PATH": os.pathsep.join(filter(None, (folder, os.environ.get("LD_LIBRARY_PATH")))),
        "FAKECUDA_CC": str(capability),
        "FAKECUDA_OPTIN": str(optin),
        "FAKECUDA_LOG": str(log) if log is not None else "",
    }
