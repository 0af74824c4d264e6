"""Model patches that the estimate traces and train/ runs, one copy for both: Liger kernels as the HF Trainer's
use_liger_kernel applies them, with pure-torch substitutes the tracer can run (liger), ALST's tiled MLP and tiled
logits + loss (tiling), torchtune's chunked cross-entropy (chunkedce), the LM-head helpers they share (lmhead), and
the Dynamo setting that keeps checkpointed layers inside a compiled graph (compiledckpt).
They stand below estimate/ and train/ (tests/test_layout.py), so both import them downward."""
