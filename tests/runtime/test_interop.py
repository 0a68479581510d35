"""Tests of aotriton_rt.interop: framework arrays -> pointer, device, layout, stream.

The DLPack producers below build real DLManagedTensor / DLManagedTensorVersioned structs
with ctypes (their own declarations of the dlpack.h ABI, independent of the module's) and
wrap them in real PyCapsules with a destructor, as C producers do.
"""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys

import pytest

from aotriton_rt import interop
from aotriton_rt.errors import ArgumentError
from aotriton_rt.interop import ArrayInfo, current_stream, describe, pointer, pointer_reader, stream_getter

torch = pytest.importorskip("torch")

FAKE_PTR = 0x7F12_3456_0000  # never dereferenced: only read back


# ---------------------------------------------------------------------------------------
# A DLPack producer written against dlpack.h with ctypes

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", DELETER), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


assert ctypes.sizeof(DLTensor) == 48 and ctypes.sizeof(DLManagedTensorVersioned) == 80

NAME = b"dltensor"
NAME_VERSIONED = b"dltensor_versioned"
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
# The destructor gets a dying object: take it as a plain address, never as py_object.
_is_valid_raw = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_get_pointer_raw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi))

_LIVE: dict[int, tuple] = {}  # struct address -> (producer, struct, shape array, strides array)


@DELETER
def _deleter(address: int) -> None:
    producer = _LIVE.pop(address)[0]
    producer.deleted += 1


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int) -> None:
    # What every producer does: an unconsumed capsule releases its own tensor.
    for name in (NAME, NAME_VERSIONED):
        if _is_valid_raw(capsule, name):
            _deleter(_get_pointer_raw(capsule, name))


class FakeGPUArray:
    """A producer of DLPack capsules on a fake CUDA device."""

    def __init__(self, *, shape=(4,), strides=None, code=2, bits=32, lanes=1, device=(2, 0),
                 byte_offset=0, version=(1, 1), flags=0, null_deleter=False,
                 ptr=FAKE_PTR) -> None:
        self.shape, self.strides = shape, strides
        self.dtype = (code, bits, lanes)
        self.device, self.byte_offset, self.version, self.flags = device, byte_offset, version, flags
        self.null_deleter, self.ptr = null_deleter, ptr
        self.deleted = 0
        self.calls: list[dict] = []
        self.capsules: list = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        capsule = self._capsule(versioned=kwargs.get("max_version") is not None)
        self.capsules.append(capsule)
        return capsule

    def _capsule(self, versioned: bool):
        managed = DLManagedTensorVersioned() if versioned else DLManagedTensor()
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * ndim)(*self.shape)
        strides = (ctypes.c_int64 * ndim)(*self.strides) if self.strides is not None else None
        t = managed.dl_tensor
        t.data = self.ptr
        t.device = DLDevice(*self.device)
        t.ndim = ndim
        t.dtype = DLDataType(*self.dtype)
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        if strides is not None:
            t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = self.byte_offset
        if not self.null_deleter:
            managed.deleter = _deleter
        if versioned:
            managed.version = DLPackVersion(*self.version)
            managed.flags = self.flags
        address = ctypes.addressof(managed)
        _LIVE[address] = (self, managed, shape, strides)
        return _capsule_new(address, NAME_VERSIONED if versioned else NAME,
                            ctypes.cast(_capsule_destructor, ctypes.c_void_p))


class LegacyGPUArray(FakeGPUArray):
    """A pre-1.0 producer: ``__dlpack__`` knows nothing of max_version."""

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        if set(kwargs) - {"stream"}:
            raise TypeError(f"__dlpack__() got an unexpected keyword argument {kwargs}")
        capsule = self._capsule(versioned=False)
        self.capsules.append(capsule)
        return capsule


def capsule_name(capsule) -> str:
    return _get_name(capsule).decode()


class FakeCAI:
    """An object exposing __cuda_array_interface__ built from keyword arguments."""

    def __init__(self, **cai) -> None:
        base = {"data": (FAKE_PTR, False), "shape": (4,), "typestr": "<f4", "version": 2}
        base.update(cai)
        self._cai = base

    @property
    def __cuda_array_interface__(self) -> dict:
        return self._cai


@pytest.fixture
def resolver():
    """Install a pointer -> device resolver that records what it was asked."""
    seen: list[int] = []

    def device_of(ptr: int) -> int:
        seen.append(ptr)
        return 3

    interop.set_pointer_device_resolver(device_of)
    yield seen
    interop.set_pointer_device_resolver(None)


# ---------------------------------------------------------------------------------------
# Import

def test_importing_interop_imports_no_framework():
    code = ("import sys, aotriton_rt.interop; "
            "print(sorted(m for m in ('torch', 'cupy', 'jax', 'numpy', 'triton') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------------------
# torch (CPU build here: the refusals)

def test_torch_cpu_tensor_is_refused_with_the_fix():
    with pytest.raises(ArgumentError, match=r"torch\.Tensor is on the CPU \(device 'cpu'\); "
                                            r"move it to the GPU first, e\.g\. t\.cuda\(\)"):
        pointer(torch.ones(3))
    with pytest.raises(ArgumentError, match=r"torch\.Tensor is on the CPU"):
        describe(torch.ones(3))


def test_torch_parameter_is_read_as_a_tensor_and_named_by_its_type():
    with pytest.raises(ArgumentError, match=r"torch\.nn\.parameter\.Parameter is on the CPU"):
        pointer(torch.nn.Parameter(torch.ones(3)))


def test_torch_meta_tensor_is_refused_as_having_no_memory():
    with pytest.raises(ArgumentError, match=r"is on the 'meta' device and has no memory"):
        pointer(torch.empty(3, device="meta"))


def test_torch_sparse_tensor_is_refused_with_to_dense_fix():
    with pytest.raises(ArgumentError, match=r"layout torch\.sparse_coo has no single data "
                                            r"pointer; pass a dense tensor, e\.g\. t\.to_dense"):
        pointer(torch.eye(3).to_sparse())


def test_torch_handler_is_chosen_once_per_exact_type(monkeypatch):
    t = torch.ones(2)
    with pytest.raises(ArgumentError):
        pointer(t)
    assert interop.pointer_reader(torch.Tensor) is not None

    def no_second_selection(obj):
        raise AssertionError("handler selected again")

    monkeypatch.setattr(interop, "_select", no_second_selection)
    with pytest.raises(ArgumentError, match="on the CPU"):
        pointer(torch.zeros(5))


# ---------------------------------------------------------------------------------------
# __cuda_array_interface__

def test_cai_v2_without_strides_is_c_contiguous():
    info = describe(FakeCAI(shape=(2, 3, 4), typestr="<f2", version=2))
    assert info == ArrayInfo(FAKE_PTR, -1, "fp16", (2, 3, 4), (12, 4, 1), "cai", None, False)


def test_cai_v3_byte_strides_become_element_strides_and_stream_is_kept():
    obj = FakeCAI(shape=(3, 5), typestr="<i4", strides=(4, 12), version=3, stream=0xBEEF,
                  data=(FAKE_PTR, True))
    info = describe(obj)
    assert (info.dtype, info.shape, info.strides) == ("i32", (3, 5), (1, 3))
    assert info.stream == 0xBEEF and info.readonly is True


@pytest.mark.parametrize("stream", [None, 1, 2])
def test_cai_v3_default_stream_values_are_accepted(stream):
    assert describe(FakeCAI(version=3, stream=stream)).stream == stream
    assert pointer(FakeCAI(version=3, stream=stream)) == (FAKE_PTR, -1)


def test_cai_stream_zero_is_refused_as_the_protocol_requires():
    msg = r"__cuda_array_interface__ has stream 0, which the protocol forbids"
    with pytest.raises(ArgumentError, match=msg):
        pointer(FakeCAI(version=3, stream=0))
    with pytest.raises(ArgumentError, match=msg):
        describe(FakeCAI(version=3, stream=0))


def test_cai_device_comes_from_the_installed_resolver(resolver):
    assert pointer(FakeCAI()) == (FAKE_PTR, 3)
    assert describe(FakeCAI()).device == 3
    assert resolver == [FAKE_PTR, FAKE_PTR]


def test_cai_null_pointer_of_an_empty_array_is_not_resolved(resolver):
    assert pointer(FakeCAI(data=(0, False), shape=(0,))) == (0, -1)
    assert resolver == []


def test_cai_without_resolver_reports_unknown_device():
    assert pointer(FakeCAI())[1] == -1


@pytest.mark.parametrize(("typestr", "name"), [
    ("|b1", "i1"), ("|i1", "i8"), ("|u1", "u8"), ("<i2", "i16"), ("<u4", "u32"), ("<i8", "i64"),
    ("<f8", "fp64")])
def test_cai_typestrs_map_to_triton_names(typestr, name):
    assert describe(FakeCAI(typestr=typestr)).dtype == name


def test_cai_big_endian_and_complex_typestr_are_refused():
    with pytest.raises(ArgumentError, match=r"has typestr '>f4', which Triton kernels do not take"):
        describe(FakeCAI(typestr=">f4"))
    with pytest.raises(ArgumentError, match=r"has typestr '<c8'"):
        describe(FakeCAI(typestr="<c8"))


def test_cai_strides_that_split_an_element_are_refused():
    with pytest.raises(ArgumentError, match=r"byte strides \(6,\) that are not multiples of "
                                            r"the item size 4"):
        describe(FakeCAI(strides=(6,)))


def test_cai_masked_array_is_refused():
    with pytest.raises(ArgumentError, match=r"has a mask; masked arrays cannot be passed"):
        describe(FakeCAI(mask=FakeCAI()))


def test_cai_with_malformed_data_entry_is_refused():
    with pytest.raises(ArgumentError, match=r"has no valid 'data' entry .* got None"):
        pointer(FakeCAI(data=None))


def test_cai_pointer_given_as_a_numpy_integer_is_accepted():
    np = pytest.importorskip("numpy")
    obj = FakeCAI(data=(np.uint64(FAKE_PTR), np.bool_(False)))
    assert pointer(obj) == (FAKE_PTR, -1)
    assert type(describe(obj).ptr) is int


def test_cai_property_that_raises_is_reported_as_an_argument_error():
    class Broken:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("array lives on another context")

    with pytest.raises(ArgumentError, match=r"Broken\.__cuda_array_interface__ is not available: "
                                            r"array lives on another context"):
        pointer(Broken())


def test_cai_set_on_the_instance_is_found():
    class Holder:
        pass

    h = Holder()
    h.__cuda_array_interface__ = {"data": (FAKE_PTR + 64, False), "shape": (1,),
                                  "typestr": "|u1", "version": 3}
    assert pointer(h) == (FAKE_PTR + 64, -1)
    assert describe(h).dtype == "u8"


# ---------------------------------------------------------------------------------------
# DLPack

def test_numpy_array_is_refused_as_cpu_dlpack():
    np = pytest.importorskip("numpy")
    with pytest.raises(ArgumentError, match=r"numpy\.ndarray: tensor is on the CPU \(DLPack "
                                            r"device type 1\); move it to the GPU first"):
        pointer(np.zeros(3))


def test_versioned_capsule_is_read_renamed_and_released_once():
    a = FakeGPUArray(shape=(2, 3), byte_offset=256)
    info = describe(a)
    assert info == ArrayInfo(FAKE_PTR + 256, 0, "fp32", (2, 3), (3, 1), "dlpack", None, False)
    assert a.calls == [{"max_version": (1, 1)}]
    assert capsule_name(a.capsules[0]) == "used_dltensor_versioned"
    assert a.deleted == 1
    a.capsules.clear()
    gc.collect()
    assert a.deleted == 1, "the producer's capsule destructor must leave a used capsule alone"


def test_legacy_capsule_is_renamed_used_dltensor_and_released_once():
    class FirstSeen(LegacyGPUArray):  # a type of its own: nothing cached about it yet
        pass

    a = FirstSeen(shape=(8,), device=(2, 1))
    assert pointer(a) == (FAKE_PTR, 1)
    assert a.calls == [{"max_version": (1, 1)}, {}]  # TypeError, then asked the old way
    assert capsule_name(a.capsules[0]) == "used_dltensor"
    assert a.deleted == 1
    a.capsules.clear()
    gc.collect()
    assert a.deleted == 1


def test_producer_without_max_version_is_asked_without_it_from_then_on():
    pointer(LegacyGPUArray())
    b = LegacyGPUArray()
    pointer(b)
    assert b.calls == [{}]  # one call: no second failed attempt with max_version


def test_strided_bf16_tensor_keeps_its_strides_and_dtype():
    a = FakeGPUArray(shape=(4, 6), strides=(1, 8), code=4, bits=16)
    info = describe(a, backend="cuda")
    assert (info.dtype, info.shape, info.strides) == ("bf16", (4, 6), (1, 8))


@pytest.mark.parametrize(("code", "bits", "name"), [
    (0, 8, "i8"), (1, 8, "u8"), (1, 64, "u64"), (2, 16, "fp16"), (2, 64, "fp64"), (6, 8, "i1"),
    (10, 8, "fp8e4nv"), (12, 8, "fp8e5"), (11, 8, "fp8e4b8"), (13, 8, "fp8e5b16")])
def test_dlpack_dtypes_map_to_triton_names(code, bits, name):
    assert describe(FakeGPUArray(code=code, bits=bits)).dtype == name


def test_complex_dtype_is_refused_and_the_tensor_still_released():
    a = FakeGPUArray(code=5, bits=64)
    with pytest.raises(ArgumentError, match=r"has DLPack dtype complex64 \(code 5, bits 64, "
                                            r"lanes 1\), which Triton kernels do not take"):
        describe(a)
    assert a.deleted == 1


def test_vector_lanes_are_refused():
    with pytest.raises(ArgumentError, match=r"float32 x 4 lanes"):
        describe(FakeGPUArray(lanes=4))


def test_unknown_major_version_is_refused_and_released():
    a = FakeGPUArray(version=(2, 0))
    with pytest.raises(ArgumentError, match=r"exports DLPack 2\.0; aotriton-rt reads DLPack 1\.x"):
        pointer(a)
    assert a.deleted == 1


def test_read_only_flag_is_reported():
    assert describe(FakeGPUArray(flags=1)).readonly is True


def test_null_deleter_is_not_called():
    a = FakeGPUArray(null_deleter=True)
    assert pointer(a) == (FAKE_PTR, 0)
    leftover = [address for address, entry in _LIVE.items() if entry[0] is a]
    assert len(leftover) == 1  # nobody released it: a NULL deleter means nothing to release
    del _LIVE[leftover[0]]


def test_rocm_tensor_is_accepted_for_hip_and_refused_for_cuda():
    a = FakeGPUArray(device=(10, 2))
    assert pointer(a, backend="hip") == (FAKE_PTR, 2)
    with pytest.raises(ArgumentError, match=r"tensor is on a ROCm device \(DLPack device type "
                                            r"10\) but the kernel is for CUDA"):
        pointer(a, backend="cuda")


def test_cuda_managed_memory_is_accepted_for_cuda():
    assert pointer(FakeGPUArray(device=(13, 0))) == (FAKE_PTR, 0)


def test_pinned_host_memory_is_refused():
    with pytest.raises(ArgumentError, match=r"tensor is in pinned host memory \(DLPack device "
                                            r"type 3, kDLCUDAHost\); move it to the GPU first"):
        pointer(FakeGPUArray(device=(3, 0)))


def test_other_device_types_are_refused_by_name():
    with pytest.raises(ArgumentError, match=r"unsupported device \(DLPack device type 8, "
                                            r"kDLMetal\)"):
        pointer(FakeGPUArray(device=(8, 0)))


def test_capsule_device_is_checked_even_when_dlpack_device_says_cuda():
    class Liar(FakeGPUArray):
        def __dlpack_device__(self):
            return (2, 0)

    a = Liar(device=(1, 0))
    with pytest.raises(ArgumentError, match=r"tensor is on the CPU \(DLPack device type 1\)"):
        pointer(a)
    assert a.deleted == 1


@pytest.mark.parametrize(("backend", "launch", "asked"), [
    ("cuda", 0, 1), ("cuda", 2, 2), ("cuda", 0xABC0, 0xABC0), ("hip", 0, 0)])
def test_launch_stream_is_handed_to_the_producer_in_dlpack_spelling(backend, launch, asked):
    a = FakeGPUArray(device=(2 if backend == "cuda" else 10, 0))
    pointer(a, backend=backend, stream=launch)
    assert a.calls[-1]["stream"] == asked


def test_already_used_capsule_is_refused():
    class Reuser(FakeGPUArray):
        def __dlpack__(self, **kwargs):
            if not self.capsules:
                super().__dlpack__(**kwargs)
            return self.capsules[0]

    a = Reuser()
    pointer(a)
    with pytest.raises(ArgumentError, match=r"capsule named 'used_dltensor_versioned': it was "
                                            r"already consumed"):
        pointer(a)
    assert a.deleted == 1


def test_dlpack_returning_no_capsule_is_refused():
    class Wrong(FakeGPUArray):
        def __dlpack__(self, **kwargs):
            return 42

    with pytest.raises(ArgumentError, match=r"__dlpack__\(\) returned int, not a DLPack capsule"):
        pointer(Wrong())


def test_dlpack_producer_error_is_reported_with_its_message():
    class Failing(FakeGPUArray):
        def __dlpack__(self, **kwargs):
            raise BufferError("cannot export a lazy view")

    with pytest.raises(ArgumentError, match=r"Failing\.__dlpack__\(\) failed: cannot export"):
        pointer(Failing())


def test_real_numpy_capsule_is_released_through_its_own_deleter():
    # numpy's capsule holds a reference to the array until its deleter runs.
    np = pytest.importorskip("numpy")
    arr = np.arange(6.0)

    class PretendsCUDA:
        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kwargs):
            self.capsule = arr.__dlpack__(max_version=kwargs.get("max_version"))
            return self.capsule

    before = sys.getrefcount(arr)
    p = PretendsCUDA()
    with pytest.raises(ArgumentError, match=r"tensor is on the CPU \(DLPack device type 1\)"):
        pointer(p)
    assert capsule_name(p.capsule) == "used_dltensor_versioned"
    del p
    gc.collect()
    assert sys.getrefcount(arr) == before


# ---------------------------------------------------------------------------------------
# Raw integers and unknown objects

def test_raw_integer_is_refused_without_allow_raw():
    with pytest.raises(ArgumentError, match=r"got a raw integer \(0x1000\) where a GPU array was "
                                            r"expected; .* allow_raw=True with device=N"):
        pointer(0x1000)


def test_raw_integer_needs_a_device():
    with pytest.raises(ArgumentError, match=r"allow_raw=True needs device=N \(got None\)"):
        pointer(0x1000, allow_raw=True)


def test_raw_integer_with_device_is_taken_as_is():
    assert pointer(0x1000, allow_raw=True, device=1) == (0x1000, 1)


def test_bool_is_never_a_raw_pointer():
    with pytest.raises(ArgumentError, match=r"cannot pass bool as a GPU array"):
        pointer(True, allow_raw=True, device=0)


def test_unknown_object_is_refused_with_its_type_and_the_fix():
    with pytest.raises(ArgumentError, match=r"cannot pass list as a GPU array: it is not a torch "
                                            r"tensor and has neither __cuda_array_interface__ "
                                            r"nor __dlpack__; pass a torch, CuPy or JAX"):
        pointer([1, 2])


def test_host_array_interface_object_is_refused_as_cpu():
    class HostOnly:
        __array_interface__ = {"data": (0, False), "shape": (1,), "typestr": "<f4", "version": 3}

    with pytest.raises(ArgumentError, match=r"HostOnly is a host \(CPU\) array .*move it to "
                                            r"the GPU first"):
        describe(HostOnly())


# ---------------------------------------------------------------------------------------
# Streams and allocation

def test_frameworks_without_streams_use_the_default_stream():
    assert current_stream("jax", 0) == 0
    assert current_stream("cai", 0) == 0


def test_frameworks_without_streams_have_no_stream_getter():
    assert stream_getter("jax") is None and stream_getter("cai") is None


def test_a_pointer_reader_is_cached_per_type_once_an_array_of_it_was_read():
    class Cai:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x1000, False), "version": 3}

    assert pointer_reader(Cai) is None
    assert pointer(Cai()) == (0x1000, -1)
    reader = pointer_reader(Cai)
    assert reader is not None and reader(Cai(), "cuda", None) == (0x1000, -1)


# ---------------------------------------------------------------------------------------
# GPU: the same pointer as the framework reports

def _cuda_torch() -> bool:
    return torch.cuda.is_available()


class OnlyDLPack:
    """Hides a tensor behind DLPack only, to exercise the generic path on real memory."""

    def __init__(self, t) -> None:
        self.t = t

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__(**kwargs)


class OnlyCAI:
    def __init__(self, t) -> None:
        self.t = t

    @property
    def __cuda_array_interface__(self):
        return self.t.__cuda_array_interface__


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_torch(), reason="needs a GPU visible to torch")
def test_torch_gpu_tensor_gives_data_ptr_and_device():
    backend = "hip" if torch.version.hip else "cuda"
    t = torch.arange(24, dtype=torch.float16, device="cuda").reshape(4, 6).t()[1:]
    assert pointer(t, backend=backend) == (t.data_ptr(), t.get_device())
    info = describe(t, backend=backend)
    assert info == ArrayInfo(t.data_ptr(), t.get_device(), "fp16", (5, 4), (1, 6), "torch")
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.bool, "i1"), (torch.uint8, "u8")):
        assert describe(torch.ones(2, dtype=dtype, device="cuda"), backend=backend).dtype == name
    other = "cuda" if backend == "hip" else "hip"
    with pytest.raises(ArgumentError, match=rf"but the kernel is for {other.upper()}"):
        pointer(t, backend=other)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_torch(), reason="needs a GPU visible to torch")
def test_torch_gpu_tensor_through_dlpack_gives_the_same_pointer():
    backend = "hip" if torch.version.hip else "cuda"
    t = torch.arange(10, dtype=torch.int32, device="cuda")[2:]
    stream = current_stream("torch", t.get_device())
    assert pointer(OnlyDLPack(t), backend=backend, stream=stream) == (t.data_ptr(), t.get_device())
    info = describe(OnlyDLPack(t), backend=backend, stream=stream)
    assert (info.dtype, info.shape, info.strides) == ("i32", (8,), (1,))
    gc.collect()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_torch() or bool(torch.version.hip), reason="needs CUDA torch")
def test_torch_gpu_tensor_through_cai_gives_the_same_pointer():
    t = torch.ones(3, 5, device="cuda")[:, 1:]
    info = describe(OnlyCAI(t))
    assert (info.ptr, info.dtype, info.shape, info.strides) == (t.data_ptr(), "fp32", (3, 4),
                                                                (5, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_torch(), reason="needs a GPU visible to torch")
def test_torch_current_stream():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert current_stream("torch", 0) == s.cuda_stream
        assert stream_getter("torch")(0) == s.cuda_stream


@pytest.mark.gpu
def test_cupy_array_gives_the_pointer_cupy_reports():
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - any failure means no usable device
        pytest.skip(f"no CuPy device: {exc}")
    backend = "hip" if cupy.cuda.runtime.is_hip else "cuda"
    a = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)[:, 1:]
    assert pointer(a, backend=backend) == (a.data.ptr, a.device.id)
    info = describe(a, backend=backend)
    assert (info.dtype, info.shape, info.strides, info.framework) == ("fp32", (3, 3), (4, 1),
                                                                      "cupy")
    assert current_stream("cupy", a.device.id) == cupy.cuda.get_current_stream().ptr


@pytest.mark.gpu
def test_jax_array_gives_its_buffer_pointer_via_dlpack():
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError as exc:
        pytest.skip(f"no JAX GPU: {exc}")
    backend = "hip" if "rocm" in gpu.client.platform_version.lower() else "cuda"
    x = jax.device_put(jax.numpy.arange(8, dtype=jax.numpy.float32), gpu)
    ptr, dev = pointer(x, backend=backend)
    assert ptr == x.unsafe_buffer_pointer()
    assert dev == gpu.local_hardware_id
    info = describe(x, backend=backend)
    assert (info.framework, info.dtype, info.shape) == ("jax", "fp32", (8,))
