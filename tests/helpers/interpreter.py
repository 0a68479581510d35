"""Running test cases under Triton's CPU interpreter, in subprocesses.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the cases run in a child
process: the test module itself, run as a script with case names as arguments, printing one
JSON object per case. Cases are split over two children (CI has two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def require_interpreter() -> None:
    """Skip the calling test when torch or triton is missing (the ``test`` extra has neither)."""
    import importlib.util

    import pytest

    missing = [m for m in ("torch", "triton") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"interpreter tests need {' and '.join(missing)}: pip install torch triton")


def run_interpreted(script: str | Path, names: list[str]) -> list[dict]:
    """Run ``script`` with ``names`` under the interpreter; its JSON lines, one per name."""
    require_interpreter()
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script), *names], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(results) != len(names):
        raise RuntimeError(f"interpreter subprocess failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


def run_sharded(script: str | Path, names: list[str], shards: int = 2) -> dict[str, dict]:
    """All ``names`` over ``shards`` children at once; results by case name."""
    require_interpreter()
    parts = [names[i::shards] for i in range(shards)]
    with ThreadPoolExecutor(len(parts)) as pool:
        results = [r for part in pool.map(lambda p: run_interpreted(script, p), parts) for r in part]
    return {r["name"]: r for r in results}


def report_cases(names: list[str], run: Callable[[str], dict]) -> None:
    """The child's side of :func:`run_interpreted`: one JSON line per case, ``run(name)``'s result
    or, when it raises, a failed result carrying the exception and its traceback (the test then
    fails with them)."""
    import traceback

    for name in names:
        try:
            result = run(name)
        except Exception as exc:  # reported to the test, which fails with it
            result = {"errors": {}, "failed": [f"{type(exc).__name__}: {exc}"[:1500], traceback.format_exc()[-3000:]]}
        result["name"] = name
        print(json.dumps(result), flush=True)


def patch_interpreter() -> None:
    """Work around three Triton 3.6 interpreter defects and run the one inline assembly the decode
    kernel has (:func:`_widen_e4m3_words`); call in the child before running kernels.

    It turns scalars into 1-element arrays and calls int() on them when a loop bound is a
    run-time value (numpy >= 2.4 refuses int() of a 1-d array), and its tl.dot multiplies bf16
    operands as their uint16 bit patterns: widen them to fp32 first (exact: a bf16 is the top
    half of an fp32). Its own rounding to fp8 drops the carry of a mantissa that rounds up into
    the next exponent (31.5 becomes 16, not 32), rounds ties up and turns NaN into 384: convert
    to and from fp8 through torch, which rounds to nearest even as the GPUs' conversions do.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # noqa: ANN001, ANN202 - interpreter internals
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def widen(h):  # noqa: ANN001, ANN202
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot
    _convert_fp8_through_torch(builder)
    _widen_e4m3_words(builder)


def _widen_e4m3_words(builder: type) -> None:
    """``builder.kernels.decode.E4M3X4_TO_F16`` by its PTX semantics: byte i of each 32-bit word
    (from the least significant: the lowest address, as the GPU's little-endian loads put it) to
    fp16 output i. Any other assembly still raises, as the interpreter does."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    from builder.kernels.decode import E4M3X4_TO_F16

    class Results:
        def __init__(self, handles: list) -> None:
            self.handles = handles

        def get_result(self, i: int):  # noqa: ANN202 - interpreter internals
            return self.handles[i]

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):  # noqa: ANN001, ANN202
        if asm != E4M3X4_TO_F16.value or pack != 1 or len(values) != 1 or values[0].dtype.scalar != tl.int32:
            raise NotImplementedError(f"inline assembly under the interpreter: {asm!r}")
        words = np.ascontiguousarray(values[0].data, dtype=np.int32)
        raw = torch.from_numpy(words.reshape(-1).view("<u1").copy())
        wide = raw.view(torch.float8_e4m3fn).to(torch.float16).view(*words.shape, 4).numpy()
        return Results([interpreter.TensorHandle(np.ascontiguousarray(wide[..., i]), tl.float16) for i in range(4)])

    builder.create_inline_asm = create_inline_asm


def _convert_fp8_through_torch(builder: type) -> None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    types = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2, tl.float16: torch.float16,
             tl.bfloat16: torch.bfloat16, tl.float32: torch.float32}
    fp8 = (tl.float8e4nv, tl.float8e5)
    original = builder.create_fp_to_fp

    def fp_to_fp(self, src, dst_type, rounding_mode):  # noqa: ANN001, ANN202 - interpreter internals
        s, d = src.dtype.scalar, dst_type.scalar
        if (s in fp8 or d in fp8) and s in types and d in types and rounding_mode in (None, ir.ROUNDING_MODE.RTNE):
            raw = torch.from_numpy(np.ascontiguousarray(src.data).view(np.uint8).copy())
            out = raw.view(types[s]).to(types[d]).view(torch.uint8).numpy()
            data = out.view(interpreter._get_np_dtype(dst_type)).reshape(src.data.shape)
            return interpreter.TensorHandle(data, d)
        return original(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = fp_to_fp
