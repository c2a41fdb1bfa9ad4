"""gpu_check_tp.py: gpu_check.py's tp step: two tensor-parallel ranks on one GPU, equal to one.

BOOST (arXiv 2512.12131) section 2: bottleneck-aware TP. NCCL refuses two ranks on one device, so
here the two ranks of a TP group share the one GPU over gloo, which takes CUDA tensors (copying them
through the host): slow, but the layouts' collectives, CopyUp's overlapped backward (--overlap), the
vocabulary-parallel cross-entropy and the Triton kernels then run on CUDA tensors at least once.
A CoLA model under BTP at tp=2 trains STEPS SGD steps beside the single-device model on each rank;
every step's loss and every gradient (gathered to full shape) must equal the one device's within
fp32 rounding. On a CPU (--cpu) the same on CPU tensors, the kernels interpreted.
"""
import datetime
import json
import os
import tempfile

import torch
import torch.distributed as dist

STEPS, LR = 3, 0.1
TOL = dict(rtol=1e-4, atol=1e-5)   # fp32: the TP sums in another order than one device's


def rank_main(tp_rank, world, store, device, out):
    """One rank: the TP model and the reference side by side; its largest differences to `out`."""
    import local_ops
    from extensions import kernel_ops  # noqa: F401  (the Triton side registers itself)
    from tp_model import TPLlama
    import parallel
    from model import Config, Llama
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=tp_rank, world_size=world,
                            store=dist.FileStore(store, world),
                            timeout=datetime.timedelta(seconds=40))   # (< gpu_check's slot)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    local_ops.select("triton", device)
    cfg = Config(arch="cola", n_layer=2, n_embd=64, n_head=4, n_kv_head=2, block_size=32,
                 vocab_size=128)
    torch.manual_seed(0)
    ref = Llama(cfg)
    tp = parallel.TPGroup(dist.group.WORLD, tp_rank, world, overlap=True)
    model = TPLlama(ref, tp, "btp").to(device)
    ref = ref.to(device)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (ref, model)]
    worst = {"loss": 0.0, "grad": 0.0}
    for step in range(STEPS):
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size),
                            generator=torch.Generator().manual_seed(step)).to(device)
        want = ref(idx, idx)[1]   # (model.py: PyTorch ops only)
        want.backward()
        got = model(idx, idx)[1]
        got.backward()
        torch.testing.assert_close(got, want, **TOL)
        worst["loss"] = max(worst["loss"], abs(got.item() - want.item()) / abs(want.item()))
        for name, g in model.full_tensors(grads=True).items():
            g_ref = dict(ref.named_parameters())[name].grad
            torch.testing.assert_close(g, g_ref, **TOL, msg=lambda m: f"step {step} {name}: {m}")
            worst["grad"] = max(worst["grad"], ((g - g_ref).norm() / g_ref.norm()).item())
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    if tp_rank == 0:
        with open(out, "w") as fh:
            json.dump(worst, fh)
    dist.barrier()
    dist.destroy_process_group()


def step(args):
    """gpu_check's step: two ranks spawned on the one device; one line, then RESULT."""
    import torch.multiprocessing as mp
    device = "cpu" if args.cpu else "cuda:0"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "worst.json")
        try:
            mp.start_processes(rank_main, args=(2, os.path.join(tmp, "store"), device, out),
                               nprocs=2, start_method="spawn")
            worst = json.load(open(out))
        except Exception as e:   # (a rank's failure: its message, one line)
            print(f"FAIL tp=2 BTP on {device} over gloo: {str(e).strip().splitlines()[-1]}",
                  flush=True)
            print("RESULT " + json.dumps({"failed": 1}), flush=True)
            return
    print(f"ok   tp=2 BTP on {device} over gloo, {STEPS} steps, Triton kernels, CopyUp: equal to "
          f"one device (loss {worst['loss']:.1e}, gradients {worst['grad']:.1e} relative)",
          flush=True)
    print("RESULT " + json.dumps({"failed": 0, **worst}), flush=True)
