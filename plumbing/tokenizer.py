"""tokenizer.py: the tokenizers a run can use, behind one small interface.

Not part of the BOOST paper (arXiv 2512.12131) itself: what its models read. CoLA trains with T5's
32000-token SentencePiece model, BOOST's benchmarks with LLaMA's; here `--tokenizer=` is one of

- `bytes`: the 256 byte values and <|endoftext|> (offline, the default), through tiktoken;
- `gpt2`: tiktoken's GPT-2 BPE (its cache, TIKTOKEN_CACHE_DIR, or a download);
- a path: a Hugging Face `tokenizer.json` (the `tokenizers` package), a SentencePiece `.model`
  (`sentencepiece`), or a model folder holding either (tokenizer.json first, then tokenizer.model).

Every one has encode_ordinary(text) -> ids (special tokens in the text are text), encode_continued
(the same for a piece that continues a document: SentencePiece and Metaspace-style tokenizers add a
"▁" before every text they encode, which a document cut into pieces must get once, not at every
piece; `continued` gives it for any tokenizer), decode(ids),
eot_token (the end-of-document id: SentencePiece's eos, a tokenizer.json's eos_token from the
tokenizer_config.json beside it, else its first special token named like one) and n_vocab. A file's
identity, `hf-<sha256 of the file, 12 hex>` or `spm-<...>`, names the prepared token files and is
recorded in checkpoints, so a run never mixes two tokenizers; `bytes` and `gpt2` are their own.
"""
import hashlib
import json
import shutil
from pathlib import Path

NAMES = ("bytes", "gpt2")
EOT = "<|endoftext|>"
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
# GPT-2's pre-tokenisation pattern; it only splits text into pieces, the ranks do the rest.
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def need(package, what):
    """Import `package`, or a one-line ValueError naming it."""
    import importlib
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ValueError(f"{what} needs the {package} package: pip install {package}") from None


def locate(name):
    """(kind, file) of a tokenizer path: ("hf", tokenizer.json) or ("spm", a .model); ValueError
    else."""
    p = Path(name)
    shown = name if len(name) <= 200 else f"{name[:80]}... ({len(name):,} characters)"
    try:
        p.stat()
    except FileNotFoundError:
        pass
    except OSError as e:   # (a name too long for a path, a path through a file, no permission)
        raise ValueError(f"tokenizer={shown} cannot be read: {e.strerror}") from None
    if p.is_dir():
        found = [p / "tokenizer.json", p / "tokenizer.model", *sorted(p.glob("*.model"))]
        p = next((f for f in found if f.is_file()), None)
        if p is None:
            raise ValueError(f"tokenizer={name} is a folder without a tokenizer.json or a "
                             f"SentencePiece .model")
    elif not p.is_file():
        raise ValueError(f"tokenizer={shown} is not one of {', '.join(NAMES)}, nor a tokenizer "
                         f"file or folder")
    return ("spm" if p.suffix == ".model" else "hf"), p


# One hash and one load of a tokenizer a process (a run asks for both from several places: the
# vocabulary's size, the prepared files' name, checkpoint checks, the sample): kept by the file's
# state, so a file that changes is read again.
_IDENTITY, _LOADED = {}, {}


def _state(name):
    """What identifies the tokenizer `name` now: its name, or its file's path, size, mtime,
    inode."""
    if name in NAMES:
        return name
    path = locate(name)[1].resolve()
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns, st.st_ino


def identity(name):
    """`bytes`, `gpt2`, or the kind and a hash of the file: what token files and checkpoints
    record."""
    if name in NAMES:
        return name
    key = _state(name)
    if key not in _IDENTITY:
        kind, path = locate(name)
        _IDENTITY[key] = f"{kind}-{_digest(path)}"
    return _IDENTITY[key]


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def load(name):
    """The tokenizer `name` names (see the module's docstring), loaded once a process (while its
    file is unchanged); ValueError in one line where it cannot."""
    key = _state(name)
    if key not in _LOADED:
        _LOADED[key] = _load(name)
    return _LOADED[key]


def _load(name):
    if name == "bytes":
        import tiktoken
        ranks = {bytes([i]): i for i in range(256)}
        return tiktoken.Encoding(name="bytes", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                                 special_tokens={EOT: 256})
    if name == "gpt2":
        import tiktoken
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # network or cache failure inside tiktoken
            raise ValueError(f"cannot load the GPT-2 vocabulary ({type(e).__name__}); set "
                             "TIKTOKEN_CACHE_DIR to a tiktoken cache or use "
                             "--tokenizer=bytes") from None
    kind, path = locate(name)
    try:
        return (SentencePiece if kind == "spm" else HuggingFace)(path)
    except ValueError:
        raise
    except Exception as e:   # the library's own complaint about a damaged or foreign file
        raise ValueError(f"cannot read the tokenizer {path} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]})") from None


def continued(enc):
    """The encoder of a piece that continues a document (preparation.py cuts long ones)."""
    return getattr(enc, "encode_continued", enc.encode_ordinary)


def _no_prefix(spec):
    """A tokenizer.json's dict without the "▁" it prepends to a text: Prepend normalizers dropped,
    Metaspace pre-tokenizers and decoders set to prepend never (LLaMA's and T5's tokenizer.json)."""
    if isinstance(spec, list):
        return [_no_prefix(x) for x in spec
                if not (isinstance(x, dict) and x.get("type") == "Prepend")]
    if not isinstance(spec, dict):
        return spec
    out = {k: _no_prefix(v) for k, v in spec.items()}
    if out.get("type") == "Prepend":
        return None
    if out.get("type") == "Metaspace":
        out.update(prepend_scheme="never", add_prefix_space=False)
    return out


class HuggingFace:
    """A tokenizer.json through the `tokenizers` package."""

    def __init__(self, path):
        lib = need("tokenizers", f"the tokenizer {path}")
        text = Path(path).read_text(encoding="utf-8")
        self.tok = lib.Tokenizer.from_str(text)
        spec = json.loads(text)
        stripped = _no_prefix(spec)   # a second tokenizer only where the file prepends a "▁"
        self.cont = self.tok if stripped == spec else lib.Tokenizer.from_str(json.dumps(stripped))
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)
        configured = _configured_eos(path.parent / "tokenizer_config.json")
        special = [t.content for t in self.tok.get_added_tokens_decoder().values() if t.special]
        eos = configured or next((n for n in EOS_NAMES if n in special), None)
        if configured and self.tok.token_to_id(configured) is None:
            config = path.parent / "tokenizer_config.json"
            raise ValueError(f"the eos_token {configured!r} of {config} is not in the vocabulary "
                             f"of {path}")
        if eos is None:
            raise ValueError(f"cannot tell the end-of-document token of {path}: put a "
                             "tokenizer_config.json with its eos_token beside it")
        self.eos, self.eot_token = eos, self.tok.token_to_id(eos)

    def encode_ordinary(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_continued(self, text):
        return self.cont.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


def _configured_eos(path):
    """The eos_token a tokenizer_config.json names, or None; ValueError naming the file if it is not
    a JSON object whose eos_token is a string or {"content": string}."""
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable or not JSON ({type(e).__name__})") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(config, dict) or not isinstance(eos, (str, type(None))):
        raise ValueError(f"{path} is not a JSON object with an eos_token string")
    return eos


class SentencePiece:
    """A SentencePiece .model through the `sentencepiece` package (no BOS or EOS added while
    encoding)."""

    def __init__(self, path):
        lib = need("sentencepiece", f"the tokenizer {path}")
        self.sp = lib.SentencePieceProcessor(model_file=str(path))
        proto = _without_dummy_prefix(self.sp.serialized_model_proto())
        self.cont = lib.SentencePieceProcessor(model_proto=proto)
        self.n_vocab, self.eot_token = self.sp.get_piece_size(), self.sp.eos_id()
        if self.eot_token < 0:
            raise ValueError(f"the SentencePiece model {path} has no eos piece to end documents "
                             f"with")
        self.eos = self.sp.id_to_piece(self.eot_token)

    def encode_ordinary(self, text):
        return self.sp.encode(text)

    def encode_continued(self, text):
        return self.cont.encode(text)

    def decode(self, ids):
        return self.sp.decode(ids)


def _varint(buf, i):
    """(value, next index) of the protobuf varint at buf[i]."""
    value = shift = 0
    while True:
        value, i, shift = value | (buf[i] & 0x7F) << shift, i + 1, shift + 7
        if not buf[i - 1] & 0x80:
            return value, i


def _put_varint(n):
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _fields(buf):
    """The (field number, wire type, raw bytes of the whole field) of a protobuf message, in
    order."""
    i, out = 0, []
    while i < len(buf):
        start = i
        tag, i = _varint(buf, i)
        kind = tag & 7
        if kind == 0:
            _, i = _varint(buf, i)
        elif kind == 2:
            n, i = _varint(buf, i)
            i += n
        else:
            i += 8 if kind == 1 else 4
        out.append((tag >> 3, kind, buf[start:i]))
    return out


def _without_dummy_prefix(proto):
    """A SentencePiece model (serialized ModelProto) with normalizer_spec.add_dummy_prefix = false:
    field 3 of the model, field 3 of the spec (edited on the wire, so no protobuf package is
    needed)."""
    out = bytearray()
    for number, kind, raw in _fields(proto):
        if number == 3 and kind == 2:
            _, i = _varint(raw, 0)
            n, i = _varint(raw, i)
            spec = b"".join(r for f, k, r in _fields(raw[i:i + n]) if f != 3) + b"\x18\x00"
            raw = raw[:1] + _put_varint(len(spec)) + spec
        out += raw
    return bytes(out)


def write_for_hf(name, folder):
    """Put the tokenizer into a Hugging Face model folder, so AutoTokenizer.from_pretrained(folder)
    (and lm_eval's hf model) needs no tokenizer argument: tokenizer.json or tokenizer.model, and a
    tokenizer_config.json naming the class and the eos token; bytes and gpt2 as the tokenizer.json
    that gives their ids (plumbing/hf_tokenizer.py)."""
    if name in NAMES:
        need("tokenizers", "writing a tokenizer.json")
        from plumbing import hf_tokenizer
        return hf_tokenizer.write(name, load(name), folder)
    kind, path = locate(name)
    enc = load(name)
    if kind == "hf":
        shutil.copyfile(path, Path(folder) / "tokenizer.json")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": enc.eos}
    else:
        shutil.copyfile(path, Path(folder) / "tokenizer.model")
        sp = enc.sp
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False,
                  "add_eos_token": False, "legacy": True,
                  "eos_token": enc.eos, "unk_token": sp.id_to_piece(sp.unk_id())
                  if sp.unk_id() >= 0 else None,
                  "bos_token": sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None}
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def in_folder(folder):
    """The tokenizer a model folder holds: the name bytes or gpt2 where write_for_hf wrote theirs,
    else its tokenizer file (a Hugging Face model's too), or None."""
    config = Path(folder) / "tokenizer_config.json"
    try:
        named = json.loads(config.read_text()).get("boost_tokenizer") if config.is_file() else None
    except (ValueError, OSError, AttributeError):   # (not ours: its tokenizer file speaks)
        named = None
    if named in NAMES:
        return named
    try:
        return str(locate(folder)[1])
    except ValueError:
        return None


def keep(name, out_dir):
    """A copy of a tokenizer file in out_dir/tokenizer/ (an imported run keeps using it when the
    folder it came from is gone); its new path. bytes and gpt2 are names, kept as they are."""
    if name in NAMES:
        return name
    kind, path = locate(name)
    dest = Path(out_dir) / "tokenizer"
    dest.mkdir(parents=True, exist_ok=True)
    config = path.parent / "tokenizer_config.json"   # (where a tokenizer.json's eos_token is named)
    if kind == "hf" and config.is_file():
        shutil.copyfile(config, dest / config.name)
    shutil.copyfile(path, dest / path.name)
    # (absolute: a resume from another folder still finds it)
    return str((dest / path.name).resolve())


def sample_text(model, enc, n_tokens, device="cpu", prompt="", temperature=0.8, top_k=50):
    """The prompt and n_tokens generated after it by model.generate (after <|endoftext|>, which
    starts a document), decoded; top_k=None samples from the whole vocabulary. The ids of the
    vocabulary's padding are never decoded."""
    import torch
    start = [enc.eot_token] + (enc.encode_ordinary(prompt) if prompt else [])
    out = model.generate(torch.tensor([start], device=device), n_tokens, temperature, top_k)
    return enc.decode([t for t in out[0, 1:].tolist() if t < enc.n_vocab])


def sample_at_end(run):
    """train.py's sample at the end of a run (every TP rank runs the forward; rank 0 prints), said
    before it starts: without a KV cache each token reruns the model on the whole context."""
    import torch
    import local_ops
    tc = run.tc
    if tc.sample_tokens > 0 and run.pipe:
        run.log("no sample under pp > 1: export the checkpoint, then python interchange.py sample")
    if tc.sample_tokens <= 0 or run.pipe:   # (nothing to sample, or no one model to sample from)
        return
    run.log(f"sampling {tc.sample_tokens} tokens (--sample_tokens=0: none)")
    torch.manual_seed(tc.seed)
    with run.autocast, local_ops.reference():   # M = 1..200 rows: too few for the kernels
        run.log("sample:\n" + sample_text(run.raw_model, load(tc.tokenizer), tc.sample_tokens,
                                          run.place.device))
