"""trainer/config/limits.py (issue 22, item 8): absurd model sizes are refused by config validation,
before anything is built of them: the trainer and its --dry-run exit 2 with one line naming the key,
at once (10^9 layers used to hang the dry run's meta build for minutes; a 10^12 hidden size or a 10^17
vocabulary escaped as torch's RuntimeError with a traceback)."""

from __future__ import annotations


import pytest

from tests.support import REPO
from tests.support.hangs import ends
from trainer.config import ConfigError, load_config
from trainer.config.limits import MAX_HIDDEN_DIM, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB

DEBUG = str(REPO / "configs" / "debug.toml")
ABSURD = [
    (["--model.n_layers", "1000000000"], "model.n_layers"),
    (["--model.hidden_dim", "1000000000000"], "model.hidden_dim"),
    (["--model.vocab_size", "100000000000000000"], "model.vocab_size"),
    (["--model.n_heads", "1000000000"], "model.n_heads"),
    (["--model.n_kv_heads", "1000000000"], "model.n_kv_heads"),
    (["--training.seq_len", str(10 ** 12)], "training.seq_len"),
]


@pytest.mark.parametrize("argv, key", ABSURD)
def test_absurd_sizes_are_config_errors(argv, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*at most"):
        load_config(argv)


def test_the_limits_are_far_above_real_models():
    """The largest published llama (405B: 16384 wide, 126 layers, 128256 tokens, 128K context) passes."""
    cfg = load_config(["--model.flavor", "70b", "--model.hidden_dim", "16384", "--model.n_layers", "126",
                       "--model.n_heads", "128", "--model.n_kv_heads", "8", "--model.vocab_size", "128256",
                       "--training.seq_len", "131072"])
    assert cfg.model.n_layers == 126
    assert (MAX_HIDDEN_DIM, MAX_LAYERS, MAX_VOCAB, MAX_SEQ_LEN) > (16384, 126, 128256, 131072)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
@pytest.mark.parametrize("argv, key", ABSURD[:3])
def test_trainer_and_dry_run_exit_2_with_one_line_at_once(argv, key, dry_run, tmp_path, capsys, monkeypatch):
    from trainer.train import main

    import trainer.model

    def never_built(*args, **kwargs):  # refused up front: no model (not even on meta) is made of it
        raise AssertionError("a model was built from an absurd config")

    monkeypatch.setattr(trainer.model.Transformer, "__init__", never_built)
    code = ends(lambda: main(["--config", DEBUG, "--job.dump_folder", str(tmp_path / "run"), *argv]
                             + (["--dry-run"] if dry_run else [])))
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and key in lines[0] and "Traceback" not in captured.err, captured.err
    assert not (tmp_path / "run").exists()  # refused before the run wrote anything
