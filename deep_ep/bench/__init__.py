"""The main job: ``python -m deep_ep bench`` (also ``deep-ep bench``); see docs/bench.md.

Modules (each imports only those listed before it, and `deep_ep`'s public API):

* `fp8`: FP8 quantisation of the inputs; `config`: options -> `BenchConfig`, inputs, byte counts;
* `progress`: progress lines; `check`: comparison with `deep_ep.reference`;
* `session`: one rank's calls, timings and checks; `report`: rows, tables, JSON;
* `plot`: charts; `sweep`: ``--sm-sweep``; `eplb`: the ``--eplb`` pass;
* `runner_cpu`: gloo processes; `gpu_timing`, `runner_gpu`: the GPU path (imported lazily);
* `cli`: the options and `main`.
"""
from .cli import add_arguments, main
from .fp8 import dequantize_fp8, quantize_fp8

__all__ = ["add_arguments", "main", "quantize_fp8", "dequantize_fp8"]
