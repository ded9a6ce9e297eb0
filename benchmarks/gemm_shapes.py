"""The GEMMs of a few public rows timed on the GPU, beside the planner's rate for them (issue 20 item 4).

    PYTHONPATH=src .venv/bin/python benchmarks/gemm_shapes.py                 # on a GPU (< 90 s): measure
    PYTHONPATH=src .venv/bin/python benchmarks/gemm_shapes.py --cpu-smoke     # tiny sizes on the CPU: the code path
    PYTHONPATH=src .venv/bin/python benchmarks/gemm_shapes.py --validate      # the candidate model on validate --loo

Shape lists (one per public row, catalog/runs.toml): every GEMM the planner times for one decoder layer at the row's
micro-batch (forward y = xW, backward dX = dY W^T and dW = X^T dY of each projection, estimate/planner/layer.py
layer_gemm_shapes, TP-sharded) and the LM head: MPT-1B mb12, MPT-7B mb6, MPT-30B mb8 (llm-foundry's large-scale H100
table, 2048 tokens), Llama 3.1 70B and 405B at TP8, one 8192-token sequence (Llama 3 Table 4's micro-batch).

Each GEMM is a bf16 ``torch.matmul`` of (m x k) @ (k x n), timed with CUDA events after warm-up, the median of up to
--reps runs (fewer once a list has spent --budget seconds), synchronised before and after. Printed beside it:
- ``planner``: today's model at the sustained clock 1 (a short benchmark is no long run): MAMF x its 128 x 128 tile
  and wave quantization on a roofline (layer.gemm_time);
- ``shape``: the candidate shape model this script holds (``CandidateShape``, not wired into the planner: it did not
  improve `validate --loo`, benchmarks/RESULTS.md "GEMM shapes"): the generation's cuBLAS tile (Hopper 128 x 256,
  Ampere 256 x 128) in its better orientation, waves of one tile per SM, split-K when a GEMM has fewer tiles than SMs,
  rated at MAMF x its quantization over the MAMF best shape's (at most 1), on the same roofline;
- ``shape+epi``: the same with each tile's epilogue (its bf16 output written at the HBM rate) exposed after its K
  loop: k / (k + peak / HBM bandwidth).
The median measured / predicted ratio per list says which model reads the GPU better.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainscale.estimate.planner import layer
from trainscale.estimate.planner.efficiencies import load_efficiencies
from trainscale.specs import GPUSpec, ModelSpec, load_gpu, load_model

# (label, model, micro-batch tokens, tensor parallel)
ROWS = (
    ("MPT-1B mb12 (foundry-1b-h100-s2048)", "mpt-1b", 12 * 2048, 1),
    ("MPT-7B mb6 (foundry-7b-h100-s2048)", "mpt-7b", 6 * 2048, 1),
    ("MPT-30B mb8 (foundry-30b-h100-s2048)", "mpt-30b", 8 * 2048, 1),
    ("Llama 3.1 70B tp8 mb1 x 8192", "llama3.1-70b", 8192, 8),
    ("Llama 3.1 405B tp8 mb1 x 8192 (llama3-405b-8k)", "llama3.1-405b", 8192, 8),
)

# The candidate's tile per generation, and the shape each generation's MAMF figure (catalog/planner.toml
# matmul_efficiency) was measured at.
TILES = {
    "hopper": (128, 256, (6144, 17920, 2816),
               "cuBLAS 12 bf16 kernels on H100: sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_"
               "warpgroupsize2x1x1 (public H100 profiler traces; CUTLASS 3 SM90 cooperative kernel, 2 consumer "
               "warpgroups); MAMF shape: Stas Bekman ml-engineering compute/accelerator/README.md @249778b, H100 SXM "
               "792.1 TFLOPS at 6144x17920x2816"),
    "ampere": (256, 128, (6912, 16384, 2048),
               "NVIDIA Matrix Multiplication Background User's Guide (DU-09799-001) Sec. 2.3 (256x128 / 128x256 the "
               "most efficient cuBLAS tiles) and 3.2 (A100: 108 SMs, one 256x128 tile each per wave); MAMF shape: "
               "ml-engineering @249778b, A100 SXM 267.9 TFLOPS at 6912x16384x2048"),
}
SPLIT_K_MIN = 256  # the shortest K piece a split keeps: 4 K-blocks of 64 (the tiles' K depth)


@dataclass(frozen=True)
class CandidateShape:
    """The candidate per-GEMM model: tile, SMs (one tile per SM), exposed epilogue in K units, MAMF shape factor."""

    tile_m: int
    tile_n: int
    sms: int
    k_epilogue: float = 0.0
    q_mamf: float = 1.0


def split_k(tiles: Any, k: Any, sms: int) -> Any:
    """K pieces for an output of ``tiles`` tiles: as many as fill the SMs (cuBLAS segment-K / CUTLASS split-K), at
    least 1, none shorter than SPLIT_K_MIN."""
    return np.maximum(1.0, np.minimum(np.floor(sms / tiles), np.floor(k / SPLIT_K_MIN)))


def tile_wave_util(mm: Any, k: Any, n: Any, tile_m: int, tile_n: int, sms: int) -> Any:
    """Useful share of the tensor-core work: tile padding (Matrix Multiplication Background guide Sec. 3.1) times the
    last wave's idle SMs (Sec. 3.2), after split-K."""
    tiles = np.ceil(mm / tile_m) * np.ceil(n / tile_n)
    util = mm * n / (tiles * tile_m * tile_n)
    units = tiles * split_k(tiles, k, sms)
    return util * units / (np.ceil(units / sms) * sms)


def shape_factor(mm: Any, k: Any, n: Any, s: CandidateShape) -> Any:
    util = np.maximum(tile_wave_util(mm, k, n, s.tile_m, s.tile_n, s.sms),
                      tile_wave_util(mm, k, n, s.tile_n, s.tile_m, s.sms))
    return util * k / (k + s.k_epilogue)


def candidate(gpu: GPUSpec, sms: int | None = None, epilogue: bool = False) -> CandidateShape | None:
    """The candidate model for ``gpu`` (None for a generation without a tile above)."""
    t = TILES.get(gpu.generation)
    if t is None or not gpu.sm_count:
        return None
    k_epi = gpu.peak_bf16_flops / gpu.hbm_bandwidth if epilogue else 0.0
    mm, n, k = t[2]
    q = float(shape_factor(float(mm), float(k), float(n), CandidateShape(t[0], t[1], gpu.sm_count, k_epi)))
    return CandidateShape(t[0], t[1], sms or gpu.sm_count, k_epi, q)


def candidate_time(mm: Any, k: Any, n: Any, flops_per_s: float, bytes_per_s: float, s: CandidateShape,
                   launch_s: float = 0.0) -> Any:
    """The candidate's roofline: 2mkn / (MAMF x min(1, shape_factor / q_mamf)) against the bf16 bytes of A, B, C."""
    mm, k, n = (np.asarray(x, dtype=float) for x in (mm, k, n))
    eff = np.minimum(shape_factor(mm, k, n, s) / s.q_mamf, 1.0)
    t = np.maximum(2.0 * mm * k * n / (flops_per_s * eff), layer.ACT_BYTES * (mm * k + k * n + mm * n) / bytes_per_s)
    return np.maximum(t, launch_s)


# ------------------------------------------------------------------ the shape lists


def row_gemms(m: ModelSpec, tokens: int, tp: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of every GEMM of one decoder layer and the LM head, forward and backward, deduplicated."""
    out: dict[tuple[int, int, int], str] = {}
    linears = {name: (int(a), int(b)) for name, (a, b) in layer.layer_gemm_shapes(m, tp).items()}
    linears["head"] = (m.d_model, int(m.vocab_size / tp))
    for name, (k_in, n_out) in linears.items():
        for part, shape in (("fwd", (tokens, k_in, n_out)), ("dX", (tokens, n_out, k_in)),
                            ("dW", (k_in, tokens, n_out))):
            out.setdefault(shape, f"{name}.{part}")
    return [(name, *shape) for shape, name in out.items()]


def predictions(gpu: GPUSpec, shapes: list[tuple[str, int, int, int]]) -> dict[str, np.ndarray]:
    """Seconds per GEMM under the planner's model and the candidate's, at the GPU's MAMF and clock 1."""
    eff = load_efficiencies(gpu.name)
    f_mm, hbm = gpu.peak_bf16_flops * eff.matmul_efficiency, gpu.hbm_bandwidth * eff.hbm_efficiency
    mm, k, n = (np.array([s[i] for s in shapes], dtype=float) for i in (1, 2, 3))
    out = {"planner": layer.gemm_time(mm, k, n, f_mm, hbm, gpu.sm_count)}
    for label, epi in (("shape", False), ("shape+epi", True)):
        c = candidate(gpu, epilogue=epi)
        if c is not None:
            out[label] = candidate_time(mm, k, n, f_mm, hbm, c)
    return out


# ------------------------------------------------------------------ timing


def time_matmul(torch: Any, mm: int, k: int, n: int, device: str, dtype: Any, reps: int, deadline: float) -> float:
    """Median seconds of (mm x k) @ (k x n) over up to ``reps`` runs after 3 warm-up runs, stopping at ``deadline``
    (at least 3 timed runs)."""
    a = torch.randn(mm, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    cuda = device == "cuda"
    for _ in range(3):
        torch.matmul(a, b)
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < reps and (len(times) < 3 or time.perf_counter() < deadline):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
    del a, b
    return statistics.median(times)


def gpu_of(torch: Any, name: str | None) -> GPUSpec:
    """The catalog GPU the device is (by its name), or --gpu."""
    if name:
        return load_gpu(name)
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    for key, cat in (("H200", "h200"), ("H100", "h100-sxm"), ("H800", "h800"), ("A100", "a100-sxm-80gb")):
        if key in dev:
            return load_gpu(cat)
    return load_gpu("h100-sxm")


def measure(args: argparse.Namespace) -> int:
    import torch

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the code path", file=sys.stderr)
        return 2
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    gpu = gpu_of(torch, args.gpu)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if not smoke else gpu.sm_count
    print(f"device {'cpu (smoke: shapes / 64, fp32)' if smoke else torch.cuda.get_device_name(0)}; predictions for "
          f"{gpu.name} ({gpu.sm_count} SMs in the catalog, {sms} on the device), torch {torch.__version__}")
    report: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for label, model, tokens, tp in ROWS:
        shapes = row_gemms(load_model(model), tokens, tp)
        pred = predictions(gpu, shapes)
        print(f"\n{label}")
        print(f"{'gemm':<10} {'m':>6} {'k':>6} {'n':>6} {'measured':>9} " + " ".join(f"{p:>10}" for p in pred)
              + "   TFLOP/s")
        deadline = time.perf_counter() + args.budget
        ratios: dict[str, list[float]] = {p: [] for p in pred}
        for i, (name, mm, k, n) in enumerate(shapes):
            run = (max(mm // 64, 16), max(k // 64, 16), max(n // 64, 16)) if smoke else (mm, k, n)
            t = time_matmul(torch, *run, device, dtype, args.reps, deadline)
            got = 2.0 * run[0] * run[1] * run[2] / t / 1e12
            want = {p: 2.0 * mm * k * n / pred[p][i] / 1e12 for p in pred}
            for p in pred:
                ratios[p].append(got / want[p])
            print(f"{name:<10} {mm:>6} {k:>6} {n:>6} {got:>9.{3 if smoke else 1}f} "
                  + " ".join(f"{want[p]:>10.1f}" for p in pred))
            report.append({"row": label, "gemm": name, "m": mm, "k": k, "n": n, "measured_tflops": got,
                           **{f"{p}_tflops": want[p] for p in pred}})
        print("median measured / predicted: " + ", ".join(f"{p} {statistics.median(r):.3f}"
                                                         for p, r in ratios.items()))
    print(f"\nwhole script {time.perf_counter() - t_all:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu.name, "smoke": smoke, "rows": report}, f, indent=1)
    return 0


# ------------------------------------------------------------------ the candidate on `validate --loo`


def validate_candidate(epilogue: bool | None, overrides: dict[str, float] | None = None) -> dict[str, Any]:
    """`validate --loo` with the candidate wired in place of layer.gemm_time (every GEMM the planner times: the
    layer projections, the LM head, unfused attention's products, the MoE experts and router). ``epilogue`` None:
    the planner as it is. ``overrides``: planner constants fixed (then no leave-one-out: nothing is fitted)."""
    from trainscale.estimate.planner import moe
    from trainscale.estimate.planner.validate import validate

    current: dict[str, CandidateShape | None] = {"s": None}
    orig_rates, orig_gemm = layer.rates, layer.gemm_time

    def rates(gpu: GPUSpec, eff: Any, sw: Any) -> layer.Rates:
        r = orig_rates(gpu, eff, sw)
        current["s"] = None if epilogue is None else candidate(gpu, r.sms, epilogue)
        return r

    def gemm_time(mm: Any, k: Any, n: Any, flops_per_s: float, bytes_per_s: float, sms: int = 0,
                  launch_s: float = 0.0) -> Any:
        s = current["s"]
        if s is None:
            return orig_gemm(mm, k, n, flops_per_s, bytes_per_s, sms, launch_s)
        return candidate_time(mm, k, n, flops_per_s, bytes_per_s, s, launch_s)

    layer.rates, layer.gemm_time = rates, gemm_time
    try:
        assert moe.gemm_train_time is layer.gemm_train_time  # it calls layer.gemm_time by name: patched too
        return validate(overrides=overrides, loo=overrides is None)
    finally:
        layer.rates, layer.gemm_time = orig_rates, orig_gemm


def validate_table() -> int:
    """The three models on `validate --loo` (the fitted sustained clock refit per generation), and with the clock
    fixed at 1 (no fitted constant)."""
    print("| model | catalog mean / worst | in-sample | leave-one-out | refit hopper / ampere | clock 1, no fit |\n"
          "|---|---|---|---|---|---|")
    for label, epi in (("planner today (128x128 tiles, waves)", None),
                       ("candidate: cuBLAS tile, waves, split-K, MAMF ceiling", False),
                       ("candidate + exposed tile epilogue", True)):
        v, one = validate_candidate(epi), validate_candidate(epi, {"sustained_clock_fraction": 1.0})
        fit = {f["scope"]: f["fit_all_rows"] for f in v["fit"]}
        print(f"| {label} | {v['mean_abs_error']:.2%} / {v['worst_abs_error']:.1%} | "
              f"{v['in_sample']['mean_abs_error']:.2%} / {v['in_sample']['worst_abs_error']:.1%} | "
              f"{v['loo']['mean_abs_error']:.2%} / {v['loo']['worst_abs_error']:.1%} | "
              f"{fit.get('hopper', float('nan')):.3f} / {fit.get('ampere', float('nan')):.3f} | "
              f"{one['mean_abs_error']:.1%} / {one['worst_abs_error']:.1%} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes (/ 64) in fp32 on the CPU")
    ap.add_argument("--validate", action="store_true", help="the candidate model on `validate --loo` (CPU)")
    ap.add_argument("--gpu", help="catalog GPU for the predictions (default: from the device's name)")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per GEMM (median)")
    ap.add_argument("--budget", type=float, default=15.0, help="seconds per shape list before cutting runs to 3")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    return validate_table() if args.validate else measure(args)


if __name__ == "__main__":
    sys.exit(main())
