"""The largest model shapes anything here builds: a configuration (or an imported model's config)
beyond them is refused before a module, a meta tensor or a memory plan is made of it.

Contract: constants only, each far above every published llama (Llama 3.1 405B: hidden 16384,
126 layers, 128 query heads, FFN 53248, vocabulary 128256, 128K context; the largest vocabularies
in use are ~256K, the longest contexts ~10M) and far below what hangs or overflows: 10^6 layers
take minutes even on the meta device, a 10^12-wide matrix overflows torch's storage size. Both
:mod:`trainer.config.validate` and :mod:`trainer.hf` (a Hugging Face ``config.json``) check them.
"""

from __future__ import annotations

MAX_HIDDEN_DIM = 1 << 16  # 65536: 4x Llama 405B's
MAX_LAYERS = 1024  # 8x Llama 405B's; a meta build of this many blocks takes ~10 s
MAX_HEADS = 1 << 12  # query and key/value heads
MAX_FFN_DIM = 1 << 20  # the SwiGLU width (intermediate_size)
MAX_VOCAB = 1 << 24  # 16.7M rows: 64x the largest vocabularies in use
MAX_SEQ_LEN = 1 << 24  # positions (max_position_embeddings, training.seq_len)

MODEL_LIMITS = {"hidden_dim": MAX_HIDDEN_DIM, "n_layers": MAX_LAYERS, "n_heads": MAX_HEADS,
                "n_kv_heads": MAX_HEADS, "vocab_size": MAX_VOCAB, "ffn_dim": MAX_FFN_DIM, "moe_ffn_dim": MAX_FFN_DIM,
                "max_seq_len": MAX_SEQ_LEN, "rope_original_max_positions": MAX_SEQ_LEN}
"""The trainer's ``model`` section keys and their upper bounds."""
