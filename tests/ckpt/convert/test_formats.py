"""ckpt.convert.formats: the streamed torch.save zip — a write failing inside torch's zip writer (a full
disk) surfaces as itself and the process lives on."""

from __future__ import annotations

import errno

import pytest
import torch

from ckpt.convert import TensorSpec, TorchZipWriter


def test_a_failed_write_inside_the_torch_zip_writer_surfaces_as_itself():
    # (an exception thrown into PyTorchFileWriter would make its destructor abort the process)
    tensor = torch.randn(5, 3)
    one = [TensorSpec("model.a", torch.float32, (5, 3))]
    sizes = []
    whole = TorchZipWriter(lambda data: sizes.append(len(data)), one)
    whole.add(0, tensor)
    whole.finish()
    for budget in (10, sum(sizes) // 2, sum(sizes) - 30):  # in the pickle, a storage record, the end records
        written_bytes = [0]

        def full_disk(data, budget=budget):
            written_bytes[0] += len(data)
            if written_bytes[0] > budget:
                raise OSError(errno.ENOSPC, "No space left on device")

        with pytest.raises(OSError, match="No space"):
            archive = TorchZipWriter(full_disk, one)
            archive.add(0, tensor)
            archive.finish()
        archive = None
