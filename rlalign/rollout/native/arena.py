"""Device memory that can be given back to the GPU and taken again at the same addresses.

A colocated generator (placement.colocate on CUDA) shares its GPU with a trainer rank: while the
trainer trains, the generator's weights and KV cache are not needed, so their physical memory goes
back to the driver (the trainer's process can allocate it), and before the generator runs again it
is mapped back at the same virtual addresses. The addresses are what matter: the engine's captured
CUDA graphs read the weights and the KV cache by address, so they stay valid and are never captured
again. The contents do not survive a release: the weight sync writes every parameter and the KV
cache is zeroed (stale entries are never attended to, but must be finite numbers).

This is CUDA's virtual memory management (cuMemAddressReserve / cuMemCreate / cuMemMap through the
driver library, the mechanism vLLM's sleep mode uses): one reserved address range per arena, one
physical allocation mapped onto it while resident. Tensors are views of the range
(torch.as_tensor over its __cuda_array_interface__); the arena owns the memory, not torch's
allocator, so torch's memory statistics do not count it.
"""

from __future__ import annotations

import ctypes
import math

import torch

ALIGN = 256  # bytes: every tensor of an arena starts at an aligned offset


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _ON_DEVICE, _READ_WRITE, _GRANULARITY_RECOMMENDED = 1, 1, 3, 1
_DRIVER = None


def _driver():
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = ctypes.CDLL("libcuda.so.1")
    return _DRIVER


def _check(result: int, call: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(msg))
        raise RuntimeError(f"device memory arena: {call} failed: CUDA error {result} "
                           f"({msg.value.decode() if msg.value else 'unknown'})")


class _Span:
    """`nbytes` at `ptr` as a CUDA array (what torch.as_tensor reads)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class DeviceArena:
    """`nbytes` (rounded up to the driver's granularity) of device memory at a fixed address range;
    `tensor()` hands out views of it; `release()` gives the physical memory back, `resume()` maps
    new physical memory at the same addresses (contents undefined until written)."""

    def __init__(self, nbytes: int, device: torch.device):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device memory arena: {device} is not a CUDA device")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.cuda.current_stream().synchronize()  # the runtime's primary context is current on this thread
        self._prop = _AllocationProp()
        self._prop.type, self._prop.location = _PINNED, _Location(_ON_DEVICE, self.device.index)
        gran = ctypes.c_size_t()
        _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self._prop),
                                                       _GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity")
        self.nbytes = max(1, math.ceil(max(nbytes, 1) / gran.value)) * gran.value
        ptr = ctypes.c_uint64()
        _check(_driver().cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(self.nbytes),
                                             ctypes.c_size_t(gran.value), ctypes.c_uint64(0), ctypes.c_uint64(0)),
               "cuMemAddressReserve")
        self.ptr, self.used, self._handle = ptr.value, 0, None
        self.resume()
        self._base = torch.as_tensor(_Span(self.ptr, self.nbytes), device=self.device)

    @property
    def resident(self) -> bool:
        return self._handle is not None

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of the arena (bump allocation; contents undefined)."""
        start = -(-self.used // ALIGN) * ALIGN
        n = math.prod(shape) * dtype.itemsize
        if start + n > self.nbytes:
            raise RuntimeError(f"device memory arena: {n} bytes for a {dtype} tensor of shape {tuple(shape)} do not "
                               f"fit ({self.nbytes - start} of {self.nbytes} left)")
        self.used = start + n
        return self._base[start : start + n].view(dtype).view(shape)

    def release(self) -> None:
        """Give the physical memory back (after the device has finished every queued use of it)."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)
        _check(_driver().cuMemUnmap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes)), "cuMemUnmap")
        _check(_driver().cuMemRelease(ctypes.c_uint64(self._handle)), "cuMemRelease")
        self._handle = None

    def resume(self) -> None:
        """Map new physical memory at the arena's addresses (raises torch.OutOfMemoryError when the
        device has not that much free)."""
        if self._handle is not None:
            return
        torch.cuda.synchronize(self.device)  # (also makes the device's primary context current on this thread)
        handle = ctypes.c_uint64()
        r = _driver().cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.nbytes), ctypes.byref(self._prop),
                                  ctypes.c_uint64(0))
        if r == 2:  # CUDA_ERROR_OUT_OF_MEMORY
            free, total = torch.cuda.mem_get_info(self.device)
            raise torch.OutOfMemoryError(f"device memory arena: {self.nbytes / 2**30:.2f} GiB do not fit on "
                                         f"{self.device} ({free / 2**30:.2f} of {total / 2**30:.2f} GiB free)")
        _check(r, "cuMemCreate")
        try:
            _check(_driver().cuMemMap(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0),
                                      handle, ctypes.c_uint64(0)), "cuMemMap")
        except RuntimeError:
            _driver().cuMemRelease(handle)
            raise
        access = _AccessDesc(_Location(_ON_DEVICE, self.device.index), _READ_WRITE)
        _check(_driver().cuMemSetAccess(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes), ctypes.byref(access),
                                        ctypes.c_size_t(1)), "cuMemSetAccess")
        self._handle = handle.value

    def close(self) -> None:
        """Release the memory and the address range; the arena's tensors must not be used after."""
        if self.ptr is None:
            return
        self.release()
        self._base = None
        _check(_driver().cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes)),
               "cuMemAddressFree")
        self.ptr = None
