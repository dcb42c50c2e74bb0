"""trainer/hf/run.py: the model arguments a trainer run built, rebuilt from the config it recorded."""

from __future__ import annotations

from trainer.hf.run import args_from_run_config


def test_args_from_a_run_config():
    from trainer.config import Config

    cfg = Config()
    cfg.model.n_layers, cfg.training.seq_len = 2, 4096
    d = cfg.to_dict()
    d["checkpoint"]["a_key_of_another_trainer_version"] = 1  # only model and training.seq_len are read
    args = args_from_run_config(d, vocab_size=300)
    assert (args.n_layers, args.vocab_size, args.max_seq_len, args.dim) == (2, 300, 4096, 128)
