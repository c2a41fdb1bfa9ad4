"""options.py: train.py's options: their defaults, the --key=value parser, every check before work.

Not in the BOOST paper (arXiv 2512.12131). The model's options are model.Config's fields, the rest
TrainConfig's; names follow nanoGPT. A wrong name (with the closest ones suggested), a value of the
wrong type or out of range, a shape that cannot be built or a layout that cannot split it is a
ValueError with one clear line, which train.py prints as `error: ...` and exits 2, before any work.
"""
import difflib
import inspect
import math
import os
import re
import tomllib
from dataclasses import asdict, dataclass, fields

import torch

from recompute import RECOMPUTE
from extensions import dp_shard
import local_ops
import layouts
from lax import LAX_GATES
from model import ARCHS, GATES, Config
from plumbing import data, preparation, train_state
from plumbing.tokenizer import NAMES as TOKENIZER_NAMES, load as load_tokenizer


@dataclass
class TrainConfig:
    # --- I/O
    out_dir: str = "out"
    eval_interval: int = 250       # evaluate and save a checkpoint every this many iterations
    log_interval: int = 10
    eval_iters: int = 20           # batches per split in each evaluation
    # scratch | resume (the newest good checkpoint) | auto (resume if one exists)
    init_from: str = "scratch"
    # with scratch: discard the out_dir's earlier run (its checkpoints and metrics)
    overwrite: bool = False
    keep_checkpoints: int = 2      # complete checkpoints kept in <out_dir>/checkpoints
    # for tests: kill:N, nan:N (not with pp) or kill_in_save:N (first attempt only)
    inject_fault: str = ""
    # run one recorded step, print what every rank computes and sends, exit (explain.py)
    explain: bool = False
    # W:A: after W steps of the run, trace A steps to <out_dir>/trace/rank<N>.json
    profile: str = ""
    # also write the metrics to <out_dir>/tensorboard (torch.utils.tensorboard)
    tensorboard: bool = False
    # --- data
    # 'pydoc' (Python's help text, embedded), or text / JSON Lines / .gz files or a folder
    dataset: str = data.EMBEDDED
    # bytes (offline) | gpt2 (tiktoken's) | a tokenizer.json, .model or folder
    tokenizer: str = "bytes"
    data_dir: str = "data"         # where prepared token files are kept
    num_proc: int = 0              # processes preparing a corpus; 0: every CPU (prepare.py)
    # share of the documents held out (of the ~16 KiB pieces, for one text file)
    val_fraction: float = 0.1
    text_field: str = "text"       # the field of a JSON line that holds its text
    batch_size: int = 16           # sequences per micro-step per data-parallel rank
    gradient_accumulation_steps: int = 1  # micro-steps per iteration, in total over the dp ranks
    # --- AdamW and the cosine schedule
    learning_rate: float = 3e-3
    max_iters: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0         # 0: no clipping
    warmup_iters: int = 100
    lr_decay_iters: int = 0        # 0: max_iters
    min_lr: float = 3e-4
    # adamw | muon: Muon for the decoder's matrices (every A, B, dense projection), AdamW the rest
    optimizer: str = "adamw"
    muon_lr: float = 0.02          # Muon's peak learning rate (the schedule scales it alike)
    muon_momentum: float = 0.95    # Muon's Nesterov momentum
    # Muon over TP: auto (the cheapest of gram, gather, owner by muon.step_cost) | gram (r×r
    # all-reduces) | gather (the matrices) | owner (each matrix whole on one rank: two all-to-alls)
    muon_mode: str = "auto"
    muon_alpha_us: float = 0.0     # a collective's latency for auto; 0: gloo 50, NCCL 10
    muon_gbps: float = 0.0         # its bandwidth, GB/s, for auto; 0: gloo 1, NCCL 100
    muon_tflops: float = 0.0       # Newton-Schulz's rate for auto; 0: gloo (CPU) 0.05, NCCL 100
    # --- parallelism (under torchrun: world size = dp × pp × tp, TP peers are adjacent ranks)
    tp: int = 1                    # tensor-parallel degree
    dp: int = 0                    # data-parallel degree; 0: world size / (tp · pp)
    layout: str = "auto"           # auto (btp, or megatron for full) | btp | vanilla | megatron
    pp: int = 1                    # pipeline stages (n_layer / pp layers each)
    # 1f1b | gpipe | interleaved_1f1b | zero_bubble | zbv | dualpipev (docs/pipelines.md)
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1  # stages a rank: interleaved_1f1b, zero_bubble any; zbv, dualpipev 2
    recompute: str = "none"  # activation checkpointing: none | layer | lowrank (recompute.py)
    kernels: str = "auto"  # auto (Triton on CUDA, PyTorch elsewhere) | triton | torch (local_ops)
    # TP: backward's all-reduces overlap the weight-gradient GEMMs (parallel.CopyUp)
    overlap: bool = True
    # none (DDP) | grad (FSDP2, ZeRO-2 style) | full (ZeRO-3 style): extensions/dp_shard.py
    dp_shard: str = "none"
    # --- system
    device: str = "auto"           # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on a GPU that has it, else float32) | float32 | bfloat16
    compile: bool = False
    cuda_graph: bool = False  # the step captured as one CUDA graph (extensions/cuda_graph.py)
    seed: int = 1337
    peak_tflops: float = 0.0       # your device's peak, for MFU; 0: report TFLOP/s only
    sample_tokens: int = 100       # generated at the end (no KV cache: each reruns the context)
    timeout_s: int = 600           # process-group timeout
    threads: int = 0   # a CPU process's threads; 0: OMP_NUM_THREADS, else the idle cores, shared


CHOICES = {"arch": ARCHS, "mlp_gate": ("auto",) + GATES, "lax_gate": LAX_GATES,
           "init_from": ("scratch", "resume", "auto"), "dtype": ("auto", "float32", "bfloat16"),
           "layout": lambda: ("auto", *layouts.LAYOUTS),   # (read when asked: a fork's too)
           "recompute": RECOMPUTE,
           "pp_schedule": ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"),
           "kernels": local_ops.BACKENDS,
           "dp_shard": dp_shard.MODES, "optimizer": ("adamw", "muon"),
           "muon_mode": ("auto", "gram", "gather", "owner")}
FAULTS = ("kill", "nan", "kill_in_save")


def _convert(where, typ, text):
    """The value of an option (`where`: --key or file: key) from its text, by its default's type."""
    if typ is bool:
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"{where} expects true or false, got {text!r}")
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"{where} expects {'an integer' if typ is int else 'a number'}, got "
                         f"{text!r}") from None


def options():
    """Every command-line option: name -> (dataclass, field). vocab_size comes from the
    tokeniser."""
    return {f.name: (cls, f) for cls in (Config, TrainConfig) for f in fields(cls)
            if f.name != "vocab_size"}


def chosen(cfg, tc):
    """'key=value ...' of every option not at its default, for a run's start line: two logs side
    by side tell their runs apart. A model field left at 0 or auto (the model derives it: r = d/4,
    the gate, d_ff) is left out."""
    def derivable(f):
        return f.default == "auto" or (type(f.default) is int and f.default == 0)
    derived = Config(**{f.name: getattr(cfg, f.name) for f in fields(Config) if not derivable(f)})
    out = []
    for key, (cls, f) in options().items():
        value = getattr(cfg if cls is Config else tc, key)
        if value != f.default and not (cls is Config and derivable(f)
                                       and value == getattr(derived, key)):
            out.append(f"{key}={value}")
    return " ".join(out) or "all defaults"


def notes(cls):
    """{field: its comment in the dataclass}: the one after it on its line, or the lines just above
    it (a `# ---` line heads a section)."""
    out, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        field = re.match(r"^\s+(\w+): \w+ = [^#]*(#\s*(.*))?$", line)
        if field:
            out[field.group(1)] = field.group(3) or " ".join(above)
            above = []
        elif line.strip().startswith("# ") and not line.strip().startswith("# ---"):
            above.append(line.strip()[2:])
        else:
            above = []
    return out


def usage():
    """Every option with its default and the comment it has in its dataclass."""
    lines = ["usage: [torchrun ...] train.py [config.toml] [--key=value ...]", "",
             "A config file (configs/*.toml: the papers' models) sets options as `key = value`",
             "lines, with the names below; options on the command line override it.", ""]
    for cls, title in ((Config, "model"), (TrainConfig, "training")):
        note = notes(cls)
        lines.append(f"{title} options (default):")
        lines += [(f"  --{f.name}={f.default}".ljust(34) + note.get(f.name, "")).rstrip()
                  for f in fields(cls) if f.name != "vocab_size"]
    return "\n".join(lines)


RENAMED = {"tp_mode": "layout"}   # an option's old name -> its new one (refused, naming it)


def _unknown(key, known, where):
    if key in RENAMED:
        return ValueError(f"{where}{'--' if not where else ''}{key} is now --{RENAMED[key]}: pass "
                          f"--{RENAMED[key]}=... instead")
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join('--' + c for c in close)}?" if close else \
        " (-h lists them)"
    return ValueError(f"{where}unknown option {'--' if not where else ''}{key}{hint}")


def read_config_file(path, known):
    """{option: text} from a TOML file of `option = value` lines (configs/), checked like the
    command line."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"config file {path} cannot be read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            raise ValueError(f"{path}: [{key}] is a section; write `option = value` lines, without "
                             f"sections")
        if key not in known:
            raise _unknown(key, known, f"{path}: ")
        if isinstance(value, list):
            raise ValueError(f"{path}: {key} must be a single value, not a list")
        out[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


# options of one launch, never taken from the record of the run a launch resumes
PER_LAUNCH = {"out_dir", "init_from", "overwrite", "device", "dtype", "dp", "tp", "pp", "layout",
              "pp_schedule", "pp_virtual_stages", "dp_shard", "overlap", "compile", "cuda_graph",
              "kernels", "profile", "explain", "inject_fault",
              "num_proc", "data_dir",
              "timeout_s", "keep_checkpoints", "peak_tflops", "sample_tokens", "threads"}
# a resume says when these change
NOTED = ("dataset", "seed", "tokenizer", "text_field", "val_fraction")


def parse_args(argv):
    """[config.toml] --key=value arguments -> (model Config, TrainConfig): the file's values first,
    then the command line's; raises ValueError with one clear line."""
    return _parse(argv, {})[:2]


def resume_args(argv, recorded):
    """parse_args for a launch that continues a run: the model, data and schedule options the run
    recorded (`recorded`: its checkpoint's config and train_config) where argv does not give them.
    Returns (Config, TrainConfig, the NOTED options argv changes, as 'key=old -> new')."""
    return _parse(argv, {k: v for k, v in recorded.items() if k not in PER_LAUNCH})


def resume_plan(argv, tc, log):
    """None for a run from scratch; else the train_state.Resume of the newest intact checkpoint in
    out_dir, with the launch's options (.cfg, .tc): the ones that checkpoint recorded, where argv
    does not give them again (a changed dataset or seed is said in one line)."""
    found = train_state.candidates(tc.out_dir, tc.init_from)
    if not found:
        return None
    resume = train_state.intact(found, log)
    resume.cfg, resume.tc, changed = resume_args(argv, train_state.recorded(resume.meta))
    theirs = resume.meta.get("train_config", {}).get("optimizer", "adamw")
    if theirs != resume.tc.optimizer:   # (its moments are another optimizer's: nothing loads)
        raise ValueError(f"{resume.found[0]} was trained with --optimizer={theirs}, this launch "
                         f"asks for --optimizer={resume.tc.optimizer}, whose moments it does not "
                         f"hold: resume with --optimizer={theirs}")
    if changed:
        log(f"resume: {'; '.join(changed)} (as given; the run had the first)")
    return resume


def other_options(argv, resume, meta):
    """What the options a launch takes from an older checkpoint's record `meta`, resumed in place
    of resume.found[0], would change (None: nothing; the older one must give the same options)."""
    cfg, tc = resume_args(argv, train_state.recorded(meta))[:2]
    theirs, ours = {**cfg.shape(), **asdict(tc)}, {**resume.cfg.shape(), **asdict(resume.tc)}
    differ = sorted(k for k in ours if theirs.get(k) != ours[k])
    return f"it recorded other options than {resume.found[0]} ({', '.join(differ)})" \
        if differ else None


def _parse(argv, recorded):
    known, texts, given = options(), {}, {Config: {}, TrainConfig: {}}
    if argv and not argv[0].startswith("-"):
        if not argv[0].endswith(".toml"):
            raise ValueError(f"expected a config file (.toml) or --key=value, got {argv[0]!r} (-h "
                             f"lists the options)")
        texts = {k: (v, f"{argv[0]}: {k}") for k, v in read_config_file(argv[0], known).items()}
        argv = argv[1:]
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"expected --key=value, got {arg!r} (-h lists the options)")
        key, text = arg[2:].split("=", 1)
        if key not in known:
            raise _unknown(key, known, "")
        texts[key] = (text, f"--{key}")
    def same(key, text):   # (a path as given, against the resolved one recorded)
        return str(recorded[key]) in (text, os.path.abspath(text))
    changed = [f"{k}={recorded[k]} -> {texts[k][0]}" for k in NOTED if k in texts and k in recorded
               and not same(k, texts[k][0])]
    for key, value in recorded.items():
        if key in known and key not in texts:
            texts[key] = (str(value), f"{key} (recorded by the run)")
    for key, (text, where) in texts.items():
        cls, f = known[key]
        value = _convert(where, type(f.default), text)
        allowed = CHOICES[key]() if callable(CHOICES.get(key)) else CHOICES.get(key)
        if allowed and value not in allowed:
            raise ValueError(f"{where}={value} is not one of {', '.join(allowed)}")
        given[cls][key] = value
    tc = TrainConfig(**given[TrainConfig])
    check_values(tc)
    # recorded resolved: a resume from another working directory reads the same files
    if tc.dataset != data.EMBEDDED:
        tc.dataset = os.path.abspath(tc.dataset)
    if tc.tokenizer not in TOKENIZER_NAMES and os.path.exists(tc.tokenizer):
        tc.tokenizer = os.path.abspath(tc.tokenizer)
    return Config(**given[Config]), tc, changed


def check_values(tc):
    """Every training value in its range, else a ValueError naming the option (before work)."""
    for name in ("batch_size", "gradient_accumulation_steps", "eval_interval", "log_interval",
                 "eval_iters", "tp", "pp", "pp_virtual_stages", "keep_checkpoints", "timeout_s"):
        if getattr(tc, name) < 1:
            raise ValueError(f"{name}={getattr(tc, name)} must be at least 1")
    for name in ("max_iters", "dp", "warmup_iters", "lr_decay_iters", "seed", "sample_tokens",
                 "threads"):
        if getattr(tc, name) < 0:
            raise ValueError(f"{name}={getattr(tc, name)} must not be negative")
    for name in ("learning_rate", "min_lr", "weight_decay", "grad_clip", "peak_tflops", "beta1",
                 "beta2", "muon_lr", "muon_momentum", "muon_alpha_us", "muon_gbps",
                 "muon_tflops"):
        if not math.isfinite(getattr(tc, name)):
            raise ValueError(f"{name}={getattr(tc, name)} must be a finite number")
    if tc.seed >= 2 ** 63:   # (torch.manual_seed takes a signed 64-bit integer)
        raise ValueError(f"seed={tc.seed} must be below 2**63")
    if tc.learning_rate <= 0:
        raise ValueError(f"learning_rate={tc.learning_rate} must be positive")
    for name in ("min_lr", "weight_decay", "grad_clip", "peak_tflops", "muon_alpha_us",
                 "muon_gbps", "muon_tflops"):
        if getattr(tc, name) < 0:
            raise ValueError(f"{name}={getattr(tc, name)} must not be negative")
    if tc.min_lr > tc.learning_rate:
        raise ValueError(f"min_lr={tc.min_lr} is above learning_rate={tc.learning_rate}: the "
                         "schedule decays from learning_rate to min_lr, so lower --min_lr")
    if tc.muon_lr <= 0:
        raise ValueError(f"muon_lr={tc.muon_lr} must be positive")
    for name in ("beta1", "beta2", "muon_momentum"):
        if not 0 <= getattr(tc, name) < 1:
            raise ValueError(f"{name}={getattr(tc, name)} must be at least 0 and below 1")
    if 0 < tc.lr_decay_iters < tc.warmup_iters:
        raise ValueError(f"lr_decay_iters={tc.lr_decay_iters} ends before "
                         f"warmup_iters={tc.warmup_iters}")
    if tc.inject_fault and not re.fullmatch(f"({'|'.join(FAULTS)}):\\d+", tc.inject_fault):
        raise ValueError(f"inject_fault={tc.inject_fault} is not kill:N, nan:N or kill_in_save:N")
    if tc.profile:
        wait, _, active = tc.profile.partition(":")
        if not (wait.isdigit() and active.isdigit() and int(active) > 0):
            raise ValueError(f"profile={tc.profile} is not W:A (wait W steps, then record A > 0 "
                             f"steps), e.g. 2:3")
        if int(wait) + int(active) > tc.max_iters:
            last = int(wait) + int(active)
            raise ValueError(f"profile={tc.profile} records steps {int(wait) + 1}..{last}, "
                             f"past max_iters={tc.max_iters}")
        if tc.explain:
            raise ValueError("explain=true runs one step and exits: there is nothing for profile "
                             "to trace")
    check_names_and_modes(tc)
    if tc.overwrite and tc.init_from != "scratch":
        raise ValueError(f"overwrite=true discards the earlier run, init_from={tc.init_from} "
                         f"continues it: choose one")
    preparation.check_preparation(tc.dataset, tc.data_dir, tc.num_proc, tc.val_fraction)
    if os.path.exists(tc.out_dir) and not os.path.isdir(tc.out_dir):
        raise ValueError(f"out_dir={tc.out_dir} is a file, not a folder")
    check_device(tc.device)


def check_names_and_modes(tc):
    """No empty name where a path or corpus is meant, and no Muon mode that would be ignored."""
    for name in ("out_dir", "data_dir", "dataset", "tokenizer"):
        if not getattr(tc, name).strip():
            raise ValueError(f"{name} is empty: name one (the default is "
                             f"{getattr(TrainConfig, name)})")
    if tc.muon_mode != "auto" and (tc.optimizer != "muon" or tc.tp == 1):
        why = ("it needs --optimizer=muon" if tc.optimizer != "muon" else
               "at tp=1 every matrix is whole on its rank, leave it at auto")
        raise ValueError(f"muon_mode={tc.muon_mode} chooses how Muon's updates cross tensor "
                         f"parallelism: {why}")


def check_device(device):
    """auto, cpu, cuda or cuda:N, where that device exists."""
    if device in ("auto", "cpu"):
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"device={device} is not auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device} but this machine has no CUDA device (use --device=cpu "
                         f"or auto)")
    if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
        raise ValueError(f"device={device} but this machine has {torch.cuda.device_count()} CUDA "
                         f"devices")


def vocab_size(tokenizer):
    """The tokenizer's vocabulary, padded to a multiple of 64 (fast, divisible by tp)."""
    return 64 * math.ceil(load_tokenizer(tokenizer).n_vocab / 64)
