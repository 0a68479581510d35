"""The per-variant packer: struct layout equals the catalog's, rules compile safely."""

import struct

import pytest

from aotriton_rt.arguments import Packer, compile_expr, scalar_checker
from aotriton_rt.catalog import Arg, Catalog
from aotriton_rt.errors import ArgumentError, CatalogError


@pytest.fixture(scope="module")
def catalog(built_images):
    return Catalog.load(built_images)


def test_every_variant_packs_to_its_catalog_param_size(catalog):
    for v in catalog.variants:
        p = Packer(v)
        assert p.struct.size == v.param_size
        values = [0x1000 * (i + 1) if a.is_pointer else 7 for i, a in enumerate(v.args)] + [0, 0]
        buf = p.struct.pack(*values)
        for a, value in zip(v.args, values):
            fmt = "<Q" if a.is_pointer else {"i32": "<i", "i64": "<q"}[a.type]
            assert struct.unpack_from(fmt, buf, a.offset)[0] == value


def test_grid_rule_uses_arguments_and_compile_time_values(catalog):
    v = next(v for v in catalog.variants if v.kernel == "add")
    p = Packer(v)
    n = 1_000_003
    assert p.grid_for([1, 2, 3, n]) == (-(-n // v.config.constexprs["BLOCK"]), 1, 1)


def test_checks_refuse_values_that_break_a_variant(catalog):
    v = next(v for v in catalog.variants if v.kernel == "softmax" and v.spec["BLOCK"] == 256)
    p = Packer(v)
    p.run_checks([0, 0, 4, 256, 256, 256])
    with pytest.raises(ArgumentError, match=r"n_cols=257 violates `n_cols <= BLOCK` of this variant"):
        p.run_checks([0, 0, 4, 257, 257, 257])


@pytest.mark.parametrize("text,why", [
    ("__import__('os')", "only cdiv, min and max may be called"),
    ("n.real", "uses Attribute"),
    ("open", "names 'open'"),
    ("1.5 * n", "only integer constants"),
    ("n +", "is not an expression"),
])
def test_rules_reject_anything_but_arithmetic(text, why):
    with pytest.raises(CatalogError, match=why):
        compile_expr(text, ["n"], {}, "grid rule")


def test_rules_fold_constants_and_support_cdiv_min_max():
    f = compile_expr("min(cdiv(n, B), 4) * max(h, 1)", ["n", "h"], {"B": 128}, "grid rule")
    assert f(1000, 3) == 12


@pytest.mark.parametrize("t,value,msg", [
    ("i32", 2**31, r"x \(i32\) = 2147483648 is out of range"),
    ("u32", -1, r"x \(u32\) = -1 is out of range"),
    ("i64", 1.5, r"x \(i64\) must be an integer, got float"),
    ("i32", True, r"must be an integer, got bool"),
    ("fp32", "1", r"x \(fp32\) must be a real number, got str"),
])
def test_scalars_are_type_and_range_checked(t, value, msg):
    conv = scalar_checker(Arg("x", t, 0, 4 if t in ("i32", "u32", "fp32") else 8, 4))
    with pytest.raises(ArgumentError, match=msg):
        conv(value)


def test_numpy_style_integers_are_accepted():
    class Index:
        def __index__(self):
            return 5
    assert scalar_checker(Arg("x", "i32", 0, 4, 4))(Index()) == 5


class _BrokenIndex:
    def __index__(self):
        return "5"


class _RaisingFloat:
    def __float__(self):
        raise ValueError("no")


# Issue 25, finding 9: what numpy and broken number protocols give is an ArgumentError, never TypeError.
@pytest.mark.parametrize("t,value,msg", [
    ("i32", "array", r"^argument x \(i32\) must be an integer, got ndarray of shape \(1,\); pass a Python int or "
                     r"a 0-d array \(int\(a\[0\]\)\)$"),
    ("fp32", "array", r"^argument x \(fp32\) must be a real number, got ndarray of shape \(1,\); pass a Python "
                      r"float or a 0-d array"),
    ("i32", _BrokenIndex(), r"^argument x \(i32\) must be an integer, got _BrokenIndex whose __index__\(\) failed: "
                            r"TypeError: __index__ returned non-int \(type str\)$"),
    ("fp32", _RaisingFloat(), r"^argument x \(fp32\) must be a real number, got _RaisingFloat whose __float__\(\) "
                              r"failed: ValueError: no$"),
])
def test_arrays_and_broken_number_protocols_are_argument_errors(t, value, msg):
    np = pytest.importorskip("numpy")
    if value == "array":
        value = np.array([5], dtype=np.int32 if t == "i32" else np.float32)
    conv = scalar_checker(Arg("x", t, 0, 4, 4))
    with pytest.raises(ArgumentError, match=msg):
        conv(value)


def test_zero_dimensional_numpy_values_are_accepted():
    np = pytest.importorskip("numpy")
    assert scalar_checker(Arg("x", "i32", 0, 4, 4))(np.array(5)) == 5
    assert scalar_checker(Arg("x", "i64", 0, 8, 8))(np.int64(7)) == 7
    assert scalar_checker(Arg("x", "fp32", 0, 4, 4))(np.float32(0.5)) == 0.5
