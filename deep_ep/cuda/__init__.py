"""The ground floor: the CUDA driver (contexts), dedicated streams and the libnccl torch loaded.

Both the JIT (`deep_ep.jit`) and the communication layer (`deep_ep.comm`) stand on this package;
it imports neither.

Modules:
    ``driver``   ``cuda.bindings.driver``, the devices' primary contexts, error names.
    ``streams``  dedicated communication streams and cheap stream-to-stream ordering.
    ``nccl``     the libnccl mapped into this process (by torch): path, ctypes handle, version.
"""
