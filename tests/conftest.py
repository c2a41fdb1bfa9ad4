"""conftest.py: what the test files share: the tiny run, the prepared corpus, runners for train.py
in this process, under torchrun and in spawned gloo groups, and the one-line-error check.
Run the tests with: make test (or .venv/bin/python -m pytest -q from the root); make test-fast
leaves out the tests marked slow. The GPT-2 vocabulary comes from TIKTOKEN_CACHE_DIR, never a download.
"""
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parallel
from plumbing import preparation
import train
from model import Config
from plumbing import data, placement

ROOT = Path(__file__).resolve().parents[1]   # the repository: train.py and the other core files

TINY = ["--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=32", "--block_size=32",
        "--batch_size=4", "--eval_iters=2", "--sample_tokens=0", "--warmup_iters=2", "--log_interval=1"]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """One prepared copy of the embedded corpus for the whole session."""
    d = tmp_path_factory.mktemp("data")
    preparation.prepare(data.EMBEDDED, "bytes", d, log=lambda *a: None)
    return d


def run_train(out_dir, data_dir, *args):
    """train.main in this process; returns the metrics.jsonl records (events left out)."""
    train.main([f"--out_dir={out_dir}", f"--data_dir={data_dir}", *TINY, *args])
    return metrics(out_dir)


def losses(records):
    return [r["loss"] for r in records if "loss" in r]


def torchrun(nproc, *args, timeout=300, launcher=(), check=True):
    """train.py on nproc ranks. torchrun itself where its agent is what a test checks (launcher
    options such as --max-restarts, or check=False: the job's exit status); otherwise `launch`,
    the same worker processes with the variables torchrun gives them, without the agent's two
    seconds of start and stop; and one rank that must succeed in this process (train.main)."""
    if nproc == 1 and check:   # (in this process, as its own process would run it: faster)
        code, out, err = command_out(train.main, *args)
        assert code == 0, out[-2000:] + err[-3000:]
        return subprocess.CompletedProcess(args, 0, out, err)
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train.py"), *args]
    elif launcher or not check:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *launcher, str(ROOT / "train.py"), *args]
    else:
        return launch(nproc, [str(ROOT / "train.py"), *args], timeout)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


def forked():
    """The multiprocessing context the tests start ranks in: a fork server that imported torch and
    the project once, so a rank starts in a fraction of a second, not the 3 s of a fresh
    interpreter's imports (most of the suite's time); it forks before any tensor op, so no
    OpenMP pool or gloo thread is copied into a rank."""
    import multiprocessing
    multiprocessing.set_forkserver_preload(["torch", "conftest"])
    return multiprocessing.get_context("forkserver")


def launch(nproc, argv, timeout, cwd=ROOT):
    """What `torchrun --standalone --nproc_per_node=nproc` starts: nproc processes running the
    script as __main__ with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and MASTER_ADDR/PORT (a
    free port, found as --standalone finds one), their output in one stream; every rank must exit
    0 (a failed rank stops the others, as the agent does). The ranks come from the fork server,
    in the folder cwd."""
    import socket
    import tempfile
    import time
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        procs = [forked().Process(target=_script, args=(argv, {**env, "RANK": str(r),
                                  "LOCAL_RANK": str(r)}, cwd, out, err)) for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.time() + timeout
        while any(p.exitcode is None for p in procs) and time.time() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        stdout, stderr = (Path(f).read_text() if Path(f).exists() else "" for f in (out, err))
    assert codes == [0] * nproc, f"ranks exited {codes}\n" + stdout[-2000:] + stderr[-3000:]
    return subprocess.CompletedProcess(argv, 0, stdout, stderr)


def _script(argv, env, cwd, out, err):
    """One launched rank: the environment torchrun gives it, its output appended to the job's,
    then the script run as `python script args` runs it (its __main__ block)."""
    import runpy
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), fd)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))   # (OpenMP read it at the server's import)
    os.chdir(cwd)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


def metrics(out_dir, events=False):
    """The iteration records of metrics.jsonl; with events=True the event lines too."""
    records = [json.loads(x) for x in open(Path(out_dir) / "metrics.jsonl")]
    return records if events else [r for r in records if "event" not in r]


def spawn(world, fn, *args, timeout=240):
    """Run fn(rank, world, *args) in `world` processes over gloo; re-raises a worker's failure."""
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        forked()   # (its preloads)
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), dict(os.environ),
                                                fn, *args), nprocs=world, join=False,
                                 start_method="forkserver")
        deadline = __import__("time").time() + timeout
        while not ctx.join(timeout=5):
            if __import__("time").time() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout} s")


def _worker(rank, world, store, env, fn, *args):
    """One spawned process (from the fork server, with the test's environment): a gloo group over
    a FileStore (no port), fn, then an orderly shutdown."""
    import datetime
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120),
                            store=dist.FileStore(store, world))
    fn(rank, world, *args)
    placement.exit_worker(world)  # together, then skip the teardown where gloo's threads can abort


def command(cli, *args):
    """A command's cli(argv) (interchange.py's, prepare.py's main) in this process, as its subprocess
    would run: (exit status, what it wrote to stderr)."""
    code, _, err = command_out(cli, *args)
    return code, err.strip()


def command_out(cli, *args):
    """command(), with what it wrote to stdout: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            cli([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def expect_error(capsys, argv, *fragments):
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err


TP_CASES = [("full", "megatron"), ("svd", "btp"), ("cola", "btp"), ("svd", "vanilla"), ("cola", "vanilla")]


def group_of_one(ref, recompute="none", layout=None):
    """The model train.py trains at tp=1: ref's layout with a TP group of one (btp for low-rank,
    megatron for dense), with activation checkpointing `recompute`."""
    from tp_model import TPLlama
    layout = layout or ("btp" if ref.cfg.lowrank else "megatron")
    return TPLlama(ref, parallel.TPGroup(None, 0, 1), layout, recompute=recompute)


def small_cfg(arch, n_layer=2, **extra):
    return Config(arch=arch, n_layer=n_layer, n_head=8, n_kv_head=4, n_embd=64, block_size=16,
                  vocab_size=128, attn_rank=16, mlp_rank=24, **extra)


def check_tp_step(ref, logits, loss, tp_model, tp_logits, tp_loss, handle, dp_group, share, where):
    """A TP model's step against the single-device model's, on this rank: its vocab slice of the
    logits of its share of the batch, the loss averaged over dp, every gradient gathered to full
    shape, and each replicated parameter's gradient identical on every TP rank."""
    v = logits.shape[-1] // handle.size
    torch.testing.assert_close(tp_logits, logits[share][..., handle.tp_rank * v:(handle.tp_rank + 1) * v],
                               msg=lambda m: f"{where} logits: {m}")
    mean_loss = tp_loss.detach().clone()
    dist.all_reduce(mean_loss, group=dp_group)
    dp = dist.get_world_size(dp_group)
    torch.testing.assert_close(mean_loss / dp, loss.detach(), msg=lambda m: f"{where} loss: {m}")
    grads = tp_model.full_tensors(grads=True)
    assert grads.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} grad of {name}: {m}")
    params = dict(tp_model.named_parameters())
    for name, spec in tp_model.named_specs():
        if spec.dim is None:
            g = params[name].grad
            peers = [torch.empty_like(g) for _ in range(handle.size)]
            dist.all_gather(peers, g, group=handle.group)
            assert all(torch.equal(peer, g) for peer in peers), f"{where}: {name} grads differ"
