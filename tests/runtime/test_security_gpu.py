"""Issue 9 launch checks on a real GPU: stream objects and handles launch correctly; bad streams,
grids and extra positionals are refused before the driver, and the device keeps working."""

from __future__ import annotations

import pytest

import aotriton_rt
from aotriton_rt import ArgumentError, LaunchError

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib(gpu_images):
    return aotriton_rt.Library(gpu_images)


@pytest.mark.parametrize("how", ["object", "handle"])
def test_add_on_a_side_stream_given_as_object_or_handle_is_correct(lib, how):
    n = 1_000_003
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    out = torch.full_like(x, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lib.kernel("add", dtype="fp32")(x, y, out, n, stream=side if how == "object" else side.cuda_stream)
    side.synchronize()
    torch.testing.assert_close(out, x + y, rtol=0, atol=0)


@pytest.mark.parametrize("call,error,message", [
    (lambda k, x: k(x, x, x, 16, stream="0"), ArgumentError, r"stream must be a raw stream handle"),
    (lambda k, x: k(x, x, x, 16, stream=-1), ArgumentError, r"stream -1 is not a stream handle"),
    (lambda k, x: k(x, x, x, 16, stream=2**70), ArgumentError, r"is not a stream handle"),
    (lambda k, x: k(x, x, x, 16, 0), ArgumentError, r"add takes 4 arguments .* given 5 positionally"),
    (lambda k, x: k(x, x, x, -2000), LaunchError, r"gives grid \(-1, 1, 1\)"),
    (lambda k, x: k[(2**31,)](x, x, x, 16), ArgumentError, r"grid\[0\] = 2147483648 must be an integer in"),
    (lambda k, x: k[(1, 65536)](x, x, x, 16), ArgumentError, r"grid\[1\] = 65536 must be an integer in"),
])
def test_bad_launch_values_are_refused_and_the_device_stays_usable(lib, call, error, message):
    k = lib.kernel("add", dtype="fp32")
    x = torch.zeros(16, device="cuda")
    with pytest.raises(error, match=message):
        call(k, x)
    y = torch.ones(16, device="cuda")
    out = torch.empty_like(y)
    k(y, y, out, 16)
    torch.cuda.synchronize()
    assert out.eq(2).all()
