"""docs/ADOPTING.md's snippets, run as written against the installed packages.

Every ``python`` block of the page is taken from the page itself (:func:`snippets`) and executed in a
fresh folder, with only the names the page leaves to the reader supplied (``model``, ``data``,
``build_model``, ...: tiny ones here). A snippet that no test runs fails
:func:`test_every_python_snippet_is_run`. The sizes in the snippets are the page's (``interval=500``,
``every_n_train_steps=500``): the quick tests run few steps (the snippet runs, its plug-in is in place,
a resume goes through it), the ``slow`` ones enough steps for the snippet's own saves and a restart.
The torchtitan blocks are ``bash`` command lines of a torchrun job over torchtitan's own models, not
run here (tests/integrations/test_torchtitan.py runs that flow).

"A trainer that already calls DCP" also runs on 2 gloo ranks: our Writer and DoubleBufferStager under
plain ``dcp.async_save`` on a gloo group of its own, a load through our Reader with the strict
SafeLoadPlanner (rank-local keys accepted), and the caveats the page states: a value every rank saves
under one key is stored once, and a committed step is never written over.
"""

from __future__ import annotations

import os
import re
import types
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
from tests.support.launch import run_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "ADOPTING.md"
PLAIN, DCP, LIGHTNING, HF, ACCELERATE, DEEPSPEED = (
    "A plain PyTorch loop", "A trainer that already calls DCP", "PyTorch Lightning",
    "Hugging Face Trainer and accelerate", "Hugging Face Trainer and accelerate #2", "DeepSpeed")


def snippets() -> dict[str, str]:
    """The page's python blocks by section title (without its parenthesis; a second block: ``#2``)."""
    found: dict[str, str] = {}
    section = ""
    for part in re.split(r"^(## .*)$", DOC.read_text(), flags=re.M):
        if part.startswith("## "):
            section = part[3:].split(" (")[0].strip()
            continue
        for number, code in enumerate(re.findall(r"^```python\n(.*?)^```", part, flags=re.S | re.M), 1):
            found[section if number == 1 else f"{section} #{number}"] = code
    return found


def run_snippet(name: str, **names) -> dict:
    """Execute the snippet as written, with the reader's ``names``; its namespace afterwards."""
    namespace = dict(names)
    exec(compile(snippets()[name], f"ADOPTING.md: {name}", "exec"), namespace)
    return namespace


def test_every_python_snippet_is_run():
    assert set(snippets()) == {PLAIN, DCP, LIGHTNING, HF, ACCELERATE, DEEPSPEED}


# -- a plain PyTorch loop ---------------------------------------------------------------------------------
class _LossModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        return types.SimpleNamespace(loss=self.linear(x).pow(2).mean())


def _plain_loop(total_steps: int) -> dict:
    batches = iter(torch.randn(total_steps, 2, 4, generator=torch.Generator().manual_seed(1)))
    return run_snippet(PLAIN, build_model=_LossModel, next_batch=lambda: next(batches), batch_size=2,
                       total_steps=total_steps)


def test_the_plain_loop_snippet_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _plain_loop(3)
    assert run["start"] == 0 and run["loader_state"] == {"position": 6}
    assert os.path.isdir("ckpts")


@pytest.mark.slow
def test_the_plain_loop_snippet_saves_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = _plain_loop(1000)  # saves at 500 and 1000
    assert sorted(n for n in os.listdir("ckpts") if n.startswith("step-")) == ["step-00000500", "step-00001000"]
    again = _plain_loop(1000)
    assert again["start"] == 1000 and again["loader_state"] == {"position": 2000}
    for key, value in first["model"].state_dict().items():
        assert torch.equal(value, again["model"].state_dict()[key]), key


# -- a trainer that already calls DCP ---------------------------------------------------------------------
def _dcp_trainer(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    page = run_snippet(DCP)  # checkpoint_pg, stager, save, before_optimizer_step, load
    weight = torch.full((4, 4), float(rank))  # each rank's own tensor, under a rank-named key
    state = {f"weight_rank{rank}": weight, "shared": torch.arange(6.0), "same_key": torch.tensor([rank]),
             f"loader.dp_rank_{rank}": {"position": 10 + rank}}
    response = page["save"](state, f"{root}/step-1")
    page["before_optimizer_step"]()          # the live tensors may change now
    weight.add_(100.0)
    response.upload_completion.result()
    try:  # a committed step is never written over (a restarted trainer must resume, not save again)
        dcp.save(state, storage_writer=ckpt.dcp.Writer(f"{root}/step-1"), process_group=page["checkpoint_pg"])
        exists = False
    except CheckpointException as exc:  # DCP's wrapper (a BaseException) around each rank's error
        exists = any(isinstance(error, ckpt.CheckpointExistsError) for error, _ in exc.failures.values())

    live = {f"weight_rank{rank}": torch.zeros(4, 4), "shared": torch.zeros(6), "same_key": torch.tensor([-1]),
            f"loader.dp_rank_{rank}": {"position": -1}}
    page["load"](live, f"{root}/step-1")
    page["stager"].close()
    return {"weight": live[f"weight_rank{rank}"][0, 0].item(), "shared": torch.equal(live["shared"], torch.arange(6.0)),
            "same_key": live["same_key"].item(), "position": live[f"loader.dp_rank_{rank}"]["position"],
            "exists": exists}


def _check_dcp_trainer(results: list) -> None:
    for rank, result in enumerate(results):
        assert result["weight"] == float(rank)          # the snapshot, not the tensor changed after it
        assert result["shared"] and result["position"] == 10 + rank
        assert result["exists"]
    same = [r["same_key"] for r in results]
    assert len(set(same)) == 1 and same[0] in range(len(results))  # one rank's copy of a per-rank value


def test_the_dcp_snippet_runs_on_one_rank(tmp_path):
    _check_dcp_trainer(run_ranks(1, _dcp_trainer, str(tmp_path)))


@pytest.mark.slow
def test_a_dcp_calling_trainer_on_two_ranks(tmp_path):
    _check_dcp_trainer(run_ranks(2, _dcp_trainer, str(tmp_path)))


# -- PyTorch Lightning --------------------------------------------------------------------------------------
def _lightning_model(stop_after: int | None):
    from tests.support.lightning_runs import TinyModule

    class Model(TinyModule):
        """One batch an epoch (the Trainer's default 1000 epochs are 1000 steps); stops after
        ``stop_after`` more steps when given."""

        def train_dataloader(self):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

        def on_train_start(self):
            self.stop_at = None if stop_after is None else self.trainer.global_step + stop_after

        def on_train_batch_end(self, *args):
            if self.stop_at is not None and self.trainer.global_step >= self.stop_at:
                self.trainer.should_stop = True

    return Model()


@pytest.mark.filterwarnings("ignore::UserWarning:lightning", "ignore::FutureWarning")
def test_the_lightning_snippet_runs_and_resumes_through_the_plugin(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    from ckpt.integrations.lightning import CkptCheckpointIO

    monkeypatch.chdir(tmp_path)
    first = run_snippet(LIGHTNING, model=_lightning_model(stop_after=2))  # no ModelCheckpoint error (monitor)
    trainer = first["trainer"]
    assert trainer.global_step == 2 and isinstance(trainer.strategy.checkpoint_io, CkptCheckpointIO)
    trainer.save_checkpoint("ckpts/last.ckpt")  # through the snippet's plug-in (its saves come every 500 steps)
    trainer.strategy.checkpoint_io.teardown()  # the write done (fit's own teardown has passed)
    assert ckpt.read_manifest("ckpts/last.ckpt").step == 2
    again = run_snippet(LIGHTNING, model=_lightning_model(stop_after=1))
    assert again["trainer"].global_step == 3  # resumed at step 2 from ckpt_path="last"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning:lightning", "ignore::FutureWarning")
def test_the_lightning_snippet_saves_and_resumes_at_its_own_steps(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    first = run_snippet(LIGHTNING, model=_lightning_model(stop_after=None))  # 1000 steps, saves at 500 and 1000
    assert sorted(os.listdir("ckpts")) == ["epoch=499-step=500.ckpt", "epoch=999-step=1000.ckpt", "last.ckpt"]
    again = run_snippet(LIGHTNING, model=_lightning_model(stop_after=None))
    assert again["trainer"].global_step == 1000  # resumed at the end: nothing left to train
    for key, value in first["model"].state_dict().items():
        assert torch.equal(value, again["model"].state_dict()[key]), key


# -- Hugging Face Trainer and accelerate ------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_the_hf_trainer_snippet_saves_and_resumes(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from tests.support.hf_runs import Tokens, tiny_llama

    monkeypatch.chdir(tmp_path)
    # 8 samples, the Trainer's default batch of 8 and 3 epochs: 3 steps; "steps" saves at the end.
    first = run_snippet(HF, model=tiny_llama(), data=Tokens(n=8))
    assert first["trainer"].state.global_step == 3
    assert ckpt.read_manifest(tmp_path / "out" / "ckpt" / "step-00000003").step == 3
    assert (tmp_path / "out" / "checkpoint-3" / "trainer_state.json").is_file()
    again = run_snippet(HF, model=tiny_llama(), data=Tokens(n=8))  # resumes from out/checkpoint-3
    assert again["trainer"].state.global_step == 3
    for key, value in first["model"].state_dict().items():
        assert torch.equal(value, again["model"].state_dict()[key]), key


def test_the_accelerate_snippet_saves_and_loads_the_weights_through_the_engine(tmp_path, monkeypatch):
    accelerate = pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    accelerator = accelerate.Accelerator(cpu=True)
    model = accelerator.prepare(_LossModel())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    run_snippet(ACCELERATE, accelerator=accelerator)
    assert ckpt.read_manifest(tmp_path / "state" / "ckpt_model").kind == "full"
    for key, value in saved.items():
        assert torch.equal(value, model.state_dict()[key]), key


# -- DeepSpeed -------------------------------------------------------------------------------------------------
def _deepspeed_snippet(rank: int, world: int) -> dict:
    from tests.support.deepspeed_runs import config, model  # sets DS_ACCELERATOR=cpu before deepspeed loads

    net = model()
    page = run_snippet(DEEPSPEED, model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2),
                       config=config(1))
    return {"engine": type(page["engine"].checkpoint_engine).__name__, "step": page["engine"].global_steps}


@pytest.mark.slow
def test_the_deepspeed_snippet_runs_on_one_rank(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.chdir(tmp_path)
    result = run_ranks(1, _deepspeed_snippet)[0]
    assert result["engine"] == "CkptCheckpointEngine" and result["step"] == 0
    (tag,) = [path.name for path in (tmp_path / "ckpts").iterdir() if path.is_dir()]
    assert (tmp_path / "ckpts" / "latest").read_text() == tag  # committed by destroy()
    assert all((tmp_path / "ckpts" / tag / name / "manifest.json").is_file()
               for name in os.listdir(tmp_path / "ckpts" / tag))
