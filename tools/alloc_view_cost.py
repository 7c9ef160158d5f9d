"""Host cost of a fresh dispatch's small outputs as separate allocations against views of one
allocation, of `torch.empty` against ``new_empty`` of a kept empty tensor (which takes its
dtype and device without parsing them: about 0.6 us less per allocation on the CPU machine, with
CPU tensors), and of the sizes given as a tuple against separate arguments (0.45 us less there),
on the GPU when there is one: us per operation, best of 5 rounds.

Usage: python tools/alloc_view_cost.py
"""
import torch

from deep_ep.bench.gpu_timing import best_host_us

T, K, H = 4096, 8, 7168


def main() -> None:
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    words = 4096 + T + 2 * T * K * 2 + T * K   # layout + pos_tok, two int64 [T, K], one fp32 [T, K]
    slab = torch.empty(words, dtype=torch.int32, device=dev)
    w64 = slab.view(torch.int64)
    f32 = slab.view(torch.float32)
    template = torch.empty(0, dtype=torch.int64, device=dev)
    idx = dev.index if dev.type == "cuda" else "cpu"
    shape = (T, H)
    rows = [
        # how the sizes and the device are passed (`deep_ep.backends.outputs.empty` takes the second)
        ("torch.empty((T, H)) bf16, sizes as a tuple", lambda: torch.empty(shape, dtype=torch.bfloat16, device=dev)),
        ("torch.empty(*(T, H)) bf16, sizes as arguments", lambda: torch.empty(*shape, dtype=torch.bfloat16,
                                                                              device=dev)),
        ("torch.empty(*(T, H)) bf16, device as an index", lambda: torch.empty(*shape, dtype=torch.bfloat16,
                                                                              device=idx)),
        ("torch.empty [T, K] int64", lambda: torch.empty((T, K), dtype=torch.int64, device=dev)),
        ("template.new_empty [T, K] int64", lambda: template.new_empty((T, K))),
        ("torch.empty [T, K] float32", lambda: torch.empty((T, K), dtype=torch.float32, device=dev)),
        ("torch.empty [T, H] bf16", lambda: torch.empty((T, H), dtype=torch.bfloat16, device=dev)),
        ("torch.empty [n] int32", lambda: torch.empty(words, dtype=torch.int32, device=dev)),
        ("slab.view(torch.int64)", lambda: slab.view(torch.int64)),
        ("w64.as_strided([T, K])", lambda: w64.as_strided((T, K), (K, 1), 4096)),
        ("f32.as_strided([T, K])", lambda: f32.as_strided((T, K), (K, 1), 8192)),
        ("slab[a:b].view(int64).view(T, K)", lambda: slab[4096:4096 + 2 * T * K].view(torch.int64).view(T, K)),
        ("3 x torch.empty (idx, weights, topk copy)", lambda: (
            torch.empty((T, K), dtype=torch.int64, device=dev), torch.empty((T, K), dtype=torch.float32, device=dev),
            torch.empty((T, K), dtype=torch.int64, device=dev))),
        ("slab view + 3 as_strided", lambda: (
            slab.view(torch.int64).as_strided((T, K), (K, 1), 4096), slab.view(torch.float32).as_strided(
                (T, K), (K, 1), 8192), w64.as_strided((T, K), (K, 1), 8192))),
    ]
    print(f"device {dev}; us per operation (best of 5 rounds of 2000)")
    for name, fn in rows:
        print(f"  {name:44s} {best_host_us(fn, calls=2000, rounds=5, warmup=200):6.2f}")


if __name__ == "__main__":
    main()
