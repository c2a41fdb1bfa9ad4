"""bench_data.py: `python tools/bench.py data`: the corpus preparation of prepare.py at scale,
measured.

Not in the BOOST paper (arXiv 2512.12131): what feeding it a pretraining corpus costs. Generates a
corpus of `--mb` MB (default 1024) from Python's standard library sources, repeated, in the forms a
pretraining corpus ships in (a folder of .txt files, one per source file; one .jsonl; the same
.jsonl gzip- and zstd-compressed; a .parquet of 4096-row groups; and `mixed`, one folder holding
the .txt folder, the .jsonl and the .jsonl.gz, three times `--mb`), then prepares each with each
tokenizer and num_proc 1 and 2, every preparation in a fresh process, `--rounds` times (default 3)
with the configurations interleaved, and reports the medians: MB/s, tokens/s and peak memory (the
main process's high-water mark and the largest worker's). A note compares ways of using two cores
for the tokenisation alone: one thread, tiktoken's own batch encoding on two threads, and
prepare.py's two processes.
"""
import gzip
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
MEASURE = """
import json, resource, sys, time
from plumbing import preparation
t0 = time.time()
out = preparation.prepare(sys.argv[1], sys.argv[2], sys.argv[3], num_proc=int(sys.argv[4]),
                          log=lambda *a: None)
seconds = time.time() - t0
meta = json.loads((out / "meta.json").read_text())
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
own = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
print(json.dumps({"seconds": seconds, "tokens": meta["train_tokens"] + meta["val_tokens"],
                  "documents": meta["documents"], "main_mb": int(hwm) / 1024,
                  "worker_mb": own[1].ru_maxrss / 1024,
                  "cpu_s": sum(u.ru_utime + u.ru_stime for u in own)}))
"""


def machine_cpu_s():
    """(busy, steal) CPU seconds of the whole machine so far, from /proc/stat (Linux)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    busy = sum(fields) - fields[3] - fields[4]   # all but idle and iowait
    return busy / tick, (fields[7] if len(fields) > 7 else 0) / tick


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


FORMS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "mixed")


def make_corpus(folder, mb):
    """Every form of a corpus of at least `mb` MB of text; returns {form: path}."""
    folder = Path(folder)
    forms = {"txt": folder / "txt", "jsonl": folder / "corpus.jsonl",
             "jsonl.gz": folder / "corpus.jsonl.gz",
             "jsonl.zst": folder / "corpus.jsonl.zst", "parquet": folder / "corpus.parquet",
             "mixed": folder / "mixed"}
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
    _packed_forms(forms)
    for f in forms["txt"].rglob("*.txt"):   # mixed: the three forms in one folder, as hard links
        link = forms["mixed"] / "txt" / f.relative_to(forms["txt"])
        link.parent.mkdir(parents=True, exist_ok=True)
        os.link(f, link)
    for form in ("jsonl", "jsonl.gz"):
        os.link(forms[form], forms["mixed"] / forms[form].name)
    return forms


def _packed_forms(forms):
    """The .jsonl.zst and .parquet forms of the .jsonl (zstandard and pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    with open(forms["jsonl"], "rb") as src, open(forms["jsonl.zst"], "wb") as dst:
        zstandard.ZstdCompressor(level=3).copy_stream(src, dst)
    with open(forms["jsonl"]) as src:
        schema = pa.schema([("text", pa.string())])
        with pq.ParquetWriter(forms["parquet"], schema) as writer:
            rows = []
            for line in src:
                rows.append(json.loads(line)["text"])
                if len(rows) == 4096:
                    writer.write_table(pa.table({"text": rows}, schema=schema))
                    rows = []
            if rows:
                writer.write_table(pa.table({"text": rows}, schema=schema))


def sizes_of(forms):
    """{form: bytes on disk}."""
    return {f: sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
            if Path(path).is_dir()
            else Path(path).stat().st_size for f, path in forms.items()}


def run_one(path, tokenizer, data_dir, num_proc):
    """One preparation in a fresh process: its measures, and the CPU seconds the rest of the machine
    used meanwhile (`other_cpu_s`: busy time not the preparation's; `steal_s`: the hypervisor's)."""
    before = machine_cpu_s()
    res = subprocess.run([sys.executable, "-c", MEASURE, str(path), tokenizer, str(data_dir),
                          str(num_proc)],
                         cwd=ROOT, capture_output=True, text=True, timeout=7200)
    if res.returncode:
        sys.exit(f"preparing {path} failed:\n{res.stderr[-2000:]}")
    after, r = machine_cpu_s(), json.loads(res.stdout.splitlines()[-1])
    return {**r, "other_cpu_s": after[0] - before[0] - r["cpu_s"], "steal_s": after[1] - before[1]}


def tokenise_alone(jsonl, tokenizer, mb=100):
    """MB/s of tokenisation alone on the first `mb` MB of documents: one thread, two threads."""
    from plumbing.tokenizer import load as load_tokenizer
    enc = load_tokenizer(tokenizer)
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


def rounds_of(forms, folder, rounds):
    """{(tokenizer, form, num_proc): [run_one's results, a round each]}, the rounds interleaved
    (a slow moment of the machine falls on one run of each)."""
    runs = {}
    for round_ in range(rounds):
        for tokenizer in ("bytes", "gpt2"):
            for form, path in forms.items():
                for num_proc in (1, 2):
                    r = run_one(path, tokenizer,
                                folder / f"d-{tokenizer}-{form}-{num_proc}-{round_}", num_proc)
                    runs.setdefault((tokenizer, form, num_proc), []).append(r)
                    print(f"  round {round_ + 1}: {tokenizer} {form} num_proc={num_proc}: "
                          f"{r['seconds']:.1f} s (the rest of the machine: "
                          f"{r['other_cpu_s']:.1f} CPU s, steal {r['steal_s']:.1f} s)", flush=True)
    return runs


def bench_data(mb, keep=None, rounds=3):
    """(title, header, rows, note, results) of the preparation of an `mb` MB corpus (kept in
    `keep`): the medians of `rounds` interleaved rounds."""
    from plumbing.tokenizer import need
    need("pyarrow", "bench.py data's .parquet form")
    need("zstandard", "bench.py data's .jsonl.zst form")
    tmp = tempfile.TemporaryDirectory() if keep is None else None
    folder = Path(keep or tmp.name)
    t0 = time.time()
    forms = make_corpus(folder / "corpus", mb)
    sizes = sizes_of(forms)
    print(f"corpus: {mb} MB of text generated in {time.time() - t0:.0f} s: " +
          ", ".join(f"{f} {s / 1e6:.0f} MB" for f, s in sizes.items()), flush=True)
    text_mb = sizes["txt"] / 1e6
    runs = rounds_of(forms, folder, rounds)
    rows, out = [], {}
    for (tokenizer, form, num_proc), rs in runs.items():
        mb_of = text_mb * (3 if form == "mixed" else 1)
        s, single = (statistics.median(x["seconds"] for x in runs[(tokenizer, form, n)])
                     for n in (num_proc, 1))
        r = rs[0]
        main_mb, worker_mb = max(x["main_mb"] for x in rs), max(x["worker_mb"] for x in rs)
        out[f"{tokenizer} {form} num_proc={num_proc}"] = {
            "seconds": [x["seconds"] for x in rs], "median_s": s, "tokens": r["tokens"],
            "documents": r["documents"], "text_mb": mb_of, "mb_per_s": mb_of / s,
            "tokens_per_s": r["tokens"] / s, "speedup": single / s, "main_mb": main_mb,
            "worker_mb": worker_mb, "other_cpu_s": [x["other_cpu_s"] for x in rs]}
        rows.append([tokenizer, form, num_proc, f"{s:.1f}", f"{mb_of / s:.1f}",
                     f"{r['tokens'] / s / 1e6:.2f}M", f"{main_mb:.0f}",
                     f"{worker_mb:.0f}" if num_proc > 1 else "-", f"{single / s:.2f}"])
    title = (f"Preparing {text_mb:.0f} MB of text (Python's standard library, repeated; mixed: "
             f"{3 * text_mb:.0f} MB) on {os.cpu_count()} CPUs, medians of {rounds} interleaved "
             "rounds")
    header = ["tokenizer", "form", "num_proc", "s", "MB/s", "tokens/s", "main peak MB",
              "worker peak MB", "vs num_proc=1"]
    alone, size = tokenise_alone(forms["jsonl"], "gpt2", min(100, mb))
    two = out["gpt2 jsonl num_proc=2"]["mb_per_s"]
    out["tokenise_alone_gpt2"] = {"mb": size / 1e6, "threads_1": alone[1], "threads_2": alone[2],
                                  "processes_2": two}
    note = (f"Two cores for gpt2, the tokenisation alone on the first {size / 1e6:.0f} MB of "
            f"documents in memory: 1 thread {alone[1]:.1f} MB/s, tiktoken's batch encoding on 2 "
            f"threads {alone[2]:.1f} MB/s; prepare.py with 2 processes, reading and writing "
            f"included: {two:.1f} MB/s")
    if tmp:
        tmp.cleanup()
    return title, header, rows, note, out
