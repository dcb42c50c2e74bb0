"""trainer/config/load.py: the defaults, and a Config through its dict and back."""

from __future__ import annotations


from tests.support import REPO
from trainer.config import Config, load_config

CONFIGS = REPO / "configs"


def test_defaults():
    cfg = load_config([])
    assert cfg == Config()
    assert cfg.training.steps == 100 and cfg.training.batch_size == 8 and cfg.training.lr == 3e-4
    assert cfg.parallelism.dp_shard == -1 and cfg.optimization.zero_stage == 3
    assert cfg.checkpoint.async_mode == "double_buffer" and cfg.checkpoint.load_step is None


def test_to_dict_round_trip():
    cfg = load_config(["--config", str(CONFIGS / "seed_70b.yaml")])
    d = cfg.to_dict()
    assert d["parallelism"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 4, "pp": 4, "cp": 1, "pp_schedule": "1f1b",
                                "pp_microbatches": None, "pp_virtual_stages": 1, "ep": 1}
    assert d["model"]["flavor"] == "70B" and "size" not in d["model"]
    assert set(d) == {"job", "model", "training", "parallelism", "optimization", "checkpoint", "metrics"}
    assert Config.from_dict(d) == cfg
