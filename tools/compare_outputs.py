"""Dump, or compare, the outputs of a fixed set of dispatch/combine calls on the GPU.

For checking that a change leaves every output bit-identical (a refactor, a kernel reorganisation):
run ``dump`` in each tree on the same GPU, then ``compare`` the two files.

    PYTHONPATH=<tree> python3 tools/compare_outputs.py dump OUT.pt
    python3 tools/compare_outputs.py compare A.pt B.pt

The calls: EP=1 through a one-rank NCCL group and four emulated ranks; BF16 with weights, FP8
(float32 scales), expanded with alignment 128, cached dispatch, combine with weights and two
biases, a 128-token decode batch. Inputs come from fixed seeds (random, never zeros), the same in
every tree. Only the public API is used, so any two versions with the same API can be compared.
"""
from __future__ import annotations

import os
import sys

import torch


def _inputs(seed: int, T: int, H: int, E: int, K: int, fp8: bool):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
    w = torch.rand((T, K), generator=g)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    if fp8:
        x = ((torch.randn((T, H), generator=g) * 4).to(torch.float8_e4m3fn), torch.rand((T, H // 128), generator=g) + 0.5)
    biases = tuple(torch.randn((T, H), generator=g).to(torch.bfloat16) for _ in range(2))
    return x, idx, w, biases


def _to(v, dev):
    if isinstance(v, tuple):
        return tuple(_to(t, dev) for t in v)
    return v.to(dev) if isinstance(v, torch.Tensor) else v


def _flat(prefix: str, v, out: dict) -> None:
    if isinstance(v, (tuple, list)):
        for i, t in enumerate(v):
            _flat(f"{prefix}.{i}", t, out)
    elif isinstance(v, torch.Tensor):
        out[prefix] = v.detach().clone()   # on the device; copied to the host after a stream sync


CONFIGS = [  # name, tokens, hidden, experts, top-k, fp8, expand
    ("bf16", 512, 7168, 256, 8, False, False),
    ("fp8", 512, 7168, 256, 8, True, False),
    ("expand", 512, 7168, 256, 8, False, True),
    ("decode", 128, 7168, 256, 8, False, False),
]


def _run_rank(group, rank: int, dev, results: dict, tag: str) -> None:
    import deep_ep
    # Inputs first, all of them: with emulated ranks nothing may block on the host (a pageable copy
    # or a device-wide synchronize) while a peer's kernel spins waiting for this rank.
    inputs = [_to(_inputs(1000 * ci + rank, T, H, E, K, fp8), dev)
              for ci, (name, T, H, E, K, fp8, expand) in enumerate(CONFIGS)]
    scales = [torch.rand(H, generator=torch.Generator().manual_seed(77 + ci)).to(dev)
              for ci, (name, T, H, E, K, fp8, expand) in enumerate(CONFIGS)]
    torch.cuda.current_stream().synchronize()
    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=512, hidden=7168, num_topk=8, use_fp8_dispatch=False)
    for ci, (name, T, H, E, K, fp8, expand) in enumerate(CONFIGS):
        x, idx, w, biases = inputs[ci]
        kw = dict(do_expand=True, expert_alignment=128, do_zero_padding=True) if expand else {}
        recv_x, recv_idx, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=E, **kw)
        out = {}
        _flat("dispatch.recv_x", recv_x, out)
        _flat("dispatch.recv_idx", recv_idx, out)
        _flat("dispatch.recv_w", recv_w, out)
        for f in ("rank_prefix_sum", "num_recv_tokens_per_expert", "recv_src_rank", "recv_src_token", "send_pos",
                  "recv_src_metadata", "dst_buffer_slot_idx", "psum_num_recv_tokens_per_expert"):
            _flat(f"handle.{f}", getattr(handle, f, None), out)   # the fields a tree has
        cached = buf.dispatch(x, handle=handle)
        _flat("cached.recv_x", cached[0], out)
        data = recv_x[0].float() if fp8 else recv_x.float()
        y = (data * scales[ci]).to(torch.bfloat16)
        cw = (recv_w * 0.5 + 0.25) if recv_w is not None else None
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=cw, bias=biases)
        _flat("combine.x", combined, out)
        _flat("combine.w", combined_w, out)
        torch.cuda.current_stream().synchronize()   # this rank's stream only: peers may still be running
        results[f"{tag}/{name}/rank{rank}"] = {k: v.cpu() for k, v in out.items()}
    buf.destroy()


def dump(path: str) -> None:
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    from deep_ep.emulated import EmulatedGroup
    dev = torch.device("cuda", 0)
    results: dict = {}
    group4 = EmulatedGroup(4, device=dev)       # before the process uses CUDA otherwise
    group4.run(lambda g: _run_rank(g, g.rank(), dev, results, "emulated4"))
    try:
        from deep_ep.bench.gpu_timing import single_rank_nccl_group
    except ImportError:  # an older tree
        from deep_ep.bench_gpu import single_rank_nccl_group
    _run_rank(single_rank_nccl_group(dev), 0, dev, results, "ep1")
    torch.save(results, path)
    print(f"dumped {sum(len(v) for v in results.values())} tensors of {len(results)} calls to {path}")


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    bad = 0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"{key}: only in {'A' if key in a else 'B'}")
            bad += 1
            continue
        for name in sorted(set(a[key]) | set(b[key])):
            ta, tb = a[key].get(name), b[key].get(name)
            if ta is None or tb is None or ta.shape != tb.shape or ta.dtype != tb.dtype:
                print(f"{key} {name}: differs in presence, shape or dtype")
                bad += 1
                continue
            ua = ta.contiguous().view(torch.uint8) if ta.numel() else ta
            ub = tb.contiguous().view(torch.uint8) if tb.numel() else tb
            if not torch.equal(ua, ub):
                n = int((ua != ub).sum())
                print(f"{key} {name}: {n} bytes differ")
                bad += 1
    total = sum(len(v) for v in a.values())
    print(f"compare: {total} tensors, {bad} differ" + (" -- BIT-IDENTICAL" if bad == 0 else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
