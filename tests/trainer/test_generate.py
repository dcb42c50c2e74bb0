"""trainer.generate: a checkpoint sampled without converting it; greedy decoding equals what
transformers' own ``generate`` does with the HF export of the same step."""

from __future__ import annotations

import pytest
import torch

from tests.support.trainer_runs import run_trainer, trainer_args

pytestmark = pytest.mark.slow  # a trainer run first


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    run_trainer(trainer_args(str(folder), steps=10))
    return folder / "checkpoints"


def test_greedy_sampling_matches_transformers_on_the_export(checkpoints, tmp_path):
    transformers = pytest.importorskip("transformers")
    from trainer.generate import load_model, run_tokenizer, sample
    from trainer.hf import export_hf

    model, config, path = load_model(str(checkpoints))
    assert path.path.endswith("step-00000010")  # the newest committed step
    tokenizer = run_tokenizer(config, None)
    prompt = tokenizer.encode("def main(", bos=True, eos=False)
    ours = sample(model, prompt, max_new_tokens=12, temperature=0, top_k=None, eos_id=None,
                  generator=torch.Generator().manual_seed(0))
    export_hf(path, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=12)[0].tolist()
    assert ours == theirs


def test_the_cli_prints_the_prompt_continued(checkpoints, capsys):
    from trainer.generate import main

    assert main(["--checkpoint", str(checkpoints), "--step", "10", "--prompt", "import ", "--max-new-tokens", "16",
                 "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("import ") and len(first) > len("import \n")
    assert main(["--checkpoint", str(checkpoints), "--prompt", "import ", "--max-new-tokens", "16", "--seed", "3"]) == 0
    assert capsys.readouterr().out == first  # seeded: the same sample again
    assert main(["--checkpoint", str(checkpoints), "--step", "7", "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("trainer.generate: error:") and err.count("\n") == 1 and "10" in err
