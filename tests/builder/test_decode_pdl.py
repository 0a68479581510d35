"""The decode chain's programmatic dependent launch (PDL): compiled into the sm90 variants only.

append -> decode -> combine run back to back on one stream; on sm90 each is launched with
programmatic stream serialization (the catalog's ``launch.pdl``) and waits in-kernel
(``griddepcontrol.wait``) for its predecessor before touching memory. sm80 has no griddepcontrol
and HIP no PTX: their variants must hold neither the instruction nor the launch flag, and the
HIP binaries must still match their catalog layout (the ABI proof). Real compiles (Triton 3.6).
"""

from __future__ import annotations

import lzma
from typing import Any

import pytest

from builder.compile import compile_job_with_ptx
from builder.kernels import decode as kernels
from builder.registry import expand, load_kernels
from builder.targets import KNOWN, parse_targets

SPEC = {"dtype": "bf16", "HEAD_DIM": 128}


def _job(name: str, arch: str, config: int = 0, padded: int = 0) -> Any:
    cache = {"PAGED": 1} if name != "attn_decode_combine" else {}
    want = {**SPEC, **cache, "PADDED_D": padded, **({"KV_DTYPE": SPEC["dtype"]} if cache else {})}
    jobs = [j for j in expand(load_kernels()[name], parse_targets(arch), "gputest", "3.6.0")
            if j.spec == want and j.config_index == config]
    assert len(jobs) == 1, (name, arch, [j.spec for j in jobs])
    return jobs[0]


@pytest.mark.parametrize("padded", [0, 1], ids=["as_is", "masked"])
@pytest.mark.parametrize("name", ["attn_decode_append", "attn_decode", "attn_decode_combine"])
def test_sm90_decode_chain_variants_launch_with_pdl_and_wait_for_their_predecessor(name: str, padded: int) -> None:
    job = _job(name, "sm90", padded=padded)
    assert job.constexprs["PDL"] == 1 and job.options()["launch_pdl"] is True
    variant, raw, _, ptx = compile_job_with_ptx(job)
    assert variant.pdl is True and variant.to_json()["launch"]["pdl"] is True
    text = lzma.decompress(ptx).decode()
    # The wait precedes every global access of the kernel; the successor may launch only after
    # the loads (late: its profiled duration would otherwise include this kernel's work).
    body = text[text.index(".entry"):]
    wait = body.index("griddepcontrol.wait")
    first_load = min(i for i in (body.find("ld.global"), body.find("cp.async")) if i >= 0)
    first_store = body.find("st.global")
    assert wait < first_load and wait < first_store, "a global access comes before griddepcontrol.wait"
    assert first_load < body.index("griddepcontrol.launch_dependents") < body.rindex("st.global")
    assert raw[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ["sm80", "gfx942"])
@pytest.mark.parametrize("name", ["attn_decode_append", "attn_decode_combine"])
def test_sm80_and_hip_decode_chain_variants_launch_plainly_and_keep_their_abi(arch: str, name: str) -> None:
    from builder.abi import prove

    job = _job(name, arch)
    assert job.constexprs["PDL"] == 0 and "launch_pdl" not in job.options()
    variant, raw, _, ptx = compile_job_with_ptx(job)
    assert variant.pdl is False and variant.to_json()["launch"]["pdl"] is False
    if ptx is not None:
        assert "griddepcontrol" not in lzma.decompress(ptx).decode()
    else:
        assert b"griddepcontrol" not in raw
    prove(variant, raw)


def test_every_decode_config_turns_pdl_on_exactly_for_cuda_sm90() -> None:
    for decl in kernels.KERNELS:
        for arch in ("sm80", "sm86", "sm89", "sm90", "gfx942", "gfx1100"):
            target = KNOWN[arch]
            for dtype in kernels.DTYPES:
                spec = {"dtype": dtype, "HEAD_DIM": 128, "PAGED": 1, "PADDED_D": 1}
                for config in decl.configs_for(spec, target):
                    on = arch == "sm90"
                    assert config.constexprs["PDL"] == int(on), (decl.name, arch, config)
                    assert config.options.get("launch_pdl", False) is on, (decl.name, arch, config)
