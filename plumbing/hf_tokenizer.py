"""hf_tokenizer.py: the project's named tokenizers (bytes, gpt2) as Hugging Face tokenizer.json
files, so an exported model folder evaluates with lm-evaluation-harness as it stands.

Not in the BOOST paper (arXiv 2512.12131): what makes its models readable by the field's tools.
Both are byte-level BPE in the `tokenizers` package's terms: every byte is a vocabulary entry,
written as GPT-2's printable stand-in character for it (`byte_chars`), and text is split with
GPT-2's pattern before the merges.

- bytes: the 256 bytes as ids 0..255 and <|endoftext|> as 256, no merges: the ids of a text are its
  UTF-8 bytes, as this project's tiktoken encoding gives them.
- gpt2: tiktoken's ranks are the BPE's vocabulary; the merges are recovered from them (each token
  of two or more bytes is the merge of the two parts BPE reaches with lower ranks only); 50256 is
  <|endoftext|>.

A tokenizer_config.json beside it names the class, the eos token and `boost_tokenizer`, the name
an import of the folder trains on (the same ids as the file, without a file to keep).
"""
import json
from pathlib import Path

EOT = "<|endoftext|>"


def byte_chars():
    """GPT-2's byte -> printable character table: printable Latin-1 bytes are themselves, the rest
    are shifted past 255 (so no byte becomes whitespace or a control character)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


def merges_of(ranks):
    """The BPE merges that give tiktoken's `ranks` ({token bytes: rank}), in rank order: each
    token of two or more bytes is the pair that BPE, using only lower ranks, reaches last."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:   # merge the lowest-ranked adjacent pair below this token's rank
            pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append(tuple(parts))
    return merges


def write(name, enc, folder):
    """tokenizer.json and tokenizer_config.json of the named tokenizer `name` (bytes or gpt2; `enc`
    its tiktoken Encoding) in `folder` (the tokenizers package: tokenizer.write_for_hf checked)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    chars = byte_chars()

    def text(b):
        return "".join(chars[x] for x in b)
    if name == "bytes":
        vocab, merges = {chars[b]: b for b in range(256)}, []
    else:
        ranks = enc._mergeable_ranks   # (tiktoken's table: {token bytes: rank = id})
        vocab = {text(t): r for t, r in ranks.items()}
        merges = [(text(a), text(b)) for a, b in merges_of(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])   # (the next id: 256, or 50256 after gpt2's 50256 entries)
    tok.save(str(Path(folder) / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT,
              "boost_tokenizer": name}
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
