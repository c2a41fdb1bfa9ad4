"""plumbing/__init__.py: what a run needs around BOOST's story (arXiv 2512.12131), apart from it.

The files at the repository's root tell the story (model, lax, layouts, tp_model, sharding,
parallel, local_ops, triton_kernels, recompute) and are the commands a user types (train, prepare,
interchange); what the project adds beyond the paper is extensions/. No story file imports this
package. Here:

  options      train.py's options and their checks
  plan         a run's Plan, resolved once before any work (dp, layout, device, dtype, resume)
  placement    the process group and (dp, pp, tp) mesh, and the build step: this rank's model
  rundir       the out_dir: its lock, metrics log, interrupts, profiler and TensorBoard
  faults       --inject_fault (the failures the tests provoke, as hooks) and a peer lost
  train_state  training-state checkpoints (DCP): save, verify, choose, resume
  integrity    checksums, and reading files from elsewhere as data (never code)
  pickle_scan  a checkpoint's .metadata read as an opcode stream first: no hang, no crash
  formats      the folders other tools read (Hugging Face Llama, CoLA's), written and read back
  hf_remote/   the model's code in transformers' terms, carried by an exported cola, LaX, svd folder
  heldout      interchange.py eval: a checkpoint's held-out loss, perplexity and bits per byte
  weights      safetensors files read as data, for imports
  tokenizer    bytes, GPT-2, Hugging Face tokenizer.json and SentencePiece .model
  hf_tokenizer bytes and GPT-2 written as Hugging Face tokenizer.json files (for lm-eval)
  preparation  a corpus to token files (prepare.py's work, and train.py's on first use)
  corpus       text, JSON Lines, Parquet and compressed corpora, read document by document
  data         prepared token files and the batches drawn from them
  explain      --explain=true: one recorded step, printed (notation: the names of its shapes)
  recorder     that step recorded op by op: ops, collectives (the optimizer's too), saved bytes
"""
