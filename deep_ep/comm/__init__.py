"""Communication layer: transports that give the kernels their peers' windows (NCCL LSA, emulated)."""
