"""prepare.py: the command that tokenises a corpus into token files (train.py does it on first use).

Not part of the BOOST paper (arXiv 2512.12131); what a pretraining run needs before its first step.

    python prepare.py --dataset=path/to/corpus --tokenizer=gpt2 [--data_dir=data --num_proc=N
                      --val_fraction=0.1 --text_field=text]

The work is plumbing/preparation.py's: streaming, in parallel, published by renaming, never
half-used; this file reads the options and says where the files are.
"""
import sys

from plumbing import data
from plumbing.preparation import prepare

def main(argv):
    parser = data.CommandParser(prog="prepare.py",
                                description="Tokenise a corpus into <data_dir>/<name>-<tokenizer>/ "
                                "(train.py does this on first use; the option names are "
                                "train.py's).")
    parser.add_argument("--dataset", required=True,
                        help="a text, .jsonl or .gz file, or a folder of them, or 'pydoc'")
    parser.add_argument("--tokenizer", default="bytes",
                        help="bytes, gpt2, or a tokenizer.json, a SentencePiece "
                        ".model or a folder holding one")
    parser.add_argument("--data_dir", default="data")
    parser.add_argument("--num_proc", type=int, default=0,
                        help="worker processes (default: every CPU)")
    parser.add_argument("--val_fraction", type=float, default=0.1)
    parser.add_argument("--text_field", default="text",
                        help="the field of a JSON line that holds its text")
    args = parser.parse_args(argv)
    try:
        folder = prepare(args.dataset, args.tokenizer, args.data_dir, args.num_proc,
                         args.val_fraction,
                         args.text_field)
    except ValueError as e:
        parser.error(str(e))
    print(f"data: ready in {folder}")


if __name__ == "__main__":
    main(sys.argv[1:])
