"""The training job the device checks time, and how a save's cost is timed on a device.

* :func:`job_model_args`: the project's llama at ~1B parameters on a device (dim 2048, 16 layers,
  16 heads, 32k vocabulary: 0.95 B, 11.4 GB of fp32 weights and AdamW moments), the debug one in a
  dry run.
* :class:`Job`: that llama under FSDP2 on a 1-rank mesh (bf16 compute through its
  ``MixedPrecisionPolicy``, fp32 master weights and AdamW moments; fp32 throughout in a dry run),
  random tokens, the trainer's chunked loss.
* :meth:`Job.timed`: ``sync; t0; [lead steps]; save(); forward/backward; before_optimizer();
  optimizer step; sync; t1``. The save's whole cost lands inside the window — its host time, the
  copy it starts and whatever the compute stream waits for — and the plain reference is the same
  call without a save, so "lost" is the difference of two windows timed alike (a device sync before
  ``t0`` alone would let the copy finish untimed). ``lead`` unsynchronised steps first put the host
  ahead of the device.
* :class:`CopyTimes`: timing events on the snapshot copy stream around every copy the engine queues
  there (the copy's own duration on the device), beside the compute stream's waits that the engine
  measures itself (``device_stall_s``). It wraps the accelerator module the copy engine is given, so
  it reaches no engine internals: :meth:`CopyTimes.stager` for a stager of our own, and
  :meth:`CopyTimes.every_stager` (the manager's) for a while.
"""

from __future__ import annotations

import contextlib
import gc
import time

from device_setup import Context


def job_model_args(ctx: Context):
    """~1B parameters on a device (dim 2048, 16 layers, 32k vocabulary), the debug llama in a dry run."""
    from trainer import model as model_mod

    if ctx.dry:
        return model_mod.model_args("debug", max_seq_len=128)
    return model_mod.ModelArgs(dim=2048, n_layers=16, n_heads=16, vocab_size=32000, max_seq_len=2048)


class Job:
    """The llama under FSDP2 (1 rank) with AdamW on random tokens; ``optimizer`` builds another
    optimizer over the model's parameters (torchtitan's container, say)."""

    def __init__(self, ctx: Context, seed: int = 0, batch: int | None = None):
        torch = ctx.torch
        from torch.distributed.device_mesh import init_device_mesh

        from trainer import model as model_mod
        from trainer.parallel import apply_fsdp

        ctx.needs_group()
        gc.collect()  # an earlier section's job (FSDP modules hold reference cycles) leaves the device first
        if ctx.accel is not None:
            ctx.accel.empty_cache()
        self.ctx = ctx
        self.args = job_model_args(ctx)
        self.batch, self.seq = (2, 64) if ctx.dry else (batch or 4, 2048)
        torch.manual_seed(seed)
        with torch.device(ctx.device):
            model = model_mod.build(self.args)
        model.loss_chunk_len = 1024  # the trainer's default: the logits never whole
        mesh = init_device_mesh(ctx.device_type, (1,))
        self.model = apply_fsdp(model, mesh, reshard_after_forward=True, precision="fp32" if ctx.dry else "bf16")
        self.opt = self.adamw()
        tokens = torch.randint(0, self.args.vocab_size, (self.batch, self.seq + 1), device=ctx.device)
        self.inputs, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self.params = model_mod.num_params(self.model)
        self.tokens_per_step = self.batch * self.seq
        self.flops_per_token = model_mod.flops_per_token(self.args, self.seq)

    def adamw(self):
        return self.ctx.torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def forward_backward(self):
        loss = self.model(self.inputs, self.labels)
        loss.backward()
        return loss

    def optimizer_step(self, before=None) -> None:
        if before is not None:
            before()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, before_optimizer=None):
        loss = self.forward_backward()
        self.optimizer_step(before_optimizer)
        return loss

    def state(self) -> dict:
        return {"model": self.model, "optim": self.opt}

    def timed(self, save=None, before_optimizer=None, lead: int = 0) -> tuple[float, float]:
        """Seconds of the window (see the module docstring) and the host seconds inside ``save()``."""
        self.ctx.sync()
        start = time.perf_counter()
        for _ in range(lead):
            self.step()
        call = 0.0
        if save is not None:
            call = time.perf_counter()
            save()
            call = time.perf_counter() - call
        self.step(before_optimizer)
        self.ctx.sync()
        return time.perf_counter() - start, call


class StreamEvents:
    """The accelerator module as a copy engine sees it, with a pair of timing events recorded on a
    stream around each ``with accel.stream(s):`` block (the engine's copies on its side stream)."""

    def __init__(self, accel, spans: list):
        self._accel, self._spans = accel, spans

    def __getattr__(self, name):
        return getattr(self._accel, name)

    @contextlib.contextmanager
    def stream(self, stream):
        start, end = self._accel.Event(enable_timing=True), self._accel.Event(enable_timing=True)
        with self._accel.stream(stream):
            start.record(stream)
            yield
            end.record(stream)
        self._spans.append((start, end))


class CopyTimes:
    """Device milliseconds of the snapshot copies, read from events on the copy stream."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.spans: list = []

    def engine(self, base):
        """A copy engine class like ``base`` whose side-stream copies are timed into this."""
        spans = self.spans

        class TimedCopy(base):
            def __init__(self, accel):
                super().__init__(None if accel is None else StreamEvents(accel, spans))

        return TimedCopy

    def stager(self, *args, **kwargs):
        from ckpt import DoubleBufferStager

        timed = type("TimedStager", (DoubleBufferStager,), {"copy_engine": self.engine(DoubleBufferStager.copy_engine)})
        return timed(*args, **kwargs)

    @contextlib.contextmanager
    def every_stager(self):
        """Stagers made meanwhile (a manager's) time their copies."""
        from ckpt import DoubleBufferStager

        original = DoubleBufferStager.copy_engine
        DoubleBufferStager.copy_engine = self.engine(original)
        try:
            yield self
        finally:
            DoubleBufferStager.copy_engine = original

    def take_ms(self) -> float:
        """The copies recorded since the last call (waits for the device)."""
        self.ctx.sync()
        spans, self.spans[:] = list(self.spans), []
        return sum(start.elapsed_time(end) for start, end in spans)
