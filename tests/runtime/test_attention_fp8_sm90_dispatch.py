"""Which FP8 forward runs a call on sm90, on the CPU: ``attn_fwd_fp8_sm90`` (the Gluon kernel)
where the images hold it for the call's spec, ``attn_fwd_fp8`` otherwise; ``explain`` says which
and why, and the operator passes the Gluon kernel the same argument values as the portable one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

GLUON = "attn_fwd_fp8_sm90"
PORTABLE = "attn_fwd_fp8"
DENSE = {"dtype": "fp8e4nv", "out_dtype": "bf16", "HEAD_DIM": 128, "HEAD_DIM_V": 128, "VARLEN": 0}


@pytest.fixture(autouse=True)
def switch_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon FP8 forward runs by default: no switch in the environment."""
    monkeypatch.delenv("AOTRITON_RT_FP8_SM90", raising=False)


def test_its_switch_at_0_runs_the_portable_fp8_forward_and_explain_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aotriton_rt.ops.attention import explain

    lib = _library(tmp_path / "gluon", gluon=True)
    for value, kernel in ((None, GLUON), ("1", GLUON), ("yes", GLUON), ("0", PORTABLE)):
        if value is None:
            monkeypatch.delenv("AOTRITON_RT_FP8_SM90", raising=False)
        else:
            monkeypatch.setenv("AOTRITON_RT_FP8_SM90", value)
        ex = explain(dtype="fp8e4nv", head_dim=128, seqlen_q=4096, arch="sm90", library=lib)
        assert ex.kernels[1].kernel == kernel, value
    assert "own FP8 forward is off (AOTRITON_RT_FP8_SM90=0)" in ex.kernels[1].kernel_reason


def _library(folder: Path, gluon: bool, configs: tuple[int, ...] = (0,), tuning: dict | None = None) -> Any:
    """Synthetic sm90 images (never launched): the portable FP8 forward at D=128, bf16 out, modes
    0 and 1, dense and packed, with its V^T pre-pass; with ``gluon``, the Gluon forward's dense D=128
    variants of every mask mode too."""
    import aotriton_rt
    from tests.runtime.test_attention_op import _synthetic_variant

    variants = [_synthetic_variant(PORTABLE, {**DENSE, "CAUSAL": c, "VARLEN": v}) for c in (0, 1) for v in (0, 1)]
    variants.append(_synthetic_variant("attn_fp8_v_transpose", {"dtype": "fp8e4nv", "HEAD_DIM": 128}))
    if gluon:
        variants += [_synthetic_variant(GLUON, {**DENSE, "CAUSAL": c}, index=i) for c in (0, 1, 2) for i in configs]
        # The V^T in the Gluon forward's key order (its configs but the last read it).
        variants.append(_synthetic_variant("attn_fp8_v_transpose", {"dtype": "fp8e4nv", "HEAD_DIM": 128}, index=1))
    folder.mkdir()
    (folder / "catalog.json").write_text(json.dumps({"schema": "aotriton-rt.catalog", "schema_version": 2,
                                                     "triton_version": "3.6.0", "variants": variants,
                                                     **({"tuning": tuning} if tuning else {})}))
    return aotriton_rt.Library(folder)


def test_an_sm90_fp8_call_runs_the_gluon_forward_where_the_images_hold_it(tmp_path: Path) -> None:
    from aotriton_rt.ops.attention import explain

    lib = _library(tmp_path / "gluon", gluon=True)
    ex = explain(dtype="fp8e4nv", head_dim=128, seqlen_q=4096, arch="sm90", library=lib)
    assert [k.kernel for k in ex.kernels] == ["attn_fp8_v_transpose", GLUON]
    assert ex.kernels[1].spec == {**DENSE, "CAUSAL": 0}
    # V^T with each 32 keys in the Gluon forward's register order.
    assert ex.kernels[0].spec == {"dtype": "fp8e4nv", "HEAD_DIM": 128, "KEY_ORDER": 1}
    assert "register order" in ex.kernels[0].kernel_reason
    assert ex.kernels[1].kernel_reason.startswith("sm90's own FP8 forward (Gluon")
    assert f"{GLUON}[dtype=fp8e4nv, out_dtype=bf16, HEAD_DIM=128" in str(ex)
    # A bottom-right call of unequal lengths: mode 2 first, which only the Gluon kernel holds here.
    br = explain(dtype="fp8e4nv", head_dim=128, seqlen_q=100, seqlen_k=300, causal=True, align="bottom_right",
                 arch="sm90", library=lib)
    assert br.kernels[1].kernel == GLUON and br.kernels[1].spec["CAUSAL"] == 2
    # Head dims below 128 run zero-padded on the 128 bucket, on the Gluon kernel too.
    assert explain(dtype="fp8e4nv", head_dim=96, seqlen_q=64, causal=True, arch="sm90",
                   library=lib).kernels[1].kernel == GLUON


def test_the_catalogs_rule_names_the_gluon_forwards_config_and_its_v_transpose_order(tmp_path: Path) -> None:
    from aotriton_rt.ops.attention import explain
    from builder.kernels.attention_fp8_sm90 import FASTEST, fp8_sm90_configs, fp8_sm90_tuning
    from builder.targets import KNOWN

    rules = [{"arch": "sm90", **r} for r in fp8_sm90_tuning(KNOWN["sm90"])]
    assert [(r["spec"], r["config"]) for r in rules] == [({"HEAD_DIM": 128}, 3), ({"HEAD_DIM": 64}, 2)]
    # Each names the persistent ping-pong tile of its head dim's table.
    for d, i in FASTEST.items():
        picked = fp8_sm90_configs({"HEAD_DIM": d}, KNOWN["sm90"])[i].constexprs
        assert (picked["PERSISTENT"], picked["PINGPONG"], picked["KEY_ORDER"]) == (132, 1, 1)
    assert fp8_sm90_tuning(KNOWN["sm80"]) == []
    lib = _library(tmp_path / "tuned", gluon=True, configs=(0, FASTEST[128]), tuning={GLUON: rules})
    for causal in (False, True):
        ex = explain(dtype="fp8e4nv", head_dim=128, seqlen_q=4096, causal=causal, arch="sm90", library=lib)
        chosen = ex.kernels[1]
        assert chosen.kernel == GLUON and chosen.config == FASTEST[128] and chosen.tuned
        assert chosen.params["PERSISTENT"] == 132 and chosen.params["PINGPONG"] == 1
        assert ex.kernels[0].spec["KEY_ORDER"] == 1
    # Without the rule config #0 runs (the lowest config built).
    plain = _library(tmp_path / "untuned", gluon=True, configs=(0, FASTEST[128]))
    chosen = explain(dtype="fp8e4nv", head_dim=128, seqlen_q=4096, arch="sm90", library=plain).kernels[1]
    assert chosen.config == 0 and not chosen.tuned


def test_packed_sequences_and_images_without_it_run_the_portable_fp8_forward(tmp_path: Path) -> None:
    from aotriton_rt.ops.attention import explain

    lib = _library(tmp_path / "gluon", gluon=True)
    packed = explain(dtype="fp8e4nv", head_dim=128, seqlen_q=4096, varlen=True, arch="sm90", library=lib)
    assert packed.kernels[1].kernel == PORTABLE and packed.kernels[1].spec == {**DENSE, "CAUSAL": 0, "VARLEN": 1}
    assert packed.kernels[0].spec == {"dtype": "fp8e4nv", "HEAD_DIM": 128}  # the keys in order
    assert packed.kernels[1].kernel_reason == ("the FP8 forward (fp8 q, k, v); sm90's own FP8 forward is not in "
                                               "these images for this spec")
    without = _library(tmp_path / "portable", gluon=False)
    ex = explain(dtype="fp8e4nv", head_dim=128, seqlen_q=4096, causal=True, arch="sm90", library=without)
    assert [k.kernel for k in ex.kernels] == ["attn_fp8_v_transpose", PORTABLE]
    assert ex.kernels[1].spec == {**DENSE, "CAUSAL": 1}


class _Recorded:
    """A forward handle that records the argument values it is launched with (nothing runs); the
    Gluon forward's one candidate variant reads V^T in its key order (KEY_ORDER=1), as config #0 does."""

    def __init__(self, lib: Any, name: str, params: dict) -> None:
        from builder.registry import _resolve_signature

        self.lib, self.name, self.params = lib, name, params
        spec = {k: v for k, v in params.items() if k != "KEY_ORDER"}
        self.arg_names = [n for n, t in _resolve_signature(lib.decls[name], spec).items() if t != "constexpr"]
        if name == GLUON:
            self.candidates = [type("Variant", (), {"params": {**params, "KEY_ORDER": 1}})()]

    def __call__(self, *args: Any, stream: Any = None) -> None:
        self.lib.recorded.append((self.name, dict(zip(self.arg_names, args, strict=True))))
        self.lib.params.append((self.name, self.params))


def _recording_library(held: tuple[str, ...]) -> Any:
    """The CPU operator's library, holding ``held`` of the two FP8 forwards and recording every
    launch (the V^T pre-pass's too; nothing runs)."""
    from tests.runtime.test_attention_op import InterpretedLibrary

    class Recording(InterpretedLibrary):
        def __init__(self) -> None:
            super().__init__(missing=tuple(n for n in (GLUON, PORTABLE) if n not in held))
            self.missing = tuple(n for n in self.missing if n not in held)
            self.recorded: list[tuple[str, dict]] = []
            self.params: list[tuple[str, dict]] = []

        def kernel(self, name: str, **params: Any) -> Any:
            # KernelNotFound where the images lack it (the interpreted pre-pass has no KEY_ORDER axis).
            super().kernel(name, **{k: v for k, v in params.items() if k != "KEY_ORDER"})
            return _Recorded(self, name, params)

    return Recording()


def test_the_operator_launches_the_gluon_forward_with_the_portable_ones_argument_values(monkeypatch) -> None:
    import aotriton_rt
    from aotriton_rt.ops.attention import dispatch, problem
    from tests.helpers.cpu_arrays import cpu_describer

    monkeypatch.setattr(problem, "_describe", cpu_describer(problem._describe))
    monkeypatch.setattr(dispatch, "_available", lambda lib, name, params: lib.has(name, params))
    monkeypatch.setattr(dispatch, "_takes", lambda lib, name, params, args: all(
        a in lib.decls[name].signature for a in args))
    monkeypatch.setattr(dispatch.LibraryKernels, "device_arch", lambda self, device: "sm90")

    torch.manual_seed(0)
    q = torch.randn(2, 4, 37, 64).to(torch.float8_e4m3fn)
    k, v = (torch.randn(2, 2, 53, 64).to(torch.float8_e4m3fn) for _ in range(2))
    descales = {"q_descale": torch.rand(2, 2) + 0.5, "k_descale": 0.25, "v_descale": torch.rand(2, 2) + 0.5}
    launched, pre = {}, {}
    for held in ((GLUON, PORTABLE), (PORTABLE,)):
        lib = _recording_library(held)
        aotriton_rt.attention(q, k, v, causal=True, align="bottom_right", window=(17, 0), library=lib, **descales)
        ((name, values),) = [(n, v) for n, v in lib.recorded if n != "attn_fp8_v_transpose"]
        launched[name] = values
        ((_, pre[name]),) = [(n, p) for n, p in lib.params if n == "attn_fp8_v_transpose"]
    # The pre-pass in the order of the forward launched: the Gluon one's register order, else keys in order.
    assert pre[GLUON].get("KEY_ORDER") == 1 and "KEY_ORDER" not in pre[PORTABLE]
    assert set(launched) == {GLUON, PORTABLE}
    gluon, portable = launched[GLUON], launched[PORTABLE]
    assert list(gluon) == list(portable)  # the same arguments, in the same order

    def plain(values: dict) -> dict:
        # Arrays by shape and dtype (each call allocates its own outputs and V^T), scalars as they are.
        return {n: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for n, x in values.items()}

    assert plain(gluon) == plain(portable)
    assert (gluon["seqlen_q"], gluon["seqlen_k"], gluon["window_left"], gluon["causal_align"]) == (37, 53, 17, 1)
    assert gluon["V"].shape == (2, 2, 64, 64)  # V^T: (B, Hkv, D bucket, 53 keys rounded up to 32)


def test_the_gluon_fp8_forward_takes_attn_fwd_fp8s_arguments_and_is_built_for_sm90_gputest_and_full() -> None:
    import triton

    from builder.registry import expand, load_kernels
    from builder.targets import parse_targets

    kernels = load_kernels()
    gluon, portable = kernels[GLUON], kernels[PORTABLE]

    def runtime(decl: Any) -> list[tuple[str, str]]:
        return [(n, t) for n, t in decl.signature.items() if t != "constexpr"]

    assert runtime(gluon) == runtime(portable)
    assert dict(gluon.divisibility) == dict(portable.divisibility)
    assert set(portable.checks) <= set(gluon.checks)
    targets = parse_targets("sm80,sm90,gfx942,gfx950")
    full = expand(gluon, targets, "full", triton.__version__)
    assert {j.target.arch for j in full} == {"sm90"}
    specs = {(j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.spec["out_dtype"], j.spec["VARLEN"]) for j in full}
    assert specs == {(d, c, o, 0) for d in (64, 128) for c in (0, 1, 2) for o in ("bf16", "fp16")}
    gputest = expand(gluon, targets, "gputest", triton.__version__)
    assert {(j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.spec["out_dtype"]) for j in gputest} == {
        (d, c, o) for d, c, o, _ in specs}
    # The default set: D=128, bf16 out, modes 0 and 1, in the config the catalog's rule names.
    default = expand(gluon, targets, "default", triton.__version__)
    assert sorted((j.target.arch, j.spec["HEAD_DIM"], j.spec["CAUSAL"], j.spec["out_dtype"], j.config_index)
                  for j in default) == [("sm90", 128, c, "bf16", 3) for c in (0, 1)]
    # Each spec's whole config table: one-tile configs first, then the persistent ones (their
    # indices are what tuning rules will name), then the first of each again with EXP2_SPLIT,
    # which only those two configs name, then the first again with the keys in order (KEY_ORDER=0).
    for j in gputest:
        configs = gluon.configs_for(j.spec, j.target)
        table = [c.constexprs["PERSISTENT"] for c in configs[:-3]]
        assert table == sorted(table) and table[-2:] == [132, 132] and table[0] == 0
        split = [{k: v for k, v in c.constexprs.items() if k != "EXP2_SPLIT"} for c in configs[-3:-1]]
        assert split == [configs[0].constexprs, configs[table.index(132)].constexprs]
        assert [c.constexprs.get("EXP2_SPLIT") for c in configs] == [None] * len(table) + [1, 1, None]
        assert configs[-1].constexprs == {**configs[0].constexprs, "KEY_ORDER": 0}
    assert len(gputest) == len(full) == 6 * 8 + 6 * 7
