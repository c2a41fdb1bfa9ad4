"""bench_data.py: `python tools/bench.py data`: the corpus preparation of prepare.py at scale, measured.

Not in the BOOST paper (arXiv 2512.12131): what feeding it a pretraining corpus costs. Generates a
corpus of `--mb` MB (default 1024) from Python's standard library sources, repeated, in three forms
(a folder of .txt files, one per source file; one .jsonl; the same .jsonl gzip-compressed), then
prepares each with each tokenizer and num_proc 1 and 2, every preparation in a fresh process, and
reports MB/s, tokens/s and peak memory (the main process's high-water mark and the largest
worker's). A second table compares ways of using two cores for the tokenisation alone: one
thread, tiktoken's own batch encoding on two threads, and prepare.py's two processes.
"""
import gzip
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the core files live at the repository root

ROOT = Path(__file__).resolve().parents[1]
MEASURE = """
import json, resource, sys, time, prepare
t0 = time.time()
out = prepare.prepare(sys.argv[1], sys.argv[2], sys.argv[3], num_proc=int(sys.argv[4]), log=lambda *a: None)
seconds = time.time() - t0
meta = json.loads((out / "meta.json").read_text())
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({"seconds": seconds, "tokens": meta["train_tokens"] + meta["val_tokens"],
                  "documents": meta["documents"], "main_mb": int(hwm) / 1024,
                  "worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def sources():
    """(name, text) of the standard library's .py files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts:
            continue
        try:
            yield p.relative_to(root), p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def make_corpus(folder, mb):
    """The three forms of a corpus of at least `mb` MB; returns {form: path}."""
    folder = Path(folder)
    forms = {"txt": folder / "txt", "jsonl": folder / "corpus.jsonl", "jsonl.gz": folder / "corpus.jsonl.gz"}
    if all(p.exists() for p in forms.values()):
        return forms
    written, rep = 0, 0
    folder.mkdir(parents=True, exist_ok=True)
    with open(forms["jsonl"], "w") as jl, gzip.open(forms["jsonl.gz"], "wt", compresslevel=1) as gz:
        while written < mb * 1e6:
            for name, text in sources():
                path = forms["txt"] / f"rep{rep:03d}" / name.with_suffix(".txt")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                line = json.dumps({"text": text}) + "\n"
                jl.write(line)
                gz.write(line)
                written += len(text.encode())
                if written >= mb * 1e6:
                    break
            rep += 1
    return forms


def run_one(path, tokenizer, data_dir, num_proc):
    res = subprocess.run([sys.executable, "-c", MEASURE, str(path), tokenizer, str(data_dir), str(num_proc)],
                         cwd=ROOT, capture_output=True, text=True, timeout=7200)
    if res.returncode:
        sys.exit(f"preparing {path} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.splitlines()[-1])


def tokenise_alone(jsonl, tokenizer, mb=100):
    """MB/s of tokenisation alone on the first `mb` MB of documents: one thread, two threads."""
    import data
    enc = data.get_tokenizer(tokenizer)
    docs, size = [], 0
    with open(jsonl) as f:
        for line in f:
            docs.append(json.loads(line)["text"])
            size += len(docs[-1].encode())
            if size >= mb * 1e6:
                break
    out = {}
    for threads in (1, 2):
        t0 = time.time()
        enc.encode_ordinary_batch(docs, num_threads=threads)
        out[threads] = size / 1e6 / (time.time() - t0)
    return out, size


def bench_data(mb, keep=None):
    """(title, header, rows, note, results) of the preparation of an `mb` MB corpus (kept in `keep`)."""
    rows, out = [], {}
    tmp = tempfile.TemporaryDirectory() if keep is None else None
    folder = Path(keep or tmp.name)
    t0 = time.time()
    forms = make_corpus(folder / "corpus", mb)
    sizes = {f: sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir()
             else Path(path).stat().st_size for f, path in forms.items()}
    print(f"corpus: {mb} MB of text generated in {time.time() - t0:.0f} s: " +
          ", ".join(f"{f} {s / 1e6:.0f} MB" for f, s in sizes.items()), flush=True)
    text_mb = sizes["txt"] / 1e6
    for tokenizer in ("bytes", "gpt2"):
        for form, path in forms.items():
            single = None
            for num_proc in (1, 2):
                r = run_one(path, tokenizer, folder / f"d-{tokenizer}-{form}-{num_proc}", num_proc)
                single = single or r["seconds"]
                key = f"{tokenizer} {form} num_proc={num_proc}"
                out[key] = {**r, "text_mb": text_mb, "mb_per_s": text_mb / r["seconds"],
                            "tokens_per_s": r["tokens"] / r["seconds"], "speedup": single / r["seconds"]}
                rows.append([tokenizer, form, num_proc, f"{r['seconds']:.0f}", f"{text_mb / r['seconds']:.1f}",
                             f"{r['tokens'] / r['seconds'] / 1e6:.2f}M", f"{r['main_mb']:.0f}",
                             f"{r['worker_mb']:.0f}", f"{single / r['seconds']:.2f}"])
                print(f"  {key}: {r['seconds']:.0f} s", flush=True)
    title = f"Preparing {text_mb:.0f} MB of text (Python's standard library, repeated) on {os.cpu_count()} CPUs"
    header = ["tokenizer", "form", "num_proc", "s", "MB/s", "tokens/s", "main peak MB", "worker peak MB",
              "vs num_proc=1"]
    alone, size = tokenise_alone(forms["jsonl"], "gpt2")
    two = out["gpt2 jsonl num_proc=2"]["mb_per_s"]
    out["tokenise_alone_gpt2"] = {"mb": size / 1e6, "threads_1": alone[1], "threads_2": alone[2], "processes_2": two}
    note = ("Two cores for gpt2, the tokenisation alone on the first 100 MB of documents in memory: "
            f"1 thread {alone[1]:.1f} MB/s, tiktoken's batch encoding on 2 threads {alone[2]:.1f} MB/s; "
            f"prepare.py with 2 processes, reading and writing included: {two:.1f} MB/s")
    if tmp:
        tmp.cleanup()
    return title, header, rows, note, out
