"""The staging sections of ``device_checks.py``: does ``DoubleBufferStager`` hold what it promises on a
real device.

* :func:`pinned`: our buffer sets are pinned (a segment and a view at an offset), our ``host_bytes``
  against the host allocator's own figure, the sets released at close; pinning 1/4/16 GiB timed.
* :func:`ordering`: ``pytest -m accelerator tests/ckpt/test_accelerator.py`` (each test's outcome
  and, for a failure, its message, from its JUnit file; the JUnit file and the tail of pytest's
  output are kept in the results folder whatever happened) and the negative control: without
  ``wait_snapshot()`` the next in-place add reaches the snapshot (a mismatch count above zero shows
  the check can see a race).
* :func:`dtensor`: DTensors of a 1-rank device mesh staged: where the staged local tensor lives,
  whether its bytes equal the state, device memory during ``stage()``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from device_setup import GIB, REPO, Context, Failed, mem_available


def host_allocated(ctx: Context) -> int | None:
    stats = getattr(ctx.accel, "host_memory_stats", None) if ctx.accel is not None else None
    try:
        return None if stats is None else int(stats().get("allocated_bytes.current", 0))
    except Exception:  # noqa: BLE001 - an allocator without stats
        return None


def pinned(ctx: Context, figures: dict) -> None:
    torch = ctx.torch
    from ckpt import DoubleBufferStager
    from ckpt.device import empty_host_cache

    empty_host_cache()
    before = host_allocated(ctx)
    stager = DoubleBufferStager(ctx.device_type)
    state = {"a": torch.randn(3 << 20, device=ctx.device), "b": torch.randn(333, 7, device=ctx.device)}
    staged = stager.stage(state).result()
    segments = [s for b in stager.sets if b.memory for s in b.memory.segments]
    figures["segments_pinned"] = all(s.is_pinned() for s in segments)
    figures["offset_view_pinned"] = staged["b"].is_pinned()
    figures["stager_host_bytes"] = stager.host_bytes
    after = host_allocated(ctx)
    if before is not None and after is not None:
        figures["allocator_allocated_bytes_delta"] = after - before
    stager.close()
    released = host_allocated(ctx)
    if released is not None and before is not None:
        figures["allocator_bytes_after_close_minus_before"] = released - before
    sizes = [1 << 20, 4 << 20, 16 << 20] if ctx.dry else [GIB, 4 * GIB, 16 * GIB]
    for size in sizes:
        if size * 2 > mem_available():
            figures[f"pin_{size >> 20}MiB_s"] = "skipped: not enough free host memory"
            continue
        start = time.perf_counter()
        block = torch.empty(size, dtype=torch.uint8, pin_memory=ctx.accel is not None)
        figures[f"pin_{size >> 20}MiB_s"] = round(time.perf_counter() - start, 4)
        del block
        empty_host_cache()
    if ctx.accel is not None and not (figures["segments_pinned"] and figures["offset_view_pinned"]):
        raise Failed("staging buffers are not pinned")
    if figures.get("allocator_allocated_bytes_delta", figures["stager_host_bytes"]) != figures["stager_host_bytes"]:
        raise Failed("our host_bytes differs from the host allocator's figure")


def ordering(ctx: Context, figures: dict) -> None:
    torch = ctx.torch
    from ckpt import DoubleBufferStager

    junit = ctx.out / "accelerator-junit.xml"
    junit.unlink(missing_ok=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "accelerator", "-p", "no:cacheprovider",
                               f"--junitxml={junit}", "tests/ckpt/test_accelerator.py"], cwd=REPO,
                              capture_output=True, text=True, timeout=max(60, min(240, ctx.left())))
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, code = f"{exc.stdout or ''}{exc.stderr or ''}\n(timed out after {exc.timeout} s)", None
    output = output if isinstance(output, str) else output.decode(errors="replace")
    (ctx.out / "accelerator-pytest.txt").write_text(output[-20000:])
    figures["pytest_exit"] = code
    figures["pytest_tail"] = output[-1500:]
    figures["tests"] = junit_outcomes(junit) if junit.exists() else {}
    # Negative control: without the wait, the next in-place add races the copy and reaches the snapshot.
    n = (1 << 16) if ctx.dry else (1 << 28)  # 1 GiB of fp32 on a device: the copy takes milliseconds
    x = torch.zeros(n, device=ctx.device)
    for waited in (True, False):
        stager = DoubleBufferStager(ctx.device_type)
        stager.stage({"x": x}).result()  # buffers allocated outside the control
        stager.wait_snapshot(host=True)
        x.zero_()
        future = stager.stage({"x": x})
        if waited:
            stager.wait_snapshot()
        x.add_(1.0)
        staged = future.result()["x"]
        stager.wait_snapshot(host=True)
        figures["mismatched_with_wait" if waited else "mismatched_without_wait_control"] = int((staged != 0).sum())
        stager.close()
    figures["control_shows_the_race"] = figures["mismatched_without_wait_control"] > 0
    failed = [name for name, outcome in figures["tests"].items() if outcome != "passed" and outcome != "skipped"]
    if code not in (0, 5) or failed or figures["mismatched_with_wait"]:
        raise Failed(f"accelerator tests failed: {failed}" if failed else
                     f"pytest exited {code}" if code not in (0, 5) else "a waited snapshot saw a later write")


def junit_outcomes(path: Path) -> dict:
    """Each test's outcome: passed, skipped, or ``failed: <its message>``."""
    import xml.etree.ElementTree as ET

    outcomes = {}
    try:
        cases = list(ET.parse(path).getroot().iter("testcase"))
    except ET.ParseError as exc:
        return {"junit": f"failed: unreadable ({exc})"}
    for case in cases:
        bad = next((child for child in case if child.tag in ("failure", "error")), None)
        skipped = any(child.tag == "skipped" for child in case)
        if bad is not None:
            outcomes[case.get("name")] = "failed: " + (bad.get("message") or bad.text or bad.tag)[:400]
        else:
            outcomes[case.get("name")] = "skipped" if skipped else "passed"
    return outcomes


def dtensor(ctx: Context, figures: dict) -> None:
    torch = ctx.torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckpt import DoubleBufferStager

    ctx.needs_group()
    mesh = init_device_mesh(ctx.device_type, (1,))
    rows = 256 if ctx.dry else 1 << 18  # 1 GiB of fp32 in two DTensors
    state = {"w": distribute_tensor(torch.randn(rows, 512, device=ctx.device), mesh, [Shard(0)]),
             "m": distribute_tensor(torch.randn(rows, 512, device=ctx.device), mesh, [Replicate()])}
    stager = DoubleBufferStager(ctx.device_type)
    stager.stage(state).result()
    stager.wait_snapshot(host=True)
    for t in state.values():
        t.to_local().add_(1.0)  # new values: stale bytes from the warm-up would not match
    ctx.sync()
    figures["state_bytes"] = sum(t.to_local().nbytes for t in state.values())
    if ctx.accel is not None:
        ctx.accel.reset_peak_memory_stats()
        before = ctx.accel.memory_allocated()
    staged = stager.stage(state)
    if ctx.accel is not None:
        figures["device_bytes_allocated_by_stage"] = ctx.accel.memory_allocated() - before
    result = staged.result()
    if ctx.accel is not None:
        figures["device_peak_bytes_over_before"] = ctx.accel.max_memory_allocated() - before
    local = result["w"].to_local()
    figures["staged_device"] = str(local.device)
    figures["staged_pinned"] = local.is_pinned()
    figures["bytes_equal"] = all(torch.equal(result[k].to_local(), state[k].to_local().cpu()) for k in state)
    stager.close()
    if not figures["bytes_equal"] or local.device.type != "cpu":
        raise Failed("a staged DTensor is not the state's bytes on the host")
    if figures.get("device_peak_bytes_over_before", 0) > figures["state_bytes"] // 8:
        raise Failed("staging allocated device memory in the order of the state")

