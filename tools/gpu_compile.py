"""gpu_compile.py: compile triton_kernels.py's kernels for GPUs that are not here (A100, H100/H200).

BOOST (arXiv 2512.12131) sections 3-4 run on GPUs; this machine has none. Triton can still lower a
kernel to PTX and a cubin for any target, `triton.compile(ASTSource(...), target=GPUTarget("cuda",
90, 32))`, with the ptxas inside the Triton wheel, and `ptxas -v` reports each kernel's registers
and spills. For every kernel, every tile configuration of its list (triton_kernels.GEMM_CONFIGS),
sm_80 and sm_90, bf16 and fp32, this records: registers, spill bytes, shared memory, and whether the
GEMM kernels use tensor cores (`mma.sync` on sm_80, `wgmma` on sm_90; fp32 inputs take exact IEEE
dots, which never do). test_kernels.py asserts that all compile, bf16 GEMMs use tensor cores and
nothing spills.

    TRITON_INTERPRET=0 python tools/gpu_compile.py [--json]
"""
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TRITON_INTERPRET"] = "0"  # compile, not interpret: before triton_kernels imports Triton
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import triton_kernels as tk  # noqa: E402

F32 = ("s_ptr", "ds_ptr", "dg_ptr", "rstd_ptr", "eps")   # always fp32
# the signatures bf16 autocast training launches ("mixed"): norm_down with the fp32 residual x, its
# gain γ and gradient dx beside bf16 A, H and dH; the grouped GEMM reading the fp32 Bs where they
# lie beside bf16 latents (cast in registers)
MIXED_F32 = ("x_ptr", "g_ptr", "dx_ptr", "b0_ptr", "b1_ptr", "b2_ptr")
I32 = ("meta_ptr",)
# the GEMM-shaped kernels and their block names, as the autotuners name them
GEMMS = {name: blocks for name, (_, blocks, _, _) in tk.KERNELS.items()}


# the strides that are 1 in each way local_ops.py calls _grouped_mm (Triton's JIT makes them
# constants)
GROUPED_CALLS = {"expand": ("s_ak", "s_bk", "s_cq"), "dz": ("s_ak", "s_bq", "s_cq")}


def signature(fn, dtype, ones=()):
    """Triton's signature of fn with its tensors in `dtype` ("bf16", "fp32", or "mixed": bf16 but
    the fp32 MIXED_F32) and the arguments in
    `ones` equal to 1, and its attributes as the JIT gives them for aligned shapes: every pointer
    and every other integer divisible by 16."""
    sig, attrs = {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr or name in ones:
            sig[name] = "constexpr"
        elif name in F32 or (dtype == "mixed" and name in MIXED_F32):
            sig[name] = "*fp32" if name.endswith("_ptr") else "fp32"
        elif name in I32:
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16" if dtype == "mixed" else f"*{dtype}"
        else:
            sig[name] = "i32"
        if sig[name] != "constexpr" and name != "eps":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def ptxas(ptx, cap):
    """(registers, spill bytes) from `ptxas -v` on this PTX."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([tool, "-v", f"--gpu-name=sm_{cap}{'a' if cap == 90 else ''}", path,
                              "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True,
                             check=True)
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr))
    return regs, spills


def cases():
    """(sm, dtype, kernel, call, constexprs, num_warps, num_stages) of every configuration a GPU
    would run."""
    for cap in (80, 90):
        for dtype, bits in (("bf16", 16), ("fp32", 32)):
            for name, blocks in GEMMS.items():
                for cfg in tk.gemm_configs(blocks, bits, cap):
                    const = dict(cfg.kwargs, UPCAST=False)
                    for call, ones in (GROUPED_CALLS.items() if name == "grouped_mm"
                                       else [("", ())]):
                        consts = {**const, **({"G": 3} if ones else {}), **{o: 1 for o in ones}}
                        yield cap, dtype, name, call, consts, cfg.num_warps, cfg.num_stages
            for name in GEMMS if bits == 16 else ():
                # (the list triton_kernels.launcher picks for an fp32 residual beside bf16 A)
                mixed = "x32" if name == "norm_down_dx" else 16
                for cfg in tk.gemm_configs(GEMMS[name], mixed, cap):
                    const = dict(cfg.kwargs, UPCAST=False)
                    for call, ones in (GROUPED_CALLS.items() if name == "grouped_mm"
                                       else [("", ())]):
                        consts = {**const, **({"G": 3} if ones else {}), **{o: 1 for o in ones}}
                        yield cap, "mixed", name, call, consts, cfg.num_warps, cfg.num_stages
            for name in ("rms_fwd", "rms_bwd"):
                # d ≤ 4096 (up to 7B), and the 13B and 30B models' 5120, 6656
                for block in (4096, 8192):
                    yield (cap, dtype, name, "", {"ROWS": tk.ROWS_CONFIG["ROWS"], "BLOCK": block},
                           tk.rms_warps(block, backward=name == "rms_bwd"), 1)


def compile_one(case):
    """Compile one case for its GPU; its row of the table."""
    cap, dtype, name, call, const, warps, stages = case
    fn = tk.JIT[name]
    const_d = {**const, **({"IEEE": dtype == "fp32"} if "IEEE" in fn.arg_names else {})}
    sig, attrs = signature(fn, dtype, [k for k in const if k.startswith("s_")])
    kernel = triton.compile(ASTSource(fn, sig, const_d, attrs), target=GPUTarget("cuda", cap, 32),
                            options={"num_warps": warps, "num_stages": stages})
    ptx = kernel.asm["ptx"]
    regs, spills = ptxas(ptx, cap)
    tiles = {k: v for k, v in const.items() if k not in ("UPCAST", "G") and not k.startswith("s_")}
    return {"sm": cap, "kernel": name + (f" ({call})" if call else ""), "dtype": dtype,
            "tiles": tiles,
            "num_warps": warps, "num_stages": stages, "registers": regs, "spill_bytes": spills,
            "shared_bytes": kernel.metadata.shared, "gemm": name in GEMMS,
            "mma": "mma.sync" in ptx, "wgmma": "wgmma.mma_async" in ptx}


def compile_all(workers=os.cpu_count()):
    """Every case, compiled by `workers` processes (each compile is single-threaded)."""
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return pool.map(compile_one, list(cases()))


def main(argv):
    rows = compile_all()
    if "--json" in argv:
        print(json.dumps(rows))
        return
    print("| sm | kernel | dtype | tiles | warps | stages | registers | spill bytes | shared KB | "
          "tensor cores |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tc = "wgmma" if r["wgmma"] else "mma" if r["mma"] else "-"
        tiles = "x".join(str(v) for v in r["tiles"].values())
        print(f"| {r['sm']} | {r['kernel']} | {r['dtype']} | {tiles} | {r['num_warps']} | "
              f"{r['num_stages']} | "
              f"{r['registers']} | {r['spill_bytes']} | {r['shared_bytes'] / 1024:.0f} | {tc} |")


if __name__ == "__main__":
    main(sys.argv[1:])
